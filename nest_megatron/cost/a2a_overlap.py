"""Megatron's EP all-to-all overlap (--overlap-moe-expert-parallel-comm): what pairing a forward with a backward saves.

With the flag, megatron-core runs the steady state of its schedules as "combined 1F1B" steps (pipeline_parallel/
combined_1f1b.py at 0.16.1): the forward of one micro-batch and the backward of another advance together, layer by
layer, each layer cut into an attention node (attention, the pre-MLP norm, the router, the shared experts and the
token permutation), a dispatch, the experts, and a combine. The dispatches and combines run on a communication
stream beside the other micro-batch's computation, in the order of TransformerLayerSchedulePlan.run
(models/common/model_chunk_schedule_plan.py:190-262):

    communication: combine_bwd(B) | dispatch_fwd(F) -> dispatch_bwd(B) | combine_fwd(F)
    computation:   attn_fwd(F)    | experts_bwd(B)  -> experts_fwd(F)  | attn_bwd(B)

Each node waits for its own micro-batch's previous node: the experts' forward for its dispatch, the backward's
dispatch for the experts' input gradient (only that with --delay-wgrad-compute, which runs the weight gradient
after it; the whole backward without), the attention backward for that dispatch. Played out with c the time of
one dispatch or combine, the pair of layers takes

    max(c, A_f) + max(max(E_b, c) + E_f, max(c, E_d) + c) + max(c, A_b)

(A: the rest of the layer, forward and backward, with its TP and CP communication; E_f, E_b: the experts'
forward and backward, E_d of it the input gradient), where run one after the other they take
A_f + E_f + A_b + E_b + 4 c. `pair_saving` is the difference, at most the 4 c of EP communication.

The all-to-all's kernels hold SMs while they run, which the computation beside them loses: a computation of
time A that shares the device with a transfer of time c runs at 1 - s of its speed meanwhile (s: the transfer's
share of the SMs) and ends at max(c, A + s c). The share is the SMs megatron-core gives the dispatcher's kernels:
DeepEP's moe_deepep_num_sms, 20 (transformer_config.py:722 at 0.16.1), of the accelerator's SMs (H100: 132). NCCL's
all-to-all takes as many channels, one SM each, as its tuning picks for the group: DeepEP's 20 stand in for it.

Only paired passes save it: the warm-up forwards and the cool-down backwards run alone. Without pipelining the
first forward and the last backward (combined_1f1b_schedule_for_no_pipelining); with virtual stages (the flag
needs them for pp > 1, transformer_config.py:1857-1861) the first rank's warm-up, 2 (pp - 1) + (vpp - 1) pp + 1
model chunks (schedules.py:773-779: one more than without the flag), and as many in the cool-down.
"""

from __future__ import annotations

from nest_megatron.cost.layer import LayerTime

# The SMs the all-to-all's kernels hold beside the computation (module docstring)
DISPATCH_SMS = 20


def dispatch_sm_share(sm_count: int) -> float:
    """The share of an accelerator's `sm_count` SMs the all-to-all's kernels hold."""
    return DISPATCH_SMS / sm_count


def pair_saving(lt: LayerTime, *, delay_wgrad: bool, sm_share: float = 0.0) -> float:
    """Seconds one layer of `lt`'s kind saves when its forward is paired with another micro-batch's backward of a
    layer like it, each computation beside an all-to-all slowed by `sm_share` of its time (module docstring); 0
    for a layer without EP communication. With `sm_share` 0, the most it can save."""
    if not lt.ep_comm:
        return 0.0
    c = lt.ep_comm / 4  # ep_comm: a dispatch and a combine, forward and backward
    slowed = sm_share * c  # what a computation beside one all-to-all loses
    experts_bwd = lt.experts_dgrad + lt.experts_wgrad
    attn_fwd = lt.fwd - lt.experts_fwd - 2 * c
    attn_bwd = lt.bwd - experts_bwd - 2 * c
    gate = lt.experts_dgrad if delay_wgrad else experts_bwd  # what the backward's dispatch waits for
    middle = max(max(experts_bwd + slowed, c) + lt.experts_fwd + slowed, max(c, gate + slowed) + c)
    paired = max(c, attn_fwd + slowed) + middle + max(c, attn_bwd + slowed)
    return max(0.0, lt.fwd + lt.bwd - paired)


def unpaired_microbatches(pp: int, vpp: int, num_microbatches: int) -> float:
    """Micro-batches whose forward and backward run alone on the first pipeline rank, in whole micro-batches of the
    rank's layers (a model chunk is 1 / vpp of them)."""
    if pp == 1:
        return min(1.0, num_microbatches)
    warmup_chunks = 2 * (pp - 1) + (vpp - 1) * pp + 1
    return min(warmup_chunks / vpp, num_microbatches)
