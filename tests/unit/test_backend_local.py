"""backend: local, through the CLI as a user runs it: the examples train on this machine under the host
supervisor (the same plan, env contract, restarts, status and logs as over SSH), stop leaves no orphan,
and what the backend cannot honour is refused at its line."""

from __future__ import annotations

import json
import shutil
import sys
import uuid
from pathlib import Path

import pytest
import yaml

from clusterctl import cli
from helpers import free_port_base, job_pids

ROOT = Path(__file__).resolve().parents[2]
PY = sys.executable


@pytest.fixture
def home(tmp_path, monkeypatch):
    """The local backend works in $HOME (as an ssh session would): a private one per test, caches too."""
    h = tmp_path / "home"
    h.mkdir()
    monkeypatch.setenv("HOME", str(h))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    return h


def local_spec(tmp_path: Path, example: str, job: dict, **top) -> tuple[Path, str]:
    name = f"loc-{uuid.uuid4().hex[:8]}"
    base = free_port_base(24)
    spec = {"name": name, "backend": "local", "hosts": [{"address": "localhost"}],
            "workspace": {"local": str(ROOT / "examples" / example), "remote": f"clusterctl-local/{name}"},
            "job": {"entrypoint": [PY, "train.py"], "grace": 3,
                    "ports": {"control": base, "master": base + 1, "pserver": base + 2, "trainer": base + 12},
                    **job},
            **top}
    path = tmp_path / "local.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path, name


def run(capsys, *argv) -> tuple[int, str, str]:
    code = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_torch_gloo_trains_on_this_machine_and_status_says_so(home, tmp_path, capsys):
    spec, name = local_spec(tmp_path, "torch_gloo", {"trainers": 2, "env": {"STEPS": "12"}})
    code, out, err = run(capsys, "start", "--dispatch", "--follow", spec)
    assert code == 0, out + err
    assert "[localhost trainer.1] done rank=1 world=2" in out, out
    code, out, _ = run(capsys, "status", "--json", spec)
    st = json.loads(out)
    assert (code, st["backend"], st["state"]) == (0, "local", "succeeded"), st
    assert [(p["role"], p["id"], p["state"], p["exit_code"]) for p in st["processes"]] == [
        ("trainer", 0, "exited", 0), ("trainer", 1, "exited", 0)]
    assert not job_pids(name)


def test_a_failed_attempt_is_restarted_and_both_attempts_are_logged(home, tmp_path, capsys):
    spec, name = local_spec(tmp_path, "fit_a_line",
                            {"mode": "pserver", "pservers": 1, "trainers": 2, "restarts": 1, "restart_backoff": 1,
                             "env": {"FIT_A_LINE_PASSES": "2"}},
                            data={"local": str(ROOT / "examples" / "fit_a_line" / "data"), "pattern": "*.csv"})
    # trainer 1 fails in the first attempt only (the attempt number is in its environment)
    wrapper = home / "fail_first.sh"
    wrapper.write_text('[ "$CLUSTERCTL_RESTART_COUNT" = 0 ] && [ "$PADDLE_TRAINER_ID" = 1 ] && exit 7\n'
                       f'exec {PY} train.py "$@"\n')
    data = yaml.safe_load(spec.read_text())
    data["job"]["entrypoint"] = ["sh", str(wrapper)]
    spec.write_text(yaml.safe_dump(data, sort_keys=False))
    code, out, err = run(capsys, "start", "--dispatch", "--follow", spec)
    assert code == 0, out + err
    code, out, _ = run(capsys, "status", "--json", spec)
    st = json.loads(out)
    assert (st["state"], st["attempt"], st["restarts"]) == ("succeeded", 1, 1), st
    assert st["attempts"][0]["outcome"] == "failed" and "trainer.1 on localhost exited with code 7" in st["attempts"][0]["reason"]
    code, out, _ = run(capsys, "logs", "--role", "trainer", "--id", "1", spec)
    assert code == 0 and "[localhost trainer.1#1] step=0 " in out, out  # the second attempt's log, named so
    assert not job_pids(name)


def test_mpi_abort_fails_the_job_naming_the_rank_and_the_code(home, tmp_path, capsys):
    """An unmodified mpi4py program under the host supervisor (the one every backend runs): rank 1's MPI_Abort(3)
    ends every rank, and the job's reason names the rank, the code and why, from the rank's abort.json."""
    pytest.importorskip("mpi4py.MPI")
    ws = tmp_path / "ws"
    ws.mkdir()
    shutil.copy(ROOT / "tests/integration/jobs/mpi_abort.py", ws / "abort.py")
    spec, name = local_spec(tmp_path, "torch_gloo", {"mode": "collective", "trainers": 2,
                                                     "entrypoint": [PY, "-m", "clusterctl.collective", "abort.py"]})
    data = yaml.safe_load(spec.read_text())
    data["workspace"]["local"] = str(ws)
    data["job"]["env"] = {"MPIR_CVAR_CH4_CMA_ENABLE": "0"}
    spec.write_text(yaml.safe_dump(data, sort_keys=False))
    code, out, err = run(capsys, "start", "--dispatch", "--follow", spec)
    assert code != 0 and "not reached" not in out, out + err
    code, out, _ = run(capsys, "status", "--json", spec)
    st = json.loads(out)
    assert st["state"] == "failed" and st["reason"] == (
        "localhost: trainer.1 on localhost exited with code 3 (rank 1 called MPI_Abort with error code 3)"), st
    assert not job_pids(name)


def test_stop_leaves_no_process_of_the_job(home, tmp_path, capsys):
    spec, name = local_spec(tmp_path, "torch_gloo", {"trainers": 2, "entrypoint": ["sleep", "300"]})
    code, out, err = run(capsys, "start", "--dispatch", spec)
    assert code == 0, out + err
    assert len(job_pids(name)) >= 2
    code, out, _ = run(capsys, "stop", spec)
    assert code == 0 and f"job {name} stopped on 1 host(s), 2 process(es) killed" in out, out
    assert not job_pids(name)
    code, out, _ = run(capsys, "stop", spec)
    assert code == 0 and f"job {name} is not running" in out


@pytest.mark.parametrize("extra, where", [
    ({"hosts": [{"address": "localhost"}, {"address": "10.0.0.2"}]},
     "hosts: not supported… "),
    ({"hosts": [{"address": "10.0.0.2"}]}, "hosts[0]: backend: local runs on this machine, not on 10.0.0.2"),
    ({"ssh": {"user": "me"}}, "ssh: not supported with backend: local: no SSH: the job runs on this machine"),
    ({"launcher": "mpi"},
     "job.launcher: not supported with backend: local: launcher: mpi runs mpiexec over an ssh mesh"),
    ({"hosts": [{"address": "localhost", "proxy_jump": ["b"]}]},
     "hosts[0].proxy_jump: not supported with backend: local: no SSH: the job runs on this machine"),
])
def test_what_the_local_backend_cannot_honour_is_refused_at_its_key(home, tmp_path, capsys, extra, where):
    job = {"trainers": 1, **({"launcher": extra.pop("launcher")} if "launcher" in extra else {})}
    spec, _ = local_spec(tmp_path, "torch_gloo", job, **extra)
    code, _, err = run(capsys, "validate", spec)
    if where.endswith("… "):
        where = "hosts: backend: local runs on this machine: hosts: [localhost] (got 2 hosts)"
    assert code == 2 and where in err, err
    line = err.strip().splitlines()
    assert len(line) == 1 and line[0].startswith(f"{spec}:"), err


def test_exec_and_provision_say_they_need_ssh_hosts(home, tmp_path, capsys):
    spec, _ = local_spec(tmp_path, "torch_gloo", {"trainers": 1})
    code, _, err = run(capsys, "exec", spec, "--", "true")
    assert code == 2 and "this command works on SSH hosts; with backend: local use dispatch, start" in err, err


def test_logs_to_an_output_that_cannot_take_them_is_one_line_not_a_hang(home, tmp_path, capsys):
    """`logs > /dev/full`: the thread that read the log stream died on ENOSPC, the stream's writer then blocked on
    a full pipe, and `logs` never returned; with `-n 1` it exited 0 having written nothing. Now: one line, exit 1."""
    import os
    import subprocess

    workspace = tmp_path / "ws"
    workspace.mkdir()
    (workspace / "train.py").write_text("import time\nfor i in range(3000):\n    print('line', i, 'x' * 100)\n"
                                        "time.sleep(60)\n")
    spec, name = local_spec(tmp_path, "torch_gloo", {"trainers": 1})
    spec.write_text(spec.read_text().replace(str(ROOT / "examples" / "torch_gloo"), str(workspace)))
    assert run(capsys, "start", "--dispatch", spec)[0] == 0
    try:
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        for lines in (["-n", "5"], ["-n", "1"], []):
            with open("/dev/full", "w") as full:
                res = subprocess.run([PY, "-m", "clusterctl.cli", "logs", str(spec), *lines], stdout=full,
                                     stderr=subprocess.PIPE, text=True, env=env, timeout=60, cwd=tmp_path)
            assert (res.returncode, res.stderr) == (1, "clusterctl: error: cannot write the output: No space left on "
                                                       "device\n"), lines
        for argv in (["status", str(spec)], ["logs", str(spec), "-n", "1"]):  # `>&-`: a traceback, or a hang
            res = subprocess.run([PY, "-m", "clusterctl.cli", *argv], stderr=subprocess.PIPE, text=True, env=env,
                                 timeout=60, cwd=tmp_path, preexec_fn=lambda: os.close(1))
            assert (res.returncode, res.stderr) == (1, "clusterctl: error: standard output is closed\n"), argv
    finally:
        assert run(capsys, "stop", spec)[0] == 0
    assert job_pids(name) == []
