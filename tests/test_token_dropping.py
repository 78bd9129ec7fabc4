"""Token dropping (Megatron-LM --moe-expert-capacity-factor, --moe-pad-expert-input-to-capacity) worked out by hand on
tiny_moe (4 layers, h 256, 4 experts, top-2, sequence 128): each expert takes at
most ceil(tokens x topk / experts x factor) of a rank's routed tokens (megatron-core moe_utils.get_capacity), padded
to exactly that many with the padding flag. The expert GEMMs, the dispatch, the permutation and the saved activations
follow; the padded alltoall dispatcher needs no token counts on the host; the flags are read from an argv, emitted,
and refused where Megatron refuses them."""

from __future__ import annotations

import dataclasses

import pytest
from test_cost_terms import GemmOnly, close

from nest_megatron import api
from nest_megatron.config.load import load
from nest_megatron.config.megatron_argv import model_values, scan
from nest_megatron.cost.activations import layer_activation_terms
from nest_megatron.cost.collectives import Network
from nest_megatron.cost.evaluate import context
from nest_megatron.cost.layer import layer_time
from nest_megatron.cost.placement import compute_spans
from nest_megatron.errors import NestError
from nest_megatron.hardware.topology import Level, Topology
from nest_megatron.launch.megatron_rules import violations
from nest_megatron.model.kinds import LayerKind
from nest_megatron.model.spec import ModelSpec
from nest_megatron.parallel.config import ParallelConfig
from nest_megatron.parallel.ranks import identity_placement

KEYS = ["model=tiny_moe"]
PADDED = [*KEYS, "model.moe_expert_capacity_factor=1.1", "model.moe_pad_expert_input_to_capacity=true"]
CLUSTER = ["cluster=dgx_h100_superpod", "cluster.num_devices=8", "train.global_batch_size=64"]
MOE_BLOCK = LayerKind("none", "moe")


def tiny(**changes) -> ModelSpec:
    spec = load(KEYS).problem.model
    return ModelSpec(dataclasses.replace(spec.cfg, **changes))


def expert_rows(spec: ModelSpec, *, tp: int, ep: int, etp: int = 1) -> int:
    gemms = {g.name: g for g in spec.mlp_gemms(MOE_BLOCK, tokens=128, tp=tp, ep=ep, etp=etp)}
    assert gemms["expert_fc1"].m == gemms["expert_fc2"].m
    return gemms["expert_fc1"].m


def test_padded_experts_compute_their_capacity_by_hand():
    # 128 tokens x top-2 over 4 experts: 64 a expert from a rank. Factor 1.1: ceil(70.4) = 71 from each of the
    # etp x ep = 2 ranks: 142 rows an expert (dropless and balanced: 128 x 2 / 2 local experts = 128)
    padded = tiny(moe_expert_capacity_factor=1.1, moe_pad_expert_input_to_capacity=True)
    assert expert_rows(padded, tp=1, ep=2) == 142
    assert expert_rows(tiny(), tp=1, ep=2) == 128
    # TP 2 with SP: the router sees 64 tokens, ceil(64 x 2 / 4 x 1.1) = ceil(35.2) = 36 from each of the 2 ranks: 72
    assert expert_rows(padded, tp=2, ep=2) == 72
    # expert TP 2: each expert takes the capacity of etp x ep = 4 ranks: 144
    assert expert_rows(padded, tp=2, ep=2, etp=2) == 144


def test_the_capacity_is_megatron_core_s():
    from megatron.core.transformer.moe.moe_utils import get_capacity

    padded = tiny(moe_expert_capacity_factor=1.1, moe_pad_expert_input_to_capacity=True)
    assert expert_rows(padded, tp=1, ep=2) == 2 * get_capacity(num_tokens=128 * 2, num_experts=4, capacity_factor=1.1)


def test_the_capacity_caps_the_busiest_expert_and_padding_fills_it():
    # the busiest EP rank's rows over the balanced share: the imbalance, at most the factor when tokens are dropped,
    # exactly the factor when padded
    assert tiny(moe_load_imbalance=1.5).expert_load == 1.5
    assert tiny(moe_load_imbalance=1.5, moe_expert_capacity_factor=1.2).expert_load == 1.2
    assert tiny(moe_load_imbalance=1.5, moe_expert_capacity_factor=2.0).expert_load == 1.5
    assert tiny(moe_load_imbalance=1.5, moe_expert_capacity_factor=1.25,
                moe_pad_expert_input_to_capacity=True).expert_load == 1.25
    # dropped, not padded: 256 routed rows x 1.2 / 2 local experts = 153.6 -> 154
    assert expert_rows(tiny(moe_load_imbalance=1.5, moe_expert_capacity_factor=1.2), tp=1, ep=2) == 154


def test_the_padded_dispatch_carries_the_padding_by_hand():
    cfg = ParallelConfig(ep=2, dp=2)
    topo = Topology("pair", (Level("node", 2, 1e9, 0.0),))
    spans, net = compute_spans(cfg, topo, identity_placement(2)), Network.for_topology(topo)

    def ep_comm(spec):
        return layer_time(spec, cfg=cfg, kind=LayerKind(mlp="moe"), spans=spans, net=net, compute=GemmOnly()).ep_comm

    # 128 tokens x 2 copies x h 256 x 2 B = 131,072 B a device, half of it to the other rank at 1 GB/s: 65.536 us a
    # dispatch, as long a combine, forward and backward; padded at 1.25 each rank sends 1.25 x as many rows
    assert ep_comm(tiny()) == close(4 * 65_536 / 1e9)
    assert ep_comm(tiny(moe_expert_capacity_factor=1.25, moe_pad_expert_input_to_capacity=True)) == close(
        1.25 * 4 * 65_536 / 1e9)


def test_padded_rows_are_saved_as_any_other():
    # the experts' input at TP 1, EP 2, one sequence: 256 routed rows x 256 x 2 B = 131,072; padded at 1.25: 320 rows
    plain = layer_activation_terms(tiny(), mbs=1, tp=1, sp=False, cp=1, kind=MOE_BLOCK)
    padded = layer_activation_terms(tiny(moe_expert_capacity_factor=1.25, moe_pad_expert_input_to_capacity=True),
                                    mbs=1, tp=1, sp=False, cp=1, kind=MOE_BLOCK)
    assert (plain["expert_input"], padded["expert_input"]) == (131_072, 163_840)


@pytest.mark.parametrize("keys, waits", [
    (KEYS, True),  # dropless: the alltoall dispatcher copies the token counts to the host
    (PADDED, False),  # padded: every count is the capacity, known without the device
    ([*PADDED, "train.moe_dispatcher=allgather"], True),  # the allgather dispatcher copies its counts all the same
])
def test_only_the_padded_alltoall_layer_leaves_the_host_free(keys, waits):
    problem = load([*keys, *CLUSTER]).problem
    cfg = ParallelConfig(ep=2, dp=8, sp=False)
    costs = context(problem, cfg).costs
    per_layer = costs.sync_wait[1] - costs.sync_wait[0]
    # a synchronising span waits at least one operator's issue time (host.synchronised_span)
    assert (per_layer >= problem.accelerator.host_overhead_s > 0) == waits
    assert per_layer == 0.0 or waits


def test_the_plan_emits_the_flags_and_reads_them_back():
    plan = api.evaluate([*PADDED, *CLUSTER, "plan.tp=1", "plan.ep=2", "plan.dp=8", "plan.pp=1", "plan.mbs=1"])
    argv = plan.megatron_args
    assert argv[argv.index("--moe-expert-capacity-factor") + 1] == "1.1"
    assert "--moe-pad-expert-input-to-capacity" in argv and violations(argv, world_size=8) == []
    values = model_values(scan(argv))
    assert (values["moe_expert_capacity_factor"], values["moe_pad_expert_input_to_capacity"]) == (1.1, True)
    # and a dropless plan emits neither
    dropless = api.evaluate([*KEYS, *CLUSTER, "plan.tp=1", "plan.ep=2", "plan.dp=8", "plan.pp=1", "plan.mbs=1"])
    assert not {"--moe-expert-capacity-factor", "--moe-pad-expert-input-to-capacity"} & set(dropless.megatron_args)


@pytest.mark.parametrize("keys, message", [
    ([*KEYS, "model.moe_pad_expert_input_to_capacity=true"],
     r"^model.moe_pad_expert_input_to_capacity=true without model.moe_expert_capacity_factor: megatron-core pads"),
    (["model=tiny_gpt", "model.moe_expert_capacity_factor=1.0"],
     r"^model.moe_expert_capacity_factor / moe_pad_expert_input_to_capacity without model.num_experts"),
    ([*KEYS, "model.moe_expert_capacity_factor=0"],
     r"^model.moe_expert_capacity_factor=0.0: must be a finite number > 0, or null \(dropless\)$"),
    ([*PADDED, "train.moe_dispatcher=deepep"],
     r"^model.moe_pad_expert_input_to_capacity=true with train.moe_dispatcher=deepep: megatron-core's DeepEP"),
    ([*PADDED, "model.source=megatron"],
     r"^model.moe_expert_capacity_factor=1.1 with the traced model.source=megatron: the trace routes every token"),
])
def test_token_dropping_megatron_or_the_planner_refuses_is_one_line(keys, message):
    with pytest.raises(NestError, match=message):
        load([*keys, *CLUSTER])


def test_megatron_core_refuses_padding_without_a_factor():
    """The rule pad-needs-capacity is megatron-core's own check (transformer_config.py:1131-1135 at 0.16.1)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    shape = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_moe_experts=4, moe_router_topk=2)
    with pytest.raises(ValueError, match="moe_expert_capacity_factor must be set to use moe_pad_expert_input_to_capacity"):
        TransformerConfig(**shape, moe_pad_expert_input_to_capacity=True)
    TransformerConfig(**shape, moe_pad_expert_input_to_capacity=True, moe_expert_capacity_factor=1.0)


def test_the_launch_rule_refuses_padding_with_deepep():
    argv = api.evaluate([*PADDED, *CLUSTER, "plan.tp=1", "plan.ep=2", "plan.dp=8", "plan.pp=1", "plan.mbs=1"]).megatron_args
    at = argv.index("--moe-token-dispatcher-type") + 1
    flex = [*argv[:at], "flex", *argv[at + 1:], "--moe-flex-dispatcher-backend", "deepep"]
    assert any(v.startswith("--moe-pad-expert-input-to-capacity with --moe-token-dispatcher-type flex (DeepEP)")
               for v in violations(flex, world_size=8))
