"""`nest-megatron calibrate RUN... [out=PROFILE.yaml] [overrides]`: fit the cost model's constants to measured runs.

Each RUN is a training log (Megatron-LM, Megatron-Bridge, NeMo 2) or a run directory `nest-megatron launch` wrote.
Its configuration is rebuilt from the arguments it logged (calibration/runs.py), priced with the one cost model,
and the constants the runs determine are fitted (calibration/fit.py); the profile holds the constants, each run
before and after, and the leave-one-out errors that give every later plan its error band (`calibration=PROFILE`),
with the leave-one-source-out and leave-one-release-out errors where the runs fall in two groups or more.
A bad or truncated log is one line naming the file and line, exit 2, and nothing is written.
"""

from __future__ import annotations

import argparse
import datetime as dt
import sys
from pathlib import Path

from nest_megatron import __version__
from nest_megatron.calibration.constants import CONSTANTS, level_name
from nest_megatron.calibration.fit import Errors, Fit, Run, cross_validation, errors_of, fit, leave_one_out
from nest_megatron.calibration.profile import write_profile
from nest_megatron.calibration.runs import Rebuilt, read_run
from nest_megatron.commands.common import check_writable, fail, stdout_console, write_atomically
from nest_megatron.cost.evaluate import estimate
from nest_megatron.errors import NestError
from nest_megatron.hardware.accelerator import GIB

HELP = "fit the cost model's constants to your runs' logs and write a calibration profile"
EPILOG = """examples:
  nest-megatron calibrate run1.log run2.log cluster=dgx_h100_superpod out=cal.yaml
  nest-megatron calibrate /tmp/nest-run-1a2b3c out=cal.yaml        # a run directory of nest-megatron launch
  nest-megatron plan model=llama3_70b calibration=cal.yaml          # then plan with it (or NEST_MEGATRON_CALIBRATION)
Megatron-LM and Megatron-Bridge logs carry their configuration; give the cluster the runs ran on (cluster=...).
A NeMo 2 log prints none: give its model and layout too (model=... plan.tp=... train.global_batch_size=...)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("items", nargs="*", metavar="RUN | out=PROFILE.yaml | override",
                        help="log files or run directories; out=PROFILE.yaml (default: the profile on stdout); "
                             "Hydra overrides for the runs' cluster (cluster=..., accelerator=...)")
    parser.add_argument("--quiet", action="store_true", help="print nothing but errors")


def split_items(items: list[str]) -> tuple[list[str], str | None, list[str]]:
    """(runs, out, overrides): a key=value item is an option or an override, anything else a run."""
    runs, out, overrides = [], None, []
    for item in items:
        key, sep, value = item.partition("=")
        if sep and not Path(item).exists():
            if key == "out":
                out = value
            else:
                overrides.append(item)
        else:
            runs.append(item)
    return runs, out, overrides


def run(args: argparse.Namespace) -> int:
    try:
        runs, out, overrides = split_items(args.items)
        if not runs:
            raise NestError("no run given: give log files or run directories, e.g. calibrate run.log cluster=... "
                            "out=cal.yaml")
        if out:
            check_writable(Path(out), "out")
        rebuilt = [read_run(path, user=overrides, label=_label(path, runs[:i])) for i, path in enumerate(runs)]
        accelerators = {r.loaded.problem.accelerator.name for r in rebuilt}
        if len(accelerators) > 1:
            raise NestError(f"the runs are of {', '.join(sorted(accelerators))}: a calibration is of one accelerator; "
                            "calibrate each apart")
        measured = [r.run() for r in rebuilt]
        full = fit(measured)
        loo = leave_one_out(measured, full=full)
        held = held_out(measured, full)
        text = write_profile(profile(rebuilt, full, loo, held))
        if out:
            write_atomically(Path(out), text)
    except (NestError, OSError) as err:
        return fail("calibrate", err)
    if not out:
        print(text, end="")
    elif not args.quiet:
        report(rebuilt, full, loo, held, out=out)
    return 0


def _label(path: str, before: list[str]) -> str:
    """The run's name in the profile: its path, numbered when the same path was given before."""
    count = before.count(path)
    return path if not count else f"{path}#{count + 1}"


# The cross-validations by group (calibration/fit.py CROSS_VALIDATIONS), each with the group it holds out
GROUPED = {"leave-one-source-out": "source", "leave-one-release-out": "release"}


def held_out(runs: list[Run], full: Fit) -> dict[str, Errors | str]:
    """Each grouped cross-validation: its errors where the runs fall in two groups or more, else why not (a line)."""
    computed = cross_validation(runs, full=full, which=tuple(GROUPED))
    return {name: computed[name] if name in computed else _why_not(runs, group) for name, group in GROUPED.items()}


def _why_not(runs: list[Run], group: str) -> str:
    if any(group not in run.groups for run in runs):
        return f"the logs state no {group} (none of the formats calibrate reads prints one)"
    return f"{'the one run' if len(runs) == 1 else f'all {len(runs)} runs'} of one {group}: {runs[0].groups[group]}"


def _held_out_entry(errors: Errors | str) -> dict:
    return errors.as_dict() if isinstance(errors, Errors) else {"not_computed": errors}


def profile(rebuilt: list[Rebuilt], full: Fit, loo, held: dict[str, Errors | str]) -> dict:
    """The profile's content (calibration/profile.py reads it back)."""
    problem, measured = rebuilt[0].loaded.problem, [r.run() for r in rebuilt]
    before, after = errors_of(full.prior_predicted_s, measured), errors_of(full.predicted_s, measured)
    constants = {}
    for name, verdict in full.verdicts.items():
        constant = CONSTANTS[name]
        entry = {"value": float(verdict.value), "prior": float(verdict.prior), "unit": constant.unit,
                 "fitted": verdict.fitted, "why": verdict.why}
        if verdict.posterior_sd is not None:
            entry["posterior_sd"] = float(verdict.posterior_sd)
        if (level := level_name(problem, constant)) is not None:
            entry["level"] = level
        constants[name] = entry
    runs = []
    for i, r in enumerate(rebuilt):
        c = r.config
        est = estimate(r.loaded.problem, c, layers_per_stage=r.layers_per_stage)
        runs.append({
            "log": r.log.source,
            "format": r.log.format,
            "source": r.source,
            "overrides": list(r.overrides),
            "configuration": {"world": c.world, "tp": c.tp, "pp": c.pp, "dp": c.dp, "cp": c.cp, "ep": c.ep,
                              "etp": c.etp, "vpp": c.vpp, "sp": c.sp, "mbs": c.mbs, "zero": c.zero,
                              "recompute": c.recompute, "order": c.order,
                              "layers_per_stage": list(r.layers_per_stage) if r.layers_per_stage else None},
            "iterations_logged": len(r.log.iterations),
            "measured_step_s": r.log.measured_step_s,
            "predicted_before_s": full.prior_predicted_s[i],
            "predicted_after_s": full.predicted_s[i],
            "error_before": before.errors[i],
            "error_after": after.errors[i],
            "leave_one_out_error": loo.errors[i],
            "measured_peak_memory_gib": r.log.peak_memory_bytes / GIB if r.log.peak_memory_bytes else None,
            "predicted_peak_memory_gib": est.peak_memory / GIB,
            **({"plan_digest": _digest(r.plan)} if r.plan else {}),
            **({"notes": r.notes} if r.notes else {}),
        })
    return {
        "accelerator": problem.accelerator.name,
        "cluster": problem.topology.name,
        "written": f"nest-megatron {__version__} calibrate, {dt.datetime.now().isoformat(timespec='seconds')}",
        "constants": constants,
        "runs": runs,
        "errors": {"before": _summary(before), "after": _summary(after)},
        "leave_one_out": loo.as_dict(),
        "cross_validation": {name: _held_out_entry(errors) for name, errors in held.items()},
    }


def _digest(plan: dict) -> str:
    from nest_megatron.plan import Plan

    return Plan.from_dict(plan).digest


def _summary(errors) -> dict:
    return {"runs": errors.runs, "median_abs_error": errors.median_abs, "bias": errors.bias,
            "worst_abs_error": errors.worst}


def report(rebuilt: list[Rebuilt], full: Fit, loo, held: dict[str, Errors | str], *, out: str) -> None:
    from rich.table import Table

    from nest_megatron.report.table import print_table

    console = stdout_console()
    constants = Table(title="constants (prior -> calibrated)")
    for column in ("constant", "prior", "calibrated", "unit", ""):
        constants.add_column(column)
    for name, v in full.verdicts.items():
        constants.add_row(name, f"{v.prior:.4g}", f"{v.value:.4g}" if v.fitted else "(prior)", CONSTANTS[name].unit, v.why)
    print_table(console, constants)
    runs = Table(title="runs: step time (s)")
    for column in ("run", "configuration", "measured", "before", "after", "left out"):
        runs.add_column(column, justify="left" if column in ("run", "configuration") else "right")
    for i, r in enumerate(rebuilt):
        c, m = r.config, r.log.measured_step_s
        runs.add_row(r.label, f"TP {c.tp} PP {c.pp} DP {c.dp} CP {c.cp} EP {c.ep} mbs {c.mbs} ZeRO {c.zero}",
                     f"{m:.4g}", f"{full.prior_predicted_s[i]:.4g} ({full.prior_predicted_s[i] / m - 1:+.1%})",
                     f"{full.predicted_s[i]:.4g} ({full.predicted_s[i] / m - 1:+.1%})", f"{loo.errors[i]:+.1%}")
    print_table(console, runs)
    console.print(f"leave-one-out: {loo.line()}", highlight=False)
    for name, errors in held.items():
        line = errors.line() if isinstance(errors, Errors) else f"not computed: {errors}"
        console.print(f"{name}: {line}", highlight=False, soft_wrap=True)
    console.print(f"calibration written to {out}; plan with it: calibration={out}", highlight=False, soft_wrap=True)
    sys.stdout.flush()
