"""Start a job's ranks the way clusterctl's ssh launcher does, on this host: the plan's env plus the token.

Shared by the tests that run real MPI worlds through clusterctl's PMI server without mpiexec.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

from helpers import free_port, free_port_base, job_pids

from clusterctl.plan import make_plan
from clusterctl.spec import parse_spec

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent

#: What the host supervisor adds to every process's environment (clusterctl/host/spawn.py): the job token.
TOKEN = {"CLUSTERCTL_JOB_TOKEN": "7e57" * 16}


def plan_for(trainers: int, script, *args: str, name: str | None = None, entrypoint=None):
    """The plan clusterctl makes for a one-host collective job (launcher: ssh) of ``trainers`` ranks running
    ``[*entrypoint, script, *args]`` (entrypoint: this Python by default)."""
    name = name or f"pmitest-{secrets.token_hex(3)}"
    entry = [*(entrypoint or [sys.executable]), str(script)]
    spec = parse_spec(f"""
name: {name}
hosts: [{{address: 127.0.0.1}}]
job:
  entrypoint: [{', '.join(map(str, entry))}{''.join(', ' + a for a in args)}]
  trainers: {trainers}
  ports: {{trainer: {free_port_base(trainers)}, master: {free_port()}, control: {free_port()}}}
""")
    return make_plan(spec)


def start(trainer, *, stdout=subprocess.PIPE, cwd=ROOT, token=True, **extra) -> subprocess.Popen:
    """Start one rank with exactly the plan's env (plus PATH/HOME/LANG, the token and ``extra``)."""
    base = {k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "LANG")}
    env = {**base, **trainer.env, **(TOKEN if token else {}), "PYTHONPATH": str(ROOT), "UCX_LOG_LEVEL": "error",
           **{k: str(v) for k, v in extra.items()}}
    return subprocess.Popen(list(trainer.argv), env=env, cwd=cwd, stdout=stdout,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def finish(procs: list[subprocess.Popen], timeout: float) -> list[str]:
    """Wait for every rank (killing what is left at the deadline); their outputs."""
    outs = []
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            outs.append(p.communicate(timeout=max(0.1, deadline - time.monotonic()))[0])
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    return outs


def assert_no_orphans(job: str) -> None:
    """No process tagged with the job is left (within 15 s); kill and fail if one is."""
    deadline = time.monotonic() + 15
    while job_pids(job) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = job_pids(job)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, f"processes of job {job} left behind: {left}"
