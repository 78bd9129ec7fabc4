"""SLURM: `srun nest-megatron launch` and the script `nest-megatron sbatch` writes, on a real two-node cluster.

The cluster (tests/slurm_cluster.py) is Debian's slurmctld + four slurmd + munged on this host, started
here for the module and stopped after it; its nodes are 127.0.0.1 .. 127.0.0.4 with 2 "GPUs" each (a
GRES count, no device: the processes run on CPU with gloo). Most jobs take two of them. Jobs run scripts/pretrain_gpt.py
(megatron-core) through tests/slurm_probe.py, which records the SLURM node and torchrun node rank of
every rank, since both test nodes share one host name.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from slurm_cluster import SlurmCluster, SlurmClusterError, clean_environment, running_cluster

from nest_megatron import api, cli
from nest_megatron.config.load import load
from nest_megatron.hardware import slurm_tree
from nest_megatron.launch.prepare import problem_overrides
from nest_megatron.launch.sbatch import unit_option

ROOT = Path(__file__).resolve().parents[1]
PROBE = str(ROOT / "tests" / "slurm_probe.py")
GPUS_PER_NODE = 2
# the DGX H100 fabric with 2 devices a node, as the test nodes have
CLUSTER = ["cluster=dgx_h100_superpod", f"cluster.levels.0.fan_out={GPUS_PER_NODE}"]
MEGATRON_ARGS = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
                 "--max-position-embeddings", "32", "--micro-batch-size", "2", "--global-batch-size", "8",
                 "--vocab-size", "128", "--bf16", "--train-iters", "3", "--lr", "3e-3", "--hidden-dropout", "0",
                 "--attention-dropout", "0"]
ITERATION = re.compile(r"\] iteration +(\d+)/ *\d+ \|.*? lm loss: (\S+) \|")  # Megatron-LM's training_log line
# The script calls nest-megatron by its absolute path: under pytest, the console script beside this Python.
LAUNCHER = str(Path(sys.executable).parent / "nest-megatron")


@pytest.fixture(scope="module")
def cluster():
    yield from running_cluster(num_nodes=4, gpus_per_node=GPUS_PER_NODE)


def job_env(cluster: SlurmCluster, probe_dir: Path, **extra: str) -> dict[str, str]:
    return cluster.env(NEST_PROBE_DIR=str(probe_dir), OMP_NUM_THREADS="1", **extra)


def expected_placement(overrides: list[str], script_args: list[str], hosts: list[str]) -> dict[int, tuple[str, int]]:
    """rank -> (SLURM node, torchrun node rank), worked out from the plan's rank_to_device by hand:
    device d sits on host d // devices_per_node (hosts in SLURM's order); a host whose ranks start at r
    is torchrun node r // ranks_per_node."""
    devices = [f"cluster.num_devices={len(hosts) * GPUS_PER_NODE}"]
    plan = api.plan_loaded(load(problem_overrides(PROBE, script_args, overrides) + devices))
    host_of_rank = {rank: hosts[device // GPUS_PER_NODE] for rank, device in enumerate(plan.rank_to_device)}
    first_rank = {host: min(r for r, h in host_of_rank.items() if h == host) for host in set(host_of_rank.values())}
    return {rank: (host, first_rank[host] // GPUS_PER_NODE) for rank, host in host_of_rank.items()}


def ran(cluster: SlurmCluster, probe_dir: Path) -> tuple[dict[int, tuple[str, int]], list[str]]:
    """rank -> (SLURM node, torchrun node rank) as the ranks saw them, and the job's hosts in SLURM's order
    (SLURM's own expansion of SLURM_JOB_NODELIST)."""
    records = [json.loads(p.read_text()) for p in sorted(probe_dir.glob("rank*.json"))]
    nodelists = {r["SLURM_JOB_NODELIST"] for r in records}
    assert len(nodelists) == 1, nodelists
    hosts = cluster.run(["scontrol", "show", "hostnames", nodelists.pop()], timeout_s=30).stdout.split()
    return {int(r["RANK"]): (r["SLURMD_NODENAME"], int(r["GROUP_RANK"])) for r in records}, hosts


def losses(log: str) -> list[float]:
    return [float(m.group(2)) for m in ITERATION.finditer(log)]


# -- the cluster itself ------------------------------------------------------------------------------------

def test_cluster_runs_one_task_per_node_and_passes_exit_status(cluster):
    step = cluster.run(["srun", "-N2", "-w", "127.0.0.[1-2]", "--ntasks-per-node=1", f"--gpus-per-node={GPUS_PER_NODE}",
                        "bash", "-c",
                        "echo $SLURMD_NODENAME $SLURM_NODEID $SLURM_GPUS_ON_NODE $SLURM_JOB_NODELIST"], timeout_s=60)
    assert step.returncode == 0, step.stderr + cluster.logs()
    assert sorted(step.stdout.split("\n")[:2]) == ["127.0.0.1 0 2 127.0.0.[1-2]", "127.0.0.2 1 2 127.0.0.[1-2]"]
    failed = cluster.run(["srun", "-N2", "bash", "-c", "exit 3"], timeout_s=60)
    assert failed.returncode == 3


def test_cluster_that_cannot_start_names_the_daemon_and_shows_its_log():
    class Misconfigured(SlurmCluster):
        def _write_config(self):
            super()._write_config()
            with open(self.conf, "a") as conf:
                conf.write("NoSuchSlurmOption=1\n")

    broken = Misconfigured(num_nodes=1, start_timeout_s=30)
    with pytest.raises(SlurmClusterError) as err:
        broken.start(attempts=1)
    message = str(err.value)
    # both slurmctld and slurmd read the file: whichever has died by the next poll is named
    assert re.match(r"(slurmctld|slurmd-127\.0\.0\.1)(, slurmd-127\.0\.0\.1)? exited while waiting for sinfo .*"
                    r"\(after 1 attempts\)$", message.splitlines()[0]), message
    assert "NoSuchSlurmOption" in message  # slurmctld's own complaint, from its log
    assert broken.root is None and not broken.processes  # everything stopped and removed


# -- srun nest-megatron launch ------------------------------------------------------------------------------

@pytest.mark.slow
def test_srun_launch_takes_node_ranks_from_the_plan(cluster, tmp_path):
    overrides = [*CLUSTER, "plan.pp=2"]
    step = cluster.run(["srun", "-N2", "--ntasks-per-node=1", "--kill-on-bad-exit=1",
                        f"--gpus-per-node={GPUS_PER_NODE}", "nest-megatron", "launch", *overrides, "--", PROBE,
                        *MEGATRON_ARGS], env=job_env(cluster, tmp_path / "probe"), cwd=ROOT, timeout_s=420)
    log = step.stdout + step.stderr
    assert step.returncode == 0, log[-4000:] + cluster.logs()
    placement, hosts = ran(cluster, tmp_path / "probe")
    assert len(hosts) == 2 and placement == expected_placement(overrides, MEGATRON_ARGS, hosts)
    # both nodes planned the same: one summary line each, identical
    summaries = [line for line in step.stderr.splitlines() if line.startswith("nest-megatron: tp=")]
    assert len(summaries) == 2 and summaries[0] == summaries[1] and " pp=2 " in summaries[0], log[-2000:]
    trained = losses(log)
    assert len(trained) == 3 and trained[-1] < trained[0], log[-2000:]


@pytest.mark.slow
def test_srun_launch_on_four_nodes_follows_a_permuted_placement(cluster, tmp_path):
    """4 nodes of 2, 2 nodes a rack, TP=2 x PP=2 x DP=2: the planner swaps the second and third node so
    that both pipeline stages of a DP replica share a rack (tests/test_placement_realised.py), so SLURM's
    node 1 must run torchrun node rank 2 and node 2 node rank 1. Only the rendezvous is needed to see the
    node ranks: the ranks stop after recording them (NEST_PROBE_ONLY)."""
    overrides = ["model=tiny_gpt", "cluster=h100_spine_leaf", "cluster.levels.0.fan_out=2",
                 "cluster.levels.1.fan_out=2", "train.global_batch_size=8", "plan.tp=2", "plan.pp=2"]
    step = cluster.run(["srun", "-N4", "--ntasks-per-node=1", "--kill-on-bad-exit=1", f"--gpus-per-node={GPUS_PER_NODE}",
                        "nest-megatron", "launch", *overrides, "--", PROBE, "--bf16"],
                       env=job_env(cluster, tmp_path / "probe", NEST_PROBE_ONLY="1"), cwd=ROOT, timeout_s=300)
    assert step.returncode == 0, step.stderr[-4000:] + cluster.logs()
    placement, hosts = ran(cluster, tmp_path / "probe")
    assert hosts == cluster.node_names
    expected = expected_placement(overrides, ["--bf16"], hosts)
    assert placement == expected
    node_rank_of_host = {host: node_rank for host, node_rank in expected.values()}
    assert [node_rank_of_host[h] for h in hosts] == [0, 2, 1, 3]  # by hand, as in the docstring


# -- the sbatch script ---------------------------------------------------------------------------------------

def write_script(tmp_path: Path, *extra: str) -> Path:
    script = tmp_path / "job.sh"
    status = cli.main(["sbatch", "--nodes", "2", "--gpus-per-node", str(GPUS_PER_NODE),
                       f"--output={tmp_path}/job-%j.out", *CLUSTER, *extra, f"out={script}", "--", PROBE,
                       *MEGATRON_ARGS])
    assert status == 0 and script.exists()
    return script


def submit(cluster: SlurmCluster, script: Path, tmp_path: Path, **env: str) -> tuple[int, str, str]:
    """sbatch the script and wait for the job: (its exit status as SLURM records it, its log, scontrol's view of
    it). Polls scontrol every 0.3 s: `sbatch --wait` polls slower and returns some 25 s after the job ends."""
    job = cluster.run(["sbatch", "--parsable", str(script)], env=job_env(cluster, tmp_path / "probe", **env), cwd=ROOT,
                      timeout_s=60)
    assert job.returncode == 0, job.stderr + cluster.logs()
    job_id = job.stdout.strip().split(";")[0]
    deadline = time.monotonic() + 420
    while True:
        state = cluster.run(["scontrol", "show", "job", job_id], timeout_s=30).stdout
        if re.search(r"JobState=(COMPLETED|FAILED|CANCELLED|TIMEOUT|NODE_FAIL|OUT_OF_MEMORY)\b", state):
            break
        assert time.monotonic() < deadline, state + cluster.logs()
        time.sleep(0.3)
    out = tmp_path / f"job-{job_id}.out"
    exit_code, signal_number = map(int, re.search(r"\bExitCode=(\d+):(\d+)", state).groups())
    return exit_code or (128 + signal_number if signal_number else 0), out.read_text() if out.exists() else "", state


@pytest.mark.slow
def test_sbatch_script_trains_on_two_nodes(cluster, tmp_path):
    script = write_script(tmp_path)
    status, log, state = submit(cluster, script, tmp_path)
    assert status == 0 and "JobState=COMPLETED" in state, state + log[-4000:] + cluster.logs()
    placement, hosts = ran(cluster, tmp_path / "probe")
    assert len(hosts) == 2 and placement == expected_placement(CLUSTER, MEGATRON_ARGS, hosts)
    assert "pretrain_gpt done: iterations=3" in log
    trained = losses(log)
    assert len(trained) == 3 and trained[-1] < trained[0], log[-2000:]


@pytest.mark.slow
def test_failed_training_fails_the_job_with_the_ranks_status(cluster, tmp_path):
    """Rank 1 exits 3 (the other ranks stop cleanly after their record): its node's launch ends with 3, the
    other node's with 0 or, stopped by srun (--kill-on-bad-exit), 1; srun passes on the highest, 3, and the job
    (exec srun) ends with it. Also the --srun options: NEST_PROBE_EXIT reaches the ranks only through the srun
    line's --export (the job's own environment lacks it), and --label prefixes every line with its task."""
    script = write_script(tmp_path, "--srun=--export=ALL,NEST_PROBE_EXIT=3", "--srun=--label")
    assert f" --kill-on-bad-exit=1 --export=ALL,NEST_PROBE_EXIT=3 --label {LAUNCHER} launch " in script.read_text()
    status, log, state = submit(cluster, script, tmp_path, NEST_PROBE_ONLY="1")
    assert status == 3, log[-3000:]
    assert re.search(r"exitcode\s*:\s*3", log), log[-3000:]  # torchrun's failure report names the rank's status
    assert re.search(r"^[01]: nest-megatron: first failure: rank 1 exited with 3; the launch exits with 3$", log, re.M), log
    summaries = re.findall(r"^([01]): nest-megatron: tp=", log, re.M)
    assert sorted(summaries) == ["0", "1"], log[-3000:]
    assert "JobState=FAILED" in state and "ExitCode=3:0" in state, state


@pytest.mark.slow
def test_job_expecting_another_plan_starts_nothing(cluster, tmp_path):
    """The script expects a plan digest that the nodes do not plan (as when the login node that wrote it had
    another nest-megatron, cluster config or profile cache): the first node to plan refuses in one line with
    exit status 2; srun then stops the other, which either refused as well or, stopped while planning, ends
    with 1; no rank starts and the job's status is the refusal's, 2."""
    script = write_script(tmp_path)
    written = re.search(r" --expect-plan ([0-9a-f]{12}) ", script.read_text()).group(1)
    script.write_text(script.read_text().replace(f"--expect-plan {written}", "--expect-plan 0123456789ab"))
    status, log, state = submit(cluster, script, tmp_path)
    assert status == 2, log[-3000:]
    refused = (f"nest-megatron launch: error: this node planned {written}, but the job expects plan 0123456789ab "
               "(--expect-plan): nothing started; a different nest-megatron version, cluster config or profile cache "
               "on this node (or on the node that wrote the job) changes the plan, or SLURM booked the nodes on "
               "other switches or racks than it was planned on (docs/guide.md, 'Whole racks')")
    lines = sorted(line for line in log.splitlines() if line.startswith("nest-megatron"))
    assert lines in ([refused] * 2, [refused, "nest-megatron: stopped by SIGTERM; the launch exits with 1"]), log
    assert not (tmp_path / "probe").exists()  # no rank started anywhere
    assert "JobState=FAILED" in state and "ExitCode=2:0" in state, state


# -- bad SLURM input: one line per node, nothing launched -------------------------------------------------

@pytest.mark.parametrize("srun_options, wrapper, message", [
    # no --gpus-per-node: SLURM sets no SLURM_GPUS_ON_NODE, the devices per node are unknown
    ([], "", "devices per node unknown: SLURM_GPUS_ON_NODE is not set; give --nproc-per-node"),
    # a job environment that contradicts itself (3 nodes claimed, 2 listed)
    ([f"--gpus-per-node={GPUS_PER_NODE}"], "SLURM_NNODES=3",
     "SLURM_NNODES=3, but SLURM_JOB_NODELIST=127.0.0.[1-2] names 2 hosts"),
], ids=["no-gpus-on-node", "nnodes-vs-nodelist"])
def test_bad_slurm_environment_launches_nothing(cluster, tmp_path, srun_options, wrapper, message):
    launch = ["nest-megatron", "launch", *CLUSTER, "--", PROBE, *MEGATRON_ARGS]
    command = ["bash", "-c", f"{wrapper} exec \"$@\"", "-", *launch] if wrapper else launch
    step = cluster.run(["srun", "-N2", "-w", "127.0.0.[1-2]", "--ntasks-per-node=1", *srun_options, *command],
                       env=job_env(cluster, tmp_path / "probe"), cwd=ROOT, timeout_s=120)
    assert step.returncode == 2
    errors = [line for line in step.stderr.splitlines() if line.startswith("nest-megatron")]
    assert errors == [f"nest-megatron launch: error: {message}"] * 2, step.stderr
    assert not (tmp_path / "probe").exists()  # no rank started anywhere


def test_slurm_nodelist_missing_outside_srun(tmp_path):
    env = clean_environment() | {"SLURM_NNODES": "2", "NEST_PROBE_DIR": str(tmp_path)}
    result = subprocess.run([sys.executable, "-m", "nest_megatron.cli", "launch", *CLUSTER, "--", PROBE,
                             *MEGATRON_ARGS], env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip() == "nest-megatron launch: error: SLURM_NNODES=2 but SLURM_JOB_NODELIST is not set"
    assert not list(tmp_path.iterdir())


# -- the script's text ---------------------------------------------------------------------------------------

def test_sbatch_script_text(tmp_path, capsys):
    megatron_args = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
                     "--max-position-embeddings", "32", "--global-batch-size", "8", "--vocab-size", "128", "--bf16",
                     "--data-path", "my data"]
    status = cli.main(["sbatch", "--nodes", "2", "--gpus-per-node", "2", "--partition", "batch", "--time", "4:00:00",
                       "--account", "proj", "--sbatch=--qos=high", "--srun=--container-image=nvcr.io#nvidia/pytorch:25.01",
                       "--srun=--container-mounts=/data:/data", *CLUSTER, "plan.pp=2", "--", "pretrain_gpt.py",
                       *megatron_args])
    out = capsys.readouterr().out
    assert status == 0
    lines = out.splitlines()
    assert lines[:10] == [
        "#!/bin/bash",
        "#SBATCH --job-name=nest-megatron",
        "#SBATCH --nodes=2",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --gpus-per-node=2",
        "#SBATCH --exclusive",
        "#SBATCH --partition=batch",
        "#SBATCH --time=4:00:00",
        "#SBATCH --account=proj",
        "#SBATCH --qos=high",
    ]
    assert any(line.startswith("# plan when written: tp=1 pp=2 dp=2 ") for line in lines)
    # in a container (--container-image) the launcher is the container's: the bare name, said in a comment
    assert "# nest-megatron from the PATH of the nodes (or of the container): when written, none was found as an " \
           "executable, or srun runs it in a container." in lines
    # the digest of the same problem on 2 x 2 devices, planned here through the API
    plan = api.plan_loaded(load(problem_overrides("pretrain_gpt.py", megatron_args, [*CLUSTER, "plan.pp=2"])
                                + ["cluster.num_devices=4"]))
    digest = plan.digest
    assert f"# plan digest {digest} (every node must plan the same: --expect-plan)" in lines
    # the predicted step, its band and the calibration that priced it, as the plan records them
    step, (low, high) = plan.predicted["step_time_s"], plan.calibration["step_time_band_s"]
    assert f"# predicted {step:.3f} s ({low:.3g}-{high:.3g} s) a step; {plan.calibration['summary']}" in lines
    assert lines[-1] == (
        "exec srun --ntasks-per-node=1 --kill-on-bad-exit=1 '--container-image=nvcr.io#nvidia/pytorch:25.01' "
        f"--container-mounts=/data:/data nest-megatron launch --expect-plan {digest} cluster=dgx_h100_superpod "
        "cluster.levels.0.fan_out=2 plan.pp=2 -- pretrain_gpt.py --num-layers 2 --hidden-size 64 "
        "--num-attention-heads 4 --seq-length 32 --max-position-embeddings 32 --global-batch-size 8 "
        "--vocab-size 128 --bf16 --data-path 'my data'")
    # bash reads the line back into the same words (what srun receives)
    printed = subprocess.run(["bash", "-c", lines[-1].replace("exec srun ", "printf '%s\\n' ", 1)],
                             capture_output=True, text=True).stdout.splitlines()
    assert printed[2] == "--container-image=nvcr.io#nvidia/pytorch:25.01"  # quoted: an unquoted # starts a comment
    assert printed[-2:] == ["--data-path", "my data"]


def test_sbatch_script_carries_the_config_path_and_the_launchers_path(tmp_path, capsys, monkeypatch):
    """A job submitted with --export=NONE gets neither the submitter's environment nor its PATH: the script sets
    NEST_MEGATRON_CONFIG_PATH itself (absolute, quoted) and calls nest-megatron by its absolute path."""
    configs = tmp_path / "my configs"
    (configs / "cluster").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("NEST_MEGATRON_CONFIG_PATH", "my configs")  # relative at submit time
    assert cli.main(["sbatch", "--nodes", "1", "model=tiny_gpt", "cluster=dgx_h100_superpod", "--", "t.py"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert f"export NEST_MEGATRON_CONFIG_PATH='{configs}'" in lines
    assert lines[-1].startswith(f"exec srun --ntasks-per-node=1 --kill-on-bad-exit=1 {LAUNCHER} launch --expect-plan ")
    # bash reads the export back as the folder, blank included
    script = "\n".join(line for line in lines if line.startswith("export "))
    echoed = subprocess.run(["bash", "-c", script + '\nprintf %s "$NEST_MEGATRON_CONFIG_PATH"'], capture_output=True,
                            text=True).stdout
    assert echoed == str(configs)

    monkeypatch.delenv("NEST_MEGATRON_CONFIG_PATH")
    assert cli.main(["sbatch", "--nodes", "1", "model=tiny_gpt", "cluster=dgx_h100_superpod", "--", "t.py"]) == 0
    assert "NEST_MEGATRON_CONFIG_PATH" not in capsys.readouterr().out


def test_sbatch_defaults_gpus_per_node_to_the_clusters_node_size(tmp_path, capsys):
    script = tmp_path / "job.sh"
    status = cli.main(["sbatch", "--nodes", "1", "model=tiny_gpt", "cluster=dgx_h100_superpod",
                       "train.global_batch_size=64", f"out={script}", "--", "pretrain_gpt.py"])
    assert status == 0, capsys.readouterr().err
    text = script.read_text()
    assert "#SBATCH --gpus-per-node=8\n" in text  # a DGX H100 node holds 8
    assert f"out={script}" not in text and re.search(rf" {re.escape(LAUNCHER)} launch --expect-plan [0-9a-f]{{12}} model=tiny_gpt ", text)
    assert script.stat().st_mode & 0o111  # executable
    assert capsys.readouterr().out == f"sbatch script written to {script}\n"



# -- whole units of the level above the host (leaf switches, NVL72 racks) --------------------------------------

BLOCKS = slurm_tree.parse("BlockName=rack0 Nodes=t[001-018]\nBlockName=rack1 Nodes=t[019-036]\nBlockSizes=18,36\n",
                          source="scontrol show topology")
SWITCHES = slurm_tree.parse("SwitchName=leaf0 Nodes=n[01-18]\nSwitchName=leaf1 Nodes=n[19-36]\n"
                            "SwitchName=spine Switches=leaf[0-1]\n", source="scontrol show topology")


@pytest.mark.parametrize("scheduler, nodes, option", [
    # SLURM's Topology Guide, User Options: --segment=S books segments of S nodes, each in one base block, the node
    # count a multiple of S; a job of one block or less is placed in one by the block plugin itself.
    (BLOCKS, 36, "--segment=18"), (BLOCKS, 72, "--segment=18"), (BLOCKS, 18, None), (BLOCKS, 9, None),
    # the tree plugin's --switches=K: at most K leaf switches, so K x 18 nodes fill K of them
    (SWITCHES, 36, "--switches=2"), (SWITCHES, 18, "--switches=1"), (SWITCHES, 5, "--switches=1"),
    (SWITCHES, 1, None),
])
def test_units_of_the_level_above_the_host_are_booked_whole(scheduler, nodes, option):
    assert unit_option(scheduler, nodes=nodes, unit_nodes=18, unit="rack", extra=[]) == (option, None)


def test_units_that_cannot_be_booked_whole_are_a_note():
    # 20 = 18 + 2: SLURM's segments must divide the nodes, and two leaf switches may hold 10 + 10
    for scheduler in (BLOCKS, SWITCHES):
        option, note = unit_option(scheduler, nodes=20, unit_nodes=18, unit="rack", extra=[])
        assert option is None and note.startswith("20 nodes are not whole rack units of 18 nodes: SLURM may book them "
                                                  "in other shares than the plan's (1 x 18 + 2)")
    option, note = unit_option(None, nodes=36, unit_nodes=18, unit="rack", extra=[])
    assert option is None and note.endswith("add --sbatch=--segment=18 (block plugin) or --sbatch=--switches=2 (tree "
                                            "plugin)")
    # one rack or less: the block plugin needs nothing
    assert unit_option(None, nodes=9, unit_nodes=18, unit="rack", extra=[])[1].endswith(
        "add --sbatch=--switches=1 (tree plugin)")
    # SLURM's racks of 16 trays against the config's 18: the nodes would plan on 16
    option, note = unit_option(BLOCKS, nodes=36, unit_nodes=16, unit="nvl72", extra=[])
    assert option is None and note.startswith("SLURM's blocks hold 18 nodes, the cluster config's nvl72 units 16: ")
    # the user's own --segment or --switches is kept, nothing added
    assert unit_option(BLOCKS, nodes=36, unit_nodes=18, unit="rack", extra=["--segment=36"]) == (None, None)
    assert unit_option(SWITCHES, nodes=36, unit_nodes=18, unit="rack", extra=["--switches=1@10:00"]) == (None, None)


def test_sbatch_on_nvl72_racks_books_whole_racks(monkeypatch, tmp_path, capsys):
    """36 trays of gb200_nvl72 (18 a rack) under SLURM's block plugin: `scontrol show topology` answers with two
    blocks (a stand-in for the plugin: Debian's SLURM 22.05 here has none), and the script asks --segment=18."""
    monkeypatch.setattr(slurm_tree, "from_scontrol", lambda: BLOCKS)
    script = tmp_path / "job.sh"
    assert cli.main(["sbatch", "--nodes", "36", "model=tiny_gpt", "cluster=gb200_nvl72", "train.global_batch_size=144",
                     f"out={script}", "--", "pretrain_gpt.py"]) == 0, capsys.readouterr().err
    lines = script.read_text().splitlines()
    assert lines[1:7] == ["#SBATCH --job-name=nest-megatron", "#SBATCH --nodes=36", "#SBATCH --ntasks-per-node=1",
                          "#SBATCH --gpus-per-node=4", "#SBATCH --exclusive", "#SBATCH --segment=18"]
    assert "note:" not in capsys.readouterr().err
    # 40 trays are not whole racks: no option, the note in the script and on stderr
    monkeypatch.setattr(slurm_tree, "from_scontrol", lambda: BLOCKS)
    assert cli.main(["sbatch", "--nodes", "40", "model=tiny_gpt", "cluster=gb200_nvl72", "train.global_batch_size=160",
                     f"out={script}", "--", "pretrain_gpt.py"]) == 0
    text, err = script.read_text(), capsys.readouterr().err
    assert "--segment" not in text and "# note: 40 nodes are not whole nvl72 units of 18 nodes: " in text
    assert "\nnest-megatron sbatch: note: 40 nodes are not whole nvl72 units of 18 nodes: " in "\n" + err

@pytest.mark.parametrize("args, message", [
    (["--nodes", "2", "--time", "4h"], "--time '4h': give minutes, [hours:]minutes:seconds or days-hours"),
    (["--nodes", "0"], "--nodes 0: a job needs at least one node"),
    ([], "--nodes is required: the number of nodes to book"),
    (["--nodes", "2", "--partition", "a b"], "--partition 'a b': one word of printable characters"),
    (["--nodes", "2", "--sbatch=qos=high"], "--sbatch 'qos=high': give one long sbatch option such as --qos=high"),
    (["--nodes", "2", "--srun=-l"], "--srun '-l': give one long srun option such as --container-image=IMAGE"),
    (["--nodes", "2", "--srun=--container-mounts=/a /b"], "--srun '--container-mounts=/a /b': give one long srun option"),
    # 2 nodes x 4 = 8 devices, but the cluster's nodes hold 2
    (["--nodes", "2", "--gpus-per-node", "4"], "cluster dgx_h100_superpod has 2 devices per node, but the launch "
                                               "starts 4 per node"),
    # 80 layers of 8192 on 4 x 80 GB cannot hold weights + optimizer state in any split
    (["--nodes", "2", "--", "pretrain_gpt.py", "--num-layers", "80", "--hidden-size", "8192",
      "--num-attention-heads", "64", "--seq-length", "4096", "--max-position-embeddings", "4096",
      "--global-batch-size", "8", "--vocab-size", "32000", "--bf16"], "no configuration of pretrain_gpt fits"),
], ids=["time", "nodes0", "nodes-missing", "partition", "sbatch-option", "srun-short", "srun-blank", "node-size",
        "infeasible"])
def test_sbatch_bad_input_is_one_line_and_writes_nothing(args, message, tmp_path, capsys):
    script = tmp_path / "job.sh"
    tail = [] if "--" in args else ["--", "pretrain_gpt.py", *MEGATRON_ARGS]
    status = cli.main(["sbatch", *CLUSTER, f"out={script}", *args, *tail])
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert status == 2 and len(lines) == 1, captured.err
    assert lines[0].startswith("nest-megatron sbatch: error: ") and message in lines[0], lines[0]
    assert not script.exists() and captured.out == ""


def test_sbatch_without_a_script_is_one_line(capsys):
    assert cli.main(["sbatch", "--nodes", "2", *CLUSTER]) == 2
    assert capsys.readouterr().err.strip() == ("nest-megatron sbatch: error: no training script: give it after --, "
                                               "e.g. nest-megatron sbatch --nodes 2 -- pretrain_gpt.py ARGS")
