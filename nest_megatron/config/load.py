"""Compose the Hydra config from overrides, check it, and turn it into SI-unit objects.

Every way a user can get the input wrong ends here as one NestError line that names the key, the
value and what is allowed.
"""

from __future__ import annotations

import copy
import difflib
import hashlib
import math
import os
import re
from dataclasses import dataclass, fields, replace
from functools import lru_cache
from pathlib import Path

import yaml
from hydra import compose, initialize_config_dir
from hydra._internal.config_loader_impl import ConfigLoaderImpl  # Hydra's own override code (hydra-core 1.3)
from hydra.core.config_store import ConfigStore
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import ConfigCompositionException, HydraException, MissingConfigException
from hydra.types import RunMode
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from nest_megatron.calibration.constants import with_values
from nest_megatron.calibration.profile import Calibration, check_levels, from_config
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
from nest_megatron.cost.offload import why_not_offloaded
from nest_megatron.cost.problem import Problem
from nest_megatron.errors import NestError
from nest_megatron.hardware import slurm_tree
from nest_megatron.hardware.accelerator import accelerator_from_config
from nest_megatron.hardware.hostlist import expand
from nest_megatron.hardware.topology import BUILDERS, Topology, without_hosts
from nest_megatron.model.kinds import HYBRID_KINDS
from nest_megatron.model.spec import (
    ATTENTION_BACKENDS,
    DTYPE_BYTES,
    SOFTMAX_TYPES,
    ModelSpec,
    Numerics,
    OptimizerDtypes,
    gpt_model,
)
from nest_megatron.parallel.config import CP_COMM_TYPES, RANK_ORDERS, RECOMPUTE_KINDS, RECOMPUTE_MODULES, ZERO_STAGES
from nest_megatron.parallel.layout import EXCLUSIONS, SplitForm, excluded_pair, form_vpp, layout_problem, pattern_chunks
from nest_megatron.parallel.rules import model_violation
from nest_megatron.solver.registry import SOLVERS
from nest_megatron.solver.visit import MAX_JOBS
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
    # What prices the problem: the shipped constants, or a calibration profile's (calibration=, NEST_MEGATRON_CALIBRATION)
    calibration: Calibration | None = None


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
                      cache=cfg.get("cache"), report=cfg.get("report"), calibration=cfg.get("calibration"))
    root.model, tracer = resolve_model_source(root.model)  # model.source: analytic, or a traced model
    _check(root)
    kept = tuple(o for o in overrides if not o.startswith(("out=", "report=", "calibration=")))
    if root.cluster.nodes is None and _allocated_nodes(root.cluster) is not None:
        # SLURM's node list, so that the overrides rebuild the problem outside the job too (explain, sweep)
        kept += (f"cluster.nodes={os.environ['SLURM_JOB_NODELIST']}",)
    calibration = from_config(root.calibration, root.accelerator.name)
    if calibration.path is not None:
        # The profile by its absolute path (given, or from NEST_MEGATRON_CALIBRATION), so that the overrides
        # re-price the plan with it anywhere (explain)
        root.calibration = calibration.path
        kept += (f"calibration={calibration.path}",)
    problem = _problem(root, tracer)
    if calibration.path is not None:
        check_levels(calibration, [lv.name for lv in problem.topology.levels], f"calibration={calibration.path}")
        problem = with_values(problem, calibration.values)
    return Loaded(problem=problem, config=root, overrides=kept, calibration=calibration)


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
        cfg = _hydra_compose([quote_verbatim(item) for item in overrides])
    except yaml.YAMLError as err:  # a config file of the user's that is not YAML
        raise NestError(_yaml_message(err)) from None
    except (ConfigCompositionException, MissingConfigException, HydraException, OmegaConfBaseException) as err:
        raise NestError(_composition_message(err, overrides)) from None
    return cfg


# Keys whose value is a SLURM hostlist or a path: n[01-12],n20 is a string, not Hydra's list and sweep syntax.
VERBATIM_KEYS = ("cluster.nodes", "cluster.failed_nodes", "cluster.topology_conf", "plan.pipeline_model_parallel_layout")


def quote_verbatim(item: str) -> str:
    """`item` with an unquoted hostlist or path value quoted for Hydra (a quoted one, or several as a sweep
    'a','b', stay as written)."""
    key, _, value = item.partition("=")
    if key not in VERBATIM_KEYS or value[:1] in ("'", '"') or value == "null":
        return item
    return f"{key}='{value}'" if "'" not in value else f'{key}="{value}"'


def _hydra_compose(overrides: list[str]):
    """Hydra's composition of `overrides`, the user's config folders searched before the shipped ones.

    Composing the config groups (Hydra's defaults tree and OmegaConf merges) costs ~110 ms of CPU, and a sweep,
    `explain` or a test suite composes the same groups again and again with other values: that composition is
    kept by the group choices and the bytes of every YAML file Hydra could read (an edited, added or removed file
    composes afresh), and the key=value overrides are applied to a copy of it by Hydra's own override code, as
    Hydra's compose applies them once the defaults are merged (~10 ms)."""
    choices = [item for item in overrides if _selects_configs(item)]
    values = [item for item in overrides if not _selects_configs(item)]
    user_dirs = user_config_dirs()
    key = (tuple(choices), tuple(user_dirs), _config_files_digest([CONFIG_DIR, *user_dirs]))
    if key not in _COMPOSED:
        search = [f"hydra.searchpath=[{','.join(_search_path(folder) for folder in user_dirs)}]"] if user_dirs else []
        with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
            composed = compose(config_name="config", overrides=[*choices, *search])
        if len(_COMPOSED) >= COMPOSED_KEPT:
            del _COMPOSED[next(iter(_COMPOSED))]  # the oldest
        _COMPOSED[key] = composed
    cfg = copy.deepcopy(_COMPOSED[key])
    if values:  # hydra/_internal/config_loader_impl.py _load_configuration_impl, after the defaults list
        parsed = OverridesParser.create().parse_overrides(overrides=values)
        ConfigLoaderImpl.validate_sweep_overrides_legal(overrides=parsed, run_mode=RunMode.RUN, from_shell=False)
        ConfigLoaderImpl._apply_overrides_to_config(parsed, cfg)
    return cfg


def _selects_configs(item: str) -> bool:
    """Whether override `item` takes part in Hydra's defaults list (a group's option, a package, Hydra's own
    settings) rather than setting a value of the composed config."""
    key = item.split("=", 1)[0]
    return key in GROUPS or key.startswith("hydra") or "@" in key or "/" in key


_COMPOSED: dict[tuple, object] = {}  # (group choices, user folders, digest of their files) -> Hydra's composition
COMPOSED_KEPT = 64  # a composition is ~50 kB


def _config_files_digest(folders: list[Path]) -> str:
    """A digest of the path and bytes of every YAML file under `folders` (what Hydra composes from)."""
    digest = hashlib.sha1()
    for folder in folders:
        for path in sorted(folder.rglob("*.yaml")):
            digest.update(str(path).encode() + b"\0")
            try:
                digest.update(path.read_bytes() + b"\0")
            except OSError:  # unreadable (Hydra will say so): the path alone
                pass
    return digest.hexdigest()


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


# Keys an earlier release took, and where their setting lives now.
MOVED_KEYS = {"train.moe_a2a_overlap": "plan.moe_a2a_overlap (a configuration's choice, which the search also tries: "
                                       "solver.moe_a2a_overlap)"}


def _unknown_key_message(dotted: str) -> str:
    if dotted in MOVED_KEYS:
        return f"{dotted}: moved to {MOVED_KEYS[dotted]}"
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
    allowed = list(SECTIONS) + ["out", "cache", "report", "calibration"]
    return f"{dotted}: no such key; top-level keys: {', '.join(allowed)}"


def _typed(name: str, schema, node):
    """Merge one section onto its dataclass so that unknown keys and wrong types fail here."""
    try:
        merged = OmegaConf.merge(_structured(schema), node if node is not None else {})  # merge copies its first
        return OmegaConf.to_object(merged)
    except OmegaConfBaseException as err:
        key = getattr(err, "full_key", None) or getattr(err, "key", None) or "?"
        text = str(err).splitlines()[0]
        if "not in struct" in text or "Key '" in text and "not" in text:
            raise NestError(_unknown_key_message(f"{name}.{key}")) from None
        raise NestError(f"{name}.{key}: {text}") from None


@lru_cache(maxsize=None)
def _structured(schema):
    """The schema's empty config, built once per schema (a tenth of a load's CPU); OmegaConf.merge works on a copy."""
    return OmegaConf.structured(schema)


# Caps on sizes: powers of two at least 10x the largest value a published model or cluster uses, so that every real
# input loads and a typo (a few zeros too many) is one line instead of a hang or a nonsense plan.
# Devices: today's largest GPU clusters hold ~200k (xAI Colossus) and 1M-GPU sites are announced; a device count past
# 2^20 is a typo.
MAX_DEVICES = 2**20
MAX_LAYERS = 2**14  # DeepNet (Wang et al., 2022) trained 1,000 layers; LLMs use <= 128 (Llama 3 405B: 126)
MAX_HIDDEN = 2**18  # MT-NLG 530B's 20,480 is the widest
MAX_FFN = 2**20  # PaLM 540B's 73,728
MAX_HEADS = 2**12  # Falcon 180B's 232 query heads
MAX_KV_CHANNELS = 2**12  # Gemma's 256 per head
MAX_SEQ = 2**24  # 1M-token contexts are trained (context parallel)
MAX_VOCAB = 2**22  # Gemma 3's 262,144
MAX_EXPERTS = 2**15  # Switch-C's 2,048
MAX_SMS = 2**12  # B200: 148 streaming multiprocessors
MAX_BATCH = 2**20  # sequences: LAMB trained BERT at 65,536 a batch, LLMs use a few thousand
# Search knob, capped by its cost: every value up to it is tried at every pipeline size (1,024 made a 16-GPU plan of
# tiny_gpt 5x slower), while published interleaved schedules use a few chunks a rank.
MAX_VIRTUAL_STAGES = 64
MAX_PROFILE_RUNS = 1000  # runs of one kernel: a median of more moves nothing; more is a typo that holds a GPU for hours


def _integer(key: str, value: int | None, lo: int, hi: int | None = None, bound: str = "") -> None:
    """`value` (None: unset) in lo..hi (no cap when hi is None); `bound` names where hi comes from."""
    if value is None or lo <= value and (hi is None or value <= hi):
        return
    raise NestError(f"{key}={value}: must be an integer >= {lo}" if hi is None
                    else f"{key}={value}: allowed {lo}..{hi}{f' ({bound})' if bound else ''}")


def _real(key: str, value: float | None, lo: float, *, above: bool = False) -> None:
    """`value` (None: unset) a finite number >= lo, or > lo with `above`: NaN and infinity are no sizes."""
    if value is None or math.isfinite(value) and (value > lo if above else value >= lo):
        return
    raise NestError(f"{key}={value}: must be a finite number {'>' if above else '>='} {lo:g}")


def _one_of(key: str, value, allowed) -> None:
    if value is not None and value not in allowed:
        raise NestError(f"{key}={value}: allowed are {', '.join(map(str, allowed))}")


def _check(root: RootConfig) -> None:
    _check_model(root.model)
    devices = _check_cluster(root.cluster)
    _check_accelerator(root.accelerator, root.cluster.device_memory_gib)
    _check_train_and_solver(root.train, root.solver)
    _check_precision(root.train, root.accelerator)
    _check_a2a_overlap(root.train, root.model, root.plan)
    if root.model.moe_pad_expert_input_to_capacity and root.train.moe_dispatcher == "deepep":
        raise NestError("model.moe_pad_expert_input_to_capacity=true with train.moe_dispatcher=deepep: megatron-core's "
                        "DeepEP dispatcher does not pad to capacity (launch rule pad-deepep); use alltoall")
    _check_cpu_offloading(root.plan, root.accelerator, root.train)
    _check_plan(root.plan, devices=devices, layers=root.model.num_layers, batch=root.train.global_batch_size,
                mtp_num_layers=root.model.mtp_num_layers)
    p = root.profile
    _integer("profile.warmup", p.warmup, 0, MAX_PROFILE_RUNS)
    _integer("profile.repeats", p.repeats, 1, MAX_PROFILE_RUNS)
    _integer("profile.local_devices", p.local_devices, 1, MAX_DEVICES)


def _check_model(m: ModelConfig) -> None:
    for key, cap in (("num_layers", MAX_LAYERS), ("hidden_size", MAX_HIDDEN), ("ffn_hidden_size", MAX_FFN),
                     ("num_attention_heads", MAX_HEADS), ("kv_channels", MAX_KV_CHANNELS), ("seq_length", MAX_SEQ),
                     ("vocab_size", MAX_VOCAB), ("make_vocab_size_divisible_by", MAX_VOCAB),
                     ("num_experts", MAX_EXPERTS), ("moe_ffn_hidden_size", MAX_FFN),
                     ("moe_shared_expert_intermediate_size", MAX_FFN), ("q_lora_rank", MAX_HIDDEN),
                     ("kv_lora_rank", MAX_HIDDEN), ("qk_head_dim", MAX_KV_CHANNELS),
                     ("qk_pos_emb_head_dim", MAX_KV_CHANNELS), ("v_head_dim", MAX_KV_CHANNELS),
                     ("mtp_num_layers", MAX_LAYERS), ("moe_router_num_groups", MAX_EXPERTS),
                     ("moe_router_group_topk", MAX_EXPERTS), ("moe_latent_size", MAX_HIDDEN)):
        _integer(f"model.{key}", getattr(m, key), 1, cap)
    _integer("model.num_query_groups", m.num_query_groups, 1, m.num_attention_heads, "model.num_attention_heads")
    _integer("model.padded_vocab_size", m.padded_vocab_size, 1, MAX_VOCAB)
    if m.padded_vocab_size and m.padded_vocab_size < m.vocab_size:  # Megatron does not check it
        raise NestError(f"model.padded_vocab_size={m.padded_vocab_size} is below model.vocab_size={m.vocab_size}: the "
                        f"tokenizer's last ids would index past the embedding; give at least {m.vocab_size} or leave "
                        "it unset (Megatron pads the vocabulary itself)")
    if m.num_experts:
        _integer("model.moe_router_topk", m.moe_router_topk, 1, m.num_experts, "model.num_experts")
    else:
        _integer("model.moe_router_topk", m.moe_router_topk, 1, MAX_EXPERTS)
    _one_of("model.family", m.family, ("gpt", "bert"))
    if m.kv_channels is None and m.hidden_size % m.num_attention_heads:
        raise NestError(
            f"model.num_attention_heads={m.num_attention_heads}: must divide model.hidden_size={m.hidden_size} "
            "(or set model.kv_channels)"
        )
    groups = m.num_query_groups or m.num_attention_heads
    if m.num_attention_heads % groups:
        raise NestError(f"model.num_query_groups={groups}: must divide model.num_attention_heads={m.num_attention_heads}")
    for key, allowed in (("attention_backend", ATTENTION_BACKENDS), ("normalization", ("LayerNorm", "RMSNorm")),
                         ("position_embedding_type", ("learned_absolute", "rope", "none"))):
        _one_of(f"model.{key}", getattr(m, key), allowed)
    for key in ("hidden_dropout", "attention_dropout"):
        if not 0 <= getattr(m, key) < 1:
            raise NestError(f"model.{key}={getattr(m, key)}: must be in [0, 1)")
    _real("model.moe_load_imbalance", m.moe_load_imbalance, 1)
    capacity = m.moe_expert_capacity_factor
    if capacity is not None and not (math.isfinite(capacity) and capacity > 0):  # Megatron reads a negative as None
        raise NestError(f"model.moe_expert_capacity_factor={capacity}: must be a finite number > 0, or null (dropless)")
    if isinstance(m.moe_layer_freq, int) and not isinstance(m.moe_layer_freq, bool):
        _integer("model.moe_layer_freq", m.moe_layer_freq, 1, MAX_LAYERS)
    _real("model.mtp_loss_scaling_factor", m.mtp_loss_scaling_factor, 0)
    _one_of("model.transformer_impl", m.transformer_impl, ("transformer_engine", "local"))
    _one_of("model.softmax_type", m.softmax_type, SOFTMAX_TYPES)
    if m.q_lora_rank is not None and not m.multi_latent_attention:
        raise NestError(f"model.q_lora_rank={m.q_lora_rank} without model.multi_latent_attention=true: only MLA has a "
                        "query latent; set multi_latent_attention or drop q_lora_rank")
    line = model_violation(m)  # parallel/rules.py MODEL_RULES: the MoE pattern, MLA, group-limited routing
    if line:
        raise NestError(line)
    if m.squared_relu and m.swiglu:  # Megatron-LM megatron/training/argument_utils.py:320-321 asserts it
        raise NestError("model.squared_relu=true and model.swiglu=true: one MLP activation; choose one")
    if m.hybrid_layer_pattern is not None:
        _check_hybrid(m)
    elif m.mtp_hybrid_pattern is not None:
        raise NestError(f"model.mtp_hybrid_pattern={m.mtp_hybrid_pattern} without model.hybrid_layer_pattern: a GPT "
                        "stack's depth is its last layer; drop mtp_hybrid_pattern")
    if m.mtp_use_repeated_layer and not m.mtp_num_layers:
        raise NestError("model.mtp_use_repeated_layer=true without model.mtp_num_layers: no depth to repeat")
    _integer("model.window_size", m.window_size, 1, m.seq_length - 1, "model.seq_length - 1: a window of the whole "
             "sequence is full attention; set null")
    _integer("model.window_attn_skip_freq", m.window_attn_skip_freq, 1, m.num_layers, "model.num_layers")
    if m.window_attn_skip_freq is not None and m.window_size is None:
        raise NestError(f"model.window_attn_skip_freq={m.window_attn_skip_freq} without model.window_size: no layer "
                        "has sliding-window attention; set model.window_size or drop it")


def _check_hybrid_mtp(m: ModelConfig) -> None:
    """A hybrid stack's MTP depths are given by their layers (Megatron-LM warns and builds no depth without them,
    arguments.py:897-907 at d98e8a6): M, *, - or E, no pipeline cut (hybrid_layer_allocation.py _validate_pattern,
    allow_pipe False)."""
    depth = m.mtp_hybrid_pattern
    if m.mtp_num_layers and depth is None:
        raise NestError(f"model.mtp_num_layers={m.mtp_num_layers} with model.hybrid_layer_pattern: a hybrid stack's "
                        "depth is its own layers; give model.mtp_hybrid_pattern (e.g. '*E': attention, then MoE)")
    if depth is None:
        return
    if not m.mtp_num_layers:
        raise NestError(f"model.mtp_hybrid_pattern={depth}: the layers of a multi-token-prediction depth; give "
                        "model.mtp_num_layers, the depths")
    wrong = [symbol for symbol in dict.fromkeys(depth) if symbol not in HYBRID_KINDS]
    if wrong or not depth:
        raise NestError(f"model.mtp_hybrid_pattern={depth}: one layer a symbol, M (Mamba), * (attention), - (MLP) or E "
                        f"(MoE){f'; not {wrong[0]!r}' if wrong else ''}")


def _check_hybrid(m: ModelConfig) -> None:
    """A hybrid stack: one of megatron-core's symbols a layer (M, *, -, E; '|' segments are the plan's split, a '/'
    depth is model.mtp_hybrid_pattern), the MoE flags only with 'E' layers, the Mamba sizes megatron-core asserts
    (0.16.1 ssm/mamba_mixer.py:250-262); what the planner prices of it: Transformer Engine's spec, the analytic
    source, no MLA."""
    pattern = m.hybrid_layer_pattern
    if "|" in pattern:  # Megatron-LM's split of the pattern (parallel/layout.py PIPE): the plan's, not the model's
        raise NestError(f"model.hybrid_layer_pattern: '|' cuts the layers into pipeline stages, which is the plan's "
                        f"split; give the layers alone and plan.layers_per_stage={list(pattern_chunks(pattern))}")
    wrong = [symbol for symbol in dict.fromkeys(pattern) if symbol not in HYBRID_KINDS]
    if wrong:
        raise NestError(f"model.hybrid_layer_pattern: '{wrong[0]}' is no layer the planner prices; allowed are M "
                        "(Mamba), * (attention), - (MLP), E (MoE), one a layer (an MTP depth: model.mtp_hybrid_pattern)")
    if len(pattern) != m.num_layers:
        raise NestError(f"model.hybrid_layer_pattern has {len(pattern)} layers but model.num_layers={m.num_layers}: "
                        "one symbol a layer")
    if ("E" in pattern + (m.mtp_hybrid_pattern or "")) != bool(m.num_experts):
        raise NestError("model.hybrid_layer_pattern: 'E' layers and model.num_experts go together; give both or "
                        "neither")
    _check_hybrid_mtp(m)
    for key, value in (("multi_latent_attention", m.multi_latent_attention),
                       ("transformer_impl", m.transformer_impl == "local"),
                       ("source", m.source in ("megatron", "module"))):
        if value:
            raise NestError(f"model.{key}={getattr(m, key)} with model.hybrid_layer_pattern: a hybrid stack is planned "
                            "with attention, Transformer Engine's layers and the analytic model only")
    for key in ("mamba_state_dim", "mamba_head_dim", "mamba_num_groups", "mamba_num_heads"):
        _integer(f"model.{key}", getattr(m, key), 1, MAX_HIDDEN)
    heads = m.mamba_num_heads or 2 * m.hidden_size // m.mamba_head_dim
    if m.mamba_num_heads is None and 2 * m.hidden_size % m.mamba_head_dim:
        raise NestError(f"model.mamba_head_dim={m.mamba_head_dim}: must divide 2 x model.hidden_size (the Mamba "
                        "inner width), or give model.mamba_num_heads")
    if heads % m.mamba_num_groups:
        raise NestError(f"model.mamba_num_groups={m.mamba_num_groups}: must divide the {heads} Mamba heads")


def _check_accelerator(a: AcceleratorConfig, device_memory_gib: float | None) -> None:
    for key in ("peak_bf16_tflops", "memory_gib", "hbm_bandwidth_gb_per_s"):
        _real(f"accelerator.{key}", getattr(a, key), 0, above=True)
    for key in ("gemm_efficiency", "gemm_fp8_efficiency", "attention_efficiency", "memory_bound_efficiency"):
        if not 0 < getattr(a, key) <= 1:
            raise NestError(f"accelerator.{key}={getattr(a, key)}: must be in (0, 1]")
    _integer("accelerator.sm_count", a.sm_count, 1, MAX_SMS)
    _real("accelerator.kernel_overhead_us", a.kernel_overhead_us, 0)
    _real("accelerator.host_overhead_us", a.host_overhead_us, 0)
    _real("accelerator.host_link_gb_per_s", a.host_link_gb_per_s, 0, above=True)
    _real("accelerator.host_memory_gib", a.host_memory_gib, 0, above=True)
    _real("accelerator.reserved_memory_gib", a.reserved_memory_gib, 0)
    memory = device_memory_gib or a.memory_gib  # what the cluster models a device to hold (checked before)
    if a.reserved_memory_gib >= memory:
        raise NestError(f"accelerator.reserved_memory_gib={a.reserved_memory_gib}: must be below the device memory, "
                        f"{memory} GiB")


def _check_cluster(c: ClusterConfig) -> int:
    """Check the cluster's keys; return its device count."""
    _one_of("cluster.topology", c.topology, tuple(BUILDERS))
    _real("cluster.device_memory_gib", c.device_memory_gib, 0, above=True)
    _integer("cluster.num_devices", c.num_devices, 1, MAX_DEVICES)
    if c.topology == "torus":
        if c.torus is None or not c.torus.dims:
            raise NestError("cluster.torus.dims: a torus needs a list of dimensions, e.g. [4, 4, 4]")
        for i, k in enumerate(c.torus.dims):
            _integer(f"cluster.torus.dims[{i}]", k, 1, MAX_DEVICES)
        _real("cluster.torus.link_bandwidth_gb_per_s", c.torus.link_bandwidth_gb_per_s, 0, above=True)
        _real("cluster.torus.hop_latency_s", c.torus.hop_latency_s, 0)
        described, where = c.torus.dims, "cluster.torus.dims:"
    else:
        if not c.levels:
            raise NestError("cluster.levels: a hierarchical cluster needs at least one level")
        for i, lv in enumerate(c.levels):
            _integer(f"cluster.levels[{i}].fan_out", lv.fan_out, 1, MAX_DEVICES)
            _real(f"cluster.levels[{i}].bandwidth_gb_per_s", lv.bandwidth_gb_per_s, 0, above=True)
            _real(f"cluster.levels[{i}].latency_s", lv.latency_s, 0)
            _real(f"cluster.levels[{i}].oversubscription", lv.oversubscription, 1)
            for key in ("efficiency", "all_to_all_efficiency"):
                if not 0 < getattr(lv, key) <= 1:
                    raise NestError(f"cluster.levels[{i}].{key}={getattr(lv, key)}: must be in (0, 1], a fraction of "
                                    "the level's bandwidth")
        described, where = [lv.fan_out for lv in c.levels], "cluster.levels: fan_outs"
    nodes = _allocated_nodes(c)
    if nodes is not None:
        return _devices_of_nodes(c, nodes)
    if c.failed_nodes is not None and c.topology_conf is None:
        if os.environ.get("SLURM_JOB_NODELIST") and c.topology == "hierarchical":
            # SLURM's nodes were set aside for a cluster.num_devices of another size: the error says which size
            return _devices_of_nodes(c, expand(os.environ["SLURM_JOB_NODELIST"], key="SLURM_JOB_NODELIST"))
        raise NestError(f"cluster.failed_nodes={c.failed_nodes}: the allocation's nodes are unnamed; give "
                        "cluster.nodes (or cluster.topology_conf) to say which of them failed")
    if c.num_devices is not None:  # the levels are rescaled to it
        return c.num_devices
    devices = math.prod(described)
    if devices > MAX_DEVICES:
        raise NestError(f"{where} {'*'.join(map(str, described))} = {devices} devices; allowed 1..{MAX_DEVICES}")
    return devices


def _allocated_nodes(c: ClusterConfig) -> list[str] | None:
    """cluster.nodes expanded; inside a SLURM job without it, SLURM_JOB_NODELIST, unless cluster.num_devices
    asks for another size (a what-if plan run from a login allocation)."""
    if c.nodes is not None:
        return expand(c.nodes, key="cluster.nodes")
    nodelist = os.environ.get("SLURM_JOB_NODELIST")
    if nodelist is None or c.topology != "hierarchical":
        return None
    nodes = expand(nodelist, key="SLURM_JOB_NODELIST")
    if c.num_devices is not None and c.num_devices != len(_working_nodes(c, nodes)) * _devices_per_node(c):
        return None
    return nodes


def _nodes_key(c: ClusterConfig) -> str:
    """Where the allocated nodes came from, as an error names it."""
    return f"cluster.nodes={c.nodes}" if c.nodes is not None else f"SLURM_JOB_NODELIST={os.environ.get('SLURM_JOB_NODELIST')}"


def _devices_per_node(c: ClusterConfig) -> int:
    if not 0 <= c.host_level < len(c.levels):
        return 1  # the builder names the bad host_level
    return math.prod(lv.fan_out for lv in c.levels[: c.host_level + 1])


def _devices_of_nodes(c: ClusterConfig, nodes: list[str]) -> int:
    key = _nodes_key(c)
    if c.topology != "hierarchical":
        raise NestError(f"{key}: cluster {c.name} is a {c.topology}, whose chips are not named nodes; use "
                        "cluster.num_devices")
    if len(set(nodes)) != len(nodes):
        twice = next(n for i, n in enumerate(nodes) if n in nodes[:i])
        raise NestError(f"{key}: node {twice} is listed twice")
    working = _working_nodes(c, nodes)
    devices = len(working) * _devices_per_node(c)
    names = f"names {len(nodes)} nodes" + (f", {len(working)} of them working," if len(working) < len(nodes) else "")
    if c.num_devices is not None and c.num_devices != devices:
        raise NestError(f"cluster.num_devices={c.num_devices}, but {key} {names} "
                        f"of {_devices_per_node(c)} devices = {devices}; give one of them")
    if devices > MAX_DEVICES:
        raise NestError(f"{key} {names} of {_devices_per_node(c)} devices = {devices}; allowed 1..{MAX_DEVICES}")
    return devices


def _allocation(c: ClusterConfig, topology: Topology) -> Topology:
    """The topology of the allocated nodes: their switch tree from cluster.topology_conf (inside a SLURM job
    without it, `scontrol show topology` when the tree plugin answers), else the levels' fan_outs filled in
    node order; the nodes become the topology's hosts."""
    nodes = _allocated_nodes(c)
    if c.topology_conf is not None and c.topology != "hierarchical":
        raise NestError(f"cluster.topology_conf={c.topology_conf}: cluster {c.name} is a {c.topology}, not a switch tree")
    if c.topology_conf is not None:
        tree, source = slurm_tree.read(c.topology_conf), c.topology_conf
    elif nodes is not None and c.nodes is None:
        tree, source = slurm_tree.from_scontrol(), "scontrol show topology"
    else:
        tree, source = None, ""
    if tree is not None:
        nodes = nodes if nodes is not None else list(tree.leaf_of)
        working = _working_nodes(c, nodes)
        allocated = slurm_tree.allocation_topology(topology, tree, working, source=source)
        if c.num_devices is not None and c.num_devices != allocated.num_devices:
            raise NestError(f"cluster.num_devices={c.num_devices}, but the {len(working)} working nodes of {source} "
                            f"have {allocated.num_devices} devices; give one of them")
        if len(working) == len(nodes):
            return allocated
        return replace(allocated, allocation=slurm_tree.allocation_topology(topology, tree, nodes, source=source))
    if nodes is None:
        return topology.rescaled(c.num_devices) if c.num_devices is not None else topology
    allocated = replace(topology.rescaled(len(nodes) * topology.devices_per_node), hosts=tuple(nodes))
    working = _working_nodes(c, nodes)
    if len(working) == len(nodes):
        return allocated
    # The failed nodes leave holes: the others keep their units (the tree the report draws).
    return replace(without_hosts(allocated, set(nodes) - set(working)), allocation=allocated)


def _working_nodes(c: ClusterConfig, nodes: list[str]) -> list[str]:
    """The allocated `nodes` without cluster.failed_nodes, each of which must be one of them."""
    if c.failed_nodes is None:
        return nodes
    failed = expand(c.failed_nodes, key="cluster.failed_nodes")
    allocated = set(nodes)
    stranger = next((n for n in failed if n not in allocated), None)
    if stranger is not None:
        raise NestError(f"cluster.failed_nodes={c.failed_nodes}: node {stranger} is not one of the allocation's "
                        f"{len(nodes)} nodes ({', '.join(nodes[:3])}{', ...' if len(nodes) > 3 else ''})")
    down = set(failed)
    working = [n for n in nodes if n not in down]
    if not working:
        raise NestError(f"cluster.failed_nodes={c.failed_nodes}: every node of the allocation failed; nothing is "
                        "left to plan on")
    return working


def _check_train_and_solver(t: TrainConfig, s: SolverConfig) -> None:
    _integer("train.global_batch_size", t.global_batch_size, 1, MAX_BATCH)
    _integer("train.micro_batch_size", t.micro_batch_size, 1, t.global_batch_size, "train.global_batch_size")
    _one_of("solver.name", s.name, tuple(SOLVERS))
    if not s.micro_batch_sizes:
        raise NestError("solver.micro_batch_sizes=[]: list at least one micro-batch size")
    # Entries are capped, not bounded by the model or the batch: one solver config serves every problem.
    for i, size in enumerate(s.micro_batch_sizes):
        _integer(f"solver.micro_batch_sizes[{i}]", size, 1, MAX_BATCH)
    for i, count in enumerate(s.recompute_num_layers):
        _integer(f"solver.recompute_num_layers[{i}]", count, 1, MAX_LAYERS)
    for key, allowed in (("zero_stages", ZERO_STAGES), ("recompute", RECOMPUTE_KINDS), ("rank_orders", RANK_ORDERS),
                         ("cp_comm_types", CP_COMM_TYPES)):
        for i, value in enumerate(getattr(s, key)):
            _one_of(f"solver.{key}[{i}]", value, allowed)
    if not s.cpu_offloading:
        raise NestError("solver.cpu_offloading=[]: list at least one share of the layers (0: no offloading)")
    for i, share in enumerate(s.cpu_offloading):
        if not (math.isfinite(share) and 0 <= share < 1):
            raise NestError(f"solver.cpu_offloading[{i}]={share}: a share of the layers offloaded, from 0 (none) to "
                            "below 1 (the last layer's activations stay on the device)")
    _integer("solver.max_virtual_stages", s.max_virtual_stages, 1, MAX_VIRTUAL_STAGES)
    _integer("solver.max_context_parallel", s.max_context_parallel, 1)  # the sizes tried are a fixed short list
    _integer("solver.top_k", s.top_k, 0)
    _integer("solver.jobs", s.jobs, 1, MAX_JOBS)


# --fp8-recipe's choices (Megatron-LM megatron/core/transformer/transformer_config.py:594, less 'custom', whose
# quantizer is the user's own code)
PRECISIONS = ("bf16", "fp8")
MAIN_PARAMS_DTYPES = ("fp32", "fp16")  # --main-params-dtype's choices (training/arguments.py:3673)
MOE_DISPATCHERS = ("alltoall", "allgather", "deepep")  # train.moe_dispatcher (emit/megatron.py DISPATCHER_FLAGS)
FP8_RECIPES = ("delayed", "tensorwise", "blockwise", "mxfp8")


def _check_precision(t: TrainConfig, a: AcceleratorConfig) -> None:
    """The precision and FP8 recipe exist, and the accelerator has the tensor cores they need; the optimizer
    state's dtypes are the precision-aware optimizer's."""
    _one_of("train.precision", t.precision, PRECISIONS)
    _one_of("train.fp8_recipe", t.fp8_recipe, FP8_RECIPES)
    _one_of("train.main_params_dtype", t.main_params_dtype, MAIN_PARAMS_DTYPES)
    _one_of("train.moe_dispatcher", t.moe_dispatcher, MOE_DISPATCHERS)
    for key in ("exp_avg_dtype", "exp_avg_sq_dtype"):
        _one_of(f"train.{key}", getattr(t, key), tuple(DTYPE_BYTES))
    lowered = [f"train.{k}={getattr(t, k)}" for k in ("main_params_dtype", "exp_avg_dtype", "exp_avg_sq_dtype")
               if getattr(t, k) != "fp32"]
    if lowered and not t.precision_aware_optimizer:
        raise NestError(f"{lowered[0]}: only the precision-aware optimizer keeps its state in another dtype than "
                        "fp32 (Megatron reads it only with --use-precision-aware-optimizer); set "
                        "train.precision_aware_optimizer=true")
    if t.precision != "fp8":
        return
    if a.peak_fp8_tflops is None:
        with_fp8 = [name for name in options("accelerator") if _has_fp8(name)]
        raise NestError(f"train.precision=fp8: accelerator {a.name} has no FP8 tensor cores (no peak_fp8_tflops); "
                        f"FP8 accelerators: {', '.join(with_fp8) or 'none'}")
    # MXFP8 is a Blackwell recipe (transformer_config.py:597-599: "'mxfp8' for Blackwell architecture only")
    if t.fp8_recipe == "mxfp8" and not a.mxfp8:
        with_mx = [name for name in options("accelerator") if _has_fp8(name, "mxfp8")]
        raise NestError(f"train.fp8_recipe=mxfp8: accelerator {a.name} has no MXFP8 (block-scaled FP8) in hardware; "
                        f"MXFP8 accelerators: {', '.join(with_mx) or 'none'}; use delayed, tensorwise or blockwise")


def _check_cpu_offloading(p: PlanChoice, a: AcceleratorConfig, t: TrainConfig) -> None:
    """What a pinned --cpu-offloading-num-layers asks of the machine and the run (cost/offload.py
    why_not_offloaded)."""
    why = why_not_offloaded(accelerator_from_config(a), cuda_graphs=t.cuda_graphs) if p.cpu_offloading_num_layers else None
    if why:
        raise NestError(f"plan.cpu_offloading_num_layers={p.cpu_offloading_num_layers}: {why}")


def _check_a2a_overlap(t: TrainConfig, m: ModelConfig, p: PlanChoice) -> None:
    """What a pinned --overlap-moe-expert-parallel-comm asks of the run as a whole, whatever the layout (Megatron-LM
    transformer_config.py:3002-3071 at d98e8a6; what it asks of the layout is parallel/rules.py's a2a-overlap rules;
    the search tries it only where these hold, solver/space.py searched_a2a_overlaps): a MoE GPT model, the alltoall or
    flex dispatcher, at most one multi-token-prediction depth, no shared-expert overlap. --delay-wgrad-compute runs
    only with it (:3074-3077): train.delay_wgrad_compute=true plans with the overlap."""
    if t.delay_wgrad_compute and p.moe_a2a_overlap is False:
        raise NestError("train.delay_wgrad_compute=true with plan.moe_a2a_overlap=false: --delay-wgrad-compute runs "
                        "only with the EP all-to-all overlap (--overlap-moe-expert-parallel-comm); drop one")
    if p.moe_a2a_overlap:
        asked = "plan.moe_a2a_overlap=true"
    elif t.delay_wgrad_compute:
        asked = "train.delay_wgrad_compute=true (with the EP all-to-all overlap)"
    else:
        return
    if not m.num_experts:
        raise NestError(f"{asked}: model {m.name} has no experts (model.num_experts); "
                        "the overlap hides a MoE layer's expert-parallel all-to-alls")
    if not gpt_model(m):
        kind = "a hybrid Mamba stack" if m.family == "gpt" else f"a {m.family} model"
        raise NestError(f"{asked}: model {m.name} is {kind}; megatron-core's combined schedule runs the overlap for "
                        "a GPT model only (GPTModel.build_schedule_plan)")
    if t.moe_dispatcher == "allgather":
        raise NestError(f"{asked} with train.moe_dispatcher=allgather: the overlap runs with the "
                        "alltoall or flex (deepep) dispatcher only")
    if (m.mtp_num_layers or 0) > 1:
        raise NestError(f"{asked} with model.mtp_num_layers={m.mtp_num_layers}: the overlap takes "
                        "at most 1 multi-token-prediction layer")
    if m.moe_shared_expert_overlap:
        raise NestError(f"{asked} with model.moe_shared_expert_overlap=true: megatron-core takes one "
                        "of the two (--overlap-moe-expert-parallel-comm, --moe-shared-expert-overlap)")


def _has_fp8(name: str, key: str = "peak_fp8_tflops") -> bool:
    """Whether the accelerator config `name` sets `key` (FP8 peak, or mxfp8: true)."""
    path = _config_file("accelerator", name)
    try:
        data = yaml.safe_load(path.read_text()) if path else None
    except (OSError, yaml.YAMLError):
        return False
    return isinstance(data, dict) and bool(data.get(key))


def _check_plan(p: PlanChoice, *, devices: int, layers: int, batch: int, mtp_num_layers: int | None = None) -> None:
    """Pinned values, each within what can ever launch; 0 is a bad value here, never "unset"."""
    for key in ("tp", "pp", "dp", "cp", "ep", "etp", "distributed_optimizer_instances"):
        _integer(f"plan.{key}", getattr(p, key), 1, devices, "the cluster's devices")
    _integer("plan.vpp", p.vpp, 1, layers, "model.num_layers")
    _integer("plan.recompute_num_layers", p.recompute_num_layers, 1, layers, "model.num_layers")
    # 0: none (what a plan JSON without offloading reads back as); Transformer Engine offloads at most all layers but
    # the last (cpu_offload.py: num_layers <= model_layers - 1)
    _integer("plan.cpu_offloading_num_layers", p.cpu_offloading_num_layers, 0, layers - 1, "model.num_layers - 1")
    _integer("plan.mbs", p.mbs, 1, batch, "train.global_batch_size")
    _integer("plan.microbatch_group_size_per_vp_stage", p.microbatch_group_size_per_vp_stage, 1, batch,
             "train.global_batch_size")
    _one_of("plan.zero", p.zero, ZERO_STAGES)
    _one_of("plan.recompute", p.recompute, RECOMPUTE_KINDS)
    _check_recompute_modules(p.recompute_modules)
    if p.recompute_modules is not None and p.recompute not in (None, "selective"):
        raise NestError(f"plan.recompute_modules with plan.recompute={p.recompute}: the modules are selective "
                        "recompute's; use plan.recompute=selective or drop plan.recompute_modules")
    _one_of("plan.order", p.order, RANK_ORDERS)
    _one_of("plan.cp_comm_type", p.cp_comm_type, CP_COMM_TYPES)
    _check_split(p, layers, mtp_num_layers)


def _check_recompute_modules(modules) -> None:
    """plan.recompute_modules: a list of Megatron's module names (what they need of the model: the rule table)."""
    if modules is None:
        return
    if not isinstance(modules, (list, tuple)) or not all(isinstance(m, str) for m in modules):
        raise NestError(f"plan.recompute_modules={modules}: a list of module names, any of "
                        f"{', '.join(RECOMPUTE_MODULES)}")
    unknown = [m for m in modules if m not in RECOMPUTE_MODULES]
    if unknown:
        raise NestError(f"plan.recompute_modules: {', '.join(unknown)} unknown; allowed are "
                        f"{', '.join(RECOMPUTE_MODULES)}")


def _check_split(p: PlanChoice, layers: int, mtp_num_layers: int | None = None) -> None:
    """The layer split is given at most one way. plan.layers_per_stage: pp entries (layers per pipeline rank) or
    pp*vpp (layers per model chunk), each >= 0 (Megatron's layout allows an empty stage), adding up to
    model.num_layers. The first / last stage layers are 1..num_layers; a layout needs plan.pp and is one Megatron
    reads with the model's layers (whether it fits each pp x vpp is parallel.rules')."""
    form = SplitForm.from_fields(p)
    for _, one, other, source in EXCLUSIONS:
        pair = excluded_pair(form, one, other)
        if pair:
            raise NestError(f"plan.{pair[0]} with plan.{pair[1]}: Megatron takes one way to give the layer split "
                            f"({source}); give one")
    if p.layers_per_stage is not None and form.given:
        raise NestError(f"plan.layers_per_stage with plan.{form.given[0]}: give the layer split one way")
    for name, value in zip(("decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers"), form.first_last):
        _integer(f"plan.{name}", value, 1, layers, "model.num_layers")
    layout = p.pipeline_model_parallel_layout
    if layout is not None:
        key = f"plan.pipeline_model_parallel_layout={layout}"
        if p.pp is None:
            raise NestError(f"{key}: needs plan.pp pinned (its stages are pp*vpp model chunks)")
        line = layout_problem(str(layout), pp=p.pp, num_layers=layers, mtp_num_layers=mtp_num_layers)
        if line is None and p.vpp is not None and form_vpp(form, pp=p.pp) != p.vpp:
            line = f"{key}: its stages make plan.vpp={form_vpp(form, pp=p.pp)}, but plan.vpp={p.vpp} is given"
        if line is not None:
            raise NestError(line)
    split = p.layers_per_stage
    if split is None:
        return
    key = f"plan.layers_per_stage={list(split)}"
    if p.pp is None:
        raise NestError(f"{key}: needs plan.pp pinned (the split has pp or pp*vpp entries)")
    if not split or any(isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in split):
        raise NestError(f"{key}: a list of integers >= 0, one per pipeline rank or per model chunk")
    lengths = [p.pp] if p.vpp is None or p.vpp == 1 else [p.pp, p.pp * p.vpp]
    if p.vpp is None and len(split) % p.pp == 0:
        lengths = [len(split)]  # pp*vpp entries set vpp = len/pp, as Megatron's layout does
    if len(split) not in lengths:
        allowed = f"pp={p.pp}" if len(lengths) == 1 else f"pp={p.pp} or pp*vpp={p.pp * p.vpp}"
        raise NestError(f"{key}: {len(split)} entries, allowed {allowed} (or a multiple of pp without plan.vpp)")
    if sum(split) != layers:
        raise NestError(f"{key}: the entries add up to {sum(split)}, must add up to model.num_layers={layers}")


def _problem(root: RootConfig, tracer=None) -> Problem:
    topology = _allocation(root.cluster, BUILDERS[root.cluster.topology](root.cluster))
    t = root.train
    dtypes = (OptimizerDtypes(t.main_params_dtype, t.exp_avg_dtype, t.exp_avg_sq_dtype)
              if t.precision_aware_optimizer else None)
    numerics = Numerics(fp8_recipe=t.fp8_recipe if t.precision == "fp8" else None,
                        fp8_any_layout=root.accelerator.fp8_gemm_any_layout,
                        grad_reduce_in_bf16=t.grad_reduce_in_bf16, cross_entropy_fusion=t.cross_entropy_fusion,
                        optimizer_dtypes=dtypes)
    return Problem(
        model=ModelSpec(root.model, tracer=tracer, numerics=numerics),
        accelerator=accelerator_from_config(root.accelerator, memory_gib=root.cluster.device_memory_gib),
        topology=topology,
        global_batch_size=t.global_batch_size,
        overlap_grad_reduce=t.overlap_grad_reduce,
        overlap_param_gather=t.overlap_param_gather,
        tp_comm_overlap=t.tp_comm_overlap,
        moe_dispatcher=t.moe_dispatcher,
        cuda_graphs=t.cuda_graphs,
        defer_embedding_wgrad=t.defer_embedding_wgrad_compute,
        delay_wgrad_compute=t.delay_wgrad_compute,
    )
