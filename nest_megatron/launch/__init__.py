"""Launching a plan: argv rewrite, rank placement on hosts, torchrun, and the CPU runtime of the example."""
