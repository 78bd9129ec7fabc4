"""Megatron-LM arguments for a configuration: returned as an argv list, rendered elsewhere."""

from __future__ import annotations

from nest_megatron.cost.tables import chunk_split
from nest_megatron.model.spec import ModelSpec
from nest_megatron.parallel.config import DEFAULT_RECOMPUTE_MODULES, ParallelConfig
from nest_megatron.parallel.layout import ACCOUNT_FIELDS, EVEN, FIRST_LAST_FIELDS, flag_of, piped_pattern, simplest_form

# How each ZeRO stage is realised in Megatron-LM. ZeRO-3 builds the model on the meta device and lets
# Megatron-FSDP materialise only each rank's shard (training.py get_model); else every rank first
# allocates the whole unsharded stage, which is what ZeRO-3 was chosen to avoid.
# train.moe_dispatcher -> its Megatron flags. DeepEP is the flex dispatcher's backend (megatron-core
# transformer_config.py moe_flex_dispatcher_backend; its default, named so that the argv says it).
DISPATCHER_FLAGS = {
    "alltoall": ["--moe-token-dispatcher-type", "alltoall"],
    "allgather": ["--moe-token-dispatcher-type", "allgather"],
    "deepep": ["--moe-token-dispatcher-type", "flex", "--moe-flex-dispatcher-backend", "deepep"],
}
# The precision-aware optimizer's dtype flags (training/arguments.py:3671-3685) -> the OptimizerDtypes field.
OPTIMIZER_DTYPE_FLAGS = {"--main-params-dtype": "main_params", "--exp-avg-dtype": "exp_avg",
                         "--exp-avg-sq-dtype": "exp_avg_sq"}


ZERO_FLAGS = {
    0: [],
    1: ["--use-distributed-optimizer"],
    2: ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads", "--ckpt-format", "fsdp_dtensor"],
    3: ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads_params", "--ckpt-format", "fsdp_dtensor",
        "--init-model-with-meta-device"],
}


def recompute_settings(cfg: ParallelConfig, layers_per_chunk: int) -> dict:
    """Megatron's recompute granularity / method / num_layers for the configuration, and with selective recompute
    its modules."""
    if cfg.recompute == "none":
        return {"granularity": None, "method": None, "num_layers": None}
    if cfg.recompute == "selective":
        return {"granularity": "selective", "method": None, "num_layers": None, "modules": list(cfg.recompute_modules)}
    if cfg.recompute_num_layers is None:
        return {"granularity": "full", "method": "uniform", "num_layers": 1}
    return {"granularity": "full", "method": "block", "num_layers": min(cfg.recompute_num_layers, layers_per_chunk)}


def fp8_format(recipe: str) -> str:
    """--fp8-format for a recipe: e4m3 everywhere for MXFP8, as Transformer Engine's MXFP8BlockScaling defaults to
    (common/recipe/__init__.py:290 at v2.11) and Megatron-Bridge's bf16_with_mxfp8_mixed sets (src/megatron/bridge/
    training/mixed_precision.py:262 at 067f987); hybrid (e4m3 forward, e5m2 gradients) for the other recipes.
    Megatron takes either with any recipe (megatron/core/fp8_utils.py:761-766); the argv's own --fp8-format stays
    (it is not a planner flag), and both are priced alike."""
    return "e4m3" if recipe == "mxfp8" else "hybrid"


def model_args(model: ModelSpec, *, tp: int) -> list[str]:
    """The model-shape flags, so that the argv is complete for pretrain_gpt.py, the embedding's rows as priced at
    `tp` (--padded-vocab-size: whatever the tokenizer, Megatron builds that many,
    megatron/training/argument_utils.py:474-476), and the datatypes
    it is priced in (model.numerics): with fp8 Megatron's FP8 flags (`fp8_format`; bf16 stays the dtype of the rest), bf16 gradient reduction, the fused cross entropy, the precision-aware optimizer."""
    m = model.cfg
    args = [
        "--num-layers", str(m.num_layers),
        "--hidden-size", str(m.hidden_size),
        "--ffn-hidden-size", str(m.ffn_hidden_size),
        "--num-attention-heads", str(m.num_attention_heads),
        "--seq-length", str(m.seq_length),
        "--max-position-embeddings", str(m.seq_length),
        "--position-embedding-type", m.position_embedding_type,
        "--normalization", m.normalization,
        "--hidden-dropout", str(m.hidden_dropout),
        "--attention-dropout", str(m.attention_dropout),
        "--make-vocab-size-divisible-by", str(m.make_vocab_size_divisible_by),
        "--padded-vocab-size", str(model.padded_vocab(tp)),
        "--bf16",
    ]
    numerics = model.numerics
    if numerics.fp8_recipe:
        args += ["--fp8-format", fp8_format(numerics.fp8_recipe), "--fp8-recipe", numerics.fp8_recipe]
    if numerics.grad_reduce_in_bf16:
        args.append("--grad-reduce-in-bf16")
    if numerics.cross_entropy_fusion:
        args.append("--cross-entropy-loss-fusion")
    if numerics.optimizer_dtypes is not None:
        args.append("--use-precision-aware-optimizer")
        for flag, field in OPTIMIZER_DTYPE_FLAGS.items():
            dtype = getattr(numerics.optimizer_dtypes, field)
            if dtype != "fp32":  # Megatron's default
                args += [flag, dtype]
    if model.query_groups != model.heads:
        args += ["--group-query-attention", "--num-query-groups", str(model.query_groups)]
    if m.kv_channels:
        args += ["--kv-channels", str(m.kv_channels)]
    if m.swiglu:
        args.append("--swiglu")
    if m.squared_relu:
        args.append("--squared-relu")
    if m.qk_layernorm:
        args.append("--qk-layernorm")
    if m.window_size:  # a causal window of N past tokens: Megatron's (left, right) tuple
        args += ["--window-size", f"{m.window_size},0"]
        if m.window_attn_skip_freq:
            args += ["--window-attn-skip-freq", str(m.window_attn_skip_freq)]
    if m.softmax_type != "vanilla":  # Megatron's default; the others decide which CP exchange runs (parallel/rules.py)
        args += ["--softmax-type", m.softmax_type]
    if m.hybrid_layer_pattern:  # a MambaModel (pretrain_mamba.py): the Mamba mixer's sizes (its pattern: split_args)
        args += ["--mamba-state-dim", str(m.mamba_state_dim), "--mamba-head-dim", str(m.mamba_head_dim),
                 "--mamba-num-groups", str(m.mamba_num_groups)]
        if m.mamba_num_heads:
            args += ["--mamba-num-heads", str(m.mamba_num_heads)]
    if m.untie_embeddings_and_output_weights:
        args.append("--untie-embeddings-and-output-weights")
    if not m.add_bias_linear:
        args.append("--disable-bias-linear")
    if m.multi_latent_attention:  # Megatron's defaults are not MLATransformerConfig's: every width is spelt out
        args += ["--multi-latent-attention", "--kv-lora-rank", str(m.kv_lora_rank), "--qk-head-dim", str(m.qk_head_dim),
                 "--qk-pos-emb-head-dim", str(m.qk_pos_emb_head_dim), "--v-head-dim", str(m.v_head_dim)]
        if m.q_lora_rank is not None:
            args += ["--q-lora-rank", str(m.q_lora_rank)]
    if model.is_moe:
        args += ["--num-experts", str(m.num_experts), "--moe-router-topk", str(m.moe_router_topk)]
        if m.moe_layer_freq != 1:
            args += ["--moe-layer-freq", moe_layer_freq_arg(m.moe_layer_freq)]
        if m.moe_ffn_hidden_size:
            args += ["--moe-ffn-hidden-size", str(m.moe_ffn_hidden_size)]
        if m.moe_shared_expert_intermediate_size:
            args += ["--moe-shared-expert-intermediate-size", str(m.moe_shared_expert_intermediate_size)]
            if m.moe_shared_expert_overlap:
                args.append("--moe-shared-expert-overlap")
        if m.moe_latent_size:
            args += ["--moe-latent-size", str(m.moe_latent_size)]
        if m.moe_router_group_topk:
            args += ["--moe-router-num-groups", str(m.moe_router_num_groups),
                     "--moe-router-group-topk", str(m.moe_router_group_topk)]
        if m.moe_expert_capacity_factor is not None:
            args += ["--moe-expert-capacity-factor", str(m.moe_expert_capacity_factor)]
        if m.moe_pad_expert_input_to_capacity:
            args.append("--moe-pad-expert-input-to-capacity")
    if m.mtp_num_layers:
        args += ["--mtp-num-layers", str(m.mtp_num_layers), "--mtp-loss-scaling-factor", str(m.mtp_loss_scaling_factor)]
        if m.mtp_use_repeated_layer:
            args.append("--mtp-use-repeated-layer")
    # The kernels the memory model assumed: an unfused attention keeps its softmax, an unfused
    # SwiGLU its activation; a traced model is megatron-core's local layer spec.
    if m.attention_backend != "auto":  # Megatron's default
        args += ["--attention-backend", m.attention_backend]
    if not model.fused_attention and m.attention_softmax_in_fp32:
        args.append("--attention-softmax-in-fp32")
    if m.swiglu and not m.bias_swiglu_fusion:
        args.append("--no-bias-swiglu-fusion")
    if local_spec(m):
        args += ["--transformer-impl", "local"]
    return args


def local_spec(m) -> bool:
    """Whether the model runs megatron-core's local layer spec (a traced model, or model.transformer_impl=local)
    rather than Transformer Engine's (`m`: the model's config). A Hugging Face config.json is priced with Transformer
    Engine's unless model.transformer_impl=local (trace/source.py)."""
    return m.source in ("megatron", "module") or m.transformer_impl == "local"


def moe_layer_freq_arg(freq) -> str:
    """--moe-layer-freq as Megatron reads it (arguments.py moe_freq_type): the integer, or a list of 0/1 written as
    runs, ([0]*3+[1]*58) for DeepSeek-V3's first three dense layers."""
    if isinstance(freq, int):
        return str(freq)
    runs: list[list[int]] = []
    for x in freq:
        if runs and runs[-1][0] == x:
            runs[-1][1] += 1
        else:
            runs.append([x, 1])
    return "(" + "+".join(f"[{x}]*{n}" for x, n in runs) + ")"


def split_args(cfg: ParallelConfig, *, num_layers: int, layers_per_stage: tuple[int, ...] | None,
               mtp_num_layers: int = 0, hybrid_pattern: str | None = None,
               mtp_hybrid_pattern: str | None = None) -> list[str]:
    """The simplest Megatron flags for the layer split (parallel.layout.simplest_form): none for the even split,
    --account-for-embedding/loss-in-pipeline-split, --decoder-first/last-pipeline-num-layers, else
    --pipeline-model-parallel-layout; --num-virtual-stages-per-pipeline-rank beside any but a layout, which sets
    the virtual stages itself (Megatron takes no other virtual-stage flag with it: arguments.py:928-939).
    A hybrid stack says its split, even or not, as '|' segments of its --hybrid-layer-pattern, the only way
    Megatron-LM takes one with virtual stages and the one it asks for with pp > 1 (a pattern without them is
    deprecated there: hybrid_layer_allocation.py:393-399); its multi-token-prediction depths follow, one '/' each
    (`mtp_hybrid_pattern` their layers: Megatron-LM's unified pattern)."""
    chunks = chunk_split(cfg, layers_per_stage) if layers_per_stage else None
    if hybrid_pattern is not None:
        depths = f"/{mtp_hybrid_pattern}" * mtp_num_layers if mtp_hybrid_pattern else ""
        if cfg.pp == 1:
            return ["--hybrid-layer-pattern", hybrid_pattern + depths]
        even = (num_layers // (cfg.pp * cfg.vpp),) * (cfg.pp * cfg.vpp)  # Megatron's split where none is given
        return ["--hybrid-layer-pattern", piped_pattern(hybrid_pattern, chunks or even) + depths]
    form = (simplest_form(chunks, num_layers=num_layers, pp=cfg.pp, mtp_num_layers=mtp_num_layers)
            if chunks and cfg.pp > 1 else EVEN)
    if form.pipeline_model_parallel_layout is not None:
        return ["--pipeline-model-parallel-layout", form.pipeline_model_parallel_layout]
    args = [flag_of(name) for name in ACCOUNT_FIELDS if getattr(form, name)]
    for name in FIRST_LAST_FIELDS:
        if getattr(form, name) is not None:
            args += [flag_of(name), str(getattr(form, name))]
    if cfg.vpp > 1:
        args += ["--num-virtual-stages-per-pipeline-rank", str(cfg.vpp)]
    return args


def parallel_args(
    cfg: ParallelConfig,
    *,
    model: ModelSpec,
    global_batch_size: int,
    overlap_grad_reduce: bool,
    overlap_param_gather: bool,
    layers_per_stage: tuple[int, ...] | None = None,
    tp_comm_overlap: bool = False,
    moe_dispatcher: str = "alltoall",
    delay_wgrad_compute: bool = False,
    defer_embedding_wgrad: bool = False,
) -> list[str]:
    """The flags the planner owns: parallel sizes, batch, ZeRO, recompute, layout, the MoE token dispatcher (and
    its all-to-all overlap) and Transformer Engine's context-parallel exchange."""
    args = [
        "--tensor-model-parallel-size", str(cfg.tp),
        "--pipeline-model-parallel-size", str(cfg.pp),
        "--context-parallel-size", str(cfg.cp),
        "--micro-batch-size", str(cfg.mbs),
        "--global-batch-size", str(global_batch_size),
    ]
    if model.is_moe:
        args += ["--expert-model-parallel-size", str(cfg.ep), "--expert-tensor-parallel-size", str(cfg.etp)]
        # The dispatcher the cost model priced (train.moe_dispatcher); Megatron's default is allgather.
        args += DISPATCHER_FLAGS[moe_dispatcher]
        if cfg.moe_a2a_overlap:  # as priced (cost/a2a_overlap.py)
            args.append("--overlap-moe-expert-parallel-comm")
            if delay_wgrad_compute:
                args.append("--delay-wgrad-compute")
        if not local_spec(model.cfg):
            # The experts as the cost model prices them: a stage's local experts in one grouped GEMM (model/spec.py
            # mlp_gemms), Transformer Engine's TEGroupedMLP; without the flag megatron-core runs SequentialMLP, an
            # expert at a time (models/backends.py grouped_mlp_modules). Megatron-LM asks only sm >= 8 of it
            # (arguments.py:1378-1380 at d98e8a6). The local spec's grouped experts are the legacy GroupedMLP of
            # the grouped_gemm package: not emitted there.
            args.append("--moe-grouped-gemm")
    if cfg.sp:
        args.append("--sequence-parallel")
        if tp_comm_overlap and cfg.tp > 1:  # only with sequence parallel (Megatron-LM arguments.py:1441-1442)
            args.append("--tp-comm-overlap")
    args += split_args(cfg, num_layers=model.cfg.num_layers, layers_per_stage=layers_per_stage,
                       mtp_num_layers=model.cfg.mtp_num_layers or 0, hybrid_pattern=model.cfg.hybrid_layer_pattern,
                       mtp_hybrid_pattern=model.cfg.mtp_hybrid_pattern)
    if cfg.vpp > 1 and cfg.microbatch_group_size_per_vp_stage is not None:  # read only by the interleaved schedule
        args += ["--microbatch-group-size-per-virtual-pipeline-stage", str(cfg.microbatch_group_size_per_vp_stage)]
    if defer_embedding_wgrad:  # train.defer_embedding_wgrad_compute (the plan has pp > 1: solver/space.py)
        args.append("--defer-embedding-wgrad-compute")
    if cfg.cp > 1 or cfg.cp_comm_type != "p2p":  # the exchange the cost model priced (Megatron's default: p2p)
        args += ["--cp-comm-type", cfg.cp_comm_type]
    if cfg.order == "tp-cp-ep-pp-dp":
        args.append("--use-tp-pp-dp-mapping")
    args += ZERO_FLAGS[cfg.zero]
    if cfg.distributed_optimizer_instances > 1:
        args += ["--num-distributed-optimizer-instances", str(cfg.distributed_optimizer_instances)]
    if cfg.cpu_offloading_num_layers:
        args += ["--cpu-offloading-num-layers", str(cfg.cpu_offloading_num_layers)]  # turns cpu_offloading on (:1950)
    if overlap_grad_reduce and cfg.zero in (0, 1):
        args.append("--overlap-grad-reduce")
    if overlap_param_gather and cfg.zero == 1:
        args.append("--overlap-param-gather")
    rc = recompute_settings(cfg, model.cfg.num_layers // (cfg.pp * cfg.vpp))
    if rc["granularity"]:
        args += ["--recompute-granularity", rc["granularity"]]
    if rc["method"]:
        args += ["--recompute-method", rc["method"], "--recompute-num-layers", str(rc["num_layers"])]
    if rc.get("modules") is not None and tuple(rc["modules"]) != DEFAULT_RECOMPUTE_MODULES:  # Megatron's default
        args += ["--recompute-modules", *rc["modules"]]
        # moe_act recomputes only the grouped experts' activation (transformer_config.py:1964)
        if "moe_act" in rc["modules"] and "--moe-grouped-gemm" not in args:
            args.append("--moe-grouped-gemm")
    return args
