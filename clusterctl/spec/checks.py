"""The semantic checks of a validated spec: what its models cannot see alone (duplicate hosts, pservers
named but not listed, Slurm's constraints) and what only laying out its plan finds.

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


def _slurm_problems(loc: Located, source: str, spec: ClusterSpec) -> list[SpecProblem]:
    if spec.backend != "slurm":
        return [problem(loc, source, ("slurm",), "a slurm: section needs backend: slurm")] if spec.slurm else []
    if spec.slurm is None:
        return [problem(loc, source, ("backend",), "backend: slurm needs a slurm: section (login:, nodes:, ...)")]
    problems = []
    given = loc.data.get("hosts") if isinstance(loc.data, dict) else None
    if spec.slurm.nodes is None and not given:
        problems.append(problem(loc, source, ("slurm",), "give slurm.nodes (or hosts, for the shape of each node)"))
    if spec.slurm.nodes is not None and given and spec.slurm.nodes != len(given):
        problems.append(problem(loc, source, ("slurm", "nodes"), f"{spec.slurm.nodes} nodes but {len(given)} hosts"))
    if isinstance(spec.job.pservers, tuple):
        problems.append(problem(loc, source, ("job", "pservers"),
                                 "under Slurm the nodes are known at run time: give a count or {per_host: N}"))
    if spec.job.launcher == "mpi":
        problems.append(problem(loc, source, ("job", "launcher"),
                                 "launcher: mpi is not supported with backend: slurm"))
    if spec.data is not None:
        problems.append(problem(loc, source, ("data",), "data: is not supported with backend: slurm yet; "
                                 "put the files in the workspace"))
    if spec.slurm.workspace == "shared" and not spec.workspace.remote.startswith("/"):
        problems.append(problem(loc, source, ("workspace", "remote"),
                                 "slurm.workspace: shared needs an absolute path on the shared filesystem"))
    return problems


def semantic_problems(loc: Located, source: str, spec: ClusterSpec, *, layout: bool = True) -> list[SpecProblem]:
    """What is wrong with a well-typed `spec`: Slurm's constraints, hosts, pservers, then (with `layout`)
    its plan's layout."""
    problems = _slurm_problems(loc, source, spec)
    if problems:
        return problems
    if not spec.hosts:
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
