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
  hidden_dropout_masks       2 x 1 h T_sp      after attention and after the MLP (p > 0)

With fp8 GEMMs (model.numerics) the inputs of the linears (qkv_input, proj_input, fc1_input,
fc2_input, expert_input) are kept as Transformer Engine's 1-byte fp8 copies.

For Korthikanti's GPT (learned positions, bf16 softmax) these terms add up to exactly their
34 s b h + 5 a s^2 b; RoPE adds the new Q and K, 4 s b h. Selective recompute ("core_attn") drops the softmax and dropout terms and
keeps Q, K, V un-repeated as the checkpoint's inputs; full recompute keeps the layer input only.
"""

from __future__ import annotations

from nest_megatron.cost import fp8
from nest_megatron.model.spec import ModelSpec

BF16, FP32, MASK = 2, 4, 1

# Terms that selective recompute (core attention) does not keep.
CORE_ATTENTION_TERMS = ("softmax", "attention_dropout", "softmax_lse")
# The inputs of the linears (QKV, projection, FC1, FC2, the experts' FC1): kept in fp8 with fp8 GEMMs.
FP8_SAVED_INPUTS = ("qkv_input", "proj_input", "fc1_input", "fc2_input", "expert_input")


def _qkv_bytes(model: ModelSpec, *, tokens: float, tp: int, selective: bool) -> float:
    q, kv = model.q_size / tp, model.kv_size / tp
    if model.fused_attention:
        return BF16 * tokens * (q + 2 * kv)
    gqa = model.query_groups != model.heads
    if gqa and not selective:
        return BF16 * tokens * 3 * q  # Q, and K and V repeated to every head
    # Q and K are new tensors after RoPE or the GQA reshape, views of the QKV output otherwise;
    # the QKV output itself stays alive under V's view.
    fresh_qk = q + kv if gqa or model.cfg.position_embedding_type == "rope" else 0.0
    return BF16 * tokens * (fresh_qk + q + 2 * kv)


def layer_activation_terms(
    model: ModelSpec, *, mbs: int, tp: int, sp: bool, cp: int, moe: bool, etp: int = 1, selective: bool = False
) -> dict[str, float]:
    m = model.cfg
    h, s = model.h, m.seq_length
    tokens = mbs * s // cp
    tokens_sp = tokens / tp if sp else tokens
    heads = model.heads / tp
    terms = {
        "norm1_input": BF16 * h * tokens_sp,
        "qkv_input": BF16 * h * tokens_sp,
        "qkv": _qkv_bytes(model, tokens=tokens, tp=tp, selective=selective),
        "proj_input": BF16 * tokens * model.q_size / tp,
        "norm2_input": BF16 * h * tokens_sp,
        "fc1_input": BF16 * h * tokens_sp,
    }
    if model.fused_attention:
        terms["softmax_lse"] = FP32 * heads * tokens
    else:
        terms["softmax"] = (FP32 if m.attention_softmax_in_fp32 else BF16) * heads * tokens * s
        # What attention-over-values keeps: the dropped probabilities and the 1-byte mask; without
        # dropout, the bf16 cast of an fp32 softmax, or nothing more (the softmax output itself).
        dropped = MASK + BF16 if m.attention_dropout > 0 else BF16 if m.attention_softmax_in_fp32 else 0
        if dropped:
            terms["attention_dropout"] = dropped * heads * tokens * s
    if m.hidden_dropout > 0:
        terms["hidden_dropout_masks"] = 2 * MASK * h * tokens_sp
    if moe:
        # Each routed copy of a token goes through its expert's FC1, activation and FC2.
        rows, f, width = model.routed_rows(tokens=tokens, tp=tp, etp=etp), model.moe_ffn, etp
        terms["expert_input"] = BF16 * h * rows
    else:
        rows, f, width = tokens, m.ffn_hidden_size, tp
    terms["fc1_output"] = BF16 * rows * f * model.fc1_factor / width
    if m.swiglu and not m.bias_swiglu_fusion:
        terms["swiglu_unfused"] = 2 * BF16 * rows * f / width
        if moe:  # the routing weights multiply the activation's output, which that product keeps
            terms["expert_probs_input"] = BF16 * rows * f / width
    terms["fc2_input"] = BF16 * rows * f / width
    if model.numerics.fp8_recipe is not None:
        # Transformer Engine's fp8 linears keep their input as the fp8 copy the weight-gradient GEMM
        # reads (1 byte per element and its scales: cost/fp8.py saved_input_bytes), not in bf16.
        per_element = fp8.saved_input_bytes(model.numerics.fp8_recipe)
        for name in FP8_SAVED_INPUTS:
            if name in terms:
                terms[name] = terms[name] * per_element / BF16
    if selective:
        for name in CORE_ATTENTION_TERMS:
            terms.pop(name, None)
    return terms


def layer_activation_bytes(
    model: ModelSpec, *, mbs: int, tp: int, sp: bool, cp: int, moe: bool, etp: int = 1
) -> dict[str, float]:
    """Bytes kept per layer and micro-batch under each recompute setting.

    none / selective: what the layer keeps; full: the checkpointed layer input only.

    A traced model (ModelSpec.tracer) supplies what its layer really saves and hands on, traced at
    one sequence without context parallelism: both scale with the tokens (b s / cp), except the
    bytes the trace found fixed (an [s, s] mask, RoPE's cos/sin), which scale with 1 / cp only.
    What differs between sequence parallel on and off (when the trace's setting is not `sp`), and
    what selective recompute drops, come from the analytic terms.
    """
    args = dict(mbs=mbs, tp=tp, sp=sp, cp=cp, moe=moe, etp=etp)
    none = layer_activation_terms(model, **args)
    selective = layer_activation_terms(model, **args, selective=True)
    analytic = {"none": sum(none.values()), "selective": sum(selective.values()), "full": none["norm1_input"]}
    traced = model.traced_layer(tp=tp, etp=etp, moe=moe)
    if not traced:
        return analytic
    graph, layer = traced
    scale = mbs / (graph.micro_batch_size * cp)
    sp_change = analytic["none"] - sum(layer_activation_terms(model, **{**args, "sp": graph.sequence_parallel}).values())
    fixed = layer.fixed_saved_bytes
    kept = (layer.saved_bytes - fixed) * scale + fixed / cp + sp_change
    boundary = layer.boundary_bytes * scale * (tp if graph.sequence_parallel else 1) / (tp if sp else 1)
    return {"none": kept, "selective": kept - (analytic["none"] - analytic["selective"]), "full": boundary}


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
    cross entropy keeps only the logits' bf16 gradient, written over them."""
    tokens = mbs * model.cfg.seq_length // cp
    per_logit = BF16 if model.numerics.cross_entropy_fusion else BF16 + FP32
    return per_logit * tokens * model.padded_vocab(tp) / tp
