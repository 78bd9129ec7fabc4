"""Megatron's feasibility rules, written once.

Config validation, the planner's search space, `evaluate` and the argv emitter all ask
`violation(...)`; each rule returns one line naming the value and what Megatron allows.
"""

from __future__ import annotations

from nest_megatron.model.spec import ModelSpec
from nest_megatron.parallel.config import RANK_ORDERS, RECOMPUTE_KINDS, ZERO_STAGES, ParallelConfig


def num_microbatches(cfg: ParallelConfig, global_batch_size: int) -> int:
    return global_batch_size // (cfg.mbs * cfg.dp)


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
    m = model.cfg
    for name in ("tp", "pp", "dp", "cp", "ep", "etp", "vpp", "mbs"):
        if getattr(cfg, name) < 1:
            return f"plan.{name}={getattr(cfg, name)}: must be a positive integer"
    if cfg.zero not in ZERO_STAGES:
        return f"plan.zero={cfg.zero}: allowed are {', '.join(map(str, ZERO_STAGES))}"
    if cfg.recompute not in RECOMPUTE_KINDS:
        return f"plan.recompute={cfg.recompute}: allowed are {', '.join(RECOMPUTE_KINDS)}"
    if cfg.order not in RANK_ORDERS:
        return f"plan.order={cfg.order}: Megatron launches {' or '.join(RANK_ORDERS)}"
    if cfg.zero >= 2 and cfg.order == "tp-cp-ep-pp-dp":
        return (f"plan.zero={cfg.zero} (Megatron-FSDP) with plan.order=tp-cp-ep-pp-dp: Megatron-FSDP does not "
                "support --use-tp-pp-dp-mapping; use plan.order=tp-cp-ep-dp-pp or plan.zero=0|1")
    if cfg.world > num_devices:
        return (
            f"tp*cp*pp*dp = {cfg.tp}*{cfg.cp}*{cfg.pp}*{cfg.dp} = {cfg.world} devices, "
            f"but the cluster has {num_devices}"
        )
    if m.num_attention_heads % cfg.tp:
        return f"plan.tp={cfg.tp}: must divide num_attention_heads={m.num_attention_heads}"
    if model.query_groups % cfg.tp:
        return f"plan.tp={cfg.tp}: must divide num_query_groups={model.query_groups}"
    if cfg.sp and cfg.tp == 1:
        return "plan.sp=true: sequence parallel needs tp > 1"
    if model.is_moe and cfg.tp > 1 and not cfg.sp:
        return f"plan.tp={cfg.tp} with MoE: Megatron requires sequence parallel (plan.sp=true)"
    if cfg.cp > 1 and m.attention_backend == "unfused":
        # dot_product_attention.py asserts it; TE's unfused backend has no context parallel either.
        return (f"plan.cp={cfg.cp} with model.attention_backend=unfused: unfused attention has no context parallel "
                "(Megatron's fused and flash backends do); use plan.cp=1")
    if cfg.cp > 1 and m.seq_length % (2 * cfg.cp):
        return f"plan.cp={cfg.cp}: seq_length={m.seq_length} must be a multiple of 2*cp"
    if cfg.sp and (m.seq_length // cfg.cp) % cfg.tp:
        return f"plan.sp=true: seq_length/cp={m.seq_length // cfg.cp} must be a multiple of tp={cfg.tp}"
    if cfg.ep > 1 and not model.is_moe:
        return f"plan.ep={cfg.ep}: expert parallel needs a MoE model (model.num_experts)"
    if model.is_moe:
        if m.num_experts % cfg.ep:
            return f"plan.ep={cfg.ep}: must divide num_experts={m.num_experts}"
        if (cfg.tp * cfg.cp * cfg.dp) % (cfg.etp * cfg.ep):
            return (
                f"plan.ep={cfg.ep} x plan.etp={cfg.etp}: must divide tp*cp*dp = "
                f"{cfg.tp * cfg.cp * cfg.dp} (the expert grid reuses the non-expert ranks of a stage)"
            )
        if model.moe_ffn % cfg.etp:
            return f"plan.etp={cfg.etp}: must divide the expert ffn size {model.moe_ffn}"
    elif cfg.etp != 1:
        return f"plan.etp={cfg.etp}: expert tensor parallel needs a MoE model"
    # megatron-core's initialize_model_parallel: unless pp is the slowest rank dimension, the expert
    # layers' data-parallel size tp*cp*dp/(etp*ep) must equal dp. Megatron-LM sets etp = tp for a
    # dense model too, so there context parallel alone breaks it (checked against Megatron-LM).
    expert_tp = cfg.etp if model.is_moe else cfg.tp
    if cfg.order == "tp-cp-ep-pp-dp" and cfg.pp > 1 and cfg.tp * cfg.cp * cfg.dp // (expert_tp * cfg.ep) != cfg.dp:
        return (f"plan.order=tp-cp-ep-pp-dp with plan.pp={cfg.pp}: megatron-core needs the expert data-parallel size "
                f"tp*cp*dp/(etp*ep) = {cfg.tp * cfg.cp * cfg.dp // (expert_tp * cfg.ep)} to equal dp={cfg.dp}; "
                "use plan.order=tp-cp-ep-dp-pp")
    uneven = layers_per_stage is not None or any_split
    if layers_per_stage is not None and (
        len(layers_per_stage) != cfg.pp or min(layers_per_stage) < 1 or sum(layers_per_stage) != m.num_layers
    ):
        return f"layers_per_stage={list(layers_per_stage)}: {cfg.pp} stages of at least one layer adding up to {m.num_layers}"
    if uneven and cfg.vpp == 1:
        if cfg.pp > m.num_layers:
            return f"plan.pp={cfg.pp}: more stages than num_layers={m.num_layers}"
    elif m.num_layers % (cfg.pp * cfg.vpp):
        return (
            f"plan.pp={cfg.pp} x plan.vpp={cfg.vpp}: must divide num_layers={m.num_layers} "
            "for an even split"
        )
    if cfg.vpp > 1 and cfg.pp == 1:
        return f"plan.vpp={cfg.vpp}: virtual pipeline stages need pp > 1"
    if global_batch_size % (cfg.mbs * cfg.dp):
        return (
            f"train.global_batch_size={global_batch_size}: must be a multiple of "
            f"micro_batch_size*dp = {cfg.mbs}*{cfg.dp}"
        )
    microbatches = num_microbatches(cfg, global_batch_size)
    if microbatches < cfg.pp:
        return f"{microbatches} micro-batches per iteration: need at least pp={cfg.pp} to fill the pipeline"
    if cfg.vpp > 1 and microbatches % cfg.pp:
        return f"{microbatches} micro-batches: the interleaved schedule needs a multiple of pp={cfg.pp}"
    if cfg.recompute_num_layers is not None:
        if cfg.recompute != "full":
            return "plan.recompute_num_layers: only with plan.recompute=full"
        per_chunk = m.num_layers // (cfg.pp * cfg.vpp)
        if not 1 <= cfg.recompute_num_layers <= per_chunk:
            return f"plan.recompute_num_layers={cfg.recompute_num_layers}: allowed 1..{per_chunk}"
    return None
