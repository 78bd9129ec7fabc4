"""The solver's rank -> device search inside a host: with sub-host levels (NVLink pairs, PCIe
switches), the order of the units inside a host is searched, and its best equals the best of
every unit permutation (brute force over the same cost model)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from nest_megatron import api
from nest_megatron.config.load import load
from nest_megatron.cost.evaluate import estimate
from nest_megatron.cost.placement import Spans
from nest_megatron.errors import NestError
from nest_megatron.launch.placement import host_assignments
from nest_megatron.parallel.config import ParallelConfig
from nest_megatron.parallel.ranks import host_placements, identity_placement, sizes_inside
from nest_megatron.plan import Plan
from nest_megatron.solver.dp import placements

# One 8-GPU PCIe host: NVLink-bridged pairs, two pairs per PCIe switch, two switches per host
# (host_level 2), two hosts on a slow network. The numbers make the level a group crosses matter.
LEVELS = ("cluster.levels=[{name: pair, fan_out: 2, bandwidth_gb_per_s: 100, latency_s: 3.0e-6},"
          "{name: switch, fan_out: 2, bandwidth_gb_per_s: 20, latency_s: 5.0e-6},"
          "{name: host, fan_out: 2, bandwidth_gb_per_s: 5, latency_s: 8.0e-6},"
          "{name: net, fan_out: 2, bandwidth_gb_per_s: 2, latency_s: 1.0e-5}]")
PCIE = ["model=tiny_gpt", "cluster=dgx_h100_superpod", LEVELS, "cluster.host_level=2", "cluster.num_devices=16",
        "train.global_batch_size=64"]


def test_sizes_inside_a_host():
    # tp-cp-ep-dp-pp with tp 2, dp 4, pp 2 on 8-device hosts: tp and dp fill a host (2 x 4 = 8).
    assert sizes_inside("tp-cp-ep-dp-pp", {"tp": 2, "dp": 4, "pp": 2}, 8) == {"tp": 2, "dp": 4}
    # dp 8 straddles the host: its first 4 values sit inside.
    assert sizes_inside("tp-cp-ep-dp-pp", {"tp": 2, "dp": 8, "pp": 1}, 8) == {"tp": 2, "dp": 4}


def test_host_placements_permute_units_inside_a_host():
    # tp 2 in a pair, dp 2 and pp 2 across the four pairs of the host: two orders of (dp, pp).
    maps = host_placements("tp-cp-ep-dp-pp", {"tp": 2, "dp": 2, "pp": 2}, 8, 2)
    assert [m.tolist() for m in maps] == [
        [0, 1, 2, 3, 4, 5, 6, 7],  # Megatron's: dp neighbours share a switch
        [0, 1, 4, 5, 2, 3, 6, 7],  # pp neighbours share a switch: rank 2 (dp 1, pp 0) moves to pair 2
    ]
    # Without sub-host levels nothing is added.
    assert len(host_placements("tp-cp-ep-dp-pp", {"tp": 2, "dp": 2, "pp": 2}, 8, 8)) == 1


def test_host_level_must_name_a_level():
    with pytest.raises(NestError, match="cluster.host_level=4: must name one of the 4 levels"):
        load([*PCIE[:-1], "cluster.host_level=4", "train.global_batch_size=64"])


@pytest.mark.parametrize("order", ["tp-cp-ep-dp-pp", "tp-cp-ep-pp-dp"])
def test_searched_placements_reach_the_best_unit_permutation(order):
    problem = load(PCIE).problem
    assert problem.topology.devices_per_node == 8
    cfg = ParallelConfig(tp=2, pp=2, dp=4, sp=True, mbs=1, zero=1, order=order)
    searched = min(estimate(problem, cfg, rank_to_device=m).step_time for m in placements(problem, cfg))
    # Brute force: every order of the 4 pairs inside each host (the same in both hosts), and both
    # host orders; a pair's two GPUs are interchangeable in the cost model.
    best = np.inf
    for units in itertools.permutations(range(4)):
        inside = np.array([2 * u + g for u in units for g in (0, 1)])
        for hosts in ((0, 1), (1, 0)):
            mapping = np.array([8 * hosts[r // 8] + inside[r % 8] for r in range(16)])
            best = min(best, estimate(problem, cfg, rank_to_device=mapping).step_time)
    assert searched == pytest.approx(best, rel=1e-12)
    if order == "tp-cp-ep-pp-dp":
        # Megatron's layout puts pipeline neighbours on one switch and data-parallel peers across
        # the host; the searched order inside the host is faster.
        assert searched < estimate(problem, cfg).step_time


def test_plan_inside_host_order_is_launchable():
    # the configuration the test above finds faster with a searched order inside the host
    pins = ["plan.tp=2", "plan.pp=2", "plan.dp=4", "plan.order=tp-cp-ep-pp-dp", "plan.mbs=1", "plan.zero=1", "plan.sp=true"]
    plan = Plan.from_dict(api.plan([*PCIE, *pins]).to_dict())
    assert plan.rank_to_device != list(range(16))
    hosts = host_assignments(plan, ["h0", "h1"])
    # Every rank lands on its planned device: torchrun's global rank node_rank * 8 + local_rank
    # sees CUDA_VISIBLE_DEVICES[local_rank] on its host.
    for a in hosts:
        for local, device in enumerate(a.cuda_visible_devices):
            assert plan.rank_to_device[a.node_rank * 8 + local] == 8 * ["h0", "h1"].index(a.host) + device


def test_shipped_pcie_cluster_has_hosts_of_eight():
    topology = load(["model=tiny_gpt", "cluster=a100_pcie_bridged", "cluster.num_devices=32"]).problem.topology
    # 2 (pair) x 2 (switch) x 2 (host) devices per host; 32 devices: 4 hosts under the network level.
    assert topology.devices_per_node == 8
    assert [lv.fan_out for lv in topology.levels] == [2, 2, 2, 4]


@pytest.mark.parametrize("cluster, devices", [("gb200_nvl72", 1152), ("dgx_h100_superpod", 2048),
                                              ("h100_spine_leaf", 640)])
def test_the_shapes_shared_across_configurations_are_each_configuration_s_own(cluster, devices):
    """Rank r on device r, a group's shapes are looked up by the sizes up to its dimension and the world
    (cost/placement.py identity_key): equal to the shapes of that configuration's own groups on the identity map,
    for every kind of group, both rank orders, idle devices and irregular group counts (120 configurations each)."""
    topology = load([f"cluster={cluster}", f"cluster.num_devices={devices}", "model=tiny_moe"]).problem.topology
    rng = np.random.default_rng(0)
    checked = 0
    while checked < 120:
        tp, cp, pp = (int(rng.choice(values)) for values in ([1, 2, 4, 8], [1, 2, 4], [1, 2, 3, 4, 8, 16]))
        if devices % (tp * cp * pp):
            continue
        dp = int(rng.integers(1, devices // (tp * cp * pp) + 1))  # some devices idle
        etp = int(rng.choice([1, tp]))
        ep = int(rng.choice([e for e in (1, 2, 4, 8, 16, 32, 64) if (tp * cp * dp) % (e * etp) == 0]))
        cfg = ParallelConfig(tp=tp, cp=cp, pp=pp, dp=dp, ep=ep, etp=etp,
                             order=str(rng.choice(["tp-cp-ep-dp-pp", "tp-cp-ep-pp-dp"])))
        shared, own = Spans(cfg, topology, None), Spans(cfg, topology, identity_placement(cfg.world))
        for kind in ("tp", "cp", "dp", "ep", "etp", "edp", "pp_boundary_level"):
            assert getattr(shared, kind) == getattr(own, kind), (cfg, kind)
        checked += 1


def test_optimizer_instances_shard_inside_a_node_and_replicate_across():
    """tp 1, dp 16 on two DGX H100 nodes with 2 optimizer instances: each instance is one node's 8 GPUs (its group
    stays on NVLink, level 0) and a shard's two replicas sit on the two nodes (level 1); with one instance the whole
    group crosses the nodes and there is no replica to reach. ZeRO-1's weight all-gather, within an instance, then
    stays on NVLink: the same bytes in less time (the gradients pay an all-reduce across the nodes instead)."""
    loaded = load(["model=llama3_8b", "cluster=dgx_h100_superpod", "cluster.num_devices=16"])
    topology = loaded.problem.topology
    two = Spans(ParallelConfig(dp=16, zero=1, distributed_optimizer_instances=2), topology, None)
    one = Spans(ParallelConfig(dp=16, zero=1), topology, None)
    assert [s.top_level for s in two.dp_instance] == [0] and [s.top_level for s in two.dp_across] == [1]
    assert [s.size for s in two.dp_instance] == [8] and [s.size for s in two.dp_across] == [2]
    assert [s.top_level for s in one.dp_instance] == [1] and [s.top_level for s in one.dp_across] == [-1]
    pins = ["model=llama3_8b", "cluster=dgx_h100_superpod", "cluster.num_devices=16", "plan.tp=1", "plan.dp=16",
            "plan.zero=1", "plan.mbs=1", "plan.recompute=full", "train.overlap_grad_reduce=false",
            "train.overlap_param_gather=false"]
    sync = [api.evaluate([*pins, f"plan.distributed_optimizer_instances={n}"]).predicted["breakdown"] for n in (1, 2)]
    assert sync[1]["dp_param_gather"] < sync[0]["dp_param_gather"]
