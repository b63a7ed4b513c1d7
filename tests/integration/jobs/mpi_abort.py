"""An unmodified mpi4py program whose rank 1 calls MPI_Abort(3) after a barrier: every rank must end with code 3
and "not reached" never printed (tests/integration/test_mpi_launch.py, tests/unit/test_backend_local.py)."""
import time

from mpi4py import MPI

w = MPI.COMM_WORLD
w.Barrier()
if w.Get_rank() == 1:
    w.Abort(3)
    time.sleep(60)
w.Barrier()
print("not reached", flush=True)
