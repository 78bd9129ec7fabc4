"""Memory of one device of one pipeline stage.

Model states per parameter, with bf16 training and fp32 gradient accumulation (Megatron turns on
--accumulate-allreduce-grads-in-fp32 for bf16; --grad-reduce-in-bf16 halves the gradient's 4 B to 2)
and Adam with fp32 master weights:

  zero 0  DDP                                  2 + 4 + 12         = 18 B
  zero 1  --use-distributed-optimizer          2 + 4 + 12/D       (Megatron's 6 + 12/d)
  zero 2  Megatron-FSDP optim_grads            2 + (4 + 12)/D
  zero 3  Megatron-FSDP optim_grads_params     (2 + 4 + 12)/D, plus the gathered bf16 weights of
                                               the layer being computed and the one prefetched

The optimizer's 12 B (fp32 master weight and moments, Megatron's distributed optimizer) is the
model's `numerics.optimizer_state_bytes`, which the precision-aware optimizer lowers (model/spec.py:
its fp32 master kept as the 16 low bits beside the bf16 weight, moments in the dtypes given).

D is the width of the group the state is sharded over: dp x cp for dense parameters, the
expert-data-parallel width for expert parameters, each divided by --num-distributed-optimizer-instances
(ParallelConfig.dense_shards, expert_shards). With fp8 GEMMs each local layer's linears also
keep fp8 copies of their weight for the step (cost/fp8.py: 2 B per parameter on Hopper, its rowwise copy and the
transpose; 1 B on Blackwell with a per-tensor recipe; 2 + 2/32 B with MXFP8).

Activations: the k-th stage from the end keeps k micro-batches in flight under 1F1B; with v
virtual stages, rank i keeps min(m v, 2 (p - i - 1) + (v - 1) p + 1) chunks of L/(p v) layers
(Megatron's interleaved warm-up count plus the one in progress); --overlap-moe-expert-parallel-comm
warms up one chunk more (schedules.py:773-779 at megatron-core 0.16.1) and, without pipelining, runs one
micro-batch's forward before the last one's backward (combined_1f1b.py): one chunk more in flight. Unfused
attention adds one score buffer per rank (activations.attention_buffer_bytes).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from nest_megatron.cost import fp8
from nest_megatron.cost.activations import attention_buffer_bytes, layer_activation_bytes, logits_bytes
from nest_megatron.cost.compute import BF16
from nest_megatron.cost.tables import StageSums
from nest_megatron.model.spec import ModelSpec
from nest_megatron.parallel.config import ParallelConfig

GRAD_FP32, ADAM_FP32 = 4, 12  # main gradient; master weight + two moments (Megatron's optimizers)


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
            "weights": float(self.weights),
            "grads": float(self.grads),
            "optimizer": float(self.optimizer),
            "activations": float(self.activations),
            "logits": float(self.logits),
            "workspace": float(self.workspace),
        }


def model_state_bytes(params: float, *, zero: int, shards: int, grad_bytes: int = GRAD_FP32,
                      optimizer_bytes: float = ADAM_FP32) -> tuple[float, float, float]:
    """(weights, grads, optimizer) bytes on one device for `params` parameters; main gradients of
    `grad_bytes` each (2 with --grad-reduce-in-bf16), `optimizer_bytes` of optimizer state each."""
    weights = BF16 * params / (shards if zero == 3 else 1)
    grads = grad_bytes * params / (shards if zero >= 2 else 1)
    optimizer = optimizer_bytes * params / (shards if zero >= 1 else 1)
    return weights, grads, optimizer


def in_flight_chunks(cfg: ParallelConfig, *, stage: int, num_microbatches: int) -> int:
    """Micro-batch chunks whose activations a pipeline rank holds at its peak: the schedule's warm-up forwards and
    the first steady one (with the EP all-to-all overlap, --overlap-moe-expert-parallel-comm, one more). The
    interleaved warm-up is 2 (p - stage - 1) + (v - 1) x the micro-batch group (schedules.py:963-965 at d98e8a6)."""
    p, v, a2a_overlap = cfg.pp, cfg.vpp, int(cfg.moe_a2a_overlap)
    if v == 1:
        return min(p - stage + a2a_overlap, num_microbatches)
    return min(num_microbatches * v, 2 * (p - stage - 1) + (v - 1) * cfg.microbatch_group + 1 + a2a_overlap)


def activation_bytes(sums: StageSums, *, in_flight: int, act_rebuilt: float):
    """Activations of a pipeline rank holding `in_flight` micro-batch chunks of `sums`' layers;
    the backward of a fully recomputed layer rebuilds its activations, one layer at a time."""
    act = in_flight * sums.act_per_chunk + np.where(sums.recomputes, act_rebuilt, 0.0)
    return float(act) if np.ndim(act) == 0 else act


def largest_layer_params(model: ModelSpec, cfg: ParallelConfig) -> int:
    """Parameters of the largest layer on one device (layers of several kinds: dense and MoE MLPs, a
    multi-token-prediction depth)."""
    kinds = model.kinds + model.mtp_depth_kinds
    return max(sum(model.layer_params(tp=cfg.tp, ep=cfg.ep, etp=cfg.etp, kind=kind)) for kind in kinds)


def mtp_memory(model: ModelSpec, cfg: ParallelConfig) -> tuple[float, float, float]:
    """(dense parameters, expert parameters, activation bytes of one micro-batch) the multi-token-prediction
    depths add to the last pipeline stage: each depth's layers (model.mtp_depth_kinds; their parameters once with
    a repeated layer, model.mtp_physical_depths) and the embedding they need there (ModelSpec.mtp_embedding_params).
    A depth keeps its activations as a layer does under the recompute setting, except that Megatron checkpoints it
    only with the uniform method and skips the block method (multi_token_prediction.py
    MultiTokenPredictionLayer._checkpointed_forward)."""
    return _mtp_memory(model, cfg.tp, cfg.pp, cfg.ep, cfg.etp, cfg.sp, cfg.cp, cfg.mbs, cfg.recompute,
                       cfg.recompute_num_layers, cfg.recompute_modules)


@lru_cache(maxsize=4096)
def _mtp_memory(model, tp, pp, ep, etp, sp, cp, mbs, recompute, recompute_num_layers,
                recompute_modules) -> tuple[float, float, float]:
    kinds = model.mtp_depth_kinds
    if not kinds:
        return 0.0, 0.0, 0.0
    params = [model.layer_params(tp=tp, ep=ep, etp=etp, kind=kind) for kind in kinds]
    kept = {"none": "none", "selective": "selective", "full": "full" if recompute_num_layers is None else "none"}[recompute]
    act = sum(layer_activation_bytes(model, mbs=mbs, tp=tp, sp=sp, cp=cp, kind=kind, etp=etp,
                                     modules=recompute_modules)[kept] for kind in kinds)
    built = model.mtp_physical_depths
    return (built * sum(p[0] for p in params) + model.mtp_embedding_params(tp=tp, pp=pp),
            built * sum(p[1] for p in params), model.mtp_depths * act)


def stage_memory(
    model: ModelSpec,
    cfg: ParallelConfig,
    sums: StageSums,
    *,
    first: bool,
    last: bool,
    in_flight: int,
    reserved_bytes: float,
    act_rebuilt: float
) -> StageMemory:
    """Memory of one device of a pipeline rank whose layers `sums` adds up (with the embedding if
    `first`, the output layer if `last`), holding `in_flight` chunks (`in_flight_chunks`); every
    field is an array when `sums` holds arrays (the DP solver's candidate stages), and `first`, `last`,
    `in_flight` may be arrays over ranks. The last stage also holds the multi-token-prediction depths
    (`mtp_memory`)."""
    mtp_dense, mtp_expert, mtp_act = mtp_memory(model, cfg) if model.mtp_depths else (0.0, 0.0, 0.0)
    dense = sums.dense_params + model.embedding_params(cfg.tp) * first
    dense = dense + (model.output_params(tp=cfg.tp, pp=cfg.pp) + mtp_dense) * last
    expert = sums.expert_params + mtp_expert * last
    grad_bytes = model.numerics.grad_bytes
    optimizer_bytes = model.numerics.optimizer_state_bytes
    w, g, o = model_state_bytes(dense, zero=cfg.zero, shards=cfg.dense_shards, grad_bytes=grad_bytes,
                                optimizer_bytes=optimizer_bytes)
    ew, eg, eo = model_state_bytes(expert, zero=cfg.zero, shards=cfg.expert_shards, grad_bytes=grad_bytes,
                                   optimizer_bytes=optimizer_bytes)
    weights, grads, optimizer = w + ew, g + eg, o + eo
    # ZeRO-3 gathers the weights of the layer being computed and of the one prefetched.
    gathered = 2 * largest_layer_params(model, cfg) if cfg.zero == 3 else 0
    weights = weights + BF16 * gathered
    numerics = model.numerics
    if numerics.fp8_recipe is not None:
        # Transformer Engine caches each linear's fp8 weight copies for the step (cast in the first micro-batch;
        # cost/fp8.py weight_copy_bytes): of every local layer, or of the gathered ones under ZeRO-3.
        mtp_linears = (mtp_dense + mtp_expert - model.mtp_embedding_params(tp=cfg.tp, pp=cfg.pp)) * last if mtp_dense else 0
        local = gathered if cfg.zero == 3 else sums.dense_params + sums.expert_params + mtp_linears
        weights = weights + fp8.weight_copy_bytes(numerics.fp8_recipe, any_layout=numerics.fp8_any_layout) * local
    # The multi-token-prediction depths' activations once: they are the last chunk's, whose micro-batches run
    # their backward right after their forward (1F1B on the last stage holds one).
    activations = (activation_bytes(sums, in_flight=in_flight, act_rebuilt=act_rebuilt) + mtp_act * last
                   + attention_buffer_bytes(model, mbs=cfg.mbs, tp=cfg.tp))
    logits = logits_bytes(model, mbs=cfg.mbs, tp=cfg.tp, cp=cfg.cp) * last
    return StageMemory(weights, grads, optimizer, activations, logits, reserved_bytes)


def memory_per_stage(
    model: ModelSpec,
    cfg: ParallelConfig,
    sums: list[StageSums],
    *,
    num_microbatches: int,
    reserved_bytes: float,
    act_rebuilt: float,
) -> tuple[StageMemory, ...]:
    """Memory of every pipeline rank, whose layers `sums[i]` adds up, under 1F1B or interleaving."""
    return tuple(
        memory_of_rank(model, cfg, s, stage=i, num_microbatches=num_microbatches, reserved_bytes=reserved_bytes,
                       act_rebuilt=act_rebuilt)
        for i, s in enumerate(sums)
    )


def memory_of_rank(model: ModelSpec, cfg: ParallelConfig, sums: StageSums, *, stage: int, num_microbatches: int,
                   reserved_bytes: float, act_rebuilt: float) -> StageMemory:
    """Memory of pipeline rank `stage`, whose layers `sums` adds up, under 1F1B or interleaving."""
    return stage_memory(model, cfg, sums, first=stage == 0, last=stage == cfg.pp - 1,
                        in_flight=in_flight_chunks(cfg, stage=stage, num_microbatches=num_microbatches),
                        reserved_bytes=reserved_bytes, act_rebuilt=act_rebuilt)
