"""`nest-megatron calibrate`: Megatron-LM and Megatron-Bridge logs read back and their runs rebuilt, the fit recovering
constants a cost model with perturbed constants produced, one line for every bad log, and the error band.

The GPU-format logs are written with the frameworks' own format strings (tests/megatron_logs.py, each cited); with
MEGATRON_LM_ROOT / MEGATRON_BRIDGE_ROOT (checkouts) a test checks every string against the source.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
from pathlib import Path

import pytest
import yaml
from megatron_logs import (
    BRIDGE_STRINGS,
    MEGATRON_LM_STRINGS,
    NEMO_STRINGS,
    arguments_block,
    bridge_grid,
    bridge_iteration_line,
    bridge_summary,
    iteration_line,
    memory_line,
    nemo2_step_line,
    padded_vocab_line,
)

from nest_megatron import api, cli
from nest_megatron.calibration.band import band, overlaps
from nest_megatron.calibration.constants import CONSTANTS
from nest_megatron.calibration.fit import Run, fit, nominal_priors, priors
from nest_megatron.calibration.logs import read
from nest_megatron.calibration.profile import SHIPPED, read_profile
from nest_megatron.calibration.runs import DEST, read_run
from nest_megatron.config.load import load
from nest_megatron.config.megatron_argv import KNOWN_FLAGS
from nest_megatron.cost.evaluate import estimate
from nest_megatron.errors import NestError

CLUSTER = ["cluster=dgx_h100_superpod"]


# --- the frameworks' own format strings ---------------------------------------------------------------------

@pytest.mark.parametrize("env, strings", [("MEGATRON_LM_ROOT", MEGATRON_LM_STRINGS),
                                          ("MEGATRON_BRIDGE_ROOT", BRIDGE_STRINGS), ("NEMO_ROOT", NEMO_STRINGS)])
def test_format_strings_are_the_frameworks(env, strings):
    root = os.environ.get(env)
    if not root:
        pytest.skip(f"{env} is not set (a checkout of the framework; neither is on PyPI)")
    for path, needles in strings.items():
        source = (Path(root) / path).read_text()
        missing = [n for n in needles if n not in source]
        assert not missing, f"{path}: {missing}"


# --- a 1,024-GPU Llama 3 70B run of Megatron-LM -------------------------------------------------------------

# Megatron-LM's validated namespace of a Llama 3 70B pre-training on 128 DGX H100 nodes (the arguments a
# Megatron-LM user passes for Meta's shape; the derived ones as validate_args sets them), and a few of the
# hundreds of others, printed as they print (enums, dtypes, lists, None).
LLAMA3_70B = {
    "num_layers": 80, "hidden_size": 8192, "ffn_hidden_size": 28672, "num_attention_heads": 64,
    "group_query_attention": True, "num_query_groups": 8, "kv_channels": 128, "seq_length": 8192,
    "max_position_embeddings": 8192, "position_embedding_type": "rope", "normalization": "RMSNorm", "swiglu": True,
    "untie_embeddings_and_output_weights": True, "add_bias_linear": False, "hidden_dropout": 0.0,
    "attention_dropout": 0.0, "make_vocab_size_divisible_by": 128, "vocab_size": None, "padded_vocab_size": None,
    "tokenizer_type": "HuggingFaceTokenizer", "tokenizer_model": "meta-llama/Meta-Llama-3-70B",
    "attention_backend": "AttnBackend.auto", "transformer_impl": "transformer_engine", "bf16": True, "fp16": False,
    "params_dtype": "torch.bfloat16", "main_params_dtype": "torch.float32", "exp_avg_dtype": "torch.float32",
    "exp_avg_sq_dtype": "torch.float32", "use_precision_aware_optimizer": False, "fp8": None, "fp8_recipe": "delayed",
    "tensor_model_parallel_size": 8, "pipeline_model_parallel_size": 4, "context_parallel_size": 1,
    "expert_model_parallel_size": 1, "expert_tensor_parallel_size": 8, "sequence_parallel": True,
    "tp_comm_overlap": True, "num_layers_per_virtual_pipeline_stage": 4, "num_virtual_stages_per_pipeline_rank": None,
    "virtual_pipeline_model_parallel_size": 5, "pipeline_model_parallel_layout": None,
    "decoder_first_pipeline_num_layers": None, "decoder_last_pipeline_num_layers": None, "overlap_p2p_comm": True,
    "micro_batch_size": 1, "global_batch_size": 1024, "use_distributed_optimizer": True, "overlap_grad_reduce": True,
    "overlap_param_gather": True, "use_megatron_fsdp": False, "use_torch_fsdp2": False, "use_tp_pp_dp_mapping": False,
    "recompute_granularity": None, "recompute_method": None, "recompute_num_layers": None,
    "cross_entropy_loss_fusion": True, "grad_reduce_in_bf16": False, "bias_swiglu_fusion": True,
    "num_experts": None, "moe_router_topk": 2, "moe_layer_freq": 1, "moe_token_dispatcher_type": "allgather",
    "multi_latent_attention": False, "mtp_num_layers": None, "hybrid_layer_pattern": None, "window_size": None,
    "qk_layernorm": False, "squared_relu": False, "attention_softmax_in_fp32": False, "ckpt_format": "torch_dist",
    "world_size": 1024, "rank": 0, "data_parallel_size": 32, "lr": 0.00015, "min_lr": 1.5e-05, "train_iters": 60,
    "log_interval": 10, "data_path": ["/lustre/data/llama3_text_document"], "save": "/lustre/ckpt/llama3-70b",
    "load": None, "seed": 1234, "eval_iters": 0,
    # a name of 48 or more characters gets no dots: '  {} {} {}' with an empty dots string
    "overlap_param_gather_with_optimizer_step_and_more": False,
}
STEP_MS = (31_870.4, 13_211.2, 13_198.7, 13_204.1, 13_190.5, 13_215.9, 13_207.3)  # iteration 1 shows the start-up


def llama3_70b_log(tmp_path: Path, *, prefix: str = "", last_prefix: str = "", namespace=None, steps=STEP_MS) -> Path:
    """The stdout of the job: rank 0's arguments and vocabulary, then the last rank's iteration lines and memory
    reports of data-parallel rank 0 (ranks 0..31 of the first stage, 992.. of the last), as srun --label or
    torchrun --tee prefix them."""
    lines = [f"{prefix}{line}" for line in arguments_block(namespace or LLAMA3_70B)]
    lines.append(f"{prefix}{padded_vocab_line(128256, 128256)}")
    for i, ms in enumerate(steps):
        iteration = 1 if i == 0 else 10 * i
        lines.append(f"{last_prefix}{iteration_line(iteration=iteration, train_iters=60, consumed=1024 * iteration, elapsed_s=ms / 1e3, batch_size=1024, throughput=400.0)}")
        if i < 2:
            lines.append(f"{prefix}{memory_line(rank=0, iteration=iteration, max_allocated_mb=61_234.56)}")
            lines.append(f"{last_prefix}{memory_line(rank=1016, iteration=iteration, max_allocated_mb=58_002.10)}")
    path = tmp_path / "llama3_70b.log"
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize("prefix, last_prefix", [("", ""), ("0: ", "1023: "), ("[default0]:", "[default7]:"),
                                                 ("[rank0]:", "[rank1023]:")])
def test_a_megatron_lm_log_of_1024_gpus_is_read(tmp_path, prefix, last_prefix):
    log = read(llama3_70b_log(tmp_path, prefix=prefix, last_prefix=last_prefix))
    assert log.format == "megatron"
    assert log.value("num_layers") == 80 and log.value("attention_backend") == "auto"
    assert log.value("overlap_param_gather_with_optimizer_step_and_more") is False
    assert [it.iteration for it in log.iterations] == [1, 10, 20, 30, 40, 50, 60]
    # the median of the lines after the first: 13,211.2 13,198.7 13,204.1 13,190.5 13,215.9 13,207.3 -> 13,205.7 ms
    assert log.measured_step_s == pytest.approx((13_204.1 + 13_207.3) / 2 / 1e3)
    assert log.peak_memory_bytes == pytest.approx(61_234.56 * 2**20)
    assert log.padded_vocab == (128256, 128256)


def test_the_1024_gpu_run_is_rebuilt_exactly(tmp_path):
    rebuilt = read_run(str(llama3_70b_log(tmp_path)), user=CLUSTER, label="llama")
    c = rebuilt.config
    # 1,024 = TP 8 x PP 4 x DP 32; 80 layers / PP 4 = 20 a rank, 4 a virtual stage: 5 virtual stages
    assert (c.world, c.tp, c.pp, c.dp, c.cp, c.ep, c.vpp) == (1024, 8, 4, 32, 1, 1, 5)
    assert (c.mbs, c.zero, c.sp, c.recompute, c.order) == (1, 1, True, "none", "tp-cp-ep-dp-pp")
    assert rebuilt.layers_per_stage is None  # Megatron's even split
    m = rebuilt.loaded.config.model
    assert (m.num_layers, m.hidden_size, m.ffn_hidden_size, m.num_attention_heads, m.num_query_groups,
            m.seq_length, m.vocab_size) == (80, 8192, 28672, 64, 8, 8192, 128256)
    assert (m.swiglu, m.untie_embeddings_and_output_weights, m.position_embedding_type, m.normalization,
            m.add_bias_linear, m.attention_backend) == (True, True, "rope", "RMSNorm", False, "auto")
    t = rebuilt.loaded.config.train
    assert (t.global_batch_size, t.overlap_grad_reduce, t.overlap_param_gather, t.tp_comm_overlap,
            t.cross_entropy_fusion, t.precision) == (1024, True, True, True, True, "bf16")
    assert rebuilt.loaded.problem.num_devices == 1024 and rebuilt.loaded.problem.topology.name == "dgx_h100_superpod"
    # The run is priced as it ran, in torchrun's rank order; `evaluate` of the same overrides places the ranks as
    # the search would (never slower), here within 0.1 %.
    step = estimate(rebuilt.loaded.problem, c).step_time
    assert step * 0.999 <= api.evaluate(rebuilt.overrides).predicted["step_time_s"] <= step


def test_every_flag_the_reader_knows_has_a_megatron_attribute():
    """The flags whose attribute is not their own name are Megatron-LM's exceptions, each cited in runs.DEST."""
    assert set(DEST) <= set(KNOWN_FLAGS)
    assert DEST["--disable-bias-linear"] == "add_bias_linear" and DEST["--fp8-format"] == "fp8"


# --- Megatron-Bridge ------------------------------------------------------------------------------------------

def bridge_log(tmp_path: Path) -> Path:
    """A Llama 3 8B pre-training on 16 H100 with Megatron-Bridge: its configuration summary (the model's fields that
    differ from megatron-core's TransformerConfig defaults, the DDP config's, then the other sections), the grid, the
    vocabulary and the iteration lines."""
    mcore = {
        "model": {"__class__": "TransformerConfig", "num_layers": (32, 0), "hidden_size": (4096, 0),
                  "ffn_hidden_size": (14336, None), "num_attention_heads": (32, 0), "num_query_groups": (8, None),
                  "kv_channels": (128, None), "gated_linear_unit": (True, False), "add_bias_linear": (False, True),
                  "normalization": ("RMSNorm", "LayerNorm"), "hidden_dropout": (0.0, 0.1),
                  "attention_dropout": (0.0, 0.1), "tensor_model_parallel_size": (2, 1),
                  "context_parallel_size": (2, 1), "sequence_parallel": (True, False), "bf16": (True, False),
                  "params_dtype": ("torch.bfloat16", "torch.float32"), "recompute_granularity": ("selective", None)},
        "ddp": {"__class__": "DistributedDataParallelConfig", "use_distributed_optimizer": (True, False),
                "overlap_grad_reduce": (True, False), "overlap_param_gather": (True, False)},
    }
    other = {"train": {"micro_batch_size": 1, "global_batch_size": 128, "train_iters": 50},
             "dataset": {"sequence_length": 8192, "random_seed": 1234},
             "tokenizer": {"tokenizer_type": "HuggingFaceTokenizer", "vocab_size": 128256}}
    lines = bridge_summary(mcore, other)
    lines.append(bridge_grid(tp=2, pp=1, cp=2, dp=4))
    for i, ms in enumerate((9_000.0, 4_101.5, 4_098.2, 4_105.0)):
        iteration = 1 if i == 0 else 10 * i
        lines.append(bridge_iteration_line(iteration=iteration, train_iters=50, consumed=128 * iteration,
                                           elapsed_s=ms / 1e3, batch_size=128, throughput=420.0))
    path = tmp_path / "bridge.log"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_a_megatron_bridge_log_is_rebuilt(tmp_path):
    rebuilt = read_run(str(bridge_log(tmp_path)), user=[*CLUSTER, "model.position_embedding_type=rope",
                                                         "model.untie_embeddings_and_output_weights=true"],
                       label="bridge")
    assert rebuilt.log.format == "bridge"
    c = rebuilt.config
    # 16 = TP 2 x CP 2 x DP 4 (the grid line)
    assert (c.world, c.tp, c.pp, c.cp, c.dp, c.mbs, c.zero, c.sp, c.recompute) == (16, 2, 1, 2, 4, 1, 1, True, "selective")
    m = rebuilt.loaded.config.model
    assert (m.num_layers, m.hidden_size, m.ffn_hidden_size, m.num_query_groups, m.seq_length, m.vocab_size,
            m.swiglu, m.add_bias_linear, m.normalization) == (32, 4096, 14336, 8, 8192, 128256, True, False, "RMSNorm")
    # what Bridge's summary leaves out (GPTModelProvider's own fields) comes from the command line
    assert (m.position_embedding_type, m.untie_embeddings_and_output_weights) == ("rope", True)
    assert rebuilt.log.measured_step_s == pytest.approx(4.1015)  # median of 4101.5, 4098.2, 4105.0 ms


# --- NeMo 2 ----------------------------------------------------------------------------------------------------

def test_a_nemo2_log_gives_the_step_times_and_the_command_line_the_configuration(tmp_path, capsys):
    """NeMo 2 prints no configuration: the overrides give it; its step lines give the times (the mean of each
    logged interval's train_step_timing)."""
    lines = ["[NeMo I 2026-11-30 10:00:00 nemo_logging:393] Experiments will be logged at /results"]
    for n, seconds in ((1, 20.0), (11, 6.124), (21, 6.118), (31, 6.131)):
        lines.append(nemo2_step_line(epoch=0, n=n, total=100, metrics={
            "lr": 1.5e-6, "global_batch_size": 128.0, "global_step": float(n - 1), "reduced_train_loss": 10.93,
            "train_step_timing in s": seconds, "consumed_samples": 128.0 * n}))
    path = tmp_path / "nemo.log"
    path.write_text("\n".join(lines) + "\n")
    given = ["model=llama3_8b", *CLUSTER, "cluster.num_devices=16", "train.global_batch_size=128", "plan.tp=2",
             "plan.mbs=1"]
    rebuilt = read_run(str(path), user=given, label="nemo")
    assert rebuilt.log.format == "nemo2" and rebuilt.log.measured_step_s == pytest.approx(6.124)  # of 6.124 6.118 6.131
    assert (rebuilt.config.tp, rebuilt.config.dp, rebuilt.config.mbs) == (2, 8, 1)
    code, err = _calibrate(capsys, str(path), *CLUSTER)
    assert code == 2 and "a NeMo 2 log prints no configuration" in err and len(err.splitlines()) == 1


# --- bad input: one line naming the file and the line, exit 2, nothing written --------------------------------

def _calibrate(capsys, *items) -> tuple[int, str]:
    code = cli.main(["calibrate", *items])
    return code, capsys.readouterr().err.strip()


def bad_logs(tmp_path: Path) -> dict[str, tuple[Path, str]]:
    """name -> (log, what the one line must say)."""
    good = llama3_70b_log(tmp_path).read_text().splitlines()
    start = good.index("------------------------ arguments ------------------------")
    end = good.index("-------------------- end of arguments ---------------------")
    first_iteration, second = [i for i, line in enumerate(good) if "elapsed time per iteration" in line][:2]
    cases = {
        "empty": ("", "empty"),
        "no arguments block": ("\n".join(good[end + 1:]), "no Megatron-LM arguments block"),
        "no iteration": ("\n".join(good[:first_iteration]), "no iteration finished"),
        "truncated in the arguments": ("\n".join(good[: start + 30]), f":{start + 1}: the arguments block that starts "
                                                                      "here does not end"),
        "truncated in an iteration": ("\n".join(good[: second + 1])[:-90], f":{second + 1}: the last iteration line is cut"),
    }
    encoder = dict(LLAMA3_70B, encoder_num_layers=4)
    encoder_line = line_of(encoder, "encoder_num_layers")
    cases["a model the project cannot express"] = (
        llama3_70b_log(tmp_path, namespace=encoder).read_text(),
        f":{encoder_line}: --encoder-num-layers: encoder-decoder models are not in the cost model")
    # Megatron's MLAConfig has no query groups: transformer_config.py asserts MLA and GQA exclude each other
    mla_gqa = dict(LLAMA3_70B, multi_latent_attention=True)
    mla_line = line_of(mla_gqa, "multi_latent_attention")
    cases["a model Megatron refuses"] = (
        llama3_70b_log(tmp_path, namespace=mla_gqa).read_text(),
        f":{mla_line}: --multi-latent-attention")
    out = {}
    for i, (name, (text, said)) in enumerate(cases.items()):
        path = tmp_path / f"bad{i}.log"
        path.write_text(text)
        out[name] = (path, said)
    return out


def line_of(namespace: dict, key: str) -> int:
    """The 1-based line of `key` in the arguments block a log of `namespace` starts with."""
    block = arguments_block(namespace)
    return block.index(next(line for line in block if line.startswith(f"  {key} "))) + 1


def test_each_bad_log_is_one_line_exit_2_and_nothing_written(tmp_path, capsys):
    for name, (path, said) in bad_logs(tmp_path).items():
        out = tmp_path / f"{path.stem}.yaml"
        code, err = _calibrate(capsys, str(path), *CLUSTER, f"out={out}")
        assert code == 2, name
        assert len(err.splitlines()) == 1, (name, err)
        assert err.startswith(f"nest-megatron calibrate: error: {path}"), (name, err)
        assert said in err, (name, err)
        assert not out.exists(), name


# --- recovery: logs of a cost model with perturbed constants ---------------------------------------------------

# Configurations that determine the perturbed constants between them (dgx_h100_superpod, 8 GPUs a node): compute-bound
# steps (GEMM efficiency), a tiny model whose step is its kernels' fixed time (kernel overhead), steps whose
# data-parallel all-reduce crosses the nodes unhidden (the scalable unit's network efficiency, level 1), and a MoE
# model whose expert-parallel all-to-all spans two nodes (the scalable unit's all-to-all efficiency).
RECOVERY = [
    "model=qwen3_30b_a3b cluster.num_devices=16 train.global_batch_size=64 plan.tp=1 plan.ep=16 plan.mbs=1 "
    "plan.recompute=full",
    "model=llama3_8b cluster.num_devices=16 train.global_batch_size=128 plan.tp=1 plan.mbs=1 plan.recompute=full",
    "model=tiny_gpt cluster.num_devices=16 train.global_batch_size=64 plan.tp=1 plan.mbs=1",
    "model=llama3_8b cluster.num_devices=64 train.global_batch_size=64 plan.tp=1 plan.mbs=1 plan.recompute=full "
    "train.overlap_grad_reduce=false train.overlap_param_gather=false",
    "model=llama3_8b cluster.num_devices=16 train.global_batch_size=128 plan.tp=8 plan.pp=2 plan.mbs=1",
    "model=llama3_8b cluster.num_devices=16 train.global_batch_size=128 plan.tp=2 plan.mbs=2 plan.zero=3",
    "model=llama3_8b model.seq_length=1024 cluster.num_devices=64 train.global_batch_size=64 plan.tp=1 plan.mbs=1 "
    "train.overlap_grad_reduce=false train.overlap_param_gather=false",
]


def namespace_of(argv: list[str], world: int, vpp: int) -> dict:
    """Megatron-LM's namespace of an argv (the flags it holds; attribute names as runs.DEST says), with what
    validate_args derives."""
    names = {flag: DEST.get(flag, flag[2:].replace("-", "_")) for flag in KNOWN_FLAGS}
    out, i = {"world_size": world, "virtual_pipeline_model_parallel_size": vpp if vpp > 1 else None}, 0
    while i < len(argv):
        flag = argv[i]
        if KNOWN_FLAGS.get(flag) in ("true", "false"):
            out[names[flag]] = flag not in DEST  # a store_false flag sets its attribute False
            i += 1
        else:
            out[names[flag]] = argv[i + 1]
            i += 2
    return out


def perturbed_truth() -> dict[str, float]:
    shipped = load(CLUSTER).problem.accelerator
    return {"gemm_efficiency": 0.9 * shipped.gemm_efficiency,
            "kernel_overhead_us": 1.3 * shipped.kernel_overhead_s * 1e6, "network_efficiency.1": 0.8,
            "all_to_all_efficiency.1": 0.7}


def perturbed_log(case: str, truth: dict[str, float]) -> tuple[str, api.Plan]:
    """The Megatron-LM log of `case` run on a cluster whose constants are `truth`, and the plan it runs."""
    plan = api.evaluate([*CLUSTER, *case.split()])
    loaded = load([*CLUSTER, *case.split()])
    problem = loaded.problem
    for name, value in truth.items():
        problem = CONSTANTS[name].write(problem, value)
    cfg = api.evaluate_config(loaded.problem, loaded.config.plan, default_mbs=None)
    measured = estimate(problem, cfg).step_time
    namespace = namespace_of(plan.megatron_args, plan.world_size, plan.parallel["vpp"])
    vocab = loaded.config.model.vocab_size
    lines = arguments_block(namespace) + [padded_vocab_line(vocab, problem.model.padded_vocab(cfg.tp))] + [
        iteration_line(iteration=it, train_iters=3, consumed=it, elapsed_s=measured * (3 if it == 1 else 1),
                       batch_size=plan.global_batch_size) for it in (1, 2, 3)]
    return "\n".join(lines) + "\n", plan


def perturbed_logs(folder: Path, cases: list[str], truth: dict[str, float]) -> list[Path]:
    """One log file in `folder` for each of `cases` (`perturbed_log`)."""
    logs = [folder / f"run{i}.log" for i in range(len(cases))]
    for log, case in zip(logs, cases):
        log.write_text(perturbed_log(case, truth)[0])
    return logs


@pytest.mark.slow
def test_calibrate_recovers_perturbed_constants(tmp_path, capsys):
    truth = perturbed_truth()
    logs = perturbed_logs(tmp_path, RECOVERY, truth)
    out = tmp_path / "cal.yaml"
    code, err = _calibrate(capsys, *map(str, logs), *CLUSTER, f"out={out}")
    assert code == 0, err
    profile = yaml.safe_load(out.read_text())
    constants = profile["constants"]
    for name, value in truth.items():
        assert constants[name]["fitted"], (name, constants[name])
        assert constants[name]["value"] == pytest.approx(value, rel=0.02), name
    for name, entry in constants.items():  # the others: their true value is the prior
        if name not in truth:
            assert entry["value"] == pytest.approx(entry["prior"], rel=0.02), name
            assert entry["fitted"] or "determine" in entry["why"] or "depends" in entry["why"], entry
    for run in profile["runs"]:
        assert abs(run["error_after"]) < 0.01, run["log"]
        assert abs(run["error_before"]) > 0.05, run["log"]  # the shipped constants were 7-22 % off
    calibration = read_profile(str(out))
    assert set(calibration.values) == {n for n, e in constants.items() if e["fitted"]}
    assert len(calibration.errors) == len(RECOVERY)


# tiny_gpt at 8k tokens, micro-batch 4, on 8 GPUs (tests/test_cpu_offloading.py TINY), without and with 3 of its 4
# layers offloaded: at 50 GB/s (h100_sxm's estimate) every copy is exposed, so the step of the second depends on the
# host link and the first pins everything else.
OFFLOADING = ["model=tiny_gpt model.seq_length=8192 cluster.num_devices=8 train.global_batch_size=64 plan.tp=1 plan.pp=1 "
              f"plan.dp=8 plan.mbs=4 plan.recompute=none plan.zero=1{extra}" for extra in ("", " plan.cpu_offloading_num_layers=3")]


def test_calibrate_measures_the_host_link_from_a_run_that_offloads(tmp_path, capsys):
    """The host links shipped are datasheet estimates: runs on a machine whose link moves 30 GB/s, not 50, give it
    back, and leave every other constant at its prior."""
    logs = perturbed_logs(tmp_path, OFFLOADING, {"host_link_gb_per_s": 30.0})
    out = tmp_path / "cal.yaml"
    code, err = _calibrate(capsys, *map(str, logs), *CLUSTER, f"out={out}")
    assert code == 0, err
    constants = yaml.safe_load(out.read_text())["constants"]
    assert constants["host_link_gb_per_s"]["fitted"] and constants["host_link_gb_per_s"]["prior"] == 50.0
    assert constants["host_link_gb_per_s"]["value"] == pytest.approx(30.0, rel=0.02)
    for name, entry in constants.items():
        if name != "host_link_gb_per_s":
            assert entry["value"] == pytest.approx(entry["prior"], rel=0.02), name
    runs = yaml.safe_load(out.read_text())["runs"]
    assert abs(runs[1]["error_before"]) > 0.05 and all(abs(run["error_after"]) < 0.01 for run in runs)


@pytest.mark.parametrize("case, fields", [
    ("model=qwen3_30b_a3b cluster.num_devices=16 train.global_batch_size=64 plan.tp=1 plan.pp=2 plan.vpp=2 plan.ep=8 "
     "plan.mbs=1 plan.recompute=none plan.moe_a2a_overlap=true", {"moe_a2a_overlap": True}),
    ("model=tiny_gpt cluster.num_devices=8 train.global_batch_size=20 plan.tp=1 plan.pp=2 plan.vpp=2 plan.mbs=1 "
     "plan.recompute=none plan.zero=1 plan.microbatch_group_size_per_vp_stage=3 plan.distributed_optimizer_instances=2",
     {"microbatch_group_size_per_vp_stage": 3, "distributed_optimizer_instances": 2}),
    (OFFLOADING[1], {"cpu_offloading_num_layers": 3}),
])
def test_a_run_is_rebuilt_with_what_its_argv_sets_beside_the_sizes(case, fields, tmp_path):
    """The EP all-to-all overlap, the micro-batch group, the optimizer's instances and the offloaded layers of a logged
    run: priced without them, its step would be another's."""
    log = tmp_path / "run.log"
    text, plan = perturbed_log(case, {})
    log.write_text(text)
    rebuilt = read_run(str(log), user=CLUSTER, label="run")
    assert {name: getattr(rebuilt.config, name) for name in fields} == fields
    assert estimate(rebuilt.loaded.problem, rebuilt.config).step_time == pytest.approx(plan.predicted["step_time_s"])


# --- cross-validation by source and release -------------------------------------------------------------------

def run_directory(folder: Path, text: str, plan: api.Plan) -> Path:
    """What `nest-megatron launch` leaves (launch/run_dir.py): the plan, run.json and rank 0's teed log."""
    worker = folder / "logs" / "node0" / "run" / "attempt_0" / "0"
    worker.mkdir(parents=True)
    (worker / "stdout.log").write_text(text)
    (folder / "plan.json").write_text(plan.to_json())
    (folder / "run.json").write_text('{"logs": "logs"}')
    return folder


@pytest.mark.parametrize("logged, planned, wrong", [
    (OFFLOADING[1], OFFLOADING[0], "cpu_offloading_num_layers 3 in the log, 0 in plan.json"),
    (OFFLOADING[0], OFFLOADING[0].replace("plan.mbs=4", "plan.mbs=2"), "mbs 4 in the log, 2 in plan.json"),
])
def test_a_run_directory_whose_log_is_not_its_plan_is_one_line(logged, planned, wrong, tmp_path):
    """The log's arguments against the plan the run directory holds: a size, or a field beside the sizes (an
    offload the plan did not make would be priced as the plan)."""
    text, _ = perturbed_log(logged, {})
    folder = run_directory(tmp_path / "run", text, api.evaluate([*CLUSTER, *planned.split()]))
    with pytest.raises(NestError, match=rf"^.*: the run's arguments are not its plan's \({wrong}\)$"):
        read_run(str(folder), user=[], label="run")


def test_calibrate_holds_out_each_source(tmp_path, capsys):
    """Megatron-LM logs and launch run directories: each source's runs are priced by a fit to the other source's
    alone, its candidates the constants the full fit determined (fit.cross_validate); no log states a release."""
    truth, paths = perturbed_truth(), []
    for i, case in enumerate(RECOVERY):
        text, plan = perturbed_log(case, truth)
        if i < 4:
            paths.append(tmp_path / f"run{i}.log")
            paths[-1].write_text(text)
        else:
            paths.append(run_directory(tmp_path / f"nest-run-{i}", text, plan))
    out = tmp_path / "cal.yaml"
    code = cli.main(["calibrate", *map(str, paths), *CLUSTER, f"out={out}"])
    printed = capsys.readouterr().out
    assert code == 0
    profile = yaml.safe_load(out.read_text())
    assert [r["source"] for r in profile["runs"]] == ["Megatron-LM log"] * 4 + ["launch run directory"] * 3

    runs = [read_run(str(p), user=CLUSTER, label=str(p)).run() for p in paths]
    full = fit(runs)
    expected = []
    for run in runs:
        others = fit([r for r in runs if r.groups["source"] != run.groups["source"]], only=full.fitted)
        expected.append(run.predict(others.values) / run.measured_s - 1)
    held = profile["cross_validation"]["leave-one-source-out"]
    assert held["errors"] == pytest.approx(expected, abs=1e-4)
    assert held["median_abs_error"] == pytest.approx(statistics.median(map(abs, expected)), abs=1e-4)
    assert f"leave-one-source-out: 7 runs: median |error| {held['median_abs_error']:.1%}, bias {held['bias']:+.1%}, " \
           f"worst {held['worst_abs_error']:.1%}" in printed
    why = "the logs state no release (none of the formats calibrate reads prints one)"
    assert profile["cross_validation"]["leave-one-release-out"] == {"not_computed": why}
    assert f"leave-one-release-out: not computed: {why}" in printed


def test_runs_of_one_source_say_why_there_is_no_fold(tmp_path, capsys):
    paths = []
    for i, case in enumerate(RECOVERY[:3]):
        paths.append(tmp_path / f"run{i}.log")
        paths[-1].write_text(perturbed_log(case, perturbed_truth())[0])
    out = tmp_path / "cal.yaml"
    code = cli.main(["calibrate", *map(str, paths), *CLUSTER, f"out={out}"])
    printed = capsys.readouterr().out
    assert code == 0
    assert "leave-one-source-out: not computed: all 3 runs of one source: Megatron-LM log\n" in printed
    held = yaml.safe_load(out.read_text())["cross_validation"]
    assert held["leave-one-source-out"] == {"not_computed": "all 3 runs of one source: Megatron-LM log"}


# --- the shipped calibration and the band ---------------------------------------------------------------------

def test_the_shipped_calibration_is_of_the_shipped_constants():
    """calibration/shipped/h100_sxm.yaml holds the cross-validated errors of the constants in the accelerator
    config: after a refit, `python scripts/fit_calibration.py --write-shipped` regenerates it."""
    data = yaml.safe_load((SHIPPED / "h100_sxm.yaml").read_text())
    accelerator = load(CLUSTER).problem.accelerator
    for name, value in data["constants"].items():
        assert CONSTANTS[name].read(load(CLUSTER).problem) == pytest.approx(value), name
    assert accelerator.name == data["accelerator"]
    assert len(data["cross_validation"][data["band_from"]]["errors"]) == data["cross_validation"][data["band_from"]]["runs"]



def test_the_shipped_fit_is_cross_validated_from_priors_no_row_informed():
    """The shipped values were fitted to the calibration rows: a fold centred on them would lean on the rows it
    holds out. scripts/fit_calibration.py centres each candidate on its nominal size instead (gemm 0.6, the
    all-to-all 1.0 of the NIC: calibration/constants.py) and keeps every other constant at its shipped value."""
    runs = [Run(label="r", problem=load(CLUSTER).problem, config=None, measured_s=1.0)]
    shipped = priors(runs)
    nominal = nominal_priors(runs, ["gemm_efficiency", "all_to_all_efficiency.1"])
    assert nominal["gemm_efficiency"] == 0.6 and nominal["all_to_all_efficiency.1"] == 1.0
    assert shipped["gemm_efficiency"] == pytest.approx(0.65) and shipped["all_to_all_efficiency.1"] == pytest.approx(0.74)
    assert {k: v for k, v in nominal.items() if k not in ("gemm_efficiency", "all_to_all_efficiency.1")} == \
        {k: v for k, v in shipped.items() if k not in ("gemm_efficiency", "all_to_all_efficiency.1")}


def test_the_band_is_the_cross_validated_errors_percentiles():
    # errors -10 %, 0, +10 %, +20 %: 5th percentile -8.5 %, 95th +18.5 % (numpy's linear interpolation)
    low, high = band(10.0, [-0.10, 0.0, 0.10, 0.20])
    assert low == pytest.approx(10.0 / 1.185) and high == pytest.approx(10.0 / 0.915)
    # one run, predicted 50 % too slow: it measured 10 / 1.5; the band reaches the prediction itself
    assert band(10.0, [0.5]) == pytest.approx((10.0 / 1.5, 10.0))
    assert band(10.0, [-0.2, -0.1]) == pytest.approx((10.0, 10.0 / (1 - 0.195)))  # 5th percentile -19.5 %
    # tied: the two bands meet, whichever is the faster (10 s: 9.8-10.2 s; 100 s: 98-102 s)
    assert overlaps(10.0, 10.1, [0.02, -0.02]) and overlaps(10.1, 10.0, [0.02, -0.02])
    assert not overlaps(10.0, 100.0, [0.02, -0.02]) and not overlaps(100.0, 10.0, [0.02, -0.02])


@pytest.mark.parametrize("command", ["plan", "evaluate"])
def test_every_plan_prints_its_band_and_calibration(command, capsys, tmp_path):
    overrides = ["model=tiny_gpt", "cluster.num_devices=8", "train.global_batch_size=64", "solver.jobs=1"]
    if command == "evaluate":
        overrides += ["plan.tp=1", "plan.mbs=1"]
    out = tmp_path / "plan.json"
    assert cli.main([command, *overrides, f"out={out}"]) == 0
    text = capsys.readouterr().out
    plan = api.Plan.from_dict(yaml.safe_load(out.read_text()))
    step, (low, high) = plan.predicted["step_time_s"], plan.calibration["step_time_band_s"]
    errors = yaml.safe_load((SHIPPED / "h100_sxm.yaml").read_text())
    shipped = errors["cross_validation"][errors["band_from"]]["errors"]
    assert (low, high) == pytest.approx(band(step, shipped))
    assert f"{step:.3f} s ({low:.3g}-{high:.3g} s)" in text
    assert "shipped H100 calibration: cross-validated median" in text
    assert plan.calibration["label"] == "shipped H100 calibration" and plan.calibration["path"] is None


def test_a_profile_of_another_accelerator_is_one_line(tmp_path, capsys):
    profile = tmp_path / "cal.yaml"
    profile.write_text("format: nest-megatron calibration\nversion: 1\naccelerator: a100_80gb\nconstants: {}\n")
    code = cli.main(["evaluate", "model=tiny_gpt", "cluster.num_devices=8", f"calibration={profile}"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1
    assert "a calibration of a100_80gb, but the plan is for h100_sxm" in err


def test_plans_with_a_calibration_use_its_constants(tmp_path):
    profile = tmp_path / "cal.yaml"
    profile.write_text(yaml.safe_dump({
        "format": "nest-megatron calibration", "version": 1, "accelerator": "h100_sxm",
        "constants": {"gemm_efficiency": {"value": 0.5, "fitted": True},
                      "kernel_overhead_us": {"value": 54.4, "fitted": False}},
        "leave_one_out": {"errors": [0.01, -0.02]}}))
    overrides = ["model=llama3_8b", "cluster.num_devices=8", "plan.tp=2", "plan.mbs=1"]
    calibrated = api.evaluate([*overrides, f"calibration={profile}"])
    plain = load(overrides).problem
    expected = estimate(dataclasses.replace(plain, accelerator=dataclasses.replace(plain.accelerator, gemm_efficiency=0.5)),
                        api.evaluate_config(plain, load(overrides).config.plan, default_mbs=None)).step_time
    assert calibrated.predicted["step_time_s"] == pytest.approx(expected)
    assert calibrated.calibration["values"] == {"gemm_efficiency": 0.5}  # a kept prior does not price plans
    assert f"calibration={profile.resolve()}" in calibrated.overrides  # explain re-prices with it
    os.environ["NEST_MEGATRON_CALIBRATION"] = str(profile)
    try:
        assert api.evaluate(overrides).predicted["step_time_s"] == pytest.approx(expected)
    finally:
        del os.environ["NEST_MEGATRON_CALIBRATION"]
