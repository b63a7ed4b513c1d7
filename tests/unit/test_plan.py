"""The plan: IDs, endpoints, env and argv for several cluster shapes, all without a network."""

import json
import subprocess
import sys


from clusterctl.plan import make_plan
from clusterctl.spec import CONTRACT_ENV, parse_spec


def plan_of(text):
    return make_plan(parse_spec(text))


def test_one_host_collective():
    plan = plan_of("name: one\nhosts: [{address: 127.0.0.1}]\njob: {entrypoint: [python3, t.py], trainers: 2}\n")
    assert [(p.role, p.id, p.rank, p.local_rank, p.endpoint) for p in plan.processes] == [
        ("trainer", 0, 0, 0, "127.0.0.1:6180"),
        ("trainer", 1, 1, 1, "127.0.0.1:6181"),
    ]
    env = plan.processes[1].env
    assert env == {
        "CLUSTERCTL_JOB": "one",
        "CLUSTERCTL_ROLE": "trainer",
        "TRAINING_ROLE": "TRAINER",
        "POD_IP": "127.0.0.1",
        "PADDLE_PORT": "6181",
        "PADDLE_CURRENT_ENDPOINT": "127.0.0.1:6181",
        "PADDLE_TRAINER_ID": "1",
        "PADDLE_TRAINERS_NUM": "2",
        "PADDLE_TRAINER_ENDPOINTS": "127.0.0.1:6180,127.0.0.1:6181",
        "RANK": "1",
        "WORLD_SIZE": "2",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "6169",
    }
    assert plan.control_endpoint == "127.0.0.1:6168"
    assert plan.log_dir == "clusterctl/one.logs"  # beside the workspace's generations, not inside one


SHAPE = """\
name: big
hosts:
  - {address: 10.0.0.1, gpus: 2}
  - {address: 10.0.0.2, gpus: [2, 3]}
  - {address: 10.0.0.3, gpus: 2}
job:
  mode: pserver
  entrypoint: [python3, dist_train_demo.py]
  args: ["{role}", "{pserver_endpoints}", "{current_endpoint}", "{trainer_id}", "{trainers}"]
  pservers: 2
  trainers: gpu
  env: {GLOG_v: 1}
"""


def test_three_hosts_two_gpus_two_pservers():
    plan = plan_of(SHAPE)
    rows = [(p.host.address, p.role, p.id, p.local_rank, p.endpoint, p.gpus) for p in plan.processes]
    assert rows == [
        ("10.0.0.1", "pserver", 0, 0, "10.0.0.1:6170", ()),
        ("10.0.0.2", "pserver", 1, 0, "10.0.0.2:6170", ()),
        ("10.0.0.1", "trainer", 0, 0, "10.0.0.1:6180", (0,)),
        ("10.0.0.1", "trainer", 1, 1, "10.0.0.1:6181", (1,)),
        ("10.0.0.2", "trainer", 2, 0, "10.0.0.2:6180", (2,)),
        ("10.0.0.2", "trainer", 3, 1, "10.0.0.2:6181", (3,)),
        ("10.0.0.3", "trainer", 4, 0, "10.0.0.3:6180", (0,)),
        ("10.0.0.3", "trainer", 5, 1, "10.0.0.3:6181", (1,)),
    ]
    t3 = plan.processes[5]
    assert t3.env["CUDA_VISIBLE_DEVICES"] == "3" and t3.env["FLAGS_selected_gpus"] == "0"
    assert t3.env["PADDLE_PSERVERS_IP_PORT_LIST"] == "10.0.0.1:6170,10.0.0.2:6170"
    assert t3.env["GLOG_v"] == "1"
    assert t3.argv == (
        "python3", "dist_train_demo.py", "trainer", "10.0.0.1:6170,10.0.0.2:6170", "10.0.0.2:6181", "3", "6",
    )
    ps1 = plan.processes[1]
    assert ps1.argv[2:] == ("pserver", "10.0.0.1:6170,10.0.0.2:6170", "10.0.0.2:6170", "1", "6")
    assert ps1.env["PADDLE_PSERVER_ID"] == "1" and ps1.env["TRAINING_ROLE"] == "PSERVER"
    assert not {"RANK", "WORLD_SIZE", "MASTER_ADDR", "CUDA_VISIBLE_DEVICES"} & set(ps1.env)
    assert set(plan.processes[2].env) <= CONTRACT_ENV | {"GLOG_v", "CLUSTERCTL_PS_MODE", "CLUSTERCTL_PS_K_STEPS"}


def test_hostfile_slots(tmp_path):
    (tmp_path / "hosts").write_text("10.0.0.7 slots=3\n10.0.0.8 slots=1\n")
    spec = tmp_path / "c.yaml"
    spec.write_text("name: hf\nhostfile: hosts\njob: {entrypoint: [x]}\n")
    from clusterctl.spec import load_spec

    plan = make_plan(load_spec(spec))
    assert [(p.host.address, p.id, p.local_rank) for p in plan.processes] == [
        ("10.0.0.7", 0, 0), ("10.0.0.7", 1, 1), ("10.0.0.7", 2, 2), ("10.0.0.8", 3, 0),
    ]
    assert plan.processes[3].env["LOCAL_WORLD_SIZE"] == "1"
    assert plan.processes[0].env["LOCAL_WORLD_SIZE"] == "3"


def test_reordered_hosts_reorder_ids_deterministically():
    a = plan_of(SHAPE)
    b = plan_of(SHAPE.replace("10.0.0.1", "10.0.0.X").replace("10.0.0.3", "10.0.0.1").replace("10.0.0.X", "10.0.0.3"))
    assert a.to_json() == plan_of(SHAPE).to_json()  # same spec, same plan
    assert [p.host.address for p in b.trainers] == ["10.0.0.3", "10.0.0.3", "10.0.0.2", "10.0.0.2", "10.0.0.1", "10.0.0.1"]
    assert [p.id for p in b.trainers] == list(range(6))


def test_pservers_per_host_and_explicit_list():
    per = plan_of(SHAPE.replace("pservers: 2", "pservers: {per_host: 2}"))
    assert [(p.host.address, p.endpoint) for p in per.pservers] == [
        ("10.0.0.1", "10.0.0.1:6170"), ("10.0.0.1", "10.0.0.1:6171"),
        ("10.0.0.2", "10.0.0.2:6170"), ("10.0.0.2", "10.0.0.2:6171"),
        ("10.0.0.3", "10.0.0.3:6170"), ("10.0.0.3", "10.0.0.3:6171"),
    ]
    explicit = plan_of(SHAPE.replace("pservers: 2", "pservers: [10.0.0.3, 10.0.0.3]"))
    assert [p.endpoint for p in explicit.pservers] == ["10.0.0.3:6170", "10.0.0.3:6171"]


def test_placeholder_values_are_not_reparsed():
    plan = plan_of(
        "name: q\nhosts: [{address: h1}]\njob: {entrypoint: [x], args: ['{{literal}}', '--ep={current_endpoint}', '{job}']}\n"
    )
    assert plan.processes[0].argv == ("x", "{literal}", "--ep=h1:6180", "q")


def test_plan_json_cli(tmp_path):
    spec = tmp_path / "c.yaml"
    spec.write_text(SHAPE)
    res = subprocess.run([sys.executable, "-m", "clusterctl.cli", "plan", str(spec), "--json"], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    data = json.loads(res.stdout)
    assert data["job"] == "big"
    assert len(data["processes"]) == 8
    assert set(data["processes"][0]) == {"host", "role", "id", "rank", "local_rank", "endpoint", "gpus", "env", "argv"}
    assert data["processes"][2]["gpus"] == [0] and data["processes"][0]["rank"] is None


def test_data_shards_dealt_by_index_mod_trainers():
    spec = parse_spec(
        "name: d\nhosts: [{address: a}, {address: b}]\ndata: {local: shards, pattern: 'part-*'}\n"
        "job: {entrypoint: [x], trainers: 1}\n"
    )
    names = [f"part-{i:05d}" for i in range(5)]
    plan = make_plan(spec, data_files=list(reversed(names)))  # order given does not matter
    assert [t.env["CLUSTERCTL_DATA_FILES"] for t in plan.trainers] == [
        "data/part-00000:data/part-00002:data/part-00004",
        "data/part-00001:data/part-00003",
    ]


def test_launcher_mpi_runs_the_provisioned_venvs_mpiexec_unless_the_spec_names_one():
    """`provision.mpi` puts MPICH's wheels (bin/mpiexec with them) into `provision.python.venv`; with `job.mpiexec`
    left out, `mpiexec` on PATH was not found on such hosts (`preflight: mpiexec not found in PATH=...`). That venv's
    mpiexec is the default now: under the home (`~/venv` is `venv`, mpiexec runs from the home) or absolute."""
    head = ("name: m\nhosts: [10.0.0.1, 10.0.0.2]\njob: {mode: collective, launcher: mpi, entrypoint: [python3, t.py]%s}\n"
            "provision:\n  python: {venv: %s}\n  mpi: %s\n")
    assert plan_of(head % ("", "~/venv", "mpich")).mpi.argv[0] == "venv/bin/mpiexec"
    assert plan_of(head % ("", "/opt/v", "{implementation: mpich}")).mpi.argv[0] == "/opt/v/bin/mpiexec"
    assert plan_of(head % (", mpiexec: /usr/bin/mpiexec.hydra", "~/venv", "mpich")).mpi.argv[0] == "/usr/bin/mpiexec.hydra"
    assert plan_of(head % ("", "~/venv", "openmpi")).mpi.argv[0] == "mpiexec"  # another MPI than the job's launch
    assert plan_of(head.split("provision:")[0] % "").mpi.argv[0] == "mpiexec"
