"""Our model of the rules Megatron-LM applies to a launch line, checked on the final argv.

Megatron-LM checks its arguments in `validate_args` (megatron/training/arguments.py) and again when
megatron-core builds its groups (`initialize_model_parallel`, `TransformerConfig.__post_init__`).
A launch that breaks one of them dies on every rank after minutes of start-up; `violations(argv,
world_size=N)` finds them first. The rules about sizes (heads and query groups vs TP, expert grid,
global batch vs micro-batch x DP, micro-batches vs stages, sequence parallel vs TP, ...) are the
planner's own (`parallel.rules.RULES`), applied to the configuration the argv spells; the rules
about how flags combine are `ARGV_RULES` here, in the same style (id, source at the pinned
Megatron-LM commit, check). `rules_doc()` writes both tables as docs/megatron_rules.md.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from nest_megatron.config.megatron_argv import (
    FLAG_OF_KEY,
    Scanned,
    argv_hybrid_pattern,
    cuda_graph_impl,
    model_values,
    scan,
)
from nest_megatron.config.schema import ModelConfig
from nest_megatron.errors import NestError
from nest_megatron.model.spec import ModelSpec, Numerics
from nest_megatron.parallel.config import CP_COMM_TYPES, DEFAULT_RECOMPUTE_MODULES, ParallelConfig
from nest_megatron.parallel.layout import (
    ACCOUNT_FIELDS,
    EVEN,
    EXCLUSIONS,
    FIRST_LAST_FIELDS,
    LAYOUT_FIELD,
    PIPE,
    SplitForm,
    chunk_layers,
    excluded_pair,
    flag_of,
    form_problem,
    form_vpp,
    pattern_chunks,
)
from nest_megatron.parallel.rules import (
    DPA,
    MC,
    MEGATRON_LM_COMMIT,
    MODEL_RULES,
    RULES,
    TE,
    TRANSFORMER_ENGINE_COMMIT,
    TRANSFORMER_ENGINE_TAG,
    Rule,
    microbatch_group_problem,
    model_violation,
    violation,
)

VIRTUAL_FLAGS = ("--num-layers-per-virtual-pipeline-stage", "--num-virtual-stages-per-pipeline-rank",
                 "--pipeline-model-parallel-layout")
# Megatron-FSDP sharding strategy -> the ZeRO stage it realises (emit/megatron.py ZERO_FLAGS); no_shard and
# optim count as Megatron-FSDP too, which is what the rank-order rule asks.
FSDP_ZERO = {"optim_grads": 2, "optim_grads_params": 3, "no_shard": 2, "optim": 2}
# parallel.rules names the configuration's fields; on an argv, name the flag that sets them.
FLAG_OF_FIELD = {
    "plan.cp_comm_type": "--cp-comm-type",  # before plan.cp, which it begins with
    **{f"plan.{name}": flag_of(name) for name in (*ACCOUNT_FIELDS, *FIRST_LAST_FIELDS, LAYOUT_FIELD)},
    "plan.tp": "--tensor-model-parallel-size",
    "plan.pp": "--pipeline-model-parallel-size",
    "plan.cp": "--context-parallel-size",
    "plan.ep": "--expert-model-parallel-size",
    "plan.etp": "--expert-tensor-parallel-size",
    "plan.vpp": "virtual pipeline stages",
    "plan.sp=true": "--sequence-parallel",
    "plan.zero": "ZeRO stage",
    "plan.order=tp-cp-ep-pp-dp": "--use-tp-pp-dp-mapping",
    "use plan.order=tp-cp-ep-dp-pp": "drop --use-tp-pp-dp-mapping",
    "plan.recompute_num_layers": "--recompute-num-layers",
    "train.global_batch_size": "--global-batch-size",
    "train.tp_comm_overlap=true": "--tp-comm-overlap",
    "plan.distributed_optimizer_instances": "--num-distributed-optimizer-instances",
    "plan.microbatch_group_size_per_vp_stage": "--microbatch-group-size-per-virtual-pipeline-stage",
    "plan.moe_a2a_overlap=true": "--overlap-moe-expert-parallel-comm",
    "plan.moe_a2a_overlap=false": "no --overlap-moe-expert-parallel-comm",
}
# Transformer Engine's context-parallel exchanges (context_parallel.py:4076-4110; Megatron-LM's help text at
# training/arguments.py:3223 says "allgather", which TE refuses with a ValueError).
TE_CP_COMM_TYPES = (*CP_COMM_TYPES, "a2a+p2p")


def _zero(s: Scanned) -> int:
    if s.has("--use-megatron-fsdp"):
        return FSDP_ZERO[s.get("--data-parallel-sharding-strategy", "optim_grads_params")]
    return 1 if s.has("--use-distributed-optimizer") else 0


def argv_recompute_modules(s: Scanned) -> tuple[str, ...]:
    """The argv's --recompute-modules as it lists them, or Megatron's default [core_attn] (transformer_config.py:1940)."""
    return tuple(s.get("--recompute-modules", DEFAULT_RECOMPUTE_MODULES))


def _recompute(s: Scanned) -> tuple[str, int | None, str | None]:
    """(kind, layers recomputed per chunk or None for all, the problem with the flags or None)."""
    granularity = "selective" if s.has("--recompute-activations") else s.get("--recompute-granularity")
    method, layers = s.get("--recompute-method"), s.get("--recompute-num-layers")
    if s.has("--recompute-activations") and s.get("--recompute-granularity", "selective") != "selective":
        return "none", None, "--recompute-activations (selective) and --recompute-granularity full: choose one"
    if granularity is None:
        if method or layers is not None:
            return "none", None, "--recompute-method / --recompute-num-layers without --recompute-granularity full"
        return "none", None, None
    if granularity == "selective":
        if method or layers is not None:
            return "selective", None, "--recompute-granularity selective takes no --recompute-method / --recompute-num-layers"
        return "selective", None, None
    if granularity != "full":
        return "none", None, f"--recompute-granularity {granularity}: allowed are full, selective"
    if method not in ("uniform", "block"):
        return "full", None, "--recompute-granularity full needs --recompute-method uniform or block"
    if layers is None:
        return "full", None, "--recompute-granularity full needs --recompute-num-layers"
    # uniform recomputes every layer (in groups of n); block the first n of each chunk.
    return "full", (layers if method == "block" else None), None


def name_flags(line: str) -> str:
    """A parallel.rules line with each plan.* field replaced by the Megatron flag that sets it (a whole field name:
    plan.cp is no part of plan.cpu_offloading_num_layers)."""
    for name, flag in FLAG_OF_FIELD.items():
        line = re.sub(re.escape(name) + r"(?!\w)", flag, line)
    return line


@dataclass(frozen=True)
class Launch:
    """What an argv rule looks at: the scanned argv, the world size, the model and the model-parallel sizes."""
    s: Scanned
    world_size: int
    model: ModelConfig
    tp: int
    pp: int
    cp: int

    @property
    def dp(self) -> int:
        return max(self.world_size // (self.tp * self.pp * self.cp), 1)

    @property
    def gtp(self) -> int:
        """Megatron-LM's GTP weight-remat size: --tensor-parallel-num-weight-shards / tp (megatron/core/
        model_parallel_config.py:28-41)."""
        return _remat_size(self.s.get("--tensor-parallel-num-weight-shards"), self.tp)

    @property
    def form(self) -> SplitForm:
        """How the argv gives the layer split (parallel.layout: the flags of each form)."""
        return argv_form(self.s)


def argv_form(s: Scanned) -> SplitForm:
    """The split form the argv's flags spell."""
    form = SplitForm(**{name: s.get(flag_of(name), False if name in ACCOUNT_FIELDS else None)
                        for name in (*ACCOUNT_FIELDS, *FIRST_LAST_FIELDS, LAYOUT_FIELD)})
    return EVEN if form == EVEN else form


def argv_segments(s: Scanned) -> tuple[int, ...] | None:
    """The layers of each '|' segment of the argv's hybrid pattern (parallel/layout.py PIPE); None without them."""
    pattern = argv_hybrid_pattern(s)
    return pattern_chunks(pattern) if pattern is not None and PIPE in pattern else None


def argv_vpp(s: Scanned, *, pp: int, num_layers: int) -> int:
    """Virtual stages per pipeline rank as Megatron-LM reads them from the flags (arguments.py:941-977: a layout's
    stages / pp; layers per virtual stage as (num_layers + the embedding and loss counted) / pp / that number; or
    the count itself; a hybrid pattern's segments / pp, arguments.py:840-858); 1 where the flags are broken (other
    rules say how)."""
    segments = argv_segments(s)
    if segments is not None:
        return len(segments) // pp if len(segments) % pp == 0 else 1
    form = argv_form(s)
    if form.pipeline_model_parallel_layout is not None:
        vpp = form_vpp(form, pp=pp)
        return vpp if vpp is not None else 1
    per_virtual = s.get("--num-layers-per-virtual-pipeline-stage")
    if per_virtual is not None:
        counted = num_layers + sum(form.accounts)
        if form.first_last != (None, None) or counted % pp or (counted // pp) % per_virtual:
            return 1
        return counted // pp // per_virtual
    return s.get("--num-virtual-stages-per-pipeline-rank", 1)


def _vpp(launch: Launch) -> int:
    return argv_vpp(launch.s, pp=launch.pp, num_layers=launch.model.num_layers)


def argv_split(argv: list[str], *, world_size: int, model: ModelConfig | None = None) -> tuple[int, ...] | None:
    """The split a user's argv gives, as the layers of each of its pp*vpp model chunks (parallel.layout.chunk_layers
    reads every form: the embedding / loss counted, first / last stage layers, a layout); None for Megatron's even
    split or flags that break a rule (`violations` says which)."""
    s = scan(argv)
    pp = s.get("--pipeline-model-parallel-size", 1)
    segments = argv_segments(s)
    if segments is not None:  # a hybrid stack's '|' segments are its chunks
        return segments if len(segments) % pp == 0 and len(set(segments)) > 1 else None
    m = model or ModelConfig(**model_values(s, vocab_size=s.get("--vocab-size", 1)))
    form, vpp = argv_form(s), argv_vpp(s, pp=pp, num_layers=m.num_layers)
    if form == EVEN or form_problem(form, num_layers=m.num_layers, pp=pp, vpp=vpp,
                                    mtp_num_layers=m.mtp_num_layers) is not None:
        return None
    if any(excluded_pair(form, one, other) for _, one, other, _ in EXCLUSIONS):
        return None
    return chunk_layers(form, num_layers=m.num_layers, pp=pp, vpp=vpp)


# What Megatron-LM refuses beside a hybrid pattern: the split and the virtual stages come from its '|' segments
HYBRID_REFUSED = (*VIRTUAL_FLAGS, *(flag_of(name) for name in ACCOUNT_FIELDS))


def _hybrid_split_flags(launch: Launch):
    """A hybrid pattern takes no virtual-stage flag, layout or embedding / loss accounting: its pipe segments say them."""
    if argv_hybrid_pattern(launch.s) is None:
        return None
    given = next((flag for flag in HYBRID_REFUSED if launch.s.has(flag)), None)
    if given:
        return (f"{given} with --hybrid-layer-pattern: Megatron-LM takes a hybrid stack's split and virtual stages "
                f"only from '|' segments of the pattern (e.g. 'M*M-|M*M-' at pp 2); drop {given}")


def _hybrid_pipes_first_last(launch: Launch):
    """A hybrid pattern's pipe segments exclude first / last stage layers (a pattern without them may take those)."""
    if argv_segments(launch.s) is not None:
        given = next((flag_of(name) for name in FIRST_LAST_FIELDS if launch.s.has(flag_of(name))), None)
        if given:
            return (f"{given} with '|' segments in --hybrid-layer-pattern: the segments already give the split; "
                    "drop one of them")


def _hybrid_segments(launch: Launch):
    """A hybrid pattern's pipe segments are a multiple of pp (each rank the same number of virtual stages)."""
    segments = argv_segments(launch.s)
    if segments is not None and len(segments) % launch.pp:
        return (f"--hybrid-layer-pattern has {len(segments)} '|' segments: must be a multiple of "
                f"--pipeline-model-parallel-size {launch.pp} (segment k*pp + r is rank r's k-th virtual stage)")


def _world_divisible(launch: Launch):
    """The world size is a multiple of tp*pp*cp."""
    if launch.world_size % (launch.tp * launch.pp * launch.cp):
        return f"world size {launch.world_size} is not divisible by tp*pp*cp = {launch.tp}*{launch.pp}*{launch.cp}"


SHARD_FLAGS = ("--tensor-parallel-num-weight-shards", "--expert-tensor-parallel-num-weight-shards")
GTP = "GTP weight sharding (--tensor-parallel-num-weight-shards or --expert-tensor-parallel-num-weight-shards above TP)"


def _etp(launch: Launch) -> int:
    return launch.s.get("--expert-tensor-parallel-size", launch.tp)  # Megatron-LM's default (arguments.py:588)


def _remat_size(shards: int | None, tp: int) -> int:
    """GTP's weight-remat size, shards / tp: 1 without shards, or where they are no multiple of tp (rule
    weight-shards says so)."""
    return shards // tp if shards and shards % tp == 0 else 1


def _expert_gtp(launch: Launch) -> int:
    """The experts' GTP weight-remat size, --expert-tensor-parallel-num-weight-shards / etp."""
    return _remat_size(launch.s.get(SHARD_FLAGS[1]), _etp(launch))


def _weight_shards(launch: Launch):
    """GTP weight shards are a multiple of TP (the experts' of expert TP)."""
    for flag, tp_flag, tp in zip(SHARD_FLAGS, ("--tensor-model-parallel-size", "--expert-tensor-parallel-size"),
                                 (launch.tp, _etp(launch))):
        shards = launch.s.get(flag)
        if shards is not None and (shards < tp or shards % tp):
            return f"{flag} {shards}: must be a multiple of {tp_flag} {tp}, at least it (shards = tp x GTP ranks)"


def _weight_shards_world(launch: Launch):
    """GTP's ranks are a factor of the world: tp*pp*cp*gtp divides it (the experts' etp*ep*pp*egtp)."""
    w, pp, gtp, expert_gtp = launch.world_size, launch.pp, launch.gtp, _expert_gtp(launch)
    if gtp > 1 and w % (launch.tp * pp * launch.cp * gtp):  # gtp 1: rule world-divisible
        return (f"world size {w} with {SHARD_FLAGS[0]} {launch.s.get(SHARD_FLAGS[0])}: must be divisible by "
                f"tp*pp*cp*(shards/tp) = {launch.tp}*{pp}*{launch.cp}*{gtp}")
    etp, ep = _etp(launch), launch.s.get("--expert-model-parallel-size", 1)
    if expert_gtp > 1 and w % (etp * ep * pp * expert_gtp):
        return (f"world size {w} with {SHARD_FLAGS[1]} {launch.s.get(SHARD_FLAGS[1])}: must be divisible by "
                f"etp*ep*pp*(shards/etp) = {etp}*{ep}*{pp}*{expert_gtp}")


def _gtp_on(launch: Launch) -> bool:
    return launch.gtp > 1 or _expert_gtp(launch) > 1


def _weight_shards_instances(launch: Launch):
    """GTP weight sharding only with one distributed-optimizer instance."""
    instances = launch.s.get("--num-distributed-optimizer-instances", 1)
    if _gtp_on(launch) and instances > 1:
        return f"{GTP} with --num-distributed-optimizer-instances {instances}: megatron-core takes 1 instance; drop one"


def _weight_shards_checkpoint(launch: Launch):
    """GTP weight sharding checkpoints as torch or torch_dist."""
    ckpt = launch.s.get("--ckpt-format", "torch_dist")
    if _gtp_on(launch) and ckpt not in ("torch", "torch_dist"):
        return f"{GTP} with --ckpt-format {ckpt}: Megatron-LM takes torch or torch_dist only; drop one"


def _virtual_flags(launch: Launch):
    """At most one of the three ways to set virtual stages."""
    given = [f for f in VIRTUAL_FLAGS if launch.s.has(f)]
    if len(given) > 1:
        return f"{' and '.join(given)}: at most one of {', '.join(VIRTUAL_FLAGS)}"


def _flags(names: tuple[str, ...]) -> str:
    return " / ".join(flag_of(name) for name in names)


def _exclusion(rule_id: str, one: tuple[str, ...], other: tuple[str, ...]):
    """The check of one of parallel.layout.EXCLUSIONS: two ways to give the split together."""
    def check(launch: Launch):
        pair = excluded_pair(launch.form, one, other)
        if pair:
            return f"{flag_of(pair[0])} with {flag_of(pair[1])}: Megatron takes one way to give the layer split; choose one"
    check.__doc__ = f"{_flags(one)} excludes {_flags(other)}."
    check.__name__ = "_" + rule_id.replace("-", "_")
    return check


def _per_virtual_uneven(launch: Launch):
    """Layers per virtual stage only with an even split."""
    s = launch.s
    if (not s.has("--pipeline-model-parallel-layout") and s.has("--num-layers-per-virtual-pipeline-stage")
            and launch.form.first_last != (None, None)):
        return "--num-layers-per-virtual-pipeline-stage with an uneven split: use --num-virtual-stages-per-pipeline-rank"


def _per_virtual_divides(launch: Launch):
    """Layers per virtual stage divide the layers per stage (the embedding and loss counted as layers when asked)."""
    s, pp = launch.s, launch.pp
    per_virtual = s.get("--num-layers-per-virtual-pipeline-stage")
    counted = launch.model.num_layers + sum(launch.form.accounts)
    if (per_virtual is not None and not s.has("--pipeline-model-parallel-layout")
            and launch.form.first_last == (None, None) and (counted % pp or (counted // pp) % per_virtual)):
        return f"--num-layers-per-virtual-pipeline-stage {per_virtual}: must divide num_layers/pp = {counted}/{pp}"


def _vpp_p2p_overlap(launch: Launch):
    """Virtual stages with --no-overlap-p2p-communication need pp > 2."""
    if _vpp(launch) > 1 and launch.s.has("--no-overlap-p2p-communication") and launch.pp <= 2:
        return "virtual pipeline stages with --no-overlap-p2p-communication need --pipeline-model-parallel-size > 2"


def _p2p_warmup_flush(launch: Launch):
    """--overlap-p2p-communication-warmup-flush needs virtual stages and p2p overlap."""
    s = launch.s
    # Megatron-LM turns p2p overlap off without virtual stages (arguments.py:1010-1012) and batches p2p without it
    # (argument_utils.py:307); ModelParallelConfig then refuses the warm-up / flush overlap.
    if s.present("--overlap-p2p-communication-warmup-flush") and (
            _vpp(launch) == 1 or s.has("--no-overlap-p2p-communication")):
        return ("--overlap-p2p-communication-warmup-flush needs virtual pipeline stages and p2p overlap (no "
                "--no-overlap-p2p-communication): it overlaps the interleaved schedule's warm-up / flush only")


GROUP_FLAG = "--microbatch-group-size-per-virtual-pipeline-stage"


def _microbatches(launch: Launch, gbs: int, mbs: int) -> int:
    return gbs // (mbs * launch.dp)


def _moe_act_grouped_gemm(launch: Launch):
    """The moe_act recompute module only with --moe-grouped-gemm (the grouped experts' activation)."""
    s = launch.s
    if (_recompute(s)[0] == "selective" and "moe_act" in argv_recompute_modules(s)
            and not s.has("--moe-grouped-gemm")):
        return "--recompute-modules moe_act needs --moe-grouped-gemm"


def _recompute_flags(launch: Launch):
    """The recompute flags combine as Megatron reads them (selective alone; full with a method and a number)."""
    return _recompute(launch.s)[2]


def _micro_batch(launch: Launch):
    """--micro-batch-size is given."""
    if not launch.s.has("--micro-batch-size"):
        return "--micro-batch-size: Megatron requires it"


def _eval_sizes(launch: Launch) -> tuple[int, int] | None:
    """(eval global batch, eval micro-batch) when the argv gives either (each defaults to the training one,
    arguments.py:708-711); None without them: evaluation then runs the training batch."""
    s = launch.s
    if not (s.has("--eval-global-batch-size") or s.has("--eval-micro-batch-size")):
        return None
    mbs = s.get("--micro-batch-size", 1)
    gbs = s.get("--global-batch-size", mbs * launch.dp)
    return s.get("--eval-global-batch-size", gbs), s.get("--eval-micro-batch-size", mbs)


def _eval_batch(launch: Launch):
    """The eval batch is a multiple of the eval micro-batch x DP."""
    sizes = _eval_sizes(launch)
    if sizes and sizes[0] % (sizes[1] * launch.dp):
        return (f"--eval-global-batch-size {sizes[0]}: must be a multiple of --eval-micro-batch-size x dp = "
                f"{sizes[1]}*{launch.dp} (each defaults to the training one)")


def _eval_microbatch_group(launch: Launch):
    """Under the interleaved schedule the eval micro-batches fill the micro-batch groups as the training ones do."""
    s, sizes = launch.s, _eval_sizes(launch)
    # Megatron-LM evaluates with --eval-iters > 0 (its default 100) or --full-validation (training.py:5539)
    evaluates = s.get("--eval-iters", 100) > 0 or s.present("--full-validation")
    if not sizes or _vpp(launch) == 1 or not evaluates or sizes[0] % (sizes[1] * launch.dp):  # the last: eval-batch
        return None
    microbatches, group = _microbatches(launch, *sizes), s.get(GROUP_FLAG, launch.pp)
    problem = microbatch_group_problem(microbatches, group, launch.pp)
    if problem:
        return (f"{microbatches} eval micro-batches (--eval-global-batch-size / --eval-micro-batch-size / dp) in "
                f"groups of {group} under the interleaved schedule: {problem}; the first evaluation dies (or give "
                "--eval-iters 0)")


def _param_gather_optimizer(launch: Launch):
    """--overlap-param-gather needs a sharded optimizer."""
    s = launch.s
    if s.has("--overlap-param-gather") and not (s.has("--use-distributed-optimizer") or s.has("--use-megatron-fsdp")):
        return "--overlap-param-gather needs --use-distributed-optimizer (or --use-megatron-fsdp)"


def _param_gather_grad_reduce(launch: Launch):
    """--overlap-param-gather needs --overlap-grad-reduce."""
    if launch.s.has("--overlap-param-gather") and not launch.s.has("--overlap-grad-reduce"):
        return "--overlap-param-gather needs --overlap-grad-reduce"


def _fsdp_checkpoint(launch: Launch):
    """Megatron-FSDP checkpoints as fsdp_dtensor."""
    if launch.s.has("--use-megatron-fsdp") and launch.s.get("--ckpt-format") != "fsdp_dtensor":
        return "--use-megatron-fsdp needs --ckpt-format fsdp_dtensor"


def _dtensor_needs_fsdp(launch: Launch):
    """The fsdp_dtensor checkpoint only with Megatron-FSDP."""
    if launch.s.get("--ckpt-format") == "fsdp_dtensor" and not launch.s.has("--use-megatron-fsdp"):
        return "--ckpt-format fsdp_dtensor is only for --use-megatron-fsdp"


def _sharding_needs_fsdp(launch: Launch):
    """A sharding strategy only with Megatron-FSDP (Megatron-LM ignores it otherwise)."""
    if launch.s.has("--data-parallel-sharding-strategy") and not launch.s.has("--use-megatron-fsdp"):
        return "--data-parallel-sharding-strategy is only read with --use-megatron-fsdp"


def _meta_device_no_shard(launch: Launch):
    """Meta-device initialisation not with the no_shard strategy."""
    s = launch.s
    if (s.present("--init-model-with-meta-device") and s.has("--use-megatron-fsdp")
            and s.get("--data-parallel-sharding-strategy") == "no_shard"):
        return "--init-model-with-meta-device with --data-parallel-sharding-strategy no_shard: not supported; drop one"


def _torch_fsdp2(launch: Launch):
    """Torch FSDP2 not with pipeline or expert parallel or the distributed optimizer."""
    s = launch.s
    if s.has("--use-torch-fsdp2") and (
            launch.pp > 1 or s.get("--expert-model-parallel-size", 1) > 1 or s.has("--use-distributed-optimizer")):
        return "--use-torch-fsdp2: not with pipeline or expert parallel or --use-distributed-optimizer"


def _sequence_parallel_tp(launch: Launch):
    """--sequence-parallel needs TP > 1."""
    if launch.s.has("--sequence-parallel") and launch.tp == 1:
        return "--sequence-parallel needs --tensor-model-parallel-size > 1"


def _tp_comm_overlap(launch: Launch):
    """--tp-comm-overlap needs --sequence-parallel, which needs TP > 1."""
    s = launch.s
    if s.present("--tp-comm-overlap") and (not s.has("--sequence-parallel") or launch.tp == 1):
        return ("--tp-comm-overlap needs --sequence-parallel and --tensor-model-parallel-size > 1 "
                "(TP communication overlaps only the sequence-parallel all-gather / reduce-scatter)")


def _fp8_fp4(launch: Launch):
    """FP8 and FP4 not together."""
    if launch.s.has("--fp8-format") and launch.s.present("--fp4-format"):
        return "--fp8-format and --fp4-format: Megatron takes one low precision; choose one"


def _fp8_param_gather(launch: Launch):
    """--fp8-param-gather needs --fp8-format."""
    if launch.s.present("--fp8-param-gather") and not launch.s.has("--fp8-format"):
        return "--fp8-param-gather needs --fp8-format (FP8 parameters only in FP8 training)"


def _fp8_param_gather_optimizer(launch: Launch):
    """--fp8-param-gather needs a sharded optimizer."""
    s = launch.s
    if s.present("--fp8-param-gather") and not (s.has("--use-distributed-optimizer") or s.has("--use-megatron-fsdp")
                                                or s.has("--use-torch-fsdp2")):
        return "--fp8-param-gather needs --use-distributed-optimizer (or --use-megatron-fsdp / --use-torch-fsdp2)"


def _precision_aware_optimizer(launch: Launch):
    """--use-precision-aware-optimizer needs the distributed optimizer (Megatron-FSDP turns it on)."""
    s = launch.s
    if s.present("--use-precision-aware-optimizer") and not (s.has("--use-distributed-optimizer")
                                                             or s.has("--use-megatron-fsdp")):
        return ("--use-precision-aware-optimizer needs --use-distributed-optimizer (or --use-megatron-fsdp, "
                "which turns it on)")


def _param_gather_with_step(launch: Launch):
    """The param gather overlapped with the optimizer step: distributed optimizer, virtual stages, torch checkpoints."""
    s = launch.s
    if not s.present("--overlap-param-gather-with-optimizer-step"):
        return None
    # Megatron-FSDP turns the distributed optimizer on only later (arguments.py:1135): it does not count here
    needs = (("--use-distributed-optimizer", s.has("--use-distributed-optimizer")),
             ("--overlap-param-gather", s.has("--overlap-param-gather")),
             ("virtual pipeline stages", _vpp(launch) > 1),
             ("--ckpt-format torch", s.get("--ckpt-format", "torch_dist") == "torch"))  # not a distributed checkpoint
    missing = [need for need, ok in needs if not ok]
    if missing:
        return f"--overlap-param-gather-with-optimizer-step needs {', '.join(missing)}"


def _fsdp_single_grouped(launch: Launch):
    """Megatron-FSDP not with single grouped MoE parameters."""
    s = launch.s
    given = [flag for flag in ("--moe-single-grouped-weight", "--moe-single-grouped-bias") if s.present(flag)]
    if s.has("--use-megatron-fsdp") and given:
        return (f"{given[0]} with --use-megatron-fsdp: Megatron-FSDP does not remap grouped-tensor parameters; drop "
                f"{given[0]} or use --use-distributed-optimizer")


def _fsdp_weight_hash(launch: Launch):
    """Megatron-FSDP's optim_grads_params strategy checks no weight hash across DP replicas."""
    s = launch.s
    if (s.has("--use-megatron-fsdp") and s.get("--data-parallel-sharding-strategy", "optim_grads_params")
            == "optim_grads_params" and s.present("--check-weight-hash-across-dp-replicas-interval")):
        return ("--check-weight-hash-across-dp-replicas-interval with --data-parallel-sharding-strategy "
                "optim_grads_params (Megatron-FSDP's default): the replicas hold no whole weights; drop it")


def _save_params_param_gather(launch: Launch):
    """Saving the parameters on their own interval not with --overlap-param-gather."""
    s = launch.s
    if s.present("--save") and s.present("--save-params-interval") and s.has("--overlap-param-gather"):
        return ("--save-params-interval (with --save) and --overlap-param-gather: Megatron-LM refuses them together; "
                "drop one")


def _deepep_needs_flex(launch: Launch):
    """--moe-enable-deepep needs the flex dispatcher."""
    s = launch.s
    if s.present("--moe-enable-deepep") and s.get("--moe-token-dispatcher-type", "allgather") != "flex":
        return "--moe-enable-deepep needs --moe-token-dispatcher-type flex"


def _pad_deepep(launch: Launch):
    """The experts' input padded to capacity not with DeepEP."""
    s = launch.s
    deepep = s.has("--moe-enable-deepep") or s.get("--moe-flex-dispatcher-backend", "deepep") == "deepep"
    if s.present("--moe-pad-expert-input-to-capacity") and s.get("--moe-token-dispatcher-type") == "flex" and deepep:
        return ("--moe-pad-expert-input-to-capacity with --moe-token-dispatcher-type flex (DeepEP): megatron-core's "
                "DeepEP dispatcher does not pad to capacity; use --moe-token-dispatcher-type alltoall")


def _deepep_group(launch: Launch):
    """DeepEP needs expert TP x EP > 1."""
    s = launch.s
    deepep = s.has("--moe-enable-deepep") or s.get("--moe-flex-dispatcher-backend", "deepep") == "deepep"
    if s.has("--num-experts") and s.get("--moe-token-dispatcher-type") == "flex" and deepep:
        etp = s.get("--expert-tensor-parallel-size", launch.tp)
        if etp * s.get("--expert-model-parallel-size", 1) == 1:
            return ("--moe-token-dispatcher-type flex (DeepEP) needs --expert-tensor-parallel-size x "
                    "--expert-model-parallel-size > 1")


def _cp_comm_types(launch: Launch) -> tuple[str, ...]:
    return launch.s.get("--cp-comm-type", ("p2p",))


def _cp_comm_type_known(launch: Launch):
    """--cp-comm-type names Transformer Engine's exchanges: p2p, a2a, all_gather, a2a+p2p."""
    unknown = [t for t in _cp_comm_types(launch) if t not in TE_CP_COMM_TYPES]
    if launch.cp > 1 and unknown:
        return (f"--cp-comm-type {unknown[0]}: Transformer Engine takes {', '.join(TE_CP_COMM_TYPES)} (Megatron's help "
                "says allgather, which TE refuses; the name is all_gather)")


def _cp_comm_type_layers(launch: Launch):
    """--cp-comm-type gives one exchange for every layer, or one per layer."""
    given, layers = len(_cp_comm_types(launch)), launch.model.num_layers
    if launch.cp > 1 and given not in (1, layers):
        return f"--cp-comm-type with {given} values: give one for every layer, or one per layer ({layers})"


def _cp_hierarchical(launch: Launch):
    """a2a+p2p needs --hierarchical-context-parallel-sizes, whose product is the CP size."""
    s = launch.s
    if launch.cp > 1 and "a2a+p2p" in _cp_comm_types(launch):
        sizes = s.get("--hierarchical-context-parallel-sizes")
        if sizes is None:
            return "--cp-comm-type a2a+p2p needs --hierarchical-context-parallel-sizes (the a2a and p2p group sizes)"
        if not all(v.isdigit() for v in sizes) or math.prod(int(v) for v in sizes) != launch.cp:
            return (f"--hierarchical-context-parallel-sizes {' '.join(sizes)}: their product must be "
                    f"--context-parallel-size {launch.cp}")


def _dsa_cp(launch: Launch):
    """DeepSeek sparse attention with CP > 1 only through the all-gather exchange."""
    exchanges = _cp_comm_types(launch)
    if (launch.s.get("--experimental-attention-variant") == "dsa" and launch.cp > 1
            and any(t.replace("_", "").lower() != "allgather" for t in exchanges)):
        return (f"--experimental-attention-variant dsa with --context-parallel-size {launch.cp} and --cp-comm-type "
                f"{' '.join(exchanges)} (p2p when not given): DSAttention takes context parallelism only through "
                "all_gather; give --cp-comm-type all_gather")


GDN_VARIANTS = ("gdn", "gdn2", "gated_delta_net")  # gated_delta_net: the deprecated spelling of gdn


def _gdn_heads(launch: Launch):
    """Gated DeltaNet's key and value heads are multiples of tp*cp."""
    s, tp_cp = launch.s, launch.tp * launch.cp
    variant = s.get("--experimental-attention-variant")
    if variant not in GDN_VARIANTS:
        return None
    # megatron-core's defaults: 16 key and 32 value heads (transformer_config.py:379, 382)
    for flag, default in (("--linear-num-key-heads", 16), ("--linear-num-value-heads", 32)):
        heads = s.get(flag, default)
        if heads % tp_cp:
            return (f"{flag} {heads} with --experimental-attention-variant {variant}: must be a multiple of "
                    f"tp*cp = {launch.tp}*{launch.cp} (each rank takes whole linear-attention heads)")


def _hybrid_cp_layout(launch: Launch):
    """Hybrid context parallelism not with pipeline parallelism or Megatron-FSDP."""
    s = launch.s
    given = [flag for flag, on in ((f"--pipeline-model-parallel-size {launch.pp}", launch.pp > 1),
                                   ("--use-megatron-fsdp", s.has("--use-megatron-fsdp"))) if on]
    if s.present("--hybrid-context-parallel") and given:
        return (f"--hybrid-context-parallel with {' and '.join(given)}: Megatron-LM takes hybrid context parallelism "
                "only at pp 1 and without Megatron-FSDP; drop one")


def _hybrid_cp_even(launch: Launch):
    """Hybrid context parallelism pairs the data x context-parallel ranks: an even number of them."""
    dp = launch.dp // launch.gtp  # Megatron's data-parallel size leaves out GTP's ranks (arguments.py:441-448)
    if launch.s.present("--hybrid-context-parallel") and (dp * launch.cp) % 2:
        return (f"--hybrid-context-parallel with dp x cp = {dp}*{launch.cp} ranks: megatron-core needs an even number "
                "of them")


def _hybrid_cp_loss(launch: Launch):
    """Hybrid context parallelism needs --calculate-per-token-loss."""
    if launch.s.present("--hybrid-context-parallel") and not launch.s.present("--calculate-per-token-loss"):
        return "--hybrid-context-parallel needs --calculate-per-token-loss"


def _batch_invariant_cp(launch: Launch):
    """Batch-invariant mode not with context parallelism."""
    if launch.s.present("--batch-invariant-mode") and launch.cp > 1:
        return (f"--batch-invariant-mode with --context-parallel-size {launch.cp}: context parallelism runs "
                "Transformer Engine's own FlashAttention-2 kernels, not the batch-invariant ones; use cp 1")


def _first_last_bf16_delayed(launch: Launch):
    """FP8 with the first / last layers in bf16 not under the delayed recipe."""
    s = launch.s
    if s.has("--fp8-format") and s.present("--first-last-layers-bf16") and s.get("--fp8-recipe", "delayed") == "delayed":
        return ("--first-last-layers-bf16 with --fp8-recipe delayed (Megatron's default recipe): delayed scaling does "
                "not support it; use --fp8-recipe tensorwise, blockwise or mxfp8")


def _first_last_bf16_layers(launch: Launch):
    """FP8's bf16 first / last layers fit in a pipeline stage (num_layers // pp)."""
    s, most = launch.s, launch.model.num_layers // launch.pp
    if not (s.has("--fp8-format") and s.present("--first-last-layers-bf16")):
        return None
    for flag in ("--num-layers-at-start-in-bf16", "--num-layers-at-end-in-bf16"):
        layers = s.get(flag, 1)
        if not 0 <= layers <= most:
            return (f"{flag} {layers} with --pipeline-model-parallel-size {launch.pp}: allowed 0 to the "
                    f"num_layers // pp = {most} layers of a stage")


def _defer_embedding_wgrad_pp(launch: Launch):
    """The output layer's weight gradient deferred only with pipeline parallelism."""
    if launch.s.present("--defer-embedding-wgrad-compute") and launch.pp == 1:
        return ("--defer-embedding-wgrad-compute with --pipeline-model-parallel-size 1: megatron-core defers the output "
                "layer's weight gradient only with pipeline parallelism; use pp > 1 or drop it")


def _defer_embedding_wgrad_fusion(launch: Launch):
    """The output layer's weight gradient deferred only with gradient accumulation fusion."""
    if launch.s.present("--defer-embedding-wgrad-compute") and launch.s.present("--no-gradient-accumulation-fusion"):
        return ("--defer-embedding-wgrad-compute with --no-gradient-accumulation-fusion: megatron-core defers the "
                "output layer's weight gradient only with gradient accumulation fusion; drop one")


def _offload_expert_fc1_delayed(launch: Launch):
    """Offloading the grouped experts' FC1 input not with FP8 delayed scaling."""
    s = launch.s
    grouped = s.has("--num-experts") and s.has("--moe-grouped-gemm") and not s.has("--moe-use-legacy-grouped-gemm")
    offloaded = s.has("--fine-grained-activation-offloading") and "expert_fc1" in s.get("--offload-modules", ())
    if grouped and offloaded and s.has("--fp8-format") and s.get("--fp8-recipe", "delayed") == "delayed":
        return ("--offload-modules expert_fc1 with --moe-grouped-gemm and --fp8-recipe delayed (Megatron's default "
                "recipe): the grouped experts' FC1 then keeps its unquantized input, which Transformer Engine's "
                "GroupedLinear refuses under delayed scaling; use --fp8-recipe tensorwise, blockwise or mxfp8, or drop "
                "expert_fc1")


def _latent_legacy_grouped_gemm(launch: Launch):
    """A MoE latent size not with the legacy grouped GEMM (GroupedMLP)."""
    s = launch.s
    if s.has("--moe-latent-size") and s.has("--moe-use-legacy-grouped-gemm"):
        return ("--moe-latent-size with --moe-use-legacy-grouped-gemm: the legacy GroupedMLP has no latent projection "
                "(megatron-core asserts it); drop --moe-use-legacy-grouped-gemm (Transformer Engine's TEGroupedMLP)")


def _latent_shared_expert_overlap(launch: Launch):
    """A MoE latent size not with the shared expert overlapped with the dispatch."""
    s = launch.s
    if s.has("--moe-latent-size") and s.present("--moe-shared-expert-overlap"):
        return ("--moe-latent-size with --moe-shared-expert-overlap: the dispatcher would overlap the shared expert "
                "with latent-wide tokens, which megatron-core refuses in training; drop --moe-shared-expert-overlap")


def _shared_expert_overlap_dispatcher(launch: Launch):
    """The shared expert overlapped with the dispatch only under the alltoall or flex dispatcher."""
    s = launch.s
    dispatcher = s.get("--moe-token-dispatcher-type", "allgather")
    if s.has("--moe-shared-expert-intermediate-size") and s.present("--moe-shared-expert-overlap") and \
            dispatcher not in ("alltoall", "flex"):
        return (f"--moe-shared-expert-overlap with --moe-token-dispatcher-type {dispatcher} (Megatron's default "
                "allgather when not given): megatron-core overlaps the shared expert only with alltoall or flex")


def _a2a_shared_expert_overlap(launch: Launch):
    """The EP all-to-all overlap not with the shared expert overlapped with the dispatch."""
    s = launch.s
    if s.present("--overlap-moe-expert-parallel-comm") and s.present("--moe-shared-expert-overlap"):
        return ("--overlap-moe-expert-parallel-comm with --moe-shared-expert-overlap: megatron-core takes one of the "
                "two; drop --moe-shared-expert-overlap")


def cpu_offloaded_layers(s: Scanned) -> int:
    """The layers whose activations --cpu-offloading-num-layers sends to the host (0: none; Megatron-LM turns
    cpu_offloading on for any N > 0, arguments.py:1950-1951)."""
    return max(0, s.get("--cpu-offloading-num-layers", 0))


def _cpu_offloading_layers(launch: Launch):
    """CPU offloading of fewer layers than the model has."""
    n = cpu_offloaded_layers(launch.s)
    if n and n >= launch.model.num_layers:
        return (f"--cpu-offloading-num-layers {n}: megatron-core offloads fewer than the {launch.model.num_layers} "
                "layers of --num-layers")


def _cpu_offloading_pp(launch: Launch):
    """CPU offloading not with pipeline parallelism."""
    if cpu_offloaded_layers(launch.s) and launch.pp > 1:
        return (f"--cpu-offloading-num-layers with --pipeline-model-parallel-size {launch.pp}: megatron-core has no "
                "CPU offloading with pipeline parallelism; use pp 1 or drop the offloading")


def _cpu_offloading_recompute(launch: Launch):
    """CPU offloading not with activation recompute."""
    if cpu_offloaded_layers(launch.s) and _recompute(launch.s)[0] != "none":
        return ("--cpu-offloading-num-layers with --recompute-granularity: megatron-core does not offload and "
                "recompute activations together; drop one")


def _distribute_saved_activations(launch: Launch):
    """--distribute-saved-activations needs TP > 1 and full recompute."""
    if launch.s.present("--distribute-saved-activations") and (launch.tp == 1 or _recompute(launch.s)[0] != "full"):
        return ("--distribute-saved-activations needs --tensor-model-parallel-size > 1 and --recompute-granularity "
                "full with a --recompute-method: it splits the recomputed layers' saved inputs over TP")


def _distribute_saved_activations_sp(launch: Launch):
    """--distribute-saved-activations not with sequence parallel."""
    # at TP 1 Megatron-LM turns sequence parallel off (arguments.py:1433); the rule above names that case
    if launch.s.present("--distribute-saved-activations") and launch.s.has("--sequence-parallel") and launch.tp > 1:
        return ("--distribute-saved-activations with --sequence-parallel: megatron-core refuses them together (the "
                "saved inputs are already split over TP); drop one")


def _mhc_pp(launch: Launch):
    """Hyper-connections (mHC) not with pipeline parallelism."""
    if launch.s.present("--enable-mhc-connections") and launch.pp > 1:
        return (f"--enable-mhc-connections with --pipeline-model-parallel-size {launch.pp}: megatron-core has no "
                "pipeline support for mHC's n-stream activations yet; use pp 1")


def _mhc_full_recompute(launch: Launch):
    """Hyper-connections (mHC) not with full recompute."""
    if launch.s.present("--enable-mhc-connections") and _recompute(launch.s)[0] == "full":
        return ("--enable-mhc-connections with --recompute-granularity full: megatron-core recomputes mHC only "
                "selectively (--recompute-modules mhc); drop full recompute")


def whole_layer_graphs(s: Scanned) -> bool:
    """Whether the argv's CUDA graphs capture whole layers: full_iteration, or a per-layer graph without
    --cuda-graph-modules (or megatron-core 0.16.1's --cuda-graph-scope) naming its parts (transformer_config.py:
    2871-2876)."""
    impl = cuda_graph_impl(s)
    parts = s.has("--cuda-graph-modules") or s.has("--cuda-graph-scope")
    return impl == "full_iteration" or (impl in ("local", "transformer_engine") and not parts)


def _cuda_graphs_full_recompute(launch: Launch):
    """Per-layer CUDA graphs not with full recompute."""
    if cuda_graph_impl(launch.s) in ("local", "transformer_engine") and _recompute(launch.s)[0] == "full":
        return (f"--cuda-graph-impl {cuda_graph_impl(launch.s)} with --recompute-granularity full: megatron-core "
                "recomputes whole layers only under full_iteration CUDA graphs; drop one")


def _cuda_graphs_dropout_recompute(launch: Launch):
    """Whole-layer CUDA graphs recompute no module whose dropout they would capture."""
    s = launch.s
    if not whole_layer_graphs(s) or _recompute(s)[0] != "selective":
        return None
    modules = argv_recompute_modules(s)
    if s.get("--attention-dropout", 0.1) and "core_attn" in modules:
        return ("--recompute-modules core_attn with attention dropout under whole-layer CUDA graphs: megatron-core "
                "refuses graphed attention recompute with dropout; set --attention-dropout 0 or name "
                "--cuda-graph-modules")
    if s.get("--hidden-dropout", 0.1) and {"mlp", "moe"} & set(modules):
        return ("--recompute-modules mlp or moe with hidden dropout under whole-layer CUDA graphs: megatron-core "
                "refuses graphed MLP recompute with dropout; set --hidden-dropout 0 or name --cuda-graph-modules")


def _cpu_offloading_cuda_graphs(launch: Launch):
    """CPU offloading not with per-layer CUDA graphs."""
    s = launch.s
    if cpu_offloaded_layers(s) and cuda_graph_impl(s) in ("local", "transformer_engine"):
        return ("--cpu-offloading-num-layers with per-layer CUDA graphs: megatron-core refuses them together "
                "(full_iteration graphs are allowed); drop one")


ARGS = "megatron/training/arguments.py"
# The flag combinations Megatron-LM (and Transformer Engine) reject; the sizes are checked by parallel.rules.RULES on
# the configuration.
ARGV_RULES = (
    Rule("world-divisible", f"{ARGS}:432", _world_divisible),
    Rule("weight-shards", f"megatron/core/model_parallel_config.py:28-41 (from {ARGS}:416-421, 1496-1513)",
         _weight_shards),
    Rule("weight-shards-world", f"{ARGS}:424-434; megatron/core/parallel_state.py:815-823, 874-884",
         _weight_shards_world),
    Rule("weight-shards-instances", "megatron/core/parallel_state.py:808-811", _weight_shards_instances),
    Rule("weight-shards-checkpoint", f"{ARGS}:1515, 1558-1561", _weight_shards_checkpoint),
    Rule("virtual-flags", f"{ARGS}:928-939", _virtual_flags),
    *(Rule(rule_id, source, _exclusion(rule_id, one, other)) for rule_id, one, other, source in EXCLUSIONS),
    Rule("hybrid-split-flags", f"{ARGS}:814-838", _hybrid_split_flags),
    Rule("hybrid-pipes-first-last", f"{ARGS}:802-813; {MC}models/hybrid/hybrid_layer_allocation.py:377-383",
         _hybrid_pipes_first_last),
    Rule("hybrid-segments", f"{ARGS}:848-855; {MC}models/hybrid/hybrid_layer_allocation.py:458-465", _hybrid_segments),
    Rule("per-virtual-uneven", f"{ARGS}:954-956", _per_virtual_uneven),
    Rule("per-virtual-divides", f"{ARGS}:957-975", _per_virtual_divides),
    Rule("vpp-p2p-overlap", f"{ARGS}:1006", _vpp_p2p_overlap),
    Rule("p2p-warmup-flush", f"megatron/core/model_parallel_config.py:570-575 ({ARGS}:1010-1012 turns p2p overlap off "
         "without virtual stages; megatron/training/argument_utils.py:307 batches p2p without it)", _p2p_warmup_flush),
    Rule("recompute-flags", f"{ARGS}:1426; megatron/core/transformer/transformer_config.py:1901-1931", _recompute_flags),
    Rule("recompute-moe-act-grouped-gemm", "megatron/core/transformer/transformer_config.py:1964-1967",
         _moe_act_grouped_gemm),
    Rule("micro-batch", f"{ARGS}:693", _micro_batch),
    Rule("eval-batch", f"{ARGS}:707-720", _eval_batch),
    Rule("eval-microbatch-group", "megatron/core/pipeline_parallel/schedules.py:1160-1180 (megatron/training/"
         "training.py:5131-5133, 5193: the eval micro-batches; :5539 evaluates with --eval-iters > 0)",
         _eval_microbatch_group),
    Rule("param-gather-optimizer", f"{ARGS}:1025", _param_gather_optimizer),
    Rule("param-gather-grad-reduce", f"{ARGS}:1028", _param_gather_grad_reduce),
    Rule("param-gather-with-optimizer-step", f"{ARGS}:1066-1074 (use_dist_ckpt: any --ckpt-format but torch, "
         "megatron/training/utils/common_utils.py:581)", _param_gather_with_step),
    Rule("save-params-param-gather", f"{ARGS}:1361, 1367-1368", _save_params_param_gather),
    Rule("fsdp-checkpoint", f"{ARGS}:1169", _fsdp_checkpoint),
    Rule("dtensor-needs-fsdp", f"{ARGS}:1676", _dtensor_needs_fsdp),
    Rule("sharding-needs-fsdp", "nest: Megatron-LM reads --data-parallel-sharding-strategy only with Megatron-FSDP",
         _sharding_needs_fsdp),
    Rule("meta-device-no-shard", f"{ARGS}:1183", _meta_device_no_shard),
    Rule("fsdp-single-grouped", f"{ARGS}:1138-1148", _fsdp_single_grouped),
    Rule("fsdp-weight-hash", f"{ARGS}:1162-1164 (the strategy's default: :3190)", _fsdp_weight_hash),
    Rule("torch-fsdp2", f"{ARGS}:1034-1039", _torch_fsdp2),
    Rule("sequence-parallel-tp", f"nest: {ARGS}:1433 turns it off silently", _sequence_parallel_tp),
    Rule("tp-comm-overlap", f"{ARGS}:1441-1442 (after :1433 turns sequence parallel off at tp 1)", _tp_comm_overlap),
    Rule("fp8-fp4", f"{ARGS}:1100-1101", _fp8_fp4),
    Rule("fp8-param-gather", "megatron/core/transformer/transformer_config.py:1566-1567", _fp8_param_gather),
    Rule("fp8-param-gather-optimizer", f"{ARGS}:1095-1097", _fp8_param_gather_optimizer),
    Rule("precision-aware-optimizer", f"megatron/core/optimizer/__init__.py:1057; {ARGS}:1127-1134 (Megatron-FSDP)",
         _precision_aware_optimizer),
    Rule("deepep-needs-flex", "megatron/core/transformer/transformer_config.py:1743-1745", _deepep_needs_flex),
    Rule("deepep-group", "megatron/core/transformer/moe/token_dispatcher.py:1836 (its tp_size is expert TP, :89)",
         _deepep_group),
    Rule("pad-deepep", "megatron/core/transformer/transformer_config.py:1754-1761", _pad_deepep),
    Rule("latent-legacy-grouped-gemm", "megatron-core 0.16.1 moe/experts.py:86-87 (GroupedMLP); core_v0.16.1 "
         f"{ARGS}:1273 (d98e8a6 has no legacy GroupedMLP left)", _latent_legacy_grouped_gemm),
    Rule("latent-shared-expert-overlap", "megatron/core/transformer/moe/moe_layer.py:476-481 (megatron-core 0.16.1 "
         "moe_layer.py:264-268)", _latent_shared_expert_overlap),
    Rule("shared-expert-overlap-dispatcher", "megatron/core/transformer/transformer_config.py:1820-1826",
         _shared_expert_overlap_dispatcher),
    Rule("a2a-shared-expert-overlap", "megatron/core/transformer/transformer_config.py:3039-3041",
         _a2a_shared_expert_overlap),
    Rule("first-last-bf16-delayed", "megatron/core/transformer/transformer_config.py:1527-1530",
         _first_last_bf16_delayed),
    Rule("first-last-bf16-layers", "megatron/core/transformer/transformer_config.py:1532-1556",
         _first_last_bf16_layers),
    Rule("cp-comm-type-layers", "megatron/core/transformer/transformer_config.py:3103-3113", _cp_comm_type_layers),
    Rule("cp-hierarchical", f"{ARGS}:580-585", _cp_hierarchical),
    Rule("cp-comm-type-known", f"{DPA}context_parallel.py:4076-4110", _cp_comm_type_known),
    Rule("dsa-cp", "megatron/core/transformer/transformer_config.py:3162-3176 (the default --cp-comm-type p2p: "
         f"{ARGS}:3221; one value: megatron/training/argument_utils.py:343-344)", _dsa_cp),
    Rule("gdn-heads", "megatron/core/transformer/transformer_config.py:1470, 1500-1508", _gdn_heads),
    Rule("hybrid-cp-layout", f"{ARGS}:1444-1445, 1447", _hybrid_cp_layout),
    Rule("hybrid-cp-even", "megatron/core/parallel_state.py:1040-1044", _hybrid_cp_even),
    Rule("hybrid-cp-loss", f"{ARGS}:1444, 1449", _hybrid_cp_loss),
    Rule("batch-invariant-cp", "megatron/core/transformer/transformer_config.py:3200, 3230-3232", _batch_invariant_cp),
    Rule("cpu-offloading-layers", f"megatron/core/transformer/transformer_config.py:1884-1889; {ARGS}:1950-1951",
         _cpu_offloading_layers),
    Rule("cpu-offloading-pp", "megatron/core/transformer/transformer_config.py:1891-1894", _cpu_offloading_pp),
    Rule("cpu-offloading-recompute", "megatron/core/transformer/transformer_config.py:1896-1899",
         _cpu_offloading_recompute),
    Rule("distribute-saved-activations", f"{ARGS}:1410-1419", _distribute_saved_activations),
    Rule("distribute-saved-activations-sp", "megatron/core/transformer/transformer_config.py:1934-1938",
         _distribute_saved_activations_sp),
    Rule("mhc-pp", "megatron/core/transformer/transformer_config.py:2087, 2092-2098", _mhc_pp),
    Rule("mhc-full-recompute", "megatron/core/transformer/transformer_config.py:2069-2074", _mhc_full_recompute),
    Rule("cpu-offloading-cuda-graphs", f"megatron/core/transformer/transformer_config.py:2798-2801; {ARGS}:619-630 (the "
         "deprecated CUDA-graph flags)", _cpu_offloading_cuda_graphs),
    Rule("cuda-graphs-full-recompute", "megatron/core/transformer/transformer_config.py:2854-2858",
         _cuda_graphs_full_recompute),
    Rule("cuda-graphs-dropout-recompute", "megatron/core/transformer/transformer_config.py:2868-2899",
         _cuda_graphs_dropout_recompute),
    Rule("defer-embedding-wgrad-pp", "megatron/core/model_parallel_config.py:545-548", _defer_embedding_wgrad_pp),
    Rule("defer-embedding-wgrad-fusion", f"megatron/core/model_parallel_config.py:550-553; {ARGS}:2944-2948",
         _defer_embedding_wgrad_fusion),
    Rule("offload-expert-fc1-delayed", f"{TE}pytorch/module/grouped_linear.py:107-108 (Float8Quantizer: delayed "
         "scaling); megatron/core/transformer/moe/experts.py:254-257, 278-284 (TEGroupedMLP's linear_fc1 saves its "
         "original input unless MXFP8 or NVFP4; megatron-core 0.16.1 experts.py:598-601 with every recipe)",
         _offload_expert_fc1_delayed),
)


def violations(argv: list[str], *, world_size: int) -> list[str]:
    """Every rule the final Megatron argv breaks at `world_size` ranks, one line each ([] when it launches)."""
    s = scan(argv)
    if not s.has("--num-layers"):
        return ["--num-layers: the argv describes no model"]
    m = ModelConfig(**model_values(s, vocab_size=s.get("--vocab-size", 1)))  # the vocabulary sets no rule
    model_line = model_violation(m)  # the model's own rules (MODEL_RULES), named by the flags that set them
    if model_line:
        return [re.sub(r"model\.\w+", lambda key: FLAG_OF_KEY.get(key.group(0), key.group(0)), model_line)]
    launch = Launch(s, world_size, m, tp=s.get("--tensor-model-parallel-size", 1),
                    pp=s.get("--pipeline-model-parallel-size", 1), cp=s.get("--context-parallel-size", 1))
    out = [line for rule in ARGV_RULES if (line := rule.check(launch)) is not None]

    kind, recomputed, _ = _recompute(s)
    mbs, dp, vpp = s.get("--micro-batch-size", 1), launch.dp, _vpp(launch)
    gbs = s.get("--global-batch-size", mbs * dp)
    comm_types = set(_cp_comm_types(launch))
    cfg = ParallelConfig(
        tp=launch.tp, pp=launch.pp, dp=dp, cp=launch.cp,
        ep=s.get("--expert-model-parallel-size", 1),
        etp=s.get("--expert-tensor-parallel-size", launch.tp if m.num_experts else 1),
        vpp=vpp, sp=s.has("--sequence-parallel"), mbs=mbs,
        zero=_zero(s), recompute=kind, recompute_num_layers=recomputed, recompute_modules=argv_recompute_modules(s),
        order="tp-cp-ep-pp-dp" if s.has("--use-tp-pp-dp-mapping") else "tp-cp-ep-dp-pp",
        # a per-layer list of several exchanges is no configuration the planner prices (the rules name it)
        cp_comm_type=comm_types.pop() if len(comm_types) == 1 else " ".join(_cp_comm_types(launch)),
        moe_a2a_overlap=s.present("--overlap-moe-expert-parallel-comm"),
        distributed_optimizer_instances=s.get("--num-distributed-optimizer-instances", 1),
        # the offloaded layers left out: the argv rules cpu-offloading-* judge them, by their flag
        microbatch_group_size_per_vp_stage=s.get(GROUP_FLAG),
    )
    # The split's own rules (parallel.rules: layout, account-split, first-last-split, even-split) on the form the
    # flags spell. The FP8 recipe Transformer Engine's shape rules depend on (Megatron's default recipe: delayed).
    numerics = Numerics(fp8_recipe=s.get("--fp8-recipe", "delayed") if s.has("--fp8-format") else None)
    rule = violation(cfg, model=ModelSpec(m, numerics=numerics), num_devices=world_size, global_batch_size=gbs,
                     tp_comm_overlap=s.present("--tp-comm-overlap"), form=launch.form,
                     layers_per_stage=argv_segments(s))  # a hybrid pattern's segments: a given split
    if rule and name_flags(rule) not in out:
        out.append(name_flags(rule))
    return out


def rules_doc() -> str:
    """docs/megatron_rules.md: every rule of both tables with what it asks and its source."""
    lines = [
        "# Megatron-LM's rules, as the planner applies them",
        "",
        "Generated by `nest_megatron.launch.megatron_rules.rules_doc()`; tests/test_megatron_rules.py fails when this",
        "file and the tables differ. Sources are file:line of Megatron-LM at "
        f"[`{MEGATRON_LM_COMMIT[:12]}`](https://github.com/NVIDIA/Megatron-LM/tree/{MEGATRON_LM_COMMIT}),",
        "an upstream issue / PR, or `nest:` for the planner's own policy (Megatron-LM would launch, or silently",
        "change the flag). The installed megatron-core 0.16.1 makes the same checks at other lines; tests/test_fsdp_mesh.py",
        "and tests/test_megatron_rules.py run its code for the Megatron-FSDP mesh and the MoE bias rule.",
        "",
    ]
    config_where = ("`nest_megatron/parallel/rules.py` `RULES`: the search space, `evaluate`, the emitted argv; the "
                    "first broken one is reported")
    argv_where = ("`nest_megatron/launch/megatron_rules.py` `ARGV_RULES`: how the flags of a final argv combine; then "
                  "the configuration rules on the sizes it spells")
    for title, where, table in (
        ("Model rules", "`nest_megatron/parallel/rules.py` `MODEL_RULES`: the model keys when they load "
         "(config/load.py) and the model a launch line describes", MODEL_RULES),
        ("Configuration rules", config_where, [r for r in RULES if not is_te(r)]),
        ("Launch-line rules", argv_where, [r for r in ARGV_RULES if not is_te(r)]),
    ):
        lines += [f"## {title}", "", f"{where}.", ""] + _table(table)
    lines += [
        "## Transformer Engine's rules",
        "",
        "Transformer Engine asserts these when a module is built or at the first forward pass, after minutes of",
        "start-up on every rank, where no CPU run reaches. They are in the same tables, checked after Megatron-LM's;",
        "sources (`TE transformer_engine/...`) are file:line of Transformer Engine at "
        f"[`{TRANSFORMER_ENGINE_TAG}`](https://github.com/NVIDIA/TransformerEngine/tree/{TRANSFORMER_ENGINE_COMMIT})",
        f"(`{TRANSFORMER_ENGINE_COMMIT[:12]}`, what megatron-core 0.16.1's uv.lock pins; its wheel asks for",
        ">=2.9.0a0,<2.12.0, and each check cited is the same in v2.9-v2.11). Per rank, tokens T = mbs x",
        "seq_length / cp in every GEMM and T / tp in a sequence-parallel input shard. Where an option fixes a rule,",
        "the planner chooses it: `plan.cp_comm_type` (`--cp-comm-type`) is searched over `solver.cp_comm_types` and",
        "priced by cost/layer.py; a `--cp-comm-type` in the user's argv is a constraint.",
        "",
        f"### Configuration ({config_where.split(':')[0]})",
        "",
    ] + _table([r for r in RULES if is_te(r)])
    lines += [f"### Launch line ({argv_where.split(':')[0]})", ""] + _table([r for r in ARGV_RULES if is_te(r)])
    lines += [
        "### Read, and no rule needed",
        "",
        "- The experts' grouped GEMM (`--moe-grouped-gemm`, which every MoE plan emits): Transformer Engine's",
        "  `GroupedLinear` refuses a bias with TP > 1 (`TE transformer_engine/pytorch/module/grouped_linear.py:655-659`)",
        "  and current scaling with TP > 1 (`:882-885`), but megatron-core never hands it a TP group: with expert TP or",
        "  EP it communicates itself and passes tp_size 1 (`megatron/core/extensions/transformer_engine.py:2459-2474`).",
        "  Its asserts on delayed scaling with the original input kept are rule `offload-expert-fc1-delayed`.",
        "- MoE permutation fusion (`--moe-permute-fusion`): megatron-core asks only that Transformer Engine has the",
        "  fused kernels (`megatron/core/transformer/transformer_config.py:2984-2995`, TE >= 2.1); no shape or layout.",
        "",
    ]
    return "\n".join(lines)


def is_te(rule: Rule) -> bool:
    """Whether the rule is Transformer Engine's (its source is a TE file)."""
    return rule.source.startswith(TE)


def _table(rules: list[Rule]) -> list[str]:
    return (["| id | rule | source |", "|---|---|---|"]
            + [f"| `{r.id}` | {r.check.__doc__.splitlines()[0]} | {r.source} |" for r in rules] + [""])


def check(argv: list[str], *, world_size: int) -> None:
    """Raise one NestError line for the first rule the argv breaks."""
    found = violations(argv, world_size=world_size)
    if found:
        raise NestError(f"Megatron would reject the launch line: {found[0]}")
