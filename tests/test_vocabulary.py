"""The vocabulary the plan prices is the one that runs: the plan's argv sets the embedding's rows
(--padded-vocab-size), the Plan JSON says which tokenizer size it assumed, and a launch checks the user's tokenizer
flags against it (launch/vocabulary.py)."""

from __future__ import annotations

import pytest

from nest_megatron import api
from nest_megatron.config.megatron_argv import model_values, scan
from nest_megatron.errors import NestError
from nest_megatron.launch.devices import Devices
from nest_megatron.launch.prepare import prepare

DGX_64 = Devices(num_nodes=8, per_node=8, node_rank=0, master_addr="n1")
# llama3_8b at TP 4 and 64 GPUs, one configuration: what is tested is the vocabulary, not the search.
PINNED = ["model=llama3_8b", "cluster=dgx_h100_superpod", "cluster.num_devices=64", "plan.tp=4", "plan.pp=1",
          "plan.dp=16", "plan.mbs=1", "plan.zero=1", "plan.recompute=full"]
# 128,256 entries padded to a multiple of 128 x TP 4 = 512: ceil(128256 / 512) = 251 -> 251 x 512 = 128,512 rows.
ROWS_TP4 = 128_512


def flag(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None


def test_the_plan_s_argv_sets_the_rows_it_priced_and_its_json_says_the_tokenizer_it_assumed():
    plan = api.evaluate(PINNED)
    assert flag(plan.megatron_args, "--padded-vocab-size") == str(ROWS_TP4)
    assert plan.vocabulary == {"entries": 128_256, "make_vocab_size_divisible_by": 128, "padded_rows": ROWS_TP4}
    # At TP 8 the multiple is 1024: ceil(128256 / 1024) = 126 -> 129,024 rows.
    at_tp8 = api.evaluate([*PINNED, "plan.tp=8", "plan.dp=8"])
    assert flag(at_tp8.megatron_args, "--padded-vocab-size") == "129024"


def test_the_argv_read_back_prices_the_same_rows():
    """The plan's argv, read as a user's, is the same model: the same rows, so the same step time."""
    plan = api.evaluate(PINNED)
    read = model_values(scan(plan.megatron_args))
    assert read["padded_vocab_size"] == ROWS_TP4
    again = api.evaluate([*PINNED, f"model.padded_vocab_size={ROWS_TP4}"])
    assert again.predicted["step_time_s"] == plan.predicted["step_time_s"]
    # More rows cost more: the output layer's GEMM grows with them.
    wider = api.evaluate([*PINNED, f"model.padded_vocab_size={ROWS_TP4 + 4 * 512 * 100}"])
    assert wider.predicted["step_time_s"] > plan.predicted["step_time_s"]


def test_tp_must_divide_given_rows_and_rows_must_hold_the_tokenizer():
    # 128,258 = 2 x 64,129: TP 2 splits it, TP 4 does not (VocabParallelEmbedding divides the rows by TP).
    api.evaluate([*PINNED, "plan.tp=2", "plan.dp=32", "model.padded_vocab_size=128258"])
    with pytest.raises(NestError, match=r"plan.tp=4: must divide the embedding's rows, model.padded_vocab_size=128258"):
        api.evaluate([*PINNED, "model.padded_vocab_size=128258"])
    with pytest.raises(NestError, match=r"model.padded_vocab_size=100000 is below model.vocab_size=128256"):
        api.evaluate([*PINNED, "model.padded_vocab_size=100000"])


def launch_argv(script_args: list[str], overrides: list[str] = PINNED) -> tuple[list[str], list[str]]:
    prepared = prepare(overrides=list(overrides), script="pretrain_gpt.py", script_args=script_args, devices=DGX_64)
    return prepared.script_args, prepared.changes


def test_a_tokenizer_that_reads_vocab_size_is_given_the_planned_entries():
    """Megatron's NullTokenizer is as large as --vocab-size (its end-of-document id the last of them:
    megatron/core/tokenizers/text/libraries/null_tokenizer.py:18-19)."""
    argv, _ = launch_argv(["--tokenizer-type", "NullTokenizer", "--mock-data"])
    assert flag(argv, "--vocab-size") == "128256"
    assert flag(argv, "--padded-vocab-size") == str(ROWS_TP4)


def test_a_tokenizer_of_another_size_is_refused_in_one_line():
    with pytest.raises(NestError, match=r"tokenizer \(--tokenizer-type GPT2BPETokenizer\) has 50,257 entries but the "
                                        r"plan prices model.vocab_size=128,256: give model.vocab_size=50257"):
        launch_argv(["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", "v.json", "--merge-file", "m.txt"])
    # The rows are the model's shape: with model=NAME the plan sets them (model.padded_vocab_size to change them).
    with pytest.raises(NestError, match=r"--padded-vocab-size without --num-layers: give the whole model"):
        launch_argv(["--padded-vocab-size", "131072"])


def test_a_tokenizer_of_unknown_size_runs_the_planned_rows_and_is_said_before_launch():
    # A Hugging Face tokenizer by hub name: its size is not on this machine.
    argv, changes = launch_argv(["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", "meta-llama/Llama-3.1-8B"])
    assert flag(argv, "--padded-vocab-size") == str(ROWS_TP4) and "--vocab-size" not in argv
    assert any(line.startswith(f"--padded-vocab-size: {ROWS_TP4} rows for the 128,256 entries") for line in changes)

    # The model from the argv, its vocabulary from model.vocab_size: the launch adds the rows it priced,
    # 32,000 padded to a multiple of 128 x TP 4 = 512: ceil(32000 / 512) = 63 -> 32,256.
    model = ("--num-layers 4 --hidden-size 1024 --num-attention-heads 16 --seq-length 2048 --max-position-embeddings "
             "2048 --bf16 --tokenizer-type SentencePieceTokenizer --tokenizer-model tok.model").split()
    overrides = ["cluster=dgx_h100_superpod", "cluster.num_devices=64", "model.vocab_size=32000", "plan.tp=4",
                 "plan.pp=1", "plan.dp=16"]
    argv, changes = launch_argv(model, overrides)
    assert flag(argv, "--padded-vocab-size") == "32256"
    assert any(line.startswith("--padded-vocab-size: 32256 rows for the 32,000 entries") for line in changes)
