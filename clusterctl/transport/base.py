"""What every transport shares, below all of them: the ssh options, one host's Result (which knows whether the
host was reached, whether our deadline ended it, and how to read its JSON reply), a fan-out's GroupResult
and GroupException (Fabric's names: every host's Result, and the one error that carries them), the typed
errors' use, and the small interface a transport implements (start one command on one host; finish it with
a stdin). Nothing here imports the spec or the plan: `Host` is clusterctl.transport.host's.

Transports: clusterctl.transport.openssh (the OpenSSH client, one process per host), clusterctl.sshconn
(paramiko channels) and clusterctl.transport.local (a fake: each host a directory, a real `sh`).
clusterctl.remote.Remote runs commands on many hosts at once through one of them.
"""

from __future__ import annotations

import base64
import collections
import hashlib
import json
import os
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from ..errors import CannotConnect, CommandFailed, HostError, HostFailure, RemoteError, TimedOut
from .host import Host

__all__ = ["Host", "SshOptions", "Result", "GroupResult", "GroupException", "Transport", "Running", "LineSplitter",
           "cut_short", "dropped_note", "fingerprint", "UNREACHABLE", "TIMED_OUT", "timed_out_reason", "LineCallback", "Stdin"]

UNREACHABLE = 255  # what `ssh` itself exits with when it cannot connect; used as the host's exit code
TIMED_OUT = 124  # the exit code of a command our deadline ended (as timeout(1) exits)
TAIL = 2000  # bytes of stderr kept in failure messages

LineCallback = Callable[[Host, str, str], None]  # (host, "out"|"err", line without newline)
Stdin = bytes | Callable[[Host], Iterable[bytes]] | None


@dataclass(frozen=True)
class SshOptions:
    """How to connect: ssh config, identity, host-key policy and timeouts. Paths are already resolved.

    None means "what the user's ssh config says" (config: ssh's default files; known_hosts: its
    UserKnownHostsFile, by default ~/.ssh/known_hosts)."""

    identity_file: str | None = None
    known_hosts: str | None = None
    host_key_policy: str = "strict"  # strict | accept-new | off
    connect_timeout: float = 10.0
    keepalive: int = 15
    forward_agent: bool = False
    persist: int = 0  # seconds an idle OpenSSH connection stays open for the next command (0: none)
    config: str | None = "none"  # None: ssh's default config files; "none": none; else a path
    command_timeout: float = 60.0  # deadline of control commands (status, state reads, job files, preflight)

    @classmethod
    def from_spec(cls, spec) -> "SshOptions":
        """Options from a ClusterSpec, resolving its paths against the spec file's directory."""
        from ..sshconfig import config_path

        ssh = spec.ssh
        return cls(
            identity_file=str(spec.local_path(ssh.identity_file)) if ssh.identity_file else None,
            known_hosts=str(spec.local_path(ssh.known_hosts)) if ssh.known_hosts else None,
            host_key_policy=ssh.host_key_policy,
            connect_timeout=ssh.connect_timeout,
            keepalive=ssh.keepalive,
            forward_agent=ssh.forward_agent,
            persist=ssh.persist,
            config=config_path(spec),
            command_timeout=ssh.command_timeout,
        )

    def known_hosts_for(self, host: Host) -> str:
        """The known_hosts file checked for `host`: the spec's, else the first one its ssh config names."""
        if self.known_hosts:
            return os.path.expanduser(self.known_hosts)
        return os.path.expanduser("~/.ssh/known_hosts")


@dataclass(frozen=True)
class Result:
    """One host's outcome of one command. `cause`: the transport's typed error when the command never
    answered (CannotConnect, TimedOut); None when it ran to its exit."""

    host: Host
    command: str
    exit_code: int
    stdout: str
    stderr: str
    seconds: float
    cause: HostError | None = field(default=None, compare=False, repr=False)

    @property
    def ok(self) -> bool:
        """True when the command exited 0."""
        return self.exit_code == 0

    @property
    def unreachable(self) -> bool:
        """The host was never reached, or its connection broke before the command answered (exit 255)."""
        if self.cause is not None:
            return isinstance(self.cause, CannotConnect)
        return self.exit_code == UNREACHABLE and not self.stdout

    @property
    def timed_out(self) -> bool:
        """Our deadline ended the command before it answered (exit 124; not a command's own exit 124)."""
        if self.cause is not None:
            return isinstance(self.cause, TimedOut)
        return self.exit_code == TIMED_OUT and not self.stdout and self.stderr.startswith("timed out after")

    @property
    def answered(self) -> bool:
        """The command ran and answered: neither unreachable nor ended by our deadline."""
        return not (self.unreachable or self.timed_out)

    def error(self) -> HostError | None:
        """This outcome as a typed error (CannotConnect, TimedOut or CommandFailed); None when it succeeded."""
        if self.ok:
            return None
        if self.cause is not None:
            return self.cause
        if self.unreachable:
            return CannotConnect(self.host.label, self.stderr.strip() or f"cannot connect to {self.host.label}", self.command)
        if self.timed_out:
            return TimedOut(self.host.label, self.stderr.strip(), self.command)
        return CommandFailed(self.host.label, str(self.failure()), self.command, self.exit_code, self.stderr[-TAIL:])

    def reply(self) -> dict:
        """The JSON object the host's tool printed last on stdout, found robustly: lines a shell's start-up
        files print before it (even without a newline) are skipped. Raises RemoteError naming the host."""
        for line in reversed(self.stdout.splitlines()):
            line = line.strip()
            start, tries = line.find("{"), 0
            while start >= 0 and tries < 20:
                tries += 1
                try:
                    obj = json.loads(line[start:])
                except (ValueError, RecursionError):
                    start = line.find("{", start + 1)
                    continue
                if isinstance(obj, dict):
                    return obj
                break
            if start >= 0 or line.startswith("{"):
                break  # the last JSON-looking line is not an object: do not guess further up
        shown = "".join(c if c.isprintable() else "?" for c in self.stdout.strip()[-200:]) or "nothing"
        raise RemoteError([HostFailure(self.host.label, self.command, None, self.stderr[-TAIL:],
                                       f"exit {self.exit_code} but no JSON reply on stdout (got {shown!r})")],
                          what="reading a reply")

    def failure(self) -> HostFailure:
        """This outcome as a failure: when the host was never reached (255, no output), the reason alone."""
        if not self.stdout and (self.unreachable or self.timed_out):
            return HostFailure(self.host.label, self.command, None, self.stderr[-TAIL:], self.stderr)
        return HostFailure(self.host.label, self.command, self.exit_code, self.stderr[-TAIL:])


class GroupResult(dict):
    """Every host's Result of one fan-out, by Host (a dict, in the order the hosts were given), as Fabric's
    GroupResult: `succeeded` and `failed` split it; `raise_if_failed` turns it into the one GroupException."""

    @property
    def succeeded(self) -> "GroupResult":
        """The hosts whose command exited 0."""
        return GroupResult((h, r) for h, r in self.items() if r.ok)

    @property
    def failed(self) -> "GroupResult":
        """The hosts that were not reached, timed out, or exited non-zero."""
        return GroupResult((h, r) for h, r in self.items() if not r.ok)

    @property
    def ok(self) -> bool:
        """True when every host's command exited 0."""
        return all(r.ok for r in self.values())

    def failures(self) -> list[HostFailure]:
        """Each failed host's outcome, as the error message shows it."""
        return [r.failure() for r in self.values() if not r.ok]

    def raise_if_failed(self, what: str = "command") -> "GroupResult":
        """Raise GroupException (carrying this result) when a host failed; else return self."""
        if not self.ok:
            raise GroupException(self, what=what)
        return self


class GroupException(RemoteError):
    """A fan-out in which one or more hosts failed, carrying its GroupResult (`result`), as Fabric's
    GroupException. A RemoteError: `failures` (the message), `results` (the successes), `failed` (the
    failures' Results), `outcomes` and `errors` (each failed host's typed error) read as there."""

    def __init__(self, result: GroupResult, what: str = "command"):
        self.result = result if isinstance(result, GroupResult) else GroupResult(result)
        self.what = what
        super().__init__(self.result.failures(), self.result.succeeded, what=what, failed=self.result.failed)


def unreachable_result(host: Host, command: str, reason: str, seconds: float) -> Result:
    """The Result of a host that was never reached (or whose connection broke): exit 255, the reason on stderr."""
    return Result(host, command, UNREACHABLE, "", reason, seconds, CannotConnect(host.label, reason, command))


def timed_out_result(host: Host, command: str, timeout: float, seconds: float) -> Result:
    """The Result of a command our deadline ended: exit 124, the one-line reason on stderr."""
    reason = timed_out_reason(timeout, command)
    return Result(host, command, TIMED_OUT, "", reason, seconds, TimedOut(host.label, reason, command))


def timed_out_reason(timeout: float, command: str) -> str:
    """The one-line reason of a command that outlived its deadline (its first line names it)."""
    first = command.strip().splitlines()[0] if command.strip() else command
    return f"timed out after {timeout:g}s running {first[:200]}{' ...' if first != command.strip() else ''}"


def fingerprint(key) -> str:
    """OpenSSH-style SHA256 fingerprint of a public key (a paramiko PKey)."""
    digest = hashlib.sha256(key.asbytes()).digest()
    return "SHA256:" + base64.b64encode(digest).decode().rstrip("=")


class Running:
    """One command started on one host by a transport, waiting for its stdin."""

    deferred = False  # True: nothing runs until finish() (a host never finished simply never ran it)

    def finish(self, feed: Callable[[], Iterable[bytes]], timeout: float | None,
               on_line: LineCallback | None, max_output: int | None = None) -> Result:
        """Write what `feed()` yields to the command's stdin, close it, wait for its end: the host's Result
        (exit 255 with the reason when it was not reached, 124 when `timeout` ended it). `max_output`: the stdout
        kept without `on_line` (default LineSplitter.MAX_KEPT); beyond it, dropped and said (cut_short)."""
        raise NotImplementedError

    def kill(self) -> None:
        """End the command: one never finished, or one another thread is finishing (that thread then sees its end)."""


class Transport:
    """How commands reach hosts: the one interface Remote needs. Implementations: OpenSshTransport and
    LocalTransport (processes, clusterctl.transport.process), ParamikoTransport (clusterctl.sshconn)."""

    def start(self, host: Host, command: str) -> Running:
        """Start `command` on `host` now (or as soon as a connection may be opened); finish it later."""
        raise NotImplementedError

    def close(self) -> None:
        """Close what the transport keeps open (connections)."""


def dropped_note(over: int, limit: int) -> str:
    """The line a kept stream ends with when `over` bytes beyond its `limit` were dropped (cut_short finds it)."""
    size = f"{limit >> 20} MiB" if limit and not limit % (1 << 20) else f"{limit:,} bytes"
    return f"\n[clusterctl: {over:,} more bytes beyond {size} dropped]\n"


_DROPPED = re.compile(r"\n\[clusterctl: [\d,]+ more bytes beyond [\d,]+ (?:MiB|bytes) dropped\]\n\Z")


def cut_short(output: str) -> bool:
    """Whether `output` (a Result's stdout) ends with dropped_note's line: what the host printed was longer than
    the caller kept (Remote.run's max_output). A host that prints that line itself only has its reply refused."""
    return _DROPPED.search(output[-200:]) is not None


class LineSplitter:
    """Turns a byte stream into decoded lines for a callback. Without a callback it keeps the stream for the
    Result, up to MAX_KEPT bytes (a host may be compromised: what it prints must not fill the controller's
    memory; what comes beyond is counted and dropped, and the Result ends with a line that says so); with one,
    the lines belong to the callback and only the last KEEP_WITH_CALLBACK bytes are kept (for the Result's
    tail and reply), so streaming a log of any size holds a bounded amount. Stderr without a callback is only
    ever read for its end (a reason, a failure's last lines): its last KEEP_WITH_CALLBACK bytes are kept."""

    KEEP_WITH_CALLBACK = 1 << 20
    MAX_KEPT = 256 << 20  # a 1,000,000-file workspace's state reply is ~130 MiB
    MAX_PARTIAL = 4 << 20  # a "line" longer than this is handed on in pieces

    def __init__(self, host: Host, stream: str, on_line: LineCallback | None, max_kept: int | None = None):
        self.host, self.stream, self.on_line = host, stream, on_line
        self.max_kept = self.MAX_KEPT if max_kept is None else max_kept  # without a callback: a caller's own bound
        self.chunks: collections.deque[bytes] = collections.deque()
        self._kept = 0
        self.dropped = 0  # bytes streamed to the callback and not kept
        self.over = 0  # bytes beyond MAX_KEPT, without a callback: dropped
        self._partial = b""

    def feed(self, data: bytes) -> None:
        """Take the next chunk of the stream."""
        tail = self.on_line is None and self.stream == "err"  # stderr is read for a tail only: as with a callback
        if self.on_line is None and not tail and (self.over or self._kept + len(data) > self.max_kept):
            self.over += len(data)
            return
        self.chunks.append(data)
        self._kept += len(data)
        if self.on_line is None and not tail:
            return
        while self._kept - len(self.chunks[0]) >= self.KEEP_WITH_CALLBACK:
            old = self.chunks.popleft()
            self._kept -= len(old)
            self.dropped += len(old)
        if tail:
            return
        data = self._partial + data
        *lines, self._partial = data.split(b"\n")
        for line in lines:
            if line.endswith(b"\r"):  # CRLF (ssh's own messages, a tty, a Windows-made log) ends a line as LF does
                line = line[:-1]
            self.on_line(self.host, self.stream, line.decode("utf-8", "replace"))
        if len(self._partial) > self.MAX_PARTIAL:
            self.on_line(self.host, self.stream, self._partial.decode("utf-8", "replace"))
            self._partial = b""

    def close(self) -> str:
        """Flush a last unterminated line; the kept output (all of it, or its tail with a callback)."""
        if self.on_line is not None and self._partial:
            self.on_line(self.host, self.stream, self._partial.decode("utf-8", "replace"))
        self._partial = b""
        data = b"".join(self.chunks)
        self.chunks.clear()
        cut = data.find(b"\n")
        if self.dropped and 0 <= cut < len(data) - 1:  # the tail starts mid-stream: from its first whole line
            data = data[cut + 1:]  # (a tail that is one line, cut or not, is kept as it is: never nothing)
        text = data.decode("utf-8", "replace")
        if self.over:
            text += dropped_note(self.over, self.max_kept)
        return text
