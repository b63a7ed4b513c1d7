"""Run commands on many hosts at once over SSH (Fabric/paramiko); the only module that imports them.

Every host's outcome is collected (a failure never hides the others) and failures are raised as one
RemoteError naming each host, its exit code and the tail of its stderr. Host keys are verified.
"""

from __future__ import annotations

import base64
import fcntl
import hashlib
import logging
import os
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import paramiko
from fabric import Config, Connection

from .errors import ClusterctlError, HostFailure, RemoteError
from .plan import Host

__all__ = ["SshOptions", "Result", "Remote", "fingerprint", "UNREACHABLE"]

log = logging.getLogger(__name__)

UNREACHABLE = 255  # what `ssh` itself exits with when it cannot connect; used as the host's exit code
_TAIL = 2000  # bytes of stderr kept in failure messages

LineCallback = Callable[[Host, str, str], None]  # (host, "out"|"err", line without newline)
Stdin = bytes | Callable[[Host], Iterable[bytes]] | None


@dataclass(frozen=True)
class SshOptions:
    """How to connect: identity, host-key policy and timeouts. Paths are already resolved."""

    identity_file: str | None = None
    known_hosts: str = "~/.ssh/known_hosts"
    host_key_policy: str = "strict"  # strict | accept-new | off
    connect_timeout: float = 10.0
    keepalive: int = 15
    forward_agent: bool = False

    @classmethod
    def from_spec(cls, spec) -> "SshOptions":
        """Options from a ClusterSpec, resolving its paths against the spec file's directory."""
        ssh = spec.ssh
        return cls(
            identity_file=str(spec.local_path(ssh.identity_file)) if ssh.identity_file else None,
            known_hosts=str(spec.local_path(ssh.known_hosts)),
            host_key_policy=ssh.host_key_policy,
            connect_timeout=ssh.connect_timeout,
            keepalive=ssh.keepalive,
            forward_agent=ssh.forward_agent,
        )


@dataclass(frozen=True)
class Result:
    """One host's outcome of one command."""

    host: Host
    command: str
    exit_code: int
    stdout: str
    stderr: str
    seconds: float

    @property
    def ok(self) -> bool:
        """True when the command exited 0."""
        return self.exit_code == 0


class _HostKeyError(paramiko.SSHException):
    """Raised inside paramiko's connect when a host key is not acceptable."""


def fingerprint(key: paramiko.PKey) -> str:
    """OpenSSH-style SHA256 fingerprint of a public key."""
    digest = hashlib.sha256(key.asbytes()).digest()
    return "SHA256:" + base64.b64encode(digest).decode().rstrip("=")


class _StrictPolicy(paramiko.MissingHostKeyPolicy):
    def __init__(self, known_hosts: str):
        self.known_hosts = known_hosts

    def missing_host_key(self, client, hostname, key):
        raise _HostKeyError(
            f"unknown host key for {hostname} ({key.get_name()} {fingerprint(key)}); "
            f"not in {self.known_hosts}. Verify it and add it (ssh-keyscan), or use host_key_policy: accept-new"
        )


class _AcceptNewPolicy(paramiko.MissingHostKeyPolicy):
    _lock = threading.Lock()

    def __init__(self, known_hosts: str):
        self.known_hosts = known_hosts

    def missing_host_key(self, client, hostname, key):
        line = f"{hostname} {key.get_name()} {key.get_base64()}\n"
        path = Path(self.known_hosts)
        with self._lock:
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "a", encoding="utf-8") as fh:
                fcntl.flock(fh, fcntl.LOCK_EX)
                fh.write(line)
        client.get_host_keys().add(hostname, key.get_name(), key)
        log.warning("recorded new host key for %s (%s) in %s", hostname, fingerprint(key), self.known_hosts)


class _OffPolicy(paramiko.MissingHostKeyPolicy):
    def missing_host_key(self, client, hostname, key):
        pass  # explicitly requested with host_key_policy: off (warned about on every run)


class Remote:
    """Parallel SSH to a fixed set of hosts, with cached connections. Use as a context manager."""

    def __init__(self, hosts: Sequence[Host], options: SshOptions, *, max_workers: int = 64):
        self.hosts = tuple(hosts)
        self.options = options
        self._pool = ThreadPoolExecutor(max_workers=max(1, min(max_workers, len(self.hosts) or 1)))
        self._conns: dict[Host, Connection] = {}
        self._conn_locks = {h: threading.Lock() for h in self.hosts}
        self._early_failures: dict[Host, ClusterctlError] = {}  # from connect_soon(), reported once
        if options.host_key_policy == "off":
            log.warning("host key checking is OFF (ssh.host_key_policy: off): connections can be intercepted")

    def __enter__(self) -> "Remote":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Close every connection and the worker pool (safe while workers still run)."""
        for conn in list(self._conns.values()):  # a snapshot: workers may drop lost connections meanwhile
            conn.close()
        self._conns.clear()
        self._pool.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------------------------ connect

    def _client(self) -> paramiko.SSHClient:
        client = paramiko.SSHClient()  # our own: Fabric's default would AutoAdd unknown keys
        known = os.path.expanduser(self.options.known_hosts)
        policy = self.options.host_key_policy
        if policy != "off" and os.path.exists(known):
            client.load_host_keys(known)
        if policy == "strict":
            client.set_missing_host_key_policy(_StrictPolicy(known))
        elif policy == "accept-new":
            client.set_missing_host_key_policy(_AcceptNewPolicy(known))
        else:
            client.set_missing_host_key_policy(_OffPolicy())
        return client

    def connect_soon(self, hosts: Sequence[Host] | None = None) -> None:
        """Start connecting in the background (e.g. while files are scanned); a failure is reported by the
        next command to that host instead of costing a second timeout."""
        for host in self.hosts if hosts is None else hosts:
            self._pool.submit(self._connect_early, host)

    def _connect_early(self, host: Host) -> None:
        try:
            self.connection(host)
        except ClusterctlError as exc:
            self._early_failures[host] = exc

    def connection(self, host: Host) -> Connection:
        """The (cached) open connection to `host`; raises ClusterctlError with a one-line reason."""
        with self._conn_locks[host]:
            early = self._early_failures.pop(host, None)
            if early is not None:
                raise early
            conn = self._conns.get(host)
            if conn is not None and conn.is_connected:
                return conn
            opts = self.options
            timeout = opts.connect_timeout
            conn = Connection(
                host.address,
                user=host.user,
                port=host.port,
                config=Config(overrides={"load_ssh_configs": False}),
                connect_timeout=timeout,
                forward_agent=opts.forward_agent,
                connect_kwargs={
                    "key_filename": [os.path.expanduser(opts.identity_file)] if opts.identity_file else None,
                    "look_for_keys": opts.identity_file is None,
                    "allow_agent": True,
                    "banner_timeout": timeout,
                    "auth_timeout": timeout,
                    "channel_timeout": timeout,
                },
            )
            conn.client = self._client()
            t0 = time.monotonic()
            try:
                conn.open()
            except paramiko.BadHostKeyException as exc:
                raise ClusterctlError(
                    f"host key for {host.label} CHANGED: server offers {fingerprint(exc.key)}, "
                    f"{self.options.known_hosts} has {fingerprint(exc.expected_key)}. "
                    "Possible man-in-the-middle; if the host was reinstalled, remove the old key"
                ) from None
            except _HostKeyError as exc:
                raise ClusterctlError(str(exc)) from None
            except paramiko.AuthenticationException as exc:
                raise ClusterctlError(
                    f"authentication failed as {host.user}@{host.label} ({exc}); check ssh.identity_file or your ssh-agent"
                ) from None
            except (socket.timeout, TimeoutError):
                raise ClusterctlError(f"cannot connect to {host.label}: timed out after {timeout:g}s") from None
            except (OSError, paramiko.SSHException, EOFError) as exc:
                if time.monotonic() - t0 >= timeout * 0.9:  # e.g. a frozen host: TCP accepted, no SSH banner
                    raise ClusterctlError(f"cannot connect to {host.label}: timed out after {timeout:g}s") from None
                reason = getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
                raise ClusterctlError(f"cannot connect to {host.label}: {reason}") from None
            if opts.keepalive:
                conn.transport.set_keepalive(opts.keepalive)
            self._conns[host] = conn
            return conn

    # ------------------------------------------------------------------------------------ run

    def run(
        self,
        command: str | Callable[[Host], str],
        *,
        hosts: Sequence[Host] | None = None,
        stdin: Stdin = None,
        timeout: float | None = None,
        on_line: LineCallback | None = None,
        check: bool = True,
        what: str = "command",
    ) -> dict[Host, Result]:
        """Run `command` (a shell line, or a function of the host) on every host in parallel.

        Returns each host's Result. With check=True, raises one RemoteError naming every host that
        failed to connect or exited non-zero; with check=False, unreachable hosts get exit code 255.
        """
        targets = tuple(hosts) if hosts is not None else self.hosts
        futures = {h: self._pool.submit(self._run_one, h, command, stdin, timeout, on_line) for h in targets}
        results: dict[Host, Result] = {}
        failures: list[HostFailure] = []
        for host, fut in futures.items():
            res = fut.result()
            results[host] = res
            if not res.ok:
                reason = res.stderr if res.exit_code == UNREACHABLE and not res.stdout else ""
                failures.append(
                    HostFailure(host.label, res.command, None if reason else res.exit_code, res.stderr[-_TAIL:], reason)
                )
        if check and failures:
            raise RemoteError(failures, {h: r for h, r in results.items() if r.ok}, what=what)
        return results

    def _run_one(self, host, command, stdin, timeout, on_line) -> Result:
        cmd = command(host) if callable(command) else command
        start = time.monotonic()
        try:
            conn = self.connection(host)
        except ClusterctlError as exc:
            return Result(host, cmd, UNREACHABLE, "", str(exc), time.monotonic() - start)
        try:
            code, out, err = _exec(conn, host, cmd, stdin, timeout, on_line)
        except _Timeout:
            return Result(host, cmd, 124, "", f"timed out after {timeout:g}s running {cmd[:200]}", time.monotonic() - start)
        except (OSError, paramiko.SSHException, EOFError) as exc:
            with self._conn_locks[host]:
                self._conns.pop(host, None)
            msg = f"connection to {host.label} lost: {exc or type(exc).__name__}"
            return Result(host, cmd, UNREACHABLE, "", msg, time.monotonic() - start)
        return Result(host, cmd, code, out, err, time.monotonic() - start)


    # ------------------------------------------------------------------------------------ bulk

    def push(
        self,
        command: str,
        *,
        hosts: Sequence[Host],
        stdin: Callable[[Host], Iterable[bytes]],
        timeout: float | None = None,
        what: str = "transfer",
    ) -> dict[Host, Result]:
        """Run `command` on each host feeding it a large stdin stream; exit codes as with run(check=False).

        Bulk data goes through the OpenSSH client (C crypto, one process per host, so every core works)
        with strict checking against the same known_hosts file. paramiko's pure-Python framing tops
        out far lower. Without an `ssh` binary, or with host-key checking off, it falls back to run().
        """
        if self.options.host_key_policy == "off" or shutil.which("ssh") is None:
            return self.run(command, hosts=hosts, stdin=stdin, timeout=timeout, check=False, what=what)
        futures = {h: self._pool.submit(self._push_one, h, command, stdin, timeout) for h in hosts}
        return {h: f.result() for h, f in futures.items()}

    def _ssh_argv(self, host: Host, command: str) -> list[str]:
        opts = self.options
        argv = [
            "ssh",
            "-F", "/dev/null",  # like our paramiko connections: no user ssh_config surprises
            "-T",  # no terminal
            "-o", "BatchMode=yes",  # never prompt
            "-o", "StrictHostKeyChecking=yes",  # keys were verified or recorded by paramiko just before
            "-o", f"UserKnownHostsFile={os.path.expanduser(opts.known_hosts)}",
            "-o", "GlobalKnownHostsFile=/dev/null",
            "-o", f"ConnectTimeout={max(1, int(opts.connect_timeout))}",
            "-o", f"ServerAliveInterval={opts.keepalive or 15}",
            "-o", f"ForwardAgent={'yes' if opts.forward_agent else 'no'}",
            "-p", str(host.port),
            "-l", host.user,
        ]  # fmt: skip
        if opts.identity_file:
            argv += ["-i", os.path.expanduser(opts.identity_file), "-o", "IdentitiesOnly=yes"]
        return argv + [host.address, command]

    def _push_one(self, host: Host, command: str, stdin, timeout) -> Result:
        start = time.monotonic()
        try:  # paramiko first (cached if open): verifies, or with accept-new records, the host key ssh checks
            self.connection(host)
        except ClusterctlError as exc:
            return Result(host, command, UNREACHABLE, "", str(exc), time.monotonic() - start)
        proc = subprocess.Popen(
            self._ssh_argv(host, command), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        outputs: dict[str, bytes] = {}

        def drain(name: str, stream) -> None:
            outputs[name] = stream.read()

        readers = [threading.Thread(target=drain, args=(n, s), daemon=True) for n, s in (("out", proc.stdout), ("err", proc.stderr))]
        for t in readers:
            t.start()
        try:
            for chunk in stdin(host):
                proc.stdin.write(chunk)
            proc.stdin.close()
        except BrokenPipeError:
            pass  # the remote command ended early; its exit code and stderr say why
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            return Result(host, command, 124, "", f"timed out after {timeout:g}s running {command[:200]}", time.monotonic() - start)
        for t in readers:
            t.join()
        out = outputs.get("out", b"").decode("utf-8", "replace")
        err = outputs.get("err", b"").decode("utf-8", "replace")
        return Result(host, command, code, out, err, time.monotonic() - start)


class _Timeout(Exception):
    pass


def _send_all(chan, data: bytes, deadline: float | None) -> None:
    """chan.sendall that survives the channel's short poll timeout while the peer's window is full."""
    view = memoryview(data)
    while view:
        try:
            sent = chan.send(view)
        except socket.timeout:
            if deadline and time.monotonic() > deadline:
                raise  # the main loop reports the timeout
            continue
        if sent <= 0:
            raise EOFError("channel closed while sending stdin")
        view = view[sent:]


class _LineSplitter:
    """Turns a byte stream into decoded lines for a callback; keeps everything for the Result."""

    def __init__(self, host: Host, stream: str, on_line: LineCallback | None):
        self.host, self.stream, self.on_line = host, stream, on_line
        self.chunks: list[bytes] = []
        self._partial = b""

    def feed(self, data: bytes) -> None:
        self.chunks.append(data)
        if self.on_line is None:
            return
        data = self._partial + data
        *lines, self._partial = data.split(b"\n")
        for line in lines:
            self.on_line(self.host, self.stream, line.decode("utf-8", "replace"))

    def close(self) -> str:
        if self.on_line is not None and self._partial:
            self.on_line(self.host, self.stream, self._partial.decode("utf-8", "replace"))
        self._partial = b""
        return b"".join(self.chunks).decode("utf-8", "replace")


def _exec(conn: Connection, host: Host, cmd: str, stdin: Stdin, timeout: float | None, on_line) -> tuple[int, str, str]:
    chan = conn.transport.open_session(timeout=conn.connect_timeout)
    try:
        chan.exec_command(cmd)
        out = _LineSplitter(host, "out", on_line)
        err = _LineSplitter(host, "err", on_line)
        errors: list[BaseException] = []

        def pump_stderr() -> None:
            try:
                while True:
                    try:
                        data = chan.recv_stderr(65536)
                    except socket.timeout:  # the channel's 0.5 s poll timeout: keep reading
                        continue
                    if not data:
                        break
                    err.feed(data)
            except (OSError, paramiko.SSHException) as exc:  # surfaced below via the main loop
                errors.append(exc)

        def pump_stdin() -> None:
            try:
                if stdin is not None:
                    chunks = [stdin] if isinstance(stdin, bytes) else stdin(host)
                    for chunk in chunks:
                        _send_all(chan, chunk, deadline)
                chan.shutdown_write()
            except (OSError, paramiko.SSHException, EOFError) as exc:  # e.g. the command exited without reading
                errors.append(exc)

        deadline = None if timeout is None else time.monotonic() + timeout
        chan.settimeout(0.5 if deadline else None)
        threads = [threading.Thread(target=pump_stderr, daemon=True), threading.Thread(target=pump_stdin, daemon=True)]
        for t in threads:
            t.start()
        while True:
            try:
                data = chan.recv(65536)
            except socket.timeout:
                if deadline and time.monotonic() > deadline:
                    raise _Timeout() from None
                if errors:  # the stdin pump died (e.g. the connection broke): do not wait for output forever
                    raise errors[0]
                continue
            if not data:
                break
            out.feed(data)
        for t in threads:
            t.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
            if t.is_alive():
                raise _Timeout()
        code = chan.recv_exit_status()
        if code == -1:  # the channel closed without an exit status: the connection or sshd went away
            if errors:
                raise errors[0]
            raise EOFError("no exit status received")
        return code, out.close(), err.close()
    finally:
        chan.close()
