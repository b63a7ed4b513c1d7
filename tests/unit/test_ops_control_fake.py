"""status, stop, logs and top of a running job through each host's supervisor (its control socket), over fake
hosts: real daemonized supervisors (`agent up`), real processes, each host a directory (tests/unit/fakehosts.py).
The hosts' `python3` counts its starts: a running supervisor answers with none; where it is dead (kill -9), the
agent answers from the state files and stops what is left, as before."""

import json
import os
import signal
import sys
import threading
import time

from clusterctl.ops.dispatch import dispatch
from clusterctl.ops.job import logs, start, status, stop
from clusterctl.ops.top import Top

sys.path.insert(0, os.path.dirname(__file__))
from fakehosts import FakeCluster, fake_exe, job_pids, wait_until  # noqa: E402

# each trainer says hello, then waits (ignoring SIGTERM when IGNORE_TERM is set: it outlives a killed supervisor)
TRAIN = """\
import os, signal, time
if os.environ.get("IGNORE_TERM"):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
print("hello from rank", os.environ["RANK"], flush=True)
time.sleep(120)
"""
GRACE = 2  # the job's grace (FakeCluster's spec); a stop waits at most this plus the SIGKILL phase
STOP_WAIT = GRACE + 5.0 + 15.0  # + stopping.Stopper's SIGKILL phase + a busy machine's scheduling


def cluster(tmp_path, hosts=2, **job):
    c = FakeCluster(tmp_path, hosts=hosts, files={"train.py": TRAIN}, job=job)
    with c.session() as s:
        dispatch(s)
    return c


def count_python(c):
    """From now on, every `python3` a fake host starts is written to <tmp>/python-starts; returns a reader."""
    real = os.path.realpath(c.bin / "python3")
    (c.bin / "python3").unlink()
    fake_exe(c.bin, "python3", f'echo "$*" >> {c.tmp}/python-starts\nexec {real} "$@"\n')
    path = c.tmp / "python-starts"
    return lambda: path.read_text().splitlines() if path.exists() else []


def collect(s, **kw):
    lines = []
    logs(s, on_line=lambda h, stream, line: lines.append((h.label, stream, line)), **kw)
    return sorted(lines)


def supervisor_pid(c, i):
    with open(c.home(i) / ".clusterctl" / "jobs" / c.name / "state.json") as f:
        return json.load(f)["supervisor"]["pid"]


def test_status_top_logs_and_stop_of_a_running_job_start_no_python_on_the_hosts(tmp_path):
    c = cluster(tmp_path, trainers=2)
    with c.session() as s:
        start(s)
        starts = count_python(c)
        try:
            hello = [("n0", "out", "[n0 trainer.0] hello from rank 0"), ("n0", "out", "[n0 trainer.1] hello from rank 1"),
                     ("n1", "out", "[n1 trainer.2] hello from rank 2"), ("n1", "out", "[n1 trainer.3] hello from rank 3")]
            wait_until(lambda: collect(s) == hello)
            st = status(s)
            assert st.state == "running" and st.unreachable == {}
            assert [(p.host, p.id, p.state) for p in st.processes] == [
                ("n0", 0, "running"), ("n0", 1, "running"), ("n1", 2, "running"), ("n1", 3, "running")]
            assert collect(s, host="n1", role="trainer", id=3, lines=1) == [("n1", "out", "[n1 trainer.3] hello from rank 3")]
            with Top(s, window_s=6.0, gpu=False) as top:
                snap = top.snapshot(None)
            assert [(h.host, h.status, h.state) for h in snap.hosts] == [("n0", "ok", "running"), ("n1", "ok", "running")]
            # a follow streams until the job ends: the stop below ends it
            followed = []
            follower = threading.Thread(target=lambda: logs(
                s, follow=True, on_line=lambda h, stream, line: followed.append((h.label, stream, line))))
            follower.start()
            wait_until(lambda: sorted(followed) == hello)  # both hosts stream
            assert starts() == []  # every answer came from the supervisors
        finally:
            pids = set(job_pids(c.name))
            replies = stop(s)
        follower.join(STOP_WAIT)
        assert not follower.is_alive() and sorted(followed) == hello
        # every process killed once, whichever host's stop (or the coordinator's broadcast) got there first
        killed = [k["pid"] for r in replies.values() for k in r["killed"]]
        assert sorted(killed) == sorted(pids) and len(killed) == 4
        assert all(r["ok"] and r["state"] == "stopped" for r in replies.values()), replies
        assert job_pids(c.name) == []
        # a peer whose supervisor the coordinator's stop ended before its own request came is asked by the agent
        assert all(" agent stop " in f" {line} " for line in starts()), starts()


def test_a_host_whose_supervisor_died_is_answered_by_the_agent_from_its_state_files(tmp_path):
    c = cluster(tmp_path, hosts=1, env={"IGNORE_TERM": "1"})
    with c.session() as s:
        start(s)
        starts = count_python(c)
        wait_until(lambda: collect(s) == [("n0", "out", "[n0 trainer.0] hello from rank 0")])
        assert starts() == []
        (orphan,) = job_pids(c.name)
        os.kill(supervisor_pid(c, 0), signal.SIGKILL)  # its trainer ignores the SIGTERM its death sends
        st = wait_until(lambda: (x := status(s)).state == "lost" and x)
        assert st.reason.startswith("n0: supervisor is not running (was running")
        assert [(p.pid, p.state) for p in st.processes] == [(orphan, "running")]
        assert len(starts()) >= 1 and all(" agent top " in line for line in starts())
        before = len(starts())
        assert collect(s) == [("n0", "out", "[n0 trainer.0] hello from rank 0")]  # the agent reads the files
        t0 = time.monotonic()
        (reply,) = stop(s).values()
        assert time.monotonic() - t0 < STOP_WAIT
        assert reply["was_running"] and reply["supervisor"] is None and reply["ok"]
        assert [(k["pid"], k["signal"]) for k in reply["killed"]] == [(orphan, "SIGKILL")]  # after the grace
        assert job_pids(c.name) == []
        assert [line.split(" agent ")[1].split()[0] for line in starts()[before:]] == ["logs", "stop"]


def test_a_stop_answered_by_the_supervisor_counts_exactly_what_it_killed(tmp_path):
    c = cluster(tmp_path, hosts=1, trainers=3)
    with c.session() as s:
        start(s)
        starts = count_python(c)
        pids = set(job_pids(c.name))
        assert len(pids) == 3
        (reply,) = stop(s).values()
        assert starts() == []
        assert reply["supervisor"] == "answered" and reply["was_running"] and reply["left"] == []
        assert {k["pid"] for k in reply["killed"]} == pids and len(reply["killed"]) == 3
        (again,) = stop(s).values()  # the supervisor is gone now: the agent, which reports nothing twice
        assert again["killed"] == [] and again["was_running"] is False and len(starts()) == 1
        assert status(s).state == "stopped"


def test_enough_waits_for_the_others_as_long_again_as_the_needed_answers_took_then_cuts_them():
    """control.Enough (an elastic job's status): not set before `need` has a reason; then set once as long again as
    that took, plus the grace, has passed; a host not waited for gets a TimedOut Result that says why."""
    from clusterctl.ops.control import Enough
    from clusterctl.plan import Host
    from clusterctl.remote import Result

    a, b, lost = (Host(f"10.0.0.{i}", 22, "u", i) for i in (1, 2, 3))
    enough = Enough(lambda got: "its hosts all answered" if {a, b} <= set(got) else None, grace_s=0.3)
    time.sleep(0.2)
    enough.add(a, Result(a, "c", 0, "{}", "", 0.1))
    assert not enough.is_set()
    enough.add(b, Result(b, "c", 0, "{}", "", 0.1))
    t = time.monotonic()
    assert not enough.is_set()
    while not enough.is_set():
        time.sleep(0.01)
    assert 0.45 < time.monotonic() - t < 3  # 0.2 s (what the answers took) + 0.3 s
    cut = enough.cut(lost, "c", 1.26)
    assert (cut.answered, cut.timed_out, cut.stderr) == (False, True, "no answer in 1.3s, not waited for: its hosts all answered")
