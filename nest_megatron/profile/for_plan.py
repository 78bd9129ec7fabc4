"""Which compute model a plan uses: the one fitted from the profile cache when it holds profiles
of the plan's accelerator, else the accelerator's roofline; and the line that says which."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from nest_megatron.config.schema import RootConfig
from nest_megatron.cost.problem import Problem
from nest_megatron.errors import NestError
from nest_megatron.profile.cache import Cache, cache_path
from nest_megatron.profile.fit import fit

# Profiles shipped with the package (scripts/validate_on_gpu.sh writes them), one file per accelerator.
SHIPPED = Path(__file__).resolve().parent / "shipped"


def profiled_problem(problem: Problem, config: RootConfig) -> tuple[Problem, str]:
    """`problem` priced with the fitted compute model where profiles exist, and a one-line note."""
    name = problem.accelerator.name
    if not config.profile.use:
        return problem, "roofline with the shipped efficiencies (profile.use=false)"
    path = cache_path(config.cache)
    if config.cache and not path.exists():
        raise NestError(f"cache={config.cache}: no such profile cache; run nest-megatron profile cache={config.cache}")
    entries = Cache.load(path).select(accelerator=name)
    source = path
    if not entries and not config.cache and (SHIPPED / f"{name}.json").exists():
        source = SHIPPED / f"{name}.json"
        entries = Cache.load(source).select(accelerator=name)
    if not entries:
        return problem, (f"roofline with the shipped efficiencies (no profiles of {name} in {path}; "
                         "nest-megatron profile measures them)")
    result = fit(entries, problem.accelerator)
    return dataclasses.replace(problem, compute=result.compute), f"fitted from {len(entries)} profiles in {source}: {result.summary()}"
