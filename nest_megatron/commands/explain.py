"""`nest-megatron explain PLAN.json [out=DIR]`: an HTML report of a plan (schedule, memory, placement,
runners-up, baselines) with its PNGs, under DIR (default: PLAN_report/ beside the plan file)."""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import tempfile
from dataclasses import MISSING, fields, replace
from pathlib import Path

from rich.progress import Progress

from nest_megatron import api
from nest_megatron.calibration.band import overlaps
from nest_megatron.calibration.profile import ENV
from nest_megatron.calibration.runs import measured_in
from nest_megatron.commands.common import check_writable, fail, progress_bar, stdout_console
from nest_megatron.config.load import Loaded, load
from nest_megatron.errors import NestError
from nest_megatron.plan import Plan, key_overrides
from nest_megatron.report.explain import FIGURES, plan_mismatch, report_data, write_report
from nest_megatron.solver.baselines import flat_network, manual
from nest_megatron.solver.registry import SOLVERS

HELP = "write an HTML report of a plan: schedule, memory, placement, runners-up, baselines"
EPILOG = """examples:
  nest-megatron plan model=llama3_70b cluster.num_devices=1024 out=plan.json
  nest-megatron explain plan.json out=report/      # then open report/index.html
  nest-megatron plan model=tiny_gpt cluster.num_devices=16 report=report/   # both in one go"""
BASELINE_STEPS = 2


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("plan", help="a Plan JSON, as `nest-megatron plan ... out=PLAN.json` writes it")
    parser.add_argument("options", nargs="*", help="out=DIR: where index.html and the PNGs go (default: PLAN_report/); "
                        f"calibration=PATH (or {ENV}): re-price the plan and its runners-up with that calibration")
    parser.add_argument("--no-baselines", action="store_true",
                        help="leave out the Manual and flat-network baselines (the flat one repeats the search)")
    parser.add_argument("--quiet", action="store_true", help="print nothing but errors")


def read_plan(path: str) -> Plan:
    try:
        data = json.loads(Path(path).read_text())
    except OSError as err:
        raise NestError(f"{path}: cannot read it ({err.strerror}); give the file `plan ... out=PLAN.json` wrote")
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise NestError(f"{path}: not JSON ({err}); give the file `plan ... out=PLAN.json` wrote")
    if not isinstance(data, dict):
        raise NestError(f"{path}: not a plan (a JSON object with schema_version, parallel, ...)")
    known = {f.name for f in fields(Plan)}
    required = {f.name for f in fields(Plan) if f.default is MISSING and f.default_factory is MISSING}
    if required - set(data) or set(data) - known:
        wrong = [f"missing {k}" for k in sorted(required - set(data))] + [f"unknown {k}" for k in sorted(set(data) - known)]
        raise NestError(f"{path}: not a plan ({', '.join(wrong[:4])}{', ...' if len(wrong) > 4 else ''})")
    try:
        return Plan.from_dict(data)
    except ValueError as err:
        raise NestError(f"{path}: {err}") from None


def parse_options(plan_path: str, options: list[str]) -> tuple[Path, str | None]:
    """(the report's folder, the calibration= profile to re-price the plan with or None)."""
    given = {}
    for option in options:
        key, sep, value = option.partition("=")
        if key not in ("out", "calibration") or not sep or not value:
            raise NestError(f"'{option}': explain takes out=DIR and calibration=PATH")
        given[key] = value
    out = Path(given["out"]) if "out" in given else Path(plan_path).with_name(Path(plan_path).stem + "_report")
    return out, given.get("calibration") or os.environ.get(ENV) or None


def repriced(plan: Plan, calibration: str) -> Plan:
    """`plan` and its runners-up that fit, priced again with the calibration profile at `calibration`: the same
    configurations and layer splits (their plan.* keys, in place of the user's plan.* pins and pick); the overrides
    stay the user's, with the calibration, so that the baselines search as they did."""
    if not plan.choice:
        raise NestError("the plan holds no plan.* keys of its configuration (written before them): plan it again to "
                        "re-price it with calibration=")
    keep = [o for o in plan.overrides if not o.startswith("calibration=")] + [f"calibration={calibration}"]
    problem = [o for o in keep if not o.startswith("plan.")]
    again = api.evaluate([*problem, *key_overrides(plan.choice)])
    best, errors = again.predicted["step_time_s"], again.calibration.get("errors") or ()
    runners = []
    for row in (r for r in plan.runners_up if r["fits"]):  # the constants change no memory: they still fit
        step = api.evaluate([*problem, *key_overrides(row["plan"])]).predicted["step_time_s"]
        runners.append({**row, "step_time_s": step, "tied_within_error": overlaps(step, best, errors)})
    return replace(again, overrides=keep, runners_up=runners, search=plan.search)


def explain(loaded: Loaded, plan: Plan, out: Path, *, baselines: bool, progress: Progress,
            measured: dict | None = None) -> Path:
    """Run the baselines on `loaded`'s problem, render the report of `plan` and move it into `out`
    (index.html last, so a report is either whole or absent); return index.html's path."""
    problem, cfg = loaded.problem, loaded.config
    if plan.num_devices != problem.num_devices:
        raise NestError(f"the plan is for {plan.num_devices} devices but its overrides build {problem.num_devices}")
    mismatch = plan_mismatch(plan, problem)
    if mismatch:
        raise NestError(mismatch)
    if out.exists() and not out.is_dir():
        raise NestError(f"{out}: exists and is not a folder; give the report a folder of its own")
    steps = (BASELINE_STEPS if baselines else 0) + len(FIGURES) + 1
    task = progress.add_task("report", total=steps)
    done = iter(range(steps + 1))

    def step(name: str) -> None:
        progress.update(task, description=name, completed=next(done))

    found = {}
    if baselines:
        step("Manual baseline")
        found["Manual (recipe habits)"] = manual(problem)
        step("flat-network search")
        found["best flat-network plan"] = flat_network(problem, SOLVERS[cfg.solver.name], solver_cfg=cfg.solver,
                                                       pins=cfg.plan, micro_batch_size=cfg.train.micro_batch_size)
    data = report_data(problem, plan, baselines=found, measured=measured)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out, prefix=".explain-") as tmp:
        write_report(data, Path(tmp), step=step)
        for name in (*FIGURES, "index.html"):
            shutil.move(Path(tmp) / name, out / name)
    progress.update(task, completed=steps)
    return out / "index.html"


def run(args: argparse.Namespace) -> int:
    console = stdout_console()
    try:
        out, calibration = parse_options(args.plan, args.options)
        plan = read_plan(args.plan)
        check_writable(out, "out", folder=True)
        if calibration is not None and Path(calibration).resolve() != Path(plan.calibration.get("path") or "").resolve():
            was = plan.calibration.get("label") or "no calibration recorded"
            plan = repriced(plan, calibration)
            faster = min((r["step_time_s"] for r in plan.runners_up), default=math.inf)
            if not args.quiet:
                console.print(f"re-priced with {plan.calibration['label']} (the plan was priced with {was})"
                              + (f"; a runner-up is faster with it ({faster:.4g} s against "
                                 f"{plan.predicted['step_time_s']:.4g} s): plan again with calibration={calibration}"
                                 if faster < plan.predicted["step_time_s"] else ""), highlight=False, soft_wrap=True)
        loaded = load(plan.overrides)
        with progress_bar(quiet=args.quiet) as progress:
            # a plan in the run directory of its launch: what the run measured, beside what was predicted
            measured = measured_in(Path(args.plan).parent)
            index = explain(loaded, plan, out, baselines=not args.no_baselines, progress=progress, measured=measured)
    except (NestError, OSError) as err:
        return fail(args.command, err)
    if not args.quiet:
        console.print(f"report written to {index}", highlight=False, soft_wrap=True)
    return 0
