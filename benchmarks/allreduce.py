"""Allreduce benchmark: clusterctl.collective vs raw mpi4py and torch.distributed gloo, side by side.

Run under any MPI launcher, e.g. one host, two ranks:

    mpiexec -n 2 python benchmarks/allreduce.py

Workload A is ResNet-50's 161 float32 gradients (25,557,032 values), workload B 1,000 tensors of 256
float32.  Every method runs in the same processes in the same run; the median of ``--reps`` timed runs
(after one warm-up) is reported with algbw = bytes / time, busbw = algbw * 2(n-1)/n, and busbw divided
by the single-core memcpy bandwidth measured at the start of the run.
"""

from __future__ import annotations

import argparse
import socket
import statistics
import sys
import time
import warnings
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from allreduce_workloads import (RESNET50_TENSORS, RESNET50_VALUES, resnet50_shapes,  # noqa: E402
                                 small_shapes)

import clusterctl.collective as cc  # noqa: E402
from clusterctl.collective.numpy_opt import GradientBuffer  # noqa: E402

MB = 1 << 20


def memcpy_bandwidth(nbytes: int = 256 * MB, reps: int = 5) -> float:
    """Single-core np.copyto bandwidth in bytes/s (bytes copied per second)."""
    a = np.ones(nbytes, dtype=np.uint8)
    b = np.empty_like(a)
    np.copyto(b, a)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        np.copyto(b, a)
        times.append(time.perf_counter() - t0)
    return nbytes / statistics.median(times)


def timed(comm, fn, reps: int) -> float:
    """Median seconds of ``fn`` over ``reps`` runs, each started together and timed by the slowest rank."""
    fn()
    times = []
    for _ in range(reps):
        comm.Barrier()
        t0 = time.perf_counter()
        fn()
        dt = time.perf_counter() - t0
        times.append(comm.allreduce(dt, op=MPI.MAX))
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--threshold-mb", type=float, default=None, help="fusion threshold (default: library's)")
    ap.add_argument("--sweep", action="store_true", help="also time ours for several fusion thresholds")
    ap.add_argument("--no-gloo", action="store_true")
    ap.add_argument("--gloo-addr", default=None, help="rendezvous address for gloo (default: 127.0.0.1 "
                    "when every rank is on one host, else rank 0's hostname)")
    args = ap.parse_args()
    # In-place sums double the data every run until it overflows to inf (timing is unaffected).
    warnings.filterwarnings("ignore", message="overflow encountered", category=RuntimeWarning)

    threshold = int(args.threshold_mb * MB) if args.threshold_mb else None
    c = cc.init(fusion_threshold=threshold, timeout=600)
    global MPI
    MPI = c.MPI
    comm = MPI.COMM_WORLD
    n, rank = comm.size, comm.rank

    shapes_a = resnet50_shapes()
    if len(shapes_a) != RESNET50_TENSORS or sum(int(np.prod(s)) for s in shapes_a) != RESNET50_VALUES:
        raise SystemExit(f"ResNet-50 shape list is wrong: {len(shapes_a)} tensors, "
                         f"{sum(int(np.prod(s)) for s in shapes_a)} values")
    workloads = {"A: ResNet-50 (161 x f32, 25.6M)": shapes_a,
                 "B: 1000 x 256 f32": small_shapes()}

    comm.Barrier()
    bw = memcpy_bandwidth() if rank == 0 else 0.0
    bw = comm.bcast(bw, root=0)

    gloo = None
    if not args.no_gloo:
        import torch
        import torch.distributed as dist
        hosts = comm.allgather(socket.gethostname())
        addr = args.gloo_addr or ("127.0.0.1" if len(set(hosts)) == 1 else hosts[0])
        if rank == 0:
            with socket.socket() as s:
                s.bind(("", 0))
                port = s.getsockname()[1]
        else:
            port = None
        port = comm.bcast(port, root=0)
        dist.init_process_group("gloo", init_method=f"tcp://{addr}:{port}", rank=rank, world_size=n)
        gloo = (torch, dist)

    rows = []
    sweep_rows = []
    for wname, shapes in workloads.items():
        rng = np.random.default_rng(rank)
        arrays = [rng.standard_normal(s).astype(np.float32) for s in shapes]
        nbytes = sum(a.nbytes for a in arrays)
        flat = np.concatenate([a.reshape(-1) for a in arrays])
        methods = {}
        methods["ours: grouped_allreduce (fused)"] = lambda: cc.grouped_allreduce(arrays, inplace=True)
        # gradients living in the buffer (GradientBuffer: its own shared window): no pack/unpack copies
        gb = GradientBuffer({str(i): s for i, s in enumerate(shapes)}, op="sum")
        for k, a in enumerate(arrays):
            gb.grads[str(k)][...] = a
        methods["ours: GradientBuffer (grads in window)"] = gb.allreduce
        methods["mpi4py Allreduce per tensor"] = lambda: [comm.Allreduce(MPI.IN_PLACE, a) for a in arrays]
        methods["mpi4py Allreduce one flat buffer"] = lambda: comm.Allreduce(MPI.IN_PLACE, flat)
        if gloo:
            torch, dist = gloo
            tensors = [torch.from_numpy(a) for a in arrays]
            methods["gloo all_reduce per tensor"] = lambda: [dist.all_reduce(t) for t in tensors]
            buckets, cur, size = [], [], 0
            for t in tensors:
                if cur and size + t.numel() * 4 > 25 * MB:
                    buckets.append(cur)
                    cur, size = [], 0
                cur.append(t)
                size += t.numel() * 4
            buckets.append(cur)

            def gloo_bucketed():
                for b in buckets:
                    f = torch.cat([t.reshape(-1) for t in b])
                    dist.all_reduce(f)
                    off = 0
                    for t in b:
                        t.reshape(-1).copy_(f[off: off + t.numel()])
                        off += t.numel()
            methods["gloo bucketed 25 MB"] = gloo_bucketed
        reps = args.reps if nbytes > MB else 3 * args.reps
        for mname, fn in methods.items():
            t = timed(comm, fn, reps)
            rows.append((wname, mname, t, nbytes))
        if args.sweep:
            for th in (1, 4, 8, 16, 32, 64):
                cth = cc.init(comm=comm, fusion_threshold=th * MB, timeout=600)
                t = timed(comm, lambda: cc.grouped_allreduce(arrays, inplace=True, comm=cth), reps)
                sweep_rows.append((wname, th, t))

    if rank == 0:
        shm = "shared-memory window" if c.uses_shm else "MPI only"
        print(f"\nranks: {n} on {len(set(c.topo.hosts))} host(s); ours via {shm}; fusion threshold "
              f"{c.fusion_threshold / MB:g} MB; single-core memcpy {bw / 1e9:.2f} GB/s; median of {args.reps} "
              f"(A) / {3 * args.reps} (B) runs\n")
        print("| workload | method | time (ms) | algbw (GB/s) | busbw (GB/s) | busbw / memcpy | time vs ours |")
        print("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
        ours = {w: t for w, m, t, _ in rows if m.startswith("ours: grouped")}
        for w, m, t, nb in rows:
            alg = nb / t
            bus = alg * 2 * (n - 1) / n
            print(f"| {w} | {m} | {t * 1e3:.2f} | {alg / 1e9:.2f} | {bus / 1e9:.2f} | {bus / bw:.0%} | "
                  f"{t / ours[w]:.2f}x |")
        if sweep_rows:
            print("\n| workload | fusion threshold (MB) | ours time (ms) |")
            print("| --- | ---: | ---: |")
            for w, th, t in sweep_rows:
                print(f"| {w} | {th} | {t * 1e3:.2f} |")
        print()
        get = {(w, m): t for w, m, t, _ in rows}
        wa, wb = list(workloads)
        checks = []
        for tag, ours_m in (("packed", "ours: grouped_allreduce (fused)"),
                            ("in-buffer", "ours: GradientBuffer (grads in window)")):
            checks += [
                (f"A ({tag}): ours <= 0.6x raw per-tensor mpi4py",
                 get[(wa, ours_m)] / get[(wa, "mpi4py Allreduce per tensor")], 0.6, "le"),
                (f"A ({tag}): ours busbw >= 70% of memcpy",
                 (RESNET50_VALUES * 4 / get[(wa, ours_m)]) * 2 * (n - 1) / n / bw, 0.7, "ge"),
                (f"B ({tag}): ours >= 8x faster than raw per-tensor",
                 get[(wb, "mpi4py Allreduce per tensor")] / get[(wb, ours_m)], 8, "ge"),
            ]
            if gloo:
                for w in (wa, wb):
                    checks.append((f"{w[0]} ({tag}): ours >= 3x faster than gloo bucketed",
                                   get[(w, "gloo bucketed 25 MB")] / get[(w, ours_m)], 3, "ge"))
        for name, value, target, how in checks:
            ok = value <= target if how == "le" else value >= target
            print(f"- {name}: {value:.2f} -> {'MET' if ok else 'NOT MET'}")
        sys.stdout.flush()
    if gloo:
        gloo[1].destroy_process_group()
    cc.finalize()
    return 0


MPI = None

if __name__ == "__main__":
    raise SystemExit(main())
