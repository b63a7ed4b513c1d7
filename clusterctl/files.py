"""Reading the user's own files (a spec, its hostfile, an ssh config and what it includes): bounded, read once where
they can be read only once, and never stuck on what is not a file (`/dev/zero` never ends, a FIFO with no writer
never answers); appending to the controller's own logs, never stuck on a FIFO with no reader."""

from __future__ import annotations

import errno
import os
import stat

__all__ = ["SPEC_LIMIT", "TooLarge", "NotAFile", "read_limited", "read_fd", "read_spec_bytes", "open_append",
           "special_file"]

SPEC_LIMIT = 1 << 20  # a spec larger than 1 MiB is refused before parsing

_ONCE: dict[tuple, bytes] = {}  # a spec that is not a regular file (`/dev/stdin`, `<(...)`): its bytes, read once


class TooLarge(OSError):
    """A file over the limit it was read with."""

    def __init__(self, path: str, limit: int):
        super().__init__(errno.EFBIG, f"larger than {limit // 1024} KiB", path)
        self.limit = limit


class NotAFile(OSError):
    """A FIFO or a socket where a file is read: it may never answer."""

    def __init__(self, path: str, what: str = "not a file (a FIFO or a socket)"):
        super().__init__(errno.EINVAL, what, path)


def read_limited(path: str | os.PathLike, limit: int, *, wait: bool = False) -> bytes:
    """The bytes of `path`, at most `limit` of them: OSError (strerror set) when it cannot be read or is a
    directory, TooLarge when it holds more than `limit` bytes (then no more than `limit` + 1 were read). Without
    `wait`, a FIFO or a socket is refused (NotAFile), not waited on; a device is read as a file (`/dev/null`: empty,
    `/dev/zero`: too large). With `wait`, a pipe is read to its end (a spec given as `/dev/stdin`)."""
    name = os.fspath(path)
    fd = os.open(name, os.O_RDONLY | os.O_CLOEXEC | (0 if wait else os.O_NONBLOCK))
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):
            raise IsADirectoryError(errno.EISDIR, "is a directory", name)
        if not wait and (stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode)):
            raise NotAFile(name)
        data = read_fd(fd, limit)
        if len(data) > limit:
            raise TooLarge(name, limit)
        return data
    finally:
        os.close(fd)


def special_file(path: str | os.PathLike) -> bool:
    """Whether `path` is there and is not a regular file (a FIFO a reader waits on for a writer, `/dev/zero` read for
    ever, a directory): for files another program reads (ssh's known_hosts), which cannot be given a limit."""
    try:
        return not stat.S_ISREG(os.stat(path).st_mode)
    except OSError:
        return False


def read_fd(fd: int, limit: int) -> bytes:
    """What `fd` holds, up to `limit` + 1 bytes (one more than `limit` says it holds more)."""
    chunks, left = [], limit + 1
    while left > 0 and (chunk := os.read(fd, min(left, 1 << 20))):
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def read_spec_bytes(path: str | os.PathLike) -> bytes:
    """The spec file's bytes (read_limited, SPEC_LIMIT). A spec given as a pipe is read once per process and its
    bytes kept, so that every reader of the spec (the plan cache, the loader, a backend) sees them; a regular file
    is read each time (it may change between two commands of one process)."""
    name = os.fspath(path)
    try:
        st = os.stat(name)
        key = (name, st.st_dev, st.st_ino)  # another pipe under the same name (`/dev/fd/5` again) is another spec
        once = not stat.S_ISREG(st.st_mode)
    except OSError:
        key, once = (name, None, None), False  # read_limited says why
    if key in _ONCE:
        return _ONCE[key]
    data = read_limited(name, SPEC_LIMIT, wait=True)
    if once:
        _ONCE[key] = data
    return data


def open_append(path: str | os.PathLike, flags: int = 0, mode: int = 0o600) -> int:
    """A blocking fd that appends to the regular file `path` (made with `mode` if missing): NotAFile for a FIFO (with
    no reader, an open for writing waits for one forever), a socket or a device. `flags` are open()'s (an `opener`)."""
    name = os.fspath(path)
    try:
        fd = os.open(name, flags | os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC | os.O_NONBLOCK, mode)
    except OSError as exc:
        if exc.errno == errno.ENXIO:  # a FIFO that no process reads
            raise NotAFile(name, "not a regular file") from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise NotAFile(name, "not a regular file")
    os.set_blocking(fd, True)
    return fd
