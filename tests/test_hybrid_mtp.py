"""Multi-token prediction in a hybrid (Mamba) stack: model.mtp_hybrid_pattern (Megatron-LM's unified
--hybrid-layer-pattern 'MAIN/DEPTH/DEPTH', models/hybrid/hybrid_layer_allocation.py parse_hybrid_pattern at d98e8a6)
and model.mtp_use_repeated_layer (--mtp-use-repeated-layer: one depth's layers built once, run at every depth).

megatron-core 0.16.1, the newest release for Python 3.11, builds no hybrid MTP (its MambaModel has no mtp block), so
these numbers are worked out by hand, not traced.
"""

from __future__ import annotations

import pytest

from nest_megatron import api
from nest_megatron.config.load import load
from nest_megatron.config.megatron_argv import model_values, scan
from nest_megatron.cost.flops import megatron_model_flops
from nest_megatron.errors import NestError
from nest_megatron.launch.megatron_rules import violations
from nest_megatron.model.kinds import LayerKind
from nest_megatron.solver.baselines import total_params

# A small latent-free hybrid MoE: h 64, 4 heads of 16 (no GQA), 4 experts of 32 (squared ReLU: no GLU), top 2;
# Mamba 8 heads of 16 (d_inner 128), 2 groups of state 16.
HYBRID = ["model=tiny_gpt", "model.num_layers=3", "model.hybrid_layer_pattern=M*E", "model.hidden_size=64",
          "model.num_attention_heads=4", "model.num_query_groups=null", "model.ffn_hidden_size=32",
          "model.num_experts=4", "model.moe_router_topk=2", "model.squared_relu=true", "model.swiglu=false",
          "model.mamba_head_dim=16", "model.mamba_num_heads=8", "model.mamba_num_groups=2", "model.mamba_state_dim=16",
          "model.normalization=RMSNorm", "model.add_bias_linear=false", "model.position_embedding_type=none",
          "model.hidden_dropout=0.0", "model.attention_dropout=0.0", "model.vocab_size=256", "model.seq_length=64",
          "cluster=dgx_h100_superpod", "cluster.num_devices=8", "train.global_batch_size=16"]
TWO_DEPTHS = ["model.mtp_num_layers=2", "model.mtp_hybrid_pattern='*E'"]


def _problem(*keys):
    return load([*HYBRID, *keys]).problem


def test_a_depth_is_its_own_layers_the_first_with_the_depth_s_projection():
    assert _problem(*TWO_DEPTHS).model.mtp_depth_kinds == (LayerKind("attention", "none", mtp=True),
                                                           LayerKind("none", "moe"))


def test_two_depths_parameters_by_hand_and_the_repeated_layer_keeps_one():
    # One depth: the attention layer, its input norm 64 + QKV 64 x 192 + projection 64 x 64 = 16,448, with the depth's
    # enorm, hnorm and final norm 3 x 64 and eh_proj 2 x 64 x 64 = 8,384; the MoE layer, its norm 64 and router
    # 64 x 4 = 320 dense and 4 experts x (64 x 32 + 32 x 64) = 16,384: 41,536 a depth.
    plain = total_params(_problem())
    assert total_params(_problem(*TWO_DEPTHS)) - plain == 2 * 41_536
    assert total_params(_problem(*TWO_DEPTHS, "model.mtp_use_repeated_layer=true")) - plain == 41_536


def test_the_repeated_layer_runs_every_depth():
    # Megatron's model FLOPs count what runs: the same with or without the repeated layer. Each depth adds, a token,
    # forward and backward (x 6): the attention layer 64 x 192 + 64 x 64, eh_proj 128 x 64 and the logits 64 x 256
    # (the model's vocabulary padded to 128 x 1: 256), and the routed experts 2 x (64 x 32 + 32 x 64) (no router:
    # megatron/training/training.py num_floating_point_operations counts none), plus attention's square,
    # 2 x 2 x 64 (sequence) x 64 (q width) x 0.5 (causal), x 3.
    repeated = megatron_model_flops(_problem(*TWO_DEPTHS, "model.mtp_use_repeated_layer=true").model, batch_size=1, tp=1)
    separate = megatron_model_flops(_problem(*TWO_DEPTHS).model, batch_size=1, tp=1)
    assert repeated == separate
    plain = megatron_model_flops(_problem().model, batch_size=1, tp=1)
    per_token = 6 * (64 * 192 + 64 * 64 + 128 * 64 + 64 * 256 + 2 * (64 * 32 + 32 * 64)) + 3 * 2 * 64 * 64
    norms = 6 * 3 * 64  # the depth's enorm, hnorm and final norm, as Megatron's formula counts them
    assert separate - plain == 2 * 64 * (per_token + norms)


def test_the_unified_pattern_reads_back_and_is_emitted():
    plan = api.evaluate([*HYBRID, *TWO_DEPTHS, "model.mtp_use_repeated_layer=true", "plan.tp=1", "plan.pp=1",
                         "plan.dp=8", "plan.ep=2", "plan.mbs=1"])
    args = plan.megatron_args
    assert args[args.index("--hybrid-layer-pattern") + 1] == "M*E/*E/*E"
    assert "--mtp-use-repeated-layer" in args and args[args.index("--mtp-num-layers") + 1] == "2"
    read = model_values(scan(args))
    assert (read["hybrid_layer_pattern"], read["mtp_hybrid_pattern"], read["mtp_num_layers"],
            read["mtp_use_repeated_layer"]) == ("M*E", "*E", 2, True)
    assert violations(args, world_size=plan.world_size) == []


def test_a_pipelined_hybrid_keeps_its_depths_after_the_last_segment():
    plan = api.evaluate([*HYBRID, "model.num_layers=4", "model.hybrid_layer_pattern=M*EE", *TWO_DEPTHS, "plan.tp=1",
                         "plan.pp=2", "plan.dp=4", "plan.ep=2", "plan.mbs=1"])
    args = plan.megatron_args
    assert args[args.index("--hybrid-layer-pattern") + 1] == "M*|EE/*E/*E"
    assert violations(args, world_size=plan.world_size) == []


BASE_ARGV = ("--num-layers 3 --hidden-size 64 --num-attention-heads 4 --seq-length 64 --vocab-size 256 "
             "--num-experts 4").split()


def test_megatron_s_older_spelling_reads_as_the_unified_one():
    # --mtp-hybrid-override-pattern is repeated --mtp-num-layers times (arguments.py:774-785 at d98e8a6)
    read = model_values([*BASE_ARGV, "--hybrid-layer-pattern", "M*E", "--mtp-hybrid-override-pattern", "*E",
                         "--mtp-num-layers", "3"])
    assert (read["mtp_hybrid_pattern"], read["mtp_num_layers"]) == ("*E", 3)
    # the unified pattern's depth count wins over --mtp-num-layers (arguments.py:864-880)
    read = model_values([*BASE_ARGV, "--hybrid-layer-pattern", "M*E/*E/*E", "--mtp-num-layers", "3"])
    assert (read["hybrid_layer_pattern"], read["mtp_num_layers"]) == ("M*E", 2)


def test_depths_that_differ_are_one_line():
    with pytest.raises(NestError, match=r"^--hybrid-layer-pattern M\*E/\*E/E: every multi-token-prediction depth"):
        model_values([*BASE_ARGV, "--hybrid-layer-pattern", "M*E/*E/E"])


@pytest.mark.parametrize("keys, line", [
    (["model.mtp_num_layers=2"], "model.mtp_num_layers=2 with model.hybrid_layer_pattern: a hybrid stack's depth is "
                                 "its own layers; give model.mtp_hybrid_pattern"),
    (["model.mtp_hybrid_pattern='*E'"], r"model.mtp_hybrid_pattern=\*E: the layers of a multi-token-prediction depth; "
                                        "give model.mtp_num_layers"),
    (["model.mtp_num_layers=1", "model.mtp_hybrid_pattern='*G'"], r"model.mtp_hybrid_pattern=\*G: one layer a symbol"),
    (["model.mtp_use_repeated_layer=true"], "model.mtp_use_repeated_layer=true without model.mtp_num_layers"),
])
def test_a_wrong_depth_is_one_line(keys, line):
    with pytest.raises(NestError, match="^" + line):
        load([*HYBRID, *keys])


def test_a_gpt_stack_has_no_hybrid_depth():
    with pytest.raises(NestError, match=r"^model.mtp_hybrid_pattern=\*E without model.hybrid_layer_pattern"):
        load(["model=tiny_moe", "model.mtp_num_layers=1", "model.mtp_hybrid_pattern='*E'"])
