"""Dotted-path overrides (`trainer.strategy.tensor_model_parallel_size` -> 2): render them, apply them.

NeMo 2 recipes (nemo-run `Config` / `Partial` trees) and Megatron-Bridge `ConfigContainer`s are both
trees of objects reached by attribute; the same setter serves both. It never creates a missing
attribute: a recipe without the path is not the recipe the overrides were written for.
"""

from __future__ import annotations

import shlex
from typing import Any

from nest_megatron.errors import NestError
from nest_megatron.launch.megatron_rules import argv_split
from nest_megatron.parallel.layout import layout_string
from nest_megatron.plan import Plan

Overrides = dict[str, Any]  # dotted path -> value, in the order they are printed and applied


def flag_value(plan: Plan, flag: str) -> str | None:
    """The value the plan's Megatron argv gives a flag, so that every target says what that argv says."""
    args = plan.megatron_args
    return args[args.index(flag) + 1] if flag in args else None


def uneven_layout(plan: Plan) -> str | None:
    """The layer split the plan's argv gives, as a pipeline_model_parallel_layout (None: Megatron's even split). The
    argv may say it with other flags (the embedding / loss counted, first / last stage layers); a layout says every
    split, in the one field both targets have."""
    chunks = argv_split(plan.megatron_args, world_size=plan.world_size)
    pattern = flag_value(plan, "--hybrid-layer-pattern")
    if pattern is not None and (chunks is not None or plan.parallel["vpp"] > 1):
        # a hybrid stack takes its split only as '|' segments of its pattern, a model field these overrides leave
        # to the recipe (Megatron-LM refuses a layout beside a hybrid pattern: training/arguments.py:825-828)
        raise NestError(f"the plan splits the hybrid stack as '{pattern}' (pp {plan.parallel['pp']}, vpp "
                        f"{plan.parallel['vpp']}), which NeMo / Megatron-Bridge overrides do not carry: give the "
                        "recipe's model that pattern yourself, or plan an even split (plan.vpp=1, pp dividing the "
                        "layers)")
    mtp = flag_value(plan, "--mtp-num-layers")
    return layout_string(chunks, mtp_num_layers=int(mtp or 0)) if chunks is not None else None


def is_moe(plan: Plan) -> bool:
    return "--num-experts" in plan.megatron_args


def fp8_recipe(plan: Plan) -> str | None:
    """The FP8 recipe the plan's argv runs (--fp8-recipe with --fp8-format), None for a bf16 plan."""
    return flag_value(plan, "--fp8-recipe") if "--fp8-format" in plan.megatron_args else None


def precision_aware_optimizer(plan: Plan) -> bool:
    """Whether the plan's argv runs the precision-aware optimizer; one line when it also lowers the state's dtypes,
    which megatron-core's OptimizerConfig takes as torch dtypes that these overrides do not carry."""
    if "--use-precision-aware-optimizer" not in plan.megatron_args:
        return False
    lowered = [f for f in ("--main-params-dtype", "--exp-avg-dtype", "--exp-avg-sq-dtype") if f in plan.megatron_args]
    if lowered:
        raise NestError(f"the plan keeps the optimizer state in {flag_value(plan, lowered[0])} ({lowered[0]}), which "
                        "NeMo / Megatron-Bridge overrides do not carry: set the recipe's OptimizerConfig dtypes "
                        "yourself, or plan with train.exp_avg_dtype / exp_avg_sq_dtype / main_params_dtype=fp32")
    return True


def offloading_overrides(plan: Plan, model_path: str) -> Overrides:
    """The activation offloading the plan is priced with, as megatron-core's TransformerConfig fields under
    `model_path` (Megatron-LM sets cpu_offloading from --cpu-offloading-num-layers, arguments.py:1950-1951; the
    weights stay: their offload is deprecated in Transformer Engine). A recipe's own offloading is replaced."""
    n = plan.parallel.get("cpu_offloading_num_layers", 0)
    return {f"{model_path}.cpu_offloading": bool(n), f"{model_path}.cpu_offloading_num_layers": n,
            f"{model_path}.cpu_offloading_activations": True, f"{model_path}.cpu_offloading_weights": False}


def apply_overrides(root: Any, overrides: Overrides, *, root_name: str = "recipe") -> Any:
    """Set every path on root; raise NestError naming the first path root does not have. Checks all paths
    before setting any, so a recipe is never left half-changed."""
    targets = []
    for path, value in overrides.items():
        *parents, leaf = path.split(".")
        node, walked = root, root_name
        for part in parents:
            if not hasattr(node, part):
                raise NestError(f"{root_name} has no {walked}.{part} (needed for {path}); is it a NeMo 2 / "
                                "Megatron-Bridge config of the kind these overrides target?")
            node, walked = getattr(node, part), f"{walked}.{part}"
        if not hasattr(node, leaf):
            raise NestError(f"{walked} ({type(node).__name__}) has no attribute {leaf!r} (override {path})")
        targets.append((node, leaf, value))
    for node, leaf, value in targets:
        setattr(node, leaf, value)
    return root


def python_literal(value: Any) -> str:
    return repr(value)


def hydra_literal(value: Any) -> str:
    """Hydra's override grammar: null, true/false, numbers, quoted strings."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"
    return str(value)


def cli_tokens(overrides: Overrides, literal=python_literal) -> list[str]:
    return [f"{path}={literal(value)}" for path, value in overrides.items()]


def shell_word(token: str) -> str:
    """The token as one shell word: bare when safe, in double quotes around inner single quotes
    (key='value' reads better than shlex's '"'"' splicing), else shlex's quoting."""
    if shlex.quote(token) == token:
        return token
    if not any(c in token for c in '"$`\\!'):
        return f'"{token}"'
    return shlex.quote(token)


def cli_line(overrides: Overrides, literal=python_literal) -> str:
    """One shell-ready line of key=value words (quoted where the shell would split or expand them)."""
    return " ".join(shell_word(token) for token in cli_tokens(overrides, literal))


def python_lines(overrides: Overrides, root_name: str) -> list[str]:
    return [f"{root_name}.{path} = {value!r}" for path, value in overrides.items()]
