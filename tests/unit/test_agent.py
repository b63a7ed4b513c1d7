"""Tests for clusterctl/host (the agent) with real processes on 127.0.0.1.

Several "hosts" are simulated on one machine: each has its own job dir and host
label, and they share one job id and one coordinator (an ephemeral port).  The agent
is always run as a separate program (`python agent.py ...`), as the controller does.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid

import pytest

from clusterctl.host import agent as agent_mod
from helpers import free_port, job_pids as tagged  # noqa: F401  (test_agent_attacks, test_agent_restart import them from here)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
AGENT = os.path.join(ROOT, "clusterctl", "host", "agent.py")
WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "agent_helpers", "worker.py")
PY = sys.executable
TOKEN = "5ec7e7" * 8

# fast protocol timings so fault tests finish in seconds
FAST = {"heartbeat": 0.3, "peer_timeout": 2.0, "reconnect_timeout": 1.0, "connect_timeout": 10.0}


# ---------------------------------------------------------------------------
# helpers


def agent(*args, timeout=30):
    """Run the agent; return (exit code, parsed JSON stdout)."""
    p = subprocess.run([PY, AGENT] + [str(a) for a in args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                       timeout=timeout)
    out = p.stdout.decode()
    assert "Traceback" not in p.stderr.decode(), p.stderr.decode()
    try:
        return p.returncode, json.loads(out)
    except ValueError:
        raise AssertionError("agent %s printed non-JSON: %r (stderr %r)" % (args, out, p.stderr))


def alive(pid):
    try:
        with open("/proc/%d/stat" % pid) as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def wait_for(pred, timeout, interval=0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(interval)
    return pred()


def status(jobdir):
    rc, st = agent("status", jobdir)
    assert rc == 0, st
    return st


def proc(st, role, pid_):
    return next(p for p in st["processes"] if p["role"] == role and p["id"] == pid_)


def terminal(jobdir):
    st = status(jobdir)
    return st if st["state"] in ("succeeded", "failed", "stopped", "lost") and not st["supervisor"]["alive"] else None


class Cluster:
    """Job dirs of simulated hosts, cleaned up after the test."""

    def __init__(self, tmp_path):
        self.tmp = tmp_path
        self.jobdirs = []
        self.job_ids = set()
        self.work = tmp_path / "work"
        self.work.mkdir()

    def new_job_id(self, name="job"):
        job_id = "%s-%s" % (name, uuid.uuid4().hex[:8])
        self.job_ids.add(job_id)
        return job_id

    def process(self, role, pid_, *worker_args, ports=()):
        return {"role": role, "id": pid_, "argv": [PY, WORKER] + [str(a) for a in worker_args],
                "env": {"CLUSTERCTL_ROLE": role.upper()}, "cwd": str(self.work),
                "log": str(self.work / "log" / ("%s.%d.log" % (role, pid_))), "ports": list(ports)}

    def host(self, label, job_id, processes, coordinator=None, **extra):
        jobdir = self.tmp / label / job_id
        jobdir.mkdir(parents=True)
        for p in processes:  # one log dir per simulated host
            if p["log"].startswith(str(self.work / "log")):
                p["log"] = str(self.tmp / label / "log" / os.path.basename(p["log"]))
        job = {"job": job_id, "host": label, "state_root": str(self.tmp / label), "on_failure": "stop",
               "grace": 2, "processes": processes}
        if coordinator is not None:
            job["coordinator"] = coordinator
        job.update(extra)
        (jobdir / "job.json").write_text(json.dumps(job))
        self.jobdirs.append(str(jobdir))
        return str(jobdir)

    def cleanup(self):
        for d in self.jobdirs:
            subprocess.run([PY, AGENT, "stop", d, "--grace", "0"], stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL, timeout=30)
        for job_id in self.job_ids:
            for pid in tagged(job_id):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass


@pytest.fixture
def cluster(tmp_path):
    c = Cluster(tmp_path)
    yield c
    c.cleanup()


def coordinator(port, is_coordinator, hosts, trainers_total, **kw):
    c = {"address": "127.0.0.1", "port": port, "token": TOKEN, "is_coordinator": is_coordinator,
         "hosts": hosts, "trainers_total": trainers_total}
    c.update(FAST)
    c.update(kw)
    return c


def launch(jobdir):
    rc, out = agent("launch", os.path.join(jobdir, "job.json"))
    assert rc == 0 and out["ok"], out
    return out


# ---------------------------------------------------------------------------
# launch / status / stop


@pytest.mark.timeout(30)
def test_launch_returns_fast_without_holding_pipes_and_status_reports_processes(cluster):
    job_id = cluster.new_job_id()
    port = free_port()
    jobdir = cluster.host("hA", job_id, [cluster.process("pserver", 0, "serve", "127.0.0.1", port,
                                                         ports=["127.0.0.1:%d" % port]),
                                         cluster.process("trainer", 0, "sleep")])
    t0 = time.monotonic()
    # like an SSH channel: communicate() only returns once every holder of the pipes closed them
    p = subprocess.Popen([PY, AGENT, "launch", os.path.join(jobdir, "job.json")], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE)
    out, err = p.communicate(timeout=15)
    elapsed = time.monotonic() - t0
    assert p.returncode == 0, (out, err)
    assert elapsed < 3.0, elapsed
    res = json.loads(out)
    assert res["ok"] is True and res["error"] is None and res["job"] == job_id and res["host"] == "hA"
    assert sorted(res["pids"]) == ["pserver.0", "trainer.0"]
    for pid in res["pids"].values():
        assert alive(pid)
        assert pid in tagged(job_id)
        assert os.getpgid(pid) == pid  # own process group (start_new_session)
    with open("/proc/%d/environ" % res["pids"]["trainer.0"], "rb") as f:
        env = dict(e.split(b"=", 1) for e in f.read().split(b"\0") if e)
    assert env[b"CLUSTERCTL_ROLE"] == b"TRAINER" and env[b"PATH"] == os.environ["PATH"].encode()

    st = status(jobdir)
    assert st["state"] == "running" and st["job"] == job_id and st["host"] == "hA"
    assert st["supervisor"] == {"pid": res["supervisor_pid"], "alive": True}
    assert [(q["role"], q["id"], q["pid"], q["state"], q["exit_code"]) for q in st["processes"]] == [
        ("pserver", 0, res["pids"]["pserver.0"], "running", None),
        ("trainer", 0, res["pids"]["trainer.0"], "running", None)]
    for q in st["processes"]:
        assert q["started_at"] <= time.time() and q["uptime_s"] >= 0 and q["ended_at"] is None

    # launching the same job dir again is refused while the supervisor lives
    rc, again = agent("launch", os.path.join(jobdir, "job.json"))
    assert rc == 1 and again["ok"] is False and "already has a supervisor" in again["error"]

    rc, stopped = agent("stop", jobdir, "--grace", "2")
    assert rc == 0 and stopped["ok"] is True and stopped["was_running"] is True and stopped["left"] == []
    assert {(k["role"], k["id"], k["signal"], k["via"]) for k in stopped["killed"]} == {
        ("pserver", 0, "SIGTERM", "killpg"), ("trainer", 0, "SIGTERM", "killpg")}
    assert stopped["state"] == "stopped"
    assert tagged(job_id) == []
    st = status(jobdir)
    assert st["state"] == "stopped" and st["supervisor"]["alive"] is False
    assert [(q["state"], q["exit_code"]) for q in st["processes"]] == [("stopped", -15), ("stopped", -15)]
    with socket.socket() as s:  # the pserver's port is free again
        s.bind(("127.0.0.1", port))

    rc, second = agent("stop", jobdir)
    assert rc == 0 and second["ok"] is True and second["was_running"] is False and second["killed"] == []

    rc, unknown = agent("stop", str(cluster.tmp / "hA" / "never-launched-1"))
    assert rc == 0 and unknown == {"ok": True, "was_running": False, "job": "never-launched-1",
                                   "jobdir": str(cluster.tmp / "hA" / "never-launched-1"), "state": None,
                                   "reason": None, "supervisor": None, "killed": [], "left": []}
    rc, unknown_status = agent("status", str(cluster.tmp / "nowhere"))
    assert rc == 1 and unknown_status["ok"] is False and unknown_status["state"] == "unknown"


@pytest.mark.timeout(30)
def test_escaped_setsid_child_is_swept_and_other_jobs_survive(cluster):
    job_id = cluster.new_job_id("mine")
    other_id = cluster.new_job_id("other")
    pidfile = cluster.tmp / "escaped.pid"
    mine = cluster.host("hA", job_id, [cluster.process("trainer", 0, "escape", pidfile),
                                       cluster.process("pserver", 0, "sleep")])
    other = cluster.host("hB", other_id, [cluster.process("trainer", 0, "sleep")])
    launch(mine)
    other_pids = launch(other)["pids"]
    untagged = subprocess.Popen([PY, WORKER, "sleep"], env={"PATH": os.environ["PATH"]})
    try:
        escaped = int(wait_for(lambda: pidfile.exists() and pidfile.read_text(), 10))
        trainer_pid = status(mine)["processes"][0]["pid"]
        assert os.getpgid(escaped) == escaped != trainer_pid  # it left the trainer's group
        assert escaped in tagged(job_id)

        t0 = time.monotonic()
        rc, out = agent("stop", mine, "--grace", "1")
        elapsed = time.monotonic() - t0
        assert rc == 0 and out["ok"] is True and out["was_running"] is True, out
        assert elapsed < 1 + 4, elapsed
        assert {"pid": escaped, "signal": "SIGKILL", "via": "kill"} in out["killed"]
        assert wait_for(lambda: tagged(job_id) == [], 2), tagged(job_id)
        # another job's processes (same script) and untagged processes are untouched
        for pid in other_pids.values():
            assert alive(pid)
        assert untagged.poll() is None
        assert status(other)["state"] == "running"

        rc, out = agent("stop", mine)
        assert rc == 0 and out["ok"] is True and out["was_running"] is False
    finally:
        untagged.kill()
        untagged.wait()


# ---------------------------------------------------------------------------
# cross-host rules


@pytest.mark.timeout(40)
def test_trainer_failure_stops_every_host(cluster):
    job_id = cluster.new_job_id()
    port, ps_port = free_port(), free_port()
    hA = cluster.host("hA", job_id, [cluster.process("pserver", 0, "serve", "127.0.0.1", ps_port,
                                                     ports=["127.0.0.1:%d" % ps_port])],
                      coordinator(port, True, 3, 2))
    hB = cluster.host("hB", job_id, [cluster.process("trainer", 0, "sleep")], coordinator(port, False, 3, 2))
    hC = cluster.host("hC", job_id, [cluster.process("trainer", 1, "exit", 1, 2.5)], coordinator(port, False, 3, 2))
    for d in (hA, hB, hC):
        launch(d)
    assert wait_for(lambda: sorted(status(hA)["hosts"]) == ["hB", "hC"], 5), status(hA)
    assert status(hA)["state"] == "running"

    def trainer_ended():
        q = proc(status(hC), "trainer", 1)
        return q["ended_at"] if q["state"] != "running" else None
    ended_at = wait_for(trainer_ended, 10)
    assert ended_at
    finals = [wait_for(lambda d=d: terminal(d), 10) for d in (hA, hB, hC)]
    assert all(finals), [status(d) for d in (hA, hB, hC)]
    assert max(f["updated_at"] for f in finals) - ended_at < 5.0
    failure = {"role": "trainer", "id": 1, "host": "hC", "exit_code": 1}
    for f in finals:
        assert f["state"] == "failed", f
        assert f["failure"] == failure
        assert f["reason"] == "trainer.1 on hC exited with code 1"
    stA, stB, stC = finals
    assert (proc(stC, "trainer", 1)["state"], proc(stC, "trainer", 1)["exit_code"]) == ("failed", 1)
    assert (proc(stB, "trainer", 0)["state"], proc(stB, "trainer", 0)["exit_code"]) == ("stopped", -15)
    assert (proc(stA, "pserver", 0)["state"], proc(stA, "pserver", 0)["exit_code"]) == ("stopped", -15)
    assert stA["hosts"]["hB"]["state"] == "done" and stA["hosts"]["hC"]["state"] == "done"
    assert tagged(job_id) == []


@pytest.mark.timeout(40)
def test_all_trainers_succeed_then_pservers_are_stopped(cluster):
    job_id = cluster.new_job_id()
    port, ps0, ps1 = free_port(), free_port(), free_port()
    hA = cluster.host("hA", job_id, [cluster.process("pserver", 0, "serve", "127.0.0.1", ps0),
                                     cluster.process("trainer", 0, "exit", 0, 1.0)],
                      coordinator(port, True, 2, 2))
    hB = cluster.host("hB", job_id, [cluster.process("pserver", 1, "serve", "127.0.0.1", ps1),
                                     cluster.process("trainer", 1, "exit", 0, 2.0)],
                      coordinator(port, False, 2, 2))
    launch(hA)
    launch(hB)
    rc, ports = agent("wait-ports", "127.0.0.1:%d,127.0.0.1:%d" % (ps0, ps1), "--timeout", "5")
    assert rc == 0 and ports["closed"] == [], ports
    finals = [wait_for(lambda d=d: terminal(d), 10) for d in (hA, hB)]
    assert all(finals), [status(d) for d in (hA, hB)]
    for f in finals:
        assert f["state"] == "succeeded" and f["failure"] is None and f["reason"] == "all 2 trainers exited 0", f
    stA, stB = finals
    for st, i in ((stA, 0), (stB, 1)):
        assert (proc(st, "trainer", i)["state"], proc(st, "trainer", i)["exit_code"]) == ("exited", 0)
        assert proc(st, "pserver", i)["state"] == "stopped"
    assert tagged(job_id) == []
    rc, ports = agent("wait-ports", "127.0.0.1:%d,127.0.0.1:%d" % (ps0, ps1), "--timeout", "0.3")
    assert rc == 1 and sorted(ports["closed"]) == sorted(["127.0.0.1:%d" % ps0, "127.0.0.1:%d" % ps1])


@pytest.mark.timeout(30)
def test_on_failure_continue_keeps_other_trainers_running(cluster):
    job_id = cluster.new_job_id()
    d = cluster.host("hA", job_id, [cluster.process("pserver", 0, "sleep"),
                                    cluster.process("trainer", 0, "exit", 3, 0.3),
                                    cluster.process("trainer", 1, "exit", 0, 2.5)],
                     coordinator(free_port(), True, 1, 2), on_failure="continue")
    launch(d)
    assert wait_for(lambda: proc(status(d), "trainer", 0)["state"] == "failed", 5)
    st = status(d)
    assert st["state"] == "running"
    assert proc(st, "trainer", 1)["state"] == "running" and proc(st, "pserver", 0)["state"] == "running"
    final = wait_for(lambda: terminal(d), 10)
    assert final["state"] == "failed"
    assert final["failure"] == {"role": "trainer", "id": 0, "host": "hA", "exit_code": 3}
    assert [(q["role"], q["id"], q["state"], q["exit_code"]) for q in final["processes"]] == [
        ("pserver", 0, "stopped", -15), ("trainer", 0, "failed", 3), ("trainer", 1, "exited", 0)]


@pytest.mark.timeout(30)
def test_coordinator_loses_peer_host(cluster):
    job_id = cluster.new_job_id()
    port = free_port()
    hA = cluster.host("hA", job_id, [cluster.process("pserver", 0, "sleep")], coordinator(port, True, 2, 1))
    hB = cluster.host("hB", job_id, [cluster.process("trainer", 0, "sleep")], coordinator(port, False, 2, 1))
    launch(hA)
    resB = launch(hB)
    assert wait_for(lambda: status(hA).get("hosts", {}).get("hB", {}).get("state") == "connected", 5)
    os.kill(resB["supervisor_pid"], signal.SIGKILL)  # host B "dies"
    final = wait_for(lambda: terminal(hA), 8)
    assert final and final["state"] == "failed", status(hA)
    assert final["reason"].startswith("lost host hB: ")
    assert final["hosts"]["hB"]["state"] == "lost"
    assert proc(final, "pserver", 0)["state"] == "stopped"
    # B's trainer got SIGTERM from the kernel (PR_SET_PDEATHSIG); B's record says what happened
    stB = wait_for(lambda: proc(status(hB), "trainer", 0)["state"] == "lost" and status(hB), 5)
    assert stB and stB["state"] == "lost" and stB["supervisor"]["alive"] is False, status(hB)
    assert wait_for(lambda: tagged(job_id) == [], 3)


@pytest.mark.timeout(30)
def test_peer_stops_when_coordinator_dies(cluster):
    job_id = cluster.new_job_id()
    port = free_port()
    hA = cluster.host("hA", job_id, [cluster.process("pserver", 0, "sleep")], coordinator(port, True, 2, 1))
    hB = cluster.host("hB", job_id, [cluster.process("trainer", 0, "sleep")], coordinator(port, False, 2, 1))
    resA = launch(hA)
    launch(hB)
    assert wait_for(lambda: status(hB).get("coordinator", {}).get("connected"), 5)
    t0 = time.monotonic()
    os.kill(resA["supervisor_pid"], signal.SIGKILL)
    final = wait_for(lambda: terminal(hB), 10)
    assert final and final["state"] == "failed", status(hB)
    assert time.monotonic() - t0 < 6
    assert final["reason"].startswith("lost connection to coordinator 127.0.0.1:%d: " % port)
    assert proc(final, "trainer", 0)["state"] == "stopped"
    assert wait_for(lambda: tagged(job_id) == [], 3)


@pytest.mark.timeout(30)
def test_stop_on_one_host_stops_the_job_everywhere(cluster):
    job_id = cluster.new_job_id()
    port = free_port()
    hA = cluster.host("hA", job_id, [cluster.process("pserver", 0, "sleep")], coordinator(port, True, 2, 1))
    hB = cluster.host("hB", job_id, [cluster.process("trainer", 0, "sleep")], coordinator(port, False, 2, 1))
    launch(hA)
    launch(hB)
    assert wait_for(lambda: status(hB).get("coordinator", {}).get("connected"), 5)
    rc, out = agent("stop", hB, "--grace", "1")
    assert rc == 0 and out["ok"] and out["was_running"] and out["state"] == "stopped", out
    final = wait_for(lambda: terminal(hA), 5)
    assert final and final["state"] == "stopped" and final["reason"] == "stop requested on hB", final
    assert proc(final, "pserver", 0)["state"] == "stopped"
    assert wait_for(lambda: tagged(job_id) == [], 3)


@pytest.mark.timeout(20)
def test_launch_reports_spawn_and_listen_failures(cluster):
    job_id = cluster.new_job_id()
    bad = cluster.process("trainer", 1, "sleep")
    bad["argv"] = ["no-such-binary-xyz", "--flag"]
    d = cluster.host("hA", job_id, [cluster.process("pserver", 0, "sleep"), bad,
                                    cluster.process("trainer", 2, "sleep")])
    rc, out = agent("launch", os.path.join(d, "job.json"))
    assert rc == 1 and out["ok"] is False
    assert out["error"] == ("cannot start trainer.1 (no-such-binary-xyz in %s): No such file or directory"
                            % cluster.work)
    assert list(out["pids"]) == ["pserver.0"]
    final = wait_for(lambda: terminal(d), 5)
    assert final["state"] == "failed" and final["failure"]["role"] == "trainer" and final["failure"]["id"] == 1
    assert [(q["role"], q["id"], q["state"]) for q in final["processes"]] == [
        ("pserver", 0, "stopped"), ("trainer", 1, "failed"), ("trainer", 2, "stopped")]
    assert tagged(job_id) == []

    held = socket.create_server(("127.0.0.1", 0))
    try:
        port = held.getsockname()[1]
        d2 = cluster.host("hB", cluster.new_job_id(), [cluster.process("trainer", 0, "sleep")],
                          coordinator(port, True, 1, 1))
        rc, out = agent("launch", os.path.join(d2, "job.json"))
    finally:
        held.close()
    assert rc == 1 and out["ok"] is False and out["pids"] == {}
    assert out["error"] == "cannot listen on 127.0.0.1:%d: Address already in use" % port
    assert status(d2)["state"] == "failed"


@pytest.mark.timeout(30)
def test_bad_token_and_garbage_are_rejected(cluster):
    job_id = cluster.new_job_id()
    port = free_port()
    d = cluster.host("hA", job_id, [cluster.process("trainer", 0, "sleep")], coordinator(port, True, 1, 1))
    launch(d)

    def exchange(payload):
        """Send payload after reading the challenge; return (challenge, everything else the coordinator sent)."""
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            f = s.makefile("rb")
            challenge = json.loads(f.readline())
            s.sendall(payload)
            return challenge, f.read()

    challenge, reply = exchange(json.dumps({"type": "hello", "token": TOKEN, "job": job_id, "host": "old"}).encode()
                                + b"\n")
    assert set(challenge) == {"type", "version", "nonce"} and challenge["type"] == "challenge", challenge
    assert challenge["version"] == 2 and len(challenge["nonce"]) == 64
    assert json.loads(reply) == {"type": "error", "error": "protocol version mismatch: coordinator speaks 2, "
                                 "peer sent None", "version": 2}
    bad = {"type": "hello", "version": 2, "job": job_id, "host": "evil", "nonce": "ab" * 32, "proof": "0" * 64}
    _, reply = exchange(json.dumps(bad).encode() + b"\n")
    assert json.loads(reply) == {"type": "error", "error": "bad token", "version": 2}
    assert exchange(b"\xff\xfe not json at all\n")[1] == b""
    assert exchange(b"[1, 2, 3]\n")[1] == b""
    assert exchange(b"[" * 3000 + b"]" * 3000 + b"\n")[1] == b""  # deep nesting: RecursionError once
    st = status(d)
    assert st["state"] == "running" and "evil" not in st["hosts"]
    assert st["supervisor"]["alive"] is True
    log = open(os.path.join(d, "supervisor.log")).read()
    assert "bad token" in log and "garbage from 127.0.0.1:" in log and "nested deeper" in log

    # an authenticated peer sending nonsense does not crash the supervisor; its disconnect is a lost host
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        f = s.makefile("rb")
        nc = json.loads(f.readline())["nonce"]
        np_ = "cd" * 32
        proof = agent_mod.auth_proof(TOKEN, "peer", job_id, "odd", nc, np_)
        s.sendall(json.dumps({"type": "hello", "version": 2, "job": job_id, "host": "odd", "nonce": np_,
                              "proof": proof}).encode() + b"\n")
        assert json.loads(f.readline()) == {
            "type": "welcome", "job": job_id,
            "proof": agent_mod.auth_proof(TOKEN, "coordinator", job_id, "odd", nc, np_)}
        s.sendall(b'{"type": "exit", "role": "trainer", "id": [1], "code": {}}\n{"type": "what"}\n')
        assert wait_for(lambda: "ignoring malformed exit event" in open(os.path.join(d, "supervisor.log")).read(), 5)
        assert status(d)["supervisor"]["alive"] is True
    final = wait_for(lambda: terminal(d), 5)
    # "connection closed", or "no heartbeat" when the status call above was slow (a loaded machine)
    assert final and final["state"] == "failed" and final["reason"].startswith("lost host odd: "), final
    assert final["coordinator"]["rejected_connections"] == 5, final["coordinator"]

    # a peer configured with the wrong token gives up at once; the coordinator times out waiting for it
    job2 = cluster.new_job_id()
    port2 = free_port()
    hA = cluster.host("hA", job2, [cluster.process("pserver", 0, "sleep")],
                      coordinator(port2, True, 2, 1, connect_timeout=2.0))
    peer = coordinator(port2, False, 2, 1)
    peer["token"] = "wrong"
    hB = cluster.host("hB", job2, [cluster.process("trainer", 0, "sleep")], peer)
    launch(hA)
    launch(hB)
    fB = wait_for(lambda: terminal(hB), 5)
    assert fB and fB["state"] == "failed" and fB["reason"] == "coordinator rejected this host: bad token", fB
    fA = wait_for(lambda: terminal(hA), 8)
    assert fA and fA["state"] == "failed"
    assert fA["reason"] == "only 0 of 1 peer host(s) connected within 2s (connected: none)"


# ---------------------------------------------------------------------------
# preflight / wait-ports / bad input


@pytest.mark.timeout(20)
def test_preflight_names_ports_and_paths(cluster):
    job_id = cluster.new_job_id()
    held = socket.create_server(("127.0.0.1", 0))
    held_port = held.getsockname()[1]
    free = free_port()
    blocker = cluster.tmp / "not-a-dir"
    blocker.write_text("x")
    (cluster.work / "train.py").write_text("print('hi')\n")
    procs = [
        {"role": "pserver", "id": 0, "argv": ["python3", "train.py"], "env": {}, "cwd": str(cluster.work),
         "log": str(cluster.work / "log" / "p0.log"), "ports": ["127.0.0.1:%d" % held_port]},
        {"role": "trainer", "id": 0, "argv": ["python3", "-u", "missing.py", "--x"], "env": {},
         "cwd": str(cluster.work), "log": str(blocker / "t0.log"), "ports": ["127.0.0.1:%d" % free]},
        {"role": "trainer", "id": 1, "argv": ["no-such-binary-xyz"], "env": {}, "cwd": "/nonexistent/dir",
         "log": str(cluster.work / "log" / "t1.log")},
        {"role": "trainer", "id": 2, "argv": ["./run.sh"], "env": {}, "cwd": str(cluster.work),
         "log": str(cluster.work / "log" / "t2.log"), "ports": ["127.0.0.1:%d" % free]},
    ]
    d = cluster.host("hA", job_id, procs)
    try:
        rc, out = agent("preflight", os.path.join(d, "job.json"))
    finally:
        held.close()
    assert rc == 1 and out["ok"] is False
    got = [(p["kind"], p.get("process"), p.get("endpoint") or p.get("path")) for p in out["problems"]]
    assert got == [
        ("script_missing", "trainer.0", str(cluster.work / "missing.py")),
        ("log_dir_not_writable", "trainer.0", str(blocker)),
        ("cwd_missing", "trainer.1", "/nonexistent/dir"),
        ("entrypoint_missing", "trainer.1", "no-such-binary-xyz"),
        ("entrypoint_missing", "trainer.2", str(cluster.work / "run.sh")),
        ("port_in_use", "pserver.0", "127.0.0.1:%d" % held_port),
        ("port_duplicate", "trainer.2", "127.0.0.1:%d" % free),
    ], out
    msgs = {p["kind"]: p["message"] for p in out["problems"]}
    assert "127.0.0.1:%d" % held_port in msgs["port_in_use"]

    ok_dir = cluster.host("hB", cluster.new_job_id(), [procs[0]])
    rc, out = agent("preflight", os.path.join(ok_dir, "job.json"))
    assert rc == 0 and out == {"ok": True, "job": out["job"], "host": "hB", "problems": []}


@pytest.mark.timeout(20)
def test_wait_ports_names_the_ones_that_never_opened():
    srv = socket.create_server(("127.0.0.1", 0))
    late_port, dead_port = free_port(), free_port()
    opened = []

    def open_late():
        time.sleep(0.5)
        opened.append(socket.create_server(("127.0.0.1", late_port)))
    t = threading.Thread(target=open_late)
    t.start()
    try:
        eps = "127.0.0.1:%d,127.0.0.1:%d,127.0.0.1:%d" % (srv.getsockname()[1], late_port, dead_port)
        t0 = time.monotonic()
        rc, out = agent("wait-ports", eps, "--timeout", "1.5")
        assert 1.4 < time.monotonic() - t0 < 5
        assert rc == 1 and out["ok"] is False
        assert out["open"] == ["127.0.0.1:%d" % srv.getsockname()[1], "127.0.0.1:%d" % late_port]
        assert out["closed"] == ["127.0.0.1:%d" % dead_port]
        assert out["errors"] == {"127.0.0.1:%d" % dead_port: "Connection refused"}
    finally:
        t.join()
        srv.close()
        for s in opened:
            s.close()


@pytest.mark.timeout(20)
@pytest.mark.parametrize("args, content, message", [
    (["launch", "{dir}/absent.json"], None, "cannot read job file {dir}/absent.json"),
    (["launch", "{dir}/job.json"], b"{not json", "job file {dir}/job.json is not valid JSON"),
    (["launch", "{dir}/job.json"], b'{"job": "j1", "processes": [{"role": "worker", "id": 0}]}',
     "{dir}/job.json: processes[0].role: must be one of pserver/trainer, got 'worker'"),
    (["preflight", "{dir}/job.json"],
     b'{"job": "j1", "processes": [{"role": "trainer", "id": 0, "argv": [], "cwd": "/", "log": "/l"}]}',
     "{dir}/job.json: processes[0].argv: must be a non-empty list of strings"),
    (["launch", "{dir}/job.json"], b'{"job": "../x", "processes": []}', "{dir}/job.json: job: '../x' must match"),
    (["wait-ports", "nohost", "--timeout", "1"], None, "expected HOST:PORT, got 'nohost'"),
    (["wait-ports", "h:99999"], None, "expected HOST:PORT with port 1-65535, got 'h:99999'"),
    (["explode"], None, "agent.py: argument COMMAND: invalid choice: 'explode'"),
    (["status"], None, "agent.py status: the following arguments are required: jobdir"),
    (["logs", "{dir}"], None, "no job state or job.json in {dir}"),
])
def test_bad_input_gives_json_error_and_exit_2(tmp_path, args, content, message):
    if content is not None:
        (tmp_path / "job.json").write_bytes(content)
    rc, out = agent(*[a.format(dir=tmp_path) for a in args])
    assert rc == 2 and out["ok"] is False
    assert out["error"].startswith(message.format(dir=tmp_path)), out["error"]


# ---------------------------------------------------------------------------
# logs


def _fake_job(cluster, files):
    """A job dir (never launched) whose processes' logs have the given contents."""
    procs = [cluster.process(role, i, "sleep") for role, i in files]
    d = cluster.host("hL", cluster.new_job_id(), procs)
    for p, data in zip(procs, files.values()):
        os.makedirs(os.path.dirname(p["log"]), exist_ok=True)
        with open(p["log"], "wb") as f:
            f.write(data)
    return d


@pytest.mark.timeout(20)
def test_logs_prefix_tail_non_utf8_and_long_lines(cluster):
    big = b"x" * (1024 * 1024)
    d = _fake_job(cluster, {("pserver", 0): b"p1\np2\n\np4",
                            ("trainer", 3): b"t1\n\xff\xfe bad \xc3(\n" + big + b"\nt4\n"})
    p = subprocess.run([PY, AGENT, "logs", d, "--host-label", "10.0.0.2"], stdout=subprocess.PIPE, timeout=10)
    assert p.returncode == 0
    assert p.stdout.split(b"\n") == [
        b"[10.0.0.2 pserver.0] p1", b"[10.0.0.2 pserver.0] p2", b"[10.0.0.2 pserver.0] ",
        b"[10.0.0.2 pserver.0] p4",
        b"[10.0.0.2 trainer.3] t1", b"[10.0.0.2 trainer.3] \xff\xfe bad \xc3(",
        b"[10.0.0.2 trainer.3] " + big, b"[10.0.0.2 trainer.3] t4", b""]

    p = subprocess.run([PY, AGENT, "logs", d, "-n", "2"], stdout=subprocess.PIPE, timeout=10)
    assert p.stdout.split(b"\n") == [b"[hL pserver.0] ", b"[hL pserver.0] p4",
                                     b"[hL trainer.3] " + big, b"[hL trainer.3] t4", b""]
    p = subprocess.run([PY, AGENT, "logs", d, "--role", "trainer", "--id", "3", "-n", "1"],
                       stdout=subprocess.PIPE, timeout=10)
    assert p.stdout == b"[hL trainer.3] t4\n"


@pytest.mark.timeout(30)
def test_logs_follow_survives_truncation_and_exits_when_job_ends(cluster):
    job_id = cluster.new_job_id()
    d = cluster.host("hF", job_id, [cluster.process("trainer", 0, "sleep")])
    launch(d)
    logpath = status(d)["processes"][0]["log"]
    with open(logpath, "ab") as f:
        f.write(b"one\ntwo\n")
    follower = subprocess.Popen([PY, AGENT, "logs", d, "--follow"], stdout=subprocess.PIPE)
    lines = []
    reader = threading.Thread(target=lambda: lines.extend(follower.stdout))
    reader.start()
    try:
        assert wait_for(lambda: len(lines) >= 2, 5), lines
        os.truncate(logpath, 0)
        with open(logpath, "ab") as f:
            f.write(b"three\n")
        assert wait_for(lambda: len(lines) >= 3, 5), lines
        big = b"y" * (1024 * 1024)
        with open(logpath, "ab") as f:
            f.write(big[:1000])
            f.flush()
            time.sleep(0.5)  # the follower sees a partial line first
            f.write(big[1000:] + b"\n\xff tail")
        assert wait_for(lambda: len(lines) >= 4, 5)
        rc, _ = agent("stop", d, "--grace", "1")
        assert rc == 0
        assert follower.wait(timeout=10) == 0  # job over on this host -> follow ends by itself
    finally:
        if follower.poll() is None:
            follower.kill()
        reader.join()
    assert lines == [b"[hF trainer.0] one\n", b"[hF trainer.0] two\n", b"[hF trainer.0] three\n",
                     b"[hF trainer.0] " + big + b"\n", b"[hF trainer.0] \xff tail\n"]


# ---------------------------------------------------------------------------
# pservers first, trainers once every pserver endpoint accepts connections


@pytest.mark.timeout(40)
def test_trainers_start_only_after_the_pserver_endpoints_open(cluster):
    job_id = cluster.new_job_id("order")
    ps_port, ctl = free_port(), free_port()
    ep = "127.0.0.1:%d" % ps_port
    # pserver on hA opens its port after 1.5 s; the trainer on hB must wait for it
    delayed = [PY, "-c", "import time, socket; time.sleep(1.5); s = socket.create_server(('127.0.0.1', %d)); "
                         "[s.accept()[0].close() for _ in iter(int, 1)]" % ps_port]
    ps = cluster.process("pserver", 0, "sleep", ports=[ep])
    ps["argv"] = delayed
    after = {"endpoints": [ep], "timeout": 20}
    a = cluster.host("hA", job_id, [ps, cluster.process("trainer", 0, "sleep")],
                     coordinator(ctl, True, 2, 2), start_trainers_after=after)
    b = cluster.host("hB", job_id, [cluster.process("trainer", 1, "sleep")],
                     coordinator(ctl, False, 2, 2), start_trainers_after=after)
    t0 = time.monotonic()
    launches = [threading.Thread(target=launch, args=(d,)) for d in (a, b)]
    for t in launches:
        t.start()
    for t in launches:
        t.join()
    assert time.monotonic() - t0 >= 1.4  # launch returned only once the trainers were running
    sa, sb = status(a), status(b)
    started_ps = proc(sa, "pserver", 0)["started_at"]
    for st, tid in ((sa, 0), (sb, 1)):
        t = proc(st, "trainer", tid)
        assert t["state"] == "running"
        assert t["started_at"] - started_ps >= 1.4, (t, started_ps)


@pytest.mark.timeout(40)
def test_pserver_endpoint_that_never_opens_fails_the_launch_and_leaves_nothing(cluster):
    job_id = cluster.new_job_id("noopen")
    ep = "127.0.0.1:%d" % free_port()
    a = cluster.host("hA", job_id, [cluster.process("pserver", 0, "sleep", ports=[ep]),
                                    cluster.process("trainer", 0, "sleep")],
                     start_trainers_after={"endpoints": [ep], "timeout": 1.5})
    rc, out = agent("launch", os.path.join(a, "job.json"))
    assert rc == 1 and not out["ok"]
    assert out["error"] == "pserver endpoint(s) %s did not accept connections within 1.5s" % ep
    st = wait_for(lambda: terminal(a), 15)
    assert st["state"] == "failed", st
    assert proc(st, "trainer", 0)["pid"] is None
    assert wait_for(lambda: not tagged(job_id), 10)
