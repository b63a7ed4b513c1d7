"""What `ssh HOST` would connect to: each host resolved through the user's OpenSSH config.

"If `ssh HOST` works, clusterctl works": a host in a spec may be an alias of the user's ssh config,
reached as another user, on another port, through bastions. OpenSSH itself resolves it (`ssh -G`
prints the configuration it would use, without connecting), so every feature of the config — Match,
Include, wildcards, tokens — means exactly what it means to `ssh`. What the spec sets explicitly
(user, port, proxy_jump) is passed on ssh's command line, where it wins over the config.

Results are cached on disk, keyed by the question and by the size and mtime of every file the
config can come from (the config files and their directories, for Include), so that commands after
the first pay nothing; `ssh.config: none` needs no resolution at all.
"""

from __future__ import annotations

import getpass
import hashlib
import json
import os
import shutil
import subprocess
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from .errors import ClusterctlError

__all__ = ["Target", "Resolved", "resolve", "config_path", "ssh_g_argv", "parse_ssh_g", "SYSTEM_CONFIG", "USER_CONFIG"]

SYSTEM_CONFIG = "/etc/ssh/ssh_config"
USER_CONFIG = "~/.ssh/config"
_TIMEOUT = 10.0  # `ssh -G` reads files and, for `Match exec`, runs the user's commands: bounded
_CACHE_VERSION = 1


@dataclass(frozen=True)
class Target:
    """One host as the spec names it, with what the spec sets explicitly (None: the config decides)."""

    address: str
    user: str | None = None
    port: int | None = None


@dataclass(frozen=True)
class Resolved:
    """What OpenSSH would use for a Target: `ssh -G`'s hostname, user, port and jump chain."""

    hostname: str
    user: str
    port: int
    proxy_jump: tuple[str, ...] = ()  # from the config's ProxyJump (first hop first); () when none
    proxy_command: str | None = None  # the config's ProxyCommand, left to ssh
    known_hosts: tuple[str, ...] = ()  # UserKnownHostsFile entries (for the paramiko paths)
    identity_files: tuple[str, ...] = ()  # IdentityFile entries (for the paramiko paths)


def config_path(spec) -> str | None:
    """The ssh config file of a ClusterSpec: None (ssh's default files), "none", or a path resolved
    against the spec file's directory."""
    cfg = spec.ssh.config
    if cfg is None or cfg.lower() == "none":
        return cfg
    return str(spec.local_path(cfg))


def ssh_g_argv(config: str | None, target: Target) -> list[str]:
    """The `ssh -G` command line that resolves `target` under `config` (None: ssh's default files)."""
    argv = ["ssh", "-G"]
    if config is not None:
        argv += ["-F", config]
    if target.user:
        argv += ["-l", target.user]
    if target.port:
        argv += ["-p", str(target.port)]
    return argv + ["--", target.address]


def parse_ssh_g(text: str, target: Target) -> Resolved:
    """Parse `ssh -G` output (one `keyword value` per line, keywords lower-case) into a Resolved."""
    single: dict[str, str] = {}
    multi: dict[str, list[str]] = {}
    for line in text.splitlines():
        key, _, value = line.strip().partition(" ")
        if not key:
            continue
        multi.setdefault(key, []).append(value)
        single.setdefault(key, value)
    jump = single.get("proxyjump", "none")
    command = single.get("proxycommand", "none")
    known = [p for line in multi.get("userknownhostsfile", []) for p in line.split()]
    try:
        port = int(single.get("port", "22"))
    except ValueError:
        port = 22
    return Resolved(
        hostname=single.get("hostname") or target.address,
        user=single.get("user") or target.user or _local_user(),
        port=port,
        proxy_jump=() if jump.lower() == "none" else tuple(h.strip() for h in jump.split(",") if h.strip()),
        proxy_command=None if command.lower() == "none" else command,
        known_hosts=tuple(known),
        identity_files=tuple(multi.get("identityfile", [])),
    )


def unresolved(target: Target) -> Resolved:
    """What a target means with no config file at all (`ssh.config: none`): ssh's built-in defaults."""
    return Resolved(
        hostname=target.address,
        user=target.user or _local_user(),
        port=target.port or 22,
        known_hosts=(os.path.expanduser("~/.ssh/known_hosts"),),
    )


def resolve(targets: Sequence[Target], config: str | None) -> list[Resolved]:
    """Resolve every target as `ssh` would under `config` (None: ssh's default config files, "none": no
    file, else a path); raises ClusterctlError with one line when ssh rejects the config."""
    if config is not None and config.lower() == "none":
        return [unresolved(t) for t in targets]
    if config is not None and not os.path.isfile(os.path.expanduser(config)):
        raise ClusterctlError(f"ssh config {config}: no such file")
    files = [os.path.expanduser(config)] if config is not None else [SYSTEM_CONFIG, os.path.expanduser(USER_CONFIG)]
    if not any(os.path.exists(f) for f in files):
        return [unresolved(t) for t in targets]
    if shutil.which("ssh") is None:
        return _resolve_paramiko(targets, config, files)
    cache = _Cache(config, files)
    found = {t: cache.get(t) for t in targets}
    missing = [t for t, r in found.items() if r is None]
    if missing:
        with ThreadPoolExecutor(max_workers=min(16, len(missing))) as pool:
            for target, res in zip(missing, pool.map(lambda t: _ssh_g(config, t), missing), strict=True):
                found[target] = res
        cache.put({t: found[t] for t in missing})
    return [found[t] for t in targets]  # type: ignore[misc]


def _ssh_g(config: str | None, target: Target) -> Resolved:
    argv = ssh_g_argv(config, target)
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=_TIMEOUT, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise ClusterctlError(f"resolving {target.address} with `ssh -G` took over {_TIMEOUT:g}s (a Match exec in the ssh config?)") from None
    if proc.returncode != 0:
        said = [ln.strip() for ln in proc.stderr.splitlines() if ln.strip()]
        where = f"ssh config {config}" if config else "your ssh config"
        raise ClusterctlError(f"{where}: {said[-1] if said else f'ssh -G {target.address} failed'}")
    return parse_ssh_g(proc.stdout, target)


def _resolve_paramiko(targets: Sequence[Target], config: str | None, files: list[str]) -> list[Resolved]:
    """No `ssh` binary here: paramiko's reader of the same files (Host blocks; no Match exec, no Include)."""
    import paramiko

    cfg = paramiko.SSHConfig()
    for f in files:
        if os.path.isfile(f):
            with open(f, encoding="utf-8") as fh:
                cfg.parse(fh)
    out = []
    for t in targets:
        found = cfg.lookup(t.address)
        jump = found.get("proxyjump", "none")
        out.append(
            Resolved(
                hostname=found.get("hostname", t.address),
                user=t.user or found.get("user") or _local_user(),
                port=t.port or int(found.get("port", 22)),
                proxy_jump=() if jump.lower() == "none" else tuple(h.strip() for h in jump.split(",")),
                proxy_command=found.get("proxycommand"),
                known_hosts=tuple(str(found.get("userknownhostsfile", "~/.ssh/known_hosts")).split()),
                identity_files=tuple(found.get("identityfile", ())),
            )
        )
    return out


def _local_user() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return str(os.getuid())


class _Cache:
    """`ssh -G` answers on disk, valid while no file the config can come from has changed."""

    def __init__(self, config: str | None, files: list[str]):
        from .cache import cache_dir

        stamp = [_CACHE_VERSION, config, os.environ.get("USER"), os.getuid()]
        for f in files:
            for p in [f, *_siblings(f)]:
                try:
                    st = os.stat(p)
                    stamp.append((p, st.st_size, st.st_mtime_ns))
                except OSError:
                    stamp.append((p, None))
        key = hashlib.sha256(json.dumps(stamp).encode()).hexdigest()[:24]
        self.path = cache_dir("sshg") / f"{key}.json"
        try:
            self.data: dict[str, dict] = json.loads(self.path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            self.data = {}

    @staticmethod
    def _key(t: Target) -> str:
        return json.dumps([t.address, t.user, t.port])

    def get(self, t: Target) -> Resolved | None:
        entry = self.data.get(self._key(t))
        if not isinstance(entry, dict):
            return None
        try:
            return Resolved(**{k: tuple(v) if isinstance(v, list) else v for k, v in entry.items()})
        except TypeError:
            return None

    def put(self, found: dict[Target, Resolved]) -> None:
        from dataclasses import asdict

        self.data.update({self._key(t): asdict(r) for t, r in found.items()})
        tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
        try:
            tmp.write_text(json.dumps(self.data), encoding="utf-8")
            os.replace(tmp, self.path)
        except OSError:
            tmp.unlink(missing_ok=True)  # a cache that cannot be written is only slower


def _siblings(path: str) -> list[str]:
    """Files beside a config file and in its `*.d` directory (where Include usually points)."""
    out = []
    p = Path(path)
    for d in (p.parent, Path(str(p) + ".d")):
        try:
            out += sorted(str(e) for e in d.iterdir() if e.is_file() and not e.name.startswith("known_hosts"))
        except OSError:
            continue
    return out
