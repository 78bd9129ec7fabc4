"""`plan` when Megatron's rules leave no configuration to search: the rule's line, not the memory message.

Every expected line below is worked out by hand from parallel/rules.py's rules (in the comments); the memory
message stays for a search that scored configurations of which none fit.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from nest_megatron import api
from nest_megatron.errors import InfeasibleError, NestError

CLI = [sys.executable, "-m", "nest_megatron.cli"]
H100 = ["cluster=dgx_h100_superpod"]
# tiny_gpt (8 heads, 4 layers) on 2 devices, a search space small enough to count by hand: TP in {1, 2, 4, 8}
# (divisors of the 8 GPUs of a node that divide the heads), CP 1, PP in {1, 2} (dp: PP <= 4 dividing the 2
# devices; enumerate: divisors of 4 layers, where 4 leaves devices over), one mbs, ZeRO, recompute, order, no VPP.
# TP x PP must divide 2 devices: (1, 1) dp 2, (1, 2) dp 1, (2, 1) dp 1 are the 3 configurations.
NARROW = ["model=tiny_gpt", *H100, "cluster.num_devices=2", "train.global_batch_size=64", "solver.micro_batch_sizes=[3]",
          "solver.zero_stages=[1]", "solver.recompute=[none]", "solver.rank_orders=[tp-cp-ep-dp-pp]",
          "solver.max_virtual_stages=1", "solver.max_context_parallel=1"]


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=300)


def test_plan_with_a_pinned_dp_that_splits_no_batch_names_the_batch_rule():
    # 63 is odd: no micro-batch size times dp = 16 divides it; the pinned dp with Megatron's default mbs 1.
    proc = run_cli("plan", "model=llama3_8b", *H100, "cluster.num_devices=16", "train.global_batch_size=63", "plan.dp=16")
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert proc.stderr == ("nest-megatron plan: error: no launchable configuration: train.global_batch_size=63: must be "
                           "a multiple of micro_batch_size*dp = 1*16 (plan.dp=16 pinned)\n")


@pytest.mark.parametrize("overrides, line", [
    # TP 8 x CP 4 = 32 ranks before any DP or PP; dp = 16 // 32 rounds to 0, Megatron's smallest is 1.
    (["model=llama3_8b", "cluster.num_devices=16", "plan.tp=8", "plan.cp=4"],
     "tp*cp*pp*dp = 8*4*1*1 = 32 devices, but the cluster has 16 (plan.tp=8, plan.cp=4 pinned)"),
    # Mixtral has 8 experts; 3 divides no 8.
    (["model=mixtral_8x7b", "cluster.num_devices=64", "plan.ep=3"],
     "plan.ep=3: must divide num_experts=8 (plan.ep=3 pinned)"),
])
def test_pins_that_break_a_rule_name_it(overrides, line):
    with pytest.raises(NestError) as err:
        api.plan([*overrides, *H100])
    assert not isinstance(err.value, InfeasibleError)
    assert str(err.value) == f"no launchable configuration: {line}"


def test_pins_that_leave_devices_over_run_on_fewer_and_say_so():
    # TP 8 x PP 16 = 128 ranks: 192 devices hold one replica and 64 over (no DP fills them), so the plan runs
    # on 128 (16 whole nodes) and leaves 64 idle.
    plan = api.plan(["model=llama3_8b", "cluster.num_devices=192", "plan.tp=8", "plan.pp=16", *H100])
    assert (plan.world_size, plan.idle_devices, plan.parallel["dp"]) == (128, 64, 1)


@pytest.mark.parametrize("solver", ["dp", "enumerate"])
def test_a_search_space_that_breaks_one_rule_everywhere_names_it(solver):
    # mbs 3 times dp 2 or 1 divides no power of two; the first configuration searched is TP 1, PP 1, dp 2.
    with pytest.raises(NestError) as err:
        api.plan([*NARROW, f"solver.name={solver}"])
    assert str(err.value) == ("no launchable configuration: train.global_batch_size=64: must be a multiple of "
                              "micro_batch_size*dp = 3*2 (this rules out all 3 configurations in the search space)")


def test_the_most_common_rule_is_named_when_rules_differ():
    # Up to 4 virtual stages adds, for PP 2 (4 layers), VPP 2 (4 % (2*2) = 0), VPP 3 (6 chunks: the planner's family
    # holds 0|1|1|1|1|0, the embedding and the loss alone on the end chunks), both on to the batch rule (mbs 3 x dp 1),
    # and VPP 4 (8 chunks: no split of 4 layers in the family, parallel.layout.searched_splits): 5 of 6
    # configurations break the batch rule.
    with pytest.raises(NestError) as err:
        api.plan([*NARROW, "solver.max_virtual_stages=4"])
    assert str(err.value) == ("no launchable configuration: train.global_batch_size=64: must be a multiple of "
                              "micro_batch_size*dp = 3*2 (this rules out 5 of the 6 configurations in the search "
                              "space, other rules the rest)")


def test_launch_dry_run_with_pinned_sizes_beyond_the_devices_names_the_rule():
    # --pin keeps the argv's TP 8 and PP 16: 128 ranks on 8 nodes x 8 = 64 GPUs.
    proc = run_cli("launch", "model=llama3_8b", *H100, "--nnodes", "8", "--nproc-per-node", "8", "--master-addr", "n1",
                   "--node-rank", "0", "--dry-run", "--pin", "tp,pp", "--", "pretrain_gpt.py",
                   "--tensor-model-parallel-size", "8", "--pipeline-model-parallel-size", "16")
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert proc.stderr == ("nest-megatron launch: error: no plan keeps what the launch line fixes (pinned tp,pp): "
                           "no launchable configuration: tp*cp*pp*dp = 8*1*16*1 = 128 "
                           "devices, but the cluster has 64 (plan.tp=8, plan.pp=16 pinned)\n")


def test_configurations_searched_of_which_none_fit_keep_the_memory_message():
    # Llama 3 70B's bf16 weights alone are 140 GB, more than 8 x 80 GB leave with optimizer states and activations.
    with pytest.raises(InfeasibleError) as err:
        api.plan(["model=llama3_70b", *H100, "cluster.num_devices=8"])
    message = str(err.value)
    # Answered from the memory floor, before any configuration is timed (solver/bounds.py).
    assert message.startswith("no configuration of llama3_70b fits on 8 x h100_sxm (79.6 GiB): at least ")
