"""How a job's status reads on the terminal: one table, shared by the SSH, Slurm, local and Kubernetes front ends.

Stdlib only: rich costs ~0.08 s of the controller's CPU to import, more than the rest of `clusterctl status`
(docs/benchmarks.md, issue 23). The table looks like the ones rich draws for the other commands; colours are
ANSI codes, used only on a terminal and never when NO_COLOR is set. Every cell and line is made printable
(clusterctl.console.printable): what hosts send never drives the terminal."""

from __future__ import annotations

import json
import math
import sys

from ..console import paint, printable, use_colour, write_text
from ..host.states import TERMINAL_JOB_STATES, JobState, ProcState

__all__ = ["render_status", "STATE_STYLE", "table_lines", "strict_json"]

def strict_json(doc, **kw) -> str:
    """`doc` as JSON that every reader takes (RFC 8259): a number that is not finite (a host's `NaN`, a sum of two
    hosts' 1e308) is null, where json.dumps would write `NaN` or `Infinity` and strict parsers refuse the document."""
    def clean(v):
        if isinstance(v, float):
            return v if math.isfinite(v) else None
        if isinstance(v, dict):
            return {k: clean(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [clean(x) for x in v]
        return v

    return json.dumps(clean(doc), allow_nan=False, **kw)


STATE_STYLE = {JobState.STARTING: "cyan", JobState.RUNNING: "green", JobState.SUCCEEDED: "bold green", ProcState.EXITED: "green",
               JobState.FAILED: "bold red", JobState.LOST: "bold red", JobState.STOPPED: "yellow",
               JobState.NOT_RUNNING: "dim", JobState.RESTARTING: "yellow"}

# box characters, as rich's HEAVY_HEAD (the other commands' tables) and its ASCII fallback
_UNICODE = {"top": "┏━┳┓", "head": "┃┃┃", "rule": "┡━╇┩", "row": "│││", "bottom": "└─┴┘"}
_ASCII = {"top": "+-++", "head": "|||", "rule": "|-+|", "row": "|||", "bottom": "+-++"}


def _width(text: str) -> int:
    """Terminal cells `text` takes: wide (East Asian) characters two, combining marks none."""
    if text.isascii():
        return len(text)
    import unicodedata

    return sum(0 if unicodedata.combining(c) else 2 if unicodedata.east_asian_width(c) in "WF" else 1 for c in text)


def table_lines(columns: list[str], rows: list[list[tuple[str, str]]], *, right: frozenset = frozenset(),
                colour: bool = False, unicode: bool = True) -> list[str]:
    """A table's lines: a bold header, then one line per row of (text, style) cells, columns as wide as their
    widest cell (never cut), the columns named in `right` right-aligned. Cells are made printable here."""
    box = _UNICODE if unicode else _ASCII
    body = [[(printable(text), style) for text, style in row] for row in rows]
    widths = [max([_width(name)] + [_width(row[i][0]) for row in body]) for i, name in enumerate(columns)]

    def rule(kind: str) -> str:
        left, fill, cross, end = box[kind]
        return left + cross.join(fill * (w + 2) for w in widths) + end

    def line(kind: str, cells: list[tuple[str, str]]) -> str:
        left, mid, end = box[kind]
        parts = []
        for (text, style), w, name in zip(cells, widths, columns):
            pad = " " * (w - _width(text))
            parts.append(" " + (pad + paint(text, style, colour) if name in right else paint(text, style, colour) + pad) + " ")
        return left + mid.join(parts) + end

    return [rule("top"), line("head", [(c, "bold") for c in columns]), rule("rule"),
            *(line("row", cells) for cells in body), rule("bottom")]


def _progress_cells(progress, straggler: bool) -> list[tuple[str, str]]:
    """The step and steps/s cells of a process's progress (blank without any); a straggler's rate in red."""
    if not progress:
        return [("", ""), ("", "")]
    step = f"{progress['step']:,}" + (" (done)" if progress.get("done") else "")
    rate = "" if progress.get("rate") is None else f"{progress['rate']:.3g}"
    return [(step, ""), (f"{rate} straggler", "bold red") if straggler else (rate, "")]


def render_status(st, file=None) -> None:
    """Print a job's status (to `file`, default stdout) as a table plus its overall state."""
    file = sys.stdout if file is None else file
    colour = use_colour(file)
    encoding = (getattr(file, "encoding", None) or "utf-8").lower().replace("-", "")
    lines = []

    def state(text: str) -> str:
        return paint(printable(text), STATE_STYLE.get(text, ""), colour)

    if not st.processes and not st.unreachable:
        if st.state == JobState.NOT_RUNNING and not st.reason:
            lines.append(f"job {printable(st.job)} is not running (no state on any host)")
        else:  # e.g. a batch job waiting for its allocation
            why = f" ({printable(st.reason)})" if st.reason else ""
            lines.append(f"job {printable(st.job)}: {state(st.state)}{why}")
        write_text(file, "".join(line + "\n" for line in lines))
        return
    columns = ["host", "role", "id", "pid", "state", "exit", "uptime"]
    progress = any(getattr(p, "progress", None) for p in st.processes)  # trainers that print progress lines
    rates = any((getattr(p, "progress", None) or {}).get("rate") is not None for p in st.processes)
    if progress:
        columns.append("step")
    if rates:
        columns.append("steps/s")
    slow = {(s["host"], s["process"]) for s in getattr(st, "stragglers", ())}
    rows = []
    for p in st.processes:
        cells = [(p.host, ""), (p.role, ""), (str(p.id), ""), (str(p.pid or ""), ""),
                 (p.state or "?", STATE_STYLE.get(p.state or "?", "")),
                 ("" if p.exit_code is None else str(p.exit_code), ""),
                 ("" if p.uptime_s is None else f"{p.uptime_s:.1f}s", "")]
        if progress:
            cells += _progress_cells(p.progress, (p.host, f"{p.role}.{p.id}") in slow)[: 1 + rates]
        rows.append(cells)
    lines.append(f"{paint(f'job {printable(st.job)}: ', 'italic', colour)}{state(st.state)}")
    lines += table_lines(columns, rows, right=frozenset({"step", "steps/s"}), colour=colour,
                         unicode=encoding.startswith("utf"))
    for s in getattr(st, "stragglers", ()):
        lines.append(f"{paint('straggler', 'bold red', colour)}: {printable(s['process'])} on {printable(s['host'])}: "
                     f"{s['rate']:.3g} steps/s, {s['ratio']:.0%} of the median {s['median']:.3g}")
    if st.restarts or st.attempt:
        lines.append(f"attempt {st.attempt} (restarts allowed: {st.restarts})")
        for a in st.attempts:
            if a.get("attempt") != st.attempt or a.get("outcome") in TERMINAL_JOB_STATES:
                lines.append(f"  attempt {a.get('attempt')}: {state(a.get('outcome') or '?')}: "
                             f"{printable(str(a.get('reason')))}")
    for line in (getattr(st, "elastic", None) or {}).get("lines", ()):  # an elastic job: its hosts, spares, changes
        lines.append(printable(line))
    if st.reason:
        lines.append(f"reason: {printable(st.reason)}")  # host-supplied text: control characters escaped
    for host, why in st.unreachable.items():
        lines.append(paint(f"{printable(host)}: {printable(why)}", "red", colour))
    write_text(file, "".join(line + "\n" for line in lines))
