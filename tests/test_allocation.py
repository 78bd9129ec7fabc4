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


# SLURM's topology/block plugin (Slurm 23.11+; Debian's 22.05 here has no such plugin, so these files are read, not
# served by a running slurmctld): ten NVL72 racks of 18 trays, one block each.
RACKS = "".join(f"BlockName=rack{b} Nodes=r{b}n[01-18]\n" for b in range(10)) + "BlockSizes=18,36\n"


def test_blocks_are_racks_and_consecutive_blocks_share_a_scalable_unit(tmp_path):
    conf = tmp_path / "topology.conf"
    conf.write_text(RACKS)

    def topology(nodes: str):
        return load(["model=tiny_gpt", "cluster=gb200_nvl72", f"cluster.topology_conf={conf}",
                     f"cluster.nodes={nodes}"]).problem.topology

    # Half of rack 1, all of rack 2, half of rack 3: 36 trays of 4 GPUs. The racks are the units above the tray,
    # largest first (rack 2's 18, then 9 and 9); gb200_nvl72's scalable unit takes 8 consecutive racks, so all three
    # share su 0 (one unit: the spine above it is not crossed and drops out).
    three = topology("r1n[10-18],r2n[01-18],r3n[01-09]")
    assert three.num_devices == 144 and three.children[1:] == ((18, 9, 9), (3,))
    assert three.hosts[:2] == ("r2n01", "r2n02") and three.hosts[18:20] == ("r1n10", "r1n11")
    # Racks 0 and 7 are in su 0 (racks 0-7), racks 0 and 8 in su 0 and su 1: the same 36 trays, and DP 36 over
    # them (TP 4 in each tray) crosses the su level in the first allocation, the spine in the second.
    same_su, two_sus = topology("r0n[01-18],r7n[01-18]"), topology("r0n[01-18],r8n[01-18]")
    assert same_su.children[1:] == ((18, 18), (2,)) and two_sus.children[1:] == ((18, 18), (1, 1), (2,))
    dp = ParallelConfig(tp=4, dp=36)
    assert compute_spans(dp, same_su, identity_placement(144)).levels_used(moe=False)["dp"] == 2  # su
    assert compute_spans(dp, two_sus, identity_placement(144)).levels_used(moe=False)["dp"] == 3  # spine
    assert [lv.name for lv in two_sus.levels] == ["tray", "nvl72", "su", "spine"]


def test_a_plan_on_blocks_names_the_allocated_trays(tmp_path):
    conf = tmp_path / "topology.conf"
    conf.write_text(RACKS)
    nodes = "r1n[10-18],r2n[01-18],r3n[01-09]"
    plan = api.plan(["model=llama3_8b", "cluster=gb200_nvl72", f"cluster.topology_conf={conf}", f"cluster.nodes={nodes}"])
    assert plan.num_devices == 144 and sorted(plan.hosts) == sorted(expand(nodes))
    assert plan.group_levels["dp"] in ("nvl72", "su")  # three racks of one scalable unit: the spine is not there


def test_scontrol_show_topology_blocks_follow_their_block_index():
    # the block plugin's `scontrol show topology` lines (slurm src/plugins/topology/block/topology_block.c
    # _print_topo_record): BlockName= or AggregatedBlock= (a scheduling aggregate of base blocks, read past), BlockIndex,
    # Nodes, BlockSize; the base blocks go in index order
    tree = parse("BlockName=b2 BlockIndex=1 Nodes=n[3-4] BlockSize=2\nBlockName=b1 BlockIndex=0 Nodes=n[1-2] BlockSize=2\n"
                 "AggregatedBlock=b[1-2] BlockIndex=2 Nodes=n[1-4] BlockSize=4\n", source="scontrol show topology")
    assert tree.blocks == ("b1", "b2") and tree.leaf_of["n3"] == "b2" and tree.leaf_of["n1"] == "b1"


@pytest.mark.parametrize("text, words", [
    ("SwitchName=s0 Nodes=n[01-20]\nSwitchName=s1 Nodes=n[05-06]\n", ":2: node n05 hangs off switches s0 and s1"),
    ("BlockName=b0 Nodes=n[01-18]\nBlockName=b1 Nodes=n18\n", ":2: node n18 hangs off blocks b0 and b1"),
    ("SwitchName=s0 Nodes=n1\nBlockName=b0 Nodes=n2\n", ":2: BlockName= after SwitchName= lines; a topology.conf is"),
    ("BlockName=b0 Switches=s[0-1]\n", ":1: block b0 lists Switches=; a block holds nodes only"),
    ("BlockName=b0 Nodes=n1\nBlockName=b0 Nodes=n2\n", ":2: block b0 is described twice"),
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


# --- failed nodes (cluster.failed_nodes) ---------------------------------------------------------------------------

def test_failed_nodes_are_planned_around(conf):
    # n03 (leaf s0) and n22 (leaf s1) are down: 11 + 3 working nodes = 112 GPUs, none of them on n03 or n22.
    extra = "cluster.failed_nodes=n03,n22"
    topology = load(cell(conf, extra)).problem.topology
    working = [h for h in HOSTS if h not in ("n03", "n22")]
    assert topology.hosts == tuple(working) and topology.children[1] == (11, 3) and topology.num_devices == 112
    assert topology.failed_hosts == ("n03", "n22") and topology.allocation.num_devices == 128
    plan = api.plan(cell(conf, extra))
    assert plan.failed_hosts == ["n03", "n22"] and sorted(plan.hosts) == sorted(working)
    assert plan.num_devices == 112


def test_the_placement_moves_onto_the_whole_allocation_with_the_failed_nodes_marked(conf, tmp_path):
    from nest_megatron.report.explain import on_allocation
    from nest_megatron.report.plots.placement import FAILED, GroupMark

    topology = load(cell(conf, "cluster.failed_nodes=n03,n22")).problem.topology
    # The allocation in device order: n01..n12 (s0, the larger leaf) then n21..n24. n03 is its node 2 (GPUs
    # 16-23), n22 its node 13 (GPUs 104-111). Working device 16 is on n04 (the working list's node 2), which
    # is the allocation's node 3: device 24; working device 95 (n21's last GPU, node 11) -> node 12 -> 103.
    stages = [d // 56 for d in range(112)]  # two "stages" of 56 devices, by hand
    whole, moved, groups = on_allocation(topology, stages, [GroupMark("dp", (0, 16, 95), "dp")])
    assert whole.num_devices == 128 and whole.hosts == tuple(HOSTS)
    assert [d for d, s in enumerate(moved) if s == FAILED] == [*range(16, 24), *range(104, 112)]
    assert groups[0].devices == (0, 24, 103)
    assert moved[24] == stages[16] and moved[103] == stages[95]
    drawn = draw(whole, stage_of_device=moved, groups=groups, title="t", path=tmp_path / "p.png")
    assert drawn["devices"] == 128 and (tmp_path / "p.png").stat().st_size > 0


@pytest.mark.parametrize("extra, words", [
    (["cluster.failed_nodes=n30"], "cluster.failed_nodes=n30: node n30 is not one of the allocation's 16 nodes"),
    ([f"cluster.failed_nodes={NODES}"], f"cluster.failed_nodes={NODES}: every node of the allocation failed"),
    (["cluster.failed_nodes=n01", "cluster.num_devices=128"],
     f"cluster.num_devices=128, but cluster.nodes={NODES} names 16 nodes, 15 of them working, of 8 devices = 120"),
])
def test_bad_failed_nodes_are_one_line(conf, extra, words):
    with pytest.raises(NestError) as err:
        load(cell(conf, *extra))
    assert words in str(err.value) and "\n" not in str(err.value)


def test_failed_nodes_of_unnamed_nodes_are_one_line():
    with pytest.raises(NestError, match=r"^cluster.failed_nodes=n05: the allocation's nodes are unnamed; give "
                                        r"cluster.nodes \(or cluster.topology_conf\)"):
        load(["model=tiny_gpt", "cluster=dgx_h100_superpod", "cluster.failed_nodes=n05"])


def test_a_failed_node_of_the_job_runs_nothing_and_the_others_launch():
    from nest_megatron.launch.devices import resolve
    from nest_megatron.launch.prepare import prepare

    # A 3-node SLURM job whose gpu08 failed: the plan runs on gpu07 and gpu09 (16 GPUs), and gpu08's launcher
    # starts nothing.
    overrides = ["model=tiny_gpt", "cluster=dgx_h100_superpod", "cluster.nodes=gpu[07-09]", "cluster.failed_nodes=gpu08",
                 "train.global_batch_size=64", "plan.tp=8", "plan.pp=2", "plan.mbs=1", "plan.zero=1",
                 "plan.recompute=none", "plan.vpp=1"]
    env = {"SLURM_JOB_NODELIST": "gpu[07-09]", "SLURM_NNODES": "3", "SLURM_GPUS_ON_NODE": "8", "SLURM_JOB_ID": "7"}
    runs = {}
    for node in range(3):
        devices = resolve(env={**env, "SLURM_NODEID": str(node)})
        prepared = prepare(overrides=overrides, script="train.py", script_args=[], devices=devices)
        runs[devices.hosts[node]] = prepared.this_node
    assert prepared.plan.failed_hosts == ["gpu08"] and sorted(prepared.plan.hosts) == ["gpu07", "gpu09"]
    assert runs["gpu08"] is None
    heads = {host: run.argv[: run.argv.index("train.py")] for host, run in runs.items() if run is not None}
    assert sorted(head[6] for head in heads.values()) == ["0", "1"]  # --node-rank 0 and 1 of --nnodes 2
    assert all(head[:5] == ["torchrun", "--nnodes", "2", "--nproc-per-node", "8"] for head in heads.values())


def test_without_a_tree_a_failed_node_leaves_a_hole_and_the_others_keep_their_units():
    # n[01-40] on 32-node scalable units: SU 0 holds n01-n32, SU 1 n33-n40. With n05 down SU 0 holds 31 and SU 1
    # still 8: n33 stays in SU 1 (re-filling 39 nodes in order would move it to SU 0: 32 + 7).
    topology = load(["model=tiny_gpt", "cluster=dgx_h100_superpod", "cluster.nodes=n[01-40]",
                     "cluster.failed_nodes=n05"]).problem.topology
    assert topology.children[1] == (31, 8) and topology.allocation.children[1] == (32, 8)
    n33 = topology.hosts.index("n33") * 8
    assert topology.unit_of(1, n33) == 1 and topology.num_devices == 39 * 8


def test_failed_nodes_inside_a_slurm_job(monkeypatch):
    # SLURM_JOB_NODELIST names the allocation; the failed node is planned around, cluster.num_devices may say the
    # working size (16 = 2 nodes of 8) or is left out, and the plan's overrides name the nodes for `explain`.
    monkeypatch.setenv("SLURM_JOB_NODELIST", "gpu[07-09]")
    base = ["model=tiny_gpt", "cluster=dgx_h100_superpod", "train.global_batch_size=64", "cluster.failed_nodes=gpu08"]
    for extra in ([], ["cluster.num_devices=16"]):
        loaded = load([*base, *extra])
        assert loaded.problem.topology.hosts == ("gpu07", "gpu09") and loaded.problem.num_devices == 16
        assert "cluster.nodes=gpu[07-09]" in loaded.overrides
    with pytest.raises(NestError, match=r"^cluster.num_devices=24, but SLURM_JOB_NODELIST=gpu\[07-09\] names 3 nodes, "
                                        r"2 of them working,"):
        load([*base, "cluster.num_devices=24"])
