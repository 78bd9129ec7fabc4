"""The plan as a terminal table (rich)."""

from __future__ import annotations

import os
import shlex

from rich.console import Console
from rich.measure import Measurement
from rich.table import Table

from nest_megatron.plan import Plan


def configurations(count: int) -> str:
    return f"{count} configuration{'' if count == 1 else 's'}"


def fits_console(console: Console) -> bool:
    """Whether tables are fitted to the console's width: on a terminal, or piped with COLUMNS set (the README's
    outputs are rendered at COLUMNS=100); otherwise they are as wide as they need (no headers cut to "weigh…")."""
    return console.is_terminal or bool(os.environ.get("COLUMNS"))


def print_table(console: Console, table: Table) -> None:
    """Fitted to the console's width where `fits_console`, else as wide as the table needs."""
    if fits_console(console):
        console.print(table)
        return
    width = console.width  # print's own width= is capped at the console's
    console.width = Measurement.get(console, console.options.update_width(10_000), table).maximum
    try:
        console.print(table)
    finally:
        console.width = width


def band_text(band: list[float], unit: str = "s", scale: float = 1.0) -> str:
    """`14.1-16.9 s`: a step time's band (in `unit`, seconds / `scale`)."""
    return f"{band[0] / scale:.3g}-{band[1] / scale:.3g} {unit}"


def step_time(plan: Plan) -> str:
    """`15.400 s (14.1-16.9 s)`: the predicted step time and the band its calibration's errors give it."""
    step = plan.predicted["step_time_s"]
    band = (plan.calibration or {}).get("step_time_band_s")
    return f"{step:.3f} s" + (f" ({band_text(band)})" if band else "")


def calibration_line(plan: Plan) -> str:
    """`predicted 15.400 s (14.1-16.9 s) a step; shipped H100 calibration: ...`: the band and the calibration that
    priced the plan, for the commands whose output is not the plan's table (launch, sweep, nemo, bridge, sbatch)."""
    return f"predicted {step_time(plan)} a step; {plan.calibration['summary']}"


def expert_parallel(row: dict) -> str:
    """A runner-up's EP and whether it overlaps the EP all-to-alls, as the tied line shows them ('' at EP 1)."""
    if row["ep"] == 1:
        return ""
    return f"EP {row['ep']}{' overlapped' if row['plan'].get('moe_a2a_overlap') else ''} "


def host_offload(row: dict) -> str:
    """A runner-up's offloaded layers, as the tied line shows them ('' without)."""
    offloaded = row["plan"].get("cpu_offloading_num_layers")  # --cpu-offloading-num-layers
    return f" {offloaded} layers offloaded" if offloaded else ""


def render(plan: Plan, console: Console, *, megatron_args: list[str] | None = None) -> None:
    """The plan's tables and its Megatron arguments: `megatron_args` where a launch ran them through the user's argv
    (launch/prepare.py Prepared.script_args, the argv every node's command runs), else the plan's own."""
    p, pred = plan.parallel, plan.predicted
    command = "evaluate" if plan.search["solver"] == "evaluate" else "plan"  # a scored choice, or a search
    head = Table(title=f"nest-megatron {command}: {plan.model} on {plan.num_devices} x {plan.accelerator} "
                       f"({plan.cluster})", show_header=False)
    head.add_column("what", style="bold")
    head.add_column("value")
    cp_exchange = f" ({p['cp_comm_type']})" if p["cp"] > 1 and "cp_comm_type" in p else ""  # --cp-comm-type
    a2a_overlap = " (all-to-alls overlapped)" if p.get("moe_a2a_overlap") else ""  # --overlap-moe-expert-parallel-comm
    head.add_row("parallel", f"TP {p['tp']}  PP {p['pp']}  DP {p['dp']}  CP {p['cp']}{cp_exchange}  EP {p['ep']}{a2a_overlap}  "
                             f"ETP {p['etp']}  VPP {p['vpp']}  SP {'on' if p['sp'] else 'off'}")
    group = p.get("microbatch_group_size_per_vp_stage") if p["vpp"] > 1 else None  # read with virtual stages
    head.add_row("batch", f"micro {plan.micro_batch_size} x {plan.num_microbatches} micro-batches x DP {p['dp']} "
                          f"= global {plan.global_batch_size}"
                 + (f"  (interleaved {group} at a time per model chunk)" if group else ""))
    instances = p.get("distributed_optimizer_instances", 1)  # --num-distributed-optimizer-instances
    offloaded = p.get("cpu_offloading_num_layers", 0)  # --cpu-offloading-num-layers
    head.add_row("ZeRO / recompute", f"stage {plan.zero_stage}" + (f" in {instances} instances" if instances > 1 else "")
                 + f"  /  {plan.recompute['granularity'] or 'none'}"
                 + (f" ({plan.recompute['method']}, {plan.recompute['num_layers']} layers)" if plan.recompute['method'] else "")
                 + (f"  /  {offloaded} layers' activations in host memory" if offloaded else "")
                 + (f" ({plan.predicted['host_memory_gib']:.1f} of {plan.predicted['host_capacity_gib']:.1f} GiB pinned)"
                    if "host_memory_gib" in plan.predicted else ""))
    head.add_row("layers per stage", " ".join(map(str, plan.layers_per_stage)))
    if plan.vocabulary:
        v = plan.vocabulary
        # the flag that fixes the rows when the plan's argv has it; a launch's argv may leave Megatron to pad them
        flag = " (--padded-vocab-size)" if "--padded-vocab-size" in plan.megatron_args else ""
        head.add_row("vocabulary", f"{v['entries']:,} tokenizer entries in {v['padded_rows']:,} embedding rows{flag}")
    node_order = "torchrun's" if plan.rank_to_device == sorted(plan.rank_to_device) else "permuted (see rank_to_device)"
    head.add_row("placement", f"{plan.rank_order}, node order {node_order}   groups cross: "
                 + ", ".join(f"{k}={v}" for k, v in plan.group_levels.items() if v))
    head.add_row("step time", f"{step_time(plan)}   {pred['tokens_per_s']:,.0f} tokens/s   "
                              f"{pred['tflops_per_gpu']:.0f} TFLOP/s/GPU   MFU {pred['mfu']:.1%}")
    if plan.calibration:
        head.add_row("calibration", plan.calibration["summary"])
    tied = [r for r in plan.runners_up if r.get("tied_within_error")]
    if tied:
        head.add_row("tied", f"{len(tied)} runner(s)-up within the model's error: "
                             + "; ".join(f"TP {r['tp']} PP {r['pp']} DP {r['dp']} {expert_parallel(r)}mbs {r['mbs']} "
                                         f"ZeRO {r['zero']} {r['recompute']}{host_offload(r)}, {r['step_time_s']:.3f} s"
                                         for r in tied[:3])
                             + ("; ..." if len(tied) > 3 else ""))
    if plan.idle_devices:
        head.add_row("idle devices", str(plan.idle_devices))
    if plan.failed_hosts:
        head.add_row("failed nodes", f"{len(plan.failed_hosts)}, planned around: {', '.join(plan.failed_hosts)}")
    head.add_row("search", f"{plan.search['solver']}: {configurations(plan.search['configs_evaluated'])} in "
                           f"{plan.search['time_s']:.2f} s")
    if "compute" in plan.search:
        head.add_row("compute model", plan.search["compute"])
    print_table(console, head)

    mem = Table(title="memory per pipeline stage (GiB)")
    keys = list(pred["memory_breakdown_gib"][0])
    for col in ["stage", *keys, "total", "capacity"]:
        mem.add_column(col, justify="right")
    for i, stage in enumerate(pred["memory_breakdown_gib"]):
        total = pred["memory_per_stage_gib"][i]
        style = "red" if total > pred["capacity_gib"] else None
        mem.add_row(str(i), *(f"{stage[k]:.1f}" for k in keys), f"{total:.1f}", f"{pred['capacity_gib']:.1f}", style=style)
    print_table(console, mem)

    time_table = Table(title="step time breakdown (s)")
    time_table.add_column("part")
    time_table.add_column("seconds", justify="right")
    for k, v in pred["breakdown"].items():
        if v > 0:
            time_table.add_row(k, f"{v:.3f}")
    print_table(console, time_table)
    console.print("[bold]Megatron arguments:[/bold]")
    console.print(shlex.join(plan.megatron_args if megatron_args is None else megatron_args), soft_wrap=True,
                  highlight=False)
