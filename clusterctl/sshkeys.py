"""What paramiko's connections (clusterctl.sshconn) know of keys, as ssh knows it: the host keys they accept (the
known_hosts files, user's and system-wide, read and matched as ssh reads and matches them; HostKeyAlias; `@revoked`;
the strict and accept-new policies) and the user's keys they offer (IdentityFile as ssh opens it; a user certificate with the key
it certifies; the agent's key of a file). Imported with clusterctl.sshconn, on first use only (paramiko).
"""

from __future__ import annotations

import fcntl
import hmac
import logging
import os
import select
import socket
import stat
import threading
from pathlib import Path
from typing import TYPE_CHECKING

import paramiko

from .cache import makedirs
from .errors import ClusterctlError
from .sshconfigfile import match_pattern
from .transport.base import SshOptions, fingerprint

if TYPE_CHECKING:
    from .sshconfig import Resolved

__all__ = ["HostKeyError", "host_key_client", "key_files", "certified_key", "agent_key_for", "agent_socket",
           "SocketAgent", "forward_agent", "AcceptNewPolicy", "StrictPolicy"]

log = logging.getLogger("clusterctl.remote")


class HostKeyError(paramiko.SSHException):
    """Raised inside paramiko's connect when a host key is not acceptable (`hostname` as paramiko names the
    host: `name`, or `[name]:port` off port 22)."""

    def __init__(self, message: str, hostname: str):
        super().__init__(message)
        self.hostname = hostname


def _refuse_revoked(hostname: str, name: str, key, revoked: frozenset[bytes]) -> None:
    """Raise HostKeyError for a key a known_hosts file marks `@revoked` (ssh refuses it under every policy)."""
    if key.asbytes() in revoked:
        raise HostKeyError(f"host key for {name} ({key.get_name()} {fingerprint(key)}) is marked @revoked in a "
                            "known_hosts file: refused", hostname)


def _certified_in(paths, name: str) -> str | None:
    """The first of the known_hosts files `paths` with a `@cert-authority` line for `name`, if any: a host ssh
    trusts through a host certificate, which paramiko cannot check (read only when a key is refused)."""
    for path in paths:
        try:
            with open(path, encoding="utf-8", errors="replace") as fh:
                for line in fh:
                    words = line.split()
                    if len(words) >= 3 and words[0] == "@cert-authority" and _for_host(name, words[1].split(",")):
                        return path
        except OSError:
            continue
    return None


class StrictPolicy(paramiko.MissingHostKeyPolicy):
    def __init__(self, known_hosts: str, alias: str | None = None, revoked: frozenset[bytes] = frozenset(),
                 files: tuple[str, ...] = ()):
        self.known_hosts, self.alias, self.revoked, self.files = known_hosts, alias, revoked, files

    def missing_host_key(self, client, hostname, key):
        name = self.alias or hostname
        _refuse_revoked(hostname, name, key, self.revoked)
        certified = _certified_in(self.files, name)
        if certified is not None:  # ssh would take the host's certificate; this connection cannot check one
            raise HostKeyError(
                f"host key for {name} ({key.get_name()} {fingerprint(key)}) is trusted in {certified} through a "
                "@cert-authority line, and paramiko, used here for want of an `ssh` client, checks no host "
                f"certificate: install the OpenSSH client, or add the host's own key to {self.known_hosts} (verified)",
                hostname,
            )
        raise HostKeyError(
            f"unknown host key for {name} ({key.get_name()} {fingerprint(key)}); "
            f"not in {self.known_hosts}. Verify it and add it (ssh-keyscan), or use host_key_policy: accept-new",
            hostname,
        )


class AcceptNewPolicy(paramiko.MissingHostKeyPolicy):
    _lock = threading.Lock()

    def __init__(self, known_hosts: str, alias: str | None = None, revoked: frozenset[bytes] = frozenset()):
        self.known_hosts, self.alias, self.revoked = known_hosts, alias, revoked

    def missing_host_key(self, client, hostname, key):
        named = hostname  # paramiko's name for the host, under which the client looks its key up
        hostname = self.alias or hostname  # the name the key is recorded under: the HostKeyAlias, as ssh does
        _refuse_revoked(named, hostname, key, self.revoked)
        line = f"{hostname} {key.get_name()} {key.get_base64()}\n"
        path = Path(self.known_hosts)
        with self._lock:
            makedirs(path.parent)  # ~/.ssh as ssh makes it (0700), but never a home directory that does not exist
            with open(path, "a+", encoding="utf-8") as fh:
                fcntl.flock(fh, fcntl.LOCK_EX)
                # another connection (a bastion shared by many hosts, another clusterctl) may have recorded
                # it since this client loaded the file: record each key once, and never a second one
                fh.seek(0)
                entries = _parse_known(fh.read().splitlines())[0]  # a line it cannot read: not ours to judge
                seen = [e.key for e in entries if e.key.get_name() == key.get_name() and _for_host(hostname, e.hostnames)]
                if seen and key not in seen:
                    raise HostKeyError(f"host key for {hostname} changed while connecting: {self.known_hosts} now "
                                        f"has {fingerprint(seen[0])}, the host sent {fingerprint(key)}", named)
                if not seen:
                    fh.seek(0, os.SEEK_END)
                    fh.write(line)
        client.get_host_keys().add(named, key.get_name(), key)
        if not seen:
            log.warning("recorded new host key for %s (%s) in %s", hostname, fingerprint(key), self.known_hosts)


class _OffPolicy(paramiko.MissingHostKeyPolicy):
    def missing_host_key(self, client, hostname, key):
        pass  # explicitly requested with host_key_policy: off (warned about on every run)


def _known_hosts(options: SshOptions, resolved: Resolved | None) -> list[str]:
    """The known_hosts files host keys are checked against, the one new keys go to first: the spec's, else the
    ssh config's UserKnownHostsFile for this host (as ssh reads them), else ~/.ssh/known_hosts."""
    files = [options.known_hosts] if options.known_hosts else list(resolved.known_hosts if resolved else ())
    return [os.path.expanduser(f) for f in files or ["~/.ssh/known_hosts"]]


KNOWN_HOSTS_LIMIT = 256 << 20  # bytes of one known_hosts file read (a fleet's system-wide file: tens of MiB)
_PARSED: dict[str, tuple[tuple, tuple[list, frozenset[bytes]]]] = {}  # path -> ((size, mtime), _parse_known's answer)
_UNIONS: dict[tuple, tuple[list, frozenset[bytes]]] = {}  # ((path, (size, mtime)), ...) -> _union's answer


def _known_entries(paths: list[str]) -> tuple[list, frozenset[bytes]]:
    """The host key entries of the known_hosts files `paths` (those that are there), in their order, and the keys
    any of them marks `@revoked`, which no entry offers. Each file is parsed once per process while it is unchanged,
    and so is their union (a fleet's system-wide file can hold thousands of hosts, and every connection of a command
    reads the same files). The entries are shared: read them only."""
    stamps = []
    for path in paths:
        try:
            st = os.stat(path)
        except OSError:
            continue
        if not stat.S_ISREG(st.st_mode):  # /dev/zero would be read for ever, a FIFO wait for a writer
            raise ClusterctlError(f"known_hosts file {path} is not a regular file")
        if st.st_size > KNOWN_HOSTS_LIMIT:
            raise ClusterctlError(f"known_hosts file {path} is larger than {KNOWN_HOSTS_LIMIT >> 20} MiB")
        stamps.append((path, (st.st_size, st.st_mtime_ns)))
    key = tuple(stamps)
    if key not in _UNIONS:
        if len(_UNIONS) >= 16:
            _UNIONS.clear()
        _UNIONS[key] = _union(stamps)
    entries, revoked = _UNIONS[key]
    return list(entries), revoked


def _union(stamps: list[tuple[str, tuple]]) -> tuple[list, frozenset[bytes]]:
    entries, revoked = [], set()
    for path, stamp in stamps:
        try:
            if _PARSED.get(path, (None,))[0] != stamp:
                with open(path, encoding="utf-8", errors="replace") as fh:
                    _PARSED[path] = (stamp, _parse_known(fh))
        except OSError:
            continue
        found, marked = _PARSED[path][1]
        revoked |= marked
        entries.extend(found)
    return [e for e in entries if e.key.asbytes() not in revoked], frozenset(revoked)


def _parse_known(lines) -> tuple[list, frozenset[bytes]]:
    """known_hosts lines as ssh reads them, where paramiko's own reader stops at the first line it cannot parse:
    plain entries, and the keys of `@revoked` lines; `@cert-authority` lines are left out (paramiko checks no host
    certificate: such a host's plain key is unknown here) and so is a line that is not a key."""
    entries, revoked = [], set()
    for line in lines:
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        marker = ""
        if line.startswith("@"):
            marker, line = (line.split(None, 1) + [""])[:2]
            if marker != "@revoked":
                continue
        try:
            entry = paramiko.hostkeys.HostKeyEntry.from_line(" ".join(line.split()))
        except (paramiko.hostkeys.InvalidHostKey, paramiko.SSHException, ValueError):
            continue
        if entry is not None and entry.key is not None:
            (revoked.add(entry.key.asbytes()) if marker else entries.append(entry))
    return entries, frozenset(revoked)


def _for_host(name: str, hostnames: list[str]) -> bool:
    """Whether a known_hosts line's `hostnames` name `name` (`host`, or `[host]:port` off port 22, or a HostKeyAlias),
    as ssh matches it (match_hostname): a hashed name, or a list of patterns (`*`, `?`), any case, of which a
    matching negated one (`!pattern`) excludes the host whatever else matches (match_pattern_list, on the list
    paramiko has split). paramiko compares exact names only: a fleet's `10.1.*` or `node*,!node9` pin was met as
    no key at all."""
    lowered, hit = name.lower(), False
    for h in hostnames:
        if h.startswith("|1|"):
            hit = hit or hmac.compare_digest(paramiko.HostKeys.hash_host(name, h), h)
        elif h.startswith("!"):
            if match_pattern(lowered, h[1:].lower()):
                return False
        elif match_pattern(lowered, h.lower()):
            hit = True
    return hit


class _AnyOf:
    """Several keys of one type known for a host (its user's file and the system's disagree, a key being rotated):
    ssh accepts the host presenting any of them, where paramiko's client compares the first alone. Compares equal
    to each of them; reads as the first elsewhere (paramiko's messages)."""

    def __init__(self, keys: list):
        self.known = keys

    def __eq__(self, other):
        return any(k == other for k in self.known)

    def __ne__(self, other):
        return not self == other

    __hash__ = None  # type: ignore[assignment]

    def __getattr__(self, name):
        return getattr(self.known[0], name)


class _KnownKeys(paramiko.HostKeys):
    """paramiko's HostKeys whose lookup gives, for a key type with several keys, all of them (_AnyOf)."""

    def lookup(self, hostname):
        by_type: dict[str, list] = {}
        for e in self._entries:
            if e.key is not None and self._hostname_matches(hostname, e):
                by_type.setdefault(e.key.get_name(), []).append(e.key)
        return _ByType({kind: keys[0] if len(keys) == 1 else _AnyOf(keys) for kind, keys in by_type.items()}) or None


class _ByType(dict):
    """A host's keys by type, as paramiko's connect reads them: `keys()` a list (it takes the first as the type to
    ask the host for)."""

    def keys(self):  # type: ignore[override]
        return list(super().keys())


def _global_known_hosts(options: SshOptions, resolved: Resolved | None) -> list[str]:
    """The system-wide known_hosts files ssh also checks keys against (GlobalKnownHostsFile; where a fleet's
    configuration management pins its hosts' keys), never written: none beside the spec's known_hosts, which the
    OpenSSH path passes with GlobalKnownHostsFile=/dev/null."""
    if options.known_hosts or resolved is None:
        return []
    return [os.path.expanduser(f) for f in resolved.global_known_hosts]


def host_key_client(options: SshOptions, resolved: Resolved | None = None) -> paramiko.SSHClient:
    """A client that checks the host key of `resolved` (what a host or a bastion resolves to) as ssh would: against
    every known_hosts file, the user's and then the system's, under the host's name (`[name]:port` off port 22), or
    only under the ssh config's HostKeyAlias where it has one (ssh then looks up and records the alias alone); the
    names matched as ssh matches them (_for_host), any key listed for the host accepted (_KnownKeys)."""
    client = paramiko.SSHClient()  # our own: Fabric's default would AutoAdd unknown keys
    client._host_keys = _KnownKeys()
    known = _known_hosts(options, resolved)
    policy = options.host_key_policy
    alias = resolved.host_key_alias if resolved is not None else None
    revoked: frozenset[bytes] = frozenset()
    files = [*known, *_global_known_hosts(options, resolved)]
    if policy != "off":
        entries, revoked = _known_entries(files)
        if resolved is not None:  # the host's keys (or its alias's alone), under the name paramiko will look up
            port = resolved.port
            named = resolved.hostname if port == 22 else f"[{resolved.hostname}]:{port}"  # as paramiko's connect names it
            keys: dict[bytes, paramiko.PKey] = {}
            for e in entries:
                if _for_host(alias or named, e.hostnames):
                    keys.setdefault(e.key.asbytes(), e.key)
            entries = [paramiko.hostkeys.HostKeyEntry([named], key) for key in keys.values()]
        client.get_host_keys()._entries.extend(entries)  # parsed once per file (paramiko's load: quadratic)
    if policy == "strict":
        client.set_missing_host_key_policy(StrictPolicy(known[0], alias, revoked, tuple(files)))
    elif policy == "accept-new":
        client.set_missing_host_key_policy(AcceptNewPolicy(known[0], alias, revoked))
    else:
        client.set_missing_host_key_policy(_OffPolicy())
    client.host_key_alias = alias  # type: ignore[attr-defined]  # ours: names the key in a refusal (_key_refused)
    return client


def key_files(r: Resolved, name: str) -> list[str]:
    """The ssh config's IdentityFiles for `r` (the host or bastion it calls `name`) as ssh opens them: `~`,
    `${VAR}` and the tokens of ssh_config(5) expanded (OpenSSH 9.2's: %%, %C, %d, %h, %i, %k, %L, %l, %n, %p, %r,
    %u); ClusterctlError for one ssh would refuse. `ssh -G` prints them as written."""
    return _config_files(r.identity_files, "IdentityFile", r, name)


def _config_files(values: tuple[str, ...], keyword: str, r: Resolved, name: str) -> list[str]:
    import hashlib

    from .sshconfigfile import expand_path, local_tokens

    if not any("%" in f or "$" in f or f.startswith("~") for f in values):
        return list(values)
    tokens = local_tokens()
    tokens.update(h=r.hostname, p=str(r.port), r=r.user, n=name, k=r.host_key_alias or name)
    tokens["C"] = hashlib.sha1(f"{tokens['l']}{r.hostname}{r.port}{r.user}".encode()).hexdigest()
    out = []
    for value in values:
        try:
            out.append(expand_path(value, tokens))
        except KeyError as exc:
            raise ClusterctlError(f"{name}: {keyword} {value}: token %{exc.args[0]} is not one ssh expands "
                                  "there") from None
        except LookupError as exc:
            raise ClusterctlError(f"{name}: {keyword} {value}: environment variable {exc.args[0]} is not "
                                  "set") from None
    return out


def certified_key(r: Resolved, name: str, files: list[str], sock: str | None):
    """A user certificate with the private key it certifies, as ssh pairs them, or None. The certificates: the ssh
    config's CertificateFiles (expanded as IdentityFile is), then each key file's `FILE-cert.pub`. The key: one of
    `files` (the key files, not under a passphrase: none is ever asked), else the agent's at `sock`. paramiko offers
    it first, as ssh offers certificates first."""
    certs = [*_config_files(r.certificate_files, "CertificateFile", r, name), *(f + "-cert.pub" for f in files)]
    held = None
    for cert in certs:
        try:
            blob = paramiko.pkey.PublicBlob.from_file(cert)
        except (OSError, ValueError, UnicodeDecodeError, paramiko.SSHException):
            continue  # not there, or not a key (ssh skips it too)
        if not blob.key_type.endswith("-cert-v01@openssh.com"):
            continue
        for path in files:
            public = _public_blob(path)
            if public is None or not _certifies(blob.key_blob, public):
                continue
            try:
                key = paramiko.PKey.from_path(path)
            except (OSError, ValueError, TypeError, paramiko.SSHException):
                continue  # under a passphrase (paramiko 5: TypeError): the agent may hold it
            key.load_certificate(cert)
            return key
        if held is None:
            held = _agent_keys(sock)
        for key in held:
            if _certifies(blob.key_blob, key.asbytes()):
                key.load_certificate(cert)
                return key
    return None


def _certifies(cert_blob: bytes, public_blob: bytes) -> bool:
    """Whether the OpenSSH certificate `cert_blob` certifies the public key `public_blob`: the key's fields (its blob
    after the type) come right after the certificate's nonce (PROTOCOL.certkeys), for every key type."""
    try:
        cert, plain = paramiko.Message(cert_blob), paramiko.Message(public_blob)
        kind = plain.get_text()
        if cert.get_text() != f"{kind}-cert-v01@openssh.com":
            return False
        cert.get_binary()  # the nonce
        fields = plain.get_remainder()
        return bool(fields) and cert.get_remainder().startswith(fields)
    except (paramiko.SSHException, ValueError, IndexError, UnicodeDecodeError):
        return False


def _public_blob(path: str) -> bytes | None:
    """The public key of the key file `path` as ssh finds it: `path`.pub, else the unencrypted public half of an
    OpenSSH-format private key (there even when the key has a passphrase); None when neither is readable."""
    import base64
    import struct

    try:
        with open(path + ".pub", encoding="utf-8") as fh:
            fields = fh.read().split()
        if len(fields) >= 2:
            return base64.b64decode(fields[1], validate=True)
    except (OSError, UnicodeDecodeError, ValueError):
        pass
    try:
        with open(path, encoding="utf-8") as fh:
            lines = fh.read(1 << 16).strip().splitlines()
        if lines[:1] != ["-----BEGIN OPENSSH PRIVATE KEY-----"]:
            return None
        raw = base64.b64decode("".join(lines[1:-1]))
        magic = b"openssh-key-v1\0"
        at = len(magic)
        if not raw.startswith(magic):
            return None
        for _ in range(3):  # cipher name, kdf name, kdf options
            (n,) = struct.unpack_from(">I", raw, at)
            at += 4 + n
        (count, size) = struct.unpack_from(">II", raw, at)
        blob = raw[at + 8: at + 8 + size]
        return blob if count >= 1 and len(blob) == size else None
    except (OSError, UnicodeDecodeError, ValueError, struct.error):
        return None


def agent_key_for(files: list[str], sock: str | None):
    """The key of the ssh-agent at `sock` (agent_socket) for one of `files` (matched, as ssh matches it, by the file's
    public key), or None: no agent, or none of its keys is one of theirs."""
    wanted = {blob for blob in map(_public_blob, files) if blob}
    return next((k for k in _agent_keys(sock) if k.asbytes() in wanted), None) if wanted else None


def agent_socket(r: Resolved) -> str | None:
    """The ssh-agent socket ssh uses for `r`: the config's IdentityAgent (`none`: no agent; `SSH_AUTH_SOCK` or
    `$VAR`: that environment variable's), else SSH_AUTH_SOCK's; None for no agent."""
    value = r.identity_agent
    if value is None or value == "SSH_AUTH_SOCK":
        return os.environ.get("SSH_AUTH_SOCK") or None
    if value.lower() == "none":
        return None
    if value.startswith("$"):
        return os.environ.get(value[1:]) or None
    return os.path.expanduser(value)  # `ssh -G` gives it with its tokens and ~ expanded


class SocketAgent(paramiko.Agent):
    """The ssh-agent at `path` (IdentityAgent), where paramiko.Agent() only knows SSH_AUTH_SOCK's; no keys when it
    cannot be reached, as Agent()."""

    def __init__(self, path: str):
        paramiko.agent.AgentSSH.__init__(self)
        conn = socket.socket(socket.AF_UNIX)
        try:
            conn.settimeout(5)
            conn.connect(path)
            conn.settimeout(None)
        except OSError:
            conn.close()
            return
        self._connect(conn)


def forward_agent(chan: paramiko.Channel, sock: str | None) -> None:
    """ssh's ForwardAgent on the session `chan`: each agent connection the host opens is relayed to the agent at
    `sock` (agent_socket: the config's IdentityAgent, else SSH_AUTH_SOCK's, the agent ssh forwards), or closed at
    once when there is none. paramiko's own handler opens SSH_AUTH_SOCK's, polls, and raises in its thread."""

    def relay(remote: paramiko.Channel) -> None:  # on paramiko's transport thread: connect, hand over, return
        local = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            if sock is None:
                raise OSError("no agent")
            local.settimeout(5)
            local.connect(sock)
            local.settimeout(None)
        except OSError:
            local.close()
            remote.close()
            return
        threading.Thread(target=_pump, args=(remote, local), daemon=True, name="clusterctl-agent").start()

    chan.request_forward_agent(relay)


def _pump(remote: paramiko.Channel, local: socket.socket) -> None:
    """Bytes both ways between a forwarded agent channel and the local agent, until either side closes."""
    try:
        while True:
            ready = select.select([remote, local], [], [])[0]
            for src, dst in ((remote, local), (local, remote)):
                if src in ready:
                    data = src.recv(65536)
                    if not data:
                        return
                    dst.sendall(data)
    except (OSError, EOFError, paramiko.SSHException):
        pass
    finally:
        local.close()
        remote.close()

def _agent_keys(sock: str | None) -> list:
    """The keys the ssh-agent at `sock` holds ([] with none): its connection stays open while one of them is used."""
    if sock is None:
        return []
    try:
        return list(SocketAgent(sock).get_keys())
    except (paramiko.SSHException, OSError):
        return []
