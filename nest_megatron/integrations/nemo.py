"""A plan as NeMo 2 recipe overrides (nemo-run CLI words, Python lines, or set on a recipe object).

Field names follow NeMo 2.7.3 (nemo_toolkit 2.7.3 on PyPI; NVIDIA/NeMo at 8cfedd72 has the same ones):
- trainer.strategy.*: nemo/lightning/pytorch/strategies/megatron_strategy.py, MegatronStrategy.__init__
  (tensor_/pipeline_/virtual_pipeline_/context_/expert_model_parallel_size, expert_tensor_parallel_size,
  sequence_parallel, pipeline_model_parallel_layout, use_tp_pp_dp_mapping, fsdp, save_ckpt_format, ddp);
- trainer.strategy.ddp: a megatron.core DistributedDataParallelConfig (recipes/llama3_8b.py, trainer());
- data.*: nemo/collections/llm/gpt/data/mock.py, MockDataModule(micro_batch_size, global_batch_size);
- model.config.*: megatron.core TransformerConfig (recompute_granularity / method / num_layers, recompute_modules
  with selective recompute, moe_token_dispatcher_type and moe_grouped_gemm of a MoE model, cp_comm_type with CP),
  as the recipes set them (recipes/qwen3_32b.py:
  recipe.model.config.recompute_granularity = "full");
- optim.config.use_distributed_optimizer: megatron.core OptimizerConfig (recipes/optim/adam.py);
- model.config.init_model_with_meta_device: a megatron.core TransformerConfig field (megatron-core 0.16.1,
  transformer_config.py:330), not a MegatronStrategy argument. In nemo_toolkit 2.7.3 (and at 8cfedd72),
  nemo/collections/llm/gpt/model/base.py:383, GPTConfig.configure_model builds the MCoreGPTModel under
  torch.device("meta") when it is set; nemo/lightning/megatron_parallel.py:575 (564 at 8cfedd72) skips
  .cuda() only with fsdp="megatron". Set as the Megatron argv sets it (ZeRO-3 only), false otherwise: a
  recipe's True with fsdp=None would leave meta tensors for .cuda(). NeMo's own Megatron-FSDP setup sets it
  with optim_grads_params (scripts/performance/helpers.py:182, set_mcore_fsdp_configs).
- trainer.plugins.fp8 / fp8_recipe: the MegatronMixedPrecision plugin (nemo/lightning/pytorch/plugins/
  mixed_precision.py:111-112, fp8=None and fp8_recipe="delayed" by default), the recipes' `plugins=bf16_mixed()`
  (recipes/llama3_8b.py:138; recipes/precision/mixed_precision.py:65-66 sets fp8 'hybrid' for FP8), as the argv's
  --fp8-format F --fp8-recipe R (F: hybrid, e4m3 for mxfp8, as NeMo's own bf16_with_mxfp8_mixed takes either);
  fp8=None for a bf16 plan.
NeMo copies optim.config.use_distributed_optimizer into the DDP config itself (MegatronStrategy.setup).
--tp-comm-overlap has no attribute path in NeMo 2: it is the MegatronCommOverlapCallback(tp_comm_overlap=True)
of trainer.callbacks (nemo/lightning/pytorch/callbacks/megatron_comm_overlap.py:85), which also initialises
Transformer Engine's userbuffers (:290); model.config.tp_comm_overlap alone would not. Add that callback for a
plan whose argv has --tp-comm-overlap; these overrides leave it out.
The EP all-to-all overlap (--overlap-moe-expert-parallel-comm, plan.moe_a2a_overlap) has no NeMo 2 form: megatron-core's
combined 1F1B schedule calls the forward step with return_schedule_plan=True (megatron/core/pipeline_parallel/
combined_1f1b.py:342 at 0.16.1), which NeMo 2.7.3's wrapped_forward_step_func(dataloader_iter, model) does not take
(nemo/lightning/megatron_parallel.py:511), so such a plan is refused rather than set without the overlap it was priced with.
NeMo 3.0 dropped nemo.collections.llm, hence the [nemo] extra's <2.8 bound.
"""

from __future__ import annotations

from typing import Any

from nest_megatron.emit.megatron import ZERO_FLAGS
from nest_megatron.errors import NestError
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

# Megatron-FSDP's sharding strategy for ZeRO-2 / ZeRO-3 (the --data-parallel-sharding-strategy of the argv)
FSDP_SHARDING = {2: "optim_grads", 3: "optim_grads_params"}


def meta_device_init(plan: Plan) -> bool:
    """Whether the model is built on the meta device, as the Megatron argv says (--init-model-with-meta-device:
    ZeRO-3 only, emit/megatron.py ZERO_FLAGS), so Megatron-FSDP materialises each rank's shard only."""
    return "--init-model-with-meta-device" in ZERO_FLAGS[plan.zero_stage]


def trainer_shape(plan: Plan, devices_per_node: int) -> tuple[int, int]:
    """(trainer.num_nodes, trainer.devices) whose product is the plan's world size."""
    world = plan.num_devices - plan.idle_devices
    if world <= devices_per_node:
        return 1, world
    if world % devices_per_node:
        raise NestError(f"the plan uses {world} devices, not whole nodes of {devices_per_node}: NeMo's trainer "
                        "needs num_nodes x devices; pick cluster.num_devices as a multiple of the node size")
    return world // devices_per_node, devices_per_node


def nemo_overrides(plan: Plan, devices_per_node: int | None = None) -> Overrides:
    if "--overlap-moe-expert-parallel-comm" in plan.megatron_args:
        raise NestError("plan.moe_a2a_overlap=true has no NeMo 2 form (its training step cannot run megatron-core's "
                        "combined 1F1B schedule): plan with plan.moe_a2a_overlap=false for NeMo 2, or launch it with "
                        "Megatron-LM or Megatron-Bridge")
    p, rc = plan.parallel, plan.recompute
    s = "trainer.strategy"
    out: Overrides = {}
    if devices_per_node is not None:
        out["trainer.num_nodes"], out["trainer.devices"] = trainer_shape(plan, devices_per_node)
    out |= {
        f"{s}.tensor_model_parallel_size": p["tp"],
        f"{s}.pipeline_model_parallel_size": p["pp"],
        f"{s}.virtual_pipeline_model_parallel_size": p["vpp"] if p["vpp"] > 1 else None,
        # the interleaved schedule's micro-batch groups the plan is priced with (None: pp, megatron-core's default)
        f"{s}.microbatch_group_size_per_vp_stage": p.get("microbatch_group_size_per_vp_stage"),
        f"{s}.context_parallel_size": p["cp"],
        f"{s}.expert_model_parallel_size": p["ep"],
    }
    if p["cp"] > 1:  # Transformer Engine's exchange the plan prices (megatron.core TransformerConfig.cp_comm_type)
        out["model.config.cp_comm_type"] = flag_value(plan, "--cp-comm-type")
    if is_moe(plan):
        out[f"{s}.expert_tensor_parallel_size"] = p["etp"]
        # the dispatcher the plan prices (megatron.core TransformerConfig, whose default is allgather)
        out["model.config.moe_token_dispatcher_type"] = flag_value(plan, "--moe-token-dispatcher-type")
        if flag_value(plan, "--moe-flex-dispatcher-backend") == "deepep":
            # moe_enable_deepep: the spelling older megatron-core releases have too (newer ones map it to the backend)
            out["model.config.moe_enable_deepep"] = True
        out["model.config.moe_grouped_gemm"] = "--moe-grouped-gemm" in plan.megatron_args  # the experts' kernel priced
    out |= {
        f"{s}.sequence_parallel": bool(p["sp"]),
        f"{s}.pipeline_model_parallel_layout": uneven_layout(plan),
        f"{s}.use_tp_pp_dp_mapping": "--use-tp-pp-dp-mapping" in plan.megatron_args,
        "data.micro_batch_size": plan.micro_batch_size,
        "data.global_batch_size": plan.global_batch_size,
        "model.config.recompute_granularity": rc["granularity"],
        "model.config.recompute_method": rc["method"],
        "model.config.recompute_num_layers": rc["num_layers"],
        "optim.config.use_distributed_optimizer": plan.zero_stage >= 1,
    }
    if rc["granularity"] == "selective":  # the modules priced (megatron.core TransformerConfig.recompute_modules)
        out["model.config.recompute_modules"] = list(rc["modules"])
    if precision_aware_optimizer(plan):  # megatron-core OptimizerConfig, as on the argv
        out["optim.config.use_precision_aware_optimizer"] = True
    if plan.zero_stage >= 2:
        out |= {
            f"{s}.fsdp": "megatron",
            f"{s}.ddp.data_parallel_sharding_strategy": FSDP_SHARDING[plan.zero_stage],
            f"{s}.ddp.average_in_collective": False,  # not supported with Megatron-FSDP (recipes/llama3_8b.py)
            f"{s}.save_ckpt_format": "fsdp_dtensor",  # the only format MegatronStrategy accepts with it
        }
    else:
        out[f"{s}.fsdp"] = None
    # False below ZeRO-3, as on the argv, so that a recipe's True (fine only with Megatron-FSDP) is turned off
    out["model.config.init_model_with_meta_device"] = meta_device_init(plan)
    # the datatypes the plan is priced in (megatron-core's DistributedDataParallelConfig and TransformerConfig)
    out[f"{s}.ddp.grad_reduce_in_fp32"] = "--grad-reduce-in-bf16" not in plan.megatron_args
    # the sharded state's replicas the memory is priced with (DistributedDataParallelConfig), a recipe's own replaced
    out[f"{s}.ddp.num_distributed_optimizer_instances"] = plan.parallel.get("distributed_optimizer_instances", 1)
    out.update(offloading_overrides(plan, "model.config"))
    out["model.config.cross_entropy_loss_fusion"] = "--cross-entropy-loss-fusion" in plan.megatron_args
    recipe = fp8_recipe(plan)
    out["trainer.plugins.fp8"] = flag_value(plan, "--fp8-format") if recipe else None  # as the plan's argv, priced
    if recipe:
        out["trainer.plugins.fp8_recipe"] = recipe
    return out


def apply_to_recipe(recipe: Any, plan: Plan, devices_per_node: int | None = None) -> Any:
    """Set the plan on a NeMo 2 recipe (e.g. `llm.llama3_8b.pretrain_recipe(...)`) in place and return it.
    Works on any object with these attribute paths; a missing one is a NestError naming it, set nothing."""
    return apply_overrides(recipe, nemo_overrides(plan, devices_per_node), root_name="recipe")
