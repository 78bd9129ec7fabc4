"""Time of one transformer layer for one micro-batch on one device, split the way the schedule
and the recompute options need it.

Forward: the layer's GEMMs, attention and memory-bound ops. Backward: for every GEMM an
input-gradient and a weight-gradient GEMM of the same size, twice the attention FLOPs, and twice
the memory-bound bytes. Communication inside the layer (TP, CP, EP) is not overlapped with
compute in Megatron's default settings, except CP's K/V ring, which hides behind attention.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from nest_megatron.cost.collectives import (
    Network,
    all_gather_time,
    all_reduce_time,
    all_to_all_time,
    p2p_time,
    reduce_scatter_time,
    worst,
)
from nest_megatron.cost.compute import BF16, ComputeModel
from nest_megatron.cost.placement import Spans
from nest_megatron.model.spec import ModelSpec
from nest_megatron.parallel.config import ParallelConfig


@dataclass(frozen=True)
class LayerTime:
    fwd_compute: float
    bwd_compute: float
    core_attention_fwd: float  # what selective recompute runs again
    fwd_comm: float  # exposed TP + CP + EP communication of the forward pass
    bwd_comm: float
    tp_comm: float  # forward + backward, for the breakdown
    cp_comm: float
    ep_comm: float

    @property
    def fwd(self) -> float:
        return self.fwd_compute + self.fwd_comm

    @property
    def bwd(self) -> float:
        return self.bwd_compute + self.bwd_comm


def elementwise_bytes(model: ModelSpec, *, tokens: int, cfg: ParallelConfig, moe: bool) -> float:
    """HBM bytes read + written by the memory-bound ops of one layer's forward pass.

    Two norms, two residual adds, RoPE on q and k, the activation function, dropouts where p > 0,
    and the softmax when attention is not fused.
    """
    m = model.cfg
    h, t = model.h, cfg.tp
    tokens_sp = tokens / t if cfg.sp else tokens
    nbytes = 2 * (2 * h * tokens_sp)  # norms: read and write
    nbytes += 2 * (3 * h * tokens_sp)  # residual adds: two reads, one write
    if m.position_embedding_type == "rope":
        nbytes += 2 * tokens * (model.q_size + model.kv_size) / t
    rows, f, width = (model.routed_rows(tokens=tokens, tp=t, etp=cfg.etp), model.moe_ffn, cfg.etp) if moe else (tokens, m.ffn_hidden_size, t)
    nbytes += rows * f / width * (model.fc1_factor + 1)  # read FC1's output, write FC2's input
    if m.hidden_dropout > 0:
        nbytes += 2 * (2 * h * tokens_sp)
    if m.attention_backend != "flash":
        nbytes += 2 * (model.heads / t) * tokens * m.seq_length * (2 if m.attention_dropout > 0 else 1)
    return BF16 * nbytes


def layer_time(
    model: ModelSpec, *, cfg: ParallelConfig, moe: bool, spans: Spans, net: Network, compute: ComputeModel
) -> LayerTime:
    """One layer's times; configurations that differ only in what a layer does not see (ZeRO,
    recompute, pipeline depth, ...) share one computation."""
    return _layer_time(model, cfg.tp, cfg.sp, cfg.cp, cfg.ep, cfg.etp, cfg.mbs, moe, spans.tp, spans.cp, spans.ep, net, compute)


@lru_cache(maxsize=65536)
def _layer_time(model, tp, sp, cp, ep, etp, mbs, moe, tp_shapes, cp_shapes, ep_shapes, net, compute) -> LayerTime:
    cfg = ParallelConfig(tp=tp, sp=sp, cp=cp, ep=ep, etp=etp, mbs=mbs)
    tokens = cfg.mbs * model.cfg.seq_length // cfg.cp
    gemms = model.layer_gemms(tokens=tokens, tp=cfg.tp, etp=cfg.etp, moe=moe)
    gemm = sum(compute.gemm_time(g) for g in gemms)
    attention_flops = model.attention_flops(micro_batch=cfg.mbs, tp=cfg.tp, cp=cfg.cp)
    attention = compute.attention_time(attention_flops)
    memory = compute.memory_time(elementwise_bytes(model, tokens=tokens, cfg=cfg, moe=moe))

    # TP: two collectives on the [tokens, h] activation per pass (after attention and after the
    # MLP): all-reduces, or with sequence parallel an all-gather before and a reduce-scatter after
    # each block. The MoE block's tokens are exchanged by EP instead when etp is 1.
    activation = BF16 * tokens * model.h
    tp_blocks = 2 if not moe else 1 + (cfg.etp > 1)
    if cfg.tp == 1:
        tp_pass = 0.0
    elif cfg.sp:
        tp_pass = tp_blocks * (worst(all_gather_time, tp_shapes, activation, net) + worst(reduce_scatter_time, tp_shapes, activation, net))
    else:
        tp_pass = tp_blocks * worst(all_reduce_time, tp_shapes, activation, net)

    # CP: a ring of cp - 1 steps, each passing one K/V chunk to the next rank; backward passes
    # K/V and their gradients. It overlaps with the attention computation.
    cp_fwd = cp_bwd = 0.0
    if cfg.cp > 1:
        kv_chunk = 2 * BF16 * tokens * model.kv_size / cfg.tp
        ring_level = max(shape.top_level for shape in cp_shapes)
        step = p2p_time(ring_level, kv_chunk, net)
        cp_fwd = max(0.0, (cfg.cp - 1) * step - attention)
        cp_bwd = max(0.0, 2 * (cfg.cp - 1) * step - 2 * attention)

    # EP: dispatch and combine all-to-alls of the routed copies of this rank's tokens.
    ep_pass = 0.0
    if moe and cfg.ep > 1:
        tokens_sp = tokens / cfg.tp if cfg.sp else tokens
        routed = BF16 * tokens_sp * model.cfg.moe_router_topk * model.h
        ep_pass = 2 * worst(all_to_all_time, ep_shapes, routed, net)

    return LayerTime(
        fwd_compute=gemm + attention + memory,
        bwd_compute=2 * (gemm + attention + memory),
        core_attention_fwd=attention,
        fwd_comm=tp_pass + cp_fwd + ep_pass,
        bwd_comm=tp_pass + cp_bwd + ep_pass,
        tp_comm=2 * tp_pass,
        cp_comm=cp_fwd + cp_bwd,
        ep_comm=2 * ep_pass,
    )
