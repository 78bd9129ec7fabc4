"""Memory of one device of each pipeline stage, stacked by what holds it, against the capacity."""

from __future__ import annotations

from pathlib import Path

from nest_megatron.report.plots import new_figure, save

STYLE = {  # Plan.predicted["memory_breakdown_gib"] key -> (colour, legend label)
    "weights": ("#4C72B0", "weights (bf16; embedding on the first stage)"),
    "grads": ("#55A868", "gradients (fp32)"),
    "optimizer": ("#8172B3", "optimizer state (Adam, fp32)"),
    "activations": ("#DD8452", "activations in flight"),
    "logits": ("#C44E52", "logits + loss (last stage)"),
    "workspace": ("#A0A0A0", "workspace (CUDA, NCCL, allocator)"),
}


def draw(breakdown: list[dict], *, capacity_gib: float, title: str, path: Path) -> dict:
    """One stacked bar per stage from `breakdown` (GiB per kind), the capacity as a line; write `path`."""
    num_stages = len(breakdown)
    fig = new_figure(min(12.0, 7.5 + 0.3 * num_stages), 4.8)
    ax = fig.add_subplot()
    x = list(range(num_stages))
    bottom = [0.0] * num_stages
    bars = None
    for kind, (colour, label) in STYLE.items():
        heights = [stage.get(kind, 0.0) for stage in breakdown]
        bars = ax.bar(x, heights, bottom=bottom, color=colour, label=label, width=0.7)
        bottom = [b + h for b, h in zip(bottom, heights)]
    capacity = ax.axhline(capacity_gib, color="#C00000", linestyle="--", linewidth=1.5,
                          label=f"device capacity {capacity_gib:.1f} GiB")
    if num_stages <= 32:  # totals under the stage numbers, clear of the capacity line
        ax.set_xticks(x, [f"{i}\n{total:.1f}" for i, total in zip(x, bottom)], fontsize=8)
        ax.set_xlabel("pipeline stage / total GiB")
    else:
        ax.set_xlabel("pipeline stage")
    ax.set_ylabel("GiB per device")
    ax.set_ylim(0, max(capacity_gib, max(bottom)) * 1.12)
    ax.set_title(title, fontsize=11, loc="left")
    fig.legend(loc="outside right center", fontsize=8, frameon=False)
    save(fig, path)
    return {"bars": len(bars), "capacity_y": float(capacity.get_ydata()[0]), "totals": bottom}
