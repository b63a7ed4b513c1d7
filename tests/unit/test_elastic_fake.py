"""Elastic jobs over fake hosts (tests/unit/fakehosts.py): the real operations, the real host supervisors and
real processes on this machine, a host "lost" by killing its supervisor with SIGKILL (its processes follow it:
PR_SET_PDEATHSIG). The wiring of clusterctl/host/elastic.py into the supervisor, end to end: a spare takes the
lost host's place, the coordinator's host lost and its successor takes over, status and logs say so. The
docker test cluster runs the same with hosts stopped hard (tests/integration/test_elastic_cluster.py)."""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import time

import pytest
import yaml

from clusterctl.errors import JobError
from clusterctl.ops.dispatch import dispatch
from clusterctl.ops.job import logs, start, status, stop
from clusterctl.ops.top import Top
from clusterctl.commands.render import render_status

sys.path.insert(0, os.path.dirname(__file__))
from fakehosts import FakeCluster, FaultyTransport, job_pids, wait_until  # noqa: E402

# Attempt 0 runs until it is stopped; a later attempt prints its world and exits 0.
TRAIN = """\
import os, sys, time
attempt = int(os.environ.get("CLUSTERCTL_RESTART_COUNT", "0"))
print("rank %s of %s master %s attempt %d" % (os.environ["RANK"], os.environ["WORLD_SIZE"],
                                              os.environ["MASTER_ADDR"], attempt), flush=True)
if attempt == 0:
    time.sleep(120)
"""

# the documented timings (docs/agent.md): a killed supervisor's connection is reset at once; the coordinator's
# successor takes over reconnect_timeout (3 s) after the loss; a busy machine adds its own delays
DEADLINE = 60.0


def elastic_cluster(tmp_path, members=3, spares=1, **job):
    """A fake cluster of `members` hosts and `spares` spares (the last ones) running TRAIN, dispatched."""
    c = FakeCluster(tmp_path, hosts=members + spares, files={"train.py": TRAIN},
                    job={"restarts": 2, "restart_backoff": 1, **job})
    spec = yaml.safe_load(c.spec_path.read_text())
    for h in spec["hosts"][members:]:
        h["spare"] = True
    c.spec_path.write_text(yaml.safe_dump(spec, sort_keys=False))
    with c.session() as s:
        dispatch(s)
    return c


def state(c, i):
    with open(c.home(i) / ".clusterctl" / "jobs" / c.name / "state.json") as f:
        return json.load(f)


def lose(c, i):
    """Host n<i> is lost: its supervisor killed with SIGKILL (its processes get SIGTERM from the kernel)."""
    os.kill(state(c, i)["supervisor"]["pid"], signal.SIGKILL)


def collect(session):
    lines = []
    logs(session, on_line=lambda h, stream, line: lines.append(line))
    return sorted(lines)


@pytest.mark.timeout(180)
def test_a_lost_host_is_replaced_by_the_spare_and_the_job_finishes_there(tmp_path, capsys):
    c = elastic_cluster(tmp_path, min_hosts=2)
    try:
        with c.session() as s:
            st = start(s)  # every host's supervisor, the spare's too; nothing runs before all four joined
            assert [(p.host, p.id) for p in st.processes] == [("n0", 0), ("n1", 1), ("n2", 2)]
            wait_until(lambda: all(p.state == "running" for p in status(s).processes), DEADLINE)
            assert state(c, 3)["elastic"]["member"] is False and state(c, 3)["processes"] == []
            # `running` is the spawn, not the script's first line: under load n0's trainer printed nothing yet when
            # n2 went, and attempt 0 had no line to show below
            first = "[n0 trainer.0] rank 0 of 3 master 127.0.0.1 attempt 0"
            wait_until(lambda: first in collect(s), DEADLINE)
            lose(c, 2)
            # n2 is outside attempt 1: a status waits for it (its agent reads its state files) as long again as
            # attempt 1's hosts took to answer, plus a second; a loaded machine may take longer for its rows
            done = wait_until(lambda: (x := status(s)).state == "succeeded" and "n2" not in x.unreachable and x,
                              DEADLINE)
            # attempt 1 ran on n0, n1 and the spare n3 in n2's place: rank 2 there, the world as before
            assert [(p.host, p.role, p.id, p.state) for p in done.processes] == [
                ("n0", "trainer", 0, "exited"), ("n1", "trainer", 1, "exited"), ("n2", "trainer", 2, "lost"),
                ("n3", "trainer", 2, "exited")]
            assert (done.attempt, done.reason) == (1, None)
            assert done.attempts[0]["outcome"] == "failed" and done.attempts[0]["reason"].startswith("lost host n2: ")
            assert done.elastic["members"] == ["n0", "n1", "n3"]
            assert done.elastic["lines"] == [
                "attempt 1 runs on 3 host(s) (min 2): n0, n1, n3; coordinator n0",
                "n2: lost at attempt 0",
                "host n2 lost at attempt 0; n3 (spare) in its place at attempt 1"]
            render_status(done)
            out = capsys.readouterr().out
            assert "host n2 lost at attempt 0; n3 (spare) in its place at attempt 1" in out
            # the lost host hung (a machine gone behind a bastion answers nothing until the deadline): status waits
            # for attempt 1's hosts, not for the host the job left (each call paid its connect timeout)
            with c.session(transport=FaultyTransport(c.transport, hung={"n2"}), command_timeout=60) as hung:
                t0 = time.monotonic()
                again = status(hung)
                assert time.monotonic() - t0 < 30 and again.state == "succeeded"
                with Top(hung) as top:  # nor does `top --once`'s snapshot
                    t0 = time.monotonic()
                    once = top.snapshot()
                    assert time.monotonic() - t0 < 30 and once.state == "succeeded"
                assert [(h.status, h.error.split(", ")[1]) for h in once.hosts if h.host == "n2"] == [
                    ("unreachable", "not waited for: attempt 1 runs without it and its hosts all answered")]
                # nor `logs`, whose replies carry no view: the last status noted n2 as left on this controller
                t0 = time.monotonic()
                with pytest.raises(JobError, match=r"logs incomplete:\nn2: no answer in \d+\.\ds, not waited for: "
                                                   r"attempt 1 ran without it at the job's last status$"):
                    collect(hung)
                assert time.monotonic() - t0 < 30
            assert "n2" not in status(s).unreachable  # it answers again: no longer noted, `logs` waits for it
            assert "[n3 trainer.2#1] rank 2 of 3 master 127.0.0.1 attempt 1" in collect(s)
            assert re.fullmatch(r"no answer in \d+\.\ds, not waited for: attempt 1 runs without it and its hosts all "
                                r"answered", again.unreachable["n2"]), again.unreachable
            # `top` folds the job's state as `status` does (it said `lost`: n2's own word) and shows the same lines
            with Top(s) as top:
                snap = top.snapshot()
            assert (snap.state, snap.elastic["lines"]) == ("succeeded", done.elastic["lines"])
            assert [h.state for h in snap.hosts if h.host == "n2"] == ["lost"]
            # the spare's logs are the job's logs too; the lost host's are gone with it (here: not answering)
            lines = collect(s)
            assert "[n3 trainer.2#1] rank 2 of 3 master 127.0.0.1 attempt 1" in lines
            assert "[n0 trainer.0#1] rank 0 of 3 master 127.0.0.1 attempt 1" in lines
            assert first in lines
            stop(s)
        assert job_pids(c.name) == []
    finally:
        for pid in job_pids(c.name):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.timeout(180)
def test_the_coordinators_host_lost_its_successor_takes_over_and_the_job_goes_on_without_it(tmp_path):
    c = elastic_cluster(tmp_path, members=3, spares=0, min_hosts=2)
    try:
        with c.session() as s:
            start(s)
            wait_until(lambda: all(p.state == "running" for p in status(s).processes), DEADLINE)
            lose(c, 0)  # the coordinator: n1, the next member, takes over on its own control endpoint
            done = wait_until(lambda: (x := status(s)).state == "succeeded" and x, DEADLINE)
            assert [(p.host, p.id, p.state) for p in done.processes if p.state != "lost"] == [
                ("n1", 0, "exited"), ("n2", 1, "exited")]  # two ranks left: rank 0 on n1 now
            assert done.elastic["lines"] == [
                "attempt 1 runs on 2 host(s) (min 2): n1, n2; coordinator n1",
                "n0: lost at attempt 0",
                "host n0 lost at attempt 0 (the coordinator; n1 took over); left out from attempt 1"]
            assert state(c, 1)["is_coordinator"] is True
            lines = collect(s)
            assert "[n2 trainer.1#1] rank 1 of 2 master 127.0.0.2 attempt 1" in lines
            stop(s)
        assert job_pids(c.name) == []
    finally:
        for pid in job_pids(c.name):
            os.kill(pid, signal.SIGKILL)
