"""Time of one transformer layer for one micro-batch on one device, split the way the schedule
and the recompute options need it.

Forward: the layer's GEMMs, attention and memory-bound ops. Backward: for every GEMM its
input-gradient and weight-gradient GEMMs (`Gemm.dgrad`, `Gemm.wgrad`), flash attention's backward
(2.5 x the forward FLOPs, compute.ATTENTION_BACKWARD_FACTOR) and twice the memory-bound bytes.
With fp8 GEMMs every GEMM input is quantised first (`quantisation_bytes`).

Communication inside the layer, and what Megatron overlaps it with (`tp_exposed`):
- TP without --tp-comm-overlap: the forward's collectives wait for their GEMMs and are exposed; in
  the backward, a column-parallel linear (QKV, FC1) overlaps its input-gradient reduction with its
  weight-gradient GEMM and, with sequence parallel, the all-gather of its saved input with its
  input-gradient GEMM (megatron/core/tensor_parallel/layers.py,
  LinearWithGradAccumulationAndAsyncCommunication.backward), when CUDA_DEVICE_MAX_CONNECTIONS=1
  orders the streams (not under Megatron-FSDP); the row-parallel linear's mirror collective is exposed.
- TP with --tp-comm-overlap (userbuffers): every collective is split into tp chunks pipelined
  with its GEMM; the part the GEMM cannot cover, and at least the first chunk, is exposed.
- CP, by Transformer Engine's exchange (--cp-comm-type): p2p, the K/V ring, hides behind the attention of
  the chunks already received; a2a (Ulysses) all-to-alls Q, K, V to head shards before attention and the
  output back after it, and all_gather gathers K and V before it (the backward gathers them again and
  reduce-scatters their gradients): both exposed.
- EP: the dispatch and combine all-to-alls wait for the slowest rank of the group (exposed). They carry
  `dispatch_copies` copies of each token: one per routed expert with Megatron's alltoall dispatcher, one
  per destination rank with DeepEP's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from nest_megatron.cost import fp8
from nest_megatron.cost.collectives import (
    Network,
    all_gather_time,
    all_reduce_time,
    all_to_all_time,
    p2p_time,
    reduce_scatter_time,
    worst,
)
from nest_megatron.cost.compute import ATTENTION_BACKWARD_FACTOR, BF16, ComputeModel
from nest_megatron.cost.placement import Spans
from nest_megatron.model.spec import Gemm, ModelSpec
from nest_megatron.parallel.config import ParallelConfig


@dataclass(frozen=True)
class LayerTime:
    fwd_compute: float
    bwd_compute: float
    core_attention_fwd: float  # what selective recompute runs again
    fwd_comm: float  # exposed TP + CP + EP communication of the forward pass
    bwd_comm: float
    tp_comm: float  # exposed, forward + backward, for the breakdown
    cp_comm: float
    ep_comm: float

    @property
    def fwd(self) -> float:
        return self.fwd_compute + self.fwd_comm

    @property
    def bwd(self) -> float:
        return self.bwd_compute + self.bwd_comm


def permutation_elements(model: ModelSpec, *, tokens_sp: float, rows: float, local_experts: int,
                         dispatcher: str = "alltoall", copies: float | None = None, fused: bool = False) -> float:
    """Elements a MoE layer's forward reads and writes to permute its tokens to the experts and back.

    `rows` R routed copies of the h-wide tokens; T the tokens permuted: this rank's `tokens_sp` before
    Megatron's alltoall exchange, or the tokens DeepEP delivered to it (R x copies / topk).
    - allgather (megatron-core 0.7's default MoEAllGatherTokenDispatcher, token_dispatcher.py): the
      expert-parallel group's tokens gathered, ep T_sp of them; the local copies gathered out of them
      (2 R h), multiplied by their probabilities (2 R h) and scattered back into a zeroed buffer of the
      gathered size for the reduce-scatter (ep T_sp h + 3 R h); with several local experts, sorted by
      expert and back (4 R h).
    - permute: read a token per copy, write the copy: 2 R h (Megatron's index_select; Transformer
      Engine's moe_permute the same).
    - unpermute, unfused (megatron/core/transformer/moe/moe_utils.py unpermute: the copies times their
      probabilities, a zero output, scatter_add into it): 3 R h + 3 T h; fused (--moe-permute-fusion,
      Transformer Engine's moe_unpermute: read each copy once, write each weighted sum once): R h + T h.
    - alltoall with several local experts: the received chunks sorted by expert after the exchange and
      back before it (sort_chunks_by_idxs): 2 R h each.
    """
    h, k = model.h, model.cfg.moe_router_topk
    if dispatcher == "allgather":
        gathered = tokens_sp * max(1, model.cfg.num_experts // local_experts)
        return h * (7 * rows + gathered + (4 * rows if local_experts > 1 else 0.0))
    permuted = tokens_sp if dispatcher == "alltoall" else rows * (k if copies is None else copies) / k
    unpermute = rows + permuted if fused else 3 * rows + 3 * permuted
    sort = 4 * rows if dispatcher == "alltoall" and local_experts > 1 else 0.0
    return h * (2 * rows + unpermute + sort)


def elementwise_bytes(model: ModelSpec, *, tokens: int, cfg: ParallelConfig, moe: bool, dispatcher: str = "alltoall",
                      copies: float | None = None, permute_fusion: bool = False) -> float:
    """HBM bytes read + written by the memory-bound ops of one layer's forward pass.

    Two norms, two residual adds, RoPE on q and k, the activation function, dropouts where p > 0,
    the softmax when attention is not fused, and in a MoE layer the token permutation before the
    experts and the unpermutation (weighted by the router's probabilities) after them
    (`permutation_elements`, for the dispatcher, its `copies` and whether the permutation is fused).
    """
    m = model.cfg
    h, t = model.h, cfg.tp
    tokens_sp = tokens / t if cfg.sp else tokens
    nbytes = 2 * (2 * h * tokens_sp)  # norms: read and write
    nbytes += 2 * (3 * h * tokens_sp)  # residual adds: two reads, one write
    if m.position_embedding_type == "rope":
        nbytes += 2 * tokens * (model.q_size + model.kv_size) / t
    if m.qk_layernorm:
        nbytes += 2 * tokens * (model.q_size + model.kv_size) / t
    rows, f, width = (model.routed_rows(tokens=tokens, tp=t, etp=cfg.etp), model.moe_ffn, cfg.etp) if moe else (tokens, m.ffn_hidden_size, t)
    nbytes += rows * f / width * (model.fc1_factor + 1)  # read FC1's output, write FC2's input
    if moe:
        nbytes += permutation_elements(model, tokens_sp=tokens_sp, rows=rows,
                                       local_experts=max(1, model.cfg.num_experts // cfg.ep), dispatcher=dispatcher,
                                       copies=copies, fused=permute_fusion)
    if m.hidden_dropout > 0:
        nbytes += 2 * (2 * h * tokens_sp)
    if not model.fused_attention:
        nbytes += 2 * (model.heads / t) * tokens * m.seq_length * (2 if m.attention_dropout > 0 else 1)
    return BF16 * nbytes


def quantisation_bytes(model: ModelSpec, gemms: list[Gemm]) -> tuple[float, float]:
    """(forward, backward) bytes of the fp8 casts (cost/fp8.py quantise_bytes per element): each GEMM's input
    [m, k] forward, its output gradient [m, n] backward. Weights are cast once per step (the first micro-batch's)
    and left out."""
    numerics = model.numerics
    if numerics.fp8_recipe is None:
        return 0.0, 0.0
    per_element = fp8.quantise_bytes(numerics.fp8_recipe, any_layout=numerics.fp8_any_layout)
    fwd = sum(g.count * g.m * g.k for g in gemms if g.name != "router")
    bwd = sum(g.count * g.m * g.n for g in gemms if g.name != "router")
    return per_element * fwd, per_element * bwd


def dispatch_copies(model: ModelSpec, ep: int, *, dispatcher: str = "alltoall", router: str = "learned") -> float:
    """Copies of each token the EP dispatch all-to-all carries (and the combine brings back).

    alltoall: Megatron's MoEAlltoAllTokenDispatcher permutes a copy per routed expert before the
    exchange (megatron/core/transformer/moe/token_dispatcher.py): topk copies.
    deepep: DeepEP's dispatch (Megatron's flex dispatcher, NeMo AutoModel's) sends a token once to
    each rank holding one of its experts (deep_ep Buffer.get_dispatch_layout, is_token_in_rank), and
    the receiving rank expands it to its local experts. How many ranks that is depends on the router:
      learned: taken as uniform, k distinct of E experts, E/ep a rank: ep (1 - C(E - E/ep, k) / C(E, k));
      fake_balanced: AutoModel's FakeBalancedGate sends token i to experts ik, ..., ik + k - 1 (mod E)
        (nemo_automodel/components/moe/layers.py, FakeBalancedGate.forward): the ranks of those
        consecutive experts, averaged over the starts ik mod E.
    """
    k, experts = model.cfg.moe_router_topk, model.cfg.num_experts
    if dispatcher in ("alltoall", "allgather") or ep <= 1:  # allgather: exchanges whole tokens (layer_time)
        return float(k)
    if dispatcher != "deepep":
        raise ValueError(f"unknown MoE dispatcher {dispatcher!r}: alltoall | allgather | deepep")
    local = experts // ep
    if router == "learned":
        return ep * (1 - math.comb(experts - local, k) / math.comb(experts, k))
    if router == "fake_balanced":
        starts = range(0, experts, math.gcd(k, experts))
        return sum(len({((s + j) % experts) // local for j in range(k)}) for s in starts) / len(starts)
    raise ValueError(f"unknown MoE router {router!r}: learned | fake_balanced")


def layer_time(
    model: ModelSpec, *, cfg: ParallelConfig, moe: bool, spans: Spans, net: Network, compute: ComputeModel,
    tp_comm_overlap: bool = False, ep_copies: float | None = None, dispatcher: str = "alltoall",
    permute_fusion: bool = False,
) -> LayerTime:
    """One layer's times; configurations that differ only in what a layer does not see (ZeRO,
    recompute, pipeline depth, ...) share one computation. `ep_copies`: the copies of a token the EP
    all-to-alls carry (`dispatch_copies`; None: topk, Megatron's alltoall dispatcher); `dispatcher` and
    `permute_fusion` set the permutation's bytes (`permutation_elements`)."""
    copies = float(model.cfg.moe_router_topk) if ep_copies is None else ep_copies
    return _layer_time(model, cfg.tp, cfg.sp, cfg.cp, cfg.ep, cfg.etp, cfg.mbs, moe, spans.tp, spans.cp, spans.ep, net,
                       compute, tp_comm_overlap, ordered_streams(cfg), copies, dispatcher, permute_fusion, cfg.cp_comm_type)


def ordered_streams(cfg: ParallelConfig) -> bool:
    """Whether the launch sets CUDA_DEVICE_MAX_CONNECTIONS=1 (launch/prepare.py megatron_env): with TP, unless
    Megatron-FSDP needs more queues. Only then are the backward's collectives issued ahead of the GEMMs
    they overlap (megatron/core/tensor_parallel/layers.py:843-849); otherwise they may wait behind them."""
    return cfg.zero < 2


def _exposed(comm: float, gemm: float, chunks: int) -> float:
    """A collective pipelined with a GEMM in `chunks` pieces: what the GEMM cannot cover, and at
    least the first piece."""
    return max(comm - gemm, comm / chunks)


@lru_cache(maxsize=65536)
def _layer_time(model, tp, sp, cp, ep, etp, mbs, moe, tp_shapes, cp_shapes, ep_shapes, net, compute,
                tp_comm_overlap, ordered, ep_copies, dispatcher, permute_fusion, cp_comm_type) -> LayerTime:
    cfg = ParallelConfig(tp=tp, sp=sp, cp=cp, ep=ep, etp=etp, mbs=mbs)
    tokens = cfg.mbs * model.cfg.seq_length // cfg.cp
    gemms = model.layer_gemms(tokens=tokens, tp=cfg.tp, ep=cfg.ep, etp=cfg.etp, moe=moe)
    timed = gemm_times(compute, gemms)
    memory = elementwise_bytes(model, tokens=tokens, cfg=cfg, moe=moe, dispatcher=dispatcher, copies=ep_copies,
                               permute_fusion=permute_fusion)
    passes = pass_times(compute, timed, attention_flops=model.attention_flops(micro_batch=cfg.mbs, tp=cfg.tp, cp=cfg.cp),
                        head_dim=model.head_dim, cp=cfg.cp, memory_bytes=memory, quantise_bytes=quantisation_bytes(model, gemms))
    fwd_compute, bwd_compute, attention, attention_bwd = passes

    fwd_gemm = {name: forward for name, forward, _, _ in timed}
    dgrad = {name: input_gradient for name, _, input_gradient, _ in timed}
    wgrad = {name: weight_gradient for name, _, _, weight_gradient in timed}
    tp_fwd, tp_bwd = tp_exposed(model, cfg, moe=moe, shapes=tp_shapes, net=net, gemm=fwd_gemm, dgrad=dgrad,
                                wgrad=wgrad, overlap=tp_comm_overlap, ordered=ordered)

    # CP (Transformer Engine's attention/dot_product_attention/context_parallel.py at v2.12), by cp_comm_type:
    # p2p (AttnFuncWithCPAndKVP2P): a ring of cp - 1 steps, each passing one K/V chunk to the next rank;
    #   backward passes K/V and their gradients. Each step hides behind the attention of the chunk in hand.
    # a2a (AttnFuncWithCPAndQKVOA2A, :3268): Q, K and V all-to-all'd from sequence to head shards before
    #   attention and the output back after it; backward the output gradient in, dQ, dK, dV out. Exposed.
    # all_gather (AttnFuncWithCPAndKVAllGather, :2759): K and V all-gathered before attention ("exposed", its
    #   docstring); backward gathers them again and reduce-scatters dK, dV.
    cp_fwd = cp_bwd = 0.0
    if cfg.cp > 1:
        q_chunk = BF16 * tokens * model.q_size / cfg.tp  # this rank's queries, and its output
        kv_chunk = 2 * BF16 * tokens * model.kv_size / cfg.tp  # its keys and values
        if cp_comm_type == "a2a":
            q_or_out = worst(all_to_all_time, cp_shapes, q_chunk, net)
            k_or_v = worst(all_to_all_time, cp_shapes, kv_chunk / 2, net)
            cp_fwd = cp_bwd = 2 * q_or_out + 2 * k_or_v
        elif cp_comm_type == "all_gather":
            gathered = cfg.cp * kv_chunk / 2  # the whole sequence's K (or V)
            cp_fwd = 2 * worst(all_gather_time, cp_shapes, gathered, net)
            cp_bwd = cp_fwd + 2 * worst(reduce_scatter_time, cp_shapes, gathered, net)
        else:
            ring_level = max(shape.top_level for shape in cp_shapes)
            step = p2p_time(ring_level, kv_chunk, net)
            cp_fwd = max(0.0, (cfg.cp - 1) * step - attention)
            cp_bwd = max(0.0, 2 * (cfg.cp - 1) * step - attention_bwd)

    # EP: dispatch and combine all-to-alls of the copies of this rank's tokens (`dispatch_copies`); the
    # allgather dispatcher gathers the whole group's tokens and reduce-scatters the experts' outputs in
    # that size (its backward the mirror), whatever the routing. Under TP it gathers over the TP x EP
    # group; priced over the EP group's links with the same total.
    ep_pass = 0.0
    if moe and cfg.ep > 1:
        tokens_sp = tokens / cfg.tp if cfg.sp else tokens
        if dispatcher == "allgather":
            gathered = BF16 * tokens_sp * cfg.ep * model.h
            ep_pass = worst(all_gather_time, ep_shapes, gathered, net) + worst(reduce_scatter_time, ep_shapes, gathered, net)
        else:
            routed = BF16 * tokens_sp * ep_copies * model.cfg.moe_load_imbalance * model.h
            ep_pass = 2 * worst(all_to_all_time, ep_shapes, routed, net)

    return LayerTime(
        fwd_compute=fwd_compute,
        bwd_compute=bwd_compute,
        core_attention_fwd=attention,
        fwd_comm=tp_fwd + cp_fwd + ep_pass,
        bwd_comm=tp_bwd + cp_bwd + ep_pass,
        tp_comm=tp_fwd + tp_bwd,
        cp_comm=cp_fwd + cp_bwd,
        ep_comm=2 * ep_pass,
    )


def gemm_times(compute: ComputeModel, gemms: list[Gemm]) -> list[tuple[str, float, float, float]]:
    """(name, forward, input-gradient, weight-gradient) time of each GEMM of a layer."""
    return [(g.name, compute.gemm_time(g), compute.gemm_time(g.dgrad), compute.gemm_time(g.wgrad)) for g in gemms]


def pass_times(compute: ComputeModel, timed: list[tuple[str, float, float, float]], *, attention_flops: float,
               head_dim: int, cp: int, memory_bytes: float,
               quantise_bytes: tuple[float, float] = (0.0, 0.0)) -> tuple[float, float, float, float]:
    """(forward, backward, attention forward, attention backward) computation of one layer pass
    without communication, from its GEMMs' `gemm_times`: what a profiled layer measures
    (profile/fit.py) and the cost model adds. CP runs one attention kernel per ring step, each on
    one K/V chunk."""
    attention = cp * compute.attention_time(attention_flops / cp, head_dim)
    attention_bwd = cp * compute.attention_time(ATTENTION_BACKWARD_FACTOR * attention_flops / cp, head_dim)
    forward = sum(t[1] for t in timed) + attention + compute.memory_time(memory_bytes + quantise_bytes[0])
    backward = (sum(t[2] + t[3] for t in timed) + attention_bwd
                + compute.memory_time(2 * memory_bytes + quantise_bytes[1]))
    return forward, backward, attention, attention_bwd


# The column-parallel and row-parallel GEMMs of each block whose input / output TP exchanges.
TP_BLOCKS = {"attention": ("qkv", "proj"), "mlp": ("fc1", "fc2"), "shared": ("shared_fc1", "shared_fc2")}


def tp_exposed(model: ModelSpec, cfg: ParallelConfig, *, moe: bool, shapes, net: Network, gemm: dict, dgrad: dict,
               wgrad: dict, overlap: bool, ordered: bool = True) -> tuple[float, float]:
    """(forward, backward) exposed TP communication of one layer: per block (attention, the dense
    MLP, or a MoE layer's shared expert; the routed experts exchange tokens by EP instead, or by
    expert TP as an MLP block), the collectives on the [tokens, h] activation around its
    column-parallel and row-parallel GEMMs. Without `ordered` streams the backward hides nothing."""
    if cfg.tp == 1:
        return 0.0, 0.0
    tokens = cfg.mbs * model.cfg.seq_length // cfg.cp
    activation = BF16 * tokens * model.h
    gather = worst(all_gather_time, shapes, activation, net)
    scatter = worst(reduce_scatter_time, shapes, activation, net)
    reduce = worst(all_reduce_time, shapes, activation, net)
    blocks = ["attention"]
    if not moe:
        blocks.append("mlp")
    elif model.cfg.moe_shared_expert_intermediate_size:
        blocks.append("shared")
    fwd = bwd = 0.0
    for block in blocks:
        # a traced GEMM named otherwise hides nothing (model/spec.py gemm_role names megatron-core's)
        column, row = TP_BLOCKS[block]
        col_fwd, row_fwd = gemm.get(column, 0.0), gemm.get(row, 0.0)
        col_dgrad, row_dgrad, col_wgrad = dgrad.get(column, 0.0), dgrad.get(row, 0.0), wgrad.get(column, 0.0)
        if overlap:  # userbuffers: needs sequence parallel (a Megatron rule)
            fwd += _exposed(gather, col_fwd, cfg.tp) + _exposed(scatter, row_fwd, cfg.tp)
            bwd += (_exposed(gather, row_dgrad, cfg.tp) + _exposed(gather, col_dgrad, cfg.tp)
                    + _exposed(scatter, col_wgrad, cfg.tp))
        elif cfg.sp:
            fwd += gather + scatter
            hidden_d, hidden_w = (col_dgrad, col_wgrad) if ordered else (0.0, 0.0)
            bwd += gather + max(0.0, gather - hidden_d) + max(0.0, scatter - hidden_w)
        else:
            fwd += reduce
            bwd += max(0.0, reduce - (col_wgrad if ordered else 0.0))
    if moe and cfg.etp > 1:  # the experts under expert TP: an MLP block's exchanges, exposed
        fwd += gather + scatter if cfg.sp else reduce
        bwd += gather + scatter if cfg.sp else reduce
    return fwd, bwd
