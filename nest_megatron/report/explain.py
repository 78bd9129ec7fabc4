"""The explain report: one Plan made legible — its schedule, memory and placement, the plans it beat,
and the baselines beside it — as a self-contained index.html with the PNGs next to it.

`report_data` gathers the numbers, every one from the cost model (`cost.evaluate`,
`cost.schedule`) or from the Plan; `write_report` renders them (report/plots/) and writes the files.
Neither reads configs: the caller rebuilds the Problem (commands/explain.py) and runs the baselines.
"""

from __future__ import annotations

import base64
import html
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from nest_megatron.calibration.band import band, overlaps
from nest_megatron.cost.evaluate import Context, Estimate, after_pipeline, context, estimate_in, stage_parts
from nest_megatron.cost.problem import Problem
from nest_megatron.cost.schedule import Timeline, timeline
from nest_megatron.cost.tables import stage_sums
from nest_megatron.hardware.accelerator import GIB
from nest_megatron.hardware.topology import Topology
from nest_megatron.parallel.config import ParallelConfig
from nest_megatron.parallel.ranks import decoder_sizes, expert_sizes, rank_groups
from nest_megatron.parallel.rules import violation
from nest_megatron.plan import Plan
from nest_megatron.report.plots import memory, placement, prediction, schedule
from nest_megatron.report.plots.placement import FAILED, IDLE, GroupMark
from nest_megatron.report.table import configurations

SCHEDULE_TOLERANCE = 0.01  # the drawn iteration is within 1% of the predicted step time (cost/schedule.py)
GROUP_TOKENS = {"tp": "tp", "cp": "cp", "dp": "dp-cp", "ep": "ep", "pp": "pp"}  # kind -> rank_groups token


def plan_config(plan: Plan) -> ParallelConfig:
    """The ParallelConfig a Plan was priced with."""
    p, r = plan.parallel, plan.recompute
    recompute = r["granularity"] or "none"
    return ParallelConfig(tp=p["tp"], pp=p["pp"], dp=p["dp"], cp=p["cp"], ep=p["ep"], etp=p["etp"], vpp=p["vpp"],
                          sp=p["sp"], mbs=plan.micro_batch_size, zero=plan.zero_stage, recompute=recompute,
                          recompute_num_layers=r["num_layers"] if r["method"] == "block" else None,
                          order=plan.rank_order, cp_comm_type=p.get("cp_comm_type", "p2p"),
                          moe_a2a_overlap=p.get("moe_a2a_overlap", False),
                          distributed_optimizer_instances=p.get("distributed_optimizer_instances", 1),
                          cpu_offloading_num_layers=p.get("cpu_offloading_num_layers", 0),
                          microbatch_group_size_per_vp_stage=p.get("microbatch_group_size_per_vp_stage"))


SIZES = ("tp", "pp", "dp", "cp", "ep", "etp", "vpp")


def plan_mismatch(plan: Plan, problem: Problem) -> str | None:
    """Why `plan` (read from a file, maybe edited) cannot be the plan of `problem` (its overrides' problem), as
    one line: a field of the wrong type, a Megatron rule it breaks, or a value its problem contradicts. None
    when it can be explained."""
    p, r = plan.parallel, plan.recompute
    if not isinstance(p, dict) or not isinstance(r, dict):
        return "parallel and recompute: must be JSON objects, as `plan` writes them"
    for name in SIZES:
        if type(p.get(name)) is not int:
            return f"parallel.{name}={p.get(name)!r}: must be an integer"
    if not isinstance(p.get("sp"), bool):
        return f"parallel.sp={p.get('sp')!r}: must be true or false"
    for name in ("micro_batch_size", "global_batch_size", "zero_stage"):
        if type(getattr(plan, name)) is not int:
            return f"{name}={getattr(plan, name)!r}: must be an integer"
    for name in ("layers_per_stage", "rank_to_device"):
        values = getattr(plan, name)
        if not isinstance(values, list) or any(type(v) is not int for v in values):
            return f"{name}: must be a list of integers"
    if not isinstance(plan.rank_order, str) or set(r) != {"granularity", "method", "num_layers"}:
        return "rank_order and recompute: must be as `plan` writes them (a string; granularity, method, num_layers)"
    if plan.global_batch_size != problem.global_batch_size:
        return (f"the plan's global_batch_size={plan.global_batch_size}, but its overrides build "
                f"train.global_batch_size={problem.global_batch_size}")
    layers = problem.model.cfg.num_layers
    if sum(plan.layers_per_stage) != layers:
        return (f"the plan's layers_per_stage={plan.layers_per_stage} hold {sum(plan.layers_per_stage)} layers, but "
                f"its overrides build {problem.model.cfg.name} with model.num_layers={layers}")
    cfg = plan_config(plan)
    broken = violation(cfg, model=problem.model, num_devices=problem.num_devices,
                       global_batch_size=problem.global_batch_size, layers_per_stage=tuple(plan.layers_per_stage),
                       tp_comm_overlap=problem.tp_comm_overlap)
    if broken:
        return f"the plan breaks a Megatron rule: {broken}"
    mapping = plan.rank_to_device
    if len(mapping) != cfg.world or len(set(mapping)) != len(mapping) or not all(0 <= d < plan.num_devices for d in mapping):
        return (f"rank_to_device: must place the tp*cp*pp*dp = {cfg.world} ranks on distinct devices 0..{plan.num_devices - 1}"
                f" (it lists {len(mapping)})")
    return None


def plan_context(problem: Problem, plan: Plan) -> Context:
    return context(problem, plan_config(plan), rank_to_device=np.asarray(plan.rank_to_device, dtype=np.int64))


def describe(cfg: ParallelConfig) -> str:
    text = f"TP {cfg.tp} · PP {cfg.pp} · DP {cfg.dp}"
    text += "".join(f" · {k.upper()} {v}" for k, v in (("cp", cfg.cp), ("ep", cfg.ep), ("vpp", cfg.vpp)) if v > 1)
    text += " · all-to-alls overlapped" if cfg.moe_a2a_overlap else ""  # --overlap-moe-expert-parallel-comm
    text += f" · mbs {cfg.mbs} · ZeRO {cfg.zero} · recompute {cfg.recompute}"
    offloaded = cfg.cpu_offloading_num_layers  # --cpu-offloading-num-layers
    return text + (f" · {offloaded} layers' activations in host memory" if offloaded else "")


def runner_config(r: dict) -> ParallelConfig:
    """A runner-up's configuration, as far as `describe` tells it."""
    keys = r.get("plan", {})
    return ParallelConfig(tp=r["tp"], pp=r["pp"], dp=r["dp"], cp=r["cp"], ep=r["ep"], vpp=r["vpp"], mbs=r["mbs"],
                          zero=r["zero"], recompute=r["recompute"], order=r["order"],
                          moe_a2a_overlap=keys.get("moe_a2a_overlap", False),
                          cpu_offloading_num_layers=keys.get("cpu_offloading_num_layers", 0))


def runner_up_rows(plan: Plan) -> list[dict]:
    """plan.runners_up with why each lost: slower by x% (fits) or does not fit by y GiB."""
    best, capacity = plan.predicted["step_time_s"], plan.predicted["capacity_gib"]
    rows = []
    for r in plan.runners_up:
        if r["fits"]:
            why = f"slower by {100 * (r['step_time_s'] / best - 1):.1f}%"
            if r.get("tied_within_error"):
                why = f"tied within the model's error ({why})"
        elif r.get("shortfall"):
            why = f"does not fit: {r['shortfall']}"
        else:  # a plan written before runners-up carried their shortfall
            why = f"does not fit by {r['peak_memory_gib'] - capacity:.1f} GiB"
        rows.append({"config": runner_describe(r), "order": r["order"], "step_time_s": r["step_time_s"],
                     "peak_memory_gib": r["peak_memory_gib"], "why": why})
    return rows


def comparison_rows(plan: Plan, cfg: ParallelConfig, baselines: dict[str, Estimate | None]) -> list[dict]:
    """The plan and each baseline (None: it found nothing that fits), with the plan's speed-up over it."""
    pred = plan.predicted
    rows = [{"name": "this plan", "config": describe(cfg), "step_time_s": pred["step_time_s"],
             "tokens_per_s": pred["tokens_per_s"], "mfu": pred["mfu"], "peak_memory_gib": pred["peak_memory_gib"],
             "speedup": 1.0}]
    for name, est in baselines.items():
        if est is None:
            rows.append({"name": name, "config": "nothing that fits", "step_time_s": None})
            continue
        rows.append({"name": name, "config": describe(est.config), "step_time_s": est.step_time,
                     "tokens_per_s": est.tokens_per_s, "mfu": est.mfu, "peak_memory_gib": est.peak_memory / GIB,
                     "speedup": est.step_time / pred["step_time_s"]})
    return rows


def exposed_time_per_group(ctx: Context, split: tuple[int, ...]) -> dict[str, float]:
    """Seconds per iteration each kind of group keeps the slowest-communicating rank busy, as the
    cost model charges them: m x the per-micro-batch parts, plus the data-parallel sync after the
    pipeline (ZeRO 2/3 traffic runs on the data-parallel group)."""
    m, cfg = ctx.num_microbatches, ctx.cfg
    out = {k: 0.0 for k in GROUP_TOKENS}
    for s in range(cfg.pp):
        sums = stage_sums(ctx.costs, cfg, split, s)
        parts = stage_parts(ctx, sums, stage=s)
        after = after_pipeline(ctx, sums, first=s == 0, last=s == cfg.pp - 1)
        dp = after["dp_grad_sync"] + after["dp_param_gather"] + m * parts["zero_comm"]
        for kind, seconds in (("tp", m * parts["tp_comm"]), ("cp", m * parts["cp_comm"]),
                              ("ep", m * parts["ep_comm"]), ("pp", m * parts["pp_p2p"]), ("dp", dp)):
            out[kind] = max(out[kind], float(seconds))
    return out


def _seconds(value: float) -> str:
    return f"{value:.3g} s" if value >= 1 else f"{value * 1e3:.3g} ms" if value >= 1e-3 else f"{value * 1e6:.3g} µs"


def placement_marks(plan: Plan, cfg: ParallelConfig, exposed: dict[str, float]) -> tuple[list[int], list[GroupMark]]:
    """Each device's pipeline stage (IDLE when it runs nothing) and the group of each kind that holds rank 0."""
    mapping = np.asarray(plan.rank_to_device, dtype=np.int64)
    stage_of_device = np.full(plan.num_devices, IDLE, dtype=int)
    for stage, ranks in enumerate(rank_groups(cfg.order, decoder_sizes(cfg), "pp").T):
        stage_of_device[mapping[ranks]] = stage
    marks = []
    for kind, token in GROUP_TOKENS.items():
        sizes = expert_sizes(cfg) if kind == "ep" else decoder_sizes(cfg)
        group = rank_groups(cfg.order, sizes, token)[0]
        if len(group) == 1:
            continue
        level = plan.group_levels.get(kind)
        where = f"over the {level} level" if level else "inside one device"
        # The data-parallel group outlined is Megatron's dp-cp group: with context parallel it spans both.
        name = "DP x CP" if kind == "dp" and cfg.cp > 1 else kind.upper()
        marks.append(GroupMark(kind, tuple(int(d) for d in mapping[group]),
                               f"{name} group of {len(group)} (rank 0's): {where}, "
                               + (f"{_seconds(exposed[kind])}/iteration exposed" if exposed[kind] > 0
                                  else "hidden behind compute")))
    return stage_of_device.tolist(), marks


def on_allocation(topology: Topology, stage_of_device: list[int],
                  groups: list[GroupMark]) -> tuple[Topology, list[int], list[GroupMark]]:
    """The placement moved onto the whole allocation when nodes failed (cluster.failed_nodes): each device to
    its host's place in the allocation's tree, the failed nodes' devices marked FAILED."""
    whole = topology.allocation
    if whole is None:
        return topology, stage_of_device, groups
    per = topology.devices_per_node
    place_of = {host: i for i, host in enumerate(whole.hosts)}
    moved = [place_of[topology.hosts[d // per]] * per + d % per for d in range(len(stage_of_device))]
    stages = [FAILED] * whole.num_devices
    for device, stage in zip(moved, stage_of_device):
        stages[device] = stage
    return whole, stages, [replace(g, devices=tuple(moved[d] for d in g.devices)) for g in groups]


PREDICTION_ROWS = 8  # runners-up drawn beside the plan in the prediction figure


def prediction_rows(plan: Plan, cfg: ParallelConfig, baselines: dict[str, Estimate | None]) -> list[dict]:
    """The plan, its runners-up that fit and the baselines, each with the band of its step time by the plan's
    calibration (calibration/band.py) and whether it is tied with the plan within it."""
    errors = (plan.calibration or {}).get("errors") or ()
    best = plan.predicted["step_time_s"]

    def row(name: str, step: float) -> dict:
        return {"name": name, "step_time_s": step, "band_s": band(step, errors), "tied": overlaps(step, best, errors)}

    rows = [dict(row(f"this plan: {describe(cfg)}", best), tied=False)]
    for r in [r for r in plan.runners_up if r["fits"]][:PREDICTION_ROWS]:
        rows.append(row(f"runner-up: {runner_describe(r)}", r["step_time_s"]))
    for name, est in baselines.items():
        if est is not None:
            rows.append(row(f"{name}: {describe(est.config)}", est.step_time))
    return rows


def runner_describe(r: dict) -> str:
    return describe(runner_config(r))


@dataclass(frozen=True)
class ReportData:
    plan: Plan
    topology: Topology  # what the placement is drawn on: the whole allocation, failed nodes included
    estimate: Estimate  # the plan re-priced from its problem
    timeline: Timeline
    stage_of_device: list[int]
    groups: list[GroupMark]
    runners_up: list[dict]
    comparison: list[dict]
    prediction: list[dict] = ()  # prediction_rows
    # What a run of this plan measured (its run directory's logs): {"step_s", "source", "iterations"}; None: no run
    measured: dict | None = None


def report_data(problem: Problem, plan: Plan, *, baselines: dict[str, Estimate | None],
                measured: dict | None = None) -> ReportData:
    ctx = plan_context(problem, plan)
    split = tuple(plan.layers_per_stage)
    drawn_on, stage_of_device, groups = on_allocation(
        problem.topology, *placement_marks(plan, ctx.cfg, exposed_time_per_group(ctx, split)))
    return ReportData(plan=plan, topology=drawn_on, estimate=estimate_in(ctx, split),
                      timeline=timeline(ctx, split), stage_of_device=stage_of_device, groups=groups,
                      runners_up=runner_up_rows(plan), comparison=comparison_rows(plan, ctx.cfg, baselines),
                      prediction=prediction_rows(plan, ctx.cfg, baselines), measured=measured)


# --- rendering -------------------------------------------------------------------------------------------

FIGURES = ("prediction.png", "schedule.png", "memory.png", "placement.png")


def draw_figures(data: ReportData, out: Path, *, step: Callable[[str], None] = lambda name: None) -> dict[str, dict]:
    """The three PNGs under `out`; what each drew (plots/*.draw's return), by file name."""
    plan, pred = data.plan, data.plan.predicted
    p = plan.parallel
    step("prediction figure")
    calibration = (plan.calibration or {}).get("summary") or "no calibration recorded: no band"
    drawn = {"prediction.png": prediction.draw(
        list(data.prediction), measured_s=data.measured["step_s"] if data.measured else None,
        path=out / "prediction.png",
        title=f"Predicted step time, with the model's error band\n{calibration}")}
    step("schedule figure")
    drawn |= {"schedule.png": schedule.draw(
        data.timeline, step_time=pred["step_time_s"], path=out / "schedule.png",
        title=f"One iteration, {data.timeline.schedule}: {plan.num_microbatches} micro-batches on {p['pp']} "
              + ("stage" if p["pp"] == 1 else "stages") + (f" x {p['vpp']} virtual" if p["vpp"] > 1 else ""))}
    step("memory figure")
    drawn["memory.png"] = memory.draw(pred["memory_breakdown_gib"], capacity_gib=pred["capacity_gib"],
                                      path=out / "memory.png",
                                      title=f"Memory per device of each stage (ZeRO {plan.zero_stage}, "
                                            f"recompute {plan.recompute['granularity'] or 'none'})")
    step("placement figure")
    drawn["placement.png"] = placement.draw(data.topology, stage_of_device=data.stage_of_device, groups=data.groups,
                                            path=out / "placement.png",
                                            title=f"Placement on {plan.cluster}: {plan.num_devices} devices, "
                                                  f"coloured by pipeline stage"
                                                  + (f"\n{len(plan.failed_hosts)} failed node(s) planned around"
                                                     if plan.failed_hosts else ""))
    return drawn


def _table(headers: list[str] | None, rows: list[list[str]]) -> str:
    head = "<thead><tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in headers) + "</tr></thead>" if headers else ""
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table>{head}<tbody>{body}</tbody></table>"


def _image(out: Path, name: str, alt: str) -> str:
    encoded = base64.b64encode((out / name).read_bytes()).decode("ascii")
    return f'<figure><img src="data:image/png;base64,{encoded}" alt="{html.escape(alt)}"></figure>'


STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1300px; color: #222; padding: 0 1em; }
h1 { font-size: 1.5em; } h2 { font-size: 1.2em; margin-top: 2em; border-bottom: 1px solid #ddd; }
table { border-collapse: collapse; margin: 0.5em 0; font-size: 0.9em; }
th, td { border: 1px solid #ccc; padding: 0.25em 0.6em; text-align: left; } th { background: #f2f2f2; }
td.num { text-align: right; } figure { margin: 0.5em 0; } img { max-width: 100%; height: auto; }
p.note { color: #555; font-size: 0.9em; } pre { white-space: pre-wrap; background: #f7f7f7; padding: 0.6em; }
"""


def _band_text(plan: Plan) -> str:
    band_s = (plan.calibration or {}).get("step_time_band_s")
    return f" ({band_s[0]:.4g}-{band_s[1]:.4g} s)" if band_s else ""


def render_html(data: ReportData, out: Path) -> str:
    plan, pred, p = data.plan, data.plan.predicted, data.plan.parallel
    summary = [
        ["parallel", describe(plan_config(plan))],
        ["batch", f"micro {plan.micro_batch_size} x {plan.num_microbatches} micro-batches x DP {p['dp']} "
                  f"= global {plan.global_batch_size}"],
        ["layers per stage", " ".join(map(str, plan.layers_per_stage))],
        ["groups cross", ", ".join(f"{k}: {v}" for k, v in plan.group_levels.items() if v) or "nothing (one device)"],
        ["predicted step", f"{pred['step_time_s']:.4g} s{_band_text(plan)}, {pred['tokens_per_s']:,.0f} tokens/s, "
                           f"{pred['tflops_per_gpu']:.0f} TFLOP/s per GPU, MFU {pred['mfu']:.1%}"],
        ["calibration", (plan.calibration or {}).get("summary") or "not recorded (a plan written before calibrations)"],
        ["peak memory", f"{pred['peak_memory_gib']:.1f} of {pred['capacity_gib']:.1f} GiB"
                        + (f"; pinned host memory {pred['host_memory_gib']:.1f} of {pred['host_capacity_gib']:.1f} GiB"
                           if "host_memory_gib" in pred else "")],
        ["search", f"{plan.search['solver']}: {configurations(plan.search['configs_evaluated'])} in "
                   f"{plan.search['time_s']:.2f} s"],
    ]
    if data.measured:
        m = data.measured
        summary.insert(6, ["measured step", f"{m['step_s']:.4g} s ({m['step_s'] / pred['step_time_s'] - 1:+.1%} "
                                            f"of the prediction: median of {m['iterations']} logged intervals in "
                                            f"{m['source']})"])
    if plan.idle_devices or plan.failed_hosts:
        summary.insert(1, ["allocation", f"{plan.num_devices - plan.idle_devices} of the {plan.num_devices} working "
                                         f"devices run ranks, {plan.idle_devices} idle"
                                         + (f"; failed nodes, planned around: {', '.join(plan.failed_hosts)}"
                                            if plan.failed_hosts else "")])
    tl = data.timeline
    drift = tl.length / pred["step_time_s"] - 1
    runners = [[r["config"], r["order"], f"{r['step_time_s']:.4g}", f"{r['peak_memory_gib']:.1f}", r["why"]]
               for r in data.runners_up]
    compare = []
    for r in data.comparison:
        if r["step_time_s"] is None:
            compare.append([r["name"], r["config"], "-", "-", "-", "-", "-"])
            continue
        compare.append([r["name"], r["config"], f"{r['step_time_s']:.4g}", f"{r['tokens_per_s']:,.0f}", f"{r['mfu']:.1%}",
                        f"{r['peak_memory_gib']:.1f}", f"{r['speedup']:.2f}x" if r["name"] != "this plan" else ""])
    schedule_note = (f"Durations from the cost model; every stage runs at the slowest stage's pace, as the cost model "
                     f"charges it. The drawn iteration is {_seconds(tl.length)}, the predicted step "
                     f"{_seconds(pred['step_time_s'])} ({drift:+.2%}).")
    if p["vpp"] > 1:
        schedule_note += f" Interleaved schedule: each rank holds {p['vpp']} model chunks; bars are chunk passes."
    parts = [
        f"<h1>nest-megatron plan: {html.escape(plan.model)} on {plan.num_devices} x {html.escape(plan.accelerator)} "
        f"({html.escape(plan.cluster)})</h1>",
        _table(None, summary),
        "<h2>Predicted step time and the model's error</h2>",
        _image(out, "prediction.png", "predicted step time of the plan, runners-up and baselines with error bands"),
        '<p class="note">Each whisker is the band the calibration\'s cross-validated errors give that prediction '
        "(the 5th to the 95th percentile of predicted / measured on runs it was not fitted to); a runner-up whose "
        "band reaches the plan's is tied with it within the model's error.</p>",
        "<h2>Pipeline schedule of one iteration</h2>",
        _image(out, "schedule.png", "pipeline schedule timeline per stage"),
        f'<p class="note">{html.escape(schedule_note)}</p>',
        "<h2>Memory per stage</h2>",
        _image(out, "memory.png", "memory per pipeline stage, stacked, against device capacity"),
        "<h2>Placement on the topology</h2>",
        _image(out, "placement.png", "devices by network level, coloured by pipeline stage"),
        '<p class="note">One group of each kind (the one holding rank 0) is outlined; its label gives the highest '
        "network level it crosses and the communication time per iteration the cost model leaves exposed on the "
        "critical path (the cost model prices time, not bytes).</p>",
        "<h2>Plans the solver also considered</h2>",
        _table(["configuration", "rank order", "step (s)", "peak GiB", "why it lost"], runners)
        if runners else "<p>The plan records no runners-up.</p>",
        "<h2>Against the baselines</h2>",
        _table(["", "configuration", "step (s)", "tokens/s", "MFU", "peak GiB", "this plan is faster by"], compare),
        '<p class="note">Manual: Megatron / NeMo recipe habits (solver/baselines.py manual). Flat network: the same '
        "search believing every link is as fast as NVLink (Phaze's view), its choice re-priced on the real network."
        "</p>",
        "<h2>Megatron arguments</h2>",
        f"<pre>{html.escape(' '.join(plan.megatron_args))}</pre>",
    ]
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>nest-megatron: '
            f"{html.escape(plan.model)} on {plan.num_devices} devices</title><style>{STYLE}</style></head>\n<body>\n"
            + "\n".join(parts) + "\n</body></html>\n")


def write_report(data: ReportData, out: Path, *,
                 step: Callable[[str], None] = lambda name: None) -> tuple[Path, dict[str, dict]]:
    """Write the PNGs and index.html (the PNGs embedded) under `out`; return index.html's path and
    what each figure drew."""
    out.mkdir(parents=True, exist_ok=True)
    drawn = draw_figures(data, out, step=step)
    step("HTML")
    index = out / "index.html"
    tmp = index.with_name(index.name + ".tmp")
    tmp.write_text(render_html(data, out), encoding="utf-8")
    tmp.replace(index)
    return index, drawn
