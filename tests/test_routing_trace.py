"""megatron-core 0.16.1's own MoE top-k routing, run on CPU, against the cost model's routing probabilities
(nest_megatron/cost/routing.py): the share of tokens that reach each expert-parallel rank's experts
(`experts_hit_probability`), the ranks a token reaches (`dispatch_copies`, DeepEP) and DeepEP's copies per network
level (`deepep_level_copies`).

The routing is TopKRouter.routing's own (megatron/core/transformer/moe/router.py:573-584, the unfused path
without Transformer Engine): `topk_routing_with_score_function`, which calls `group_limited_topk` with
--moe-router-num-groups / --moe-router-group-topk (moe_utils.py:515-570, 608-747). It runs on 256 experts, top-8,
DeepSeek-V3's sigmoid score function, on N i.i.d. standard-normal logits a token (seeded): the uniform router the
cost model takes. Sigmoid is monotone, so the top-k is the logits' own; the experts sit on the EP ranks in order,
E/ep consecutive experts a rank (MoELayer.local_expert_indices).

Tolerance. A rank's measured share is the mean of N independent Bernoulli(p) draws (one a token): standard error
sqrt(p (1 - p) / N), about 0.0034 at p = 0.5 and 0.0023 at p = 0.12 for N = 20,000; the test allows 4 of them
(a two-sided miss of a right p has probability 6e-5 per comparison, under 1 % over the ~90 compared here, and
the seed fixes the draw). A per-token count (ranks reached, copies per level) is the mean of N i.i.d. bounded
draws: its sample standard deviation / sqrt(N) (central limit theorem), again 4 of them. With a group limit the
priced p is itself a draw of megatron-core's choice (cost/routing.py group_counts, 16,384 tokens averaged over the
groups' rotations), whose error is a small part of the measured one's.
"""

from __future__ import annotations

import math

import pytest

pytest.importorskip("megatron.core")

pytestmark = [pytest.mark.filterwarnings("ignore::DeprecationWarning"), pytest.mark.filterwarnings("ignore::UserWarning")]

import torch  # noqa: E402
from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function  # noqa: E402

from nest_megatron.config.schema import ModelConfig  # noqa: E402
from nest_megatron.cost.routing import deepep_level_copies, dispatch_copies, experts_hit_probability  # noqa: E402
from nest_megatron.model.spec import ModelSpec  # noqa: E402

EXPERTS, TOPK, TOKENS, SIGMAS = 256, 8, 20_000, 4.0


def megatron_routing_map(groups: int | None, group_topk: int | None, *, seed: int = 0) -> torch.Tensor:
    """[TOKENS, EXPERTS] bool: the experts megatron-core routes each token to."""
    logits = torch.randn(TOKENS, EXPERTS, generator=torch.Generator().manual_seed(seed))
    _, routing_map = topk_routing_with_score_function(logits, TOPK, num_groups=groups, group_topk=group_topk,
                                                      score_function="sigmoid")
    assert routing_map.shape == (TOKENS, EXPERTS) and bool((routing_map.sum(dim=1) == TOPK).all())
    return routing_map


def rank_hits(routing_map: torch.Tensor, ep: int) -> torch.Tensor:
    """[TOKENS, ep] bool: whether a token reaches EP rank q (one of experts [q E/ep, (q + 1) E/ep))."""
    return routing_map.view(TOKENS, ep, EXPERTS // ep).any(dim=-1)


def model(groups: int | None = None, group_topk: int | None = None) -> ModelSpec:
    return ModelSpec(ModelConfig(name="routed", num_layers=1, hidden_size=64, ffn_hidden_size=64, num_attention_heads=4,
                                 seq_length=16, vocab_size=128, num_experts=EXPERTS, moe_router_topk=TOPK,
                                 moe_router_num_groups=groups, moe_router_group_topk=group_topk))


def assert_shares(measured: torch.Tensor, priced: list[float]) -> None:
    """Each rank's measured share within SIGMAS binomial standard errors of the priced probability."""
    for q, (share, p) in enumerate(zip(measured.tolist(), priced)):
        assert abs(share - p) <= SIGMAS * math.sqrt(p * (1 - p) / TOKENS), (q, share, p)


def assert_mean(per_token: torch.Tensor, priced: float) -> None:
    """The per-token count's mean within SIGMAS standard errors (sample standard deviation / sqrt N) of `priced`."""
    per_token = per_token.double()
    tolerance = SIGMAS * per_token.std().item() / math.sqrt(TOKENS)
    assert abs(per_token.mean().item() - priced) <= tolerance, (per_token.mean().item(), priced, tolerance)


def deepep_copies_measured(hits: torch.Tensor, per_node: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token, DeepEP's copies from EP rank 0 (node 0) over NVLink and across nodes, counted on the routing
    map: one to each other rank of node 0 it reaches, one RDMA copy to each other node it reaches, which that
    node's receiving rank forwards over NVLink to the node's other ranks it reaches (cost/routing.py's model
    of deep_ep's internode dispatch)."""
    per_rank = hits.view(TOKENS, -1, per_node)  # [tokens, node, rank in node]
    ranks_hit, node_hit = per_rank.sum(dim=-1), per_rank.any(dim=-1)
    nvlink = per_rank[:, 0, 1:].sum(dim=-1) + (ranks_hit[:, 1:] - node_hit[:, 1:].long()).sum(dim=-1)
    return nvlink, node_hit[:, 1:].sum(dim=-1)


@pytest.mark.parametrize("ep", [8, 64])
def test_megatron_routing_without_group_limit_reaches_each_rank_as_priced(ep):
    """Without groups a token's top-8 of 256 i.i.d. scores is any 8 experts alike: by hand it misses a rank's
    E/ep experts with probability C(E - E/ep, 8) / C(E, 8) (EP 8: 1 - C(224, 8) / C(256, 8) = 0.6618 a rank;
    EP 64: 1 - C(252, 8) / C(256, 8) = 0.1199)."""
    local = EXPERTS // ep
    by_hand = 1 - math.comb(EXPERTS - local, TOPK) / math.comb(EXPERTS, TOPK)
    priced = [experts_hit_probability(EXPERTS, TOPK, 1, 1, q * local, (q + 1) * local) for q in range(ep)]
    assert priced == pytest.approx([by_hand] * ep, rel=1e-12)
    hits = rank_hits(megatron_routing_map(None, None), ep)
    assert_shares(hits.double().mean(dim=0), priced)
    # DeepEP sends a token once to each rank it reaches: ep x by_hand copies (EP 8: 5.29, EP 64: 7.68)
    assert dispatch_copies(model(), ep, dispatcher="deepep") == pytest.approx(ep * by_hand)
    assert_mean(hits.sum(dim=1), dispatch_copies(model(), ep, dispatcher="deepep"))


def test_megatron_routing_without_group_limit_gives_deepep_s_copies_per_level():
    """EP 64 as 8 nodes of 8 ranks: DeepEP's copies per level counted on megatron-core's routing map against
    `deepep_level_copies` (across nodes, by hand, 7 x (1 - C(224, 8) / C(256, 8)) = 4.63)."""
    nvlink, across = deepep_copies_measured(rank_hits(megatron_routing_map(None, None, seed=1), 64), per_node=8)
    priced = deepep_level_copies(model(), (8.0, 8.0))
    assert priced[1] == pytest.approx(7 * (1 - math.comb(224, 8) / math.comb(256, 8)))
    assert_mean(nvlink, priced[0])
    assert_mean(across, priced[1])


@pytest.mark.parametrize("groups, group_topk", [(8, 4), (16, 4)])
def test_megatron_group_limit_keeps_each_token_in_its_groups(groups, group_topk):
    """What the cost model builds on (cost/routing.py: 'a token crosses the network to at most K nodes'):
    megatron-core's group-limited top-8 takes every token's experts from at most K of the G groups of E/G
    consecutive experts; with groups aligned to nodes (DeepSeek-V3: EP 64 on 8 nodes, G = 8, K = 4) no token
    crosses to more than K nodes, and the cost model's mean stays below K too. By exchangeability every group is
    among a token's K with probability K/G, so no group (no node) is reached by more than K/G of the tokens."""
    routing_map = megatron_routing_map(groups, group_topk, seed=2)
    hits = rank_hits(routing_map, groups)  # one group a "rank"
    assert int(hits.sum(dim=1).max()) <= group_topk
    assert int(hits.sum(dim=1).min()) >= 1
    p = group_topk / groups
    assert bool((hits.double().mean(dim=0) <= p + SIGMAS * math.sqrt(p * (1 - p) / TOKENS)).all())
    if groups == 8:
        _, across = deepep_copies_measured(rank_hits(routing_map, 64), per_node=8)
        assert int(across.max()) <= group_topk  # the own node, if reached, is one of the K
        assert deepep_level_copies(model(groups, group_topk), (8.0, 8.0))[1] <= group_topk


# Found by these two tests: the cost model drew a token's k experts uniformly from the K E/G experts of its K groups,
# so a picked group might hold none of them; megatron-core picks the K groups by the sum of each group's top k/K
# scores (moe_utils.py:553-556), so a picked group nearly always holds some of the k. It priced fewer ranks and nodes
# reached than megatron-core routes to (EP 8 with G = 8, K = 4: 0.454 a rank priced, 0.494 measured; DeepSeek-V3's
# cross-node copies 3.18 priced, 3.47 measured). The cost model now draws megatron-core's choice (cost/routing.py
# group_counts).


@pytest.mark.parametrize("groups, group_topk, ep", [(8, 4, 8), (8, 4, 16), (16, 4, 8), (16, 4, 16)])
def test_megatron_group_limited_routing_reaches_each_rank_as_priced(groups, group_topk, ep):
    local = EXPERTS // ep
    hits = rank_hits(megatron_routing_map(groups, group_topk, seed=3), ep)
    assert_shares(hits.double().mean(dim=0),
                  [experts_hit_probability(EXPERTS, TOPK, groups, group_topk, q * local, (q + 1) * local)
                   for q in range(ep)])


def test_megatron_node_limited_routing_gives_deepep_s_copies_per_level():
    """DeepSeek-V3's routing (G = 8 groups = nodes, K = 4) on EP 64 as 8 nodes of 8 ranks: DeepEP's copies per
    level counted on megatron-core's routing map against `deepep_level_copies` (measured 3.90 over NVLink and 3.47
    across nodes; priced 3.90 and 3.47 now, 4.07 and 3.18 when the cost model drew the experts uniformly)."""
    nvlink, across = deepep_copies_measured(rank_hits(megatron_routing_map(8, 4, seed=4), 64), per_node=8)
    priced = deepep_level_copies(model(8, 4), (8.0, 8.0))
    assert_mean(nvlink, priced[0])
    assert_mean(across, priced[1])
