"""The calibration set as `evaluate` reads it (nest_megatron/fidelity/): the measured step times, the
sources' FLOP conventions, the overrides of every row, and that the memory model never refuses a
layout that ran. The accuracy itself is measured by scripts/bench_published.py, not asserted here.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from script_module import load_module

from nest_megatron.cli import main
from nest_megatron.config.load import load
from nest_megatron.errors import NestError
from nest_megatron.fidelity.bench import evaluate_row
from nest_megatron.fidelity.published import (
    convention_flops_per_token,
    implied_gflops_per_token,
    is_nemo_era,
    load_entries,
    measured_step_time,
    row_of,
)

ENTRIES = {e["id"]: e for e in load_entries()}
ROOT = Path(__file__).resolve().parents[1]


def test_measured_step_time_from_tokens_per_second():
    # GPT-3 175B, launcher 24.01: 2,048 x 2,048 tokens a step at 741 tokens/s on each of 512 GPUs
    assert measured_step_time(ENTRIES["launcher-24.01-GPT3-175B-fp8"]) == pytest.approx(2048 * 2048 / (741 * 512))
    assert 11.05 < 2048 * 2048 / (741 * 512) < 11.06  # the file's derived time_per_step_s: 11.055


def test_nemo_flop_convention_matches_the_rows_own_numbers():
    """Where a NeMo-era row gives both tokens/s and TFLOP/s, their ratio is its GFLOP per token; the
    convention formula (full attention, 6 x the GEMM weights incl. the output layer) reproduces it."""
    checked, off = 0, {}
    for entry in ENTRIES.values():
        implied = implied_gflops_per_token(entry)
        if implied is None or not is_nemo_era(entry) or entry["model_shape"].get("experts"):
            continue
        ratio = convention_flops_per_token(entry) / 1e9 / implied
        checked += 1
        if abs(ratio - 1) > 0.005:
            off[entry["id"]] = ratio
    assert checked >= 30
    # The one exception disagrees with its own siblings: 746 TFLOP/s / 23,574 tokens/s = 31.65 GFLOP/token
    # where the same GPT-3 5B at the same sequence gives 32.64-32.68 in every other release.
    assert set(off) == {"launcher-24.03-GPT3-5B-fp8"}


def test_llama2_7b_convention_by_hand():
    # 32 layers of h 4096 (MHA), SwiGLU ffn 11,008, s 4,096, vocab 32,000:
    # 6 x (4 h^2 + 3 h ffn) + 12 s h per layer = 6 x (67,108,864 + 135,266,304) + 201,326,592 = 1,415,577,600
    # x 32 = 45,298,483,200, + 6 h V = 786,432,000 -> 46.08 GFLOP per token (the row: 694 / 15,066 = 46.06)
    assert convention_flops_per_token(ENTRIES["launcher-24.01-LLAMA2-7B-fp8"]) == 46_084_915_200


def test_rows_carry_the_recipe_settings():
    row = row_of(ENTRIES["launcher-24.01-LLAMA2-70B-fp8"])
    assert "plan.vpp=20" in row.overrides  # launcher conf llama2_70b.yaml at 24.01; the table's pp 4 is its
    assert "train.precision=fp8" in row.overrides and "train.tp_comm_overlap=true" in row.overrides
    assert "train.grad_reduce_in_bf16=false" in row.overrides  # grad_sync_dtype=bf16 came in April 2024
    later = row_of(ENTRIES["nemo-24.07-LLAMA2-70B-64gpu-fp8"])
    assert "train.grad_reduce_in_bf16=true" in later.overrides
    # AutoModel's FSDP2 inside pipeline stages: a stage gathers once, reduces once a step (ZeRO 1's traffic), its
    # gradient accumulation separate pipeline schedules: global batch / (local batch 8 x DP) of them, 512 / (8 x 64) = 1,
    # 512 / (8 x 32) = 2 (Kimi K2), 8,192 / (8 x 256) = 4; 61 layers over pp x vp = 32 stages: 61 // 32 = 1 each and
    # one more on the first 61 % 32 = 29
    split = "plan.layers_per_stage=[" + ",".join(["2"] * 29 + ["1"] * 3) + "]"
    for row_id, runs in (("automodel-DeepSeek_V3_671B-256gpu-bf16", 1), ("automodel-Kimi_K2-256gpu-bf16", 2),
                         ("automodel-DeepSeek_V3_671B-1024gpu-bf16", 4)):
        row = row_of(ENTRIES[row_id])
        assert row.not_expressible is None and row.pipeline_runs == runs and row.optimizer == "automodel"
        assert {"plan.zero=1", split} <= set(row.overrides)
    # Nemotron-3 Nano: the hybrid of its note and its recipe (ep 8 by the row, full recompute, the bf16 model's state)
    nano = row_of(ENTRIES["automodel-Nemotron_V3_Nano_30B-8gpu-bf16"])
    assert nano.not_expressible is None and nano.optimizer == "automodel"
    assert "model.hybrid_layer_pattern=MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME" in nano.overrides
    assert {"plan.ep=8", "plan.recompute=full", "plan.zero=3", "model.mamba_num_groups=8"} <= set(nano.overrides)


def test_nemotron3_super_row_is_the_shipped_model_at_its_automodel_config():
    """The table gives no shape: the row is hydra_configs/model/nemotron3_super.yaml (AutoModel's FLOP-test config) at
    the row's 4,096 tokens, with its config's settings (nemotron_super_v3_te_deepep.yaml at 36044ad3): EP 64 under FSDP2
    of 64 (ZeRO 3), activation_checkpointing (full recompute), fp32_upcast false (the fused loss), HybridEP behind the
    fake balanced gate (priced as DeepEP). Measured: 512 x 4,096 tokens at 4,497 tokens/s on each of 64 GPUs."""
    entry = ENTRIES["automodel-Nemotron_V3_Super_120B-64gpu-bf16"]
    row = row_of(entry)
    assert row.not_expressible is None and row.moe
    assert row.overrides[:4] == ["model=nemotron3_super", "cluster=dgx_h100_superpod", "cluster.num_devices=64",
                                 "model.seq_length=4096"]
    for key in ("plan.ep=64", "plan.dp=64", "plan.tp=1", "plan.pp=1", "plan.mbs=2", "plan.zero=3", "plan.recompute=full",
                "train.cross_entropy_fusion=true", "train.global_batch_size=512"):
        assert key in row.overrides, key
    assert (row.moe_dispatcher, row.moe_router, row.moe_permute_fusion) == ("deepep", "fake_balanced", True)
    assert row.measured_step_s == pytest.approx(512 * 4096 / (4497 * 64)) == pytest.approx(7.2866, abs=1e-4)
    # Megatron's count of the model (no router) at 4,096 tokens: 74.57 GFLOP a token, within 0.5 % of the row's own
    # 334 TFLOP/s / 4,497 tokens/s = 74.27 (AutoModel's nemotronh_flops, which counts the router, gives 75.07)
    from nest_megatron.cost.flops import megatron_model_flops

    model = load(row.overrides[:4]).problem.model
    per_token = megatron_model_flops(model, batch_size=1, tp=1) / 4096
    assert per_token / 1e9 == pytest.approx(implied_gflops_per_token(entry), rel=0.005)


def test_a_row_is_an_evaluate_command(capsys):
    row = row_of(ENTRIES["nemo-24.07-LLAMA3-8B-8gpu-fp8"])
    assert main(["evaluate", *row.overrides, "--json"]) == 0
    out = capsys.readouterr().out
    assert '"tp": 1' in out and '"cp": 2' in out and "--fp8-format" in out


@pytest.mark.slow
def test_no_published_layout_is_refused_as_out_of_memory(tmp_path):
    """Every one of these runs ran on 80 GB H100s: the memory model must let each layout fit, at
    its stated recomputation or, where the row only has its recipe's default, the least that fits.
    The bench script reports the same and writes its table and figure."""
    bench = load_module(ROOT / "scripts" / "bench_published.py")
    assert bench.main(["--out", str(tmp_path)]) == 0
    (table,) = tmp_path.glob("published_*.md")
    text = table.read_text()
    assert "- published layouts refused as out of memory: 0" in text
    # every one of the 76 rows priced (Nemotron-3 Ultra with its shape recovered: hydra_configs/model/nemotron3_ultra.yaml)
    assert "| all | 76 |" in text
    assert len(list(tmp_path.glob("published_*.png"))) == 1


def test_rows_take_their_recipe_layout_where_the_table_does_not_give_the_run_s():
    # Nemotron-22B BF16: the table of cb3482d0 gives 16 GPUs and GBS 32 only; its recipe
    # nemotron_22b_bf16.sh runs 2 nodes at MBS 1 with the conf's TP 2 PP 4 VP 10: DP = 16 / 8 = 2. Its FP8
    # sibling's TFLOP/s came from the same table and the same recipe (nemotron_22b_fp8.sh).
    for row in (row_of(ENTRIES["launcher-24.01-Nemotron-22B-bf16"]), row_of(ENTRIES["launcher-24.01-Nemotron-22B-fp8"])):
        for key in ("plan.tp=2", "plan.pp=4", "plan.vpp=10", "plan.dp=2", "plan.mbs=1", "plan.sp=true"):
            assert key in row.overrides
    # LLAMA2-13B FP8 of 81b75a7c: the conf of that commit (TP 1 PP 4 VP 10, no userbuffers), DP = 16 / 4 = 4
    row = row_of(ENTRIES["launcher-24.03-LLAMA2-13B-fp8"])
    for key in ("plan.tp=1", "plan.pp=4", "plan.vpp=10", "plan.dp=4", "plan.sp=false", "train.tp_comm_overlap=false"):
        assert key in row.overrides
    # the measured time is the table's: 128 x 4,096 tokens at 8,317 tokens/s on each of 16 GPUs = 3.940 s
    assert row.measured_step_s == pytest.approx(128 * 4096 / (8317 * 16))


def test_nemo_rows_keep_apex_optimizer_state_and_the_340b_its_bf16_state():
    # distributed_fused_adam in every launcher conf; nemotron_340b.yaml at 24.07 also optim.dtype: bf16
    assert row_of(ENTRIES["launcher-24.01-LLAMA2-7B-fp8"]).optimizer == "apex_remainders"
    assert row_of(ENTRIES["nemo-24.07-Nemotron-340B-128gpu-fp8"]).optimizer == "apex_bf16"
    # torch.optim.Adam on AutoModel's bf16 model: bf16 moments, no master (published.py OPTIMIZERS)
    assert row_of(ENTRIES["automodel-Llama3_70B-64gpu-bf16"]).optimizer == "automodel"
    # the long-sequence rows ran NeMo 24.03.01, whose LLAMA2 recipes reduce gradients in bf16
    assert "train.grad_reduce_in_bf16=true" in row_of(ENTRIES["nemo-longseq-24.03-LLAMA2-7B-4k-fp8"]).overrides


def test_automodel_moe_rows_dispatch_with_deepep_behind_the_fake_balanced_gate():
    # configs at 89e3a9fdd (the commit that published these rows): enable_deepep, fake_balanced_gate, and
    # activation_checkpointing true for Qwen3-30B and GPT-OSS-20B (false for GPT-OSS-120B)
    for name in ("automodel-Qwen3_MoE_30B-8gpu-bf16", "automodel-GPT-OSS_20B-8gpu-bf16", "automodel-GPT-OSS_120B-64gpu-bf16"):
        row = row_of(ENTRIES[name])
        assert (row.moe_dispatcher, row.moe_router, row.moe_permute_fusion) == ("deepep", "fake_balanced", True)
    assert "plan.recompute=full" in row_of(ENTRIES["automodel-GPT-OSS_20B-8gpu-bf16"]).overrides
    assert "plan.recompute=none" in row_of(ENTRIES["automodel-GPT-OSS_120B-64gpu-bf16"]).overrides
    mixtral = row_of(ENTRIES["launcher-24.05-MIXTRAL-8x7B-bf16-draft"])  # Megatron's alltoall, a learned router
    assert (mixtral.moe_dispatcher, mixtral.moe_router, mixtral.moe_permute_fusion) == ("alltoall", "learned", False)
    # the 8x3B conf names no dispatcher: megatron-core 0.7's default, allgather
    assert row_of(ENTRIES["launcher-24.05-MIXTRAL-8x3B-bf16-draft"]).moe_dispatcher == "allgather"


def test_bridge_rows_take_their_recipes_uneven_splits():
    """Megatron-Bridge's Llama 3.1 405B counts the embedding and the loss as layers (recipes/llama/llama31_405b.py
    :47-48 at v0.1.0rc4): 126 + 2 = 128 slots over 8 x 8 chunks of 2, so chunk 0 holds 1 layer beside the
    embedding, the last chunk 1 beside the loss, every other one 2; the measured step is 512 x 8,192 tokens at 302
    tokens/s on each of 1,024 GPUs = 13.563 s."""
    row = row_of(ENTRIES["mb-25.09-LLAMA3.1_405B-fp8"])
    for key in ("plan.account_for_embedding_in_pipeline_split=true", "plan.account_for_loss_in_pipeline_split=true",
                "plan.pp=8", "plan.vpp=8", "plan.cp=2", "train.fp8_recipe=tensorwise", "train.grad_reduce_in_bf16=true"):
        assert key in row.overrides
    assert row.measured_step_s == pytest.approx(512 * 8192 / (302 * 1024))
    result = evaluate_row(row)
    assert result.refused is None
    assert result.estimate.layers_per_stage == (1, *[2] * 62, 1)


def test_deepseek_v3_bridge_row_runs_its_layout_with_the_mtp_depth():
    """run_script.py:66 at v0.1.0rc4: 'Et|(tt|)*30mL' at PP 8 x VP 4: 32 stages, the first with the embedding and 1
    layer, 30 of 2 layers, the last with the MTP depth and the loss and no decoder layer: 1 + 60 = 61 layers."""
    row = row_of(ENTRIES["mb-25.09-DeepSeekV3-fp8cs"])
    for key in ("model.multi_latent_attention=true", "model.q_lora_rank=1536", "model.kv_lora_rank=512",
                "model.mtp_num_layers=1", "model.moe_router_num_groups=8", "model.moe_router_group_topk=4",
                "plan.pipeline_model_parallel_layout='Et|(tt|)*30mL'", "model.num_query_groups=null"):
        assert key in row.overrides
    assert "model.moe_layer_freq=[0,0,0," + ",".join(["1"] * 58) + "]" in row.overrides  # first 3 layers dense
    assert (row.moe_dispatcher, row.moe_router, row.moe_permute_fusion) == ("deepep", "learned", True)
    result = evaluate_row(row)
    assert result.refused is None
    assert result.estimate.layers_per_stage == (1, *[2] * 30, 0)
    # the blockwise variant prints only TFLOP/s: 1,297 tokens/s x 330 / 338 = 1,266, 8,192 x 4,096 tokens a step
    blockwise = row_of(ENTRIES["mb-25.09-DeepSeekV3-fp8blockwise"])
    assert blockwise.measured_step_s == pytest.approx(8192 * 4096 / (1266 * 1024))
    assert "train.fp8_recipe=blockwise" in blockwise.overrides and "train.tp_comm_overlap=false" in blockwise.overrides


def test_a_layout_with_an_mtp_layer_needs_the_model_s_mtp_depth():
    row = row_of(ENTRIES["mb-25.09-DeepSeekV3-fp8cs"])
    without = [o for o in row.overrides if o != "model.mtp_num_layers=1"]
    with pytest.raises(NestError, match="1 MTP layers .m., but the model has no multi-token prediction layers"):
        load(without)
    load(row.overrides)  # the same layout with the model's one MTP depth builds


def test_fit_script_leaves_a_row_out_and_judges_the_fit_on_the_held_out_runs(capsys):
    """`scripts/fit_calibration.py --exclude ROW` fits the other rows and still prices and reports all 76; every fit
    is also judged on Megatron-Bridge's later runs, which no fit sees. The held-out line at the shipped constants is
    the summary scripts/bench_held_out.py prints by its own pricing (evaluate_row of each row, not a fitted Run)."""
    from nest_megatron.calibration.fit import fit, nominal_priors
    from nest_megatron.fidelity.bench import SHIPPED_FIT, as_runs, summarise
    from nest_megatron.fidelity.held_out import held_out
    from nest_megatron.fidelity.published import rows

    script = load_module(ROOT / "scripts" / "fit_calibration.py")
    left_out = "mb-25.11-Qwen3_30B_a3B-fp8cs"
    assert script.main(["--no-cross-validation", "--exclude", left_out]) == 0
    out = capsys.readouterr().out
    assert f"the fit leaves out {left_out}" in out
    assert "# the fit, in sample:           76 runs:" in out
    # the fit is that of the 75 other rows, each candidate from its nominal prior
    others = [run for run in as_runs([evaluate_row(row) for row in rows()]) if run.label != left_out]
    assert len(others) == 75
    alone = fit(others, prior=nominal_priors(others, list(SHIPPED_FIT)), only=list(SHIPPED_FIT))
    assert f"memory_bound_efficiency: {alone.values['memory_bound_efficiency']:.4g} " in out
    sound = summarise([h.result for h in held_out() if h.result is not None and not h.known_issue])
    shipped = out.split("# held out")[1].split("shipped constants ")[1]
    assert shipped.startswith(f"{sound.rows} runs: median |error| {sound.median_abs_error:.1%}, bias {sound.bias:+.1%}, "
                              f"worst {sound.max_abs_error:.1%}")


def test_fit_script_refuses_a_row_it_does_not_price_in_one_line(capsys):
    script = load_module(ROOT / "scripts" / "fit_calibration.py")
    assert script.main(["--no-cross-validation", "--exclude", "mb-25.11-Qwen3_30B"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: --exclude mb-25.11-Qwen3_30B: no such priced row of h100_published.yaml (the row ids of "
                   "docs/fidelity/published_*.md)"]
