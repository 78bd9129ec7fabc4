"""Helpers for the megatron-core tests: shipped model configs, parameter counts, and the
single-process state. Posing as a rank (fake process group), building a GPTModel on the meta
device and the ModelConfig -> TransformerConfig converter live in nest_megatron/trace/ and are
re-exported here.

Imported only after ``pytest.importorskip("megatron.core")``.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch.distributed as dist
from megatron.core import parallel_state as ps
from omegaconf import OmegaConf

from nest_megatron.config.schema import ModelConfig
from nest_megatron.trace.meta import as_rank, build_meta_gpt, teardown_distributed  # noqa: F401 (re-exported)
from nest_megatron.trace.record import is_expert_param

MODEL_CONFIGS = Path(__file__).resolve().parents[1] / "nest_megatron" / "hydra_configs" / "model"


def load_model_config(name: str, **overrides) -> ModelConfig:
    """A shipped model YAML merged onto the ModelConfig schema (as config/load.py does)."""
    merged = OmegaConf.merge(OmegaConf.structured(ModelConfig), OmegaConf.load(MODEL_CONFIGS / f"{name}.yaml"))
    merged = OmegaConf.merge(merged, overrides)
    return OmegaConf.to_object(merged)


def ensure_single_process() -> None:
    """The state nest_megatron.trace.cpu_megatron.prepare_cpu_megatron sets up (a one-rank gloo
    group, TP = PP = 1), re-created if a fake-rank test tore it down: prepare_cpu_megatron runs its
    set-up once per process only."""
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(1, 1)


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
