"""NeMo 2 / Megatron-Bridge overrides: checked against the field names of the real configs.

NeMo (3 GB with its CUDA stack) and Megatron-Bridge (needs Transformer Engine, CUDA only) are not installed
here or in CI. The classes they contribute are therefore written below as schemas, transcribed from their
source (file and version named at each); the megatron-core dataclasses NeMo and Bridge build on
(TransformerConfig, DistributedDataParallelConfig, OptimizerConfig) are the real ones, imported. The last
test runs against a real NeMo recipe wherever `import nemo.collections.llm` works.
"""

from __future__ import annotations

import ast
import dataclasses
import shlex
from types import SimpleNamespace

import pytest

pytest.importorskip("megatron.core")

from hydra._internal.config_loader_impl import ConfigLoaderImpl  # noqa: E402
from hydra.core.override_parser.overrides_parser import OverridesParser  # noqa: E402
from megatron.core.distributed import DistributedDataParallelConfig  # noqa: E402
from megatron.core.optimizer import OptimizerConfig  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

from nest_megatron import api, cli  # noqa: E402
from nest_megatron.errors import NestError  # noqa: E402
from nest_megatron.integrations import apply_to_config, apply_to_recipe, bridge_overrides, nemo_overrides  # noqa: E402
from nest_megatron.integrations.nemo import trainer_shape  # noqa: E402
from nest_megatron.integrations.overrides import cli_line, hydra_literal  # noqa: E402
from nest_megatron.parallel.layout import layout_string  # noqa: E402

# nemo_toolkit 2.7.3 (PyPI wheel), nemo/lightning/pytorch/strategies/megatron_strategy.py:
# MegatronStrategy.__init__ parameters and defaults (NVIDIA/NeMo@8cfedd72 has the same, less the two
# ckpt_optim_* / distrib_optim_* ones).
MEGATRON_STRATEGY = dict(
    tensor_model_parallel_size=1, pipeline_model_parallel_size=1, pipeline_model_parallel_comm_backend=None,
    num_layers_in_first_pipeline_stage=None, num_layers_in_last_pipeline_stage=None,
    virtual_pipeline_model_parallel_size=None, microbatch_group_size_per_vp_stage=None, context_parallel_size=1,
    sequence_parallel=False, expert_model_parallel_size=1, moe_extended_tp=False, expert_tensor_parallel_size=None,
    encoder_tensor_model_parallel_size=0, encoder_pipeline_model_parallel_size=0,
    account_for_embedding_in_pipeline_split=False, account_for_loss_in_pipeline_split=False, data_sampler=None,
    parallel_devices=None, cluster_environment=None, checkpoint_io=None, find_unused_parameters=False,
    ckpt_load_optimizer=True, ckpt_save_optimizer=True, ckpt_load_main_params=False, ddp="megatron", fsdp=None,
    lazy_init=False, pipeline_dtype=None, use_te_rng_tracker=False, use_sharp=False, save_ckpt_format="torch_dist",
    ckpt_async_save=True, ckpt_torch_dist_multiproc=None, ckpt_assume_constant_structure=False,
    ckpt_parallel_save=True, ckpt_parallel_save_within_dp=False, ckpt_parallel_load=True,
    ckpt_parallel_save_optim=None, ckpt_load_directly_on_device=True, ckpt_load_strictness=None,
    ckpt_optim_fully_reshardable=False, distrib_optim_fully_reshardable_mem_efficient=False, setup_optimizers=True,
    init_model_parallel=True, replace_progress_bar=True, progress_interval=1, restore_config=None,
    megatron_log_level=0, use_tp_pp_dp_mapping=False, num_distributed_optimizer_instances=1,
    nccl_communicator_config_path=None, pipeline_model_parallel_layout=None, use_gloo_process_groups=True,
)
# nemo_toolkit 2.7.3, nemo/collections/llm/gpt/data/mock.py: MockDataModule.__init__ (as llama3_8b's recipe uses it)
MOCK_DATA_MODULE = dict(
    seq_length=2048, tokenizer=None, micro_batch_size=4, global_batch_size=8, rampup_batch_size=None,
    num_train_samples=10_000_000, num_val_samples=10_000, num_test_samples=10_000, num_workers=8, pin_memory=True,
    persistent_workers=False, create_attention_mask=False, vocab_file=None, merges_file=None,
)
# lightning 2.4 Trainer.__init__: the two arguments the recipes set for the world size
TRAINER = dict(num_nodes=1, devices="auto")
# NVIDIA/NeMo@8cfedd72, nemo/lightning/pytorch/plugins/mixed_precision.py:102-132: MegatronMixedPrecision.__init__, as
# recipes/precision/mixed_precision.py bf16_mixed() builds it (the recipes' trainer.plugins)
MEGATRON_MIXED_PRECISION = dict(
    precision="bf16-mixed", params_dtype=None, pipeline_dtype=None, autocast_dtype=None, autocast_enabled=False,
    grad_reduce_in_fp32=True, fp8=None, fp8_recipe="delayed", first_last_layers_bf16=False, fp8_margin=0,
    fp8_amax_history_len=1, fp8_amax_compute_algo="most_recent", fp8_wgrad=True, fp8_dot_product_attention=False,
    fp8_multi_head_attention=False, fp8_params=None, fp8_param_gather=None, fp4=None, fp4_recipe="nvfp4",
    fp16_loss_scale=None, fp16_initial_loss_scale=4294967296, fp16_min_loss_scale=1.0, fp16_loss_scale_window=1000,
    fp16_hysteresis=2, num_layers_at_start_in_bf16=0, num_layers_at_end_in_bf16=0,
    reuse_grad_buf_for_mxfp8_param_ag=False,
)

# megatron-bridge 0.3.1 (PyPI wheel), megatron/bridge/training/config.py: dataclass fields
BRIDGE_TRAINING = dict.fromkeys([
    "micro_batch_size", "global_batch_size", "rampup_batch_size", "decrease_batch_size_if_needed",
    "empty_unused_memory_level", "check_weight_hash_across_dp_replicas_interval", "train_sync_interval",
    "train_iters", "train_samples", "exit_interval", "exit_duration_in_mins", "exit_signal_handler", "exit_signal",
    "exit_signal_handler_for_dataloader", "manual_gc", "manual_gc_interval", "manual_gc_eval", "iterations_to_skip",
    "eval_iters", "eval_interval", "skip_train"])
BRIDGE_CHECKPOINT = dict.fromkeys([
    "save", "save_interval", "most_recent_k", "save_optim", "save_rng", "load", "load_optim",
    "load_main_params_from_ckpt", "load_rng", "non_persistent_save_interval", "non_persistent_ckpt_type",
    "non_persistent_global_ckpt_dir", "non_persistent_local_ckpt_dir", "non_persistent_local_ckpt_algo", "finetune",
    "pretrained_checkpoint", "ckpt_step", "use_checkpoint_args", "exit_on_missing_checkpoint", "ckpt_format",
    "ckpt_convert_format", "ckpt_convert_save", "fully_parallel_save", "async_save", "use_persistent_ckpt_worker",
    "fully_parallel_load", "ckpt_assume_constant_structure", "strict_fsdp_dtensor_load", "dist_ckpt_strictness",
    "dist_ckpt_optim_fully_reshardable", "distrib_optim_fully_reshardable_mem_efficient", "save_tokenizer_assets",
    "replication", "replication_jump", "replication_factor"]) | {"ckpt_format": "torch_dist"}
BRIDGE_DIST = dict.fromkeys([
    "distributed_backend", "distributed_timeout_minutes", "align_grad_reduce", "local_rank", "lazy_init",
    "use_megatron_fsdp", "use_torch_fsdp2", "nccl_communicator_config_path", "use_tp_pp_dp_mapping",
    "use_gloo_process_groups", "use_sharp", "sharp_enabled_group", "high_priority_stream_groups",
    "external_gpu_device_mapping", "enable_megatron_core_experimental", "distributed_timeout_seconds_after_init",
    "disable_jit_fuser", "use_decentralized_pg"]) | {"use_tp_pp_dp_mapping": False, "use_megatron_fsdp": False}


def transformer_config() -> TransformerConfig:
    return TransformerConfig(num_layers=4, hidden_size=64, num_attention_heads=4)


def nemo_recipe_stand_in() -> SimpleNamespace:
    """llama3_8b.pretrain_recipe()'s tree (recipes/llama3_8b.py): trainer(strategy(ddp)), data, model.config, optim."""
    strategy = SimpleNamespace(**MEGATRON_STRATEGY | {"ddp": DistributedDataParallelConfig()})
    return SimpleNamespace(
        trainer=SimpleNamespace(**TRAINER, strategy=strategy, plugins=SimpleNamespace(**MEGATRON_MIXED_PRECISION)),
        data=SimpleNamespace(**MOCK_DATA_MODULE),
        model=SimpleNamespace(config=transformer_config()),
        optim=SimpleNamespace(config=OptimizerConfig(use_distributed_optimizer=True)),
    )


def bridge_container_stand_in() -> SimpleNamespace:
    """ConfigContainer's tree: model is a GPTModelProvider, i.e. a megatron-core TransformerConfig."""
    return SimpleNamespace(
        model=transformer_config(), train=SimpleNamespace(**BRIDGE_TRAINING), optimizer=OptimizerConfig(),
        ddp=DistributedDataParallelConfig(), checkpoint=SimpleNamespace(**BRIDGE_CHECKPOINT),
        dist=SimpleNamespace(**BRIDGE_DIST),
        mixed_precision="bf16_mixed",  # recipes/common.py:124 (megatron-bridge 0.3.1): a registered config's name
    )


BASE = ["cluster=dgx_h100_superpod", "cluster.num_devices=16", "train.global_batch_size=64"]


@pytest.fixture(scope="module")
def moe_plan():
    # pinned by hand: tp=2 pp=2 ep=2 etp=1 -> dp = 16 / (2*2) = 4; ZeRO-1, full uniform recompute, mbs 2
    return api.evaluate(["model=tiny_moe", *BASE, "plan.tp=2", "plan.pp=2", "plan.ep=2", "plan.etp=1", "plan.zero=1",
                         "plan.recompute=full", "plan.mbs=2", "plan.sp=true"])


@pytest.fixture(scope="module")
def fsdp_plan():
    # tp=2 pp=1 -> dp = 8 (Megatron-FSDP has no pipeline stages); ZeRO-3 (optim_grads_params), selective recompute
    return api.evaluate(["model=tiny_gpt", *BASE, "plan.tp=2", "plan.pp=1", "plan.zero=3",
                         "plan.sp=false", "plan.recompute=selective", "plan.mbs=1"])


@pytest.fixture(scope="module")
def zero2_plan():
    # the same shape as fsdp_plan at ZeRO-2 (optim_grads): Megatron-FSDP, but no meta-device model
    return api.evaluate(["model=tiny_gpt", *BASE, "plan.tp=2", "plan.pp=1", "plan.zero=2",
                         "plan.sp=false", "plan.recompute=selective", "plan.mbs=1"])


@pytest.fixture(scope="module")
def plain_plan():
    # tp=1 pp=2 vpp=2 dp=8, no ZeRO, Megatron's tp-pp-dp order, no recompute
    return api.evaluate(["model=tiny_gpt", *BASE, "plan.tp=1", "plan.pp=2", "plan.vpp=2", "plan.zero=0", "plan.mbs=1",
                         "plan.order=tp-cp-ep-pp-dp", "plan.recompute=none"])


@pytest.fixture(scope="module")
def fp8_plan():
    # tp=2 with sequence parallel, FP8 under the tensorwise recipe, TP communication overlapped
    return api.evaluate(["model=tiny_gpt", *BASE, "plan.tp=2", "plan.pp=1", "plan.zero=1", "plan.mbs=1",
                         "train.precision=fp8", "train.fp8_recipe=tensorwise", "train.tp_comm_overlap=true"])


def uneven(plan):
    """The same plan with a 1|3 split of tiny_gpt's 4 layers, as the solver emits one (layout on the Megatron argv)."""
    args = plan.megatron_args + ["--pipeline-model-parallel-layout", layout_string((1, 3))]
    return dataclasses.replace(plan, layers_per_stage=[1, 3], megatron_args=args)


# -- NeMo 2 ---------------------------------------------------------------------------------------------

def test_nemo_overrides_of_a_moe_plan(moe_plan):
    recipe = apply_to_recipe(nemo_recipe_stand_in(), moe_plan, devices_per_node=8)
    s = recipe.trainer.strategy
    assert (recipe.trainer.num_nodes, recipe.trainer.devices) == (2, 8)  # 16 devices = 2 nodes of 8
    assert (s.tensor_model_parallel_size, s.pipeline_model_parallel_size, s.context_parallel_size) == (2, 2, 1)
    assert (s.expert_model_parallel_size, s.expert_tensor_parallel_size) == (2, 1)
    assert s.virtual_pipeline_model_parallel_size is None  # vpp=1 is NeMo's None
    assert s.sequence_parallel is True and s.pipeline_model_parallel_layout is None
    assert s.use_tp_pp_dp_mapping is False and s.fsdp is None and s.save_ckpt_format == "torch_dist"
    assert (recipe.data.micro_batch_size, recipe.data.global_batch_size) == (2, 64)
    c = recipe.model.config
    assert (c.recompute_granularity, c.recompute_method, c.recompute_num_layers) == ("full", "uniform", 1)
    assert c.moe_token_dispatcher_type == "alltoall"  # the dispatcher the plan prices; TransformerConfig's is allgather
    assert c.moe_grouped_gemm is True  # the experts' grouped GEMM the plan prices; TransformerConfig's default is False
    assert recipe.optim.config.use_distributed_optimizer is True  # ZeRO-1 = Megatron's distributed optimizer
    assert c.init_model_with_meta_device is False  # ZeRO-1: plain DDP needs real tensors


def test_nemo_overrides_of_a_zero3_plan(fsdp_plan):
    recipe = apply_to_recipe(nemo_recipe_stand_in(), fsdp_plan)
    s = recipe.trainer.strategy
    assert s.virtual_pipeline_model_parallel_size is None
    assert s.expert_model_parallel_size == 1 and s.expert_tensor_parallel_size is None  # dense: NeMo's default kept
    assert recipe.model.config.moe_token_dispatcher_type == "allgather"  # dense: no dispatcher set
    assert (s.fsdp, s.ddp.data_parallel_sharding_strategy, s.save_ckpt_format) == ("megatron", "optim_grads_params",
                                                                                  "fsdp_dtensor")
    assert s.ddp.average_in_collective is False
    c = recipe.model.config
    assert (c.recompute_granularity, c.recompute_method, c.recompute_num_layers) == ("selective", None, None)
    assert c.init_model_with_meta_device is True  # ZeRO-3: built on the meta device, as --init-model-with-meta-device
    assert recipe.trainer.num_nodes == 1 and recipe.trainer.devices == "auto"  # no devices_per_node: untouched


def test_meta_device_model_for_zero3_only(fsdp_plan, zero2_plan):
    """--init-model-with-meta-device is on the ZeRO-3 argv only; NeMo's model.config and Bridge's model
    (both a megatron-core TransformerConfig) say the same, and ZeRO-2 turns a recipe's True off."""
    assert "--init-model-with-meta-device" in fsdp_plan.megatron_args
    assert "--init-model-with-meta-device" not in zero2_plan.megatron_args
    assert "optim_grads" in zero2_plan.megatron_args  # ZeRO-2 is Megatron-FSDP too: the flag is not FSDP's
    assert nemo_overrides(fsdp_plan)["model.config.init_model_with_meta_device"] is True
    assert nemo_overrides(zero2_plan)["model.config.init_model_with_meta_device"] is False
    assert bridge_overrides(fsdp_plan)["model.init_model_with_meta_device"] is True
    assert bridge_overrides(zero2_plan)["model.init_model_with_meta_device"] is False
    start = nemo_recipe_stand_in()
    start.model.config.init_model_with_meta_device = True  # as NeMo's set_mcore_fsdp_configs leaves it
    recipe = apply_to_recipe(start, zero2_plan)
    assert recipe.model.config.init_model_with_meta_device is False
    assert (recipe.trainer.strategy.fsdp, recipe.trainer.strategy.ddp.data_parallel_sharding_strategy) == (
        "megatron", "optim_grads")
    start = bridge_container_stand_in()
    start.model.init_model_with_meta_device = True  # as Bridge's _set_megatron_fsdp_overrides leaves it
    assert apply_to_config(start, zero2_plan).model.init_model_with_meta_device is False
    assert apply_to_config(bridge_container_stand_in(), fsdp_plan).model.init_model_with_meta_device is True


def test_nemo_overrides_of_a_plain_plan_turn_things_off(plain_plan):
    start = nemo_recipe_stand_in()
    start.model.config.recompute_granularity = "full"  # as recipes/qwen3_32b.py leaves it
    recipe = apply_to_recipe(start, plain_plan)
    assert recipe.optim.config.use_distributed_optimizer is False  # the recipe's True turned off for ZeRO-0
    assert recipe.model.config.recompute_granularity is None
    assert recipe.model.config.init_model_with_meta_device is False
    assert recipe.trainer.strategy.use_tp_pp_dp_mapping is True
    assert recipe.trainer.strategy.virtual_pipeline_model_parallel_size == 2


def test_uneven_split_becomes_the_layout_of_the_megatron_argv(plain_plan):
    plan = uneven(plain_plan)
    assert nemo_overrides(plan)["trainer.strategy.pipeline_model_parallel_layout"] == "Et|t*3L"  # E, 1|3, L
    assert bridge_overrides(plan)["model.pipeline_model_parallel_layout"] == "Et|t*3L"


def test_fp8_and_tp_comm_overlap_reach_nemo_and_bridge(fp8_plan, plain_plan):
    """The argv's --fp8-format hybrid --fp8-recipe tensorwise --tp-comm-overlap, in each target's words."""
    assert fp8_plan.megatron_args[fp8_plan.megatron_args.index("--fp8-format"):][:4] == [
        "--fp8-format", "hybrid", "--fp8-recipe", "tensorwise"]
    assert "--tp-comm-overlap" in fp8_plan.megatron_args
    recipe = apply_to_recipe(nemo_recipe_stand_in(), fp8_plan)
    assert (recipe.trainer.plugins.fp8, recipe.trainer.plugins.fp8_recipe) == ("hybrid", "tensorwise")
    assert "model.config.tp_comm_overlap" not in nemo_overrides(fp8_plan)  # NeMo's is a callback (module doc)
    start = nemo_recipe_stand_in()
    start.trainer.plugins.fp8 = "hybrid"  # an FP8 recipe, planned in bf16: turned off, as the argv has no FP8
    assert apply_to_recipe(start, plain_plan).trainer.plugins.fp8 is None
    cfg = apply_to_config(bridge_container_stand_in(), fp8_plan)
    assert cfg.mixed_precision == "bf16_with_fp8_current_scaling_mixed" and cfg.model.tp_comm_overlap is True
    plain = apply_to_config(bridge_container_stand_in(), plain_plan)
    assert plain.mixed_precision == "bf16_mixed" and plain.model.tp_comm_overlap is False


@pytest.mark.parametrize("name", ["moe_plan", "fsdp_plan", "zero2_plan", "plain_plan", "fp8_plan"])
def test_every_nemo_path_is_a_field_of_the_recipe(name, request):
    plan = uneven(request.getfixturevalue(name))
    apply_to_recipe(nemo_recipe_stand_in(), plan, devices_per_node=8)  # raises on a path the recipe lacks


def test_nemo_cli_words_read_back_as_nemo_run_reads_them(fsdp_plan):
    """nemo-run's PythonicParser.parse_value starts with ast.literal_eval (nemo_run 0.11.1,
    nemo_run/cli/cli_parser.py); the words must survive the shell and give back the same values."""
    overrides = nemo_overrides(uneven(fsdp_plan), devices_per_node=8)
    words = shlex.split(cli_line(overrides))
    parsed = {k: ast.literal_eval(v) for k, v in (w.split("=", 1) for w in words)}
    assert parsed == overrides


def test_missing_path_names_it_and_changes_nothing(moe_plan):
    recipe = nemo_recipe_stand_in()
    recipe.trainer.strategy.ddp = "megatron"  # a recipe whose DDP is the string form, not a config
    plan = dataclasses.replace(moe_plan, zero_stage=2)
    with pytest.raises(NestError, match=r"recipe.trainer.strategy.ddp \(str\) has no attribute "
                                        r"'data_parallel_sharding_strategy'"):
        apply_to_recipe(recipe, plan)
    assert recipe.trainer.strategy.tensor_model_parallel_size == 1  # checked before anything was set
    del recipe.data
    with pytest.raises(NestError, match=r"recipe has no recipe.data \(needed for data.micro_batch_size\)"):
        apply_to_recipe(recipe, moe_plan)


def test_the_recompute_modules_priced_reach_both_targets():
    """Selective recompute of [moe_act, layernorm] (the GPT-OSS recipe's set) is what the plan prices: NeMo and Bridge
    get the same list in TransformerConfig.recompute_modules, whose default ([core_attn]) would keep other
    activations; a plan without selective recompute leaves the recipe's list alone."""
    plan = api.evaluate(["model=tiny_moe", *BASE, "plan.tp=1", "plan.pp=1", "plan.ep=2", "plan.zero=1", "plan.mbs=1",
                         "plan.recompute_modules=[moe_act,layernorm]"])
    recipe = apply_to_recipe(nemo_recipe_stand_in(), plan)
    assert recipe.model.config.recompute_granularity == "selective"
    assert recipe.model.config.recompute_modules == ["moe_act", "layernorm"]
    assert recipe.model.config.moe_grouped_gemm is True  # moe_act recomputes the grouped experts' activation
    container = apply_to_config(bridge_container_stand_in(), plan)
    assert container.model.recompute_modules == ["moe_act", "layernorm"]
    untouched = apply_to_config(bridge_container_stand_in(), api.evaluate(["model=tiny_moe", *BASE, "plan.ep=2",
                                                                          "plan.recompute=full"]))
    assert untouched.model.recompute_modules == ["core_attn"]  # TransformerConfig's own, as built


def test_trainer_shape_needs_whole_nodes(moe_plan):
    assert trainer_shape(moe_plan, 8) == (2, 8)
    assert trainer_shape(moe_plan, 32) == (1, 16)  # fewer devices than one node: one node, 16 of them
    with pytest.raises(NestError, match="the plan uses 16 devices, not whole nodes of 6"):
        trainer_shape(moe_plan, 6)


# -- Megatron-Bridge --------------------------------------------------------------------------------------

def test_bridge_overrides_of_a_moe_plan(moe_plan):
    cfg = apply_to_config(bridge_container_stand_in(), moe_plan)
    m = cfg.model
    assert (m.tensor_model_parallel_size, m.pipeline_model_parallel_size, m.expert_model_parallel_size) == (2, 2, 2)
    assert m.expert_tensor_parallel_size == 1 and m.moe_token_dispatcher_type == "alltoall"
    assert m.moe_grouped_gemm is True
    assert m.virtual_pipeline_model_parallel_size is None and m.sequence_parallel is True
    assert (m.recompute_granularity, m.recompute_method, m.recompute_num_layers) == ("full", "uniform", 1)
    assert (cfg.train.micro_batch_size, cfg.train.global_batch_size) == (2, 64)
    assert cfg.optimizer.use_distributed_optimizer is True and cfg.ddp.use_distributed_optimizer is True
    assert cfg.ddp.use_megatron_fsdp is False and cfg.ddp.data_parallel_sharding_strategy == "no_shard"
    assert cfg.checkpoint.ckpt_format == "torch_dist" and cfg.dist.use_tp_pp_dp_mapping is False
    assert m.init_model_with_meta_device is False
    assert m.overlap_moe_expert_parallel_comm is False and m.delay_wgrad_compute is False  # not asked for


def test_bridge_overrides_carry_the_a2a_overlap():
    plan = api.evaluate(["model=tiny_moe", *BASE, "plan.tp=1", "plan.ep=2", "plan.moe_a2a_overlap=true",
                         "train.delay_wgrad_compute=true"])
    m = apply_to_config(bridge_container_stand_in(), plan).model
    assert m.overlap_moe_expert_parallel_comm is True and m.delay_wgrad_compute is True


def test_both_targets_offload_the_activations_priced():
    # the first 2 of tiny_gpt's 4 layers' activations in host memory, as megatron-core's TransformerConfig fields
    # Megatron-LM sets from --cpu-offloading-num-layers 2 (arguments.py:1950-1951); the weights stay on the device
    plan = api.evaluate(["model=tiny_gpt", *BASE, "plan.tp=2", "plan.pp=1", "plan.recompute=none",
                         "plan.cpu_offloading_num_layers=2"])
    for m in (apply_to_recipe(nemo_recipe_stand_in(), plan).model.config,
              apply_to_config(bridge_container_stand_in(), plan).model):
        assert (m.cpu_offloading, m.cpu_offloading_num_layers) == (True, 2)
        assert (m.cpu_offloading_activations, m.cpu_offloading_weights) == (True, False)


def test_a_plan_without_offloading_turns_a_recipes_off(plain_plan):
    recipe = nemo_recipe_stand_in()
    recipe.model.config.cpu_offloading, recipe.model.config.cpu_offloading_num_layers = True, 3
    m = apply_to_recipe(recipe, plain_plan).model.config
    assert (m.cpu_offloading, m.cpu_offloading_num_layers) == (False, 0)


def test_nemo_overrides_refuse_the_a2a_overlap_bridge_takes_it():
    plan = api.evaluate(["model=tiny_moe", *BASE, "plan.tp=1", "plan.ep=2", "plan.moe_a2a_overlap=true"])
    with pytest.raises(NestError, match="no NeMo 2 form"):
        nemo_overrides(plan, 8)
    assert bridge_overrides(plan)["model.overlap_moe_expert_parallel_comm"] is True


def test_bridge_overrides_of_zero3_and_zero0(fsdp_plan, plain_plan):
    cfg = apply_to_config(bridge_container_stand_in(), fsdp_plan)
    assert cfg.model.virtual_pipeline_model_parallel_size is None
    assert (cfg.ddp.use_megatron_fsdp, cfg.ddp.data_parallel_sharding_strategy) == (True, "optim_grads_params")
    assert cfg.checkpoint.ckpt_format == "fsdp_dtensor"
    assert cfg.model.init_model_with_meta_device is True
    start = bridge_container_stand_in()
    start.ddp.use_distributed_optimizer = True  # Bridge would turn both on if either stayed on
    cfg = apply_to_config(start, plain_plan)
    assert cfg.optimizer.use_distributed_optimizer is False and cfg.ddp.use_distributed_optimizer is False
    assert cfg.dist.use_tp_pp_dp_mapping is True
    assert cfg.model.virtual_pipeline_model_parallel_size == 2


@pytest.mark.parametrize("name", ["moe_plan", "fsdp_plan", "zero2_plan", "plain_plan", "fp8_plan"])
def test_bridge_cli_words_apply_with_hydra_as_bridge_does(name, request):
    """megatron/bridge/training/utils/omegaconf_utils.py parse_hydra_overrides: OverridesParser, then
    ConfigLoaderImpl._apply_overrides_to_config on a struct config. A key the config lacks fails there."""
    overrides = bridge_overrides(uneven(request.getfixturevalue(name)))
    schema = {
        "model": {f.name: None for f in dataclasses.fields(TransformerConfig)},
        "train": dict(BRIDGE_TRAINING), "checkpoint": dict(BRIDGE_CHECKPOINT), "dist": dict(BRIDGE_DIST),
        "optimizer": {f.name: None for f in dataclasses.fields(OptimizerConfig)},
        "ddp": {f.name: None for f in dataclasses.fields(DistributedDataParallelConfig)},
        "mixed_precision": "bf16_mixed",
    }
    cfg = OmegaConf.create(schema)
    OmegaConf.set_struct(cfg, True)
    words = shlex.split(cli_line(overrides, hydra_literal))
    ConfigLoaderImpl._apply_overrides_to_config(overrides=OverridesParser.create().parse_overrides(words), cfg=cfg)
    assert {path: OmegaConf.select(cfg, path) for path in overrides} == overrides


# -- the command ------------------------------------------------------------------------------------------

def run_cli(capsys, *args) -> tuple[int, str, str]:
    status = cli.main(list(args))
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def test_nemo_command_python_form_sets_a_recipe(tmp_path, capsys):
    # pinned: tp=2 pp=2 -> dp=4 on 16 devices (2 DGX nodes of 8), mbs=1, ZeRO-1
    out = tmp_path / "overrides.py"
    status, stdout, stderr = run_cli(capsys, "nemo", "model=tiny_gpt", *BASE, "plan.tp=2", "plan.pp=2", "plan.mbs=1",
                                     "plan.zero=1", "plan.recompute=none", "--format", "python", f"out={out}")
    assert status == 0, stderr
    assert stdout == ""  # out= given: written there, not printed
    recipe = nemo_recipe_stand_in()
    exec(out.read_text(), {"recipe": recipe})
    s = recipe.trainer.strategy
    assert (s.tensor_model_parallel_size, s.pipeline_model_parallel_size) == (2, 2)
    assert (recipe.trainer.num_nodes, recipe.trainer.devices) == (2, 8)
    assert recipe.data.micro_batch_size == 1 and recipe.optim.config.use_distributed_optimizer is True


def test_bridge_command_cli_form(capsys):
    pins = ["model=tiny_gpt", *BASE, "plan.tp=2", "plan.pp=2", "plan.mbs=1", "plan.zero=0"]
    status, stdout, stderr = run_cli(capsys, "bridge", *pins)
    assert status == 0, stderr
    words = shlex.split(stdout)
    assert all("=" in word for word in words)  # stdout is the overrides alone
    assert "model.tensor_model_parallel_size=2" in words and "train.global_batch_size=64" in words
    assert "optimizer.use_distributed_optimizer=false" in words
    # the band and the calibration go to stderr, as the plan records them
    plan = api.plan(pins)
    step, (low, high) = plan.predicted["step_time_s"], plan.calibration["step_time_band_s"]
    assert stderr == f"nest-megatron: predicted {step:.3f} s ({low:.3g}-{high:.3g} s) a step; " \
                     f"{plan.calibration['summary']}\n"
    assert run_cli(capsys, "nemo", "--target", "bridge", *pins)[1] == stdout


@pytest.mark.parametrize("args, message", [
    (["model=tiny_gpt", *BASE, "plan.tp=3"], "plan.tp=3: must divide num_attention_heads=8"),  # tiny_gpt: 8 heads
    (["model=no_such_model"], "model"),
    # NeMo 2.7.3's forward step cannot build megatron-core's combined 1F1B schedule plan (integrations/nemo.py)
    (["model=tiny_moe", *BASE, "plan.tp=1", "plan.ep=2", "plan.moe_a2a_overlap=true"],
     "plan.moe_a2a_overlap=true has no NeMo 2 form"),
])
def test_nemo_command_bad_input_is_one_line(args, message, tmp_path, capsys):
    out = tmp_path / "o.txt"
    status, stdout, stderr = run_cli(capsys, "nemo", *args, "plan.mbs=1", f"out={out}")
    assert status == 2
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("nest-megatron nemo: error:") and message in lines[0]
    assert not out.exists() and stdout == ""


# -- a real NeMo recipe, where NeMo is installed ([nemo] extra) --------------------------------------------

def nemo_llm():
    try:
        from nemo.collections import llm
    except Exception:  # ImportError, or NeMo's own import-time failures without its CUDA stack
        return None
    return llm


@pytest.mark.skipif(nemo_llm() is None, reason="nemo.collections.llm is not importable: the [nemo] extra "
                    "(nemo_toolkit 2.x, ~3 GB with its CUDA stack) is not installed")
def test_real_llama3_8b_recipe(moe_plan):
    llm = nemo_llm()
    recipe = llm.llama3_8b.pretrain_recipe(name="nest", num_nodes=2, num_gpus_per_node=8)
    apply_to_recipe(recipe, moe_plan, devices_per_node=8)
    s = recipe.trainer.strategy
    assert (s.tensor_model_parallel_size, s.pipeline_model_parallel_size, s.expert_model_parallel_size) == (2, 2, 2)
    assert s.virtual_pipeline_model_parallel_size is None and s.sequence_parallel is True
    assert (recipe.data.micro_batch_size, recipe.data.global_batch_size) == (2, 64)
    assert recipe.model.config.recompute_granularity == "full"
    assert recipe.model.config.moe_token_dispatcher_type == "alltoall"  # what the plan is priced for
    assert recipe.model.config.init_model_with_meta_device is False  # a GPTConfig (TransformerConfig) field; ZeRO-1
    assert recipe.optim.config.use_distributed_optimizer is True
    assert (recipe.trainer.num_nodes, recipe.trainer.devices) == (2, 8)


def test_both_overrides_carry_the_optimizer_instances():
    """The memory is priced with 2 replicas of the sharded state: NeMo's and Bridge's DDP config get 2 (a recipe's
    own value replaced), and 1 for a plan without."""
    plan = api.evaluate(["model=tiny_gpt", *BASE, "plan.tp=1", "plan.dp=16", "plan.zero=1",
                         "plan.distributed_optimizer_instances=2"])
    assert nemo_overrides(plan, 8)["trainer.strategy.ddp.num_distributed_optimizer_instances"] == 2
    assert apply_to_config(bridge_container_stand_in(), plan).ddp.num_distributed_optimizer_instances == 2
    plain = api.evaluate(["model=tiny_gpt", *BASE, "plan.tp=1", "plan.dp=16", "plan.zero=1"])
    assert bridge_overrides(plain)["ddp.num_distributed_optimizer_instances"] == 1
