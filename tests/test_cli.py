"""The real console script, run as a subprocess: exit status, stderr, the Plan JSON it writes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from nest_megatron import api
from nest_megatron.errors import NestError
from nest_megatron.plan import key_overrides

# 16 GPUs of a DGX H100 SuperPOD (two nodes of one scalable unit) and a tiny GPT.
SMALL = ["model=tiny_gpt", "cluster=dgx_h100_superpod", "cluster.num_devices=16", "train.global_batch_size=64"]


def run(*args: str, cwd) -> subprocess.CompletedProcess:
    # Without COLUMNS, piped tables print as wide as they need (report/table.py fits_console); a test worker may
    # have inherited the terminal's COLUMNS.
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    return subprocess.run(
        [sys.executable, "-m", "nest_megatron.cli", *args],
        cwd=cwd, capture_output=True, text=True, timeout=120, env=env,
    )


def assert_one_line_error(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    line = proc.stderr.strip()
    assert line and "\n" not in line, proc.stderr
    return line


@pytest.fixture(scope="module")
def planned(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("plan")
    proc = run("plan", *SMALL, f"out={tmp / 'p.json'}", "--quiet", cwd=tmp)
    return proc, tmp / "p.json"


def test_plan_writes_a_complete_plan(planned):
    proc, path = planned
    assert proc.returncode == 0, proc.stderr
    plan = json.loads(path.read_text())
    assert plan["schema_version"] == 1
    assert set(plan["parallel"]) == {"tp", "pp", "dp", "cp", "ep", "etp", "vpp", "sp", "cp_comm_type",
                                     "moe_a2a_overlap", "distributed_optimizer_instances",
                                     "cpu_offloading_num_layers", "microbatch_group_size_per_vp_stage"}
    for key in ("micro_batch_size", "global_batch_size", "num_microbatches", "zero_stage", "layers_per_stage",
                "rank_order", "rank_to_device", "megatron_args"):
        assert key in plan, key
    assert set(plan["recompute"]) >= {"granularity", "method", "num_layers"}
    assert set(plan["predicted"]) >= {"step_time_s", "tokens_per_s", "tflops_per_gpu", "mfu", "peak_memory_gib",
                                      "memory_per_stage_gib", "breakdown"}
    assert set(plan["search"]) >= {"time_s", "configs_evaluated"}
    assert plan["search"]["configs_evaluated"] >= 1


def test_plan_is_consistent(planned):
    _, path = planned
    plan = json.loads(path.read_text())
    p = plan["parallel"]
    assert p["tp"] * p["cp"] * p["pp"] * p["dp"] == 16
    assert plan["global_batch_size"] == 64
    # 64 sequences = mbs x dp x num_microbatches
    assert plan["micro_batch_size"] * p["dp"] * plan["num_microbatches"] == 64
    # tiny_gpt has 4 layers, split over pp stages
    assert sum(plan["layers_per_stage"]) == 4 and len(plan["layers_per_stage"]) == p["pp"]
    assert sorted(plan["rank_to_device"]) == list(range(16))
    assert len(plan["predicted"]["memory_per_stage_gib"]) == p["pp"]
    pred = plan["predicted"]
    assert sum(pred["breakdown"].values()) == pytest.approx(pred["step_time_s"], rel=1e-9)
    # 64 sequences x 128 tokens per step
    assert pred["tokens_per_s"] == pytest.approx(64 * 128 / pred["step_time_s"], rel=1e-9)
    # H100: 989.4 TFLOP/s peak
    assert pred["mfu"] == pytest.approx(pred["tflops_per_gpu"] / 989.4, rel=1e-9)


def test_plan_argv_matches_the_plan(planned):
    _, path = planned
    plan = json.loads(path.read_text())
    argv, p = plan["megatron_args"], plan["parallel"]

    def flag(name):
        return argv[argv.index(name) + 1]

    assert flag("--tensor-model-parallel-size") == str(p["tp"])
    assert flag("--pipeline-model-parallel-size") == str(p["pp"])
    assert flag("--context-parallel-size") == str(p["cp"])
    assert flag("--micro-batch-size") == str(plan["micro_batch_size"])
    assert flag("--global-batch-size") == "64"
    assert flag("--num-layers") == "4"
    assert ("--sequence-parallel" in argv) == p["sp"]


PINS = ["plan.tp=2", "plan.pp=2", "plan.dp=4", "plan.cp=1", "plan.mbs=2", "plan.vpp=2", "plan.zero=1",
        "plan.recompute=selective"]


def test_evaluate_valid_pins(tmp_path):
    out = tmp_path / "e.json"
    proc = run("evaluate", *SMALL, *PINS, f"out={out}", "--quiet", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    plan = json.loads(out.read_text())
    # sp defaults to on with tp > 1; etp and ep to 1 for a dense model; the CP exchange to Megatron's p2p
    assert plan["parallel"] == {"tp": 2, "pp": 2, "dp": 4, "cp": 1, "ep": 1, "etp": 1, "vpp": 2, "sp": True,
                                "cp_comm_type": "p2p", "moe_a2a_overlap": False,
                                "distributed_optimizer_instances": 1, "cpu_offloading_num_layers": 0,
                                "microbatch_group_size_per_vp_stage": None}
    assert plan["micro_batch_size"] == 2
    # 64 / (2 * 4) = 8 micro-batches; 4 layers over 2 stages
    assert plan["num_microbatches"] == 8
    assert plan["layers_per_stage"] == [2, 2]
    assert plan["zero_stage"] == 1
    assert plan["recompute"]["granularity"] == "selective"
    assert plan["search"]["configs_evaluated"] == 1


def test_evaluate_invalid_configuration(tmp_path):
    out = tmp_path / "e.json"
    proc = run("evaluate", *SMALL, "plan.tp=3", f"out={out}", cwd=tmp_path)
    line = assert_one_line_error(proc)
    assert "plan.tp=3" in line and "num_attention_heads=8" in line
    assert not out.exists()
    assert list(tmp_path.iterdir()) == []


def test_evaluate_does_not_fit(tmp_path):
    # Llama 3 70B on one DGX H100 (8 GPUs, 79.6 GiB each), tp = 8, pp = 1: ~70.6e9 / 8 parameters
    # per GPU at 18 B each (zero 1 over dp = 1: 6 + 12/1) is ~148 GiB > 79.6 GiB.
    out = tmp_path / "e.json"
    proc = run("evaluate", "model=llama3_70b", "cluster=dgx_h100_superpod", "cluster.num_devices=8",
               "train.global_batch_size=8", "plan.tp=8", f"out={out}", cwd=tmp_path)
    line = assert_one_line_error(proc)
    assert "does not fit" in line
    assert not out.exists()


@pytest.mark.parametrize("command", ["plan", "evaluate"])
def test_typo_key_is_one_line(command, tmp_path):
    out = tmp_path / "e.json"
    proc = run(command, *SMALL, "model.num_layer=4", f"out={out}", cwd=tmp_path)
    line = assert_one_line_error(proc)
    assert "did you mean model.num_layers?" in line
    assert not out.exists()


def test_api_plan_and_evaluate_agree():
    plan = api.plan(SMALL)
    p = plan.parallel
    pins = key_overrides(p) + [  # the parallel keys, those at null (Megatron's defaults) left out
        f"plan.mbs={plan.micro_batch_size}", f"plan.zero={plan.zero_stage}", f"plan.order={plan.rank_order}",
        f"plan.recompute={plan.recompute['granularity'] or 'none'}",
    ]
    if plan.recompute["method"] == "block":
        pins.append(f"plan.recompute_num_layers={plan.recompute['num_layers']}")
    evaluated = api.evaluate(SMALL + pins)
    assert evaluated.parallel == p
    assert evaluated.predicted["step_time_s"] == plan.predicted["step_time_s"]
    assert evaluated.predicted["peak_memory_gib"] == plan.predicted["peak_memory_gib"]
    assert evaluated.megatron_args == plan.megatron_args


def test_evaluate_reports_idle_devices():
    # 16 GPUs (two DGX H100 nodes), tp 2 x pp 2 x dp 2 = 8 ranks: the other 8 devices are idle.
    plan = api.evaluate(["model=tiny_gpt", "cluster=dgx_h100_superpod", "cluster.num_devices=16",
                         "train.global_batch_size=64", "plan.tp=2", "plan.pp=2", "plan.dp=2"])
    assert plan.idle_devices == 8
    assert len(plan.rank_to_device) == 8
    assert plan.parallel["dp"] == 2


def test_megatron_fsdp_refuses_the_tp_pp_dp_mapping():
    # Megatron-LM / Megatron-Bridge: "use_tp_pp_dp_mapping is not supported with Megatron FSDP".
    base = ["model=tiny_gpt", "cluster=dgx_h100_superpod", "cluster.num_devices=16", "train.global_batch_size=64",
            "plan.tp=2", "plan.pp=1", "plan.dp=8"]  # pp 1: Megatron-FSDP has no pipeline stages
    with pytest.raises(NestError, match=r"plan.zero=2 \(Megatron-FSDP\) with plan.order=tp-cp-ep-pp-dp"):
        api.evaluate(base + ["plan.zero=2", "plan.order=tp-cp-ep-pp-dp"])
    assert api.evaluate(base + ["plan.zero=2", "plan.order=tp-cp-ep-dp-pp"]).zero_stage == 2
    assert api.evaluate(base + ["plan.zero=1", "plan.order=tp-cp-ep-pp-dp"]).rank_order == "tp-cp-ep-pp-dp"


def test_argv_names_the_kernels_the_memory_model_assumed():
    # The unfused attention keeps its s x s softmax (in fp32 here) and an unfused SwiGLU its
    # activation: the launch line must ask Megatron for exactly those kernels.
    plan = api.evaluate([*SMALL, "model.attention_backend=unfused", "model.attention_softmax_in_fp32=true",
                         "model.swiglu=true", "model.bias_swiglu_fusion=false", "plan.tp=2"])
    argv = plan.megatron_args
    assert argv[argv.index("--attention-backend") + 1] == "unfused"
    assert "--attention-softmax-in-fp32" in argv and "--no-bias-swiglu-fusion" in argv
    assert "--transformer-impl" not in argv  # analytic: whatever implementation has these kernels
    flash = api.evaluate([*SMALL, "plan.tp=2"]).megatron_args
    assert "--attention-backend" not in flash and "--no-bias-swiglu-fusion" not in flash


@pytest.mark.parametrize("argv", [["plan", "--json", *SMALL], ["plan", *SMALL], ["--help"]])
def test_a_reader_that_went_away_is_no_traceback(argv, tmp_path):
    # `nest-megatron plan --json ... | head -1` with head already gone: stdout is a pipe whose read end is
    # closed before the command writes, so its first write fails (EPIPE), whatever the pipe's buffer holds.
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        proc = subprocess.run([sys.executable, "-m", "nest_megatron.cli", *argv], cwd=tmp_path, stdout=write_end,
                              stderr=subprocess.PIPE, text=True, timeout=120)
    finally:
        os.close(write_end)
    assert proc.stderr == ""  # no BrokenPipeError traceback, nor "Exception ignored ... flush" at exit
    assert proc.returncode == 1  # the Python docs' exit status for EPIPE


def test_evaluate_table_piped_is_whole_and_says_evaluate(tmp_path):
    # Piped (not a terminal): the tables print as wide as they need, so no header is cut to "weigh…".
    proc = run("evaluate", *SMALL, "plan.tp=2", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].strip() == "nest-megatron evaluate: tiny_gpt on 16 x h100_sxm (dgx_h100_superpod)"
    assert any("│ evaluate: 1 configuration in " in line for line in lines)  # one, not "1 configurations"
    header = next(line for line in lines if line.startswith("┃ stage"))
    assert [cell.strip() for cell in header.strip("┃").split("┃")] == [
        "stage", "weights", "grads", "optimizer", "activations", "logits", "workspace", "total", "capacity"]
    assert "…" not in proc.stdout


@pytest.mark.parametrize("overrides, message", [
    # Megatron-FSDP's mesh has no pipeline dimension (rule fsdp-pp): the README quick start chose this before.
    (["model=llama3_70b", "cluster=dgx_h100_superpod", "cluster.num_devices=64", "plan.tp=8", "plan.pp=2",
      "plan.zero=3"], "plan.zero=3 (Megatron-FSDP) with plan.pp=2: Megatron-FSDP's device mesh has no pipeline "
                      "dimension; use plan.pp=1 or plan.zero=0|1"),
    # megatron-core's TransformerConfig refuses biased experts split by expert TP (rule moe-bias-etp).
    (["model=mixtral_8x7b", "model.add_bias_linear=true", "cluster=dgx_h100_superpod", "cluster.num_devices=64",
      "plan.tp=2", "plan.etp=2"], "plan.etp=2 with model.add_bias_linear=true: megatron-core supports biases in MoE "
                                  "experts only with expert tensor parallel 1; use plan.etp=1 or model.add_bias_linear=false"),
], ids=["fsdp-pp", "moe-bias-etp"])
def test_evaluate_refuses_what_megatron_does_not_run(tmp_path, overrides, message):
    proc = run("evaluate", *overrides, f"out={tmp_path / 'p.json'}", cwd=tmp_path)
    assert assert_one_line_error(proc) == f"nest-megatron evaluate: error: invalid configuration: {message}"
    assert list(tmp_path.iterdir()) == []
