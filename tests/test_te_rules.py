"""Transformer Engine's run-time rules (parallel/rules.py TE_RULES, launch/megatron_rules.py ARGV_RULES): each with a
configuration it keeps and one it refuses, the line worked out from TE's source at v2.12 (the file:line is cited at
each case); `evaluate`, the argv check and the planner refuse what TE refuses, and the planner chooses the
--cp-comm-type that a rule fixes.

TE cannot run here: its PyTorch extension (transformer_engine_torch) is built against CUDA and loads
libtransformer_engine.so from transformer_engine_cu12 at import, so `import transformer_engine.pytorch` fails on a
machine without a GPU driver, and none of the checks below can be imported on their own. The expectations are worked
out by hand from TE's code instead, and megatron-core's own code (installed, CPU) decides what it decides: which layers
slide their window.
"""

from __future__ import annotations

import pytest

from nest_megatron import api, cli
from nest_megatron.config.load import load
from nest_megatron.config.schema import ModelConfig
from nest_megatron.errors import NestError
from nest_megatron.launch.constraints import argv_constraints
from nest_megatron.launch.megatron_rules import violations
from nest_megatron.model.spec import ModelSpec, Numerics
from nest_megatron.parallel.config import ParallelConfig
from nest_megatron.parallel.rules import violation

# A Llama-3-8B-like layer: 32 heads of 128 in 8 query groups, SwiGLU FFN 14336, sequence 8192.
SHAPE = dict(name="t", num_layers=8, hidden_size=4096, ffn_hidden_size=14336, num_attention_heads=32,
             num_query_groups=8, seq_length=8192, vocab_size=32000, swiglu=True, hidden_dropout=0.0,
             attention_dropout=0.0, normalization="RMSNorm", add_bias_linear=False)
WINDOW = dict(window_size=4096, window_attn_skip_freq=4)  # the issue's example: every 4th layer full attention


def spec(*, fp8: str | None = None, **changes) -> ModelSpec:
    return ModelSpec(ModelConfig(**{**SHAPE, **changes}), numerics=Numerics(fp8_recipe=fp8))


def broken(model: ModelSpec, *, tp_comm_overlap: bool = False, **sizes) -> str | None:
    """The first rule `sizes` break on `model`, one replica (dp 1, pp 1 unless given), a batch of one step."""
    cfg = ParallelConfig(**{"sp": sizes.get("tp", 1) > 1, **sizes})
    return violation(cfg, model=model, num_devices=cfg.world, global_batch_size=cfg.mbs * cfg.dp * cfg.pp,
                     tp_comm_overlap=tp_comm_overlap)


# -- context parallelism and attention ------------------------------------------------------------------------------

@pytest.mark.parametrize("comm_type, allowed", [("p2p", False), ("a2a", True), ("all_gather", True)])
def test_sliding_window_attention_with_cp_needs_a2a_or_all_gather(comm_type, allowed):
    """TE context_parallel.py:4023-4029: `sliding_window_attn = window_size not in (None, (-1, 0), (-1, -1))`, then
    `assert not sliding_window_attn or cp_comm_type in ["a2a", "all_gather"]`. Megatron gives a windowed layer
    window_size=(4096, 0) (extensions/transformer_engine.py TEDotProductAttention), so p2p fails with CP 2."""
    line = broken(spec(**WINDOW), cp=2, cp_comm_type=comm_type)
    if allowed:
        assert line is None
    else:
        assert line == ("plan.cp_comm_type=p2p with plan.cp=2 and model.window_size=4096: Transformer Engine's context "
                        "parallelism runs sliding-window attention only with a2a or all_gather; use plan.cp_comm_type="
                        "a2a or all_gather, or plan.cp=1")
    assert broken(spec(**WINDOW), cp=1) is None  # no CP: TE's attention runs no exchange
    assert broken(spec(), cp=2, cp_comm_type="p2p") is None  # full attention: the ring is Megatron's default


@pytest.mark.parametrize("skip", [None, 1, 2, 4, 9])
def test_the_windowed_layers_are_megatron_cores(skip):
    """Whether any layer slides its window is megatron-core's is_layer_window_attention, run here for each layer:
    window_attn_skip_freq N keeps every N-th layer full (N = 1: all of them, so p2p is fine)."""
    utils = pytest.importorskip("megatron.core.transformer.utils")
    layers = SHAPE["num_layers"]
    some_slide = any(utils.is_layer_window_attention((4096, 0), skip, n) for n in range(1, layers + 1))
    assert some_slide == (skip != 1)
    line = broken(spec(window_size=4096, window_attn_skip_freq=skip), cp=2, cp_comm_type="p2p")
    assert (line is not None) == some_slide


def test_a2a_splits_each_tp_ranks_heads_and_groups_over_cp():
    """TE context_parallel.py:3365-3367 asserts q.shape[-2] % cp == 0 and k.shape[-2] % cp == 0: the heads and query
    groups of one TP rank. 32 heads, 8 groups at TP 2: 16 and 4 a rank, so CP 4 divides both, CP 8 not the groups."""
    assert broken(spec(), tp=2, cp=4, cp_comm_type="a2a") is None
    assert broken(spec(), tp=2, cp=8, cp_comm_type="a2a") == (
        "plan.cp_comm_type=a2a with plan.cp=8: the all-to-all splits each TP rank's 16 attention heads and 4 query "
        "groups over the CP ranks, so cp must divide both; use plan.cp_comm_type=all_gather or p2p, or a smaller plan.cp")
    assert broken(spec(), tp=2, cp=8, cp_comm_type="all_gather") is None  # K/V gathered whole: no head split


@pytest.mark.parametrize("comm_type", ["a2a", "all_gather"])
def test_a2a_and_all_gather_need_a_head_size_multiple_of_8(comm_type):
    """TE context_parallel.py:2806 (all_gather) and 3320 (a2a): `assert q.shape[-1] % 8 == 0`, the head size; the p2p
    ring has no such check."""
    assert broken(spec(kv_channels=128), cp=2, cp_comm_type=comm_type) is None
    assert broken(spec(kv_channels=100), cp=2, cp_comm_type=comm_type) == (
        f"plan.cp_comm_type={comm_type} with plan.cp=2: Transformer Engine needs the head size (kv_channels=100) a "
        "multiple of 8 for it; use plan.cp_comm_type=p2p")
    assert broken(spec(kv_channels=100), cp=2, cp_comm_type="p2p") is None


def _mla_channels(**mla) -> tuple[int, int]:
    """The key and value head sizes megatron-core's MLASelfAttention hands its core attention (k_channels,
    v_channels; with TE's spec they become TE DotProductAttention's kv_channels): its own code, built on the meta
    device at TP 1 with a core attention that records what it is given (TE's cannot be built here)."""
    pytest.importorskip("megatron.core")
    import torch

    from nest_megatron.trace.meta import as_rank
    from nest_megatron.trace.transformer_config import transformer_config

    seen = {}

    class Recorder(torch.nn.Module):  # stands for TEDotProductAttention, which needs a GPU
        def __init__(self, **kwargs):
            super().__init__()
            seen.update(kwargs)

    with as_rank(0, 1):
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.transformer.spec_utils import build_module

        attention = get_gpt_layer_local_spec(multi_latent_attention=True).submodules.self_attention
        attention.submodules.core_attention = Recorder
        with torch.device("meta"):
            build_module(attention, config=transformer_config(ModelConfig(**{**MLA, **mla})), layer_number=1)
    return seen["k_channels"], seen["v_channels"]


# A small MLA layer: 4 heads, queries and keys of qk_head_dim + qk_pos_emb_head_dim, values of v_head_dim.
MLA = dict(name="mla", num_layers=2, hidden_size=256, ffn_hidden_size=512, num_attention_heads=4, seq_length=256,
           vocab_size=1024, multi_latent_attention=True, q_lora_rank=32, kv_lora_rank=16,
           position_embedding_type="rope", normalization="RMSNorm", add_bias_linear=False)


@pytest.mark.parametrize("dims, k_v", [
    (dict(qk_head_dim=128, qk_pos_emb_head_dim=64, v_head_dim=128), (192, 128)),  # DeepSeek-V3's heads
    (dict(qk_head_dim=64, qk_pos_emb_head_dim=64, v_head_dim=128), (128, 128)),  # equal: TE sees no MLA
])
def test_mla_with_cp_exchanges_by_p2p(dims, k_v):
    """TE context_parallel.py:4031-4035: `enable_mla = k.shape[-1] != v.shape[-1]`, then `assert not enable_mla or
    cp_comm_type in ["p2p", "a2a+p2p"]`. The head sizes are megatron-core's (k_channels = qk_head_dim +
    qk_pos_emb_head_dim = 128 + 64 = 192, v_channels = v_head_dim = 128); where they are equal, TE takes any."""
    assert _mla_channels(**dims) == k_v
    model = ModelSpec(ModelConfig(**{**MLA, **dims}))
    for comm_type in ("a2a", "all_gather"):
        line = broken(model, cp=2, cp_comm_type=comm_type)
        if k_v[0] == k_v[1]:
            assert line is None, line
        else:
            assert line == (
                f"plan.cp_comm_type={comm_type} with plan.cp=2 and model.multi_latent_attention=true: Transformer "
                "Engine's context parallelism runs MLA (key heads 192 wide, value heads 128) only with p2p; use "
                "plan.cp_comm_type=p2p, or plan.cp=1")
    assert broken(model, cp=2, cp_comm_type="p2p") is None
    assert broken(model, cp=1, cp_comm_type="a2a") is None  # no CP: no exchange


def test_mla_with_a_window_has_no_cp_exchange():
    """A sliding window needs a2a or all_gather (:4026), MLA p2p (:4032): with both, no CP exchange runs, so the
    search finds every CP > 1 configuration refused and the empty-space line names the first rule."""
    model = ModelSpec(ModelConfig(**MLA, qk_head_dim=128, qk_pos_emb_head_dim=64, v_head_dim=128, **WINDOW))
    lines = [broken(model, cp=2, cp_comm_type=t) for t in ("p2p", "a2a", "all_gather")]
    assert lines[0].startswith("plan.cp_comm_type=p2p with plan.cp=2 and model.window_size=4096")
    assert all(line.startswith(f"plan.cp_comm_type={t} with plan.cp=2 and model.multi_latent_attention=true")
               for t, line in zip(("a2a", "all_gather"), lines[1:]))
    assert broken(model, cp=1) is None


MLA_ARGV = ("--num-layers 2 --hidden-size 256 --num-attention-heads 4 --seq-length 256 --max-position-embeddings 256 "
            "--vocab-size 1024 --multi-latent-attention --q-lora-rank 32 --kv-lora-rank 16 --qk-head-dim 128 "
            "--qk-pos-emb-head-dim 64 --v-head-dim 128 --position-embedding-type rope --normalization RMSNorm "
            "--disable-bias-linear --bf16 --global-batch-size 8 --micro-batch-size 1 --context-parallel-size 2").split()
MLA_KEYS = ["model=tiny_gpt", "model.multi_latent_attention=true", "model.q_lora_rank=32", "model.kv_lora_rank=16",
            "model.qk_head_dim=128", "model.qk_pos_emb_head_dim=64", "model.v_head_dim=128",
            "model.position_embedding_type=rope", "model.normalization=RMSNorm", "model.seq_length=256",
            "cluster.num_devices=8"]


def test_mla_exchange_in_the_argv_evaluate_and_the_search():
    """The same rule on a launch line (Megatron's default p2p launches), in `evaluate`, and in the search: asked to
    try only a2a, the planner finds TE refuses it for MLA and runs the ring instead."""
    assert violations(MLA_ARGV, world_size=2) == []
    assert violations([*MLA_ARGV, "--cp-comm-type", "a2a"], world_size=2) == [
        "--cp-comm-type=a2a with --context-parallel-size=2 and model.multi_latent_attention=true: Transformer Engine's "
        "context parallelism runs MLA (key heads 192 wide, value heads 128) only with p2p; use --cp-comm-type=p2p, or "
        "--context-parallel-size=1"]
    with pytest.raises(NestError, match=r"^invalid configuration: plan\.cp_comm_type=all_gather with plan\.cp=2 and "
                                        r"model\.multi_latent_attention=true: Transformer Engine's context parallelism "
                                        r"runs MLA \(key heads 192 wide, value heads 128\) only with p2p"):
        api.evaluate([*MLA_KEYS, "plan.tp=1", "plan.pp=1", "plan.cp=2", "plan.cp_comm_type=all_gather"])
    plan = api.plan([*MLA_KEYS, "plan.cp=2", "solver.cp_comm_types=[a2a]"])
    argv = plan.megatron_args
    assert plan.parallel["cp"] == 2 and plan.parallel["cp_comm_type"] == "p2p"
    assert argv[argv.index("--cp-comm-type") + 1] == "p2p"  # emitted with any CP > 1 (emit/megatron.py)
    assert violations(argv, world_size=plan.world_size) == []


@pytest.mark.parametrize("softmax", ["off-by-one", "learnable"])
@pytest.mark.parametrize("comm_type, allowed", [("p2p", False), ("a2a", True), ("all_gather", False)])
def test_off_by_one_and_learnable_softmax_with_cp_exchange_by_a2a(softmax, comm_type, allowed):
    """TE utils.py:715-717 turns flash-attn off for a softmax_type other than vanilla, :733-741 cuDNN's fused attention
    with CP unless cp_comm_type is a2a, :755-759 the unfused attention with any CP: with p2p or all_gather no backend is
    left (dot_product_attention.py:1425-1431 raises), and context_parallel.py:4045-4047 asserts a2a itself. a2a also
    splits the heads: 32 heads and 8 groups at TP 1 over CP 2, 16 and 4 a rank, so it runs."""
    line = broken(spec(softmax_type=softmax), cp=2, cp_comm_type=comm_type)
    if allowed:
        assert line is None, line
    else:
        assert line == (f"plan.cp_comm_type={comm_type} with plan.cp=2 and model.softmax_type={softmax}: Transformer "
                        f"Engine's context parallelism runs the {softmax} softmax only in cuDNN's fused attention with "
                        "a2a; use plan.cp_comm_type=a2a, or plan.cp=1")
    assert broken(spec(softmax_type=softmax), cp=1, cp_comm_type=comm_type) is None  # no CP: cuDNN or unfused run it
    assert broken(spec(), cp=2, cp_comm_type=comm_type) is None  # the vanilla softmax: every exchange


def test_a_learnable_softmax_with_a_window_exchanges_by_a2a_only():
    """The window refuses p2p (context_parallel.py:4026), the softmax all_gather (:4045): a2a is left."""
    model = spec(softmax_type="learnable", **WINDOW)
    assert broken(model, cp=2, cp_comm_type="a2a") is None
    assert broken(model, cp=2, cp_comm_type="all_gather").startswith(
        "plan.cp_comm_type=all_gather with plan.cp=2 and model.softmax_type=learnable")


@pytest.mark.parametrize("backend, allowed", [("flash", False), ("fused", True), ("auto", True), ("unfused", True)])
def test_the_flash_backend_runs_only_the_vanilla_softmax(backend, allowed):
    """TE utils.py:715-717 turns flash-attn off for softmax_type off-by-one; --attention-backend flash turns cuDNN's
    and the unfused attention off (language_module.py:133-136), so no backend is left (dot_product_attention.py:
    1425-1431); the other backends keep one (cuDNN's fused, or TE's unfused, attention)."""
    line = broken(spec(attention_backend=backend, softmax_type="off-by-one"))
    if allowed:
        assert line is None, line
    else:
        assert line == ("model.attention_backend=flash with model.softmax_type=off-by-one: flash-attn has only the "
                        "vanilla softmax, and Megatron turns the other backends off; use attention_backend=auto|fused")
    assert broken(spec(attention_backend=backend)) is None  # vanilla: every backend


def test_bert_padding_mask_has_no_cp():
    """megatron-core's BERT layers take AttnMaskType.padding (models/bert/bert_layer_specs.py); TE's flash and fused
    attention assert `not context_parallel` for a padding mask (backends.py:821-824, 1860-1863)."""
    assert broken(spec(family="bert"), cp=1) is None
    assert broken(spec(family="bert"), cp=2) == (
        "plan.cp=2 with model.family=bert: Transformer Engine's context parallelism does not take BERT's padding mask "
        "(its flash and fused attention assert it); use plan.cp=1")


@pytest.mark.parametrize("backend, allowed", [("auto", True), ("flash", True), ("fused", True), ("unfused", False),
                                              ("local", False)])
def test_cp_needs_a_fused_attention_backend(backend, allowed):
    """TE utils.py:755-759 turns UnfusedDotProductAttention off with CP; megatron-core's local DotProductAttention
    asserts cp == 1 (transformer/dot_product_attention.py)."""
    line = broken(spec(attention_backend=backend), cp=2)
    assert (line is None) == allowed, line
    if not allowed:
        assert line.startswith(f"plan.cp=2 with model.attention_backend={backend}: unfused attention has no context")


def test_the_fused_backend_slides_no_window_with_dropout():
    """TE utils.py:874-885 turns FusedAttention off for a sliding window with attention dropout; Megatron's
    --attention-backend fused turns flash-attn and TE's unfused attention off (language_module.py sets
    NVTE_FLASH_ATTN=0, NVTE_UNFUSED_ATTN=0), so no backend is left: dot_product_attention.py:1425-1431 raises."""
    assert broken(spec(attention_backend="fused", **WINDOW), cp=1) is None  # no dropout
    assert broken(spec(attention_backend="auto", attention_dropout=0.1, **WINDOW), cp=1) is None  # flash-attn may take it
    assert broken(spec(attention_backend="fused", attention_dropout=0.1, **WINDOW), cp=1) == (
        "model.attention_backend=fused with model.window_size=4096 and model.attention_dropout=0.1: cuDNN's fused "
        "attention has no sliding window with dropout, and Megatron turns the other backends off; use "
        "attention_dropout=0 or attention_backend=auto|flash")


def test_the_flash_backend_takes_head_sizes_up_to_256():
    """TE utils.py:627-646 (flash-attn 2: head_dim <= 256, a multiple of 8) and 648-650 (flash-attn 3: <= 256); with
    --attention-backend flash nothing else is left (dot_product_attention.py:1425-1431)."""
    assert broken(spec(attention_backend="flash", num_attention_heads=16, num_query_groups=8, kv_channels=256)) is None
    assert broken(spec(attention_backend="flash", num_attention_heads=8, num_query_groups=8, kv_channels=512)) == (
        "model.attention_backend=flash with kv_channels=512: flash-attn takes head sizes up to 256 in multiples of 8, "
        "and Megatron turns the other backends off; use attention_backend=auto|fused")
    assert broken(spec(attention_backend="fused", num_attention_heads=8, num_query_groups=8, kv_channels=512)) is None


def test_a2a_plus_p2p_is_no_plan():
    """TE's fourth exchange, a2a+p2p (context_parallel.py:3986), runs over hierarchical CP groups that the planner does
    not build (Megatron-LM needs --hierarchical-context-parallel-sizes for it)."""
    assert broken(spec(), cp=1, cp_comm_type="a2a+p2p") is None  # Megatron reads it only with CP
    assert broken(spec(), cp=2, cp_comm_type="a2a+p2p").startswith(
        "plan.cp_comm_type=a2a+p2p: allowed are p2p, a2a, all_gather")


# -- FP8 GEMM shapes ------------------------------------------------------------------------------------------------

def test_fp8_gemm_dimensions_are_multiples_of_16():
    """TE utils.py:439-447 assert_dim_for_fp8_exec(input, weight) (linear.py:177): the input's rows % 8 and its last
    dimension % 16, the weight's [out, in] % 8 and % 16; cuBLAS's FP8 leading dimensions % 16 (cublaslt_gemm.cu:157,
    248) are, in Hopper's TN-only FP8 GEMMs, each GEMM's reduction dimension: in (forward), out (input gradient) and
    the tokens (weight gradient). FFN 5440 at TP 8: FC1 makes 2 x 5440 / 8 = 1360 = 16 x 85 (fine), FC2 takes
    5440 / 8 = 680 = 16 x 42.5 (not); at TP 4 FC2 takes 1360."""
    assert broken(spec(ffn_hidden_size=5440), tp=8) is None  # bf16: no such rule
    assert broken(spec(fp8="delayed", ffn_hidden_size=5440), tp=4) is None
    assert broken(spec(fp8="delayed", ffn_hidden_size=5440), tp=8) == (
        "plan.tp=8 with FP8 (delayed): Transformer Engine's FP8 GEMMs need each dimension a multiple of 16; the fc2 "
        "GEMM's input per rank is 680 wide")


def test_fp8_tokens_per_rank_are_a_multiple_of_16():
    """The weight gradient reduces over the tokens (cublaslt_gemm.cu:157, 248): mbs x seq / cp = 1 x 1000 = 1000 =
    16 x 62.5 is refused, 2 x 1000 = 2000 = 16 x 125 launches."""
    model = spec(fp8="tensorwise", seq_length=1000)
    assert broken(model, mbs=2) is None
    assert broken(model, mbs=1) == (
        "plan.mbs=1 x seq_length/plan.cp=1000/1 = 1000 tokens per rank with FP8 (tensorwise): Transformer Engine's "
        "FP8 GEMMs need a multiple of 16")


def test_fp8_sequence_parallel_shard_rows_are_a_multiple_of_8():
    """assert_dim_for_fp8_exec checks the column-parallel input before its sequence-parallel all-gather
    (layernorm_linear.py:160): seq 1040 at TP 8 leaves 130 = 8 x 16.25 tokens a rank, at TP 2 520 = 8 x 65."""
    model = spec(fp8="delayed", seq_length=1040)
    assert broken(model, tp=2) is None
    assert broken(model, tp=8) == (
        "plan.sp=true with plan.tp=8: each TP rank's sequence shard of 130 tokens with FP8 (delayed): Transformer "
        "Engine's FP8 GEMMs need a multiple of 8")


def test_mxfp8_needs_multiples_of_32():
    """MXFP8 quantizes in blocks of 32 (MXFP8_BLOCK_SCALING_SIZE, constants.py:91): quantizer.cpp:876-878 refuses a
    tensor whose dims are not multiples of 32. FFN 11136 at TP 8: FC2 takes 1392 = 16 x 87 (fine for FP8) = 32 x 43.5."""
    assert broken(spec(fp8="delayed", ffn_hidden_size=11136), tp=8) is None
    assert broken(spec(fp8="mxfp8", ffn_hidden_size=11136), tp=8) == (
        "plan.tp=8 with FP8 (mxfp8): Transformer Engine's FP8 GEMMs need each dimension a multiple of 32; the fc2 GEMM's "
        "input per rank is 1392 wide")
    assert broken(spec(fp8="mxfp8"), tp=8) is None  # 14336 / 8 = 1792 = 32 x 56


def test_fp8_expert_weights_but_not_their_rows():
    """The experts' GEMMs are TE's GroupedLinear: their weights [moe_ffn x 2 / etp, h] and [h, moe_ffn / etp] meet the
    same multiples; their rows, the tokens routed to each expert, are padded to them by Fp8Padding
    (fp8_padding.py:116-122; megatron-core experts.py). moe_ffn 1400 = 16 x 87.5 is refused, 1408 = 16 x 88 launches."""
    moe = dict(num_experts=8, moe_router_topk=2)
    assert broken(spec(fp8="delayed", moe_ffn_hidden_size=1408, **moe), ep=1) is None
    assert broken(spec(fp8="delayed", moe_ffn_hidden_size=1400, **moe), ep=1) == (
        "plan.etp=1 with FP8 (delayed): Transformer Engine's FP8 GEMMs need each dimension a multiple of 16; the "
        "expert_fc2 GEMM's input per rank is 1400 wide")


def test_blockwise_fp8_all_gathers_blocks_of_128():
    """With sequence parallel TE asserts the local input is quantizable for its FP8 all-gather (utils.py:450-457 at
    linear.py:178); Float8BlockQuantizer.is_quantizable (float8_blockwise_tensor.py:194-203) wants both dims multiples
    of block_len = 128 (:51). Seq 4096 over CP 8 and TP 8: 4096 / 64 = 64 tokens a rank at mbs 1, 128 at mbs 2."""
    model = spec(fp8="blockwise", seq_length=4096)
    assert broken(spec(fp8="delayed", seq_length=4096), tp=8, cp=8, mbs=1) is None  # 64 = 8 x 8 rows: the per-tensor recipes take it
    assert broken(model, tp=8, cp=8, mbs=2) is None
    assert broken(model, tp=8, cp=8, mbs=1) == (
        "plan.sp=true with FP8 (blockwise): Transformer Engine all-gathers the sequence-parallel input in 1x128 FP8 "
        "blocks, so each TP rank's 64-token shard (mbs*seq_length/(cp*tp)) and hidden_size=4096 must be multiples of 128")


# -- TP communication overlap (userbuffers) -------------------------------------------------------------------------

def test_userbuffers_split_the_sequence_in_tp_chunks():
    """Megatron-LM gives initialize_ub the shape [mbs x seq / cp, h] (training/initialize.py:224) and TE cuts its rows
    in tp chunks (comm_gemm_overlap.cpp:695, 702): the sequence-parallel rule, seq / cp a multiple of tp, already
    asks it. Seq 8196 over TP 8: 1024.5 rows a rank."""
    assert broken(spec(seq_length=8192), tp=8, tp_comm_overlap=True) is None
    assert broken(spec(seq_length=8196), tp=8, tp_comm_overlap=True) == (
        "plan.sp=true: seq_length/cp=8196 must be a multiple of tp=8")


def test_userbuffers_take_no_blockwise_fp8():
    """fill_userbuffers_buffer_for_all_gather (module/base.py:467-603) handles Float8Quantizer /
    Float8CurrentScalingQuantizer and MXFP8Quantizer and raises "Unsupported quantizer for Userbuffers" for any other
    (:602-603); comm_gemm_overlap.cpp:177-178 takes only tensor scaling and MXFP8."""
    assert broken(spec(fp8="blockwise"), tp=2) is None  # no overlap
    assert broken(spec(fp8="delayed"), tp=2, tp_comm_overlap=True) is None
    assert broken(spec(fp8="blockwise"), tp=2, tp_comm_overlap=True) == (
        "train.tp_comm_overlap=true with FP8 (blockwise): Transformer Engine's userbuffers take delayed or tensorwise "
        "FP8 or MXFP8, not blockwise; set train.tp_comm_overlap=false or another train.fp8_recipe")


def test_userbuffers_with_mxfp8_need_multiples_of_128():
    """module/base.py:559-563: an MXFP8 all-gather through userbuffers raises unless the local shard's rows are a
    multiple of 128; comm_gemm_overlap.cpp:211-218 the same of the gathered tensor's width. Seq 4096 over CP 8 x
    TP 8: 64 rows at mbs 1 (a multiple of 32, fine without the overlap), 128 at mbs 2."""
    model = spec(fp8="mxfp8", seq_length=4096)
    assert broken(model, tp=8, cp=8, mbs=1) is None
    assert broken(model, tp=8, cp=8, mbs=2, tp_comm_overlap=True) is None
    assert broken(model, tp=8, cp=8, mbs=1, tp_comm_overlap=True) == (
        "train.tp_comm_overlap=true with FP8 (mxfp8): Transformer Engine's userbuffers need each TP rank's 64-token "
        "sequence shard (mbs*seq_length/(cp*tp)) and hidden_size=4096 multiples of 128")


# -- the argv check refuses what TE refuses -------------------------------------------------------------------------

ARGV = ("--num-layers 8 --hidden-size 256 --num-attention-heads 8 --group-query-attention --num-query-groups 4 "
        "--seq-length 128 --max-position-embeddings 128 --vocab-size 1000 --bf16 --global-batch-size 64").split()


def argv_problems(extra: str, *, world: int = 8, mbs: int = 1) -> list[str]:
    return violations([*ARGV, "--micro-batch-size", str(mbs), *extra.split()], world_size=world)


@pytest.mark.parametrize("extra, line", [
    ("--context-parallel-size 2 --window-size 64,0 --cp-comm-type a2a", None),
    ("--context-parallel-size 2 --window-size 64,0 --cp-comm-type all_gather", None),
    ("--context-parallel-size 2 --window-size 64,0",  # Megatron's default exchange, p2p (arguments.py:3221)
     "--cp-comm-type=p2p with --context-parallel-size=2 and model.window_size=64: Transformer Engine's context "
     "parallelism runs sliding-window attention only with a2a or all_gather"),
    # 8 heads / 4 groups per rank at TP 1: CP 8 divides the heads, not the groups (context_parallel.py:3365-3367)
    ("--context-parallel-size 8 --cp-comm-type a2a",
     "--cp-comm-type=a2a with --context-parallel-size=8: the all-to-all splits each TP rank's 8 attention heads and "
     "4 query groups"),
    # Megatron-LM's help text says allgather; TE raises ValueError on anything but its four (context_parallel.py:4110)
    ("--context-parallel-size 2 --cp-comm-type allgather",
     "--cp-comm-type allgather: Transformer Engine takes p2p, a2a, all_gather, a2a+p2p"),
    ("--context-parallel-size 2 --cp-comm-type p2p a2a", "--cp-comm-type with 2 values: give one for every layer"),
    ("--context-parallel-size 2 --cp-comm-type " + " ".join(["a2a"] * 8), None),  # one per layer
    ("--context-parallel-size 2 --cp-comm-type a2a+p2p",
     "--cp-comm-type a2a+p2p needs --hierarchical-context-parallel-sizes"),
    # the generated --softmax-type (TransformerConfig.softmax_type) with Megatron's default exchange, p2p
    ("--context-parallel-size 2 --softmax-type learnable",
     "--cp-comm-type=p2p with --context-parallel-size=2 and model.softmax_type=learnable: Transformer Engine's context "
     "parallelism runs the learnable softmax only in cuDNN's fused attention with a2a"),
    ("--context-parallel-size 2 --softmax-type learnable --cp-comm-type a2a", None),
    ("--attention-backend flash --softmax-type off-by-one",
     "model.attention_backend=flash with model.softmax_type=off-by-one: flash-attn has only the vanilla softmax"),
    ("--attention-backend fused --window-size 64,0",  # Megatron's --attention-dropout default is 0.1
     "model.attention_backend=fused with model.window_size=64 and model.attention_dropout=0.1: cuDNN's fused attention"),
    ("--attention-backend fused --window-size 64,0 --attention-dropout 0.0", None),
    ("--fp8-format hybrid --fp8-recipe blockwise --tensor-model-parallel-size 2 --sequence-parallel", None),
    ("--fp8-format hybrid --fp8-recipe blockwise --tensor-model-parallel-size 2 --sequence-parallel --tp-comm-overlap",
     "--tp-comm-overlap with FP8 (blockwise): Transformer Engine's userbuffers take delayed or tensorwise FP8 or MXFP8"),
], ids=lambda v: v if v is None else v[:60])
def test_the_argv_check_refuses_what_te_refuses(extra, line):
    # mbs 2: 2 x 128 / 2 = 128 tokens a TP rank, what blockwise FP8 all-gathers (multiples of 128)
    found = argv_problems(extra, mbs=2 if "blockwise" in extra else 1)
    if line is None:
        assert found == []
    else:
        assert any(f.startswith(line) for f in found), found


MOE_ARGV = "--num-experts 8 --moe-router-topk 2 --moe-grouped-gemm --fine-grained-activation-offloading"


@pytest.mark.parametrize("extra, refused", [
    ("--fp8-format hybrid --offload-modules expert_fc1", True),  # Megatron's default recipe is delayed
    ("--fp8-format hybrid --fp8-recipe delayed --offload-modules moe_act expert_fc1", True),
    ("--fp8-format hybrid --fp8-recipe tensorwise --offload-modules expert_fc1", False),  # Float8CurrentScalingQuantizer
    ("--fp8-format hybrid --fp8-recipe mxfp8 --offload-modules expert_fc1", False),  # main keeps the quantized input
    ("--offload-modules expert_fc1", False),  # bf16: no input quantizer
    ("--fp8-format hybrid --offload-modules moe_act", False),  # FC1's input stays quantized
])
def test_offloading_the_grouped_experts_fc1_input_takes_no_delayed_fp8(extra, refused):
    """megatron-core's TEGroupedMLP with expert_fc1 offloaded sets linear_fc1.save_original_input (experts.py:278-284,
    unless MXFP8 / NVFP4); TE's GroupedLinear forward raises for it when the input quantizer is a Float8Quantizer, the
    delayed-scaling one (grouped_linear.py:107-108; tensorwise's is a Float8CurrentScalingQuantizer, another class)."""
    found = argv_problems(f"{MOE_ARGV} {extra}")
    line = ("--offload-modules expert_fc1 with --moe-grouped-gemm and --fp8-recipe delayed (Megatron's default recipe): "
            "the grouped experts' FC1 then keeps its unquantized input, which Transformer Engine's GroupedLinear "
            "refuses under delayed scaling; use --fp8-recipe tensorwise, blockwise or mxfp8, or drop expert_fc1")
    assert (line in found) == refused, found
    # the sequential experts (no --moe-grouped-gemm) and the legacy GroupedMLP are no GroupedLinear
    assert line not in argv_problems(f"{MOE_ARGV.replace(' --moe-grouped-gemm', '')} {extra}")
    assert line not in argv_problems(f"{MOE_ARGV} --moe-use-legacy-grouped-gemm {extra}")


def test_the_argv_check_on_hierarchical_cp():
    """a2a+p2p with --hierarchical-context-parallel-sizes whose product is the CP size is Megatron-LM's
    (arguments.py:580-585); the planner does not price it, which the configuration rule says."""
    assert argv_problems("--context-parallel-size 4 --cp-comm-type a2a+p2p --hierarchical-context-parallel-sizes 2 3")[
        0].startswith("--hierarchical-context-parallel-sizes 2 3: their product must be --context-parallel-size 4")
    found = argv_problems("--context-parallel-size 4 --cp-comm-type a2a+p2p --hierarchical-context-parallel-sizes 2 2")
    assert [f.split(":")[0] for f in found] == ["--cp-comm-type=a2a+p2p"]


# -- evaluate refuses what TE refuses; the planner chooses the exchange ----------------------------------------------

EXAMPLE = ["model=llama3_8b", "model.window_size=4096", "model.window_attn_skip_freq=4", "cluster=dgx_h100_superpod",
           "cluster.num_devices=64"]
CP2 = ["plan.tp=1", "plan.pp=1", "plan.cp=2", "plan.mbs=2", "plan.zero=2"]  # a runner-up of the issue's example


def test_evaluate_refuses_megatrons_default_exchange_with_a_window():
    with pytest.raises(NestError) as err:
        api.evaluate([*EXAMPLE, *CP2])  # plan.cp_comm_type unset: Megatron's default, p2p
    assert str(err.value) == (
        "invalid configuration: plan.cp_comm_type=p2p with plan.cp=2 and model.window_size=4096: Transformer Engine's "
        "context parallelism runs sliding-window attention only with a2a or all_gather; use plan.cp_comm_type=a2a or "
        "all_gather, or plan.cp=1")


@pytest.mark.parametrize("comm_type", ["a2a", "all_gather"])
def test_evaluate_emits_and_prices_the_exchange(comm_type):
    plan = api.evaluate([*EXAMPLE, *CP2, f"plan.cp_comm_type={comm_type}"])
    argv = plan.megatron_args
    assert argv[argv.index("--cp-comm-type") + 1] == comm_type and argv.count("--cp-comm-type") == 1
    assert plan.parallel["cp_comm_type"] == comm_type
    assert violations(argv, world_size=plan.world_size) == []
    assert plan.predicted["breakdown"]["cp_comm"] > 0  # exposed, unlike the ring behind attention


def test_the_planner_chooses_a_working_exchange_for_the_window():
    """The issue's example with CP 2 pinned: p2p is refused, so the planner prices a2a and all_gather and keeps the
    faster (by the same cost model `evaluate` prices each with), and emits it."""
    plan = api.plan([*EXAMPLE, "plan.cp=2", "plan.tp=1", "plan.pp=1"])
    argv = plan.megatron_args
    chosen = plan.parallel["cp_comm_type"]
    assert chosen in ("a2a", "all_gather") and argv[argv.index("--cp-comm-type") + 1] == chosen
    assert violations(argv, world_size=plan.world_size) == []
    pins = [f"plan.{k}={plan.parallel[k]}" for k in ("tp", "pp", "dp", "cp", "ep", "vpp")]
    pins += [f"plan.mbs={plan.micro_batch_size}", f"plan.zero={plan.zero_stage}", f"plan.order={plan.rank_order}",
             f"plan.recompute={plan.recompute['granularity'] or 'none'}",
             f"plan.layers_per_stage=[{','.join(map(str, plan.layers_per_stage))}]"]
    other = "all_gather" if chosen == "a2a" else "a2a"
    slower = api.evaluate([*EXAMPLE, *pins, f"plan.cp_comm_type={other}"]).predicted["step_time_s"]
    assert plan.predicted["step_time_s"] <= slower


def test_the_planner_exchanges_a_learnable_softmax_by_a2a():
    """model.softmax_type=learnable with CP 2 pinned: the planner's default exchange (p2p) and all_gather are refused
    (TE context_parallel.py:4045-4047), so it prices a2a and emits it; `evaluate` refuses Megatron's default."""
    keys = ["model=llama3_8b", "model.softmax_type=learnable", "cluster=dgx_h100_superpod", "cluster.num_devices=64"]
    plan = api.plan([*keys, "plan.cp=2", "plan.tp=1", "plan.pp=1"])
    argv = plan.megatron_args
    assert plan.parallel["cp"] == 2 and plan.parallel["cp_comm_type"] == "a2a"
    assert argv[argv.index("--cp-comm-type") + 1] == "a2a" and argv[argv.index("--softmax-type") + 1] == "learnable"
    assert violations(argv, world_size=plan.world_size) == []
    with pytest.raises(NestError, match=r"^invalid configuration: plan\.cp_comm_type=p2p with plan\.cp=2 and "
                                        r"model\.softmax_type=learnable"):
        api.evaluate([*keys, *CP2])


@pytest.mark.slow
def test_the_issues_example_plans_a_working_exchange_or_no_cp():
    """`nest-megatron plan model=llama3_8b model.window_size=4096 model.window_attn_skip_freq=4
    cluster=dgx_h100_superpod cluster.num_devices=64`: its answer and every runner-up runs (a runner-up used CP 2
    with p2p); those with CP exchange K/V by a2a or all_gather, and some runner-up has CP."""
    plan = api.plan(EXAMPLE)
    rows = [(plan.parallel["cp"], plan.megatron_args)] + [(r["cp"], r["megatron_args"]) for r in plan.runners_up]
    for cp, argv in rows:
        if cp > 1:
            assert argv[argv.index("--cp-comm-type") + 1] in ("a2a", "all_gather")
        else:
            assert "--cp-comm-type" not in argv
        assert violations(argv, world_size=plan.world_size) == []
    assert any(cp > 1 for cp, _ in rows)


def test_the_users_exchange_is_a_constraint():
    """plan.cp_comm_type=p2p (what a --cp-comm-type p2p in the argv becomes) with a window: no plan with CP > 1;
    with CP pinned too, one line."""
    plan = api.plan([*EXAMPLE, "plan.cp_comm_type=p2p", "plan.tp=1", "plan.pp=1", "plan.zero=2"])
    assert plan.parallel["cp"] == 1 and all(r["cp"] == 1 for r in plan.runners_up)
    with pytest.raises(NestError, match=r"plan\.cp_comm_type=p2p with plan\.cp=2 and model\.window_size=4096: "
                                        r"Transformer Engine's context parallelism runs sliding-window attention only"):
        api.plan([*EXAMPLE, "plan.cp_comm_type=p2p", "plan.cp=2"])


@pytest.fixture(scope="module")
def llama():
    return load(["model=llama3_8b"]).config.model


@pytest.mark.parametrize("argv, user, expected", [
    ([], [], []),
    (["--cp-comm-type", "p2p"], [], [["plan.cp_comm_type=p2p"]]),
    (["--cp-comm-type", "a2a", "a2a"], [], [["plan.cp_comm_type=a2a"]]),  # one per layer, all alike
    (["--cp-comm-type", "p2p"], ["plan.cp_comm_type=a2a"], []),  # the user's own override wins
])
def test_the_argvs_exchange_becomes_a_pin(llama, argv, user, expected):
    assert [c.overrides for c in argv_constraints(argv, user, model=llama)] == expected


@pytest.mark.parametrize("argv", [["--cp-comm-type", "p2p", "a2a"], ["--cp-comm-type", "a2a+p2p"]])
def test_an_exchange_the_planner_cannot_price_is_one_line(llama, argv):
    with pytest.raises(NestError, match=r"^--cp-comm-type .*: the planner prices one of p2p, a2a, all_gather for every "
                                        r"layer"):
        argv_constraints(argv, [], model=llama)


LAUNCH = ["launch", "cluster=dgx_h100_superpod", "--nnodes", "2", "--nproc-per-node", "8", "--master-addr", "n1",
          "--dry-run"]
MODEL = ("--num-layers 8 --hidden-size 4096 --num-attention-heads 32 --group-query-attention --num-query-groups 8 "
         "--seq-length 8192 --max-position-embeddings 8192 --vocab-size 32000 --swiglu --normalization RMSNorm "
         "--disable-bias-linear --attention-dropout 0.0 --hidden-dropout 0.0 --window-size 4096,0 --bf16 "
         "--global-batch-size 256 --micro-batch-size 1").split()


def test_a_launch_keeps_the_users_exchange(capsys):
    """--cp-comm-type a2a with CP 2 pinned: the rewritten argv says a2a once; with p2p the launch is one line, exit 2."""
    assert cli.main([*LAUNCH, "--pin", "cp", "--", "pretrain_gpt.py", *MODEL, "--context-parallel-size", "2",
                     "--cp-comm-type", "a2a"]) == 0
    command = next(line for line in capsys.readouterr().out.splitlines() if " torchrun " in line).split()
    assert command.count("--cp-comm-type") == 1 and command[command.index("--cp-comm-type") + 1] == "a2a"
    assert cli.main([*LAUNCH, "--pin", "cp", "--", "pretrain_gpt.py", *MODEL, "--context-parallel-size", "2",
                     "--cp-comm-type", "p2p"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith(
        "nest-megatron launch: error: no plan keeps what the launch line fixes (pinned cp; --cp-comm-type p2p): no "
        "launchable configuration: plan.cp_comm_type=p2p with plan.cp=2 and --window-size (model.window_size)=4096: "
        "Transformer Engine's context parallelism runs sliding-window attention only with a2a or all_gather"), err


def test_a_launch_with_a_learnable_softmax_plans_a2a(capsys):
    """The argv's --softmax-type learnable is the model's (config/megatron_argv.py), so with CP 2 pinned the rewritten
    launch line exchanges by a2a, the one TE runs it with (context_parallel.py:4045-4047), where Megatron would ring."""
    model = [*MODEL[:MODEL.index("--window-size")], *MODEL[MODEL.index("--window-size") + 2:]]
    assert cli.main([*LAUNCH, "--pin", "cp", "--", "pretrain_gpt.py", *model, "--context-parallel-size", "2",
                     "--softmax-type", "learnable"]) == 0
    command = next(line for line in capsys.readouterr().out.splitlines() if " torchrun " in line).split()
    assert command[command.index("--cp-comm-type") + 1] == "a2a"
    assert command.count("--softmax-type") == 1 and command[command.index("--softmax-type") + 1] == "learnable"


# -- the cost model prices the exchange it emits --------------------------------------------------------------------

@pytest.mark.parametrize("comm_type, exposed_s", [
    # CP 2 inside a DGX H100 node (450 GB/s a direction, 3 us a message), tokens 1 x 8192 / 2 = 4096 a rank, bf16:
    # Q (and the output) 4096 x 4096 x 2 B = 33,554,432 B; K (and V) 4096 x 1024 x 2 B = 8,388,608 B.
    # a2a (context_parallel.py AttnFuncWithCPAndQKVOA2A): all-to-alls of Q, K, V and the output forward, of dO, dQ,
    #   dK, dV backward; one of X bytes over 2 ranks sends X/2: X / (2 x 450e9) + 3e-6.
    #   pass = (2 x 33,554,432 + 2 x 8,388,608) / 9e11 + 4 x 3e-6 = 1.05207e-4 s, forward and backward: 2.10414e-4
    ("a2a", 2 * ((2 * 33_554_432 + 2 * 8_388_608) / 9e11 + 4 * 3e-6)),
    # all_gather (AttnFuncWithCPAndKVAllGather): K and V gathered to 2 x 8,388,608 B each, (2-1)/2 of it received:
    #   16,777,216 / 9e11 + 3e-6 per gather; forward 2 gathers, backward 2 gathers and 2 reduce-scatters of dK, dV
    ("all_gather", 6 * (16_777_216 / 9e11 + 3e-6)),
])
def test_the_exchange_is_priced_as_te_runs_it(comm_type, exposed_s):
    from nest_megatron.cost.evaluate import groups_and_network
    from nest_megatron.cost.layer import layer_time
    from nest_megatron.model.kinds import LayerKind

    problem = load(["model=llama3_8b", "cluster=dgx_h100_superpod", "cluster.num_devices=8"]).problem
    cfg = ParallelConfig(cp=2, dp=4, cp_comm_type=comm_type)
    spans, net = groups_and_network(problem, cfg, None)
    lt = layer_time(problem.model, cfg=cfg, kind=LayerKind(), spans=spans, net=net, compute=problem.compute_model)
    assert lt.cp_comm == pytest.approx(exposed_s, rel=1e-9)
    assert lt.fwd_comm + lt.bwd_comm == pytest.approx(exposed_s, rel=1e-9)  # TP 1, no experts: all of it is CP's


def test_nemo_and_bridge_overrides_carry_the_exchange():
    """A NeMo 2 or Megatron-Bridge run of the plan must run the exchange it was priced with: TransformerConfig's
    cp_comm_type (megatron-core transformer_config.py:1030), which Megatron's TEDotProductAttention hands to TE."""
    from nest_megatron.integrations import bridge_overrides, nemo_overrides

    plan = api.evaluate([*EXAMPLE, *CP2, "plan.cp_comm_type=all_gather"])
    assert nemo_overrides(plan)["model.config.cp_comm_type"] == "all_gather"
    assert bridge_overrides(plan)["model.cp_comm_type"] == "all_gather"
    no_cp = api.evaluate([*EXAMPLE, "plan.tp=1", "plan.pp=1", "plan.cp=1", "plan.zero=2"])
    assert "model.config.cp_comm_type" not in nemo_overrides(no_cp) and "model.cp_comm_type" not in bridge_overrides(no_cp)
