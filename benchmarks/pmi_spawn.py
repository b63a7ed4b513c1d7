"""MPI_Comm_spawn latency: clusterctl's PMI server (launcher: ssh, no mpiexec) vs MPICH's hydra (mpiexec), side by side.

Each run starts a 2-rank job, either as clusterctl's ssh launcher starts it (the plan's environment plus a
token, through ``python -m clusterctl.collective``) or under ``mpiexec -n 2``; every rank spawns
``--spawns`` times ``--children`` processes from COMM_SELF (each child joins, meets its parent in a
barrier, disconnects, exits) and reports each spawn's wall time, from the call to the intercommunicator's
barrier. The launchers alternate run by run; the table shows medians over all spawns of all runs, and the
job's wall time (start to exit, MPI_Init included).

usage: python benchmarks/pmi_spawn.py [--runs 3] [--spawns 5] [--children 1 4]
"""

from __future__ import annotations

import argparse
import os
import secrets
import shutil
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

WORKER = r"""
import sys, time
from mpi4py import MPI
if sys.argv[1] == "child":
    p = MPI.Comm.Get_parent(); p.Barrier(); p.Disconnect(); sys.exit(0)
spawns, children = int(sys.argv[1]), int(sys.argv[2])
times = []
for _ in range(spawns):
    t = time.perf_counter()
    inter = MPI.COMM_SELF.Spawn(sys.executable, [__file__, "child"], children)
    inter.Barrier()
    times.append(time.perf_counter() - t)
    inter.Disconnect()
print("TIMES", MPI.COMM_WORLD.Get_rank(), " ".join(f"{x:.4f}" for x in times), flush=True)
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(launcher: str, script: Path, spawns: int, children: int) -> tuple[list[float], float]:
    """One 2-rank job; (spawn times of both ranks, job wall time)."""
    base = {**os.environ, "PYTHONPATH": str(ROOT), "UCX_LOG_LEVEL": "error"}
    args = [str(script), str(spawns), str(children)]
    t0 = time.perf_counter()
    if launcher == "mpiexec":
        mpiexec = shutil.which("mpiexec", path=str(Path(sys.executable).parent)) or "mpiexec"
        procs = [subprocess.Popen([mpiexec, "-n", "2", sys.executable, *args], env=base, stdout=subprocess.PIPE,
                                  text=True)]
    else:
        port, token = free_port(), secrets.token_hex(16)
        procs = [subprocess.Popen([sys.executable, "-m", "clusterctl.collective", *args], stdout=subprocess.PIPE,
                                  text=True, env={**base, "RANK": str(r), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                                                  "MASTER_PORT": str(port), "CLUSTERCTL_JOB": "bench-spawn",
                                                  "CLUSTERCTL_JOB_TOKEN": token})
                 for r in range(2)]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    wall = time.perf_counter() - t0
    if any(p.returncode for p in procs):
        raise SystemExit(f"{launcher} run failed: {outs}")
    times = [float(x) for out in outs for line in out.splitlines() if line.startswith("TIMES ")
             for x in line.split()[2:]]
    return times, wall


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--spawns", type=int, default=5)
    ap.add_argument("--children", type=int, nargs="+", default=[1, 4])
    a = ap.parse_args()
    work = Path(os.environ.get("TMPDIR", "/tmp")) / f"pmi-spawn-bench-{os.getpid()}"
    work.mkdir(parents=True, exist_ok=True)
    script = work / "worker.py"
    script.write_text(WORKER)
    print("| children per spawn | launcher | spawns | median spawn (s) | median job wall (s) | ratio vs mpiexec |")
    print("| --- | --- | --- | --- | --- | --- |")
    for children in a.children:
        got: dict[str, tuple[list[float], list[float]]] = {"mpiexec": ([], []), "clusterctl": ([], [])}
        for _ in range(a.runs):
            for launcher in ("mpiexec", "clusterctl"):
                times, wall = run(launcher, script, a.spawns, children)
                got[launcher][0].extend(times)
                got[launcher][1].append(wall)
        ref = statistics.median(got["mpiexec"][0])
        for launcher, (times, walls) in got.items():
            med = statistics.median(times)
            print(f"| {children} | {launcher} | {len(times)} | {med:.3f} | {statistics.median(walls):.2f} | "
                  f"{med / ref:.2f} |")
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
