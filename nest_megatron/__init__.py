"""nest-megatron: network- and memory-aware parallelism planning for Megatron-LM (the NEST method)."""

__version__ = "0.1.0"
