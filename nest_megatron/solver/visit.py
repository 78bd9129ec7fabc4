"""Visit configurations by increasing lower bound, in this process or in worker processes.

A configuration is solved unless its bound exceeds the cutoff (the step time of the last kept plan),
and the cutoff only falls. Workers share it through one shared double that the parent lowers as
outcomes arrive, so a worker skips what the kept plans already rule out; as the parent ranks kept
plans by (step time, position) and pruning drops only what cannot enter them, the result is the
one-process result whatever order the outcomes arrive in. Workers are forked: they inherit the
problem and the caches built so far, and nothing is pickled but outcomes (each loads the compiled
Numba functions from Numba's on-disk cache, or compiles them once on a fresh machine). Each
takes whole groups of configurations (those sharing placement caches): with chunks dealt from one
queue, every worker built the same caches and two workers were slower than one at 65,536 GPUs.
"""

from __future__ import annotations

import math
import multiprocessing
import os
import signal
from collections.abc import Callable, Hashable
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any

from nest_megatron.errors import NestError

Progress = Callable[[int, int, float], None]  # (configurations visited, in the space, best step time so far)


MAX_JOBS = 1024  # search worker processes: one a core of the largest hosts; each holds a copy of the search's caches
JOBS_ENV = "NEST_MEGATRON_JOBS"


def default_jobs() -> int:
    """The worker processes of a search whose solver.jobs is unset: NEST_MEGATRON_JOBS when set (a machine whose
    cores other work keeps busy, as a parallel test run: forked workers there only add CPU), else one per core
    this process may run on (solver/README.md has the measurements on 2 cores): the cores of its affinity, fewer
    under a cgroup CPU quota (a container limited to 2 CPUs on a big host)."""
    setting = os.environ.get(JOBS_ENV)
    if setting is not None:
        if not (setting.isdigit() and 1 <= int(setting) <= MAX_JOBS):
            raise NestError(f"{JOBS_ENV}={setting}: allowed 1..{MAX_JOBS} (the search's worker processes; unset: one "
                            "per core)")
        return int(setting)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    try:  # cgroup v2: "QUOTA PERIOD" in microseconds, or "max PERIOD" for no quota
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()
        if quota != "max":
            cores = min(cores, max(1, math.ceil(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    return cores


def visit(bounds: list[float], solve: Callable[[int, float], Any], accept: Callable[[int, Any], float], *,
          jobs: int, progress: Progress | None, best: Callable[[], float],
          group: Callable[[int], Hashable] = lambda position: position) -> dict[int, Any]:
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

    # Workers inherit the problem by forking; a daemonic process (a multiprocessing pool's worker planning
    # for its caller) may start none.
    if jobs <= 1 or "fork" not in multiprocessing.get_all_start_methods() or multiprocessing.current_process().daemon:
        cutoff = math.inf
        for position, bound in enumerate(bounds):
            if bound > cutoff:
                break
            cutoff = heard(position, solve(position, cutoff))
        return outcomes
    fork = multiprocessing.get_context("fork")
    shared = fork.RawValue("d", math.inf)
    # Each worker takes the positions of its own groups (`group(position)`, e.g. the placement caches a
    # configuration shares with others), in visiting order, so that no two workers build the same caches.
    worker_of: dict[Hashable, int] = {}  # the groups dealt round the workers in the order they are first met
    mine: list[list[int]] = [[] for _ in range(jobs)]
    for position in range(len(bounds)):
        mine[worker_of.setdefault(group(position), len(worker_of) % jobs)].append(position)
    mine = [positions for positions in mine if positions]  # fewer groups than workers: no idle worker
    workers, running = [], {}  # running: the receiving end of each worker's pipe -> the worker, until it is done
    try:
        for positions in mine:
            receive, send = fork.Pipe(duplex=False)
            worker = fork.Process(target=_work, args=(positions, bounds, solve, shared, send), daemon=True)
            worker.start()
            # Only the worker holds the sending end now (later workers fork after this close): its death reads
            # as EOF here, never as a wait forever.
            send.close()
            workers.append(worker)
            running[receive] = worker
        while running:
            for receive in wait(list(running)):
                try:
                    item = receive.recv()
                except EOFError:
                    worker = running[receive]
                    worker.join()
                    raise NestError(f"a search worker ended without its results (exit code {worker.exitcode}: out of "
                                    "memory?); solver.jobs=1 searches in this process") from None
                if item is None:
                    del running[receive]
                elif isinstance(item, BaseException):
                    raise item
                else:
                    shared.value = heard(*item)
    finally:
        for worker in workers:
            worker.terminate()
            worker.join()
    return outcomes


def _work(positions: list[int], bounds: list[float], solve: Callable[[int, float], Any], shared, send) -> None:
    """A worker: its positions in visiting order until one's bound exceeds the shared cutoff, each
    outcome sent back as it is found; None when done."""
    # The parent's handlers (the launcher's SIGTERM report, Python's KeyboardInterrupt) are not the worker's:
    # a signal to the process group ends it quietly and the parent, which gets the same signal, speaks.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    try:
        for position in positions:
            cutoff = shared.value
            if bounds[position] > cutoff:  # bounds ascend: the rest are ruled out too
                break
            send.send((position, solve(position, cutoff)))
    except BaseException as err:  # noqa: BLE001 - the parent raises it
        send.send(err)
    send.send(None)
