"""Regenerate (or check) the outputs and tables the README and docs/guide.md show, from the tool as it is now.

Two kinds of generated block, each between an opening and an end marker:

    <!-- readme-output: nest-megatron plan cluster=dgx_h100_superpod -->
    ```text
    $ nest-megatron plan cluster=dgx_h100_superpod
    (what the command prints on stdout)
    ```
    <!-- end readme-output -->

    <!-- readme-include: docs/fidelity/published_2026-12-07.md "## Cross-validated" -->
    (the first table under that heading of that file)
    <!-- end readme-include -->

Commands run under bash in an empty temporary folder with this Python's bin directory first on
PATH, COLUMNS=100 (the tables' width) and XDG_CACHE_HOME=~/.cache written literally, so that the
profile cache's path reads the same on every machine (what a library caches under it lands in the
temporary folder). Their stderr (progress, the changed-flags list) is dropped unless the command
redirects it.

    python scripts/readme_outputs.py --write    # rewrite the blocks of README.md and docs/guide.md
    python scripts/readme_outputs.py --check    # exit 1 and show what differs
"""

from __future__ import annotations

import argparse
import difflib
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = [ROOT / "README.md", ROOT / "docs" / "guide.md"]
WIDTH = 100

OUTPUT_BLOCK = re.compile(r"<!-- readme-output: (?P<command>.+?) -->\n```text\n.*?```\n<!-- end readme-output -->",
                          re.S)
INCLUDE_BLOCK = re.compile(r'<!-- readme-include: (?P<path>\S+) "(?P<heading>[^"]+)" -->\n.*?'
                           r"<!-- end readme-include -->", re.S)
# What differs from run to run and machine to machine without the tool having changed.
# A time in a table cell takes the cell's padding with it: a slower search (11.2 s for 1.26 s) widens the number and
# narrows the padding, not the table.
VOLATILE = [(re.compile(r"\d+ configurations in [\d.]+ s *"), "N configurations in T s "),
            (re.compile(r"in [\d.]+ s\b *"), "in T s "),
            (re.compile(r"/\S*/bin/nest-megatron\b"), "/PATH/bin/nest-megatron")]  # where it is installed


def command_output(command: str) -> str:
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
           "COLUMNS": str(WIDTH), "XDG_CACHE_HOME": "~/.cache", "NO_COLOR": "1"}
    with tempfile.TemporaryDirectory(prefix="readme-outputs-") as folder:
        done = subprocess.run(["bash", "-c", command], cwd=folder, env=env, capture_output=True, text=True,
                              timeout=600)
    if done.returncode != 0:
        raise SystemExit(f"readme_outputs: `{command}` exited {done.returncode}: {done.stderr.strip()[-500:]}")
    return done.stdout


def table_under(path: Path, heading: str) -> str:
    """The first Markdown table after the line that starts with `heading`."""
    lines = path.read_text().splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith(heading)), None)
    if start is None:
        raise SystemExit(f"readme_outputs: {path.relative_to(ROOT)} has no heading {heading!r}")
    table = []
    for line in lines[start + 1:]:
        if line.startswith("|"):
            table.append(line)
        elif table:
            break
    return "\n".join(table) + "\n"


def generated(readme: str) -> str:
    """README text with every generated block replaced by what the tool prints now."""
    def output(match: re.Match) -> str:
        command = match["command"]
        return (f"<!-- readme-output: {command} -->\n```text\n$ {command}\n{command_output(command)}```\n"
                "<!-- end readme-output -->")

    def include(match: re.Match) -> str:
        return (f'<!-- readme-include: {match["path"]} "{match["heading"]}" -->\n'
                f'{table_under(ROOT / match["path"], match["heading"])}<!-- end readme-include -->')

    return INCLUDE_BLOCK.sub(include, OUTPUT_BLOCK.sub(output, readme))


def normalised(text: str) -> str:
    for pattern, replacement in VOLATILE:
        text = pattern.sub(replacement, text)
    return text


def stale_lines(text: str, name: str = "README.md") -> list[str]:
    """A unified diff of a document against its regenerated self (volatile numbers aside); empty when current."""
    now = generated(text)
    return list(difflib.unified_diff(normalised(text).splitlines(), normalised(now).splitlines(),
                                     name, f"{name} (regenerated)", lineterm=""))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", action="store_true", help="rewrite the documents' generated blocks")
    mode.add_argument("--check", action="store_true", help="exit 1 when a block differs from the tool's output")
    args = parser.parse_args(argv)
    stale = False
    for path in DOCUMENTS:
        name, text = str(path.relative_to(ROOT)), path.read_text()
        if args.write:
            path.write_text(generated(text))
            continue
        diff = stale_lines(text, name)
        print("\n".join(diff) or f"{name}: every generated block is current")
        stale = stale or bool(diff)
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
