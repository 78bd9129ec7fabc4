"""One iteration as a timeline per pipeline rank, laid out from the cost model's own numbers.

Every duration comes from `evaluate`: a rank's time per micro-batch is `stage_parts` (its layers'
compute and in-layer communication, recompute, exposed ZeRO traffic, point-to-point sends split by
`pipeline_sends`), and what follows the pipeline is `after_pipeline`. Nothing is priced here.

What this module adds is the order of the work. The cost model charges every rank at the pace of
the slowest one, (m + (p - 1) / v) x max_i t_i: so each rank's forward and backward operations are
stretched to that pace, the stretch drawn as `imbalance` (the rank waits on the slowest stage), and
the operations are played out in Megatron's order — 1F1B (forward_backward_pipelining_without_
interleaving) or, with v virtual stages, the interleaved schedule (..._with_interleaving: warm-up of
2 (p - i - 1) + (v - 1) g chunks, the micro-batches in groups of g, p unless given, each group through
every chunk in turn) — each starting when its rank is free and its input has arrived. Gaps are the
pipeline bubbles. With equal forward : backward ratios on every rank the pipeline ends at exactly
(m + (p - 1) / v) max_i t_i; otherwise it differs from the formula by a small fraction of one stage
time. The data-parallel sync and the optimizer step follow the flush on every rank, as the cost
model adds the slowest rank's after-pipeline time.

The forward / backward split of a rank's layer work is the cost model's own ratio of its layers'
forward to backward time (`StageSums.fwd`, `.bwd`); recompute and the ZeRO reduce-scatter belong to
the backward, the activation send to the forward and the gradient send to the backward.
"""

from __future__ import annotations

from dataclasses import dataclass

from nest_megatron.cost.evaluate import Context, after_pipeline, offload_parts, pipeline_sends, stage_parts
from nest_megatron.cost.tables import stage_sums

# The kinds of work a rank's timeline holds, in drawing order; idle gaps are the bubbles.
KINDS = ("forward", "backward", "recompute", "p2p", "zero_comm", "host", "offload", "imbalance",
         "dp_grad_sync", "dp_param_gather", "optimizer")


@dataclass(frozen=True)
class Segment:
    kind: str  # one of KINDS
    start: float  # s from the start of the iteration
    duration: float  # s
    microbatch: int = -1  # -1: after the pipeline
    chunk: int = 0  # virtual stage (model chunk) on this rank


@dataclass(frozen=True)
class Timeline:
    schedule: str  # "1F1B" or "interleaved 1F1B"
    stages: tuple[tuple[Segment, ...], ...]  # per pipeline rank, in time order
    pipeline_end: float  # the flush: the last backward of any rank ends, s
    length: float  # the iteration, s

    def bubble(self, stage: int) -> float:
        """Idle time of a rank during the pipeline (the gaps before the flush)."""
        return self.pipeline_end - sum(seg.duration for seg in self.stages[stage] if seg.microbatch >= 0)


@dataclass(frozen=True)
class _Operation:
    forward: bool
    microbatch: int
    chunk: int


def schedule_table(num_microbatches: int, vpp: int, group: int) -> list[tuple[int, int]]:
    """(micro-batch, model chunk) of each forward in order: each group of micro-batches through every chunk in turn,
    the last group holding the rest (megatron-core get_schedule_table, schedules.py:989-1015 at d98e8a6)."""
    table = []
    for first in range(0, num_microbatches, group):
        last = num_microbatches if first + group >= num_microbatches else first + group
        table += [(microbatch, chunk) for chunk in range(vpp) for microbatch in range(first, last)]
    return table


def megatron_order(*, pp: int, vpp: int, stage: int, num_microbatches: int, group: int | None = None) -> list[_Operation]:
    """The forward and backward operations of rank `stage` in the order Megatron runs them; `group`: the interleaved
    schedule's micro-batch group (None: pp)."""
    total, group = num_microbatches * vpp, group or pp
    if vpp == 1:
        warmup = min(pp - stage - 1, total)
    else:
        warmup = min(2 * (pp - stage - 1) + (vpp - 1) * group, total)
    table = schedule_table(num_microbatches, vpp, group)

    def operation(k: int, forward: bool) -> _Operation:
        microbatch, chunk = table[k]
        return _Operation(forward, microbatch, chunk if forward else vpp - 1 - chunk)

    ops = [operation(k, True) for k in range(warmup)]
    for i in range(total - warmup):
        ops += [operation(warmup + i, True), operation(i, False)]
    ops += [operation(k, False) for k in range(total - warmup, total)]
    return ops


def _input_of(op: _Operation, stage: int, *, pp: int, vpp: int) -> tuple[int, _Operation] | None:
    """The operation (rank, operation) whose output `op` on `stage` waits for; None: none."""
    if op.forward:
        if stage > 0:
            return stage - 1, op
        return (pp - 1, _Operation(True, op.microbatch, op.chunk - 1)) if op.chunk > 0 else None
    if stage < pp - 1:
        return stage + 1, op
    if op.chunk < vpp - 1:
        return 0, _Operation(False, op.microbatch, op.chunk + 1)
    return stage, _Operation(True, op.microbatch, op.chunk)


def _pieces(ctx: Context, split: tuple[int, ...], stage: int, pace: float) -> tuple[list, list]:
    """(kind, seconds) of one forward and one backward chunk operation of `stage`, stretched to `pace`
    seconds per micro-batch."""
    cfg = ctx.cfg
    sums = stage_sums(ctx.costs, cfg, split, stage)
    parts = stage_parts(ctx, sums, stage=stage)
    send_forward, send_backward = pipeline_sends(ctx, stage=stage, sums=sums)
    layer_work = parts["compute"] + parts["tp_comm"] + parts["cp_comm"] + parts["ep_comm"]
    layer_time = float(sums.fwd + sums.bwd)
    forward_share = float(sums.fwd) / layer_time if layer_time > 0 else 0.5  # a rank of empty stages has no layer work
    # the GPU's wait for the host (host.py), shared out like the layer work
    offload_forward, offload_backward = offload_parts(ctx)  # waits for the activations' copies to and from the host
    forward = [("forward", forward_share * layer_work), ("host", forward_share * parts["host"]),
               ("offload", offload_forward), ("p2p", send_forward)]
    backward = [("recompute", parts["recompute"]), ("backward", (1 - forward_share) * layer_work),
                ("host", (1 - forward_share) * parts["host"]), ("offload", offload_backward),
                ("zero_comm", parts["zero_comm"]), ("p2p", send_backward)]
    busy = float(sum(parts.values()))
    stretch = pace - busy
    forward.append(("imbalance", stretch * sum(d for _, d in forward) / busy))
    backward.append(("imbalance", stretch * sum(d for _, d in backward) / busy))
    v = cfg.vpp
    return [(k, float(d) / v) for k, d in forward if d > 0], [(k, float(d) / v) for k, d in backward if d > 0]


def timeline(ctx: Context, split: tuple[int, ...]) -> Timeline:
    """The iteration of `ctx`'s configuration with its layers split as `split`, rank by rank."""
    cfg = ctx.cfg
    p, v, m = cfg.pp, cfg.vpp, ctx.num_microbatches
    all_sums = [stage_sums(ctx.costs, cfg, split, s) for s in range(p)]
    pace = max(float(sum(stage_parts(ctx, sums, stage=s).values())) for s, sums in enumerate(all_sums))
    pieces = [_pieces(ctx, split, s, pace) for s in range(p)]
    orders = [megatron_order(pp=p, vpp=v, stage=s, num_microbatches=m, group=cfg.microbatch_group)
              for s in range(p)]

    segments: list[list[Segment]] = [[] for _ in range(p)]
    done: dict[tuple[int, _Operation], float] = {}  # end time of each operation played
    free = [0.0] * p
    position = [0] * p
    while any(position[s] < len(orders[s]) for s in range(p)):
        progressed = False
        for s in range(p):
            while position[s] < len(orders[s]):
                op = orders[s][position[s]]
                source = _input_of(op, s, pp=p, vpp=v)
                if source is not None and source not in done:
                    break
                start = max(free[s], done[source] if source is not None else 0.0)
                for kind, seconds in pieces[s][0 if op.forward else 1]:
                    segments[s].append(Segment(kind, start, seconds, op.microbatch, op.chunk))
                    start += seconds
                done[(s, op)] = free[s] = start
                position[s] += 1
                progressed = True
        assert progressed, "the schedule deadlocked: Megatron's order cannot"

    flush = max(free)
    finish = []
    for s, sums in enumerate(all_sums):
        start = flush
        for kind, seconds in after_pipeline(ctx, sums, first=s == 0, last=s == p - 1).items():
            if seconds > 0:
                segments[s].append(Segment(kind, start, float(seconds)))
                start += float(seconds)
        finish.append(start)
    return Timeline(schedule="1F1B" if v == 1 else "interleaved 1F1B", stages=tuple(map(tuple, segments)),
                    pipeline_end=flush, length=max(finish))
