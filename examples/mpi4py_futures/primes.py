"""Count the primes below N with mpi4py.futures: every rank of the job starts a pool of workers with
``MPIPoolExecutor`` (MPI_Comm_spawn) and counts its share; the ranks add up their counts.

A plain mpi4py program: under ``launcher: mpi`` it runs as ``python3 primes.py``; under clusterctl's
``launcher: ssh`` (no mpiexec) as ``python3 -m clusterctl.collective primes.py``. See README.md.

usage: primes.py [--below N] [--workers W]
"""

import argparse
import math
import os
import socket
import sys

from mpi4py import MPI
from mpi4py.futures import MPIPoolExecutor

#: pi(10**k) for checking the answer
KNOWN = {10**3: 168, 10**4: 1229, 10**5: 9592, 10**6: 78498, 10**7: 664579}


def count_primes(lo: int, hi: int) -> tuple[int, str, int]:
    """Primes in [lo, hi), with the host and pid that counted them (a worker)."""
    n = 0
    for k in range(max(lo, 2), hi):
        if all(k % d for d in range(2, math.isqrt(k) + 1)):
            n += 1
    return n, socket.gethostname(), os.getpid()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--below", type=int, default=10**5)
    ap.add_argument("--workers", type=int, default=2)
    args = ap.parse_args()
    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    step = 1000
    mine = [(lo, min(lo + step, args.below)) for lo in range(rank * step, args.below, size * step)]
    with MPIPoolExecutor(max_workers=args.workers) as pool:
        results = list(pool.starmap(count_primes, mine))
    local = sum(n for n, _, _ in results)
    workers = sorted({f"{host}:{pid}" for _, host, pid in results})
    print(f"rank {rank}/{size} on {socket.gethostname()}: {local} primes in {len(mine)} chunks, "
          f"workers {' '.join(workers)}", flush=True)
    total = world.allreduce(local)
    if rank == 0:
        want = KNOWN.get(args.below)
        ok = want is None or total == want
        print(f"primes below {args.below}: {total}" + ("" if want is None else f" (expected {want})"), flush=True)
        return 0 if ok else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
