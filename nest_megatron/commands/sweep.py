"""`nest-megatron sweep [overrides] [out=ROWS.csv|.json] [plot=PLOT.png]`: plan every point of a Hydra sweep
(`cluster=a,b cluster.num_devices=256,1024`) and print one row per point."""

from __future__ import annotations

import argparse
import csv
import io
import json
from pathlib import Path

from rich.measure import Measurement
from rich.table import Table

from nest_megatron import sweep
from nest_megatron.commands.common import fail, stdout_console, write_atomically
from nest_megatron.commands.explain import progress_bar
from nest_megatron.errors import NestError
from nest_megatron.report.plots import time_unit
from nest_megatron.report.plots.sweep import draw
from nest_megatron.report.table import band_text, fits_console

HELP = "plan every point of a sweep (cluster=a,b cluster.num_devices=256,1024) and tabulate the best plans"
EPILOG = """examples:
  nest-megatron sweep model=llama3_70b cluster=dgx_h100_superpod,h100_spine_leaf \\
      cluster.num_devices=256,512,1024,2048,4096 --jobs 4 out=sweep.csv plot=sweep.png
  nest-megatron sweep model=llama3_8b,llama3_70b 'cluster.num_devices=range(64,513,64)'   # quote the ( )
  nest-megatron sweep 'cluster.levels.1.bandwidth_gb_per_s=50,25,12.5' --json"""
OUT_FORMATS = (".csv", ".json")
OPTIONS = ("out", "plot")  # the sweep's own key=value options; every other key=value is a Hydra override


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("overrides", nargs="*",
                        help="Hydra overrides; a=x,y or a=range(start,stop,step) sweeps a, the rest apply to every point; "
                             "out=ROWS.csv|ROWS.json writes the rows; plot=PLOT.png draws tokens/s per device")
    parser.add_argument("--jobs", type=positive, default=1, metavar="N", help="plan N points at a time, in N processes")
    parser.add_argument("--max-points", type=positive, default=sweep.MAX_POINTS, metavar="N",
                        help=f"refuse a sweep of more than N points (default {sweep.MAX_POINTS})")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON instead of a table")
    parser.add_argument("--quiet", action="store_true", help="print nothing; write out= / plot= only")


def positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return int(text)


def split_options(items: list[str]) -> tuple[list[str], dict[str, Path]]:
    """(Hydra overrides, {out, plot: path}); NestError for a wrong extension, a repeated or swept option."""
    overrides, chosen = [], {}
    for item in items:
        key, sep, value = item.partition("=")
        if key == "report":
            raise NestError(f"'{item}': sweep writes no report; plan one point with report=DIR")
        if key not in OPTIONS or not sep:
            overrides.append(item)
            continue
        allowed = OUT_FORMATS if key == "out" else (".png",)
        if key in chosen:
            raise NestError(f"'{item}': {key}= given twice; give one path")
        if Path(value).suffix.lower() not in allowed:
            raise NestError(f"'{item}': {key}= must end in {' or '.join(allowed)}")
        chosen[key] = Path(value)
    return overrides, chosen


def plot_axes(points: list[sweep.Point]) -> tuple[str, list[str]]:
    """(x key: the first swept key whose values are all numbers, the other swept keys: one line each)."""
    keys = list(points[0].values)
    x = next((k for k in keys if sweep.numeric(p.values[k] for p in points)), None)
    if x is None:
        swept = ", ".join(keys) or "none"
        raise NestError(f"plot= needs a swept key with numeric values (e.g. cluster.num_devices=256,512); swept: {swept}")
    return x, [k for k in keys if k != x]


def to_csv(rows: list[dict]) -> str:
    text = io.StringIO()
    writer = csv.DictWriter(text, fieldnames=list(rows[0]), lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    return text.getvalue()


def table(rows: list[dict], swept: list[str], fixed: str) -> tuple[Table, list[str]]:
    """The rows as a rich table, and the reasons of the points without a plan as numbered notes."""
    failed = sum(r["error"] is not None for r in rows)
    title = f"nest-megatron sweep: {len(rows)} points" + (f", {failed} without a plan" if failed else "")
    t = Table(title=title, caption=f"every point: {fixed}" if fixed else None)
    heads = [*swept, "devices", "TP", "PP", "DP", "CP", "EP", "VPP", "mbs", "ZeRO", "recompute", "step", "band",
             "tokens/s", "tok/s/dev", "MFU", "GiB peak/cap"]
    for head in heads:
        t.add_column(head, justify="left" if head in swept or head == "recompute" else "right", no_wrap=head == "band")
    notes = []
    for r in rows:
        cells = [str(r[k]) for k in swept] + [str(r["num_devices"] or "-")]
        if r["error"] is not None:
            notes.append(r["error"])
            t.add_row(*cells, f"no plan [{len(notes)}]", *[""] * (len(heads) - len(cells) - 1), style="red")
            continue
        cells += [str(r[k]) for k in ("tp", "pp", "dp", "cp", "ep", "vpp", "mbs", "zero")] + [r["recompute"]]
        unit, scale = time_unit(r["step_time_s"])
        band = (r["step_time_low_s"], r["step_time_high_s"])
        cells += [f"{r['step_time_s'] / scale:.3g} {unit}", band_text(band, unit, scale) if band[0] is not None else "",
                  f"{r['tokens_per_s']:,.0f}", f"{r['tokens_per_s_per_device']:,.0f}",
                  f"{r['mfu']:.1%}", f"{r['peak_memory_gib']:.1f}/{r['capacity_gib']:.0f}"]
        t.add_row(*cells)
    return t, notes


def calibration_lines(rows: list[dict]) -> list[str]:
    """`calibration: ...` once for each calibration that priced a point and its band (an accelerator sweep: several)."""
    return [f"calibration: {summary}" for summary in dict.fromkeys(r["calibration"] for r in rows if r["calibration"])]


def run(args: argparse.Namespace) -> int:
    console = stdout_console()
    try:
        overrides, chosen = split_options(args.overrides)
        points = sweep.expand(overrides, max_points=args.max_points)
        if "plot" in chosen:
            x, series = plot_axes(points)
        with progress_bar(quiet=args.quiet) as progress:
            tasks = {phase: progress.add_task(text, total=len(points))
                     for phase, text in (("check", "loading configs"), ("plan", "planning points"))}
            outcomes = sweep.run(points, jobs=args.jobs, on_done=lambda phase: progress.advance(tasks[phase]))
        rows = [sweep.row(o) for o in outcomes]
        swept = list(points[0].values)
        if "plot" in chosen:  # before out=, so that a plot that cannot be written leaves no rows file either
            fixed = [o for o in points[0].overrides if o.partition("=")[0] not in swept]
            draw(rows, x=x, series=series, title=" ".join(fixed) or "nest-megatron sweep", path=chosen["plot"])
        if "out" in chosen:
            out = chosen["out"]
            write_atomically(out, json.dumps(rows, indent=2) if out.suffix.lower() == ".json" else to_csv(rows))
    except (NestError, OSError) as e:
        return fail(args.command, e)
    if args.json:
        print(json.dumps(rows, indent=2))
    elif not args.quiet:
        fixed = " ".join(o for o in points[0].overrides if o.partition("=")[0] not in swept)
        rendered, notes = table(rows, swept, fixed)
        if not fits_console(console):  # piped: as wide as the table needs, not squeezed into 80 columns
            console.width = Measurement.get(console, console.options.update_width(10_000), rendered).maximum
        console.print(rendered)
        for number, note in enumerate(notes, 1):
            console.print(f"[{number}] {note}", highlight=False, soft_wrap=True, markup=False)
        for line in calibration_lines(rows):
            console.print(line, highlight=False, soft_wrap=True, markup=False)
        for key in OPTIONS:
            if key in chosen:
                console.print(f"{'rows' if key == 'out' else 'plot'} written to {chosen[key]}", highlight=False)
    return 0
