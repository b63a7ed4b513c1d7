"""PyTorch integration: a DistributedOptimizer that allreduces gradients in buckets during backward."""

from __future__ import annotations

import zlib
from concurrent.futures import Future

import numpy as np
import torch as _torch

from ._mpi import check_threshold, default
from .buffers import TORCH_REDUCIBLE
from .check import agree_then, signature
from .errors import CollectiveError
from .fusion import plan_buckets

__all__ = ["DistributedOptimizer", "broadcast_parameters", "broadcast_optimizer_state", "OVERLAP_ENV"]

#: ``1`` (default): reduce buckets on the worker thread, overlapping backward; ``0``: on the thread
#: that runs backward, inside the hook.
OVERLAP_ENV = "CLUSTERCTL_COLLECTIVE_OVERLAP"


def broadcast_parameters(params, root: int = 0, *, comm=None) -> None:
    """Copy ``root``'s values into every rank's tensors: a state_dict, named_parameters() or a list."""
    from .ops import broadcast
    if isinstance(params, dict):
        items = sorted(params.items())
    else:
        items = list(params)
        if items and isinstance(items[0], tuple):
            items = sorted(items)
        else:
            items = list(enumerate(items))
    for _, t in items:
        if isinstance(t, _torch.Tensor):
            broadcast(t, root, comm=comm)


def broadcast_optimizer_state(optimizer, root: int = 0, *, comm=None) -> None:
    """Make every rank's optimizer state (and hyper-parameters) equal to ``root``'s."""
    from .ops import broadcast_object
    state = broadcast_object(optimizer.state_dict(), root, comm=comm)
    optimizer.load_state_dict(state)


def _choose_overlap(overlap, comm) -> bool:
    """Explicit ``overlap``, else the environment, else True (the worker thread).

    Reducing inline in the hook was meant for one core per rank (the worker thread then only
    time-slices with backward), but on the 2-core machine it measured no faster than the worker
    thread (docs/benchmarks.md, "Training step"), so overlapping stays the default everywhere.
    """
    if overlap is not None:
        return bool(overlap)
    from ._mpi import _env_bool
    return _env_bool(OVERLAP_ENV, True)


class _Bucket:
    __slots__ = ("params", "flat", "host", "views", "ready", "handle")

    def __init__(self, params, dtype, storage=None):
        total = sum(p.numel() for p in params)
        self.params = params
        if storage is not None:               # a slice of the shared window (NumPy view)
            self.host = storage
            self.flat = _torch.from_numpy(storage)
            self.flat.zero_()
        else:
            self.host = None
            self.flat = _torch.zeros(total, dtype=dtype)
        self.views = []
        off = 0
        for p in params:
            self.views.append(self.flat[off: off + p.numel()].view(p.shape))
            off += p.numel()
        self.ready = 0
        self.handle = None


class DistributedOptimizer:
    """Wrap ``optimizer`` so gradients are averaged across ranks, overlapping backward (Horovod-style).

    Every ``.grad`` is a view into a flat fusion bucket (``fusion_threshold`` bytes; the buckets live
    in a shared-memory window when same-node ranks exist), so autograd accumulates straight into the
    buckets: no copy in, no copy back (DDP's ``gradient_as_bucket_view``).  A per-parameter
    post-accumulate hook counts ready gradients; a bucket starts its non-blocking allreduce as soon as
    it is full and every earlier bucket has started (the same order on every rank).  ``step()`` waits
    for the buckets and runs the wrapped optimizer.  ``zero_grad()`` zeroes in place.
    """

    def __init__(self, optimizer, named_parameters=None, *, op: str = "avg", comm=None,
                 fusion_threshold: int | None = None, compression: str | None = None,
                 backward_passes_per_step: int = 1, overlap: bool | None = None):
        if op not in ("sum", "avg"):
            raise CollectiveError(f"op={op!r}: expected 'sum' or 'avg'")
        if backward_passes_per_step != 1:
            raise CollectiveError("backward_passes_per_step != 1 is not supported yet")
        if compression not in (None, "fp16", "bf16"):
            raise CollectiveError(f"compression={compression!r}: expected None, 'fp16' or 'bf16'")
        self.optimizer = optimizer
        self.comm = default(comm)
        self.overlap = _choose_overlap(overlap, self.comm)
        self.op = op
        self.compression = compression
        optimized = [p for g in optimizer.param_groups for p in g["params"]]
        if named_parameters is None:
            named = [(f"param.{i}", p) for i, p in enumerate(optimized)]
        else:
            named = list(named_parameters)
            if not all(isinstance(item, tuple) and len(item) == 2 and isinstance(item[1], _torch.Tensor)
                       for item in named):
                raise CollectiveError("named_parameters must be (name, tensor) pairs, e.g. model.named_parameters()")
        names = [n for n, _ in named]
        if len(set(names)) != len(names):
            raise CollectiveError("named_parameters has duplicate names")
        params, seen = [], set()
        for _, p in named:          # a tensor listed twice (tied weights) is one gradient, reduced once
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                params.append(p)
        unnamed = sum(1 for p in optimized if p.requires_grad and id(p) not in seen)
        if unnamed:
            raise CollectiveError(f"{unnamed} parameter(s) of the optimizer are not in named_parameters: "
                                  "their gradients would not be averaged across ranks")
        for p in params:
            if p.is_cuda or p.is_sparse:
                raise CollectiveError("DistributedOptimizer buckets are CPU-only for now; "
                                      "use allreduce() per tensor for CUDA parameters")
            if str(p.dtype) not in TORCH_REDUCIBLE:
                raise CollectiveError(f"cannot allreduce gradients of dtype {p.dtype}")
        threshold = (self.comm.fusion_threshold if fusion_threshold is None
                     else check_threshold("fusion_threshold", fusion_threshold))
        # Gradients become ready roughly in reverse registration order: bucket in that order.
        order = list(reversed(params))
        plan = plan_buckets([p.numel() for p in order],
                            [_torch.empty(0, dtype=p.dtype).numpy().dtype
                             if p.dtype != _torch.bfloat16 else "float32" for p in order],
                            max(threshold, 1))
        if self.comm.check:          # names the first parameter that differs (the check below only says that one does)
            names_of = {id(p): n for n, p in reversed(named)}
            self.comm.call(self.comm.agree, signature(
                "DistributedOptimizer", params, names=[names_of[id(p)] for p in params], op=op,
                compression=compression, fusion_threshold=threshold))
        self._check_same_on_every_rank(order, plan)
        self._known = seen
        # Buckets live in a shared-memory window of their own when same-node ranks exist (and
        # .grad are views into them, like DDP's gradient_as_bucket_view): no copies in or out.
        self._arena = None
        storages = [None] * len(plan)
        from .shm import shm_supported
        resident = [k for k, b in enumerate(plan) if shm_supported(b.dtype)] if compression is None else []
        if resident:
            aligned = [-(-plan[k].count * plan[k].dtype.itemsize // 64) * 64 for k in resident]
            self._arena = self.comm.resident_arena(sum(aligned))
        if self._arena is not None:
            seg = self._arena.segments[self._arena.local.rank]
            off = 0
            for k, nbytes in zip(resident, aligned):
                b = plan[k]
                storages[k] = seg[off: off + b.count * b.dtype.itemsize].view(b.dtype)
                off += nbytes
        self._buckets = [_Bucket([order[i] for i in b.indices], order[b.indices[0]].dtype, storages[k])
                         for k, b in enumerate(plan)]
        self._where = {}
        for bi, b in enumerate(self._buckets):
            for pi, p in enumerate(b.params):
                self._where[p] = (bi, pi)
        self._next = 0
        for b in self._buckets:
            for p, v in zip(b.params, b.views):
                if p.grad is not None:
                    v.copy_(p.grad.detach())
                p.grad = v
        self._hooks = [p.register_post_accumulate_grad_hook(self._hook) for p in params]

    def _check_same_on_every_rank(self, order, plan) -> None:
        """One small broadcast and one allreduce at construction: every rank must bucket the same parameters
        (count, shapes, dtypes, order), op and threshold, else the bucket allreduces would mix unrelated
        gradients or hang on different sizes. Every rank raises, not only the odd one out."""
        c = self.comm
        if c.size == 1:
            return
        layout = repr((self.op, self.compression, [(tuple(p.shape), str(p.dtype)) for p in order],
                       [(b.count, b.dtype.str) for b in plan]))
        mine = np.array([len(order), sum(p.numel() for p in order), zlib.crc32(layout.encode())], dtype=np.int64)
        root = mine.copy()
        c.run(c.bcast_flat, root, 0, "DistributedOptimizer parameter check")
        odd = np.array([int(not np.array_equal(mine, root))], dtype=np.int64)
        c.run(c.allreduce_flat, odd, odd, False, "DistributedOptimizer parameter check")
        if odd[0]:
            here = (f"rank {c.rank} has {mine[0]} parameter tensor(s) ({mine[1]} elements), rank 0 has {root[0]} "
                    f"({root[1]} elements)" if not np.array_equal(mine, root) else
                    f"{odd[0]} rank(s) differ from rank 0")
            raise CollectiveError(f"DistributedOptimizer: the ranks' parameters differ ({here}; shapes, dtypes, "
                                  "order, op, compression and fusion_threshold must be the same on every rank)")

    # optimizer facade
    @property
    def param_groups(self):
        """The wrapped optimizer's parameter groups."""
        return self.optimizer.param_groups

    @property
    def state(self):
        """The wrapped optimizer's state."""
        return self.optimizer.state

    def state_dict(self):
        """The wrapped optimizer's state_dict."""
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict) -> None:
        """Load into the wrapped optimizer."""
        self.optimizer.load_state_dict(state_dict)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset the gradients: ``set_to_none`` (default) drops them, else zeroes the buckets in place.

        With ``None``, autograd hands each parameter a fresh gradient and the hook copies it into
        the bucket once (one read, one write); zeroing would cost a write of every bucket and then
        an in-place add by autograd (two reads, one write). Either way ``.grad`` is a bucket view
        again after backward.
        """
        for b in self._buckets:
            if set_to_none:
                for p in b.params:
                    p.grad = None
                continue
            b.flat.zero_()
            for p, v in zip(b.params, b.views):
                if p.grad is None or p.grad.data_ptr() != v.data_ptr():
                    p.grad = v

    # hooks and launching
    def _hook(self, p) -> None:
        bi, pi = self._where[p]
        b = self._buckets[bi]
        v = b.views[pi]
        if p.grad.data_ptr() != v.data_ptr():    # autograd replaced .grad (e.g. set to None by the user)
            v.copy_(p.grad.detach())
            p.grad = v
        b.ready += 1
        self._launch_ready()

    def _launch(self, b) -> None:
        from .ops import Handle, allreduce, allreduce_async
        c = self.comm
        if b.host is not None:
            job = (c.allreduce_resident, self._arena, b.host, self.op == "avg",
                   f"gradient bucket ({len(b.params)} tensors)")
            if c.check:               # agreed in the same job, right before the reduction (the other path: in allreduce)
                job = (agree_then, c, signature("gradient bucket", [b.host], op=self.op), *job)
        if not self.overlap:              # reduce now, on this thread (no hand-off, no time-slicing)
            if b.host is not None:
                c.call(*job)
            else:
                allreduce(b.flat, self.op, out=b.flat, comm=c, compression=self.compression)
            done = Future()
            done.set_result(None)
            b.handle = Handle(done)
        elif b.host is not None:
            b.handle = Handle(c.submit(*job))
        else:
            b.handle = allreduce_async(b.flat, self.op, out=b.flat, comm=c, compression=self.compression)

    def _launch_ready(self) -> None:
        while self._next < len(self._buckets):
            b = self._buckets[self._next]
            if b.ready < len(b.params):
                return
            self._launch(b)
            self._next += 1

    def synchronize(self) -> None:
        """Finish every bucket's allreduce and write the results into ``.grad``."""
        while self._next < len(self._buckets):
            b = self._buckets[self._next]
            # Parameters without a gradient this step (unused) contribute zeros, like DDP.
            for pi, p in enumerate(b.params):
                if p.grad is None:
                    b.views[pi].zero_()
                    p.grad = b.views[pi]
            self._launch(b)
            self._next += 1
        for b in self._buckets:
            b.handle.wait()
            for p, v in zip(b.params, b.views):
                if p.grad is None or p.grad.data_ptr() != v.data_ptr():
                    p.grad = v
            b.ready = 0
            b.handle = None
        self._next = 0

    def step(self, closure=None):
        """Average gradients across ranks, then take the wrapped optimizer's step."""
        self.synchronize()
        added = sum(1 for g in self.optimizer.param_groups for p in g["params"]
                    if p.grad is not None and id(p) not in self._known)
        if added:
            raise CollectiveError(f"{added} parameter(s) with a gradient were added to the optimizer (or started "
                                  "requiring grad) after DistributedOptimizer wrapped it: their gradients are not "
                                  "averaged across ranks; wrap the optimizer again")
        return self.optimizer.step(closure) if closure is not None else self.optimizer.step()

    def remove_hooks(self) -> None:
        """Detach the gradient hooks (the wrapped optimizer keeps working locally)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
