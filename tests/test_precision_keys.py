"""FP8, --tp-comm-overlap and the squared-ReLU / QK-norm / sliding-window model keys: read from a Megatron argv,
checked at load (one line, exit 2), emitted on the plan's argv, and kept by the search.

Flag names, choices and defaults are Megatron-LM's at d98e8a6 (parallel/rules.MEGATRON_LM_COMMIT):
TransformerConfig.fp8 is --fp8-format {e4m3, hybrid}, fp8_recipe --fp8-recipe (default delayed;
core/transformer/transformer_config.py:587-599); --window-size is "left,right" (arguments.py:2384, tuple_type);
--tp-comm-overlap needs sequence parallel (arguments.py:1441-1442).
"""

from __future__ import annotations

import pytest

from nest_megatron import api
from nest_megatron.cli import main
from nest_megatron.config.load import load
from nest_megatron.config.megatron_argv import model_values, overrides_from_argv, train_overrides
from nest_megatron.config.schema import PlanChoice, SolverConfig
from nest_megatron.errors import NestError
from nest_megatron.launch.megatron_rules import violations
from nest_megatron.solver.space import candidates, empty_space_reason

# tiny_gpt: 4 layers, 8 heads, hidden 256, sequence 128; dgx_h100_superpod: H100 SXM, 8 a node.
BASE = ["model=tiny_gpt", "cluster=dgx_h100_superpod", "cluster.num_devices=16", "train.global_batch_size=64"]
MODEL = ("--num-layers 4 --hidden-size 256 --num-attention-heads 8 --seq-length 128 --max-position-embeddings 128 "
         "--vocab-size 1024 --bf16 --micro-batch-size 1 --global-batch-size 64").split()


def train_keys(argv: list[str]) -> dict[str, str]:
    return dict(item.split("=", 1) for item in train_overrides(argv))


# -- the argv's flags become overrides ------------------------------------------------------------------------

@pytest.mark.parametrize("argv, precision, recipe, overlap", [
    ([], "bf16", "delayed", "false"),  # no --fp8-format: Megatron's fp8=None
    (["--fp8-format", "hybrid"], "fp8", "delayed", "false"),  # Megatron's default recipe
    (["--fp8-format=e4m3", "--fp8-recipe", "mxfp8"], "fp8", "mxfp8", "false"),
    (["--fp8-format", "hybrid", "--fp8-recipe", "blockwise", "--tp-comm-overlap"], "fp8", "blockwise", "true"),
    (["--tp-comm-overlap"], "bf16", "delayed", "true"),
])
def test_argv_precision_and_overlap_become_train_overrides(argv, precision, recipe, overlap):
    keys = train_keys(argv)
    assert (keys["train.precision"], keys["train.fp8_recipe"], keys["train.tp_comm_overlap"]) == (
        precision, recipe, overlap)


@pytest.mark.parametrize("argv, graphs", [
    ([], "false"),  # Megatron's cuda_graph_impl "none" (transformer_config.py:1075)
    (["--cuda-graph-impl", "none"], "false"),
    (["--cuda-graph-impl", "transformer_engine"], "true"),
    (["--cuda-graph-impl=local"], "true"),
    (["--enable-cuda-graph"], "true"),  # deprecated: read as local (arguments.py:619-623)
    (["--external-cuda-graph"], "true"),  # deprecated: read as transformer_engine (:625-630)
])
def test_argv_cuda_graphs_become_a_train_key(argv, graphs):
    assert train_keys(argv)["train.cuda_graphs"] == graphs


@pytest.mark.parametrize("argv, message", [
    (["--cuda-graph-impl", "cudnn"], "--cuda-graph-impl cudnn: allowed are none, local, transformer_engine, full_iteration"),
    (["--fp8-format", "e5m2"], "--fp8-format e5m2: allowed are e4m3, hybrid"),
    (["--fp8-format", "hybrid", "--fp8-recipe", "custom"], "--fp8-recipe custom: the planner prices delayed, "
                                                          "tensorwise, blockwise, mxfp8"),
])
def test_bad_fp8_flags_are_one_line(argv, message):
    with pytest.raises(NestError) as err:
        train_overrides(argv)
    assert str(err.value) == message


def test_fp8_still_needs_bf16_or_fp16():
    """--fp8-format is on top of the 2-byte dtype, as in Megatron (FP8 GEMMs, bf16 elsewhere)."""
    with pytest.raises(NestError, match=r"^no --bf16 or --fp16"):
        overrides_from_argv([a for a in MODEL if a != "--bf16"] + ["--fp8-format", "hybrid"])
    fp16 = overrides_from_argv([a if a != "--bf16" else "--fp16" for a in MODEL] + ["--fp8-format", "hybrid"])
    assert "train.precision=fp8" in fp16  # Megatron has no check against --fp16 with --fp8-format


def test_model_flags_become_model_keys():
    values = model_values([*MODEL, "--squared-relu", "--qk-layernorm", "--window-size", "64,0",
                           "--window-attn-skip-freq", "4"])
    assert (values["squared_relu"], values["qk_layernorm"], values["window_size"], values["window_attn_skip_freq"]) == (
        True, True, 64, 4)
    plain = model_values(MODEL)
    assert (plain["squared_relu"], plain["qk_layernorm"], plain["window_size"], plain["window_attn_skip_freq"]) == (
        False, False, None, None)
    # tuple_type strips the parentheses; -1 on the left is the infinite window, i.e. full attention
    assert model_values([*MODEL, "--window-size", "(32,0)"])["window_size"] == 32
    assert model_values([*MODEL, "--window-size", "-1,0"])["window_size"] is None


@pytest.mark.parametrize("extra, message", [
    (["--squared-relu", "--swiglu"], "--squared-relu and --swiglu: one MLP activation; Megatron asserts it, choose one"),
    (["--window-size", "64"], "--window-size 64: the planner models a causal sliding window, 'N,0' (N past tokens)"),
    (["--window-size", "64,64"], "--window-size 64,64: the planner models a causal sliding window"),
    (["--window-size", "64,0", "--window-attn-skip-freq", "[1,1,1,0]"],
     "--window-attn-skip-freq [1,1,1,0]: the planner models full attention every N-th layer; give an integer N"),
])
def test_model_flags_the_planner_cannot_take_are_one_line(extra, message):
    with pytest.raises(NestError) as err:
        model_values([*MODEL, *extra])
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


# -- load: one line, exit 2 -----------------------------------------------------------------------------------

@pytest.mark.parametrize("overrides, message", [
    (["accelerator=a100_80gb", "train.precision=fp8"],
     "train.precision=fp8: accelerator a100_80gb has no FP8 tensor cores (no peak_fp8_tflops); "
     "FP8 accelerators: b200, gb200, gb300, h100_sxm, h200"),
    (["accelerator=tpuv4", "train.precision=fp8"], "train.precision=fp8: accelerator tpuv4 has no FP8 tensor cores"),
    (["train.precision=fp8", "train.fp8_recipe=mxfp8"],
     "train.fp8_recipe=mxfp8: accelerator h100_sxm has no MXFP8 (block-scaled FP8) in hardware; MXFP8 accelerators: "
     "b200, gb200, gb300; use delayed, tensorwise or blockwise"),
    (["train.precision=fp16"], "train.precision=fp16: allowed are bf16, fp8"),
    (["train.fp8_recipe=custom"], "train.fp8_recipe=custom: allowed are delayed, tensorwise, blockwise, mxfp8"),
    (["model.swiglu=true", "model.squared_relu=true"],
     "model.squared_relu=true and model.swiglu=true: one MLP activation; choose one"),
    (["model.window_size=128"], "model.window_size=128: allowed 1..127 (model.seq_length - 1: "),
    (["model.window_size=0"], "model.window_size=0: allowed 1..127"),
    (["model.window_size=64", "model.window_attn_skip_freq=5"], "model.window_attn_skip_freq=5: allowed 1..4 "
                                                                "(model.num_layers)"),
    (["model.window_attn_skip_freq=2"], "model.window_attn_skip_freq=2 without model.window_size: "),
    (["train.tp_comm_overlap=true", "plan.tp=2", "plan.sp=false"],
     "invalid configuration: plan.sp=false with plan.tp=2 and train.tp_comm_overlap=true: "),
])
def test_load_errors_are_one_line_and_exit_2(overrides, message, tmp_path, capsys):
    out = tmp_path / "p.json"
    code = main(["evaluate", *BASE, *overrides, f"out={out}", "--quiet"])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert "\n" not in err and err.startswith(f"nest-megatron evaluate: error: {message}"), err
    assert list(tmp_path.iterdir()) == []


def test_a_plan_in_fp8_on_a100_is_refused(capsys):
    assert main(["plan", *BASE, "accelerator=a100_80gb", "train.precision=fp8", "--quiet"]) == 2
    assert "accelerator a100_80gb has no FP8 tensor cores" in capsys.readouterr().err


def test_accelerator_fp8_numbers_reach_the_problem():
    """Dense FP8 = half the datasheet's sparse figure: H100 / H200 3,958 -> 1,978.9 TFLOP/s; HGX B200 72 PFLOPS for
    8 GPUs with sparsity -> 9 per GPU sparse, 4.5 dense (2x its 2,250 bf16)."""
    expected = {"h100_sxm": (1978.9e12, False), "h200": (1978.9e12, False), "b200": (4.5e15, True),
                # GB200 / GB300 NVL72: 720 PFLOPS FP8 with sparsity for 72 GPUs -> 10 sparse, 5 dense per GPU
                "gb200": (5.0e15, True), "gb300": (5.0e15, True),
                "a100_80gb": (None, False), "tpuv4": (None, False)}
    for name, (peak, mx) in expected.items():
        a = load([*BASE, f"accelerator={name}"]).problem.accelerator
        assert (a.peak_fp8_flops, a.mxfp8) == (pytest.approx(peak) if peak else None, mx), name


def test_mxfp8_is_taken_on_b200():
    p = load([*BASE, "accelerator=b200", "train.precision=fp8", "train.fp8_recipe=mxfp8",
              "train.tp_comm_overlap=true"]).problem
    assert (p.model.numerics.fp8_recipe, p.tp_comm_overlap) == ("mxfp8", True)


# -- the plan's argv ------------------------------------------------------------------------------------------

def flags_after(args: list[str], flag: str, n: int) -> list[str]:
    i = args.index(flag)
    return args[i:i + n]


def test_fp8_and_tp_comm_overlap_are_emitted_exactly():
    plan = api.evaluate([*BASE, "plan.tp=2", "train.precision=fp8", "train.fp8_recipe=tensorwise",
                         "train.tp_comm_overlap=true"])
    args = plan.megatron_args
    assert flags_after(args, "--bf16", 5) == ["--bf16", "--fp8-format", "hybrid", "--fp8-recipe", "tensorwise"]
    assert args.count("--fp8-format") == args.count("--fp8-recipe") == args.count("--tp-comm-overlap") == 1
    assert "--sequence-parallel" in args  # TP 2: sequence parallel, Megatron's default with TP (and the flag's need)
    assert violations(args, world_size=16) == []
    plain = api.evaluate([*BASE, "plan.tp=2"]).megatron_args
    assert not {"--fp8-format", "--fp8-recipe", "--tp-comm-overlap"} & set(plain)


def test_tp_comm_overlap_at_tp_1_emits_nothing():
    args = api.evaluate([*BASE, "plan.tp=1", "train.tp_comm_overlap=true"]).megatron_args
    assert "--tp-comm-overlap" not in args and "--sequence-parallel" not in args


def test_model_keys_are_emitted_and_read_back():
    overrides = [*BASE, "model.squared_relu=true", "model.qk_layernorm=true", "model.window_size=64",
                 "model.window_attn_skip_freq=4", "plan.tp=1"]
    args = api.evaluate(overrides).megatron_args
    assert "--squared-relu" in args and "--qk-layernorm" in args
    assert flags_after(args, "--window-size", 4) == ["--window-size", "64,0", "--window-attn-skip-freq", "4"]
    back = model_values(args, vocab_size=1024)  # the emitted argv leaves the vocabulary to the tokenizer flags
    assert (back["squared_relu"], back["qk_layernorm"], back["window_size"], back["window_attn_skip_freq"]) == (
        True, True, 64, 4)


def test_the_argv_round_trip_keeps_fp8():
    """A plan's own argv, read back, asks for the same precision and recipe. (Not blockwise with the overlap:
    Transformer Engine's userbuffers refuse it, parallel/rules.py tp-overlap-recipe.)"""
    args = api.evaluate([*BASE, "plan.tp=2", "train.precision=fp8", "train.fp8_recipe=tensorwise",
                         "train.tp_comm_overlap=true"]).megatron_args
    keys = train_keys(args)
    assert (keys["train.precision"], keys["train.fp8_recipe"], keys["train.tp_comm_overlap"]) == (
        "fp8", "tensorwise", "true")


# -- the search --------------------------------------------------------------------------------------------

def test_the_search_never_offers_tp_without_sp_under_tp_comm_overlap():
    problem = load([*BASE, "train.tp_comm_overlap=true"]).problem
    solver = SolverConfig(micro_batch_sizes=[1], zero_stages=[1], recompute=["none"])
    space = list(candidates(problem, solver, PlanChoice(), micro_batch_size=None))
    assert {c.tp for c in space} > {1}  # TP 2, 4, 8 are searched (8 heads, 8 a node) ...
    assert all(c.sp for c in space if c.tp > 1)  # ... always with sequence parallel
    # sequence parallel pinned off: only TP 1 is left, and a pinned TP 2 says why it is empty
    off = list(candidates(problem, solver, PlanChoice(sp=False), micro_batch_size=None))
    assert off and {c.tp for c in off} == {1}
    reason = empty_space_reason(problem, solver, PlanChoice(tp=2, sp=False), micro_batch_size=None)
    assert reason.startswith("plan.sp=false with plan.tp=2 and train.tp_comm_overlap=true: ") and reason.endswith(
        "(plan.tp=2, plan.sp=False pinned)")
    # without the overlap the same pins are a plan
    free = load(BASE).problem
    assert list(candidates(free, solver, PlanChoice(tp=2, sp=False), micro_batch_size=None))


def test_a_plan_with_tp_comm_overlap_and_sp_off_picks_tp_1():
    plan = api.plan([*BASE, "train.tp_comm_overlap=true", "plan.sp=false"])
    assert plan.parallel["tp"] == 1 and "--tp-comm-overlap" not in plan.megatron_args


# -- the argv rules ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("extra, line", [
    (["--fp8-format", "hybrid", "--fp4-format", "nvfp4"], "--fp8-format and --fp4-format: "),
    (["--fp8-param-gather", "--use-distributed-optimizer"], "--fp8-param-gather needs --fp8-format"),
    (["--fp8-format", "hybrid", "--fp8-param-gather"], "--fp8-param-gather needs --use-distributed-optimizer"),
    (["--fp8-format", "hybrid", "--first-last-layers-bf16"], "--first-last-layers-bf16 with --fp8-recipe delayed"),
])
def test_fp8_flag_rules(extra, line):
    found = violations([*MODEL, *extra], world_size=1)
    assert any(v.startswith(line) for v in found), found


@pytest.mark.parametrize("extra", [
    ["--fp8-format", "hybrid", "--fp8-param-gather", "--use-distributed-optimizer"],
    ["--fp8-format", "hybrid", "--fp8-recipe", "tensorwise", "--first-last-layers-bf16"],
])
def test_fp8_flags_megatron_takes(extra):
    assert violations([*MODEL, *extra], world_size=1) == []
