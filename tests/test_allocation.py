"""The allocation's real topology: SLURM's topology.conf and the allocated nodes (cluster.topology_conf,
cluster.nodes), hostlists as SLURM expands them, and the Plan's hosts in node-rank order."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from nest_megatron import api, sweep
from nest_megatron.config.load import load
from nest_megatron.cost.placement import compute_spans
from nest_megatron.errors import NestError
from nest_megatron.hardware.hostlist import expand
from nest_megatron.hardware.slurm_tree import parse
from nest_megatron.parallel.config import ParallelConfig
from nest_megatron.parallel.ranks import identity_placement
from nest_megatron.report.plots.placement import device_positions, draw

TWO_LEAVES = """# two leaves of 20 nodes under one spine switch
SwitchName=s0 Nodes=n[01-20] LinkSpeed=400
SwitchName=s1 Nodes=n[21-40]   # the second leaf
SwitchName=s2 Switches=s[0-1]
"""
NODES = "n[01-12],n[21-24]"
HOSTS = [f"n{i:02d}" for i in range(1, 13)] + [f"n{i}" for i in range(21, 25)]


@pytest.fixture
def conf(tmp_path):
    path = tmp_path / "topology.conf"
    path.write_text(TWO_LEAVES)
    return str(path)


def cell(conf: str, *extra: str) -> list[str]:
    return ["model=llama3_8b", "cluster=dgx_h100_superpod", f"cluster.topology_conf={conf}", f"cluster.nodes={NODES}",
            *extra]


def test_sixteen_nodes_on_two_leaves_are_a_128_gpu_plan_on_those_hosts(conf):
    plan = api.plan(cell(conf))
    assert plan.num_devices == 128 and sorted(plan.hosts) == sorted(HOSTS)


def test_groups_cross_the_spine_where_the_tree_says(conf):
    # Device order: leaf s0's 12 nodes first (GPUs 0-95), then s1's 4 (GPUs 96-127). TP 8 x DP 8 x PP 2.
    # tp-cp-ep-dp-pp, rank = tp + 8 dp + 64 pp: stage 0 on nodes 0-7 (all s0), stage 1 on nodes 8-15
    # (8-11 in s0, 12-15 in s1).
    #   DP of stage 0: 8 nodes of s0 -> fan-in (1, 8, 1), inside the leaf; DP of stage 1: 4 + 4 nodes on two
    #   leaves -> (1, 4, 2), across the spine. PP pairs node k with node k + 8: k = 4..7 reach s1 -> spine.
    # tp-cp-ep-pp-dp, rank = tp + 8 pp + 16 dp: replica k on nodes 2k, 2k+1 (both in s0 for k < 6, both in
    #   s1 for k = 6, 7): PP stays inside a leaf; DP of stage 0 is nodes 0, 2, ..., 14 -> 6 in s0, 2 in s1.
    # On one regular 32-node scalable unit every one of these groups stays inside the leaf.
    topology = load(cell(conf)).problem.topology
    assert topology.hosts == tuple(HOSTS) and topology.children[1] == (12, 4)
    dp_first = compute_spans(ParallelConfig(tp=8, dp=8, pp=2), topology, identity_placement(128))
    assert sorted(s.fan_in for s in dp_first.dp) == [(1.0, 4.0, 2.0), (1.0, 8.0, 1.0)]
    assert dp_first.levels_used(moe=False) == {"tp": 0, "cp": -1, "dp": 2, "pp": 2}
    pp_first = compute_spans(ParallelConfig(tp=8, dp=8, pp=2, order="tp-cp-ep-pp-dp"), topology, identity_placement(128))
    assert pp_first.levels_used(moe=False) == {"tp": 0, "cp": -1, "dp": 2, "pp": 1}
    # 8 nodes on 2 leaves (6 + 2): 4 a leaf on average, the model's fan-in for an uneven group
    assert sorted(s.fan_in for s in pp_first.dp) == [(1.0, 4.0, 2.0)]
    regular = load(["model=llama3_8b", "cluster=dgx_h100_superpod", "cluster.num_devices=128"]).problem.topology
    assert compute_spans(ParallelConfig(tp=8, dp=8, pp=2), regular, identity_placement(128)).levels_used(moe=False) == \
        {"tp": 0, "cp": -1, "dp": 1, "pp": 1}


def test_hosts_are_in_node_rank_order(conf):
    # The plan's hosts follow its rank -> device map: node rank k is the host of the device rank 8k sits on.
    plan = api.plan(cell(conf))
    topology = load(cell(conf)).problem.topology
    assert plan.hosts == [topology.hosts[plan.rank_to_device[8 * k] // 8] for k in range(16)]


def test_nodes_without_a_topology_fill_the_levels_in_order():
    topology = load(["model=tiny_gpt", "cluster=dgx_h100_superpod", "cluster.nodes=a[1-3]"]).problem.topology
    assert topology.hosts == ("a1", "a2", "a3") and topology.num_devices == 24


@pytest.mark.parametrize("text", ["n[01-12],n[21-24]", "r[1-2]n[01-02]", "gpu[8-11,3]", "a[098-101]", "n[1-2],n1", "x"])
def test_hostlists_expand_as_scontrol_does(text, tmp_path):
    scontrol = shutil.which("scontrol")
    if scontrol is None:
        pytest.skip("no scontrol (the Debian package slurm-client)")
    # `scontrol show hostnames` needs a slurm.conf to read, not a running controller.
    (tmp_path / "slurm.conf").write_text("ClusterName=t\nSlurmctldHost=localhost\nNodeName=x CPUs=1\nPartitionName=p Nodes=x\n")
    done = subprocess.run([scontrol, "show", "hostnames", text], capture_output=True, text=True, check=True,
                          env={"SLURM_CONF": str(tmp_path / "slurm.conf"), "PATH": "/usr/bin:/bin"})
    assert expand(text) == done.stdout.split()


def test_scontrol_show_topology_lines_parse():
    # scontrol prints Level= and, beside a switch of switches, every node below it: only leaves place nodes.
    tree = parse("SwitchName=s0 Level=0 LinkSpeed=1 Nodes=n[1-2]\nSwitchName=s1 Level=0 LinkSpeed=1 Nodes=n3\n"
                 "SwitchName=top Level=1 LinkSpeed=1 Nodes=n[1-3] Switches=s[0-1]\n", source="scontrol show topology")
    assert tree.chain("n3") == ["s1", "top"] and tree.leaf_of["n1"] == "s0"


@pytest.mark.parametrize("text, words", [
    ("SwitchName=s0 Nodes=n[01-20]\nSwitchName=s1 Nodes=n[05-06]\n", ":2: node n05 hangs off switches s0 and s1"),
    ("SwitchName=s0 Nodes=n[01-20]\nNodes=n21\n", ":2: a line without SwitchName="),
    ("SwitchName=s0 Nodes=n[01-\n", ":1: Nodes=n[01-: '[' without ']'"),
    ("SwitchName=s0 Nodes\n", ":1: 'Nodes' is not KEY=VALUE"),
    ("SwitchName=s0 Nodes=n1\nSwitchName=s2 Switches=s[0-1]\n", "switch s1 is listed under Switches= but never described"),
])
def test_bad_topology_conf_is_one_line_with_its_line_number(tmp_path, text, words):
    path = tmp_path / "topology.conf"
    path.write_text(text)
    with pytest.raises(NestError) as err:
        load(["model=tiny_gpt", "cluster=dgx_h100_superpod", f"cluster.topology_conf={path}"])
    assert words in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("extra, words", [
    (["cluster.nodes=n[01-02],n99"], "cluster.nodes: node n99 is not under any switch of"),
    (["cluster.nodes=n[01-02],n01"], "node n01 is listed twice"),
    (["cluster.nodes=n[01-02]", "cluster.num_devices=64"], "cluster.num_devices=64, but cluster.nodes=n[01-02] names 2 nodes of 8 devices = 16"),
    (["cluster.nodes=n[02-01]"], "cluster.nodes=n[02-01]: range 02-01 runs backwards"),
])
def test_bad_nodes_are_one_line(conf, extra, words):
    with pytest.raises(NestError, match=None) as err:
        load(["model=tiny_gpt", "cluster=dgx_h100_superpod", f"cluster.topology_conf={conf}", *extra])
    assert words in str(err.value)


def test_an_unreadable_topology_conf_is_one_line(tmp_path):
    with pytest.raises(NestError, match=r"^cluster.topology_conf=.*missing.conf: cannot read it \(No such file or directory\)$"):
        load(["model=tiny_gpt", "cluster=dgx_h100_superpod", f"cluster.topology_conf={tmp_path}/missing.conf"])


def test_sweep_over_node_lists_prices_the_spine(conf):
    # 2 nodes under one leaf against 2 nodes on two leaves: whatever tiny_gpt's plan, some group crosses nodes
    # (16 GPUs, 8 a node), and only the second allocation's cross the spine.
    points = sweep.expand(["model=tiny_gpt", "cluster=dgx_h100_superpod", "train.global_batch_size=64",
                           f"cluster.topology_conf={conf}", "cluster.nodes='n[01-02]','n01,n21'"])
    assert [p.values["cluster.nodes"] for p in points] == ["n[01-02]", "n01,n21"]
    outcomes = sweep.run(points)
    levels = [set(o.plan.group_levels.values()) - {None} for o in outcomes]
    assert [o.num_devices for o in outcomes] == [16, 16]
    assert "spine" not in levels[0] and "su" in levels[0] and "spine" in levels[1]


def test_the_placement_drawing_holds_the_allocations_tree_and_its_idle_nodes(conf, tmp_path):
    # n[01-12] under s0 and n[21-23] under s1: 15 node boxes in two leaf boxes, of 12 and 3 nodes; the last
    # 7 nodes (56 GPUs) idle.
    topology = load(cell(conf)[:3] + ["cluster.nodes=n[01-12],n[21-23]"]).problem.topology
    positions, boxes = device_positions(topology, topology.num_devices)
    assert len(positions) == 120
    assert sum(1 for b in boxes if b[0] == 0) == 15 and sum(1 for b in boxes if b[0] == 1) == 2
    drawn = draw(topology, stage_of_device=[0] * 64 + [-1] * 56, groups=[], title="t", path=tmp_path / "p.png")
    assert drawn["devices_drawn"] == 120 and (tmp_path / "p.png").stat().st_size > 0
