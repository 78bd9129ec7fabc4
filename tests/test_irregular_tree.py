"""Partial and irregular trees: N nodes of a cluster whose units they do not fill, priced at the levels
each group really crosses, planned on every device Megatron can use and otherwise with the fewest idle."""

from __future__ import annotations

import pytest

from nest_megatron import api
from nest_megatron.config.load import load
from nest_megatron.config.schema import ModelConfig, PlanChoice, SolverConfig
from nest_megatron.cost.placement import compute_spans
from nest_megatron.cost.problem import Problem
from nest_megatron.errors import NestError
from nest_megatron.hardware.accelerator import Accelerator
from nest_megatron.hardware.topology import Level, Topology, irregular
from nest_megatron.model.spec import ModelSpec
from nest_megatron.parallel.config import ParallelConfig
from nest_megatron.parallel.ranks import identity_placement
from nest_megatron.solver.dp import solve

LEVELS = (Level("node", 2, 100e9, 1e-6), Level("leaf", 2, 10e9, 2e-6), Level("spine", 2, 1e9, 5e-6))


def tree(*nodes_per_leaf: int) -> Topology:
    """2 GPUs a node; leaves holding `nodes_per_leaf` nodes; one spine."""
    return irregular(Topology("t", LEVELS), ((2,) * sum(nodes_per_leaf), nodes_per_leaf, (len(nodes_per_leaf),)))


def test_37_nodes_of_a_superpod_are_a_full_scalable_unit_and_five_nodes():
    topo = load(["model=tiny_gpt", "cluster=dgx_h100_superpod", "cluster.num_devices=296"]).problem.topology
    # 296 GPUs = 37 nodes of 8; scalable units of 32 nodes: one full (GPUs 0-255) and one of 5 (256-295).
    assert topo.num_devices == 296 and topo.children[1] == (32, 5) and topo.children[2] == (2,)
    assert topo.unit_sizes(1) == (256, 40)
    assert (topo.unit_of(1, 255), topo.unit_of(1, 256), topo.unit_of(0, 263), topo.unit_of(0, 264)) == (0, 1, 32, 33)
    # 48 nodes: 32 + 16.
    assert load(["model=tiny_gpt", "cluster=dgx_h100_superpod", "cluster.num_devices=384"]).problem.topology.children[1] == (32, 16)


def test_a_device_count_that_splits_a_node_is_one_line():
    with pytest.raises(NestError, match=r"cluster.num_devices=300: must be a multiple of 8 \(the devices in one node"):
        load(["model=tiny_gpt", "cluster=dgx_h100_superpod", "cluster.num_devices=300"])


def test_groups_are_priced_at_the_levels_they_cross_on_an_irregular_tree():
    # Leaf A holds nodes 0-2 (GPUs 0-5), leaf B node 3 (GPUs 6, 7). TP 2 x DP 2 x PP 2 in tp-cp-ep-dp-pp,
    # rank r on GPU r: rank = tp + 2 dp + 4 pp.
    #   TP {0,1}: node 0 -> fan-in (2, 1, 1), crosses the node only.
    #   DP {0,2}: nodes 0, 1, both leaf A -> (1, 2, 1); DP {4,6}: node 2 (leaf A), node 3 (leaf B) -> (1, 1, 2).
    #   PP: stage 0 on GPUs 0-3 (leaf A), stage 1 on 4-7: GPUs 6, 7 are in leaf B -> the boundary crosses the spine.
    # On the regular tree of two 2-node leaves the same DP groups both stay inside a leaf (level 1).
    cfg = ParallelConfig(tp=2, pp=2, dp=2)
    spans = compute_spans(cfg, tree(3, 1), identity_placement(8))
    assert [s.fan_in for s in spans.tp] == [(2.0, 1.0, 1.0)]
    assert sorted(s.fan_in for s in spans.dp) == [(1.0, 1.0, 2.0), (1.0, 2.0, 1.0)]
    assert spans.pp_boundary_level == (2,)
    assert spans.levels_used(moe=False) == {"tp": 0, "cp": -1, "dp": 2, "pp": 2}
    regular = compute_spans(cfg, Topology("r", LEVELS), identity_placement(8))
    assert regular.levels_used(moe=False) == {"tp": 0, "cp": -1, "dp": 1, "pp": 2}


def _problem(topology: Topology, batch: int) -> Problem:
    model = ModelSpec(ModelConfig(name="m", num_layers=4, hidden_size=64, ffn_hidden_size=256, num_attention_heads=4,
                                  seq_length=64, vocab_size=512))
    acc = Accelerator(name="acc", peak_flops=1e14, memory_bytes=1e12, hbm_bandwidth=2e12, gemm_efficiency=0.7,
                      attention_efficiency=0.5, memory_bound_efficiency=0.8, reserved_memory_bytes=0.0)
    return Problem(model=model, accelerator=acc, topology=topology, global_batch_size=batch)


def test_a_node_count_no_configuration_fills_leaves_the_partial_leaf_idle():
    # 3 nodes of 2 GPUs: leaf A = nodes 0, 1 (GPUs 0-3), leaf B = node 2 (GPUs 4, 5). Batch 4: DP divides 4.
    # 6 GPUs = tp * cp * pp * dp with tp <= 2 (a node), cp a power of two, pp <= 2 (4 layers, >= 2 a stage):
    # the factor 3 must go to dp, which does not divide 4. So no configuration uses all 6; 4 GPUs (two whole
    # nodes) is the most that launches, 2 idle. The search runs ranks on the first devices, i.e. leaf A,
    # so no group reaches the spine.
    problem = _problem(tree(2, 1), batch=4)
    result = solve(problem, SolverConfig(jobs=1), PlanChoice(), micro_batch_size=None)
    best = result.best
    assert best.idle_devices == 2 and best.config.world == 4
    mapping = best.rank_to_device if best.rank_to_device is not None else identity_placement(4)
    assert sorted(mapping) == [0, 1, 2, 3]
    assert max(compute_spans(best.config, problem.topology, mapping).levels_used(moe=False).values()) <= 1


def test_all_devices_when_a_configuration_fills_them():
    # The same tree with batch 12: DP 3 divides it, so 6 GPUs run (TP 2 x DP 3, or DP 6 ...): none idle.
    best = solve(_problem(tree(2, 1), batch=12), SolverConfig(jobs=1), PlanChoice(), micro_batch_size=None).best
    assert best.idle_devices == 0 and best.config.world == 6


@pytest.mark.parametrize("devices", [384, 296])
def test_llama3_70b_plans_on_a_partial_superpod_with_stages_of_two_layers_or_more(devices):
    plan = api.plan(["model=llama3_70b", "cluster=dgx_h100_superpod", f"cluster.num_devices={devices}"])
    assert plan.num_devices == devices
    assert plan.world_size + plan.idle_devices == devices
    assert min(plan.layers_per_stage) >= 2


def test_a_pinned_pp37_splits_80_layers_into_twos_and_threes():
    # 80 layers on 37 stages: at least 2 a stage (74), the 6 left over as stages of 3.
    plan = api.plan(["model=llama3_70b", "cluster=dgx_h100_superpod", "cluster.num_devices=296", "plan.pp=37",
                     "plan.tp=1", "plan.cp=4", "plan.dp=2", "solver.zero_stages=[1]", "solver.recompute=[none]"])
    assert sorted(set(plan.layers_per_stage)) == [2, 3] and plan.layers_per_stage.count(3) == 6


def test_a_pinned_pp_beyond_half_the_layers_still_gets_one_layer_stages():
    # tiny_gpt has 4 layers: plan.pp=4 can only be stages of one layer.
    plan = api.plan(["model=tiny_gpt", "cluster=dgx_h100_superpod", "cluster.num_devices=16", "plan.pp=4", "plan.tp=1",
                     "plan.cp=1", "train.global_batch_size=64"])
    assert plan.layers_per_stage == [1, 1, 1, 1]


HIERARCHICAL = ["a100_pcie_bridged", "dgx_a100_superpod", "dgx_h100_superpod", "h100_spine_leaf", "tpuv4_fat_tree"]


@pytest.mark.slow
@pytest.mark.parametrize("cluster", HIERARCHICAL)
@pytest.mark.parametrize("nodes", [7, 13, 37, 100])
def test_awkward_node_counts_plan_on_every_shipped_hierarchical_cluster(cluster, nodes):
    # Every shipped hierarchical cluster has 8 devices a host.
    plan = api.plan(["model=llama3_8b", f"cluster={cluster}", f"cluster.num_devices={8 * nodes}"])
    pp = plan.parallel["pp"]  # layers_per_stage: per model chunk with virtual stages (chunk k pp + rank: the rank's k-th)
    assert plan.num_devices == 8 * nodes and min(sum(plan.layers_per_stage[rank::pp]) for rank in range(pp)) >= 2
    assert (plan.world_size) % 8 == 0  # whole nodes run; the rest are idle


def test_an_awkward_host_count_also_searches_the_nearest_host_counts_with_a_small_odd_part():
    from nest_megatron.solver.space import searched_worlds

    def worlds(nodes: int, *extra: str) -> list[int]:
        loaded = load(["model=llama3_8b", "cluster=dgx_h100_superpod", f"cluster.num_devices={8 * nodes}", *extra])
        return searched_worlds(loaded.problem, loaded.config.solver, PlanChoice(), micro_batch_size=None, any_split=True)

    # 15 nodes: 120 GPUs launch (TP 8 x PP 15 or TP 4 x PP 15 x DP 2: 32 layers, >= 2 a stage). 15's odd part is
    # 15, so the search also runs the most nodes of the form 2^k x m below it: 8 (m 1), 12 (3), 10 (5), 14 (7).
    assert worlds(15) == [120, 64, 96, 80, 112]
    # 16 and 12 nodes (odd parts 1 and 3) search only their own world.
    assert worlds(16) == [128] and worlds(12) == [96]
    # solver.allow_idle=false (an elastic launch): every device or nothing. 15 nodes fill (above). 37 nodes,
    # 296 = 8 x 37 GPUs, do not: TP, CP and DP (of a batch of 4,096) are powers of two, so PP would be 37,
    # more than 32 layers at 2 a stage allow.
    assert worlds(15, "solver.allow_idle=false") == [120]
    assert worlds(37, "solver.allow_idle=false") == []
