"""The host agent's coordinator and peers under attack on loopback (issue 12, findings 1, 5 and 13):
real agent.py processes, a real trainer, hostile clients and an impostor coordinator."""

from __future__ import annotations

import json
import socket
import stat
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))

from helpers import FakeCoordinator, free_port  # noqa: E402
from test_agent import TOKEN, Cluster, coordinator, launch, proc, status, terminal, wait_for  # noqa: E402


@pytest.fixture
def cluster(tmp_path):
    c = Cluster(tmp_path)
    yield c
    c.cleanup()


def _send(port, payload, read=True):
    """Connect, read the challenge, send payload, return whatever comes back until close."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.settimeout(5)
        f = s.makefile("rb")
        challenge = json.loads(f.readline())
        try:
            s.sendall(payload)
        except OSError:
            return challenge, b""
        try:
            return challenge, f.read() if read else b""
        except OSError:
            return challenge, b""


@pytest.mark.timeout(60)
def test_one_unauthenticated_line_does_not_kill_the_job(cluster):
    """Finding 1: 3,001 bytes of nested brackets, and other garbage, before any authentication."""
    job_id = cluster.new_job_id()
    port = free_port()
    d = cluster.host("hA", job_id, [cluster.process("trainer", 0, "sleep")], coordinator(port, True, 1, 1))
    launch(d)
    pid = proc(status(d), "trainer", 0)["pid"]
    for payload in [b"[" * 1500 + b"]" * 1500 + b"\n", b"{\"a\":" * 3000 + b"\n", b"\x00" * 70000,
                    b"x" * 200000 + b"\n", b'{"type": "hello", "version": 2}\n' * 50, b"\xff\n",
                    json.dumps({"type": "hello", "version": 2, "job": job_id, "host": "h", "nonce": 5,
                                "proof": ["x"]}).encode() + b"\n"]:
        _, reply = _send(port, payload)
        assert TOKEN.encode() not in reply
    st = status(d)
    assert st["state"] == "running" and st["supervisor"]["alive"] is True
    assert proc(st, "trainer", 0)["pid"] == pid and proc(st, "trainer", 0)["state"] == "running"
    assert st["coordinator"]["rejected_connections"] >= 7


@pytest.mark.timeout(60)
def test_connection_churn_is_counted_and_its_log_lines_rate_limited(cluster):
    """Finding 13: unauthenticated churn used to write megabytes to supervisor.log."""
    job_id = cluster.new_job_id()
    port = free_port()
    d = cluster.host("hA", job_id, [cluster.process("trainer", 0, "sleep")], coordinator(port, True, 1, 1))
    launch(d)
    log = Path(d) / "supervisor.log"
    size0 = log.stat().st_size
    for _ in range(300):
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            s.sendall(b"GET / HTTP/1.0\r\n\r\n")
            s.settimeout(5)
            while s.recv(4096):
                pass
    st = wait_for(lambda: (lambda s: s if s["coordinator"]["rejected_connections"] >= 300 else None)(status(d)), 10)
    assert st and st["state"] == "running", st
    grown = log.stat().st_size - size0
    assert grown < 5000, log.read_text()[-3000:]  # 10 lines per kind per 10 s, not 300
    assert stat.S_IMODE(log.stat().st_mode) == 0o600


def Impostor(port):
    """Listens on the coordinator's port: sends a challenge, records the hello, forges a stop."""
    return FakeCoordinator(port, after=b'{"type": "welcome", "job": "x", "proof": "' + b"0" * 64 + b'"}\n'
                                       b'{"type": "stop", "state": "failed", "reason": "impostor says stop"}\n')


@pytest.mark.timeout(60)
def test_a_peer_reveals_nothing_to_an_impostor_and_ignores_its_stop(cluster):
    """Finding 5: peers sent the token to whatever listened on the coordinator's port, and obeyed it."""
    job_id = cluster.new_job_id()
    port = free_port()
    impostor = Impostor(port)
    try:
        hB = cluster.host("hB", job_id, [cluster.process("trainer", 0, "sleep")],
                          coordinator(port, False, 2, 1, connect_timeout=4.0))
        launch(hB)
        final = wait_for(lambda: terminal(hB), 15)
    finally:
        impostor.close()
    assert impostor.received, "the peer never answered the challenge"
    assert TOKEN.encode() not in impostor.received
    hello = json.loads(impostor.received.splitlines()[0])
    assert set(hello) >= {"type", "proof", "nonce"} and "token" not in hello
    assert final and final["state"] == "failed", final
    assert "impostor" not in final["reason"]
    assert final["reason"].startswith("could not connect to coordinator 127.0.0.1:%d within 4s" % port), final
    assert "did not prove the job token" in final["reason"]
    # reconnects back off, not thousands of attempts: until the first welcome 0.1 s doubling to JOIN_BACKOFF_MAX
    # (a quarter second: the start barrier waits for every peer) with jitter down to half of it, within the 4 s
    from clusterctl.host.peer import JOIN_BACKOFF_MAX

    assert 2 <= impostor.connections <= 4.0 / (JOIN_BACKOFF_MAX / 2) + 4, impostor.connections


@pytest.mark.timeout(60)
def test_real_peers_still_form_a_job_and_the_processes_get_a_derived_token(cluster):
    job_id = cluster.new_job_id()
    port = free_port()
    hA = cluster.host("hA", job_id, [cluster.process("pserver", 0, "sleep")], coordinator(port, True, 2, 1))
    hB = cluster.host("hB", job_id, [cluster.process("trainer", 0, "exit", 0, 1.5)], coordinator(port, False, 2, 1))
    launch(hA)
    launch(hB)
    # the supervisors start their processes once both joined (the start barrier): wait for the pserver's pid
    pid = wait_for(lambda: proc(status(hA), "pserver", 0)["pid"], 15)
    assert pid, status(hA)
    env = dict(kv.split(b"=", 1) for kv in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0") if b"=" in kv)
    token = env[b"CLUSTERCTL_JOB_TOKEN"].decode()
    assert len(token) == 64 and token != TOKEN  # derived: the processes never hold the agents' token
    final = wait_for(lambda: terminal(hA), 20)
    assert final and final["state"] == "succeeded", final
    log = Path(hA).parent / "log" / "pserver.0.log"
    assert stat.S_IMODE(log.stat().st_mode) == 0o600
    for d in (hA, hB):
        text = (Path(d) / "supervisor.log").read_text() + (Path(d) / "state.json").read_text()
        assert TOKEN not in text and token not in text
