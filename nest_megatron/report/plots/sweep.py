"""Predicted throughput per device across a sweep: one line per combination of the other swept keys."""

from __future__ import annotations

import math
from pathlib import Path

from matplotlib.ticker import EngFormatter

from nest_megatron.report.plots import new_figure, save

Y_KEY = "tokens_per_s_per_device"


def draw(rows: list[dict], *, x: str, series: list[str], title: str, path: Path) -> dict:
    """Tokens/s per device against row[x], one line per distinct (row[k] for k in series), in the rows'
    order; a point without a plan leaves a gap. Write `path`; return the lines' labels and points."""
    lines: dict[tuple, list[dict]] = {}
    for r in rows:
        lines.setdefault(tuple(r[k] for k in series), []).append(r)
    fig = new_figure(8.0, 4.8)
    ax = fig.add_subplot()
    xs_all = sorted({r[x] for r in rows})
    drawn = []
    for values, members in lines.items():
        members = sorted(members, key=lambda r: r[x])
        ys = [r[Y_KEY] if r[Y_KEY] is not None else math.nan for r in members]
        label = ", ".join(f"{k}={v}" for k, v in zip(series, values)) or "predicted"
        ax.plot([r[x] for r in members], ys, marker="o", label=label)
        drawn.append({"label": label, "points": sum(not math.isnan(y) for y in ys)})
    if xs_all and min(xs_all) > 0 and max(xs_all) / min(xs_all) >= 8:  # device counts: doubling steps
        ax.set_xscale("log", base=2)
    ax.set_xticks(xs_all, [f"{v:g}" for v in xs_all])
    ax.set_xlabel(x)
    ax.set_ylabel("predicted tokens/s per device")
    found = [r[Y_KEY] for r in rows if r[Y_KEY]]
    if found and max(found) / min(found) > 100:  # models of different sizes: keep the small ones readable
        ax.set_yscale("log")
    else:
        ax.set_ylim(0, max(found, default=1) * 1.08)
    ax.yaxis.set_major_formatter(EngFormatter())  # 8.4 M, not an offset of 1e6 over the axis
    ax.grid(True, alpha=0.3)
    missing = sum(r[Y_KEY] is None for r in rows)
    ax.set_title(title + (f"\n{missing} point(s) without a feasible plan: gaps" if missing else ""), fontsize=11, loc="left")
    if len(drawn) > 1 or series:
        ax.legend(fontsize=8, frameon=False)
    save(fig, path)
    return {"lines": drawn, "legend": [t.get_text() for t in ax.get_legend().get_texts()] if ax.get_legend() else []}
