"""Megatron-LM's model FLOPs per iteration, the numerator of its TFLOP/s and MFU.

A transcription of `num_floating_point_operations` (transformer_flops) in megatron/training/training.py
at d98e8a6: every GEMM counted 3 times (forward, dgrad, wgrad) x 2 FLOPs per multiply-add, per token;
the attention square per sequence with half of it for a causal mask. Per decoder layer of each kind
(model/kinds.py): the mixer's projections (standard attention's QKV and output; MLA's latent, up and output
projections with Megatron's "+1" per latent for its norm), the dense MLP or the routed experts (topk of them; with
--moe-latent-size at the latent width, plus the two latent projections, 2 h L: training.py:1267-1280 at d98e8a6, and
hybrid_flops' moe_layer_flops :846-860, alike) and the shared expert; a Mamba-2 mixer as Megatron's mamba_layer_flops counts it (in_proj, the scan, out_proj, at
d_in = 2 h whatever mamba_num_heads; hybrid_flops :964); the multi-token-prediction depths count as layers of the decoder's last kind, with
their norms and eh_proj, and one more pass of the output layer each.
"""

from __future__ import annotations

from nest_megatron.model.kinds import LayerKind
from nest_megatron.model.spec import ModelSpec

GEMM_PASSES = 3 * 2  # forward, dgrad, wgrad; 2 FLOPs per multiply-add


def megatron_model_flops(model: ModelSpec, *, batch_size: int, tp: int) -> float:
    m = model.cfg
    h, s = m.hidden_size, m.seq_length
    causal = 0.5 if m.family == "gpt" else 1.0
    depths = model.mtp_depths
    layers = dict(model.kind_counts)  # kind -> layers of it run, with every depth's
    for kind in model.mtp_depth_kinds:
        layers[kind] = layers.get(kind, 0) + depths
    per_token = sum(n * (_mixer_linear(model, kind) + _mlp(model, kind)) for kind, n in layers.items())
    per_sequence_square = sum(n * GEMM_PASSES * causal * sum(model.attention_widths(kind)) for kind, n in layers.items())
    per_token += GEMM_PASSES * depths * (3 * h + 2 * h * h)  # the depths' enorm, hnorm, final norm; eh_proj
    per_token += GEMM_PASSES * h * model.padded_vocab(tp) * (1 + depths)  # the logits, once per depth more
    return batch_size * s * per_token + batch_size * s * s * per_sequence_square


def _mixer_linear(model: ModelSpec, kind: LayerKind) -> float:
    """The mixer's projection FLOPs per token."""
    m, h = model.cfg, model.cfg.hidden_size
    if kind.mixer == "attention":
        return GEMM_PASSES * (h * (model.q_size + 2 * model.kv_size) + model.q_size * h)
    if kind.mixer == "mamba":  # training.py:885-903: 2 x in_proj + 7 d_in state (the scan) + 2 x out_proj, x 3
        d_in, groups, state = 2 * h, m.mamba_num_groups, m.mamba_state_dim
        per_pass = 2 * h * (2 * d_in + 2 * groups * state + model.mamba_heads) + 7 * d_in * state + 2 * d_in * h
        return 3 * per_pass
    if kind.mixer != "mla":
        return 0.0
    heads, q_head = m.num_attention_heads, model.mla_qk_head_dim
    if m.q_lora_rank is None:
        q = h * heads * q_head
    else:
        q = m.q_lora_rank * (h + heads * q_head + 1)
    kv = m.kv_lora_rank * (h + heads * (m.qk_head_dim + m.v_head_dim) + 1) + h * m.qk_pos_emb_head_dim
    return GEMM_PASSES * (q + kv + heads * m.v_head_dim * h)


def _mlp(model: ModelSpec, kind: LayerKind) -> float:
    """The MLP's FLOPs per token: the dense MLP, or topk routed experts and the shared expert."""
    m, h = model.cfg, model.cfg.hidden_size
    ffn_factor = 3 if m.swiglu else 2  # h -> 2f and f -> h GEMMs with SwiGLU, h -> f and f -> h without
    if kind.mlp == "dense":
        return GEMM_PASSES * h * m.ffn_hidden_size * ffn_factor
    if kind.mlp != "moe":
        return 0.0
    shared = m.moe_shared_expert_intermediate_size or 0
    routed = model.moe_token_width * model.moe_ffn * m.moe_router_topk * ffn_factor  # at the latent width, if any
    latent = 2 * h * m.moe_latent_size if m.moe_latent_size else 0  # fc1_latent_proj and fc2_latent_proj
    return GEMM_PASSES * (routed + latent + h * shared * ffn_factor)
