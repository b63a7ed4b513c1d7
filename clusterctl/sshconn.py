"""paramiko/Fabric connections for Remote: opening them (host-key policies, one-line errors) and running
one command over a channel. Used where the OpenSSH client cannot go alone (host_key_policy accept-new,
which records first-seen keys, or off) and to word the client's connection failures. Imported on first
use only: paramiko, Fabric and invoke are a tenth of a second of start-up that most commands never pay.
"""

from __future__ import annotations

import fcntl
import logging
import os
import socket
import threading
import time
from pathlib import Path

import paramiko
from fabric import Config, Connection

from .errors import ClusterctlError
from .plan import Host
from .remote import LineSplitter, SshOptions, Stdin, fingerprint

log = logging.getLogger("clusterctl.remote")

# What a broken connection raises while a command runs on it.
TRANSPORT_ERRORS = (OSError, paramiko.SSHException, EOFError)


class Timeout(Exception):
    """The command outlived its timeout."""


class _HostKeyError(paramiko.SSHException):
    """Raised inside paramiko's connect when a host key is not acceptable."""


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


def _client(options: SshOptions) -> paramiko.SSHClient:
    client = paramiko.SSHClient()  # our own: Fabric's default would AutoAdd unknown keys
    known = os.path.expanduser(options.known_hosts or "~/.ssh/known_hosts")
    policy = options.host_key_policy
    if policy != "off" and os.path.exists(known):
        client.load_host_keys(known)
    if policy == "strict":
        client.set_missing_host_key_policy(_StrictPolicy(known))
    elif policy == "accept-new":
        client.set_missing_host_key_policy(_AcceptNewPolicy(known))
    else:
        client.set_missing_host_key_policy(_OffPolicy())
    return client


def _connection(hostname: str, user: str, port: int, opts: SshOptions, gateway: Connection | None) -> Connection:
    timeout = opts.connect_timeout
    conn = Connection(
        hostname,
        user=user,
        port=port,
        config=Config(overrides={"load_ssh_configs": False}),  # resolved already, by `ssh -G` (sshconfig)
        connect_timeout=timeout,
        forward_agent=opts.forward_agent,
        gateway=gateway,
        connect_kwargs={
            "key_filename": [os.path.expanduser(opts.identity_file)] if opts.identity_file else None,
            "look_for_keys": opts.identity_file is None,
            "allow_agent": True,
            "banner_timeout": timeout,
            "auth_timeout": timeout,
            "channel_timeout": timeout,
        },
    )
    conn.client = _client(opts)  # ours: Fabric's default would AutoAdd unknown keys (bastions included)
    return conn


def _gateway(chain: tuple[str, ...], opts: SshOptions) -> Connection | None:
    """The bastions as nested Fabric gateways (first hop first), each resolved through the ssh config and
    each checked under the same host-key policy and known_hosts as the nodes."""
    from .sshconfig import Target, resolve
    from .spec import parse_jump

    gateway = None
    for hop in chain:
        user, name, port = parse_jump(hop)
        (r,) = resolve([Target(name, user, port)], opts.config)
        gateway = _connection(r.hostname, r.user, r.port, opts, gateway)
    return gateway


def open_connection(host: Host, opts: SshOptions) -> Connection:
    """A new open connection to `host` (through its bastions); raises ClusterctlError with a one-line reason."""
    timeout = opts.connect_timeout
    conn = _connection(host.connect_name, host.user, host.port, opts, _gateway(host.jump, opts))
    via = f" (through {', '.join(host.jump)})" if host.jump else ""
    t0 = time.monotonic()
    try:
        conn.open()
    except paramiko.BadHostKeyException as exc:
        raise ClusterctlError(
            f"host key for {getattr(exc, 'hostname', None) or host.label} CHANGED: server offers {fingerprint(exc.key)}, "
            f"{opts.known_hosts or '~/.ssh/known_hosts'} has {fingerprint(exc.expected_key)}. "
            "Possible man-in-the-middle; if the host was reinstalled, remove the old key"
        ) from None
    except _HostKeyError as exc:
        raise ClusterctlError(str(exc)) from None
    except paramiko.AuthenticationException as exc:
        raise ClusterctlError(
            f"authentication failed as {host.user}@{host.label} ({exc}); check ssh.identity_file or your ssh-agent"
        ) from None
    except (socket.timeout, TimeoutError):
        raise ClusterctlError(f"cannot connect to {host.label}{via}: timed out after {timeout:g}s") from None
    except (OSError, paramiko.SSHException, EOFError) as exc:
        if time.monotonic() - t0 >= timeout * 0.9:  # e.g. a frozen host: TCP accepted, no SSH banner
            raise ClusterctlError(f"cannot connect to {host.label}{via}: timed out after {timeout:g}s") from None
        reason = getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
        raise ClusterctlError(f"cannot connect to {host.label}{via}: {reason}") from None
    if opts.keepalive:
        conn.transport.set_keepalive(opts.keepalive)
    return conn


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


def run_on(conn: Connection, host: Host, cmd: str, stdin: Stdin, timeout: float | None, on_line) -> tuple[int, str, str]:
    """Run `cmd` over a new channel of `conn`: (exit code, stdout, stderr). Raises Timeout, or one of
    TRANSPORT_ERRORS when the connection breaks."""
    chan = conn.transport.open_session(timeout=conn.connect_timeout)
    try:
        chan.exec_command(cmd)
        out = LineSplitter(host, "out", on_line)
        err = LineSplitter(host, "err", on_line)
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
                    raise Timeout() from None
                if errors:  # the stdin pump died (e.g. the connection broke): do not wait for output forever
                    raise errors[0]
                continue
            if not data:
                break
            out.feed(data)
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
