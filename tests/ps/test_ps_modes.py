"""Sync / async / geo semantics with in-process pservers (threads) on 127.0.0.1."""

from __future__ import annotations

import numpy as np
import pytest
from ps_jobs import in_threads, pulls_during_pushes

from clusterctl.ps import SGD, Adam, Momentum, PSClient, RemoteOpError, protocol

pytestmark = pytest.mark.timeout(30)

T = 3  # trainers
IN, OUT = 3000, 10  # W has 30000 elements: sliced into 2 blocks over 2 pservers


def _batch(tid: int, step: int, n: int = 4) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(1000 * step + tid)
    x = rng.normal(size=(n, IN)).astype(np.float32)
    y = rng.normal(size=(n, OUT)).astype(np.float32)
    return x, y


def _grads(params: dict[str, np.ndarray], x: np.ndarray, y: np.ndarray) -> dict[str, np.ndarray]:
    err = x @ params["W"] + params["b"] - y
    scale = np.float32(2.0 / len(x))
    return {"W": scale * (x.T @ err), "b": scale * err.sum(axis=0)}


def _init() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(5)
    return {"W": (rng.normal(size=(IN, OUT)) * 0.01).astype(np.float32), "b": np.zeros(OUT, np.float32)}


def _run_trainers(eps, mode, opt, steps, **kw):
    """Run T trainer threads; each returns its final params."""
    results: dict[int, dict[str, np.ndarray]] = {}

    def trainer(tid: int) -> None:
        with PSClient(eps, trainer_id=tid, num_trainers=T, mode=mode, optimizer=opt, timeout=20, **kw) as c:
            params = c.init(_init())
            for step in range(c.start_step, steps):
                params = c.push_pull(_grads(params, *_batch(tid, step)), step=step)
            c.complete()
            results[tid] = params

    in_threads(trainer, range(T))
    return results


def _reference(opt_kind: str, steps: int) -> dict[str, np.ndarray]:
    """Single process: each step, gradients of the T batches summed in trainer order, divided by T."""
    p = _init()
    lr = np.float32(0.01)
    vel = {k: np.zeros_like(v) for k, v in p.items()}
    m = {k: np.zeros_like(v) for k, v in p.items()}
    v2 = {k: np.zeros_like(v) for k, v in p.items()}
    for step in range(steps):
        gs = [_grads(p, *_batch(t, step)) for t in range(T)]
        for k in p:
            g = gs[0][k].copy()
            for other in gs[1:]:
                g += other[k]
            g /= np.float32(T)
            if opt_kind == "sgd":
                p[k] = p[k] - lr * g
            elif opt_kind == "momentum":
                vel[k] = np.float32(0.9) * vel[k] + g
                p[k] = p[k] - lr * vel[k]
            else:
                t = step + 1
                m[k] = np.float32(0.9) * m[k] + np.float32(0.1) * g
                v2[k] = np.float32(0.999) * v2[k] + np.float32(0.001) * g * g
                lr_t = 0.01 * np.sqrt(1 - 0.999 ** t) / (1 - 0.9 ** t)
                p[k] = p[k] - np.float32(lr_t) * m[k] / (np.sqrt(v2[k]) + np.float32(1e-8 * np.sqrt(1 - 0.999 ** t)))
    return p


@pytest.mark.parametrize("chunk", [None, 1024], ids=["one-frame-per-block", "chunked-1KiB"])
def test_sync_sgd_equals_single_process_on_the_union_exactly(servers, monkeypatch, chunk):
    if chunk:  # every block then travels as many frames, both ways; the result must not change
        monkeypatch.setattr(protocol, "CHUNK_BYTES", chunk)
    g = servers(2, num_trainers=T, mode="sync", barrier_timeout=20)
    got = _run_trainers(g.endpoints, "sync", SGD(0.01), steps=6)
    assert g.join(5) and not g.errors  # every pserver exited on its own after 3 completes
    ref = _reference("sgd", 6)
    for tid in range(T):
        for k in ref:
            np.testing.assert_array_equal(got[tid][k], ref[k])  # bit for bit
    # ... and it is the gradient step on the union batch (mean loss over all 12 rows), up to rounding
    p = _init()
    for step in range(6):
        x = np.concatenate([_batch(t, step)[0] for t in range(T)])
        y = np.concatenate([_batch(t, step)[1] for t in range(T)])
        gu = _grads(p, x, y)
        p = {k: p[k] - np.float32(0.01) * gu[k] for k in p}
    for k in p:
        np.testing.assert_allclose(got[0][k], p[k], rtol=1e-4, atol=1e-6)
    assert [s.step for s in g.servers] == [6, 6]


@pytest.mark.parametrize(("opt", "kind"), [(Momentum(0.01, 0.9), "momentum"), (Adam(0.01), "adam")])
@pytest.mark.parametrize("chunk", [None, 4096])
def test_sync_momentum_and_adam_match_reference(servers, monkeypatch, opt, kind, chunk):
    if chunk:
        monkeypatch.setattr(protocol, "CHUNK_BYTES", chunk)
    g = servers(2, num_trainers=T, mode="sync", barrier_timeout=20)
    got = _run_trainers(g.endpoints, "sync", opt, steps=4)
    ref = _reference(kind, 4)
    for k in ref:
        np.testing.assert_allclose(got[0][k], ref[k], rtol=1e-5, atol=1e-7)
        np.testing.assert_array_equal(got[0][k], got[2][k])


@pytest.mark.parametrize("opt", [SGD(0.01), Momentum(0.01, 0.9), Adam(0.01)], ids=["sgd", "momentum", "adam"])
def test_sync_pipelined_equals_one_message_bit_for_bit(servers, monkeypatch, opt):
    """Reducing a sync round range by range as pieces arrive gives the same bits as whole gradients."""
    monkeypatch.setattr(protocol, "CHUNK_BYTES", 1024)  # many pieces per block
    runs = []
    for pipeline in (False, True):
        g = servers(2, num_trainers=T, mode="sync", barrier_timeout=20)
        runs.append(_run_trainers(g.endpoints, "sync", opt, steps=4, pipeline=pipeline))
        assert g.join(5) and not g.errors
        assert [s.step for s in g.servers] == [4, 4]
        assert [s.stats["updates"] for s in g.servers] == [4 * 2, 4 * 1]  # once per block and round
    for tid in range(T):
        for k in runs[0][tid]:
            np.testing.assert_array_equal(runs[1][tid][k], runs[0][tid][k])


def test_sync_round_mixes_pipelined_and_one_message_pushes(servers, monkeypatch):
    """One trainer pushes one message per pserver (push, then pull), the others pipelined push_pulls."""
    monkeypatch.setattr(protocol, "CHUNK_BYTES", 1024)
    g = servers(2, num_trainers=T, mode="sync", barrier_timeout=20)
    results: dict[int, dict[str, np.ndarray]] = {}

    def trainer(tid: int) -> None:
        with PSClient(g.endpoints, trainer_id=tid, num_trainers=T, mode="sync", optimizer=SGD(0.01), timeout=20) as c:
            params = c.init(_init())
            for step in range(6):
                grads = _grads(params, *_batch(tid, step))
                if tid == 1:
                    c.push(grads, step=step)
                    params = c.pull()
                else:
                    params = c.push_pull(grads, step=step)
            c.complete()
            results[tid] = params

    in_threads(trainer, range(T))
    assert g.join(5) and not g.errors
    ref = _reference("sgd", 6)
    for tid in range(T):
        for k in ref:
            np.testing.assert_array_equal(results[tid][k], ref[k])


# -------------------------------------------------------------- convergence: async and geo

D = 50
_TRUE_W = np.linspace(-2, 2, D).astype(np.float32).reshape(D, 1)


def _lin_batch(tid: int, step: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(77 * step + tid)
    x = rng.normal(size=(16, D)).astype(np.float32)
    return x, x @ _TRUE_W + np.float32(3.0)


def _lin_loss(p: dict[str, np.ndarray]) -> float:
    x, y = _lin_batch(99, 999)
    return float(np.mean((x @ p["w"] + p["c"] - y) ** 2))


def _lin_grads(p, x, y):
    err = x @ p["w"] + p["c"] - y
    return {"w": np.float32(2 / len(x)) * (x.T @ err), "c": np.float32(2 / len(x)) * err.sum(axis=0)}


def _lin_init():
    return {"w": np.zeros((D, 1), np.float32), "c": np.zeros(1, np.float32)}


def test_async_converges(servers, monkeypatch):
    monkeypatch.setattr(protocol, "CHUNK_BYTES", 64)  # w (200 bytes) travels as 4 frames
    g = servers(2, num_trainers=T, mode="async")
    results: dict[int, float] = {}

    def trainer(tid: int) -> None:
        with PSClient(g.endpoints, trainer_id=tid, num_trainers=T, mode="async", optimizer=SGD(0.05), timeout=20) as c:
            p = c.init(_lin_init())
            for step in range(150):
                p = c.push_pull(_lin_grads(p, *_lin_batch(tid, step)), step=step)
            c.complete()
            results[tid] = _lin_loss(p)

    start = _lin_loss(_lin_init())
    in_threads(trainer, range(T))
    assert g.join(5) and not g.errors
    assert start > 20 and all(v < 1e-2 for v in results.values()), (start, results)
    assert sum(s.stats["updates"] for s in g.servers) == 2 * 150 * T  # every push applied on arrival


def test_geo_converges_with_k_steps(servers, monkeypatch):
    monkeypatch.setattr(protocol, "CHUNK_BYTES", 64)
    k = 5
    g = servers(2, num_trainers=T, mode="geo", k_steps=k)
    results: dict[int, float] = {}

    def trainer(tid: int) -> None:
        with PSClient(g.endpoints, trainer_id=tid, num_trainers=T, mode="geo", k_steps=k, timeout=20) as c:
            p = c.init(_lin_init())
            for step in range(152):
                for name, grad in _lin_grads(p, *_lin_batch(tid, step)).items():
                    p[name] -= np.float32(0.05) * grad  # local SGD
                c.geo_step(p, step=step)
            c.complete(p)  # flushes the 2 steps not yet sent
            results[tid] = _lin_loss(p)

    in_threads(trainer, range(T))
    assert g.join(5) and not g.errors
    assert all(v < 1e-2 for v in results.values()), results
    # 152 local steps -> 30 pushes of k=5 plus one final flush, per trainer, per pserver (1 block each)
    assert [s.stats["updates"] for s in g.servers] == [31 * T, 31 * T]


def test_geo_client_refuses_gradient_push(servers):
    g = servers(1, num_trainers=1, mode="geo")
    with PSClient(g.endpoints, trainer_id=0, num_trainers=1, mode="geo", timeout=5) as c:
        c.init(_lin_init())
        with pytest.raises(Exception, match="geo mode pushes parameter deltas"):
            c.push_pull(_lin_grads(_lin_init(), *_lin_batch(0, 0)))
        c.complete()


def test_mode_mismatch_is_rejected(servers):
    g = servers(1, num_trainers=1, mode="sync")
    with PSClient(g.endpoints, trainer_id=0, num_trainers=1, mode="async", timeout=5) as c, \
            pytest.raises(RemoteOpError) as err:
        c.init(_lin_init())
    assert err.value.code == "mode_mismatch"
    assert "trainer runs mode 'async', pserver 0 runs 'sync'" in str(err.value)


def test_optimizer_mismatch_is_rejected(servers):
    g = servers(1, num_trainers=2, mode="async")
    with PSClient(g.endpoints, trainer_id=0, num_trainers=2, mode="async", optimizer=SGD(0.1), timeout=5) as a, \
            PSClient(g.endpoints, trainer_id=1, num_trainers=2, mode="async", optimizer=Adam(0.1), timeout=5) as b:
        a.init(_lin_init())
        with pytest.raises(RemoteOpError) as err:
            b.init(_lin_init())
    assert err.value.code == "optimizer_mismatch"


def test_sync_round_waits_only_for_trainers_not_completed(servers):
    """A trainer that finishes early (fewer batches) must not block the others' barriers."""
    g = servers(1, num_trainers=2, mode="sync", barrier_timeout=10)
    steps = {0: 2, 1: 5}

    def trainer(tid: int) -> None:
        with PSClient(g.endpoints, trainer_id=tid, num_trainers=2, mode="sync", optimizer=SGD(0.01), timeout=10) as c:
            p = c.init(_lin_init())
            for step in range(steps[tid]):
                p = c.push_pull(_lin_grads(p, *_lin_batch(tid, step)), step=step)
            c.complete()

    in_threads(trainer, (0, 1), timeout=15)
    assert g.join(5) and not g.errors
    assert g.servers[0].step == 5


def test_zero_copy_replies_are_consistent_snapshots(servers):
    """Updates never touch a buffer ZeroMQ is still sending: every pull sees one version, whole."""
    n = 3_000_000  # 12 MB: several wire chunks
    g = servers(1, num_trainers=2, mode="async")
    seen, torn = pulls_during_pushes(g.endpoints, n, "push")
    assert not torn, torn
    assert seen[-1] < seen[0] <= 0  # the pusher really was updating meanwhile


def test_trainers_with_a_different_parameter_order_are_refused(servers):
    g = servers(2, num_trainers=2, mode="async")
    a_params = {"w": np.zeros((D, 1), np.float32), "c": np.zeros(1, np.float32)}
    b_params = {"c": np.zeros(1, np.float32), "w": np.zeros((D, 1), np.float32)}  # same tensors, other order
    with PSClient(g.endpoints, trainer_id=0, num_trainers=2, mode="async", timeout=5) as a, \
            PSClient(g.endpoints, trainer_id=1, num_trainers=2, mode="async", timeout=5) as b:
        a.init(a_params)
        with pytest.raises(RemoteOpError) as err:
            b.init(b_params)
    assert err.value.code == "plan_mismatch"
    assert "trainer 1 placed the parameters differently" in str(err.value)
