"""End to end on CPU: `nest-megatron launch` plans, rewrites the argv and runs torchrun's agent, which starts
scripts/pretrain_gpt.py (megatron-core, gloo) in 2 processes; a tiny GPT trains a few iterations
with the plan's TP=2, PP=2 or DP=2, its loss falls, and the log shows the sizes megatron-core built."""

from __future__ import annotations

import importlib.util
import math
import os
import re
import signal
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

# The training runs in subprocesses; this process only needs to know that megatron-core is there.
pytestmark = pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="needs megatron-core")

ROOT = Path(__file__).resolve().parents[1]
LAUNCH = [sys.executable, "-m", "nest_megatron.cli", "launch"]
# A 2-device "cluster" of one node with 2 GPUs: the launch starts --nproc-per-node 2 on this host.
CLUSTER = ["cluster=dgx_h100_superpod", "cluster.levels.0.fan_out=2"]
VOCAB = 128
MEGATRON_ARGS = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
                 "--max-position-embeddings", "32", "--micro-batch-size", "2", "--global-batch-size", "8",
                 "--vocab-size", str(VOCAB), "--bf16", "--train-iters", "6", "--lr", "3e-3", "--hidden-dropout", "0",
                 "--attention-dropout", "0"]
# The launch tees each rank's output (launch/run_dir.py), torchrun prefixing it with the rank: [rank0]:
BUILT = re.compile(r"^(?:\[rank\d+\]:)?pretrain_gpt parallel: (.*) order=(\S+)$", re.M)
PLANNED = re.compile(r"^nest-megatron: tp=(\d+) pp=(\d+) dp=(\d+) cp=(\d+)", re.M)
# Megatron-LM's training_log line (scripts/pretrain_gpt.py prints it: training.py:3567-3641)
ITERATION = re.compile(r"\] iteration +(\d+)/ *(\d+) \|.*? lm loss: (\S+) \|")
FIRST_FAILURE = re.compile(r"^nest-megatron: first failure: rank (\d+) ", re.M)  # launch/torchrun.py
ABORTED = re.compile(r"^nest-megatron: first failure: rank \d+ died of SIGABRT;", re.M)


def launch(overrides: list[str], script_args: list[str], timeout_s: float = 300) -> subprocess.CompletedProcess:
    """`nest-megatron launch` of scripts/pretrain_gpt.py on 2 CPU ranks. A launch whose rank aborts (SIGABRT) runs
    once more, the abort's report a warning in pytest's summary. A rank of the Megatron-FSDP launch aborted once in
    about 50 runs of the suite (CI, 2026-12-07; the report then showed only the other rank's lost connection) and
    in none of about 250 runs of that launch alone here, so the cause is unknown. A second abort fails the test, as
    does any other failure."""
    result = _launch_once(overrides, script_args, timeout_s)
    log = result.stdout + result.stderr
    if result.returncode and ABORTED.search(log):
        warnings.warn(f"launch {' '.join(overrides)}: a rank aborted; run again\n{failure_report(log)}")
        result = _launch_once(overrides, script_args, timeout_s)
    return result


def _launch_once(overrides: list[str], script_args: list[str], timeout_s: float) -> subprocess.CompletedProcess:
    cmd = [*LAUNCH, *CLUSTER, *overrides, "--nproc-per-node", "2", "--", "scripts/pretrain_gpt.py", *script_args]
    # PYTHONFAULTHANDLER: a rank killed by a signal (SIGABRT, SIGSEGV) prints every thread's Python stack first
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1"}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    finally:
        if proc.poll() is None:  # timed out (or the test was interrupted): the whole torchrun tree goes
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def failure_report(log: str) -> str:
    """A failed launch's story: the first failing rank's own last lines (the cause; the other ranks' errors
    follow from it and fill the log's end), then the log's end."""
    first = FIRST_FAILURE.search(log)
    if first is None:
        return log[-4000:]
    own = [line for line in log.splitlines() if line.startswith(f"[rank{first.group(1)}]:")]
    return "\n".join(["first failing rank's last lines:", *own[-60:], "", "the log's end:", log[-2000:]])


def test_a_failure_report_leads_with_the_first_failing_rank():
    # torchrun's tee prefixes each rank's lines; the launch's last line names the rank that failed first.
    log = "\n".join(["[rank0]:terminate called after throwing an instance of 'gloo::EnforceNotMet'",
                     "[rank1]:RuntimeError: Connection closed by peer", "(torchrun's failure table)",
                     "nest-megatron: first failure: rank 0 died of SIGABRT; the launch exits with 134"])
    report = failure_report(log).splitlines()
    assert report[:2] == ["first failing rank's last lines:",
                          "[rank0]:terminate called after throwing an instance of 'gloo::EnforceNotMet'"]
    assert report[2:4] == ["", "the log's end:"] and ABORTED.search(log)
    assert failure_report("no launch summary") == "no launch summary" and not ABORTED.search("rank 0 exited with 1")


@pytest.mark.slow
@pytest.mark.parametrize("pins, sizes", [
    # The pins fix one size at 2; with 2 ranks the others are 1 (tp x pp x dp = 2).
    (["plan.tp=2", "plan.sp=false"], {"tp": 2, "pp": 1, "dp": 1}),
    (["plan.pp=2"], {"tp": 1, "pp": 2, "dp": 1}),
    (["plan.dp=2", "plan.tp=1", "plan.pp=1"], {"tp": 1, "pp": 1, "dp": 2}),
], ids=["tp2", "pp2", "dp2"])
def test_launch_trains_a_tiny_gpt_with_the_planned_sizes(pins, sizes):
    result = launch(pins, MEGATRON_ARGS)
    log = result.stdout + result.stderr
    assert result.returncode == 0, failure_report(log)

    planned = PLANNED.search(log)
    assert planned and dict(zip(("tp", "pp", "dp"), map(int, planned.groups()[:3]))) == sizes, log[-2000:]
    built = BUILT.search(log)
    assert built, log[-2000:]
    built_sizes = dict(item.split("=") for item in built.group(1).split())
    assert {k: int(built_sizes[k]) for k in sizes} == sizes
    assert int(built_sizes["world"]) == 2 and int(built_sizes["cp"]) == 1

    losses = [float(m.group(3)) for m in ITERATION.finditer(log)]
    assert len(losses) == 6, log[-2000:]
    # At initialisation (weights ~ N(0, 0.02)) the logits are ~0: the loss is ln(padded vocab), by hand
    # ln(128) = 4.852 (ln(256) = 5.545 at TP=2, where the vocabulary pads to a multiple of 128 x 2).
    padded = 128 * sizes["tp"]
    assert abs(losses[0] - math.log(padded)) < 0.15, losses
    # Every sequence cycles through 8 of the tokens: the model learns that within a few steps.
    assert losses[-1] < losses[0] - 0.5, losses


@pytest.mark.parametrize("extra, env, message", [
    # One rank (DP = 1): a global batch of 7 does not split into micro-batches of 2.
    (["--global-batch-size", "7"], {}, "--global-batch-size 7 is not a multiple of --micro-batch-size 2 x data parallel 1"),
    (["--tensor-model-parallel-size", "2"], {"WORLD_SIZE": "3"},
     "world size 3 is not a multiple of tensor x pipeline x context parallel = 2"),
    (["--fp16"], {}, "--bf16 and --fp16 are exclusive"),
    (["--pipeline-model-parallel-layout", "Ex*3|t"], {}, "--pipeline-model-parallel-layout 'Ex*3|t' is not a layout"),
    # argparse's own message (its quoting of the choices varies between Python versions).
    (["--recompute-granularity", "some"], {}, "argument --recompute-granularity: invalid choice: 'some'"),
])
def test_bad_script_arguments_are_one_line_and_exit_2(extra, env, message):
    # Checked before any process group or model exists, so nothing starts.
    result = subprocess.run([sys.executable, "scripts/pretrain_gpt.py", *MEGATRON_ARGS, *extra], cwd=ROOT,
                            env={**os.environ, **env}, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"pretrain_gpt: error: {message}"), lines


def test_cpu_runtime_sends_cuda_requests_to_the_cpu():
    # What megatron-core's schedules and optimizers ask of CUDA, answered on the CPU (torch here is
    # the CPU build: each of these would raise "Torch not compiled with CUDA enabled" without it).
    import torch

    from nest_megatron.launch.cpu_runtime import CudaToCpu

    with CudaToCpu():
        counter = torch.zeros([], dtype=torch.int, device="cuda")
        weight = torch.ones(3, device=torch.device("cuda", 0))
        assert counter.device.type == "cpu" and weight.device.type == "cpu"
        assert weight.cuda() is weight
        assert weight.type() == "torch.cuda.FloatTensor" and weight.bfloat16().type() == "torch.cuda.BFloat16Tensor"
        assert weight.type(torch.float64).dtype == torch.float64  # a conversion is not a query: untouched
    assert torch.ones(1).type() == "torch.FloatTensor"  # outside the mode, nothing changed


@pytest.mark.slow
def test_moe_launch_trains_with_expert_parallelism():
    """A MoE model with EP=2: the plan's argv asks for the alltoall dispatcher it prices; megatron-core runs that
    one on GPUs only, so the CPU example trainer says so and uses allgather; the experts train across 2 ranks."""
    result = launch(["plan.ep=2", "plan.tp=1", "plan.pp=1"], [*MEGATRON_ARGS, "--num-experts", "4"])
    log = result.stdout + result.stderr
    assert result.returncode == 0, failure_report(log)
    built = dict(item.split("=") for item in BUILT.search(log).group(1).split())
    assert (built["ep"], built["dp"], built["tp"]) == ("2", "2", "1"), log[-2000:]
    assert "pretrain_gpt: note: --moe-token-dispatcher-type alltoall: runs on GPUs only; allgather on CPU" in log
    losses = [float(m.group(3)) for m in ITERATION.finditer(log)]
    assert len(losses) == 6 and losses[-1] < losses[0] - 0.5, losses
