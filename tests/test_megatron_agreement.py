"""nest_megatron's model of Megatron checked against megatron-core itself, on CPU.

1. Rank groups: parallel.ranks.rank_groups vs parallel_state.RankGenerator (decoder and expert
   generators, both of Megatron's orders).
2. Parameters per rank: ModelSpec's counts vs a real GPTModel (local spec) built on the meta
   device by one process posing as a given rank (fake process group + initialize_model_parallel),
   and the model-state bytes cost.memory derives from them.
3. Activations: cost.activations vs the bytes one real TransformerLayer saves for backward
   (trace.cpu_megatron.measure_layer_saved_bytes).
"""

from __future__ import annotations

import dataclasses
import itertools

import pytest

pytest.importorskip("megatron.core")

# megatron-core's own noise (missing Apex/TE, deprecated arguments, settings it only warns about
# and that change no count here, e.g. EP + TP without sequence parallel).
pytestmark = [
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::UserWarning:megatron"),
]

from megatron.core import parallel_state as ps  # noqa: E402
from megatron.core.parallel_state import RankGenerator  # noqa: E402
from megatron.core.transformer.transformer_block import get_num_layers_to_build  # noqa: E402
from megatron_helpers import (  # noqa: E402
    as_rank,
    build_meta_gpt,
    count_params,
    data_parallel_width,
    ensure_single_process,
    load_model_config,
    teardown_distributed,
)

from nest_megatron.config.schema import ModelConfig  # noqa: E402
from nest_megatron.cost.activations import (  # noqa: E402
    attention_buffer_bytes,
    layer_activation_bytes,
    layer_activation_terms,
)
from nest_megatron.cost.memory import model_state_bytes, stage_memory  # noqa: E402
from nest_megatron.cost.tables import layer_costs, range_sums  # noqa: E402
from nest_megatron.model.kinds import LayerKind  # noqa: E402
from nest_megatron.model.spec import ModelSpec  # noqa: E402
from nest_megatron.parallel.config import RANK_ORDERS, ParallelConfig  # noqa: E402
from nest_megatron.parallel.ranks import decoder_sizes, expert_sizes, rank_groups  # noqa: E402

DENSE, MOE = LayerKind(mlp="dense"), LayerKind(mlp="moe")


@pytest.fixture(scope="module", autouse=True)
def _leave_no_process_group():
    yield
    teardown_distributed()


# ------------------------------------------------------------------------------------------------
# 1. Rank groups
# ------------------------------------------------------------------------------------------------
ORDERS = ("tp-cp-ep-dp-pp", "tp-cp-ep-pp-dp")
assert set(ORDERS) == set(RANK_ORDERS)

DECODER_TOKENS = ("tp", "cp", "dp", "pp", "dp-cp", "tp-pp", "tp-dp-cp", "tp-cp")
EXPERT_TOKENS = ("ep", "tp", "dp", "tp-ep")

WIDTHS = (1, 2, 3, 4, 8)
DECODER_GRID = [
    (tp, cp, dp, pp)
    for tp, cp, dp, pp in itertools.product(WIDTHS, repeat=4)
    if tp * cp * dp * pp <= 64
]
# Expert layouts: the tp*cp*dp non-pipeline ranks regrouped as etp x ep x expert_dp.
EXPERT_GRID = [
    (tp, cp, dp, pp, ep, etp)
    for tp, cp, dp, pp in DECODER_GRID
    for ep in (1, 2, 4, 8)
    for etp in (1, 2, 4)
    if (tp * cp * dp) % (ep * etp) == 0
]


def test_grids_are_not_trivial():
    assert len(DECODER_GRID) > 200 and max(tp * cp * dp * pp for tp, cp, dp, pp in DECODER_GRID) == 64
    assert len(EXPERT_GRID) > 200 and any(ep > 1 and etp > 1 for *_, ep, etp in EXPERT_GRID)


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("token", DECODER_TOKENS)
def test_decoder_rank_groups_match_megatron(order, token):
    for tp, cp, dp, pp in DECODER_GRID:
        cfg = ParallelConfig(tp=tp, cp=cp, dp=dp, pp=pp, order=order)
        expected = RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order=order).get_ranks(token)
        actual = rank_groups(order, decoder_sizes(cfg), token).tolist()
        assert actual == expected, f"{order} {token} tp={tp} cp={cp} dp={dp} pp={pp}"


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("token", EXPERT_TOKENS)
def test_expert_rank_groups_match_megatron(order, token):
    for tp, cp, dp, pp, ep, etp in EXPERT_GRID:
        cfg = ParallelConfig(tp=tp, cp=cp, dp=dp, pp=pp, ep=ep, etp=etp, order=order)
        # initialize_model_parallel's expert generator: expert_dp = world // (etp * ep * pp).
        expert_dp = (tp * cp * dp * pp) // (etp * ep * pp)
        assert cfg.expert_dp == expert_dp
        expected = RankGenerator(tp=etp, ep=ep, dp=expert_dp, pp=pp, cp=1, order=order).get_ranks(token)
        actual = rank_groups(order, expert_sizes(cfg), token).tolist()
        assert actual == expected, f"{order} {token} tp={tp} cp={cp} dp={dp} pp={pp} ep={ep} etp={etp}"


# ------------------------------------------------------------------------------------------------
# 2. Parameters per rank
# ------------------------------------------------------------------------------------------------
def _tiny_moe_shared():
    return load_model_config("tiny_moe", moe_shared_expert_intermediate_size=512)


MODELS = {
    "tiny_gpt": lambda: load_model_config("tiny_gpt"),
    "tiny_moe": lambda: load_model_config("tiny_moe"),
    "tiny_moe_shared": _tiny_moe_shared,
    "llama3_70b": lambda: load_model_config("llama3_70b"),
}

# (model, tp, pp, ep, etp, stages checked)
PARAM_CASES = [
    ("tiny_gpt", 1, 1, 1, 1, (0,)),
    ("tiny_gpt", 2, 1, 1, 1, (0,)),
    ("tiny_gpt", 4, 1, 1, 1, (0,)),
    ("tiny_gpt", 1, 2, 1, 1, (0, 1)),
    ("tiny_gpt", 2, 2, 1, 1, (0, 1)),
    ("tiny_gpt", 2, 4, 1, 1, (0, 1, 3)),
    ("tiny_moe", 1, 1, 1, 1, (0,)),
    ("tiny_moe", 1, 1, 2, 1, (0,)),
    ("tiny_moe", 1, 1, 4, 1, (0,)),
    ("tiny_moe", 2, 1, 2, 1, (0,)),
    ("tiny_moe", 2, 1, 2, 2, (0,)),
    ("tiny_moe", 4, 1, 1, 4, (0,)),
    ("tiny_moe", 2, 2, 2, 1, (0, 1)),
    ("tiny_moe", 1, 4, 4, 1, (0, 2, 3)),
    ("tiny_moe_shared", 2, 1, 2, 1, (0,)),
    ("tiny_moe_shared", 2, 2, 4, 1, (0, 1)),
    ("llama3_70b", 1, 1, 1, 1, (0,)),
    ("llama3_70b", 8, 1, 1, 1, (0,)),
    ("llama3_70b", 8, 4, 1, 1, (0, 1, 3)),
    ("llama3_70b", 4, 8, 1, 1, (0, 7)),
]


def _case_id(case):
    name, tp, pp, ep, etp, stages = case
    return f"{name}-tp{tp}-pp{pp}-ep{ep}-etp{etp}"


def _megatron_rank_counts(cfg: ModelConfig, *, tp, pp, ep, etp, stage):
    """Build the model as the last rank of pipeline stage `stage` (a non-zero TP/EP rank where
    there is one) and return megatron's own view of it."""
    dp = data_parallel_width(tp, ep, etp)
    world = tp * dp * pp
    rank = (stage + 1) * (world // pp) - 1  # order tp-cp-ep-dp-pp: pp is the slowest dimension
    with as_rank(rank, world, tp=tp, pp=pp, ep=ep, etp=etp):
        assert ps.get_pipeline_model_parallel_rank() == stage
        assert ps.get_tensor_model_parallel_world_size() == tp
        model, config = build_meta_gpt(cfg, tp=tp, pp=pp, ep=ep, etp=etp)
        dense, expert = count_params(model)
        return dict(
            dense=dense,
            expert=expert,
            layers=len(model.decoder.layers),
            layers_to_build=get_num_layers_to_build(config),
            first=ps.is_pipeline_first_stage(),
            last=ps.is_pipeline_last_stage(),
            dp=dp,
            # The widths the distributed optimizer shards over: dense parameters over DP x CP,
            # expert parameters over the expert-data-parallel group.
            dense_shards=ps.get_data_parallel_world_size(with_context_parallel=True),
            expert_shards=ps.get_expert_data_parallel_world_size(),
            names=[n for n, _ in model.named_parameters()],
        )


@pytest.mark.parametrize("case", PARAM_CASES, ids=_case_id)
def test_params_per_rank_match_megatron(case):
    name, tp, pp, ep, etp, stages = case
    cfg = MODELS[name]()
    spec = ModelSpec(cfg)
    for stage in stages:
        got = _megatron_rank_counts(cfg, tp=tp, pp=pp, ep=ep, etp=etp, stage=stage)
        layers = cfg.num_layers // pp
        assert got["layers"] == got["layers_to_build"] == layers
        assert got["first"] == (stage == 0) and got["last"] == (stage == pp - 1)

        layer_dense, layer_expert = spec.layer_params(tp=tp, ep=ep, etp=etp)
        dense = layer_dense * layers
        if stage == 0:
            dense += spec.embedding_params(tp)
        if stage == pp - 1:
            dense += spec.output_params(tp=tp, pp=pp)
        expert = layer_expert * layers
        where = f"{_case_id(case)} stage {stage}"
        assert (dense, expert) == (got["dense"], got["expert"]), (
            f"{where}: nest (dense, expert) = {(dense, expert)}, megatron-core = {(got['dense'], got['expert'])}"
        )

        # Model-state bytes from megatron's count: 2 (bf16) + 4 (fp32 grad) + 12 (Adam) per
        # parameter with DDP; the 12 sharded over the data-parallel width with the distributed
        # optimizer.
        for params, shards in ((got["dense"], got["dense_shards"]), (got["expert"], got["expert_shards"])):
            assert sum(model_state_bytes(params, zero=0, shards=shards)) == 18 * params
            assert sum(model_state_bytes(params, zero=1, shards=shards)) == pytest.approx(
                6 * params + 12 * params / shards, rel=1e-12
            )

        # The same through stage_memory, with megatron's group widths.
        par = ParallelConfig(tp=tp, pp=pp, dp=got["dp"], ep=ep, etp=etp)
        assert par.dp * par.cp == got["dense_shards"] and par.expert_dp == got["expert_shards"], where
        total = got["dense"] + got["expert"]
        for zero, expected in (
            (0, 18 * total),
            (1, 6 * total + 12 * got["dense"] / got["dense_shards"] + 12 * got["expert"] / got["expert_shards"]),
        ):
            zcfg = ParallelConfig(tp=tp, pp=pp, dp=got["dp"], ep=ep, etp=etp, zero=zero)
            costs = layer_costs(spec, zcfg, spans=None, net=None, compute=None)
            mem = stage_memory(spec, zcfg, range_sums(costs, zcfg, 0, layers), first=stage == 0,
                               last=stage == pp - 1, in_flight=1, reserved_bytes=0.0, act_rebuilt=costs.act_rebuilt)
            assert mem.weights + mem.grads + mem.optimizer == pytest.approx(expected, rel=1e-12), (where, zero)


def test_shared_experts_count_as_dense():
    """The split above relies on megatron's parameter names: check that a shared expert's
    weights are present and are not taken for routed-expert weights."""
    cfg = _tiny_moe_shared()
    got = _megatron_rank_counts(cfg, tp=1, pp=1, ep=1, etp=1, stage=0)
    assert any(".mlp.shared_experts." in n for n in got["names"])
    assert any(".mlp.experts.local_experts." in n for n in got["names"])


# ------------------------------------------------------------------------------------------------
# 3. Activations of one layer
# ------------------------------------------------------------------------------------------------
S, B, H, A = 128, 2, 256, 8
GPT_SHAPE = dict(ffn=1024, groups=8, swiglu=False, dropout=0.1)  # (i) GELU MLP, MHA, dropout
LLAMA_SHAPE = dict(ffn=704, groups=2, swiglu=True, dropout=0.0)  # (ii) SwiGLU, GQA, no dropout
SHAPES = {"gpt": GPT_SHAPE, "swiglu_gqa": LLAMA_SHAPE}

# Both position embeddings: with RoPE, Q and K are new tensors; with learned absolute positions
# and multi-head attention they are views of the QKV output (this measurement is how the model
# learned that: it once counted them in both cases, 12 % too much with selective recompute).
def _activation_cases():
    for shape in SHAPES:
        for pos in ("rope", "learned_absolute"):
            for recompute in ("none", "selective"):
                yield pytest.param(shape, pos, recompute, id=f"{shape}-{pos}-{recompute}")


def _model_config(shape: dict, pos: str) -> ModelConfig:
    return ModelConfig(
        name="activation-check",
        num_layers=1,
        hidden_size=H,
        ffn_hidden_size=shape["ffn"],
        num_attention_heads=A,
        num_query_groups=shape["groups"],
        seq_length=S,
        vocab_size=1024,
        swiglu=shape["swiglu"],
        position_embedding_type=pos,
        # LayerNorm, not RMSNorm: on CPU torch.nn.RMSNorm takes torch's composite fp32 path
        # (it saves the fp32 input and the fp32 normalised tensor, 8 B per element of [s, b, h],
        # instead of the bf16 input); native_layer_norm saves the bf16 input as a GPU norm does.
        normalization="LayerNorm",
        add_bias_linear=False,  # what measure_layer_saved_bytes builds
        hidden_dropout=shape["dropout"],
        attention_dropout=shape["dropout"],
        # The local spec on CPU: megatron-core's DotProductAttention with the unfused fp32
        # softmax (masked_softmax_fusion off) and the unfused SwiGLU (bias_activation_fusion off).
        attention_backend="unfused",
        attention_softmax_in_fp32=True,
        bias_swiglu_fusion=False,
    )


def _noise_storages(result, module: str) -> list[tuple[tuple, str, int]]:
    """(shape, dtype, storage bytes) of the dropout noise tensors saved in `module`."""
    return [
        (tuple(t["saves"][0]["shape"]), t["saves"][0]["dtype"], t["storage_bytes"])
        for t in result["breakdown"].get(module, {"tensors": []})["tensors"]
        if t["saves"][0]["op"] == "MulBackward0._saved_other" and len(t["saves"][0]["shape"]) in (3, 4)
        and t["saves"][0]["shape"][-1] != H // A  # not the RoPE cos/sin [s, 1, 1, d]
    ]


@pytest.fixture(scope="module")
def measure():
    from nest_megatron.trace.cpu_megatron import measure_layer_saved_bytes, prepare_cpu_megatron

    def run(**kwargs):
        # The parameter-count tests tear the process group down; put back the single-process
        # state prepare_cpu_megatron creates (it only sets it up on its first call).
        ensure_single_process()
        prepare_cpu_megatron()
        return measure_layer_saved_bytes(**kwargs)

    yield run
    teardown_distributed()


@pytest.mark.parametrize("shape_name, pos, recompute", list(_activation_cases()))
def test_layer_activations_match_megatron(measure, shape_name, pos, recompute):
    shape = SHAPES[shape_name]
    result = measure(
        hidden_size=H,
        ffn_hidden_size=shape["ffn"],
        num_attention_heads=A,
        num_query_groups=shape["groups"],
        seq_length=S,
        micro_batch_size=B,
        swiglu=shape["swiglu"],
        hidden_dropout=shape["dropout"],
        attention_dropout=shape["dropout"],
        recompute_granularity="selective" if recompute == "selective" else None,
        normalization="LayerNorm",  # see _model_config: RMSNorm takes an fp32 path on CPU
        use_rope=pos == "rope",
        attention_softmax_in_fp32=True,
    )
    measured = result["total_bytes"]

    # CPU-only correction. On CUDA, F.dropout is the fused native_dropout, which saves a 1-byte
    # bool mask; on CPU it saves the scaled Bernoulli noise in the input dtype (bf16, 2 bytes).
    # Subtract 1 byte per element of every dropout mask: the two hidden dropouts (after attention
    # and after the MLP) over s*b*h each, and the attention dropout over a*s*s*b (not kept under
    # selective recompute, which recomputes core attention).
    hidden_mask = 2 * S * B * H if shape["dropout"] > 0 else 0
    attention_mask = A * S * S * B if shape["dropout"] > 0 and recompute == "none" else 0
    correction = hidden_mask + attention_mask
    # ... and check that those bf16 noise tensors are what the measurement holds.
    noise = (
        _noise_storages(result, "self_attn_bda")
        + _noise_storages(result, "mlp_bda")
        + _noise_storages(result, "self_attention.core_attention.attention_dropout")
    )
    assert all(dtype == "bfloat16" for _, dtype, _ in noise), noise
    assert sum(nbytes for *_, nbytes in noise) == 2 * correction, noise
    measured_gpu = measured - correction

    spec = ModelSpec(_model_config(shape, pos))
    model = layer_activation_bytes(spec, mbs=B, tp=1, sp=False, cp=1, kind=DENSE)[recompute]
    terms = layer_activation_terms(spec, mbs=B, tp=1, sp=False, cp=1, kind=DENSE,
                                   modules=("core_attn",) if recompute == "selective" else ())
    measured_by_module = {k: v["bytes"] for k, v in result["breakdown"].items()}
    message = (
        f"{shape_name} {pos} recompute={recompute}: measured {measured} B on CPU, "
        f"{measured_gpu} B after the dropout-mask correction (-{correction} B); model {model:.0f} B; "
        f"model/measured = {model / measured_gpu:.4f}\n  model terms: {terms}\n  measured by module: {measured_by_module}"
    )
    print(message)
    assert model == pytest.approx(measured_gpu, rel=0.10), message


def test_unfused_attention_score_buffer_matches_megatron(measure):
    # DotProductAttention writes its raw scores into parallel_state's global memory buffer, which no
    # layer saves and every layer reuses: after one layer it holds b x a x s x s bf16 values,
    # 2 x 8 x 128 x 128 x 2 B = 524,288 B. The fused kernels have none.
    ps.get_global_memory_buffer().buffer.clear()
    shape = SHAPES["swiglu_gqa"]
    measure(hidden_size=H, ffn_hidden_size=shape["ffn"], num_attention_heads=A, num_query_groups=shape["groups"],
            seq_length=S, micro_batch_size=B, swiglu=True, hidden_dropout=0.0, attention_dropout=0.0,
            recompute_granularity=None, normalization="LayerNorm", use_rope=True, attention_softmax_in_fp32=True)
    held = sum(t.numel() * t.element_size() for t in ps.get_global_memory_buffer().buffer.values())
    spec = ModelSpec(_model_config(shape, "rope"))
    assert held == 524_288 == attention_buffer_bytes(spec, mbs=B, tp=1)
    assert attention_buffer_bytes(ModelSpec(dataclasses.replace(spec.cfg, attention_backend="flash")), mbs=B, tp=1) == 0


@pytest.mark.parametrize("modules", [["layernorm"], ["mlp"], ["mlp", "layernorm"]])
def test_recompute_modules_drop_what_megatron_stops_saving(measure, modules):
    # megatron-core's own selective recompute of `modules` (--recompute-modules) on a real local-spec layer (both
    # norms modules of their own): the bytes it stops saving, against the model's (cost/recompute.py dropped_terms).
    # The local spec's norms each keep an fp32 statistic a token (B S x 4 B) that the model leaves out, and that
    # "layernorm" frees with the norm's output: 2 x 2 x 128 x 4 B = 2,048 B beside the normed tensors. (core_attn:
    # test_layer_activations_match_megatron.)
    shape = SHAPES["swiglu_gqa"]
    args = dict(hidden_size=H, ffn_hidden_size=shape["ffn"], num_attention_heads=A, num_query_groups=shape["groups"],
                seq_length=S, micro_batch_size=B, swiglu=True, hidden_dropout=0.0, attention_dropout=0.0,
                normalization="LayerNorm", use_rope=True, attention_softmax_in_fp32=True)
    kept = measure(**args, recompute_granularity=None)["total_bytes"]
    recomputed = measure(**args, recompute_granularity="selective", recompute_modules=modules)["total_bytes"]
    spec = ModelSpec(dataclasses.replace(_model_config(shape, "rope"), transformer_impl="local"))
    none, selective = (sum(layer_activation_terms(spec, mbs=B, tp=1, sp=False, cp=1, kind=DENSE, modules=m).values())
                       for m in ((), tuple(modules)))
    norm_statistics = 2 * B * S * 4 if "layernorm" in modules else 0
    assert kept - recomputed == none - selective + norm_statistics
