"""The placement on the topology: devices grouped by network level, coloured by pipeline stage,
one group of each kind outlined and labelled with the level it crosses and its traffic."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from matplotlib import colormaps
from matplotlib.lines import Line2D
from matplotlib.patches import Patch, Rectangle

from nest_megatron.hardware.topology import Topology
from nest_megatron.report.plots import new_figure, save

IDLE, FAILED = -1, -2  # stage_of_device for a device that runs nothing, and for one on a failed node
FAILED_COLOUR = "#E8A0A0"
HOST_FILL = {"failed": "#F6DADA", "idle": "#E4E4E4"}  # the box of a host that runs nothing
HOST_HATCH = {"failed": "xx", "idle": "///"}
PITCH = 1.15  # distance between device centres; a device is a unit square
MAX_DEVICES = 2048  # above this, the first top-level units up to this many devices are drawn
TARGET_ASPECT = 2.0  # width : height of a unit's grid of children
# kind -> (outline colour, line style, offset of the outline from the device square)
OUTLINE = {
    "tp": ("#000000", "-", 0.16),
    "cp": ("#E7298A", "-", 0.09),
    "ep": ("#1B9E77", "-", 0.09),
    "dp": ("#D62728", "-", 0.02),
    "pp": ("#1F3A93", (0, (2, 1)), -0.08),
}


@dataclass(frozen=True)
class GroupMark:
    """One group to outline: its kind (tp, cp, dp, ep, pp), its devices in group order, a legend label."""

    kind: str
    devices: tuple[int, ...]
    label: str


@dataclass(frozen=True)
class _Box:
    width: float
    height: float


def _unit_sizes(topology: Topology) -> list[tuple[_Box, int]]:
    """Per level, the box of one unit and how many columns its children take."""
    fan0 = topology.levels[0].fan_out
    cols0 = min(fan0, 16)
    node = _Box(cols0 * PITCH + 0.75, math.ceil(fan0 / cols0) * PITCH + 0.3)  # + room for its label
    sizes = [(node, cols0)]
    for level, lv in enumerate(topology.levels[1:], start=1):
        child, _ = sizes[-1]
        cols = max(1, min(lv.fan_out, round(math.sqrt(lv.fan_out * TARGET_ASPECT * child.height / child.width))))
        rows = math.ceil(lv.fan_out / cols)
        pad, header = 0.35 + 0.25 * level, 0.9 + 0.2 * level
        sizes.append((_Box(cols * (child.width + pad) + pad, rows * (child.height + pad) + pad + header), cols))
    return sizes


def device_positions(topology: Topology, num_devices: int) -> tuple[list[tuple[float, float]], list[tuple]]:
    """Lower-left corner of each of the first `num_devices` devices, and the unit boxes
    (level, index, x, y, width, height) of levels >= 1 that hold them. A unit of an irregular tree
    (a partial scalable unit, a leaf switch of the allocation) holds the children it really has."""
    sizes = _unit_sizes(topology)
    positions: list[tuple[float, float]] = []
    boxes: list[tuple] = []
    # first child and first device of each unit, per level
    first_child = [None] + [np.concatenate(([0], np.cumsum(_children(topology, lvl)))) for lvl in range(1, len(topology.levels))]
    first_device = [np.concatenate(([0], np.cumsum(topology.unit_sizes(lvl)))) for lvl in range(len(topology.levels))]

    def place(level: int, index: int, x: float, y: float) -> None:
        box, cols = sizes[level]
        if level == 0:
            start = index * topology.levels[0].fan_out
            for d in range(topology.levels[0].fan_out):
                if start + d < num_devices:
                    positions.append((x + 0.15 + (d % cols) * PITCH, y + 0.15 + (d // cols) * PITCH))
            boxes.append((0, index, x, y, box.width, box.height))
            return
        boxes.append((level, index, x, y, box.width, box.height))
        child, _ = sizes[level - 1]
        pad, header = 0.35 + 0.25 * level, 0.9 + 0.2 * level
        for c, child_index in enumerate(range(first_child[level][index], first_child[level][index + 1])):
            if first_device[level - 1][child_index] >= num_devices:
                break
            place(level - 1, child_index, x + pad + (c % cols) * (child.width + pad),
                  y + header + pad + (c // cols) * (child.height + pad))

    top = len(topology.levels) - 1
    place(top, 0, 0.0, 0.0)
    return positions, boxes


def _children(topology: Topology, level: int) -> tuple[int, ...]:
    """Units of level - 1 in each unit of `level`."""
    if topology.children is not None:
        return topology.children[level]
    return (topology.levels[level].fan_out,) * topology.num_units(level)


def stage_colours(num_stages: int) -> list:
    if num_stages <= 10:
        return [colormaps["tab10"](i) for i in range(num_stages)]
    if num_stages <= 20:
        return [colormaps["tab20"](i) for i in range(num_stages)]
    return [colormaps["viridis"](i / (num_stages - 1)) for i in range(num_stages)]


def _runs(devices: list[int], fan0: int, cols0: int) -> list[tuple[int, int]]:
    """Consecutive devices on one row of one node, merged: (first, last) pairs."""
    runs: list[tuple[int, int]] = []
    for d in sorted(devices):
        if runs and d == runs[-1][1] + 1 and d // fan0 == runs[-1][0] // fan0 and (d % fan0) // cols0 == (runs[-1][0] % fan0) // cols0:
            runs[-1] = (runs[-1][0], d)
        else:
            runs.append((d, d))
    return runs


def draw(topology: Topology, *, stage_of_device: list[int], groups: list[GroupMark], title: str, path: Path) -> dict:
    """Every device (or the first MAX_DEVICES) as a square coloured by its pipeline stage (IDLE, FAILED),
    inside nested boxes per network level; `groups` outlined; write `path`."""
    total = len(stage_of_device)
    shown = total if total <= MAX_DEVICES else MAX_DEVICES
    positions, boxes = device_positions(topology, shown)
    level_names = [lv.name for lv in topology.levels]
    width = max(b[4] for b in boxes)
    height = max(b[5] for b in boxes)
    # Width: ~0.2 in per device column, the stage legend on the right; height: the drawing at the
    # same scale, the title above and one legend line per outlined group below.
    drawing_w = min(12.0, max(6.0, 0.2 * width))
    fig = new_figure(drawing_w + 1.6, min(18.0, drawing_w * height / width + 0.9 + 0.3 * len(groups)))
    ax = fig.add_subplot()
    ax.set_aspect("equal")
    ax.axis("off")

    unit_font = 7 if len(boxes) < 200 else 5
    host = topology.host_level
    first = np.concatenate(([0], np.cumsum(topology.unit_sizes(host))))  # first device of each host
    for level, index, x, y, w, h in boxes:
        # A host that runs nothing is filled: hatched grey when idle, cross-hatched red when it failed.
        stages = {stage_of_device[d] for d in range(first[index], min(first[index + 1], total))} if level == host else {0}
        state = "failed" if stages == {FAILED} else "idle" if max(stages) < 0 else ""
        name = topology.hosts[index] if topology.hosts and level == host else f"{level_names[level]} {index}"
        colour = "#A03030" if state == "failed" else "#606060"
        if level == 0:
            # inside a host of several level-0 units (host_level > 0), the host's fill shows through
            ax.add_patch(Rectangle((x, y), w, h, facecolor=HOST_FILL.get(state, "#FAFAFA" if host == 0 else "none"),
                                   edgecolor="#C04040" if state == "failed" else "#9A9A9A", linewidth=0.6,
                                   hatch=HOST_HATCH.get(state)))
            if len(boxes) <= 64:
                ax.text(x + w - 0.25, y + h / 2, name, fontsize=unit_font - 1, va="center", ha="center", color=colour,
                        rotation=90)
        else:
            ax.add_patch(Rectangle((x, y), w, h, facecolor=HOST_FILL.get(state, "none"), edgecolor="#505050",
                                   linewidth=0.6 + 0.5 * level, hatch=HOST_HATCH.get(state)))
            ax.text(x + 0.3, y + 0.25, name, fontsize=unit_font + level, va="top", ha="left",
                    color=colour if level == host else "#303030")
    num_stages = max(stage_of_device) + 1
    colours = stage_colours(num_stages)
    for d, (x, y) in enumerate(positions):
        stage = stage_of_device[d]
        face = colours[stage] if stage >= 0 else FAILED_COLOUR if stage == FAILED else "white"
        ax.add_patch(Rectangle((x, y), 1, 1, facecolor=face, edgecolor="#707070", linewidth=0.3))

    fan0, cols0 = topology.levels[0].fan_out, min(topology.levels[0].fan_out, 16)
    drawn_members = {}
    handles = []
    for mark in groups:
        colour, style, offset = OUTLINE[mark.kind]
        members = [d for d in mark.devices if d < shown]
        drawn_members[mark.kind] = len(members)
        for first, last in _runs(members, fan0, cols0):
            (x0, y0), (x1, _) = positions[first], positions[last]
            ax.add_patch(Rectangle((x0 - offset, y0 - offset), x1 - x0 + 1 + 2 * offset, 1 + 2 * offset,
                                   facecolor="none", edgecolor=colour, linestyle=style, linewidth=1.6))
        if mark.kind == "pp":
            for a, b in zip(members, members[1:]):
                (xa, ya), (xb, yb) = positions[a], positions[b]
                ax.annotate("", xy=(xb + 0.5, yb + 0.5), xytext=(xa + 0.5, ya + 0.5),
                            arrowprops={"arrowstyle": "-|>", "color": colour, "linewidth": 1.2,
                                        "connectionstyle": "arc3,rad=0.25", "shrinkA": 2, "shrinkB": 2})
        handles.append(Line2D([], [], color=colour, linestyle=style, linewidth=1.8, label=mark.label))
    if handles:
        fig.legend(handles=handles, loc="outside lower left", ncols=1, fontsize=10, frameon=False)
    handles = [Patch(facecolor=colours[s], edgecolor="#707070", label=f"stage {s}") for s in range(min(num_stages, 20))]
    if num_stages > 20:
        handles.append(Patch(facecolor="none", edgecolor="none", label=f"... stages 20-{num_stages - 1} (viridis)"))
    if IDLE in stage_of_device:
        handles.append(Patch(facecolor="white", edgecolor="#707070", label="idle"))
        handles.append(Patch(facecolor=HOST_FILL["idle"], edgecolor="#9A9A9A", hatch=HOST_HATCH["idle"], label="idle node"))
    if FAILED in stage_of_device:
        handles.append(Patch(facecolor=FAILED_COLOUR, edgecolor="#C04040", hatch=HOST_HATCH["failed"], label="failed node"))
    if shown < total:
        title += f"\n(showing the first {shown} of {total} devices)"
    ax.set_title(title, fontsize=12, loc="left")
    ax.set_xlim(-0.5, width + 0.5)
    ax.set_ylim(height + 0.5, -0.5)  # first unit at the top left
    fig.legend(handles=handles, loc="outside right upper", ncols=1, fontsize=9, frameon=False)
    save(fig, path)
    return {"devices_drawn": len(positions), "devices": total, "subset": shown < total, "group_members_drawn": drawn_members}
