"""`clusterctl status`'s table (clusterctl/commands/render.py): stdlib only, aligned columns, ANSI colours only on a
terminal without NO_COLOR, host-supplied text escaped; and the whole `status` command imports no rich."""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import yaml

from clusterctl import cli
from clusterctl.commands.render import render_status
from clusterctl.host.status import JobStatus, ProcessStatus
from helpers import free_port_base, job_pids

ROOT = Path(__file__).resolve().parents[2]


class Stream(io.StringIO):
    """A text stream that says whether it is a terminal, and which encoding it writes."""

    def __init__(self, tty: bool, encoding: str = "utf-8"):
        super().__init__()
        self._tty, self._encoding = tty, encoding

    def isatty(self) -> bool:
        return self._tty

    @property
    def encoding(self) -> str:
        return self._encoding


def sample(**kw) -> JobStatus:
    return JobStatus("j", "running", processes=[
        ProcessStatus("n0", "trainer", 0, 11, "running", None, 5.0, None, {"step": 1200, "rate": 9.5, "done": False}),
        ProcessStatus("node-long-name", "trainer", 1, 12, "running", None, 15.25, None,
                      {"step": 30, "rate": 3.1, "done": False}),
        ProcessStatus("n1", "pserver", 0, None, "exited", 0, None)],
        stragglers=[{"host": "node-long-name", "process": "trainer.1", "rate": 3.1, "median": 9.4, "ratio": 0.33}],
        **kw)


def shown(st: JobStatus, *, tty: bool = False, encoding: str = "utf-8") -> str:
    stream = Stream(tty, encoding)
    render_status(st, file=stream)
    return stream.getvalue()


@pytest.fixture(autouse=True)
def plain_env(monkeypatch):
    for var in ("NO_COLOR", "FORCE_COLOR"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("TERM", "xterm")


def test_the_table_off_a_terminal_is_plain_text_with_aligned_columns():
    assert shown(sample(restarts=2, attempt=1, attempts=[{"attempt": 0, "outcome": "failed", "reason": "n1 lost"},
                                                         {"attempt": 1, "outcome": "running"}],
                        reason="trainer.1 is slow", unreachable={"n9": "cannot connect to n9"})) == """\
job j: running
┏━━━━━━━━━━━━━━━━┳━━━━━━━━━┳━━━━┳━━━━━┳━━━━━━━━━┳━━━━━━┳━━━━━━━━┳━━━━━━━┳━━━━━━━━━━━━━━━┓
┃ host           ┃ role    ┃ id ┃ pid ┃ state   ┃ exit ┃ uptime ┃  step ┃       steps/s ┃
┡━━━━━━━━━━━━━━━━╇━━━━━━━━━╇━━━━╇━━━━━╇━━━━━━━━━╇━━━━━━╇━━━━━━━━╇━━━━━━━╇━━━━━━━━━━━━━━━┩
│ n0             │ trainer │ 0  │ 11  │ running │      │ 5.0s   │ 1,200 │           9.5 │
│ node-long-name │ trainer │ 1  │ 12  │ running │      │ 15.2s  │    30 │ 3.1 straggler │
│ n1             │ pserver │ 0  │     │ exited  │ 0    │        │       │               │
└────────────────┴─────────┴────┴─────┴─────────┴──────┴────────┴───────┴───────────────┘
straggler: trainer.1 on node-long-name: 3.1 steps/s, 33% of the median 9.4
attempt 1 (restarts allowed: 2)
  attempt 0: failed: n1 lost
reason: trainer.1 is slow
n9: cannot connect to n9
"""


def test_without_progress_there_are_no_step_columns_and_wide_characters_count_twice():
    st = JobStatus("j", "succeeded", processes=[ProcessStatus("节点", "trainer", 0, 7, "exited", 0, 1.0),
                                                ProcessStatus("n1", "trainer", 1, 8, "exited", 0, 1.0)])
    lines = shown(st).splitlines()
    assert lines[2] == "┃ host ┃ role    ┃ id ┃ pid ┃ state  ┃ exit ┃ uptime ┃"
    assert lines[4] == "│ 节点 │ trainer │ 0  │ 7   │ exited │ 0    │ 1.0s   │"
    assert lines[5] == "│ n1   │ trainer │ 1  │ 8   │ exited │ 0    │ 1.0s   │"


def test_colours_only_on_a_terminal_and_never_with_no_color(monkeypatch):
    plain = shown(sample())
    assert "\x1b" not in plain
    coloured = shown(sample(), tty=True)
    assert coloured.splitlines()[0] == "\x1b[3mjob j: \x1b[0m\x1b[32mrunning\x1b[0m"
    assert "│ \x1b[32mrunning\x1b[0m │" in coloured and "\x1b[1;31m3.1 straggler\x1b[0m │" in coloured
    assert "┃ \x1b[1mhost\x1b[0m           ┃" in coloured  # the header bold, padded as its column
    assert re.sub(r"\x1b\[[\d;]*m", "", coloured) == plain  # the same text, only coloured
    monkeypatch.setenv("NO_COLOR", "1")
    assert shown(sample(), tty=True) == plain
    monkeypatch.delenv("NO_COLOR")
    monkeypatch.setenv("TERM", "dumb")
    assert shown(sample(), tty=True) == plain


def test_host_supplied_text_cannot_drive_the_terminal():
    """A compromised host's state, reasons and lines show their control characters as escapes, even in colour."""
    evil = "\x1b[2J\x1b]0;pwned\x07\r"
    st = JobStatus("j", "failed", processes=[ProcessStatus("n0", "trainer", 0, 5, "failed" + evil, 1, 2.0)],
                   reason="boom" + evil, unreachable={"n1": "gone" + evil}, restarts=1, attempt=1,
                   attempts=[{"attempt": 0, "outcome": "failed" + evil, "reason": "r" + evil}],
                   elastic={"lines": ["elastic" + evil]})
    escaped = r"\x1b[2J\x1b]0;pwned\x07\r"
    for tty in (False, True):
        text = shown(st, tty=tty)
        assert all(line.isprintable() for line in re.sub(r"\x1b\[[\d;]*m", "", text).splitlines())
        for want in (f"failed{escaped}", f"reason: boom{escaped}", f"n1: gone{escaped}", f"elastic{escaped}",
                     f"  attempt 0: failed{escaped}: r{escaped}"):
            assert want in re.sub(r"\x1b\[[\d;]*m", "", text), text


def test_a_terminal_without_utf8_gets_an_ascii_box():
    lines = shown(JobStatus("j", "running", processes=[ProcessStatus("n0", "trainer", 0, 5, "running", None, 2.0)]),
                  encoding="ascii").splitlines()
    assert lines == ["job j: running",
                     "+------+---------+----+-----+---------+------+--------+",
                     "| host | role    | id | pid | state   | exit | uptime |",
                     "|------+---------+----+-----+---------+------+--------|",
                     "| n0   | trainer | 0  | 5   | running |      | 2.0s   |",
                     "+------+---------+----+-----+---------+------+--------+"]


def test_a_job_without_processes_is_one_line():
    assert shown(JobStatus("j", "not running")) == "job j is not running (no state on any host)\n"
    assert shown(JobStatus("j", "pending", reason="waiting for\x1b[2J nodes")) == (
        "job j: pending (waiting for\\x1b[2J nodes)\n")


PROBE = """\
import sys
from clusterctl import cli
code = cli.main(sys.argv[1:])
sys.stderr.write("modules: " + " ".join(sorted(sys.modules)) + "\\n")
sys.exit(code)
"""


def test_the_lifecycle_commands_import_no_rich(tmp_path, monkeypatch):
    """`clusterctl start`, then `clusterctl status` of the running job, `dispatch` and `stop` (backend: local, the supervisor a real one),
    each in a process of its own: the table is shown and rich was never imported (issue 23: its import cost more
    than the rest of `status`). sys.modules at the end, not `-X importtime`, which misses what
    importlib.import_module loads (the plugins)."""
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    name = f"render-{uuid.uuid4().hex[:8]}"
    base = free_port_base(24)
    (tmp_path / "ws").mkdir()
    (tmp_path / "ws" / "train.py").write_text("")
    spec = tmp_path / "local.yaml"
    spec.write_text(yaml.safe_dump({
        "name": name, "backend": "local", "hosts": [{"address": "localhost"}],
        "workspace": {"local": str(tmp_path / "ws"), "remote": f"clusterctl-local/{name}"},
        "job": {"entrypoint": ["sleep", "300"], "trainers": 2, "grace": 3,
                "ports": {"control": base, "master": base + 1, "pserver": base + 2, "trainer": base + 12}}}))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}

    def probe(*argv):
        res = subprocess.run([sys.executable, "-c", PROBE, *argv, str(spec)], capture_output=True, text=True,
                             env=env, timeout=120)
        modules = set(res.stderr.rsplit("modules: ", 1)[-1].split())
        assert "clusterctl.commands.lifecycle" in modules, res.stderr[-3000:]  # the probe sees the command's imports
        assert not {m for m in modules if m == "rich" or m.startswith("rich.")}, (argv, sorted(modules))
        return res, modules

    try:
        res, _ = probe("start", "--dispatch")  # `start` too: its progress lines and the table
        assert res.returncode == 0 and "started in " in res.stdout and "launching…" in res.stderr, res
        res, modules = probe("status")
        assert res.returncode == 0, res.stderr[-3000:]
        rows = [[c.strip() for c in line.split("│")[1:-1]] for line in res.stdout.splitlines() if "│" in line]
        assert [(r[0], r[1], r[2], r[4]) for r in rows] == [("localhost", "trainer", "0", "running"),
                                                           ("localhost", "trainer", "1", "running")], res.stdout
        assert res.stdout.startswith(f"job {name}: running\n"), res.stdout
        assert {"clusterctl.commands.render", "clusterctl.backends.local"} <= modules
        res, _ = probe("dispatch")  # nothing changed since the start's dispatch: a row that says so
        rows = [[c.strip() for c in line.split("│")[1:-1]] for line in res.stdout.splitlines() if "│" in line]
        assert res.returncode == 0 and res.stdout.startswith("dispatch ("), res
        head = [c.strip() for c in res.stdout.splitlines()[2].split("┃")[1:-1]]
        assert head == ["host", "files sent", "bytes sent", "deleted", "generation"], res.stdout
        assert [r[:2] for r in rows] == [["localhost", "0"]], res.stdout
        res, _ = probe("stop")
        assert res.returncode == 0 and res.stdout == f"job {name} stopped on 1 host(s), 2 process(es) killed\n", res
    finally:
        assert cli.main(["stop", str(spec)]) == 0
    assert not job_pids(name)
