"""The shipped cost model on Megatron-Bridge's later H100 runs, which no fit sees (benchmarks/bridge_h100_held_out.yaml).

    python scripts/bench_held_out.py [--out docs/fidelity]

Each row of NeMo containers 26.02 to 26.06 that runs the layout of a 25.11 recipe of the calibration set, or of a
later recipe read at its tag (held_out.LATER_RECIPES), is priced with the shipped constants and that recipe's settings
(nest_megatron/fidelity/held_out.py); the rest are listed with the reason they are not priced. Prints the rows and the
summary (median |error|, bias, worst), again without the rows their release's own notes say ran degraded
(held_out.KNOWN_ISSUES), and writes them to <out>/held_out_bridge_<date>.md. No GPU: the measurements are the
source's.
"""

from __future__ import annotations

import argparse
import datetime as dt
import subprocess
from pathlib import Path

from nest_megatron.fidelity.bench import summarise
from nest_megatron.fidelity.held_out import HELD_OUT_PATH, held_out

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "docs" / "fidelity"))
    args = parser.parse_args(argv)
    rows = held_out()
    priced = [h for h in rows if h.result is not None]
    table = ["| row (table line) | layout and recipe of | measured s | predicted s | error |", "|---|---|---|---|---|"]
    for h in priced:
        r = h.result
        error = f"{r.error:+.1%}" if r.refused is None else f"refused: {r.refused}"
        recipe = f"{h.base} at {h.recipe}" if h.recipe else h.base
        table.append(f"| {h.label} ({h.line}) | {recipe} | {r.row.measured_step_s:.3f} | "
                     f"{r.estimate.step_time:.3f} | {error} |")
    summary = summarise([h.result for h in priced])
    summary_line = summary.line() if summary else "no row priced"
    degraded = [f"- {h.label} ({h.line}): {h.known_issue}" for h in priced if h.known_issue]
    sound = summarise([h.result for h in priced if not h.known_issue])
    sound_line = f"without the {len(degraded)} row(s) their release's notes say ran degraded: " + (
        sound.line() if sound else "no row priced")
    skipped = [f"- {h.label} ({h.line}): {h.why_not}" for h in rows if h.result is None]
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    stamp = dt.date.today().isoformat()
    doc = [f"# Held out: Megatron-Bridge's later H100 runs ({stamp})", "",
           f"`python scripts/bench_held_out.py` at commit {commit}: the rows of `{HELD_OUT_PATH.relative_to(ROOT)}` "
           "(NeMo containers 26.02 to 26.06), which no fit sees, priced with the shipped constants and the settings "
           "of the 25.11 recipe whose layout they run, or of the later recipe named, read at its tag "
           "(nest_megatron/fidelity/held_out.py LATER_RECIPES; for a model without a 25.11 row, the row named gives "
           "only its shape). Error = predicted / measured - 1.", "",
           f"Summary: {summary_line}; {sound_line}", "", *table, "",
           "## Degraded by a known issue of their release (priced, and left out of the second summary)", "",
           *(degraded or ["none"]), "", "## Not priced", "", *skipped]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"held_out_bridge_{stamp}.md"
    path.write_text("\n".join(doc) + "\n")
    print("\n".join(table))
    print(f"summary: {summary_line}")
    print(sound_line)
    print(f"not priced: {len(skipped)}; wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
