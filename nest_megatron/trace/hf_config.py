"""A Hugging Face config.json on disk -> ModelConfig: Llama / Mistral, Mixtral, Qwen3 and Qwen3 MoE, DeepSeek-V3 and
Kimi K2, GPT-OSS, Nemotron-H (hybrid Mamba, its MoE and latent MoE), GPT-2, GPT-NeoX.

Reads the JSON only: no download, no `transformers`. The keys are those of transformers' configuration classes
(transformers 5.25.0 models/<family>/configuration_<family>.py), their meaning that of its modeling files, cited
per family. The architecture comes from the file; what is a choice of the training run -- the sequence length, the
attention kernel, the fusions, the vocabulary padding, the layer spec -- stays as the composed model config has it
(model.seq_length=...). A shipped model's config.json gives that shipped config's keys (tests/test_hf_configs.py).
"""

from __future__ import annotations

import json
from pathlib import Path

from nest_megatron.config.schema import ModelConfig
from nest_megatron.errors import NestError

RUN_CHOICES = ("seq_length", "make_vocab_size_divisible_by", "attention_backend", "attention_softmax_in_fp32",
               "bias_swiglu_fusion", "transformer_impl", "source", "hf_config", "module", "family")


def _llama(c: dict, get) -> dict:
    """Llama, Mistral (and Mixtral below): SwiGLU, RMSNorm, RoPE, grouped-query attention, no biases."""
    heads = get("num_attention_heads")
    head_dim = c.get("head_dim") or get("hidden_size") // heads
    return dict(
        num_layers=get("num_hidden_layers"), hidden_size=get("hidden_size"), ffn_hidden_size=get("intermediate_size"),
        num_attention_heads=heads, num_query_groups=c.get("num_key_value_heads") or heads,
        kv_channels=head_dim if head_dim * heads != get("hidden_size") else None,
        vocab_size=get("vocab_size"), swiglu=True, normalization="RMSNorm", position_embedding_type="rope",
        add_bias_linear=bool(c.get("attention_bias", False) or c.get("mlp_bias", False)),
        untie_embeddings_and_output_weights=not c.get("tie_word_embeddings", False),
        hidden_dropout=0.0, attention_dropout=float(c.get("attention_dropout", 0.0)),
    )


def _mixtral(c: dict, get) -> dict:
    return {**_llama(c, get), "num_experts": get("num_local_experts"), "moe_router_topk": get("num_experts_per_tok")}


def _gpt2(c: dict, get) -> dict:
    """GPT-2: GELU MLP of n_inner (default 4 h), LayerNorm, learned positions, biases, tied head."""
    h = get("n_embd")
    return dict(
        num_layers=get("n_layer"), hidden_size=h, ffn_hidden_size=c.get("n_inner") or 4 * h,
        num_attention_heads=get("n_head"), vocab_size=get("vocab_size"), swiglu=False, normalization="LayerNorm",
        position_embedding_type="learned_absolute", add_bias_linear=True,
        untie_embeddings_and_output_weights=not c.get("tie_word_embeddings", True),
        hidden_dropout=float(c.get("resid_pdrop", 0.1)), attention_dropout=float(c.get("attn_pdrop", 0.1)),
    )


def _gpt_neox(c: dict, get) -> dict:
    """GPT-NeoX / Pythia: GELU MLP, LayerNorm, RoPE, biases, untied head. Its parallel residual and
    partial rotary (rotary_pct) change no parameter or GEMM; megatron-core builds the sequential form."""
    return dict(
        num_layers=get("num_hidden_layers"), hidden_size=get("hidden_size"), ffn_hidden_size=get("intermediate_size"),
        num_attention_heads=get("num_attention_heads"), vocab_size=get("vocab_size"), swiglu=False,
        normalization="LayerNorm", position_embedding_type="rope", add_bias_linear=True,
        untie_embeddings_and_output_weights=not c.get("tie_word_embeddings", False),
        hidden_dropout=float(c.get("hidden_dropout", 0.0)), attention_dropout=float(c.get("attention_dropout", 0.0)),
    )


def _qwen3(c: dict, get) -> dict:
    """Qwen3: Llama's blocks with RMSNorm on each head's queries and keys (modeling_qwen3.py q_norm, k_norm)."""
    return {**_llama(c, get), "qk_layernorm": True}


def _qwen3_moe(c: dict, get) -> dict:
    """Qwen3 MoE: Qwen3 with experts in layer i unless i is in mlp_only_layers or (i + 1) is off decoder_sparse_step
    (modeling_qwen3_moe.py:310-311); no shared expert."""
    layers = get("num_hidden_layers")
    step, dense = c.get("decoder_sparse_step", 1), set(c.get("mlp_only_layers") or ())
    return {**_qwen3(c, get), "num_experts": get("num_experts"), "moe_router_topk": get("num_experts_per_tok"),
            "moe_ffn_hidden_size": get("moe_intermediate_size"),
            "moe_layer_freq": _layer_freq([i not in dense and (i + 1) % step == 0 for i in range(layers)])}


def _deepseek_v3(c: dict, get) -> dict:
    """DeepSeek-V3, and Kimi K2 (its model_type kimi_k2 is DeepseekV3's architecture): multi-head latent attention
    with its latent norms (q_a_layernorm, kv_a_layernorm: Megatron's qk_layernorm with MLA), the first
    first_k_dense_replace layers dense (modeling_deepseek_v3.py:477), n_shared_experts shared experts as one MLP of
    n_shared_experts x moe_intermediate_size (:211), group-limited routing over n_group groups, top topk_group,
    num_nextn_predict_layers MTP depths (configuration_deepseek_v3.py attribute_map num_mtp_layers)."""
    layers, shared = get("num_hidden_layers"), c.get("n_shared_experts") or 0
    groups = c.get("n_group") or 1
    return dict(
        num_layers=layers, hidden_size=get("hidden_size"), ffn_hidden_size=get("intermediate_size"),
        num_attention_heads=get("num_attention_heads"), vocab_size=get("vocab_size"), swiglu=True,
        normalization="RMSNorm", position_embedding_type="rope", add_bias_linear=bool(c.get("attention_bias", False)),
        untie_embeddings_and_output_weights=not c.get("tie_word_embeddings", False), hidden_dropout=0.0,
        attention_dropout=float(c.get("attention_dropout", 0.0)), qk_layernorm=True, multi_latent_attention=True,
        q_lora_rank=c.get("q_lora_rank"), kv_lora_rank=get("kv_lora_rank"), qk_head_dim=get("qk_nope_head_dim"),
        qk_pos_emb_head_dim=get("qk_rope_head_dim"), v_head_dim=get("v_head_dim"),
        num_experts=get("n_routed_experts"), moe_router_topk=get("num_experts_per_tok"),
        moe_ffn_hidden_size=get("moe_intermediate_size"),
        moe_shared_expert_intermediate_size=shared * get("moe_intermediate_size") if shared else None,
        moe_layer_freq=_layer_freq([i >= c.get("first_k_dense_replace", 0) for i in range(layers)]),
        moe_router_num_groups=groups if groups > 1 else None,
        moe_router_group_topk=c.get("topk_group") if groups > 1 else None,
        mtp_num_layers=c.get("num_nextn_predict_layers") or None,
    )


def _gpt_oss(c: dict, get) -> dict:
    """GPT-OSS: experts of intermediate_size in every layer, biases in every linear layer (attention_bias), and
    sliding-window attention where layer_types says (configuration_gpt_oss.py:84-87: every other layer, the first
    sliding, by default). A window of sliding_window tokens is the token and sliding_window - 1 before it
    (masking_utils.py sliding_window_overlay: kv_idx > q_idx - sliding_window): Megatron's window (W - 1, 0). Its
    attention sinks and clamped GLU are priced as plain attention and SwiGLU (the same GEMMs)."""
    layers, heads = get("num_hidden_layers"), get("num_attention_heads")
    head_dim = c.get("head_dim") or get("hidden_size") // heads
    types = c.get("layer_types") or ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)]
    window, skip = _window(c, [t == "sliding_attention" for t in types])
    return dict(
        num_layers=layers, hidden_size=get("hidden_size"), ffn_hidden_size=get("intermediate_size"),
        num_attention_heads=heads, num_query_groups=c.get("num_key_value_heads") or heads,
        kv_channels=head_dim if head_dim * heads != get("hidden_size") else None, vocab_size=get("vocab_size"),
        swiglu=True, normalization="RMSNorm", position_embedding_type="rope",
        add_bias_linear=bool(c.get("attention_bias", True)),
        untie_embeddings_and_output_weights=not c.get("tie_word_embeddings", False), hidden_dropout=0.0,
        attention_dropout=float(c.get("attention_dropout", 0.0)), num_experts=get("num_local_experts"),
        moe_router_topk=get("num_experts_per_tok"), moe_ffn_hidden_size=get("intermediate_size"),
        window_size=window, window_attn_skip_freq=skip,
    )


# NemotronH's block names (configuration_nemotron_h.py _pattern_to_list; configuration_utils.py
# _LEGACY_LAYER_TYPE_REMAP's older names) -> Megatron's hybrid symbols
HYBRID_SYMBOL = {"linear_attention": "M", "mamba": "M", "full_attention": "*", "attention": "*", "mlp": "-", "moe": "E"}


def _nemotron_h(c: dict, get) -> dict:
    """Nemotron-H: a hybrid stack, its pattern hybrid_override_pattern (the Hub's files) or layers_block_type
    (configuration_nemotron_h.py:100, 169-177); Mamba-2 mixers of mamba_num_heads x mamba_head_dim, state
    ssm_state_size, n_groups groups; squared-ReLU MLPs (mlp_hidden_act relu2); no position embedding; MoE layers of
    n_routed_experts with one shared MLP of moe_shared_expert_intermediate_size and an optional latent
    (modeling_nemotron_h.py:778, 828-833)."""
    pattern = c.get("hybrid_override_pattern")
    if pattern is None:
        blocks = c.get("layers_block_type") or c.get("layer_types") or []
        unknown = sorted({b for b in blocks if b not in HYBRID_SYMBOL})
        if unknown or not blocks:
            raise ValueError(f"layers_block_type {unknown or blocks}: allowed are {', '.join(HYBRID_SYMBOL)}")
        pattern = "".join(HYBRID_SYMBOL[b] for b in blocks)
    if c.get("num_nextn_predict_layers"):
        raise ValueError(f"num_nextn_predict_layers {c['num_nextn_predict_layers']}: multi-token prediction in a "
                         "hybrid stack is not in the cost model")
    heads = get("num_attention_heads")
    head_dim = c.get("head_dim") or c.get("attention_head_dim") or get("hidden_size") // heads
    act = c.get("mlp_hidden_act", "relu2")
    if act != "relu2":
        raise ValueError(f"mlp_hidden_act {act!r}: the planner prices Nemotron-H's relu2 (squared ReLU) MLPs")
    fields = dict(
        num_layers=len(pattern), hybrid_layer_pattern=pattern, hidden_size=get("hidden_size"),
        ffn_hidden_size=get("intermediate_size"), squared_relu=True, swiglu=False, num_attention_heads=heads,
        num_query_groups=c.get("num_key_value_heads") or heads,
        kv_channels=head_dim if head_dim * heads != get("hidden_size") else None, vocab_size=get("vocab_size"),
        mamba_state_dim=get("ssm_state_size"), mamba_head_dim=get("mamba_head_dim"), mamba_num_groups=get("n_groups"),
        mamba_num_heads=get("mamba_num_heads"), untie_embeddings_and_output_weights=not c.get("tie_word_embeddings", False),
        position_embedding_type="none", normalization="RMSNorm",
        add_bias_linear=bool(c.get("use_bias") or c.get("mlp_bias") or c.get("attention_bias")),
        hidden_dropout=0.0, attention_dropout=float(c.get("attention_dropout", 0.0)),
    )
    if "E" in pattern:
        groups = c.get("n_group") or 1
        fields |= dict(num_experts=get("n_routed_experts"), moe_router_topk=get("num_experts_per_tok"),
                       moe_ffn_hidden_size=get("moe_intermediate_size"),
                       moe_shared_expert_intermediate_size=c.get("moe_shared_expert_intermediate_size") or None,
                       moe_router_num_groups=groups if groups > 1 else None,
                       moe_router_group_topk=c.get("topk_group") if groups > 1 else None)
    return fields


def _layer_freq(moe: list[bool]) -> int | list[int]:
    """Megatron's --moe-layer-freq for which layers have experts: 1 for every layer, else the 0/1 list."""
    return 1 if all(moe) else [int(x) for x in moe]


def _window(c: dict, sliding: list[bool]) -> tuple[int | None, int | None]:
    """(window_size, window_attn_skip_freq) for the layers that slide: Megatron's full attention every N-th layer
    (layer l, counted from 1, when l % N == 0; no N: every layer slides)."""
    if not any(sliding):
        return None, None
    window = c.get("sliding_window")
    if not isinstance(window, int) or window < 2:
        raise ValueError(f"sliding_window {window!r}: a positive window of at least 2 tokens")
    if all(sliding):
        return window - 1, None
    skip = next((n for n in range(2, len(sliding) + 1)
                 if all(slides != ((i + 1) % n == 0) for i, slides in enumerate(sliding))), None)
    if skip is None:
        raise ValueError("layer_types: the planner prices full attention every N-th layer and a window elsewhere")
    return window - 1, skip


FAMILIES = {"llama": _llama, "mistral": _llama, "mixtral": _mixtral, "qwen3": _qwen3, "qwen3_moe": _qwen3_moe,
            "deepseek_v3": _deepseek_v3, "kimi_k2": _deepseek_v3, "gpt_oss": _gpt_oss, "nemotron_h": _nemotron_h,
            "gpt2": _gpt2, "gpt_neox": _gpt_neox}


def read_hf_config(path: str | Path) -> dict:
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise NestError(f"model.hf_config={path}: no such file (a Hugging Face config.json)") from None
    except (OSError, UnicodeDecodeError) as err:
        raise NestError(f"model.hf_config={path}: cannot read it ({err})") from None
    except json.JSONDecodeError as err:
        raise NestError(f"model.hf_config={path}: not JSON ({err})") from None
    if not isinstance(data, dict):
        raise NestError(f"model.hf_config={path}: a config.json holds one JSON object")
    return data


def model_config_from_hf(path: str | Path, base: ModelConfig) -> ModelConfig:
    """`base` with its architecture replaced by the one the config.json at `path` describes."""
    data = read_hf_config(path)
    model_type = data.get("model_type")
    if model_type not in FAMILIES:
        raise NestError(f"model.hf_config={path}: model_type {model_type!r} is not supported; "
                        f"supported are {', '.join(FAMILIES)}")

    def get(key: str):
        value = data.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise NestError(f"model.hf_config={path}: {model_type} needs {key} as a positive integer, found {value!r}")
        return value

    try:
        fields = FAMILIES[model_type](data, get)
    except ValueError as err:  # a key the family reads, of a shape the planner does not price
        raise NestError(f"model.hf_config={path}: {model_type} {err}") from None
    if data.get("moe_latent_size") is not None:  # latent MoE, as NemotronH's config.json names it (megatron's name too)
        fields["moe_latent_size"] = get("moe_latent_size")
    name = str(data.get("_name_or_path") or Path(path).resolve().parent.name or model_type)
    kept = {key: getattr(base, key) for key in RUN_CHOICES}
    return ModelConfig(name=name, **fields, **kept)
