"""The cost model: one configuration in, predicted step time, memory and breakdown out.

Every user of a cost — `evaluate`, the planners, the baselines, the reports — goes through the
functions here. `stage_parts`, `after_pipeline` and `memory.stage_memory` price one pipeline
rank from the sums of its layers (`tables.StageSums`); they work elementwise on arrays, which is
how the DP solver prices all candidate stages with the same formulas. The equations are written
down in nest_megatron/cost/README.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from nest_megatron.cost.a2a_overlap import dispatch_sm_share, unpaired_microbatches
from nest_megatron.cost.collectives import (
    Network,
    all_gather_time,
    all_reduce_time,
    p2p_time,
    reduce_scatter_time,
    worst,
)
from nest_megatron.cost.compute import BF16, ComputeModel
from nest_megatron.cost.flops import megatron_model_flops
from nest_megatron.cost.host import exposed_host_time, head_operators
from nest_megatron.cost.memory import StageMemory, memory_of_rank, memory_per_stage, mtp_memory
from nest_megatron.cost.offload import offload_waits
from nest_megatron.cost.placement import Spans, spans_for
from nest_megatron.cost.problem import Problem
from nest_megatron.cost.recompute import recompute_seconds
from nest_megatron.cost.routing import dispatch_copies
from nest_megatron.cost.tables import LayerCosts, StageSums, layer_costs, stage_sums
from nest_megatron.hardware.accelerator import GIB
from nest_megatron.model.spec import Gemm
from nest_megatron.parallel.config import ParallelConfig
from nest_megatron.parallel.rules import num_microbatches


def adam_step_bytes(state_bytes: float) -> float:
    """HBM bytes of the Adam step per parameter: read the fp32 gradient (4), read and write the
    optimizer state (master weight and moments, `state_bytes`), write the bf16 weight (2): 30 for
    Megatron's 12 B of state."""
    return 4 + 2 * state_bytes + BF16


DDP_BUCKET_PARAMS = 40_000_000  # Megatron DDP bucket size: max(4e7, 1e6 * dp) parameters
# HBM bytes per logit of Megatron's vocab-parallel cross entropy (tensor_parallel/cross_entropy.py) on
# bf16 logits cast to fp32. Forward: the cast (read 2, write 4), the max (read 4), subtracting it and
# exp in place (read 4 write 4, twice), the sum (read 4), the division (read 4, write 4) = 38;
# backward: the softmax made the gradient in place (read 4, write 4) and cast to bf16 (read 4,
# write 2) = 14.
CROSS_ENTROPY_BYTES_PER_LOGIT = 52
# The fused cross entropy (--cross-entropy-loss-fusion) reads the bf16 logits for the max and the sum
# and writes their bf16 gradient in place in the forward (2 + 2 + 2), which the backward scales (2 + 2).
FUSED_CROSS_ENTROPY_BYTES_PER_LOGIT = 10


def cross_entropy_bytes(model) -> int:
    fused = model.numerics.cross_entropy_fusion
    return FUSED_CROSS_ENTROPY_BYTES_PER_LOGIT if fused else CROSS_ENTROPY_BYTES_PER_LOGIT


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
    rank_to_device: np.ndarray | None = None  # None: rank r on device r
    host_memory: float = 0.0  # pinned host bytes a device's offloaded activations take (`pinned_host_bytes`)
    host_capacity: float | None = None  # host memory per device, bytes; None: not known

    @property
    def peak_memory(self) -> float:
        return float(max(m.total for m in self.memory))

    @property
    def fits(self) -> bool:
        return self.shortfall is None

    @property
    def shortfall(self) -> str | None:
        """What does not fit, in one phrase ("99.1 GiB of 79.6 GiB device memory"); None when everything does."""
        if self.peak_memory > self.capacity:
            return f"{self.peak_memory / GIB:.1f} GiB of {self.capacity / GIB:.1f} GiB device memory"
        if over_host_memory(self.host_memory, self.host_capacity):
            return (f"{self.host_memory / GIB:.1f} GiB of pinned host memory for the offloaded activations, of "
                    f"{(self.host_capacity or 0.0) / GIB:.1f} GiB a device")
        return None


@dataclass(frozen=True)
class Context:
    """What pricing a stage needs besides its layers: one configuration on one placement."""

    problem: Problem
    cfg: ParallelConfig
    spans: Spans
    net: Network
    compute: ComputeModel
    costs: LayerCosts
    num_microbatches: int
    rank_to_device: np.ndarray | None = None

    @property
    def pipeline_factor(self) -> float:
        """Step time = pipeline_factor x slowest stage + the slowest after-pipeline part."""
        return pipeline_factor(self.problem, self.cfg, self.num_microbatches)

    @property
    def a2a_paired_share(self) -> float:
        """Of the slowest stage's pipeline_factor times per micro-batch, the share a paired forward and backward
        saves its layers' a2a_saving in (cost/a2a_overlap.py): the micro-batches not in the warm-up, over the
        factor. Charging every time the share keeps step = factor x stage time."""
        m = self.num_microbatches
        return (m - unpaired_microbatches(self.cfg.pp, self.cfg.vpp, m)) / self.pipeline_factor


def pipeline_factor(problem: Problem, cfg: ParallelConfig, num_microbatches: int) -> float:
    """The slowest stage's times per micro-batch in a step: every micro-batch, and each pipeline schedule's fill and
    drain, (pp - 1) / vpp of them (the interleaved schedule's bubble; 1F1B's at vpp 1)."""
    return num_microbatches + problem.pipeline_runs * (cfg.pp - 1) / cfg.vpp


def groups_and_network(problem: Problem, cfg: ParallelConfig, rank_to_device: np.ndarray | None) -> tuple[Spans, Network]:
    """Where `cfg`'s groups sit on the topology, and the network as this plan's devices share it."""
    spans = spans_for(cfg, problem.topology, rank_to_device)
    return spans, Network.for_topology(problem.topology, busy_fraction=cfg.world / problem.num_devices)


def context(problem: Problem, cfg: ParallelConfig, *, rank_to_device: np.ndarray | None = None,
            compute: ComputeModel | None = None) -> Context:
    compute = compute or problem.compute_model
    spans, net = groups_and_network(problem, cfg, rank_to_device)
    costs = layer_costs(problem.model, cfg, spans=spans, net=net, compute=compute, **layer_options(problem, cfg),
                        delay_wgrad=problem.delay_wgrad_compute,
                        dispatch_sm_share=dispatch_sm_share(problem.accelerator.sm_count),
                        host_overhead_s=problem.accelerator.host_overhead_s, cuda_graphs=problem.cuda_graphs)
    return Context(problem, cfg, spans, net, compute, costs, num_microbatches(cfg, problem.global_batch_size),
                   rank_to_device)


def layer_options(problem: Problem, cfg: ParallelConfig) -> dict:
    """What the problem says of how a layer runs, as `layer.layer_time`'s keywords: the same for `evaluate` and
    the search's bounds."""
    copies = (dispatch_copies(problem.model, cfg.ep, dispatcher=problem.moe_dispatcher, router=problem.moe_router)
              if problem.model.is_moe else None)
    return {"tp_comm_overlap": problem.tp_comm_overlap, "ep_copies": copies, "dispatcher": problem.moe_dispatcher,
            "router": problem.moe_router, "permute_fusion": problem.moe_permute_fusion}


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
    """Score `cfg` (which must satisfy parallel.rules). `layers_per_stage` is pp entries (layers per
    pipeline rank, split evenly over its virtual chunks) or pp*vpp (layers per model chunk, in Megatron's
    order: cost.tables.chunk_split) and defaults to the even split; `rank_to_device` to the identity map;
    `compute` to the accelerator's roofline."""
    ctx = context(problem, cfg, rank_to_device=rank_to_device, compute=compute)
    return estimate_in(ctx, tuple(layers_per_stage or uniform_split(problem.model.cfg.num_layers, cfg.pp)))


def estimate_in(ctx: Context, split: tuple[int, ...]) -> Estimate:
    """The Estimate of `ctx`'s configuration with the layers split as `split` (pp or pp*vpp entries), which
    it carries."""
    problem, cfg = ctx.problem, ctx.cfg
    model, acc = problem.model, problem.accelerator
    sums = [stage_sums(ctx.costs, cfg, tuple(split), i) for i in range(cfg.pp)]
    parts_per_stage = [stage_parts(ctx, s, stage=i) for i, s in enumerate(sums)]
    stage_times = [float(sum(parts.values())) for parts in parts_per_stage]
    slowest = int(np.argmax(stage_times))
    finish = [after_pipeline(ctx, s, first=i == 0, last=i == cfg.pp - 1) for i, s in enumerate(sums)]
    last = int(np.argmax([sum(f.values()) for f in finish]))
    step = ctx.pipeline_factor * stage_times[slowest] + float(sum(finish[last].values()))

    m = ctx.num_microbatches
    breakdown = {k: float(m * v) for k, v in parts_per_stage[slowest].items()}
    breakdown["pipeline_bubble"] = (ctx.pipeline_factor - m) * stage_times[slowest]
    breakdown.update({k: float(v) for k, v in finish[last].items()})

    memory = _memory_in(ctx, sums)
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
        levels=ctx.spans.levels_used(moe=model.is_moe),
        idle_devices=problem.num_devices - cfg.world,
        stage_times=tuple(stage_times),
        rank_to_device=ctx.rank_to_device,
        host_memory=pinned_host_bytes(ctx),
        host_capacity=acc.host_memory_bytes,
    )


def pinned_host_bytes(ctx: Context) -> float:
    """Pinned host memory one device's offloaded activations take: those of the first cpu_offloading_num_layers
    layers of one micro-batch (megatron-core offloads at pp 1, where a micro-batch's backward ends before the next
    forward, and the caching host allocator hands the freed buffers to the next micro-batch)."""
    n = ctx.cfg.cpu_offloading_num_layers
    return float(ctx.costs.act_pinned[n] - ctx.costs.act_pinned[0])


def over_host_memory(pinned: float, capacity: float | None) -> bool:
    """Whether a device's pinned bytes of offloaded activations exceed its host memory (None: unknown, none)."""
    return pinned > (capacity or 0.0)


def fits_in(ctx: Context, split: tuple[int, ...]) -> bool:
    """Whether every stage of `split` fits: the memory half of `estimate_in`, which no placement
    changes. Stops at the first stage that does not (the first stage, most often: it holds the most
    micro-batches in flight)."""
    problem, cfg = ctx.problem, ctx.cfg
    for stage in range(cfg.pp):
        memory = memory_of_rank(problem.model, cfg, stage_sums(ctx.costs, cfg, tuple(split), stage), stage=stage,
                                num_microbatches=ctx.num_microbatches,
                                reserved_bytes=problem.accelerator.reserved_memory_bytes, act_rebuilt=ctx.costs.act_rebuilt)
        if memory.total > problem.accelerator.memory_bytes:
            return False
    return not over_host_memory(pinned_host_bytes(ctx), problem.accelerator.host_memory_bytes)


def _memory_in(ctx: Context, sums: list[StageSums]) -> tuple:
    return memory_per_stage(ctx.problem.model, ctx.cfg, sums, num_microbatches=ctx.num_microbatches,
                            reserved_bytes=ctx.problem.accelerator.reserved_memory_bytes, act_rebuilt=ctx.costs.act_rebuilt)


def stage_parts(ctx: Context, sums: StageSums, *, stage: int) -> dict:
    """Seconds one micro-batch spends on pipeline rank `stage`, by kind (all its chunks)."""
    parts = stage_body(ctx, sums, first=stage == 0, last=stage == ctx.cfg.pp - 1)
    parts["pp_p2p"] = pipeline_p2p(ctx, stage=stage, sums=sums)
    return parts


def pipeline_p2p(ctx: Context, *, stage: int, sums: StageSums | None = None) -> float:
    """Exposed point-to-point time of one micro-batch on `stage`: its activation forward and its
    gradient backward, each at the network level of that boundary (see `pipeline_sends`)."""
    return sum(pipeline_sends(ctx, stage=stage, sums=sums))


def pipeline_sends(ctx: Context, *, stage: int, sums: StageSums | None = None) -> tuple:
    """(exposed send of the activation to the next stage, of the gradient to the previous one) of one
    micro-batch on `stage`, over all its chunks; the schedule timeline draws them apart.

    1F1B waits for each transfer. The interleaved schedule sends every chunk boundary, the wrap from
    the last rank to the first included, and overlaps each send with the next chunk's computation
    (Megatron's --overlap-p2p-communication, on by default with virtual stages): only what a chunk's
    forward (backward) cannot cover is exposed, and at least the latency. Without `sums` (a bound
    before the layers are known) the latency alone."""
    model, cfg, spans, net = ctx.problem.model, ctx.cfg, ctx.spans, ctx.net
    if cfg.pp == 1:
        return 0.0, 0.0
    tokens = cfg.mbs * model.cfg.seq_length // cfg.cp
    boundary = BF16 * tokens * model.h / (cfg.tp if cfg.sp else 1)
    levels = spans.pp_boundary_level
    if cfg.vpp > 1:
        level = max(levels)
        send, latency = p2p_time(level, boundary, net), net.latency[level]
        if sums is None:
            return (cfg.vpp * latency,) * 2
        return tuple(cfg.vpp * np.maximum(latency, send - work / cfg.vpp) for work in (sums.fwd, sums.bwd))
    forward = p2p_time(levels[stage], boundary, net) if stage < cfg.pp - 1 else 0.0
    backward = p2p_time(levels[stage - 1], boundary, net) if stage > 0 else 0.0
    return forward, backward


def stage_body(ctx: Context, sums: StageSums, *, first: bool, last: bool) -> dict:
    """Seconds one micro-batch spends on a rank's layers (with the embedding if `first`, the
    output layer and the multi-token-prediction depths if `last`), everything but the pipeline transfers."""
    model, cfg, spans, net = ctx.problem.model, ctx.cfg, ctx.spans, ctx.net
    tokens = cfg.mbs * model.cfg.seq_length // cfg.cp
    compute_s, recompute, tp_comm, cp_comm, ep_comm = sums.compute, sums.recompute, sums.tp_comm, sums.cp_comm, sums.ep_comm
    if cfg.moe_a2a_overlap:  # the EP communication paired passes hide (a2a_overlap.py)
        ep_comm = ep_comm - ctx.a2a_paired_share * sums.a2a_saving
    gpu_fwd, gpu_bwd = sums.fwd, sums.bwd + sums.recompute  # the GPU work of the host's spans (host.py)
    host_fwd, host_bwd = _layer_operators(ctx, sums)
    heads = 1 + model.mtp_depths  # the output layer runs once more per multi-token-prediction depth
    if last:
        # Output layer: logits GEMM forward and its two backward GEMMs (bf16: Megatron keeps the
        # output layer out of fp8), and the cross entropy (with the forward's span).
        logits = Gemm("output", tokens, model.padded_vocab(cfg.tp) // cfg.tp, model.h)
        bf16 = ctx.compute.with_bf16_gemms()
        head_fwd = heads * (bf16.gemm_time(logits) + ctx.compute.memory_time(cross_entropy_bytes(model) * tokens * logits.n))
        head_bwd = heads * (bf16.gemm_time(logits.dgrad) + bf16.gemm_time(logits.wgrad))
        compute_s = compute_s + head_fwd + head_bwd
        gpu_fwd, gpu_bwd = gpu_fwd + head_fwd, gpu_bwd + head_bwd
        times, depths = ctx.costs.mtp, ctx.costs.mtp_depths
        if depths:  # each depth its layers (LayerCosts.mtp), recomputed as memory.mtp_memory says
            compute_s = compute_s + depths * sum(lt.fwd_compute + lt.bwd_compute for lt in times)
            mtp_recompute = 0.0
            if cfg.recompute == "selective":
                mtp_recompute = depths * sum(recompute_seconds(lt, model, kind, cfg.recompute_modules)
                                             for kind, lt in zip(model.mtp_depth_kinds, times))
            elif cfg.recompute == "full" and cfg.recompute_num_layers is None:
                mtp_recompute = depths * sum(lt.fwd for lt in times)
            recompute = recompute + mtp_recompute
            tp_comm = tp_comm + depths * sum(lt.tp_comm for lt in times)
            cp_comm = cp_comm + depths * sum(lt.cp_comm for lt in times)
            ep_comm = ep_comm + depths * sum(lt.ep_comm for lt in times)
            gpu_fwd = gpu_fwd + depths * sum(lt.fwd for lt in times)
            gpu_bwd = gpu_bwd + depths * sum(lt.bwd for lt in times) + mtp_recompute
            graphed = ctx.problem.cuda_graphs
            host_fwd = host_fwd + depths * (len(times) if graphed else ctx.costs.mtp_host[0])
            host_bwd = host_bwd + depths * (len(times) if graphed else ctx.costs.mtp_host[1])
    head_tp = 0.0
    if cfg.tp > 1 and (first or last):
        # The vocab-parallel embedding all-reduces (reduce-scatters with SP) its output, the
        # output layer all-gathers its input with SP; each has its mirror in backward.
        op = reduce_scatter_time if cfg.sp else all_reduce_time
        head_tp = 2 * worst(op, spans.tp, BF16 * tokens * model.h, net) * (first + heads * last)
    head_ops = head_operators(model, cfg, first=first, last=last)
    seconds = ctx.problem.accelerator.host_overhead_s
    # 1F1B without virtual stages synchronises the device after each pipeline transfer; each MoE layer's forward is a
    # span of its own, priced in the tables (host.py)
    host = sums.sync_wait + exposed_host_time(
        seconds * (host_fwd - sums.sync_host_fwd + head_ops[0]),
        seconds * (host_bwd - sums.sync_host_bwd + head_ops[1]),
        gpu_fwd - sums.sync_gpu_fwd + head_tp / 2, gpu_bwd - sums.sync_gpu_bwd + head_tp / 2,
        synchronised=cfg.pp > 1 and cfg.vpp == 1)
    return {
        "compute": compute_s,
        "recompute": recompute,
        "tp_comm": tp_comm + head_tp,
        "cp_comm": cp_comm,
        "ep_comm": ep_comm,
        "zero_comm": _sharded_dp_per_microbatch(ctx, sums, first=first, last=last),
        "host": host,
        "offload": sum(offload_parts(ctx)),
    }


def offload_parts(ctx: Context) -> tuple[float, float]:
    """(forward, backward) seconds a micro-batch waits for its activations' copies to and from host memory
    (cost/offload.py); none without --cpu-offloading-num-layers."""
    n = ctx.cfg.cpu_offloading_num_layers
    if not n:
        return 0.0, 0.0
    return offload_waits(ctx.costs, n, ctx.problem.accelerator.host_link_bandwidth)


def _layer_operators(ctx: Context, sums: StageSums) -> tuple:
    """(forward, backward) operators the host issues for a rank's layers and one micro-batch (host.py): every
    layer's (and a full recompute's forward again), or with CUDA graphs one graph replay per layer and pass."""
    if ctx.problem.cuda_graphs:
        return sums.layers, sums.layers
    return sums.host_fwd, sums.host_bwd + sums.host_recompute


def _stage_params(ctx: Context, sums: StageSums, *, first: bool, last: bool):
    model, cfg = ctx.problem.model, ctx.cfg
    dense = sums.dense_params
    if first:
        dense = dense + model.embedding_params(cfg.tp)
    expert = sums.expert_params
    if last:
        dense = dense + model.output_params(tp=cfg.tp, pp=cfg.pp)
        if model.mtp_depths:
            mtp_dense, mtp_expert, _ = mtp_memory(model, cfg)
            dense, expert = dense + mtp_dense, expert + mtp_expert
    return dense, expert


def _sharded_dp_traffic(ctx: Context, sums: StageSums, *, first: bool, last: bool):
    """(reduce-scatter of the gradients, all-gather of the weights) of a rank's parameters over
    their data-parallel groups within one optimizer instance, s."""
    spans, net, grad = ctx.spans, ctx.net, ctx.problem.model.numerics.grad_bytes
    dense, expert = _stage_params(ctx, sums, first=first, last=last)
    scatter = (worst(reduce_scatter_time, spans.dp_instance, grad * dense, net)
               + worst(reduce_scatter_time, spans.edp_instance, grad * expert, net))
    gather = (worst(all_gather_time, spans.dp_instance, BF16 * dense, net)
              + worst(all_gather_time, spans.edp_instance, BF16 * expert, net))
    return scatter, gather


def _across_instances(ctx: Context, dense, expert):
    """The all-reduce of each gradient shard over the optimizer instances (--num-distributed-optimizer-instances;
    0 with one), once a step, s."""
    cfg, spans, net, grad = ctx.cfg, ctx.spans, ctx.net, ctx.problem.model.numerics.grad_bytes
    if cfg.distributed_optimizer_instances == 1:
        return 0.0
    return (worst(all_reduce_time, spans.dp_across, grad * dense / cfg.dense_shards, net)
            + worst(all_reduce_time, spans.edp_across, grad * expert / cfg.expert_shards, net))


def _sharded_dp_per_microbatch(ctx: Context, sums: StageSums, *, first: bool, last: bool):
    """Exposed Megatron-FSDP traffic of every micro-batch. ZeRO-2 reduce-scatters each layer's
    gradients as its backward ends, behind the backward of the layers before it; ZeRO-3 also
    all-gathers each layer's weights a layer ahead, behind the forward, and again behind the
    backward. What a pass cannot hide is exposed; the step's first gather and last reduce-scatter
    are in `after_pipeline` (the others overlap the neighbouring micro-batch)."""
    cfg = ctx.cfg
    if cfg.zero < 2:
        return 0.0
    scatter, gather = _sharded_dp_traffic(ctx, sums, first=first, last=last)
    if cfg.zero == 2:
        return np.maximum(0.0, scatter - sums.bwd)
    return np.maximum(0.0, gather - sums.fwd) + np.maximum(0.0, gather + scatter - sums.bwd)


def after_pipeline(ctx: Context, sums: StageSums, *, first: bool, last: bool) -> dict:
    """Exposed data-parallel synchronisation and the optimizer step of a rank (with the embedding
    if `first`, the output layer if `last`), in seconds.

    With --overlap-grad-reduce the gradient reduction of the last micro-batch's buckets overlaps
    with that micro-batch's backward pass, except the last bucket; with --overlap-param-gather the
    distributed optimizer's weight all-gather overlaps with the next forward, except the first
    bucket. Overlap never makes the step slower than no overlap.
    """
    problem, cfg, spans, net = ctx.problem, ctx.cfg, ctx.spans, ctx.net
    model = problem.model
    dense, expert = _stage_params(ctx, sums, first=first, last=last)
    grad_bytes = model.numerics.grad_bytes
    grad = param = 0.0
    if cfg.zero == 0:
        grad = worst(all_reduce_time, spans.dp, grad_bytes * dense, net) + worst(all_reduce_time, spans.edp, grad_bytes * expert, net)
    elif cfg.zero == 1:
        grad = (worst(reduce_scatter_time, spans.dp_instance, grad_bytes * dense, net)
                + worst(reduce_scatter_time, spans.edp_instance, grad_bytes * expert, net))
    if cfg.zero in (1, 2):
        param = (worst(all_gather_time, spans.dp_instance, BF16 * dense, net)
                 + worst(all_gather_time, spans.edp_instance, BF16 * expert, net))
    grad = grad + _across_instances(ctx, dense, expert)
    # The last bucket is only ready when the backward ends, the first is needed when the
    # forward starts: at least its share stays exposed; the rest hides behind the pass.
    bucket = np.minimum(1.0, max(DDP_BUCKET_PARAMS, 1_000_000 * cfg.dp) / np.maximum(dense + expert, 1.0))
    if problem.overlap_grad_reduce:
        grad = np.maximum(grad - sums.bwd, bucket * grad)
    if problem.overlap_param_gather:
        param = np.maximum(param - sums.fwd, bucket * param)
    if cfg.zero >= 2:
        # Megatron-FSDP: the last layer's reduce-scatter follows the step's last backward, and
        # ZeRO-3's first layer's all-gather precedes its first forward.
        scatter, gather = _sharded_dp_traffic(ctx, sums, first=first, last=last)
        layers = np.maximum(sums.layers, 1)
        grad = grad + scatter / layers
        if cfg.zero == 3:
            param = param + gather / layers
    tied = 0.0
    if model.has_shared_embedding(cfg.pp) and (first or last):
        # The first and last stages all-reduce the gradient of the shared word embedding.
        words = grad_bytes * model.padded_vocab(cfg.tp) * model.h / cfg.tp
        tied = p2p_time(max(spans.pp_boundary_level), words, net)
    replicated = 0.0
    if cfg.sp and cfg.tp > 1 and (model.cfg.multi_latent_attention or model.cfg.moe_latent_size):
        # Weights duplicated over TP (MLA's down projections, a latent MoE's projections) see each rank's own tokens
        # under sequence parallel: Megatron all-reduces their gradients over TP after the backward (exposed).
        mtp = model.mtp_physical_depths * sum(model.tp_replicated_params(kind, cfg.tp) for kind in model.mtp_depth_kinds)
        params = sums.tp_replicated_params + (mtp if last else 0)
        replicated = worst(all_reduce_time, spans.tp, grad_bytes * params, net)
    shards = cfg.dense_shards if cfg.zero >= 1 else 1
    expert_shards = cfg.expert_shards if cfg.zero >= 1 else 1
    optimizer = ctx.compute.memory_time(adam_step_bytes(problem.model.numerics.optimizer_state_bytes) * (dense / shards + expert / expert_shards))
    return {"dp_grad_sync": grad + tied + replicated, "dp_param_gather": param, "optimizer": optimizer}
