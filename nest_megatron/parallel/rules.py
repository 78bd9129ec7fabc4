"""Megatron's feasibility rules for a configuration, written once, as one table with sources.

Config validation, the planner's search space, `evaluate` and the argv emitter all ask
`violation(...)`; it returns the line of the first rule of `RULES` the configuration breaks. Each
rule's source is a file:line of Megatron-LM at `MEGATRON_LM_COMMIT` (megatron/...), of Transformer
Engine at `TRANSFORMER_ENGINE_TAG` (`TE transformer_engine/...`: the asserts of its first forward pass,
which only a GPU run would otherwise hit), an upstream issue or PR, or `nest:` for the planner's own
policy where Megatron would launch but the plan is pointless or undefined. docs/megatron_rules.md lists
them (launch/megatron_rules.rules_doc writes it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

from nest_megatron.config.schema import ModelConfig
from nest_megatron.model.spec import ModelSpec
from nest_megatron.parallel.config import (
    CP_COMM_TYPES,
    RANK_ORDERS,
    RECOMPUTE_KINDS,
    RECOMPUTE_MODULES,
    ZERO_STAGES,
    ParallelConfig,
)
from nest_megatron.parallel.layout import (
    EVEN,
    SplitForm,
    account_problem,
    even_problem,
    first_last_problem,
    form_problem,
    searched_splits,
    split_hint,
)

# The Megatron-LM commit the sources below were read at (github.com/NVIDIA/Megatron-LM, 2026-08-22).
MEGATRON_LM_COMMIT = "d98e8a64ddf34856e74b24714e3bedb2f5a39553"
# The Transformer Engine the TE sources were read at (github.com/NVIDIA/TransformerEngine): the commit
# megatron-core 0.16.1's uv.lock pins (transformer-engine 2.12.0+5671fd36, tag v2.12); its wheel asks for
# transformer-engine >=2.9.0a0,<2.12.0, and every check cited is the same in v2.9, v2.10 and v2.11.
TRANSFORMER_ENGINE_TAG = "v2.12"
TRANSFORMER_ENGINE_COMMIT = "5671fd3675906cda1ade26c24a65d3dedd88eb89"


@dataclass(frozen=True)
class Rule:
    id: str
    source: str
    check: Callable  # the case -> its one-line message, or None when the rule holds; its docstring says what it asks


class Case(NamedTuple):
    """What a rule of `RULES` looks at. A named tuple, immutable like a frozen dataclass but built in a quarter of
    the time: the planner's search builds one for each of up to a million configurations."""
    cfg: ParallelConfig
    model: ModelSpec
    num_devices: int
    global_batch_size: int
    layers_per_stage: tuple[int, ...] | None
    any_split: bool
    tp_comm_overlap: bool = False  # --tp-comm-overlap: Transformer Engine's userbuffers, with TP > 1 and SP
    form: SplitForm = EVEN  # how Megatron is told the split (plan.account_for_*, plan.decoder_*, plan.pipeline_*)


def num_microbatches(cfg: ParallelConfig, global_batch_size: int) -> int:
    return global_batch_size // (cfg.mbs * cfg.dp)


def _positive(c: Case):
    """Every size is a positive integer."""
    cfg = c.cfg
    if min(cfg.tp, cfg.pp, cfg.dp, cfg.cp, cfg.ep, cfg.etp, cfg.vpp, cfg.mbs) >= 1:  # the search's every case, at once
        return None
    for name in ("tp", "pp", "dp", "cp", "ep", "etp", "vpp", "mbs"):
        if getattr(c.cfg, name) < 1:
            return f"plan.{name}={getattr(c.cfg, name)}: must be a positive integer"


def _zero_stage(c: Case):
    """ZeRO is 0 (DDP), 1 (distributed optimizer), 2 or 3 (Megatron-FSDP optim_grads / optim_grads_params)."""
    if c.cfg.zero not in ZERO_STAGES:
        return f"plan.zero={c.cfg.zero}: allowed are {', '.join(map(str, ZERO_STAGES))}"


def _recompute_kind(c: Case):
    """Recompute granularity is none, selective or full."""
    if c.cfg.recompute not in RECOMPUTE_KINDS:
        return f"plan.recompute={c.cfg.recompute}: allowed are {', '.join(RECOMPUTE_KINDS)}"


def module_problem(model: ModelSpec, modules: tuple[str, ...]) -> str | None:
    """The first of megatron-core's rules on recompute_modules that `modules` breaks for `model` (one line), or None:
    known names (Megatron-LM transformer_config.py:1943-1962), mla_up_proj only with MLA (:1969-1973), moe_act and
    layernorm not with fp8 delayed scaling (:2000-2006), shared_experts not with --moe-shared-expert-overlap
    (:1991-1998). moe_act's --moe-grouped-gemm the emitter gives every MoE model."""
    unknown = [m for m in modules if m not in RECOMPUTE_MODULES]
    if unknown:
        return f"plan.recompute_modules: {', '.join(unknown)} unknown; allowed are {', '.join(RECOMPUTE_MODULES)}"
    if "mla_up_proj" in modules and not model.cfg.multi_latent_attention:
        return "plan.recompute_modules: mla_up_proj needs multi-head latent attention (model.multi_latent_attention)"
    if model.numerics.fp8_recipe == "delayed" and {"moe_act", "layernorm"} & set(modules):
        return ("plan.recompute_modules: moe_act and layernorm do not recompute with fp8 delayed scaling; "
                "use another model.fp8_recipe or drop them")
    if "shared_experts" in modules and model.cfg.moe_shared_expert_intermediate_size and model.cfg.moe_shared_expert_overlap:
        return ("plan.recompute_modules: shared_experts does not recompute with the shared expert overlapped "
                "(model.moe_shared_expert_overlap); drop one")
    return None


def _recompute_modules(c: Case):
    """Selective recompute's modules are megatron-core's names; mla_up_proj needs MLA; moe_act and layernorm do not
    recompute under fp8 delayed scaling (module_problem)."""
    if c.cfg.recompute == "selective":
        return module_problem(c.model, c.cfg.recompute_modules)


def _rank_order(c: Case):
    """The rank order is one of Megatron-LM's two (the second is --use-tp-pp-dp-mapping)."""
    if c.cfg.order not in RANK_ORDERS:
        return f"plan.order={c.cfg.order}: Megatron launches {' or '.join(RANK_ORDERS)}"


def _fsdp_order(c: Case):
    """Megatron-FSDP only in the default rank order."""
    if c.cfg.zero >= 2 and c.cfg.order == "tp-cp-ep-pp-dp":
        return (f"plan.zero={c.cfg.zero} (Megatron-FSDP) with plan.order=tp-cp-ep-pp-dp: Megatron-FSDP does not "
                "support --use-tp-pp-dp-mapping; use plan.order=tp-cp-ep-dp-pp or plan.zero=0|1")


def _fsdp_pp(c: Case):
    """Megatron-FSDP without pipeline stages: its device mesh (dp_cp x ep x tp) must hold every rank."""
    if c.cfg.zero >= 2 and c.cfg.pp > 1:
        return (f"plan.zero={c.cfg.zero} (Megatron-FSDP) with plan.pp={c.cfg.pp}: Megatron-FSDP's device mesh has "
                "no pipeline dimension; use plan.pp=1 or plan.zero=0|1")


def _optimizer_instances(c: Case):
    """More than one distributed-optimizer instance only with a sharded optimizer, each instance an equal share of the
    data-parallel ranks (dp x cp) and of the expert data-parallel ranks."""
    cfg, n = c.cfg, c.cfg.distributed_optimizer_instances
    if n == 1:
        return None
    if cfg.zero == 0:
        return (f"plan.distributed_optimizer_instances={n} with plan.zero=0: the instances shard the distributed "
                "optimizer (or Megatron-FSDP's state); use plan.zero=1|2|3")
    if (cfg.dp * cfg.cp) % n:
        return (f"plan.distributed_optimizer_instances={n}: must divide dp*cp = {cfg.dp * cfg.cp} (each instance an "
                "equal share of the data-parallel ranks)")
    if c.model.is_moe and cfg.expert_dp % n:
        return (f"plan.distributed_optimizer_instances={n}: must divide the expert data-parallel size "
                f"tp*cp*dp/(etp*ep) = {cfg.expert_dp}")


def _world(c: Case):
    """The ranks fit on the cluster."""
    cfg = c.cfg
    if cfg.world > c.num_devices:
        return (f"tp*cp*pp*dp = {cfg.tp}*{cfg.cp}*{cfg.pp}*{cfg.dp} = {cfg.world} devices, "
                f"but the cluster has {c.num_devices}")


def _tp_heads(c: Case):
    """TP divides the attention heads."""
    if c.model.cfg.num_attention_heads % c.cfg.tp:
        return f"plan.tp={c.cfg.tp}: must divide num_attention_heads={c.model.cfg.num_attention_heads}"


def _tp_query_groups(c: Case):
    """TP divides the query groups."""
    if c.model.query_groups % c.cfg.tp:
        return f"plan.tp={c.cfg.tp}: must divide num_query_groups={c.model.query_groups}"


def _tp_padded_vocab(c: Case):
    """TP divides a --padded-vocab-size (Megatron pads any other vocabulary to a multiple of TP itself)."""
    rows = c.model.cfg.padded_vocab_size
    if rows and rows % c.cfg.tp:
        return f"plan.tp={c.cfg.tp}: must divide the embedding's rows, model.padded_vocab_size={rows}"


def _mamba_tp(c: Case):
    """TP divides a Mamba mixer's heads and its B/C groups."""
    if not c.model.has_mamba:
        return None
    heads, groups = c.model.mamba_heads, c.model.cfg.mamba_num_groups
    if heads % c.cfg.tp or groups % c.cfg.tp:
        return f"plan.tp={c.cfg.tp}: must divide the Mamba heads ({heads}) and groups (model.mamba_num_groups={groups})"


def _mamba_cp(c: Case):
    """CP divides each TP rank's Mamba heads, and its groups or they CP (each CP rank takes whole heads)."""
    if not c.model.has_mamba or c.cfg.cp == 1:
        return None
    heads, groups, cp = c.model.mamba_heads // c.cfg.tp, c.model.cfg.mamba_num_groups // c.cfg.tp, c.cfg.cp
    if heads % cp or (groups % cp if groups >= cp else cp % groups):
        return (f"plan.cp={cp}: must divide the {heads} Mamba heads of a TP rank, and divide or be a multiple of its "
                f"{groups} groups")


def _mamba_fp8(c: Case):
    """With FP8, a Mamba mixer's in_proj output (2 d_inner + 2 groups x state + heads) is a multiple of 16."""
    if c.model.has_mamba and c.model.numerics.fp8_recipe and c.model.mamba_in_proj_width % 16:
        return (f"model.fp8_recipe={c.model.numerics.fp8_recipe}: the Mamba in_proj output of "
                f"{c.model.mamba_in_proj_width} is not a multiple of 16")


def _sp_tp(c: Case):
    """Sequence parallel needs TP > 1."""
    if c.cfg.sp and c.cfg.tp == 1:
        return "plan.sp=true: sequence parallel needs tp > 1"


def _moe_sp(c: Case):
    """A MoE model with TP > 1 trains only with sequence parallel."""
    if c.model.is_moe and c.cfg.tp > 1 and not c.cfg.sp:
        return f"plan.tp={c.cfg.tp} with MoE: Megatron requires sequence parallel (plan.sp=true)"


def _cp_unfused(c: Case):
    """Context parallel needs a fused attention (TE's flash or fused backend)."""
    backend = c.model.cfg.attention_backend
    if c.cfg.cp > 1 and not c.model.fused_attention:
        return (f"plan.cp={c.cfg.cp} with model.attention_backend={backend}: unfused attention has no context "
                "parallel (Megatron's auto, fused and flash backends do); use plan.cp=1")


def _cp_seq(c: Case):
    """The sequence is a multiple of 2*CP (load-balanced CP chunks)."""
    if c.cfg.cp > 1 and c.model.cfg.seq_length % (2 * c.cfg.cp):
        return f"plan.cp={c.cfg.cp}: seq_length={c.model.cfg.seq_length} must be a multiple of 2*cp"


def _sp_seq(c: Case):
    """With sequence parallel, TP divides the sequence each CP rank holds."""
    seq = c.model.cfg.seq_length // c.cfg.cp
    if c.cfg.sp and seq % c.cfg.tp:
        return f"plan.sp=true: seq_length/cp={seq} must be a multiple of tp={c.cfg.tp}"


def _ep_dense(c: Case):
    """Expert parallel needs a MoE model."""
    if c.cfg.ep > 1 and not c.model.is_moe:
        return f"plan.ep={c.cfg.ep}: expert parallel needs a MoE model (model.num_experts)"


def _ep_experts(c: Case):
    """EP divides the experts."""
    if c.model.is_moe and c.model.cfg.num_experts % c.cfg.ep:
        return f"plan.ep={c.cfg.ep}: must divide num_experts={c.model.cfg.num_experts}"


def _expert_grid(c: Case):
    """ETP x EP divides a stage's tp*cp*dp ranks (the expert grid reuses them)."""
    cfg = c.cfg
    if c.model.is_moe and (cfg.tp * cfg.cp * cfg.dp) % (cfg.etp * cfg.ep):
        return (f"plan.ep={cfg.ep} x plan.etp={cfg.etp}: must divide tp*cp*dp = "
                f"{cfg.tp * cfg.cp * cfg.dp} (the expert grid reuses the non-expert ranks of a stage)")


def _etp_ffn(c: Case):
    """ETP divides the expert FFN size."""
    if c.model.is_moe and c.model.moe_ffn % c.cfg.etp:
        return f"plan.etp={c.cfg.etp}: must divide the expert ffn size {c.model.moe_ffn}"


def _etp_dense(c: Case):
    """Expert TP is 1 for a dense model (the planner's convention: it has no expert layers)."""
    if not c.model.is_moe and c.cfg.etp != 1:
        return f"plan.etp={c.cfg.etp}: expert tensor parallel needs a MoE model"


def _moe_bias_etp(c: Case):
    """A MoE model with biases in its linear layers needs expert TP 1."""
    if c.model.is_moe and c.model.cfg.add_bias_linear and c.cfg.etp > 1:
        return (f"plan.etp={c.cfg.etp} with model.add_bias_linear=true: megatron-core supports biases in MoE experts "
                "only with expert tensor parallel 1; use plan.etp=1 or model.add_bias_linear=false")


def _order_expert_dp(c: Case):
    """Unless PP is the slowest rank dimension, the expert data-parallel size equals DP."""
    cfg = c.cfg
    # Megatron-LM sets etp = tp for a dense model too, so there context parallel alone breaks it.
    expert_tp = cfg.etp if c.model.is_moe else cfg.tp
    expert_dp = cfg.tp * cfg.cp * cfg.dp // (expert_tp * cfg.ep)
    if cfg.order == "tp-cp-ep-pp-dp" and cfg.pp > 1 and expert_dp != cfg.dp:
        return (f"plan.order=tp-cp-ep-pp-dp with plan.pp={cfg.pp}: megatron-core needs the expert data-parallel size "
                f"tp*cp*dp/(etp*ep) = {expert_dp} to equal dp={cfg.dp}; use plan.order=tp-cp-ep-dp-pp")


def _split(c: Case):
    """A given split has pp entries (per pipeline rank) or pp*vpp (per model chunk), none negative, adding up to num_layers.

    The pp*vpp entries are in Megatron's virtual-stage order (chunk k*pp + rank); an empty stage is allowed."""
    split, layers = c.layers_per_stage, c.model.cfg.num_layers
    lengths = sorted({c.cfg.pp, c.cfg.pp * c.cfg.vpp})
    if split is not None and (len(split) not in lengths or min(split) < 0 or sum(split) != layers):
        return (f"layers_per_stage={list(split)}: {' or '.join(map(str, lengths))} entries (pp or pp*vpp) of at least "
                f"0 layers adding up to num_layers={layers}")


def _split_virtual(c: Case):
    """A split of pp entries with virtual stages gives each rank a multiple of vpp layers (split evenly over its chunks)."""
    split, v = c.layers_per_stage, c.cfg.vpp
    if split is not None and v > 1 and len(split) == c.cfg.pp and any(n % v for n in split):
        return (f"layers_per_stage={list(split)}: with plan.vpp={v}, pp entries must each be a multiple of vpp "
                "(or give pp*vpp entries, one per model chunk)")


def _given(c: Case) -> bool:
    return c.layers_per_stage is not None or (c.form is not EVEN and c.form != EVEN)


def _layout(c: Case):
    """A layout: E first and L last once each, the model's t and m layers (m after every t, in one rank's last virtual stage), pp*vpp stages."""
    if c.form.pipeline_model_parallel_layout is not None:
        return form_problem(c.form, num_layers=c.model.cfg.num_layers, pp=c.cfg.pp, vpp=c.cfg.vpp,
                            mtp_num_layers=c.model.cfg.mtp_num_layers)


def _account_split(c: Case):
    """The embedding / loss counted as layers: pp divides num_layers + them, vpp each rank's share, their chunks keep >= 0 layers."""
    if c.form is EVEN:
        return None
    return account_problem(c.form, num_layers=c.model.cfg.num_layers, pp=c.cfg.pp, vpp=c.cfg.vpp)


def _first_last_split(c: Case):
    """First / last stage layers: positive multiples of vpp, the rest even over the middle stages and their virtual stages."""
    if c.form is EVEN:
        return None
    return first_last_problem(c.form, num_layers=c.model.cfg.num_layers, pp=c.cfg.pp, vpp=c.cfg.vpp)


def _uneven_stages(c: Case):
    """An uneven split the planner chooses has at most one stage per layer."""
    uneven = c.any_split and not _given(c) and c.cfg.vpp == 1
    if uneven and c.cfg.pp > c.model.cfg.num_layers:
        return f"plan.pp={c.cfg.pp}: more stages than num_layers={c.model.cfg.num_layers}"


def _virtual_split_family(c: Case):
    """With virtual stages, a split the planner chooses is one of its family (parallel.layout.searched_splits)."""
    searched = c.any_split and not _given(c) and c.cfg.vpp > 1 and c.cfg.pp > 1
    if searched and not searched_splits(c.model.cfg.num_layers, c.cfg.pp, c.cfg.vpp):
        return (f"plan.pp={c.cfg.pp} x plan.vpp={c.cfg.vpp}: no split of num_layers={c.model.cfg.num_layers} "
                "into their chunks that the planner searches (middle chunks equal, the first and last at most as "
                "large, or each rank's chunks equal)")


def _even_split(c: Case):
    """Without a given split, pp x vpp divides the layers."""
    if not _given(c) and not c.any_split:
        line = even_problem(num_layers=c.model.cfg.num_layers, pp=c.cfg.pp, vpp=c.cfg.vpp)
        if not line:
            return line
        hint = split_hint(num_layers=c.model.cfg.num_layers, pp=c.cfg.pp, vpp=c.cfg.vpp,
                          mtp_num_layers=c.model.cfg.mtp_num_layers or 0,
                          hybrid=c.model.cfg.hybrid_layer_pattern is not None)
        return f"{line}; {hint}"


def _vpp_pp(c: Case):
    """Virtual stages need PP > 1."""
    if c.cfg.vpp > 1 and c.cfg.pp == 1:
        return f"plan.vpp={c.cfg.vpp}: virtual pipeline stages need pp > 1"


def _a2a_overlap_layout(c: Case):
    """The EP all-to-all overlap needs EP > 1, and virtual stages with PP > 1."""
    if not c.cfg.moe_a2a_overlap:
        return None
    if c.cfg.ep == 1:
        return ("plan.ep=1 with plan.moe_a2a_overlap=true: the overlap hides expert-parallel all-to-alls; "
                "use plan.ep > 1 or plan.moe_a2a_overlap=false")
    if c.cfg.pp > 1 and c.cfg.vpp == 1:
        return (f"plan.pp={c.cfg.pp} without virtual stages and plan.moe_a2a_overlap=true: the overlap needs "
                "plan.vpp > 1 with pp > 1")


def _a2a_overlap_recompute(c: Case):
    """The EP all-to-all overlap takes no full recompute and no recomputed MoE layer."""
    if not c.cfg.moe_a2a_overlap:
        return None
    if c.cfg.recompute == "full":
        return "plan.recompute=full with plan.moe_a2a_overlap=true: the overlap takes none or selective recompute"
    if c.cfg.recompute == "selective" and "moe" in c.cfg.recompute_modules:
        return ("plan.recompute_modules with moe and plan.moe_a2a_overlap=true: the overlap does not recompute a "
                "whole MoE layer; drop moe (moe_act recomputes its activation)")


def _global_batch(c: Case):
    """The global batch is a multiple of micro-batch x DP."""
    if c.global_batch_size % (c.cfg.mbs * c.cfg.dp):
        return (f"train.global_batch_size={c.global_batch_size}: must be a multiple of "
                f"micro_batch_size*dp = {c.cfg.mbs}*{c.cfg.dp}")


def _fill_pipeline(c: Case):
    """At least pp micro-batches per iteration (fewer leave stages idle: Megatron runs it, the planner does not)."""
    microbatches = num_microbatches(c.cfg, c.global_batch_size)
    if microbatches < c.cfg.pp:
        return f"{microbatches} micro-batches per iteration: need at least pp={c.cfg.pp} to fill the pipeline"


def microbatch_group_problem(microbatches: int, group: int, pp: int) -> str | None:
    """What the interleaved schedule says of `microbatches` run `group` at a time per model chunk (None: fine)."""
    if not pp <= group <= microbatches:
        return f"must be from pp={pp} to the {microbatches} micro-batches"
    if 0 < microbatches % group < pp:
        return f"leaves a last group of {microbatches % group} micro-batches, fewer than pp={pp} (0 or >= pp allowed)"
    return None


def _interleaved_microbatches(c: Case):
    """The interleaved schedule runs the micro-batches in groups of pp (or the group size given) to its last, which
    holds none or at least pp: with the default groups, a multiple of pp micro-batches."""
    cfg = c.cfg
    if cfg.vpp == 1:
        return None
    microbatches = num_microbatches(cfg, c.global_batch_size)
    problem = microbatch_group_problem(microbatches, cfg.microbatch_group, cfg.pp)
    if problem is None:
        return None
    if cfg.microbatch_group_size_per_vp_stage is None:
        return f"{microbatches} micro-batches: the interleaved schedule needs a multiple of pp={cfg.pp}"
    return (f"plan.microbatch_group_size_per_vp_stage={cfg.microbatch_group_size_per_vp_stage} with {microbatches} "
            f"micro-batches per iteration: {problem}")


def _mla_local_tp(c: Case):
    """With megatron-core's local spec, TP divides MLA's down projections' outputs (there column-parallel)."""
    m = c.model.cfg
    if c.cfg.tp == 1 or not m.multi_latent_attention or not c.model.mla_down_split:
        return None
    for name, width in (("q_lora_rank", m.q_lora_rank), ("kv_lora_rank + qk_pos_emb_head_dim", c.model.mla_kv_down_width)):
        if width is not None and width % c.cfg.tp:
            return (f"plan.tp={c.cfg.tp} with model.transformer_impl=local: must divide MLA's {name} = {width} (the "
                    "local spec splits the down projections over TP; Transformer Engine's duplicates them)")


def _cpu_offloading(c: Case):
    """Activation offloading to the host of fewer layers than the model has, with pp 1 and no recompute."""
    cfg, n = c.cfg, c.cfg.cpu_offloading_num_layers
    if not n:
        return None
    layers = c.model.cfg.num_layers
    if n >= layers:
        return (f"plan.cpu_offloading_num_layers={n}: allowed 1..{layers - 1} (the last layer's activations stay on the "
                "device)")
    if cfg.pp > 1:
        return (f"plan.cpu_offloading_num_layers={n} with plan.pp={cfg.pp}: megatron-core offloads no activations under "
                "pipeline parallelism; use plan.pp=1")
    if cfg.recompute != "none":
        return (f"plan.cpu_offloading_num_layers={n} with plan.recompute={cfg.recompute}: megatron-core offloads no "
                "activations under recompute; use plan.recompute=none")


def _recompute_layers_full(c: Case):
    """A number of recomputed layers only with full recompute."""
    if c.cfg.recompute_num_layers is not None and c.cfg.recompute != "full":
        return "plan.recompute_num_layers: only with plan.recompute=full"


def _recompute_layers_range(c: Case):
    """Recomputed layers per virtual stage are 1 .. the layers it holds."""
    n = c.cfg.recompute_num_layers
    per_chunk = c.model.cfg.num_layers // (c.cfg.pp * c.cfg.vpp)
    if n is not None and not 1 <= n <= per_chunk:
        return f"plan.recompute_num_layers={n}: allowed 1..{per_chunk}"


# --- Transformer Engine's run-time rules (TRANSFORMER_ENGINE_TAG) ---------------------------------------------
# What TE's modules see of a configuration: tokens per rank T = mbs * seq_length / cp in every GEMM, T / tp in
# a column-parallel layer's sequence-parallel input shard (its all-gather's input), the heads, query groups and
# head size per TP rank in attention.

# A column-parallel GEMM's input is the sequence-parallel shard its forward all-gathers (model/spec.py's names).
COLUMN_PARALLEL = ("qkv", "fc1", "shared_fc1")
# FP8 recipe -> the multiple every GEMM dimension needs; MXFP8 quantizes in blocks of 32.
FP8_MULTIPLE = {"delayed": 16, "tensorwise": 16, "blockwise": 16, "mxfp8": 32}


def _tokens(c: Case) -> int:
    return c.cfg.mbs * c.model.cfg.seq_length // c.cfg.cp


def _shard_tokens(c: Case) -> int:
    """Tokens of the sequence-parallel shard a TP rank holds (all of them without sequence parallel)."""
    return _tokens(c) // c.cfg.tp if c.cfg.sp else _tokens(c)


def _windowed(c: Case) -> bool:
    """Whether some layer slides its attention window (megatron/core/transformer/utils.py:531
    is_layer_window_attention: window_attn_skip_freq N leaves every N-th layer full, N = 1 all of them)."""
    return c.model.cfg.window_size is not None and c.model.cfg.window_attn_skip_freq != 1


def _cp_comm_type(c: Case):
    """The CP exchange is one of p2p, a2a, all_gather."""
    if c.cfg.cp > 1 and c.cfg.cp_comm_type not in CP_COMM_TYPES:
        return (f"plan.cp_comm_type={c.cfg.cp_comm_type}: allowed are {', '.join(CP_COMM_TYPES)} (Transformer Engine's "
                "a2a+p2p needs hierarchical CP groups, which the planner does not build)")


def _cp_padding_mask(c: Case):
    """Context parallel not with BERT's padding mask."""
    if c.cfg.cp > 1 and c.model.cfg.family == "bert":
        return (f"plan.cp={c.cfg.cp} with model.family=bert: Transformer Engine's context parallelism does not take "
                "BERT's padding mask (its flash and fused attention assert it); use plan.cp=1")


def _cp_sliding_window(c: Case):
    """Sliding-window attention with context parallel exchanges by a2a or all_gather."""
    cfg = c.cfg
    if cfg.cp > 1 and _windowed(c) and cfg.cp_comm_type not in ("a2a", "all_gather"):
        return (f"plan.cp_comm_type={cfg.cp_comm_type} with plan.cp={cfg.cp} and model.window_size="
                f"{c.model.cfg.window_size}: Transformer Engine's context parallelism runs sliding-window attention "
                "only with a2a or all_gather; use plan.cp_comm_type=a2a or all_gather, or plan.cp=1")


def _cp_mla(c: Case):
    """With MLA (a key head wider than a value head), context parallel exchanges by p2p."""
    cfg, m = c.cfg, c.model
    # megatron-core hands TE's attention k_channels = qk_head_dim + qk_pos_emb_head_dim, v_channels = v_head_dim
    k_dim, v_dim = m.mla_qk_head_dim, m.cfg.v_head_dim
    if cfg.cp > 1 and m.cfg.multi_latent_attention and k_dim != v_dim and cfg.cp_comm_type != "p2p":
        return (f"plan.cp_comm_type={cfg.cp_comm_type} with plan.cp={cfg.cp} and model.multi_latent_attention=true: "
                f"Transformer Engine's context parallelism runs MLA (key heads {k_dim} wide, value heads {v_dim}) only "
                "with p2p; use plan.cp_comm_type=p2p, or plan.cp=1")


def _cp_softmax_type(c: Case):
    """With an off-by-one or learnable softmax, context parallel exchanges by a2a."""
    cfg, softmax = c.cfg, c.model.cfg.softmax_type
    if cfg.cp > 1 and softmax != "vanilla" and cfg.cp_comm_type != "a2a":
        return (f"plan.cp_comm_type={cfg.cp_comm_type} with plan.cp={cfg.cp} and model.softmax_type={softmax}: "
                f"Transformer Engine's context parallelism runs the {softmax} softmax only in cuDNN's fused attention "
                "with a2a; use plan.cp_comm_type=a2a, or plan.cp=1")


def _cp_a2a_heads(c: Case):
    """With a2a, CP divides each TP rank's attention heads and query groups."""
    cfg, m = c.cfg, c.model
    heads, groups = m.heads // cfg.tp, m.query_groups // cfg.tp
    if cfg.cp > 1 and cfg.cp_comm_type == "a2a" and (heads % cfg.cp or groups % cfg.cp):
        return (f"plan.cp_comm_type=a2a with plan.cp={cfg.cp}: the all-to-all splits each TP rank's {heads} attention "
                f"heads and {groups} query groups over the CP ranks, so cp must divide both; use plan.cp_comm_type="
                "all_gather or p2p, or a smaller plan.cp")


def _cp_head_dim(c: Case):
    """With a2a or all_gather, the head size is a multiple of 8."""
    cfg, d = c.cfg, c.model.head_dim
    if cfg.cp > 1 and cfg.cp_comm_type in ("a2a", "all_gather") and d % 8:
        return (f"plan.cp_comm_type={cfg.cp_comm_type} with plan.cp={cfg.cp}: Transformer Engine needs the head size "
                f"(kv_channels={d}) a multiple of 8 for it; use plan.cp_comm_type=p2p")


def _fused_window_dropout(c: Case):
    """The fused backend runs sliding-window attention only without attention dropout."""
    m = c.model.cfg
    if m.attention_backend == "fused" and _windowed(c) and m.attention_dropout > 0:
        return (f"model.attention_backend=fused with model.window_size={m.window_size} and model.attention_dropout="
                f"{m.attention_dropout}: cuDNN's fused attention has no sliding window with dropout, and Megatron "
                "turns the other backends off; use attention_dropout=0 or attention_backend=auto|flash")


def _flash_head_dim(c: Case):
    """The flash backend needs a head size of at most 256, a multiple of 8."""
    d = c.model.attention_head_dim(c.model.default_kind)  # MLA: the query/key head, qk_head_dim + qk_pos_emb_head_dim
    if c.model.cfg.attention_backend == "flash" and (d > 256 or d % 8):
        return (f"model.attention_backend=flash with kv_channels={d}: flash-attn takes head sizes up to 256 in "
                "multiples of 8, and Megatron turns the other backends off; use attention_backend=auto|fused")


def _flash_softmax_type(c: Case):
    """The flash backend runs only the vanilla softmax."""
    m = c.model.cfg
    if m.attention_backend == "flash" and m.softmax_type != "vanilla":
        return (f"model.attention_backend=flash with model.softmax_type={m.softmax_type}: flash-attn has only the "
                "vanilla softmax, and Megatron turns the other backends off; use attention_backend=auto|fused")


def _fp8_gemm_dims(c: Case):
    """With FP8, every GEMM dimension per rank is a multiple of 16 (MXFP8: 32), the sequence-parallel shard of 8 (32)."""
    recipe = c.model.numerics.fp8_recipe
    if recipe is None:
        return None
    multiple, cfg = FP8_MULTIPLE[recipe], c.cfg
    tokens, shard = _tokens(c), _shard_tokens(c)
    label = f"with FP8 ({recipe}): Transformer Engine's FP8 GEMMs need"
    if tokens % multiple:
        return (f"plan.mbs={cfg.mbs} x seq_length/plan.cp={c.model.cfg.seq_length}/{cfg.cp} = {tokens} tokens per rank "
                f"{label} a multiple of {multiple}")
    shard_multiple = 32 if recipe == "mxfp8" else 8
    if cfg.sp and shard % shard_multiple:
        return (f"plan.sp=true with plan.tp={cfg.tp}: each TP rank's sequence shard of {shard} tokens {label} a "
                f"multiple of {shard_multiple}")
    kinds = c.model.kinds + c.model.mtp_depth_kinds
    for kind in kinds:
        for g in c.model.layer_gemms(tokens=tokens, tp=cfg.tp, sp=cfg.sp, ep=cfg.ep, etp=cfg.etp, kind=kind):
            if g.name == "router":  # megatron-core's router GEMM is no TE module, and stays in high precision
                continue
            for side, size in (("output", g.n), ("input", g.k)):
                if size % multiple:
                    width = f"plan.etp={cfg.etp}" if g.name.startswith("expert_") else f"plan.tp={cfg.tp}"
                    return (f"{width} {label} each dimension a multiple of {multiple}; the {g.name} GEMM's {side} "
                            f"per rank is {size} wide")


def _fp8_blockwise_sp(c: Case):
    """Blockwise FP8 with sequence parallel: the shard's tokens and hidden_size are multiples of 128."""
    cfg, h = c.cfg, c.model.h
    shard = _shard_tokens(c)
    if c.model.numerics.fp8_recipe == "blockwise" and cfg.sp and (shard % 128 or h % 128):
        return (f"plan.sp=true with FP8 (blockwise): Transformer Engine all-gathers the sequence-parallel input in "
                f"1x128 FP8 blocks, so each TP rank's {shard}-token shard (mbs*seq_length/(cp*tp)) and hidden_size={h} "
                "must be multiples of 128")


def _tp_overlap_recipe(c: Case):
    """TP communication overlap takes delayed or tensorwise FP8, or MXFP8: not blockwise."""
    cfg = c.cfg
    if c.tp_comm_overlap and cfg.tp > 1 and cfg.sp and c.model.numerics.fp8_recipe == "blockwise":
        return ("train.tp_comm_overlap=true with FP8 (blockwise): Transformer Engine's userbuffers take delayed or "
                "tensorwise FP8 or MXFP8, not blockwise; set train.tp_comm_overlap=false or another train.fp8_recipe")


def _tp_overlap_mxfp8(c: Case):
    """TP communication overlap with MXFP8: the shard's tokens and hidden_size are multiples of 128."""
    cfg, h = c.cfg, c.model.h
    shard = _shard_tokens(c)
    if (c.tp_comm_overlap and cfg.tp > 1 and cfg.sp and c.model.numerics.fp8_recipe == "mxfp8"
            and (shard % 128 or h % 128)):
        return (f"train.tp_comm_overlap=true with FP8 (mxfp8): Transformer Engine's userbuffers need each TP rank's "
                f"{shard}-token sequence shard (mbs*seq_length/(cp*tp)) and hidden_size={h} multiples of 128")


MC = "megatron/core/"
TC = MC + "transformer/transformer_config.py"
ARGS = "megatron/training/arguments.py"
TE = "TE transformer_engine/"
DPA = TE + "pytorch/attention/dot_product_attention/"
# Transformer Engine's rules, in the order they are checked after Megatron-LM's.
TE_RULES = (
    Rule("cp-comm-type", f"{DPA}context_parallel.py:4076-4110 (p2p, all_gather, a2a; other values raise ValueError); "
         "nest: a2a+p2p (:3986) needs --hierarchical-context-parallel-sizes, which the planner does not set", _cp_comm_type),
    Rule("cp-padding-mask", f"{DPA}backends.py:821-824, 1860-1863; BERT's padding mask: "
         f"{MC}models/bert/bert_layer_specs.py:60, 113", _cp_padding_mask),
    Rule("cp-sliding-window", f"{DPA}context_parallel.py:4023-4029", _cp_sliding_window),
    Rule("cp-mla", f"{DPA}context_parallel.py:4031-4035 (`enable_mla = k.shape[-1] != v.shape[-1]`: p2p or a2a+p2p); "
         f"{MC}transformer/multi_latent_attention.py:214-215 (k_channels, v_channels), "
         f"{MC}extensions/transformer_engine.py:2176", _cp_mla),
    Rule("cp-softmax-type", f"{DPA}utils.py:715-717 (flash-attn off), 733-741 (cuDNN's fused attention off unless "
         "a2a), 755-759 (unfused off with CP), dot_product_attention.py:1425-1431 (no backend left); "
         "context_parallel.py:4042-4047", _cp_softmax_type),
    Rule("cp-a2a-heads", f"{DPA}context_parallel.py:3365-3367", _cp_a2a_heads),
    Rule("cp-head-dim", f"{DPA}context_parallel.py:2806 (all_gather), 3320 (a2a)", _cp_head_dim),
    Rule("fused-window-dropout", f"{DPA}utils.py:874-885, dot_product_attention.py:1425-1431 (no backend left: "
         f"{MC}models/common/language_module/language_module.py:137-140 sets NVTE_FLASH_ATTN=0, NVTE_UNFUSED_ATTN=0)",
         _fused_window_dropout),
    Rule("flash-head-dim", f"{DPA}utils.py:627-646 (flash-attn 2), 648-650 (3), dot_product_attention.py:1425-1431 "
         f"(no backend left: {MC}models/common/language_module/language_module.py:133-136)", _flash_head_dim),
    Rule("flash-softmax-type", f"{DPA}utils.py:715-717, dot_product_attention.py:1425-1431 (no backend left: "
         f"{MC}models/common/language_module/language_module.py:133-136)", _flash_softmax_type),
    Rule("fp8-gemm-dims", f"{TE}pytorch/utils.py:439-447 (module/linear.py:177, layernorm_linear.py:160); "
         "common/gemm/cublaslt_gemm.cu:157, 205-210, 248, 291-298 (FP8 leading dimensions; in Hopper's TN GEMMs "
         "the reduction dimension, the tokens in the weight gradient); MXFP8: pytorch/csrc/quantizer.cpp:876-878; "
         "routed experts' rows are padded: pytorch/module/fp8_padding.py:116-122 "
         f"({MC}transformer/moe/experts.py:311)", _fp8_gemm_dims),
    Rule("fp8-blockwise-sp", f"{TE}pytorch/utils.py:450-457 (module/linear.py:178, layernorm_linear.py:161), "
         "pytorch/tensor/float8_blockwise_tensor.py:51, 194-203", _fp8_blockwise_sp),
    Rule("tp-overlap-recipe", f"{TE}pytorch/module/base.py:602-603, common/comm_gemm_overlap/comm_gemm_overlap.cpp:"
         "177-178", _tp_overlap_recipe),
    Rule("tp-overlap-mxfp8", f"{TE}pytorch/module/base.py:559-563, common/comm_gemm_overlap/comm_gemm_overlap.cpp:"
         "211-218", _tp_overlap_mxfp8),
)
# In order: a rule may assume the rules above it hold (positive sizes, a known ZeRO stage, ...).
RULES = (
    Rule("positive", "nest: argparse takes any integer; a size below 1 is no configuration", _positive),
    Rule("zero-stage", "nest: the ZeRO stages emit/megatron.py ZERO_FLAGS realises", _zero_stage),
    Rule("recompute-kind", f"{TC}:1904", _recompute_kind),
    Rule("recompute-modules", f"{TC}:1943-1962 (the names), 1969-1973 (mla_up_proj), 1991-1998 (shared_experts with "
         "--moe-shared-expert-overlap), 2000-2006 (fp8 delayed)",
         _recompute_modules),
    Rule("rank-order", "megatron/training/initialize.py:395", _rank_order),
    Rule("fsdp-order", "Megatron-Bridge src/megatron/bridge/training/config.py@4feb11f "
         "(assert not use_tp_pp_dp_mapping with Megatron FSDP)", _fsdp_order),
    Rule("fsdp-pp", f"{MC}distributed/fsdp/mcore_fsdp_adapter.py:820 (_get_dp_tp_mesh); "
         "Megatron-LM issue #1455, PR #6081", _fsdp_pp),
    Rule("optimizer-instances", f"{MC}distributed/distributed_data_parallel.py:357-360; {MC}parallel_state.py:922-926, "
         f"1447-1449; {MC}distributed/fsdp/mcore_fsdp_adapter.py:346 (Megatron-FSDP: hybrid sharding)",
         _optimizer_instances),
    Rule("world", "nest: the plan's ranks run on the cluster's devices", _world),
    Rule("tp-heads", f"{TC}:1446", _tp_heads),
    Rule("tp-query-groups", f"{TC}:1462 (stricter: Megatron also takes tp a multiple of the groups, replicating "
         "KV heads, which the cost model does not price)", _tp_query_groups),
    Rule("mamba-tp", f"{MC}ssm/mamba_mixer.py:262, 270", _mamba_tp),
    Rule("mamba-cp", f"{MC}ssm/mamba_context_parallel.py:108, 122, 129", _mamba_cp),
    Rule("mamba-fp8", f"{MC}ssm/mamba_mixer.py:256", _mamba_fp8),
    Rule("tp-padded-vocab", f"{MC}tensor_parallel/layers.py:268 (VocabParallelEmbedding), "
         f"{MC}tensor_parallel/utils.py:118 (divide)", _tp_padded_vocab),
    Rule("sp-tp", f"{MC}model_parallel_config.py:504 ({ARGS}:1433 turns it off silently)", _sp_tp),
    Rule("moe-sp", f"{MC}transformer/moe/moe_layer.py:636", _moe_sp),
    Rule("cp-unfused", f"{MC}transformer/dot_product_attention.py:58; "
         "TE transformer_engine/pytorch/attention/dot_product_attention/utils.py:755-759", _cp_unfused),
    Rule("cp-seq", f"{ARGS}:1336", _cp_seq),
    Rule("sp-seq", f"{MC}tensor_parallel/mappings.py:73; so too the userbuffers of --tp-comm-overlap, "
         "[mbs*seq_length/cp, h] (megatron/training/initialize.py:224) in tp chunks: "
         "TE transformer_engine/common/comm_gemm_overlap/comm_gemm_overlap.cpp:695, 702", _sp_seq),
    Rule("ep-dense", f"{ARGS}:1656", _ep_dense),
    Rule("ep-experts", f"{ARGS}:1657", _ep_experts),
    Rule("expert-grid", f"{MC}parallel_state.py:883", _expert_grid),
    Rule("etp-ffn", f"{MC}tensor_parallel/layers.py:1038 (divide)", _etp_ffn),
    Rule("etp-dense", f"nest: {ARGS}:588 sets etp = tp, used by no layer of a dense model", _etp_dense),
    Rule("moe-bias-etp", f"{TC}:2615", _moe_bias_etp),
    Rule("order-expert-dp", f"{MC}parallel_state.py:898", _order_expert_dp),
    Rule("split", f"{MC}transformer/pipeline_parallel_layer_layout.py:41, 107 (pp*vpp stages, num_layers "
         "transformer layers; empty stages allowed); pp entries: nest", _split),
    Rule("split-virtual", f"nest: as {TC}:2306-2336 asks of --decoder-first/last-pipeline-num-layers", _split_virtual),
    Rule("layout", f"{MC}transformer/pipeline_parallel_layer_layout.py:41-46, 86-140, 315-318; {TC}:2276-2285; "
         f"{ARGS}:941-952", _layout),
    Rule("account-split", f"{TC}:2370-2412; {MC}transformer/transformer_block.py:156-159, 194-201; {ARGS}:962-998",
         _account_split),
    Rule("first-last-split", f"{TC}:2295-2368; {MC}transformer/transformer_layer.py:158-165 (a division by the middle "
         "stages); stricter with both at pp 1, where megatron-core builds the last count",
         _first_last_split),
    Rule("uneven-stages", "nest: each stage of an uneven split the planner chooses holds a layer", _uneven_stages),
    Rule("virtual-split-family", "nest: the virtual-stage splits the planner searches (solver/README.md)",
         _virtual_split_family),
    Rule("even-split", f"{ARGS}:969, 973, 998; {MC}transformer/transformer_block.py:156-159, 175-178 (not with a "
         f"layout: {ARGS}:941)", _even_split),
    Rule("vpp-pp", f"{MC}parallel_state.py:830", _vpp_pp),
    Rule("a2a-overlap-layout", f"{TC}:3007-3015", _a2a_overlap_layout),
    Rule("global-batch", f"{MC}num_microbatches_calculator.py:381", _global_batch),
    Rule("fill-pipeline", "nest: 1F1B with fewer micro-batches than stages leaves stages idle", _fill_pipeline),
    Rule("interleaved-microbatches", f"{MC}pipeline_parallel/schedules.py:1160-1180; {MC}model_parallel_config.py:"
         "567-568 (the group defaults to pp)", _interleaved_microbatches),
    Rule("mla-local-tp", f"{MC}tensor_parallel/layers.py:1038 (ColumnParallelLinear: divide(output_size, tp)); "
         f"{MC}models/gpt/gpt_layer_specs.py get_gpt_layer_local_spec (MLA's down projections column-parallel)",
         _mla_local_tp),
    Rule("recompute-layers-full", f"{TC}:1931", _recompute_layers_full),
    Rule("recompute-layers-range", f"{TC}:1922 (per virtual stage: nest)", _recompute_layers_range),
    Rule("a2a-overlap-recompute", f"{TC}:3021-3032", _a2a_overlap_recompute),
    Rule("cpu-offloading", f"{TC}:1884-1899; {TE}pytorch/cpu_offload.py:827-829 (num_layers <= model_layers - 1)",
         _cpu_offloading),
    *TE_RULES,
)


# The rules that read nothing of a configuration but tp, cp, pp, dp, ep, etp, zero and order (and the model): the
# search skips what they refuse before the rest of a configuration is enumerated (solver/space.py candidates).
SIZE_RULES = (_fsdp_pp, _fsdp_order, _expert_grid, _etp_ffn, _moe_bias_etp, _order_expert_dp)
# The rules that read nothing of a configuration but pp, vpp, mbs and dp (and the model, the global batch and the
# given split): the search drops the (vpp, mbs) pairs they refuse at a (pp, dp) before the rest is enumerated.
PIPELINE_RULES = (_split, _split_virtual, _layout, _account_split, _first_last_split, _uneven_stages,
                  _virtual_split_family, _even_split, _vpp_pp, _global_batch, _fill_pipeline, _interleaved_microbatches)


# The rules of the EP all-to-all overlap that read nothing of a configuration but pp, vpp, ep and the recompute kind
# (with Megatron's default recompute modules): the search skips an overlap they refuse before it is judged.
OVERLAP_RULES = (_a2a_overlap_layout, _a2a_overlap_recompute)


def refused_overlap(pp: int, vpp: int, ep: int, recompute: str) -> bool:
    """Whether a rule of OVERLAP_RULES refuses the EP all-to-all overlap at these sizes, whatever the rest."""
    cfg = ParallelConfig(pp=pp, vpp=vpp, ep=ep, recompute=recompute, moe_a2a_overlap=True)
    case = Case(cfg, model=None, num_devices=0, global_batch_size=0, layers_per_stage=None, any_split=False)
    return any(check(case) is not None for check in OVERLAP_RULES)


def refused_by_sizes(cfg: ParallelConfig, model: ModelSpec) -> bool:
    """Whether a rule of SIZE_RULES refuses `cfg` (its other fields at their defaults), whatever the rest."""
    case = Case(cfg, model, num_devices=0, global_batch_size=0, layers_per_stage=None, any_split=False)
    return any(check(case) is not None for check in SIZE_RULES)


def refused_by_pipeline(pp: int, vpp: int, mbs: int, dp: int, *, model: ModelSpec, global_batch_size: int,
                        layers_per_stage: tuple[int, ...] | None = None, any_split: bool = False,
                        form: SplitForm = EVEN, microbatch_group_size_per_vp_stage: int | None = None) -> bool:
    """Whether a rule of PIPELINE_RULES refuses these sizes (the other fields at their defaults), whatever the rest."""
    cfg = ParallelConfig(pp=pp, vpp=vpp, mbs=mbs, dp=dp,
                         microbatch_group_size_per_vp_stage=microbatch_group_size_per_vp_stage)
    case = Case(cfg, model, num_devices=0,
                global_batch_size=global_batch_size, layers_per_stage=layers_per_stage, any_split=any_split, form=form)
    return any(check(case) is not None for check in PIPELINE_RULES)


def violation(
    cfg: ParallelConfig,
    *,
    model: ModelSpec,
    num_devices: int,
    global_batch_size: int,
    layers_per_stage: tuple[int, ...] | None = None,
    any_split: bool = False,
    tp_comm_overlap: bool = False,
    form: SplitForm = EVEN,
) -> str | None:
    """The first Megatron rule `cfg` breaks, as one line, or None when it can launch.

    The layers are split evenly unless `layers_per_stage` (the layers of each pipeline rank or model chunk) or
    `form` (Megatron's flags for a split: parallel.layout) gives the split; `any_split` asks whether some split the
    planner searches can launch; `tp_comm_overlap`: whether the launch overlaps TP communication (--tp-comm-overlap).
    """
    case = Case(cfg, model, num_devices, global_batch_size, layers_per_stage, any_split, tp_comm_overlap, form)
    for check in _CHECKS:
        line = check(case)
        if line is not None:
            return line
    return None


_CHECKS = tuple(rule.check for rule in RULES)  # in RULES' order, without a lookup per rule per configuration

# The rules that read a configuration's recompute fields (recompute, recompute_num_layers, recompute_modules), its
# EP all-to-all overlap or its offloaded layers, and of the rest only pp, vpp and ep. The others answer the same for
# every recompute, overlap and offload choice of a configuration (its variants), so the search judges each half once
# for all the configurations that share its fields (solver/space.py; tests/test_search_space.py
# holds this split to the rules).
VARIANT_RULES = frozenset({"recompute-kind", "recompute-modules", "recompute-layers-full", "recompute-layers-range",
                           "a2a-overlap-layout", "a2a-overlap-recompute", "cpu-offloading"})
Broken = tuple[int, str]  # a broken rule's position in RULES and its line


def broken_apart(cfg: ParallelConfig, *, variant: bool, model: ModelSpec, num_devices: int, global_batch_size: int,
                 layers_per_stage: tuple[int, ...] | None = None, any_split: bool = False,
                 tp_comm_overlap: bool = False, form: SplitForm = EVEN) -> Broken | None:
    """The first rule `cfg` breaks among VARIANT_RULES (`variant`) or among the others: with the other half's,
    first_of gives violation()'s line."""
    case = Case(cfg, model, num_devices, global_batch_size, layers_per_stage, any_split, tp_comm_overlap, form)
    for position, check in _VARIANT_CHECKS if variant else _OTHER_CHECKS:
        line = check(case)
        if line is not None:
            return position, line
    return None


def first_of(*broken: Broken | None) -> str | None:
    """The line of the earliest rule in RULES among those broken (None: none is)."""
    found = [b for b in broken if b is not None]
    return min(found)[1] if found else None


_VARIANT_CHECKS = tuple((i, rule.check) for i, rule in enumerate(RULES) if rule.id in VARIANT_RULES)
_OTHER_CHECKS = tuple((i, rule.check) for i, rule in enumerate(RULES) if rule.id not in VARIANT_RULES)


# --- rules on the model alone (config/load.py checks them when the model is loaded) ---------------------------
def _moe_pattern(m: ModelConfig):
    """--moe-layer-freq is an integer (its range: config/load.py), or a list of 0 / 1 with one entry per layer."""
    freq = m.moe_layer_freq
    if isinstance(freq, bool) or not isinstance(freq, (int, list, tuple)):
        return f"model.moe_layer_freq={freq}: an integer N (every N-th layer MoE) or a list of 0/1, one per layer"
    if isinstance(freq, int):
        return None
    if len(freq) != m.num_layers:
        return f"model.moe_layer_freq: {len(freq)} entries, but model.num_layers={m.num_layers}; one 0/1 per layer"
    if any(x not in (0, 1) or isinstance(x, bool) for x in freq):
        return f"model.moe_layer_freq={list(freq)}: entries are 0 (dense) or 1 (MoE)"
    if m.num_experts and 1 not in freq:
        return "model.moe_layer_freq: no 1 in the list, so no MoE layer; drop model.num_experts or add 1s"


def _mla_gqa(m: ModelConfig):
    """Multi-head latent attention has no query groups."""
    if m.multi_latent_attention and m.num_query_groups not in (None, m.num_attention_heads):
        return (f"model.num_query_groups={m.num_query_groups} with model.multi_latent_attention=true: MLA has no query "
                "groups (Megatron asserts group-query attention is exclusive with it); set model.num_query_groups=null")


def _group_topk_needs_groups(m: ModelConfig):
    """Group-limited routing needs the number of groups."""
    if m.moe_router_group_topk is not None and m.moe_router_num_groups is None:
        return (f"model.moe_router_group_topk={m.moe_router_group_topk} without model.moe_router_num_groups: "
                "group-limited routing needs the number of expert groups")


def _group_routing_moe(m: ModelConfig):
    """Group-limited routing needs a MoE model."""
    if m.moe_router_group_topk is not None and not m.num_experts:
        return "model.moe_router_group_topk: group-limited routing needs a MoE model (model.num_experts)"


def _groups_divide_experts(m: ModelConfig):
    """The expert groups divide the experts."""
    g = m.moe_router_num_groups
    if m.moe_router_group_topk and m.num_experts and m.num_experts % g:
        return f"model.moe_router_num_groups={g}: must divide model.num_experts={m.num_experts}"


def _group_topk_groups(m: ModelConfig):
    """A token takes its experts from at most as many groups as there are."""
    k, g = m.moe_router_group_topk, m.moe_router_num_groups
    if k and m.num_experts and k > g:
        return f"model.moe_router_group_topk={k}: allowed 1..{g} (model.moe_router_num_groups)"


def _topk_in_groups(m: ModelConfig):
    """The top-k experts fit in the selected groups, and each selected group is scored by at least one expert."""
    k, g, topk = m.moe_router_group_topk, m.moe_router_num_groups, m.moe_router_topk
    if not (k and m.num_experts) or m.num_experts % g or k > g:
        return None
    room = k * (m.num_experts // g)
    if not k <= topk <= room:
        return (f"model.moe_router_topk={topk} with {k} of {g} expert groups: allowed {k}..{room} (a group is scored "
                f"by its top topk // group_topk experts, and the top-k come from the selected groups' {room} experts)")


def _latent_moe(m: ModelConfig):
    """A MoE latent size needs experts."""
    if m.moe_latent_size is not None and not m.num_experts:
        return (f"model.moe_latent_size={m.moe_latent_size} without model.num_experts: MoE latent projections are "
                "applicable only for MoE models (Megatron asserts it)")


def _latent_moe_te(m: ModelConfig):
    """A MoE latent size needs Transformer Engine's layer spec (not the local spec, which a traced model runs)."""
    if m.moe_latent_size is not None and m.transformer_impl == "local":
        traced = f" (model.source={m.source} traces megatron-core's local spec)" if m.source != "analytic" else ""
        return (f"model.moe_latent_size={m.moe_latent_size} with model.transformer_impl=local{traced}: megatron-core "
                "builds the latent projections as Transformer Engine's TELinear and the local spec's grouped experts "
                "refuse a latent size; plan it with Transformer Engine's spec and the analytic model")


def _capacity_moe(m: ModelConfig):
    """Token dropping needs a MoE model."""
    if (m.moe_expert_capacity_factor is not None or m.moe_pad_expert_input_to_capacity) and not m.num_experts:
        return ("model.moe_expert_capacity_factor / moe_pad_expert_input_to_capacity without model.num_experts: only "
                "experts have a capacity")


def _pad_needs_capacity(m: ModelConfig):
    """Padding the experts' input to capacity needs a capacity factor."""
    if m.moe_pad_expert_input_to_capacity and m.moe_expert_capacity_factor is None:
        return ("model.moe_pad_expert_input_to_capacity=true without model.moe_expert_capacity_factor: megatron-core "
                "pads each expert's input to its capacity, set by the factor (e.g. 1.0)")


def _capacity_traced(m: ModelConfig):
    """Token dropping is priced by the analytic model (a traced model is routed dropless)."""
    traced = m.source == "megatron" or m.source == "hf" and m.transformer_impl == "local"  # trace/source.py resolve
    if m.moe_expert_capacity_factor is not None and traced:
        return (f"model.moe_expert_capacity_factor={m.moe_expert_capacity_factor} with the traced "
                f"model.source={m.source}: the trace routes every token (dropless); plan token dropping with "
                "model.source=analytic")


# In order. Each check takes the ModelConfig and returns its one-line message, or None.
MODEL_RULES = (
    Rule("moe-layer-pattern", f"{MC}models/gpt/gpt_layer_specs.py:653, 671 ({ARGS}:327 moe_freq_type)", _moe_pattern),
    Rule("mla-gqa", f"{ARGS}:1974", _mla_gqa),
    Rule("group-topk-needs-groups", f"{TC}:2677", _group_topk_needs_groups),
    Rule("group-routing-moe", "nest: the router of a dense model routes nothing", _group_routing_moe),
    Rule("groups-divide-experts", f"{TC}:2682", _groups_divide_experts),
    Rule("group-topk-groups", f"{TC}:2686", _group_topk_groups),
    Rule("topk-in-groups", f"nest: {MC}transformer/moe/moe_utils.py:712, 726 (group_limited_topk scores a group by "
         "its top topk // group_topk experts and takes the top-k of the masked scores: Megatron asserts neither)",
         _topk_in_groups),
    Rule("latent-moe", f"{ARGS}:1980-1982 (megatron-core 0.16.1's Megatron-LM, core_v0.16.1 arguments.py:1269-1271)",
         _latent_moe),
    Rule("latent-moe-te", f"{MC}transformer/moe/moe_layer.py:266-267 (assert HAVE_TE: fc1_latent_proj and "
         "fc2_latent_proj are TELinear; megatron-core 0.16.1 moe_layer.py:170-171); the local spec's grouped experts are "
         "the legacy GroupedMLP, megatron-core 0.16.1 experts.py:86-87 (core_v0.16.1 arguments.py:1273); nest: "
         "model.transformer_impl=local is the planner's Transformer-Engine-free spec, which model.source=megatron traces "
         "(and hf with it)", _latent_moe_te),
    Rule("capacity-moe", "nest: a dense model routes nothing (Megatron-LM would ignore the factor)", _capacity_moe),
    Rule("pad-needs-capacity", f"{TC}:1862-1866", _pad_needs_capacity),
    Rule("capacity-traced", "nest: trace/cpu_megatron.py routes the traced layer's tokens balanced and dropless",
         _capacity_traced),
)


def model_violation(model: ModelConfig) -> str | None:
    """The first rule of `MODEL_RULES` the model breaks, as one line, or None."""
    for rule in MODEL_RULES:
        line = rule.check(model)
        if line is not None:
            return line
    return None
