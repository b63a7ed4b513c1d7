"""Rendering shared by the CLI and fabfile: consoles, prefixed output lines, and error exits."""

from __future__ import annotations

import logging
import os
import sys
import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rich.console import Console

    from .plan import Host

    out: Console  # module attributes made on first access by __getattr__ below
    err: Console

__all__ = ["out", "err", "setup_logging", "LinePrinter", "error", "note", "write_line", "write_text", "output_error",
           "reader_gone", "printable", "use_colour", "paint"]

# `out` and `err` (rich Consoles) are made on first use: rich costs ~0.1 s to import, and a command that
# only streams lines (`exec`) or fails early never needs it (module __getattr__, PEP 562).
_consoles: dict = {}


MIN_WIDTH = 40  # the narrowest output rich is given: a table of a few columns still shows its cells


def _console(name: str):
    if name not in _consoles:
        from rich.console import Console

        columns = os.environ.get("COLUMNS", "")
        # rich takes COLUMNS=0 (or garbage read as 0) for a width of nothing, and then prints nothing at all; a
        # few columns (COLUMNS=8) leave its tables no room for a cell: empty frames
        width = {} if not columns else {"width": 80} if not columns.isdigit() or int(columns) == 0 else \
            {"width": max(int(columns), MIN_WIDTH)}
        class Quiet(Console):
            def on_broken_pipe(self) -> None:
                """Our reader went away (`doctor | head`): the rest of the output goes nowhere and the command goes
                on to its own exit code (rich's own ends the process, exit 1, mid-command)."""
                self.quiet = True
                to_devnull(sys.stderr if self.stderr else sys.stdout)

        _consoles[name] = Quiet(stderr=name == "err", highlight=False, soft_wrap=True, **width)
    return _consoles[name]


def __getattr__(name: str):
    """`out` / `err`: the stdout / stderr rich Console, created (and rich imported) on first access."""
    if name in ("out", "err"):
        return _console(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class _LazyRichHandler(logging.Handler):
    """A RichHandler on `err`, made (rich imported) when the first record arrives."""

    def __init__(self, level: int = logging.NOTSET):
        super().__init__(level)
        self._rich: logging.Handler | None = None

    def emit(self, record: logging.LogRecord) -> None:
        """Hand the record to the RichHandler, creating it first when needed."""
        if self._rich is None:
            from rich.logging import RichHandler

            self._rich = RichHandler(console=_console("err"), show_time=False, show_path=False, markup=False)
            self._rich.setFormatter(self.formatter)
        self._rich.handle(record)


def hold_std_fds() -> None:
    """Started with its standard input or error closed (`<&-`, `2>&-`: some CI runners, cron set-ups): /dev/null takes
    descriptor 0 or 2, as OpenSSH's sanitise_stdfd does, so that no file opened later (a spec, a key, a cache, a
    socket) becomes one of them, and so the standard input or error of what clusterctl starts (ssh, rsync, kubectl).
    With its error closed a command runs as usual, its messages going nowhere and its exit code saying how it ended,
    as `cp` or `git` do (it exited 1 doing nothing). A closed standard output is the caller's to refuse."""
    for fd, flags in ((0, os.O_RDONLY), (2, os.O_WRONLY)):
        try:
            os.fstat(fd)
        except OSError:
            null = os.open(os.devnull, flags)
            if null != fd:  # the lowest free descriptor: 1 when standard output is closed too (it stays closed)
                os.dup2(null, fd)
                os.close(null)
    if sys.stderr is None:  # Python found descriptor 2 closed at its start
        sys.stderr = open(2, "w", encoding="utf-8", errors="backslashreplace", closefd=False)


def tolerate_encoding() -> None:
    """Standard output and error that cannot encode every character (`PYTHONIOENCODING=ascii`, a C locale without
    UTF-8 coercion) write what they cannot as escapes (`\\xb7`), instead of failing the command mid-table."""
    for stream in (sys.stdout, sys.stderr):
        encoding = (getattr(stream, "encoding", None) or "").lower().replace("-", "").replace("_", "")
        if stream is not None and not encoding.startswith("utf") and hasattr(stream, "reconfigure"):
            try:
                stream.reconfigure(errors="backslashreplace")
            except (ValueError, OSError):  # closed, or a stream that cannot change now
                pass


def setup_logging(verbose: bool = False) -> None:
    """Send clusterctl's log records (warnings by default) to stderr."""
    handler = _LazyRichHandler()
    logging.basicConfig(level=logging.DEBUG if verbose else logging.WARNING, handlers=[handler], format="%(message)s")
    logging.getLogger("paramiko").setLevel(logging.CRITICAL)  # its failures reach the user as our messages


def printable(text: str) -> str:
    """`text` safe for a terminal: control characters (ANSI escapes, `\r`, backspace, C1 codes, bidi
    overrides...) shown as Python escapes (`\x1b`); tabs kept. What hosts send never drives the terminal."""
    if text.isprintable():  # the common case, at C speed
        return text
    return "".join(c if c.isprintable() or c == "\t" else _escaped(c) for c in text)


def _escaped(c: str) -> str:
    """One character as printable() shows it: a byte that was not UTF-8 (in a file name or an argument, Python's
    surrogateescape, U+DC80-U+DCFF) as that byte, `\\xff`, not `\\udcff`; anything else as Python's repr has it."""
    return f"\\x{ord(c) - 0xDC00:02x}" if "\udc80" <= c <= "\udcff" else repr(c)[1:-1]


def markup_safe(text) -> str:
    """`text` (from a host, or holding its words) for rich markup: control characters escaped as printable() does
    (rich's own escape() leaves ESC alone), then rich's markup (`[...]`) escaped."""
    from rich.markup import escape

    return escape(printable(str(text)))


_SGR = {"bold": "1", "dim": "2", "italic": "3", "red": "31", "green": "32", "yellow": "33"}


def use_colour(stream) -> bool:
    """Whether `stream` gets ANSI colours: a terminal (or FORCE_COLOR set), not TERM=dumb, and NO_COLOR unset
    (https://no-color.org: set and not empty)."""
    if os.environ.get("NO_COLOR"):
        return False
    if os.environ.get("FORCE_COLOR"):
        return True
    try:
        return stream.isatty() and os.environ.get("TERM") != "dumb"
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


def paint(text: str, style: str, colour: bool) -> str:
    """`text` in `style` ("bold red", "green", ...) as ANSI SGR codes when `colour`, else as it is."""
    if not colour or not style or not text:
        return text
    return f"\x1b[{';'.join(_SGR[word] for word in style.split())}m{text}\x1b[0m"


def error(message: str) -> None:
    """Print an error message, one `clusterctl: error:` line per line of `message`."""
    from rich.markup import escape

    for line in str(message).splitlines() or [""]:
        _console("err").print(f"[bold red]clusterctl: error:[/] {escape(printable(line))}")


def note(message: str) -> None:
    """Tell the user something they should know before going on: one `clusterctl: note:` line on stderr (no rich)."""
    write_text(sys.stderr, paint("clusterctl: note:", "yellow", use_colour(sys.stderr)) + " " + printable(message) + "\n")


class LinePrinter:
    """Prints remote output lines as `[host] line`, stdout to stdout and stderr to stderr, never interleaved."""

    def __init__(self, width: int = 0):
        self._lock = threading.Lock()
        self.width = width

    def __call__(self, host: Host, stream: str, line: str) -> None:
        prefix = f"[{host.label}]".ljust(self.width + 2)
        target = sys.stdout if stream == "out" else sys.stderr
        with self._lock:
            write_line(target, f"{prefix} {line}")


def write_line(target, text: str) -> None:
    """Write one line (control characters escaped: see printable); when our reader went away (`| head`),
    drop output instead of failing remote work."""
    write_text(target, printable(text) + "\n")


_output_errors: list[OSError] = []  # writes that failed other than by EPIPE (`> /dev/full`): the command fails


_readers_gone: list = []  # the streams whose reader went away (`logs -f | head -1`): write_text dropped their output


def reader_gone(stream) -> bool:
    """Whether a write to `stream` found that its reader went away (EPIPE): what is written there goes nowhere."""
    return any(s is stream for s in _readers_gone)


def output_error() -> OSError | None:
    """The first write of output that failed, other than because our reader went away (see write_text)."""
    return _output_errors[0] if _output_errors else None


def to_devnull(stream) -> None:
    """Point `stream`'s descriptor at /dev/null: what is left in its buffer, and what is written later, goes
    nowhere (Python's documented recipe for EPIPE on stdout: the interpreter's exit flushes it again)."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, stream.fileno())
        finally:
            os.close(devnull)
    except (OSError, ValueError, AttributeError):
        pass


def write_text(target, text: str) -> None:
    """Write `text` as it is (already printable) and flush. When our reader went away (`| head`), drop output
    (write_line); when the output cannot take it (`> /dev/full`), drop output too and remember why (output_error:
    the command then fails, clusterctl.cli.guarded). Never raises: the writer may be the thread that reads a
    remote command's output, and a reader that dies leaves that command blocked on a full pipe forever."""
    try:
        target.write(text)
        target.flush()
    except OSError as exc:
        if not isinstance(exc, BrokenPipeError):
            _output_errors.append(exc)
        elif not reader_gone(target):
            _readers_gone.append(target)
        to_devnull(target)
