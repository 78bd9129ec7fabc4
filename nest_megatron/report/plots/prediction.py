"""The predicted step time of the plan, its runners-up and the baselines, each with the error band its calibration's
cross-validated errors give it, and the measured step time where a run measured it."""

from __future__ import annotations

import textwrap
from pathlib import Path

from matplotlib.ticker import FuncFormatter, MaxNLocator

from nest_megatron.report.plots import new_figure, save


def draw(rows: list[dict], *, measured_s: float | None, title: str, path: Path) -> dict:
    """One horizontal bar per row ({"name", "step_time_s", "band_s": (low, high) or None, "tied": bool}), top first,
    with the band as a whisker; the measured step time as a vertical line. Returns what it drew."""
    fig = new_figure(10.0, 1.6 + 0.42 * len(rows))
    ax = fig.add_subplot()
    y = list(range(len(rows)))[::-1]
    colours = ["#4C72B0" if i == 0 else "#8FB3DE" if r.get("tied") else "#B0B0B0" for i, r in enumerate(rows)]
    ax.barh(y, [r["step_time_s"] for r in rows], color=colours, height=0.6)
    whiskers = []
    for yi, r in zip(y, rows):
        if r.get("band_s"):
            low, high = r["band_s"]
            ax.plot([low, high], [yi, yi], color="black", marker="|", markersize=9, linewidth=1.2)
            whiskers.append((low, high))
    best = rows[0].get("band_s")
    if best:  # the best plan's band, across every row: a row whose bar or band reaches it is tied
        ax.axvspan(best[0], best[1], color="#4C72B0", alpha=0.12, label="the plan's error band")
    if measured_s is not None:
        ax.axvline(measured_s, color="#C00000", linewidth=2, label=f"measured {measured_s:.4g} s")
    ax.set_yticks(y, [f"{r['name']}{'  (tied)' if r.get('tied') else ''}" for r in rows], fontsize=8)
    ax.set_xlabel("step time, s")
    ax.xaxis.set_major_locator(MaxNLocator(nbins=6))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:.3g}"))
    ax.set_xlim(0, max([r["step_time_s"] for r in rows] + [h for _, h in whiskers] + [measured_s or 0]) * 1.08)
    # across the whole figure: the labels on the left take much of the axes' width
    fig.suptitle("\n".join(textwrap.fill(line, 120) for line in title.splitlines()), x=0.01, ha="left", fontsize=10)
    if best or measured_s is not None:
        ax.legend(loc="lower right", fontsize=8)
    save(fig, path)
    return {"bars": len(rows), "whiskers": whiskers, "measured_x": measured_s}
