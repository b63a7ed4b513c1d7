"""The OpenSSH client as a transport: one `ssh` process per host and command (C crypto on every core, no
Python import cost, connections kept open between commands with ControlMaster). The argv is a pure function
of (host, options, command, control directory); its failures (exit 255) are worded here as our paramiko
connections word theirs; a connection shed before the login is recognised (and tried again by ProcessRun);
new connections pass a HandshakeGate (clusterctl.transport.gate) so a bastion's MaxStartups is not stormed.
"""

from __future__ import annotations

import base64
import hashlib
import os
import re
import shlex
import stat
import subprocess
import threading
import time
from collections.abc import Callable

from .host import Host, split_jump
from .base import SshOptions
from .gate import HandshakeGate, gate_key
from .process import ProcessTransport

__all__ = ["OpenSshTransport", "ssh_argv", "common_options", "config_path", "jump_command", "control_dir",
           "control_socket", "ssh_failure", "shed", "KEX", "CIPHERS"]

# Key exchange for the OpenSSH client: its defaults less the sntrup761 hybrid, which costs ~75 ms of CPU
# per connection (client and server together, 4x the rest of the handshake; measured, docs/benchmarks.md)
# and which our paramiko connections never offer either. Newer clients' ML-KEM hybrid stays first.
KEX = "-sntrup761x25519-sha512@openssh.com,sntrup761x25519-sha512"


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


CIPHERS = _ciphers()


def config_path(path: str) -> str:
    """A file name as the value of an `-o` option that takes one (UserKnownHostsFile, IdentityFile, ControlPath):
    ssh reads `-o` values as ssh_config lines, split at blanks, with quotes and backslashes of their own (a blank
    cut the name in two, a quote was "invalid quotes"), and expands %-tokens in these: double quotes, `\\` and
    `\"` escaped inside them, and `%%` for a `%`. (`-F FILE` is argv, read as it is.)"""
    return '"' + path.replace("\\", "\\\\").replace('"', '\\"').replace("%", "%%") + '"'


def _config_value(path: str) -> str:
    """`path` as config_path writes it, unless it needs nothing of that (the common case: the argv stays plain)."""
    return path if _PLAIN.fullmatch(path) else config_path(path)


_PLAIN = re.compile(r"[A-Za-z0-9_./+:-]+")  # no blank, quote, backslash, %, # or anything else ssh reads


def common_options(opts: SshOptions) -> list[str]:
    """Options of every ssh we run, to hosts and to bastions alike. File names in `-o` values are written as ssh
    reads them back (config_path); the key is `-o IdentityFile`, not `-i`, whose name ssh %-expands after
    checking the name as given (`-i a%%b` was "not accessible", `-i a%d` read the key a<home directory>)."""
    argv = [] if opts.config is None else ["-F", opts.config]  # None: ~/.ssh/config and the system's
    argv += [
        "-o", "BatchMode=yes",  # never prompt
        "-o", "StrictHostKeyChecking=yes",  # accept-new keys were recorded by paramiko just before
        "-o", f"ConnectTimeout={max(1, int(opts.connect_timeout))}",
        "-o", f"KexAlgorithms={KEX}",
        *(("-o", f"Ciphers={CIPHERS}") if CIPHERS else ()),
    ]  # fmt: skip
    if opts.known_hosts:  # else the ssh config's UserKnownHostsFile (default ~/.ssh/known_hosts)
        argv += ["-o", f"UserKnownHostsFile={_config_value(os.path.expanduser(opts.known_hosts))}",
                 "-o", "GlobalKnownHostsFile=/dev/null"]
    if opts.identity_file:
        argv += ["-o", f"IdentityFile={_config_value(os.path.expanduser(opts.identity_file))}",
                 "-o", "IdentitiesOnly=yes"]
    return argv


def jump_command(chain: tuple[str, ...], opts: SshOptions, login_flag: str | None = None, first: str = "") -> str:
    """The ProxyCommand that reaches %h:%p through `chain` (first hop first): an ssh of ours to the last
    bastion, itself reached through the ones before it. Tokens of inner levels are escaped (%%) once
    per level, since each ssh expands the ProxyCommand it runs. login_flag: a file the ssh to the first
    bastion touches once logged in there (from then on the connection no longer counts in its MaxStartups);
    first: the first bastion's own ProxyCommand in the ssh config, run to reach it as ssh runs it."""
    command = ""
    for level, hop in enumerate(chain):
        user, name, port = split_jump(hop)  # checked when it entered the plan; `--` below keeps it a name
        # every word is escaped (%%) from the ssh that runs this command, but for the ProxyCommand of the hop before
        # (escaped already: its tokens are that hop's) and the %h:%p this ssh is told to reach (`-F a%b` was
        # expanded there, a file name in an -o value twice)
        literal = ["ssh", *common_options(opts), "-o", "ServerAliveInterval=5", "-o", "ForwardAgent=no",
                   "-o", "ClearAllForwardings=yes"]
        argv = [a.replace("%", "%%") for a in literal]
        if command:
            argv += ["-o", f"ProxyCommand={command}"]
        elif first:  # its tokens are this bastion's: escaped from the ssh that runs this one
            argv += ["-o", "ProxyCommand=" + first.replace("%", "%%")]
        else:
            argv += ["-o", "ProxyJump=none"]
        literal = [*(_login_signal(login_flag) if level == 0 and login_flag is not None else ()),
                   *(["-l", user] if user else []), *(["-p", str(port)] if port else [])]
        argv += [a.replace("%", "%%") for a in literal] + ["-W", "%h:%p", "--", name.replace("%", "%%")]
        command = " ".join(shlex.quote(a) for a in argv)
        if level < len(chain) - 1:
            command = command.replace("%", "%%")
    return command


def _control_tag(host: Host, opts: SshOptions) -> str:
    """The prefix of `host`'s control sockets: other options, other connection."""
    return hashlib.sha256(repr((opts.identity_file, opts.known_hosts, opts.forward_agent, opts.config,
                                host.jump, KEX, CIPHERS)).encode()).hexdigest()[:12]


def ssh_argv(host: Host, opts: SshOptions, command: str, control: str | None, login_flag: str | None = None) -> list[str]:
    """The OpenSSH command line that runs `command` on `host`: strict host keys, no prompts, our bastions.

    control: the directory of kept connections' sockets (None: no reuse; only used when opts.persist);
    login_flag: a file ssh touches once it has logged in (LocalCommand; the handshake gate's signal): to the
    host itself, or behind bastions to the first one (whose sshd's MaxStartups the gate protects)."""
    control = control if opts.persist else None
    alive, missed = opts.keepalive or 15, 3
    if control is not None:  # see below: a reused connection's only wait is its keepalive
        alive, missed = 1, max(2, -(-int(opts.connect_timeout) // 3))
    argv = ["ssh", *common_options(opts), "-T", "-o", f"ServerAliveInterval={alive}",
            "-o", f"ForwardAgent={'yes' if opts.forward_agent else 'no'}"]
    if host.jump:
        # Each bastion is reached by an ssh of ours (ProxyCommand), not by ssh's own ProxyJump, whose
        # hops would not get these options: host keys are checked on every hop, the same way.
        argv += ["-o", f"ProxyCommand={jump_command(host.jump, opts, login_flag, host.hop_command)}"]
    elif host.jump_none:
        argv += ["-o", "ProxyJump=none"]  # the spec says direct, over the ssh config's ProxyJump
    if control is not None:
        # The first command to a host leaves its connection open for `persist` idle seconds; later
        # ones, from any clusterctl process, start as a new session on it: no handshake. A host that
        # froze is given up on after `missed` one-second keepalives (a third of connect_timeout)
        # instead of holding the commands that reuse its connection; ssh then tries a new one.
        argv += [
            "-o", "ControlMaster=auto",
            "-o", f"ControlPath={_control_path(control, host, opts)}",  # other options, other connection
            "-o", f"ControlPersist={opts.persist}",
            "-o", f"ServerAliveCountMax={missed}",
        ]  # fmt: skip
    if login_flag is not None and not host.jump:  # behind a bastion: the ssh to its first hop signals
        argv += _login_signal(login_flag)
    # user and port as resolved (what the spec set, else the ssh config's); `--`: an address is
    # never read as an option
    return argv + ["-p", str(host.port), "-l", host.user, "--", host.address, command]


def _control_path(control: str, host: Host, opts: SshOptions) -> str:
    """The ControlPath option's value: `control`'s name as ssh reads it back (config_path), then the socket's own
    name with its %C token (the %C outside the quotes: ssh joins a word's quoted and plain parts)."""
    return f"{_config_value(control + '/')}{_control_tag(host, opts)}-%C"


def _login_signal(flag: str) -> list[str]:
    """Options that make an ssh touch `flag` once logged in: LocalCommand runs after the login, and only in
    an ssh that opened a connection itself (never in a client of a kept one)."""
    return ["-o", "PermitLocalCommand=yes", "-o", "LocalCommand=touch " + shlex.quote(flag).replace("%", "%%")]


def control_socket(host: Host, opts: SshOptions, control: str | None) -> str | None:
    """The path of `host`'s kept connection's socket, as ssh expands our ControlPath (%C: the SHA-1 of
    local host name, HostName, port and user); None without reuse."""
    if control is None or not opts.persist:
        return None
    local = os.uname().nodename  # gethostname(), as ssh's %l (without importing socket)
    conn = hashlib.sha1(f"{local}{host.connect_name.lower()}{host.port}{host.user}".encode()).hexdigest()
    return f"{control}/{_control_tag(host, opts)}-{conn}"


_CONTROL_DIRS: dict[str, str | None] = {}
_CONTROL_FALLBACK = "/tmp/clusterctl-ssh-{uid}"  # where the cache directory's path is too long for sockets


def control_dir() -> str | None:
    """Where reusable connections' sockets live: a 0700 directory of ours, its path short enough for a
    socket (108 bytes); None (no reuse) where there is none."""
    from ..cache import cache_root_path, makedirs

    base = os.path.join(cache_root_path(), "ssh")
    if base not in _CONTROL_DIRS:
        found = None
        for d in (base, _CONTROL_FALLBACK.format(uid=os.getuid())):
            if len(d) > 36:  # + "/" + 12 + "-" + 40 (%C) + ssh's 17-byte temporary suffix < 108
                continue
            try:
                makedirs(d)
                st = os.lstat(d)
                if st.st_uid == os.getuid() and stat.S_ISDIR(st.st_mode) and not st.st_mode & 0o077:
                    found = d
                    break
            except OSError:
                continue
        _CONTROL_DIRS[base] = found
    return _CONTROL_DIRS[base]


class OpenSshTransport(ProcessTransport):
    """One `ssh` process per host and command. `gate`: bounds new connections per bastion (None: no bound);
    `explain(host)`: a precise one-line reason from a paramiko attempt, for host-key and login failures."""

    POLL = 0.02  # seconds between looks for a new connection's login

    def __init__(self, options: SshOptions, gate: HandshakeGate | None = None,
                 explain: Callable[[Host], str | None] | None = None):
        self.options, self.gate, self.explain = options, gate, explain
        self._flags: str | None = None

    def argv(self, host: Host, command: str, login_flag: str | None = None) -> list[str]:
        """This transport's ssh command line for `host`."""
        return ssh_argv(host, self.options, command, control_dir() if self.options.persist else None, login_flag)

    def popen(self, host: Host, command: str) -> subprocess.Popen:
        """Start ssh for `host` at once (no gate)."""
        return self._popen(self.argv(host, command))

    @staticmethod
    def _popen(argv: list[str]) -> subprocess.Popen:
        return subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)

    def reuses(self, host: Host) -> bool:
        """Whether a kept connection to `host` is open now (its socket exists): no handshake to wait for."""
        return self.kept(host) is not None

    def kept(self, host: Host) -> str | None:
        """The control socket of `host`'s kept connection when it exists now, else None."""
        path = control_socket(host, self.options, control_dir() if self.options.persist else None)
        try:
            return path if path is not None and stat.S_ISSOCK(os.stat(path).st_mode) else None
        except OSError:
            return None

    def spawn(self, host: Host, command: str, wait: bool = True) -> subprocess.Popen | None:
        """Start `command` on `host`: over its kept connection without an `ssh` process when one is open
        (clusterctl.transport.mux; None with wait=False: it is opened in the background, the caller goes
        on), else with ssh, whose new connection first takes a slot of its bastion's gate (None when none is
        free and wait is False) and gives it back once logged in, failed, or after connect_timeout."""
        kept = self.kept(host)
        if kept is not None:
            if not wait:
                return None
            from .mux import open_session

            # a master whose host froze goes away after a third of connect_timeout (its keepalives): then
            # ssh makes a new connection; one that is only slow gets the whole connect_timeout to open
            proc = open_session(kept, command, forward_agent=self.options.forward_agent,
                                timeout=max(1.0, self.options.connect_timeout))
            if proc is not None:
                return proc
        if self.gate is None or self.reuses(host):
            return self.popen(host, command)
        key = gate_key(host)
        if not self.gate.acquire(key, blocking=wait):
            return None
        flag = os.path.join(self._flag_dir(), os.urandom(16).hex())
        try:
            proc = self._popen(self.argv(host, command, login_flag=flag))
        except OSError:
            self.gate.release(key)
            raise
        proc.login_flag = flag  # see shed(): until _hold has looked at it for the last time
        threading.Thread(target=self._hold, args=(key, proc, flag), daemon=True).start()
        return proc

    def _hold(self, key: str, proc: subprocess.Popen, flag: str) -> None:
        """Keep the slot until ssh logged in (it touched `flag`), exited, or connect_timeout passed."""
        deadline = time.monotonic() + max(1.0, self.options.connect_timeout)
        try:
            while not os.path.exists(flag) and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(self.POLL)
        finally:
            self.gate.release(key)
        while proc.poll() is None and not os.path.exists(flag):
            time.sleep(0.5)  # the touch may still come (after the deadline): remove it once it has
        proc.logged_in = os.path.exists(flag)  # before the file goes: shed() reads one or the other
        try:
            os.unlink(flag)
        except FileNotFoundError:
            pass

    def _flag_dir(self) -> str:
        """A private directory for login flags: the control directory, else a 0700 temporary one."""
        if self._flags is None:
            import tempfile

            self._flags = control_dir() or tempfile.mkdtemp(prefix="clusterctl-login-")
        return self._flags

    def shed(self, stderr: str) -> bool:
        """See shed()."""
        return shed(stderr)

    def logged_in(self, proc) -> bool:
        """A session of a kept connection (it has no handshake to shed), or a connection whose ssh touched its login
        flag: it ran, and a command's own stderr can read like ssh's (it ran `ssh` itself); running it again would
        repeat what it did."""
        from .mux import MuxProcess

        if isinstance(proc, MuxProcess) or getattr(proc, "logged_in", False):
            return True
        flag = getattr(proc, "login_flag", None)
        return flag is not None and os.path.exists(flag)

    def prelogin(self, line: str) -> bool:
        """ssh's lines for a connection closed before the login."""
        return bool(_PRELOGIN.match(line))

    def failure_reason(self, host: Host, stderr: str) -> str:
        """See ssh_failure()."""
        return ssh_failure(host, stderr, self.options, self.explain)


def ssh_failure(host: Host, stderr: str, options: SshOptions, explain: Callable[[Host], str | None] | None = None) -> str:
    """One line for the OpenSSH client's own failure (exit 255), worded as our connections word it;
    behind bastions, the hop that failed is named. A host key OpenSSH refuses without its fingerprint (an
    unknown key), and a bastion that closed the connection before the login (under ControlPersist, OpenSSH
    sends the bastion hop's own words to /dev/null), are explained by `explain` (a paramiko attempt under
    the same policy: the key's type and fingerprint, both fingerprints of a changed key, the bastion named)."""
    said = [line.strip() for line in stderr.splitlines() if line.strip()]
    text = "\n".join(said)
    via = f" (through {', '.join(host.jump)})" if host.jump else ""
    changed = _changed_key(text, options)
    if changed:
        name = re.search(r"Host key for (\S+) has changed", text).group(1)
        if host.jump and name != host.connect_name:
            return f"cannot connect to {host.label}{via}: bastion {name}: {changed}"
        return changed
    unknown = re.search(r"No (\S+) host key is known for (\S+) and", text)
    if unknown and (host.jump or unknown.group(2) != host.connect_name):
        precise = explain(host) if explain is not None else None  # with the key's fingerprint
        if precise:
            return precise
        bastion = f"bastion {unknown.group(2)}: " if host.jump and unknown.group(2) != host.connect_name else ""
        known = options.known_hosts or "your known_hosts"
        return (f"cannot connect to {host.label}{via}: {bastion}unknown host key for {unknown.group(2)} "
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
        return f"cannot connect to {host.label}{via}: timed out after {options.connect_timeout:g}s"
    if "Could not resolve hostname" in text:
        if (options.config or "").lower() == "none":  # no config read: DNS alone
            where = " (ssh.config: none, and DNS does not know it)"
        else:
            where = f" (not an alias in {options.config or 'your ssh config'}, nor a name DNS knows)"
        return f"cannot connect to {host.label}{via}: Could not resolve hostname {host.connect_name}{where}"
    for reason in ("Connection refused", "No route to host", "Network is unreachable"):
        if reason in text:
            return f"cannot connect to {host.label}{via}: {reason}"
    if explain is not None and ("Host key verification failed" in text or "Permission denied" in text):
        precise = explain(host)  # paramiko words it precisely: both fingerprints, the known_hosts file, the user
        if precise:
            return precise
    if host.jump and ("Connection closed" in text or "kex_exchange_identification" in text):
        precise = explain(host) if explain is not None else None  # a bastion's key, or login, refused?
        if precise:
            return precise
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


_FINAL = ("Connection refused", "timed out", "Could not resolve", "Permission denied", "Host key", "No route",
          "Network is unreachable", "host key")

# What ssh prints when a connection is closed before the login (see shed), on its own or through a bastion.
_PRELOGIN = re.compile(r"(kex_exchange_identification: |banner exchange: Connection to |Connection (closed|reset) by )")


def shed(stderr: str) -> bool:
    """Whether ssh's stderr says the server (or a bastion) closed the connection before the login, for no
    reason of its own: what sshd's MaxStartups does to a burst of connections. Never for a refusal, a
    timeout, a failed login or a host key problem."""
    # the identification exchange is the first thing on a connection: a failure there ran nothing yet
    # through a bastion the drop can also reach our ssh as a failed write of its banner ("banner exchange:
    # Connection to UNKNOWN port 65535: Broken pipe", seen with 64 hosts behind one bastion)
    return ("kex_exchange_identification" in stderr or "banner exchange: Connection to" in stderr) and not any(
        word in stderr for word in _FINAL)
