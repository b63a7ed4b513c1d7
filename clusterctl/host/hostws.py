#!/usr/bin/env python3
"""Host side of `clusterctl dispatch`: apply a workspace update atomically, report state, detect drift.

Stdlib only (Python >= 3.9): part of the host package (clusterctl/host), uploaded to every host and run
there with `python3`. The wire format it reads (frame, header keys, manifest entries) is clusterctl/host/wire.py.

Layout on the host, for workspace ROOT:
    ROOT                  symlink -> ROOT.d/<gen>   (switched atomically with rename)
    ROOT.d/<gen>/         one generation of the workspace
    ROOT.d/<gen>.manifest its manifest {path: {"s": size, "h": sha256, "m": mode, "t": mtime_ns}}, marshal

`apply` reads from stdin: a 16-digit length, that many bytes of header {"gen", "base", "check",
"changes", "patches", "delete", "archive", "inline"}, then (when "archive") a tar stream, which GNU tar
extracts (C speed; it unlinks before replacing, so the old generation is never modified), or Python's
tarfile where there is no tar. `changes` holds the manifest entries that differ from generation `base`,
whose files travel whole; `patches` holds entries whose files travel as their changed fixed-size blocks
only ({"e": entry, "b": block size, "r": [[first block, count], ...]}): those blocks back to back, in the
tar member or inline under "d", and the rest is copied from the previous generation, then the result is
checked against the entry's sha256. A small update travels inside the header: whole files' content under
"inline" {path: bytes}, and no archive. The controller may start `apply` before it knows the update (to
overlap the SSH set-up and the drift check below with its own scan): an empty stdin means nothing to do. It hard-links the current generation into a staging directory, replaces changed files,
deletes removed ones, checks every changed file, and only then switches the symlink. Any failure
removes the staging directory and leaves the previous workspace untouched.

With "check" (the controller planned from its cached copy of this host's manifest instead of asking),
the host first confirms that its generation is `base` and that nothing drifted; otherwise, or when a
patch does not reproduce its sha256, it changes nothing and replies {"stale": reason, "gen", "manifest",
"drift"} (exit 0) so the controller can plan again from that state in the same session.

The header and the manifests are in marshal format (version 4: any Python 3 reads it), not JSON: `apply`
runs once per host per dispatch, and importing json (which imports re) is a tenth of its time there.
Both come only from the controller over SSH or from this script; replies stay JSON.
"""

if __name__ == "__main__" and not __package__:
    # Run as a file (python3 .../hostws.py): import the package this file is part of, so that the
    # relative imports below work (PEP 366), with the package's own directory off sys.path.
    import os
    import sys

    _here = os.path.dirname(os.path.abspath(__file__))
    _top, _parts = _here, []
    while os.path.isfile(os.path.join(_top, "__init__.py")):
        _top, _name = os.path.split(_top)
        _parts.insert(0, _name)
    if sys.path and os.path.abspath(sys.path[0] or ".") == _here:
        sys.path[0] = _top
    else:
        sys.path.insert(0, _top)
    __package__ = ".".join(_parts)
    __import__(__package__)

import marshal
import os
import stat as _stat
import sys

from . import wire
from .wire import ENTRY_MTIME_NS, ENTRY_SHA256, ENTRY_SIZE, PATCH_ENTRY
from .wsfiles import (PatchError, apply_patch, extract, extract_tar, fail, read_exact, rmtree, safe_rel, sha256, spawn,
                      which, write_file)

# hashlib, json, shutil and tarfile are imported where needed: this runs once per host per
# dispatch, and on a busy host Python's start-up is a good part of its time.
MANIFEST = wire.MANIFEST_SUFFIX


def paths(root):
    root = os.path.normpath(os.path.expanduser(root))
    return root, root + ".d"


def current_gen(root):
    if os.path.islink(root):
        target = os.readlink(root)
        return os.path.basename(target.rstrip("/"))
    if os.path.isdir(root) and not os.listdir(root):
        mode = os.lstat(root).st_mode
        if mode & (_stat.S_ISVTX | 0o002):  # /tmp, /var/tmp, any world-writable one: never replaced with our symlink
            fail(f"{root} is a directory anyone may write to (mode {_stat.S_IMODE(mode):o}), not a clusterctl workspace; "
                 "give a directory of its own in workspace.remote")
        return None  # an empty directory of its own is adopted: apply replaces it with the symlink
    if os.path.exists(root):
        fail(f"{root} exists and is not a clusterctl workspace (not a symlink); move it away or change workspace.remote")
    return None


def load_manifest(gens, gen):
    if gen is None:
        return {}
    try:
        with open(os.path.join(gens, gen + MANIFEST), "rb") as fh:
            return wire.load_manifest(fh.read())  # marshal.load(fh) reads in small pieces: 6x slower
    except FileNotFoundError:
        pass
    try:  # written by clusterctl before 0.2: JSON
        import json

        with open(os.path.join(gens, gen + ".json"), encoding="utf-8") as fh:
            return json.load(fh)
    except FileNotFoundError:
        return {}


def cmd_state(root):
    root, gens = paths(root)
    gen = current_gen(root)
    manifest = load_manifest(gens, gen)
    drift = find_drift(os.path.join(gens, gen), manifest) if gen else []
    reply({"gen": gen, "manifest": manifest, "drift": drift})


def link_tree(src, dst):
    """Copy a tree as hard links (directories are created, files linked): GNU cp where there is one."""
    if which("cp") and spawn(["cp", "-al", "--", src, dst])[0] == 0:
        return
    rmtree(dst)  # not GNU cp, or it failed: redo it here (and name any error)
    for dirpath, dirnames, filenames in os.walk(src):
        rel = os.path.relpath(dirpath, src)
        target = os.path.join(dst, rel) if rel != "." else dst
        os.makedirs(target, exist_ok=True)
        for name in filenames:
            s = os.path.join(dirpath, name)
            if os.path.islink(s):
                os.symlink(os.readlink(s), os.path.join(target, name))
            else:
                os.link(s, os.path.join(target, name))


def spare_gen(gens, live):
    """The newest complete generation other than the live one (kept by the previous dispatch) that no job runs in, if
    any."""
    try:
        names = os.listdir(gens)
    except FileNotFoundError:
        return None
    spare = [g for g in set(map(gen_of, names)) if g and g != live and os.path.isdir(os.path.join(gens, g)) and (g + MANIFEST) in names]
    for g in sorted(spare, reverse=True):  # generation names sort by time
        if not in_use(os.path.join(gens, g)):
            return g
    return None


def in_use(path):
    """Whether a running job's supervisor holds the generation at `path` (a shared flock on its directory, taken when
    the job started in it: host/processes.py LocalProcesses.pin); such a generation is neither recycled nor removed."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:
        return False
    try:
        import fcntl

        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    except OSError:  # no locks on this file system (ENOLCK): no supervisor holds it either
        return False
    finally:
        os.close(fd)


def recycle(spare, live, staging, manifest, skip, live_stats):
    """Turn the spare generation (renamed to `staging`; False if it is gone) into a hard-linked copy of `live` for the paths of
    `manifest`, except those in `skip` (about to be written): what differs from `live` is re-linked, what
    `live` does not have is removed. One directory listing per directory (the inode of each entry comes
    with it) and a link per differing file, instead of a link per file plus the later deletion of a
    whole tree."""
    try:
        os.rename(spare, staging)  # atomic: a concurrent dispatch that lost the race builds its own copy
    except FileNotFoundError:
        return False
    if os.stat(staging).st_dev != os.stat(live).st_dev:  # inodes below are compared within one file system
        rmtree(staging)
        return False
    # Manifest paths are normal and safe (cmd_apply checks each one as it enters a manifest), and plain
    # string joins below: os.path.join costs more than the system calls here.
    paths = [rel for rel in manifest if rel not in skip]
    want = set(paths) | set(skip)
    need_dirs = {""}
    for rel in want:
        d = rel.rpartition("/")[0]
        while d not in need_dirs:
            need_dirs.add(d)
            d = d.rpartition("/")[0]
    inodes = {}  # path -> inode of what staging has there (a file or a symlink, never followed)

    def sweep(directory, prefix):
        with os.scandir(directory) as it:
            entries = list(it)
        for entry in entries:
            rel = prefix + entry.name
            if entry.is_dir(follow_symlinks=False):
                if rel in need_dirs:
                    sweep(entry.path, rel + "/")
                else:
                    rmtree(entry.path)  # nothing of the live generation lives under it
            elif rel in want:
                inodes[rel] = entry.inode()  # d_ino from the listing: no stat
            else:
                os.unlink(entry.path)

    sweep(staging, "")
    for rel in paths:
        src, dst = live + "/" + rel, staging + "/" + rel
        st = live_stats.get(rel)
        if st is None:
            try:
                st = os.stat(src)
            except FileNotFoundError:
                continue  # missing in the live generation: the controller sends it (drift)
        cur = inodes.get(rel)
        if cur == st.st_ino:
            continue
        if cur is not None:
            os.unlink(dst)
        else:
            os.makedirs(staging + "/" + rel.rpartition("/")[0], exist_ok=True)
        os.link(src, dst)
    return True


def remove_paths(staging, delete):
    """Delete files (before extraction, so a file may replace a directory) and directories left empty."""
    for rel in delete:
        p = os.path.join(staging, rel)
        if os.path.lexists(p) and not os.path.isdir(p):
            os.unlink(p)
        d = os.path.dirname(p)
        while d != staging and os.path.isdir(d) and not os.listdir(d):
            os.rmdir(d)
            d = os.path.dirname(d)


def clear_planted(staging, rels):
    """Remove what stands where a directory on the way to `rels` (written or deleted) must be, when it is not a directory that
    this script made: a symlink (planted in the live workspace and copied by the hard-linked staging
    copy) would redirect the writes below outside the workspace. Costs one lstat per directory."""
    seen = set()
    for rel in rels:
        parts = rel.split("/")[:-1]
        cur = staging
        for part in parts:
            cur = cur + "/" + part
            if cur in seen:
                continue
            seen.add(cur)
            try:
                st = os.lstat(cur)
            except FileNotFoundError:
                break  # created by the writes below, as directories
            if not _stat.S_ISDIR(st.st_mode):
                os.unlink(cur)  # a symlink or a file: never followed, never written through
                break


def unlink_file(path):
    """Remove `path` unless it is a directory or missing (never followed)."""
    try:
        if not _stat.S_ISDIR(os.lstat(path).st_mode):
            os.unlink(path)
    except FileNotFoundError:
        pass


def size_of(path):
    """The size of the file at `path`; None when there is none."""
    try:
        return os.stat(path).st_size
    except FileNotFoundError:
        return None


def gen_of(name):
    """The generation a name in ROOT.d belongs to (a directory, its manifest, or leftovers of either)."""
    for suffix in (MANIFEST, ".json", ".patch.tmp", ".tmp"):
        if name.endswith(suffix):
            return gen_of(name[: -len(suffix)])
    return name


def reply(obj):
    """Print one JSON object. Flat replies of plain words and numbers (the common case) are written here,
    so that `apply` does not import json."""

    def plain(v):
        return v is None or isinstance(v, int) or (
            isinstance(v, str) and v.isascii() and v.isprintable() and '"' not in v and "\\" not in v
        )

    def encode(v):
        if isinstance(v, bool) or v is None:
            return {True: "true", False: "false", None: "null"}[v]
        return f'"{v}"' if isinstance(v, str) else str(v)

    if all(map(plain, obj.values())):
        print("{" + ", ".join(f'"{k}": {encode(v)}' for k, v in obj.items()) + "}", flush=True)
        return
    import json

    print(json.dumps(obj), flush=True)


def cmd_apply(root):
    root, gens = paths(root)
    # The live generation's state comes first: the controller may start this command before it has
    # scanned its files, so this work overlaps its scan. Its stats serve recycle() below too.
    old = current_gen(root)
    manifest = load_manifest(gens, old)
    live_stats = {}
    drift = find_drift(os.path.join(gens, old), manifest, live_stats) if old is not None else []
    length = read_exact(0, wire.LENGTH_DIGITS, eof_ok=True)
    if not length:  # started ahead and then not needed: nothing to do
        return
    header = marshal.loads(read_exact(0, wire.parse_length(length)))
    gen, changes, patches, delete = header["gen"], header["changes"], header.get("patches", {}), header["delete"]
    for rel in (*changes, *patches, *delete):  # checked once here: every use below joins them as they are
        if safe_rel(rel) != rel:
            fail(f"refusing path that is not normal and relative: {rel!r}")

    def stale(reason, drift):
        reply({"stale": reason, "gen": old, "manifest": manifest, "drift": drift})

    if old != header["base"]:
        if header.get("check"):
            return stale(f"generation is {old}, not {header['base']}", [])
        fail(f"{root} changed during dispatch (now {old}, expected {header['base']}); dispatch again")
    if header.get("check") and drift:
        return stale("drift", drift)
    if not changes and not patches and not delete and old is not None:  # (none yet: an empty workspace is made)
        return reply({"gen": old, "previous": old, "written": 0, "deleted": 0, "unchanged": True})
    new_manifest = dict(manifest)
    new_manifest.update(changes)
    new_manifest.update({rel: p[PATCH_ENTRY] for rel, p in patches.items()})
    for rel in delete:
        new_manifest.pop(rel, None)
    os.makedirs(gens, exist_ok=True)
    staging = os.path.join(gens, gen + ".tmp")
    if os.path.exists(staging):
        rmtree(staging)
    try:
        live = os.path.join(gens, old) if old is not None else None
        spare = spare_gen(gens, old) if live is not None else None
        if live is None or not os.path.isdir(live):
            os.makedirs(staging)
        elif spare is None or not recycle(os.path.join(gens, spare), live, staging, manifest,
                                          set(changes) | set(patches) | set(delete), live_stats):
            link_tree(live, staging)
        # first: a deletion, like a write, must not go through a symlink planted on its way (a copy by
        # link_tree keeps it; recycle() removes it)
        clear_planted(staging, [*changes, *patches, *delete])
        remove_paths(staging, delete)
        # Every file of the update comes from this update: the copy's older version of it (the live
        # generation's, or the spare's) goes first, so that one whose member never came (a stream that
        # ended early between two members, which GNU tar takes for the end of the archive) is found missing
        # below instead of going live under its new manifest entry.
        for rel in (*changes, *patches):
            unlink_file(staging + "/" + rel)
        for rel, data in header.get("inline", {}).items():  # small files travel inside the header
            write_file(staging, rel, data, changes[rel], os.path.join(gens, gen + ".patch.tmp"))
        digests = None
        if header.get("archive") and which("tar"):
            extract_tar(staging)
        elif header.get("archive"):
            with os.fdopen(0, "rb", closefd=False) as stream:
                digests = extract(stream, staging)
        if digests is not None:  # Python extraction hashed while writing
            bad = [rel for rel in changes if digests.get(rel) != changes[rel][ENTRY_SHA256]]
        else:  # GNU tar or inline: SSH's MAC guarantees the bytes; sizes catch a truncated stream
            bad = [rel for rel in changes if size_of(os.path.join(staging, rel)) != changes[rel][ENTRY_SIZE]]
        if bad:
            raise OSError(f"content check failed after transfer: {', '.join(bad[:5])}")
        unpatched = []
        for rel, patch in patches.items():
            try:
                digest = apply_patch(os.path.join(staging, rel), os.path.join(gens, old, rel),
                                     os.path.join(gens, gen + ".patch.tmp"), patch)
            except PatchError:
                digest = None
            if digest != patch[PATCH_ENTRY][ENTRY_SHA256]:  # the base differs from its manifest entry: ask for the whole file
                unpatched.append({"path": rel, "problem": "modified"})
        if unpatched:
            rmtree(staging)
            return stale("patch", unpatched)
        with open(os.path.join(gens, gen + MANIFEST + ".tmp"), "wb") as fh:
            fh.write(wire.dump_manifest(new_manifest))
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(os.path.join(gens, gen + MANIFEST + ".tmp"), os.path.join(gens, gen + MANIFEST))
        os.replace(staging, os.path.join(gens, gen))
        link = root + ".link.tmp"
        if os.path.lexists(link):
            os.unlink(link)
        os.symlink(os.path.join(os.path.basename(gens), gen), link)
        if os.path.isdir(root) and not os.path.islink(root):
            os.rmdir(root)  # the empty directory adopted above
        os.replace(link, root)  # the atomic switch
    except OSError as exc:
        rmtree(staging)
        for leftover in (os.path.join(gens, gen + MANIFEST + ".tmp"), os.path.join(gens, gen + ".patch.tmp")):
            if os.path.exists(leftover):
                os.unlink(leftover)
        fail(f"dispatch failed, previous workspace kept: {exc.strerror or exc}" + (f": {exc.filename}" if exc.filename else ""))
    doomed = [n for n in os.listdir(gens) if gen_of(n) not in {gen, old}]
    if old is None:
        leave_spare(gens, gen)
    reply({"gen": gen, "previous": old, "written": len(changes) + len(patches), "deleted": len(delete)})
    prune_detached(gens, doomed)


def leave_spare(gens, gen):
    """After a first dispatch: a hard-linked copy of generation `gen` as the spare generation, so that the
    next dispatch recycles it instead of copying the tree (a link per file) while its controller waits.
    Best effort: without it, the next dispatch makes its copy itself, as before."""
    name = gen + "~spare"  # sorts after `gen`: spare_gen() takes it before the generation it copies
    tmp = os.path.join(gens, name + ".tmp")
    try:
        link_tree(os.path.join(gens, gen), tmp)
        os.rename(tmp, os.path.join(gens, name))
        os.link(os.path.join(gens, gen + MANIFEST), os.path.join(gens, name + MANIFEST))
    except OSError:
        rmtree(tmp)
        rmtree(os.path.join(gens, name))


def prune_detached(gens, names):
    """Remove old generations after replying, only `names` (listed before this generation went live, so a
    later dispatch's staging is never touched): files at once, directories in a child detached from the
    SSH channel."""
    dirs = []
    held = {name for name in names if os.path.isdir(os.path.join(gens, name)) and in_use(os.path.join(gens, name))}
    for name in names:
        p = os.path.join(gens, name)
        if name in held or gen_of(name) in held:  # a running job's generation and its manifest: kept for now
            continue
        if os.path.isdir(p) and not os.path.islink(p):
            dirs.append(name)
        elif os.path.lexists(p):
            os.unlink(p)
    if not dirs:
        return
    if os.fork() != 0:
        return
    try:
        os.setsid()
        os.nice(19)  # cleanup yields to whatever the host does next
        devnull = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(devnull, fd)  # let sshd close the channel now
        prune(gens, dirs)
    finally:
        os._exit(0)


def prune(gens, names):
    """Delete these generation directories and manifests (with rm -rf, many times faster than Python)."""
    try:
        if spawn(["rm", "-rf", "--"] + [os.path.join(gens, n) for n in names])[0] == 0:
            return
    except OSError:
        pass
    for name in names:
        p = os.path.join(gens, name)
        if os.path.isdir(p) and not os.path.islink(p):
            rmtree(p)
        elif os.path.lexists(p):
            os.unlink(p)


def cmd_verify(root):
    root, gens = paths(root)
    gen = current_gen(root)
    if gen is None:
        reply({"gen": None, "drift": [{"path": "", "problem": "never dispatched"}]})
        return
    drift = find_drift(os.path.join(gens, gen), load_manifest(gens, gen))
    reply({"gen": gen, "drift": drift})


def find_drift(base, manifest, stats=None):
    """Files of `manifest` that are missing, replaced (by a symlink or anything not a regular file, or
    under a directory that was replaced) or whose content changed under `base` (their stats go into
    `stats` when given). Nothing is followed: a workspace holds only directories and regular files."""
    drift = []
    dirs = {}  # relative directory -> True if it is a real directory (lstat, one per directory)

    def real_dir(d):
        ok = dirs.get(d)
        if ok is None:
            parent = d.rpartition("/")[0]
            if parent and not real_dir(parent):
                ok = False
            else:
                try:
                    ok = _stat.S_ISDIR(os.lstat(base + "/" + d).st_mode)
                except FileNotFoundError:
                    ok = True  # missing: its files are reported missing below
            dirs[d] = ok
        return ok

    for rel, entry in sorted(manifest.items()):
        p = base + "/" + rel
        d = rel.rpartition("/")[0]
        if d and not real_dir(d):
            drift.append({"path": rel, "problem": "replaced"})
            continue
        try:
            st = os.lstat(p)
        except (FileNotFoundError, NotADirectoryError):
            drift.append({"path": rel, "problem": "missing"})
            continue
        if not _stat.S_ISREG(st.st_mode):
            drift.append({"path": rel, "problem": "replaced"})
            continue
        if stats is not None:
            stats[rel] = st
        if st.st_size == entry[ENTRY_SIZE] and st.st_mtime_ns == entry[ENTRY_MTIME_NS]:
            continue
        if st.st_size != entry[ENTRY_SIZE] or sha256(p) != entry[ENTRY_SHA256]:
            drift.append({"path": rel, "problem": "modified"})
    return drift


def main(argv):
    """Run one command: argv is [state|apply|verify, ROOT] (no program name)."""
    if len(argv) != 2 or argv[0] not in ("state", "apply", "verify"):
        fail("usage: hostws.py state|apply|verify ROOT", 2)
    {"state": cmd_state, "apply": cmd_apply, "verify": cmd_verify}[argv[0]](argv[1])


if __name__ == "__main__":
    main(sys.argv[1:])
