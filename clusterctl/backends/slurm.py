"""`backend: slurm`: the job as one Slurm batch job, submitted over ssh to `slurm.login` (docs/slurm.md).

The plan is made as for SSH, with node i of the allocation planned as ``slurm-node-<i>.invalid``; the
operations are in clusterctl/ops/slurm.py.
"""

from __future__ import annotations

from typing import ClassVar

from ..host.status import JobStatus
from .base import Backend, LineCallback, Progress, StopReport

__all__ = ["SlurmBackend"]


class SlurmBackend(Backend):
    """Jobs as Slurm batch jobs: sbatch, scontrol/sacct, scancel over ssh to a login node."""

    name: ClassVar[str] = "slurm"
    summary: ClassVar[str] = "one Slurm batch job, submitted over ssh to slurm.login"
    unsupported = (
        ("job.launcher", "launcher: mpi is not supported; use launcher: ssh (clusterctl's own PMI server)"),
        ("data", "data: is not dealt under Slurm yet; put the files in the workspace"),
    )

    @classmethod
    def check_spec(cls, spec) -> list:
        """slurm: section present; nodes or hosts give the shape; pservers by count; a shared workspace is absolute."""
        from ..spec.errors import problem

        loc, source, problems = spec.located, spec.source, []
        if loc is None:
            return []
        if spec.slurm is None:
            return [problem(loc, source, ("backend",), "backend: slurm needs a slurm: section (login:, nodes:, ...)")]
        given = loc.data.get("hosts") if isinstance(loc.data, dict) else None
        if spec.slurm.nodes is None and not given:
            problems.append(problem(loc, source, ("slurm",), "give slurm.nodes (or hosts, for the shape of each node)"))
        if spec.slurm.nodes is not None and given and spec.slurm.nodes != len(given):
            problems.append(problem(loc, source, ("slurm", "nodes"), f"{spec.slurm.nodes} nodes but {len(given)} hosts"))
        if isinstance(spec.job.pservers, tuple):
            problems.append(problem(loc, source, ("job", "pservers"),
                                    "under Slurm the nodes are known at run time: give a count or {per_host: N}"))
        if spec.slurm.workspace == "shared" and not spec.workspace.remote.startswith("/"):
            problems.append(problem(loc, source, ("workspace", "remote"),
                                    "slurm.workspace: shared needs an absolute path on the shared filesystem"))
        return problems

    def dispatch(self, *, on_progress: Progress | None = None) -> list:
        """The workspace to every node of the partition (or to the login node, for a shared workspace)."""
        from ..ops.slurm import dispatch

        return dispatch(self.spec, self.plan)

    def start(self, *, on_progress: Progress | None = None) -> JobStatus:
        """Submit the batch job."""
        from ..ops.slurm import start

        st = start(self.spec, self.plan, on_progress=on_progress)
        st.backend = self.name
        return st

    def status(self) -> JobStatus:
        """Slurm's view of the job and the batch program's state file."""
        from ..ops.slurm import status

        st = status(self.spec, self.plan)
        st.backend = self.name
        return st

    def logs(self, *, on_line: LineCallback, follow: bool = False, role: str | None = None, id: int | None = None,
             host: str | None = None, lines: int | None = None) -> int:
        """The job's output files, read on the batch host (or the login node, for a shared workspace)."""
        from ..errors import JobError
        from ..ops.slurm import logs

        if host is not None:
            raise JobError("--host selects nothing under backend: slurm (nodes are Slurm's choice); use --role/--id")
        return logs(self.spec, self.plan, on_line=on_line, follow=follow, role=role, id=id, lines=lines)

    def stop(self, *, grace: float | None = None) -> StopReport:
        """scancel, then the sweep of the job's nodes."""
        from ..ops.slurm import stop

        res = stop(self.spec, self.plan, grace=grace)
        detail = f"Slurm job {res['slurm_job']}" if res["slurm_job"] else ""
        return StopReport(job=self.plan.job, was_running=res["was_running"], hosts=len(res["nodes"]),
                          killed=len(res["killed"]), detail=detail)
