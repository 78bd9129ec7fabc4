"""Sweeps for what-if and co-design: expand Hydra sweep overrides into points, plan each with api.plan
(the one cost model), and turn the outcomes into rows.

    from nest_megatron import sweep
    points = sweep.expand(["model=llama3_70b", "cluster=dgx_h100_superpod,h100_spine_leaf",
                           "cluster.num_devices=256,1024,4096"])
    rows = [sweep.row(o) for o in sweep.run(points, jobs=4)]   # NestError on bad input, before any planning

Expansion is Hydra's own: OverridesParser parses `a=1,2`, `a=range(8,64,8)` and `model=glob(llama*)`;
a hostlist is one value (`cluster.nodes=n[01-12],n20`), several are quoted (`cluster.nodes='n[01-08]','n[01-16]'`),
and the points are the Cartesian product of the swept keys in the order given (the last varies
fastest), as Hydra's basic sweeper orders its jobs.
"""

from __future__ import annotations

import contextlib
import itertools
import multiprocessing
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ProcessPoolExecutor, as_completed
from dataclasses import dataclass

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Glob, Override, QuotedString, ValueType
from hydra.errors import HydraException

from nest_megatron import api
from nest_megatron.config.load import GROUPS, load, options, quote_verbatim
from nest_megatron.errors import NestError
from nest_megatron.plan import Plan

MAX_POINTS = 256

# What a row holds after the swept values, in table / CSV order: the step time's band and the calibration that
# priced it are the plan's (Plan.calibration: step_time_band_s, summary).
COLUMNS = ("num_devices", "tp", "pp", "dp", "cp", "ep", "vpp", "mbs", "zero", "recompute", "step_time_s",
           "step_time_low_s", "step_time_high_s", "tokens_per_s", "tokens_per_s_per_device", "mfu", "peak_memory_gib",
           "capacity_gib", "calibration", "error", "overrides")


@dataclass(frozen=True)
class Point:
    values: dict  # swept key -> its value at this point (int, float, str, ... as Hydra parsed it)
    overrides: tuple[str, ...]  # every override of this point, fixed and swept, as `plan` takes them


@dataclass(frozen=True)
class Outcome:
    point: Point
    num_devices: int | None  # None when the point's config does not load
    plan: Plan | None
    reason: str | None  # why there is no plan: one line


def expand(overrides: list[str], *, max_points: int = MAX_POINTS) -> list[Point]:
    """The points of the sweep, in order. NestError for malformed syntax, a key given twice, a sweep that
    cannot be listed (interval) or more than `max_points` points."""
    try:
        parsed = OverridesParser.create().parse_overrides([quote_verbatim(item) for item in overrides])
    except HydraException as err:
        text = " ".join(str(err).split()).split(" See https://")[0]  # Hydra's message, less its link to the grammar
        raise NestError(f"bad sweep override: {text}") from None
    seen = set()
    for override in parsed:
        key = override.key_or_group
        if key in seen:
            raise NestError(f"{key}: given twice; give it once (several values are a sweep: {key}=A,B)")
        seen.add(key)
    swept = [(o, _values(o)) for o in parsed if o.is_sweep_override()]
    size = 1
    for _, values in swept:
        size *= len(values)
    if size > max_points:
        counts = " x ".join(f"{len(values)} {o.key_or_group}" for o, values in swept)
        raise NestError(f"{size} points ({counts}) is more than --max-points={max_points}; sweep fewer values "
                        "or raise --max-points")
    fixed = {o.key_or_group: o.input_line for o in parsed if not o.is_sweep_override()}
    points = []
    for combination in itertools.product(*(values for _, values in swept)):
        chosen = {o.key_or_group: (value, text) for (o, _), (value, text) in zip(swept, combination)}
        # each override keeps its place on the command line, so the point reads like the sweep
        line = tuple(fixed.get(o.key_or_group) or f"{o.get_key_element()}={chosen[o.key_or_group][1]}" for o in parsed)
        points.append(Point(values={k: v for k, (v, _) in chosen.items()}, overrides=line))
    return points


def _values(override: Override) -> list[tuple[object, str]]:
    """(value, value as an override spells it) for each value of a sweep override."""
    key = override.key_or_group
    if override.value_type == ValueType.GLOB_CHOICE_SWEEP:
        glob = override.value()
        assert isinstance(glob, Glob)
        if key not in GROUPS:
            raise NestError(f"{override.input_line}: glob() selects config files, so only for {', '.join(GROUPS)}")
        names = glob.filter(options(key))
        if not names:
            raise NestError(f"{override.input_line}: matches no {key}; choose among: {', '.join(options(key))}")
        return [(name, name) for name in names]
    if not override.is_discrete_sweep():
        raise NestError(f"{override.input_line}: an interval cannot be listed; give the values (a=1,2,4) "
                        "or range(start,stop,step)")
    # a quoted value ('n[01-08]', a hostlist) is its text
    values = [(value.text if isinstance(value, QuotedString) else value, text)
              for value, text in zip(override.sweep_iterator(), override.sweep_string_iterator())]
    if not values:
        raise NestError(f"{override.input_line}: lists no value")
    return values


def run(points: list[Point], *, jobs: int = 1, on_done: Callable[[str], None] | None = None) -> list[Outcome]:
    """Plan every point, `jobs` at a time; the outcomes in point order whatever order they finish in.

    First the config of every point is loaded ("check"): a key=value that fails in every point holding it is
    bad input, and NestError names it before anything is planned. A point that fails on its own is a
    combination that does not go together (24 devices of a fabric whose leaves hold 16) and an outcome with
    the reason, as is a point whose model fits in no configuration ("plan"). on_done(phase) after each point.
    """
    done = on_done or (lambda phase: None)
    with _workers(jobs, len(points)) as pool:
        reasons = _in_order(pool, _load_reason, [p.overrides for p in points], lambda: done("check"))
        _raise_bad_input(points, reasons)
        todo = [i for i, reason in enumerate(reasons) if reason is None]
        planned = _in_order(pool, _plan_point, [points[i].overrides for i in todo], lambda: done("plan"))
    outcomes = [Outcome(p, None, None, reason) for p, reason in zip(points, reasons)]
    for index, (num_devices, plan, reason) in zip(todo, planned):
        outcomes[index] = Outcome(points[index], num_devices, plan, reason)
    return outcomes


def _raise_bad_input(points: list[Point], reasons: list[str | None]) -> None:
    holding: dict[str, list[int]] = {}
    for index, point in enumerate(points):
        for item in point.overrides:
            holding.setdefault(item, []).append(index)
    for indices in holding.values():
        if all(reasons[i] for i in indices):
            first = points[indices[0]]
            raise NestError(reasons[indices[0]] + (f" (at {describe(first)})" if first.values else ""))


def row(outcome: Outcome) -> dict:
    """One line of the sweep table: the swept values, then COLUMNS (None where a point has no plan)."""
    values = dict(outcome.point.values)
    values.update(dict.fromkeys(COLUMNS))
    values.update(num_devices=outcome.num_devices, error=outcome.reason, overrides=" ".join(outcome.point.overrides))
    plan = outcome.plan
    if plan is not None:
        p, pred = plan.parallel, plan.predicted
        low, high = plan.calibration["step_time_band_s"] or (None, None)
        values.update(
            tp=p["tp"], pp=p["pp"], dp=p["dp"], cp=p["cp"], ep=p["ep"], vpp=p["vpp"], mbs=plan.micro_batch_size,
            zero=plan.zero_stage, recompute=plan.recompute["granularity"] or "none",
            step_time_s=pred["step_time_s"], step_time_low_s=low, step_time_high_s=high,
            tokens_per_s=pred["tokens_per_s"],
            # per device of the cluster, idle ones included: what each GPU bought delivers
            tokens_per_s_per_device=pred["tokens_per_s"] / plan.num_devices,
            mfu=pred["mfu"], peak_memory_gib=pred["peak_memory_gib"], capacity_gib=pred["capacity_gib"],
            calibration=plan.calibration["summary"],
        )
    return values


def describe(point: Point) -> str:
    return " ".join(f"{k}={v}" for k, v in point.values.items())


def _load_reason(overrides: tuple[str, ...]) -> str | None:
    try:
        load(list(overrides))
    except NestError as err:
        return str(err)
    return None


def _plan_point(overrides: tuple[str, ...]) -> tuple[int | None, Plan | None, str | None]:
    """(devices, plan, None), or (devices, None, why) when nothing fits or Megatron's rules rule it out."""
    try:
        loaded = load(list(overrides))
    except NestError as err:
        return None, None, str(err)
    try:
        return loaded.problem.num_devices, api.plan_loaded(loaded), None
    except NestError as err:
        return loaded.problem.num_devices, None, str(err)


def _workers(jobs: int, num_points: int):
    """A process pool for jobs > 1, else a context that holds None (work in this process). Spawned, not
    forked: a forked child inherits the parent's thread pools (OpenMP, numba's threading layer) in whatever
    state they were, and the default start method differs between Linux and macOS."""
    if jobs <= 1 or num_points <= 1:
        return contextlib.nullcontext()
    return ProcessPoolExecutor(max_workers=min(jobs, num_points), mp_context=multiprocessing.get_context("spawn"))


def _in_order(pool: ProcessPoolExecutor | None, work: Callable, items: list, done: Callable[[], None]) -> list:
    """[work(item) for item in items], in `pool`'s processes when there is one, in the items' order."""
    if pool is None:
        results = []
        for item in items:
            results.append(work(item))
            done()
        return results
    futures: dict[Future, int] = {pool.submit(work, item): i for i, item in enumerate(items)}
    results = [None] * len(items)
    for future in as_completed(futures):
        results[futures[future]] = future.result()
        done()
    return results


def numeric(values: Iterable) -> bool:
    return all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)
