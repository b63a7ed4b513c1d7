"""Training-step benchmark: torch DistributedOptimizer vs raw mpi4py per-tensor Allreduce vs torch DDP (gloo).

Run under any MPI launcher, e.g. one host, two ranks, one thread each:

    OMP_NUM_THREADS=1 mpiexec -n 2 python benchmarks/train_step.py

Every method trains its own replica of the same model (same initial weights, same batches) in the same
processes, and the methods take turns step by step, so machine noise hits them alike. A step is
forward + backward + gradient averaging + SGD step, started together on every rank (barrier) and
timed by the slowest rank. The report gives the median step per method, the ratios, and where the
step's time goes (median of each phase on rank 0):

* none: no communication (the floor);
* raw: ``loss.backward()``, then ``comm.Allreduce(IN_PLACE, grad)`` per tensor (reduce), then
  ``grad /= size`` per tensor (unpack/average), then the step;
* ours: ``loss.backward()`` during which buckets are reduced (gradients are views into the buckets:
  no pack, no unpack), then ``synchronize()`` (wait for the buckets still running), then the step;
  ``reduce (worker)`` is the time the communicator's worker thread spent reducing, overlapped;
* ddp: ``DistributedDataParallel`` on a gloo process group (reduction inside backward), then the step.

Variants of ours (``--methods``): ``ours`` = defaults (overlap chosen from the core count,
``zero_grad()`` sets gradients to None); ``ours-thread`` / ``ours-inline`` force ``overlap=True`` /
``False``; ``ours-zero`` uses ``zero_grad(set_to_none=False)`` (buckets zeroed in place, autograd adds).
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import clusterctl.collective as cc  # noqa: E402

MB = 1 << 20


def build_model(name: str, width: int):
    """The benchmark's models: ``mlp`` (3 hidden layers of ``width``), ``deep`` (48 x Linear(512) +
    LayerNorm: many small tensors) or ``cnn`` (small ResNet-style)."""
    import torch.nn as nn
    if name == "deep":
        layers = [nn.Linear(1024, 512)]
        for _ in range(48):
            layers += [nn.Linear(512, 512), nn.LayerNorm(512), nn.ReLU()]
        return nn.Sequential(*layers, nn.Linear(512, 10))
    if name == "mlp":
        return nn.Sequential(nn.Linear(1024, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                             nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10))

    class Block(nn.Module):
        def __init__(self, cin, cout, stride):
            super().__init__()
            self.c1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
            self.b1 = nn.BatchNorm2d(cout)
            self.c2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
            self.b2 = nn.BatchNorm2d(cout)
            self.down = None
            if stride != 1 or cin != cout:
                self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

        def forward(self, x):
            y = self.b2(self.c2(self.b1(self.c1(x)).relu()))
            return (y + (x if self.down is None else self.down(x))).relu()

    return nn.Sequential(nn.Conv2d(3, 32, 3, 1, 1, bias=False), nn.BatchNorm2d(32), nn.ReLU(),
                         Block(32, 64, 2), Block(64, 128, 2), Block(128, 256, 2), Block(256, 384, 2),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(384, 10))


def batch(name: str, size: int, rank: int):
    """A fixed random batch for this rank."""
    import torch
    g = torch.Generator().manual_seed(1000 + rank)
    x = torch.randn(size, 3, 32, 32, generator=g) if name == "cnn" else torch.randn(size, 1024, generator=g)
    return x, torch.randint(0, 10, (size,), generator=g)


class Clock:
    """Phase timer: ``lap(name)`` adds the time since the previous lap to ``name``."""

    def __init__(self):
        self.t = time.perf_counter()
        self.phases: dict[str, float] = {}

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.phases[name] = self.phases.get(name, 0.0) + now - self.t
        self.t = now


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="mlp,cnn",
                    help="comma-separated: mlp, deep, cnn; NAME:BATCH overrides the batch size")
    ap.add_argument("--steps", type=int, default=15, help="timed steps per method (after 3 warm-up)")
    ap.add_argument("--mlp-width", type=int, default=2048)
    ap.add_argument("--mlp-batch", type=int, default=64)
    ap.add_argument("--cnn-batch", type=int, default=32)
    ap.add_argument("--methods", default="none,raw,ours,ddp")
    ap.add_argument("--threshold-mb", type=float, default=None, help="fusion threshold (default: library's)")
    ap.add_argument("--gloo-addr", default=None)
    args = ap.parse_args()

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    from clusterctl.collective.torch import DistributedOptimizer

    c = cc.init(timeout=600)
    MPI = c.MPI
    comm = MPI.COMM_WORLD
    n, rank = comm.size, comm.rank
    methods = args.methods.split(",")
    threshold = int(args.threshold_mb * MB) if args.threshold_mb else None

    if "ddp" in methods:
        hosts = comm.allgather(socket.gethostname())
        addr = args.gloo_addr or ("127.0.0.1" if len(set(hosts)) == 1 else hosts[0])
        port = None
        if rank == 0:
            with socket.socket() as s:
                s.bind(("", 0))
                port = s.getsockname()[1]
        port = comm.bcast(port, root=0)
        dist.init_process_group("gloo", init_method=f"tcp://{addr}:{port}", rank=rank, world_size=n)

    # worker-thread reduce time of "ours" (wraps the kernel the buckets run; benchmark-only)
    busy = [0.0]
    kernel = c.allreduce_resident

    def timed_kernel(*a):
        t0 = time.perf_counter()
        try:
            return kernel(*a)
        finally:
            busy[0] += time.perf_counter() - t0
    c.allreduce_resident = timed_kernel

    results = []
    for spec in args.models.split(","):
        mname, _, b = spec.partition(":")
        width = args.mlp_width
        bsz = int(b) if b else (args.cnn_batch if mname == "cnn" else args.mlp_batch)
        x, y = batch(mname, bsz, rank)
        torch.manual_seed(0)
        base = build_model(mname, width)
        nparams = sum(p.numel() for p in base.parameters())
        runners = {}
        dopts = {}
        for meth in methods:
            model = build_model(mname, width)
            model.load_state_dict(base.state_dict())
            opt = torch.optim.SGD(model.parameters(), lr=1e-3)
            if meth in ("none", "ddp"):  # no reduction of ours: none has none at all, DDP's runs inside backward
                def run(clock, model=DDP(model) if meth == "ddp" else model, opt=opt):
                    opt.zero_grad()
                    loss = F.cross_entropy(model(x), y)
                    clock.lap("forward")
                    loss.backward()
                    clock.lap("backward")
                    opt.step()
                    clock.lap("step")
            elif meth == "raw":
                def run(clock, model=model, opt=opt):
                    opt.zero_grad()
                    loss = F.cross_entropy(model(x), y)
                    clock.lap("forward")
                    loss.backward()
                    clock.lap("backward")
                    grads = [p.grad for p in model.parameters()]
                    for g in grads:
                        comm.Allreduce(MPI.IN_PLACE, g.numpy())
                    clock.lap("reduce")
                    for g in grads:
                        g.div_(n)
                    clock.lap("unpack")
                    opt.step()
                    clock.lap("step")
            elif meth in ("ours", "ours-thread", "ours-inline", "ours-zero"):
                overlap = {"ours-thread": True, "ours-inline": False}.get(meth)
                dopt = DistributedOptimizer(opt, model.named_parameters(), fusion_threshold=threshold,
                                            overlap=overlap)
                to_none = meth != "ours-zero"
                dopts[meth] = dopt

                def run(clock, model=model, dopt=dopt, to_none=to_none):
                    dopt.zero_grad(set_to_none=to_none)
                    loss = F.cross_entropy(model(x), y)
                    clock.lap("forward")
                    loss.backward()
                    clock.lap("backward")
                    dopt.synchronize()
                    clock.lap("wait")
                    dopt.optimizer.step()
                    clock.lap("step")
            else:
                raise SystemExit(f"unknown method {meth!r}")
            runners[meth] = (run, model, dopt.overlap if meth.startswith("ours") else None)
        times = {m: [] for m in methods}
        phases = {m: [] for m in methods}
        worker: dict[str, list[float]] = {}
        for i in range(3 + args.steps):
            for meth in methods:
                run = runners[meth][0]
                comm.Barrier()
                busy[0] = 0.0
                clock = Clock()
                run(clock)
                dt = time.perf_counter() - clock.t + sum(clock.phases.values())
                dt = comm.allreduce(dt, op=MPI.MAX)
                if i >= 3:
                    times[meth].append(dt)
                    phases[meth].append(clock.phases)
                    if meth.startswith("ours"):
                        worker.setdefault(meth, []).append(busy[0])
        # communication only, on the gradients of the last step: raw per-tensor loop vs ours' buckets
        comm_only: dict[str, list[float]] = {}
        pairs = []
        if "raw" in runners:
            rgrads = [p.grad.numpy() for p in runners["raw"][1].parameters()]
            pairs.append(("raw", lambda: [comm.Allreduce(MPI.IN_PLACE, g) for g in rgrads]))
        if "ours" in dopts:
            pairs.append(("ours", dopts["ours"].synchronize))  # re-reduces every bucket (no backward)
        for _ in range(args.steps):
            for key, fn in pairs:
                comm.Barrier()
                t0 = time.perf_counter()
                fn()
                comm_only.setdefault(key, []).append(comm.allreduce(time.perf_counter() - t0, op=MPI.MAX))
        # every replica must hold the same weights on every rank
        for meth in methods:
            if meth == "none":
                continue
            model = runners[meth][1]
            model = model.module if hasattr(model, "module") else model
            flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
            ref = flat.clone()
            comm.Bcast(ref.numpy(), root=0)
            if not torch.equal(flat, ref):
                raise SystemExit(f"{mname}/{meth}: rank {rank}'s weights differ from rank 0's")
        results.append((mname, nparams, bsz, times, phases, worker, sum(1 for _ in base.parameters()), comm_only))

    if rank == 0:
        print(f"\nranks: {n} on {len(set(c.topo.hosts))} host(s); ours via "
              f"{'shared-memory window' if c.uses_shm else 'MPI only'}; fusion threshold "
              f"{(threshold or c.fusion_threshold) / MB:g} MB; OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}; "
              f"torch threads {torch.get_num_threads()}; median of {args.steps} steps\n")
        print("| model | params (tensors) | batch | " + " | ".join(f"{m} (ms)" for m in methods)
              + " | ours / raw | ours / ddp |")
        print("| --- | ---: | ---: | " + " | ".join("---:" for _ in methods) + " | ---: | ---: |")
        for mname, nparams, bsz, times, _, _, ntensors, _ in results:
            med = {m: statistics.median(v) for m, v in times.items()}
            r1 = f"{med['ours'] / med['raw']:.2f}" if "ours" in med and "raw" in med else "-"
            r2 = f"{med['ours'] / med['ddp']:.2f}" if "ours" in med and "ddp" in med else "-"
            print(f"| {mname} | {nparams / 1e6:.1f}M ({ntensors}) | {bsz} | "
                  + " | ".join(f"{med[m] * 1e3:.1f}" for m in methods) + f" | {r1} | {r2} |")
        print("\nwhere the step goes (rank 0, median ms per phase):\n")
        for mname, _, bsz, times, phases, worker, _, _ in results:
            for meth in methods:
                names = list(phases[meth][0])
                parts = ", ".join(f"{p} {statistics.median(ph[p] for ph in phases[meth]) * 1e3:.1f}"
                                  for p in names)
                extra = ""
                if meth.startswith("ours"):
                    where = "in the hooks, inside backward" if not runners[meth][2] else "worker thread, overlapped"
                    extra = (f"; reduce ({where}) {statistics.median(worker[meth]) * 1e3:.1f}; "
                             "pack 0, unpack 0 (grads are bucket views)")
                print(f"- {mname} (batch {bsz}) {meth}: {parts}{extra}")
        if any(r[7] for r in results):
            print("\ncommunication only (the last step's gradients reduced again, no backward; median ms):\n")
            print("| model | grads (MB) | raw per-tensor Allreduce | ours: synchronize() of all buckets | ours / raw |")
            print("| --- | ---: | ---: | ---: | ---: |")
            for mname, nparams, bsz, _, _, _, _, co in results:
                if "raw" in co and "ours" in co:
                    a, b = statistics.median(co["raw"]), statistics.median(co["ours"])
                    print(f"| {mname} | {nparams * 4 / 1e6:.0f} | {a * 1e3:.1f} | {b * 1e3:.1f} | {b / a:.2f} |")
        sys.stdout.flush()
    if "ddp" in methods:
        dist.destroy_process_group()
    cc.finalize()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
