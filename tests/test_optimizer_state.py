"""The precision-aware optimizer (--use-precision-aware-optimizer and its dtypes): read from a Megatron argv, priced
as the bytes of state it keeps, planned with the distributed optimizer only, emitted on the plan's argv.

Megatron-LM d98e8a6: the flags are training/arguments.py:3667-3685; the optimizer refuses it without the
distributed optimizer (megatron/core/optimizer/__init__.py:1057); with an fp32 master Transformer Engine's FusedAdam
keeps only the 16 low bits beside the bf16 weight (store_param_remainders, optimizer/optimizer_config.py:192), unless
an fp8 recipe other than delayed makes Megatron keep its own fp32 master (optimizer_config.py:407-413).
"""

from __future__ import annotations

import pytest

from nest_megatron import api
from nest_megatron.config.load import load
from nest_megatron.config.megatron_argv import train_overrides
from nest_megatron.errors import NestError
from nest_megatron.launch.megatron_rules import violations
from nest_megatron.model.spec import Numerics, OptimizerDtypes

BASE = ["model=tiny_gpt", "cluster=dgx_h100_superpod", "cluster.num_devices=16", "train.global_batch_size=64"]
AWARE = ["train.precision_aware_optimizer=true"]
MODEL = ("--num-layers 4 --hidden-size 256 --num-attention-heads 8 --seq-length 128 --max-position-embeddings 128 "
         "--vocab-size 1024 --bf16 --micro-batch-size 1 --global-batch-size 64").split()


@pytest.mark.parametrize("dtypes, fp8_recipe, state", [
    (None, None, 12),  # Megatron's fp32 master weight and two fp32 moments
    (OptimizerDtypes(), None, 2 + 4 + 4),  # the master as 16-bit remainders beside the bf16 weight
    (OptimizerDtypes(exp_avg="bf16", exp_avg_sq="bf16"), None, 2 + 2 + 2),
    (OptimizerDtypes(main_params="fp16", exp_avg="fp8", exp_avg_sq="fp8"), None, 2 + 1 + 1),
    (OptimizerDtypes(), "delayed", 2 + 4 + 4),  # delayed scaling: FusedAdam still keeps the master
    (OptimizerDtypes(), "tensorwise", 4 + 4 + 4),  # Megatron keeps its own fp32 master
    (OptimizerDtypes(main_params="fp16"), "tensorwise", 2 + 4 + 4),
])
def test_bytes_of_state_per_parameter(dtypes, fp8_recipe, state):
    assert Numerics(fp8_recipe=fp8_recipe, optimizer_dtypes=dtypes).optimizer_state_bytes == state


def test_the_optimizer_state_in_memory_is_the_dtypes_share():
    # ZeRO 1 on the same layout: only the optimizer part changes, 12 B -> 2 + 2 + 2 = 6 B a parameter: half.
    pinned = [*BASE, "plan.tp=1", "plan.pp=1", "plan.zero=1", "plan.mbs=1"]
    plain = api.evaluate(pinned).predicted["memory_breakdown_gib"][0]
    aware = api.evaluate([*pinned, *AWARE, "train.exp_avg_dtype=bf16", "train.exp_avg_sq_dtype=bf16"])
    lowered = aware.predicted["memory_breakdown_gib"][0]
    assert lowered["optimizer"] == pytest.approx(plain["optimizer"] / 2)
    assert {k: v for k, v in lowered.items() if k != "optimizer"} == {k: v for k, v in plain.items() if k != "optimizer"}
    assert "--use-precision-aware-optimizer" in aware.megatron_args
    args = aware.megatron_args
    assert args[args.index("--exp-avg-dtype") + 1] == "bf16" and "--main-params-dtype" not in args  # fp32: the default


def test_the_search_keeps_the_distributed_optimizer():
    # tiny_gpt on 16 GPUs plans Megatron-FSDP (ZeRO 3) when free (tests/test_precision_keys.py's BASE); with the
    # precision-aware optimizer only ZeRO 1 launches.
    assert api.plan([*BASE, *AWARE]).zero_stage == 1
    with pytest.raises(NestError, match=r"^invalid configuration: plan.zero=0 and train.precision_aware_optimizer=true: "
                                        r"the precision-aware optimizer runs with the distributed optimizer"):
        api.evaluate([*BASE, *AWARE, "plan.zero=0"])


@pytest.mark.parametrize("extra, line", [
    (["train.exp_avg_dtype=bf16"], "train.exp_avg_dtype=bf16: only the precision-aware optimizer keeps its state in "
                                   "another dtype than fp32"),
    ([*AWARE, "train.exp_avg_sq_dtype=int4"], "train.exp_avg_sq_dtype=int4: allowed are fp32, fp16, bf16, fp8"),
    ([*AWARE, "train.main_params_dtype=bf16"], "train.main_params_dtype=bf16: allowed are fp32, fp16"),
])
def test_bad_optimizer_dtypes_are_one_line(extra, line):
    with pytest.raises(NestError) as err:
        load([*BASE, *extra])
    assert str(err.value).startswith(line) and "\n" not in str(err.value)


def test_the_argv_sets_the_keys_and_the_rule_holds():
    keys = dict(item.split("=", 1) for item in train_overrides(
        [*MODEL, "--use-precision-aware-optimizer", "--exp-avg-sq-dtype", "fp8"]))
    assert (keys["train.precision_aware_optimizer"], keys["train.exp_avg_dtype"], keys["train.exp_avg_sq_dtype"]) == \
        ("true", "fp32", "fp8")
    assert keys["train.main_params_dtype"] == "fp32"
    found = violations([*MODEL, "--use-precision-aware-optimizer"], world_size=1)
    assert any(v.startswith("--use-precision-aware-optimizer needs --use-distributed-optimizer") for v in found), found
    for sharded in ("--use-distributed-optimizer", "--use-megatron-fsdp --ckpt-format fsdp_dtensor"):
        assert violations([*MODEL, "--use-precision-aware-optimizer", *sharded.split()], world_size=1) == []


def test_a_launch_with_the_flag_plans_the_distributed_optimizer_and_keeps_the_flag_once():
    from nest_megatron.launch.devices import resolve
    from nest_megatron.launch.prepare import prepare

    devices = resolve(nproc_per_node="8", env={})
    prepared = prepare(overrides=["model=tiny_gpt", "cluster=dgx_h100_superpod", "train.global_batch_size=64"],
                       script="train.py", script_args=["--use-precision-aware-optimizer", "--exp-avg-dtype", "bf16"],
                       devices=devices)
    assert prepared.plan.zero_stage == 1
    argv = prepared.this_node.argv
    assert argv.count("--use-precision-aware-optimizer") == 1 and argv.count("--exp-avg-dtype") == 1
    assert violations(argv[argv.index("train.py") + 1:], world_size=8) == []


def test_nemo_and_bridge_overrides_carry_it_or_say_they_cannot():
    from nest_megatron.integrations.bridge import bridge_overrides
    from nest_megatron.integrations.nemo import nemo_overrides

    plan = api.evaluate([*BASE, *AWARE, "plan.zero=1"])
    assert nemo_overrides(plan)["optim.config.use_precision_aware_optimizer"] is True
    assert bridge_overrides(plan)["optimizer.use_precision_aware_optimizer"] is True
    lowered = api.evaluate([*BASE, *AWARE, "plan.zero=1", "train.exp_avg_dtype=bf16"])
    with pytest.raises(NestError, match=r"^the plan keeps the optimizer state in bf16 \(--exp-avg-dtype\), which NeMo"):
        nemo_overrides(lowered)


def test_the_search_checks_memory_with_the_same_state():
    # The same pinned layout priced by evaluate with fp32 and with bf16 moments; on a device whose memory lies
    # between the two peaks the search finds the lowered plan and nothing without it (its memory check reads
    # the model's optimizer state as evaluate does).
    pinned = [*BASE, "plan.tp=1", "plan.pp=1", "plan.cp=1", "plan.zero=1", "plan.mbs=1", "plan.recompute=none"]
    lowered = [*AWARE, "train.exp_avg_dtype=bf16", "train.exp_avg_sq_dtype=bf16"]
    fp32 = api.evaluate(pinned).predicted["peak_memory_gib"]
    bf16 = api.evaluate([*pinned, *lowered]).predicted["peak_memory_gib"]
    assert bf16 < fp32
    between = [f"cluster.device_memory_gib={(fp32 + bf16) / 2}"]
    assert api.plan([*pinned, *lowered, *between]).predicted["peak_memory_gib"] == pytest.approx(bf16)
    with pytest.raises(NestError, match="fits"):
        api.plan([*pinned, *AWARE, *between])
