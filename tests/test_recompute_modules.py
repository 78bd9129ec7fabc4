"""Granular selective recompute (plan.recompute_modules, Megatron's --recompute-modules), worked out by hand on small
shapes: the activation bytes each module stops keeping, the forward work it runs again, the sets the search tries,
Megatron's rules on the names, and the argv round trip. Against megatron-core's own layer on CPU:
tests/test_megatron_agreement.py test_recompute_modules_drop_what_megatron_stops_saving.
"""

from __future__ import annotations

import pytest

from nest_megatron.config.load import load
from nest_megatron.config.megatron_argv import scan
from nest_megatron.config.schema import ModelConfig
from nest_megatron.cost.activations import layer_activation_bytes, layer_activation_terms
from nest_megatron.cost.collectives import Network
from nest_megatron.cost.compute import RooflineCompute
from nest_megatron.cost.layer import layer_time
from nest_megatron.cost.placement import compute_spans
from nest_megatron.cost.recompute import recompute_seconds, searched_sets
from nest_megatron.emit.megatron import parallel_args
from nest_megatron.errors import NestError
from nest_megatron.hardware.accelerator import Accelerator
from nest_megatron.hardware.topology import Level, Topology
from nest_megatron.launch.megatron_rules import argv_recompute_modules, violations
from nest_megatron.launch.rewrite import pin_overrides
from nest_megatron.model.kinds import LayerKind
from nest_megatron.model.spec import Gemm, ModelSpec, Numerics
from nest_megatron.parallel.config import ParallelConfig
from nest_megatron.parallel.ranks import identity_placement
from nest_megatron.parallel.rules import violation

DENSE, MOE, MLA = LayerKind(mlp="dense"), LayerKind(mlp="moe"), LayerKind("mla", "dense")
# T = mbs 2 x s 32 = 64 tokens, h 64, 4 heads of 16, SwiGLU f 128 (fused), flash attention, no dropout, TP 1.
SHAPE = dict(name="t", num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, seq_length=32,
             vocab_size=128, swiglu=True, normalization="RMSNorm", add_bias_linear=False, hidden_dropout=0.0,
             attention_dropout=0.0, position_embedding_type="rope")
MOE_SHAPE = dict(num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32, moe_shared_expert_intermediate_size=64)
MLA_SHAPE = dict(multi_latent_attention=True, q_lora_rank=32, kv_lora_rank=16, qk_head_dim=8, qk_pos_emb_head_dim=4,
                 v_head_dim=8)


def spec(**overrides) -> ModelSpec:
    return ModelSpec(ModelConfig(**{**SHAPE, **overrides}))


def dropped(m: ModelSpec, kind: LayerKind, *modules: str) -> float:
    """Bytes a layer stops keeping with `modules` recomputed."""
    args = dict(mbs=2, tp=1, sp=False, cp=1, kind=kind)
    return sum(layer_activation_terms(m, **args).values()) - sum(layer_activation_terms(m, **args, modules=modules).values())


def test_dense_modules_by_hand():
    te, local = spec(), spec(transformer_impl="local")
    # Flash's log-sum-exp: fp32 x 4 heads x 64 tokens = 1,024 B
    assert dropped(te, DENSE, "core_attn") == 4 * 4 * 64 == 1024
    # Transformer Engine fuses both norms into linear_qkv / linear_fc1: nothing for "layernorm" to free
    assert dropped(te, DENSE, "layernorm") == 0
    # the local spec's norms are modules: their outputs (QKV's and FC1's inputs) go, 2 x (2 B x 64 x 64) = 16,384
    assert dropped(local, DENSE, "layernorm") == 2 * 2 * 64 * 64 == 16384
    # mlp: FC1's output 2 B x 64 x 256 = 32,768 and FC2's input 2 B x 64 x 128 = 16,384; with TE the normed input
    # too (the norm runs inside the checkpointed MLP), 2 B x 64 x 64 = 8,192; the local spec's checkpoint keeps it
    assert dropped(local, DENSE, "mlp") == 32768 + 16384 == 49152
    assert dropped(te, DENSE, "mlp") == 32768 + 16384 + 8192 == 57344
    # both, local: the MLP checkpoint's input is the norm's freed output
    assert dropped(local, DENSE, "layernorm", "mlp") == 16384 + 49152
    # by setting: "selective" is the configuration's modules
    by_setting = layer_activation_bytes(local, mbs=2, tp=1, sp=False, cp=1, kind=DENSE, modules=("mlp",))
    assert by_setting["none"] - by_setting["selective"] == 49152


def test_moe_modules_by_hand():
    m = spec(**MOE_SHAPE)
    # 64 tokens x top-2 = 128 routed rows; experts' FC1 output 2 B x 128 x 64 = 16,384, FC2's input 2 B x 128 x 32
    # = 8,192; shared expert's FC1 output 2 B x 64 x 128 = 16,384, its FC2 input 2 B x 64 x 64 = 8,192
    assert dropped(m, MOE, "moe_act") == 8192
    assert dropped(m, MOE, "shared_experts") == 16384 + 8192
    # TE keeps the MoE's pre-MLP norm a module (the router reads it): "layernorm" frees its output 2 B x 64 x 64
    assert dropped(m, MOE, "layernorm") == 8192
    # moe: everything after the layer's input, which the checkpoint keeps: the experts' input 2 B x 128 x 64 =
    # 16,384, their FC1 output and FC2 input, the shared expert's
    assert dropped(m, MOE, "moe") == 16384 + 16384 + 8192 + 24576
    # on a dense layer of the same model the MoE modules free nothing
    assert dropped(m, DENSE, "moe", "moe_act", "shared_experts") == 0


def test_mla_modules_by_hand():
    m = spec(**MLA_SHAPE, qk_layernorm=True)
    # mla_up_proj: the Q, K, V the up projections and RoPE make, 2 B x 64 tokens x 4 heads x (2 x (8 + 4) + 8)
    assert dropped(m, MLA, "mla_up_proj") == 2 * 64 * 4 * 32 == 16384
    # TE's MLA has its input norm as a module: "layernorm" frees the normed input of the down projections, and the
    # dense MLP's norm stays fused
    assert dropped(m, MLA, "layernorm") == 2 * 64 * 64 == 8192


def test_recompute_time_is_the_modules_forward():
    acc = Accelerator(name="t", peak_flops=1e15, hbm_bandwidth=2e12, memory_bytes=80e9, gemm_efficiency=0.5,
                      memory_bound_efficiency=0.8, attention_efficiency=0.4, reserved_memory_bytes=0.0)
    compute = RooflineCompute(acc)
    m = spec(transformer_impl="local")
    cfg = ParallelConfig(mbs=2)
    one_host = Topology("one", (Level("node", 1, 100e9, 1e-6),))
    lt = layer_time(m, cfg=cfg, kind=DENSE, spans=compute_spans(cfg, one_host, identity_placement(1)),
                    net=Network.for_topology(one_host), compute=compute)
    # mlp: FC1 [64 x 64] x [64 x 256], FC2 [64 x 128] x [128 x 64] and the SwiGLU, which reads FC1's output
    # (64 x 256) and writes FC2's input (64 x 128) in bf16: 2 B x 64 x 384 = 49,152 B
    fc = compute.gemm_time(Gemm("fc1", 64, 256, 64)) + compute.gemm_time(Gemm("fc2", 64, 64, 128))
    assert recompute_seconds(lt, m, DENSE, ("mlp",)) == pytest.approx(fc + 49152 / (2e12 * 0.8))
    # layernorm: both norms read and write [64 x 64] in bf16: 2 x 2 x 2 B x 4,096 = 32,768 B
    assert recompute_seconds(lt, m, DENSE, ("layernorm",)) == pytest.approx(32768 / (2e12 * 0.8))
    assert recompute_seconds(lt, m, DENSE, ()) == 0.0


def test_searched_sets_by_model_kind():
    # Transformer Engine's dense layer: its norms are fused, so "layernorm" frees nothing and is not tried
    assert searched_sets(spec()) == [("core_attn",), ("core_attn", "mlp")]
    assert searched_sets(spec(transformer_impl="local")) == [("core_attn",), ("core_attn", "layernorm"),
                                                             ("core_attn", "layernorm", "mlp")]
    # every layer MoE, no shared expert: the published GPT-OSS set (layernorm moe_act) with core_attn
    moe = spec(num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32)
    assert searched_sets(moe) == [("core_attn",), ("core_attn", "moe_act", "layernorm")]
    # MLA with a dense first layer, MoE with a shared expert after (DeepSeek-V3's kinds): the recipe's
    # mla_up_proj mlp within the largest set
    deepseek = spec(**MLA_SHAPE, **MOE_SHAPE, moe_layer_freq=[0, 1])
    assert searched_sets(deepseek) == [("core_attn",), ("core_attn", "moe_act", "layernorm", "mla_up_proj"),
                                       ("core_attn", "moe_act", "layernorm", "mla_up_proj", "mlp", "shared_experts")]
    # fp8 delayed scaling refuses moe_act and layernorm (Megatron): they are not tried
    assert searched_sets(ModelSpec(moe.cfg, numerics=Numerics(fp8_recipe="delayed"))) == [("core_attn",)]


def _violation(m: ModelSpec, modules: tuple[str, ...]) -> str | None:
    cfg = ParallelConfig(dp=8, recompute="selective", recompute_modules=modules)
    return violation(cfg, model=m, num_devices=8, global_batch_size=16)


def test_rules_on_the_modules():
    assert _violation(spec(), ("mla_up_proj",)) == ("plan.recompute_modules: mla_up_proj needs multi-head latent "
                                                    "attention (model.multi_latent_attention)")
    assert _violation(spec(**MLA_SHAPE), ("mla_up_proj", "mlp")) is None
    assert _violation(spec(), ("attn",)).startswith("plan.recompute_modules: attn unknown; allowed are core_attn, ")
    fp8 = ModelSpec(spec(**MOE_SHAPE).cfg, numerics=Numerics(fp8_recipe="delayed"))
    assert "fp8 delayed scaling" in _violation(fp8, ("moe_act",))
    # the modules count only with selective recompute
    assert violation(ParallelConfig(dp=8, recompute="full", recompute_modules=("attn",)), model=spec(),
                     num_devices=8, global_batch_size=16) is None


SMALL = ["model=llama3_8b", "cluster=dgx_h100_superpod", "cluster.num_devices=8", "train.global_batch_size=16"]


def test_config_takes_and_refuses_modules():
    assert load([*SMALL, "plan.recompute=selective", "plan.recompute_modules=[mlp,core_attn]"]).config.plan \
        .recompute_modules == ["mlp", "core_attn"]
    with pytest.raises(NestError, match=r"^plan.recompute_modules: attn unknown; allowed are core_attn, moe_act, "
                                        r"layernorm, mla_up_proj, mlp, moe, shared_experts$"):
        load([*SMALL, "plan.recompute_modules=[core_attn,attn]"])
    with pytest.raises(NestError, match="plan.recompute_modules with plan.recompute=full"):
        load([*SMALL, "plan.recompute=full", "plan.recompute_modules=[mlp]"])


def test_argv_round_trip():
    m = spec(**MOE_SHAPE)
    cfg = ParallelConfig(dp=8, ep=4, recompute="selective", recompute_modules=("moe_act", "layernorm"))
    args = parallel_args(cfg, model=m, global_batch_size=16, overlap_grad_reduce=False,
                         overlap_param_gather=False)
    s = scan(args)
    # emitted as Megatron spells it, with the grouped GEMM moe_act needs (once: a MoE plan has it), read back exactly
    assert args[args.index("--recompute-granularity"):] == ["--recompute-granularity", "selective",
                                                            "--recompute-modules", "moe_act", "layernorm"]
    assert args.count("--moe-grouped-gemm") == 1
    assert argv_recompute_modules(s) == ("moe_act", "layernorm")
    # Megatron's default set is not spelt out
    default = parallel_args(ParallelConfig(dp=8, ep=4, recompute="selective"), model=m, global_batch_size=16,
                            overlap_grad_reduce=False, overlap_param_gather=False)
    assert "--recompute-modules" not in default and argv_recompute_modules(scan(default)) == ("core_attn",)
    # --pin recompute keeps the user's set
    user = ["--num-layers", "2", "--recompute-granularity", "selective", "--recompute-modules", "layernorm", "moe_act"]
    assert pin_overrides(user, ["recompute"]) == ["plan.recompute=selective", "plan.recompute_modules=[layernorm,moe_act]"]


MOE_ARGV = ["--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "128", "--num-attention-heads", "4",
            "--seq-length", "32", "--max-position-embeddings", "32", "--num-experts", "4", "--moe-router-topk", "2",
            "--micro-batch-size", "1", "--global-batch-size", "8", "--bf16",
            "--recompute-granularity", "selective", "--recompute-modules", "moe_act"]


def test_launch_rules_on_the_modules():
    assert violations(MOE_ARGV, world_size=8) == ["--recompute-modules moe_act needs --moe-grouped-gemm"]
    assert violations([*MOE_ARGV, "--moe-grouped-gemm"], world_size=8) == []
    mla = [*MOE_ARGV[:-1], "mla_up_proj", "--moe-grouped-gemm"]
    assert violations(mla, world_size=8) == ["plan.recompute_modules: mla_up_proj needs multi-head latent attention "
                                             "(model.multi_latent_attention)"]
