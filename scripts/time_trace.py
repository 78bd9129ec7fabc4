#!/usr/bin/env python
"""Time and peak memory of tracing a model on the meta device (target for llama3_70b: under 30 s
and under 2 GiB of RAM on a 2-core CPU).

    taskset -c 0,1 .venv/bin/python scripts/time_trace.py [--model llama3_70b] [--tp 1] [--layers N]

Prints the import time (torch, megatron-core), the trace time (build all layers on meta, one
forward pass with FlopCounterMode, saved-tensor hooks and the module tracker) and the process's
peak resident memory (getrusage ru_maxrss), and the parameter count as a check.
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import time

START = time.perf_counter()
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama3_70b")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--layers", type=int, default=None, help="build only this many layers (default: all)")
    args = parser.parse_args()

    from nest_megatron.config.load import load
    from nest_megatron.trace.cpu_megatron import prepare_cpu_megatron
    from nest_megatron.trace.meta import trace_megatron

    cfg = load([f"model={args.model}"]).config.model
    prepare_cpu_megatron()  # imports megatron-core
    imported = time.perf_counter()
    graph = trace_megatron(cfg, tp=args.tp, num_layers=args.layers)
    traced = time.perf_counter()
    peak_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 2**30  # ru_maxrss is KiB on Linux
    cores = len(os.sched_getaffinity(0))
    params = sum(layer.params for layer in graph.layers)
    print(f"{args.model} tp={args.tp}: {len(graph.layers) - 2} layers, {params:,} parameters on this rank; "
          f"{cores} CPU cores")
    print(f"imports {imported - START:.1f} s  trace {traced - imported:.1f} s  total {traced - START:.1f} s  "
          f"peak RSS {peak_gib:.2f} GiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
