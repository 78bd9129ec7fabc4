"""One rank of a profiling group under torchrun: time layer tasks with real collectives.

    python -m torch.distributed.run --standalone --nproc-per-node N -m nest_megatron.profile.worker \
        TASKS.json RESULTS.json WARMUP REPEATS

Every rank builds its shard of each layer and times it (a barrier lines the ranks up before each
run); the slowest rank's median is the group's time. Rank 0 writes the results.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from nest_megatron.profile.runner import Skip, Task, time_layer_task
from nest_megatron.profile.timing import local_device


def main(argv: list[str]) -> int:
    tasks_path, out_path, warmup, repeats = argv[0], argv[1], int(argv[2]), int(argv[3])
    device = local_device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    results = []
    for item in json.loads(Path(tasks_path).read_text()):
        task = Task(**item)
        try:
            if device.type == "cpu":
                _prepare_cpu(task)
            strategy, both, fwd = time_layer_task(task, device, warmup=warmup, repeats=repeats, before=dist.barrier,
                                                  fake=False)
        except Skip as why:
            results.append({"skipped": str(why)})
            continue
        slowest = torch.tensor([both, fwd], dtype=torch.float64, device=device)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        results.append({"strategy": strategy, "seconds": float(slowest[0]), "fwd_s": float(slowest[1])})
    if dist.get_rank() == 0:
        tmp = Path(out_path).with_suffix(".tmp")
        tmp.write_text(json.dumps(results))
        tmp.replace(out_path)
    dist.barrier()
    dist.destroy_process_group()
    return 0


def _prepare_cpu(task: Task) -> None:
    """The CPU patches for megatron-core, with this task's parallel state already in place (so that
    prepare_cpu_megatron keeps the gloo group rather than making a one-rank one)."""
    from nest_megatron.trace.cpu_megatron import import_megatron_core_uncompiled, prepare_cpu_megatron

    import_megatron_core_uncompiled()  # before megatron_layers imports it
    from nest_megatron.profile import megatron_layers as ml

    s = task.strategy
    ml.parallel_state_for(tp=s["tp"], ep=s.get("ep", 1), etp=s.get("etp", 1))
    prepare_cpu_megatron()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
