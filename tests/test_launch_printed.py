"""The launch --dry-run's "Megatron arguments" block is the argv every node's command runs (issue 20 item 2), for
every launch the README shows (read from it) and a model=NAME launch: the README's example printed the plan's own
--max-position-embeddings 4096 while the command kept the user's 8192."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from nest_megatron import cli

README = Path(__file__).resolve().parents[1] / "README.md"


def readme_launches() -> list[list[str]]:
    """Every `nest-megatron launch` command of the README's sh blocks, as the shell would split it: continued lines
    joined, the block's VAR="..." assignments substituted for $VAR, --run-dir dropped (a dry run writes nothing)."""
    launches, variables, block = [], {}, None
    for line in README.read_text().splitlines():
        if line.startswith("```"):
            block = [] if line == "```sh" and block is None else None
            continue
        if block is None:
            continue
        if block and block[-1].endswith("\\"):
            block[-1] = block[-1][:-1] + " " + line.strip()
        else:
            block.append(line)
        if block[-1].endswith("\\"):
            continue
        words = shlex.split(block[-1])
        if len(words) == 1 and "=" in words[0] and words[0].split("=")[0].isupper():
            name, value = words[0].split("=", 1)
            variables[name] = value
        elif words[:2] == ["nest-megatron", "launch"]:
            words = [w for word in words for w in (shlex.split(variables[word[1:]]) if word.startswith("$") else [word])]
            if "--run-dir" in words:
                at = words.index("--run-dir")
                del words[at:at + 2]
            launches.append([w for w in words[2:] if w != "--dry-run"])
    return launches


EXAMPLES = {f"readme-{i}": argv for i, argv in enumerate(readme_launches())} | {
    # the model from model=NAME: its flags are added to the script's
    "named-model": ["model=llama3_70b", "cluster=dgx_h100_superpod", "cluster.num_devices=64", "--nnodes", "8",
                    "--nproc-per-node", "8", "--master-addr", "n1", "--", "pretrain_gpt.py", "--data-path",
                    "/data/corpus_text_document"],
}


def test_the_readme_launches_are_all_here():
    """The README's launch example and its calibrate loop's two launches (the tests run each as a dry run)."""
    launches = readme_launches()
    assert len(launches) == 3
    assert launches[0][:4] == ["cluster=dgx_h100_superpod", "--nnodes", "8", "--nproc-per-node"]
    assert "--max-position-embeddings" in launches[0] and all("$ARGS" not in a for a in launches)
    assert launches[1][-2:] == ["--lr", "3e-3"]  # $ARGS expanded


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
    block, _ = printed_and_launched(capsys, EXAMPLES["readme-0"])
    assert block[block.index("--max-position-embeddings") + 1] == "8192"
    assert block.count("--max-position-embeddings") == 1
