"""`backend: slurm`'s status, the pure part: Slurm's word for the job folded with its supervisors' replies.

clusterctl/ops/slurm.py asks (the login node, and the nodes over ssh once the job has ended); this decides. Node i
of the plan is the i-th name of the job's node list as `scontrol show hostnames` expands it: the batch glue
(clusterctl/host/slurm.py `cmd_node`) gives the node of that name (SLURMD_NODENAME) the plan's job file i and puts
the name in the file's `host`, which its supervisor's replies carry; the login node's query (clusterctl/host/
slurmctl.py `query_job`) expands the same node list the same way into ``sj["nodes"]``, and the replies come back
keyed by those names, each told by Slurm (the step's task i runs on node i, and srun labels its lines: slurmctl.py
`overlap_argv`, `StepOutput`), not by the node. So, as an SSH host's (ops/job.py `fold_status`), a node's reply
speaks for that node alone and for the processes the plan placed on node i alone: a node (possibly compromised)
that names another node, or reports another node's process rows, is that node's one `no status: ...` line.
"""

from __future__ import annotations

from ..host.states import JobState
from ..plan import JobPlan
from .job import JobStatus, fold_status, placement

__all__ = ["slurm_state", "slurm_status", "node_placement"]

_STATES = {"PENDING": JobState.PENDING, "CONFIGURING": JobState.PENDING, "REQUEUED": JobState.PENDING,
           "RUNNING": JobState.RUNNING, "SUSPENDED": JobState.RUNNING, "RESIZING": JobState.RUNNING,
           "COMPLETING": JobState.STOPPING, "COMPLETED": JobState.SUCCEEDED, "CANCELLED": JobState.STOPPED}


def slurm_state(state: str) -> str:
    """Our job state for Slurm's JobState word (pure)."""
    word = state.split()[0].rstrip("+") if state else ""
    return _STATES.get(word, JobState.FAILED if word else JobState.NOT_RUNNING)


def node_placement(plan: JobPlan, nodes: list[str]) -> dict[str, frozenset] | None:
    """Node name -> the (role, id) of the processes the plan places on it (pure): the i-th of `nodes` (Slurm's
    order) runs the plan's host i's; a node past the plan's hosts (a spec changed since the job started) runs
    none. None where the plan does not say (ops/job.py `placement`: elastic jobs, launcher: mpi)."""
    placed = placement(plan)
    if placed is None:
        return None
    labels = [h.label for h in plan.hosts]
    return {n: placed.get(labels[i], frozenset()) if i < len(labels) else frozenset() for i, n in enumerate(nodes)}


def slurm_status(job: str, sj: dict, replies: dict[str, dict], unreachable: dict[str, str], tail: str = "", *,
                 placed: dict[str, frozenset] | None = None) -> JobStatus:
    """The job's status (pure): Slurm's word for the allocation, folded with the supervisors' replies (node
    name -> `agent status` reply) when any supervisor has a state, as over SSH (ops/job.py fold_status): a reply
    must name this job and its own node, and hold rows of the processes `placed` on that node only
    (node_placement; None: not checked)."""
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
    # a supervisor's `host` is its node's name (its job file's, from the glue): the name its reply is keyed by
    st = fold_status(job, answered, unreachable, {n: n for n in answered}, placed=placed)
    st.backend = "slurm"
    if word_state == JobState.FAILED and st.state == JobState.STOPPED:  # TIMEOUT, NODE_FAIL, PREEMPTED...: Slurm
        st.state = JobState.FAILED  # ended the job; its supervisors only heard a SIGTERM, as from a user's stop
    st.reason = head + (f"; {st.reason}" if st.reason else "")
    return st
