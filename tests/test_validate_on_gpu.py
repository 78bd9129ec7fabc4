"""scripts/validate_on_gpu.sh --cpu-smoke: the GPU validation's every step at tiny size on this CPU
(profile, plan, evaluate, real megatron-core training under torchrun, the table, the shipped
cache), so that the script a GPU machine runs cannot rot. It runs the way a GPU node with no network
runs it: a Python that holds PyTorch but not nest-megatron, megatron-core or Hydra, given the wheels
scripts/offline_wheels.sh fetched."""

from __future__ import annotations

import datetime
import os
import re
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from nest_megatron import api
from nest_megatron.profile.cache import Cache

ROOT = Path(__file__).resolve().parents[1]
VALIDATE = ROOT / "scripts" / "validate_on_gpu.sh"
# What a PyTorch-only image lacks; the rest of this environment (torch, numpy, numba, rich, ...) it has.
NOT_ON_THE_NODE = ("nest_megatron", "megatron", "hydra", "omegaconf", "antlr4", "__editable__")


def bare_python(tmp_path: Path) -> Path:
    """A Python that sees this environment's packages except NOT_ON_THE_NODE (each entry linked one by one)."""
    base = tmp_path / "base-site"
    base.mkdir()
    for entry in Path(sysconfig.get_paths()["purelib"]).iterdir():
        if not entry.name.lower().startswith(NOT_ON_THE_NODE) and entry.suffix != ".pth":
            (base / entry.name).symlink_to(entry)
    venv = tmp_path / "bare"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    (Path(site) / "base.pth").write_text(f"{base}\n")
    return python


@pytest.mark.slow
def test_cpu_smoke_run_on_a_bare_python_with_offline_wheels(tmp_path):
    pytest.importorskip("megatron.core")
    python = bare_python(tmp_path)
    env = {**os.environ, "PYTHON": str(python)}
    env.pop("PYTHONPATH", None)
    absent = subprocess.run([str(python), "-c", "import megatron.core"], capture_output=True, text=True, env=env)
    assert "No module named 'megatron'" in absent.stderr  # the node really lacks it

    # Without the wheels: one line naming what is missing (nest_megatron itself comes from the checkout).
    done = subprocess.run(["bash", str(VALIDATE), "--cpu-smoke"], capture_output=True, text=True, env=env, timeout=300)
    assert (done.returncode, done.stderr.strip()) == (2, f"validate_on_gpu: error: megatron.core, hydra not importable by "
                                                         f"{python}; install them, or on a node with no network pass "
                                                         "--wheels DIR made by scripts/offline_wheels.sh")

    wheels = tmp_path / "wheels"  # fetched with this machine's network, for the node's (here: this) Python
    fetched = subprocess.run(["bash", str(ROOT / "scripts" / "offline_wheels.sh"), str(wheels)], capture_output=True,
                             text=True, env=env, timeout=600)
    assert fetched.returncode == 0, fetched.stderr[-2000:]
    names = sorted(w.name.split("-")[0] for w in wheels.glob("*.whl"))
    assert names == ["antlr4_python3_runtime", "hydra_core", "megatron_core", "nest_megatron", "omegaconf"]

    out = tmp_path / "out"
    done = subprocess.run(["bash", str(VALIDATE), "--cpu-smoke", "--wheels", str(wheels), "--out-dir", str(out)],
                          capture_output=True, text=True, env=env, timeout=900)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    table = out / f"{datetime.date.today().isoformat()}_cpu-smoke.md"
    cache = out / "cpu-smoke.json"
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
    log = table.with_suffix(".log")
    assert sorted(p.name for p in out.iterdir()) == sorted([table.name, cache.name, log.name])  # the working copy moved
    runs = re.findall(r"^== ([^:]+): ", log.read_text(), flags=re.M)
    assert runs == ["profile", *rows]  # every training's command and output, in the table's order

    # The table's prediction is what nest-megatron evaluate says for that configuration with that cache.
    problem = re.search(r"Model and cluster overrides: `([^`]*)`", text).group(1).split()
    plan = api.evaluate([*problem, "plan.mbs=1", "plan.recompute=none", "plan.zero=1", "plan.tp=1", "plan.pp=1",
                         f"cache={cache}"])
    # The table prints seconds to 4 decimals: equal within half of the last digit.
    assert float(rows["mbs1"][5]) == pytest.approx(plan.predicted["step_time_s"], abs=5.01e-5)


def test_the_smoke_run_writes_nothing_into_the_repo():
    done = subprocess.run(["bash", str(VALIDATE), "--cpu-smoke"], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHON": sys.executable})
    assert (done.returncode, done.stderr.strip()) == (2, "validate_on_gpu: error: --cpu-smoke needs --out-dir DIR for "
                                                         "its table and profile")


def test_without_a_gpu_it_says_so_in_one_line():
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: the real run applies")
    done = subprocess.run(["bash", str(VALIDATE)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHON": sys.executable})
    assert done.returncode == 2
    assert done.stderr.strip() == "validate_on_gpu: error: no CUDA device visible; run with --cpu-smoke for the CPU dry run"


@pytest.mark.slow
def test_a_failed_profile_still_predicts_with_the_roofline_and_ships_no_cache(tmp_path):
    pytest.importorskip("megatron.core")
    # A 2 s budget: profiling (half of it) is stopped, with its torchrun workers, and no training starts.
    done = subprocess.run(["bash", str(VALIDATE), "--cpu-smoke", "--budget-s", "2", "--out-dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHON": sys.executable})
    assert done.returncode == 1, done.stderr[-2000:]
    assert "nest-megatron profile did not finish in 1 s; predicting with the roofline alone" in done.stdout
    table = tmp_path / f"{datetime.date.today().isoformat()}_cpu-smoke.md"
    text = table.read_text()
    assert "Compute model: roofline with the shipped efficiencies (profile.use=false). Profiling failed: " in text
    rows = [line.split("|")[2:-1] for line in text.splitlines() if line.startswith("| mbs1")]
    assert rows and all(cells[5] == cells[6] and cells[12].strip() == "not run: time budget spent" for cells in rows)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([table.name, table.with_suffix(".log").name])
