"""Config loading: every shipped option loads, every key can be overridden, and each bad input
fails as one NestError line naming the key, next to an input that is allowed."""

from __future__ import annotations

from dataclasses import fields

import pytest

from nest_megatron.config.load import GROUPS, load, options
from nest_megatron.config.schema import (
    AcceleratorConfig,
    ClusterConfig,
    LevelConfig,
    ModelConfig,
    PlanChoice,
    ProfileConfig,
    SolverConfig,
    TorusConfig,
    TrainConfig,
)
from nest_megatron.cost.collectives import Network
from nest_megatron.errors import NestError

GIB = 2**30
TINY = "model=tiny_gpt"  # a small model keeps the loads quick


@pytest.mark.parametrize("group, name", [(g, n) for g in GROUPS for n in options(g)])
def test_every_shipped_option_loads(group, name):
    loaded = load([f"{group}={name}"])
    if group != "train":  # TrainConfig has no name
        assert getattr(loaded.config, group).name == name
    assert loaded.problem.num_devices > 0


def test_every_group_has_options():
    # model, accelerator, cluster, train, solver: at least one YAML each, and the defaults exist
    for group, default in (("model", "llama3_70b"), ("accelerator", "h100_sxm"), ("cluster", "h100_spine_leaf"),
                           ("train", "default"), ("solver", "enumerate")):
        assert default in options(group)


@pytest.mark.parametrize(
    "overrides, devices",
    [
        ([], 1024),  # h100_spine_leaf: 8 x 4 x 32
        (["cluster.num_devices=64"], 64),
        (["cluster=dgx_h100_superpod"], 8 * 32 * 4),
        (["cluster=dgx_a100_superpod"], 8 * 20 * 7),
        (["cluster=torus"], 4 * 4 * 4),
        (["cluster=tpuv4_fat_tree"], 8 * 4 * 32),
    ],
)
def test_cluster_device_counts(overrides, devices):
    assert load([TINY, *overrides]).problem.num_devices == devices


def test_cluster_accelerator_and_si_units():
    # dgx_h100_superpod picks the H100: 989.4 TFLOP/s -> 9.894e14 FLOP/s, 79.6 GiB, 3350 GB/s
    p = load([TINY, "cluster=dgx_h100_superpod"]).problem
    assert p.accelerator.name == "h100_sxm"
    assert p.accelerator.peak_flops == pytest.approx(989.4e12)
    assert p.accelerator.memory_bytes == pytest.approx(79.6 * GIB)
    assert p.accelerator.hbm_bandwidth == pytest.approx(3350e9)
    # node level: 450 GB/s, 3 us; su level 50 GB/s
    assert [lv.bandwidth for lv in p.topology.levels] == pytest.approx([450e9, 50e9, 50e9])
    assert p.topology.levels[0].latency == pytest.approx(3e-6)
    # torus: a ring along one dimension uses both links: 2 x 50 GB/s; k = 4 -> 4/4 = 1 hop
    t = load([TINY, "cluster=torus"]).problem.topology
    assert [lv.bandwidth for lv in t.levels] == pytest.approx([100e9] * 3)
    assert [lv.latency for lv in t.levels] == pytest.approx([1e-6] * 3)
    # the spine-leaf cluster models 83.82 GiB per device instead of the H100's 79.6
    assert load([TINY]).problem.accelerator.memory_bytes == pytest.approx(83.82 * GIB)


def test_model_overrides():
    m = load(["model.num_layers=48", "model.hidden_size=8192"]).config.model
    assert (m.name, m.num_layers, m.hidden_size) == ("llama3_70b", 48, 8192)


# One override per key of every section; the sets below must name every field of the schema, so
# a key added to the schema without a test here fails test_every_key_is_listed.
MODEL_KEYS = {
    "name": ("m", "m"), "family": ("gpt", "gpt"), "num_layers": ("48", 48), "hidden_size": ("8192", 8192),
    "ffn_hidden_size": ("16384", 16384), "num_attention_heads": ("32", 32), "num_query_groups": ("4", 4),
    "kv_channels": ("128", 128), "seq_length": ("2048", 2048), "vocab_size": ("32000", 32000),
    "make_vocab_size_divisible_by": ("64", 64), "padded_vocab_size": ("131072", 131072),
    # a hybrid pattern and its Mamba sizes: tests/test_mamba_hybrid.py loads hybrid models
    "hybrid_layer_pattern": ("null", None), "mamba_state_dim": ("64", 64), "mamba_head_dim": ("32", 32),
    "mamba_num_groups": ("4", 4), "mamba_num_heads": ("16", 16), "swiglu": ("false", False),
    "untie_embeddings_and_output_weights": ("false", False), "position_embedding_type": ("learned_absolute", "learned_absolute"),
    "normalization": ("LayerNorm", "LayerNorm"), "add_bias_linear": ("true", True), "hidden_dropout": ("0.1", 0.1),
    "attention_dropout": ("0.05", 0.05), "attention_backend": ("unfused", "unfused"),
    "attention_softmax_in_fp32": ("true", True), "bias_swiglu_fusion": ("false", False), "num_experts": ("8", 8),
    "moe_router_topk": ("1", 1), "moe_ffn_hidden_size": ("4096", 4096),
    "moe_shared_expert_intermediate_size": ("2048", 2048), "moe_shared_expert_overlap": ("true", True),
    "moe_layer_freq": ("2", 2),
    # a latent size needs Transformer Engine's spec, not the local one set below: tests/test_latent_moe.py loads them
    "moe_latent_size": ("null", None),
    "squared_relu": ("true", True), "qk_layernorm": ("true", True), "window_size": ("512", 512),
    "window_attn_skip_freq": ("4", 4), "moe_load_imbalance": ("1.2", 1.2),
    "moe_expert_capacity_factor": ("1.25", 1.25), "moe_pad_expert_input_to_capacity": ("true", True),
    "moe_router_num_groups": ("2", 2), "moe_router_group_topk": ("1", 1), "kv_lora_rank": ("64", 64),
    "qk_head_dim": ("64", 64), "qk_pos_emb_head_dim": ("32", 32), "v_head_dim": ("64", 64),
    "mtp_num_layers": ("1", 1), "mtp_loss_scaling_factor": ("0.3", 0.3), "mtp_use_repeated_layer": ("true", True),
    # a hybrid stack's depth: tests/test_hybrid_mtp.py
    "mtp_hybrid_pattern": ("null", None), "transformer_impl": ("local", "local"),
    "softmax_type": ("off-by-one", "off-by-one"),
    # MLA excludes the query groups set above: tests/test_layer_kinds.py loads MLA models
    "multi_latent_attention": ("false", False), "q_lora_rank": ("null", None),
    # model.source and its paths: tests/test_trace.py loads the traced sources and their errors.
    "source": ("analytic", "analytic"), "hf_config": ("null", None), "module": ("null", None),
}
ACCELERATOR_KEYS = {
    "name": ("acc", "acc"), "peak_bf16_tflops": ("500", 500.0), "memory_gib": ("40", 40.0),
    "hbm_bandwidth_gb_per_s": ("1000", 1000.0), "gemm_efficiency": ("0.5", 0.5), "attention_efficiency": ("0.4", 0.4),
    "memory_bound_efficiency": ("0.7", 0.7), "reserved_memory_gib": ("2", 2.0),
    "peak_fp8_tflops": ("1000", 1000.0), "mxfp8": ("true", True), "gemm_fp8_efficiency": ("0.5", 0.5),
    "sm_count": ("108", 108), "kernel_overhead_us": ("10", 10.0), "host_overhead_us": ("5", 5.0),
    "fp8_gemm_any_layout": ("true", True), "host_link_gb_per_s": ("64", 64.0), "host_memory_gib": ("128", 128.0),
}
CLUSTER_KEYS = {
    "name": ("c", "c"), "topology": ("hierarchical", "hierarchical"), "num_devices": ("64", 64),
    "device_memory_gib": ("70", 70.0), "host_level": ("1", 1), "nvlink_level": ("2", 2),
}
LEVEL_KEYS = {
    "name": ("board", "board"), "fan_out": ("4", 4), "bandwidth_gb_per_s": ("100", 100.0), "latency_s": ("1e-6", 1e-6),
    "oversubscription": ("1.5", 1.5), "efficiency": ("0.7", 0.7),
    "all_to_all_efficiency": ("0.6", 0.6),
}
TORUS_KEYS = {
    "dims": ("[2,2,2]", [2, 2, 2]), "link_bandwidth_gb_per_s": ("25", 25.0), "hop_latency_s": ("2e-6", 2e-6),
}
TRAIN_KEYS = {
    "global_batch_size": ("512", 512), "micro_batch_size": ("2", 2), "overlap_grad_reduce": ("false", False),
    "overlap_param_gather": ("false", False), "precision": ("bf16", "bf16"), "fp8_recipe": ("tensorwise", "tensorwise"),
    "tp_comm_overlap": ("true", True), "grad_reduce_in_bf16": ("true", True), "cross_entropy_fusion": ("true", True),
    "precision_aware_optimizer": ("true", True), "main_params_dtype": ("fp16", "fp16"), "exp_avg_dtype": ("bf16", "bf16"),
    "exp_avg_sq_dtype": ("fp8", "fp8"), "moe_dispatcher": ("deepep", "deepep"), "cuda_graphs": ("true", True),
    "delay_wgrad_compute": ("false", False),  # true needs a MoE model (tests/test_a2a_overlap.py)
    "defer_embedding_wgrad_compute": ("true", True),
}
SOLVER_KEYS = {
    "name": ("enumerate", "enumerate"), "micro_batch_sizes": ("[1,2]", [1, 2]), "zero_stages": ("[1]", [1]),
    "recompute": ("[none]", ["none"]), "rank_orders": ("[tp-cp-ep-dp-pp]", ["tp-cp-ep-dp-pp"]),
    "max_virtual_stages": ("2", 2), "max_context_parallel": ("2", 2), "top_k": ("3", 3),
    "recompute_num_layers": ("[null,1]", [None, 1]), "jobs": ("2", 2), "allow_idle": ("false", False),
    "cp_comm_types": ("[p2p,a2a]", ["p2p", "a2a"]), "moe_a2a_overlap": ("[false]", [False]),
    "cpu_offloading": ("[0,0.5]", [0, 0.5]),
}
SPLIT_FORM_KEYS = ("account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split",
                   "decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers",
                   "pipeline_model_parallel_layout")
PROFILE_KEYS = {
    "warmup": ("1", 1), "repeats": ("2", 2), "local_devices": ("2", 2), "layers": ("false", False), "use": ("false", False),
    "allow_cpu": ("true", True),
}
PLAN_KEYS = {
    "tp": ("2", 2), "pp": ("2", 2), "dp": ("4", 4), "cp": ("1", 1), "ep": ("1", 1), "etp": ("1", 1), "vpp": ("1", 1),
    "sp": ("true", True), "mbs": ("1", 1), "zero": ("1", 1), "recompute": ("full", "full"),
    "recompute_num_layers": ("1", 1), "order": ("tp-cp-ep-pp-dp", "tp-cp-ep-pp-dp"),
    "layers_per_stage": ("[1,3]", [1, 3]), "cp_comm_type": ("a2a", "a2a"), "pick": ("0", 0),
    "moe_a2a_overlap": ("false", False),  # true needs a MoE model (tests/test_a2a_overlap.py); the tiny model is dense
    "distributed_optimizer_instances": ("2", 2),
    "cpu_offloading_num_layers": ("2", 2),  # with pp 1 and no recompute only: tests/test_cpu_offloading.py
    "microbatch_group_size_per_vp_stage": ("4", 4),  # read with vpp > 1: tests/test_microbatch_groups.py
}


@pytest.mark.parametrize(
    "schema, keys",
    [
        (ModelConfig, MODEL_KEYS), (AcceleratorConfig, ACCELERATOR_KEYS),
        # nodes, failed_nodes and topology_conf: overridden in tests/test_allocation.py (node lists and a file that
        # go together)
        (ClusterConfig, {**CLUSTER_KEYS, "levels": None, "torus": None, "nodes": None, "failed_nodes": None,
                         "topology_conf": None}),
        (LevelConfig, LEVEL_KEYS),
        (TorusConfig, TORUS_KEYS), (TrainConfig, TRAIN_KEYS), (SolverConfig, SOLVER_KEYS),
        # the split's flag forms: one at a time (at most one form is given), in tests/test_pipeline_layouts.py;
        # recompute_modules (selective's, not full's as here) in tests/test_recompute_modules.py
        (PlanChoice, {**PLAN_KEYS, **dict.fromkeys(SPLIT_FORM_KEYS), "recompute_modules": None}),
        (ProfileConfig, PROFILE_KEYS),
    ],
)
def test_every_key_is_listed(schema, keys):
    assert set(keys) == {f.name for f in fields(schema)}


@pytest.mark.parametrize(
    "section, keys, extra",
    [
        ("model", MODEL_KEYS, []),
        ("accelerator", ACCELERATOR_KEYS, [TINY]),
        ("cluster", CLUSTER_KEYS, [TINY]),
        ("cluster.levels.0", LEVEL_KEYS, [TINY]),
        ("cluster.torus", TORUS_KEYS, [TINY, "cluster=torus"]),
        ("train", TRAIN_KEYS, [TINY]),
        ("solver", SOLVER_KEYS, [TINY]),
        ("plan", PLAN_KEYS, [TINY]),
        ("profile", PROFILE_KEYS, [TINY]),
    ],
)
def test_every_key_can_be_overridden(section, keys, extra):
    loaded = load([*extra] + [f"{section}.{k}={text}" for k, (text, _) in keys.items()])
    node = loaded.config
    for part in section.split("."):
        node = node[int(part)] if part.isdigit() else getattr(node, part)
    for key, (_, value) in keys.items():
        assert getattr(node, key) == value, key


def test_overridden_values_reach_the_problem_in_si_units():
    p = load([TINY, "accelerator.peak_bf16_tflops=500", "accelerator.hbm_bandwidth_gb_per_s=1000",
              "accelerator.reserved_memory_gib=2", "cluster.device_memory_gib=70",
              "cluster.levels.0.bandwidth_gb_per_s=100", "cluster.levels.0.latency_s=1e-6",
              "cluster.levels.1.oversubscription=1.5", "cluster.levels.1.efficiency=0.5", "train.global_batch_size=512",
              "train.overlap_grad_reduce=false", "out=/tmp/x.json"])
    a = p.problem.accelerator
    assert (a.peak_flops, a.hbm_bandwidth) == pytest.approx((5e14, 1e12))
    assert (a.memory_bytes, a.reserved_memory_bytes) == pytest.approx((70 * GIB, 2 * GIB))
    lv = p.problem.topology.levels
    assert (lv[0].bandwidth, lv[0].latency, lv[1].oversubscription) == pytest.approx((1e11, 1e-6, 1.5))
    # h100_spine_leaf's rack level: 12.5 GB/s at half its bandwidth (its oversubscription 1.5 with every device busy
    # takes 1 / 1.5 of that), the node level untouched
    net = Network.for_topology(p.problem.topology)
    assert (lv[1].efficiency, net.bandwidth[0], net.bandwidth[1]) == pytest.approx((0.5, 1e11, 12.5e9 * 0.5 / 1.5))
    assert p.problem.global_batch_size == 512 and p.problem.overlap_grad_reduce is False
    assert p.config.out == "/tmp/x.json"


# (bad overrides, what the message must say, allowed overrides next to it)
BAD = {
    "misspelt key": (["model.num_layer=4"], r"model\.num_layer: no such key; did you mean model\.num_layers\?",
                     ["model.num_layers=4"]),
    "misspelt section": (["trian.global_batch_size=8"], r"trian\.global_batch_size: no such key.*train",
                         ["train.global_batch_size=8"]),
    "moved key": (["train.moe_a2a_overlap=false"], r"^train\.moe_a2a_overlap: moved to plan\.moe_a2a_overlap",
                  ["plan.moe_a2a_overlap=false"]),
    "unknown group option": (["model=tiny_gtp"], r"model=tiny_gtp: unknown model; choose one of: .*tiny_gpt",
                             ["model=tiny_gpt"]),
    "wrong type": (["model.num_layers=abc"], r"model\.num_layers=abc: expected", ["model.num_layers=12"]),
    "wrong type bool": (["model.swiglu=maybe"], r"model\.swiglu=maybe: expected", ["model.swiglu=true"]),
    "heads do not divide hidden": (["model.hidden_size=250"],
                                   r"model\.num_attention_heads=8: must divide model\.hidden_size=250",
                                   ["model.hidden_size=264"]),
    "query groups do not divide heads": (["model.num_query_groups=3"],
                                         r"model\.num_query_groups=3: must divide model\.num_attention_heads=8",
                                         ["model.num_query_groups=4"]),
    # 125 nodes fill racks of 4 nodes partly (a partial tree); a part of a node is no host
    "num_devices not whole nodes": (["cluster.num_devices=1001"],
                                    r"cluster\.num_devices=1001: must be a multiple of 8 \(the devices in one node",
                                    ["cluster.num_devices=1000"]),
    "num_devices inside a node not a multiple": (["cluster.num_devices=20"],
                                                 r"cluster\.num_devices=20: must be a multiple of 8",
                                                 ["cluster.num_devices=24"]),
    "negative bandwidth": (["cluster.levels.0.bandwidth_gb_per_s=-1"],
                           r"cluster\.levels\[0\]\.bandwidth_gb_per_s=-1\.0: must be a finite number > 0",
                           ["cluster.levels.0.bandwidth_gb_per_s=1"]),
    "negative latency": (["cluster.levels.1.latency_s=-1e-6"], r"cluster\.levels\[1\]\.latency_s=-1e-06: must be a finite number >= 0",
                         ["cluster.levels.1.latency_s=0"]),
    "oversubscription below 1": (["cluster.levels.1.oversubscription=0.5"],
                                 r"cluster\.levels\[1\]\.oversubscription=0\.5: must be a finite number >= 1",
                                 ["cluster.levels.1.oversubscription=1"]),
    "level efficiency above 1": (["cluster.levels.1.efficiency=1.2"],
                                 r"cluster\.levels\[1\]\.efficiency=1\.2: must be in \(0, 1\], a fraction of the "
                                 r"level's bandwidth", ["cluster.levels.1.efficiency=0.7"]),
    "all-to-all efficiency 0": (["cluster.levels.1.all_to_all_efficiency=0"],
                                r"cluster\.levels\[1\]\.all_to_all_efficiency=0\.0: must be in \(0, 1\]",
                                ["cluster.levels.1.all_to_all_efficiency=0.5"]),
    "efficiency above 1": (["accelerator.gemm_efficiency=1.5"], r"accelerator\.gemm_efficiency=1\.5: must be in \(0, 1\]",
                           ["accelerator.gemm_efficiency=1.0"]),
    "unknown topology": (["cluster.topology=mesh"], r"cluster\.topology=mesh: allowed are hierarchical, torus",
                         ["cluster.topology=hierarchical"]),
    "bad attention backend": (["model.attention_backend=fast"],
                              r"model\.attention_backend=fast: allowed are auto, flash, fused, unfused, local",
                              ["model.attention_backend=unfused"]),
    # megatron-core's TransformerConfig.softmax_type choices; "sink" is no softmax of its
    "bad softmax type": (["model.softmax_type=sink"], r"model\.softmax_type=sink: allowed are vanilla, off-by-one, learnable",
                         ["model.softmax_type=learnable"]),
    # Megatron-LM's --cp-comm-type help spells it allgather; Transformer Engine knows all_gather only
    "bad cp exchange": (["plan.cp_comm_type=allgather"], r"plan\.cp_comm_type=allgather: allowed are p2p, a2a, all_gather",
                        ["plan.cp_comm_type=all_gather"]),
    "bad searched cp exchange": (["solver.cp_comm_types=[p2p,ring]"],
                                 r"solver\.cp_comm_types\[1\]=ring: allowed are p2p, a2a, all_gather",
                                 ["solver.cp_comm_types=[p2p,a2a]"]),
    "not key=value": (["tiny_gpt"], r"'tiny_gpt': overrides are key=value", ["model=tiny_gpt"]),
    # h100_spine_leaf (the default cluster) has 3 levels: node, rack, spine
    "level index past the last": (["cluster.levels.5.fan_out=2"],
                                  r"^cluster\.levels\.5\.fan_out: cluster h100_spine_leaf has 3 levels, indices 0\.\.2$",
                                  ["cluster.levels.2.fan_out=2"]),
    "misspelt level key": (["cluster.levels.0.fanout=2"],
                           r"^cluster\.levels\.0\.fanout: no such key; did you mean cluster\.levels\.0\.fan_out\? "
                           r"keys of a cluster level: name, fan_out, bandwidth_gb_per_s, latency_s, oversubscription, "
                           r"efficiency, all_to_all_efficiency$",
                           ["cluster.levels.0.fan_out=2"]),
}


@pytest.mark.parametrize("bad, match, good", list(BAD.values()), ids=list(BAD))
def test_bad_input_is_one_line(bad, match, good):
    load([TINY, *good])  # the allowed neighbour loads
    with pytest.raises(NestError, match=match) as err:
        load([TINY, *bad])
    assert "\n" not in str(err.value)


def test_appended_misspelt_key_is_an_error():
    with pytest.raises(NestError, match=r"'\+model\.num_layer=4': every key exists already.*write model\.num_layer=VALUE"):
        load([TINY, "+model.num_layer=4"])


# config/load.py composes the config groups once and applies the key=value overrides to a copy with Hydra's own
# override code: each of these must give what Hydra's full compose of the same overrides gives (keys in order).
COMPOSED_ALIKE = [
    ["model=llama3_70b", "cluster=dgx_h100_superpod", "cluster.num_devices=64", "plan.tp=8"],
    ["cluster.num_devices=64", "model=mixtral_8x7b", "model.num_layers=8", "train.global_batch_size=256"],  # value first
    ["model=tiny_gpt", "model.num_layers=4", "model.num_layers=6"],  # the last value wins
    ["cluster=hgx_h200", "accelerator=b200"],  # the accelerator the cluster's defaults chose, replaced
    ["solver.micro_batch_sizes=[1,2]", "cluster.nodes='n[01-04]'", "out=plan.json", "plan.recompute=null"],
    [],
]
# ... and each of these the same error (type and words)
COMPOSED_REFUSED = [["model.no_such_key=1"], ["plan.tp=2,4"], ["plan.tp=[1"], ["cluster.num_devices=many"],
                    ["model=tiny_gpt", "solver.micro_batch_sizes=1"]]


def _hydra_alone(overrides: list[str]):
    from hydra import compose, initialize_config_dir

    from nest_megatron.config.load import CONFIG_DIR

    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        return compose(config_name="config", overrides=overrides)


@pytest.mark.parametrize("overrides", COMPOSED_ALIKE)
def test_a_kept_composition_with_values_is_hydras_composition(overrides):
    from omegaconf import OmegaConf

    from nest_megatron.config.load import _hydra_compose

    assert OmegaConf.to_yaml(_hydra_compose(overrides)) == OmegaConf.to_yaml(_hydra_alone(overrides))
    _hydra_compose(["model=tiny_gpt", *overrides])  # another composition in between changes nothing kept
    assert OmegaConf.to_yaml(_hydra_compose(overrides)) == OmegaConf.to_yaml(_hydra_alone(overrides))


@pytest.mark.parametrize("overrides", COMPOSED_REFUSED)
def test_a_kept_composition_refuses_a_value_as_hydra_does(overrides):
    from nest_megatron.config.load import _hydra_compose

    with pytest.raises(Exception) as hydra_alone:
        _hydra_alone(overrides)
    with pytest.raises(Exception) as kept:
        _hydra_compose(overrides)
    assert (type(kept.value), str(kept.value)) == (type(hydra_alone.value), str(hydra_alone.value))
