"""from_env: the GUIDE section 2 contract parsed into PsEnv, with errors that name the variable."""

from __future__ import annotations

import pytest

from clusterctl.ps import PsConfigError, PsEnv, PSClient, client_from_env, from_env, server_from_env

pytestmark = pytest.mark.timeout(10)

BASE = {
    "PADDLE_PSERVERS_IP_PORT_LIST": "10.0.0.2:6170,10.0.0.3:6170",
    "PADDLE_TRAINERS_NUM": "3",
    "CLUSTERCTL_JOB": "j1",
}


def test_pserver_env():
    env = {**BASE, "TRAINING_ROLE": "PSERVER", "PADDLE_CURRENT_ENDPOINT": "10.0.0.3:6170", "PADDLE_PSERVER_ID": "1",
           "CLUSTERCTL_PS_MODE": "geo", "CLUSTERCTL_PS_K_STEPS": "8", "CLUSTERCTL_PS_BARRIER_TIMEOUT": "30"}
    assert from_env(env) == PsEnv("pserver", ("10.0.0.2:6170", "10.0.0.3:6170"), "10.0.0.3:6170", 0, 3, 1,
                                  "geo", 8, "j1", 30.0, 90.0, None)


def test_trainer_env_defaults():
    env = {**BASE, "TRAINING_ROLE": "TRAINER", "PADDLE_TRAINER_ID": "2", "POD_IP": "10.0.0.9", "PADDLE_PORT": "7000"}
    pe = from_env(env)
    assert (pe.role, pe.trainer_id, pe.current_endpoint, pe.mode, pe.k_steps, pe.timeout) == (
        "trainer", 2, "10.0.0.9:7000", "sync", 1, 360.0)


def test_pserver_id_falls_back_to_position():
    env = {**BASE, "TRAINING_ROLE": "PSERVER", "POD_IP": "10.0.0.3", "PADDLE_PORT": "6170"}
    assert from_env(env).pserver_id == 1


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"TRAINING_ROLE": "WORKER"}, "TRAINING_ROLE must be TRAINER or PSERVER, got 'WORKER'"),
        ({"TRAINING_ROLE": "TRAINER", "PADDLE_PSERVERS_IP_PORT_LIST": ""},
         "environment variable PADDLE_PSERVERS_IP_PORT_LIST is not set"),
        ({"TRAINING_ROLE": "TRAINER"}, "environment variable PADDLE_TRAINER_ID is not set"),
        ({"TRAINING_ROLE": "TRAINER", "PADDLE_TRAINER_ID": "3"}, "PADDLE_TRAINER_ID=3 is outside 0..2"),
        ({"TRAINING_ROLE": "TRAINER", "PADDLE_TRAINER_ID": "x"},
         "environment variable PADDLE_TRAINER_ID='x' is not an integer"),
        ({"TRAINING_ROLE": "TRAINER", "PADDLE_TRAINER_ID": "0", "CLUSTERCTL_PS_MODE": "hogwild"},
         "CLUSTERCTL_PS_MODE must be sync, async or geo, got 'hogwild'"),
        ({"TRAINING_ROLE": "TRAINER", "PADDLE_TRAINER_ID": "0", "CLUSTERCTL_PS_K_STEPS": "0"},
         "CLUSTERCTL_PS_K_STEPS must be >= 1, got 0"),
        ({"TRAINING_ROLE": "PSERVER"}, "a pserver needs PADDLE_CURRENT_ENDPOINT (or POD_IP and PADDLE_PORT)"),
        ({"TRAINING_ROLE": "PSERVER", "PADDLE_CURRENT_ENDPOINT": "10.0.0.3:6170", "PADDLE_PSERVER_ID": "0"},
         "PADDLE_PSERVER_ID=0 does not name 10.0.0.3:6170 in PADDLE_PSERVERS_IP_PORT_LIST=10.0.0.2:6170,10.0.0.3:6170"),
        ({"TRAINING_ROLE": "PSERVER", "PADDLE_CURRENT_ENDPOINT": "10.0.0.4:6170"},
         "environment variable PADDLE_PSERVER_ID is not set"),
        ({"TRAINING_ROLE": "TRAINER", "PADDLE_PSERVERS_IP_PORT_LIST": "10.0.0.2"},
         "endpoint '10.0.0.2' is not HOST:PORT"),
    ],
)
def test_env_errors(extra, message):
    with pytest.raises(PsConfigError) as err:
        from_env({**BASE, **extra})
    assert str(err.value) == message


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({}, "pserver 1: no job token: CLUSTERCTL_JOB_TOKEN is not set (clusterctl's supervisor sets it); "
             "set CLUSTERCTL_AUTH=none to run unauthenticated"),
        ({"CLUSTERCTL_AUTH": "token"}, "pserver 1: no job token: CLUSTERCTL_JOB_TOKEN is not set (clusterctl's "
                                       "supervisor sets it); set CLUSTERCTL_AUTH=none to run unauthenticated"),
        ({"CLUSTERCTL_AUTH": "None", "CLUSTERCTL_JOB_TOKEN": "t"},
         "pserver 1: CLUSTERCTL_AUTH must be 'token' or 'none', got 'None'"),
    ],
)
def test_a_pserver_from_an_env_without_a_token_is_refused(extra, message):
    env = {**BASE, "TRAINING_ROLE": "PSERVER", "PADDLE_CURRENT_ENDPOINT": "10.0.0.3:6170", **extra}
    with pytest.raises(PsConfigError) as err:
        server_from_env(env=env)  # the explicit mapping is read, not os.environ (which holds the tests' token)
    assert str(err.value) == message


def test_trainers_and_pservers_from_an_env_take_its_token_or_auth_none():
    env = {**BASE, "TRAINING_ROLE": "TRAINER", "PADDLE_TRAINER_ID": "1"}
    with pytest.raises(PsConfigError, match=r"^trainer 1: no job token"):
        client_from_env(env=env)
    for auth in ({"CLUSTERCTL_JOB_TOKEN": "t"}, {"CLUSTERCTL_AUTH": "none"}):
        client_from_env(env={**env, **auth}).close()
        server_from_env(env={**env, **auth, "TRAINING_ROLE": "PSERVER", "PADDLE_CURRENT_ENDPOINT": "10.0.0.3:6170"})


@pytest.mark.parametrize(("extra", "message"), [
    # 10**18 trainers: a set of every id rebuilt at each barrier check (MemoryError), a missing list too large to
    # send; a geo k_steps of 23 digits: the pserver refused the header and the trainer saw only a timeout
    ({"TRAINING_ROLE": "TRAINER", "PADDLE_TRAINERS_NUM": str(10**18)},
     "environment variable PADDLE_TRAINERS_NUM=1000000000000000000 is more than 65,536"),
    ({"TRAINING_ROLE": "TRAINER", "PADDLE_TRAINER_ID": "1", "CLUSTERCTL_PS_K_STEPS": "9" * 23},
     f"environment variable CLUSTERCTL_PS_K_STEPS={'9' * 23} is more than 1,000,000,000"),
    # read with a bare int() when the protocol was imported: a traceback; 0 or 7 failed at the first send
    ({"TRAINING_ROLE": "TRAINER", "PADDLE_TRAINER_ID": "1", "CLUSTERCTL_PS_CHUNK_BYTES": "garbage"},
     "environment variable CLUSTERCTL_PS_CHUNK_BYTES='garbage' is not an integer"),
    ({"TRAINING_ROLE": "TRAINER", "PADDLE_TRAINER_ID": "1", "CLUSTERCTL_PS_CHUNK_BYTES": "7"},
     "CLUSTERCTL_PS_CHUNK_BYTES must be a positive multiple of 8, got 7"),
])
def test_counts_and_sizes_out_of_bounds_are_one_line(extra, message):
    with pytest.raises(PsConfigError) as err:
        from_env({**BASE, **extra})
    assert str(err.value) == message


def test_a_barriers_missing_trainers_are_listed_up_to_a_point():
    from clusterctl.ps.errors import BarrierTimeoutError

    err = BarrierTimeoutError(range(5, 65536), 8.0, 3)
    assert str(err) == ("sync barrier for step 3 timed out after 8s; missing trainer id(s): "
                        + ", ".join(map(str, range(5, 21))) + ", ... (65,531 in all)")
    assert len(err.missing) == 65531  # the reply still names every one (the ids of a job fit in one header)


PIPELINE_WORDS = "(1, true, yes, on or 0, false, no, off)"


@pytest.mark.parametrize(("raw", "pipeline"), [
    (None, True), ("", True), ("1", True), ("true", True), ("Yes", True), ("ON", True),
    ("0", False), ("false", False), ("FALSE", False), ("no", False), ("Off", False), (" off\n", False),
])
def test_the_pipeline_switch_takes_the_collectives_words(raw, pipeline, monkeypatch):
    """CLUSTERCTL_PS_PIPELINE=false, off or no left pipelining on (only 0 turned it off)."""
    env = {**BASE, "TRAINING_ROLE": "TRAINER", "PADDLE_TRAINER_ID": "1"}
    if raw is not None:
        env["CLUSTERCTL_PS_PIPELINE"] = raw
    assert from_env(env).pipeline is pipeline
    with client_from_env(env={**env, "CLUSTERCTL_JOB_TOKEN": "t"}) as c:  # the mapping's value, not os.environ's
        assert c.pipeline is pipeline
    monkeypatch.delenv("CLUSTERCTL_PS_PIPELINE", raising=False)
    if raw is not None:
        monkeypatch.setenv("CLUSTERCTL_PS_PIPELINE", raw)
    with PSClient(["127.0.0.1:1"], trainer_id=0, num_trainers=1) as c:  # a client made without from_env
        assert c.pipeline is pipeline


@pytest.mark.parametrize("raw", ["2", "-1", "maybe", "flase", "enabled", "o n"])
def test_a_pipeline_switch_that_is_no_switch_is_refused_by_name(raw, monkeypatch):
    message = f"environment variable CLUSTERCTL_PS_PIPELINE={raw!r} is not a switch {PIPELINE_WORDS}"
    for role in ({"TRAINING_ROLE": "TRAINER", "PADDLE_TRAINER_ID": "1"},
                 {"TRAINING_ROLE": "PSERVER", "PADDLE_CURRENT_ENDPOINT": "10.0.0.3:6170"}):
        with pytest.raises(PsConfigError) as err:
            from_env({**BASE, **role, "CLUSTERCTL_PS_PIPELINE": raw})
        assert str(err.value) == message
    monkeypatch.setenv("CLUSTERCTL_PS_PIPELINE", raw)
    with pytest.raises(PsConfigError) as err:
        PSClient(["127.0.0.1:1"], trainer_id=0, num_trainers=1)
    assert str(err.value) == message
    with pytest.raises(PsConfigError) as err:
        PSClient(["127.0.0.1:1"], trainer_id=0, num_trainers=1, pipeline="off")  # the argument is a bool
    assert str(err.value) == "pipeline must be True, False or None (from CLUSTERCTL_PS_PIPELINE), got 'off'"
