"""launch/megatron_rules.py: each rule of Megatron-LM's validate_args / initialize_model_parallel that it models,
with an argv that keeps it and one that breaks it; and every plan of the paper grid, rewritten, keeps them all."""

from __future__ import annotations

import pytest
import torch
from paper_grid_plans import grid_plans

from nest_megatron.errors import NestError
from nest_megatron.launch.megatron_rules import check, violations
from nest_megatron.parallel.layout import layout_stages

# 8 layers, 8 heads in 4 query groups, sequence 128; micro-batch 1, global batch 64 unless a case sets it.
BASE = ("--num-layers 8 --hidden-size 256 --num-attention-heads 8 --group-query-attention --num-query-groups 4 "
        "--seq-length 128 --max-position-embeddings 128 --vocab-size 1000 --bf16 --micro-batch-size 1").split()
MOE = [*BASE, "--num-experts", "8", "--moe-router-topk", "2"]


def problems(extra: str, *, world: int, base=BASE) -> list[str]:
    batch = [] if "--global-batch-size" in extra else ["--global-batch-size", "64"]
    return violations([*base, *batch, *extra.split()], world_size=world)


# (rule, argv that keeps it + world size, argv that breaks it + world size, the line expected for the break)
CASES = [
    ("world size divisible by tp*pp*cp",
     ("--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2", 8),
     ("--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2", 6),
     "world size 6 is not divisible by tp*pp*cp = 2*2*1"),
    ("tp divides the attention heads",
     ("--tensor-model-parallel-size 4", 8),
     ("--tensor-model-parallel-size 16", 16),
     "--tensor-model-parallel-size=16: must divide num_attention_heads=8"),
    ("tp divides the query groups",
     ("--tensor-model-parallel-size 4", 8),
     ("--tensor-model-parallel-size 8", 8),
     "--tensor-model-parallel-size=8: must divide num_query_groups=4"),
    ("pp splits the layers evenly without a layout",
     ("--pipeline-model-parallel-size 4", 8),
     ("--pipeline-model-parallel-size 3", 6),
     "--pipeline-model-parallel-size=3 x virtual pipeline stages=1: must divide num_layers=8 for an even split"),
    ("a layout gives an uneven split (3 + 3 + 2 layers)",
     ("--pipeline-model-parallel-size 3 --pipeline-model-parallel-layout Et*3|t*3|t*2L", 6),
     ("--pipeline-model-parallel-size 3 --pipeline-model-parallel-layout Et*3|t*3|t*3L", 6),
     "--pipeline-model-parallel-layout=Et*3|t*3|t*3L: 9 transformer layers (t), but num_layers=8"),
    ("a layout's layers are E, t, L, m",
     ("--pipeline-model-parallel-size 2 --pipeline-model-parallel-layout E,t*2|(t|)*2,t*4L", 8),
     ("--pipeline-model-parallel-size 2 --pipeline-model-parallel-layout Et*3|x*5L", 8),
     "--pipeline-model-parallel-layout=Et*3|x*5L: ['x'] are no layers"),
    ("MTP layers in a layout only with a model that has them",
     ("--pipeline-model-parallel-size 2 --pipeline-model-parallel-layout Et*3|t*5L", 8),
     ("--pipeline-model-parallel-size 2 --pipeline-model-parallel-layout Et*3|t*5mL", 8),
     "--pipeline-model-parallel-layout=Et*3|t*5mL: 1 MTP layers (m), but the model has no multi-token prediction"),
    ("a layout excludes the embedding / loss counted as layers",
     ("--pipeline-model-parallel-size 2 --pipeline-model-parallel-layout Et*3|t*5L", 8),
     ("--pipeline-model-parallel-size 2 --pipeline-model-parallel-layout Et*3|t*5L --account-for-loss-in-pipeline-split", 8),
     "--pipeline-model-parallel-layout with --account-for-loss-in-pipeline-split: Megatron takes one way"),
    ("a layout excludes first / last stage layers",
     ("--pipeline-model-parallel-size 2 --pipeline-model-parallel-layout Et*3|t*5L", 8),
     ("--pipeline-model-parallel-size 2 --pipeline-model-parallel-layout Et*3|t*5L --decoder-last-pipeline-num-layers 5", 8),
     "--pipeline-model-parallel-layout with --decoder-last-pipeline-num-layers: Megatron takes one way"),
    ("first / last stage layers exclude the embedding / loss counted as layers",
     ("--pipeline-model-parallel-size 2 --decoder-first-pipeline-num-layers 3", 8),
     ("--pipeline-model-parallel-size 2 --decoder-first-pipeline-num-layers 3 --account-for-embedding-in-pipeline-split", 8),
     "--decoder-first-pipeline-num-layers with --account-for-embedding-in-pipeline-split: Megatron takes one way"),
    ("the embedding and loss counted: pp divides the layers and them",
     ("--pipeline-model-parallel-size 2 --account-for-embedding-in-pipeline-split --account-for-loss-in-pipeline-split", 8),
     ("--pipeline-model-parallel-size 4 --account-for-embedding-in-pipeline-split", 8),
     "--account-for-embedding-in-pipeline-split=true: num_layers + 1 = 9 must be a multiple of "
     "--pipeline-model-parallel-size=4"),
    ("the embedding and loss counted: vpp divides each rank's share",
     ("--pipeline-model-parallel-size 2 --account-for-embedding-in-pipeline-split --account-for-loss-in-pipeline-split "
      "--num-virtual-stages-per-pipeline-rank 5", 8),
     ("--pipeline-model-parallel-size 2 --account-for-embedding-in-pipeline-split --account-for-loss-in-pipeline-split "
      "--num-virtual-stages-per-pipeline-rank 3", 8),
     "--account-for-embedding-in-pipeline-split=true and --account-for-loss-in-pipeline-split=true: the 5 layers of "
     "each pipeline rank"),
    ("layers per virtual stage count the embedding and loss when asked",
     ("--pipeline-model-parallel-size 2 --account-for-embedding-in-pipeline-split --account-for-loss-in-pipeline-split "
      "--num-layers-per-virtual-pipeline-stage 1", 8),
     ("--pipeline-model-parallel-size 2 --account-for-embedding-in-pipeline-split --account-for-loss-in-pipeline-split "
      "--num-layers-per-virtual-pipeline-stage 2", 8),
     "--num-layers-per-virtual-pipeline-stage 2: must divide num_layers/pp = 10/2"),
    ("first / last stage layers leave an even split of the middle stages",
     ("--pipeline-model-parallel-size 4 --decoder-first-pipeline-num-layers 1 --decoder-last-pipeline-num-layers 1", 8),
     ("--pipeline-model-parallel-size 4 --decoder-first-pipeline-num-layers 1 --decoder-last-pipeline-num-layers 2", 8),
     "--decoder-first-pipeline-num-layers=1, --decoder-last-pipeline-num-layers=2: the other 5 layers must split evenly "
     "over 2 middle pipeline stages"),
    ("first / last stage layers are at least 1",
     ("--pipeline-model-parallel-size 2 --decoder-last-pipeline-num-layers 1", 8),
     ("--pipeline-model-parallel-size 2 --decoder-last-pipeline-num-layers 0", 8),
     "--decoder-last-pipeline-num-layers=0: must be at least 1"),
    ("first / last stage layers with virtual stages are multiples of vpp",
     ("--pipeline-model-parallel-size 4 --decoder-first-pipeline-num-layers 2 --decoder-last-pipeline-num-layers 2 "
      "--num-virtual-stages-per-pipeline-rank 2 --global-batch-size 64", 8),
     ("--pipeline-model-parallel-size 4 --decoder-first-pipeline-num-layers 1 --decoder-last-pipeline-num-layers 3 "
      "--num-virtual-stages-per-pipeline-rank 2 --global-batch-size 64", 8),
     "--decoder-first-pipeline-num-layers=1: must be a multiple of virtual pipeline stages=2"),
    ("virtual stages: pp x vpp divides the layers",
     ("--pipeline-model-parallel-size 2 --num-virtual-stages-per-pipeline-rank 2", 8),
     ("--pipeline-model-parallel-size 2 --num-virtual-stages-per-pipeline-rank 3", 8),
     # 6 chunks of 8 layers: the planner's simplest is two empty end chunks (ranks 4 + 4)
     "--pipeline-model-parallel-size=2 x virtual pipeline stages=3: must divide num_layers=8 for an even split; give "
     "the split, e.g. --pipeline-model-parallel-layout='E|(t*2|)*4,L'"),
    ("layers per virtual stage divide the layers per stage",
     ("--pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 2", 8),
     ("--pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 3", 8),
     "--num-layers-per-virtual-pipeline-stage 3: must divide num_layers/pp = 8/2"),
    ("the three virtual-pipeline flags exclude each other",
     ("--pipeline-model-parallel-size 2 --num-virtual-stages-per-pipeline-rank 2", 8),
     ("--pipeline-model-parallel-size 2 --num-virtual-stages-per-pipeline-rank 2 --num-layers-per-virtual-pipeline-stage 2", 8),
     "--num-layers-per-virtual-pipeline-stage and --num-virtual-stages-per-pipeline-rank: at most one of"),
    ("global batch is a multiple of micro-batch x dp",
     ("--global-batch-size 64", 8),
     ("--global-batch-size 60", 8),
     "--global-batch-size=60: must be a multiple of micro_batch_size*dp = 1*8"),
    ("enough micro-batches to fill the pipeline",
     ("--pipeline-model-parallel-size 8 --global-batch-size 8", 8),
     ("--pipeline-model-parallel-size 8 --global-batch-size 4", 8),
     "4 micro-batches per iteration: need at least pp=8 to fill the pipeline"),
    ("selective recompute takes no method",
     ("--recompute-granularity selective", 8),
     ("--recompute-granularity selective --recompute-method uniform", 8),
     "--recompute-granularity selective takes no --recompute-method / --recompute-num-layers"),
    ("full recompute needs a method",
     ("--recompute-granularity full --recompute-method uniform --recompute-num-layers 1", 8),
     ("--recompute-granularity full --recompute-num-layers 1", 8),
     "--recompute-granularity full needs --recompute-method uniform or block"),
    ("--overlap-param-gather needs the distributed optimizer",
     ("--overlap-grad-reduce --overlap-param-gather --use-distributed-optimizer", 8),
     ("--overlap-grad-reduce --overlap-param-gather", 8),
     "--overlap-param-gather needs --use-distributed-optimizer (or --use-megatron-fsdp)"),
    ("--overlap-param-gather needs --overlap-grad-reduce",
     ("--overlap-grad-reduce --overlap-param-gather --use-distributed-optimizer", 8),
     ("--overlap-param-gather --use-distributed-optimizer", 8),
     "--overlap-param-gather needs --overlap-grad-reduce"),
    ("sequence parallel needs tp > 1",
     ("--tensor-model-parallel-size 2 --sequence-parallel", 8),
     ("--sequence-parallel", 8),
     "--sequence-parallel needs --tensor-model-parallel-size > 1"),
    ("context parallel: the sequence is a multiple of 2*cp",
     ("--context-parallel-size 2", 8),
     ("--context-parallel-size 3", 6),
     "--context-parallel-size=3: seq_length=128 must be a multiple of 2*cp"),
    ("context parallel needs a fused attention (megatron-core's DotProductAttention asserts cp == 1)",
     ("--context-parallel-size 2", 8),
     ("--context-parallel-size 2 --transformer-impl local", 8),
     "--context-parallel-size=2 with model.attention_backend=unfused: unfused attention has no context parallel"),
    ("Megatron-FSDP checkpoints as fsdp_dtensor",
     ("--use-megatron-fsdp --ckpt-format fsdp_dtensor", 8),
     ("--use-megatron-fsdp", 8),
     "--use-megatron-fsdp needs --ckpt-format fsdp_dtensor"),
    ("Megatron-FSDP does not take the tp-pp-dp rank order",
     ("--use-megatron-fsdp --ckpt-format fsdp_dtensor", 8),
     ("--use-megatron-fsdp --ckpt-format fsdp_dtensor --use-tp-pp-dp-mapping", 8),
     "ZeRO stage=3 (Megatron-FSDP) with --use-tp-pp-dp-mapping: Megatron-FSDP does not support --use-tp-pp-dp-mapping"),
    # its mesh is dp_cp x tp = the whole world (mcore_fsdp_adapter._get_dp_tp_mesh; tests/test_fsdp_mesh.py runs it)
    ("Megatron-FSDP has no pipeline stages",
     ("--use-megatron-fsdp --ckpt-format fsdp_dtensor --tensor-model-parallel-size 2", 8),
     ("--use-megatron-fsdp --ckpt-format fsdp_dtensor --pipeline-model-parallel-size 2", 8),
     "ZeRO stage=3 (Megatron-FSDP) with --pipeline-model-parallel-size=2: Megatron-FSDP's device mesh has no pipeline "
     "dimension"),
    ("Megatron-FSDP's no_shard strategy does not initialise on the meta device",
     ("--use-megatron-fsdp --ckpt-format fsdp_dtensor --init-model-with-meta-device", 8),
     ("--use-megatron-fsdp --ckpt-format fsdp_dtensor --data-parallel-sharding-strategy no_shard "
      "--init-model-with-meta-device", 8),
     "--init-model-with-meta-device with --data-parallel-sharding-strategy no_shard: not supported"),
    ("TP communication overlap needs sequence parallel",
     ("--tensor-model-parallel-size 2 --sequence-parallel --tp-comm-overlap", 8),
     ("--tensor-model-parallel-size 2 --tp-comm-overlap", 8),
     "--tp-comm-overlap needs --sequence-parallel and --tensor-model-parallel-size > 1"),
    ("TP communication overlap needs tp > 1 (Megatron-LM turns sequence parallel off at tp 1)",
     ("--tensor-model-parallel-size 2 --sequence-parallel --tp-comm-overlap", 8),
     ("--tp-comm-overlap", 8),
     "--tp-comm-overlap needs --sequence-parallel and --tensor-model-parallel-size > 1"),
    ("the interleaved schedule on 2 stages needs p2p overlap (Megatron's default)",
     ("--pipeline-model-parallel-size 2 --num-virtual-stages-per-pipeline-rank 2", 8),
     ("--pipeline-model-parallel-size 2 --num-virtual-stages-per-pipeline-rank 2 --no-overlap-p2p-communication", 8),
     "virtual pipeline stages with --no-overlap-p2p-communication need --pipeline-model-parallel-size > 2"),
    ("a MoE latent size not with the legacy grouped GEMM (megatron-core 0.16.1 experts.py:86-87)",
     ("--num-experts 8 --moe-latent-size 64 --moe-grouped-gemm", 8),
     ("--num-experts 8 --moe-latent-size 64 --moe-grouped-gemm --moe-use-legacy-grouped-gemm", 8),
     "--moe-latent-size with --moe-use-legacy-grouped-gemm: the legacy GroupedMLP has no latent projection"),
    ("a MoE latent size not with the shared expert overlapped (moe_layer.py:476-481)",
     ("--num-experts 8 --moe-latent-size 64 --moe-shared-expert-intermediate-size 128", 8),
     ("--num-experts 8 --moe-latent-size 64 --moe-shared-expert-intermediate-size 128 --moe-shared-expert-overlap", 8),
     "--moe-latent-size with --moe-shared-expert-overlap"),
    # CPU offloading (megatron-core transformer_config.py:1884-1899, 2798-2801 at d98e8a6; cpu_offloading is set by
    # --cpu-offloading-num-layers N > 0, arguments.py:1950-1951)
    ("CPU offloading of fewer layers than the model's",
     ("--cpu-offloading-num-layers 7", 8),
     ("--cpu-offloading-num-layers 8", 8),
     "--cpu-offloading-num-layers 8: megatron-core offloads fewer than the 8 layers of --num-layers"),
    ("CPU offloading not with pipeline parallelism",
     ("--cpu-offloading-num-layers 2 --tensor-model-parallel-size 2", 8),
     ("--cpu-offloading-num-layers 2 --pipeline-model-parallel-size 2", 8),
     "--cpu-offloading-num-layers with --pipeline-model-parallel-size 2: megatron-core has no CPU offloading with "
     "pipeline parallelism"),
    ("CPU offloading not with recompute",
     ("--cpu-offloading-num-layers 2", 8),
     ("--cpu-offloading-num-layers 2 --recompute-activations", 8),
     "--cpu-offloading-num-layers with --recompute-granularity: megatron-core does not offload and recompute"),
    ("CPU offloading not with per-layer CUDA graphs",
     ("--cpu-offloading-num-layers 2", 8),
     ("--cpu-offloading-num-layers 2 --external-cuda-graph", 8),
     "--cpu-offloading-num-layers with per-layer CUDA graphs: megatron-core refuses them together"),
    ("the output layer's weight gradient deferred only with pipeline parallelism (model_parallel_config.py:545-548)",
     ("--defer-embedding-wgrad-compute --pipeline-model-parallel-size 2", 8),
     ("--defer-embedding-wgrad-compute", 8),
     "--defer-embedding-wgrad-compute with --pipeline-model-parallel-size 1: megatron-core defers the output layer's "
     "weight gradient only with pipeline parallelism"),
    ("... and only with gradient accumulation fusion (model_parallel_config.py:550-553)",
     ("--defer-embedding-wgrad-compute --pipeline-model-parallel-size 2", 8),
     ("--defer-embedding-wgrad-compute --pipeline-model-parallel-size 2 --no-gradient-accumulation-fusion", 8),
     "--defer-embedding-wgrad-compute with --no-gradient-accumulation-fusion: megatron-core defers the output layer's "
     "weight gradient only with gradient accumulation fusion"),
    ("the shared expert overlapped only with the alltoall or flex dispatcher (transformer_config.py:1820-1826)",
     ("--num-experts 8 --moe-shared-expert-intermediate-size 128 --moe-shared-expert-overlap "
      "--moe-token-dispatcher-type alltoall", 8),
     ("--num-experts 8 --moe-shared-expert-intermediate-size 128 --moe-shared-expert-overlap", 8),
     "--moe-shared-expert-overlap with --moe-token-dispatcher-type allgather (Megatron's default allgather when not "
     "given)"),
    # CUDA graphs and recompute (transformer_config.py:2854-2858, 2868-2899)
    ("per-layer CUDA graphs not with full recompute",
     ("--cuda-graph-impl local --recompute-activations --attention-dropout 0", 8),
     ("--cuda-graph-impl local --recompute-granularity full --recompute-method uniform --recompute-num-layers 1", 8),
     "--cuda-graph-impl local with --recompute-granularity full: megatron-core recomputes whole layers only"),
    ("whole-layer CUDA graphs recompute no attention with dropout",
     ("--cuda-graph-impl transformer_engine --recompute-activations --attention-dropout 0", 8),
     ("--cuda-graph-impl transformer_engine --recompute-activations", 8),
     "--recompute-modules core_attn with attention dropout under whole-layer CUDA graphs"),
    ("whole-layer CUDA graphs recompute no MLP with dropout",
     ("--cuda-graph-impl local --cuda-graph-modules attn --recompute-activations --recompute-modules mlp", 8),
     ("--cuda-graph-impl local --recompute-activations --recompute-modules mlp", 8),
     "--recompute-modules mlp or moe with hidden dropout under whole-layer CUDA graphs"),
    ("--micro-batch-size is required",
     ("", 8),
     ("", 8),
     None),  # the break is built below (it removes a flag)
]


@pytest.mark.parametrize("rule, good, bad, line", CASES, ids=[c[0] for c in CASES])
def test_rule(rule, good, bad, line):
    assert problems(good[0], world=good[1]) == []
    if line is None:
        argv = [t for t in BASE if t not in ("--micro-batch-size",)]
        argv.remove("1")  # its value
        assert violations(argv, world_size=8)[0] == "--micro-batch-size: Megatron requires it"
        return
    found = problems(bad[0], world=bad[1])
    assert any(f.startswith(line) for f in found), found


def test_expert_grid():
    # 8 experts: ep must divide them
    assert problems("--expert-model-parallel-size 4", world=8, base=MOE) == []
    assert problems("--expert-model-parallel-size 3", world=6, base=MOE) == [
        "--expert-model-parallel-size=3: must divide num_experts=8"]
    # tp 2 x dp 4 = 8 non-expert ranks per stage: etp 1 x ep 8 fits, etp 2 x ep 8 = 16 does not
    ok = "--tensor-model-parallel-size 2 --sequence-parallel --expert-tensor-parallel-size 1 --expert-model-parallel-size 8"
    assert problems(ok, world=8, base=MOE) == []
    bad = "--tensor-model-parallel-size 2 --sequence-parallel --expert-model-parallel-size 8"  # etp defaults to tp = 2
    assert problems(bad, world=8, base=MOE)[0].startswith(
        "--expert-model-parallel-size=8 x --expert-tensor-parallel-size=2: must divide tp*cp*dp = 8")
    # pp not the last rank dimension: expert dp must equal dp; tp 1 x dp 4 over etp 1 x ep 4 leaves expert dp 1 != 4,
    # ep 1 keeps it 4
    pp_dp = "--pipeline-model-parallel-size 2 --use-tp-pp-dp-mapping --expert-model-parallel-size"
    assert problems(f"{pp_dp} 1", world=8, base=MOE) == []
    assert problems(f"{pp_dp} 4", world=8, base=MOE)[0].startswith(
        "--use-tp-pp-dp-mapping with --pipeline-model-parallel-size=2: megatron-core needs the expert data-parallel size "
        "tp*cp*dp/(etp*ep) = 1 to equal dp=4; drop --use-tp-pp-dp-mapping")
    # a dense model too: etp defaults to tp and ep to 1, so cp 2 makes the expert dp 2*dp (Megatron-LM rejects it)
    dense = "--pipeline-model-parallel-size 2 --use-tp-pp-dp-mapping --context-parallel-size"
    assert problems(f"{dense} 1", world=8) == []
    assert problems(f"{dense} 2", world=8)[0].startswith(
        "--use-tp-pp-dp-mapping with --pipeline-model-parallel-size=2: megatron-core needs the expert data-parallel size "
        "tp*cp*dp/(etp*ep) = 4 to equal dp=2; drop --use-tp-pp-dp-mapping")
    # MoE with tp > 1 needs sequence parallel (megatron-core)
    assert problems("--tensor-model-parallel-size 2 --expert-tensor-parallel-size 1", world=8, base=MOE)[0].startswith(
        "--tensor-model-parallel-size=2 with MoE: Megatron requires sequence parallel")


def test_layout_is_unrolled_as_megatron_core_does():
    # megatron-core's docstring example: "Ettt|(tt|)*29,m|L" -> [E t t t] + [t t] * 29 + [m] + [L]
    stages = layout_stages("Ettt|(tt|)*29,m|L")
    assert stages == ["Ettt"] + ["tt"] * 29 + ["m", "L"]
    assert layout_stages("Et*19|t*21|t*21|t*19L") == ["E" + "t" * 19, "t" * 21, "t" * 21, "t" * 19 + "L"]


def test_check_raises_one_line():
    with pytest.raises(NestError, match="^Megatron would reject the launch line: --sequence-parallel needs"):
        check([*BASE, "--sequence-parallel"], world_size=8)


@pytest.mark.slow
def test_every_paper_grid_plan_keeps_the_rules():
    plans = grid_plans()
    assert len([p for p in plans if p.name.endswith("/dp")]) == 50  # 5 models x 5 sizes x 2 clusters
    broken = {p.name: violations(p.argv, world_size=p.world_size) for p in plans}
    assert {k: v for k, v in broken.items() if v} == {}


@pytest.mark.parametrize("etp", [1, 2])
def test_moe_bias_with_expert_tp_as_megatron_core_decides(etp):
    """megatron-core's own TransformerConfig.__post_init__ decides whether a MoE with biased linear layers takes
    expert TP `etp` (it asserts "Bias in Moe is only supported when ETP==1"); our rule must agree both ways."""
    pytest.importorskip("megatron.core")
    from megatron_helpers import load_model_config

    from nest_megatron.model.spec import ModelSpec
    from nest_megatron.parallel.config import ParallelConfig
    from nest_megatron.parallel.rules import violation
    from nest_megatron.trace.transformer_config import transformer_config

    model = load_model_config("tiny_moe", add_bias_linear=True)  # 4 experts, 8 heads in 4 query groups
    try:
        transformer_config(model, tp=2, ep=2, etp=etp, sequence_parallel=True)
        error = None
    except AssertionError as e:
        error = str(e)
    megatron_accepts = error is None
    assert megatron_accepts == (etp == 1)  # worked out from transformer_config.py:2615 (0.16.1: :1591)
    assert megatron_accepts or error == "Bias in Moe is only supported when ETP==1"
    # tp 2 x dp 2 = 4 ranks regroup as etp x ep = 2 x 2 or 1 x 2 (x expert dp 2): only the bias rule can break
    cfg = ParallelConfig(tp=2, dp=2, ep=2, etp=etp, sp=True)
    line = violation(cfg, model=ModelSpec(model), num_devices=4, global_batch_size=8)
    assert (line is None) == megatron_accepts, line
    if line:
        assert line.startswith("plan.etp=2 with model.add_bias_linear=true: megatron-core supports biases")


def test_plan_refuses_a_biased_moe_with_expert_tp():
    # the example: Mixtral with biases, tp 2 = etp 2 was accepted and died in TransformerConfig
    from nest_megatron import api

    base = ["model=mixtral_8x7b", "model.add_bias_linear=true", "cluster=dgx_h100_superpod", "cluster.num_devices=16",
            "train.global_batch_size=64", "plan.tp=2", "plan.pp=2", "plan.ep=4"]
    with pytest.raises(NestError, match=r"^invalid configuration: plan.etp=2 with model.add_bias_linear=true"):
        api.evaluate([*base, "plan.etp=2"])


def test_the_doc_lists_every_rule_with_its_source():
    from pathlib import Path

    from nest_megatron.launch.megatron_rules import ARGV_RULES, rules_doc
    from nest_megatron.parallel.rules import RULES

    doc = Path(__file__).resolve().parents[1] / "docs" / "megatron_rules.md"
    assert doc.read_text() == rules_doc() + "\n", (
        "docs/megatron_rules.md is stale: python -c 'from nest_megatron.launch.megatron_rules import rules_doc; "
        "print(rules_doc())' > docs/megatron_rules.md")
    for table in (RULES, ARGV_RULES):
        assert len({r.id for r in table}) == len(table)
        assert all(r.source and r.check.__doc__ for r in table)


@pytest.mark.parametrize("zero, meta", [(2, False), (3, True)])
def test_zero3_builds_the_model_on_the_meta_device(zero, meta):
    """ZeRO-3 (optim_grads_params) asks Megatron-LM for --init-model-with-meta-device, so that no rank allocates the
    unsharded model; the flag is the planner's: a user's copy is replaced by the plan's, once or not at all."""
    from nest_megatron import api
    from nest_megatron.launch.rewrite import model_part, rewrite

    plan = api.evaluate(["model=tiny_gpt", "cluster=dgx_h100_superpod", "cluster.num_devices=8",
                         "train.global_batch_size=64", "plan.tp=2", f"plan.zero={zero}"])
    assert ("--init-model-with-meta-device" in plan.megatron_args) == meta
    argv = rewrite([*model_part(plan.megatron_args), "--init-model-with-meta-device"], plan)
    assert argv.count("--init-model-with-meta-device") == int(meta)
    assert violations(argv, world_size=plan.world_size) == []


def test_first_and_last_stage_sizes_without_a_middle_stage():
    # pp 2 with both ends given: 8 layers as 3 + 5 launches, 3 + 4 leaves a layer over.
    assert problems("--pipeline-model-parallel-size 2 --decoder-first-pipeline-num-layers 3 "
                    "--decoder-last-pipeline-num-layers 5", world=2) == []
    assert problems("--pipeline-model-parallel-size 2 --decoder-first-pipeline-num-layers 3 "
                    "--decoder-last-pipeline-num-layers 4", world=2) != []


# ------------------------------------------------------------------------------------------------
# The rules layer kinds bring: group-limited routing, MoE layer patterns, MLA (parallel/rules.py MODEL_RULES, RULES)
# ------------------------------------------------------------------------------------------------
def _moe_model(**overrides):
    from nest_megatron.config.schema import ModelConfig

    fields = dict(name="m", num_layers=4, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, seq_length=16,
                  vocab_size=128, num_experts=8, moe_router_topk=2, add_bias_linear=False)
    return ModelConfig(**{**fields, **overrides})


def _megatron_core_refusal(model) -> str | None:
    """What megatron-core's TransformerConfig.__post_init__ says of the model's router (None: it accepts it)."""
    from nest_megatron.trace.transformer_config import transformer_config

    try:
        transformer_config(model)
    except (AssertionError, ValueError) as err:
        return str(err)
    return None


@pytest.mark.parametrize("groups, group_topk, rule, megatron_says", [
    (4, 2, None, None),
    (None, 2, "group-topk-needs-groups", "moe_router_num_groups must be specified"),
    (3, 2, "groups-divide-experts", "should be divisible by moe_router_num_groups"),
    (4, 5, "group-topk-groups", "should be smaller than moe_router_num_groups"),
])
def test_group_limited_routing_rules_as_megatron_core_decides(groups, group_topk, rule, megatron_says):
    """transformer_config.py:2677, 2682, 2686 (0.16.1: 1649-1661): our rule fires exactly where megatron-core's
    TransformerConfig refuses, with the allowed case passing both."""
    pytest.importorskip("megatron.core")
    from nest_megatron.parallel.rules import MODEL_RULES, model_violation

    model = _moe_model(moe_router_num_groups=groups, moe_router_group_topk=group_topk)
    refusal = _megatron_core_refusal(model)
    line = model_violation(model)
    assert (refusal is None) == (line is None) == (rule is None), (refusal, line)
    if rule:
        assert megatron_says in refusal
        assert line == next(r for r in MODEL_RULES if r.id == rule).check(model)


@pytest.mark.parametrize("topk, fits", [(2, True), (4, True), (5, False), (1, False)])
def test_topk_in_groups_as_megatron_cores_router_computes(topk, fits):
    """Megatron asserts nothing, but its group_limited_topk (moe_utils.py) scores a group by its top topk // K
    experts and takes the top-k of the masked scores: 8 experts in 4 groups, 2 groups a token leaves room for 4
    experts. With topk 5 its fifth pick is a masked expert (-inf score, outside the chosen groups); with topk 1 < K
    the groups are scored by no expert (all 0, the choice arbitrary). Our rule refuses exactly those."""
    pytest.importorskip("megatron.core")
    import torch
    from megatron.core.transformer.moe.moe_utils import group_limited_topk

    from nest_megatron.parallel.rules import model_violation

    scores = torch.softmax(torch.arange(16, dtype=torch.float32).reshape(2, 8), dim=-1)
    probs, experts = group_limited_topk(scores, topk=topk, num_tokens=2, num_experts=8, num_groups=4, group_topk=2)
    scored = scores.view(2, 4, 2).topk(topk // 2, dim=-1)[0].sum(-1)
    well_defined = bool(torch.isfinite(probs).all()) and bool((scored > 0).all())
    assert well_defined == fits
    line = model_violation(_moe_model(moe_router_topk=topk, moe_router_num_groups=4, moe_router_group_topk=2))
    assert (line is None) == fits, line
    if line:
        assert line.startswith(f"model.moe_router_topk={topk} with 2 of 4 expert groups: allowed 2..4")


@pytest.mark.parametrize("pattern, megatron_says", [
    ([0, 1, 1, 1], None),
    ([0, 1, 1], "Invalid length of moe_layer_pattern"),
    ([0, 2, 1, 1], "Invalid layer pattern"),
])
def test_moe_layer_pattern_rule_as_megatron_core_decides(pattern, megatron_says):
    """gpt_layer_specs.py get_gpt_decoder_layer_specs (d98e8a6 :653, :671) asserts one 0/1 entry per layer."""
    pytest.importorskip("megatron.core")
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    from nest_megatron.parallel.rules import model_violation
    from nest_megatron.trace.meta import as_rank
    from nest_megatron.trace.transformer_config import transformer_config

    model = _moe_model(moe_layer_freq=pattern)
    with as_rank(0, 1):
        try:
            get_gpt_decoder_block_spec(transformer_config(model), use_transformer_engine=False)
            refusal = None
        except (AssertionError, ValueError) as err:
            refusal = str(err)
    line = model_violation(model)
    assert (refusal is None) == (line is None), (refusal, line)
    if megatron_says:
        assert megatron_says in refusal and line.startswith("model.moe_layer_freq")


def test_mla_excludes_query_groups():
    """Megatron-LM arguments.py:1974 asserts --group-query-attention is not given with --multi-latent-attention
    (megatron-core's MLATransformerConfig does not check it)."""
    from nest_megatron.parallel.rules import model_violation

    mla = _moe_model(multi_latent_attention=True, q_lora_rank=32, kv_lora_rank=16)
    assert model_violation(mla) is None
    line = model_violation(_moe_model(multi_latent_attention=True, num_query_groups=2))
    assert line.startswith("model.num_query_groups=2 with model.multi_latent_attention=true: MLA has no query groups")


@pytest.mark.parametrize("q_lora_rank, builds", [(32, True), (33, False)])
def test_mla_local_spec_tp_rule_as_megatron_core_decides(q_lora_rank, builds):
    """megatron-core's local spec makes MLA's down projections column-parallel: ColumnParallelLinear divides their
    output over TP (tensor_parallel/layers.py:1038). Building the model at TP 2 on the meta device fails exactly
    where our rule refuses; Transformer Engine's spec (duplicated down projections) takes either."""
    pytest.importorskip("megatron.core")
    from dataclasses import replace

    from nest_megatron.model.spec import ModelSpec
    from nest_megatron.parallel.config import ParallelConfig
    from nest_megatron.parallel.rules import violation
    from nest_megatron.trace.meta import trace_megatron

    model = _moe_model(num_experts=None, multi_latent_attention=True, q_lora_rank=q_lora_rank, kv_lora_rank=16,
                       qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=8, position_embedding_type="rope",
                       normalization="RMSNorm", num_layers=1)
    try:
        trace_megatron(model, tp=2)
        built = True
    except NestError as err:
        built = False
        assert "megatron-core cannot build" in str(err)
    assert built == builds
    cfg = ParallelConfig(tp=2, dp=1, sp=True)
    local = violation(cfg, model=ModelSpec(replace(model, transformer_impl="local")), num_devices=2, global_batch_size=2)
    assert (local is None) == builds, local
    assert violation(cfg, model=ModelSpec(model), num_devices=2, global_batch_size=2) is None


@pytest.mark.parametrize("fields, megatron_says", [
    ({}, None),
    # megatron-core asks any pipeline its dtype first
    ({"pipeline_model_parallel_size": 2, "pipeline_dtype": torch.bfloat16},
     "no support for Pipeline parallelism with CPU offloading"),
    ({"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1},
     "CPU offloading does not work when activation recomputation is enabled"),
    ({"cpu_offloading_num_layers": 4}, "CPU offloading can be done only for layers less than 4"),
])
def test_cpu_offloading_rules_as_megatron_core_decides(fields, megatron_says):
    """megatron-core 0.16.1's own TransformerConfig (on CPU) refuses what the cpu-offloading rules refuse."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    base = {"num_layers": 4, "hidden_size": 64, "num_attention_heads": 4, "cpu_offloading": True,
            "cpu_offloading_num_layers": 1}
    flags = {"pipeline_model_parallel_size": "--pipeline-model-parallel-size 2",
             "recompute_granularity": "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1"}
    argv = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
            "--max-position-embeddings", "32", "--vocab-size", "128", "--micro-batch-size", "1", "--global-batch-size",
            "8", "--cpu-offloading-num-layers", str(fields.get("cpu_offloading_num_layers", 1)),
            *" ".join(flags[k] for k in fields if k in flags).split()]
    ours = [line for line in violations(argv, world_size=8) if line.startswith("--cpu-offloading-num-layers")]
    if megatron_says is None:
        TransformerConfig(**base)
        assert ours == []
        return
    with pytest.raises(ValueError, match=megatron_says):
        TransformerConfig(**{**base, **fields})
    assert len(ours) == 1, ours


@pytest.mark.parametrize("fields, megatron_says", [
    ({"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1},
     "full recompute is only supported with full iteration CUDA graph"),
    ({"recompute_granularity": "selective", "attention_dropout": 0.1},
     "attention dropout is not supported with graphed attention recomputation"),
    ({"recompute_granularity": "selective", "attention_dropout": 0.0}, None),
])
def test_cuda_graph_recompute_rules_as_megatron_core_decides(fields, megatron_says):
    """megatron-core 0.16.1's own TransformerConfig (on CPU), a whole-layer local CUDA graph (its default scope),
    refuses what the cuda-graphs rules refuse."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    base = {"num_layers": 4, "hidden_size": 64, "num_attention_heads": 4, "cuda_graph_impl": "local"}
    argv = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
            "--max-position-embeddings", "32", "--vocab-size", "128", "--micro-batch-size", "1", "--global-batch-size",
            "8", "--cuda-graph-impl", "local", "--attention-dropout", str(fields.get("attention_dropout", 0.1)),
            *(["--recompute-activations"] if fields["recompute_granularity"] == "selective" else
              ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"])]
    ours = [line for line in violations(argv, world_size=8) if "CUDA graphs" in line]
    if megatron_says is None:
        TransformerConfig(**base, **fields)
        assert ours == []
        return
    with pytest.raises(AssertionError, match=megatron_says):
        TransformerConfig(**base, **fields)
    assert len(ours) == 1, ours


@pytest.mark.parametrize("overlap", [False, True])
def test_shared_experts_recompute_with_the_overlap_as_megatron_core_decides(overlap):
    """megatron-core 0.16.1's TransformerConfig refuses the shared_experts recompute module with the shared expert
    overlapped; the rule does too, and the search then tries no set holding it (cost/recompute.py searched_sets)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    from nest_megatron.config.load import load
    from nest_megatron.cost.recompute import searched_sets
    from nest_megatron.parallel.rules import module_problem

    fields = {"num_layers": 4, "hidden_size": 64, "num_attention_heads": 4, "num_moe_experts": 4,
              "moe_shared_expert_intermediate_size": 64, "moe_shared_expert_overlap": overlap,
              "moe_token_dispatcher_type": "alltoall",  # the overlap's own requirement
              "recompute_granularity": "selective", "recompute_modules": ["shared_experts"]}
    model = load(["model=deepseek_v3", f"model.moe_shared_expert_overlap={str(overlap).lower()}"]).problem.model
    if overlap:
        with pytest.raises(ValueError, match="shared_experts recompute cannot work with --moe-shared-expert-overlap"):
            TransformerConfig(**fields)
        assert module_problem(model, ("shared_experts",)).startswith("plan.recompute_modules: shared_experts does not")
        assert all("shared_experts" not in modules for modules in searched_sets(model))
    else:
        TransformerConfig(**fields)
        assert module_problem(model, ("shared_experts",)) is None
        assert any("shared_experts" in modules for modules in searched_sets(model))


@pytest.mark.parametrize("fields, megatron_says", [
    ({"pipeline_model_parallel_size": 2, "pipeline_dtype": torch.bfloat16}, None),
    ({}, "Cannot defer embedding wgrad compute when pipeline model parallel is not used"),
    ({"pipeline_model_parallel_size": 2, "pipeline_dtype": torch.bfloat16, "gradient_accumulation_fusion": False},
     "Cannot defer embedding wgrad compute when gradient accumulation fusion is not used"),
])
def test_defer_embedding_wgrad_rules_as_megatron_core_decides(fields, megatron_says):
    """megatron-core 0.16.1's own TransformerConfig (on CPU) refuses what the defer-embedding-wgrad rules refuse."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    base = {"num_layers": 4, "hidden_size": 64, "num_attention_heads": 4, "defer_embedding_wgrad_compute": True,
            "gradient_accumulation_fusion": True}
    flags = {"pipeline_model_parallel_size": "--pipeline-model-parallel-size 2",
             "gradient_accumulation_fusion": "--no-gradient-accumulation-fusion"}
    argv = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
            "--max-position-embeddings", "32", "--vocab-size", "128", "--micro-batch-size", "1", "--global-batch-size",
            "8", "--defer-embedding-wgrad-compute", *" ".join(flags[k] for k in fields if k in flags).split()]
    ours = [line for line in violations(argv, world_size=8) if line.startswith("--defer-embedding-wgrad-compute")]
    if megatron_says is None:
        TransformerConfig(**{**base, **fields})
        assert ours == []
        return
    with pytest.raises(ValueError, match=megatron_says):
        TransformerConfig(**{**base, **fields})
    assert len(ours) == 1
