"""Compose the Hydra config from overrides, check it, and turn it into SI-unit objects.

Every way a user can get the input wrong ends here as one NestError line that names the key, the
value and what is allowed.
"""

from __future__ import annotations

import difflib
import os
import re
from dataclasses import dataclass, fields
from pathlib import Path

import yaml
from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.errors import ConfigCompositionException, HydraException, MissingConfigException
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from nest_megatron.config.schema import (
    AcceleratorConfig,
    ClusterConfig,
    LevelConfig,
    ModelConfig,
    PlanChoice,
    ProfileConfig,
    RootConfig,
    SolverConfig,
    TrainConfig,
)
from nest_megatron.cost.problem import Problem
from nest_megatron.errors import NestError
from nest_megatron.hardware.accelerator import accelerator_from_config
from nest_megatron.hardware.topology import BUILDERS
from nest_megatron.model.spec import ModelSpec
from nest_megatron.solver.registry import SOLVERS
from nest_megatron.trace.source import resolve as resolve_model_source

CONFIG_DIR = Path(__file__).resolve().parents[1] / "hydra_configs"  # package data: an installed wheel has it too
# The user's own clusters, models, ... live outside the installed package: folders with the same group
# layout (cluster/NAME.yaml, ...), listed in this variable like PATH.
CONFIG_PATH_ENV = "NEST_MEGATRON_CONFIG_PATH"
GROUPS = ("model", "accelerator", "cluster", "train", "solver")
SECTIONS = {
    "model": ModelConfig,
    "accelerator": AcceleratorConfig,
    "cluster": ClusterConfig,
    "train": TrainConfig,
    "solver": SolverConfig,
    "plan": PlanChoice,
    "profile": ProfileConfig,
}


@dataclass(frozen=True)
class Loaded:
    problem: Problem
    config: RootConfig
    overrides: tuple[str, ...] = ()  # as given, so that a Plan can be rebuilt (explain, every SLURM node)


ConfigStore.instance().store(name="base_config", node=RootConfig)


def user_config_dirs() -> list[Path]:
    """The folders of NEST_MEGATRON_CONFIG_PATH, checked: each exists, and no file in them has the name of a
    shipped one (Hydra would silently take the shipped file)."""
    dirs = [Path(d).expanduser().resolve() for d in os.environ.get(CONFIG_PATH_ENV, "").split(os.pathsep) if d]
    for folder in dirs:
        if not folder.is_dir():
            raise NestError(f"{CONFIG_PATH_ENV}: {folder} is not a folder; list folders that hold {'/, '.join(GROUPS)}/ "
                            f"YAML files, separated by '{os.pathsep}'")
        for group in GROUPS:
            for clash in sorted((folder / group).glob("*.yaml")):
                if (CONFIG_DIR / group / clash.name).exists():
                    raise NestError(f"{clash}: a shipped {group} has the name {clash.stem}; rename yours "
                                    f"(the shipped one would be used)")
    return dirs


def _search_path(folder: Path) -> str:
    """`folder` as a quoted Hydra search-path entry: Hydra takes the path after file:// as it is (no URI
    decoding), and the quotes keep blanks and commas inside one entry."""
    escaped = str(folder).replace("\\", "\\\\").replace("'", "\\'")
    return f"'file://{escaped}'"


def options(group: str) -> list[str]:
    return sorted({p.stem for folder in [*user_config_dirs(), CONFIG_DIR] for p in (folder / group).glob("*.yaml")})


def load(overrides: list[str]) -> Loaded:
    cfg = _compose(overrides)
    root = RootConfig(**{name: _typed(name, schema, cfg.get(name)) for name, schema in SECTIONS.items()}, out=cfg.get("out"),
                      cache=cfg.get("cache"), report=cfg.get("report"))
    root.model, tracer = resolve_model_source(root.model)  # model.source: analytic, or a traced model
    _check(root)
    return Loaded(problem=_problem(root, tracer), config=root,
                  overrides=tuple(o for o in overrides if not o.startswith(("out=", "report="))))


def _compose(overrides: list[str]):
    for item in overrides:
        if item.startswith(("+", "~")):
            name = item.lstrip("+~").split("=", 1)[0]
            raise NestError(f"'{item}': every key exists already, so '+' and '~' are not allowed; write {name}=VALUE")
        if "=" not in item:
            raise NestError(f"'{item}': overrides are key=value (e.g. model=llama3_70b, cluster.num_devices=1024)")
        key, value = item.split("=", 1)
        if key in GROUPS and value not in options(key):
            raise NestError(_unknown_option_message(f"{key}={value}", key, value))
    try:
        cfg = _hydra_compose(overrides)
    except yaml.YAMLError as err:  # a config file of the user's that is not YAML
        raise NestError(_yaml_message(err)) from None
    except (ConfigCompositionException, MissingConfigException, HydraException, OmegaConfBaseException) as err:
        raise NestError(_composition_message(err, overrides)) from None
    return cfg


def _hydra_compose(overrides: list[str]):
    """Hydra's composition of `overrides`, the user's config folders searched before the shipped ones."""
    user_dirs = user_config_dirs()
    search = [f"hydra.searchpath=[{','.join(_search_path(folder) for folder in user_dirs)}]"] if user_dirs else []
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        return compose(config_name="config", overrides=[*overrides, *search])


def _unknown_option_message(where: str, group: str, name: str) -> str:
    return (f"{where}: unknown {group}; choose one of: {', '.join(options(group))} (your own {group}s go in a folder "
            f"listed in {CONFIG_PATH_ENV}, as {group}/{name}.yaml)")


def _config_file(group: str, name: str) -> Path | None:
    """The YAML file that `group`=`name` composes: the user's folders first, then the shipped configs."""
    return next((p for folder in [*user_config_dirs(), CONFIG_DIR] if (p := folder / group / f"{name}.yaml").exists()),
                None)


def _yaml_message(err: yaml.YAMLError) -> str:
    mark = getattr(err, "problem_mark", None)
    if mark is None:
        return f"a config file is not valid YAML: {' '.join(str(err).split())}"
    problem = getattr(err, "problem", None) or "not valid YAML"
    context, start = getattr(err, "context", None), getattr(err, "context_mark", None)
    opened = f" ({context} from line {start.line + 1})" if context and start else ""
    return f"{mark.name}: line {mark.line + 1}, column {mark.column + 1}: {problem}{opened}; fix the YAML"


# The schema of what a config file's keys go into, as the messages call it
SCHEMA_NAMES = {**{schema: section for section, schema in SECTIONS.items()}, LevelConfig: "a cluster level"}


def _file_message(where: str, cause: Exception | None) -> str | None:
    """A problem inside one config file (`where` is Hydra's 'group/name'), as one line naming the file, or None."""
    group, _, name = where.partition("/")
    path = _config_file(group, name) if group in GROUPS else None
    if path is None or not isinstance(cause, OmegaConfBaseException):
        return None
    key = getattr(cause, "full_key", None) or getattr(cause, "key", None) or "?"
    schema = getattr(cause, "object_type", None)
    if "not in" in str(cause) and schema in SCHEMA_NAMES:
        allowed = [f.name for f in fields(schema)]
        close = difflib.get_close_matches(str(key).split(".")[-1], allowed, n=1)
        hint = f"did you mean {close[0]}? " if close else ""
        return f"{path}: {key}: no such key; {hint}keys of {SCHEMA_NAMES[schema]}: {', '.join(allowed)}"
    text = str(cause).splitlines()[0]
    wrong_type = re.match(r"Value '(.*)' of type '\w+' could not be converted to (\w+)", text)
    return f"{path}: {key}: " + (f"expected {wrong_type.group(2)}, not {wrong_type.group(1)}" if wrong_type else text)


def _missing_option_message(group: str, name: str, overrides: list[str]) -> str:
    """An option that a config file's defaults name (overrides on the command line are checked before)."""
    chosen = [_config_file(k, v) for k, _, v in (o.partition("=") for o in overrides) if k in GROUPS]
    mine = [p for folder in user_config_dirs() for g in GROUPS for p in sorted((folder / g).glob("*.yaml"))]
    pattern = re.compile(rf"{group}\S*:\s*{re.escape(name)}\b")
    source = next((p for p in [*chosen, *mine] if p and pattern.search(p.read_text())), None)
    return _unknown_option_message(f"{source}: defaults: {group} {name}" if source else f"{group}={name}", group, name)


def _levels_message(overrides: list[str]) -> str | None:
    """An override of a level the cluster does not have (cluster.levels.5.fan_out=2 on a 3-level cluster)."""
    indexed = [(o, int(m.group(1))) for o in overrides if (m := re.match(r"cluster\.levels\.(\d+)\b", o))]
    if not indexed:
        return None
    cluster = _hydra_compose([o for o in overrides if not re.match(r"cluster\.levels\.\d", o)]).cluster
    count = len(cluster.levels)
    return next((f"{o.split('=', 1)[0]}: cluster {cluster.name} has {count} levels, indices 0..{count - 1}"
                 for o, i in indexed if i >= count), None)


def _composition_message(err: Exception, overrides: list[str]) -> str:
    text = " ".join(str(err).split())
    cause = " ".join(str(err.__cause__ or "").split())
    in_file = re.match(r"In '([\w/.-]+)': ", text)
    if in_file and (message := _file_message(in_file.group(1), err.__cause__ or err.__context__)):
        return message
    not_found = re.search(r"Could not find '(\w+)/([\w.-]+)'", text)
    if not_found:
        return _missing_option_message(not_found.group(1), not_found.group(2), overrides)
    try:
        levels = _levels_message(overrides)
    except (HydraException, OmegaConfBaseException):
        levels = None
    if levels:
        return levels
    wrong_type = re.search(r"Error merging override ([\w.]+)=(\S*)", text)
    if wrong_type and cause:
        expected = re.search(r"(?:converted to|a valid) (\w+)", cause)
        kind = expected.group(1) if expected else cause.split(" full_key")[0]
        return f"{wrong_type.group(1)}={wrong_type.group(2)}: expected {kind}"
    missing = re.search(r"override '([\w.]+)'", text) or re.search(r"Key '(\w+)' is not in struct", text)
    if missing:
        dotted = missing.group(1)
        return _unknown_key_message(dotted)
    return f"bad override ({' '.join(overrides)}): {text}"


def _unknown_key_message(dotted: str) -> str:
    level = re.match(r"cluster\.levels\.\d+\.(\w+)$", dotted)
    if level:
        allowed = [f.name for f in fields(LevelConfig)]
        close = difflib.get_close_matches(level.group(1), allowed, n=1)
        hint = f"did you mean {dotted.rsplit('.', 1)[0]}.{close[0]}? " if close else ""
        return f"{dotted}: no such key; {hint}keys of a cluster level: {', '.join(allowed)}"
    section, _, key = dotted.partition(".")
    if section in SECTIONS and key:
        allowed = [f.name for f in fields(SECTIONS[section])]
        close = difflib.get_close_matches(key.split(".")[0], allowed, n=1)
        hint = f"did you mean {section}.{close[0]}? " if close else ""
        return f"{dotted}: no such key; {hint}keys of {section}: {', '.join(allowed)}"
    allowed = list(SECTIONS) + ["out", "cache", "report"]
    return f"{dotted}: no such key; top-level keys: {', '.join(allowed)}"


def _typed(name: str, schema, node):
    """Merge one section onto its dataclass so that unknown keys and wrong types fail here."""
    try:
        merged = OmegaConf.merge(OmegaConf.structured(schema), node if node is not None else {})
        return OmegaConf.to_object(merged)
    except OmegaConfBaseException as err:
        key = getattr(err, "full_key", None) or getattr(err, "key", None) or "?"
        text = str(err).splitlines()[0]
        if "not in struct" in text or "Key '" in text and "not" in text:
            raise NestError(_unknown_key_message(f"{name}.{key}")) from None
        raise NestError(f"{name}.{key}: {text}") from None


def _positive(section: str, obj, *names: str) -> None:
    for n in names:
        value = getattr(obj, n)
        if value is not None and value <= 0:
            raise NestError(f"{section}.{n}={value}: must be positive")


def _check(root: RootConfig) -> None:
    m, a, c, t = root.model, root.accelerator, root.cluster, root.train
    _positive("model", m, "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "seq_length",
              "vocab_size", "num_query_groups", "kv_channels", "num_experts", "moe_router_topk", "moe_layer_freq")
    if m.family not in ("gpt", "bert"):
        raise NestError(f"model.family={m.family}: allowed are gpt, bert")
    if m.kv_channels is None and m.hidden_size % m.num_attention_heads:
        raise NestError(
            f"model.num_attention_heads={m.num_attention_heads}: must divide model.hidden_size={m.hidden_size} "
            "(or set model.kv_channels)"
        )
    groups = m.num_query_groups or m.num_attention_heads
    if m.num_attention_heads % groups:
        raise NestError(f"model.num_query_groups={groups}: must divide model.num_attention_heads={m.num_attention_heads}")
    if m.num_experts and m.moe_router_topk > m.num_experts:
        raise NestError(f"model.moe_router_topk={m.moe_router_topk}: at most model.num_experts={m.num_experts}")
    for key, allowed in (("attention_backend", ("flash", "unfused")), ("normalization", ("LayerNorm", "RMSNorm")),
                         ("position_embedding_type", ("learned_absolute", "rope"))):
        if getattr(m, key) not in allowed:
            raise NestError(f"model.{key}={getattr(m, key)}: allowed are {', '.join(allowed)}")
    for key in ("hidden_dropout", "attention_dropout"):
        if not 0 <= getattr(m, key) < 1:
            raise NestError(f"model.{key}={getattr(m, key)}: must be in [0, 1)")
    _positive("accelerator", a, "peak_bf16_tflops", "memory_gib", "hbm_bandwidth_gb_per_s")
    for key in ("gemm_efficiency", "attention_efficiency", "memory_bound_efficiency"):
        if not 0 < getattr(a, key) <= 1:
            raise NestError(f"accelerator.{key}={getattr(a, key)}: must be in (0, 1]")
    if c.topology not in BUILDERS:
        raise NestError(f"cluster.topology={c.topology}: allowed are {', '.join(BUILDERS)}")
    if c.topology == "torus":
        if c.torus is None or not c.torus.dims or any(d <= 0 for d in c.torus.dims):
            raise NestError("cluster.torus.dims: a torus needs a list of positive dimensions, e.g. [4, 4, 4]")
        _positive("cluster.torus", c.torus, "link_bandwidth_gb_per_s")
        if c.torus.hop_latency_s < 0:
            raise NestError(f"cluster.torus.hop_latency_s={c.torus.hop_latency_s}: must be >= 0")
    elif not c.levels:
        raise NestError("cluster.levels: a hierarchical cluster needs at least one level")
    for i, lv in enumerate(c.levels):
        _positive(f"cluster.levels[{i}]", lv, "fan_out", "bandwidth_gb_per_s")
        if lv.latency_s < 0:
            raise NestError(f"cluster.levels[{i}].latency_s={lv.latency_s}: must be >= 0")
        if lv.oversubscription < 1:
            raise NestError(f"cluster.levels[{i}].oversubscription={lv.oversubscription}: must be >= 1")
    _positive("cluster", c, "num_devices", "device_memory_gib")
    _positive("train", t, "global_batch_size", "micro_batch_size")
    s = root.solver
    if s.name not in SOLVERS:
        raise NestError(f"solver.name={s.name}: allowed are {', '.join(SOLVERS)}")
    if not s.micro_batch_sizes or any(x <= 0 for x in s.micro_batch_sizes):
        raise NestError(f"solver.micro_batch_sizes={s.micro_batch_sizes}: a list of positive integers")
    _positive("profile", root.profile, "repeats", "local_devices")
    if root.profile.warmup < 0:
        raise NestError(f"profile.warmup={root.profile.warmup}: must be >= 0")


def _problem(root: RootConfig, tracer=None) -> Problem:
    topology = BUILDERS[root.cluster.topology](root.cluster)
    if root.cluster.num_devices is not None:
        topology = topology.rescaled(root.cluster.num_devices)
    return Problem(
        model=ModelSpec(root.model, tracer=tracer),
        accelerator=accelerator_from_config(root.accelerator, memory_gib=root.cluster.device_memory_gib),
        topology=topology,
        global_batch_size=root.train.global_batch_size,
        overlap_grad_reduce=root.train.overlap_grad_reduce,
        overlap_param_gather=root.train.overlap_param_gather,
    )
