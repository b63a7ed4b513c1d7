"""Helpers shared by every test tier on this machine: free loopback ports, GUIDE §3's orphan finder, mpiexec.

Importable as ``helpers`` from any test module: pytest puts tests/ on sys.path when it loads
tests/conftest.py (rootdir conftest, default "prepend" import mode). Cluster-side helpers (specs for the
session cluster, CLI runs, the orphan finder run inside the nodes) are in tests/integration/clusterlib.py.
"""

from __future__ import annotations

import os
import shutil
import socket
import sys
from pathlib import Path

__all__ = ["MPIEXEC", "free_port", "free_ports", "job_pids"]

# MPICH's mpiexec from the `mpich` wheel next to the interpreter, else one on PATH; None: the MPI tests skip.
MPIEXEC = shutil.which("mpiexec", path=str(Path(sys.executable).parent)) or shutil.which("mpiexec")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``host`` a moment ago."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct TCP ports that were free on ``host`` a moment ago (all bound at once, then released)."""
    socks, ports = [], []
    for _ in range(n):
        s = socket.socket()
        s.bind((host, 0))
        socks.append(s)
        ports.append(s.getsockname()[1])
    for s in socks:
        s.close()
    return ports


def job_pids(job: str) -> list[int]:
    """Pids on this machine whose /proc/<pid>/environ carries CLUSTERCTL_JOB=<job> exactly (GUIDE section 3's orphans).

    Self-contained (os only): tests/integration/clusterlib.py sends this function's source to the nodes."""
    needle = f"CLUSTERCTL_JOB={job}".encode()
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as fh:
                env = fh.read().split(b"\0")
        except OSError:
            continue
        if needle in env:
            found.append(int(name))
    return found
