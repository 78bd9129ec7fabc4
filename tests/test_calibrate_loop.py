"""The loop on CPU: plan -> launch (torchrun on gloo, scripts/pretrain_gpt.py, a tiny GPT) -> calibrate -> plan.

Two short real runs (pipeline 2, then tensor parallel 2) write their run directories; their logs, as pretrain_gpt.py
prints them in Megatron-LM's formats and torchrun tees them, are read back and each run is rebuilt as its plan
said; calibrating the two fits a profile that the next plan is priced with, and says so. The loop is the point
here, not the values: the "GPU" is an H100 with a 1 TFLOP/s peak, so that the CPU's step times (40-100 ms, more
under load) are GEMM-bound in the model and fit the GEMM efficiency; priced at the H100's own peak they are 30x the
prediction, the host overhead alone can take that, and it runs into its 500 µs bound when the machine is busy.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from nest_megatron import cli
from nest_megatron.calibration.logs import read
from nest_megatron.calibration.runs import read_run, rebuild

ROOT = Path(__file__).resolve().parents[1]
CLUSTER = ["cluster=dgx_h100_superpod", "cluster.levels.0.fan_out=2", "accelerator.peak_bf16_tflops=1.0"]  # see above
MODEL_ARGS = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
              "--max-position-embeddings", "32", "--vocab-size", "128", "--global-batch-size", "8", "--bf16",
              "--micro-batch-size", "2", "--train-iters", "4", "--lr", "3e-3"]
RUNS = {"pp2": ["plan.pp=2"], "tp2": ["plan.tp=2", "plan.sp=false"]}
pytestmark = pytest.mark.slow


def launch(pins: list[str], run_dir: Path) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "nest_megatron.cli", "launch", *CLUSTER, *pins, "--nproc-per-node", "2",
           "--run-dir", str(run_dir), "--", "scripts/pretrain_gpt.py", *MODEL_ARGS]
    proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


@pytest.fixture(scope="module")
def run_dirs(tmp_path_factory) -> dict[str, tuple[Path, str]]:
    """name -> (its run directory, the launch's console output)."""
    base = tmp_path_factory.mktemp("runs")
    out = {}
    for name, pins in RUNS.items():
        done = launch(pins, base / name)
        assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
        out[name] = (base / name, done.stdout + done.stderr)
    return out


def test_the_launch_writes_a_run_directory(run_dirs):
    folder, console = run_dirs["pp2"]
    run = json.loads((folder / "run.json").read_text())
    plan = json.loads((folder / "plan.json").read_text())
    assert run["plan_digest"] in console and f"run directory {folder}" in console
    assert run["script_args"][:2] == ["--num-layers", "2"] and "--pipeline-model-parallel-size" in run["script_args"]
    logs = sorted(folder.glob("logs/node0/*/attempt_0/*/stdout.log"))
    assert [p.parent.name for p in logs] == ["0", "1"]  # each local rank's output, teed
    assert "------------------------ arguments ------------------------" in logs[0].read_text()
    assert "elapsed time per iteration (ms)" in logs[1].read_text()  # the last rank logs the iterations
    assert plan["parallel"]["pp"] == 2


@pytest.mark.parametrize("name", list(RUNS))
def test_pretrain_gpt_logs_on_gloo_rebuild_the_run_exactly(run_dirs, name, tmp_path):
    folder, console = run_dirs[name]
    plan = json.loads((folder / "plan.json").read_text())
    # the console, as torchrun --tee prefixes each rank's lines ([default0]:, [default1]:), and the run directory
    captured = tmp_path / "console.log"
    captured.write_text(console)
    cluster = [o for o in plan["overrides"] if o.startswith("cluster")]
    for rebuilt in (read_run(str(folder), user=[], label=name), rebuild(read(captured), user=cluster, label=name)):
        c, p = rebuilt.config, plan["parallel"]
        assert (c.tp, c.pp, c.dp, c.cp, c.ep, c.vpp, c.sp) == (p["tp"], p["pp"], p["dp"], p["cp"], p["ep"], p["vpp"], p["sp"])
        assert (c.mbs, c.zero, c.recompute, c.order) == (plan["micro_batch_size"], plan["zero_stage"],
                                                         plan["recompute"]["granularity"] or "none", plan["rank_order"])
        m = rebuilt.loaded.config.model
        # the launch line's model: 2 layers of 64 wide, 4 heads, 32 tokens, 128 words, the default 4h MLP; the local
        # layer spec pretrain_gpt.py builds (unfused attention)
        assert (m.num_layers, m.hidden_size, m.num_attention_heads, m.seq_length, m.vocab_size, m.ffn_hidden_size,
                m.attention_backend) == (2, 64, 4, 32, 128, 256, "unfused")
        assert rebuilt.loaded.problem.global_batch_size == 8 and rebuilt.loaded.problem.num_devices == 2
        assert len(rebuilt.log.iterations) == 4


def test_plan_launch_calibrate_plan(run_dirs, tmp_path, capsys):
    """The loop: a plan priced by the shipped calibration; the launches (the fixture) run it; calibrate fits their
    logs; the next plan of the same problem is priced with the profile and says so."""
    planning = [*CLUSTER, "model=tiny_gpt", "cluster.num_devices=2", "train.global_batch_size=8", "solver.jobs=1"]
    before = tmp_path / "before.json"
    assert cli.main(["plan", *planning, f"out={before}"]) == 0
    assert "shipped H100 calibration: cross-validated median" in capsys.readouterr().out
    profile = tmp_path / "cal.yaml"
    assert cli.main(["calibrate", *(str(run_dirs[n][0]) for n in RUNS), f"out={profile}"]) == 0
    data = yaml.safe_load(profile.read_text())
    assert [r["log"] for r in data["runs"]] == [str(run_dirs[n][0]) for n in RUNS]
    assert all(r["plan_digest"] for r in data["runs"]) and len(data["leave_one_out"]["errors"]) == 2
    capsys.readouterr()
    out = tmp_path / "after.json"
    assert cli.main(["plan", *planning, f"calibration={profile}", f"out={out}"]) == 0
    text = capsys.readouterr().out
    plan, shipped = json.loads(out.read_text()), json.loads(before.read_text())
    assert shipped["calibration"]["label"] == "shipped H100 calibration" and shipped["calibration"]["path"] is None
    assert plan["calibration"]["path"] == str(profile.resolve())
    fitted = {k: v["value"] for k, v in data["constants"].items() if v["fitted"]}
    assert fitted and plan["calibration"]["values"] == fitted
    assert "calibration cal.yaml: cross-validated median" in text and "(2 runs, leave-one-out)" in text
    # The CPU runs took longer than the 1 TFLOP/s "H100" is priced to (about 20 ms): the calibrated constants price
    # every plan slower
    assert plan["predicted"]["step_time_s"] > shipped["predicted"]["step_time_s"]
