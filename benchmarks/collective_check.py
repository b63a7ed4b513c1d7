"""What the argument check costs: allreduce with ``check`` off vs on, side by side in one run.

Run under any MPI launcher, e.g. one host, two ranks:

    mpiexec -n 2 python benchmarks/collective_check.py

Two communicators over the same processes, one with the check off (the default), one with it on; blocks of
in-place allreduces of zeros (1 KiB and 16 MiB of float32) alternate between them, each block timed by the slowest
rank after a barrier. Reported: the median per-call time of ``--reps`` blocks per side, the difference and the ratio.
Against a tree that has no check (``init()`` without ``check=``) only the "off" column is measured, to compare the
default path with the code before the check by running both trees in turn.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import clusterctl.collective as cc  # noqa: E402

SIZES = {"1 KiB": 1 << 10, "16 MiB": 16 << 20}
CALLS = {"1 KiB": 2000, "16 MiB": 10}      # allreduces per timed block


def block(MPI, world, c, x, calls: int) -> float:
    """Seconds per allreduce over ``calls`` in-place allreduces of ``x``, as the slowest rank saw them."""
    world.Barrier()
    t0 = time.perf_counter()
    for _ in range(calls):
        cc.allreduce(x, out=x, comm=c)
    dt = (time.perf_counter() - t0) / calls
    return world.allreduce(dt, op=MPI.MAX)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=11, help="timed blocks per size and side (median reported)")
    args = ap.parse_args()
    off = cc.init(timeout=600)
    MPI = off.MPI
    world = MPI.COMM_WORLD
    has_check = hasattr(off, "check")
    if has_check and off.check:
        raise SystemExit("CLUSTERCTL_COLLECTIVE_CHECK is set: unset it, the script turns the check on itself")
    sides = {"off": off}
    if has_check:
        sides["on"] = cc.init(comm=world, check=True, timeout=600)
    rows = []
    for label, nbytes in SIZES.items():
        x = np.zeros(nbytes // 4, dtype=np.float32)
        times: dict[str, list[float]] = {s: [] for s in sides}
        for c in sides.values():
            block(MPI, world, c, x, max(1, CALLS[label] // 10))         # warm-up
        for rep in range(args.reps):
            order = list(sides) if rep % 2 == 0 else list(reversed(sides))    # alternate who goes first
            for s in order:
                times[s].append(block(MPI, world, sides[s], x, CALLS[label]))
        rows.append((label, {s: statistics.median(t) for s, t in times.items()}))
    if world.rank == 0:
        path = "shared-memory window" if off.uses_shm else "MPI"
        print(f"{world.size} ranks, {path}, medians of {args.reps} blocks (µs per allreduce)")
        if has_check:
            print("| size | check off (µs) | check on (µs) | on − off (µs) | on ÷ off |")
            print("| --- | ---: | ---: | ---: | ---: |")
            for label, m in rows:
                print(f"| {label} | {m['off'] * 1e6:.1f} | {m['on'] * 1e6:.1f} | {(m['on'] - m['off']) * 1e6:.1f} "
                      f"| {m['on'] / m['off']:.2f} |")
        else:
            print("| size | no check in this tree (µs) |")
            print("| --- | ---: |")
            for label, m in rows:
                print(f"| {label} | {m['off'] * 1e6:.1f} |")
    cc.finalize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
