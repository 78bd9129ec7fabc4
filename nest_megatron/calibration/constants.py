"""The cost model's fittable constants: a registry of name -> where the constant lives, its unit, bounds and scale.

A calibration (`nest-megatron calibrate`) fits some of these to measured runs and writes them into a profile by
name; `with_values` puts a profile's values back into a Problem, so that the one cost model prices with them.
Everything else the cost model uses (peaks, bandwidths, tile shapes, the schedule) is a datasheet or a derivation
and is never fitted.

To add a constant (a host-overhead model's cost per operator, an FP8 cast efficiency, ...): give it a field where
the cost model reads it (an Accelerator field, a Problem field), then one `Constant` entry here with how to read
and replace it. The fitter (calibration/fit.py), the profile (calibration/profile.py) and `calibrate` take every
entry of `CONSTANTS` that `applies` to a run's problem; none of them names a constant.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from nest_megatron.cost.problem import Problem

MAX_LEVELS = 8  # network levels a calibration can hold an efficiency for (the shipped clusters have 2-4)


@dataclass(frozen=True)
class Constant:
    """One fittable constant, in the unit a profile writes it (its value in SI units is the cost model's)."""

    name: str  # the profile's key
    unit: str
    bounds: tuple[float, float]  # what is physical, in `unit`; a fit stays inside
    scale: float  # the typical size of the value, in `unit`: the fit's step and the prior's width are relative to it
    read: Callable[[Problem], float]  # the value `problem` prices with, in `unit`
    write: Callable[[Problem, float], Problem]  # `problem` pricing with the value instead
    doc: str
    applies: Callable[[Problem], bool] = lambda problem: True  # whether `problem` has such a constant at all


def _accelerator(field: str, *, to_si: float = 1.0) -> tuple[Callable, Callable]:
    def read(problem: Problem) -> float:
        return getattr(problem.accelerator, field) / to_si

    def write(problem: Problem, value: float) -> Problem:
        accelerator = dataclasses.replace(problem.accelerator, **{field: value * to_si})
        return dataclasses.replace(problem, accelerator=accelerator)

    return read, write


def _level_constant(prefix: str, field: str, index: int, doc: str) -> Constant:
    """PREFIX.N: the Level field `field` of network level N, which cost/collectives.py Network applies."""

    def read(problem: Problem) -> float:
        return getattr(problem.topology.levels[index], field)

    def write(problem: Problem, value: float) -> Problem:
        topology = problem.topology
        levels = list(topology.levels)
        levels[index] = dataclasses.replace(levels[index], **{field: value})
        return dataclasses.replace(problem, topology=dataclasses.replace(topology, levels=tuple(levels)))

    return Constant(f"{prefix}.{index}", "fraction of the level's bandwidth", (0.05, 1.0), 1.0, read, write,
                    doc=f"{doc} at network level {index} (hardware/topology.py Level.{field})",
                    applies=lambda problem: index < len(problem.topology.levels))


LEVEL_CONSTANTS = ("network_efficiency", "all_to_all_efficiency")  # the prefixes of the per-level constants


def _accelerator_constant(name: str, field: str, *, unit: str, bounds, scale: float, doc: str,
                          to_si: float = 1.0, applies=None) -> Constant:
    read, write = _accelerator(field, to_si=to_si)
    return Constant(name, unit, bounds, scale, read, write, doc, **({"applies": applies} if applies else {}))


def _fp8(problem: Problem) -> bool:
    return problem.model.numerics.fp8_recipe is not None


CONSTANTS: dict[str, Constant] = {c.name: c for c in (
    _accelerator_constant("gemm_efficiency", "gemm_efficiency", unit="fraction of the bf16 peak", bounds=(0.2, 1.0),
                          scale=0.6, doc="what a large bf16 GEMM reaches (cost/compute.py RooflineCompute.gemm_time)"),
    # Above 0.81 a GEMM in training would beat the largest fp8 GEMM alone: cuBLASLt E4M3 8192^3 runs at 1,599-1,630
    # of H100 SXM's 1,979 TFLOP/s (16 GPUs, "cuBLASLt FP8 GEMM Cross-Check Report", 2026-05-24, gitea.d-robotics.cc/
    # han.zhao/test_gpu_scripts). With all_to_all_efficiency.1 free the published rows drive it to 0.90 (and the
    # kernel overhead to 107 us): the bound keeps such a fit physical
    _accelerator_constant("gemm_fp8_efficiency", "gemm_fp8_efficiency", unit="fraction of the fp8 peak",
                          bounds=(0.2, 0.81), scale=0.6, applies=_fp8,
                          doc="what a large fp8 GEMM reaches (runs with train.precision=fp8 only)"),
    _accelerator_constant("attention_efficiency", "attention_efficiency", unit="fraction of the bf16 peak",
                          bounds=(0.05, 1.0), scale=0.35,
                          doc="flash attention at head dim 128, forward and backward (RooflineCompute.attention_time)"),
    _accelerator_constant("memory_bound_efficiency", "memory_bound_efficiency", unit="fraction of the HBM bandwidth",
                          bounds=(0.2, 1.0), scale=0.65,
                          doc="elementwise, norm, cast and optimizer kernels (RooflineCompute.memory_time)"),
    _accelerator_constant("kernel_overhead_us", "kernel_overhead_s", unit="µs", bounds=(0.0, 500.0), scale=50.0,
                          to_si=1e-6, doc="launch, host and tail time of each GEMM or attention kernel"),
    _accelerator_constant("host_overhead_us", "host_overhead_s", unit="µs", bounds=(0.0, 500.0), scale=20.0,
                          to_si=1e-6, doc="host time to issue one operator, hidden behind longer GPU work (cost/host.py)"),
    # The shipped figures are datasheet estimates (each accelerator YAML); a run that offloads determines it.
    _accelerator_constant("host_link_gb_per_s", "host_link_bandwidth", unit="GB/s", bounds=(1.0, 1000.0), scale=50.0,
                          to_si=1e9, applies=lambda problem: problem.accelerator.host_link_bandwidth is not None,
                          doc="one device's copies to and from host memory, which activation offloading waits for "
                              "(cost/offload.py)"),
    *(_level_constant("network_efficiency", "efficiency", i, "the fraction of the bandwidth collectives reach")
      for i in range(MAX_LEVELS)),
    *(_level_constant("all_to_all_efficiency", "all_to_all_efficiency", i,
                      "the fraction of that an all-to-all (the MoE dispatch, a2a CP) reaches") for i in range(MAX_LEVELS)),
)}


def applicable(problem: Problem) -> list[Constant]:
    """The constants `problem` prices with, in registry order."""
    return [c for c in CONSTANTS.values() if c.applies(problem)]


def with_values(problem: Problem, values: dict[str, float]) -> Problem:
    """`problem` priced with `values` (name -> value in the constant's unit); a constant the problem does not have
    (an fp8 efficiency in a bf16 run, a level the cluster lacks) is left out."""
    for name, value in values.items():
        constant = CONSTANTS[name]
        if constant.applies(problem):
            problem = constant.write(problem, value)
    return problem


def level_name(problem: Problem, constant: Constant) -> str | None:
    """The network level a per-level constant (network_efficiency.N, all_to_all_efficiency.N) is of, by name ('node',
    'su', ...); None for the others."""
    if constant.name.rpartition(".")[0] not in LEVEL_CONSTANTS:
        return None
    index = int(constant.name.rpartition(".")[2])
    return problem.topology.levels[index].name if index < len(problem.topology.levels) else None
