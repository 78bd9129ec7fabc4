"""Per-layer costs of one configuration, and their sums over the layers of a pipeline stage.

Everything about a configuration except its layer split is computed once per layer kind
(model/kinds.py: dense and MoE MLPs mixed, ...) and laid out per layer. A stage is then a set of layers, and its costs are sums (and
one max) over them. `range_sums` takes a contiguous range [a, b) whose end `b` may be a numpy
array, so that the DP solver prices every candidate stage from one call with the same formulas
`estimate` uses.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import NamedTuple

import numpy as np

from nest_megatron.cost.a2a_overlap import pair_saving
from nest_megatron.cost.activations import layer_activation_bytes
from nest_megatron.cost.collectives import Network
from nest_megatron.cost.compute import ComputeModel
from nest_megatron.cost.host import layer_operators, synchronised_span, synchronises
from nest_megatron.cost.layer import LayerTime, layer_time
from nest_megatron.cost.placement import Spans
from nest_megatron.cost.recompute import recompute_seconds
from nest_megatron.model.kinds import LayerKind
from nest_megatron.model.spec import ModelSpec
from nest_megatron.parallel.config import ParallelConfig
from nest_megatron.parallel.layout import as_chunks

NO_TIME = LayerTime(0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)


def _prefix(values: np.ndarray) -> np.ndarray:
    out = np.zeros(len(values) + 1)
    np.cumsum(values, out=out[1:])
    return out


@dataclass(frozen=True, eq=False)  # hashed by identity: stage_sums memoises per LayerCosts object
class LayerCosts:
    """Prefix sums over layers (entry l = sum over layers < l) of per-micro-batch costs."""

    compute: np.ndarray  # forward + backward computation, s
    fwd: np.ndarray  # forward with its communication: what full recompute runs again, s
    bwd: np.ndarray  # backward with its communication, s
    selective: np.ndarray  # what selective recompute of the configuration's modules runs again, s, s
    tp_comm: np.ndarray
    cp_comm: np.ndarray
    ep_comm: np.ndarray
    act_kept: np.ndarray  # bytes kept per micro-batch when the layer is not fully recomputed
    act_checkpoint: np.ndarray  # bytes kept when it is (its input)
    act_pinned: np.ndarray  # pinned host bytes per micro-batch when the layer is offloaded (activations "pinned")
    dense_params: np.ndarray
    expert_params: np.ndarray
    # of dense_params, linear weights duplicated over TP (MLA's down projections, latent MoE projections); None: none
    tp_replicated_params: np.ndarray | None
    # operators the host issues for a layer's forward and backward (host.layer_operators)
    host_fwd: np.ndarray
    host_bwd: np.ndarray
    # A MoE layer's own host span (host.synchronises: unless padded to capacity): the device's wait in it, and its
    # operators and device time, forward and (paired with it under --overlap-moe-expert-parallel-comm) backward;
    # zeros for other layers
    sync_wait: np.ndarray
    sync_host_fwd: np.ndarray
    sync_gpu_fwd: np.ndarray
    sync_host_bwd: np.ndarray
    sync_gpu_bwd: np.ndarray
    # what a layer saves per micro-batch when its forward is paired with another's backward under
    # --overlap-moe-expert-parallel-comm (a2a_overlap.pair_saving; zeros without the flag)
    a2a_saving: np.ndarray
    act_rebuilt: float  # the most bytes one fully recomputed layer rebuilds during its backward
    # The multi-token-prediction depths, all on the last pipeline stage: the times of one depth's layers
    # (model.mtp_depth_kinds; none without them, or for a memory-only table); `mtp_memory` has their parameters
    # and activations.
    mtp: tuple[LayerTime, ...] = ()
    mtp_depths: int = 0
    mtp_host: tuple[float, float] = (0.0, 0.0)  # one depth's host operators, forward and backward

    @property
    def num_layers(self) -> int:
        return len(self.compute) - 1


def layer_costs(
    model: ModelSpec, cfg: ParallelConfig, *, spans: Spans | None, net: Network | None, compute: ComputeModel | None,
    tp_comm_overlap: bool = False, ep_copies: float | None = None, dispatcher: str = "alltoall",
    router: str = "learned", permute_fusion: bool = False, delay_wgrad: bool = False,
    dispatch_sm_share: float = 0.0, host_overhead_s: float = 0.0, cuda_graphs: bool = False,
) -> LayerCosts:
    """Per-layer costs, computed once per layer kind (model.kinds) and laid out per layer (model.layer_kinds);
    with spans=None only the memory columns (times are left at zero). `ep_copies`, `dispatcher`, `router`,
    `permute_fusion`: layer.layer_time's; `delay_wgrad`: --delay-wgrad-compute with cfg's EP all-to-all overlap,
    `dispatch_sm_share` the SMs its all-to-alls hold (a2a_overlap.py); `host_overhead_s` the host's time per
    operator and `cuda_graphs` one operator a layer pass (host.py), for a MoE layer's own span."""
    options = dict(spans=spans, net=net, compute=compute, tp_comm_overlap=tp_comm_overlap, ep_copies=ep_copies,
                   dispatcher=dispatcher, router=router, permute_fusion=permute_fusion)
    per_kind = [_kind_costs(model, cfg, kind, **options) for kind in model.kinds]
    kind_of_layer = model.kind_index

    def column(get) -> np.ndarray:
        by_kind = np.array([get(*costs) for costs in per_kind], dtype=float)
        return _prefix(by_kind[kind_of_layer])

    reruns = np.array([recompute_seconds(costs[0], model, kind, cfg.selective_modules)
                       for kind, costs in zip(model.kinds, per_kind)], dtype=float)

    kept = "selective" if cfg.recompute == "selective" else "none"
    operators = np.array([layer_operators(model, cfg, kind, dispatcher=dispatcher, permute_fusion=permute_fusion)
                          for kind in model.kinds], dtype=float)
    sync_columns = _sync_spans(model, cfg, per_kind, np.ones_like(operators) if cuda_graphs else operators,
                               host_overhead_s, dispatcher=dispatcher)
    mtp_operators = [layer_operators(model, cfg, kind, dispatcher=dispatcher, permute_fusion=permute_fusion)
                     for kind in model.mtp_depth_kinds]
    return LayerCosts(
        compute=column(lambda lt, act, p, r: lt.fwd_compute + lt.bwd_compute),
        fwd=column(lambda lt, act, p, r: lt.fwd),
        bwd=column(lambda lt, act, p, r: lt.bwd),
        selective=_prefix(reruns[kind_of_layer]),
        tp_comm=column(lambda lt, act, p, r: lt.tp_comm),
        cp_comm=column(lambda lt, act, p, r: lt.cp_comm),
        ep_comm=column(lambda lt, act, p, r: lt.ep_comm),
        act_kept=column(lambda lt, act, p, r: act[kept]),
        act_checkpoint=column(lambda lt, act, p, r: act["full"]),
        act_pinned=column(lambda lt, act, p, r: act["pinned"]),
        dense_params=column(lambda lt, act, p, r: p[0]),
        expert_params=column(lambda lt, act, p, r: p[1]),
        tp_replicated_params=column(lambda lt, act, p, r: r) if any(r for *_, r in per_kind) else None,
        act_rebuilt=max(act["none"] for _, act, _, _ in per_kind),
        host_fwd=_prefix(operators[kind_of_layer, 0]),
        host_bwd=_prefix(operators[kind_of_layer, 1]),
        **{name: _prefix(values[kind_of_layer]) for name, values in sync_columns.items()},
        a2a_saving=column(lambda lt, act, p, r: pair_saving(lt, delay_wgrad=delay_wgrad, sm_share=dispatch_sm_share)
                          if cfg.moe_a2a_overlap else 0.0),
        mtp=tuple(_kind_costs(model, cfg, kind, **options)[0] for kind in model.mtp_depth_kinds),
        mtp_depths=model.mtp_depths,
        mtp_host=(sum(f for f, _ in mtp_operators), sum(b for _, b in mtp_operators)),
    )


def _sync_spans(model: ModelSpec, cfg: ParallelConfig, per_kind, operators: np.ndarray,
                host_overhead_s: float, *, dispatcher: str) -> dict[str, np.ndarray]:
    """Per layer kind, LayerCosts' sync_* columns: a synchronising layer's forward (and under the EP all-to-all
    overlap the backward issued beside it) as a span of its own, host.synchronised_span's wait in it."""
    paired = cfg.moe_a2a_overlap
    sync = np.array([synchronises(kind, model, dispatcher=dispatcher) for kind in model.kinds], dtype=float)
    gpu_fwd = np.array([costs[0].fwd for costs in per_kind]) * sync
    gpu_bwd = np.array([costs[0].bwd for costs in per_kind]) * sync * paired
    host_fwd, host_bwd = operators[:, 0] * sync, operators[:, 1] * sync * paired
    wait = synchronised_span(host_overhead_s * (host_fwd + host_bwd), gpu_fwd + gpu_bwd, host_overhead_s) * sync
    return {"sync_wait": wait, "sync_host_fwd": host_fwd, "sync_gpu_fwd": gpu_fwd, "sync_host_bwd": host_bwd,
            "sync_gpu_bwd": gpu_bwd}


def _kind_costs(model: ModelSpec, cfg: ParallelConfig, kind: LayerKind, *, spans, **options):
    """(LayerTime, activation bytes by recompute setting, (dense, expert) parameters, TP-replicated parameters)
    of one layer of `kind`."""
    lt = layer_time(model, cfg=cfg, kind=kind, spans=spans, **options) if spans else NO_TIME
    act = layer_activation_bytes(model, mbs=cfg.mbs, tp=cfg.tp, sp=cfg.sp, cp=cfg.cp, kind=kind, etp=cfg.etp,
                                 modules=cfg.recompute_modules)
    params = model.layer_params(tp=cfg.tp, ep=cfg.ep, etp=cfg.etp, kind=kind)
    replicated = model.tp_replicated_params(kind, cfg.tp) if cfg.sp else 0
    return lt, act, params, replicated


class StageSums(NamedTuple):
    """The layers of one pipeline rank (all its virtual chunks), summed. Fields are numbers, or
    arrays when the DP prices many candidate stages at once."""

    layers: object
    compute: object
    recompute: object  # extra forward work per micro-batch for recomputation, s
    fwd: object
    bwd: object
    tp_comm: object
    cp_comm: object
    ep_comm: object
    act_per_chunk: object  # bytes one micro-batch leaves on one chunk (the largest chunk)
    recomputes: object  # whether any layer is fully recomputed (then one layer is rebuilt at a time)
    dense_params: object
    expert_params: object
    tp_replicated_params: object  # of dense_params, the weights duplicated over TP (LayerCosts.tp_replicated_params)
    # operators the host issues per micro-batch (LayerCosts.host_fwd, .host_bwd), and those a full recompute issues
    # again (a selective one reruns a few kernels per layer: left out)
    host_fwd: object = 0.0
    host_bwd: object = 0.0
    host_recompute: object = 0.0
    a2a_saving: object = 0.0  # LayerCosts.a2a_saving
    # The MoE layers' own host spans (LayerCosts.sync_*), a full recompute's forwards again (in the backward)
    sync_wait: object = 0.0
    sync_host_fwd: object = 0.0
    sync_gpu_fwd: object = 0.0
    sync_host_bwd: object = 0.0
    sync_gpu_bwd: object = 0.0


def range_sums(c: LayerCosts, cfg: ParallelConfig, a, b) -> StageSums:
    """Sums over the contiguous layers [a, b) of a stage without virtual chunks; `a` and `b` may
    be index arrays that broadcast (every candidate stage of the DP at once).

    Full recompute rebuilds the first n layers of the stage (Megatron's block method, n =
    recompute_num_layers) or all of them (uniform method with one layer per group). Activation offloading
    keeps the first cpu_offloading_num_layers layers' activations in host memory (Transformer Engine's
    offload of layers 0 .. n - 1: cost/offload.py), not on the device.
    """
    if cfg.recompute == "full":
        n = cfg.recompute_num_layers
        r_end = b + 0 * a if n is None else np.minimum(a + n, b)
    else:
        r_end = a + 0 * b
    recompute = c.fwd[r_end] - c.fwd[a]
    if cfg.recompute == "selective":
        recompute = c.selective[b] - c.selective[a]
    o_end = np.minimum(a + cfg.cpu_offloading_num_layers, b)  # offloading runs without recompute (a rule)
    offloaded = c.act_kept[o_end] - c.act_kept[a]
    act = (c.act_checkpoint[r_end] - c.act_checkpoint[a]) + (c.act_kept[b] - c.act_kept[r_end]) - offloaded
    return StageSums(
        layers=b - a,
        compute=c.compute[b] - c.compute[a],
        recompute=recompute,
        fwd=c.fwd[b] - c.fwd[a],
        bwd=c.bwd[b] - c.bwd[a],
        tp_comm=c.tp_comm[b] - c.tp_comm[a],
        cp_comm=c.cp_comm[b] - c.cp_comm[a],
        ep_comm=c.ep_comm[b] - c.ep_comm[a],
        act_per_chunk=act,
        recomputes=r_end > a,
        dense_params=c.dense_params[b] - c.dense_params[a],
        expert_params=c.expert_params[b] - c.expert_params[a],
        tp_replicated_params=(np.zeros(np.broadcast(a, b).shape) if c.tp_replicated_params is None
                              else c.tp_replicated_params[b] - c.tp_replicated_params[a]),
        host_fwd=c.host_fwd[b] - c.host_fwd[a],
        host_bwd=c.host_bwd[b] - c.host_bwd[a],
        host_recompute=c.host_fwd[r_end] - c.host_fwd[a],  # r_end = a unless fully recomputed
        a2a_saving=c.a2a_saving[b] - c.a2a_saving[a],
        sync_wait=c.sync_wait[b] - c.sync_wait[a] + c.sync_wait[r_end] - c.sync_wait[a],
        sync_host_fwd=c.sync_host_fwd[b] - c.sync_host_fwd[a],
        sync_gpu_fwd=c.sync_gpu_fwd[b] - c.sync_gpu_fwd[a],
        sync_host_bwd=c.sync_host_bwd[b] - c.sync_host_bwd[a] + c.sync_host_fwd[r_end] - c.sync_host_fwd[a],
        sync_gpu_bwd=c.sync_gpu_bwd[b] - c.sync_gpu_bwd[a] + c.sync_gpu_fwd[r_end] - c.sync_gpu_fwd[a],
    )


def chunk_split(cfg: ParallelConfig, layers_per_stage: tuple[int, ...]) -> tuple[int, ...]:
    """The layers of each of the pp*vpp model chunks, in Megatron's virtual-stage order (chunk c = k*pp + rank
    holds the c-th slice of layers): `layers_per_stage` as it is when it has pp*vpp entries, else its pp ranks'
    layers split over their chunks (parallel.layout.as_chunks)."""
    return as_chunks(tuple(layers_per_stage), pp=cfg.pp, vpp=cfg.vpp)


def chunk_bounds(cfg: ParallelConfig, chunks) -> tuple[np.ndarray, np.ndarray]:
    """(starts, ends) of every rank's chunks: arrays [..., rank, k] of the layer range of rank `rank`'s k-th chunk
    (chunk k*pp + rank), for `chunks` of shape [..., pp*vpp] (one split, or many candidate splits at once)."""
    chunks = np.asarray(chunks, dtype=np.int64)
    bounds = np.concatenate((np.zeros((*chunks.shape[:-1], 1), dtype=np.int64), np.cumsum(chunks, axis=-1)), axis=-1)
    shape = (*chunks.shape[:-1], cfg.vpp, cfg.pp)
    starts = bounds[..., :-1].reshape(shape).swapaxes(-1, -2)
    ends = bounds[..., 1:].reshape(shape).swapaxes(-1, -2)
    return starts, ends


def chunk_sums(c: LayerCosts, cfg: ParallelConfig, starts, ends) -> StageSums:
    """Sums over the chunks [starts[..., k], ends[..., k]) along the last axis (the chunks of one pipeline rank):
    their layers, work and parameters added up in chunk order, the activations of the largest chunk, and whether
    any recomputes. One function for `estimate` (one rank) and the search (every rank of many splits at once)."""
    parts = range_sums(c, cfg, np.asarray(starts), np.asarray(ends))

    def added(values):
        total = values[..., 0]
        for k in range(1, values.shape[-1]):
            total = total + values[..., k]
        return total

    fields = {name: added(value) for name, value in parts._asdict().items() if name not in ("act_per_chunk", "recomputes")}
    return StageSums(**fields, act_per_chunk=np.max(parts.act_per_chunk, axis=-1), recomputes=np.any(parts.recomputes, axis=-1))


def stage_sums(c: LayerCosts, cfg: ParallelConfig, layers_per_stage: tuple[int, ...], stage: int) -> StageSums:
    """Sums over every chunk of pipeline rank `stage`; the activations of its largest chunk.
    Memoised: the configurations that differ in ZeRO stage share their LayerCosts and their sums."""
    return _stage_sums(c, cfg.pp, cfg.vpp, cfg.recompute, cfg.recompute_num_layers, cfg.cpu_offloading_num_layers,
                       tuple(layers_per_stage), stage)


@lru_cache(maxsize=65536)
def _stage_sums(c: LayerCosts, pp: int, vpp: int, recompute: str, recompute_num_layers: int | None, offloaded: int,
                layers_per_stage: tuple[int, ...], stage: int) -> StageSums:
    cfg = ParallelConfig(pp=pp, vpp=vpp, recompute=recompute, recompute_num_layers=recompute_num_layers,
                         cpu_offloading_num_layers=offloaded)
    starts, ends = chunk_bounds(cfg, chunk_split(cfg, layers_per_stage))
    return chunk_sums(c, cfg, starts[stage], ends[stage])
