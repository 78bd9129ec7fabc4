"""Memory of one device of one pipeline stage.

Model states per parameter, with bf16 training and fp32 gradient accumulation (Megatron turns on
--accumulate-allreduce-grads-in-fp32 for bf16) and Adam with fp32 master weights:

  zero 0  DDP                                  2 + 4 + 12         = 18 B
  zero 1  --use-distributed-optimizer          2 + 4 + 12/D       (Megatron's 6 + 12/d)
  zero 2  Megatron-FSDP optim_grads            2 + (4 + 12)/D
  zero 3  Megatron-FSDP optim_grads_params     (2 + 4 + 12)/D, plus the gathered bf16 weights of
                                               the layer being computed and the one prefetched

D is the width of the group the state is sharded over: dp x cp for dense parameters, the
expert-data-parallel width for expert parameters.

Activations: the k-th stage from the end keeps k micro-batches in flight under 1F1B; with v
virtual stages, rank i keeps min(m v, 2 (p - i - 1) + (v - 1) p + 1) chunks of L/(p v) layers
(Megatron's interleaved warm-up count plus the one in progress).
"""

from __future__ import annotations

from dataclasses import dataclass

from nest_megatron.cost.activations import layer_activation_bytes, logits_bytes
from nest_megatron.cost.compute import BF16
from nest_megatron.model.spec import ModelSpec
from nest_megatron.parallel.config import ParallelConfig

GRAD_FP32, ADAM_FP32 = 4, 12  # main gradient; master weight + two moments


@dataclass(frozen=True)
class StageMemory:
    weights: float
    grads: float
    optimizer: float
    activations: float
    logits: float
    workspace: float

    @property
    def total(self) -> float:
        return self.weights + self.grads + self.optimizer + self.activations + self.logits + self.workspace

    def as_dict(self) -> dict[str, float]:
        return {
            "weights": self.weights,
            "grads": self.grads,
            "optimizer": self.optimizer,
            "activations": self.activations,
            "logits": self.logits,
            "workspace": self.workspace,
        }


def model_state_bytes(params: float, *, zero: int, shards: int) -> tuple[float, float, float]:
    """(weights, grads, optimizer) bytes on one device for `params` parameters."""
    weights = BF16 * params / (shards if zero == 3 else 1)
    grads = GRAD_FP32 * params / (shards if zero >= 2 else 1)
    optimizer = ADAM_FP32 * params / (shards if zero >= 1 else 1)
    return weights, grads, optimizer


def in_flight_chunks(cfg: ParallelConfig, *, stage: int, num_microbatches: int) -> int:
    """Micro-batch chunks whose activations a pipeline rank holds at its peak."""
    p, v = cfg.pp, cfg.vpp
    if v == 1:
        return min(p - stage, num_microbatches)
    return min(num_microbatches * v, 2 * (p - stage - 1) + (v - 1) * p + 1)


def recomputed_layers(cfg: ParallelConfig, layers_per_chunk: int) -> int:
    """Layers of each chunk that full recompute rebuilds (the first n: Megatron's block method)."""
    if cfg.recompute != "full":
        return 0
    return layers_per_chunk if cfg.recompute_num_layers is None else cfg.recompute_num_layers


def stage_activation_bytes(
    model: ModelSpec, cfg: ParallelConfig, *, stage: int, layers: int, num_microbatches: int, moe: bool
) -> float:
    """Activations of `layers` transformer layers on `stage`, all micro-batches in flight."""
    per_layer = layer_activation_bytes(model, mbs=cfg.mbs, tp=cfg.tp, sp=cfg.sp, cp=cfg.cp, moe=moe, etp=cfg.etp)
    per_chunk_layers = layers // cfg.vpp
    recomputed = recomputed_layers(cfg, per_chunk_layers)
    kept = per_layer["selective" if cfg.recompute == "selective" else "none"]
    per_chunk = recomputed * per_layer["full"] + (per_chunk_layers - recomputed) * kept
    chunks = in_flight_chunks(cfg, stage=stage, num_microbatches=num_microbatches)
    # Backward of a recomputed layer rebuilds its full activations, one layer at a time.
    working = per_layer["none"] if recomputed else 0.0
    return chunks * per_chunk + working


def stage_memory(
    model: ModelSpec,
    cfg: ParallelConfig,
    *,
    stage: int,
    layers: int,
    num_microbatches: int,
    reserved_bytes: float,
) -> StageMemory:
    """Memory of one device of `stage`, which holds `layers` transformer layers."""
    first, last = stage == 0, stage == cfg.pp - 1
    dense, expert = model.layer_params(tp=cfg.tp, ep=cfg.ep, etp=cfg.etp)
    dense *= layers
    expert *= layers
    if first:
        dense += model.embedding_params(cfg.tp)
    if last:
        dense += model.output_params(tp=cfg.tp, pp=cfg.pp)
    dp_shards = cfg.dp * cfg.cp
    w, g, o = model_state_bytes(dense, zero=cfg.zero, shards=dp_shards)
    ew, eg, eo = model_state_bytes(expert, zero=cfg.zero, shards=cfg.expert_dp)
    weights, grads, optimizer = w + ew, g + eg, o + eo
    if cfg.zero == 3:
        layer_dense, layer_expert = model.layer_params(tp=cfg.tp, ep=cfg.ep, etp=cfg.etp)
        weights += 2 * BF16 * (layer_dense + layer_expert)  # gathered layer + prefetched layer
    activations = stage_activation_bytes(
        model, cfg, stage=stage, layers=layers, num_microbatches=num_microbatches, moe=model.is_moe
    )
    logits = logits_bytes(model, mbs=cfg.mbs, tp=cfg.tp, cp=cfg.cp) if last else 0.0
    return StageMemory(weights, grads, optimizer, activations, logits, reserved_bytes)
