"""Activation offloading to host memory (--cpu-offloading-num-layers n): what the copies cost the step.

megatron-core runs each decoder layer inside Transformer Engine's CPU offload context (transformer_block.py
get_cpu_offload_context(cpu_offloading, cpu_offloading_num_layers, num_layers, ...), megatron-core 0.16.1), and
Transformer Engine's default synchroniser (pytorch/cpu_offload.py DefaultOffloadSynchronizer:586-630 at v2.12)
offloads layers 0 .. n - 1 of the L layers:
- forward: layer i's saved tensors (those of 256k elements or more, :443: every activation of a training-sized
  layer) are copied to pinned host memory on a side stream once its forward ends, one layer after another; the
  forward of layer L - n + i waits for layer i's copy, so that at most L - n layers' activations stay on the device;
- backward: the copy back of layer i starts before the backward of layer L - 1 - n + i, and layer i's backward waits
  for it.
The copies run beside the computation at the device's link to host memory (accelerator.host_link_gb_per_s, per
direction); the step sees what the computation cannot cover. `exposed_offload_time` plays that schedule out layer by
layer for one micro-batch. Left out: the copies' share of HBM bandwidth. The pinned host memory they fill:
evaluate.pinned_host_bytes.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from nest_megatron.cost.tables import LayerCosts
from nest_megatron.hardware.accelerator import Accelerator


def why_not_offloaded(accelerator: Accelerator, *, cuda_graphs: bool) -> str | None:
    """Why a run cannot offload activations, or None: it needs a known link to host memory, to price the copies
    over, and a known host memory, for their pinned buffers (evaluate.pinned_host_bytes); megatron-core refuses it
    under per-layer CUDA graphs (transformer_config.py:2798-2801 at d98e8a6). A pinned offload's one line
    (config/load.py), and why the search tries none (solver/space.py)."""
    if accelerator.host_link_bandwidth is None:
        return (f"accelerator {accelerator.name} gives no accelerator.host_link_gb_per_s, the bandwidth the offloaded "
                "activations are copied at")
    if accelerator.host_memory_bytes is None:
        return (f"accelerator {accelerator.name} gives no accelerator.host_memory_gib, the host memory per device the "
                "offloaded activations must fit")
    if cuda_graphs:
        return "megatron-core refuses it with train.cuda_graphs=true (per-layer CUDA graphs); drop one"
    return None


@lru_cache(maxsize=1024)
def offload_waits(costs: LayerCosts, offloaded: int, bandwidth: float) -> tuple[float, float]:
    """`exposed_offload_time` of a pipeline rank that holds every layer of `costs` (megatron-core offloads only at
    pp 1), once per configuration: the DP prices its one stage many times."""
    return exposed_offload_time(np.diff(costs.fwd), np.diff(costs.bwd), np.diff(costs.act_kept), offloaded=offloaded,
                                bandwidth=bandwidth)


def exposed_offload_time(fwd: np.ndarray, bwd: np.ndarray, saved_bytes: np.ndarray, *, offloaded: int,
                         bandwidth: float) -> tuple[float, float]:
    """(forward, backward) seconds one micro-batch waits for the copies, of layers whose forward and backward take
    `fwd[l]`, `bwd[l]` seconds and save `saved_bytes[l]`, the first `offloaded` of them offloaded."""
    layers = len(fwd)
    copy = np.asarray(saved_bytes[:offloaded], dtype=float) / bandwidth
    # forward: layer j may start once the copy of layer j - (L - n) is done; layer j's own copy starts after it
    clock = stream = 0.0
    copied = np.zeros(offloaded)
    for j in range(layers):
        due = j - (layers - offloaded)
        if 0 <= due < offloaded:
            clock = max(clock, copied[due])
        clock += fwd[j]
        if j < offloaded:
            stream = copied[j] = max(stream, clock) + copy[j]
    forward = clock - float(np.sum(fwd))
    # backward, layers L - 1 .. 0: before layer k, the copy back of layer k - (L - 1 - n) starts; layer k < n waits
    # for its own
    clock = stream = 0.0
    reloaded = np.zeros(offloaded)
    for k in range(layers - 1, -1, -1):
        starts = k - (layers - 1 - offloaded)
        if 0 <= starts < offloaded:
            stream = reloaded[starts] = max(stream, clock) + copy[starts]
        if k < offloaded:
            clock = max(clock, reloaded[k])
        clock += bwd[k]
    return forward, clock - float(np.sum(bwd))
