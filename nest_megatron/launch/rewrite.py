"""A Megatron argv in, the planned Megatron argv out.

The flags the planner decides (parallel sizes, virtual stages and layer split, micro and global batch,
ZeRO / distributed optimizer / FSDP, recompute, rank order; `config.megatron_argv.PLANNER_FLAGS`)
are removed wherever they stand and the plan's are appended; every other token stays, in order.
What the user pins (`--pin tp,pp` or `solver.keep_user_parallelism=[tp,pp]`) is read from the argv
and becomes a `plan.*` constraint for the planner instead of being overwritten.
"""

from __future__ import annotations

from dataclasses import replace

from nest_megatron.config.megatron_argv import PLANNER_FLAGS, Scanned, scan
from nest_megatron.config.schema import ModelConfig
from nest_megatron.errors import NestError
from nest_megatron.launch.megatron_rules import FSDP_ZERO, argv_form, argv_recompute_modules, argv_vpp, name_flags
from nest_megatron.model.spec import ModelSpec
from nest_megatron.parallel.config import ParallelConfig
from nest_megatron.parallel.layout import PIPE, pattern_chunks
from nest_megatron.parallel.rules import violation
from nest_megatron.plan import Plan

# What can be pinned, and the flag (or flags) the pinned value is read from.
PIN_FLAGS = {
    "tp": "--tensor-model-parallel-size",
    "pp": "--pipeline-model-parallel-size",
    "cp": "--context-parallel-size",
    "ep": "--expert-model-parallel-size",
    "etp": "--expert-tensor-parallel-size",
    "vpp": "--num-virtual-stages-per-pipeline-rank",
    "sp": "--sequence-parallel",
    "mbs": "--micro-batch-size",
    "zero": "--use-distributed-optimizer / --use-megatron-fsdp",
    "recompute": "--recompute-granularity",
    "order": "--use-tp-pp-dp-mapping",
}


def parse_pins(text: str | list[str]) -> list[str]:
    """`tp,pp` (or ['tp', 'pp']) -> ['tp', 'pp']; an unknown name is an error naming the allowed ones."""
    names = [n.strip() for n in (text.split(",") if isinstance(text, str) else text) if n.strip()]
    for name in names:
        if name not in PIN_FLAGS:
            hint = " (dp follows from the others: pin tp, pp, cp)" if name == "dp" else ""
            raise NestError(f"pin {name}: allowed are {', '.join(PIN_FLAGS)}{hint}")
    return names


def _pinned_value(s: Scanned, name: str, num_layers: int | None, moe: bool):
    """The value the argv gives for `name`, Megatron's default when its flag is absent (for a dense model the
    expert sizes are 1 whatever the argv says: Megatron reads them only with experts)."""
    if name in ("ep", "etp") and not moe:
        return 1
    if name in ("tp", "pp", "cp", "ep"):
        return s.get(PIN_FLAGS[name], 1)
    if name == "etp":
        return s.get("--expert-tensor-parallel-size", s.get("--tensor-model-parallel-size", 1))
    if name == "vpp":  # as Megatron-LM reads it: a layout's stages / pp, layers per virtual stage, or the count
        pp = s.get("--pipeline-model-parallel-size", 1)
        if s.has("--num-layers-per-virtual-pipeline-stage"):
            per = s.get("--num-layers-per-virtual-pipeline-stage")
            if num_layers is None or (num_layers + sum(argv_form(s).accounts)) % (pp * per):
                raise NestError(f"--num-layers-per-virtual-pipeline-stage {per}: must divide num_layers/pp to be pinned")
        return argv_vpp(s, pp=pp, num_layers=num_layers or 0)
    if name == "sp":
        return s.has("--sequence-parallel")
    if name == "mbs":
        if not s.has("--micro-batch-size"):
            raise NestError("pin mbs: the script arguments have no --micro-batch-size")
        return s.get("--micro-batch-size")
    if name == "zero":
        if s.has("--use-torch-fsdp2"):
            raise NestError("--use-torch-fsdp2 cannot be pinned: the planner realises ZeRO with the distributed "
                            "optimizer (1) and Megatron-FSDP (2, 3)")
        if s.has("--use-megatron-fsdp"):
            strategy = s.get("--data-parallel-sharding-strategy", "optim_grads_params")
            if strategy not in ("optim_grads", "optim_grads_params"):
                raise NestError(f"--data-parallel-sharding-strategy {strategy} cannot be pinned: "
                                "the planner models optim_grads and optim_grads_params")
            return FSDP_ZERO[strategy]
        return 1 if s.has("--use-distributed-optimizer") else 0
    if name == "recompute":
        if s.has("--recompute-activations"):
            return "selective"
        return s.get("--recompute-granularity") or "none"
    if name == "order":
        return "tp-cp-ep-pp-dp" if s.has("--use-tp-pp-dp-mapping") else "tp-cp-ep-dp-pp"
    raise AssertionError(name)


def pinned_values(argv: list[str], names: list[str], *, model: ModelConfig | None = None) -> dict[str, object]:
    """PlanChoice field -> the argv's value, for the pinned names (and recompute_num_layers with block recompute).

    With the model, each pinned value is checked against it alone (heads vs tp, layers vs pp, ...),
    so that a value the model cannot satisfy is an error naming the flag, not "nothing fits".
    """
    s = scan(argv)
    out = {}
    for name in names:
        value = _pinned_value(s, name, model.num_layers if model else s.get("--num-layers"),
                              moe=bool(model.num_experts if model else s.get("--num-experts")))
        if model is not None and name in ("tp", "pp", "cp", "ep", "etp"):
            problem = _alone(name, value, model)
            if problem:
                raise NestError(f"pinned {PIN_FLAGS[name]} {value}: {problem}")
        out[name] = value
        if name == "recompute" and value == "full" and s.get("--recompute-method") == "block":
            out["recompute_num_layers"] = s.get("--recompute-num-layers")
        if name == "recompute" and value == "selective":  # the user's modules, as listed (or Megatron's default)
            out["recompute_modules"] = list(argv_recompute_modules(s))
    return out


def pin_overrides(argv: list[str], names: list[str], *, model: ModelConfig | None = None) -> list[str]:
    """`plan.*` overrides holding the pinned names at the argv's values (`pinned_values`)."""
    return [f"plan.{name}={_override_value(value)}" for name, value in pinned_values(argv, names, model=model).items()]


def _override_value(value) -> str:
    """A pinned value in Hydra's override syntax: true / false, [a,b] for a list."""
    if isinstance(value, bool):
        return str(value).lower()
    return f"[{','.join(value)}]" if isinstance(value, list) else str(value)


def _alone(name: str, value: int, model: ModelConfig) -> str | None:
    """Megatron's rule for a pinned size on its own (the other sizes at their smallest that let it
    stand: dp = ep for the expert grid, sequence parallel with TP on a MoE model), when it names it."""
    fields = {name: value, "dp": value if name == "ep" else 1}
    if name == "etp":
        fields["tp"] = value
    cfg = ParallelConfig(**fields)
    if model.num_experts and cfg.tp > 1:
        cfg = replace(cfg, sp=True)
    line = violation(cfg, model=ModelSpec(model), num_devices=cfg.world, global_batch_size=2 * cfg.dp * cfg.pp,
                     any_split=True)
    return name_flags(line).split(": ", 1)[-1] if line and line.startswith(f"plan.{name}=") else None


DISPATCHER = "--moe-token-dispatcher-type"
GROUPED_GEMM = "--moe-grouped-gemm"
# The dispatcher's flags: the plan's replace the user's (read into train.moe_dispatcher) in a MoE plan.
DISPATCHER_FLAG_NAMES = (DISPATCHER, "--moe-flex-dispatcher-backend", "--moe-enable-deepep")


# megatron-core 0.16.1's Megatron-LM names a hybrid pattern --hybrid-override-pattern and takes no '|' in it (0.16.1
# ssm/mamba_hybrid_layer_allocation.py:82-83); Megatron-LM main takes it as --hybrid-layer-pattern (arguments.py:743-755).
OLD_PATTERN = "--hybrid-override-pattern"


def _old_pattern_spelling(plan_args: list[str], plan: Plan) -> list[str]:
    """The plan's pattern under the user's older flag, and without '|' where the split needs none (an even split
    without virtual stages, which that Megatron-LM runs; another split needs Megatron-LM main's segments)."""
    out = list(plan_args)
    at = out.index("--hybrid-layer-pattern")
    out[at] = OLD_PATTERN
    if len(set(pattern_chunks(out[at + 1]))) == 1 and plan.parallel["vpp"] == 1:
        out[at + 1] = out[at + 1].replace(PIPE, "")
    return out


def planner_part(args: list[str]) -> list[str]:
    """The tokens of the planner's flags in `args` (a plan's megatron_args), in their order."""
    s = scan(args)
    return [token for flag, start, stop in s.spans if flag in PLANNER_FLAGS for token in args[start:stop]]


def model_part(args: list[str]) -> list[str]:
    """The tokens of `args` that are not the planner's flags (the plan's model-shape flags)."""
    dropped = {i for flag, start, stop in scan(args).spans if flag in PLANNER_FLAGS for i in range(start, stop)}
    return [token for i, token in enumerate(args) if i not in dropped]


def rewrite(argv: list[str], plan: Plan, *, model_args: list[str] = ()) -> list[str]:
    """The user's argv without the planner's flags, then `model_args` (when the argv has no model), then
    the plan's parallel flags. --ckpt-format belongs to the planner only when the plan uses Megatron-FSDP
    (it sets fsdp_dtensor) or the user's value is fsdp_dtensor (only Megatron-FSDP reads it);
    the dispatcher's flags only when the plan sets them (a MoE plan: train.moe_dispatcher's). A flag of the user's that
    `model_args` sets again (--bf16, the precision flags it was read into) is dropped: it is said once."""
    s = scan(argv)
    plan_args = planner_part(plan.megatron_args)
    if s.has(GROUPED_GEMM):  # said once: the user's stands
        plan_args = [token for token in plan_args if token != GROUPED_GEMM]
    if s.has(OLD_PATTERN):
        plan_args = _old_pattern_spelling(plan_args, plan)
    fsdp = "--use-megatron-fsdp" in plan_args
    restated = {token for token in model_args if token.startswith("--")}

    def owned(flag: str) -> bool:
        if flag == "--ckpt-format":
            return fsdp or s.get("--ckpt-format") == "fsdp_dtensor"
        if flag in DISPATCHER_FLAG_NAMES:  # a dense plan sets none; Megatron ignores the user's then
            return DISPATCHER in plan_args
        if flag == GROUPED_GEMM:  # the plan adds it to a MoE model's argv; a plan without it keeps the user's
            return False
        return flag in PLANNER_FLAGS or flag in restated

    dropped = {i for flag, start, stop in s.spans if owned(flag) for i in range(start, stop)}
    kept = [token for i, token in enumerate(argv) if i not in dropped]
    return kept + list(model_args) + plan_args
