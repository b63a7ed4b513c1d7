"""A plain mpi4py program (no clusterctl import) for test_pmi_spawn.py, run as
``python -m clusterctl.collective spawn_worker.py MODE DIR`` under the ssh launcher's environment.

Modes of the job's ranks: spawn, refused, abort, abort-at-exit, abort-child, crash-child, early-exit, futures.
Modes of spawned processes: child-report, child-abort, child-crash.
"""

import json
import os
import sys
import time

from mpi4py import MPI

world = MPI.COMM_WORLD
me = world.Get_rank()


def report(comm):
    """A child's view of itself, gathered by the parent over the intercommunicator."""
    env = os.environ
    info = {"rank": world.Get_rank(), "size": world.Get_size(), "appnum": world.Get_attr(MPI.APPNUM),
            "job": env.get("CLUSTERCTL_JOB"), "jobdir": env.get("CLUSTERCTL_JOBDIR"),
            "token": env.get("CLUSTERCTL_JOB_TOKEN"), "RANK": env.get("RANK"), "WORLD_SIZE": env.get("WORLD_SIZE"),
            "spawned": env.get("PMI_SPAWNED"), "cwd": os.getcwd(), "argv": sys.argv[4:], "pid": os.getpid()}
    comm.gather(info, root=int(sys.argv[3]))     # the spawning rank in the parent group


def spawn(comm, cmds, args, nprocs, info=MPI.INFO_NULL, root=0):
    inter = comm.Spawn_multiple(cmds, args, nprocs, info=info, root=root)
    got = inter.gather(None, root=MPI.ROOT if comm.Get_rank() == root else MPI.PROC_NULL)
    inter.Disconnect()
    return got


def main(mode, outdir):
    """Run one mode (the module is also imported by mpi4py.futures' workers: nothing runs then)."""
    if mode == "child-report":
        parent = MPI.Comm.Get_parent()
        report(parent)
        parent.Disconnect()
    elif mode == "child-abort":             # a world of two: MPI_Abort reaches the process manager
        parent = MPI.Comm.Get_parent()
        if me == 0:
            world.Abort(5)
        parent.Barrier()                    # never completes: the job is ended
    elif mode == "child-crash":
        MPI.Comm.Get_parent()
        os._exit(3)
    elif mode == "spawn":
        py, me_py = sys.executable, os.path.abspath(__file__)
        single = spawn(MPI.COMM_SELF, [py], [[me_py, "child-report", outdir, "0", "a b", "c\\d"]], [2])
        wdir = MPI.Info.Create()
        wdir.Set("wdir", outdir)
        here = MPI.Info.Create()
        here.Set("host", "localhost")
        multi = spawn(MPI.COMM_SELF, [py, py], [[me_py, "child-report", outdir, "0", "x"], [me_py, "child-report", outdir, "0", "y"]],
                      [1, 2], info=[wdir, here])
        by_world = spawn(world, [py], [[me_py, "child-report", outdir, "1", "world"]], [1], root=1)
        print("REPORT " + json.dumps({"rank": me, "single": single, "multi": multi, "by_world": by_world}), flush=True)
    elif mode == "refused":
        py, me_py = sys.executable, os.path.abspath(__file__)
        foreign = MPI.Info.Create()
        foreign.Set("host", "no-such-host.invalid")
        for what, cmds, info in [("foreign host", [py], [foreign]), ("missing program", [py, "/no/such/program"],
                                                                      [MPI.INFO_NULL, MPI.INFO_NULL])]:
            try:
                MPI.COMM_SELF.Spawn_multiple(cmds, [[me_py, "child-report", outdir, "0"]] * len(cmds), [1] * len(cmds), info=info)
                print(f"SPAWNED {what}", flush=True)
            except MPI.Exception as e:
                print(f"REFUSED {what} class={e.Get_error_class()}", flush=True)
        ok = spawn(MPI.COMM_SELF, [py], [[me_py, "child-report", outdir, "0", "after"]], [1])
        world.Barrier()
        print(f"AFTER rank={me} children={len(ok)}", flush=True)
    elif mode in ("abort", "abort-at-exit"):
        world.Barrier()
        if me == world.Get_size() - 1:
            print(f"ABORTING rank={me}", flush=True)
            world.Abort(7 if mode == "abort" else 9)
            if mode == "abort":
                print("ABORT RETURNED", flush=True)
                time.sleep(60)
        else:
            world.Barrier()            # never completes: the job is ended
            print("BARRIER COMPLETED", flush=True)
    elif mode in ("abort-child", "crash-child"):
        world.Barrier()
        if me == 0:
            kind = "child-abort" if mode == "abort-child" else "child-crash"
            inter = MPI.COMM_SELF.Spawn(sys.executable, [os.path.abspath(__file__), kind, outdir], 2 if
                                        kind == "child-abort" else 1)
            inter.Barrier()            # never completes: the job is ended
        world.Barrier()
        print("BARRIER COMPLETED", flush=True)
    elif mode == "early-exit":
        world.Barrier()
        if me == 1:
            print("LEAVING rank=1", flush=True)
            os._exit(0)                # no MPI_Finalize
        time.sleep(1)
        print(f"FINALIZING rank={me}", flush=True)
    elif mode == "futures":
        from mpi4py.futures import MPIPoolExecutor

        with MPIPoolExecutor(max_workers=2) as pool:
            got = list(pool.map(pow, range(10), [2] * 10))
        print(f"FUTURES rank={me} sum={sum(got)}", flush=True)
    else:
        sys.exit(f"unknown mode {mode}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
