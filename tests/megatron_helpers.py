"""Helpers for tests/test_megatron_agreement.py: one CPU process posing as one rank of a
megatron-core job, and a megatron-core GPTModel built on the meta device from a ModelConfig.

Imported only after ``pytest.importorskip("megatron.core")``.
"""

from __future__ import annotations

import contextlib
import math
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import parallel_state as ps
from omegaconf import OmegaConf

from nest_megatron.config.schema import ModelConfig
from nest_megatron.model.spec import ModelSpec

MODEL_CONFIGS = Path(__file__).resolve().parents[1] / "hydra_configs" / "model"


def load_model_config(name: str, **overrides) -> ModelConfig:
    """A shipped model YAML merged onto the ModelConfig schema (as config/load.py does)."""
    merged = OmegaConf.merge(OmegaConf.structured(ModelConfig), OmegaConf.load(MODEL_CONFIGS / f"{name}.yaml"))
    merged = OmegaConf.merge(merged, overrides)
    return OmegaConf.to_object(merged)


def teardown_distributed() -> None:
    """Forget megatron's parallel state and the process group, whatever set them up."""
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def ensure_single_process() -> None:
    """The state nest_megatron.trace.cpu_megatron.prepare_cpu_megatron sets up (a one-rank gloo
    group, TP = PP = 1), re-created if a fake-rank test tore it down: prepare_cpu_megatron runs its
    set-up once per process only."""
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(1, 1)


@contextlib.contextmanager
def as_rank(rank: int, world: int, *, tp: int = 1, pp: int = 1, ep: int = 1, etp: int | None = None,
            order: str = "tp-cp-ep-dp-pp"):
    """Make this process rank `rank` of a `world`-rank job: a fake process group (no
    communication; collectives return at once) and megatron's own initialize_model_parallel, so
    that megatron computes this rank's TP/PP/EP coordinates and group sizes itself."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    teardown_distributed()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        ps.initialize_model_parallel(
            tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=pp,
            expert_model_parallel_size=ep,
            expert_tensor_parallel_size=etp,
            order=order,
            create_gloo_process_groups=False,
        )
        yield
    finally:
        teardown_distributed()


@contextlib.contextmanager
def meta_cuda_is_identity():
    """With tied embeddings and PP > 1, LanguageModule.setup_embeddings_and_output_layer moves
    the word-embedding copy to CUDA (`weight.data.cuda()`) before all-reducing it over the
    embedding group. A meta tensor has no data to move: let `.cuda()` return it unchanged."""
    original = torch.Tensor.cuda

    def cuda(self, *args, **kwargs):
        return self if self.is_meta else original(self, *args, **kwargs)

    torch.Tensor.cuda = cuda
    try:
        yield
    finally:
        torch.Tensor.cuda = original


def transformer_config(cfg: ModelConfig, *, tp: int, pp: int, ep: int, etp: int, num_layers: int | None = None):
    """megatron-core's TransformerConfig for `cfg`. Optional ModelConfig fields are passed through
    as None so that megatron applies its own defaults (num_query_groups = heads, kv_channels =
    h / heads, moe_ffn_hidden_size = ffn_hidden_size), which is what ModelSpec assumes.

    sequence_parallel stays off: it changes no parameter count, and without Apex the local spec's
    torch LayerNorm/RMSNorm (WrappedTorchNorm) refuses it. (megatron-core only checks SP with MoE
    and TP > 1 in the forward pass, MoELayer.forward; Megatron-LM's argument parser requires it.)"""
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=num_layers or cfg.num_layers,
        hidden_size=cfg.hidden_size,
        ffn_hidden_size=cfg.ffn_hidden_size,
        num_attention_heads=cfg.num_attention_heads,
        num_query_groups=cfg.num_query_groups,
        kv_channels=cfg.kv_channels,
        add_bias_linear=cfg.add_bias_linear,
        gated_linear_unit=cfg.swiglu,
        activation_func=F.silu if cfg.swiglu else F.gelu,
        normalization=cfg.normalization,
        hidden_dropout=cfg.hidden_dropout,
        attention_dropout=cfg.attention_dropout,
        params_dtype=torch.bfloat16,
        pipeline_dtype=torch.bfloat16,
        bf16=True,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
        sequence_parallel=False,
        num_moe_experts=cfg.num_experts,
        moe_router_topk=cfg.moe_router_topk,
        moe_ffn_hidden_size=cfg.moe_ffn_hidden_size,
        moe_shared_expert_intermediate_size=cfg.moe_shared_expert_intermediate_size,
        moe_grouped_gemm=False,
        # Allocate with plain torch.empty (no device argument, so the meta device applies) and
        # skip the initialisation: only shapes are needed.
        use_cpu_initialization=True,
        perform_initialization=False,
    )


def build_meta_gpt(cfg: ModelConfig, *, tp: int, pp: int, ep: int, etp: int, num_layers: int | None = None):
    """This rank's GPTModel (local spec) on the meta device; call inside `as_rank`.

    The vocabulary is padded as Megatron-LM's training code does before it builds the model
    (megatron/training/tokenizer: multiple of make_vocab_size_divisible_by x TP; that function
    is not part of megatron-core), i.e. ModelSpec.padded_vocab(tp)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    config = transformer_config(cfg, tp=tp, pp=pp, ep=ep, etp=etp, num_layers=num_layers)
    spec = get_gpt_layer_local_spec(
        num_experts=cfg.num_experts, moe_grouped_gemm=False, normalization=cfg.normalization
    )
    with meta_cuda_is_identity(), torch.device("meta"):
        model = GPTModel(
            config=config,
            transformer_layer_spec=spec,
            vocab_size=ModelSpec(cfg).padded_vocab(tp),
            max_sequence_length=cfg.seq_length,
            pre_process=ps.is_pipeline_first_stage(),
            post_process=ps.is_pipeline_last_stage(),
            share_embeddings_and_output_weights=not cfg.untie_embeddings_and_output_weights,
            position_embedding_type=cfg.position_embedding_type,
        )
    return model, config


def is_expert_param(name: str) -> bool:
    """Routed-expert weights (mlp.experts.local_experts.*). Shared experts
    (mlp.shared_experts.*) are TP-split like a dense MLP and reduced over the DP group, so they
    count as dense, as in ModelSpec.layer_params."""
    return ".mlp.experts." in name


def count_params(model) -> tuple[int, int]:
    """(dense, expert) parameter counts of a model."""
    dense = expert = 0
    for name, p in model.named_parameters():
        if is_expert_param(name):
            expert += p.numel()
        else:
            dense += p.numel()
    return dense, expert


def data_parallel_width(tp: int, ep: int, etp: int) -> int:
    """The smallest DP width for which TP x DP ranks regroup as ETP x EP x expert-DP."""
    return math.lcm(tp, ep * etp) // tp
