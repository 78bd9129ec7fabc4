"""`nest-megatron launch` and `nest-torchrun` as real processes.

A stand-in `torchrun` executable, first on PATH in a temporary folder, records the argv, pid and
environment it was exec'ed with (a real process: what is tested is the exec, not torchrun), exits
with the status it is told to, or waits for SIGTERM. torchrun itself runs in the end-to-end tests.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nest_megatron.errors import NestError
from nest_megatron.launch.devices import expand_nodelist, resolve

FAKE = """#!{python}
import json, os, signal, sys, time
out = os.environ["FAKE_TORCHRUN_OUT"]
record = {{"argv": sys.argv[1:], "pid": os.getpid(), "cuda": os.environ.get("CUDA_VISIBLE_DEVICES"),
          "connections": os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS")}}
def done(signum, frame):
    with open(out + ".signal", "w") as f:
        f.write(signal.Signals(signum).name)
    sys.exit(128 + signum)
signal.signal(signal.SIGTERM, done)
with open(out + ".tmp", "w") as f:
    json.dump(record, f)
os.replace(out + ".tmp", out)
if os.environ.get("FAKE_TORCHRUN_WAIT"):
    time.sleep(60)
sys.exit(int(os.environ.get("FAKE_TORCHRUN_EXIT", "0")))
"""

# tiny_gpt on two CPU processes, every choice pinned so that the command is known by hand.
TINY = ["model=tiny_gpt", "cluster=dgx_h100_superpod", "cluster.num_devices=2", "train.global_batch_size=8",
        "plan.tp=2", "plan.pp=1", "plan.cp=1", "plan.mbs=2", "plan.zero=1", "plan.recompute=none", "plan.vpp=1"]
# tiny_gpt's YAML (hydra_configs/model/tiny_gpt.yaml) as Megatron flags, written out by hand.
TINY_MODEL = ("--num-layers 4 --hidden-size 256 --ffn-hidden-size 1024 --num-attention-heads 8 --seq-length 128 "
              "--max-position-embeddings 128 --position-embedding-type learned_absolute --normalization LayerNorm "
              "--hidden-dropout 0.1 --attention-dropout 0.1 --make-vocab-size-divisible-by 128 --bf16 --vocab-size 1024").split()
# tp 2 x dp 1, micro-batch 2, global 8, distributed optimizer; TP>1 turns sequence parallel on.
TINY_PARALLEL = ("--tensor-model-parallel-size 2 --pipeline-model-parallel-size 1 --context-parallel-size 1 "
                 "--micro-batch-size 2 --global-batch-size 8 --sequence-parallel --use-distributed-optimizer").split()


@pytest.fixture
def fake(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    exe = bin_dir / "torchrun"
    exe.write_text(FAKE.format(python=sys.executable))
    exe.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", FAKE_TORCHRUN_OUT=str(tmp_path / "record.json"),
               NO_COLOR="1")
    return env, tmp_path / "record.json"


def launch(*args: str, env: dict, script: str = "nest-megatron") -> subprocess.CompletedProcess:
    exe = Path(sys.executable).parent / script
    return subprocess.run([str(exe), *args], env=env, capture_output=True, text=True, timeout=300)


def assert_one_line_error(proc: subprocess.CompletedProcess, record: Path, starts: str) -> None:
    assert proc.returncode == 2, proc.stderr
    line = proc.stderr.strip()
    assert "\n" not in line and "Traceback" not in line, proc.stderr
    assert line.startswith(starts), line
    assert not record.exists()  # nothing started


def test_launch_execs_torchrun_with_the_planned_argv(fake):
    env, record = fake
    proc = launch("launch", *TINY, "--nproc-per-node", "2", "--", "train.py", "--lr", "1e-3", "--seed", "3", env=env)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(record.read_text())
    assert got["argv"] == ["--standalone", "--nnodes", "1", "--nproc-per-node", "2",
                           "train.py", "--lr", "1e-3", "--seed", "3", *TINY_MODEL, *TINY_PARALLEL]
    assert got["cuda"] == "0,1"
    assert got["connections"] == "1"  # Megatron-LM asserts it with TP > 1 (on Hopper and before)
    assert "tp=2 pp=1 dp=1" in proc.stderr


def test_dry_run_prints_the_command_and_starts_nothing(fake):
    env, record = fake
    proc = launch("launch", *TINY, "--dry-run", "--nproc-per-node", "2", "--", "train.py", "--lr", "1e-3", env=env)
    assert proc.returncode == 0, proc.stderr
    expected = " ".join(["CUDA_DEVICE_MAX_CONNECTIONS=1", "CUDA_VISIBLE_DEVICES=0,1",
                         "torchrun", "--standalone", "--nnodes", "1", "--nproc-per-node", "2",
                         "train.py", "--lr", "1e-3", *TINY_MODEL, *TINY_PARALLEL])
    assert expected in proc.stdout.splitlines()
    assert "TP 2" in proc.stdout  # the plan's table
    assert not record.exists()


def test_exit_status_and_pid_are_torchruns(fake):
    env, record = fake
    env["FAKE_TORCHRUN_EXIT"] = "7"
    proc = subprocess.Popen([str(Path(sys.executable).parent / "nest-megatron"), "launch", *TINY, "--nproc-per-node", "2",
                             "--", "train.py"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc.communicate(timeout=300)
    assert proc.returncode == 7
    assert json.loads(record.read_text())["pid"] == proc.pid  # exec: the same process


def test_sigterm_reaches_the_child(fake):
    env, record = fake
    env["FAKE_TORCHRUN_WAIT"] = "1"
    proc = subprocess.Popen([str(Path(sys.executable).parent / "nest-megatron"), "launch", *TINY, "--nproc-per-node", "2",
                             "--", "train.py"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while not record.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert json.loads(record.read_text())["pid"] == proc.pid
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=60)
    assert Path(str(record) + ".signal").read_text() == "SIGTERM"
    assert proc.returncode == 128 + signal.SIGTERM


def test_nest_torchrun_keeps_torchruns_flags(fake):
    env, record = fake
    proc = launch(*TINY, "--standalone", "--nproc_per_node=2", "--max-restarts", "0", "train.py", "--lr", "1e-3",
                  "--tensor-model-parallel-size", "1", env=env, script="nest-torchrun")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(record.read_text())["argv"] == [
        "--standalone", "--nproc_per_node=2", "--max-restarts", "0", "train.py", "--lr", "1e-3", *TINY_MODEL, *TINY_PARALLEL]


def test_slurm_node_starts_its_agent_with_the_shared_rendezvous(fake):
    """Two SLURM nodes of 8 GPUs (the variables srun sets; the real SLURM run is tests/test_slurm*)."""
    env, record = fake
    env.update(SLURM_JOB_NODELIST="gpu[07-08]", SLURM_NNODES="2", SLURM_NODEID="1", SLURM_GPUS_ON_NODE="8",
               SLURM_JOB_ID="4242")
    pinned = ["model=tiny_gpt", "cluster=dgx_h100_superpod", "train.global_batch_size=64", "plan.tp=8", "plan.pp=2",
              "plan.mbs=1", "plan.zero=1", "plan.recompute=none", "plan.vpp=1"]
    proc = launch("launch", *pinned, "--", "train.py", env=env)
    assert proc.returncode == 0, proc.stderr
    argv = json.loads(record.read_text())["argv"]
    # static rendezvous: 2 nodes x 8, this node's rank, the master is the host of node rank 0, port 20000 + 4242
    head = argv[: argv.index("train.py")]
    assert head[:4] == ["--nnodes", "2", "--nproc-per-node", "8"]
    assert head[4] == "--node-rank" and head[5] in ("0", "1")
    master = "gpu08" if head[5] == "0" else "gpu07"
    assert head[6:] == ["--master-addr", master, "--master-port", "24242"]


@pytest.mark.parametrize("args, extra_env, starts", [
    (["model=llama3_70b", "cluster=dgx_h100_superpod", "cluster.num_devices=8", "--nproc-per-node", "8", "--", "t.py"], {},
     "nest-megatron launch: error: no configuration of llama3_70b fits on 8 x h100_sxm"),
    (["model=tiny_gpt", "cluster=dgx_h100_superpod", "cluster.num_devices=4", "--nproc-per-node", "2", "--", "t.py"], {},
     "nest-megatron launch: error: cluster dgx_h100_superpod has 4 devices, but the launch starts 1 x 2 = 2"),
    (["model=tiny_gpt", "--nproc-per-node", "2", "t.py"], {},
     "nest-megatron launch: error: no training script: give it after --"),
    (["model=tiny_gpt", "--", "t.py"], {}, "nest-megatron launch: error: device count unknown"),
    (["model=tiny_gpt", "--", "t.py"], {"SLURM_JOB_NODELIST": "n[1-2]", "SLURM_NNODES": "3", "SLURM_GPUS_ON_NODE": "8"},
     "nest-megatron launch: error: SLURM_NNODES=3, but SLURM_JOB_NODELIST=n[1-2] names 2 hosts"),
    (["model=tiny_gpt", "--nnodes", "2", "--", "t.py"], {"SLURM_JOB_NODELIST": "n1", "SLURM_GPUS_ON_NODE": "8"},
     "nest-megatron launch: error: --nnodes 2, but the SLURM allocation has SLURM_NNODES=1"),
    (["model=tiny_gpt", "--nproc-per-node", "2", "--", "t.py", "--bf16", "--fp16"], {},
     "nest-megatron launch: error: --bf16 and"),
    (["model=tiny_gpt", "--bogus", "1", "--nproc-per-node", "2", "--", "t.py"], {},
     "nest-megatron launch: error: unrecognized arguments: --bogus 1"),
])
def test_bad_launch_is_one_line_and_starts_nothing(fake, args, extra_env, starts):
    env, record = fake
    env.update(extra_env)
    assert_one_line_error(launch("launch", *args, env=env), record, starts)


@pytest.mark.parametrize("text, hosts", [
    ("n1", ["n1"]),
    ("n[1-3,5]", ["n1", "n2", "n3", "n5"]),
    ("gpu[08-10],login", ["gpu08", "gpu09", "gpu10", "login"]),
    ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),
])
def test_expand_nodelist(text, hosts):
    assert expand_nodelist(text) == hosts


@pytest.mark.parametrize("text", ["n[1-", "n[3-1]", "n[a-b]", "n1,,n2"])
def test_bad_nodelist_is_one_line(text):
    with pytest.raises(NestError, match=r"^SLURM_JOB_NODELIST="):
        expand_nodelist(text)


def test_devices_from_torchrun_flags_and_slurm():
    d = resolve(nnodes="4", nproc_per_node="8", node_rank="2", rdzv_endpoint="head:29400", env={})
    assert (d.num_devices, d.node_rank, d.master_addr, d.master_port) == (32, 2, "head", 29400)
    s = resolve(env={"SLURM_JOB_NODELIST": "n[1-4]", "SLURM_NNODES": "4", "SLURM_NODEID": "3", "SLURM_GPUS_ON_NODE": "8"})
    assert (s.num_nodes, s.per_node, s.node_rank, s.master_addr, s.hosts) == (4, 8, 3, "n1", ("n1", "n2", "n3", "n4"))
    # torchrun's flags win for the processes per node (a CPU allocation has no SLURM_GPUS_ON_NODE)
    assert resolve(nproc_per_node="2", env={"SLURM_JOB_NODELIST": "n1", "SLURM_NODEID": "0"}).num_devices == 2
    for kwargs, message in [
        (dict(nnodes="1:4", nproc_per_node="8"), "--nnodes 1:4: an elastic range cannot be planned"),
        (dict(nnodes="2", nproc_per_node="8", node_rank="2"), "node rank 2: must be below the node count 2"),
        (dict(nproc_per_node="0"), "--nproc-per-node 0: must be at least 1"),
        (dict(nproc_per_node="8", master_addr="a", rdzv_endpoint="b:1"), "--rdzv-endpoint and --master-addr: give one"),
    ]:
        with pytest.raises(NestError, match=f"^{message}"):
            resolve(env={}, **kwargs)
    with pytest.raises(NestError, match="^SLURM_NODEID=5: must be below the 2 nodes"):
        resolve(env={"SLURM_JOB_NODELIST": "n[1-2]", "SLURM_NODEID": "5", "SLURM_GPUS_ON_NODE": "8"})
    with pytest.raises(NestError, match="^devices per node unknown: SLURM_GPUS_ON_NODE is not set"):
        resolve(env={"SLURM_JOB_NODELIST": "n[1-2]", "SLURM_NODEID": "0"})
