"""Activation bytes one transformer layer keeps for its backward pass, on one device.

Term by term after Korthikanti et al., "Reducing Activation Recomputation in Large Transformer
Models" (arXiv 2205.05198, Sec. 4.1), generalised beyond their GPT (4h GeLU MLP, multi-head
attention, dropout, unfused fp16 softmax) to SwiGLU, grouped-query attention, no dropout, fused
(flash) attention, context and sequence parallel and MoE, and checked against what a real
megatron-core layer saves (tests/test_activations_vs_megatron.py). Notation: T tokens on this CP
rank (b s / cp), t the TP width, T_sp = T/t with sequence parallel (tensors on the full hidden
size are sequence-sharded) and T without it; q and kv are the query and key/value widths.

  norm1_input, norm2_input   2 h T_sp          each norm keeps its input
  qkv_input, fc1_input       2 h T_sp          the linears keep their (pre-all-gather) input
  qkv (flash)                2 T (q + 2kv)/t   Q, K, V as the fused kernel keeps them
  qkv (unfused)              the whole QKV output 2 T (q + 2kv)/t, kept alive by V's view, plus
                             Q and K, 2 T (q + kv)/t, where RoPE or the GQA reshape makes them
                             new tensors; with GQA, K and V are repeated to every head before
                             they are kept: 3 x 2 T q/t instead
  softmax_lse (flash)        4 (a/t) T         the fp32 log-sum-exp
  softmax (unfused)          2 or 4 (a/t) T s  probabilities, bf16 or fp32 (softmax_in_fp32)
  attention_dropout          3 (a/t) T s       1-byte mask + dropped probabilities (p > 0);
                             without dropout, 2 (a/t) T s: the bf16 copy attention-over-values keeps
  proj_input                 2 T q/t           the context
  fc1_output                 2 T f'/t          kept by the activation (f' = 2f with SwiGLU); an
                             unfused SwiGLU also keeps silu(gate) and a copy of up: + 4 T f/t
  fc2_input                  2 T f/t
  hidden_dropout_masks       1 h T_sp a block  after attention and after the MLP (p > 0)
  shared_fc1_output, ...     a MoE layer's shared expert: its FC1 output, unfused SwiGLU and FC2
                             input over every token, as the dense MLP's at its width / t
  expert_input               2 w R             the routed experts' FC1 input, R routed rows of the token width w
                             (ModelSpec.moe_token_width: h, or the latent size L with --moe-latent-size)
  latent_fc2_input           2 L T_sp          a latent MoE's fc2_latent_proj input, the combined latent tokens
                             (fc1_latent_proj reads fc1_input's normed tensor, kept once)

The terms are kept per block of the layer's kind (model/kinds.py): the mixer's (standard attention
above; MLA's latents and Q, K, V: `_mla_terms`; a Mamba-2 mixer's: `_mamba_terms`), the MLP's (dense or MoE), a multi-token-prediction
depth's own (`_mtp_terms`); a block that is "none" keeps nothing.

With fp8 GEMMs (model.numerics) the inputs of the linears (FP8_SAVED_INPUTS) are kept as
Transformer Engine's 1-byte fp8 copies.

For Korthikanti's GPT (learned positions, bf16 softmax) these terms add up to exactly their
34 s b h + 5 a s^2 b; RoPE adds the new Q and K, 4 s b h. Selective recompute drops the terms of its modules
(cost/recompute.py dropped_terms; "core_attn", Megatron's default, the softmax and dropout terms, and keeps Q, K, V
un-repeated as the checkpoint's inputs); full recompute keeps the layer input only.
"""

from __future__ import annotations

import math

from nest_megatron.cost import fp8
from nest_megatron.cost.recompute import dropped_terms
from nest_megatron.model.kinds import LayerKind
from nest_megatron.model.spec import ModelSpec
from nest_megatron.parallel.config import DEFAULT_RECOMPUTE_MODULES

BF16, FP32, MASK, INT64 = 2, 4, 1, 8

# The inputs of the linears (QKV, projection, FC1, FC2, the experts' FC1, the shared expert's FC2, MLA's down and
# up projections, MTP's eh_proj, Mamba's in_proj and out_proj, a latent MoE's fc2_latent_proj): kept in fp8 with
# fp8 GEMMs.
FP8_SAVED_INPUTS = ("qkv_input", "proj_input", "fc1_input", "fc2_input", "expert_input", "shared_fc2_input",
                    "mla_down_input", "q_latent_norm", "kv_latent_norm", "eh_proj_input", "in_proj_input",
                    "out_proj_input", "latent_fc2_input")


def _qkv_bytes(model: ModelSpec, *, tokens: float, tp: int, core_attn: bool) -> float:
    q, kv = model.q_size / tp, model.kv_size / tp
    if model.fused_attention:
        return BF16 * tokens * (q + 2 * kv)
    gqa = model.query_groups != model.heads
    if gqa and not core_attn:
        return BF16 * tokens * 3 * q  # Q, and K and V repeated to every head
    # Q and K are new tensors after RoPE or the GQA reshape, views of the QKV output otherwise;
    # the QKV output itself stays alive under V's view.
    fresh_qk = q + kv if gqa or model.cfg.position_embedding_type == "rope" else 0.0
    return BF16 * tokens * (fresh_qk + q + 2 * kv)


def layer_activation_terms(
    model: ModelSpec, *, mbs: int, tp: int, sp: bool, cp: int, kind: LayerKind, etp: int = 1,
    modules: tuple[str, ...] = (),
) -> dict[str, float]:
    """The named bytes one layer of `kind` keeps for its backward (the module docstring's terms): its mixer
    block's, its MLP block's and, for a multi-token-prediction depth, that depth's own. Selective recompute of
    `modules` drops cost/recompute.py's dropped_terms."""
    m = model.cfg
    tokens = mbs * m.seq_length // cp
    tokens_sp = tokens / tp if sp else tokens
    terms = {}
    if kind.mtp:
        terms |= _mtp_terms(model, tokens=tokens, tokens_sp=tokens_sp)
    terms |= _mixer_terms(model, kind, tokens=tokens, tokens_sp=tokens_sp, tp=tp, core_attn="core_attn" in modules)
    terms |= _mlp_terms(model, kind, tokens=tokens, tokens_sp=tokens_sp, tp=tp, etp=etp)
    if m.hidden_dropout > 0:
        blocks = (kind.mixer != "none") + (kind.mlp != "none")
        terms["hidden_dropout_masks"] = blocks * MASK * model.h * tokens_sp
    if model.numerics.fp8_recipe is not None:
        # Transformer Engine's fp8 linears keep their input as the fp8 copy the weight-gradient GEMM
        # reads (1 byte per element and its scales: cost/fp8.py saved_input_bytes), not in bf16.
        per_element = fp8.saved_input_bytes(model.numerics.fp8_recipe)
        for name in FP8_SAVED_INPUTS:
            if name in terms:
                terms[name] = terms[name] * per_element / BF16
    for name in dropped_terms(model, kind, modules):
        terms.pop(name, None)
    return terms


def _mixer_terms(model: ModelSpec, kind: LayerKind, *, tokens: float, tokens_sp: float, tp: int,
                 core_attn: bool) -> dict[str, float]:
    m, h = model.cfg, model.h
    if kind.mixer == "none":
        return {}
    terms = {"norm1_input": BF16 * h * tokens_sp}
    if kind.mixer == "mamba":
        return terms | _mamba_terms(model, tokens=tokens, tokens_sp=tokens_sp, tp=tp)
    if kind.mixer == "attention":
        terms |= {"qkv_input": BF16 * h * tokens_sp,
                  "qkv": _qkv_bytes(model, tokens=tokens, tp=tp, core_attn=core_attn),
                  "proj_input": BF16 * tokens * model.q_size / tp}
    elif kind.mixer == "mla":
        terms |= _mla_terms(model, tokens=tokens, tokens_sp=tokens_sp, tp=tp)
    heads = model.heads / tp
    if model.fused_attention:
        terms["softmax_lse"] = FP32 * heads * tokens
    else:
        s = m.seq_length
        terms["softmax"] = (FP32 if m.attention_softmax_in_fp32 else BF16) * heads * tokens * s
        # What attention-over-values keeps: the dropped probabilities and the 1-byte mask; without
        # dropout, the bf16 cast of an fp32 softmax, or nothing more (the softmax output itself).
        dropped = MASK + BF16 if m.attention_dropout > 0 else BF16 if m.attention_softmax_in_fp32 else 0
        if dropped:
            terms["attention_dropout"] = dropped * heads * tokens * s
    return terms


def _mamba_terms(model: ModelSpec, *, tokens: float, tokens_sp: float, tp: int) -> dict[str, float]:
    """What a Mamba-2 mixer keeps (megatron-core 0.16.1 ssm/mamba_mixer.py forward and _ssm_training; mamba_ssm
    ops/triton/ssd_combined.py MambaSplitConv1dScanCombinedFn, which recomputes the conv and the scan's states
    in backward), d_inner D, groups G, state N, heads H:
      in_proj_input   2 h T_sp            the normed hidden state (TE's fused norm keeps its output)
      mamba_zxbcdt    2 T (2D + 2GN + H)/t  in_proj's output, the scan kernel's saved input
      mamba_scan_out  2 T D / t           the scan's output before the gate (out_x)
      mamba_norm_input 2 T D / t          the gated output, the gated RMSNorm's input (and 4 T G / t of rstd)
      out_proj_input  2 T D / t           the norm's output, out_proj's input"""
    inner = model.mamba_inner / tp
    return {"in_proj_input": BF16 * model.h * tokens_sp,
            "mamba_zxbcdt": BF16 * tokens * model.mamba_in_proj_width / tp,
            "mamba_scan_out": BF16 * tokens * inner,
            "mamba_norm_input": BF16 * tokens * inner + FP32 * tokens * model.cfg.mamba_num_groups / tp,
            "out_proj_input": BF16 * tokens * inner}


def _mla_terms(model: ModelSpec, *, tokens: float, tokens_sp: float, tp: int) -> dict[str, float]:
    """What MLASelfAttention keeps (megatron/core/transformer/multi_latent_attention.py), heads H, q = qk_head_dim
    + qk_pos_emb_head_dim, v = v_head_dim:
      mla_down_input   2 h T_sp        the normed hidden state, input of the down projections (and of
                                       linear_q_proj without a query latent)
      q_latent         2 q_lora T_sp   linear_q_up_proj's input (q_layernorm's, with --qk-layernorm)
      q_latent_norm    2 q_lora T_sp   with --qk-layernorm: the normed latent the up projection reads
      kv_latent        2 (kv_lora + rope) T_sp   linear_kv_down_proj's output, kept whole by the KV latent's
                                       view (kv_layernorm's or linear_kv_up_proj's input)
      kv_latent_norm   2 kv_lora T_sp  with --qk-layernorm
      qkv              2 T H (2 q + v) / t   the query, key and value the attention kernel keeps: new
                                       tensors (the RoPE parts concatenated on; V made contiguous)
      proj_input       2 T H v / t     the attention output
    The up projections' outputs are split and concatenated into Q, K, V and not kept."""
    m, h = model.cfg, model.h
    terms = {"mla_down_input": BF16 * h * tokens_sp}
    if m.q_lora_rank is not None:
        terms["q_latent"] = BF16 * m.q_lora_rank * tokens_sp
        if m.qk_layernorm:
            terms["q_latent_norm"] = BF16 * m.q_lora_rank * tokens_sp
    terms["kv_latent"] = BF16 * model.mla_kv_down_width * tokens_sp
    if m.qk_layernorm:
        terms["kv_latent_norm"] = BF16 * m.kv_lora_rank * tokens_sp
    qk, v = model.attention_widths(LayerKind("mla"))
    terms["qkv"] = BF16 * tokens * (2 * qk + v) / tp
    terms["proj_input"] = BF16 * tokens * v / tp
    return terms


def _mlp_terms(model: ModelSpec, kind: LayerKind, *, tokens: float, tokens_sp: float, tp: int,
               etp: int) -> dict[str, float]:
    m, h = model.cfg, model.h
    if kind.mlp == "none":
        return {}
    terms = {"norm2_input": BF16 * h * tokens_sp, "fc1_input": BF16 * h * tokens_sp}
    moe = kind.mlp == "moe"
    if moe:
        # Each routed copy of a token goes through its expert's FC1, activation and FC2.
        rows, f, width = model.routed_rows(tokens=tokens, tp=tp, etp=etp), model.moe_ffn, etp
        terms["expert_input"] = BF16 * model.moe_token_width * rows
        if m.moe_latent_size:  # fc2_latent_proj's input: the combined tokens at the latent width, on this rank's shard
            terms["latent_fc2_input"] = BF16 * m.moe_latent_size * tokens_sp
    else:
        rows, f, width = tokens, m.ffn_hidden_size, tp
    terms["fc1_output"] = BF16 * rows * f * model.fc1_factor / width
    if m.swiglu and not m.bias_swiglu_fusion:
        terms["swiglu_unfused"] = 2 * BF16 * rows * f / width
        if moe:  # the routing weights multiply the activation's output, which that product keeps
            terms["expert_probs_input"] = BF16 * rows * f / width
    terms["fc2_input"] = BF16 * rows * f / width
    shared = m.moe_shared_expert_intermediate_size if moe else None
    if shared:  # the shared expert: an MLP over every token, split over TP, reading fc1_input's tensor
        terms["shared_fc1_output"] = BF16 * tokens * shared * model.fc1_factor / tp
        if m.swiglu and not m.bias_swiglu_fusion:
            terms["shared_swiglu_unfused"] = 2 * BF16 * tokens * shared / tp
        terms["shared_fc2_input"] = BF16 * tokens * shared / tp
    return terms


def _mtp_terms(model: ModelSpec, *, tokens: float, tokens_sp: float) -> dict[str, float]:
    """A multi-token-prediction depth's own (megatron-core MultiTokenPredictionLayer): the shifted token ids its
    embedding lookup keeps (int64), enorm's input (their embedding), hnorm's (the hidden state), eh_proj's (the
    two normed, concatenated: 2h wide) and final_layernorm's, each on this rank's sequence shard."""
    h = model.h
    return {"mtp_token_ids": INT64 * tokens, "mtp_enorm_input": BF16 * h * tokens_sp,
            "mtp_hnorm_input": BF16 * h * tokens_sp, "eh_proj_input": BF16 * 2 * h * tokens_sp,
            "mtp_final_norm_input": BF16 * h * tokens_sp}


def layer_input_bytes(model: ModelSpec, *, mbs: int, tp: int, sp: bool, cp: int, kind: LayerKind) -> float:
    """What a fully recomputed layer keeps: its input, [b s / cp (/ tp with SP), h] in bf16; a multi-token-
    prediction depth checkpoints two, the hidden state and the shifted tokens' embedding
    (MultiTokenPredictionLayer._checkpointed_forward)."""
    tokens_sp = mbs * model.cfg.seq_length // cp / (tp if sp else 1)
    return (2 if kind.mtp else 1) * BF16 * model.h * tokens_sp


def layer_activation_bytes(
    model: ModelSpec, *, mbs: int, tp: int, sp: bool, cp: int, kind: LayerKind, etp: int = 1,
    modules: tuple[str, ...] = DEFAULT_RECOMPUTE_MODULES,
) -> dict[str, float]:
    """Bytes kept per layer of `kind` and micro-batch under each recompute setting.

    none / selective (of `modules`): what the layer keeps; full: the checkpointed layer input only; pinned: the
    host memory "none" takes when the layer is offloaded (`pinned_bytes`, its rounding applied to a traced layer's
    bytes).

    A traced model (ModelSpec.tracer) supplies what its layer really saves and hands on, traced at
    one sequence without context parallelism: both scale with the tokens (b s / cp), except the
    bytes the trace found fixed (an [s, s] mask, RoPE's cos/sin), which scale with 1 / cp only.
    What differs between sequence parallel on and off (when the trace's setting is not `sp`), and
    what selective recompute drops, come from the analytic terms.
    """
    args = dict(mbs=mbs, tp=tp, sp=sp, cp=cp, kind=kind, etp=etp)
    none = layer_activation_terms(model, **args)
    selective = layer_activation_terms(model, **args, modules=modules)
    full = layer_input_bytes(model, mbs=mbs, tp=tp, sp=sp, cp=cp, kind=kind)
    analytic = {"none": sum(none.values()), "selective": sum(selective.values()), "full": full}
    # offloaded (no recompute): "none"'s bytes as pinned host buffers hold them
    rounding = pinned_bytes(none, qkv_widths=_qkv_widths(model, kind)) / analytic["none"] if analytic["none"] else 1.0
    traced = model.traced_layer(tp=tp, etp=etp, kind=kind)
    if not traced:
        return analytic | {"pinned": analytic["none"] * rounding}
    graph, layer = traced
    scale = mbs / (graph.micro_batch_size * cp)
    sp_change = analytic["none"] - sum(layer_activation_terms(model, **{**args, "sp": graph.sequence_parallel}).values())
    fixed = layer.fixed_saved_bytes
    kept = (layer.saved_bytes - fixed) * scale + fixed / cp + sp_change
    boundary = layer.boundary_bytes * scale * (tp if graph.sequence_parallel else 1) / (tp if sp else 1)
    return {"none": kept, "selective": kept - (analytic["none"] - analytic["selective"]), "full": boundary,
            "pinned": kept * rounding}


def pinned_bytes(terms: dict[str, float], *, qkv_widths: tuple[int, ...] = ()) -> float:
    """Host bytes the saved tensors `terms` take when offloaded: Transformer Engine copies each into a pinned
    buffer of its size (pytorch/cpu_offload.py:281 at v2.12, torch.empty_like(pin_memory=True)), which PyTorch's
    caching host allocator rounds up to a power of two (ATen/core/CachingHostAllocator.h, allocate: PowerOf2Ceil
    below pinned_max_round_threshold, unlimited by default) and keeps for reuse. A term is one tensor, but "qkv":
    the query, key and value, in the proportions `qkv_widths`."""
    def buffer(size: float) -> float:
        return 2.0 ** math.ceil(math.log2(size)) if size > 0 else 0.0

    total = 0.0
    for name, size in terms.items():
        if name == "qkv" and qkv_widths:
            total += sum(buffer(size * width / sum(qkv_widths)) for width in qkv_widths)
        else:
            total += buffer(size)
    return total


def _qkv_widths(model: ModelSpec, kind: LayerKind) -> tuple[int, ...]:
    """The widths of the query, key and value tensors the attention keeps (the "qkv" term): the query groups' keys
    and values beside the heads' queries; MLA's per-head queries, keys (with their RoPE part) and values."""
    if kind.mixer == "mla":
        qk, v = model.attention_widths(kind)
        return qk, qk, v
    return (model.q_size, model.kv_size, model.kv_size) if kind.mixer == "attention" else ()


def attention_buffer_bytes(model: ModelSpec, *, mbs: int, tp: int) -> float:
    """megatron-core's unfused DotProductAttention writes the raw scores, [b a/t, s, s] in bf16, into
    parallel_state's global memory buffer: allocated once per rank and kept across layers and steps,
    so it is not among any layer's saved activations. The fused kernels have no such buffer."""
    if model.fused_attention:
        return 0.0
    s = model.cfg.seq_length
    return BF16 * mbs * (model.cfg.num_attention_heads // tp) * s * s


def logits_bytes(model: ModelSpec, *, mbs: int, tp: int, cp: int) -> float:
    """The last stage's output: bf16 logits and the fp32 softmax the vocab-parallel cross
    entropy keeps (megatron-core tensor_parallel/cross_entropy.py), for one micro-batch; the fused
    cross entropy keeps only the logits' bf16 gradient, written over them. Each multi-token-prediction depth
    has logits and a loss of its own, all kept until the backward (gpt_model.py _postprocess)."""
    tokens = mbs * model.cfg.seq_length // cp
    per_logit = BF16 if model.numerics.cross_entropy_fusion else BF16 + FP32
    return (1 + model.mtp_depths) * per_logit * tokens * model.padded_vocab(tp) / tp
