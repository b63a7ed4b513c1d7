"""NumPy training loops: gradients that live in fusion buffers, averaged with one fused allreduce."""

from __future__ import annotations

from typing import Callable, Mapping

import numpy as np

from ._mpi import default
from .check import agree_then, signature
from .errors import CollectiveError

__all__ = ["GradientBuffer", "DistributedOptimizer", "broadcast_parameters"]


class GradientBuffer:
    """Named gradient arrays that live in one flat buffer, in a shared-memory window of their own when
    same-node ranks exist: the main path, with no pack/unpack copies.

    ``buf.grads[name]`` are ordinary arrays (views) to write gradients into; ``buf.allreduce()``
    averages them across ranks in place.  Without the window (one rank per node, or
    CLUSTERCTL_COLLECTIVE_SHM=0) the flat buffer is ordinary memory reduced with one MPI allreduce.
    Construction is collective (every rank, same shapes and order).
    """

    def __init__(self, shapes: Mapping[str, tuple], *, dtype=np.float32, op: str = "avg", comm=None):
        if op not in ("sum", "avg"):
            raise CollectiveError(f"op={op!r}: expected 'sum' or 'avg'")
        self.comm = default(comm)
        dtype = np.dtype(dtype)
        if self.comm.check:          # other shapes on another rank: the message names them, not the window's sizes
            self.comm.call(self.comm.agree, signature(
                "GradientBuffer", [["cpu", str(dtype), str(tuple(int(d) for d in np.atleast_1d(s)))]
                                   for s in shapes.values()], names=list(shapes), op=op))
        total = sum(int(np.prod(s)) for s in shapes.values())
        self.arena = self.comm.resident_arena(total * dtype.itemsize) if total else None
        if self.arena is not None:
            flat = self.arena.segment(dtype, total)
            flat[...] = 0
        else:
            flat = np.zeros(total, dtype=dtype)
        self.flat = flat
        self.grads: dict[str, np.ndarray] = {}
        off = 0
        for name, shape in shapes.items():
            n = int(np.prod(shape))
            self.grads[name] = flat[off: off + n].reshape(shape)
            off += n
        self.op = op

    @property
    def in_window(self) -> bool:
        """True when the gradients live in the shared-memory window."""
        return self.arena is not None

    def zero(self) -> None:
        """Set every gradient to zero (in place)."""
        self.flat[...] = 0

    def allreduce(self) -> dict[str, np.ndarray]:
        """Average (or sum) every gradient across ranks in place; returns ``grads``."""
        c = self.comm
        if self.arena is not None:
            job = (c.allreduce_resident, self.arena, self.flat, self.op == "avg", "gradient buffer allreduce")
        else:
            job = (c.allreduce_flat, self.flat, self.flat, self.op == "avg", "gradient buffer allreduce")
        if c.check:                  # the agreement runs in the same job, right before the reduction
            job = (agree_then, c, signature("GradientBuffer.allreduce", [self.flat], op=self.op), *job)
        c.run(*job)
        return self.grads


class DistributedOptimizer:
    """Average a dict of NumPy gradients across ranks (fused), then call ``update(params, grads)``."""

    def __init__(self, update: Callable[[dict, dict], None], named_parameters: Mapping[str, np.ndarray],
                 *, op: str = "avg", comm=None, fusion_threshold: int | None = None):
        if not callable(update):
            raise CollectiveError("update must be callable as update(params, grads)")
        self.update = update
        self.params = dict(named_parameters)
        self.op = op
        self.comm = default(comm)
        self.fusion_threshold = fusion_threshold

    def step(self, grads: Mapping[str, np.ndarray]) -> None:
        """Allreduce ``grads`` in place (same names on every rank) and apply ``update``."""
        names = sorted(self.params)
        missing = [n for n in names if n not in grads]
        if missing:
            raise CollectiveError(f"no gradient for parameter(s): {', '.join(missing)}")
        from .ops import grouped_allreduce
        grouped_allreduce([grads[n] for n in names], self.op, inplace=True, comm=self.comm,
                          threshold=self.fusion_threshold)
        self.update(self.params, {n: grads[n] for n in names})


def broadcast_parameters(params: Mapping[str, np.ndarray], root: int = 0, *, comm=None) -> None:
    """Overwrite every rank's arrays with ``root``'s values, in sorted name order."""
    from .ops import broadcast
    for name in sorted(params):
        broadcast(params[name], root, comm=comm)
