"""megatron-core 0.16.1's real Mamba-2 layer (tests/mamba_meta.py builds it on the meta device) against a
parameter count worked out by hand, and against the cost model's ModelSpec.mixer_params; its two GEMMs (in_proj,
out_proj) against ModelSpec.mixer_gemms."""


import pytest
from mamba_meta import mamba_layer_params, mamba_projection_gemms
from test_mamba_hybrid import MAMBA, TINY

from nest_megatron.config.schema import ModelConfig
from nest_megatron.model.kinds import LayerKind
from nest_megatron.model.spec import ModelSpec

# One small shape: h=64, state N=16, head_dim P=16, groups G=2; heads H = expand 2 x h / P = 8, d_inner = H x P = 128.
SMALL = dict(hidden=64, state_dim=16, head_dim=16, num_groups=2)


@pytest.mark.parametrize("tp, expected", [
    # TP 1, by hand (megatron-core 0.16.1 ssm/mamba_mixer.py:268-379, ssm/mamba_layer.py:85):
    #   in_proj   h x (2 d_inner + 2 G N + H) = 64 x (256 + 64 + 8) = 64 x 328 = 20992
    #   conv1d    (d_inner + 2 G N) = 192 channels x (4 weights + 1 bias)      =   960
    #   dt_bias, A_log, D: H each = 3 x 8                                      =    24
    #   gated RMSNorm (ExtendedRMSNorm) weight d_inner                         =   128
    #   out_proj  d_inner x h = 128 x 64                                       =  8192
    #   pre-norm  RMSNorm weight h                                             =    64
    #   total                                                                  = 30360
    (1, 30360),
    # TP 2: every one of the mixer's tensors is split over TP (in_proj column-parallel on its output, out_proj
    # row-parallel on its input, conv1d / dt_bias / A_log / D / norm built from d_inner_local_tp, nheads_local_tp,
    # ngroups_local_tp, mamba_mixer.py:247-259); only the pre-norm (h) is whole on each rank:
    #   in_proj 64 x 328/2 = 10496; conv1d 96 x 5 = 480; 3 x 4 = 12; norm 64; out_proj 64 x 64 = 4096; pre-norm 64
    #   total 10496 + 480 + 12 + 64 + 4096 + 64 = 15212
    (2, 15212),
])
def test_megatron_mamba_layer_params_match_hand_count(tp, expected):
    assert mamba_layer_params(**SMALL, tp=tp) == expected


@pytest.mark.parametrize("tp, cp, expected", [
    # Context parallel splits no parameter: every CP rank keeps its TP rank's whole conv1d, dt_bias, A_log and D
    # and slices them in the forward pass (mamba_mixer.py:381-385, mamba_context_parallel.py:253-300), so the
    # counts are SMALL's TP ones above. CP 4 > G = 2 groups: each group's B/C state is repeated on 2 CP ranks
    # (group_repeat_count, mamba_context_parallel.py:112-118), still no parameter more.
    (1, 2, 30360), (2, 2, 15212), (1, 4, 30360), (2, 4, 15212),
])
def test_context_parallel_splits_no_mamba_parameter(tp, cp, expected):
    assert mamba_layer_params(**SMALL, tp=tp, cp=cp) == expected


@pytest.mark.parametrize("num_heads, num_groups, tp, cp, message", [
    # ngroups % tp_size (mamba_mixer.py:258): G = 2 groups cannot be split over TP 4, though its 8 heads can.
    (None, 2, 4, 1, "ngroups must be evenly divisible by tp_size"),
    # nheads_local_tp % cp_size (mamba_context_parallel.py:99-101): 8 heads over TP 2 x CP 8.
    (None, 2, 2, 8, "nheads must be evenly divisible by tp_size \\* cp_size"),
    # Fewer local groups than CP ranks: cp_size % ngroups_local_tp (:112-115): 24 heads in G = 6 groups, CP 8.
    (24, 6, 1, 8, "cp_size must be evenly divisible by ngroups/tp_size"),
    # At least as many: ngroups_local_tp % cp_size (:119-122): G = 12 groups, CP 8.
    (24, 12, 1, 8, "ngroups must be evenly divisible by tp_size \\* cp_size"),
])
def test_megatron_refuses_heads_and_groups_that_do_not_split(num_heads, num_groups, tp, cp, message):
    with pytest.raises(AssertionError, match=message):
        mamba_layer_params(hidden=64, state_dim=16, head_dim=16, num_groups=num_groups, num_heads=num_heads,
                           tp=tp, cp=cp)


def test_fp8_wants_an_in_proj_width_of_sixteens():
    # With fp8 MambaMixer asserts (2 d_inner + 2 G N + H) % 16 == 0 (mamba_mixer.py:241-245), on the whole width,
    # not a TP rank's. SMALL's 328 = 16 x 20.5 is refused.
    with pytest.raises(AssertionError, match="multiple of 16"):
        mamba_layer_params(**SMALL, fp8="hybrid")
    # mamba_num_heads H = 16 (d_inner = 16 x 16 = 256, not 2h = 128): 2 x 256 + 64 + 16 = 592 = 16 x 37 builds, and
    # by hand: in_proj 64 x 592 = 37888; conv1d (256 + 64) x 5 = 1600; 3 x 16 = 48; norm 256; out_proj 256 x 64
    # = 16384; pre-norm 64; total 56240.
    assert mamba_layer_params(**SMALL, num_heads=16, fp8="hybrid") == 56240


def _cfg_with_mamba(**mamba) -> ModelConfig:
    return ModelConfig(name="m", num_layers=2, hidden_size=256, ffn_hidden_size=1024, num_attention_heads=4,
                       seq_length=128, vocab_size=1024, normalization="RMSNorm", add_bias_linear=False,
                       hybrid_layer_pattern="M-", **mamba)


# A second shape, set apart from SMALL: mamba_num_heads given (H = 12, d_inner = 12 x 32 = 384, not 2 x 256), and
# TP 4 splitting G = 4 groups and 12 heads.
@pytest.mark.parametrize("mamba, tp", [
    (dict(mamba_state_dim=32, mamba_head_dim=32, mamba_num_groups=4), 1),
    (dict(mamba_state_dim=32, mamba_head_dim=32, mamba_num_groups=4), 2),
    (dict(mamba_state_dim=16, mamba_head_dim=32, mamba_num_groups=4, mamba_num_heads=12), 4),
])
def test_cost_model_mamba_params_match_megatron(mamba, tp):
    cfg = _cfg_with_mamba(**mamba)
    built = mamba_layer_params(hidden=cfg.hidden_size, state_dim=cfg.mamba_state_dim, head_dim=cfg.mamba_head_dim,
                               num_groups=cfg.mamba_num_groups, num_heads=cfg.mamba_num_heads, tp=tp)
    assert ModelSpec(cfg).mixer_params(LayerKind("mamba", "none"), tp) == built


@pytest.mark.parametrize("cfg, tp, by_hand", [
    # TINY (tests/test_mamba_hybrid.py): h 256, d_inner 512, 8 heads, 8 groups of state 128; one sequence of 128.
    #   TP 1: in_proj [2 x 512 + 2 x 8 x 128 + 8, 256] = [3080, 256], 2 x 128 x 3080 x 256 = 201,850,880 FLOPs;
    #         out_proj [256, 512], 2 x 128 x 256 x 512 = 33,554,432
    (ModelConfig(**TINY), 1, [("in_proj", (3080, 256), 201_850_880), ("out_proj", (256, 512), 33_554_432)]),
    #   TP 2: in_proj's outputs and out_proj's inputs halved, [1540, 256] and [256, 256]: half the FLOPs
    (ModelConfig(**TINY), 2, [("in_proj", (1540, 256), 100_925_440), ("out_proj", (256, 256), 16_777_216)]),
    # 12 heads of 32 given (d_inner 384), 4 groups of state 16, h 256, at TP 4:
    #   in_proj [(768 + 128 + 12) / 4, 256] = [227, 256], 2 x 128 x 227 x 256 = 14,876,672;
    #   out_proj [256, 96], 2 x 128 x 256 x 96 = 6,291,456
    (_cfg_with_mamba(mamba_state_dim=16, mamba_head_dim=32, mamba_num_groups=4, mamba_num_heads=12), 4,
     [("in_proj", (227, 256), 14_876_672), ("out_proj", (256, 96), 6_291_456)]),
])
def test_cost_model_mamba_gemms_are_megatron_s_projections(cfg, tp, by_hand):
    """The analytic Mamba GEMMs (ModelSpec.mixer_gemms: 2 m n k each, m = tokens) are megatron-core's in_proj and
    out_proj: n x k is the weight megatron-core builds on the TP rank ([out, in]), and 2 m n k the FLOPs
    FlopCounterMode counts for the module's forward, each also worked out by hand. The rest of the mixer's
    forward is the fused Triton scan, which does not run here (tests/mamba_meta.py); the cost model prices the
    scan by Megatron-LM's own formula (hybrid_flops' 7 x tokens x d_inner x state), hand-checked in
    tests/test_mamba_hybrid.py (test_mamba_gemms_and_scan_flops_by_hand, test_megatron_s_hybrid_flops_by_hand)."""
    traced = mamba_projection_gemms(hidden=cfg.hidden_size, state_dim=cfg.mamba_state_dim, head_dim=cfg.mamba_head_dim,
                                    num_groups=cfg.mamba_num_groups, num_heads=cfg.mamba_num_heads, tp=tp, tokens=128)
    assert traced == by_hand
    priced = ModelSpec(cfg).mixer_gemms(MAMBA, tokens=128, tp=tp, sp=False)
    assert [(g.name, (g.n, g.k), g.flops) for g in priced] == traced
    assert all(g.m == 128 for g in priced)
