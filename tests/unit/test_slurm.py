"""backend: slurm, pure parts: spec checks, the plan with placeholder nodes, resolve(), the batch script,
Slurm states, slurm.conf; and slurmjob's task middleman, sweep and logs run for real on this machine."""

from __future__ import annotations

import base64
import json
import os
import re
import subprocess
import sys
import time
import uuid

import pytest

from clusterctl import slurmjob
from clusterctl.backends import problems as backend_problems
from clusterctl.errors import SpecError
from clusterctl.ops.slurm import batch_script, job_file, process_rows, slurm_state
from clusterctl.plan import make_plan
from clusterctl.spec import parse_spec

BASE = """\
name: sj
backend: slurm
slurm: {login: login1, nodes: 3, partition: gpu, time: "01:00:00"}
job: {mode: pserver, entrypoint: [python, train.py], args: ["--ep={current_endpoint}"], pservers: 2, trainers: 2}
"""


def problems(text: str) -> list[str]:
    """What `clusterctl validate` says: the spec's own problems, else its backend's (clusterctl.backends)."""
    with pytest.raises(SpecError) as info:
        parse_spec(text, "s.yaml", check=backend_problems)
    return [f"{p.path}: {p.message}" for p in info.value.problems]


def test_slurm_spec_plans_node_i_as_a_placeholder():
    spec = parse_spec(BASE)
    assert [h.address for h in spec.hosts] == ["slurm-node-0.invalid", "slurm-node-1.invalid", "slurm-node-2.invalid"]
    plan = make_plan(spec)
    t3 = plan.trainers[3]
    assert (t3.host.index, t3.endpoint, t3.env["LOCAL_RANK"]) == (1, "slurm-node-1.invalid:6181", "1")
    assert plan.pservers[1].env["PADDLE_PSERVERS_IP_PORT_LIST"] == "slurm-node-0.invalid:6170,slurm-node-1.invalid:6170"


def test_hosts_give_the_shape_of_each_node():
    spec = parse_spec(BASE.replace("nodes: 3, ", "") + "hosts: [{address: a, gpus: 2}, {address: b, slots: 3}]\n")
    assert [(h.address, h.gpus, h.slots) for h in spec.hosts] == [
        ("slurm-node-0.invalid", (0, 1), None), ("slurm-node-1.invalid", (), 3)]


@pytest.mark.parametrize("text, expected", [
    (BASE.replace("slurm: {login: login1, nodes: 3, partition: gpu, time: \"01:00:00\"}\n", ""),
     "backend: backend: slurm needs a slurm: section (login:, nodes:, ...)"),
    (BASE.replace("backend: slurm\n", ""), "slurm: not supported with backend: ssh: a slurm: section needs backend: slurm"),
    (BASE.replace("nodes: 3, ", ""), "slurm: give slurm.nodes (or hosts, for the shape of each node)"),
    (BASE + "hosts: [{address: a}]\n", "slurm.nodes: 3 nodes but 1 hosts"),
    (BASE.replace("pservers: 2", "pservers: [a]"),
     "job.pservers: under Slurm the nodes are known at run time: give a count or {per_host: N}"),
    (BASE.replace("mode: pserver", "mode: collective, launcher: mpi").replace("pservers: 2, ", ""),
     "job.launcher: not supported with backend: slurm: launcher: mpi is not supported; use launcher: ssh "
     "(clusterctl's own PMI server)"),
    (BASE.replace("time:", "workspace: shared, time:") + "workspace: {remote: rel/dir}\n",
     "workspace.remote: slurm.workspace: shared needs an absolute path on the shared filesystem"),
    (BASE + "data: {local: d}\n",
     "data: not supported with backend: slurm: data: is not dealt under Slurm yet; put the files in the workspace"),
    (BASE.replace("login: login1", "login: 'a b'"), "slurm.login: not a host name, ssh alias or IP address: 'a b'"),
    (BASE.replace("login: login1", "login: '-oProxyCommand=x'"),
     "slurm.login: not a host name, ssh alias or IP address: '-oProxyCommand=x'"),
    (BASE.replace("backend: slurm", "backend: k8s"), "backend: expected one of 'ssh', 'slurm' or 'kubernetes', got 'k8s'"),
    (BASE.replace("partition: gpu", 'partition: "gpu\\nrm -rf ~"'),  # a real newline: an #SBATCH line injected
     "slurm.partition: expected one word (letters, digits, _.:,+=@/-), got 'gpu\\nrm -rf ~'"),
    (BASE.replace("time:", "sbatch_args: [exclusive], time:"),
     "slurm.sbatch_args: each item is one sbatch option on one line, starting with '-': 'exclusive'"),
])
def test_slurm_spec_problems(text, expected):
    assert problems(text) == [expected]


def _addresses(n: int) -> tuple[list[str], list[str]]:
    return [f"n{i:02d}" for i in range(n)], [f"10.0.0.{i + 1}" for i in range(n)]


def test_resolve_puts_the_allocations_addresses_in_every_env_value_and_arg():
    spec = parse_spec(BASE.replace("nodes: 3", "nodes: 12"))
    job = job_file(spec, make_plan(spec))
    nodes, addrs = _addresses(12)
    tasks = slurmjob.resolve(job, nodes, addrs)
    assert [t["node"] for t in tasks["pserver"]] == ["n00", "n01"]
    t = tasks["trainer"][23]  # node 11, local 1: `slurm-node-1.invalid` must not match inside `-11.`
    assert (t["node"], t["endpoint"], t["env"]["POD_IP"], t["argv"]) == (
        "n11", "10.0.0.12:6181", "10.0.0.12", ["python", "train.py", "--ep=10.0.0.12:6181"])
    assert t["env"]["MASTER_ADDR"] == "10.0.0.1" and t["env"]["RANK"] == "23" and t["env"]["WORLD_SIZE"] == "24"
    eps = t["env"]["PADDLE_TRAINER_ENDPOINTS"].split(",")
    assert eps[:3] == ["10.0.0.1:6180", "10.0.0.1:6181", "10.0.0.2:6180"] and len(eps) == 24
    assert not any("invalid" in json.dumps(x) for x in tasks.values())


def test_resolve_refuses_an_allocation_of_another_size():
    job = job_file(parse_spec(BASE), make_plan(parse_spec(BASE)))
    with pytest.raises(ValueError, match=r"planned for 3 node\(s\) but Slurm allocated 2: n00,n01"):
        slurmjob.resolve(job, *_addresses(2))


def test_batch_script_carries_the_options_the_program_and_the_job_file():
    spec = parse_spec(BASE.replace("time:", "account: ml, sbatch_args: ['--exclusive'], gpus_per_node: 2, time:"))
    plan = make_plan(spec)
    script = batch_script(spec, plan, b"print('program')\n")
    options = re.findall(r"^#SBATCH (.*)$", script, re.MULTILINE)
    assert options == ["--job-name=clusterctl-sj", "--nodes=3", "--ntasks-per-node=3",
                       "--output=clusterctl/sj.logs/slurm-%j.out", "--partition=gpu", "--time=01:00:00",
                       "--account=ml", "--gres=gpu:2", "--exclusive"]
    blobs = re.findall(r"<<'CLUSTERCTL_EOF'\n(.*?)\nCLUSTERCTL_EOF", script, re.DOTALL)
    assert base64.b64decode(blobs[0]) == b"print('program')\n"
    assert json.loads(base64.b64decode(blobs[1])) == job_file(spec, plan)
    assert script.endswith('exec python3 "$d/slurmjob.py" batch "$d"\n')


@pytest.mark.parametrize("word, state", [
    ("PENDING", "pending"), ("RUNNING", "running"), ("COMPLETING", "stopping"), ("COMPLETED", "succeeded"),
    ("CANCELLED by 0", "stopped"), ("FAILED", "failed"), ("TIMEOUT", "failed"), ("NODE_FAIL", "failed"),
    ("CANCELLED+", "stopped"), ("", "not running"),
])
def test_slurm_states(word, state):
    assert slurm_state(word) == state


def _found(steps, state="failed"):
    procs = [{"role": "pserver", "id": 0, "node": "n0"}]
    procs += [{"role": "trainer", "id": i, "node": f"n{i}"} for i in range(3)]
    return {"state": state, "processes": procs, "steps": steps}


def _rows(state, found):
    return [(r.role, r.id, r.host, r.state, r.exit_code) for r in process_rows(state, found)]


def test_process_rows_name_the_first_failure_and_what_was_stopped_after_it():
    found = _found({"trainer": {"code": 3, "stopped": False, "tasks": {"1": 3, "2": 143, "0": 143}},
                    "pserver": {"code": 143, "stopped": True, "tasks": {"0": 143}}})
    assert _rows("failed", found) == [("pserver", 0, "n0", "stopped", 143), ("trainer", 0, "n0", "stopped", 143),
                                      ("trainer", 1, "n1", "failed", 3), ("trainer", 2, "n2", "stopped", 143)]


def test_process_rows_of_a_success_a_running_job_and_a_cancelled_one():
    ok = _found({"trainer": {"code": 0, "stopped": False, "tasks": {}},
                 "pserver": {"code": 0, "stopped": False, "tasks": {}}}, state="succeeded")
    assert {r[3] for r in _rows("succeeded", ok)} == {"exited"}
    assert {r[3] for r in _rows("running", _found({}, state="running"))} == {"running"}
    assert {(r[3], r[4]) for r in _rows("stopped", _found({}, state="stopped"))} == {("stopped", None)}


def test_slurm_conf_runs_the_controller_on_node0_without_cgroups():
    from clusterctl.testcluster import Node
    from clusterctl.testcluster_slurm import slurm_conf

    conf = slurm_conf("ct", [Node("ct-node0", "10.1.0.2", "ct-node0"), Node("ct-node1", "10.1.0.3", "ct-node1")])
    lines = conf.splitlines()
    for line in ("SlurmctldHost=ct-node0(10.1.0.2)", "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none",
                 "SelectType=select/cons_tres", "AuthType=auth/munge",
                 "NodeName=ct-node1 NodeAddr=10.1.0.3 CPUs=16 State=UNKNOWN"):
        assert line in lines
    assert lines[-1] == "PartitionName=debug Nodes=ct-node0,ct-node1 Default=YES MaxTime=INFINITE State=UP"


# ------------------------------------------------------------------- slurmjob for real, on this machine


def _tasks_file(tmp_path, argv, node="here", env=None):
    tasks = {"trainer": [{"role": "trainer", "id": 0, "node": node, "address": "127.0.0.1", "endpoint": "",
                          "env": env or {}, "argv": argv, "cwd": str(tmp_path)}], "pserver": []}
    path = tmp_path / "tasks.json"
    path.write_text(json.dumps(tasks))
    return path


def _task(path, **env):
    return subprocess.run([sys.executable, slurmjob.__file__, "task", str(path), "trainer"], capture_output=True,
                          text=True, timeout=30,
                          env={**os.environ, "SLURM_PROCID": "0", "SLURMD_NODENAME": "here", **env})


def test_task_runs_the_planned_argv_with_its_env_in_its_cwd_and_returns_its_code(tmp_path):
    code = "import os, sys; print(os.getcwd(), os.environ['RANK']); sys.exit(7)"
    res = _task(_tasks_file(tmp_path, [sys.executable, "-c", code], env={"RANK": "5"}))
    assert (res.returncode, res.stdout) == (7, f"{tmp_path} 5\n")


def test_task_refuses_to_run_on_another_node(tmp_path):
    res = _task(_tasks_file(tmp_path, ["true"], node="elsewhere"))
    assert res.returncode == 2
    assert res.stderr == "clusterctl-slurm: trainer.0 planned on elsewhere but started on here\n"


def test_task_does_not_wait_for_a_child_left_holding_the_output(tmp_path):
    code = "import subprocess, sys; subprocess.Popen(['sleep', '30'], start_new_session=True); print('bye')"
    job = f"ut-{uuid.uuid4().hex[:8]}"
    t0 = time.monotonic()
    res = _task(_tasks_file(tmp_path, [sys.executable, "-c", code], env={"CLUSTERCTL_JOB": job}))
    assert (res.returncode, res.stdout) == (0, "bye\n")
    assert time.monotonic() - t0 < 10
    left = slurmjob._tagged(job)
    assert left, "the leftover child carries the job's tag"
    assert slurmjob.sweep(job, grace=1)
    assert not slurmjob._tagged(job)


def test_sweep_kills_what_ignores_sigterm(tmp_path):
    job = f"ut-{uuid.uuid4().hex[:8]}"
    proc = subprocess.Popen([sys.executable, "-c",
                             "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                             "print('up', flush=True); time.sleep(60)"], env={**os.environ, "CLUSTERCTL_JOB": job},
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "up\n"
    slurmjob.sweep(job, grace=0.5)
    assert proc.wait(5) == -9
    assert not slurmjob._tagged(job)


def test_logs_prefix_each_line_with_node_and_process(tmp_path, capsys):
    state = {"state": "succeeded", "processes": [{"role": "trainer", "id": 0, "node": "n1", "endpoint": "x"},
                                                 {"role": "pserver", "id": 0, "node": "n0", "endpoint": "y"}]}
    (tmp_path / slurmjob.STATE_FILE).write_text(json.dumps(state))
    (tmp_path / "trainer.0.log").write_text("a\nb\nc\n")
    (tmp_path / "pserver.0.log").write_text("p\n")
    assert slurmjob.main(["logs", str(tmp_path), "--follow"]) == 0
    assert capsys.readouterr().out == "[n1 trainer.0] a\n[n1 trainer.0] b\n[n1 trainer.0] c\n[n0 pserver.0] p\n"
    assert slurmjob.main(["logs", str(tmp_path), "--role", "trainer", "-n", "1"]) == 0
    assert capsys.readouterr().out == "[n1 trainer.0] c\n"
