"""Fault injection worker, run under mpiexec by test_mpi.py: one rank dies or stops mid-allreduce.

usage: fault_worker.py {exit,stop} PIDFILE_DIR
"""

import os
import signal
import sys

import numpy as np

import clusterctl.collective as cc

mode, piddir = sys.argv[1], sys.argv[2]
c = cc.init(timeout=float(os.environ.get("CLUSTERCTL_COLLECTIVE_TIMEOUT", "3")))
with open(os.path.join(piddir, f"{c.rank}.pid"), "w") as f:
    f.write(str(os.getpid()))
victim = c.size - 1
x = np.ones(1 << 16, dtype=np.float32)
xs = [np.ones(1000, dtype=np.float32) for _ in range(20)]
for step in range(10):
    if step == 3 and c.rank == victim:
        print(f"rank {c.rank}: injecting {mode}", flush=True)
        if mode == "exit":
            os._exit(1)
        os.kill(os.getpid(), signal.SIGSTOP)
    cc.allreduce(x, out=x)
    cc.grouped_allreduce(xs, inplace=True, threshold=8192)
print(f"rank {c.rank}: finished without noticing the fault", flush=True)
sys.exit(3)
