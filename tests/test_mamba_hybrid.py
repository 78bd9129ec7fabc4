"""Hybrid Mamba-2 / attention / MLP stacks (megatron-core MambaModel, --hybrid-layer-pattern): the Mamba mixer's
parameters, FLOPs and saved activations worked out by hand, the rules megatron-core asserts, the argv read and
written, and the shipped Nemotron-H 56B planned."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from script_module import load_module

from nest_megatron import api
from nest_megatron.config.load import load
from nest_megatron.config.megatron_argv import model_values, scan
from nest_megatron.config.schema import ModelConfig
from nest_megatron.cost.activations import layer_activation_terms
from nest_megatron.cost.flops import megatron_model_flops
from nest_megatron.errors import NestError
from nest_megatron.integrations.overrides import uneven_layout
from nest_megatron.launch.changes import change_lines, flag_reasons
from nest_megatron.launch.constraints import argv_constraints
from nest_megatron.launch.megatron_rules import argv_split, argv_vpp, violations
from nest_megatron.launch.rewrite import planner_part, rewrite
from nest_megatron.model.kinds import LayerKind
from nest_megatron.model.spec import ModelSpec
from nest_megatron.parallel.layout import as_chunks

MAMBA = LayerKind("mamba", "none")
# h 256 and Mamba head 64: d_inner = 2 x 256 = 512, 8 heads; 8 groups of state 128.
TINY = dict(name="tiny_hybrid", num_layers=4, hidden_size=256, ffn_hidden_size=1024, num_attention_heads=16,
            seq_length=128, vocab_size=1024, hybrid_layer_pattern="M*M-", normalization="RMSNorm",
            add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0)
TINY_KEYS = ["model=tiny_gpt", "model.num_attention_heads=16", "model.hybrid_layer_pattern=M*M-",
             "model.normalization=RMSNorm", "model.add_bias_linear=false", "model.hidden_dropout=0.0",
             "model.attention_dropout=0.0", "cluster=dgx_h100_superpod", "cluster.num_devices=8",
             "train.global_batch_size=64", "plan.mbs=1", "plan.zero=1", "plan.recompute=none"]


def tiny() -> ModelSpec:
    return ModelSpec(ModelConfig(**TINY))


def test_the_pattern_gives_each_layer_its_blocks():
    assert tiny().layer_kinds == (MAMBA, LayerKind("attention", "none"), MAMBA, LayerKind("none", "dense"))


def test_mamba_mixer_parameters_by_hand():
    # in_proj: 256 x (2 x 512 + 2 x 8 x 128 + 8) = 256 x 3080 = 788,480; conv1d: (512 + 2048) channels x (4 weights
    # + 1 bias) = 12,800; dt_bias, A_log, D: 3 x 8 = 24; gated norm: 512; out_proj: 512 x 256 = 131,072; the input
    # norm (RMSNorm): 256. Sum 933,144.
    assert tiny().mixer_params(MAMBA, tp=1) == 933_144
    # TP 2 splits every one of them but the input norm: 394,240 + 6,400 + 12 + 256 + 65,536 + 256 = 466,700.
    assert tiny().mixer_params(MAMBA, tp=2) == 466_700


def test_mamba_gemms_and_scan_flops_by_hand():
    gemms = tiny().mixer_gemms(MAMBA, tokens=128, tp=2, sp=True)
    assert [(g.name, g.m, g.n, g.k) for g in gemms] == [("in_proj", 128, 1540, 256), ("out_proj", 128, 256, 256)]
    # Megatron-LM's scan count, 7 x tokens x d_inner x state, on a TP rank: 7 x 128 x 512 x 128 / 2 = 29,360,128.
    assert tiny().attention_flops(micro_batch=1, tp=2, cp=1, kind=MAMBA) == 29_360_128


def test_megatron_s_hybrid_flops_by_hand():
    """megatron/training/training.py hybrid_flops at d98e8a6 for one sequence of 128 (x 3 for fwd + bwd):
    Mamba, 2 T h (2 d_in + 2 G N + H) + 7 T d_in N + 2 T d_in h = 2 T 256 x 3080 + 7 T 512 x 128 + 2 T 512 x 256
    = T (1,576,960 + 458,752 + 262,144) = 2,297,856 T; attention (16 heads of 16, no GQA), its projections
    2 T h (q + 2 kv) + 2 T q h = 2 T 256 x 768 + 2 T 256 x 256 = 524,288 T and its square 2 x 2 T s h x 0.5
    (causal) = 2 T 128 x 256 = 65,536 T; the MLP (squared ReLU off: GELU, h -> f -> h) 2 x 2 T h f = 1,048,576 T;
    the logits 2 T h V = 524,288 T. Per token 2 x 2,297,856 + 524,288 + 65,536 + 1,048,576 + 524,288
    = 6,758,400, x 3 x 128 tokens = 2,595,225,600."""
    assert megatron_model_flops(tiny(), batch_size=1, tp=1) == 2_595_225_600


def test_mamba_activations_by_hand():
    # One micro-batch of 128 tokens at TP 2 with SP (64 tokens a rank outside the mixer): the input norm's input and
    # output 2 x 256 x 64 each; in_proj's output 2 x 128 x 1540; the scan's output, the gated norm's input and its
    # output 2 x 128 x 256 each, and the norm's rstd 4 x 128 x 4.
    terms = layer_activation_terms(tiny(), mbs=1, tp=2, sp=True, cp=1, kind=MAMBA)
    assert terms == {"norm1_input": 32_768, "in_proj_input": 32_768, "mamba_zxbcdt": 394_240,
                     "mamba_scan_out": 65_536, "mamba_norm_input": 65_536 + 2_048, "out_proj_input": 65_536}


@pytest.mark.parametrize("keys, message", [
    # 8 Mamba heads do not split over TP 16 (the 16 attention heads would)
    (["plan.tp=16", "cluster.num_devices=16", "plan.dp=1", "plan.pp=1"],
     r"plan.tp=16: must divide the Mamba heads \(8\) and groups"),
    # TP 2 leaves 4 heads a rank: CP 8 cannot split them
    (["plan.tp=2", "plan.cp=8", "cluster.num_devices=16", "plan.dp=1", "plan.pp=1"],
     r"plan.cp=8: must divide the 4 Mamba heads of a TP rank"),
])
def test_megatron_core_s_mamba_rules(keys, message):
    with pytest.raises(NestError, match=message):
        api.evaluate([*TINY_KEYS, *keys])
    # TP 2 x CP 2 keeps 2 whole heads and 2 groups a rank: it runs
    api.evaluate([*TINY_KEYS, "plan.tp=2", "plan.cp=2", "plan.dp=2", "plan.pp=1"])


@pytest.mark.parametrize("keys, message", [
    (["model.hybrid_layer_pattern=M*G-"], r"'G' is no layer the planner prices; allowed are M \(Mamba\)"),
    (["model.hybrid_layer_pattern=M*-"], r"has 3 layers but model.num_layers=4"),
    (["model.hybrid_layer_pattern='M*|M-'"], r"^model.hybrid_layer_pattern: '\|' cuts the layers into pipeline stages, "
                                             r"which is the plan's split; give the layers alone and "
                                             r"plan.layers_per_stage=\[2, 2\]$"),
    (["model.hybrid_layer_pattern=M*E-"], r"'E' layers and model.num_experts go together"),
    (["model.mamba_num_groups=3"], r"model.mamba_num_groups=3: must divide the 8 Mamba heads"),
])
def test_a_wrong_hybrid_model_is_one_line(keys, message):
    with pytest.raises(NestError, match=message):
        load([*TINY_KEYS, *keys])


def test_the_plan_s_argv_reads_back_as_the_same_hybrid():
    plan = api.evaluate([*TINY_KEYS, "plan.tp=2", "plan.dp=4", "plan.pp=1"])
    read = model_values(scan(plan.megatron_args))
    assert (read["hybrid_layer_pattern"], read["mamba_state_dim"], read["mamba_head_dim"], read["mamba_num_groups"]) == (
        "M*M-", 128, 64, 8)
    # megatron-core 0.16.1's spelling is the same pattern; both at once Megatron refuses (arguments.py:745-748)
    base = "--num-layers 4 --hidden-size 256 --num-attention-heads 16 --seq-length 128 --vocab-size 1024".split()
    assert model_values([*base, "--hybrid-override-pattern", "M*M-"])["hybrid_layer_pattern"] == "M*M-"
    with pytest.raises(NestError, match="--hybrid-layer-pattern and --hybrid-override-pattern: one pattern"):
        model_values([*base, "--hybrid-override-pattern", "M*M-", "--hybrid-layer-pattern", "M*M-"])


def test_nemotron_h_56b_has_its_56_billion_parameters_and_plans():
    model = ModelSpec(load(["model=nemotron_h_56b"]).config.model)
    # By hand at TP 1: a Mamba layer 8192 x (2 x 16384 + 2 x 8 x 256 + 256) + 20480 x 5 + 3 x 256 + 16384
    # + 16384 x 8192 + 8192 = 438,432,512 (54 of them); an MLP layer 2 x 8192 x 32768 + 8192 = 536,879,104 (54);
    # an attention layer 8192 x (8192 + 2 x 1024) + 8192 x 8192 + 8192 = 151,003,136 (10); the embedding and the
    # untied output layer 131072 x 8192 each, the final norm 8192: 56,324,350,464 in all.
    total = (sum(n * sum(model.layer_params(tp=1, kind=k)) for k, n in model.kind_counts.items())
             + model.embedding_params(1) + model.output_params(tp=1, pp=2))
    assert total == 54 * 438_432_512 + 54 * 536_879_104 + 10 * 151_003_136 + 2 * 131072 * 8192 + 8192 == 56_324_350_464
    plan = api.plan(["model=nemotron_h_56b", "cluster=dgx_h100_superpod", "cluster.num_devices=256"])
    assert "--hybrid-layer-pattern" in plan.megatron_args
    assert 8 % plan.parallel["tp"] == 0  # megatron-core splits the 8 groups (and 256 heads) over TP


# The split of a hybrid stack is '|' segments of its pattern, segment k*pp + r rank r's k-th virtual stage
# (Megatron-LM d98e8a6 megatron/core/models/hybrid/hybrid_layer_allocation.py:458-470).
@pytest.mark.parametrize("keys, pattern", [
    # even at pp 2: two layers a rank
    (["plan.pp=2", "plan.dp=4"], "M*|M-"),
    # pp 2 x vpp 2, a layer a chunk: chunks 0, 2 on rank 0 ('M', 'M'), chunks 1, 3 on rank 1 ('*', '-')
    (["plan.pp=2", "plan.vpp=2", "plan.dp=4"], "M|*|M|-"),
    # the first rank holds one layer, the last the other three
    (["plan.pp=2", "plan.dp=4", "plan.decoder_first_pipeline_num_layers=1"], "M|*M-"),
    # a split of pp*vpp chunks as given, an empty one too
    (["plan.pp=2", "plan.dp=4", "plan.layers_per_stage=[0,1,2,1]"], "|M|*M|-"),
])
def test_a_hybrid_split_is_written_as_segments_of_the_pattern(keys, pattern):
    plan = api.evaluate([*TINY_KEYS, "plan.tp=1", *keys])
    args = plan.megatron_args
    assert args[args.index("--hybrid-layer-pattern") + 1] == pattern
    # Megatron-LM takes no other split or virtual-stage flag beside a hybrid pattern (arguments.py:814-838)
    assert not {"--num-virtual-stages-per-pipeline-rank", "--decoder-first-pipeline-num-layers",
                "--pipeline-model-parallel-layout"} & set(args)
    assert violations(args, world_size=8) == []
    # read back: the model's layers without the '|', the split and its virtual stages from the segments
    s = scan(args)
    assert model_values(s)["hybrid_layer_pattern"] == "M*M-"
    segments = tuple(len(x) for x in pattern.split("|"))
    assert argv_vpp(s, pp=2, num_layers=4) == len(segments) // 2
    assert argv_split(args, world_size=8) == (segments if len(set(segments)) > 1 else None)


BASE = ("--num-layers 4 --hidden-size 256 --num-attention-heads 16 --seq-length 128 --vocab-size 1024 "
        "--micro-batch-size 1 --global-batch-size 64 --pipeline-model-parallel-size 2").split()


@pytest.mark.parametrize("extra, line", [
    (["--hybrid-layer-pattern", "M*|M-", "--num-virtual-stages-per-pipeline-rank", "2"],
     "--num-virtual-stages-per-pipeline-rank with --hybrid-layer-pattern: Megatron-LM takes a hybrid stack's split and "
     "virtual stages only from '|' segments of the pattern (e.g. 'M*M-|M*M-' at pp 2); drop "
     "--num-virtual-stages-per-pipeline-rank"),
    (["--hybrid-layer-pattern", "M*M-", "--account-for-loss-in-pipeline-split"],
     "--account-for-loss-in-pipeline-split with --hybrid-layer-pattern: Megatron-LM takes a hybrid stack's split and "
     "virtual stages only from '|' segments of the pattern (e.g. 'M*M-|M*M-' at pp 2); drop "
     "--account-for-loss-in-pipeline-split"),
    (["--hybrid-layer-pattern", "M|*M-", "--decoder-first-pipeline-num-layers", "1"],
     "--decoder-first-pipeline-num-layers with '|' segments in --hybrid-layer-pattern: the segments already give the "
     "split; drop one of them"),
    (["--hybrid-layer-pattern", "M|*|M-"],
     "--hybrid-layer-pattern has 3 '|' segments: must be a multiple of --pipeline-model-parallel-size 2 (segment "
     "k*pp + r is rank r's k-th virtual stage)"),
])
def test_megatron_lm_s_hybrid_split_rules_on_an_argv(extra, line):
    assert violations([*BASE, *extra], world_size=8)[0] == line
    # a pattern without pipes splits by the first / last counts at pp > 1 (hybrid_layer_allocation.py:403-430)
    assert violations([*BASE, "--hybrid-layer-pattern", "M*M-", "--decoder-first-pipeline-num-layers", "1"],
                      world_size=8) == []


def test_nemotron_h_56b_pipelines_over_4_stages_unevenly():
    """118 layers do not split evenly over 4 stages (Megatron-LM's even split refuses them: 118 % 4 = 2); the plan
    cuts the pattern into 4 segments of whole layers, none far from the even share of 29.5: the DP balances their
    time, and a Mamba, an attention and an MLP layer take different times."""
    plan = api.plan(["model=nemotron_h_56b", "cluster=dgx_h100_superpod", "cluster.num_devices=256", "plan.pp=4",
                     "plan.vpp=1"])
    args = plan.megatron_args
    written = args[args.index("--hybrid-layer-pattern") + 1]
    segments = written.split("|")
    assert len(segments) == 4 and "".join(segments) == load(["model=nemotron_h_56b"]).config.model.hybrid_layer_pattern
    assert sum(map(len, segments)) == 118 and max(map(len, segments)) <= 32
    assert violations(args, world_size=256) == []


def test_a_launch_cuts_the_user_s_pattern_where_the_plan_splits():
    user = [*BASE[:-2], "--hybrid-layer-pattern", "M*M-"]
    plan = api.evaluate([*TINY_KEYS, "plan.tp=1", "plan.pp=2", "plan.dp=4", "plan.decoder_first_pipeline_num_layers=1"])
    final = rewrite(user, plan)
    assert final.count("--hybrid-layer-pattern") == 1 and final[final.index("--hybrid-layer-pattern") + 1] == "M|*M-"
    # megatron-core 0.16.1's spelling stays the user's (Megatron-LM main reads it too, arguments.py:743-755); its
    # pattern keeps '|' only where the split needs them, as that Megatron-LM takes none
    old = [*BASE[:-2], "--hybrid-override-pattern", "M*M-"]
    for keys, written in ((["plan.decoder_first_pipeline_num_layers=1"], "M|*M-"), ([], "M*M-")):
        plan = api.evaluate([*TINY_KEYS, "plan.tp=1", "plan.pp=2", "plan.dp=4", *keys])
        final = rewrite(old, plan)
        assert "--hybrid-layer-pattern" not in final and final[final.index("--hybrid-override-pattern") + 1] == written


def test_a_launch_says_why_the_pattern_changed():
    """A pattern cut into the split the user's own flags gave is only said another way; one cut for another pp goes
    with the pp change, whose line prices the user's pp with the user's pattern (the two reverted together)."""
    same = [*BASE, "--hybrid-layer-pattern", "M*M-", "--decoder-first-pipeline-num-layers", "1"]
    plan = api.evaluate([*TINY_KEYS, "plan.tp=1", "plan.pp=2", "plan.dp=4", "plan.decoder_first_pipeline_num_layers=1"])
    final = rewrite(same, plan)
    reasons = flag_reasons(planner_part(plan.megatron_args), same)
    assert reasons["--hybrid-layer-pattern"].startswith("the same split, said by '|' segments of the pattern")
    assert reasons["--decoder-first-pipeline-num-layers"] == reasons["--hybrid-layer-pattern"]
    priced = []
    other = [*BASE[:-2], "--hybrid-layer-pattern", "M*M-"]  # pp 1
    plan = api.evaluate([*TINY_KEYS, "plan.tp=1", "plan.pp=2", "plan.dp=4"])
    lines = change_lines(other, rewrite(other, plan), reasons=flag_reasons(planner_part(plan.megatron_args), other),
                         layout=lambda argv: priced.append(argv) or "priced")
    assert "--hybrid-layer-pattern: M*M- -> M*|M- (goes with --pipeline-model-parallel-size)" in lines
    reverted = scan(priced[0])  # the pp line's argv: the user's pp and the user's pattern
    assert reverted.get("--pipeline-model-parallel-size") is None and reverted.get("--hybrid-layer-pattern") == "M*M-"
    assert final[final.index("--hybrid-layer-pattern") + 1] == "M|*M-"


@pytest.mark.parametrize("pinned, kept", [(["pp"], "plan.layers_per_stage=[2,2]"),
                                          (["pp", "vpp"], "plan.layers_per_stage=[1,1,1,1]")])
def test_a_pinned_pp_keeps_the_segments_of_each_rank(pinned, kept):
    """--pin pp keeps each rank's layers of the user's segments and leaves the virtual stages free, as it does with
    first / last stage counts; pinning vpp too keeps every segment."""
    user = [*BASE, "--hybrid-layer-pattern", "M|*|M|-"]
    constraints = argv_constraints(user, [], model=ModelConfig(**TINY), pinned=pinned)
    assert [item for c in constraints for item in c.overrides] == [kept]


def test_nemo_and_bridge_overrides_refuse_a_hybrid_split_they_cannot_carry():
    plan = api.evaluate([*TINY_KEYS, "plan.tp=1", "plan.pp=2", "plan.dp=4", "plan.decoder_first_pipeline_num_layers=1"])
    with pytest.raises(NestError, match=r"^the plan splits the hybrid stack as 'M\|\*M-' \(pp 2, vpp 1\), which NeMo "
                                        r"/ Megatron-Bridge overrides do not carry"):
        uneven_layout(plan)
    # the even split at vpp 1 is the recipe's own pattern split by pp: nothing to carry
    assert uneven_layout(api.evaluate([*TINY_KEYS, "plan.tp=1", "plan.pp=2", "plan.dp=4"])) is None


MEGATRON_LM = os.environ.get("MEGATRON_LM_ROOT")


@pytest.mark.skipif(not MEGATRON_LM, reason="MEGATRON_LM_ROOT is not set (a Megatron-LM checkout; it is not on PyPI)")
@pytest.mark.parametrize("keys", [["plan.pp=2", "plan.vpp=2"], ["plan.pp=2", "plan.layers_per_stage=[0,1,2,1]"],
                                  ["plan.pp=2", "plan.decoder_first_pipeline_num_layers=1"]])
def test_megatron_lm_builds_each_rank_s_segment_as_planned(keys, monkeypatch):
    """Megatron-LM's own select_pipeline_segment (its file loaded alone; the installed megatron-core gives it the
    logging helpers, silenced) hands each rank and virtual stage the layers the plan put in that chunk."""
    allocation = load_module(Path(MEGATRON_LM) / "megatron/core/models/hybrid/hybrid_layer_allocation.py",
                             "megatron_lm_hybrid")
    monkeypatch.setattr(allocation, "log_on_each_pipeline_stage", lambda *a, **k: None)
    monkeypatch.setattr(allocation, "log_single_rank", lambda *a, **k: None)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda group=None: group[0])  # group: (rank, size)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: group[1])
    plan = api.evaluate([*TINY_KEYS, "plan.tp=1", "plan.dp=4", *keys])
    args = plan.megatron_args
    pattern, pp, vpp = args[args.index("--hybrid-layer-pattern") + 1], plan.parallel["pp"], plan.parallel["vpp"]
    chunks, order = as_chunks(tuple(plan.layers_per_stage), pp=pp, vpp=vpp), "M*M-"
    for chunk, layers in enumerate(chunks):
        rank, stage = chunk % pp, chunk // pp
        offset = sum(chunks[:chunk])
        built = allocation.select_pipeline_segment(pattern, (rank, pp), stage if vpp > 1 else None)
        assert built == (list(order[offset:offset + layers]), offset)
