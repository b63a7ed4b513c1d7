"""Block digests and deltas: a changed file travels as its changed fixed-size blocks when this controller
hashed the blocks of the content the host has (the previous scan's), and that saves at least half."""

from __future__ import annotations

import hashlib
import os
import stat
from contextlib import contextmanager
from dataclasses import dataclass

from ...errors import JobError
from ...host import wire

__all__ = ["BLOCK", "MAX_BLOCKS", "DIGEST", "CHUNK", "block_size", "hash_file", "Patch", "delta", "patch_bytes",
           "read_scanned", "changed"]

CHUNK = 1 << 20  # read and stream in pieces of up to 1 MiB
BLOCK = 4096  # smallest delta block; files get at most MAX_BLOCKS blocks (bigger ones, bigger blocks)
MAX_BLOCKS = 1024
DIGEST = 8  # bytes of sha256 kept per block (16 hex characters)


def block_size(size: int) -> int:
    """Delta block size for a file of `size` bytes: 4 KiB, doubled until the file has <= 1024 blocks."""
    bs = BLOCK
    while bs * MAX_BLOCKS < size:
        bs *= 2
    return bs


def changed(path: str) -> JobError:
    """The error of a workspace file that is no longer what the scan saw."""
    return JobError(f"{path} changed while being dispatched; dispatch again")


@contextmanager
def read_scanned(path: str, size: int):
    """The file scanned at `path` (a regular file of `size` bytes), open for reading; `changed(path)` unless it still
    is one, and unless it stayed as it was (size and mtime) while the block read it. Nothing that took its
    place since the scan is read: a symlink is not followed (a file outside the workspace), a FIFO not waited on."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:  # removed (ENOENT), a symlink now (ELOOP), no longer readable
        raise changed(path) from None
    with os.fdopen(fd, "rb") as fh:
        before = os.fstat(fd)
        if not stat.S_ISREG(before.st_mode) or before.st_size != size:
            raise changed(path)

        def same() -> bool:
            after = os.fstat(fd)
            return (after.st_size, after.st_mtime_ns) == (before.st_size, before.st_mtime_ns)

        try:
            yield fh
        except OSError:  # cut shorter while read (tarfile: "unexpected end of data"), or not the file's (disk full)
            if same():
                raise
            raise changed(path) from None
        if not same():
            raise changed(path)


def hash_file(path: str, size: int) -> tuple[str, str]:
    """The file's sha256, and its per-block digests (hex) when it has more than one block."""
    h = hashlib.sha256()
    bs = block_size(size)
    parts: list[bytes] = []
    with read_scanned(path, size) as fh:
        while block := fh.read(max(CHUNK, bs)):
            h.update(block)
            if size > bs:
                view = memoryview(block)
                parts.extend(hashlib.sha256(view[i : i + bs]).digest()[:DIGEST] for i in range(0, len(view), bs))
    return h.hexdigest(), b"".join(parts).hex()


@dataclass(frozen=True)
class Patch:
    """A changed file sent as its changed blocks: `ranges` of block indices, `payload` bytes of them."""

    base: str  # sha256 of the content the host has, which the other blocks are copied from
    block: int
    ranges: tuple[tuple[int, int], ...]
    payload: int


def delta(size: int, blocks: str, previous: tuple[str, str] | None, base: dict | None) -> Patch | None:
    """The blocks of a file (`size` bytes, block digests `blocks`) that differ from the host's content
    `base` (its manifest entry), when that content is `previous` (sha256, block digests: what this
    controller hashed at its previous scan) and sending the changed blocks saves at least half of the file."""
    if base is None or previous is None or previous[0] != base[wire.ENTRY_SHA256] or not blocks:
        return None
    bs = block_size(size)
    if block_size(base[wire.ENTRY_SIZE]) != bs:
        return None
    width = 2 * DIGEST
    new, old = blocks, previous[1]
    changed = [i for i in range(len(new) // width) if new[i * width : (i + 1) * width] != old[i * width : (i + 1) * width]]
    payload = sum(min(bs, size - i * bs) for i in changed)
    if payload * 2 > size:
        return None
    ranges: list[list[int]] = []
    for i in changed:
        if ranges and ranges[-1][0] + ranges[-1][1] == i:
            ranges[-1][1] += 1
        else:
            ranges.append([i, 1])
    return Patch(base[wire.ENTRY_SHA256], bs, tuple((a, n) for a, n in ranges), payload)


def patch_bytes(source: str, size: int, patch: Patch) -> bytes:
    """The changed blocks of the file at `source` (`size` bytes), back to back, as the host's apply_patch reads them."""
    out = []
    with read_scanned(source, size) as fh:
        for first, count in patch.ranges:
            start = first * patch.block
            out.append(os.pread(fh.fileno(), min(count * patch.block, size - start), start))
    return b"".join(out)
