"""`nest-megatron launch` and `nest-torchrun` as real processes, with a real torchrun.

torchrun's agent runs inside the launch process; its workers run a small recording script (no torch:
a worker starts in a fraction of a second) that writes the argv and environment it got, then exits
with the status it is told to, or waits for SIGTERM. Megatron itself runs in tests/test_e2e_launch.py.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nest_megatron import api, cli
from nest_megatron.commands.launch import torchrun_main
from nest_megatron.errors import NestError
from nest_megatron.launch.devices import expand_nodelist, resolve
from nest_megatron.launch.prepare import prepare
from nest_megatron.launch.torchrun import check_script

WORKER = """import json, os, signal, sys, time
out = os.environ["WORKER_OUT"]
rank = os.environ["RANK"]
record = {"argv": sys.argv[1:], "ppid": os.getppid(),
          **{k: os.environ.get(k) for k in ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_MAX_CONNECTIONS", "WORLD_SIZE",
                                            "LOCAL_WORLD_SIZE", "TORCHELASTIC_MAX_RESTARTS")}}
def stopped(signum, frame):
    with open(os.path.join(out, f"signal{rank}"), "w") as f:
        f.write(signal.Signals(signum).name)
    sys.exit(0)
signal.signal(signal.SIGTERM, stopped)
# written under another name, renamed when whole: the test polls for records and must never read half of one
with open(os.path.join(out, f"rank{rank}.tmp"), "w") as f:
    json.dump(record, f)
os.replace(os.path.join(out, f"rank{rank}.tmp"), os.path.join(out, f"rank{rank}.json"))
if os.environ.get("WORKER_WAIT"):
    time.sleep(120)
code = int(os.environ.get("WORKER_RANK1_EXIT", "0")) if rank == "1" else 0
if code < 0:
    os.kill(os.getpid(), -code)  # die of that signal
sys.exit(code)
"""

# tiny_gpt on two CPU processes, every choice pinned so that the command is known by hand.
TINY = ["model=tiny_gpt", "cluster=dgx_h100_superpod", "cluster.num_devices=2", "train.global_batch_size=8",
        "plan.tp=2", "plan.pp=1", "plan.cp=1", "plan.mbs=2", "plan.zero=1", "plan.recompute=none", "plan.vpp=1"]
# tiny_gpt's YAML (hydra_configs/model/tiny_gpt.yaml) as Megatron flags, written out by hand.
TINY_MODEL = ("--num-layers 4 --hidden-size 256 --ffn-hidden-size 1024 --num-attention-heads 8 --seq-length 128 "
              "--max-position-embeddings 128 --position-embedding-type learned_absolute --normalization LayerNorm "
              "--hidden-dropout 0.1 --attention-dropout 0.1 --make-vocab-size-divisible-by 128 --padded-vocab-size 1024 --bf16 "
              "--vocab-size 1024").split()  # 1024 entries pad to a multiple of 128 x TP 2: 1024 rows
# tp 2 x dp 1, micro-batch 2, global 8, distributed optimizer; TP>1 turns sequence parallel on.
TINY_PARALLEL = ("--tensor-model-parallel-size 2 --pipeline-model-parallel-size 1 --context-parallel-size 1 "
                 "--micro-batch-size 2 --global-batch-size 8 --sequence-parallel --use-distributed-optimizer").split()
DIGEST = re.compile(r", plan ([0-9a-f]{12})$", re.M)


def tiny_digest() -> str:
    """The digest of TINY's plan, planned here through the API. A launch reads the overlap options from the
    argv, which has no --overlap-grad-reduce / --overlap-param-gather: both off."""
    return api.plan(["train.overlap_grad_reduce=false", "train.overlap_param_gather=false", *TINY]).digest


@pytest.fixture
def worker(tmp_path):
    """(environment, the worker script, the folder its records go to)."""
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    out = tmp_path / "records"
    out.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TORCHELASTIC_"))}
    env.update(WORKER_OUT=str(out), NO_COLOR="1", OMP_NUM_THREADS="1")
    return env, str(script), out


def launch(*args: str, env: dict, script: str = "nest-megatron") -> subprocess.CompletedProcess:
    exe = Path(sys.executable).parent / script
    return subprocess.run([str(exe), *args], env=env, capture_output=True, text=True, timeout=300)


def records(out: Path) -> dict[int, dict]:
    return {int(p.stem[4:]): json.loads(p.read_text()) for p in out.glob("rank*.json")}


def assert_one_line_error(proc: subprocess.CompletedProcess, out: Path, starts: str) -> str:
    assert proc.returncode == 2, proc.stderr
    line = proc.stderr.strip()
    assert "\n" not in line and "Traceback" not in line, proc.stderr
    assert line.startswith(starts), line
    assert not list(out.iterdir())  # no worker started
    return line


def test_launch_runs_torchrun_with_the_planned_argv(worker):
    env, script, out = worker
    proc = subprocess.Popen([str(Path(sys.executable).parent / "nest-megatron"), "launch", *TINY, "--nproc-per-node",
                             "2", "--", script, "--lr", "1e-3", "--seed", "3"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    got = records(out)
    assert sorted(got) == [0, 1]
    for record in got.values():
        assert record["argv"] == ["--lr", "1e-3", "--seed", "3", *TINY_MODEL, *TINY_PARALLEL]
        assert (record["WORLD_SIZE"], record["LOCAL_WORLD_SIZE"]) == ("2", "2")  # --nproc-per-node 2, one node
        assert record["CUDA_VISIBLE_DEVICES"] == "0,1"
        assert record["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"  # Megatron-LM asserts it with TP > 1 (on Hopper and before)
        assert record["ppid"] == proc.pid  # torchrun's agent is the launch process itself
    assert "tp=2 pp=1 dp=1" in err
    # before torchrun starts, each flag the plan changed, each with its own why (the Hydra overrides chose TP 2 and
    # micro-batch 2; the argv gave neither, and Megatron requires a micro-batch size)
    change = "--micro-batch-size: (unset) -> 2 (Megatron requires it and the argv gives none: the planner's choice)"
    assert change in err.splitlines() and err.index(change) < err.index("nest-megatron: tp=2")
    tp = next(line for line in err.splitlines() if line.startswith("--tensor-model-parallel-size: (unset) -> 2 ("))
    assert tp.startswith("--tensor-model-parallel-size: (unset) -> 2 (with --tensor-model-parallel-size unset and the "
                         "plan's other flags, ") and "--micro-batch-size" not in tp, tp


def test_dry_run_prints_the_command_and_the_digest_and_starts_nothing(worker):
    env, script, out = worker
    proc = launch("launch", *TINY, "--dry-run", "--nproc-per-node", "2", "--", script, "--lr", "1e-3", env=env)
    assert proc.returncode == 0, proc.stderr
    expected = " ".join(["CUDA_DEVICE_MAX_CONNECTIONS=1", "CUDA_VISIBLE_DEVICES=0,1",
                         "torchrun", "--standalone", "--nnodes", "1", "--nproc-per-node", "2",
                         script, "--lr", "1e-3", *TINY_MODEL, *TINY_PARALLEL])
    assert expected in proc.stdout.splitlines()
    assert "TP 2" in proc.stdout  # the plan's table
    # the digest of the same problem planned in this process, through the API
    assert DIGEST.findall(proc.stdout) == [tiny_digest()]
    assert not list(out.iterdir())


@pytest.mark.parametrize("rank1_exit, status", [
    (3, 3),  # a worker's own status, e.g. a config error of the training script
    (-signal.SIGKILL, 128 + 9),  # killed (the kernel's OOM killer): 137, as a shell reports it
], ids=["exit3", "sigkill"])
def test_launch_ends_with_the_failing_workers_status(worker, rank1_exit, status):
    env, script, out = worker
    env["WORKER_RANK1_EXIT"] = str(rank1_exit)
    proc = launch("launch", *TINY, "--nproc-per-node", "2", "--", script, env=env)
    assert proc.returncode == status, proc.stderr[-3000:]
    assert sorted(records(out)) == [0, 1]
    assert proc.stderr.splitlines()[-1] == (f"nest-megatron: first failure: rank 1 "
                                            f"{'exited with 3' if rank1_exit == 3 else 'died of SIGKILL'}; "
                                            f"the launch exits with {status}")


def test_sigterm_reaches_the_agent_and_its_workers(worker):
    env, script, out = worker
    env["WORKER_WAIT"] = "1"
    proc = subprocess.Popen([str(Path(sys.executable).parent / "nest-megatron"), "launch", *TINY, "--nproc-per-node", "2",
                             "--", script], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while len(records(out)) < 2 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert [r["ppid"] for r in records(out).values()] == [proc.pid] * 2
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    # the agent stopped both workers with SIGTERM, then ended with torchrun's own status for a stopped agent
    assert sorted(p.read_text() for p in out.glob("signal*")) == ["SIGTERM", "SIGTERM"]
    assert proc.returncode == 1, err[-3000:]
    assert err.splitlines()[-1] == "nest-megatron: torchrun's agent stopped on SIGTERM; the launch exits with 1"


def test_sigterm_before_torchrun_ends_the_launch_with_1():
    """While the launch plans (before torchrun), SIGTERM ends it with 1, not as a signal death (143): under
    srun, which stops the other nodes when one fails and reports the highest status, the failing node's own
    status (2 for bad input) then stays the job's."""
    code = ("import os, signal, sys, time\n"
            "from nest_megatron.launch.torchrun import sigterm_stops_with_status\n"
            "with sigterm_stops_with_status(process_ends=True):\n"
            "    os.kill(os.getpid(), signal.SIGTERM)\n"
            "    time.sleep(30)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    assert proc.stderr == "nest-megatron: stopped by SIGTERM; the launch exits with 1\n"
    # a SIGTERM handled inside an at-fork hook (as logging's, when planning forks), where Python drops the
    # handler's SystemExit, still stops the launch (this one ran on to its refusal, status 2, on a SLURM node)
    in_hook = ("import os, signal, sys, time\n"
               "from nest_megatron.launch.torchrun import sigterm_stops_with_status\n"
               "def after_fork():\n"
               "    os.kill(os.getpid(), signal.SIGTERM)\n"
               "    time.sleep(0.01)\n"
               "with sigterm_stops_with_status(process_ends=True):\n"
               "    os.register_at_fork(after_in_parent=after_fork)\n"
               "    if os.fork() == 0:\n"
               "        os._exit(0)\n"
               "    time.sleep(30)\n"
               "    sys.exit(2)\n")
    proc = subprocess.run([sys.executable, "-c", in_hook], capture_output=True, text=True, timeout=60)
    assert (proc.returncode, proc.stderr) == (1, "nest-megatron: stopped by SIGTERM; the launch exits with 1\n")
    # once the status is decided, a SIGTERM while the process ends changes nothing
    ending = ("import os, signal, sys\n"
              "from nest_megatron.launch.torchrun import sigterm_stops_with_status\n"
              "with sigterm_stops_with_status(process_ends=True):\n"
              "    pass\n"
              "os.kill(os.getpid(), signal.SIGTERM)\n"
              "sys.exit(2)\n")
    assert subprocess.run([sys.executable, "-c", ending], timeout=60).returncode == 2


def test_a_launch_called_in_this_process_gives_sigterm_back(capsys):
    """Called in a process that goes on (a test, a library), the launch leaves SIGTERM's handler as it was: an
    ignored SIGTERM was inherited by the pytest worker's later pool workers, which then outlived Pool.terminate()
    and hung the test run."""
    before = signal.getsignal(signal.SIGTERM)
    assert before is not signal.SIG_IGN
    dry_run(capsys, "--", "t.py", *DENSE_MODEL)
    assert signal.getsignal(signal.SIGTERM) is before
    assert torchrun_main(["cluster=dgx_h100_superpod", "--dry-run", "--standalone", "--nproc-per-node", "2", "train.py",
                          *DENSE_MODEL]) == 0, capsys.readouterr().err
    assert signal.getsignal(signal.SIGTERM) is before


def test_nest_torchrun_keeps_torchruns_flags(worker):
    env, script, out = worker
    proc = launch(*TINY, "--standalone", "--nproc_per_node=2", "--max-restarts", "2", script, "--lr", "1e-3",
                  "--tensor-model-parallel-size", "1", env=env, script="nest-torchrun")
    assert proc.returncode == 0, proc.stderr
    for record in records(out).values():
        assert record["argv"] == ["--lr", "1e-3", *TINY_MODEL, *TINY_PARALLEL]
        assert (record["LOCAL_WORLD_SIZE"], record["TORCHELASTIC_MAX_RESTARTS"]) == ("2", "2")  # as typed
    assert len(records(out)) == 2


def test_slurm_node_starts_its_agent_with_the_shared_rendezvous():
    """Two SLURM nodes of 8 GPUs (the variables srun sets; the real SLURM run is tests/test_slurm.py)."""
    devices = resolve(env={"SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_NNODES": "2", "SLURM_NODEID": "1",
                           "SLURM_GPUS_ON_NODE": "8", "SLURM_JOB_ID": "4242"})
    pinned = ["model=tiny_gpt", "cluster=dgx_h100_superpod", "train.global_batch_size=64", "plan.tp=8", "plan.pp=2",
              "plan.mbs=1", "plan.zero=1", "plan.recompute=none", "plan.vpp=1"]
    argv = prepare(overrides=pinned, script="train.py", script_args=[], devices=devices).this_node.argv
    # static rendezvous: 2 nodes x 8, this node's rank, the master is the host of node rank 0, port 20000 + 4242
    head = argv[: argv.index("train.py")]
    assert head[:5] == ["torchrun", "--nnodes", "2", "--nproc-per-node", "8"]
    assert head[5] == "--node-rank" and head[6] in ("0", "1")
    master = "gpu08" if head[6] == "0" else "gpu07"
    assert head[7:] == ["--master-addr", master, "--master-port", "24242"]


def test_expect_plan_of_the_same_plan_starts(worker):
    env, script, out = worker
    proc = launch("launch", *TINY, "--expect-plan", tiny_digest(), "--dry-run", "--nproc-per-node", "2",
                  "--", script, env=env)
    assert proc.returncode == 0, proc.stderr


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
    ([*TINY, "--expect-plan", "8C73610", "--nproc-per-node", "2", "--", "t.py"], {},
     "nest-megatron launch: error: --expect-plan '8C73610': give the 12 hex digits of a plan digest"),
])
def test_bad_launch_is_one_line_and_starts_nothing(worker, args, extra_env, starts):
    env, script, out = worker
    env.update(extra_env)
    args = [script if a == "t.py" else a for a in args]  # the worker: had the launch gone on, it would record
    assert_one_line_error(launch("launch", *args, env=env), out, starts)


@pytest.mark.parametrize("dry_run", [[], ["--dry-run"]], ids=["launch", "dry-run"])
def test_expect_plan_of_another_plan_is_one_line_and_starts_nothing(worker, dry_run):
    """A node that plans differently from the job (here: the job expects a digest no plan has)."""
    env, script, out = worker
    proc = launch("launch", *TINY, "--expect-plan", "000000000000", *dry_run, "--nproc-per-node", "2", "--", script,
                  env=env)
    line = assert_one_line_error(proc, out, f"nest-megatron launch: error: this node planned {tiny_digest()}, "
                                            "but the job expects plan 000000000000 (--expect-plan): nothing started; ")
    assert all(cause in line for cause in ("nest-megatron version", "cluster config", "profile cache",
                                           "other switches or racks")), line
    assert proc.stdout == ""  # not even the dry run's plan


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
        (dict(nnodes="1:4", nproc_per_node="8"), "--nnodes 1:4: nest-torchrun plans one node count; for an elastic "
                                                  "range, which plans every count and replans at each rendezvous, use "
                                                  "nest-megatron launch --nnodes 1:4"),
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


# -- a script that is not there, MoE's dispatcher, what a dry run says of each node --------------------------

def test_missing_script_is_one_line_and_starts_nothing(worker):
    """Checked on the node that runs it (every node runs launch itself), before planning; a dry run only prints."""
    env, script, out = worker
    where = f"on this node ({socket.gethostname()}, working directory {os.getcwd()})"
    assert_one_line_error(launch("launch", *TINY, "--nproc-per-node", "2", "--", "nope_pretrain.py", env=env), out,
                          f"nest-megatron launch: error: nope_pretrain.py: no such training script {where}")
    assert_one_line_error(launch(*TINY, "--standalone", "--nproc-per-node", "2", "nope_pretrain.py", env=env,
                                 script="nest-torchrun"), out,
                          f"nest-megatron torchrun: error: nope_pretrain.py: no such training script {where}")
    assert launch("launch", *TINY, "--dry-run", "--nproc-per-node", "2", "--", "nope_pretrain.py", env=env).returncode == 0


def test_torchruns_module_and_no_python_forms_are_looked_up_their_way(tmp_path):
    check_script("no_such_module", module=True)  # -m: Python's to find, in the workers' environment
    check_script("true", no_python=True)  # --no-python: a program on PATH
    with pytest.raises(NestError) as err:
        check_script("no-such-program", no_python=True)
    assert str(err.value) == (f"no-such-program: no such program on this node ({socket.gethostname()}), neither a "
                              "path nor on PATH (--no-python runs it as a program)")
    with pytest.raises(NestError):
        check_script(str(tmp_path))  # a folder is no script


DENSE_MODEL = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --vocab-size 128 --bf16 "
               "--micro-batch-size 2 --global-batch-size 8").split()
MOE_MODEL = [*DENSE_MODEL, "--num-experts", "4"]


def dry_run(capsys, *args: str) -> list[str]:
    """launch --dry-run on 2 devices: its stdout lines; its stderr (the flags the plan changed) in dry_run.err."""
    status = cli.main(["launch", "cluster=dgx_h100_superpod", "cluster.num_devices=2", "--nproc-per-node", "2",
                       "--dry-run", *args])
    out, dry_run.err = capsys.readouterr()
    assert status == 0, dry_run.err
    return out.splitlines()


def test_moe_launch_runs_the_dispatcher_the_plan_prices(capsys):
    """Megatron's default dispatcher is allgather; without the flag the plan prices and launches alltoall, and the
    list of changed flags says so with why. The user's own dispatcher is kept (train.moe_dispatcher), once."""
    why = "(the plan prices the alltoall dispatcher's traffic)"
    lines = dry_run(capsys, "--", "t.py", *MOE_MODEL)
    argv = shlex.split(lines[-1])
    assert argv[argv.index("--moe-token-dispatcher-type") + 1] == "alltoall"
    assert f"--moe-token-dispatcher-type: (unset) -> alltoall {why}" in dry_run.err.splitlines()
    assert not any(line.startswith("--moe-token-dispatcher-type:") for line in lines)  # on stderr only

    lines = dry_run(capsys, "--", "t.py", *MOE_MODEL, "--moe-token-dispatcher-type", "allgather")
    argv = shlex.split(lines[-1])
    assert argv.count("--moe-token-dispatcher-type") == 1 and argv[argv.index("--moe-token-dispatcher-type") + 1] == "allgather"
    assert "--moe-token-dispatcher-type:" not in dry_run.err

    # a dense model: the plan sets no dispatcher, Megatron ignores the user's, which stays as typed
    argv = shlex.split(dry_run(capsys, "--", "t.py", *DENSE_MODEL, "--moe-token-dispatcher-type", "flex")[-1])
    assert argv[argv.index("--moe-token-dispatcher-type") + 1] == "flex" and argv.count("--moe-token-dispatcher-type") == 1
    assert "--moe-token-dispatcher-type" not in dry_run.err


def torchrun_dry_run(capsys, *flags: str) -> list[str]:
    """nest-torchrun --dry-run on 2 nodes of 8 (a DGX H100 pod): the command lines it prints, with their labels."""
    assert torchrun_main(["model=tiny_gpt", "cluster=dgx_h100_superpod", "--dry-run", "--nnodes", "2",
                          "--nproc-per-node", "8", *flags, "train.py"]) == 0, capsys.readouterr().err
    lines = capsys.readouterr().out.splitlines()
    return lines[next(i for i, line in enumerate(lines) if line.startswith("# ")):]


def test_nest_torchrun_dry_run_prints_what_each_node_runs(capsys):
    # dynamic rendezvous, no --node-rank: the rendezvous numbers the nodes; every node runs the same line
    lines = torchrun_dry_run(capsys, "--rdzv-backend", "c10d", "--rdzv-endpoint", "n1:29500")
    assert len(lines) == 2 and lines[0] == "# every node (2) runs the same command:"
    assert " torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint n1:29500 train.py " in lines[1]
    # --node-rank 1 as typed: that is this node's command only (node 0's would carry --node-rank 0)
    lines = torchrun_dry_run(capsys, "--node-rank", "1", "--master-addr", "n1")
    assert len(lines) == 2 and lines[0] == "# node rank 1 (this node; each node runs its own command):"
    assert " torchrun --nnodes 2 --nproc-per-node 8 --node-rank 1 --master-addr n1 train.py " in lines[1]
