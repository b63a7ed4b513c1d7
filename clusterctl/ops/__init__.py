"""Operations: plain functions over (plan, remote). They return results; they never print or exit."""

from __future__ import annotations

from contextlib import contextmanager

from ..errors import ClusterctlError
from ..plan import JobPlan, make_plan
from ..remote import Remote, SshOptions
from ..spec import ClusterSpec, load_spec

__all__ = ["Session", "open_session", "plan_for"]


class Session:
    """A loaded spec, its plan, and a Remote to its hosts: what every operation works on."""

    def __init__(self, spec: ClusterSpec, plan: JobPlan, remote: Remote):
        self.spec, self.plan, self.remote = spec, plan, remote


def plan_for(spec: ClusterSpec) -> JobPlan:
    """The plan of `spec`, with its data files listed from the controller's disk."""
    from .dispatch import list_data_files

    return make_plan(spec, data_files=list_data_files(spec))


@contextmanager
def open_session(spec_or_path: "str | ClusterSpec"):
    """Load (if given a path) and plan a spec, open a Remote to its hosts, close it afterwards."""
    spec = spec_or_path if isinstance(spec_or_path, ClusterSpec) else load_spec(spec_or_path)
    if spec.backend == "slurm":  # its hosts are placeholders until the job runs (ops/slurm.py)
        raise ClusterctlError(f"{spec.source}: this command works on SSH hosts; with backend: slurm use "
                              "dispatch, start, status, logs or stop")
    plan = plan_for(spec)
    with Remote(plan.hosts, SshOptions.from_spec(spec)) as remote:
        yield Session(spec, plan, remote)
