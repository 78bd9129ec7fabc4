"""Plan.digest: what every node of a job must agree on, as 12 hex digits (`launch --expect-plan`).

Equal for the same problem planned twice (also in other processes, with other hash seeds, as the nodes of a
job plan), different when anything that changes the Megatron a node builds changes, equal when only the
predictions, the search statistics or the labels differ.
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys

import pytest

from nest_megatron import api
from nest_megatron.plan import DIGEST_FIELDS, Plan

# tiny_gpt on 8 devices: small enough to plan in a fraction of a second
PROBLEM = ["model=tiny_gpt", "cluster=dgx_h100_superpod", "cluster.num_devices=8", "train.global_batch_size=64"]


@pytest.fixture(scope="module")
def plan() -> Plan:
    return api.plan(PROBLEM)


def test_digest_is_twelve_hex_digits_and_survives_the_json_form(plan):
    assert re.fullmatch(r"[0-9a-f]{12}", plan.digest)
    assert Plan.from_dict(plan.to_dict()).digest == plan.digest


def test_same_problem_planned_twice_has_the_same_digest(plan):
    again = api.plan(PROBLEM)
    assert again is not plan and again.digest == plan.digest


def test_the_digest_is_the_same_in_other_processes(plan):
    """As the nodes of a job: separate processes with different string-hash seeds print the same digest."""
    digests = set()
    for seed in ("1", "2"):
        proc = subprocess.run([sys.executable, "-m", "nest_megatron.cli", "launch", *PROBLEM, "--nproc-per-node", "8",
                               "--dry-run", "--", "train.py"], capture_output=True, text=True, timeout=120,
                              env={**os.environ, "PYTHONHASHSEED": seed, "NO_COLOR": "1"})
        assert proc.returncode == 0, proc.stderr
        digests.update(re.findall(r", plan ([0-9a-f]{12})$", proc.stdout, re.M))
    # a launch whose argv has no --overlap-grad-reduce / --overlap-param-gather plans with both off
    assert digests == {api.plan(["train.overlap_grad_reduce=false", "train.overlap_param_gather=false", *PROBLEM]).digest}


def test_a_pin_that_changes_the_plan_changes_the_digest(plan):
    other_tp = 2 if plan.parallel["tp"] != 2 else 4
    pinned = api.plan([*PROBLEM, f"plan.tp={other_tp}"])
    assert pinned.parallel["tp"] == other_tp and pinned.digest != plan.digest


# One change per field that every node must agree on, each of which would build another Megatron.
CHANGES = {
    "num_devices": lambda p: p.num_devices * 2,
    "parallel": lambda p: {**p.parallel, "vpp": p.parallel["vpp"] + 1},
    "micro_batch_size": lambda p: p.micro_batch_size * 2,
    "global_batch_size": lambda p: p.global_batch_size * 2,
    "zero_stage": lambda p: (p.zero_stage + 1) % 4,
    "recompute": lambda p: {**p.recompute, "granularity": "full" if p.recompute.get("granularity") != "full" else None},
    "layers_per_stage": lambda p: [*p.layers_per_stage[:-1], p.layers_per_stage[-1] + 1],
    "rank_order": lambda p: "tp-cp-dp-pp" if p.rank_order != "tp-cp-dp-pp" else "tp-cp-ep-pp-dp",
    "rank_to_device": lambda p: list(reversed(p.rank_to_device)),
    "megatron_args": lambda p: [*p.megatron_args, "--overlap-grad-reduce"],
}


def test_every_agreed_field_has_a_change():
    assert set(CHANGES) == set(DIGEST_FIELDS)


@pytest.mark.parametrize("name", sorted(CHANGES))
def test_changing_what_nodes_must_agree_on_changes_the_digest(plan, name):
    changed = dataclasses.replace(plan, **{name: CHANGES[name](plan)})
    assert getattr(changed, name) != getattr(plan, name)
    assert changed.digest != plan.digest


def test_predictions_timings_and_labels_leave_the_digest_alone(plan):
    slower = dataclasses.replace(
        plan,
        predicted={**plan.predicted, "step_time_s": plan.predicted["step_time_s"] * 3, "peak_memory_gib": 1.0},
        search={**plan.search, "time_s": plan.search.get("time_s", 0.0) + 12.5, "configs_evaluated": 1},
        runners_up=[],
        overrides=[*plan.overrides, "solver.name=dp"],
        model="renamed",
        cluster="renamed",
        group_levels={},
    )
    assert slower.digest == plan.digest
