"""The controller's memory of each host: the generation and manifest it last dispatched there, so that
the next dispatch plans without asking (the host confirms, or replies with its actual state)."""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

from ...plan import Host
from .plan import HostView
from .scan import CACHE_ROOT, private_dir, write_atomic

__all__ = ["RECORDS_DIR", "Records"]

RECORDS_DIR = CACHE_ROOT / "dispatched"


class Records:
    """What this controller last dispatched to each host (for one workspace root): generation and manifest.

    ~/.cache/clusterctl/dispatched/<host+root>.json holds {"gen", "manifest": sha256}; manifests are stored
    once by content under manifests/, since hosts usually share one.
    """

    def __init__(self, root: str):
        self.dir = RECORDS_DIR
        self.root = root
        self._loaded: dict[str, dict] = {}

    def _path(self, host: Host) -> Path:
        ident = json.dumps([host.user, host.address, host.port, self.root])
        return self.dir / (hashlib.sha256(ident.encode()).hexdigest()[:32] + ".json")

    def load(self, host: Host) -> HostView | None:
        """The host as last dispatched to (to be confirmed by it), or None without a readable record."""
        try:
            rec = json.loads(self._path(host).read_text())
            ref = rec["manifest"]
            if ref not in self._loaded:
                self._loaded[ref] = json.loads((self.dir / "manifests" / f"{ref}.json").read_text())
            return HostView(rec["gen"], self._loaded[ref], check=True)
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def save(self, records: dict[Host, tuple[str, dict]]) -> None:
        """Record each host's new (generation, manifest); a failure to write only costs a round trip later."""
        written: dict[int, str] = {}
        try:
            private_dir(self.dir / "manifests", self.dir.parent)
            for host, (gen, manifest) in records.items():
                ref = written.get(id(manifest))
                if ref is None:
                    blob = json.dumps(manifest, sort_keys=True).encode()
                    ref = written[id(manifest)] = hashlib.sha256(blob).hexdigest()
                    target = self.dir / "manifests" / f"{ref}.json"
                    if not target.exists():
                        write_atomic(target, blob)
                    else:
                        os.utime(target)  # recently used: kept by the sweep below
                write_atomic(self._path(host), json.dumps({"gen": gen, "manifest": ref}).encode())
            cutoff = time.time() - 30 * 86400
            for old in (self.dir / "manifests").glob("*.json"):  # manifests no dispatch used for a month
                if old.stat().st_mtime < cutoff:
                    old.unlink(missing_ok=True)
        except OSError:
            pass
