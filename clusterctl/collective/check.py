"""The opt-in per-call argument check (``init(check=True)`` or ``CLUSTERCTL_COLLECTIVE_CHECK=1``).

Without it, ranks that pass different things to one collective get a silently wrong answer, garbage, or a hang
until the deadline (docs/collective.md, "Argument check").  With it, every collective first agrees on a compact
*signature* of its call (the collective, its reduction op and other parameters, each buffer's device kind, dtype
and shape, and whether this rank refused its input): one ``Iallreduce`` of two int64 (the MIN of a 64-bit
fingerprint and of its complement, so every rank learns whether min == max).  Only on a mismatch do the ranks
exchange the signatures themselves, and then every rank raises the same one-line :class:`CollectiveError`:

    allreduce: ranks disagree: rank 0 float32 (1000,), rank 1 float32 (999,)

torch's ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` is the model.  The formatting here is pure (unit-tested without MPI);
:meth:`Communicator.agree <clusterctl.collective._mpi.Communicator.agree>` makes the exchange.
"""

from __future__ import annotations

import hashlib
import json
import operator
import sys

import numpy as np

__all__ = ["CHECK_ENV", "MAX_GROUPS", "describe", "signature", "encode", "fingerprint", "disagreement", "agreed",
           "agree_then"]

CHECK_ENV = "CLUSTERCTL_COLLECTIVE_CHECK"

#: Rank groups (ranks that passed the same) named in one message, and whose signatures are exchanged; the rest are
#: counted. So a mismatch moves at most this many signatures to every rank, however many ranks there are.
MAX_GROUPS = 8
_MAX_REFUSAL = 200         # characters of a rank's own refusal quoted in the message
_DTYPE_NAMES: dict = {}    # NumPy dtype -> str(dtype), which takes microseconds each time


def _dtype_name(dtype) -> str:
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype)
    return name


def describe(x) -> list:
    """``[device kind, dtype, shape]`` of a buffer as plain strings; anything else by its type name (the call
    refuses it after the check)."""
    if isinstance(x, np.ndarray):
        return ["cpu", _dtype_name(x.dtype), str(x.shape)]
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(x, torch.Tensor):
        try:
            shape = str(tuple(x.shape))
        except RuntimeError:                  # nested tensors have no single shape
            shape = "(nested)"
        return [x.device.type, str(x.dtype).removeprefix("torch."), shape]
    cupy = sys.modules.get("cupy")
    if cupy is not None and isinstance(x, cupy.ndarray):
        return ["cuda", _dtype_name(x.dtype), str(tuple(x.shape))]
    t = type(x)
    return [f"{t.__module__}.{t.__qualname__}", "", ""]


def _plain(value):
    """A parameter as a JSON value that compares equal when the call means the same (64e6 == 64000000)."""
    if value is None or isinstance(value, (bool, str, int)):
        return value
    if isinstance(value, float):
        return int(value) if value.is_integer() else repr(value)
    try:
        return operator.index(value)          # NumPy integers
    except TypeError:
        return repr(value)


def signature(collective: str, buffers=(), *, names=None, **params) -> dict:
    """What this rank passes to ``collective``: its parameters (in the order given) and ``buffers`` (arrays, or
    ready ``describe()`` lists). ``names`` (e.g. parameter names) only label the message; they are not compared."""
    sig = {"collective": collective, "params": [[k, _plain(v)] for k, v in params.items()],
           "tensors": [b if isinstance(b, list) else describe(b) for b in buffers], "refused": None}
    if names is not None:
        sig["names"] = [str(n) for n in names]
    return sig


def encode(sig: dict) -> bytes:
    """The compared part of a signature (``names`` left out) as bytes: the repr of JSON values, which is the same in
    every process (and faster than json.dumps)."""
    return repr((sig["collective"], sig["params"], sig["tensors"], sig["refused"])).encode()


def fingerprint(data: bytes) -> int:
    """A 64-bit signed fingerprint of ``data`` (the same on every rank; Python's ``hash`` is salted per process)."""
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little", signed=True)


def _ranks(ranks: list[int]) -> str:
    """``rank 3`` or ``ranks 0-2,5``."""
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    parts, lo = [], ranks[0]
    for prev, cur in zip(ranks, ranks[1:] + [None]):
        if cur != prev + 1:
            parts.append(str(lo) if lo == prev else f"{lo}-{prev}")
            lo = cur
    return "ranks " + ",".join(parts)


def _tensor(t: list, with_kind: bool) -> str:
    kind, dtype, shape = t
    if not dtype and not shape:               # not an array at all
        return kind
    return " ".join(p for p in ((kind if with_kind else ""), dtype, shape) if p)


def _count(n: int) -> str:
    return f"{n} tensor" + ("" if n == 1 else "s")


def _full(sig: dict) -> str:
    """Everything a rank passed, for ranks that are not even in the same collective."""
    parts = [sig["collective"]]
    parts += [f"{k}={v!r}" for k, v in sig["params"] if v is not None]
    ts = sig["tensors"]
    if len(ts) == 1:
        parts.append(_tensor(ts[0], ts[0][0] != "cpu"))
    elif ts:
        parts.append(_count(len(ts)))
    if sig["refused"] is not None:
        parts.append(f"(refused: {sig['refused'][:_MAX_REFUSAL]})")
    return " ".join(parts)


def disagreement(sigs: list, hidden: int = 0) -> str:
    """The one-line message every rank raises when the ranks' signatures (``sigs[r]`` is rank r's) differ: the
    ranks grouped by what they passed, showing only what differs. ``None`` for a rank whose signature was not
    exchanged; ``hidden`` counts the groups of those ranks."""
    ranks = [r for r, s in enumerate(sigs) if s is not None]
    sigs = [sigs[r] for r in ranks]
    names = {s["collective"] for s in sigs}
    if len(names) > 1:
        head, views = "ranks disagree on the collective", [_full(s) for s in sigs]
    else:
        head = f"{sigs[0]['collective']}: ranks disagree"
        keys = list(dict.fromkeys(k for s in sigs for k, _ in s["params"]))
        values = [dict((k, v) for k, v in s["params"]) for s in sigs]
        differ = [k for k in keys if len({json.dumps(v.get(k)) for v in values}) > 1]
        parts = [[f"{k}={v.get(k)!r}" for k in differ] for v in values]
        counts = [len(s["tensors"]) for s in sigs]
        if len(set(counts)) > 1:
            for p, n in zip(parts, counts):
                p.append(_count(n))
        else:
            n = counts[0]
            at = [i for i in range(n) if len({json.dumps(s["tensors"][i]) for s in sigs}) > 1]
            if at:
                i = at[0]
                if n > 1:
                    label = sigs[0].get("names")
                    head += f" on tensor {i}" + (f" ({label[i]})" if label and i < len(label) else "")
                    if len(at) > 1:
                        head += f" (and {len(at) - 1} more)"
                kinds = len({s["tensors"][i][0] for s in sigs}) > 1
                for p, s in zip(parts, sigs):
                    p.append(_tensor(s["tensors"][i], kinds))
        if len({s["refused"] for s in sigs}) > 1:
            for p, s in zip(parts, sigs):
                if s["refused"] is not None:
                    p.append(f"(refused: {s['refused'][:_MAX_REFUSAL]})")
                elif not p:
                    p.append("(accepted its input)")
        views = [" ".join(p) for p in parts]
        if len(set(views)) < 2:               # nothing above tells them apart: say everything
            views = [_full(s) for s in sigs]
    groups: dict[str, list[int]] = {}
    for r, v in zip(ranks, views):
        groups.setdefault(v, []).append(r)
    shown = [f"{_ranks(rs)} {v}" for v, rs in list(groups.items())[:MAX_GROUPS]]
    more = max(0, len(groups) - MAX_GROUPS) + hidden
    if more:
        shown.append(f"and {more} more group" + ("" if more == 1 else "s"))
    return f"{head}: {', '.join(shown)}"


def agreed(c, sig: dict, validate, *args, defer: bool = False):
    """``validate(*args)`` (this rank's own checks, no MPI call), then agree with the other ranks on ``sig`` and on
    whether ``validate`` refused, then return its result or raise its error.  A call that some ranks refuse and
    others accept thus raises on all of them, instead of leaving the accepting ones in the collective.

    ``defer``: when ``validate`` accepts, return at once; the caller agrees with :func:`agree_then` on the worker
    thread, in the job of the collective itself (no extra hand-off between threads; an async call raises at wait())."""
    try:
        result = validate(*args)
    except Exception as e:                    # re-raised below, after the ranks have agreed
        c.call(c.agree, {**sig, "refused": str(e).split("\n", 1)[0] or type(e).__name__})
        raise
    if not defer:
        c.call(c.agree, sig)
    return result


def agree_then(c, sig: dict, fn, *args):
    """(Worker thread.) Agree on ``sig`` with the other ranks, then run the collective ``fn(*args)``."""
    c.agree(sig)
    return fn(*args)
