"""Predicted against measured step time for every calibration row, and the summary statistics.

`evaluate_row` prices a row's published layout with the one cost model, exactly as `nest-megatron
evaluate` would with the row's overrides. A row whose recompute is only its recipe's default tries
that, then selective, then full recomputation, and keeps the first that fits: the run ran, so it
fit. `summarise` gives the median |error|, the bias (the median signed error), and the shares of
rows within 10 % and 20 %.
"""

from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass

from nest_megatron.calibration.fit import Fit, Run, fit, nominal_priors
from nest_megatron.config.load import load
from nest_megatron.cost.evaluate import Estimate, estimate
from nest_megatron.cost.problem import Problem
from nest_megatron.fidelity.published import OPTIMIZERS, Row
from nest_megatron.solver.space import evaluate_config, pinned_chunks

RECOMPUTE_ORDER = ("none", "selective", "full")


@dataclass(frozen=True)
class RowResult:
    row: Row
    estimate: Estimate | None  # None: not expressible
    recompute: str | None  # the recomputation priced
    refused: str | None = None  # why no recomputation fits
    problem: Problem | None = None  # what was priced: a fit prices it again with other constants

    @property
    def error(self) -> float:
        """predicted / measured - 1: positive when the model is too slow."""
        return self.estimate.step_time / self.row.measured_step_s - 1


def recompute_chain(row: Row) -> tuple[str, ...]:
    stated = next(o.split("=", 1)[1] for o in row.overrides if o.startswith("plan.recompute="))
    if row.recompute_stated:
        return (stated,)
    return RECOMPUTE_ORDER[RECOMPUTE_ORDER.index(stated):]


def evaluate_row(row: Row, *, accelerator: dict | None = None) -> RowResult:
    """`row` at its published layout; `accelerator` replaces fields of the accelerator (a fit)."""
    if row.not_expressible:
        return RowResult(row, None, None)
    est = None
    for recompute in recompute_chain(row):
        overrides = [o for o in row.overrides if not o.startswith("plan.recompute=")] + [f"plan.recompute={recompute}"]
        loaded = load(overrides)
        model = loaded.problem.model
        numerics = dataclasses.replace(model.numerics, optimizer_dtypes=OPTIMIZERS[row.optimizer])
        problem = dataclasses.replace(loaded.problem, model=dataclasses.replace(model, numerics=numerics),
                                      moe_dispatcher=row.moe_dispatcher, moe_router=row.moe_router,
                                      moe_permute_fusion=row.moe_permute_fusion, pipeline_runs=row.pipeline_runs)
        if accelerator:
            problem = dataclasses.replace(problem, accelerator=dataclasses.replace(problem.accelerator, **accelerator))
        cfg = evaluate_config(problem, loaded.config.plan, default_mbs=loaded.config.train.micro_batch_size)
        # the split the row's plan.* keys give (the embedding / loss counted, a layout), as `evaluate` prices it
        est = estimate(problem, cfg, layers_per_stage=pinned_chunks(loaded.config.plan, cfg, num_layers=model.cfg.num_layers))
        if est.fits:
            return RowResult(row, est, recompute, problem=problem)
    return RowResult(row, est, recompute, problem=problem,
                     refused=f"needs {est.shortfall} at recompute={recompute}")


@dataclass(frozen=True)
class Summary:
    rows: int
    median_abs_error: float
    bias: float  # median signed error
    within_10: float  # share of rows
    within_20: float
    max_abs_error: float

    def line(self) -> str:
        return (f"{self.rows} rows: median |error| {self.median_abs_error:.1%}, bias {self.bias:+.1%}, "
                f"within 10 % {self.within_10:.0%}, within 20 % {self.within_20:.0%}, worst {self.max_abs_error:.1%}")


def summarise(results: list[RowResult]) -> Summary | None:
    """Over the rows priced and not refused; None when there are none."""
    return summarise_errors([r.error for r in results if r.estimate is not None and r.refused is None])


def summarise_errors(errors: list[float]) -> Summary | None:
    if not errors:
        return None
    absolute = [abs(e) for e in errors]
    return Summary(len(errors), statistics.median(absolute), statistics.median(errors),
                   sum(a <= 0.10 for a in absolute) / len(errors), sum(a <= 0.20 for a in absolute) / len(errors),
                   max(absolute))


def groups(results: list[RowResult]) -> dict[str, list[RowResult]]:
    """The summaries the targets are stated for: all, dense / MoE, bf16 / fp8, and per source."""
    out = {"all": results, "dense": [r for r in results if not r.row.moe], "moe": [r for r in results if r.row.moe],
           "bf16": [r for r in results if r.row.precision == "bf16"],
           "fp8": [r for r in results if r.row.precision == "fp8"]}
    for source in sorted({r.row.source for r in results}):
        out[f"source {source}"] = [r for r in results if r.row.source == source]
    return out


def as_runs(results: list[RowResult]) -> list[Run]:
    """The priced rows as the fitter's runs (calibration/fit.py), grouped by source and release."""
    return [Run(label=r.row.id, problem=r.problem, config=r.estimate.config, measured_s=r.row.measured_step_s,
                layers_per_stage=r.estimate.layers_per_stage,
                groups={"source": r.row.source, "release": r.row.release})
            for r in results if r.estimate is not None and r.refused is None]


def shipped_fit(runs: list[Run], only: list[str]) -> tuple[dict[str, float], Fit]:
    """The procedure that chooses the shipped constants: the fit of `only` to `runs`, each candidate's prior at its
    nominal size (calibration/fit.py nominal_priors). (That prior, for the cross-validation's folds; the Fit.)"""
    nominal = nominal_priors(runs, only)
    return nominal, fit(runs, prior=nominal, only=only)


def cross_validated(results: list[RowResult], *, compute: bool = False) -> dict[str, list[float]]:
    """Each cross-validation's errors of the priced rows (calibration/fit.py cross_validation: leave-one-out,
    -source-out, -release-out), by name. Without `compute`, those the shipped calibration file holds
    (calibration/shipped/h100_sxm.yaml, written by scripts/fit_calibration.py --write-shipped), when it holds the
    same rows and the constants they are priced with; {} when it does not (refit: compute them)."""
    import yaml

    from nest_megatron.calibration.fit import cross_validation, priors
    from nest_megatron.calibration.profile import SHIPPED

    runs = as_runs(results)
    if compute:
        nominal, full = shipped_fit(runs, list(SHIPPED_FIT))
        crossed = cross_validation(runs, full=full, prior=nominal, only=list(SHIPPED_FIT))
        return {name: list(e.errors) for name, e in crossed.items()}
    path = SHIPPED / "h100_sxm.yaml"
    if not path.exists():
        return {}
    data = yaml.safe_load(path.read_text())
    prior = priors(runs)
    same_constants = all(abs(prior.get(k, float("nan")) - v) <= 1e-9 * max(1.0, abs(v)) for k, v in data["constants"].items())
    out = {}
    for name, cross in data["cross_validation"].items():
        if same_constants and cross["rows"] == [run.label for run in runs]:
            out[name] = list(cross["errors"])
    return out


# The constants the shipped fit chooses (scripts/fit_calibration.py): the accelerator's compute efficiencies, the
# host's time per operator (which keeps its prior while no row is host-bound) and the all-to-all efficiency of the
# NIC level (dgx_h100_superpod's level 1). The per-kernel time keeps its earlier fit (SHIPPED_HELD): fitted beside the
# all-to-all efficiency it goes to 107 us and the fp8 GEMMs to what cuBLASLt reaches alone, pricing small models at
# micro-batch 1 slower still (nest_megatron/cost/README.md).
SHIPPED_FIT = ("gemm_efficiency", "gemm_fp8_efficiency", "attention_efficiency", "memory_bound_efficiency",
               "host_overhead_us", "all_to_all_efficiency.1")
SHIPPED_HELD = ("kernel_overhead_us",)
