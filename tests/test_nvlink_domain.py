"""An NVLink domain above the host (cluster.nvlink_level; GB200 NVL72: 18 trays of 4 GPUs on one NVLink switch
fabric) and MXFP8 on Blackwell: hand-worked collective times inside and across the domain, the search space it
gives, the launch of a TP group that spans trays, the one-line refusals, and MXFP8's bytes and GEMM time.

gb200_nvl72 (hydra_configs/cluster/gb200_nvl72.yaml): levels tray (4 GPUs, 900 GB/s, 3 us), nvl72 (18 trays,
900 GB/s, 3 us), su (8 racks, 50 GB/s, 6 us), spine (SUs, 50 GB/s, 10 us); host_level 0, nvlink_level 1.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from nest_megatron import api
from nest_megatron.cli import main
from nest_megatron.config.load import load
from nest_megatron.config.schema import PlanChoice, SolverConfig
from nest_megatron.cost import fp8
from nest_megatron.cost.collectives import Network, all_reduce_time, all_to_all_time
from nest_megatron.cost.compute import RooflineCompute
from nest_megatron.cost.evaluate import estimate
from nest_megatron.cost.layer import quantisation_bytes
from nest_megatron.cost.placement import compute_spans
from nest_megatron.errors import NestError
from nest_megatron.hardware.topology import irregular
from nest_megatron.launch.devices import Devices
from nest_megatron.launch.megatron_rules import violations
from nest_megatron.launch.placement import host_assignments
from nest_megatron.launch.prepare import prepare
from nest_megatron.model.spec import Gemm
from nest_megatron.parallel.config import ParallelConfig
from nest_megatron.parallel.ranks import GroupShape, host_placements, identity_placement, rank_groups
from nest_megatron.solver.dp import placements
from nest_megatron.solver.space import candidates, tensor_parallel_sizes

ROOT = Path(__file__).resolve().parents[1]
NVL72 = ["cluster=gb200_nvl72"]
NVLINK, IB = 900e9, 50e9  # B/s per GPU per direction
A_NVLINK, A_SU = 3e-6, 6e-6  # s per step


@pytest.fixture(scope="module")
def racks16():
    """llama3_70b on 1,152 GB200 (16 racks, 2 scalable units)."""
    return load(["model=llama3_70b", *NVL72, "cluster.num_devices=1152", "train.global_batch_size=1152"]).problem


# --- collectives, by hand ------------------------------------------------------------------------------------------

def test_tp8_across_two_trays_runs_at_nvlink_and_across_racks_at_the_nic(racks16):
    topo, net = racks16.topology, Network.for_topology(racks16.topology)
    assert (net.bandwidth, net.latency) == ((NVLINK, NVLINK, IB, IB), (A_NVLINK, A_NVLINK, A_SU, 1e-5))
    cfg = ParallelConfig(tp=8, dp=144)
    # Megatron's order: ranks 0-7 on devices 0-7, trays 0 and 1 of rack 0: 4 GPUs in each tray, 2 trays in the rack
    inside = compute_spans(cfg, topo, identity_placement(1152)).tp
    assert inside == (GroupShape((4.0, 2.0, 1.0, 1.0)),)
    # the same group with its second half on tray 18 (rack 1, devices 72-75): 4 a tray, 1 tray a rack, 2 racks
    mapping = identity_placement(1152).copy()
    mapping[4:8], mapping[72:76] = np.arange(72, 76), np.arange(4, 8)
    crossing = [s for s in compute_spans(cfg, topo, mapping).tp if s.top_level == 2]
    assert crossing == [GroupShape((4.0, 1.0, 2.0, 1.0))]
    # all-reduce of S = 64 MiB (one 4096 x 8192 bf16 activation): twice a reduce-scatter, first among the 4 GPUs of a
    # tray on S, then among the 2 trays (or racks) on the S/4 each GPU holds:
    #   inside:   3 x 3 us + 3/4 S / 900 GB/s + 1 x 3 us + 1/2 (S/4) / 900 GB/s = 77.245 us, all-reduce 154.49 us
    #   crossing: 3 x 3 us + 3/4 S / 900 GB/s + 1 x 6 us + 1/2 (S/4) / 50 GB/s   = 238.70 us, all-reduce 477.39 us
    s = 4096 * 8192 * 2
    assert all_reduce_time(inside[0], s, net) == pytest.approx(2 * (9e-6 + 0.75 * s / NVLINK + 3e-6 + s / 8 / NVLINK))
    assert all_reduce_time(inside[0], s, net) == pytest.approx(154.49e-6, rel=1e-4)
    assert all_reduce_time(crossing[0], s, net) == pytest.approx(2 * (9e-6 + 0.75 * s / NVLINK + 6e-6 + s / 8 / IB))
    assert all_reduce_time(crossing[0], s, net) == pytest.approx(477.39e-6, rel=1e-4)


def test_expert_all_to_all_inside_the_domain(racks16):
    """EP 16 over 4 trays of one rack against EP 16 over 4 racks (a tray in each): each GPU sends 15/16 of its
    bytes; inside, 3/16 stay in the tray and 12/16 cross trays, both at NVLink, the slower share sets the time."""
    net = Network.for_topology(racks16.topology)
    inside, spread = GroupShape((4.0, 4.0, 1.0, 1.0)), GroupShape((4.0, 1.0, 4.0, 1.0))
    b = 64 * 2**20  # bytes each GPU holds
    # inside: max(3/16 b, 12/16 b) / 900 GB/s + 3 us + 3 us = 55.92 us + 6 us = 61.92 us
    assert all_to_all_time(inside, b, net) == pytest.approx(12 / 16 * b / NVLINK + 2 * A_NVLINK)
    assert all_to_all_time(inside, b, net) == pytest.approx(61.92e-6, rel=1e-4)
    # spread: 12/16 b crosses racks at the NIC's 50 GB/s x 0.74 (the cluster's all-to-all efficiency) = 37 GB/s:
    # 1,360.3 us + 3 us + 6 us = 1,369.3 us, 22 x slower
    assert all_to_all_time(spread, b, net) == pytest.approx(12 / 16 * b / (0.74 * IB) + A_NVLINK + A_SU)
    assert all_to_all_time(spread, b, net) == pytest.approx(1369.3e-6, rel=1e-4)


# --- the search space ----------------------------------------------------------------------------------------------

def test_tp_reaches_across_trays_but_never_leaves_a_rack(racks16):
    # llama3_70b: 64 heads, 8 query groups: TP 1, 2, 4, 8 (TP 8 spans two trays), as on an 8-GPU host
    assert tensor_parallel_sizes(racks16) == [1, 2, 4, 8]
    solver = SolverConfig(micro_batch_sizes=[1], zero_stages=[1], recompute=["full"], max_virtual_stages=1)
    space = list(candidates(racks16, solver, PlanChoice(), micro_batch_size=None))
    assert {c.tp for c in space} == {1, 2, 4, 8}
    dropped = 0
    for cfg in (c for c in space if c.tp == 8 and c.pp > 1):
        tried = placements(racks16, cfg)
        dropped += len(host_placements(cfg.order, {"tp": 8, "cp": 1, "ep": 1, "dp": cfg.dp, "pp": cfg.pp}, 4, 4)) \
            - len(tried)
        for mapping in tried:
            rank_to_device = identity_placement(cfg.world) if mapping is None else mapping
            # every TP group on the tray or nvl72 level, never su / spine
            assert max(s.top_level for s in compute_spans(cfg, racks16.topology, rank_to_device).tp) == 1
    assert dropped > 0  # host orders that would split a TP group over two racks were on offer, and left out


def test_expert_parallel_sizes_up_to_the_domain():
    """Mixtral with 64 experts on 16 trays of one rack: EP 16, 32 and 64 are searched, inside the NVLink domain."""
    problem = load(["model=mixtral_8x7b", "model.num_experts=64", *NVL72, "cluster.num_devices=64",
                    "train.global_batch_size=512"]).problem
    solver = SolverConfig(micro_batch_sizes=[1], zero_stages=[1], recompute=["full"], max_virtual_stages=1)
    space = list(candidates(problem, solver, PlanChoice(), micro_batch_size=None))
    assert {16, 32, 64} <= {c.ep for c in space}
    cfg = next(c for c in space if c.ep == 64)
    assert compute_spans(cfg, problem.topology, identity_placement(cfg.world)).ep[0].top_level == 1  # nvl72


@pytest.mark.parametrize("cluster, devices, expected", [
    ("dgx_h100_superpod", 256, [1, 2, 4, 8]),  # NVLink ends at the 8-GPU host: as before, the host's divisors
    ("a100_pcie_bridged", 16, [1, 2, 4, 8]),  # host_level 2: the host of 2 x 2 x 2 GPUs
    ("dgx_h100_superpod", 4, [1, 2, 4]),  # half a host
])
def test_without_a_domain_above_the_host_tp_stays_in_the_host(cluster, devices, expected):
    problem = load(["model=llama3_70b", f"cluster={cluster}", f"cluster.num_devices={devices}"]).problem
    assert problem.topology.domain_level == problem.topology.host_level
    assert tensor_parallel_sizes(problem) == expected


@pytest.mark.parametrize("trays, domain", [
    ((18, 18), 72),
    ((10, 8), 40),  # racks of 40 and 32 GPUs: blocks of 8 from device 0 never straddle device 40
    ((9, 10), 36),  # the boundary at 36: TP 8 would put devices 32-39 in two racks
    ((10, 9, 10), 4),  # boundaries 40 and 76
])
def test_a_partial_allocation_keeps_tp_inside_its_racks(racks16, trays, domain):
    topo = irregular(racks16.topology, ((4,) * sum(trays), trays, (len(trays),)))
    assert topo.domain_devices == domain


# --- one-line refusals -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("overrides, message", [
    ([*NVL72, "cluster.nvlink_level=4"], "cluster.nvlink_level=4: must name a level at or above cluster.host_level=0 "
                                         "(an NVLink domain holds whole hosts): 0: tray, 1: nvl72, 2: su, 3: spine"),
    (["cluster=a100_pcie_bridged", "cluster.nvlink_level=1"],
     "cluster.nvlink_level=1: must name a level at or above cluster.host_level=2 (an NVLink domain holds whole "
     "hosts): 2: host, 3: net"),
    (["cluster=torus", "cluster.nvlink_level=0"], "cluster.nvlink_level=0: a torus has no NVLink domain"),
    ([*NVL72, "cluster.num_devices=70"], "cluster.num_devices=70: must be a multiple of 4 (the devices in one tray "
                                         "of cluster gb200_nvl72)"),
    (["cluster=dgx_h100_superpod", "train.precision=fp8", "train.fp8_recipe=mxfp8"],
     "train.fp8_recipe=mxfp8: accelerator h100_sxm has no MXFP8 (block-scaled FP8) in hardware; MXFP8 accelerators: "
     "b200, gb200, gb300; use delayed, tensorwise or blockwise"),
])
def test_descriptions_that_do_not_add_up_are_one_line(overrides, message, tmp_path, capsys):
    with pytest.raises(NestError) as err:
        load(["model=tiny_gpt", *overrides])
    assert str(err.value).startswith(message) and "\n" not in str(err.value)
    out = tmp_path / "p.json"
    assert main(["plan", "model=tiny_gpt", *overrides, f"out={out}", "--quiet"]) == 2
    assert capsys.readouterr().err.strip().startswith(f"nest-megatron plan: error: {message}")
    assert list(tmp_path.iterdir()) == []


# --- the launch of a TP group that spans trays ---------------------------------------------------------------------

LLAMA_ARGV = ("--num-layers 80 --hidden-size 8192 --ffn-hidden-size 28672 --num-attention-heads 64 "
              "--group-query-attention --num-query-groups 8 --seq-length 4096 --max-position-embeddings 4096 "
              "--swiglu --position-embedding-type rope --normalization RMSNorm --untie-embeddings-and-output-weights "
              "--disable-bias-linear --vocab-size 128256 --bf16 --lr 1e-4").split()
PINNED = ["train.global_batch_size=576", "plan.tp=8", "plan.pp=1", "plan.mbs=1", "plan.zero=1",
          "plan.recompute=full", "plan.vpp=1"]


def test_eighteen_trays_run_nine_tp_groups_of_two_trays_each():
    """TP 8 x DP 9 on one rack (18 trays of 4): Megatron's tp-cp-ep-dp-pp order makes rank r = tp + 8 dp, so TP group
    j is ranks 8j .. 8j + 7; torchrun gives node k ranks 4k .. 4k + 3 (--node-rank k, GPUs 0-3 in order): TP group j
    is trays 2j and 2j + 1, and the plan places rank r on device r."""
    hosts = tuple(f"gb{i:02d}" for i in range(18))
    prepared = prepare(overrides=[*NVL72, *PINNED], script="scripts/pretrain_gpt.py", script_args=LLAMA_ARGV,
                       devices=Devices(num_nodes=18, per_node=4, hosts=hosts, master_addr="gb00"))
    plan = prepared.plan
    assert (plan.parallel["tp"], plan.parallel["dp"], plan.world_size) == (8, 9, 72)
    assert plan.rank_to_device == list(range(72))
    assert plan.group_levels["tp"] == "nvl72"
    groups = rank_groups(plan.rank_order, {"tp": 8, "cp": 1, "ep": 1, "dp": 9, "pp": 1}, "tp")
    assert groups.tolist() == [list(range(8 * j, 8 * j + 8)) for j in range(9)]
    assert [c.node_rank for c in prepared.commands] == list(range(18))
    for k, command in enumerate(prepared.commands):
        assert command.env["CUDA_VISIBLE_DEVICES"] == "0,1,2,3"
        assert command.env["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"  # TP > 1 (Megatron asserts it below Blackwell)
        line = command.render()
        assert f"--node-rank {k} " in line and "--nnodes 18 --nproc-per-node 4" in line
    # each TP group: two consecutive trays of the same rack
    assert [sorted({r // 4 for r in g}) for g in groups.tolist()] == [[2 * j, 2 * j + 1] for j in range(9)]


def test_two_racks_keep_every_tp_group_in_one_rack():
    """TP 8 x PP 2 on two racks (36 trays), the node order the planner's: whatever it chooses, the hosts holding a
    TP group's ranks are of one rack, and torchrun's node ranks realise the map."""
    hosts = tuple(f"gb{i:02d}" for i in range(36))
    prepared = prepare(overrides=[*NVL72, *PINNED[:2], "plan.pp=2", *PINNED[3:]], script="scripts/pretrain_gpt.py",
                       script_args=LLAMA_ARGV, devices=Devices(num_nodes=36, per_node=4, hosts=hosts,
                                                               master_addr="gb00"))
    plan = prepared.plan
    p = plan.parallel
    to_device = np.asarray(plan.rank_to_device)
    for group in rank_groups(plan.rank_order, {"tp": 8, "cp": 1, "ep": 1, "dp": p["dp"], "pp": 2}, "tp"):
        assert len({int(d) // 72 for d in to_device[group]}) == 1  # one rack (72 devices)
    # torchrun node rank k holds ranks 4k .. 4k + 3: the host of device rank_to_device[4k], its GPUs in local-rank
    # order; the command of that node carries the same CUDA_VISIBLE_DEVICES
    env_of = {c.node_rank: c.env for c in prepared.commands}
    for a in host_assignments(plan, hosts):
        devices = to_device[4 * a.node_rank:4 * a.node_rank + 4]
        assert {int(d) // 4 for d in devices} == {hosts.index(a.host)}
        assert a.cuda_visible_devices == tuple(int(d) % 4 for d in devices)
        assert env_of[a.node_rank]["CUDA_VISIBLE_DEVICES"] == ",".join(map(str, a.cuda_visible_devices))


def test_dry_run_on_eighteen_trays_prints_each_nodes_command(tmp_path):
    exe = Path(sys.executable).parent / "nest-megatron"
    proc = subprocess.run([str(exe), "launch", *NVL72, *PINNED, "--nnodes", "18", "--nproc-per-node", "4",
                           "--master-addr", "gb00", "--dry-run", "--", "scripts/pretrain_gpt.py", *LLAMA_ARGV],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if " torchrun " in f" {line}"]
    assert len(lines) == 18
    for k, line in enumerate(lines):
        assert line.startswith("CUDA_DEVICE_MAX_CONNECTIONS=1 CUDA_VISIBLE_DEVICES=0,1,2,3 torchrun --nnodes 18 "
                               f"--nproc-per-node 4 --node-rank {k} --master-addr gb00 ")
        assert "--tensor-model-parallel-size 8 " in line


# --- MXFP8 on Blackwell --------------------------------------------------------------------------------------------

def test_mxfp8_bytes_per_element():
    # read bf16 (2) + rowwise and columnwise copies, each 1 B and an E8M0 scale per 32 elements (1/32 B)
    assert fp8.quantise_bytes("mxfp8", any_layout=True) == 2 + 2 * (1 + 1 / 32) == 4.0625
    assert fp8.quantise_bytes("mxfp8", any_layout=False) == 4.0625  # its transpose is quantised apart everywhere
    assert fp8.quantise_bytes("delayed", any_layout=False) == 4.0  # Hopper: the copy and its transpose
    assert fp8.quantise_bytes("delayed", any_layout=True) == 3.0  # Blackwell: one copy serves both GEMM layouts
    assert fp8.quantise_bytes("tensorwise", any_layout=True) == 5.0  # + one more bf16 read for the amax
    assert fp8.quantise_bytes("blockwise", any_layout=False) == 2 + 2 * (1 + 4 / 128)  # fp32 scale per 1 x 128
    assert fp8.weight_copy_bytes("mxfp8", any_layout=True) == 2.0625
    assert fp8.weight_copy_bytes("delayed", any_layout=True) == 1.0
    assert fp8.weight_copy_bytes("delayed", any_layout=False) == 2.0
    assert fp8.saved_input_bytes("mxfp8") == 1 + 1 / 32


def test_mxfp8_gemm_and_cast_of_one_shape_on_gb200():
    """Llama 3 70B's FC1 at TP 8, one 4096-token micro-batch: [4096, 8192] @ [8192, 7168] (2 x 28672 / 8).

    GEMM: 32 x 28 = 896 tiles of 128 x 256 on 152 SMs = 6 waves (5 x 152 = 760 < 896), each tile 2 x 128 x 256 x
    8192 FLOP, at 5 PFLOP/s x 0.792 = 3.96 PFLOP/s: 6 x 152 x 536,870,912 / 3.96e15 = 123.64 us; its bytes
    (1-byte operands 33,554,432 + 58,720,256, the bf16 output 58,720,256 = 150,994,944 B) at 8 TB/s x 0.396 take
    47.66 us, so the tiles set it, plus the 54.4 us kernel overhead: 178.04 us.
    Cast: the 4096 x 8192 input at 4.0625 B an element = 136,314,880 B forward; the [4096, 7168] output gradient at
    4.0625 B = 119,275,520 B backward."""
    problem = load(["model=llama3_70b", *NVL72, "cluster.num_devices=72", "train.precision=fp8",
                    "train.fp8_recipe=mxfp8"]).problem
    gemm = Gemm("fc1", 4096, 7168, 8192)
    waves_time = 6 * 152 * 2 * 128 * 256 * 8192 / (5e15 * 0.792)
    assert RooflineCompute(problem.accelerator, fp8=True).gemm_time(gemm) == pytest.approx(waves_time + 54.4e-6)
    assert waves_time + 54.4e-6 == pytest.approx(178.04e-6, rel=1e-4)
    fwd, bwd = quantisation_bytes(problem.model, [gemm])
    assert (fwd, bwd) == (4096 * 8192 * 4.0625, 4096 * 7168 * 4.0625) == (136_314_880, 119_275_520)


def test_mxfp8_keeps_its_weight_copies_and_is_emitted_with_e4m3():
    """Llama 3 70B at TP 8 x PP 4 on GB200: each stage's 20 layers cache MXFP8 weights (2 + 2/32 B a parameter)
    where delayed scaling on Blackwell keeps one copy (1 B): 1.0625 B a local parameter more."""
    base = ["model=llama3_70b", *NVL72, "cluster.num_devices=72", "train.global_batch_size=576", "train.precision=fp8"]
    cfg = ParallelConfig(tp=8, pp=4, dp=2, sp=True, mbs=1, zero=1, recompute="full")
    mx = load([*base, "train.fp8_recipe=mxfp8"]).problem
    delayed = load([*base, "train.fp8_recipe=delayed"]).problem
    layer = sum(mx.model.layer_params(tp=8))
    extra = [a.weights - b.weights for a, b in zip(estimate(mx, cfg).memory, estimate(delayed, cfg).memory)]
    assert extra == pytest.approx([1.0625 * 20 * layer] * 4)
    plan = api.evaluate([*base, "train.fp8_recipe=mxfp8", "plan.tp=8", "plan.pp=4"])
    args = plan.megatron_args
    i = args.index("--fp8-format")
    assert args[i:i + 4] == ["--fp8-format", "e4m3", "--fp8-recipe", "mxfp8"]
    assert violations(args, world_size=plan.world_size) == []
