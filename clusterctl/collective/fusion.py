"""Tensor fusion: many small buffers packed into fusion buffers and reduced together.

Buffers are taken in the order given (every rank must pass the same shapes and dtypes in the same order),
grouped by dtype into buckets of at most ``threshold`` bytes (one buffer larger than the threshold is a
bucket of its own).  Buckets run on the communicator's worker thread with non-blocking collectives
(``Iallreduce`` polled against the deadline), so the caller keeps computing, and packing bucket k+1
overlaps reducing bucket k.  With the shared-memory window a bucket is packed straight into the window
and unpacked straight out of the peers' segments (one copy each way).

CUDA tensors are fused on the device: those of one device and floating dtype are concatenated into device
buckets (one kernel), and each bucket is reduced as one tensor (handed to a CUDA-aware MPI, or staged
through pinned host memory in one copy each way instead of one per tensor), then split back.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import numpy as np

from ._mpi import check_threshold
from .buffers import OPS, TORCH_REDUCIBLE, check_writable, prepare, reduce_one
from .errors import CollectiveError
from .shm import shm_supported

__all__ = ["Bucket", "plan_buckets", "FusedAllreduce", "fused_for"]


@dataclass(frozen=True)
class Bucket:
    """Indices of the buffers fused together, their dtype and total element count."""

    indices: tuple[int, ...]
    dtype: np.dtype
    count: int


def plan_buckets(sizes: list[int], dtypes: list, threshold: int) -> list[Bucket]:
    """Pure bucketing: consecutive same-dtype buffers up to ``threshold`` bytes per bucket, order kept."""
    buckets: list[Bucket] = []
    open_: dict[str, tuple[list[int], int]] = {}
    order: list[str] = []
    for i, (n, dt) in enumerate(zip(sizes, dtypes)):
        dt = np.dtype(dt)
        key = dt.str
        nbytes = n * dt.itemsize
        idx, count = open_.get(key, ([], 0))
        if idx and (count + n) * dt.itemsize > threshold:
            buckets.append(Bucket(tuple(idx), dt, count))
            order.remove(key)
            idx, count = [], 0
        idx.append(i)
        count += n
        open_[key] = (idx, count)
        if key not in order:
            order.append(key)
        if nbytes >= threshold:
            buckets.append(Bucket(tuple(idx), dt, count))
            order.remove(key)
            open_.pop(key)
    for key in order:
        idx, count = open_[key]
        buckets.append(Bucket(tuple(idx), np.dtype(key), count))
    return buckets


_PLANS: dict[tuple, list[Bucket]] = {}   # same shapes every training step: plan once


def _host_view(x):
    """1-D contiguous NumPy view of a host buffer that can be fused, else None."""
    if isinstance(x, np.ndarray):
        if x.flags.c_contiguous and x.dtype.kind in "fiu" and x.dtype.isnative:
            return x.reshape(-1)
        return None
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(x, torch.Tensor):
        if (x.device.type != "cpu" or x.layout != torch.strided or x.is_nested or not x.is_contiguous()
                or str(x.dtype) not in TORCH_REDUCIBLE or x.dtype == torch.bfloat16):
            return None       # the single-buffer path copies what it can and refuses the rest
        return x.detach().reshape(-1).numpy()
    return None


def _torch():
    return sys.modules["torch"]


def _device_buckets(xs: list, threshold: int) -> list[list[int]]:
    """Indices of the CUDA tensors that can share a device bucket (contiguous, floating, not bf16 — which is
    reduced in float32 —, same device and dtype), in order, in buckets of at most ``threshold`` bytes; a
    bucket of one tensor is left to the single-tensor path."""
    torch = sys.modules.get("torch")
    if torch is None:
        return []
    groups: dict[tuple, list[int]] = {}
    for i, x in enumerate(xs):
        if (isinstance(x, torch.Tensor) and x.is_cuda and x.is_contiguous() and not x.is_sparse
                and x.dtype in (torch.float32, torch.float64, torch.float16)):
            groups.setdefault((x.device, x.dtype), []).append(i)
    buckets = []
    for idx in groups.values():
        cur: list[int] = []
        nbytes = 0
        for i in idx:
            n = xs[i].numel() * xs[i].element_size()
            if cur and nbytes + n > max(threshold, 1):
                buckets.append(cur)
                cur, nbytes = [], 0
            cur.append(i)
            nbytes += n
        buckets.append(cur)
    return [b for b in buckets if len(b) > 1]


def _empty_like(x):
    if isinstance(x, np.ndarray):
        out = np.empty(x.shape, dtype=x.dtype)
        return out, out.reshape(-1)
    import torch
    out = torch.empty(x.shape, dtype=x.dtype)
    return out, out.reshape(-1).numpy()


class FusedAllreduce:
    """One fused allreduce of a list of buffers; reusable (keeps its fusion buffers) for repeated calls."""

    def __init__(self, xs: list, *, op: str = "sum", comm, threshold: int | None = None,
                 compression: str | None = None):
        if op not in OPS:
            raise CollectiveError(f"op={op!r}: expected one of {', '.join(OPS)}")
        self.comm = comm
        self.op = op
        self.compression = compression
        self.threshold = comm.fusion_threshold if threshold is None else check_threshold("threshold", threshold)
        if comm.arena is not None:
            self.threshold = min(max(self.threshold, 1), comm.arena.capacity)
        self.xs = xs
        views = [_host_view(x) for x in xs]
        int_avg = [op == "avg" and v is not None and v.dtype.kind in "iu" for v in views]
        self.fusable = [i for i, v in enumerate(views)
                        if v is not None and not int_avg[i] and compression is None]
        self.device_buckets = _device_buckets(xs, self.threshold) if compression is None else []
        taken = set(self.fusable).union(*self.device_buckets)
        self.single = [i for i in range(len(xs)) if i not in taken]
        self.views = views
        key = (tuple(views[i].size for i in self.fusable), tuple(views[i].dtype.str for i in self.fusable),
               max(self.threshold, 1))
        self.buckets = _PLANS.get(key)
        if self.buckets is None:
            if len(_PLANS) > 64:
                _PLANS.clear()
            self.buckets = _PLANS[key] = plan_buckets(list(key[0]), list(key[1]), key[2])
        self._buffers: dict[int, np.ndarray] = {}
        self._copy_plans: dict[int, list] = {}

    def _buffer(self, k: int, dtype, count: int) -> np.ndarray:
        buf = self._buffers.get(k)
        if buf is None or buf.dtype != dtype or buf.size < count:
            buf = np.empty(count, dtype=dtype)
            self._buffers[k] = buf
        return buf[:count]

    def _reduce_bucket(self, ins: list, outs: list, buf, plan=None) -> None:
        c = self.comm
        avg = self.op == "avg"
        if c.size == 1:
            for a, b in zip(ins, outs):
                if a is not b:
                    np.copyto(b, a)
            return
        fits = c.arena is not None and sum(a.size for a in ins) * ins[0].itemsize <= c.arena.capacity
        if fits and shm_supported(ins[0].dtype):
            c.progress.check()
            c.progress.seq += 1
            c.progress.what = f"fused allreduce ({len(ins)} buffers)"
            c.arena.reduce_pieces(ins, outs, average=avg, world_size=c.size, plan=plan)
            return
        if len(ins) == 1:                 # one big buffer: no packing (the window path chunks it)
            c.allreduce_flat(ins[0], outs[0], avg, "fused allreduce")
            return
        np.concatenate(ins, out=buf)
        c.allreduce_flat(buf, buf, avg, f"fused allreduce ({len(ins)} buffers)")
        offset = 0
        for o in outs:
            np.copyto(o, buf[offset: offset + o.size])
            offset += o.size

    def prepare_singles(self, *, inplace: bool = False) -> list:
        """This rank's checks of every buffer, and the unfusable ones prepared: (index, Prepared) pairs. No MPI call."""
        c = self.comm
        if inplace:
            for x in self.xs:
                check_writable(x)
        return [(i, prepare(self.xs[i], self.op, self.xs[i] if inplace else None, c.size, self.compression, c))
                for i in self.single]

    def start(self, *, inplace: bool = False, prepared: list | None = None):
        """Submit every bucket (and unfusable buffer) to the worker; returns (results, futures).
        ``prepared``: what :meth:`prepare_singles` returned, when the caller ran it already."""
        c = self.comm
        # Check and prepare the unfusable buffers first: a buffer that cannot be reduced raises here, before
        # any bucket is submitted (not after the earlier buckets were reduced in place).
        if prepared is None:
            prepared = self.prepare_singles(inplace=inplace)
        results = list(self.xs) if inplace else [None] * len(self.xs)
        futures = []
        fusable = self.fusable
        for k, b in enumerate(self.buckets):
            ins, outs = [], []
            for j in b.indices:
                i = fusable[j]
                ins.append(self.views[i])
                if inplace:
                    outs.append(self.views[i])
                else:
                    res, flat = _empty_like(self.xs[i])
                    results[i] = res
                    outs.append(flat)
            buf = None if (c.arena is not None or len(ins) == 1) else self._buffer(k, b.dtype, b.count)
            plan = None
            if inplace and c.arena is not None and b.count * b.dtype.itemsize <= c.arena.capacity:
                plan = self._copy_plans.get(k)      # the same buffers every step: unpack views made once
                if plan is None:
                    plan = self._copy_plans[k] = c.arena.copy_plan(outs, b.dtype)
            futures.append(c.submit(self._reduce_bucket, ins, outs, buf, plan))
        for idx in self.device_buckets:
            futures.append(self._start_device_bucket(idx, results, inplace))
        singles = [(i, c.submit(reduce_one, c, p, self.op, "allreduce")) for i, p in prepared]
        return results, futures, singles

    def _start_device_bucket(self, idx: list[int], results: list, inplace: bool):
        """Concatenate CUDA tensors ``idx`` into one device buffer, reduce it as one tensor on the worker, then
        copy the pieces back (``inplace``) or hand out views of it as the results."""
        c = self.comm
        parts = [self.xs[i] for i in idx]
        if c.size == 1:  # the sum (and the average) of one rank: the tensors themselves, no copy to the host
            for i, x in zip(idx, parts):
                if not inplace:
                    results[i] = x.detach().clone()
            return c.submit(lambda: None)
        flat = _torch().cat([x.detach().reshape(-1) for x in parts])
        prepared = prepare(flat, self.op, flat, c.size, None, c)
        sizes = [x.numel() for x in parts]

        def reduce_and_split():
            reduce_one(c, prepared, self.op, f"fused allreduce ({len(parts)} CUDA tensors)")
            for i, x, piece in zip(idx, parts, flat.split(sizes)):
                if inplace:
                    x.detach().copy_(piece.view(x.shape))
                else:
                    results[i] = piece.view(x.shape)
        return c.submit(reduce_and_split)

    def run(self, *, inplace: bool = False, prepared: list | None = None) -> list:
        """Reduce every buffer and return the results in input order (the inputs when ``inplace``)."""
        results, futures, singles = self.start(inplace=inplace, prepared=prepared)
        for f in futures:
            f.result()
        for i, f in singles:
            results[i] = f.result()
        return results


_FUSED: dict[tuple, "FusedAllreduce"] = {}


def fused_for(xs: list, *, op: str, comm, threshold: int | None, compression: str | None) -> FusedAllreduce:
    """The FusedAllreduce for these very buffers, reused across calls (a training loop passes the same
    gradient arrays every step), so views, bucket plans and unpack plans are built once.  The last four
    buffer lists stay referenced by the cache."""
    key = (tuple(map(id, xs)), op, threshold, compression, id(comm))
    fused = _FUSED.get(key)
    if fused is not None and len(fused.xs) == len(xs) and all(a is b for a, b in zip(fused.xs, xs)):
        return fused
    fused = FusedAllreduce(xs, op=op, comm=comm, threshold=threshold, compression=compression)
    if len(_FUSED) >= 4:
        _FUSED.pop(next(iter(_FUSED)))
    _FUSED[key] = fused
    return fused
