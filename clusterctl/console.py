"""Rendering shared by the CLI and fabfile: consoles, prefixed output lines, and error exits."""

from __future__ import annotations

import logging
import os
import sys
import threading

from rich.console import Console
from rich.logging import RichHandler
from rich.markup import escape

from .plan import Host

__all__ = ["out", "err", "setup_logging", "LinePrinter", "error", "write_line", "printable"]

out = Console(highlight=False, soft_wrap=True)
err = Console(stderr=True, highlight=False, soft_wrap=True)


def setup_logging(verbose: bool = False) -> None:
    """Send clusterctl's log records (warnings by default) to stderr."""
    handler = RichHandler(console=err, show_time=False, show_path=False, markup=False)
    logging.basicConfig(level=logging.DEBUG if verbose else logging.WARNING, handlers=[handler], format="%(message)s")
    logging.getLogger("paramiko").setLevel(logging.CRITICAL)  # its failures reach the user as our messages


def printable(text: str) -> str:
    """`text` safe for a terminal: control characters (ANSI escapes, `\r`, backspace, C1 codes, bidi
    overrides...) shown as Python escapes (`\x1b`); tabs kept. What hosts send never drives the terminal."""
    if text.isprintable():  # the common case, at C speed
        return text
    return "".join(c if c.isprintable() or c == "\t" else repr(c)[1:-1] for c in text)


def error(message: str) -> None:
    """Print an error message, one `clusterctl: error:` line per line of `message`."""
    for line in str(message).splitlines() or [""]:
        err.print(f"[bold red]clusterctl: error:[/] {escape(printable(line))}")


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
    try:
        target.write(printable(text) + "\n")
        target.flush()
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)  # Python's documented recipe for EPIPE on stdout
        os.dup2(devnull, target.fileno())
        os.close(devnull)
