"""Checkpoints record parameter shapes: a same-named parameter of another shape or dtype is refused on resume.

Blocks are flat, so a (6, 4) parameter saved and a (4, 6) one registered had the same block sizes and were
accepted in silence.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from ps_jobs import raw_dealer

from clusterctl.ps import CheckpointError, PSClient, RemoteOpError
from clusterctl.ps import checkpoint as ckpt
from clusterctl.ps.protocol import decode, encode

pytestmark = pytest.mark.timeout(30)

TIMEOUT = 10.0
W = np.arange(24, dtype=np.float32).reshape(6, 4)  # two blocks of 12 over two pservers (min_block_size=4)
B = np.ones(4, np.float32)


def _client(g) -> PSClient:
    return PSClient(g.endpoints, trainer_id=0, num_trainers=1, mode="async", timeout=TIMEOUT, min_block_size=4)


def _save(servers, tmp_path, params, n=2):
    """``params`` registered with ``n`` fresh pservers and saved at step 3 under tmp_path/ckpt."""
    root = tmp_path / "ckpt"
    g = servers(n, mode="async", checkpoint_root=str(tmp_path))
    with _client(g) as c:
        c.init(params)
        assert c.save(str(root), 3) == 3
        c.complete()
    assert g.join(5) and not g.errors
    return root


def test_a_checkpoint_records_each_parameters_shape_and_dtype(servers, tmp_path):
    root = _save(servers, tmp_path, {"fc.w": W, "b": B})
    manifests = [json.loads((root / f"pserver-{i}" / "manifest.json").read_text()) for i in (0, 1)]
    assert [m["params"] for m in manifests] == [
        {"fc.w": {"shape": [6, 4], "dtype": "float32"}, "b": {"shape": [4], "dtype": "float32"}},
        {"fc.w": {"shape": [6, 4], "dtype": "float32"}},
    ]
    assert ckpt.load_server(root, 1, 2).params == {"fc.w": ((6, 4), "float32")}


@pytest.mark.parametrize("resume", ["start", "load"])
@pytest.mark.parametrize(
    ("w", "trainer"),
    [(W.reshape(4, 6), "(4, 6) float32"), (W.astype(np.float64), "(6, 4) float64")],
    ids=["shape", "dtype"],
)
def test_a_resumed_init_of_another_shape_or_dtype_is_refused_at_once(servers, tmp_path, resume, w, trainer):
    root = _save(servers, tmp_path, {"fc.w": W, "b": B})
    if resume == "start":  # pservers started from the checkpoint
        g = servers(2, mode="async", checkpoint_dir=str(root))
    else:  # fresh pservers told to load it before any init
        g = servers(2, mode="async", checkpoint_root=str(tmp_path))
    with _client(g) as c:
        if resume == "load":
            assert c.load(str(root)) == 3
        with pytest.raises(RemoteOpError) as err:  # the refusal answers the request: no wait for the timeout
            c.init({"fc.w": w, "b": B})
        assert err.value.code == "checkpoint_mismatch"
        assert err.value.remote_message == ("trainer 0's parameters differ from the checkpoint (step 3) pserver 0 "
                                            f"resumed from: fc.w: checkpoint (6, 4) float32, trainer {trainer}")
        assert "\n" not in str(err.value)
        # nothing registered: the trainer's init with the checkpoint's shapes resumes from its values
        got = c.init({"fc.w": np.zeros((6, 4), np.float32), "b": B})
        np.testing.assert_array_equal(got["fc.w"], W)
        assert c.start_step == 3


def test_more_than_five_parameters_of_another_shape_are_named_five_and_counted(servers, tmp_path):
    saved = {f"p{i}": np.zeros((2, 3), np.float32) for i in range(7)}
    root = _save(servers, tmp_path, saved, n=1)
    g = servers(1, mode="async", checkpoint_dir=str(root))
    with _client(g) as c, pytest.raises(RemoteOpError) as err:
        c.init({name: a.reshape(3, 2) for name, a in saved.items()})
    five = "; ".join(f"p{i}: checkpoint (2, 3) float32, trainer (3, 2) float32" for i in range(5))
    assert err.value.remote_message == ("trainer 0's parameters differ from the checkpoint (step 3) pserver 0 "
                                        f"resumed from: {five}; ... (7 in all)")


def test_a_load_after_init_of_another_shape_is_refused_and_keeps_what_was_registered(servers, tmp_path):
    """No init follows a trainer's own load: the pserver compares the checkpoint with the registered shapes."""
    root = _save(servers, tmp_path, {"fc.w": W, "b": B})
    g = servers(2, mode="async", checkpoint_root=str(tmp_path))
    with _client(g) as c:
        mine = {"fc.w": -W.reshape(4, 6), "b": B}
        c.init(mine)
        with pytest.raises(RemoteOpError) as err:
            c.load(str(root))
        assert err.value.code == "checkpoint_mismatch"
        assert err.value.remote_message == (f"the checkpoint (step 3) in {os.path.realpath(root)} differs from the "
                                            "parameters registered with pserver 0: fc.w: checkpoint (6, 4) float32, "
                                            "trainer (4, 6) float32")
        np.testing.assert_array_equal(c.pull()["fc.w"], mine["fc.w"])
        assert [s.loaded_step for s in g.servers] == [0, 0]


def test_an_older_checkpoint_without_shapes_loads_and_checks_names_and_sizes_as_before(servers, tmp_path):
    root = _save(servers, tmp_path, {"fc.w": W, "b": B})
    for i in (0, 1):  # as written before shapes were recorded
        path = root / f"pserver-{i}" / "manifest.json"
        manifest = json.loads(path.read_text())
        del manifest["params"]
        path.write_text(json.dumps(manifest))
    assert ckpt.load_server(root, 0, 2).params == {}
    g = servers(2, mode="async", checkpoint_dir=str(root), checkpoint_root=str(tmp_path))
    with _client(g) as c:
        with pytest.raises(RemoteOpError) as err:
            c.init({"v": W, "b": B})
        assert err.value.code == "checkpoint_mismatch" and "it lacks 1 block(s): fc.w.block0" in err.value.remote_message
        got = c.init({"fc.w": np.zeros((4, 6), np.float32), "b": B})  # same names and sizes: nothing to tell
        np.testing.assert_array_equal(got["fc.w"], W.reshape(4, 6))
        assert c.start_step == 3
        c.save(str(tmp_path / "again"), 3)  # the next save records the shapes the trainer registered
        c.complete()
    assert ckpt.load_server(tmp_path / "again", 1, 2).params == {"fc.w": ((4, 6), "float32")}


@pytest.mark.parametrize("params", [[], {"fc.w": [6, 4]}, {"fc.w": {"shape": [6, -4], "dtype": "float32"}},
                                    {"fc.w": {"shape": [6, 4]}}])
def test_a_malformed_parameter_table_is_a_checkpoint_error(servers, tmp_path, params):
    root = _save(servers, tmp_path, {"fc.w": W, "b": B})
    path = root / "pserver-0" / "manifest.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "params": params}))
    with pytest.raises(CheckpointError) as err:
        ckpt.load_server(root, 0, 2)
    assert str(err.value) == f"{root}/pserver-0/manifest.json: the parameter table is malformed"


def test_an_init_with_a_malformed_parameter_table_is_a_bad_request(servers):
    g = servers(1, mode="async")
    s = raw_dealer(g.endpoints[0])
    try:
        head = {"op": "init", "seq": 5, "tid": 0, "mode": "async", "plan": "x", "server": 0, "params": {"w": {"shape": "(4,)"}}}
        s.send_multipart(encode(head, {"w.block0": np.zeros(4, np.float32)}))
        assert s.poll(int(TIMEOUT * 1000))
        reply = decode(s.recv_multipart(), request=False)
    finally:
        s.close()
    assert (reply.seq, reply.header["code"]) == (5, "bad_request")
    assert reply.header["error"] == "init's 'params' must map each parameter to its 'shape' and 'dtype'"
    assert g.servers[0].blocks == {}
