"""Operations: plain functions over (plan, remote). They return results; they never print or exit."""

from __future__ import annotations

from contextlib import contextmanager

from ..plan import JobPlan, make_plan
from ..remote import Remote, SshOptions
from ..spec import ClusterSpec, load_spec

__all__ = ["Session", "open_session", "plan_for"]


class Session:
    """A loaded spec, its plan, and a Remote to its hosts: what every operation works on."""

    def __init__(self, spec: ClusterSpec, plan: JobPlan, remote: Remote):
        self.spec, self.plan, self.remote = spec, plan, remote


def plan_for(spec: ClusterSpec) -> JobPlan:
    """The plan of `spec`: its hosts resolved as `ssh` would (the user's ssh config), its data files
    listed from the controller's disk. A problem the plan finds is reported as a spec error, at its key."""
    from ..errors import SpecError, SpecProblem
    from ..plan import PlanError, ssh_targets
    from ..sshconfig import config_path, resolve
    from .dispatch import list_data_files

    resolved = resolve(ssh_targets(spec), config_path(spec))
    try:
        return make_plan(spec, data_files=list_data_files(spec), resolved=resolved)
    except PlanError as exc:
        line, col = spec_position(spec, exc.path)
        raise SpecError([SpecProblem(spec.source, line, col, _dotted(exc.path), exc.message)]) from None


def spec_position(spec: ClusterSpec, path: tuple) -> tuple[int, int]:
    """Line and column of `path` in the spec's file (1, 1 when it cannot be read back)."""
    from ..yamlpos import YamlSyntaxError, load_located

    try:
        with open(spec.source, encoding="utf-8") as fh:
            return load_located(fh.read()).position(path)
    except (OSError, UnicodeDecodeError, YamlSyntaxError):
        return 1, 1


def _dotted(path: tuple) -> str:
    return "".join(f"[{p}]" if isinstance(p, int) else (f".{p}" if i else str(p)) for i, p in enumerate(path))


@contextmanager
def open_session(spec_or_path: "str | ClusterSpec"):
    """Load (if given a path) and plan a spec, open a Remote to its hosts, close it afterwards."""
    spec = spec_or_path if isinstance(spec_or_path, ClusterSpec) else load_spec(spec_or_path)
    plan = plan_for(spec)
    with Remote(plan.hosts, SshOptions.from_spec(spec)) as remote:
        yield Session(spec, plan, remote)
