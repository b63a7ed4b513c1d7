"""Optimizer state in a checkpoint must be what the optimizer makes for the block, or the load says what is wrong."""

from __future__ import annotations

import numpy as np
import pytest

from clusterctl.ps import Adam, CheckpointError, Momentum, ParameterServer
from clusterctl.ps import checkpoint as ckpt

pytestmark = pytest.mark.timeout(30)

N = 8  # elements of the block


def _save(root, opt, state, dtype=np.float32):
    shard = ckpt.ServerCheckpoint(0, 1, 5, "sync", opt.to_dict(), {"w.block0": np.ones(N, dtype)},
                                  {"w.block0": state}, {"w": ((N,), np.dtype(dtype).name)})
    return ckpt.save_server(root, shard)


@pytest.mark.parametrize(("opt", "state", "message"), [
    (Momentum(0.1), {"velocity": np.zeros(3, np.float32)},
     "optimizer state 'velocity' of block 'w.block0' is float32[3], want float32[8]"),
    (Momentum(0.1), {"velocity": np.zeros(N, np.float64)},
     "optimizer state 'velocity' of block 'w.block0' is float64[8], want float32[8]"),
    (Momentum(0.1), {"velocity": np.zeros((2, 4), np.float32)},
     "optimizer state 'velocity' of block 'w.block0' is float32[2, 4], want float32[8]"),
    (Adam(), {"m": np.zeros(N, np.float32), "v": np.zeros(N, np.float32), "t": np.zeros(0)},
     "optimizer state 't' of block 'w.block0' is float64[0], want float64[1]"),
    (Adam(), {"m": np.zeros(N, np.float32), "v": np.zeros(N, np.float32), "t": np.zeros(1, np.float32)},
     "optimizer state 't' of block 'w.block0' is float32[1], want float64[1]"),
    (Adam(), {"m": np.zeros(N, np.float32), "v": np.zeros(N + 1, np.float32), "t": np.zeros(1)},
     "optimizer state 'v' of block 'w.block0' is float32[9], want float32[8]"),
])
def test_optimizer_state_of_another_size_dtype_or_shape_is_refused_naming_file_state_and_block(tmp_path, opt, state,
                                                                                             message):
    """It loaded, and every push then failed with 'internal: ValueError: operands could not be broadcast'."""
    sdir = _save(tmp_path, opt, state)
    with pytest.raises(CheckpointError) as err:
        ckpt.load_server(tmp_path, 0, 1)
    assert str(err.value) == f"{sdir}/tensors.npz: {message}"
    with pytest.raises(CheckpointError) as err:  # a pserver told to start from it: one line, naming it
        ParameterServer("127.0.0.1:0", checkpoint_dir=str(tmp_path))
    assert str(err.value) == f"{sdir}/tensors.npz: {message}"


def test_optimizer_state_names_other_than_the_optimizers_are_refused(tmp_path):
    sdir = _save(tmp_path, Adam(), {"m": np.zeros(N, np.float32), "t": np.zeros(1)})
    with pytest.raises(CheckpointError) as err:
        ckpt.load_server(tmp_path, 0, 1)
    assert str(err.value) == f"{sdir}/manifest.json: block 'w.block0' has optimizer state ['m', 't'], adam needs " \
                             "['m', 't', 'v']"


def test_float16_state_of_an_older_checkpoint_is_widened_to_float32(tmp_path):
    """Before float16 blocks were updated in float32 their state was float16: it still loads."""
    _save(tmp_path, Momentum(0.1), {"velocity": np.full(N, 0.5, np.float16)}, dtype=np.float16)
    vel = ckpt.load_server(tmp_path, 0, 1).states["w.block0"]["velocity"]
    assert vel.dtype == np.float32
    np.testing.assert_array_equal(vel, np.full(N, 0.5, np.float32))
