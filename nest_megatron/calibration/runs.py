"""A measured run rebuilt as the cost model prices it: its log's arguments turned back into the Megatron argv they
parse, read by the project's one argv reader (config/megatron_argv.py, launch/prepare.py problem_overrides, the
pins of launch/rewrite.py, launch/megatron_rules.py argv_split), loaded and checked as `evaluate` would.

A run directory (`nest-megatron launch` writes one: plan.json, run.json and the workers' logs) adds the cluster
the run was planned on and the plan's rank placement; its log's arguments must be the plan's.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from nest_megatron.calibration.fit import Run
from nest_megatron.calibration.logs import RunLog, check, parse, read
from nest_megatron.config.load import Loaded, load
from nest_megatron.config.megatron_argv import KNOWN_FLAGS, UNPLANNABLE, model_values, scan
from nest_megatron.config.schema import ModelConfig
from nest_megatron.errors import NestError
from nest_megatron.launch.constraints import argv_constraints
from nest_megatron.launch.megatron_rules import argv_split
from nest_megatron.launch.prepare import problem_overrides
from nest_megatron.launch.rewrite import PIN_FLAGS, pin_overrides
from nest_megatron.parallel.config import ParallelConfig
from nest_megatron.solver.space import evaluate_config

RUN_FILE = "run.json"  # what `nest-megatron launch` writes into a run directory (launch/run_dir.py)
PLAN_FILE = "plan.json"
# The plan fields an argv sets beside its sizes, read as a launch reads them (launch/constraints.py): the EP all-to-all
# overlap, the optimizer's instances, the micro-batch group, the offloaded layers; each with the value a Plan JSON
# written before the field existed stands for.
ARGV_FIELDS = {"moe_a2a_overlap": False, "distributed_optimizer_instances": 1, "microbatch_group_size_per_vp_stage": None,
               "cpu_offloading_num_layers": 0}

# Megatron-LM's namespace attribute of a flag, where it is not the flag's own name (arguments.py / the config
# dataclasses' argparse_meta at d98e8a6): store_false flags keep the positive name, --fp8-format sets `fp8`.
DEST = {
    "--disable-bias-linear": "add_bias_linear",  # transformer_config.py:212-214
    "--no-bias-swiglu-fusion": "bias_swiglu_fusion",  # arguments.py:2895
    "--no-overlap-p2p-communication": "overlap_p2p_comm",  # arguments.py:3118
    "--fp8-format": "fp8",  # transformer_config.py:587-589
}
NEGATED = frozenset(DEST) - {"--fp8-format"}  # present on the argv when the attribute is False
# Megatron-Bridge's names for what Megatron-LM's arguments call otherwise (its ConfigContainer fields).
BRIDGE_DEST = {"--swiglu": "gated_linear_unit", "--seq-length": "dataset.sequence_length",
               "--vocab-size": "tokenizer.vocab_size"}
# Flags whose attribute validate_args deletes (arguments.py:607-609: --recompute-activations becomes
# recompute_granularity selective) or that describe no run (the planner's derived ones).
NOT_ARGUMENTS = frozenset({"--recompute-activations"})
CLUSTER_KEYS = ("cluster", "accelerator")
# Where a run comes from, for leave-one-source-out: the kind of log it was read from. No release is stated: none of
# the formats read (logs.py) prints the software's version, so a user's runs have no leave-one-release-out.
SOURCES = {"megatron": "Megatron-LM log", "bridge": "Megatron-Bridge log", "nemo2": "NeMo 2 log"}
RUN_DIR_SOURCE = "launch run directory"


@dataclass(frozen=True)
class Rebuilt:
    """One run as the cost model prices it."""

    log: RunLog
    label: str
    overrides: list[str]  # what `nest-megatron evaluate` takes to price it
    loaded: Loaded
    config: ParallelConfig
    layers_per_stage: tuple[int, ...] | None
    rank_to_device: tuple[int, ...] | None = None  # the plan's placement (a run directory); None: torchrun's order
    plan: dict | None = None  # the Plan JSON of a run directory
    notes: list[str] = field(default_factory=list)

    @property
    def source(self) -> str:
        """The kind of log it was read from: a run directory of `nest-megatron launch` (its plan), else the format."""
        return RUN_DIR_SOURCE if self.plan is not None else SOURCES[self.log.format]

    def run(self) -> Run:
        return Run(label=self.label, problem=self.loaded.problem, config=self.config,
                   measured_s=self.log.measured_step_s, layers_per_stage=self.layers_per_stage,
                   rank_to_device=self.rank_to_device, groups={"source": self.source})


# validate_args maps the dtype flags' names to torch dtypes before printing them (arguments.py:1077-1085)
TORCH_DTYPES = {"torch.float32": "fp32", "torch.bfloat16": "bf16", "torch.float16": "fp16", "torch.uint8": "fp8"}


def _text(value) -> str:
    if isinstance(value, str) and value in TORCH_DTYPES:
        return TORCH_DTYPES[value]
    if isinstance(value, tuple):
        return ",".join(map(str, value))
    if isinstance(value, list):
        return "[" + ",".join(map(str, value)) + "]"
    return str(value)


def argv_of(log: RunLog) -> tuple[list[str], dict[str, str]]:
    """The Megatron argv whose parse the log's arguments print (the flags this project reads), and the file:line of
    each flag's argument."""
    argv, where = [], {}
    for flag, kind in {**KNOWN_FLAGS, **{f: "str" for f in UNPLANNABLE}}.items():
        if flag in NOT_ARGUMENTS:
            continue
        name = DEST.get(flag, flag[2:].replace("-", "_"))
        if name not in log.arguments and log.format == "bridge":
            name = BRIDGE_DEST.get(flag, name)
        value = log.value(name)
        if flag == "--group-query-attention" and log.format == "bridge":
            value = log.value("num_query_groups") is not None  # TransformerConfig has only num_query_groups
        if flag == "--vocab-size" and value is None and log.padded_vocab:
            value, where[flag] = log.padded_vocab[0], log.arguments_at  # the tokenizer's size (vocab_utils.py:35)
        if value is None:
            continue
        if flag in NEGATED:
            tokens = [flag] if value is False else []
        elif kind == "true" or flag in UNPLANNABLE and isinstance(value, bool):
            tokens = [flag] if value is True else []
        elif kind == "false":
            tokens = [flag] if value is False else []
        elif kind == "list":  # nargs='+': one token a value
            tokens = [flag, *map(_text, value if isinstance(value, (list, tuple)) else [value])]
        else:
            tokens = [flag, _text(value)]
        if tokens:
            argv += tokens
            where.setdefault(flag, log.where.get(name, log.arguments_at))
    return argv, where


def world_size(log: RunLog) -> int | None:
    if log.value("world_size") is not None:
        return int(log.value("world_size"))
    if log.sizes:
        return log.sizes["tp"] * log.sizes["pp"] * log.sizes["cp"] * log.sizes["dp"]
    return None


def _blame(err: Exception, where: dict[str, str], default: str) -> NestError:
    """`err` as one line that starts with the file:line of the argument it names."""
    flag = next((f for f in re.findall(r"--[a-z0-9][a-z0-9-]*", str(err)) if f in where), None)
    return type(err)(f"{where.get(flag, default)}: {err}") if isinstance(err, NestError) else NestError(f"{default}: {err}")


def rebuild(log: RunLog, *, user: list[str], label: str, plan: dict | None = None,
            rank_to_device: tuple[int, ...] | None = None) -> Rebuilt:
    """The run `log` describes, on the cluster `user`'s overrides say (NeMo 2 logs: their model and plan.* too)."""
    check(log)
    if log.format == "nemo2":
        return _rebuild_from_overrides(log, user=user, label=label)
    argv, where = argv_of(log)
    world = world_size(log)
    at = log.arguments_at
    if world is None:
        raise NestError(f"{at}: the log does not say how many GPUs ran it (no world_size argument, no HyperCommGrid "
                        "line); give cluster.num_devices=N")
    try:
        keys = {item.partition("=")[0] for item in user}
        overrides = problem_overrides("pretrain_gpt.py", argv, user)
        model = ModelConfig(**model_values(scan(argv), vocab_size=1))
        s = scan(argv)
        names = [n for n in PIN_FLAGS if n != "vpp"]
        pins = pin_overrides(argv, names, model=model)
        vpp = log.value("virtual_pipeline_model_parallel_size") or 1
        tp, pp, cp = (s.get(flag, 1) for flag in ("--tensor-model-parallel-size", "--pipeline-model-parallel-size",
                                                   "--context-parallel-size"))
        split = argv_split(argv, world_size=world, model=model)
        extra = [*pins, f"plan.vpp={vpp}", f"plan.dp={world // (tp * pp * cp)}"]
        extra += [item for c in argv_constraints(argv, user=[], model=model) for item in c.overrides
                  if item.partition("=")[0].removeprefix("plan.") in ARGV_FIELDS]
        exchanges = s.get("--cp-comm-type")
        if cp > 1 and exchanges:  # the exchange the run used; the planner prices one for every layer
            if len(set(exchanges)) > 1:
                raise NestError(f"--cp-comm-type {' '.join(exchanges)}: a run with one exchange per layer is not in "
                                "the cost model")
            extra.append(f"plan.cp_comm_type={exchanges[0]}")
        if split is not None:
            extra.append(f"plan.layers_per_stage=[{','.join(map(str, split))}]")
        if "cluster.num_devices" not in keys:
            extra.append(f"cluster.num_devices={world}")
        overrides = [*overrides, *extra]
        loaded = load(overrides)
        cfg = evaluate_config(loaded.problem, loaded.config.plan, default_mbs=loaded.config.train.micro_batch_size)
    except NestError as err:
        raise _blame(err, where, at) from None
    rebuilt = Rebuilt(log, label, overrides, loaded, cfg, split, rank_to_device=rank_to_device, plan=plan)
    return _fits(rebuilt)


def _rebuild_from_overrides(log: RunLog, *, user: list[str], label: str) -> Rebuilt:
    """NeMo 2 prints no configuration: `user` gives it (model=..., plan.*, train.global_batch_size, cluster)."""
    if not any(item.startswith("model=") or item.startswith("model.num_layers=") for item in user):
        raise NestError(f"{log.source}: a NeMo 2 log prints no configuration; give its model and layout on the "
                        "command line (model=NAME plan.tp=... plan.pp=... train.global_batch_size=...)")
    loaded = load(user)
    cfg = evaluate_config(loaded.problem, loaded.config.plan, default_mbs=loaded.config.train.micro_batch_size)
    batch = log.iterations[-1].global_batch_size
    if batch is not None and batch != loaded.problem.global_batch_size:
        raise NestError(f"{log.iterations[-1].where}: global_batch_size {batch}, but the overrides give "
                        f"train.global_batch_size={loaded.problem.global_batch_size}")
    return _fits(Rebuilt(log, label, list(user), loaded, cfg, None))


def _fits(rebuilt: Rebuilt) -> Rebuilt:
    """The run ran, so it fit; where the memory model says otherwise it is priced anyway, with a note."""
    from nest_megatron.cost.evaluate import estimate

    est = estimate(rebuilt.loaded.problem, rebuilt.config, layers_per_stage=rebuilt.layers_per_stage)
    if not est.fits:
        rebuilt.notes.append(f"the memory model puts it at {est.shortfall}")
    return rebuilt


# --- run directories -----------------------------------------------------------------------------------------

def run_dir_log(folder: Path) -> tuple[RunLog, dict]:
    """The workers' logs of a run directory, merged, and its Plan JSON."""
    try:
        run = json.loads((folder / RUN_FILE).read_text())
        plan = json.loads((folder / PLAN_FILE).read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise NestError(f"{folder}: not a run directory of nest-megatron launch ({err})") from None
    logs = sorted(Path(folder, run.get("logs", "logs")).rglob("stdout.log"), key=lambda p: str(p))
    # torchrun starts attempt_<n> again after a restart: the last attempt is the run that the plan describes
    attempts = {int(m.group(1)) for p in logs if (m := re.search(r"attempt_(\d+)", str(p)))}
    if attempts:
        logs = [p for p in logs if f"attempt_{max(attempts)}" in str(p)]
    if not logs:
        raise NestError(f"{folder}: no worker logs under {run.get('logs', 'logs')}/ (torchrun --log-dir): the run "
                        "did not start, or its logs went elsewhere")
    return parse([(str(p), p.read_text(errors="replace")) for p in logs], source=str(folder)), plan


def measured_in(folder: Path) -> dict | None:
    """What the run of a run directory measured, for the explain report; None when `folder` is no run directory or
    its logs hold no finished iteration."""
    if not (folder / RUN_FILE).exists():
        return None
    try:
        log, _ = run_dir_log(folder)
        check(log)
    except NestError:
        return None
    return {"step_s": log.measured_step_s, "source": str(folder), "iterations": max(len(log.iterations) - 1, 1)}


def read_run_dir(folder: Path, *, label: str) -> Rebuilt:
    """A run directory of `nest-megatron launch`: the plan it ran, rebuilt from the workers' logs."""
    log, plan = run_dir_log(folder)
    user = [o for o in plan["overrides"] if o.partition("=")[0].split(".")[0] in CLUSTER_KEYS]
    rebuilt = rebuild(log, user=user, label=label, plan=plan, rank_to_device=tuple(plan["rank_to_device"]))
    _check_against_plan(rebuilt, plan, folder)
    return rebuilt


def _check_against_plan(rebuilt: Rebuilt, plan: dict, folder: Path) -> None:
    c, parallel = rebuilt.config, plan["parallel"]
    logged = {"tp": c.tp, "pp": c.pp, "dp": c.dp, "cp": c.cp, "ep": c.ep, "vpp": c.vpp, "mbs": c.mbs, "zero": c.zero}
    planned = {**{k: parallel[k] for k in ("tp", "pp", "dp", "cp", "ep", "vpp")},
               "mbs": plan["micro_batch_size"], "zero": plan["zero_stage"]}
    for name, default in ARGV_FIELDS.items():
        if name != "microbatch_group_size_per_vp_stage" or c.vpp > 1:  # Megatron reads a group only interleaved
            logged[name], planned[name] = getattr(c, name), parallel.get(name, default)
    wrong = [f"{k} {logged[k]} in the log, {planned[k]} in {PLAN_FILE}" for k in logged if logged[k] != planned[k]]
    if wrong:
        raise NestError(f"{rebuilt.log.arguments_at}: the run's arguments are not its plan's ({'; '.join(wrong)})")


def read_run(path: str, *, user: list[str], label: str) -> Rebuilt:
    """A log file or a run directory."""
    target = Path(path)
    if target.is_dir():
        if not (target / RUN_FILE).exists():
            raise NestError(f"{path}: a folder without {RUN_FILE}; give a log file or the run directory "
                            "nest-megatron launch wrote")
        return read_run_dir(target, label=label)
    if not target.exists():
        raise NestError(f"{path}: no such log file or run directory")
    return rebuild(read(target), user=user, label=label)

