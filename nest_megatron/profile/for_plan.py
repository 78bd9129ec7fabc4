"""Which compute model a plan uses: the one fitted from the profile cache when it holds profiles
of the plan's accelerator, measured on a GPU of that accelerator, else the accelerator's roofline;
and the line that says which."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from nest_megatron.config.schema import RootConfig
from nest_megatron.cost.problem import Problem
from nest_megatron.errors import NestError
from nest_megatron.profile.cache import Cache, Entry, cache_path
from nest_megatron.profile.fit import fit

# Profiles shipped with the package (scripts/validate_on_gpu.sh writes them), one file per accelerator.
SHIPPED = Path(__file__).resolve().parent / "shipped"

# Substrings of torch's device names -> the accelerator config that describes that GPU.
GPU_ACCELERATORS = {"H100": "h100_sxm", "H200": "h200", "A100": "a100_80gb", "B200": "b200"}


def accelerator_of_device(device: str) -> str | None:
    """The accelerator config of torch's device name ("NVIDIA H100 80GB HBM3" -> h100_sxm); None when unknown."""
    return next((acc for key, acc in GPU_ACCELERATORS.items() if key in device), None)


def measured_elsewhere(entry: Entry, accelerator: str) -> bool:
    """Whether `entry` was timed on something other than a GPU of `accelerator`: the CPU, or a GPU
    known to be another accelerator (a GPU no config names is trusted as the one it was profiled as)."""
    detected = accelerator_of_device(entry.device)
    return entry.device == "cpu" or (detected is not None and detected != accelerator)


def profiled_problem(problem: Problem, config: RootConfig) -> tuple[Problem, str]:
    """`problem` priced with the fitted compute model where profiles exist, and a one-line note."""
    name = problem.accelerator.name
    if not config.profile.use:
        return problem, "roofline with the shipped efficiencies (profile.use=false)"
    path = cache_path(config.cache)
    if config.cache and not path.exists():
        raise NestError(f"cache={config.cache}: no such profile cache; run nest-megatron profile cache={config.cache}")
    source = path
    entries, ignored = _usable(Cache.load(path).select(accelerator=name), name, config.profile.allow_cpu)
    if not entries and not config.cache and (SHIPPED / f"{name}.json").exists():
        # The user's own cache holds none that may price this accelerator (perhaps CPU ones): the shipped profile.
        source = SHIPPED / f"{name}.json"
        entries, _ = _usable(Cache.load(source).select(accelerator=name), name, config.profile.allow_cpu)
    skipped = ""
    if ignored:
        devices = ", ".join(sorted({e.device for e in ignored}))
        hint = "; profile.allow_cpu=true uses them" if all(e.device == "cpu" for e in ignored) else ""
        skipped = f"{len(ignored)} profiles of {name} in {path} were measured on {devices}{hint}"
    if not entries:
        reason = skipped or f"no profiles of {name} in {path}; nest-megatron profile measures them"
        return problem, f"roofline with the shipped efficiencies ({reason})"
    result = fit(entries, problem.accelerator)
    note = f"fitted from {len(entries)} profiles in {source}: {result.summary()}"
    if ignored:
        note += f" (not used: {skipped})"
    return dataclasses.replace(problem, compute=result.compute), note


def _usable(entries: list[Entry], accelerator: str, allow_cpu: bool) -> tuple[list[Entry], list[Entry]]:
    """(entries that may price `accelerator`, entries measured elsewhere that may not)."""
    usable, ignored = [], []
    for e in entries:
        foreign = measured_elsewhere(e, accelerator) and not (allow_cpu and e.device == "cpu")
        (ignored if foreign else usable).append(e)
    return usable, ignored
