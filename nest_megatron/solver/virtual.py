"""The layer split with virtual stages: the best of the planner's family of Megatron's own forms.

With vpp > 1 a pipeline rank's time is the sum of v non-contiguous chunks, which an exact DP over splits would
search in exponential time. The planner searches a family instead (`parallel.layout.searched_splits`: the
even split, the embedding and / or loss counted as layers, first / last stage layer counts with the rest even,
layouts whose first and last chunks are lighter than an otherwise even middle) and prices every member at once:
`cost.tables.chunk_sums` sums each rank's chunks of every candidate as arrays, and the cost model's own stage
formulas (`stage_body`, `pipeline_p2p`, `after_pipeline`, `memory.stage_memory`) price those sums elementwise, so
each candidate costs what `estimate_in` says it does. The memory half comes first (no placement changes it).
"""

from __future__ import annotations

import numpy as np

from nest_megatron.cost.evaluate import Context, after_pipeline, pipeline_p2p, stage_body
from nest_megatron.cost.memory import in_flight_chunks, stage_memory
from nest_megatron.cost.tables import StageSums, chunk_bounds, chunk_sums
from nest_megatron.parallel.layout import searched_splits


def family(ctx: Context) -> np.ndarray:
    """The searched splits of `ctx`'s configuration (vpp > 1), one row of pp*vpp chunk layers each, simplest first."""
    cfg = ctx.cfg
    return np.array(searched_splits(ctx.costs.num_layers, cfg.pp, cfg.vpp), dtype=np.int64).reshape(-1, cfg.pp * cfg.vpp)


def family_sums(ctx: Context, chunks: np.ndarray) -> StageSums:
    """Every candidate's sums over each rank's chunks: arrays [candidate, rank]."""
    starts, ends = chunk_bounds(ctx.cfg, chunks)
    return chunk_sums(ctx.costs, ctx.cfg, starts, ends)


def family_fits(ctx: Context, sums: StageSums) -> np.ndarray:
    """Whether every rank of each candidate (`family_sums`) fits in the device: memory.memory_of_rank on arrays."""
    problem, cfg = ctx.problem, ctx.cfg
    ranks = np.arange(cfg.pp)
    in_flight = np.array([in_flight_chunks(cfg, stage=s, num_microbatches=ctx.num_microbatches) for s in ranks])
    memory = stage_memory(problem.model, cfg, sums, first=ranks == 0, last=ranks == cfg.pp - 1, in_flight=in_flight,
                          reserved_bytes=problem.accelerator.reserved_memory_bytes, act_rebuilt=ctx.costs.act_rebuilt)
    return np.all(memory.total <= problem.accelerator.memory_bytes, axis=-1)


def step_times(ctx: Context, sums: StageSums) -> np.ndarray:
    """Each candidate's step time, as `estimate_in` computes it: F x the slowest rank's time per micro-batch (its
    stage body and pipeline transfers) + the slowest rank's exposed data-parallel sync and optimizer."""
    pp = ctx.cfg.pp
    slowest = after = -np.inf
    for first, last, ranks in ((True, False, slice(0, 1)), (False, False, slice(1, pp - 1)), (False, True, slice(pp - 1, pp))):
        if ranks.stop <= ranks.start:  # no middle rank
            continue
        part = StageSums(*(value[:, ranks] for value in sums))
        body = sum(stage_body(ctx, part, first=first, last=last).values())
        # With virtual stages a rank's transfers depend on its work, not on its place (evaluate.pipeline_sends).
        t = body + pipeline_p2p(ctx, stage=ranks.start, sums=part)
        x = sum(after_pipeline(ctx, part, first=first, last=last).values())
        slowest = np.maximum(slowest, np.max(t + 0 * part.compute, axis=-1))
        after = np.maximum(after, np.max(x + 0 * part.compute, axis=-1))
    return ctx.pipeline_factor * slowest + after


def best_virtual_split(ctx: Context, *, cutoff: float = np.inf,
                       fitting: np.ndarray | None = None) -> tuple[tuple[int, ...], float] | None:
    """The fastest searched split whose every rank fits, with its step time; None when none fits or none is faster
    than `cutoff`. Equal times go to the simplest form (`searched_splits`' order). `fitting`: the candidates'
    `family_fits`, when already known (memory does not change with the placement)."""
    chunks = family(ctx)
    sums = family_sums(ctx, chunks)
    ok = family_fits(ctx, sums) if fitting is None else fitting
    if not ok.any():
        return None
    times = np.where(ok, step_times(ctx, sums), np.inf)
    best = int(np.argmin(times))
    if not times[best] < cutoff:
        return None
    return tuple(int(n) for n in chunks[best]), float(times[best])
