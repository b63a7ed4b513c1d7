"""`backend: slurm`'s status, the pure part: Slurm's word for the job folded with its supervisors' replies.

clusterctl/ops/slurm.py asks (the login node, and the nodes over ssh once the job has ended); this decides.
"""

from __future__ import annotations

from ..host.states import JobState
from .job import JobStatus, fold_status

__all__ = ["slurm_state", "slurm_status"]

_STATES = {"PENDING": JobState.PENDING, "CONFIGURING": JobState.PENDING, "REQUEUED": JobState.PENDING,
           "RUNNING": JobState.RUNNING, "SUSPENDED": JobState.RUNNING, "RESIZING": JobState.RUNNING,
           "COMPLETING": JobState.STOPPING, "COMPLETED": JobState.SUCCEEDED, "CANCELLED": JobState.STOPPED}


def slurm_state(state: str) -> str:
    """Our job state for Slurm's JobState word (pure)."""
    word = state.split()[0].rstrip("+") if state else ""
    return _STATES.get(word, JobState.FAILED if word else JobState.NOT_RUNNING)


def slurm_status(job: str, sj: dict, replies: dict[str, dict], unreachable: dict[str, str], tail: str = "") -> JobStatus:
    """The job's status (pure): Slurm's word for the allocation, folded with the supervisors' replies (node
    name -> `agent status` reply) when any supervisor has a state, as over SSH (ops/job.py fold_status)."""
    where = f" on {','.join(sj['nodes'])}" if sj.get("nodes") else ""
    head = f"Slurm job {sj['id']} {sj['state']} (exit {sj['exit_code']}){where}" + (
        f": {sj['reason']}" if sj.get("reason") else "")
    answered = {n: r for n, r in replies.items() if r and r.get("state") not in (None, JobState.UNKNOWN)}
    word_state = slurm_state(sj["state"])
    if not answered:  # no supervisor (yet, or any more reachable): Slurm's word is all there is
        if word_state == JobState.RUNNING:
            word_state, head = JobState.STARTING, head + "; starting the supervisors"
        return JobStatus(job, word_state, head + (f"; slurm-{sj['id']}.out ends: {tail}" if tail else ""),
                         unreachable=dict(unreachable), backend="slurm")
    st = fold_status(job, answered, unreachable)
    st.backend = "slurm"
    if word_state == JobState.FAILED and st.state == JobState.STOPPED:  # TIMEOUT, NODE_FAIL, PREEMPTED...: Slurm
        st.state = JobState.FAILED  # ended the job; its supervisors only heard a SIGTERM, as from a user's stop
    st.reason = head + (f"; {st.reason}" if st.reason else "")
    return st
