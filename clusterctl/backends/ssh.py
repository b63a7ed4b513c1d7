"""`backend: ssh` (the default): the spec's hosts are machines `ssh` reaches; the controller writes a job
file on each and starts the host supervisor there (clusterctl/ops/job.py), ships the workspace itself
(clusterctl/ops/dispatch), and reads status and logs from the supervisors."""

from __future__ import annotations

from typing import ClassVar

from ..errors import RemoteError
from ..host.status import JobStatus
from .base import Backend, LineCallback, Progress, StopReport, killed_count

__all__ = ["SshBackend"]


class SshBackend(Backend):
    """Jobs on machines reached over SSH (bastions, ssh config, non-root with sudo)."""

    name: ClassVar[str] = "ssh"
    summary: ClassVar[str] = "the spec's hosts over SSH: the controller starts a supervisor on each"
    unsupported = (("slurm", "a slurm: section needs backend: slurm"),)
    ssh_hosts: ClassVar[bool] = True

    def __init__(self, spec, plan, *, spec_path=None, options=None, transport=None):
        super().__init__(spec, plan, spec_path=spec_path, options=options)
        self._transport = transport
        self._session = None

    @property
    def session(self):
        """The ops Session (spec, plan, a Remote to the hosts), opened on first use and kept."""
        if self._session is None:
            from ..ops import Session
            from ..remote import Remote, SshOptions

            options = self.options if self.options is not None else SshOptions.from_spec(self.spec)
            remote = Remote(self.plan.hosts, options, transport=self._transport)
            self._session = Session(self._spec, self.plan, remote, spec_path=self.spec_path)
        return self._session

    def close(self) -> None:
        """Close the connections."""
        if self._session is not None:
            self._session.remote.close()
            self._session = None

    def dispatch(self, *, on_progress: Progress | None = None) -> list:
        """The workspace and data shards to every host, incrementally and atomically."""
        from ..ops.dispatch import dispatch

        return dispatch(self.session)

    def start(self, *, on_progress: Progress | None = None) -> JobStatus:
        """Verify workspaces, preflight, launch a supervisor on every host."""
        from ..ops.job import start

        st = start(self.session, on_progress=on_progress)
        st.backend = self.name
        return st

    def status(self) -> JobStatus:
        """Every host's supervisor's view, folded."""
        from ..ops.job import status

        st = status(self.session)
        st.backend = self.name
        return st

    def logs(self, *, on_line: LineCallback, follow: bool = False, role: str | None = None, id: int | None = None,
             host: str | None = None, lines: int | None = None) -> int:
        """The hosts' logs, through their agents."""
        from ..ops.job import logs

        codes = logs(self.session, on_line=on_line, follow=follow, role=role, id=id, host=host, lines=lines)
        return max(codes.values(), default=0)

    def top_asks(self, request) -> list:
        """Each host on its own: its supervisor's `top` over the control socket (`agent top` as the fallback)."""
        from ..ops.top import ssh_asks

        return ssh_asks(self.session, request)

    def stop(self, *, grace: float | None = None) -> StopReport:
        """Stop the job on every host; the sweep by the job's tag."""
        from ..ops.control import agent_reply
        from ..ops.job import stop

        try:
            results = stop(self.session, grace=grace)
        except RemoteError as exc:  # some hosts failed: what the others did goes with the error (run_stop says it)
            replies = {h: agent_reply(r) for h, r in exc.results.items()}
            exc.report = self._stop_report(replies, f"{len(exc.failures)} host(s) did not answer")
            raise
        return self._stop_report(results)

    def _stop_report(self, results: dict, detail: str = "") -> StopReport:
        return StopReport(
            job=self.plan.job,
            was_running=any(r.get("was_running") for r in results.values()),
            hosts=len(results),
            killed=killed_count(results.values()),
            left={h.label: r["left"] for h, r in results.items() if r.get("left")},
            detail=detail,
        )
