"""A user's misuse of the ps runtime (bad environment, API misuse, damaged checkpoints): one clear error of the
runtime's own classes, at once; never a traceback from numpy/zmq, a wait for a timeout, or silently cast data."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from clusterctl.ps import (CheckpointError, ParameterServer, PSClient, PsConfigError, PsError, PsTimeoutError,
                           RemoteOpError, from_env, protocol)
from clusterctl.ps import checkpoint as ckpt
from clusterctl.ps.__main__ import main

from ps_jobs import REPO  # noqa: E402 (tests/ps is on sys.path: conftest.py)

pytestmark = pytest.mark.timeout(20)

BASE = {"TRAINING_ROLE": "TRAINER", "PADDLE_PSERVERS_IP_PORT_LIST": "127.0.0.1:6170,127.0.0.2:6170",
        "PADDLE_TRAINERS_NUM": "2", "PADDLE_TRAINER_ID": "1"}
#: Short enough that a test of a fix that regressed fails in seconds, not the default 360 s.
TIMEOUT = 4.0


# ------------------------------------------------------------------ environment


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"PADDLE_TRAINERS_NUM": "1_0"}, "environment variable PADDLE_TRAINERS_NUM='1_0' is not an integer"),
        ({"PADDLE_TRAINER_ID": "\u0661"}, "environment variable PADDLE_TRAINER_ID='\u0661' is not an integer"),
        ({"CLUSTERCTL_PS_BARRIER_TIMEOUT": "nan"},
         "environment variable CLUSTERCTL_PS_BARRIER_TIMEOUT='nan' must be a finite number of seconds > 0"),
        ({"CLUSTERCTL_PS_BARRIER_TIMEOUT": "0"},
         "environment variable CLUSTERCTL_PS_BARRIER_TIMEOUT='0' must be a finite number of seconds > 0"),
        ({"CLUSTERCTL_PS_TIMEOUT": "-5"},
         "environment variable CLUSTERCTL_PS_TIMEOUT='-5' must be a finite number of seconds > 0"),
        ({"CLUSTERCTL_PS_TIMEOUT": "inf"},
         "environment variable CLUSTERCTL_PS_TIMEOUT='inf' must be a finite number of seconds > 0"),
        # "never": an OverflowError traceback in the pserver at the first sync round, in the trainer at its first poll
        ({"CLUSTERCTL_PS_BARRIER_TIMEOUT": "1e308"},
         "environment variable CLUSTERCTL_PS_BARRIER_TIMEOUT=1e308 is more than 10,000,000 seconds"),
        ({"CLUSTERCTL_PS_TIMEOUT": " 1e17 "},
         "environment variable CLUSTERCTL_PS_TIMEOUT=1e17 is more than 10,000,000 seconds"),
        ({"PADDLE_PSERVERS_IP_PORT_LIST": "127.0.0.1:6170, 127.0.0.1:6170"},
         "PADDLE_PSERVERS_IP_PORT_LIST names 127.0.0.1:6170 more than once"),
        # one pserver written two ways passed as two: the second failed to bind, trainers sent both shares to one
        ({"PADDLE_PSERVERS_IP_PORT_LIST": "localhost:6170,127.0.0.1:6170"},
         "PADDLE_PSERVERS_IP_PORT_LIST names 127.0.0.1:6170 (as 'localhost:6170', '127.0.0.1:6170') more than once"),
        ({"PADDLE_PSERVERS_IP_PORT_LIST": "127.0.0.1:6170,127.0.0.2:6170,127.0.0.1:06170"},
         "PADDLE_PSERVERS_IP_PORT_LIST names 127.0.0.1:6170 (as '127.0.0.1:6170', '127.0.0.1:06170') more than once"),
        ({"PADDLE_PSERVERS_IP_PORT_LIST": "tcp://10.0.0.2:6170,10.0.0.2:6170,[::1]:7,[0:0::1]:0007"},
         "PADDLE_PSERVERS_IP_PORT_LIST names 10.0.0.2:6170 (as 'tcp://10.0.0.2:6170', '10.0.0.2:6170'), "
         "[::1]:7 (as '[::1]:7', '[0:0::1]:0007') more than once"),
        ({"PADDLE_PSERVERS_IP_PORT_LIST": "127.0.0.1:0"},
         "PADDLE_PSERVERS_IP_PORT_LIST: endpoint '127.0.0.1:0' has port 0 (a pserver must listen on its planned port)"),
        ({"CLUSTERCTL_PS_CHECKPOINT_EVERY": "-1"},
         "CLUSTERCTL_PS_CHECKPOINT_EVERY must be >= 0 (0: no periodic saves), got -1"),
        ({"PADDLE_PSERVERS_IP_PORT_LIST": "127.0.0.1:\u00b2"},  # str.isdigit() takes it; int() did not
         "endpoint '127.0.0.1:\u00b2' is not HOST:PORT"),
        ({"PADDLE_PSERVERS_IP_PORT_LIST": "127.0.0.1:\u0661\u0662"}, "endpoint '127.0.0.1:\u0661\u0662' is not HOST:PORT"),
    ],
)
def test_bad_env_values_are_refused_by_name(extra, message):
    with pytest.raises(PsConfigError) as err:
        from_env({**BASE, **extra})
    assert str(err.value) == message


def test_env_integers_may_carry_surrounding_whitespace():
    assert from_env({**BASE, "PADDLE_TRAINER_ID": " 1\n"}).trainer_id == 1


def test_main_with_a_bad_log_level_exits_2_with_one_line():
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PADDLE_", "CLUSTERCTL_", "TRAINING_"))}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-m", "clusterctl.ps", "server", "--log-level", "loud"], env=env,
                          capture_output=True, text=True, timeout=15)
    assert proc.returncode == 2
    assert proc.stderr.splitlines()[-1] == ("python -m clusterctl.ps server: error: argument --log-level: 'loud' is "
                                            "not a logging level (DEBUG, INFO, WARNING, ERROR, CRITICAL)")
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize(("value", "why"), [("0", "is not a finite number of seconds > 0"),
                                             ("nan", "is not a finite number of seconds > 0"),
                                             ("-3", "is not a finite number of seconds > 0"),
                                             ("1e308", "is more than 10,000,000 seconds")])
def test_main_refuses_a_barrier_timeout_that_is_no_timeout(value, why, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["server", "--barrier-timeout", value])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"python -m clusterctl.ps server: error: argument --barrier-timeout: '{value}' {why}")


def test_the_largest_timeouts_taken_serve_a_sync_round_and_a_ping_of_any_timeout_polls(servers):
    """1e308 s overflowed int() in the pserver's poll, 1e17 s the C long of the trainer's zmq_poll."""
    for value, message in ((1e308, "barrier_timeout must be > 0 and at most 10,000,000 seconds, got 1e+308"),
                           (float("nan"), "barrier_timeout must be > 0 and at most 10,000,000 seconds, got nan")):
        with pytest.raises(PsConfigError) as err:
            ParameterServer("127.0.0.1:0", barrier_timeout=value)
        assert str(err.value) == message
    g = servers(1, num_trainers=1, mode="sync", barrier_timeout=1e7)
    with PSClient(g.endpoints, trainer_id=0, num_trainers=1, mode="sync", timeout=1e7) as c:
        assert len(c.ping(timeout=1e300)) == 1
        c.init({"w": np.zeros(4, np.float32)})
        np.testing.assert_array_equal(c.push_pull({"w": np.ones(4, np.float32)})["w"], np.full(4, -0.01, np.float32))
        c.complete()
    assert g.join(5) and not g.errors


# ------------------------------------------------------------------ trainer API


def _client(group, **kw) -> PSClient:
    return PSClient(group.endpoints, trainer_id=0, num_trainers=1, mode="async", timeout=TIMEOUT,
                    min_block_size=4, **kw)


PARAMS = {"w": np.arange(8, dtype=np.float32).reshape(4, 2), "b": np.zeros(3, np.float32)}


def test_init_refuses_no_params_and_names_that_are_not_strings(servers):
    g = servers(1, mode="async")
    with _client(g) as c:
        with pytest.raises(PsConfigError, match=r"^init needs at least one parameter$"):
            c.init({})
        with pytest.raises(PsConfigError, match=r"^parameter names must be non-empty strings, got 1$"):
            c.init({1: np.ones(3, np.float32)})
        assert c.plan is None
        assert g.servers[0].blocks == {}


def test_grads_of_unknown_names_or_non_float_dtypes_are_refused(servers):
    g = servers(1, mode="async")
    with _client(g) as c:
        c.init(PARAMS)
        with pytest.raises(PsConfigError, match=r"^'q' is not a registered parameter \('w', 'b'\)$"):
            c.push({"q": np.ones(3, np.float32)})
        with pytest.raises(PsConfigError, match=r"^b: dtype complex128 is not supported \(float16/32/64\)$"):
            c.push({"b": np.full(3, 1 + 1j)})
        with pytest.raises(PsConfigError, match=r"^b: dtype int64 is not supported \(float16/32/64\)$"):
            c.push_pull({"b": np.ones(3, np.int64), "w": np.ones((4, 2), np.float32)})
        assert g.servers[0].stats["updates"] == 0  # nothing reached the pserver
        np.testing.assert_array_equal(c.pull()["b"], PARAMS["b"])


def test_torch_bfloat16_is_refused_by_name(servers):
    torch = pytest.importorskip("torch")
    g = servers(1, mode="async")
    with _client(g) as c:
        with pytest.raises(PsConfigError, match=r"^t: cannot be read as a float16/32/64 array: .*BFloat16"):
            c.init({"t": torch.ones(3, dtype=torch.bfloat16)})


def test_out_arrays_that_are_not_arrays_are_refused(servers):
    g = servers(1, mode="async")
    with _client(g) as c:
        c.init(PARAMS)
        with pytest.raises(PsConfigError, match=r"^out\['w'\] must be a C-contiguous float32 array of shape \(4, 2\)$"):
            c.pull(out={"w": [[0.0, 0.0]] * 4})


@pytest.mark.parametrize("step", [-1, "3", 2.0, True])
def test_a_bad_step_is_refused_at_once(servers, step):
    g = servers(1, mode="async")
    with _client(g) as c:
        c.init(PARAMS)
        for call in (lambda: c.push({"b": np.ones(3, np.float32)}, step=step),
                     lambda: c.push_pull({"b": np.ones(3, np.float32)}, step=step),
                     lambda: c.save("ck", step=step)):
            with pytest.raises(PsConfigError) as err:
                call()
            assert str(err.value) == f"step must be a non-negative integer, got {step!r}"
        assert c.step == 0


def test_calls_after_complete_or_close_are_refused_at_once(servers):
    g = servers(1, mode="async")
    c = _client(g)
    c.init(PARAMS)
    c.complete()
    assert g.join(TIMEOUT)  # the only trainer completed: the pserver is gone
    for call in (c.pull, lambda: c.push({"b": np.ones(3, np.float32)}), c.complete, c.ping):
        with pytest.raises(PsConfigError, match=r"^trainer 0: complete\(\) was called on this client; no more"):
            call()
    c.close()
    with pytest.raises(PsConfigError, match=r"^trainer 0: close\(\) was called on this client; no more requests$"):
        c.pull()


def test_a_refused_init_keeps_the_registered_parameters(servers):
    g = servers(1, mode="async")
    with _client(g) as c:
        c.init(PARAMS)
        with pytest.raises(RemoteOpError) as err:
            c.init({"w": np.ones((4, 3), np.float32), "b": np.zeros(3, np.float32)})
        assert err.value.code == "plan_mismatch"
        got = c.pull()  # the client still talks about what the pservers hold
        np.testing.assert_array_equal(got["w"], PARAMS["w"])
        with pytest.raises(PsConfigError, match=r"^w: shape \(4, 3\) differs from the registered \(4, 2\)$"):
            c.push({"w": np.ones((4, 3), np.float32)})


def test_a_trainer_whose_endpoint_list_is_in_another_order_is_refused_by_the_first_pserver_it_reaches(servers):
    """Before: a pserver took whatever blocks a trainer sent it. A trainer (the first, or every one) whose
    PADDLE_PSERVERS_IP_PORT_LIST had the pservers in another order put pserver 1's blocks on pserver 0, whose
    checkpoints then held another pserver's share (a resume with the right list found them missing)."""
    g = servers(2, mode="async")
    with PSClient(list(reversed(g.endpoints)), trainer_id=0, num_trainers=1, mode="async", timeout=TIMEOUT,
                  min_block_size=4) as c:
        with pytest.raises(RemoteOpError) as err:
            c.init(PARAMS)
    assert err.value.code == "wrong_pserver"
    assert str(err.value) == (f"pserver {g.endpoints[1]} rejected the request (wrong_pserver): trainer 0 takes pserver 1 "
                              "for pserver 0: the same PADDLE_PSERVERS_IP_PORT_LIST, in the same order, on every "
                              "trainer and pserver?")
    with _client(g) as c:  # nothing was registered: the right list goes through
        got = c.init(PARAMS)
        np.testing.assert_array_equal(got["w"], PARAMS["w"])


# ------------------------------------------------------------------ checkpoints


def _saved(tmp_path):
    shard = ckpt.ServerCheckpoint(0, 1, 3, "async", None, {"w.block0": np.ones(4, np.float32)}, {"w.block0": {}})
    sdir = ckpt.save_server(tmp_path, shard)
    return sdir, json.loads((sdir / "manifest.json").read_text())


def test_a_truncated_tensor_file_is_a_checkpoint_error(tmp_path):
    sdir, _ = _saved(tmp_path)
    raw = (sdir / "tensors.npz").read_bytes()
    (sdir / "tensors.npz").write_bytes(raw[:len(raw) // 2])  # a copy cut short
    with pytest.raises(CheckpointError, match=rf"^{sdir}/tensors.npz: unreadable: "):
        ckpt.load_server(tmp_path, 0, 1)
    with pytest.raises(CheckpointError, match=rf"^{sdir}/tensors.npz: unreadable: "):  # a pserver starting from it
        ParameterServer("127.0.0.1:0", checkpoint_dir=str(tmp_path), mode="async")


def test_init_after_resume_must_name_the_checkpoints_parameters(servers, tmp_path):
    """A resumed pserver refused nothing: another model's init was added beside the loaded blocks."""
    _saved(tmp_path)  # w.block0 = ones(4), step 3
    g = servers(1, mode="async", checkpoint_dir=str(tmp_path))
    with _client(g) as c:
        for params, diff in (({"v": np.zeros(4, np.float32)}, "lacks 1 block(s): w.block0; it adds 1 block(s): v.block0"),
                             ({"w": np.zeros(4, np.float32), "b": np.zeros(3, np.float32)}, "adds 1 block(s): b.block0")):
            with pytest.raises(RemoteOpError) as err:  # at once, not after the client's timeout
                c.init(params)
            assert err.value.code == "checkpoint_mismatch"
            assert err.value.remote_message == ("trainer 0's parameters differ from the checkpoint (step 3) pserver 0 "
                                                f"resumed from: it {diff}")
        assert g.servers[0].blocks.keys() == {"w.block0"}  # nothing added beside the loaded blocks
        np.testing.assert_array_equal(c.init({"w": np.zeros(4, np.float32)})["w"], np.ones(4, np.float32))
        assert c.start_step == 3


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"blocks": [{"key": "w.block0"}]}, "the block table is malformed"),
        ({"blocks": "w.block0"}, "the block table is malformed"),
        ({"blocks": [{"key": "w.block0", "dtype": "float32", "size": 4, "state": "m"}]},
         "the block table is malformed"),
        ({"step": True}, "step is not a non-negative integer"),
        ({"step": -2}, "step is not a non-negative integer"),
        ({"optimizer": "adam"}, "optimizer is not an object"),
    ],
)
def test_a_damaged_manifest_is_a_checkpoint_error(tmp_path, change, message):
    sdir, manifest = _saved(tmp_path)
    (sdir / "manifest.json").write_text(json.dumps({**manifest, **change}))
    with pytest.raises(CheckpointError) as err:
        ckpt.load_server(tmp_path, 0, 1)
    assert str(err.value) == f"{sdir}/manifest.json: {message}"


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"timeout": float("nan")}, "timeout must be a finite number of seconds, got nan"),
        ({"timeout": "5"}, "timeout must be a finite number of seconds, got '5'"),
        ({"timeout": 1e17}, "timeout must be > 0 and at most 10,000,000 seconds, got 1e+17"),
        ({"trainer_id": "0"}, "trainer_id must be an integer, got '0'"),
        ({"k_steps": 1.5}, "k_steps must be an integer, got 1.5"),
        ({"endpoints": "127.0.0.1:6170"},
         "endpoints must be a list of 'ip:port' strings, got the string '127.0.0.1:6170'"),
    ],
)
def test_client_arguments_of_the_wrong_kind_are_refused(kw, message):
    args = {"endpoints": ["127.0.0.1:6170"], "trainer_id": 0, "num_trainers": 1, **kw}
    with pytest.raises(PsConfigError) as err:
        PSClient(args.pop("endpoints"), **args)
    assert str(err.value) == message


def test_save_and_load_refuse_a_path_that_is_no_path(servers, tmp_path):
    g = servers(1, mode="async", checkpoint_dir=str(tmp_path))
    with _client(g) as c:
        c.init(PARAMS)
        for op in (c.save, c.load):
            with pytest.raises(PsConfigError, match=rf"^{op.__name__} needs a directory path, got \['ck'\]$"):
                op(["ck"])
    assert os.listdir(tmp_path) == []  # nothing saved under a name made of the list


def test_geo_steps_with_missing_or_misshapen_params_send_nothing(servers):
    g = servers(1, mode="geo")
    with PSClient(g.endpoints, trainer_id=0, num_trainers=1, mode="geo", k_steps=1, timeout=TIMEOUT,
                  min_block_size=4) as c:
        params = c.init(PARAMS)
        with pytest.raises(PsConfigError, match=r"^geo mode needs every registered parameter \('w', 'b'\), got 'w'$"):
            c.geo_step({"w": params["w"] + 1})
        with pytest.raises(PsConfigError, match=r"^w: shape \(2,\) differs from the registered \(4, 2\)$"):
            c.geo_step({"w": np.ones(2, np.float32), "b": params["b"]})  # would broadcast against the base
        assert g.servers[0].stats["updates"] == 0
        np.testing.assert_array_equal(c.pull()["w"], PARAMS["w"])


# ------------------------------------------------------------------ big models


def test_a_model_of_thousands_of_parameter_tensors_registers_and_trains_on_one_pserver(servers):
    # 2,000 tensors with long names: a 160 KB `init` header, over the 64 KiB the pserver refused unread (the
    # trainer then waited for its timeout: the refusal could not name the request)
    g = servers(1)
    params = {f"model.encoder.layer{i:04d}.attention.output.dense.weight": np.full(4, i, np.float32)
              for i in range(2000)}
    with PSClient(g.endpoints, trainer_id=0, num_trainers=1, timeout=TIMEOUT) as c:
        got = c.init(params)
        assert len(got) == 2000 and got["model.encoder.layer1999.attention.output.dense.weight"][0] == 1999
        after = c.push_pull({name: np.ones(4, np.float32) for name in params})
        assert len(after) == 2000 and all(a.shape == (4,) for a in after.values())


def test_a_request_over_the_header_limit_fails_at_once_naming_it(servers, monkeypatch):
    from clusterctl.ps import protocol

    monkeypatch.setattr(protocol, "MAX_HEADER_BYTES", 4096)
    g = servers(1)
    params = {f"p{i:03d}": np.zeros(2, np.float32) for i in range(200)}
    with PSClient(g.endpoints, trainer_id=0, num_trainers=1, timeout=TIMEOUT) as c:
        with pytest.raises(PsError, match=r"^a 'init' header of 200 tensor\(s\) is \d+ bytes \(limit 4096\): send "
                                          r"fewer tensors at once, or spread them over more pservers$"):
            c.init(params)


@pytest.mark.parametrize("chunk", [protocol.DEFAULT_CHUNK_BYTES, 16 << 20])
def test_a_timeout_with_a_chunk_size_of_its_own_says_it_must_match_the_pservers(chunk, monkeypatch):
    """A trainer's frames over a pserver's limit are dropped without a word: the timeout was all it saw."""
    monkeypatch.setattr(protocol, "CHUNK_BYTES", chunk)  # what CLUSTERCTL_PS_CHUNK_BYTES set at import
    with PSClient(["127.0.0.1:9"], trainer_id=0, num_trainers=1, timeout=TIMEOUT) as c:  # nothing answers there
        with pytest.raises(PsTimeoutError) as err:
            c.ping(timeout=0.3)
    hint = ("" if chunk == protocol.DEFAULT_CHUNK_BYTES else
            " (CLUSTERCTL_PS_CHUNK_BYTES=16777216 here, not the default 4194304: every pserver must have the same "
            "value, or each side drops the other's larger frames without a reply)")
    assert str(err.value) == f"no reply to 'ping' within 0.3s from pserver(s) 127.0.0.1:9{hint}"
