"""torchrun's elastic worker: after each rendezvous, the cached plan for the ranks present, exec'ed.

`python -m nest_megatron.launch.elastic_worker RUN_DIR` reads RUN_DIR/elastic.json (launch/elastic.py wrote it
before the agent started), picks the entry of torchrun's WORLD_SIZE and execs the training script with that
plan's Megatron arguments and environment, in this process (torchrun watches this pid).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from nest_megatron.errors import NestError  # the standard library only: a replan must take well under a second

INDEX = "elastic.json"
WORKER_MODULE = "nest_megatron.launch.elastic_worker"


def select(run_dir: str, env: dict[str, str]) -> tuple[list[str], dict[str, str], dict]:
    """The command (python, script, argv), environment and cache entry for the world torchrun started."""
    index = json.loads((Path(run_dir) / INDEX).read_text())
    world = env.get("WORLD_SIZE", "?")
    chosen = index["sizes"].get(world)
    if chosen is None:
        have = ", ".join(f"{e['nodes']} node(s) = {w} ranks" for w, e in index["sizes"].items())
        raise NestError(f"torchrun started {world} ranks, but {run_dir}/{INDEX} plans {have}")
    out = {**env, **{k: v for k, v in chosen["env"].items() if v is not None}}
    for key in (k for k, v in chosen["env"].items() if v is None):
        out.pop(key, None)
    visible = chosen["cuda_visible_devices"].get(env.get("GROUP_RANK", "0"))
    if visible:
        out["CUDA_VISIBLE_DEVICES"] = visible
    return [index["python"], "-u", index["script"], *chosen["argv"]], out, chosen


def worker(argv: list[str]) -> int:
    start = time.perf_counter()
    if len(argv) != 1:
        print(f"usage: python -m {WORKER_MODULE} RUN_DIR (torchrun's elastic worker)", file=sys.stderr)
        return 2
    try:
        command, env, chosen = select(argv[0], dict(os.environ))
    except (NestError, OSError, ValueError, KeyError) as err:
        print(f"nest-megatron elastic: error: {err}", file=sys.stderr, flush=True)
        return 2
    if env.get("RANK") == "0":
        p = chosen["parallel"]
        print(f"nest-megatron elastic: {chosen['nodes']} node(s), {chosen['world_size']} ranks, restart "
              f"{env.get('TORCHELASTIC_RESTART_COUNT', '0')}: plan {chosen['digest']} tp={p['tp']} pp={p['pp']} "
              f"dp={p['dp']} mbs={chosen['micro_batch_size']} x {chosen['num_microbatches']} micro-batches, "
              f"selected in {1000 * (time.perf_counter() - start):.1f} ms", file=sys.stderr, flush=True)
    os.execve(command[0], command, env)


if __name__ == "__main__":
    sys.exit(worker(sys.argv[1:]))
