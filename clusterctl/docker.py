"""A thin helper around the docker CLI: argv lists only (never a shell), errors that carry the result."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from .errors import ClusterctlError

__all__ = [
    "DockerError",
    "DockerUnavailable",
    "docker_binary",
    "run",
    "ensure_daemon",
    "daemon_running",
    "image_exists",
    "image_id",
    "pull",
    "inspect",
    "ids_with_label",
    "buildkit_available",
]

DEFAULT_TIMEOUT = 300.0
DAEMON_START_TIMEOUT = 60.0


class DockerUnavailable(ClusterctlError):
    """Docker is not installed, or its daemon is not running and cannot be started."""


class DockerError(ClusterctlError):
    """A docker command failed; carries its argv, exit code and stderr."""

    def __init__(self, argv: Sequence[str], returncode: int | None, stderr: str, reason: str = ""):
        self.argv = list(argv)
        self.returncode = returncode
        self.stderr = stderr
        self.reason = reason
        shown = " ".join(self.argv)
        if returncode is None:
            message = f"`{shown}` {reason}"
        else:
            tail = " | ".join(stderr.strip().splitlines()[-5:])
            message = f"`{shown}` exited {returncode}" + (f": {tail}" if tail else "")
        super().__init__(message)


def docker_binary() -> str:
    """Path of the docker CLI, or raise DockerUnavailable with the install hint."""
    path = shutil.which("docker")
    if path is None:
        raise DockerUnavailable("docker is not installed: run `apt-get install docker.io` (Debian/Ubuntu)")
    return path


def run(
    args: Sequence[str],
    *,
    input: str | None = None,
    timeout: float | None = DEFAULT_TIMEOUT,
    check: bool = True,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run `docker ARGS...` and return the completed process; raise DockerError on failure if check."""
    argv = [docker_binary(), *args]
    full_env = {**os.environ, **env} if env else None
    try:
        proc = subprocess.run(
            argv,
            input=input,
            capture_output=True,
            text=True,
            timeout=timeout,
            env=full_env,
            cwd=cwd,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        raise DockerError(argv, None, _text(exc.stderr), f"timed out after {timeout:g}s") from exc
    if check and proc.returncode != 0:
        raise DockerError(argv, proc.returncode, proc.stderr)
    return proc


def _text(data: bytes | str | None) -> str:
    if data is None:
        return ""
    return data.decode(errors="replace") if isinstance(data, bytes) else data


def daemon_running(timeout: float = 10.0) -> bool:
    """True if `docker info` reaches a daemon within timeout seconds."""
    try:
        proc = run(["info", "--format", "{{.ServerVersion}}"], timeout=timeout, check=False)
    except DockerError:
        return False
    return proc.returncode == 0 and bool(proc.stdout.strip())


def ensure_daemon(log_path: Path, timeout: float = DAEMON_START_TIMEOUT) -> bool:
    """Make sure a docker daemon answers; start `dockerd` in the background if needed. True if started."""
    docker_binary()
    if daemon_running():
        return False
    dockerd = shutil.which("dockerd")
    if dockerd is None:
        raise DockerUnavailable(
            "the docker daemon is not running and dockerd is not installed: run `apt-get install docker.io`"
        )
    if os.geteuid() != 0:
        raise DockerUnavailable(
            "the docker daemon is not running and only root can start it: "
            "run `sudo systemctl start docker` (or `sudo dockerd &`)"
        )
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        # A session of its own: the daemon outlives this process and its terminal's signals.
        proc = subprocess.Popen([dockerd], stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if daemon_running(timeout=5.0):
            return True
        if proc.poll() is not None and not daemon_running(timeout=5.0):
            raise DockerUnavailable(f"dockerd exited with code {proc.returncode}; see {log_path}")
        time.sleep(0.5)
    raise DockerUnavailable(f"dockerd did not answer within {timeout:g}s; see {log_path}")


def inspect(kind: str, refs: Sequence[str]) -> list[dict[str, Any]]:
    """`docker KIND inspect REFS...` parsed; missing objects are left out instead of raising."""
    if not refs:
        return []
    proc = run([kind, "inspect", "--", *refs], check=False)  # `--`: a ref that starts with '-' is not an option
    if not proc.stdout.strip():
        return []
    return list(json.loads(proc.stdout))


def image_id(ref: str) -> str | None:
    """The local image ID of ref, or None if it is not present locally."""
    found = inspect("image", [ref])
    return str(found[0]["Id"]) if found else None


def image_exists(ref: str) -> bool:
    """True if the image is present locally."""
    return image_id(ref) is not None


def pull(ref: str, timeout: float) -> bool:
    """Try to pull ref within timeout seconds; True on success, False if no registry answered."""
    try:
        run(["pull", "--quiet", "--", ref], timeout=timeout)
    except DockerError:
        return False
    return True


def ids_with_label(kind: str, label: str) -> list[str]:
    """IDs (or names, for networks) of containers or networks carrying label (`key=value`)."""
    if kind == "container":
        proc = run(["ps", "--all", "--quiet", "--no-trunc", "--filter", f"label={label}"])
    elif kind == "network":
        proc = run(["network", "ls", "--quiet", "--no-trunc", "--filter", f"label={label}"])
    else:
        raise ValueError(f"unknown docker object kind: {kind!r}")
    return proc.stdout.split()


def buildkit_available() -> bool:
    """True if the CLI has the buildx plugin; without it `docker build` needs DOCKER_BUILDKIT=0."""
    return run(["buildx", "version"], check=False, timeout=30).returncode == 0
