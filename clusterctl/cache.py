"""The controller's cache directory: one place that decides where clusterctl keeps its state, and whether
what is there may be trusted.

Some of what is kept there decides what runs (a cached plan holds every process's argv; the ssh answers
say which machine a host name is): `private_dir` hands out such a directory only when neither it nor the
directories above it up to the cache root can have been written by anyone else (owned by this user, not
group- or world-writable, not a symlink; the root's parent owned by this user or root, and sticky where
others may write to it), as the ssh control directory is checked (clusterctl.transport.openssh); files in
it are written 0600 (`write_private`) and read back only when still so (`read_private`). Anything else is
a miss: the caller works without its cache.
"""

from __future__ import annotations

import errno
import os
import stat
from typing import TYPE_CHECKING

from .files import read_fd

if TYPE_CHECKING:  # pathlib (and the urllib.parse it imports) only where a Path is asked for: not for `exec`
    from collections.abc import Callable
    from pathlib import Path

__all__ = ["cache_root", "cache_root_path", "cache_dir", "makedirs", "private_dir", "read_private", "write_private",
           "write_atomic", "trusted_dir", "prune_lru"]


def cache_root_path() -> str:
    """$XDG_CACHE_HOME/clusterctl, as a string; ~/.cache/clusterctl where XDG_CACHE_HOME is unset, empty or
    relative (the XDG base directory spec: a relative path is invalid and ignored)."""
    base = os.environ.get("XDG_CACHE_HOME")
    if not base or not os.path.isabs(base):
        base = os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "clusterctl")


def makedirs(path: "str | os.PathLike") -> None:
    """os.makedirs(path, 0o700, exist_ok=True) for a directory of the cache, but never the home directory itself:
    FileNotFoundError when `path` is under a home directory that does not exist (a service account's
    HOME=/nonexistent says it has none; as root, making one would make /nonexistent)."""
    home = os.path.expanduser("~")
    name = os.fspath(path)
    if not os.path.isdir(home) and os.path.commonpath([os.path.abspath(name), os.path.abspath(home)]) == \
            os.path.abspath(home):
        raise FileNotFoundError(errno.ENOENT, f"the home directory {home} does not exist", home)
    os.makedirs(name, mode=0o700, exist_ok=True)


def cache_root() -> "Path":
    """cache_root_path() as a Path."""
    from pathlib import Path

    return Path(cache_root_path())


def cache_dir(*parts: str) -> "Path":
    """A directory under cache_root(), created private (0700) when missing."""
    path = cache_root().joinpath(*parts)
    makedirs(path)
    return path


def trusted_dir(path: "str | os.PathLike", *, parent: bool = False) -> bool:
    """Whether `path` is a real directory (not a symlink) that only this user can write to; with `parent`
    (a directory above ours, such as ~/.cache or /tmp), one owned by this user or root, and sticky where
    group or others may write to it (so they cannot move ours away)."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    if not stat.S_ISDIR(st.st_mode):
        return False
    if parent:
        return st.st_uid in (os.getuid(), 0) and (not st.st_mode & 0o022 or bool(st.st_mode & stat.S_ISVTX))
    return st.st_uid == os.getuid() and not st.st_mode & 0o022


def private_dir(*parts: str) -> str | None:
    """A directory under the cache root for state that decides what runs (created 0700 when missing); None
    when it, or a directory between it and the cache root's parent, fails trusted_dir()."""
    root = cache_root_path()
    path = os.path.join(root, *parts)
    try:
        makedirs(path)
    except OSError:
        return None
    if not trusted_dir(os.path.dirname(root), parent=True):
        return None
    if not all(trusted_dir(os.path.join(root, *parts[:i])) for i in range(len(parts) + 1)):
        return None
    return path


def read_private(path: "str | os.PathLike", limit: int) -> bytes | None:
    """The bytes of a file this user wrote privately: None (a miss) unless it is a regular file (not a
    symlink) owned by this user, readable and writable by nobody else, of at most `limit` bytes."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077 or st.st_size > limit:
            return None
        data = read_fd(fd, limit)
        return data if len(data) <= limit else None
    except OSError:
        return None
    finally:
        os.close(fd)


def write_atomic(path: "str | os.PathLike", data: bytes) -> None:
    """Write `path` 0600 through a temporary file beside it and a rename: a reader sees the old file or the new, and
    whatever is at `path` (a symlink, say) is replaced, never written through. OSError when it cannot be written."""
    path = os.fspath(path)
    folder, name = os.path.split(path)
    tmp = os.path.join(folder, f".{name}.{os.getpid()}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            os.fchmod(fd, 0o600)  # whatever the umask, and over a file left by an earlier try (before any write)
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except OSError:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def write_private(path: "str | os.PathLike", data: bytes) -> bool:
    """write_atomic(path, data); False when it could not be written (a cache that cannot be written is only
    slower)."""
    try:
        write_atomic(path, data)
        return True
    except OSError:
        return False


def prune_lru(directory: "str | os.PathLike", keep: int, idle_s: float, *, now: float | None = None,
              match: "Callable[[str], bool] | None" = None) -> list[str]:
    """Remove the entries of `directory` (files, or directories with what is in them) that are not among its `keep`
    most recently used (by mtime: a user of an entry touches it) and were last used `idle_s` ago or more; their
    names. For a cache whose entries are made per key and never reused once the key changes (offline apt's roots,
    the wheelhouse's groups). With `match`, only the entries whose name it accepts count: the rest of the directory
    (a user's own files, where the user named the directory) is neither kept in their place nor removed."""
    import shutil
    import time

    now = time.time() if now is None else now
    try:
        with os.scandir(directory) as it:
            entries = sorted(((e.stat(follow_symlinks=False).st_mtime, e) for e in it if match is None or match(e.name)),
                             key=lambda m_e: -m_e[0])
    except OSError:
        return []
    gone = []
    for mtime, entry in entries[keep:]:
        if now - mtime < idle_s:
            continue
        if entry.is_dir(follow_symlinks=False):
            shutil.rmtree(entry.path, ignore_errors=True)
        else:
            try:
                os.unlink(entry.path)
            except OSError:
                continue
        gone.append(entry.name)
    return gone
