"""Runners-up carry all it takes to rebuild and launch them: `evaluate` with a row's plan.* keys gives the row's
argv and step time, and plan.pick=K takes the K-th that fits."""

from __future__ import annotations

import pytest

from nest_megatron import api
from nest_megatron.errors import NestError
from nest_megatron.plan import key_overrides

CLUSTERS = ("dgx_h100_superpod", "h100_spine_leaf")
SIZES = (64, 1024)
# Every shipped model (hydra_configs/model), at both sizes but where it does not fit on 64 H100s: Llama 3.1 405B,
# DeepSeek-V3, Kimi K2 and Nemotron-3 Ultra need 110, 183, 273 and 158 GiB a device there even at the widest
# sharding (the search's memory floor; test_every_shipped_model_is_round_tripped holds the list to the configs).
TOO_BIG_FOR_64 = {"llama31_405b", "deepseek_v3", "kimi_k2", "nemotron3_ultra"}
MODELS = ("llama3_8b", "llama3_70b", "mixtral_8x7b", "llama2_7b", "gpt3_175b", "bert_large", "tiny_gpt", "tiny_moe",
          "llama31_405b", "deepseek_v3", "kimi_k2", "qwen3_30b_a3b", "qwen3_235b_a22b", "gpt_oss_120b", "nemotron_h_56b",
          "nemotron3_super", "nemotron3_ultra")
CASES = [(m, c, n) for m in MODELS for c in CLUSTERS for n in SIZES if not (n == 64 and m in TOO_BIG_FOR_64)]


def overrides(model: str, cluster: str, num_devices: int) -> list[str]:
    return [f"model={model}", f"cluster={cluster}", f"cluster.num_devices={num_devices}"]


@pytest.fixture(scope="module")
def plans() -> dict:
    return {}


def planned(plans: dict, case: tuple) -> object:
    """One search per case, shared by the tests of this module."""
    if case not in plans:
        plans[case] = api.plan(overrides(*case))
    return plans[case]


@pytest.mark.parametrize("case", CASES, ids=["-".join(map(str, c)) for c in CASES])
def test_evaluate_of_each_row_reproduces_it(plans, case):
    plan = planned(plans, case)
    rows = [("chosen", plan.choice, plan.megatron_args, plan.predicted["step_time_s"])]
    rows += [(f"runner-up {i}", r["plan"], r["megatron_args"], r["step_time_s"])
             for i, r in enumerate(plan.runners_up) if r["fits"]]
    assert len(rows) > 1, "the search kept no fitting runner-up: nothing is round-tripped"
    for name, keys, argv, step in rows:
        again = api.evaluate(overrides(*case) + key_overrides(keys))
        assert again.megatron_args == argv, name
        assert again.predicted["step_time_s"] == step, name  # the same cost model, the same placement: exact
        assert again.choice == keys, name


def test_every_shipped_model_is_round_tripped():
    from nest_megatron.config.load import CONFIG_DIR

    assert set(MODELS) == {path.stem for path in (CONFIG_DIR / "model").glob("*.yaml")}
    for model in TOO_BIG_FOR_64:
        with pytest.raises(NestError, match=f"no configuration of {model} fits on 64 x h100_sxm"):
            api.plan(overrides(model, "dgx_h100_superpod", 64))


def test_every_row_has_every_plan_key(plans):
    """Each row names every plan.* key but pick (a key a row does not set is None), so nothing falls back to
    evaluate's defaults (expert TP = TP for an MoE model, the even split)."""
    from dataclasses import fields

    from nest_megatron.config.schema import PlanChoice

    plan = planned(plans, ("mixtral_8x7b", "dgx_h100_superpod", 64))
    wanted = {f.name for f in fields(PlanChoice)} - {"pick"}
    assert all(set(r["plan"]) == wanted for r in plan.runners_up) and set(plan.choice) == wanted


def test_key_overrides_quote_what_hydra_would_parse():
    keys = {"tp": 2, "sp": True, "account_for_loss_in_pipeline_split": None,
            "pipeline_model_parallel_layout": "Et|(t*2|)*3,tL", "order": "tp-cp-ep-pp-dp"}
    assert key_overrides(keys) == ["plan.tp=2", "plan.sp=true", "plan.pipeline_model_parallel_layout='Et|(t*2|)*3,tL'",
                                   "plan.order=tp-cp-ep-pp-dp"]


def test_pick_takes_the_kth_fitting_runner_up(plans):
    case = ("llama3_70b", "dgx_h100_superpod", 64)
    plan = planned(plans, case)
    fitting = [r for r in plan.runners_up if r["fits"]]
    second = api.plan(overrides(*case) + ["plan.pick=2"])
    assert second.megatron_args == fitting[1]["megatron_args"]
    assert second.predicted["step_time_s"] == fitting[1]["step_time_s"]
    assert second.choice == fitting[1]["plan"]
    # the fastest is now a runner-up of the picked plan, listed first
    assert second.runners_up[0]["plan"] == plan.choice
    # evaluate with a pick searches (the other plan.* keys its pins) and takes the same
    assert api.evaluate(overrides(*case) + ["plan.pick=2"]).megatron_args == fitting[1]["megatron_args"]
    assert api.evaluate(overrides(*case) + ["plan.pick=0"]).megatron_args == plan.megatron_args


def test_pick_beyond_the_runners_up_is_one_line(plans):
    case = ("llama3_70b", "dgx_h100_superpod", 64)
    count = sum(r["fits"] for r in planned(plans, case).runners_up)
    with pytest.raises(NestError, match=rf"plan.pick=99: give 0 \(the fastest plan\) or 1..{count}, the runners-up"):
        api.plan(overrides(*case) + ["plan.pick=99"])


def _launch_plan(*extra: str):
    """The plan `launch` (and `sbatch`, which writes its job) makes of llama3_70b on 8 nodes of dgx_h100_superpod:
    priced as the script runs (its Megatron flags, here none: no DP overlap), not as `plan` alone prices it."""
    from nest_megatron.launch.devices import Devices
    from nest_megatron.launch.prepare import prepare

    return prepare(overrides=["model=llama3_70b", "cluster=dgx_h100_superpod", *extra], script="pretrain_gpt.py",
                   script_args=["--data-path", "/data/corpus_text_document"],
                   devices=Devices(num_nodes=8, per_node=8, node_rank=0, master_addr="n1")).plan


def test_launch_takes_a_pick():
    """`launch plan.pick=1` runs the first fitting runner-up of the plan it would launch: its planner flags are the
    row's."""
    from nest_megatron.launch.rewrite import planner_part

    first = next(r for r in _launch_plan().runners_up if r["fits"])
    picked = _launch_plan("plan.pick=1")
    assert planner_part(picked.megatron_args) == planner_part(first["megatron_args"])
    assert picked.predicted["step_time_s"] == first["step_time_s"]


def test_sbatch_takes_a_pick(capsys):
    """`sbatch plan.pick=1` writes the job of the first fitting runner-up: the plan in its comments is the row's, and
    every node's launch line asks for the same pick (and the row's plan digest, which --expect-plan checks)."""
    from nest_megatron import cli

    first = next(r for r in _launch_plan().runners_up if r["fits"])
    picked = _launch_plan("plan.pick=1")
    assert cli.main(["sbatch", "--nodes", "8", "model=llama3_70b", "cluster=dgx_h100_superpod", "plan.pick=1", "--",
                     "pretrain_gpt.py", "--data-path", "/data/corpus_text_document"]) == 0
    lines = capsys.readouterr().out.splitlines()
    keys = first["plan"]
    assert any(line.startswith(f"# plan when written: tp={keys['tp']} pp={keys['pp']} dp={keys['dp']} cp={keys['cp']} ")
               for line in lines), lines
    assert f"# plan digest {picked.digest} (every node must plan the same: --expect-plan)" in lines
    assert f"--expect-plan {picked.digest} " in lines[-1] and " plan.pick=1 " in lines[-1]
