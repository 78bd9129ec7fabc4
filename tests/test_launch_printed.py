"""The launch --dry-run's "Megatron arguments" block is the argv every node's command runs (issue 20 item 2): the
README's example printed the plan's own --max-position-embeddings 4096 while the command kept the user's 8192."""

from __future__ import annotations

import shlex

import pytest

from nest_megatron import cli

LLAMA_70B = ["--num-layers", "80", "--hidden-size", "8192", "--ffn-hidden-size", "28672", "--num-attention-heads", "64",
             "--group-query-attention", "--num-query-groups", "8", "--seq-length", "4096",
             "--max-position-embeddings", "8192", "--vocab-size", "128256", "--swiglu", "--normalization", "RMSNorm",
             "--untie-embeddings-and-output-weights", "--position-embedding-type", "rope", "--disable-bias-linear",
             "--bf16", "--global-batch-size", "1024", "--tensor-model-parallel-size", "8", "--micro-batch-size", "1",
             "--lr", "3e-4", "--data-path", "/data/corpus_text_document"]
EXAMPLES = {
    # README's first launch example, its `...` given
    "argv-model": ["cluster=dgx_h100_superpod", "--nnodes", "8", "--nproc-per-node", "8", "--master-addr", "n1",
                   "--", "pretrain_gpt.py", *LLAMA_70B],
    # the model from model=NAME: its flags are added to the script's
    "named-model": ["model=llama3_70b", "cluster=dgx_h100_superpod", "cluster.num_devices=64", "--nnodes", "8",
                    "--nproc-per-node", "8", "--master-addr", "n1", "--", "pretrain_gpt.py", "--data-path",
                    "/data/corpus_text_document"],
    # README's CPU example (scripts/pretrain_gpt.py)
    "tiny": ["cluster=dgx_h100_superpod", "cluster.levels.0.fan_out=2", "plan.pp=2", "--nproc-per-node", "2", "--",
             "scripts/pretrain_gpt.py", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
             "--seq-length", "32", "--max-position-embeddings", "32", "--vocab-size", "128", "--micro-batch-size", "2",
             "--global-batch-size", "8", "--bf16", "--train-iters", "6", "--lr", "3e-3"],
}


def printed_and_launched(capsys, argv: list[str]) -> tuple[list[str], list[list[str]]]:
    """(the printed block's argv, each printed command's argv after the script) of `launch --dry-run argv`."""
    assert cli.main(["launch", "--dry-run", *argv]) == 0
    lines = capsys.readouterr().out.splitlines()
    block = shlex.split(lines[lines.index("Megatron arguments:") + 1])
    script = argv[argv.index("--") + 1]
    commands = [shlex.split(line) for line in lines if f" {script} " in line and "torchrun" in line]
    return block, [c[c.index(script) + 1:] for c in commands]


@pytest.mark.parametrize("name", list(EXAMPLES))
def test_printed_block_is_what_every_node_runs(capsys, name):
    block, commands = printed_and_launched(capsys, EXAMPLES[name])
    assert commands, "no command printed"
    assert all(c == block for c in commands)


def test_the_users_max_position_embeddings_is_printed(capsys):
    """The user's 8192 stays (a planner flag it is not), in the block as in the command."""
    block, _ = printed_and_launched(capsys, EXAMPLES["argv-model"])
    assert block[block.index("--max-position-embeddings") + 1] == "8192"
    assert block.count("--max-position-embeddings") == 1
