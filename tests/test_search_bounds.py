"""Every search is bounded: device counts are factored, a model that cannot fit is answered before the
search, worker processes find the one-process result, and a long search says it is alive."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from nest_megatron import api
from nest_megatron.config.load import load
from nest_megatron.errors import InfeasibleError, NestError
from nest_megatron.hardware.accelerator import GIB
from nest_megatron.model.spec import ModelSpec
from nest_megatron.solver import dp
from nest_megatron.solver.space import divisors
from nest_megatron.solver.visit import JOBS_ENV, default_jobs, visit


def test_divisors_come_from_the_factorisation():
    for n in [*range(1, 400), 65536, 1_000_003 * 6]:
        assert divisors(n) == [d for d in range(1, n + 1) if n % d == 0]
    # 10^12 = 2^12 5^12: 13 * 13 divisors, found without scanning to 10^12.
    big = divisors(10**12)
    assert len(big) == 169 and big[:4] == [1, 2, 4, 5] and big[-1] == 10**12
    assert all(10**12 % d == 0 for d in big)


def test_a_model_too_big_for_every_configuration_is_answered_before_the_search():
    # Llama 3 70B stretched to 800 layers (~690 B parameters) on 64 H100s: Adam's 18 bytes a parameter
    # (bf16 weight, fp32 gradient, fp32 master weight and two moments) spread over all 64 devices
    # already exceed 80 GB, whatever the sharding.
    overrides = ["model=llama3_70b", "model.num_layers=800", "cluster=dgx_h100_superpod", "cluster.num_devices=64"]
    loaded = load(overrides)
    model: ModelSpec = loaded.problem.model
    params = (800 * sum(model.layer_params(tp=1)) + model.embedding_params(1)
              + model.output_params(tp=1, pp=64))
    states = 18 * params / 64 / GIB
    result = dp.solve(loaded.problem, loaded.config.solver, loaded.config.plan, micro_batch_size=None)
    assert result.best is None and result.configs_evaluated == 0
    with pytest.raises(InfeasibleError) as raised:
        api.plan(overrides)
    message = str(raised.value)
    at_least = float(re.search(r"at least ([\d.]+) GiB per device", message).group(1))
    # The states, plus the workspace and at least one micro-batch of activations (a few GiB at most).
    assert states - 0.1 <= at_least <= states + 6
    assert "79.6 GiB" in message  # the H100's 80 GB, as the line compares it


def test_a_model_that_fits_is_not_refused_by_the_bound():
    # Llama 3 70B needs 70e9 * 18 B / 64 = 19.7 GB of model states a device on 64 GPUs: the floor lets it through.
    plan = api.plan(["model=llama3_70b", "cluster=dgx_h100_superpod", "cluster.num_devices=64",
                     "train.global_batch_size=64", "solver.top_k=1"])
    assert plan.predicted["peak_memory_gib"] <= plan.predicted["capacity_gib"]


def _rows(result) -> list[tuple]:
    estimates = [result.best, *result.runners_up]
    return [(e.config, e.layers_per_stage, e.step_time, None if e.rank_to_device is None else e.rank_to_device.tolist(),
             e.fits) for e in estimates]


@pytest.mark.parametrize("cell", [
    ["model=tiny_moe", "cluster=dgx_h100_superpod", "cluster.num_devices=16", "train.global_batch_size=64"],
    # Many placements at equal step times: the ties must go to the same configuration and placement.
    ["model=tiny_gpt", "cluster=dgx_h100_superpod", "cluster.num_devices=128", "train.global_batch_size=128",
     "solver.top_k=3"],
    ["model=tiny_gpt", "model.num_layers=10", "cluster=dgx_h100_superpod", "cluster.num_devices=32",
     "train.global_batch_size=256", "plan.pp=4"],
])
def test_worker_processes_find_the_one_process_result(cell):
    loaded = load(cell)
    problem, solver, pins = loaded.problem, loaded.config.solver, loaded.config.plan
    solver.jobs = 1
    alone = dp.solve(problem, solver, pins, micro_batch_size=None)
    solver.jobs = 2
    workers = dp.solve(problem, solver, pins, micro_batch_size=None)
    assert alone.best is not None
    assert _rows(workers) == _rows(alone)


def _visit_two_workers(solve):
    """Four positions of bound 0 over two workers (each its own group), nothing pruned."""
    return visit([0.0] * 4, solve, lambda position, outcome: float("inf"), jobs=2, progress=None,
                 best=lambda: float("inf"), group=lambda position: position % 2)


def test_worker_outcomes_reach_the_parent():
    assert _visit_two_workers(lambda position, cutoff: position * 10) == {0: 0, 1: 10, 2: 20, 3: 30}


def test_an_error_in_a_worker_is_raised_in_the_parent():
    def solve(position, cutoff):
        if position == 3:
            raise ValueError("position 3")
        return position

    with pytest.raises(ValueError, match="position 3"):
        _visit_two_workers(solve)


def test_a_worker_that_dies_is_an_error_not_a_wait_forever():
    def solve(position, cutoff):
        if position == 1:
            os._exit(7)  # as a worker killed by the OOM killer would end: no result, no word
        return position

    with pytest.raises(NestError, match=r"exit code 7"):
        _visit_two_workers(solve)


def _visit_in_a_pool_worker(_) -> dict:
    return _visit_two_workers(lambda position, cutoff: position * 10)


def test_a_pool_worker_searches_in_its_own_process():
    """A multiprocessing pool's worker is daemonic and may start no processes: it visits everything itself."""
    import multiprocessing

    with multiprocessing.get_context("fork").Pool(1) as pool:
        assert pool.map(_visit_in_a_pool_worker, [0]) == [{0: 0, 1: 10, 2: 20, 3: 30}]


def _plan_cli(*options: str, interval: str) -> subprocess.CompletedProcess:
    cell = ["model=tiny_moe", "cluster=dgx_h100_superpod", "cluster.num_devices=16", "train.global_batch_size=64",
            "solver.jobs=1"]
    env = {**os.environ, "NEST_MEGATRON_PROGRESS_S": interval}
    return subprocess.run([sys.executable, "-m", "nest_megatron.cli", "plan", *cell, *options], env=env,
                          capture_output=True, text=True, timeout=300)


def test_a_search_prints_progress_lines_on_a_piped_stderr():
    done = _plan_cli("--json", interval="0")  # a line for every configuration heard
    assert done.returncode == 0, done.stderr
    search = json.loads(done.stdout)["search"]
    lines = [line for line in done.stderr.splitlines() if line.startswith("searching: ")]
    assert lines, done.stderr
    counts = [re.match(r"searching: ([\d,]+) of ([\d,]+) configurations", line).groups() for line in lines]
    visited = [int(v.replace(",", "")) for v, _ in counts]
    assert {int(total.replace(",", "")) for _, total in counts} == {search["configs_in_space"]}
    assert visited == sorted(visited) and visited[-1] == search["configs_evaluated"]
    assert "s/step" in lines[-1]  # a plan was found by then: its step time is shown
    quiet = _plan_cli("--quiet", interval="0")
    assert quiet.returncode == 0 and "searching" not in quiet.stderr


def test_a_bad_progress_interval_is_one_line():
    done = _plan_cli("--json", interval="often")
    assert done.returncode == 2
    assert done.stderr == ("nest-megatron plan: error: NEST_MEGATRON_PROGRESS_S=often: give the seconds between "
                           "progress lines\n")


def test_the_environment_sets_the_default_worker_count(monkeypatch):
    """NEST_MEGATRON_JOBS (which conftest.py sets to 1 in pytest's parallel workers) is the worker count of a search
    whose solver.jobs is unset: with 1 the search forks nothing, with 2 it forks its two workers; unset, one per
    core."""
    forks, counting = [], [True]
    os.register_at_fork(before=lambda: counting[0] and forks.append(1))  # cannot be unregistered: switched off below
    cell = ["model=tiny_moe", "cluster=dgx_h100_superpod", "cluster.num_devices=16", "train.global_batch_size=64"]
    try:
        monkeypatch.setenv(JOBS_ENV, "1")
        assert default_jobs() == 1
        api.plan(cell)
        assert forks == []
        monkeypatch.setenv(JOBS_ENV, "2")
        api.plan(cell)
        assert len(forks) == 2
    finally:
        counting[0] = False
    monkeypatch.delenv(JOBS_ENV)
    assert 1 <= default_jobs() <= len(os.sched_getaffinity(0))


@pytest.mark.parametrize("setting", ["0", "two", "1025", "-1"])
def test_a_bad_worker_count_in_the_environment_is_one_line(setting):
    cell = ["model=tiny_gpt", "cluster=dgx_h100_superpod", "cluster.num_devices=8", "train.global_batch_size=64"]
    done = subprocess.run([sys.executable, "-m", "nest_megatron.cli", "plan", *cell], capture_output=True, text=True,
                          env={**os.environ, JOBS_ENV: setting}, timeout=300)
    assert (done.returncode, done.stderr) == (2, f"nest-megatron plan: error: NEST_MEGATRON_JOBS={setting}: allowed "
                                                 "1..1024 (the search's worker processes; unset: one per core)\n")
