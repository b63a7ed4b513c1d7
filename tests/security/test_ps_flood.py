"""A pserver job under a connection flood (issue 21, item 3), on loopback, every part real.

2 pservers and 3 trainers (examples/fit_a_line, sync mode, as local processes with the plan's
environment and a job token) start and run while an attacker without the token floods pserver 0 with
2,000 idle connections, 100 MB of garbage and handshakes that announce a 4 MiB command (what makes
libzmq allocate the most before a peer is authenticated), from 127.0.0.1 (the trainers' own address)
and from 127.0.0.2-9. The job must finish with the right result; pserver 0's memory must stay within
what its door allows to wait (``MAX_PENDING`` connections, each holding at most one frame of
``MAX_WIRE_FRAME_BYTES``), and it must not spin once the flood is over.
"""

from __future__ import annotations

import json
import os
import re
import socket
import struct
import sys
import threading
import time
from pathlib import Path

import pytest
import zmq

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "ps"))

from ps_jobs import TOKEN, LocalJob  # noqa: E402 (tests/ps on the path first)

from clusterctl.ps import ParameterServer  # noqa: E402
from clusterctl.ps.auth import Credentials, secure_client  # noqa: E402
from clusterctl.ps.protocol import MAX_WIRE_FRAME_BYTES  # noqa: E402

FIT = "examples/fit_a_line/train.py"
DONE = re.compile(r"^done steps=180 loss=([0-9.]+) .* trainer=(\d) mode=sync$", re.M)
SOURCES = [f"127.0.0.{i}" for i in range(1, 10)]
IDLE, GARBAGE_BYTES = 2000, 100 * 10**6
# A ZMTP 3.0 greeting that asks for CURVE, then a command frame announcing 4 MiB (flags: command, long size).
BIG_HELLO = (b"\xff" + b"\0" * 8 + b"\x7f" + b"\x03\x00" + b"CURVE".ljust(20, b"\0") + b"\0" + b"\0" * 31
             + b"\x06" + struct.pack(">Q", 4 << 20))


def _status(pid: int, key: str) -> float:
    """A ``VmRSS``/``VmHWM`` line of /proc/PID/status, in MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no {key} for {pid}")


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid``."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Flood:
    """The attacker: threads that open idle connections, pour garbage and start oversized handshakes."""

    def __init__(self, endpoint: str):
        host, port = endpoint.rsplit(":", 1)
        self.target = (host, int(port))
        self.idle: list[socket.socket] = []
        self.counts = {"idle": 0, "garbage_bytes": 0, "big_hellos": 0, "connect_errors": 0}
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._idle, args=(i,), daemon=True) for i in range(4)]
        self.threads += [threading.Thread(target=self._garbage, args=(i,), daemon=True) for i in range(4)]
        self.threads += [threading.Thread(target=self._big_hello, args=(i,), daemon=True) for i in range(4)]

    def start(self) -> Flood:
        for t in self.threads:
            t.start()
        return self

    def _connect(self, source: str) -> socket.socket | None:
        try:
            return socket.create_connection(self.target, timeout=3, source_address=(source, 0))
        except OSError:
            with self.lock:
                self.counts["connect_errors"] += 1
            return None

    def _idle(self, k: int) -> None:
        n = 0
        while not self.stop.is_set() and self.counts["idle"] < IDLE:
            s = self._connect(SOURCES[(k + 4 * n) % len(SOURCES)])
            n += 1
            if s is not None:
                with self.lock:
                    self.idle.append(s)  # kept open, silent, until the end
                    self.counts["idle"] += 1

    def _garbage(self, k: int) -> None:
        chunk = os.urandom(1 << 20)
        n = 0
        while not self.stop.is_set() and self.counts["garbage_bytes"] < GARBAGE_BYTES:
            s = self._connect(SOURCES[(k + 4 * n) % len(SOURCES)])
            n += 1
            if s is None:
                continue
            with s:
                try:
                    while self.counts["garbage_bytes"] < GARBAGE_BYTES:
                        s.sendall(chunk)
                        with self.lock:
                            self.counts["garbage_bytes"] += len(chunk)
                except OSError:  # dropped by the pserver (what is in flight counts: it arrived)
                    pass

    def _big_hello(self, k: int) -> None:
        body = os.urandom(4 << 20)
        n = 0
        while not self.stop.is_set():
            s = self._connect(SOURCES[1 + (k + 4 * n) % 8])  # from 127.0.0.2-9
            n += 1
            if s is None:
                continue
            with s:
                try:
                    s.sendall(BIG_HELLO + body)
                    with self.lock:
                        self.counts["big_hellos"] += 1
                    s.settimeout(10)
                    while s.recv(65536):  # hold the connection until the pserver drops it
                        pass
                except OSError:
                    pass

    def done(self) -> bool:
        return self.counts["idle"] >= IDLE and self.counts["garbage_bytes"] >= GARBAGE_BYTES

    def close(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(15)
        for s in self.idle:
            s.close()


def _ping(endpoint: str) -> dict | None:
    """An authenticated ping to a pserver (a fresh connection, as a new trainer would make); None if no answer."""
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    secure_client(s, Credentials.from_token(TOKEN))
    s.connect("tcp://" + endpoint)
    try:
        s.send_multipart([json.dumps({"v": 1, "op": "ping", "seq": 1}).encode()])
        return json.loads(s.recv_multipart()[0]) if s.poll(10000) else None
    finally:
        s.close()


@pytest.mark.timeout(240)
def test_a_job_finishes_while_its_pserver_is_flooded():
    job = LocalJob([FIT], extra_env={"CLUSTERCTL_PS_MODE": "sync", "CLUSTERCTL_PS_BARRIER_TIMEOUT": "120"},
                   trainer_argv=["--step-delay", "0.1"])  # >= 18 s of training: longer than the flood
    job.start()
    flood = None
    try:
        ep = job.pserver_eps[0]
        pid = job.procs["pserver0"].pid
        deadline = time.monotonic() + 60
        while _ping(ep) is None:
            assert time.monotonic() < deadline and job.procs["pserver0"].poll() is None, "pserver 0 did not start"
        rss0, cpu0, t0 = _status(pid, "VmRSS"), _cpu_s(pid), time.monotonic()
        flood = Flood(ep).start()
        peak, during = rss0, []
        while not flood.done() and job.procs["pserver0"].poll() is None:
            peak = max(peak, _status(pid, "VmRSS"))
            t_ping = time.monotonic()
            reply = _ping(ep)  # a newcomer with the token gets in, flood or not
            assert reply is not None and reply["ok"], (f"no answer to a ping in {time.monotonic() - t_ping:.1f}s, "
                                                       f"{t_ping - t0:.1f}s into the flood: {flood.counts}, last door "
                                                       f"{during[-1] if during else None}")
            during.append(reply["door"])
            assert time.monotonic() - t0 < 150, f"flood not done: {flood.counts}"
            time.sleep(0.05)  # sampling pace
        flood_s = time.monotonic() - t0
        cpu_flood = _cpu_s(pid) - cpu0
        print(f"flood {flood.counts} in {flood_s:.1f}s; pserver 0: RSS {rss0:.0f} -> peak {peak:.0f} MiB "
              f"(HWM {_status(pid, 'VmHWM'):.0f}), CPU {cpu_flood:.2f}s; door {during[-1] if during else None}")
        flood.close()
        if job.procs["pserver0"].poll() is None:  # the attacker stopped: no spinning afterwards
            wait = time.monotonic() + 30
            while (reply := _ping(ep)) is not None and reply["door"]["pending"]:
                assert time.monotonic() < wait, reply["door"]
            assert reply is not None, "pserver 0 stopped answering after the flood"
            cpu1, t1 = _cpu_s(pid), time.monotonic()
            time.sleep(1.0)  # measuring a rate: CPU seconds over one wall second of the job's own traffic
            rate = (_cpu_s(pid) - cpu1) / (time.monotonic() - t1)
            print(f"after the flood: {rate:.2f} CPU s/s; door {reply and reply['door']}")
            assert rate < 0.5, f"pserver 0 used {rate:.2f} CPU s/s after the flood"
            during.append(reply["door"])  # the door's final counts: every flood connection seen and gone
        else:
            pytest.fail("the job ended before the flood did: nothing was measured after it")
        res = job.wait(180)
    finally:
        if flood is not None:
            flood.close()
        job.kill()
    for name, (rc, out) in res.items():
        assert rc == 0, f"{name} exited {rc}:\n{out[-3000:]}"
    losses = {int(m[2]): float(m[1]) for m in DONE.finditer("".join(res[f"trainer{t}"][1] for t in range(3)))}
    assert sorted(losses) == [0, 1, 2] and all(v < 10.0 for v in losses.values()), losses
    assert flood.counts["idle"] >= IDLE and flood.counts["garbage_bytes"] >= GARBAGE_BYTES, flood.counts
    door = during[-1]
    assert door["evicted"] > 0 and door["accept_failures"] == 0 and door["door_errors"] == 0, door
    assert door["accepted"] - door["authenticated"] >= IDLE, door
    bound = ParameterServer.MAX_PENDING * MAX_WIRE_FRAME_BYTES / 2**20 + 64
    assert peak - rss0 < bound, f"RSS {rss0:.0f} -> {peak:.0f} MiB (bound {bound:.0f} MiB above the start)"
    assert cpu_flood < flood_s, f"pserver 0 used {cpu_flood:.1f} CPU s in a {flood_s:.1f} s flood"
    out = res["pserver0"][1]
    assert "Traceback" not in out and "all 3 trainer(s) completed; pserver 0 exiting" in out
