"""The dispatch wire format: what the controller (clusterctl/ops/dispatch) and the host (hostws.py) exchange.

Defined once, here; both sides import it (this package is stdlib only, so the controller can import it
too). `apply` reads from stdin a frame: `LENGTH_DIGITS` ASCII digits giving the header's length, the header
(a dict in marshal format `MARSHAL_VERSION`, which any Python 3 reads; not JSON, whose import costs a tenth
of `apply` on a host), then, when the header says "archive", a tar stream.

Header keys (`HEADER_KEYS`):
    gen      the new generation's name          base     the generation the update was planned from
    check    the controller planned from its cached manifest: confirm `base` and no drift first
    changes  {path: manifest entry} of files travelling whole
    patches  {path: {PATCH_ENTRY: entry, PATCH_BLOCK: block size, PATCH_RANGES: [[first, count]...],
              PATCH_DATA: bytes (only when inline)}} of files travelling as their changed blocks
    delete   [paths]                             archive  whether a tar stream follows the header
    inline   {path: bytes} of small whole files (no archive then)

A manifest entry (`manifest_entry`) is {"s": size, "h": sha256 hex, "m": mode, "t": mtime in ns}; a
generation's manifest {path: entry} is stored beside it as `<gen>` + `MANIFEST_SUFFIX`, in marshal format.
Replies are one JSON object on stdout. `TOOL_MISSING_EXIT` is the exit status of the controller's `apply`
command line when the host package is not installed on the host (the controller then installs it and asks
again).
"""

import marshal

MARSHAL_VERSION = 4
LENGTH_DIGITS = 16
MANIFEST_SUFFIX = ".manifest"
TOOL_MISSING_EXIT = 75

ENTRY_SIZE, ENTRY_SHA256, ENTRY_MODE, ENTRY_MTIME_NS = "s", "h", "m", "t"
ENTRY_KEYS = (ENTRY_SIZE, ENTRY_SHA256, ENTRY_MODE, ENTRY_MTIME_NS)
HEADER_KEYS = ("gen", "base", "check", "changes", "patches", "delete", "archive", "inline")
PATCH_ENTRY, PATCH_BLOCK, PATCH_RANGES, PATCH_DATA = "e", "b", "r", "d"
# keys of the host's replies: {GEN, MANIFEST, DRIFT: [{PATH, "problem"}]} for `state`; for `apply` the new
# {GEN, ...} (UNCHANGED: true when nothing changed), or {STALE: reason, GEN, MANIFEST, DRIFT} when the host is
# not where the controller planned from (reason STALE_PATCH: a patch's base differed, send that file whole)
GEN, MANIFEST, DRIFT, PATH = "gen", "manifest", "drift", "path"
STALE, UNCHANGED = "stale", "unchanged"
STALE_PATCH = "patch"

__all__ = ["MARSHAL_VERSION", "LENGTH_DIGITS", "MANIFEST_SUFFIX", "TOOL_MISSING_EXIT", "ENTRY_KEYS", "HEADER_KEYS",
           "ENTRY_SIZE", "ENTRY_SHA256", "ENTRY_MODE", "ENTRY_MTIME_NS", "PATCH_ENTRY", "PATCH_BLOCK",
           "PATCH_RANGES", "PATCH_DATA", "manifest_entry", "frame_header", "parse_length", "dump_manifest",
           "load_manifest", "GEN", "MANIFEST", "DRIFT", "PATH", "STALE", "UNCHANGED", "STALE_PATCH", "differs",
           "patch", "header"]


def manifest_entry(size, sha256, mode, mtime_ns):
    """One manifest entry: {"s": size, "h": sha256 hex, "m": mode, "t": mtime in ns}."""
    return {ENTRY_SIZE: size, ENTRY_SHA256: sha256, ENTRY_MODE: mode, ENTRY_MTIME_NS: mtime_ns}


def frame_header(header):
    """The bytes `apply` reads first: the header's length in LENGTH_DIGITS digits, then the marshalled header."""
    blob = marshal.dumps(header, MARSHAL_VERSION)
    return b"%0*d" % (LENGTH_DIGITS, len(blob)) + blob


def parse_length(digits):
    """The header length from the frame's first LENGTH_DIGITS bytes; raise ValueError when they are not digits."""
    if len(digits) != LENGTH_DIGITS or not digits.isdigit():
        raise ValueError("bad header length %r" % (digits[:LENGTH_DIGITS],))
    return int(digits)


def dump_manifest(manifest):
    """A manifest {path: entry} as stored beside its generation."""
    return marshal.dumps(manifest, MARSHAL_VERSION)


def load_manifest(data):
    """Inverse of dump_manifest."""
    return marshal.loads(data)


def differs(old, new):
    """Whether the file of manifest entry `new` must travel to a host whose entry is `old` (None: absent);
    a different mtime alone does not count."""
    return (old is None or old[ENTRY_SHA256] != new[ENTRY_SHA256] or old[ENTRY_MODE] != new[ENTRY_MODE]
            or old[ENTRY_SIZE] != new[ENTRY_SIZE])


def patch(new, block, ranges, data=None):
    """A patch of the header: the file's new entry, its block size, the changed block ranges (their bytes
    inline in `data`, else in the archive's member of that path)."""
    out = {PATCH_ENTRY: new, PATCH_BLOCK: block, PATCH_RANGES: ranges}
    if data is not None:
        out[PATCH_DATA] = data
    return out


def header(*, gen, base, check, changes, patches, delete, archive, inline=None):
    """The header of one update: from generation `base` to `gen` (`check`: the host must confirm that it
    is at `base` with no drift); whole files' entries, patches, deletions; whether a tar archive follows,
    and small files' content inline."""
    out = {"gen": gen, "base": base, "check": check, "changes": changes, "patches": patches, "delete": delete,
           "archive": archive}
    if inline:
        out["inline"] = inline
    return out
