"""`clusterctl top` with backend: slurm and backend: kubernetes, over fakes: every process with its progress and the
straggler, and a node or pod that does not answer is a row that says so.

Slurm: the fake Slurm (tests/unit/fakeslurm.py) runs the real batch script, glue and supervisors on fake hosts;
`top` goes through the real `slurmctl login top` and its one `srun --overlap` step of `node-top` per refresh.
Kubernetes: a fake `kubectl` lists pods that the test describes and runs each `kubectl exec` argv here, in the job
dir of a real supervisor on a fake host (the pod's paths mapped onto that host's): the argv, the pods' reading and
the replies are the backend's own.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import yaml

from clusterctl import k8s
from clusterctl.backends import load_spec
from clusterctl.cli import main
from clusterctl.ops.dispatch import dispatch
from clusterctl.ops.hosttools import package_dir
from clusterctl.ops.job import start, stop

sys.path.insert(0, os.path.dirname(__file__))
from fakehosts import FakeCluster, job_pids, wait_until  # noqa: E402

# Every rank prints a progress line per step (as clusterctl.report writes them); rank SLOW_RANK sleeps 4x longer.
TRAIN = """\
import os, time
rank = int(os.environ["RANK"])
delay = 0.05 * (4 if str(rank) == os.environ.get("SLOW_RANK") else 1)
for step in range(1000000):
    print("step=%d loss=%.4f time=%.3f" % (step, 1.0 / (step + 1), time.time()), flush=True)
    time.sleep(delay)
"""
HOST_PACKAGE = Path(k8s.__file__).resolve().parent / "host"


def top(capsys, spec) -> tuple[int, dict]:
    """`clusterctl top SPEC --once --json` with the shortest straggler window (6 s)."""
    code = main(["top", str(spec), "--once", "--json", "--no-gpu", "--straggler-window", "6"])
    out = capsys.readouterr().out
    return code, json.loads(out)


def _straggler_seen(capsys, spec, process: str):
    """top's verdict, once every process has a rate and the rule has a window of history (a busy machine may delay
    the ranks' first lines by a few seconds)."""
    def seen():
        code, doc = top(capsys, spec)
        ok = all(p["progress"] and p["progress"]["rate"] for p in doc["processes"])
        return ok and [s["process"] for s in doc["stragglers"]] == [process] and (code, doc)
    return wait_until(seen, timeout=45, interval=1.0)


# ------------------------------------------------------------------------------------------- Slurm


def slurm_cluster(tmp_path, monkeypatch):
    from fakeslurm import install

    c = FakeCluster(tmp_path, files={"train.py": TRAIN}, hosts=2, job={"trainers": 2, "env": {"SLOW_RANK": "3"}})
    data = yaml.safe_load(c.spec_path.read_text())
    data.pop("hosts")
    data.update(backend="slurm", slurm={"login": "login", "nodes": 2, "partition": "debug", "workspace": "shared"})
    data["workspace"]["remote"] = str(c.root / "login" / c.remote_dir)
    c.spec_path.write_text(yaml.safe_dump(data, sort_keys=False))
    c.slurm = tmp_path / "slurm"
    install(c.bin, c.slurm, c.root, 2)
    return c.everywhere(monkeypatch)


def test_top_under_slurm_gathers_every_node_in_one_srun_step(tmp_path, monkeypatch, capsys):
    c = slurm_cluster(tmp_path, monkeypatch)
    code, doc = top(capsys, c.spec_path)  # never submitted: one row, under the login node's name
    assert code == 0 and doc["state"] == "not running" and doc["processes"] == []
    assert [(h["host"], h["status"], h["error"]) for h in doc["hosts"]] == [
        ("login", "no job", f"job {c.name} was never submitted from login")]
    assert main(["start", str(c.spec_path), "--dispatch"]) == 0
    capsys.readouterr()
    jobdirs = [c.root / f"127.0.0.{i}" / ".clusterctl" / "slurm" / "jobs" / c.name / f"4242-node{i}" for i in (1, 2)]
    for d in jobdirs:  # `start` asked for the status while a supervisor did not listen yet: `agent top --progress-only`
        (d / "top-cache.json").unlink(missing_ok=True)
    try:
        code, doc = _straggler_seen(capsys, c.spec_path, "trainer.3")
        assert code == 0 and doc["state"] == "running"
        assert [(p["host"], p["name"], p["state"]) for p in doc["processes"]] == [
            ("node1", "trainer.0", "running"), ("node1", "trainer.1", "running"),
            ("node2", "trainer.2", "running"), ("node2", "trainer.3", "running")]
        assert all(isinstance(p["pid"], int) and p["rss_bytes"] > 1 << 20 and p["progress"]["step"] > 0
                   for p in doc["processes"])
        assert [(h["host"], h["status"], h["state"]) for h in doc["hosts"]] == [("node1", "ok", "running"),
                                                                                ("node2", "ok", "running")]
        assert doc["stragglers"][0]["host"] == "node2" and doc["stragglers"][0]["ratio"] < 0.8
        # the supervisors answered over their control sockets: `agent top` (which keeps top-cache.json) never ran
        assert all((d / "control").exists() and not (d / "top-cache.json").exists() for d in jobdirs)

        # node2's step cannot run (its host package is gone): a row that says so; node1 goes on; exit 1
        pkg = c.root / "127.0.0.2" / package_dir()
        pkg.rename(pkg.with_name("moved"))
        try:
            code, doc = top(capsys, c.spec_path)
        finally:
            pkg.with_name("moved").rename(pkg)
        assert code == 1 and doc["state"] == "lost"
        assert [(h["host"], h["status"]) for h in doc["hosts"]] == [("node1", "ok"), ("node2", "unreachable")]
        assert doc["hosts"][1]["error"].startswith("no answer from its srun --overlap step: "), doc["hosts"][1]
        assert [p["name"] for p in doc["processes"]] == ["trainer.0", "trainer.1"]
        code = main(["top", str(c.spec_path), "--once", "--no-gpu"])
        text = capsys.readouterr().out
        assert code == 0 and f"job {c.name}: running · 2 host(s), 4 process(es)" in text and "host total" in text
    finally:
        assert main(["stop", str(c.spec_path)]) == 0
        capsys.readouterr()
    assert job_pids(c.name) == []
    code, doc = top(capsys, c.spec_path)
    assert code == 0 and doc["state"] == "stopped" and doc["hosts"][0]["host"] == "login"
    assert doc["hosts"][0]["error"].startswith("Slurm job 4242 CANCELLED; top shows a running job"), doc["hosts"]


# -------------------------------------------------------------------------------------- Kubernetes

# The fake kubectl: `get` answers the pods of $FAKE_PODS; `exec POD -c C -- ARGV` runs ARGV here with the pod's
# paths mapped onto fake host n<index>'s (the host package: this checkout's; the job dir: that host's), unless
# the pod is listed in $FAKE_PODS.down (then kubectl's own error, exit 1). Every argv is logged.
KUBECTL = r"""#!{python}
import json, os, re, subprocess, sys
args = sys.argv[1:]
state = os.environ["FAKE_PODS"]
with open(state + ".log", "a") as log:
    log.write(json.dumps(args) + "\n")
while args[0].startswith("--"):
    args = args[2:]
if args[0] == "get":
    print(json.dumps({{"items": json.load(open(state))}}))
    sys.exit(0)
assert args[0] == "exec" and args[2] == "-c" and args[4] == "--", args
pod, argv = args[1], args[5:]
if os.path.exists(state + ".down") and pod in open(state + ".down").read().split():
    sys.stderr.write("error: unable to upgrade connection: container not found (\"trainer\")\n")
    sys.exit(1)
home = os.path.join({root!r}, "n" + re.match(r".*-(\d+)-[a-z0-9]{{5}}$", pod).group(1))
mapped = [a.replace({state_dir!r} + "/jobs", ".clusterctl/jobs").replace({state_dir!r}, {tmp!r})
           .replace({mount!r}, {opt!r}) for a in argv]
mapped[0] = {python!r}
sys.exit(subprocess.run(mapped, cwd=home).returncode)
"""


def _pod(name: str, i: int, *, state: dict) -> dict:
    return {"kind": "Pod", "metadata": {"name": f"{name}-trainer-{i}-abcde", "creationTimestamp": "2024-01-01T00:00:00Z",
                                        "labels": {k8s.LABEL_ROLE: "trainer"},
                                        "annotations": {k8s.INDEX_ANNOTATION: str(i)}},
            "status": {"phase": "Running", "containerStatuses": [{"name": "trainer", "state": state}]}}


def test_top_under_kubernetes_asks_each_pod_with_kubectl_exec(tmp_path, monkeypatch, capsys):
    # the pods' processes: a real supervisor per fake host, one trainer each (rank 2 slow)
    c = FakeCluster(tmp_path, files={"train.py": TRAIN}, hosts=3, job={"trainers": 1, "env": {"SLOW_RANK": "2"}})
    opt = tmp_path / "opt"
    opt.mkdir()
    (opt / k8s.HOST_PACKAGE).symlink_to(HOST_PACKAGE)
    kbin = tmp_path / "kbin"
    kbin.mkdir()
    (kbin / "kubectl").write_text(KUBECTL.format(python=sys.executable, root=str(c.root), state_dir=k8s.STATE_MOUNT,
                                                 tmp=str(tmp_path / "pod-state"), mount=k8s.HOST_MOUNT, opt=str(opt)))
    (kbin / "kubectl").chmod(0o755)
    spec = tmp_path / "k8s.yaml"
    spec.write_text(yaml.safe_dump({
        "name": c.name, "backend": "kubernetes", "hosts": [{"address": f"shape-{i}"} for i in range(3)],
        "job": {"entrypoint": ["python3", "train.py"], "trainers": 1}, "kubernetes": {"image": "img"}}))
    kspec = load_spec(str(spec))
    pods = tmp_path / "pods.json"
    name = c.name
    pods.write_text(json.dumps([{"kind": "Job", "metadata": {"name": f"{name}-trainer"}}]
                               + [_pod(name, i, state={"running": {}}) for i in range(3)]))
    monkeypatch.setenv("FAKE_PODS", str(pods))
    monkeypatch.setenv("PATH", f"{kbin}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    with c.session() as s:
        dispatch(s)
        start(s)
        try:
            code, doc = _straggler_seen(capsys, spec, "trainer.2")
            assert code == 0 and doc["state"] == "running"
            assert [(p["host"], p["name"], p["state"]) for p in doc["processes"]] == [
                (f"{name}-trainer-{i}-abcde", f"trainer.{i}", "running") for i in range(3)]
            assert all(isinstance(p["pid"], int) and p["rss_bytes"] > 1 << 20 and p["progress"]["step"] > 0
                       for p in doc["processes"])
            assert doc["stragglers"][0]["host"] == f"{name}-trainer-2-abcde"
            # the last refresh: one `kubectl get` for every pod, then one `kubectl exec` of `agent top` per pod
            log = [json.loads(line) for line in Path(f"{pods}.log").read_text().splitlines()]
            last = log[max(i for i, a in enumerate(log) if "get" in a):]
            assert last[0] == ["--namespace", "default", "get", "jobs,pods", "-l", f"{k8s.LABEL_JOB}={name}", "-o", "json"]
            agent = k8s.host_tool_argv(kspec, "agent", ["top", k8s.jobdir(kspec), "--slice", "1", "--slices", "6",
                                                        "--no-gpu"])
            assert sorted(last[1:]) == [["--namespace", "default", "exec", f"{name}-trainer-{i}-abcde", "-c", "trainer",
                                         "--", *agent] for i in range(3)]

            # a pod kubectl cannot reach, one not started yet: rows that say so; the others go on
            Path(f"{pods}.down").write_text(f"{name}-trainer-1-abcde\n")
            waiting = _pod(name, 2, state={"waiting": {"reason": "ContainerCreating"}})
            pods.write_text(json.dumps(json.loads(pods.read_text())[:3] + [waiting]))
            code, doc = top(capsys, spec)
            assert code == 1 and doc["state"] == "lost"
            assert [(h["host"], h["status"], h["error"]) for h in doc["hosts"]] == [
                (f"{name}-trainer-0-abcde", "ok", None),
                (f"{name}-trainer-1-abcde", "unreachable", f"kubectl exec {name}-trainer-1-abcde: error: unable to "
                                                          'upgrade connection: container not found ("trainer")'),
                (f"{name}-trainer-2-abcde", "waiting", "not started (ContainerCreating)")]
            assert [p["name"] for p in doc["processes"]] == ["trainer.0"]
        finally:
            stop(s)
    assert job_pids(c.name) == []
    pods.write_text("[]")  # no objects: one row per process that says so
    code, doc = top(capsys, spec)
    assert code == 0 and doc["state"] == "not running"
    assert [(h["host"], h["status"]) for h in doc["hosts"]] == [(f"{name}-trainer-{i}", "no job") for i in range(3)]


# ------------------------------------------------------------------------------------------- local


def test_top_with_backend_local_asks_this_machine(tmp_path, monkeypatch, capsys):
    from helpers import free_port_base

    home = tmp_path / "home"
    (tmp_path / "ws").mkdir()
    (tmp_path / "ws" / "train.py").write_text(TRAIN)
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    name = f"loc-{os.urandom(4).hex()}"
    base = free_port_base(24)
    spec = tmp_path / "local.yaml"
    spec.write_text(yaml.safe_dump({
        "name": name, "backend": "local", "hosts": [{"address": "localhost"}],
        "workspace": {"local": str(tmp_path / "ws"), "remote": f"clusterctl-local/{name}"},
        "job": {"entrypoint": [sys.executable, "train.py"], "trainers": 3, "grace": 2, "env": {"SLOW_RANK": "1"},
                "ports": {"control": base, "master": base + 1, "pserver": base + 2, "trainer": base + 12}}}))
    assert main(["start", "--dispatch", str(spec)]) == 0
    capsys.readouterr()
    try:
        code, doc = _straggler_seen(capsys, spec, "trainer.1")
        assert code == 0 and [(p["host"], p["name"], p["state"]) for p in doc["processes"]] == [
            ("localhost", f"trainer.{i}", "running") for i in range(3)]
    finally:
        assert main(["stop", str(spec)]) == 0
    assert job_pids(name) == []
