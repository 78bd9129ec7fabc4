"""What the user's Megatron argv fixes for the planner: a checkpoint to resume, flags that hold the optimizer, the
recompute or the pipeline.

The planner owns the parallel flags (launch/rewrite.py), but some choices of the argv are constraints, since a
plan that changed them would not run: the checkpoint format and the optimizer sharding it was written with, the
sharding an optimizer or --fp8-param-gather needs, the recompute CUDA graphs allow, what activation offloading
to the host allows, the EP all-to-all overlap the argv asks for or rules out, and the distributed optimizer's
instances.
Each becomes plan.* / solver.* overrides fed to the planner as --pin's are. (--tp-comm-overlap is no
constraint: it becomes train.tp_comm_overlap=true (config/megatron_argv.train_overrides), under which the
search has no TP > 1 plan without sequence parallel, and the plan emits the flag with TP > 1 only.) A resume laid out
by pipeline stage keeps the argv's layer split, and so does --pin pp when the argv gives one (its flags become the
plan.* keys of the same form). A key the user's own Hydra overrides set (plan.tp=..., plan.zero=..., or
solver.zero_stages=... for the ZeRO family, any plan.* split key for the split) is theirs: the user's word wins over
the argv's.

Megatron-LM references are to main at d98e8a6.
"""

from __future__ import annotations

from dataclasses import dataclass

from nest_megatron.config.megatron_argv import Scanned, cuda_graph_impl, scan
from nest_megatron.config.schema import ModelConfig
from nest_megatron.errors import NestError
from nest_megatron.launch.megatron_rules import (
    argv_form,
    argv_segments,
    argv_vpp,
    cpu_offloaded_layers,
    whole_layer_graphs,
)
from nest_megatron.launch.rewrite import pin_overrides
from nest_megatron.parallel.config import CP_COMM_TYPES
from nest_megatron.parallel.layout import ACCOUNT_FIELDS, EVEN, FIRST_LAST_FIELDS, LAYOUT_FIELD, flag_of, rank_layers

# training/config/training_config.py:486 (choices and default: --load without --ckpt-format reads torch_dist)
CKPT_FORMATS = ("torch", "torch_dist", "torch_dcp", "fsdp_dtensor")
DEFAULT_CKPT_FORMAT = "torch_dist"
# The sizes a bucket-space distributed-optimizer checkpoint (dp_reshardable) is laid out by: Megatron refuses a
# TP or PP change (training/checkpointing.py:2649-2657); its buckets are per model chunk and per expert buffer,
# keyed by model-parallel group (core/optimizer/distrib_optimizer.py:1877-1904), so VPP, EP and expert TP too, and
# the layers of each stage.
BUCKET_SPACE_SIZES = ["tp", "pp", "vpp", "ep", "etp"]
# A legacy `torch` checkpoint is one file per TP, PP (and EP) rank (training/checkpointing.py:264-275) holding
# that rank's slice of every chunk, and the distributed optimizer's own file beside it (:296, :741-750): it
# does not reshard, and the optimizer stays what wrote it.
LEGACY_SIZES = ["tp", "pp", "vpp", "ep", "etp", "zero"]
# Every plan.* key that gives the layer split (parallel.layout's forms): the user's own one replaces the argv's.
SPLIT_KEYS = {"plan.layers_per_stage", *(f"plan.{name}" for name in (*ACCOUNT_FIELDS, *FIRST_LAST_FIELDS, LAYOUT_FIELD))}


@dataclass(frozen=True)
class Constraint:
    overrides: list[str]  # plan.* / solver.* overrides for the planner
    why: str  # the argv's choice that fixes them, e.g. "--load with --ckpt-format torch_dist"


def _keys(overrides: list[str]) -> set[str]:
    return {item.partition("=")[0].lstrip("+~") for item in overrides}


def _theirs(override: str, user_keys: set[str]) -> bool:
    """Whether the user's Hydra overrides already decide what `override` would."""
    key = override.partition("=")[0]
    if key in ("plan.zero", "solver.zero_stages"):  # either one chooses the ZeRO stage
        return bool(user_keys & {"plan.zero", "solver.zero_stages"})
    if key in SPLIT_KEYS:  # any one gives the layer split
        return bool(user_keys & SPLIT_KEYS)
    return key in user_keys


def _pinned(argv: list[str], names: list[str], model: ModelConfig, why: str) -> list[str]:
    """The argv's values of `names` as plan.* pins; a value the model cannot take says which resume pinned it."""
    try:
        return pin_overrides(argv, names, model=model)
    except NestError as err:
        raise NestError(f"{why} keeps the argv's sizes, but {err}") from None


def _resume(argv: list[str], s: Scanned, model: ModelConfig) -> Constraint | None:
    """What a checkpoint needs of the plan: the argv's format and optimizer family, and the sizes it cannot
    reshard. A run given --ckpt-format without --load writes the checkpoint the next run resumes, so it is held
    the same way."""
    if not (s.present("--load") or s.has("--ckpt-format")):
        return None
    fmt = s.get("--ckpt-format", DEFAULT_CKPT_FORMAT)
    why = f"--load with --ckpt-format {fmt}" if s.present("--load") else f"--ckpt-format {fmt}"
    if fmt not in CKPT_FORMATS:
        raise NestError(f"--ckpt-format {fmt}: allowed are {', '.join(CKPT_FORMATS)}")
    fsdp, dist_opt = s.has("--use-megatron-fsdp"), s.has("--use-distributed-optimizer")
    if s.has("--use-torch-fsdp2") or fmt == "torch_dcp":
        # torch_dcp is read only with FSDP2 (training/arguments.py:1668), which the planner does not plan.
        raise NestError(f"{why}{' and --use-torch-fsdp2' if s.has('--use-torch-fsdp2') else ''}: the checkpoint is "
                        "torch FSDP2's, which the planner does not plan; resume it with torchrun as typed, or "
                        "convert it to torch_dist")
    if fmt == "fsdp_dtensor":
        # Only Megatron-FSDP reads fsdp_dtensor (arguments.py:1675-1676): ZeRO 2 or 3, whichever shards.
        if dist_opt and not fsdp:
            raise NestError(f"{why} and --use-distributed-optimizer: only Megatron-FSDP (--use-megatron-fsdp) reads "
                            "fsdp_dtensor, the distributed optimizer alone reads torch_dist or torch; give one family")
        return Constraint(["solver.zero_stages=[2,3]"], f"{why} (Megatron-FSDP)")
    if fsdp:  # Megatron-FSDP writes and reads fsdp_dtensor only (arguments.py:1169-1170)
        raise NestError(f"{why} and --use-megatron-fsdp: Megatron-FSDP reads and writes only --ckpt-format "
                        "fsdp_dtensor; give that, or resume with --use-distributed-optimizer")
    if fmt == "torch":
        split = _kept_split(s, model, even=True)
        return Constraint(_pinned(argv, LEGACY_SIZES, model, why) + split, f"{why} (it does not reshard)")
    # torch_dist: the distributed optimizer's state is saved by DP-rank buckets, DDP's by model tensor
    # (distrib_optimizer.py:1535-1540 vs optimizer.py:1196-1200): neither reads the other's; keep the argv's.
    if s.present("--no-load-optim") or s.present("--finetune"):  # the optimizer state is not read
        return Constraint(["solver.zero_stages=[0,1]"], f"{why} (DDP or the distributed optimizer)")
    if not dist_opt:
        return Constraint(["plan.zero=0"], f"{why} (DDP)")
    if s.present("--dist-ckpt-optim-fully-reshardable"):  # saved fully_reshardable (checkpointing.py:550-553)
        return Constraint(["plan.zero=1"], f"{why} (the distributed optimizer, fully reshardable)")
    split = _kept_split(s, model, even=True)
    return Constraint(_pinned(argv, ["zero", *BUCKET_SPACE_SIZES], model, why) + split,
                      f"{why} and --use-distributed-optimizer (its state is saved by bucket, for these sizes)")


def _zero_stages(overrides: list[str]) -> set[int] | None:
    """The ZeRO stages `overrides` allow (plan.zero=Z or solver.zero_stages=[...]); None when they do not say."""
    for item in overrides:
        key, _, value = item.partition("=")
        if key == "plan.zero" and value.isdigit():
            return {int(value)}
        if key == "solver.zero_stages":
            return {int(v) for v in value.strip("[]").split(",") if v.strip().isdigit()}
    return None


def _sharded_optimizer(s: Scanned, user: list[str], resume: Constraint | None) -> Constraint | None:
    """--fp8-param-gather needs a sharded optimizer (training/arguments.py:1095-1097): the distributed optimizer or
    Megatron-FSDP, ZeRO 1-3, within the stages the user's overrides allow; one line when they, or the checkpoint to
    resume, fix DDP. (--use-precision-aware-optimizer is train.precision_aware_optimizer, which the search holds
    to ZeRO 1.)"""
    if not s.present("--fp8-param-gather"):
        return None
    users = _zero_stages(user)
    if (users or (_zero_stages(resume.overrides) if resume is not None else None)) == {0}:
        source = "your overrides" if users else resume.why
        raise NestError("--fp8-param-gather needs a sharded optimizer (ZeRO 1-3: the distributed optimizer or "
                        f"Megatron-FSDP), but DDP (ZeRO 0) is fixed by {source}; drop one of them")
    stages = sorted((users or {1, 2, 3}) - {0})
    return Constraint([f"solver.zero_stages=[{','.join(map(str, stages))}]"], "--fp8-param-gather (a sharded optimizer)")


def _kept_split(s: Scanned, model: ModelConfig, *, even: bool, virtual: bool = True) -> list[str]:
    """The argv's layer split as plan.* keys, for a launch that keeps it: its flags' keys (the embedding / loss
    counted, first / last stage layers, a layout: parallel.layout's forms, which the plan emits again), a hybrid
    pattern's '|' segments as plan.layers_per_stage (each model chunk's layers; each rank's without `virtual`, which
    leaves the virtual stages free as the other forms do), or with `even` (a checkpoint laid out per stage: a legacy
    file's layers, a bucket's parameters) Megatron's even split as plan.layers_per_stage. Nothing with one stage."""
    pp = s.get("--pipeline-model-parallel-size", 1)
    form = argv_form(s)
    if pp == 1:
        return []
    segments = argv_segments(s)
    if segments is not None:
        if len(segments) % pp:  # an argv Megatron refuses: its own rule says why
            return []
        split = segments if virtual else rank_layers(segments, pp=pp)
        return [f"plan.layers_per_stage=[{','.join(map(str, split))}]"]
    if form != EVEN:
        return [f"plan.{name}={'true' if name in ACCOUNT_FIELDS else getattr(form, name)}" for name in form.given]
    vpp = argv_vpp(s, pp=pp, num_layers=model.num_layers)
    if not even or model.num_layers % (pp * vpp):  # an argv Megatron refuses: its own rule says why
        return []
    return [f"plan.layers_per_stage=[{','.join([str(model.num_layers // pp)] * pp)}]"]


def _cp_comm_type(s: Scanned, user_keys: set[str]) -> Constraint | None:
    """--cp-comm-type: the exchange the user chose is the plan's (Transformer Engine refuses some with some models:
    parallel/rules.py, e.g. p2p with sliding-window attention, which leaves such a plan without CP). One exchange
    for every layer, of those the cost model prices."""
    given = s.get("--cp-comm-type")
    if given is None or user_keys & {"plan.cp_comm_type", "solver.cp_comm_types"}:
        return None
    if len(set(given)) > 1 or given[0] not in CP_COMM_TYPES:
        raise NestError(f"--cp-comm-type {' '.join(given)}: the planner prices one of {', '.join(CP_COMM_TYPES)} for "
                        "every layer (per-layer lists and hierarchical a2a+p2p are not in the cost model)")
    return Constraint([f"plan.cp_comm_type={given[0]}"], f"--cp-comm-type {given[0]}")


# The optimizers Megatron-FSDP takes (training/arguments.py:1150-1151); the others of --optimizer's choices (:2913-2914:
# muon, dist_muon, lion, soap, adaptive_muon) assert it off (:1724-1741), under DDP or the distributed optimizer.
FSDP_OPTIMIZERS = ("adam", "sgd")


def _optimizer_without_fsdp(s: Scanned, user: list[str], fixed: list[Constraint]) -> Constraint | None:
    """An --optimizer Megatron-FSDP does not take holds the plan to ZeRO 0 or 1, within the stages the user's
    overrides and the other constraints allow; one line when they leave none."""
    optimizer = s.get("--optimizer", "adam")
    if optimizer in FSDP_OPTIMIZERS:
        return None
    allowed = {0, 1}
    for source, overrides in [("your overrides", user), *((c.why, c.overrides) for c in fixed)]:
        stages = _zero_stages(overrides)
        if stages is None:
            continue
        if not stages & allowed:
            raise NestError(f"--optimizer {optimizer} runs without Megatron-FSDP (ZeRO 0 or 1: DDP or the distributed "
                            f"optimizer), but ZeRO {','.join(map(str, sorted(stages)))} is fixed by {source}")
        allowed &= stages
    return Constraint([f"solver.zero_stages=[{','.join(map(str, sorted(allowed)))}]"],
                      f"--optimizer {optimizer} (no Megatron-FSDP)")


def _a2a_overlap(s: Scanned, user_keys: set[str]) -> Constraint | None:
    """The EP all-to-all overlap, which the search otherwise tries: the argv's --overlap-moe-expert-parallel-comm keeps
    it on; --overlap-dispatch-backward-with-experts-wgrad, which megatron-core takes only without it
    (transformer_config.py:3084-3087), keeps it off."""
    if user_keys & {"plan.moe_a2a_overlap", "solver.moe_a2a_overlap"}:
        return None
    if s.present("--overlap-moe-expert-parallel-comm"):
        return Constraint(["plan.moe_a2a_overlap=true"], "--overlap-moe-expert-parallel-comm")
    if s.present("--overlap-dispatch-backward-with-experts-wgrad"):
        return Constraint(["plan.moe_a2a_overlap=false"], "--overlap-dispatch-backward-with-experts-wgrad (no EP "
                          "all-to-all overlap with it)")
    return None


def _optimizer_instances(s: Scanned, user_keys: set[str]) -> Constraint | None:
    """--num-distributed-optimizer-instances N: the plan keeps N (its memory is priced with it; the rules hold the
    ZeRO stage and the data-parallel sizes to it)."""
    n = s.get("--num-distributed-optimizer-instances", 1)
    if n == 1 or "plan.distributed_optimizer_instances" in user_keys:
        return None
    return Constraint([f"plan.distributed_optimizer_instances={n}"], f"--num-distributed-optimizer-instances {n}")


def _microbatch_group(s: Scanned, user_keys: set[str]) -> Constraint | None:
    """--microbatch-group-size-per-virtual-pipeline-stage G: the plan keeps G (the interleaved schedule's warm-up
    memory is priced with it; the rules hold the micro-batches to it)."""
    group = s.get("--microbatch-group-size-per-virtual-pipeline-stage")
    if group is None or "plan.microbatch_group_size_per_vp_stage" in user_keys:
        return None
    return Constraint([f"plan.microbatch_group_size_per_vp_stage={group}"],
                      f"--microbatch-group-size-per-virtual-pipeline-stage {group}")


def _cuda_graphs(s: Scanned, user: list[str]) -> Constraint | None:
    """CUDA graphs hold the search's recompute kinds: per-layer graphs take no full recompute (transformer_config.py:
    2854-2858), and whole-layer graphs no selective recompute with attention dropout (:2868-2884), since every module
    set the search tries recomputes core_attn (cost/recompute.py CANDIDATE_SETS); one line when the user's overrides
    fix a kind they refuse."""
    impl = cuda_graph_impl(s)
    kinds = ["none", "selective", "full"]
    if impl in ("local", "transformer_engine"):
        kinds.remove("full")
    if whole_layer_graphs(s) and s.get("--attention-dropout", 0.1):
        kinds.remove("selective")
    if len(kinds) == 3:
        return None
    why = f"--cuda-graph-impl {impl}" + (" with attention dropout" if "selective" not in kinds else "")
    for item in user:
        key, _, value = item.partition("=")
        theirs = {"plan.recompute": [value], "solver.recompute": value.strip("[]").split(",")}.get(key)
        if theirs is None:
            continue
        kept = [kind for kind in kinds if kind in {v.strip() for v in theirs}]
        if not kept:
            raise NestError(f"{why} takes recompute {' or '.join(kinds)} (megatron-core), but {item} is fixed by your "
                            "overrides")
        kinds = kept
    return Constraint([f"solver.recompute=[{','.join(kinds)}]"], f"{why} (recompute {' or '.join(kinds)})")


def _cpu_offloading(argv: list[str], s: Scanned, *, model: ModelConfig, user: list[str], pinned: list[str],
                    fixed: list[Constraint]) -> Constraint | None:
    """--cpu-offloading-num-layers: the plan offloads as many layers (priced: cost/offload.py); megatron-core
    offloads no activations under pipeline parallelism or recompute (transformer_config.py:1891-1899), so the plan
    keeps pp 1 and no recompute; a pp or recompute that the user's overrides, a pin or another constraint holds
    otherwise is one line."""
    n = cpu_offloaded_layers(s)
    if not n:
        return None
    why = f"--cpu-offloading-num-layers {n}"
    held = [(item, "your overrides") for item in user]
    held += [(item, f"--pin {','.join(pinned)}") for item in pin_overrides(argv, [p for p in pinned if p in ("pp", "recompute")],
                                                                          model=model)]
    held += [(item, c.why) for c in fixed for item in c.overrides]
    for item, source in held:
        key, _, value = item.partition("=")
        if key in ("plan.pp", "plan.recompute") and value not in ("1", "none"):
            raise NestError(f"{why} needs pp 1 and no recompute (megatron-core has neither with CPU offloading), but "
                            f"{item} is fixed by {source}")
    decided = _keys([item for item, _ in held])
    kept = [item for item in (f"plan.cpu_offloading_num_layers={n}", "plan.pp=1", "plan.recompute=none")
            if not _theirs(item, decided)]
    return Constraint(kept, f"{why} (no pipeline parallelism or recompute with it)") if kept else None


def argv_constraints(argv: list[str], user: list[str], *, model: ModelConfig, pinned: list[str] = ()) -> list[Constraint]:
    """The constraints the argv puts on the plan, less what the user's overrides (`user`) decide themselves. With
    pp `pinned` (--pin pp), the argv's own split flags are kept too."""
    user_keys = _keys(user)
    out = []
    s = scan(argv)
    if s.present("--step-batch-size-schedule"):
        # every plan emits its --global-batch-size, which Megatron-LM refuses beside a schedule (arguments.py:698-701)
        raise NestError("--step-batch-size-schedule: the plan is made for one global batch and gives "
                        "--global-batch-size, which Megatron-LM refuses beside a schedule; drop the schedule (plan each "
                        "batch size as its own launch)")
    resume = _resume(argv, s, model)
    if resume is not None:
        kept = [item for item in resume.overrides if not _theirs(item, user_keys)]
        if kept:
            out.append(Constraint(kept, resume.why))
    sharded = _sharded_optimizer(s, user, resume)  # within the user's own stages already
    exchange = _cp_comm_type(s, user_keys)
    overlap = _a2a_overlap(s, user_keys)
    instances = _optimizer_instances(s, user_keys)
    group = _microbatch_group(s, user_keys)
    out += [c for c in (sharded, exchange, overlap, instances, group) if c is not None]
    optimizer = _optimizer_without_fsdp(s, user, out)
    graphs = _cuda_graphs(s, user)
    out += [c for c in (optimizer, graphs) if c is not None]
    offloading = _cpu_offloading(argv, s, model=model, user=user, pinned=list(pinned), fixed=out)
    out += [offloading] if offloading is not None else []
    decided = user_keys | _keys([item for c in out for item in c.overrides])
    split = (_kept_split(s, model, even=False, virtual="vpp" in pinned) if "pp" in pinned and not decided & SPLIT_KEYS
             else [])
    if split:
        flags = ", ".join(flag_of(name) for name in argv_form(s).given) or "'|' segments of --hybrid-layer-pattern"
        out.append(Constraint(split, f"pinned pp with the argv's layer split ({flags})"))
    return out
