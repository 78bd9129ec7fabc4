"""The calibrated cost model's terms against numbers worked out by hand: flash attention's backward
and head size, fp8 GEMMs and their casts, what TP communication Megatron hides behind which GEMM,
the cross entropy's bytes, fp8 and bf16-gradient memory, MoE grouped GEMMs and permutation,
sliding-window attention, and the host time hidden behind the GPU's work (or not, or removed by CUDA graphs).

The objects are the 64-wide synthetic GPT of tests/test_cost_terms.py; every expectation is derived
in its comment from literal numbers, not from the code under test.
"""

from __future__ import annotations

import dataclasses

import pytest
from test_cost_terms import GemmOnly, accelerator, close, memory_of, model

from nest_megatron.cost.activations import layer_activation_terms, logits_bytes
from nest_megatron.cost.collectives import Network, all_gather_time, reduce_scatter_time
from nest_megatron.cost.compute import RooflineCompute, head_dim_factor
from nest_megatron.cost.evaluate import (
    CROSS_ENTROPY_BYTES_PER_LOGIT,
    adam_step_bytes,
    context,
    estimate,
    pipeline_sends,
    stage_parts,
)
from nest_megatron.cost.host import layer_operators
from nest_megatron.cost.layer import (
    elementwise_bytes,
    layer_time,
    permutation_elements,
    quantisation_bytes,
)
from nest_megatron.cost.memory import model_state_bytes
from nest_megatron.cost.placement import compute_spans
from nest_megatron.cost.problem import Problem
from nest_megatron.cost.routing import dispatch_copies
from nest_megatron.cost.tables import stage_sums
from nest_megatron.fidelity.published import OPTIMIZERS
from nest_megatron.hardware.topology import Level, Topology
from nest_megatron.model.kinds import LayerKind
from nest_megatron.model.spec import Gemm, Numerics
from nest_megatron.parallel.config import ParallelConfig
from nest_megatron.parallel.ranks import GroupShape, identity_placement

DENSE, MOE = LayerKind(mlp="dense"), LayerKind(mlp="moe")


def with_numerics(m, **kw):
    return dataclasses.replace(m, numerics=Numerics(**kw))


# --- attention -----------------------------------------------------------------------------------

def test_attention_backward_is_two_and_a_half_forwards_at_head_dim_128():
    rc = RooflineCompute(accelerator(peak_flops=1e15, attention_efficiency=0.5))
    # 1e12 FLOP at 0.5 x 1e15 = 2 ms; the backward's five products: 2.5 x that
    assert rc.attention_time(1e12, 128) == close(2e-3)
    assert rc.attention_time(2.5e12, 128) == close(5e-3)


@pytest.mark.parametrize("head_dim, factor", [(32, 0.75), (64, 0.75), (128, 1.0), (256, 1.1), (512, 1.1),
                                              # log2(90.5) = 6.5: halfway from 64 to 128 -> 0.875
                                              (2 ** 6.5, 0.875)])
def test_head_dim_factor(head_dim, factor):
    assert head_dim_factor(head_dim) == pytest.approx(factor, rel=1e-12)


def test_small_heads_slow_attention_down():
    rc = RooflineCompute(accelerator(peak_flops=1e15, attention_efficiency=0.5))
    # head dim 64: 0.75 x the throughput -> 2 ms / 0.75
    assert rc.attention_time(1e12, 64) == close(2e-3 / 0.75)


def test_layer_prices_flash_backward_at_2_5_x():
    # GEMM-free compute: only attention costs time, 1 FLOP per 1e-12 s.
    class AttentionOnly(GemmOnly):
        def gemm_time(self, gemm):
            return 0.0

        def attention_time(self, flops, head_dim=128):
            return flops / 1e12

    m = model()
    cfg = ParallelConfig()
    topo = Topology("one", (Level("node", 1, 100e9, 1e-6),))
    spans = compute_spans(cfg, topo, identity_placement(1))
    lt = layer_time(m, cfg=cfg, kind=DENSE, spans=spans, net=Network.for_topology(topo), compute=AttentionOnly())
    # causal attention of the 64-wide model at s 32, b 1: 4 x 32 x 32 x 64 x 1/2 = 131,072 FLOP
    assert lt.fwd_compute == close(131_072 / 1e12)
    assert lt.bwd_compute == close(2.5 * 131_072 / 1e12)


def test_sliding_window_attends_to_about_the_window():
    full = model(seq_length=1024)
    windowed = model(seq_length=1024, window_size=128)
    every_other = model(seq_length=1024, window_size=128, window_attn_skip_freq=2)
    # full causal: s/2 = 512 keys per query; window 128: 128 (1 - 128 / 2048) = 120 keys (the first
    # 128 queries see fewer); every other layer full: (512 + 120) / 2 = 316
    assert full.mean_keys_per_query(1024, 0.5) == 512
    assert windowed.mean_keys_per_query(1024, 0.5) == pytest.approx(120.0)
    assert every_other.mean_keys_per_query(1024, 0.5) == pytest.approx(316.0)
    assert windowed.attention_flops(micro_batch=1, tp=1, cp=1) == pytest.approx(4 * 1024 * 120 * 64)


# --- fp8 -----------------------------------------------------------------------------------------

def test_fp8_gemm_runs_at_the_fp8_peak():
    acc = accelerator(peak_flops=1e15, gemm_efficiency=0.75, peak_fp8_flops=2e15, gemm_fp8_efficiency=0.6)
    g = Gemm("g", 128 * 33, 256 * 4, 8192)  # exactly one wave of 132 tiles
    flops = 2 * 128 * 33 * 256 * 4 * 8192
    assert RooflineCompute(acc).gemm_time(g) == close(flops / 0.75e15)
    assert RooflineCompute(acc, fp8=True).gemm_time(g) == close(flops / 1.2e15)
    # the output layer stays in bf16
    assert RooflineCompute(acc, fp8=True).with_bf16_gemms().gemm_time(g) == close(flops / 0.75e15)


def test_fp8_quantisation_bytes_per_recipe():
    m = model()
    gemms = m.layer_gemms(tokens=32, tp=1)
    # inputs [m, k]: qkv 32 x 64, proj 32 x 64, fc1 32 x 64, fc2 32 x 256 = 14,336 elements;
    # output gradients [m, n]: qkv 32 x 192, proj 32 x 64, fc1 32 x 256, fc2 32 x 64 = 18,432
    assert quantisation_bytes(m, gemms) == (0.0, 0.0)
    assert quantisation_bytes(with_numerics(m, fp8_recipe="delayed"), gemms) == (4 * 14_336, 4 * 18_432)
    # current scaling reads each tensor once more for its amax: 6 bytes an element
    assert quantisation_bytes(with_numerics(m, fp8_recipe="tensorwise"), gemms) == (6 * 14_336, 6 * 18_432)


def test_fp8_linears_keep_their_inputs_in_one_byte():
    m = model(hidden_dropout=0.0, attention_dropout=0.0)
    bf16 = layer_activation_terms(m, mbs=1, tp=1, sp=False, cp=1, kind=DENSE)
    fp8 = layer_activation_terms(with_numerics(m, fp8_recipe="delayed"), mbs=1, tp=1, sp=False, cp=1, kind=DENSE)
    # the inputs of QKV, the projection, FC1 and FC2 halve: 2 x 32 x 64 -> 32 x 64 (and FC2's 32 x 256)
    for term in ("qkv_input", "proj_input", "fc1_input", "fc2_input"):
        assert fp8[term] == bf16[term] / 2
    # what the norms and the activation keep does not
    for term in ("norm1_input", "norm2_input", "fc1_output", "qkv"):
        assert fp8[term] == bf16[term]


def test_fp8_caches_a_weight_copy_and_its_transpose():
    m = model(untie_embeddings_and_output_weights=True, position_embedding_type="rope")
    cfg = ParallelConfig(pp=3, zero=1, dp=1)
    bf16 = memory_of(m, cfg, stage=1, layers=1, num_microbatches=3, reserved_bytes=0)
    fp8 = memory_of(with_numerics(m, fp8_recipe="delayed"), cfg, stage=1, layers=1, num_microbatches=3, reserved_bytes=0)
    # one layer of 49,984 parameters: + 2 bytes each
    assert fp8.weights - bf16.weights == close(2 * 49_984)


# --- gradients and the loss ------------------------------------------------------------------------

def test_bf16_gradients_halve_memory_and_traffic():
    assert model_state_bytes(1000, zero=1, shards=4, grad_bytes=2) == (2000, 2000, 3000)
    m = model(num_layers=2, untie_embeddings_and_output_weights=True, position_embedding_type="rope")
    slow = Topology("slow", (Level("node", 1, 100e9, 1e-6), Level("net", 2, 1e9, 0.0)))
    problem = Problem(model=m, accelerator=accelerator(peak_flops=1e12), topology=slow, global_batch_size=2,
                      overlap_grad_reduce=False, overlap_param_gather=False)
    fp32 = estimate(problem, ParallelConfig(dp=2, zero=0), compute=GemmOnly())
    half = estimate(dataclasses.replace(problem, model=with_numerics(m, grad_reduce_in_bf16=True)),
                    ParallelConfig(dp=2, zero=0), compute=GemmOnly())
    # all-reduce of P = 231,168 parameters over the 1 GB/s pair: 2 x 1/2 x 4P / 1e9, then 2P
    params = 2 * 49_984 + 65_536 + 128 + 65_536
    assert fp32.breakdown["dp_grad_sync"] == close(4 * params / 1e9)
    assert half.breakdown["dp_grad_sync"] == close(2 * params / 1e9)


def test_optimizer_state_bytes_of_each_implementation():
    # Megatron's distributed optimizer: fp32 master + two fp32 moments = 12 B; NeMo 1.x's Apex
    # DistributedFusedAdam keeps the master's 16 low bits only (2 + 4 + 4 = 10), and with optim.dtype
    # bf16 two bf16 moments and no master (2 + 2 = 4), as PyTorch's Adam on AutoModel's bf16 parameters
    assert {name: Numerics(optimizer_dtypes=d).optimizer_state_bytes for name, d in OPTIMIZERS.items()} == \
        {"megatron": 12, "apex_remainders": 10, "apex_bf16": 4, "automodel": 4}
    # neither of the last two is Megatron's precision-aware optimizer (a master of its own): the bench prices them
    # under Megatron-FSDP too, where that optimizer is refused
    assert [d.megatron for d in OPTIMIZERS.values() if d is not None] == [True, False, False]
    # 1,000 parameters, distributed optimizer over 4: bf16 weights 2,000, fp32 grads 4,000, state 10 x 250
    assert model_state_bytes(1000, zero=1, shards=4, optimizer_bytes=10) == (2000, 4000, 2500)
    assert model_state_bytes(1000, zero=0, shards=4, optimizer_bytes=4) == (2000, 4000, 4000)
    # the Adam step reads the fp32 gradient (4), reads and writes the state, writes the bf16 weight (2)
    assert adam_step_bytes(12) == 4 + 24 + 2 == 30
    assert adam_step_bytes(4) == 4 + 8 + 2
    m = model(num_layers=2, untie_embeddings_and_output_weights=True, position_embedding_type="rope")
    problem = Problem(model=m, accelerator=accelerator(), topology=Topology("t", (Level("node", 2, 100e9, 1e-6),)),
                      global_batch_size=2)
    megatron = estimate(problem, ParallelConfig(dp=2, zero=1))
    apex_model = dataclasses.replace(m, numerics=Numerics(optimizer_dtypes=OPTIMIZERS["apex_bf16"]))
    apex = estimate(dataclasses.replace(problem, model=apex_model), ParallelConfig(dp=2, zero=1))
    # P = 231,168 parameters (two layers of 49,984, embedding and output layer of 65,536 + 128 and 65,536),
    # half of each shard on a device: 12 P / 2 against 4 P / 2 bytes
    params = 2 * 49_984 + 65_536 + 128 + 65_536
    assert megatron.memory[0].optimizer - apex.memory[0].optimizer == close(8 * params / 2)
    # the step at 3e12 x 0.8 B/s: 30 and 14 bytes for each of the P / 2 local parameters
    assert megatron.breakdown["optimizer"] == close(30 * params / 2 / 2.4e12)
    assert apex.breakdown["optimizer"] == close(14 * params / 2 / 2.4e12)


def test_each_pipeline_schedule_of_a_step_fills_and_drains_the_pipeline():
    """Problem.pipeline_runs (the fidelity bench's AutoModel rows: gradient accumulation as separate pipeline
    schedules): each schedule adds the bubble, (pp - 1) / vpp of the slowest stage's time per micro-batch; the
    micro-batches themselves are the same. At pp 2, vpp 1, 3 schedules: 2 bubbles more, 2 x 1 x the slowest stage."""
    m = model(num_layers=4, untie_embeddings_and_output_weights=True, position_embedding_type="rope")
    problem = Problem(model=m, accelerator=accelerator(), topology=Topology("t", (Level("node", 2, 100e9, 1e-6),)),
                      global_batch_size=8)
    cfg = ParallelConfig(pp=2, dp=1, zero=1)
    one = estimate(problem, cfg)
    three = estimate(dataclasses.replace(problem, pipeline_runs=3), cfg)
    slowest = max(one.stage_times)
    assert three.step_time - one.step_time == close(2 * 1 * slowest)
    assert three.breakdown["pipeline_bubble"] == close(3 * one.breakdown["pipeline_bubble"])
    assert one.breakdown["pipeline_bubble"] == close((2 - 1) / 1 * slowest)
    assert three.breakdown["compute"] == one.breakdown["compute"]  # 8 micro-batches either way


def test_cross_entropy_bytes_and_logits_kept():
    assert CROSS_ENTROPY_BYTES_PER_LOGIT == 38 + 14  # forward 6 + 4 + 8 + 8 + 4 + 8, backward 4 + 4 + 4 + 2
    m = model()  # vocab 1000 padded to 1024 at tp 1; 32 tokens
    assert logits_bytes(m, mbs=1, tp=1, cp=1) == 6 * 32 * 1024  # bf16 logits + fp32 softmax
    assert logits_bytes(with_numerics(m, cross_entropy_fusion=True), mbs=1, tp=1, cp=1) == 2 * 32 * 1024


# --- TP communication and what hides it --------------------------------------------------------------

def _tp_layer(overlap: bool, bandwidth: float, zero: int = 1):
    m = model(hidden_dropout=0.0, attention_dropout=0.0)
    cfg = ParallelConfig(tp=2, sp=True, zero=zero)
    topo = Topology("pair", (Level("node", 2, bandwidth, 0.0),))
    spans = compute_spans(cfg, topo, identity_placement(2))
    net = Network.for_topology(topo)
    lt = layer_time(m, cfg=cfg, kind=DENSE, spans=spans, net=net, compute=GemmOnly(), tp_comm_overlap=overlap)
    # the [32, 64] bf16 activation = 4,096 B; an all-gather or reduce-scatter over the pair: 1/2 x 4,096 / B
    collective = 0.5 * 4096 / bandwidth
    assert all_gather_time(GroupShape((2.0,)), 4096, net) == close(collective)
    assert reduce_scatter_time(GroupShape((2.0,)), 4096, net) == close(collective)
    return lt, collective


def test_tp_without_overlap_on_a_slow_link():
    # 1 MB/s: a collective takes 2.048 ms, far beyond any GEMM (the largest is 262,144 FLOP = 0.26 us at 1e12)
    lt, c = _tp_layer(False, 1e6)
    # forward: per block an all-gather and a reduce-scatter, exposed: 2 x 2c
    assert lt.fwd_comm == close(4 * c)
    # backward, per block: the row-parallel mirror (exposed), the column-parallel's input all-gather behind
    # its input-gradient GEMM and its reduce-scatter behind its weight-gradient GEMM: c + (c - g_d) + (c - g_w)
    # column GEMMs at tp 2 on 32 tokens: QKV [32, 96] x 64 -> 393,216 FLOP, FC1 [32, 128] x 64 -> 524,288 FLOP;
    # their dgrad and wgrad have the same FLOPs
    qkv, fc1 = 393_216 / 1e12, 524_288 / 1e12
    assert lt.bwd_comm == close(2 * 3 * c - 2 * (qkv + fc1))


def test_tp_backward_hides_nothing_without_ordered_streams():
    # Megatron-FSDP runs with CUDA_DEVICE_MAX_CONNECTIONS > 1: the backward's three collectives per block
    # are all exposed
    lt, c = _tp_layer(False, 1e6, zero=3)
    assert lt.bwd_comm == close(2 * 3 * c)


def test_tp_comm_overlap_hides_all_but_a_chunk_behind_a_longer_gemm():
    # 1 TB/s: a collective takes 2.048 ns, shorter than every GEMM it overlaps (>= 131,072 FLOP = 131 ns):
    # with userbuffers each is exposed for its first of tp = 2 chunks only
    lt, c = _tp_layer(True, 1e12)
    assert lt.fwd_comm == close(2 * 2 * c / 2)
    assert lt.bwd_comm == close(2 * 3 * c / 2)
    # without the overlap the forward's four collectives are all exposed
    plain, _ = _tp_layer(False, 1e12)
    assert plain.fwd_comm == close(4 * c)


class AttentionOnly(GemmOnly):
    """Only attention costs time: its FLOPs at 1e12 FLOP/s (one call per ring step, no launch time)."""

    def attention_time(self, flops: float, head_dim: int = 128) -> float:
        return flops / 1e12

    def gemm_time(self, gemm: Gemm) -> float:
        return 0.0


def _cp_ring_layer(bandwidth: float):
    m = model()
    cfg = ParallelConfig(cp=4)
    topo = Topology("ring", (Level("node", 4, bandwidth, 0.0),))
    net = Network.for_topology(topo)
    return layer_time(m, cfg=cfg, kind=DENSE, spans=compute_spans(cfg, topo, identity_placement(4)), net=net,
                      compute=AttentionOnly())


def test_cp_ring_hides_each_transfer_behind_one_step_s_attention_only():
    # s 32 over cp 4: 8 local queries, each over 16 keys (causal), 64 wide: 4 x 8 x 16 x 64 = 32,768 FLOP of
    # attention forward = 32.768 ns at 1e12, 8.192 ns a ring step; backward 2.5 x: 20.48 ns a step.
    # A K/V chunk: 2 B x 8 tokens x (64 + 64) = 2,048 B.
    # At 200 GB/s a chunk takes 10.24 ns, beyond a forward step: 3 transfers x (10.24 - 8.192) = 6.144 ns
    # exposed (the old pooled form, 3 x 10.24 - 32.768 < 0, hid it all behind the four steps).
    # Backward: steps 0 and 3 send one chunk (10.24 <= 20.48: hidden), steps 1, 2 two (20.48: just hidden).
    lt = _cp_ring_layer(200e9)
    assert lt.cp_comm == close(3 * (10.24e-9 - 8.192e-9))
    # at 100 GB/s: forward 3 x (20.48 - 8.192) = 36.864 ns; backward 2 x 0 + 2 x (40.96 - 20.48) = 40.96 ns
    lt = _cp_ring_layer(100e9)
    assert lt.cp_comm == close(36.864e-9 + 40.96e-9)


# --- MoE ---------------------------------------------------------------------------------------------

def test_experts_are_a_grouped_gemm_of_the_local_experts():
    m = model(num_experts=8, moe_router_topk=2, moe_ffn_hidden_size=128, swiglu=True)
    gemms = {g.name: g for g in m.layer_gemms(tokens=32, tp=1, ep=2, etp=1, kind=MOE)}
    # 32 tokens x top-2 = 64 routed rows on this rank's 8 / 2 = 4 experts: 16 rows each
    assert (gemms["expert_fc1"].m, gemms["expert_fc1"].n, gemms["expert_fc1"].k, gemms["expert_fc1"].count) == (16, 256, 64, 4)
    assert (gemms["expert_fc2"].m, gemms["expert_fc2"].n, gemms["expert_fc2"].k, gemms["expert_fc2"].count) == (16, 64, 128, 4)
    # a router that sends the busiest rank 1.5 x the mean: 24 rows per expert
    skewed = model(num_experts=8, moe_router_topk=2, moe_ffn_hidden_size=128, swiglu=True, moe_load_imbalance=1.5)
    assert {g.name: g for g in skewed.layer_gemms(tokens=32, tp=1, ep=2, kind=MOE)}["expert_fc1"].m == 24


def test_moe_permutation_bytes_by_dispatcher_and_fusion():
    dense_like = model(num_experts=8, moe_router_topk=2, moe_ffn_hidden_size=256, hidden_dropout=0.0)
    cfg = ParallelConfig()
    moe = elementwise_bytes(dense_like, tokens=32, cfg=cfg, kind=MOE)
    dense = elementwise_bytes(dense_like, tokens=32, cfg=cfg, kind=DENSE)
    # the MoE layer's FC1 / FC2 traffic is on 64 routed rows instead of 32 tokens: + 32 x 256 x 2 elements.
    # Megatron's alltoall, unfused, R = 64 copies of T = 32 tokens, 8 local experts, h = 64: permute 2R,
    # unpermute 3R + 3T, the chunks sorted by expert and back 4R: 128 + 288 + 256 = 672 rows of 64; bf16
    assert moe - dense == close(2 * (32 * 256 * 2 + 672 * 64))
    args = dict(tokens_sp=32, rows=64, local_experts=8)
    assert permutation_elements(dense_like, **args) == 672 * 64
    # fused (Transformer Engine's moe_permute / moe_unpermute): 2R + R + T + the sort 4R = 128 + 96 + 256
    assert permutation_elements(dense_like, **args, fused=True) == 480 * 64
    # one local expert: no sort; 2R + 3R + 3T = 128 + 192 + 96
    assert permutation_elements(dense_like, tokens_sp=32, rows=64, local_experts=1) == 416 * 64
    # DeepEP delivers T = R x copies / topk tokens and sorts nothing: fused, one copy a token (T = 32):
    # 128 + 64 + 32; unfused, two copies (T = 64): 128 + 192 + 192
    assert permutation_elements(dense_like, **args, dispatcher="deepep", copies=1.0, fused=True) == 224 * 64
    assert permutation_elements(dense_like, **args, dispatcher="deepep", copies=2.0) == 512 * 64


def test_allgather_dispatcher_gathers_the_group_s_tokens():
    m = model(num_experts=8, moe_router_topk=2, moe_ffn_hidden_size=128, hidden_dropout=0.0, attention_dropout=0.0)
    # megatron-core 0.7's allgather dispatcher, R = 64 copies, T = 32 tokens a rank, h = 64: the local copies
    # gathered (2R), weighted (2R), scattered into the zeroed gathered buffer (ep T + 3R), sorted by local expert
    # and back (4R). EP 2 (4 local experts): 448 + 64 + 256 = 768 rows; EP 8 (one local expert): 448 + 256 = 704
    assert permutation_elements(m, tokens_sp=32, rows=64, local_experts=4, dispatcher="allgather") == 768 * 64
    assert permutation_elements(m, tokens_sp=32, rows=64, local_experts=1, dispatcher="allgather") == 704 * 64
    cfg = ParallelConfig(ep=4, dp=4)
    topo = Topology("four", (Level("node", 4, 1e9, 0.0),))
    spans = compute_spans(cfg, topo, identity_placement(4))
    net = Network.for_topology(topo)
    alltoall = layer_time(m, cfg=cfg, kind=MOE, spans=spans, net=net, compute=GemmOnly())
    allgather = layer_time(m, cfg=cfg, kind=MOE, spans=spans, net=net, compute=GemmOnly(), dispatcher="allgather")
    # alltoall: 32 tokens x 2 copies x 64 x 2 B = 8,192 B, 3/4 of it to the three peers at 1 GB/s = 6.144 us,
    # dispatch and combine, forward and backward: 4 x 6.144 us
    assert alltoall.ep_comm == close(4 * 6.144e-6)
    # allgather: the group's 4 x 32 tokens, 16,384 B, gathered (3/4 of it arrives: 12.288 us) and the outputs
    # reduce-scattered in that size (12.288 us), forward and backward: 4 x 12.288 us
    assert allgather.ep_comm == close(4 * 12.288e-6)


def test_dispatch_copies_per_dispatcher_and_router():
    m = model(num_experts=8, moe_router_topk=2, moe_ffn_hidden_size=128)
    # Megatron's alltoall dispatcher sends a copy per routed expert
    assert dispatch_copies(m, 2) == 2.0
    # DeepEP sends once per destination rank. 8 experts, 4 a rank, 2 distinct chosen uniformly: a rank is
    # missed with C(4, 2) / C(8, 2) = 6 / 28, so 2 x (1 - 6/28) = 11/7 ranks
    assert dispatch_copies(m, 2, dispatcher="deepep") == close(11 / 7)
    # one expert a rank (ep 8): no two experts share a rank, 8 x (1 - C(7, 2) / C(8, 2)) = 8 x 7/28 = 2
    assert dispatch_copies(m, 8, dispatcher="deepep") == close(2.0)
    # AutoModel's FakeBalancedGate: token i to experts 2i, 2i + 1 (mod 8), always on one rank of 4 experts
    assert dispatch_copies(m, 2, dispatcher="deepep", router="fake_balanced") == 1.0
    # 12 experts, top-3, 3 ranks of 4: starts 0, 3, 6, 9 -> experts {0,1,2}: rank 0; {3,4,5}: ranks 0, 1;
    # {6,7,8}: ranks 1, 2; {9,10,11}: rank 2 -> (1 + 2 + 2 + 1) / 4 = 1.5
    m12 = model(num_experts=12, moe_router_topk=3, moe_ffn_hidden_size=128)
    assert dispatch_copies(m12, 3, dispatcher="deepep", router="fake_balanced") == 1.5
    # Qwen3-30B-A3B at EP 8 (128 experts, top-8, 16 a rank): one rank; GPT-OSS-120B at EP 64 (2 a rank, top-4): two
    qwen = model(num_experts=128, moe_router_topk=8, moe_ffn_hidden_size=128)
    assert dispatch_copies(qwen, 8, dispatcher="deepep", router="fake_balanced") == 1.0
    oss = model(num_experts=128, moe_router_topk=4, moe_ffn_hidden_size=128)
    assert dispatch_copies(oss, 64, dispatcher="deepep", router="fake_balanced") == 2.0


def test_ep_all_to_all_carries_the_dispatched_copies():
    m = model(num_experts=8, moe_router_topk=2, moe_ffn_hidden_size=128, hidden_dropout=0.0, attention_dropout=0.0)
    cfg = ParallelConfig(ep=2, dp=2)
    topo = Topology("pair", (Level("node", 2, 1e9, 0.0),))
    spans = compute_spans(cfg, topo, identity_placement(2))
    net = Network.for_topology(topo)
    topk = layer_time(m, cfg=cfg, kind=MOE, spans=spans, net=net, compute=GemmOnly())
    once = layer_time(m, cfg=cfg, kind=MOE, spans=spans, net=net, compute=GemmOnly(), ep_copies=1.0)
    # 32 tokens x 2 copies x 64 x 2 B = 8,192 B a device; half of it to the other rank at 1 GB/s: 4.096 us a
    # dispatch, as long a combine, in each of the forward and the backward: 4 x 4.096 us
    assert topk.ep_comm == close(4 * 4096 / 1e9)
    assert once.ep_comm == close(topk.ep_comm / 2)


# --- pipeline --------------------------------------------------------------------------------------

def test_interleaved_sends_hide_behind_the_next_chunk():
    m = model(num_layers=4)
    # 2 ranks on two devices joined by one level: 1 GB/s, 1 us. The boundary activation of one micro-batch
    # (32 tokens x 64 x bf16 = 4,096 B) takes 1e-6 + 4,096 / 1e9 = 5.096 us a send.
    for bandwidth, send in ((1e9, 1e-6 + 4096 / 1e9), (1e6, 1e-6 + 4096 / 1e6)):
        topo = Topology("two", (Level("link", 2, bandwidth, 1e-6),))
        problem = Problem(model=m, accelerator=accelerator(peak_flops=1e12), topology=topo, global_batch_size=4)
        cfg = ParallelConfig(pp=2, vpp=2, mbs=1)
        ctx = context(problem, cfg, compute=GemmOnly())
        sums = stage_sums(ctx.costs, cfg, (2, 2), 0)
        # a rank holds 2 chunks of 1 layer: forward 3.145728 us a chunk (GEMMs at 1e12), backward twice that
        chunk_fwd, chunk_bwd = 3.145728e-6, 2 * 3.145728e-6
        forward, backward = pipeline_sends(ctx, stage=0, sums=sums)
        assert forward == close(2 * max(1e-6, send - chunk_fwd))
        assert backward == close(2 * max(1e-6, send - chunk_bwd))
        # without the layers (a bound) only the latency of each chunk's send
        assert pipeline_sends(ctx, stage=0) == (2e-6, 2e-6)


# --- host time --------------------------------------------------------------------------------------

# The 64-wide GPT's layer issues 12 operators forward (4 GEMMs: qkv, proj, fc1, fc2; the attention kernel; 7
# memory-bound terms: norm1, residual1, dropout1, norm2, residual2, the GeLU, dropout2) and 16 backward (8 GEMMs,
# the attention backward, the 7 terms' backward). The embedding is 1 operator each way; the output layer 24 forward
# (final norm, logits GEMM, 22 of the cross entropy) and 9 backward (2 GEMMs, the norm, 6 of the cross entropy).
# Its GEMMs at 1e12 FLOP/s (GemmOnly), 32 tokens: forward 2 x 32 x 64 x (192 + 64 + 256 + 256) = 3,145,728 FLOPs
# = 3.145728 us a layer, backward twice that; the logits 2 x 32 x 1024 x 64 = 4.194304 us forward, twice backward.
LAYER_FWD_S, LAYER_BWD_S, LOGITS_S = 3.145728e-6, 2 * 3.145728e-6, 4.194304e-6


def host_problem(seconds_per_operator, *, devices=1, cuda_graphs=False):
    topo = Topology("t", (Level("node", devices, 1e9, 0.0),))
    return Problem(model=model(num_layers=4), accelerator=accelerator(host_overhead_s=seconds_per_operator),
                   topology=topo, global_batch_size=1, cuda_graphs=cuda_graphs)


def test_host_time_hides_behind_longer_gpu_work():
    # One device, one micro-batch: GPU 4 (3.145728 + 6.291456) + 3 x 4.194304 = 50.331648 us. The host issues
    # 4 (12 + 16) + (1 + 24) + (1 + 9) = 147 operators: at 0.1 us each 14.7 us, hidden behind the GPU's work.
    est = estimate(host_problem(0.1e-6), ParallelConfig(mbs=1), compute=GemmOnly())
    assert est.breakdown["host"] == 0.0
    assert est.step_time == close(4 * (LAYER_FWD_S + LAYER_BWD_S) + 3 * LOGITS_S)


def test_host_time_longer_than_the_gpu_work_is_paid_as_the_difference():
    # At 1 us an operator the host needs 147 us for what the GPU runs in 50.331648 us: the step waits 96.668352 us
    # for the host, and takes the host's 147 us.
    est = estimate(host_problem(1e-6), ParallelConfig(mbs=1), compute=GemmOnly())
    assert est.breakdown["host"] == close(147e-6 - 50.331648e-6)
    assert est.step_time == close(147e-6)


def test_cuda_graphs_make_each_layer_pass_one_operator():
    # With CUDA graphs a layer's forward and backward are one graph replay each: 4 x 2 + 25 + 10 = 43 operators,
    # 43 us at 1 us each, hidden behind the 50.331648 us of GPU work the eager run waited on (the test above).
    est = estimate(host_problem(1e-6, cuda_graphs=True), ParallelConfig(mbs=1), compute=GemmOnly())
    assert est.breakdown["host"] == 0.0
    # at 2 us an operator the eager operators of the embedding and the output layer (35) and the 8 replays show
    assert estimate(host_problem(2e-6, cuda_graphs=True), ParallelConfig(mbs=1),
                    compute=GemmOnly()).breakdown["host"] == close(86e-6 - 50.331648e-6)


def test_1f1b_synchronises_the_host_after_each_pipeline_transfer():
    # Two stages of 2 layers, 1F1B: each micro-batch's forward and backward are spans of their own
    # (p2p_communication.py batch_p2p_sync). The first stage issues 2 x 12 + 1 = 25 operators forward, 7.5 us at
    # 0.3 us each, for 2 x 3.145728 = 6.291456 us of GPU work: 1.208544 us exposed; backward 2 x 16 + 1 = 33,
    # 9.9 us, behind 12.582912 us: none. One span of both (interleaved) would hide all: 17.4 < 18.874368 us.
    problem = host_problem(0.3e-6, devices=2)
    for cfg, exposed in ((ParallelConfig(pp=2, mbs=1), 7.5e-6 - 2 * LAYER_FWD_S), (ParallelConfig(pp=2, vpp=2, mbs=1), 0.0)):
        ctx = context(dataclasses.replace(problem, global_batch_size=4), cfg, compute=GemmOnly())
        assert stage_parts(ctx, stage_sums(ctx.costs, cfg, (2, 2), 0), stage=0)["host"] == close(exposed)


def test_operators_count_tp_collectives_and_fp8_casts():
    # The 12 / 16 operators above; TP 2 with sequence parallel adds per block (attention, MLP) an all-gather and a
    # reduce-scatter forward, and the row's gather, the column's re-gather and its reduce-scatter backward: 16 / 22.
    # Without sequence parallel one all-reduce per block each way: 14 / 18. fp8 casts each GEMM's input forward
    # and its output gradient backward: 4 more each way.
    m = model(num_layers=4)
    assert layer_operators(m, ParallelConfig(mbs=1), DENSE) == (12, 16)
    assert layer_operators(m, ParallelConfig(tp=2, sp=True, mbs=1), DENSE) == (16, 22)
    assert layer_operators(m, ParallelConfig(tp=2, sp=False, mbs=1), DENSE) == (14, 18)
    assert layer_operators(with_numerics(m, fp8_recipe="delayed"), ParallelConfig(mbs=1), DENSE) == (16, 20)


def moe_host_problem(seconds_per_operator, *, cuda_graphs=False):
    m = model(num_layers=2, num_experts=4, moe_router_topk=1, moe_ffn_hidden_size=64, hidden_dropout=0.0,
              attention_dropout=0.0)
    return Problem(model=m, accelerator=accelerator(host_overhead_s=seconds_per_operator),
                   topology=Topology("t", (Level("node", 1, 1e9, 0.0),)), global_batch_size=1, cuda_graphs=cuda_graphs)


# A MoE layer of the 64-wide GPT, 4 experts, top 1, one device: 5 GEMMs forward (qkv, proj, the router, the experts'
# fc1 and fc2, one grouped GEMM each), the attention kernel, 6 memory-bound terms (norm1, residual1, norm2, residual2,
# the GeLU, the permutation) and the router's 12 operators: 24; backward 10 GEMMs, the attention, the 6 terms and 6 of
# the router: 23. Its GEMMs at 1e12 FLOP/s, 32 tokens: 2 x 32 x 64 x (192 + 64 + 4 + 64 + 64) = 1,589,248 FLOPs,
# 1.589248 us forward, twice that backward.
MOE_FWD_S = 1.589248e-6


def test_a_moe_layer_s_forward_waits_for_the_host_in_a_span_of_its_own():
    problem = moe_host_problem(0.1e-6)
    cfg = ParallelConfig(mbs=1)
    assert layer_operators(problem.model, cfg, MOE) == (24, 23)
    assert context(problem, cfg, compute=GemmOnly()).costs.sync_gpu_fwd[1] == close(MOE_FWD_S)
    # Its token counts go to the host before its exchange (token_dispatcher.py:921-958): the device is idle when the
    # host comes back, and the host needs 24 x 0.1 = 2.4 us for the layer's 1.589248 us of forward: 0.810752 us, and
    # 0.1 us for its first operator. The backward and the embedding and output layer are one span: 2 x 23 + 1 + 24 +
    # 1 + 9 = 81 operators, 8.1 us, behind 2 x 3.178496 + 3 x 4.194304 us of GPU work: none. Without the sync every
    # pass would be one span, 12.9 us behind 22.1184 us: no wait at all.
    est = estimate(problem, cfg, compute=GemmOnly())
    assert est.breakdown["host"] == close(2 * (2.4e-6 - MOE_FWD_S + 0.1e-6))
    # A full recompute runs each forward, and its wait, once more in the backward
    recomputed = estimate(problem, ParallelConfig(mbs=1, recompute="full"), compute=GemmOnly())
    assert recomputed.breakdown["host"] == close(4 * (2.4e-6 - MOE_FWD_S + 0.1e-6))
    # Under --overlap-moe-expert-parallel-comm the layer's forward is issued beside a backward (a2a_overlap.py), which
    # joins its span: 24 + 23 operators, 4.7 us, behind 3 x 1.589248 = 4.767744 us of GPU work: only the 0.1 us
    paired = context(problem, ParallelConfig(mbs=1, moe_a2a_overlap=True), compute=GemmOnly()).costs
    assert paired.sync_host_bwd[1] == 23 and paired.sync_gpu_bwd[1] == close(2 * MOE_FWD_S)
    assert paired.sync_wait[1] == close(0.1e-6)
    # With CUDA graphs a layer's forward is one replay, 0.1 us, behind its own work: only the first operator's 0.1 us
    graphed = estimate(moe_host_problem(0.1e-6, cuda_graphs=True), cfg, compute=GemmOnly())
    assert graphed.breakdown["host"] == close(2 * 0.1e-6)
    # A dense layer does not wait: the 64-wide GPT above at the same 0.1 us an operator shows none
    assert estimate(host_problem(0.1e-6), cfg, compute=GemmOnly()).breakdown["host"] == 0.0
