"""The dispatch wire format, controller side: the header `hostws.py apply` reads, manifest entries, the
host tool's replies and exit codes.

The host side (clusterctl/hostws.py) reads and writes the same format. Stdlib only and self-contained
(it imports nothing of clusterctl) so that it can give way to the one module both sides import.

    stdin of `apply`:  16 ASCII digits N, N bytes of marshal(header), then a tar stream when header["archive"]
    header:            {"gen", "base", "check", "changes": {path: entry}, "patches": {path: patch},
                        "delete": [path], "archive": bool[, "inline": {path: bytes}]}
    manifest entry:    {"s": size, "h": sha256 hex, "m": mode bits, "t": mtime in ns}
    patch:             {"e": entry, "b": block size, "r": [[first block, count], ...][, "d": the blocks' bytes]}
    replies (JSON):    {"gen", "manifest", "drift": [{"path", "problem"}]} for `state`; for `apply` the new
                       {"gen", ...} (with "unchanged": true when nothing changed), or {"stale": reason,
                       "gen", "manifest", "drift"} when the host is not where the controller planned from
"""

from __future__ import annotations

import marshal

__all__ = [
    "MARSHAL_VERSION", "TOOL_MISSING", "LENGTH_DIGITS", "SIZE", "SHA256", "MODE", "MTIME", "GEN", "MANIFEST",
    "DRIFT", "PATH", "STALE", "STALE_PATCH", "UNCHANGED", "entry", "differs", "patch", "header", "frame",
]

MARSHAL_VERSION = 4  # what hostws.py writes and reads: any Python 3 reads it
TOOL_MISSING = 75  # the apply command's exit code when hostws is not installed on the host
LENGTH_DIGITS = 16  # the header's length, in ASCII digits, before the header

# manifest entry fields
SIZE, SHA256, MODE, MTIME = "s", "h", "m", "t"
# keys of the host's replies
GEN, MANIFEST, DRIFT, PATH = "gen", "manifest", "drift", "path"
STALE, UNCHANGED = "stale", "unchanged"
STALE_PATCH = "patch"  # the stale reason when a patch's base differed: send that file whole


def entry(size: int, sha256: str, mode: int, mtime_ns: int) -> dict:
    """A manifest entry, as hostws.py stores and checks it."""
    return {SIZE: size, SHA256: sha256, MODE: mode, MTIME: mtime_ns}


def differs(old: dict | None, new: dict) -> bool:
    """Whether the file of manifest entry `new` must travel to a host whose entry is `old` (None: absent);
    a different mtime alone does not count."""
    return old is None or old[SHA256] != new[SHA256] or old[MODE] != new[MODE] or old[SIZE] != new[SIZE]


def patch(new: dict, block: int, ranges: tuple[tuple[int, int], ...], data: bytes | None = None) -> dict:
    """A patch of the header: the file's new entry, its block size, the changed block ranges (their bytes
    inline in `data`, else in the archive's member of that path)."""
    out = {"e": new, "b": block, "r": ranges}
    if data is not None:
        out["d"] = data
    return out


def header(*, gen: str, base: str | None, check: bool, changes: dict[str, dict], patches: dict[str, dict],
           delete: list[str], archive: bool, inline: dict[str, bytes] | None = None) -> dict:
    """The header of one update: from generation `base` to `gen` (`check`: the host must confirm that it
    is at `base` with no drift); whole files' entries, patches, deletions; whether a tar archive follows,
    and small files' content inline."""
    out = {"gen": gen, "base": base, "check": check, "changes": changes, "patches": patches, "delete": delete,
           "archive": archive}
    if inline:
        out["inline"] = inline
    return out


def frame(hdr: dict) -> bytes:
    """The header as `apply` reads it from stdin: length-framed, so the host hands the rest of stdin to tar.

    marshal, not JSON: hostws reads it without importing json (see there)."""
    blob = marshal.dumps(hdr, MARSHAL_VERSION)
    return b"%0*d" % (LENGTH_DIGITS, len(blob)) + blob
