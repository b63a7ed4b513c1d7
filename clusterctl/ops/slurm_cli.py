"""The lifecycle commands for `backend: slurm` specs (lifecycle_cli hands them over here)."""

from __future__ import annotations

import json
import sys
import time

from rich.markup import escape

from ..console import err, out, write_line
from ..errors import JobError
from ..host.states import JobState
from ..spec import ClusterSpec, load_spec

__all__ = ["load", "is_slurm", "run_dispatch", "run_start", "run_status", "run_logs", "run_stop"]


def load(spec) -> ClusterSpec:
    """The spec itself, or loaded from its path (once, for both backends)."""
    return spec if isinstance(spec, ClusterSpec) else load_spec(spec)


def is_slurm(spec) -> bool:
    """True when the spec (a path or a ClusterSpec) says `backend: slurm`."""
    return load(spec).backend == "slurm"


def _plan(spec):
    from . import plan_for

    s = load(spec)
    return s, plan_for(s)


def _raw_line(host, stream, line) -> None:
    write_line(sys.stdout if stream == "out" else sys.stderr, line)


def run_dispatch(spec) -> int:
    """Ship the workspace to the partition's nodes (or the login node, for a shared workspace)."""
    from .slurm import dispatch

    s, plan = _plan(spec)
    t0 = time.monotonic()
    results = dispatch(s, plan)
    for r in results:
        out.print(f"{escape(r.host.label)}: {r.files_sent} file(s), {r.bytes_sent} bytes, "
                  f"generation {escape(r.generation)}")
    out.print(f"dispatch to {len(results)} host(s) in {time.monotonic() - t0:.1f}s")
    return 0


def run_status(spec, *, as_json: bool = False) -> int:
    """Print the job's status from Slurm."""
    from .render import render_status
    from .slurm import status

    s, plan = _plan(spec)
    st = status(s, plan)
    if as_json:
        sys.stdout.write(json.dumps(st.to_json(), indent=2) + "\n")
    elif st.processes:
        render_status(st)
    else:
        out.print(f"job {escape(st.job)}: {escape(st.state)}" + (f" ({escape(st.reason)})" if st.reason else ""))
    return 0


def run_logs(spec, *, follow=False, role=None, id=None, host=None, lines=None) -> int:
    """Print `[node role.id] line` from the job's output files."""
    from .slurm import logs

    if host is not None:
        err.print("[yellow]--host is ignored with backend: slurm (use --role/--id)[/]")
    s, plan = _plan(spec)
    return logs(s, plan, on_line=_raw_line, follow=follow, role=role, id=id, lines=lines)


def run_stop(spec) -> int:
    """scancel the job and sweep its nodes."""
    from .slurm import stop

    s, plan = _plan(spec)
    res = stop(s, plan)
    if res["was_running"]:
        out.print(f"job {escape(plan.job)} stopped (Slurm job {res['slurm_job']}, swept {len(res['nodes'])} node(s)"
                  + (f", {len(res['killed'])} process(es) killed)" if res["killed"] else ")"))
    else:
        swept = f" (swept {len(res['nodes'])} node(s))" if res["nodes"] else ""
        out.print(f"job {escape(plan.job)} is not running{swept}")
    return 0


def run_start(spec, *, dispatch_first: bool = False, follow: bool = False) -> int:
    """(Dispatch,) submit; with follow, stream logs until the job ends and exit with its state."""
    from .render import render_status
    from .slurm import dispatch, logs, start, status

    s, plan = _plan(spec)
    if dispatch_first:
        sent = dispatch(s, plan)
        out.print(f"dispatched to {len(sent)} host(s): {sum(d.files_sent for d in sent)} file(s)")
    t0 = time.monotonic()
    st = start(s, plan, on_progress=lambda m: err.print(f"[dim]{escape(m)}…[/]"))
    out.print(f"submitted in {time.monotonic() - t0:.1f}s: {escape(st.reason or st.state)}")
    if not follow:
        return 0
    try:
        while (st := status(s, plan)).state == JobState.PENDING:
            time.sleep(0.5)
        if st.state not in (JobState.UNKNOWN, JobState.NOT_RUNNING):
            try:
                logs(s, plan, on_line=_raw_line, follow=True)
            except JobError as exc:  # e.g. the batch program failed before writing any state
                err.print(f"[yellow]{escape(str(exc))}[/]")
        deadline = time.monotonic() + 60
        while (st := status(s, plan)).state in (JobState.RUNNING, JobState.STOPPING) and time.monotonic() < deadline:
            time.sleep(0.5)
    except KeyboardInterrupt:
        from .slurm import stop

        err.print("[yellow]interrupted: stopping the job…[/]")
        stop(s, plan)
        return 130
    if st.processes:
        render_status(st)
    else:
        out.print(f"job {escape(st.job)}: {escape(st.state)}" + (f" ({escape(st.reason)})" if st.reason else ""))
    return 0 if st.state == JobState.SUCCEEDED else 1
