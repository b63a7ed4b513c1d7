"""A trainer as clusterctl's ssh launcher starts it: env only (RANK, WORLD_SIZE, MASTER_ADDR, ...), no mpiexec.

test_ssh_launcher.py starts N of these with plain subprocess.Popen.  Each joins the MPI world through
clusterctl.collective.init() (rank 0 serves PMI on MASTER_ADDR:MASTER_PORT), checks allreduce, grouped
allreduce, broadcast and the shared-memory layout, and prints one 'ok' line.
usage: ssh_worker.py [--then-exit-1]
"""

import os
import sys

import numpy as np

import clusterctl.collective as cc

c = cc.init(timeout=float(os.environ.get("CLUSTERCTL_COLLECTIVE_TIMEOUT", "30")))
rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
if (c.rank, c.size) != (rank, size):
    sys.exit(f"MPI says rank {c.rank}/{c.size}, env says {rank}/{size}")
from mpi4py import MPI  # noqa: E402  (after init: the same, joined world)

if MPI.COMM_WORLD.Get_size() != size:
    sys.exit(f"COMM_WORLD has {MPI.COMM_WORLD.Get_size()} ranks")
topo = cc.topology()
nodes = int(os.environ.get("EXPECT_NODES", "1"))     # CLUSTERCTL_COLLECTIVE_PMI_NODE fakes several
if topo.local_size != size // nodes or topo.node_count != nodes or not c.uses_shm:
    sys.exit(f"expected {nodes} node(s) with {size // nodes} local ranks over shared memory, got {topo}")

x = np.arange(100_003, dtype=np.float64) + rank
y = cc.allreduce(x)
want = size * np.arange(100_003, dtype=np.float64) + size * (size - 1) / 2
np.testing.assert_array_equal(y, want)
xs = [np.full(n, rank + 1, dtype=np.float32) for n in (1, 256, 70_000, 3)]
for out in cc.grouped_allreduce(xs, "avg", inplace=True):
    np.testing.assert_allclose(out, (size + 1) / 2)
b = np.full(7, rank, dtype=np.int32)
cc.broadcast(b, root=size - 1)
np.testing.assert_array_equal(b, size - 1)
assert cc.broadcast_object({"from": rank}, root=0) == {"from": 0}
cc.barrier()
print(f"ok rank {rank}/{size} pid {os.getpid()} host {topo.hosts[rank]}", flush=True)
cc.finalize()
