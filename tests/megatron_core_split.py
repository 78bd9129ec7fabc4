"""The layers each model chunk builds, as megatron-core 0.16.1 computes them: its TransformerConfig checks the split
flags (__post_init__), then for every pipeline rank and virtual stage get_num_layers_to_build and
get_transformer_layer_offset run with megatron-core's parallel_state set to that rank (its own setters, which is all
those functions read of the process groups), on CPU."""

from __future__ import annotations

import warnings

import torch

# Megatron-LM's flags -> TransformerConfig fields (megatron/training/argument_utils.py:310-311 for first / last)
FIELD_OF_FLAG = {
    "--account-for-embedding-in-pipeline-split": "account_for_embedding_in_pipeline_split",
    "--account-for-loss-in-pipeline-split": "account_for_loss_in_pipeline_split",
    "--decoder-first-pipeline-num-layers": "num_layers_in_first_pipeline_stage",
    "--decoder-last-pipeline-num-layers": "num_layers_in_last_pipeline_stage",
    "--pipeline-model-parallel-layout": "pipeline_model_parallel_layout",
    "--num-virtual-stages-per-pipeline-rank": "virtual_pipeline_model_parallel_size",
}


def split_flags(args: list[str]) -> list[str]:
    """The split's flags of an argv and their values, in order."""
    out = []
    for i, token in enumerate(args):
        if token in FIELD_OF_FLAG:
            out += [token] if token.startswith("--account-for") else [token, args[i + 1]]
    return out


def split_fields(args: list[str]) -> dict:
    """The TransformerConfig fields an argv's split flags set (store_true flags take no value)."""
    out, i = {}, 0
    while i < len(args):
        name = FIELD_OF_FLAG.get(args[i])
        if name is None:
            i += 1
        elif name.startswith("account_for"):
            out[name], i = True, i + 1
        else:
            value = args[i + 1]
            out[name], i = (value if name == "pipeline_model_parallel_layout" else int(value)), i + 2
    return out


def megatron_core_chunks(num_layers: int, pp: int, **fields) -> tuple[tuple[int, int], ...] | Exception:
    """(layers, offset of the first) of each of the pp*vpp chunks in Megatron's order (chunk k*pp + rank), as
    megatron-core builds them for `fields` (TransformerConfig's: the split and virtual_pipeline_model_parallel_size);
    the exception megatron-core raises instead when it refuses them."""
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cfg = TransformerConfig(num_layers=num_layers, hidden_size=64, num_attention_heads=4,
                                    pipeline_model_parallel_size=pp, pipeline_dtype=torch.bfloat16, **fields)
        vpp = cfg.virtual_pipeline_model_parallel_size  # a layout sets it
        ps.set_virtual_pipeline_model_parallel_world_size(vpp)
        out = []
        for chunk in range(pp * (vpp or 1)):
            rank, stage = chunk % pp, (chunk // pp if vpp else None)
            ps.set_pipeline_model_parallel_rank(rank)
            out.append((get_num_layers_to_build(cfg, vp_stage=stage, pp_rank=rank),
                        get_transformer_layer_offset(cfg, vp_stage=stage, pp_rank=rank)))
        return tuple(out)
    except (ValueError, AssertionError, ZeroDivisionError) as err:
        return err
    finally:
        ps.set_virtual_pipeline_model_parallel_world_size(None)
        ps.set_pipeline_model_parallel_rank(None)
