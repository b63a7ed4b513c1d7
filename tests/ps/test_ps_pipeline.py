"""Pipelined (chunk-level) async push_pull: same results as the one-message path, whole versions on pull."""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest
from ps_jobs import in_threads, pulls_during_pushes, raw_dealer

from clusterctl.ps import SGD, Adam, Momentum, PSClient, protocol

pytestmark = pytest.mark.timeout(30)


def _params(n: int = 5000) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(3)
    return {"w": rng.normal(size=(n // 10, 10)).astype(np.float32), "b": np.zeros(7, np.float32)}


def _grad(step: int, params: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(100 + step)
    return {k: rng.normal(size=v.shape).astype(v.dtype) for k, v in params.items()}


@pytest.mark.parametrize("opt", [SGD(0.1), Momentum(0.1, 0.9), Adam(0.01)], ids=["sgd", "momentum", "adam"])
def test_pipelined_push_pull_equals_push_then_pull_bit_for_bit(servers, monkeypatch, opt):
    monkeypatch.setattr(protocol, "CHUNK_BYTES", 1024)  # w: 20 KB -> 20 pieces; b packed with a w piece
    piped, plain = servers(2, num_trainers=1, mode="async"), servers(2, num_trainers=1, mode="async")
    with PSClient(piped.endpoints, trainer_id=0, num_trainers=1, mode="async", optimizer=opt, timeout=10) as a, \
            PSClient(plain.endpoints, trainer_id=0, num_trainers=1, mode="async", optimizer=opt, timeout=10) as b:
        pa, pb = a.init(_params()), b.init(_params())
        for step in range(4):
            pa = a.push_pull(_grad(step, pa), step=step)
            b.push(_grad(step, pb), step=step)  # one message per pserver, not pipelined
            pb = b.pull()
            for k in pa:
                np.testing.assert_array_equal(pa[k], pb[k])
            np.testing.assert_array_equal(a.pull()["w"], pa["w"])  # the pserver published what it replied
        a.complete()
        b.complete()
    assert piped.join(5) and plain.join(5) and not piped.errors and not plain.errors
    # the pipelined path really ran: many requests per step, yet one update per block and push
    assert sum(s.stats["requests"] for s in piped.servers) > 4 * 20
    assert [s.stats["updates"] for s in piped.servers] == [s.stats["updates"] for s in plain.servers]


def test_concurrent_pipelined_pushes_apply_every_piece_once(servers, monkeypatch):
    """Two trainers' pieces of the same block interleave; each gradient piece is applied exactly once."""
    monkeypatch.setattr(protocol, "CHUNK_BYTES", 4096)
    n, steps = 200_000, 15  # 800 KB: ~200 pieces per push
    g = servers(1, num_trainers=2, mode="async")

    def trainer(tid: int) -> None:
        with PSClient(g.endpoints, trainer_id=tid, num_trainers=2, mode="async", optimizer=SGD(1.0), timeout=20) as c:
            c.init({"w": np.zeros(n, np.float32)})
            ones = {"w": np.ones(n, np.float32)}
            for step in range(steps):
                c.push_pull(ones, step=step)
            c.complete()

    in_threads(trainer, (0, 1))
    assert g.join(5) and not g.errors
    w = g.servers[0].blocks["w.block0"]
    assert float(w.min()) == float(w.max()) == -2.0 * steps
    assert g.servers[0].stats["updates"] == 2 * steps


def test_pulls_see_whole_versions_during_pipelined_pushes(servers, monkeypatch):
    """A block is replaced only when all pieces of an update were applied: pulls never see half of one."""
    monkeypatch.setattr(protocol, "CHUNK_BYTES", 64 << 10)
    n = 3_000_000  # 12 MB: ~180 pieces per push
    g = servers(1, num_trainers=2, mode="async")
    seen, torn = pulls_during_pushes(g.endpoints, n, "push_pull")
    assert not torn, torn
    assert seen[-1] < seen[0] <= 0


def _raw(endpoint: str, header: dict, *buffers: bytes) -> dict:
    s = raw_dealer(endpoint)  # the job's keys: these requests are well authenticated, and malformed
    try:
        s.send_multipart([json.dumps({"v": 1, "seq": 1, "tid": 0, **header}).encode(), *buffers])
        assert s.poll(5000)
        return json.loads(s.recv_multipart()[0])
    finally:
        s.close()


@pytest.mark.parametrize(("mode", "fields", "code", "message"), [
    ("geo", {"off": [0]}, "bad_request", "needs sync or async mode"),
    ("sync", {"off": [0]}, "bad_request", "parts must be an integer above part (0), got None"),
    ("sync", {"off": [0], "part": 1, "parts": 1}, "bad_request", "parts must be an integer above part (1), got 1"),
    ("sync", {"off": [2], "parts": 2}, "shape_mismatch",
     "block 'b.block0': piece at 2 does not continue the trainer's previous piece (ends at 0)"),
    ("async", {"off": [0, 1]}, "bad_request", "one integer element offset per tensor"),
    ("async", {"off": ["0"]}, "bad_request", "one integer element offset per tensor"),
    ("async", {"off": [6]}, "shape_mismatch", "got float32[6:8], holds float32[7]"),
    ("async", {"off": [-1]}, "shape_mismatch", "got float32[-1:1]"),
    ("async", {"off": [0], "part": -1}, "bad_request", "part must be a non-negative integer"),
], ids=["geo", "sync-no-parts", "sync-part-past-parts", "sync-out-of-order", "off-count", "off-type", "past-end",
        "negative", "part"])
def test_malformed_pieces_are_rejected(servers, mode, fields, code, message):
    g = servers(1, num_trainers=1, mode=mode)
    with PSClient(g.endpoints, trainer_id=0, num_trainers=1, mode=mode, timeout=5) as c:
        c.init({"b": np.zeros(7, np.float32)})
        header = {"op": "push_pull", "step": 0, "pull": True, "part": 0, "t": [["b.block0", "float32", 2]], "c": 8,
                  **fields}
        reply = _raw(g.endpoints[0], header, np.ones(2, np.float32).tobytes())
        assert (reply["ok"], reply["code"]) == (False, code) and message in reply["error"], reply
        np.testing.assert_array_equal(c.pull()["b"], np.zeros(7, np.float32))  # nothing was applied
        c.complete()
    assert g.servers[0].stats["rejected"] == 1


def test_pulls_see_whole_versions_with_two_pipelined_pushers(servers, monkeypatch):
    """Other trainers' pieces of a block wait while one trainer's update of it is being built."""
    monkeypatch.setattr(protocol, "CHUNK_BYTES", 64 << 10)
    n = 1_000_000
    g = servers(1, num_trainers=3, mode="async")
    stop = threading.Event()
    torn: list[tuple[float, float]] = []
    pushes = {1: 0, 2: 0}

    def pusher(tid: int) -> None:
        with PSClient(g.endpoints, trainer_id=tid, num_trainers=3, mode="async", optimizer=SGD(1.0), timeout=20) as c:
            c.init({"w": np.zeros(n, np.float32)})
            ones = {"w": np.ones(n, np.float32)}
            while not stop.is_set():
                w = c.push_pull(ones)["w"]
                pushes[tid] += 1
                if w.min() != w.max():
                    torn.append((float(w.min()), float(w.max())))
            c.complete()

    with PSClient(g.endpoints, trainer_id=0, num_trainers=3, mode="async", optimizer=SGD(1.0), timeout=20) as c:
        c.init({"w": np.zeros(n, np.float32)})
        threads = [threading.Thread(target=pusher, args=(t,)) for t in (1, 2)]
        for t in threads:
            t.start()
        out = {"w": np.empty(n, np.float32)}
        for _ in range(20):
            w = c.pull(out=out)["w"]
            if w.min() != w.max():
                torn.append((float(w.min()), float(w.max())))
        stop.set()
        for t in threads:
            t.join(20)
        final = c.pull()["w"]
        c.complete()
    assert not torn, torn
    assert float(final[0]) == -float(pushes[1] + pushes[2]) and min(pushes.values()) > 0


def test_a_stalled_update_does_not_block_other_trainers(servers, monkeypatch, caplog):
    """A trainer that sent only part of a block's pieces (then died) holds the others for DEFER_TIMEOUT at most."""
    monkeypatch.setattr(protocol, "CHUNK_BYTES", 1024)
    g = servers(1, num_trainers=2, mode="async")
    monkeypatch.setattr(g.servers[0], "DEFER_TIMEOUT", 0.3)
    n = 1024  # 4 KiB: 4 pieces
    with PSClient(g.endpoints, trainer_id=1, num_trainers=2, mode="async", optimizer=SGD(1.0), timeout=10) as c:
        c.init({"w": np.zeros(n, np.float32)})
        header = {"op": "push_pull", "step": 0, "pull": True, "part": 0, "off": [0], "c": 1024,
                  "t": [["w.block0", "float32", 256]]}
        reply = _raw(g.endpoints[0], header, np.ones(256, np.float32).tobytes())  # trainer 0: 1 piece of 4
        assert reply["ok"] and reply["off"] == [0]
        w = c.push_pull({"w": np.ones(n, np.float32)})["w"]
        c.complete()
    np.testing.assert_array_equal(w[:256], -2.0)  # trainer 0's piece was kept, and applied once
    np.testing.assert_array_equal(w[256:], -1.0)
    assert "trainer 0's update of w.block0 stalled" in caplog.text


def test_pack_pieces_cuts_big_blocks_and_packs_small_ones():
    from clusterctl.ps.client import pack_pieces

    big, small, tiny = np.zeros(10, np.float32), np.zeros(3, np.float32), np.zeros(1, np.float64)
    msgs = pack_pieces({"big": big, "small": small, "tiny": tiny}, 16)  # 16 bytes = 4 float32
    assert [[(k, off, p.size) for k, off, p in m] for m in msgs] == [
        [("big", 0, 4)], [("big", 4, 4)], [("big", 8, 2)], [("small", 0, 3)], [("tiny", 0, 1)]]
    assert all(np.shares_memory(p, big) for m in msgs for k, _, p in m if k == "big")  # views, no copies
    assert [[k for k, _, _ in m] for m in pack_pieces({"a": small, "b": tiny}, 64)] == [["a", "b"]]


def test_sync_pipelined_parts_apply_their_blocks_and_refuse_repeats(servers):
    """Sync pieces from the wire: a repeated part is refused; blocks no part carried keep their value."""
    g = servers(1, num_trainers=1, mode="sync", barrier_timeout=10)
    with PSClient(g.endpoints, trainer_id=0, num_trainers=1, mode="sync", optimizer=SGD(0.5), timeout=5) as c:
        c.init({"a": np.zeros(7, np.float32), "b": np.zeros(5, np.float32)})
        head = {"op": "push_pull", "step": 0, "pull": True, "parts": 2, "c": 64}
        one = _raw(g.endpoints[0], {**head, "part": 0, "off": [0], "t": [["a.block0", "float32", 4]]},
                   np.ones(4, np.float32).tobytes())
        assert (one["ok"], one["part"], one["off"]) == (True, 0, [0])  # applied: a single trainer's round
        again = _raw(g.endpoints[0], {**head, "part": 0, "off": [4], "t": [["a.block0", "float32", 3]]},
                     np.ones(3, np.float32).tobytes())
        assert (again["ok"], again["code"], again["error"]) == (
            False, "duplicate", "trainer 0 pushed part 0 of 2 twice (or mixed push kinds) in round 0")
        assert g.servers[0].step == 0  # the round waits for part 1
        last = _raw(g.endpoints[0], {**head, "part": 1, "off": [4], "t": [["a.block0", "float32", 3]]},
                    np.full(3, 2, np.float32).tobytes())
        assert last["ok"] and last["step"] == 1
        assert g.servers[0].step == 1
        got = c.pull()
        np.testing.assert_array_equal(got["a"], np.array([-0.5] * 4 + [-1.0] * 3, np.float32))
        np.testing.assert_array_equal(got["b"], np.zeros(5, np.float32))  # no part carried b
        c.complete()
    assert g.servers[0].stats["updates"] == 1


@pytest.mark.parametrize(("raw", "requests"), [
    ("0", 1), ("false", 1), ("OFF", 1), ("no", 1),  # false, off and no pipelined all the same (only 0 did not)
    (None, 20), ("1", 20), ("true", 20), ("on", 20), ("Yes", 20),
])
def test_the_pipeline_switch_decides_how_a_push_pull_goes_out(servers, monkeypatch, raw, requests):
    """A trainer's CLUSTERCTL_PS_PIPELINE: one message per pserver, or one per piece (w: 20 KB in 1 KB chunks is
    20 pieces, b packed with the last one)."""
    monkeypatch.setattr(protocol, "CHUNK_BYTES", 1024)
    monkeypatch.delenv("CLUSTERCTL_PS_PIPELINE", raising=False)
    if raw is not None:
        monkeypatch.setenv("CLUSTERCTL_PS_PIPELINE", raw)
    g = servers(1, num_trainers=1, mode="async")
    with PSClient(g.endpoints, trainer_id=0, num_trainers=1, mode="async", optimizer=SGD(0.1), timeout=10) as c:
        params = c.init(_params())
        before = g.servers[0].stats["requests"]
        c.push_pull(_grad(0, params))
        assert g.servers[0].stats["requests"] - before == requests  # counted as received, before the replies
        c.complete()
    assert g.join(5) and not g.errors
