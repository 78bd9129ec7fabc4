"""The interleaved schedule's micro-batch groups (plan.microbatch_group_size_per_vp_stage:
--microbatch-group-size-per-virtual-pipeline-stage): the rule on the micro-batches (parallel/rules.py
interleaved-microbatches), the warm-up memory it costs, the order it runs (cost/schedule.py) checked against
megatron-core's own schedule table and warm-up count, the plan that carries a user's flag to Megatron, NeMo and
Megatron-Bridge, and the group the search gives a batch that pp does not divide.

megatron-core's schedule refusing exactly what the rule refuses: tests/test_megatron_rules_rare.py
(test_microbatch_groups_as_megatron_cores_schedule_decides).
"""

from __future__ import annotations

import pytest

from nest_megatron import api
from nest_megatron.config.load import load
from nest_megatron.cost.schedule import megatron_order, schedule_table
from nest_megatron.errors import NestError
from nest_megatron.integrations import bridge_overrides, nemo_overrides
from nest_megatron.launch.constraints import argv_constraints
from nest_megatron.launch.megatron_rules import GROUP_FLAG, violations
from nest_megatron.solver.space import microbatch_group

# tiny_gpt (4 layers, s = 128, h = 256, 8 heads) on pp 2 x vpp 2: one layer per model chunk; dp 4 on 8 GPUs
TINY = ["model=tiny_gpt", "cluster=dgx_h100_superpod", "cluster.num_devices=8", "plan.tp=1", "plan.pp=2",
        "plan.vpp=2", "plan.mbs=1", "plan.recompute=none", "plan.zero=1"]
GROUP = "plan.microbatch_group_size_per_vp_stage"
# One chunk's activations at micro-batch 1: 34 s b h + 4 b a s bytes (tests/test_cpu_offloading.py LAYER_BYTES at b 1)
CHUNK_BYTES = 34 * 128 * 1 * 256 + 4 * 1 * 8 * 128  # 1,118,208
GIB = 2**30


@pytest.mark.parametrize("batch, group, refused", [
    # 5 micro-batches (global 20 over dp 4): groups of pp = 2 leave a last group of 1 < pp
    (20, None, r"5 micro-batches: the interleaved schedule needs a multiple of pp=2"),
    (20, 3, None),  # 3 + 2: the last group holds pp
    (20, 4, r"=4 with 5 micro-batches per iteration: leaves a last group of 1 micro-batches, fewer than pp=2"),
    (20, 6, r"=6 with 5 micro-batches per iteration: must be from pp=2 to the 5 micro-batches"),
    (32, 8, None),  # 8 micro-batches in one group
])
def test_the_micro_batches_fill_the_groups_as_megatron_core_asks(batch, group, refused):
    overrides = [*TINY, f"train.global_batch_size={batch}", *([f"{GROUP}={group}"] if group else [])]
    if refused is None:
        api.evaluate(overrides)
    else:
        with pytest.raises(NestError, match=refused):
            api.evaluate(overrides)


def test_a_larger_group_holds_more_chunks_in_the_warm_up():
    # Rank 0's warm-up: 2 (p - 1) + (v - 1) g forwards, then one more before its first backward: g = 2 (pp) -> 5
    # chunks, g = 4 -> 7, g = 8 -> 11; each chunk one layer's activations. Step time: the same bubble.
    def rank0(group):
        plan = api.evaluate([*TINY, "train.global_batch_size=32", *([f"{GROUP}={group}"] if group else [])])
        return plan.predicted["memory_per_stage_gib"][0] * GIB, plan.predicted["step_time_s"]

    (base, step), (four, step4), (eight, _) = rank0(None), rank0(4), rank0(8)
    assert four - base == pytest.approx(2 * CHUNK_BYTES, rel=1e-6)
    assert eight - base == pytest.approx(6 * CHUNK_BYTES, rel=1e-6)
    assert step4 == pytest.approx(step)


@pytest.mark.parametrize("microbatches, vpp, group", [(8, 2, 2), (5, 2, 3), (7, 3, 4), (12, 4, 5), (6, 2, 6)])
def test_the_order_is_megatron_cores(microbatches, vpp, group):
    from megatron.core.pipeline_parallel.schedules import get_schedule_table

    assert schedule_table(microbatches, vpp, group) == get_schedule_table(microbatches, vpp, group)


@pytest.mark.parametrize("pp, microbatches, vpp, group", [(2, 8, 2, 2), (2, 5, 2, 3), (4, 8, 2, 6), (3, 9, 3, 3)])
def test_each_rank_warms_up_as_megatron_core_counts(pp, microbatches, vpp, group, monkeypatch):
    """megatron-core 0.16.1's get_pp_rank_microbatches (the warm-up the interleaved schedule runs) against the
    forwards megatron_order puts before each rank's first backward."""
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel.schedules import get_pp_rank_microbatches

    for stage in range(pp):
        monkeypatch.setattr(parallel_state, "get_pipeline_model_parallel_world_size", lambda: pp)
        monkeypatch.setattr(parallel_state, "get_pipeline_model_parallel_rank", lambda: stage)
        monkeypatch.setattr(parallel_state, "get_virtual_pipeline_model_parallel_world_size", lambda: vpp)
        _, _, warmup, _ = get_pp_rank_microbatches(microbatches, vpp, group)
        ops = megatron_order(pp=pp, vpp=vpp, stage=stage, num_microbatches=microbatches, group=group)
        assert next(i for i, op in enumerate(ops) if not op.forward) - 1 == warmup


SMALL = ["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "8", "--seq-length", "128",
         "--max-position-embeddings", "128", "--micro-batch-size", "1", "--bf16", "--pipeline-model-parallel-size", "2",
         "--num-virtual-stages-per-pipeline-rank", "2"]


def test_the_argv_s_group_is_judged_with_it():
    # world 8, pp 2: dp 4; global 20 -> 5 micro-batches, which groups of 3 take and Megatron's default groups of 2 not
    assert violations([*SMALL, "--global-batch-size", "20", GROUP_FLAG, "3"], world_size=8) == []
    assert violations([*SMALL, "--global-batch-size", "20"], world_size=8) == [
        "5 micro-batches: the interleaved schedule needs a multiple of pp=2"]
    assert violations([*SMALL, "--global-batch-size", "64", GROUP_FLAG, "3"], world_size=8) == [
        f"{GROUP_FLAG}=3 with 16 micro-batches per iteration: leaves a last group of 1 micro-batches, fewer than pp=2 "
        "(0 or >= pp allowed)"]


def test_a_users_group_is_planned_emitted_and_carried():
    fixed = argv_constraints([*SMALL, GROUP_FLAG, "3"], user=[], model=load(TINY).config.model)
    assert [c.overrides for c in fixed] == [[f"{GROUP}=3"]]
    plan = api.evaluate([*TINY, "train.global_batch_size=20", f"{GROUP}=3"])
    args = plan.megatron_args
    assert plan.parallel["microbatch_group_size_per_vp_stage"] == 3 and args[args.index(GROUP_FLAG) + 1] == "3"
    assert nemo_overrides(plan)["trainer.strategy.microbatch_group_size_per_vp_stage"] == 3
    assert bridge_overrides(plan)["model.microbatch_group_size_per_vp_stage"] == 3
    # without virtual stages Megatron reads no group: none emitted
    flat = api.evaluate([*TINY, "plan.vpp=1", "train.global_batch_size=20", f"{GROUP}=3"])
    assert GROUP_FLAG not in flat.megatron_args


@pytest.mark.parametrize("pinned, pp, vpp, microbatches, group", [
    (None, 4, 2, 8, None),  # pp divides the micro-batches: Megatron's default groups of pp
    (None, 4, 1, 6, None),  # nothing interleaved: no group
    (None, 4, 4, 6, 6),  # 5 leaves a last group of 1 < pp; 6: one group
    (None, 4, 2, 22, 6),  # 5 leaves a last group of 2 < pp; 6 of 4
    (None, 8, 2, 12, 12),  # 9, 10, 11 leave 3, 2, 1 < 8
    (None, 3, 2, 7, 4),  # 4 + 3: the last group holds pp
    (None, 4, 2, 3, None),  # fewer micro-batches than pp: no group runs them (the rule says so)
    (5, 4, 2, 6, 5),  # the user's, whatever it leaves (the rule judges it)
])
def test_the_search_takes_the_smallest_group_that_runs_the_batch(pinned, pp, vpp, microbatches, group):
    assert microbatch_group(pinned, pp=pp, vpp=vpp, microbatches=microbatches) == group


def test_a_batch_pp_does_not_divide_is_planned_interleaved_in_groups():
    """Llama 3 70B on 64 H100 at TP 4, PP 4, global batch 24: DP 4 gives 6 micro-batches, which Megatron's default
    groups of 4 cannot interleave. Before groups were searched the plan took CP 2 (12 micro-batches) at 1.801 s;
    now DP 4 interleaved in one group of 6 (1.694 s), and the flag goes to Megatron."""
    plan = api.plan(["model=llama3_70b", "cluster=dgx_h100_superpod", "cluster.num_devices=64",
                     "train.global_batch_size=24", "plan.tp=4", "plan.pp=4", "plan.mbs=1"])
    p = plan.parallel
    assert (p["dp"], p["vpp"], p["microbatch_group_size_per_vp_stage"]) == (4, 4, 6)
    args = plan.megatron_args
    assert args[args.index(GROUP_FLAG) + 1] == "6"
    assert violations(args, world_size=64) == []
