"""Activation offloading to host memory (plan.cpu_offloading_num_layers: --cpu-offloading-num-layers): the copies'
exposed time (cost/offload.py, Transformer Engine's default synchroniser played out), the device memory it frees,
megatron-core's rules for it, and the plan that carries it from a user's argv to the emitted flags.

megatron-core's own TransformerConfig refusing what the rules refuse: tests/test_megatron_rules.py
(test_cpu_offloading_rules_as_megatron_core_decides); the NeMo / Bridge fields: tests/test_integrations.py.
"""

from __future__ import annotations

import numpy as np
import pytest
from rich.console import Console

from nest_megatron import api
from nest_megatron.config.load import load
from nest_megatron.cost.offload import exposed_offload_time
from nest_megatron.errors import InfeasibleError, NestError
from nest_megatron.launch.constraints import argv_constraints
from nest_megatron.launch.megatron_rules import name_flags, violations
from nest_megatron.report.explain import runner_describe
from nest_megatron.report.table import render
from nest_megatron.solver.space import searched_offloads

GIB = 2**30
LAYERS = 4


def waits(fwd: float, bwd: float, copy: float, offloaded: int) -> tuple[float, float]:
    """exposed_offload_time of LAYERS equal layers whose copy takes `copy` seconds (bytes at 1 B/s)."""
    return exposed_offload_time(np.full(LAYERS, fwd), np.full(LAYERS, bwd), np.full(LAYERS, copy),
                                offloaded=offloaded, bandwidth=1.0)


def test_copies_shorter_than_the_layers_beside_them_are_hidden():
    # L = 4, n = 2, forward 1 s, backward 2 s, copy 0.5 s. Forward: copy 0 runs 1 .. 1.5, copy 1 2 .. 2.5; layer 2
    # waits for copy 0 (done), layer 3 for copy 1 (done at 2.5, layer 3 starts at 3). Backward (layers 3 .. 0): the
    # copy back of layer 1 starts before layer 2's backward (at 2, done 2.5), of layer 0 before layer 1's (at 4,
    # done 4.5); layer 1 starts at 4, layer 0 at 6: nothing waits.
    assert waits(1.0, 2.0, 0.5, 2) == pytest.approx((0.0, 0.0))


def test_copies_longer_than_the_layers_beside_them_are_exposed():
    # L = 4, n = 2, forward 1 s, backward 2 s, copy 3 s. Forward: copy 0 runs 1 .. 4, copy 1 4 .. 7 (one stream);
    # layer 2 waits for copy 0 until 4 (ends 5), layer 3 for copy 1 until 7 (ends 8): 8 - 4 = 4 s exposed.
    # Backward: layer 3 runs 0 .. 2; the copy back of layer 1 runs 2 .. 5, layer 2 runs 2 .. 4; the copy back of
    # layer 0 runs 5 .. 8; layer 1 waits until 5 (ends 7), layer 0 until 8 (ends 10): 10 - 8 = 2 s exposed.
    assert waits(1.0, 2.0, 3.0, 2) == pytest.approx((4.0, 2.0))


def test_offloading_all_but_the_last_layer_exposes_every_copy():
    # n = L - 1: layer j + 1's forward waits for layer j's copy, which starts when layer j ends, and each backward
    # of an offloaded layer waits for its own copy back, started when the layer after it ends: 3 copies each way.
    assert waits(1.0, 2.0, 0.5, LAYERS - 1) == pytest.approx((1.5, 1.5))


# tiny_gpt (4 layers, h = 256, 8 heads, 4h MLP with GELU, LayerNorm, biases, dropout) at s = 8192 and micro-batch 4,
# one stage on 8 GPUs: every tensor a layer saves has at least the 256Ki elements Transformer Engine offloads
# (cpu_offload.py:443 at v2.12; the smallest, the softmax statistics, b a s = 262,144).
TINY = ["model=tiny_gpt", "model.seq_length=8192", "cluster=dgx_h100_superpod", "cluster.num_devices=8",
        "train.global_batch_size=64", "plan.tp=1", "plan.pp=1", "plan.dp=8", "plan.mbs=4", "plan.recompute=none",
        "plan.zero=1"]
S, B, H, HEADS, MICROBATCHES = 8192, 4, 256, 8, 64 // (4 * 8)
# One layer's saved activations (Korthikanti et al. 2022, eq. 1 without the attention matrix: 34 s b h bytes) plus
# the fused attention's softmax statistics (fp32, one per head and token: 4 b a s bytes).
LAYER_BYTES = 34 * S * B * H + 4 * B * HEADS * S  # 286,261,248
HOST_LINK = 50e9  # h100_sxm's accelerator.host_link_gb_per_s


def offloaded(n: int) -> dict:
    return api.evaluate([*TINY, f"plan.cpu_offloading_num_layers={n}"] if n else TINY).predicted


def test_each_offloaded_layer_frees_its_activations_on_the_device():
    peak = {n: offloaded(n)["peak_memory_gib"] * GIB for n in range(LAYERS)}
    for n in range(1, LAYERS):
        assert peak[0] - peak[n] == pytest.approx(n * LAYER_BYTES, rel=1e-6)


def test_the_step_carries_the_exposed_copies():
    base, exposed = offloaded(0), offloaded(LAYERS - 1)
    # n = 2 of 4 over a 10 TB/s link: each copy (29 us) hides behind a whole layer (a forward of about 2 ms)
    hidden = api.evaluate([*TINY, "plan.cpu_offloading_num_layers=2", "accelerator.host_link_gb_per_s=10000"]).predicted
    assert hidden["breakdown"]["offload"] == 0 and hidden["step_time_s"] == pytest.approx(base["step_time_s"])
    # n = 3 of 4 at 50 GB/s: every copy exposed, 3 each way per micro-batch
    waited = 2 * (LAYERS - 1) * LAYER_BYTES / HOST_LINK * MICROBATCHES
    assert exposed["breakdown"]["offload"] == pytest.approx(waited, rel=1e-6)
    assert exposed["step_time_s"] - base["step_time_s"] == pytest.approx(waited, rel=1e-6)


@pytest.mark.parametrize("overrides, message", [
    (["plan.cpu_offloading_num_layers=4"], r"plan\.cpu_offloading_num_layers=4: .*0\.\.3"),
    (["plan.cpu_offloading_num_layers=2", "plan.pp=2", "plan.dp=4"],
     r"plan\.cpu_offloading_num_layers=2 with plan\.pp=2: .*use plan\.pp=1"),
    (["plan.cpu_offloading_num_layers=2", "plan.recompute=selective"],
     r"plan\.cpu_offloading_num_layers=2 with plan\.recompute=selective: .*use plan\.recompute=none"),
    (["plan.cpu_offloading_num_layers=2", "train.cuda_graphs=true"],
     r"plan\.cpu_offloading_num_layers=2: megatron-core refuses it with train\.cuda_graphs=true .*; drop one"),
    (["plan.cpu_offloading_num_layers=2", "cluster=tpuv4_fat_tree"],
     r"accelerator tpuv4 gives no accelerator\.host_link_gb_per_s"),
    (["plan.cpu_offloading_num_layers=2", "accelerator.host_memory_gib=null"],
     r"accelerator h100_sxm gives no accelerator\.host_memory_gib"),
    (["accelerator.host_memory_gib=0"], r"accelerator\.host_memory_gib=0\.0: must be a finite number > 0"),
])
def test_what_megatron_core_refuses_is_one_line(overrides, message):
    with pytest.raises((NestError, InfeasibleError), match=message):
        api.evaluate([*TINY, *overrides])


def test_a_users_offloading_flag_is_planned_priced_and_emitted():
    argv = ["--num-layers", "4", "--hidden-size", "256", "--cpu-offloading-num-layers", "3"]
    fixed = [item for c in argv_constraints(argv, user=[], pinned=[], model=load(TINY).config.model)
             for item in c.overrides]
    assert {"plan.cpu_offloading_num_layers=3", "plan.pp=1", "plan.recompute=none"} <= set(fixed)
    plan = api.evaluate([*TINY, "plan.cpu_offloading_num_layers=3"])
    assert plan.parallel["cpu_offloading_num_layers"] == 3
    args = plan.megatron_args
    assert args[args.index("--cpu-offloading-num-layers") + 1] == "3"
    assert "--cpu-offloading-num-layers" not in api.evaluate(TINY).megatron_args


def test_a_users_argv_hears_each_offloading_rule_once():
    # the argv rules cpu-offloading-* name the flags; parallel/rules.py's cpu-offloading (the plan's) stays silent there
    argv = ["--num-layers", "8", "--hidden-size", "256", "--num-attention-heads", "8", "--seq-length", "128",
            "--max-position-embeddings", "128", "--micro-batch-size", "1", "--global-batch-size", "64", "--bf16",
            "--cpu-offloading-num-layers", "2", "--pipeline-model-parallel-size", "2"]
    assert violations(argv, world_size=8) == [
        "--cpu-offloading-num-layers with --pipeline-model-parallel-size 2: megatron-core has no CPU offloading with "
        "pipeline parallelism; use pp 1 or drop the offloading"]
    # a plan field is renamed whole: plan.cp is no prefix of plan.cpu_offloading_num_layers
    assert name_flags("plan.cpu_offloading_num_layers=2 with plan.cp=2") == (
        "plan.cpu_offloading_num_layers=2 with --context-parallel-size=2")


# -- searched: solver.cpu_offloading, shares of the layers (off by default) -------------------------------------------

SHARES = "solver.cpu_offloading=[0,0.25,0.5,0.75]"
# Llama 3 70B at 8k tokens, FP8, on 64 GB200 (NVLink-C2C to Grace: 225 GB/s a GPU), as Megatron-Bridge's GB200 recipe
GB200_70B = ["model=llama3_70b", "cluster=gb200_nvl72", "cluster.num_devices=64", "model.seq_length=8192",
             "train.global_batch_size=128", "train.precision=fp8", "train.fp8_recipe=tensorwise"]


@pytest.mark.parametrize("overrides, offloads", [
    ([SHARES], [0, 20, 40, 60]),  # 80 layers
    ([SHARES, "model=tiny_gpt", "solver.cpu_offloading=[0,0.9]"], [0, 3]),  # 0.9 x 4 rounds to 4: at most 3
    ([SHARES, "train.cuda_graphs=true"], [0]),  # megatron-core offloads nothing under per-layer graphs
    ([SHARES, "cluster=tpuv4_fat_tree"], [0]),  # no host link to price the copies over
    ([SHARES, "accelerator.host_memory_gib=null"], [0]),  # no host memory to hold them
    ([], [0]),  # the default: none
])
def test_the_offloads_searched(overrides, offloads):
    loaded = load(["model=llama3_70b", *overrides])
    assert searched_offloads(loaded.problem, loaded.config.solver) == offloads


@pytest.fixture(scope="module")
def searched():
    return api.plan([*GB200_70B, SHARES])


def test_the_search_offloads_where_that_is_fastest(searched):
    """Searched, the plan keeps half the layers' activations in host memory and doubles the micro-batch, which
    without the offload does not fit; it beats the best plan without offloading."""
    plain = api.plan(GB200_70B)
    assert plain.parallel["cpu_offloading_num_layers"] == 0
    n, mbs = searched.parallel["cpu_offloading_num_layers"], searched.micro_batch_size
    assert n in (20, 40, 60) and searched.parallel["pp"] == 1 and searched.recompute["granularity"] is None
    assert searched.predicted["step_time_s"] < plain.predicted["step_time_s"]
    args = searched.megatron_args
    assert args[args.index("--cpu-offloading-num-layers") + 1] == str(n)
    same_layout = [*GB200_70B, f"plan.tp={searched.parallel['tp']}", "plan.pp=1", f"plan.mbs={mbs}",
                   f"plan.zero={searched.zero_stage}", "plan.recompute=none"]
    with pytest.raises(InfeasibleError, match="GiB"):
        api.evaluate(same_layout)


# -- the pinned host memory the offloaded activations take ---------------------------------------------------------------

# One Llama 3 70B layer at 8k tokens, micro-batch 2 (T = 16,384 tokens), TP 1, FP8 (the linears' inputs kept in 1
# byte), each saved tensor in a pinned buffer rounded up to a power of two by PyTorch's caching host allocator:
#   the two norms' inputs 2 h T = 2^28 each; QKV's, the projection's and FC1's inputs h T = 2^27 each;
#   Q 2 T q = 2^28, K and V 2 T kv = 2^25 each (q = 8,192, kv = 8 x 128); the softmax statistics 4 a T = 2^22;
#   FC1's output 2 T (2 x 28,672) = 1,879,048,192 -> 2^31; FC2's input T x 28,672 = 469,762,048 -> 2^29.
PINNED_70B_LAYER = 2 * 2**28 + 3 * 2**27 + 2**28 + 2 * 2**25 + 2**22 + 2**31 + 2**29  # 3,963,617,280
ROUNDED_UP = (2**31 - 1_879_048_192) + (2**29 - 469_762_048)  # what the rounding adds to a layer's 3,628,072,960
GB200_70B_MBS2 = [*GB200_70B, "plan.tp=1", "plan.pp=1", "plan.dp=64", "plan.zero=3", "plan.mbs=2", "plan.recompute=none"]


def test_offloaded_layers_take_their_power_of_two_buffers_in_host_memory():
    predicted = api.evaluate([*GB200_70B_MBS2, "plan.cpu_offloading_num_layers=40"]).predicted
    assert predicted["host_memory_gib"] * GIB == pytest.approx(40 * PINNED_70B_LAYER, rel=1e-9)
    assert predicted["host_capacity_gib"] == 223.5  # gb200.yaml: 480 GB per Grace and its two GPUs
    # the device frees the layers' bytes themselves, the host holds them rounded up
    freed = (predicted["peak_memory_gib"]
             - api.evaluate([*GB200_70B_MBS2, "plan.cpu_offloading_num_layers=60"]).predicted["peak_memory_gib"]) * GIB
    assert freed == pytest.approx(20 * (PINNED_70B_LAYER - ROUNDED_UP), rel=1e-9)
    assert "host_memory_gib" not in offloaded(0)  # nothing offloaded, nothing pinned


def test_more_offloaded_activations_than_the_host_holds_is_one_line():
    # 79 layers: 79 x 3,963,617,280 B = 291.6 GiB, over GB200's 223.5 GiB a GPU
    with pytest.raises(InfeasibleError, match=r"does not fit: 291\.6 GiB of pinned host memory for the offloaded "
                                              r"activations, of 223\.5 GiB a device on gb200; offload fewer layers"):
        api.evaluate([*GB200_70B_MBS2, "plan.cpu_offloading_num_layers=79"])


def test_the_search_offloads_what_the_host_holds(searched):
    """The searched plan keeps its offloaded activations within the host memory: 147.7 GiB with all of GB200's
    223.5 GiB (40 layers at micro-batch 2), and within 100 GiB when that is all a device gets."""
    assert searched.predicted["host_memory_gib"] == pytest.approx(40 * PINNED_70B_LAYER / GIB)
    held = api.plan([*GB200_70B, SHARES, "accelerator.host_memory_gib=100"])
    assert held.predicted.get("host_memory_gib", 0.0) <= 100


@pytest.mark.parametrize("shares, message", [
    ("[]", r"solver\.cpu_offloading=\[\]: list at least one share"),
    ("[0,1.0]", r"solver\.cpu_offloading\[1\]=1\.0: a share of the layers offloaded, from 0 \(none\) to below 1"),
])
def test_a_bad_share_is_one_line(shares, message):
    with pytest.raises(NestError, match=message):
        load([f"solver.cpu_offloading={shares}"])


def test_the_plan_and_its_runners_up_say_what_they_offload(searched):
    console = Console(record=True, width=200)
    render(searched, console)
    n = searched.parallel["cpu_offloading_num_layers"]
    host = searched.predicted["host_memory_gib"]
    assert f"{n} layers' activations in host memory ({host:.1f} of 223.5 GiB pinned)" in console.export_text()
    offloading = [r for r in searched.runners_up if r["plan"]["cpu_offloading_num_layers"]]
    assert offloading
    for r in offloading:
        said = f" · {r['plan']['cpu_offloading_num_layers']} layers' activations in host memory"
        assert runner_describe(r).endswith(said), runner_describe(r)
