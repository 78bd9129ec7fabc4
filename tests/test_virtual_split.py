"""The search's uneven splits with virtual stages (solver/virtual.py) are the best of their family by the cost model:
on random small problems (dense and MoE layers mixed, random 2-4 level clusters, tight memory) the answer equals the
best of every member of the family -- enumerated from its definition (solver/README.md) over all chunk splits, and
scored by `estimate` -- and fits; the memory floor and the bounds stay below it."""

from __future__ import annotations

import itertools
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from test_dp_exact import problems

from nest_megatron import api
from nest_megatron.config.load import load
from nest_megatron.cost.evaluate import context, estimate_in
from nest_megatron.launch.megatron_rules import argv_split, violations
from nest_megatron.parallel.config import ParallelConfig
from nest_megatron.parallel.layout import min_stage_layers, rank_layers, searched_splits
from nest_megatron.parallel.rules import violation
from nest_megatron.solver.bounds import MemoryFloors
from nest_megatron.solver.dp import best_for, context_bound, lower_bound
from nest_megatron.solver.virtual import family, family_fits, family_sums


def in_family(chunks: tuple[int, ...], *, pp: int, vpp: int, num_layers: int) -> bool:
    """The family as solver/README.md defines it, tested on one split: every rank holds min_stage_layers; and the
    middle chunks are equal with the first and last at most as large ("ends"), or each rank's chunks are equal,
    the middle ranks' alike and the first and last rank's 1..theirs (any with two ranks) ("first/last")."""
    if min(rank_layers(chunks, pp=pp)) < min_stage_layers(num_layers, pp):
        return False
    middle = set(chunks[1:-1])
    ends = len(middle) == 1 and max(chunks[0], chunks[-1]) <= min(middle)
    per_chunk = [set(chunks[r::pp]) for r in range(pp)]
    if any(len(c) != 1 for c in per_chunk):
        return ends
    s = [c.pop() for c in per_chunk]
    if pp == 2:
        return ends or min(s) >= 1
    return ends or (len(set(s[1:-1])) == 1 and 1 <= s[0] <= s[1] and 1 <= s[-1] <= s[1])


def compositions(total: int, parts: int):
    """Every way to write `total` as `parts` integers >= 0, in order (stars and bars)."""
    for bars in itertools.combinations(range(total + parts - 1), parts - 1):
        edges = (-1, *bars, total + parts - 1)
        yield tuple(edges[i + 1] - edges[i] - 1 for i in range(parts))


@st.composite
def virtual_problems(draw):
    problem, cfg = draw(problems())
    assume(cfg.pp > 1)
    cfg = replace(cfg, vpp=draw(st.sampled_from([2, 3])))
    layers = problem.model.cfg.num_layers
    assume(violation(cfg, model=problem.model, num_devices=problem.num_devices,
                     global_batch_size=problem.global_batch_size, any_split=True) is None)
    assume(cfg.pp * cfg.vpp <= 8 or layers <= 6)  # the brute force enumerates every chunk split
    return problem, cfg


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(virtual_problems())
def test_the_virtual_split_is_the_best_of_its_family(case):
    problem, cfg = case
    layers = problem.model.cfg.num_layers
    ctx = context(problem, cfg)
    members = [c for c in compositions(layers, cfg.pp * cfg.vpp)
               if in_family(c, pp=cfg.pp, vpp=cfg.vpp, num_layers=layers)]
    assert sorted(members) == sorted(searched_splits(layers, cfg.pp, cfg.vpp))  # the generator is the definition
    priced = [estimate_in(ctx, c) for c in members]
    fitting = [e for e in priced if e.fits]
    assert family_fits(ctx, family_sums(ctx, family(ctx))).any() == bool(fitting)  # the memory check made before any timing
    assert MemoryFloors(problem).floor(cfg).total <= min(e.peak_memory for e in priced) * (1 + 1e-12)
    found = best_for(ctx)
    if not fitting:
        assert found is None
        return
    best = min(fitting, key=lambda e: e.step_time)
    assert found is not None
    split, step = found
    assert step == pytest.approx(best.step_time, rel=1e-12, abs=1e-18)
    est = estimate_in(ctx, split)
    assert est.fits and est.step_time == pytest.approx(step, rel=1e-12, abs=1e-18)
    assert lower_bound(problem, cfg) <= step * (1 + 1e-9)
    assert context_bound(ctx) <= step * (1 + 1e-9)


LLAMA_405B = ["model=llama3_70b", "model.num_layers=126", "model.hidden_size=16384", "model.ffn_hidden_size=53248",
              "model.num_attention_heads=128", "model.seq_length=8192", "train.global_batch_size=512",
              "cluster=dgx_h100_superpod", "cluster.num_devices=1024"]


def test_plan_chooses_an_uneven_virtual_split_of_the_405b():
    # 126 layers at pp 8 x vpp 8 have no even split; the family holds three (the embedding and loss counted, or an
    # empty first or last chunk); the plan is the fastest of them that fits on its placement, with its simplest flags.
    pins = ["plan.tp=8", "plan.pp=8", "plan.vpp=8", "plan.cp=1", "plan.mbs=1", "plan.zero=1", "plan.recompute=full",
            "plan.order=tp-cp-ep-dp-pp"]
    plan = api.plan([*LLAMA_405B, *pins])
    p = plan.parallel
    cfg = ParallelConfig(tp=p["tp"], pp=p["pp"], dp=p["dp"], cp=p["cp"], ep=p["ep"], etp=p["etp"], vpp=p["vpp"],
                         sp=p["sp"], mbs=plan.micro_batch_size, zero=plan.zero_stage, recompute="full",
                         order=plan.rank_order)
    ctx = context(load(plan.overrides).problem, cfg, rank_to_device=np.array(plan.rank_to_device))
    priced = {c: estimate_in(ctx, c) for c in searched_splits(126, 8, 8)}
    assert len(priced) == 3 and tuple(plan.layers_per_stage) in priced
    fastest = min((e for e in priced.values() if e.fits), key=lambda e: e.step_time)
    assert plan.predicted["step_time_s"] == pytest.approx(fastest.step_time, rel=1e-12)
    assert argv_split(plan.megatron_args, world_size=plan.world_size) == tuple(plan.layers_per_stage)
    assert violations(plan.megatron_args, world_size=plan.world_size) == []
