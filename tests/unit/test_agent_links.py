"""The coordinator and peer links (clusterctl/host/coordinator.py, peer.py) over real loopback sockets, in this
process, on a clock the test moves: authentication both ways, messages, heartbeats and silence, the listener's
flood limits (evict the oldest, per source, auth deadline, garbage, accept errors) and a peer that retries
after a refusal. No supervisor processes: the handlers record what the links tell them."""

from __future__ import annotations

import errno
import json
import select
import socket
import time

import pytest

from clusterctl.host import protocol
from clusterctl.host.coordinator import ACCEPT_PAUSE, CoordinatorLink
from clusterctl.host.loop import EventLoop
from clusterctl.host.peer import JOIN_BACKOFF_MAX, PeerLink
from clusterctl.host.policy import Timings
from clusterctl.host.protocol import AUTH_TIMEOUT, Msg
from helpers import free_port

TOKEN = "70ce" * 16
JOB = "job-links"
T = Timings(connect_timeout=30.0, heartbeat=1.0, peer_timeout=5.0, reconnect_timeout=3.0)
WAIT = 10.0  # seconds of real time a loopback exchange may take on a loaded machine (returns as soon as done)


class Clock:
    """The links' clock: moved by the test."""

    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


class CoordHandler:
    def __init__(self):
        self.joined, self.messages, self.left = [], [], []

    def peer_joined(self, host, addr, hello):
        self.joined.append((host, hello))

    def peer_message(self, host, msg):
        self.messages.append((host, msg))

    def peer_left(self, host, why):
        self.left.append((host, why))


class PeerHandler:
    def __init__(self):
        self.welcomed, self.messages, self.lost = 0, [], []

    def hello_fields(self):
        return {"exits": [], "stopping": None, "attempt": 0, "idle": False, "failed": None}

    def coordinator_welcomed(self):
        self.welcomed += 1

    def coordinator_message(self, msg):
        self.messages.append(msg)

    def coordinator_lost(self, why):
        self.lost.append(why)


class Logs(list):
    def __call__(self, kind, msg, now=None):
        self.append((kind, msg))


def pump(loop, until, timeout=WAIT):
    """Run the loop until `until()` holds (real time: at most `timeout`); return whether it did."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if until():
            return True
        loop.poll(0.01)
    return until()


@pytest.fixture
def net():
    loop, clock = EventLoop(), Clock()
    made = []

    def coordinator(port=None, **kw):
        handler, logs = CoordHandler(), Logs()
        link = CoordinatorLink(loop, JOB, "127.0.0.1", port or free_port(), TOKEN, T, handler, logs, clock, **kw)
        assert link.listen() is None
        made.append(link)
        return link, handler, logs

    def peer(port, host="hB", token=TOKEN):
        handler, logs = PeerHandler(), Logs()
        link = PeerLink(loop, JOB, host, "127.0.0.1", port, token, T, handler, logs, clock)
        made.append(link)
        return link, handler, logs

    yield loop, clock, coordinator, peer
    for link in made:
        link.close()
    loop.close()


def raw(port, source="127.0.0.1"):
    """A client socket from `source` (any 127.x.y.z address is this machine)."""
    s = socket.socket()
    s.bind((source, 0))
    s.settimeout(WAIT)
    s.connect(("127.0.0.1", port))
    return s


def test_peer_and_coordinator_prove_the_token_to_each_other_and_talk(net):
    loop, clock, coordinator, peer = net
    coord, ch, _ = coordinator()
    link, ph, _ = peer(coord.port)
    link.tick(clock())
    assert pump(loop, lambda: link.connected and ch.joined)
    (host, hello), = ch.joined
    assert host == "hB" and hello["type"] == Msg.HELLO and hello["attempt"] == 0 and ph.welcomed == 1
    assert coord.connected() == {"hB"} and coord.stats()["pending_connections"] == 0
    coord.send("hB", protocol.stop("failed", "trainer.0 on hA exited with code 1", None, 0, True))
    link.send(protocol.exit_event("trainer", 1, 3, None, "hB", 0))
    assert pump(loop, lambda: ph.messages and ch.messages)
    assert ph.messages == [protocol.stop("failed", "trainer.0 on hA exited with code 1", None, 0, True)]
    assert ch.messages == [("hB", protocol.exit_event("trainer", 1, 3, None, "hB", 0))]
    # a malformed message from an authenticated peer is logged and ignored; the peer stays
    link.conn.sock.sendall(b'{"type": "exit", "role": "trainer", "id": [1], "code": {}}\n{"type": "what"}\n')
    link.send(protocol.done("hB", 0))
    assert pump(loop, lambda: len(ch.messages) == 2)
    assert ch.messages[1] == ("hB", protocol.done("hB", 0)) and coord.connected() == {"hB"}


def test_heartbeats_keep_both_sides_and_silence_drops_them(net):
    loop, clock, coordinator, peer = net
    coord, ch, _ = coordinator()
    link, ph, _ = peer(coord.port)
    link.tick(clock())
    assert pump(loop, lambda: link.connected and ch.joined)
    for _ in range(8):  # 8 s of heartbeats: both sides ping, nobody is dropped
        clock.t += T.heartbeat
        coord.tick(clock())
        link.tick(clock())
        assert pump(loop, lambda: link.conn.last_rx == clock.t and coord.peers["hB"].last_rx == clock.t)
    assert ch.left == [] and ph.lost == []
    clock.t += T.peer_timeout + 0.1  # the peer says nothing any more
    link.conn.last_tx = clock.t
    coord.tick(clock())
    assert ch.left == [("hB", "no heartbeat for 5.1s")] and coord.connected() == set()
    assert pump(loop, lambda: ph.lost == ["connection closed by coordinator"])
    assert link.lost_since == clock.t and link.why() == "connection closed by coordinator"


def test_idle_connections_never_keep_a_peer_out(net):
    """40 idle sockets used to hold the 32 slots (the newest was dropped): now the oldest goes."""
    loop, clock, coordinator, peer = net
    coord, ch, logs = coordinator(max_pending=8, max_per_source=4)
    idle = [raw(coord.port, "127.0.0.%d" % (2 + i % 5)) for i in range(40)]  # 5 sources, 8 each
    assert pump(loop, lambda: coord.counts["rejected"] == 40 - 8)
    assert len(coord.pending) == 8 and max(coord.by_source.values()) <= 4
    first = idle[0]  # the oldest was evicted: it got its challenge, then EOF
    line = first.makefile("rb").readline()
    assert json.loads(line)["type"] == "challenge" and first.recv(1) == b""
    link, ph, _ = peer(coord.port)
    link.tick(clock())
    assert pump(loop, lambda: link.connected and ch.joined)  # the newest (the peer's) stays until it proves itself
    assert coord.counts["evicted"] >= 32 and ("overload" in {k for k, _ in logs})
    for s in idle:
        s.close()


def test_the_oldest_is_read_before_it_is_evicted_so_a_waiting_hello_gets_in(net):
    loop, clock, coordinator, peer = net
    coord, ch, _ = coordinator(max_pending=8, max_per_source=2)
    a = raw(coord.port)
    assert pump(loop, lambda: len(coord.pending) == 1)
    nc = json.loads(a.makefile("rb").readline())["nonce"]
    np_ = "ef" * 32
    proof = protocol.auth_proof(TOKEN, "peer", JOB, "hLate", nc, np_)
    a.sendall(json.dumps(protocol.hello(JOB, "hLate", np_, proof)).encode() + b"\n")
    (conn,) = coord.pending.values()
    assert select.select([conn.sock], [], [], WAIT)[0]  # its hello is there, not read yet
    flood = [raw(coord.port) for _ in range(3)]  # same source: over its limit of 2
    coord._on_accept(coord.listener)  # accept them before anything else is read
    assert [h for h, _ in ch.joined] == ["hLate"] and coord.counts["evicted"] == 1  # a flooder, not hLate
    assert coord.connected() == {"hLate"} and len(coord.pending) == 2
    for s in flood + [a]:
        s.close()


def test_one_source_evicts_only_its_own_oldest(net):
    loop, clock, coordinator, peer = net
    coord, ch, _ = coordinator(max_pending=16, max_per_source=3)
    other = raw(coord.port, "127.0.0.9")
    flood = [raw(coord.port, "127.0.0.10") for _ in range(10)]
    assert pump(loop, lambda: len(coord.pending) == 4)
    assert sorted(c.source for c in coord.pending.values()) == ["127.0.0.10"] * 3 + ["127.0.0.9"]
    for s in flood + [other]:
        s.close()


def test_a_connection_must_authenticate_within_the_deadline(net):
    loop, clock, coordinator, peer = net
    coord, ch, logs = coordinator()
    s = raw(coord.port)
    s.sendall(b'{"type": "hello"')  # half a line, then nothing (a slow loris)
    assert pump(loop, lambda: len(coord.pending) == 1 and next(iter(coord.pending.values())).reader.buf)
    clock.t += AUTH_TIMEOUT - 0.1
    coord.tick(clock())
    assert len(coord.pending) == 1
    clock.t += 0.2
    coord.tick(clock())
    assert len(coord.pending) == 0 and coord.counts["rejected"] == 1
    assert ("rejected", "rejected connection from %s: no hello within 3s" % ("127.0.0.1:%d" % s.getsockname()[1])) in logs
    s.close()


@pytest.mark.parametrize("payload, reply, counter", [
    (b"\n", b"", "garbage"),  # a blank line is garbage
    (b"\n" * 100000, b"", "garbage"),
    (b"GET / HTTP/1.0\r\n\r\n", b"", "garbage"),
    (b"[1, 2, 3]\n", b"", "garbage"),
    (b'{"a":' + b"[" * 3000 + b"]" * 3000 + b"}\n", b"", "garbage"),
    (b"{" + b"x" * (protocol.MAX_MESSAGE + 10), b"", "garbage"),  # too long, no newline needed
    (b'{"type": "ping"}\n', b'{"error": "expected hello", "type": "error", "version": 2}\n', "rejected"),
    (b'{"type": "hello", "version": 1}\n', b'{"error": "protocol version mismatch: coordinator speaks 2, peer sent 1", '
                                          b'"type": "error", "version": 2}\n', "rejected"),
    (b'{"type": "hello", "version": 2, "job": "j", "host": "h", "nonce": 5, "proof": ["x"]}\n',
     b'{"error": "malformed hello", "type": "error", "version": 2}\n', "rejected"),
    (json.dumps({"type": "hello", "version": 2, "job": JOB, "host": "evil", "nonce": "ab" * 32,
                 "proof": "0" * 64}).encode() + b"\n", b'{"error": "bad token", "type": "error", "version": 2}\n',
     "rejected"),
])
def test_garbage_and_refusals_drop_the_connection(net, payload, reply, counter):
    loop, clock, coordinator, peer = net
    coord, ch, logs = coordinator()
    s = raw(coord.port)
    f = s.makefile("rb")
    assert pump(loop, lambda: len(coord.pending) == 1)
    assert json.loads(f.readline())["type"] == "challenge"
    try:
        s.sendall(payload)
    except OSError:
        pass  # dropped before it all arrived
    assert pump(loop, lambda: coord.counts["rejected"] == 1)
    try:
        got = f.read()
    except OSError:
        got = b""
    assert got == reply and coord.counts["garbage"] == (1 if counter == "garbage" else 0)
    assert ch.joined == [] and coord.pending == {}
    s.close()


class FailingListener:
    """A listener whose accept() fails like a process out of file descriptors."""

    def __init__(self, err):
        self.err, self.calls = err, 0

    def accept(self):
        self.calls += 1
        raise OSError(self.err, "simulated")


def test_accept_errors_evict_the_oldest_or_pause_accepting_and_never_crash(net):
    loop, clock, coordinator, peer = net
    coord, ch, logs = coordinator()
    listener = coord.listener
    s1, s2 = raw(coord.port), raw(coord.port)
    assert pump(loop, lambda: len(coord.pending) == 2)
    # no descriptor left: the oldest pending one makes room; still none: stop accepting for a moment
    coord._on_accept(FailingListener(errno.EMFILE))
    assert len(coord.pending) == 1 and coord.counts["evicted"] == 1
    assert coord.accept_paused_until == clock.t + ACCEPT_PAUSE
    clock.t += ACCEPT_PAUSE
    coord.tick(clock())
    for err in (errno.ENFILE, errno.EMFILE):
        coord._drop_pending(next(iter(coord.pending.values())), "test") if coord.pending else None
        coord._on_accept(FailingListener(err))
        assert coord.accept_paused_until == clock.t + ACCEPT_PAUSE
        assert listener not in [k.fileobj for k in loop.sel.get_map().values()]
        clock.t += ACCEPT_PAUSE
        coord.tick(clock())
        assert coord.accept_paused_until is None and loop.sel.get_key(listener)
    fl = FailingListener(errno.ECONNABORTED)  # one aborted connection: the next accept goes on
    coord._on_accept(fl)
    assert fl.calls > 1 and coord.accept_paused_until is None
    assert coord.counts["accept_errors"] == 4 + fl.calls
    link, ph, _ = peer(coord.port)  # and the listener still serves
    link.tick(clock())
    assert pump(loop, lambda: link.connected)
    s1.close()
    s2.close()


def _fake_coordinator(port):
    srv = socket.create_server(("127.0.0.1", port))
    srv.settimeout(WAIT)
    return srv


def test_a_peer_retries_after_a_refusal_until_a_coordinator_welcomes_it(net):
    loop, clock, coordinator, peer = net
    port = free_port()
    srv = _fake_coordinator(port)
    link, ph, logs = peer(port)
    answers = [b'{"type": "error", "error": "bad token", "version": 2}\n',
               b'{"type": "welcome", "job": "x", "proof": "' + b"0" * 64 + b'"}\n',  # an impostor
               None]  # an older coordinator: challenge version 1
    expect = ["coordinator rejected this host: bad token", "coordinator did not prove the job token",
              "protocol version mismatch: this host's agent speaks 2, coordinator 127.0.0.1:%d sent 1 "
              "(upload the same agent to every host)" % port]
    for answer, why in zip(answers, expect):
        link.tick(clock())
        conn, _ = srv.accept()
        conn.settimeout(WAIT)
        assert pump(loop, lambda: link.conn is not None)
        version = 1 if answer is None else 2
        conn.sendall(json.dumps({"type": "challenge", "version": version, "nonce": "cd" * 32}).encode() + b"\n")
        if answer is not None:
            assert pump(loop, lambda: link.conn is not None and link.conn.their_nonce)
            hello = json.loads(conn.makefile("rb").readline())
            assert hello["type"] == "hello" and TOKEN not in json.dumps(hello)
            conn.sendall(answer)
        assert pump(loop, lambda: link.conn is None)
        conn.close()
        assert link.last_error == why and link.why() == link.rejection  # a refusal says more than a later error
        assert not link.ever_connected and ph.lost == []  # never welcomed: nothing was lost
        clock.t = link.next_try  # the back-off (jittered, at most JOIN_BACKOFF_MAX until the first welcome)
    assert link.backoff == min(protocol.BACKOFF_MIN * 2 ** 3, JOIN_BACKOFF_MAX) and link.tries == 3 and link.rejection == expect[2]
    srv.close()
    coord, ch, _ = coordinator(port)  # the real one comes up: the next try gets in
    link.tick(clock())
    assert pump(loop, lambda: link.connected and ch.joined)
    assert link.rejection is None and link.backoff == protocol.BACKOFF_MIN


def test_a_peer_gives_up_on_a_silent_listener_and_a_closed_port(net):
    loop, clock, coordinator, peer = net
    port = free_port()
    srv = _fake_coordinator(port)
    link, ph, _ = peer(port)
    link.tick(clock())
    conn, _ = srv.accept()
    assert pump(loop, lambda: link.conn is not None)
    clock.t += AUTH_TIMEOUT + 0.1  # it accepted, and said nothing
    link.tick(clock())
    assert link.conn is None and link.last_error == "coordinator did not authenticate within 3s"
    conn.close()
    srv.close()
    clock.t = link.next_try
    link.tick(clock())  # nothing listens now
    assert pump(loop, lambda: link.connecting is None)
    assert link.last_error == "Connection refused" and link.why() == "Connection refused"


def test_a_welcomed_peer_notices_a_silent_coordinator(net):
    loop, clock, coordinator, peer = net
    coord, ch, _ = coordinator()
    link, ph, _ = peer(coord.port)
    link.tick(clock())
    assert pump(loop, lambda: link.connected)
    clock.t += T.peer_timeout + 0.5
    link.conn.last_tx = clock.t  # no ping due from this side
    link.tick(clock())
    assert ph.lost == ["no heartbeat for 5.5s"] and link.lost_since == clock.t and not link.connected
    assert link.why() == "no heartbeat for 5.5s" and link.ever_connected
