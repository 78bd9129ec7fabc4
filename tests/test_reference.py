"""The CLI reference (docs/reference.md) is the one generated from the commands and the config schema."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path

from nest_megatron import cli, reference
from nest_megatron.config import schema

REFERENCE = Path(__file__).resolve().parents[1] / "docs" / "reference.md"


def test_reference_is_current():
    text = REFERENCE.read_text()
    assert text == reference.with_reference(text), "stale: run `python -m nest_megatron.reference`"


def test_reference_lists_every_command_and_key():
    block = reference.markdown()
    for name in cli.COMMANDS:
        assert f"`nest-megatron {name}`" in block
    # Every leaf key of every section, spelt as an override.
    assert "| `model.num_query_groups` | int or null | `null` |" in block
    assert "| `solver.zero_stages` | list[int] | `[0, 1, 2, 3]` |" in block
    for prefix, cls in reference.SECTIONS:
        for f in fields(cls):
            if f.name in ("model", "accelerator", "cluster", "train", "solver", "plan", "profile"):
                continue
            assert f"`{prefix + '.' if prefix else ''}{f.name}`" in block, f.name
    assert {cls for _, cls in reference.SECTIONS} >= {
        schema.ModelConfig, schema.ClusterConfig, schema.SolverConfig, schema.PlanChoice, schema.RootConfig}


def test_field_comments_come_from_the_schema_source():
    comments = reference.field_comments(schema.LevelConfig)
    assert comments["fan_out"] == "units of the level below in one unit of this level"
    # A comment on the lines above a field belongs to it, and only to it.
    assert reference.field_comments(schema.ModelConfig)["attention_backend"].startswith("auto (Megatron's default")
    assert reference.field_comments(schema.ModelConfig)["hidden_size"] == ""
