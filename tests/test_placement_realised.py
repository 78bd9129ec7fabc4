"""nest_megatron/launch/placement.py: the plan's rank -> device map becomes torchrun node ranks and
CUDA_VISIBLE_DEVICES, checked on hand-worked maps and then for real: torchrun agents on loopback, one
per "host" of two devices (two hosts with a map permuted by hand, four with the planner's own node
permutation), run megatron-core's initialize_model_parallel (gloo) through scripts/pretrain_gpt.py,
and every process's TP/PP/DP/CP groups are compared with the plan's; a third run puts one TP group of 4 across two
hosts of an NVLink domain (gb200_nvl72's rack, trays of 2 here)."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from nest_megatron import api
from nest_megatron.errors import NestError
from nest_megatron.launch.placement import HostAssignment, assignments_for_map, host_assignments, master_host
from nest_megatron.parallel.ranks import rank_groups

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "pretrain_gpt.py"
HOSTS = ["hostA", "hostB"]


def summary(assignments: list[HostAssignment]) -> list[tuple]:
    return [(a.host, a.node_rank, a.nnodes, a.nproc_per_node, a.cuda_visible_devices) for a in assignments]


# --- hand-worked maps: 2 hosts x 2 devices; device d is GPU d % 2 of host d // 2 ---------------------------
def test_identity_map_is_torchruns_default():
    # Ranks 0,1 on hostA's GPUs 0,1; ranks 2,3 on hostB's: node ranks in host order, GPUs in order.
    got = assignments_for_map([0, 1, 2, 3], 4, HOSTS)
    assert summary(got) == [("hostA", 0, 2, 2, (0, 1)), ("hostB", 1, 2, 2, (0, 1))]
    assert got[0].env() == {"CUDA_VISIBLE_DEVICES": "0,1"}
    assert master_host(got) == "hostA"


def test_node_permutation_swaps_node_ranks():
    # Ranks 0,1 on devices 2,3 (hostB), ranks 2,3 on devices 0,1 (hostA): hostA must be torchrun
    # node 1 and hostB node 0, which also hosts the rendezvous.
    got = assignments_for_map([2, 3, 0, 1], 4, HOSTS)
    assert summary(got) == [("hostA", 1, 2, 2, (0, 1)), ("hostB", 0, 2, 2, (0, 1))]
    assert master_host(got) == "hostB"


def test_gpu_permutation_inside_a_node_orders_cuda_visible_devices():
    # Rank 0 on device 1 (hostA GPU 1), rank 1 on device 0: hostA lists GPU 1 first so that local
    # rank 0 (global rank 0) opens GPU 1; the same on hostB for ranks 2 -> device 3, 3 -> device 2.
    got = assignments_for_map([1, 0, 3, 2], 4, HOSTS)
    assert summary(got) == [("hostA", 0, 2, 2, (1, 0)), ("hostB", 1, 2, 2, (1, 0))]
    assert got[1].env() == {"CUDA_VISIBLE_DEVICES": "1,0"}


def test_both_permutations_at_once():
    # [3, 2, 1, 0]: hostA (devices 0,1) holds ranks 3 (device 0) and 2 (device 1): node rank 1, and
    # local rank 0 = global rank 2 sits on GPU 1 -> CUDA_VISIBLE_DEVICES=1,0. hostB likewise node 0.
    got = assignments_for_map([3, 2, 1, 0], 4, HOSTS)
    assert summary(got) == [("hostA", 1, 2, 2, (1, 0)), ("hostB", 0, 2, 2, (1, 0))]


def test_idle_host_runs_nothing():
    # 3 hosts x 2 devices, 4 ranks on devices 2..5: hostA idle, hostB node 0, hostC node 1.
    got = assignments_for_map([2, 3, 4, 5], 6, ["hostA", "hostB", "hostC"])
    assert summary(got) == [("hostA", None, 2, 2, ()), ("hostB", 0, 2, 2, (0, 1)), ("hostC", 1, 2, 2, (0, 1))]
    assert got[0].idle and got[0].env() == {}


@pytest.mark.parametrize(
    "mapping, num_devices, hosts, words",
    [
        # hostA would hold ranks 0 and 2: torchrun node 0 holds ranks 0,1 and they must share a host.
        ([0, 2, 1, 3], 4, HOSTS, "torchrun cannot realise this placement: host hostA holds ranks [0, 2]"),
        # 4 ranks on hostA, 2 on hostB: torchrun starts the same number of processes on every node.
        ([0, 1, 2, 3, 4, 5], 8, HOSTS, "same number of processes on every node"),
        ([0, 0, 1, 2], 4, HOSTS, "each rank its own device in 0..3"),
        ([0, 1, 2, 4], 4, HOSTS, "each rank its own device in 0..3"),
        ([0, 1, 2, 3], 4, ["h", "h"], "name a host twice"),
        ([0, 1, 2], 3, HOSTS, "3 devices do not spread evenly over 2 hosts"),
        ([0, 1], 2, [], "no hosts"),
    ],
)
def test_unrealisable_or_bad_maps_are_one_line_errors(mapping, num_devices, hosts, words):
    with pytest.raises(NestError) as err:
        assignments_for_map(mapping, num_devices, hosts)
    assert words in str(err.value) and "\n" not in str(err.value)


def test_solver_permuted_plan():
    # 4 nodes of 2 GPUs, 2 nodes a rack, PP=2 x DP=4 in order tp-cp-ep-dp-pp (rank = dp + 4 * pp).
    # torchrun's order would put stage 0 (ranks 0-3) in rack 0 and stage 1 in rack 1, so every
    # pipeline transfer crosses racks; the planner instead swaps nodes 1 and 2, so that rack 0 holds
    # ranks 0,1,4,5 (both stages of DP ranks 0,1): pipeline transfers stay in the rack.
    # (Pinned to one chunk a rank and that order: with virtual stages the sends hide behind the next
    # chunk, and Megatron's own layout is as fast.)
    plan = api.plan(["model=tiny_gpt", "cluster=h100_spine_leaf", "cluster.levels.0.fan_out=2",
                     "cluster.levels.1.fan_out=2", "cluster.num_devices=8", "train.global_batch_size=8", "plan.pp=2",
                     "plan.vpp=1", "plan.order=tp-cp-ep-dp-pp"])
    assert plan.rank_to_device == [0, 1, 4, 5, 2, 3, 6, 7]
    got = host_assignments(plan, ["n0", "n1", "n2", "n3"])
    # Host n1 (devices 2,3) holds ranks 4,5 -> node rank 2; n2 (devices 4,5) holds ranks 2,3 -> node 1.
    assert [(a.host, a.node_rank, a.cuda_visible_devices) for a in got] == [
        ("n0", 0, (0, 1)), ("n1", 2, (0, 1)), ("n2", 1, (0, 1)), ("n3", 3, (0, 1))]


# --- the real thing: torchrun agents on loopback, one per host -----------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_agents(assignments: list[HostAssignment], script_args: list[str], dump_root: Path, timeout_s: float = 240):
    """One torchrun agent per host (static rendezvous, so that --node-rank is honoured), each a
    separate process group that is killed whole if anything goes wrong."""
    port = free_port()
    procs = []
    try:
        for a in assignments:
            env = {**os.environ, **a.env(), "NEST_DUMP_GROUPS": str(dump_root / a.host), "OMP_NUM_THREADS": "1"}
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(a.nnodes),
                   "--nproc-per-node", str(a.nproc_per_node), "--node-rank", str(a.node_rank),
                   "--master-addr", "127.0.0.1", "--master-port", str(port), str(SCRIPT), *script_args]
            procs.append(subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                          text=True, start_new_session=True))
        outputs = [p.communicate(timeout=timeout_s)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    for p, out in zip(procs, outputs):
        assert p.returncode == 0, out[-3000:]
    return outputs


def predicted_device_groups(plan, kind: str) -> dict[int, frozenset[int]]:
    """Device -> the devices of its `kind` group, from the plan alone (ranks.rank_groups, mapped
    through plan.rank_to_device)."""
    sizes = {k: plan.parallel[k] for k in ("tp", "cp", "dp", "pp")} | {"ep": 1}
    token = {"dp_cp": "dp-cp"}.get(kind, kind)
    to_device = np.asarray(plan.rank_to_device)
    out = {}
    for group in rank_groups(plan.rank_order, sizes, token):
        devices = frozenset(int(d) for d in to_device[group])
        out.update({d: devices for d in devices})
    return out


SMALL_NODES = ["cluster.levels.0.fan_out=2", "train.global_batch_size=8"]  # nodes of 2 devices


def hand_permuted_plan():
    """PP=2 x DP=2 in Megatron's tp-cp-ep-pp-dp order (--use-tp-pp-dp-mapping in the plan's argv) on 2 hosts
    of 2 devices. On two nodes the planner has no node order to choose (one dimension spans the nodes),
    so the map is set by hand to move everything: rank r on device 3 - r, so hostA (devices 0,1) is
    torchrun node 1 and each host lists its GPUs backwards."""
    plan = api.evaluate(["model=tiny_gpt", "cluster=dgx_h100_superpod", *SMALL_NODES, "cluster.num_devices=4",
                         "plan.tp=1", "plan.pp=2", "plan.dp=2", "plan.order=tp-cp-ep-pp-dp"])
    return dataclasses.replace(plan, rank_to_device=[3, 2, 1, 0]), HOSTS


def solver_permuted_plan():
    """TP=2 x PP=2 x DP=2 on 4 hosts of 2 devices, 2 hosts a rack, as the planner places it: it swaps
    nodes 1 and 2 so that both pipeline stages of DP rank 0 share rack 0 (as in test_solver_permuted_plan)."""
    plan = api.plan(["model=tiny_gpt", "cluster=h100_spine_leaf", *SMALL_NODES, "cluster.levels.1.fan_out=2",
                     "cluster.num_devices=8", "plan.tp=2", "plan.pp=2"])
    assert plan.rank_to_device == [0, 1, 4, 5, 2, 3, 6, 7]
    return plan, ["n0", "n1", "n2", "n3"]


def nvlink_domain_plan():
    """TP=4 on 2 hosts of 2 devices inside one NVLink domain (gb200_nvl72 with trays of 2: the rack's NVLink joins
    them), as the planner places it: Megatron's own order, rank r on device r, so TP group 0 is ranks 0-3, hostA's
    two GPUs and hostB's two. The plan's TP group crosses the nvl72 level, never a network level."""
    plan = api.plan(["model=tiny_gpt", "cluster=gb200_nvl72", *SMALL_NODES, "cluster.num_devices=4", "plan.tp=4",
                     "plan.pp=1"])
    assert (plan.parallel["tp"], plan.parallel["dp"], plan.rank_to_device) == (4, 1, [0, 1, 2, 3])
    assert plan.group_levels["tp"] == "nvl72"
    return plan, HOSTS


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="needs megatron-core")
@pytest.mark.parametrize("make_plan", [hand_permuted_plan, solver_permuted_plan, nvlink_domain_plan],
                         ids=["2hosts_by_hand", "4hosts_solver", "tp_across_2hosts_nvl72"])
def test_loopback_nodes_build_the_planned_groups(tmp_path, make_plan):
    plan, hosts = make_plan()
    assignments = host_assignments(plan, hosts)
    # --train-iters 0: build the process groups, dump them, stop (the training is test_e2e_launch's).
    outputs = run_agents(assignments, [*plan.megatron_args, "--train-iters", "0"], tmp_path)

    records = [(i, json.loads(p.read_text())) for i, host in enumerate(hosts)
               for p in sorted((tmp_path / host).glob("rank*.json"))]
    world = len(plan.rank_to_device)
    assert sorted(r["rank"] for _, r in records) == list(range(world))
    device_of_rank = {}
    for host_index, r in records:
        assert r["node_rank"] == assignments[host_index].node_rank  # torchrun honoured --node-rank
        local_gpus = [int(g) for g in r["cuda_visible_devices"].split(",")]
        # The device this process really sits on: its host, and the GPU its local rank opens.
        device_of_rank[r["rank"]] = host_index * 2 + local_gpus[r["local_rank"]]
    assert device_of_rank == dict(enumerate(plan.rank_to_device))
    for kind in ("tp", "pp", "dp", "cp", "dp_cp"):
        predicted = predicted_device_groups(plan, kind)
        for _, r in records:
            built = frozenset(device_of_rank[q] for q in r["groups"][kind])
            assert built == predicted[device_of_rank[r["rank"]]], (kind, r)
    sizes = {k: plan.parallel[k] for k in ("tp", "pp", "dp", "cp")}
    assert all({k: r["sizes"][k] for k in sizes} == sizes for _, r in records)
    assert any("pretrain_gpt parallel:" in out for out in outputs)
