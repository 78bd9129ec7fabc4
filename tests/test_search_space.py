"""The planner's candidates are exactly the configurations of the search space that break no rule: `candidates`
skips, unjudged, what the rules of parallel/rules.py SIZE_RULES refuse by the sizes tp, cp, pp, dp, ep, etp, zero and
order, and what those of PIPELINE_RULES refuse by pp, vpp, mbs and dp, and the full judged space says which launch."""

from __future__ import annotations

import dataclasses

import pytest

from nest_megatron.config.load import load
from nest_megatron.parallel.config import DEFAULT_RECOMPUTE_MODULES
from nest_megatron.parallel.layout import SplitForm
from nest_megatron.parallel.rules import (
    OVERLAP_RULES,
    PIPELINE_RULES,
    RULES,
    SIZE_RULES,
    VARIANT_RULES,
    Case,
    violation,
)
from nest_megatron.solver.space import _configurations, candidates


@pytest.mark.parametrize("overrides", [
    ["model=tiny_gpt", "cluster=dgx_h100_superpod", "cluster.num_devices=16", "train.global_batch_size=64"],
    # MoE: expert parallel, expert TP and both rank orders with pipeline stages
    ["model=mixtral_8x7b", "cluster=h100_spine_leaf", "cluster.num_devices=64", "train.global_batch_size=1024"],
    # biased experts: expert TP 1 only
    ["model=tiny_moe", "cluster=dgx_h100_superpod", "cluster.num_devices=16", "train.global_batch_size=64",
     "model.add_bias_linear=true"],
    # with pins: Megatron-FSDP pinned, so only its one rank order and no pipeline stage can launch
    ["model=tiny_moe", "cluster=dgx_h100_superpod", "cluster.num_devices=16", "train.global_batch_size=64",
     "plan.zero=3"],
    # a split form pinned: the account-for flags launch only where pp divides the layers with the embedding and loss
    ["model=tiny_gpt", "cluster=dgx_h100_superpod", "cluster.num_devices=16", "train.global_batch_size=64",
     "plan.account_for_embedding_in_pipeline_split=true", "plan.account_for_loss_in_pipeline_split=true"],
])
def test_candidates_are_the_judged_space_that_launches(overrides):
    loaded = load(overrides)
    problem, cfg = loaded.problem, loaded.config
    args = dict(micro_batch_size=cfg.train.micro_batch_size, any_split=True)
    judged = [c for c, line in _configurations(problem, cfg.solver, cfg.plan, **args) if line is None]
    found = list(candidates(problem, cfg.solver, cfg.plan, **args))
    assert found == judged and found
    # the EP all-to-all overlap is searched for the MoE models, where its rules let it launch
    overlapped = [c for c in found if c.moe_a2a_overlap]
    assert bool(overlapped) == problem.model.is_moe
    assert all(c.ep > 1 and c.recompute != "full" and (c.pp == 1 or c.vpp > 1) for c in overlapped)
    fsdp = [c for c in found if c.zero >= 2]
    assert fsdp and all(c.pp == 1 and c.order == "tp-cp-ep-dp-pp" for c in fsdp)
    # what was skipped is there, and refused, in the judged space
    every = [(c, line) for c, line in _configurations(problem, cfg.solver, cfg.plan, **args) if c is not None]
    skipped = [line for c, line in every if c.zero >= 2 and c.pp > 1]
    assert skipped and None not in skipped
    # what global-batch refuses (skipped by candidates too): in tiny_gpt's space mbs 8 x dp 16 does not divide 64
    by_batch = [line for c, line in every if problem.global_batch_size % (c.mbs * c.dp)]
    assert None not in by_batch and (by_batch or "model=tiny_gpt" not in overrides)
    if problem.model.cfg.add_bias_linear and problem.model.is_moe:
        assert {c.etp for c in found} == {1} and any(c.etp > 1 and line for c, line in every)
    # Megatron-LM sets expert TP = TP for a dense model: there the expert data-parallel size is cp*dp
    moe = problem.model.is_moe
    pp_dp = [line for c, line in every if c.order == "tp-cp-ep-pp-dp" and c.pp > 1
             and c.tp * c.cp * c.dp // ((c.etp if moe else c.tp) * c.ep) != c.dp]
    assert None not in pp_dp


@pytest.mark.parametrize("overrides, recompute_rule", [
    # 4 layers: 3 recomputed layers exceed a stage's 2 at PP 2 (and a virtual stage's at PP 2 x VPP 2, 1)
    (["model=tiny_gpt", "cluster=dgx_h100_superpod", "cluster.num_devices=16", "train.global_batch_size=64",
      "solver.recompute_num_layers=[null,1,3]"], "plan.recompute_num_layers=3: allowed 1..2"),
    # moe_act does not recompute under FP8 delayed scaling: every selective configuration breaks it
    (["model=tiny_moe", "cluster=dgx_h100_superpod", "cluster.num_devices=16", "train.global_batch_size=64",
      "train.precision=fp8", "train.fp8_recipe=delayed", "plan.recompute_modules=[moe_act]"],
     "plan.recompute_modules: moe_act and layernorm do not recompute with fp8 delayed scaling; use another "
     "model.fp8_recipe or drop them"),
])
def test_the_search_judges_each_configuration_as_the_rule_table_does(overrides, recompute_rule):
    """The search judges the rules but the variant ones once for a configuration's recompute and overlap variants
    (rules.VARIANT_RULES): each configuration's line is still violation()'s, the first rule of RULES it breaks,
    in spaces where the recompute rules break alone, together with earlier rules and with later ones."""
    loaded = load(overrides)
    problem, cfg = loaded.problem, loaded.config
    every = [(c, line) for c, line in _configurations(problem, cfg.solver, cfg.plan, any_split=True,
                                                       micro_batch_size=cfg.train.micro_batch_size) if c is not None]
    form = SplitForm.from_fields(cfg.plan)
    for c, line in every:
        assert line == violation(c, model=problem.model, num_devices=problem.num_devices,
                                 global_batch_size=problem.global_batch_size, any_split=True,
                                 tp_comm_overlap=problem.tp_comm_overlap, form=form), c
    lines = set(line for _, line in every)
    if "plan.recompute_modules=[moe_act]" in overrides:
        # every configuration is selective; recompute-modules, third of RULES, comes before any other it breaks
        assert lines == {recompute_rule}
    else:
        assert recompute_rule in lines and None in lines and len(lines) > 3


def test_the_variant_rules_are_the_ones_reading_the_recompute_fields_and_the_overlap():
    """Each rule outside VARIANT_RULES gives one answer whatever a configuration's recompute fields, EP all-to-all
    overlap and offloaded layers, and each rule in it one answer for every configuration with the same variant fields, pp, vpp and ep: on
    300 configurations spread over a MoE space (both rank orders, expert TP, FP8 GEMM shapes, pipeline splits), each
    with variants that break and keep the variant rules."""
    loaded = load(["model=mixtral_8x7b", "cluster=h100_spine_leaf", "cluster.num_devices=64", "train.global_batch_size=1024",
                   "train.precision=fp8", "solver.recompute_num_layers=[null,1,20]"])
    problem, cfg = loaded.problem, loaded.config
    configurations = {dataclasses.replace(c, recompute="none", recompute_num_layers=None,
                                          recompute_modules=DEFAULT_RECOMPUTE_MODULES, moe_a2a_overlap=False,
                                          cpu_offloading_num_layers=0)
                      for c, _ in _configurations(problem, cfg.solver, cfg.plan, any_split=True, micro_batch_size=None)
                      if c is not None}
    configurations = sorted(configurations, key=repr)[::len(configurations) // 300]
    recomputes = [dict(recompute="none"), dict(recompute="full"), dict(recompute="full", recompute_num_layers=20),
                  dict(recompute="selective", recompute_modules=("moe_act",)),
                  dict(recompute="selective", recompute_modules=("core_attn", "mlp")), dict(recompute="bogus"),
                  dict(recompute="none", recompute_num_layers=1), dict(recompute="selective", recompute_modules=("x",)),
                  dict(recompute="selective", recompute_modules=("moe",))]
    variants = [dict(v, moe_a2a_overlap=overlap, cpu_offloading_num_layers=offloaded) for v in recomputes
                for overlap in (False, True) for offloaded in (0, 8)]
    assert len(configurations) > 100 and len([r for r in RULES if r.id in VARIANT_RULES]) == 7
    assert {c.ep for c in configurations} > {1} and {(c.pp > 1, c.vpp > 1) for c in configurations} >= {(True, False),
                                                                                                      (True, True)}

    def answer(rule, c, variant):
        return rule.check(Case(dataclasses.replace(c, **variant), problem.model, problem.num_devices,
                               problem.global_batch_size, None, True))

    variant_answers: dict[tuple, set] = {}
    for c in configurations:
        for rule in RULES:
            answers = {i: answer(rule, c, v) for i, v in enumerate(variants)}
            if rule.id in VARIANT_RULES:
                for i, line in answers.items():
                    variant_answers.setdefault((rule.id, c.pp, c.vpp, c.ep, i), set()).add(line)
            else:
                assert len(set(answers.values())) == 1, (rule.id, c, answers)
    assert all(len(lines) == 1 for lines in variant_answers.values())
    assert len({line for lines in variant_answers.values() for line in lines}) > 6  # they break, and hold


# Spaces whose configurations reach every rule of the two groups: virtual stages and micro-batch counts, MoE expert
# grids, a hybrid stack, split forms, a given split.
PRE_FILTER_SPACES = [
    ["model=tiny_gpt", "cluster=dgx_h100_superpod", "cluster.num_devices=16", "train.global_batch_size=64"],
    ["model=tiny_moe", "cluster=dgx_h100_superpod", "cluster.num_devices=16", "train.global_batch_size=64"],
    ["model=tiny_moe", "cluster=dgx_h100_superpod", "cluster.num_devices=16", "train.global_batch_size=64",
     "model.add_bias_linear=true"],
    ["model=nemotron_h_56b", "cluster=dgx_h100_superpod", "cluster.num_devices=64", "train.global_batch_size=256"],
    ["model=tiny_gpt", "cluster=dgx_h100_superpod", "cluster.num_devices=16", "train.global_batch_size=64",
     "plan.pp=2", "plan.pipeline_model_parallel_layout='Et|t|t|tL'"],
    ["model=tiny_gpt", "cluster=dgx_h100_superpod", "cluster.num_devices=16", "train.global_batch_size=64",
     "plan.decoder_first_pipeline_num_layers=1"],
    ["model=tiny_gpt", "cluster=dgx_h100_superpod", "cluster.num_devices=16", "train.global_batch_size=64",
     "plan.pp=2", "plan.layers_per_stage=[1,3]"],
]


class _Reading:
    """A configuration that records which of its fields (or properties) a rule reads."""

    def __init__(self, cfg):
        self._cfg, self.read = cfg, set()

    def __getattr__(self, name):
        self.read.add(name)
        return getattr(self._cfg, name)


@pytest.mark.parametrize("group, allowed", [
    (SIZE_RULES, {"tp", "cp", "pp", "dp", "ep", "etp", "zero", "order"}),
    # and the micro-batch groups, one value in a whole search (refused_by_pipeline takes it)
    (PIPELINE_RULES, {"pp", "vpp", "mbs", "dp", "microbatch_group_size_per_vp_stage", "microbatch_group"}),
    # refused_overlap asks them with Megatron's default modules, which read as recompute_modules only with selective
    (OVERLAP_RULES, {"moe_a2a_overlap", "pp", "vpp", "ep", "recompute", "recompute_modules"}),
], ids=["SIZE_RULES", "PIPELINE_RULES", "OVERLAP_RULES"])
def test_the_rules_the_search_applies_first_read_only_their_fields(group, allowed):
    """The search drops what SIZE_RULES and PIPELINE_RULES refuse before it enumerates the rest of a configuration
    (solver/space.py), asking them with the other fields at Megatron's defaults: right only when each rule reads
    nothing else of a configuration. Every configuration of spaces that reach the rules, with and without uneven
    splits, is judged through one that records what is read of it; each rule reads some of its fields there (but
    moe-bias-etp, which reads etp only of a MoE model with biases) and the group refuses some configurations."""
    reads = {check: set() for check in group}
    refused = 0
    for overrides in PRE_FILTER_SPACES:
        loaded = load(overrides)
        problem, cfg = loaded.problem, loaded.config
        form, split = SplitForm.from_fields(cfg.plan), cfg.plan.layers_per_stage
        for any_split in (True, False):
            # one of each configuration's recompute variants: the rules' reads of those fields show on any of them
            space = {dataclasses.replace(c, recompute="none", recompute_num_layers=None,
                                         recompute_modules=DEFAULT_RECOMPUTE_MODULES): None
                     for c, _ in _configurations(problem, cfg.solver, cfg.plan, any_split=any_split, micro_batch_size=None)
                     if c is not None}
            for c in space:
                for check in group:
                    reading = _Reading(c)
                    line = check(Case(reading, problem.model, problem.num_devices, problem.global_batch_size,
                                      tuple(split) if split else None, any_split, form=form))
                    reads[check] |= reading.read
                    refused += line is not None
    for check in group:
        assert reads[check] <= allowed, (check.__name__, reads[check] - allowed)
        assert reads[check], check.__name__
    assert refused
