"""Reading the process environment clusterctl's plan gives trainers and pservers (GUIDE section 2)."""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .auth import AUTH_ENV, TOKEN_ENV
from .endpoints import duplicate_endpoints, parse_endpoint_list, split_endpoint
from .protocol import (CHUNK_ENV, DEFAULT_CHUNK_BYTES, MAX_CHUNK_BYTES, MAX_TIMEOUT, PIPELINE_ENV, chunk_bytes_ok,
                       env_flag)
from .errors import PsConfigError
from .optim import OptimizerConfig

__all__ = ["PIPELINE_ENV", "PsEnv", "client_from_env", "env_flag", "from_env", "server_from_env"]

_ROLES = {"TRAINER": "trainer", "PSERVER": "pserver"}
_INT = re.compile(r"[+-]?[0-9]+")  # ASCII digits only: int() would also take "1_0" and non-ASCII digits


@dataclass(frozen=True)
class PsEnv:
    """The parameter-server view of one process's environment."""

    role: str  # "trainer" | "pserver"
    endpoints: tuple[str, ...]
    current_endpoint: str
    trainer_id: int
    num_trainers: int
    pserver_id: int
    mode: str
    k_steps: int
    job: str
    barrier_timeout: float
    timeout: float
    checkpoint_dir: str | None
    checkpoint_every: int = 0
    pipeline: bool = True


MAX_TRAINERS = 1 << 16  # trainers of one job: beyond any plan (16,384 processes); their ids fit in one reply


def _int(env: Mapping[str, str], name: str, default: int | None = None, most: int = 10**9) -> int:
    raw = env.get(name)
    if raw is None or raw == "":
        if default is None:
            raise PsConfigError(f"environment variable {name} is not set")
        return default
    if not _INT.fullmatch(raw.strip()):
        raise PsConfigError(f"environment variable {name}={raw!r} is not an integer")
    if int(raw) > most:  # what the wire carries, and what a job can be: a typo's 10**18 is refused here
        raise PsConfigError(f"environment variable {name}={raw.strip()} is more than {most:,}")
    return int(raw)


def _seconds(env: Mapping[str, str], name: str, default: float) -> float:
    """A timeout in seconds: a finite number > 0, at most MAX_TIMEOUT."""
    raw = env.get(name)
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise PsConfigError(f"environment variable {name}={raw!r} is not a number") from None
    if not (math.isfinite(value) and value > 0):
        raise PsConfigError(f"environment variable {name}={raw!r} must be a finite number of seconds > 0")
    if value > MAX_TIMEOUT:
        raise PsConfigError(f"environment variable {name}={raw.strip()} is more than {MAX_TIMEOUT:,.0f} seconds")
    return value


def _endpoints(raw: str) -> tuple[str, ...]:
    """PADDLE_PSERVERS_IP_PORT_LIST: planned endpoints, each a real port, none twice."""
    endpoints = parse_endpoint_list(raw)
    for ep in endpoints:
        if split_endpoint(ep)[1] == 0:
            raise PsConfigError(f"PADDLE_PSERVERS_IP_PORT_LIST: endpoint {ep!r} has port 0 (a pserver must "
                                "listen on its planned port)")
    dups = duplicate_endpoints(endpoints)  # also when written two ways: localhost / 127.0.0.1, :06170, tcp://
    if dups:
        raise PsConfigError(f"PADDLE_PSERVERS_IP_PORT_LIST names {', '.join(dups)} more than once")
    return endpoints


def from_env(env: Mapping[str, str] | None = None) -> PsEnv:
    """Parse TRAINING_ROLE, PADDLE_* and CLUSTERCTL_PS_* into a :class:`PsEnv`."""
    e = os.environ if env is None else env
    role_raw = e.get("TRAINING_ROLE", "")
    if role_raw.upper() not in _ROLES:
        raise PsConfigError(f"TRAINING_ROLE must be TRAINER or PSERVER, got {role_raw!r}")
    role = _ROLES[role_raw.upper()]
    if not e.get("PADDLE_PSERVERS_IP_PORT_LIST"):
        raise PsConfigError("environment variable PADDLE_PSERVERS_IP_PORT_LIST is not set")
    endpoints = _endpoints(e["PADDLE_PSERVERS_IP_PORT_LIST"])
    current = e.get("PADDLE_CURRENT_ENDPOINT", "")
    if not current and e.get("POD_IP") and e.get("PADDLE_PORT"):
        current = f"{e['POD_IP']}:{e['PADDLE_PORT']}"
    num_trainers = _int(e, "PADDLE_TRAINERS_NUM", most=MAX_TRAINERS)
    if num_trainers < 1:
        raise PsConfigError(f"PADDLE_TRAINERS_NUM must be >= 1, got {num_trainers}")
    # A trainer of a multi-trainer job must know its id: defaulting to 0 would alias trainer 0.
    trainer_id = _int(e, "PADDLE_TRAINER_ID", 0 if role == "pserver" or num_trainers == 1 else None)
    pserver_id = 0
    if role == "pserver":
        if not current:
            raise PsConfigError("a pserver needs PADDLE_CURRENT_ENDPOINT (or POD_IP and PADDLE_PORT)")
        fallback = endpoints.index(current) if current in endpoints else None
        pserver_id = _int(e, "PADDLE_PSERVER_ID", fallback)
        if not 0 <= pserver_id < len(endpoints) or endpoints[pserver_id] != current:
            raise PsConfigError(f"PADDLE_PSERVER_ID={pserver_id} does not name {current} in "
                                f"PADDLE_PSERVERS_IP_PORT_LIST={','.join(endpoints)}")
    elif not 0 <= trainer_id < num_trainers:
        raise PsConfigError(f"PADDLE_TRAINER_ID={trainer_id} is outside 0..{num_trainers - 1}")
    mode = e.get("CLUSTERCTL_PS_MODE", "sync") or "sync"
    if mode not in ("sync", "async", "geo"):
        raise PsConfigError(f"CLUSTERCTL_PS_MODE must be sync, async or geo, got {mode!r}")
    k_steps = _int(e, "CLUSTERCTL_PS_K_STEPS", 1)
    if k_steps < 1:
        raise PsConfigError(f"CLUSTERCTL_PS_K_STEPS must be >= 1, got {k_steps}")
    chunk = _int(e, CHUNK_ENV, DEFAULT_CHUNK_BYTES, most=MAX_CHUNK_BYTES)
    if not chunk_bytes_ok(chunk):  # read (leniently) at import by ps.protocol: refused here, where it is the job's
        raise PsConfigError(f"{CHUNK_ENV} must be a positive multiple of 8, got {chunk}")
    barrier = _seconds(e, "CLUSTERCTL_PS_BARRIER_TIMEOUT", 300.0)
    every = _int(e, "CLUSTERCTL_PS_CHECKPOINT_EVERY", 0)
    if every < 0:
        raise PsConfigError(f"CLUSTERCTL_PS_CHECKPOINT_EVERY must be >= 0 (0: no periodic saves), got {every}")
    pipeline = env_flag(e, PIPELINE_ENV, True)  # a trainer's; refused in a pserver too: one job, one environment
    return PsEnv(role, endpoints, current, trainer_id, num_trainers, pserver_id, mode, k_steps,
                 e.get("CLUSTERCTL_JOB", ""), barrier, _seconds(e, "CLUSTERCTL_PS_TIMEOUT", min(barrier + 60.0, MAX_TIMEOUT)),
                 e.get("CLUSTERCTL_PS_CHECKPOINT") or None, every, pipeline)


def _auth(env: Mapping[str, str] | None) -> dict[str, str]:
    """``token``/``auth`` from an explicit ``env`` mapping (none given: the constructors read os.environ)."""
    return {} if env is None else {"token": env.get(TOKEN_ENV, ""), "auth": env.get(AUTH_ENV, "")}


def client_from_env(*, optimizer: OptimizerConfig | None = None, env: Mapping[str, str] | None = None,
                    **overrides: Any):
    """A :class:`~clusterctl.ps.client.PSClient` configured from the environment (kwargs override)."""
    from .client import PSClient

    pe = from_env(env)
    kw: dict[str, Any] = dict(trainer_id=pe.trainer_id, num_trainers=pe.num_trainers, mode=pe.mode,
                              k_steps=pe.k_steps, timeout=pe.timeout, job=pe.job, optimizer=optimizer,
                              pipeline=pe.pipeline)
    kw.update(_auth(env))
    kw.update(overrides)
    return PSClient(pe.endpoints, **kw)


def server_from_env(*, env: Mapping[str, str] | None = None, **overrides: Any):
    """A :class:`~clusterctl.ps.server.ParameterServer` configured from the environment (kwargs override)."""
    from .server import ParameterServer

    pe = from_env(env)
    if pe.role != "pserver":
        raise PsConfigError(f"TRAINING_ROLE is {pe.role.upper()}, not PSERVER")
    kw: dict[str, Any] = dict(server_id=pe.pserver_id, num_servers=len(pe.endpoints),
                              num_trainers=pe.num_trainers, mode=pe.mode, k_steps=pe.k_steps,
                              barrier_timeout=pe.barrier_timeout, checkpoint_dir=pe.checkpoint_dir,
                              checkpoint_every=pe.checkpoint_every, job=pe.job)
    kw.update(_auth(env))
    kw.update(overrides)
    return ParameterServer(pe.current_endpoint, **kw)
