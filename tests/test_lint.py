"""ruff (pyflakes + import order) over the project: unused names and imports fail the suite."""

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(shutil.which("ruff") is None, reason="ruff is installed with the [dev] extra")
def test_ruff_is_clean():
    result = subprocess.run(["ruff", "check", "nest_megatron", "tests", "scripts"], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
