"""Time `plan` for one cell (default: the README's Llama 3 70B / 1,024-GPU cell) and print the search
statistics; with --baseline REF, also the code of git revision REF on the same cell, side by side.

Usage: python scripts/time_plan.py [--baseline REF] [--timeout S] [--repeat N] [overrides...]

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
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    overrides = args.overrides or DEFAULT
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"python {platform.python_version()}")
    print(f"overrides: {' '.join(overrides)}")
    sides = [("this tree", ROOT)] + ([(args.baseline, worktree(args.baseline))] if args.baseline else [])
    for name, tree in sides:
        for _ in range(args.repeat):
            print(f"{name}: {describe(run_side(tree, overrides, args.timeout), args.timeout)}", flush=True)


if __name__ == "__main__":
    main()
