"""Every temporary file of a test run lies in one folder, so that a green run leaves nothing in /tmp: the controller
process makes it before anything is collected (importing megatron-core at collection makes TorchInductor's cache
folder) and sets TMPDIR to it for itself and every process it starts (pytest-xdist's workers, launch's nest-run-*,
torchrun's torchelastic_* logs, Chromium's profile, pip's build folders, pytest's own base folder). A green run
removes it; a failed run keeps it for reading and says where. (The SLURM cluster's folder is the exception:
tests/slurm_cluster.py, which removes it itself.)

In pytest-xdist's workers, which keep every core busy already, a search whose solver.jobs is unset takes one
process (NEST_MEGATRON_JOBS=1, inherited by every process a test starts): forked search workers there doubled the
CPU each plan took (10 paper-grid plans, os.times() around api.plan: 5.8 s of CPU alone, 3.9 s + 7.1 s in the two
workers' processes)."""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest

from nest_megatron.solver.visit import JOBS_ENV

RUN_FOLDER_ENV = "NEST_MEGATRON_TEST_TMPDIR"  # the run's folder, set by the controller; workers inherit it
_OWN_FOLDER = pytest.StashKey[str]()  # in the process that made the folder


def pytest_configure(config):
    if "PYTEST_XDIST_WORKER" in os.environ:  # set in each xdist worker process
        os.environ.setdefault(JOBS_ENV, "1")
    elif RUN_FOLDER_ENV not in os.environ:
        # Short: the SLURM cluster's and munged's unix sockets lie below it (108 bytes at most on Linux).
        folder = tempfile.mkdtemp(prefix="nest-tests-")
        os.environ[RUN_FOLDER_ENV] = os.environ["TMPDIR"] = folder
        tempfile.tempdir = None  # tempfile caches its folder: read TMPDIR again
        config.stash[_OWN_FOLDER] = folder


@pytest.hookimpl(trylast=True)  # after pytest's own clean-up of its base folder, which lies inside
def pytest_sessionfinish(session, exitstatus):
    folder = session.config.stash.get(_OWN_FOLDER, None)
    if folder is None:
        return
    if exitstatus == 0 or not os.listdir(folder):  # green, or nothing to read
        shutil.rmtree(folder, ignore_errors=True)
    else:
        print(f"\nthe run's temporary files are kept in {folder}")

