"""`backend: slurm`: the job as one Slurm batch job, submitted over ssh to `slurm.login` (docs/slurm.md).

The plan is made as for SSH, with node i of the allocation planned as ``slurm-node-<i>.invalid``; inside the
allocation the same host supervisor as over SSH runs on every node (clusterctl/host/slurm.py), so the token,
restarts, fail-fast, attempt logs, the status reply and the sweep are the supervisor's. The operations are
in clusterctl/ops/slurm.py.
"""

from __future__ import annotations

import re
from typing import ClassVar

from ..host.status import JobStatus
from .base import Backend, LineCallback, Placement, Progress, StopReport, killed_count

__all__ = ["SlurmBackend"]

_PLACED = "Slurm places the nodes; hosts: gives only the shape (gpus, slots) of node i"
# sbatch --time's forms (sbatch(1)): minutes, minutes:seconds, hours:minutes:seconds, days-hours,
# days-hours:minutes, days-hours:minutes:seconds; no limit: -1, INFINITE or UNLIMITED
_SLURM_TIME = re.compile(r"\d+(:\d+){0,2}|\d+-\d+(:\d+){0,2}|-1|(?i:infinite|unlimited)")


class SlurmBackend(Backend):
    """Jobs as Slurm batch jobs: sbatch, scontrol/sacct, srun --overlap, scancel over ssh to a login node."""

    name: ClassVar[str] = "slurm"
    summary: ClassVar[str] = "one Slurm batch job, submitted over ssh to slurm.login: a supervisor on each node"
    unsupported = (
        ("data", "data: is not dealt under Slurm yet; put the files in the workspace"),
        ("hostfile", "Slurm places the nodes; give slurm.nodes (or hosts: for the shape of each node)"),
        ("hosts.*.address", _PLACED),
        ("hosts.*.port", _PLACED),
        ("hosts.*.user", _PLACED + " (ssh.user is the login's and the nodes' user)"),
        ("hosts.*.proxy_jump", _PLACED + " (ssh.proxy_jump reaches the login node and the nodes)"),
        ("hosts.*.train_address", _PLACED + " (slurm.endpoints: ip | hostname picks the endpoints' address)"),
        ("hosts.*.spare", "a Slurm allocation is the job's hosts: spares and min_hosts are the SSH backend's"),
        ("job.min_hosts", "a Slurm allocation is the job's hosts: spares and min_hosts are the SSH backend's"),
    )

    @classmethod
    def check_spec(cls, spec) -> list:
        """slurm: section present; nodes or hosts give the shape; pservers by count; launcher ssh; a shared
        workspace is absolute; the time limit in one of sbatch's forms; the log dir is an #SBATCH value (one word)."""
        from ..spec.errors import problem

        loc, source, problems = spec.located, spec.source, []
        if loc is None:
            return []
        if spec.slurm is None:
            return [problem(loc, source, ("backend",), "backend: slurm needs a slurm: section (login:, nodes:, ...)")]
        given = loc.data.get("hosts") if isinstance(loc.data, dict) else None
        for i, entry in enumerate(given if isinstance(given, list) else ()):
            if isinstance(entry, str):  # `hosts: [n1, n2]`: addresses only (hosts.*.address below)
                problems.append(problem(loc, source, ("hosts", i), f"an address is not supported with backend: slurm: "
                                        f"{_PLACED}"))
        if spec.slurm.nodes is None and not given:
            problems.append(problem(loc, source, ("slurm",), "give slurm.nodes (or hosts, for the shape of each node)"))
        if spec.slurm.nodes is not None and given and spec.slurm.nodes != len(given):
            problems.append(problem(loc, source, ("slurm", "nodes"), f"{spec.slurm.nodes} nodes but {len(given)} hosts"))
        if spec.job.launcher == "mpi":
            problems.append(problem(loc, source, ("job", "launcher"), "not supported with backend: slurm: launcher: "
                                    "mpi; use launcher: ssh (clusterctl's own PMI server)"))
        if isinstance(spec.job.pservers, tuple):
            problems.append(problem(loc, source, ("job", "pservers"),
                                    "under Slurm the nodes are known at run time: give a count or {per_host: N}"))
        if spec.slurm.workspace == "shared" and not spec.workspace.remote.startswith("/"):
            problems.append(problem(loc, source, ("workspace", "remote"),
                                    "slurm.workspace: shared needs an absolute path on the shared filesystem"))
        if spec.slurm.time is not None and not _SLURM_TIME.fullmatch(spec.slurm.time):
            problems.append(problem(loc, source, ("slurm", "time"), f"{spec.slurm.time!r} is not a Slurm time limit: "
                                    "write one of \"MINUTES\", \"MM:SS\", \"HH:MM:SS\", \"D-HH\", \"D-HH:MM\", "
                                    "\"D-HH:MM:SS\", \"UNLIMITED\""))
        bad = next((c for c in spec.job.log_dir if c.isspace() or c == "\\"), None)
        if bad is not None:
            problems.append(problem(loc, source, ("job", "log_dir"), f"under Slurm the log dir is an #SBATCH "
                                    f"--output value: no whitespace or backslash (found {bad!r})"))
        return problems

    @classmethod
    def placement(cls, spec, plan) -> Placement:
        """Node i of the allocation, Slurm's choice at start: not the plan's placeholder hosts, nor their ssh
        connections (`plan` listed `slurm-node-0.invalid`, and no word of the login node)."""
        index = {h.address: i for i, h in enumerate(plan.hosts)}
        procs = plan.processes

        def row(n: int) -> tuple[str, str, str, str, str, str, str]:
            p = procs[n]
            node = f"node {index[p.host.address]}"
            return (node, p.role, str(p.id), "" if p.rank is None else str(p.rank),
                    p.endpoint.replace(p.host.address, f"<{node}>"), ",".join(map(str, p.gpus)), " ".join(p.argv))

        s = spec.slurm
        where = f"partition {s.partition}" if s.partition else "the default partition"
        return Placement("node", len(procs), row, f"backend: slurm, {len(plan.hosts)} node(s) of {where}",
                         f"sbatch through ssh to {s.login}; Slurm picks the nodes at start, and the endpoints use "
                         f"each node's {'IP' if s.endpoints == 'ip' else 'name'} then")

    def __init__(self, spec, plan, *, spec_path=None, options=None):
        super().__init__(spec, plan, spec_path=spec_path, options=options)
        self._closing: list = []

    def dispatch(self, *, on_progress: Progress | None = None) -> list:
        """The workspace to every node of the partition (or to the login node, for a shared workspace)."""
        from ..ops.slurm import dispatch

        return dispatch(self.spec, self.plan)

    def start(self, *, on_progress: Progress | None = None) -> JobStatus:
        """Submit the batch job (it starts a supervisor on every node)."""
        from ..ops.slurm import start

        return start(self.spec, self.plan, on_progress=on_progress)

    def status(self) -> JobStatus:
        """Slurm's word for the allocation, folded with every node's supervisor's status."""
        from ..ops.slurm import status

        return status(self.spec, self.plan)

    def logs(self, *, on_line: LineCallback, follow: bool = False, role: str | None = None, id: int | None = None,
             host: str | None = None, lines: int | None = None) -> int:
        """Every node's logs (every attempt), read by its agent over ssh."""
        from ..errors import JobError
        from ..ops.slurm import logs

        if host is not None:
            raise JobError("--host selects nothing under backend: slurm (nodes are Slurm's choice); use --role/--id")
        return logs(self.spec, self.plan, on_line=on_line, follow=follow, role=role, id=id, lines=lines)

    def top_asks(self, request) -> list:
        """One TopAsk: every node's supervisor's `top` reply in one srun --overlap step from the login node."""
        from ..ops.slurm import SlurmTop
        from ..ops.top import TopAsk

        asker = SlurmTop(self.spec, self.plan, request)
        self._closing.append(asker.close)
        return [TopAsk((asker.login.label,), asker)]

    def close(self) -> None:
        """Close what `top` holds open (the connection to the login node)."""
        while self._closing:
            self._closing.pop()()

    def stop(self, *, grace: float | None = None) -> StopReport:
        """Every supervisor's stop (grace, then the sweep by the job's tag), then scancel."""
        from ..ops.slurm import stop

        res = stop(self.spec, self.plan, grace=grace)
        replies = {n: r for n, r in res["replies"].items() if r and isinstance(r, dict)}  # a node's word: a JSON object
        sj = res["slurm"]
        detail = f"Slurm job {sj['id']} {sj['state']}" if sj else (
            f"Slurm job {res['slurm_job']}" if res["slurm_job"] else "")
        left = {n: r["left"] for n, r in replies.items() if r.get("left")}
        return StopReport(
            job=self.plan.job,
            was_running=res["was_running"] or any(r.get("was_running") for r in replies.values()),
            hosts=len(replies),
            killed=killed_count(replies.values()),
            left=left,
            detail=detail,
        )
