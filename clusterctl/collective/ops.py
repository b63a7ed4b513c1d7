"""Stdlib-shaped collectives: allreduce, broadcast, barrier, and their non-blocking / grouped forms."""

from __future__ import annotations

from concurrent.futures import Future

import numpy as np

from ._mpi import as_index, default
from .buffers import check_torch, check_writable, kind_of, prepare, reduce_one
from .check import agree_then, agreed, signature
from .errors import CollectiveError

__all__ = ["Handle", "allreduce", "allreduce_async", "grouped_allreduce", "broadcast",
           "broadcast_object", "barrier"]


class Handle:
    """A pending collective: ``wait()`` returns its result, ``done()`` polls."""

    def __init__(self, future: Future):
        self._future = future

    def done(self) -> bool:
        """True once the collective has completed (or failed)."""
        return self._future.done()

    def wait(self):
        """Block until the collective completes (bounded by the communicator's timeout); return the result."""
        return self._future.result()


def allreduce_async(x, op: str = "sum", *, out=None, comm=None, compression: str | None = None) -> Handle:
    """Start an allreduce of ``x`` on the communicator's worker thread; returns a :class:`Handle`."""
    c = default(comm)
    if c.check:    # the ranks agree on what they pass, on the worker right before the reduction
        sig = signature("allreduce", [x], op=op, compression=compression)
        prepared = agreed(c, sig, prepare, x, op, out, c.size, compression, c, defer=True)
        return Handle(c.submit(agree_then, c, sig, reduce_one, c, prepared, op, "allreduce"))
    prepared = prepare(x, op, out, c.size, compression, c)
    return Handle(c.submit(reduce_one, c, prepared, op, "allreduce"))


def allreduce(x, op: str = "sum", *, out=None, comm=None, compression: str | None = None):
    """Sum or average ``x`` over all ranks; ``out=x`` reduces in place. Returns the result."""
    return allreduce_async(x, op, out=out, comm=comm, compression=compression).wait()


def grouped_allreduce(xs, op: str = "sum", *, inplace: bool = False, comm=None,
                      threshold: int | None = None, compression: str | None = None) -> list:
    """Allreduce many buffers at once, fused into buckets of at most ``threshold`` bytes."""
    from .fusion import fused_for
    c = default(comm)
    xs = list(xs)
    if not c.check:
        return fused_for(xs, op=op, comm=c, threshold=threshold, compression=compression).run(inplace=inplace)

    def validate():
        fused = fused_for(xs, op=op, comm=c, threshold=threshold, compression=compression)
        return fused, fused.prepare_singles(inplace=inplace)
    sig = signature("grouped_allreduce", xs, op=op, compression=compression,
                    threshold=c.fusion_threshold if threshold is None else threshold)
    fused, prepared = agreed(c, sig, validate)
    return fused.run(inplace=inplace, prepared=prepared)


def _check_root(root, c) -> int:
    """``root`` as a rank of ``c``: an int in range on every rank (checked before any MPI call)."""
    try:
        root = as_index(root)
    except TypeError:
        raise CollectiveError(f"root={root!r}: expected an int rank") from None
    if not 0 <= root < c.size:
        raise CollectiveError(f"root={root} out of range for {c.size} rank(s)")
    return root


def _check_broadcast(x, root, c) -> tuple[int, str]:
    """``root`` as a rank and ``x``'s kind, or CollectiveError. Every rank checks what only the receivers would trip
    over, so all of them raise alike (a root that went on would leave the others one collective behind)."""
    root = _check_root(root, c)
    kind = kind_of(x)
    if kind in ("numpy", "cupy"):
        check_writable(x)
        if x.dtype.hasobject:
            raise CollectiveError(f"cannot broadcast dtype {x.dtype}: it holds Python object pointers")
    else:
        check_torch(x)
    return root, kind


def broadcast(x, root: int = 0, *, comm=None):
    """Overwrite ``x`` on every rank with ``root``'s values (in place); returns ``x``."""
    c = default(comm)
    if c.check:
        root, kind = agreed(c, signature("broadcast", [x], root=root), _check_broadcast, x, root, c)
    else:
        root, kind = _check_broadcast(x, root, c)
    if kind == "numpy":
        # Sent as bytes: any fixed-size dtype (bool, big-endian, datetime, structured) goes through.
        tmp = x if x.flags.c_contiguous else np.ascontiguousarray(x)
        c.run(c.bcast_flat, tmp.reshape(-1).view(np.uint8), root)
        if tmp is not x:
            x[...] = tmp
        return x
    if kind == "torch":
        t = x.detach()
        import torch
        tmp = t.contiguous()
        c.run(c.bcast_flat, tmp.reshape(-1).view(torch.uint8).numpy(), root)
        if tmp.data_ptr() != t.data_ptr():
            t.copy_(tmp)
        return x
    # device buffers: straight to a CUDA-aware MPI, else through host memory
    from .cuda import cuda_aware, note_staging
    if cuda_aware(c):
        if kind == "torch-cuda":
            import torch
            torch.cuda.current_stream(x.device).synchronize()
            buf = x.detach().contiguous()
        else:
            import cupy
            cupy.cuda.get_current_stream().synchronize()
            buf = cupy.ascontiguousarray(x)
        c.run(c.bcast_flat, buf, root)
        if buf is not x and kind == "cupy":
            x[...] = buf
        elif kind == "torch-cuda" and buf.data_ptr() != x.data_ptr():
            x.detach().copy_(buf)
        return x
    note_staging(c)
    if kind == "torch-cuda":
        import torch
        host = x.detach().to("cpu").contiguous()
        c.run(c.bcast_flat, host.reshape(-1).view(torch.uint8).numpy(), root)
        x.detach().copy_(host)
        return x
    host = x.get()
    c.run(c.bcast_flat, np.ascontiguousarray(host).reshape(-1), root)
    x.set(host)
    return x


def broadcast_object(obj, root: int = 0, *, comm=None):
    """Broadcast any picklable object from ``root`` and return it on every rank."""
    import pickle
    c = default(comm)
    if c.check:
        root = agreed(c, signature("broadcast_object", root=root), _check_root, root, c)
    else:
        root = _check_root(root, c)
    data, error = None, None
    if c.rank == root:
        try:
            data = np.frombuffer(pickle.dumps(obj), dtype=np.uint8)
        except Exception as e:               # unpicklable: tell the other ranks (size -1) instead of leaving them waiting
            error = e
    n = np.array([data.size if data is not None else -1], dtype=np.int64)
    c.run(c.bcast_flat, n, root)
    if n[0] < 0:
        raise CollectiveError(f"broadcast_object: rank {root} could not pickle its object"
                              + (f" ({type(error).__name__}: {error})" if error is not None else "")) from error
    buf = data.copy() if data is not None else np.empty(int(n[0]), dtype=np.uint8)
    c.run(c.bcast_flat, buf, root)
    return pickle.loads(buf.tobytes())


def barrier(*, comm=None) -> None:
    """Wait until every rank arrives (bounded by the communicator's timeout)."""
    c = default(comm)
    if c.check:
        c.run(agree_then, c, signature("barrier"), c.barrier_flat)
        return
    c.run(c.barrier_flat)
