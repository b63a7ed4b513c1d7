"""The job lifecycle (clusterctl.ops.job: start · status · logs · stop) over fake hosts: the real agent and real
processes on this machine, each host a directory (tests/unit/fakehosts.py)."""

import os
import re
import signal
import socket
import subprocess
import sys

import pytest

from clusterctl.errors import JobError, RemoteError
from clusterctl.ops.dispatch import dispatch
from clusterctl.ops.job import job_files, logs, start, status, stop
from clusterctl.transport.local import LocalTransport
from clusterctl.commands.lifecycle import render_status

sys.path.insert(0, os.path.dirname(__file__))
from fakehosts import FakeCluster, FaultyTransport, job_pids, refused, wait_until  # noqa: E402

# Each trainer says hello, leaves a file in its working directory, then sleeps SLEEP seconds and exits with
# the code FAIL_RANK_<rank> names (0 by default); on a restart (CLUSTERCTL_RESTART_COUNT > 0) it exits 0.
TRAIN = """\
import os, sys, time
rank = os.environ.get("RANK", "-")
restart = int(os.environ.get("CLUSTERCTL_RESTART_COUNT", "0"))
print("hello from rank", rank, "attempt", restart, "job env", os.environ.get("GREETING"), flush=True)
with open("ran-%s-%d" % (rank, restart), "w") as fh:
    fh.write(os.environ.get("PADDLE_TRAINER_ENDPOINTS", ""))
time.sleep(float(os.environ.get("SLEEP", "0")))
sys.exit(0 if restart else int(os.environ.get("FAIL_RANK_" + rank, "0")))
"""


def cluster(tmp_path, hosts=2, **job):
    """A fake cluster running TRAIN, dispatched."""
    c = FakeCluster(tmp_path, hosts=hosts, files={"train.py": TRAIN}, job=job)
    with c.session() as s:
        dispatch(s)
    return c


def collect(session, **kw):
    """Every log line `logs` relays, as (host label, line): hosts in order, each host's lines in order."""
    lines = []
    logs(session, on_line=lambda h, stream, line: lines.append((h.label, line)), **kw)
    return sorted(lines, key=lambda item: item[0])


def test_a_job_runs_to_success_and_its_logs_and_files_are_on_each_host(tmp_path):
    c = cluster(tmp_path, env={"GREETING": "hi", "SLEEP": "0.3"})
    progress = []
    with c.session() as s:
        st = start(s, on_progress=progress.append)
        assert progress == ["launching"]  # one round trip: `agent up` (checks, job file, preflight, launch)
        assert st.state in ("running", "succeeded") and len(st.processes) == 2
        done = wait_until(lambda: (x := status(s)).state == "succeeded" and x)
        assert [(p.host, p.role, p.id, p.state, p.exit_code) for p in done.processes] == [
            ("n0", "trainer", 0, "exited", 0), ("n1", "trainer", 1, "exited", 0)]
        assert done.reason is None and done.unreachable == {}
        assert done.to_json()["state"] == "succeeded"
        assert collect(s) == [("n0", "[n0 trainer.0] hello from rank 0 attempt 0 job env hi"),
                              ("n1", "[n1 trainer.1] hello from rank 1 attempt 0 job env hi")]
        assert collect(s, host="n1", lines=1) == [("n1", "[n1 trainer.1] hello from rank 1 attempt 0 job env hi")]
        assert collect(s, role="trainer", id=0) == [("n0", "[n0 trainer.0] hello from rank 0 attempt 0 job env hi")]
        with pytest.raises(JobError, match=r"no process of job fk-\w+ matches role=pserver"):
            collect(s, role="pserver")
        again = stop(s)
    assert [r["was_running"] for r in again.values()] == [False, False]
    # each trainer ran in its own host's workspace, with the planned endpoints of both
    eps = f"127.0.0.1:{c.spec().job.ports.trainer},127.0.0.2:{c.spec().job.ports.trainer}"
    assert (c.workspace(0) / "ran-0-0").read_text() == eps
    assert (c.workspace(1) / "ran-1-0").read_text() == eps
    assert not (c.workspace(0) / "ran-1-0").exists()


class Counting(LocalTransport):
    """The fake transport, counting the commands each host is sent."""

    def __init__(self, inner: LocalTransport):
        super().__init__(inner.root, env=inner.env)
        self.sent: dict[str, int] = {}

    def popen(self, host, command):
        self.sent[host.address] = self.sent.get(host.address, 0) + 1
        return super().popen(host, command)


def test_start_is_one_round_trip_per_host_and_says_why_a_host_refused(tmp_path):
    c = cluster(tmp_path, env={"SLEEP": "30"})
    counting = Counting(c.transport)
    with c.session(transport=counting) as s:
        stop(s)  # the host package is installed by now (as after any dispatch or earlier command)
        counting.sent.clear()
        st = start(s)
        assert counting.sent == {"n0": 1, "n1": 1} and st.state == "running", counting.sent
        assert [(p.host, p.state) for p in st.processes] == [("n0", "running"), ("n1", "running")]
        stop(s)
        # a file of n1's workspace changed since the dispatch: n1 says so; n0, launched, had started nothing (its
        # supervisor waits for every host: the start barrier) and is stopped again
        (c.workspace(1) / "train.py").write_text("changed\n")
        with pytest.raises(JobError) as info:
            start(s)
        assert str(info.value).splitlines() == [
            "workspace drift; run clusterctl dispatch first:",
            "n1: workspace train.py modified since the last dispatch"], str(info.value)
        assert job_pids(c.name) == []


def test_stop_ends_a_running_job_everywhere_with_no_orphans(tmp_path):
    c = cluster(tmp_path, env={"SLEEP": "60"})
    with c.session() as s:
        st = start(s)
        assert st.state == "running" and all(p.state == "running" for p in st.processes)
        assert len(job_pids(c.name)) >= 2  # the trainers (and their supervisors) carry the job's tag
        with pytest.raises(JobError, match=f"job {c.name} is already running; stop it first"):
            start(s)
        res = stop(s, grace=1)
        assert [r["was_running"] for r in res.values()] == [True, True]
        assert job_pids(c.name) == []
        after = status(s)
    assert after.state == "stopped"
    assert {p.state for p in after.processes} == {"stopped"}


def test_a_failing_trainer_fails_the_job_and_stops_the_others(tmp_path):
    c = cluster(tmp_path, env={"FAIL_RANK_1": "3", "SLEEP": "0.2"})
    with c.session() as s:
        start(s)
        st = wait_until(lambda: (x := status(s)).state == "failed" and x)
        rows = {p.id: p for p in st.processes}
        assert (rows[1].state, rows[1].exit_code) == ("failed", 3)
        assert "trainer.1" in st.reason and "exit" in st.reason
        stop(s)
    assert job_pids(c.name) == []


def test_a_failed_attempt_is_restarted_and_succeeds(tmp_path, capsys):
    c = cluster(tmp_path, hosts=1, env={"FAIL_RANK_0": "5"}, restarts=2, restart_backoff=1)  # the least there is (clusterctl/host/policy.py)
    with c.session() as s:
        start(s)
        st = wait_until(lambda: (x := status(s)).state == "succeeded" and x)
        assert [line for _, line in collect(s)] == ["[n0 trainer.0] hello from rank 0 attempt 0 job env None",
                                                    "[n0 trainer.0#1] hello from rank 0 attempt 1 job env None"]
    assert (st.attempt, st.restarts) == (1, 2)
    assert [(a["attempt"], a["outcome"]) for a in st.attempts] == [(0, "failed"), (1, "succeeded")]
    assert (c.workspace(0) / "ran-0-0").exists() and (c.workspace(0) / "ran-0-1").exists()
    render_status(st)  # as `clusterctl status` shows it
    shown = capsys.readouterr().out
    assert "attempt 1 (restarts allowed: 2)" in shown
    assert "  attempt 0: failed: trainer.0 on n0 exited with code 5" in shown


def test_pservers_start_before_the_trainers_and_stop_when_they_are_done(tmp_path):
    serve = """\
        import os, socket, sys, time
        if os.environ["TRAINING_ROLE"] == "PSERVER":
            host, port = os.environ["PADDLE_CURRENT_ENDPOINT"].rsplit(":", 1)
            srv = socket.create_server((host, int(port)))
            print("serving", os.environ["PADDLE_CURRENT_ENDPOINT"], flush=True)
            time.sleep(60)
        else:
            eps = os.environ["PADDLE_PSERVERS_IP_PORT_LIST"].split(",")
            for ep in eps:
                h, p = ep.rsplit(":", 1)
                socket.create_connection((h, int(p)), timeout=5).close()  # the pservers are up already
            print("reached", len(eps), "pserver(s)", flush=True)
        """
    c = FakeCluster(tmp_path, files={"train.py": serve}, job={"mode": "pserver", "pservers": 2})
    with c.session() as s:
        files = job_files(s.plan, {h: f"/home/{h.address}" for h in s.plan.hosts}, "tok")
        assert [[p["role"] for p in f["processes"]] for f in files.values()] == [["pserver", "trainer"]] * 2
        assert files[s.plan.hosts[0]]["coordinator"]["is_coordinator"] is True
        assert files[s.plan.hosts[1]]["start_trainers_after"]["endpoints"] == [p.endpoint for p in s.plan.pservers]
        dispatch(s)
        start(s)
        st = wait_until(lambda: (x := status(s)).state == "succeeded" and x)
        assert {(p.role, p.state) for p in st.processes} == {("pserver", "stopped"), ("trainer", "exited")}
        assert [p.role for p in st.processes] == ["pserver", "pserver", "trainer", "trainer"]
        assert ("n0", "[n0 trainer.0] reached 2 pserver(s)") in collect(s)
    assert job_pids(c.name) == []


def test_mpi_launcher_runs_one_mpiexec_on_the_first_host_with_its_hostfile(tmp_path):
    c = FakeCluster(tmp_path, files={"train.py": TRAIN},
                    job={"launcher": "mpi", "mpiexec": "mpiexec-fake", "env": {"GREETING": "mpi"}})
    # a stand-in for mpiexec on the fake hosts' PATH: says what it was given and what the hostfile says
    (c.bin / "mpiexec-fake").write_text('#!/bin/sh\necho "mpiexec $*"; cat .clusterctl/jobs/$CLUSTERCTL_JOB/hostfile\n'
                                        'echo "GREETING=$GREETING"\n')
    (c.bin / "mpiexec-fake").chmod(0o755)
    with c.session() as s:
        dispatch(s)
        start(s)
        st = wait_until(lambda: (x := status(s)).state == "succeeded" and x)
        assert [(p.host, p.role, p.id) for p in st.processes] == [("n0", "trainer", 0)]
        lines = [line for _, line in collect(s)]
        assert not (c.home(1) / ".clusterctl" / "jobs" / c.name).exists()  # nothing runs on n1 itself
    assert lines[0].startswith(f"[n0 trainer.0] mpiexec -f .clusterctl/jobs/{c.name}/hostfile -n 2 -wdir {c.remote_dir} ")
    assert lines[1:] == ["[n0 trainer.0] 127.0.0.1:1", "[n0 trainer.0] 127.0.0.2:1", "[n0 trainer.0] GREETING=mpi"]


def test_start_refuses_an_undispatched_workspace_and_a_busy_port(tmp_path):
    c = FakeCluster(tmp_path, files={"train.py": TRAIN})
    with c.session() as s:
        with pytest.raises(JobError, match=r"workspace drift; run clusterctl dispatch first:\nn0: no workspace "
                                           r"dispatched yet\nn1: no workspace dispatched yet$"):
            start(s)
        dispatch(s)
        port = s.plan.trainers[1].port
        with socket.create_server(("127.0.0.2", port)):
            with pytest.raises(JobError) as info:
                start(s)
        # n0 passed its checks and launched (one round trip each): its supervisor waited for n1's, which never
        # came, so it started nothing, and was stopped again
        assert str(info.value) == f"preflight failed, nothing started:\nn1: trainer.1: cannot bind 127.0.0.2:{port}: " \
                                  "Address already in use"
        st = status(s)
        assert st.state == "stopped" and job_pids(c.name) == []
        assert [(p.host, p.state, p.pid, p.error) for p in st.processes] == [
            ("n0", "stopped", None, "not started: the job ended first")]
        assert not (c.home(0) / s.plan.log_path(s.plan.trainers[0])).exists()  # no trainer ever wrote its log


def test_a_failed_launch_stops_whatever_started(tmp_path):
    c = cluster(tmp_path, hosts=1)
    # a process of this job left over on the host (say, from a killed supervisor): launch refuses to start
    # beside it, and start's cleanup (stop) sweeps it away by its CLUSTERCTL_JOB tag
    stray = subprocess.Popen(["sleep", "30"], env={**os.environ, "CLUSTERCTL_JOB": c.name}, start_new_session=True)
    try:
        with c.session() as s, pytest.raises(JobError) as info:
            start(s)
        assert str(info.value).startswith("start failed, nothing started:\nn0: job ")
        assert "still has 1 process(es) on this host" in str(info.value)
        assert stray.wait(timeout=10) == -signal.SIGTERM
    finally:
        if stray.poll() is None:
            stray.kill()
            stray.wait()


def test_an_unreachable_host_is_named_by_status_logs_start_and_stop(tmp_path):
    c = cluster(tmp_path, env={"SLEEP": "0"})
    with c.session() as s:
        start(s)
        wait_until(lambda: status(s).state == "succeeded")
    # n1 is lost just for the logs command (one round trip: no install step before it): n0's lines still come
    # through; ssh's own words about n1 are said once, in the error, not relayed as a line of n1's
    lines = []
    with c.session(transport=FaultyTransport(c.transport, down={"n1"}, only=" logs ")) as s:
        with pytest.raises(JobError) as info:
            logs(s, on_line=lambda h, stream, line: lines.append((h.label, stream, line)))
    assert re.fullmatch("logs incomplete:\nn1: " + refused("n1"), str(info.value))
    assert lines == [("n0", "out", "[n0 trainer.0] hello from rank 0 attempt 0 job env None")]
    with c.session(transport=FaultyTransport(c.transport, down={"n1"})) as s:
        st = status(s)
        assert st.state == "lost"
        assert list(st.unreachable) == ["n1"] and re.fullmatch(refused("n1"), st.unreachable["n1"])
        assert st.reason == "unreachable: n1"
        assert [p.host for p in st.processes] == ["n0"]
        with pytest.raises(JobError, match="start failed, nothing started:\nn1: .*Connection refused"):
            start(s)
        st = status(s)  # n0's supervisor waited for n1's, which never came: its trainer never ran again
        assert [(p.host, p.state, p.pid, p.error) for p in st.processes] == [
            ("n0", "stopped", None, "not started: the job ended first")]
        with pytest.raises(RemoteError, match="n1.*Connection refused"):
            stop(s)
        # n1 down before anything reached it: n0's logs still come, then the error names n1
        seen = []
        with pytest.raises(JobError, match="logs incomplete:\nn1: .*Connection refused"):
            logs(s, on_line=lambda h, stream, line: seen.append((h.label, line)))
        assert seen == [("n0", "[n0 trainer.0] hello from rank 0 attempt 0 job env None")]
        assert collect(s, host="n0") == [("n0", "[n0 trainer.0] hello from rank 0 attempt 0 job env None")]


def test_a_host_whose_commands_hang_is_reported_timed_out(tmp_path):
    c = FakeCluster(tmp_path, hosts=1, files={"train.py": TRAIN})
    faulty = FaultyTransport(c.transport, hung={"n0"})
    with c.session(transport=faulty, command_timeout=1) as s:
        st = status(s)
    assert st.state == "lost"
    assert list(st.unreachable) == ["n0"]
    assert st.unreachable["n0"].startswith("timed out after 1s running ")


def test_logs_of_a_job_that_never_ran(tmp_path):
    c = cluster(tmp_path)
    with c.session() as s, pytest.raises(JobError, match=f"job {c.name} has no logs on any host"):
        collect(s)
