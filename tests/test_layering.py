"""Imports flow one way: each module imports only from its own layer or the layers before it."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "nest_megatron"

LAYERS = [
    ["errors", "config.schema", "config.megatron_argv", "calibration", "calibration.logs"],
    ["model", "hardware"],
    ["parallel"],
    ["cost", "calibration.constants", "calibration.fit"],
    ["emit"],
    ["solver"],
    ["plan"],
    ["report"],
    ["config.load", "trace", "profile", "calibration.profile"],
    ["api", "fidelity"],
    ["launch", "integrations", "sweep", "calibration.runs"],
    ["commands"],
    ["cli", "reference"],
]


def layer_of(module: str) -> int:
    best = None
    for i, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if module == prefix or module.startswith(prefix + "."):
                best = i
    assert best is not None, f"nest_megatron.{module} is in no layer of LAYERS"
    return best


def modules():
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE).with_suffix("")
        name = ".".join(rel.parts).removesuffix(".__init__")
        if name and name != "__init__":
            yield name, path


def test_imports_flow_one_way():
    wrong = []
    for name, path in modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("nest_megatron."):
                target = node.module.removeprefix("nest_megatron.")
                if layer_of(target) > layer_of(name):
                    wrong.append(f"{name} imports {target}")
    assert not wrong, wrong


def test_nothing_reads_the_shared_folder():
    for name, path in modules():
        assert "../shared" not in path.read_text(), name
