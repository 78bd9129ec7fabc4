"""The first planner: score every configuration of the search space, keep the fastest that fits."""

from __future__ import annotations

import heapq
import time
from dataclasses import dataclass

from nest_megatron.config.schema import PlanChoice, SolverConfig
from nest_megatron.cost.evaluate import Estimate, estimate
from nest_megatron.cost.memory import memory_per_stage
from nest_megatron.cost.problem import Problem
from nest_megatron.cost.tables import layer_costs, stage_sums
from nest_megatron.parallel.rules import num_microbatches
from nest_megatron.solver.space import candidates


@dataclass
class SearchResult:
    best: Estimate | None
    runners_up: list[Estimate]  # the next fastest plans that fit, then some that did not
    configs_evaluated: int  # configurations scored
    time_s: float
    configs_in_space: int = 0  # configurations the space holds (pruned ones included)


def fits_in_memory(problem: Problem, cfg) -> bool:
    """Memory of every stage under the even split, checked before the (costlier) timing."""
    model, acc = problem.model, problem.accelerator
    costs = layer_costs(model, cfg, spans=None, net=None, compute=None)
    split = (model.cfg.num_layers // cfg.pp,) * cfg.pp
    m = num_microbatches(cfg, problem.global_batch_size)
    sums = [stage_sums(costs, cfg, split, i) for i in range(cfg.pp)]
    memory = memory_per_stage(model, cfg, sums, num_microbatches=m, reserved_bytes=acc.reserved_memory_bytes,
                              act_rebuilt=costs.act_rebuilt)
    return all(stage.total <= acc.memory_bytes for stage in memory)


def solve(problem: Problem, solver: SolverConfig, pins: PlanChoice, *, micro_batch_size: int | None) -> SearchResult:
    start = time.perf_counter()
    fastest: list[tuple[float, int, Estimate]] = []  # a max-heap of the top_k fitting plans
    too_big: list[Estimate] = []
    evaluated = 0
    for i, cfg in enumerate(candidates(problem, solver, pins, micro_batch_size=micro_batch_size)):
        evaluated += 1
        if not fits_in_memory(problem, cfg):
            if len(too_big) < solver.top_k:
                too_big.append(estimate(problem, cfg))
            continue
        est = estimate(problem, cfg)
        heapq.heappush(fastest, (-est.step_time, i, est))
        if len(fastest) > solver.top_k + 1:
            heapq.heappop(fastest)
    ranked = [e for _, _, e in sorted(fastest, key=lambda x: -x[0])]
    best = ranked[0] if ranked else None
    return SearchResult(best=best, runners_up=ranked[1:] + too_big[:3], configs_evaluated=evaluated,
                        time_s=time.perf_counter() - start, configs_in_space=evaluated)
