"""Helpers for the ps tests: local jobs launched with the plan's env contract, the checkpoint tests' sync job
(free ports: tests/helpers.py)."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from helpers import free_ports

import zmq

from clusterctl.ps import Adam, PSClient
from clusterctl.ps.auth import Credentials, secure_client

__all__ = ["CKPT_TRAINERS", "REPO", "TOKEN", "LocalJob", "ckpt_grads", "ckpt_init", "ckpt_job", "in_threads", "job_env",
           "pulls_during_pushes", "raw_dealer"]

REPO = Path(__file__).resolve().parents[2]
#: The job token of the ps tests' pservers and trainers (conftest.py puts it into CLUSTERCTL_JOB_TOKEN).
TOKEN = secrets.token_hex(32)


def raw_dealer(endpoint: str, token: str | None = TOKEN, ctx: zmq.Context | None = None) -> zmq.Socket:
    """A bare DEALER connected to a pserver, with the job's CURVE keys of ``token`` (None: plain ZMTP)."""
    s = (ctx or zmq.Context.instance()).socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    secure_client(s, Credentials.from_token(token) if token else None)
    s.connect(f"tcp://{endpoint}")
    return s


def in_threads(target: Callable[[int], None], ids: Iterable[int], timeout: float = 25.0) -> None:
    """Run ``target(i)`` for each ``i`` in its own thread (trainers, usually), wait for each up to
    ``timeout`` seconds, and raise the first exception any of them raised."""
    errors: list[BaseException] = []

    def guarded(i: int) -> None:
        try:
            target(i)
        except BaseException as exc:  # surfaced in the calling thread below
            errors.append(exc)

    threads = [threading.Thread(target=guarded, args=(i,)) for i in ids]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    if errors:
        raise errors[0]


def job_env(role: str, index: int, pserver_eps: Sequence[str], trainer_eps: Sequence[str],
            extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment GUIDE section 2 gives process ``index`` of ``role`` ("pserver" or "trainer")."""
    own = (pserver_eps if role == "pserver" else trainer_eps)[index]
    ip, port = own.rsplit(":", 1)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PADDLE_", "CLUSTERCTL_", "TRAINING_"))}
    env.update({
        "CLUSTERCTL_JOB": "pstest",
        "CLUSTERCTL_ROLE": role,
        "TRAINING_ROLE": role.upper() if role == "pserver" else "TRAINER",
        "POD_IP": ip,
        "PADDLE_PORT": port,
        "PADDLE_CURRENT_ENDPOINT": own,
        "PADDLE_TRAINERS_NUM": str(len(trainer_eps)),
        "PADDLE_TRAINER_ENDPOINTS": ",".join(trainer_eps),
        "PADDLE_PSERVERS_IP_PORT_LIST": ",".join(pserver_eps),
        "PYTHONPATH": str(REPO) + os.pathsep + env.get("PYTHONPATH", ""),
        "PYTHONUNBUFFERED": "1",
        "CLUSTERCTL_JOB_TOKEN": TOKEN,  # what the host supervisor gives every process of a job
    })
    if role == "pserver":
        env["PADDLE_PSERVER_ID"] = str(index)
    else:
        env["PADDLE_TRAINER_ID"] = str(index)
    env.update(extra or {})
    return env


@dataclass
class LocalJob:
    """A pserver job as local processes (pservers first, then trainers), all on 127.0.0.1."""

    argv: Sequence[str]
    pservers: int = 2
    trainers: int = 3
    extra_env: Mapping[str, str] = field(default_factory=dict)
    trainer_argv: Sequence[str] = ()
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)

    def __post_init__(self) -> None:
        ports = free_ports(self.pservers + self.trainers)
        self.pserver_eps = [f"127.0.0.1:{p}" for p in ports[:self.pservers]]
        self.trainer_eps = [f"127.0.0.1:{p}" for p in ports[self.pservers:]]

    def start(self) -> LocalJob:
        """Start every process."""
        for role, n in (("pserver", self.pservers), ("trainer", self.trainers)):
            for i in range(n):
                env = job_env(role, i, self.pserver_eps, self.trainer_eps, self.extra_env)
                argv = list(self.argv) + (list(self.trainer_argv) if role == "trainer" else [])
                self.procs[f"{role}{i}"] = subprocess.Popen(
                    [sys.executable, *argv], env=env, cwd=REPO, stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT, text=True, start_new_session=True)
        return self

    def wait(self, timeout: float) -> dict[str, tuple[int, str]]:
        """Wait for every process; return ``{name: (exit code, output)}``; kill all on timeout."""
        deadline = time.monotonic() + timeout
        out: dict[str, tuple[int, str]] = {}
        try:
            for name, p in self.procs.items():
                text, _ = p.communicate(timeout=max(0.1, deadline - time.monotonic()))
                out[name] = (p.returncode, text)
        finally:
            self.kill()
        return out

    def kill(self) -> None:
        """SIGKILL whatever is still running."""
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
                p.communicate()


def pulls_during_pushes(endpoints: Sequence[str], n: int, push: str) -> tuple[list[float], list[tuple[float, float]]]:
    """Trainer 1 keeps calling `push` ("push" or "push_pull") with ones while trainer 0 pulls.

    Returns (the minimum of each pull, the pulls whose values were not all equal). Pulls at least 15 times,
    and on until the pusher's updates show up (bounded): a loaded machine may start the pusher late.
    """
    import threading

    import numpy as np

    from clusterctl.ps import SGD, PSClient

    stop = threading.Event()
    seen: list[float] = []
    torn: list[tuple[float, float]] = []

    def pusher() -> None:
        with PSClient(endpoints, trainer_id=1, num_trainers=2, mode="async", optimizer=SGD(1.0), timeout=20) as c:
            c.init({"w": np.zeros(n, np.float32)})
            ones = {"w": np.ones(n, np.float32)}
            while not stop.is_set():
                getattr(c, push)(ones)
            c.complete()

    with PSClient(endpoints, trainer_id=0, num_trainers=2, mode="async", optimizer=SGD(1.0), timeout=20) as c:
        c.init({"w": np.zeros(n, np.float32)})
        t = threading.Thread(target=pusher)
        t.start()
        out = {"w": np.empty(n, np.float32)}
        deadline = time.monotonic() + 15
        while len(seen) < 15 or (seen[-1] == seen[0] and time.monotonic() < deadline):
            w = c.pull(out=out)["w"]
            lo, hi = float(w.min()), float(w.max())
            seen.append(lo)
            if lo != hi:
                torn.append((lo, hi))
        stop.set()
        t.join(20)
        c.complete()
    return seen, torn


CKPT_TRAINERS = 3  # the sync trainers of ckpt_job


def ckpt_init():
    """The checkpoint tests' model: W (4000 x 5, seeded) and b."""
    rng = np.random.default_rng(3)
    return {"W": rng.normal(size=(4000, 5)).astype(np.float32), "b": np.zeros(5, np.float32)}


def ckpt_grads(p, tid, step):
    """Trainer ``tid``'s seeded least-squares gradients at ``step``."""
    rng = np.random.default_rng(100 * step + tid)
    x = rng.normal(size=(3, 4000)).astype(np.float32)
    err = x @ p["W"] + p["b"] - np.float32(1.0)
    return {"W": np.float32(2 / 3) * (x.T @ err), "b": np.float32(2 / 3) * err.sum(axis=0)}


def ckpt_job(eps, steps, *, save_at=None, root=None, load_root=None):
    """CKPT_TRAINERS sync trainers from their start step to ``steps``; trainer 0 saves after ``save_at`` steps."""
    out: dict[int, tuple[int, dict[str, np.ndarray]]] = {}

    def trainer(tid):
        with PSClient(eps, trainer_id=tid, num_trainers=CKPT_TRAINERS, mode="sync", optimizer=Adam(0.01),
                      timeout=20) as c:
            p = c.init(ckpt_init())
            if load_root is not None and tid == 0:
                c.load(load_root)
            start = c.start_step
            for step in range(start, steps):
                p = c.push_pull(ckpt_grads(p, tid, step), step=step)
                if tid == 0 and save_at == step + 1:
                    assert c.save(root, step + 1) == step + 1
            c.complete()
            out[tid] = (start, p)

    in_threads(trainer, range(CKPT_TRAINERS))
    return out
