"""NumPy training loops: gradients that live in fusion buffers, averaged with one fused allreduce."""

from __future__ import annotations

from typing import Callable, Mapping

import numpy as np

from ._mpi import default
from .errors import CollectiveError
from .fusion import FusedAllreduce

__all__ = ["GradientBuffer", "DistributedOptimizer", "broadcast_parameters"]


class GradientBuffer:
    """Named gradient arrays allocated inside the shared-memory window when it fits (no copy-in).

    ``buf.grads[name]`` are ordinary arrays to write gradients into; ``buf.allreduce()`` averages them
    across ranks in place.  When the window is not available (one rank per node, or too large) they
    are ordinary arrays and the fused allreduce packs them.
    """

    def __init__(self, shapes: Mapping[str, tuple], *, dtype=np.float32, op: str = "avg", comm=None):
        self.comm = default(comm)
        dtype = np.dtype(dtype)
        total = sum(int(np.prod(s)) for s in shapes.values())
        arena = self.comm.arena
        if arena is not None and total * dtype.itemsize <= arena.capacity:
            # Lives in the window: each allreduce reduces straight from here.
            flat = arena.segment(dtype, total)
            flat[...] = 0
            self._in_window = True
        else:
            flat = np.zeros(total, dtype=dtype)
            self._in_window = False
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
        return self._in_window

    def allreduce(self) -> dict[str, np.ndarray]:
        """Average (or sum) every gradient across ranks in place; returns ``grads``."""
        c = self.comm
        c.run(c.allreduce_flat, self.flat, self.flat, self.op == "avg", "gradient buffer allreduce")
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
        arrays = [grads[n] for n in names]
        FusedAllreduce(arrays, op=self.op, comm=self.comm, threshold=self.fusion_threshold).run(inplace=True)
        self.update(self.params, {n: grads[n] for n in names})


def broadcast_parameters(params: Mapping[str, np.ndarray], root: int = 0, *, comm=None) -> None:
    """Overwrite every rank's arrays with ``root``'s values, in sorted name order."""
    from .ops import broadcast
    for name in sorted(params):
        broadcast(params[name], root, comm=comm)
