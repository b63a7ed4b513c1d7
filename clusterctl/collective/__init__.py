"""clusterctl.collective: fused, shared-memory-accelerated, deadline-bounded allreduce over mpi4py.

Import-light: PyTorch helpers live in :mod:`clusterctl.collective.torch`, NumPy training helpers in
:mod:`clusterctl.collective.numpy_opt`; MPI is initialised on :func:`init` (or the first collective).
"""

from __future__ import annotations

from ._mpi import (DEFAULT_FUSION_THRESHOLD, DEFAULT_TIMEOUT, Communicator, finalize, init,
                   is_initialized)
from ._mpi import default as _default
from .errors import CollectiveError, CollectiveTimeout
from .ops import (Handle, allreduce, allreduce_async, barrier, broadcast, broadcast_object,
                  grouped_allreduce)
from .topology import Topology

__all__ = [
    "init", "finalize", "is_initialized", "Communicator", "Topology", "topology",
    "rank", "size", "local_rank", "local_size", "node_count",
    "allreduce", "allreduce_async", "grouped_allreduce", "broadcast", "broadcast_object", "barrier",
    "Handle", "CollectiveError", "CollectiveTimeout", "DEFAULT_FUSION_THRESHOLD", "DEFAULT_TIMEOUT",
]


def topology(*, comm=None) -> Topology:
    """Placement of every rank (hosts, local ranks, nodes) of the communicator."""
    return _default(comm).topo


def rank(*, comm=None) -> int:
    """Rank of this process."""
    return _default(comm).topo.rank


def size(*, comm=None) -> int:
    """Number of processes."""
    return _default(comm).topo.size


def local_rank(*, comm=None) -> int:
    """Rank of this process among the processes on its node."""
    return _default(comm).topo.local_rank


def local_size(*, comm=None) -> int:
    """Number of processes on this process's node."""
    return _default(comm).topo.local_size


def node_count(*, comm=None) -> int:
    """Number of nodes."""
    return _default(comm).topo.node_count
