"""The layer split by dynamic programming, exact within the cost model.

For one configuration (everything but the split), `best_split` divides the L layers into p
contiguous pipeline stages, possibly uneven, minimising the cost model's step time

    step = F * max_s t_s + max_s x_s        (F = micro-batches + (p - 1); x: after the pipeline)

over the splits whose every stage fits in memory. The stage tables come from the cost model's
own stage formulas, applied to arrays of candidate stages (`cost.evaluate.stage_body`,
`pipeline_p2p`, `after_pipeline`, `memory.stage_memory`): t(s, a, b), x(s, a, b) and the memory of
stage s holding layers [a, b). Stage s knows its micro-batches in flight (p - s under 1F1B) and the network level
of its boundaries, so memory and transfers are priced where they occur.

Stages are filled from the last backwards. Because the objective adds two maxima, the state
(s, a) = "stages s..p-1 hold layers a..L-1" keeps the Pareto front of (max t, max x) pairs rather
than one number; the front is short (both maxima grow with the layers a stage holds), and the
answer is the point of F(0, 0) with the least F t + x. `brute_force_split` enumerates every split
with `estimate` for the tests.
"""

from __future__ import annotations

import itertools
import operator
import time
from dataclasses import fields, replace
from functools import lru_cache
from typing import NamedTuple

import numba
import numpy as np

from nest_megatron.config.schema import PlanChoice, SolverConfig
from nest_megatron.cost.a2a_overlap import dispatch_sm_share, pair_saving, unpaired_microbatches
from nest_megatron.cost.evaluate import (
    Context,
    Estimate,
    after_pipeline,
    context,
    estimate_in,
    fits_in,
    groups_and_network,
    layer_options,
    pipeline_factor,
    pipeline_p2p,
    stage_body,
)
from nest_megatron.cost.layer import LayerTime, layer_time, ordered_streams
from nest_megatron.cost.memory import activation_bytes, in_flight_chunks, stage_memory
from nest_megatron.cost.problem import Problem
from nest_megatron.cost.recompute import recompute_seconds
from nest_megatron.cost.tables import range_sums
from nest_megatron.model.kinds import LayerKind
from nest_megatron.parallel.config import ParallelConfig
from nest_megatron.parallel.layout import EVEN, SplitForm, min_stage_layers, searched_splits
from nest_megatron.parallel.ranks import decoder_sizes, host_placements, inside_units, rank_groups
from nest_megatron.parallel.rules import num_microbatches
from nest_megatron.solver.bounds import MemoryFloors, no_fit_reason
from nest_megatron.solver.enumerate import SearchResult, row_key
from nest_megatron.solver.space import candidates, empty_space_reason, pinned_chunks, searched_worlds
from nest_megatron.solver.virtual import best_virtual_split, family, family_fits, family_sums
from nest_megatron.solver.visit import Progress, default_jobs, visit

FRONT_CAPACITY = 64  # Pareto points kept per state; exceeding it is an error, never a silent cut


class StageTables(NamedTuple):
    """Stage s holding layers [a, b) costs t = body[kind[s], a, b] + p2p[s] per micro-batch and
    x = after[kind[s], a, b] after the pipeline, and fits when in_flight[s] * per_chunk[a, b] <=
    room[kind[s], a, b] (the memory left beside its model states, logits, workspace and the layer
    rebuilt by recompute). Kinds: first, middle, last (or the only) stage."""

    body: np.ndarray
    after: np.ndarray
    room: np.ndarray
    per_chunk: np.ndarray
    kind: np.ndarray
    p2p: np.ndarray
    in_flight: np.ndarray


def stage_tables(ctx: Context, memory: tuple | None = None) -> StageTables:
    """Every candidate stage priced with the cost model's own stage formulas, once per kind of
    stage: a stage's index matters only through being first or last, its pipeline transfers and
    its micro-batches in flight (activation_bytes is affine in them). `memory`: the configuration's
    `memory_tables`, which no placement changes."""
    a = np.arange(ctx.costs.num_layers + 1)[:, None]
    b = a.T
    sums = range_sums(ctx.costs, ctx.cfg, a, b)
    room, per_chunk, kind, in_flight = memory or memory_tables(ctx, sums)
    body, after = [], []
    for first, last in _kinds(ctx.cfg.pp):
        body.append(sum(stage_body(ctx, sums, first=first, last=last).values()) + 0 * a * b)
        after.append(sum(after_pipeline(ctx, sums, first=first, last=last).values()) + 0 * a * b)
    return StageTables(
        body=np.stack(body).astype(float),
        after=np.stack(after).astype(float),
        room=room,
        per_chunk=per_chunk,
        kind=kind,
        p2p=np.array([pipeline_p2p(ctx, stage=s) for s in range(ctx.cfg.pp)], dtype=float),
        in_flight=in_flight,
    )


def _kinds(pp: int) -> list[tuple[bool, bool]]:
    """The distinct kinds of stage, (first, last), in the order of the stages."""
    return list(dict.fromkeys((s == 0, s == pp - 1) for s in range(pp)))


def memory_tables(ctx: Context, sums=None) -> tuple:
    """The memory half of `StageTables`: (room, per_chunk, kind, in_flight)."""
    cfg, problem = ctx.cfg, ctx.problem
    acc = problem.accelerator
    a = np.arange(ctx.costs.num_layers + 1)[:, None]
    b = a.T
    sums = range_sums(ctx.costs, cfg, a, b) if sums is None else sums
    rebuilt = activation_bytes(sums, in_flight=0, act_rebuilt=ctx.costs.act_rebuilt)
    per_chunk = activation_bytes(sums, in_flight=1, act_rebuilt=ctx.costs.act_rebuilt) - rebuilt
    distinct = _kinds(cfg.pp)
    # A stage of fewer layers than the search allows has no room: no split the DP returns holds one.
    too_short = (b - a) < min_stage_layers(ctx.costs.num_layers, cfg.pp)
    room = []
    for first, last in distinct:
        states = stage_memory(problem.model, cfg, sums, first=first, last=last, in_flight=0,
                              reserved_bytes=acc.reserved_memory_bytes, act_rebuilt=ctx.costs.act_rebuilt)
        room.append(np.where(too_short, -np.inf, acc.memory_bytes - states.total + 0 * a * b))
    return (np.stack(room).astype(float), np.asarray(per_chunk + 0 * a * b, dtype=float),
            np.array([distinct.index((s == 0, s == cfg.pp - 1)) for s in range(cfg.pp)], dtype=np.int64),
            np.array([in_flight_chunks(cfg, stage=s, num_microbatches=ctx.num_microbatches)
                      for s in range(cfg.pp)], dtype=float))


def split_fits(memory: tuple) -> bool:
    """Whether some split of the layers fits every stage, from `memory_tables` alone: known before
    the (costlier) time tables are priced."""
    return bool(_any_split_fits(*memory))


@numba.njit(cache=True)
def _any_split_fits(room, per_chunk, kind, in_flight):  # pragma: no cover - compiled
    """Reachability from the last stage backwards: holds[a] when stages s..p-1 can hold layers a..L-1."""
    stages, layers = kind.shape[0], per_chunk.shape[0] - 1
    holds = np.zeros(layers + 1, dtype=np.bool_)
    last = stages - 1
    for a in range(last, layers):
        holds[a] = in_flight[last] * per_chunk[a, layers] <= room[kind[last], a, layers]
    for s in range(stages - 2, -1, -1):
        earlier = np.zeros(layers + 1, dtype=np.bool_)
        for a in range(0 if s == 0 else s, (0 if s == 0 else layers - (stages - s)) + 1):
            for b in range(a + 1, layers - (stages - 1 - s) + 1):
                if holds[b] and in_flight[s] * per_chunk[a, b] <= room[kind[s], a, b]:
                    earlier[a] = True
                    break
        holds = earlier
    return holds[0]


@numba.njit(cache=True)
def _split_value(tables, factor, split):  # pragma: no cover - compiled
    """The step time of `split` from the tables, inf when a stage does not fit."""
    t_max, x_max, a = 0.0, 0.0, 0
    for s in range(split.shape[0]):
        ts, xs = _stage(tables, s, a, a + split[s])
        t_max, x_max, a = max(t_max, ts), max(x_max, xs), a + split[s]
    return factor * t_max + x_max


@numba.njit(cache=True, inline="always")
def _stage(tables, s, a, b):
    """(t, x) of stage s on layers [a, b), or (inf, inf) when it does not fit."""
    k = tables[4][s]
    if b <= a or tables[6][s] * tables[3][a, b] > tables[2][k, a, b]:
        return np.inf, np.inf
    return tables[0][k, a, b] + tables[5][s], tables[1][k, a, b]


@numba.njit(cache=True)
def _fill_state(tables, s, a, stages, shortest, factor, cutoff, front_t, front_x, next_b, next_i, count):  # pragma: no cover
    """The Pareto front of state (s, a) from the fronts of stage s + 1, stages of at least `shortest`
    layers; False when it overflows."""
    capacity = front_t.shape[2]
    layers = tables[3].shape[0] - 1
    for b in range(a + shortest, layers - shortest * (stages - 1 - s) + 1):
        ts, xs = _stage(tables, s, a, b)
        # No split with this stage can beat the cutoff, nor with a longer one: a stage's time and
        # memory only grow with its layers (sums over them, and maxima of such sums).
        if factor * ts >= cutoff:
            break
        for j in range(count[s + 1, b]):
            nt = max(ts, front_t[s + 1, b, j])
            nx = max(xs, front_x[s + 1, b, j])
            # Keep (nt, nx) unless a point of the front is at least as good in both.
            dominated = False
            for k in range(count[s, a]):
                if front_t[s, a, k] <= nt and front_x[s, a, k] <= nx:
                    dominated = True
                    break
            if dominated:
                continue
            kept = 0
            for k in range(count[s, a]):
                if not (nt <= front_t[s, a, k] and nx <= front_x[s, a, k]):
                    front_t[s, a, kept] = front_t[s, a, k]
                    front_x[s, a, kept] = front_x[s, a, k]
                    next_b[s, a, kept] = next_b[s, a, k]
                    next_i[s, a, kept] = next_i[s, a, k]
                    kept += 1
            if kept == capacity:
                return False
            front_t[s, a, kept] = nt
            front_x[s, a, kept] = nx
            next_b[s, a, kept] = b
            next_i[s, a, kept] = j
            count[s, a] = kept + 1
    return True


# One thread on purpose. With numba.prange over the states of a stage (parallel=True), 2 cores
# planned GPT-3 on 1,024 devices 8 % faster when idle, but each of the ~25,000 parallel loops of a
# search ends at a barrier: the OpenMP layer spins there, and when anything else runs on the cores
# a descheduled thread stalls the loop for a time slice (GPT-3 on 128 devices: 63 s instead of 4 s);
# the sleeping layers (workqueue, OMP_WAIT_POLICY=passive) were 1.4-2x slower than one thread.
@numba.njit(cache=True)
def _pareto_split(tables, stages, shortest, factor, capacity, cutoff):  # pragma: no cover - compiled; tests run it compiled
    n1 = tables[3].shape[0]
    layers = n1 - 1
    # Only the first count[s, a] points of a front are ever read: no fill of memory never read.
    front_t = np.empty((stages, n1, capacity))
    front_x = np.empty((stages, n1, capacity))
    next_b = np.empty((stages, n1, capacity), dtype=np.int64)
    next_i = np.empty((stages, n1, capacity), dtype=np.int64)
    count = np.zeros((stages, n1), dtype=np.int64)
    last = stages - 1
    for a in range(shortest * last, layers - shortest + 1):
        ts, xs = _stage(tables, last, a, layers)
        if factor * ts < cutoff:
            front_t[last, a, 0] = ts
            front_x[last, a, 0] = xs
            next_b[last, a, 0] = layers
            next_i[last, a, 0] = -1
            count[last, a] = 1
    complete = np.ones(n1, dtype=np.bool_)
    for s in range(stages - 2, -1, -1):
        a_first = 0 if s == 0 else shortest * s
        a_last = 0 if s == 0 else layers - shortest * (stages - s)
        # The states of one stage depend only on the next stage's.
        for a in range(a_first, a_last + 1):
            complete[a] = complete[a] and _fill_state(tables, s, a, stages, shortest, factor, cutoff,
                                                      front_t, front_x, next_b, next_i, count)
        if not complete.all():
            return -1.0, np.zeros(0, dtype=np.int64)  # front overflow
    best, best_k = np.inf, -1
    for k in range(count[0, 0]):
        value = factor * front_t[0, 0, k] + front_x[0, 0, k]
        if value < best:
            best, best_k = value, k
    if best_k < 0:
        return np.inf, np.zeros(0, dtype=np.int64)
    split = np.zeros(stages, dtype=np.int64)
    a, k = 0, best_k
    for s in range(stages):
        b = next_b[s, a, k]
        split[s] = b - a
        a, k = b, next_i[s, a, k]
    return best, split


def best_split(ctx: Context, *, cutoff: float = np.inf, memory: tuple | None = None) -> tuple[tuple[int, ...], float] | None:
    """The fastest split of the layers whose every stage fits, with its step time; None when no
    split fits or none is faster than `cutoff` (stages slower than cutoff / F are never tried).
    `memory`: the configuration's `memory_tables`, when already built."""
    if ctx.cfg.pp == 1:
        split = (ctx.costs.num_layers,)
        est = estimate_in(ctx, split)
        return (split, est.step_time) if est.fits and est.step_time < cutoff else None
    tables = tuple(stage_tables(ctx, memory))
    # The even split, when it fits, bounds the best: stages slower than it need not be tried either.
    even = _split_value(tables, ctx.pipeline_factor, np.array(balanced_split(ctx.costs.num_layers, ctx.cfg.pp)))
    capacity = 8  # fronts are short; a longer one is solved again with room for it
    while True:
        value, split = _pareto_split(tables, ctx.cfg.pp, min_stage_layers(ctx.costs.num_layers, ctx.cfg.pp),
                                     ctx.pipeline_factor, capacity,
                                     min(cutoff, np.nextafter(even, np.inf)))
        if value >= 0:
            break
        if capacity == FRONT_CAPACITY:
            raise RuntimeError(f"Pareto front of more than {FRONT_CAPACITY} points: raise FRONT_CAPACITY")
        capacity = min(2 * capacity, FRONT_CAPACITY)
    if not value < cutoff:
        return None
    return tuple(int(n) for n in split), float(value)


def brute_force_split(ctx: Context) -> Estimate | None:
    """Every split of the layers into cfg.pp stages of at least `min_stage_layers`, scored by `estimate`; the
    fastest that fits. Exponential: for the exactness tests only."""
    layers, stages = ctx.costs.num_layers, ctx.cfg.pp
    shortest = min_stage_layers(layers, stages)
    best = None
    for cuts in itertools.combinations(range(1, layers), stages - 1):
        bounds = (0, *cuts, layers)
        split = tuple(bounds[i + 1] - bounds[i] for i in range(stages))
        if min(split) < shortest:
            continue
        est = estimate_in(ctx, split)
        if est.fits and (best is None or est.step_time < best.step_time):
            best = est
    return best


def balanced_split(num_layers: int, stages: int) -> tuple[int, ...]:
    """As even as the layers allow: the first num_layers % stages stages take one more."""
    base, extra = divmod(num_layers, stages)
    return tuple(base + (i < extra) for i in range(stages))


def lower_bound(problem: Problem, cfg: ParallelConfig, *, work: tuple[float, float] | None = None) -> float:
    """A step time no split can beat: the slowest stage is at least the mean of the stages, and a
    stage is at least its layers' computation, recomputation and communication, less what the EP all-to-all
    overlap hides in the paired micro-batches (cost/a2a_overlap.py). `work`: `layers_work(problem, cfg)`, which the
    virtual stages do not change, when already known."""
    per_microbatch, hidden = layers_work(problem, cfg) if work is None else work
    m = num_microbatches(cfg, problem.global_batch_size)
    paired = m - unpaired_microbatches(cfg.pp, cfg.vpp, m) if cfg.moe_a2a_overlap else 0.0
    return (pipeline_factor(problem, cfg, m) * per_microbatch - paired * hidden) / cfg.pp


LayerTimes = list[tuple[LayerKind, int, LayerTime]]  # each layer kind, its count and one such layer's times


def layer_times(problem: Problem, cfg: ParallelConfig) -> LayerTimes:
    """Each layer kind's times under `cfg` in Megatron's rank layout; the recompute fields do not change them."""
    spans, net = groups_and_network(problem, cfg, None)
    compute, options = problem.compute_model, layer_options(problem, cfg)
    return [(kind, count, layer_time(problem.model, cfg=cfg, kind=kind, spans=spans, net=net, compute=compute, **options))
            for kind, count in problem.model.kind_counts.items()]


def layers_work(problem: Problem, cfg: ParallelConfig, *, times: LayerTimes | None = None) -> tuple[float, float]:
    """Every layer's computation, recomputation and communication of one micro-batch, s, and what the EP all-to-all
    overlap would hide of it in a paired micro-batch (the same with the overlap or without: `lower_bound` counts it
    with). `times`: `layer_times(problem, cfg)` when already known."""
    per_microbatch = hidden = 0.0
    sm_share = dispatch_sm_share(problem.accelerator.sm_count)
    for kind, count, lt in layer_times(problem, cfg) if times is None else times:
        work = lt.fwd_compute + lt.bwd_compute + lt.tp_comm + lt.cp_comm + lt.ep_comm
        hidden += count * pair_saving(lt, delay_wgrad=problem.delay_wgrad_compute, sm_share=sm_share)
        if cfg.recompute == "selective":
            work += recompute_seconds(lt, problem.model, kind, cfg.recompute_modules)
        elif cfg.recompute == "full" and cfg.recompute_num_layers is None:
            work += lt.fwd
        per_microbatch += count * work
    return per_microbatch, hidden


def context_bound(ctx: Context) -> float:
    """A tighter bound once the configuration is priced on its placement: the stages' fixed parts
    (pipeline transfers, embedding and output layer) join the mean, and the stage with the largest
    fixed part holds at least the lightest layer."""
    c, cfg = ctx.costs, ctx.cfg
    work = np.diff(c.compute + c.tp_comm + c.cp_comm + c.ep_comm - ctx.a2a_paired_share * c.a2a_saving)
    if cfg.recompute == "selective":
        work = work + np.diff(c.selective)
    elif cfg.recompute == "full" and cfg.recompute_num_layers is None:
        work = work + np.diff(c.fwd)
    empty = range_sums(c, cfg, 0, 0)
    kinds = {(s == 0, s == cfg.pp - 1) for s in range(cfg.pp)}
    bodies = {kind: stage_body(ctx, empty, first=kind[0], last=kind[1]) for kind in kinds}
    fixed = []
    for s in range(cfg.pp):
        body = bodies[(s == 0, s == cfg.pp - 1)]
        fixed.append(body["compute"] + body["tp_comm"] + pipeline_p2p(ctx, stage=s))
    slowest = max((work.sum() + sum(fixed)) / cfg.pp, max(fixed) + work.min())
    return ctx.pipeline_factor * slowest


def best_for(ctx: Context, *, cutoff: float = np.inf, memory=None) -> tuple[tuple[int, ...], float] | None:
    """The best split of `ctx`'s configuration and its step time, or None when nothing fits or beats `cutoff`:
    the DP over every split without virtual stages (`memory`: its memory_tables), the best of the searched family
    with them (solver/virtual.py; `memory`: which of the family fit)."""
    if ctx.cfg.vpp == 1:
        return best_split(ctx, cutoff=cutoff, memory=memory)
    return best_virtual_split(ctx, cutoff=cutoff, fitting=memory)


def default_split(cfg: ParallelConfig, num_layers: int) -> tuple[int, ...]:
    """A split to show a configuration by when none was chosen: the most even, or the simplest of the family."""
    family = searched_splits(num_layers, cfg.pp, cfg.vpp) if cfg.vpp > 1 else ()
    return family[0] if family else balanced_split(num_layers, cfg.pp)


def placements(problem: Problem, cfg: ParallelConfig) -> list[np.ndarray | None]:
    """The rank -> device maps a configuration is tried under: Megatron's own layout (None, rank r
    on device r), every other host order torchrun can realise, and with sub-host levels every
    order of the units inside a host (`host_placements`); with TP across hosts, only the orders that
    keep every TP group inside its NVLink domain (cluster.nvlink_level)."""
    topo = problem.topology
    maps = host_placements(cfg.order, decoder_sizes(cfg), topo.devices_per_node, topo.unit_size(0))
    others = maps[1:]
    if cfg.tp > topo.devices_per_node:  # TP spans hosts: only the other host orders that keep it in its NVLink domain
        tp_groups = rank_groups(cfg.order, decoder_sizes(cfg), "tp")
        others = [m for m in others if inside_units(tp_groups, m, topo, topo.domain_level)]
    return [None, *others]


def fields_but(cfg: ParallelConfig, *names: str) -> tuple:
    """`cfg`'s field values except `names`: a cheap key (dataclasses.replace is slow in this loop)."""
    return _getter_but(names)(cfg)


@lru_cache(maxsize=None)
def _getter_but(names: tuple[str, ...]) -> operator.attrgetter:
    """A getter of every field of ParallelConfig but `names` (a handful of ParallelConfig's many), as a tuple."""
    return operator.attrgetter(*(f.name for f in fields(ParallelConfig) if f.name not in names))


def shared_context(problem: Problem, cfg: ParallelConfig, mapping: np.ndarray | None, placement: int,
                   contexts: dict) -> Context:
    """`context(problem, cfg, rank_to_device=mapping)`, built once for the configurations that
    differ only in what the per-layer costs do not see: ZeRO (but for the stream ordering Megatron-FSDP
    changes, layer.ordered_streams), and full recompute against none (both keep the same columns; only
    selective changes the activations a layer keeps, by its modules)."""
    key = (fields_but(cfg, "zero", "recompute", "recompute_num_layers", "recompute_modules"), cfg.selective_modules,
           ordered_streams(cfg), placement)
    base = contexts.get(key)
    if base is None:
        base = contexts[key] = context(problem, cfg, rank_to_device=mapping)
    return base if base.cfg == cfg else replace(base, cfg=cfg)


class Outcome(NamedTuple):
    """One configuration solved under every placement: whether any split fits in memory, and its best
    (step time, placement, split) among those not slower than the cutoff (inf, -1, () when none)."""

    fits: bool
    time: float
    placement: int
    split: tuple[int, ...]


NO_FIT = Outcome(False, np.inf, -1, ())


def solve_config(problem: Problem, cfg: ParallelConfig, cutoff: float, floors: MemoryFloors, contexts: dict,
                 pinned: tuple[int, ...] | None = None) -> Outcome:
    """`cfg`'s fastest placement and split whose step time is at most `cutoff` (equal may still win on
    the visiting order). Memory first: no placement changes it, so a configuration that fits under no
    split is known before any time is priced. A `pinned` split (plan.layers_per_stage) is the only one priced."""
    if not floors.fits(cfg):
        return NO_FIT
    if pinned is not None:
        return _solve_pinned(problem, cfg, cutoff, contexts, pinned)
    best, memory = (np.inf, -1, ()), None
    admit = np.nextafter(cutoff, np.inf)
    for i, mapping in enumerate(placements(problem, cfg)):
        ctx = shared_context(problem, cfg, mapping, i, contexts)
        if i == 0:
            if cfg.vpp > 1:  # which of the searched family fit
                memory = family_fits(ctx, family_sums(ctx, family(ctx)))
                fits = memory.any()
            elif cfg.pp > 1:
                memory = memory_tables(ctx)
                fits = split_fits(memory)
            else:
                fits = fits_in(ctx, (ctx.costs.num_layers,))
            if not fits:
                return NO_FIT
        beat = min(admit, best[0])  # a later placement must be strictly faster than an earlier one
        if context_bound(ctx) >= beat:  # priced on its placement, it cannot make the kept plans
            continue
        found = best_for(ctx, cutoff=beat, memory=memory)
        if found is not None:
            best = (found[1], i, found[0])
    return Outcome(True, *best)


def _solve_pinned(problem: Problem, cfg: ParallelConfig, cutoff: float, contexts: dict,
                  split: tuple[int, ...]) -> Outcome:
    """`solve_config` with the user's split: every placement, that split alone."""
    best = (np.inf, -1, ())
    admit = np.nextafter(cutoff, np.inf)
    for i, mapping in enumerate(placements(problem, cfg)):
        ctx = shared_context(problem, cfg, mapping, i, contexts)
        if i == 0 and not fits_in(ctx, split):
            return NO_FIT
        beat = min(admit, best[0])  # no context_bound here: it assumes each rank holds a layer, a pinned split may not
        est = estimate_in(ctx, split)
        if est.step_time < beat:
            best = (est.step_time, i, split)
    return Outcome(True, *best)


def placed_estimate(problem: Problem, cfg: ParallelConfig, split: tuple[int, ...]) -> Estimate:
    """`cfg` with `split` under its fastest placement, as `solve` places it (ties: the earlier one, Megatron's own
    first), so that `evaluate` of a plan's keys scores what the plan does; Megatron's own when it does not fit."""
    outcome = _solve_pinned(problem, cfg, np.inf, {}, split)
    mapping = placements(problem, cfg)[outcome.placement] if outcome.fits and outcome.placement >= 0 else None
    return estimate_in(context(problem, cfg, rank_to_device=mapping), split)


class Kept:
    """The top_k + 1 fastest distinct rows (row_key: what a runner-up line shows), each by its fastest
    configuration, ranked by (step time, visiting position, placement): equal times go to the one
    visited first, so the rows do not depend on the order in which outcomes arrive."""

    def __init__(self, top_k: int):
        self.size = top_k + 1
        self.rows: dict[tuple, tuple[float, int, int, tuple[int, ...]]] = {}

    def add(self, row: tuple, position: int, outcome: Outcome) -> None:
        entry = (outcome.time, position, outcome.placement, outcome.split)
        if outcome.time == np.inf or (row in self.rows and self.rows[row][:3] <= entry[:3]):
            return
        self.rows[row] = entry
        if len(self.rows) > self.size:
            del self.rows[max(self.rows, key=lambda r: self.rows[r][:3])]

    def cutoff(self) -> float:
        """The step time a configuration must not exceed to enter the kept rows."""
        return max(item[0] for item in self.rows.values()) if len(self.rows) == self.size else np.inf

    def best_time(self) -> float:
        return min((item[0] for item in self.rows.values()), default=np.inf)


RECOMPUTE_FIELDS = ("recompute", "recompute_num_layers", "recompute_modules")


def visiting_order(problem: Problem, space: list[ParallelConfig]) -> list[tuple[float, ParallelConfig]]:
    """The configurations by increasing lower bound (ties: their order in the space). The layers' times are priced once
    for the configurations that differ in what a layer does not see (ZeRO and the EP all-to-all overlap but for the
    stream ordering they set, the virtual stages, the recompute fields), their work once more for each recompute
    choice."""
    times: dict[tuple, LayerTimes] = {}
    works: dict[tuple, tuple[float, float]] = {}
    pending = []
    for i, cfg in enumerate(space):
        layer_key = (fields_but(cfg, "zero", "vpp", "moe_a2a_overlap", *RECOMPUTE_FIELDS), ordered_streams(cfg))
        key = (layer_key, cfg.recompute, cfg.recompute_num_layers, cfg.recompute_modules)
        if key not in works:
            if layer_key not in times:
                times[layer_key] = layer_times(problem, cfg)
            works[key] = layers_work(problem, cfg, times=times[layer_key])
        pending.append((lower_bound(problem, cfg, work=works[key]), i, cfg))
    pending.sort(key=lambda item: item[:2])
    return [(bound, cfg) for bound, _, cfg in pending]


def solve(problem: Problem, solver: SolverConfig, pins: PlanChoice, *, micro_batch_size: int | None,
          progress: Progress | None = None) -> SearchResult:
    """Every configuration of the search space under every placement torchrun can realise, each with its
    best layer split. Configurations are visited by increasing lower bound (which no placement
    changes) and skipped once the bound cannot beat the kept plans; `progress(done, total, best)`
    hears of each."""
    start = time.perf_counter()
    space = [cfg for world in searched_worlds(problem, solver, pins, micro_batch_size=micro_batch_size, any_split=True)
             for cfg in candidates(problem, solver, pins, micro_batch_size=micro_batch_size, any_split=True, world=world)]
    if not space:
        return SearchResult(best=None, runners_up=[], configs_evaluated=0, time_s=time.perf_counter() - start,
                            empty_space=empty_space_reason(problem, solver, pins, micro_batch_size=micro_batch_size,
                                                           any_split=True))
    floors = MemoryFloors(problem)
    too_big_line = no_fit_reason(floors, space)
    if too_big_line is not None:
        return SearchResult(best=None, runners_up=[], configs_evaluated=0, time_s=time.perf_counter() - start,
                            configs_in_space=len(space), too_big=too_big_line)
    pending = visiting_order(problem, space)
    kept = Kept(solver.top_k)
    contexts: dict = {}

    layers = problem.model.cfg.num_layers
    split_given = pins.layers_per_stage is not None or SplitForm.from_fields(pins) is not EVEN

    def split_for(cfg: ParallelConfig) -> tuple[int, ...] | None:  # the pinned split at cfg's pp x vpp
        return pinned_chunks(pins, cfg, num_layers=layers) if split_given else None

    def solve_at(position: int, cutoff: float) -> Outcome:
        cfg = pending[position][1]
        return solve_config(problem, cfg, cutoff, floors, contexts, split_for(cfg))

    def accept(position: int, outcome: Outcome) -> float:
        kept.add(row_key(pending[position][1]), position, outcome)
        return kept.cutoff()

    def sizes(position: int) -> tuple:  # what the placements and their caches depend on
        cfg = pending[position][1]
        return cfg.tp, cfg.cp, cfg.pp, cfg.dp, cfg.ep, cfg.etp, cfg.order

    outcomes = visit([bound for bound, _ in pending], solve_at, accept, jobs=solver.jobs or default_jobs(),
                     progress=progress, best=kept.best_time, group=sizes)
    # Rows that fit under no split though their bound was below the best plan's step time (they might have
    # been faster), the first three by bound: the plan lists them after its runners-up.
    best_time = kept.best_time()
    too_big: dict[tuple, Estimate] = {}
    for position, outcome in sorted(outcomes.items()):
        bound, cfg = pending[position]
        row = row_key(cfg)
        if (not outcome.fits and bound < best_time and row not in kept.rows and row not in too_big
                and len(too_big) < 3):
            split = split_for(cfg) or default_split(cfg, layers)
            too_big[row] = estimate_in(context(problem, cfg), split)
    ranked = []
    for _, position, placement, split in sorted(kept.rows.values(), key=lambda item: item[:3]):
        cfg = pending[position][1]
        ranked.append(estimate_in(context(problem, cfg, rank_to_device=placements(problem, cfg)[placement]), split))
    return SearchResult(
        best=ranked[0] if ranked else None,
        runners_up=ranked[1:] + list(too_big.values()),
        configs_evaluated=len(outcomes),
        time_s=time.perf_counter() - start,
        configs_in_space=len(pending),
    )
