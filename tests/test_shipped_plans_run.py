"""Every plan the planner offers for the shipped models on the shipped H100 clusters keeps Megatron's rules.

Issue 11's guarantee: no chosen plan and no runner-up uses a combination the rule tables
(parallel/rules.RULES, launch/megatron_rules.ARGV_RULES) say does not run. The search space is built from
those rules, so this checks the emitted Megatron argv of each plan as launch would check it (the argv
rules, which the search space does not see) and the configuration with the split it was priced with.
The README's examples are among the cells.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from nest_megatron.config.load import load
from nest_megatron.cost.evaluate import estimate
from nest_megatron.errors import InfeasibleError
from nest_megatron.launch.megatron_rules import violations
from nest_megatron.parallel.rules import violation
from nest_megatron.plan import build_plan
from nest_megatron.profile.for_plan import profiled_problem
from nest_megatron.solver.registry import SOLVERS

MODELS = ["bert_large", "llama2_7b", "llama3_8b", "llama3_70b", "gpt3_175b", "mixtral_8x7b"]
CELLS = [(model, cluster, devices) for model in MODELS for cluster in ("dgx_h100_superpod", "h100_spine_leaf")
         for devices in (64, 1024)]


def offered(overrides: list[str]):
    """(problem, the chosen plan's and every runner-up's estimate) as `nest-megatron plan` finds them."""
    loaded = load(overrides)
    cfg = loaded.config
    problem, _ = profiled_problem(loaded.problem, cfg)
    result = SOLVERS[cfg.solver.name](problem, cfg.solver, cfg.plan, micro_batch_size=cfg.train.micro_batch_size)
    if result.best is None:
        raise InfeasibleError(f"nothing fits: {overrides}")
    return problem, [result.best, *result.runners_up]


def broken_rules(overrides: list[str]) -> dict[str, list[str]]:
    """Each offered plan that breaks a rule -> the rules it breaks (empty when every plan launches)."""
    problem, estimates = offered(overrides)
    broken = {}
    for est in estimates:
        cfg = est.config
        plan = build_plan(problem, est, model_name="m", cluster_name="c")
        found = violations(plan.megatron_args, world_size=cfg.world)
        rule = violation(cfg, model=problem.model, num_devices=problem.num_devices,
                         global_batch_size=problem.global_batch_size, layers_per_stage=est.layers_per_stage)
        if rule:
            found.append(rule)
        if found:
            broken[f"{cfg} split {est.layers_per_stage}"] = found
    return broken


@pytest.mark.slow
@pytest.mark.parametrize("model, cluster, devices", CELLS, ids=[f"{m}-{c}-{n}" for m, c, n in CELLS])
def test_every_offered_plan_of_a_shipped_model_keeps_the_rules(model, cluster, devices):
    assert broken_rules([f"model={model}", f"cluster={cluster}", f"cluster.num_devices={devices}",
                         "train.global_batch_size=1024"]) == {}


# The README's plan examples (Quick start, plan) and docs/guide.md's Python one.
README_CELLS = [
    [],  # `nest-megatron plan`: the embedded default
    ["cluster=dgx_h100_superpod"],
    ["model=llama3_70b", "cluster=dgx_h100_superpod", "cluster.num_devices=512"],
    ["model=llama3_70b", "cluster.num_devices=1024", "train.global_batch_size=4096"],
]


@pytest.mark.slow
@pytest.mark.parametrize("overrides", README_CELLS, ids=["default", "superpod", "superpod-512", "api"])
def test_every_offered_plan_of_the_readme_examples_keeps_the_rules(overrides):
    assert broken_rules(overrides) == {}


def test_a_plan_breaking_a_rule_is_reported():
    """The check itself can fail: a Megatron-FSDP configuration with pipeline stages, priced as evaluate would."""
    problem, estimates = offered(["model=tiny_gpt", "cluster=dgx_h100_superpod", "cluster.num_devices=16",
                                  "train.global_batch_size=64"])
    bad = replace(estimates[0].config, tp=1, pp=2, cp=1, dp=8, vpp=1, zero=3, order="tp-cp-ep-dp-pp", sp=False)
    est = estimate(problem, bad)
    plan = build_plan(problem, est, model_name="m", cluster_name="c")
    assert any("Megatron-FSDP" in line for line in violations(plan.megatron_args, world_size=16))
