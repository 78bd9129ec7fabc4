"""The explain report: its numbers against the cost model, its figures read back from matplotlib, and
the page as a user sees it, in headless Chromium (Debian's `chromium`, driven over the DevTools
protocol with websocket-client)."""

from __future__ import annotations

import base64
import json
import shutil
import subprocess
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import websocket
import yaml

from nest_megatron import api, cli
from nest_megatron.commands.explain import repriced
from nest_megatron.config.load import load
from nest_megatron.cost.schedule import megatron_order
from nest_megatron.plan import Plan, key_overrides
from nest_megatron.report.explain import (
    SCHEDULE_TOLERANCE,
    placement_marks,
    plan_config,
    plan_context,
    report_data,
    runner_up_rows,
    write_report,
)
from nest_megatron.report.plots import placement
from nest_megatron.solver.baselines import manual

ROOT = Path(__file__).resolve().parents[1]
TINY = ["model=tiny_gpt", "cluster=dgx_h100_superpod", "cluster.num_devices=16", "train.global_batch_size=64"]
# 16 GPUs, two nodes of one scalable unit; pinned to two stages so that the schedule has a pipeline.
ONE_F_ONE_B = [*TINY, "plan.pp=2", "plan.vpp=1", "plan.tp=2"]
INTERLEAVED = [*TINY, "plan.pp=2", "plan.vpp=2"]
# groups of 3 micro-batches per model chunk (Megatron's default is pp = 2): the bubble stays (p - 1) / v
GROUPED = [*INTERLEAVED, "plan.microbatch_group_size_per_vp_stage=3"]


@pytest.fixture(scope="module")
def tiny_plan() -> Plan:
    return api.plan(ONE_F_ONE_B)


@pytest.fixture(scope="module")
def report(tiny_plan, tmp_path_factory):
    """The report of the tiny 1F1B plan, rendered once: (ReportData, index.html, what each figure drew)."""
    problem = load(tiny_plan.overrides).problem
    data = report_data(problem, tiny_plan, baselines={"Manual": manual(problem), "nothing": None})
    index, drawn = write_report(data, tmp_path_factory.mktemp("report"))
    return data, index, drawn


# --- the schedule against the cost model ---------------------------------------------------------------------

@pytest.mark.parametrize("overrides", [ONE_F_ONE_B, INTERLEAVED, GROUPED], ids=["1f1b", "interleaved", "grouped"])
def test_timeline_adds_up_to_the_predicted_step(overrides):
    plan = api.plan(overrides)
    problem = load(plan.overrides).problem
    data = report_data(problem, plan, baselines={})
    tl, est = data.timeline, data.estimate
    p, v, m = plan.parallel["pp"], plan.parallel["vpp"], plan.num_microbatches
    assert est.step_time == pytest.approx(plan.predicted["step_time_s"], rel=1e-12)  # re-priced from overrides
    pace = max(est.stage_times)
    for stage in range(p):
        # Every rank works m x the slowest stage's time per micro-batch (its own work + waiting on
        # the slowest), then its after-pipeline parts; what is left of the pipeline is bubble.
        pipeline_work = sum(s.duration for s in tl.stages[stage] if s.microbatch >= 0)
        assert pipeline_work == pytest.approx(m * pace, rel=1e-9)
        assert tl.bubble(stage) == pytest.approx((p - 1) / v * pace, abs=SCHEDULE_TOLERANCE * est.step_time)
        forwards = {(s.microbatch, s.chunk) for s in tl.stages[stage] if s.kind == "forward"}
        assert forwards == {(mb, c) for mb in range(m) for c in range(v)}
    after = sum(est.breakdown[k] for k in ("dp_grad_sync", "dp_param_gather", "optimizer"))
    assert tl.length - tl.pipeline_end == pytest.approx(after, rel=1e-9)
    assert tl.length == pytest.approx(plan.predicted["step_time_s"], rel=SCHEDULE_TOLERANCE)
    assert tl.schedule == ("1F1B" if v == 1 else "interleaved 1F1B")


def test_megatron_order_warmup_counts():
    # Megatron's 1F1B: rank i of p warms up with p - i - 1 forwards; interleaved with 2 (p - i - 1) +
    # (v - 1) p chunk forwards (forward_backward_pipelining_with_interleaving); the steady state then
    # starts with one more forward before the first backward.
    def forwards_before_first_backward(ops):
        return next(i for i, op in enumerate(ops) if not op.forward)

    assert [forwards_before_first_backward(megatron_order(pp=4, vpp=1, stage=s, num_microbatches=8))
            for s in range(4)] == [3 + 1, 2 + 1, 1 + 1, 0 + 1]
    assert [forwards_before_first_backward(megatron_order(pp=2, vpp=2, stage=s, num_microbatches=4))
            for s in range(2)] == [4 + 1, 2 + 1]
    ops = megatron_order(pp=2, vpp=2, stage=0, num_microbatches=4)
    # Chunk 0 of micro-batches 0, 1, then chunk 1 of 0, 1, then chunk 0 of 2, 3 ...
    assert [(op.microbatch, op.chunk) for op in ops if op.forward][:6] == [(0, 0), (1, 0), (0, 1), (1, 1), (2, 0), (3, 0)]


# --- the figures, read back -----------------------------------------------------------------------------------

def test_memory_bars_and_capacity(report, tiny_plan):
    _, _, drawn = report
    pred = tiny_plan.predicted
    assert drawn["memory.png"]["bars"] == tiny_plan.parallel["pp"] == 2
    # The capacity line sits at the accelerator's memory as its config file states it.
    accelerator = yaml.safe_load((ROOT / "nest_megatron" / "hydra_configs" / "accelerator" / "h100_sxm.yaml").read_text())
    assert drawn["memory.png"]["capacity_y"] == pytest.approx(accelerator["memory_gib"]) == pred["capacity_gib"]
    assert drawn["memory.png"]["totals"] == pytest.approx(pred["memory_per_stage_gib"])


def test_schedule_marks_the_predicted_step(report, tiny_plan):
    _, _, drawn = report
    assert drawn["schedule.png"]["rows"] == 2
    assert drawn["schedule.png"]["predicted_line_x"] == pytest.approx(tiny_plan.predicted["step_time_s"])


def test_placement_draws_every_device_coloured_by_stage(report, tiny_plan):
    data, _, drawn = report
    p = tiny_plan.parallel
    assert drawn["placement.png"]["devices_drawn"] == tiny_plan.num_devices == 16
    # Rank r's stage, independently: with tp-cp-ep-dp-pp the stage is r // (tp cp dp); with
    # tp-cp-ep-pp-dp it is (r // (tp cp)) % pp.
    ranks = np.arange(16)
    if tiny_plan.rank_order == "tp-cp-ep-dp-pp":
        stage_of_rank = ranks // (p["tp"] * p["cp"] * p["dp"])
    else:
        stage_of_rank = (ranks // (p["tp"] * p["cp"])) % p["pp"]
    by_device = np.empty(16, dtype=int)
    by_device[np.asarray(tiny_plan.rank_to_device)] = stage_of_rank
    assert data.stage_of_device == by_device.tolist()
    outlined = drawn["placement.png"]["group_members_drawn"]
    assert outlined == {"tp": p["tp"], "dp": p["dp"], "pp": p["pp"]}


@pytest.mark.parametrize("cp, label", [
    # TP 2 x CP 2 on 16 GPUs leaves DP 4; Megatron's dp-cp group of rank 0 holds DP x CP = 4 x 2 = 8 ranks.
    (2, "DP x CP group of 8 (rank 0's)"),
    # Without context parallel it is the data-parallel group alone: 16 / 2 = DP 8.
    (1, "DP group of 8 (rank 0's)"),
])
def test_placement_names_the_data_parallel_group_with_context_parallel(cp, label):
    plan = api.evaluate([*TINY, "plan.tp=2", f"plan.cp={cp}", "plan.pp=1"])
    _, groups = placement_marks(plan, plan_config(plan), exposed=dict.fromkeys(["tp", "cp", "dp", "ep", "pp"], 0.0))
    dp_label = next(g.label for g in groups if g.kind == "dp")
    assert dp_label.startswith(label), dp_label


@pytest.mark.slow
def test_placement_of_a_big_cluster_draws_a_subset(tmp_path):
    # 4096 GPUs: more than placement.MAX_DEVICES, so the first 2048 are drawn and the title says so.
    plan = api.evaluate(["model=llama3_70b", "cluster.num_devices=4096", "plan.tp=8", "plan.pp=8", "plan.zero=1",
                         "plan.recompute=full", "train.global_batch_size=2048"])
    data = report_data(load(plan.overrides).problem, plan, baselines={})
    drawn = placement.draw(data.topology, stage_of_device=data.stage_of_device, groups=data.groups,
                           title="big", path=tmp_path / "p.png")
    assert drawn["subset"] and drawn["devices_drawn"] == placement.MAX_DEVICES == 2048 and drawn["devices"] == 4096
    assert (tmp_path / "p.png").stat().st_size > 10_000


# --- the tables -----------------------------------------------------------------------------------------------

def test_runner_up_reasons_by_hand(tiny_plan):
    plan = Plan.from_dict({**tiny_plan.to_dict(),
                           "predicted": {**tiny_plan.predicted, "step_time_s": 2.0, "capacity_gib": 80.0},
                           "runners_up": [
                               {**tiny_plan.runners_up[0], "step_time_s": 2.5, "peak_memory_gib": 70.0, "fits": True,
                                "tied_within_error": False},
                               {**tiny_plan.runners_up[0], "step_time_s": 1.5, "peak_memory_gib": 90.5, "fits": False},
                               {**tiny_plan.runners_up[0], "step_time_s": 2.1, "peak_memory_gib": 70.0, "fits": True,
                                "tied_within_error": True},
                               {**tiny_plan.runners_up[0], "step_time_s": 1.9, "peak_memory_gib": 70.0, "fits": False,
                                "shortfall": "291.6 GiB of pinned host memory for the offloaded activations, of 223.5 "
                                             "GiB a device"},
                           ]})
    # 2.5 / 2.0 = 1.25: 25.0% slower; 90.5 - 80.0 = 10.5 GiB over (a plan written before runners-up said what does
    # not fit); 2.1 / 2.0: 5.0% slower, within the band; the last fits the device, not the host
    assert [r["why"] for r in runner_up_rows(plan)] == [
        "slower by 25.0%", "does not fit by 10.5 GiB", "tied within the model's error (slower by 5.0%)",
        "does not fit: 291.6 GiB of pinned host memory for the offloaded activations, of 223.5 GiB a device"]


def test_the_prediction_figure_draws_the_band(report, tiny_plan):
    """The plan's band is its calibration's: for the shipped one, t / (1 + e) at the 95th and the 5th percentile of
    the cross-validated errors e of calibration/shipped/h100_sxm.yaml; every runner-up that fits and both baselines
    that found a plan get theirs, and a runner-up is tied when its band reaches the plan's."""
    data, index, drawn = report
    shipped = yaml.safe_load((ROOT / "nest_megatron/calibration/shipped/h100_sxm.yaml").read_text())
    errors = np.asarray(shipped["cross_validation"][shipped["band_from"]]["errors"])
    step = tiny_plan.predicted["step_time_s"]
    low, high = step / (1 + np.percentile(errors, 95)), step / (1 + np.percentile(errors, 5))
    figure = drawn["prediction.png"]
    assert figure["whiskers"][0] == pytest.approx((low, high))
    assert tiny_plan.calibration["step_time_band_s"] == pytest.approx([low, high])
    fitting = [r for r in tiny_plan.runners_up if r["fits"]][:8]
    assert figure["bars"] == 1 + len(fitting) + 1  # the plan, the runners-up that fit, the Manual baseline
    for r, row in zip(fitting, data.prediction[1:]):
        mine_low = r["step_time_s"] / (1 + np.percentile(errors, 95))
        assert row["tied"] == (mine_low <= high) == r["tied_within_error"]
    assert figure["measured_x"] is None
    assert f"{step:.4g} s ({low:.4g}-{high:.4g} s)" in index.read_text()


def test_a_plan_in_its_run_directory_is_shown_against_what_the_run_measured(tiny_plan, tmp_path):
    """A run directory as `launch` writes it, its last rank's log in Megatron-LM's format: the report draws the
    measured step (the median of the intervals after the first) beside the prediction."""
    from megatron_logs import iteration_line

    from nest_megatron.calibration.runs import measured_in

    (tmp_path / "plan.json").write_text(tiny_plan.to_json())
    (tmp_path / "run.json").write_text(json.dumps({"logs": "logs"}))
    log = tmp_path / "logs/node0/abc_1/attempt_0/1/stdout.log"
    log.parent.mkdir(parents=True)
    log.write_text("\n".join(["------------------------ arguments ------------------------",
                               "  num_layers ...................................... 4",
                               "-------------------- end of arguments ---------------------"]
                              + [iteration_line(iteration=i, train_iters=4, consumed=64 * i, elapsed_s=s, batch_size=64)
                                 for i, s in ((1, 0.5), (2, 0.012), (3, 0.010), (4, 0.011))]) + "\n")
    measured = measured_in(tmp_path)
    assert measured["step_s"] == pytest.approx(0.011) and measured["iterations"] == 3  # median of 12, 10, 11 ms
    problem = load(tiny_plan.overrides).problem
    index, drawn = write_report(report_data(problem, tiny_plan, baselines={}, measured=measured), tmp_path / "r")
    assert drawn["prediction.png"]["measured_x"] == pytest.approx(0.011)
    assert "measured step</td><td>0.011 s" in index.read_text()


def test_baselines_side_by_side(report, tiny_plan):
    data, _, _ = report
    rows = {r["name"]: r for r in data.comparison}
    problem = load(tiny_plan.overrides).problem
    by_hand = manual(problem)
    assert rows["this plan"]["speedup"] == 1.0
    assert rows["Manual"]["step_time_s"] == pytest.approx(by_hand.step_time)
    assert rows["Manual"]["speedup"] == pytest.approx(by_hand.step_time / tiny_plan.predicted["step_time_s"])
    assert rows["nothing"]["step_time_s"] is None


def test_plan_config_round_trips(tiny_plan):
    ctx = plan_context(load(tiny_plan.overrides).problem, tiny_plan)
    assert ctx.cfg == plan_config(tiny_plan)
    assert (ctx.cfg.tp, ctx.cfg.pp, ctx.cfg.mbs, ctx.cfg.zero) == (
        tiny_plan.parallel["tp"], tiny_plan.parallel["pp"], tiny_plan.micro_batch_size, tiny_plan.zero_stage)


# --- the page in headless Chromium ----------------------------------------------------------------------------

class Chromium:
    """Headless Chromium on a DevTools websocket: load a page, evaluate JavaScript, collect errors."""

    def __init__(self, profile: Path):
        exe = shutil.which("chromium")
        assert exe, "Debian's chromium is in .ci/apt-packages: apt-get install chromium"
        self.process = subprocess.Popen(
            [exe, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--remote-debugging-port=0",
             f"--user-data-dir={profile}", "--window-size=1400,1000", "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        port_file = profile / "DevToolsActivePort"
        deadline = time.monotonic() + 60
        while not port_file.exists() or not port_file.read_text().strip():
            assert time.monotonic() < deadline and self.process.poll() is None, "chromium did not start"
            time.sleep(0.1)
        port = port_file.read_text().split()[0]
        targets = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=30).read())
        page = next(t for t in targets if t["type"] == "page")
        self.ws = websocket.create_connection(page["webSocketDebuggerUrl"], timeout=60, suppress_origin=True)
        self.next_id = 0
        self.events: list[dict] = []
        for method in ("Page.enable", "Runtime.enable", "Log.enable"):
            self.call(method)

    def call(self, method: str, **params) -> dict:
        self.next_id += 1
        self.ws.send(json.dumps({"id": self.next_id, "method": method, "params": params}))
        while True:
            message = json.loads(self.ws.recv())
            if message.get("id") == self.next_id:
                assert "error" not in message, message
                return message["result"]
            self.events.append(message)

    def wait_for(self, event: str) -> None:
        while not any(e.get("method") == event for e in self.events):
            self.events.append(json.loads(self.ws.recv()))

    def load(self, path: Path) -> None:
        self.call("Page.navigate", url=path.resolve().as_uri())
        self.wait_for("Page.loadEventFired")

    def evaluate(self, expression: str):
        return self.call("Runtime.evaluate", expression=expression, returnByValue=True)["result"]["value"]

    def errors(self) -> list[str]:
        out = []
        for e in self.events:
            method, params = e.get("method"), e.get("params", {})
            if method == "Runtime.exceptionThrown":
                out.append(params["exceptionDetails"].get("text", "exception"))
            elif method == "Runtime.consoleAPICalled" and params.get("type") == "error":
                out.append(str(params.get("args")))
            elif method == "Log.entryAdded" and params["entry"]["level"] == "error":
                out.append(params["entry"]["text"])
        return out

    def screenshot(self, path: Path, *, width: int = 1400) -> None:
        height = int(self.evaluate("document.documentElement.scrollHeight"))
        self.call("Emulation.setDeviceMetricsOverride", width=width, height=height, deviceScaleFactor=1, mobile=False)
        path.write_bytes(base64.b64decode(self.call("Page.captureScreenshot", format="png")["data"]))

    def close(self) -> None:
        self.ws.close()
        self.process.terminate()
        self.process.wait(timeout=30)


@pytest.fixture
def chromium(tmp_path):
    browser = Chromium(tmp_path / "chromium-profile")
    yield browser
    browser.close()


IMAGES = "Array.from(document.images).map(i => [i.complete, i.naturalWidth, i.src.slice(0, 22)])"


def test_report_page_loads_with_its_images(report, tiny_plan, chromium, tmp_path):
    _, index, _ = report
    chromium.load(index)
    images = chromium.evaluate(IMAGES)
    assert len(images) == 4
    assert all(complete and width > 0 for complete, width, _ in images), images
    assert all(src == "data:image/png;base64," for _, _, src in images)  # self-contained
    assert chromium.errors() == []
    headings = chromium.evaluate("Array.from(document.querySelectorAll('h2')).map(h => h.textContent)")
    assert headings == ["Predicted step time and the model's error", "Pipeline schedule of one iteration", "Memory per stage", "Placement on the topology",
                        "Plans the solver also considered", "Against the baselines", "Megatron arguments"]
    runner_rows = chromium.evaluate("document.querySelectorAll('table')[1].tBodies[0].rows.length")
    assert runner_rows == len(tiny_plan.runners_up)
    chromium.screenshot(tmp_path / "page.png")
    assert (tmp_path / "page.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_chromium_check_catches_a_broken_image(chromium, tmp_path):
    # The checker itself: a page with a missing image must fail both checks above.
    page = tmp_path / "broken.html"
    page.write_text('<!DOCTYPE html><html><body><img src="missing.png"></body></html>')
    chromium.load(page)
    assert [width for _, width, _ in chromium.evaluate(IMAGES)] == [0]
    assert any("ERR_FILE_NOT_FOUND" in e or "Failed to load" in e for e in chromium.errors())


# --- the command line -----------------------------------------------------------------------------------------

def test_explain_command_writes_the_report(tiny_plan, tmp_path, capsys):
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(tiny_plan.to_json())
    assert cli.main(["explain", str(plan_file), "--no-baselines"]) == 0
    out = tmp_path / "plan_report"
    assert sorted(p.name for p in out.iterdir()) == ["index.html", "memory.png", "placement.png", "prediction.png",
                                                     "schedule.png"]
    captured = capsys.readouterr()
    assert f"report written to {out / 'index.html'}" in captured.out
    # Not a terminal: no progress bar, no colour codes.
    assert captured.err == "" and "\x1b[" not in captured.out


@pytest.mark.slow
def test_plan_report_option(tmp_path, capsys):
    out = tmp_path / "r"
    assert cli.main(["plan", "--quiet", *ONE_F_ONE_B, f"out={tmp_path / 'plan.json'}", f"report={out}"]) == 0
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert not any(o.startswith("report=") for o in plan["overrides"])  # the report is not part of the problem
    html = (out / "index.html").read_text()
    assert "Manual (recipe habits)" in html and "best flat-network plan" in html
    assert capsys.readouterr().out == ""


def test_plan_report_that_cannot_be_written(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    plan_file = tmp_path / "plan.json"
    assert cli.main(["plan", *ONE_F_ONE_B, f"out={plan_file}", f"report={blocker}"]) == 2
    err = capsys.readouterr().err
    assert err == f"nest-megatron plan: error: report={blocker}: is a file; give a folder\n"
    assert not plan_file.exists() and blocker.read_text() == "not a folder"


def _bad_plans(tiny_plan: Plan, tmp_path: Path) -> list[tuple[list[str], str]]:
    good = tmp_path / "plan.json"
    good.write_text(tiny_plan.to_json())
    cases = [([str(tmp_path / "missing.json")], "cannot read it"),
             ([str(good), "dir=x"], "explain takes out=DIR and calibration=PATH")]
    for name, text, message in [
        ("notjson.json", "{plan", "not JSON"),
        ("list.json", "[1, 2]", "not a plan"),
        ("partial.json", '{"schema_version": 1, "model": "x"}', "missing accelerator"),
        ("version.json", json.dumps({**tiny_plan.to_dict(), "schema_version": 9}), "schema_version=9: this version reads 1"),
        ("elsewhere.json", json.dumps({**tiny_plan.to_dict(), "overrides": [*TINY[:2], "cluster.num_devices=8",
                                                                              TINY[3]]}),
         "the plan is for 16 devices but its overrides build 8"),
        ("badmodel.json", json.dumps({**tiny_plan.to_dict(), "overrides": ["model=nope"]}), "model=nope: unknown model"),
    ]:
        (tmp_path / name).write_text(text)
        cases.append(([str(tmp_path / name)], message))
    return cases


def test_bad_input_one_line_and_nothing_written(tiny_plan, tmp_path, capsys):
    for argv, message in _bad_plans(tiny_plan, tmp_path):
        out = tmp_path / "out"
        assert cli.main(["explain", *argv, f"out={out}", "--no-baselines"]) == 2, argv
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("nest-megatron explain: error: ") and message in err, err
        assert not out.exists()


def test_an_edited_plan_that_cannot_be_explained_is_refused_in_one_line(tiny_plan, tmp_path, capsys):
    # The tiny plan, edited by hand; each line is what the edit breaks, worked out from the edit.
    plan = tiny_plan.to_dict()
    split = tiny_plan.layers_per_stage
    cases = [
        # TP 3 x CP 1 x PP 2 x DP 2 = 12 of the 16 devices, but 3 does not divide tiny_gpt's 8 heads.
        ({"parallel": {**plan["parallel"], "tp": 3, "cp": 1, "dp": 2}},
         "the plan breaks a Megatron rule: plan.tp=3: must divide num_attention_heads=8"),
        # tiny_gpt has 4 layers; the overrides now build 5, which the plan's split does not hold.
        ({"overrides": [*plan["overrides"], "model.num_layers=5"]},
         f"the plan's layers_per_stage={split} hold 4 layers, but its overrides build tiny_gpt with model.num_layers=5"),
        ({"global_batch_size": 32},
         "the plan's global_batch_size=32, but its overrides build train.global_batch_size=64"),
        ({"rank_to_device": [0] * 16},
         "rank_to_device: must place the tp*cp*pp*dp = 16 ranks on distinct devices 0..15 (it lists 16)"),
        ({"parallel": {**plan["parallel"], "tp": "2"}}, "parallel.tp='2': must be an integer"),
    ]
    for edit, line in cases:
        path = tmp_path / "edited.json"
        path.write_text(json.dumps({**plan, **edit}))
        out = tmp_path / "out"
        assert cli.main(["explain", str(path), f"out={out}", "--no-baselines"]) == 2, edit
        assert capsys.readouterr().err == f"nest-megatron explain: error: {line}\n"
        assert not out.exists()


def test_a_band_beside_its_prediction_is_drawn(tmp_path):
    """A band need not hold its bar's step time (a calibration whose runs all measured slower than predicted, as a
    band from other code could be): drawn from its low to its high end (it crashed: matplotlib's negative xerr)."""
    from nest_megatron.report.plots import prediction

    rows = [{"name": "plan", "step_time_s": 29.2, "band_s": (45.9, 46.5)}]
    drawn = prediction.draw(rows, measured_s=46.0, title="t", path=tmp_path / "p.png")
    assert drawn["whiskers"] == [(45.9, 46.5)] and (tmp_path / "p.png").stat().st_size > 0


def test_explain_re_prices_a_plan_with_a_calibration(tiny_plan, tmp_path, capsys, monkeypatch):
    """`explain PLAN calibration=PATH` (or NEST_MEGATRON_CALIBRATION) reports the plan and its runners-up priced with
    that profile: the plan's step time is `evaluate` of its own plan.* keys with the calibration."""
    profile = tmp_path / "cal.yaml"
    profile.write_text(yaml.safe_dump({
        "format": "nest-megatron calibration", "version": 1, "accelerator": "h100_sxm",
        "constants": {"gemm_efficiency": {"value": 0.4, "fitted": True}}, "leave_one_out": {"errors": [0.05, -0.05]}}))
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(tiny_plan.to_dict()))
    expected = api.evaluate([*ONE_F_ONE_B, *key_overrides(tiny_plan.choice),
                             f"calibration={profile}"]).predicted["step_time_s"]
    for options, env in (([f"calibration={profile}"], None), ([], str(profile))):
        if env:
            monkeypatch.setenv("NEST_MEGATRON_CALIBRATION", env)
        out = tmp_path / f"report{len(options)}"
        assert cli.main(["explain", str(path), f"out={out}", "--no-baselines", *options]) == 0
        printed = capsys.readouterr().out
        assert "re-priced with calibration cal.yaml (the plan was priced with shipped H100 calibration)" in printed
        index = (out / "index.html").read_text()
        assert f"{expected:.4g} s" in index and "calibration cal.yaml" in index
    assert expected > tiny_plan.predicted["step_time_s"]  # GEMMs at 0.4 of the peak, not the shipped 0.61
    # the overrides stay the user's (the baselines search as before), with the calibration
    again = repriced(tiny_plan, str(profile))
    assert again.overrides == [*tiny_plan.overrides, f"calibration={profile}"]
    assert cli.main(["explain", str(path), "cal=x"]) == 2
    assert "'cal=x': explain takes out=DIR and calibration=PATH" in capsys.readouterr().err
