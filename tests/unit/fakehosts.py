"""Fake hosts for unit tests of the operations: each host a directory on this machine, its commands a real `sh`.

`FakeCluster` writes a spec (hosts n0, n1, ... with `ssh.config: none`, train addresses 127.0.0.1,
127.0.0.2, ... so that the jobs' endpoints are reachable here, free ports), a workspace, and opens
`Session`s over `Remote(..., transport=LocalTransport(root))` (clusterctl/transport/local.py): the real
operations, the real host tools (agent, hostws) and real processes, without SSH or Docker. `everywhere`
sends every session the test's commands open (the CLI front ends, the backends) to the same fake hosts,
through the supported seam for it, clusterctl.transport.default.
Fake executables (`apt-get`, `sbatch`, ...) go into `bin`, first on every fake host's PATH.
"""

from __future__ import annotations

import os
import shlex
import secrets
import stat
import sys
import textwrap
import time
from contextlib import contextmanager
from pathlib import Path

import yaml

from clusterctl.ops import Session, plan_for
from clusterctl.remote import Remote, SshOptions
from clusterctl.spec import load_spec
from clusterctl.transport import default
from clusterctl.transport.local import LocalTransport
from clusterctl.transport.process import ProcessTransport
from helpers import free_port_base, job_pids  # noqa: F401  (re-exported for the fake-host tests)

__all__ = ["FakeCluster", "FaultyTransport", "refused", "free_port_base", "fake_exe", "wait_until", "job_pids"]


def fake_exe(folder: Path, name: str, script: str) -> Path:
    """Write an executable `sh` script `name` into `folder` (a fake tool for the fake hosts' PATH)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text("#!/bin/sh\n" + textwrap.dedent(script).lstrip("\n"))
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return path


def wait_until(pred, timeout: float = 15.0, interval: float = 0.1):
    """Poll `pred()` until it returns something truthy (returned) or `timeout` passes (AssertionError)."""
    deadline = time.monotonic() + timeout
    while True:
        got = pred()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout}s (last: {got!r})")
        time.sleep(interval)


class FakeCluster:
    """A spec over fake hosts in `tmp_path`, its workspace, and sessions to them."""

    def __init__(self, tmp_path: Path, *, hosts: int = 2, job: dict | None = None, files: dict[str, str] | None = None,
                 extra: dict | None = None, env: dict[str, str] | None = None):
        self.tmp = Path(tmp_path)
        self.root = self.tmp / "hosts"
        self.bin = self.tmp / "bin"
        self.bin.mkdir(parents=True, exist_ok=True)
        # the hosts' python3: this interpreter's base (not a venv with clusterctl in it, not a version manager's
        # shim script, which would cost every host command a `bash` and a lookup)
        (self.bin / "python3").symlink_to(getattr(sys, "_base_executable", None) or sys.executable)
        self.local = self.tmp / "ws"
        self.local.mkdir(exist_ok=True)
        for rel, text in (files if files is not None else {"train.py": "print('hello')\n"}).items():
            self.write(rel, text)
        self.name = "fk-" + secrets.token_hex(4)  # a job id of its own: /proc sweeps never meet another test's
        self.remote_dir = f"ws-{self.name}"  # so is its dispatch record (kept per host address and remote dir)
        addrs = tuple(f"127.0.0.{i + 1}" for i in range(hosts))
        base = free_port_base(8, addrs)
        spec = {
            "name": self.name,
            "ssh": {"config": "none", "user": "u", "command_timeout": 20},
            "hosts": [{"address": f"n{i}", "train_address": addrs[i]} for i in range(hosts)],
            "workspace": {"local": "ws", "remote": self.remote_dir},
            "job": {"entrypoint": ["python3", "train.py"], "trainers": 1, "grace": 2,
                    "ports": {"control": base, "master": base + 1, "trainer": base + 2, "pserver": base + 5},
                    **(job or {})},
            **(extra or {}),
        }
        self.spec_path = self.tmp / "cluster.yaml"
        self.spec_path.write_text(yaml.safe_dump(spec, sort_keys=False))
        self.env = {"PATH": f"{self.bin}:{os.environ.get('PATH', '/usr/bin:/bin')}", **(env or {})}
        self.transport = LocalTransport(self.root, env=self.env)

    def write(self, rel: str, text: str | bytes) -> Path:
        """Write a file of the local workspace."""
        path = self.local / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(text, bytes):
            path.write_bytes(text)
        else:
            path.write_text(textwrap.dedent(text))
        return path

    def home(self, i: int = 0) -> Path:
        """Host n<i>'s home directory."""
        return self.root / f"n{i}"

    def workspace(self, i: int = 0) -> Path:
        """Host n<i>'s dispatched workspace (the symlink to its current generation)."""
        return self.home(i) / self.remote_dir

    def spec(self):
        """The spec, loaded as the CLI loads it."""
        return load_spec(str(self.spec_path))

    @contextmanager
    def session(self, *, transport=None, command_timeout: float | None = None):
        """A Session over the fake hosts (its Remote closed afterwards)."""
        spec = self.spec()
        plan = plan_for(spec)
        options = SshOptions(config="none", command_timeout=command_timeout or spec.ssh.command_timeout)
        with Remote(plan.hosts, options, transport=transport or self.transport) as remote:
            yield Session(spec, plan, remote)

    def everywhere(self, monkeypatch, transport=None) -> "FakeCluster":
        """Make every session opened during the test that names no transport (the CLI front ends, the
        backends, ops.slurm) go to the fake hosts, through clusterctl.transport.default's factory (set for
        this test only), and keep the controller's caches (plan cache, provisioning logs) in the test's
        directory."""
        fake = transport or self.transport
        monkeypatch.setattr(default, "factory", lambda hosts, options: fake)
        monkeypatch.setenv("XDG_CACHE_HOME", str(self.tmp / "cache"))
        return self


def refused(host: str) -> str:
    """A regex of how a `down` host of FaultyTransport is named: Remote words the OpenSSH client's own failure
    ("cannot connect to n1: Connection refused"); a transport that reads no ssh message in an exit 255 names
    its last line ("connection to n1 lost: ssh: connect to host n1 port 22: Connection refused")."""
    return rf"(cannot connect to {host}|connection to {host} lost: ssh: connect to host {host} port 22): Connection refused"


class FaultyTransport(ProcessTransport):
    """A LocalTransport whose `down` hosts answer as an unreachable host does over ssh (exit 255, ssh's own
    message), whose `hung` hosts never answer: their command takes its stdin, as the ssh client does
    (its channel window holds far more than a control command sends), then sleeps; and whose `hostile`
    hosts ({address: (stdout, exit code)}) take their stdin and answer that instead of running the command,
    as a compromised host may."""

    def __init__(self, inner: LocalTransport, *, down=(), hung=(), hostile=None, only: str = ""):
        self.inner, self.down, self.hung, self.only = inner, set(down), set(hung), only  # only: commands containing it
        self.hostile = dict(hostile or {})

    def popen(self, host, command: str):
        """Start `command` for `host`, or the fault planned for that host."""
        if self.only in command and host.address in self.down:
            command = f"echo 'ssh: connect to host {host.address} port 22: Connection refused' >&2; exit 255"
        elif self.only in command and host.address in self.hung:
            command = "cat >/dev/null; exec sleep 60"
        elif self.only in command and host.address in self.hostile:
            stdout, code = self.hostile[host.address]
            command = f"cat >/dev/null; printf '%s\\n' {shlex.quote(stdout)}; exit {code}"
        return self.inner.popen(host, command)
