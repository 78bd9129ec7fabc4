"""Timing one call: CUDA events on a GPU, the wall clock on a CPU; warm-up runs, then the median."""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable

import torch


def median_seconds(fn: Callable[[], object], *, device: torch.device, warmup: int, repeats: int,
                   before: Callable[[], object] | None = None) -> float:
    """Median time of `fn()` over `repeats` runs after `warmup` untimed ones. `before` runs
    untimed ahead of each run (a barrier that lines up the ranks of a group)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if before:
            before()
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize(device)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            start_s = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start_s)
    return statistics.median(times)


def local_device() -> torch.device:
    """The device this process profiles on: its LOCAL_RANK's GPU, or the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    found = {"torch": torch.__version__, "cuda": torch.version.cuda}
    for package in ("megatron-core", "nest-megatron", "transformer-engine"):
        try:
            found[package] = version(package)
        except PackageNotFoundError:
            pass
    return found
