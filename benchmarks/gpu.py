"""GPU checks and benchmarks, for a machine with a CUDA device (issue 23, part 6). Three parts:

    python benchmarks/gpu.py facts        # doctor's host facts script against the real driver, read back as doctor does
    python benchmarks/gpu.py provision    # the gpu provisioning step (driver check, CUDA/NCCL wheels) in check and apply mode
    mpiexec -n N python benchmarks/gpu.py bench [--sizes-mb 0.25,4,64] [--steps 20]
    mpiexec -n N python benchmarks/gpu.py cuda-mpi-probe --calls Allreduce,Bcast,Ibcast,Iallreduce

``bench`` times, on CUDA tensors, interleaved round by round (medians, timed by the slowest rank after a
barrier, with the device synchronized): clusterctl's allreduce (the CUDA-aware path when MPI says it is
CUDA-aware, and the pinned-host staging fallback; and the library's own blocking ``MPI_Allreduce`` of the device
pointer when the library says it takes device buffers at all), ``torch.distributed.all_reduce`` over NCCL (when there is a
GPU per rank: NCCL refuses two ranks on one device) and over gloo (CUDA tensors, more than one rank); then a
training step (forward, backward, gradient averaging, SGD step) with clusterctl's ``grouped_allreduce`` of the
gradients (device buckets) against ``DistributedDataParallel`` over NCCL / gloo. Every rank uses GPU
``local_rank % device_count``.

``cuda-mpi-probe`` hands a CUDA tensor straight to the named mpi4py calls, one after another, and says whether
each result is right: what a library that calls itself CUDA-aware does with device buffers in blocking and
non-blocking collectives (a crash ends the run: put the call that may crash last).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MB = 1 << 20


def facts() -> int:
    """Run doctor's facts script (clusterctl/host/provision_host.py, as doctor ships it) on this machine, with
    this interpreter's environment as the job's venv, and print what doctor would show for it."""
    from clusterctl.transport.host import Host
    from clusterctl.provision.doctor import DoctorReport, _facts_source
    from clusterctl.provision.hostdata import doctor_facts

    params = {"address": "127.0.0.1", "ports": [], "listen_port": None, "venv": sys.prefix, "peers": [],
              "window": 0.5}
    proc = subprocess.run([sys.executable, "-", json.dumps(params)], input=_facts_source(), capture_output=True,
                          timeout=120, check=False)
    if proc.returncode != 0:
        print(proc.stderr.decode(errors="replace"))
        return 1
    f = doctor_facts(json.loads(proc.stdout.decode().strip().splitlines()[-1]))
    host = Host(address=socket.gethostname(), port=22, user="", index=0)
    report = DoctorReport("gpu-check", (host,), {host: f})
    for row in report.rows():
        print(f"{row[0]:>14}: {row[1]}")
    print("gpu facts:", json.dumps(f["gpu"]))
    return 0 if f["gpu"]["gpus"] and f["gpu"]["driver"] else 1


def provision() -> int:
    """Render the gpu step for this machine's CUDA and NCCL (method pip, into this interpreter's environment)
    and run it as the provisioner does (bash, status line parsed): check mode, then apply mode (which must find
    nothing to do); then check mode for an NCCL version that is not installed (it must say it would install it)."""
    from importlib import metadata

    import torch
    import yaml

    from clusterctl.provision.render import render_step
    from clusterctl.provision.runner import parse_status
    from clusterctl.provision.steps import step_context
    from clusterctl.spec import load_spec
    from clusterctl.transport.base import Result

    cuda = ".".join(torch.version.cuda.split(".")[:2])
    nccl = metadata.version(f"nvidia-nccl-cu{cuda.split('.')[0]}")
    other = "2.27.7" if nccl != "2.27.7" else "2.27.3"
    rc = 0
    with tempfile.TemporaryDirectory() as tmp:
        for label, want, check, expect in (("check", nccl, True, "ok"), ("apply", nccl, False, "ok"),
                                           (f"check, NCCL {other}", other, True, "changed")):
            doc = {"name": "gpu-check", "hosts": [{"address": "gpu-host"}], "job": {"entrypoint": ["true"]},
                   "provision": {"python": {"venv": sys.prefix}, "cuda": {"version": cuda, "method": "pip"},
                                 "nccl": {"version": want, "method": "pip"}}}
            path = Path(tmp) / "spec.yaml"
            path.write_text(yaml.safe_dump(doc))
            spec = load_spec(path)
            script = render_step("gpu.sh.j2", step_context("gpu", spec, check=check, force=False,
                                                           wheelhouse_remote=None, mesh=None))
            t0 = time.monotonic()
            proc = subprocess.run(["bash", "-c", script, "clusterctl-gpu"], capture_output=True, text=True,
                                  timeout=300, check=False)
            res = Result(host=None, command="gpu", exit_code=proc.returncode, stdout=proc.stdout,
                         stderr=proc.stderr, seconds=time.monotonic() - t0)
            outcome = parse_status("gpu", res, 300)
            print(f"gpu step ({label}; CUDA {cuda}, NCCL {want}): {outcome.status}: {outcome.reason} "
                  f"[{outcome.seconds:.2f}s]")
            if outcome.status != expect:
                print(proc.stdout[-2000:], proc.stderr[-2000:])
                rc = 1
    return rc


def _library(MPI) -> str:
    """The library's version line (Open MPI 4.1's ends with a NUL)."""
    return MPI.Get_library_version().replace("\x00", "").splitlines()[0].strip()


def _timed(comm, MPI, fn, sync) -> float:
    comm.Barrier()
    t0 = time.perf_counter()
    fn()
    sync()
    return comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)


def bench(args) -> int:
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    import clusterctl.collective as cc
    from clusterctl.collective.cuda import CUDA_AWARE_ENV, _library_cuda_support, detect_cuda_aware

    c = cc.init(timeout=600)
    MPI, comm = c.MPI, c.MPI.COMM_WORLD
    n, rank = comm.size, comm.rank
    if args.cpu:  # a smoke run of this script on a machine without a GPU (CPU tensors; no NCCL)
        ngpu, dev, sync = 0, torch.device("cpu"), lambda: None
    else:
        ngpu = torch.cuda.device_count()
        dev = torch.device("cuda", c.topo.local_rank % ngpu)
        torch.cuda.set_device(dev)
        sync = torch.cuda.synchronize
    aware, how = detect_cuda_aware(comm, MPI)
    library_aware = _library_cuda_support(comm, MPI)[0]
    groups = {}
    port = None
    if rank == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    port = comm.bcast(port, root=0)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=n)
    if n > 1:
        groups["gloo"] = dist.new_group(backend="gloo")
    if 0 < n <= ngpu:
        groups["nccl"] = dist.new_group(backend="nccl")
    if rank == 0:
        print(f"ranks {n}, GPUs {ngpu} ({torch.cuda.get_device_name(dev) if ngpu else 'CPU tensors'}); torch {torch.__version__} "
              f"(CUDA {torch.version.cuda}, NCCL {'.'.join(map(str, torch.cuda.nccl.version())) if ngpu else '-'}); "
              f"MPI: {_library(MPI)}; CUDA-aware: {aware} ({how}); "
              f"references: {', '.join(groups) or 'none'}"
              + ("" if "nccl" in groups else f" (no NCCL: {n} ranks on {ngpu} GPU(s))"))

    def ours(mode):
        def run(x):
            os.environ[CUDA_AWARE_ENV] = "1" if mode == "aware" else "0"
            cc.allreduce(x, out=x)
        return run

    methods = {"ours (staged)": ours("staged")}
    if aware:
        methods["ours (CUDA-aware)"] = ours("aware")
    if library_aware and n > 1 and ngpu:  # the library's own device path (blocking: no deadline, no liveness pings)
        methods["MPI_Allreduce (device pointer)"] = lambda x: comm.Allreduce(MPI.IN_PLACE, x, op=MPI.SUM)
    for name, g in groups.items():
        methods[f"torch.distributed {name}"] = lambda x, g=g: dist.all_reduce(x, group=g)

    rows = []
    for mb in [float(s) for s in args.sizes_mb.split(",")]:
        count = max(1, int(mb * MB) // 4)
        xs = {m: torch.full((count,), float(rank + 1), device=dev) for m in methods}
        times = {m: [] for m in methods}
        for i in range(2 + args.steps):
            for m, fn in methods.items():
                xs[m].fill_(float(rank + 1))
                sync()
                t = _timed(comm, MPI, lambda: fn(xs[m]), sync)
                if i >= 2:
                    times[m].append(t)
        for m in methods:
            assert torch.allclose(xs[m][:8].cpu(), torch.full((8,), float(n * (n + 1) / 2))), (m, xs[m][:8])
        rows.append((mb, {m: statistics.median(v) for m, v in times.items()}))
    os.environ.pop(CUDA_AWARE_ENV, None)
    if rank == 0:
        names = list(methods)
        ref = next((m for m in names if m.endswith("nccl")), next((m for m in names if m.endswith("gloo")), None))
        print(f"\nallreduce of one float32 CUDA tensor, median of {args.steps} (ms; GB/s = size / time)\n")
        print("| MiB | " + " | ".join(names) + (f" | ours (staged) ÷ {ref.split()[-1]} |" if ref else " |"))
        print("| ---: | " + " | ".join("---:" for _ in names) + (" | ---: |" if ref else " |"))
        for mb, med in rows:
            cells = [f"{med[m] * 1e3:.2f} ({mb * MB / med[m] / 1e9:.1f})" for m in names]
            ratio = f" | {med['ours (staged)'] / med[ref]:.2f} |" if ref else " |"
            print(f"| {mb:g} | " + " | ".join(cells) + ratio)

    # training step
    def model_of(kind):
        torch.manual_seed(0)
        if kind == "mlp":
            w = args.mlp_width
            return nn.Sequential(nn.Linear(1024, w), nn.ReLU(), nn.Linear(w, w), nn.ReLU(), nn.Linear(w, w),
                                 nn.ReLU(), nn.Linear(w, 10))
        layers = [nn.Linear(1024, 512)]
        for _ in range(48):
            layers += [nn.Linear(512, 512), nn.LayerNorm(512), nn.ReLU()]
        return nn.Sequential(*layers, nn.Linear(512, 10))

    step_rows = []
    for kind in args.models.split(","):
        g = torch.Generator().manual_seed(1000 + rank)
        x = torch.randn(args.batch, 1024, generator=g).to(dev)
        y = torch.randint(0, 10, (args.batch,), generator=g).to(dev)
        runners = {}
        for meth in ["none", "ours"] + [f"ddp {name}" for name in groups]:
            model = model_of(kind).to(dev)
            params = list(model.parameters())
            if meth.startswith("ddp"):
                model = DDP(model, device_ids=[dev.index] if ngpu else None, process_group=groups[meth.split()[1]])
            opt = torch.optim.SGD(model.parameters(), lr=1e-3)

            def run(model=model, opt=opt, params=params, meth=meth):
                opt.zero_grad()
                F.cross_entropy(model(x), y).backward()
                if meth == "ours":
                    cc.grouped_allreduce([p.grad for p in params], op="avg", inplace=True)
                opt.step()
            runners[meth] = (run, params)
        times = {m: [] for m in runners}
        for i in range(3 + args.steps):
            for m, (run, _) in runners.items():
                t = _timed(comm, MPI, run, sync)
                if i >= 3:
                    times[m].append(t)
        for m, (_, params) in runners.items():  # every replica holds the same weights on every rank
            if m == "none":
                continue
            flat = torch.cat([p.detach().reshape(-1) for p in params]).cpu()
            ref = flat.clone()
            comm.Bcast(ref.numpy(), root=0)
            assert torch.equal(flat, ref), f"{kind}/{m}: rank {rank}'s weights differ from rank 0's"
        nparams = sum(p.numel() for p in runners["ours"][1])
        step_rows.append((kind, nparams, len(runners["ours"][1]), {m: statistics.median(v) for m, v in times.items()}))
    if rank == 0:
        names = list(step_rows[0][3])
        refs = [m for m in names if m.startswith("ddp")]
        print(f"\ntraining step (forward, backward, gradient average, SGD), batch {args.batch}, median of "
              f"{args.steps} (ms)\n")
        print("| model | params (tensors) | " + " | ".join(names) + "".join(f" | ours ÷ {r}" for r in refs) + " |")
        print("| --- | ---: | " + " | ".join("---:" for _ in names) + "".join(" | ---:" for _ in refs) + " |")
        for kind, nparams, ntensors, med in step_rows:
            print(f"| {kind} | {nparams / 1e6:.1f}M ({ntensors}) | " + " | ".join(f"{med[m] * 1e3:.2f}" for m in names)
                  + "".join(f" | {med['ours'] / med[r]:.2f}" for r in refs) + " |")
        sys.stdout.flush()
    dist.destroy_process_group()
    cc.finalize()
    return 0


def nccl_two_ranks_one_gpu() -> int:
    """What NCCL says to two ranks on one GPU (run under `mpiexec -n 2` on a one-GPU machine)."""
    import torch
    import torch.distributed as dist
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    port = None
    if comm.rank == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    port = comm.bcast(port, root=0)
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=comm.rank, world_size=comm.size)
    x = torch.ones(4, device="cuda")
    try:
        dist.all_reduce(x)
        torch.cuda.synchronize()
        print(f"rank {comm.rank}: NCCL all_reduce on one GPU gave {x.tolist()}")
    except Exception as exc:  # what NCCL says is the point of this probe
        print(f"rank {comm.rank}: NCCL refused: {type(exc).__name__}: {str(exc).splitlines()[0][:300]}")
    return 0


def cuda_mpi_probe(args) -> int:
    """Hand a CUDA tensor straight to each of ``args.calls`` and say whether the result is right."""
    import torch
    from mpi4py import MPI

    from clusterctl.collective.cuda import _library_cuda_support, detect_cuda_aware
    comm = MPI.COMM_WORLD
    rank, n = comm.rank, comm.size
    torch.cuda.set_device(rank % torch.cuda.device_count())
    says, how = _library_cuda_support(comm, MPI)
    ours, why = detect_cuda_aware(comm, MPI)
    if rank == 0:
        print(f"{_library(MPI)}: device buffers {'yes' if says else 'no'} "
              f"({how}); clusterctl's collectives take them: {'yes' if ours else 'no'} ({why})", flush=True)
    for call in args.calls.split(","):
        x = torch.full((1 << 20,), float(rank + 1), device="cuda")
        torch.cuda.synchronize()
        comm.Barrier()
        if call == "Allreduce":
            comm.Allreduce(MPI.IN_PLACE, x, op=MPI.SUM)
        elif call == "Iallreduce":
            comm.Iallreduce(MPI.IN_PLACE, x, op=MPI.SUM).Wait()
        elif call == "Bcast":
            comm.Bcast(x, root=0)
        elif call == "Ibcast":
            comm.Ibcast(x, root=0).Wait()
        else:
            raise SystemExit(f"cuda-mpi-probe: unknown call {call!r}")
        torch.cuda.synchronize()
        want = 1.0 if "cast" in call else n * (n + 1) / 2
        right = bool(torch.all(x == want))
        print(f"rank {rank}: {call} of a 4 MiB CUDA tensor: "
              f"{'right' if right else f'WRONG (want {want}, got {x[:3].tolist()}...)'}", flush=True)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=["facts", "provision", "bench", "nccl-probe", "cuda-mpi-probe"])
    ap.add_argument("--calls", default="Allreduce,Bcast,Ibcast,Iallreduce")
    ap.add_argument("--sizes-mb", default="0.25,4,64")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--models", default="mlp,deep")
    ap.add_argument("--mlp-width", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--cpu", action="store_true", help="smoke-run bench on CPU tensors (no GPU needed)")
    args = ap.parse_args()
    if args.what == "facts":
        return facts()
    if args.what == "provision":
        return provision()
    if args.what == "nccl-probe":
        return nccl_two_ranks_one_gpu()
    if args.what == "cuda-mpi-probe":
        return cuda_mpi_probe(args)
    return bench(args)


if __name__ == "__main__":
    raise SystemExit(main())
