"""Who is where: rank, size, local rank/size and node layout of a communicator, plus the split comms."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

__all__ = ["Topology", "discover"]

#: Env var that fakes a multi-node layout on one host: "2" splits the ranks into 2 contiguous "nodes".
FAKE_NODES_ENV = "CLUSTERCTL_COLLECTIVE_FAKE_NODES"


@dataclass(frozen=True)
class Topology:
    """Placement of every rank of a communicator: hosts in rank order and this process's coordinates."""

    rank: int
    size: int
    local_rank: int
    local_size: int
    node_rank: int
    node_count: int
    hosts: tuple[str, ...]
    pids: tuple[int, ...]
    node_of: tuple[int, ...]

    @property
    def homogeneous(self) -> bool:
        """True when every node runs the same number of ranks (needed by the hierarchical slice scheme)."""
        counts = [self.node_of.count(n) for n in range(self.node_count)]
        return len(set(counts)) == 1

    def describe(self, rank: int) -> str:
        """Human-readable 'rank R (host, pid P)' for messages."""
        return f"rank {rank} ({self.hosts[rank]}, pid {self.pids[rank]})"


def _fake_nodes() -> int:
    raw = os.environ.get(FAKE_NODES_ENV, "").strip()
    if not raw:
        return 0
    try:
        value = int(raw)
    except ValueError:
        from .errors import CollectiveError
        raise CollectiveError(f"{FAKE_NODES_ENV}={raw!r}: expected a positive integer") from None
    if value < 1:
        from .errors import CollectiveError
        raise CollectiveError(f"{FAKE_NODES_ENV}={raw!r}: expected a positive integer")
    return value


def discover(comm, MPI):
    """Collectively work out the topology of ``comm``; returns (Topology, local_comm, cross_comm)."""
    host = socket.gethostname()
    me = (host, os.getpid())
    everyone = comm.allgather(me)
    hosts = tuple(h for h, _ in everyone)
    pids = tuple(p for _, p in everyone)
    fake = _fake_nodes()
    if fake:
        # Contiguous blocks of ranks pretend to be nodes (tests exercise the hierarchical path on one host).
        per = -(-comm.size // min(fake, comm.size))
        local = comm.Split(comm.rank // per, comm.rank)
    else:
        local = comm.Split_type(MPI.COMM_TYPE_SHARED, comm.rank)
    # Number nodes by their lowest world rank so the numbering is deterministic.
    leaders = comm.allgather(comm.rank if local.rank == 0 else -1)
    leader_of_me = local.bcast(comm.rank, root=0)
    node_leaders = sorted(r for r in leaders if r >= 0)
    node_rank = node_leaders.index(leader_of_me)
    node_of = tuple(comm.allgather(node_rank))
    cross = comm.Split(local.rank, comm.rank)
    topo = Topology(rank=comm.rank, size=comm.size, local_rank=local.rank, local_size=local.size,
                    node_rank=node_rank, node_count=len(node_leaders), hosts=hosts, pids=pids,
                    node_of=node_of)
    return topo, local, cross
