"""Megatron argv in (config/megatron_argv.py), Megatron argv out (launch/rewrite.py), pins, bad inputs."""

from __future__ import annotations

import dataclasses
import json

import pytest

from nest_megatron import api
from nest_megatron.config.load import load
from nest_megatron.config.megatron_argv import model_values, overrides_from_argv
from nest_megatron.errors import NestError
from nest_megatron.launch.devices import Devices
from nest_megatron.launch.prepare import prepare
from nest_megatron.launch.rewrite import parse_pins, pin_overrides, planner_part, rewrite

# Meta's Llama 3 70B as Megatron-LM's examples launch it (hand-copied from the HF config.json:
# 80 layers, hidden 8192, intermediate 28672, 64 heads, 8 KV heads, vocab 128256, rope, RMSNorm, no biases).
LLAMA3_70B = (
    "--num-layers 80 --hidden-size 8192 --ffn-hidden-size 28672 --num-attention-heads 64 --group-query-attention "
    "--num-query-groups 8 --seq-length 4096 --max-position-embeddings 8192 --vocab-size 128256 --swiglu "
    "--normalization RMSNorm --untie-embeddings-and-output-weights --position-embedding-type rope --disable-bias-linear "
    "--hidden-dropout 0.0 --attention-dropout 0.0 --bf16 --micro-batch-size 1 --global-batch-size 1024"
).split()
# Mixtral 8x7B (HF config.json: 32 layers, hidden 4096, intermediate 14336, 32 heads, 8 KV heads, 8 experts, top-2,
# vocab 32000), written with the `--flag=value` form in places.
MIXTRAL = (
    "--num-layers=32 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32 --group-query-attention "
    "--num-query-groups=8 --seq-length 4096 --max-position-embeddings 32768 --vocab-size 32000 --swiglu "
    "--normalization RMSNorm --untie-embeddings-and-output-weights --use-rotary-position-embeddings --disable-bias-linear "
    "--hidden-dropout 0.0 --attention-dropout 0.0 --bf16 --num-experts 8 --moe-router-topk 2 --micro-batch-size 1 "
    "--global-batch-size 512"
).split()
DGX_64 = Devices(num_nodes=8, per_node=8, node_rank=0, master_addr="n1")
# A narrow search, so that each plan here takes a second or two: what is tested is the argv, not the planner.
NARROW = ("cluster=dgx_h100_superpod", "solver.micro_batch_sizes=[1]", "solver.zero_stages=[1]", "solver.recompute=[full]",
          "solver.rank_orders=[tp-cp-ep-dp-pp]", "solver.max_virtual_stages=1", "solver.max_context_parallel=1")


def shipped(name: str):
    """The model as this repository's YAML describes it (written from the HF configs, not from any argv)."""
    return load([f"model={name}"]).config.model


def test_llama3_70b_argv_builds_the_shipped_model():
    loaded = load(overrides_from_argv(LLAMA3_70B, name="llama3_70b"))
    assert loaded.config.model == shipped("llama3_70b")
    m = loaded.config.model  # and by hand, field by field
    assert (m.num_layers, m.hidden_size, m.ffn_hidden_size, m.num_attention_heads, m.num_query_groups) == (80, 8192, 28672, 64, 8)
    assert (m.seq_length, m.vocab_size, m.swiglu, m.untie_embeddings_and_output_weights) == (4096, 128256, True, True)
    assert (m.position_embedding_type, m.normalization, m.add_bias_linear, m.num_experts) == ("rope", "RMSNorm", False, None)
    assert loaded.config.train.global_batch_size == 1024
    assert (loaded.config.train.overlap_grad_reduce, loaded.config.train.overlap_param_gather) == (False, False)


def test_mixtral_argv_builds_the_shipped_model():
    loaded = load(overrides_from_argv(MIXTRAL, name="mixtral_8x7b"))
    assert loaded.config.model == shipped("mixtral_8x7b")
    m = loaded.config.model
    assert (m.num_experts, m.moe_router_topk, m.moe_layer_freq, m.moe_ffn_hidden_size) == (8, 2, 1, None)
    assert m.position_embedding_type == "rope"  # from --use-rotary-position-embeddings
    assert loaded.config.train.global_batch_size == 512


def test_megatron_defaults_fill_what_the_argv_leaves_out():
    base = "--num-layers 2 --hidden-size 4096 --num-attention-heads 32 --seq-length 128 --vocab-size 1000 --bf16".split()
    plain = model_values(base)
    assert plain["ffn_hidden_size"] == 4 * 4096  # Megatron: 4h
    assert plain["num_query_groups"] is None and plain["add_bias_linear"] is True
    assert (plain["position_embedding_type"], plain["normalization"]) == ("learned_absolute", "LayerNorm")
    assert (plain["hidden_dropout"], plain["attention_dropout"]) == (0.1, 0.1)
    # SwiGLU: int((4 * 4096 * 2 / 3) / 64) * 64 = int(170.67) * 64 = 10880
    assert model_values([*base, "--swiglu"])["ffn_hidden_size"] == 10880
    # --group-query-attention alone: Megatron's --num-query-groups default is 1 (multi-query attention)
    assert model_values([*base, "--group-query-attention"])["num_query_groups"] == 1


def test_the_local_layer_spec_keeps_the_attention_scores():
    base = "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --vocab-size 128 --bf16".split()
    assert model_values(base)["attention_backend"] == "auto"  # Megatron's default: TE picks a fused kernel
    assert model_values([*base, "--attention-backend", "fused"])["attention_backend"] == "fused"  # Megatron's name
    # --transformer-impl local builds megatron-core's DotProductAttention, the unfused one, whatever
    # --attention-backend says: its s^2 scores are kept for backward, so the plan must count them.
    assert model_values([*base, "--transformer-impl", "local"])["attention_backend"] == "unfused"
    assert model_values([*base, "--transformer-impl", "local", "--attention-backend", "flash"])["attention_backend"] == "unfused"
    assert model_values([*base, "--transformer-impl", "transformer_engine"])["attention_backend"] == "auto"


def test_vocabulary_from_the_tokenizer_flags(tmp_path):
    base = "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --bf16".split()
    assert model_values([*base, "--tokenizer-type", "GPT2BPETokenizer"])["vocab_size"] == 50257
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("[PAD]\n[UNK]\nhello\nworld\n")
    assert model_values([*base, "--tokenizer-type", "BertWordPieceLowerCase", "--vocab-file", str(vocab)])["vocab_size"] == 4
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 151936}))
    hf = [*base, "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(tmp_path)]
    assert model_values(hf)["vocab_size"] == 151936
    # --padded-vocab-size fixes the rows; with nothing else telling the tokenizer's size, the rows bound it
    assert [model_values([*base, "--padded-vocab-size", "50304"])[k] for k in ("vocab_size", "padded_vocab_size")] == [50304, 50304]
    # The null tokenizer and TikTokenizer take --vocab-size as their size; TikTokenizer falls back to 2**17 = 131072
    # without it (megatron/core/tokenizers/text/libraries/tiktoken_tokenizer.py:24, 86)
    assert model_values([*base, "--tokenizer-type", "NullTokenizer", "--vocab-size", "128256"])["vocab_size"] == 128256
    assert model_values([*base, "--tokenizer-type", "TikTokenizer", "--vocab-size", "128256"])["vocab_size"] == 128256
    assert model_values([*base, "--tokenizer-type", "TikTokenizer"])["vocab_size"] == 131072
    assert model_values(base, vocab_size=777)["vocab_size"] == 777


def plan_for(argv, *, pins=(), overrides=NARROW, devices=DGX_64):
    return prepare(overrides=list(overrides), script="pretrain_gpt.py", script_args=list(argv), devices=devices, pins=list(pins))


def test_rewrite_keeps_every_other_token_in_order():
    model = LLAMA3_70B[:-4]  # without the batch flags
    unknown = ["--lr", "3e-4", "--data-path", "0.3", "/d/a", "0.7", "/d/b", "--foo=bar", "--split", "99,1,0",
               "--log-interval", "1"]
    planner = ["--tensor-model-parallel-size", "4", "--micro-batch-size=2", "--sequence-parallel", "--use-distributed-optimizer",
               "--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1",
               "--num-layers-per-virtual-pipeline-stage", "2", "--overlap-grad-reduce", "--global-batch-size", "1024"]
    # interleaved: model flags, unknown flags, planner flags, the rest of the model, planner flags, unknown flags
    argv = model[:9] + unknown[:7] + planner[:7] + model[9:] + planner[7:] + unknown[7:]
    prepared = plan_for(argv)
    out = prepared.script_args
    # the user's tokens first, exactly as typed, nothing dropped but the planner's flags ...
    kept = model[:9] + unknown[:7] + model[9:] + unknown[7:]
    assert out[: len(kept)] == kept
    # ... then the plan's own flags, and nothing else
    assert out[len(kept):] == planner_part(prepared.plan.megatron_args)
    assert prepared.loaded.config.train.global_batch_size == 1024


def test_planner_part_is_the_whole_parallel_tail_of_a_plan():
    prepared = plan_for(MIXTRAL)
    args = prepared.plan.megatron_args
    assert planner_part(args) == args[args.index("--tensor-model-parallel-size"):]


def test_a_moe_plan_runs_its_experts_as_one_grouped_gemm():
    """The cost model prices a stage's local experts as one grouped GEMM (model/spec.py mlp_gemms: one Gemm with
    count = the local experts); megatron-core runs that only with --moe-grouped-gemm (TEGroupedMLP), otherwise one
    expert at a time (SequentialMLP). A MoE plan says it, once; a dense plan and the local layer spec do not; a
    launch whose argv lacks it gets it, listed with why; the user's own stands."""
    moe = api.evaluate([*overrides_from_argv(MIXTRAL), "cluster.num_devices=64", "plan.tp=2", "plan.ep=8"])
    assert moe.megatron_args.count("--moe-grouped-gemm") == 1
    dense = api.evaluate([*overrides_from_argv(LLAMA3_70B), "cluster.num_devices=64", "plan.tp=8", "plan.pp=4"])
    assert "--moe-grouped-gemm" not in dense.megatron_args
    local = api.evaluate(["model=tiny_moe", "model.transformer_impl=local", "cluster=dgx_h100_superpod",
                          "cluster.num_devices=8", "train.global_batch_size=64", "plan.ep=4"])
    assert "--moe-grouped-gemm" not in local.megatron_args and "--transformer-impl" in local.megatron_args
    prepared = plan_for(MIXTRAL)
    assert prepared.script_args.count("--moe-grouped-gemm") == 1
    assert ("--moe-grouped-gemm: (unset) -> on (the plan prices each stage's experts as one grouped GEMM (Transformer "
            "Engine's TEGroupedMLP); without it Megatron runs them one expert at a time)") in prepared.changes
    given = plan_for([*MIXTRAL, "--moe-grouped-gemm"])
    assert given.script_args.count("--moe-grouped-gemm") == 1
    assert not any(line.startswith("--moe-grouped-gemm") for line in given.changes)


def test_ckpt_format_is_the_users_unless_fsdp_decides_it():
    plan = api.evaluate([*overrides_from_argv(LLAMA3_70B), "cluster.num_devices=64", "plan.tp=8", "plan.pp=4", "plan.zero=1"])
    kept = rewrite([*LLAMA3_70B, "--ckpt-format", "torch_dist"], plan)
    assert kept[kept.index("--ckpt-format") + 1] == "torch_dist"
    assert "--ckpt-format" not in rewrite([*LLAMA3_70B, "--ckpt-format", "fsdp_dtensor"], plan)
    fsdp = api.evaluate([*overrides_from_argv(LLAMA3_70B), "cluster.num_devices=64", "plan.tp=8", "plan.pp=1", "plan.zero=3"])
    out = rewrite([*LLAMA3_70B, "--ckpt-format", "torch_dist"], fsdp)
    assert out.count("--ckpt-format") == 1 and out[out.index("--ckpt-format") + 1] == "fsdp_dtensor"


def test_pins_become_plan_constraints():
    argv = [*LLAMA3_70B, "--tensor-model-parallel-size", "4", "--pipeline-model-parallel-size", "8"]
    assert pin_overrides(argv, ["tp", "pp", "cp", "sp", "zero", "order"]) == [
        "plan.tp=4", "plan.pp=8", "plan.cp=1", "plan.sp=false", "plan.zero=0", "plan.order=tp-cp-ep-dp-pp"]
    prepared = plan_for(argv, pins=["tp", "pp"])
    assert (prepared.plan.parallel["tp"], prepared.plan.parallel["pp"]) == (4, 8)
    out = prepared.script_args
    assert out[out.index("--tensor-model-parallel-size") + 1] == "4"
    assert out[out.index("--pipeline-model-parallel-size") + 1] == "8"
    # the same through the Hydra option
    kept = plan_for(argv, overrides=(*NARROW, "solver.keep_user_parallelism=[tp,pp]"))
    assert (kept.plan.parallel["tp"], kept.plan.parallel["pp"]) == (4, 8)


def test_pins_read_the_other_flags():
    argv = [*LLAMA3_70B, "--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads", "--recompute-granularity",
            "full", "--recompute-method", "block", "--recompute-num-layers", "3", "--use-tp-pp-dp-mapping",
            "--pipeline-model-parallel-size", "4", "--num-layers-per-virtual-pipeline-stage", "5"]
    assert pin_overrides(argv, ["zero", "recompute", "order", "vpp", "mbs", "etp"]) == [
        "plan.zero=2", "plan.recompute=full", "plan.recompute_num_layers=3", "plan.order=tp-cp-ep-pp-dp",
        "plan.vpp=4",  # 80 layers / (pp 4 x 5 layers per virtual stage)
        "plan.mbs=1", "plan.etp=1"]


@pytest.mark.parametrize("extra, pin, flag", [
    (["--tensor-model-parallel-size", "3"], "tp", "--tensor-model-parallel-size 3"),  # 3 divides no 64 heads
    (["--pipeline-model-parallel-size", "100"], "pp", "--pipeline-model-parallel-size 100"),  # more stages than 80 layers
    (["--context-parallel-size", "3"], "cp", "--context-parallel-size 3"),  # 4096 is no multiple of 2*3
])
def test_a_pinned_value_the_model_cannot_satisfy_names_the_flag(extra, pin, flag):
    with pytest.raises(NestError, match=f"^pinned {flag}: "):
        plan_for([*LLAMA3_70B, *extra], pins=[pin])


def test_pinned_expert_parallel_must_divide_the_experts():
    with pytest.raises(NestError, match="^pinned --expert-model-parallel-size 3: must divide num_experts=8"):
        plan_for([*MIXTRAL, "--expert-model-parallel-size", "3"], pins=["ep"])


BASE = "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --vocab-size 128".split()


@pytest.mark.parametrize("argv, message", [
    ([*BASE, "--bf16", "--fp16"], "--bf16 and --fp16: choose one"),
    (BASE, "no --bf16 or --fp16"),
    ([*BASE, "--bf16", "--num-query-groups", "2"], "--num-query-groups 2 without --group-query-attention"),
    ([*BASE, "--bf16", "--num-layers", "4"], "--num-layers is given twice with different values (2 and 4)"),
    ([*BASE, "--bf16", "--hidden-size"], "--hidden-size: expects a value"),
    ([*BASE, "--bf16", "--micro-batch-size", "two"], "--micro-batch-size two: expected an integer"),
    ([*BASE, "--bf16", "--multi-latent-attention", "--group-query-attention"],
     "--multi-latent-attention and --group-query-attention: MLA has no query groups"),
    ([*BASE, "--bf16", "--num-experts", "4", "--moe-layer-freq", "([1]*3+[0])**2"], "--moe-layer-freq ([1]*3+[0])**2: "),
    ([*BASE, "--bf16", "--moe-router-topk-limited-devices", "2"], "--moe-router-topk-limited-devices: deprecated"),
    ([*BASE, "--bf16", "--position-embedding-type", "relative"], "--position-embedding-type relative: the planner models"),
    ([*BASE, "--bf16", "--max-position-embeddings", "16"], "--max-position-embeddings 16: must be at least --seq-length 32"),
    ([*BASE, "--bf16", "--use-rotary-position-embeddings", "--position-embedding-type", "learned_absolute"],
     "--use-rotary-position-embeddings and --position-embedding-type learned_absolute: choose one"),
    ([*BASE[:-2], "--bf16"], "--vocab-size: the vocabulary size is not known"),
    ([*BASE, "--bf16", "--moe-ffn-hidden-size", "128"], "--moe-ffn-hidden-size without --num-experts"),
    ([*BASE, "--bf16", "--overlap-param-gather"], "--overlap-param-gather without --overlap-grad-reduce"),
    ([*BASE, "--bf16", "--swiglu=yes"], "--swiglu=yes: --swiglu takes no value"),
    ([*BASE, "--bf16", "--attention-backend", "magic"], "--attention-backend magic: allowed are"),
])
def test_bad_argv_is_one_line_naming_the_flag(argv, message):
    with pytest.raises(NestError) as err:
        overrides_from_argv(argv)
    assert str(err.value).startswith(message), str(err.value)
    assert "\n" not in str(err.value)


TINY = [*BASE, "--bf16"]
TWO = Devices(num_nodes=1, per_node=2, node_rank=0)


@pytest.mark.parametrize("overrides, argv, pins, message", [
    (["model=tiny_gpt"], TINY, [], "model=tiny_gpt and a model in the script arguments (--num-layers ...): give one"),
    (["model=tiny_gpt"], ["--seq-length", "64"], [], "--seq-length without --num-layers: give the whole model"),
    ([], TINY, ["dp"], "pin dp: allowed are tp, pp"),
    ([], TINY, ["speed"], "pin speed: allowed are"),
    (["solver.keep_user_parallelism=[tq]"], TINY, [], "pin tq: allowed are"),
    ([], [*TINY, "--num-experts", "2", "--moe-router-topk", "4"], [], "--moe-router-topk (model.moe_router_topk)=4: allowed 1..2"),
    ([], TINY, ["mbs"], "pin mbs: the script arguments have no --micro-batch-size"),
    (["cluster.num_devices=4"], TINY, [], "cluster dgx_h100_superpod has 4 devices, but the launch starts 1 x 2 = 2"),
])
def test_bad_launch_input_is_one_line(overrides, argv, pins, message):
    with pytest.raises(NestError) as err:
        plan_for(argv, overrides=(*NARROW, *overrides), devices=TWO, pins=pins)
    assert str(err.value).startswith(message), str(err.value)
    assert "\n" not in str(err.value)


def test_devices_per_node_must_match_the_cluster():
    # dgx_h100_superpod nodes hold 8 GPUs; two torchrun nodes of 4 processes are not that cluster.
    with pytest.raises(NestError, match="^cluster dgx_h100_superpod has 8 devices per node, but the launch starts 4 per node"):
        plan_for(TINY, devices=dataclasses.replace(TWO, num_nodes=2, per_node=4, master_addr="h"))


def test_parse_pins():
    assert parse_pins("tp, pp,") == ["tp", "pp"]
    assert parse_pins(["zero"]) == ["zero"]
