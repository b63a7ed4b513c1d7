"""`clusterctl top SPEC`: a live view of a running job (one row per process, totals per host, stragglers), or
one snapshot (`--once`, `--json`). The renderer, `render_top`, is shared with `clusterctl demo`."""

from __future__ import annotations

import argparse
import sys
import time

from rich import box
from rich.console import Group
from rich.table import Table
from rich.text import Text

from ..console import markup_safe, out, to_devnull
from ..errors import UsageError
from ..progress import STRAGGLER_THRESHOLD, STRAGGLER_WINDOW_S, metrics_text
from .render import STATE_STYLE, strict_json
from ..ops.top import DEFAULT_INTERVAL, MIN_INTERVAL, HostRow, ProcRow, Snapshot, Top

__all__ = ["add_cli", "render_top", "run_top"]

LIVE_REQUEST_REFRESHES = 5
LIVE_REQUEST_MIN_S = 10.0
COMPACT_BELOW = 120  # terminal columns: narrower, the view drops its host and pid columns


def _bytes(n: float | None) -> str:
    if n is None:
        return ""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return ""


def _gib(mib: float | None) -> str:
    return "?" if mib is None else f"{mib / 1024:.1f}"


def _gpu_text(gpus: list, proc_mib: float | None = None) -> str:
    parts = []
    for g in gpus:
        util = "?" if g["util_pct"] is None else f"{g['util_pct']:.0f}%"
        parts.append(f"{g['index']}: {util} {_gib(g['mem_used_mib'])}/{_gib(g['mem_total_mib'])}G")
    if proc_mib is not None:
        parts.append(f"own {_gib(proc_mib)}G")
    return ", ".join(parts)


def _styled(state: str) -> str:
    """A job's or process's state in rich markup, coloured as in `clusterctl status` (render.STATE_STYLE)."""
    style = STATE_STYLE.get(state, "")
    return f"[{style}]{markup_safe(state)}[/]" if style else markup_safe(state)


def _rate(r: ProcRow) -> str:
    p = r.progress
    if not p or p.get("rate") is None:
        return ""
    text = f"{p['rate']:.3g}"
    return f"[bold red]{text} ▼[/]" if r.straggler else text


def _state(r: ProcRow) -> str:
    if r.straggler:
        return "[bold red]straggler[/]"
    text = _styled(r.state)
    if r.exit_code is not None and r.rank is None:
        text += f" {r.exit_code}"
    return text


def _host_line(h: HostRow) -> str:
    bits = []
    if h.cpu_pct is not None:
        bits.append(f"host cpu {h.cpu_pct:.0f}%" + (f" of {h.ncpu}" if h.ncpu else ""))
    if h.load1 is not None:
        bits.append(f"load {h.load1:.2f}")
    if h.mem_total:
        bits.append(f"mem {_bytes(h.mem_total - (h.mem_available or 0))}/{_bytes(h.mem_total)}")
    if h.gpus:
        bits.append(f"gpus {_gpu_text(h.gpus)}")
    if h.gpu_error:
        bits.append(f"nvidia-smi: {h.gpu_error}")
    if h.sample_cpu_s is not None:
        bits.append(f"sampled in {h.sample_cpu_s * 1000:.0f} ms cpu")
    return markup_safe(" · ".join(bits))


def _title(s: Snapshot) -> str:
    procs = sum(1 for r in s.rows if r.rank is None)
    every = f" · every {s.interval:g}s" if s.interval else ""
    when = time.strftime("%H:%M:%S", time.localtime(s.taken_at))
    return (f"job {markup_safe(s.job)}: {_styled(s.state)} · {len(s.hosts)} host(s), {procs} process(es){every} · "
            f"{when}")


def render_top(s: Snapshot, *, title: str | None = None, width: int | None = None):
    """A rich renderable of a snapshot: what needs attention first (stragglers, hosts that did not answer), then
    one row per process with its host's totals after it. Narrower than COMPACT_BELOW columns (`width`, default
    the console's), each host's rows come under a line of its own instead of a host and a pid column."""
    width = out.width if width is None else width
    compact = width < COMPACT_BELOW
    alerts = []
    for st in s.stragglers:
        alerts.append(Text.from_markup(
            f"[bold red]straggler[/]: {markup_safe(st['process'])} on {markup_safe(st['host'])}: {st['rate']:.3g} steps/s, "
            f"{st['ratio']:.0%} of the median {st['median']:.3g} (below {s.threshold:.0%} for {s.window_s:g}s)"))
    for h in s.hosts:
        if h.status in ("unreachable", "error"):
            alerts.append(Text.from_markup(f"[bold red]{markup_safe(h.host)}: {h.status}[/]: "
                                           f"{markup_safe(h.error or '')}"))
        elif h.age_s is not None and s.interval and h.age_s > 3 * s.interval:
            alerts.append(Text.from_markup(f"[yellow]{markup_safe(h.host)}: no answer for {h.age_s:.0f}s[/]"))
    gpu = any(r.gpus or r.gpu_mem_mib is not None for r in s.rows) or any(h.gpus for h in s.hosts)
    lines: list[tuple[dict, bool]] = []  # (cells by column, ends a host's section)
    by_host: dict[str, list[ProcRow]] = {}
    for r in s.rows:
        by_host.setdefault(r.host, []).append(r)
    for h in s.hosts:
        if compact:
            lines.append(({"process": f"[bold]{markup_safe(h.host)}[/]"}, False))
        if h.status != "ok":
            lines.append(({"host": markup_safe(h.host), "state": f"[red]{markup_safe(h.status)}[/]",
                           "metrics": markup_safe(h.error or "")[:120]}, True))
            continue
        for r in by_host.get(h.host, []):
            p = r.progress or {}
            lines.append(({
                "host": markup_safe(r.host), "process": markup_safe(r.name), "pid": "" if r.pid is None else str(r.pid),
                "state": _state(r), "cpu %": "" if r.cpu_pct is None else f"{r.cpu_pct:.0f}", "rss": _bytes(r.rss_bytes),
                "gpu": markup_safe(_gpu_text(r.gpus, r.gpu_mem_mib)) if gpu else "",
                "step": "" if "step" not in p else f"{p['step']:,}" + (" done" if p.get("done") else ""),
                "steps/s": _rate(r), "metrics": markup_safe(metrics_text(p.get("metrics") or {})),
            }, False))
        lines.append(({"host": markup_safe(h.host), "process": "[dim]host total[/]",
                       "cpu %": "" if h.job_cpu_pct is None else f"[dim]{h.job_cpu_pct:.0f}[/]",
                       "rss": f"[dim]{_bytes(h.job_rss_bytes)}[/]" if h.job_rss_bytes is not None else "",
                       "metrics": f"[dim]{_host_line(h)}[/]"}, True))
    # columns nobody has a value in (no CPU figures once every process has ended, no GPUs) are left out
    cols = [c for c in ("host", "process", "pid", "state", "cpu %", "rss", "gpu", "step", "steps/s", "metrics")
            if c in ("host", "process", "state", "metrics") or any(cells.get(c) for cells, _ in lines)]
    if compact:
        cols = [c for c in cols if c not in ("host", "pid")]
    # top-like: no vertical rules, a rule under the header; the metrics column takes what is left
    table = Table(title=title if title is not None else _title(s), title_justify="left", expand=True,
                  box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False, collapse_padding=True)
    for c in cols:
        table.add_column("gpu (util, mem used/total)" if c == "gpu" else c, no_wrap=c != "metrics",
                         justify="right" if c in ("pid", "cpu %", "rss", "step", "steps/s") else "left",
                         ratio=1 if c == "metrics" else None, min_width=16 if c == "metrics" else None)
    for cells, end in lines:
        table.add_row(*(cells.get(c, "") for c in cols), end_section=end)
    # an elastic job: which hosts run its attempt, the spares, the changes (`status` prints the same lines)
    view = [Text(line) for line in (s.elastic or {}).get("lines", [])]
    return Group(*alerts, table, *view) if alerts or view else table


def run_top(spec, *, once: bool = False, as_json: bool = False, interval: float = DEFAULT_INTERVAL,
            threshold: float = STRAGGLER_THRESHOLD, window_s: float = STRAGGLER_WINDOW_S, gpu: bool = True,
            exit_promptly: bool = False) -> int:
    """The `top` command: one snapshot (exit 1 when a host could not be asked, or its answer was an error) or a
    live view until Ctrl+C (`exit_promptly`, the command line's: the process ends within EXIT_AFTER_INTERRUPT_S
    of it)."""
    from ..backends import open_backend

    if not MIN_INTERVAL <= interval <= 3600:
        raise UsageError(f"top: --interval must be {MIN_INTERVAL:g} to 3600 seconds, not {interval:g}")
    with open_backend(spec) as backend:
        # the live view gives up on a host's request after 5 refreshes (at least 10 s), so that a frozen host is
        # named soon and Ctrl+C does not wait long for its request; --once waits the backend's own deadline
        # (ssh.command_timeout; Slurm's step deadline; kubectl's)
        wait = None if once else max(LIVE_REQUEST_MIN_S, LIVE_REQUEST_REFRESHES * interval)
        with Top(backend, threshold=threshold, window_s=window_s, gpu=gpu, request_timeout=wait) as top:
            if once:
                snap = top.snapshot(None, interval=None)
                if as_json:
                    sys.stdout.write(strict_json(snap.to_json(), indent=2) + "\n")
                else:
                    out.print(render_top(snap))
                return 1 if snap.unreachable or any(h.status == "error" for h in snap.hosts) else 0
            try:
                return _live(top, interval, as_json)
            except KeyboardInterrupt:
                if exit_promptly:
                    _exit_soon()
                return 0


EXIT_AFTER_INTERRUPT_S = 5.0  # Ctrl+C ends the view within this, whatever a host's request still waits for


def _exit_soon() -> None:
    """After Ctrl+C the view cleans up as usual (connections closed, the terminal restored), but the
    interpreter's exit joins the transport's worker threads, and a request to a host that stopped answering
    holds one until its deadline (ssh.command_timeout): past EXIT_AFTER_INTERRUPT_S the process ends anyway,
    exit 0, its output flushed."""
    import os
    import threading

    def leave() -> None:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(0)

    timer = threading.Timer(EXIT_AFTER_INTERRUPT_S, leave)
    timer.daemon = True
    timer.start()


def _live(top: Top, interval: float, as_json: bool) -> int:
    """Refresh every `interval` seconds until interrupted: JSON lines, tables one after another (not a terminal),
    or one table redrawn in place."""
    snap = top.snapshot(None, interval=interval)  # the first view waits for every host (each within its deadline)
    if as_json or not out.is_terminal:
        try:
            while True:
                if as_json:
                    sys.stdout.write(strict_json(snap.to_json()) + "\n")
                    sys.stdout.flush()
                else:
                    out.print(render_top(snap))
                    if out.quiet:  # `top | head`: the reader has what it wanted (clusterctl.console's Quiet)
                        return 0
                time.sleep(max(0.0, interval - snap.took_s))
                snap = top.snapshot(interval * 0.9, interval=interval)
        except BrokenPipeError:  # `top --json | head -n 3`: the reader has what it wanted; end as `yes | head` does
            to_devnull(sys.stdout)  # what is left in stdout's buffer goes nowhere at exit
            return 0
    from rich.live import Live

    with Live(render_top(snap), console=out, auto_refresh=False, transient=False) as live:
        while True:  # a refresh every `interval`: the wait for slow hosts is part of it
            time.sleep(max(0.0, interval - snap.took_s))
            snap = top.snapshot(interval * 0.9, interval=interval)
            live.update(render_top(snap), refresh=True)


def cmd_top(args: argparse.Namespace) -> int:
    """clusterctl top."""
    return run_top(args.spec, once=args.once, as_json=args.json, interval=args.interval, exit_promptly=True,
                   threshold=args.straggler_threshold, window_s=args.straggler_window, gpu=not args.no_gpu)


def add_cli(sub) -> None:
    """Register `clusterctl top`."""
    p = sub.add_parser("top", help="live view of a running job: resources, progress and stragglers per process")
    p.add_argument("spec")
    p.add_argument("--once", action="store_true", help="one snapshot, then exit (exit 1 when a host was not reached)")
    p.add_argument("--json", action="store_true", help="JSON: one document with --once, else one line per refresh")
    p.add_argument("--interval", type=float, default=DEFAULT_INTERVAL,
                   help=f"seconds between refreshes (default {DEFAULT_INTERVAL:g})")
    p.add_argument("--no-gpu", action="store_true", help="do not ask nvidia-smi on the hosts")
    p.add_argument("--straggler-threshold", type=float, default=STRAGGLER_THRESHOLD,
                   help=f"a rank below this fraction of the median step rate ... (default {STRAGGLER_THRESHOLD:g})")
    p.add_argument("--straggler-window", type=float, default=STRAGGLER_WINDOW_S,
                   help=f"... for this many seconds is a straggler (default {STRAGGLER_WINDOW_S:g}, 6 to 180)")
    p.set_defaults(func=cmd_top)

