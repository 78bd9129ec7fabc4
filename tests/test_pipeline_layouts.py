"""Pipeline layouts as Megatron runs them (parallel/layout.py): every form of giving the layer split -- even, the
embedding and / or loss counted as layers, first / last stage layers, a layout string -- turns into the layers of each
model chunk as megatron-core builds them; the plan emits the simplest flags for a split and reads them back; the
plan.* keys, the argv rules and the launch constraints of each form."""

from __future__ import annotations

import itertools
import random

import pytest
from megatron_core_split import megatron_core_chunks, split_fields, split_flags

from nest_megatron import api
from nest_megatron.config.load import load
from nest_megatron.emit.megatron import split_args
from nest_megatron.errors import NestError
from nest_megatron.launch.constraints import argv_constraints
from nest_megatron.launch.megatron_rules import argv_split, violations
from nest_megatron.parallel.config import ParallelConfig
from nest_megatron.parallel.layout import (
    EVEN,
    SplitForm,
    chunk_layers,
    form_problem,
    layout_stages,
    layout_string,
    rank_layers,
    searched_splits,
    simplest_form,
    split_hint,
)

ACCOUNT = SplitForm(account_for_embedding_in_pipeline_split=True, account_for_loss_in_pipeline_split=True)
FLAGS_BOTH = ["--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split"]
# Llama 3.1 405B's shape (126 layers of 16,384, 128 heads in 8 groups) on 1,024 H100s
LLAMA_405B = ["model=llama3_70b", "model.num_layers=126", "model.hidden_size=16384", "model.ffn_hidden_size=53248",
              "model.num_attention_heads=128", "model.seq_length=8192", "train.global_batch_size=512",
              "cluster=dgx_h100_superpod", "cluster.num_devices=1024"]
# Qwen3-235B-A22B (HF Qwen/Qwen3-235B-A22B config.json: 94 layers of 4,096, 64 heads in 4 groups of 128, 128 experts
# of 1,536, top 8, vocabulary 151,936, untied, QK norm) as Megatron-Bridge's H100 perf recipe runs it: 256 GPUs, TP 2,
# PP 8, VPP 4, EP 32, micro-batch 1, global batch 8,192, sequence 4,096
# (src/megatron/bridge/perf_recipes/qwen/h100/qwen3_moe.py qwen3_235b_a22b_pretrain_256gpu_h100_bf16_config, @067f987)
QWEN3_235B = ["model=mixtral_8x7b", "model.name=qwen3_235b_a22b", "model.num_layers=94", "model.hidden_size=4096",
              "model.ffn_hidden_size=12288", "model.num_attention_heads=64", "model.num_query_groups=4",
              "model.kv_channels=128", "model.num_experts=128", "model.moe_router_topk=8",
              "model.moe_ffn_hidden_size=1536", "model.vocab_size=151936", "model.seq_length=4096",
              "model.qk_layernorm=true", "cluster=dgx_h100_superpod", "cluster.num_devices=256",
              "train.global_batch_size=8192", "plan.tp=2", "plan.pp=8", "plan.vpp=4", "plan.ep=32", "plan.etp=1",
              "plan.mbs=1"]


def offsets(chunks: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    """(layers, first layer) of each chunk: a chunk starts after every chunk before it (Megatron's layer ids)."""
    return tuple((n, sum(chunks[:c])) for c, n in enumerate(chunks))


# -- hand-worked splits ------------------------------------------------------------------------------------------

def test_llama31_405b_at_pp8_vpp8_with_the_embedding_and_loss_counted():
    # 126 + 2 = 128 layers counted = 8 ranks x 16 = 8 x 8 chunks of 2 (transformer_block.py:148-186); the first chunk
    # (rank 0's vp 0) holds the embedding and so 2 - 1 = 1 transformer layer (:191-196), the last (rank 7's vp 7) the
    # loss and 1 (:198-201), the 62 others 2: 1 + 62 x 2 + 1 = 126. Rank 0 holds chunks 0, 8, ..., 56: 1 + 7 x 2 = 15.
    chunks = (1, *[2] * 62, 1)
    assert chunk_layers(ACCOUNT, num_layers=126, pp=8, vpp=8) == chunks
    assert rank_layers(chunks, pp=8) == [15, 16, 16, 16, 16, 16, 16, 15]
    assert megatron_core_chunks(126, 8, virtual_pipeline_model_parallel_size=8, account_for_embedding_in_pipeline_split=True,
                                account_for_loss_in_pipeline_split=True) == offsets(chunks)


def test_qwen3_235b_at_pp8_vpp4_as_megatron_bridge_runs_it():
    # Megatron-Bridge's qwen3_235b_a22b_pretrain_256gpu_h100_bf16_config (recipes/qwen/h100/qwen3_moe.py @067f987)
    # counts the embedding and the loss (account_for_*_in_pipeline_split = True); its perf recipe keeps that at
    # PP 8 VP 4: 94 + 2 = 96 = 8 x 4 chunks of 3; the first and last chunks hold 2: 2 + 30 x 3 + 2 = 94.
    chunks = (2, *[3] * 30, 2)
    assert chunk_layers(ACCOUNT, num_layers=94, pp=8, vpp=4) == chunks
    assert megatron_core_chunks(94, 8, virtual_pipeline_model_parallel_size=4, account_for_embedding_in_pipeline_split=True,
                                account_for_loss_in_pipeline_split=True) == offsets(chunks)


def test_first_and_last_stage_layers_with_virtual_stages():
    # 126 layers at pp 8 vpp 2, first 10, last 8: the 6 middle ranks share 126 - 18 = 108, 18 each; every rank splits
    # its layers over its 2 chunks: rank 0 5 + 5, the middle 9 + 9, rank 7 4 + 4; in chunk order (k*8 + rank):
    chunks = (5, 9, 9, 9, 9, 9, 9, 4) * 2
    form = SplitForm(decoder_first_pipeline_num_layers=10, decoder_last_pipeline_num_layers=8)
    assert chunk_layers(form, num_layers=126, pp=8, vpp=2) == chunks
    # transformer_layer.py:79-167: rank 0's second chunk starts at 1 x (5 + 54 + 4) = 63
    assert megatron_core_chunks(126, 8, virtual_pipeline_model_parallel_size=2, num_layers_in_first_pipeline_stage=10,
                                num_layers_in_last_pipeline_stage=8) == offsets(chunks)
    # only the first: 28 layers at pp 4 vpp 2, first 4, the three others (28 - 4) / 3 = 8
    first = SplitForm(decoder_first_pipeline_num_layers=4)
    assert chunk_layers(first, num_layers=28, pp=4, vpp=2) == (2, 4, 4, 4, 2, 4, 4, 4)


def test_a_layout_is_parsed_as_megatron_core_parses_it():
    from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout

    for layout in ("Et*3|(tt|)*29,m|L", "E|(tt|)*2,(t|)*4,mL", "Et|(t*2|)*62,tL", "E,t*2|(|)*3,t*4L", "E|t*12|(t|)*3*2|L"):
        ours = layout_stages(layout)
        theirs = PipelineParallelLayerLayout.parse_str_to_list(layout)
        assert ours == ["".join({"embedding": "E", "loss": "L", "decoder": "t", "mtp": "m"}[t.name] for t in stage)
                        for stage in theirs]


# -- every form against megatron-core's own code -----------------------------------------------------------------

def _forms(num_layers: int, pp: int, vpp: int, rng: random.Random) -> list[SplitForm]:
    out = [EVEN, SplitForm(account_for_embedding_in_pipeline_split=True),
           SplitForm(account_for_loss_in_pipeline_split=True), ACCOUNT]
    counts = [None, 0, 1, 2, 3, 4, 6]
    out += [SplitForm(decoder_first_pipeline_num_layers=f, decoder_last_pipeline_num_layers=last)
            for f, last in itertools.product(counts, counts) if (f, last) != (None, None)]
    for _ in range(4):  # random chunk splits as layouts, a few with one layer too many or an MTP layer
        chunks = [rng.randint(0, 3) for _ in range(pp * vpp)]
        chunks[rng.randrange(len(chunks))] += max(0, num_layers - sum(chunks))
        layout = layout_string(tuple(chunks))
        if rng.random() < 0.2:
            layout = layout.replace("L", "mL")
        out.append(SplitForm(pipeline_model_parallel_layout=layout))
    return out


def _megatron_fields(form: SplitForm, vpp: int) -> dict:
    fields = {"account_for_embedding_in_pipeline_split": form.account_for_embedding_in_pipeline_split,
              "account_for_loss_in_pipeline_split": form.account_for_loss_in_pipeline_split,
              "num_layers_in_first_pipeline_stage": form.decoder_first_pipeline_num_layers,
              "num_layers_in_last_pipeline_stage": form.decoder_last_pipeline_num_layers,
              "pipeline_model_parallel_layout": form.pipeline_model_parallel_layout}
    if form.pipeline_model_parallel_layout is None:  # a layout sets vpp itself (Megatron-LM takes no vpp flag with it)
        fields["virtual_pipeline_model_parallel_size"] = vpp if vpp > 1 else None
    return fields


def test_every_form_builds_what_megatron_core_builds():
    """For a grid of (layers, pp, vpp, form): megatron-core's TransformerConfig and get_num_layers_to_build /
    get_transformer_layer_offset, run as every rank, accept exactly what form_problem accepts and build chunk_layers."""
    rng = random.Random(18)
    checked = refused = 0
    for num_layers, pp, vpp in itertools.product((4, 6, 8, 9, 12), (1, 2, 3, 4), (1, 2, 3)):
        if vpp > 1 and pp == 1:
            continue
        for form in _forms(num_layers, pp, vpp, rng):
            layout_vpp = len(layout_stages(form.pipeline_model_parallel_layout)) // pp if form.pipeline_model_parallel_layout else vpp
            ours = form_problem(form, num_layers=num_layers, pp=pp, vpp=layout_vpp or 1)
            theirs = megatron_core_chunks(num_layers, pp, **_megatron_fields(form, vpp))
            case = (num_layers, pp, vpp, form)
            if ours is None:
                assert theirs == offsets(chunk_layers(form, num_layers=num_layers, pp=pp, vpp=layout_vpp)), case
                checked += 1
            elif pp == 1 and None not in form.first_last and not isinstance(theirs, Exception):
                # Stricter than megatron-core: with one stage both counts are its own, and megatron-core (the middle
                # count -1 = stages -1 passes transformer_config.py:2341-2351) builds the last one.
                assert theirs == ((form.decoder_last_pipeline_num_layers, 0),), case
                refused += 1
            else:
                # megatron-core refuses, or counts a rank's layers below 0 (first / last above num_layers pass its
                # checks; the model would then build fewer layers than num_layers): nest refuses both
                assert isinstance(theirs, Exception) or min(n for n, _ in theirs) < 0, (case, ours, theirs)
                refused += 1
    assert checked > 200 and refused > 200  # both sides of every rule are exercised


# -- the simplest flags, and back ----------------------------------------------------------------------------------

ROUND_TRIPS = [
    # (layers, pp, vpp, chunks, the flags the plan emits for them)
    (32, 4, 2, (4,) * 8, ["--num-virtual-stages-per-pipeline-rank", "2"]),  # even
    (30, 4, 1, (7, 8, 8, 7), FLAGS_BOTH),  # 30 + 2 = 32 = 4 x 8
    (31, 4, 1, (7, 8, 8, 8), ["--account-for-embedding-in-pipeline-split"]),  # 31 + 1 = 4 x 8
    (31, 4, 1, (8, 8, 8, 7), ["--account-for-loss-in-pipeline-split"]),
    (126, 8, 8, (1, *[2] * 62, 1), [*FLAGS_BOTH, "--num-virtual-stages-per-pipeline-rank", "8"]),
    (28, 4, 2, (2, 4, 4, 4, 2, 4, 4, 4), ["--decoder-first-pipeline-num-layers", "4",
                                          "--num-virtual-stages-per-pipeline-rank", "2"]),
    (27, 4, 1, (9, 6, 6, 6), ["--decoder-first-pipeline-num-layers", "9"]),
    (22, 4, 1, (6, 6, 6, 4), ["--decoder-last-pipeline-num-layers", "4"]),
    (20, 2, 1, (6, 14), ["--decoder-first-pipeline-num-layers", "6"]),
    (126, 8, 2, (5, 9, 9, 9, 9, 9, 9, 4) * 2, ["--decoder-first-pipeline-num-layers", "10",
                                               "--decoder-last-pipeline-num-layers", "8",
                                               "--num-virtual-stages-per-pipeline-rank", "2"]),
    (126, 8, 8, (0, *[2] * 63), ["--pipeline-model-parallel-layout", "E|(t*2|)*62,t*2L"]),
    (16, 4, 2, (1, 2, 2, 2, 2, 3, 2, 2), ["--pipeline-model-parallel-layout", "Et|(t*2|)*4,t*3|t*2|t*2L"]),
    (8, 4, 1, (0, 4, 4, 0), ["--pipeline-model-parallel-layout", "E|(t*4|)*2,L"]),
]


@pytest.mark.parametrize(("layers", "pp", "vpp", "chunks", "flags"), ROUND_TRIPS)
def test_a_split_goes_to_its_simplest_flags_and_back(layers, pp, vpp, chunks, flags):
    args = split_args(ParallelConfig(pp=pp, vpp=vpp), num_layers=layers, layers_per_stage=chunks)
    assert split_flags(args) == flags
    argv = ["--num-layers", str(layers), "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
            "--max-position-embeddings", "64", "--vocab-size", "128", "--micro-batch-size", "1",
            "--global-batch-size", str(4 * pp), "--pipeline-model-parallel-size", str(pp), *args]
    assert violations(argv, world_size=pp) == []
    even = flags[:1] in ([], ["--num-virtual-stages-per-pipeline-rank"])
    assert argv_split(argv, world_size=pp) == (None if even else chunks)
    assert megatron_core_chunks(layers, pp, **split_fields(args)) == offsets(chunks)


def _simplicity(form: SplitForm) -> int:
    if form.pipeline_model_parallel_layout is not None:
        return 3
    return 2 if form.first_last != (None, None) else 1 if any(form.accounts) else 0


def test_the_simplest_form_of_every_searched_split_builds_it():
    for layers, pp, vpp in [(126, 8, 8), (94, 8, 4), (80, 4, 2), (30, 2, 3), (126, 8, 2), (96, 2, 2), (32, 4, 2)]:
        family = searched_splits(layers, pp, vpp)
        forms = [simplest_form(chunks, num_layers=layers, pp=pp) for chunks in family]
        for chunks, form in zip(family, forms):
            assert form_problem(form, num_layers=layers, pp=pp, vpp=vpp) is None
            assert chunk_layers(form, num_layers=layers, pp=pp, vpp=vpp) == chunks
        # simplest first: even, the embedding / loss counted, first / last counts, layouts (equal times go first)
        assert [_simplicity(f) for f in forms] == sorted(_simplicity(f) for f in forms)


def test_a_nemo_or_bridge_target_gets_the_split_as_a_layout():
    from nest_megatron.integrations.bridge import bridge_overrides
    from nest_megatron.integrations.nemo import nemo_overrides

    plan = api.evaluate([*LLAMA_405B, "plan.tp=8", "plan.pp=8", "plan.vpp=8", "plan.recompute=full", *(
        f"plan.{f[2:].replace('-', '_')}=true" for f in FLAGS_BOTH)])
    assert split_flags(plan.megatron_args) == [*FLAGS_BOTH, "--num-virtual-stages-per-pipeline-rank", "8"]
    assert nemo_overrides(plan)["trainer.strategy.pipeline_model_parallel_layout"] == "Et|(t*2|)*62,tL"
    assert bridge_overrides(plan)["model.pipeline_model_parallel_layout"] == "Et|(t*2|)*62,tL"


# -- evaluate: the plan.* keys -------------------------------------------------------------------------------------

def test_evaluate_prices_the_405b_at_pp8_vpp8_given_as_megatron_users_give_it():
    pins = [*LLAMA_405B, "plan.tp=8", "plan.pp=8", "plan.vpp=8", "plan.recompute=full"]
    with pytest.raises(NestError) as err:  # Megatron's even split does not exist there: the line says what does
        api.evaluate(pins)
    assert str(err.value) == (
        "invalid configuration: plan.pp=8 x plan.vpp=8: must divide num_layers=126 for an even split; give the split, "
        "e.g. plan.account_for_embedding_in_pipeline_split=true plan.account_for_loss_in_pipeline_split=true "
        "(126 + 2 = 128 = 8 x 8 x 2)")
    counted = api.evaluate([*pins, "plan.account_for_embedding_in_pipeline_split=true",
                            "plan.account_for_loss_in_pipeline_split=true"])
    assert counted.layers_per_stage == [1, *[2] * 62, 1]
    # the same split given as a layout, as chunks, or as pp entries of... (not: 15 is no multiple of 8): priced alike
    for keys in (["plan.pipeline_model_parallel_layout=Et|(t*2|)*62,tL"],
                 [f"plan.layers_per_stage=[{','.join(map(str, [1, *[2] * 62, 1]))}]"]):
        same = api.evaluate([*pins, *keys])
        assert same.predicted["step_time_s"] == counted.predicted["step_time_s"]
        assert same.megatron_args == counted.megatron_args  # emitted the simplest way
    # the stage holding the embedding and the loss is the lighter: 15 layers against 16
    assert counted.predicted["memory_per_stage_gib"][0] < counted.predicted["memory_per_stage_gib"][1]


def test_evaluate_prices_qwen3_235b_at_pp8_vpp4():
    with pytest.raises(NestError, match=r"plan.vpp=4: must divide num_layers=94 for an even split; give the split, e.g. "
                                        r"plan.account_for_embedding_in_pipeline_split=true"):
        api.evaluate(QWEN3_235B)
    plan = api.evaluate([*QWEN3_235B, "plan.account_for_embedding_in_pipeline_split=true",
                         "plan.account_for_loss_in_pipeline_split=true"])
    assert plan.layers_per_stage == [2, *[3] * 30, 2] and plan.parallel["vpp"] == 4
    assert split_flags(plan.megatron_args) == [*FLAGS_BOTH, "--num-virtual-stages-per-pipeline-rank", "4"]
    assert violations(plan.megatron_args, world_size=plan.world_size) == []


def test_first_last_keys_with_virtual_stages():
    plan = api.evaluate([*LLAMA_405B, "plan.tp=8", "plan.pp=8", "plan.vpp=2", "plan.recompute=full",
                         "plan.decoder_first_pipeline_num_layers=10", "plan.decoder_last_pipeline_num_layers=8"])
    assert plan.layers_per_stage == [5, 9, 9, 9, 9, 9, 9, 4] * 2
    assert split_flags(plan.megatron_args) == ["--decoder-first-pipeline-num-layers", "10",
                                               "--decoder-last-pipeline-num-layers", "8",
                                               "--num-virtual-stages-per-pipeline-rank", "2"]


SMALL = ["model=tiny_gpt", "cluster=dgx_h100_superpod", "cluster.num_devices=16", "train.global_batch_size=64"]


@pytest.mark.parametrize(("keys", "line"), [
    (["plan.pp=2", "plan.pipeline_model_parallel_layout=Et*2|t*2L", "plan.account_for_loss_in_pipeline_split=true"],
     "plan.pipeline_model_parallel_layout with plan.account_for_loss_in_pipeline_split: Megatron takes one way to give "
     "the layer split (megatron/core/transformer/transformer_config.py:2242-2259); give one"),
    (["plan.pp=2", "plan.pipeline_model_parallel_layout=Et*2|t*2L", "plan.decoder_first_pipeline_num_layers=2"],
     "plan.pipeline_model_parallel_layout with plan.decoder_first_pipeline_num_layers: Megatron takes one way"),
    (["plan.decoder_last_pipeline_num_layers=1", "plan.account_for_embedding_in_pipeline_split=true"],
     "plan.decoder_last_pipeline_num_layers with plan.account_for_embedding_in_pipeline_split: Megatron takes one way"),
    (["plan.pp=2", "plan.layers_per_stage=[2,2]", "plan.account_for_loss_in_pipeline_split=true"],
     "plan.layers_per_stage with plan.account_for_loss_in_pipeline_split: give the layer split one way"),
    (["plan.pipeline_model_parallel_layout=Et*2|t*2L"], "plan.pipeline_model_parallel_layout=Et*2|t*2L: needs plan.pp"),
    (["plan.pp=2", "plan.pipeline_model_parallel_layout=Et*2|t*3L"],
     "plan.pipeline_model_parallel_layout=Et*2|t*3L: 5 transformer layers (t), but num_layers=4"),
    (["plan.pp=2", "plan.vpp=2", "plan.pipeline_model_parallel_layout=Et*2|t*2L"],
     "plan.pipeline_model_parallel_layout=Et*2|t*2L: its stages make plan.vpp=1, but plan.vpp=2 is given"),
    (["plan.pp=2", "plan.pipeline_model_parallel_layout=Et*2|t*2mL"],
     "plan.pipeline_model_parallel_layout=Et*2|t*2mL: 1 MTP layers (m), but the model has no multi-token prediction"),
    (["plan.decoder_first_pipeline_num_layers=0"], "plan.decoder_first_pipeline_num_layers=0: allowed 1..4"),
])
def test_a_bad_split_key_is_one_line(keys, line):
    with pytest.raises(NestError) as err:
        load([*SMALL, *keys])
    assert str(err.value).startswith(line) and "\n" not in str(err.value)


def test_a_layout_key_with_commas_and_repetitions():
    plan = api.evaluate([*SMALL, "plan.pp=2", "plan.pipeline_model_parallel_layout=E,t|(t|)*2,tL"])
    assert plan.parallel["vpp"] == 2 and plan.layers_per_stage == [1, 1, 1, 1]
    assert split_flags(plan.megatron_args) == ["--num-virtual-stages-per-pipeline-rank", "2"]  # the even split


def test_a_form_that_does_not_build_at_the_pinned_sizes_names_its_rule():
    with pytest.raises(NestError, match=r"plan.account_for_embedding_in_pipeline_split=true: num_layers \+ 1 = 5 must be a "
                                        r"multiple of plan.pp=2"):
        api.evaluate([*SMALL, "plan.pp=2", "plan.account_for_embedding_in_pipeline_split=true"])


def test_plan_searches_only_where_a_pinned_form_builds():
    # 4 layers, the loss counted: 5 layers split over pp ranks -- only pp 1 or 5 (16 GPUs: pp 1)
    plan = api.plan([*SMALL, "plan.account_for_loss_in_pipeline_split=true", "plan.vpp=1"])
    assert plan.parallel["pp"] == 1
    plan = api.plan([*SMALL, "model.num_layers=6", "plan.pp=2", "plan.account_for_embedding_in_pipeline_split=true",
                     "plan.account_for_loss_in_pipeline_split=true"])
    assert chunk_layers(ACCOUNT, num_layers=6, pp=2, vpp=plan.parallel["vpp"]) == tuple(plan.layers_per_stage)
    assert FLAGS_BOTH == split_flags(plan.megatron_args)[:2]


# -- a launch that keeps the argv's split --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def model():
    return load(["model=llama3_8b"]).config.model  # 32 layers


@pytest.mark.parametrize(("argv", "pinned", "expected"), [
    # a bucket-space resume keeps the sizes and the argv's form
    (["--load", "/c", "--use-distributed-optimizer", "--pipeline-model-parallel-size", "2",
      "--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split"], [],
     [["plan.zero=1", "plan.tp=1", "plan.pp=2", "plan.vpp=1", "plan.ep=1", "plan.etp=1",
       "plan.account_for_embedding_in_pipeline_split=true", "plan.account_for_loss_in_pipeline_split=true"]]),
    (["--load", "/c", "--ckpt-format", "torch", "--pipeline-model-parallel-size", "2",
      "--pipeline-model-parallel-layout", "Et*15|t*17L"], [],
     [["plan.tp=1", "plan.pp=2", "plan.vpp=1", "plan.ep=1", "plan.etp=1", "plan.zero=0",
       "plan.pipeline_model_parallel_layout=Et*15|t*17L"]]),
    # and Megatron's even split when it gives none
    (["--load", "/c", "--ckpt-format", "torch", "--pipeline-model-parallel-size", "4",
      "--num-virtual-stages-per-pipeline-rank", "2"], [],
     [["plan.tp=1", "plan.pp=4", "plan.vpp=2", "plan.ep=1", "plan.etp=1", "plan.zero=0", "plan.layers_per_stage=[8,8,8,8]"]]),
    # --pin pp keeps the argv's split flags
    (["--pipeline-model-parallel-size", "4", "--decoder-first-pipeline-num-layers", "5"], ["pp"],
     [["plan.decoder_first_pipeline_num_layers=5"]]),
    (["--pipeline-model-parallel-size", "4"], ["pp"], []),  # none given: the planner splits
    (["--pipeline-model-parallel-size", "4", "--decoder-first-pipeline-num-layers", "5"], ["tp"], []),
])
def test_a_launch_that_fixes_the_split_keeps_it(model, argv, pinned, expected):
    assert [c.overrides for c in argv_constraints(argv, [], model=model, pinned=pinned)] == expected


def test_the_users_own_split_key_wins(model):
    argv = ["--load", "/c", "--use-distributed-optimizer", "--pipeline-model-parallel-size", "2",
            "--account-for-loss-in-pipeline-split"]
    kept = argv_constraints(argv, ["plan.decoder_first_pipeline_num_layers=15"], model=model, pinned=["pp"])
    assert [c.overrides for c in kept] == [["plan.zero=1", "plan.tp=1", "plan.pp=2", "plan.vpp=1", "plan.ep=1",
                                            "plan.etp=1"]]


def test_a_pinned_pp_launch_emits_the_argv_split_again():
    from nest_megatron.launch.devices import Devices
    from nest_megatron.launch.prepare import prepare

    argv = ["--num-layers", "6", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
            "--max-position-embeddings", "64", "--vocab-size", "128", "--bf16", "--micro-batch-size", "1",
            "--global-batch-size", "16", "--pipeline-model-parallel-size", "2",
            "--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split"]
    prepared = prepare(overrides=["cluster=dgx_h100_superpod"], script="pretrain_gpt.py", script_args=argv,
                       devices=Devices(num_nodes=1, per_node=8, node_rank=0), pins=["pp"])
    assert FLAGS_BOTH == split_flags(prepared.script_args)[:2]
    assert prepared.plan.parallel["pp"] == 2 and tuple(prepared.plan.layers_per_stage) == chunk_layers(
        ACCOUNT, num_layers=6, pp=2, vpp=prepared.plan.parallel["vpp"])


def test_a_layout_of_a_model_with_mtp_carries_its_mtp_layers():
    """Megatron builds --mtp-num-layers MTP layers only where the layout has as many 'm' (on the last stage, before
    the loss): written by hand, DeepSeek-V3's 61 layers + 1 MTP layer at PP 8 x VPP 4 as 0, 30 x 2, 1 chunks."""
    assert layout_string((0, *[2] * 30, 1), mtp_num_layers=1) == "E|(t*2|)*30,tmL"
    assert layout_string((0, *[2] * 30, 1)) == "E|(t*2|)*30,tL"
    assert split_hint(num_layers=61, pp=8, vpp=4, mtp_num_layers=1).endswith("tmL'")
