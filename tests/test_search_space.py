"""The planner's candidates are exactly the configurations of the search space that break no rule: `candidates`
skips, unjudged, what rules fsdp-pp, fsdp-order, moe-bias-etp and order-expert-dp refuse (parallel/rules.py
SIZE_RULES), and the full judged space says which launch."""

from __future__ import annotations

import pytest

from nest_megatron.config.load import load
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
])
def test_candidates_are_the_judged_space_that_launches(overrides):
    loaded = load(overrides)
    problem, cfg = loaded.problem, loaded.config
    args = dict(micro_batch_size=cfg.train.micro_batch_size, any_split=True)
    judged = [c for c, line in _configurations(problem, cfg.solver, cfg.plan, **args) if line is None]
    found = list(candidates(problem, cfg.solver, cfg.plan, **args))
    assert found == judged and found
    fsdp = [c for c in found if c.zero >= 2]
    assert fsdp and all(c.pp == 1 and c.order == "tp-cp-ep-dp-pp" for c in fsdp)
    # what was skipped is there, and refused, in the judged space
    every = [(c, line) for c, line in _configurations(problem, cfg.solver, cfg.plan, **args) if c is not None]
    skipped = [line for c, line in every if c.zero >= 2 and c.pp > 1]
    assert skipped and None not in skipped
    if problem.model.cfg.add_bias_linear and problem.model.is_moe:
        assert {c.etp for c in found} == {1} and any(c.etp > 1 and line for c, line in every)
    # Megatron-LM sets expert TP = TP for a dense model: there the expert data-parallel size is cp*dp
    moe = problem.model.is_moe
    pp_dp = [line for c, line in every if c.order == "tp-cp-ep-pp-dp" and c.pp > 1
             and c.tp * c.cp * c.dp // ((c.etp if moe else c.tp) * c.ep) != c.dp]
    assert None not in pp_dp
