"""Megatron's selective recompute modules (--recompute-granularity selective --recompute-modules ...): for each,
the activations a layer stops keeping (cost/activations.py's term names) and the forward work and communication
it runs again in the backward (LayerTime.fwd_parts and fwd_comm_parts names). Read at megatron-core 0.16.1:

  core_attn       attention.py:330 / multi_latent_attention.py:279 (tensor_parallel.checkpoint of core
                  attention): the softmax, its dropout and flash's log-sum-exp go; Q, K, V stay as its inputs.
                  Runs again: the attention kernel and an unfused softmax.
  layernorm       transformer_layer.py:383-438, 576-611, 671-676, 797-800 (CheckpointWithoutOutput: the norm's
                  output freed after its consumers ran). Only a norm that is a module of its own: with Transformer
                  Engine's spec the input norm is fused into linear_qkv (TELayerNormColumnParallelLinear) but for
                  MLA, and the pre-MLP norm into linear_fc1 but for MoE (gpt_layer_specs.py:248, 265, 291); the
                  local spec has both. Drops the normed tensor the next linears keep (qkv_input / mla_down_input,
                  fc1_input: for MoE the router's and shared expert's input). Runs again: the norm.
  mlp             transformer_layer.py:445-447, 719-740 (tensor_parallel.checkpoint of a dense MLP; not of MoE):
                  keeps its input (the normed tensor; with TE's fused norm the block's input, the norm inside).
                  Drops FC1's output, the activation's and FC2's input. Runs again: FC1, the activation, FC2 (with
                  TE the norm) and the block's TP collectives.
  moe             moe/moe_layer.py:153-157, 432-450 (tensor_parallel.checkpoint of the MoE layer): keeps its input.
                  Drops the experts' inputs and everything after them, the shared expert's, a latent MoE's
                  fc2_latent_proj input. Runs again: the router, the permutation, the experts, the shared expert,
                  the dispatch / combine exchanges and a latent MoE's two projections (preprocess and postprocess,
                  :264-270, 339-345, run inside the checkpointed custom_forward, :389-430).
  moe_act         moe/experts.py:588-592, 738-750 (CheckpointWithoutOutput around the experts' activation; needs
                  --moe-grouped-gemm, TEGroupedMLP): drops FC2's input (and an unfused activation's and routing
                  product's). Runs again: the experts' activation.
  shared_experts  moe/moe_layer.py:158-161, 290-310 (tensor_parallel.checkpoint of the shared expert): drops its FC1
                  output, activation and FC2 input. Runs again: its FC1, FC2 and TP collectives.
  mla_up_proj     multi_latent_attention.py:119-122, 838-845, 344-347 (CheckpointWithoutOutput of the up projections
                  and RoPE, freed after core attention): drops the Q, K, V they make (the latents stay). Runs again:
                  the query and KV up projections (with --qk-layernorm their latent norms, fused into them), the
                  Q/K/V assembly and the gather of the latents over TP.

Not priced: the fp8 casts of the recomputed GEMMs' inputs, and the norms' fp32 statistics (4 B a token).
"""

from __future__ import annotations

from nest_megatron.model.kinds import LayerKind
from nest_megatron.model.spec import ModelSpec
from nest_megatron.parallel.config import RECOMPUTE_MODULES
from nest_megatron.parallel.rules import module_problem

CORE_ATTENTION_TERMS = ("softmax", "attention_dropout", "softmax_lse")
# The mixers with a core attention that "core_attn" recomputes (attention.py's checkpoint; a Mamba mixer has none).
ATTENTION_MIXERS = ("attention", "mla")
MLP_TERMS = ("fc1_output", "swiglu_unfused", "fc2_input")
SHARED_EXPERT_TERMS = ("shared_fc1_output", "shared_swiglu_unfused", "shared_fc2_input")


def separate_norms(model: ModelSpec, kind: LayerKind) -> tuple[bool, bool]:
    """(input norm, pre-MLP norm): whether each is a module of its own (which "layernorm" can recompute), not fused
    into the next linear as Transformer Engine's spec fuses it (gpt_layer_specs.py:248, 265, 291)."""
    if model.cfg.transformer_impl == "local":
        return kind.mixer != "none", kind.mlp != "none"
    return kind.mixer == "mla", kind.mlp == "moe"


def dropped_terms(model: ModelSpec, kind: LayerKind, modules: tuple[str, ...]) -> set[str]:
    """The activation terms (cost/activations.py) a layer of `kind` no longer keeps with `modules` recomputed."""
    input_norm, mlp_norm = separate_norms(model, kind)
    dropped = set()
    if "core_attn" in modules:
        dropped |= set(CORE_ATTENTION_TERMS)
    if "layernorm" in modules:
        dropped |= {"qkv_input", "mla_down_input"} if input_norm else set()
        dropped |= {"fc1_input"} if mlp_norm else set()
    if "mla_up_proj" in modules and kind.mixer == "mla":
        dropped.add("qkv")
    if kind.mlp == "dense" and "mlp" in modules:
        dropped |= set(MLP_TERMS) | (set() if mlp_norm else {"fc1_input"})  # TE: the norm inside the checkpoint
    if kind.mlp == "moe":
        if "moe" in modules:
            dropped |= {"expert_input", "expert_probs_input", "latent_fc2_input", *MLP_TERMS, *SHARED_EXPERT_TERMS}
        if "moe_act" in modules:
            dropped |= {"fc2_input", "swiglu_unfused", "expert_probs_input"}
        if "shared_experts" in modules:
            dropped |= set(SHARED_EXPERT_TERMS)
    return dropped


def rerun_parts(model: ModelSpec, kind: LayerKind, modules: tuple[str, ...]) -> set[str]:
    """The forward parts (LayerTime.fwd_parts, fwd_comm_parts) a layer of `kind` runs again with `modules`."""
    input_norm, mlp_norm = separate_norms(model, kind)
    parts = set()
    if "core_attn" in modules and kind.mixer in ATTENTION_MIXERS:
        parts |= {"core_attention", "softmax"}
    if "layernorm" in modules:
        parts |= {"norm1"} if input_norm else set()
        parts |= {"norm2"} if mlp_norm else set()
    if "mla_up_proj" in modules and kind.mixer == "mla":
        parts |= {"q_up", "q_proj", "kv_up", "mla_assembly", "mla_latent_norms", "tp:mla:column"}
    if kind.mlp == "dense" and "mlp" in modules:
        parts |= {"fc1", "fc2", "mlp_act", "tp:mlp:column", "tp:mlp:row"} | (set() if mlp_norm else {"norm2"})
    if kind.mlp == "moe":
        shared = {"shared_fc1", "shared_fc2", "tp:shared:column", "tp:shared:row"}
        if "moe" in modules:
            parts |= {"router", "permutation", "expert_fc1", "mlp_act", "expert_fc2", "ep", "tp:experts",
                      "latent_fc1", "latent_fc2"} | shared
        if "moe_act" in modules:
            parts.add("mlp_act")
        if "shared_experts" in modules:
            parts |= shared
    return parts


def recompute_seconds(lt, model: ModelSpec, kind: LayerKind, modules: tuple[str, ...]) -> float:
    """What selective recompute of `modules` runs again in one layer's backward, s (lt: its layer.LayerTime)."""
    if not modules:
        return 0.0
    parts = rerun_parts(model, kind, modules)
    return sum(seconds for name, seconds in (*lt.fwd_parts, *lt.fwd_comm_parts) if name in parts)


def applies(model: ModelSpec, module: str) -> bool:
    """Whether recomputing `module` changes anything in `model`: a layer it recomputes exists."""
    kinds = model.kinds
    if module == "core_attn":
        return any(k.mixer in ATTENTION_MIXERS for k in kinds)
    if module == "layernorm":
        return any(any(separate_norms(model, k)) for k in kinds)
    if module == "mla_up_proj":
        return any(k.mixer == "mla" for k in kinds)
    if module == "mlp":
        return any(k.mlp == "dense" for k in kinds)
    if module == "shared_experts":
        return model.is_moe and bool(model.cfg.moe_shared_expert_intermediate_size)
    return model.is_moe  # moe, moe_act


# The sets the search tries with selective recompute, in order of the memory they save: each adds to the one before
# (so a larger set is slower and smaller). Megatron's default first; then the published recipes' (Megatron-Bridge
# DeepSeek-V3: mla_up_proj mlp; GPT-OSS: layernorm moe_act) and what frees most for little work.
CANDIDATE_SETS = (
    ("core_attn",),
    ("core_attn", "layernorm", "mla_up_proj", "moe_act"),
    ("core_attn", "layernorm", "mla_up_proj", "mlp", "moe_act", "shared_experts"),
)


def searched_sets(model: ModelSpec) -> list[tuple[str, ...]]:
    """The module sets the search tries for `model`: CANDIDATE_SETS less the modules that change nothing in it (or
    that a Megatron rule refuses: `module_problem`), duplicates dropped."""
    out = []
    for candidate in CANDIDATE_SETS:
        kept = ordered(m for m in candidate if applies(model, m) and module_problem(model, (m,)) is None)
        if kept and kept not in out:
            out.append(kept)
    return out


def ordered(modules) -> tuple[str, ...]:
    """`modules` in RECOMPUTE_MODULES' order, each once."""
    chosen = set(modules)
    return tuple(m for m in RECOMPUTE_MODULES if m in chosen)
