"""The workspace tool's file work: reading the frame, extracting archives, writing files and block patches.

Part of the host side of `clusterctl dispatch` (hostws.py holds the commands and the generations); stdlib
only, like the whole host package.
"""

import errno
import io
import os
import sys

from .wire import ENTRY_MODE, ENTRY_MTIME_NS, ENTRY_SIZE, PATCH_BLOCK, PATCH_DATA, PATCH_ENTRY, PATCH_RANGES

CHUNK = 1 << 20


def fail(msg, code=1):
    sys.stderr.write(msg.rstrip() + "\n")
    sys.exit(code)



def which(name):
    for d in os.environ.get("PATH", "/usr/bin:/bin").split(os.pathsep):
        if os.access(os.path.join(d, name), os.X_OK):
            return os.path.join(d, name)
    return None


def spawn(argv, stderr=False):
    """Run argv (stdin inherited, stdout discarded); return (exit code, stderr bytes if asked)."""
    r, w = os.pipe() if stderr else (None, None)
    devnull = os.open(os.devnull, os.O_WRONLY)
    actions = [(os.POSIX_SPAWN_DUP2, devnull, 1), (os.POSIX_SPAWN_DUP2, w if stderr else devnull, 2)]
    try:
        pid = os.posix_spawnp(argv[0], argv, os.environ, file_actions=actions)
    finally:
        os.close(devnull)
        if stderr:
            os.close(w)
    err = b""
    if stderr:
        with os.fdopen(r, "rb") as fh:
            err = fh.read()
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), err


def rmtree(path):
    import shutil

    shutil.rmtree(path, ignore_errors=True)


def new_sha256():
    """A sha256 object (hashlib's is OpenSSL's: with SHA extensions, 5x faster than CPython's own
    _sha256, which more than pays for loading it)."""
    import hashlib

    return hashlib.sha256()


def sha256(path):
    h = new_sha256()
    with open(path, "rb") as fh:
        while True:
            block = fh.read(CHUNK)
            if not block:
                return h.hexdigest()
            h.update(block)




def safe_rel(name):
    norm = os.path.normpath(name)
    if norm.startswith("/") or norm == ".." or norm.startswith("../") or "\x00" in norm:
        fail(f"refusing unsafe path in archive: {name!r}")
    return norm


def read_exact(fd, n, eof_ok=False):
    """Exactly n bytes from a raw fd (no read-ahead, so a child can inherit the rest of the stream); with
    eof_ok, b"" when the stream ends before its first byte."""
    chunks = []
    while n:
        block = os.read(fd, n)
        if not block:
            if eof_ok and not chunks:
                return b""
            fail("stream ended early: dispatch header incomplete")
        chunks.append(block)
        n -= len(block)
    return b"".join(chunks)


def extract_tar(staging):
    """Extract the rest of stdin with GNU tar; raise OSError with its message on failure."""
    code, stderr = spawn(["tar", "-x", "-f", "-", "-C", staging, "--unlink-first", "--no-same-owner"], stderr=True)
    if code != 0:
        lines = [ln for ln in stderr.decode("utf-8", "replace").splitlines() if not ln.startswith("tar: Exiting")]
        first = lines[0].replace("tar: ", "", 1) if lines else f"tar exited {code}"
        st = os.statvfs(staging)
        if st.f_bavail * st.f_frsize < CHUNK:  # tar says "Wrote only N of M bytes"; say why
            raise OSError(f"{os.strerror(errno.ENOSPC)} ({first})")
        raise OSError(first)


def extract(stream, staging):
    """Extract regular files from a tar stream, unlinking any existing file first; return {path: sha256}."""
    import tarfile  # only where there is no GNU tar

    try:
        return _extract(tarfile.open(fileobj=stream, mode="r|", bufsize=CHUNK), staging)
    except tarfile.TarError as exc:  # a stream cut short, or garbage: the caller's OSError (staging removed)
        raise OSError(f"archive: {exc}") from None


def _extract(tar, staging):
    digests = {}
    with tar:
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
            h = new_sha256()
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


def write_file(staging, rel, data, entry, tmp):
    """Create file `rel` of `staging` with `data` and the entry's mode and mtime (replacing, never
    writing through, what is there: it may be a hard link into the live generation)."""
    dest = os.path.join(staging, rel)
    if os.path.isdir(dest) and not os.path.islink(dest):
        rmtree(dest)
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    with open(tmp, "wb") as fh:
        fh.write(data)
    os.chmod(tmp, entry[ENTRY_MODE])
    os.utime(tmp, ns=(entry[ENTRY_MTIME_NS], entry[ENTRY_MTIME_NS]))
    os.replace(tmp, dest)


class PatchError(Exception):
    pass


def _nofollow(path, flags):
    return os.open(path, flags | os.O_NOFOLLOW)


def block_set(ranges):
    return {i for first, count in ranges for i in range(first, first + count)}


def apply_patch(delta_path, base_path, tmp_path, patch):
    """Write the new file at `delta_path` from its changed blocks (inline in `patch`, or the archive member
    extracted at `delta_path`) and the rest of `base_path`; return its sha256."""

    entry, bs = patch[PATCH_ENTRY], patch[PATCH_BLOCK]
    size = entry[ENTRY_SIZE]
    h = new_sha256()
    try:
        with (io.BytesIO(patch[PATCH_DATA]) if PATCH_DATA in patch else open(delta_path, "rb")) as delta, \
                open(base_path, "rb", opener=_nofollow) as base, open(tmp_path, "wb") as out:
            if size <= 64 << 20:  # in memory: one read, the blocks spliced in, one write
                data = bytearray(base.read(size))
                data.extend(bytes(size - len(data)))
                for first, count in patch[PATCH_RANGES]:
                    start = first * bs
                    n = min(count * bs, size - start)
                    block = delta.read(n)
                    if len(block) != n:
                        raise PatchError("short delta")
                    data[start : start + n] = block
                if len(data) != size:
                    raise PatchError("bad block range")
                h.update(data)
                out.write(data)
            else:
                fresh = block_set(patch[PATCH_RANGES])
                for i in range((size + bs - 1) // bs):
                    n = min(bs, size - i * bs)
                    block = delta.read(n) if i in fresh else os.pread(base.fileno(), n, i * bs)
                    if len(block) != n:
                        raise PatchError("short block")
                    h.update(block)
                    out.write(block)
            if delta.read(1):
                raise PatchError("unused delta bytes")
    except OSError as exc:  # the base file is gone or is a symlink (never followed): sent whole
        if exc.errno not in (errno.ENOENT, errno.ELOOP, errno.ENOTDIR):
            raise
        raise PatchError(str(exc)) from None
    os.chmod(tmp_path, entry[ENTRY_MODE])
    os.utime(tmp_path, ns=(entry[ENTRY_MTIME_NS], entry[ENTRY_MTIME_NS]))
    os.replace(tmp_path, delta_path)
    return h.hexdigest()


