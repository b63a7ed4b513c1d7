"""The validated plan of a spec file, kept on disk so that `exec`, `status`, `logs` and `stop` start fast.

Loading a spec costs the pydantic models, the YAML parser and an `ssh -G` per host (~0.3 s of Python
start-up); the plan those give is a pure function of bytes this module can check in a few milliseconds.
An entry is found by the spec's path (as given) and the working directory, and used only when every
input it was made from is unchanged, compared by content:

- the spec file's bytes (sha256) and the hostfile's, when the spec names one;
- with `data:`, the listing of every file under data.local (names, not contents: the plan deals names);
- the ssh config files `ssh -G` reads (Include followed) and their directories, by size and mtime (the
  stamp that clusterctl.sshconfig's own cache checks), and whether an `ssh` binary is on PATH;
- the login user, home directory and uid (what `ssh -G` and `~` resolve to);
- clusterctl's own code (every module's size and mtime): a new version plans anew.

Which files those are is read from the spec's bytes on every command (clusterctl.speckeys: hostfile,
ssh.config, data.local), never from the entry, so that no entry can say what it was made from. An entry
is read only from a directory no one else can write to and only when it is a 0600 file of this user
(clusterctl.cache.private_dir, read_private); anything else (a foreign directory or file, an unreadable,
garbled or foreign entry, a changed input) is a miss: the caller loads and validates the spec as always,
with the same error messages, and stores a fresh entry. Entries are JSON (no pickle: nothing in the cache
can run code), written 0600 through a temporary file and os.replace, so a reader never sees half an entry.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import fields, is_dataclass

from .plan import Host, JobPlan, MpiLaunch, Process
from .remote import SshOptions

__all__ = ["CachedPlan", "load", "store", "inputs_of", "inputs_for", "entry_path", "spec_facts", "facts"]

_VERSION = 7
_MAX_ENTRY_BYTES = 256 << 20
_CLASSES = {c.__name__: c for c in (Host, Process, MpiLaunch, JobPlan, SshOptions)}
_PACKAGE = os.path.dirname(os.path.realpath(__file__))
# clusterctl's subpackages whose code plans (host: the layout, the elastic section, the failure policy)
_PLANNING_PACKAGES = ("host", "ops", "spec")


class CachedPlan:
    """A plan and connection options read back from the cache (the spec itself is not loaded), and the
    spec's facts operations read besides the plan (spec_facts)."""

    def __init__(self, plan: JobPlan, options: SshOptions, facts: dict | None = None):
        self.plan, self.options, self.facts = plan, options, facts or {}


def spec_facts(spec) -> dict:
    """What `dispatch` reads from a spec besides the plan, as plain data: the workspace directory (absolute)
    and its exclude patterns, the data directory and where its shards go. Kept in the entry, so that a
    command on a cached plan needs no spec models (pydantic) to dispatch."""
    data = spec.data
    return {"workspace": str(spec.local_path(spec.workspace.local)), "exclude": list(spec.workspace.exclude),
            "data": None if data is None else {"local": str(spec.local_path(data.local)), "remote": data.remote}}


def _facts_ok(facts) -> bool:
    """Whether an entry's facts have exactly the form spec_facts() writes."""
    if not isinstance(facts, dict) or set(facts) != {"workspace", "exclude", "data"}:
        return False
    data = facts["data"]
    return (isinstance(facts["workspace"], str) and isinstance(facts["exclude"], list)
            and all(isinstance(x, str) for x in facts["exclude"])
            and (data is None or (isinstance(data, dict) and set(data) == {"local", "remote"}
                                  and all(isinstance(v, str) for v in data.values()))))


def facts(spec_path: str) -> dict | None:
    """The spec_facts() of the spec at `spec_path` from its cache entry, under every check load() makes;
    None on a miss."""
    cached = load(spec_path)
    return None if cached is None else cached.facts


def entry_path(spec_path: str) -> str | None:
    """The cache file for the spec at `spec_path` (as given, relative to the working directory); None when
    the plan cache's directory is not one only this user can write to (clusterctl.cache.private_dir)."""
    from .cache import private_dir

    folder = private_dir("plans")
    if folder is None:
        return None
    key = hashlib.sha256(json.dumps([_VERSION, os.getcwd(), str(spec_path)]).encode()).hexdigest()[:32]
    return os.path.join(folder, f"{key}.json")


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _file_digest(path: str) -> str | None:
    try:
        with open(path, "rb") as fh:
            return _sha(fh.read())
    except OSError:
        return None


def _listing_digest(root: str) -> str | None:
    """sha256 of every file's name under `root` (what list_data_files chooses from), None when unreadable;
    symlinked directories are not entered, symlinks to files count as files (as pathlib's rglob)."""
    if not os.path.isdir(root):
        return None
    names = sorted(os.path.relpath(os.path.join(d, n), root) for d, _, files in os.walk(root) for n in files
                   if os.path.isfile(os.path.join(d, n)))
    return _sha("\n".join(names).encode("utf-8", "surrogateescape"))


def _code_stamp() -> list:
    """Size and mtime of clusterctl's modules: any change to the code that plans is a miss."""
    stamp = []
    for d in (_PACKAGE, *(os.path.join(_PACKAGE, sub) for sub in _PLANNING_PACKAGES)):
        try:
            entries = sorted(os.scandir(d), key=lambda e: e.name)
        except OSError:
            continue
        for e in entries:
            if e.name.endswith(".py"):
                st = e.stat()
                stamp.append([os.path.relpath(e.path, _PACKAGE), st.st_size, st.st_mtime_ns])
    return stamp


def _env_stamp() -> list:
    """Who and where we are: what `ssh -G`, getpass and `~` depend on."""
    env = [os.environ.get(k) for k in ("HOME", "USER", "LOGNAME", "LNAME", "USERNAME")]
    return [env, os.getuid(), shutil.which("ssh") is not None]


def inputs_of(spec, data_files: list[str] | None) -> dict:
    """What a loaded spec's plan was made from besides the spec's bytes: files re-read (by content),
    ssh config files (by size and mtime, as clusterctl.sshconfig's own cache), data trees (by listing)."""
    local = spec.data.local if spec.data is not None and data_files is not None else None
    return _inputs(spec.source, spec.hostfile, spec.ssh.config, local)


def inputs_for(spec_path: str, spec_bytes: bytes) -> dict | None:
    """The same inputs, read from the spec file's bytes (clusterctl.speckeys) instead of a loaded spec: what
    a cache entry is checked against. None when the bytes are not a spec that could have been planned."""
    from .speckeys import spec_keys

    try:
        keys = spec_keys(spec_bytes.decode("utf-8"))
    except UnicodeDecodeError:
        return None
    if keys is None:
        return None
    hostfile, config, local, has_data = keys
    return _inputs(spec_path, hostfile, config, local if has_data else None)


def _inputs(source: str, hostfile: str | None, config: str | None, local: str | None) -> dict:
    """The inputs named by a spec file at `source` (relative paths are the spec directory's, as
    ClusterSpec.local_path resolves them)."""
    from .sshconfig import stamp_paths

    base = os.path.dirname(os.path.realpath(source))

    def where(value: str) -> str:
        p = os.path.expanduser(value)
        return p if os.path.isabs(p) else os.path.join(base, p)

    if config is not None and config.lower() != "none":
        config = where(config)
    stamped = stamp_paths(config) if config is None or config.lower() != "none" else []
    return {"files": [where(hostfile)] if hostfile else [], "stamped": stamped,
            "listings": [where(local)] if local is not None else []}


def _stat_stamp(path: str) -> list | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return [st.st_size, st.st_mtime_ns]


def _digests(inputs: dict) -> dict:
    return {
        "files": {p: _file_digest(p) for p in inputs["files"]},
        "stamped": {p: _stat_stamp(p) for p in inputs["stamped"]},
        "listings": {p: _listing_digest(p) for p in inputs["listings"]},
        "code": _code_stamp(),
        "env": _env_stamp(),
    }


# --- an exact JSON form of the plan dataclasses (tuples stay tuples, hosts are shared, not copied) ---


_LONG = 32  # strings at least this long are stored once (the endpoint lists every process's env repeats)


class _Memo:
    """What an entry stores once: hosts (shared by their processes) and long strings."""

    def __init__(self, strings: list[str] | None = None):
        self.host_ids: dict[int, int] = {}  # id(Host) -> its number (encoding)
        self.hosts: list = []  # number -> Host (decoding)
        self.string_ids: dict[str, int] = {}
        self.strings: list[str] = strings if strings is not None else []


def _encode(value, memo: _Memo):
    if isinstance(value, str) and len(value) >= _LONG:
        if value not in memo.string_ids:
            memo.string_ids[value] = len(memo.strings)
            memo.strings.append(value)
        return {"s": memo.string_ids[value]}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, Host) and id(value) in memo.host_ids:
        return {"h": memo.host_ids[id(value)]}
    if is_dataclass(value) and type(value).__name__ in _CLASSES and type(value) is _CLASSES[type(value).__name__]:
        enc = {"c": type(value).__name__, "f": {f.name: _encode(getattr(value, f.name), memo) for f in fields(value) if f.init}}
        if isinstance(value, Host):
            memo.host_ids[id(value)] = len(memo.host_ids)
        return enc
    if isinstance(value, tuple):
        return {"t": [_encode(v, memo) for v in value]}
    if isinstance(value, list):
        return {"l": [_encode(v, memo) for v in value]}
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {"d": {k: _encode(v, memo) for k, v in value.items()}}
    raise TypeError(f"plan cache: cannot store a {type(value).__name__}")


def _decode(value, memo: _Memo):
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if not isinstance(value, dict) or len(value) not in (1, 2):
        raise ValueError("garbled entry")
    if "s" in value:
        return memo.strings[value["s"]]
    if "h" in value:
        return memo.hosts[value["h"]]
    if "c" in value:
        cls = _CLASSES[value["c"]]
        obj = cls(**{k: _decode(v, memo) for k, v in value["f"].items()})
        if cls is Host:  # numbered in the order the encoder met them, which is the order we meet them
            memo.hosts.append(obj)
        return obj
    if "t" in value:
        return tuple(_decode(v, memo) for v in value["t"])
    if "l" in value:
        return [_decode(v, memo) for v in value["l"]]
    if "d" in value:
        return {k: _decode(v, memo) for k, v in value["d"].items()}
    raise ValueError("garbled entry")


def load(spec_path: str) -> CachedPlan | None:
    """The cached plan of the spec file at `spec_path`, or None (a miss) unless every input is unchanged."""
    from .cache import read_private
    from .files import read_spec_bytes

    path = entry_path(spec_path)
    if path is None:
        return None
    try:
        spec_bytes = read_spec_bytes(spec_path)  # bounded; a pipe read once, its bytes kept for the loader
    except OSError:
        return None
    raw = read_private(path, _MAX_ENTRY_BYTES)
    if raw is None:
        return None
    try:
        entry = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    try:
        if entry["version"] != _VERSION or entry["spec"] != _sha(spec_bytes):
            return None
        inputs = inputs_for(spec_path, spec_bytes)  # from the spec, never from the entry
        if inputs is None or _digests(inputs) != entry["digests"]:
            return None
        strings = entry["strings"]
        if not isinstance(strings, list) or not all(isinstance(x, str) for x in strings):
            return None
        memo = _Memo(strings)
        plan, options = _decode(entry["plan"], memo), _decode(entry["options"], memo)
        found = entry["facts"]
    except (KeyError, TypeError, ValueError, IndexError, AttributeError, RecursionError):  # a garbled entry is a miss
        return None
    if not isinstance(plan, JobPlan) or not isinstance(options, SshOptions) or not _facts_ok(found):
        return None
    return CachedPlan(plan, options, found)


def store(spec_path: str, spec_bytes: bytes, started_ns: int, spec, plan: JobPlan, options: SshOptions,
          data_files: list[str] | None) -> None:
    """Keep `plan`, made from `spec_bytes` (read from `spec_path` before loading it, at `started_ns` on
    the time.time_ns() clock), for the next command. Nothing is kept when an input changed within a
    second of the start or after it (the entry could pair new bytes with an old plan: git's "racy" rule).
    Never fails the caller: a cache that cannot be written is only slower."""
    inputs = inputs_of(spec, data_files)
    if inputs_for(spec_path, spec_bytes) != inputs:  # the next command reads them from the bytes: must agree
        return
    if _changed_since(started_ns - _RACY_NS, [spec_path, *inputs["files"], *inputs["stamped"]], inputs["listings"]):
        return
    if len(plan.processes) > _MAX_PROCESSES:
        return
    path = entry_path(spec_path)
    if path is None:
        return
    memo = _Memo()
    try:
        entry = {"version": _VERSION, "spec": _sha(spec_bytes), "digests": _digests(inputs),
                 "plan": _encode(plan, memo), "options": _encode(options, memo), "strings": memo.strings,
                 "facts": spec_facts(spec)}
    except (OSError, TypeError, AttributeError):
        return
    from .cache import write_private

    write_private(path, json.dumps(entry, separators=(",", ":")).encode())


_RACY_NS = 1_000_000_000
# Plans larger than this are not kept: reading back thousands of processes' environments costs about
# what planning does (docs/benchmarks.md, plans for 10,000 processes).
_MAX_PROCESSES = 4096


def _changed_since(when_ns: int, files: list[str], trees: list[str]) -> bool:
    """Whether a file, or a directory under one of `trees`, was modified at or after `when_ns`."""
    paths = list(files)
    for root in trees:
        paths += [root] + [os.path.join(d, n) for d, dirs, _ in os.walk(root) for n in dirs]
    for p in paths:
        try:
            if os.stat(p).st_mtime_ns >= when_ns:
                return True
        except FileNotFoundError:
            continue  # an absent file is recorded as absent; creating it changes its digest
        except OSError:
            return True
    return False
