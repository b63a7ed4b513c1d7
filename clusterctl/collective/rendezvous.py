"""How processes started without an MPI launcher (clusterctl's ssh launcher) relate to MPI.

Status (see docs/collective.md, "Under clusterctl's ssh launcher"): joining independently started
singleton MPI processes with ``MPI.Open_port`` / ``Comm.Connect`` / ``Comm.Accept`` + ``Intercomm.Merge``
was implemented as a prototype and fails with the MPICH 5.0.x wheel (``MPIDI_check_disjoint_lpids``:
every singleton has the same process id; pmodels/mpich#7805, open).  The planned replacement is a
PMI-1 wire server run by rank 0 on MASTER_ADDR:MASTER_PORT+1 so every process runs ``MPI_Init`` as a
member of one real world.  Until then this module refuses, loudly, to run a RANK/WORLD_SIZE job as a
set of unrelated size-1 worlds (which would silently train N independent models).
"""

from __future__ import annotations

import os

from .errors import CollectiveError

__all__ = ["prepare_environment", "check_world"]

_LAUNCHER_VARS = ("PMI_RANK", "PMI_SIZE", "PMI_FD", "PMI_PORT", "PMIX_RANK", "OMPI_COMM_WORLD_SIZE",
                  "HYDRA_CONTROL_FD", "MPI_LOCALNRANKS")


def under_mpi_launcher() -> bool:
    """True when an MPI process manager (hydra, Open MPI/PMIx, Slurm PMI) started this process."""
    return any(v in os.environ for v in _LAUNCHER_VARS)


def prepare_environment() -> None:
    """Hook run before ``MPI_Init``; nothing to prepare under an MPI launcher."""
    return None


def check_world(MPI) -> None:
    """Raise if the env says WORLD_SIZE > 1 but MPI came up as an unrelated singleton world."""
    raw = os.environ.get("WORLD_SIZE", "").strip()
    if not raw.isdigit() or int(raw) <= 1 or MPI.COMM_WORLD.Get_size() > 1:
        return
    raise CollectiveError(
        f"WORLD_SIZE={raw} (RANK={os.environ.get('RANK', '?')}, MASTER_ADDR="
        f"{os.environ.get('MASTER_ADDR', '?')}) but this process is not under an MPI launcher, so MPI "
        "sees a world of 1. clusterctl.collective needs mpiexec for now: start the job with "
        "'mpiexec -hosts ... -n N python train.py' (or a clusterctl spec that launches through mpiexec); "
        "joining singletons over MASTER_ADDR:MASTER_PORT is not supported by this MPICH "
        "(pmodels/mpich#7805). Set WORLD_SIZE=1 to run a single process.")
