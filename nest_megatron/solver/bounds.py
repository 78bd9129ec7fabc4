"""Memory no split can go below, checked before any timing: a configuration whose floor exceeds the
device is skipped without pricing a stage, and a search space whose every floor does is answered at
once. The floors use the cost model's own memory formulas (`cost.memory.stage_memory`), in bytes."""

from __future__ import annotations

import numpy as np

from nest_megatron.cost.memory import StageMemory, stage_memory
from nest_megatron.cost.problem import Problem
from nest_megatron.cost.tables import layer_costs, range_sums
from nest_megatron.hardware.accelerator import GIB
from nest_megatron.parallel.config import ParallelConfig


class MemoryFloors:
    """`floor(cfg)`: a per-device memory below every pipeline rank's peak under any split of cfg.

    The busiest rank holds at least the mean of the ranks: together they hold every layer's model
    states (after ZeRO), the embedding and output layer, at least one micro-batch of every layer's
    activations at their smallest (a fully recomputed layer keeps only its input), the logits once;
    each also holds what no split removes (workspace, attention buffer, ZeRO-3's gathered layers)."""

    def __init__(self, problem: Problem):
        self.problem = problem
        self._costs: dict[tuple, object] = {}
        self._floors: dict[tuple, StageMemory] = {}

    def floor(self, cfg: ParallelConfig) -> StageMemory:
        key = (cfg.tp, cfg.pp, cfg.dp, cfg.cp, cfg.ep, cfg.etp, cfg.sp, cfg.mbs, cfg.zero, cfg.recompute,
               cfg.recompute_num_layers, cfg.selective_modules, cfg.distributed_optimizer_instances,
               cfg.cpu_offloading_num_layers)
        # neither the rank order nor virtual stages move memory here
        found = self._floors.get(key)
        if found is None:
            found = self._floors[key] = self._compute(cfg)
        return found

    def fits(self, cfg: ParallelConfig) -> bool:
        """False only when no split of cfg fits in the device."""
        return self.floor(cfg).total <= self.problem.accelerator.memory_bytes

    def _compute(self, cfg: ParallelConfig) -> StageMemory:
        problem = self.problem
        model, acc = problem.model, problem.accelerator
        # The memory columns depend on neither pp, dp, ZeRO nor the kind of full recompute.
        costs_key = (cfg.tp, cfg.cp, cfg.ep, cfg.etp, cfg.sp, cfg.mbs, cfg.selective_modules)
        costs = self._costs.get(costs_key)
        if costs is None:
            costs = self._costs[costs_key] = layer_costs(model, cfg, spans=None, net=None, compute=None)
        layers = costs.num_layers
        every = range_sums(costs, cfg, 0, layers)
        if cfg.recompute == "full":  # each stage recomputes its own first layers: take every layer at its smallest
            every = every._replace(act_per_chunk=float(np.minimum(np.diff(costs.act_checkpoint),
                                                                  np.diff(costs.act_kept)).sum()))
        shared = stage_memory(model, cfg, every, first=True, last=True, in_flight=1,
                              reserved_bytes=acc.reserved_memory_bytes, act_rebuilt=costs.act_rebuilt)
        each = stage_memory(model, cfg, range_sums(costs, cfg, 0, 0), first=False, last=False, in_flight=0,
                            reserved_bytes=acc.reserved_memory_bytes, act_rebuilt=costs.act_rebuilt)
        p = cfg.pp
        return StageMemory(*((s + (p - 1) * e) / p for s, e in zip(shared.as_dict().values(), each.as_dict().values())))


def no_fit_reason(floors: MemoryFloors, space: list[ParallelConfig]) -> str | None:
    """When every configuration's floor exceeds the device: the smallest floor, what it is made of and
    the configuration it belongs to (the one that needs least), as part of a line; else None."""
    # The widest shardings first: when some configuration fits, one of the first few says so.
    widest_first = sorted(space, key=lambda c: (-c.zero, -c.tp * c.pp * c.cp, c.recompute != "full", c.mbs))
    if not space or any(floors.fits(c) for c in widest_first):
        return None
    cfg = min(space, key=lambda c: floors.floor(c).total)
    floor = floors.floor(cfg)
    parts = [(name, value) for name, value in floor.as_dict().items() if value >= 0.05 * GIB]
    made_of = ", ".join(f"{name} {value / GIB:.1f}" for name, value in parts)
    sizes = [(n, v) for n, v in (("tp", cfg.tp), ("pp", cfg.pp), ("dp", cfg.dp), ("cp", cfg.cp), ("ep", cfg.ep))
             if v > 1 or n in ("tp", "pp", "dp")]
    sharding = f"{'·'.join(n for n, _ in sizes)} = {'·'.join(str(v) for _, v in sizes)} = {cfg.world}"
    return (f"at least {floor.total / GIB:.1f} GiB per device ({made_of} GiB) even at the least-memory configuration the "
            f"search space allows, {sharding} with ZeRO {cfg.zero}, recompute {cfg.recompute}, micro-batch {cfg.mbs}")
