"""Errors raised by the parameter-server runtime, all rooted in ClusterctlError."""

from __future__ import annotations

from collections.abc import Iterable

from clusterctl.errors import ClusterctlError

__all__ = [
    "AuthError",
    "BarrierTimeoutError",
    "CheckpointError",
    "ProtocolError",
    "PsConfigError",
    "PsError",
    "PsTimeoutError",
    "RemoteOpError",
]


class PsError(ClusterctlError):
    """Root of the parameter-server errors."""


class PsConfigError(PsError):
    """The process environment or constructor arguments do not describe a valid pserver job."""

    exit_code = 2


class ProtocolError(PsError):
    """A message does not follow the wire protocol (malformed header, unknown op, bad frame sizes)."""


class AuthError(ProtocolError):
    """A pserver refused this process's key, or the two ends disagree on authentication (auth.py)."""


class RemoteOpError(PsError):
    """A pserver answered a request with an error reply; carries the endpoint and the server's code."""

    def __init__(self, endpoint: str, code: str, message: str):
        self.endpoint = endpoint
        self.code = code
        self.remote_message = message
        super().__init__(f"pserver {endpoint} rejected the request ({code}): {message}")


class PsTimeoutError(PsError):
    """A pserver did not answer within the client's timeout (dead, unreachable or stuck)."""

    def __init__(self, endpoints: Iterable[str], op: str, timeout: float, hint: str = ""):
        self.endpoints = tuple(endpoints)
        self.op = op
        self.timeout = timeout
        super().__init__(
            f"no reply to {op!r} within {timeout:g}s from pserver(s) {', '.join(self.endpoints)}{hint}"
        )


class BarrierTimeoutError(PsError):
    """A sync-mode barrier waited longer than its timeout; carries the trainer ids that never arrived."""

    def __init__(self, missing: Iterable[int], timeout: float, step: int):
        self.missing = tuple(sorted(missing))
        self.timeout = timeout
        self.step = step
        shown = ", ".join(map(str, self.missing[:16])) + (
            f", ... ({len(self.missing):,} in all)" if len(self.missing) > 16 else "")
        super().__init__(f"sync barrier for step {step} timed out after {timeout:g}s; missing trainer id(s): {shown}")


class CheckpointError(PsError):
    """A checkpoint is missing, incomplete, or inconsistent across pservers."""
