"""launch/megatron_rules.py: the rarer flags Megatron-LM (d98e8a6) checks against the plan's sizes at start-up: the
p2p warm-up / flush overlap, micro-batch groups of the interleaved schedule, the eval batch, DeepSeek sparse
attention and Gated DeltaNet with TP / CP, hybrid context parallelism, distributed saved activations,
hyper-connections, batch-invariant mode, FP8's bf16 end layers, the optimizer-step param gather, Megatron-FSDP's
exclusions and GTP weight sharding. Each with an argv that keeps it (no violation at all) and one that breaks it
(exactly that violation); where megatron-core 0.16.1 makes the same check on CPU (its config classes, its
initialize_model_parallel on the fake backend, its interleaved schedule run up to the check), it refuses too. The
checks only Megatron-LM's arguments.py (not on PyPI) or d98e8a6's newer megatron-core makes are cited."""

from __future__ import annotations

import pytest
from test_megatron_rules import BASE, MOE, problems

from nest_megatron.config.megatron_argv import model_values, scan
from nest_megatron.config.schema import ModelConfig
from nest_megatron.launch.megatron_rules import ARGV_RULES, GROUP_FLAG, Launch, violations

FULL = "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1"
VIRTUAL = "--pipeline-model-parallel-size 2 --num-virtual-stages-per-pipeline-rank 2"  # 16 micro-batches at world 8
FSDP = "--use-megatron-fsdp --ckpt-format fsdp_dtensor"
GDN = ("--experimental-attention-variant gdn --linear-attention-freq 2 --tensor-model-parallel-size 2 "
       "--context-parallel-size 2")
GTP = "--tensor-model-parallel-size 2 --tensor-parallel-num-weight-shards 4"  # 2 GTP ranks per TP group
EXPERT_TP = "--tensor-model-parallel-size 2 --sequence-parallel --disable-bias-linear"
DSA = "--experimental-attention-variant dsa --disable-bias-linear"  # DSA is MLA without biases
HYBRID_CP = "--hybrid-context-parallel --calculate-per-token-loss"
DISTRIBUTED_OPTIMIZER = "--use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather"
BF16_ENDS = "--fp8-format hybrid --fp8-recipe tensorwise --first-last-layers-bf16 --pipeline-model-parallel-size 2"
BATCH_INVARIANT = "--batch-invariant-mode --attention-backend flash --flash-attention-version 3 --attention-dropout 0"

# (rule id, argv that keeps it + world size, argv that breaks it + world size, the start of the one line expected, the
# base argv); every argv keeps all the other rules
CASES = [
    ("p2p-warmup-flush",
     (f"{VIRTUAL} --overlap-p2p-communication-warmup-flush", 8),
     ("--pipeline-model-parallel-size 2 --overlap-p2p-communication-warmup-flush", 8),
     "--overlap-p2p-communication-warmup-flush needs virtual pipeline stages and p2p overlap", BASE),
    ("p2p-warmup-flush",  # pp 4: the interleaved schedule takes --no-overlap-p2p-communication (vpp-p2p-overlap)
     ("--pipeline-model-parallel-size 4 --num-virtual-stages-per-pipeline-rank 2 "
      "--overlap-p2p-communication-warmup-flush", 8),
     ("--pipeline-model-parallel-size 4 --num-virtual-stages-per-pipeline-rank 2 --no-overlap-p2p-communication "
      "--overlap-p2p-communication-warmup-flush", 8),
     "--overlap-p2p-communication-warmup-flush needs virtual pipeline stages and p2p overlap", BASE),
    ("eval-batch",  # the eval global batch defaults to the training one, 64 = 2 x 8 but not 3 x 8
     ("--eval-micro-batch-size 2", 8),
     ("--eval-micro-batch-size 3", 8),
     "--eval-global-batch-size 64: must be a multiple of --eval-micro-batch-size x dp = 3*8", BASE),
    ("eval-microbatch-group",  # 4 or 3 eval micro-batches (dp 4) in groups of pp = 2
     (f"{VIRTUAL} --eval-global-batch-size 16", 8),
     (f"{VIRTUAL} --eval-global-batch-size 12", 8),
     "3 eval micro-batches (--eval-global-batch-size / --eval-micro-batch-size / dp) in groups of 2 under the "
     "interleaved schedule: leaves a last group of 1", BASE),
    ("eval-microbatch-group",  # no evaluation, no eval schedule
     (f"{VIRTUAL} --eval-global-batch-size 12 --eval-iters 0", 8),
     (f"{VIRTUAL} --eval-global-batch-size 4", 8),
     "1 eval micro-batches (--eval-global-batch-size / --eval-micro-batch-size / dp) in groups of 2 under the "
     "interleaved schedule: must be from pp=2 to the 1 micro-batches", BASE),
    ("dsa-cp",
     (f"{DSA} --context-parallel-size 2 --cp-comm-type all_gather", 8),
     (f"{DSA} --context-parallel-size 2", 8),
     "--experimental-attention-variant dsa with --context-parallel-size 2 and --cp-comm-type p2p (p2p when not given): "
     "DSAttention takes context parallelism only through all_gather", BASE),
    ("gdn-heads",  # tp*cp = 4 divides 4 key / 8 value heads, not 2 / 4
     (f"{GDN} --linear-num-key-heads 4 --linear-num-value-heads 8", 8),
     (f"{GDN} --linear-num-key-heads 2 --linear-num-value-heads 4", 8),
     "--linear-num-key-heads 2 with --experimental-attention-variant gdn: must be a multiple of tp*cp = 2*2", BASE),
    ("hybrid-cp-layout",
     (HYBRID_CP, 8),
     (f"{HYBRID_CP} --pipeline-model-parallel-size 2", 8),
     "--hybrid-context-parallel with --pipeline-model-parallel-size 2: Megatron-LM takes hybrid context parallelism "
     "only at pp 1", BASE),
    ("hybrid-cp-layout",
     (f"{HYBRID_CP} --use-distributed-optimizer", 8),
     (f"{HYBRID_CP} {FSDP}", 8),
     "--hybrid-context-parallel with --use-megatron-fsdp", BASE),
    ("hybrid-cp-even",  # dp 4 or 3
     (HYBRID_CP, 4),
     (f"{HYBRID_CP} --global-batch-size 63", 3),
     "--hybrid-context-parallel with dp x cp = 3*1 ranks: megatron-core needs an even number", BASE),
    ("hybrid-cp-loss",
     (HYBRID_CP, 8),
     ("--hybrid-context-parallel", 8),
     "--hybrid-context-parallel needs --calculate-per-token-loss", BASE),
    ("batch-invariant-cp",
     (BATCH_INVARIANT, 8),
     (f"{BATCH_INVARIANT} --context-parallel-size 2", 8),
     "--batch-invariant-mode with --context-parallel-size 2", BASE),
    ("first-last-bf16-layers",  # 4 layers per stage
     (f"{BF16_ENDS} --num-layers-at-start-in-bf16 4", 8),
     (f"{BF16_ENDS} --num-layers-at-start-in-bf16 5", 8),
     "--num-layers-at-start-in-bf16 5 with --pipeline-model-parallel-size 2: allowed 0 to the num_layers // pp = 4",
     BASE),
    ("distribute-saved-activations",
     (f"--tensor-model-parallel-size 2 {FULL} --distribute-saved-activations", 8),
     (f"{FULL} --distribute-saved-activations", 8),
     "--distribute-saved-activations needs --tensor-model-parallel-size > 1 and --recompute-granularity full", BASE),
    ("distribute-saved-activations",
     (f"--tensor-model-parallel-size 2 {FULL} --distribute-saved-activations", 8),
     ("--tensor-model-parallel-size 2 --recompute-activations --distribute-saved-activations", 8),
     "--distribute-saved-activations needs --tensor-model-parallel-size > 1 and --recompute-granularity full", BASE),
    ("distribute-saved-activations-sp",
     (f"--tensor-model-parallel-size 2 {FULL} --distribute-saved-activations", 8),
     (f"--tensor-model-parallel-size 2 --sequence-parallel {FULL} --distribute-saved-activations", 8),
     "--distribute-saved-activations with --sequence-parallel: megatron-core refuses them together", BASE),
    ("mhc-pp",
     ("--enable-mhc-connections", 8),
     ("--enable-mhc-connections --pipeline-model-parallel-size 2", 8),
     "--enable-mhc-connections with --pipeline-model-parallel-size 2", BASE),
    ("mhc-full-recompute",
     ("--enable-mhc-connections --recompute-activations", 8),
     (f"--enable-mhc-connections {FULL}", 8),
     "--enable-mhc-connections with --recompute-granularity full", BASE),
    ("param-gather-with-optimizer-step",
     (f"{VIRTUAL} {DISTRIBUTED_OPTIMIZER} --ckpt-format torch --overlap-param-gather-with-optimizer-step", 8),
     (f"{VIRTUAL} {DISTRIBUTED_OPTIMIZER} --overlap-param-gather-with-optimizer-step", 8),
     "--overlap-param-gather-with-optimizer-step needs --ckpt-format torch", BASE),
    ("param-gather-with-optimizer-step",
     (f"{VIRTUAL} {DISTRIBUTED_OPTIMIZER} --ckpt-format torch --overlap-param-gather-with-optimizer-step", 8),
     (f"{DISTRIBUTED_OPTIMIZER} --ckpt-format torch --overlap-param-gather-with-optimizer-step", 8),
     "--overlap-param-gather-with-optimizer-step needs virtual pipeline stages", BASE),
    ("save-params-param-gather",
     (f"{DISTRIBUTED_OPTIMIZER} --save /tmp/ckpt --save-interval 10", 8),
     (f"{DISTRIBUTED_OPTIMIZER} --save /tmp/ckpt --save-interval 10 --save-params-interval 5", 8),
     "--save-params-interval (with --save) and --overlap-param-gather", BASE),
    ("fsdp-single-grouped",
     ("--use-distributed-optimizer --moe-grouped-gemm --moe-use-grouped-tensor --moe-single-grouped-weight", 8),
     (f"{FSDP} --moe-grouped-gemm --moe-use-grouped-tensor --moe-single-grouped-weight", 8),
     "--moe-single-grouped-weight with --use-megatron-fsdp", MOE),
    ("fsdp-weight-hash",
     (f"{FSDP} --data-parallel-sharding-strategy optim_grads --check-weight-hash-across-dp-replicas-interval 10", 8),
     (f"{FSDP} --check-weight-hash-across-dp-replicas-interval 10", 8),
     "--check-weight-hash-across-dp-replicas-interval with --data-parallel-sharding-strategy optim_grads_params", BASE),
    ("weight-shards",
     (GTP, 8),
     ("--tensor-model-parallel-size 2 --tensor-parallel-num-weight-shards 3", 8),
     "--tensor-parallel-num-weight-shards 3: must be a multiple of --tensor-model-parallel-size 2", BASE),
    ("weight-shards",  # expert TP 2 (tp's, by default; biases only at expert TP 1) with 1 shard
     (f"{EXPERT_TP} --expert-tensor-parallel-num-weight-shards 4", 8),
     (f"{EXPERT_TP} --expert-tensor-parallel-num-weight-shards 1", 8),
     "--expert-tensor-parallel-num-weight-shards 1: must be a multiple of --expert-tensor-parallel-size 2", MOE),
    ("weight-shards-world",  # tp 2 x 2 GTP ranks: 4 divides 8, not 6
     (GTP, 8),
     (f"{GTP} --global-batch-size 63", 6),
     "world size 6 with --tensor-parallel-num-weight-shards 4: must be divisible by tp*pp*cp*(shards/tp) = 2*1*1*2",
     BASE),
    ("weight-shards-world",  # etp 1 x ep 2 x 4 expert GTP ranks: 8 divides 8, not 4
     ("--expert-model-parallel-size 2 --expert-tensor-parallel-size 1 --expert-tensor-parallel-num-weight-shards 4", 8),
     ("--expert-model-parallel-size 2 --expert-tensor-parallel-size 1 --expert-tensor-parallel-num-weight-shards 4", 4),
     "world size 4 with --expert-tensor-parallel-num-weight-shards 4: must be divisible by etp*ep*pp*(shards/etp) = "
     "1*2*1*4", MOE),
    ("weight-shards-instances",
     (f"{GTP} --use-distributed-optimizer", 8),
     (f"{GTP} --use-distributed-optimizer --num-distributed-optimizer-instances 2", 8),
     "GTP weight sharding (--tensor-parallel-num-weight-shards or --expert-tensor-parallel-num-weight-shards above TP) "
     "with --num-distributed-optimizer-instances 2", BASE),
    ("weight-shards-checkpoint",
     (f"{GTP} --use-distributed-optimizer", 8),
     (f"{GTP} {FSDP}", 8),
     "GTP weight sharding (--tensor-parallel-num-weight-shards or --expert-tensor-parallel-num-weight-shards above TP) "
     "with --ckpt-format fsdp_dtensor", BASE),
]


@pytest.mark.parametrize("rule, good, bad, line, base", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_rule(rule, good, bad, line, base):
    assert problems(good[0], world=good[1], base=base) == []
    found = problems(bad[0], world=bad[1], base=base)
    assert len(found) == 1 and found[0].startswith(line), found
    check = next(r.check for r in ARGV_RULES if r.id == rule)
    assert check(launch_of(bad, base)) == found[0]  # the line is this rule's


def launch_of(argv_world: tuple[str, int], base: list[str]) -> Launch:
    """The Launch `violations` builds for the argv (with `problems`' global batch 64 unless it gives one)."""
    argv, world = argv_world
    batch = [] if "--global-batch-size" in argv else ["--global-batch-size", "64"]
    s = scan([*base, *batch, *argv.split()])
    return Launch(s, world, ModelConfig(**model_values(s, vocab_size=s.get("--vocab-size"))),
                  tp=s.get("--tensor-model-parallel-size", 1), pp=s.get("--pipeline-model-parallel-size", 1),
                  cp=s.get("--context-parallel-size", 1))


def test_every_new_rule_has_a_case():
    ids = {rule for rule, *_ in CASES}
    assert ids <= {r.id for r in ARGV_RULES}
    # 22: the micro-batch groups are parallel/rules.py's interleaved-microbatches (tests/test_microbatch_groups.py)
    assert len(ids) == 22


# ------------------------------------------------------------------------------------------------
# megatron-core 0.16.1's own checks (on CPU) agree where it has them
# ------------------------------------------------------------------------------------------------
SMALL = {"num_layers": 4, "hidden_size": 64, "num_attention_heads": 4}
SMALL_MODEL = ("--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32 "
               "--vocab-size 128 --micro-batch-size 1").split()
SMALL_ARGV = [*SMALL_MODEL, "--global-batch-size", "8"]


def ours(extra: str, prefix: str, *, world: int = 8) -> list[str]:
    return [line for line in violations([*SMALL_ARGV, *extra.split()], world_size=world) if line.startswith(prefix)]


def decided_alike(build, found: list[str], *, refused: tuple[type[Exception], str] | None) -> None:
    """megatron-core's `build()` and our rules (`found`, their lines) decide alike: both accept, or megatron-core
    raises `refused` (its error type and message) and our rules give one line."""
    if refused is None:
        build()
        assert found == []
        return
    error, match = refused
    with pytest.raises(error, match=match):
        build()
    assert len(found) == 1


@pytest.mark.parametrize("extra, overlap", [
    ("--pipeline-model-parallel-size 2 --num-virtual-stages-per-pipeline-rank 2", True),
    ("--pipeline-model-parallel-size 2", False),  # Megatron-LM turns the overlap off without virtual stages
    ("--pipeline-model-parallel-size 4 --num-virtual-stages-per-pipeline-rank 1 --no-overlap-p2p-communication", False),
])
def test_p2p_warmup_flush_as_megatron_core_decides(extra, overlap):
    """ModelParallelConfig (model_parallel_config.py:450-455 in 0.16.1, 570-575 at d98e8a6) refuses the warm-up /
    flush overlap without p2p overlap; Megatron-LM passes overlap_p2p_comm (off without virtual stages,
    arguments.py:1010-1012) and batch_p2p_comm = not it (argument_utils.py:307)."""
    from megatron.core.model_parallel_config import ModelParallelConfig

    flush = {"overlap_p2p_comm_warmup_flush": True, "overlap_p2p_comm": overlap, "batch_p2p_comm": not overlap}
    found = ours(f"{extra} --overlap-p2p-communication-warmup-flush", "--overlap-p2p-communication-warmup-flush")
    decided_alike(lambda: ModelParallelConfig(**flush), found,
                  refused=None if overlap else (ValueError, "only compatible with overlap_p2p_comm but not batch_p2p_comm"))


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_distribute_saved_activations_sp_as_megatron_core_decides(sequence_parallel):
    """TransformerConfig (transformer_config.py:1187-1191 in 0.16.1, 1934-1938 at d98e8a6) refuses distributed saved
    activations with sequence parallel."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    fields = {**SMALL, "tensor_model_parallel_size": 2, "sequence_parallel": sequence_parallel,
              "recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1,
              "distribute_saved_activations": True}
    found = ours(f"--tensor-model-parallel-size 2 {'--sequence-parallel' if sequence_parallel else ''} {FULL} "
                 "--distribute-saved-activations", "--distribute-saved-activations")
    decided_alike(lambda: TransformerConfig(**fields), found,
                  refused=(ValueError, "must be false when sequence parallel is enabled") if sequence_parallel else None)


@pytest.mark.parametrize("cp, megatron_core_accepts", [(1, True), (2, False)])
def test_dsa_cp_as_megatron_core_decides(cp, megatron_core_accepts):
    """megatron-core 0.16.1's TransformerConfig (transformer_config.py:1987-1990) refuses DSA with any CP > 1, as our
    rule does with the default p2p exchange; d98e8a6 (transformer_config.py:3162-3176) also takes CP through
    all_gather, which our rule lets pass and 0.16.1 still refuses."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    fields = {**SMALL, "experimental_attention_variant": "dsa", "add_bias_linear": False, "apply_rope_fusion": False,
              "context_parallel_size": cp}
    found = ours(f"{DSA} --context-parallel-size {cp}", "--experimental-attention-variant dsa")
    decided_alike(lambda: TransformerConfig(**fields), found,
                  refused=None if megatron_core_accepts else (AssertionError, "context parallelism is not supported by "
                                                                              "DSAttention"))
    if not megatron_core_accepts:
        assert ours(f"{DSA} --context-parallel-size {cp} --cp-comm-type all_gather", "--experimental") == []


@pytest.mark.parametrize("key_heads, fits", [(4, True), (2, False)])
def test_gdn_heads_as_megatron_core_decides(key_heads, fits):
    """megatron-core 0.16.1's TransformerConfig (transformer_config.py:975-980, its gated_delta_net at CP 1) refuses
    key / value heads TP does not divide; d98e8a6 (transformer_config.py:1500-1508) asks it of tp*cp."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    fields = {**SMALL, "experimental_attention_variant": "gated_delta_net", "linear_attention_freq": 2,
              "linear_conv_kernel_dim": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
              "linear_num_key_heads": key_heads, "linear_num_value_heads": 2 * key_heads,
              "tensor_model_parallel_size": 4}
    found = ours(f"--experimental-attention-variant gated_delta_net --linear-attention-freq 2 "
                 f"--tensor-model-parallel-size 4 --linear-num-key-heads {key_heads} "
                 f"--linear-num-value-heads {2 * key_heads}", "--linear-num")
    decided_alike(lambda: TransformerConfig(**fields), found,
                  refused=None if fits else (AssertionError, "linear_num_key_heads must be a multiple of "
                                                             "tensor_model_parallel_size"))


@pytest.mark.parametrize("world, even", [(4, True), (3, False)])
def test_hybrid_cp_even_as_megatron_core_decides(world, even):
    """megatron-core 0.16.1's initialize_model_parallel (parallel_state.py:938-943; d98e8a6 :1040-1044), on torch's
    fake process-group backend, refuses hybrid context parallelism over an odd number of dp x cp ranks."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from nest_megatron.trace.cpu_megatron import prepare_cpu_megatron
    from nest_megatron.trace.meta import teardown_distributed

    prepare_cpu_megatron()
    teardown_distributed()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        ps.initialize_model_parallel(hybrid_context_parallel=True, create_gloo_process_groups=False)
        refusal = None
    except AssertionError as err:
        refusal = str(err)
    finally:
        teardown_distributed()
    found = ours("--hybrid-context-parallel --calculate-per-token-loss", "--hybrid-context-parallel", world=world)
    assert (refusal is None) == even == (found == []), (refusal, found)
    if refusal:
        assert refusal == "Hybrid context parallel requires an even number of ranks"


class Group:
    """A process group of `size` ranks, this one rank 0: what the schedule asks of its groups before it runs."""

    def __init__(self, size: int):
        self._size = size

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return 0


def schedule_refusal(pp: int, microbatches: int, group: int) -> str | None:
    """What megatron-core's interleaved schedule raises for its micro-batch groups at the start of a step (2 stand-in
    model chunks per rank, forward only), or None once it is past that check."""
    import types

    import torch
    from megatron.core.enums import ModelType
    from megatron.core.model_parallel_config import ModelParallelConfig
    from megatron.core.pipeline_parallel.schedules import forward_backward_pipelining_with_interleaving

    config = ModelParallelConfig(pipeline_model_parallel_size=pp, pipeline_dtype=torch.bfloat16, overlap_p2p_comm=True,
                                 batch_p2p_comm=False, microbatch_group_size_per_vp_stage=group)
    chunks = [torch.nn.Module() for _ in range(2)]
    for chunk in chunks:
        chunk.config, chunk.model_type = config, ModelType.encoder_or_decoder
    try:
        forward_backward_pipelining_with_interleaving(
            forward_step_func=None, data_iterator=[None, None], model=chunks, num_microbatches=microbatches,
            seq_length=8, micro_batch_size=1, forward_only=True,
            p2p_communicator=types.SimpleNamespace(config=config, pp_group=Group(pp)),
            pg_collection=types.SimpleNamespace(tp=Group(1), cp=Group(1), pp=Group(pp), dp_cp=Group(1), embd=None,
                                                pos_embd=None))
    except (ValueError, RuntimeError) as err:
        if "contiguous micro-batches" in str(err) or "remainder of M" in str(err):
            return str(err)
    except AttributeError:  # past the check: the stand-in config has no model
        pass
    return None


EIGHT_LAYERS = ["8" if i and SMALL_MODEL[i - 1] == "--num-layers" else word for i, word in enumerate(SMALL_MODEL)]


@pytest.mark.parametrize("pp", [2, 4])
def test_microbatch_groups_as_megatron_cores_schedule_decides(pp, monkeypatch):
    """megatron-core 0.16.1's interleaved schedule (schedules.py:995-1015; d98e8a6 :1160-1180) checks the micro-batch
    groups at the start of its first step, with no config-time check. Run up to there on CPU (stand-in model chunks
    and process groups; torch.zeros off CUDA), it refuses exactly the groups rule interleaved-microbatches refuses: every group
    size 1..10 for 1..12 micro-batches (dp 1, so the global batch is the micro-batches)."""
    import torch

    zeros = torch.zeros
    monkeypatch.setattr(torch, "zeros", lambda *args, device=None, **kwargs: zeros(*args, **kwargs))
    verdicts = {}
    for microbatches in range(1, 13):
        for group in range(1, 11):
            # 8 layers: an even split over pp 4 x 2 virtual stages, so that only the micro-batches can be refused
            argv = [*EIGHT_LAYERS, "--global-batch-size", str(microbatches), "--pipeline-model-parallel-size", str(pp),
                    "--num-virtual-stages-per-pipeline-rank", "2", GROUP_FLAG, str(group)]
            # all our lines: with fewer micro-batches than pp an earlier rule (fill-pipeline) names the refusal
            ours = violations(argv, world_size=pp)
            verdicts[microbatches, group] = (ours == [], schedule_refusal(pp, microbatches, group) is None)
    assert {fits for fits, _ in verdicts.values()} == {True, False}
    assert {key: v for key, v in verdicts.items() if v[0] != v[1]} == {}
