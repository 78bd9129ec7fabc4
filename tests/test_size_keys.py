"""Every size-like key is checked at load: zero, negative, NaN / infinite and absurdly large values are one
line naming the key, the value and the allowed range (exit 2, nothing written), next to the edge value
that still loads. `plan.*` = 0 is never read as "unset"."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from nest_megatron.cli import main
from nest_megatron.config.load import load
from nest_megatron.errors import NestError

# tiny_gpt: 4 layers, 8 heads, hidden 256; h100_spine_leaf: 8 GPUs a node, 4 nodes a rack, 32 racks.
BASE = ["model=tiny_gpt", "cluster.num_devices=16", "train.global_batch_size=64"]
PLAN_SIZES = ("tp", "pp", "dp", "cp", "ep", "etp", "vpp", "mbs")


@pytest.mark.parametrize("command", ["plan", "evaluate"])
@pytest.mark.parametrize("key", PLAN_SIZES)
@pytest.mark.parametrize("value", [0, -1])
def test_plan_size_below_one_is_refused_by_the_cli(command, key, value, tmp_path, capsys):
    out = tmp_path / "p.json"
    code = main([command, *BASE, f"plan.{key}={value}", f"out={out}", "--quiet"])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert "\n" not in err and f"plan.{key}={value}: allowed 1.." in err, err
    assert list(tmp_path.iterdir()) == []


def test_a_trillion_devices_answers_at_once(tmp_path):
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "nest_megatron.cli", "plan", "model=tiny_gpt",
                           "cluster.num_devices=1000000000000", f"out={tmp_path / 'p.json'}"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == ("nest-megatron plan: error: cluster.num_devices=1000000000000: allowed 1..1048576")
    assert time.monotonic() - start < 20  # the interpreter's start and imports; the check itself is instant
    assert list(tmp_path.iterdir()) == []


# (bad override, the message, the edge value that loads); each on top of BASE. The bounds: 16 devices, 4 layers,
# 8 heads, a global batch of 64; the fixed caps are those of config/load.py.
BAD = [
    # plan.*: at most the cluster's devices, the model's layers, the global batch
    ("plan.tp=17", r"^plan\.tp=17: allowed 1\.\.16 \(the cluster's devices\)$", "plan.tp=16"),
    ("plan.dp=17", r"^plan\.dp=17: allowed 1\.\.16 \(the cluster's devices\)$", "plan.dp=16"),
    ("plan.ep=1000000000000", r"^plan\.ep=1000000000000: allowed 1\.\.16 ", "plan.ep=16"),
    ("plan.vpp=5", r"^plan\.vpp=5: allowed 1\.\.4 \(model\.num_layers\)$", "plan.vpp=4"),
    ("plan.mbs=65", r"^plan\.mbs=65: allowed 1\.\.64 \(train\.global_batch_size\)$", "plan.mbs=64"),
    ("plan.recompute_num_layers=0", r"^plan\.recompute_num_layers=0: allowed 1\.\.4 ", "plan.recompute_num_layers=1"),
    ("plan.recompute_num_layers=5", r"^plan\.recompute_num_layers=5: allowed 1\.\.4 ", "plan.recompute_num_layers=4"),
    ("plan.zero=4", r"^plan\.zero=4: allowed are 0, 1, 2, 3$", "plan.zero=3"),
    ("plan.zero=-1", r"^plan\.zero=-1: allowed are 0, 1, 2, 3$", "plan.zero=0"),
    ("plan.recompute=partial", r"^plan\.recompute=partial: allowed are none, selective, full$", "plan.recompute=full"),
    ("plan.order=dp-tp", r"^plan\.order=dp-tp: allowed are tp-cp-ep-dp-pp, tp-cp-ep-pp-dp$", "plan.order=tp-cp-ep-pp-dp"),
    # the plan bounds follow the cluster the overrides describe
    ("cluster.num_devices=8", r"^plan\.tp=16: allowed 1\.\.8 ", "cluster.num_devices=16", "plan.tp=16"),
    # cluster
    ("cluster.num_devices=0", r"^cluster\.num_devices=0: allowed 1\.\.1048576$", "cluster.num_devices=8"),
    ("cluster.num_devices=-8", r"^cluster\.num_devices=-8: allowed 1\.\.1048576$", "cluster.num_devices=8"),
    ("cluster.num_devices=2097152", r"^cluster\.num_devices=2097152: allowed 1\.\.1048576$",
     "cluster.num_devices=1048576"),
    ("cluster.levels.0.fan_out=0", r"^cluster\.levels\[0\]\.fan_out=0: allowed 1\.\.1048576$",
     "cluster.levels.0.fan_out=1"),
    # without cluster.num_devices the levels' fan-outs set the device count: 8 * 4 * 32768 = 2^20
    ("cluster.levels.2.fan_out=32769",
     r"^cluster\.levels: fan_outs 8\*4\*32769 = 1048608 devices; allowed 1\.\.1048576$",
     "cluster.levels.2.fan_out=32768", "cluster.num_devices=null"),
    ("cluster.levels.0.bandwidth_gb_per_s=0", r"^cluster\.levels\[0\]\.bandwidth_gb_per_s=0\.0: must be a finite number > 0$",
     "cluster.levels.0.bandwidth_gb_per_s=0.001"),
    ("cluster.levels.0.bandwidth_gb_per_s=inf", r"^cluster\.levels\[0\]\.bandwidth_gb_per_s=inf: must be a finite number > 0$",
     "cluster.levels.0.bandwidth_gb_per_s=1e9"),
    ("cluster.levels.1.latency_s=nan", r"^cluster\.levels\[1\]\.latency_s=nan: must be a finite number >= 0$",
     "cluster.levels.1.latency_s=0"),
    ("cluster.levels.1.oversubscription=0.99", r"^cluster\.levels\[1\]\.oversubscription=0\.99: must be a finite number >= 1$",
     "cluster.levels.1.oversubscription=1"),
    ("cluster.device_memory_gib=0", r"^cluster\.device_memory_gib=0\.0: must be a finite number > 0$",
     "cluster.device_memory_gib=4"),
    ("cluster.device_memory_gib=nan", r"^cluster\.device_memory_gib=nan: must be a finite number > 0$",
     "cluster.device_memory_gib=4"),
    ("cluster.host_level=3", r"^cluster\.host_level=3: must name one of the 3 levels", "cluster.host_level=2"),
    ("cluster.host_level=-1", r"^cluster\.host_level=-1: must name one of the 3 levels", "cluster.host_level=0"),
    # a torus: 4 x 4 x 4 chips
    ("cluster.torus.dims=[4,0,4]", r"^cluster\.torus\.dims\[1\]=0: allowed 1\.\.1048576$", "cluster.torus.dims=[4,1,4]",
     "cluster=torus", "cluster.num_devices=null"),
    ("cluster.torus.dims=[1024,1024,2]", r"^cluster\.torus\.dims: 1024\*1024\*2 = 2097152 devices; allowed 1\.\.1048576$",
     "cluster.torus.dims=[1024,1024,1]", "cluster=torus", "cluster.num_devices=null"),
    ("cluster.torus.link_bandwidth_gb_per_s=0", r"^cluster\.torus\.link_bandwidth_gb_per_s=0\.0: must be a finite number > 0$",
     "cluster.torus.link_bandwidth_gb_per_s=1", "cluster=torus", "cluster.num_devices=null"),
    ("cluster.torus.hop_latency_s=-1e-6", r"^cluster\.torus\.hop_latency_s=-1e-06: must be a finite number >= 0$",
     "cluster.torus.hop_latency_s=0", "cluster=torus", "cluster.num_devices=null"),
    # train
    ("train.global_batch_size=0", r"^train\.global_batch_size=0: allowed 1\.\.1048576$", "train.global_batch_size=1"),
    ("train.global_batch_size=1048577", r"^train\.global_batch_size=1048577: allowed 1\.\.1048576$",
     "train.global_batch_size=1048576"),
    ("train.micro_batch_size=0", r"^train\.micro_batch_size=0: allowed 1\.\.64 \(train\.global_batch_size\)$",
     "train.micro_batch_size=1"),
    ("train.micro_batch_size=65", r"^train\.micro_batch_size=65: allowed 1\.\.64 ", "train.micro_batch_size=64"),
    # solver
    ("solver.micro_batch_sizes=[1,0]", r"^solver\.micro_batch_sizes\[1\]=0: allowed 1\.\.1048576$",
     "solver.micro_batch_sizes=[1,1048576]"),
    ("solver.micro_batch_sizes=[]", r"^solver\.micro_batch_sizes=\[\]: list at least one micro-batch size$",
     "solver.micro_batch_sizes=[1]"),
    ("solver.zero_stages=[0,4]", r"^solver\.zero_stages\[1\]=4: allowed are 0, 1, 2, 3$", "solver.zero_stages=[0,3]"),
    ("solver.recompute=[none,partial]", r"^solver\.recompute\[1\]=partial: allowed are none, selective, full$",
     "solver.recompute=[none,full]"),
    ("solver.rank_orders=[pp-dp]", r"^solver\.rank_orders\[0\]=pp-dp: allowed are tp-cp-ep-dp-pp, tp-cp-ep-pp-dp$",
     "solver.rank_orders=[tp-cp-ep-pp-dp]"),
    ("solver.recompute_num_layers=[null,0]", r"^solver\.recompute_num_layers\[1\]=0: allowed 1\.\.16384$",
     "solver.recompute_num_layers=[null,16384]"),
    ("solver.max_virtual_stages=0", r"^solver\.max_virtual_stages=0: allowed 1\.\.64$", "solver.max_virtual_stages=1"),
    ("solver.max_virtual_stages=65", r"^solver\.max_virtual_stages=65: allowed 1\.\.64$", "solver.max_virtual_stages=64"),
    ("solver.max_context_parallel=0", r"^solver\.max_context_parallel=0: must be an integer >= 1$",
     "solver.max_context_parallel=1"),
    ("solver.top_k=-1", r"^solver\.top_k=-1: must be an integer >= 0$", "solver.top_k=0"),
    ("solver.jobs=0", r"^solver\.jobs=0: allowed 1\.\.1024$", "solver.jobs=1"),
    # model: 800 layers stay a model to plan (the planner answers whether it fits)
    ("model.num_layers=0", r"^model\.num_layers=0: allowed 1\.\.16384$", "model.num_layers=800"),
    ("model.num_layers=16385", r"^model\.num_layers=16385: allowed 1\.\.16384$", "model.num_layers=16384"),
    ("model.hidden_size=0", r"^model\.hidden_size=0: allowed 1\.\.262144$", "model.hidden_size=8"),
    ("model.hidden_size=262152", r"^model\.hidden_size=262152: allowed 1\.\.262144$", "model.hidden_size=262144"),
    ("model.ffn_hidden_size=1048577", r"^model\.ffn_hidden_size=1048577: allowed 1\.\.1048576$",
     "model.ffn_hidden_size=1048576"),
    ("model.num_attention_heads=0", r"^model\.num_attention_heads=0: allowed 1\.\.4096$", "model.num_attention_heads=1"),
    ("model.num_attention_heads=8192", r"^model\.num_attention_heads=8192: allowed 1\.\.4096$",
     "model.num_attention_heads=4096", "model.hidden_size=262144"),
    ("model.num_query_groups=0", r"^model\.num_query_groups=0: allowed 1\.\.8 \(model\.num_attention_heads\)$",
     "model.num_query_groups=1"),
    ("model.num_query_groups=16", r"^model\.num_query_groups=16: allowed 1\.\.8 ", "model.num_query_groups=8"),
    ("model.kv_channels=0", r"^model\.kv_channels=0: allowed 1\.\.4096$", "model.kv_channels=1"),
    ("model.kv_channels=4097", r"^model\.kv_channels=4097: allowed 1\.\.4096$", "model.kv_channels=4096"),
    ("model.seq_length=-128", r"^model\.seq_length=-128: allowed 1\.\.16777216$", "model.seq_length=1"),
    ("model.seq_length=16777217", r"^model\.seq_length=16777217: allowed 1\.\.16777216$", "model.seq_length=16777216"),
    ("model.vocab_size=0", r"^model\.vocab_size=0: allowed 1\.\.4194304$", "model.vocab_size=1"),
    ("model.vocab_size=4194305", r"^model\.vocab_size=4194305: allowed 1\.\.4194304$", "model.vocab_size=4194304"),
    ("model.make_vocab_size_divisible_by=0", r"^model\.make_vocab_size_divisible_by=0: allowed 1\.\.4194304$",
     "model.make_vocab_size_divisible_by=1"),
    ("model.num_experts=0", r"^model\.num_experts=0: allowed 1\.\.32768$", "model.num_experts=1", "model.moe_router_topk=1"),
    ("model.num_experts=32769", r"^model\.num_experts=32769: allowed 1\.\.32768$", "model.num_experts=32768"),
    ("model.moe_router_topk=0", r"^model\.moe_router_topk=0: allowed 1\.\.32768$", "model.moe_router_topk=1"),
    ("model.moe_router_topk=5", r"^model\.moe_router_topk=5: allowed 1\.\.4 \(model\.num_experts\)$",
     "model.moe_router_topk=4", "model=tiny_moe"),
    ("model.moe_ffn_hidden_size=0", r"^model\.moe_ffn_hidden_size=0: allowed 1\.\.1048576$",
     "model.moe_ffn_hidden_size=1", "model=tiny_moe"),
    ("model.moe_shared_expert_intermediate_size=0",
     r"^model\.moe_shared_expert_intermediate_size=0: allowed 1\.\.1048576$",
     "model.moe_shared_expert_intermediate_size=1", "model=tiny_moe"),
    ("model.moe_layer_freq=0", r"^model\.moe_layer_freq=0: allowed 1\.\.16384$", "model.moe_layer_freq=4",
     "model=tiny_moe"),
    # accelerator
    ("accelerator.peak_bf16_tflops=0", r"^accelerator\.peak_bf16_tflops=0\.0: must be a finite number > 0$",
     "accelerator.peak_bf16_tflops=0.5"),
    ("accelerator.peak_bf16_tflops=inf", r"^accelerator\.peak_bf16_tflops=inf: must be a finite number > 0$",
     "accelerator.peak_bf16_tflops=1e6"),
    ("accelerator.memory_gib=-1", r"^accelerator\.memory_gib=-1\.0: must be a finite number > 0$",
     "accelerator.memory_gib=4"),
    ("accelerator.hbm_bandwidth_gb_per_s=nan", r"^accelerator\.hbm_bandwidth_gb_per_s=nan: must be a finite number > 0$",
     "accelerator.hbm_bandwidth_gb_per_s=1"),
    ("accelerator.reserved_memory_gib=-1", r"^accelerator\.reserved_memory_gib=-1\.0: must be a finite number >= 0$",
     "accelerator.reserved_memory_gib=0"),
    ("accelerator.sm_count=0", r"^accelerator\.sm_count=0: allowed 1\.\.4096$", "accelerator.sm_count=1"),
    ("accelerator.kernel_overhead_us=-1", r"^accelerator\.kernel_overhead_us=-1\.0: must be a finite number >= 0$",
     "accelerator.kernel_overhead_us=0"),
    ("accelerator.host_overhead_us=-1", r"^accelerator\.host_overhead_us=-1\.0: must be a finite number >= 0$",
     "accelerator.host_overhead_us=0"),
    ("accelerator.gemm_fp8_efficiency=0", r"^accelerator\.gemm_fp8_efficiency=0\.0: must be in \(0, 1\]$",
     "accelerator.gemm_fp8_efficiency=1"),
    ("model.moe_load_imbalance=0.5", r"^model\.moe_load_imbalance=0\.5: must be a finite number >= 1$",
     "model.moe_load_imbalance=1", "model=tiny_moe"),
    # h100_spine_leaf models 83.82 GiB a device (cluster.device_memory_gib)
    ("accelerator.reserved_memory_gib=83.82",
     r"^accelerator\.reserved_memory_gib=83\.82: must be below the device memory, 83\.82 GiB$",
     "accelerator.reserved_memory_gib=83.8"),
    # profile
    ("profile.warmup=-1", r"^profile\.warmup=-1: allowed 0\.\.1000$", "profile.warmup=0"),
    ("profile.warmup=1001", r"^profile\.warmup=1001: allowed 0\.\.1000$", "profile.warmup=1000"),
    ("profile.repeats=0", r"^profile\.repeats=0: allowed 1\.\.1000$", "profile.repeats=1"),
    ("profile.repeats=1001", r"^profile\.repeats=1001: allowed 1\.\.1000$", "profile.repeats=1000"),
    ("profile.local_devices=0", r"^profile\.local_devices=0: allowed 1\.\.1048576$", "profile.local_devices=1"),
]


@pytest.mark.parametrize("bad, match, good, extra", [(*row[:3], row[3:]) for row in BAD], ids=[row[0] for row in BAD])
def test_each_size_key_is_checked_at_load(bad, match, good, extra):
    load([*BASE, *extra, good])  # the edge value loads
    with pytest.raises(NestError, match=match):
        load([*BASE, *extra, bad])
