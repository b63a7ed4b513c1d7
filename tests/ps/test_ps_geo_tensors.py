"""Geo mode with torch tensors: the merged values reach the tensors themselves, wherever they live."""

from __future__ import annotations

import numpy as np
import pytest
from ps_jobs import in_threads

from clusterctl.ps import PSClient

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.timeout(30)


class DeviceTensor:
    """Stands in for a CUDA tensor: ``.cpu()`` is a host *copy*, and only ``copy_`` writes into it."""

    def __init__(self, t):
        self.t = t

    shape = property(lambda self: self.t.shape)

    def detach(self):
        return self

    def cpu(self):
        return self.t.clone()  # device -> host: a copy, never a view

    def copy_(self, src):
        self.t.copy_(src)  # host -> device
        return self


def _geo_job(g, make, steps=2):
    """Two geo trainers with k_steps=1; trainer t moves each of its parameters by -(t + 1) per step."""
    out = {}

    def trainer(tid):
        with PSClient(g.endpoints, trainer_id=tid, num_trainers=2, mode="geo", k_steps=1, timeout=20) as c:
            start = c.init({"w": np.zeros(4, np.float32), "h": np.zeros((2, 3), np.float16)})  # the other's deltas may be in
            p = {n: make(torch.from_numpy(np.array(a))) for n, a in start.items()}
            seen = []
            for step in range(steps):
                for x in p.values():
                    (x.t if isinstance(x, DeviceTensor) else x).sub_(tid + 1)  # the local step, on the "device"
                c.geo_step(p, step=step)
                seen.append({n: (x.t if isinstance(x, DeviceTensor) else x).cpu().clone() for n, x in p.items()})
                for name in p:  # the merged values (the client's new base) reached the tensors
                    np.testing.assert_array_equal(seen[-1][name].numpy(), c._geo_base[name])
            c.complete()
            out[tid] = seen

    in_threads(trainer, range(2))
    return out


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


@pytest.mark.parametrize("make", [DeviceTensor, lambda t: t, pytest.param(lambda t: t.cuda(), marks=CUDA)],
                         ids=["stand-in", "cpu", "cuda"])
def test_geo_flush_writes_the_merged_values_into_the_tensors(servers, make):
    """A CUDA tensor's values were refreshed in a host copy: the device kept its local ones and drifted."""
    g = servers(1, num_trainers=2, mode="geo")
    out = _geo_job(g, make)
    assert g.join(5) and not g.errors
    for tid in range(2):  # what each trainer's tensors hold after its last flush: the merged values, in their dtype
        assert [(x["w"].dtype, x["h"].dtype) for x in out[tid]] == [(torch.float32, torch.float16)] * 2
    # every local step's delta reached the pserver once: 2 steps of -1 and 2 of -2, averaged over 2 trainers
    blocks = g.servers[0].blocks
    np.testing.assert_array_equal(blocks["w.block0"], np.full(4, -3, np.float32))
    np.testing.assert_array_equal(blocks["h.block0"], np.full(6, -3, np.float16))
