"""The supervisor's wiring (clusterctl/host/supervisor.py) in this process: rules <-> links <-> state.json, with
stand-in links that record what the supervisor sends, a clock the test moves, and jobs whose processes are
quick python3 -c one-liners (or none). The real links are tested in test_agent_links.py, real supervisor
processes in test_agent.py and test_agent_restart.py."""

from __future__ import annotations

import json
import os
import socket
import sys
import time

import pytest

from clusterctl.host import protocol
from clusterctl.host.jobdir import STATE_FILE, STOP_REQUEST, describe
from clusterctl.host.jobfile import validate_job
from clusterctl.host.rules import ATTEMPTS_KEPT
from clusterctl.host.states import HostState, JobState, ProcState
from clusterctl.host.status import AttemptRecord
from clusterctl.host.supervisor import Supervisor

S = JobState
TOKEN = "5ec7" * 16


class Clock:
    def __init__(self):
        self.t = 500.0

    def __call__(self):
        return self.t


class FakeCoordLink:
    """Stands in for CoordinatorLink: records what the supervisor sends."""

    endpoint = "127.0.0.1:1"

    def __init__(self):
        self.sent, self.peers = [], set()

    def send(self, host, msg):
        self.sent.append((host, msg))
        return True

    def broadcast(self, msg):
        for host in sorted(self.peers):
            self.send(host, msg)

    def connected(self):
        return set(self.peers)

    def tick(self, now):
        pass

    def stats(self):
        return {"rejected_connections": 0}

    def close(self):
        pass


class FakePeerLink:
    """Stands in for PeerLink."""

    endpoint = "127.0.0.1:1"

    def __init__(self):
        self.sent, self.connected, self.ever_connected = [], True, True
        self.lost_since, self.keep_trying = None, None

    def send(self, msg):
        if self.connected:
            self.sent.append(msg)
        return self.connected

    def why(self):
        return "connection closed by coordinator"

    def tick(self, now, keep_trying=True):
        self.keep_trying = keep_trying

    def close(self):
        pass


def quick(code):
    return [sys.executable, "-c", code]


def supervisor(tmp_path, processes=(), coordinator=None, clock=None, **extra):
    """A Supervisor over a validated job file in tmp_path, its link replaced by a fake one."""
    procs = [{"role": role, "id": i, "argv": argv, "cwd": str(tmp_path), "log": str(tmp_path / ("%s.%d.log" % (role, i)))}
             for role, i, argv in processes]
    raw = {"job": "job-sup", "host": "hA", "processes": procs, "grace": 1, "token": TOKEN}
    if coordinator is not None:
        raw["coordinator"] = dict({"address": "127.0.0.1", "port": 1, "token": TOKEN, "trainers_total": 2},
                                  **coordinator)
    raw.update(extra)
    job = validate_job(raw, "job.json")
    sup = Supervisor(job, str(tmp_path), clock=clock or Clock())
    sup.tick = 0.01
    if sup.link is not None:
        sup.link = FakeCoordLink() if sup.members is not None else FakePeerLink()
    sup.my_ticks, sup.started_at = None, 1.0
    return sup


def hello(attempt=0, exits=(), stopping=None, idle=False, failed=None):
    return protocol.parse_message(json.loads(json.dumps(protocol.hello(
        "job-sup", "x", "ab" * 32, "p", list(exits), stopping, attempt, idle, failed))))


def run_until(sup, pred, rounds=500):
    for _ in range(rounds):
        finished = sup.step()
        if pred():
            return True
        if finished:
            break
    return pred()


def state_file(sup):
    with open(os.path.join(sup.jobdir, STATE_FILE)) as f:
        return json.load(f)


def test_the_coordinator_restarts_the_job_once_every_host_stopped(tmp_path):
    clock = Clock()
    sup = supervisor(tmp_path, coordinator={"is_coordinator": True, "hosts": 3}, clock=clock, restarts=1,
                     restart_backoff=2)
    link = sup.link
    sup._start_attempt()
    assert sup.core.state == S.STARTING and sup.awaiting_go  # the start barrier: nothing runs before every host joined
    # what the spawns need was made while waiting (ctypes' prctl), not after the `go`, and is made once
    assert sup.procs._preexec is not None and sup.procs._preexec[0] == os.getpid()
    ready = sup.procs._preexec
    for host in ("hB", "hC"):
        link.peers.add(host)
        sup.peer_joined(host, "127.0.0.1:9", hello())
        sup.step()
    assert link.sent == [("hB", protocol.go(0)), ("hC", protocol.go(0))]  # once the last one joined
    assert sup.procs._preexec is ready
    link.sent.clear()
    assert sup.members.waiting() == ["hB", "hC"] and sup.core.state == S.RUNNING
    sup.peer_message("hC", {"type": protocol.Msg.EXIT, "role": "trainer", "id": 1, "code": 7, "error": None,
                            "attempt": 0})
    stop = protocol.stop(S.FAILED, "trainer.1 on hC exited with code 7",
                         {"role": "trainer", "id": 1, "host": "hC", "exit_code": 7}, 0, True)
    assert link.sent == [("hB", stop), ("hC", stop)]
    assert run_until(sup, lambda: sup.core.stop_done) and sup.core.state == S.RESTARTING
    assert sup.restart_at is None  # hB and hC have not said done
    sup.peer_message("hB", {"type": protocol.Msg.DONE, "attempt": 0})
    sup.peer_message("hC", {"type": protocol.Msg.DONE, "attempt": 5})  # not this attempt's: ignored
    sup.step()
    assert sup.restart_at is None and sup.members.waiting() == ["hC"]
    sup.peer_message("hC", {"type": protocol.Msg.DONE, "attempt": 0})
    sup.step()
    assert sup.restart_at == clock.t + 2.0  # restart 1: the back-off
    st = state_file(sup)
    assert st["state"] == "restarting" and st["restart_pending"] is True and st["hosts"]["hC"]["state"] == "done"
    clock.t += 2.0
    sup.step()
    assert sup.core.attempt == 1 and sup.core.state == S.RUNNING
    assert link.sent[-2:] == [("hB", protocol.restart(1)), ("hC", protocol.restart(1))]
    assert {h: r["state"] for h, r in sup.members.to_json().items()} == {"hB": HostState.CONNECTED,
                                                                          "hC": HostState.CONNECTED}
    # attempt 1: a lost host, no restarts left: final
    sup.peer_left("hB", "no heartbeat for 5.1s")
    assert sup.core.verdict.reason == "lost host hB: no heartbeat for 5.1s" and sup.core.final
    assert run_until(sup, lambda: sup.core.state == S.FAILED)
    sup.peer_left("hC", "connection closed")  # after the verdict: disconnected, not lost
    assert sup.members.to_json()["hC"]["state"] == HostState.DISCONNECTED
    st = describe(state_file(sup))
    assert [(a["attempt"], a["outcome"]) for a in st["attempts"]] == [(0, "failed"), (1, "failed")]
    assert st["attempts_total"] == 2


def test_the_coordinator_brings_a_rejoining_or_late_peer_to_the_jobs_attempt_and_verdict(tmp_path):
    clock = Clock()
    sup = supervisor(tmp_path, coordinator={"is_coordinator": True, "hosts": 3, "connect_timeout": 30}, clock=clock,
                     restarts=2)
    link = sup.link
    sup._start_attempt()
    sup.core.attempt = 1  # as if a restart happened
    link.peers.add("hB")
    sup.peer_joined("hB", "127.0.0.1:9", hello(attempt=0, idle=True))
    assert link.sent == [("hB", protocol.restart(1))]  # it stopped attempt 0 on its own: it joins attempt 1
    sup.peer_joined("hB", "127.0.0.1:9", hello(attempt=1, exits=[
        {"role": "trainer", "id": 0, "code": 0, "error": None, "host": "ignored", "attempt": 1}]))
    assert sup.core.exits[("trainer", 0)].host == "hB"
    sup.peer_joined("hB", "127.0.0.1:9", hello(attempt=1, failed="lost connection to coordinator"))
    assert sup.core.verdict.reason == "host hB: lost connection to coordinator" and sup.core.verdict.restart
    assert run_until(sup, lambda: sup.core.stop_done)
    # a stop request in a hello is final; a late peer learns it at once
    sup.peer_joined("hB", "127.0.0.1:9", hello(attempt=1, stopping="stop requested on hB"))
    assert sup.core.final and sup.core.state == S.STOPPED and sup.core.verdict.reason == "stop requested on hB"
    link.sent.clear()
    link.peers.add("hC")
    sup.peer_joined("hC", "127.0.0.1:7", hello())
    assert link.sent == [("hC", protocol.stop(S.STOPPED, "stop requested on hB", None, 1, False))]
    # hC is done once it stopped; until every peer that never joined could have joined, the coordinator waits
    sup.members.mark_done("hB", 0.0)
    sup.members.mark_done("hC", 0.0)
    sup.members.expected = 3
    assert sup.step() is False and state_file(sup)["lingering"] is True
    clock.t = sup.attempt_t0 + 30.1
    assert sup.step() is True


def test_a_peer_obeys_stops_and_restarts_and_reports_what_it_did(tmp_path):
    clock = Clock()
    sup = supervisor(tmp_path, [("trainer", 0, quick("import time; time.sleep(60)"))],
                     coordinator={"is_coordinator": False, "hosts": 2}, clock=clock, restarts=1)
    link = sup.link
    sup._start_attempt()
    assert sup.core.state == S.STARTING and sup.procs.rows[0].pid is None  # waits for every host: the barrier
    sup.coordinator_message(protocol.parse_message(protocol.go(1)))  # not this attempt's: ignored
    assert sup.procs.rows[0].pid is None
    sup.coordinator_message(protocol.parse_message(protocol.go(0)))
    pid = sup.procs.rows[0].pid
    assert sup.core.state == S.RUNNING and pid
    sup.coordinator_message(protocol.parse_message(protocol.go(0)))  # again (a reconnection): nothing new
    assert sup.procs.rows[0].pid == pid
    sup.coordinator_message(protocol.parse_message(protocol.restart(1)))  # attempt 1 while attempt 0 runs
    assert sup.core.verdict.reason == "the coordinator started attempt 1" and sup.pending_restart == (1, None)
    assert run_until(sup, lambda: sup.core.attempt == 1)
    assert link.sent[0] == protocol.done("hA", 0)  # then it started attempt 1 as asked
    row = sup.procs.rows[0]
    assert row.pid != pid and row.state == ProcState.RUNNING
    assert [e["path"] for e in row.logs] == [str(tmp_path / "trainer.0.log"), str(tmp_path / "trainer.0.attempt1.log")]
    with open("/proc/%d/environ" % row.pid, "rb") as f:
        env = f.read().split(b"\0")
    assert b"CLUSTERCTL_RESTART_COUNT=1" in env and b"TORCHELASTIC_RESTART_COUNT=1" in env
    stop = protocol.stop(S.SUCCEEDED, "all 2 trainers exited 0", None, 1, False)
    sup.coordinator_message(protocol.parse_message(json.loads(json.dumps(stop))))
    assert run_until(sup, lambda: sup.core.state == S.SUCCEEDED)
    assert sup.step() is True  # a peer is done at once
    assert sup.procs.rows[0].state == ProcState.STOPPED and link.sent[-1] == protocol.done("hA", 1)
    st = state_file(sup)
    assert st["stop"]["requested"] is False and [k["signal"] for k in st["stop"]["killed"]] == ["SIGTERM"]


def test_a_peer_that_never_reaches_its_coordinator_fails_after_connect_timeout(tmp_path):
    clock = Clock()
    sup = supervisor(tmp_path, coordinator={"is_coordinator": False, "hosts": 2, "connect_timeout": 30}, clock=clock)
    link = sup.link
    link.connected = link.ever_connected = False
    link.why = lambda: "coordinator rejected this host: bad token"
    sup._start_attempt()
    clock.t += 29
    sup.step()
    assert sup.core.verdict is None and link.keep_trying is True
    clock.t += 2
    assert run_until(sup, lambda: sup.core.state == S.FAILED)
    assert sup.core.verdict.reason == ("could not connect to coordinator 127.0.0.1:1 within 30s: "
                                       "coordinator rejected this host: bad token")
    sup.step()
    assert link.keep_trying is False  # final: no more tries
    assert sup.hello_fields() == {"exits": [], "stopping": None, "attempt": 0, "idle": True,
                                  "failed": sup.core.verdict.reason, "index": None, "ps": None}


def test_a_stop_request_takes_the_grace_it_was_given_and_tells_the_coordinator(tmp_path):
    sup = supervisor(tmp_path, [("trainer", 0, quick("import signal, time; signal.signal(signal.SIGTERM, "
                                                     "signal.SIG_IGN); print('up', flush=True); time.sleep(60)"))],
                     coordinator={"is_coordinator": False, "hosts": 2})
    sup.clock = time.monotonic  # the stop's grace is real time here
    sup._start_attempt()
    sup.coordinator_message(protocol.parse_message(protocol.go(0)))
    log = tmp_path / "trainer.0.log"
    assert run_until(sup, lambda: log.exists() and log.read_bytes() == b"up\n", rounds=2000)
    (tmp_path / STOP_REQUEST).write_text(json.dumps({"grace": 0.2}))
    sup.term_requested = True
    assert run_until(sup, lambda: sup.core.state == S.STOPPED, rounds=2000)
    assert sup.link.sent[0] == protocol.stopping("stop requested on hA")
    assert sup.core.verdict.grace == 0.2
    st = state_file(sup)
    (killed,) = st["stop"]["killed"]
    assert (killed["signal"], killed["via"], killed["role"]) == ("SIGKILL", "killpg", "trainer")  # it ignored SIGTERM
    assert st["stop"]["requested"] is True and st["stop"]["reported"] is False
    assert sup.hello_fields()["stopping"] == "stop requested on hA"


def test_on_failure_continue_and_a_spawn_failure_in_one_host(tmp_path):
    sup = supervisor(tmp_path, [("trainer", 0, quick("raise SystemExit(3)")), ("trainer", 1, quick("pass"))],
                     on_failure="continue", restarts=3)
    sup._start_attempt()
    assert run_until(sup, lambda: sup.core.verdict is not None)
    assert sup.core.verdict.reason == "all trainers ended; 1 failure(s), first: trainer.0 on hA code 3"
    assert [f["exit_code"] for f in sup.core.failures] == [3]
    (tmp_path / "b").mkdir()
    bad = supervisor(tmp_path / "b", [("pserver", 0, quick("import time; time.sleep(60)")),
                                      ("trainer", 0, ["/nonexistent/python3"]), ("trainer", 1, quick("pass"))],
                     restarts=3)
    bad._start_attempt()
    v = bad.core.verdict
    assert v.reason.startswith("trainer.0 on hA failed to start: cannot start trainer.0 (/nonexistent/python3 in ")
    assert v.restart is False  # never restarted
    assert [r.state for r in bad.procs.rows] == [ProcState.RUNNING, ProcState.FAILED, ProcState.STOPPED]
    assert run_until(bad, lambda: bad.core.state == S.FAILED)


def test_state_json_keeps_the_last_attempts_and_counts_them_all(tmp_path):
    sup = supervisor(tmp_path, restarts=100)
    for k in range(ATTEMPTS_KEPT + 3):
        sup.core.history.add(AttemptRecord(k, "failed", "r%d" % k, None, 1.0, 2.0))
    sup.core.attempt = ATTEMPTS_KEPT + 3
    sup.write_state()
    st = state_file(sup)
    assert len(st["attempts"]) == ATTEMPTS_KEPT and st["attempts_total"] == ATTEMPTS_KEPT + 3
    assert os.path.getsize(tmp_path / STATE_FILE) < 20000
    out = describe(st)
    assert out["attempts"][0]["attempt"] == 3 and out["attempts"][-1]["attempt"] == ATTEMPTS_KEPT + 3
    assert out["attempts_total"] == ATTEMPTS_KEPT + 4  # the current one too


def test_a_coordinator_that_cannot_listen_fails_at_once(tmp_path):
    held = socket.create_server(("127.0.0.1", 0))
    try:
        port = held.getsockname()[1]
        job = validate_job({"job": "job-sup", "host": "hA", "token": TOKEN, "processes": [
            {"role": "trainer", "id": 0, "argv": quick("pass"), "cwd": str(tmp_path), "log": str(tmp_path / "t.log")}],
            "coordinator": {"address": "127.0.0.1", "port": port, "token": TOKEN, "is_coordinator": True,
                            "hosts": 1, "trainers_total": 1}}, "job.json")
        rfd, wfd = os.pipe()
        assert Supervisor(job, str(tmp_path), report_fd=wfd).run() == 1
    finally:
        held.close()
    report = json.loads(os.read(rfd, 65536))
    os.close(rfd)
    assert report["ok"] is False and report["error"] == "cannot listen on 127.0.0.1:%d: Address already in use" % port
    st = json.loads((tmp_path / STATE_FILE).read_text())
    assert (st["state"], st["reason"]) == ("failed", report["error"])
    assert st["processes"][0]["state"] == "stopped" and st["processes"][0]["error"] == "not started: " + report["error"]


@pytest.fixture(autouse=True)
def _no_leftovers():
    yield
    from helpers import job_pids

    for pid in job_pids("job-sup"):
        os.kill(pid, 9)


def _real_supervisor(tmp_path, seconds):
    job = validate_job({"job": "job-sup", "host": "hA", "token": TOKEN, "grace": 5, "processes": [
        {"role": "trainer", "id": 0, "argv": ["sleep", str(seconds)], "cwd": str(tmp_path),
         "log": str(tmp_path / "t.log")}]}, "job.json")
    sup = Supervisor(job, str(tmp_path))
    sup.tick = 60.0  # the loop's wait between looks at processes and timers: never reached below
    return sup


def test_a_process_exit_wakes_the_loop_at_once_not_at_its_next_tick(tmp_path):
    sup = _real_supervisor(tmp_path, 0.3)
    t0 = time.monotonic()
    assert sup.run() == 0
    assert time.monotonic() - t0 < 20, "the exit was seen only at the loop's next tick"
    assert sup.core.state == S.SUCCEEDED
    assert sup.procs.rows[0].exit_code == 0


def test_sigterm_wakes_the_loop_at_once_and_the_handlers_and_wakeup_fd_are_put_back(tmp_path):
    import signal
    import threading

    sup = _real_supervisor(tmp_path, 120)
    before = signal.getsignal(signal.SIGCHLD), signal.getsignal(signal.SIGTERM)
    def term_once_started():  # the handlers are in place once the process runs
        deadline = time.monotonic() + 30
        while sup.procs.rows[0].pid is None and time.monotonic() < deadline:
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=term_once_started, daemon=True).start()
    t0 = time.monotonic()
    sup.run()
    assert time.monotonic() - t0 < 20, "SIGTERM was seen only at the loop's next tick"
    assert sup.core.state == S.STOPPED and sup.procs.rows[0].state == ProcState.STOPPED
    assert (signal.getsignal(signal.SIGCHLD), signal.getsignal(signal.SIGTERM)) == before
    assert signal.set_wakeup_fd(-1) == -1  # none left set


def test_a_preflight_problem_fails_the_first_attempt_where_it_would_spawn_and_is_never_restarted(tmp_path):
    """Slurm's node ran its supervisor with no preflight (the ssh path runs it in `agent up`): a port in use surfaced
    when the process bound it, after a start, and was restarted as any failure. Now the node's preflight problems
    fail the first attempt at its spawn (every host has joined: the coordinator hears of it at once)."""
    sup = supervisor(tmp_path, [("pserver", 0, quick("import time; time.sleep(60)")), ("trainer", 0, quick("pass"))],
                     restarts=3)
    sup.start_problems = [{"kind": "port_in_use", "process": "trainer.0", "endpoint": "127.0.0.1:7530",
                           "message": "trainer.0: cannot bind 127.0.0.1:7530: Address already in use"}]
    sup._start_attempt()
    v = sup.core.verdict
    assert v.reason == ("trainer.0 on hA failed to start: preflight: trainer.0: cannot bind 127.0.0.1:7530: Address "
                        "already in use")  # the process the first problem names
    assert v.restart is False
    assert [(r.state, r.pid) for r in sup.procs.rows] == [(ProcState.FAILED, None), (ProcState.FAILED, None)]
    assert run_until(sup, lambda: sup.core.state == S.FAILED)
    st = state_file(sup)
    assert st["outcome"] == "failed" and st["failure"]["error"] == v.reason.split(": ", 1)[1]
    assert {p["error"] for p in st["processes"]} == {v.reason.split(": ", 1)[1]}
