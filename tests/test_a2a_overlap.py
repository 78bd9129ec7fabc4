"""Megatron's EP all-to-all overlap (plan.moe_a2a_overlap: --overlap-moe-expert-parallel-comm, with
train.delay_wgrad_compute: --delay-wgrad-compute), priced by cost/a2a_overlap.py, searched, and held to megatron-core's
rules.

megatron-core 0.16.1 (installed) checks the flag in TransformerConfig.__post_init__ (transformer_config.py:1852-1913);
Megatron-LM d98e8a6, which the rule table cites, checks the same and also refuses a recomputed whole MoE layer
(:3030-3032), which 0.16.1 still accepts.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from rich.console import Console

from nest_megatron import api
from nest_megatron.config.load import load
from nest_megatron.config.megatron_argv import train_overrides
from nest_megatron.cost.a2a_overlap import pair_saving, unpaired_microbatches
from nest_megatron.cost.evaluate import estimate
from nest_megatron.cost.layer import LayerTime
from nest_megatron.cost.memory import in_flight_chunks
from nest_megatron.errors import NestError
from nest_megatron.launch.constraints import argv_constraints
from nest_megatron.launch.megatron_rules import violations
from nest_megatron.launch.prepare import megatron_env
from nest_megatron.parallel.config import ParallelConfig
from nest_megatron.plan import key_overrides
from nest_megatron.report.table import render
from nest_megatron.solver.space import searched_a2a_overlaps

BASE = ["model=tiny_moe", "cluster=dgx_h100_superpod", "cluster.num_devices=16", "train.global_batch_size=64"]
OVERLAP = ["plan.moe_a2a_overlap=true", "train.delay_wgrad_compute=true"]


def _layer(*, c, attn_fwd, experts_fwd, attn_bwd, experts_dgrad, experts_wgrad) -> LayerTime:
    """A MoE layer's times from its parts: c a dispatch (or combine), each pass one dispatch and one combine."""
    return LayerTime(fwd_compute=attn_fwd + experts_fwd, bwd_compute=attn_bwd + experts_dgrad + experts_wgrad,
                     fwd_comm=2 * c, bwd_comm=2 * c, tp_comm=0.0, cp_comm=0.0, ep_comm=4 * c,
                     experts_fwd=experts_fwd, experts_dgrad=experts_dgrad, experts_wgrad=experts_wgrad)


def test_a_pair_hides_communication_shorter_than_the_computation_beside_it():
    # c = 1 beside A_f = 2, E_b = 3, E_f = 3, A_b = 4: one after the other 2 + 3 + 4 + 3 + 4 x 1 = 16 s;
    # paired max(1, 2) + max(3, 1) + max(3, 1) + max(1, 4) = 12 s: the 4 s of all-to-alls hidden.
    layer = _layer(c=1, attn_fwd=2, experts_fwd=3, attn_bwd=4, experts_dgrad=2, experts_wgrad=1)
    assert layer.fwd + layer.bwd == 16
    assert pair_saving(layer, delay_wgrad=False) == pytest.approx(4)
    assert pair_saving(layer, delay_wgrad=True) == pytest.approx(4)


def test_the_delayed_weight_gradient_lets_the_backward_dispatch_start_earlier():
    # c = 2, A_f = A_b = E_f = 1, E_d = 1, E_w = 4: one after the other 1 + 1 + 1 + 5 + 8 = 16 s.
    # Without the delay the backward's dispatch waits for all 5 s of the experts' backward:
    #   max(2, 1) + max(5, 2) + max(1, 2) + max(2, 1) = 2 + 5 + 2 + 2 = 11 s, saving 5 s.
    # With it, only for the 1 s input gradient: the middle is max(max(5, 2) + 1, max(2, 1) + 2) = 6,
    #   2 + 6 + 2 = 10 s, saving 6 s.
    layer = _layer(c=2, attn_fwd=1, experts_fwd=1, attn_bwd=1, experts_dgrad=1, experts_wgrad=4)
    assert pair_saving(layer, delay_wgrad=False) == pytest.approx(5)
    assert pair_saving(layer, delay_wgrad=True) == pytest.approx(6)


def test_the_all_to_alls_slow_the_computation_beside_them():
    # The first layer with the all-to-all holding half the SMs: each computation beside it loses 0.5 x 1 s:
    # max(1, 2.5) + max(max(3.5, 1) + 3.5, max(1, 3.5) + 1) + max(1, 4.5) = 2.5 + 7 + 4.5 = 14 s, saving 2 s.
    layer = _layer(c=1, attn_fwd=2, experts_fwd=3, attn_bwd=4, experts_dgrad=2, experts_wgrad=1)
    assert pair_saving(layer, delay_wgrad=True, sm_share=0.5) == pytest.approx(2)
    # a dense layer has no all-to-all to hide
    assert pair_saving(LayerTime(1.0, 2.0, 0.0, 0.0, 0.0, 0.0, 0.0), delay_wgrad=True) == 0


@pytest.mark.parametrize("pp, vpp, microbatches, unpaired", [
    (1, 1, 32, 1),  # the first forward and the last backward
    (8, 4, 128, 9.75),  # 2 x 7 + 3 x 8 + 1 = 39 warm-up chunks of a quarter of the rank's layers
    (4, 2, 4, 4),  # all in the warm-up
])
def test_the_warm_up_runs_unpaired(pp, vpp, microbatches, unpaired):
    assert unpaired_microbatches(pp, vpp, microbatches) == unpaired


def test_the_overlap_shortens_the_step_by_what_its_pairs_hide():
    problem = load([*BASE, "train.delay_wgrad_compute=true", "plan.moe_a2a_overlap=true"]).problem
    cfg = ParallelConfig(tp=1, dp=16, ep=4, etp=1, mbs=1)
    before, after = estimate(problem, cfg), estimate(problem, replace(cfg, moe_a2a_overlap=True))
    # pp 1: 4 micro-batches, the first forward and last backward unpaired: 3 of the 4 pair
    hidden = before.breakdown["ep_comm"] - after.breakdown["ep_comm"]
    assert 0 < hidden <= 3 / 4 * before.breakdown["ep_comm"] + 1e-12
    assert before.step_time - after.step_time == pytest.approx(hidden)
    assert after.step_time == pytest.approx(sum(after.breakdown.values()))


def test_the_overlap_holds_one_more_chunk_in_flight():
    cfg = ParallelConfig(pp=4, vpp=2, dp=2)
    assert in_flight_chunks(replace(cfg, moe_a2a_overlap=True), stage=0, num_microbatches=16) == \
        in_flight_chunks(cfg, stage=0, num_microbatches=16) + 1 == 2 * 3 + 4 + 1 + 1
    assert in_flight_chunks(ParallelConfig(dp=8, moe_a2a_overlap=True), stage=0, num_microbatches=8) == 2


def test_a_plan_with_the_overlap_launches_it_and_passes_the_argv_rules():
    plan = api.plan([*BASE, *OVERLAP, "plan.zero=1"])  # Megatron-FSDP removes the variable instead
    args = plan.megatron_args
    assert "--overlap-moe-expert-parallel-comm" in args and "--delay-wgrad-compute" in args
    assert plan.parallel["ep"] > 1 and plan.recompute != "full"
    assert violations(args, world_size=plan.world_size) == []
    # Megatron-Bridge's queues for the overlap (8 with NCCL's all-to-all)
    assert megatron_env(plan) == {"CUDA_DEVICE_MAX_CONNECTIONS": "8"}


def test_the_argv_flags_become_constraints_and_train_keys():
    argv = ["--bf16", "--overlap-moe-expert-parallel-comm", "--delay-wgrad-compute"]
    assert "train.delay_wgrad_compute=true" in train_overrides(argv)
    assert not any("moe_a2a_overlap" in item for item in train_overrides(argv))  # a plan.* constraint, not a train key
    model = load(BASE).config.model
    [kept] = argv_constraints(argv, [], model=model)
    assert kept.overrides == ["plan.moe_a2a_overlap=true"]
    # megatron-core takes --overlap-dispatch-backward-with-experts-wgrad only without the overlap
    [off] = argv_constraints(["--bf16", "--overlap-dispatch-backward-with-experts-wgrad"], [], model=model)
    assert off.overrides == ["plan.moe_a2a_overlap=false"]
    # without either flag the search decides; the user's own key beats the argv's
    assert argv_constraints(["--bf16"], [], model=model) == []
    assert argv_constraints(argv, ["plan.moe_a2a_overlap=false"], model=model) == []


@pytest.mark.parametrize("extra, line", [
    (["train.delay_wgrad_compute=true", "plan.moe_a2a_overlap=false"],
     "train.delay_wgrad_compute=true with plan.moe_a2a_overlap=false: --delay-wgrad-compute runs only with the EP"),
    (["train.delay_wgrad_compute=true", "train.moe_dispatcher=allgather"],
     r"train.delay_wgrad_compute=true \(with the EP all-to-all overlap\) with train.moe_dispatcher=allgather"),
    (["train.moe_dispatcher=allgather", *OVERLAP],
     "plan.moe_a2a_overlap=true with train.moe_dispatcher=allgather: the overlap runs with the alltoall or flex"),
    ([*OVERLAP, "model.mtp_num_layers=2"], "plan.moe_a2a_overlap=true with model.mtp_num_layers=2: the overlap takes "
                                           "at most 1"),
    ([*OVERLAP, "model.moe_shared_expert_intermediate_size=64", "model.moe_shared_expert_overlap=true"],
     "plan.moe_a2a_overlap=true with model.moe_shared_expert_overlap=true: megatron-core takes one"),
])
def test_what_the_overlap_asks_of_the_run_is_one_line(extra, line):
    with pytest.raises(NestError, match="^" + line):
        load([*BASE, *extra])


def test_only_a_gpt_model_runs_the_overlap():
    """megatron-core's combined 1F1B schedule asks the model for its schedule plan, which only GPTModel builds
    (models/gpt/gpt_model.py:843 at d98e8a6): a hybrid Mamba MoE stack is never searched with it, and asking is one
    line."""
    loaded = load(["model=nemotron3_super", "cluster=dgx_h100_superpod", "cluster.num_devices=64"])
    assert searched_a2a_overlaps(loaded.problem, loaded.config.solver) == [False]
    moe_gpt = load(["model=deepseek_v3", "cluster=dgx_h100_superpod", "cluster.num_devices=64"])
    assert searched_a2a_overlaps(moe_gpt.problem, moe_gpt.config.solver) == [False, True]
    with pytest.raises(NestError, match="^plan.moe_a2a_overlap=true: model nemotron3_super is a hybrid Mamba stack; "
                                        "megatron-core's combined schedule runs the overlap for a GPT model only"):
        load(["model=nemotron3_super", "plan.moe_a2a_overlap=true"])


def test_a_dense_model_has_nothing_to_overlap():
    with pytest.raises(NestError, match="^plan.moe_a2a_overlap=true: model tiny_gpt has no experts"):
        load(["model=tiny_gpt", "plan.moe_a2a_overlap=true"])


@pytest.mark.parametrize("plan, line", [
    (["plan.ep=1"], "plan.ep=1 with plan.moe_a2a_overlap=true: the overlap hides expert-parallel all-to-alls"),
    (["plan.pp=2", "plan.vpp=1", "plan.ep=4"], "plan.pp=2 without virtual stages and plan.moe_a2a_overlap=true"),
    (["plan.ep=4", "plan.recompute=full"], "plan.recompute=full with plan.moe_a2a_overlap=true"),
    (["plan.ep=4", "plan.recompute=selective", "plan.recompute_modules=[moe]"],
     "plan.recompute_modules with moe and plan.moe_a2a_overlap=true"),
])
def test_the_layouts_the_overlap_refuses(plan, line):
    with pytest.raises(NestError, match="^invalid configuration: " + line):
        api.evaluate([*BASE, *OVERLAP, "plan.tp=1", *plan])


def _megatron_core_refusal(**fields) -> str | None:
    pytest.importorskip("megatron.core")
    import torch
    from megatron.core.transformer.transformer_config import TransformerConfig

    base = dict(num_layers=4, hidden_size=64, num_attention_heads=4, num_moe_experts=4, moe_grouped_gemm=True,
                moe_token_dispatcher_type="alltoall", expert_model_parallel_size=2, bf16=True,
                params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16, overlap_moe_expert_parallel_comm=True)
    try:
        TransformerConfig(**{**base, **fields})
    except AssertionError as err:
        return str(err)
    return None


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("fields, plan", [
    ({}, ["plan.ep=2"]),
    (dict(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2), ["plan.ep=2", "plan.pp=2", "plan.vpp=2"]),
    (dict(pipeline_model_parallel_size=2), ["plan.ep=2", "plan.pp=2", "plan.vpp=1"]),
    (dict(expert_model_parallel_size=1), ["plan.ep=1"]),
    (dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
     ["plan.ep=2", "plan.recompute=full"]),
    (dict(recompute_granularity="selective", recompute_modules=["moe_act"]),
     ["plan.ep=2", "plan.recompute=selective", "plan.recompute_modules=[moe_act]"]),
])
def test_the_layout_rules_refuse_what_megatron_core_refuses(fields, plan):
    refusal = _megatron_core_refusal(**fields)
    try:
        api.evaluate([*BASE, *OVERLAP, "plan.tp=1", *plan])
        line = None
    except NestError as err:
        line = str(err)
    assert (refusal is None) == (line is None), (refusal, line)


# GPT-OSS 120B's MoE layers (four of them) on 32 H100, the rest of the layout pinned: a space small enough to search
# thrice, where hiding the EP all-to-alls pays (0.242 s a step against 0.263 s without).
PROBLEM = ["model=gpt_oss_120b", "cluster=dgx_h100_superpod", "cluster.num_devices=32", "train.global_batch_size=64",
           "model.num_layers=4"]
SEARCHED = [*PROBLEM, "plan.pp=1", "plan.zero=1", "plan.recompute=none", "plan.mbs=1"]


def test_the_search_tries_the_overlap_and_keeps_the_faster():
    """The plan is the faster of the best without the overlap and the best with it, each from a search of its own
    (solver.moe_a2a_overlap), and launches what it priced."""
    both = api.plan(SEARCHED)
    without = api.plan([*SEARCHED, "solver.moe_a2a_overlap=[false]"])
    only = api.plan([*SEARCHED, "solver.moe_a2a_overlap=[true]"])
    assert "--overlap-moe-expert-parallel-comm" not in without.megatron_args
    assert "--overlap-moe-expert-parallel-comm" in only.megatron_args
    assert only.predicted["step_time_s"] < without.predicted["step_time_s"]
    assert both.predicted["step_time_s"] == min(without.predicted["step_time_s"], only.predicted["step_time_s"])
    assert both.parallel["moe_a2a_overlap"] and "--overlap-moe-expert-parallel-comm" in both.megatron_args
    assert both.choice["moe_a2a_overlap"] is True
    assert violations(both.megatron_args, world_size=both.world_size) == []
    # evaluate with the plan's keys scores the same plan; a user's plan.moe_a2a_overlap=false is a constraint
    again = api.evaluate([*PROBLEM, *key_overrides(both.choice)])
    assert again.predicted["step_time_s"] == pytest.approx(both.predicted["step_time_s"])
    pinned_off = api.plan([*SEARCHED, "plan.moe_a2a_overlap=false"])
    assert pinned_off.predicted["step_time_s"] == without.predicted["step_time_s"]
    # the plan's table says so, for the plan and for its tied runners-up that overlap
    console = Console(record=True, width=400)
    render(both, console)
    shown = console.export_text()
    assert f"EP {both.parallel['ep']} (all-to-alls overlapped)" in shown and " overlapped mbs " in shown


@pytest.mark.parametrize("overrides", [
    ["model=tiny_gpt"],  # no experts
    ["model=tiny_moe", "train.moe_dispatcher=allgather"],  # megatron-core overlaps alltoall or flex only
    ["model=tiny_moe", "model.mtp_num_layers=2"],  # at most one MTP layer with it
    ["model=tiny_moe", "train.cuda_graphs=true"],  # the argv's graph scope may refuse it
])
def test_no_overlap_is_searched_where_the_run_has_none(overrides):
    every = api.plan([*overrides, "cluster=dgx_h100_superpod", "cluster.num_devices=16", "train.global_batch_size=64"])
    without = api.plan([*overrides, "cluster=dgx_h100_superpod", "cluster.num_devices=16", "train.global_batch_size=64",
                        "solver.moe_a2a_overlap=[false]"])
    assert every.search["configs_in_space"] == without.search["configs_in_space"]
    assert not every.parallel["moe_a2a_overlap"]
