"""paramiko/Fabric connections as a transport (ParamikoTransport): opening them (with the keys of clusterctl.sshkeys,
one-line errors) and running one command over a channel. Used where the OpenSSH client cannot go alone
(host_key_policy accept-new, which records first-seen keys, or off) and to word the client's connection
failures. Imported on first use only: paramiko, Fabric and invoke are a tenth of a second of start-up that
most commands never pay. Builds on clusterctl.transport.base only (never on clusterctl.remote).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import paramiko
from fabric import Config, Connection

from .errors import CannotConnect, ClusterctlError
from .sshkeys import (HostKeyError, SocketAgent, agent_key_for, agent_socket, certified_key, forward_agent,
                      host_key_client, key_files)
from .transport.base import (LineSplitter, Result, Running, SshOptions, Stdin, Transport, fingerprint,
                             timed_out_result, unreachable_result)
from .transport.gate import HandshakeGate, gate_key
from .transport.host import Host, split_jump

if TYPE_CHECKING:
    from .sshconfig import Resolved

log = logging.getLogger("clusterctl.remote")

# What a broken connection raises while a command runs on it.
TRANSPORT_ERRORS = (OSError, paramiko.SSHException, EOFError)


class Timeout(Exception):
    """The command outlived its timeout."""


def _connection(r: Resolved, opts: SshOptions, gateway: Connection | None, name: str | None = None) -> Connection:
    """A Fabric connection to `r` (what the ssh config resolves a host or a bastion, named `name`, to), with the
    spec's key and known_hosts, else the ssh config's IdentityFile (its tokens expanded as ssh expands them) and
    UserKnownHostsFile for it (ssh's own default key files that are not there are left out, as ssh skips them)."""
    timeout, name = opts.connect_timeout, name or r.hostname
    named = [os.path.expanduser(opts.identity_file)] if opts.identity_file else key_files(r, name)
    keys = named if opts.identity_file else [k for k in named if os.path.isfile(k)]
    # The spec's key goes with IdentitiesOnly=yes, as on the OpenSSH path; the config may say it too. Then the agent
    # offers only the keys of those files, not every key it holds (sshd's MaxAuthTries counts each one), and ssh's
    # default key files are not looked for.
    only = bool(opts.identity_file) or r.identities_only
    # As ssh, a user certificate first, with the key it certifies; else the agent's key of one of those files (a
    # file may be there as its .pub only, its key in the agent). The agent is the config's IdentityAgent, if any.
    sock = agent_socket(r)
    first = certified_key(r, name, named, sock) or agent_key_for(named, sock)
    conn = Connection(
        r.hostname,
        user=r.user,
        port=r.port,
        config=Config(overrides={"load_ssh_configs": False}),  # resolved already, by `ssh -G` (sshconfig)
        connect_timeout=timeout,
        forward_agent=opts.forward_agent,
        gateway=gateway,
        connect_kwargs={
            **({"key_filename": keys} if keys else {}),  # never None: Fabric's Connection cannot take it
            **({"pkey": first} if first is not None else {}),
            "look_for_keys": not only,
            "allow_agent": not only and sock is not None,
            "banner_timeout": timeout,
            "auth_timeout": timeout,
            "channel_timeout": timeout,
        },
    )
    conn.client = host_key_client(opts, r)  # ours: Fabric's default would AutoAdd unknown keys (bastions included)
    conn.client.agent_sock = sock  # type: ignore[attr-defined]  # ours: the agent run_on forwards (forward_agent)
    if sock is not None and sock != os.environ.get("SSH_AUTH_SOCK"):
        conn.client._agent = SocketAgent(sock)  # the agent paramiko's own loop asks (it would open SSH_AUTH_SOCK's)
    return conn


def _gateway(chain: tuple[str, ...], opts: SshOptions) -> Connection | None:
    """The bastions as nested Fabric gateways (first hop first), each resolved through the ssh config and
    each checked under the same host-key policy and known_hosts as the nodes."""
    from .sshconfig import Target, resolve

    gateway = None
    for hop in chain:
        user, name, port = split_jump(hop)
        (r,) = resolve([Target(name, user, port)], opts.config)
        first = gateway is None
        gateway = _connection(r, opts, gateway, name)
        if first and r.proxy_command:  # the first bastion's own ProxyCommand, as ssh runs it (later hops: -W)
            hop_host = Host(address=name, port=r.port, user=r.user, index=0, hostname=r.hostname)
            gateway.connect_kwargs["sock"] = paramiko.ProxyCommand(proxy_command_line(r.proxy_command, hop_host))
    return gateway


def _close_socks(conn: Connection | None) -> None:
    """End the ProxyCommand processes of a connection that did not open and of its bastions."""
    while conn is not None:
        sock = conn.connect_kwargs.get("sock")
        if isinstance(sock, paramiko.ProxyCommand):
            sock.close()
        conn = conn.gateway if isinstance(conn.gateway, Connection) else None


def open_connection(host: Host, opts: SshOptions) -> Connection:
    """A new open connection to `host` (through its bastions); raises CannotConnect (a ClusterctlError) with
    a one-line reason."""
    try:
        return _open_connection(host, opts)
    except CannotConnect:
        raise
    except ClusterctlError as exc:
        raise CannotConnect(host.label, str(exc)) from None


def _via(host: Host) -> str:
    return f" (through {', '.join(host.jump)})" if host.jump else ""


def _key_refused(exc: Exception, opts: SshOptions, conn: Connection | None = None) -> tuple[str, str] | None:
    """(the name paramiko gave the host, one line) for a host key paramiko refused; None for other errors. conn:
    the connection (with its bastions) that met it, whose HostKeyAlias, if any, names the key."""
    if isinstance(exc, paramiko.BadHostKeyException):
        name = getattr(exc, "hostname", None) or "?"
        alias = _alias_of(name, conn)
        shown = f"{alias} (HostKeyAlias of {_bare(name)})" if alias else name
        known = " or ".join(fingerprint(k) for k in getattr(exc.expected_key, "known", [exc.expected_key]))
        return name, (f"host key for {shown} CHANGED: server offers {fingerprint(exc.key)}, "
                      f"{opts.known_hosts or 'your known_hosts'} has {known}. "
                      "Possible man-in-the-middle; if the host was reinstalled, remove the old key")
    if isinstance(exc, HostKeyError):
        return exc.hostname, str(exc)
    return None


def _alias_of(name: str, conn: Connection | None) -> str | None:
    """The HostKeyAlias the client of `conn`, or of one of its bastions, looked the key of `name` up under."""
    while conn is not None:
        if conn.host == _bare(name):
            return getattr(conn.client, "host_key_alias", None)
        conn = conn.gateway if isinstance(conn.gateway, Connection) else None
    return None


def _bare(name: str) -> str:
    """`[name]:port` (how paramiko names a host off port 22) -> name."""
    return name[1:].rsplit("]:", 1)[0] if name.startswith("[") and "]:" in name else name


def _open_connection(host: Host, opts: SshOptions) -> Connection:
    from dataclasses import replace

    from .sshconfig import Target, resolve

    (found,) = resolve([Target(host.address, host.user, host.port)], opts.config)  # its keys and known_hosts
    r = replace(found, hostname=host.connect_name, user=host.user, port=host.port, proxy_jump=(),
                proxy_command=None)  # the host's own name, user and port; its hops are the gateway's
    conn = _connection(r, opts, _gateway(host.jump, opts), host.address)
    if found.proxy_command and not host.jump:  # the ssh config's ProxyCommand, run as ssh runs it
        conn.connect_kwargs["sock"] = paramiko.ProxyCommand(proxy_command_line(found.proxy_command, host))
    t0 = time.monotonic()
    try:
        conn.open()
    except BaseException as exc:
        _close_socks(conn)  # their processes go with the connection that did not open
        _refused(exc, host, opts, time.monotonic() - t0, conn)
        raise
    if opts.keepalive:
        conn.transport.set_keepalive(opts.keepalive)
    return conn


# SSH_MSG_CHANNEL_OPEN_FAILURE's reason codes (RFC 4254 5.1), as a bastion's sshd sends them
_CHANNEL_REFUSALS = {
    1: "administratively prohibited: its sshd does not allow forwarding (AllowTcpForwarding)",
    2: "connect failed: the host is down, or the bastion cannot reach it",
    4: "resource shortage",
}


def _refused(exc: BaseException, host: Host, opts: SshOptions, took: float, conn: Connection | None = None) -> None:
    """Raise the one-line ClusterctlError for a connection to `host` (conn) that did not open; return for an error
    that is not the connection's (the caller raises it as it is)."""
    timeout, via = opts.connect_timeout, _via(host)
    if isinstance(exc, (paramiko.BadHostKeyException, HostKeyError)):
        name, line = _key_refused(exc, opts, conn)
        if host.jump and _bare(name) != host.connect_name:  # a bastion's key: named as such
            raise ClusterctlError(f"cannot connect to {host.label}{via}: bastion {_bare(name)}: {line}") from None
        raise ClusterctlError(f"cannot connect to {host.label}{via}: {line}" if host.jump else line) from None
    if isinstance(exc, paramiko.AuthenticationException):
        raise ClusterctlError(
            f"authentication failed as {host.user}@{host.label} ({exc}); check ssh.identity_file or your ssh-agent"
        ) from None
    if isinstance(exc, paramiko.SSHException) and str(exc) == "No existing session" and took >= timeout * 0.9:
        # no banner within the deadline (TCP accepted, nothing said): paramiko reports the login it never began
        raise ClusterctlError(f"cannot connect to {host.label}{via}: timed out after {timeout:g}s (no SSH banner)") \
            from None
    if isinstance(exc, paramiko.SSHException) and str(exc) == "No existing session":  # closed while logging in
        raise ClusterctlError(
            f"authentication failed as {host.user}@{host.label}{via}: the server closed the connection (sshd's "
            "MaxAuthTries? the ssh-agent may offer too many keys: set ssh.identity_file, or IdentitiesOnly yes "
            "in your ssh config)") from None
    if isinstance(exc, (socket.timeout, TimeoutError)):
        raise ClusterctlError(f"cannot connect to {host.label}{via}: timed out after {timeout:g}s") from None
    if isinstance(exc, paramiko.ChannelException):  # a bastion refused to open the way on (RFC 4254 5.1)
        why = _CHANNEL_REFUSALS.get(exc.code, exc.text or f"code {exc.code}")
        raise ClusterctlError(f"cannot connect to {host.label}{via}: a bastion could not open the connection onward "
                              f"({why})") from None
    if isinstance(exc, (OSError, paramiko.SSHException, EOFError)):
        if took >= timeout * 0.9:  # e.g. a frozen host: TCP accepted, no SSH banner
            raise ClusterctlError(f"cannot connect to {host.label}{via}: timed out after {timeout:g}s") from None
        reason = getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
        banner = "Error reading SSH protocol banner"
        if reason.startswith(banner):  # paramiko runs its cause on: "...banner[Errno 104] ..."
            reason = "no SSH server there: " + banner + (": " + reason[len(banner):] if reason != banner else "")
        raise ClusterctlError(f"cannot connect to {host.label}{via}: {reason}") from None


def proxy_command_line(command: str, host: Host) -> str:
    """The ssh config's ProxyCommand for `host` as paramiko.ProxyCommand runs it: the tokens ssh expands in it
    (ssh_config(5): %%, %h, %n, %p, %r) expanded, run by `/bin/sh -c 'exec ...'` as ssh runs it; a ClusterctlError
    for another token, which ssh refuses too ("unknown key")."""
    import shlex

    from .sshconfigfile import expand_tokens

    tokens = {"h": host.connect_name, "p": str(host.port), "r": host.user, "n": host.address}
    try:
        expanded = expand_tokens(command, tokens)
    except KeyError as exc:
        raise ClusterctlError(f"{host.label}: ProxyCommand token %{exc.args[0]} is not one ssh expands there "
                              "(%%, %h, %n, %p, %r)") from None
    return "/bin/sh -c " + shlex.quote("exec " + expanded)


def bastion_refusal(chain: tuple[str, ...], opts: SshOptions) -> str | None:
    """Why the bastions of `chain` refuse us, as "bastion NAME: <reason>" (a host key unknown or changed,
    with its fingerprints; a failed login), found by opening the chain with paramiko under the same
    host-key policy; None when the chain opens (or fails in a way not worth naming here)."""
    gateway = _gateway(chain, opts)
    if gateway is None:
        return None
    try:
        gateway.open()
    except (paramiko.BadHostKeyException, HostKeyError) as exc:
        name, line = _key_refused(exc, opts, gateway)
        return f"bastion {_bare(name)}: {line}"
    except paramiko.AuthenticationException as exc:
        return f"bastion {gateway.host}: authentication failed as {gateway.user}@{gateway.host} ({exc})"
    except (OSError, paramiko.SSHException, EOFError):
        return None
    finally:
        gateway.close()
    return None


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


def run_on(conn: Connection, host: Host, cmd: str, stdin: Stdin, timeout: float | None, on_line,
           opened: Callable[[paramiko.Channel], None] | None = None,
           max_output: int | None = None) -> tuple[int, str, str]:
    """Run `cmd` over a new channel of `conn`: (exit code, stdout, stderr). Raises Timeout, or one of
    TRANSPORT_ERRORS when the connection breaks. `opened(channel)`: told the channel before the command starts
    (closing it from another thread ends the run, as killing an `ssh` client does). `max_output`: as for
    Running.finish."""
    chan = conn.transport.open_session(timeout=conn.connect_timeout)
    try:
        if opened is not None:
            opened(chan)
        if conn.forward_agent:  # the spec's ssh.forward_agent, as -o ForwardAgent=yes on ssh's own path
            forward_agent(chan, getattr(conn.client, "agent_sock", None))
        chan.exec_command(cmd)
        out = LineSplitter(host, "out", on_line, max_output)
        err = LineSplitter(host, "err", on_line)
        errors: list[BaseException] = []
        local: list[BaseException] = []  # the stdin stream's own error (e.g. a dispatched file changed)

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
            except Exception as exc:  # noqa: BLE001  the local stream itself failed: raised below, the command ended
                local.append(exc)
                chan.close()  # (the command waits for the rest of its stdin; a recv without a timeout returns now)

        deadline = None if timeout is None else time.monotonic() + timeout
        chan.settimeout(0.5 if deadline else None)
        threads = [threading.Thread(target=pump_stderr, daemon=True), threading.Thread(target=pump_stdin, daemon=True)]
        for t in threads:
            t.start()
        while True:
            try:
                data = chan.recv(65536)
            except socket.timeout:
                if local:  # the command waits for the rest of its stdin: closing the channel (finally) ends it
                    raise local[0] from None
                if deadline and time.monotonic() > deadline:
                    raise Timeout() from None
                if errors:  # the stdin pump died (e.g. the connection broke): do not wait for output forever
                    raise errors[0]
                continue
            if not data:
                break
            out.feed(data)
        if local:
            raise local[0] from None
        for t in threads:
            t.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
            if t.is_alive():
                raise Timeout()
        code = chan.recv_exit_status()
        if code == -1:  # the channel closed without an exit status: the connection or sshd went away
            if errors:
                raise errors[0]
            raise EOFError("no exit status received")
        return code, out.close(), err.close()
    finally:
        chan.close()


class ParamikoTransport(Transport):
    """Commands over paramiko channels, one cached connection per host (opened at most once at a time per
    host; new ones pass the handshake gate). `pool`: where connections are opened in the background."""

    def __init__(self, options: SshOptions, hosts, pool=None, gate: HandshakeGate | None = None):
        self.options, self.pool, self.gate = options, pool, gate
        self._conns: dict[Host, Connection] = {}
        self._locks: dict[Host, threading.Lock] = {h: threading.Lock() for h in hosts}
        self._locks_lock = threading.Lock()
        self._early: dict[Host, ClusterctlError] = {}  # from connect_soon(), reported once
        self._chains: dict[tuple[str, ...], str | None] = {}  # bastion chain -> why it refuses us (explain)
        self._chain_locks: dict[tuple[str, ...], threading.Lock] = {}

    def _lock(self, host: Host) -> threading.Lock:
        with self._locks_lock:
            return self._locks.setdefault(host, threading.Lock())

    def is_open(self, host: Host) -> bool:
        """Whether a connection to `host` is open now (commands over it start without a handshake)."""
        conn = self._conns.get(host)
        return conn is not None and conn.is_connected

    def connection(self, host: Host, keep_failure: bool = False) -> Connection:
        """The (cached) open connection to `host`; raises ClusterctlError with a one-line reason (kept, with
        keep_failure, for the next command to `host` instead of costing it a second timeout)."""
        with self._lock(host):
            early = self._early.pop(host, None)
            if early is not None:
                raise early
            conn = self._conns.get(host)
            if conn is not None and conn.is_connected:
                return conn
            key = gate_key(host)
            if self.gate is not None:
                self.gate.acquire(key)
            try:
                conn = open_connection(host, self.options)
            except ClusterctlError as exc:
                if keep_failure:
                    self._early[host] = exc
                raise
            finally:
                if self.gate is not None:
                    self.gate.release(key)
            self._conns[host] = conn
            return conn

    def connect_soon(self, host: Host) -> None:
        """Start connecting to `host` in the background; a failure is kept for the next command to it."""
        if self.pool is not None:
            self.pool.submit(self._connect_early, host)

    def _connect_early(self, host: Host) -> None:
        try:
            self.connection(host, keep_failure=True)
        except ClusterctlError as exc:  # kept (in the lock) for the next command to this host
            log.debug("connecting to %s early failed: %s", host.label, exc)

    def explain(self, host: Host) -> str | None:
        """Why a connection to `host` fails, as paramiko words it (both fingerprints, the user); None if it
        does not fail. Behind bastions their chain is tried first, once per chain and session (64 hosts
        behind one bastion whose key changed cost one attempt): a refusal there is the bastion's."""
        if host.jump:
            with self._locks_lock:
                lock = self._chain_locks.setdefault(host.jump, threading.Lock())
            with lock:
                if host.jump not in self._chains:
                    self._chains[host.jump] = bastion_refusal(host.jump, self.options)
            if self._chains[host.jump] is not None:
                return f"cannot connect to {host.label}{_via(host)}: {self._chains[host.jump]}"
        try:
            self.connection(host)
        except ClusterctlError as exc:
            return str(exc)
        return None

    def run(self, host: Host, cmd: str, stdin: Stdin, timeout: float | None, on_line, start: float | None = None,
            opened: Callable[[paramiko.Channel], None] | None = None,
            killed: Callable[[], bool] | None = None, max_output: int | None = None) -> Result:
        """Run `cmd` on `host` over its connection: the host's Result (255 with the reason when the host was
        not reached or the connection broke, 124 when `timeout` ended it). `opened`: as for run_on; `killed()`:
        whether the caller closed the channel (then its end is no broken connection: the connection is kept)."""
        start = time.monotonic() if start is None else start
        try:
            conn = self.connection(host)
        except ClusterctlError as exc:
            return unreachable_result(host, cmd, str(exc), time.monotonic() - start)
        try:
            code, out, err = run_on(conn, host, cmd, stdin, timeout, on_line, opened, max_output)
        except Timeout:
            return timed_out_result(host, cmd, timeout, time.monotonic() - start)
        except TRANSPORT_ERRORS as exc:
            if killed is not None and killed():
                return unreachable_result(host, cmd, "interrupted", time.monotonic() - start)
            with self._lock(host):
                self._conns.pop(host, None)
            msg = f"connection to {host.label} lost: {exc or type(exc).__name__}"
            return unreachable_result(host, cmd, msg, time.monotonic() - start)
        return Result(host, cmd, code, out, err, time.monotonic() - start)

    def start(self, host: Host, command: str) -> "_ChannelRun":
        """Connect in the background now; the command itself runs when finished (it needs its stdin)."""
        self.connect_soon(host)
        return _ChannelRun(self, host, command)

    def close(self) -> None:
        """Close every connection (safe while workers still run)."""
        for conn in list(self._conns.values()):  # a snapshot: workers may drop lost connections meanwhile
            conn.close()
        self._conns.clear()


class _ChannelRun(Running):
    """A command for one host over paramiko: nothing runs until finish(); kill() closes its channel."""

    deferred = True

    def __init__(self, transport: ParamikoTransport, host: Host, command: str):
        self.transport, self.host, self.command = transport, host, command
        self._lock = threading.Lock()
        self._chan: paramiko.Channel | None = None
        self._killed = False

    def finish(self, feed, timeout, on_line, max_output: int | None = None) -> Result:
        """Run the command with what `feed()` yields as its stdin."""
        if self._killed:  # interrupted before a worker came to it: never run
            return unreachable_result(self.host, self.command, "interrupted", 0.0)
        return self.transport.run(self.host, self.command, lambda _h: feed(), timeout, on_line, opened=self._opened,
                                  killed=lambda: self._killed, max_output=max_output)

    def _opened(self, chan: paramiko.Channel) -> None:
        with self._lock:
            self._chan = chan
            killed = self._killed
        if killed:  # the command then fails to start on a closed channel: `killed()` tells run() why
            chan.close()

    def kill(self) -> None:
        """Close the channel (the command then sees its stdin and stdout closed, as when an `ssh` client is killed);
        a run not started yet never starts."""
        with self._lock:
            self._killed = True
            chan = self._chan
        if chan is not None:
            chan.close()
