"""Shared test helpers."""

import os
import signal
import textwrap
import time
from pathlib import Path

import pytest

_STARTED = time.time()


def pytest_sessionfinish(session, exitstatus):
    """Remove the MPI runtime's files this run's tests left (MPICH's segments in /dev/shm, ~2 MiB of memory each
    until the next boot, hydra's topology files in /tmp, and Open MPI's launchers' session directories in /tmp and
    TMPDIR: their ranks and launchers killed on purpose, outside any clusterctl stop, which removes its own:
    clusterctl/host/stopping.py): made since the run began, of this user, used by nothing (a session directory:
    its launcher gone)."""
    from clusterctl.host.procfs import mpi_leftovers, release_mpi_files

    release_mpi_files(mpi_leftovers(since=_STARTED), None)


def pytest_configure(config):
    """Ctrl+C as in a terminal, however the suite was started: a shell's background job starts with SIGINT
    ignored, and an ignored signal stays ignored in every process started from it, so the tests that press
    Ctrl+C (here, and in the commands they start) would see nothing happen. A handler is not inherited: the
    children start with the default again."""
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(autouse=True)
def _umask_kept():
    """The process's umask as each test found it: a test that changed it and left it (slurmctl.main sets 077, as the
    login node's command does) made every later test's files private, and dpkg-deb then refused a test package's
    DEBIAN directory in another module. Restored, and the test that left it fails at its teardown."""
    before = os.umask(0o022)
    os.umask(before)
    yield
    after = os.umask(before)
    if after != before:
        pytest.fail(f"the test left the process's umask at {after:03o} (it was {before:03o}): restore it", pytrace=False)


@pytest.fixture
def write_spec(tmp_path: Path):
    """Write a dedented YAML spec into tmp_path and return its path."""

    def write(text: str, name: str = "cluster.yaml") -> Path:
        path = tmp_path / name
        path.write_text(textwrap.dedent(text))
        return path

    return write
