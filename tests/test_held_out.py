"""The held-out rows (benchmarks/bridge_h100_held_out.yaml): read, matched to their 25.11 recipe or a later one, priced
with the shipped constants. Their accuracy is reported by scripts/bench_held_out.py, not asserted here."""

from __future__ import annotations

from pathlib import Path

import pytest
from script_module import load_module

from nest_megatron.fidelity.bench import evaluate_row
from nest_megatron.fidelity.held_out import held_out, later_recipe, layout_difference, load_rows, price
from nest_megatron.fidelity.published import load_entries, measured_step_time, row_of

ROOT = Path(__file__).resolve().parents[1]
ENTRIES = {entry["id"]: entry for entry in load_entries()}


def row(line: int) -> dict:
    return next(r for r in load_rows() if r["line"] == line)


def test_every_base_is_a_calibration_row_of_the_same_model():
    rows = load_rows()
    assert len(rows) == 24  # the archive's DGX-H100 pre-training rows of 26.02 to 26.06 (SFT and LoRA left out)
    for r in rows:
        if r["base"] is not None:
            assert _name(ENTRIES[r["base"]]["model"]) == _name(r["model"]), r


def _name(model: str) -> str:
    return "".join(ch for ch in model.lower() if ch.isalnum())


def test_measured_step_time_from_the_table():
    # 26.04 Qwen3-235B-A22B (archive line 357): GBS 8192 x 4096 tokens at 1,686 tokens/s on each of 256 GPUs:
    # 33,554,432 / 431,616 = 77.741 s a step
    h = price(row(357), ENTRIES)
    assert h.result.row.measured_step_s == pytest.approx(77.741, abs=1e-3)


def test_layout_difference_reads_na_as_one_and_names_each_difference():
    assert layout_difference(row(308), ENTRIES["mb-25.11-LLAMA3_70B-fp8cs"]) is None  # EP 'n/a' = the base's 1
    # 26.06 Qwen3-30B-A3B runs EP 16 without a pipeline; the 25.11 recipe (its VP corrected to 12) PP 2, VP 12, EP 8
    assert layout_difference(row(132), ENTRIES["mb-25.11-Qwen3_30B_a3B-fp8cs"]) == \
        "pp 1 against 2, vp 1 against 12, ep 16 against 8"
    # ... which is the layout of the 26.04 recipe
    assert layout_difference(row(132), ENTRIES["mb-25.11-Qwen3_30B_a3B-fp8cs"], later_recipe(row(132))) is None


def test_rows_not_priced_say_why():
    # Nemotron-3 Nano at 26.02: no 25.11 row, and its first perf recipe is Bridge v0.3.1's (26.02.01)
    nano = price({**row(463), "release": "26.02"}, ENTRIES)
    assert nano.result is None and nano.why_not == ("no 25.11 Megatron-Bridge recipe of this model in the calibration "
                                                    "set, nor a later one read")
    # a later release at a layout neither the 25.11 recipe nor a later one read gives: listed, not guessed
    pp4 = {**row(132), "release": "26.02", "pp": 4}
    assert price(pp4, ENTRIES).why_not == ("layout not that of Bridge v0.3.0 QWEN3_30B_A3B_PRETRAIN_CONFIG_H100_FP8_CS_V1 "
                                           "(pp 4 against 2, vp 1 against 12, ep 16 against 8)")
    # 26.02.01 is Bridge v0.3.1, whose recipe runs EP 16 without a pipeline; its table row prints v0.3.0's layout
    assert price(row(445), ENTRIES).why_not == ("layout not that of Bridge v0.3.1 QWEN3_30B_A3B_PRETRAIN_CONFIG_H100_FP8_CS_V1 "
                                                "(pp 2 against 1, vp 12 against 1, ep 8 against 16)")
    rows = held_out()
    priced = [h for h in rows if h.result is not None]
    assert len(priced) == 23 and all(h.result.refused is None for h in priced)
    assert [h.label for h in rows if h.result is None] == ["mb-26.02.01-Qwen3_30B_a3B-fp8"]


def test_a_later_recipe_prices_its_own_layout_and_settings():
    # 26.06 Qwen3-30B-A3B (line 132) at the H100 FP8 recipe of Bridge v0.3.1 and later (v0.5.0 for 26.06): 16 GPUs as
    # EP 16 = DP 16, no pipeline, HybridEP (priced as DeepEP), no EP all-to-all overlap; GBS 1024 x 4096 tokens at
    # 8,826 tokens/s on each of 16 GPUs: 4,194,304 / 141,216 = 29.701 s a step
    h = price(row(132), ENTRIES)
    assert h.recipe == "Bridge v0.3.1 QWEN3_30B_A3B_PRETRAIN_CONFIG_H100_FP8_CS_V1"
    r = h.result.row
    assert r.measured_step_s == pytest.approx(29.701, abs=1e-3)
    assert {"plan.pp=1", "plan.vpp=1", "plan.ep=16", "plan.dp=16", "plan.mbs=1", "train.global_batch_size=1024"} \
        <= set(r.overrides)
    assert r.moe_dispatcher == "deepep" and not any("moe_a2a_overlap" in o for o in r.overrides)
    # the 26.02 run keeps the 25.11 layout (PP 2, VP 12, EP 8) and overlap, but dispatches with DeepEP (v0.3.0)
    v030 = price(row(530), ENTRIES)
    assert v030.recipe == "Bridge v0.3.0 QWEN3_30B_A3B_PRETRAIN_CONFIG_H100_FP8_CS_V1"
    assert v030.result.row.moe_dispatcher == "deepep"
    assert {"plan.pp=2", "plan.vpp=12", "plan.ep=8", "plan.moe_a2a_overlap=true"} <= set(v030.result.row.overrides)
    # a model whose recipe kept its settings is priced at the 25.11 one
    assert price(row(357), ENTRIES).recipe is None


def test_gpt_oss_recomputes_from_v030_only():
    # 25.11 (Bridge v0.2.0) set recompute_modules without the selective granularity: nothing was recomputed
    assert {"plan.recompute=none"} <= set(row_of(ENTRIES["mb-25.11-GPT_OSS_120B-bf16"]).overrides)
    assert not any(o.startswith("plan.recompute_modules") for o in row_of(ENTRIES["mb-25.11-GPT_OSS_120B-bf16"]).overrides)
    # 26.02 (v0.3.0 sets the granularity): the same layout, selective [layernorm, moe_act]; GBS 1280 x 4096 tokens at
    # 5,993 tokens/s on each of 64 GPUs: 5,242,880 / 383,552 = 13.669 s a step
    h = price(row(520), ENTRIES)
    assert h.recipe == "Bridge v0.3.0 GPT_OSS_120B_PRETRAIN_CONFIG_H100_BF16_V2" and h.result.recompute == "selective"
    assert {"plan.recompute=selective", "plan.recompute_modules=[layernorm,moe_act]", "plan.pp=4", "plan.ep=8",
            "plan.mbs=1"} <= set(h.result.row.overrides)
    assert h.result.row.measured_step_s == pytest.approx(13.669, abs=1e-3)


def test_a_model_without_a_2511_row_is_priced_at_its_own_recipe_with_another_rows_shape():
    # 26.06 Nemotron-3 Nano (line 156) at Bridge's H100 FP8 recipe (v0.3.1 on): 16 GPUs, TP 1, EP 8 (DP 16), MBS 1,
    # selective recompute of four modules, FP8 current scaling, the distributed optimizer; the hybrid's shape is the
    # AutoModel row's. GBS 1024 x 8192 tokens at 14,719 tokens/s on each of 16 GPUs: 8,388,608 / 235,504 = 35.620 s
    h = price(row(156), ENTRIES)
    assert h.recipe == "Bridge v0.3.1 NEMOTRON_3_NANO_PRETRAIN_CONFIG_H100_FP8_CS_V1"
    assert h.base == "automodel-Nemotron_V3_Nano_30B-8gpu-bf16"
    r = h.result.row
    assert r.source == "bridge" and r.optimizer == "megatron" and r.moe_dispatcher == "deepep"
    assert {"plan.tp=1", "plan.ep=8", "plan.dp=16", "plan.mbs=1", "plan.zero=1", "plan.recompute=selective",
            "plan.recompute_modules=[moe,layernorm,core_attn,moe_act]", "train.precision=fp8", "train.fp8_recipe=tensorwise",
            "model.seq_length=8192", "model.hybrid_layer_pattern=MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME"} \
        <= set(r.overrides)
    assert r.measured_step_s == pytest.approx(35.620, abs=1e-3)


def test_known_issue_marks_the_runs_it_degraded():
    # 26.02's notes: DeepEP not supported in that container; its Qwen3-30B-A3B recipe (v0.3.0) dispatches with
    # DeepEP, its Qwen3-235B-A22B and GPT-OSS recipes with the alltoall dispatcher
    assert "DeepEP is not supported in the NeMo 26.02 container" in price(row(530), ENTRIES).known_issue
    assert price(row(540), ENTRIES).known_issue is None and price(row(520), ENTRIES).known_issue is None
    # the DeepEP-priced Qwen3-30B runs of later releases are not marked
    assert price(row(348), ENTRIES).known_issue is None


def test_a_row_at_its_base_batch_is_priced_as_the_base():
    # the 25.11 Llama 3.1 405B row as if re-measured: the same layout, batch and throughput -> the same prediction
    # and measured step as the calibration bench gives that row itself
    base = ENTRIES["mb-25.11-LLAMA3.1_405B-fp8cs"]
    same = {**row(106), "gbs": base["gbs"], "mbs": base["mbs"], "tokens_per_sec_per_gpu": base["tokens_per_sec_per_gpu"]}
    h, own = price(same, ENTRIES), evaluate_row(row_of(base))
    assert h.result.estimate.step_time == pytest.approx(own.estimate.step_time, rel=1e-12)
    assert h.result.row.measured_step_s == pytest.approx(measured_step_time(base), rel=1e-12)
    assert h.result.row.id == "mb-26.06-LLAMA3.1_405B-fp8"


def test_script_writes_the_report(tmp_path, capsys):
    script = load_module(ROOT / "scripts" / "bench_held_out.py")
    assert script.main(["--out", str(tmp_path)]) == 0
    (report,) = tmp_path.glob("held_out_bridge_*.md")
    text = report.read_text()
    assert text.count("| mb-26.") == 23 and text.count("\n- mb-26.") == 1 + 1  # not priced; degraded
    assert text.count(" at Bridge v0.3.1 QWEN3_30B_A3B_PRETRAIN_CONFIG_H100_FP8_CS_V1 |") == 3
    assert text.count(" at Bridge v0.3.0 QWEN3_30B_A3B_PRETRAIN_CONFIG_H100_FP8_CS_V1 |") == 1
    assert text.count(" at Bridge v0.3.0 GPT_OSS_120B_PRETRAIN_CONFIG_H100_BF16_V2 |") == 4
    assert text.count(" at Bridge v0.3.1 NEMOTRON_3_NANO_PRETRAIN_CONFIG_H100_FP8_CS_V1 |") == 4
    assert "\n- mb-26.02-Qwen3_30B_a3B-fp8 (530): DeepEP is not supported" in text
    out = capsys.readouterr().out
    assert "summary: 23 rows" in out and "without the 1 row(s) their release's notes say ran degraded: 22 rows" in out
