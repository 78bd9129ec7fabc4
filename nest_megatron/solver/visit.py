"""Visit configurations by increasing lower bound, in this process or in worker processes.

A configuration is solved unless its bound exceeds the cutoff (the step time of the last kept plan),
and the cutoff only falls. Workers share it through one shared double that the parent lowers as
outcomes arrive, so a worker skips what the kept plans already rule out; as the parent ranks kept
plans by (step time, position) and pruning drops only what cannot enter them, the result is the
one-process result whatever order the outcomes arrive in. Workers are forked: they inherit the
problem, the compiled Numba functions and the caches, and nothing is pickled but positions and
outcomes.
"""

from __future__ import annotations

import math
import multiprocessing
import os
import queue
from collections.abc import Callable
from typing import Any

Progress = Callable[[int, int, float], None]  # (configurations visited, in the space, best step time so far)

CHUNK = 4  # positions per task: a few keep the cutoff fresh, one costs a round trip per configuration

_solve: Callable[[int, float], Any] | None = None  # the worker's job, inherited through fork
_cutoff = None  # the worker's view of the shared cutoff


def default_jobs() -> int:
    """One worker per core this process may run on, but one process on two cores or fewer: there the
    workers did not pay (GPT-3 175B on 1,024 GPUs 1.9-2.7 s with two workers against 2.2-2.5 s alone;
    Llama 3 70B on 65,536 GPUs 10.6-12.2 s against 6.0-9.1 s, as every worker builds its own placement
    caches; solver/README.md)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return cores if cores > 2 else 1


def visit(bounds: list[float], solve: Callable[[int, float], Any], accept: Callable[[int, Any], float], *,
          jobs: int, progress: Progress | None, best: Callable[[], float]) -> dict[int, Any]:
    """Outcomes by position of every position solved: `solve(position, cutoff)` for each position
    whose bound (ascending) does not exceed the cutoff; `accept(position, outcome)` returns the new
    cutoff. With jobs > 1, solved in that many forked worker processes."""
    outcomes: dict[int, Any] = {}

    def heard(position: int, outcome: Any) -> float:
        outcomes[position] = outcome
        cutoff = accept(position, outcome)
        if progress is not None:
            progress(len(outcomes), len(bounds), best())
        return cutoff

    if jobs <= 1 or "fork" not in multiprocessing.get_all_start_methods():  # workers inherit the problem by forking
        cutoff = math.inf
        for position, bound in enumerate(bounds):
            if bound > cutoff:
                break
            cutoff = heard(position, solve(position, cutoff))
        return outcomes
    fork = multiprocessing.get_context("fork")
    shared = fork.RawValue("d", math.inf)
    arrived: queue.SimpleQueue = queue.SimpleQueue()
    starts = iter(range(0, len(bounds), CHUNK))
    with fork.Pool(jobs, initializer=_start, initargs=(solve, shared)) as pool:

        def submit() -> bool:
            """Send the next chunk unless its first bound is already ruled out (then so is the rest)."""
            first = next(starts, None)
            if first is None or bounds[first] > shared.value:
                return False
            chunk = [(p, bounds[p]) for p in range(first, min(first + CHUNK, len(bounds)))]
            pool.apply_async(_run, (chunk,), callback=arrived.put, error_callback=arrived.put)
            return True

        # A few chunks a worker, not the whole space: chunks are sent while their bounds can still enter.
        in_flight = sum(submit() for _ in range(2 * jobs))
        while in_flight:
            solved = arrived.get()
            if isinstance(solved, BaseException):
                raise solved
            in_flight -= 1
            for position, outcome in solved:
                shared.value = heard(position, outcome)
            in_flight += submit()
    return outcomes


def _start(solve: Callable[[int, float], Any], shared) -> None:
    global _solve, _cutoff
    _solve, _cutoff = solve, shared


def _run(chunk: list[tuple[int, float]]) -> list[tuple[int, Any]]:
    solved = []
    for position, bound in chunk:
        cutoff = _cutoff.value
        if bound > cutoff:  # bounds ascend: the rest of the chunk is ruled out too
            break
        solved.append((position, _solve(position, cutoff)))
    return solved
