"""The configurations a planner searches: every Megatron-launchable one, within the user's pins."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

from nest_megatron.config.schema import PlanChoice, SolverConfig
from nest_megatron.cost.problem import Problem
from nest_megatron.errors import NestError
from nest_megatron.parallel.config import ParallelConfig
from nest_megatron.parallel.rules import violation


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def evaluate_config(problem: Problem, choice: PlanChoice, *, default_mbs: int | None) -> ParallelConfig:
    """The one configuration `evaluate` scores: the user's choice, Megatron's defaults elsewhere."""
    tp, pp, cp = choice.tp or 1, choice.pp or 1, choice.cp or 1
    dp = choice.dp or problem.num_devices // (tp * cp * pp)
    cfg = ParallelConfig(
        tp=tp, pp=pp, cp=cp, dp=max(dp, 1),
        ep=choice.ep or 1,
        etp=choice.etp or (tp if problem.model.is_moe else 1),
        vpp=choice.vpp or 1,
        sp=choice.sp if choice.sp is not None else tp > 1,
        mbs=choice.mbs or default_mbs or 1,
        zero=choice.zero if choice.zero is not None else 1,
        recompute=choice.recompute or "none",
        recompute_num_layers=choice.recompute_num_layers,
        order=choice.order or "tp-cp-ep-dp-pp",
    )
    problem_line = violation(cfg, model=problem.model, num_devices=problem.num_devices, global_batch_size=problem.global_batch_size)
    if problem_line:
        raise NestError(f"invalid configuration: {problem_line}")
    return cfg


def candidates(
    problem: Problem, solver: SolverConfig, pins: PlanChoice, *, micro_batch_size: int | None, any_split: bool = False
) -> Iterator[ParallelConfig]:
    """Every configuration that uses all devices, satisfies Megatron's rules and the pins; with
    `any_split`, also those whose layers only split unevenly over the stages."""
    model, devices = problem.model, problem.num_devices
    node = problem.topology.devices_per_node

    def axis(pinned, values):
        return [pinned] if pinned is not None else values

    tps = axis(pins.tp, [t for t in divisors(node) if model.heads % t == 0 and model.query_groups % t == 0])
    cps = axis(pins.cp, [c for c in (1, 2, 4, 8, 16, 32) if c <= solver.max_context_parallel])
    pps = axis(pins.pp, [p for p in divisors(devices) if p <= model.cfg.num_layers] if any_split
               else divisors(model.cfg.num_layers))
    mbss = axis(pins.mbs, [micro_batch_size] if micro_batch_size else list(solver.micro_batch_sizes))
    zeros = axis(pins.zero, list(solver.zero_stages))
    recomputes = axis(pins.recompute, list(solver.recompute))
    recomputed_counts = axis(pins.recompute_num_layers, list(solver.recompute_num_layers))
    for tp, cp, pp in itertools.product(tps, cps, pps):
        if devices % (tp * cp * pp):
            continue
        dp = pins.dp or devices // (tp * cp * pp)
        experts = model.cfg.num_experts or 1
        eps = axis(pins.ep, [e for e in divisors(experts) if (tp * cp * dp) % e == 0])
        etps = axis(pins.etp, sorted({1, tp}) if model.is_moe else [1])
        sps = axis(pins.sp, [tp > 1])
        vpps = axis(pins.vpp, [v for v in range(1, solver.max_virtual_stages + 1) if v == 1 or pp > 1])
        # With one pipeline stage or one replica both Megatron orders build the same groups.
        orders = axis(pins.order, list(solver.rank_orders) if pp > 1 and dp > 1 else solver.rank_orders[:1])
        for ep, etp, sp, vpp, mbs, zero, recompute, order in itertools.product(eps, etps, sps, vpps, mbss, zeros, recomputes, orders):
            for recomputed in recomputed_counts if recompute == "full" else [None]:
                cfg = ParallelConfig(tp=tp, pp=pp, dp=dp, cp=cp, ep=ep, etp=etp, vpp=vpp, sp=sp, mbs=mbs, zero=zero,
                                     recompute=recompute, recompute_num_layers=recomputed, order=order)
                if violation(cfg, model=model, num_devices=devices, global_batch_size=problem.global_batch_size,
                             any_split=any_split) is None:
                    yield cfg
