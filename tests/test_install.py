"""nest-megatron installed as a wheel, away from any checkout: the shipped configs travel inside the
package, and a user's own clusters and models live in the folders of NEST_MEGATRON_CONFIG_PATH."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from nest_megatron import api
from nest_megatron.config.load import CONFIG_PATH_ENV, load
from nest_megatron.errors import NestError

ROOT = Path(__file__).resolve().parents[1]
TINY = ["model=tiny_gpt", "cluster.num_devices=16", "train.global_batch_size=64"]


@pytest.mark.slow
def test_an_installed_wheel_plans_outside_the_checkout(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(tmp_path),
                    str(ROOT)], check=True, capture_output=True, timeout=300)
    wheel = next(tmp_path.glob("nest_megatron-*.whl"))
    package = ROOT / "nest_megatron"
    configs = sorted(str(p.relative_to(ROOT)) for folder in ("hydra_configs", "calibration/shipped")
                     for p in (package / folder).rglob("*.yaml"))
    assert len(configs) > 20 and any(c.startswith("nest_megatron/calibration/shipped/") for c in configs)
    assert configs == sorted(n for n in zipfile.ZipFile(wheel).namelist() if n.endswith(".yaml"))

    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(wheel)],
                   check=True, capture_output=True, timeout=300)
    env = {**os.environ, "PYTHONPATH": str(site)}
    run = tmp_path / "elsewhere"
    run.mkdir()
    where = subprocess.run([sys.executable, "-c", "import nest_megatron; print(nest_megatron.__file__)"],
                           env=env, cwd=run, capture_output=True, text=True, check=True)
    assert Path(where.stdout.strip()).is_relative_to(site)  # the wheel's copy, not the checkout's
    done = subprocess.run([sys.executable, "-m", "nest_megatron.cli", "plan", *TINY, "cluster=dgx_h100_superpod", "--json"],
                          env=env, cwd=run, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    plan = json.loads(done.stdout)
    p = plan["parallel"]
    assert (plan["cluster"], p["tp"] * p["pp"] * p["dp"] * p["cp"]) == ("dgx_h100_superpod", 16)
    # the band comes from the shipped calibration the wheel carries
    low, high = plan["calibration"]["step_time_band_s"]
    assert low < plan["predicted"]["step_time_s"] < high


def _my_cluster(folder: Path, name: str) -> Path:
    """A copy of the shipped DGX H100 SuperPOD description under another name."""
    shipped = (ROOT / "nest_megatron" / "hydra_configs" / "cluster" / "dgx_h100_superpod.yaml").read_text()
    (folder / "cluster").mkdir(parents=True, exist_ok=True)
    path = folder / "cluster" / f"{name}.yaml"
    path.write_text(shipped.replace("name: dgx_h100_superpod", f"name: {name}"))
    return path


def test_a_users_own_cluster_comes_from_the_config_path(tmp_path, monkeypatch):
    _my_cluster(tmp_path / "mine", "my_pod")
    monkeypatch.setenv(CONFIG_PATH_ENV, f"{tmp_path / 'empty_but_real'}{os.pathsep}{tmp_path / 'mine'}")
    (tmp_path / "empty_but_real").mkdir()
    mine = api.plan([*TINY, "cluster=my_pod"])
    shipped = api.plan([*TINY, "cluster=dgx_h100_superpod"])
    assert mine.cluster == "my_pod"
    # The same network under another name: the same plan.
    assert (mine.parallel, mine.rank_to_device) == (shipped.parallel, shipped.rank_to_device)


@pytest.mark.parametrize("folder", ["my configs", "bob's, configs"])
def test_a_config_folder_may_hold_blanks_commas_and_quotes(tmp_path, monkeypatch, folder):
    _my_cluster(tmp_path / folder, "my_pod")
    monkeypatch.setenv(CONFIG_PATH_ENV, str(tmp_path / folder))
    assert api.plan([*TINY, "cluster=my_pod"]).cluster == "my_pod"


def test_without_the_config_path_a_users_cluster_is_unknown_and_the_shipped_ones_are_listed(monkeypatch):
    monkeypatch.delenv(CONFIG_PATH_ENV, raising=False)
    with pytest.raises(NestError, match=r"^cluster=my_pod: unknown cluster; choose one of: .*dgx_h100_superpod") as err:
        api.plan([*TINY, "cluster=my_pod"])
    assert str(err.value).endswith(f"(your own clusters go in a folder listed in {CONFIG_PATH_ENV}, as cluster/my_pod.yaml)")


def test_a_config_path_that_is_not_a_folder_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv(CONFIG_PATH_ENV, str(tmp_path / "missing"))
    with pytest.raises(NestError, match=rf"^{CONFIG_PATH_ENV}: {tmp_path / 'missing'} is not a folder; list folders"):
        api.plan(TINY)


def test_a_user_file_named_like_a_shipped_one_is_refused(tmp_path, monkeypatch):
    # Hydra would take the shipped file and silently ignore the user's.
    clash = _my_cluster(tmp_path, "dgx_h100_superpod")
    monkeypatch.setenv(CONFIG_PATH_ENV, str(tmp_path))
    with pytest.raises(NestError, match=rf"^{clash}: a shipped cluster has the name dgx_h100_superpod; rename yours"):
        api.plan(TINY)


# (what is changed in the copy of the shipped cluster, the message after "PATH: "); the shipped file's levels are
# on lines 9-11: `  - {name: node,  fan_out: 8,  bandwidth_gb_per_s: 450, latency_s: 3.0e-6}` first
BROKEN_FILES = {
    "unclosed flow mapping": (("fan_out: 8,  bandwidth_gb_per_s: 450, latency_s: 3.0e-6}", "fan_out: 8"),
                              "line 13, column 5: expected ',' or '}', but got '{' "
                              "(while parsing a flow mapping from line 12); fix the YAML"),
    "misspelt level key": (("bandwidth_gb_per_s: 450", "bandwith_gb_per_s: 450"),
                           "bandwith_gb_per_s: no such key; did you mean bandwidth_gb_per_s? keys of a cluster level: "
                           "name, fan_out, bandwidth_gb_per_s, latency_s, oversubscription, efficiency, all_to_all_efficiency"),
    "wrong type": (("fan_out: 32", "fan_out: many"), "fan_out: expected Integer, not many"),
}


@pytest.mark.parametrize("change, says", list(BROKEN_FILES.values()), ids=list(BROKEN_FILES))
def test_a_mistake_in_a_users_cluster_file_is_one_line_naming_the_file(change, says, tmp_path, monkeypatch):
    path = _my_cluster(tmp_path, "my_pod")
    old, new = change
    assert path.read_text().count(old) == 1
    path.write_text(path.read_text().replace(old, new))
    monkeypatch.setenv(CONFIG_PATH_ENV, str(tmp_path))
    with pytest.raises(NestError) as err:
        load([*TINY, "cluster=my_pod"])
    assert str(err.value) == f"{path}: {says}"


def test_an_unknown_accelerator_in_a_users_defaults_names_the_file(tmp_path, monkeypatch):
    path = _my_cluster(tmp_path, "my_pod")
    path.write_text(path.read_text().replace("@_global_.accelerator: h100_sxm", "@_global_.accelerator: h300"))
    monkeypatch.setenv(CONFIG_PATH_ENV, str(tmp_path))
    with pytest.raises(NestError) as err:
        load([*TINY, "cluster=my_pod"])
    assert str(err.value) == (f"{path}: defaults: accelerator h300: unknown accelerator; choose one of: a100_80gb, b200, "
                              f"gb200, gb300, h100_sxm, h200, tpuv4 (your own accelerators go in a folder listed in {CONFIG_PATH_ENV}, "
                              "as accelerator/h300.yaml)")


def test_an_edited_or_removed_user_file_composes_afresh(tmp_path, monkeypatch):
    """Compositions are kept by the bytes of the config files (config/load.py _hydra_compose): a user file edited
    between two loads (the same length, within one file-time tick) gives the new value, a removed one is unknown."""
    path = _my_cluster(tmp_path, "my_pod")
    monkeypatch.setenv(CONFIG_PATH_ENV, str(tmp_path))
    text = path.read_text()
    spine = "{name: spine, fan_out: 4,"
    assert spine in text  # 8 GPUs a node x 32 nodes an SU x 4 SUs = 1024
    path.write_text(text.replace(spine, "{name: spine, fan_out: 2,"))
    assert load(["cluster=my_pod"]).problem.num_devices == 8 * 32 * 2
    path.write_text(text.replace(spine, "{name: spine, fan_out: 3,"))  # the same size, maybe the same file time
    assert load(["cluster=my_pod"]).problem.num_devices == 8 * 32 * 3
    path.unlink()
    with pytest.raises(NestError, match=r"^cluster=my_pod: unknown cluster"):
        load(["cluster=my_pod"])
