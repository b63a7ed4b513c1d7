"""How a job's status reads on the terminal: one table, shared by the SSH and Slurm front ends."""

from __future__ import annotations

from rich.markup import escape
from rich.table import Table

from ..console import out, printable
from ..host.states import TERMINAL_JOB_STATES, JobState, ProcState

__all__ = ["render_status"]

_STATE_STYLE = {JobState.RUNNING: "green", JobState.SUCCEEDED: "bold green", ProcState.EXITED: "green",
                JobState.FAILED: "bold red", JobState.LOST: "bold red", JobState.STOPPED: "yellow",
                JobState.NOT_RUNNING: "dim", JobState.RESTARTING: "yellow"}


def _styled(state: str) -> str:
    style = _STATE_STYLE.get(state, "")
    return f"[{style}]{escape(state)}[/]" if style else escape(state)


def _progress_cells(progress, straggler: bool) -> list[str]:
    """The step and steps/s cells of a process's progress (blank without any); a straggler's rate in red."""
    if not progress:
        return ["", ""]
    step = f"{progress['step']:,}" + (" (done)" if progress.get("done") else "")
    rate = "" if progress.get("rate") is None else f"{progress['rate']:.3g}"
    return [step, f"[bold red]{rate} straggler[/]" if straggler else rate]


def render_status(st) -> None:
    """Print a job's status as a table plus its overall state."""
    if not st.processes and not st.unreachable:
        if st.state == JobState.NOT_RUNNING and not st.reason:
            out.print(f"job {escape(st.job)} is not running (no state on any host)")
        else:  # e.g. a batch job waiting for its allocation
            why = f" ({escape(printable(st.reason))})" if st.reason else ""
            out.print(f"job {escape(st.job)}: {_styled(st.state)}{why}")
        return
    table = Table(title=f"job {st.job}: {_styled(st.state)}", title_justify="left")
    for col in ("host", "role", "id", "pid", "state", "exit", "uptime"):
        table.add_column(col, no_wrap=True)
    progress = any(getattr(p, "progress", None) for p in st.processes)  # trainers that print progress lines
    rates = any((getattr(p, "progress", None) or {}).get("rate") is not None for p in st.processes)
    if progress:
        table.add_column("step", no_wrap=True, justify="right")
    if rates:
        table.add_column("steps/s", no_wrap=True, justify="right")
    slow = {(s["host"], s["process"]) for s in getattr(st, "stragglers", ())}
    for p in st.processes:
        cells = [
            escape(p.host), p.role, str(p.id), str(p.pid or ""), _styled(p.state or "?"),
            "" if p.exit_code is None else str(p.exit_code),
            "" if p.uptime_s is None else f"{p.uptime_s:.1f}s",
        ]
        if progress:
            cells += _progress_cells(p.progress, (p.host, f"{p.role}.{p.id}") in slow)[: 1 + rates]
        table.add_row(*cells)
    out.print(table)
    for s in getattr(st, "stragglers", ()):
        out.print(f"[bold red]straggler[/]: {escape(s['process'])} on {escape(s['host'])}: {s['rate']:.3g} steps/s, "
                  f"{s['ratio']:.0%} of the median {s['median']:.3g}")
    if st.restarts or st.attempt:
        out.print(f"attempt {st.attempt} (restarts allowed: {st.restarts})")
        for a in st.attempts:
            if a.get("attempt") != st.attempt or a.get("outcome") in TERMINAL_JOB_STATES:
                out.print(f"  attempt {a.get('attempt')}: {_styled(a.get('outcome') or '?')}: {escape(str(a.get('reason')))}")
    for line in (getattr(st, "elastic", None) or {}).get("lines", ()):  # an elastic job: its hosts, spares, changes
        out.print(escape(printable(line)))
    if st.reason:
        out.print(f"reason: {escape(printable(st.reason))}")  # host-supplied text: control characters escaped
    for host, why in st.unreachable.items():
        out.print(f"[red]{escape(host)}: {escape(printable(why))}[/]")
