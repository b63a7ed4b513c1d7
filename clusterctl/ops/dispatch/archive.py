"""What travels to a host: the framed header of its update (small updates' content inside it) and the tar
archive of changed files (whole, or their changed blocks), built once per change set and streamed to many
hosts while it is still being written."""

from __future__ import annotations

import io
import os
import tarfile
import tempfile
import threading
from collections.abc import Iterator, Mapping

from ...errors import JobError
from ...host import wire
from .delta import CHUNK, Patch, changed, patch_bytes, read_scanned
from .plan import HostPlan
from .scan import LocalFile

__all__ = ["Archive", "update_bytes", "read_whole"]


def read_whole(f: LocalFile) -> bytes:
    """The content of `f`, which must still be the file it was scanned as (delta.read_scanned)."""
    with read_scanned(f.source, f.size) as fh:
        data = fh.read(f.size + 1)
    if len(data) != f.size:
        raise changed(f.source)
    return data


def update_bytes(plan: HostPlan, files: Mapping[str, LocalFile]) -> bytes:
    """The framed header of `plan` as `apply` reads it; for an inline plan, with the content of its files."""
    patches = {rel: wire.patch(plan.manifest[rel], p.block, p.ranges,
                               patch_bytes(files[rel].source, files[rel].size, p) if plan.inline else None)
               for rel, p in plan.patches.items()}
    return wire.frame_header(wire.header(
        gen=plan.gen, base=plan.base, check=plan.check,
        changes={rel: plan.manifest[rel] for rel in plan.whole}, patches=patches, delete=plan.delete,
        archive=bool(plan.whole or plan.patches) and not plan.inline,
        inline={rel: read_whole(files[rel]) for rel in plan.whole} if plan.inline else None,
    ))


class Archive:
    """A tar archive of changed files (whole, or their changed blocks), streamed to many hosts while it is
    still being written.

    A background thread writes it into an unlinked temporary file; each host's stream reads, with
    positional reads (`os.pread`: no shared file offset), whatever has been written so far.
    """

    def __init__(self, files: Mapping[str, LocalFile], changed: list[str], patches: Mapping[str, Patch] | None = None):
        patches = patches or {}
        items = sorted([(rel, None) for rel in changed] + list(patches.items()))
        self._fh = tempfile.TemporaryFile()
        self._cond = threading.Condition()
        self._written = 0
        self._done = not items  # deletions only: no archive at all
        self._error: BaseException | None = None
        self._cancelled = False
        if items:
            threading.Thread(target=self._build, args=(files, items), daemon=True).start()

    def _build(self, files: Mapping[str, LocalFile], items: list[tuple[str, Patch | None]]) -> None:
        try:
            with tarfile.open(fileobj=self, mode="w|", format=tarfile.PAX_FORMAT, bufsize=CHUNK) as tar:
                for rel, patch in items:
                    if self._cancelled:
                        break
                    f = files[rel]
                    info = tarfile.TarInfo(rel)
                    info.mode, info.mtime = f.mode, f.mtime
                    if patch is not None:
                        data = patch_bytes(f.source, f.size, patch)
                        info.size = len(data)
                        tar.addfile(info, io.BytesIO(data))
                        continue
                    info.size = f.size
                    with read_scanned(f.source, f.size) as fh:
                        tar.addfile(info, fh)
        except (OSError, JobError) as exc:  # e.g. a file changed since the scan: every stream fails with it
            self._error = exc
        with self._cond:
            self._done = True
            self._cond.notify_all()

    def write(self, data: bytes) -> int:
        """tarfile's sink: append, then wake the readers."""
        self._fh.write(data)
        self._fh.flush()
        with self._cond:
            self._written += len(data)
            self._cond.notify_all()
        return len(data)

    @property
    def size(self) -> int:
        """Bytes written so far (the whole archive once it is complete)."""
        return self._written

    def stream(self, header: bytes) -> Iterator[bytes]:
        """The header, then the archive in blocks of up to 1 MiB as they become available."""
        yield header
        fd, offset = self._fh.fileno(), 0
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._written > offset or self._done)
                if isinstance(self._error, JobError):
                    raise self._error
                if self._error is not None:
                    raise OSError(f"building the archive failed: {self._error}")
                available = self._written
            if offset >= available:
                return  # done, and everything was sent
            block = os.pread(fd, min(CHUNK, available - offset), offset)
            offset += len(block)
            yield block

    def wait(self) -> None:
        """Block until the archive is complete (or its building stopped)."""
        with self._cond:
            self._cond.wait_for(lambda: self._done)

    def close(self) -> None:
        """Stop building (no host reads the rest: e.g. each replied that our record of it was stale)."""
        self._cancelled = True
        self.wait()
        self._fh.close()
