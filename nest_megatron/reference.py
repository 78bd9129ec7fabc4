"""The CLI reference in docs/reference.md, generated from the commands and the config schema, so the two
cannot drift apart: `python -m nest_megatron.reference` rewrites the reference's block between the
markers, and tests/test_reference.py fails when it is stale."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import io
import json
import sys
import tokenize
from pathlib import Path

from nest_megatron import cli
from nest_megatron.config.load import load
from nest_megatron.config.megatron_argv import FLAG_OF_KEY
from nest_megatron.config.schema import (
    AcceleratorConfig,
    ClusterConfig,
    LevelConfig,
    ModelConfig,
    PlanChoice,
    ProfileConfig,
    RootConfig,
    SolverConfig,
    TorusConfig,
    TrainConfig,
)

START, END = "<!-- reference:start (python -m nest_megatron.reference) -->", "<!-- reference:end -->"

# The key prefix each schema is reached by, in the order the reference lists them.
SECTIONS = [
    ("model", ModelConfig), ("accelerator", AcceleratorConfig), ("cluster", ClusterConfig),
    ("cluster.levels[i]", LevelConfig), ("cluster.torus", TorusConfig), ("train", TrainConfig),
    ("solver", SolverConfig), ("plan", PlanChoice), ("profile", ProfileConfig), ("", RootConfig),
]


def field_comments(cls: type) -> dict[str, str]:
    """Each field's comment in schema.py: the comment on its line, else the comment lines above it."""
    source = inspect.getsource(cls)
    trailing, standalone = {}, {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            own_line = tok.line.strip().startswith("#")
            (standalone if own_line else trailing)[tok.start[0]] = tok.string.lstrip("#").strip()
    out = {}
    for node in ast.parse(source).body[0].body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            line = node.lineno
            above = []
            while line - 1 - len(above) in standalone:
                above.insert(0, standalone[line - 1 - len(above)])
            # A comment block above several fields introduces them; a field's own trailing comment says what it is.
            out[node.target.id] = trailing.get(line) or " ".join(above)
    return out


# Sections whose default group file (train: default, solver: dp) sets values over the schema's: the reference
# shows what a key is when no override names it.
COMPOSED = ("train", "solver")


def default_text(f: dataclasses.Field, composed: object | None = None) -> str:
    """The default as an override would spell it (YAML / JSON: null, true, [1, 2]); `composed`: the section
    as the default config composes it."""
    value = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
    if composed is not None:
        value = getattr(composed, f.name)
    if value is dataclasses.MISSING or value == "???":
        return "required"
    return f"`{value}`" if isinstance(value, str) else f"`{json.dumps(value)}`"


def type_text(f: dataclasses.Field) -> str:
    text = str(f.type)
    return f"{text.removeprefix('Optional[')[:-1]} or null" if text.startswith("Optional[") else text


def commands_table() -> list[str]:
    lines = ["| command | what it does |", "|---|---|"]
    for name in cli.COMMANDS:
        module = cli.command_module(name)
        text = module.HELP[name] if isinstance(module.HELP, dict) else module.HELP
        lines.append(f"| `nest-megatron {name}` | {text} |")
    return lines + ["", "`nest-megatron COMMAND --help` gives each command's options."]


def keys_tables() -> list[str]:
    lines = []
    config = load([]).config
    for prefix, cls in SECTIONS:
        comments = field_comments(cls)
        lines += ["", f"**{prefix or 'top level'}** (`{cls.__name__}`: {(cls.__doc__ or '').strip().splitlines()[0]})", "",
                  "| key | type | default | meaning |", "|---|---|---|---|"]
        for f in dataclasses.fields(cls):
            if dataclasses.is_dataclass(f.default_factory() if f.default_factory is not dataclasses.MISSING else None):
                continue  # a section of its own
            key = f"{prefix}.{f.name}" if prefix else f.name
            meaning = comments.get(f.name, "")
            flag = FLAG_OF_KEY.get(key) if prefix == "model" else None
            if flag:  # the flag that sets it, as config/megatron_argv.py reads it (--disable-bias-linear, ...)
                meaning = f"Megatron-LM's `{flag}`" + (f"; {meaning}" if meaning else "")
            meaning = meaning.replace("|", "\\|")
            composed = getattr(config, prefix) if prefix in COMPOSED else None
            lines.append(f"| `{key}` | {type_text(f)} | {default_text(f, composed)} | {meaning} |")
    return lines


def markdown() -> str:
    return "\n".join([START, "", *commands_table(), *keys_tables(), "", END])


def with_reference(text: str) -> str:
    """`text` with its reference block replaced by the generated one."""
    head, start, rest = text.partition(START)
    _, end, tail = rest.partition(END)
    if not start or not end:
        raise ValueError(f"the reference has no {START} ... {END} block")
    return head + markdown() + tail


if __name__ == "__main__":
    path = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).resolve().parents[1] / "docs" / "reference.md")
    path.write_text(with_reference(path.read_text()))
