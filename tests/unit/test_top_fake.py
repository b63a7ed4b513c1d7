"""`clusterctl top` (clusterctl/ops/top.py, clusterctl/commands/top.py) and the progress in `status`, over fake hosts: the real
agent (`agent top`), real processes printing progress lines, hosts that stop answering (tests/unit/fakehosts.py)."""

from __future__ import annotations

import json
import os
import re
import sys
import time

import pytest

from clusterctl.transport.local import LocalTransport
import yaml

from clusterctl.cli import main
from clusterctl.host.status import JobStatus, ProcessStatus
from clusterctl.ops.dispatch import dispatch
from clusterctl.ops.job import start, status, stop
from clusterctl.commands.render import render_status
from clusterctl.ops.top import Top
from clusterctl.commands.top import render_top
from clusterctl.console import out

sys.path.insert(0, os.path.dirname(__file__))
from fakehosts import FakeCluster, FaultyTransport, fake_exe, job_pids, refused, wait_until  # noqa: E402

# Every rank prints a progress line per step (as clusterctl.report writes them); rank SLOW_RANK sleeps 4x longer.
TRAIN = """\
import os, time
rank = int(os.environ["RANK"])
delay = float(os.environ.get("STEP_S", "0.05")) * (4 if str(rank) == os.environ.get("SLOW_RANK") else 1)
for step in range(1000000):
    print("step=%d loss=%.4f time=%.3f" % (step, 1.0 / (step + 1), time.time()), flush=True)
    time.sleep(delay)
"""
WINDOW = 6.0  # the shortest straggler window top takes: 6 slices of 1 s


def cluster(tmp_path, transport=None, **env):
    c = FakeCluster(tmp_path, hosts=2, files={"train.py": TRAIN}, job={"trainers": 2, "env": env})
    if transport is not None:
        c.transport = transport(c.transport)
    with c.session() as s:
        dispatch(s)
    return c


@pytest.fixture
def running(tmp_path):
    """A started 2-host, 4-rank job whose rank 3 is slow; stopped afterwards."""
    c = cluster(tmp_path, SLOW_RANK="3")
    with c.session(command_timeout=5) as s:
        start(s)
        try:
            yield c, s
        finally:
            stop(s)


def test_a_snapshot_has_every_process_its_resources_progress_and_the_straggler(running):
    c, s = running
    with Top(s, window_s=WINDOW) as top:
        snap = top.snapshot(None)
        assert [(r.host, r.name, r.state) for r in snap.rows] == [
            ("n0", "trainer.0", "running"), ("n0", "trainer.1", "running"),
            ("n1", "trainer.2", "running"), ("n1", "trainer.3", "running")]
        for r in snap.rows:
            assert isinstance(r.pid, int) and r.procs == 1 and r.cpu_pct is not None and 0 <= r.cpu_pct <= 100 * os.cpu_count()
            assert 1 << 20 < r.rss_bytes < 1 << 30
        assert [(h.host, h.status, h.state) for h in snap.hosts] == [("n0", "ok", "running"), ("n1", "ok", "running")]
        assert all(h.job_rss_bytes == sum(r.rss_bytes for r in snap.rows if r.host == h.host) for h in snap.hosts)
        # the rule needs WINDOW seconds of history: wait for its verdict (each slice is 1 s; a busy machine may
        # delay the ranks' first lines by a few seconds)
        snap = wait_until(lambda: (x := top.snapshot(None)).stragglers and x, timeout=WINDOW + 30, interval=0.5)
    assert [(st["host"], st["process"]) for st in snap.stragglers] == [("n1", "trainer.3")]
    slow = snap.rows[3]
    assert slow.straggler == {k: snap.stragglers[0][k] for k in ("rate", "median", "ratio")}
    assert snap.stragglers[0]["ratio"] < 0.8
    fast = [r.progress["rate"] for r in snap.rows[:3]]
    assert all(rate > slow.progress["rate"] for rate in fast), snap.to_json()
    assert all(r.progress["metrics"]["loss"] == pytest.approx(1 / (r.progress["step"] + 1), abs=1e-4) for r in snap.rows)
    doc = json.loads(json.dumps(snap.to_json()))
    assert doc["state"] == "running" and doc["straggler_rule"] == {"threshold": 0.8, "window_s": WINDOW}
    assert [p["name"] for p in doc["processes"]] == ["trainer.0", "trainer.1", "trainer.2", "trainer.3"]
    assert doc["stragglers"][0]["process"] == "trainer.3" and doc["hosts"][1]["host"] == "n1"
    # the view names it too
    with out.capture() as cap:
        out.print(render_top(snap))
    text = cap.get()
    assert re.search(r"straggler: trainer\.3 on n1: [\d.]+ steps/s, \d+% of the median [\d.]+ \(below 80% for 6s\)", text)
    assert "host total" in text and f"job {c.name}: running" in text


def test_status_shows_each_trainers_step_and_rate(running, capsys):
    c, s = running
    st = wait_until(lambda: (x := status(s)) and all(p.progress and p.progress["rate"] for p in x.processes) and x,
                    timeout=30, interval=0.3)
    assert all(p.progress["step"] >= 0 and "slices" not in p.progress for p in st.processes)
    assert st.stragglers == []  # the default window (a minute) has not passed
    assert st.to_json()["processes"][0]["progress"]["metrics"]["loss"] > 0
    render_status(st)
    header = next(line for line in capsys.readouterr().out.splitlines() if "host" in line and "role" in line)
    assert header.split("┃")[1:-1] and [c.strip() for c in header.split("┃")[1:-1]] == [
        "host", "role", "id", "pid", "state", "exit", "uptime", "step", "steps/s"]


def test_status_names_a_straggler(capsys):
    st = JobStatus("j", "running", processes=[
        ProcessStatus("n0", "trainer", 0, 11, "running", None, 5.0, None, {"step": 90, "rate": 9.5, "done": False}),
        ProcessStatus("n1", "trainer", 1, 12, "running", None, 5.0, None, {"step": 30, "rate": 3.1, "done": False}),
        ProcessStatus("n1", "pserver", 0, 13, "running", None, 5.0)],
        stragglers=[{"host": "n1", "process": "trainer.1", "rate": 3.1, "median": 9.4, "ratio": 0.33}])
    render_status(st)
    text = capsys.readouterr().out
    assert "straggler: trainer.1 on n1: 3.1 steps/s, 33% of the median 9.4" in text
    assert re.search(r"n1 .* trainer .* 1 .* 12 .* running .* 30 .* 3\.1 straggler", text)
    assert st.to_json()["stragglers"] == [{"host": "n1", "process": "trainer.1", "rate": 3.1, "median": 9.4, "ratio": 0.33}]


class Recording(LocalTransport):
    """A transport that records each command line it runs."""

    def __init__(self, inner: LocalTransport):
        super().__init__(inner.root, env=inner.env)
        self.commands: list = []

    def popen(self, host, command):
        self.commands.append((host.address, command))
        return super().popen(host, command)


def test_hosts_that_stop_answering_are_rows_and_the_view_goes_on(tmp_path):
    c = cluster(tmp_path)
    faulty = FaultyTransport(c.transport, only="agent top")
    with c.session(transport=faulty, command_timeout=4) as s:
        start(s)
        try:
            with Top(s, window_s=WINDOW) as top:
                assert [h.status for h in top.snapshot(None).hosts] == ["ok", "ok"]
                faulty.down.add("n1")  # refused: a row that says so, n0 goes on
                snap = top.snapshot(None)
                assert [(h.host, h.status) for h in snap.hosts] == [("n0", "ok"), ("n1", "unreachable")]
                assert re.fullmatch(refused("n1"), snap.hosts[1].error), snap.hosts[1].error
                assert [r.host for r in snap.rows] == ["n0", "n0"] and snap.state == "lost"
                with out.capture() as cap:
                    out.print(render_top(snap, title="t"))
                assert re.search(r"n1: unreachable: " + refused("n1"), cap.get())
                faulty.down.clear()
                faulty.hung.add("n1")  # frozen: the view does not wait for it
                top.snapshot(None)  # n1's refusal was answered; this request hangs until its deadline
                t0 = time.monotonic()
                snap = top.snapshot(0.5)
                assert time.monotonic() - t0 < 3 and [r.host for r in snap.rows][:2] == ["n0", "n0"]
                snap = wait_until(lambda: (x := top.snapshot(0.5)).hosts[1].status == "unreachable" and x, timeout=30)
                assert "did not answer within 4s" in snap.hosts[1].error, snap.hosts[1].error
                faulty.hung.clear()  # back: its rows return
                snap = wait_until(lambda: (x := top.snapshot(0.5)).hosts[1].status == "ok" and x, timeout=30)
                assert [r.host for r in snap.rows] == ["n0", "n0", "n1", "n1"]
        finally:
            stop(s)
    assert job_pids(c.name) == []


def test_each_refresh_is_one_command_line_that_the_supervisor_answers_with_no_python_on_the_host(tmp_path):
    c = cluster(tmp_path)
    rec = Recording(c.transport)
    with c.session(transport=rec) as s:
        start(s)
        real = os.path.realpath(c.bin / "python3")
        (c.bin / "python3").unlink()  # from here on, count the hosts' Python starts
        fake_exe(c.bin, "python3", f'echo "$*" >> {c.tmp}/python-starts\nexec {real} "$@"\n')
        try:
            rec.commands.clear()
            with Top(s, window_s=WINDOW) as top:
                first = top.snapshot(None)
                second = top.snapshot(None)
            starts = c.tmp / "python-starts"
            assert not starts.exists(), starts.read_text()  # the supervisors answered: the agent never ran
        finally:
            stop(s)  # (a peer that the coordinator's stop ended first is stopped by the agent: a Python start)
    tops = [cmd for _, cmd in rec.commands if "agent top" in cmd]
    assert len(tops) == 4, rec.commands
    request = """'"'"'top {"gpu":true,"slice":1.0,"slices":6}'"'"'"""
    assert all(cmd.startswith("ctl='f=.clusterctl/jobs/") and request in cmd
               and cmd.endswith(f"agent top .clusterctl/jobs/{c.name} --slice 1 --slices 6") for cmd in tops)
    for snap in (first, second):
        assert [(h.host, h.status) for h in snap.hosts] == [("n0", "ok"), ("n1", "ok")]
        assert sorted(r.name for r in snap.rows if r.rank is None) == ["trainer.%d" % i for i in range(4)]
    # no baseline at the first refresh: the supervisor took one and answered TOP_BASELINE_WAIT later, with CPU
    assert all(r.cpu_pct is not None for r in first.rows if r.rank is None), first.rows


def test_top_from_the_command_line(tmp_path, monkeypatch, capsys):
    c = cluster(tmp_path).everywhere(monkeypatch)
    with c.session() as s:
        start(s)
    try:
        code = main(["top", str(c.spec_path), "--once", "--json", "--no-gpu"])
        doc = json.loads(capsys.readouterr().out)
        assert code == 0 and doc["job"] == c.name and doc["state"] == "running"
        assert [(p["host"], p["name"], p["state"]) for p in doc["processes"]] == [
            ("n0", "trainer.0", "running"), ("n0", "trainer.1", "running"),
            ("n1", "trainer.2", "running"), ("n1", "trainer.3", "running")]
        assert doc["straggler_rule"] == {"threshold": 0.8, "window_s": 60.0} and doc["stragglers"] == []
        code = main(["top", str(c.spec_path), "--once"])
        text = capsys.readouterr().out
        assert code == 0 and f"job {c.name}: running · 2 host(s), 4 process(es)" in text
        assert text.count("host total") == 2 and "trainer.3" in text
        code = main(["top", str(c.spec_path), "--interval", "0.1"])
        assert (code, capsys.readouterr().err.strip()) == (2, "clusterctl: error: top: --interval must be 0.5 to 3600 "
                                                              "seconds, not 0.1")
        code = main(["top", str(c.spec_path), "--once", "--straggler-window", "2"])
        assert (code, capsys.readouterr().err.strip()) == (2, "clusterctl: error: top: the straggler window must be 6 "
                                                              "to 180 seconds, not 2")
    finally:
        with c.session() as s:
            stop(s)


def test_top_once_exits_1_when_a_hosts_answer_is_an_error(tmp_path, monkeypatch, capsys):
    # the error row was shown, and the exit was 0: only unreachable hosts counted
    c = cluster(tmp_path)
    c.everywhere(monkeypatch, transport=FaultyTransport(c.transport, hostile={"n1": ('{"ok": false, "error": "boom"}', 1)},
                                                        only="agent top"))
    code = main(["top", str(c.spec_path), "--once", "--no-gpu", "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert code == 1 and [(h["host"], h["status"], h["error"]) for h in doc["hosts"]][1] == ("n1", "error", "boom"), doc


def test_gpu_columns_with_a_fake_nvidia_smi_on_the_hosts(tmp_path):
    c = cluster(tmp_path)
    fake_exe(c.bin, "nvidia-smi", """\
        case "$1" in
          --query-gpu=*) echo "0, GPU-aaa, 87, 40213, 81559"; echo "1, GPU-bbb, 3, 4, 81559";;
          --query-compute-apps=*) ;;
        esac
        """)
    data = yaml.safe_load(c.spec_path.read_text())
    data["hosts"] = [{**h, "gpus": [0, 1]} for h in data["hosts"]]
    c.spec_path.write_text(yaml.safe_dump(data, sort_keys=False))
    with c.session() as s:
        start(s)
        try:
            with Top(s, window_s=WINDOW) as top:
                snap = top.snapshot(None)
        finally:
            stop(s)
    assert [[g["index"] for g in r.gpus] for r in snap.rows] == [[0], [1], [0], [1]]  # CUDA_VISIBLE_DEVICES per rank
    assert snap.rows[0].gpus[0] == {"index": 0, "util_pct": 87.0, "mem_used_mib": 40213.0, "mem_total_mib": 81559.0}
    assert [g["index"] for g in snap.hosts[0].gpus] == [0, 1]
    with out.capture() as cap:
        out.print(render_top(snap, title="t"))
    assert "0: 87% 39.3/79.6G" in cap.get()
