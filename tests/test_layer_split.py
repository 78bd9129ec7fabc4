"""plan.layers_per_stage: an explicit (uneven) layer split, with or without virtual stages — validated, priced,
searched under, emitted as the simplest Megatron flags for it (tests/test_pipeline_layouts.py has every form), and
built by megatron-core as given."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from megatron_core_split import megatron_core_chunks, split_fields, split_flags

from nest_megatron import api
from nest_megatron.config.load import load
from nest_megatron.cost.evaluate import estimate
from nest_megatron.cost.tables import chunk_split
from nest_megatron.emit.megatron import parallel_args
from nest_megatron.errors import NestError
from nest_megatron.launch.megatron_rules import violations
from nest_megatron.parallel.config import ParallelConfig
from nest_megatron.solver.space import evaluate_config, pinned_split

SMALL = ["model=tiny_gpt", "cluster=dgx_h100_superpod", "cluster.num_devices=16", "train.global_batch_size=64"]
# Llama 3 70B (80 layers) on 64 H100s at tp 8 pp 4 vpp 2: 8 model chunks of 10 layers when even.
BIG = ["model=llama3_70b", "cluster=dgx_h100_superpod", "cluster.num_devices=64", "train.global_batch_size=128",
       "plan.tp=8", "plan.pp=4", "plan.vpp=2"]


def layout_of(args: list[str]) -> str | None:
    flag = "--pipeline-model-parallel-layout"
    return args[args.index(flag) + 1] if flag in args else None


# (layers, pp, vpp, the split as given, the layers per model chunk in Megatron's order, worked out by hand, the
# simplest flags for it)
ACCOUNT_BOTH = ["--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split"]
SPLITS = [
    # Llama 3.1 405B: 126 layers at pp 8 vpp 8 = 64 chunks; the first and last chunk (embedding, loss) take
    # one layer, the 62 others two: 1 + 62*2 + 1 = 126. That is the embedding and loss counted: 128 = 64 x 2.
    (126, 8, 8, (1, *[2] * 62, 1), (1, *[2] * 62, 1), [*ACCOUNT_BOTH, "--num-virtual-stages-per-pipeline-rank", "8"]),
    # Qwen3-235B: 94 layers at pp 8 vpp 4 = 32 chunks; first and last two layers, the 30 others three:
    # 2 + 30*3 + 2 = 94 (96 = 32 x 3 with the embedding and loss counted).
    (94, 8, 4, (2, *[3] * 30, 2), (2, *[3] * 30, 2), [*ACCOUNT_BOTH, "--num-virtual-stages-per-pipeline-rank", "4"]),
    # pp only, uneven: 30 layers as 7 + 8 + 8 + 7 (32 = 4 x 8 with the embedding and loss counted).
    (30, 4, 1, (7, 8, 8, 7), (7, 8, 8, 7), ACCOUNT_BOTH),
    # pp entries with vpp 2: each rank's layers split evenly over its two chunks; chunk c = k*pp + rank, so
    # rank 0 holds chunks 0 and 4 (2 + 2), rank 1 chunks 1 and 5 (3 + 3): [2, 3, 3, 2, 2, 3, 3, 2]; the first and
    # last ranks hold 4, the middle ones 6.
    (20, 4, 2, (4, 6, 6, 4), (2, 3, 3, 2, 2, 3, 3, 2),
     ["--decoder-first-pipeline-num-layers", "4", "--decoder-last-pipeline-num-layers", "4",
      "--num-virtual-stages-per-pipeline-rank", "2"]),
    # an empty stage: Megatron's layout allows one: 8 layers at pp 4, no other form gives it.
    (8, 4, 1, (0, 4, 4, 0), (0, 4, 4, 0), ["--pipeline-model-parallel-layout", "E|(t*4|)*2,L"]),
]


def _emitted(layers: int, pp: int, vpp: int, split: tuple[int, ...]) -> list[str]:
    model = load(["model=tiny_gpt", f"model.num_layers={layers}"]).problem.model
    return parallel_args(ParallelConfig(pp=pp, vpp=vpp, dp=1), model=model, global_batch_size=pp * 4,
                         overlap_grad_reduce=False, overlap_param_gather=False, layers_per_stage=split)


@pytest.mark.parametrize(("layers", "pp", "vpp", "split", "chunks", "flags"), SPLITS)
def test_megatron_core_builds_the_emitted_split(layers, pp, vpp, split, chunks, flags):
    assert chunk_split(ParallelConfig(pp=pp, vpp=vpp), split) == chunks
    args = _emitted(layers, pp, vpp, split)
    assert split_flags(args) == flags
    # What each rank builds, as megatron-core computes it from those flags (its offsets: the layers before).
    built = megatron_core_chunks(layers, pp, **split_fields(args))
    assert built == tuple((n, sum(chunks[:c])) for c, n in enumerate(chunks))
    # nest's own reading of the launch line agrees: no rule broken (world: pp ranks, 4 micro-batches per rank)
    argv = ["--num-layers", str(layers), "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
            "--max-position-embeddings", "64", "--vocab-size", "128", *args]
    assert violations(argv, world_size=pp) == []


def test_an_even_split_emits_no_layout():
    args = _emitted(16, 4, 2, (4, 4, 4, 4))
    assert layout_of(args) is None and args[args.index("--num-virtual-stages-per-pipeline-rank") + 1] == "2"
    assert layout_of(_emitted(16, 4, 2, (2,) * 8)) is None


def test_the_argv_reads_first_last_stage_sizes_with_virtual_stages():
    base = ["--num-layers", "16", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
            "--max-position-embeddings", "64", "--vocab-size", "128", "--micro-batch-size", "1",
            "--global-batch-size", "8", "--pipeline-model-parallel-size", "4", "--num-virtual-stages-per-pipeline-rank",
            "2"]
    # 2 + 6 + 6 + 2: each a multiple of vpp 2
    assert violations([*base, "--decoder-first-pipeline-num-layers", "2", "--decoder-last-pipeline-num-layers", "2"],
                      world_size=4) == []
    # 3 on the first rank cannot split over 2 virtual stages
    found = violations([*base, "--decoder-first-pipeline-num-layers", "3", "--decoder-last-pipeline-num-layers", "1"],
                       world_size=4)
    assert found[0].startswith("--decoder-first-pipeline-num-layers=3: must be a multiple of virtual pipeline stages=2")


def _priced(overrides: list[str]):
    loaded = load(overrides)
    cfg = evaluate_config(loaded.problem, loaded.config.plan, default_mbs=loaded.config.train.micro_batch_size)
    return estimate(loaded.problem, cfg, layers_per_stage=pinned_split(loaded.config.plan))


def test_an_uneven_chunk_split_prices_the_heavier_rank_slower():
    even = _priced(BIG)
    # rank 0 takes 12 + 10 layers, rank 1 8 + 10, the others 10 + 10
    uneven = _priced([*BIG, "plan.layers_per_stage=[12,8,10,10,10,10,10,10]"])
    assert uneven.layers_per_stage == (12, 8, 10, 10, 10, 10, 10, 10)
    t, e = uneven.stage_times, even.stage_times
    assert t[0] > e[0] and t[1] < e[1]  # 22 layers against 20, 18 against 20
    assert t[2:] == pytest.approx(e[2:], rel=1e-12)  # the same 20 layers as in the even split
    assert t[0] > t[2] > t[1]
    assert uneven.step_time > even.step_time  # the slowest rank sets the pace


@pytest.mark.parametrize("split", ["[10,10,10,10,10,10,10,10]", "[20,20,20,20]"])
def test_an_explicit_even_split_prices_exactly_as_the_default(split):
    default, given = api.evaluate(BIG), api.evaluate([*BIG, f"plan.layers_per_stage={split}"])
    assert given.predicted["step_time_s"] == default.predicted["step_time_s"]
    assert given.predicted["memory_per_stage_gib"] == default.predicted["memory_per_stage_gib"]
    assert layout_of(given.megatron_args) is None


def test_the_plan_carries_the_split_and_its_layout():
    plan = api.evaluate([*BIG, "plan.layers_per_stage=[12,8,10,10,10,10,10,10]"])
    assert plan.layers_per_stage == [12, 8, 10, 10, 10, 10, 10, 10]
    # ranks 22, 18, 20, 20: neither the embedding / loss counted nor first / last counts give it
    assert layout_of(plan.megatron_args) == "Et*12|t*8|(t*10|)*5,t*10L"
    assert "--num-virtual-stages-per-pipeline-rank" not in plan.megatron_args
    assert violations(plan.megatron_args, world_size=plan.world_size) == []


def test_plan_with_a_pinned_split_searches_only_its_pp_and_vpp():
    split = [1, 0, 1, 2]
    plan = api.plan([*SMALL, "plan.pp=2", f"plan.layers_per_stage={split}"])
    assert plan.parallel["pp"] == 2 and plan.parallel["vpp"] == 2
    assert plan.layers_per_stage == split
    assert layout_of(plan.megatron_args) == "Et||t|t*2L"
    plan = api.plan([*SMALL, "plan.pp=2", "plan.layers_per_stage=[1,3]", "solver.name=enumerate"])
    assert plan.parallel["pp"] == 2 and plan.layers_per_stage == [1, 3]


@pytest.mark.parametrize(("pins", "words"), [
    (["plan.layers_per_stage=[2,2]"], "needs plan.pp pinned"),
    (["plan.pp=2", "plan.layers_per_stage=[2,1]"], "must add up to model.num_layers=4"),
    (["plan.pp=2", "plan.layers_per_stage=[2,1,1]"], "3 entries, allowed pp=2"),
    (["plan.pp=2", "plan.vpp=2", "plan.layers_per_stage=[1,1,1,0,1]"], "allowed pp=2 or pp*vpp=4"),
    (["plan.pp=2", "plan.layers_per_stage=[5,-1]"], "integers >= 0"),
])
def test_a_bad_split_is_one_line_naming_the_key(pins, words):
    with pytest.raises(NestError, match="plan.layers_per_stage=") as err:
        load([*SMALL, *pins])
    assert words in str(err.value) and "\n" not in str(err.value)


def test_a_split_of_pp_entries_with_vpp_needs_multiples_of_vpp():
    with pytest.raises(NestError, match="multiple of vpp"):
        api.evaluate([*SMALL, "plan.pp=2", "plan.vpp=2", "plan.layers_per_stage=[1,3]"])


def test_cli_evaluate_with_a_split(tmp_path):
    out = tmp_path / "e.json"
    proc = subprocess.run([sys.executable, "-m", "nest_megatron.cli", "evaluate", *SMALL, "plan.pp=2", "plan.vpp=2",
                           "plan.layers_per_stage=[2,0,1,1]", f"out={out}", "--quiet"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    plan = json.loads(out.read_text())
    assert plan["layers_per_stage"] == [2, 0, 1, 1] and plan["parallel"]["vpp"] == 2
    assert layout_of(plan["megatron_args"]) == "Et*2||t|tL"
    bad = subprocess.run([sys.executable, "-m", "nest_megatron.cli", "evaluate", *SMALL,
                          "plan.layers_per_stage=[2,2]", f"out={out}"], cwd=tmp_path, capture_output=True, text=True,
                         timeout=120)
    assert bad.returncode == 2 and bad.stderr.strip().count("\n") == 0
    assert "plan.layers_per_stage=[2, 2]: needs plan.pp pinned" in bad.stderr


@pytest.mark.parametrize("split", ["[2,0,1,1]", "[0,4]", "[1,3]"])
def test_the_report_draws_an_uneven_split(split, tmp_path):
    from nest_megatron.report.explain import SCHEDULE_TOLERANCE, report_data, write_report

    plan = api.evaluate([*SMALL, "plan.pp=2", f"plan.layers_per_stage={split}"])
    data = report_data(load(plan.overrides).problem, plan, baselines={})
    assert data.estimate.step_time == pytest.approx(plan.predicted["step_time_s"], rel=1e-12)  # re-priced, same split
    assert data.timeline.length == pytest.approx(plan.predicted["step_time_s"], rel=SCHEDULE_TOLERANCE)
    index, _ = write_report(data, tmp_path)
    assert index.exists()


def test_a_users_layout_is_read_back_and_priced():
    from nest_megatron.launch.changes import layout_why
    from nest_megatron.launch.megatron_rules import argv_split

    overrides = [*SMALL, "plan.pp=2", "plan.tp=1"]
    plan, loaded = api.evaluate(overrides), load(overrides)
    args = list(plan.megatron_args)
    # a layout: its stages (chunks); 4 stages at pp 2 is vpp 2
    assert argv_split([*args, "--pipeline-model-parallel-layout", "Et*1|t*3L"], world_size=16) == (1, 3)
    assert argv_split([*args, "--pipeline-model-parallel-layout", "Et*2|t*0|t*1|t*1L"], world_size=16) == (2, 0, 1, 1)
    # first / last stage sizes: the layers per pipeline rank
    first_last = ["--decoder-first-pipeline-num-layers", "1", "--decoder-last-pipeline-num-layers", "3"]
    assert argv_split([*args, *first_last], world_size=16) == (1, 3)
    assert argv_split(args, world_size=16) is None
    # priced by the cost model as the split it spells (1 + 3 is slower than the plan's 2 + 2)
    uneven = api.evaluate([*overrides, "plan.layers_per_stage=[1,3]"])
    ratio = uneven.predicted["step_time_s"] / plan.predicted["step_time_s"]
    for extra in (["--pipeline-model-parallel-layout", "Et*1|t*3L"], first_last):
        assert layout_why([*args, *extra], loaded, plan) == f"the planned layout is {ratio:.2f}x faster by the cost model"
