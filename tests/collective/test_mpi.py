"""Runs tests/collective/mpi_cases.py under ``mpiexec -n N`` (mpi4py style) and the fault injections.

Each launch is a subprocess with a hard timeout; the assertion is on the exit status and the full
output.  MPICH's mpiexec (from the ``mpich`` wheel next to the interpreter, or on PATH) oversubscribes
a 2-core machine fine for N = 3, 4.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import MPIEXEC

pytest.importorskip("mpi4py")

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent

pytestmark = pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec found")


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CLUSTERCTL_COLLECTIVE_")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["UCX_LOG_LEVEL"] = "error"
    env.update({k: str(v) for k, v in extra.items()})
    return env


def _mpiexec(n: int, args: list[str], env: dict, timeout: float, extra: tuple = ()):
    cmd = [MPIEXEC, *extra, "-n", str(n), sys.executable, *args]
    start = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    return proc, time.monotonic() - start, cmd


FULL = os.environ.get("CLUSTERCTL_TEST_FULL") == "1"
full_only = pytest.mark.skipif(not FULL, reason="set CLUSTERCTL_TEST_FULL=1 for the oversubscribed extras")

LAYOUTS = [
    pytest.param(1, {}, id="n1"),
    pytest.param(2, {}, id="n2-shm"),
    pytest.param(3, {}, id="n3-shm", marks=full_only),     # 3 ranks: also test_ssh_launcher n3
    pytest.param(4, {}, id="n4-shm", marks=full_only),
    pytest.param(2, {"CLUSTERCTL_COLLECTIVE_SHM": "0"}, id="n2-mpi-only"),
    pytest.param(3, {"CLUSTERCTL_COLLECTIVE_SHM": "0"}, id="n3-mpi-only", marks=full_only),
    pytest.param(4, {"CLUSTERCTL_COLLECTIVE_FAKE_NODES": "2"}, id="n4-two-fake-nodes-hierarchical"),
    pytest.param(3, {"CLUSTERCTL_COLLECTIVE_FAKE_NODES": "2"}, id="n3-uneven-fake-nodes", marks=full_only),
]


@pytest.mark.timeout(150)
@pytest.mark.parametrize("n,extra_env", LAYOUTS)
def test_mpi_cases(n, extra_env):
    env = _env(CLUSTERCTL_COLLECTIVE_TIMEOUT=60, **extra_env)
    args = ["-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", str(HERE / "mpi_cases.py")]
    proc, took, cmd = _mpiexec(n, args, env, timeout=140)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{' '.join(cmd)} failed ({proc.returncode}) after {took:.1f}s:\n{out[-6000:]}"
    assert out.count(" passed") >= n, out[-3000:]
    assert " failed" not in out


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is gone for our purposes
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except OSError:
        return False


@pytest.mark.timeout(90)
@pytest.mark.parametrize("mode,extra", [("stop", ()), ("exit", ("-disable-auto-cleanup",))])
def test_fault_every_rank_ends_with_message(mode, extra, tmp_path):
    timeout_s = 3
    env = _env(CLUSTERCTL_COLLECTIVE_TIMEOUT=timeout_s)
    proc, took, cmd = _mpiexec(3, [str(HERE / "fault_worker.py"), mode, str(tmp_path)], env,
                               timeout=60, extra=extra)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert "finished without noticing" not in out
    # timeout + diagnosis grace (max(1, timeout/4)) + start-up; far below "forever"
    assert took < 30, f"took {took:.1f}s:\n{out}"
    pids = {int(p.stem): int(p.read_text()) for p in tmp_path.glob("*.pid")}
    assert sorted(pids) == [0, 1, 2], out
    host = os.uname().nodename
    want = (f"collective timeout after {timeout_s}.", f"missing rank 2 ({host}, pid {pids[2]})")
    assert all(w in out for w in want), f"expected {want} in:\n{out}"
    assert "aborting the job" in out
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in pids.values()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in pids.values() if _alive(p)], "processes left behind"
