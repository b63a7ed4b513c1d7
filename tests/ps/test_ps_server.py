"""Pserver robustness: garbage input, planned-address binding, barrier timeouts, clean exits."""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
import zmq
from helpers import free_ports
from ps_jobs import REPO, TOKEN, in_threads, job_env, raw_dealer

from clusterctl.ps import (
    SGD,
    BarrierTimeoutError,
    ParameterServer,
    PSClient,
    PsConfigError,
    PsError,
    PsTimeoutError,
)
from clusterctl.ps.auth import Credentials, secure_client

pytestmark = pytest.mark.timeout(30)


def _params():
    return {"w": np.arange(6, dtype=np.float32).reshape(3, 2), "b": np.ones(1, np.float32)}


def _listening(ip: str, port: int) -> list[str]:
    """Local addresses in LISTEN state on ``port``, read from /proc/net/tcp (no psutil, no ss)."""
    found = []
    with open("/proc/net/tcp") as fh:
        next(fh)
        for line in fh:
            local, state = line.split()[1], line.split()[3]
            hexip, hexport = local.split(":")
            if state == "0A" and int(hexport, 16) == port:
                found.append(socket.inet_ntoa(bytes.fromhex(hexip)[::-1]))
    return found


def test_binds_only_the_planned_address(servers):
    port = free_ports(1, "127.0.0.2")[0]
    srv = ParameterServer(f"127.0.0.2:{port}", num_trainers=1)
    try:
        assert srv.bind() == f"tcp://127.0.0.2:{port}"
        assert _listening("127.0.0.2", port) == ["127.0.0.2"]
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=2).close()
        socket.create_connection(("127.0.0.2", port), timeout=2).close()
    finally:
        srv.close()


@pytest.mark.parametrize("endpoint", ["0.0.0.0:6170", "*:6170", ":6170", "[::]:6170"])
def test_wildcard_endpoints_are_refused(endpoint):
    with pytest.raises(PsConfigError, match="binds its planned address, not a wildcard"):
        ParameterServer(endpoint, num_trainers=1)


def test_port_already_taken_is_a_config_error():
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    port = holder.getsockname()[1]
    srv = ParameterServer(f"127.0.0.1:{port}", num_trainers=1)
    try:
        want = f"pserver 0 cannot bind tcp://127.0.0.1:{port}: Address already in use"
        with pytest.raises(PsConfigError, match=want):
            srv.bind()
    finally:
        srv.close()
        holder.close()


def test_garbage_does_not_crash_the_server(servers):
    g = servers(1, num_trainers=1, mode="async")
    ip, port = g.endpoints[0].rsplit(":", 1)
    # 1. raw TCP garbage (not even a ZMTP greeting): libzmq drops the connection in the handshake
    with socket.create_connection((ip, int(port)), timeout=2) as raw:
        raw.sendall(b"GET / HTTP/1.0\r\n\r\n" + bytes(range(256)) * 64)
        with contextlib.suppress(ConnectionResetError):  # the greeting, then the end of the stream (or a reset)
            while raw.recv(4096):
                pass
    door = g.servers[0]._door
    deadline = time.monotonic() + 10
    while door.stats["accepted"] < 1 or door.pending:  # the door saw the connection come and go
        assert time.monotonic() < deadline, dict(door.stats)
        time.sleep(0.05)
    assert g.servers[0].stats["requests"] == 0  # nothing of it reached the pserver as a request
    # 2. well-framed ZeroMQ messages with bad content, from an authenticated DEALER and REQ socket
    ctx = zmq.Context.instance()
    dealer = raw_dealer(g.endpoints[0])
    cases = [  # (frames, code, message, the seq the refusal names: the request's, where its header says it)
        ([b"\x00\x01\x02garbage"], "bad_request", "header is not UTF-8 JSON", 0),
        ([json.dumps({"v": 1, "op": "drop_tables", "seq": 4}).encode()], "bad_request", "unknown op 'drop_tables'", 4),
        ([json.dumps({"v": 1, "op": "push", "seq": 5, "tid": 0, "t": [["w.block0", "float32", 100]]}).encode(),
          b"\0" * 3], "bad_request", "tensor 'w.block0': frame has 3 bytes, header says 400", 5),
        ([json.dumps({"v": 1, "op": "push", "seq": 6, "tid": 7, "t": []}).encode()], "bad_request",
         "tid must be a trainer id in 0..0, got 7", 6),
        ([json.dumps({"v": 1, "op": "push", "seq": 7, "tid": 0, "t": [["nope", "float32", 1]]}).encode(),
          b"\0" * 4], "unknown_key", "block 'nope' was never initialised on pserver 0", 7),
        ([json.dumps({"v": 1, "op": "save", "seq": 8, "tid": 0}).encode()], "bad_request",
         "save needs a non-empty 'dir'", 8),
        # refused while decoding: the reply still names seq 9, so a client is told at once, not at its timeout
        ([json.dumps({"v": 1, "op": "push", "seq": 9, "tid": 0, "step": -1, "t": []}).encode()], "bad_request",
         "step must be a non-negative integer, got -1", 9),
        ([json.dumps({"v": 1, "op": "push", "seq": -3, "tid": 0, "t": []}).encode()], "bad_request",
         "seq must be a non-negative integer, got -3", 0),
    ]
    for frames, code, message, seq in cases:
        dealer.send_multipart(frames)
        assert dealer.poll(5000), f"no reply to {frames[0][:40]!r}"
        reply = json.loads(dealer.recv_multipart()[0])
        assert (reply["ok"], reply["code"], reply["seq"]) == (False, code, seq), reply
        assert reply["error"].startswith(message), reply["error"]
    req = ctx.socket(zmq.REQ)
    secure_client(req, Credentials.from_token(TOKEN))
    req.connect(f"tcp://{g.endpoints[0]}")
    req.send(b"{{{{")
    assert req.poll(5000)
    assert json.loads(req.recv())["code"] == "bad_request"
    dealer.close(0)
    req.close(0)
    # 3. the server still serves a real trainer end to end
    with PSClient(g.endpoints, trainer_id=0, num_trainers=1, mode="async", optimizer=SGD(0.5), timeout=5) as c:
        c.init(_params())
        out = c.push_pull({"w": np.ones((3, 2), np.float32), "b": np.ones(1, np.float32)})
        np.testing.assert_array_equal(out["w"], np.arange(6, dtype=np.float32).reshape(3, 2) - 0.5)
        c.complete()
    assert g.join(5) and not g.errors
    assert g.servers[0].stats["rejected"] == len(cases) + 1


def test_barrier_timeout_names_the_missing_trainers(servers):
    g = servers(1, num_trainers=3, mode="sync", barrier_timeout=1.0)
    with PSClient(g.endpoints, trainer_id=1, num_trainers=3, mode="sync", optimizer=SGD(0.1), timeout=10) as c:
        c.init(_params())
        t0 = time.monotonic()
        with pytest.raises(BarrierTimeoutError) as err:
            c.push_pull({"w": np.ones((3, 2), np.float32), "b": np.ones(1, np.float32)})
        assert 0.9 < time.monotonic() - t0 < 5
    assert err.value.missing == (0, 2)
    assert str(err.value) == "sync barrier for step 0 timed out after 1s; missing trainer id(s): 0, 2"
    assert g.join(5)
    srv_err = g.errors[0]
    assert isinstance(srv_err, BarrierTimeoutError)
    assert str(srv_err) == "sync barrier for step 0 timed out after 1s; missing trainer id(s): 0, 2"


@pytest.mark.parametrize("pipelined", [True, False], ids=["pipelined", "whole"])
def test_a_pserver_whose_round_completed_fails_too_when_the_other_times_out(servers, pipelined):
    """Trainer 1's push reaches pserver 0 and never pserver 1 (it was killed in between): pserver 0's round
    completes and pserver 1's times out. The trainers that pserver 1 failed tell pserver 0 (``abort``), which
    fails the same way instead of waiting for ever for a round nobody will push (seen in CI under load)."""
    g = servers(2, num_trainers=3, mode="sync", barrier_timeout=1.0)
    grads = {"w": np.ones((3, 2), np.float32), "b": np.ones(1, np.float32)}
    failed: dict[int, BaseException] = {}

    def trainer(tid: int) -> None:
        with PSClient(g.endpoints, trainer_id=tid, num_trainers=3, mode="sync", optimizer=SGD(0.1),
                      timeout=4, pipeline=pipelined) as c:
            c.init(_params())
            assert all(c._split(grads).values())  # both pservers hold a block
            if tid == 1:  # everything it sends to pserver 1 from now on is lost
                real = c._send
                c._send = lambda i, *a: None if i == 1 else real(i, *a)
            try:
                c.push_pull(grads)
            except PsError as exc:
                failed[tid] = exc

    t0 = time.monotonic()
    in_threads(trainer, range(3))
    assert g.join(8), "pserver 0 still waits for a round that nobody will push"
    assert time.monotonic() - t0 < 9
    why = "sync barrier for step 0 timed out after 1s; missing trainer id(s): 1"
    assert [type(failed[t]).__name__ for t in (0, 2)] == ["BarrierTimeoutError"] * 2
    assert str(failed[0]) == str(failed[2]) == why
    assert isinstance(failed[1], PsTimeoutError)  # the lost trainer's own view: pserver 1 never answered
    assert [str(g.errors[i]) for i in (0, 1)] == [why, why]
    assert all(isinstance(g.errors[i], BarrierTimeoutError) for i in (0, 1))


def test_abort_is_checked_and_only_for_sync_mode(servers):
    g = servers(1, num_trainers=2, mode="async")
    d = raw_dealer(g.endpoints[0])
    d.send_multipart([json.dumps({"v": 1, "op": "abort", "seq": 1, "tid": 0, "missing": [1], "timeout": 1,
                                  "step": 0}).encode()])
    assert d.poll(5000)
    assert json.loads(d.recv_multipart()[0])["error"] == "abort is for sync mode; pserver 0 runs async"
    g2 = servers(1, num_trainers=2, mode="sync", barrier_timeout=10)
    d2 = raw_dealer(g2.endpoints[0])
    for bad in ({"missing": "1", "timeout": 1, "step": 0}, {"missing": [1], "timeout": True, "step": 0},
                {"missing": [1], "timeout": 1}, {"missing": [0, 1, 1], "timeout": 1, "step": 0},
                {"missing": [2], "timeout": 1, "step": 0}, {"missing": [-1], "timeout": 1, "step": 0},  # not its trainers
                {"missing": [1, 1], "timeout": 1, "step": 0}):
        d2.send_multipart([json.dumps({"v": 1, "op": "abort", "seq": 2, "tid": 0, **bad}).encode()])
        assert d2.poll(5000)
        reply = json.loads(d2.recv_multipart()[0])
        assert (reply["code"], reply["error"]) == ("bad_request", "abort needs the barrier's 'missing' trainer "
                                                   "ids, its 'timeout' and its 'step'"), bad
    assert not g.errors and not g2.errors and all(t.is_alive() for t in g.threads + g2.threads)
    d.close(0)
    d2.close(0)


def test_client_times_out_when_no_pserver_answers():
    port = free_ports(1)[0]
    with PSClient([f"127.0.0.1:{port}"], trainer_id=0, num_trainers=1, timeout=0.5) as c:
        t0 = time.monotonic()
        with pytest.raises(Exception, match=rf"no reply to 'init' within 0.5s from pserver\(s\) 127.0.0.1:{port}"):
            c.init(_params())
        assert time.monotonic() - t0 < 3


def test_duplicate_push_in_a_round_is_rejected(servers):
    g = servers(1, num_trainers=2, mode="sync", barrier_timeout=10)
    with PSClient(g.endpoints, trainer_id=0, num_trainers=2, mode="sync", optimizer=SGD(0.1), timeout=5) as c:
        c.init(_params())
    d = raw_dealer(g.endpoints[0])
    head = {"v": 1, "op": "push", "tid": 0, "t": [["b.block0", "float32", 1]]}
    d.send_multipart([json.dumps({**head, "seq": 1}).encode(), np.ones(1, np.float32).tobytes()])
    d.send_multipart([json.dumps({**head, "seq": 2}).encode(), np.ones(1, np.float32).tobytes()])
    assert d.poll(5000)
    reply = json.loads(d.recv_multipart()[0])
    assert (reply["seq"], reply["code"], reply["error"]) == (2, "duplicate", "trainer 0 pushed twice in round 0")
    d.close(0)


def test_pserver_process_exits_zero_after_all_trainers_complete():
    eps = [f"127.0.0.1:{p}" for p in free_ports(1)]
    env = job_env("pserver", 0, eps, ["127.0.0.1:1", "127.0.0.1:2"], {"CLUSTERCTL_PS_MODE": "async"})
    proc = subprocess.Popen([sys.executable, "-m", "clusterctl.ps", "server"], env=env, cwd=REPO,
                            stderr=subprocess.PIPE, text=True)
    try:
        for tid in (0, 1):
            with PSClient(eps, trainer_id=tid, num_trainers=2, mode="async", timeout=10) as c:
                c.init(_params())
                c.complete()
        assert proc.wait(10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    err = proc.stderr.read()
    assert (f"pserver 0 of 1 listening on tcp://{eps[0]} (mode=async, trainers=2, CURVE with the job token's keys)"
            in err)
    assert "all 2 trainer(s) completed; pserver 0 exiting" in err


def test_pserver_process_exits_nonzero_on_barrier_timeout():
    eps = [f"127.0.0.1:{p}" for p in free_ports(1)]
    env = job_env("pserver", 0, eps, ["127.0.0.1:1", "127.0.0.1:2"],
                  {"CLUSTERCTL_PS_MODE": "sync", "CLUSTERCTL_PS_BARRIER_TIMEOUT": "1"})
    proc = subprocess.Popen([sys.executable, "-m", "clusterctl.ps", "server"], env=env, cwd=REPO,
                            stderr=subprocess.PIPE, text=True)
    try:
        with PSClient(eps, trainer_id=0, num_trainers=2, mode="sync", timeout=10) as c:
            c.init(_params())
            with pytest.raises(BarrierTimeoutError):
                c.push({"w": np.ones((3, 2), np.float32), "b": np.ones(1, np.float32)})
        assert proc.wait(10) == 1
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "missing trainer id(s): 1" in proc.stderr.read()


def test_bad_environment_exits_2():
    env = job_env("pserver", 0, ["127.0.0.1:1"], ["127.0.0.1:2"], {"PADDLE_PSERVER_ID": "3"})
    proc = subprocess.run([sys.executable, "-m", "clusterctl.ps", "server"], env=env, cwd=REPO,
                          check=False, capture_output=True, text=True, timeout=20)
    assert proc.returncode == 2
    assert "PADDLE_PSERVER_ID=3 does not name 127.0.0.1:1 in PADDLE_PSERVERS_IP_PORT_LIST=127.0.0.1:1" in proc.stderr
