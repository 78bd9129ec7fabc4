"""Megatron's feasibility rules for a configuration, written once, as one table with sources.

Config validation, the planner's search space, `evaluate` and the argv emitter all ask
`violation(...)`; it returns the line of the first rule of `RULES` the configuration breaks. Each
rule's source is a file:line of Megatron-LM at `MEGATRON_LM_COMMIT` (megatron/...), an upstream issue
or PR, or `nest:` for the planner's own policy where Megatron would launch but the plan is pointless
or undefined. docs/megatron_rules.md lists them (launch/megatron_rules.rules_doc writes it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from nest_megatron.model.spec import ModelSpec
from nest_megatron.parallel.config import RANK_ORDERS, RECOMPUTE_KINDS, ZERO_STAGES, ParallelConfig

# The Megatron-LM commit the sources below were read at (github.com/NVIDIA/Megatron-LM, 2026-08-22).
MEGATRON_LM_COMMIT = "d98e8a64ddf34856e74b24714e3bedb2f5a39553"


@dataclass(frozen=True)
class Rule:
    id: str
    source: str
    check: Callable  # the case -> its one-line message, or None when the rule holds; its docstring says what it asks


@dataclass(frozen=True)
class Case:
    """What a rule of `RULES` looks at."""
    cfg: ParallelConfig
    model: ModelSpec
    num_devices: int
    global_batch_size: int
    layers_per_stage: tuple[int, ...] | None
    any_split: bool


def num_microbatches(cfg: ParallelConfig, global_batch_size: int) -> int:
    return global_batch_size // (cfg.mbs * cfg.dp)


def _positive(c: Case):
    """Every size is a positive integer."""
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


def _sp_tp(c: Case):
    """Sequence parallel needs TP > 1."""
    if c.cfg.sp and c.cfg.tp == 1:
        return "plan.sp=true: sequence parallel needs tp > 1"


def _moe_sp(c: Case):
    """A MoE model with TP > 1 trains only with sequence parallel."""
    if c.model.is_moe and c.cfg.tp > 1 and not c.cfg.sp:
        return f"plan.tp={c.cfg.tp} with MoE: Megatron requires sequence parallel (plan.sp=true)"


def _cp_unfused(c: Case):
    """Context parallel needs a fused attention (TE's DotProductAttention)."""
    if c.cfg.cp > 1 and c.model.cfg.attention_backend == "unfused":
        return (f"plan.cp={c.cfg.cp} with model.attention_backend=unfused: unfused attention has no context parallel "
                "(Megatron's fused and flash backends do); use plan.cp=1")


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


def _uneven_stages(c: Case):
    """An uneven split has at most one stage per layer."""
    uneven = c.any_split and c.layers_per_stage is None and c.cfg.vpp == 1
    if uneven and c.cfg.pp > c.model.cfg.num_layers:
        return f"plan.pp={c.cfg.pp}: more stages than num_layers={c.model.cfg.num_layers}"


def _even_split(c: Case):
    """Without a layout, pp x vpp divides the layers."""
    uneven = c.layers_per_stage is not None or (c.any_split and c.cfg.vpp == 1)
    if not uneven and c.model.cfg.num_layers % (c.cfg.pp * c.cfg.vpp):
        return (f"plan.pp={c.cfg.pp} x plan.vpp={c.cfg.vpp}: must divide num_layers={c.model.cfg.num_layers} "
                "for an even split")


def _vpp_pp(c: Case):
    """Virtual stages need PP > 1."""
    if c.cfg.vpp > 1 and c.cfg.pp == 1:
        return f"plan.vpp={c.cfg.vpp}: virtual pipeline stages need pp > 1"


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


def _interleaved_microbatches(c: Case):
    """The interleaved schedule needs a multiple of pp micro-batches."""
    microbatches = num_microbatches(c.cfg, c.global_batch_size)
    if c.cfg.vpp > 1 and microbatches % c.cfg.pp:
        return f"{microbatches} micro-batches: the interleaved schedule needs a multiple of pp={c.cfg.pp}"


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


MC = "megatron/core/"
TC = MC + "transformer/transformer_config.py"
ARGS = "megatron/training/arguments.py"
# In order: a rule may assume the rules above it hold (positive sizes, a known ZeRO stage, ...).
RULES = (
    Rule("positive", "nest: argparse takes any integer; a size below 1 is no configuration", _positive),
    Rule("zero-stage", "nest: the ZeRO stages emit/megatron.py ZERO_FLAGS realises", _zero_stage),
    Rule("recompute-kind", f"{TC}:1904", _recompute_kind),
    Rule("rank-order", "megatron/training/initialize.py:395", _rank_order),
    Rule("fsdp-order", "Megatron-Bridge src/megatron/bridge/training/config.py@4feb11f "
         "(assert not use_tp_pp_dp_mapping with Megatron FSDP)", _fsdp_order),
    Rule("fsdp-pp", f"{MC}distributed/fsdp/mcore_fsdp_adapter.py:820 (_get_dp_tp_mesh); "
         "Megatron-LM issue #1455, PR #6081", _fsdp_pp),
    Rule("world", "nest: the plan's ranks run on the cluster's devices", _world),
    Rule("tp-heads", f"{TC}:1446", _tp_heads),
    Rule("tp-query-groups", f"{TC}:1462 (stricter: Megatron also takes tp a multiple of the groups, replicating "
         "KV heads, which the cost model does not price)", _tp_query_groups),
    Rule("sp-tp", f"{MC}model_parallel_config.py:504 ({ARGS}:1433 turns it off silently)", _sp_tp),
    Rule("moe-sp", f"{MC}transformer/moe/moe_layer.py:636", _moe_sp),
    Rule("cp-unfused", f"{MC}transformer/dot_product_attention.py:58", _cp_unfused),
    Rule("cp-seq", f"{ARGS}:1336", _cp_seq),
    Rule("sp-seq", f"{MC}tensor_parallel/mappings.py:73", _sp_seq),
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
    Rule("uneven-stages", "nest: each stage of an uneven split the planner chooses holds a layer", _uneven_stages),
    Rule("even-split", f"{ARGS}:969, 973, 998 (not with a layout: {ARGS}:941)", _even_split),
    Rule("vpp-pp", f"{MC}parallel_state.py:830", _vpp_pp),
    Rule("global-batch", f"{MC}num_microbatches_calculator.py:381", _global_batch),
    Rule("fill-pipeline", "nest: 1F1B with fewer micro-batches than stages leaves stages idle", _fill_pipeline),
    Rule("interleaved-microbatches", f"{MC}pipeline_parallel/schedules.py:1173", _interleaved_microbatches),
    Rule("recompute-layers-full", f"{TC}:1931", _recompute_layers_full),
    Rule("recompute-layers-range", f"{TC}:1922 (per virtual stage: nest)", _recompute_layers_range),
)


def violation(
    cfg: ParallelConfig,
    *,
    model: ModelSpec,
    num_devices: int,
    global_batch_size: int,
    layers_per_stage: tuple[int, ...] | None = None,
    any_split: bool = False,
) -> str | None:
    """The first Megatron rule `cfg` breaks, as one line, or None when it can launch.

    The layers are split evenly unless `layers_per_stage` gives the split (Megatron's
    --pipeline-model-parallel-layout); `any_split` asks whether some split can launch.
    """
    case = Case(cfg, model, num_devices, global_batch_size, layers_per_stage, any_split)
    for rule in RULES:
        line = rule.check(case)
        if line is not None:
            return line
    return None
