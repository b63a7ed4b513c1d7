"""MPICH 5.0.2's ch4:ucx loses an MPI_ANY_SOURCE receive whose message, from another node, has already arrived.

Two ranks, one per host: each sends 4 ints to the other, a barrier makes sure the message is in, then
MPI_Recv(source=MPI_ANY_SOURCE). With the ucx netmod both ranks spin in MPI_Recv for ever (the shared-memory
half of the any-source receive is never cancelled: docs/benchmarks.md, issue 26); with ofi they get the message.
A rank still waiting 5 s after the barrier (60 s after its start, whatever it waits for) prints its stack and
exits 1, so the job ends either way.
"""

import faulthandler
from array import array

faulthandler.dump_traceback_later(60, exit=True)

from mpi4py import MPI  # noqa: E402

comm = MPI.COMM_WORLD
rank, peer = comm.Get_rank(), 1 - comm.Get_rank()
req = comm.Isend(array("i", [rank] * 4), dest=peer, tag=7)
comm.Barrier()
faulthandler.dump_traceback_later(5, exit=True)  # the message is in: a receive that works takes microseconds
got, status = array("i", [-1] * 4), MPI.Status()
comm.Recv(got, source=MPI.ANY_SOURCE, tag=7, status=status)
req.Wait()
print(f"rank {rank} got {got.tolist()} from {status.Get_source()}", flush=True)
