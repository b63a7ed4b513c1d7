"""A rank for test_pmi_flood.py: join the MPI world (clusterctl.collective.init), allreduce, wait until the
test says the flood has arrived in full (the file GO exists), allreduce again and finish.
usage: pmi_flood_worker.py GO"""

import os
import sys
import time

import numpy as np

import clusterctl.collective as cc

go = sys.argv[1]
c = cc.init(timeout=float(os.environ.get("CLUSTERCTL_COLLECTIVE_TIMEOUT", "120")))
x = cc.allreduce(np.full(1000, c.rank + 1.0))
assert float(x[0]) == c.size * (c.size + 1) / 2
print(f"joined rank {c.rank}/{c.size}", flush=True)
deadline = time.monotonic() + 200
while not os.path.exists(go) and time.monotonic() < deadline:
    time.sleep(0.1)
y = cc.allreduce(np.full(1000, 2.0))
assert float(y[0]) == 2.0 * c.size
cc.barrier()
print(f"ok rank {c.rank}/{c.size} pid {os.getpid()} go={os.path.exists(go)}", flush=True)
cc.finalize()
