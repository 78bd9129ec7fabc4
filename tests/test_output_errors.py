"""Every command's out= / report= / cache= that cannot be written: one line naming the key, the path and what is
wrong, exit 2, and nothing left behind (no temporary file, no plan beside a report that failed)."""

from __future__ import annotations

from pathlib import Path

import pytest

from nest_megatron.cli import main

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["model=tiny_gpt", "cluster=dgx_h100_superpod", "cluster.num_devices=16", "train.global_batch_size=64"]
PINS = ["plan.tp=2", "plan.pp=1", "plan.mbs=1"]
# A training script and its Megatron arguments, as sbatch takes them after `--`
SCRIPT = ["--", str(ROOT / "tests" / "slurm_probe.py"), "--num-layers", "2", "--hidden-size", "64",
          "--num-attention-heads", "4", "--seq-length", "32", "--max-position-embeddings", "32",
          "--micro-batch-size", "2", "--global-batch-size", "8", "--vocab-size", "128", "--bf16"]

# command -> (argv before the out= option, argv after it)
COMMANDS = {
    "plan": (["plan", *SMALL], []),
    "evaluate": (["evaluate", *SMALL, *PINS], []),
    "nemo": (["nemo", *SMALL], []),
    "bridge": (["bridge", *SMALL], []),
    "sbatch": (["sbatch", "--nodes", "2", "--gpus-per-node", "8", "cluster=dgx_h100_superpod"], SCRIPT),
    "trace": (["trace", "model=tiny_gpt", "--layers", "1"], []),
    "sweep": (["sweep", *SMALL[:3], "train.global_batch_size=32,64"], []),
}

# (out= value, the message after "out=VALUE: "), worked out from the folders the fixture makes
BAD_FILES = [
    ("adir", "is a folder; give a file path"),
    ("afile/plan.json", "cannot create afile (afile is a file)"),
    ("/proc/nope/plan.json", "cannot create /proc/nope (No such file or directory)"),
    ("/proc/plan.json", "cannot write in /proc (No such file or directory)"),
]


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """A folder with a folder `adir` and a file `afile` in it, as the current folder."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "adir").mkdir()
    (tmp_path / "afile").write_text("mine\n")
    return tmp_path


def error_line(capsys, argv: list[str]) -> str:
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    return err.strip()


def untouched(folder: Path) -> None:
    assert sorted(p.name for p in folder.iterdir()) == ["adir", "afile"]
    assert not list((folder / "adir").iterdir()) and (folder / "afile").read_text() == "mine\n"


@pytest.mark.parametrize("command, value, says", [
    (command, value, says) for command in COMMANDS for value, says in BAD_FILES
    if command != "sweep" or value.endswith(".json")  # sweep's out= names a .csv or .json file
])
def test_an_out_file_that_cannot_be_written_is_one_line(command, value, says, workdir, capsys):
    before, after = COMMANDS[command]
    assert error_line(capsys, [*before, f"out={value}", *after]) == f"nest-megatron {command}: error: out={value}: {says}"
    untouched(workdir)


@pytest.mark.parametrize("value, says", [
    ("afile", "is a file; give a folder"),
    ("afile/report", "cannot create afile/report (afile is a file)"),
    ("/proc/nope", "cannot create /proc/nope (No such file or directory)"),
])
def test_a_report_folder_that_cannot_be_made_is_one_line_before_the_search(value, says, workdir, capsys):
    line = error_line(capsys, ["plan", *SMALL, f"report={value}", "out=plan.json"])
    assert line == f"nest-megatron plan: error: report={value}: {says}"
    untouched(workdir)  # and no plan.json either


@pytest.mark.parametrize("value, says", [
    ("afile", "is a file; give a folder"),
    ("/proc/nope", "cannot create /proc/nope (No such file or directory)"),
])
def test_explain_out_that_cannot_be_made_is_one_line(value, says, workdir, capsys):
    assert main(["plan", *SMALL, *PINS, "out=adir/plan.json", "--quiet"]) == 0
    line = error_line(capsys, ["explain", "adir/plan.json", f"out={value}"])
    assert line == f"nest-megatron explain: error: out={value}: {says}"
    assert sorted(p.name for p in (workdir / "adir").iterdir()) == ["plan.json"]


def test_an_out_file_is_written_where_its_folders_are_missing(workdir, capsys):
    assert main(["plan", *SMALL, *PINS, "out=new/sub/plan.json", "--quiet"]) == 0
    assert sorted(p.name for p in (workdir / "new" / "sub").iterdir()) == ["plan.json"]  # no temporary file left
