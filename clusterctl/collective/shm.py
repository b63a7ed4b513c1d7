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

The barriers are flag barriers in the window itself, not MPI barriers: each rank owns a 64-byte control
line in front of its segment and publishes a monotonically increasing epoch there (``MPI_Win_sync``
around it orders the data writes, inside a ``Lock_all`` passive epoch); waiting ranks poll the peers'
epochs (spin briefly, then yield, then back off), answering liveness pings and honouring the deadline
like every other wait (:meth:`Progress.wait_for`).  A barrier costs microseconds instead of an
``Ibarrier`` round through the progress engine.
"""

from __future__ import annotations

import bisect
import os

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


_CTRL = 64          # bytes of control line (the barrier epoch) in front of every segment
_CHUNK = 128 << 10  # bytes reduced and scaled at a time (fits in L2)


def _shm_free() -> int | None:
    """Free bytes of /dev/shm, where MPICH puts shared windows; None where there is none."""
    try:
        st = os.statvfs("/dev/shm")
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


class ShmArena:
    """A shared window with one ``capacity``-byte segment per local rank, and the allreduce over it."""

    def __init__(self, local, cross, progress, MPI, *, capacity: int):
        self.local = local
        self.cross = cross
        self.progress = progress
        self.MPI = MPI
        self.capacity = int(capacity) // 64 * 64
        # Every segment is read as ``capacity`` bytes: a rank asking for another size (another fusion
        # threshold, other gradient shapes) would fail reading the peers' segments while they wait in the
        # barrier below for ever, so all of them refuse alike first.  MPICH maps the window from a file in
        # /dev/shm without reserving it: one that does not fit is an obscure MPI error, or, when the mapping
        # succeeds, a SIGBUS on the rank that first writes past the tmpfs's end (its smallest free space on
        # any rank of the node, so that they all refuse alike).
        sizes, free = zip(*local.allgather((self.capacity, _shm_free())))
        from .errors import CollectiveError
        if len(set(sizes)) > 1:
            raise CollectiveError(f"shared-memory window: the ranks of this node asked for different sizes (bytes by "
                                  f"local rank: {list(sizes)}); fusion_threshold / "
                                  "CLUSTERCTL_COLLECTIVE_FUSION_THRESHOLD and the gradients' shapes must be the same "
                                  "on every rank")
        if None not in free and local.size * (_CTRL + self.capacity) > min(free):
            raise CollectiveError(f"shared-memory window: {local.size} local ranks x {_CTRL + self.capacity} bytes do "
                                  f"not fit in /dev/shm ({min(free)} bytes free); lower fusion_threshold / "
                                  "CLUSTERCTL_COLLECTIVE_FUSION_THRESHOLD, give the node a larger /dev/shm (docker "
                                  "--shm-size) or set CLUSTERCTL_COLLECTIVE_SHM=0")
        self.win = MPI.Win.Allocate_shared(_CTRL + self.capacity, 1, comm=local)
        self.segments = []
        self._flags = []
        for r in range(local.size):
            buf, _ = self.win.Shared_query(r)
            raw = np.frombuffer(buf, dtype=np.uint8, count=_CTRL + self.capacity)
            self._flags.append(raw[:8].view(np.int64))
            self.segments.append(raw[_CTRL:])
        self._flags[local.rank][0] = 0
        self._epoch = 0
        self.win.Lock_all(MPI.MODE_NOCHECK)       # passive epoch: Win_sync is our memory fence
        local.Barrier()                           # every flag is zeroed before anyone waits on it

    def free(self) -> None:
        """Release the window (collective over the node communicator)."""
        if self.win is not None:
            self.segments = []
            self._flags = []
            self.win.Unlock_all()
            self.win.Free()
            self.win = None

    def segment(self, dtype, count: int) -> np.ndarray:
        """This rank's segment as a ``count``-element array: data placed here is reduced without a copy-in."""
        dtype = np.dtype(dtype)
        if count * dtype.itemsize > self.capacity:
            raise ValueError(f"{count} x {dtype} does not fit the {self.capacity}-byte shared segment")
        return self.segments[self.local.rank][: count * dtype.itemsize].view(dtype)

    def _barrier(self) -> None:
        self._epoch += 1
        epoch = self._epoch
        self.win.Sync()                           # my data writes before my flag
        self._flags[self.local.rank][0] = epoch
        flags = self._flags
        self.progress.wait_for(lambda: all(f[0] >= epoch for f in flags))
        self.win.Sync()                           # the peers' writes before my reads

    def copy_plan(self, outs: list, dtype) -> list:
        """Precomputed (destination view, source view) pairs that unpack a reduced bucket into ``outs``."""
        dtype = np.dtype(dtype)
        nloc = self.local.size
        sizes = [o.size for o in outs]
        m = sum(sizes)
        segs = [s[: m * dtype.itemsize].view(dtype) for s in self.segments]
        offsets = [0]
        for sz in sizes:
            offsets.append(offsets[-1] + sz)
        pairs = []
        for j in range(nloc):
            x, y = _split(m, nloc, j)
            if y <= x:
                continue
            k = bisect.bisect_right(offsets, x) - 1
            while k < len(outs) and offsets[k] < y:
                a, b = max(x, offsets[k]), min(y, offsets[k + 1])
                if b > a:
                    pairs.append((outs[k][a - offsets[k]: b - offsets[k]], segs[j][a:b]))
                k += 1
        return pairs

    def reduce_pieces(self, ins: list, outs: list, *, average: bool, world_size: int, plan=None) -> None:
        """Fused allreduce of 1-D pieces (one dtype, together <= capacity): pack straight into the own
        segment, reduce-scatter in the window, and unpack every reduced slice straight from its owner's
        segment into ``outs`` (which may be ``ins``): one copy in, one copy out, no staging buffer.
        ``plan`` is :meth:`copy_plan` of ``outs``, computed once when the same buffers are reduced again."""
        dtype = ins[0].dtype
        m = sum(p.size for p in ins)
        me = self.local.rank
        own = self.segments[me][: m * dtype.itemsize].view(dtype)
        if len(ins) == 1:
            np.copyto(own, ins[0])
        elif m:
            np.concatenate(ins, out=own)
        self._barrier()
        segs = [s[: m * dtype.itemsize].view(dtype) for s in self.segments]
        self._reduce_slice(segs, m, average, world_size)
        self._barrier()
        for dst, src in (plan if plan is not None else self.copy_plan(outs, dtype)):
            np.copyto(dst, src)
        self._barrier()

    def _reduce_slice(self, segs, m: int, average: bool, world_size: int) -> None:
        me, nloc = self.local.rank, self.local.size
        a, b = _split(m, nloc, me)
        acc = segs[me][a:b]
        scale = average and acc.dtype.kind == "f" and b > a
        if self.cross is not None and self.cross.size > 1:
            for j in range(nloc):
                if j != me:
                    np.add(acc, segs[j][a:b], out=acc)
            if b > a:
                self.progress.wait(self.cross.Iallreduce(self.MPI.IN_PLACE, acc, self.MPI.SUM))
            if scale:
                np.multiply(acc, acc.dtype.type(1.0 / world_size), out=acc)
            return
        # One node: add the peers and scale in cache-sized chunks, so the scaling reads the sums from
        # cache instead of making one more pass over memory (the reduction is memory-bound).
        step = max(1, _CHUNK // acc.dtype.itemsize)
        inv = acc.dtype.type(1.0 / world_size)
        for lo in range(0, b - a, step):
            hi = min(b - a, lo + step)
            part = acc[lo:hi]
            for j in range(nloc):
                if j != me:
                    np.add(part, segs[j][a + lo:a + hi], out=part)
            if scale:
                np.multiply(part, inv, out=part)

    def _offset_in_own(self, a: np.ndarray) -> int:
        """Byte offset of ``a`` inside this rank's segment, or -1 when it lives elsewhere."""
        own = self.segments[self.local.rank]
        off = a.__array_interface__["data"][0] - own.__array_interface__["data"][0]
        return off if 0 <= off and off + a.nbytes <= self.capacity and a.size else -1

    def allreduce(self, src: np.ndarray, dst: np.ndarray, *, average: bool, world_size: int) -> None:
        """Sum (or average) 1-D contiguous ``src`` over all ranks into ``dst`` (may be ``src``).

        When ``src`` lives in this rank's segment (every rank at the same offset: GradientBuffer,
        the torch buckets) there is no copy in, and with ``dst is src`` each rank copies out only the
        peers' slices."""
        dtype = src.dtype
        n = src.size
        me, nloc = self.local.rank, self.local.size
        off = self._offset_in_own(src)
        if off >= 0:
            m = n
            segs = [s[off: off + m * dtype.itemsize].view(dtype) for s in self.segments]
            self._barrier()
            self._reduce_slice(segs, m, average, world_size)
            self._barrier()
            same = dst is src or self._offset_in_own(dst) == off
            for j in range(nloc):
                if same and j == me:
                    continue
                x, y = _split(m, nloc, j)
                if y > x:
                    np.copyto(dst[x:y], segs[j][x:y])
            self._barrier()
            return
        per = self.capacity // dtype.itemsize
        for lo in range(0, max(n, 1), per):
            hi = min(n, lo + per)
            m = hi - lo
            segs = [s[: m * dtype.itemsize].view(dtype) for s in self.segments]
            np.copyto(segs[me], src[lo:hi])
            self._barrier()
            self._reduce_slice(segs, m, average, world_size)
            self._barrier()
            out = dst[lo:hi]
            for j in range(nloc):
                x, y = _split(m, nloc, j)
                if y > x:
                    np.copyto(out[x:y], segs[j][x:y])
            self._barrier()
