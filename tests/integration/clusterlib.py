"""Helpers for integration tests: specs derived from the session cluster, CLI runs, docker, orphan checks.

Every integration module imports what it shares from here (not from another test module); helpers that
need no cluster (free ports, the local /proc sweep) are in tests/helpers.py.
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import yaml
from helpers import job_pids

from clusterctl.testcluster import NODE_UID

ROOT = Path(__file__).resolve().parents[2]
JOBS = Path(__file__).resolve().parent / "jobs"  # job.py: pservers listen, trainers print step=N
# each job gets its own port range, across every module of the session; above the fixed ranges other modules use
# (7400-7819: fit_a_line, Slurm, MPI, elastic jobs). From 7000 the 23rd job got test_ps_cluster's 7440, and on a
# quiet machine its pserver port was still in TIME_WAIT on the same node: the test pserver's bind failed.
_ports = itertools.count(9000, 20)


def port_base() -> int:
    """The first of 20 ports no other job of this session uses (9000, 9020, ...)."""
    return next(_ports)


def dump_spec(path: Path, spec: dict, sections: dict) -> Path:
    """Write `spec` plus `sections` (an `ssh` section is merged into the spec's own) to `path` as YAML."""
    for key, value in sections.items():
        if key == "ssh":
            spec["ssh"].update(value)
        else:
            spec[key] = value
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def write_spec(info, path: Path, *, name: str, hosts: int | None = None, **sections) -> Path:
    """A spec for the session cluster: its ssh section and first `hosts` nodes, plus `sections`."""
    base = yaml.safe_load(Path(info.spec_path).read_text())
    spec = {"name": name, "ssh": dict(base["ssh"]), "hosts": base["hosts"][: hosts or len(base["hosts"])]}
    return dump_spec(path, spec, sections)


def job_spec(info, tmp_path, name, *, hosts=3, mode="pserver", pservers=2, trainers=1, env=None, grace=3, **job):
    """A spec running tests/integration/jobs/job.py on the first `hosts` nodes, on ports of its own; any earlier
    run of the job (a kept cluster) is stopped first."""
    base = port_base()
    spec_job = {
        "mode": mode,
        "entrypoint": ["python3", "job.py"],
        "args": ["{role}", "{id}"],
        "trainers": trainers,
        "env": env or {},
        "grace": grace,
        "ports": {"control": base, "master": base + 1, "pserver": base + 2, "trainer": base + 10},
        **job,
    }
    if mode == "pserver":
        spec_job["pservers"] = pservers
    spec = write_spec(
        info, tmp_path / f"{name}.yaml", name=name, hosts=hosts,
        workspace={"local": str(JOBS), "remote": f"clusterctl-it/{name}"}, job=spec_job,
    )
    clusterctl("stop", spec)  # a kept cluster may hold a crashed earlier run of this job
    return spec


def via(info) -> str:
    """What clusterctl's connection errors add after a host reached through the cluster's bastion ("" without one)."""
    return f" (through {info.proxy_jump})" if info.bastion else ""


def bastion_pins(info) -> str:
    """The cluster's known_hosts lines for its bastion ("" without one): a test of the nodes' host keys starts
    its own known_hosts file from these, so that the first hop is verified as usual."""
    if not info.bastion:
        return ""
    lines = Path(info.known_hosts_path).read_text().splitlines(keepends=True)
    return "".join(line for line in lines if line.split(maxsplit=1)[0] in (info.bastion.ip, f"[{info.bastion.ip}]:22"))


def clusterctl(*args: str, timeout: float = 120, check: bool = False, input: str | None = None) -> subprocess.CompletedProcess:
    """Run the real CLI in a subprocess (stdin closed unless `input`), capturing text output."""
    res = subprocess.run(
        [sys.executable, "-m", "clusterctl.cli", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL if input is None else None,
        input=input,
        env={**os.environ, "COLUMNS": "200"},
    )
    if check and res.returncode != 0:
        raise AssertionError(f"clusterctl {' '.join(map(str, args))} exited {res.returncode}\n{res.stdout}\n{res.stderr}")
    return res


@contextlib.contextmanager
def cli_to_interrupt(*args: str, env: dict | None = None) -> Iterator[subprocess.Popen]:
    """`clusterctl ARGS` as a user runs it at a terminal before pressing Ctrl+C: SIGINT at its default however the
    suite was started, faulthandler on (interrupt() prints its threads if it hangs), stdout and stderr merged,
    stdin closed. Killed on the way out if still running."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "clusterctl.cli", *map(str, args)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, stdin=subprocess.DEVNULL,
        env={**(os.environ if env is None else env), "PYTHONFAULTHANDLER": "1"},
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def read_until(proc: subprocess.Popen, done: Callable[[list[str]], bool], timeout: float) -> list[str]:
    """The lines `proc` printed until done(lines) held, it ended, or `timeout` passed (checked at each line)."""
    seen: list[str] = []
    deadline = time.monotonic() + timeout
    for line in proc.stdout:
        seen.append(line)
        if done(seen) or time.monotonic() > deadline:
            break
    return seen


def interrupt(proc: subprocess.Popen, timeout: float, sig: int = signal.SIGINT) -> str:
    """Ctrl+C: a process-directed SIGINT (any thread may take it; the main one must still see it), or `sig`. The
    rest of the output once `proc` ended; a failure with every thread's stack when it did not end within `timeout`."""
    proc.send_signal(sig)
    try:
        return proc.communicate(timeout=timeout)[0]
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGABRT)
        rest, _ = proc.communicate(timeout=30)
        pytest.fail(f"{proc.args[3:5]} did not end within {timeout:g} s of {signal.Signals(sig).name}; its threads then:\n" + rest[-8000:])


def wait_until(cond: Callable[[], bool], timeout: float, interval: float = 0.5) -> bool:
    """Poll cond() until it holds or `timeout` passes; its last value."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(interval)
    return True


def docker(*args: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess:
    """Run the docker CLI."""
    return subprocess.run(["docker", *args], capture_output=True, text=True, check=check, timeout=timeout)


def node_exec(container: str, script: str, *, check: bool = True, timeout: float = 60, user: str = "root") -> str:
    """Run a shell script inside a node (as root, or as `user`) and return its stdout."""
    return docker("exec", "-u", user, container, "sh", "-c", script, check=check, timeout=timeout).stdout


def clusterctl_while_paused(container: str, *args, timeout: float = 60) -> tuple[subprocess.CompletedProcess, float]:
    """Run `clusterctl ARGS` while `container` is frozen (`docker pause`); return its result and wall time."""
    docker("pause", container)
    try:
        t0 = time.monotonic()
        res = clusterctl(*args, timeout=timeout)
        elapsed = time.monotonic() - t0
    finally:
        docker("unpause", container)
    return res, elapsed


def mlp_single(steps: int, batch: int) -> tuple[str, str]:
    """(final loss, checksum) that examples/mlp_collective/train.py prints when run as one process (`--single`)
    on this machine: what every rank of a distributed run of the same steps and batch must match."""
    single = subprocess.run(
        [sys.executable, str(ROOT / "examples/mlp_collective/train.py"), "--single", "--steps", str(steps),
         "--batch", str(batch)],
        capture_output=True, text=True, check=True,
    ).stdout
    return re.search(rf"done steps={steps} loss=([\d.]+) .* checksum=([\d.]+)", single).groups()


def assert_mlp_ranks_match_single(stdout: str, *, ranks: int, steps: int, batch: int) -> None:
    """Every rank 0..ranks-1 of an mlp_collective run (`start --follow` output) printed `done` with the checksum of
    the single-process run of the same steps and batch."""
    done = re.findall(rf"trainer\.(\d)\] done steps={steps} loss=([\d.]+) .* checksum=([\d.]+)", stdout)
    assert sorted(t for t, _, _ in done) == [str(i) for i in range(ranks)], stdout[-3000:]
    _, ref_sum = mlp_single(steps, batch)
    assert all(float(c) == pytest.approx(float(ref_sum), rel=1e-9) for _, _, c in done)


# Lists pids whose environment carries CLUSTERCTL_JOB=<job> exactly (GUIDE §3's definition of an orphan): the
# same finder the local tests use (tests/helpers.py), its source run by the node's python3.
_FIND_TAGGED = "import os, sys\n\n" + inspect.getsource(job_pids) + "\nprint(*job_pids(sys.argv[1]), sep='\\n')\n"


def tagged_pids(container: str, job: str) -> list[int]:
    """Pids in `container` whose environment has CLUSTERCTL_JOB=<job>."""
    # Docker's root lacks CAP_SYS_PTRACE, without which it cannot read another user's environ: the finder also
    # runs as the test clusters' login user (uid NODE_UID), whose jobs would otherwise go unseen (and every
    # orphan check pass).
    found: set[int] = set()
    for uid in ("0", str(NODE_UID)):
        out = docker("exec", "-u", uid, container, "python3", "-c", _FIND_TAGGED, job).stdout
        found.update(int(x) for x in out.split())
    return sorted(found)


def listening(container: str, port: int) -> bool:
    """True when something in `container` listens on TCP `port`."""
    out = node_exec(container, "cat /proc/net/tcp /proc/net/tcp6 2>/dev/null")
    want = f":{port:04X}"
    return any(line.split()[1].endswith(want) and line.split()[3] == "0A" for line in out.splitlines()[1:] if len(line.split()) > 3)


def status_json(spec: Path) -> dict:
    """`clusterctl status --json` parsed."""
    res = clusterctl("status", spec, "--json")
    return json.loads(res.stdout)


def assert_no_orphans(info, job, ports=(), hosts=None, within=10.0):
    """GUIDE §3: no process carrying CLUSTERCTL_JOB=<job> on any node, and the job's ports are free."""
    deadline = time.monotonic() + within
    while True:
        left = {n.container: tagged_pids(n.container, job) for n in (hosts or info.nodes)}
        busy = [(n.container, p) for n in (hosts or info.nodes) for p in ports if listening(n.container, p)]
        if not any(left.values()) and not busy:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"orphans of {job}: {left}, ports still listening: {busy}")
        time.sleep(0.5)


def wait_state(spec, want, timeout=30.0):
    """Poll `status --json` until the job's state is one of `want`."""
    deadline = time.monotonic() + timeout
    while True:
        st = status_json(spec)
        if st["state"] in want:
            return st
        if time.monotonic() > deadline:
            raise AssertionError(f"job never reached {want}: {st}")
        time.sleep(0.5)


def job_ports(spec_path):
    """The ports a job_spec-style spec uses (pservers 0-1, trainer base, control)."""
    p = yaml.safe_load(Path(spec_path).read_text())["job"]["ports"]
    return [p["pserver"], p["pserver"] + 1, p["trainer"], p["control"]]
