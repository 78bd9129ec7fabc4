"""The README cannot go stale: its example outputs are what the tool prints now, its commands can be copied,
and its install and test lines are the ones CI runs."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
from script_module import load_module

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


readme_outputs = load_module(ROOT / "scripts" / "readme_outputs.py")


def fenced_blocks(text: str) -> list[tuple[str, str]]:
    """(language, body) of every fenced code block."""
    return re.findall(r"^```(\w*)\n(.*?)^```", text, flags=re.M | re.S)


@pytest.mark.slow
@pytest.mark.parametrize("path", readme_outputs.DOCUMENTS, ids=lambda p: p.name)
def test_every_generated_output_is_what_the_tool_prints_now(path):
    assert "<!-- readme-output: " in path.read_text()
    stale = readme_outputs.stale_lines(path.read_text(), path.name)
    assert stale == [], "stale: run `python scripts/readme_outputs.py --write`\n" + "\n".join(stale[:40])


def test_the_check_fails_on_a_changed_output():
    """The check itself can fail: one number of the NeMo example's output changed by hand."""
    block = re.search(r"<!-- readme-output: nest-megatron nemo .*?<!-- end readme-output -->", README, re.S)[0]
    tampered = block.replace("trainer.num_nodes=8", "trainer.num_nodes=9")
    assert tampered != block
    assert any(line.startswith("-trainer.num_nodes=9") for line in readme_outputs.stale_lines(tampered))


def test_the_volatile_numbers_are_the_only_ones_ignored():
    assert readme_outputs.normalised("dp: 1756 configurations in 1.74 s") == "dp: N configurations in T s "
    # in a table cell the padding goes with the time: 1.74 s and 11.74 s compare equal
    assert (readme_outputs.normalised("│ dp: 1756 configurations in 1.74 s    │")
            == readme_outputs.normalised("│ dp: 1756 configurations in 11.74 s   │"))
    assert readme_outputs.normalised("step time 15.393 s") == "step time 15.393 s"


def test_the_readme_is_a_start_not_a_manual():
    assert len(README.splitlines()) <= 250


def test_no_copyable_command_has_a_placeholder():
    commands = [body for language, body in fenced_blocks(README) if language != "text"]
    assert commands
    for body in commands:
        assert "..." not in body and "ARGS..." not in body, body


def test_the_install_line_names_every_package_ci_installs():
    wanted = {line.strip() for line in (ROOT / ".ci" / "apt-packages").read_text().splitlines()
              if line.strip() and not line.startswith("#")}
    apt = next(line for line in README.splitlines() if "apt-get install" in line)
    words = shlex.split(apt.split("apt-get install", 1)[1])
    assert {w for w in words if not w.startswith("-")} == wanted


def test_the_test_command_is_the_one_ci_runs():
    readme_test = next(line for line in README.splitlines() if "python -m pytest" in line)
    ci = (ROOT / ".ci" / "run").read_text()
    assert readme_test.strip() in ci


def test_the_fidelity_table_is_the_newest_report():
    newest = max((ROOT / "docs" / "fidelity").glob("published_*.md"))
    included = re.findall(r"<!-- readme-include: (\S+) ", README)
    assert included == [str(newest.relative_to(ROOT))]
    assert f"]({newest.relative_to(ROOT)})" in README  # and the link to it


def test_the_calibrate_loop_is_the_one_the_loop_test_runs():
    loop = load_module(ROOT / "tests" / "test_calibrate_loop.py")
    assert f'ARGS="{" ".join(loop.MODEL_ARGS)}"' in README
    for name, pins in loop.RUNS.items():
        launch = [line for line in README.splitlines() if line.startswith("nest-megatron launch")
                  and " ".join([*loop.CLUSTER, *pins, "--nproc-per-node", "2"]) in line]
        assert len(launch) == 1 and "-- scripts/pretrain_gpt.py $ARGS" in launch[0], name


def test_every_local_link_exists():
    for target in re.findall(r"\]\(([^)#\s]+)\)", README):
        if not target.startswith("http"):
            assert (ROOT / target).exists(), target
