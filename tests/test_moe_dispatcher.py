"""train.moe_dispatcher: the MoE token dispatcher the plan is priced for and launches with (alltoall, allgather, or
DeepEP under the flex dispatcher), read from the argv's dispatcher flags, held to what Megatron runs.

Megatron-LM d98e8a6: megatron-core raises for --moe-enable-deepep without the flex dispatcher
(core/transformer/transformer_config.py:1743-1745) and MoEFlexTokenDispatcher asserts expert TP x EP > 1 for DeepEP
(core/transformer/moe/token_dispatcher.py:1836).
"""

from __future__ import annotations

import pytest

from nest_megatron import api
from nest_megatron.config.load import load
from nest_megatron.config.megatron_argv import train_overrides
from nest_megatron.cost.evaluate import layer_options
from nest_megatron.errors import NestError
from nest_megatron.launch.megatron_rules import violations
from nest_megatron.parallel.config import ParallelConfig

# tiny_moe: 4 experts, top-2 routing; 16 H100s.
BASE = ["model=tiny_moe", "cluster=dgx_h100_superpod", "cluster.num_devices=16", "train.global_batch_size=64"]
MOE_ARGV = ("--num-layers 4 --hidden-size 256 --num-attention-heads 8 --seq-length 128 --max-position-embeddings 128 "
            "--vocab-size 1024 --bf16 --micro-batch-size 1 --global-batch-size 64 --num-experts 4 --moe-router-topk 2 "
            "--tensor-model-parallel-size 1").split()


@pytest.mark.parametrize("dispatcher, flags", [
    ("alltoall", ["--moe-token-dispatcher-type", "alltoall"]),
    ("allgather", ["--moe-token-dispatcher-type", "allgather"]),
    ("deepep", ["--moe-token-dispatcher-type", "flex", "--moe-flex-dispatcher-backend", "deepep"]),
])
def test_the_plan_launches_the_dispatcher_it_is_priced_for(dispatcher, flags):
    plan = api.plan([*BASE, f"train.moe_dispatcher={dispatcher}"])
    args = plan.megatron_args
    start = args.index("--moe-token-dispatcher-type")
    assert args[start:start + len(flags)] == flags
    assert violations(args, world_size=plan.world_size) == []


def test_deepep_sends_a_token_once_to_each_rank_of_its_experts():
    # 4 experts on EP 2 (2 a rank), top-2 of a router taken as uniform: a token misses a rank with probability
    # C(2, 2) / C(4, 2) = 1/6, so it goes to 2 (1 - 1/6) = 5/3 ranks, against 2 copies with alltoall.
    cfg = ParallelConfig(tp=1, dp=16, ep=2, etp=1)
    assert layer_options(load([*BASE, "train.moe_dispatcher=deepep"]).problem, cfg)["ep_copies"] == pytest.approx(5 / 3)
    assert layer_options(load(BASE).problem, cfg)["ep_copies"] == 2


def test_deepep_is_planned_with_expert_tp_x_ep_above_one():
    plan = api.plan([*BASE, "train.moe_dispatcher=deepep"])
    assert plan.parallel["etp"] * plan.parallel["ep"] > 1
    with pytest.raises(NestError, match=r"^invalid configuration: plan.etp=1 and plan.ep=1 with "
                                        r"train.moe_dispatcher=deepep: Megatron's DeepEP dispatcher needs"):
        api.evaluate([*BASE, "train.moe_dispatcher=deepep", "plan.tp=1", "plan.ep=1"])


@pytest.mark.parametrize("flags, expected", [
    ([], None),  # none given: the planner's (alltoall)
    (["--moe-token-dispatcher-type", "allgather"], "allgather"),
    (["--moe-token-dispatcher-type", "flex"], "deepep"),  # DeepEP: the flex dispatcher's default backend
    (["--moe-token-dispatcher-type", "flex", "--moe-enable-deepep"], "deepep"),
])
def test_the_argv_sets_the_dispatcher(flags, expected):
    keys = dict(item.split("=", 1) for item in train_overrides([*MOE_ARGV, *flags]))
    assert keys.get("train.moe_dispatcher") == expected


@pytest.mark.parametrize("flags, line", [
    (["--moe-enable-deepep"], "--moe-enable-deepep with --moe-token-dispatcher-type allgather (the default): DeepEP "
                              "runs only under the flex dispatcher"),
    (["--moe-token-dispatcher-type", "flex", "--moe-flex-dispatcher-backend", "hybridep"],
     "--moe-flex-dispatcher-backend hybridep: the cost model prices the flex dispatcher with DeepEP only"),
])
def test_dispatchers_the_cost_model_does_not_price_are_one_line(flags, line):
    with pytest.raises(NestError) as err:
        train_overrides([*MOE_ARGV, *flags])
    assert str(err.value).startswith(line) and "\n" not in str(err.value)


def test_a_deepep_launch_keeps_the_users_dispatcher_in_megatrons_current_spelling():
    from nest_megatron.launch.devices import resolve
    from nest_megatron.launch.prepare import prepare

    # Before train.moe_dispatcher this argv launched with alltoall beside --moe-enable-deepep, which megatron-core
    # refuses at start-up.
    prepared = prepare(overrides=["model=tiny_moe", "cluster=dgx_h100_superpod", "train.global_batch_size=64"],
                       script="train.py", script_args=["--moe-token-dispatcher-type", "flex", "--moe-enable-deepep"],
                       devices=resolve(nproc_per_node="8", env={}))
    argv = prepared.this_node.argv
    argv = argv[argv.index("train.py") + 1:]
    assert argv[argv.index("--moe-token-dispatcher-type") + 1] == "flex" and "--moe-enable-deepep" not in argv
    assert argv[argv.index("--moe-flex-dispatcher-backend") + 1] == "deepep"
    assert violations(argv, world_size=8) == []
    assert any(line.startswith("--moe-enable-deepep: on -> (removed) (megatron-core's deprecated spelling")
               for line in prepared.changes)


def test_the_rules_agree_with_megatron_core():
    """megatron-core's own TransformerConfig refuses DeepEP without the flex dispatcher, and our rule says so."""
    pytest.importorskip("megatron.core")
    from megatron.core.transformer.transformer_config import TransformerConfig

    common = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_moe_experts=4, moe_router_topk=2)
    with pytest.raises(ValueError, match="DeepEP backend is only supported with flex token dispatcher"):
        TransformerConfig(**common, moe_token_dispatcher_type="alltoall", moe_enable_deepep=True)
    TransformerConfig(**common, moe_token_dispatcher_type="flex", moe_enable_deepep=True)
    found = violations([*MOE_ARGV, "--moe-token-dispatcher-type", "alltoall", "--moe-enable-deepep"], world_size=1)
    assert any(v.startswith("--moe-enable-deepep needs --moe-token-dispatcher-type flex") for v in found), found
    found = violations([*MOE_ARGV, "--moe-token-dispatcher-type", "flex", "--expert-tensor-parallel-size", "1"],
                       world_size=1)
    assert any(v.startswith("--moe-token-dispatcher-type flex (DeepEP) needs --expert-tensor-parallel-size x") for v in found)


def test_nemo_and_bridge_overrides_carry_deepep():
    from nest_megatron.integrations.bridge import bridge_overrides
    from nest_megatron.integrations.nemo import nemo_overrides

    # NeMo 2 cannot run the EP all-to-all overlap, which the search picks for this host-bound tiny model (its MoE
    # forwards' host spans then hold a backward too: cost/host.py)
    plan = api.plan([*BASE, "train.moe_dispatcher=deepep", "plan.moe_a2a_overlap=false"])
    nemo, bridge = nemo_overrides(plan), bridge_overrides(plan)
    assert nemo["model.config.moe_token_dispatcher_type"] == "flex" and nemo["model.config.moe_enable_deepep"] is True
    assert bridge["model.moe_token_dispatcher_type"] == "flex" and bridge["model.moe_enable_deepep"] is True
