"""At most a few SSH handshakes in flight per sshd: new connections wait for earlier ones to log in.

sshd's MaxStartups (OpenSSH's default 10:30:100) starts dropping connections that have not yet logged in
once 10 are pending; 64 hosts behind one bastion opened at once are 64 pending connections at the
bastion's sshd, and 30 of them timed out in the banner exchange on a loaded machine (docs/benchmarks.md).
So Remote lets at most HANDSHAKES_PER_BASTION new connections through one first jump hop be in their
handshake at a time (and at most HANDSHAKES_DIRECT to hosts reached directly, each its own sshd, for the
controller's own CPU); a connection leaves the gate when it has logged in (the transport says when: for
OpenSSH, ssh's LocalCommand, run after the login (to the first bastion, or to the host reached directly), touches a file; for paramiko, open() returning), when it
failed, or after HOLD_MAX seconds at most, so a stuck handshake never holds the others for ever. Commands
over a connection already open (ControlMaster) do not pass the gate at all.
"""

from __future__ import annotations

import threading
import time

from .host import Host

__all__ = ["HandshakeGate", "HANDSHAKES_PER_BASTION", "HANDSHAKES_DIRECT", "gate_key"]

HANDSHAKES_PER_BASTION = 8  # under MaxStartups' first number (10) with room for others' connections
HANDSHAKES_DIRECT = 32  # every direct host has its own sshd: a bound for the controller's CPU only


def gate_key(host: Host) -> str:
    """The sshd a new connection to `host` costs a pending login at first: its first bastion, else ""
    (the set of hosts reached directly)."""
    return f"jump:{host.jump[0]}" if host.jump else ""


class HandshakeGate:
    """Counting slots per key (a bastion, or the direct hosts): acquire before a new connection, release
    once it logged in or failed. Thread-safe; waiting callers are served first come, first served."""

    def __init__(self, per_bastion: int = HANDSHAKES_PER_BASTION, direct: int = HANDSHAKES_DIRECT):
        self.per_bastion, self.direct = max(1, per_bastion), max(1, direct)
        self._cond = threading.Condition()
        self._busy: dict[str, int] = {}
        self._queue: dict[str, list[object]] = {}
        self.peak: dict[str, int] = {}  # the most handshakes in flight at once per key (for tests, benchmarks)

    def limit(self, key: str) -> int:
        """How many handshakes may be in flight at once for `key`."""
        return self.direct if key == "" else self.per_bastion

    def in_flight(self, key: str) -> int:
        """How many handshakes hold a slot of `key` now."""
        with self._cond:
            return self._busy.get(key, 0)

    def acquire(self, key: str, blocking: bool = True, timeout: float | None = None) -> bool:
        """Take a slot of `key`; False when none was free (blocking=False) or none came within `timeout`."""
        ticket = object()
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            queue = self._queue.setdefault(key, [])
            if not blocking and (queue or self._busy.get(key, 0) >= self.limit(key)):
                return False
            queue.append(ticket)
            try:
                while queue[0] is not ticket or self._busy.get(key, 0) >= self.limit(key):
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        return False
                    self._cond.wait(left)
            finally:
                queue.remove(ticket)
                self._cond.notify_all()  # the next in line may go now (or re-check its place)
            self._busy[key] = self._busy.get(key, 0) + 1
            self.peak[key] = max(self.peak.get(key, 0), self._busy[key])
            return True

    def release(self, key: str) -> None:
        """Give a slot of `key` back (its connection logged in, failed or gave up waiting)."""
        with self._cond:
            if self._busy.get(key, 0) <= 0:
                raise RuntimeError(f"handshake gate {key!r} released more often than acquired")
            self._busy[key] -= 1
            self._cond.notify_all()
