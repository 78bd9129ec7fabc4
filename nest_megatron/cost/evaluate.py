"""The cost model: one configuration in, predicted step time, memory and breakdown out.

Every user of a cost — `evaluate`, the planners, the baselines, the reports — calls `estimate`.
The equations are written down in nest_megatron/cost/README.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from nest_megatron.cost.collectives import Network, all_gather_time, all_reduce_time, p2p_time, reduce_scatter_time
from nest_megatron.cost.compute import BF16, ComputeModel, RooflineCompute
from nest_megatron.cost.flops import megatron_model_flops
from nest_megatron.cost.layer import LayerTime, layer_time, worst
from nest_megatron.cost.memory import GRAD_FP32, StageMemory, recomputed_layers, stage_memory
from nest_megatron.cost.placement import Spans, spans_for
from nest_megatron.cost.problem import Problem
from nest_megatron.model.spec import Gemm
from nest_megatron.parallel.config import ParallelConfig
from nest_megatron.parallel.rules import num_microbatches

ADAM_STEP_BYTES = 30  # per parameter: read grad 4, r/w master 8, r/w m 8, r/w v 8, write bf16 2
DDP_BUCKET_PARAMS = 40_000_000  # Megatron DDP bucket size: max(4e7, 1e6 * dp) parameters


@dataclass(frozen=True)
class Estimate:
    config: ParallelConfig
    layers_per_stage: tuple[int, ...]
    num_microbatches: int
    step_time: float  # s
    tokens_per_s: float
    tflops_per_gpu: float  # Megatron's model FLOPs / step time / GPUs, 1e12 FLOP/s
    mfu: float
    memory: tuple[StageMemory, ...]  # per pipeline rank, bytes
    capacity: float  # device memory, bytes
    breakdown: dict[str, float]  # seconds; adds up to step_time
    levels: dict[str, int]  # highest network level each group kind crosses
    idle_devices: int
    stage_times: tuple[float, ...] = field(default=())  # per micro-batch, s

    @property
    def peak_memory(self) -> float:
        return max(m.total for m in self.memory)

    @property
    def fits(self) -> bool:
        return self.peak_memory <= self.capacity


def uniform_split(num_layers: int, pp: int) -> tuple[int, ...]:
    return (num_layers // pp,) * pp


def estimate(
    problem: Problem,
    cfg: ParallelConfig,
    *,
    layers_per_stage: tuple[int, ...] | None = None,
    rank_to_device: np.ndarray | None = None,
    compute: ComputeModel | None = None,
) -> Estimate:
    """Score `cfg` (which must satisfy parallel.rules). `layers_per_stage` defaults to the even
    split; `rank_to_device` to the identity map; `compute` to the accelerator's roofline."""
    model, acc = problem.model, problem.accelerator
    compute = compute or RooflineCompute(acc)
    split = layers_per_stage or uniform_split(model.cfg.num_layers, cfg.pp)
    m = num_microbatches(cfg, problem.global_batch_size)
    spans = spans_for(cfg, problem.topology, rank_to_device)
    net = Network.for_topology(problem.topology, busy_fraction=cfg.world / problem.num_devices)
    lt = layer_time(model, cfg=cfg, moe=model.is_moe, spans=spans, net=net, compute=compute)

    stage_parts = [
        _stage_parts(problem, cfg, stage=i, layers=n, lt=lt, spans=spans, net=net, compute=compute)
        for i, n in enumerate(split)
    ]
    stage_times = [sum(parts.values()) for parts in stage_parts]
    slowest = int(np.argmax(stage_times))
    bubble_factor = (cfg.pp - 1) / cfg.vpp
    pipeline = (m + bubble_factor) * stage_times[slowest]

    finish = [_after_pipeline(problem, cfg, stage=i, layers=n, lt=lt, spans=spans, net=net, compute=compute) for i, n in enumerate(split)]
    last = int(np.argmax([sum(f.values()) for f in finish]))
    step = pipeline + sum(finish[last].values())

    breakdown = {k: m * v for k, v in stage_parts[slowest].items()}
    breakdown["pipeline_bubble"] = bubble_factor * stage_times[slowest]
    breakdown.update(finish[last])

    memory = tuple(
        stage_memory(model, cfg, stage=i, layers=n, num_microbatches=m, reserved_bytes=acc.reserved_memory_bytes)
        for i, n in enumerate(split)
    )
    tokens = problem.global_batch_size * model.cfg.seq_length
    tflops = megatron_model_flops(model, batch_size=problem.global_batch_size, tp=cfg.tp) / step / cfg.world / 1e12
    return Estimate(
        config=cfg,
        layers_per_stage=tuple(split),
        num_microbatches=m,
        step_time=step,
        tokens_per_s=tokens / step,
        tflops_per_gpu=tflops,
        mfu=tflops * 1e12 / acc.peak_flops,
        memory=memory,
        capacity=acc.memory_bytes,
        breakdown=breakdown,
        levels=spans.levels_used(moe=model.is_moe),
        idle_devices=problem.num_devices - cfg.world,
        stage_times=tuple(stage_times),
    )


def _stage_parts(
    problem: Problem, cfg: ParallelConfig, *, stage: int, layers: int, lt: LayerTime, spans: Spans, net: Network, compute: ComputeModel
) -> dict[str, float]:
    """Seconds one micro-batch spends on `stage`, by kind (all v chunks of a rank together)."""
    model = problem.model
    first, last = stage == 0, stage == cfg.pp - 1
    tokens = cfg.mbs * model.cfg.seq_length // cfg.cp
    compute_s = layers * (lt.fwd_compute + lt.bwd_compute)
    recompute = recomputed_layers(cfg, layers // cfg.vpp) * cfg.vpp * lt.fwd
    if cfg.recompute == "selective":
        recompute = layers * lt.core_attention_fwd
    activation = BF16 * tokens * model.h
    head_tp = 0.0
    if last:
        # Output layer: logits GEMM forward and its two backward GEMMs, and the cross entropy.
        logits = Gemm("output", tokens, model.padded_vocab(cfg.tp) // cfg.tp, model.h)
        compute_s += 3 * compute.gemm_time(logits) + compute.memory_time(3 * 6 * tokens * logits.n)
    if cfg.tp > 1 and (first or last):
        # The vocab-parallel embedding all-reduces (reduce-scatters with SP) its output, the
        # output layer all-gathers its input with SP; each has its mirror in backward.
        op = reduce_scatter_time if cfg.sp else all_reduce_time
        head_tp = 2 * worst(op, spans.tp, activation, net) * (first + last)
    p2p = 0.0
    if cfg.pp > 1:
        boundary = BF16 * tokens * model.h / (cfg.tp if cfg.sp else 1)
        levels = spans.pp_boundary_level
        if cfg.vpp > 1:
            # Every chunk boundary is crossed, including the wrap from the last rank to the first.
            p2p = 2 * cfg.vpp * p2p_time(max(levels), boundary, net)
        else:
            if not last:
                p2p += p2p_time(levels[stage], boundary, net)
            if not first:
                p2p += p2p_time(levels[stage - 1], boundary, net)
    zero = _sharded_dp_per_microbatch(problem, cfg, stage=stage, layers=layers, spans=spans, net=net)
    zero = max(0.0, zero - compute_s) if zero else 0.0
    return {
        "compute": compute_s,
        "recompute": recompute,
        "tp_comm": layers * lt.tp_comm + head_tp,
        "cp_comm": layers * lt.cp_comm,
        "ep_comm": layers * lt.ep_comm,
        "pp_p2p": p2p,
        "zero_comm": zero,
    }


def _stage_params(problem: Problem, cfg: ParallelConfig, *, stage: int, layers: int) -> tuple[float, float]:
    model = problem.model
    dense, expert = model.layer_params(tp=cfg.tp, ep=cfg.ep, etp=cfg.etp)
    dense, expert = dense * layers, expert * layers
    if stage == 0:
        dense += model.embedding_params(cfg.tp)
    if stage == cfg.pp - 1:
        dense += model.output_params(tp=cfg.tp, pp=cfg.pp)
    return dense, expert


def _sharded_dp_per_microbatch(problem: Problem, cfg: ParallelConfig, *, stage: int, layers: int, spans: Spans, net: Network) -> float:
    """Megatron-FSDP traffic of every micro-batch: ZeRO-2 reduce-scatters the gradients after each
    backward; ZeRO-3 also all-gathers the weights for the forward and again for the backward."""
    if cfg.zero < 2:
        return 0.0
    dense, expert = _stage_params(problem, cfg, stage=stage, layers=layers)
    t = worst(reduce_scatter_time, spans.dp, GRAD_FP32 * dense, net) + worst(reduce_scatter_time, spans.edp, GRAD_FP32 * expert, net)
    if cfg.zero == 3:
        t += 2 * (worst(all_gather_time, spans.dp, BF16 * dense, net) + worst(all_gather_time, spans.edp, BF16 * expert, net))
    return t


def _after_pipeline(
    problem: Problem, cfg: ParallelConfig, *, stage: int, layers: int, lt: LayerTime, spans: Spans, net: Network, compute: ComputeModel
) -> dict[str, float]:
    """Exposed data-parallel synchronisation and the optimizer step of one stage, in seconds.

    With --overlap-grad-reduce the gradient reduction of the last micro-batch's buckets overlaps
    with that micro-batch's backward pass, except the last bucket; with --overlap-param-gather the
    distributed optimizer's weight all-gather overlaps with the next forward, except the first
    bucket. Overlap never makes the step slower than no overlap.
    """
    model = problem.model
    dense, expert = _stage_params(problem, cfg, stage=stage, layers=layers)
    grad = param = 0.0
    if cfg.zero == 0:
        grad = worst(all_reduce_time, spans.dp, GRAD_FP32 * dense, net) + worst(all_reduce_time, spans.edp, GRAD_FP32 * expert, net)
    elif cfg.zero == 1:
        grad = worst(reduce_scatter_time, spans.dp, GRAD_FP32 * dense, net) + worst(reduce_scatter_time, spans.edp, GRAD_FP32 * expert, net)
    if cfg.zero in (1, 2):
        param = worst(all_gather_time, spans.dp, BF16 * dense, net) + worst(all_gather_time, spans.edp, BF16 * expert, net)
    # The last bucket is only ready when the backward ends, the first is needed when the
    # forward starts: at least its share stays exposed; the rest hides behind the pass.
    bucket = min(1.0, max(DDP_BUCKET_PARAMS, 1_000_000 * cfg.dp) / max(dense + expert, 1.0))
    if problem.overlap_grad_reduce:
        grad = max(grad - layers * lt.bwd, bucket * grad)
    if problem.overlap_param_gather:
        param = max(param - layers * lt.fwd, bucket * param)
    tied = 0.0
    if cfg.pp > 1 and not model.cfg.untie_embeddings_and_output_weights and stage in (0, cfg.pp - 1):
        # The first and last stages all-reduce the gradient of the shared word embedding.
        words = GRAD_FP32 * model.padded_vocab(cfg.tp) * model.h / cfg.tp
        tied = p2p_time(max(spans.pp_boundary_level), words, net)
    shards = cfg.dp * cfg.cp if cfg.zero >= 1 else 1
    expert_shards = cfg.expert_dp if cfg.zero >= 1 else 1
    optimizer = compute.memory_time(ADAM_STEP_BYTES * (dense / shards + expert / expert_shards))
    return {"dp_grad_sync": grad + tied, "dp_param_gather": param, "optimizer": optimizer}
