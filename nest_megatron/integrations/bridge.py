"""A plan as Megatron-Bridge overrides on its ConfigContainer (Hydra override words, Python, or applied).

Field names follow megatron-bridge 0.3.1 (PyPI), megatron/bridge/training/config.py:
- ConfigContainer: model, train, optimizer, ddp, checkpoint, dist;
- model.*: the GPTModelProvider, a megatron.core TransformerConfig (tensor_/pipeline_/virtual_pipeline_/
  context_/expert_model_parallel_size, expert_tensor_parallel_size, sequence_parallel,
  pipeline_model_parallel_layout, recompute_granularity / method / num_layers, recompute_modules with selective
  recompute, moe_token_dispatcher_type and moe_grouped_gemm of a MoE model, cp_comm_type with CP), as
  recipes/llama/llama3.py sets them (cfg.model.tensor_model_parallel_size = 1);
- train.micro_batch_size / global_batch_size: TrainingConfig;
- optimizer.use_distributed_optimizer and ddp.use_distributed_optimizer: Bridge turns both on when either is
  on (_validate_and_sync_distributed_optimizer_settings), so ZeRO-0 sets both off;
- ddp.use_megatron_fsdp, ddp.data_parallel_sharding_strategy ("no_shard" in recipes/llama/llama3.py),
  checkpoint.ckpt_format ("fsdp_dtensor" is required with Megatron-FSDP), dist.use_tp_pp_dp_mapping;
- model.init_model_with_meta_device (ZeRO-3 only, as on the Megatron argv): models/gpt_provider.py:177 declares
  it on GPTModelProvider, :254 builds the model under torch.device("meta") when set, and
  models/model_provider.py:580 (get_model) then skips .cuda(), leaving Megatron-FSDP to materialise each
  rank's shard; false below ZeRO-3 (a config's True would leave DDP meta tensors). Bridge's Megatron-FSDP overrides
  set it with optim_grads_params (scripts/performance/utils/overrides.py:86, git tag v0.3.1 = 9c9dd848).
- mixed_precision: ConfigContainer.mixed_precision (config.py:1344) is a MixedPrecisionConfig or the name of a
  registered one, which the recipes use ("bf16_mixed", recipes/common.py:124); its fp8 fields overwrite the model's
  at setup (training/mixed_precision.py:125-143), so an FP8 plan sets the name of Bridge's config for its recipe
  (training/mixed_precision.py: bf16_with_fp8_delayed_scaling_mixed :204, bf16_with_fp8_current_scaling_mixed
  (tensorwise) :272, bf16_with_fp8_subchannel_scaling_mixed (blockwise) :360, all fp8 "hybrid"; bf16_with_mxfp8_mixed
  :242, whose fp8 is "e4m3"); a bf16 plan leaves the recipe's precision as it is;
- model.tp_comm_overlap: the TransformerConfig (ModelParallelConfig) field that training/initialize.py:226 reads
  to set up Transformer Engine's userbuffers, as the argv's --tp-comm-overlap (a recipe's own comm_overlap, a
  CommOverlapConfig, applies its choice over it at setup: training/comm_overlap.py:581).
Bridge reads these words with Hydra's override parser (training/utils/omegaconf_utils.py,
parse_hydra_overrides), hence the Hydra literals of the CLI form.
"""

from __future__ import annotations

from typing import Any

from nest_megatron.integrations.nemo import FSDP_SHARDING, meta_device_init
from nest_megatron.integrations.overrides import (
    Overrides,
    apply_overrides,
    flag_value,
    fp8_recipe,
    is_moe,
    offloading_overrides,
    precision_aware_optimizer,
    uneven_layout,
)
from nest_megatron.plan import Plan


def bridge_overrides(plan: Plan) -> Overrides:
    p, rc = plan.parallel, plan.recompute
    out: Overrides = {
        "model.tensor_model_parallel_size": p["tp"],
        "model.pipeline_model_parallel_size": p["pp"],
        "model.virtual_pipeline_model_parallel_size": p["vpp"] if p["vpp"] > 1 else None,
        # the interleaved schedule's micro-batch groups the plan is priced with (None: pp, megatron-core's default)
        "model.microbatch_group_size_per_vp_stage": p.get("microbatch_group_size_per_vp_stage"),
        "model.context_parallel_size": p["cp"],
        "model.expert_model_parallel_size": p["ep"],
    }
    if p["cp"] > 1:  # Transformer Engine's exchange the plan prices (TransformerConfig.cp_comm_type)
        out["model.cp_comm_type"] = flag_value(plan, "--cp-comm-type")
    if is_moe(plan):
        out["model.expert_tensor_parallel_size"] = p["etp"]
        out["model.moe_token_dispatcher_type"] = flag_value(plan, "--moe-token-dispatcher-type")  # the one priced
        if flag_value(plan, "--moe-flex-dispatcher-backend") == "deepep":
            out["model.moe_enable_deepep"] = True  # the spelling older megatron-core releases have too
        out["model.moe_grouped_gemm"] = "--moe-grouped-gemm" in plan.megatron_args  # the experts' kernel priced
        # the EP all-to-all overlap priced (ModelParallelConfig / TransformerConfig fields; a recipe's CommOverlapConfig
        # sets the same two at setup, Megatron-Bridge scripts/performance/utils/helpers.py:182-186 at v0.2.0)
        out["model.overlap_moe_expert_parallel_comm"] = "--overlap-moe-expert-parallel-comm" in plan.megatron_args
        out["model.delay_wgrad_compute"] = "--delay-wgrad-compute" in plan.megatron_args
    out |= {
        "model.sequence_parallel": bool(p["sp"]),
        "model.pipeline_model_parallel_layout": uneven_layout(plan),
        "model.recompute_granularity": rc["granularity"],
        "model.recompute_method": rc["method"],
        "model.recompute_num_layers": rc["num_layers"],
        "train.micro_batch_size": plan.micro_batch_size,
        "train.global_batch_size": plan.global_batch_size,
        "optimizer.use_distributed_optimizer": plan.zero_stage >= 1,
        "ddp.use_distributed_optimizer": plan.zero_stage >= 1,
        "ddp.use_megatron_fsdp": plan.zero_stage >= 2,
        "ddp.data_parallel_sharding_strategy": FSDP_SHARDING.get(plan.zero_stage, "no_shard"),
        "dist.use_tp_pp_dp_mapping": "--use-tp-pp-dp-mapping" in plan.megatron_args,
        "model.init_model_with_meta_device": meta_device_init(plan),
    }
    if plan.zero_stage >= 2:
        out["checkpoint.ckpt_format"] = "fsdp_dtensor"
    if rc["granularity"] == "selective":  # the modules priced (megatron.core TransformerConfig.recompute_modules)
        out["model.recompute_modules"] = list(rc["modules"])
    if precision_aware_optimizer(plan):  # megatron-core OptimizerConfig, as on the argv
        out["optimizer.use_precision_aware_optimizer"] = True
    out["model.tp_comm_overlap"] = "--tp-comm-overlap" in plan.megatron_args
    # the datatypes the plan is priced in: DistributedDataParallelConfig.grad_reduce_in_fp32 and
    # TransformerConfig.cross_entropy_loss_fusion (megatron-core)
    out["ddp.grad_reduce_in_fp32"] = "--grad-reduce-in-bf16" not in plan.megatron_args
    # the sharded state's replicas the memory is priced with (DistributedDataParallelConfig), a recipe's own replaced
    out["ddp.num_distributed_optimizer_instances"] = plan.parallel.get("distributed_optimizer_instances", 1)
    out.update(offloading_overrides(plan, "model"))
    out["model.cross_entropy_loss_fusion"] = "--cross-entropy-loss-fusion" in plan.megatron_args
    if fp8_recipe(plan):
        out["mixed_precision"] = BRIDGE_FP8[fp8_recipe(plan)]
    return out


# Bridge's registered mixed-precision config for each FP8 recipe (megatron/bridge/training/mixed_precision.py)
BRIDGE_FP8 = {"delayed": "bf16_with_fp8_delayed_scaling_mixed", "tensorwise": "bf16_with_fp8_current_scaling_mixed",
              "blockwise": "bf16_with_fp8_subchannel_scaling_mixed", "mxfp8": "bf16_with_mxfp8_mixed"}


def apply_to_config(container: Any, plan: Plan) -> Any:
    """Set the plan on a Megatron-Bridge ConfigContainer (e.g. llama3_8b_pretrain_config()) in place."""
    return apply_overrides(container, bridge_overrides(plan), root_name="config")
