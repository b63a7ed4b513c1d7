"""`backend: local`: the job on this machine, as `torchrun --standalone` would run it, but with everything
the cluster gives: the same plan and environment contract, the same host supervisor (restarts, fail-fast,
attempt logs, the job token, the sweep), the same dispatch into a generation directory, status and logs.

What a user tries before the cluster, and the proof that a backend is one module plus a registry entry:
this one is the SSH backend's operations over a transport that runs each command here, in a local shell
in the user's home directory, instead of over ssh.

    name: try-it
    backend: local
    hosts: [localhost]
    job: {entrypoint: python3 train.py, trainers: 4}
"""

from __future__ import annotations

import os
import subprocess
from typing import ClassVar

from ..transport.process import ProcessTransport
from .ssh import SshBackend

__all__ = ["LocalBackend", "ThisMachine", "LOCAL_ADDRESSES"]

LOCAL_ADDRESSES = ("localhost", "127.0.0.1", "::1")


class ThisMachine(ProcessTransport):
    """Each "remote" command runs here, as `sh -c` in the home directory, as an ssh session would start it."""

    def popen(self, host, command: str) -> subprocess.Popen:
        """Start `command` with pipes on stdin, stdout and stderr, in its own session (a stop ends it whole)."""
        home = os.path.expanduser("~")
        return subprocess.Popen(["sh", "-c", command], cwd=home, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, start_new_session=True)

    def failure_reason(self, host, stderr: str) -> str:
        """sh exits 255 only if the command does: name the last line it said."""
        said = [line.strip() for line in stderr.splitlines() if line.strip()]
        return f"local command failed: {said[-1] if said else 'exit 255'}"

    def close(self) -> None:
        """Nothing held open."""


class LocalBackend(SshBackend):
    """The job's processes on this machine, under the host supervisor; no SSH."""

    name: ClassVar[str] = "local"
    summary: ClassVar[str] = "this machine (as torchrun --standalone): the same plan, supervisor and status, no SSH"
    unsupported = (
        ("slurm", "a slurm: section needs backend: slurm"),
        ("ssh", "no SSH: the job runs on this machine"),
        ("hostfile", "the job runs on this machine: hosts: [localhost]"),
        ("hosts.*.user", "the job runs as you, on this machine"),
        ("hosts.*.port", "no SSH: the job runs on this machine"),
        ("hosts.*.proxy_jump", "no SSH: the job runs on this machine"),
        ("hosts.*.train_address", "the job's endpoints are on 127.0.0.1"),
        ("provision", "provisioning works over SSH; install what the job needs on this machine yourself"),
        ("hosts.*.spare", "one machine: there is no other host to take its place"),
        ("job.min_hosts", "one machine: there is no other host to take its place"),
    )
    ssh_hosts: ClassVar[bool] = False
    resolve_hosts: ClassVar[bool] = False

    @classmethod
    def check_spec(cls, spec) -> list:
        """One host, and it is this machine."""
        from ..spec.errors import problem

        loc = spec.located
        if loc is None:
            return []
        if len(spec.hosts) != 1:
            return [problem(loc, spec.source, ("hosts",), "backend: local runs on this machine: hosts: [localhost] "
                            f"(got {len(spec.hosts)} hosts)")]
        if spec.hosts[0].address not in LOCAL_ADDRESSES:
            return [problem(loc, spec.source, ("hosts", 0), f"backend: local runs on this machine, not on "
                            f"{spec.hosts[0].address}: use one of {', '.join(LOCAL_ADDRESSES)}")]
        if spec.job.launcher == "mpi":
            return [problem(loc, spec.source, ("job", "launcher"), "not supported with backend: local: launcher: "
                            "mpi runs mpiexec over an ssh mesh; use launcher: ssh (the default)")]
        return []

    def __init__(self, spec, plan, *, spec_path=None, options=None, transport=None):
        super().__init__(spec, plan, spec_path=spec_path, options=options, transport=transport or ThisMachine())
