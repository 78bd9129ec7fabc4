"""scripts/validate_on_gpu.sh --cpu-smoke: the GPU validation's every step at tiny size on this CPU
(profile, plan, evaluate, real megatron-core training under torchrun, the table, the shipped
cache), so that the script a GPU machine runs cannot rot."""

from __future__ import annotations

import datetime
import re
import subprocess
from pathlib import Path

import pytest

from nest_megatron import api
from nest_megatron.profile.cache import Cache

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_cpu_smoke_run_writes_the_table_and_the_profile_cache(tmp_path):
    pytest.importorskip("megatron.core")
    done = subprocess.run(["bash", str(ROOT / "scripts" / "validate_on_gpu.sh"), "--cpu-smoke", "--out-dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    table = tmp_path / "docs" / "validation" / f"{datetime.date.today().isoformat()}_cpu-smoke.md"
    cache = tmp_path / "data" / "profiles" / "cpu-smoke.json"
    text = table.read_text()
    assert text.startswith("# Validation on 1 x cpu (CPU smoke run, not a record)")
    assert "Compute model: fitted from" in text
    rows = {line.split("|")[1].strip(): [cell.strip() for cell in line.split("|")[2:-1]]
            for line in text.splitlines() if line.startswith("| ") and not line.startswith("| configuration")}
    assert {"mbs1", "mbs1 selective"} <= set(rows) and len(rows) in (2, 3)
    for cells in rows.values():
        # TP PP DP mbs recompute | step: profile roofline measured error | memory: predicted allocated error | note
        measured = float(cells[7])  # a real training ran
        assert measured > 0 and re.fullmatch(r"[+-]\d+\.\d%", cells[8])
        assert cells[10] == "-"  # no CUDA memory on a CPU
    entries = Cache.load(cache).entries.values()
    assert {e.kind for e in entries} >= {"gemm", "memory", "attention", "dense", "embedding", "output"}
    assert not list(cache.parent.glob(".*profiling*"))  # the working copy was moved, not left behind

    # The table's prediction is what nest-megatron evaluate says for that configuration with that cache.
    problem = re.search(r"Model and cluster overrides: `([^`]*)`", text).group(1).split()
    plan = api.evaluate([*problem, "plan.mbs=1", "plan.recompute=none", "plan.zero=1", "plan.tp=1", "plan.pp=1",
                         f"cache={cache}"])
    assert float(rows["mbs1"][5]) == pytest.approx(plan.predicted["step_time_s"], rel=1e-3)


def test_without_a_gpu_it_says_so_in_one_line():
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: the real run applies")
    done = subprocess.run(["bash", str(ROOT / "scripts" / "validate_on_gpu.sh")], capture_output=True, text=True, timeout=300)
    assert done.returncode == 2
    assert done.stderr.strip() == "validate_on_gpu: error: no CUDA device visible; run with --cpu-smoke for the CPU dry run"
