"""megatron-core 0.16.1's real MoE layer with a latent size (TransformerConfig.moe_latent_size) traced on the meta device
against the cost model: a GPTModel of one MoE layer built and run forward by nest_megatron/trace/meta.py, its two latent
projections Transformer Engine's TELinear replaced by a duplicated stand-in of the same shapes (tests/latent_meta.py:
TE does not install here), everything else megatron-core's own.

Agreement, as tests/test_trace.py holds the other kinds to (one sequence of 128, SP with TP):
  parameters (dense and expert), GEMM FLOPs                 exactly equal (the brief asks 1 %)
  saved-activation bytes                                    the analytic terms plus test_trace's CPU terms
  Megatron-LM's FLOP count (the MFU numerator)              3 x the traced GEMMs but the router's (Megatron leaves
                                                            it out) + 3 x half the traced full attention square
  EP all-to-all bytes                                       latent-wide tokens: less than at h by 2 B x T x topk x
                                                            (h - L), dispatch and combine
"""

from __future__ import annotations

import dataclasses

import pytest

pytest.importorskip("megatron.core")

pytestmark = [pytest.mark.filterwarnings("ignore::DeprecationWarning"), pytest.mark.filterwarnings("ignore::UserWarning")]

from latent_meta import te_latent_projections  # noqa: E402
from test_trace import cpu_and_small_terms  # noqa: E402

from nest_megatron.config.schema import ModelConfig  # noqa: E402
from nest_megatron.cost.activations import layer_activation_terms  # noqa: E402
from nest_megatron.cost.flops import megatron_model_flops  # noqa: E402
from nest_megatron.errors import NestError  # noqa: E402
from nest_megatron.model.kinds import LayerKind  # noqa: E402
from nest_megatron.model.spec import ModelSpec  # noqa: E402
from nest_megatron.trace.meta import teardown_distributed, trace_megatron  # noqa: E402
from nest_megatron.trace.source import local_spec_kernels  # noqa: E402

# tests/test_latent_moe.py's SMALL, one layer: h 256, 8 heads in 4 groups, 4 experts of 512 (SwiGLU), top-2, latent 64,
# a shared expert of 128.
SMALL = ModelConfig(name="small_latent", num_layers=1, hidden_size=256, ffn_hidden_size=512, num_attention_heads=8,
                    num_query_groups=4, seq_length=128, vocab_size=1024, swiglu=True,
                    untie_embeddings_and_output_weights=True, position_embedding_type="rope", normalization="RMSNorm",
                    add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0, num_experts=4, moe_router_topk=2,
                    moe_ffn_hidden_size=512, moe_shared_expert_intermediate_size=128, moe_latent_size=64)
MOE = LayerKind(mlp="moe")


@pytest.fixture(scope="module", autouse=True)
def _leave_no_process_group():
    yield
    teardown_distributed()


def traced(cfg: ModelConfig, *, tp: int = 1, ep: int = 1):
    with te_latent_projections():
        return trace_megatron(cfg, tp=tp, ep=ep)


@pytest.mark.parametrize("tp, ep", [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_megatron_latent_moe_layer_traces_like_the_analytic_model(tp, ep):
    graph = traced(SMALL, tp=tp, ep=ep)
    layer = graph.layers[1]
    assert layer.kind == "moe"
    spec, sp = ModelSpec(local_spec_kernels(SMALL)), tp > 1
    # parameters: the latent projections whole on every TP rank (2 x 256 x 64 = 32,768 dense), the experts at the
    # latent width (4 / ep x (64 x 1024 + 512 x 64) = 393,216 / ep expert); tests/test_latent_moe.py works them out
    assert (layer.dense_params, layer.expert_params) == spec.layer_params(tp=tp, ep=ep, kind=MOE)
    assert layer.expert_params == 393_216 // ep
    # the GEMMs: the projections on this rank's 128 / tp tokens, the experts' K (FC1) and N (FC2) the latent 64
    names = {g.name: (g.m, g.n, g.k) for g in layer.gemms}
    assert names["mlp.fc1_latent_proj"] == (128 // tp, 64, 256) and names["mlp.fc2_latent_proj"] == (128 // tp, 256, 64)
    assert {(g.n, g.k) for g in layer.gemms if ".experts." in g.name} == {(1024, 64), (64, 512)}
    gemms = spec.layer_gemms(tokens=128, tp=tp, sp=sp, ep=ep, kind=MOE)
    assert layer.gemm_flops == sum(g.flops for g in gemms)
    # what the layer keeps for its backward: the analytic terms (expert_input at 64 wide, fc2_latent_proj's input)
    # and the CPU kernels' own (norms upcast, the causal mask, RoPE's cos / sin, the routing indices)
    analytic = sum(layer_activation_terms(spec, mbs=1, tp=tp, sp=sp, cp=1, kind=MOE).values())
    extra = cpu_and_small_terms(SMALL, tp=tp, etp=1, sp=sp, moe=True)
    assert layer.saved_bytes == pytest.approx(analytic + sum(extra.values()), rel=1e-3)


def test_megatron_s_flop_count_is_the_traced_model_s():
    """Megatron-LM's MFU numerator (training.py:1267-1280 at d98e8a6, the latent experts and the two projections) for
    the one-layer model equals 3 x what megatron-core computes forward: its GEMMs but the router (which Megatron's
    count leaves out: 2 x 128 x 256 x 4 = 262,144) and half of the local spec's full attention square (a causal
    kernel's share, as Megatron counts it)."""
    graph = traced(SMALL)
    gemm = sum(layer.gemm_flops for layer in graph.layers)
    router = next(g for g in graph.layers[1].gemms if g.name == "mlp.router")
    assert 2 * router.m * router.n * router.k == 262_144
    attention = graph.layers[1].attention_flops
    expected = 3 * (gemm - 262_144) + 3 * attention / 2
    assert megatron_model_flops(ModelSpec(SMALL), batch_size=1, tp=1) == pytest.approx(expected, rel=1e-12)


def test_the_dispatch_carries_latent_wide_tokens():
    """The alltoall dispatcher's all-to-alls at EP 2 (TP 1): the latent model sends 128 tokens x 2 copies x 64 x 2 B
    each way, the same model without a latent size 256 wide: 2 x 2 x 128 x 2 x (256 - 64) = 196,608 B more over a
    dispatch and a combine (the bytes of the token counts and routing probabilities are the same in both)."""
    latent = traced(SMALL, ep=2).layers[1].communication_bytes
    plain = traced(dataclasses.replace(SMALL, moe_latent_size=None), ep=2).layers[1].communication_bytes
    assert plain - latent == 2 * 2 * 128 * 2 * (256 - 64) == 196_608


def test_megatron_core_builds_no_latent_projection_without_transformer_engine():
    """Without Transformer Engine megatron-core refuses the latent MoE layer (moe_layer.py:171, assert HAVE_TE): what
    rule latent-moe-te says of the local spec a traced model runs."""
    with pytest.raises(NestError, match="TransformerEngine is required for MoE latent projections"):
        trace_megatron(SMALL)
