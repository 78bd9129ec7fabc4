"""Host time: the CPU's work of issuing a pass's operators, hidden behind the GPU work it has queued.

Megatron trains in eager PyTorch: a Python thread issues every operator (a kernel, a collective) and goes on
before the GPU has run it, so it runs ahead of the GPU. The GPU waits for the host only where the host needs
longer to issue a span's operators than the GPU needs to run them: a span costs max(host, GPU), and what the
step sees of the host is max(0, operators x seconds per operator - GPU time of the span). Large layers at a
large micro-batch hide it; a small model at micro-batch 1 does not.

Spans end where the host waits for the device. 1F1B without interleaving batches its pipeline transfers
(batch_p2p_comm = not overlap_p2p_comm, Megatron-LM training/arguments.py:1012 turns overlap off without
virtual stages) and synchronises the device after each (megatron/core/pipeline_parallel/
p2p_communication.py:421-424, batch_p2p_sync True by default, model_parallel_config.py:395): each
micro-batch's forward and backward are spans of their own. Without pipeline transfers, or interleaved
(the transfers overlapped, not synchronised), a micro-batch's forward and backward are one span.

A dropless MoE layer's forward waits on the host too: it needs its token counts there to size the exchange and the
expert GEMMs (megatron/core/transformer/moe at Megatron-LM d98e8a64: the alltoall dispatcher's
_maybe_dtoh_and_synchronize, token_dispatcher.py:921-958; the allgather dispatcher's .cpu(), :320; DeepEP's dispatch
returns its received counts as a host list, fused_a2a.py:108-113,138). Only the alltoall dispatcher with the
experts' input padded to capacity (--moe-pad-expert-input-to-capacity) knows them without the device: each expert
gets exactly its capacity, and its sync point stays "no_sync" (token_dispatcher.py:485-505 at megatron-core 0.16.1;
DeepEP refuses the padding, the allgather dispatcher copies its counts to the host all the same). So each other MoE
layer's forward is a span of its own (`synchronised_span`), which starts with the device idle; the rest of the
micro-batch's passes are one span as above. With --overlap-moe-expert-parallel-comm a layer's forward is issued
beside another micro-batch's backward (cost/a2a_overlap.py): the span holds both. The multi-token-prediction depths'
MoE layers stay in the micro-batch's span.

With CUDA graphs (--cuda-graph-impl local | transformer_engine, or the deprecated --enable-cuda-graph /
--external-cuda-graph: transformer_config.py:1049-1075) each layer's pass is one graph replay, one
operator for the host; the rest of the pass (embedding, output layer, loss) stays eager.

Operators per layer are counted from what the cost model prices (`layer_operators`): each GEMM (a grouped
GEMM one), its fp8 cast, each attention kernel, each memory-bound term (`layer.elementwise_terms`: a
norm, an activation, a residual add, a permutation), each TP / CP / EP collective; the backward runs two
GEMMs per GEMM, the attention backward, each memory-bound term's backward and the mirror collectives.
"""

from __future__ import annotations

import numpy as np

from nest_megatron.cost.layer import elementwise_terms, tp_blocks
from nest_megatron.model.kinds import LayerKind
from nest_megatron.model.spec import ModelSpec
from nest_megatron.parallel.config import ParallelConfig

# The router's operators besides its GEMM (megatron/core/transformer/moe/router.py TopKRouter.routing :746-838
# at d98e8a64: the score function, top-k, the routing map's scatter, the auxiliary load-balancing loss's
# token counts and products) and the dispatcher's preprocessing (token_dispatcher.py dispatch_preprocess
# :624-680: tokens per expert, the splits copied to the host): about 12 forward, 6 backward.
ROUTER_OPERATORS = (12, 6)
# Megatron's vocab-parallel cross entropy (megatron/core/tensor_parallel/cross_entropy.py at d98e8a64,
# _VocabParallelCrossEntropy.forward and the calculate_* helpers it calls): the fp32 cast, the max and its
# all-reduce, the subtraction, the target mask (3), the masked target (2) and its index_put, the arange, the
# predicted-logit gather, clone and index_put, exp, sum, two all-reduces, log, the loss's subtraction and the
# softmax division: 22 forward; the arange, the mask's cast and 1 - mask, the index_put and the product, the
# bf16 cast: 6 backward. Fused (--cross-entropy-loss-fusion) does fewer; counted alike.
CROSS_ENTROPY_OPERATORS = (22, 6)


def layer_operators(model: ModelSpec, cfg: ParallelConfig, kind: LayerKind, *, dispatcher: str = "alltoall",
                    permute_fusion: bool = False) -> tuple[int, int]:
    """(forward, backward) operators the host issues for one layer of `kind` and one micro-batch."""
    tokens = cfg.mbs * model.cfg.seq_length // cfg.cp
    gemms = model.layer_gemms(tokens=tokens, tp=cfg.tp, sp=cfg.sp, ep=cfg.ep, etp=cfg.etp, kind=kind)
    memory = len(elementwise_terms(model, tokens=tokens, cfg=cfg, kind=kind, dispatcher=dispatcher,
                                   permute_fusion=permute_fusion))
    # fp8: Transformer Engine quantises each linear's input (forward) and output gradient (backward), a grouped
    # GEMM's per expert (GroupedLinear's quantizers, one per GEMM); the router stays in bf16
    casts = sum(g.count for g in gemms if g.name != "router") if model.numerics.fp8_recipe is not None else 0
    attention = {"none": 0, "mamba": 1}.get(kind.mixer, cfg.cp)  # attention: a kernel per CP step; Mamba: its scan
    comm_fwd, comm_bwd = _collectives(model, cfg, kind)
    router_fwd, router_bwd = ROUTER_OPERATORS if kind.is_moe else (0, 0)
    forward = len(gemms) + casts + attention + memory + comm_fwd + router_fwd
    backward = 2 * len(gemms) + casts + attention + memory + comm_bwd + router_bwd
    return forward, backward


def _collectives(model: ModelSpec, cfg: ParallelConfig, kind: LayerKind) -> tuple[int, int]:
    """(forward, backward) collectives of one layer, as layer.py prices them: per TP block an all-gather and a
    reduce-scatter forward, the row's gather, the column's re-gather and reduce-scatter backward (with sequence
    parallel; else one all-reduce each way); the CP exchange; EP dispatch and combine each way."""
    fwd = bwd = 0
    if cfg.tp > 1:
        blocks = len(tp_blocks(model, kind)) + (1 if kind.is_moe and cfg.etp > 1 else 0) + (1 if kind.mtp else 0)
        fwd, bwd = (2 * blocks, 3 * blocks) if cfg.sp else (blocks, blocks)
    if cfg.cp > 1 and kind.mixer == "mamba":  # z, x, B, C, dt in and the output back (mamba_context_parallel.py:155-201)
        fwd, bwd = fwd + 6, bwd + 6
    elif cfg.cp > 1 and kind.mixer != "none":
        per_type = {"a2a": (4, 4), "all_gather": (2, 4)}  # Q, K, V, O / their gradients; K, V gathered (and dK, dV)
        cp_fwd, cp_bwd = per_type.get(cfg.cp_comm_type, (cfg.cp - 1, cfg.cp - 1))  # p2p: a transfer per ring step
        fwd, bwd = fwd + cp_fwd, bwd + cp_bwd
    if kind.is_moe and cfg.ep > 1:
        fwd, bwd = fwd + 2, bwd + 2
    return fwd, bwd


def head_operators(model: ModelSpec, cfg: ParallelConfig, *, first: bool, last: bool) -> tuple[int, int]:
    """(forward, backward) operators of the embedding (`first`: the lookup and its TP reduction) and of the output
    layer (`last`: the final norm, the logits GEMM, its TP gather, the cross entropy; once more per
    multi-token-prediction depth)."""
    tp_collective = 1 if cfg.tp > 1 else 0
    fwd = bwd = 0
    if first:
        fwd, bwd = 1 + tp_collective, 1 + tp_collective
    if last:
        heads = 1 + model.mtp_depths
        ce_fwd, ce_bwd = CROSS_ENTROPY_OPERATORS
        fwd += heads * (2 + tp_collective + ce_fwd)
        bwd += heads * (3 + tp_collective + ce_bwd)
    return fwd, bwd


def synchronises(kind: LayerKind, model: ModelSpec, *, dispatcher: str) -> bool:
    """Whether a layer's forward waits for the device before the host can go on: a MoE layer's, unless the alltoall
    dispatcher pads its experts' input to capacity."""
    padded = model.cfg.moe_pad_expert_input_to_capacity and dispatcher == "alltoall"
    return kind.is_moe and not padded


def synchronised_span(host, gpu, host_overhead_s):
    """Seconds the device waits in a span that starts idle, after the host has waited for it: at least the time to
    issue the first operator, and whatever more the host needs for the span than the device (a lower bound: the
    operators are taken as spread over the span alike). Elementwise on arrays."""
    return np.maximum(0.0, host - gpu) + host_overhead_s


def exposed_host_time(host_fwd, host_bwd, gpu_fwd, gpu_bwd, *, synchronised: bool):
    """Seconds one micro-batch waits for the host: a forward and a backward span each (`synchronised`: 1F1B's
    synchronised transfers between them), or one span of both. Elementwise on arrays (the DP's candidate stages)."""
    if synchronised:
        return np.maximum(0.0, host_fwd - gpu_fwd) + np.maximum(0.0, host_bwd - gpu_bwd)
    return np.maximum(0.0, host_fwd + host_bwd - gpu_fwd - gpu_bwd)
