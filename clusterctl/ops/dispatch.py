"""`clusterctl dispatch`: ship the workspace (and data shards) to every host, incrementally and atomically.

Each host keeps the manifest of its last dispatch; only files whose content differs travel, as one tar
stream per distinct change set (built once, streamed to every host that needs it). A changed file whose
previous content this controller hashed travels as its changed fixed-size blocks only. The host applies
the stream to a hard-linked staging copy and switches a symlink (see clusterctl/hostws.py).

One round trip per host: the controller remembers what it last dispatched to each host (generation and
manifest, under ~/.cache/clusterctl/dispatched) and sends the update straight away; the host checks that
it is still at that generation with no drift, and otherwise replies with its actual state, from which
the update is planned again. Hosts this controller has not dispatched to are asked for their state first.
"""

from __future__ import annotations

import fnmatch
import hashlib
import io
import json
import marshal
import os
import re
import secrets
import tarfile
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pathspec

from ..cache import cache_root
from ..errors import JobError, RemoteError
from ..plan import DATA_ENV, Host
from ..quoting import join
from ..remote import Launch, Result
from ..spec import ClusterSpec
from . import Session
from .hosttools import package_dir, tool_argv, tool_command

__all__ = ["LocalFile", "scan_workspace", "list_data_files", "dispatch", "verify", "HostDispatch"]

_CACHE_ROOT = cache_root()
_CACHE_DIR = _CACHE_ROOT / "hashes"


def _private_dir(path: Path) -> None:
    """Create `path` (and the cache root) 0700: the caches name every file of the user's workspace."""
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    for p in (_CACHE_ROOT, path.parent, path):
        if p == _CACHE_ROOT or _CACHE_ROOT in p.parents:
            os.chmod(p, 0o700)
_CHUNK = 1 << 20
_BULK = 8 << 20  # per-host archive size from which data goes through the OpenSSH client
_INLINE = 1 << 20  # per-host update size up to which file content travels inside the header
_BLOCK = 4096  # smallest delta block; files get at most _MAX_BLOCKS blocks (bigger ones, bigger blocks)
_MAX_BLOCKS = 1024
_DIGEST = 8  # bytes of sha256 kept per block (16 hex characters)
_MARSHAL_VERSION = 4  # what hostws.py writes and reads: any Python 3 reads it
_TOOL_MISSING = 75  # the apply command's exit code when hostws is not installed on the host
# `apply` runs hostws as an imported module, not as a script: Python keeps an imported module's bytecode
# (in __pycache__ beside it, per interpreter version, checked against the source) but compiles a script
# on every run, ~6 ms of CPU per host per dispatch. argv: tool directory, module name, command, root.
_RUN_TOOL = "import sys; sys.path[0] = sys.argv[1]; __import__(sys.argv[2]).main(sys.argv[2:])"


def block_size(size: int) -> int:
    """Delta block size for a file of `size` bytes: 4 KiB, doubled until the file has <= 1024 blocks."""
    bs = _BLOCK
    while bs * _MAX_BLOCKS < size:
        bs *= 2
    return bs


@dataclass(frozen=True)
class LocalFile:
    """One file to ship: where it is here, and its manifest entry on the host."""

    source: str
    size: int
    sha256: str
    mode: int
    mtime: int  # whole seconds: what tar carries
    blocks: str = ""  # per-block digests (hex, 16 characters each) for files of more than one block
    previous: tuple[str, str] | None = None  # (sha256, blocks) of this path's content at the previous scan

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
    """sha256 (and per-block digests) of local files, remembered by (path, size, mtime_ns, inode) so that
    unchanged files are not re-read; the previous scan's digests of changed files are kept for deltas."""

    def __init__(self, root: Path):
        key = hashlib.sha256(str(root).encode()).hexdigest()[:16]
        self.path = _CACHE_DIR / f"{key}.marshal"  # our own file, read on every dispatch: 3x faster than JSON
        try:
            self.data = marshal.loads(self.path.read_bytes())
            if not isinstance(self.data, dict):
                self.data = {}
        except (OSError, ValueError, EOFError, TypeError):
            self.data = {}
        self.fresh: dict[str, list] = {}

    def digests(self, rel: str, full: str, st: os.stat_result) -> tuple[str, str, tuple[str, str] | None]:
        """(sha256, block digests, previous (sha256, block digests) if the content changed)."""
        stamp = [st.st_size, st.st_mtime_ns, st.st_ino]
        hit = self.data.get(rel)
        if hit and hit[:3] == stamp and len(hit) == 5:
            self.fresh[rel] = hit
            return hit[3], hit[4], None
        digest, blocks = _hash_file(full, st.st_size)
        self.fresh[rel] = stamp + [digest, blocks]
        previous = (hit[3], hit[4]) if hit and len(hit) == 5 and hit[3] != digest and hit[4] else None
        return digest, blocks, previous

    def save(self) -> None:
        if self.fresh == self.data:
            return  # nothing was hashed or removed: the file on disk says it all
        try:
            _private_dir(self.path.parent)
            _write_atomic(self.path, marshal.dumps(self.fresh, _MARSHAL_VERSION))
        except OSError:
            pass  # a cache that cannot be written only costs re-hashing next time


def _hash_file(path: str, size: int) -> tuple[str, str]:
    """The file's sha256, and its per-block digests when it has more than one block."""
    h = hashlib.sha256()
    bs = block_size(size)
    parts: list[bytes] = []
    with open(path, "rb") as fh:
        while block := fh.read(max(_CHUNK, bs)):
            h.update(block)
            if size > bs:
                view = memoryview(block)
                parts.extend(hashlib.sha256(view[i : i + bs]).digest()[:_DIGEST] for i in range(0, len(view), bs))
    return h.hexdigest(), b"".join(parts).hex()


def _ignore_matcher(exclude: tuple[str, ...]):
    """path -> whether the gitignore-style `exclude` patterns ignore it (directories end with "/")."""
    spec = pathspec.GitIgnoreSpec.from_lines(exclude)
    active = [p for p in spec.patterns if p.include is not None]
    regexes = [getattr(p, "regex", None) for p in active]
    if active and all(p.include for p in active) and all(isinstance(r, re.Pattern) for r in regexes):
        # Ignoring patterns only (no "!"): a path is ignored when any of them matches, so one regex of
        # them all decides at once: 5x faster than asking each pattern, once per file of the workspace.
        combined = re.compile("|".join(f"(?:{r.pattern.replace('(?P<ps_d>', '(?:')})" for r in regexes))
        return lambda path: combined.match(path) is not None
    return spec.match_file


def scan_workspace(root: Path, exclude: tuple[str, ...], *, prefix: str = "") -> dict[str, LocalFile]:
    """Every file under `root` not matched by the gitignore-style `exclude` patterns, with its hash."""
    if not root.is_dir():
        raise JobError(f"workspace.local {root} is not a directory")
    ignored = _ignore_matcher(exclude)
    cache = _HashCache(root)
    files: dict[str, LocalFile] = {}

    def walk(directory: str, rel_dir: str) -> None:
        # scandir: the kind of each entry comes with the listing, so a file costs one stat (for the cache key)
        with os.scandir(directory) as it:
            entries = sorted(it, key=lambda e: e.name)
        for entry in entries:
            rel = rel_dir + entry.name
            if entry.is_dir(follow_symlinks=False):
                if not ignored(rel + "/"):
                    walk(entry.path, rel + "/")
            elif entry.is_file(follow_symlinks=False) and not ignored(rel):
                st = entry.stat(follow_symlinks=False)
                digest, blocks, previous = cache.digests(rel, entry.path, st)
                files[prefix + rel] = LocalFile(
                    entry.path, st.st_size, digest, st.st_mode & 0o777, int(st.st_mtime), blocks, previous
                )

    try:
        walk(str(root), "")
    except OSError as exc:
        raise JobError(f"cannot read {exc.filename or root}: {exc.strerror or exc}") from None
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
    per_host = dict.fromkeys(plan.hosts, workspace)  # shared until a host gets shards of its own
    if spec.data is None:
        return per_host
    data_prefix = spec.data.remote.strip("/") + "/"
    data_files = scan_workspace(spec.local_path(spec.data.local), (), prefix=data_prefix)
    for trainer in plan.trainers:
        for path in filter(None, trainer.env[DATA_ENV].split(":")):
            if per_host[trainer.host] is workspace:
                per_host[trainer.host] = dict(workspace)
            per_host[trainer.host][path] = data_files[path]
    return per_host


@dataclass(frozen=True)
class _Patch:
    """A changed file sent as its changed blocks: `ranges` of block indices, `payload` bytes of them."""

    base: str  # sha256 of the content the host has, which the other blocks are copied from
    block: int
    ranges: tuple[tuple[int, int], ...]
    payload: int


def _delta(f: LocalFile, base: dict | None) -> _Patch | None:
    """The blocks of `f` that differ from the host's content `base`, when this controller hashed that
    content's blocks at its previous scan and sending them saves at least half of the file."""
    if base is None or f.previous is None or f.previous[0] != base["h"] or not f.blocks:
        return None
    bs = block_size(f.size)
    if block_size(base["s"]) != bs:
        return None
    width = 2 * _DIGEST
    new, old = f.blocks, f.previous[1]
    changed = [i for i in range(len(new) // width) if new[i * width : (i + 1) * width] != old[i * width : (i + 1) * width]]
    payload = sum(min(bs, f.size - i * bs) for i in changed)
    if payload * 2 > f.size:
        return None
    ranges: list[list[int]] = []
    for i in changed:
        if ranges and ranges[-1][0] + ranges[-1][1] == i:
            ranges[-1][1] += 1
        else:
            ranges.append([i, 1])
    return _Patch(base["h"], bs, tuple((a, n) for a, n in ranges), payload)


def _read_whole(f: LocalFile) -> bytes:
    with open(f.source, "rb") as fh:
        data = fh.read(f.size + 1)
    if len(data) != f.size:
        raise JobError(f"{f.source} changed while being dispatched; dispatch again")
    return data


def _patch_bytes(f: LocalFile, patch: _Patch) -> bytes:
    """The changed blocks of `f`, back to back, as the host's apply_patch reads them."""
    out = []
    with open(f.source, "rb") as fh:
        for first, count in patch.ranges:
            start = first * patch.block
            out.append(os.pread(fh.fileno(), min(count * patch.block, f.size - start), start))
    return b"".join(out)


class _Archive:
    """A tar archive of changed files (whole, or their changed blocks), streamed to many hosts while it is
    still being written.

    A background thread writes it into an unlinked temporary file; each host's stream reads, with
    positional reads (`os.pread`: no shared file offset), whatever has been written so far.
    """

    def __init__(self, files: dict[str, LocalFile], changed: list[str], patches: dict[str, _Patch] | None = None):
        patches = patches or {}
        items = sorted([(rel, None) for rel in changed] + list(patches.items()))
        self._fh = tempfile.TemporaryFile()
        self._cond = threading.Condition()
        self._written = 0
        self._done = not items  # deletions only: no archive at all
        self._error: BaseException | None = None
        self._cancelled = False
        if items:
            threading.Thread(target=self._build, args=(files, items), daemon=True).start()

    def _build(self, files: dict[str, LocalFile], items: list[tuple[str, _Patch | None]]) -> None:
        try:
            with tarfile.open(fileobj=self, mode="w|", format=tarfile.PAX_FORMAT, bufsize=_CHUNK) as tar:
                for rel, patch in items:
                    if self._cancelled:
                        break
                    f = files[rel]
                    info = tarfile.TarInfo(rel)
                    info.mode, info.mtime = f.mode, f.mtime
                    if patch is not None:
                        data = _patch_bytes(f, patch)
                        info.size = len(data)
                        tar.addfile(info, io.BytesIO(data))
                        continue
                    info.size = f.size
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
        """Block until the archive is complete (or its building stopped)."""
        with self._cond:
            self._cond.wait_for(lambda: self._done)

    def close(self) -> None:
        """Stop building (no host reads the rest: e.g. each replied that our record of it was stale)."""
        self._cancelled = True
        self.wait()
        self._fh.close()


@dataclass
class _HostView:
    """What the controller takes a host's workspace to be: its generation, manifest and drifted paths."""

    gen: str | None
    manifest: dict[str, dict]
    drift: frozenset[str] = frozenset()
    check: bool = False  # from the controller's records, not read just now: the host must confirm it


@dataclass
class _HostPlan:
    header: bytes
    whole: list[str]
    patches: dict[str, _Patch]
    delete: list[str]
    manifest: dict[str, dict]  # the host's manifest once this update is applied
    key: tuple  # identifies the archive: hosts with equal keys share one
    payload: int  # bytes of file content that travel
    inline: bool = False  # the content is in the header: no archive follows

    @property
    def empty(self) -> bool:
        return not (self.whole or self.patches or self.delete)


class _Records:
    """What this controller last dispatched to each host (for one workspace root): generation and manifest.

    ~/.cache/clusterctl/dispatched/<host+root>.json holds {"gen", "manifest": sha256}; manifests are stored
    once by content under manifests/, since hosts usually share one.
    """

    def __init__(self, root: str):
        self.dir = _CACHE_ROOT / "dispatched"
        self.root = root
        self._loaded: dict[str, dict] = {}

    def _path(self, host: Host) -> Path:
        ident = json.dumps([host.user, host.address, host.port, self.root])
        return self.dir / (hashlib.sha256(ident.encode()).hexdigest()[:32] + ".json")

    def load(self, host: Host) -> _HostView | None:
        try:
            rec = json.loads(self._path(host).read_text())
            ref = rec["manifest"]
            if ref not in self._loaded:
                self._loaded[ref] = json.loads((self.dir / "manifests" / f"{ref}.json").read_text())
            return _HostView(rec["gen"], self._loaded[ref], check=True)
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def save(self, records: dict[Host, tuple[str, dict]]) -> None:
        """Record each host's new (generation, manifest); a failure to write only costs a round trip later."""
        written: dict[int, str] = {}
        try:
            _private_dir(self.dir / "manifests")
            for host, (gen, manifest) in records.items():
                ref = written.get(id(manifest))
                if ref is None:
                    blob = json.dumps(manifest, sort_keys=True).encode()
                    ref = written[id(manifest)] = hashlib.sha256(blob).hexdigest()
                    target = self.dir / "manifests" / f"{ref}.json"
                    if not target.exists():
                        _write_atomic(target, blob)
                    else:
                        os.utime(target)  # recently used: kept by the sweep below
                _write_atomic(self._path(host), json.dumps({"gen": gen, "manifest": ref}).encode())
            cutoff = time.time() - 30 * 86400
            for old in (self.dir / "manifests").glob("*.json"):  # manifests no dispatch used for a month
                if old.stat().st_mtime < cutoff:
                    old.unlink(missing_ok=True)
        except OSError:
            pass


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    tmp.replace(path)


def _plan_host(gen: str, view: _HostView, files: dict[str, LocalFile], *, deltas: bool = True) -> _HostPlan:
    """The update that brings a host from `view` to `files`: whole files, patched files, deletions."""
    whole, patches = [], {}
    manifest = dict(view.manifest)
    for rel, f in files.items():
        entry, current = f.entry(), view.manifest.get(rel)
        if rel not in view.drift and not _differs(current, entry):
            continue
        patch = _delta(f, current) if deltas and rel not in view.drift else None
        if patch is None:
            whole.append(rel)
        else:
            patches[rel] = patch
        manifest[rel] = entry
    delete = sorted(set(view.manifest) - set(files))
    for rel in delete:
        del manifest[rel]
    whole.sort()
    payload = sum(files[rel].size for rel in whole) + sum(p.payload for p in patches.values())
    inline = payload <= _INLINE  # small updates travel inside the header: no tar on either side
    header = {
        "gen": gen, "base": view.gen, "check": view.check,
        "changes": {rel: manifest[rel] for rel in whole},
        "patches": {rel: {"e": manifest[rel], "b": p.block, "r": p.ranges, **({"d": _patch_bytes(files[rel], p)} if inline else {})}
                    for rel, p in sorted(patches.items())},
        "delete": delete, "archive": bool(whole or patches) and not inline,
    }
    if inline and whole:
        header["inline"] = {rel: _read_whole(files[rel]) for rel in whole}
    blob = marshal.dumps(header, _MARSHAL_VERSION)  # hostws reads it without importing json (see there)
    key = tuple((rel, files[rel].sha256, None) for rel in whole) + tuple(
        (rel, files[rel].sha256, p.base) for rel, p in sorted(patches.items())
    )
    # length-framed: the host hands the rest of stdin to tar
    return _HostPlan(b"%016d" % len(blob) + blob, whole, patches, delete, manifest, key, payload, inline)


def _read_states(remote, hosts: list[Host], root: str) -> dict[Host, _HostView | Result]:
    """Ask hosts for their workspace state (installing hostws where missing): a view, or the failed Result."""
    state_cmd, payload = tool_command("hostws", ["state", root])  # installs the tool if missing, same round trip
    out: dict[Host, _HostView | Result] = {}
    for host, res in remote.run(state_cmd, hosts=hosts, stdin=payload, check=False, timeout=remote.control_timeout,
                                what="reading workspace state").items():
        out[host] = _view_of(res.reply()) if res.ok else res
    return out


def _view_of(state: dict) -> _HostView:
    return _HostView(state["gen"], state["manifest"], frozenset(d["path"] for d in state["drift"]))


def dispatch(session: Session) -> list[HostDispatch]:
    """Bring every host's workspace to the local content; raise RemoteError naming hosts that failed."""
    plan, remote = session.plan, session.remote
    root = plan.workdir
    records = _Records(root)
    apply = f"test -d {join([package_dir()])} || exit {_TOOL_MISSING}; exec " + join(tool_argv("hostws", ["apply", root]))

    views: dict[Host, _HostView] = {}
    ask: list[Host] = []
    for host in plan.hosts:
        view = records.load(host)
        if view is None:
            ask.append(host)
        else:
            views[host] = view
    # Hosts we have a record of get their update in one round trip: start `apply` there now, so the SSH
    # handshakes and the hosts' own checks overlap the scan below. (Unknown hosts are asked first.)
    launched = remote.launch(apply, hosts=list(views)) if views else None
    try:
        return _dispatch(session, records, apply, views, ask, launched)
    finally:
        if launched is not None:
            launched.close()


def _dispatch(session: Session, records: "_Records", apply: str, views: dict, ask: list, launched) -> list[HostDispatch]:
    spec, plan, remote = session.spec, session.plan, session.remote
    workspace = scan_workspace(spec.local_path(spec.workspace.local), spec.workspace.exclude)
    wanted = _host_files(session, workspace)
    root = plan.workdir
    gen = time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(4)
    failed: dict[Host, Result] = {}
    sent: dict[Host, int] = dict.fromkeys(plan.hosts, 0)
    done: dict[Host, tuple[_HostPlan | None, str]] = {}  # host → (the plan it applied, its generation)
    learned: dict[Host, tuple[str, dict]] = {}  # host → (generation, manifest) to remember
    succeeded: dict[Host, Result] = {}
    no_deltas: set[Host] = set()
    for _round in range(3):  # a stale record costs one more round; a patch that does not apply, one more
        if ask:
            for host, got in _read_states(remote, ask, root).items():
                if isinstance(got, Result):
                    failed[host] = got
                else:
                    views[host] = got
            ask = []
        if not views:
            break
        plans, memo = {}, {}
        for h, v in views.items():  # hosts in the same state wanting the same files share one plan
            key = (id(v.manifest), v.gen, v.drift, v.check, id(wanted[h]), h not in no_deltas)
            if key not in memo:
                memo[key] = _plan_host(gen, v, wanted[h], deltas=h not in no_deltas)
            plans[h] = memo[key]
        for host in [h for h, p in plans.items() if views[h].check and p.payload >= _BULK]:
            ask.append(host)  # a big update: confirm the host's state first rather than stream in vain
            del plans[host], views[host]
        for host in [h for h, p in plans.items() if p.empty and not views[h].check]:
            view = views.pop(host)  # read just now and up to date: nothing to send
            done[host] = (None, view.gen)
            learned[host] = (view.gen, view.manifest)
            del plans[host]
        results, streamed = _send(remote, apply, plans, wanted, launched)
        launched = None  # finished: every host it started got its update or an empty stdin
        views = {}
        for host, res in results.items():
            sent[host] += streamed[host]
            if res.exit_code == _TOOL_MISSING and not res.stdout:
                ask.append(host)
            elif not res.ok:
                failed[host] = res
            else:
                reply = res.reply()
                if "stale" not in reply:
                    done[host] = (plans[host], reply["gen"])
                    succeeded[host] = res
                    if not reply.get("unchanged"):
                        learned[host] = (reply["gen"], plans[host].manifest)
                    continue
                views[host] = _view_of(reply)
                if reply["stale"] == "patch":
                    no_deltas.add(host)
        if not views and not ask:
            break
    for host in [*views, *ask]:  # did not converge in three rounds (something keeps changing it)
        failed[host] = Result(host, apply, 1, "", "the workspace kept changing during dispatch; dispatch again", 0.0)

    records.save(learned)
    out = []
    for host in plan.hosts:
        if host in done:
            p, g = done[host]
            out.append(HostDispatch(host, 0 if p is None else len(p.whole) + len(p.patches), sent[host],
                                    0 if p is None else len(p.delete), g))
    if failed:
        raise RemoteError(
            [failed[h].failure() for h in plan.hosts if h in failed], succeeded,
            what="dispatch",
        )
    return out


def _send(remote, apply: str, plans: dict[Host, _HostPlan], wanted, launched: Launch | None = None) -> tuple[dict[Host, Result], dict[Host, int]]:
    """Stream each host its header and archive (one archive per distinct change set); the results and
    the bytes streamed to each host (less than the archive where a host stopped reading early). Hosts
    where `launched` already started `apply` get theirs there (those without a plan, an empty stdin)."""
    if not plans and launched is None:
        return {}, {}
    archives: dict[tuple, _Archive] = {}
    streamed = dict.fromkeys(plans, 0)
    try:
        for host, p in plans.items():
            if p.key not in archives and not p.inline:  # built once per distinct change set, streamed to every host that needs it
                archives[p.key] = _Archive(wanted[host], p.whole, p.patches)

        def feed(host: Host):
            p = plans[host]
            for block in [p.header] if p.inline else archives[p.key].stream(p.header):
                yield block
                streamed[host] += len(block)  # counted once the channel took it

        started = set(launched.hosts) if launched is not None else set()
        rest = [h for h in plans if h not in started]
        # a deadline for the whole transfer: ten control deadlines, plus a second per MB at the least
        deadline = 10 * remote.control_timeout + max((p.payload for p in plans.values()), default=0) / 1e6
        with ThreadPoolExecutor(1) as waiter:  # the launched hosts and the others at the same time
            early = (waiter.submit(launched.finish, {h: feed for h in plans if h in started}, timeout=deadline)
                     if started else None)
            results: dict[Host, Result] = {}
            if rest and max(plans[h].payload for h in rest) >= _BULK:  # through ssh whatever the host-key policy
                results = remote.push(apply, hosts=rest, stdin=feed, timeout=deadline, what="dispatch")
            elif rest:
                results = remote.run(apply, hosts=rest, stdin=feed, check=False, timeout=deadline, what="dispatch")
            if early is not None:
                results.update(early.result())
    finally:
        for archive in archives.values():
            archive.close()
    return results, streamed


def _differs(old: dict | None, new: dict) -> bool:
    return old is None or old["h"] != new["h"] or old["m"] != new["m"] or old["s"] != new["s"]


def verify(session: Session) -> dict[Host, list[dict]]:
    """Each host's drift from its last dispatch: [{'path', 'problem'}]; an empty list means verified."""
    cmd, payload = tool_command("hostws", ["verify", session.plan.workdir])
    results = session.remote.run(cmd, stdin=payload, timeout=10 * session.remote.control_timeout, what="verifying workspaces")
    return {host: res.reply()["drift"] for host, res in results.items()}

