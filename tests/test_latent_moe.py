"""Latent MoE (megatron-core's moe_latent_size, Megatron-LM --moe-latent-size): a small latent MoE worked out by hand
-- parameters, GEMMs, Megatron's FLOP count, EP dispatch bytes, permutation, saved activations and what recompute
drops and reruns, host operators, the TP-duplicated projections -- the rules Megatron asserts, and the key read from
an argv and a Hugging Face config.json and written back. tests/test_latent_moe_trace.py holds the same model to
megatron-core's own layer.

SMALL is tiny_moe (4 layers, h 256, 8 heads in 4 query groups of 32, SwiGLU, 4 experts, top-2, sequence 128,
vocabulary 1024) with 512-wide experts, a shared expert of 128 and a latent size L = 64. megatron-core 0.16.1's MoE
layer with it (moe/moe_layer.py:169-193, 264-270, 339-345; experts.py:540-570): fc1_latent_proj h -> L before the
dispatch, the experts L -> 2 x 512 -> L, the combine L wide, fc2_latent_proj L -> h after it; the router and the
shared expert read the h-wide input."""

from __future__ import annotations

import dataclasses
import json

import pytest
from test_cost_terms import GemmOnly, close

from nest_megatron import api
from nest_megatron.config.load import load
from nest_megatron.config.megatron_argv import model_values, scan
from nest_megatron.cost.activations import layer_activation_terms
from nest_megatron.cost.collectives import Network
from nest_megatron.cost.flops import megatron_model_flops
from nest_megatron.cost.host import layer_operators
from nest_megatron.cost.layer import layer_time, permutation_elements
from nest_megatron.cost.placement import compute_spans
from nest_megatron.cost.recompute import recompute_seconds, rerun_parts
from nest_megatron.errors import NestError
from nest_megatron.hardware.topology import Level, Topology
from nest_megatron.launch.megatron_rules import violations
from nest_megatron.model.kinds import LayerKind
from nest_megatron.model.spec import ModelSpec
from nest_megatron.parallel.config import ParallelConfig
from nest_megatron.parallel.ranks import identity_placement
from nest_megatron.trace.hf_config import model_config_from_hf

KEYS = ["model=tiny_moe", "model.moe_latent_size=64", "model.moe_shared_expert_intermediate_size=128",
        "model.moe_ffn_hidden_size=512"]
CLUSTER = ["cluster=dgx_h100_superpod", "cluster.num_devices=8", "train.global_batch_size=64"]
MOE = LayerKind(mlp="moe")
MOE_BLOCK = LayerKind("none", "moe")  # the MoE block alone (a hybrid's 'E' layer): its terms without attention's


def small(**changes) -> ModelSpec:
    spec = load(KEYS).problem.model
    return ModelSpec(dataclasses.replace(spec.cfg, **changes)) if changes else spec


def test_parameters_by_hand():
    s = small()
    # The MoE block at TP 1, EP 1: its RMSNorm 256; the router 4 x 256 = 1,024; fc1_latent_proj and fc2_latent_proj
    # 2 x 256 x 64 = 32,768; the shared expert (SwiGLU) 256 x 2 x 128 + 128 x 256 = 98,304: 132,352 dense. The
    # experts at the latent width, 4 x (64 x 2 x 512 + 512 x 64) = 4 x 98,304 = 393,216 (at h they would be 1,572,864).
    assert s.mlp_params(MOE_BLOCK, tp=1, ep=1, etp=1) == (132_352, 393_216)
    # TP 2, EP 2: the projections stay whole on every TP rank (duplicated), the shared expert halves (49,152), two
    # experts a rank: 256 + 1,024 + 32,768 + 49,152 = 83,200 dense, 196,608 expert.
    assert s.mlp_params(MOE_BLOCK, tp=2, ep=2, etp=1) == (83_200, 196_608)
    # with attention (QKV 256 x (256 + 2 x 128), projection 256 x 256, norm 256: 196,864) a layer is 329,216 dense
    assert s.layer_params(tp=1, kind=MOE) == (329_216, 393_216)
    # The duplicated weights whose gradients Megatron all-reduces over TP under SP: the two projections a layer
    assert (s.tp_replicated_params(MOE, 2), s.tp_replicated_params(MOE, 1)) == (32_768, 0)
    # with biases (add_bias_linear): fc1_latent_proj's 64 and fc2_latent_proj's 256 more, on every rank
    assert small(add_bias_linear=True).latent_proj_params == 32_768 + 64 + 256


def test_gemms_by_hand():
    # 128 tokens at TP 2 (SP: 64 a rank), EP 2: the router and both projections on the rank's 64 tokens; the experts'
    # 2 x 128 / 2 = 128 routed rows over 2 local experts, 64 each, at K = 64 (FC1) and N = 64 (FC2); the shared expert
    # on the gathered 128 tokens, split over TP.
    gemms = small().mlp_gemms(MOE_BLOCK, tokens=128, tp=2, ep=2, etp=1)
    assert [(g.name, g.m, g.n, g.k, g.count) for g in gemms] == [
        ("router", 64, 4, 256, 1), ("latent_fc1", 64, 64, 256, 1), ("expert_fc1", 64, 1024, 64, 2),
        ("expert_fc2", 64, 64, 512, 2), ("latent_fc2", 64, 256, 64, 1), ("shared_fc1", 128, 128, 256, 1),
        ("shared_fc2", 128, 256, 64, 1)]
    # FLOPs: each projection 2 x 64 x 64 x 256 = 2,097,152; the experts 2 x 64 x 1024 x 64 x 2 = 16,777,216 and
    # 2 x 64 x 64 x 512 x 2 = 8,388,608 (a quarter of what they cost at h = 256)
    flops = {g.name: g.flops for g in gemms}
    assert flops["latent_fc1"] == flops["latent_fc2"] == 2_097_152
    assert (flops["expert_fc1"], flops["expert_fc2"]) == (16_777_216, 8_388_608)


def test_megatron_s_flop_count_by_hand():
    """Megatron-LM training.py:1267-1280 at d98e8a6 (and hybrid_flops' moe_layer_flops :846-860), x 3 passes x 2 per
    multiply-add, per token: a MoE layer L f k x 3 (SwiGLU) + 2 h L + h x shared x 3 = 64 x 512 x 2 x 3 + 2 x 256 x 64
    + 256 x 128 x 3 = 196,608 + 32,768 + 98,304 = 327,680, x 6 = 1,966,080; attention 6 x (256 x 512 + 256 x 256)
    = 1,179,648; the logits 6 x 256 x 1024 = 1,572,864. Per token 4 x (1,966,080 + 1,179,648) + 1,572,864
    = 14,155,776, x 128 tokens = 1,811,939,328; the causal square 4 layers x 128^2 x 6 x 0.5 x (256 + 256)
    = 100,663,296. One sequence: 1,912,602,624."""
    assert megatron_model_flops(small(), batch_size=1, tp=1) == 1_912_602_624


def test_the_dispatch_carries_latent_wide_tokens_by_hand():
    cfg = ParallelConfig(ep=2, dp=2)
    topo = Topology("pair", (Level("node", 2, 1e9, 0.0),))
    spans, net = compute_spans(cfg, topo, identity_placement(2)), Network.for_topology(topo)

    def ep_comm(spec):
        return layer_time(spec, cfg=cfg, kind=MOE, spans=spans, net=net, compute=GemmOnly()).ep_comm

    # 128 tokens x 2 copies x L 64 x 2 B = 32,768 B a device, half of it to the other rank at 1 GB/s: 16.384 us a
    # dispatch, as long a combine, forward and backward. At h = 256 four times that.
    assert ep_comm(small()) == close(4 * 16_384 / 1e9)
    assert ep_comm(small(moe_latent_size=None)) == close(4 * 4 * 16_384 / 1e9)


def test_permutation_moves_latent_wide_rows_by_hand():
    # Megatron's alltoall, unfused, R = 256 copies of T = 128 tokens, 2 local experts: permute 2R, unpermute 3R + 3T,
    # the chunks sorted by expert and back 4R: 512 + 768 + 384 + 1,024 = 2,688 rows of L = 64 elements
    assert permutation_elements(small(), tokens_sp=128, rows=256, local_experts=2) == 2_688 * 64


def test_saved_activations_by_hand():
    # The MoE block at TP 2 with SP, EP 2, one sequence (T = 128, T_sp = 64): the norm's input and the normed tensor
    # the router, the shared expert and fc1_latent_proj read, 2 x 256 x 64 each; the experts' input, 128 routed rows
    # of L: 2 x 64 x 128 = 16,384; fc2_latent_proj's input, the combined tokens of the rank: 2 x 64 x 64 = 8,192;
    # FC1's output 2 x 128 x 1024 = 262,144 and FC2's input 2 x 128 x 512 = 131,072 (at the ffn width, unchanged);
    # the shared expert's 2 x 128 x 256 / 2 and 2 x 128 x 128 / 2.
    terms = layer_activation_terms(small(), mbs=1, tp=2, sp=True, cp=1, kind=MOE_BLOCK)
    assert terms == {"norm2_input": 32_768, "fc1_input": 32_768, "expert_input": 16_384, "latent_fc2_input": 8_192,
                     "fc1_output": 262_144, "fc2_input": 131_072, "shared_fc1_output": 32_768,
                     "shared_fc2_input": 16_384}
    # Selective recompute of "moe" (the whole MoE layer checkpointed, projections inside it) keeps its input only;
    # "moe_act" drops FC2's input only; full recompute keeps the layer input (2 x 256 x 64)
    moe = layer_activation_terms(small(), mbs=1, tp=2, sp=True, cp=1, kind=MOE_BLOCK, modules=("moe",))
    assert moe == {"norm2_input": 32_768, "fc1_input": 32_768}
    act = layer_activation_terms(small(), mbs=1, tp=2, sp=True, cp=1, kind=MOE_BLOCK, modules=("moe_act",))
    assert set(terms) - set(act) == {"fc2_input"}
    # with FP8 GEMMs fc2_latent_proj keeps its input as Transformer Engine's 1-byte copy (delayed: 1 B an element)
    fp8 = load([*KEYS, *CLUSTER, "train.precision=fp8"]).problem.model
    assert layer_activation_terms(fp8, mbs=1, tp=2, sp=True, cp=1, kind=MOE_BLOCK)["latent_fc2_input"] == 4_096


def test_recompute_of_moe_runs_the_projections_again():
    s = small()
    assert {"latent_fc1", "latent_fc2"} <= rerun_parts(s, MOE, ("moe",))
    cfg = ParallelConfig(tp=2, sp=True, ep=2, dp=2)
    topo = Topology("four", (Level("node", 4, 1e9, 0.0),))
    lt = layer_time(s, cfg=cfg, kind=MOE, spans=compute_spans(cfg, topo, identity_placement(4)),
                    net=Network.for_topology(topo), compute=GemmOnly())
    # GemmOnly: the rerun's GEMMs are the MoE block's forward, 1e-12 s a FLOP: the router 131,072, the projections
    # 2 x 2,097,152, the experts 16,777,216 + 8,388,608, the shared expert 2 x 128 x 128 x 256 + 2 x 128 x 256 x 64
    # = 12,582,912, and the EP all-to-alls of the forward (layer_time's "ep")
    ep = dict(lt.fwd_comm_parts)["ep"]
    gemm = 131_072 + 2 * 2_097_152 + 16_777_216 + 8_388_608 + 12_582_912
    assert recompute_seconds(lt, s, MOE, ("moe",)) == close(gemm / 1e12 + ep + dict(lt.fwd_comm_parts)["tp:shared:column"]
                                                           + dict(lt.fwd_comm_parts)["tp:shared:row"])


def test_host_issues_two_more_gemms_forward_four_backward():
    cfg = ParallelConfig(tp=2, sp=True, ep=2, dp=2)
    latent, plain = layer_operators(small(), cfg, MOE), layer_operators(small(moe_latent_size=None), cfg, MOE)
    assert (latent[0] - plain[0], latent[1] - plain[1]) == (2, 4)


def test_the_plan_emits_the_latent_size_and_reads_it_back():
    plan = api.evaluate([*KEYS, *CLUSTER, "plan.tp=2", "plan.ep=2", "plan.dp=4", "plan.pp=1", "plan.mbs=1"])
    argv = plan.megatron_args
    assert argv[argv.index("--moe-latent-size") + 1] == "64" and "--moe-grouped-gemm" in argv
    assert model_values(scan(argv))["moe_latent_size"] == 64
    base = "--num-layers 4 --hidden-size 256 --num-attention-heads 8 --seq-length 128 --vocab-size 1024".split()
    with pytest.raises(NestError, match="^--moe-latent-size without --num-experts: a dense model has no experts"):
        model_values([*base, "--moe-latent-size", "64"])


@pytest.mark.parametrize("keys, message", [
    (["model=tiny_gpt", "model.moe_latent_size=64"],
     r"^model.moe_latent_size=64 without model.num_experts: MoE latent projections are applicable only for MoE"),
    ([*KEYS, "model.moe_latent_size=0"], r"^model.moe_latent_size=0: allowed 1\.\."),
    ([*KEYS, "model.transformer_impl=local"],
     r"^model.moe_latent_size=64 with model.transformer_impl=local: megatron-core builds the latent projections as "
     r"Transformer Engine's TELinear"),
    ([*KEYS, "model.source=megatron"],
     r"^model.moe_latent_size=64 with model.transformer_impl=local \(model.source=megatron traces megatron-core's "
     r"local spec\)"),
])
def test_a_latent_moe_megatron_refuses_is_one_line(keys, message):
    with pytest.raises(NestError, match=message):
        load([*keys, *CLUSTER])


@pytest.mark.parametrize("extra, line", [
    (["--moe-use-legacy-grouped-gemm"], "--moe-latent-size with --moe-use-legacy-grouped-gemm: the legacy GroupedMLP"),
    (["--moe-shared-expert-overlap"], "--moe-latent-size with --moe-shared-expert-overlap:"),
])
def test_the_launch_rules_on_a_latent_argv(extra, line):
    argv = api.evaluate([*KEYS, *CLUSTER, "plan.tp=1", "plan.ep=2", "plan.dp=8", "plan.pp=1", "plan.mbs=1"]).megatron_args
    assert violations(argv, world_size=8) == []
    assert any(v.startswith(line) for v in violations([*argv, *extra], world_size=8))


def test_a_hugging_face_config_gives_its_latent_size(tmp_path):
    """NemotronH's config.json names it moe_latent_size; read from any family the file is (a Mixtral here), and then
    refused for a traced model (model.source=hf with model.transformer_impl=local traces megatron-core's local spec:
    rule latent-moe-te)."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "mixtral", "hidden_size": 256, "intermediate_size": 512,
                                "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 4,
                                "vocab_size": 1024, "num_local_experts": 4, "num_experts_per_tok": 2,
                                "moe_latent_size": 64}))
    base = load(["model=tiny_gpt"]).config.model
    assert model_config_from_hf(path, base).moe_latent_size == 64
    with pytest.raises(NestError, match=r"model.source=hf traces megatron-core's local spec"):
        load(["model=tiny_gpt", "model.source=hf", f"model.hf_config={path}", "model.transformer_impl=local", *CLUSTER])
