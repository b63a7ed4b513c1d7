"""A local fake transport: each "host" is a directory on this machine and its commands run in a real `sh`.

For unit tests of orchestration (job start/status/stop, provisioning, dispatch) without Docker or SSH:
`Remote(hosts, options, transport=LocalTransport(tmp_path))`, or for every session a test's commands open,
clusterctl.transport.default. Each host's commands start in its own home directory (root/<host address>),
with HOME set to it, so the host tools are installed and the jobs run there, as they would on a remote
machine. A Transport like the OpenSSH one (a ProcessTransport: the same output collection, deadlines and
exit codes); never used against real hosts.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from .host import Host
from .process import ProcessTransport

__all__ = ["LocalTransport"]


class LocalTransport(ProcessTransport):
    """Runs each host's commands as local `sh -c` processes in that host's own home directory."""

    def __init__(self, root: str | os.PathLike, env: dict[str, str] | None = None):
        self.root = Path(root)
        self.env = dict(env or {})

    def home(self, host: Host) -> Path:
        """The directory that plays `host`'s home directory (created on first use)."""
        path = self.root / host.address
        path.mkdir(parents=True, exist_ok=True)
        return path

    def popen(self, host: Host, command: str) -> subprocess.Popen:
        """Start `command` for `host` with pipes on stdin, stdout and stderr, as the OpenSSH client would."""
        home = self.home(host)
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home), "LANG": "C.UTF-8",
               "USER": os.environ.get("USER", "root"), "LOGNAME": os.environ.get("USER", "root"), **self.env}
        return subprocess.Popen(["sh", "-c", command], cwd=home, env=env, stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
