"""Run commands on many hosts at once over SSH.

Every host's outcome is collected (a failure never hides the others) into one GroupResult (Host -> Result,
with `succeeded` and `failed`), and failures are raised as one GroupException (a RemoteError) naming each
host, its exit code and the tail of its stderr and carrying the GroupResult, as Fabric's GroupException
does. Host keys are verified.

Remote keeps the parallel orchestration (run, launch, push) over a transport (clusterctl.transport): the
one given, else the one clusterctl.transport.default gives (unit tests' fake hosts), else its own choice:
the OpenSSH client, one process per host (C crypto on every core, no Python import cost, connections kept
open between commands), for everything where it can check host keys itself; paramiko/Fabric connections
(clusterctl.sshconn, imported on first use) for host_key_policy accept-new (which records first-seen keys)
or off, and to word the client's connection failures. New connections pass a handshake gate: at most a
few in flight per bastion (clusterctl.transport.gate).

The types below every transport (Host, SshOptions, Result, GroupResult, ...) live in clusterctl.transport
and are re-exported here.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import FIRST_COMPLETED, FIRST_EXCEPTION, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from typing import TYPE_CHECKING

from .errors import ClusterctlError
from .files import special_file
from .transport import default
from .transport.base import (TIMED_OUT, UNREACHABLE, GroupException, GroupResult, LineCallback, LineSplitter, Result,
                             Running, SshOptions, Stdin, Transport, fingerprint, timed_out_reason, unreachable_result)
from .transport.host import Host
from .transport.gate import HandshakeGate
from .transport.openssh import CIPHERS as _CIPHERS
from .transport.openssh import KEX as _KEX
from .transport.openssh import OpenSshTransport, control_dir, ssh_argv, ssh_failure
from .transport.process import ProcessRun, ProcessTransport

if TYPE_CHECKING:
    from fabric import Connection

    from .sshconn import ParamikoTransport

__all__ = ["Host", "SshOptions", "Result", "GroupResult", "GroupException", "Remote", "Launch", "Until", "LineSplitter",
           "fingerprint", "UNREACHABLE", "TIMED_OUT", "LineCallback", "Stdin"]

log = logging.getLogger(__name__)
_timed_out = timed_out_reason  # the old private name
_ = (_KEX, _CIPHERS)  # re-exported for benchmarks


class Remote:
    """Parallel SSH to a fixed set of hosts, with cached connections. Use as a context manager."""

    def __init__(self, hosts: Sequence[Host], options: SshOptions, *, max_workers: int = 64,
                 transport: Transport | None = None, gate: HandshakeGate | None = None):
        if options.known_hosts and special_file(known := os.path.expanduser(options.known_hosts)):
            # ssh would wait for a FIFO's writer, or read /dev/zero, for ever; paramiko's path refuses it too
            raise ClusterctlError(f"known_hosts file {known} is not a regular file")
        self.hosts = tuple(hosts)
        self.options = options
        # transport: the one given, else clusterctl.transport.default's, else (None) the OpenSSH client or paramiko
        if transport is None:
            transport = default.transport_for(self.hosts, options)
        elif not isinstance(transport, Transport):
            raise TypeError(f"transport must be a clusterctl.transport Transport, not {type(transport).__name__}")
        self.transport = transport
        self._pool = ThreadPoolExecutor(max_workers=max(1, min(max_workers, len(self.hosts) or 1)))
        self.gate = gate if gate is not None else HandshakeGate()  # new connections per bastion
        self._paramiko: ParamikoTransport | None = None
        if transport is not None:
            self._given: Transport | None = transport
            self._ssh: ProcessTransport | None = transport if isinstance(transport, ProcessTransport) else None
        else:
            self._given = None
            usable = options.host_key_policy != "off" and shutil.which("ssh") is not None
            self._ssh = OpenSshTransport(options, self.gate, self._explain) if usable else None
        if options.host_key_policy == "off":
            log.warning("host key checking is OFF (ssh.host_key_policy: off): connections can be intercepted")

    @property
    def control_timeout(self) -> float:
        """The deadline of a control command (status, a state read, writing job files, preflight): a host whose
        command has not answered by then is named as timed out (exit 124), even when its SSH connection stays
        healthy and only the command hangs (ssh.command_timeout; docs/lifecycle.md#deadlines)."""
        return self.options.command_timeout

    def __enter__(self) -> "Remote":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Close every connection and the worker pool (safe while workers still run)."""
        for transport in (self._paramiko, self._given):
            if transport is not None:
                transport.close()
        self._pool.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------------------------ transports

    @property
    def channels(self) -> "ParamikoTransport":
        """The paramiko transport of this session (created, and paramiko imported, on first use)."""
        if self._paramiko is None:
            from .sshconn import ParamikoTransport

            self._paramiko = ParamikoTransport(self.options, self.hosts, self._pool, self.gate)
        return self._paramiko

    def _openssh(self) -> bool:
        """Whether commands go through a process transport: the one given, or the OpenSSH client where it
        checks host keys against our known_hosts on its own (policy strict; accept-new records keys through
        paramiko first)."""
        if self._given is not None:
            return self._ssh is not None
        return self._ssh is not None and self.options.host_key_policy == "strict"

    def _for(self, targets: Sequence[Host]) -> Transport:
        """The transport that runs commands on `targets`: the process transport, unless it cannot check
        host keys alone or this session has paramiko connections open to them already."""
        if self._given is not None:
            return self._given
        if self._openssh() and not any(map(self.is_open, targets)):
            return self._ssh
        return self.channels

    def _explain(self, host: Host) -> str | None:
        """paramiko's precise wording of why `host` refuses us (host key, login); None if it does not."""
        return self.channels.explain(host)

    # ------------------------------------------------------------------------------------ connect

    def connect_soon(self, hosts: Sequence[Host] | None = None) -> None:
        """Start connecting in the background (e.g. while files are scanned); a failure is reported by the
        next command to that host instead of costing a second timeout."""
        for host in self.hosts if hosts is None else hosts:
            self.channels.connect_soon(host)

    def kept_control(self, host: Host) -> str | None:
        """The control socket of `host`'s kept OpenSSH connection, when this session's commands to `host` go
        through it (clusterctl.transport.muxfwd asks services on the host through it); None otherwise."""
        transport = self._for((host,))
        kept = getattr(transport, "kept", None)
        return kept(host) if transport is self._ssh and callable(kept) else None

    def is_open(self, host: Host) -> bool:
        """Whether a paramiko connection to `host` is open now (commands over it start without a handshake)."""
        return self._paramiko is not None and self._paramiko.is_open(host)

    def connection(self, host: Host) -> "Connection":
        """The (cached) open paramiko connection to `host`; raises ClusterctlError with a one-line reason."""
        return self.channels.connection(host)

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
        max_output: int | None = None,
        until: "Until | None" = None,
    ) -> GroupResult:
        """Run `command` (a shell line, or a function of the host) on every host in parallel.

        Returns each host's Result (a GroupResult). With check=True, raises one GroupException (a
        RemoteError) naming every host that failed to connect or exited non-zero, carrying the GroupResult
        (every host's Result and typed error); with check=False, unreachable hosts get exit code 255.
        Through the OpenSSH client and its kept connections (see launch()), unless this session has
        paramiko connections open to these hosts already (host_key_policy accept-new or off). `max_output`: the
        bytes of each host's stdout kept without `on_line` (default LineSplitter.MAX_KEPT), for a caller that parses
        a small reply; a longer one ends with the line that says what was dropped (transport.base.cut_short).
        `until` (Launch.finish): each host's Result as it comes; the hosts not done once it has enough are not waited for.
        """
        targets = tuple(hosts) if hosts is not None else self.hosts
        if callable(stdin):
            feed = stdin
        else:
            chunks = () if stdin is None else (stdin,)
            feed = lambda _host: chunks  # noqa: E731
        with self._launch(command, targets, self._for(targets)) as launched:
            done = launched.finish(dict.fromkeys(targets, feed), timeout=timeout, on_line=on_line,
                                   max_output=max_output, until=until)
        return done.raise_if_failed(what) if check else done

    def launch(self, command: str | Callable[[Host], str], *, hosts: Sequence[Host]) -> "Launch":
        """Start `command` on `hosts` now and give it its stdin later (Launch.finish): the SSH handshake and
        the command's own start-up overlap whatever the caller does meanwhile. Through the OpenSSH client
        where it can check host keys itself; otherwise the connections are opened now and the command runs
        over them when finished."""
        return self._launch(command, hosts, self._given or (self._ssh if self._openssh() else self.channels))

    def _launch(self, command, hosts: Sequence[Host], transport: Transport) -> "Launch":
        runs = {h: transport.start(h, command(h) if callable(command) else command) for h in hosts}
        return Launch(self, command, hosts, runs)

    def push(
        self,
        command: str,
        *,
        hosts: Sequence[Host],
        stdin: Callable[[Host], Iterable[bytes]],
        timeout: float | None = None,
        what: str = "transfer",
    ) -> GroupResult:
        """Run `command` on each host feeding it a large stdin stream; exit codes as with run(check=False).

        Bulk data goes through the OpenSSH client (C crypto, one process per host, so every core works)
        with strict checking against the same known_hosts file. paramiko's pure-Python framing tops
        out far lower. Without an `ssh` binary, or with host-key checking off, it falls back to run().
        """
        if self._ssh is None:
            return self.run(command, hosts=hosts, stdin=stdin, timeout=timeout, check=False, what=what)
        futures = {h: self._pool.submit(self._push_one, h, command, stdin, timeout) for h in hosts}
        _wait_awake(futures.values())
        return GroupResult((h, f.result()) for h, f in futures.items())

    def _push_one(self, host: Host, command: str, stdin, timeout) -> Result:
        start = time.monotonic()
        if not self._openssh():  # accept-new: paramiko verifies or records the key that ssh then checks
            try:
                self.connection(host)
            except ClusterctlError as exc:
                return unreachable_result(host, command, str(exc), time.monotonic() - start)
        return ProcessRun(self._ssh, host, command, start=start).finish(lambda: stdin(host), timeout, None)

    # ------------------------------------------------------------------------------------ OpenSSH (tests)

    def _ssh_argv(self, host: Host, command: str) -> list[str]:
        """The OpenSSH command line for `host` (clusterctl.transport.openssh.ssh_argv with this session's options)."""
        return ssh_argv(host, self.options, command, control_dir() if self.options.persist else None)

    def _ssh_failure(self, host: Host, stderr: str) -> str:
        """One line for the OpenSSH client's own failure (clusterctl.transport.openssh.ssh_failure)."""
        return ssh_failure(host, stderr, self.options, self._explain)


WAKE_S = 0.25  # the waiting thread wakes this often, so that Ctrl+C reaches it (_wait_awake)
UNTIL_WAKE_S = 0.05  # ... and this often when an `until` may be told it has enough by another thread


class Until:
    """What a caller of Remote.run needs from its hosts before it stops waiting (clusterctl.ops.control.Enough):
    `add(host, result)` as each host's Result comes (from any thread), `is_set()` once it has enough, and
    `cut(host, command, seconds)`, the Result of a host not waited for."""

    def add(self, host: Host, result: Result) -> None:
        raise NotImplementedError

    def is_set(self) -> bool:
        raise NotImplementedError

    def cut(self, host: Host, command: str, seconds: float) -> Result:
        raise NotImplementedError


def _wait_awake(futures, until: Until | None = None) -> set:
    """Wait for `futures` (or the first to fail), waking every WAKE_S. A process-directed SIGINT (Ctrl+C) is
    taken by whichever thread the kernel picks; when that is a worker, the main thread blocked in a lock without
    a timeout would not run the handler (KeyboardInterrupt) until the futures were done: with a followed log,
    never. Waking makes it run within WAKE_S. With `until` (`futures`: {host: future}), each host's Result is
    given to it as it comes, and the wait ends once it has enough: the futures still pending are returned."""
    host_of = {f: h for h, f in futures.items()} if until is not None else {}
    pending = set(futures.values() if until is not None else futures)
    while pending:
        if until is None:
            done, pending = wait_futures(pending, timeout=WAKE_S, return_when=FIRST_EXCEPTION)
        else:
            done, pending = wait_futures(pending, timeout=UNTIL_WAKE_S, return_when=FIRST_COMPLETED)
        if any(f.exception() is not None for f in done):
            return set()
        for f in done if until is not None else ():
            until.add(host_of[f], f.result())
        if pending and until is not None and until.is_set():
            return pending
    return set()


class Launch:
    """Commands started by Remote.launch, waiting for their stdin. Use as a context manager (or close()):
    processes never finished are ended."""

    def __init__(self, remote: Remote, command, hosts: Sequence[Host], runs: dict[Host, Running]):
        self.remote, self.command, self.hosts = remote, command, tuple(hosts)  # command: str or f(host) -> str
        self._runs = runs

    def __enter__(self) -> "Launch":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def finish(
        self,
        stdin: dict[Host, Callable[[Host], Iterable[bytes]]],
        timeout: float | None = None,
        on_line: LineCallback | None = None,
        max_output: int | None = None,
        until: Until | None = None,
    ) -> GroupResult:
        """Feed each host in `stdin` its stream and wait for all (output lines to `on_line` as they come);
        a launched host not in `stdin` gets an empty stdin (the command must treat that as nothing to do).
        The Results of the hosts in `stdin`; exit codes as with Remote.run(check=False); `max_output` as there.
        With `until`, the hosts in `stdin` not done once it has enough are ended, and get its `cut` Result."""
        futures, running, started = {}, {}, time.monotonic()
        try:  # from the first submit: a Ctrl+C may come as soon as one host's output does
            for host in self.hosts:
                run = self._runs.get(host)
                if run is None or (run.deferred and host not in stdin):
                    continue  # finished already, or never started (paramiko runs nothing until finished)
                running[host] = run
                feed = (lambda h=host: stdin[h](h)) if host in stdin else (lambda: ())
                futures[host] = self.remote._pool.submit(run.finish, feed, timeout, on_line if host in stdin else None,
                                                         max_output)
                del self._runs[host]
            if until is None:
                _wait_awake(futures.values())
                return GroupResult((h, f.result()) for h, f in futures.items() if h in stdin)
            left = {h for h, f in futures.items() if f in _wait_awake(futures, until)}
            for h in left:
                running[h].kill()
            seconds = time.monotonic() - started
            command = self.command if callable(self.command) else (lambda _h: self.command)
            return GroupResult((h, until.cut(h, command(h), seconds) if h in left else f.result())
                               for h, f in futures.items() if h in stdin)
        except BaseException:  # Ctrl+C while waiting (a followed log, say): end the commands, not only the wait
            for run in running.values():
                run.kill()
            raise

    def close(self) -> None:
        """End the processes that were never finished (the caller gave up before sending anything)."""
        for run in self._runs.values():
            run.kill()
        self._runs.clear()
