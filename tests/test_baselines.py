"""The baselines (nest_megatron/solver/baselines.py) and the benchmark's cell runner, on tiny problems:
every baseline is valid, priced only by `estimate`, deterministic, and never beats the exhaustive
planner over the same space."""

from __future__ import annotations

import functools
from dataclasses import replace
from pathlib import Path

import pytest
from script_module import load_module

from nest_megatron.config.load import load
from nest_megatron.config.schema import PlanChoice
from nest_megatron.cost.evaluate import estimate
from nest_megatron.parallel.rules import violation
from nest_megatron.solver import baselines as bl
from nest_megatron.solver import paper_grid
from nest_megatron.solver.registry import SOLVERS
from nest_megatron.solver.space import candidates

ROOT = Path(__file__).resolve().parents[1]
TINY = ["cluster=dgx_h100_superpod", "cluster.num_devices=16", "train.global_batch_size=64"]
GPT = ("model=tiny_gpt", *TINY)
MOE = ("model=tiny_moe", *TINY)
# A third tiny cell: the same GPT on 16 A100s of a DGX A100 SuperPOD (other bandwidths and memory).
GPT_A100 = ("model=tiny_gpt", "cluster=dgx_a100_superpod", "cluster.num_devices=16", "train.global_batch_size=64")
MBS = 1  # every search here at micro-batch 1: a quarter of the space, the same for all


@functools.lru_cache(maxsize=None)
def problem(*overrides: str):
    return load(list(overrides)).problem


@functools.lru_cache(maxsize=None)
def planned(*overrides: str):
    """SOLVERS["enumerate"]: exhaustive over the space the local searches walk."""
    loaded = load(list(overrides))
    return SOLVERS["enumerate"](loaded.problem, loaded.config.solver, loaded.config.plan, micro_batch_size=MBS)


def valid(p, cfg) -> bool:
    return violation(cfg, model=p.model, num_devices=p.num_devices, global_batch_size=p.global_batch_size) is None


# --- manual ------------------------------------------------------------------------------------------------

def test_manual_large_model_takes_the_whole_node_for_tp():
    # Llama 3 70B (70.6e9 parameters > 20e9) on 64 H100s: TP = 8 = GPUs per node, sequence
    # parallel, distributed optimizer, selective recompute, micro-batch 1, the smallest PP that fits.
    p = problem("model=llama3_70b", "cluster=h100_spine_leaf", "cluster.num_devices=64", "train.global_batch_size=4096")
    assert bl.total_params(p) > bl.LARGE_MODEL_PARAMS
    est = bl.manual(p)
    c = est.config
    assert valid(p, c) and est.fits
    assert c.tp == p.topology.devices_per_node == 8
    assert (c.sp, c.zero, c.mbs, c.recompute, c.order, c.cp) == (True, 1, 1, "selective", "tp-cp-ep-dp-pp", 1)
    assert c.world == 64
    # Every recipe configuration tried before it (smaller PP) does not fit.
    tried = bl.manual_candidates(p)
    assert all(not estimate(p, cfg).fits for cfg in tried[: tried.index(c)])
    assert all(cfg.tp == 8 for cfg in tried)


def test_manual_tiny_model_uses_the_smallest_tp():
    # tiny_gpt: 4 layers x (12 h^2 + 13 h = 789,760) + embeddings (1024 + 128) x 256 = 294,912
    # + final norm 512 = 3,454,464 parameters. With the distributed optimizer over dp = 16 a
    # parameter costs 2 (bf16) + 4 (fp32 grad) + 12/16 (Adam) = 6.75 B: 23 MB, plus a few MB of
    # activations (128 tokens x 256 hidden), far below 80 - 3 GiB. So TP 1, PP 1 fits: the recipe
    # takes tp=1, pp=1, dp=16 with selective recompute.
    p = problem(*GPT)
    assert bl.total_params(p) == 3_454_464
    est = bl.manual(p)
    c = est.config
    assert valid(p, c) and est.fits
    assert (c.tp, c.pp, c.dp, c.sp, c.zero, c.mbs, c.recompute) == (1, 1, 16, False, 1, 1, "selective")


def test_manual_tiny_model_in_tight_memory_grows_tp_then_pp():
    # 12 MiB of device memory, none reserved. TP 1 cannot fit at any PP: the best is PP 4, whose
    # first stage holds 1 layer + the embeddings = 1,084,672 parameters: 2 B weights 2.07 MiB +
    # 4 B grads 4.14 MiB + 12 B / dp 4 Adam 3.10 MiB + 4 micro-batches in flight of one layer's
    # activations 4.25 MiB = 13.6 MiB > 12. TP 2, PP 1 keeps all 4 layers: 15.0 MiB > 12. TP 2,
    # PP 2 halves both: stage 0 = 1.82 + 3.64 + 2.73 (dp 4) + 2.12 MiB = 10.3 MiB <= 12: the recipe
    # picks tp=2 (sequence parallel), pp=2, dp=4, still with selective recompute. (Full recompute
    # would fit TP 1 at PP 4, 10.9 MiB, but the recipe turns it on only when nothing fits without.)
    p = problem(*GPT, "cluster.device_memory_gib=0.01171875", "accelerator.reserved_memory_gib=0")
    est = bl.manual(p)
    c = est.config
    assert valid(p, c) and est.fits
    assert (c.tp, c.pp, c.dp, c.sp, c.recompute) == (2, 2, 4, True, "selective")
    assert est.peak_memory / 2**20 == pytest.approx(10.3, abs=0.1)
    for pp in (1, 2, 4):  # TP 1 does not fit at any PP with selective recompute
        assert not estimate(p, replace(c, tp=1, sp=False, pp=pp, dp=16 // pp)).fits
    assert not estimate(p, replace(c, pp=1, dp=8)).fits
    assert estimate(p, replace(c, tp=1, sp=False, pp=4, dp=4, recompute="full")).fits


def test_manual_moe_takes_the_largest_expert_parallel_that_fits_the_grid():
    # tiny_moe: 4 experts; tp 1, dp 16: every divisor of 4 divides 16, so EP = 4.
    p = problem(*MOE)
    est = bl.manual(p)
    assert valid(p, est.config) and est.fits
    assert (est.config.tp, est.config.ep) == (1, 4)


# --- flat network ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("cluster", ["dgx_h100_superpod", "h100_spine_leaf"])
def test_flat_topology_prices_every_level_as_level_0(cluster):
    real = problem("model=tiny_gpt", f"cluster={cluster}", "cluster.num_devices=64").topology
    flat = bl.flat_topology(real)
    assert len(flat.levels) == len(real.levels) >= 2
    base = real.levels[0]
    for f, r in zip(flat.levels, real.levels):
        assert (f.bandwidth, f.latency, f.oversubscription) == (base.bandwidth, base.latency, base.oversubscription)
        assert (f.fan_out, f.name) == (r.fan_out, r.name)
    assert flat.num_devices == real.num_devices and flat.devices_per_node == real.devices_per_node
    assert real.levels[1].bandwidth < base.bandwidth  # the real network is slower above the node


def test_flat_network_choice_is_rescored_on_the_real_network():
    p = problem(*GPT)
    out = bl.flat_network_search(p, SOLVERS["enumerate"], micro_batch_size=MBS)
    cfg = out.best.config
    assert out.best.config == out.flat.config
    assert out.best.step_time == estimate(p, cfg, layers_per_stage=out.best.layers_per_stage).step_time
    flat_problem = replace(p, topology=bl.flat_topology(p.topology))
    assert out.flat.step_time == estimate(flat_problem, cfg).step_time
    assert out.best.step_time > out.flat.step_time  # 16 GPUs on two nodes: DP crosses the 50 GB/s NICs
    assert bl.flat_network(p, SOLVERS["enumerate"], micro_batch_size=MBS).step_time == out.best.step_time


# --- annealing and MCMC ------------------------------------------------------------------------------------

@pytest.mark.parametrize("cell", [GPT, MOE], ids=["tiny_gpt", "tiny_moe"])
@pytest.mark.parametrize("name", ["annealing", "mcmc"])
def test_local_search_is_deterministic_bounded_and_never_beats_the_planner(name, cell):
    p = problem(*cell)
    search = bl.BASELINES[name]
    space = list(candidates(p, load(list(cell)).config.solver, PlanChoice(), micro_batch_size=MBS))
    budget = 60
    assert len(space) > budget
    first = search(p, budget=budget, seed=7, micro_batch_size=MBS)
    again = search(p, budget=budget, seed=7, micro_batch_size=MBS)
    assert first.best is not None and first.best.fits
    assert (first.best.config, first.best.step_time, first.evaluations) == (again.best.config, again.best.step_time, again.evaluations)
    assert first.evaluations == budget  # the space is larger than the budget: all of it is spent
    assert first.best.config in space and valid(p, first.best.config)
    assert first.best.step_time == estimate(p, first.best.config).step_time
    best = planned(*cell).best
    assert first.best.step_time >= best.step_time * (1 - 1e-12)
    # A budget above the space: never more evaluations than configurations.
    small = search(p, budget=5, seed=1, micro_batch_size=MBS)
    assert small.evaluations <= 5


def test_local_search_depends_on_the_seed():
    p = problem(*MOE)
    walks = {bl.annealing(p, budget=20, seed=s, micro_batch_size=MBS).best.config for s in range(4)}
    assert len(walks) > 1


# --- the planner against every baseline --------------------------------------------------------------------

@pytest.mark.parametrize("cell", [GPT, MOE, GPT_A100], ids=["tiny_gpt_h100", "tiny_moe_h100", "tiny_gpt_a100"])
def test_planner_is_at_least_as_fast_as_every_baseline(cell):
    p = problem(*cell)
    best = planned(*cell).best
    found = {
        "manual": bl.manual(p),
        "flat_network": bl.flat_network(p, SOLVERS["enumerate"], micro_batch_size=MBS),
        "annealing": bl.annealing(p, budget=80, seed=0, micro_batch_size=MBS).best,
        "mcmc": bl.mcmc(p, budget=80, seed=0, micro_batch_size=MBS).best,
    }
    assert set(found) == set(bl.BASELINES)
    for name, est in found.items():
        assert est is not None and est.fits, name
        assert best.step_time <= est.step_time * (1 + 1e-12), name


# --- the paper's entries -----------------------------------------------------------------------------------

def test_paper_entries_of_llama3_70b_on_1024_h100_are_skipped_with_reasons():
    p = problem("model=llama3_70b", "cluster=h100_spine_leaf", "cluster.num_devices=1024", "train.global_batch_size=4096")
    found = bl.paper(p, cluster_name="h100_spine_leaf", model_name="llama3_70b", num_devices=1024)
    assert {name: (est, why) for name, est, why in found} == {
        "Manual": (None, "global batch 4096 is not a multiple of dp=12 x micro-batch 1"),
        "MCMC": (None, "global batch 4096 is not a multiple of dp=25 x micro-batch 1"),
        "Phaze": (None, "p=28 does not divide 80 layers"),
    }


def test_paper_entries_are_scored_with_the_distributed_optimizer():
    # llama2_7b on 64 TPU v4: Manual (p 8, d 8, t 1) and MCMC (p 32, d 2, t 1) launch; Phaze's
    # p = 6 does not divide 32 layers.
    p = problem("model=llama2_7b", "cluster=tpuv4_fat_tree", "cluster.num_devices=64", "train.global_batch_size=4096")
    found = {name: (est, why) for name, est, why in bl.paper(p, cluster_name="tpuv4_fat_tree", model_name="llama2_7b",
                                                             num_devices=64)}
    assert found["Phaze"] == (None, "p=6 does not divide 32 layers")
    manual = found["Manual"][0]
    c = manual.config
    assert (c.pp, c.dp, c.tp, c.zero, c.mbs) == (8, 8, 1, 1, 1) and manual.fits and found["Manual"][1] is None
    assert manual.step_time == estimate(p, c).step_time
    assert found["MCMC"][0].config.pp == 32
    assert bl.paper(problem(*GPT), cluster_name="dgx_h100_superpod", model_name="tiny_gpt", num_devices=16) == []


def test_paper_mixtral_entries_run_with_the_papers_expert_parallel_on_every_device():
    # benchmarks/nest_paper_grid.yaml: mixtral_8x7b has expert_parallel 4; h100_spineLeaf 128 gives
    # MCMC (p 32, d 1), Manual (p 16, d 2), Phaze (p 8, d 4), all t 1. Each replica spans EP 4
    # devices, so Megatron's dp = 4d: 4, 8, 16, and tp*pp*dp = 32*4 = 16*8 = 8*16 = 128: none idle
    # (with dp = d they ran on 32, 32, 32 ranks and left 96 idle).
    found = paper_grid.baselines(cluster="h100_spine_leaf", num_devices=128, model="mixtral_8x7b", num_layers=32,
                                 global_batch_size=4096)
    assert {b.name: b.overrides for b in found} == {
        "MCMC": ["plan.pp=32", "plan.dp=4", "plan.tp=1", "plan.ep=4", "plan.mbs=1"],
        "Manual": ["plan.pp=16", "plan.dp=8", "plan.tp=1", "plan.ep=4", "plan.mbs=1"],
        "Phaze": ["plan.pp=8", "plan.dp=16", "plan.tp=1", "plan.ep=4", "plan.mbs=1"],
    }
    p = problem("model=mixtral_8x7b", "cluster=h100_spine_leaf", "cluster.num_devices=128",
                "train.global_batch_size=4096")
    for name, est, why in bl.paper(p, cluster_name="h100_spine_leaf", model_name="mixtral_8x7b", num_devices=128):
        c = est.config
        # ZeRO 1 (the distributed optimizer): Megatron-FSDP (ZeRO 2/3) does not run with pp > 1.
        assert (c.ep, c.zero, est.idle_devices, why) == (4, 1, 0, None), name
    # 1,024 H100: Manual (p 16, d 16) -> dp 64, 16*64 = 1,024; Phaze (p 8, d 32) -> dp 128, 8*128 = 1,024;
    # MCMC's p = 33 does not divide 32 layers.
    found = paper_grid.baselines(cluster="h100_spine_leaf", num_devices=1024, model="mixtral_8x7b", num_layers=32,
                                 global_batch_size=4096)
    assert {b.name: b.overrides or b.skipped for b in found} == {
        "MCMC": "p=33 does not divide 32 layers",
        "Manual": ["plan.pp=16", "plan.dp=64", "plan.tp=1", "plan.ep=4", "plan.mbs=1"],
        "Phaze": ["plan.pp=8", "plan.dp=128", "plan.tp=1", "plan.ep=4", "plan.mbs=1"],
    }
    # 64 TPU v4: Manual (p 32, d 1) needs 32*1*1*4 = 128 devices (the artifact reports Manual infeasible
    # there); MCMC and Phaze (p 16, d 1) take 16*4 = 64.
    found = {b.name: b.overrides or b.skipped
             for b in paper_grid.baselines(cluster="tpuv4_fat_tree", num_devices=64, model="mixtral_8x7b",
                                           num_layers=32, global_batch_size=4096)}
    assert found["Manual"] == "p*d*t*ep = 32*1*1*4 = 128 devices, but the cluster has 64"
    assert found["MCMC"] == found["Phaze"] == ["plan.pp=16", "plan.dp=4", "plan.tp=1", "plan.ep=4", "plan.mbs=1"]


# --- the benchmark script ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def bench():
    return load_module(ROOT / "scripts" / "bench_paper_grid.py")


def test_bench_cell_runner_on_a_tiny_cell(bench, tmp_path):
    record = bench.run_cell("tiny_gpt", "dgx_h100_superpod", 16, solver="enumerate", mbs=1, global_batch_size=64,
                            budget=30, plans_dir=tmp_path / "plans")
    planner = record["planner"]
    assert planner["tokens_per_s"] > 0 and planner["configs_evaluated"] > 0 and planner["time_s"] > 0
    names = [b["name"] for b in record["baselines"]]
    assert names == ["manual", "flat_network", "annealing", "mcmc"]  # no paper entries for tiny_gpt
    assert record["paper_note"]
    for b in record["baselines"]:
        assert b["skipped"] is None and b["ratio"] >= 1 - 1e-9, b
        assert b["tokens_per_s"] == pytest.approx(planner["tokens_per_s"] / b["ratio"])
    assert {b["name"]: b["configs_evaluated"] for b in record["baselines"]}["annealing"] == 30
    plans = sorted(f.name for f in (tmp_path / "plans").iterdir())
    assert len(plans) == 5 and any(name.endswith("_manual.json") for name in plans)
    meta = {"date": "today", "machine": bench.machine(), "solver": "enumerate", "global_batch_size": 64, "mbs": [1],
            "budget": 30, "seed": 0, "wall_s": 1.0, "planner_search_s": planner["time_s"]}
    md = bench.markdown([record], meta)
    assert "| tiny_gpt | dgx_h100_superpod | 16 | 1 |" in md and "no baseline entries" in md


def test_bench_config_text_names_idle_devices(bench):
    # tiny_gpt on 16 devices with tp 2, pp 2, dp 2: 2*2*2 = 8 ranks, 16 - 8 = 8 idle.
    p = problem(*GPT)
    est = estimate(p, replace(bl.manual(p).config, tp=2, pp=2, dp=2, sp=True))
    assert bench.config_text(est).endswith(" idle 8")
    assert "idle" not in bench.config_text(bl.manual(p))


def test_bench_baseline_plan_names_the_baseline(bench):
    p = problem(*GPT)
    est = bl.manual(p)
    plan = bench.baseline_plan(p, est, name="manual", model_name="tiny_gpt", cluster_name="dgx_h100_superpod",
                               time_s=0.5, configs_evaluated=3)
    assert plan.search == {"solver": "manual", "time_s": 0.5, "configs_evaluated": 3}
    assert plan.parallel["tp"] == est.config.tp and plan.predicted["step_time_s"] == est.step_time


def test_bench_scale_search_reports_time_and_memory(bench):
    row = bench.scale_search("tiny_gpt", "dgx_h100_superpod", 16, "enumerate", 64, 1)
    assert row["wall_s"] > 0 and row["peak_rss_mib"] > 0 and row["configs_evaluated"] > 0
