#!/usr/bin/env python3
"""Host side of `clusterctl dispatch`: apply a workspace update atomically, report state, detect drift.

Stdlib only (Python >= 3.9): this file is uploaded to every host and run there with `python3`.

Layout on the host, for workspace ROOT:
    ROOT                  symlink -> ROOT.d/<gen>   (switched atomically with rename)
    ROOT.d/<gen>/         one generation of the workspace
    ROOT.d/<gen>.json     its manifest {path: {"s": size, "h": sha256, "m": mode, "t": mtime_ns}}

`apply` reads from stdin: a 16-digit length, that many bytes of JSON header {"gen", "base", "changes",
"delete", "archive"}, then (when "archive") a tar stream of the changed files, which GNU tar extracts
(C speed; it unlinks before replacing, so the old generation is never modified), or Python's tarfile
where there is no tar. `changes` holds only the manifest entries that differ from generation `base` (the
one the controller read), so what travels is proportional to what changed. It hard-links the current generation into a staging directory, replaces changed files
(unlink first, so the old generation is never modified), deletes removed ones, checks every changed
file against the manifest, and only then switches the symlink. Any failure removes the staging
directory and leaves the previous workspace untouched.
"""

import errno
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile

CHUNK = 1 << 20


def fail(msg, code=1):
    sys.stderr.write(msg.rstrip() + "\n")
    sys.exit(code)


def paths(root):
    root = os.path.normpath(os.path.expanduser(root))
    return root, root + ".d"


def current_gen(root):
    if os.path.islink(root):
        target = os.readlink(root)
        return os.path.basename(target.rstrip("/"))
    if os.path.isdir(root) and not os.listdir(root):
        return None  # an empty directory is adopted: apply replaces it with the symlink
    if os.path.exists(root):
        fail(f"{root} exists and is not a clusterctl workspace (not a symlink); move it away or change workspace.remote")
    return None


def load_manifest(gens, gen):
    if gen is None:
        return {}
    try:
        with open(os.path.join(gens, gen + ".json"), encoding="utf-8") as fh:
            return json.load(fh)
    except FileNotFoundError:
        return {}


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while True:
            block = fh.read(CHUNK)
            if not block:
                return h.hexdigest()
            h.update(block)


def cmd_state(root):
    root, gens = paths(root)
    gen = current_gen(root)
    manifest = load_manifest(gens, gen)
    drift = find_drift(os.path.join(gens, gen), manifest) if gen else []
    print(json.dumps({"gen": gen, "manifest": manifest, "drift": drift}))


def link_tree(src, dst):
    """Copy a tree as hard links (directories are created, files linked)."""
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


def safe_rel(name):
    norm = os.path.normpath(name)
    if norm.startswith("/") or norm == ".." or norm.startswith("../") or "\x00" in norm:
        fail(f"refusing unsafe path in archive: {name!r}")
    return norm


def read_exact(fd, n):
    """Exactly n bytes from a raw fd (no read-ahead, so a child can inherit the rest of the stream)."""
    chunks = []
    while n:
        block = os.read(fd, n)
        if not block:
            fail("stream ended early: dispatch header incomplete")
        chunks.append(block)
        n -= len(block)
    return b"".join(chunks)


def extract_tar(staging):
    """Extract the rest of stdin with GNU tar; raise OSError with its message on failure."""
    res = subprocess.run(
        ["tar", "-x", "-f", "-", "-C", staging, "--unlink-first", "--no-same-owner"],
        stdin=0, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )
    if res.returncode != 0:
        lines = [ln for ln in res.stderr.decode("utf-8", "replace").splitlines() if not ln.startswith("tar: Exiting")]
        first = lines[0].replace("tar: ", "", 1) if lines else f"tar exited {res.returncode}"
        st = os.statvfs(staging)
        if st.f_bavail * st.f_frsize < CHUNK:  # tar says "Wrote only N of M bytes"; say why
            raise OSError(f"{os.strerror(errno.ENOSPC)} ({first})")
        raise OSError(first)


def extract(stream, staging):
    """Extract regular files from a tar stream, unlinking any existing file first; return {path: sha256}."""
    digests = {}
    with tarfile.open(fileobj=stream, mode="r|", bufsize=CHUNK) as tar:
        for member in tar:
            rel = safe_rel(member.name)
            dest = os.path.join(staging, rel)
            if member.isdir():
                os.makedirs(dest, exist_ok=True)
                continue
            if not member.isfile():
                fail(f"refusing non-regular file in archive: {member.name!r}")
            os.makedirs(os.path.dirname(dest), exist_ok=True)
            if os.path.lexists(dest):
                os.unlink(dest)
            src = tar.extractfile(member)
            h = hashlib.sha256()
            with open(dest, "wb") as out:
                while True:
                    block = src.read(CHUNK)
                    if not block:
                        break
                    h.update(block)  # checked against the manifest below: no second read
                    out.write(block)
            os.chmod(dest, member.mode & 0o7777)
            os.utime(dest, ns=(member.mtime * 10**9, member.mtime * 10**9))
            digests[rel] = h.hexdigest()
    return digests


def cmd_apply(root):
    root, gens = paths(root)
    header = json.loads(read_exact(0, int(read_exact(0, 16))))
    gen, changes, delete = header["gen"], header["changes"], header["delete"]
    old = current_gen(root)
    if old != header["base"]:
        fail(f"{root} changed during dispatch (now {old}, expected {header['base']}); dispatch again")
    manifest = load_manifest(gens, old)
    manifest.update(changes)
    for rel in delete:
        manifest.pop(rel, None)
    os.makedirs(gens, exist_ok=True)
    staging = os.path.join(gens, gen + ".tmp")
    if os.path.exists(staging):
        shutil.rmtree(staging)
    try:
        if old is not None and os.path.isdir(os.path.join(gens, old)):
            link_tree(os.path.join(gens, old), staging)
        else:
            os.makedirs(staging)
        digests = None
        if header.get("archive") and shutil.which("tar"):
            extract_tar(staging)
        elif header.get("archive"):
            with os.fdopen(0, "rb", closefd=False) as stream:
                digests = extract(stream, staging)
        for rel in delete:
            p = os.path.join(staging, safe_rel(rel))
            if os.path.lexists(p) and not os.path.isdir(p):
                os.unlink(p)
        if digests is not None:  # Python extraction hashed while writing
            bad = [rel for rel in changes if digests.get(safe_rel(rel)) != manifest[rel]["h"]]
        else:  # GNU tar: SSH's MAC guarantees the bytes; sizes catch a truncated stream
            bad = [rel for rel in changes if os.stat(os.path.join(staging, safe_rel(rel))).st_size != manifest[rel]["s"]]
        if bad:
            raise OSError(f"content check failed after transfer: {', '.join(bad[:5])}")
        with open(os.path.join(gens, gen + ".json.tmp"), "w", encoding="utf-8") as fh:
            json.dump(manifest, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(os.path.join(gens, gen + ".json.tmp"), os.path.join(gens, gen + ".json"))
        os.replace(staging, os.path.join(gens, gen))
        link = root + ".link.tmp"
        if os.path.lexists(link):
            os.unlink(link)
        os.symlink(os.path.join(os.path.basename(gens), gen), link)
        if os.path.isdir(root) and not os.path.islink(root):
            os.rmdir(root)  # the empty directory adopted above
        os.replace(link, root)  # the atomic switch
    except OSError as exc:
        shutil.rmtree(staging, ignore_errors=True)
        for leftover in (os.path.join(gens, gen + ".json.tmp"),):
            if os.path.exists(leftover):
                os.unlink(leftover)
        fail(f"dispatch failed, previous workspace kept: {exc.strerror or exc}" + (f": {exc.filename}" if exc.filename else ""))
    doomed = [n for n in os.listdir(gens) if (n[:-5] if n.endswith(".json") else n) not in {gen, old}]
    print(json.dumps({"gen": gen, "previous": old, "written": len(changes), "deleted": len(delete)}), flush=True)
    prune_detached(gens, doomed)


def prune_detached(gens, names):
    """Remove old generations after replying: in a child detached from the SSH channel, only `names`
    (listed before this generation went live, so a later dispatch's staging is never touched)."""
    if not names:
        return
    if os.fork() != 0:
        return
    try:
        os.setsid()
        devnull = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(devnull, fd)  # let sshd close the channel now
        prune(gens, names)
    finally:
        os._exit(0)


def prune(gens, names):
    """Delete these generation directories and manifests."""
    for name in names:
        p = os.path.join(gens, name)
        if os.path.isdir(p) and not os.path.islink(p):
            shutil.rmtree(p, ignore_errors=True)
        elif os.path.lexists(p):
            os.unlink(p)


def cmd_verify(root):
    root, gens = paths(root)
    gen = current_gen(root)
    if gen is None:
        print(json.dumps({"gen": None, "drift": [{"path": "", "problem": "never dispatched"}]}))
        return
    drift = find_drift(os.path.join(gens, gen), load_manifest(gens, gen))
    print(json.dumps({"gen": gen, "drift": drift}))


def find_drift(base, manifest):
    """Files of `manifest` that are missing or whose content changed under `base`."""
    drift = []
    for rel, entry in sorted(manifest.items()):
        p = os.path.join(base, rel)
        try:
            st = os.stat(p)
        except FileNotFoundError:
            drift.append({"path": rel, "problem": "missing"})
            continue
        if st.st_size == entry["s"] and st.st_mtime_ns == entry["t"]:
            continue
        if st.st_size != entry["s"] or sha256(p) != entry["h"]:
            drift.append({"path": rel, "problem": "modified"})
    return drift


def main(argv):
    if len(argv) != 3 or argv[1] not in ("state", "apply", "verify"):
        fail("usage: hostws.py state|apply|verify ROOT", 2)
    {"state": cmd_state, "apply": cmd_apply, "verify": cmd_verify}[argv[1]](argv[2])


if __name__ == "__main__":
    main(sys.argv)
