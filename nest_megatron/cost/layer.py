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
  per destination rank with DeepEP's; a token is `ModelSpec.moe_token_width` wide (a latent MoE's latent size).
"""

from __future__ import annotations

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
    routed_all_to_all_time,
    worst,
)
from nest_megatron.cost.compute import ATTENTION_BACKWARD_FACTOR, BF16, ComputeModel
from nest_megatron.cost.placement import Spans
from nest_megatron.cost.routing import deepep_level_copies
from nest_megatron.model.kinds import LayerKind
from nest_megatron.model.spec import Gemm, ModelSpec
from nest_megatron.parallel.config import ParallelConfig


@dataclass(frozen=True)
class LayerTime:
    fwd_compute: float
    bwd_compute: float
    fwd_comm: float  # exposed TP + CP + EP communication of the forward pass
    bwd_comm: float
    tp_comm: float  # exposed, forward + backward, for the breakdown
    cp_comm: float
    ep_comm: float
    # The forward computation by part (GEMM roles, core_attention, memory-bound terms): `forward_parts`.
    fwd_parts: tuple[tuple[str, float], ...] = ()
    # The forward's exposed communication by part: "tp:<block>:column" and "tp:<block>:row" (`tp_blocks`' names),
    # "tp:experts" (expert TP), "ep" (dispatch and combine); what a recompute of some modules sends again.
    fwd_comm_parts: tuple[tuple[str, float], ...] = ()
    # Of the computation above, a MoE layer's experts (`EXPERT_NODE`): forward, input-gradient and weight-gradient
    # time; what the other micro-batch's dispatch and combine overlap with under --overlap-moe-expert-parallel-comm
    # (cost/a2a_overlap.py).
    experts_fwd: float = 0.0
    experts_dgrad: float = 0.0
    experts_wgrad: float = 0.0

    @property
    def fwd(self) -> float:
        return self.fwd_compute + self.fwd_comm

    @property
    def bwd(self) -> float:
        return self.bwd_compute + self.bwd_comm


def permutation_elements(model: ModelSpec, *, tokens_sp: float, rows: float, local_experts: int,
                         dispatcher: str = "alltoall", copies: float | None = None, fused: bool = False) -> float:
    """Elements a MoE layer's forward reads and writes to permute its tokens to the experts and back.

    `rows` R routed copies of the tokens, each h wide (`ModelSpec.moe_token_width`: the latent size with
    --moe-latent-size, whose fc1_latent_proj runs before the dispatch); T the tokens permuted: this rank's `tokens_sp` before
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
    h, k = model.moe_token_width, model.cfg.moe_router_topk
    if dispatcher == "allgather":
        gathered = tokens_sp * max(1, model.cfg.num_experts // local_experts)
        return h * (7 * rows + gathered + (4 * rows if local_experts > 1 else 0.0))
    permuted = tokens_sp if dispatcher == "alltoall" else rows * (k if copies is None else copies) / k
    unpermute = rows + permuted if fused else 3 * rows + 3 * permuted
    sort = 4 * rows if dispatcher == "alltoall" and local_experts > 1 else 0.0
    return h * (2 * rows + unpermute + sort)


def elementwise_terms(model: ModelSpec, *, tokens: int, cfg: ParallelConfig, kind: LayerKind,
                      dispatcher: str = "alltoall", copies: float | None = None,
                      permute_fusion: bool = False) -> dict[str, float]:
    """HBM bytes read + written by the memory-bound ops of one layer's forward pass, by name and block.

    Each block (mixer, MLP) has its norm and its residual add (and a hidden dropout where p > 0). Standard
    attention: RoPE (and QK-norm) on q and k, the softmax when attention is not fused. MLA: its latent norms
    (with --qk-layernorm) and the assembly of Q, K, V from the up projections' outputs and the RoPE parts
    (`mla_assembly`). The MLP: the activation function, and in a MoE layer the token permutation before the
    experts and the unpermutation after them (`permutation_elements`, for the dispatcher, its `copies` and
    whether the permutation is fused). A multi-token-prediction depth: its three norms, the concatenation
    and the shifted tokens' embedding.
    """
    m = model.cfg
    h, t = model.h, cfg.tp
    tokens_sp = tokens / t if cfg.sp else tokens
    elements = {}
    if kind.mtp:
        elements |= {"mtp_norms": 3 * 2 * h * tokens_sp, "mtp_concat": 2 * 2 * h * tokens_sp,
                     "mtp_embedding": 2 * h * tokens_sp}
    if kind.mixer != "none":
        elements |= {"norm1": 2 * h * tokens_sp, "residual1": 3 * h * tokens_sp}
        if kind.mixer == "attention":
            if m.position_embedding_type == "rope":
                elements["rope"] = 2 * tokens * (model.q_size + model.kv_size) / t
            if m.qk_layernorm:
                elements["qk_norm"] = 2 * tokens * (model.q_size + model.kv_size) / t
        elif kind.mixer == "mla":
            elements |= _mla_elements(model, tokens=tokens, tokens_sp=tokens_sp, tp=t)
        elif kind.mixer == "mamba":
            # The fused conv + scan kernel reads in_proj's output and writes its gated output; the gated RMSNorm
            # reads that and writes out_proj's input (the scan's FLOPs: ModelSpec.mamba_scan_flops).
            elements["mamba_scan_io"] = tokens * (model.mamba_in_proj_width + model.mamba_inner) / t
            elements["mamba_norm"] = 2 * tokens * model.mamba_inner / t
        if m.hidden_dropout > 0:
            elements["dropout1"] = 2 * h * tokens_sp
        if not model.fused_attention and kind.mixer != "mamba":
            elements["softmax"] = 2 * (model.heads / t) * tokens * m.seq_length * (2 if m.attention_dropout > 0 else 1)
    if kind.mlp != "none":
        elements |= {"norm2": 2 * h * tokens_sp, "residual2": 3 * h * tokens_sp}
        moe = kind.mlp == "moe"
        rows, f, width = ((model.routed_rows(tokens=tokens, tp=t, etp=cfg.etp), model.moe_ffn, cfg.etp) if moe
                          else (tokens, m.ffn_hidden_size, t))
        elements["mlp_act"] = rows * f / width * (model.fc1_factor + 1)  # read FC1's output, write FC2's input
        if moe:
            elements["permutation"] = permutation_elements(
                model, tokens_sp=tokens_sp, rows=rows, local_experts=max(1, model.cfg.num_experts // cfg.ep),
                dispatcher=dispatcher, copies=copies, fused=permute_fusion)
        if m.hidden_dropout > 0:
            elements["dropout2"] = 2 * h * tokens_sp
    return {name: BF16 * n for name, n in elements.items()}


def _mla_elements(model: ModelSpec, *, tokens: float, tokens_sp: float, tp: int) -> dict[str, float]:
    """MLA's memory-bound work, in elements: the query and KV latent norms (read and write) with --qk-layernorm;
    the queries [T, H (qk + rope) / t] read and written whole (RoPE on their last rope dims and the concatenation,
    or Megatron's fused MLA RoPE kernel, which does the same in one pass), the KV up projection's output read
    with the shared RoPE key and written as keys [T, H (qk + rope) / t] and values [T, H v / t]."""
    m = model.cfg
    elements = {}
    if m.qk_layernorm:
        elements["mla_latent_norms"] = 2 * tokens_sp * ((m.q_lora_rank or 0) + m.kv_lora_rank)
    qk, v = model.attention_widths(LayerKind("mla"))
    kv_up = model.heads * (m.qk_head_dim + m.v_head_dim)
    elements["mla_assembly"] = tokens * (2 * qk + kv_up + qk + v) / tp + tokens * m.qk_pos_emb_head_dim
    return elements


def elementwise_bytes(model: ModelSpec, *, tokens: int, cfg: ParallelConfig, kind: LayerKind,
                      dispatcher: str = "alltoall", copies: float | None = None, permute_fusion: bool = False) -> float:
    """HBM bytes read + written by the memory-bound ops of one layer's forward pass (`elementwise_terms`)."""
    return sum(elementwise_terms(model, tokens=tokens, cfg=cfg, kind=kind, dispatcher=dispatcher, copies=copies,
                                 permute_fusion=permute_fusion).values())


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


def layer_time(
    model: ModelSpec, *, cfg: ParallelConfig, kind: LayerKind, spans: Spans, net: Network, compute: ComputeModel,
    tp_comm_overlap: bool = False, ep_copies: float | None = None, dispatcher: str = "alltoall",
    router: str = "learned", permute_fusion: bool = False,
) -> LayerTime:
    """One layer's times for a layer of `kind`; configurations that differ only in what a layer does not see
    (ZeRO, recompute, pipeline depth, ...) share one computation. `ep_copies`: the copies of a token the EP
    all-to-alls carry (`routing.dispatch_copies`; None: topk, Megatron's alltoall dispatcher); `dispatcher` and
    `permute_fusion` set the permutation's bytes (`permutation_elements`); `router` where DeepEP's copies go
    (`routing.deepep_level_copies`)."""
    copies = float(model.cfg.moe_router_topk) if ep_copies is None else ep_copies
    return _layer_time(model, cfg.tp, cfg.sp, cfg.cp, cfg.ep, cfg.etp, cfg.mbs, kind, spans.tp, spans.cp, spans.ep, net,
                       compute, tp_comm_overlap, ordered_streams(cfg), copies, dispatcher,
                       router, permute_fusion, cfg.cp_comm_type)


def ordered_streams(cfg: ParallelConfig) -> bool:
    """Whether the launch sets CUDA_DEVICE_MAX_CONNECTIONS=1 (launch/prepare.py megatron_env): with TP, unless
    Megatron-FSDP or the EP all-to-all overlap needs more queues. Only then are the backward's collectives issued
    ahead of the GEMMs they overlap (megatron/core/tensor_parallel/layers.py:843-849); otherwise they may wait
    behind them."""
    return cfg.zero < 2 and not cfg.moe_a2a_overlap


def _exposed(comm: float, gemm: float, chunks: int) -> float:
    """A collective pipelined with a GEMM in `chunks` pieces: what the GEMM cannot cover, and at
    least the first piece."""
    return max(comm - gemm, comm / chunks)


@lru_cache(maxsize=65536)
def _layer_time(model, tp, sp, cp, ep, etp, mbs, kind, tp_shapes, cp_shapes, ep_shapes, net, compute,
                tp_comm_overlap, ordered, ep_copies, dispatcher, router, permute_fusion, cp_comm_type) -> LayerTime:
    cfg = ParallelConfig(tp=tp, sp=sp, cp=cp, ep=ep, etp=etp, mbs=mbs)
    tokens = cfg.mbs * model.cfg.seq_length // cfg.cp
    gemms = model.layer_gemms(tokens=tokens, tp=cfg.tp, sp=cfg.sp, ep=cfg.ep, etp=cfg.etp, kind=kind)
    timed = gemm_times(compute, gemms)
    memory = elementwise_terms(model, tokens=tokens, cfg=cfg, kind=kind, dispatcher=dispatcher, copies=ep_copies,
                               permute_fusion=permute_fusion)
    quantise = quantisation_bytes(model, gemms)
    passes = pass_times(compute, timed,
                        attention_flops=model.attention_flops(micro_batch=cfg.mbs, tp=cfg.tp, cp=cfg.cp, kind=kind),
                        head_dim=model.attention_head_dim(kind), cp=cfg.cp, memory_bytes=sum(memory.values()),
                        quantise_bytes=quantise)
    fwd_compute, bwd_compute, attention, attention_bwd = passes

    fwd_gemm = {name: forward for name, forward, _, _ in timed}
    dgrad = {name: input_gradient for name, _, input_gradient, _ in timed}
    wgrad = {name: weight_gradient for name, _, _, weight_gradient in timed}
    tp_fwd, tp_bwd, tp_parts = tp_exposed(model, cfg, kind=kind, shapes=tp_shapes, net=net, gemm=fwd_gemm,
                                          dgrad=dgrad, wgrad=wgrad, overlap=tp_comm_overlap, ordered=ordered)

    # CP (Transformer Engine's attention/dot_product_attention/context_parallel.py at v2.12), by cp_comm_type:
    # p2p (AttnFuncWithCPAndKVP2P, :1232): cp attention steps, one per K/V chunk, the causal chunks balanced
    #   (each rank holds chunks r and 2 cp - 1 - r: every step the same FLOPs, attention / cp). Forward (:1539),
    #   step i issues the next chunk's transfer, runs its attention, and step i + 1 waits for the transfer:
    #   cp - 1 transfers, each hidden behind one step's attention only. Backward (:2275), step i sends K/V
    #   (step 0), K/V and the dK/dV so far (steps 1 .. cp - 2) or dK/dV (step cp - 1), waited for after its
    #   attention backward. What one step cannot hide is exposed; another step's slack does not help.
    # a2a (AttnFuncWithCPAndQKVOA2A, :3268): Q, K and V all-to-all'd from sequence to head shards before
    #   attention and the output back after it; backward the output gradient in, dQ, dK, dV out. Exposed.
    # all_gather (AttnFuncWithCPAndKVAllGather, :2759): K and V all-gathered before attention ("exposed", its
    #   docstring); backward gathers them again and reduce-scatters dK, dV.
    # The widths are the mixer's (`attention_widths`, `cp_kv_width`): MLA's K is as wide as its Q, its V and the
    # output as wide as the values.
    cp_fwd = cp_bwd = 0.0
    if cfg.cp > 1 and kind.mixer == "mamba":
        # megatron-core 0.16.1 ssm/mamba_context_parallel.py: in_proj's output all-to-all'd from sequence to head
        # shards before the conv and scan (pre_conv_ssm, :133-192), their output back after (post_conv_ssm,
        # :194-205); backward the mirror. Exposed.
        zxbcdt = BF16 * tokens * model.mamba_in_proj_width / cfg.tp
        scanned = BF16 * tokens * model.mamba_inner / cfg.tp
        cp_fwd = cp_bwd = worst(all_to_all_time, cp_shapes, zxbcdt, net) + worst(all_to_all_time, cp_shapes, scanned, net)
    elif cfg.cp > 1 and kind.mixer != "none":
        qk_width, v_width = model.attention_widths(kind)
        kv_chunk = BF16 * tokens * model.cp_kv_width(kind) / cfg.tp  # this rank's keys and values
        if cp_comm_type == "a2a":
            q_chunk = BF16 * tokens * qk_width / cfg.tp  # its queries; the output is v_width wide
            out_chunk = BF16 * tokens * v_width / cfg.tp
            q_and_out = worst(all_to_all_time, cp_shapes, q_chunk, net) + worst(all_to_all_time, cp_shapes, out_chunk, net)
            k_and_v = (worst(all_to_all_time, cp_shapes, kv_chunk * _key_share(model, kind), net)
                       + worst(all_to_all_time, cp_shapes, kv_chunk * (1 - _key_share(model, kind)), net))
            cp_fwd = cp_bwd = q_and_out + k_and_v
        elif cp_comm_type == "all_gather":
            gathered_k = cfg.cp * kv_chunk * _key_share(model, kind)  # the whole sequence's K, then V
            gathered_v = cfg.cp * kv_chunk - gathered_k
            cp_fwd = worst(all_gather_time, cp_shapes, gathered_k, net) + worst(all_gather_time, cp_shapes, gathered_v, net)
            cp_bwd = cp_fwd + (worst(reduce_scatter_time, cp_shapes, gathered_k, net)
                               + worst(reduce_scatter_time, cp_shapes, gathered_v, net))
        else:
            ring_level = max(shape.top_level for shape in cp_shapes)
            one, both = p2p_time(ring_level, kv_chunk, net), p2p_time(ring_level, 2 * kv_chunk, net)
            step_fwd, step_bwd = attention / cfg.cp, attention_bwd / cfg.cp
            cp_fwd = (cfg.cp - 1) * max(0.0, one - step_fwd)
            cp_bwd = 2 * max(0.0, one - step_bwd) + (cfg.cp - 2) * max(0.0, both - step_bwd)

    experts = expert_node_times(compute, model, timed, gemms, memory) if kind.is_moe else (0.0, 0.0, 0.0)

    # EP: dispatch and combine all-to-alls of the copies of this rank's tokens (`routing.dispatch_copies`; with
    # DeepEP, per level: `routing.deepep_level_copies`); the allgather dispatcher gathers the whole group's
    # tokens and reduce-scatters the experts' outputs in that size (its backward the mirror), whatever the
    # routing. Under TP it gathers over the TP x EP group; priced over the EP group's links with the same total.
    # A token is moe_token_width wide: a latent MoE exchanges its latent-projected tokens.
    ep_pass = 0.0
    if kind.is_moe and cfg.ep > 1:
        tokens_sp = tokens / cfg.tp if cfg.sp else tokens
        width = model.moe_token_width
        if dispatcher == "allgather":
            gathered = BF16 * tokens_sp * cfg.ep * width
            ep_pass = worst(all_gather_time, ep_shapes, gathered, net) + worst(reduce_scatter_time, ep_shapes, gathered, net)
        else:
            one_copy = BF16 * tokens_sp * model.expert_load * width
            ep_pass = 2 * max(_dispatch_time(model, shape, one_copy, ep_copies, dispatcher, router, net)
                              for shape in ep_shapes)

    return LayerTime(
        fwd_compute=fwd_compute,
        bwd_compute=bwd_compute,
        fwd_comm=tp_fwd + cp_fwd + ep_pass,
        bwd_comm=tp_bwd + cp_bwd + ep_pass,
        tp_comm=tp_fwd + tp_bwd,
        cp_comm=cp_fwd + cp_bwd,
        ep_comm=2 * ep_pass,
        fwd_parts=forward_parts(compute, timed, attention=attention, memory=memory, quantise_fwd=quantise[0]),
        fwd_comm_parts=tuple(tp_parts.items()) + ((("ep", ep_pass),) if ep_pass else ()),
        experts_fwd=experts[0],
        experts_dgrad=experts[1],
        experts_wgrad=experts[2],
    )


# What megatron-core runs between a MoE layer's dispatch and its combine (models/gpt/fine_grained_callables.py
# submodule_moe_forward at 0.16.1: the experts' grouped GEMMs and their activation); the shared experts, the router
# and the token permutation run before the dispatch (submodule_attn_forward :427-482), the unpermutation after the
# combine (submodule_combine_forward :544-556).
EXPERT_NODE = ("expert_fc1", "expert_fc2")


def expert_node_times(compute: ComputeModel, model: ModelSpec, timed, gemms: list[Gemm],
                      memory: dict[str, float]) -> tuple[float, float, float]:
    """(forward, input-gradient, weight-gradient) time of a MoE layer's experts: their GEMMs (with their fp8 casts)
    and their activation, priced as `pass_times` prices them (the activation's backward reads twice the bytes)."""
    fwd = sum(t[1] for t in timed if t[0] in EXPERT_NODE)
    dgrad = sum(t[2] for t in timed if t[0] in EXPERT_NODE)
    wgrad = sum(t[3] for t in timed if t[0] in EXPERT_NODE)
    cast_fwd, cast_bwd = quantisation_bytes(model, [g for g in gemms if g.name in EXPERT_NODE])
    act = memory.get("mlp_act", 0.0)
    return fwd + compute.memory_time(act + cast_fwd), dgrad + compute.memory_time(2 * act + cast_bwd), wgrad


def _key_share(model: ModelSpec, kind: LayerKind) -> float:
    """Of the keys and values a CP exchange passes, the keys' share: a half with standard attention, MLA's
    H (qk + rope) of H (qk + rope) + H v."""
    if kind.mixer == "mla":
        qk, v = model.attention_widths(kind)
        return qk / (qk + v)
    return 0.5


def _dispatch_time(model: ModelSpec, shape, one_copy: float, copies: float, dispatcher: str, router: str,
                   net: Network) -> float:
    """One dispatch (or combine) all-to-all over an EP group of `shape`: `copies` of each token spread over the
    peers alike (Megatron's alltoall), or DeepEP's copies per level where the group's units are regular."""
    if dispatcher == "deepep":
        levels = deepep_level_copies(model, shape.fan_in, router=router)
        if levels is not None:
            return routed_all_to_all_time(shape, tuple(one_copy * c for c in levels), net)
    return all_to_all_time(shape, one_copy * copies, net)


def forward_parts(compute: ComputeModel, timed: list[tuple[str, float, float, float]], *, attention: float,
                  memory: dict[str, float], quantise_fwd: float) -> tuple[tuple[str, float], ...]:
    """The forward computation of one layer pass by part: each GEMM by its role, the core attention, and the
    memory-bound time shared out over the named terms in proportion to their bytes (the fp8 casts as
    `fp8_casts`); the parts add up to `pass_times`' forward. What a recompute of some modules runs again is a
    sum of some of these."""
    parts = [(name, forward) for name, forward, _, _ in timed] + [("core_attention", attention)]
    named = {**memory, "fp8_casts": quantise_fwd} if quantise_fwd else dict(memory)
    total = sum(named.values())
    if total > 0:
        seconds = compute.memory_time(total)
        parts += [(name, seconds * nbytes / total) for name, nbytes in named.items()]
    return tuple(parts)


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


@dataclass(frozen=True)
class TpBlock:
    """A block whose linears are split over TP: its column-parallel GEMMs read the block's input, gathered along
    the sequence with sequence parallel (`gather_width` wide; their input gradient all-reduced over
    `reduce_width` without it), and its row-parallel GEMM's output is reduced (h wide). `row` None: no
    row-parallel GEMM, the column-parallel output gathered along its last dimension instead
    (`output_gather_width`: a multi-token-prediction depth's eh_proj). `name`: the block's, in
    LayerTime.fwd_comm_parts."""

    name: str
    column: tuple[str, ...]
    row: str | None
    gather_width: int
    reduce_width: int
    output_gather_width: int = 0


def tp_blocks(model: ModelSpec, kind: LayerKind) -> list[TpBlock]:
    """The TP-split blocks of a layer of `kind`: attention (QKV, projection), a Mamba-2 mixer (in_proj, out_proj);
    MLA (its query and KV up
    projections -- linear_q_proj without a query latent -- read the latents gathered with the one RoPE key,
    q_lora + kv_lora + rope wide, the duplicated down projections no collective); the dense MLP, or a MoE layer's
    shared expert (the routed experts exchange tokens by EP instead, or by expert TP as an MLP block); a
    multi-token-prediction depth's eh_proj (2h in, its h-wide output gathered)."""
    h, m = model.h, model.cfg
    blocks = []
    if kind.mtp:
        blocks.append(TpBlock("eh_proj", ("eh_proj",), None, 2 * h, 2 * h, output_gather_width=h))
    if kind.mixer == "attention":
        blocks.append(TpBlock("attention", ("qkv",), "proj", h, h))
    elif kind.mixer == "mamba":
        blocks.append(TpBlock("mamba", ("in_proj",), "out_proj", h, h))
    elif kind.mixer == "mla":
        q_name, q_width = ("q_proj", h) if m.q_lora_rank is None else ("q_up", m.q_lora_rank)
        blocks.append(TpBlock("mla", (q_name, "kv_up"), "proj", q_width + m.kv_lora_rank + m.qk_pos_emb_head_dim,
                              q_width + m.kv_lora_rank))
    if kind.mlp == "dense":
        blocks.append(TpBlock("mlp", ("fc1",), "fc2", h, h))
    elif kind.mlp == "moe" and m.moe_shared_expert_intermediate_size:
        blocks.append(TpBlock("shared", ("shared_fc1",), "shared_fc2", h, h))
    return blocks


def tp_exposed(model: ModelSpec, cfg: ParallelConfig, *, kind: LayerKind, shapes, net: Network, gemm: dict,
               dgrad: dict, wgrad: dict, overlap: bool, ordered: bool = True) -> tuple[float, float, dict]:
    """(forward, backward, forward by part) exposed TP communication of one layer: per `tp_blocks` block, the collectives
    around its column-parallel and row-parallel GEMMs. Forward, the column-parallel input's all-gather and the
    row-parallel output's reduce-scatter (with SP; else one all-reduce); backward, the row-parallel mirror
    exposed, the column-parallel re-gather of its input behind its input-gradient GEMMs and its input
    gradient's reduce-scatter (all-reduce) behind its weight-gradient GEMMs. Without `ordered` streams the
    backward hides nothing. A multi-token-prediction depth also runs the vocab-parallel embedding of the
    shifted tokens, whose output TP reduces (as the first stage's embedding, cost/evaluate.py stage_body). The
    forward by part: LayerTime.fwd_comm_parts' TP names."""
    if cfg.tp == 1:
        return 0.0, 0.0, {}
    tokens = cfg.mbs * model.cfg.seq_length // cfg.cp

    priced: dict = {}  # (collective, width) -> seconds: the blocks share widths (h)

    def collective(op, width):
        key = (op, width)
        if key not in priced:
            priced[key] = worst(op, shapes, BF16 * tokens * width, net)
        return priced[key]

    def gather(width):
        return collective(all_gather_time, width)

    def scatter(width):
        return collective(reduce_scatter_time, width)

    def reduce(width):
        return collective(all_reduce_time, width)

    fwd = bwd = 0.0
    parts = {}
    for block in tp_blocks(model, kind):
        # a traced GEMM named otherwise hides nothing (model/spec.py gemm_role names megatron-core's)
        col_fwd = sum(gemm.get(name, 0.0) for name in block.column)
        col_dgrad = sum(dgrad.get(name, 0.0) for name in block.column)
        col_wgrad = sum(wgrad.get(name, 0.0) for name in block.column)
        row_fwd, row_dgrad = gemm.get(block.row, 0.0), dgrad.get(block.row, 0.0)
        has_row = block.row is not None
        if block.output_gather_width:  # gathered forward; its backward a split, or with SP the gather of the
            out = gather(block.output_gather_width)  # re-scattered sequence
            fwd += out
            bwd += out if cfg.sp else 0.0
        if overlap:  # userbuffers: needs sequence parallel (a Megatron rule)
            column, row = (_exposed(gather(block.gather_width), col_fwd, cfg.tp),
                           _exposed(scatter(model.h), row_fwd, cfg.tp) if has_row else 0.0)
            bwd += ((_exposed(gather(model.h), row_dgrad, cfg.tp) if has_row else 0.0)
                    + _exposed(gather(block.gather_width), col_dgrad, cfg.tp)
                    + _exposed(scatter(block.gather_width), col_wgrad, cfg.tp))
        elif cfg.sp:
            column, row = gather(block.gather_width), scatter(model.h) if has_row else 0.0
            hidden_d, hidden_w = (col_dgrad, col_wgrad) if ordered else (0.0, 0.0)
            bwd += ((gather(model.h) if has_row else 0.0) + max(0.0, gather(block.gather_width) - hidden_d)
                    + max(0.0, scatter(block.gather_width) - hidden_w))
        else:
            column, row = 0.0, reduce(model.h) if has_row else 0.0
            bwd += max(0.0, reduce(block.reduce_width) - (col_wgrad if ordered else 0.0))
        fwd += column + row
        parts[f"tp:{block.name}:column"], parts[f"tp:{block.name}:row"] = column, row
    if kind.mtp:
        op = reduce_scatter_time if cfg.sp else all_reduce_time
        fwd += collective(op, model.h)
        bwd += collective(op, model.h)
    if kind.is_moe and cfg.etp > 1:  # the experts under expert TP: an MLP block's exchanges, exposed, of its tokens
        width = model.moe_token_width
        parts["tp:experts"] = gather(width) + scatter(width) if cfg.sp else reduce(width)
        fwd += parts["tp:experts"]
        bwd += gather(width) + scatter(width) if cfg.sp else reduce(width)
    return fwd, bwd, parts
