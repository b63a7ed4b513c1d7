"""The controller's memory of each host: the generation and manifest it last dispatched there, so that
the next dispatch plans without asking (the host confirms, or replies with its actual state)."""

from __future__ import annotations

import hashlib
import json
import os
import stat
import time
from pathlib import Path

from ...plan import Host
from .plan import HostView
from ...cache import read_private
from ...host import wire
from .scan import CACHE_ROOT, private_dir, write_atomic

__all__ = ["RECORDS_DIR", "Records"]

RECORDS_DIR = CACHE_ROOT / "dispatched"
MANIFEST_KEEP_S = 30 * 86400  # a manifest no dispatch used for this long is removed
SWEEP_EVERY_S = 86400  # and the manifests are looked through for those at most this often


class Records:
    """What this controller last dispatched to each host (for one workspace root): generation and manifest.

    ~/.cache/clusterctl/dispatched/<host+root>.json holds {"gen", "manifest": sha256}; manifests are stored
    once by content under manifests/, since hosts usually share one.
    """

    def __init__(self, root: str):
        self.dir = RECORDS_DIR
        self.root = root
        self._loaded: dict[str, dict] = {}
        self._usable: bool | None = None

    def _path(self, host: Host) -> Path:
        ident = json.dumps([host.user, host.address, host.port, self.root])
        return self.dir / (hashlib.sha256(ident.encode()).hexdigest()[:32] + ".json")

    def load(self, host: Host) -> HostView | None:
        """The host as last dispatched to (to be confirmed by it), or None without a record read from our own
        private directory (a file of this user, 0600: clusterctl.cache.read_private)."""
        if self._usable is None:
            self._usable = private_dir(self.dir / "manifests")
        if not self._usable:
            return None
        try:
            rec = json.loads(read_private(self._path(host), 1 << 20) or b"null")
            ref = rec["manifest"]
            if not isinstance(ref, str) or not ref.isalnum():
                return None
            if ref not in self._loaded:  # hosts usually share one manifest: read and checked once
                manifest = json.loads(read_private(self.dir / "manifests" / f"{ref}.json", 1 << 30) or b"null")
                self._loaded[ref] = manifest if _manifest_ok(manifest) else None
            if not isinstance(rec["gen"], str) or self._loaded[ref] is None:
                return None
            return HostView(rec["gen"], self._loaded[ref], check=True)
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError):
            return None

    def save(self, records: dict[Host, tuple[str, dict]]) -> None:
        """Record each host's new (generation, manifest); a failure to write only costs a round trip later."""
        written: dict[int, str] = {}
        if not private_dir(self.dir / "manifests"):
            return  # no private place for them: the next dispatch asks the hosts
        try:
            for host, (gen, manifest) in records.items():
                ref = written.get(id(manifest))
                if ref is None:
                    blob = json.dumps(manifest, sort_keys=True).encode()
                    ref = written[id(manifest)] = hashlib.sha256(blob).hexdigest()
                    target = self.dir / "manifests" / f"{ref}.json"
                    if not _private(target):
                        write_atomic(target, blob)  # new, or left by an older version readable by others
                    else:
                        os.utime(target)  # recently used: kept by the sweep below
                write_atomic(self._path(host), json.dumps({"gen": gen, "manifest": ref}).encode())
            self._sweep()
        except OSError:
            pass

    def _sweep(self) -> None:
        """Remove the manifests no dispatch used for a month: at most once a day (a stamp file says when), not on
        every dispatch (a controller that dispatched thousands of workspaces stat()ed each of them every time:
        3,204 files, ~25 ms of every `clusterctl dispatch` on the development machine)."""
        manifests = self.dir / "manifests"
        stamp = manifests / ".swept"
        now = time.time()
        try:
            if _private(stamp) and now - os.stat(stamp).st_mtime < SWEEP_EVERY_S:
                return
        except FileNotFoundError:
            pass
        write_atomic(stamp, b"")  # (a stamp others could write never postpones the sweep: it is written again)
        cutoff = now - MANIFEST_KEEP_S
        with os.scandir(manifests) as entries:
            for entry in entries:
                if entry.name.endswith(".json") and entry.stat(follow_symlinks=False).st_mtime < cutoff:
                    os.unlink(entry.path)


_ENTRY_TYPES = {wire.ENTRY_SIZE: int, wire.ENTRY_SHA256: str, wire.ENTRY_MODE: int, wire.ENTRY_MTIME_NS: int}


def _manifest_ok(manifest) -> bool:
    """Whether a recorded manifest is exactly of the form we write: {path: {size, sha256, mode, mtime_ns}}."""
    return isinstance(manifest, dict) and all(
        isinstance(path, str) and isinstance(entry, dict) and entry.keys() == _ENTRY_TYPES.keys()
        and all(type(entry[k]) is t for k, t in _ENTRY_TYPES.items()) for path, entry in manifest.items())


def _private(path) -> bool:
    """Whether `path` is a regular file of this user that nobody else may read or write (what load reads)."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid() and not st.st_mode & 0o077
