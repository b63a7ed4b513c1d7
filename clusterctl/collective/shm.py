"""Intra-node fast path: allreduce through an MPI-3 shared-memory window.

Every local rank owns one segment of ``capacity`` bytes in a window allocated with
``Win.Allocate_shared`` on the node communicator; every rank can read every segment.  One allreduce of a
flat buffer (in chunks of at most ``capacity`` bytes) is a single-copy reduce-scatter + allgather:

1. copy the input into the own segment (skipped when the data already lives there, see
   :meth:`ShmArena.segment`), barrier;
2. rank ``i`` reduces slice ``i`` reading slice ``i`` of every peer's segment, in place into its own
   segment (for several nodes it then allreduces that slice with the same-local-rank peers of the other
   nodes over MPI: the hierarchical scheme), barrier;
3. everyone copies every reduced slice out of its owner's segment, barrier (segments may be reused).

Every rank's result is the same bytes (each slice is computed once), so replicas never drift.
"""

from __future__ import annotations

import bisect

import numpy as np

__all__ = ["ShmArena", "shm_supported"]

_ADDABLE = {np.dtype(t) for t in ("float16", "float32", "float64", "int8", "int16", "int32", "int64",
                                  "uint8", "uint16", "uint32", "uint64")}


def shm_supported(dtype) -> bool:
    """True when NumPy can reduce ``dtype`` in the window (bfloat16 and friends cannot)."""
    return np.dtype(dtype) in _ADDABLE


def _split(count: int, parts: int, i: int) -> tuple[int, int]:
    base, extra = divmod(count, parts)
    lo = i * base + min(i, extra)
    return lo, lo + base + (1 if i < extra else 0)


class ShmArena:
    """A shared window with one ``capacity``-byte segment per local rank, and the allreduce over it."""

    def __init__(self, local, cross, progress, MPI, *, capacity: int):
        self.local = local
        self.cross = cross
        self.progress = progress
        self.MPI = MPI
        self.capacity = int(capacity) // 64 * 64
        self.win = MPI.Win.Allocate_shared(self.capacity, 1, comm=local)
        self.segments = []
        for r in range(local.size):
            buf, _ = self.win.Shared_query(r)
            self.segments.append(np.frombuffer(buf, dtype=np.uint8, count=self.capacity))

    def free(self) -> None:
        """Release the window (collective over the node communicator)."""
        if self.win is not None:
            self.segments = []
            self.win.Free()
            self.win = None

    def segment(self, dtype, count: int) -> np.ndarray:
        """This rank's segment as a ``count``-element array: data placed here is reduced without a copy-in."""
        dtype = np.dtype(dtype)
        if count * dtype.itemsize > self.capacity:
            raise ValueError(f"{count} x {dtype} does not fit the {self.capacity}-byte shared segment")
        return self.segments[self.local.rank][: count * dtype.itemsize].view(dtype)

    def _barrier(self) -> None:
        self.progress.wait(self.local.Ibarrier())

    def reduce_pieces(self, ins: list, outs: list, *, average: bool, world_size: int) -> None:
        """Fused allreduce of 1-D pieces (one dtype, together <= capacity): pack straight into the own
        segment, reduce-scatter in the window, and unpack every reduced slice straight from its owner's
        segment into ``outs`` (which may be ``ins``): one copy in, one copy out, no staging buffer."""
        dtype = ins[0].dtype
        sizes = [p.size for p in ins]
        m = sum(sizes)
        me, nloc = self.local.rank, self.local.size
        segs = [s[: m * dtype.itemsize].view(dtype) for s in self.segments]
        if len(ins) == 1:
            np.copyto(segs[me], ins[0])
        elif m:
            np.concatenate(ins, out=segs[me])
        self._barrier()
        self._reduce_slice(segs, m, average, world_size)
        self._barrier()
        offsets = [0]
        for sz in sizes:
            offsets.append(offsets[-1] + sz)
        for j in range(nloc):
            x, y = _split(m, nloc, j)
            if y <= x:
                continue
            k = bisect.bisect_right(offsets, x) - 1
            src = segs[j]
            while k < len(outs) and offsets[k] < y:
                a = max(x, offsets[k])
                b = min(y, offsets[k + 1])
                if b > a:
                    np.copyto(outs[k][a - offsets[k]: b - offsets[k]], src[a:b])
                k += 1
        self._barrier()

    def _reduce_slice(self, segs, m: int, average: bool, world_size: int) -> None:
        me, nloc = self.local.rank, self.local.size
        a, b = _split(m, nloc, me)
        acc = segs[me][a:b]
        for j in range(nloc):
            if j != me:
                np.add(acc, segs[j][a:b], out=acc)
        if self.cross is not None and self.cross.size > 1 and b > a:
            self.progress.wait(self.cross.Iallreduce(self.MPI.IN_PLACE, acc, self.MPI.SUM))
        if average and acc.dtype.kind == "f" and b > a:
            np.multiply(acc, acc.dtype.type(1.0 / world_size), out=acc)

    def allreduce(self, src: np.ndarray, dst: np.ndarray, *, average: bool, world_size: int) -> None:
        """Sum (or average) 1-D contiguous ``src`` over all ranks into ``dst`` (may be ``src``)."""
        dtype = src.dtype
        per = self.capacity // dtype.itemsize
        n = src.size
        me, nloc = self.local.rank, self.local.size
        own = self.segments[me]
        in_window = (src.size > 0 and n <= per
                     and src.__array_interface__["data"][0] == own.__array_interface__["data"][0])
        for lo in range(0, max(n, 1), per):
            hi = min(n, lo + per)
            m = hi - lo
            segs = [s[: m * dtype.itemsize].view(dtype) for s in self.segments]
            if not in_window:
                np.copyto(segs[me], src[lo:hi])
            self._barrier()
            self._reduce_slice(segs, m, average, world_size)
            self._barrier()
            out = dst[lo:hi]
            same = in_window and dst.__array_interface__["data"][0] == own.__array_interface__["data"][0]
            for j in range(nloc):
                if same and j == me:
                    continue
                x, y = _split(m, nloc, j)
                if y > x:
                    np.copyto(out[x:y], segs[j][x:y])
            self._barrier()
