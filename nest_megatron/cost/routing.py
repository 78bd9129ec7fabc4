"""Where a MoE layer's tokens go: how many copies of a token the expert-parallel dispatch carries, and across
which network levels.

Experts sit on the expert-parallel ranks in order, E/ep consecutive experts a rank (megatron-core's
MoELayer: local_expert_indices). Group-limited routing (--moe-router-num-groups G, --moe-router-group-topk K)
splits the experts into G groups of E/G consecutive experts and takes a token's top-k experts from the K groups
its router scores highest (megatron/core/transformer/moe/moe_utils.py group_limited_topk: scores.view(tokens,
G, E/G)). A learned router is taken as uniform: K of the G groups, then k distinct experts among their K E/G.

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

from nest_megatron.model.spec import ModelSpec


@lru_cache(maxsize=65536)
def experts_hit_probability(experts: int, k: int, groups: int, group_topk: int, lo: int, hi: int) -> float:
    """P(at least one of a token's k experts is one of experts [lo, hi)), for a router taken as uniform:
    `group_topk` of `groups` equal groups of consecutive experts, then k distinct experts among theirs (no group
    limit: groups = group_topk = 1)."""
    size = experts // groups
    pool = group_topk * size
    overlaps = [c for c in (min(hi, (g + 1) * size) - max(lo, g * size) for g in range(groups)) if c > 0]
    # ways[(j, a)]: the subsets of j of the overlapping groups holding a of the experts [lo, hi)
    ways = {(0, 0): 1}
    for c in overlaps:
        grown = dict(ways)
        for (j, a), w in ways.items():
            grown[(j + 1, a + c)] = grown.get((j + 1, a + c), 0) + w
        ways = grown
    others = groups - len(overlaps)
    miss = sum(w * math.comb(others, group_topk - j) * math.comb(pool - a, k)
               for (j, a), w in ways.items() if j <= group_topk)
    return 1 - miss / (math.comb(groups, group_topk) * math.comb(pool, k))


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
      learned: taken as uniform (with group-limited routing, within K of G groups), E/ep experts a rank:
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
