"""SLURM with the tree plugin: the job's plan follows `scontrol show topology`, and each node takes its node rank by
name. A real cluster (tests/slurm_cluster.py) of four slurmd, 2 "GPUs" each, whose topology.conf puts nodes 1 and 3
under one leaf switch and nodes 2 and 4 under another, the opposite of the order SLURM lists them in."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from slurm_cluster import running_cluster

ROOT = Path(__file__).resolve().parents[1]
PROBE = str(ROOT / "tests" / "slurm_probe.py")
TOPOLOGY = "SwitchName=s0 Nodes=127.0.0.[1,3]\nSwitchName=s1 Nodes=127.0.0.[2,4]\nSwitchName=s2 Switches=s[0-1]\n"
# 2 GPUs a node, 2 nodes a leaf (rack), racks on a slow spine: a pipeline's stages want one rack.
OVERRIDES = ["model=tiny_gpt", "cluster=h100_spine_leaf", "cluster.levels.0.fan_out=2", "cluster.levels.1.fan_out=2",
             "train.global_batch_size=8", "plan.tp=2", "plan.pp=2"]


@pytest.fixture(scope="module")
def cluster():
    yield from running_cluster(num_nodes=4, gpus_per_node=2, topology=TOPOLOGY)


def test_scontrol_show_topology_is_the_plans_tree(cluster, tmp_path):
    # Inside a job, without cluster.topology_conf or cluster.nodes, the plan reads SLURM's tree and node list.
    # Device order: leaf s0 first (nodes .1, .3), then s1 (.2, .4). TP 2 x PP 2 x DP 2 in tp-cp-ep-dp-pp, rank =
    # tp + 2 dp + 4 pp, torchrun node rank = dp + 2 pp. Pipeline neighbours want one leaf: node ranks 0 and 2 (the
    # stages of replica 0) on .1 and .3, node ranks 1 and 3 on .2 and .4. So .1 -> 0, .2 -> 1, .3 -> 2, .4 -> 3,
    # and the plan's hosts in node-rank order are .1 .2 .3 .4.
    out = tmp_path / "plan.json"
    # salloc runs the command here, inside a four-node job (SLURM_JOB_NODELIST set)
    step = cluster.run(["salloc", "-N4", "nest-megatron", "plan", *OVERRIDES, f"out={out}"], cwd=ROOT, timeout_s=300)
    assert step.returncode == 0, step.stderr[-3000:] + cluster.logs()
    plan = json.loads(out.read_text())
    assert plan["hosts"] == ["127.0.0.1", "127.0.0.2", "127.0.0.3", "127.0.0.4"]
    assert plan["group_levels"]["pp"] == "rack" and plan["group_levels"]["dp"] == "spine"


def test_srun_launch_gives_each_node_its_planned_node_rank_by_name(cluster, tmp_path):
    probe = tmp_path / "probe"
    env = cluster.env(NEST_PROBE_DIR=str(probe), OMP_NUM_THREADS="1", NEST_PROBE_ONLY="1")
    step = cluster.run(["srun", "-N4", "--ntasks-per-node=1", "--kill-on-bad-exit=1", "--gpus-per-node=2",
                        "nest-megatron", "launch", *OVERRIDES, "--", PROBE, "--bf16"], env=env, cwd=ROOT, timeout_s=300)
    assert step.returncode == 0, step.stderr[-4000:] + cluster.logs()
    records = [json.loads(p.read_text()) for p in sorted(probe.glob("rank*.json"))]
    node_rank_of = {r["SLURMD_NODENAME"]: int(r["GROUP_RANK"]) for r in records}
    # As worked out above: the stages of a replica share a leaf switch.
    assert node_rank_of == {"127.0.0.1": 0, "127.0.0.2": 1, "127.0.0.3": 2, "127.0.0.4": 3}


def test_scontrol_reads_the_tree(cluster):
    shown = cluster.run(["scontrol", "show", "topology"], timeout_s=30)
    assert shown.returncode == 0 and "SwitchName=s0" in shown.stdout, shown.stdout + shown.stderr



@pytest.mark.parametrize("srun", [["-N2", "--exclude=127.0.0.[3-4]"], ["-N4"]], ids=["exclude", "all"])
def test_failed_nodes_of_the_job_run_nothing_and_the_working_ones_run_the_plan(cluster, tmp_path, srun):
    # Inside a 4-node job, nodes .3 and .4 are given as failed: the plan (TP 2 x PP 2, one replica) runs on .1 and
    # .2, one stage each. A node that is really down runs no task: the step excludes it (SLURM_STEP_NODELIST names
    # the two, SLURM_NODEID counts them). A step on all four starts no rank on .3 and .4.
    probe = tmp_path / "probe"
    env = cluster.env(NEST_PROBE_DIR=str(probe), OMP_NUM_THREADS="1", NEST_PROBE_ONLY="1")
    step = cluster.run(["salloc", "-N4", "--gpus-per-node=2", "srun", *srun, "--ntasks-per-node=1", "--kill-on-bad-exit=1",
                        "--gpus-per-node=2", "nest-megatron", "launch", *OVERRIDES, "cluster.failed_nodes=127.0.0.[3-4]",
                        "--", PROBE, "--bf16"], env=env, cwd=ROOT, timeout_s=300)
    assert step.returncode == 0, step.stderr[-4000:] + cluster.logs()
    records = [json.loads(p.read_text()) for p in sorted(probe.glob("rank*.json"))]
    assert sorted({r["SLURMD_NODENAME"] for r in records}) == ["127.0.0.1", "127.0.0.2"] and len(records) == 4
    assert sorted({int(r["GROUP_RANK"]) for r in records}) == [0, 1]
    assert (step.stdout + step.stderr).count("runs no rank of this plan (a failed node of the plan)") == \
        (2 if srun == ["-N4"] else 0)


def test_sbatch_books_whole_leaf_switches_and_the_job_runs_there(cluster, tmp_path):
    # Written inside this cluster's reach (scontrol answers with its tree): the plan fills leaves of 2 nodes, so
    # 2 nodes are one leaf (--switches=1) and 3 nodes are not whole leaves (a note, no option). Submitted, the
    # 2-node job runs and its nodes share a leaf: .1 and .3, or .2 and .4.
    script = tmp_path / "job.sh"
    written = cluster.run(["nest-megatron", "sbatch", "--nodes", "2", f"--output={tmp_path}/job-%j.out", *OVERRIDES,
                           f"out={script}", "--", PROBE, "--bf16"], cwd=ROOT, timeout_s=120)
    assert written.returncode == 0, written.stderr
    assert "#SBATCH --switches=1" in script.read_text().splitlines()
    three = cluster.run(["nest-megatron", "sbatch", "--nodes", "3", *OVERRIDES, "plan.pp=1", "plan.tp=2", "--", PROBE,
                         "--bf16"], cwd=ROOT, timeout_s=120)
    assert three.returncode == 0 and "--switches" not in three.stdout, three.stderr
    assert "nest-megatron sbatch: note: 3 nodes are not whole rack units of 2 nodes: " in three.stderr

    probe = tmp_path / "probe"
    env = cluster.env(NEST_PROBE_DIR=str(probe), OMP_NUM_THREADS="1", NEST_PROBE_ONLY="1")
    job = cluster.run(["sbatch", "--parsable", "--wait", str(script)], env=env, cwd=ROOT, timeout_s=300)
    assert job.returncode == 0, job.stderr + cluster.logs()
    nodes = sorted({json.loads(p.read_text())["SLURMD_NODENAME"] for p in probe.glob("rank*.json")})
    assert nodes in (["127.0.0.1", "127.0.0.3"], ["127.0.0.2", "127.0.0.4"]), nodes
