"""Stdio forwarding through kept OpenSSH connections (clusterctl.transport.muxfwd) against stand-in masters on
real Unix sockets (descriptors really passed): each host's answer, the first line checked before anything is
kept, refusals, silence, garbage and many hosts at once. The real master and sshd are exercised in
tests/integration/test_control_socket.py."""

from __future__ import annotations

import os
import socket
import struct
import threading
import time

import pytest
from test_transport_mux import _packet, _send

from clusterctl.transport import mux, muxfwd
from clusterctl.transport.muxfwd import MUX_C_NEW_STDIO_FWD, Forward, ask_many

SERVER = "5e" * 32
CLIENT = "c1" * 32


def _string(at: int, data: bytes) -> tuple[bytes, int]:
    n = struct.unpack(">I", data[at:at + 4])[0]
    return data[at + 4:at + 4 + n], at + 4 + n


class FwdMaster:
    """Serves stdio-forwarding requests the way an OpenSSH master does, with the service on the other side of the
    channel played here too, or misbehaves as told (`mode`): ok, refuse, version, wrong (another first line),
    silent (the channel opens, nothing comes back), huge (a body over the limit), stall (the first line, then
    nothing), early (closed before a whole first line), mute (the service closes without a word), gone (the
    master goes away before it answers)."""

    def __init__(self, path: str, mode: str = "ok", body: bytes = b'{"ok": true}\n'):
        self.path, self.mode, self.body = path, mode, body
        self.server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.server.bind(path)
        self.server.listen(8)
        self.seen: dict = {}
        self.done = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    def close(self) -> None:
        self.done.set()
        self.server.close()

    def _serve(self) -> None:
        try:
            conn, _ = self.server.accept()
        except OSError:
            return
        try:
            self._answer(conn)
        except OSError:  # the client went away first (one that had what it needed: ask_many's `stop`), as from a master
            pass

    def _answer(self, conn) -> None:
        with conn:
            _send(conn, mux.MUX_MSG_HELLO, 3 if self.mode == "version" else mux.PROTOCOL_VERSION)
            self.seen["hello"] = struct.unpack(">II", _packet(conn))
            if self.mode == "version":
                return
            request = _packet(conn)
            kind, rid = struct.unpack(">II", request[:8])
            _, at = _string(8, request)
            host, at = _string(at, request)
            port = struct.unpack(">I", request[at:at + 4])[0]
            self.seen["forward"] = (kind, rid, host, port)
            fds = []
            for _ in range(2):
                _, got, _, _ = socket.recv_fds(conn, 1, 1)
                fds += got
            if self.mode == "gone":  # the master ends (its connection died) before it answers
                for fd in fds:
                    os.close(fd)
                return
            if self.mode == "reset":  # as OpenSSH's master may: the channel's descriptors closed (our request unread
                for fd in fds:  # in them: the client's read says ECONNRESET) before the refusal is sent
                    os.close(fd)
                time.sleep(0.2)
                _send(conn, mux.MUX_S_FAILURE, rid, tail=struct.pack(">I", 8) + b"refused!")
                return
            if self.mode == "refuse":
                _send(conn, mux.MUX_S_FAILURE, rid, tail=struct.pack(">I", 8) + b"refused!")
                for fd in fds:
                    os.close(fd)
                return
            _send(conn, mux.MUX_S_SESSION_OPENED, rid, 3)
            chan = socket.socket(fileno=os.dup(fds[0]))
            for fd in fds:
                os.close(fd)
            with chan:
                line = b""
                while not line.endswith(b"\n"):
                    chunk = chan.recv(1)
                    if not chunk:
                        break
                    line += chunk
                self.seen["request"] = line
                if self.mode == "mute":  # a service that closes without a word (a wrong client secret)
                    return
                if self.mode == "silent":
                    self.done.wait(10)
                    return
                if self.mode == "early":
                    chan.sendall(b"ok 5e5e")
                    return
                header = f"ok {'00' * 32 if self.mode == 'wrong' else SERVER}\n".encode()
                chan.sendall(header)
                if self.mode == "stall":
                    self.done.wait(10)
                    return
                try:
                    chan.sendall(b"x" * (2 << 20) if self.mode == "huge" else self.body)
                except OSError:  # the client had enough (huge)
                    pass


@pytest.fixture
def masters(tmp_path):
    made: list[FwdMaster] = []

    def make(name: str, mode: str = "ok", **kw) -> FwdMaster:
        m = FwdMaster(str(tmp_path / name), mode, **kw)
        made.append(m)
        return m

    yield make
    for m in made:
        m.close()


def _fwd(master: FwdMaster, port: int = 4242) -> Forward:
    return Forward(master.path, port, f"{CLIENT} status\n".encode(), f"ok {SERVER}".encode())


def test_a_host_is_asked_through_its_master_and_its_body_kept_after_the_first_line(masters):
    m = masters("a", body=b'{"state": "running"}\n')
    out = ask_many({"a": _fwd(m, 40001)}, header_timeout=5, timeout=10)
    assert out["a"].kind == "ok" and out["a"].body == b'{"state": "running"}\n'
    assert m.seen["hello"] == (mux.MUX_MSG_HELLO, mux.PROTOCOL_VERSION)
    assert m.seen["forward"] == (MUX_C_NEW_STDIO_FWD, 1, b"127.0.0.1", 40001)  # the host's loopback, that port
    assert m.seen["request"] == f"{CLIENT} status\n".encode()


@pytest.mark.parametrize("mode, kind", [("refuse", "refused"), ("reset", "refused"), ("mute", "refused"), ("version", "unreachable"),
                                        ("gone", "unreachable"), ("wrong", "bad"), ("huge", "big"), ("early", "bad")])
def test_a_host_that_does_not_answer_as_the_service_would_is_not_ok(masters, mode, kind):
    m = masters("m", mode)
    out = ask_many({"m": _fwd(m)}, header_timeout=5, timeout=10, max_body=1 << 20)
    assert out["m"] == type(out["m"])(kind)  # and nothing of what it said is kept


def test_no_master_is_unreachable_at_once(tmp_path):
    t0 = time.monotonic()
    out = ask_many({"x": Forward(str(tmp_path / "none"), 1, b"r\n", b"ok s")}, header_timeout=5, timeout=10)
    assert out["x"].kind == "unreachable" and time.monotonic() - t0 < 1


def test_silence_ends_at_the_header_timeout_and_a_stalled_body_at_the_deadline(masters):
    silent, stall = masters("s", "silent"), masters("t", "stall")
    t0 = time.monotonic()
    out = ask_many({"s": _fwd(silent)}, header_timeout=0.5, timeout=10)
    assert out["s"].kind == "timeout" and 0.45 < time.monotonic() - t0 < 3
    t0 = time.monotonic()
    out = ask_many({"t": _fwd(stall)}, header_timeout=0.5, timeout=1.5)
    assert out["t"].kind == "timeout" and 1.4 < time.monotonic() - t0 < 4  # the first line came: the deadline holds


def test_many_hosts_are_asked_at_once_and_a_silent_one_holds_up_no_other(masters):
    ok = {f"h{i}": masters(f"h{i}", body=b"%d\n" % i) for i in range(24)}
    silent = masters("quiet", "silent")
    t0 = time.monotonic()
    out = ask_many({**{k: _fwd(m) for k, m in ok.items()}, "quiet": _fwd(silent)}, header_timeout=1.0, timeout=10)
    took = time.monotonic() - t0
    assert {k: o.body for k, o in out.items() if o.kind == "ok"} == {f"h{i}": b"%d\n" % i for i in range(24)}
    assert out["quiet"].kind == "timeout" and took < 3  # one header timeout for all, not one per host


def test_a_master_that_accepts_nothing_is_given_up_after_the_connect_timeout(tmp_path, monkeypatch):
    monkeypatch.setattr(muxfwd, "CONNECT_TIMEOUT", 0.3)
    path = str(tmp_path / "hung")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as server, \
            socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as filler:
        server.bind(path)
        server.listen(0)  # a hung master: it accepts nothing, and its backlog is full
        filler.connect(path)
        t0 = time.monotonic()
        out = ask_many({"h": Forward(path, 1, b"r\n", b"ok s")}, header_timeout=5, timeout=10)
        assert out["h"].kind == "unreachable" and time.monotonic() - t0 < 2


def test_each_answer_is_passed_on_as_it_comes_and_the_rest_cut_once_the_caller_has_enough(masters):
    """`on_ok` hears each answer when it is whole; once `stop()` is true the hosts still asked are `cut` at once,
    not held to their header timeout (an elastic job's status: the host it lost need not be waited for)."""
    ok = {f"h{i}": masters(f"h{i}", body=b"%d\n" % i) for i in range(3)}
    silent = masters("quiet", "silent")
    heard = {}
    t0 = time.monotonic()
    out = ask_many({**{k: _fwd(m) for k, m in ok.items()}, "quiet": _fwd(silent)}, header_timeout=30, timeout=60,
                   on_ok=heard.__setitem__, stop=lambda: len(heard) == 3)
    assert heard == {f"h{i}": b"%d\n" % i for i in range(3)}
    assert out["quiet"].kind == "cut" and time.monotonic() - t0 < 10
