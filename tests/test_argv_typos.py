"""A misspelt Megatron flag is one line before anything is planned or started; a flag we do not know passes.

Megatron-LM parses with allow_abbrev=False and rejects an unknown flag, but only once the job has its nodes;
until then a misspelt planner or model flag would silently change the plan (`--untie-embedding-and-output-weights`
plans tied embeddings). None of Megatron-LM's real flags may be taken for a typo: the flags megatron-core's config
dataclasses give its parser (always), and every flag of a Megatron-LM checkout (with MEGATRON_LM_ROOT; see
tests/megatron_lm_flags.py).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from megatron_lm_flags import dataclass_flags, megatron_lm_flags

from nest_megatron import cli
from nest_megatron.config.megatron_argv import KNOWN_FLAGS, misspelt, model_values, scan
from nest_megatron.errors import NestError
from nest_megatron.launch.megatron_rules import violations

MEGATRON_LM_ROOT = os.environ.get("MEGATRON_LM_ROOT")
LAUNCH = ["launch", "cluster=dgx_h100_superpod", "cluster.num_devices=2", "--nproc-per-node", "2", "--dry-run", "--"]
MODEL = ["pretrain_gpt.py", "--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "8", "--seq-length",
         "128", "--vocab-size", "1024", "--bf16"]


@pytest.mark.parametrize("typo, meant", [
    ("--untie-embedding-and-output-weights", "--untie-embeddings-and-output-weights"),  # a letter missing
    ("--micro-batch-sise", "--micro-batch-size"),  # a letter wrong
    ("--global-batch-sizes", "--global-batch-size"),  # a letter too many
    ("--tensor-model-paralel-size", "--tensor-model-parallel-size"),
    ("--num-attention-head", "--num-attention-heads"),
    ("--hiden-size", "--hidden-size"),
    ("--moe-token-dispatcher-typ", "--moe-token-dispatcher-type"),
])
def test_a_typo_names_the_flag_it_resembles(typo, meant):
    assert misspelt(typo) == meant
    with pytest.raises(NestError) as err:
        scan(["--num-layers", "2", typo, "1"])
    assert str(err.value) == f"{typo}: not a Megatron flag; did you mean {meant}?"
    with pytest.raises(NestError) as err:
        scan([f"{typo}=1"])  # the --flag=value form too
    assert str(err.value) == f"{typo}: not a Megatron flag; did you mean {meant}?"


@pytest.mark.parametrize("flag", [
    "--log-interval", "--data-path", "--lr", "--train-iters", "--save", "--fp8-param-gather",
    "--fp8",  # one letter from --fp16 / --bf16 in edit distance, far in similarity: a short flag is never a typo
    "--no-bias-gelu-fusion",  # a real flag as close to --no-bias-swiglu-fusion as a typo would be
    "--no-masked-softmax-fusion",
    "--my-script-option",  # the training script's own
])
def test_a_flag_far_from_every_known_flag_passes(flag):
    assert misspelt(flag) is None
    s = scan(["--num-layers", "2", flag, "x", "--micro-batch-size", "2"])
    assert s.values == {"--num-layers": 2, "--micro-batch-size": 2}


def test_no_megatron_core_config_flag_is_taken_for_a_typo():
    # Megatron-LM's parser turns every field of these dataclasses into a flag.
    core = pytest.importorskip("megatron.core")
    root = Path(core.__file__).parent
    flags = set()
    for path in (root / "transformer" / "transformer_config.py", root / "model_parallel_config.py"):
        flags |= dataclass_flags(path.read_text())
    assert len(flags) > 250  # megatron-core 0.16.1: 285
    assert {flag: misspelt(flag) for flag in flags if misspelt(flag)} == {}


@pytest.mark.skipif(not MEGATRON_LM_ROOT, reason="MEGATRON_LM_ROOT is not set (a Megatron-LM checkout; it is not on PyPI)")
def test_no_real_megatron_lm_flag_is_taken_for_a_typo():
    flags = megatron_lm_flags(Path(MEGATRON_LM_ROOT))
    assert len(flags) > 900  # the sources are there (d98e8a6: 1,023 flags)
    assert {flag: misspelt(flag) for flag in flags if misspelt(flag)} == {}
    # and every flag this project reads is a real one; --moe-use-legacy-grouped-gemm is megatron-core 0.16.1's
    # Megatron-LM's (core_v0.16.1 arguments.py:1273, the legacy GroupedMLP the launch rules name), gone on main
    assert set(KNOWN_FLAGS) - flags <= {"--moe-use-legacy-grouped-gemm"}


@pytest.mark.parametrize("extra, typo, meant", [
    (["--untie-embedding-and-output-weights"], "--untie-embedding-and-output-weights",
     "--untie-embeddings-and-output-weights"),
    (["--micro-batch-sise", "2"], "--micro-batch-sise", "--micro-batch-size"),
])
def test_launch_with_a_typo_is_one_line_and_plans_nothing(capsys, extra, typo, meant):
    assert cli.main([*LAUNCH, *MODEL, *extra]) == 2
    captured = capsys.readouterr()
    assert captured.err == f"nest-megatron launch: error: {typo}: not a Megatron flag; did you mean {meant}?\n"
    assert captured.out == ""  # no plan printed


def test_launch_passes_flags_it_does_not_know(capsys):
    assert cli.main([*LAUNCH, *MODEL, "--log-interval", "10", "--data-path", "x"]) == 0
    command = capsys.readouterr().out.splitlines()[-1]
    assert " pretrain_gpt.py --num-layers 4 " in command and " --bf16 --log-interval 10 --data-path x " in command


@pytest.mark.parametrize("flag", ["--hybrid-layer-pattern", "--hybrid-override-pattern"])
def test_a_hybrid_mamba_pattern_is_planned_as_one(flag):
    """Reproduced: megatron-core 0.16.1's --hybrid-override-pattern (Megatron-LM core_v0.16.1 arguments.py:2828) was
    neither known nor refused, so a Mamba hybrid's argv was planned as a plain GPT stack; either spelling is the
    model's pattern now (tests/test_mamba_hybrid.py prices it)."""
    base = "--num-layers 4 --hidden-size 256 --num-attention-heads 16 --seq-length 128 --vocab-size 1024".split()
    assert model_values([*base, flag, "M*M*"])["hybrid_layer_pattern"] == "M*M*"


def test_a_hybrid_pattern_with_mtp_depths_is_read():
    # Megatron-LM main's unified pattern, the MTP depths after '/' (tests/test_hybrid_mtp.py prices them), and its older
    # --mtp-hybrid-override-pattern, a known flag
    scan(["--num-layers", "4", "--mtp-hybrid-override-pattern", "M*"])
    base = "--num-layers 4 --hidden-size 256 --num-attention-heads 16 --seq-length 128 --vocab-size 1024".split()
    argv = [*base, "--hybrid-layer-pattern", "M*M-/M*", "--mtp-num-layers", "1", "--micro-batch-size", "1"]
    assert violations(argv, world_size=1) == []
