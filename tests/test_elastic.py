"""Elastic replanning: `nest-megatron launch --nnodes 2:3` plans both node counts before torchrun's elastic agent
starts; after each rendezvous the workers pick the plan of the nodes present and resume from the torch_dist
checkpoint. End to end on CPU, agents on loopback (c10d rendezvous, one process each) training the real
megatron-core script: three start and one is killed, the other two continue under the 2-node plan; and two
start, a third joins, and all three continue under the 3-node plan."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nest_megatron.config.schema import ModelConfig
from nest_megatron.errors import NestError
from nest_megatron.launch.elastic import Entry, check_resumable
from nest_megatron.launch.elastic_worker import select
from nest_megatron.model.spec import ModelSpec

ROOT = Path(__file__).resolve().parents[1]
LAUNCH = [sys.executable, "-m", "nest_megatron.cli", "launch"]
# Nodes of one CPU "device" each: the 2- and 3-node plans.
CLUSTER = ["cluster=dgx_h100_superpod", "cluster.levels.0.fan_out=1"]
VOCAB = 128
GLOBAL_BATCH = 12  # a multiple of DP 2 and DP 3: every plan keeps it
TRAIN_ITERS = 30
# The two nodes' workers wait (stopped) while the third node plans and joins: the 3-node run trains on from the
# checkpoint at 2 * SAVE_INTERVAL, whatever the time the node took to join.
JOIN_TRAIN_ITERS = 30
SAVE_INTERVAL = 5


def megatron_args(ckpt: Path, train_iters: int = TRAIN_ITERS) -> list[str]:
    # --make-vocab-size-divisible-by 64: the vocabulary pads to 128 rows at TP 1 and TP 2 alike, so that any plan
    # loads any other's checkpoint.
    return ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
            "--max-position-embeddings", "32", "--micro-batch-size", "2", "--global-batch-size", str(GLOBAL_BATCH),
            "--vocab-size", str(VOCAB), "--make-vocab-size-divisible-by", "64", "--bf16", "--lr", "3e-3",
            "--hidden-dropout", "0", "--attention-dropout", "0", "--train-iters", str(train_iters),
            "--save", str(ckpt), "--load", str(ckpt), "--save-interval", str(SAVE_INTERVAL)]


def run_launch(args: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([*LAUNCH, *CLUSTER, *args], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, **(env or {})})


PLAN_LINE = re.compile(r"^nest-megatron: elastic, (\d) node\(s\): tp=(\d+) pp=(\d+) dp=(\d+) .* mbs=(\d+) x (\d+) "
                       r"micro-batches = global batch (\d+)", re.M)


def test_dry_run_plans_every_node_count_and_prints_the_elastic_agent():
    result = run_launch(["--nnodes", "2:3", "--nproc-per-node", "1", "--rdzv-endpoint", "127.0.0.1:29400", "--dry-run",
                         "--", "scripts/pretrain_gpt.py", *megatron_args(Path("/tmp/ckpt"))])
    assert result.returncode == 0, result.stderr
    plans = {int(m.group(1)): tuple(map(int, m.groups()[1:])) for m in PLAN_LINE.finditer(result.stdout)}
    assert sorted(plans) == [2, 3], result.stdout
    # 3 ranks: TP must divide both 3 and the 4 heads, PP both 3 and the 2 layers: only DP 3 is left.
    tp, pp, dp, mbs, micro, gbs = plans[3]
    assert (tp, pp, dp) == (1, 1, 3)
    for tp, pp, dp, mbs, micro, gbs in plans.values():
        assert gbs == GLOBAL_BATCH and micro == GLOBAL_BATCH // (mbs * dp)  # the batch is kept, the micro-batches follow
    command = result.stdout.strip().splitlines()[-1]
    # Inside a SLURM job the same: the rendezvous, not SLURM's node list, decides the nodes of each plan.
    inside = run_launch(["--nnodes", "2:3", "--nproc-per-node", "1", "--rdzv-endpoint", "127.0.0.1:29400", "--dry-run",
                         "--", "scripts/pretrain_gpt.py", *megatron_args(Path("/tmp/ckpt"))],
                        env={"SLURM_JOB_NODELIST": "n[1-3]", "SLURM_NNODES": "3", "SLURM_NODEID": "0"})
    assert inside.returncode == 0 and inside.stdout == result.stdout, inside.stderr
    assert command.startswith("TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --nnodes 2:3 --nproc-per-node 1 --rdzv-backend c10d "
                              "--rdzv-endpoint 127.0.0.1:29400 --rdzv-id nest-")
    assert command.endswith("-m nest_megatron.launch.elastic_worker RUN_DIR")


@pytest.mark.parametrize("flags, script_extra, message", [
    (["--nnodes", "3:2"], [], "--nnodes 3:2: give MIN:MAX with 1 <= MIN <= MAX"),
    (["--nnodes", "2:3", "--node-rank", "1"], [], "--nnodes 2:3 with --node-rank: an elastic job's rendezvous numbers"),
    (["--nnodes", "2:3"], ["--ckpt-format", "torch"],
     "--nnodes 2:3 with --ckpt-format torch: an elastic job resumes under another plan"),
    (["--nnodes", "2:3"], ["--load", "/tmp/other"], "--nnodes 2:3: an elastic job resumes from its last checkpoint"),
    # 5 ranks: TP divides the 4 heads and 5, PP the 2 layers and 5 (both 1), DP 5 does not divide the global batch
    # 12: no layout uses all 5 devices (4 of them do, DP 4), and torchrun would start a worker on the fifth.
    (["--nnodes", "3:5"], [], "--nnodes 3:5: 5 node(s) cannot be planned on all their devices: no plan keeps what "
                              "the launch line fixes (--load with --ckpt-format torch_dist (DDP)): no launchable "
                              "configuration: --global-batch-size (train.global_batch_size)=12: must be a multiple of "
                              "micro_batch_size*dp = 1*5"),
    (["--nnodes", "2:3", "cluster.failed_nodes=n2"], [], "--nnodes 2:3 with cluster.failed_nodes=n2: an elastic job is "
                                                         "planned by node count"),
])
def test_bad_elastic_input_is_one_line_and_starts_nothing(flags, script_extra, message):
    args = megatron_args(Path("/tmp/ckpt"))
    if "--load" in script_extra:
        args = args[: args.index("--load")] + args[args.index("--load") + 2:]
    result = run_launch([*flags, "--nproc-per-node", "1", "--rdzv-endpoint", "127.0.0.1:29400", "--",
                         "scripts/pretrain_gpt.py", *args, *script_extra])
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"nest-megatron launch: error: {message}"), lines


def _entry(nodes: int, tp: int, padded_vocab: int, zero: int = 0, vocab_size: int = 50000, divisible_by: int = 128) -> Entry:
    dp = nodes // tp
    return Entry(nodes=nodes, digest="0" * 12, parallel={"tp": tp, "pp": 1, "dp": dp, "cp": 1, "ep": 1, "etp": tp, "vpp": 1},
                 micro_batch_size=1, global_batch_size=12, num_microbatches=12 // dp, zero_stage=zero,
                 vocab_size=vocab_size, vocab_divisible_by=divisible_by, padded_vocab=padded_vocab, world_size=nodes, num_devices=nodes, argv=[], env={}, cuda_visible_devices={})


def test_plans_that_cannot_load_each_others_checkpoint_are_refused():
    # Vocabulary 50000 padded to a multiple of 128 x TP: 50048 at TP 1, 50176 at TP 2 (by hand): the embedding's
    # global shape differs, so neither plan loads the other's checkpoint.
    with pytest.raises(NestError, match=r"pad the vocabulary to 50048 and 50176 rows"):
        check_resumable([_entry(2, 1, 50048), _entry(4, 2, 50176)], [])
    with pytest.raises(NestError, match=r"differ in tp, etp, which the distributed optimizer's bucket-space"):
        check_resumable([_entry(2, 1, 128, zero=1), _entry(4, 2, 128, zero=1)], ["--use-distributed-optimizer"])
    check_resumable([_entry(2, 1, 128, zero=1), _entry(4, 2, 128, zero=1)],
                    ["--use-distributed-optimizer", "--dist-ckpt-optim-fully-reshardable"])


@pytest.mark.parametrize("vocab, tps, advised, too_coarse", [
    # Worked from Megatron's rule, pad to a multiple of m x TP, trying m = 128 (given), 64, 32...:
    # 128256 = 2^8 x 501. m = 128: TP 1 128256, TP 8 (1024) 129024. m = 64: TP 8 (512) 128512. m = 32: TP 8 (256)
    # 128256 = every TP's. At 1024 (a "multiple", the old advice): TP 1 129024, TP 8 (8192) 131072.
    (128256, [1, 2, 4, 8], 32, 1024),
    # 50000. m = 128: TP 1 50048, TP 2 (256) 50176. m = 64: TP 1 782 x 64 = 50048, TP 2 (128) 391 x 128 = 50048.
    # At 16: TP 1 50000, TP 2 (32) 50016.
    (50000, [1, 2], 64, 16),
])
def test_the_vocabulary_advice_once_followed_lets_every_plan_load_the_others(vocab, tps, advised, too_coarse):
    def entries(m):
        model = ModelConfig(vocab_size=vocab, make_vocab_size_divisible_by=m)
        return [_entry(tp, tp, ModelSpec(model).padded_vocab(tp), vocab_size=vocab, divisible_by=m) for tp in tps]

    with pytest.raises(NestError, match=rf"give --make-vocab-size-divisible-by {advised} \(every TP"):
        check_resumable(entries(128), [])
    check_resumable(entries(advised), [])  # followed: every plan pads alike
    with pytest.raises(NestError, match=r"pad the vocabulary to"):
        check_resumable(entries(too_coarse), [])


def test_worker_picks_the_plan_of_the_world_size_and_refuses_an_unplanned_one(tmp_path):
    index = {"script": "train.py", "python": "/usr/bin/python3", "sizes": {
        "2": {"nodes": 2, "argv": ["--tensor-model-parallel-size", "2"], "env": {"CUDA_DEVICE_MAX_CONNECTIONS": "1"},
              "cuda_visible_devices": {"1": "1,0"}},
        "3": {"nodes": 3, "argv": ["--tensor-model-parallel-size", "1"], "env": {"CUDA_DEVICE_MAX_CONNECTIONS": None},
              "cuda_visible_devices": {}}}}
    (tmp_path / "elastic.json").write_text(json.dumps(index))
    command, env, _ = select(str(tmp_path), {"WORLD_SIZE": "2", "GROUP_RANK": "1"})
    assert command == ["/usr/bin/python3", "-u", "train.py", "--tensor-model-parallel-size", "2"]
    assert env["CUDA_DEVICE_MAX_CONNECTIONS"] == "1" and env["CUDA_VISIBLE_DEVICES"] == "1,0"
    _, env, _ = select(str(tmp_path), {"WORLD_SIZE": "3", "CUDA_DEVICE_MAX_CONNECTIONS": "1"})
    assert "CUDA_DEVICE_MAX_CONNECTIONS" not in env
    with pytest.raises(NestError, match=r"torchrun started 5 ranks, but .* plans 2 node\(s\) = 2 ranks, 3 node\(s\) = 3 ranks"):
        select(str(tmp_path), {"WORLD_SIZE": "5"})


# --- end to end ----------------------------------------------------------------------------------------------------

ITERATION = re.compile(r"\] iteration +(\d+)/ *\d+ \|.*? lm loss: (\S+) \|")  # Megatron-LM's training_log line
SELECTED = re.compile(r"^nest-megatron elastic: (\d) node\(s\), (\d) ranks, restart (\d+): plan (\w+) .*selected in "
                      r"([\d.]+) ms", re.M)
BUILT = re.compile(r"^pretrain_gpt parallel: world=(\d) tp=(\d) pp=(\d) dp=(\d)", re.M)
SAVED = re.compile(r"^pretrain_gpt saved checkpoint: iteration=(\d+)", re.M)
LOADED = re.compile(r"^pretrain_gpt loaded checkpoint: iteration=(\d+)", re.M)
STOPPED = re.compile(r"Sending process \d+ closing signal SIGTERM")  # torchrun's agent stops its workers to restart


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _runs(path: Path) -> list[list[tuple[int, float]]]:
    """The (iteration, loss) lines of one agent's log, a list for each start of its workers: a new one begins where
    the iteration goes back, or after the agent stopped its workers (a worker paused right after its checkpoint's
    iteration resumes from the next one)."""
    runs: list[list[tuple[int, float]]] = []
    stopped = False
    for line in path.read_text(errors="replace").splitlines():
        iteration = ITERATION.search(line)
        if iteration is None:
            stopped = stopped or STOPPED.search(line) is not None
            continue
        i, loss = int(iteration.group(1)), float(iteration.group(2))
        if not runs or stopped or i <= runs[-1][-1][0]:
            runs.append([])
        runs[-1].append((i, loss))
        stopped = False
    return runs


def _lose_node(agent: subprocess.Popen) -> None:
    """Kill a node: its agent and its workers at once (torchrun starts each worker in a session of its own)."""
    import psutil

    for process in [*psutil.Process(agent.pid).children(recursive=True), psutil.Process(agent.pid)]:
        process.kill()


def _logs(paths: list[Path]) -> str:
    return "\n".join(p.read_text(errors="replace") for p in paths if p.exists())


def _start_agent(i: int, tmp_path: Path, port: int, log: Path, train_iters: int = TRAIN_ITERS) -> subprocess.Popen:
    """Node i's `launch --nnodes 2:3` on loopback; agent 0 hosts the rendezvous store (is_host)."""
    # A lost node is dropped after keep_alive_interval x keep_alive_max_attempt seconds without a heartbeat (5 x 3 by
    # default).
    conf = f"is_host={'true' if i == 0 else 'false'},last_call_timeout=2,keep_alive_interval=1,keep_alive_max_attempt=5"
    cmd = [*LAUNCH, *CLUSTER, "--nnodes", "2:3", "--nproc-per-node", "1", "--rdzv-endpoint", f"127.0.0.1:{port}",
           "--rdzv-conf", conf, "--run-dir", str(tmp_path / f"run{i}"), "--",
           "scripts/pretrain_gpt.py", *megatron_args(tmp_path / "ckpt", train_iters)]
    with open(log, "w") as out:
        return subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)


def _wait_for_save(agents: list[subprocess.Popen], logs: list[Path], iteration: int, after: str = "") -> None:
    """Until a checkpoint at `iteration` or later is logged beyond the text `after` (what was logged before)."""
    deadline = time.monotonic() + 300
    while not any(int(n) >= iteration for n in SAVED.findall(_logs(logs)[len(after):])):
        assert time.monotonic() < deadline and all(a.poll() is None for a in agents), _logs(logs)[-4000:]
        time.sleep(0.05)


def _pause_workers(agents: list[subprocess.Popen]) -> list:
    """Stop (SIGSTOP) the agents' workers (their children, the training script exec'ed by elastic_worker): the
    training waits where it is, the agents (and the rendezvous store agent 0 hosts) run on."""
    import psutil

    workers = [w for agent in agents for w in psutil.Process(agent.pid).children()]
    assert len(workers) == len(agents)  # one rank a node
    for worker in workers:
        worker.suspend()
    return workers


SIGTERM_BIT = 1 << (signal.SIGTERM - 1)  # in the pending-signal masks of /proc/PID/status


def _resume_once_told_to_stop(workers: list, agents: list[subprocess.Popen], logs: list[Path]) -> None:
    """Once the agents, seeing a node wait in the rendezvous, have sent each paused worker its SIGTERM (pending while
    it is stopped), continue them, so that they take it at once and the agents restart under the new plan."""
    deadline = time.monotonic() + 300

    def told(worker) -> bool:
        try:
            status = Path(f"/proc/{worker.pid}/status").read_text()
        except FileNotFoundError:  # gone (SIGKILLed after the agent's wait)
            return True
        pending = int(re.search(r"^ShdPnd:\s*([0-9a-f]+)", status, re.M).group(1), 16)
        return bool(pending & SIGTERM_BIT)

    while not all(told(worker) for worker in workers):
        assert time.monotonic() < deadline and all(a.poll() is None for a in agents), _logs(logs)[-4000:]
        time.sleep(0.05)
    for worker in workers:
        if worker.is_running():
            worker.resume()


def _stop(agents: list[subprocess.Popen]) -> None:
    for agent in agents:
        if agent.poll() is None:
            os.killpg(agent.pid, signal.SIGKILL)
            agent.wait()


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="needs megatron-core")
def test_a_lost_node_replans_to_two_nodes_and_resumes_from_the_checkpoint(tmp_path):
    port, logs = _free_port(), [tmp_path / f"agent{i}.log" for i in range(3)]
    agents = []
    try:
        agents = [_start_agent(i, tmp_path, port, logs[i]) for i in range(3)]  # agent 2 is the node that is lost
        _wait_for_save(agents, logs, 2 * SAVE_INTERVAL)
        _lose_node(agents[2])
        before = _logs(logs)
        for agent in agents[:2]:
            assert agent.wait(timeout=300) == 0, _logs(logs)[-4000:]
    finally:
        _stop(agents)
    log = _logs(logs)

    # Every node computed the same cache; its plans are the ones the workers ran.
    cache = json.loads((tmp_path / "run0" / "elastic.json").read_text())
    assert cache == json.loads((tmp_path / "run1" / "elastic.json").read_text())
    three, two = cache["sizes"]["3"], cache["sizes"]["2"]
    assert three["parallel"]["dp"] == 3 and two["parallel"]["dp"] * two["parallel"]["tp"] * two["parallel"]["pp"] == 2
    assert json.loads((tmp_path / "run0" / two["plan"]).read_text())["parallel"] == two["parallel"]
    # Rank 0 says which plan it picked after each rendezvous (it may sit on any node: all logs). The 3-node plan
    # at the start; the 2-node one after the loss (a failure or a membership change, whichever the agent saw first:
    # its restart count says which).
    selected = [(int(n), int(r), digest, float(ms)) for n, _, r, digest, ms in SELECTED.findall(log)]
    assert [s[:3] for s in selected if s[0] == 3] == [(3, 0, three["digest"])], selected
    assert {s[2] for s in selected if s[0] != 3} == {two["digest"]}, selected
    assert all(ms < 1000 for *_, ms in selected)  # the replan is a file read
    built = {tuple(map(int, b)) for b in BUILT.findall(log)}
    assert built == {(3, 1, 1, 3), (2, two["parallel"]["tp"], two["parallel"]["pp"], two["parallel"]["dp"])}, built

    # The restart loaded the last checkpoint saved before the kill and continued from the next iteration.
    saved_before = [int(n) for n in SAVED.findall(before)]
    resumed = [int(n) for n in LOADED.findall(log)][-1]
    assert resumed >= 2 * SAVE_INTERVAL and resumed % SAVE_INTERVAL == 0 and resumed in saved_before
    runs = [run for path in logs for run in _runs(path)]  # the last rank logs the iterations, on any node
    (first_run,) = [run for run in runs if run[0][0] == 1]
    second_run = [run for run in runs if run[0][0] == resumed + 1][-1]
    assert [i for i, _ in first_run] == list(range(1, len(first_run) + 1)) and len(first_run) >= resumed
    assert [i for i, _ in second_run] == list(range(resumed + 1, TRAIN_ITERS + 1))

    # The loss goes on from where it was, not from the start. At initialisation it is ln(128) = 4.85 (logits ~0
    # over the 128-row vocabulary); by the checkpoint it has fallen by more than 1.5. The first step after the
    # resume starts from the checkpoint's weights, so its loss is within one step's fall (here < 0.25 a step; 0.5
    # allowed, as DP 3 -> 2 feeds other samples) of the loss logged at the checkpoint's iteration before the kill.
    initial, at_checkpoint, after = first_run[0][1], dict(first_run)[resumed], second_run[0][1]
    assert abs(initial - math.log(VOCAB)) < 0.15, initial
    assert at_checkpoint < initial - 1.5, (at_checkpoint, initial)
    assert abs(after - at_checkpoint) < 0.5, (after, at_checkpoint)
    assert second_run[-1][1] < after  # and it keeps falling on 2 nodes


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="needs megatron-core")
def test_a_joining_node_replans_to_three_nodes_and_resumes_from_the_checkpoint(tmp_path):
    port, logs = _free_port(), [tmp_path / f"agent{i}.log" for i in range(3)]
    agents = []
    try:
        # MIN: the run starts on 2 nodes.
        agents = [_start_agent(i, tmp_path, port, logs[i], JOIN_TRAIN_ITERS) for i in range(2)]
        _wait_for_save(agents, logs, 2 * SAVE_INTERVAL)
        paused = _pause_workers(agents)
        before = _logs(logs)
        agents.append(_start_agent(2, tmp_path, port, logs[2], JOIN_TRAIN_ITERS))  # a third node joins the running job
        _resume_once_told_to_stop(paused, agents, logs)
        for agent in agents:
            assert agent.wait(timeout=300) == 0, _logs(logs)[-4000:]
    finally:
        _stop(agents)
    log = _logs(logs)

    cache = json.loads((tmp_path / "run0" / "elastic.json").read_text())
    two, three = cache["sizes"]["2"], cache["sizes"]["3"]
    # The 2-node plan at the start (restart 0); after the join, torchrun's agents restart their workers (a
    # membership change) and every one picks the 3-node plan: DP 3 (only DP divides 3 ranks here).
    selected = [(int(n), int(r), digest) for n, _, r, digest, _ in SELECTED.findall(log)]
    assert selected[0] == (2, 0, two["digest"]) and {s[0] for s in selected} == {2, 3}, selected
    assert {s[2] for s in selected if s[0] == 3} == {three["digest"]} and selected[-1][0] == 3, selected
    assert three["parallel"]["dp"] == 3
    built = {tuple(map(int, b)) for b in BUILT.findall(log)}
    assert (3, 1, 1, 3) in built and (2, two["parallel"]["tp"], two["parallel"]["pp"], two["parallel"]["dp"]) in built

    # The three nodes load the last checkpoint the two saved before they were paused for the join and
    # train to the end from the iteration after it.
    resumed = [int(n) for n in LOADED.findall(log)][-1]
    assert resumed >= 2 * SAVE_INTERVAL and resumed % SAVE_INTERVAL == 0 and resumed in map(int, SAVED.findall(log))
    assert len(LOADED.findall(before)) == 0  # nothing was loaded before the join
    runs = [run for path in logs for run in _runs(path)]
    (first_run,) = [run for run in runs if run[0][0] == 1]
    last_run = [run for run in runs if run[0][0] == resumed + 1][-1]
    assert first_run[-1][0] >= resumed and [i for i, _ in last_run] == list(range(resumed + 1, JOIN_TRAIN_ITERS + 1))
    # As for a lost node: the loss goes on from the checkpoint's (within one step's fall), not from ln(128).
    at_checkpoint, after = dict(first_run)[resumed], last_run[0][1]
    assert at_checkpoint < math.log(VOCAB) - 1.5 and abs(after - at_checkpoint) < 0.5, (after, at_checkpoint)
    assert last_run[-1][1] < after


@pytest.mark.parametrize("extra, message", [
    (["--save", "/tmp/ckpt"], "--save needs --save-interval N"),
    (["--load", "/tmp/ckpt", "--ckpt-format", "torch"], "--save / --load with --ckpt-format torch: this example checkpoints "
                                                         "torch_dist only"),
])
def test_the_script_refuses_checkpoints_it_cannot_write_in_one_line(extra, message):
    base = megatron_args(Path("/tmp/ckpt"))
    base = base[: base.index("--save")]  # without the checkpoint flags
    result = subprocess.run([sys.executable, "scripts/pretrain_gpt.py", *base, *extra], cwd=ROOT, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"pretrain_gpt: error: {message}"), lines
