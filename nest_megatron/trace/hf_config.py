"""A Hugging Face config.json on disk -> ModelConfig (Llama / Mistral, Mixtral, GPT-2, GPT-NeoX), and a MoE latent
size (moe_latent_size, NemotronH's key) where the file gives one.

Reads the JSON only: no download, no `transformers`. The architecture comes from the file; what
is a choice of the training run -- the sequence length, the attention kernel, the fusions, the
vocabulary padding -- stays as the composed model config has it (model.seq_length=...).
"""

from __future__ import annotations

import json
from pathlib import Path

from nest_megatron.config.schema import ModelConfig
from nest_megatron.errors import NestError

RUN_CHOICES = ("seq_length", "make_vocab_size_divisible_by", "attention_backend", "attention_softmax_in_fp32",
               "bias_swiglu_fusion", "source", "hf_config", "module", "family")


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


FAMILIES = {"llama": _llama, "mistral": _llama, "mixtral": _mixtral, "gpt2": _gpt2, "gpt_neox": _gpt_neox}


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

    fields = FAMILIES[model_type](data, get)
    if data.get("moe_latent_size") is not None:  # latent MoE, as NemotronH's config.json names it (megatron's name too)
        fields["moe_latent_size"] = get("moe_latent_size")
    name = str(data.get("_name_or_path") or Path(path).resolve().parent.name or model_type)
    kept = {key: getattr(base, key) for key in RUN_CHOICES}
    return ModelConfig(name=name, **fields, **kept)
