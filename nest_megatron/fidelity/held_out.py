"""Megatron-Bridge's later H100 rows (benchmarks/bridge_h100_held_out.yaml), priced with the shipped constants.

No fit sees these rows: they measure how the shipped cost model does on software releases after the ones it was
fitted to (NeMo containers 26.02 to 26.06 against the calibration set's 25.09 and 25.11). A table row gives the
layout and throughput only; the recipe's other settings (recomputation, overlaps, FP8 recipe, dispatcher) are
those of the 25.11 row it names as `base`, so a row is priced where its layout is that recipe's (the base row's
layout as the fidelity bench prices it, published.ROW_SETTINGS applied), or where a later recipe read at its tag
(LATER_RECIPES) gives the row's layout and the settings it changes. A model without a 25.11 row is priced where
a later recipe of it was read, with the shape of another stack's calibration row of that model. The others are
listed with the reason, not guessed.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from nest_megatron.fidelity.bench import RowResult, evaluate_row
from nest_megatron.fidelity.published import ROW_SETTINGS, load_entries, row_of

HELD_OUT_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "bridge_h100_held_out.yaml"
# The layout a recipe is written for; the batch (GBS, MBS) may differ, as the table gives it and it changes no other
# setting of the recipe.
LAYOUT_KEYS = ("num_gpus", "seq_length", "tp", "pp", "cp", "vp", "ep")


@dataclass(frozen=True)
class LaterRecipe:
    """A later release's recipe of a base row's model at another layout: the base's settings but `settings`."""

    name: str  # where it is read, for the report
    base: str  # the calibration row whose recipe it changes
    releases: tuple[str, ...]  # the NeMo containers that run it
    layout: dict  # LAYOUT_KEYS it sets (the rest are the base's)
    settings: dict  # published.ROW_SETTINGS-style, in place of the base's
    # A model no 25.11 Bridge row has: the held-out rows' model name it prices, `base` another stack's row that gives
    # the model's shape, and `stack` the entry fields that make it this recipe's (source, precision, optimizer)
    model: str | None = None
    stack: dict = field(default_factory=dict)


# Megatron-Bridge v0.3.0 is NeMo 26.02's, v0.4.0 26.04's and v0.5.0 26.06's (docs/releases/software-versions.md at
# 067f987); v0.3.1 is 26.02.01's (docs/releases/known-issues.md at 067f987, '## 26.02': "Fixed in 26.02.01
# (r0.3.1)"), and 26.04.01 is taken as v0.4.1 (no file says; its recipes below are v0.4.0's). Read at those tags:
# - Llama 3 70B, Llama 3.1 405B and Qwen3-235B-A22B keep v0.2.0's H100 layout and settings but their batch (which
#   the table gives);
# - GPT-OSS 120B, GPT_OSS_120B_PRETRAIN_CONFIG_H100_BF16_V2 (V1 at GBS 1280, configs/gpt_oss/
#   gpt_oss_workload_base_configs.py:79-83,114-117 at v0.3.0, :79-83,126-129 at v0.4.0), keeps its layout and
#   recompute_modules [layernorm, moe_act], which from v0.3.0 run as a selective recompute (utils/overrides.py:141-143
#   sets the granularity; v0.2.0 did not: published.ROW_SETTINGS);
# - Qwen3-30B-A3B's H100 FP8 recipe, QWEN3_30B_A3B_PRETRAIN_CONFIG_H100_FP8_CS_V1, at v0.3.0
#   (scripts/performance/configs/qwen/qwen3_workload_base_configs.py:421-429): the 25.11 layout and overlap, the flex
#   dispatcher with DeepEP; from v0.3.1 (:408-415; :422-429 at v0.4.0 and v0.4.1, :470-477 at v0.5.0): 16 GPUs as
#   EP 16 without a pipeline, moe_a2a_overlap False, the flex dispatcher with HybridEP (qwen3_llm_pretrain.py:298-299),
#   priced as DeepEP's as the AutoModel rows. The 26.02.01 table row prints the v0.3.0 layout (PP 2, VP 12, EP 8), not
#   its tag's: listed, not priced.
# The rest as at v0.2.0 (set_qwen3_common_configs: no recompute, forced balancing, bf16 gradient reduction).
# Nemotron-3 Nano 30B-A3B has no 25.11 Bridge row; its H100 FP8 recipe from v0.3.1 on,
# NEMOTRON_3_NANO_PRETRAIN_CONFIG_H100_FP8_CS_V1 (configs/nemotronh/nemotron_3_nano_workload_base_configs.py at v0.3.1,
# nemotron_3_workload_base_configs.py:31-40,70-87 at v0.4.0 and v0.4.1, :31-40,74-91 at v0.5.0): 16 GPUs, TP 1, EP 8,
# MBS 1, GBS 1024, selective recompute of [moe, layernorm, core_attn, moe_act] (overrides.py sets the granularity), TE
# CUDA graphs of the Mamba mixers; the recipe (src/megatron/bridge/recipes/nemotronh/nemotron_3_nano.py:49,65-67,87-89 at
# v0.3.1) 8,192 tokens, the flex dispatcher with its backend set to HybridEP by the perf config, fused permutation, the
# fused loss; set_nemotron_3_nano_common_configs forced balancing and bf16 gradient reduction; FP8 current scaling
# (get_precision_config 'fp8_cs'). The model's shape is the AutoModel row's (the same Nemotron3NanoProvider).
NANO = "automodel-Nemotron_V3_Nano_30B-8gpu-bf16"
BRIDGE_STACK = {"source": {"repo": "NVIDIA-NeMo/Megatron-Bridge"}, "fsdp": 0, "distributed_optimizer": True,
                "precision_class": "FP8", "fp8_recipe": "FP8 current scaling", "sequence_parallel": False,
                "optimizations": {"dp_overlap_grad_reduce": True, "dp_overlap_param_gather": True}}
LATER_RECIPES = (
    LaterRecipe("Bridge v0.3.1 NEMOTRON_3_NANO_PRETRAIN_CONFIG_H100_FP8_CS_V1", NANO,
                ("26.02.01", "26.04", "26.04.01", "26.06"), {"num_gpus": 16, "seq_length": 8192},
                {"model": ROW_SETTINGS[NANO]["model"], "recompute": "selective",
                 "recompute_modules": ["moe", "layernorm", "core_attn", "moe_act"], "moe_dispatcher": "deepep",
                 "cross_entropy_fusion": True,
                 "assumed": ["model shape of the AutoModel row", "HybridEP dispatch priced as DeepEP's",
                             "the Mamba mixers' CUDA graphs not priced (the host time is hidden without them)"]},
                model="Nemotron_3_Nano", stack=BRIDGE_STACK),
    LaterRecipe("Bridge v0.3.0 GPT_OSS_120B_PRETRAIN_CONFIG_H100_BF16_V2", "mb-25.11-GPT_OSS_120B-bf16",
                ("26.02", "26.02.01", "26.04", "26.04.01"), {},
                {"layout": {"mbs": 1}, "recompute": "selective", "recompute_modules": ["layernorm", "moe_act"]}),
    LaterRecipe("Bridge v0.3.0 QWEN3_30B_A3B_PRETRAIN_CONFIG_H100_FP8_CS_V1", "mb-25.11-Qwen3_30B_a3B-fp8cs",
                ("26.02",), {"vp": 12},
                {"layout": {"vp": 12}, "moe_dispatcher": "deepep", "assumed": ["DeepEP dispatch (the 26.02 recipe's)"]}),
    LaterRecipe("Bridge v0.3.1 QWEN3_30B_A3B_PRETRAIN_CONFIG_H100_FP8_CS_V1", "mb-25.11-Qwen3_30B_a3B-fp8cs",
                ("26.02.01", "26.04", "26.04.01", "26.06"), {"pp": 1, "vp": None, "ep": 16},
                {"moe_dispatcher": "deepep", "optimizations": {"ep_a2a_overlap_1f1b": False},
                 "assumed": ["layout pp=1 ep=16, no EP all-to-all overlap (the recipe's from v0.3.1)",
                             "HybridEP dispatch priced as DeepEP's"]}),
)
# What a release's own notes say ran degraded, by release: (the dispatcher it hits, the note). Such a row is priced
# and reported as any other, and the summary is given without it too.
KNOWN_ISSUES = {
    "26.02": ("deepep", "DeepEP is not supported in the NeMo 26.02 container: a recipe that dispatches with it ran "
                        "without it (the notes: DeepSeek-V3 slower than in 25.09 on H100; docs/releases/known-issues.md "
                        "at 067f987, '## 26.02')"),
}


@dataclass(frozen=True)
class HeldOut:
    label: str  # e.g. 'mb-26.04-Qwen3_235B_a22B-fp8'
    line: int  # the row's line in the source table
    base: str | None  # the calibration row whose recipe it runs
    result: RowResult | None  # None: not priced
    why_not: str | None = None
    recipe: str | None = None  # the later recipe (LaterRecipe.name) that changes the base's, if one does
    known_issue: str | None = None  # what the release's notes say degraded the run (KNOWN_ISSUES)


def load_rows(path: Path = HELD_OUT_PATH) -> list[dict]:
    return yaml.safe_load(path.read_text())["rows"]


def label_of(row: dict) -> str:
    return f"mb-{row['release']}-{row['model'].replace(' ', '_')}-{row['precision'].lower()}"


def base_layout(base: dict) -> dict:
    """The base row's layout as the bench prices it: the table's, with the recipe's corrections."""
    return {**base, **ROW_SETTINGS.get(base["id"], {}).get("layout", {})}


def layout_difference(row: dict, base: dict, recipe: LaterRecipe | None = None) -> str | None:
    """'pp 1 against 2, ...' where the held-out row's layout is not its base recipe's (or `recipe`'s, `base` with the
    recipe's stack); None when it is."""
    layout = {**base, **recipe.layout} if recipe else base_layout(base)
    diffs = [f"{key} {_size(row[key])} against {_size(layout[key])}" for key in LAYOUT_KEYS
             if _size(row[key]) != _size(layout[key])]
    if row["precision"].upper() != base["precision_class"].upper():
        diffs.append(f"precision {row['precision']} against {base['precision_class']}")
    return ", ".join(diffs) or None


def _size(value) -> int:
    """A parallel size as the tables write it: 'n/a' (None) is 1."""
    return 1 if value is None else value


def held_out_entry(row: dict, base: dict, recipe: LaterRecipe | None = None) -> dict:
    """The base row with the later release's batch and measured throughput (its id kept: its recipe settings are
    looked up by it), and `recipe`'s layout."""
    entry = {**base, "gbs": row["gbs"], "mbs": row["mbs"], "tokens_per_sec_per_gpu": row["tokens_per_sec_per_gpu"]}
    if recipe:
        entry.update(recipe.layout)
        entry["dp"] = entry["num_gpus"] // (entry["tp"] * entry["pp"] * _size(entry["cp"]))
    return entry


def later_recipe(row: dict) -> LaterRecipe | None:
    """The later recipe of the row's base, or of its model where it names no base, at the row's release."""
    return next((r for r in LATER_RECIPES if row["release"] in r.releases
                 and (r.base == row["base"] if row["base"] else r.model == row["model"])), None)


def price(row: dict, entries: dict[str, dict]) -> HeldOut:
    label = label_of(row)
    recipe = later_recipe(row)
    if row["base"] is None and recipe is None:
        return HeldOut(label, row["line"], None, None, "no 25.11 Megatron-Bridge recipe of this model in the calibration "
                                                       "set, nor a later one read")
    base_id = recipe.base if recipe else row["base"]
    base = {**entries[base_id], **(recipe.stack if recipe else {})}
    differs = layout_difference(row, base, recipe)
    if differs:
        recipe_of = f"that of {recipe.name}" if recipe else f"the {row['base']} recipe's"
        return HeldOut(label, row["line"], base_id, None, f"layout not {recipe_of} ({differs})")
    settings = recipe.settings if recipe else None
    priced = evaluate_row(dataclasses.replace(row_of(held_out_entry(row, base, recipe), settings), id=label))
    return HeldOut(label, row["line"], base_id, priced, recipe=recipe.name if recipe else None,
                   known_issue=known_issue(row["release"], priced))


def known_issue(release: str, priced: RowResult) -> str | None:
    dispatcher, note = KNOWN_ISSUES.get(release, (None, None))
    return note if dispatcher is not None and priced.row.moe_dispatcher == dispatcher else None


def held_out(path: Path = HELD_OUT_PATH) -> list[HeldOut]:
    entries = {entry["id"]: entry for entry in load_entries()}
    return [price(row, entries) for row in load_rows(path)]
