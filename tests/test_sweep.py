"""`nest-megatron sweep`: Hydra's sweep syntax expanded into points, each planned by api.plan, one row each."""

from __future__ import annotations

import contextlib
import csv
import io
import json
import re

import pytest
from matplotlib.image import imread

from nest_megatron import api, sweep
from nest_megatron.cli import main
from nest_megatron.errors import NestError
from nest_megatron.report.plots.sweep import draw

# 2 clusters x 2 device counts of tiny_gpt. a100_pcie_bridged's levels are pair 2, switch 2, host 2: 6 devices
# need a whole switch of 4 below them, so (a100_pcie_bridged, 6) does not load, while 6 devices of a DGX node do.
FIXED = ["model=tiny_gpt", "train.global_batch_size=48"]
SWEEP = [*FIXED, "cluster=dgx_h100_superpod,a100_pcie_bridged", "cluster.num_devices=4,6"]
ORDER = [("dgx_h100_superpod", 4), ("dgx_h100_superpod", 6), ("a100_pcie_bridged", 4), ("a100_pcie_bridged", 6)]


@pytest.fixture(scope="module")
def outcomes():
    return sweep.run(sweep.expand(SWEEP))


def test_product_in_order_last_key_fastest(outcomes):
    assert [(o.point.values["cluster"], o.point.values["cluster.num_devices"]) for o in outcomes] == ORDER
    assert outcomes[1].point.overrides == ("model=tiny_gpt", "train.global_batch_size=48", "cluster=dgx_h100_superpod",
                                           "cluster.num_devices=6")


def test_each_row_is_the_plan_of_its_point(outcomes):
    rows = [sweep.row(o) for o in outcomes]
    for (cluster, devices), r in zip(ORDER[:3], rows[:3]):
        expected = api.plan([*FIXED, f"cluster={cluster}", f"cluster.num_devices={devices}"])
        p, pred = expected.parallel, expected.predicted
        assert [r[k] for k in ("tp", "pp", "dp", "cp", "ep", "vpp")] == [p[k] for k in ("tp", "pp", "dp", "cp", "ep", "vpp")]
        assert (r["mbs"], r["zero"], r["num_devices"]) == (expected.micro_batch_size, expected.zero_stage, devices)
        assert r["step_time_s"] == pytest.approx(pred["step_time_s"], rel=1e-12)
        assert r["tokens_per_s_per_device"] == pytest.approx(pred["tokens_per_s"] / devices, rel=1e-12)
        assert r["mfu"] == pytest.approx(pred["mfu"], rel=1e-12)
        assert [r["step_time_low_s"], r["step_time_high_s"]] == pytest.approx(expected.calibration["step_time_band_s"],
                                                                               rel=1e-12)
        assert r["calibration"] == expected.calibration["summary"]
        assert r["error"] is None


def test_a_combination_that_does_not_go_together_is_a_row(outcomes):
    failed = outcomes[3]
    assert failed.plan is None and failed.num_devices is None
    assert failed.reason.startswith("cluster.num_devices=6: must be a multiple of 4")
    assert sweep.row(failed)["tp"] is None


def test_a_model_that_fits_nowhere_is_a_row_and_the_rest_still_plan():
    # llama3_70b on 4 H100: even with weights, gradients and Adam state all sharded over the 4 devices, 70.6e9
    # parameters x at least 16 B (bf16 weights 2, gradients 2+, fp32 master + 2 moments 12) / 4 = 282 GB > 80 GB.
    outcomes = sweep.run(sweep.expand(["model=tiny_gpt,llama3_70b", "cluster=dgx_h100_superpod", "cluster.num_devices=4",
                                       "train.global_batch_size=48"]))
    assert outcomes[0].plan is not None and outcomes[0].reason is None
    assert outcomes[1].plan is None and outcomes[1].num_devices == 4
    assert outcomes[1].reason.startswith("no configuration of llama3_70b fits on 4 x h100_sxm")


def test_range_and_glob_are_hydras():
    points = sweep.expand(["cluster.num_devices=range(8,33,8)"])
    assert [p.values["cluster.num_devices"] for p in points] == [8, 16, 24, 32]  # stop is exclusive, as Python's
    points = sweep.expand(["model=glob(llama3_*)", "cluster.num_devices=8"])
    assert [p.overrides for p in points] == [("model=llama3_70b", "cluster.num_devices=8"),
                                             ("model=llama3_8b", "cluster.num_devices=8")]


@pytest.mark.parametrize(("overrides", "message"), [
    (["cluster.num_devices=8,,16"], "bad sweep override: Error parsing override 'cluster.num_devices=8,,16'"),
    (["cluster.num_devices=range(0,300)"], "300 points (300 cluster.num_devices) is more than --max-points=256"),
    (["cluster.num_devices=interval(8,16)"], "cluster.num_devices=interval(8,16): an interval cannot be listed"),
    (["cluster.num_devices=8", "cluster.num_devices=16,32"], "cluster.num_devices: given twice"),
])
def test_expand_refuses(overrides, message):
    with pytest.raises(NestError) as err:
        sweep.expand(overrides)
    assert str(err.value).startswith(message)


@pytest.mark.parametrize(("argv", "message"), [
    (["model=tiny_gpt", "cluster.num_devices=8,,16"], "bad sweep override"),
    (["model=tiny_gpt", "model.num_layerz=2,4"], "model.num_layerz: no such key; did you mean model.num_layers?"),
    (["model=tiny_gpt", "cluster=dgx_h100_superpod,nosuch"], "cluster=nosuch: unknown cluster; choose one of:"),
    (["model=tiny_gpt", "cluster.num_devices=abc,8"], "cluster.num_devices=abc: expected Integer"),
    (["model=tiny_gpt", "cluster.num_devices=range(8,4096,8)"], "511 points"),
    (["model=tiny_gpt", "cluster.num_devices=8,16", "--max-points", "1"], "2 points"),
    (["model=tiny_gpt,llama3_8b", "cluster.num_devices=8", "plot=p.png"], "plot= needs a swept key with numeric values"),
    (["model=tiny_gpt", "cluster.num_devices=8,16", "out=rows.txt"], "'out=rows.txt': out= must end in .csv or .json"),
    (["model=tiny_gpt", "cluster.num_devices=8,16", "report=r"], "'report=r': sweep writes no report"),
])
def test_bad_input_is_one_line_exit_2_nothing_written(argv, message, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    out = ["out=rows.csv"] if not any(a.startswith("out=") for a in argv) else []
    assert main(["sweep", *argv, *out, "--quiet"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1
    assert captured.err.startswith(f"nest-megatron sweep: error: {message}"), captured.err
    assert list(tmp_path.iterdir()) == []


@pytest.fixture(scope="module")
def cli_run(tmp_path_factory):
    """One CLI run writing out=.csv and plot=.png with --json, read back by the tests below."""
    folder = tmp_path_factory.mktemp("sweep")
    argv = ["sweep", *SWEEP, f"out={folder}/rows.csv", f"plot={folder}/rows.png", "--json"]
    stdout = io.StringIO()  # capsys is function-scoped; this fixture is shared by the module
    with contextlib.redirect_stdout(stdout):
        status = main(argv)
    return status, json.loads(stdout.getvalue()), folder


def test_out_csv_round_trips(cli_run, outcomes):
    status, printed, folder = cli_run
    assert status == 0
    with open(folder / "rows.csv", newline="") as f:
        reader = csv.DictReader(f)
        rows = list(reader)
    assert reader.fieldnames == ["cluster", "cluster.num_devices", "num_devices", "tp", "pp", "dp", "cp", "ep", "vpp",
                                 "mbs", "zero", "recompute", "step_time_s", "step_time_low_s", "step_time_high_s",
                                 "tokens_per_s", "tokens_per_s_per_device", "mfu", "peak_memory_gib", "capacity_gib",
                                 "calibration", "error", "overrides"]
    assert [(r["cluster"], int(r["cluster.num_devices"])) for r in rows] == ORDER
    for r, outcome in zip(rows[:3], outcomes[:3]):  # the same cost model, so the same numbers as the Python run
        assert float(r["step_time_s"]) == pytest.approx(outcome.plan.predicted["step_time_s"], rel=1e-12)
        assert int(r["tp"]) * int(r["pp"]) * int(r["dp"]) * int(r["cp"]) <= int(r["num_devices"])
    assert rows[3]["tp"] == "" and rows[3]["error"].startswith("cluster.num_devices=6: must be a multiple of 4")
    assert rows[1]["overrides"] == "model=tiny_gpt train.global_batch_size=48 cluster=dgx_h100_superpod cluster.num_devices=6"
    assert [r["cluster.num_devices"] for r in printed] == [4, 6, 4, 6]  # --json keeps the numbers typed


def test_the_table_prints_each_plans_band_and_calibration(capsys, monkeypatch):
    """The band column and the calibration lines are the plans' (Plan.calibration), a line for each calibration:
    the A100 points are priced with the H100 calibration's errors, and say so."""
    monkeypatch.delenv("COLUMNS", raising=False)  # piped: the table as wide as it needs, no cell cut
    assert main(["sweep", *SWEEP]) == 0
    printed = capsys.readouterr().out
    summaries = []
    for cluster, devices in ORDER[:3]:
        plan = api.plan([*FIXED, f"cluster={cluster}", f"cluster.num_devices={devices}"])
        low, high = plan.calibration["step_time_band_s"]
        assert plan.predicted["step_time_s"] < 0.1  # tiny_gpt: a step of milliseconds
        assert re.search(rf"│ +{re.escape(f'{low * 1e3:.3g}-{high * 1e3:.3g} ms')} │", printed)  # a cell, right-aligned
        summaries.append(plan.calibration["summary"])
    assert summaries[0] == summaries[1] != summaries[2]
    assert printed.splitlines()[-2:] == [f"calibration: {summaries[0]}", f"calibration: {summaries[2]}"]


def test_plot_is_a_png_with_a_line_per_cluster(cli_run, tmp_path):
    status, printed, folder = cli_run
    image = imread(folder / "rows.png")
    assert image.ndim == 3 and image.shape[0] > 300 and image.shape[1] > 500
    # the same rows drawn again, read back from the matplotlib artists: x = devices, one line per cluster;
    # the DGX line has 2 points, the bridged one 1 (its 6-device point has no plan)
    drawn = draw(printed, x="cluster.num_devices", series=["cluster"], title=" ".join(FIXED), path=tmp_path / "again.png")
    assert drawn["legend"] == ["cluster=dgx_h100_superpod", "cluster=a100_pcie_bridged"]
    assert [line["points"] for line in drawn["lines"]] == [2, 1]
    assert (imread(tmp_path / "again.png") == image).all()  # and that figure is the one the CLI wrote


@pytest.mark.slow
def test_jobs_2_gives_the_rows_of_jobs_1(outcomes):
    parallel = sweep.run(sweep.expand(SWEEP), jobs=2)  # 3 of 4 points planned in 2 spawned processes
    assert [sweep.row(o) for o in parallel] == [sweep.row(o) for o in outcomes]
    assert [o.plan.rank_to_device for o in parallel[:3]] == [o.plan.rank_to_device for o in outcomes[:3]]
