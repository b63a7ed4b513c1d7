"""Helpers shared by every test tier on this machine: free loopback ports, GUIDE §3's orphan finder, mpiexec.

Importable as ``helpers`` from any test module: pytest puts tests/ on sys.path when it loads
tests/conftest.py (rootdir conftest, default "prepend" import mode). Cluster-side helpers (specs for the
session cluster, CLI runs, the orphan finder run inside the nodes) are in tests/integration/clusterlib.py.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import socket
import sys
import time
import threading
from pathlib import Path

__all__ = ["MPIEXEC", "free_port", "free_ports", "free_port_base", "job_pids", "FakeCoordinator", "pids_running"]

# MPICH's mpiexec from the `mpich` wheel next to the interpreter, else one on PATH; None: the MPI tests skip.
MPIEXEC = shutil.which("mpiexec", path=str(Path(sys.executable).parent)) or shutil.which("mpiexec")


# Test ports come from below the kernel's ephemeral range (32768 and up on Linux): a port the kernel hands to
# bind(port 0), to an outgoing connection or to Docker's port publishing is never one of these, so the port a
# test picked stays free until the test's own server binds it. (Port 0 picked then released is not safe: in the
# moment before the server binds it, an ssh connection of the other test lane may take it; CI saw exactly that.)
_LOW, _HIGH = 20000, 32000
_handed: set[int] = set()
_handed_lock = threading.Lock()


def _bindable(addr: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((addr, port))
        except OSError:
            return False
    return True


def free_port_base(width: int, addrs: tuple[str, ...] = ("127.0.0.1",)) -> int:
    """A port p such that p .. p+width-1 are free on every address in `addrs` (just now) and were not handed out
    before in this process. Below the kernel's ephemeral range, where nothing else takes it meanwhile."""
    rng = random.Random()
    with _handed_lock:
        for _ in range(500):
            base = rng.randrange(_LOW, _HIGH - width)
            ports = range(base, base + width)
            if _handed.isdisjoint(ports) and all(_bindable(a, p) for a in addrs for p in ports):
                _handed.update(ports)
                return base
    raise RuntimeError("no free port range found")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` now and that nothing but the caller will take (see free_port_base)."""
    return free_port_base(1, (host,))


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct TCP ports that are free on ``host`` now (see free_port)."""
    return [free_port(host) for _ in range(n)]


def job_pids(job: str) -> list[int]:
    """Pids on this machine whose /proc/<pid>/environ carries CLUSTERCTL_JOB=<job> exactly (GUIDE section 3's orphans).

    A zombie's environ reads empty, so only live processes are found. Self-contained (os only):
    tests/integration/clusterlib.py sends this function's source to the nodes."""
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


class FakeCoordinator:
    """Listens on a job's coordinator port as an agent's coordinator would not: challenges every connection
    (protocol `version`), records what the peer answers in `received`, then sends `after` (e.g. a forged
    welcome and stop). `connections` counts the connections it took."""

    def __init__(self, port: int, *, version: int = 2, after: bytes = b"", timeout: float = 2.0):
        self.srv = socket.create_server(("127.0.0.1", port))
        self.srv.settimeout(0.2)
        self.version, self.after, self.timeout = version, after, timeout
        self.received, self.connections, self.stop = b"", 0, threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self) -> None:
        """Accept, challenge, read one line, send `after`; until close()."""
        while not self.stop.is_set():
            try:
                conn, _ = self.srv.accept()
            except socket.timeout:
                continue
            self.connections += 1
            with conn:
                conn.settimeout(self.timeout)
                try:
                    challenge = {"type": "challenge", "version": self.version, "nonce": "ab" * 32}
                    conn.sendall(json.dumps(challenge).encode() + b"\n")
                    self.received += conn.makefile("rb").readline()
                    if self.after:
                        conn.sendall(self.after)
                        time.sleep(0.1)
                except OSError:
                    pass

    def close(self) -> None:
        """Stop listening."""
        self.stop.set()
        self.thread.join(5)
        self.srv.close()


def tiny_wheel(folder: Path, name: str = "tinypkg", version: str = "1.0") -> Path:
    """A minimal pure-Python wheel in `folder` (what pip download accepts from --find-links)."""
    import zipfile

    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}-{version}-py3-none-any.whl"
    dist = f"{name}-{version}.dist-info"
    files = {f"{name}/__init__.py": b"X = 1\n",
             f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode(),
             f"{dist}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    with zipfile.ZipFile(path, "w") as zf:
        for arc, data in files.items():
            zf.writestr(arc, data)
        zf.writestr(f"{dist}/RECORD", "".join(f"{a},,\n" for a in files) + f"{dist}/RECORD,,\n")
    return path


class SshAgent:
    """A real ssh-agent of a test's own, its socket in `folder`; add() loads a key (one with a passphrase through
    an SSH_ASKPASS script, as a desktop gives it); stop() ends it."""

    def __init__(self, folder: Path):
        import subprocess

        if not shutil.which("ssh-agent"):
            import pytest

            pytest.skip("no ssh-agent")
        self.folder, self.sock = folder, folder / "agent.sock"
        self.proc = subprocess.Popen(["ssh-agent", "-D", "-a", str(self.sock)], stdout=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while not self.sock.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise AssertionError("ssh-agent did not start")
            time.sleep(0.01)

    def add(self, key: Path, passphrase: str = "") -> None:
        import subprocess

        askpass = self.folder / "askpass"
        askpass.write_text(f"#!/bin/sh\necho '{passphrase}'\n")
        askpass.chmod(0o700)
        res = subprocess.run(["ssh-add", "-q", str(key)], capture_output=True, stdin=subprocess.DEVNULL,
                             env={"SSH_AUTH_SOCK": str(self.sock), "PATH": os.environ["PATH"], "DISPLAY": "none",
                                  "SSH_ASKPASS": str(askpass), "SSH_ASKPASS_REQUIRE": "force"})
        assert res.returncode == 0, res.stderr

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


def ssh_keygen(path: Path, passphrase: str = "") -> Path:
    """A new ed25519 key pair at `path` (and `path`.pub)."""
    import subprocess

    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", passphrase, "-f", str(path)], check=True,
                   capture_output=True, stdin=subprocess.DEVNULL)
    return path


def pids_running(argv: list[str]) -> list[int]:
    """The pids of this machine's processes whose command line is exactly `argv` (a marker a test gave a process
    that must not outlive what started it)."""
    want = b"".join(a.encode() + b"\0" for a in argv)
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if (entry / "cmdline").read_bytes() == want:
                found.append(int(entry.name))
        except (OSError, ValueError):
            continue
    return found
