"""The explain report's figures: one module per figure, each `draw(...)` writes a PNG and returns
what it drew (counts and positions read back from the matplotlib artists, for the tests).

Figures are made with matplotlib's object API on the Agg canvas: no pyplot state, no display.
"""

from __future__ import annotations

from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

DPI = 110


def new_figure(width_in: float, height_in: float) -> Figure:
    fig = Figure(figsize=(width_in, height_in), dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def save(fig: Figure, path: Path) -> None:
    """Write through a temporary file and rename, so no half-written PNG is ever left."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    fig.savefig(tmp, format="png", dpi=DPI)
    tmp.replace(path)


def time_unit(seconds: float) -> tuple[str, float]:
    """A readable unit for an axis that spans `seconds`: (name, seconds per unit)."""
    if seconds >= 1:
        return "s", 1.0
    if seconds >= 1e-3:
        return "ms", 1e-3
    return "µs", 1e-6
