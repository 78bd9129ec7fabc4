"""ModelConfig -> megatron-core TransformerConfig: the one converter (tracing, the agreement tests).

Optional ModelConfig fields pass through as None so that megatron applies its own defaults
(num_query_groups = heads, kv_channels = h / heads, moe_ffn_hidden_size = ffn_hidden_size), which
is what ModelSpec assumes. Fused kernels that need CUDA, Apex or Transformer Engine are off, so
that every op runs in plain torch on CPU and on the meta device.
"""

from __future__ import annotations

from nest_megatron.config.schema import ModelConfig


def transformer_config(cfg: ModelConfig, *, tp: int = 1, pp: int = 1, ep: int = 1, etp: int | None = None,
                       num_layers: int | None = None, sequence_parallel: bool = False, **settings):
    """megatron-core's TransformerConfig for `cfg` on a TP x PP x EP (x expert-TP) grid; `settings`
    are further TransformerConfig fields (recompute_granularity=..., perform_initialization=True).

    sequence_parallel changes no parameter count; without Apex the local spec's torch norms
    (WrappedTorchNorm) accept it only through trace/cpu_megatron.py's patch 8. (megatron-core
    checks SP with MoE and TP > 1 in the forward pass, MoELayer.forward; Megatron-LM's argument
    parser requires it.)
    """
    import torch
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    fields = dict(
        num_layers=num_layers or cfg.num_layers,
        hidden_size=cfg.hidden_size,
        ffn_hidden_size=cfg.ffn_hidden_size,
        num_attention_heads=cfg.num_attention_heads,
        num_query_groups=cfg.num_query_groups,
        kv_channels=cfg.kv_channels,
        add_bias_linear=cfg.add_bias_linear,
        gated_linear_unit=cfg.swiglu,
        activation_func=F.silu if cfg.swiglu else F.gelu,
        normalization=cfg.normalization,
        hidden_dropout=cfg.hidden_dropout,
        attention_dropout=cfg.attention_dropout,
        attention_softmax_in_fp32=cfg.attention_softmax_in_fp32,
        softmax_type=cfg.softmax_type,  # learnable: a per-head softmax_offset parameter
        params_dtype=torch.bfloat16,
        pipeline_dtype=torch.bfloat16,
        bf16=True,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
        sequence_parallel=sequence_parallel,
        num_moe_experts=cfg.num_experts,
        moe_router_topk=cfg.moe_router_topk,
        moe_ffn_hidden_size=cfg.moe_ffn_hidden_size,
        moe_layer_freq=cfg.moe_layer_freq if isinstance(cfg.moe_layer_freq, int) else list(cfg.moe_layer_freq),
        moe_shared_expert_intermediate_size=cfg.moe_shared_expert_intermediate_size,
        moe_latent_size=cfg.moe_latent_size,
        moe_router_num_groups=cfg.moe_router_num_groups,
        moe_router_group_topk=cfg.moe_router_group_topk,
        moe_grouped_gemm=False,
        qk_layernorm=cfg.qk_layernorm,
        mtp_num_layers=cfg.mtp_num_layers,
        mtp_loss_scaling_factor=cfg.mtp_loss_scaling_factor,
        # Plain torch code paths (the fused ones need CUDA, Apex or Transformer Engine).
        apply_rope_fusion=False,
        bias_dropout_fusion=False,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        # Allocate with plain torch.empty (no device argument, so a `with torch.device("meta")`
        # block applies) and skip the initialisation: only shapes are needed.
        use_cpu_initialization=True,
        perform_initialization=False,
    )
    if cfg.multi_latent_attention:  # MLATransformerConfig (transformer_config.py), RoPE on the decoupled dims
        fields |= dict(q_lora_rank=cfg.q_lora_rank, kv_lora_rank=cfg.kv_lora_rank, qk_head_dim=cfg.qk_head_dim,
                       qk_pos_emb_head_dim=cfg.qk_pos_emb_head_dim, v_head_dim=cfg.v_head_dim, rope_type="rope")
        return MLATransformerConfig(**{**fields, **settings})
    return TransformerConfig(**{**fields, **settings})
