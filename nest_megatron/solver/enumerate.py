"""The first planner: score every configuration of the search space, keep the fastest that fits."""

from __future__ import annotations

import time
from dataclasses import dataclass

from nest_megatron.config.schema import PlanChoice, SolverConfig
from nest_megatron.cost.evaluate import Estimate, estimate
from nest_megatron.cost.memory import memory_per_stage
from nest_megatron.cost.problem import Problem
from nest_megatron.cost.tables import layer_costs, stage_sums
from nest_megatron.parallel.config import ParallelConfig
from nest_megatron.parallel.rules import num_microbatches
from nest_megatron.solver.bounds import MemoryFloors, no_fit_reason
from nest_megatron.solver.space import candidates, empty_space_reason, pinned_chunks, searched_worlds
from nest_megatron.solver.visit import Progress


@dataclass
class SearchResult:
    best: Estimate | None
    runners_up: list[Estimate]  # the next fastest plans that fit, then some that did not
    configs_evaluated: int  # configurations scored
    time_s: float
    configs_in_space: int = 0  # configurations the space holds (pruned ones included)
    empty_space: str | None = None  # when it holds none: the Megatron rule that rules them out, as one line
    too_big: str | None = None  # when no configuration can fit, whatever its split: the memory it needs at least


def fits_in_memory(problem: Problem, cfg, split: tuple[int, ...] | None = None) -> bool:
    """Memory of every stage under the even split (or `split`), checked before the (costlier) timing."""
    model, acc = problem.model, problem.accelerator
    costs = layer_costs(model, cfg, spans=None, net=None, compute=None)
    split = split or (model.cfg.num_layers // cfg.pp,) * cfg.pp
    m = num_microbatches(cfg, problem.global_batch_size)
    sums = [stage_sums(costs, cfg, split, i) for i in range(cfg.pp)]
    memory = memory_per_stage(model, cfg, sums, num_microbatches=m, reserved_bytes=acc.reserved_memory_bytes,
                              act_rebuilt=costs.act_rebuilt)
    return all(stage.total <= acc.memory_bytes for stage in memory)


def row_key(cfg: ParallelConfig) -> tuple:
    """What a runner-up row shows the user (plan.summary, report/explain.py describe): configurations that
    differ only elsewhere (rank order, placement, expert TP, recomputed layers) read as the same row."""
    return cfg.tp, cfg.pp, cfg.dp, cfg.cp, cfg.ep, cfg.vpp, cfg.mbs, cfg.zero, cfg.recompute


def solve(problem: Problem, solver: SolverConfig, pins: PlanChoice, *, micro_batch_size: int | None,
          progress: Progress | None = None) -> SearchResult:
    start = time.perf_counter()
    space = [cfg for world in searched_worlds(problem, solver, pins, micro_batch_size=micro_batch_size)
             for cfg in candidates(problem, solver, pins, micro_batch_size=micro_batch_size, world=world)]
    too_big_line = no_fit_reason(MemoryFloors(problem), space)
    if too_big_line is not None:
        return SearchResult(best=None, runners_up=[], configs_evaluated=0, time_s=time.perf_counter() - start,
                            configs_in_space=len(space), too_big=too_big_line)
    fastest: dict[tuple, tuple[float, int, Estimate]] = {}  # row -> its fastest plan that fits, in order found
    too_big: dict[tuple, Estimate] = {}
    evaluated, best_time = 0, float("inf")
    layers = problem.model.cfg.num_layers
    for i, cfg in enumerate(space):
        split = pinned_chunks(pins, cfg, num_layers=layers)  # the plan.* keys' split, else the even split
        evaluated += 1
        if progress is not None:
            progress(evaluated, len(space), best_time)
        row = row_key(cfg)
        if not fits_in_memory(problem, cfg, split):
            if len(too_big) < 3 and row not in too_big:
                too_big[row] = estimate(problem, cfg, layers_per_stage=split)
            continue
        est = estimate(problem, cfg, layers_per_stage=split)
        if row not in fastest or est.step_time < fastest[row][0]:
            fastest[row] = (est.step_time, i, est)
        best_time = min(best_time, est.step_time)
    ranked = [e for _, _, e in sorted(fastest.values(), key=lambda item: item[:2])[: solver.top_k + 1]]
    best = ranked[0] if ranked else None
    runners_up = ranked[1:] + [est for row, est in too_big.items() if best is None or row != row_key(best.config)]
    empty = empty_space_reason(problem, solver, pins, micro_batch_size=micro_batch_size) if not evaluated else None
    return SearchResult(best=best, runners_up=runners_up, configs_evaluated=evaluated,
                        time_s=time.perf_counter() - start, configs_in_space=evaluated, empty_space=empty)
