"""The semantic checks of a validated spec: what its models cannot see alone (duplicate hosts, pservers
named but not listed) and what only laying out its plan finds. What a backend cannot honour is that
backend's check (clusterctl.backends), made by every command that runs the spec.

Imports the models and clusterctl.plan; neither imports this module (clusterctl.spec.loading calls it)."""

from __future__ import annotations

from ..errors import SpecProblem
from ..plan import PlanError, make_plan
from ..yamlpos import Located
from .errors import problem
from .fields import _did_you_mean
from .job import PserversPerHost
from .models import ClusterSpec

__all__ = ["semantic_problems"]


def semantic_problems(loc: Located, source: str, spec: ClusterSpec, *, layout: bool = True) -> list[SpecProblem]:
    """What is wrong with a well-typed `spec`: Slurm's constraints, hosts, pservers, then (with `layout`)
    its plan's layout."""
    problems: list[SpecProblem] = []
    if not spec.hosts and spec.slurm is None:  # under Slurm the nodes give the hosts (clusterctl.backends.slurm)
        where = ("hostfile",) if spec.hostfile else ("hosts",)
        problems.append(problem(loc, source, where, "no hosts: list at least one host"))
    seen: dict[tuple[str, int], int] = {}
    for i, host in enumerate(spec.hosts):
        key = (host.address, host.port or spec.ssh.port)
        if key in seen:
            where = key[0] if key[1] is None else f"{key[0]}:{key[1]}"
            problems.append(problem(loc, source, ("hosts", i), f"duplicate host {where} (also hosts[{seen[key]}])"))
        else:
            seen[key] = i
        if spec.job.trainers == "gpu" and not host.gpus:
            problems.append(problem(loc, source, ("hosts", i), "job.trainers is 'gpu' but this host lists no gpus"))
    if isinstance(spec.job.pservers, tuple):
        addresses = {h.address for h in spec.hosts}
        for i, addr in enumerate(spec.job.pservers):
            if addr not in addresses:
                hint = _did_you_mean(addr, sorted(addresses))
                problems.append(problem(loc, source, ("job", "pservers", i), f"{addr} is not in hosts{hint}"))
    if spec.job.mode == "pserver" and _pserver_count(spec) == 0:
        problems.append(problem(loc, source, ("job", "pservers"), "pserver mode needs at least one pserver"))
    if spec.job.mode == "collective" and _pserver_count(spec) > 0:
        problems.append(problem(loc, source, ("job", "pservers"), "collective mode runs no pservers; set mode: pserver"))
    if problems or not layout:
        return problems
    try:
        make_plan(spec)
    except PlanError as exc:
        problems.append(problem(loc, source, exc.path, exc.message))
    return problems


def _pserver_count(spec: ClusterSpec) -> int:
    p = spec.job.pservers
    if isinstance(p, int):
        return p
    if isinstance(p, PserversPerHost):
        return p.per_host * len(spec.hosts)
    return len(p)
