"""The command-line front ends of the operations (`clusterctl dispatch/start/status/logs/stop/exec/provision/
doctor`, and the same commands for `backend: slurm`) over fake hosts: clusterctl.cli.main with every Remote it
opens going to host directories on this machine (tests/unit/fakehosts.py)."""

import json
import os
import re
import socket
import sys
import threading

import pytest
import yaml

from clusterctl.cli import main

sys.path.insert(0, os.path.dirname(__file__))
from fakehosts import FakeCluster, FaultyTransport, fake_exe, job_pids, refused, wait_until  # noqa: E402

TRAIN = """\
import os, sys, time
print("step of rank", os.environ["RANK"], flush=True)
time.sleep(float(os.environ.get("SLEEP", "0")))
sys.exit(int(os.environ.get("EXIT", "0")))
"""


def cli(capsys, *argv):
    """(exit code, stdout, stderr) of `clusterctl ARGV`."""
    code = main([str(a) for a in argv])
    got = capsys.readouterr()
    return code, got.out, got.err


def test_dispatch_start_status_logs_stop_from_the_command_line(tmp_path, monkeypatch, capsys):
    c = FakeCluster(tmp_path, files={"train.py": TRAIN}, job={"env": {"SLEEP": "30"}}).everywhere(monkeypatch)
    spec = c.spec_path
    code, out, _ = cli(capsys, "dispatch", spec)
    assert code == 0 and "n0" in out and "n1" in out and "generation" in out
    code, out, err = cli(capsys, "start", spec)
    assert code == 0 and "started in" in out and "running" in out
    assert "launching…" in err
    code, out, _ = cli(capsys, "status", spec, "--json")
    doc = json.loads(out)
    assert code == 0 and doc["state"] == "running"
    assert [(p["host"], p["role"], p["id"], p["state"]) for p in doc["processes"]] == [
        ("n0", "trainer", 0, "running"), ("n1", "trainer", 1, "running")]
    code, out, _ = cli(capsys, "status", spec)
    assert code == 0 and f"job {c.name}: running" in out
    wait_until(lambda: all((c.workspace(i).parent / f"{c.remote_dir}.logs" / f"trainer.{i}.log").exists() and
                           (c.workspace(i).parent / f"{c.remote_dir}.logs" / f"trainer.{i}.log").read_text()
                           for i in (0, 1)))
    code, out, _ = cli(capsys, "logs", spec, "--role", "trainer", "-n", "5")
    assert code == 0
    assert sorted(out.splitlines()) == ["[n0 trainer.0] step of rank 0", "[n1 trainer.1] step of rank 1"]
    code, out, _ = cli(capsys, "stop", spec)
    assert code == 0 and f"job {c.name} stopped on 2 host(s)" in out
    assert job_pids(c.name) == []
    code, out, _ = cli(capsys, "stop", spec)
    assert (code, out.strip()) == (0, f"job {c.name} is not running")
    code, out, _ = cli(capsys, "status", spec)
    assert code == 0 and f"job {c.name}: stopped" in out


def test_start_follow_streams_the_logs_and_exits_with_the_jobs_state(tmp_path, monkeypatch, capsys):
    """The logs end with the processes; the exit code and the final status wait for the job's verdict (it said
    `running` and exit 1 for a job that succeeded, when the coordinator had not decided yet)."""
    c = FakeCluster(tmp_path, files={"train.py": TRAIN}, job={"env": {"EXIT": "0"}}).everywhere(monkeypatch)
    code, out, _ = cli(capsys, "start", c.spec_path, "--dispatch", "--follow")
    assert code == 0, out
    assert "dispatched: 2 file(s)" in out  # one per host
    assert "[n0 trainer.0] step of rank 0" in out.splitlines() and "[n1 trainer.1] step of rank 1" in out.splitlines()
    assert "succeeded" in out
    data = yaml.safe_load(c.spec_path.read_text())
    data["job"]["env"].update(EXIT="4", SLEEP="2")  # time for the peer to join before the coordinator fails fast
    c.spec_path.write_text(yaml.safe_dump(data))
    code, out, _ = cli(capsys, "start", c.spec_path, "--dispatch", "--follow")
    assert code == 1
    final = out.split("step of rank")[-1]  # after the logs: the final status
    assert f"job {c.name}: failed" in final and re.search(r"│ failed +│ 4 ", final)
    assert re.search(r"reason: n0(, n1)?: trainer\.\d on n\d exited with code 4$", final, re.M)


@pytest.mark.parametrize("sig, code, said", [("SIGINT", 130, "interrupted"), ("SIGTERM", 143, "terminated")])
def test_ctrl_c_or_sigterm_while_following_stops_the_job(tmp_path, monkeypatch, capsys, sig, code, said):
    """Ctrl+C, and SIGTERM (a CI runner's cancel, `timeout`, a batch time limit), while `start --follow` owns the
    job: it is stopped everywhere; afterwards SIGTERM is this process's own again."""
    import signal

    c = FakeCluster(tmp_path, files={"train.py": TRAIN}, hosts=1, job={"env": {"SLEEP": "60"}}).everywhere(monkeypatch)
    log = c.home(0) / f"{c.remote_dir}.logs" / "trainer.0.log"

    late = []

    def interrupt_once_running():
        try:
            wait_until(lambda: log.exists() and log.read_text(), timeout=50)
        except AssertionError as exc:  # interrupted all the same (the command must not run for the trainer's 60 s)
            late.append(exc)
        os.kill(os.getpid(), getattr(signal, sig))

    before = signal.getsignal(signal.SIGTERM)
    t = threading.Thread(target=interrupt_once_running, daemon=True)
    t.start()
    got, out, err = cli(capsys, "start", c.spec_path, "--dispatch", "--follow")
    t.join()
    assert not late, f"the trainer's log stayed empty: {late[0]}\n{out}\n{err}"
    assert got == code, (out, err)
    assert f"{said}: stopping the job" in err
    assert f"job {c.name}: stopped" in out
    assert job_pids(c.name) == []
    assert signal.getsignal(signal.SIGTERM) is before


def test_ctrl_c_while_a_host_hangs_exits_130_and_says_the_stop_did_not_reach_it(tmp_path, monkeypatch, capsys):
    """Ctrl+C during `start` while one host does not answer: the stop that follows cannot reach that host either;
    that is said in one line, and the exit code is still the interrupt's (it was the stop's error, exit 1)."""
    import signal

    c = FakeCluster(tmp_path, files={"train.py": TRAIN})
    c.everywhere(monkeypatch)
    assert cli(capsys, "dispatch", c.spec_path)[0] == 0
    # n1 takes the start and never answers; the stop's fresh connection to it is refused
    hung = FaultyTransport(c.transport, hung={"n1"}, only=" agent up")
    c.everywhere(monkeypatch, transport=FaultyTransport(hung, down={"n1"}, only=" stop "))
    threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGINT)).start()
    got, out, err = cli(capsys, "start", c.spec_path)
    assert got == 130, (out, err)
    lines = err.splitlines()
    assert "interrupted: stopping the job…" in lines and "Traceback" not in err
    said = [line for line in lines if line.startswith("clusterctl: error: interrupted, but the stop did not complete:")]
    assert len(said) == 1 and "n1" in said[0], err


def test_status_exits_1_when_a_host_is_unreachable(tmp_path, monkeypatch, capsys):
    c = FakeCluster(tmp_path, files={"train.py": TRAIN})
    c.everywhere(monkeypatch, transport=FaultyTransport(c.transport, down={"n1"}))
    code, out, _ = cli(capsys, "status", c.spec_path)
    assert code == 1
    assert re.search("n1: " + refused("n1"), out) and "lost" in out
    code, out, err = cli(capsys, "dispatch", c.spec_path)
    assert code != 0 and "dispatch failed on 1 host(s): n1" in err and re.search(refused("n1"), err)


def test_a_stop_that_cannot_reach_a_host_says_what_it_did_on_the_others(tmp_path, monkeypatch, capsys):
    # one host down: the stop's error named it, and nothing said that the job had been stopped on the other
    c = FakeCluster(tmp_path, files={"train.py": TRAIN}, job={"env": {"SLEEP": "30"}}).everywhere(monkeypatch)
    assert cli(capsys, "start", c.spec_path, "--dispatch")[0] == 0
    try:
        c.everywhere(monkeypatch, transport=FaultyTransport(c.transport, down={"n1"}))
        code, out, err = cli(capsys, "stop", c.spec_path)
        assert code == 1 and out == f"job {c.name} stopped on 1 host(s) (1 host(s) did not answer), 1 process(es) killed\n"
        assert "stop failed on 1 host(s): n1" in err and re.search(refused("n1"), err)
    finally:
        c.everywhere(monkeypatch)
        cli(capsys, "stop", c.spec_path)
    assert job_pids(c.name) == []


def test_exec_runs_one_argv_everywhere_and_exits_with_the_worst_code(tmp_path, monkeypatch, capsys):
    c = FakeCluster(tmp_path).everywhere(monkeypatch)
    script = 'echo "on $(basename "$HOME") with $1"; [ "$(basename "$HOME")" = n1 ] && exit 3; exit 0'
    code, out, err = cli(capsys, "exec", c.spec_path, "--", "sh", "-c", script, "sh", "a b; not a command")
    assert code == 3
    assert sorted(out.splitlines()) == ["[n0] on n0 with a b; not a command", "[n1] on n1 with a b; not a command"]
    assert "[n1] exit 3" in err
    code, out, err = cli(capsys, "exec", "--timeout", "0.5", c.spec_path, "--", "sleep", "20")
    assert code == 124 and "[n0] exit 124 (--timeout 0.5s)" in err
    code, out, err = cli(capsys, "exec", "--timeout", "30", c.spec_path, "--", "sh", "-c", "exit 124")  # its own
    assert code == 124 and "[n0] exit 124\n" in err and "--timeout" not in err
    code, out, err = cli(capsys, "exec", c.spec_path)
    assert code == 2 and "exec needs a command after --" in err
    code, out, err = cli(capsys, "exec", c.spec_path, "--", "")  # `-- "$CMD"`, CMD unset: was sent to every host
    assert (code, out) == (2, "") and "exec needs a command after --" in err
    c.everywhere(monkeypatch, transport=FaultyTransport(c.transport, down={"n0"}))
    code, out, err = cli(capsys, "exec", c.spec_path, "--", "true")
    assert code == 255 and re.search(refused("n0"), err)


def test_a_plan_problem_is_reported_at_its_key(tmp_path, monkeypatch, capsys):
    c = FakeCluster(tmp_path).everywhere(monkeypatch)
    data = yaml.safe_load(c.spec_path.read_text())
    data["job"]["ports"]["trainer"] = data["job"]["ports"]["control"]
    c.spec_path.write_text(yaml.safe_dump(data, sort_keys=False))
    code, out, err = cli(capsys, "status", c.spec_path)
    assert code == 2
    lines = c.spec_path.read_text().splitlines()
    n = lines.index("  ports:") + 1
    port = data["job"]["ports"]["control"]
    assert err == (f"{c.spec_path}:{n}:3: job.ports: two planned endpoints on 127.0.0.1:{port}: "
                   "the job's control port and trainer.0\n")
    # one found only once the hosts are resolved as ssh resolves them: two aliases of one machine
    (tmp_path / "ssh_config").write_text("Host n0 n1\n    HostName 127.0.0.1\n")
    data = yaml.safe_load(c.spec_path.read_text())
    data["job"]["ports"]["trainer"] = data["job"]["ports"]["control"] + 2
    data["ssh"]["config"] = "ssh_config"
    for h in data["hosts"]:
        del h["train_address"]
    c.spec_path.write_text(yaml.safe_dump(data, sort_keys=False))
    code, out, err = cli(capsys, "status", c.spec_path)
    lines = c.spec_path.read_text().splitlines()
    assert code == 2 and err.startswith(f"{c.spec_path}:{lines.index('- address: n1') + 1}:3: hosts[1]: n1 and hosts[0] (n0) "
                                        "both resolve to 127.0.0.1: ")


def test_provision_and_doctor_from_the_command_line(tmp_path, monkeypatch, capsys):
    section = {"timeout": 30, "commands": [{"name": "mark", "run": "echo made | tee marker", "creates": "marker"},
                                           {"name": "nope", "run": "[ \"$(basename $HOME)\" != n1 ]", "unless": "false"}]}
    c = FakeCluster(tmp_path, extra={"provision": section}).everywhere(monkeypatch)
    os.utime(c.spec_path, (1e9, 1e9))  # an old spec: its plan is cached by the first command, reused by the next
    code, out, _ = cli(capsys, "provision", c.spec_path, "--check")
    assert code == 0 and "--check (nothing was changed)" in out and "would change" in out
    assert not (c.home(0) / "marker").exists()
    code, out, err = cli(capsys, "provision", c.spec_path, "--lines")
    assert code == 1
    assert "1 changed, 1 failed, 0 ok" in out
    assert "command nope exited 1" in out
    assert "[n0] [commands] made" in err.splitlines()  # --lines: each host's output as it comes
    assert "CLUSTERCTL_STEP" not in err  # status lines are not echoed
    assert (c.home(0) / "marker").read_text() == "made\n"
    assert len(list((tmp_path / "cache" / "clusterctl" / "plans").glob("*.json"))) == 1
    code, out, err = cli(capsys, "provision", c.spec_path, "--only", "apt")
    assert code != 0 and "--only apt: the spec's provision section has no apt step" in err
    code, out, _ = cli(capsys, "doctor", c.spec_path)
    assert "ssh          │ ok" in out
    venv = [[cell.strip() for cell in line.split("│")[2:4]] for line in out.splitlines() if line.startswith("│ venv ")]
    assert venv == [["-", "-"]], out  # the spec names no venv (was " (missing)")
    if not any(_listening(addr, 22) for addr in ("127.0.0.1", "127.0.0.2")):  # no sshd here: each host says so
        assert code == 1
        assert out.splitlines()[-3:] == ["problem: n0 cannot reach n1 (ssh): Connection refused",
                                         "problem: n1 cannot reach n0 (ssh): Connection refused", "2 problem(s)"]


def _listening(addr, port):
    try:
        socket.create_connection((addr, port), timeout=1).close()
    except OSError:
        return False
    return True


# ------------------------------------------------------------------------------------------- Slurm

# A fake Slurm (tests/unit/fakeslurm.py) on the fake hosts: sbatch runs the batch script for real on node1
# (home: the fake host 127.0.0.1), srun runs one task per node (node2: 127.0.0.2), scancel signals the job's
# process groups. The batch script, the glue (clusterctl/host/slurm.py) and the supervisors are the real ones.
# The failing rank fails once every rank of its attempt has said its line (files in the shared workspace): the
# supervisors stop the others at once, and a line not yet printed then would never be.
SLURM_TRAIN = """\
import os, sys, time
rank, attempt = int(os.environ["RANK"]), int(os.environ["CLUSTERCTL_RESTART_COUNT"])
print(f"rank {rank} attempt {attempt} token {len(os.environ.get('CLUSTERCTL_JOB_TOKEN', ''))}", flush=True)
open(f"said-{rank}-{attempt}", "w").close()
if str(rank) == os.environ.get("FAIL_RANK") and attempt < int(os.environ.get("FAIL_ATTEMPTS", "99")):
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not all(os.path.exists(f"said-{r}-{attempt}")
                                                  for r in range(int(os.environ["WORLD_SIZE"]))):
        time.sleep(0.01)
    sys.exit(3)
time.sleep(float(os.environ.get("SLEEP", "0")))
"""


def slurm_cluster(tmp_path, monkeypatch, workspace="shared", job=None, allocate=None):
    from fakeslurm import install

    c = FakeCluster(tmp_path, files={"train.py": SLURM_TRAIN}, hosts=2, job=job)  # free ports on 127.0.0.1 and .2
    data = yaml.safe_load(c.spec_path.read_text())
    data.pop("hosts")
    data.update(backend="slurm", slurm={"login": "login", "nodes": 2, "partition": "debug", "workspace": workspace})
    if workspace == "shared":  # an absolute path on the shared filesystem: here, the login host's directory
        data["workspace"]["remote"] = str(c.root / "login" / c.remote_dir)
    c.spec_path.write_text(yaml.safe_dump(data, sort_keys=False))
    c.slurm = tmp_path / "slurm"
    install(c.bin, c.slurm, c.root, 2, allocate=allocate)
    return c.everywhere(monkeypatch)


def _status(capsys, c) -> dict:
    code, out, _ = cli(capsys, "status", c.spec_path, "--json")
    assert code == 0, out
    return json.loads(out)


def _mode(path) -> str:
    return oct(os.stat(path).st_mode & 0o777)


def test_slurm_start_status_logs_and_stop(tmp_path, monkeypatch, capsys):
    c = slurm_cluster(tmp_path, monkeypatch, job={"env": {"SLEEP": "60"}, "restarts": 2})
    login, node1, node2 = c.root / "login", c.root / "127.0.0.1", c.root / "127.0.0.2"
    (c.slurm / "hold").touch()  # the job waits for its allocation
    code, out, _ = cli(capsys, "dispatch", c.spec_path)
    assert code == 0 and out.count("│ login") == 1, out  # the shared filesystem: the login node only
    code, out, _ = cli(capsys, "start", c.spec_path)
    assert code == 0 and "started in" in out
    script = (c.slurm / "script-4242.sh").read_text()
    assert re.findall(r"^#SBATCH (.*)$", script, re.MULTILINE) == [
        f"--job-name=clusterctl-{c.name}", "--nodes=2", "--ntasks-per-node=1", "--cpus-per-task=1",
        f"--output={login}/{c.remote_dir}.logs/slurm-%j.out", "--partition=debug"]
    record = json.loads((login / ".clusterctl" / "slurm" / f"{c.name}.json").read_text())
    assert record["slurm_job"] == "4242" and record["log_dir"] == f"{login}/{c.remote_dir}.logs"
    st = _status(capsys, c)
    assert (st["backend"], st["state"], st["reason"]) == ("slurm", "pending", "Slurm job 4242 PENDING (exit 0:0)")
    code, out, err = cli(capsys, "start", c.spec_path)
    assert code != 0 and f"clusterctl: error: job {c.name} is already pending as Slurm job 4242; stop it first " \
        "(clusterctl stop)\n" in err  # not `sbatch on login failed: ...`: sbatch never ran

    (c.slurm / "hold").unlink()  # the allocation: a supervisor on each node starts its trainer (once both joined)
    st = wait_until(lambda: (s := _status(capsys, c))["state"] == "running" and len(s["processes"]) == 2
                    and all(p["state"] == "running" for p in s["processes"]) and s)
    assert [(p["host"], p["role"], p["id"], p["state"]) for p in st["processes"]] == [
        ("node1", "trainer", 0, "running"), ("node2", "trainer", 1, "running")]
    assert (st["attempt"], st["restarts"]) == (0, 2) and all(p["pid"] for p in st["processes"])
    logs = login / f"{c.remote_dir}.logs"
    wait_until(lambda: all((logs / f"trainer.{i}.log").exists() and (logs / f"trainer.{i}.log").read_text() for i in (0, 1)))
    code, out, err = cli(capsys, "logs", c.spec_path, "--host", "n1")
    assert code != 0 and "--host selects nothing under backend: slurm" in err
    code, out, _ = cli(capsys, "logs", c.spec_path)
    assert code == 0 and sorted(out.splitlines()) == ["[node1 trainer.0] rank 0 attempt 0 token 64",
                                                      "[node2 trainer.1] rank 1 attempt 0 token 64"]

    # the files: the job's own directories and files are the user's alone; the token only in the job files
    jobdirs = [h / ".clusterctl" / "slurm" / "jobs" / c.name / f"4242-{n}" for h, n in ((node1, "node1"), (node2, "node2"))]
    for d in jobdirs:
        assert _mode(d) == "0o700" and _mode(d / "job.json") == "0o600" and _mode(d / "state.json") == "0o600"
    assert _mode(logs) == "0o700" and _mode(logs / "trainer.0.log") == "0o600" and _mode(logs / "slurm-4242.out") == "0o600"
    token = json.loads((jobdirs[0] / "job.json").read_text())["token"]
    assert len(token) == 64 and json.loads((jobdirs[1] / "job.json").read_text())["token"] == token
    assert token not in script and token not in (logs / "slurm-4242.out").read_text()
    assert all(token not in p.read_text() for p in logs.iterdir())

    code, out, _ = cli(capsys, "stop", c.spec_path)
    assert (code, out.strip()) == (0, f"job {c.name} stopped on 2 host(s) (Slurm job 4242 CANCELLED), 2 process(es) killed")
    assert job_pids(c.name) == []
    st = _status(capsys, c)
    assert st["state"] == "stopped" and st["reason"].startswith("Slurm job 4242 CANCELLED (exit 143:0) on node1,node2; ")
    assert {p["state"] for p in st["processes"]} == {"stopped"}
    code, out, _ = cli(capsys, "stop", c.spec_path)
    assert (code, out.strip()) == (0, f"job {c.name} is not running (Slurm job 4242 CANCELLED)")
    (c.slurm / "forget").touch()  # slurmctld forgot the job: sacct still knows it
    assert _status(capsys, c)["state"] == "stopped"
    (c.slurm / "forget-sacct").touch()  # neither knows it any more
    st = _status(capsys, c)
    assert (st["state"], st["reason"]) == ("unknown", "Slurm job 4242 is no longer known to Slurm")


def test_slurm_restarts_and_fail_fast_are_the_supervisors(tmp_path, monkeypatch, capsys):
    c = slurm_cluster(tmp_path, monkeypatch, job={"env": {"FAIL_RANK": "1", "FAIL_ATTEMPTS": "1", "SLEEP": "0.5"},
                                                   "restarts": 1, "restart_backoff": 1})
    code, out, err = cli(capsys, "start", c.spec_path, "--dispatch", "--follow")
    assert code == 0, out + err
    lines = out.splitlines()
    for line in ("[node1 trainer.0] rank 0 attempt 0 token 64", "[node2 trainer.1] rank 1 attempt 0 token 64",
                 "[node1 trainer.0#1] rank 0 attempt 1 token 64", "[node2 trainer.1#1] rank 1 attempt 1 token 64"):
        assert line in lines, out
    assert f"job {c.name}: succeeded" in out
    st = _status(capsys, c)
    assert (st["state"], st["attempt"]) == ("succeeded", 1)
    assert [(a["attempt"], a["outcome"], a["reason"]) for a in st["attempts"]] == [
        (0, "failed", "trainer.1 on node2 exited with code 3"), (1, "succeeded", "all 2 trainers exited 0")]

    # fail-fast: no restart left; trainer.1 fails, trainer.0 is stopped, nothing is left
    data = yaml.safe_load(c.spec_path.read_text())
    data["job"].update(restarts=0, env={"FAIL_RANK": "1", "SLEEP": "60"})
    c.spec_path.write_text(yaml.safe_dump(data, sort_keys=False))
    code, out, err = cli(capsys, "start", c.spec_path, "--follow")
    assert code == 1, out + err
    st = _status(capsys, c)
    assert st["state"] == "failed" and st["reason"].startswith("Slurm job 4243 FAILED (exit 1:0) on node1,node2; ")
    assert "trainer.1 on node2 exited with code 3" in st["reason"]
    assert [(p["host"], p["id"], p["state"], p["exit_code"]) for p in st["processes"]] == [
        ("node1", 0, "stopped", -15), ("node2", 1, "failed", 3)]
    assert job_pids(c.name) == []


def test_slurm_dispatch_and_a_batch_that_failed_before_any_supervisor(tmp_path, monkeypatch, capsys):
    from fakeslurm import install

    c = slurm_cluster(tmp_path, monkeypatch, workspace="dispatch", allocate=1)  # Slurm gives 1 node of 2
    code, out, err = cli(capsys, "logs", c.spec_path)
    assert code != 0 and f"job {c.name} was never submitted from login" in err
    code, out, err = cli(capsys, "provision", c.spec_path)
    assert code == 2 and "this command works on SSH hosts; with backend: slurm use" in err
    code, out, _ = cli(capsys, "dispatch", c.spec_path)
    assert code == 0 and "dispatch (" in out and out.count("│ 127.0.0.") == 2, out
    for node in ("127.0.0.1", "127.0.0.2"):
        assert (c.root / node / c.remote_dir / "train.py").read_text() == SLURM_TRAIN
        assert _mode(c.root / node / f"{c.remote_dir}.logs") == "0o700"
    code, out, _ = cli(capsys, "status", c.spec_path)
    assert code == 0 and "never submitted" in out
    code, out, _ = cli(capsys, "start", c.spec_path)
    assert code == 0
    st = wait_until(lambda: (s := _status(capsys, c))["state"] == "failed" and s)
    assert st["reason"] == (f"Slurm job 4242 FAILED (exit 2:0) on node1; slurm-4242.out ends: clusterctl-slurm: job "
                            f"{c.name} was planned for 2 node(s) but Slurm allocated 1: node1")
    fake_exe(c.bin, "sbatch", 'cat >/dev/null; echo "sbatch: error: invalid partition specified: debug" >&2; exit 1\n')
    code, out, err = cli(capsys, "start", c.spec_path)
    assert code != 0 and "sbatch on login failed: sbatch failed: sbatch: error: invalid partition specified: debug" in err
    fake_exe(c.bin, "sbatch", 'cat >/dev/null; echo "Submitted batch job"\n')
    code, out, err = cli(capsys, "start", c.spec_path)
    assert code != 0 and "sbatch on login failed: sbatch answered 'Submitted batch job', not a job id" in err
    install(c.bin, c.slurm, c.root, 2)  # the fake sbatch again
    (c.slurm / "hold").touch()  # a job stopped while it waits for its allocation: cancelled, nothing ran
    code, out, _ = cli(capsys, "start", c.spec_path)
    assert code == 0 and _status(capsys, c)["state"] == "pending"
    code, out, _ = cli(capsys, "stop", c.spec_path)
    assert (code, out.strip()) == (0, f"job {c.name} stopped on 0 host(s) (Slurm job 4243 CANCELLED)")
    assert not (c.root / "127.0.0.1" / ".clusterctl" / "slurm" / "jobs" / c.name / "4243-node1").exists()
    (c.root / "login" / ".clusterctl" / "slurm" / f"{c.name}.json").write_text("{not json")
    code, out, err = cli(capsys, "status", c.spec_path)
    assert code != 0 and f"asking Slurm on login failed: ~/.clusterctl/slurm/{c.name}.json is not a job record; remove it" in err


def test_doctor_says_a_down_host_once_not_again_for_every_peer_that_cannot_reach_it(tmp_path, monkeypatch, capsys):
    c = FakeCluster(tmp_path, hosts=3)
    c.everywhere(monkeypatch, transport=FaultyTransport(c.transport, down={"n2"}))
    code, out, _ = cli(capsys, "doctor", c.spec_path)
    problems = [line for line in out.splitlines() if line.startswith("problem: ")]
    assert code == 1 and re.search("^problem: n2: " + refused("n2"), problems[0]), out
    assert not [p for p in problems if "reach n2" in p], problems  # were 2 lines a peer: its ssh and its job port
    assert "n2 job_port" in " ".join(out.split()), out  # the table's peers row still shows what each peer saw
    code, out, _ = cli(capsys, "doctor", "--json", c.spec_path)
    data = json.loads(out)
    assert code == 1 and [data["hosts"][h]["reach"]["n2"]["job_port"] != "ok" for h in ("n0", "n1")] == [True, True]
    assert not [p for p in data["problems"] if "reach n2" in p], data["problems"]


def test_start_prints_the_plans_notes_before_it_starts(tmp_path, monkeypatch, capsys):
    """What the plan had to leave out (JobPlan.notes: a trainer list over what execve takes, at ~8,000 trainers)
    is said before the job starts, once, on stderr; the job starts."""
    from clusterctl.plan import JobPlan

    monkeypatch.setattr(JobPlan, "notes", property(lambda plan: (f"{plan.job}: something left out",)))
    c = FakeCluster(tmp_path, files={"train.py": TRAIN}).everywhere(monkeypatch)
    assert cli(capsys, "dispatch", c.spec_path)[0] == 0
    code, out, err = cli(capsys, "start", c.spec_path)
    assert code == 0 and "started in" in out, err
    assert err.count("clusterctl: note:") == 1
    assert err.index(f"clusterctl: note: {c.name}: something left out\n") < err.index("launching…")
    assert cli(capsys, "stop", c.spec_path)[0] == 0
