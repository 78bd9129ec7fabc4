"""What the plan changed in the user's argv, one line per flag, with why: `--flag: old -> new (why)`.

A user who typed `--tensor-model-parallel-size 8` and gets 2 is told so before anything starts. Each layout
flag's change is explained on its own: the plan with only that flag back at the user's value is priced with
the same cost model (one evaluation per changed flag), so the line says by how much the plan is faster, or
which Megatron rule that argv breaks, or what of it does not fit (device memory, or the host memory of offloaded
activations).
"""

from __future__ import annotations

from collections.abc import Callable

from nest_megatron.config.load import Loaded
from nest_megatron.config.megatron_argv import PLANNER_FLAGS, Scanned, argv_hybrid_pattern, scan
from nest_megatron.config.schema import PlanChoice
from nest_megatron.cost.evaluate import estimate
from nest_megatron.errors import NestError
from nest_megatron.launch.megatron_rules import argv_form, argv_split, name_flags, violations
from nest_megatron.launch.rewrite import DISPATCHER, DISPATCHER_FLAG_NAMES, OLD_PATTERN, PIN_FLAGS, pinned_values
from nest_megatron.parallel.layout import FIRST_LAST_FIELDS, PIPE, chunk_layers, flag_of, form_problem, pattern_chunks
from nest_megatron.plan import Plan
from nest_megatron.profile.for_plan import profiled_problem
from nest_megatron.solver.space import evaluate_config

# Megatron-LM's value of a flag it is not given (training/arguments.py, training/config/training_config.py):
# the plan writing that value out changes nothing, and is not listed.
DEFAULTS = {
    "--tensor-model-parallel-size": 1,
    "--pipeline-model-parallel-size": 1,
    "--context-parallel-size": 1,
    "--expert-model-parallel-size": 1,
    "--ckpt-format": "torch_dist",
    DISPATCHER: "allgather",
    "--moe-flex-dispatcher-backend": "deepep",  # megatron-core transformer_config.py moe_flex_dispatcher_backend
    "--cp-comm-type": ("p2p",),  # training/arguments.py:3221
    "--num-distributed-optimizer-instances": 1,  # training/arguments.py:3216
    "--cpu-offloading-num-layers": 0,  # megatron-core transformer_config.py cpu_offloading_num_layers: off
}


# Flags that only mean something with another (Megatron-FSDP's): explained by it, and reverted with it.
# A hybrid pattern's '|' segments are cut for its pp (launch/rewrite.py OLD_PATTERN: either spelling).
FOLLOWERS = {"--data-parallel-sharding-strategy": "--use-megatron-fsdp", "--init-model-with-meta-device": "--use-megatron-fsdp",
             "--ckpt-format": "--use-megatron-fsdp", "--hybrid-layer-pattern": "--pipeline-model-parallel-size",
             OLD_PATTERN: "--pipeline-model-parallel-size"}
FIRST_LAST_FLAGS = tuple(flag_of(name) for name in FIRST_LAST_FIELDS)


def _shown(value) -> str:
    if isinstance(value, tuple):  # a flag of several values (--cp-comm-type p2p a2a ...)
        return " ".join(value)
    return "on" if value is True else str(value)


def _same_hybrid_split(planned: Scanned, given: Scanned) -> bool:
    """Whether the plan's hybrid pattern is the user's, without '|', cut where the user's flags split it (at the
    same pp: evenly, or by first / last stage counts)."""
    pattern, theirs = planned.get("--hybrid-layer-pattern"), argv_hybrid_pattern(given)
    pp = planned.get("--pipeline-model-parallel-size", 1)
    if pattern is None or theirs is None or PIPE in theirs or given.get("--pipeline-model-parallel-size", 1) != pp:
        return False
    form = argv_form(given)
    if form_problem(form, num_layers=len(theirs), pp=pp, vpp=1) is not None:
        return False
    return pattern_chunks(pattern) == chunk_layers(form, num_layers=len(theirs), pp=pp, vpp=1)


def layout_why(argv: list[str], loaded: Loaded, plan: Plan) -> str:
    """Why the plan's layout replaces the argv's (`argv`: the user's, with the model flags when the model
    came from model=NAME), by the cost model that chose the plan."""
    broken = violations(argv, world_size=plan.world_size)
    if broken:
        return f"the given layout breaks a Megatron rule: {broken[0]}"
    # A layout sets vpp itself (its stages / pp) and is priced as the split it spells.
    split = argv_split(argv, world_size=plan.world_size, model=loaded.config.model)
    s = scan(argv)
    layout = s.has("--pipeline-model-parallel-layout")
    try:
        given = PlanChoice(**pinned_values(argv, [n for n in PIN_FLAGS if not (layout and n == "vpp")],
                                           model=loaded.config.model),
                           layers_per_stage=list(split) if split is not None else None,
                           cp_comm_type=s.get("--cp-comm-type", ("p2p",))[0],
                           moe_a2a_overlap=s.present("--overlap-moe-expert-parallel-comm"),
                           distributed_optimizer_instances=s.get("--num-distributed-optimizer-instances"),
                           cpu_offloading_num_layers=s.get("--cpu-offloading-num-layers") or None,
                           microbatch_group_size_per_vp_stage=s.get("--microbatch-group-size-per-virtual-pipeline-stage"))
    except NestError as err:
        return f"the given layout is not one the cost model prices: {err}"
    problem, _ = profiled_problem(loaded.problem, loaded.config)
    try:
        est = estimate(problem, evaluate_config(problem, given, default_mbs=None), layers_per_stage=split)
    except NestError as err:  # evaluate_config's line names plan.* keys: name the flags the user typed
        return f"the given layout breaks a Megatron rule: {name_flags(str(err).removeprefix('invalid configuration: '))}"
    if not est.fits:
        return f"the given layout does not fit: {est.shortfall}"
    ratio = est.step_time / plan.predicted["step_time_s"]
    if abs(ratio - 1) < 1e-9:  # a flag the cost model does not price alone (one that goes with another change)
        return "the cost model prices it alike (the same step time)"
    if ratio >= 1:
        return f"the planned layout is {ratio:.2f}x faster by the cost model"
    # The plan is held to what the launch fixes (pins, a resume) or to one of the searched placements.
    return f"the given layout is {1 / ratio:.2f}x faster by the cost model, but not one the planner may choose here"


def flag_reasons(plan_args: list[str], user: list[str]) -> dict[str, str]:
    """The flags whose change has a reason of its own (not the layout's)."""
    planned, given = scan(plan_args), scan(user)
    out = {}
    dispatcher = planned.get(DISPATCHER)
    if dispatcher is not None:
        # The argv's dispatcher is train.moe_dispatcher's (config/megatron_argv.py), so this changes only a flag
        # the argv did not give, or DeepEP's deprecated spelling (--moe-enable-deepep) into the backend flag.
        name = "flex (DeepEP)" if dispatcher == "flex" else dispatcher
        for flag in DISPATCHER_FLAG_NAMES:
            out[flag] = f"the plan prices the {name} dispatcher's traffic"
        if dispatcher == "flex":
            out["--moe-enable-deepep"] = "megatron-core's deprecated spelling: the plan gives --moe-flex-dispatcher-backend"
    if _same_hybrid_split(planned, given):  # only said another way
        why = ("the same split, said by '|' segments of the pattern (Megatron-LM deprecates a pattern without them at "
               "pp > 1: hybrid_layer_allocation.py:393-399)")
        for flag in ("--hybrid-layer-pattern", OLD_PATTERN, *FIRST_LAST_FLAGS):
            out[flag] = why
    if planned.has("--moe-grouped-gemm"):  # the argv's own stands (launch/rewrite.py): only added, never changed
        out["--moe-grouped-gemm"] = ("the plan prices each stage's experts as one grouped GEMM (Transformer Engine's "
                                     "TEGroupedMLP); without it Megatron runs them one expert at a time")
    if planned.has("--cp-comm-type"):  # the argv's own is a constraint (launch/constraints.py): the plan's equals it
        out["--cp-comm-type"] = (f"the plan prices Transformer Engine's {planned.get('--cp-comm-type')[0]} exchange "
                                 "for its context parallelism")
    if planned.has("--use-megatron-fsdp"):
        out["--ckpt-format"] = "Megatron-FSDP reads and writes only fsdp_dtensor"
    elif given.get("--ckpt-format") == "fsdp_dtensor":
        out["--ckpt-format"] = "only Megatron-FSDP reads fsdp_dtensor, and the plan does not use it"
    if not given.has("--global-batch-size"):
        out["--global-batch-size"] = "train.global_batch_size: the argv gives none"
    if not given.has("--micro-batch-size"):
        out["--micro-batch-size"] = "Megatron requires it and the argv gives none: the planner's choice"
    return out


def reverted(final: list[str], flag: str, old) -> list[str]:
    """`final` with `flag` back at the user's value `old` (None: not given): the flag and its values out, then
    the user's back in."""
    out, skipping = [], False
    for arg in final:
        if arg.startswith("--"):
            skipping = arg == flag
        if not skipping:
            out.append(arg)
    if old is None:
        return out
    values = [] if old is True else list(old) if isinstance(old, tuple) else [str(old)]
    return [*out, flag, *values]


def changed_flags(user: list[str], final: list[str]) -> list[tuple[str, object, object]]:
    """(flag, the argv's value or None, the final value or None) for each planner flag whose value changed;
    a flag added at Megatron's default changes nothing and is left out."""
    before, after = scan(user), scan(final)
    out = []
    for flag in PLANNER_FLAGS:
        old, new = before.get(flag), after.get(flag)
        if old == new or (old is None and new == DEFAULTS.get(flag)) or (new is None and old == DEFAULTS.get(flag)):
            continue
        out.append((flag, old, new))
    return out


def change_lines(user: list[str], final: list[str], *, reasons: dict[str, str],
                 layout: Callable[[list[str]], str]) -> list[str]:
    """One `--flag: old -> new (why)` line per changed flag; `layout(argv)` prices `argv`'s layout against the
    plan's, here the final argv with only that flag back at the user's value."""
    lines, changed = [], changed_flags(user, final)
    olds = {flag: old for flag, old, _ in changed}
    for flag, old, new in changed:
        if flag in reasons:
            reason = reasons[flag]
        elif FOLLOWERS.get(flag) in olds:
            reason = f"goes with {FOLLOWERS[flag]}"
        else:
            argv = reverted(final, flag, old)
            for follower in (f for f, leader in FOLLOWERS.items() if leader == flag and f in olds):
                argv = reverted(argv, follower, olds[follower])
            yours = "unset" if old is None else _shown(old)
            reason = f"with {flag} {yours} and the plan's other flags, {layout(argv)}"
        lines.append(f"{flag}: {'(unset)' if old is None else _shown(old)} -> "
                     f"{'(removed)' if new is None else _shown(new)} ({reason})")
    return lines
