"""CLI for the job lifecycle: dispatch, start, status, logs, stop."""

from __future__ import annotations

import argparse
import signal
import sys
import threading
import time

from ..console import error, note, paint, printable, reader_gone, use_colour, write_line, write_text
from ..errors import ClusterctlError, RemoteError, UsageError
from ..host.states import ACTIVE_JOB_STATES, JobState


def render_status(st) -> None:
    """clusterctl/commands/render.py's table (stdlib only: `status` imports no rich)."""
    from .render import render_status as render

    render(st)

__all__ = ["add_cli"]


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _open(spec):
    """The spec's backend (clusterctl.backends): the one object every lifecycle command talks to."""
    from ..backends import open_backend

    return open_backend(spec)


def _say(msg: str) -> None:
    """A step of a command, dim on a terminal (no rich: `start` imports none)."""
    write_text(sys.stderr, paint(printable(msg) + "…", "dim", use_colour(sys.stderr)) + "\n")


def render_dispatch(results, seconds: float, file=None) -> None:
    """What each host received: one row per host (stdlib only: `dispatch` imports no rich)."""
    from .render import table_lines

    file = sys.stdout if file is None else file
    encoding = (getattr(file, "encoding", None) or "utf-8").lower().replace("-", "")
    rows = [[(r.host.label, ""), (str(r.files_sent), ""), (_human(r.bytes_sent), ""), (str(r.deleted), ""),
             (r.generation or "-", "")] for r in results]  # no generation: an empty workspace, never filled
    colour = use_colour(file)
    lines = [paint(f"dispatch ({seconds:.1f}s)", "italic", colour)]
    lines += table_lines(["host", "files sent", "bytes sent", "deleted", "generation"], rows,
                         right=frozenset({"files sent", "bytes sent", "deleted"}), colour=colour,
                         unicode=encoding.startswith("utf"))
    write_text(file, "".join(line + "\n" for line in lines))


def cmd_dispatch(args: argparse.Namespace) -> int:
    """Ship the workspace to every host; print what each host received."""
    t0 = time.monotonic()
    with _open(args.spec) as backend:
        results = backend.dispatch(on_progress=_say)
    if results:  # none: the backend ships nothing (Kubernetes: the image or a volume), and said so in its line
        render_dispatch(results, time.monotonic() - t0)
    return 0


def _raw_line(host, stream, line) -> None:
    # the agent already prefixes each line with [host role.id]
    write_line(sys.stdout if stream == "out" else sys.stderr, line)


def run_status(spec, *, as_json: bool = False) -> int:
    """Print the job's status; exit 0 unless a host is unreachable."""
    with _open(spec) as backend:
        st = backend.status()
    if as_json:
        from .render import strict_json

        sys.stdout.write(strict_json(st.to_json(), indent=2) + "\n")
    else:
        render_status(st)
    return 1 if st.unreachable else 0


def render_stop(report) -> None:
    """One line: stopped where, how many processes killed; or not running (stdlib only, as `status`)."""
    where = f" ({printable(report.detail)})" if report.detail else ""
    if report.was_running:
        killed = f", {report.killed} process(es) killed" if report.killed else ""
        write_text(sys.stdout, f"job {printable(report.job)} stopped on {report.hosts} host(s){where}{killed}\n")
    else:
        write_text(sys.stdout, f"job {printable(report.job)} is not running{where}\n")
    colour = use_colour(sys.stderr)
    for host, pids in report.left.items():
        write_text(sys.stderr, paint(f"{printable(host)}: processes of the job still alive: {printable(str(pids))}",
                                     "red", colour) + "\n")


def run_stop(spec) -> int:
    """Stop the job everywhere; say so when it was not running."""
    with _open(spec) as backend:
        try:
            report = backend.stop()
        except RemoteError as exc:  # the hosts that failed are the error; what the others did is said first
            if getattr(exc, "report", None) is not None and exc.report.hosts:
                render_stop(exc.report)
            raise
    render_stop(report)
    return 1 if report.left else 0


class _EndWhenReaderLeaves:
    """`logs --follow`'s lines, and its end when their reader goes away (`logs -f | head -1`), as `tail -f | head`
    ends: it followed on, every line going nowhere, until the job ended (days). The lines come from the transport's
    reader threads; the main thread, waiting on them, is woken by a SIGPIPE sent to it and leaves as after Ctrl+C
    (KeyboardInterrupt: the follow channels closed). Armed in the main thread only, where Python runs handlers."""

    def __init__(self) -> None:
        self.ended = False
        self.armed = threading.current_thread() is threading.main_thread()
        self.previous = signal.signal(signal.SIGPIPE, self._handler) if self.armed else None

    def _handler(self, signum, frame):
        if reader_gone(sys.stdout) and not self.ended:  # once: a second one must not break the cleanup
            self.ended = True
            raise KeyboardInterrupt

    def __call__(self, host, stream, line) -> None:
        _raw_line(host, stream, line)
        if self.armed and not self.ended and reader_gone(sys.stdout):
            signal.pthread_kill(threading.main_thread().ident, signal.SIGPIPE)

    def disarm(self) -> None:
        if self.armed:
            self.armed = False
            signal.signal(signal.SIGPIPE, self.previous if self.previous is not None else signal.SIG_IGN)


def run_logs(spec, *, follow=False, role=None, id=None, host=None, lines=None) -> int:
    """Print `[host role.id] line` for every selected log, optionally following (until the job ends, or the reader
    of the lines goes away: exit 0)."""
    if lines is not None and lines < 0:  # refused here once, not by every host's agent
        raise UsageError(f"logs: the number of lines must be 0 or more, not {lines}")
    if host is not None and not host.strip():  # said "no process of job J matches host="
        raise UsageError("logs: --host is empty: name a host as the spec does (its address or label)")
    with _open(spec) as backend:
        if not follow:
            return backend.logs(on_line=_raw_line, role=role, id=id, host=host, lines=lines)
        ender = _EndWhenReaderLeaves()
        try:
            return backend.logs(on_line=ender, follow=True, role=role, id=id, host=host, lines=lines)
        except KeyboardInterrupt:
            if ender.ended:
                return 0
            raise
        finally:
            ender.disarm()


class _SigtermAsInterrupt:
    """While `start` owns the job (starting it, or following it), SIGTERM takes Ctrl+C's path: the job is stopped
    everywhere and the command exits 143, as mpiexec or torchrun end their ranks when a CI runner, `timeout` or a
    batch system's time limit ends them. (SIGKILL cannot be caught: the job runs on, docs/lifecycle.md.) Armed in
    the main thread only, where Python runs signal handlers; `disarm` puts back what was there."""

    def __init__(self) -> None:
        self.terminated = False
        self.previous = (signal.signal(signal.SIGTERM, self._handler)
                         if threading.current_thread() is threading.main_thread() else None)

    def _handler(self, signum, frame):
        self.terminated = True
        raise KeyboardInterrupt

    def disarm(self) -> None:
        if self.previous is not None:
            signal.signal(signal.SIGTERM, self.previous)
            self.previous = None


def _stop_after_interrupt(backend, terminated: bool = False) -> int:
    """Ctrl+C (or SIGTERM) while a job was starting or followed: stop it everywhere through fresh connections."""
    from ..backends import open_backend

    # a second Ctrl+C or SIGTERM must not abort the cleanup (which its own deadlines bound)
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        what = "terminated" if terminated else "interrupted"
        write_text(sys.stderr, paint(f"{what}: stopping the job…", "yellow", use_colour(sys.stderr)) + "\n")
        backend.close()  # ends the follow channels, which hold the worker threads
        try:
            with open_backend(backend.spec) as fresh:
                fresh.stop()
                render_status(fresh.status())
        except ClusterctlError as e:  # a host the stop did not reach: said, and the exit code still says why we ended
            error(f"{what}, but the stop did not complete: {e}")
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 128 + signal.SIGTERM if terminated else 130


# after the logs of a followed job end, how long its verdict (the coordinator's decision) may take to show
VERDICT_WAIT_S = 30.0


def run_start(spec, *, dispatch_first: bool = False, follow: bool = False, on_started=None) -> int:
    """(Dispatch,) start, print the status; with follow, stream logs until the end and exit with the job's state.
    `on_started`: called once the job has started (before following it)."""
    with _open(spec) as backend:
        if dispatch_first:
            sent = backend.dispatch(on_progress=_say)
            write_text(sys.stdout, f"dispatched: {sum(d.files_sent for d in sent)} file(s), "
                                   f"{_human(sum(d.bytes_sent for d in sent))}\n")
        for line in backend.notes():
            note(line)
        sigterm, ender = _SigtermAsInterrupt(), None
        t0 = time.monotonic()
        try:
            st = backend.start(on_progress=_say)
            if on_started is not None:
                on_started()
            write_text(sys.stdout, f"started in {time.monotonic() - t0:.1f}s\n")
            render_status(st)
            if not follow:
                return 0
            while (st := backend.status()).state == JobState.PENDING:  # a batch job waiting for its allocation
                time.sleep(0.5)
            ender = _EndWhenReaderLeaves()
            try:
                backend.logs(on_line=ender, follow=True)
            finally:
                ender.disarm()
            final = backend.status()
            # a host's logs end with its processes; the job's state (the coordinator's verdict) follows shortly
            deadline = time.monotonic() + VERDICT_WAIT_S
            while final.state in ACTIVE_JOB_STATES and time.monotonic() < deadline:
                time.sleep(0.2)
                final = backend.status()
        except KeyboardInterrupt:
            if ender is not None and ender.ended:  # `start --follow | head`: the follow ends, as `logs -f | head`'s
                note(f"the reader of the logs went away: job {backend.plan.job} runs on "
                     "(`clusterctl logs -f` follows it, `clusterctl stop` ends it)")
                return 0
            return _stop_after_interrupt(backend, sigterm.terminated)
        finally:
            sigterm.disarm()
        render_status(final)
        return 0 if final.state == JobState.SUCCEEDED else 1


def cmd_start(args: argparse.Namespace) -> int:
    """clusterctl start."""
    return run_start(args.spec, dispatch_first=args.dispatch, follow=args.follow)


def cmd_status(args: argparse.Namespace) -> int:
    """clusterctl status."""
    return run_status(args.spec, as_json=args.json)


def cmd_logs(args: argparse.Namespace) -> int:
    """clusterctl logs."""
    return run_logs(args.spec, follow=args.follow, role=args.role, id=args.id, host=args.host, lines=args.lines)


def cmd_stop(args: argparse.Namespace) -> int:
    """clusterctl stop."""
    return run_stop(args.spec)


def add_cli(sub) -> None:
    """Register the lifecycle subcommands."""
    p = sub.add_parser("dispatch", help="ship the workspace (and data shards) to every host")
    p.add_argument("spec")
    p.set_defaults(func=cmd_dispatch)

    p = sub.add_parser("start", help="start pservers, then trainers, on every host")
    p.add_argument("spec")
    p.add_argument("--follow", action="store_true", help="stream logs and exit with the job's status")
    p.add_argument("--dispatch", action="store_true", help="dispatch the workspace first")
    p.set_defaults(func=cmd_start)

    p = sub.add_parser("status", help="every process's state")
    p.add_argument("spec")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_status)

    p = sub.add_parser("logs", help="prefixed logs of every process")
    p.add_argument("spec")
    p.add_argument("--follow", "-f", action="store_true")
    p.add_argument("--role", choices=("pserver", "trainer"))
    p.add_argument("--id", type=int)
    p.add_argument("--host")
    p.add_argument("-n", dest="lines", type=int, default=None, help="last LINES lines of each log")
    p.set_defaults(func=cmd_logs)

    p = sub.add_parser("stop", help="stop the job everywhere (idempotent)")
    p.add_argument("spec")
    p.set_defaults(func=cmd_stop)
