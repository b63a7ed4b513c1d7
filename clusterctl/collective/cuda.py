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


def detect_cuda_aware(comm, MPI) -> tuple[bool, str]:
    """Ask the MPI library whether it accepts CUDA device buffers; returns (answer, how it was found)."""
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
            return True, f"MPIX_Query_cuda_support() in {os.path.basename(path)}"
        return False, f"MPIX_Query_cuda_support() = 0 in {os.path.basename(path)}"
    # 3. Open MPI build information in the library version string.
    version = MPI.Get_library_version()
    if "Open MPI" in version and "cuda" in version.lower():
        return True, "Open MPI library version mentions CUDA"
    return False, f"no cuda memory kind (mpi_memory_alloc_kinds={kinds or 'unset'})"


_answers: dict[int, bool] = {}


def cuda_aware(communicator) -> bool:
    """Whether ``communicator`` can take device buffers directly (env override, then detection; cached)."""
    raw = os.environ.get(CUDA_AWARE_ENV, "").strip()
    if raw in ("0", "1"):
        return raw == "1"
    key = id(communicator)
    if key not in _answers:
        answer, how = detect_cuda_aware(communicator.comm, communicator.MPI)
        _answers[key] = answer
        log.debug("CUDA-aware MPI: %s (%s)", answer, how)
    return _answers[key]


_noted = False


def note_staging() -> None:
    """Log once per process that device buffers are staged through pinned host memory."""
    global _noted
    if not _noted:
        _noted = True
        log.warning("MPI is not CUDA-aware: device buffers are staged through pinned host memory "
                    "(set %s=1 to override detection)", CUDA_AWARE_ENV)
