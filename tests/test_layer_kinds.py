"""Layer kinds (model/kinds.py): multi-head latent attention, MoE layer patterns, multi-token prediction and
group-limited routing, each worked out by hand on a small shape; Megatron's FLOPs for them; the argv, Hydra and
emitted forms; DeepSeek-V3- and Kimi-K2-shaped models priced by `evaluate`.

The traced-vs-analytic checks (meta-device megatron-core models) are in tests/test_trace.py, group-limited routing
against megatron-core's own router in tests/test_routing_trace.py, the rules against megatron-core's config classes in
tests/test_megatron_rules.py.
"""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest

from nest_megatron import api
from nest_megatron.config.load import load
from nest_megatron.config.megatron_argv import model_values, scan
from nest_megatron.config.schema import ModelConfig
from nest_megatron.cost.activations import layer_activation_bytes, layer_activation_terms, logits_bytes
from nest_megatron.cost.collectives import Network, routed_all_to_all_time
from nest_megatron.cost.evaluate import groups_and_network
from nest_megatron.cost.flops import megatron_model_flops
from nest_megatron.cost.layer import elementwise_terms, layer_time, tp_blocks
from nest_megatron.cost.routing import deepep_level_copies, dispatch_copies, experts_hit_probability
from nest_megatron.cost.tables import layer_costs
from nest_megatron.emit.megatron import model_args, moe_layer_freq_arg
from nest_megatron.errors import NestError
from nest_megatron.model.kinds import LayerKind
from nest_megatron.model.layer_graph import LayerGraph
from nest_megatron.model.spec import ModelSpec
from nest_megatron.parallel.config import ParallelConfig
from nest_megatron.parallel.ranks import GroupShape

MLA_DENSE, MLA_MOE = LayerKind("mla", "dense"), LayerKind("mla", "moe")
SMALL = ["cluster=dgx_h100_superpod", "cluster.num_devices=8", "train.global_batch_size=16"]


def mla_model(**overrides) -> ModelSpec:
    """h 64, 4 heads, query latent 32, KV latent 16, per head qk 8 + RoPE 4 and v 8; 16 tokens; RMSNorm, no
    biases, --qk-layernorm, SwiGLU 128, fused (flash) attention, no dropout."""
    fields = dict(name="mla", num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, seq_length=16,
                  vocab_size=128, swiglu=True, normalization="RMSNorm", add_bias_linear=False, hidden_dropout=0.0,
                  attention_dropout=0.0, position_embedding_type="rope", untie_embeddings_and_output_weights=True,
                  qk_layernorm=True, multi_latent_attention=True, q_lora_rank=32, kv_lora_rank=16, qk_head_dim=8,
                  qk_pos_emb_head_dim=4, v_head_dim=8)
    return ModelSpec(ModelConfig(**{**fields, **overrides}))


# ------------------------------------------------------------------------------------------------
# Multi-head latent attention
# ------------------------------------------------------------------------------------------------
def test_mla_parameters_by_hand():
    m = mla_model()
    # TP 1: input norm 64; q_down 64 x 32 = 2,048; q_up 32 x 4 heads x (8 + 4) = 1,536; q_layernorm 32;
    # kv_down 64 x (16 + 4) = 1,280; kv_up 16 x 4 x (8 + 8) = 1,024; kv_layernorm 16; proj 4 x 8 x 64 = 2,048.
    assert m.mla_params(1) == 64 + 2048 + 1536 + 32 + 1280 + 1024 + 16 + 2048 == 8048
    # + the dense SwiGLU MLP: fc1 64 x 256, fc2 128 x 64, its norm 64
    assert m.layer_params(tp=1, kind=MLA_DENSE) == (8048 + 16384 + 8192 + 64, 0)
    # TP 2, Transformer Engine: the down projections and the latent norms on every rank, the rest halved:
    # 64 + 2,048 + 768 + 32 + 1,280 + 512 + 16 + 1,024
    assert m.mla_params(2) == 5744
    # megatron-core's local spec splits the down projections too: 2,048 / 2 and 1,280 / 2
    assert mla_model(transformer_impl="local").mla_params(2) == 5744 - 1024 - 640
    # no query latent: linear_q_proj 64 x 48 instead of q_down, q_up and q_layernorm
    assert mla_model(q_lora_rank=None).mla_params(1) == 8048 - 2048 - 1536 - 32 + 64 * 48
    # TE's duplicated down projections are all-reduced over TP under sequence parallel: 2,048 + 1,280 a layer
    assert m.tp_replicated_params(MLA_DENSE, 2) == 3328 and m.tp_replicated_params(MLA_DENSE, 1) == 0


def test_mla_gemms_and_attention_flops_by_hand():
    m = mla_model()
    gemms = {g.name: g for g in m.layer_gemms(tokens=16, tp=1, kind=MLA_DENSE)}
    # forward FLOPs 2 m n k: q_down 2 x 16 x 32 x 64, q_up 2 x 16 x 48 x 32, kv_down 2 x 16 x 20 x 64,
    # kv_up 2 x 16 x 64 x 16, proj 2 x 16 x 64 x 32
    mixer = {"q_down": 65536, "q_up": 49152, "kv_down": 40960, "kv_up": 32768, "proj": 65536}
    assert {name: gemms[name].flops for name in mixer} == mixer
    # attention: 2 FLOP x b 1 x 16 queries x 8 keys (causal) x (query/key 4 x 12 + value 4 x 8)
    assert m.attention_flops(micro_batch=1, tp=1, cp=1, kind=MLA_DENSE) == 2 * 16 * 8 * (48 + 32) == 20480
    # TP 2 with sequence parallel: the duplicated down projections on the 8-token shard, the rest on 16 tokens
    tp2 = {g.name: (g.m, g.n, g.k) for g in m.layer_gemms(tokens=16, tp=2, sp=True, kind=MLA_DENSE)}
    assert tp2["q_down"] == (8, 32, 64) and tp2["kv_down"] == (8, 20, 64) and tp2["q_up"] == (16, 24, 32)
    assert {g.name: (g.m, g.n) for g in m.layer_gemms(tokens=16, tp=2, sp=False, kind=MLA_DENSE)}["q_down"] == (16, 32)


def test_mla_activations_by_hand():
    m = mla_model()
    terms = layer_activation_terms(m, mbs=1, tp=1, sp=False, cp=1, kind=MLA_DENSE)
    # bf16 over T = 16 tokens: the layer input and the normed input 2 x 64 x 16 each; the query latent and its norm
    # 2 x 32 x 16 each; the KV down projection's output 2 x 20 x 16, the KV latent's norm 2 x 16 x 16; Q, K, V
    # 2 x 16 x (2 x 48 + 32); the attention output 2 x 16 x 32; flash attention's fp32 log-sum-exp 4 x 4 heads x 16
    mixer = {"norm1_input": 2048, "mla_down_input": 2048, "q_latent": 1024, "q_latent_norm": 1024, "kv_latent": 640,
             "kv_latent_norm": 512, "qkv": 4096, "proj_input": 1024, "softmax_lse": 256}
    assert {k: terms[k] for k in mixer} == mixer
    # the dense SwiGLU MLP: its norm's and FC1's input 2 x 64 x 16 each, FC1's output 2 x 16 x 256, FC2's 2 x 16 x 128
    assert {k: v for k, v in terms.items() if k not in mixer} == {"norm2_input": 2048, "fc1_input": 2048,
                                                                  "fc1_output": 8192, "fc2_input": 4096}
    by_setting = layer_activation_bytes(m, mbs=1, tp=1, sp=False, cp=1, kind=MLA_DENSE)
    # offloaded, each tensor in a pinned buffer rounded up to a power of two: the KV latent 640 -> 1024, Q and K
    # 2 x 16 x 48 = 1536 -> 2048 each, V 2 x 16 x 32 = 1024; every other term is one already
    pinned = 12672 + 16384 + (1024 - 640) + (2 * 2048 + 1024 - 4096)
    assert by_setting == pytest.approx({"none": 12672 + 16384, "selective": 12672 - 256 + 16384, "full": 2048,
                                        "pinned": pinned})
    # sequence parallel over TP 2 shards what is h-wide or on the latents (T_sp = 8), TP splits the heads
    sp = layer_activation_terms(m, mbs=1, tp=2, sp=True, cp=1, kind=MLA_DENSE)
    assert (sp["q_latent"], sp["kv_latent"], sp["qkv"], sp["proj_input"]) == (512, 320, 2048, 512)


def test_mla_tp_and_cp_communication_widths():
    m = mla_model()
    (mla, mlp) = tp_blocks(m, MLA_DENSE)
    # the up projections read the gathered latents and the one RoPE key: 32 + 16 + 4 wide; without SP their input
    # gradient is all-reduced over the latents, 32 + 16
    assert (mla.column, mla.row, mla.gather_width, mla.reduce_width) == (("q_up", "kv_up"), "proj", 52, 48)
    assert (mlp.column, mlp.gather_width) == (("fc1",), 64)
    no_q_latent = tp_blocks(mla_model(q_lora_rank=None), MLA_DENSE)[0]
    assert (no_q_latent.column, no_q_latent.gather_width) == (("q_proj", "kv_up"), 64 + 16 + 4)
    # CP passes each head's K (8 + 4) and V (8): 4 x 12 + 4 x 8 per token
    assert m.cp_kv_width(MLA_DENSE) == 80


def test_mla_memory_bound_bytes_by_hand():
    m = mla_model()
    cfg = ParallelConfig(tp=1, mbs=1)
    terms = elementwise_terms(m, tokens=16, cfg=cfg, kind=MLA_DENSE)
    # the latent norms read and write 2 x 16 x (32 + 16); Q, K, V assembled: q read and written 2 x 16 x 48,
    # the KV up output read 16 x 64 with the RoPE key 16 x 4, K written 16 x 48 and V 16 x 32 -- all bf16
    assert terms["mla_latent_norms"] == 2 * 2 * 16 * 48
    assert terms["mla_assembly"] == 2 * (2 * 16 * 48 + 16 * 64 + 16 * 4 + 16 * 48 + 16 * 32)


# ------------------------------------------------------------------------------------------------
# MoE layer patterns
# ------------------------------------------------------------------------------------------------
def test_moe_layer_freq_int_and_list():
    every_other = ModelSpec(ModelConfig(name="m", num_layers=4, hidden_size=64, ffn_hidden_size=128,
                                        num_attention_heads=4, seq_length=16, vocab_size=128, num_experts=4,
                                        moe_layer_freq=2))
    assert [k.mlp for k in every_other.layer_kinds] == ["moe", "dense", "moe", "dense"]
    first_dense = ModelSpec(ModelConfig(**{**vars(every_other.cfg), "moe_layer_freq": [0, 0, 1, 1]}))
    assert [k.mlp for k in first_dense.layer_kinds] == ["dense", "dense", "moe", "moe"]
    assert first_dense.kinds == (LayerKind(mlp="dense"), LayerKind(mlp="moe"))


def test_pattern_prefix_sums_per_kind():
    """The tables lay each kind's costs out per layer: the prefix of the parameters counts the dense layers' and
    the MoE layers' each."""
    m = ModelSpec(ModelConfig(name="m", num_layers=5, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                              seq_length=16, vocab_size=128, num_experts=4, moe_layer_freq=[0, 0, 1, 1, 1]))
    cfg = ParallelConfig(tp=1, mbs=1)
    costs = layer_costs(m, cfg, spans=None, net=None, compute=None)
    dense = sum(m.layer_params(tp=1, kind=LayerKind(mlp="dense")))
    moe_dense, moe_expert = m.layer_params(tp=1, kind=LayerKind(mlp="moe"))
    assert list(costs.dense_params) == [0, dense, 2 * dense, 2 * dense + moe_dense, 2 * dense + 2 * moe_dense,
                                        2 * dense + 3 * moe_dense]
    assert list(costs.expert_params) == [0, 0, 0, moe_expert, 2 * moe_expert, 3 * moe_expert]


@pytest.mark.parametrize("text, pattern", [
    ("([0]*3+[1]*58)", [0] * 3 + [1] * 58),
    ("([1]*3+[0]*1)*3", [1, 1, 1, 0] * 3),  # Megatron's help example
    ("[0,1,1]", [0, 1, 1]),
])
def test_moe_layer_freq_argv_expression_and_emission(text, pattern):
    argv = (f"--num-layers {len(pattern)} --hidden-size 64 --num-attention-heads 4 --seq-length 16 --vocab-size 128 "
            f"--num-experts 4 --moe-layer-freq {text}").split()
    values = model_values(scan(argv))
    assert values["moe_layer_freq"] == pattern
    spec = ModelSpec(ModelConfig(**values))
    emitted = model_args(spec, tp=1)
    assert emitted[emitted.index("--moe-layer-freq") + 1] == moe_layer_freq_arg(pattern)
    # and the emitted expression reads back to the same pattern
    again = model_values(scan([*argv[:-1], moe_layer_freq_arg(pattern)]))
    assert again["moe_layer_freq"] == pattern


def test_deepseek_pattern_is_written_as_runs():
    assert moe_layer_freq_arg([0] * 3 + [1] * 58) == "([0]*3+[1]*58)"
    assert moe_layer_freq_arg(2) == "2"


@pytest.mark.parametrize("text, message", [
    ("[0]*10**9", "only lists of integers joined by \\+ and repeated by \\*"),
    ("([0]+[1])*100000", "more than 16384 entries"),
    ("__import__('os')", "an integer N, or a list expression"),
])
def test_moe_layer_freq_argv_errors(text, message):
    argv = "--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 16 --vocab-size 128 --num-experts 4".split()
    with pytest.raises(NestError, match=message):
        model_values(scan([*argv, "--moe-layer-freq", text]))


def test_hydra_list_pattern_and_its_errors():
    base = ["model=tiny_moe", *SMALL]
    assert [k.mlp for k in load([*base, "model.moe_layer_freq=[0,1,1,1]"]).problem.model.layer_kinds] == \
        ["dense", "moe", "moe", "moe"]
    with pytest.raises(NestError, match=r"^model\.moe_layer_freq: 2 entries, but model\.num_layers=4"):
        load([*base, "model.moe_layer_freq=[0,1]"])
    with pytest.raises(NestError, match=r"entries are 0 \(dense\) or 1 \(MoE\)"):
        load([*base, "model.moe_layer_freq=[0,2,1,1]"])


# ------------------------------------------------------------------------------------------------
# Multi-token prediction
# ------------------------------------------------------------------------------------------------
def test_mtp_depth_by_hand():
    m = mla_model(mtp_num_layers=2)
    (kind,) = m.mtp_depth_kinds
    assert kind == LayerKind("mla", "dense", mtp=True)  # the decoder's last layer (two dense layers here)
    # enorm, hnorm and final_layernorm (RMSNorm: 64 each) and eh_proj 2h x h = 128 x 64
    assert m.layer_params(tp=1, kind=kind)[0] - m.layer_params(tp=1, kind=MLA_DENSE)[0] == 3 * 64 + 8192
    # eh_proj's forward GEMM over 16 tokens: 2 x 16 x 64 x 128
    assert {g.name: g.flops for g in m.layer_gemms(tokens=16, tp=1, kind=kind)}["eh_proj"] == 262144
    terms = layer_activation_terms(m, mbs=1, tp=1, sp=False, cp=1, kind=kind)
    # the depth keeps enorm's, hnorm's and final_layernorm's inputs 2 x 64 x 16 each and eh_proj's 2 x 128 x 16
    assert {k: terms[k] for k in ("mtp_enorm_input", "mtp_hnorm_input", "eh_proj_input", "mtp_final_norm_input")} == \
        {"mtp_enorm_input": 2048, "mtp_hnorm_input": 2048, "eh_proj_input": 4096, "mtp_final_norm_input": 2048}
    # a fully recomputed depth checkpoints the hidden state and the shifted tokens' embedding
    assert layer_activation_bytes(m, mbs=1, tp=1, sp=False, cp=1, kind=kind)["full"] == 2 * 2048
    # each depth has its own logits: 3 x (bf16 + fp32) x 16 tokens x 128 padded vocabulary
    assert logits_bytes(m, mbs=1, tp=1, cp=1) == 3 * 6 * 16 * 128


def test_mtp_sits_on_the_last_stage():
    """Two depths add two layers' parameters and activations, the embedding the depths read (PP > 1, untied) and
    two more passes of the output layer to the last stage only."""
    base = ["model=tiny_moe", *SMALL, "plan.tp=1", "plan.pp=2", "plan.dp=4", "plan.ep=2", "plan.mbs=1",
            "plan.recompute=none", "plan.zero=0"]
    plain = api.evaluate(base)
    mtp = api.evaluate([*base, "model.mtp_num_layers=2"])
    spec = load(["model=tiny_moe", *SMALL, "model.mtp_num_layers=2"]).problem.model
    before, after = plain.predicted["memory_breakdown_gib"], mtp.predicted["memory_breakdown_gib"]
    assert after[0] == before[0]  # the first stage is unchanged
    (depth,) = spec.mtp_depth_kinds
    dense, expert = spec.layer_params(tp=1, ep=2, kind=depth)
    embedding = spec.embedding_params(1)
    # ZeRO 0: 18 bytes a parameter (bf16 weight, fp32 gradient, Adam); expert parameters alike
    added = (2 * dense + embedding + 2 * expert) * 18
    added_states = sum(after[1][k] - before[1][k] for k in ("weights", "grads", "optimizer")) * 2**30
    assert added_states == pytest.approx(added)
    act = layer_activation_bytes(spec, mbs=1, tp=1, sp=False, cp=1, kind=depth)["none"]
    assert (after[1]["activations"] - before[1]["activations"]) * 2**30 == pytest.approx(2 * act)
    assert after[1]["logits"] == pytest.approx(3 * before[1]["logits"])
    assert mtp.predicted["step_time_s"] > plain.predicted["step_time_s"]


# ------------------------------------------------------------------------------------------------
# Group-limited routing
# ------------------------------------------------------------------------------------------------
def _megatron_enumerated_hit(experts, k, groups, group_topk, lo, hi):
    """P(an expert of [lo, hi) is among a token's k) under megatron-core's group_limited_topk, over every ordering of
    the experts' i.i.d. scores: with k / group_topk = 1 a group's score is its best expert's, so only the ordering
    counts. Without a group limit, k distinct experts of all."""
    size, hits, total = experts // groups, 0, 0
    for rank in itertools.permutations(range(experts)):  # rank[e]: expert e's place in the scores' order
        best = [max(rank[g * size:(g + 1) * size]) for g in range(groups)]
        kept = sorted(range(groups), key=lambda g: -best[g])[:group_topk]
        chosen = sorted((e for g in kept for e in range(g * size, (g + 1) * size)), key=lambda e: -rank[e])[:k]
        hits += any(lo <= e < hi for e in chosen)
        total += 1
    return hits / total


@pytest.mark.parametrize("experts, k, groups, group_topk, lo, hi", [
    (8, 2, 4, 2, 0, 2), (8, 2, 4, 2, 1, 3), (8, 3, 4, 3, 2, 7), (6, 2, 3, 2, 0, 3), (8, 2, 1, 1, 0, 2),
    (8, 3, 1, 1, 3, 6),
])
def test_hit_probability_against_megatron_s_choice_enumerated(experts, k, groups, group_topk, lo, hi):
    """Without a group limit the formula is exact; with one the cost model draws megatron-core's choice for
    GROUP_SAMPLES tokens (cost/routing.py group_counts), averaged over the groups' rotations: within 2e-3 (the
    cases here differ by at most 4e-4)."""
    expected = _megatron_enumerated_hit(experts, k, groups, group_topk, lo, hi)
    tolerance = dict(rel=1e-12) if groups == 1 else dict(abs=2e-3)
    assert experts_hit_probability(experts, k, groups, group_topk, lo, hi) == pytest.approx(expected, **tolerance)


def routed(**overrides) -> ModelSpec:
    fields = dict(name="r", num_layers=1, hidden_size=64, ffn_hidden_size=64, num_attention_heads=4, seq_length=16,
                  vocab_size=128, num_experts=8, moe_router_topk=2)
    return ModelSpec(ModelConfig(**{**fields, **overrides}))


def test_node_limited_routing_by_hand():
    """8 experts on EP 4 over 2 nodes of 2 ranks (2 experts a rank, 4 a node), top-2. DeepEP sends a token once
    to each other node holding one of its experts and once to each rank of its own node; the receiving rank
    forwards it to the others hit in its node.

    Without groups: P(rank hit) = 1 - C(6,2)/C(8,2) = 13/28, P(other node hit) = 1 - C(4,2)/C(8,2) = 22/28.
    NVLink: the own node's other rank 13/28 + forwarded 2 x 13/28 - 22/28 = 17/28; across nodes 22/28.
    Node-limited, 2 groups (= nodes), 1 group a token: P(rank hit) = 1/2 x (1 - C(2,2)/C(4,2)) = 5/12,
    P(other node) = 1/2: NVLink 5/12 + (10/12 - 1/2) = 9/12, across nodes 1/2 -- at most one node."""
    shape = (2.0, 2.0)
    assert deepep_level_copies(routed(), shape) == pytest.approx((17 / 28, 22 / 28))
    assert dispatch_copies(routed(), 4, dispatcher="deepep") == pytest.approx(4 * 13 / 28)
    limited = routed(moe_router_num_groups=2, moe_router_group_topk=1)
    assert deepep_level_copies(limited, shape) == pytest.approx((9 / 12, 1 / 2))
    assert dispatch_copies(limited, 4, dispatcher="deepep") == pytest.approx(4 * 5 / 12)
    # Megatron's alltoall dispatcher: top-2 copies either way
    assert dispatch_copies(limited, 4) == 2.0


def test_node_limited_routing_bounds_cross_node_traffic():
    """DeepSeek-V3's routing: 256 experts, top-8, EP 64 over 8 nodes, 8 groups (= nodes), 4 a token. A token
    crosses to at most 4 other nodes; without the limit to ~5.6 of 7 in expectation."""
    free = routed(num_experts=256, moe_router_topk=8)
    limited = routed(num_experts=256, moe_router_topk=8, moe_router_num_groups=8, moe_router_group_topk=4)
    shape = (8.0, 8.0)
    cross_free, cross_limited = deepep_level_copies(free, shape)[1], deepep_level_copies(limited, shape)[1]
    # without groups: 7 other nodes x (1 - C(224, 8) / C(256, 8)); limited: 7 x P(node's group among the 4) x ...
    assert cross_free == pytest.approx(7 * (1 - math.comb(224, 8) / math.comb(256, 8)))
    assert cross_limited <= 4 - 1e-9 and cross_limited < cross_free
    # the time follows the copies on the slower, cross-node level
    net = Network(bandwidth=(450e9, 50e9), latency=(0.0, 0.0))
    one = 1e6
    t_free = routed_all_to_all_time(GroupShape(shape), tuple(one * c for c in deepep_level_copies(free, shape)), net)
    t_limited = routed_all_to_all_time(GroupShape(shape), tuple(one * c for c in deepep_level_copies(limited, shape)),
                                       net)
    assert t_limited / t_free == pytest.approx(cross_limited / cross_free)


def test_alltoall_dispatch_time_ignores_the_group_limit():
    """Megatron's alltoall dispatcher sends one copy per routed expert; a uniform router lands each on any expert
    alike, group limit or not, so the EP exchange costs the same (16 ranks over 2 nodes)."""
    problem = load(["model=tiny_moe", "model.num_experts=16", "cluster=dgx_h100_superpod", "cluster.num_devices=16"]).problem
    cfg = ParallelConfig(tp=1, dp=16, ep=16, mbs=1)
    spans, net = groups_and_network(problem, cfg, None)
    times = [layer_time(m, cfg=cfg, kind=LayerKind(mlp="moe"), spans=spans, net=net, compute=problem.compute_model).ep_comm
             for m in (routed(num_experts=16), routed(num_experts=16, moe_router_num_groups=2, moe_router_group_topk=1))]
    assert times[0] == times[1] > 0


def test_group_routing_reaches_the_deepep_price():
    """`evaluate` with DeepEP: the node-limited model's EP time falls below the free router's."""
    base = ["model=tiny_moe", "model.num_experts=16", "model.moe_router_topk=4", "cluster=dgx_h100_superpod",
            "cluster.num_devices=32", "train.global_batch_size=32", "train.moe_dispatcher=deepep", "plan.tp=1",
            "plan.pp=1", "plan.dp=32", "plan.ep=16", "plan.mbs=1", "plan.zero=1", "plan.recompute=none",
            "plan.order=tp-cp-ep-pp-dp"]
    free = api.evaluate(base).predicted["breakdown"]["ep_comm"]
    limited = api.evaluate([*base, "model.moe_router_num_groups=2", "model.moe_router_group_topk=1"])
    assert limited.predicted["breakdown"]["ep_comm"] < free


# ------------------------------------------------------------------------------------------------
# Megatron's model FLOPs
# ------------------------------------------------------------------------------------------------
def test_megatron_flops_for_mla_pattern_shared_experts_and_mtp():
    """megatron/training/training.py num_floating_point_operations (transformer_flops), by hand for 2 layers
    ([0, 1]: dense, then MoE with 4 experts, top-2, expert FFN 32, a shared expert of 32), MLA, one MTP depth
    (of the last layer's kind, MoE), h 64, s 16, padded vocabulary 128, batch 2. Per token, x 6 (3 GEMMs x 2):
      MLA linear  32 (64 + 48 + 1) + 16 (64 + 64 + 1) + 64 x 4 + 32 x 64 = 7,984, over 3 layers (MTP counted)
      dense MLP   64 x 128 x 3 (SwiGLU) = 24,576, one layer
      MoE MLP     64 x (32 x 2 + 32) x 3 = 18,432, two layers (the decoder's and the MTP depth's)
      MTP         3 x 64 + 2 x 64^2 = 8,384
      logits      64 x 128 x 2 (the output layer and the depth's)
    per sequence square: 6 x (4 x 12 / 2 + 4 x 8 / 2) = 240 a layer, 3 layers."""
    spec = mla_model(num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32, moe_shared_expert_intermediate_size=32,
                     moe_layer_freq=[0, 1], mtp_num_layers=1)
    per_token = 6 * (3 * 7984 + 24576 + 2 * 18432 + 8384 + 64 * 128 * 2)
    assert megatron_model_flops(spec, batch_size=2, tp=1) == 2 * 16 * per_token + 2 * 16 * 16 * 3 * 240


def test_megatron_flops_of_a_standard_model_unchanged():
    """Llama-3-70B-shaped: 12 L h (1.5 f) + 12 L h^2 (1 + g/n + s/(2h)) + 6 h V per token (the formula before
    layer kinds, which Megatron's equals for standard attention)."""
    spec = load(["model=llama3_70b", *SMALL]).problem.model
    m = spec.cfg
    h, s, L = m.hidden_size, m.seq_length, m.num_layers
    attention = (1 + 8 / 64 + s / h * 0.5) * 1.0
    old = s * (12 * L * h * m.ffn_hidden_size * 1.5 + 12 * L * h * h * attention + 6 * h * spec.padded_vocab(1))
    assert megatron_model_flops(spec, batch_size=1, tp=1) == pytest.approx(old, rel=1e-12)


# ------------------------------------------------------------------------------------------------
# The layer graph names kinds
# ------------------------------------------------------------------------------------------------
def test_kind_labels_round_trip_and_graph_validation():
    for kind in (LayerKind(), LayerKind(mlp="moe"), MLA_MOE, LayerKind("mla", "moe", mtp=True), LayerKind("none", "moe")):
        assert LayerKind.from_label(kind.label) == kind
    assert LayerKind().label == "dense" and MLA_MOE.label == "mla+moe"
    graph = {"schema_version": 1, "source": "megatron", "model": "m", "seq_length": 8, "micro_batch_size": 1, "tp": 1,
             "ep": 1, "etp": 1, "layers": [{"index": 0, "kind": "mixer", "name": "", "dense_params": 0,
                                             "expert_params": 0, "gemm_flops": 0, "attention_flops": 0,
                                             "elementwise_flops": 0, "communication_bytes": 0, "saved_bytes": 0,
                                             "boundary_bytes": 0}]}
    with pytest.raises(NestError, match="unknown layer kind 'mixer'"):
        LayerGraph.from_dict(graph)
    graph["layers"][0]["kind"] = "mtp:mla+moe"
    assert LayerGraph.from_dict(graph).layers[0].kind == "mtp:mla+moe"


# ------------------------------------------------------------------------------------------------
# DeepSeek-V3 and Kimi K2
# ------------------------------------------------------------------------------------------------
def _deepseek_like(*, layers=61, heads=128, experts=256, first_dense=3, mtp=1, vocab=129280, groups=(8, 4)):
    """DeepSeek-V3 (github.com/deepseek-ai/DeepSeek-V3 config_671B.json): 61 layers, hidden 7168, dense FFN 18432,
    128 heads, q_lora 1536, kv_lora 512, qk 128 + RoPE 64, v 128, 256 experts top-8 of FFN 2048 with one shared
    expert of 2048, the first 3 layers dense, one MTP depth, vocabulary 129,280, 8 groups top-4."""
    overrides = [
        "model=mixtral_8x7b", "model.name=deepseek_like", f"model.num_layers={layers}", "model.hidden_size=7168",
        "model.ffn_hidden_size=18432", f"model.num_attention_heads={heads}", "model.num_query_groups=null",
        "model.multi_latent_attention=true", "model.q_lora_rank=1536", "model.kv_lora_rank=512", "model.qk_head_dim=128",
        "model.qk_pos_emb_head_dim=64", "model.v_head_dim=128", "model.qk_layernorm=true", f"model.num_experts={experts}",
        "model.moe_router_topk=8", "model.moe_ffn_hidden_size=2048", "model.moe_shared_expert_intermediate_size=2048",
        "model.moe_layer_freq=[" + ",".join(["0"] * first_dense + ["1"] * (layers - first_dense)) + "]",
        f"model.vocab_size={vocab}", "model.seq_length=4096", "model.untie_embeddings_and_output_weights=true",
    ]
    if mtp:
        overrides.append(f"model.mtp_num_layers={mtp}")
    if groups:
        overrides += [f"model.moe_router_num_groups={groups[0]}", f"model.moe_router_group_topk={groups[1]}"]
    return overrides


def _total_params(spec: ModelSpec) -> tuple[int, int]:
    """(the model without MTP, the MTP depths) at TP 1, one copy of each weight."""
    decoder = sum(sum(spec.layer_params(tp=1, kind=k)) for k in spec.layer_kinds)
    main = decoder + spec.embedding_params(1) + spec.output_params(tp=1, pp=1)
    mtp = spec.mtp_depths * sum(sum(spec.layer_params(tp=1, kind=kind)) for kind in spec.mtp_depth_kinds)
    return main, mtp


def test_deepseek_v3_parameters_against_the_published_count():
    """DeepSeek-V3's report: 671 B parameters, 685 B on Hugging Face with the 14 B MTP module (whose checkpoint
    stores its own copies of the embedding and the output head, 2 x 0.93 B, which Megatron shares)."""
    spec = load([*_deepseek_like(), *SMALL]).problem.model
    main, mtp = _total_params(spec)
    assert main == 671_026_404_352  # 671.03 B: within 0.01 % of the published 671 B
    assert abs(main / 671e9 - 1) < 1e-3
    assert mtp == 11_610_067_968  # + the two 0.93 B copies the checkpoint holds: 13.46 B of its 14 B
    assert abs((main + mtp + 2 * spec.embedding_params(1)) / 685e9 - 1) < 0.01


def test_deepseek_v3_is_priced_by_evaluate():
    base = [*_deepseek_like(), "cluster=dgx_h100_superpod", "cluster.num_devices=1024", "train.global_batch_size=4096",
            "train.moe_dispatcher=deepep", "plan.tp=1", "plan.ep=64", "plan.etp=1", "plan.mbs=1", "plan.zero=1",
            "plan.recompute=full", "plan.sp=false"]
    with pytest.raises(NestError, match="does not fit: stage 0 needs"):  # 671 B on one stage of 80 GB devices
        api.evaluate([*base, "plan.pp=1", "plan.dp=1024"])
    pp8 = api.evaluate([*base, "plan.pp=8", "plan.dp=128", "plan.layers_per_stage=[7,8,8,8,8,8,8,6]"])
    assert pp8.predicted["step_time_s"] > 0 and 0 < pp8.predicted["mfu"] < 1
    # the last of 8 stages holds the MTP depth, the logits of 2 heads, and its copy of the embedding
    memory = pp8.predicted["memory_breakdown_gib"]
    assert memory[-1]["logits"] > 0 and memory[0]["logits"] == 0
    assert pp8.layers_per_stage == [7, 8, 8, 8, 8, 8, 8, 6]


def test_kimi_k2_is_expressible_and_priced():
    """Kimi K2 (moonshotai/Kimi-K2-Instruct config.json): DeepSeek-V3's shape with 64 heads, 384 experts, one
    dense layer (first_k_dense_replace 1), vocabulary 163,840, no MTP (num_nextn_predict_layers 0), no group limit
    (n_group 1). Moonshot's model card: 1 T total, 32 B activated.

    By hand: MLA 7168 x 1536 + 1536 x 64 x 192 + 1536 + 7168 x 576 + 512 x 64 x 256 + 512 + 64 x 128 x 7168 + 7168
    = 101,131,264; a MoE layer adds 384 experts x 3 x 7168 x 2048, the shared expert 3 x 7168 x 2048, the router
    384 x 7168 and its norm 7168: 17,059,364,864; the dense layer adds 3 x 7168 x 18432 + 7168: 497,500,160; the
    untied embedding and output layer 2 x 163,840 x 7168, the final norm 7168."""
    overrides = _deepseek_like(heads=64, experts=384, first_dense=1, mtp=0, vocab=163840, groups=None)
    spec = load([*overrides, *SMALL]).problem.model
    main, mtp = _total_params(spec)
    assert mtp == 0
    assert main == 60 * 17_059_364_864 + 497_500_160 + 2 * 163840 * 7168 + 7168 == 1_026_408_209_408
    assert abs(main / 1e12 - 1) < 0.03  # the card's "1 T"
    plan = api.evaluate([*overrides, "cluster=dgx_h100_superpod", "cluster.num_devices=1024",
                         "train.global_batch_size=4096", "plan.tp=1", "plan.pp=8", "plan.dp=128", "plan.ep=64",
                         "plan.etp=1", "plan.mbs=1", "plan.zero=1", "plan.recompute=full",
                         "plan.layers_per_stage=[7,8,8,8,8,8,8,6]"])
    assert plan.predicted["step_time_s"] > 0 and 0 < plan.predicted["mfu"] < 1


def test_deepseek_v3_argv_reads_and_emits_the_same_model():
    """Megatron-LM's DeepSeek-V3 flags (its examples and Megatron-Bridge's recipe) give the Hydra model above, and
    the plan's emitted model flags read back to it."""
    argv = ("--num-layers 61 --hidden-size 7168 --ffn-hidden-size 18432 --num-attention-heads 128 --seq-length 4096 "
            "--max-position-embeddings 4096 --vocab-size 129280 --make-vocab-size-divisible-by 128 --swiglu "
            "--untie-embeddings-and-output-weights --position-embedding-type rope --normalization RMSNorm "
            "--disable-bias-linear --hidden-dropout 0 --attention-dropout 0 --qk-layernorm --multi-latent-attention "
            "--q-lora-rank 1536 --kv-lora-rank 512 --qk-head-dim 128 --qk-pos-emb-head-dim 64 --v-head-dim 128 "
            "--num-experts 256 --moe-router-topk 8 --moe-ffn-hidden-size 2048 --moe-shared-expert-intermediate-size "
            "2048 --moe-layer-freq ([0]*3+[1]*58) --moe-router-num-groups 8 --moe-router-group-topk 4 "
            "--mtp-num-layers 1 --mtp-loss-scaling-factor 0.1 --bf16").split()
    from_argv = ModelConfig(**model_values(scan(argv), name="deepseek_like"))
    from_hydra = load([*_deepseek_like(), *SMALL, "model.normalization=RMSNorm", "model.swiglu=true",
                       "model.add_bias_linear=false"]).config.model
    shape = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "multi_latent_attention",
             "q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim", "num_experts",
             "moe_router_topk", "moe_layer_freq", "moe_router_num_groups", "moe_router_group_topk", "mtp_num_layers",
             "qk_layernorm")
    assert {k: getattr(from_argv, k) for k in shape} == {k: getattr(from_hydra, k) for k in shape}
    emitted = model_args(ModelSpec(from_argv), tp=1)  # the vocabulary comes from the user's tokenizer flags
    again = ModelConfig(**model_values(scan([*emitted, "--vocab-size", "129280"]), name="deepseek_like"))
    # the same model, its embedding rows now fixed by the emitted --padded-vocab-size (129280 = 1010 x 128 at TP 1)
    assert again == dataclasses.replace(from_argv, padded_vocab_size=129280)


def test_mla_and_mtp_flags_are_no_longer_refused():
    argv = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 16 --vocab-size 128 --bf16 "
            "--multi-latent-attention --q-lora-rank 32 --mtp-num-layers 1").split()
    values = model_values(scan(argv))
    assert values["multi_latent_attention"] and values["mtp_num_layers"] == 1
    with pytest.raises(NestError, match="--moe-router-topk-limited-devices: deprecated in Megatron"):
        scan([*argv, "--moe-router-topk-limited-devices", "2"])
    with pytest.raises(NestError, match="--multi-latent-attention and --group-query-attention"):
        model_values(scan([*argv, "--group-query-attention", "--num-query-groups", "2"]))
    with pytest.raises(NestError, match="--q-lora-rank without --multi-latent-attention"):
        model_values(scan([a for a in argv if a != "--multi-latent-attention"]))
