"""CUDA-aware MPI detection and pinned-host staging for device buffers (CuPy and PyTorch CUDA)."""

from __future__ import annotations

import ctypes
import logging
import os

__all__ = ["CUDA_AWARE_ENV", "cuda_aware", "detect_cuda_aware", "note_staging"]

log = logging.getLogger("clusterctl.collective")

#: Override detection: "1" forces device buffers straight to MPI, "0" forces pinned-host staging.
CUDA_AWARE_ENV = "CLUSTERCTL_COLLECTIVE_CUDA_AWARE"


def _loaded_libmpi() -> list[str]:
    paths = []
    try:
        with open("/proc/self/maps", encoding="utf-8") as maps:
            for line in maps:
                path = line.rsplit(None, 1)[-1]
                name = os.path.basename(path)
                if name.startswith("libmpi") and ".so" in name and path not in paths:
                    paths.append(path)
    except OSError:
        log.debug("cannot read /proc/self/maps; skipping MPIX_Query_cuda_support", exc_info=True)
    return paths


def _library_cuda_support(comm, MPI) -> tuple[bool, str]:
    """Whether the MPI library says it accepts CUDA device buffers at all; returns (answer, how it said so)."""
    # 1. MPI-4.1: the communicator's info lists the memory kinds the library supports.
    try:
        info = comm.Get_info()
        kinds = info.Get("mpi_memory_alloc_kinds") or ""
        info.Free()
        if "cuda" in kinds.lower():
            return True, f"mpi_memory_alloc_kinds={kinds}"
    except MPI.Exception:
        kinds = ""
    # 2. MPIX_Query_cuda_support (MPICH >= 4, Open MPI's mpi-ext), looked up in the loaded libmpi.
    for path in _loaded_libmpi():
        try:
            fn = getattr(ctypes.CDLL(path), "MPIX_Query_cuda_support")
        except (OSError, AttributeError):
            continue
        fn.restype = ctypes.c_int
        if fn():
            return True, f"MPIX_Query_cuda_support() = 1 in {os.path.basename(path)}"
        return False, f"MPIX_Query_cuda_support() = 0 in {os.path.basename(path)}"
    return False, f"no cuda memory kind (mpi_memory_alloc_kinds={kinds or 'unset'})"


def _vendor(MPI) -> str:
    try:
        return MPI.get_vendor()[0]
    except (AttributeError, TypeError, IndexError):
        return "Open MPI" if "Open MPI" in MPI.Get_library_version() else ""


def detect_cuda_aware(comm, MPI) -> tuple[bool, str]:
    """Whether device buffers may go straight to this package's collectives; returns (answer, why).

    Every collective here is non-blocking (``Iallreduce``/``Ibcast`` polled against a deadline), so a library
    must take device buffers in *non-blocking* collectives.  MPICH built with GPU support does; Open MPI does
    in blocking ones only (its ``coll/cuda`` component intercepts the blocking reductions and stages them
    through host memory; a non-blocking reduction reads device memory on the CPU), so with Open MPI device
    buffers are staged here, through pinned memory, which is what its own component would do.
    """
    aware, how = _library_cuda_support(comm, MPI)
    if aware and _vendor(MPI) == "Open MPI":
        return False, (f"{how}, but Open MPI takes device buffers in blocking collectives only, "
                       "and these are non-blocking")
    return aware, how


_answers: dict[int, tuple[bool, str]] = {}


def cuda_aware(communicator) -> bool:
    """Whether ``communicator`` can take device buffers directly (env override, then detection; cached)."""
    raw = os.environ.get(CUDA_AWARE_ENV, "").strip()
    if raw in ("0", "1"):
        return raw == "1"
    if raw:
        from .errors import CollectiveError
        raise CollectiveError(f"{CUDA_AWARE_ENV}={raw!r}: expected 0 or 1 (unset: detect)")
    key = id(communicator)
    if key not in _answers:
        _answers[key] = detect_cuda_aware(communicator.comm, communicator.MPI)
        log.debug("CUDA-aware MPI: %s (%s)", *_answers[key])
    return _answers[key][0]


_noted = False


def note_staging(communicator=None) -> None:
    """Log once per process that device buffers are staged through pinned host memory, and why."""
    global _noted
    if not _noted:
        _noted = True
        raw = os.environ.get(CUDA_AWARE_ENV, "").strip()
        why = (f"{CUDA_AWARE_ENV}={raw}" if raw in ("0", "1")
               else _answers.get(id(communicator), (False, "MPI is not CUDA-aware"))[1])
        log.warning("device buffers are staged through pinned host memory (%s; set %s=1 to override "
                    "detection)", why, CUDA_AWARE_ENV)
