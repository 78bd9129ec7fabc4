"""The cost model against published, measured H100 training runs (benchmarks/h100_published.yaml).

    python scripts/bench_published.py [--out docs/fidelity] [--plan]

For every calibration row: the step time the cost model predicts at the published layout beside
the measured one, the error, the breakdown of the predicted step, and what the row leaves unstated
(filled from its recipe). Then the summary per group (all, dense / MoE, bf16 / fp8, per source):
median |error|, bias (median signed error), the shares within 10 % and 20 %, against the targets.
--plan also runs the planner for each row's model, cluster, batch and precision and lists where it
claims more than 10 % over the published layout, with both breakdowns.

Writes <out>/published_<date>.md and a predicted-vs-measured scatter plot <out>/published_<date>.png.
The predictions take no GPU; the measurements are the sources'.
"""

from __future__ import annotations

import argparse
import datetime as dt
import subprocess
import sys
from pathlib import Path

from nest_megatron import api
from nest_megatron.errors import NestError
from nest_megatron.fidelity.bench import RowResult, cross_validated, evaluate_row, groups, summarise, summarise_errors
from nest_megatron.fidelity.published import CALIBRATION_PATH, rows

ROOT = Path(__file__).resolve().parents[1]
TARGETS = {"median |error|": 0.08, "|bias|": 0.04, "worst |error|": 0.20}
# On rows each fit did not see (issue 19): the headline
CROSS_VALIDATED_TARGETS = {"median |error|": 0.08, "|bias|": 0.04, "worst |error|": 0.25}
PER_SOURCE = ("bridge",)  # sources whose rows the targets also hold for alone (issue 18: the Megatron-Bridge rows)
BREAKDOWN_SHOWN = 0.03  # parts of the step below this share are left out of the table


def _layout(r: RowResult) -> str:
    c = r.estimate.config
    parts = [f"tp{c.tp}", f"pp{c.pp}", f"dp{c.dp}"] + [f"{k}{v}" for k, v in (("cp", c.cp), ("ep", c.ep), ("vpp", c.vpp)) if v > 1]
    return " ".join(parts + [f"mbs{c.mbs}", f"zero{c.zero}", r.recompute])


def _breakdown(r: RowResult) -> str:
    e = r.estimate
    shown = sorted(((v / e.step_time, k) for k, v in e.breakdown.items() if v >= BREAKDOWN_SHOWN * e.step_time), reverse=True)
    return ", ".join(f"{k} {share:.0%}" for share, k in shown)


def _row_table(results: list[RowResult]) -> list[str]:
    lines = ["| row | precision | layout priced | measured s | predicted s | error | breakdown | unstated, from the recipe |",
             "|---|---|---|---|---|---|---|---|"]
    for r in results:
        if r.estimate is None:
            continue
        error = f"{r.error:+.1%}" if r.refused is None else f"refused: {r.refused}"
        lines.append(f"| {r.row.id} | {r.row.precision} | {_layout(r)} | {r.row.measured_step_s:.3f} | "
                     f"{r.estimate.step_time:.3f} | {error} | {_breakdown(r)} | {'; '.join(r.row.assumed)} |")
    return lines


def _summary_table(results: list[RowResult]) -> list[str]:
    lines = ["| group | rows | median \\|error\\| | bias | within 10 % | within 20 % | worst |", "|---|---|---|---|---|---|---|"]
    for name, members in groups(results).items():
        s = summarise(members)
        if s:
            lines.append(f"| {name} | {s.rows} | {s.median_abs_error:.1%} | {s.bias:+.1%} | {s.within_10:.0%} | "
                         f"{s.within_20:.0%} | {s.max_abs_error:.1%} |")
    return lines


def _targets(results: list[RowResult]) -> list[str]:
    lines = []
    for name in ("all", "dense", "moe", "bf16", "fp8"):
        s = summarise(groups(results)[name])
        checks = {"median |error|": s.median_abs_error, "|bias|": abs(s.bias), "worst |error|": s.max_abs_error}
        missed = [f"{k} {v:.1%} > {TARGETS[k]:.0%}" for k, v in checks.items() if v > TARGETS[k]]
        lines.append(f"- {name}: {'met' if not missed else 'missed: ' + ', '.join(missed)}")
    refused = [r.row.id for r in results if r.refused]
    lines.append(f"- published layouts refused as out of memory: {len(refused)}" + (f" ({', '.join(refused)})" if refused else ""))
    return lines


def _cross_validated_table(crossed: dict[str, list[float]], results: list[RowResult]) -> list[str]:
    """The headline: each row priced by a fit that did not see it (its row, its source, its release), beside the
    shipped constants in sample, with the targets."""
    lines = ["| errors | rows | median \\|error\\| | bias | within 10 % | within 20 % | worst | targets |",
             "|---|---|---|---|---|---|---|---|"]
    priced = [r for r in results if r.estimate is not None and r.refused is None]  # the order of the crossed errors
    by_source = [(f"{n}, source {source}", summarise_errors([e for r, e in zip(priced, errors) if r.row.source == source]))
                 for n, errors in crossed.items() for source in PER_SOURCE if any(r.row.source == source for r in priced)]
    in_sample = [("in sample (shipped constants)", summarise(results)),
                 *((f"in sample, source {source}", summarise([r for r in priced if r.row.source == source]))
                   for source in PER_SOURCE if any(r.row.source == source for r in priced))]
    for name, s in [*((n, summarise_errors(e)) for n, e in crossed.items()), *by_source, *in_sample]:
        checks = {"median |error|": s.median_abs_error, "|bias|": abs(s.bias), "worst |error|": s.max_abs_error}
        missed = [f"{k} {v:.1%} > {CROSS_VALIDATED_TARGETS[k]:.0%}" for k, v in checks.items()
                  if v > CROSS_VALIDATED_TARGETS[k]]
        verdict = "" if name.startswith("in sample") else ("met" if not missed else "missed: " + ", ".join(missed))
        verdict = verdict.replace("|", "\\|")  # a bare | would end the Markdown cell
        lines.append(f"| {name} | {s.rows} | {s.median_abs_error:.1%} | {s.bias:+.1%} | {s.within_10:.0%} | "
                     f"{s.within_20:.0%} | {s.max_abs_error:.1%} | {verdict} |")
    return lines


def _plan_table(results: list[RowResult]) -> list[str]:
    """Rows where the planner claims more than 10 % over the published layout, same model, cluster,
    batch and precision (every plan.* key free)."""
    lines = ["| row | published s | planned s | gain | planned layout | published breakdown | planned breakdown |",
             "|---|---|---|---|---|---|---|"]
    for r in results:
        if r.estimate is None or r.refused:
            continue
        free = [o for o in r.row.overrides if not o.startswith("plan.")]
        try:
            plan = api.plan(free)
        except NestError as e:
            lines.append(f"| {r.row.id} | {r.estimate.step_time:.3f} | - | - | no plan: {e} | | |")
            continue
        planned = plan.predicted["step_time_s"]
        gain = r.estimate.step_time / planned - 1
        if gain > 0.10:
            p = plan.parallel
            layout = " ".join([f"{k}{p[k]}" for k in ("tp", "pp", "dp", "cp", "ep", "vpp") if k in ("tp", "pp", "dp") or p[k] > 1]
                              + [f"mbs{plan.micro_batch_size}", f"zero{plan.zero_stage}", plan.recompute["granularity"] or "none"])
            parts = ", ".join(f"{k} {v / planned:.0%}" for k, v in sorted(plan.predicted["breakdown"].items(),
                                                                        key=lambda kv: -kv[1]) if v >= BREAKDOWN_SHOWN * planned)
            lines.append(f"| {r.row.id} | {r.estimate.step_time:.3f} | {planned:.3f} | {gain:+.0%} | {layout} | "
                         f"{_breakdown(r)} | {parts} |")
    return lines


def scatter(results: list[RowResult], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 6))
    priced = [r for r in results if r.estimate is not None and r.refused is None]
    low = min(min(r.row.measured_step_s, r.estimate.step_time) for r in priced) / 1.3
    high = max(max(r.row.measured_step_s, r.estimate.step_time) for r in priced) * 1.3
    ax.plot([low, high], [low, high], color="black", lw=1, label="predicted = measured")
    for factor, style in ((1.1, ":"), (1.2, "--")):
        for f in (factor, 1 / factor):
            ax.plot([low, high], [low * f, high * f], color="grey", lw=0.8, ls=style)
    for precision, color in (("bf16", "tab:blue"), ("fp8", "tab:orange")):
        for moe, marker in ((False, "o"), (True, "^")):
            pts = [r for r in priced if r.row.precision == precision and r.row.moe == moe]
            if pts:
                ax.scatter([r.row.measured_step_s for r in pts], [r.estimate.step_time for r in pts], c=color,
                           marker=marker, s=28, label=f"{precision} {'MoE' if moe else 'dense'} ({len(pts)})")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(low, high)
    ax.set_ylim(low, high)
    # plain seconds at 1-2-5 steps; the log axes' default minor labels overlap
    from matplotlib.ticker import FixedLocator, NullFormatter, ScalarFormatter
    ticks = [t for t in (0.5, 1, 2, 3, 5, 10, 20, 30, 50, 100, 200) if low <= t <= high]
    for axis in (ax.xaxis, ax.yaxis):
        axis.set_major_locator(FixedLocator(ticks))
        axis.set_major_formatter(ScalarFormatter())
        axis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("measured step time, s (published)")
    ax.set_ylabel("predicted step time, s (nest-megatron cost model)")
    ax.set_title("Published H100 runs at their layouts\n(dotted: ±10 %, dashed: ±20 %)")
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "docs" / "fidelity"))
    parser.add_argument("--plan", action="store_true", help="also plan each row's model and compare")
    parser.add_argument("--cross-validate", action="store_true",
                        help="compute the cross-validated errors (minutes) rather than read the shipped calibration's")
    args = parser.parse_args(argv)
    results = [evaluate_row(row) for row in rows()]
    crossed = cross_validated(results, compute=args.cross_validate)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stamp = dt.date.today().isoformat()
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    scatter(results, out / f"published_{stamp}.png")
    not_expressible = [f"- {r.row.id}: {r.row.not_expressible}" for r in results if r.row.not_expressible]
    doc = [f"# Predicted against measured: published H100 runs ({stamp})", "",
           f"`python scripts/bench_published.py` at commit {commit}; calibration set "
           f"`{CALIBRATION_PATH.relative_to(ROOT)}` ({len(results)} rows). Error = predicted / measured - 1. "
           "The launcher and NeMo rows keep their optimizer's state (Apex DistributedFusedAdam: 10 B a parameter), "
           "the AutoModel MoE rows dispatch with DeepEP, the Megatron-Bridge rows take their perf recipe's settings at its tag "
           "(nest_megatron/fidelity/published.py).", "",
           f"![predicted vs measured](published_{stamp}.png)", "",
           "## Cross-validated (the headline)", "",
           "Each row priced by the fit of the constants to the other rows (scripts/fit_calibration.py, calibration/fit.py): "
           "leaving out the row, its source (launcher, NeMo, AutoModel, Megatron-Bridge) or its release (container "
           "tag); 'source bridge': the errors of the Megatron-Bridge rows alone. Targets "
           "(issue 19): median |error| <= 8 %, |bias| <= 4 %, worst <= 25 %.", "",
           *(_cross_validated_table(crossed, results) if crossed else
             ["(not computed: the shipped calibration file is of other rows or constants; run with --cross-validate)"]),
           "", "## Summary (in sample)", "", *_summary_table(results), "",
           "Targets (issue: median |error| <= 8 %, |bias| <= 4 %, every expressible row within 20 %, for each group):", "",
           *_targets(results), "", "## Rows", "", *_row_table(results), "", "## Not expressible", "", *not_expressible]
    if args.plan:
        doc += ["", "## Where `plan` claims more than 10 % over the published layout", "", *_plan_table(results)]
    (out / f"published_{stamp}.md").write_text("\n".join(doc) + "\n")
    for line in _cross_validated_table(crossed, results)[2:] if crossed else []:
        print(line)
    for name, members in groups(results).items():
        s = summarise(members)
        if s:
            print(f"{name:22} {s.line()}")
    print(f"wrote {out / f'published_{stamp}.md'} and .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
