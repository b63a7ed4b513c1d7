"""Training progress from log lines: `step=N loss=X trainer=T ...` and `done steps=.. loss=.. steps_per_s=.. wall_s=..`.

The examples print these key=value lines; this module turns a stream of `[host role.id] line` log lines
into per-trainer state for a live display and a final summary. Pure parsing: no I/O.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from rich.table import Table

__all__ = ["TrainerProgress", "Progress", "parse_fields"]

_PREFIX = re.compile(r"^\[(?P<host>[^\]\s]+) (?P<role>pserver|trainer)\.(?P<id>\d+)\] (?P<text>.*)$")
_FIELD = re.compile(r"(\w+)=(\S+)")


def parse_fields(text: str) -> dict[str, str]:
    """`a=1 b=x` → {'a': '1', 'b': 'x'}."""
    return dict(_FIELD.findall(text))


@dataclass
class TrainerProgress:
    """What one trainer last reported."""

    host: str
    id: int
    step: int | None = None
    loss: float | None = None
    done: bool = False
    steps_per_s: float | None = None
    wall_s: float | None = None
    failed: str | None = None


@dataclass
class Progress:
    """Per-trainer progress folded from prefixed log lines."""

    trainers: dict[int, TrainerProgress] = field(default_factory=dict)
    other_lines: list[str] = field(default_factory=list)

    def feed(self, line: str) -> bool:
        """Fold one log line in; True when it changed a trainer's progress."""
        m = _PREFIX.match(line)
        if not m or m["role"] != "trainer":
            self.other_lines.append(line)
            return False
        tid = int(m["id"])
        tp = self.trainers.setdefault(tid, TrainerProgress(m["host"], tid))
        text = m["text"]
        fields = parse_fields(text)
        if text.startswith("done ") and "loss" in fields:
            tp.done = True
            tp.step = int(fields.get("steps", tp.step or 0))
            tp.loss = float(fields["loss"])
            tp.steps_per_s = float(fields["steps_per_s"]) if "steps_per_s" in fields else None
            tp.wall_s = float(fields["wall_s"]) if "wall_s" in fields else None
            return True
        if text.startswith("failed "):
            tp.failed = fields.get("error", text)
            return True
        if text.startswith("step=") and "loss" in fields:
            tp.step = int(fields["step"])
            tp.loss = float(fields["loss"])
            return True
        self.other_lines.append(line)
        return False

    def table(self, title: str) -> Table:
        """A rich table: one row per trainer."""
        t = Table(title=title, title_justify="left")
        for col in ("trainer", "host", "step", "loss", "steps/s", "wall", "state"):
            t.add_column(col, no_wrap=True, justify="right" if col in ("step", "loss", "steps/s", "wall") else "left")
        for tid in sorted(self.trainers):
            tp = self.trainers[tid]
            state = "[red]failed[/]" if tp.failed else ("[green]done[/]" if tp.done else "training")
            t.add_row(
                str(tid),
                tp.host,
                "" if tp.step is None else str(tp.step),
                "" if tp.loss is None else f"{tp.loss:.4f}",
                "" if tp.steps_per_s is None else f"{tp.steps_per_s:.1f}",
                "" if tp.wall_s is None else f"{tp.wall_s:.2f}s",
                state,
            )
        return t
