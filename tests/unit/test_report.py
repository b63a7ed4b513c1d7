"""clusterctl.report: the helper that prints progress lines, standard library only."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from clusterctl.host.progressline import parse_progress_line
from clusterctl.report import format_line, report

ROOT = Path(__file__).resolve().parents[2]


def test_a_line_reads_back_as_what_was_reported():
    line = format_line(12, {"loss": 0.31024567, "lr": 1e-4, "epoch": 3, "phase": "warmup", "ok": True}, when=1718000000.5)
    assert line == "step=12 loss=0.310246 lr=0.0001 epoch=3 phase=warmup ok=1 time=1718000000.500"
    assert parse_progress_line(line) == {"step": 12, "done": False, "time": 1718000000.5, "rank": None,
                                         "metrics": {"loss": 0.310246, "lr": 0.0001, "epoch": 3, "phase": "warmup",
                                                     "ok": 1}}
    assert format_line(0, rank=3, when=1.0) == "step=0 rank=3 time=1.000"


def test_report_writes_one_flushed_line():
    class Sink(io.StringIO):
        flushes = 0

        def flush(self):
            self.flushes += 1

    sink = Sink()
    report(5, loss=float("nan"), file=sink)
    text = sink.getvalue()
    assert text.startswith("step=5 loss=nan time=") and text.endswith("\n") and text.count("\n") == 1
    assert sink.flushes == 1


class Scalar:
    """A numpy/torch scalar: has .item()."""

    def item(self):
        return 0.25


def test_scalars_with_item():
    assert format_line(1, {"loss": Scalar()}, when=2.0) == "step=1 loss=0.25 time=2.000"


@pytest.mark.parametrize("step, metrics, message", [
    (-1, {}, "report: step must be a whole number >= 0, not -1"),
    (1.5, {}, "report: step must be a whole number >= 0, not 1.5"),
    (True, {}, "report: step must be a whole number >= 0, not True"),
    (1, {"time": 3}, "report: 'time' cannot be a metric's name (letters, digits, _.-/; not step, time, rank)"),
    (1, {"rank": 3}, "report: 'rank' cannot be a metric's name (letters, digits, _.-/; not step, time, rank)"),
    (1, {"a b": 3}, "report: 'a b' cannot be a metric's name (letters, digits, _.-/; not step, time, rank)"),
    (1, {"phase": "two words"}, "report: phase='two words': a value must be a number or one word of at most 64 characters"),
    (1, {"phase": ""}, "report: phase='': a value must be a number or one word of at most 64 characters"),
])
def test_bad_input_is_one_clear_error(step, metrics, message):
    with pytest.raises(ValueError) as exc:
        format_line(step, metrics)
    assert str(exc.value) == message


def test_importing_it_pulls_in_nothing_heavy():
    """A training script imports it without clusterctl's dependencies: python -S (no site-packages at all), and
    nothing of clusterctl but the package's __init__ and this module."""
    code = ("import sys; before = set(sys.modules); import clusterctl.report as r; "
            "import json; print(json.dumps(sorted(set(sys.modules) - before)))")
    res = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, timeout=60,
                         env={"PYTHONPATH": str(ROOT), "PATH": os.environ.get("PATH", "")}, cwd="/")
    assert res.returncode == 0, res.stderr
    loaded = json.loads(res.stdout)
    assert [m for m in loaded if m.startswith("clusterctl")] == ["clusterctl", "clusterctl.report"]
    heavy = {"rich", "pydantic", "yaml", "fabric", "paramiko", "invoke", "jinja2", "numpy"}
    assert not heavy & {m.split(".")[0] for m in loaded}, loaded
