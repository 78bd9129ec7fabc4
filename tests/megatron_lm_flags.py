"""Megatron-LM's command-line flags, read from a checkout (MEGATRON_LM_ROOT; Megatron-LM is not on PyPI) at test time,
so that nothing of Megatron-LM is copied into this repository: the flag literals of megatron/training/arguments.py
and of the config dataclasses its parser is built from (ArgumentGroupFactory: megatron/training/config/*.py,
TransformerConfig, ModelParallelConfig), whose fields are flags as --field-name, with --no-/--disable- forms of
the boolean fields that default to True."""

from __future__ import annotations

import ast
import re
from pathlib import Path

LITERAL = re.compile(r"""['"](--[a-z0-9][a-z0-9_-]*)['"]""")


def dataclass_flags(source: str) -> set[str]:
    """--field-name for every annotated field of the classes in `source`, and the negated forms of True booleans."""
    flags = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    name = item.target.id.replace("_", "-")
                    flags.add(f"--{name}")
                    if isinstance(item.value, ast.Constant) and item.value.value is True:
                        flags |= {f"--no-{name}", f"--disable-{name}"}
    return flags


def megatron_lm_flags(root: Path) -> set[str]:
    training, core = root / "megatron" / "training", root / "megatron" / "core"
    flags = set(LITERAL.findall((training / "arguments.py").read_text()))
    for path in [*sorted((training / "config").glob("*.py")), core / "transformer" / "transformer_config.py",
                 core / "model_parallel_config.py"]:
        text = path.read_text()
        flags |= set(LITERAL.findall(text)) | dataclass_flags(text)
    return flags
