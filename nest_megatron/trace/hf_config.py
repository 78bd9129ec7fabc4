"""A Hugging Face config.json on disk -> ModelConfig: Llama / Mistral, Mixtral, Qwen3 and Qwen3 MoE, DeepSeek-V3 and
Kimi K2, GPT-OSS, Nemotron-H (hybrid Mamba, its MoE and latent MoE), GPT-2, GPT-NeoX.

Reads the JSON only: no download, no `transformers`. The keys, and the defaults of those a file leaves out, are those
of transformers' configuration classes (transformers 5.25.0 models/<family>/configuration_<family>.py), their meaning
that of its modeling files, cited per family. The architecture comes from the file; what is a choice of the training
run -- the sequence length, the attention kernel, the fusions, the vocabulary padding, the layer spec, the load
imbalance -- stays as the composed model config has it (model.seq_length=...). A shipped model's config.json gives
that shipped config's keys (tests/test_hf_configs.py).
"""

from __future__ import annotations

import json
from pathlib import Path

from nest_megatron.config.schema import ModelConfig
from nest_megatron.errors import NestError

RUN_CHOICES = ("seq_length", "make_vocab_size_divisible_by", "padded_vocab_size", "attention_backend",
               "attention_softmax_in_fp32", "bias_swiglu_fusion", "transformer_impl", "moe_load_imbalance",
               "moe_expert_capacity_factor", "moe_pad_expert_input_to_capacity", "mtp_loss_scaling_factor",
               "softmax_type", "source", "hf_config", "module", "family")


class Keys(dict):
    """A config.json's keys; `need` and `count` read an integer key or say, as a ValueError, what is wrong with it."""

    def need(self, key: str) -> int:
        """A positive integer the architecture cannot do without."""
        return self.count(key, None, minimum=1)

    def count(self, key: str, default: int | None, *, minimum: int = 0) -> int:
        """An integer of at least `minimum`; `default` where the file leaves the key out (None: it is needed)."""
        value = self.get(key, default)
        if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
            raise ValueError(f"needs {key} as an integer >= {minimum}, found {value!r}")
        return value


def _kv_channels(c: Keys, *, default: int | None = None) -> int | None:
    """Megatron's --kv-channels: the head dimension where it is not hidden / heads (None there)."""
    hidden, heads = c.need("hidden_size"), c.need("num_attention_heads")
    head_dim = c.get("head_dim") or c.get("attention_head_dim") or default or hidden // heads
    return head_dim if head_dim * heads != hidden else None


def _group_routing(c: Keys, *, groups: int, group_topk: int) -> dict:
    """Group-limited routing over n_group groups, top topk_group of them; none with one group."""
    groups = c.count("n_group", groups, minimum=1)
    return (dict(moe_router_num_groups=groups, moe_router_group_topk=c.count("topk_group", group_topk, minimum=1))
            if groups > 1 else {})


def _layer_freq(moe: list[bool]) -> int | list[int]:
    """Megatron's --moe-layer-freq for which layers have experts: 1 for every layer, else the 0/1 list."""
    return 1 if all(moe) else [int(x) for x in moe]


def _llama(c: Keys) -> dict:
    """Llama, Mistral (and Mixtral below): SwiGLU, RMSNorm, RoPE, grouped-query attention, no biases."""
    heads = c.need("num_attention_heads")
    return dict(
        num_layers=c.need("num_hidden_layers"), hidden_size=c.need("hidden_size"),
        ffn_hidden_size=c.need("intermediate_size"), num_attention_heads=heads,
        num_query_groups=c.get("num_key_value_heads") or heads, kv_channels=_kv_channels(c),
        vocab_size=c.need("vocab_size"), swiglu=True, normalization="RMSNorm", position_embedding_type="rope",
        add_bias_linear=bool(c.get("attention_bias", False) or c.get("mlp_bias", False)),
        untie_embeddings_and_output_weights=not c.get("tie_word_embeddings", False),
        hidden_dropout=0.0, attention_dropout=float(c.get("attention_dropout", 0.0)),
    )


def _mixtral(c: Keys) -> dict:
    return {**_llama(c), "num_experts": c.need("num_local_experts"), "moe_router_topk": c.need("num_experts_per_tok")}


def _gpt2(c: Keys) -> dict:
    """GPT-2: GELU MLP of n_inner (default 4 h), LayerNorm, learned positions, biases, tied head."""
    h = c.need("n_embd")
    return dict(
        num_layers=c.need("n_layer"), hidden_size=h, ffn_hidden_size=c.get("n_inner") or 4 * h,
        num_attention_heads=c.need("n_head"), vocab_size=c.need("vocab_size"), swiglu=False, normalization="LayerNorm",
        position_embedding_type="learned_absolute", add_bias_linear=True,
        untie_embeddings_and_output_weights=not c.get("tie_word_embeddings", True),
        hidden_dropout=float(c.get("resid_pdrop", 0.1)), attention_dropout=float(c.get("attn_pdrop", 0.1)),
    )


def _gpt_neox(c: Keys) -> dict:
    """GPT-NeoX / Pythia: GELU MLP, LayerNorm, RoPE, biases, untied head. Its parallel residual and
    partial rotary (rotary_pct) change no parameter or GEMM; megatron-core builds the sequential form."""
    return dict(
        num_layers=c.need("num_hidden_layers"), hidden_size=c.need("hidden_size"),
        ffn_hidden_size=c.need("intermediate_size"), num_attention_heads=c.need("num_attention_heads"),
        vocab_size=c.need("vocab_size"), swiglu=False, normalization="LayerNorm", position_embedding_type="rope",
        add_bias_linear=True, untie_embeddings_and_output_weights=not c.get("tie_word_embeddings", False),
        hidden_dropout=float(c.get("hidden_dropout", 0.0)), attention_dropout=float(c.get("attention_dropout", 0.0)),
    )


def _qwen3(c: Keys) -> dict:
    """Qwen3: Llama's blocks with RMSNorm on each head's queries and keys (modeling_qwen3.py q_norm, k_norm); its
    optional sliding window (use_sliding_window) is not priced."""
    if c.get("use_sliding_window"):
        raise ValueError("use_sliding_window true: Qwen3's sliding window over its lower layers is not priced")
    return {**_llama(c), "qk_layernorm": True}


def _qwen3_moe(c: Keys) -> dict:
    """Qwen3 MoE: Qwen3 with experts in layer i unless i is in mlp_only_layers or (i + 1) is off decoder_sparse_step
    (modeling_qwen3_moe.py:310-311); no shared expert."""
    layers, step = c.need("num_hidden_layers"), c.count("decoder_sparse_step", 1, minimum=1)
    dense = set(c.get("mlp_only_layers") or ())
    return {**_qwen3(c), "num_experts": c.need("num_experts"), "moe_router_topk": c.need("num_experts_per_tok"),
            "moe_ffn_hidden_size": c.need("moe_intermediate_size"),
            "moe_layer_freq": _layer_freq([i not in dense and (i + 1) % step == 0 for i in range(layers)])}


def _deepseek_v3(c: Keys) -> dict:
    """DeepSeek-V3, and Kimi K2 (its model_type kimi_k2 is DeepseekV3's architecture): multi-head latent attention
    with its latent norms (q_a_layernorm, kv_a_layernorm: Megatron's qk_layernorm with MLA); experts from layer
    first_k_dense_replace on (modeling_deepseek_v3.py:477), every moe_layer_freq-th of them (DeepSeek's own
    modeling_deepseek.py, which transformers leaves out); n_shared_experts shared experts as one MLP of
    n_shared_experts x moe_intermediate_size (:211); group-limited routing; num_nextn_predict_layers MTP depths
    (configuration_deepseek_v3.py attribute_map num_mtp_layers). Defaults: configuration_deepseek_v3.py:83-118."""
    layers, first, every = c.need("num_hidden_layers"), c.count("first_k_dense_replace", 3), c.count("moe_layer_freq", 1,
                                                                                                     minimum=1)
    shared, experts_ffn = c.count("n_shared_experts", 1), c.need("moe_intermediate_size")
    return dict(
        num_layers=layers, hidden_size=c.need("hidden_size"), ffn_hidden_size=c.need("intermediate_size"),
        num_attention_heads=c.need("num_attention_heads"), vocab_size=c.need("vocab_size"), swiglu=True,
        normalization="RMSNorm", position_embedding_type="rope", add_bias_linear=bool(c.get("attention_bias", False)),
        untie_embeddings_and_output_weights=not c.get("tie_word_embeddings", False), hidden_dropout=0.0,
        attention_dropout=float(c.get("attention_dropout", 0.0)), qk_layernorm=True, multi_latent_attention=True,
        q_lora_rank=c.get("q_lora_rank"), kv_lora_rank=c.need("kv_lora_rank"), qk_head_dim=c.need("qk_nope_head_dim"),
        qk_pos_emb_head_dim=c.need("qk_rope_head_dim"), v_head_dim=c.need("v_head_dim"),
        num_experts=c.need("n_routed_experts"), moe_router_topk=c.need("num_experts_per_tok"),
        moe_ffn_hidden_size=experts_ffn, moe_shared_expert_intermediate_size=shared * experts_ffn if shared else None,
        moe_layer_freq=_layer_freq([i >= first and i % every == 0 for i in range(layers)]),
        mtp_num_layers=c.count("num_nextn_predict_layers", 1) or None,
        **_group_routing(c, groups=8, group_topk=4),
    )


GPT_OSS_LAYERS = ("sliding_attention", "full_attention")


def _gpt_oss(c: Keys) -> dict:
    """GPT-OSS: Llama's attention with biases in every linear layer (attention_bias, also the experts'), experts of
    intermediate_size in every layer, and sliding-window attention where layer_types says (configuration_gpt_oss.py:
    84-87: every other layer, the first sliding, by default). A window of sliding_window tokens is the token and
    sliding_window - 1 before it (masking_utils.py sliding_window_overlay: kv_idx > q_idx - sliding_window):
    Megatron's window (W - 1, 0). Its attention sinks and clamped GLU are priced as plain attention and SwiGLU (the
    same GEMMs). Defaults: configuration_gpt_oss.py:51-77."""
    layers = c.need("num_hidden_layers")
    types = c.get("layer_types") or [GPT_OSS_LAYERS[(i + 1) % 2 == 0] for i in range(layers)]
    if len(types) != layers or set(types) - set(GPT_OSS_LAYERS):
        raise ValueError(f"layer_types: one of {', '.join(GPT_OSS_LAYERS)} for each of the {layers} layers")
    window, skip = _window(c.count("sliding_window", 128, minimum=2), [t == "sliding_attention" for t in types])
    return {**_llama(c), "kv_channels": _kv_channels(c, default=64), "add_bias_linear": bool(c.get("attention_bias", True)),
            "num_experts": c.need("num_local_experts"), "moe_router_topk": c.need("num_experts_per_tok"),
            "moe_ffn_hidden_size": c.need("intermediate_size"), "window_size": window, "window_attn_skip_freq": skip}


def _window(window: int, sliding: list[bool]) -> tuple[int | None, int | None]:
    """(window_size, window_attn_skip_freq) for the layers that slide over `window` tokens: Megatron's full attention
    on every N-th layer (layer l, counted from 1, when l % N == 0: transformer/utils.py is_layer_window_attention; no
    N: every layer slides)."""
    if not any(sliding):
        return None, None
    if all(sliding):
        return window - 1, None
    skip = next((n for n in range(2, len(sliding) + 1)
                 if all(slides != ((i + 1) % n == 0) for i, slides in enumerate(sliding))), None)
    if skip is None:
        raise ValueError("layer_types: the planner prices full attention every N-th layer and a window elsewhere")
    return window - 1, skip


# NemotronH's block names (configuration_nemotron_h.py _pattern_to_list; configuration_utils.py
# _LEGACY_LAYER_TYPE_REMAP's older names) -> Megatron's hybrid symbols
HYBRID_SYMBOL = {"linear_attention": "M", "mamba": "M", "full_attention": "*", "attention": "*", "mlp": "-", "moe": "E"}


def _nemotron_h(c: Keys) -> dict:
    """Nemotron-H: a hybrid stack, its blocks layers_block_type, else the Hub files' hybrid_override_pattern
    (configuration_nemotron_h.py:169-177); Mamba-2 mixers of mamba_num_heads x mamba_head_dim, state
    ssm_state_size, n_groups groups; squared-ReLU MLPs (mlp_hidden_act relu2); attention without position embedding
    or biases (modeling_nemotron_h.py:978-981); MoE layers of n_routed_experts with one shared MLP of
    moe_shared_expert_intermediate_size and an optional latent (:778, 828-833). Defaults: configuration_nemotron_h.py:
    98-152."""
    blocks = c.get("layers_block_type") or c.get("layer_types")
    if blocks:
        unknown = sorted({b for b in blocks if b not in HYBRID_SYMBOL})
        if unknown:
            raise ValueError(f"layers_block_type {unknown}: allowed are {', '.join(HYBRID_SYMBOL)}")
        pattern = "".join(HYBRID_SYMBOL[b] for b in blocks)
    else:
        pattern = c.get("hybrid_override_pattern") or ""
        if not pattern or set(pattern) - set(HYBRID_SYMBOL.values()):
            raise ValueError(f"hybrid_override_pattern {pattern!r}: one of {''.join(sorted(set(HYBRID_SYMBOL.values())))} "
                             "a layer")
    depth = _nemotron_h_mtp_depth(c)
    if c.get("mlp_hidden_act", "relu2") != "relu2":
        raise ValueError(f"mlp_hidden_act {c['mlp_hidden_act']!r}: the planner prices Nemotron-H's relu2 (squared ReLU) "
                         "MLPs")
    heads = c.need("num_attention_heads")
    fields = dict(
        num_layers=len(pattern), hybrid_layer_pattern=pattern, hidden_size=c.need("hidden_size"),
        ffn_hidden_size=c.need("intermediate_size"), squared_relu=True, swiglu=False, num_attention_heads=heads,
        num_query_groups=c.get("num_key_value_heads") or heads, kv_channels=_kv_channels(c, default=128),
        vocab_size=c.need("vocab_size"), mamba_state_dim=c.need("ssm_state_size"),
        mamba_head_dim=c.need("mamba_head_dim"), mamba_num_groups=c.need("n_groups"),
        mamba_num_heads=c.need("mamba_num_heads"),
        untie_embeddings_and_output_weights=not c.get("tie_word_embeddings", False), position_embedding_type="none",
        normalization="RMSNorm", add_bias_linear=bool(c.get("use_bias") or c.get("mlp_bias")), hidden_dropout=0.0,
        attention_dropout=float(c.get("attention_dropout", 0.0)),
    )
    if depth:
        fields |= dict(mtp_num_layers=c.count("num_nextn_predict_layers", 0), mtp_hybrid_pattern=depth)
    if "E" in pattern + depth:
        fields |= dict(num_experts=c.need("n_routed_experts"), moe_router_topk=c.need("num_experts_per_tok"),
                       moe_ffn_hidden_size=c.need("moe_intermediate_size"),
                       moe_shared_expert_intermediate_size=c.count("moe_shared_expert_intermediate_size", 7688) or None,
                       **_group_routing(c, groups=1, group_topk=1))
    return fields


def _nemotron_h_mtp_depth(c: Keys) -> str:
    """A Nemotron-H model's multi-token-prediction depth (num_nextn_predict_layers of them) as hybrid symbols: its
    mtp_layers_block_type, else mtp_hybrid_override_pattern (the key Megatron-Bridge's NemotronHBridge maps); '' with
    no depth. Whether one depth's layers serve every depth (Megatron's --mtp-use-repeated-layer) is the training
    recipe's, not the config's: model.mtp_use_repeated_layer."""
    if not c.get("num_nextn_predict_layers"):
        return ""
    blocks = c.get("mtp_layers_block_type")
    depth = "".join(HYBRID_SYMBOL.get(b, "?") for b in blocks) if blocks else c.get("mtp_hybrid_override_pattern") or ""
    if not depth or set(depth) - set(HYBRID_SYMBOL.values()):
        raise ValueError(f"num_nextn_predict_layers {c['num_nextn_predict_layers']} with MTP layers "
                         f"{blocks or depth!r}: give mtp_layers_block_type (e.g. ['attention', 'moe'])")
    return depth


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
    keys = Keys(read_hf_config(path))
    model_type = keys.get("model_type")
    if model_type not in FAMILIES:
        raise NestError(f"model.hf_config={path}: model_type {model_type!r} is not supported; "
                        f"supported are {', '.join(FAMILIES)}")
    try:
        fields = FAMILIES[model_type](keys)
        if keys.get("moe_latent_size") is not None:  # latent MoE, as NemotronH's config.json names it (megatron's too)
            fields["moe_latent_size"] = keys.need("moe_latent_size")
    except ValueError as err:  # a key the family reads, missing or of a shape the planner does not price
        raise NestError(f"model.hf_config={path}: {model_type} {err}") from None
    name = str(keys.get("_name_or_path") or Path(path).resolve().parent.name or model_type)
    kept = {key: getattr(base, key) for key in RUN_CHOICES}
    return ModelConfig(name=name, **fields, **kept)
