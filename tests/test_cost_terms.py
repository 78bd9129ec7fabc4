"""Each cost term against a number worked out by hand.

Every expectation below is computed from literal numbers with its derivation in a comment; none
comes from the code under test. Objects are small and synthetic (a Topology of two or three
levels, a 64-wide transformer) so the arithmetic stays checkable on paper.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from nest_megatron.config.schema import ModelConfig
from nest_megatron.cost.activations import layer_activation_bytes, layer_activation_terms, logits_bytes
from nest_megatron.cost.collectives import (
    Network,
    all_gather_time,
    all_reduce_time,
    all_to_all_time,
    p2p_time,
    reduce_scatter_time,
)
from nest_megatron.cost.compute import RooflineCompute
from nest_megatron.cost.evaluate import estimate
from nest_megatron.cost.flops import megatron_model_flops
from nest_megatron.cost.layer import layer_time
from nest_megatron.cost.memory import in_flight_chunks, model_state_bytes, stage_memory
from nest_megatron.cost.placement import compute_spans
from nest_megatron.cost.problem import Problem
from nest_megatron.cost.tables import layer_costs, range_sums
from nest_megatron.hardware.accelerator import Accelerator
from nest_megatron.hardware.topology import Level, Topology
from nest_megatron.model.kinds import LayerKind
from nest_megatron.model.spec import Gemm, ModelSpec
from nest_megatron.parallel.config import ParallelConfig
from nest_megatron.parallel.ranks import GroupShape, group_shapes, identity_placement, rank_groups

DENSE, MOE = LayerKind(mlp="dense"), LayerKind(mlp="moe")

REL = 1e-12


def close(expected: float):
    return pytest.approx(expected, rel=REL, abs=1e-18)


# ------------------------------------------------------------------------------------------------
# Small synthetic objects
# ------------------------------------------------------------------------------------------------


def model(**overrides) -> ModelSpec:
    """A 64-wide GPT: 4 MHA heads of 16, 4h GeLU MLP, s 32, vocab 1000, LayerNorm, biases, dropout 0.1."""
    cfg = dict(
        name="t",
        num_layers=4,
        hidden_size=64,
        ffn_hidden_size=256,
        num_attention_heads=4,
        seq_length=32,
        vocab_size=1000,
    )
    cfg.update(overrides)
    return ModelSpec(ModelConfig(**cfg))


def memory_of(m, cfg, *, stage, layers, num_microbatches, reserved_bytes):
    """Memory of a pipeline rank holding the model's first `layers` layers (all alike here)."""
    costs = layer_costs(m, cfg, spans=None, net=None, compute=None)
    return stage_memory(m, cfg, range_sums(costs, cfg, 0, layers), first=stage == 0, last=stage == cfg.pp - 1,
                        in_flight=in_flight_chunks(cfg, stage=stage, num_microbatches=num_microbatches),
                        reserved_bytes=reserved_bytes, act_rebuilt=costs.act_rebuilt)


def accelerator(**overrides) -> Accelerator:
    acc = dict(
        name="acc",
        peak_flops=1e15,
        memory_bytes=80 * 2**30,
        hbm_bandwidth=3e12,
        gemm_efficiency=0.75,
        attention_efficiency=0.5,
        memory_bound_efficiency=0.8,
        reserved_memory_bytes=1000.0,
    )
    acc.update(overrides)
    return Accelerator(**acc)


class GemmOnly:
    """A compute model in which only GEMMs cost time: FLOPs at 1e12 FLOP/s, nothing else."""

    def gemm_time(self, gemm: Gemm) -> float:
        return gemm.flops / 1e12

    def attention_time(self, flops: float, head_dim: int = 128) -> float:
        return 0.0

    def memory_time(self, nbytes: float) -> float:
        return 0.0

    def with_bf16_gemms(self) -> "GemmOnly":
        return self


NET1 = Network(bandwidth=(450e9,), latency=(3e-6,))
NET2 = Network(bandwidth=(450e9, 50e9), latency=(3e-6, 6e-6))


# ------------------------------------------------------------------------------------------------
# 1. Collectives
# ------------------------------------------------------------------------------------------------


def test_reduce_scatter_all_gather_all_reduce_one_level():
    shape = GroupShape((8.0,))
    # ring reduce-scatter over 8 GPUs at 450 GB/s, 3 us a step: 7*3e-6 + 7/8 * 1e9 / 450e9
    rs = 7 * 3e-6 + 7 / 8 * 1e9 / 450e9
    assert rs == pytest.approx(0.0019654444444, rel=1e-9)  # 2.1e-5 + 1.9444444e-3
    assert reduce_scatter_time(shape, 1e9, NET1) == close(rs)
    assert all_gather_time(shape, 1e9, NET1) == close(rs)
    # all-reduce = reduce-scatter + all-gather
    assert all_reduce_time(shape, 1e9, NET1) == close(2 * rs)


def test_reduce_scatter_all_gather_all_reduce_two_levels():
    # 16 ranks = 8 per node x 2 nodes.
    shape = GroupShape((8.0, 2.0))
    # Phase 0, inside the node, 8 peers on 1 GB: 7*3e-6 + 7/8 * 1e9/450e9
    # Phase 1, across nodes, 2 peers on the 1e9/8 B shard:  1*6e-6 + 1/2 * 1.25e8/50e9
    phase0 = 7 * 3e-6 + 7 / 8 * 1e9 / 450e9
    phase1 = 1 * 6e-6 + 1 / 2 * 1.25e8 / 50e9  # = 6e-6 + 1.25e-3
    rs = phase0 + phase1
    assert rs == pytest.approx(0.0019654444444 + 0.001256, rel=1e-9)
    assert reduce_scatter_time(shape, 1e9, NET2) == close(rs)
    assert all_gather_time(shape, 1e9, NET2) == close(rs)
    assert all_reduce_time(shape, 1e9, NET2) == close(2 * rs)


def test_group_of_one_costs_nothing():
    assert all_reduce_time(GroupShape((1.0, 1.0)), 1e9, NET2) == 0.0
    assert all_to_all_time(GroupShape((1.0, 1.0)), 1e9, NET2) == 0.0


def test_all_to_all_one_level():
    # 8 ranks in a node, each holds 1 GB, 1/8 of it per member: 7/8 GB leaves each device,
    # over 450 GB/s, plus one latency: 7/8 * 1e9 / 450e9 + 3e-6
    expected = 7 / 8 * 1e9 / 450e9 + 3e-6
    assert all_to_all_time(GroupShape((8.0,)), 1e9, NET1) == close(expected)


def test_all_to_all_two_levels():
    # 16 ranks = 8 per node x 2 nodes; each holds 1.6 GB, 0.1 GB per member.
    # Node-local peers: 7 x 0.1 GB over 450 GB/s = 0.7e9/450e9 = 1.5556e-3 s
    # Remote peers:     8 x 0.1 GB over  50 GB/s = 0.8e9/50e9  = 1.6e-2 s  (the slowest level)
    # Levels run in parallel: max of the two, plus one latency per level crossed.
    local = 7 * 0.1e9 / 450e9
    remote = 8 * 0.1e9 / 50e9
    expected = max(local, remote) + 3e-6 + 6e-6
    assert expected == pytest.approx(0.016009, rel=1e-12)
    assert all_to_all_time(GroupShape((8.0, 2.0)), 1.6e9, NET2) == close(expected)


def test_all_to_all_efficiency_slows_the_all_to_all_only():
    # The two nodes of test_all_to_all_two_levels, the NIC level at all_to_all_efficiency 0.74 (the shipped
    # dgx_h100_superpod's): the remote 0.8 GB at 0.74 x 50 GB/s = 37 GB/s take 0.8e9 / 37e9 = 21.622 ms (16 ms at
    # line rate), still the slowest level; the node level keeps its 450 GB/s.
    two_nodes = Topology("two", (Level("node", 8, 450e9, 3e-6), Level("su", 2, 50e9, 6e-6, all_to_all_efficiency=0.74)))
    net = Network.for_topology(two_nodes)
    assert net.all_to_all_bandwidth == close((450e9, 37e9))
    assert all_to_all_time(GroupShape((8.0, 2.0)), 1.6e9, net) == close(0.8e9 / 37e9 + 3e-6 + 6e-6)
    # A ring collective over the same nodes reaches the line rate: reduce-scatter of 1.6 GB, 7/8 of it at 450 GB/s
    # in the node, then 1/2 of the 0.2 GB shard at 50 GB/s: 3.1111 ms + 2 ms, plus 7 x 3 us + 1 x 6 us.
    assert reduce_scatter_time(GroupShape((8.0, 2.0)), 1.6e9, net) == close(
        7 / 8 * 1.6e9 / 450e9 + 0.5 * 0.2e9 / 50e9 + 7 * 3e-6 + 6e-6)
    # Network built by hand (no efficiency given): the all-to-all runs at the bandwidth
    assert NET2.all_to_all_bandwidth == NET2.bandwidth


NET3 = Network(bandwidth=(450e9, 50e9, 50e9), latency=(3e-6, 6e-6, 1e-5))  # node, scalable unit, spine


def test_all_to_all_across_units_pays_the_nic_for_every_byte_that_leaves_the_node():
    # EP 64 = 8 GPUs a node x 8 nodes, each GPU holds 1.6 GB, 1/64 of it (25 MB) a member.
    # In one scalable unit (8, 8, 1): 7 x 25 MB stay in the node (0.175 GB / 450 GB/s = 0.389 ms); 56 x 25 MB =
    # 1.4 GB leave it through the NIC at 50 GB/s: 28 ms, the slowest level; 3 + 6 us of latency: 28.009 ms.
    packed = GroupShape((8.0, 8.0, 1.0))
    assert all_to_all_time(packed, 1.6e9, NET3) == close(1.4e9 / 50e9 + 3e-6 + 6e-6)
    # Over two units (8, 4, 2): 24 x 25 MB go to nodes of the unit and 32 x 25 MB = 0.8 GB to the other unit, but
    # those too leave through the NIC and the leaf: level 1's links carry 1.4 GB (28 ms), the spine's 0.8 GB (16 ms).
    # 28 ms + 3 + 6 + 10 us = 28.019 ms: slower than in one unit, not the 16 ms of the levels' own shares.
    spread = GroupShape((8.0, 4.0, 2.0))
    assert all_to_all_time(spread, 1.6e9, NET3) == close(1.4e9 / 50e9 + 3e-6 + 6e-6 + 1e-5)
    assert all_to_all_time(spread, 1.6e9, NET3) > all_to_all_time(packed, 1.6e9, NET3)


def test_p2p_time():
    # Across nodes: one latency plus bytes / bandwidth: 6e-6 + 1e8 / 50e9 = 2.006e-3
    assert p2p_time(1, 1e8, NET2) == close(6e-6 + 1e8 / 50e9)
    # Inside a node: 3e-6 + 1e8/450e9
    assert p2p_time(0, 1e8, NET2) == close(3e-6 + 1e8 / 450e9)
    # No boundary (level -1) or nothing to send: free.
    assert p2p_time(-1, 1e8, NET2) == 0.0
    assert p2p_time(1, 0, NET2) == 0.0


def _oversubscribed() -> Topology:
    return Topology(
        "t",
        (
            Level("node", 8, 450e9, 3e-6),
            Level("spine", 4, 50e9, 6e-6, oversubscription=2.0),
        ),
    )


def test_oversubscription_halves_that_levels_bandwidth():
    net = Network.for_topology(_oversubscribed())
    # Every device busy (u = 1), o = 2: 50e9 * min(1, 1/(2*1)) = 25e9; the node level is untouched.
    assert net.bandwidth == (450e9, 25e9)
    assert net.latency == (3e-6, 6e-6)


def test_oversubscription_with_a_quarter_of_devices_busy_is_capped_at_full_bandwidth():
    net = Network.for_topology(_oversubscribed(), busy_fraction=0.25)
    # min(1, 1/(2*0.25)) = min(1, 2) = 1: the full 50e9
    assert net.bandwidth == (450e9, 50e9)
    # Halfway: u = 0.75 -> min(1, 1/1.5) = 2/3 -> 33.33e9
    assert Network.for_topology(_oversubscribed(), busy_fraction=0.75).bandwidth[1] == close(50e9 / 1.5)


# ------------------------------------------------------------------------------------------------
# 2. Rank groups and the levels they span
# ------------------------------------------------------------------------------------------------


def test_rank_groups_by_hand():
    sizes = {"tp": 2, "cp": 1, "ep": 1, "dp": 2, "pp": 2}
    # tp-cp-ep-dp-pp: rank = tp + 2*dp + 4*pp.
    # dp groups: vary dp with (tp, pp) fixed, enumerated tp fastest: (0,0) (1,0) (0,1) (1,1)
    assert rank_groups("tp-cp-ep-dp-pp", sizes, "dp").tolist() == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert rank_groups("tp-cp-ep-dp-pp", sizes, "tp").tolist() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert rank_groups("tp-cp-ep-dp-pp", sizes, "pp").tolist() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    # tp-cp-ep-pp-dp: rank = tp + 2*pp + 4*dp.
    assert rank_groups("tp-cp-ep-pp-dp", sizes, "dp").tolist() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert rank_groups("tp-cp-ep-pp-dp", sizes, "pp").tolist() == [[0, 2], [1, 3], [4, 6], [5, 7]]


TWO_LEVELS = Topology("t2", (Level("node", 8, 450e9, 3e-6), Level("net", 4, 50e9, 6e-6)))
THREE_LEVELS = Topology(
    "t3", (Level("node", 8, 450e9, 3e-6), Level("rack", 2, 50e9, 6e-6), Level("spine", 2, 25e9, 1e-5))
)


def _spans(topology, **kw):
    cfg = ParallelConfig(**kw)
    return compute_spans(cfg, topology, identity_placement(cfg.world))


def test_tp8_groups_sit_inside_a_node():
    sizes = {"tp": 8, "cp": 1, "ep": 1, "dp": 2, "pp": 2}
    groups = rank_groups("tp-cp-ep-dp-pp", sizes, "tp")
    # 32 ranks, tp = 8 adjacent ranks = one node of 8; one node of each group at level 1.
    assert group_shapes(groups, np.arange(32), TWO_LEVELS) == [GroupShape((8.0, 1.0))]
    assert GroupShape((8.0, 1.0)).top_level == 0
    assert GroupShape((8.0, 1.0)).size == 8


def test_dp_and_pp_levels_depend_on_the_order_two_levels():
    # 32 devices = 8 per node x 4 nodes; tp=4, dp=4, pp=2.
    # tp-cp-ep-dp-pp: rank = t + 4d + 16p. A dp group {b, b+4, b+8, b+12} covers nodes 0,0,1,1:
    #   level 0: 4 devices in 2 nodes -> 2 per node; level 1: 2 nodes in 1 unit -> fan_in (2, 2).
    #   A pp pair {r, r+16} is 2 nodes apart -> boundary at level 1.
    s = _spans(TWO_LEVELS, tp=4, dp=4, pp=2, order="tp-cp-ep-dp-pp")
    assert s.tp == (GroupShape((4.0, 1.0)),)
    assert s.dp == (GroupShape((2.0, 2.0)),)
    assert s.pp_boundary_level == (1,)
    # tp-cp-ep-pp-dp: rank = t + 4p + 8d. A dp group {b, b+8, b+16, b+24} is one device in
    #   each of the 4 nodes -> (1, 4); a pp pair {r, r+4} sits in one node -> level 0.
    s = _spans(TWO_LEVELS, tp=4, dp=4, pp=2, order="tp-cp-ep-pp-dp")
    assert s.dp == (GroupShape((1.0, 4.0)),)
    assert s.pp_boundary_level == (0,)


def test_dp_and_pp_levels_depend_on_the_order_three_levels():
    # 32 devices = 8 per node x 2 nodes per rack x 2 racks; tp=8, dp=2, pp=2.
    # tp-cp-ep-dp-pp: rank = t + 8d + 16p. dp pair {r, r+8}: neighbouring nodes of one rack
    #   -> fan_in (1, 2, 1), top level 1 (rack); pp pair {r, r+16}: the two racks -> level 2.
    s = _spans(THREE_LEVELS, tp=8, dp=2, pp=2, order="tp-cp-ep-dp-pp")
    assert s.tp == (GroupShape((8.0, 1.0, 1.0)),)
    assert s.dp == (GroupShape((1.0, 2.0, 1.0)),)
    assert s.pp_boundary_level == (2,)
    # tp-cp-ep-pp-dp: rank = t + 8p + 16d. dp pair {r, r+16}: the two racks -> (1, 1, 2);
    #   pp pair {r, r+8}: two nodes of one rack -> level 1.
    s = _spans(THREE_LEVELS, tp=8, dp=2, pp=2, order="tp-cp-ep-pp-dp")
    assert s.dp == (GroupShape((1.0, 1.0, 2.0)),)
    assert s.pp_boundary_level == (1,)


def test_pp_boundary_levels_per_stage():
    # 32 devices = 8 x 2 x 2, tp=8, pp=4, dp=1: stage i is node i. Boundaries 0|1 and 2|3 are
    # inside a rack (level 1), 1|2 crosses racks (level 2).
    s = _spans(THREE_LEVELS, tp=8, pp=4)
    assert s.pp_boundary_level == (1, 2, 1)
    # 8 stages of 1 device each on 8 devices in one node: every boundary at level 0
    one_node = Topology("n", (Level("node", 8, 450e9, 3e-6),))
    assert _spans(one_node, pp=8).pp_boundary_level == (0,) * 7


# ------------------------------------------------------------------------------------------------
# 3. Roofline compute
# ------------------------------------------------------------------------------------------------


def test_gemm_time_compute_bound():
    rc = RooflineCompute(accelerator())
    # 4096^3 GEMM: 2*4096^3 = 1.37438953e11 FLOP at 0.75 * 1e15 -> 1.83251938e-4 s were it one full wave
    # after another; its 32 x 16 = 512 tiles of 128 x 256 take ceil(512 / 132) = 4 waves of 132 SMs, the
    # last a quarter empty: x 528 / 512 -> 1.88978561e-4 s.
    # bytes 2*(3*4096^2) = 1.00663296e8 at 0.8 * 3e12 -> 4.194304e-5 s: compute wins
    flops_time = 2 * 4096**3 / (0.75e15)
    waves_time = flops_time * 528 / 512
    bytes_time = 2 * 3 * 4096**2 / (0.8 * 3e12)
    assert waves_time > bytes_time
    assert rc.gemm_time(Gemm("g", 4096, 4096, 4096)) == close(waves_time)
    assert waves_time == pytest.approx(1.88978561e-4, rel=1e-7)


def test_gemm_time_wave_quantisation_and_launch():
    # 33 x 4 = 132 tiles fill one wave exactly; one more row makes a 34th tile row (136 tiles), which
    # needs a second wave: the time doubles for 1/4224 more work.
    rc = RooflineCompute(accelerator(kernel_overhead_s=5e-6))
    one_wave = rc.gemm_time(Gemm("g", 128 * 33, 256 * 4, 8192))  # 33 x 4 = 132 tiles
    two_waves = rc.gemm_time(Gemm("g", 128 * 33 + 1, 256 * 4, 8192))  # 34 x 4 = 136 tiles
    per_wave = 132 * 2 * 128 * 256 * 8192 / 0.75e15
    assert one_wave == close(per_wave + 5e-6)
    assert two_waves == close(2 * per_wave + 5e-6)
    # a grouped GEMM of 2 experts runs them concurrently on 2 of the 4 streams: 2 x 66 = 132 tiles, one wave, one
    # launch and tail
    assert rc.gemm_time(Gemm("g", 128 * 33, 256 * 2, 8192, count=2)) == close(per_wave + 5e-6)
    # 6 experts of 66 tiles: a round of 4 concurrent GEMMs, 264 tiles in 2 waves + 5 us, then the last 2, 132 tiles
    # in 1 wave + 5 us: 3 waves + 10 us (one launch of all 396 tiles would take 3 waves + 5 us)
    assert rc.gemm_time(Gemm("g", 128 * 33, 256 * 2, 8192, count=6)) == close(3 * per_wave + 10e-6)


def test_gemm_time_memory_bound():
    rc = RooflineCompute(accelerator())
    # m = 1 (a GEMV): 2*1*4096*4096 = 3.3554432e7 FLOP -> 4.47e-8 s;
    # bytes 2*(1*4096 + 4096*4096 + 1*4096) = 33,570,816 B at 2.4e12 B/s -> 1.398784e-5 s: memory wins
    flops_time = 2 * 4096 * 4096 / 0.75e15
    bytes_time = 2 * (4096 + 4096 * 4096 + 4096) / (0.8 * 3e12)
    assert bytes_time > flops_time
    assert rc.gemm_time(Gemm("g", 1, 4096, 4096)) == close(bytes_time)
    assert bytes_time == pytest.approx(1.398784e-5, rel=1e-9)
    # in fp8 the operands are 1 byte (the bf16 output stays 2): (4096 + 4096^2) + 2 x 4096 B at 2.4e12 B/s
    fp8 = RooflineCompute(accelerator(peak_fp8_flops=2e15, gemm_fp8_efficiency=0.6), fp8=True)
    assert fp8.gemm_time(Gemm("g", 1, 4096, 4096)) == close((4096 + 4096 * 4096 + 2 * 4096) / (0.8 * 3e12))


def test_attention_and_memory_time():
    rc = RooflineCompute(accelerator())
    # 1e12 FLOP at 0.5 * 1e15 = 2e-3 s; 2.4e9 B at 0.8 * 3e12 = 1e-3 s
    assert rc.attention_time(1e12) == close(2e-3)
    assert rc.memory_time(2.4e9) == close(1e-3)


# ------------------------------------------------------------------------------------------------
# 4. Parameter counts
# ------------------------------------------------------------------------------------------------


def gqa_model(**kw) -> ModelSpec:
    # h = 64, 8 heads of 8 -> q = 64; 2 query groups -> kv = 16; SwiGLU ffn 128; LayerNorm; biases.
    args = dict(num_attention_heads=8, num_query_groups=2, ffn_hidden_size=128, swiglu=True)
    args.update(kw)
    return model(**args)


def test_attention_params_gqa_with_biases():
    m = gqa_model()
    # QKV: 64 x (64 + 2*16) = 6144 weights + 96 bias; proj 64 x 64 = 4096 + 64 bias (row-parallel,
    # unsplit); input LayerNorm 2*64 = 128.  6144 + 96 + 4096 + 64 + 128 = 10528
    assert m.attention_params(1) == 6144 + 96 + 4096 + 64 + 128 == 10528
    # tp = 2: QKV 3072 + 48, proj 2048 + 64 (bias not split), norm 128 -> 5360
    assert m.attention_params(2) == 3072 + 48 + 2048 + 64 + 128 == 5360
    # No biases, RMSNorm (h = 64 weights): 6144 + 4096 + 64 = 10304
    assert gqa_model(add_bias_linear=False, normalization="RMSNorm").attention_params(1) == 10304


def test_mlp_and_layer_params_swiglu():
    m = gqa_model()
    # FC1 (gate + up): 64 x 2*128 = 16384 + 256 bias; FC2 128 x 64 = 8192 + 64 bias -> 24896
    assert m.dense_mlp_params(1) == 16384 + 256 + 8192 + 64 == 24896
    # tp = 2: 8192 + 128 + 4096 + 64 = 12480
    assert m.dense_mlp_params(2) == 12480
    # layer = attention (with its norm) + MLP + pre-MLP norm 128
    assert m.layer_params(tp=1) == (10528 + 24896 + 128, 0) == (35552, 0)
    assert m.layer_params(tp=2) == (5360 + 12480 + 128, 0)


def test_vocab_padding_and_embedding():
    m = model(vocab_size=1100)
    # multiple of 128*tp: tp=1 -> ceil(1100/128)*128 = 9*128 = 1152; tp=2 -> 5*256 = 1280;
    # tp=8 -> 2*1024 = 2048
    assert [m.padded_vocab(t) for t in (1, 2, 8)] == [1152, 1280, 2048]
    # embedding at tp=2: 1280*64/2 = 40960 word rows + 32*64 = 2048 learned positions (not split)
    assert m.embedding_params(2) == 40960 + 2048
    # RoPE: no position table
    assert model(vocab_size=1100, position_embedding_type="rope").embedding_params(2) == 40960


def test_output_layer_params_tied_and_untied():
    tied = model(vocab_size=1100)
    untied = model(vocab_size=1100, untie_embeddings_and_output_weights=True)
    norm = 2 * 64  # final LayerNorm
    # tied, one stage: the output layer is the embedding itself -> only the final norm
    assert tied.output_params(tp=2, pp=1) == norm
    # tied, pp > 1: the last stage keeps a copy of the word embedding, 1280*64/2 = 40960
    assert tied.output_params(tp=2, pp=4) == norm + 40960
    # untied: its own weight whatever pp
    assert untied.output_params(tp=2, pp=1) == norm + 40960
    assert untied.output_params(tp=1, pp=1) == norm + 1152 * 64


def test_llama3_70b_total_parameters():
    m = ModelSpec(
        ModelConfig(
            name="llama3_70b", num_layers=80, hidden_size=8192, ffn_hidden_size=28672, num_attention_heads=64,
            num_query_groups=8, seq_length=4096, vocab_size=128256, swiglu=True,
            untie_embeddings_and_output_weights=True, position_embedding_type="rope", normalization="RMSNorm",
            add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0,
        )
    )
    # per layer: attention 8192*(8192 + 2*1024) + 8192*8192 = 83,886,080 + 67,108,864 = 150,994,944
    #            MLP 3 * 8192 * 28672 = 704,643,072; two RMSNorms 2 * 8192 = 16,384
    layer = 8192 * (8192 + 2 * 1024) + 8192 * 8192 + 3 * 8192 * 28672 + 2 * 8192
    assert layer == 855_654_400
    # 128256 = 1002 * 128 is already padded; embedding and untied output 128256*8192 each; final norm
    total = 80 * layer + 2 * 128256 * 8192 + 8192
    assert total == 70_553_706_496
    dense, expert = m.layer_params(tp=1)
    assert expert == 0
    assert 80 * dense + m.embedding_params(1) + m.output_params(tp=1, pp=1) == total
    # Split over tp = 8: the layer weights divide evenly (no biases), norms are replicated; the
    # vocabulary is padded to a multiple of 128*8 = 1024: ceil(128256/1024) = 126 -> 129,024
    # -> 80 * (layer - 2*8192)/8 + 80*2*8192 + 2*129024*8192/8 + 8192
    per_rank = 80 * (layer - 2 * 8192) // 8 + 80 * 2 * 8192 + 2 * 129024 * 8192 // 8 + 8192
    assert per_rank == 80 * 106_971_136 + 2 * 132_120_576 + 8192
    assert 80 * m.layer_params(tp=8)[0] + m.embedding_params(8) + m.output_params(tp=8, pp=1) == per_rank


# ------------------------------------------------------------------------------------------------
# 5. Activations
# ------------------------------------------------------------------------------------------------


def korthikanti_gpt(**kw) -> ModelSpec:
    # s = 32, h = 64, a = 4, ffn = 4h = 256, GeLU, MHA, dropout 0.1, unfused bf16 softmax
    args = dict(attention_backend="unfused", attention_softmax_in_fp32=False)
    args.update(kw)
    return model(**args)


S, B, H, A = 32, 2, 64, 4
SBH = S * B * H  # 4096


def test_korthikanti_gpt_tp1():
    m = korthikanti_gpt()  # learned absolute positions, as their GPT
    terms = layer_activation_terms(m, mbs=B, tp=1, sp=False, cp=1, kind=DENSE)
    # Korthikanti et al. eq. 1: s b h (34 + 5 a s / h) = 4096 * (34 + 5*4*32/64) = 4096 * 44 = 180,224
    assert sum(terms.values()) == close(SBH * (34 + 5 * A * S / H))
    assert sum(terms.values()) == close(180_224)
    # The s^2 terms: softmax 2 a s^2 b, dropout mask + dropped probabilities 3 a s^2 b
    assert terms["softmax"] == close(2 * A * S * S * B)
    assert terms["attention_dropout"] == close(3 * A * S * S * B)
    # Q, K, V: views of the QKV output, which stays alive whole: 6 s b h (their "QK^T 4sbh + V 2sbh")
    assert terms["qkv"] == close(6 * SBH)


def test_rope_adds_the_new_q_and_k():
    m = korthikanti_gpt(position_embedding_type="rope")
    terms = layer_activation_terms(m, mbs=B, tp=1, sp=False, cp=1, kind=DENSE)
    # Q and K after RoPE are new tensors, 2 s b h each, beside the 6 s b h QKV output:
    # s b h (38 + 5 a s / h) = 4096 * 48 = 196,608
    assert terms["qkv"] == close(10 * SBH)
    assert sum(terms.values()) == close(196_608)


def test_korthikanti_gpt_tp_with_sequence_parallel_is_one_tth():
    m = korthikanti_gpt()
    full = SBH * (34 + 5 * A * S / H)
    for t in (2, 4):
        terms = layer_activation_terms(m, mbs=B, tp=t, sp=True, cp=1, kind=DENSE)
        assert sum(terms.values()) == close(full / t)


def test_korthikanti_gpt_tp_without_sequence_parallel():
    m = korthikanti_gpt()
    # Korthikanti eq. 2: without SP, the terms on the full hidden size stay whole: norm1,
    # qkv_input, norm2, fc1_input (2 sbh each) and the two 1-byte dropout masks (1 sbh each)
    # -> 10 sbh. Split by t: qkv 6, proj_input 2, fc1_output 8, fc2_input 8 -> 24 sbh / t, and the
    # 5 a s^2 b attention terms -> s b h * 5 a s / (h t).
    t = 4
    expected = SBH * (10 + 24 / t + 5 * A * S / (H * t))
    assert expected == 75_776  # 4096 * (10 + 6 + 2.5)
    terms = layer_activation_terms(m, mbs=B, tp=t, sp=False, cp=1, kind=DENSE)
    assert sum(terms.values()) == close(expected)


def test_selective_and_full_recompute():
    m = korthikanti_gpt()
    by_kind = layer_activation_bytes(m, mbs=B, tp=1, sp=False, cp=1, kind=DENSE)
    # selective drops exactly 5 a s^2 b = 5*4*32*32*2 = 40,960 (Korthikanti: 34 s b h remain)
    assert by_kind["none"] - by_kind["selective"] == close(5 * A * S * S * B)
    assert by_kind["selective"] == close(34 * SBH)
    # full keeps the layer input: 2 s b h = 8192
    assert by_kind["full"] == close(2 * SBH)
    # with SP over 4: everything / 4, the checkpoint too
    sp = layer_activation_bytes(m, mbs=B, tp=4, sp=True, cp=1, kind=DENSE)
    assert sp["selective"] == close(34 * SBH / 4)
    assert sp["full"] == close(2 * SBH / 4)
    # without SP, the checkpoint is whole
    assert layer_activation_bytes(m, mbs=B, tp=4, sp=False, cp=1, kind=DENSE)["full"] == close(2 * SBH)


def test_flash_attention_has_no_square_term():
    m = model()  # flash backend
    terms = layer_activation_terms(m, mbs=B, tp=1, sp=False, cp=1, kind=DENSE)
    assert "softmax" not in terms and "attention_dropout" not in terms
    # fp32 log-sum-exp per head and token: 4 * a * s * b = 4*4*32*2 = 1024
    assert terms["softmax_lse"] == close(4 * A * S * B)
    # Korthikanti's 34 s b h (Q, K, V = 6 s b h as the kernel keeps them) + the lse
    assert sum(terms.values()) == close(34 * SBH + 4 * A * S * B)


def test_unfused_gqa_keeps_repeated_k_and_v():
    # 8 heads of 8, 2 groups: q = 64, kv = 16. Unfused GQA repeats K and V to every head:
    # 3 x 2 T q = 6 T q = 6 * 64 tokens * 64 = 24,576 bytes (T = s b = 64)
    m = korthikanti_gpt(num_attention_heads=8, num_query_groups=2)
    terms = layer_activation_terms(m, mbs=B, tp=1, sp=False, cp=1, kind=DENSE)
    assert terms["qkv"] == close(6 * 64 * 64)
    # selective keeps them un-repeated: 2 T ((q + kv) + (q + 2 kv)) = 2*64*(80 + 96) = 22,528
    sel = layer_activation_terms(m, mbs=B, tp=1, sp=False, cp=1, kind=DENSE, modules=("core_attn",))
    assert sel["qkv"] == close(2 * 64 * (80 + 96))


def test_logits_bytes():
    # bf16 logits + fp32 softmax: 6 B x 64 tokens x 1024/2 vocab rows = 196,608
    assert logits_bytes(model(), mbs=2, tp=2, cp=1) == close(6 * 64 * 512)


# ------------------------------------------------------------------------------------------------
# 6. Memory
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "zero, per_param",
    [
        (0, 18.0),  # 2 + 4 + 12
        (1, 6 + 12 / 4),  # distributed optimizer over D = 4
        (2, 2 + 16 / 4),  # gradients too
        (3, 18 / 4),  # everything
    ],
)
def test_model_state_bytes(zero, per_param):
    w, g, o = model_state_bytes(1000, zero=zero, shards=4)
    assert w + g + o == close(per_param * 1000)


def test_model_state_bytes_split():
    # zero 1: bf16 weights 2 B, fp32 grads 4 B whole; Adam 12 B / 4
    assert model_state_bytes(1000, zero=1, shards=4) == (2000, 4000, 3000)


def test_in_flight_chunks_1f1b():
    cfg = ParallelConfig(pp=4)
    # stage i of p holds p - i micro-batches: 4, 3, 2, 1
    assert [in_flight_chunks(cfg, stage=i, num_microbatches=8) for i in range(4)] == [4, 3, 2, 1]
    # capped at m = 2
    assert [in_flight_chunks(cfg, stage=i, num_microbatches=2) for i in range(4)] == [2, 2, 2, 1]


def test_in_flight_chunks_interleaved():
    cfg = ParallelConfig(pp=4, vpp=2)
    # 2 (p - i - 1) + (v - 1) p + 1 = 2(3 - i) + 4 + 1 = 11 - 2i: 11, 9, 7, 5 (m v = 16 is no cap)
    assert [in_flight_chunks(cfg, stage=i, num_microbatches=8) for i in range(4)] == [11, 9, 7, 5]
    # m = 4 -> cap m v = 8: 8, 8, 7, 5
    assert [in_flight_chunks(cfg, stage=i, num_microbatches=4) for i in range(4)] == [8, 8, 7, 5]


def test_stage_memory_tiny_model_by_hand():
    # 4 layers, h 64, 4 MHA heads, GeLU ffn 256, s 32, vocab 1000 (-> 1024), LayerNorm, biases,
    # dropout 0.1, flash, tied embeddings. tp=2 + SP, pp=2, dp=2, mbs=2, zero 1, m = 4.
    m = model()
    cfg = ParallelConfig(tp=2, pp=2, dp=2, sp=True, mbs=2, zero=1)
    # One layer at tp=2: QKV 64*192/2 + 96 = 6240; proj 2048 + 64 = 2112; norm 128;
    # FC1 64*256/2 + 128 = 8320; FC2 8192 + 64 = 8256; norm 128 -> 25,184
    layer = 6240 + 2112 + 128 + 8320 + 8256 + 128
    assert layer == 25_184
    first = 2 * layer + 1024 * 64 // 2 + 32 * 64  # + words 32768 + positions 2048 = 85,184
    last = 2 * layer + 128 + 1024 * 64 // 2  # + final norm + tied copy of the words = 83,264
    # Activations of one layer, T = 64 tokens, T/t = 32 with SP, bytes:
    #   norm1, qkv_input, proj_input (2*64*64/2), norm2, fc1_input: 2*64*32 = 4096 each -> 20,480
    #   dropout masks 2*1*64*32 = 4096; QKV 2*64*192/2 = 12,288; lse 4*(4/2)*64 = 512
    #   fc1_output and fc2_input 2*64*256/2 = 16,384 each
    act = 5 * 4096 + 4096 + 12288 + 512 + 2 * 16384
    assert act == 70_144  # = (34 * 4096 + 1024) / 2
    # Stage 0 holds min(p - 0, m) = 2 micro-batches of 2 layers; stage 1 holds 1.
    # logits on the last stage: 6 B * 64 tokens * 1024/2 = 196,608; workspace 1000
    expected = {
        0: (2 * first, 4 * first, 12 * first / 2, 2 * 2 * act, 0.0, 1000.0),
        1: (2 * last, 4 * last, 12 * last / 2, 1 * 2 * act, 6 * 64 * 512, 1000.0),
    }
    assert sum(expected[0]) == 1_303_784
    assert sum(expected[1]) == 1_337_064
    for stage in (0, 1):
        got = memory_of(m, cfg, stage=stage, layers=2, num_microbatches=4, reserved_bytes=1000.0)
        assert (got.weights, got.grads, got.optimizer, got.activations, got.logits, got.workspace) == tuple(
            close(x) for x in expected[stage]
        )
        assert got.total == close(sum(expected[stage]))


def test_stage_memory_zero3_and_full_recompute():
    # Same model, one device (tp = pp = dp = 1), zero 3, full recompute, mbs = 2, m = 4.
    m = model()
    cfg = ParallelConfig(mbs=2, zero=3, recompute="full")
    # tp=1 layer: QKV 64*192 + 192 = 12480; proj 4160; norm 128; FC1 16640; FC2 16448; norm 128
    layer = 12480 + 4160 + 128 + 16640 + 16448 + 128
    assert layer == 49_984
    # all 4 layers, words 1024*64, positions 32*64, final norm (tied, pp = 1: no extra head)
    params = 4 * layer + 65536 + 2048 + 128
    # zero 3 over D = 1 keeps everything plus the gathered and prefetched layer: 2 * 2 B * layer
    weights = 2 * params + 2 * 2 * layer
    # full recompute keeps 2 s b h = 2*32*2*64 = 8192 per layer, 1 micro-batch in flight, plus
    # one layer's full activations while it is recomputed: 34 * 4096 + 1024 = 140,288
    activations = 4 * 8192 + 140_288
    got = memory_of(m, cfg, stage=0, layers=4, num_microbatches=4, reserved_bytes=0.0)
    assert got.weights == close(weights)
    assert got.grads == close(4 * params)
    assert got.optimizer == close(12 * params)
    assert got.activations == close(activations)
    assert got.logits == close(6 * 64 * 1024)


# ------------------------------------------------------------------------------------------------
# 7. Megatron's model FLOPs
# ------------------------------------------------------------------------------------------------


def test_megatron_model_flops_gpt():
    # tiny GPT: L 4, h 256, s 128, ffn 1024, 8 MHA heads, vocab 1024 (padded: 1024), batch 64.
    m = model(num_layers=4, hidden_size=256, ffn_hidden_size=1024, num_attention_heads=8, seq_length=128,
              vocab_size=1024)
    # per token: 12 L h ffn = 12*4*256*1024 = 12,582,912
    #            12 L h^2 (1 + 1 + s/h * 0.5) = 12*4*65536*2.25 = 7,077,888
    #            6 h V = 6*256*1024 = 1,572,864            -> 21,233,664
    per_token = 12 * 4 * 256 * 1024 + 12 * 4 * 256 * 256 * 2.25 + 6 * 256 * 1024
    assert per_token == 21_233_664
    # x B s = 64 * 128 = 8192 -> 173,946,175,488
    assert megatron_model_flops(m, batch_size=64, tp=1) == close(173_946_175_488)


def test_megatron_model_flops_gqa_swiglu_with_vocab_padding():
    # L 2, h 64, 8 heads (q = 64), 2 groups, SwiGLU ffn 128, s 32, vocab 1000 -> 1024 at tp = 2.
    m = gqa_model(num_layers=2)
    # per token: 12 L h (1.5 ffn) = 12*2*64*192 = 294,912
    #            12 L h^2 (1 + 2/8 + 32/64 * 0.5) = 12*2*4096*1.5 = 147,456
    #            6 h V = 6*64*1024 = 393,216               -> 835,584; x B s = 4*32
    assert megatron_model_flops(m, batch_size=4, tp=2) == close(835_584 * 128)


# ------------------------------------------------------------------------------------------------
# 8. The schedule: estimate() end to end
# ------------------------------------------------------------------------------------------------


def test_estimate_pp2_by_hand():
    # 2 devices in one node (100 GB/s, 1 us); GEMMs only, at 1e12 FLOP/s. Model: 4 layers, h 64,
    # s 32, 4 heads, ffn 256, vocab 1000 -> 1024, tied. tp = dp = 1, pp = 2, mbs 1, gbs 4 -> m = 4.
    topo = Topology("pair", (Level("node", 2, 100e9, 1e-6),))
    problem = Problem(model=model(), accelerator=accelerator(peak_flops=1e12), topology=topo, global_batch_size=4)
    cfg = ParallelConfig(pp=2, zero=1)
    # Layer forward GEMMs on T = 32 tokens: QKV 2*32*192*64 = 786,432; proj 2*32*64*64 = 262,144;
    # FC1 2*32*256*64 = 1,048,576; FC2 the same -> 3,145,728 FLOP = 3.145728e-6 s; backward 2x.
    fwd = 3_145_728 / 1e12
    stage0_compute = 2 * 3 * fwd  # 2 layers, fwd + bwd = 1.8874368e-5
    # Output layer on the last stage: 2*32*1024*64 = 4,194,304 FLOP, forward + 2 backward GEMMs
    stage1_compute = stage0_compute + 3 * 4_194_304 / 1e12  # 3.145728e-5
    # Boundary activation 2 B * 32 * 64 = 4096 B inside the node: 1e-6 + 4096/100e9 = 1.04096e-6;
    # stage 0 sends forward, stage 1 sends the gradient back: one transfer each per micro-batch.
    p2p = 1e-6 + 4096 / 100e9
    stage0, stage1 = stage0_compute + p2p, stage1_compute + p2p
    # After the pipeline: dp = 1 (no DP traffic), the optimizer is a memory op (free here), and the
    # tied word embedding's gradient goes between the two stages: 4 B * 1024*64 = 262,144 B
    # -> 1e-6 + 262144/100e9 = 3.62144e-6
    tied = 1e-6 + 262_144 / 100e9
    # (m + (p - 1)/v) x slowest stage + the tail = 5 * 3.249824e-5 + 3.62144e-6 = 1.6611264e-4
    step = (4 + 1) * stage1 + tied
    assert step == pytest.approx(1.6611264e-4, rel=1e-12)

    est = estimate(problem, cfg, compute=GemmOnly())
    assert est.num_microbatches == 4
    assert est.stage_times == (close(stage0), close(stage1))
    assert est.step_time == close(step)
    assert est.breakdown["compute"] == close(4 * stage1_compute)
    assert est.breakdown["pp_p2p"] == close(4 * p2p)
    assert est.breakdown["pipeline_bubble"] == close(stage1)
    assert est.breakdown["dp_grad_sync"] == close(tied)
    assert est.breakdown["dp_param_gather"] == 0.0
    assert est.breakdown["optimizer"] == 0.0
    assert sum(est.breakdown.values()) == close(step)
    # 4 sequences x 32 tokens per step
    assert est.tokens_per_s == close(128 / step)
    # Megatron FLOPs per token: 12*4*64*256 + 12*4*64*64*2.25 + 6*64*1024 = 1,622,016; x 128 tokens
    tflops = 1_622_016 * 128 / step / 2 / 1e12
    assert est.tflops_per_gpu == close(tflops)
    assert est.mfu == close(tflops * 1e12 / 1e12)  # peak 1e12 FLOP/s


def test_estimate_interleaved_schedule_identities():
    # A bigger case with the roofline: 32 devices (8 x 4), tp 2, pp 4, vpp 2, dp 4, m = 8.
    problem = Problem(model=model(num_layers=8), accelerator=accelerator(), topology=TWO_LEVELS, global_batch_size=32)
    cfg = ParallelConfig(tp=2, pp=4, dp=4, vpp=2, sp=True, zero=1)
    est = estimate(problem, cfg)
    m, p, v = 32 // 4, 4, 2
    assert est.num_microbatches == m
    tail = est.breakdown["dp_grad_sync"] + est.breakdown["dp_param_gather"] + est.breakdown["optimizer"]
    assert est.step_time == close((m + (p - 1) / v) * max(est.stage_times) + tail)
    assert est.breakdown["pipeline_bubble"] == close((p - 1) / v * max(est.stage_times))
    assert sum(est.breakdown.values()) == close(est.step_time)
    assert est.tokens_per_s == close(32 * 32 / est.step_time)
    assert est.mfu == close(est.tflops_per_gpu * 1e12 / 1e15)
    assert est.layers_per_stage == (2, 2, 2, 2)


# ------------------------------------------------------------------------------------------------
# 9. Regressions: the defects of the public reference artifact
# ------------------------------------------------------------------------------------------------


def test_network_costs_are_in_seconds():
    # The artifact added network seconds to compute milliseconds. Here everything is SI:
    # 1 GB at 50 GB/s is 0.02 s (+ 10 us latency), not 20.
    net = Network(bandwidth=(50e9,), latency=(1e-5,))
    assert p2p_time(0, 1e9, net) == close(0.02001)
    # and an 8192^3 GEMM on an H100 (989.4 TFLOP/s at 75%) is 1.53 ms = 1.53e-3 s:
    # 2 * 8192^3 / (989.4e12 * 0.75) = 1.4818e-3, in 16 waves of 132 tiles for its 64 x 32 = 2048: x 2112 / 2048
    h100 = accelerator(peak_flops=989.4e12, hbm_bandwidth=3.35e12)
    expected = 2 * 8192**3 / (989.4e12 * 0.75) * 2112 / 2048
    assert RooflineCompute(h100).gemm_time(Gemm("g", 8192, 8192, 8192)) == close(expected)
    assert 1.5e-3 < expected < 1.6e-3


def test_output_layer_is_not_in_every_transformer_layer():
    m = model(untie_embeddings_and_output_weights=True)
    # a layer's parameters have no vocabulary term: 49,984 (see test_stage_memory_zero3...)
    assert m.layer_params(tp=1) == (49_984, 0)
    # pp = 3 of 3 layers (one each): the middle stage holds one layer; the last one layer plus
    # the final norm and the 1024 x 64 output weight = 128 + 65,536 more
    cfg = ParallelConfig(pp=3, zero=0)
    mid = memory_of(m, cfg, stage=1, layers=1, num_microbatches=3, reserved_bytes=0)
    last = memory_of(m, cfg, stage=2, layers=1, num_microbatches=3, reserved_bytes=0)
    assert mid.weights == close(2 * 49_984)
    assert last.weights - mid.weights == close(2 * (128 + 65_536))


def test_optimizer_memory_is_counted():
    # zero 0: 18 B per parameter (bf16 weight 2, fp32 grad 4, Adam master + m + v 12)
    m = model(num_layers=3, position_embedding_type="rope", untie_embeddings_and_output_weights=True)
    cfg = ParallelConfig(pp=3, zero=0)
    mid = memory_of(m, cfg, stage=1, layers=1, num_microbatches=3, reserved_bytes=0)
    assert mid.optimizer == close(12 * 49_984)
    assert mid.weights + mid.grads + mid.optimizer == close(18 * 49_984)


# dp = 2 across a slow 1 GB/s link: nodes of 1 device, two nodes. The slow level has no latency
# so that the regression tests below see bandwidth terms only (latency: see the dense-model test at the end).
SLOW = Topology("slow", (Level("node", 1, 100e9, 1e-6), Level("net", 2, 1e9, 0.0)))


def test_zero3_communication_is_not_free():
    m = model(num_layers=2, position_embedding_type="rope", untie_embeddings_and_output_weights=True)
    problem = Problem(model=m, accelerator=accelerator(peak_flops=1e12), topology=SLOW, global_batch_size=8)
    zero1 = estimate(problem, ParallelConfig(dp=2, zero=1), compute=GemmOnly())
    zero3 = estimate(problem, ParallelConfig(dp=2, zero=3), compute=GemmOnly())
    assert zero3.step_time > zero1.step_time
    # By hand: params P = 2 layers * 49,984 + words 65,536 + (final norm 128 + output 65,536) = 231,168.
    # Per micro-batch ZeRO-3 reduce-scatters fp32 grads and all-gathers bf16 weights twice over a
    # pair across the 1 GB/s level: RS(4P) = 1/2 * 4P/1e9; AG(2P) = 1/2 * 2P/1e9
    params = 2 * 49_984 + 65_536 + 128 + 65_536
    assert params == 231_168
    scatter, gather = 0.5 * 4 * params / 1e9, 0.5 * 2 * params / 1e9  # 4.62336e-4, 2.31168e-4
    # The forward's gather hides behind the layers' forward (2 x 3.145728e-6 s), the backward's gather
    # and the reduce-scatter behind their backward (twice that); the rest is exposed, every micro-batch.
    forward = 2 * 3_145_728 / 1e12
    per_microbatch = (gather - forward) + (gather + scatter - 2 * forward)
    m_batches = 8 // 2
    assert zero3.breakdown["zero_comm"] == close(m_batches * per_microbatch)
    # Once a step: the first layer's gather before the first forward, the last one's reduce-scatter
    # after the last backward (one of the 2 layers' share each).
    assert zero3.breakdown["dp_param_gather"] == close(gather / 2)
    assert zero3.breakdown["dp_grad_sync"] == close(scatter / 2)


def test_backward_includes_the_weight_gradient_gemm():
    # GEMMs only: backward = input-gradient + weight-gradient GEMM = 2 x forward
    m = model()
    cfg = ParallelConfig()
    spans = compute_spans(cfg, SLOW, identity_placement(1))
    lt = layer_time(m, cfg=cfg, kind=DENSE, spans=spans, net=Network.for_topology(SLOW), compute=GemmOnly())
    # forward GEMMs on 32 tokens: 786,432 + 262,144 + 2 * 1,048,576 = 3,145,728 FLOP at 1e12
    assert lt.fwd_compute == close(3.145728e-6)
    assert lt.bwd_compute == close(2 * 3.145728e-6)


def test_full_recompute_is_one_extra_forward():
    m = model()
    problem = Problem(model=m, accelerator=accelerator(peak_flops=1e12), topology=SLOW, global_batch_size=4)
    none = estimate(problem, ParallelConfig(dp=1, recompute="none"), compute=GemmOnly())
    full = estimate(problem, ParallelConfig(dp=1, recompute="full"), compute=GemmOnly())
    # 4 micro-batches x 4 layers x one forward (3.145728e-6 s), not a forward + backward
    assert none.breakdown["recompute"] == 0.0
    assert full.breakdown["recompute"] == close(4 * 4 * 3.145728e-6)
    assert full.step_time - none.step_time == close(4 * 4 * 3.145728e-6)


def test_dp_gradient_sync_covers_every_stages_parameters():
    # pp = 3 (one layer each), dp = 2; order tp-cp-ep-pp-dp puts the dp pair {r, r+3} on two
    # nodes of 3 devices, across the 1 GB/s level. RoPE and untied output: stage 0 holds the layer
    # + 65,536 words, stage 1 the layer, stage 2 the layer + 128 + 65,536.
    topo = Topology("t", (Level("node", 3, 100e9, 1e-6), Level("net", 2, 1e9, 0.0)))
    m = model(num_layers=3, position_embedding_type="rope", untie_embeddings_and_output_weights=True)
    problem = Problem(model=m, accelerator=accelerator(peak_flops=1e12), topology=topo, global_batch_size=6,
                      overlap_grad_reduce=False, overlap_param_gather=False)
    cfg = ParallelConfig(pp=3, dp=2, zero=0, order="tp-cp-ep-pp-dp")
    est = estimate(problem, cfg, compute=GemmOnly())
    # all-reduce of fp32 grads over the pair: 2 * 1/2 * 4P / 1e9
    last = 2 * 0.5 * 4 * (49_984 + 128 + 65_536) / 1e9  # 4.62592e-4
    middle = 2 * 0.5 * 4 * 49_984 / 1e9  # 1.99936e-4
    assert last > middle
    assert est.breakdown["dp_grad_sync"] == close(last)
    assert est.levels["dp"] == 1 and est.levels["pp"] == 0


def test_overlapping_the_gradient_reduction_never_makes_the_step_slower():
    m = model(num_layers=2)
    cfg = ParallelConfig(dp=2, zero=0)
    on = Problem(model=m, accelerator=accelerator(), topology=SLOW, global_batch_size=2)
    off = replace(on, overlap_grad_reduce=False)
    exposed_on = estimate(on, cfg).breakdown["dp_grad_sync"]
    exposed_off = estimate(off, cfg).breakdown["dp_grad_sync"]
    # Overlap can only hide communication: exposed time with overlap <= without.
    assert exposed_on <= exposed_off


def test_a_dense_model_pays_no_expert_gradient_collective():
    # dp = 2 across a level with 10 us latency; dense model, zero 0, no overlap.
    topo = Topology("t", (Level("node", 1, 100e9, 1e-6), Level("net", 2, 1e9, 1e-5)))
    m = model(num_layers=2, position_embedding_type="rope", untie_embeddings_and_output_weights=True)
    problem = Problem(model=m, accelerator=accelerator(), topology=topo, global_batch_size=2,
                      overlap_grad_reduce=False, overlap_param_gather=False)
    est = estimate(problem, ParallelConfig(dp=2, zero=0))
    # one all-reduce of the 231,168 fp32 gradients over the pair: 2 * (1e-5 + 1/2 * 4P/1e9)
    params = 2 * 49_984 + 65_536 + 128 + 65_536
    assert est.breakdown["dp_grad_sync"] == close(2 * (1e-5 + 0.5 * 4 * params / 1e9))
