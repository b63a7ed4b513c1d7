"""Joining one MPI world when processes were started without an MPI launcher (clusterctl's ssh launcher).

``clusterctl start`` with ``launcher: ssh`` starts every trainer itself with RANK, WORLD_SIZE,
LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT (GUIDE §2) and no process manager, so a bare
``MPI_Init`` would give WORLD_SIZE unrelated one-process worlds.  Before MPI is initialised,
:func:`prepare_environment` therefore

1. on rank 0 starts a PMI-1 server (:mod:`clusterctl.collective.pmi`) on MASTER_ADDR:MASTER_PORT,
2. on every rank registers with it (retrying until it listens) and waits until all ranks have,
3. keeps that connection as the rank's control connection (:class:`~clusterctl.collective.pmiclient.RankControl`:
   it starts the processes an ``MPI_Comm_spawn`` asks for and ends the rank after an ``MPI_Abort``),
4. sets ``PMI_PORT``, ``PMI_ID``, ``PMI_RANK`` and ``PMI_SIZE``, so MPICH's PMI client joins the
   server's job exactly as under hydra: one real ``MPI_COMM_WORLD`` (shared memory included).

(Joining singletons with ``Comm.Connect``/``Accept`` fails with MPICH 5.0: pmodels/mpich#7805.)
"""

from __future__ import annotations

import atexit
import logging
import os
import sys

from .errors import CollectiveError

__all__ = ["under_mpi_launcher", "prepare_environment", "check_world", "joined", "RANK_ENV"]

log = logging.getLogger("clusterctl.collective")

_LAUNCHER_VARS = ("PMI_RANK", "PMI_SIZE", "PMI_FD", "PMI_PORT", "PMIX_RANK", "OMPI_COMM_WORLD_SIZE",
                  "HYDRA_CONTROL_FD", "MPI_LOCALNRANKS")

#: What describes a rank of the job's world: spawned processes do not inherit it (they get their own PMI_*).
RANK_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "PMI_PORT", "PMI_ID", "PMI_RANK",
            "PMI_SIZE", "PMI_FD", "PMI_SPAWNED")

_server = None          # rank 0's PMI server child process (subprocess.Popen)
_control = None         # this rank's control thread (pmiclient.RankControl)
_joined: dict[str, str] | None = None


def under_mpi_launcher() -> bool:
    """True when an MPI process manager (hydra, Open MPI/PMIx, Slurm PMI) started this process."""
    return any(v in os.environ for v in _LAUNCHER_VARS)


def joined() -> bool:
    """True when this process joined its MPI world through clusterctl's PMI server."""
    return _joined is not None


def _mpi_already_initialized() -> bool:
    MPI = sys.modules.get("mpi4py.MPI")
    return MPI is not None and MPI.Is_initialized()


def _int_env(name: str) -> int:
    raw = os.environ.get(name, "").strip()
    try:
        return int(raw)
    except ValueError:
        raise CollectiveError(f"{name}={raw!r}: expected an integer") from None


MAX_WORLD = 1 << 20  # ranks in one world: far beyond any plan (16,384 processes), far below a typo's 10**8


def prepare_environment(*, timeout: float) -> None:
    """Before MPI_Init: under clusterctl's ssh launcher, set up PMI so all ranks join one MPI world."""
    global _server, _joined, _control
    if _joined is not None or under_mpi_launcher() or _mpi_already_initialized():
        return
    raw = os.environ.get("WORLD_SIZE", "").strip()
    if not raw:
        return                                   # plain single process
    size = _int_env("WORLD_SIZE")
    if size <= 1:
        return
    if size > MAX_WORLD:
        raise CollectiveError(f"WORLD_SIZE={size} is more ranks than a world of clusterctl's can hold "
                              f"(at most {MAX_WORLD:,})")
    missing = [v for v in ("RANK", "MASTER_ADDR", "MASTER_PORT") if not os.environ.get(v, "").strip()]
    if missing:
        raise CollectiveError(f"WORLD_SIZE={size} but {', '.join(missing)} not set: cannot join the MPI world "
                              "without an MPI launcher (clusterctl's ssh launcher sets them all)")
    rank, port = _int_env("RANK"), _int_env("MASTER_PORT")
    host = os.environ["MASTER_ADDR"].strip()
    if not 0 <= rank < size:
        raise CollectiveError(f"RANK={rank} out of range for WORLD_SIZE={size}")
    if not 0 < port < 65536:
        raise CollectiveError(f"MASTER_PORT={port} is not a TCP port")
    from .pmi import spawn_server
    from .pmiclient import RankControl, join
    child_env = {k: v for k, v in os.environ.items() if k not in RANK_ENV}
    if rank == 0:
        _server = spawn_server(host, port, size, timeout=timeout)   # exits by itself (see spawn_server)
    info, sock, pending = join(host, port, rank=rank, size=size, timeout=timeout)
    pmi_port = f"{host}:{port}"      # MPICH splits PMI_PORT at its first ':' (no IPv6 literals)
    _control = RankControl(sock, pending, rank=rank, pmi_port=pmi_port, child_env=child_env)
    _control.start()
    atexit.register(_control.settle)
    os.environ.update({"PMI_PORT": pmi_port, "PMI_ID": info.get("pmiid", str(rank)), "PMI_RANK": str(rank),
                       "PMI_SIZE": str(size)})
    _joined = info
    log.debug("rank %d/%d joins MPI through the PMI server at %s:%d (kvs %s, mapping %s)", rank, size, host,
              port, info.get("kvsname"), info.get("mapping"))


def check_world(MPI) -> None:
    """Raise if the env says WORLD_SIZE > 1 but MPI's world does not match RANK/WORLD_SIZE."""
    raw = os.environ.get("WORLD_SIZE", "").strip()
    if not raw.isdigit() or int(raw) <= 1:
        return
    world = MPI.COMM_WORLD
    if world.Get_size() == int(raw):
        want = os.environ.get("RANK", "").strip()
        if _joined is not None and want.isdigit() and int(want) != world.Get_rank():
            raise CollectiveError(f"RANK={want} but MPI made this process rank {world.Get_rank()}")
        return
    if world.Get_size() > 1:
        return                                   # an MPI launcher's world; RANK/WORLD_SIZE are someone else's
    raise CollectiveError(
        f"WORLD_SIZE={raw} (RANK={os.environ.get('RANK', '?')}, MASTER_ADDR="
        f"{os.environ.get('MASTER_ADDR', '?')}) but MPI sees a world of 1: MPI was initialised before "
        "clusterctl.collective could set up its process manager. Call clusterctl.collective.init() before "
        "'from mpi4py import MPI' (or set mpi4py.rc.initialize = False before that import), or start the "
        "job with mpiexec.")
