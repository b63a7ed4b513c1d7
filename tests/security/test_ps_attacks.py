"""The parameter server under attack on loopback (issue 12, findings 2 and 3): clients without the job
token, oversized frames, checkpoint paths outside the checkpoint directory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import zmq
from helpers import free_port

from clusterctl.ps import PSClient, ParameterServer
from clusterctl.ps.errors import ProtocolError, RemoteOpError
from clusterctl.ps.protocol import encode, job_key

TOKEN = "f00d" * 16
ROOT = Path(__file__).resolve().parents[2]


class ServerGroup:
    """One in-process pserver serving in a thread (as tests/ps/conftest.py)."""

    def __init__(self, n, **kw):
        import threading

        self.servers = [ParameterServer("127.0.0.1:0", server_id=0, num_servers=1, **kw)]
        self.servers[0].bind()
        self.endpoints = [self.servers[0].endpoint]
        self.errors = {}
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        try:
            self.servers[0].serve()
        except BaseException as exc:  # recorded for the test
            self.errors[0] = exc

    def join(self, timeout=10.0):
        self.thread.join(timeout)
        return not self.thread.is_alive()

    def stop(self):
        self.servers[0].stop()
        self.join()


@pytest.fixture
def group():
    made = []

    def make(**kw):
        g = ServerGroup(1, **kw)
        made.append(g)
        return g

    yield make
    for g in made:
        g.stop()


def raw_request(endpoint, header, tensors=None, key=None, timeout=5.0):
    """One request on a bare DEALER; the decoded reply header (MAC stripped), or None on timeout."""
    ctx = zmq.Context.instance()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect("tcp://" + endpoint)
    try:
        s.send_multipart(encode({"seq": 1, **header}, tensors, key=key))
        if not s.poll(int(timeout * 1000)):
            return None
        frames = s.recv_multipart()
        raw = frames[0]
        return json.loads(raw[64:] if key is not None or raw[:1] != b"{" else raw)
    finally:
        s.close()


def test_requests_without_the_job_token_are_refused_and_change_nothing(group, tmp_path):
    g = group(num_trainers=1, mode="async", token=TOKEN, checkpoint_root=str(tmp_path))
    ep = g.endpoints[0]
    with PSClient(g.endpoints, trainer_id=0, num_trainers=1, mode="async", timeout=5, token=TOKEN) as c:
        c.init({"w": np.arange(4, dtype=np.float32)})
        for header, tensors in [
            ({"op": "ping"}, None),
            ({"op": "init", "tid": 0, "mode": "async", "plan": "x"}, {"w.block0": np.zeros(4, np.float32)}),
            ({"op": "pull", "keys": True}, None),
            ({"op": "push", "tid": 0}, {"w.block0": np.full(4, 1e9, np.float32)}),
            ({"op": "save", "dir": str(tmp_path / "x")}, None),
            ({"op": "load", "dir": str(tmp_path / "x")}, None),
            ({"op": "complete", "tid": 0}, None),
        ]:
            for key in (None, job_key("wrong-token")):
                reply = raw_request(ep, header, tensors, key=key)
                assert reply is not None and reply["ok"] is False and reply["code"] == "unauthenticated", reply
                assert "w.block0" not in json.dumps(reply)
        np.testing.assert_array_equal(c.pull()["w"], np.arange(4, dtype=np.float32))
        stats = c.ping()[0]["stats"]
        assert stats["unauthenticated"] == 14 and stats["updates"] == 0
        assert not (tmp_path / "x").exists()
        c.complete()
    assert g.join(5) and not g.errors  # served until the real trainer completed


def test_a_client_without_the_token_is_told_so(group):
    g = group(num_trainers=1, mode="sync", token=TOKEN)
    with PSClient(g.endpoints, trainer_id=0, num_trainers=1, mode="sync", timeout=2, token="") as c:  # no token
        with pytest.raises(ProtocolError, match="signed with a job token but this end has none"):
            c.init({"w": np.ones(3, np.float32)})  # the pserver's (signed) answer is "unauthenticated"
    assert g.servers[0].blocks == {} and g.servers[0].stats["unauthenticated"] == 1


def test_checkpoints_stay_inside_the_checkpoint_directory(group, tmp_path):
    ckroot = tmp_path / "ckpt"
    ckroot.mkdir()
    victim = tmp_path / "victim"
    (victim / "pserver-0").mkdir(parents=True)
    (victim / "pserver-0" / "keep").write_text("precious")
    os.symlink(victim, ckroot / "link")  # a symlink inside the root that leads out
    g = group(num_trainers=1, mode="sync", token=TOKEN, checkpoint_root=str(ckroot))
    with PSClient(g.endpoints, trainer_id=0, num_trainers=1, mode="sync", timeout=5, token=TOKEN) as c:
        c.init({"w": np.ones(3, np.float32)})
        for where in (str(victim), "../victim", str(ckroot / "link"), "link/..", "/"):
            with pytest.raises(RemoteOpError) as info:
                c.save(where, 1) if where != "link/.." else c.load(where)
            assert info.value.code == "checkpoint_refused", info.value
        assert c.save(str(ckroot / "run1"), 1) == 1
        c.complete()
    assert (victim / "pserver-0" / "keep").read_text() == "precious"
    assert (ckroot / "run1" / "pserver-0" / "manifest.json").is_file()


def test_without_a_checkpoint_directory_save_and_load_are_refused(group, tmp_path):
    g = group(num_trainers=1, mode="sync", token=TOKEN)
    with PSClient(g.endpoints, trainer_id=0, num_trainers=1, mode="sync", timeout=5, token=TOKEN) as c:
        c.init({"w": np.ones(3, np.float32)})
        with pytest.raises(RemoteOpError, match="no checkpoint directory configured"):
            c.save(str(tmp_path / "c"), 1)
        c.complete()
    assert not (tmp_path / "c").exists()


def _rss_mb(pid):
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmHWM")


@pytest.mark.timeout(60)
def test_an_oversized_frame_does_not_inflate_the_pserver(tmp_path):
    """Finding 3: one 1 GiB frame took a pserver from 33 to 1,016 MiB (here 256 MiB, in a real process)."""
    port = free_port()
    env = {**os.environ, "TRAINING_ROLE": "PSERVER", "PADDLE_PSERVERS_IP_PORT_LIST": f"127.0.0.1:{port}",
           "PADDLE_CURRENT_ENDPOINT": f"127.0.0.1:{port}", "PADDLE_TRAINERS_NUM": "1",
           "CLUSTERCTL_JOB_TOKEN": TOKEN, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "clusterctl.ps", "server"], env=env, stderr=subprocess.PIPE)
    try:
        ep = f"127.0.0.1:{port}"
        deadline = time.monotonic() + 20
        while raw_request(ep, {"op": "ping"}, key=job_key(TOKEN), timeout=0.5) is None:
            assert time.monotonic() < deadline and proc.poll() is None, "pserver did not start"
        before = _rss_mb(proc.pid)
        ctx = zmq.Context.instance()
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.SNDTIMEO, 10000)
        s.connect("tcp://" + ep)
        try:
            s.send_multipart([b"{}", np.zeros(256 << 20, np.uint8)], copy=False)
            time.sleep(2)
        except zmq.Again:
            pass
        finally:
            s.close()
        assert raw_request(ep, {"op": "ping"}, key=job_key(TOKEN))["ok"] is True  # still serving
        assert _rss_mb(proc.pid) - before < 64, (before, _rss_mb(proc.pid))
    finally:
        proc.terminate()
        proc.wait(10)
