"""Megatron-LM's own checks accept every rewritten argv of the paper grid at its planned world size.

Runs only with a Megatron-LM checkout (MEGATRON_LM_ROOT; Megatron-LM is not on PyPI): its
`parse_args` + `validate_args`, then megatron-core's `initialize_model_parallel` on torch's fake
process-group backend (tests/megatron_lm_check.py, in a fresh process), with the environment the
launcher gives torchrun (launch/prepare.py megatron_env).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from paper_grid_plans import grid_plans

from nest_megatron.errors import InfeasibleError
from nest_megatron.launch.devices import Devices
from nest_megatron.launch.megatron_rules import violations
from nest_megatron.launch.prepare import megatron_env, prepare

ROOT = os.environ.get("MEGATRON_LM_ROOT")
pytestmark = [
    pytest.mark.skipif(not ROOT, reason="MEGATRON_LM_ROOT is not set (a Megatron-LM checkout; it is not on PyPI)"),
    pytest.mark.skipif(ROOT is not None and importlib.util.find_spec("triton") is None,
                       reason="Megatron-LM main imports triton at module level: pip install triton"),
    pytest.mark.slow,
]
CHECK = Path(__file__).with_name("megatron_lm_check.py")


def run_megatron(cases: list[dict], tmp_path: Path) -> dict:
    path = tmp_path / "cases.json"
    path.write_text(json.dumps(cases))
    proc = subprocess.run([sys.executable, str(CHECK), str(path)], capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def grid_verdicts(tmp_path_factory) -> tuple[str, dict, dict]:
    """(Megatron-LM commit, its verdict per paper-grid argv, ours): None / [] when accepted."""
    plans = grid_plans()
    cases = [{"name": p.name, "argv": p.argv, "world_size": p.world_size, "env": megatron_env(p.plan)} for p in plans]
    # Megatron-LM's checks can fail: a line it must reject, with the same environment
    bad = dict(cases[0], name="bad: tp 3", argv=[*cases[0]["argv"], "--tensor-model-parallel-size", "3"])
    out = run_megatron([*cases, bad], tmp_path_factory.mktemp("grid"))
    results = out["results"]
    assert results.pop("bad: tp 3") is not None
    ours = {p.name: violations(p.argv, world_size=p.world_size) for p in plans}
    return out["commit"], results, ours


def test_our_rules_agree_with_megatron_lm_on_the_paper_grid(grid_verdicts):
    _, theirs, ours = grid_verdicts
    assert {name: bool(v) for name, v in ours.items()} == {name: bool(v) for name, v in theirs.items()}


def test_megatron_lm_accepts_every_paper_grid_plan(grid_verdicts):
    commit, results, _ = grid_verdicts
    failed = {name: error for name, error in results.items() if error}
    print(f"Megatron-LM {commit}: {len(results) - len(failed)} of {len(results)} paper-grid argvs accepted")
    assert failed == {}


def test_what_our_rules_accept_megatron_lm_accepts(tmp_path):
    """The rule cases of test_megatron_rules, good and bad, through Megatron-LM: every argv our rules accept,
    Megatron-LM accepts too (our rules may be stricter: sequence parallel with TP 1 is an error here, a
    silent fix-up there)."""
    from test_megatron_rules import BASE, CASES, MOE

    data = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--lr", "1e-4", "--train-iters", "10"]
    cases, ours = [], {}
    for rule, good, bad, _ in CASES:
        for kind, (extra, world) in (("good", good), ("bad", bad)):
            batch = [] if "--global-batch-size" in extra else ["--global-batch-size", "64"]
            argv = [*BASE, *batch, *extra.split(), *data]
            name = f"{rule} ({kind}, {extra or 'base'})"
            ours[name] = violations(argv, world_size=world)
            fsdp, split = "--use-megatron-fsdp" in argv, " ".join(argv)
            parallel = "--tensor-model-parallel-size 1 " not in split and "--tensor-model-parallel-size" in split
            needs_one = not fsdp and (parallel or "--context-parallel-size" in split)
            env = {"CUDA_DEVICE_MAX_CONNECTIONS": "1" if needs_one else None}
            cases.append({"name": name, "argv": argv, "world_size": world, "env": env})
    # the rank-order rule, which Megatron-LM checks itself: (base, extra flags, CUDA_DEVICE_MAX_CONNECTIONS)
    order_cases = [(MOE, "--expert-model-parallel-size 4", None),
                   (MOE, "--pipeline-model-parallel-size 2 --use-tp-pp-dp-mapping --expert-model-parallel-size 4", None),
                   (MOE, "--pipeline-model-parallel-size 2 --expert-model-parallel-size 4", None),
                   (BASE, "--pipeline-model-parallel-size 2 --use-tp-pp-dp-mapping --context-parallel-size 2", "1"),
                   (BASE, "--pipeline-model-parallel-size 2 --use-tp-pp-dp-mapping", None)]
    for base, extra, connections in order_cases:
        argv = [*base, "--global-batch-size", "64", *extra.split(), *data]
        name = f"order: {'moe' if base is MOE else 'dense'} {extra}"
        ours[name] = violations(argv, world_size=8)
        cases.append({"name": name, "argv": argv, "world_size": 8, "env": {"CUDA_DEVICE_MAX_CONNECTIONS": connections}})
    results = run_megatron(cases, tmp_path)["results"]
    # on these, Megatron-LM itself decides: the two must agree both ways
    assert {n: bool(ours[n]) for n in results if n.startswith("order:")} == {
        n: bool(results[n]) for n in results if n.startswith("order:")}
    wrongly_accepted = {name: results[name] for name in results if not ours[name] and results[name]}
    assert wrongly_accepted == {}
    both_reject = sum(1 for name in results if ours[name] and results[name])
    print(f"rule cases: {len(results)}; we reject {sum(1 for v in ours.values() if v)}, Megatron-LM rejects "
          f"{sum(1 for v in results.values() if v)}, both {both_reject}")
    for name in results:
        if ours[name] and not results[name]:
            print(f"  only we reject: {name}: {ours[name][0]}")


# The models of the reach issue, on the machines it names: 256 and 2,048 H100s, 72 and 1,152 GB200s (NVL72).
NEW_MODELS = ("llama31_405b", "deepseek_v3", "qwen3_30b_a3b", "qwen3_235b_a22b", "gpt_oss_120b", "kimi_k2",
              "nemotron_h_56b", "nemotron3_super", "nemotron3_ultra")
MACHINES = (("dgx_h100_superpod", 256, 8), ("dgx_h100_superpod", 2048, 8), ("gb200_nvl72", 72, 4),
            ("gb200_nvl72", 1152, 4))
DATA = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--lr", "1e-4", "--train-iters", "10"]


def test_megatron_lm_accepts_each_new_shipped_model_s_launch(tmp_path):
    """Each new shipped model planned and rewritten as `launch` does (prepare: a NullTokenizer of the planned
    entries, the plan's model and layout flags), through our rule table and Megatron-LM's validate_args and
    initialize_model_parallel. A cell the model does not fit in is left out (said in the output)."""
    cases, left_out = [], []
    # and a MoE model with the EP all-to-all overlap (its rules: parallel/rules.py a2a-overlap-*)
    overlap = ["plan.moe_a2a_overlap=true", "train.delay_wgrad_compute=true"]
    runs = [(model, [], machine) for model in NEW_MODELS for machine in MACHINES]
    runs += [("deepseek_v3", overlap, MACHINES[0]), ("qwen3_235b_a22b", overlap, MACHINES[0])]
    # and token dropping, padded to capacity (its rules: parallel/rules.py pad-needs-capacity, launch rule pad-deepep)
    runs += [("qwen3_30b_a3b", ["model.moe_expert_capacity_factor=1.0", "model.moe_pad_expert_input_to_capacity=true"],
              MACHINES[0])]
    # and activation offloading (its rule: parallel/rules.py cpu-offloading): 40 of Llama 3 70B's 80 layers
    runs += [("llama3_70b", ["plan.cpu_offloading_num_layers=40"], MACHINES[2])]
    # and micro-batch groups of 6 on 4 stages (256 micro-batches: a last group of 4; its rule: interleaved-microbatches)
    runs += [("llama3_70b", ["plan.pp=4", "plan.vpp=5", "plan.microbatch_group_size_per_vp_stage=6"], MACHINES[0])]
    # and the group the search gives 6 micro-batches on 4 stages (tests/test_microbatch_groups.py: one group of 6)
    runs += [("llama3_70b", ["train.global_batch_size=24", "plan.tp=4", "plan.pp=4", "plan.mbs=1"],
              ("dgx_h100_superpod", 64, 8))]
    for model, extra, (cluster, devices, per_node) in runs:
        name = f"{model}/{cluster}/{devices}" + (f" with {' '.join(extra)}" if extra else "")
        try:
            prepared = prepare(overrides=[f"model={model}", f"cluster={cluster}", *extra], script="pretrain_gpt.py",
                               script_args=list(DATA),
                               devices=Devices(num_nodes=devices // per_node, per_node=per_node, node_rank=0,
                                               master_addr="n1"))
        except InfeasibleError as err:
            left_out.append(f"{name}: {err}")
            continue
        assert violations(prepared.script_args, world_size=prepared.plan.world_size) == [], name
        cases.append({"name": name, "argv": prepared.script_args, "world_size": prepared.plan.world_size,
                      "env": megatron_env(prepared.plan)})
    out = run_megatron(cases, tmp_path)
    failed = {name: error for name, error in out["results"].items() if error}
    print(f"Megatron-LM {out['commit']}: {len(cases) - len(failed)} of {len(cases)} new-model launches accepted; "
          f"left out (do not fit): {left_out or 'none'}")
    assert failed == {}
