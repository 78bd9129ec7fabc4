"""The DP's layer split is the optimum of the cost model: it equals the best of every split
enumerated by brute force and scored by `estimate`, on random small models (dense and MoE layers
mixed), random 2-4 level clusters, regular or irregular (units of unequal size), and tight memory."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nest_megatron import api
from nest_megatron.config.load import load
from nest_megatron.config.schema import ModelConfig, PlanChoice, SolverConfig
from nest_megatron.cost.evaluate import context, estimate, estimate_in
from nest_megatron.cost.placement import spans_for
from nest_megatron.cost.problem import Problem
from nest_megatron.hardware.accelerator import Accelerator
from nest_megatron.hardware.topology import Level, Topology, irregular
from nest_megatron.launch.megatron_rules import argv_split
from nest_megatron.model.spec import ModelSpec
from nest_megatron.parallel.config import ParallelConfig
from nest_megatron.parallel.ranks import GroupShape, node_permutations
from nest_megatron.parallel.rules import violation
from nest_megatron.solver.bounds import MemoryFloors
from nest_megatron.solver.dp import (
    balanced_split,
    best_for,
    best_split,
    brute_force_split,
    context_bound,
    lower_bound,
    memory_tables,
    placements,
    solve,
    split_fits,
)
from nest_megatron.solver.enumerate import solve as enumerate_solve
from nest_megatron.solver.space import candidates


@st.composite
def trees(draw, levels):
    """An irregular tree over `levels` (host level 0): 2-4 units of level 1 holding 1-3 nodes each,
    grouped into consecutive runs at each level above, one unit at the top."""
    nodes = draw(st.lists(st.integers(1, 3), min_size=2, max_size=4))
    children = [(levels[0].fan_out,) * sum(nodes), tuple(nodes)]
    units = len(nodes)
    for _ in levels[2:-1]:
        runs = []
        while units:
            runs.append(draw(st.integers(1, units)))
            units -= runs[-1]
        children.append(tuple(runs))
        units = len(runs)
    return (*children, (units,)) if len(children) < len(levels) else tuple(children)


@st.composite
def problems(draw):
    moe = draw(st.booleans())
    mla = draw(st.booleans())  # multi-head latent attention: no query groups
    heads = draw(st.sampled_from([2, 4]))
    layers = draw(st.integers(2, 8))
    # dense and MoE layers mixed: every N-th, or any pattern with a MoE layer (first-k-dense and others)
    pattern = st.lists(st.sampled_from([0, 1]), min_size=layers, max_size=layers).filter(lambda x: 1 in x)
    model = ModelSpec(ModelConfig(
        name="random",
        num_layers=layers,
        hidden_size=heads * 16,
        ffn_hidden_size=draw(st.sampled_from([64, 128, 256])),
        num_attention_heads=heads,
        num_query_groups=None if mla else draw(st.sampled_from([1, heads])),
        multi_latent_attention=mla, q_lora_rank=draw(st.sampled_from([None, 32])) if mla else None, kv_lora_rank=16,
        qk_head_dim=16,
        qk_pos_emb_head_dim=8, v_head_dim=16,
        mtp_num_layers=draw(st.sampled_from([None, 1, 2])),  # fixed costs of the last stage
        seq_length=draw(st.sampled_from([32, 64])),
        vocab_size=draw(st.integers(100, 3000)),
        swiglu=draw(st.booleans()),
        untie_embeddings_and_output_weights=draw(st.booleans()),
        position_embedding_type=draw(st.sampled_from(["rope", "learned_absolute"])),
        attention_backend=draw(st.sampled_from(["flash", "unfused"])),
        num_experts=4 if moe else None,
        moe_layer_freq=draw(st.one_of(st.integers(1, 3), pattern)) if moe else 1,
    ))
    num_levels = draw(st.integers(2, 4))
    levels = tuple(
        Level(
            name=f"l{i}",
            fan_out=draw(st.sampled_from([1, 2, 4])),
            bandwidth=draw(st.floats(1e8, 1e11)),
            latency=draw(st.floats(0.0, 1e-4)),
            oversubscription=draw(st.sampled_from([1.0, 2.0])),
        )
        for i in range(num_levels)
    )
    topology = Topology("random", levels)
    if num_levels >= 3 and draw(st.booleans()):
        topology = irregular(topology, draw(trees(levels)))
    devices = topology.num_devices
    stage_counts = [p for p in (2, 3, 4) if p <= model.cfg.num_layers and devices % p == 0]
    pp = draw(st.sampled_from(stage_counts or [1]))
    dp = devices // pp
    zero = draw(st.sampled_from([0, 1, 2, 3] if pp == 1 else [0, 1]))  # Megatron-FSDP (2/3) has no pipeline stages
    ep = draw(st.sampled_from([e for e in (1, 2, 4) if moe and dp % e == 0] or [1]))
    # Megatron-FSDP (ZeRO 2/3) runs with Megatron's default order only; so does EP > 1 with
    # pipeline stages (tp = cp = etp = 1 here: the expert data-parallel size dp / ep must equal dp).
    default_only = zero >= 2 or (ep > 1 and pp > 1)
    cfg = ParallelConfig(
        pp=pp, dp=dp, ep=ep,
        mbs=draw(st.sampled_from([1, 2])),
        zero=zero,
        recompute=draw(st.sampled_from(["none", "selective", "full"])),
        order=draw(st.sampled_from(["tp-cp-ep-dp-pp"] if default_only else ["tp-cp-ep-dp-pp", "tp-cp-ep-pp-dp"])),
    )
    if cfg.recompute == "full" and draw(st.booleans()):
        cfg = ParallelConfig(**{**cfg.__dict__, "recompute_num_layers": 1})
    gbs = cfg.mbs * dp * draw(st.integers(pp, 2 * pp + 2))
    accelerator = Accelerator(
        name="acc", peak_flops=draw(st.floats(1e12, 1e15)), memory_bytes=1e30,
        hbm_bandwidth=draw(st.floats(1e11, 3e12)), gemm_efficiency=0.7, attention_efficiency=0.5,
        memory_bound_efficiency=0.8, reserved_memory_bytes=0.0,
    )
    problem = Problem(model=model, accelerator=accelerator, topology=topology, global_batch_size=gbs,
                      overlap_grad_reduce=draw(st.booleans()), overlap_param_gather=draw(st.booleans()))
    assert violation(cfg, model=model, num_devices=devices, global_batch_size=gbs, any_split=True) is None
    # Tight memory: between the least and the most any stage of the balanced split needs, so that
    # some splits fit and others do not.
    balanced = estimate_in(context(problem, cfg), balanced_split(model.cfg.num_layers, pp))
    least, most = min(m.total for m in balanced.memory), max(m.total for m in balanced.memory)
    capacity = least + draw(st.floats(0.3, 1.5)) * (most - least)
    problem = Problem(**{**problem.__dict__, "accelerator": Accelerator(**{**accelerator.__dict__, "memory_bytes": capacity})})
    return problem, cfg


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems())
def test_dp_split_equals_brute_force(case):
    problem, cfg = case
    ctx = context(problem, cfg)
    found = best_split(ctx)
    brute = brute_force_split(ctx)
    # The memory checks made before any timing: the floor is below every split's peak, and the
    # reachability over the memory tables says whether some split fits.
    layers = problem.model.cfg.num_layers
    peaks = [estimate_in(ctx, tuple(b - a for a, b in zip((0, *cuts), (*cuts, layers)))).peak_memory
             for cuts in itertools.combinations(range(1, layers), cfg.pp - 1)]
    assert MemoryFloors(problem).floor(cfg).total <= min(peaks) * (1 + 1e-12)
    assert cfg.pp == 1 or split_fits(memory_tables(ctx)) == (brute is not None)
    if brute is None:
        assert found is None
        return
    assert found is not None
    split, step = found
    assert step == pytest.approx(brute.step_time, rel=1e-9, abs=1e-15)
    est = estimate_in(ctx, split)
    assert est.fits  # every plan the DP returns fits in memory
    assert est.step_time == pytest.approx(step, rel=1e-9, abs=1e-15)
    # The bounds the search prunes with never exceed the optimum.
    assert lower_bound(problem, cfg) <= step * (1 + 1e-9)
    assert context_bound(ctx) <= step * (1 + 1e-9)


def test_an_uneven_split_when_the_layers_do_not_divide():
    # 10 layers on 4 stages: no even split exists; the DP finds one and Megatron gets the flags for it (the simplest
    # of parallel.layout's forms), which read back as that split.
    p = api.plan(["model=tiny_gpt", "model.num_layers=10", "cluster=dgx_h100_superpod", "cluster.num_devices=16",
                  "train.global_batch_size=64", "plan.pp=4", "plan.tp=1", "plan.cp=1", "plan.vpp=1"])
    assert sum(p.layers_per_stage) == 10 and len(p.layers_per_stage) == 4
    assert argv_split(p.megatron_args, world_size=p.world_size) == tuple(p.layers_per_stage)


def test_plan_uses_the_dp_and_beats_the_even_split_enumerator():
    cell = ["model=tiny_moe", "cluster=dgx_h100_superpod", "cluster.num_devices=16", "train.global_batch_size=64"]
    dp = api.plan(cell)
    brute = api.plan(cell + ["solver=enumerate"])
    assert dp.search["solver"] == "dp" and brute.search["solver"] == "enumerate"
    # The DP's space holds every even split the enumerator scores, so it is never slower.
    assert dp.predicted["step_time_s"] <= brute.predicted["step_time_s"] * (1 + 1e-12)
    assert math.isfinite(dp.predicted["step_time_s"])


def test_node_permutations_lay_pipeline_neighbours_on_adjacent_nodes():
    # 8 ranks, 2 per node, tp 2 x dp 2 x pp 2 in Megatron's tp-cp-ep-dp-pp order: node blocks are
    # (dp, pp) = (0,0) (1,0) (0,1) (1,1). Megatron's layout puts them on nodes 0 1 2 3; the other
    # order puts (dp, pp) = (0,0) (0,1) (1,0) (1,1) there, i.e. block 1 -> node 2, block 2 -> node 1.
    sizes = {"tp": 2, "cp": 1, "ep": 1, "dp": 2, "pp": 2}
    maps = node_permutations("tp-cp-ep-dp-pp", sizes, 2)
    assert [m.tolist() for m in maps] == [[0, 1, 2, 3, 4, 5, 6, 7], [0, 1, 4, 5, 2, 3, 6, 7]]
    # Every map is a permutation of the devices that keeps each node's ranks together.
    for m in node_permutations("tp-cp-ep-dp-pp", {"tp": 2, "cp": 2, "ep": 1, "dp": 8, "pp": 4}, 8):
        assert sorted(m.tolist()) == list(range(128))
        assert all(len(set(m[r:r + 8] // 8)) == 1 for r in range(0, 128, 8))


def test_the_planner_picks_the_faster_node_order():
    # 2 GPUs a node, 2 nodes a rack, 2 racks; the racks are joined by a slow link. A model whose
    # pipeline traffic (seq 2048 activations) outweighs its gradients: pipeline neighbours should
    # share a rack, which only the second node order does (see the test above).
    topology = Topology("two_racks", (Level("node", 2, 100e9, 1e-6), Level("rack", 2, 10e9, 1e-6),
                                      Level("spine", 2, 0.1e9, 1e-6)))
    model = ModelSpec(ModelConfig(name="wide", num_layers=4, hidden_size=256, ffn_hidden_size=512,
                                  num_attention_heads=4, seq_length=2048, vocab_size=256))
    acc = Accelerator(name="acc", peak_flops=1e15, memory_bytes=1e12, hbm_bandwidth=3e12, gemm_efficiency=0.7,
                      attention_efficiency=0.5, memory_bound_efficiency=0.8, reserved_memory_bytes=0.0)
    problem = Problem(model=model, accelerator=acc, topology=topology, global_batch_size=16)
    pins = PlanChoice(tp=2, pp=2, dp=2, cp=1, mbs=1, zero=1, recompute="none", order="tp-cp-ep-dp-pp")
    result = solve(problem, SolverConfig(), pins, micro_batch_size=None)
    cfg = result.best.config
    by_map = {tuple(m): estimate(problem, cfg, layers_per_stage=result.best.layers_per_stage, rank_to_device=m).step_time
              for m in node_permutations(cfg.order, {"tp": 2, "cp": 1, "ep": 1, "dp": 2, "pp": 2}, 2)}
    assert by_map[(0, 1, 4, 5, 2, 3, 6, 7)] < by_map[(0, 1, 2, 3, 4, 5, 6, 7)]
    assert tuple(result.best.rank_to_device) == (0, 1, 4, 5, 2, 3, 6, 7)
    assert result.best.step_time == pytest.approx(min(by_map.values()), rel=1e-12)


@pytest.mark.parametrize("model", ["tiny_gpt", "tiny_moe"])
def test_pruning_keeps_the_optimum(model):
    # Visiting configurations by lower bound, stopping early and cutting stages inside the DP must
    # find the same best plan as solving every configuration of the space (top_k above its size).
    loaded = load([f"model={model}", "model.num_layers=6", "cluster=dgx_h100_superpod", "cluster.num_devices=16",
                   "train.global_batch_size=64"])
    problem, cfg = loaded.problem, loaded.config
    pruned = solve(problem, cfg.solver, cfg.plan, micro_batch_size=None)
    everything = solve(problem, SolverConfig(top_k=10**9), cfg.plan, micro_batch_size=None)
    assert everything.configs_evaluated == everything.configs_in_space > pruned.configs_evaluated
    assert pruned.best.step_time == pytest.approx(everything.best.step_time, rel=1e-12)


def test_the_number_of_recomputed_layers_is_searched_when_asked():
    # solver.recompute_num_layers=[null,1]: full recompute of every layer, or of the first layer of
    # each stage (Megatron's block method).
    cell = ["model=tiny_gpt", "cluster=dgx_h100_superpod", "cluster.num_devices=16", "train.global_batch_size=64",
            "plan.recompute=full", "plan.pp=2", "plan.tp=1", "plan.cp=1"]
    loaded = load(cell + ["solver.recompute_num_layers=[null,1]"])
    space = list(candidates(loaded.problem, loaded.config.solver, loaded.config.plan, micro_batch_size=None, any_split=True))
    assert {c.recompute_num_layers for c in space} == {None, 1}
    # Recomputing one layer of a stage instead of all is faster when both fit (the tiny model fits
    # easily), and Megatron's block method with --recompute-num-layers 1 says so.
    plan = api.plan(cell + ["solver.recompute_num_layers=[null,1]"])
    assert plan.recompute == {"granularity": "full", "method": "block", "num_layers": 1}
    args = plan.megatron_args
    assert args[args.index("--recompute-method") + 1] == "block"
    assert args[args.index("--recompute-num-layers") + 1] == "1"


def test_runners_up_are_the_next_fastest_distinct_rows():
    # 128 GPUs give tiny_gpt many placements of one configuration at the same step time: the plan lists each
    # row a user reads (sizes, mbs, ZeRO, recompute) once, by its fastest configuration, and never the plan's own.
    loaded = load(["model=tiny_gpt", "cluster=dgx_h100_superpod", "cluster.num_devices=128", "train.global_batch_size=128",
                   "solver.top_k=3", "solver.zero_stages=[1]", "solver.recompute=[none]"])
    problem, solver = loaded.problem, loaded.config.solver
    result = solve(problem, solver, PlanChoice(), micro_batch_size=None)
    listed = [result.best, *(e for e in result.runners_up if e.fits)]

    def row(cfg):
        return cfg.tp, cfg.pp, cfg.dp, cfg.cp, cfg.ep, cfg.vpp, cfg.mbs, cfg.zero, cfg.recompute

    # Independently: every configuration under every placement, its best split without cutoffs or pruning.
    fastest_of_row: dict[tuple, float] = {}
    for cfg in candidates(problem, solver, PlanChoice(), micro_batch_size=None, any_split=True):
        for i, mapping in enumerate(placements(problem, cfg)):
            found = best_for(context(problem, cfg, rank_to_device=mapping))
            if found is not None:
                fastest_of_row[row(cfg)] = min(found[1], fastest_of_row.get(row(cfg), math.inf))
    top = sorted(fastest_of_row.values())[: solver.top_k + 1]
    assert len({row(e.config) for e in listed}) == len(listed) == solver.top_k + 1
    assert [e.step_time for e in listed] == pytest.approx(top, rel=1e-12)
    assert [e.step_time for e in listed] == pytest.approx([fastest_of_row[row(e.config)] for e in listed], rel=1e-12)


def test_the_enumerator_lists_distinct_rows_too():
    # tiny_moe on two stages: the two rank orders (and expert TP 1 or 2) of one row are separate configurations.
    loaded = load(["model=tiny_moe", "cluster=dgx_h100_superpod", "cluster.num_devices=16", "train.global_batch_size=64",
                   "plan.pp=2", "solver.top_k=3", "solver.recompute=[none]"])
    problem, solver, pins = loaded.problem, loaded.config.solver, loaded.config.plan
    result = enumerate_solve(problem, solver, pins, micro_batch_size=None)
    listed = [result.best, *(e for e in result.runners_up if e.fits)]

    def row(cfg):
        return cfg.tp, cfg.pp, cfg.dp, cfg.cp, cfg.ep, cfg.vpp, cfg.mbs, cfg.zero, cfg.recompute

    fastest_of_row: dict[tuple, float] = {}  # independently: every configuration scored, the fastest that fits per row
    for cfg in candidates(problem, solver, pins, micro_batch_size=None):
        est = estimate(problem, cfg)
        if est.fits:
            fastest_of_row[row(cfg)] = min(est.step_time, fastest_of_row.get(row(cfg), math.inf))
    assert len({row(e.config) for e in listed}) == len(listed) == solver.top_k + 1
    assert [e.step_time for e in listed] == pytest.approx(sorted(fastest_of_row.values())[: solver.top_k + 1], rel=1e-12)


def test_the_bound_holds_under_every_placement_of_an_expert_group_that_could_leave_its_unit():
    # Kimi K2 on 2,048 H100 of a DGX SuperPOD (8 GPUs a node, 32 nodes a scalable unit) at TP 2 · PP 8 · DP 128 · EP 64
    # with 4 virtual stages: Megatron's rank order keeps each EP group on 8 nodes of one unit; another host order
    # spreads it over 4 nodes in each of two units. The search orders and stops by the bound at Megatron's placement,
    # so no placement may beat it. When every level priced only its own peers' bytes, the spread group's all-to-all
    # was the cheaper (16 of 28 ms a 1.6 GB dispatch: tests/test_cost_terms.py), that placement priced 7.87 s under
    # a 9.19 s bound, and a one-process search skipped the plan two workers found (8.70 s against 7.87 s).
    loaded = load(["model=kimi_k2", "cluster=dgx_h100_superpod", "cluster.num_devices=2048",
                   "train.global_batch_size=4096"])
    problem = loaded.problem
    cfg = ParallelConfig(tp=2, pp=8, dp=128, ep=64, vpp=4, sp=True, mbs=1, zero=1)
    bound = lower_bound(problem, cfg)
    spans = [spans_for(cfg, problem.topology, mapping).ep for mapping in placements(problem, cfg)]
    assert (GroupShape((8.0, 8.0, 1.0)),) in spans and (GroupShape((8.0, 4.0, 2.0)),) in spans  # both shapes tried
    for mapping in placements(problem, cfg):
        found = best_for(context(problem, cfg, rank_to_device=mapping))
        assert found is not None and found[1] >= bound * (1 - 1e-9)
