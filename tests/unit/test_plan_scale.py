"""Plans for many processes: the factored plan JSON, job files that state shared env once, a 10,000-process plan."""

import errno
import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid

import pytest

from clusterctl import cli
from clusterctl.host import agent
from clusterctl.ops.job import job_files
from clusterctl.plan import expand_env, factor_env, make_plan
from clusterctl.spec import parse_spec

SHAPE = """\
name: big
hosts:
  - {address: 10.0.0.1, gpus: 2}
  - {address: 10.0.0.2, gpus: [2, 3]}
  - {address: 10.0.0.3, gpus: 2}
data: {local: shards}
job:
  mode: pserver
  entrypoint: [python3, train.py]
  args: ["{role}", "{current_endpoint}"]
  pservers: 2
  trainers: gpu
  env: {GLOG_v: 1}
"""

COLLECTIVE = "name: one\nhosts: [{address: h1}, {address: h2, slots: 3}]\njob: {entrypoint: [x], trainers: 2}\n"
SINGLE = "name: solo\nhosts: [{address: h1}]\njob: {entrypoint: [x]}\n"


def scale_spec(hosts: int, gpus: int = 8, pservers: int = 16) -> str:
    """The spec of benchmarks/plan_scale.py: `hosts` hosts x `gpus` GPUs, one trainer per GPU, pserver mode."""
    lines = ["name: scale", "hosts:"]
    lines += [f"  - {{address: 10.{(i >> 8) & 255}.{i & 255}.1, gpus: {gpus}}}" for i in range(hosts)]
    lines += ["job:", "  mode: pserver", f"  pservers: {pservers}", "  trainers: gpu", "  entrypoint: python train.py"]
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("text,data_files", [(SHAPE, ["a", "b", "c", "d", "e"]), (COLLECTIVE, None), (SINGLE, None)])
def test_factored_json_expands_to_every_process_full_env(text, data_files):
    plan = make_plan(parse_spec(text), data_files=data_files)
    doc = json.loads(cli.dumps_plan(plan.to_json()))
    assert len(doc["processes"]) == len(plan.processes)
    for i, proc in enumerate(plan.processes):
        assert expand_env(doc, i) == proc.env, proc.name
    expanded = json.loads(cli.dumps_plan(plan.to_json(expand=True)))
    assert "shared_env" not in expanded
    assert [p["env"] for p in expanded["processes"]] == [p.env for p in plan.processes]
    assert [expand_env(expanded, i) for i in range(len(plan.processes))] == [p.env for p in plan.processes]
    # apart from env, the factored and the expanded processes are the same
    assert [{**p, "env": None} for p in doc["processes"]] == [{**p, "env": None} for p in expanded["processes"]]


def test_shared_env_holds_the_lists_and_processes_only_their_own():
    plan = make_plan(parse_spec(SHAPE), data_files=["a", "b"])
    doc = plan.to_json()
    shared = doc["shared_env"]
    assert shared["all"] == {
        "GLOG_v": "1", "CLUSTERCTL_JOB": "big", "PADDLE_TRAINERS_NUM": "6",
        "PADDLE_TRAINER_ENDPOINTS": ",".join(t.endpoint for t in plan.trainers),
        "PADDLE_PSERVERS_IP_PORT_LIST": "10.0.0.1:6170,10.0.0.2:6170",
        "CLUSTERCTL_PS_MODE": "sync", "CLUSTERCTL_PS_K_STEPS": "100",
    }
    assert shared["pserver"] == {"CLUSTERCTL_ROLE": "pserver", "TRAINING_ROLE": "PSERVER", "PADDLE_PORT": "6170"}
    assert shared["trainer"] == {
        "CLUSTERCTL_ROLE": "trainer", "TRAINING_ROLE": "TRAINER", "WORLD_SIZE": "6", "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "6169", "FLAGS_selected_gpus": "0",
    }
    assert doc["processes"][5]["env"] == {
        "POD_IP": "10.0.0.2", "PADDLE_PORT": "6181", "PADDLE_CURRENT_ENDPOINT": "10.0.0.2:6181",
        "PADDLE_TRAINER_ID": "3", "RANK": "3", "LOCAL_RANK": "1", "CUDA_VISIBLE_DEVICES": "3",
        "CLUSTERCTL_DATA_FILES": "",
    }


def test_factor_env_edge_cases():
    assert factor_env([]) == ({}, [])
    assert factor_env([{"A": "1"}]) == ({"A": "1"}, [{}])
    # same name, different value: not shared; a name missing in one env: not shared
    shared, rest = factor_env([{"A": "1", "B": "x", "C": "c"}, {"A": "2", "B": "x"}])
    assert shared == {"B": "x"} and rest == [{"A": "1", "C": "c"}, {"A": "2"}]


def test_cli_plan_json_expand(tmp_path, capsys):
    spec = tmp_path / "c.yaml"
    spec.write_text(SHAPE.replace("data: {local: shards}\n", ""))
    assert cli.main(["plan", str(spec), "--json"]) == 0
    factored = json.loads(capsys.readouterr().out)
    assert cli.main(["plan", str(spec), "--json", "--expand"]) == 0
    expanded = json.loads(capsys.readouterr().out)
    assert [expand_env(factored, i) for i in range(8)] == [p["env"] for p in expanded["processes"]]
    assert expanded["processes"][7]["env"]["PADDLE_TRAINER_ENDPOINTS"].count(",") == 5


def test_job_files_state_shared_env_once_and_the_agent_rebuilds_each_env():
    plan = make_plan(parse_spec(SHAPE), data_files=["a", "b", "c"])
    files = job_files(plan, {h: "/home/u" for h in plan.hosts}, "t" * 32)
    trainer_eps = plan.trainers[0].env["PADDLE_TRAINER_ENDPOINTS"]
    for host, raw in files.items():
        text = json.dumps(raw)
        assert text.count(trainer_eps) == 1, host  # once per host, not once per process
        job = agent.validate_job(json.loads(text), "job.json")
        assert [(p["role"], p["id"], p["env"]) for p in job["processes"]] == [
            (p.role, p.id, p.env) for p in plan.on_host(host)
        ]


def test_agent_rejects_a_bad_shared_env():
    raw = {"job": "j", "env": {"A=B": "1"}, "processes": []}
    with pytest.raises(agent.InputError, match=r"job.json: env: must be an object of string to string"):
        agent.validate_job(raw, "job.json")
    raw = {"job": "j", "env": {"CLUSTERCTL_JOB": "other"},
           "processes": [{"role": "trainer", "id": 0, "argv": ["x"], "cwd": "/", "log": "/tmp/x.log"}]}
    with pytest.raises(agent.InputError, match=r"processes\[0\].env.CLUSTERCTL_JOB: 'other' differs from job 'j'"):
        agent.validate_job(raw, "job.json")


@pytest.mark.timeout(60)
def test_launched_process_gets_shared_and_own_env(tmp_path):
    """A real agent launch: the process's /proc/PID/environ has the job file's shared env and its own."""
    job_id = "fact-" + uuid.uuid4().hex[:8]
    jobdir = tmp_path / job_id
    jobdir.mkdir()
    job = {"job": job_id, "host": "h", "grace": 1, "env": {"SHARED_LIST": "a:1,b:2", "OVERRIDDEN": "shared"},
           "processes": [{"role": "trainer", "id": 0, "argv": [sys.executable, "-c", "import time; time.sleep(60)"],
                          "env": {"OWN": "0", "OVERRIDDEN": "own"}, "cwd": str(tmp_path), "log": str(tmp_path / "t.log")}]}
    (jobdir / "job.json").write_text(json.dumps(job))
    agent_py = agent.__file__
    res = subprocess.run([sys.executable, agent_py, "launch", str(jobdir / "job.json")], capture_output=True, timeout=30)
    out = json.loads(res.stdout.decode().strip().splitlines()[-1])
    try:
        assert res.returncode == 0 and out["ok"], out
        pid = out["pids"]["trainer.0"]
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = dict(e.decode().split("=", 1) for e in f.read().split(b"\0") if e)
        assert (env["SHARED_LIST"], env["OWN"], env["OVERRIDDEN"], env["CLUSTERCTL_JOB"]) == ("a:1,b:2", "0", "own", job_id)
    finally:
        subprocess.run([sys.executable, agent_py, "stop", str(jobdir), "--grace", "0"], capture_output=True, timeout=30)
        if out.get("pids"):
            for p in out["pids"].values():
                try:
                    os.kill(p, signal.SIGKILL)
                except ProcessLookupError:
                    pass


def test_ten_thousand_processes_plan_quickly_and_compactly():
    """1,250 hosts x 8 GPUs, 16 pservers: a sanity bound (CPU seconds), not a benchmark (benchmarks/plan_scale.py)."""
    text = scale_spec(1250)
    t0 = time.process_time()
    plan = make_plan(parse_spec(text))
    doc = cli.dumps_plan(plan.to_json())
    files = job_files(plan, {h: "/home/u" for h in plan.hosts}, "t" * 32)
    one_file = json.dumps(files[plan.hosts[-1]])
    cpu = time.process_time() - t0
    assert (len(plan.trainers), len(plan.pservers)) == (10000, 16)
    assert cpu < 5.0, f"{cpu:.1f} s of CPU for a 10,000-process plan"
    assert len(doc) < 8_000_000 and len(one_file) < 20_000, (len(doc), len(one_file))  # 1.57 GB, 160 kB before


def test_a_trainer_list_longer_than_execve_takes_is_left_out_and_the_processes_start():
    """10,000 trainers' endpoints (~150 kB) are over Linux's 128 KiB for one environment string: a process given
    them fails to start (E2BIG). The list is left out, the plan says so, and the largest process's environment is
    one execve takes; 4,800 trainers keep theirs (and a host's job file states it once)."""
    plan = make_plan(parse_spec(scale_spec(1250)))
    assert all("PADDLE_TRAINER_ENDPOINTS" not in p.env for p in plan.processes)
    size = len(",".join(t.endpoint for t in plan.trainers))
    assert size > 131072 and plan.notes == (
        f"PADDLE_TRAINER_ENDPOINTS is left out of every process's environment: its 10000 endpoints take {size} "
        "bytes, over the 128 KiB Linux passes in one environment string (PaddlePaddle's collective mode reads it; "
        "PyTorch and mpi4py do not)",)
    last = plan.trainers[-1]
    env = {**last.env, "PATH": os.environ["PATH"]}
    res = subprocess.run([sys.executable, "-S", "-c", "import os; print(os.environ['RANK'], os.environ['WORLD_SIZE'])"],
                         env=env, capture_output=True, text=True, timeout=30)
    assert (res.returncode, res.stdout) == (0, "9999 10000\n"), res.stderr
    with pytest.raises(OSError) as raised:  # what the trainers met before: execve refused the list
        subprocess.run([sys.executable, "-S", "-c", "pass"], timeout=30,
                       env={**env, "PADDLE_TRAINER_ENDPOINTS": ",".join(t.endpoint for t in plan.trainers)})
    assert raised.value.errno == errno.E2BIG

    smaller = make_plan(parse_spec(scale_spec(600)))
    trainer_list = smaller.trainers[0].env["PADDLE_TRAINER_ENDPOINTS"]
    assert smaller.notes == () and trainer_list.count(",") == 4799
    files = job_files(smaller, {h: "/home/u" for h in smaller.hosts}, "t" * 32)
    one_file = json.dumps(files[smaller.hosts[-1]])
    assert one_file.count(trainer_list) == 1 and len(one_file) < 2 * len(trainer_list)


def test_validate_and_plan_say_when_the_trainer_list_is_left_out(tmp_path):
    spec = tmp_path / "c.yaml"
    spec.write_text(scale_spec(1250))
    for command in (["validate", str(spec)], ["plan", str(spec), "--json"]):
        res = subprocess.run([sys.executable, "-m", "clusterctl.cli", *command], capture_output=True, text=True,
                             timeout=120, env={**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")})
        assert res.returncode == 0, res.stderr
        assert res.stderr.startswith("clusterctl: note: PADDLE_TRAINER_ENDPOINTS is left out of every process's "
                                     "environment: its 10000 endpoints take ") and res.stderr.count("\n") == 1, res.stderr
    spec.write_text(scale_spec(4))
    res = subprocess.run([sys.executable, "-m", "clusterctl.cli", "validate", str(spec)], capture_output=True,
                         text=True, timeout=60)
    assert (res.returncode, res.stderr) == (0, "")


def test_plan_table_summarises_large_plans(tmp_path):
    spec = tmp_path / "c.yaml"
    spec.write_text(scale_spec(13, gpus=8, pservers=2))  # 106 processes
    env = {**os.environ, "COLUMNS": "200"}

    def plan_table(*extra):
        res = subprocess.run([sys.executable, "-m", "clusterctl.cli", "plan", str(spec), *extra],
                             capture_output=True, text=True, env=env, timeout=60)
        assert res.returncode == 0, res.stderr
        return res.stdout

    short, full = plan_table(), plan_table("--all")
    assert ("13 hosts (8-9 processes each), 2 pserver(s), 104 trainer(s); showing 40 of 106 processes: "
            "--all lists every one") in " ".join(short.split())
    assert "66 more" in short and "10.0.12.1:6187" in short and "10.0.5.1:6180" not in short
    assert "showing" not in full and all(f"10.0.{i}.1:6187" in full for i in range(13))


def test_what_no_process_could_be_started_with_is_refused_when_planned():
    """Linux starts no process with an argument or environment string over 128 KiB (E2BIG). `{trainer_endpoints}`
    in job.args at 10,000 trainers was a 160 KB argument: the plan built it once per process (gigabytes), and every
    host's launch would have failed; a too long job.env value or data file list the same. Refused at its key, once."""
    from clusterctl.plan import PlanError

    spec = scale_spec(1250).replace("  entrypoint: python train.py", "  entrypoint: python train.py\n"
                                                                     "  args: ['--endpoints={trainer_endpoints}']")
    t0 = time.process_time()
    with pytest.raises(PlanError) as err:
        make_plan(parse_spec(spec, layout=False))  # (validate lays it out too: the same problem, at its line)
    assert time.process_time() - t0 < 5.0
    assert err.value.path == ("job", "args") and re.search(r"an argument \(after its placeholders\) would be 1\d{5} "
                                                           "bytes", str(err.value))
    assert "(E2BIG)" in str(err.value)
    small = "name: e\nhosts: [{address: h1}]\njob:\n  entrypoint: [x]\n  env: {BIG: '%s'}\n"
    make_plan(parse_spec(small % ("x" * (131072 - len("BIG=") - 1)), layout=False))  # the longest execve takes
    with pytest.raises(PlanError) as err:
        make_plan(parse_spec(small % ("x" * (131072 - len("BIG="))), layout=False))
    assert err.value.path == ("job", "env", "BIG") and "BIG=... would be 131072 bytes" in str(err.value)
    shards = "name: d\nhosts: [{address: h1}]\ndata: {local: shards}\njob: {entrypoint: [x]}\n"
    make_plan(parse_spec(shards, layout=False), data_files=[f"part-{i:05d}.rec" for i in range(1000)])
    with pytest.raises(PlanError) as err:
        make_plan(parse_spec(shards, layout=False), data_files=[f"part-{i:05d}.rec" for i in range(10000)])
    assert err.value.path == ("data",) and "CLUSTERCTL_DATA_FILES (one trainer's data files) would be" in str(err.value)


def test_a_pserver_list_longer_than_execve_takes_is_refused_at_job_pservers():
    """Every pserver-mode process reads every pserver's endpoint in one variable: a list no process could be
    started with is refused when planned, at its key (the trainer list is left out instead: the test above)."""
    from clusterctl.errors import SpecError

    spec = scale_spec(64, pservers=16320).replace("  trainers: gpu\n", "  trainers: 1\n  ports: {pserver: 1000, trainer: 60000, "
                                                                  "master: 61000, control: 61001}\n")
    with pytest.raises(SpecError) as info:
        make_plan(parse_spec(spec, "big.yaml"))
    (problem,) = info.value.problems
    assert str(problem).startswith("big.yaml:") and "job.pservers: PADDLE_PSERVERS_IP_PORT_LIST (every pserver's " \
        "endpoint) would be " in str(problem) and str(problem).endswith("over 128 KiB (E2BIG)"), str(problem)
