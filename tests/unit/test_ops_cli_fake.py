"""The command-line front ends of the operations (`clusterctl dispatch/start/status/logs/stop/exec/provision/
doctor`, and the same commands for `backend: slurm`) over fake hosts: clusterctl.cli.main with every Remote it
opens going to host directories on this machine (tests/unit/fakehosts.py)."""

import json
import os
import re
import socket
import sys
import threading

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
    assert re.search(r"reason: n0: trainer\.\d on n\d exited with code 4", final)


def test_ctrl_c_while_following_stops_the_job(tmp_path, monkeypatch, capsys):
    c = FakeCluster(tmp_path, files={"train.py": TRAIN}, hosts=1, job={"env": {"SLEEP": "60"}}).everywhere(monkeypatch)
    log = c.home(0) / f"{c.remote_dir}.logs" / "trainer.0.log"

    def interrupt_once_running():
        wait_until(lambda: log.exists() and log.read_text(), timeout=30)
        os.kill(os.getpid(), __import__("signal").SIGINT)

    t = threading.Thread(target=interrupt_once_running, daemon=True)
    t.start()
    code, out, err = cli(capsys, "start", c.spec_path, "--dispatch", "--follow")
    t.join()
    assert code == 130
    assert "interrupted: stopping the job" in err
    assert f"job {c.name}: stopped" in out
    assert job_pids(c.name) == []


def test_status_exits_1_when_a_host_is_unreachable(tmp_path, monkeypatch, capsys):
    c = FakeCluster(tmp_path, files={"train.py": TRAIN})
    c.everywhere(monkeypatch, transport=FaultyTransport(c.transport, down={"n1"}))
    code, out, _ = cli(capsys, "status", c.spec_path)
    assert code == 1
    assert re.search("n1: " + refused("n1"), out) and "lost" in out
    code, out, err = cli(capsys, "dispatch", c.spec_path)
    assert code != 0 and "dispatch failed on 1 host(s): n1" in err and re.search(refused("n1"), err)


def test_exec_runs_one_argv_everywhere_and_exits_with_the_worst_code(tmp_path, monkeypatch, capsys):
    c = FakeCluster(tmp_path).everywhere(monkeypatch)
    script = 'echo "on $(basename "$HOME") with $1"; [ "$(basename "$HOME")" = n1 ] && exit 3; exit 0'
    code, out, err = cli(capsys, "exec", c.spec_path, "--", "sh", "-c", script, "sh", "a b; not a command")
    assert code == 3
    assert sorted(out.splitlines()) == ["[n0] on n0 with a b; not a command", "[n1] on n1 with a b; not a command"]
    assert "[n1] exit 3" in err
    code, out, err = cli(capsys, "exec", "--timeout", "0.5", c.spec_path, "--", "sleep", "20")
    assert code == 124 and "[n0] exit 124" in err
    code, out, err = cli(capsys, "exec", c.spec_path)
    assert code != 0 and "exec needs a command after --" in err
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

# The Slurm commands on the fake login host: sbatch keeps the script and answers job 4242; scontrol and sacct
# report the state the test writes to ~/slurm-state ("gone": slurmctld forgot the job, sacct still knows it);
# scancel cancels; sinfo lists two nodes, reached as the fake hosts n1 and n2.
SLURM = {
    "sbatch": 'cat > "$HOME/sbatch.script"; echo "$*" > "$HOME/sbatch.args"; echo 4242\n',
    "scontrol": """\
        if [ "$1" = show ] && [ "$2" = hostnames ]; then echo node1; echo node2; exit 0; fi
        s=$(cat "$HOME/slurm-state" 2>/dev/null || echo PENDING)
        [ "$s" = gone ] && exit 1
        echo "JobId=4242 JobName=x JobState=$s Reason=None ExitCode=0:0 NodeList=node[1-2] BatchHost=node1"
        """,
    "sacct": 'echo "COMPLETED|0:0|node[1-2]"\n',
    "scancel": 'echo CANCELLED > "$HOME/slurm-state"\n',
    "sinfo": 'echo "node1 n1"; echo "node2 n2"\n',
}


def slurm_cluster(tmp_path, monkeypatch, workspace="shared"):
    c = FakeCluster(tmp_path, files={"train.py": TRAIN}, hosts=1)
    data = yaml.safe_load(c.spec_path.read_text())
    data.pop("hosts")
    data.update(backend="slurm", slurm={"login": "login", "nodes": 2, "partition": "debug", "workspace": workspace})
    if workspace == "shared":  # an absolute path on the shared filesystem: here, the login host's directory
        data["workspace"]["remote"] = str(c.root / "login" / c.remote_dir)
    data["job"].pop("ports")
    c.spec_path.write_text(yaml.safe_dump(data, sort_keys=False))
    for name, script in SLURM.items():
        fake_exe(c.bin, name, script)
    return c.everywhere(monkeypatch)


def test_slurm_start_status_logs_and_stop(tmp_path, monkeypatch, capsys):
    c = slurm_cluster(tmp_path, monkeypatch)
    login = c.root / "login"
    code, out, _ = cli(capsys, "start", c.spec_path)
    assert code == 0 and "started in" in out
    assert (login / "sbatch.args").read_text().strip() == "--parsable"
    script = (login / "sbatch.script").read_text()
    assert f"#SBATCH --job-name=clusterctl-{c.name}" in script and "#SBATCH --nodes=2" in script
    assert "#SBATCH --partition=debug" in script
    record = json.loads((login / ".clusterctl" / "slurm" / f"{c.name}.json").read_text())
    assert record["slurm_job"] == "4242"
    code, out, _ = cli(capsys, "status", c.spec_path, "--json")
    assert json.loads(out)["state"] == "pending"
    code, out, err = cli(capsys, "start", c.spec_path)
    assert code != 0 and "already pending as Slurm job 4242" in err
    # the job runs: slurmjob's state file and a trainer's log in the (shared) log directory
    (login / "slurm-state").write_text("RUNNING\n")
    logs = login / f"{c.remote_dir}.logs"
    assert logs.is_dir()  # made before the submission
    state = {"job": c.name, "slurm_job": "4242", "state": "running", "steps": {}, "reason": None,
             "processes": [{"role": "trainer", "id": 0, "node": "node1"}, {"role": "trainer", "id": 1, "node": "node2"}]}
    (logs / "slurm-state.json").write_text(json.dumps(state))
    (logs / "trainer.0.log").write_text("epoch 1\n")
    code, out, _ = cli(capsys, "status", c.spec_path)
    assert code == 0 and "running" in out and "node1" in out
    code, out, err = cli(capsys, "logs", c.spec_path, "--host", "n1")
    assert code != 0 and "--host selects nothing under backend: slurm" in err
    code, out, err = cli(capsys, "logs", c.spec_path)
    assert code == 0 and out.splitlines() == ["[node1 trainer.0] epoch 1"]
    code, out, _ = cli(capsys, "stop", c.spec_path)
    assert code == 0 and f"job {c.name} stopped on 2 host(s) (Slurm job 4242)" in out
    assert (login / "slurm-state").read_text().strip() == "CANCELLED"
    code, out, _ = cli(capsys, "status", c.spec_path, "--json")
    assert json.loads(out)["state"] == "stopped"
    (login / "slurm-state").write_text("gone\n")  # slurmctld forgot it: sacct still knows
    code, out, _ = cli(capsys, "status", c.spec_path)
    assert code == 0 and "succeeded" in out
    code, out, _ = cli(capsys, "stop", c.spec_path)
    assert code == 0 and f"job {c.name} is not running (Slurm job 4242)" in out


def test_slurm_start_follow_and_what_slurm_refuses(tmp_path, monkeypatch, capsys):
    c = slurm_cluster(tmp_path, monkeypatch)
    login = c.root / "login"
    logs = login / f"{c.remote_dir}.logs"
    code, out, err = cli(capsys, "logs", c.spec_path)
    assert code != 0 and f"job {c.name} was never submitted from login" in err
    code, out, err = cli(capsys, "provision", c.spec_path)
    assert code != 0 and "this command works on SSH hosts; with backend: slurm use" in err
    fake_exe(c.bin, "sbatch", 'echo "sbatch: error: invalid partition specified: debug" >&2; exit 1\n')
    code, out, err = cli(capsys, "start", c.spec_path)
    assert code != 0 and "sbatch on login failed: sbatch: error: invalid partition specified: debug" in err
    fake_exe(c.bin, "sbatch", 'echo "Submitted batch job"\n')
    code, out, err = cli(capsys, "start", c.spec_path)
    assert code != 0 and "sbatch on login answered 'Submitted batch job', not a job id" in err
    # a job that runs at once and ends: its state file and logs are there when the follow starts
    state = {"job": c.name, "slurm_job": "4242", "state": "succeeded", "reason": None,
             "steps": {"trainer": {"code": 0, "stopped": False, "tasks": {}}},
             "processes": [{"role": "trainer", "id": 0, "node": "node1"}, {"role": "trainer", "id": 1, "node": "node2"}]}
    fake_exe(c.bin, "sbatch", f"""\
        cat > /dev/null
        echo COMPLETED > "$HOME/slurm-state"
        echo '{json.dumps(state)}' > {logs}/slurm-state.json
        echo "loss 0.5" > {logs}/trainer.0.log; echo "loss 0.4" > {logs}/trainer.1.log
        echo 4242
        """)
    code, out, err = cli(capsys, "start", c.spec_path, "--follow")
    assert code == 0
    assert "[node1 trainer.0] loss 0.5" in out.splitlines() and "[node2 trainer.1] loss 0.4" in out.splitlines()
    assert f"job {c.name}: succeeded" in out and "exited" in out
    code, out, _ = cli(capsys, "logs", c.spec_path, "--role", "trainer", "--id", "1", "-n", "1", "--follow")
    assert (code, out.splitlines()) == (0, ["[node2 trainer.1] loss 0.4"])
    fake_exe(c.bin, "sacct", "exit 0\n")
    (login / "slurm-state").write_text("gone\n")  # neither scontrol nor sacct knows the job any more
    code, out, _ = cli(capsys, "status", c.spec_path, "--json")
    assert json.loads(out)["state"] == "unknown"
    (login / ".clusterctl" / "slurm" / f"{c.name}.json").write_text("{not json")
    code, out, err = cli(capsys, "status", c.spec_path)
    assert code != 0 and f"login:~/.clusterctl/slurm/{c.name}.json is not JSON; remove it" in err


def test_slurm_dispatch_and_a_batch_program_that_failed_early(tmp_path, monkeypatch, capsys):
    c = slurm_cluster(tmp_path, monkeypatch, workspace="dispatch")
    code, out, _ = cli(capsys, "dispatch", c.spec_path)
    assert code == 0 and "dispatch (" in out and out.count("│ n") == 2, out
    assert (c.root / "n1" / c.remote_dir / "train.py").read_text() == TRAIN
    assert (c.root / "n2" / c.remote_dir / "train.py").read_text() == TRAIN
    assert (c.root / "n2" / f"{c.remote_dir}.logs").is_dir()
    code, out, _ = cli(capsys, "status", c.spec_path)
    assert code == 0 and "never submitted" in out
    code, out, _ = cli(capsys, "start", c.spec_path)
    assert code == 0
    login = c.root / "login"
    (login / "slurm-state").write_text("FAILED\n")
    (c.root / "n1" / f"{c.remote_dir}.logs" / "slurm-4242.out").write_text("python3: can't open file\n")
    code, out, _ = cli(capsys, "status", c.spec_path)
    assert "failed" in out and "slurm-4242.out ends: python3: can't open file" in out
