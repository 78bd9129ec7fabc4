"""The compute model fitted from a profile cache, and the fitter.

`FittedCompute` is the cost model's roofline (`RooflineCompute`, the one formula) with the
efficiencies fitted to the measurements of one device, plus a fixed time per call for each op
class: what a kernel launch, a tile tail or a small shape costs beyond its FLOPs or bytes. The
overheads make the efficiency depend on the shape: a small GEMM reaches a smaller fraction of the
peak than a large one, as measured.

The fit, per op class, minimises the squared relative error of the predicted times:
- memory: elementwise ops of known bytes -> memory_bound_efficiency (the intercept is per kernel);
- gemm: the profiled GEMM shapes -> gemm_efficiency and gemm_overhead_s (with the fitted memory
  efficiency in the roofline's memory branch);
- attention: the profiled attention kernels -> attention_efficiency and attention_overhead_s;
- layers: whole megatron-core layers timed without communication -> memory_overhead_s, the fixed
  time of a layer pass beyond its GEMMs, attention and memory-bound bytes (norms, activation,
  dropout and residual kernels are many small launches). `memory_time` is called once per layer
  pass by the cost model, so this is where that time belongs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from nest_megatron.cost.compute import RooflineCompute, head_dim_factor
from nest_megatron.cost.layer import gemm_times, pass_times
from nest_megatron.hardware.accelerator import Accelerator
from nest_megatron.model.spec import Gemm
from nest_megatron.profile.cache import Entry

ETA_RANGE = (1e-10, 1.0)  # a CPU timed against a GPU's peak lands near 1e-7


@dataclass(frozen=True)
class FittedCompute:
    """A ComputeModel: the roofline with fitted efficiencies, plus a fitted time per call."""

    roofline: RooflineCompute
    gemm_overhead_s: float = 0.0
    attention_overhead_s: float = 0.0
    memory_overhead_s: float = 0.0

    def gemm_time(self, gemm: Gemm) -> float:
        return self.roofline.gemm_time(gemm) + self.gemm_overhead_s

    def attention_time(self, flops: float, head_dim: int = 128) -> float:
        return self.roofline.attention_time(flops, head_dim) + self.attention_overhead_s

    def memory_time(self, nbytes: float) -> float:
        return self.roofline.memory_time(nbytes) + self.memory_overhead_s

    def with_bf16_gemms(self) -> FittedCompute:
        return replace(self, roofline=self.roofline.with_bf16_gemms())

    @property
    def accelerator(self) -> Accelerator:
        return self.roofline.accelerator


@dataclass(frozen=True)
class Fit:
    compute: FittedCompute
    samples: dict  # op class -> number of measurements used
    rms_relative_error: dict  # op class -> sqrt(mean((predicted - measured) / measured)^2)
    devices: tuple[str, ...]  # the device names the measurements came from

    def summary(self) -> str:
        a, c = self.compute.accelerator, self.compute
        return (f"gemm {a.gemm_efficiency:.3g} + {c.gemm_overhead_s * 1e6:.3g} us, "
                f"attention {a.attention_efficiency:.3g} + {c.attention_overhead_s * 1e6:.3g} us, "
                f"memory {a.memory_bound_efficiency:.3g} + {c.memory_overhead_s * 1e6:.3g} us per layer pass "
                f"({', '.join(f'{k} {n}' for k, n in self.samples.items())} samples of {', '.join(self.devices)})")


# op class, the efficiency it fits, what one measurement's work is, and the roofline's time of that work
OP_CLASSES = (
    ("memory", "memory_bound_efficiency", lambda e: e.shape["bytes"], RooflineCompute.memory_time),
    ("gemm", "gemm_efficiency", lambda e: Gemm("g", e.shape["m"], e.shape["n"], e.shape["k"]), RooflineCompute.gemm_time),
    # the kernel's FLOPs at head dim 128's pace: the efficiency fitted is of head dim 128, as the config's
    ("attention", "attention_efficiency", lambda e: e.work["flops"] / head_dim_factor(e.shape.get("d", 128)),
     RooflineCompute.attention_time),
)


def _roofline(accelerator: Accelerator, **efficiencies) -> RooflineCompute:
    return RooflineCompute(replace(accelerator, **efficiencies))


def _overhead(predicted: np.ndarray, measured: np.ndarray) -> float:
    """The constant c >= 0 minimising sum(((predicted + c - measured) / measured)^2)."""
    w = 1.0 / measured**2
    return max(0.0, float(np.sum((measured - predicted) * w) / np.sum(w)))


def _relative_rms(predicted: np.ndarray, measured: np.ndarray) -> float:
    return float(np.sqrt(np.mean(((predicted - measured) / measured) ** 2)))


def _fit_rate(roof, measured: np.ndarray) -> tuple[float, float]:
    """(efficiency, overhead) minimising the relative error of roof(efficiency) + overhead.

    A log-spaced grid over ETA_RANGE finds the basin, golden-section search refines it."""

    def loss(log_eta: float) -> float:
        predicted = roof(math.exp(log_eta))
        c = _overhead(predicted, measured)
        return float(np.sum(((predicted + c - measured) / measured) ** 2))

    lo, hi = math.log(ETA_RANGE[0]), math.log(ETA_RANGE[1])
    grid = np.linspace(lo, hi, 401)
    best = int(np.argmin([loss(x) for x in grid]))
    a, b = grid[max(best - 1, 0)], grid[min(best + 1, len(grid) - 1)]
    ratio = (math.sqrt(5) - 1) / 2
    for _ in range(80):
        x1, x2 = b - ratio * (b - a), a + ratio * (b - a)
        if loss(x1) < loss(x2):
            b = x2
        else:
            a = x1
    eta = math.exp((a + b) / 2)
    predicted = roof(eta)
    return eta, _overhead(predicted, measured)


# memory_time calls per layer forward + backward in cost/layer.py pass_times: one per pass
MEMORY_CALLS_PER_LAYER = 2


def layer_time_of(entry: Entry, compute) -> float:
    """Forward + backward of a profiled dense / MoE layer as the cost model prices it
    (cost/layer.py pass_times), without communication."""
    w = entry.work
    gemms = [Gemm("g", *shape) for shape in w["gemms"]]  # [m, n, k] or [m, n, k, count]
    fwd, bwd, _, _ = pass_times(compute, gemm_times(compute, gemms), attention_flops=w["attention_flops"],
                                head_dim=w.get("head_dim", 128),
                                cp=entry.strategy.get("cp", 1), memory_bytes=w["memory_bytes"])
    return fwd + bwd


def fit(entries: list[Entry], accelerator: Accelerator) -> Fit:
    """Fit the compute model of `accelerator` (its peak FLOP/s and HBM bandwidth stay; its
    efficiencies and the overheads are fitted) to `entries`. A class with fewer than two
    measurements keeps the accelerator's efficiency and no overhead. The fitted per-call overheads
    replace the accelerator's calibrated kernel_overhead_s."""
    accelerator = replace(accelerator, kernel_overhead_s=0.0)
    by_kind: dict[str, list[Entry]] = {}
    for e in entries:
        if e.seconds <= 0:  # below the timer's resolution: no information about a rate
            continue
        by_kind.setdefault(e.kind, []).append(e)
    samples, errors, eff, overheads = {}, {}, {}, {}
    # Memory first: the GEMM roofline's memory branch uses the fitted memory efficiency.
    for kind, field, item, time_of in OP_CLASSES:
        found = by_kind.get(kind, [])
        if len(found) < 2:
            continue
        fixed = {k: eff[k] for k in ("memory_bound_efficiency",) if kind == "gemm" and k in eff}
        items, measured = [item(e) for e in found], np.array([e.seconds for e in found])

        def roof(eta):
            compute = _roofline(accelerator, **fixed, **{field: eta})
            return np.array([time_of(compute, x) for x in items])

        eff[field], overheads[kind] = _fit_rate(roof, measured)
        samples[kind] = len(found)
        errors[kind] = _relative_rms(roof(eff[field]) + overheads[kind], measured)

    compute = FittedCompute(_roofline(accelerator, **eff), overheads.get("gemm", 0.0), overheads.get("attention", 0.0),
                            overheads.get("memory", 0.0))
    layers = [e for kind in ("dense", "moe") for e in by_kind.get(kind, []) if not e.includes_comm]
    if layers:
        # What the layers take beyond their GEMMs, attention and memory-bound bytes, per memory_time call.
        measured = np.array([e.seconds for e in layers]) / MEMORY_CALLS_PER_LAYER
        bare = replace(compute, memory_overhead_s=0.0)
        roofs = np.array([layer_time_of(e, bare) for e in layers]) / MEMORY_CALLS_PER_LAYER
        compute = replace(compute, memory_overhead_s=_overhead(roofs, measured))
        samples["layers"] = len(layers)
        errors["layers"] = _relative_rms(roofs + compute.memory_overhead_s, measured)
    return Fit(compute, samples, errors, tuple(sorted({e.device for e in entries})))
