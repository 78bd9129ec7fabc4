"""Time `plan` for one cell (default: the README's Llama 3 70B / 1,024-GPU cell) and print the search
statistics; with --baseline REF, also the code of git revision REF on the same cell, side by side.

Usage: python scripts/time_plan.py [--baseline REF] [--timeout S] [--repeat N] [overrides...]
       python scripts/time_plan.py --grid [--timeout S]   (the 2025 models' cells below, then a markdown table)

Each side runs in a fresh process: one untimed run of a tiny cell fills Numba's cache, then the cell
is timed in another process from `api.plan` to its plan (or its "does not fit" error), so the time
includes loading the compiled functions but neither compiling them nor importing Python. REF runs
from a `git worktree` under the system's temp directory (kept for the next run; `git worktree remove`
deletes it). The load average is printed beside the
times: on a shared machine they are only as good as it is low."""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT = ["model=llama3_70b", "cluster=h100_spine_leaf", "cluster.num_devices=1024", "train.global_batch_size=4096"]
# --grid: each 2025-era shipped model on 256 and 2,048 H100 of a DGX SuperPOD and on 72 and 1,152 GB200 of NVL72 racks
GRID_MODELS = ["llama31_405b", "qwen3_30b_a3b", "qwen3_235b_a22b", "deepseek_v3", "kimi_k2", "gpt_oss_120b",
               "nemotron_h_56b", "nemotron3_super", "nemotron3_ultra"]
GRID_CELLS = [("dgx_h100_superpod", 256), ("dgx_h100_superpod", 2048), ("gb200_nvl72", 72), ("gb200_nvl72", 1152)]
WARM = ["model=tiny_gpt", "cluster=dgx_h100_superpod", "cluster.num_devices=16", "train.global_batch_size=64"]

# Run inside the timed process, against whichever tree PYTHONPATH points at.
TIMED = """
import json, sys, time
from nest_megatron import api
from nest_megatron.errors import NestError
start = time.perf_counter()
try:
    plan = api.plan(sys.argv[1:])
except NestError as err:
    print(json.dumps({"wall": time.perf_counter() - start, "error": str(err)}))
    raise SystemExit(0)
wall = time.perf_counter() - start
p = plan.parallel
print(json.dumps({"wall": wall, "search": plan.search["time_s"], "visited": plan.search["configs_evaluated"],
                  "space": plan.search.get("configs_in_space"),
                  "plan": f"tp={p['tp']} pp={p['pp']} dp={p['dp']} cp={p['cp']} vpp={p['vpp']} mbs={plan.micro_batch_size} "
                          f"zero={plan.zero_stage} recompute={plan.recompute['granularity']} "
                          f"step {plan.predicted['step_time_s']:.3f} s, MFU {plan.predicted['mfu']:.1%}"}))
"""


def run_side(tree: Path, overrides: list[str], timeout: float) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    command = [sys.executable, "-c", TIMED]
    subprocess.run(command + WARM, cwd=tree, env=env, capture_output=True, timeout=600)
    load = os.getloadavg()[0]
    try:
        done = subprocess.run(command + overrides, cwd=tree, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"wall": None, "load": load}
    if done.returncode:
        return {"wall": None, "error": done.stderr.strip().splitlines()[-1], "load": load}
    return {**json.loads(done.stdout.strip().splitlines()[-1]), "load": load}


def worktree(ref: str) -> Path:
    commit = subprocess.run(["git", "rev-parse", "--verify", f"{ref}^{{commit}}"], cwd=ROOT, capture_output=True,
                            text=True, check=True).stdout.strip()
    path = Path(tempfile.gettempdir()) / f"nest-megatron-{commit[:12]}"
    if not path.exists():
        subprocess.run(["git", "worktree", "add", "--detach", str(path), commit], cwd=ROOT, capture_output=True,
                       check=True)
    return path


def describe(result: dict, timeout: float) -> str:
    load = f"load {result['load']:.2f}"
    if result["wall"] is None:
        return f"{'over ' + str(timeout) + ' s' if 'error' not in result else 'failed: ' + result['error']} ({load})"
    if "error" in result:
        return f"{result['wall']:.2f} s ({load}): {result['error'][:160]}"
    space = f" of {result['space']:,}" if result.get("space") else ""
    return (f"{result['wall']:.2f} s ({load}; search {result['search']:.2f} s, {result['visited']:,}{space} "
            f"configurations) {result['plan']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", help="git revision to time on the same cell, e.g. HEAD~5")
    parser.add_argument("--timeout", type=float, default=600, help="seconds before a side is stopped")
    parser.add_argument("--repeat", type=int, default=1, help="timed runs per side (each is printed)")
    parser.add_argument("--grid", action="store_true", help="time the 2025 models' cells (GRID_MODELS x GRID_CELLS)")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    print(f"machine: {cpu_name()}, {os.cpu_count()} cores, python {platform.python_version()}")
    if args.grid:
        grid(args.timeout)
        return
    overrides = args.overrides or DEFAULT
    print(f"overrides: {' '.join(overrides)}")
    sides = [("this tree", ROOT)] + ([(args.baseline, worktree(args.baseline))] if args.baseline else [])
    for name, tree in sides:
        for _ in range(args.repeat):
            print(f"{name}: {describe(run_side(tree, overrides, args.timeout), args.timeout)}", flush=True)


def cpu_name() -> str:
    """The processor's model name (Linux's /proc/cpuinfo), else what platform says."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()} ({platform.machine()})"
    except OSError:
        pass
    return platform.processor() or platform.machine()


def grid(timeout: float) -> None:
    """Each cell of the grid as a line, then the wall times as a markdown table (a model that does not fit: the
    time to say so)."""
    walls = {}
    for model in GRID_MODELS:
        for cluster, devices in GRID_CELLS:
            cell = [f"model={model}", f"cluster={cluster}", f"cluster.num_devices={devices}", "train.global_batch_size=4096"]
            result = run_side(ROOT, cell, timeout)
            print(f"{model} {cluster} {devices}: {describe(result, timeout)}", flush=True)
            walls[model, cluster, devices] = (f"over {timeout:g} s" if result["wall"] is None
                                              else f"{result['wall']:.1f} s" + (" (does not fit)" if "error" in result else ""))
    print("\n| model | " + " | ".join(f"{c} x {n:,}" for c, n in GRID_CELLS) + " |")
    print("|---|" + "---|" * len(GRID_CELLS))
    for model in GRID_MODELS:
        print(f"| {model} | " + " | ".join(walls[model, c, n] for c, n in GRID_CELLS) + " |")


if __name__ == "__main__":
    main()
