"""Megatron-Bridge's later H100 rows (benchmarks/bridge_h100_held_out.yaml), priced with the shipped constants.

No fit sees these rows: they measure how the shipped cost model does on software releases after the ones it was
fitted to (NeMo containers 26.02 to 26.06 against the calibration set's 25.09 and 25.11). A table row gives the
layout and throughput only; the recipe's other settings (recomputation, overlaps, FP8 recipe, dispatcher) are
those of the 25.11 row it names as `base`, so a row is priced only where its layout is that recipe's (the
base row's layout as the fidelity bench prices it, published.ROW_SETTINGS applied). The others are listed with
the reason, not guessed.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import yaml

from nest_megatron.fidelity.bench import RowResult, evaluate_row
from nest_megatron.fidelity.published import ROW_SETTINGS, load_entries, row_of

HELD_OUT_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "bridge_h100_held_out.yaml"
# The layout a recipe is written for; the batch (GBS, MBS) may differ, as the table gives it and it changes no other
# setting of the recipe.
LAYOUT_KEYS = ("num_gpus", "seq_length", "tp", "pp", "cp", "vp", "ep")


@dataclass(frozen=True)
class HeldOut:
    label: str  # e.g. 'mb-26.04-Qwen3_235B_a22B-fp8'
    line: int  # the row's line in the source table
    base: str | None  # the calibration row whose recipe it runs
    result: RowResult | None  # None: not priced
    why_not: str | None = None


def load_rows(path: Path = HELD_OUT_PATH) -> list[dict]:
    return yaml.safe_load(path.read_text())["rows"]


def label_of(row: dict) -> str:
    return f"mb-{row['release']}-{row['model'].replace(' ', '_')}-{row['precision'].lower()}"


def base_layout(base: dict) -> dict:
    """The base row's layout as the bench prices it: the table's, with the recipe's corrections."""
    return {**base, **ROW_SETTINGS.get(base["id"], {}).get("layout", {})}


def layout_difference(row: dict, base: dict) -> str | None:
    """'pp 1 against 2, ...' where the held-out row's layout is not its base recipe's; None when it is."""
    layout = base_layout(base)
    diffs = [f"{key} {_size(row[key])} against {_size(layout[key])}" for key in LAYOUT_KEYS
             if _size(row[key]) != _size(layout[key])]
    if row["precision"].upper() != base["precision_class"].upper():
        diffs.append(f"precision {row['precision']} against {base['precision_class']}")
    return ", ".join(diffs) or None


def _size(value) -> int:
    """A parallel size as the tables write it: 'n/a' (None) is 1."""
    return 1 if value is None else value


def held_out_entry(row: dict, base: dict) -> dict:
    """The base row with the later release's batch and measured throughput (its id kept: its recipe settings are
    looked up by it)."""
    return {**base, "gbs": row["gbs"], "mbs": row["mbs"], "tokens_per_sec_per_gpu": row["tokens_per_sec_per_gpu"]}


def price(row: dict, entries: dict[str, dict]) -> HeldOut:
    label = label_of(row)
    if row["base"] is None:
        return HeldOut(label, row["line"], None, None, "no 25.11 Megatron-Bridge recipe of this model in the calibration set")
    base = entries[row["base"]]
    differs = layout_difference(row, base)
    if differs:
        return HeldOut(label, row["line"], row["base"], None, f"layout not the {row['base']} recipe's ({differs})")
    priced = evaluate_row(dataclasses.replace(row_of(held_out_entry(row, base)), id=label))
    return HeldOut(label, row["line"], row["base"], priced)


def held_out(path: Path = HELD_OUT_PATH) -> list[HeldOut]:
    entries = {entry["id"]: entry for entry in load_entries()}
    return [price(row, entries) for row in load_rows(path)]
