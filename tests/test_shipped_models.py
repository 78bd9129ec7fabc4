"""The shipped configs of this year's models (issue 18): each one's analytic parameter count against the count its
publisher gives, and a plan of each on 256 H100s whose Megatron argv keeps the rule table.

The counts are the project's (model/spec.py, one copy of each weight at TP 1: solver/baselines.total_params); the
expected figures are the publishers', cited per model. "Active" is what one token's forward multiplies by: the
dense weights of every layer, top-k / experts of the routed experts, and the output layer; publishers differ on
whether the input embedding (a lookup, not a multiply) counts, so each case says which it uses.
"""

from __future__ import annotations

import pytest
from test_shipped_plans_run import broken_rules

from nest_megatron.config.load import load
from nest_megatron.launch.megatron_rules import violations
from nest_megatron.model.spec import ModelSpec
from nest_megatron.solver.baselines import total_params

SMALL = ["cluster=dgx_h100_superpod", "cluster.num_devices=8", "train.global_batch_size=16"]
MODELS = ["llama31_405b", "qwen3_30b_a3b", "qwen3_235b_a22b", "deepseek_v3", "kimi_k2", "gpt_oss_120b",
          "nemotron3_super"]
# Those trace/meta.py builds as a megatron-core GPTModel: not a hybrid Mamba stack (nemotron3_super; its latent MoE layer
# is traced in tests/test_latent_moe_trace.py, its Mamba layer's kind in tests/test_mamba_trace.py), and not
# gpt_oss_120b (below).
TRACED = [m for m in MODELS if m not in ("gpt_oss_120b", "nemotron3_super")]


def problem(model: str):
    return load([f"model={model}", *SMALL]).problem


def active_params(spec: ModelSpec, *, embedding: bool) -> float:
    """Decoder weights one token uses (dense ones, and top-k / experts of the expert weights), the final norm and
    output layer, and the input embedding when `embedding`."""
    active = 0.0
    for kind in spec.layer_kinds:
        dense, expert = spec.layer_params(tp=1, kind=kind)
        active += dense + (expert * spec.cfg.moe_router_topk / spec.cfg.num_experts if expert else 0)
    return active + spec.output_params(tp=1, pp=1) + (spec.embedding_params(1) if embedding else 0)


def test_llama31_405b_count():
    """Meta's "405B" (HF meta-llama/Llama-3.1-405B: 405.9 B in its safetensors, embeddings included). By hand a
    layer is QKV 16384 x (16384 + 2 x 8 x 128) + projection 16384^2 + SwiGLU 3 x 16384 x 53248 + 2 norms of 16384
    = 3,187,703,808; 126 of them, the untied embedding and output layer 2 x 128256 x 16384 and the final norm."""
    p = problem("llama31_405b")
    assert total_params(p) == 126 * 3_187_703_808 + 2 * 128256 * 16384 + 16384 == 405_853_388_800
    assert total_params(p) == pytest.approx(405.9e9, rel=0.01)


@pytest.mark.parametrize("model, total, active, non_embedding", [
    # Qwen's model cards (HF Qwen/Qwen3-30B-A3B, Qwen/Qwen3-235B-A22B): "30.5B in total and 3.3B activated,
    # non-embedding 29.9B"; "235B in total and 22B activated, non-embedding 234B". Their activated counts take
    # both embedding tables (without the input one 3.04 B, 8 % under 3.3 B).
    ("qwen3_30b_a3b", 30.5e9, 3.3e9, 29.9e9),
    ("qwen3_235b_a22b", 235e9, 22e9, 234e9),
])
def test_qwen3_moe_counts(model, total, active, non_embedding):
    p = problem(model)
    spec = p.model
    embeddings = spec.embedding_params(1) + spec.output_params(tp=1, pp=1) - spec.norm_params
    assert total_params(p) == pytest.approx(total, rel=0.01)
    assert total_params(p) - embeddings == pytest.approx(non_embedding, rel=0.01)
    assert active_params(spec, embedding=True) == pytest.approx(active, rel=0.02)
    # by hand, Qwen3-30B-A3B's MoE layer: attention 2048 x (32 + 2 x 4) x 128 + 32 x 128 x 2048 + q/k norms 2 x 128,
    # 128 experts x 3 x 2048 x 768, the router 128 x 2048, two norms of 2048
    if model == "qwen3_30b_a3b":
        layer = 2048 * 40 * 128 + 4096 * 2048 + 256 + 128 * 3 * 2048 * 768 + 128 * 2048 + 2 * 2048
        assert sum(spec.layer_params(tp=1)) == layer == 623_120_640


def test_deepseek_v3_counts():
    """DeepSeek-V3's report (arXiv 2412.19437 section 1): 671 B total, 37 B activated per token; HF
    deepseek-ai/DeepSeek-V3 holds 685 B with the MTP module (14 B, which stores its own copies of the embedding and
    output layer, 2 x 0.93 B, that Megatron shares: within 0.4 % without them). The 671 B is worked out by hand in
    tests/test_layer_kinds.py (test_deepseek_v3_parameters_against_the_published_count)."""
    p = problem("deepseek_v3")
    spec = p.model
    (depth,) = spec.mtp_depth_kinds  # one layer a depth, one depth
    mtp = sum(spec.layer_params(tp=1, kind=depth))
    assert total_params(p) - mtp == pytest.approx(671e9, rel=0.01)
    assert total_params(p) == pytest.approx(685e9, rel=0.01)
    assert active_params(spec, embedding=False) == pytest.approx(37e9, rel=0.02)  # 36.6 B


def test_kimi_k2_counts():
    """Moonshot's model card (HF moonshotai/Kimi-K2-Base): 1 T total (1.04 T in its safetensors listing), 32 B
    activated, counted without the input embedding (with it 32.9 B). No MTP depth: num_nextn_predict_layers 0."""
    p = problem("kimi_k2")
    assert p.model.mtp_depth_kinds == ()
    assert total_params(p) == pytest.approx(1.04e12, rel=0.02)  # 1.026 T
    assert active_params(p.model, embedding=False) == pytest.approx(32e9, rel=0.02)  # 31.7 B


def test_gpt_oss_120b_counts():
    """OpenAI's gpt-oss model card (arXiv 2508.10925, table 1): 116.83 B total, 5.13 B active (the MLP 114.71 B,
    attention 0.96 B, embedding and unembedding 1.16 B; active counts the unembedding only). The attention sinks
    (64 a layer) and the router bias (128 a layer) are not counted: 6,912 parameters in all."""
    p = problem("gpt_oss_120b")
    spec = p.model
    assert total_params(p) == pytest.approx(116.83e9, rel=0.01)
    assert active_params(spec, embedding=False) == pytest.approx(5.13e9, rel=0.01)
    # by hand, one layer's attention with its biases: QKV 2880 x 5120 + 5120, projection 4096 x 2880 + 2880, norm
    assert spec.attention_params(1) == 2880 * 5120 + 5120 + 4096 * 2880 + 2880 + 2880 == 26_552_960
    assert 36 * spec.attention_params(1) == pytest.approx(0.96e9, rel=0.01)


def test_nemotron3_super_counts():
    """NVIDIA's name, Nemotron-3 Super 120B-A12B: 120 B total, 12 B active. By hand at TP 1 (the shape of
    hydra_configs/model/nemotron3_super.yaml, AutoModel's _nemotronh_super_v3_cfg):
      a Mamba layer: in_proj 4096 x (2 x 8192 + 2 x 8 x 128 + 128) = 76,021,760; conv1d (8192 + 2048) x 5 = 51,200;
        dt_bias, A_log, D 3 x 128; gated norm 8192; out_proj 8192 x 4096 = 33,554,432; input norm 4096: 109,640,064
      an attention layer: QKV 4096 x (4096 + 2 x 2 x 128) = 18,874,368; projection 4096^2; norm 4096: 35,655,680
      a MoE layer: norm 4096; router 512 x 4096 = 2,097,152; the latent projections 2 x 4096 x 1024 = 8,388,608; the
        shared expert (squared ReLU, no GLU) 2 x 4096 x 5376 = 44,040,192: 54,530,048 dense; 512 experts at the
        latent width, 512 x 2 x 1024 x 2688 = 2,818,572,288
      40 Mamba, 8 attention, 40 MoE layers, the untied embedding and output layer 2 x 131072 x 4096, the final norm.
    Active, without the input embedding: every dense weight, 22 / 512 of the experts and the output layer:
    4,385,602,560 + 285,245,440 + 40 x 54,530,048 + 40 x 22 x 5,505,024 + 536,870,912 + 4096 = 12,233,346,048."""
    p = problem("nemotron3_super")
    spec = p.model
    by_kind = {kind.label: spec.layer_params(tp=1, kind=kind) for kind in spec.kinds}
    assert by_kind == {"mamba+none": (109_640_064, 0), "none+moe": (54_530_048, 2_818_572_288),
                       "none": (35_655_680, 0)}  # "none": an attention layer, no MLP (its label)
    assert total_params(p) == (40 * 109_640_064 + 8 * 35_655_680 + 40 * (54_530_048 + 2_818_572_288)
                               + 2 * 131072 * 4096 + 4096) == 120_668_687_360
    assert total_params(p) == pytest.approx(120e9, rel=0.01)
    assert active_params(spec, embedding=False) == 12_233_346_048 == pytest.approx(12e9, rel=0.02)


# The grid cells of scripts/time_plan.py --grid (docs/measured.md): each plans, its argv the latent hybrid's
SUPER_CELLS = [("dgx_h100_superpod", 256), ("dgx_h100_superpod", 2048), ("gb200_nvl72", 72), ("gb200_nvl72", 1152)]


@pytest.mark.slow
@pytest.mark.parametrize("cluster, devices", SUPER_CELLS, ids=[f"{c}-{n}" for c, n in SUPER_CELLS])
def test_nemotron3_super_plans_on_the_grid_cells(cluster, devices):
    from nest_megatron import api

    plan = api.plan(["model=nemotron3_super", f"cluster={cluster}", f"cluster.num_devices={devices}",
                     "train.global_batch_size=4096"])
    argv = plan.megatron_args
    assert argv[argv.index("--moe-latent-size") + 1] == "1024" and "--hybrid-layer-pattern" in argv
    assert 8 % plan.parallel["tp"] == 0  # its 8 Mamba groups split over TP
    # the split is the pattern's '|' segments, one per pipeline chunk, and Megatron-LM's rules take it
    pattern = argv[argv.index("--hybrid-layer-pattern") + 1]
    assert pattern.count("|") + 1 == (plan.parallel["pp"] * plan.parallel["vpp"] if plan.parallel["pp"] > 1 else 1)
    assert violations(argv, world_size=plan.world_size) == []


# gpt_oss_120b is left out: megatron-core's local-spec forward of biased experts fails on CPU/meta (an in-place
# bias add on the view _ReduceFromModelParallelRegion returns), so trace/meta.py cannot trace it.
@pytest.mark.parametrize("model", TRACED)
def test_shipped_model_layers_have_megatron_cores_parameters(model):
    """One decoder layer of each kind (and the MTP depth) built by megatron-core on the meta device (GPTModel of the
    shipped keys, trace/meta.py; a short sequence, which changes no parameter): each layer's dense and expert
    parameters are the analytic count's, and so are the embedding's and the output layer's."""
    pytest.importorskip("megatron.core")
    from megatron_helpers import load_model_config

    from nest_megatron.model.kinds import LayerKind
    from nest_megatron.trace.meta import representative_layers, trace_megatron
    from nest_megatron.trace.source import local_spec_kernels

    cfg = load_model_config(model, seq_length=64)
    graph = trace_megatron(representative_layers(cfg))
    spec = ModelSpec(local_spec_kernels(cfg))
    layers = graph.layers[1:-1]
    assert {LayerKind.from_label(layer.kind) for layer in layers} == set(spec.kinds) | set(spec.mtp_depth_kinds)
    for layer in layers:
        kind = LayerKind.from_label(layer.kind)
        assert (layer.dense_params, layer.expert_params) == spec.layer_params(tp=1, kind=kind), layer.kind
    assert graph.layers[0].params == spec.embedding_params(1)
    assert graph.layers[-1].params == spec.output_params(tp=1, pp=1)


@pytest.mark.slow
@pytest.mark.parametrize("model", MODELS)
def test_shipped_model_plans_on_256_h100s_with_an_argv_that_keeps_the_rules(model):
    """The chosen plan and every runner-up on 256 H100s: the emitted argv keeps the argv rules, the configuration
    the search-space rules (tests/test_shipped_plans_run.py's check)."""
    assert broken_rules([f"model={model}", "cluster=dgx_h100_superpod", "cluster.num_devices=256",
                         "train.global_batch_size=1024"]) == {}
