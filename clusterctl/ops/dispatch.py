"""`clusterctl dispatch`: ship the workspace (and data shards) to every host, incrementally and atomically.

Each host keeps the manifest of its last dispatch; only files whose content differs travel, as one tar
stream per distinct change set (built once, streamed to every host that needs it). The host applies it
to a hard-linked staging copy and switches a symlink (see clusterctl/hostws.py).
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os
import posixpath
import secrets
import tarfile
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pathspec

from ..errors import HostFailure, JobError, RemoteError
from ..plan import DATA_ENV, Host
from ..quoting import join
from ..spec import ClusterSpec
from . import Session
from .hosttools import tool_command, tool_path

__all__ = ["LocalFile", "scan_workspace", "list_data_files", "dispatch", "verify", "HostDispatch"]

_CACHE_DIR = Path(os.environ.get("XDG_CACHE_HOME", "~/.cache")).expanduser() / "clusterctl" / "hashes"
_CHUNK = 1 << 20
_BULK = 8 << 20  # per-host archive size from which data goes through the OpenSSH client


@dataclass(frozen=True)
class LocalFile:
    """One file to ship: where it is here, and its manifest entry on the host."""

    source: str
    size: int
    sha256: str
    mode: int
    mtime: int  # whole seconds: what tar carries

    def entry(self) -> dict:
        """The manifest entry, as hostws.py stores and checks it."""
        return {"s": self.size, "h": self.sha256, "m": self.mode, "t": self.mtime * 10**9}


@dataclass(frozen=True)
class HostDispatch:
    """What one host received."""

    host: Host
    files_sent: int
    bytes_sent: int
    deleted: int
    generation: str


class _HashCache:
    """sha256 of local files, remembered by (path, size, mtime_ns, inode) so unchanged files are not re-read."""

    def __init__(self, root: Path):
        key = hashlib.sha256(str(root).encode()).hexdigest()[:16]
        self.path = _CACHE_DIR / f"{key}.json"
        try:
            self.data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            self.data = {}
        self.fresh: dict[str, list] = {}

    def sha256(self, rel: str, full: Path, st: os.stat_result) -> str:
        stamp = [st.st_size, st.st_mtime_ns, st.st_ino]
        hit = self.data.get(rel)
        if hit and hit[:3] == stamp:
            digest = hit[3]
        else:
            h = hashlib.sha256()
            with open(full, "rb") as fh:
                while block := fh.read(_CHUNK):
                    h.update(block)
            digest = h.hexdigest()
        self.fresh[rel] = stamp + [digest]
        return digest

    def save(self) -> None:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps(self.fresh))
            tmp.replace(self.path)
        except OSError:
            pass  # a cache that cannot be written only costs re-hashing next time


def scan_workspace(root: Path, exclude: tuple[str, ...], *, prefix: str = "") -> dict[str, LocalFile]:
    """Every file under `root` not matched by the gitignore-style `exclude` patterns, with its hash."""
    if not root.is_dir():
        raise JobError(f"workspace.local {root} is not a directory")
    spec = pathspec.GitIgnoreSpec.from_lines(exclude)
    cache = _HashCache(root)
    files: dict[str, LocalFile] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = os.path.relpath(dirpath, root)
        rel_dir = "" if rel_dir == "." else rel_dir.replace(os.sep, "/")
        dirnames[:] = sorted(d for d in dirnames if not spec.match_file(posixpath.join(rel_dir, d) + "/"))
        for name in sorted(filenames):
            rel = posixpath.join(rel_dir, name)
            full = Path(dirpath) / name
            if spec.match_file(rel) or full.is_symlink() or not full.is_file():
                continue
            st = full.stat()
            files[prefix + rel] = LocalFile(str(full), st.st_size, cache.sha256(rel, full, st), st.st_mode & 0o777, int(st.st_mtime))
    cache.save()
    return files


def list_data_files(spec: ClusterSpec) -> list[str]:
    """Names (relative to data.local, sorted) of the files matching data.pattern; [] without a data section."""
    if spec.data is None:
        return []
    root = spec.local_path(spec.data.local)
    if not root.is_dir():
        raise JobError(f"data.local {root} is not a directory")
    return sorted(
        str(p.relative_to(root)).replace(os.sep, "/")
        for p in root.rglob("*")
        if p.is_file() and fnmatch.fnmatch(p.name, spec.data.pattern)
    )


def _host_files(session: Session, workspace: dict[str, LocalFile]) -> dict[Host, dict[str, LocalFile]]:
    """The full file set each host should have: the workspace plus its trainers' data shards."""
    spec, plan = session.spec, session.plan
    per_host = {h: dict(workspace) for h in plan.hosts}
    if spec.data is None:
        return per_host
    data_prefix = spec.data.remote.strip("/") + "/"
    data_files = scan_workspace(spec.local_path(spec.data.local), (), prefix=data_prefix)
    for trainer in plan.trainers:
        for path in filter(None, trainer.env[DATA_ENV].split(":")):
            per_host[trainer.host][path] = data_files[path]
    return per_host


class _Archive:
    """A tar archive of changed files, streamed to many hosts while it is still being written.

    A background thread writes it into an unlinked temporary file; each host's stream reads, with
    positional reads (`os.pread`: no shared file offset), whatever has been written so far.
    """

    def __init__(self, files: dict[str, LocalFile], changed: list[str]):
        self._fh = tempfile.TemporaryFile()
        self._cond = threading.Condition()
        self._written = 0
        self._done = not changed  # deletions only: no archive at all
        self._error: BaseException | None = None
        self.payload = sum(files[rel].size for rel in changed)  # known up front, unlike the archive's size
        if changed:
            threading.Thread(target=self._build, args=(files, changed), daemon=True).start()

    def _build(self, files: dict[str, LocalFile], changed: list[str]) -> None:
        try:
            with tarfile.open(fileobj=self, mode="w|", format=tarfile.PAX_FORMAT, bufsize=_CHUNK) as tar:
                for rel in changed:
                    f = files[rel]
                    info = tarfile.TarInfo(rel)
                    info.size, info.mode, info.mtime = f.size, f.mode, f.mtime
                    with open(f.source, "rb") as fh:
                        tar.addfile(info, fh)
        except OSError as exc:  # e.g. a file vanished while we read it: every stream fails with it
            self._error = exc
        with self._cond:
            self._done = True
            self._cond.notify_all()

    def write(self, data: bytes) -> int:
        """tarfile's sink: append, then wake the readers."""
        self._fh.write(data)
        self._fh.flush()
        with self._cond:
            self._written += len(data)
            self._cond.notify_all()
        return len(data)

    @property
    def size(self) -> int:
        """Bytes written so far (the whole archive once it is complete)."""
        return self._written

    def stream(self, header: bytes) -> Iterator[bytes]:
        """The header, then the archive in blocks of up to 1 MiB as they become available."""
        yield header
        fd, offset = self._fh.fileno(), 0
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._written > offset or self._done)
                if self._error is not None:
                    raise OSError(f"building the archive failed: {self._error}")
                available = self._written
            if offset >= available:
                return  # done, and everything was sent
            block = os.pread(fd, min(_CHUNK, available - offset), offset)
            offset += len(block)
            yield block

    def wait(self) -> None:
        """Block until the archive is complete."""
        with self._cond:
            self._cond.wait_for(lambda: self._done)

    def close(self) -> None:
        self.wait()
        self._fh.close()


def dispatch(session: Session) -> list[HostDispatch]:
    """Bring every host's workspace to the local content; raise RemoteError naming hosts that failed."""
    spec, plan, remote = session.spec, session.plan, session.remote
    workspace = scan_workspace(spec.local_path(spec.workspace.local), spec.workspace.exclude)
    wanted = _host_files(session, workspace)
    root = plan.workdir
    state_cmd, payload = tool_command("hostws", ["state", root])  # installs the tool if missing, same round trip
    states = remote.run(state_cmd, stdin=payload, what="reading workspace state")
    tools = {"hostws": tool_path("hostws")}
    gen = time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(4)

    plans: dict[Host, tuple[bytes, list[str], list[str]]] = {}
    for host, res in states.items():
        state = json.loads(res.stdout)
        current, drifted = state["manifest"], {d["path"] for d in state["drift"]}
        files = wanted[host]
        manifest = {rel: f.entry() for rel, f in files.items()}
        changed = sorted(rel for rel, e in manifest.items() if rel in drifted or _differs(current.get(rel), e))
        delete = sorted(set(current) - set(manifest))
        header = {"gen": gen, "base": state["gen"], "changes": {rel: manifest[rel] for rel in changed},
                  "delete": delete, "archive": bool(changed)}
        blob = json.dumps(header).encode()
        header = b"%016d" % len(blob) + blob  # length-framed: the host hands the rest of stdin to tar
        plans[host] = (header, changed, delete)

    archives: dict[tuple, _Archive] = {}
    try:
        def _key(host: Host) -> tuple:
            return tuple((rel, wanted[host][rel].sha256) for rel in plans[host][1])

        for host in plans:
            key = _key(host)
            if key not in archives:  # built once per distinct change set, streamed to every host that needs it
                archives[key] = _Archive(wanted[host], plans[host][1])

        def feed(host: Host):
            return archives[_key(host)].stream(plans[host][0])

        busy = [h for h, (_, changed, delete) in plans.items() if changed or delete]
        apply = join(["python3", tools["hostws"], "apply", root])
        biggest = max((archives[_key(h)].payload for h in busy), default=0)
        if biggest >= _BULK:  # OpenSSH's C crypto, one process per host
            results = remote.push(apply, hosts=busy, stdin=feed, what="dispatch")
        else:  # small: the connections already open are faster than starting ssh processes
            results = remote.run(apply, hosts=busy, stdin=feed, check=False, what="dispatch")
        for archive in archives.values():
            archive.wait()
        sizes = {key: archive.size for key, archive in archives.items()}
    finally:
        for archive in archives.values():
            archive.close()

    out, failures = [], []
    for host in plans:
        header, changed, delete = plans[host]
        res = results.get(host)
        if res is None:  # already up to date: nothing was sent
            out.append(HostDispatch(host, 0, 0, 0, json.loads(states[host].stdout)["gen"]))
            continue
        if not res.ok:
            failures.append(host)
            continue
        key = tuple((rel, wanted[host][rel].sha256) for rel in changed)
        out.append(HostDispatch(host, len(changed), len(header) + sizes[key], len(delete), gen))
    if failures:
        raise RemoteError(
            [_failure(results[h]) for h in failures], {h: r for h, r in results.items() if r.ok}, what="dispatch"
        )
    return out


def _failure(res) -> HostFailure:
    return HostFailure(res.host.label, res.command, res.exit_code, res.stderr[-2000:])


def _differs(old: dict | None, new: dict) -> bool:
    return old is None or old["h"] != new["h"] or old["m"] != new["m"] or old["s"] != new["s"]


def verify(session: Session) -> dict[Host, list[dict]]:
    """Each host's drift from its last dispatch: [{'path', 'problem'}]; an empty list means verified."""
    cmd, payload = tool_command("hostws", ["verify", session.plan.workdir])
    results = session.remote.run(cmd, stdin=payload, what="verifying workspaces")
    return {host: json.loads(res.stdout)["drift"] for host, res in results.items()}

