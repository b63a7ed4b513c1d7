"""Run commands on many hosts at once over SSH.

Every host's outcome is collected (a failure never hides the others) and failures are raised as one
RemoteError naming each host, its exit code and the tail of its stderr. Host keys are verified.

Two ways to a host: the OpenSSH client, one process per host (C crypto on every core, no Python import
cost, connections kept open between commands), for everything where it can check host keys itself; and
paramiko/Fabric connections (clusterctl.sshconn, imported on first use) for host_key_policy accept-new
(which records first-seen keys) or off, and to word the client's connection failures.
"""

from __future__ import annotations

import base64
import collections
import hashlib
import json
import logging
import os
import random
import re
import shlex
import shutil
import stat
import subprocess
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from .errors import ClusterctlError, HostFailure, RemoteError
from .plan import Host

if TYPE_CHECKING:
    from fabric import Connection

__all__ = ["SshOptions", "Result", "Remote", "Launch", "fingerprint", "UNREACHABLE"]

log = logging.getLogger(__name__)

UNREACHABLE = 255  # what `ssh` itself exits with when it cannot connect; used as the host's exit code
_TAIL = 2000  # bytes of stderr kept in failure messages

# Key exchange for the OpenSSH client: its defaults less the sntrup761 hybrid, which costs ~75 ms of CPU
# per connection (client and server together, 4x the rest of the handshake; measured, docs/benchmarks.md)
# and which our paramiko connections never offer either. Newer clients' ML-KEM hybrid stays first.
_KEX = "-sntrup761x25519-sha512@openssh.com,sntrup761x25519-sha512"


def _ciphers() -> str | None:
    """AES-GCM first where the CPU has AES instructions (OpenSSH puts chacha20-poly1305 first for CPUs
    without them): 200 MB to a host took 0.50 s instead of 0.70 s here, with 40% less client CPU. The
    same set as OpenSSH's default, reordered; None (the default) elsewhere."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as fh:
            line = next((ln for ln in fh if ln.startswith(("flags", "Features"))), ":")  # x86, arm
    except OSError:
        return None
    if "aes" not in line.split(":", 1)[1].split():
        return None
    return "aes128-gcm@openssh.com,aes256-gcm@openssh.com,chacha20-poly1305@openssh.com,aes128-ctr,aes192-ctr,aes256-ctr"


_CIPHERS = _ciphers()

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
        from .sshconfig import config_path

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
        raise RemoteError([HostFailure(self.host.label, self.command, None, self.stderr[-_TAIL:],
                                       f"exit {self.exit_code} but no JSON reply on stdout (got {shown!r})")],
                          what="reading a reply")

    def failure(self) -> HostFailure:
        """This outcome as a failure: when the host was never reached (255, no output), the reason alone."""
        timed_out = self.exit_code == 124 and self.stderr.startswith("timed out after")  # our deadline, not the command's
        if not self.stdout and (self.exit_code == UNREACHABLE or timed_out):
            return HostFailure(self.host.label, self.command, None, self.stderr[-_TAIL:], self.stderr)
        return HostFailure(self.host.label, self.command, self.exit_code, self.stderr[-_TAIL:])


def _timed_out(timeout: float, command: str) -> str:
    """The one-line reason of a command that outlived its deadline (its first line names it)."""
    first = command.strip().splitlines()[0] if command.strip() else command
    return f"timed out after {timeout:g}s running {first[:200]}{' ...' if first != command.strip() else ''}"


def fingerprint(key) -> str:
    """OpenSSH-style SHA256 fingerprint of a public key (a paramiko PKey)."""
    digest = hashlib.sha256(key.asbytes()).digest()
    return "SHA256:" + base64.b64encode(digest).decode().rstrip("=")


class Remote:
    """Parallel SSH to a fixed set of hosts, with cached connections. Use as a context manager."""

    def __init__(self, hosts: Sequence[Host], options: SshOptions, *, max_workers: int = 64, transport=None):
        self.hosts = tuple(hosts)
        self.options = options
        # transport: None = the OpenSSH client (or paramiko); else an object whose popen(host, command) starts
        # the command as a local process with pipes (clusterctl.transport.local.LocalTransport: unit tests)
        self.transport = transport
        self._pool = ThreadPoolExecutor(max_workers=max(1, min(max_workers, len(self.hosts) or 1)))
        self._conns: dict[Host, Connection] = {}
        self._conn_locks = {h: threading.Lock() for h in self.hosts}
        self._early_failures: dict[Host, ClusterctlError] = {}  # from connect_soon(), reported once
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
        for conn in list(self._conns.values()):  # a snapshot: workers may drop lost connections meanwhile
            conn.close()
        self._conns.clear()
        self._pool.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------------------------ connect

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

    def is_open(self, host: Host) -> bool:
        """Whether a connection to `host` is open now (commands over it start without a handshake)."""
        conn = self._conns.get(host)
        return conn is not None and conn.is_connected

    def connection(self, host: Host) -> Connection:
        """The (cached) open connection to `host`; raises ClusterctlError with a one-line reason."""
        with self._conn_locks[host]:
            early = self._early_failures.pop(host, None)
            if early is not None:
                raise early
            conn = self._conns.get(host)
            if conn is not None and conn.is_connected:
                return conn
            from .sshconn import open_connection

            conn = open_connection(host, self.options)
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
        Through the OpenSSH client and its kept connections (see launch()), unless this session has
        paramiko connections open to these hosts already (host_key_policy accept-new or off).
        """
        targets = tuple(hosts) if hosts is not None else self.hosts
        if self._openssh() and not any(map(self.is_open, targets)):
            if callable(stdin):
                feed = stdin
            else:
                chunks = () if stdin is None else (stdin,)
                feed = lambda _host: chunks  # noqa: E731
            with self.launch(command, hosts=targets) as launched:
                done = launched.finish(dict.fromkeys(targets, feed), timeout=timeout, on_line=on_line)
        else:
            futures = {h: self._pool.submit(self._run_one, h, command, stdin, timeout, on_line) for h in targets}
            done = {h: f.result() for h, f in futures.items()}
        failures = [res.failure() for res in done.values() if not res.ok]
        if check and failures:
            raise RemoteError(failures, {h: r for h, r in done.items() if r.ok}, what=what)
        return done

    def _run_one(self, host, command, stdin, timeout, on_line) -> Result:
        cmd = command(host) if callable(command) else command
        start = time.monotonic()
        try:
            conn = self.connection(host)
        except ClusterctlError as exc:
            return Result(host, cmd, UNREACHABLE, "", str(exc), time.monotonic() - start)
        from .sshconn import TRANSPORT_ERRORS, Timeout, run_on

        try:
            code, out, err = run_on(conn, host, cmd, stdin, timeout, on_line)
        except Timeout:
            return Result(host, cmd, 124, "", _timed_out(timeout, cmd), time.monotonic() - start)
        except TRANSPORT_ERRORS as exc:
            with self._conn_locks[host]:
                self._conns.pop(host, None)
            msg = f"connection to {host.label} lost: {exc or type(exc).__name__}"
            return Result(host, cmd, UNREACHABLE, "", msg, time.monotonic() - start)
        return Result(host, cmd, code, out, err, time.monotonic() - start)

    # ------------------------------------------------------------------------------------ OpenSSH

    def _openssh(self) -> bool:
        """Whether the OpenSSH client can go to the hosts by itself: it is installed, and it checks host keys
        against our known_hosts on its own (policy strict; accept-new records keys through paramiko first)."""
        if self.transport is not None:
            return True
        return self.options.host_key_policy == "strict" and shutil.which("ssh") is not None

    def launch(self, command: str | Callable[[Host], str], *, hosts: Sequence[Host]) -> "Launch":
        """Start `command` on `hosts` now and give it its stdin later (Launch.finish): the SSH handshake and
        the command's own start-up overlap whatever the caller does meanwhile. Through the OpenSSH client
        where it can check host keys itself; otherwise the connections are opened now and the command runs
        over them when finished."""
        if not self._openssh():
            self.connect_soon(hosts)
            return Launch(self, command, hosts, {})
        return Launch(self, command, hosts, {h: self._popen(h, command(h) if callable(command) else command) for h in hosts})

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
        if self.transport is None and (self.options.host_key_policy == "off" or shutil.which("ssh") is None):
            return self.run(command, hosts=hosts, stdin=stdin, timeout=timeout, check=False, what=what)
        futures = {h: self._pool.submit(self._push_one, h, command, stdin, timeout) for h in hosts}
        return {h: f.result() for h, f in futures.items()}

    def _push_one(self, host: Host, command: str, stdin, timeout) -> Result:
        start = time.monotonic()
        if not self._openssh():  # accept-new: paramiko verifies or records the key that ssh then checks
            try:
                self.connection(host)
            except ClusterctlError as exc:
                return Result(host, command, UNREACHABLE, "", str(exc), time.monotonic() - start)
        return self._collect(host, command, self._popen(host, command), lambda: stdin(host), timeout, start)

    def _ssh_argv(self, host: Host, command: str) -> list[str]:
        opts = self.options
        control = _control_dir() if opts.persist else None
        alive, missed = opts.keepalive or 15, 3
        if control is not None:  # see below: a reused connection's only wait is its keepalive
            alive, missed = 1, max(2, -(-int(opts.connect_timeout) // 3))
        argv = ["ssh", *self._common_options(), "-T", "-o", f"ServerAliveInterval={alive}",
                "-o", f"ForwardAgent={'yes' if opts.forward_agent else 'no'}"]
        if host.jump:
            # Each bastion is reached by an ssh of ours (ProxyCommand), not by ssh's own ProxyJump, whose
            # hops would not get these options: host keys are checked on every hop, the same way.
            argv += ["-o", f"ProxyCommand={self._jump_command(host.jump)}"]
        elif host.jump_none:
            argv += ["-o", "ProxyJump=none"]  # the spec says direct, over the ssh config's ProxyJump
        if control is not None:
            # The first command to a host leaves its connection open for `persist` idle seconds; later
            # ones, from any clusterctl process, start as a new session on it: no handshake. A host that
            # froze is given up on after `missed` one-second keepalives (a third of connect_timeout)
            # instead of holding the commands that reuse its connection; ssh then tries a new one.
            tag = hashlib.sha256(repr((opts.identity_file, opts.known_hosts, opts.forward_agent, opts.config,
                                       host.jump, _KEX, _CIPHERS)).encode())
            argv += [
                "-o", "ControlMaster=auto",
                "-o", f"ControlPath={control}/{tag.hexdigest()[:12]}-%C",  # other options, other connection
                "-o", f"ControlPersist={opts.persist}",
                "-o", f"ServerAliveCountMax={missed}",
            ]  # fmt: skip
        # user and port as resolved (what the spec set, else the ssh config's); `--`: an address is
        # never read as an option
        return argv + ["-p", str(host.port), "-l", host.user, "--", host.address, command]

    def _common_options(self) -> list[str]:
        """Options of every ssh we run, to hosts and to bastions alike."""
        opts = self.options
        argv = [] if opts.config is None else ["-F", opts.config]  # None: ~/.ssh/config and the system's
        argv += [
            "-o", "BatchMode=yes",  # never prompt
            "-o", "StrictHostKeyChecking=yes",  # accept-new keys were recorded by paramiko just before
            "-o", f"ConnectTimeout={max(1, int(opts.connect_timeout))}",
            "-o", f"KexAlgorithms={_KEX}",
            *(("-o", f"Ciphers={_CIPHERS}") if _CIPHERS else ()),
        ]  # fmt: skip
        if opts.known_hosts:  # else the ssh config's UserKnownHostsFile (default ~/.ssh/known_hosts)
            argv += ["-o", f"UserKnownHostsFile={os.path.expanduser(opts.known_hosts)}",
                     "-o", "GlobalKnownHostsFile=/dev/null"]
        if opts.identity_file:
            argv += ["-i", os.path.expanduser(opts.identity_file), "-o", "IdentitiesOnly=yes"]
        return argv

    def _jump_command(self, chain: tuple[str, ...]) -> str:
        """The ProxyCommand that reaches %h:%p through `chain` (first hop first): an ssh of ours to the last
        bastion, itself reached through the ones before it. Tokens of inner levels are escaped (%%) once
        per level, since each ssh expands the ProxyCommand it runs."""
        from .spec import parse_jump

        command = ""
        for level, hop in enumerate(chain):
            user, host, port = parse_jump(hop)
            argv = ["ssh", *self._common_options(), "-o", "ServerAliveInterval=5", "-o", "ForwardAgent=no",
                    "-o", "ClearAllForwardings=yes"]
            argv += ["-o", f"ProxyCommand={command}"] if command else ["-o", "ProxyJump=none"]
            argv += [*(["-l", user] if user else []), *(["-p", str(port)] if port else []), "-W", "%h:%p", "--", host]
            command = " ".join(shlex.quote(a) for a in argv)
            if level < len(chain) - 1:
                command = command.replace("%", "%%")
        return command

    def _popen(self, host: Host, command: str) -> subprocess.Popen:
        if self.transport is not None:
            return self.transport.popen(host, command)
        return subprocess.Popen(
            self._ssh_argv(host, command), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )

    def _collect(self, host: Host, command: str, proc: subprocess.Popen, feed: Callable[[], Iterable[bytes]], timeout,
                 start, on_line: LineCallback | None = None) -> Result:
        """Write what `feed()` yields to the ssh process's stdin, close it, wait for the exit; the host's Result.

        A connection that the server (or a bastion) closed before the login — sshd's MaxStartups shedding
        a burst of new connections, as a bastion in front of many hosts sees — never ran the command, so it
        is tried again, a few times, with a jittered back-off."""
        for attempt in range(_CONNECT_TRIES):
            held = _PreLoginLines(on_line) if on_line is not None else None  # a shed try's lines are not shown
            code, out, err = self._collect_once(host, proc, feed(), timeout, held)
            if code is None:
                if held is not None:
                    held.release()
                return Result(host, command, 124, "", _timed_out(timeout, command),
                              time.monotonic() - start)
            spent = time.monotonic() - start
            if not (code == UNREACHABLE and not out and _shed(err)) or attempt == _CONNECT_TRIES - 1 or (
                    timeout is not None and spent > timeout / 2):
                if held is not None:
                    held.release()
                break
            time.sleep(random.uniform(0.1, 0.3) * 2 ** min(attempt, 3))
            proc = self._popen(host, command)
        if code == UNREACHABLE and not out:
            err = self._ssh_failure(host, err)
        return Result(host, command, code, out, err, time.monotonic() - start)

    def _collect_once(self, host: Host, proc: subprocess.Popen, chunks: Iterable[bytes], timeout,
                      on_line: LineCallback | None) -> tuple[int | None, str, str]:
        """One ssh process to its end: (exit code, stdout, stderr); exit code None when it timed out."""
        outputs: dict[str, str] = {}

        def drain(name: str, stream) -> None:
            lines = LineSplitter(host, name, on_line)
            while chunk := stream.read1(65536):
                lines.feed(chunk)
            outputs[name] = lines.close()

        readers = [threading.Thread(target=drain, args=(n, s), daemon=True) for n, s in (("out", proc.stdout), ("err", proc.stderr))]
        for t in readers:
            t.start()
        try:
            for chunk in chunks:
                proc.stdin.write(chunk)
            proc.stdin.close()
        except BrokenPipeError:
            pass  # the remote command (or ssh) ended early; its exit code and stderr say why
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            return None, "", ""
        for t in readers:
            t.join()
        return code, outputs.get("out", ""), outputs.get("err", "")

    def _ssh_failure(self, host: Host, stderr: str) -> str:
        """One line for the OpenSSH client's own failure (exit 255), worded as our connections word it;
        behind bastions, the hop that failed is named."""
        said = [line.strip() for line in stderr.splitlines() if line.strip()]
        text = "\n".join(said)
        changed = _changed_key(text, self.options)
        if changed:
            return changed
        via = f" (through {', '.join(host.jump)})" if host.jump else ""
        unknown = re.search(r"No (\S+) host key is known for (\S+) and", text)
        if unknown and (host.jump or unknown.group(2) != host.connect_name):
            known = self.options.known_hosts or "your known_hosts"
            return (f"cannot connect to {host.label}{via}: unknown host key for {unknown.group(2)} "
                    f"({unknown.group(1).lower()}); not in {known}. Verify it and add it (ssh-keyscan), "
                    "or use host_key_policy: accept-new")
        hop = re.search(r"connect to host (\S+) port (\d+): (.+)", text)
        if host.jump and hop and hop.group(1) not in (host.connect_name, host.address):
            return f"cannot connect to {host.label}: bastion {hop.group(1)} port {hop.group(2)}: {hop.group(3)}"
        denied = re.search(r"(\S+)@(\S+): Permission denied \((.+)\)", text)
        if host.jump and denied and denied.group(2) not in (host.connect_name, host.address):
            return (f"cannot connect to {host.label}: authentication failed as {denied.group(1)}@{denied.group(2)} "
                    f"(bastion; {denied.group(3)}); check ssh.identity_file, your ssh config or your ssh-agent")
        if "timed out" in text:  # "Connection timed out", "... during banner exchange"
            return f"cannot connect to {host.label}{via}: timed out after {self.options.connect_timeout:g}s"
        if "Could not resolve hostname" in text:
            where = f" (not an alias in {self.options.config or 'your ssh config'}, nor a name DNS knows)"
            return f"cannot connect to {host.label}{via}: Could not resolve hostname {host.connect_name}{where}"
        for reason in ("Connection refused", "No route to host", "Network is unreachable"):
            if reason in text:
                return f"cannot connect to {host.label}{via}: {reason}"
        if not host.jump and ("Host key verification failed" in text or "Permission denied" in text):
            try:  # paramiko words it precisely: both fingerprints, the known_hosts file, the user
                self.connection(host)
            except ClusterctlError as exc:
                return str(exc)
        if host.jump and ("Connection closed" in text or "kex_exchange_identification" in text):
            return f"cannot connect to {host.label}{via}: the bastion closed the connection ({said[-1]})"
        return f"connection to {host.label}{via} lost: {said[-1] if said else 'ssh exited 255'}"


def _changed_key(text: str, options: SshOptions) -> str | None:
    """OpenSSH's changed-host-key warning as one line with both fingerprints (the offered one, and the
    one on record, read back from the known_hosts line the warning points at); None if not that."""
    host = re.search(r"Host key for (\S+) has changed", text)
    offered = re.search(r"key sent by the remote host is\s+(SHA256:[A-Za-z0-9+/=]+)", text)
    if not host or not offered:
        return None
    had = "another key"
    where = options.known_hosts or "known_hosts"
    place = re.search(r"Offending \S+ key in (.+?):(\d+)", text)
    if place:
        where = place.group(1)
        try:
            with open(place.group(1), encoding="utf-8", errors="replace") as fh:
                line = fh.read().splitlines()[int(place.group(2)) - 1].split()
            blob = (line[1:] if line[0].startswith("@") else line)[2]  # [@marker] hosts type key
            had = "SHA256:" + base64.b64encode(hashlib.sha256(base64.b64decode(blob)).digest()).decode().rstrip("=")
        except (OSError, IndexError, ValueError):
            pass
    return (f"host key for {host.group(1)} CHANGED: server offers {offered.group(1).rstrip('.')}, {where} has {had}. "
            "Possible man-in-the-middle; if the host was reinstalled, remove the old key")


_CONNECT_TRIES = 6  # a connection shed before the login is tried this many times in all
_FINAL = ("Connection refused", "timed out", "Could not resolve", "Permission denied", "Host key", "No route",
          "Network is unreachable", "host key")


# What ssh prints when a connection is closed before the login (see _shed), on its own or through a bastion.
_PRELOGIN = re.compile(r"(kex_exchange_identification: |banner exchange: Connection to |Connection (closed|reset) by )")


class _PreLoginLines:
    """An on_line callback that holds back ssh's pre-login stderr lines until the try's outcome is known:
    shown as they were when the try stands, dropped when it was shed and is tried again (measured: 23 of
    64 connections through one bastion shed, each printing two such lines for a command that succeeded)."""

    def __init__(self, on_line: LineCallback):
        self._on_line, self._held, self._passed = on_line, [], False
        self._lock = threading.Lock()

    def __call__(self, host: Host, stream: str, line: str) -> None:
        """Hold a pre-login line; pass anything else on (after what was held)."""
        with self._lock:
            if not self._passed and stream == "err" and _PRELOGIN.match(line):
                self._held.append((host, stream, line))
                return
            self._passed = True
            held, self._held = self._held, []
        for item in held:
            self._on_line(*item)
        self._on_line(host, stream, line)

    def release(self) -> None:
        """The try stands: show what was held."""
        with self._lock:
            held, self._held = self._held, []
        for item in held:
            self._on_line(*item)


def _shed(stderr: str) -> bool:
    """Whether ssh's stderr says the server (or a bastion) closed the connection before the login, for no
    reason of its own: what sshd's MaxStartups does to a burst of connections. Never for a refusal, a
    timeout, a failed login or a host key problem."""
    # the identification exchange is the first thing on a connection: a failure there ran nothing yet
    # through a bastion the drop can also reach our ssh as a failed write of its banner ("banner exchange:
    # Connection to UNKNOWN port 65535: Broken pipe", seen with 64 hosts behind one bastion)
    return ("kex_exchange_identification" in stderr or "banner exchange: Connection to" in stderr) and not any(
        word in stderr for word in _FINAL)


_CONTROL_DIRS: dict[str, str | None] = {}
_CONTROL_FALLBACK = "/tmp/clusterctl-ssh-{uid}"  # where the cache directory's path is too long for sockets


def _control_dir() -> str | None:
    """Where reusable connections' sockets live: a 0700 directory of ours, its path short enough for a
    socket (108 bytes); None (no reuse) where there is none."""
    from .cache import cache_root

    base = cache_root() / "ssh"
    key = str(base)
    if key not in _CONTROL_DIRS:
        found = None
        for d in (base, Path(_CONTROL_FALLBACK.format(uid=os.getuid()))):
            if len(str(d)) > 36:  # + "/" + 12 + "-" + 40 (%C) + ssh's 17-byte temporary suffix < 108
                continue
            try:
                d.mkdir(mode=0o700, parents=True, exist_ok=True)
                st = d.lstat()
                if st.st_uid == os.getuid() and stat.S_ISDIR(st.st_mode) and not st.st_mode & 0o077:
                    found = str(d)
                    break
            except OSError:
                continue
        _CONTROL_DIRS[key] = found
    return _CONTROL_DIRS[key]


class Launch:
    """Commands started by Remote.launch, waiting for their stdin. Use as a context manager (or close()):
    processes never finished are ended."""

    def __init__(self, remote: Remote, command, hosts: Sequence[Host], procs: dict[Host, subprocess.Popen]):
        self.remote, self.command, self.hosts = remote, command, tuple(hosts)  # command: str or f(host) -> str
        self._procs = procs  # empty: the command runs over paramiko connections at finish()
        self._start = time.monotonic()

    def __enter__(self) -> "Launch":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def finish(
        self,
        stdin: dict[Host, Callable[[Host], Iterable[bytes]]],
        timeout: float | None = None,
        on_line: LineCallback | None = None,
    ) -> dict[Host, Result]:
        """Feed each host in `stdin` its stream and wait for all (output lines to `on_line` as they come);
        a launched host not in `stdin` gets an empty stdin (the command must treat that as nothing to do).
        The Results of the hosts in `stdin`; exit codes as with Remote.run(check=False)."""
        remote, futures = self.remote, {}
        for host in self.hosts:
            proc = self._procs.pop(host, None)
            if proc is not None:
                feed = (lambda h=host: stdin[h](h)) if host in stdin else (lambda: ())
                cmd = self.command(host) if callable(self.command) else self.command
                futures[host] = remote._pool.submit(
                    remote._collect, host, cmd, proc, feed, timeout, self._start, on_line if host in stdin else None
                )
            elif host in stdin:
                futures[host] = remote._pool.submit(remote._run_one, host, self.command, stdin[host], timeout, on_line)
        return {h: f.result() for h, f in futures.items() if h in stdin}

    def close(self) -> None:
        """End the processes that were never finished (the caller gave up before sending anything)."""
        for proc in self._procs.values():
            proc.kill()
            proc.wait()
            for stream in (proc.stdin, proc.stdout, proc.stderr):
                stream.close()
        self._procs.clear()


class LineSplitter:
    """Turns a byte stream into decoded lines for a callback. Without a callback it keeps everything for
    the Result; with one, the lines belong to the callback and only the last KEEP_WITH_CALLBACK bytes are
    kept (for the Result's tail and reply), so streaming a log of any size holds a bounded amount."""

    KEEP_WITH_CALLBACK = 1 << 20
    MAX_PARTIAL = 4 << 20  # a "line" longer than this is handed on in pieces

    def __init__(self, host: Host, stream: str, on_line: LineCallback | None):
        self.host, self.stream, self.on_line = host, stream, on_line
        self.chunks: collections.deque[bytes] = collections.deque()
        self._kept = 0
        self.dropped = 0  # bytes streamed to the callback and not kept
        self._partial = b""

    def feed(self, data: bytes) -> None:
        """Take the next chunk of the stream."""
        self.chunks.append(data)
        self._kept += len(data)
        if self.on_line is None:
            return
        while self._kept - len(self.chunks[0]) >= self.KEEP_WITH_CALLBACK:
            old = self.chunks.popleft()
            self._kept -= len(old)
            self.dropped += len(old)
        data = self._partial + data
        *lines, self._partial = data.split(b"\n")
        for line in lines:
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
        if self.dropped:  # the tail starts mid-stream: from its first whole line
            data = data[data.find(b"\n") + 1:]
        return data.decode("utf-8", "replace")
