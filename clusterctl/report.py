"""Report training progress the way `clusterctl top` and `clusterctl status` read it: one `key=value` line.

    from clusterctl.report import report

    for step in range(steps):
        loss = train_one_step()
        report(step, loss=loss, lr=lr)      # prints: step=12 loss=0.3102 lr=0.01 time=1718000000.512

Any program may print the same line itself (docs/lifecycle.md, "Progress and stragglers"): the first word
`step=N`, then `key=value` words; `time=` (Unix seconds) lets the rates be exact, `rank=` names the rank in a
log several ranks share. This module is standard library only and imports nothing else of clusterctl, so a
training script can use it where only it is installed (or copied next to the script).
"""

from __future__ import annotations

import math
import re
import sys
import time

__all__ = ["report", "format_line"]

_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_.\-/]{0,63}\Z")
_RESERVED = ("step", "time")


def _text(key: str, value: object) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return repr(value) if not math.isfinite(value) else f"{value:.6g}"
    if hasattr(value, "item"):  # a numpy or torch scalar
        return _text(key, value.item())
    text = str(value)
    if not text or any(c.isspace() for c in text) or len(text) > 64:
        raise ValueError(f"report: {key}={text!r}: a value must be a number or one word of at most 64 characters")
    return text


def format_line(step: int, metrics: dict | None = None, *, rank: int | str | None = None, when: float | None = None) -> str:
    """The progress line for `step` with `metrics` (no newline): `step=12 loss=0.31 time=1718000000.512`."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"report: step must be a whole number >= 0, not {step!r}")
    words = [f"step={step}"]
    for key, value in (metrics or {}).items():
        if not _KEY.match(key) or key in _RESERVED or key in ("rank", "trainer"):
            raise ValueError(f"report: {key!r} cannot be a metric's name (letters, digits, _.-/; not step, time, rank)")
        words.append(f"{key}={_text(key, value)}")
    if rank is not None:
        words.append(f"rank={_text('rank', rank)}")
    words.append(f"time={time.time() if when is None else when:.3f}")
    return " ".join(words)


def report(step: int, *, file=None, rank: int | str | None = None, **metrics) -> None:
    """Print one progress line for `step` (metrics as keyword arguments) and flush it, so that it is seen now."""
    out = sys.stdout if file is None else file
    out.write(format_line(step, metrics, rank=rank) + "\n")
    out.flush()
