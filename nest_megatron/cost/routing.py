"""Where a MoE layer's tokens go: how many copies of a token the expert-parallel dispatch carries, and across
which network levels.

Experts sit on the expert-parallel ranks in order, E/ep consecutive experts a rank (megatron-core's
MoELayer: local_expert_indices). Group-limited routing (--moe-router-num-groups G, --moe-router-group-topk K)
splits the experts into G groups of E/G consecutive experts and takes a token's top-k experts from the K groups
its router scores highest (megatron/core/transformer/moe/moe_utils.py group_limited_topk: scores.view(tokens,
G, E/G)). A learned router is taken as balanced: its scores i.i.d., through megatron-core's own choice of the K
groups and the k experts among theirs (`group_counts`).

Megatron's alltoall dispatcher sends a copy per routed expert: with a uniform router each copy lands on any
expert alike, so the traffic per level is topk copies spread over the group's peers, group limit or not (it
bounds the worst token, not the mean). DeepEP sends a token once to each rank that holds one of its experts, and
across nodes once to each node (its internode kernels: one RDMA copy per destination node, forwarded over NVLink
to the ranks there, deep_ep Buffer.get_dispatch_layout: num_tokens_per_rdma_rank): there the group limit counts.
With groups aligned to nodes (G = the EP group's nodes, DeepSeek-V3's node-limited routing) a token crosses the
network to at most K nodes.
"""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np

from nest_megatron.model.spec import ModelSpec

# megatron-core's group-limited routing (moe_utils.py group_limited_topk, :515-570 at 0.16.1, :673 at d98e8a6):
# a group's score is the sum of its top k/K expert scores, the K best groups are kept, then the top k experts among
# theirs, so a kept group nearly always gets some of them (a uniform choice among the kept groups' experts would
# leave some kept groups empty: tests/test_routing_trace.py measured it 8.5 % short of the cross-node copies).
# With the scores i.i.d. (a learned router taken as balanced; sigmoid of normal logits, DeepSeek-V3's score) how a
# token's k experts fall over the groups has no closed form: it is drawn once for GROUP_SAMPLES tokens (seeded, so
# prices repeat), and a range of experts is priced from those counts, the experts of a group uniform within it.
GROUP_SAMPLES = 16384


@lru_cache(maxsize=64)
def group_counts(experts: int, k: int, groups: int, group_topk: int) -> np.ndarray:
    """[GROUP_SAMPLES, groups]: how many of a token's k experts megatron-core's group-limited routing puts in each
    group, for i.i.d. scores."""
    rng = np.random.default_rng(0)
    scores = 1 / (1 + np.exp(-rng.standard_normal((GROUP_SAMPLES, experts), dtype=np.float32)))
    size = experts // groups
    group_scores = np.sort(scores.reshape(GROUP_SAMPLES, groups, size), axis=-1)[:, :, size - k // group_topk:].sum(-1)
    kept = np.zeros((GROUP_SAMPLES, groups), dtype=bool)
    np.put_along_axis(kept, np.argpartition(-group_scores, group_topk - 1, axis=1)[:, :group_topk], True, axis=1)
    masked = np.where(np.repeat(kept, size, axis=1), scores, -np.inf)
    chosen = np.argpartition(-masked, k - 1, axis=1)[:, :k]
    counts = np.zeros((GROUP_SAMPLES, groups), dtype=np.int64)
    np.add.at(counts, (np.arange(GROUP_SAMPLES)[:, None], chosen // size), 1)
    return counts


@lru_cache(maxsize=65536)
def experts_hit_probability(experts: int, k: int, groups: int, group_topk: int, lo: int, hi: int) -> float:
    """P(at least one of a token's k experts is one of experts [lo, hi)), for a router taken as balanced: without a
    group limit (or one that keeps every group) k distinct experts of all; with one, megatron-core's choice of
    `group_topk` of `groups` equal groups of consecutive experts and k experts among theirs (`group_counts`)."""
    if group_topk < groups:
        size = experts // groups
        overlap = [max(0, min(hi, (g + 1) * size) - max(lo, g * size)) for g in range(groups)]
        if group_topk == 1:  # one group a token: the k experts all in it
            return sum(1 - math.comb(size - o, k) / math.comb(size, k) for o in overlap) / groups
        # the groups are alike, so every rotation of the overlaps prices alike: one per rotation class
        return _grouped_hit(experts, k, groups, group_topk, min(tuple(np.roll(overlap, r)) for r in range(groups)))
    span = max(0, min(hi, experts) - max(lo, 0))
    return 1 - math.comb(experts - span, k) / math.comb(experts, k)


@lru_cache(maxsize=4096)
def _grouped_hit(experts: int, k: int, groups: int, group_topk: int, overlap: tuple[int, ...]) -> float:
    """P(some of a token's experts among a range overlapping the groups by `overlap`), from `group_counts`, the
    experts of a group uniform within it, averaged over the groups' rotations (they are alike)."""
    size, counts = experts // groups, group_counts(experts, k, groups, group_topk)
    # P(none of c experts, uniform in a group of `size`, in its `o` experts of the range)
    miss = np.array([[math.comb(size - o, c) / math.comb(size, c) for c in range(min(k, size) + 1)]
                     for o in range(size + 1)])
    return 1 - float(np.mean([np.prod(miss[np.roll(overlap, r), counts], axis=1).mean() for r in range(groups)]))


def _groups(model: ModelSpec) -> tuple[int, int]:
    """(groups, groups per token) of the model's router; (1, 1) without group-limited routing."""
    m = model.cfg
    return (m.moe_router_num_groups, m.moe_router_group_topk) if m.moe_router_group_topk else (1, 1)


def _fake_balanced_sets(model: ModelSpec):
    """AutoModel's FakeBalancedGate sends token i to experts ik, ..., ik + k - 1 (mod E)
    (nemo_automodel/components/moe/layers.py, FakeBalancedGate.forward): each distinct start's experts."""
    k, experts = model.cfg.moe_router_topk, model.cfg.num_experts
    starts = range(0, experts, math.gcd(k, experts))
    return [{(s + j) % experts for j in range(k)} for s in starts]


def hit_probabilities(model: ModelSpec, *, ranks: int, per_unit: int, router: str) -> tuple[tuple[float, ...], ...]:
    """(P(rank q gets a token) for each of `ranks` expert-parallel ranks, P(unit U does) for each unit of
    `per_unit` consecutive ranks)."""
    return _hit_probabilities(model, ranks, per_unit, router)


@lru_cache(maxsize=4096)
def _hit_probabilities(model: ModelSpec, ranks: int, per_unit: int, router: str):
    experts, k = model.cfg.num_experts, model.cfg.moe_router_topk
    local = experts // ranks
    units = ranks // per_unit
    if router == "learned":
        groups, group_topk = _groups(model)

        def p(lo, hi):
            return experts_hit_probability(experts, k, groups, group_topk, lo, hi)

        return (tuple(p(q * local, (q + 1) * local) for q in range(ranks)),
                tuple(p(u * per_unit * local, (u + 1) * per_unit * local) for u in range(units)))
    if router == "fake_balanced":
        sets = _fake_balanced_sets(model)
        rank_hits, unit_hits = [0] * ranks, [0] * units
        for chosen in sets:
            hit = {e // local for e in chosen}
            for q in hit:
                rank_hits[q] += 1
            for u in {q // per_unit for q in hit}:
                unit_hits[u] += 1
        return tuple(n / len(sets) for n in rank_hits), tuple(n / len(sets) for n in unit_hits)
    raise ValueError(f"unknown MoE router {router!r}: learned | fake_balanced")


def dispatch_copies(model: ModelSpec, ep: int, *, dispatcher: str = "alltoall", router: str = "learned") -> float:
    """Copies of each token the EP dispatch all-to-all carries (and the combine brings back).

    alltoall: Megatron's MoEAlltoAllTokenDispatcher permutes a copy per routed expert before the
    exchange (megatron/core/transformer/moe/token_dispatcher.py): topk copies.
    deepep: DeepEP's dispatch (Megatron's flex dispatcher, NeMo AutoModel's) sends a token once to
    each rank holding one of its experts (deep_ep Buffer.get_dispatch_layout, is_token_in_rank), and
    the receiving rank expands it to its local experts: the expected number of ranks hit, for the router:
      learned: taken as balanced (with group-limited routing, megatron-core's choice: `group_counts`), E/ep experts a rank:
        without groups ep (1 - C(E - E/ep, k) / C(E, k)) (`experts_hit_probability`);
      fake_balanced: the ranks of AutoModel's consecutive experts, averaged over the starts ik mod E.
    """
    k = model.cfg.moe_router_topk
    if dispatcher in ("alltoall", "allgather") or ep <= 1:  # allgather: exchanges whole tokens (layer_time)
        return float(k)
    if dispatcher != "deepep":
        raise ValueError(f"unknown MoE dispatcher {dispatcher!r}: alltoall | allgather | deepep")
    return sum(hit_probabilities(model, ranks=ep, per_unit=1, router=router)[0])


def deepep_level_copies(model: ModelSpec, fan_in: tuple[float, ...], *, router: str = "learned") -> tuple[float, ...] | None:
    """Per network level, the copies of one token DeepEP's dispatch sends across it from one rank of an
    expert-parallel group spread as `fan_in` (cost/collectives.py GroupShape, members in locality order);
    None for a group whose units hold unequal numbers of members (an irregular tree: the uniform share then).

    A rank sends a token once to each node (a unit of the group's lowest level) holding one of its experts and
    once to each rank of its own node that does; inside a destination node the receiving rank forwards it to
    the others hit there (DeepEP internode: RDMA once a node, then NVLink). Level 0 carries the own node's
    copies and the forwarded ones, level l >= 1 one copy per node hit among those first met at level l."""
    if any(abs(n - round(n)) > 1e-9 for n in fan_in):
        return None
    sizes = [round(n) for n in fan_in]
    ranks, per_unit = math.prod(sizes), sizes[0]
    rank_hit, unit_hit = hit_probabilities(model, ranks=ranks, per_unit=per_unit, router=router)
    copies = [0.0] * len(sizes)
    copies[0] = sum(rank_hit[1:per_unit]) + sum(
        sum(rank_hit[u * per_unit:(u + 1) * per_unit]) - unit_hit[u] for u in range(1, ranks // per_unit))
    for u in range(1, ranks // per_unit):
        copies[_level_first_met(u * per_unit, sizes)] += unit_hit[u]
    return tuple(copies)


def _level_first_met(member: int, sizes: list[int]) -> int:
    """The lowest level whose unit around member 0 holds `member` (members in locality order)."""
    span = 1
    for level, n in enumerate(sizes):
        span *= n
        if member < span:
            return level
    raise AssertionError(f"member {member} is outside a group of {span}")
