"""Every temporary folder of a test session lies under pytest's own base folder, so that a green run leaves nothing
in /tmp (pyproject.toml: tmp_path_retention_policy = "failed" removes it): launch's default run directory
(nest-run-*), torchrun's torchelastic_* logs, Chromium's profile, pip's build folders all take tempfile's folder,
which TMPDIR sets here for this process and every process it starts. (The SLURM cluster's folder is the exception:
tests/slurm_cluster.py, which removes it itself.)"""

from __future__ import annotations

import os
import tempfile

import pytest


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

