"""float16 blocks: the pserver's optimizer arithmetic and state are float32, only the new value is float16."""

from __future__ import annotations

import math

import numpy as np
import pytest

from clusterctl.ps import Adam, Momentum, PSClient
from clusterctl.ps import checkpoint as ckpt
from clusterctl.ps.optim import init_state

pytestmark = pytest.mark.timeout(30)

# zeros (unused rows) and gradients so small that 0.001 * g**2 underflows in float16
GRAD = np.array([0.0, 1e-3, -1e-4, 0.5, 1.0, -2.0, 0.0, 3e-2], np.float16)


def _adam_reference(steps: int) -> np.ndarray:
    """Paddle's Adam on float32 parameters, the same gradient every step."""
    p, m, v, g = np.ones(8, np.float32), np.zeros(8, np.float32), np.zeros(8, np.float32), GRAD.astype(np.float32)
    for t in range(1, steps + 1):
        m = 0.9 * m + 0.1 * g
        v = 0.999 * v + 0.001 * g * g
        corr2 = math.sqrt(1 - 0.999 ** t)
        p = p - np.float32(1e-3 * corr2 / (1 - 0.9 ** t)) * m / (np.sqrt(v) + np.float32(1e-8 * corr2))
    return p


@pytest.mark.parametrize("mode,pipeline", [("sync", True), ("sync", False), ("async", True), ("async", False)])
def test_adam_on_float16_parameters_stays_finite_and_follows_float32(servers, mode, pipeline):
    g = servers(1, num_trainers=1, mode=mode)
    with PSClient(g.endpoints, trainer_id=0, num_trainers=1, mode=mode, optimizer=Adam(1e-3), timeout=10,
                  pipeline=pipeline) as c:
        w = c.init({"w": np.ones(8, np.float16)})["w"]
        for step in range(3):
            w = c.push_pull({"w": GRAD}, step=step)["w"]
        c.complete()
    assert w.dtype == np.float16 and np.isfinite(w).all(), w
    np.testing.assert_allclose(w.astype(np.float32), _adam_reference(3), rtol=0, atol=1e-3)  # float16's ulp at 1


@pytest.mark.parametrize("opt", [Momentum(0.1), Adam(1e-3)], ids=lambda o: o.kind)
def test_optimizer_state_of_a_float16_block_is_float32(opt):
    for name, arr in init_state(opt, np.ones(8, np.float16)).items():
        assert (name, arr.dtype) == (name, np.float64 if name == "t" else np.float32)
    for arr in init_state(opt, np.ones(8, np.float32)).values():  # wider blocks keep their own dtype
        assert arr.dtype in (np.float32, np.float64)


@pytest.mark.parametrize("opt", [Momentum(0.1), Adam(1e-3)], ids=lambda o: o.kind)
def test_float16_optimizer_state_is_saved_in_float32_and_a_restart_continues_exactly(servers, tmp_path, opt):
    root = tmp_path / "ckpt"

    def train(eps, steps, save_at=None):
        with PSClient(eps, trainer_id=0, num_trainers=1, mode="sync", optimizer=opt, timeout=10) as c:
            w = c.init({"w": np.ones(8, np.float16)})["w"]
            for step in range(c.start_step, steps):
                if step == save_at:
                    c.save(str(root), step)
                w = c.push_pull({"w": GRAD * np.float16(step + 1)}, step=step)["w"]
            c.complete()
        return w

    straight = train(servers(1, num_trainers=1, checkpoint_root=str(tmp_path)).endpoints, 4, save_at=2)
    saved = ckpt.load_server(root, 0, 1)
    assert {name: a.dtype.name for name, a in saved.states["w.block0"].items()} == {
        name: "float64" if name == "t" else "float32" for name in init_state(opt, np.ones(1))}
    g2 = servers(1, num_trainers=1, checkpoint_dir=str(root))
    assert g2.servers[0].loaded_step == 2
    resumed = train(g2.endpoints, 4)
    assert np.isfinite(straight).all()
    np.testing.assert_array_equal(resumed, straight)


@pytest.mark.parametrize("pipeline", [True, False])
def test_float16_gradients_of_a_sync_round_are_summed_in_float32(servers, pipeline):
    # two trainers' 40,000 summed in float16 overflowed its 65,504 to inf before the average: every weight inf
    import threading

    from clusterctl.ps import SGD

    g = servers(1, num_trainers=2, mode="sync")
    got = {}

    def trainer(tid: int) -> None:
        with PSClient(g.endpoints, trainer_id=tid, num_trainers=2, mode="sync", optimizer=SGD(1e-4), timeout=10,
                      pipeline=pipeline) as c:
            c.init({"w": np.ones(4, np.float16)})
            got[tid] = c.push_pull({"w": np.full(4, 40000, np.float16)}, step=0)["w"]
            c.complete()

    threads = [threading.Thread(target=trainer, args=(t,)) for t in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    for tid in (0, 1):
        np.testing.assert_array_equal(got[tid], np.full(4, 1 - 1e-4 * 40000, np.float16))
