"""Published, measured H100 training runs (benchmarks/h100_published.yaml) as `evaluate` overrides.

Each row of the calibration set gives a model shape, a parallel layout, batch sizes, precision and
overlap settings, and what the run measured: tokens/s per GPU, or only model TFLOP/s per GPU under
its source's FLOP convention. `rows()` turns every row into the overrides `nest-megatron evaluate`
takes and the measured step time in seconds; a row whose model this cost model cannot express
(Mamba hybrids, shapes not published) carries the reason instead.

What a row leaves unstated is filled with the source's default and listed in `Row.assumed`.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from nest_megatron.model.spec import OptimizerDtypes

CALIBRATION_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "h100_published.yaml"

# What a row's table leaves out, from the recipe the run used. NeMo-Framework-Launcher rows: the
# model's launcher_scripts/conf/training/<model>.yaml and examples/training/*/h100/*.sh at the row's
# release tag (cb3482d0 for 24.01); the tables override the parallel sizes only.
RECIPE_VP = {  # (release, model) -> (the recipe's pp, its virtual_pipeline_model_parallel_size)
    ("launcher-24.01", "GPT3-175B"): (8, 12), ("launcher-24.01", "LLAMA2-70B"): (4, 20),
    ("launcher-24.01", "Nemotron-22B"): (4, 10), ("launcher-24.03", "LLAMA2-70B"): (4, 20),
    ("launcher-24.05", "GPT3-175B"): (8, 12), ("launcher-24.05", "LLAMA2-70B"): (4, 20),
    ("launcher-24.05", "LLAMA2-13B"): (4, 10), ("launcher-24.05", "LLAMA3-70B"): (4, 10),
    ("launcher-24.05", "Nemotron-22B"): (4, 10),
}
# +training.model.optim.grad_sync_dtype=bf16 in the GPT-3 and Llama scripts from launcher commit e743722a
# (2024-04-10) on, and in conf/training/nemotron/nemotron_340b.yaml (24.07): gradients reduced in bf16
# (--grad-reduce-in-bf16). The 24.03 table was published after it (81b75a7c, 2024-04-22) and its rows
# name the 24.05 recipes as their settings (and use their layouts: GPT3-20B at TP 2, MBS 2).
# The long-sequence table (nemo-longseq rows) ran the NeMo 24.03.01 container, whose launcher tag
# 24.03.01 carries the same LLAMA2 recipes (examples/training/llama/h100/llama2_7b_fp8.sh:22).
GRAD_BF16_RELEASES = ("launcher-24.03", "launcher-24.05", "nemo-24.07", "nemo-longseq")
GRAD_BF16_MODELS = ("GPT3", "LLAMA", "Nemotron-340B")
# Megatron-Bridge's token-drop runs (the 25.09 "tokendrop" rows): apply_moe_token_drop's defaults, capacity factor 1.0
# with the experts' input padded to it (run_script.py:109, training/utils/moe_token_drop.py:20-21,54-55 at v0.1.0rc4).
TOKEN_DROP = ["model.moe_expert_capacity_factor=1.0", "model.moe_pad_expert_input_to_capacity=true"]
ROW_SETTINGS = {
    # The rows' notes: "EP not given (launcher default 8)". The confs at the draft's commit 3499f38e say
    # expert_model_parallel_size: 1, but at EP 1 neither layout fits in 80 GB without full recomputation
    # (8x3B: 19 B parameters on one device; 8x7B: 11.7 B a stage, 106 GiB), which the rows do not use.
    # The 8x3B conf sets no moe_token_dispatcher_type (the 8x7B's sets alltoall, mixtral_8x7b.yaml:50 at
    # 3499f38e); NeMo passes a TransformerConfig field it lacks as megatron-core's default
    # (nemo/collections/nlp/models/language_modeling/megatron_base_model.py build_transformer_config at
    # v2.0.0rc0, the 24.05 release), "allgather" in core_r0.7.0 (transformer_config.py:253).
    "launcher-24.05-MIXTRAL-8x3B-bf16-draft": {"ep": 8, "moe_dispatcher": "allgather"},
    "launcher-24.05-MIXTRAL-8x7B-bf16-draft": {"ep": 8},
    # NVIDIA-NeMo/Automodel examples/llm_benchmark/*.yaml at 36044ad: ep_size, and MaskedCrossEntropy with
    # fp32_upcast: false (no fp32 logits kept: priced as the fused loss). Recompute from the configs of the
    # commit that published these rows, 89e3a9fdd (2025-10-06; the times are unchanged since):
    # examples/benchmark/configs/qwen3_moe_30b_te_deepep.yaml:59 and gptoss_20b_te_deepep.yaml:59 set
    # parallelizer.activation_checkpointing: true, which wraps every decoder block whole
    # (nemo_automodel/components/moe/parallelizer.py:84-111 apply_ac, :208): full recompute. The 20B's
    # config lost it later (HEAD has none), the 120B's was false (gptoss_120b_te_deepep.yaml:59).
    "automodel-Qwen3_MoE_30B-8gpu-bf16": {"recompute": "full", "cross_entropy_fusion": True},
    "automodel-GPT-OSS_20B-8gpu-bf16": {"ep": 8, "recompute": "full", "cross_entropy_fusion": True},
    "automodel-GPT-OSS_120B-64gpu-bf16": {"ep": 64, "cross_entropy_fusion": True},
    # DeepSeek-V3 and Kimi K2 under AutoModel's pipeline: examples/llm_benchmark/deepseek/deepseek_v3_te_deepep*.yaml and
    # kimi/kimi_k2_te_deepep.yaml at 36044ad train with MaskedCrossEntropy, fp32_upcast false (their layouts and
    # gradient accumulation: FSDP2_IN_PIPELINE below).
    "automodel-DeepSeek_V3_671B-256gpu-bf16": {"cross_entropy_fusion": True},
    "automodel-DeepSeek_V3_671B-1024gpu-bf16": {"cross_entropy_fusion": True},
    "automodel-Kimi_K2-256gpu-bf16": {"cross_entropy_fusion": True},
    # Nemotron-3 Nano 30B-A3B: the row's note gives the pattern, the Mamba and attention widths, as Megatron-Bridge's
    # Nemotron3NanoProvider (megatron-bridge 0.3.1 models/nemotronh/nemotron_h_provider.py:153-173) does, with 8 Mamba
    # groups (its NemotronHModelProvider's, :35, and n_groups=8 in AutoModel's tests/unit_tests/utils/test_flops_utils.py
    # _nemotronh_nano_v3_cfg at 36044ad), no position embedding and RMSNorm (the hybrid defaults the shipped
    # nemotron_h_56b.yaml cites). examples/llm_benchmark/nemotron/nemotron_nano_v3_te_deepep.yaml at 36044ad: ep_size 8,
    # activation_checkpointing: true (full recompute), MaskedCrossEntropy fp32_upcast false.
    "automodel-Nemotron_V3_Nano_30B-8gpu-bf16": {
        "recompute": "full", "cross_entropy_fusion": True,
        "model": ["model.hybrid_layer_pattern=MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME",
                  "model.mamba_num_heads=64", "model.mamba_head_dim=64", "model.mamba_state_dim=128",
                  "model.mamba_num_groups=8", "model.kv_channels=128", "model.position_embedding_type=none",
                  "model.normalization=RMSNorm"]},
    # Nemotron-3 Super 120B-A12B: its shape is the shipped model (SHIPPED_MODELS); its AutoModel config
    # examples/llm_benchmark/nemotron/nemotron_super_v3_te_deepep.yaml at 36044ad3 (the table's commit) sets ep_size 64
    # (:43) under FSDP2 of 64 (:39, priced as ZeRO 3, as the other AutoModel FSDP2 rows), activation_checkpointing: true
    # (:45: the expert-parallel path wraps every decoder block whole, the MoE parallelizer's apply_ac as for the rows
    # above, nemotron_v3/model.py:487-497: full recompute), MaskedCrossEntropy fp32_upcast: false (:72-74: the fused loss),
    # dispatcher hybridep with fake_balanced_gate: true (:65-66; HybridEP is NVIDIA's NVLink + RDMA dispatcher of the
    # DeepEP kind, sending a token once to each rank holding its experts: priced as the other AutoModel rows' DeepEP).
    "automodel-Nemotron_V3_Super_120B-64gpu-bf16": {"ep": 64, "recompute": "full", "cross_entropy_fusion": True,
                                                    "assumed": ["HybridEP dispatch priced as DeepEP's"]},
    # Nemotron-3 Ultra 550B-A55B: its shape is the shipped model (SHIPPED_MODELS, with its two repeated MTP depths, which
    # the row's 293 TFLOP/s count); examples/llm_benchmark/nemotron/nemotron_ultra_v3_te_deepep.yaml at 36044ad3 sets
    # ep_size 64 (:55) under FSDP2 (:51, priced as ZeRO 3), activation_checkpointing: true (:56, full recompute as for
    # Super), FusedLinearCrossEntropy (:93, the fused loss) and the hybridep dispatcher with fake_balanced_gate (:85-86).
    # The config at that commit runs local batch 1 at global batch 128; the table's row (GBS 256, MBS 2) is kept.
    "automodel-Nemotron_V3_Ultra_550B-128gpu-bf16": {"ep": 64, "recompute": "full", "cross_entropy_fusion": True,
                                                     "assumed": ["HybridEP dispatch priced as DeepEP's"]},
    # The BF16 table of commit cb3482d0 gives only 16 GPUs and GBS 32; the row's TP1 PP4 MBS2 is the
    # FP8 row's of the later table (0d09460d). The run's recipe, examples/training/nemotron/h100/
    # nemotron_22b_bf16.sh at cb3482d0, sets num_nodes=2, micro_batch_size=1 and keeps the conf's
    # tensor_model_parallel_size 2, pipeline 4, virtual 10, sequence_parallel and ub_tp_comm_overlap
    # (launcher_scripts/conf/training/nemotron/nemotron_22b.yaml:58-64,128,156 at 24.01), no recompute.
    "launcher-24.01-Nemotron-22B-bf16": {"layout": {"tp": 2, "pp": 4, "vp": 10, "dp": 2, "mbs": 1,
                                                    "sequence_parallel": True}},
    # Its FP8 sibling's 499 TFLOP/s were first published in that same table (cb3482d0) beside the same
    # recipe (nemotron_22b_fp8.sh: 2 nodes, MBS 1, the conf's TP 2 PP 4 VP 10); 0d09460d only added
    # layout columns, printing TP 1 PP 4 MBS 2, a layout whose 5.5-7 B parameters a device (60 GiB of
    # weights, fp8 copies, gradients and Adam state) and 40 in-flight chunks at MBS 2 cannot run in
    # 80 GB without a recomputation the recipe does not set.
    "launcher-24.01-Nemotron-22B-fp8": {"layout": {"tp": 2, "pp": 4, "vp": 10, "dp": 2, "mbs": 1,
                                                   "sequence_parallel": True}},
    # The 2024-04-22 table (81b75a7c) prints TP 4 PP 1, but three days earlier 5c7e280a "Fixed llama2 13b
    # perf (#293)" moved launcher_scripts/conf/training/llama/llama2_13b.yaml to tensor 1, pipeline 4,
    # virtual 10, ub_tp_comm_overlap false (lines 60-62, 136 at 81b75a7c), and the row's 8,317 tokens/s/GPU
    # is that layout's (launcher-24.05-LLAMA2-13B-fp8, TP1 PP4: 8,344), not a TP-4 one.
    "launcher-24.03-LLAMA2-13B-fp8": {"layout": {"tp": 1, "pp": 4, "vp": 10, "dp": 4,
                                                 "sequence_parallel": False, "tp_comm_overlap": False}},
    # Megatron-Bridge rows: NVIDIA-NeMo/Megatron-Bridge at the row's recipe tag, v0.1.0rc4 (NeMo 25.09:
    # scripts/performance/run_script.py, configs/*/*_llm_pretrain.yaml, src/megatron/bridge/recipes/) or v0.2.0
    # (25.11: scripts/performance/configs/*/workload_base_configs.py, *_llm_pretrain.py). What every Bridge row
    # shares is in BRIDGE_DEFAULTS below.
    # Llama 3.1 405B: 126 layers + the embedding + the loss = 128 = 8 x 8 chunks of 2 (recipes/llama/
    # llama31_405b.py:47-48,73-74 at v0.1.0rc4; recipes/llama/llama3.py:413-414 llama31_405b_pretrain_config at v0.2.0).
    "mb-25.09-LLAMA3.1_405B-fp8": {"plan": ["plan.account_for_embedding_in_pipeline_split=true",
                                            "plan.account_for_loss_in_pipeline_split=true"]},
    "mb-25.11-LLAMA3.1_405B-fp8cs": {"plan": ["plan.account_for_embedding_in_pipeline_split=true",
                                              "plan.account_for_loss_in_pipeline_split=true"]},
    # Qwen3-235B-A22B: 94 layers + 2 = 96 = 8 x 4 chunks of 3 (recipes/qwen/qwen3_235b_a22b.py:70-71 at v0.1.0rc4,
    # recipes/qwen/qwen3_moe.py:160-161 at v0.2.0); qk-layernorm as every Qwen3 MoE (Qwen3MoEModelProvider
    # qk_layernorm=True, models/qwen/qwen_provider.py:371 at v0.1.0rc4, :351 at v0.2.0; the row's arch note omits it).
    "mb-25.09-Qwen3_235B_a22B-fp8-tokendrop": {"plan": ["plan.account_for_embedding_in_pipeline_split=true",
                                                        "plan.account_for_loss_in_pipeline_split=true"],
                                               "model": ["model.qk_layernorm=true", *TOKEN_DROP]},
    "mb-25.11-Qwen3_235B_a22B-fp8cs": {"plan": ["plan.account_for_embedding_in_pipeline_split=true",
                                                "plan.account_for_loss_in_pipeline_split=true"],
                                       "model": ["model.qk_layernorm=true"]},
    # Qwen3-30B-A3B: the tables print VP 24, the recipes set 12 at both tags (configs/qwen3/
    # qwen3_30b_a3b_llm_pretrain.yaml:66 at v0.1.0rc4, workload_base_configs.py:237 at v0.2.0): 48 layers = 2 x 12
    # chunks of 2 (24 = pp x vp). MBS 2 as the tables (the 25.09 yaml's fp8_cs :73; the 25.11 table's GA 32 = 512 /
    # (8 x 2) agrees with its MBS 2). The 25.09 run drops tokens at capacity factor 1.0 padded to capacity
    # (TOKEN_DROP): every expert gets exactly its balanced share, as the 25.11 run's forced balancing
    # (qwen3_llm_pretrain.py:47) gives on average.
    "mb-25.09-Qwen3_30B_a3B-fp8-tokendrop": {"layout": {"vp": 12}, "model": TOKEN_DROP},
    "mb-25.11-Qwen3_30B_a3B-fp8cs": {"layout": {"vp": 12}},
    # Llama 3 8B at 25.11: LLAMA3_8B_H100_FP8_CS_BASE_CONFIG (configs/llama3/workload_base_configs.py:229-233 at
    # v0.2.0) sets recompute_num_layers=5, full recompute of the first 5 layers (utils/helpers.py:163-179
    # set_recompute_overrides: granularity full, method block), and no use_megatron_fsdp, where the table prints
    # FSDP (as the 25.09 recipe ran it, llama3_8b_llm_pretrain.yaml:73-77). Where the two disagree the table, the
    # measurement's own record, is kept: Megatron-FSDP (optim_grads_params, helpers.py:72 at v0.1.0rc4); at the
    # distributed optimizer the 5 layers' recompute leaves 83.5 GiB a device in this memory model, over 80 GB.
    "mb-25.11-LLAMA3_8B-fp8cs": {"zero": 3, "recompute": "full", "recompute_num_layers": 5},
    # DeepSeek-V3 (25.09, H100): run_script.py:56-66,77-91 at v0.1.0rc4: DeepEP (the flex dispatcher,
    # recipes/deepseek/deepseek_v3.py:146-149), forced load balancing, the layout 'Et|(tt|)*30mL' (an embedding
    # stage with 1 layer, 30 stages of 2, the MTP depth and the loss), recompute_modules [mla_up_proj, mlp];
    # mtp_num_layers 1 (deepseek_v3.py:51); moe_permute_fusion (:109); router 8 groups, top 4
    # (models/deepseek/deepseek_provider.py:178-179 DeepSeekV3Provider). mla_up_proj runs the q / kv up-projections
    # again (cost/recompute.py), mlp only the 3 dense layers.
    "mb-25.09-DeepSeekV3-fp8cs": {
        "plan": ["plan.pipeline_model_parallel_layout='Et|(tt|)*30mL'"],
        "model": ["model.mtp_num_layers=1", "model.moe_router_num_groups=8", "model.moe_router_group_topk=4"],
        "optimizations": {"dp_overlap_grad_reduce": False},  # the H100 branch (run_script.py:101-102)
        "moe_dispatcher": "deepep", "recompute": "selective", "recompute_modules": ["mla_up_proj", "mlp"]},
    # GPT-OSS 120B (25.11): GPT_OSS_120B_H100_BF16_BASE_CONFIG (configs/gpt_oss/workload_base_configs.py:22-28,58-62
    # at v0.2.0): PP 4, EP 8, MBS 1 (the table's MBS 4 / GA 2 do not multiply to GBS 512 over DP 16; they are the
    # B200 row's). It names recompute_modules [layernorm, moe_act], but v0.2.0's set_recompute_overrides
    # (utils/helpers.py:163-179, called at :78-80) sets only the modules, not the granularity, and no GPT-OSS recipe
    # or provider sets one: megatron-core recomputes a module only under selective granularity
    # (transformer_layer.py:382-383, moe/experts.py:102-104 at 0.16.1), so the run recomputed nothing. v0.3.0 sets
    # it (overrides.py:141-143): the later releases' runs recompute (held_out.LATER_RECIPES).
    "mb-25.11-GPT_OSS_120B-bf16": {"layout": {"mbs": 1}, "recompute": "none"},
}
# The same run with FP8 blockwise scaling: Transformer Engine's userbuffers take no blockwise FP8 (the TP overlap rule,
# parallel/rules.py), so its TP collectives ran without them
ROW_SETTINGS["mb-25.09-DeepSeekV3-fp8blockwise"] = {**ROW_SETTINGS["mb-25.09-DeepSeekV3-fp8cs"],
                                                    "optimizations": {"dp_overlap_grad_reduce": False,
                                                                      "tp_comm_overlap": False}}
# What every Megatron-Bridge perf recipe sets (both tags): gradients reduced in bf16 (mixed_precision
# grad_reduce_in_fp32: false, each configs/*/*_llm_pretrain.yaml at v0.1.0rc4, set_*_common_configs at v0.2.0), the
# fused cross-entropy (GPTModelProvider cross_entropy_loss_fusion=True, models/gpt_provider.py:152 at v0.1.0rc4,
# :180 at v0.2.0), Transformer Engine's fused MoE permutation (Qwen3MoEModelProvider moe_permute_fusion=True,
# qwen_provider.py:396 / :375; GPTOSSProvider gpt_oss_provider.py:73; deepseek_v3.py:109), the current-scaling FP8
# recipe (utils/helpers.py get_precision_config 'cs': bf16_with_fp8_current_scaling_mixed, --fp8-recipe tensorwise)
# and Megatron's distributed optimizer with fp32 state.
FP8_RECIPE_OF = (("blockwise", "blockwise"), ("current scaling", "tensorwise"))
# BRIDGE_A2A_OVERLAP: the rows whose optimizations say ep_a2a_overlap_1f1b (the DeepSeek-V3 rows of 25.09, Qwen3 of 25.11)
# ran Megatron's EP all-to-all overlap with the delayed weight gradient: overlap_moe_expert_parallel_comm and
# delay_wgrad_compute, set on H100 by run_script.py:62,82-84 at v0.1.0rc4 and by moe_a2a_overlap=True
# (workload_base_configs.py:131,143,227,238 at v0.2.0) through helpers.py:182-186 set_moe_a2a_overlap_overrides  # the row's fp8_recipe note -> key
# The optimizer's state, as the dtypes of its master weight and moments (model/spec.py OptimizerDtypes; None:
# Megatron's fp32 ones, 12 B a parameter):
# - megatron: Megatron's distributed optimizer.
# - automodel: the AutoModel rows' torch.optim.Adam (examples/llm_benchmark/*.yaml) on the bf16 parameters FSDP2 shards:
#   the models are built in bf16 (NeMoAutoModelForCausalLM.from_config's torch_dtype "auto" is bfloat16,
#   nemo_automodel/_transformers/auto_model.py:846 at 36044ad, components/_transformers/auto_model.py:360 at
#   89e3a9fdd; the custom MoE models take config.torch_dtype, bf16, components/models/qwen3_moe/model.py:231,271 at
#   89e3a9fdd), no config sets model.torch_dtype float32, and Adam keeps its moments in the parameters' dtype: no
#   master, bf16 moments (0 + 2 + 2; the bf16 storage that components/distributed/config.py:247-251 warns of).
#   FSDP2 reduces the gradients in fp32 (its MixedPrecisionPolicy reduce_dtype, config.py:306-313): priced so.
# - apex_remainders: NeMo 1.x's distributed_fused_adam (Apex DistributedFusedAdam) under bf16 O2 training
#   with the default optim.dtype fp32: store_params=False, store_param_remainders=True, the fp32 master
#   weight rebuilt from the bf16 weight and its 16 low bits (2 + 4 + 4; NeMo v1.23.0
#   nemo/collections/nlp/models/language_modeling/megatron_base_model.py:744-750, v2.0.0 :797-812).
# - apex_bf16: the same with optim.dtype bf16 (optim_dtype == model_dtype: store_params=False): bf16
#   moments and no master copy (0 + 2 + 2), as launcher conf nemotron/nemotron_340b.yaml:158-162 at 24.07.
# Every launcher conf of these rows sets optim.name distributed_fused_adam (the long-sequence rows: NeMo's
# default); nemotron_340b.yaml (24.07) also sets optim.dtype bf16.
BF16_STATE = OptimizerDtypes(main_params="none", exp_avg="bf16", exp_avg_sq="bf16")
OPTIMIZERS = {"megatron": None, "apex_remainders": OptimizerDtypes(), "apex_bf16": BF16_STATE, "automodel": BF16_STATE}
NEMO_OPTIMIZER = "apex_remainders"
OPTIMIZER_BY_MODEL = {"Nemotron-340B": "apex_bf16"}
# The AutoModel MoE rows dispatch with DeepEP ("TE + DeepEP" in the table; enable_deepep: true in the
# configs at 89e3a9fdd, :73) and route with FakeBalancedGate (fake_balanced_gate: true, :74; the row's
# moe_fake_balanced_gate): cost/layer.py dispatch_copies. The launcher's Mixtral confs (24.05) use
# Megatron's alltoall dispatcher and a learned router. AutoModel's DeepEP experts permute with
# Transformer Engine's fused kernels (nemo_automodel/components/moe/layers.py:420 moe_permute_fusion=True
# at 89e3a9fdd); NeMo 24.05's megatron-core 0.7 had no fused permutation (core_r0.7.0 moe_utils.py:130-203).
AUTOMODEL_MOE_DISPATCH = ("deepep", "fake_balanced")
# Rows whose model the table does not give and a shipped model config (hydra_configs/model/) does, with its sources
# there: row id -> the config's name. Nemotron-3 Super's shape is NeMo AutoModel's FLOP-test config
# (tests/unit_tests/utils/test_flops_utils.py _nemotronh_super_v3_cfg at 36044ad3), whose expected FLOPs give the
# row's implied 74.27 GFLOP a token (74.7 at 2,048 tokens); the row's seq_length is set on it.
SHIPPED_MODELS = {"automodel-Nemotron_V3_Super_120B-64gpu-bf16": "nemotron3_super",
                  "automodel-Nemotron_V3_Ultra_550B-128gpu-bf16": "nemotron3_ultra"}
MODEL_CONFIG_DIR = Path(__file__).resolve().parents[1] / "hydra_configs" / "model"
GPT_OSS_WINDOW = 128  # GPT-OSS: every other layer attends to the last 128 tokens (row arch note)


@dataclass(frozen=True)
class Row:
    id: str
    source: str  # e.g. NeMo-Framework-Launcher 24.01
    precision: str  # bf16 | fp8
    moe: bool
    status: str  # published | draft ...
    measured_step_s: float
    overrides: list[str] = field(default_factory=list)  # for `nest-megatron evaluate`; empty when not expressible
    not_expressible: str | None = None  # why the cost model cannot express this row's model
    assumed: tuple[str, ...] = ()  # settings the row does not state, filled with its source's default
    recompute_stated: bool = True  # False: a recipe default; the bench falls back to selective, then full

    @property
    def release(self) -> str:
        """The software release the run measured: the launcher's or NeMo's container tag (the id's first two
        words), or AutoModel's one commit of tables."""
        return "automodel" if self.source == "automodel" else "-".join(self.id.split("-")[:2])
    optimizer: str = "megatron"  # the optimizer's state dtypes (OPTIMIZERS)
    moe_dispatcher: str = "alltoall"  # cost/problem.py Problem.moe_dispatcher
    moe_router: str = "learned"  # cost/problem.py Problem.moe_router
    moe_permute_fusion: bool = False  # cost/problem.py Problem.moe_permute_fusion
    pipeline_runs: int = 1  # cost/problem.py Problem.pipeline_runs


def load_entries(path: Path = CALIBRATION_PATH) -> list[dict]:
    return yaml.safe_load(path.read_text())["entries"]


def rows(path: Path = CALIBRATION_PATH) -> list[Row]:
    return [row_of(entry) for entry in load_entries(path)]


def source_of(entry: dict) -> str:
    repo = entry["source"]["repo"].split("/")[-1]
    return {"NeMo-Framework-Launcher": "launcher", "NeMo": "nemo", "Automodel": "automodel",
            "Megatron-Bridge": "bridge"}.get(repo, repo)


def convention_flops_per_token(entry: dict) -> float:
    """Model FLOPs per token under the row's source convention (the calibration file's
    meta.model_flops_conventions): NeMo 1.x, the launcher and NeMo 24.07 count full (non-causal)
    attention, 12 s q per layer and token, plus 6 x every GEMM weight the token meets, output layer
    included (Korthikanti et al., Appendix A, generalised to GQA and gated MLPs)."""
    s = entry["model_shape"]
    h, layers, seq = s["hidden"], s["layers"], entry["seq_length"]
    head_dim = s.get("head_dim") or h // s["heads"]
    q, kv = s["heads"] * head_dim, s["query_groups"] * head_dim
    gated = _arch(entry)["swiglu"]
    mlp = (3 if gated else 2) * h * s["ffn"]
    per_layer = 6 * (h * (q + 2 * kv) + q * h + mlp) + 12 * seq * q
    return layers * per_layer + 6 * h * s["vocab"]


def measured_step_time(entry: dict) -> float:
    """Seconds per step: from tokens/s per GPU where the table gives it, else from model TFLOP/s
    per GPU under the source's FLOP convention (only NeMo-era rows lack tokens/s)."""
    tokens = entry["gbs"] * entry["seq_length"]
    if entry.get("tokens_per_sec_per_gpu"):
        return tokens / (entry["tokens_per_sec_per_gpu"] * entry["num_gpus"])
    # A Bridge variant printed only as TFLOP/s beside its sibling's tokens/s (DeepSeek-V3 blockwise: '338 (330)'):
    # the same model and FLOPs a token, so its tokens/s are the sibling's scaled by the TFLOP/s, the file's derived
    # tokens_per_sec_per_gpu_estimate (1297 x 330 / 338 = 1266)
    estimate = (entry.get("derived") or {}).get("tokens_per_sec_per_gpu_estimate")
    if estimate:
        return tokens / (estimate * entry["num_gpus"])
    flops = convention_flops_per_token(entry) * tokens
    return flops / (entry["model_tflops_per_gpu"] * 1e12 * entry["num_gpus"])


def _arch(entry: dict) -> dict:
    """Model keys implied by the row's architecture note."""
    arch = entry["model_shape"]["arch"]
    gpt3 = arch.startswith("GPT (")
    return {
        "swiglu": not gpt3 and "squared-ReLU" not in arch,
        "squared_relu": "squared-ReLU" in arch,
        "position_embedding_type": "learned_absolute" if gpt3 else "rope",
        "normalization": "LayerNorm" if gpt3 or "Nemotron" in arch else "RMSNorm",
        "add_bias_linear": gpt3 or "GPT-OSS" in arch,
        "dropout": 0.1 if gpt3 else 0.0,  # NeMo's GPT-3 configs keep dropout 0.1; the others train without
        "untie": not gpt3,
        "qk_layernorm": "qk-layernorm" in arch or "MLA" in arch,  # MLA: the q and kv latents' norms
        "window": GPT_OSS_WINDOW if "GPT-OSS" in arch else None,
        "mla": _mla(arch),
    }


# DeepSeek-V3's MLA widths (config_671B.json: q_lora_rank 1536, kv_lora_rank 512, qk_nope_head_dim 128,
# qk_rope_head_dim 64, v_head_dim 128), which Kimi K2 keeps (moonshotai/Kimi-K2-Instruct config.json; its row's note
# says only "DeepSeek-V3-style MLA")
MLA_WIDTHS = {"q_lora": 1536, "kv_lora": 512, "qk_nope": 128, "qk_rope": 64, "v": 128}
MLA_KEYS = {"q_lora": "q_lora_rank", "kv_lora": "kv_lora_rank", "qk_nope": "qk_head_dim",
            "qk_rope": "qk_pos_emb_head_dim", "v": "v_head_dim"}


def _mla(arch: str) -> dict | None:
    """The MLA widths the note gives ('q_lora 1536, kv_lora 512, ...'), DeepSeek-V3's where it names none."""
    if "MLA" not in arch:
        return None
    given = {k: int(m.group(1)) for k in MLA_WIDTHS if (m := re.search(rf"\b{k} (\d+)", arch))}
    return {**MLA_WIDTHS, **given}


def _first_dense(arch: str) -> int:
    """Leading dense layers of a MoE model, from the note ('first 3 layers dense', 'first layer dense')."""
    m = re.search(r"first (\d+ )?layers? dense", arch)
    return int(m.group(1) or 1) if m else 0


def _not_expressible(entry: dict) -> str | None:
    arch = entry["model_shape"]["arch"]
    if entry["id"] in SHIPPED_MODELS:
        return None
    if not entry["model_shape"].get("layers"):
        return "model shape not published"
    if ("Mamba" in arch or "hybrid" in arch) and "model" not in ROW_SETTINGS.get(entry["id"], {}):
        return "hybrid stack: the row's note gives no pattern and Mamba sizes to map"
    return None


def _recompute(entry: dict) -> tuple[str, bool]:
    """(recompute, stated). Stated: the run's own config says so. Otherwise it is the recipe's
    default (or nothing is known): the bench keeps the first of it, selective and full that fits,
    since the run ran."""
    text = str(entry["recompute"])
    if "activation_checkpointing: true" in text:
        return "full", True
    if "activation_checkpointing: false" in text:
        return "none", True
    if "selective" in text:
        return "selective", False
    return "none", False  # "none (launcher default)", "not stated"


def _model_overrides(entry: dict) -> list[str]:
    s, a = entry["model_shape"], _arch(entry)
    out = [
        f"model.name={entry['id']}", f"model.num_layers={s['layers']}", f"model.hidden_size={s['hidden']}",
        f"model.ffn_hidden_size={s['ffn']}", f"model.num_attention_heads={s['heads']}",
        f"model.num_query_groups={s['query_groups'] or 'null'}", f"model.seq_length={entry['seq_length']}",
        f"model.vocab_size={s['vocab']}", f"model.swiglu={str(a['swiglu']).lower()}",
        f"model.squared_relu={str(a['squared_relu']).lower()}",
        f"model.position_embedding_type={a['position_embedding_type']}", f"model.normalization={a['normalization']}",
        f"model.add_bias_linear={str(a['add_bias_linear']).lower()}", f"model.hidden_dropout={a['dropout']}",
        f"model.attention_dropout={a['dropout']}",
        f"model.untie_embeddings_and_output_weights={str(a['untie']).lower()}",
        f"model.qk_layernorm={str(a['qk_layernorm']).lower()}",
    ]
    if s.get("head_dim"):
        out.append(f"model.kv_channels={s['head_dim']}")
    if s.get("experts"):
        out += [f"model.num_experts={s['experts']}", f"model.moe_router_topk={s['topk']}",
                f"model.moe_ffn_hidden_size={s['moe_ffn']}"]
        shared = s.get("shared_expert_ffn") or (s["moe_ffn"] if "1 shared expert" in s["arch"] else None)
        if shared:
            out.append(f"model.moe_shared_expert_intermediate_size={shared}")
        dense = _first_dense(s["arch"])
        if dense:
            out.append("model.moe_layer_freq=[" + ",".join(["0"] * dense + ["1"] * (s["layers"] - dense)) + "]")
    if a["mla"]:
        out += ["model.multi_latent_attention=true",
                *(f"model.{MLA_KEYS[k]}={v}" for k, v in a["mla"].items())]
    if a["window"]:
        out += [f"model.window_size={a['window']}", "model.window_attn_skip_freq=2"]
    return out


def _shipped_is_moe(name: str) -> bool:
    return bool(yaml.safe_load((MODEL_CONFIG_DIR / f"{name}.yaml").read_text()).get("num_experts"))


def row_of(entry: dict, settings: dict | None = None) -> Row:
    """The bench's row of a calibration entry; `settings` replace its ROW_SETTINGS (a later release's recipe)."""
    shipped = SHIPPED_MODELS.get(entry["id"])
    moe = _shipped_is_moe(shipped) if shipped else bool(entry["model_shape"].get("experts"))
    common = dict(id=entry["id"], source=source_of(entry), precision=entry["precision_class"].lower(), moe=moe,
                  status=str(entry["status"]).split(" ")[0])
    why = _not_expressible(entry)
    if why:
        return Row(**common, measured_step_s=math.nan, not_expressible=why)
    settings = ROW_SETTINGS.get(entry["id"], {}) if settings is None else settings
    assumed = list(settings.get("assumed", []))
    layout = settings.get("layout", {})
    if layout:
        entry = {**entry, **{k: v for k, v in layout.items() if k != "tp_comm_overlap"}}
        if "tp_comm_overlap" in layout:
            entry["optimizations"] = {**(entry.get("optimizations") or {}),
                                      "tp_comm_overlap_userbuffers": layout["tp_comm_overlap"]}
        assumed.append("layout " + " ".join(f"{k}={v}" for k, v in layout.items()) + " (the recipe's)")
    release = "-".join(entry["id"].split("-")[:2])
    ep = entry["ep"] or settings.get("ep", 1)
    if entry["ep"] is None and moe:
        assumed.append(f"ep={ep} (the recipe's)")
    vp = entry["vp"]
    recipe_pp, recipe_vp = RECIPE_VP.get((release, entry["model"]), (None, None))
    if vp is None and recipe_pp == entry["pp"]:
        vp = recipe_vp
        assumed.append(f"vpp={vp} (the recipe's)")
    bridge = source_of(entry) == "bridge"
    grad_bf16 = bridge or (release in GRAD_BF16_RELEASES and entry["model"].startswith(GRAD_BF16_MODELS))
    if grad_bf16 and not bridge:
        assumed.append("grad_reduce_in_bf16 (the recipe's grad_sync_dtype=bf16)")
    fused_loss = settings.get("cross_entropy_fusion", bridge)
    mbs = entry["mbs"] or 1
    if entry["mbs"] is None:
        assumed.append("mbs=1 (not stated)")
    fsdp = bool(entry["fsdp"])
    in_pipeline = fsdp and entry["pp"] > 1  # FSDP2 inside AutoModel's pipeline stages: FSDP2_IN_PIPELINE
    zero = settings.get("zero", 1 if in_pipeline else 3 if fsdp else 1)  # every Megatron row: a distributed optimizer
    if "zero" in settings:
        assumed.append(f"zero={zero} (the recipe's)")
    elif not fsdp and not str(entry["distributed_optimizer"]).lower().startswith("true"):
        assumed.append("zero=1 (NeMo's default distributed optimizer; not stated)")
    recompute, stated = _recompute(entry)
    stated = stated or bridge  # the Bridge perf configs state their recomputation (ROW_SETTINGS where it is not none)
    if "recompute" in settings:
        recompute, stated = settings["recompute"], True
        modules = f" [{', '.join(settings['recompute_modules'])}]" if "recompute_modules" in settings else ""
        assumed.append(f"recompute={recompute}{modules} (the recipe's)")
    opt = {**(entry.get("optimizations") or {}), **settings.get("optimizations", {})}
    plan = [f"plan.tp={entry['tp']}", f"plan.pp={entry['pp']}", f"plan.cp={entry['cp']}", f"plan.dp={entry['dp']}",
            f"plan.vpp={vp or 1}", f"plan.mbs={mbs}", f"plan.zero={zero}",
            f"plan.sp={str(bool(entry['sequence_parallel']) and entry['tp'] > 1).lower()}"]
    if moe:
        plan += [f"plan.ep={ep}", "plan.etp=1"]
    plan.append(f"plan.recompute={recompute}")
    if "recompute_num_layers" in settings:
        plan.append(f"plan.recompute_num_layers={settings['recompute_num_layers']}")
    if "recompute_modules" in settings:
        plan.append(f"plan.recompute_modules=[{','.join(settings['recompute_modules'])}]")
    plan += settings.get("plan", [])
    runs = 1
    if in_pipeline:
        chunks = automodel_stage_layers(entry["model_shape"]["layers"], entry["pp"] * (vp or 1))
        runs = entry["gbs"] // (entry["local_batch_size"] * entry["dp"])
        plan.append(f"plan.layers_per_stage=[{','.join(map(str, chunks))}]")
        assumed.append(f"zero=1, {runs} pipeline schedule(s) a step, AutoModel's split {_runs_of(chunks)} "
                       "(FSDP2 inside pipeline stages)")
    fp8_recipe = next((key for words, key in FP8_RECIPE_OF if words in str(entry.get("fp8_recipe"))), None)
    tp_overlap = bool(opt.get("tp_comm_overlap_userbuffers")) or opt.get("tp_comm_overlap") is True
    train = [f"train.global_batch_size={entry['gbs']}", f"train.precision={entry['precision_class'].lower()}",
             f"train.overlap_grad_reduce={str(opt.get('dp_overlap_grad_reduce', True)).lower()}",
             f"train.overlap_param_gather={str(opt.get('dp_overlap_param_gather', True)).lower()}",
             f"train.tp_comm_overlap={str(tp_overlap and entry['tp'] > 1).lower()}",
             f"train.grad_reduce_in_bf16={str(grad_bf16).lower()}",
             f"train.cross_entropy_fusion={str(fused_loss).lower()}"]
    if opt.get("ep_a2a_overlap_1f1b"):  # the Bridge recipes' moe_a2a_overlap: both flags (BRIDGE_A2A_OVERLAP)
        plan.append("plan.moe_a2a_overlap=true")
        train.append(f"train.delay_wgrad_compute={str(bool(opt.get('delay_wgrad_compute'))).lower()}")
    if bridge and fp8_recipe and entry["precision_class"] == "FP8":
        train.append(f"train.fp8_recipe={fp8_recipe}")
    model = ([f"model={shipped}", f"model.seq_length={entry['seq_length']}"] if shipped
             else ["model=llama2_7b", *_model_overrides(entry)])
    if shipped:
        assumed.append(f"model {shipped} (hydra_configs/model/{shipped}.yaml: the table gives no shape)")
    overrides = [model[0], "cluster=dgx_h100_superpod", f"cluster.num_devices={entry['num_gpus']}", *model[1:],
                 *settings.get("model", []), *train, *plan]
    optimizer = (OPTIMIZER_BY_MODEL.get(entry["model"], NEMO_OPTIMIZER) if is_nemo_era(entry)
                 else "automodel" if source_of(entry) == "automodel" else "megatron")
    if optimizer == "apex_bf16":
        assumed.append("optimizer state in bf16 (the recipe's optim.dtype)")
    elif optimizer == "automodel":
        assumed.append("bf16 parameters and Adam moments, no master copy (AutoModel's bf16 model)")
    dispatcher, router = AUTOMODEL_MOE_DISPATCH if moe and source_of(entry) == "automodel" else ("alltoall", "learned")
    if "moe_dispatcher" in settings:
        dispatcher = settings["moe_dispatcher"]
        if not bridge:
            assumed.append(f"{dispatcher} token dispatcher (megatron-core's default; the conf sets none)")
    if dispatcher == "deepep":
        assumed.append("DeepEP dispatch, " + ("forced balanced router (uniform)" if bridge else "fake balanced gate")
                       + ", fused permutation (the recipe's)")
    return Row(**common, measured_step_s=measured_step_time(entry), overrides=overrides, assumed=tuple(assumed),
               recompute_stated=stated, optimizer=optimizer, moe_dispatcher=dispatcher, moe_router=router,
               moe_permute_fusion=dispatcher == "deepep" or (bridge and moe), pipeline_runs=runs)


# FSDP2 inside AutoModel's pipeline stages (the DeepSeek-V3 and Kimi K2 rows). PyTorch's pipelining runs every
# backward of an FSDP2 stage but a step's last without resharding or reducing gradients (torch 2.13
# distributed/pipelining/stage.py:845-847, the reduction once after the last micro-batch, :1175-1177; AutoModel patches
# it to the last backward before the optimizer step, components/moe/fsdp_mixin.py:130-138 at 36044ad), and AutoModel's
# MoE parallelizer keeps a layer's weights gathered after its forward (reshard_after_forward False,
# components/moe/parallelizer.py:646, the configs' moe.reshard_after_forward: false). So a stage gathers its weights
# once a step, keeps them and its gradients whole, and reduce-scatters the gradients once: the traffic and memory of
# Megatron's distributed optimizer (ZeRO 1), with AutoModel's bf16 state (OPTIMIZERS). The benchmark runs its
# gradient accumulation as separate pipeline schedules (recipes/llm/benchmark.py:349-370: one schedule.step per
# local batch, ga_steps = global batch / (local batch x DP), :311), each filling and draining the pipeline.
def automodel_stage_layers(num_layers: int, stages: int) -> list[int]:
    """AutoModel's layers per pipeline stage (components/distributed/pipelining/functional.py:98-178
    generate_hf_model_fqn_per_model_part at 36044ad): num_layers // stages each, one more on the first
    num_layers % stages; the embedding on the first, the norm and output layer on the last. Stage s sits on rank
    s % pp (the interleaved schedule's loop order), which is Megatron's model-chunk order."""
    base, extra = divmod(num_layers, stages)
    return [base + (s < extra) for s in range(stages)]


def _runs_of(chunks: list[int]) -> str:
    """A split written by its runs: [2, 2, 2, 1] -> '3 x 2 + 1 x 1'."""
    runs: list[list[int]] = []
    for n in chunks:
        if runs and runs[-1][1] == n:
            runs[-1][0] += 1
        else:
            runs.append([1, n])
    return " + ".join(f"{count} x {n}" for count, n in runs)


def implied_gflops_per_token(entry: dict) -> float | None:
    """The row's own GFLOP per token (model TFLOP/s over tokens/s), where it gives both."""
    if entry.get("tokens_per_sec_per_gpu") and entry.get("model_tflops_per_gpu"):
        return entry["model_tflops_per_gpu"] * 1e3 / entry["tokens_per_sec_per_gpu"]
    return None


def is_nemo_era(entry: dict) -> bool:
    """Rows whose TFLOP/s follow the NeMo 1.x / launcher / NeMo 24.07 convention."""
    return source_of(entry) in ("launcher", "nemo")
