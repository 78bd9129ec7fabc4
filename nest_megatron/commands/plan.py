"""`nest-megatron plan|evaluate [overrides]`: search (or score) a configuration, print it, write out= (and report=)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from rich.progress import Progress, TaskID

from nest_megatron import api
from nest_megatron.commands.common import check_writable, fail, progress_bar, stdout_console, write_atomically
from nest_megatron.config.load import load
from nest_megatron.errors import NestError
from nest_megatron.report.table import render

HELP = {
    "plan": "search the fastest configuration that fits and print it",
    "evaluate": "score the configuration given by plan.* overrides",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("overrides", nargs="*", help="Hydra overrides: model=llama3_70b cluster.num_devices=1024 ...")
    parser.add_argument("--json", action="store_true", help="print the Plan JSON instead of tables")
    parser.add_argument("--quiet", action="store_true", help="print nothing; write out= / report= only")


class SearchProgress:
    """The search's progress: the bar on a terminal, else a line on stderr every few seconds (logs and
    CI show that a long search is alive). NEST_MEGATRON_PROGRESS_S sets the interval."""

    def __init__(self, bar: Progress, task: TaskID):
        self.bar, self.task = bar, task
        every = os.environ.get("NEST_MEGATRON_PROGRESS_S", "5")
        try:
            self.every_s = float(every)
        except ValueError:
            raise NestError(f"NEST_MEGATRON_PROGRESS_S={every}: give the seconds between progress lines") from None
        self.start = self.last = time.monotonic()

    def __call__(self, visited: int, total: int, best: float) -> None:
        found = f", best {best:.4g} s/step" if best < float("inf") else ""
        if not self.bar.disable:
            self.bar.update(self.task, completed=visited, total=total, description=f"searching{found}")
            return
        now = time.monotonic()
        if now - self.last >= self.every_s:
            self.last = now
            print(f"searching: {visited:,} of {total:,} configurations{found}, {now - self.start:.0f} s",
                  file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    console = stdout_console()
    try:
        loaded = load(args.overrides)
        out, report = loaded.config.out, loaded.config.report
        if out:  # before the search, so that a path that cannot be written fails at once
            check_writable(Path(out), "out")
        if report:
            check_writable(Path(report), "report", folder=True)
        with progress_bar(quiet=args.quiet) as progress:
            task = progress.add_task("searching" if args.command == "plan" else "pricing", total=None)
            if args.command == "plan":
                plan = api.plan_loaded(loaded, progress=None if args.quiet else SearchProgress(progress, task))
            else:
                plan = api.evaluate_loaded(loaded)
            progress.update(task, total=1, completed=1)
            if report:  # before out=, so that a report that cannot be written leaves no plan file either
                from nest_megatron.commands.explain import explain  # matplotlib: 0.75 s a plan without report= saves

                report = explain(loaded, plan, Path(report), baselines=True, progress=progress)
            if out:
                write_atomically(Path(out), plan.to_json())
    except (NestError, OSError) as e:
        return fail(args.command, e)
    if args.json:
        print(json.dumps(plan.to_dict(), indent=2))
    elif not args.quiet:
        render(plan, console)
        if out:
            console.print(f"plan written to {out}")
        if report:
            console.print(f"report written to {report}", highlight=False, soft_wrap=True)
    return 0
