"""Every temporary folder of a test session lies under pytest's own base folder, so that a green run leaves nothing
in /tmp (pyproject.toml: tmp_path_retention_policy = "failed" removes it): launch's default run directory
(nest-run-*), torchrun's torchelastic_* logs, Chromium's profile, pip's build folders all take tempfile's folder,
which TMPDIR sets here for this process and every process it starts. (The SLURM cluster's folder is the exception:
tests/slurm_cluster.py, which removes it itself.)

In pytest-xdist's workers, which keep every core busy already, a search whose solver.jobs is unset takes one
process (NEST_MEGATRON_JOBS=1, inherited by every process a test starts): forked search workers there doubled the
CPU each plan took (10 paper-grid plans, os.times() around api.plan: 5.8 s of CPU alone, 3.9 s + 7.1 s in the two
workers' processes)."""

from __future__ import annotations

import os
import tempfile

import pytest

from nest_megatron.solver.visit import JOBS_ENV


def pytest_configure(config):
    if "PYTEST_XDIST_WORKER" in os.environ:  # set in each xdist worker process
        os.environ.setdefault(JOBS_ENV, "1")


@pytest.fixture(scope="session", autouse=True)
def temporary_files_under_pytest(tmp_path_factory):
    # Short name: the SLURM cluster's and munged's unix sockets lie below it (108 bytes at most on Linux).
    folder = str(tmp_path_factory.mktemp("t"))
    saved = os.environ.get("TMPDIR")
    os.environ["TMPDIR"] = folder
    tempfile.tempdir = None  # tempfile caches its folder: read TMPDIR again
    yield folder
    if saved is None:
        os.environ.pop("TMPDIR", None)
    else:
        os.environ["TMPDIR"] = saved
    tempfile.tempdir = None

