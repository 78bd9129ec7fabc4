"""Tracing real models on the meta device (nest_megatron/trace/) against the analytic cost model,
hand-worked numbers, and the plan hook (model.source=megatron|hf|module).

Agreement, per layer of every shipped model (one sequence, TP 1; tiny models also under TP / EP):
  parameters, GEMM FLOPs, boundary bytes, TP communication   exactly equal
  attention FLOPs                                            2 x analytic: megatron-core's local
      DotProductAttention computes the full s x s square and masks it; the analytic model charges
      a causal kernel's half (cost/flops.py counts the same half, as Megatron's MFU does)
  saved-activation bytes                                     within 0.1 % of the analytic terms for
      the local spec's kernels (unfused softmax and SwiGLU) plus the terms `cpu_and_small_terms`
      lists, each explained there.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

pytest.importorskip("megatron.core")

pytestmark = [pytest.mark.filterwarnings("ignore::DeprecationWarning"), pytest.mark.filterwarnings("ignore::UserWarning")]

from megatron_helpers import load_model_config  # noqa: E402

from nest_megatron.config.load import load  # noqa: E402
from nest_megatron.cost.activations import layer_activation_bytes, layer_activation_terms  # noqa: E402
from nest_megatron.errors import NestError  # noqa: E402
from nest_megatron.model.kinds import LayerKind  # noqa: E402
from nest_megatron.model.layer_graph import LayerGraph  # noqa: E402
from nest_megatron.model.spec import ModelSpec  # noqa: E402
from nest_megatron.trace.hf_config import model_config_from_hf  # noqa: E402
from nest_megatron.trace.meta import (  # noqa: E402
    representative_layers,
    teardown_distributed,
    trace_for_cost,
    trace_megatron,
)
from nest_megatron.trace.module import trace_module  # noqa: E402
from nest_megatron.trace.source import local_spec_kernels  # noqa: E402

DENSE, MOE = LayerKind(mlp="dense"), LayerKind(mlp="moe")
SHIPPED = ["tiny_gpt", "tiny_moe", "llama3_8b", "llama3_70b", "mixtral_8x7b", "gpt3_175b"]
BF16 = 2


@pytest.fixture(scope="module", autouse=True)
def _leave_no_process_group():
    yield
    teardown_distributed()


def cpu_and_small_terms(cfg, *, tp: int, etp: int, sp: bool, moe: bool, mtp: bool = False) -> dict[str, float]:
    """Bytes one traced layer saves (one sequence, T = s tokens, T_sp = T / tp with sequence
    parallel) that the analytic model does not count, each worked out by hand from what the op saves:

    - norms: on CPU and meta, torch's RMSNorm is the composite path that upcasts: it keeps the fp32
      input and the fp32 normalised tensor (8 B per element) and the fp32 1/rms (4 B per token),
      where a fused GPU norm keeps the bf16 input (2 B, the analytic term). LayerNorm
      (native_layer_norm) keeps the bf16 input, as counted, plus fp32 mean and 1/std (8 B per
      token). Two norms per layer, over T_sp tokens.
    - dropout: on CPU and meta, dropout keeps the scaled noise in bf16 (2 B per element) instead
      of CUDA's 1-byte mask: +1 B per element of each mask (two hidden dropouts over h x T_sp, the
      attention dropout over heads/t x T x s).
    - causal mask: megatron-core's unfused softmax builds a fresh [s, s] bool mask per layer,
      which masked_fill keeps (1 B per element) -- small, not in the analytic model.
    - RoPE: q and k each keep cos and sin, [s, 1, 1, d] bf16 -- small, not in the analytic model.
    - MoE routing: the router keeps top-k indices (int64) and scores (fp32) of its T_sp tokens,
      12 B x T_sp x topk; the permutation keeps two int64 index vectors, 16 B per row the experts
      compute (ModelSpec.routed_rows); each expert keeps the bf16 routing weight of its rows, 2 B
      per row.
    - MLA (model.multi_latent_attention): RoPE runs on the qk_pos_emb_head_dim dims only (the cos/sin
      above at that width); with --qk-layernorm the latent norms are RMSNorms too, upcast the same
      way: the query latent's (q_lora wide) 8 B per element instead of its bf16 input, the KV
      latent's fp32 copy of its kv_lora-wide view (8 B per element) instead of the bf16 storage of
      the whole down projection output (kv_lora + rope wide) a fused GPU norm keeps; 4 B per token each.
    - multi-token prediction: its three RMSNorms (enorm, hnorm, final_layernorm), upcast as above.
    """
    s, h = cfg.seq_length, cfg.hidden_size
    tokens, heads, d = s, cfg.num_attention_heads // tp, cfg.kv_channels or h // cfg.num_attention_heads
    tokens_sp = tokens / tp if sp else tokens
    norm = (8 - 2) * h * tokens_sp + 4 * tokens_sp if cfg.normalization == "RMSNorm" else 8 * tokens_sp
    terms = {"norms": 2 * norm, "causal_mask": s * s}
    if cfg.hidden_dropout > 0:
        terms["hidden_dropout_noise"] = 2 * h * tokens_sp
    if cfg.attention_dropout > 0:
        terms["attention_dropout_noise"] = heads * tokens * s
    if cfg.position_embedding_type == "rope":
        terms["rope_cos_sin"] = 4 * BF16 * s * (cfg.qk_pos_emb_head_dim if cfg.multi_latent_attention else d)
    if cfg.multi_latent_attention and cfg.qk_layernorm:
        q, kv, rope = cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_pos_emb_head_dim
        terms["latent_norms"] = ((8 - 2) * q * tokens_sp + 4 * tokens_sp
                                 + 8 * kv * tokens_sp - 2 * (kv + rope) * tokens_sp + 4 * tokens_sp)
    if moe:
        rows = ModelSpec(cfg).routed_rows(tokens=tokens, tp=tp, etp=etp)
        terms["routing"] = 12 * tokens_sp * cfg.moe_router_topk + 18 * rows
    if mtp:
        terms["mtp_norms"] = 3 * norm
    return terms


def _check_layer_agreement(cfg, graph: LayerGraph, *, tp: int, ep: int = 1, etp: int = 1):
    spec = ModelSpec(local_spec_kernels(cfg))
    s, h, sp = cfg.seq_length, cfg.hidden_size, graph.sequence_parallel
    assert sp == (tp > 1)  # the default: Megatron-LM requires it for MoE with TP, the planner's default
    kinds = {layer.kind for layer in graph.layers[1:-1]}
    assert kinds == ({"moe"} if cfg.num_experts else {"dense"})
    for layer in graph.layers[1:-1]:
        kind = LayerKind.from_label(layer.kind)
        moe = kind.is_moe
        where = f"{cfg.name} tp={tp} ep={ep} etp={etp} {layer.kind}"
        assert (layer.dense_params, layer.expert_params) == spec.layer_params(tp=tp, ep=ep, etp=etp, kind=kind), where
        gemms = spec.layer_gemms(tokens=s, tp=tp, sp=sp, etp=etp, kind=kind)
        assert layer.gemm_flops == sum(g.flops for g in gemms), where
        assert layer.attention_flops == 2 * spec.attention_flops(micro_batch=1, tp=tp, cp=1), where
        assert layer.boundary_bytes == BF16 * s * h / (tp if sp else 1), where
        # TP with sequence parallel: an all-gather before and a reduce-scatter after attention and
        # a dense MLP, each over the [s, h] activation; a MoE MLP exchanges its tokens over the
        # expert-TP x EP group instead (cost/layer.py prices it as EP).
        if not moe:
            assert layer.communication_bytes == (4 * BF16 * s * h if tp > 1 else 0), where
        analytic = sum(layer_activation_terms(spec, mbs=1, tp=tp, sp=sp, cp=1, kind=kind, etp=etp).values())
        extra = cpu_and_small_terms(cfg, tp=tp, etp=etp, sp=sp, moe=moe)
        assert layer.saved_bytes == pytest.approx(analytic + sum(extra.values()), rel=1e-3), (where, extra)
    embedding, output = graph.layers[0], graph.layers[-1]
    assert embedding.kind == "embedding" and output.kind == "output"
    assert embedding.params == spec.embedding_params(tp) and output.params == spec.output_params(tp=tp, pp=1)
    assert output.gemm_flops == 2 * s * h * spec.padded_vocab(tp) / tp


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_models_trace_like_the_analytic_model(name):
    cfg = load_model_config(name)
    graph = trace_for_cost(cfg, tp=1, ep=1, etp=1)
    assert len(graph.layers) == 3  # embedding, one layer (every layer of these models is one kind), output
    _check_layer_agreement(cfg, graph, tp=1)
    # The bytes that do not grow with the micro-batch are the mask and RoPE's cos/sin (cpu_and_small_terms).
    extra = cpu_and_small_terms(cfg, tp=1, etp=1, sp=False, moe=bool(cfg.num_experts))
    assert graph.layers[1].fixed_saved_bytes == extra["causal_mask"] + extra.get("rope_cos_sin", 0)


@pytest.mark.parametrize("name, tp, ep, etp", [
    ("tiny_gpt", 2, 1, 1), ("tiny_gpt", 4, 1, 1), ("tiny_moe", 2, 1, 1), ("tiny_moe", 1, 2, 1),
    ("tiny_moe", 2, 2, 1), ("tiny_moe", 2, 1, 2), ("llama3_70b", 8, 1, 1), ("mixtral_8x7b", 2, 4, 2),
])
def test_fake_process_group_gives_per_rank_shapes(name, tp, ep, etp):
    cfg = load_model_config(name)
    _check_layer_agreement(cfg, trace_for_cost(cfg, tp=tp, ep=ep, etp=etp), tp=tp, ep=ep, etp=etp)


def test_whole_model_trace_and_json_round_trip(tmp_path):
    cfg = load_model_config("tiny_moe", moe_layer_freq=2)
    graph = trace_megatron(cfg)
    kinds = [layer.kind for layer in graph.layers]
    assert kinds == ["embedding", "moe", "dense", "moe", "dense", "output"]  # i % moe_layer_freq == 0 is MoE
    spec = ModelSpec(cfg)
    total = sum(sum(spec.layer_params(tp=1, kind=kind)) for kind in spec.layer_kinds)
    total += spec.embedding_params(1) + spec.output_params(tp=1, pp=1)
    assert sum(layer.params for layer in graph.layers) == total
    # Layers of one kind trace the same (the layer index changes nothing but the name).
    for kind in ("moe", "dense"):
        same = [replace(layer, index=0, name="") for layer in graph.layers if layer.kind == kind]
        assert all(layer == same[0] for layer in same)
    path = tmp_path / "graph.json"
    path.write_text(graph.to_json())
    assert LayerGraph.from_json(path.read_text()) == graph


@pytest.mark.slow
def test_llama3_70b_whole_model_on_meta():
    """All 80 layers of Llama 3 70B on the meta device: 70.55 B parameters, with the untied 128,256
    x 8,192 embedding and output layer (Meta's model card: 70.6 B)."""
    cfg = load_model_config("llama3_70b")
    graph = trace_megatron(cfg)
    assert len(graph.layers) == 82
    # 80 x (attention 8192 x (8192 + 2 x 1024) + 8192 x 8192 + SwiGLU MLP 3 x 8192 x 28672 + 2 norms of 8192)
    # + embedding and output 2 x 128256 x 8192 + final norm 8192, by hand:
    layer = 8192 * (8192 + 2 * 1024) + 8192 * 8192 + 3 * 8192 * 28672 + 2 * 8192
    assert sum(item.params for item in graph.layers) == 80 * layer + 2 * 128256 * 8192 + 8192 == 70_553_706_496


@pytest.mark.parametrize("stage", [0, 1])
def test_pipeline_stage_holds_its_layers_embedding_and_output(stage):
    """tiny_gpt (tied embeddings) on TP 2 x PP 2: the first stage holds the embedding, the last a copy
    of the word embedding as its output layer (Megatron keeps the two in sync) and the final norm."""
    cfg = load_model_config("tiny_gpt")
    spec = ModelSpec(cfg)
    graph = trace_megatron(cfg, tp=2, pp=2, stage=stage)
    assert (graph.pp, graph.stage, [layer.kind for layer in graph.layers]) == (2, stage, ["embedding", "dense", "dense", "output"])
    assert graph.layers[0].params == (spec.embedding_params(2) if stage == 0 else 0)
    assert graph.layers[-1].params == (spec.output_params(tp=2, pp=2) if stage == 1 else 0)
    assert all((layer.dense_params, layer.expert_params) == spec.layer_params(tp=2) for layer in graph.layers[1:3])
    # The later stage's layers save what the first stage's do (its input arrives from the stage before).
    assert graph.layers[1].saved_bytes == trace_for_cost(cfg, tp=2, ep=1, etp=1).layers[1].saved_bytes


def test_module_source_traces_any_nn_module():
    import trace_factories as f

    graph = trace_module("trace_factories:tiny_torch_gpt", seq_length=f.SEQ)
    assert [layer.kind for layer in graph.layers] == ["embedding"] + ["block"] * f.LAYERS + ["output"]
    block = graph.layers[1]
    # By hand: two LayerNorms (2 x 2h), qkv (h x 3h + 3h), proj (h^2 + h), fc1 (h f + f), fc2 (f h + h).
    h, ffn, s = f.H, f.FFN, f.SEQ
    assert block.dense_params == 4 * h + (3 * h * h + 3 * h) + (h * h + h) + (h * ffn + ffn) + (ffn * h + h) == 49_984
    assert block.gemm_flops == 2 * s * (3 * h * h + h * h + 2 * h * ffn)
    assert block.attention_flops == 4 * s * s * h  # two [s, s] x [s, d] products per head, the full square
    assert block.boundary_bytes == 4 * s * h  # fp32
    assert graph.layers[0].params == f.VOCAB * h and graph.layers[-1].params == f.VOCAB * h
    assert graph.layers[-1].gemm_flops == 2 * s * h * f.VOCAB

    batch2 = trace_module("trace_factories:tiny_torch_gpt_batch2", seq_length=999)
    assert (batch2.micro_batch_size, batch2.seq_length) == (2, f.SEQ)  # taken from the example input
    assert batch2.layers[1].gemm_flops == 2 * block.gemm_flops


# ------------------------------------------------------------------------------------------------
# Layer kinds: MLA, a MoE layer pattern, multi-token prediction
# ------------------------------------------------------------------------------------------------
# tiny_moe with MLA (query latent 64, KV latent 32, per head qk 32 + RoPE 16, v 24, --qk-layernorm), its first
# layer dense, a shared expert of 128, one MTP depth.
KINDS_MODEL = dict(multi_latent_attention=True, num_query_groups=None, q_lora_rank=64, kv_lora_rank=32, qk_head_dim=32,
                   qk_pos_emb_head_dim=16, v_head_dim=24, qk_layernorm=True, moe_layer_freq=[0, 1, 1, 1],
                   moe_shared_expert_intermediate_size=128, mtp_num_layers=1)


@pytest.mark.parametrize("extra, tp, ep", [({}, 1, 1), ({}, 2, 1), ({}, 1, 2), ({"q_lora_rank": None}, 2, 1)])
def test_layer_kinds_trace_like_the_analytic_model(extra, tp, ep):
    """megatron-core's GPTModel with MLATransformerConfig, the local spec's MLA layers (TP 2: its down projections
    column-parallel, model.transformer_impl=local), the MoE pattern and the MTP block (get_gpt_mtp_block_spec), on
    the meta device: per layer kind, the parameters and forward GEMM FLOPs the analytic model gives (exactly,
    within the 1 % asked), the attention FLOPs twice its causal half (the local kernel's full square); the output
    layer runs once per head (the model's and the depth's)."""
    cfg = load_model_config("tiny_moe", **{**KINDS_MODEL, **extra})
    graph = trace_megatron(representative_layers(cfg), tp=tp, ep=ep)
    spec = ModelSpec(local_spec_kernels(cfg))
    s, h, sp = cfg.seq_length, cfg.hidden_size, graph.sequence_parallel
    assert [layer.kind for layer in graph.layers] == ["embedding", "mla+dense", "mla+moe", "mtp:mla+moe", "output"]
    for layer in graph.layers[1:-1]:
        kind = LayerKind.from_label(layer.kind)
        where = f"{layer.kind} tp={tp} ep={ep} {extra}"
        assert (layer.dense_params, layer.expert_params) == spec.layer_params(tp=tp, ep=ep, kind=kind), where
        analytic = sum(g.flops for g in spec.layer_gemms(tokens=s, tp=tp, sp=sp, ep=ep, kind=kind))
        assert layer.gemm_flops == pytest.approx(analytic, rel=1e-2) and layer.gemm_flops == analytic, where
        assert layer.attention_flops == 2 * spec.attention_flops(micro_batch=1, tp=tp, cp=1, kind=kind), where
    output = graph.layers[-1]
    assert output.gemm_flops == 2 * (2 * s * h * spec.padded_vocab(tp) / tp)
    assert graph.layers[0].params == spec.embedding_params(tp)


def test_layer_kinds_saved_bytes_trace_like_the_analytic_terms():
    """What each kind's traced layer saves (TP 1, one sequence) is the analytic terms for the local spec's kernels
    plus the CPU terms `cpu_and_small_terms` works out by hand, within 0.1 %: MLA's latents and Q, K, V, the
    shared expert's activations, the MTP depth's norms' and eh_proj's inputs and its shifted token ids."""
    cfg = load_model_config("tiny_moe", **KINDS_MODEL)
    graph = trace_megatron(representative_layers(cfg), tp=1)
    spec = ModelSpec(local_spec_kernels(cfg))
    for layer in graph.layers[1:-1]:
        kind = LayerKind.from_label(layer.kind)
        analytic = sum(layer_activation_terms(spec, mbs=1, tp=1, sp=False, cp=1, kind=kind).values())
        extra = cpu_and_small_terms(cfg, tp=1, etp=1, sp=False, moe=kind.is_moe, mtp=kind.mtp)
        assert layer.saved_bytes == pytest.approx(analytic + sum(extra.values()), rel=1e-3), (layer.kind, extra)


def test_megatron_source_plans_with_layer_kinds():
    """model.source=megatron on the layer-kinds model: the cost model reads each kind's traced layer (MLA dense,
    MLA MoE, the MTP depth) and `plan` finds a plan; its argv names the kinds' flags and the local spec."""
    from nest_megatron import api

    keys = [f"model.{k}={v if v is not None else 'null'}".replace("False", "false").replace("True", "true")
            .replace(" ", "") for k, v in KINDS_MODEL.items()]
    loaded = load(["model=tiny_moe", *keys, "model.source=megatron", *SMALL])
    spec = loaded.problem.model
    assert spec.cfg.transformer_impl == "local"  # the traced model is the local spec
    graph = trace_for_cost(spec.cfg, tp=1, ep=2, etp=1)
    for layer in graph.layers[1:-1]:
        kind = LayerKind.from_label(layer.kind)
        assert spec.layer_params(tp=1, ep=2, kind=kind) == (layer.dense_params, layer.expert_params)
    plan = api.plan(["model=tiny_moe", *keys, "model.source=megatron", *SMALL, "solver.jobs=1"])
    argv = plan.megatron_args
    for flag in ("--multi-latent-attention", "--mtp-num-layers", "--moe-layer-freq", "--transformer-impl"):
        assert flag in argv, flag
    assert argv[argv.index("--moe-layer-freq") + 1] == "([0]*1+[1]*3)"


def test_megatron_refusing_a_shape_is_one_line():
    cfg = load_model_config("tiny_gpt", num_query_groups=3, num_attention_heads=6, hidden_size=192, ffn_hidden_size=384)
    with pytest.raises(NestError, match=r"megatron-core cannot build tiny_gpt at tp=2 ep=1 etp=1: num_query_groups \(3\)"):
        trace_megatron(cfg, tp=2, num_layers=1)


@pytest.mark.parametrize("spec, message", [
    ("trace_factories", "expected pkg.mod:factory"),
    ("no_such_module_xyz:f", "cannot import no_such_module_xyz"),
    ("trace_factories:missing", "has no callable missing"),
    ("trace_factories:not_a_module", "not a torch.nn.Module"),
    ("trace_factories:no_blocks", "no ModuleList or Sequential"),
])
def test_module_source_errors(spec, message):
    with pytest.raises(NestError, match=message):
        trace_module(spec, seq_length=8)


# ------------------------------------------------------------------------------------------------
# Hugging Face config.json
# ------------------------------------------------------------------------------------------------
# Excerpts of the published config.json files (the architecture keys; values as on the Hub).
LLAMA3_8B = {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
             "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 8192,
             "hidden_act": "silu", "rms_norm_eps": 1e-05, "tie_word_embeddings": False, "attention_bias": False,
             "attention_dropout": 0.0, "_name_or_path": "meta-llama/Meta-Llama-3-8B"}
MIXTRAL = {"model_type": "mixtral", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
           "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 32000, "num_local_experts": 8,
           "num_experts_per_tok": 2, "tie_word_embeddings": False, "attention_dropout": 0.0}
GPT2 = {"model_type": "gpt2", "n_embd": 768, "n_layer": 12, "n_head": 12, "n_inner": None, "n_positions": 1024,
        "vocab_size": 50257, "resid_pdrop": 0.1, "attn_pdrop": 0.1, "activation_function": "gelu_new"}
PYTHIA_1B = {"model_type": "gpt_neox", "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
             "num_attention_heads": 8, "vocab_size": 50304, "rotary_pct": 0.25, "tie_word_embeddings": False,
             "use_parallel_residual": True, "attention_dropout": 0.0, "hidden_dropout": 0.0}
SHAPE_KEYS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups", "kv_channels",
              "vocab_size", "swiglu", "untie_embeddings_and_output_weights", "position_embedding_type", "normalization",
              "add_bias_linear", "hidden_dropout", "attention_dropout", "num_experts", "moe_router_topk")


def _write(tmp_path, data, name="config.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return path


@pytest.mark.parametrize("hf, shipped", [(LLAMA3_8B, "llama3_8b"), (MIXTRAL, "mixtral_8x7b")])
def test_hf_config_matches_the_shipped_model(tmp_path, hf, shipped):
    base = load_model_config("tiny_gpt")  # every shape key must come from the file, none from here
    got = model_config_from_hf(_write(tmp_path, hf), base)
    want = load_model_config(shipped)
    assert {k: getattr(got, k) for k in SHAPE_KEYS} == {k: getattr(want, k) for k in SHAPE_KEYS}
    assert got.seq_length == base.seq_length  # a choice of the run, not of the architecture


def test_hf_gpt2_and_neox_parameter_counts(tmp_path):
    """GPT-2 small has 124,439,808 parameters (Hugging Face, vocabulary 50,257, tied head); Megatron
    pads the vocabulary to 50,304 (a multiple of 128): + 47 x 768. Pythia-1B: 1,011,781,632
    (EleutherAI's model card: 1,011,781,632 total with its untied 50,304 x 2,048 embedding and head)."""
    base = replace(load_model_config("tiny_gpt"), seq_length=1024)
    gpt2 = ModelSpec(model_config_from_hf(_write(tmp_path, GPT2), base))
    total = sum(sum(gpt2.layer_params(tp=1)) for _ in range(12)) + gpt2.embedding_params(1) + gpt2.output_params(tp=1, pp=1)
    assert total == 124_439_808 + 47 * 768
    neox = ModelSpec(model_config_from_hf(_write(tmp_path, PYTHIA_1B), replace(base, seq_length=2048)))
    total = sum(sum(neox.layer_params(tp=1)) for _ in range(16)) + neox.embedding_params(1) + neox.output_params(tp=1, pp=1)
    assert total == 1_011_781_632


@pytest.mark.parametrize("content, message", [
    (None, "no such file"),
    ("{not json", "not JSON"),
    ("[1, 2]", "one JSON object"),
    (json.dumps({"model_type": "bert"}), "model_type 'bert' is not supported; supported are llama"),
    (json.dumps({**LLAMA3_8B, "hidden_size": None}), r": llama needs hidden_size as an integer >= 1, found None$"),
])
def test_hf_config_errors(tmp_path, content, message):
    path = tmp_path / "config.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(NestError, match=message):
        model_config_from_hf(path, load_model_config("tiny_gpt"))


# ------------------------------------------------------------------------------------------------
# The plan hook: model.source
# ------------------------------------------------------------------------------------------------
SMALL = ["cluster=dgx_h100_superpod", "cluster.num_devices=8", "train.global_batch_size=16"]


def test_traced_numbers_replace_the_analytic_ones_in_the_cost_model():
    """With model.source=megatron the cost model reads the traced layer: per-rank parameters, GEMMs
    (rows scaled from one sequence to the micro-batch), attention FLOPs, and saved bytes scaled by
    the micro-batch, with the analytic sequence-parallel and selective-recompute deltas."""
    loaded = load(["model=tiny_gpt", "model.source=megatron", *SMALL])
    spec = loaded.problem.model
    assert spec.cfg.attention_backend == "unfused" and not spec.cfg.bias_swiglu_fusion  # the local spec's kernels
    graph = trace_for_cost(load_model_config("tiny_gpt"), tp=2, ep=1, etp=1)
    layer = graph.layers[1]
    assert spec.layer_params(tp=2) == (layer.dense_params, layer.expert_params)
    gemms = spec.layer_gemms(tokens=4 * 128, tp=2)
    # named by their role in the layer (self_attention.linear_qkv -> qkv, ...), as the analytic GEMMs are
    assert [(g.name, g.m, g.n, g.k) for g in gemms] == [(role, 4 * g.m, g.n, g.k) for role, g in
                                                         zip(("qkv", "proj", "fc1", "fc2"), layer.gemms)]
    assert [g.name for g in layer.gemms] == ["self_attention.linear_qkv", "self_attention.linear_proj",
                                             "mlp.linear_fc1", "mlp.linear_fc2"]
    assert spec.attention_flops(micro_batch=4, tp=2, cp=2) == layer.attention_flops * 4 / 2

    analytic = ModelSpec(spec.cfg)  # same kernels, no tracer
    assert graph.sequence_parallel  # traced as Megatron runs TP: with sequence parallel
    # What does not grow with the micro-batch: the [s, s] bool causal mask, 128 x 128 bytes (tiny_gpt
    # has learned positions: no RoPE cos/sin).
    assert layer.fixed_saved_bytes == 128 * 128
    act = layer_activation_bytes(spec, mbs=4, tp=2, sp=True, cp=1, kind=DENSE)
    assert act["none"] == 4 * (layer.saved_bytes - 128 * 128) + 128 * 128 and act["full"] == 4 * layer.boundary_bytes
    plain = layer_activation_bytes(analytic, mbs=4, tp=2, sp=True, cp=1, kind=DENSE)
    assert act["none"] - act["selective"] == plain["none"] - plain["selective"]
    no_sp = layer_activation_bytes(spec, mbs=4, tp=2, sp=False, cp=1, kind=DENSE)
    plain_no_sp = layer_activation_bytes(analytic, mbs=4, tp=2, sp=False, cp=1, kind=DENSE)
    assert no_sp["none"] - act["none"] == pytest.approx(plain_no_sp["none"] - plain["none"])
    assert no_sp["full"] == 4 * layer.boundary_bytes * 2


def test_mixed_dense_and_moe_layers_each_get_their_own_trace():
    """moe_layer_freq=2: the tracer builds one MoE and one dense layer; the cost model reads each kind."""
    loaded = load(["model=tiny_moe", "model.moe_layer_freq=2", "model.source=megatron", *SMALL])
    spec = loaded.problem.model
    graph = trace_for_cost(spec.cfg, tp=1, ep=2, etp=1)
    assert [layer.kind for layer in graph.layers] == ["embedding", "moe", "dense", "output"]
    for layer in graph.layers[1:3]:
        kind = LayerKind.from_label(layer.kind)
        assert spec.layer_params(tp=1, ep=2, etp=1, kind=kind) == (layer.dense_params, layer.expert_params)
        assert spec.layer_params(tp=1, ep=2, etp=1, kind=kind) == ModelSpec(spec.cfg).layer_params(tp=1, ep=2, etp=1, kind=kind)


@pytest.mark.slow
def test_evaluate_with_a_traced_model(tmp_path):
    """`evaluate` end to end on a traced model: the stage's activations are the traced layer's
    saved bytes x micro-batch x layers x micro-batches in flight (1F1B, one stage: one), plus the
    unfused attention's one score buffer per rank: bf16 x mbs 2 x 8 heads / tp 2 x 128^2 = 262,144 B."""
    from nest_megatron import api

    pins = ["plan.tp=2", "plan.pp=1", "plan.dp=4", "plan.mbs=2", "plan.recompute=none", "plan.zero=1"]
    plan = api.evaluate(["model=tiny_gpt", "model.source=megatron", *SMALL, *pins])
    layer = trace_for_cost(load_model_config("tiny_gpt"), tp=2, ep=1, etp=1).layers[1]
    activations = plan.predicted["memory_breakdown_gib"][0]["activations"] * 2**30
    saved = 4 * (2 * (layer.saved_bytes - layer.fixed_saved_bytes) + layer.fixed_saved_bytes)
    assert activations == pytest.approx(saved + 262_144)


@pytest.mark.parametrize("overrides, message", [
    (["model.source=bogus"], "model.source=bogus: allowed are analytic, megatron, hf, module"),
    (["model.source=hf"], "model.source=hf: set model.hf_config=PATH"),
    (["model.source=module"], "model.source=module: set model.module=pkg.mod:factory"),
    (["model.hf_config=/x/config.json"], "read only with model.source=hf"),
    (["model.source=module", "model.module=nope"], "expected pkg.mod:factory"),
    (["model=tiny_moe", "model.source=module", "model.module=trace_factories:tiny_torch_gpt"], "unset model.num_experts"),
    (["model.source=hf", "model.hf_config=/no/such/config.json"], "no such file"),
])
def test_model_source_errors(overrides, message):
    with pytest.raises(NestError, match=message):
        load(["model=tiny_gpt", *SMALL, *overrides])


def test_module_source_supplies_tp1_and_leaves_wider_tp_to_the_formulas():
    import trace_factories as f

    shape = [f"model.num_layers={f.LAYERS}", f"model.hidden_size={f.H}", f"model.ffn_hidden_size={f.FFN}",
             f"model.num_attention_heads={f.HEADS}", f"model.seq_length={f.SEQ}", f"model.vocab_size={f.VOCAB}"]
    loaded = load(["model=tiny_gpt", *shape, "model.source=module", "model.module=trace_factories:tiny_torch_gpt", *SMALL])
    spec = loaded.problem.model
    assert spec.layer_params(tp=1) == (49_984, 0)  # the block, by hand (test_module_source_traces_any_nn_module)
    assert spec.layer_params(tp=2) == ModelSpec(spec.cfg).layer_params(tp=2)  # no TP form: the formulas
    assert spec.attention_flops(micro_batch=2, tp=1, cp=1) == 2 * 4 * f.SEQ * f.SEQ * f.H


def test_hf_source_loads_the_file_as_the_model(tmp_path):
    path = _write(tmp_path, {**LLAMA3_8B, "num_hidden_layers": 2, "hidden_size": 256, "intermediate_size": 512,
                             "num_attention_heads": 8, "num_key_value_heads": 4, "vocab_size": 1000})
    # traced (megatron-core's local spec) when asked: model.transformer_impl=local (tests/test_hf_configs.py)
    loaded = load(["model=tiny_gpt", "model.source=hf", f"model.hf_config={path}", "model.transformer_impl=local",
                   *SMALL])
    cfg = loaded.problem.model.cfg
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_query_groups, cfg.swiglu, cfg.seq_length) == (2, 256, 4, True, 128)
    spec = loaded.problem.model
    traced = spec.traced_layer(tp=1)[1]
    assert (traced.dense_params, traced.expert_params) == ModelSpec(cfg).layer_params(tp=1)


# ------------------------------------------------------------------------------------------------
# The command
# ------------------------------------------------------------------------------------------------
def test_trace_command_writes_the_layer_graph(tmp_path, capsys):
    from nest_megatron.cli import main

    out = tmp_path / "sub" / "graph.json"
    assert main(["trace", "model=tiny_moe", "--tp", "2", "--ep", "2", "--layers", "2", f"out={out}"]) == 0
    assert "written to" in capsys.readouterr().out
    graph = LayerGraph.from_json(out.read_text())
    assert (graph.tp, graph.ep, graph.etp, len(graph.layers)) == (2, 2, 1, 4)
    _check_layer_agreement(load_model_config("tiny_moe"), graph, tp=2, ep=2)

    # Without out=, the JSON on stdout; a generic module through model.source=module.
    assert main(["trace", "model=tiny_gpt", "model.source=module", "model.module=trace_factories:tiny_torch_gpt"]) == 0
    assert [layer["kind"] for layer in json.loads(capsys.readouterr().out)["layers"]].count("block") == 3


@pytest.mark.parametrize("args, message", [
    (["model=tiny_gpt", "--tp", "3"], "--tp=3: must divide the attention heads (8) and query groups (8)"),
    (["model=tiny_moe", "--ep", "3"], "--ep=3: must divide the experts (4)"),
    (["model=tiny_gpt", "--ep", "2"], "expert parallelism needs a MoE model"),
    (["model=tiny_gpt", "--layers", "9"], "--layers=9: between 1 and model.num_layers=4"),
    (["model=tiny_gpt", "--tp", "0"], "--tp=0: must be a positive integer"),
    (["model=tiny_gpt", "model.source=analytic"], "nothing to trace"),
    (["model=tiny_gpt", "model.source=module", "model.module=trace_factories:tiny_torch_gpt", "--tp", "2"],
     "traced at --tp 1 --ep 1 --etp 1 only"),
    (["model=nope"], "model=nope: unknown model"),
    (["model=tiny_gpt", "--spec", "fast"], "layer spec fast: allowed are local, te"),
    (["model=tiny_gpt", "--pp", "3"], "--pp=3 --stage=0: pp must divide the 4 layers traced"),
    (["model=tiny_gpt", "--pp", "2", "--stage", "2"], "0 <= stage < pp"),
])
def test_trace_command_bad_input(tmp_path, capsys, args, message):
    from nest_megatron.cli import main

    out = tmp_path / "graph.json"
    assert main(["trace", *args, f"out={out}"]) == 2 and not out.exists()
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("nest-megatron trace: error:") and message in lines[0], lines


# A Megatron launch line: Llama-3-8B-like flags, two layers, TP 2 with sequence parallel, micro-batch 2.
MEGATRON_ARGS = ["pretrain_gpt.py", "--num-layers", "2", "--hidden-size", "512", "--ffn-hidden-size", "1024",
                 "--num-attention-heads", "8", "--group-query-attention", "--num-query-groups", "4", "--seq-length", "64",
                 "--max-position-embeddings", "64", "--vocab-size", "1000", "--swiglu", "--normalization", "RMSNorm",
                 "--position-embedding-type", "rope", "--disable-bias-linear", "--untie-embeddings-and-output-weights",
                 "--hidden-dropout", "0", "--attention-dropout", "0", "--tensor-model-parallel-size", "2",
                 "--sequence-parallel", "--micro-batch-size", "2", "--bf16", "--lr", "3e-4"]


def test_trace_a_megatron_launch_line(tmp_path, capsys):
    from nest_megatron.cli import main

    out = tmp_path / "graph.json"
    assert main(["trace", f"out={out}", "--", *MEGATRON_ARGS]) == 0, capsys.readouterr().err
    graph = LayerGraph.from_json(out.read_text())
    assert (graph.tp, graph.sequence_parallel, graph.micro_batch_size, graph.seq_length) == (2, True, 2, 64)
    layer = graph.layers[1]
    # By hand, on one of 2 TP ranks: QKV 512 x (512 + 2 x 256) / 2, proj 512 x 512 / 2, SwiGLU FC1 512 x 2048 / 2,
    # FC2 1024 x 512 / 2, two RMSNorm weights of 512 (not split).
    assert layer.dense_params == (512 * 1024 + 512 * 512 + 512 * 2048 + 1024 * 512) // 2 + 2 * 512
    assert layer.boundary_bytes == BF16 * 2 * 64 * 512 / 2  # [s/tp, b, h] under sequence parallel
    # --tp given on the command line wins over the launch line's width.
    assert main(["trace", "--tp", "1", f"out={out}", "--", *MEGATRON_ARGS]) == 0
    assert LayerGraph.from_json(out.read_text()).tp == 1


def test_trace_a_launch_line_without_a_model(tmp_path, capsys):
    from nest_megatron.cli import main

    out = tmp_path / "graph.json"
    assert main(["trace", f"out={out}", "--", "pretrain_gpt.py", "--lr", "3e-4"]) == 2 and not out.exists()
    assert "describe no model: --num-layers" in capsys.readouterr().err


def test_transformer_engine_spec(tmp_path, capsys):
    """The TE layer spec where transformer_engine imports (it needs CUDA: not in CI); one line otherwise."""
    from nest_megatron.cli import main
    from nest_megatron.trace.meta import have_transformer_engine

    out = tmp_path / "graph.json"
    code = main(["trace", "model=tiny_gpt", "--spec", "te", "--layers", "1", f"out={out}"])
    if have_transformer_engine():
        assert code == 0 and LayerGraph.from_json(out.read_text()).layers[1].dense_params == \
            ModelSpec(load_model_config("tiny_gpt")).layer_params(tp=1)[0]
    else:
        assert code == 2 and not out.exists()
        assert "transformer_engine does not import here" in capsys.readouterr().err
