"""What `ssh HOST` would connect to: each host resolved through the user's OpenSSH config.

"If `ssh HOST` works, clusterctl works": a host in a spec may be an alias of the user's ssh config,
reached as another user, on another port, through bastions. OpenSSH itself resolves it (`ssh -G`
prints the configuration it would use, without connecting), so every feature of the config — Match,
Include, wildcards, tokens — means exactly what it means to `ssh`. What the spec sets explicitly
(user, port, proxy_jump) is passed on ssh's command line, where it wins over the config.

`ssh -G` is asked only for the names the config can change apart: the config's Host and Match lines are
read once (clusterctl.sshconfigfile), names that meet the same ones form a class, and one name per class
is asked (and one more, to check); names the reader cannot judge (`Match exec`, ...) are asked each.
Results are cached on disk (privately: clusterctl.cache), keyed by the question and by the size and mtime
of every file the config comes from (Include followed), so that commands after the first pay nothing;
`ssh.config: none` needs no resolution at all.
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
from dataclasses import dataclass, replace

from .errors import ClusterctlError
from .procs import run_session

__all__ = ["Target", "Resolved", "JumphostLoop", "resolve", "resolve_each", "stamp_paths", "config_path", "ssh_g_argv", "parse_ssh_g",
           "SYSTEM_CONFIG", "USER_CONFIG"]

SYSTEM_CONFIG = "/etc/ssh/ssh_config"
USER_CONFIG = "~/.ssh/config"
GLOBAL_KNOWN_HOSTS = ("/etc/ssh/ssh_known_hosts", "/etc/ssh/ssh_known_hosts2")  # ssh's own, with no config
_TIMEOUT = 10.0  # `ssh -G` reads files and, for `Match exec`, runs the user's commands: bounded
_CACHE_VERSION = 8
_MODELS: dict = {}  # config -> (its files' stats, the ConfigModel last read for it in this process)


class JumphostLoop(ClusterctlError):
    """`ssh -G` refused a host as its own jump host ("jumphost loop via NAME": a `Host *` ProxyJump that meets the
    bastion too); `address` is the name asked."""

    def __init__(self, message: str, address: str):
        super().__init__(message)
        self.address = address


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
    global_known_hosts: tuple[str, ...] = ()  # GlobalKnownHostsFile entries: checked too, never written
    identity_files: tuple[str, ...] = ()  # IdentityFile entries (for the paramiko paths)
    certificate_files: tuple[str, ...] = ()  # CertificateFile entries (for the paramiko paths)
    identities_only: bool = False  # IdentitiesOnly yes: those files' keys only, the agent's only where they match
    identity_agent: str | None = None  # IdentityAgent: the agent's socket (`none`, `SSH_AUTH_SOCK`, `$VAR`, a path)
    host_key_alias: str | None = None  # HostKeyAlias: the name its host key is looked up and recorded under
    hop_jump: tuple[str, ...] = ()  # the bastions before the first one, by its own ProxyJump (set by the planner)
    hop_command: str | None = None  # the outermost bastion's own ProxyCommand (set by the planner, not by `ssh -G`)


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
    known_global = [p for line in multi.get("globalknownhostsfile", []) for p in line.split()]
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
        global_known_hosts=tuple(known_global),
        identity_files=tuple(multi.get("identityfile", [])),
        certificate_files=tuple(multi.get("certificatefile", [])),
        identities_only=single.get("identitiesonly", "no").lower() == "yes",
        identity_agent=single.get("identityagent") or None,
        host_key_alias=single.get("hostkeyalias") or None,
    )


def unresolved(target: Target) -> Resolved:
    """What a target means with no config file at all (`ssh.config: none`): ssh's built-in defaults."""
    return Resolved(
        hostname=target.address,
        user=target.user or _local_user(),
        port=target.port or 22,
        known_hosts=(os.path.expanduser("~/.ssh/known_hosts"),),
        global_known_hosts=GLOBAL_KNOWN_HOSTS,
    )


def resolve(targets: Sequence[Target], config: str | None) -> list[Resolved]:
    """Resolve every target as `ssh` would under `config` (None: ssh's default config files, "none": no
    file, else a path); raises ClusterctlError with one line when ssh rejects the config.

    `ssh -G` runs only for the names the config can change apart (clusterctl.sshconfigfile): one name of
    each class of names that meet the same Host/Match lines, one more to check, and each name the reader
    cannot judge; the other names' answers are their class's, with their own host name."""
    if config is not None and config.lower() == "none":
        return [unresolved(t) for t in targets]
    given = os.path.expanduser(config) if config is not None else None
    if given is not None and os.path.isdir(given):
        raise ClusterctlError(f"ssh config {config}: is a directory")
    if given is not None and not os.path.exists(given):  # a device is read as a file (/dev/null)
        raise ClusterctlError(f"ssh config {config}: no such file")
    files = [given] if given is not None else [SYSTEM_CONFIG, os.path.expanduser(USER_CONFIG)]
    if not any(os.path.exists(f) for f in files):
        return [unresolved(t) for t in targets]
    if shutil.which("ssh") is None:
        return _resolve_paramiko(targets, config, files)
    from .sshconfigfile import ConfigModel

    model = ConfigModel(config)
    paths = stamp_paths(config, model)
    _MODELS[config] = (_stats(paths), model)
    cache = _Cache(config, paths, targets)
    found = {t: cache.get(t) for t in targets}
    missing = [t for t, r in found.items() if r is None]
    if missing:
        got = _by_class(missing, config, model)
        found.update(got)
        cache.put(got)
    return [found[t] for t in targets]  # type: ignore[misc]


def may_set(config: str | None, keyword: str) -> bool:
    """Whether the ssh config `config` (None: ssh's default files) may set `keyword` (lower-case) for some host:
    False only when none of its files uses it (the reading of resolve()'s last call for `config` if any)."""
    if config is not None and config.lower() == "none":
        return False
    stats, model = _MODELS.get(config, (None, None))
    if model is None or stats != _stats(stamp_paths(config, model)):  # none yet, or a file changed since
        from .sshconfigfile import ConfigModel

        model = ConfigModel(config)
        _MODELS[config] = (_stats(stamp_paths(config, model)), model)
    return model.dynamic is not None or keyword in model.keywords


def resolve_each(targets: Sequence[Target], config: str | None) -> list[Resolved]:
    """Every target through its own `ssh -G`, no cache (what resolve() must equal; for tests, benchmarks)."""
    got = _ask(list(dict.fromkeys(targets)), config)
    return [got[t] for t in targets]


def stamp_paths(config: str | None, model=None) -> list[str]:
    """The files and directories whose size and mtime stand for the ssh config `config` (None: ssh's default
    files): every file ssh reads or would read if it were there (Include followed), and the directories
    an Include glob lists (a file appearing there changes them)."""
    if model is None:
        from .sshconfigfile import ConfigModel

        model = ConfigModel(config)
    tops = [os.path.expanduser(config)] if config is not None else [os.path.expanduser(USER_CONFIG), SYSTEM_CONFIG]
    return sorted({*model.files, *model.dirs, *tops})


def _ask(targets: list[Target], config: str | None) -> dict[Target, Resolved]:
    """`ssh -G` for each target, 16 at a time."""
    if not targets:
        return {}
    with ThreadPoolExecutor(max_workers=min(16, len(targets))) as pool:
        return dict(zip(targets, pool.map(lambda t: _ssh_g(config, t), targets), strict=True))


def _by_class(targets: list[Target], config: str | None, model) -> dict[Target, Resolved]:
    """Resolve `targets` asking ssh once per class of names (twice, to check) and per name the reader
    cannot judge; a class whose check fails is asked name by name."""
    classes: dict[tuple, list] = {}
    single: list[Target] = []
    for t in targets:
        c = model.classify(t.address, t.user)
        if c.dynamic is not None:
            single.append(t)
        else:
            classes.setdefault((c.key, t.port), []).append((t, c))
    asked = _ask(single + [m[0][0] for m in classes.values()] + [m[-1][0] for m in classes.values() if len(m) > 1],
                 config)
    out = {t: asked[t] for t in single}
    again: list[Target] = []
    for members in classes.values():
        (first, first_class), (last, last_class) = members[0], members[-1]
        rep = asked[first]
        if rep.hostname != first_class.hostname or replace(rep, hostname=last_class.hostname) != asked[last]:
            again += [t for t, _ in members[1:-1]]  # the model is wrong here: ask ssh for every name
            out[first], out[last] = rep, asked[last]
            continue
        out.update((t, replace(rep, hostname=c.hostname)) for t, c in members)
    out.update(_ask(again, config))
    LAST.update(names=len(targets), classes=len(classes), asked=len(asked) + len(again), rechecked=len(again))
    return out


#: what the last resolution did (names, classes, `ssh -G` runs, names asked again after a failed check)
LAST: dict[str, int] = {}


def ssh_g_refusal(stderr: str, config: str | None, target: Target) -> str:
    """One line for an `ssh -G` that refused the config: what ssh said about each bad line (its closing
    "terminating, N bad configuration options" only where it said nothing else)."""
    said = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    problems = [ln for ln in said if not (": terminating, " in ln and "bad configuration option" in ln)]
    where = f"ssh config {config}" if config else "your ssh config"
    return f"{where}: {'; '.join(problems or said) or f'ssh -G {target.address} failed'}"


def _ssh_g(config: str | None, target: Target) -> Resolved:
    argv = ssh_g_argv(config, target)
    try:  # a session of its own: the commands of the config's `Match exec` are ssh's children, ended with it
        proc = run_session(argv, timeout=_TIMEOUT)
    except subprocess.TimeoutExpired:
        raise ClusterctlError(f"resolving {target.address} with `ssh -G` took over {_TIMEOUT:g}s (a Match exec in the ssh config?)") from None
    stdout, stderr = proc.stdout.decode("utf-8", "replace"), proc.stderr.decode("utf-8", "replace")
    if proc.returncode != 0:
        why = ssh_g_refusal(stderr, config, target)
        if "jumphost loop" in stderr:
            raise JumphostLoop(why, target.address)
        raise ClusterctlError(why)
    return parse_ssh_g(stdout, target)


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
                global_known_hosts=tuple(str(found.get("globalknownhostsfile", " ".join(GLOBAL_KNOWN_HOSTS))).split()),
                identity_files=tuple(found.get("identityfile", ())),
                certificate_files=tuple(found.get("certificatefile", "").split()),
                identities_only=str(found.get("identitiesonly", "no")).lower() == "yes",
                identity_agent=found.get("identityagent") or None,
                host_key_alias=found.get("hostkeyalias") or None,
            )
        )
    return out


def _local_user() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return str(os.getuid())


def _stats(paths: list[str]) -> list:
    """Each path with its size and mtime, or None when it cannot be read: what stands for a config's files."""
    out: list = []
    for p in paths:
        try:
            st = os.stat(p)
            out.append((p, st.st_size, st.st_mtime_ns))
        except OSError:
            out.append((p, None))
    return out


class _Cache:
    """`ssh -G` answers on disk, valid while no file the config can come from has changed: in a private
    directory (clusterctl.cache.private_dir), 0600, every entry checked field by field (anything else, and
    a directory anyone else could write to, is a miss).

    One file per set of targets (a spec's hosts), holding only their answers: one file per config took every
    name ever resolved, 61 MB after a day of tests, 2.2 s of JSON for every cold `validate` of a 4-host spec. The
    RECENT most recently used files are kept, and the others used within IDLE_S (a miss now costs a few `ssh -G`,
    one per class of names: resolve())."""

    MAX_BYTES = 64 << 20
    RECENT = 64
    IDLE_S = 7 * 86400

    def __init__(self, config: str | None, paths: list[str], targets: Sequence[Target] = ()):
        from .cache import private_dir, read_private

        names = sorted({self._key(t) for t in targets})
        stamp = [_CACHE_VERSION, config, os.environ.get("USER"), os.getuid(), *_stats(paths), names]
        key = hashlib.sha256(json.dumps(stamp).encode()).hexdigest()[:24]
        folder = private_dir("sshg")
        self.folder = folder
        self.path = None if folder is None else os.path.join(folder, f"{key}.json")
        self.data: dict = {}
        raw = None if self.path is None else read_private(self.path, self.MAX_BYTES)
        if raw is not None:
            try:
                data = json.loads(raw)
            except (ValueError, RecursionError):
                data = None
            self.data = data if isinstance(data, dict) else {}
            try:
                os.utime(self.path)  # used: kept by the pruning in put()
            except OSError:
                pass

    @staticmethod
    def _key(t: Target) -> str:
        return json.dumps([t.address, t.user, t.port])

    def get(self, t: Target) -> Resolved | None:
        """The cached answer for `t`, or None (also for an entry that is not exactly one we write)."""
        return _entry(self.data.get(self._key(t)))

    def put(self, found: dict[Target, Resolved]) -> None:
        """Add `found` and write the file (0600); a cache that cannot be written is only slower."""
        from dataclasses import asdict

        from .cache import write_private

        if self.path is None:
            return
        self.data.update({self._key(t): asdict(r) for t, r in found.items()})
        write_private(self.path, json.dumps(self.data).encode())
        from .cache import prune_lru

        prune_lru(self.folder, self.RECENT, self.IDLE_S, match=lambda name: name.endswith(".json"))


_STRS = ("proxy_jump", "known_hosts", "global_known_hosts", "identity_files", "certificate_files")


def _entry(entry) -> Resolved | None:
    """A Resolved from a cache entry whose every field has the type and form we store; else None."""
    if not isinstance(entry, dict) or set(entry) != {f for f in Resolved.__dataclass_fields__}:
        return None
    port, command, alias, agent = entry["port"], entry["proxy_command"], entry["host_key_alias"], entry["identity_agent"]
    if not (isinstance(entry["hostname"], str) and entry["hostname"] and isinstance(entry["user"], str)
            and type(port) is int and 1 <= port <= 65535 and (command is None or isinstance(command, str))
            and all(v is None or (isinstance(v, str) and v) for v in (alias, agent))):
        return None
    if not all(isinstance(entry[k], list) and all(isinstance(x, str) for x in entry[k]) for k in _STRS):
        return None
    if type(entry["identities_only"]) is not bool or entry["hop_command"] is not None or entry["hop_jump"] != []:
        return None
    return Resolved(entry["hostname"], entry["user"], port, tuple(entry["proxy_jump"]), command,
                    tuple(entry["known_hosts"]), tuple(entry["global_known_hosts"]), tuple(entry["identity_files"]),
                    tuple(entry["certificate_files"]), entry["identities_only"], agent, alias)
