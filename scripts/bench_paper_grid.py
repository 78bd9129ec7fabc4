"""The NEST paper's evaluation grid under this repository's one cost model: the planner against the
baselines (nest_megatron/solver/baselines.py), all scored by `cost.evaluate.estimate`.

    python scripts/bench_paper_grid.py [--solver dp|enumerate] [--models M ...] [--devices N ...]
                                       [--clusters C ...] [--mbs-sweep] [--budget 200] [--out DIR]
    python scripts/bench_paper_grid.py --scale [--scale-model llama3_70b] [--scale-devices 4096 16384 65536]

Grid: bert_large, llama2_7b, llama3_70b, gpt3_175b, mixtral_8x7b x 64..1024 devices x
h100_spine_leaf, tpuv4_fat_tree, global batch 4096, micro-batch 1 (--mbs-sweep: 1, 2, 4, 8).
For every cell: the planner's predicted tokens/s, every baseline's, the ratio planner / baseline,
search wall time and configurations evaluated, and the baselines skipped with the reason. Writes
Markdown and JSON to --out, named with the date and the machine.

--scale plans one model on h100_spine_leaf at 4,096 / 16,384 / 65,536 devices, each search in a
fresh process, and prints its wall time and peak resident memory.

The numbers are the cost model's predictions, not measurements; compare ratios, not absolutes.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import multiprocessing
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from nest_megatron.config.load import load
from nest_megatron.cost.evaluate import Estimate
from nest_megatron.plan import Plan, build_plan, summary
from nest_megatron.solver import baselines as bl
from nest_megatron.solver.registry import SOLVERS

MODELS = ["bert_large", "llama2_7b", "llama3_70b", "gpt3_175b", "mixtral_8x7b"]
DEVICES = [64, 128, 256, 512, 1024]
CLUSTERS = ["h100_spine_leaf", "tpuv4_fat_tree"]
GLOBAL_BATCH = 4096
MBS_SWEEP = [1, 2, 4, 8]
SCALE_DEVICES = [4096, 16384, 65536]
# Columns of the Markdown table, in order: the baselines' names in a cell record.
BASELINE_COLUMNS = ["manual", "paper:Manual", "paper:MCMC", "paper:Phaze", "flat_network", "annealing", "mcmc"]


def machine() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"node": platform.node(), "cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(),
            "platform": platform.platform()}


def config_text(est: Estimate | None) -> str:
    if est is None:
        return "-"
    c = est.config
    parts = [f"tp{c.tp}", f"pp{c.pp}", f"dp{c.dp}"]
    parts += [f"{k}{getattr(c, k)}" for k in ("cp", "ep", "vpp") if getattr(c, k) > 1]
    parts += [f"mbs{c.mbs}", f"z{c.zero}"]
    if c.recompute != "none":
        parts.append(c.recompute[:3])
    if c.order != "tp-cp-ep-dp-pp":
        parts.append("pp-dp")
    if len(set(est.layers_per_stage)) > 1:
        parts.append("split " + "/".join(map(str, est.layers_per_stage)))
    if est.idle_devices:
        parts.append(f"idle {est.idle_devices}")
    return " ".join(parts)


def baseline_plan(problem, est: Estimate, *, name: str, model_name: str, cluster_name: str, time_s: float = 0.0,
                  configs_evaluated: int = 1) -> Plan:
    """A baseline's configuration as a Plan, `search.solver` naming the baseline."""
    return build_plan(problem, est, model_name=model_name, cluster_name=cluster_name,
                      search=bl.search_record(name, time_s=time_s, configs_evaluated=configs_evaluated))


def _entry(problem, name: str, est: Estimate | None, planner: Estimate | None, *, time_s: float, configs: int,
           skipped: str | None = None) -> dict:
    out = {"name": name, "time_s": time_s, "configs_evaluated": configs, "skipped": skipped}
    if est is None:
        out.update(tokens_per_s=None, step_time_s=None, ratio=None, config=None, config_text="-")
        out["skipped"] = skipped or "nothing fits"
        return out
    out.update(tokens_per_s=est.tokens_per_s, step_time_s=est.step_time, mfu=est.mfu,
               ratio=(planner.tokens_per_s / est.tokens_per_s) if planner is not None else None,
               config=summary(problem, est), config_text=config_text(est))
    return out


def run_cell(model: str, cluster: str, num_devices: int, *, solver: str | None = None, mbs: int = 1,
             global_batch_size: int = GLOBAL_BATCH, budget: int = 200, seed: int = 0, overrides: list[str] = (),
             plans_dir: Path | None = None) -> dict:
    """Plan one cell with `solver` and score every baseline on it; a JSON-ready record."""
    solver = solver or "dp"
    loaded = load([f"model={model}", f"cluster={cluster}", f"cluster.num_devices={num_devices}",
                   f"train.global_batch_size={global_batch_size}", f"train.micro_batch_size={mbs}", *overrides])
    problem, cfg = loaded.problem, loaded.config
    solve = SOLVERS[solver]

    start = time.perf_counter()
    result = solve(problem, cfg.solver, cfg.plan, micro_batch_size=mbs)
    wall = time.perf_counter() - start
    best = result.best
    record = {
        "model": model, "cluster": cluster, "num_devices": num_devices, "mbs": mbs,
        "global_batch_size": global_batch_size, "solver": solver,
        "planner": {
            "tokens_per_s": best.tokens_per_s if best else None,
            "step_time_s": best.step_time if best else None,
            "mfu": best.mfu if best else None,
            "time_s": wall,
            "configs_evaluated": result.configs_evaluated,
            "configs_in_space": getattr(result, "configs_in_space", None),
            "config": summary(problem, best) if best else None,
            "layers_per_stage": list(best.layers_per_stage) if best else None,
            "config_text": config_text(best),
        },
        "baselines": [],
    }
    plans: dict[str, Plan] = {}
    if best is not None:
        plans[solver] = build_plan(problem, best, model_name=model, cluster_name=cluster,
                                   search=bl.search_record(solver, time_s=wall, configs_evaluated=result.configs_evaluated))

    def add(name: str, est: Estimate | None, *, time_s: float, configs: int, skipped: str | None = None):
        record["baselines"].append(_entry(problem, name, est, best, time_s=time_s, configs=configs, skipped=skipped))
        if est is not None:
            plans[name] = baseline_plan(problem, est, name=name, model_name=model, cluster_name=cluster,
                                        time_s=time_s, configs_evaluated=configs)

    tried = bl.manual_candidates(problem)
    est, t = bl.timed(bl.manual, problem)
    add("manual", est, time_s=t, configs=(tried.index(est.config) + 1) if est else len(tried),
        skipped=None if est else f"none of the {len(tried)} recipe configurations fits")

    start = time.perf_counter()
    entries = bl.paper(problem, cluster_name=cluster, model_name=model, num_devices=num_devices, micro_batch_size=mbs)
    t = time.perf_counter() - start
    if not entries:
        record["paper_note"] = "the paper's grid has no baseline entries for this cell"
    for name, est, reason in entries:
        add(f"paper:{name}", est, time_s=t / len(entries), configs=0 if reason and est is None else 1, skipped=reason)

    flat, t = bl.timed(bl.flat_network_search, problem, solve, solver_cfg=cfg.solver, pins=cfg.plan, micro_batch_size=mbs)
    add("flat_network", flat.best, time_s=t, configs=flat.search.configs_evaluated,
        skipped=None if flat.best else "the flat-network search found nothing that fits")

    for name in ("annealing", "mcmc"):
        walk, t = bl.timed(bl.BASELINES[name], problem, budget=budget, seed=seed, solver_cfg=cfg.solver,
                           micro_batch_size=mbs)
        add(name, walk.best, time_s=t, configs=walk.evaluations,
            skipped=None if walk.best else f"nothing that fits in {walk.evaluations} evaluations")

    if plans_dir is not None:
        plans_dir.mkdir(parents=True, exist_ok=True)
        for name, plan in plans.items():
            safe = name.replace(":", "_")
            (plans_dir / f"{model}_{cluster}_{num_devices}_mbs{mbs}_{safe}.json").write_text(plan.to_json())
    return record


# --- output ------------------------------------------------------------------------------------------------

def _ratio_cell(entry: dict | None) -> str:
    if entry is None:
        return ""
    if entry["tokens_per_s"] is None:
        return "skip"
    if entry["ratio"] is None:
        return f"({entry['tokens_per_s']:.3g} tok/s)"
    return f"{entry['ratio']:.3f}x"


def markdown(records: list[dict], meta: dict) -> str:
    m = meta["machine"]
    lines = [
        "# NEST paper grid under one cost model",
        "",
        f"- date: {meta['date']}; machine: {m['node']}, {m['cpu']}, {m['cores']} cores, Python {m['python']}",
        f"- planner: `{meta['solver']}`; global batch {meta['global_batch_size']}; micro-batch "
        f"{', '.join(map(str, meta['mbs']))}; annealing / mcmc budget {meta['budget']} evaluations, seed {meta['seed']}",
        f"- total wall time {meta['wall_s']:.1f} s, of which the planner's searches {meta['planner_search_s']:.1f} s",
        "",
        "Columns after the planner: planner tokens/s divided by the baseline's (above 1: the planner is faster); "
        "`skip`: not launchable or does not fit (reasons below); empty: no such entry in the paper's grid.",
        "",
        "| model | cluster | devices | mbs | planner tok/s | planner config | search s | configs | "
        + " | ".join(BASELINE_COLUMNS) + " |",
        "|" + "---|" * (8 + len(BASELINE_COLUMNS)),
    ]
    for r in records:
        p = r["planner"]
        by_name = {b["name"]: b for b in r["baselines"]}
        tok = f"{p['tokens_per_s']:.4g}" if p["tokens_per_s"] else "nothing fits"
        lines.append(
            f"| {r['model']} | {r['cluster']} | {r['num_devices']} | {r['mbs']} | {tok} | {p['config_text']} | "
            f"{p['time_s']:.2f} | {p['configs_evaluated']} | "
            + " | ".join(_ratio_cell(by_name.get(c)) for c in BASELINE_COLUMNS) + " |"
        )
    lines += ["", "## Baseline configurations and search cost", "",
              "| cell | baseline | tok/s | config | time s | evaluations |", "|---|---|---|---|---|---|"]
    for r in records:
        cell = f"{r['model']} / {r['cluster']} / {r['num_devices']} / mbs {r['mbs']}"
        for b in r["baselines"]:
            if b["tokens_per_s"] is not None:
                lines.append(f"| {cell} | {b['name']} | {b['tokens_per_s']:.4g} | {b['config_text']} | "
                             f"{b['time_s']:.2f} | {b['configs_evaluated']} |")
    lines += ["", "## Skipped baselines", ""]
    for r in records:
        cell = f"{r['model']} / {r['cluster']} / {r['num_devices']} / mbs {r['mbs']}"
        for b in r["baselines"]:
            if b["tokens_per_s"] is None:
                lines.append(f"- {cell}: {b['name']}: {b['skipped']}")
        if r.get("paper_note"):
            lines.append(f"- {cell}: {r['paper_note']}")
    return "\n".join(lines) + "\n"


def _out_paths(out: Path, stem: str) -> tuple[Path, Path]:
    out.mkdir(parents=True, exist_ok=True)
    stamp = dt.datetime.now().strftime("%Y-%m-%dT%H%M%S")
    node = "".join(ch if ch.isalnum() or ch in "-_" else "_" for ch in platform.node() or "unknown")
    base = out / f"{stem}_{stamp}_{node}"
    return base.with_suffix(".md"), base.with_suffix(".json")


def _print_machine(console: Console, info: dict) -> None:
    console.print(f"[bold]machine[/]: {info['node']} · {info['cpu']} · {info['cores']} cores · "
                  f"Python {info['python']} · {info['platform']}")


def run_grid(args, console: Console) -> int:
    mbss = MBS_SWEEP if args.mbs_sweep else [args.mbs]
    cells = [(m, c, n, b) for c in args.clusters for m in args.models for n in args.devices for b in mbss]
    console.print(f"planner [bold]{args.solver}[/] · {len(cells)} cells · budget {args.budget} · out {args.out}")
    records = []
    start = time.perf_counter()
    columns = [TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
               TimeRemainingColumn()]
    with Progress(*columns, console=console, transient=False) as progress:
        task = progress.add_task("grid", total=len(cells))
        for model, cluster, n, mbs in cells:
            progress.update(task, description=f"{model} · {cluster} · {n} · mbs {mbs}")
            record = run_cell(model, cluster, n, solver=args.solver, mbs=mbs, global_batch_size=args.global_batch,
                              budget=args.budget, seed=args.seed,
                              plans_dir=(args.out / "plans") if args.plans else None)
            records.append(record)
            p = record["planner"]
            ratios = ", ".join(f"{b['name']} {_ratio_cell(b)}" for b in record["baselines"])
            tok = f"{p['tokens_per_s']:.4g} tok/s" if p["tokens_per_s"] else "nothing fits"
            progress.console.print(escape(f"{model} {cluster} {n} mbs{mbs}: {tok} [{p['config_text']}] in "
                                          f"{p['time_s']:.2f} s / {p['configs_evaluated']} configs; {ratios}"))
            progress.advance(task)
    meta = {"date": dt.datetime.now().isoformat(timespec="seconds"), "machine": machine(), "solver": args.solver,
            "global_batch_size": args.global_batch, "mbs": mbss, "budget": args.budget, "seed": args.seed,
            "wall_s": time.perf_counter() - start,
            "planner_search_s": sum(r["planner"]["time_s"] for r in records)}
    console.print(f"planner search time over {len(records)} cells: {meta['planner_search_s']:.1f} s")
    md_path, json_path = _out_paths(args.out, "paper_grid" + ("_mbs_sweep" if args.mbs_sweep else ""))
    md_path.write_text(markdown(records, meta))
    json_path.write_text(json.dumps({"meta": meta, "cells": records}, indent=2))
    console.print(f"wrote {md_path} and {json_path}")
    return 0


# --- scale -------------------------------------------------------------------------------------------------

def scale_search(model: str, cluster: str, num_devices: int, solver: str, global_batch_size: int,
                 mbs: int | None) -> dict:
    """One search in this process: wall time and this process's peak resident memory."""
    overrides = [f"model={model}", f"cluster={cluster}", f"cluster.num_devices={num_devices}",
                 f"train.global_batch_size={global_batch_size}"] + ([f"train.micro_batch_size={mbs}"] if mbs else [])
    loaded = load(overrides)
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    result = SOLVERS[solver](loaded.problem, loaded.config.solver, loaded.config.plan, micro_batch_size=mbs)
    wall = time.perf_counter() - start
    best = result.best
    return {"model": model, "cluster": cluster, "num_devices": num_devices, "solver": solver, "mbs": mbs,
            "wall_s": wall, "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "rss_before_search_mib": rss_before / 1024, "configs_evaluated": result.configs_evaluated,
            "config_text": config_text(best), "tokens_per_s": best.tokens_per_s if best else None,
            "step_time_s": best.step_time if best else None}


def run_scale(args, console: Console) -> int:
    ctx = multiprocessing.get_context("spawn")  # a fresh process per search: its own peak RSS
    rows = []
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console) as progress:
        task = progress.add_task("scale", total=len(args.scale_devices))
        for n in args.scale_devices:
            progress.update(task, description=f"{args.scale_model} · {args.scale_cluster} · {n}")
            with ctx.Pool(1) as pool:
                rows.append(pool.apply(scale_search, (args.scale_model, args.scale_cluster, n, args.solver,
                                                      args.global_batch, args.scale_mbs)))
            progress.advance(task)
    table = Table(title=f"{args.scale_model} on {args.scale_cluster}, planner {args.solver}, "
                        f"global batch {args.global_batch}")
    for col in ("devices", "search wall s", "peak RSS MiB", "configs", "plan", "tokens/s"):
        table.add_column(col)
    for r in rows:
        table.add_row(str(r["num_devices"]), f"{r['wall_s']:.2f}", f"{r['peak_rss_mib']:.0f}",
                      str(r["configs_evaluated"]), r["config_text"],
                      f"{r['tokens_per_s']:.4g}" if r["tokens_per_s"] else "nothing fits")
    console.print(table)
    meta = {"date": dt.datetime.now().isoformat(timespec="seconds"), "machine": machine(), "solver": args.solver}
    md_path, json_path = _out_paths(args.out, "scale")
    md = ["# Planner scaling", "", f"- date: {meta['date']}; machine: {meta['machine']['node']}, "
          f"{meta['machine']['cpu']}, {meta['machine']['cores']} cores", "",
          "| devices | search wall s | peak RSS MiB | configs | plan | tokens/s |", "|---|---|---|---|---|---|"]
    md += [f"| {r['num_devices']} | {r['wall_s']:.2f} | {r['peak_rss_mib']:.0f} | {r['configs_evaluated']} | "
           f"{r['config_text']} | {r['tokens_per_s'] or 0:.4g} |" for r in rows]
    md_path.write_text("\n".join(md) + "\n")
    json_path.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    console.print(f"wrote {md_path} and {json_path}")
    return 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--solver", default="dp", choices=sorted(SOLVERS),
                    help="the planner (default: dp)")
    ap.add_argument("--models", nargs="+", default=MODELS, metavar="MODEL")
    ap.add_argument("--devices", nargs="+", type=int, default=DEVICES, metavar="N")
    ap.add_argument("--clusters", nargs="+", default=CLUSTERS, metavar="CLUSTER")
    ap.add_argument("--mbs", type=int, default=1, help="micro-batch of every cell (default 1, as the paper)")
    ap.add_argument("--mbs-sweep", action="store_true", help=f"sweep micro-batch {MBS_SWEEP} instead")
    ap.add_argument("--global-batch", type=int, default=GLOBAL_BATCH)
    ap.add_argument("--budget", type=int, default=200, help="evaluations of annealing and mcmc")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--plans", action="store_true", help="also write every Plan JSON to OUT/plans")
    ap.add_argument("--out", type=Path, default=Path("bench_out"))
    ap.add_argument("--scale", action="store_true", help="time the planner at 4k-64k devices instead of the grid")
    ap.add_argument("--scale-model", default="llama3_70b")
    ap.add_argument("--scale-cluster", default="h100_spine_leaf")
    ap.add_argument("--scale-devices", nargs="+", type=int, default=SCALE_DEVICES, metavar="N")
    ap.add_argument("--scale-mbs", type=int, default=None,
                    help="pin the micro-batch in --scale (default: the planner searches 1, 2, 4, 8)")
    return ap.parse_args(argv)


COMPILE_PROBE = """
import time
t0 = time.perf_counter()
from nest_megatron import api
api.plan(["model=tiny_gpt", "cluster=dgx_h100_superpod", "cluster.num_devices=16", "train.global_batch_size=64"])
t1 = time.perf_counter()
api.plan(["model=tiny_gpt", "cluster=dgx_h100_superpod", "cluster.num_devices=16", "train.global_batch_size=64"])
print(t1 - t0, time.perf_counter() - t1)
"""


def numba_cold_and_warm() -> tuple[float, float]:
    """A tiny plan in a fresh process with an empty Numba cache (the DP kernel compiles: cold) and
    the same plan again (warm); the difference is what `cache=True` saves on later runs."""
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "NUMBA_CACHE_DIR": cache}
        out = subprocess.run([sys.executable, "-c", COMPILE_PROBE], env=env, capture_output=True, text=True, check=True)
    cold, warm = (float(x) for x in out.stdout.split())
    return cold, warm


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    console = Console()
    _print_machine(console, machine())
    cold, warm = numba_cold_and_warm()
    console.print(f"tiny plan in a fresh process: {cold:.2f} s with an empty Numba cache (compile), {warm:.2f} s warm")
    return run_scale(args, console) if args.scale else run_grid(args, console)


if __name__ == "__main__":
    sys.exit(main())
