"""Megatron-LM's model FLOPs per iteration, the numerator of its TFLOP/s and MFU.

A transcription of `num_floating_point_operations` in megatron/training/training.py (Megatron-LM
main, 2025-): 12 = 3 (forward, dgrad, wgrad) x 2 (two GEMMs of a size per block) x 2 (FLOPs per
multiply-add), with half of the attention square counted for a causal mask.
"""

from __future__ import annotations

from nest_megatron.model.spec import ModelSpec


def megatron_model_flops(model: ModelSpec, *, batch_size: int, tp: int) -> float:
    m = model.cfg
    h, s, layers = m.hidden_size, m.seq_length, m.num_layers
    glu = 1.5 if m.swiglu else 1.0
    causal_ratio = 0.5 if m.family == "gpt" else 1.0
    if model.is_moe:
        mlp = model.moe_ffn * m.moe_router_topk * glu + (m.moe_shared_expert_intermediate_size or 0) * glu
    else:
        mlp = m.ffn_hidden_size * glu
    attention = (1 + model.query_groups / model.heads + s / h * causal_ratio) * (model.q_size / h)
    return (
        batch_size
        * s
        * (12 * layers * h * mlp + 12 * layers * h * h * attention + 6 * h * model.padded_vocab(tp))
    )
