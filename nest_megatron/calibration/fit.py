"""Fit the cost model's constants (calibration/constants.py) to measured step times, and cross-validate the fit.

The fit is a maximum a-posteriori estimate on log step times: each run's residual r_i = log(predicted_i /
measured_i), taken as Gaussian with a run-to-run spread `noise` (2 %: repeated Megatron runs of one job differ by
about that), and each constant's prior a Gaussian around its shipped value with a width of `prior_width` times the
constant's scale (50 %: the shipped constants are fitted to other clusters and releases). The sum

    sum_i (r_i / noise)^2 + sum_j ((c_j - prior_j) / (prior_width * scale_j))^2

is minimised by Levenberg-Marquardt inside each constant's bounds, with the Jacobian by finite differences of the
one cost model (`cost.evaluate.estimate`), so every constant is fitted through the same formulas that price a plan.

Which constants the runs determine is decided from the runs themselves: the data must shrink a constant's prior
uncertainty to at most `DETERMINED` of itself (the posterior standard deviation of the linearised problem). A
constant that no run depends on, or that the runs cannot tell apart from another (two efficiencies every run
weighs alike), keeps its prior; the fit says which, and why.

Cross-validation refits without each held-out group of runs (one run, one source, one release) and prices the
held-out runs with that fit: the error band of a prediction comes from these residuals, not the in-sample ones.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from nest_megatron.calibration.constants import CONSTANTS, Constant, with_values
from nest_megatron.cost.evaluate import estimate
from nest_megatron.cost.problem import Problem
from nest_megatron.parallel.config import ParallelConfig

NOISE = 0.02  # run-to-run spread of a measured step time (log), the residuals' scale
PRIOR_WIDTH = 0.5  # a prior's standard deviation, as a fraction of its constant's scale
DETERMINED = 0.5  # a constant is fitted only when the runs shrink its prior's standard deviation to this or less
STEP = 1e-4  # finite-difference step of the Jacobian, as a fraction of a constant's scale
MAX_ITERATIONS = 60


@dataclass(frozen=True)
class Run:
    """One measured run, as the cost model prices it: its problem (with the prior constants), configuration and
    layer split, and the step time measured."""

    label: str
    problem: Problem
    config: ParallelConfig
    measured_s: float
    layers_per_stage: tuple[int, ...] | None = None
    rank_to_device: tuple[int, ...] | None = None  # None: rank r on device r
    groups: dict[str, str] = field(default_factory=dict)  # e.g. {"source": ..., "release": ...} for cross-validation

    def predict(self, values: dict[str, float]) -> float:
        """The step time with `values` for the constants they name (the others as the problem has them)."""
        priced = with_values(self.problem, values)
        mapping = np.asarray(self.rank_to_device, dtype=np.int64) if self.rank_to_device is not None else None
        return estimate(priced, self.config, layers_per_stage=self.layers_per_stage, rank_to_device=mapping).step_time


@dataclass(frozen=True)
class Verdict:
    """What the fit did with one constant."""

    name: str
    prior: float
    value: float
    fitted: bool
    why: str  # fitted: how well determined; kept: why the runs do not determine it
    posterior_sd: float | None = None  # in the constant's unit; None when kept at its prior


@dataclass(frozen=True)
class Fit:
    values: dict[str, float]  # every applicable constant: fitted or its prior
    verdicts: dict[str, Verdict]
    predicted_s: tuple[float, ...]  # per run, with `values`
    prior_predicted_s: tuple[float, ...]  # per run, with the priors
    iterations: int

    @property
    def fitted(self) -> list[str]:
        return [name for name, v in self.verdicts.items() if v.fitted]


def priors(runs: list[Run]) -> dict[str, float]:
    """Each constant some run prices with, at the value the first such run's problem has (the shipped value)."""
    out = {}
    for run in runs:
        for constant in CONSTANTS.values():
            if constant.applies(run.problem) and constant.name not in out:
                out[constant.name] = constant.read(run.problem)
    return out


def nominal_priors(runs: list[Run], names: list[str]) -> dict[str, float]:
    """`priors(runs)` with each constant of `names` at its nominal size (`Constant.scale`): a prior no run informed.
    The shipped values were fitted to the calibration rows themselves; a cross-validation fold centred on them
    would lean on the rows it holds out."""
    return {k: CONSTANTS[k].scale if k in names else v for k, v in priors(runs).items()}


def _residuals(runs: list[Run], values: dict[str, float]) -> np.ndarray:
    return np.array([math.log(run.predict(values) / run.measured_s) for run in runs])


class _Space:
    """The fitted constants as z = (value - prior) / scale, inside their bounds."""

    def __init__(self, constants: list[Constant], prior: dict[str, float]):
        self.constants, self.prior = constants, prior
        self.scale = np.array([c.scale for c in constants])
        self.low = np.array([(c.bounds[0] - prior[c.name]) / c.scale for c in constants])
        self.high = np.array([(c.bounds[1] - prior[c.name]) / c.scale for c in constants])

    def values(self, z: np.ndarray, base: dict[str, float]) -> dict[str, float]:
        return {**base, **{c.name: self.prior[c.name] + float(zi) * c.scale for c, zi in zip(self.constants, z)}}

    def clip(self, z: np.ndarray) -> np.ndarray:
        return np.clip(z, self.low, self.high)


def _jacobian(runs, space: _Space, z: np.ndarray, base: dict, r0: np.ndarray) -> np.ndarray:
    """d r / d z by forward differences (backward at an upper bound)."""
    columns = []
    for j in range(len(z)):
        h = STEP if z[j] + STEP <= space.high[j] else -STEP
        zh = z.copy()
        zh[j] += h
        columns.append((_residuals(runs, space.values(zh, base)) - r0) / h)
    return np.stack(columns, axis=1) if columns else np.zeros((len(runs), 0))


def _posterior_sd(jac: np.ndarray, *, noise: float, width: float) -> np.ndarray:
    """Posterior standard deviation of each z, prior N(0, width^2), of the problem linearised at the fit."""
    info = jac.T @ jac / noise**2 + np.eye(jac.shape[1]) / width**2
    return np.sqrt(np.diag(np.linalg.inv(info)))


def _minimise(runs, space: _Space, z: np.ndarray, base: dict, *, noise: float, width: float) -> tuple[np.ndarray, int]:
    """Levenberg-Marquardt on the MAP objective, steps projected into the bounds."""

    def cost(r, zz):
        return float(np.sum((r / noise) ** 2) + np.sum((zz / width) ** 2))

    r = _residuals(runs, space.values(z, base))
    current, damping = cost(r, z), 1e-3
    for iteration in range(1, MAX_ITERATIONS + 1):
        jac = _jacobian(runs, space, z, base, r)
        # Whitened system: [J / noise; I / width] dz = -[r / noise; z / width]
        a = np.vstack([jac / noise, np.eye(len(z)) / width])
        b = -np.concatenate([r / noise, z / width])
        normal, gradient = a.T @ a, a.T @ b
        while True:
            step = np.linalg.solve(normal + damping * np.diag(np.diag(normal)), gradient)
            trial = space.clip(z + step)
            r_trial = _residuals(runs, space.values(trial, base))
            value = cost(r_trial, trial)
            if value < current:
                break
            damping *= 10
            if damping > 1e8:
                return z, iteration
        moved = float(np.max(np.abs(trial - z)))
        improved = current - value
        z, r, current, damping = trial, r_trial, value, max(damping / 10, 1e-9)
        if moved < 1e-6 or improved < 1e-7 * max(current, 1.0):
            return z, iteration
    return z, MAX_ITERATIONS


def fit(runs: list[Run], *, prior: dict[str, float] | None = None, noise: float = NOISE,
        prior_width: float = PRIOR_WIDTH, start: dict[str, float] | None = None,
        only: list[str] | None = None) -> Fit:
    """The MAP fit of the constants the runs determine; every other applicable constant keeps its prior.
    `start` warm-starts the search (a cross-validation fold from the full fit); `only` limits the candidates
    (names of CONSTANTS; default: every constant some run prices with)."""
    prior = dict(prior or priors(runs))
    names = [n for n in prior if only is None or n in only]
    used = {c.name for run in runs for c in CONSTANTS.values() if c.applies(run.problem)}
    verdicts: dict[str, Verdict] = {}
    for name in prior:
        if name not in used:
            verdicts[name] = Verdict(name, prior[name], prior[name], False, "no run prices with it")
        elif name not in names:
            verdicts[name] = Verdict(name, prior[name], prior[name], False, "not a candidate of this fit")
    candidates = [CONSTANTS[n] for n in names if n in used]
    base = dict(prior)
    z0 = {c.name: ((start or {}).get(c.name, prior[c.name]) - prior[c.name]) / c.scale for c in candidates}
    iterations = 0
    while True:
        space = _Space(candidates, prior)
        z = space.clip(np.array([z0[c.name] for c in candidates]))
        if candidates:
            z, used_iterations = _minimise(runs, space, z, base, noise=noise, width=prior_width)
            iterations += used_iterations
        r = _residuals(runs, space.values(z, base))
        jac = _jacobian(runs, space, z, base, r)
        sd = _posterior_sd(jac, noise=noise, width=prior_width) / prior_width
        worst = int(np.argmax(sd)) if candidates else -1
        if not candidates or sd[worst] <= DETERMINED:
            break
        dropped = candidates.pop(worst)
        # How much a prior's width of change would move the most sensitive run, against the runs' noise
        moves = float(np.max(np.abs(jac[:, worst]))) * prior_width
        why = (f"no run depends on it (a change of {prior_width:.0%} of its scale moves the most sensitive run's "
               f"step time by {moves:.2%})" if moves < noise / 10 else
               f"the runs do not determine it apart from the other constants (they would leave {sd[worst]:.0%} of "
               "its prior's uncertainty)")
        verdicts[dropped.name] = Verdict(dropped.name, prior[dropped.name], prior[dropped.name], False, why)
        z0 = {c.name: float(zi) for c, zi in zip(space.constants, z)}
    values = space.values(z, base)
    for c, s, zi, low, high in zip(candidates, sd, z, space.low, space.high):
        bound = " at its bound: the runs want it further" if np.isclose(zi, low) or np.isclose(zi, high) else ""
        verdicts[c.name] = Verdict(c.name, prior[c.name], values[c.name], True,
                                   f"fitted (the runs leave {s:.0%} of its prior's uncertainty){bound}",
                                   posterior_sd=float(s * prior_width * c.scale))
    ordered = {n: verdicts[n] for n in prior}
    return Fit(values=values, verdicts=ordered, predicted_s=tuple(run.predict(values) for run in runs),
               prior_predicted_s=tuple(run.predict(prior) for run in runs), iterations=iterations)


# --- cross-validation ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Errors:
    """Relative errors predicted / measured - 1 over some runs, and their summary."""

    errors: tuple[float, ...]

    @property
    def runs(self) -> int:
        return len(self.errors)

    @property
    def median_abs(self) -> float:
        return statistics.median(abs(e) for e in self.errors) if self.errors else float("nan")

    @property
    def bias(self) -> float:
        """The median signed error: positive when the model is too slow."""
        return statistics.median(self.errors) if self.errors else float("nan")

    @property
    def worst(self) -> float:
        return max((abs(e) for e in self.errors), default=float("nan"))

    def as_dict(self) -> dict:
        return {"runs": self.runs, "median_abs_error": self.median_abs, "bias": self.bias,
                "worst_abs_error": self.worst, "errors": list(self.errors)}

    def line(self) -> str:
        return (f"{self.runs} runs: median |error| {self.median_abs:.1%}, bias {self.bias:+.1%}, "
                f"worst {self.worst:.1%}")


def errors_of(predicted: tuple[float, ...] | list[float], runs: list[Run]) -> Errors:
    return Errors(tuple(p / run.measured_s - 1 for p, run in zip(predicted, runs)))


def cross_validate(runs: list[Run], key: Callable[[Run], str], *, full: Fit | None = None,
                   **fit_options) -> Errors:
    """Each group of runs (by `key`) priced by a fit to the others, its constants decided from them alone; the
    errors in run order. With one group only, the held-out runs are priced with the priors (nothing is left to
    fit on)."""
    predicted = [0.0] * len(runs)
    if full is not None and "only" not in fit_options:
        # The candidates are what the full fit determined: a fold decides again whether its runs still do.
        fit_options = dict(fit_options, only=full.fitted)
    for group in dict.fromkeys(key(run) for run in runs):
        held = [i for i, run in enumerate(runs) if key(run) == group]
        rest = [run for i, run in enumerate(runs) if i not in held]
        prior = fit_options.get("prior") or priors(runs)
        values = fit(rest, start=full.values if full else None, **fit_options).values if rest else prior
        for i in held:
            predicted[i] = runs[i].predict({**prior, **values})
    return errors_of(predicted, runs)


def leave_one_out(runs: list[Run], *, full: Fit | None = None, **fit_options) -> Errors:
    return cross_validate(runs, lambda run: run.label, full=full, **fit_options)


# Held-out groups: every run alone, every source of runs (the framework of a published run; the kind of log a user's
# run was read from, calibration/runs.py SOURCES), every software release; a run lacks a group key when it does not
# say (a user's logs have no release).
CROSS_VALIDATIONS: dict[str, Callable[[Run], str | None]] = {
    "leave-one-out": lambda run: run.label,
    "leave-one-source-out": lambda run: run.groups.get("source"),
    "leave-one-release-out": lambda run: run.groups.get("release"),
}


def cross_validation(runs: list[Run], *, full: Fit | None = None, which: tuple[str, ...] = tuple(CROSS_VALIDATIONS),
                     **fit_options) -> dict[str, Errors]:
    """The errors of each cross-validation in `which` that the runs' groups allow (at least two groups)."""
    out = {}
    for name in which:
        key = CROSS_VALIDATIONS[name]
        if any(key(run) is None for run in runs) or len({key(run) for run in runs}) < 2:
            continue
        out[name] = cross_validate(runs, key, full=full, **fit_options)
    return out
