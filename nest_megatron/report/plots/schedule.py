"""The pipeline schedule of one iteration: one row per pipeline rank, time left to right."""

from __future__ import annotations

from pathlib import Path

from matplotlib.patches import Patch

from nest_megatron.cost.schedule import KINDS, Timeline
from nest_megatron.report.plots import new_figure, save, time_unit

STYLE = {  # kind -> (colour, legend label)
    "forward": ("#4C72B0", "forward"),
    "backward": ("#DD8452", "backward"),
    "recompute": ("#8172B3", "recompute"),
    "p2p": ("#2CA9B7", "pipeline send (p2p)"),
    "zero_comm": ("#937860", "ZeRO traffic (exposed)"),
    "host": ("#8C8C3C", "waits on the host (eager launches)"),
    "offload": ("#5E8C8C", "waits on activation copies to / from host memory"),
    "imbalance": ("#C8C8C8", "waits on the slowest stage"),
    "dp_grad_sync": ("#55A868", "DP gradient sync (exposed)"),
    "dp_param_gather": ("#B5A642", "DP weight all-gather (exposed)"),
    "optimizer": ("#C44E52", "optimizer step"),
}
BUBBLE = ("#F3F3F3", "bubble (idle)")
LABEL_MIN_FRACTION = 0.015  # a segment narrower than this share of the axis gets no micro-batch number


def draw(timeline: Timeline, *, step_time: float, title: str, path: Path) -> dict:
    """Draw `timeline` with the cost model's predicted `step_time` marked; write `path`."""
    assert set(STYLE) == set(KINDS)
    num_stages = len(timeline.stages)
    unit, scale = time_unit(max(timeline.length, step_time))
    fig = new_figure(12, min(10.0, 1.9 + 0.42 * num_stages))
    ax = fig.add_subplot()
    row_height = 0.72
    label_numbers = num_stages <= 16
    for stage, segments in enumerate(timeline.stages):
        y = stage - row_height / 2
        ax.broken_barh([(0, timeline.pipeline_end / scale)], (y, row_height), facecolors=BUBBLE[0],
                       edgecolors="#BBBBBB", hatch="///", linewidth=0)
        for kind in KINDS:
            spans = [(s.start / scale, s.duration / scale) for s in segments if s.kind == kind]
            if spans:
                ax.broken_barh(spans, (y, row_height), facecolors=STYLE[kind][0], edgecolors="white", linewidth=0.3)
        if label_numbers:
            for s in segments:
                if s.kind in ("forward", "backward") and s.duration >= LABEL_MIN_FRACTION * timeline.length:
                    ax.text((s.start + s.duration / 2) / scale, stage, str(s.microbatch), ha="center", va="center",
                            fontsize=7, color="white")
    predicted = ax.axvline(step_time / scale, color="black", linestyle="--", linewidth=1)
    flush = ax.axvline(timeline.pipeline_end / scale, color="#555555", linestyle=":", linewidth=1,
                       label="pipeline flush (last backward ends)")
    ax.set_yticks(range(num_stages), [f"stage {s}" for s in range(num_stages)])
    ax.set_ylim(num_stages - 0.5, -0.5)  # stage 0 on top
    ax.set_xlim(0, max(timeline.length, step_time) / scale * 1.01)
    ax.set_xlabel(f"time in the iteration ({unit})")
    ax.set_title(title, fontsize=11, loc="left")
    used = [k for k in KINDS if any(s.kind == k for row in timeline.stages for s in row)]
    handles = [Patch(facecolor=STYLE[k][0], label=STYLE[k][1]) for k in used]
    handles.append(Patch(facecolor=BUBBLE[0], edgecolor="#BBBBBB", hatch="///", label=BUBBLE[1]))
    predicted.set_label(f"predicted step time {step_time / scale:.3g} {unit}")
    handles += [flush, predicted]
    fig.legend(handles=handles, loc="outside lower center", ncols=min(5, len(handles)), fontsize=8, frameon=False)
    save(fig, path)
    return {"rows": num_stages, "predicted_line_x": float(predicted.get_xdata()[0]) * scale, "unit": unit}
