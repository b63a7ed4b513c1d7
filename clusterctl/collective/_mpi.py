"""Initialisation and the per-communicator engine (topology, shared window, worker thread, timeouts).

``init()`` works in two situations:

* under ``mpiexec`` (or ``srun``/any MPI launcher): the world communicator is ``MPI.COMM_WORLD``;
* under ``clusterctl start`` with the ssh launcher (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT but no
  MPI launcher): :mod:`clusterctl.collective.rendezvous` first starts/joins a PMI-1 server on
  MASTER_ADDR:MASTER_PORT so ``MPI_Init`` gives all ranks one world (see docs/collective.md).
"""

from __future__ import annotations

import atexit
import json
import logging
import math
import operator
import os
import threading
import zlib
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from .check import CHECK_ENV, MAX_GROUPS, disagreement, encode, fingerprint
from .errors import CollectiveError

__all__ = ["Communicator", "init", "finalize", "is_initialized", "default", "get_mpi",
           "TIMEOUT_ENV", "ON_TIMEOUT_ENV", "FUSION_ENV", "SHM_ENV", "CHECK_ENV", "DEFAULT_FUSION_THRESHOLD",
           "DEFAULT_TIMEOUT"]

log = logging.getLogger("clusterctl.collective")

TIMEOUT_ENV = "CLUSTERCTL_COLLECTIVE_TIMEOUT"
ON_TIMEOUT_ENV = "CLUSTERCTL_COLLECTIVE_ON_TIMEOUT"
FUSION_ENV = "CLUSTERCTL_COLLECTIVE_FUSION_THRESHOLD"
SHM_ENV = "CLUSTERCTL_COLLECTIVE_SHM"

DEFAULT_TIMEOUT = 300.0
#: Chosen from benchmarks/allreduce.py (docs/benchmarks.md, "Collective allreduce (issue 5)").
DEFAULT_FUSION_THRESHOLD = 8 * 1024 * 1024

_lock = threading.Lock()
_default: "Communicator | None" = None
_finalized = False                   # finalize() ran: nothing but an explicit init() makes a communicator again
# init(comm=X): the communicators made over each user communicator, by their settings, the last one used last.
# The entry holds X itself, so that its id() is not reused while the entry lives.
_wrapped: dict[int, tuple[object, dict[tuple, "Communicator"]]] = {}
_retired: list["Communicator"] = []


def get_mpi(timeout: float | None = None):
    """Import and return ``mpi4py.MPI``, initialising MPI; without an MPI launcher the PMI rendezvous runs first."""
    from . import rendezvous
    if timeout is None:
        timeout = _env_float(TIMEOUT_ENV, DEFAULT_TIMEOUT)
    rendezvous.prepare_environment(timeout=timeout)
    from mpi4py import MPI
    if not MPI.Is_initialized():             # the user set mpi4py.rc.initialize = False
        MPI.Init_thread(MPI.THREAD_MULTIPLE)
        atexit.register(_finalize_mpi, MPI)
    return MPI


def _finalize_mpi(MPI) -> None:
    if MPI.Is_initialized() and not MPI.Is_finalized():
        MPI.Finalize()


def _env_float(name: str, default: float) -> float:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise CollectiveError(f"{name}={raw!r}: expected a number of seconds") from None
    if not 0 < value < math.inf:             # nan, inf: a deadline that never comes
        raise CollectiveError(f"{name}={raw!r}: must be a positive, finite number of seconds")
    return value


def check_timeout(timeout) -> float:
    """``timeout=`` as float seconds: positive and finite (every wait is bounded by it), else CollectiveError."""
    try:
        value = float(timeout)
    except (TypeError, ValueError):
        raise CollectiveError(f"timeout={timeout!r}: expected a number of seconds") from None
    if not 0 < value < math.inf:
        raise CollectiveError(f"timeout={timeout!r}: must be positive, finite seconds")
    return value


def check_on_timeout(value: str) -> str:
    """``on_timeout=``: 'abort' or 'raise', else CollectiveError."""
    if value not in ("abort", "raise"):
        raise CollectiveError(f"on_timeout={value!r}: expected 'abort' or 'raise'")
    return value


def as_index(value) -> int:
    """``value`` as an int (ints and NumPy integers, not bools); TypeError otherwise."""
    if isinstance(value, bool):
        raise TypeError(f"{value!r} is a bool")
    return operator.index(value)


def check_threshold(name: str, value) -> int:
    """A fusion threshold argument: a whole number of bytes (an int, or a float such as 64e6 with no fraction),
    not negative (0: no fusion), else CollectiveError."""
    given = value
    if isinstance(value, float) and value.is_integer():  # finite and whole: 64e6
        value = int(value)
    try:
        value = as_index(value)
    except TypeError:
        raise CollectiveError(f"{name}={given!r}: expected a whole number of bytes (an int)") from None
    if value < 0:
        raise CollectiveError(f"{name}={given!r}: must not be negative")
    return value


def _env_size(name: str, default: int) -> int:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    mult = units.get(raw[-1].lower(), 1)
    digits = raw[:-1] if raw[-1].lower() in units else raw
    try:
        value = int(float(digits) * mult)
    except (ValueError, OverflowError):
        raise CollectiveError(f"{name}={raw!r}: expected bytes, e.g. 33554432 or 32M") from None
    if value < 0:
        raise CollectiveError(f"{name}={raw!r}: must not be negative")
    return value


def _env_bool(name: str, default: bool) -> bool:
    raw = os.environ.get(name, "").strip().lower()
    if not raw:
        return default
    if raw in ("1", "true", "yes", "on"):
        return True
    if raw in ("0", "false", "no", "off"):
        return False
    raise CollectiveError(f"{name}={raw!r}: expected 0 or 1")


def _env_choice(name: str, choices: tuple[str, ...], default: str) -> str:
    """A variable naming one of ``choices``, any case (unset or blank: ``default``); else CollectiveError naming it."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    if raw.lower() not in choices:
        raise CollectiveError(f"{name}={raw!r}: expected {' or '.join(map(repr, choices))} (any case)")
    return raw.lower()


def _settings(timeout, on_timeout, fusion_threshold, shm, check) -> tuple:
    """A communicator's settings, each given one checked and each one left out from its variable or default:
    (timeout, on_timeout, fusion_threshold, shm, check)."""
    return (check_timeout(timeout) if timeout is not None else _env_float(TIMEOUT_ENV, DEFAULT_TIMEOUT),
            check_on_timeout(on_timeout) if on_timeout else _env_choice(ON_TIMEOUT_ENV, ("abort", "raise"), "abort"),
            (check_threshold("fusion_threshold", fusion_threshold)
             if fusion_threshold is not None else _env_size(FUSION_ENV, DEFAULT_FUSION_THRESHOLD)),
            _env_bool(SHM_ENV, True) if shm is None else bool(shm),
            # the per-call argument check (check.py): off by default, when the collectives make no extra call
            _env_bool(CHECK_ENV, False) if check is None else bool(check))


class Communicator:
    """An MPI intracommunicator plus everything the collectives need: topology, shm window, timeouts."""

    def __init__(self, comm, *, timeout: float | None = None, on_timeout: str | None = None,
                 fusion_threshold: int | None = None, shm: bool | None = None, check: bool | None = None):
        MPI = get_mpi(timeout)
        self.MPI = MPI
        self.timeout, self.on_timeout, self.fusion_threshold, shm, self.check = _settings(
            timeout, on_timeout, fusion_threshold, shm, check)
        from .topology import discover
        from ._progress import RequestPoller
        self.comm = comm.Dup()
        self.comm.Set_errhandler(MPI.ERRORS_RETURN)
        self.ctl = comm.Dup()
        self.topo, self.local, self.cross = discover(self.comm, MPI)
        self.progress = RequestPoller(self.ctl, self.topo, MPI, timeout=self.timeout, on_timeout=self.on_timeout)
        self.shm = shm                                                       # asked for; uses_shm: got
        # Hierarchical slices need equal ranks per node; otherwise fall back to MPI for everything.
        self.arena = None
        if self.shm and self.topo.local_size > 1 and self.topo.homogeneous:
            from .shm import ShmArena
            capacity = max(self.fusion_threshold, 1 << 20)
            self.arena = ShmArena(self.local, self.cross if self.topo.node_count > 1 else None,
                                  self.progress, MPI, capacity=capacity)
        self._residents: list = []
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="clusterctl-collective")
        self._pending = 0                     # work submitted to the worker thread and not finished
        self._pending_lock = threading.Lock()
        self._closed = False
        path = "shared-memory window" if self.arena else "MPI"
        log.debug("collective ready: rank %d/%d local %d/%d nodes %d via %s", self.topo.rank,
                  self.topo.size, self.topo.local_rank, self.topo.local_size, self.topo.node_count, path)

    # -- properties --------------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        """Rank of this process."""
        return self.topo.rank

    @property
    def size(self) -> int:
        """Number of processes."""
        return self.topo.size

    @property
    def uses_shm(self) -> bool:
        """True when same-node ranks reduce through the shared-memory window."""
        return self.arena is not None

    # -- execution ---------------------------------------------------------------------------------
    def submit(self, fn, *args) -> Future:
        """Run ``fn(*args)`` on the communicator's single worker thread (keeps collective order)."""
        if self._closed:
            raise CollectiveError("communicator already finalized")
        self.progress.check()
        with self._pending_lock:
            self._pending += 1
        fut = self._pool.submit(fn, *args)
        fut.add_done_callback(self._finished)
        return fut

    def _finished(self, _fut) -> None:
        with self._pending_lock:
            self._pending -= 1

    def run(self, fn, *args):
        """Run ``fn(*args)`` on the worker thread and wait for its result."""
        return self.submit(fn, *args).result()

    def call(self, fn, *args):
        """Run ``fn(*args)`` on the calling thread when the worker is idle (else behind its queue), and
        return the result: no thread hand-off, for callers that would wait at once anyway."""
        if self._closed:
            raise CollectiveError("communicator already finalized")
        self.progress.check()
        with self._pending_lock:
            idle = self._pending == 0
        if not idle:
            return self.run(fn, *args)
        return fn(*args)

    # -- flat kernels (worker thread only) -----------------------------------------------------------
    def allreduce_flat(self, src: np.ndarray, dst: np.ndarray, average: bool, what: str = "allreduce") -> None:
        """Sum/average 1-D contiguous host ``src`` into ``dst`` (``dst`` may be ``src``)."""
        from .shm import shm_supported
        self.progress.check()
        self.progress.seq += 1
        self.progress.what = what
        MPI = self.MPI
        if self.size == 1:
            if dst is not src:
                np.copyto(dst, src)
            return
        if self.arena is not None and shm_supported(src.dtype):
            self.arena.allreduce(src, dst, average=average, world_size=self.size)
            return
        sendbuf = MPI.IN_PLACE if dst is src else src
        self.progress.wait(self.comm.Iallreduce(sendbuf, dst, MPI.SUM))
        if average and dst.dtype.kind == "f":
            np.multiply(dst, dst.dtype.type(1.0 / self.size), out=dst)

    def resident_arena(self, nbytes: int):
        """A dedicated shared window of ``nbytes`` per local rank for buffers that live in it (gradients);
        None without the shared-memory path. Collective over the node's ranks."""
        if self.arena is None:
            return None
        from .shm import ShmArena
        arena = self.run(lambda: ShmArena(self.local, self.cross if self.topo.node_count > 1 else None,
                                          self.progress, self.MPI, capacity=max(64, -(-int(nbytes) // 64) * 64)))
        self._residents.append(arena)
        return arena

    def allreduce_resident(self, arena, flat: np.ndarray, average: bool, what: str) -> None:
        """Sum/average in place a 1-D buffer that lives in ``arena`` (worker thread only)."""
        self.progress.check()
        self.progress.seq += 1
        self.progress.what = what
        if self.size > 1:
            arena.allreduce(flat, flat, average=average, world_size=self.size)

    def allreduce_device(self, buf, what: str = "allreduce") -> None:
        """Sum a device buffer in place handing it straight to a CUDA-aware MPI."""
        self.progress.check()
        self.progress.seq += 1
        self.progress.what = what
        self.progress.wait(self.comm.Iallreduce(self.MPI.IN_PLACE, buf, self.MPI.SUM))

    def bcast_flat(self, buf, root: int, what: str = "broadcast") -> None:
        """Broadcast a buffer (host array or CUDA-aware device buffer) from ``root``."""
        self.progress.check()
        self.progress.seq += 1
        self.progress.what = what
        if self.size > 1:
            self.progress.wait(self.comm.Ibcast(buf, root=root))

    def agree(self, sig: dict) -> None:
        """With the argument check on: make sure every rank passes the same signature (check.signature) to the
        collective about to run, else raise the same one-line CollectiveError on every rank (worker thread, or
        the caller's via :meth:`call`). One Iallreduce of 16 bytes; the signatures travel only on a mismatch."""
        self.progress.check()
        if self.size == 1:
            return
        self.progress.seq += 1
        self.progress.what = f"argument check of {sig['collective']}"
        MPI = self.MPI
        h = fingerprint(encode(sig))
        span = np.array([h, ~h], dtype=np.int64)           # MIN of both: the smallest and (~) the largest
        self.progress.wait(self.comm.Iallreduce(MPI.IN_PLACE, span, MPI.MIN))
        if int(span[0]) == ~int(span[1]):
            return
        # They differ: every rank learns every fingerprint, then the first rank of each of the first MAX_GROUPS
        # groups sends its signature (at most MAX_GROUPS signatures travel, however many ranks there are).
        fps = np.empty(self.size, dtype=np.int64)
        self.progress.wait(self.comm.Iallgather(np.array([h], dtype=np.int64), fps))
        first: dict[int, int] = {}
        for r, fp in enumerate(fps.tolist()):
            first.setdefault(fp, r)
        senders = sorted(first.values())[:MAX_GROUPS]
        mine = (json.dumps(sig, separators=(",", ":")).encode() if self.rank in senders else b"")
        sizes = np.zeros(self.size, dtype=np.int64)
        self.progress.wait(self.comm.Iallgather(np.array([len(mine)], dtype=np.int64), sizes))
        offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]])
        everyone = np.empty(int(sizes.sum()), dtype=np.uint8)
        self.progress.wait(self.comm.Iallgatherv(np.frombuffer(mine, dtype=np.uint8),
                                                 [everyone, (sizes.tolist(), offsets.tolist()), MPI.BYTE]))
        sent = {int(fps[r]): json.loads(everyone[offsets[r]: offsets[r] + sizes[r]].tobytes()) for r in senders}
        sigs = [sent.get(fp) for fp in fps.tolist()]
        raise CollectiveError(disagreement(sigs, hidden=len(first) - len(senders)))

    def barrier_flat(self) -> None:
        """Deadline-bounded barrier."""
        self.progress.check()
        self.progress.seq += 1
        self.progress.what = "barrier"
        if self.size > 1:
            self.progress.wait(self.comm.Ibarrier())

    def close(self) -> None:
        """Stop the worker thread and free the window and communicators (collective)."""
        if self._closed:
            return
        self._closed = True
        self._pool.shutdown(wait=True)
        if self.progress.broken is not None:
            return  # peers are gone; freeing collectively would hang
        self.progress.close()
        for arena in self._residents:
            arena.free()
        if self.arena is not None:
            self.arena.free()
        for c in (self.cross, self.local, self.ctl, self.comm):
            c.Free()


def init(*, comm=None, timeout: float | None = None, on_timeout: str | None = None,
         fusion_threshold: int | None = None, shm: bool | None = None, check: bool | None = None) -> Communicator:
    """Initialise the collective backend and return the default :class:`Communicator` (or one wrapping ``comm``).

    Again, without ``comm``: the same communicator when every setting given equals its own (a setting left out
    keeps it), else CollectiveError naming the ones that differ. After :func:`finalize` it starts afresh.
    With ``comm``: one communicator per settings over it, made on the first call and returned again by the next
    ones; the ranks agree on that first (collective, as making one is)."""
    global _default, _finalized
    with _lock:
        if timeout is not None:
            timeout = check_timeout(timeout)
        if on_timeout:
            check_on_timeout(on_timeout)
        if fusion_threshold is not None:
            fusion_threshold = check_threshold("fusion_threshold", fusion_threshold)
        if _default is not None and comm is None:
            asked = {"timeout": timeout, "on_timeout": on_timeout or None, "fusion_threshold": fusion_threshold,
                     "shm": None if shm is None else bool(shm), "check": None if check is None else bool(check)}
            differ = [k for k, v in asked.items() if v is not None and v != getattr(_default, k)]
            if differ:
                raise CollectiveError(f"init({', '.join(f'{k}={asked[k]!r}' for k in differ)}): already initialised "
                                      f"with {', '.join(f'{k}={getattr(_default, k)!r}' for k in differ)}; "
                                      "call finalize() first to change it")
            return _default
        MPI = get_mpi(timeout)
        if comm is None:
            from .rendezvous import check_world
            check_world(MPI)
            _default = Communicator(MPI.COMM_WORLD, timeout=timeout, on_timeout=on_timeout,
                                    fusion_threshold=fusion_threshold, shm=shm, check=check)
            _finalized = False
            return _default
        # Over a communicator of the user's: one Communicator per settings, made once (each holds duplicates of
        # the communicator, a worker thread and maybe a shared window: a new one per call would leak them all).
        key = _settings(timeout, on_timeout, fusion_threshold, shm, check)
        entry = _wrapped.get(id(comm))
        if entry is None or entry[0] is not comm:
            entry = _wrapped[id(comm)] = (comm, {})
        made = entry[1]
        c = made.pop(key, None)
        reuse = c is not None and not c._closed
        if comm.Get_size() > 1:
            # Only when every rank can: a rank that asked for other settings (or closed its own) makes a new one,
            # and so must the ranks that could reuse theirs, or it would wait in MPI_Comm_dup for ever.
            mine = np.array([zlib.crc32(repr(key).encode()), reuse], dtype=np.int64)
            everyone = np.empty((comm.Get_size(), 2), dtype=np.int64)
            comm.Allgather(mine, everyone)
            reuse = reuse and bool((everyone == mine).all())
        if not reuse:
            if c is not None and not c._closed:
                _retired.append(c)            # this rank's, not reused this time: finalize() still frees it
            c = Communicator(comm, timeout=timeout, on_timeout=on_timeout,
                             fusion_threshold=fusion_threshold, shm=shm, check=check)
        made[key] = c                         # last: the one a collective's comm=X means
        return c


def is_initialized() -> bool:
    """True once :func:`init` has created the default communicator."""
    return _default is not None


def default(comm=None) -> Communicator:
    """Resolve ``comm=``: None -> the default (initialised on first use), a Communicator, or an mpi4py comm."""
    if comm is None:
        if _default is not None:
            return _default
        _check_not_finalized()
        return init()
    if isinstance(comm, Communicator):
        return comm
    entry = _wrapped.get(id(comm))
    if entry is not None and entry[0] is comm:
        c = next(reversed(entry[1].values()), None)
        if c is not None and not c._closed:
            return c
    _check_not_finalized()
    return init(comm=comm)


def _check_not_finalized() -> None:
    """After finalize() a collective must not make a new communicator silently: every rank raises, no MPI call."""
    if _finalized:
        raise CollectiveError("the collective backend was finalized: call init() again first if a new communicator "
                              "is intended")


def finalize() -> None:
    """Release the default communicator's resources (collective); MPI itself is finalized at exit.
    Collectives then raise CollectiveError until :func:`init` is called again."""
    global _default, _finalized
    with _lock:
        _finalized = True
        for c in [c for _comm, made in _wrapped.values() for c in made.values()] + _retired:
            c.close()
        _wrapped.clear()
        _retired.clear()
        if _default is not None:
            _default.close()
            _default = None
