"""`backend: kubernetes` end to end: `clusterctl start/status/logs/stop` against a fake kubectl whose pods are
Docker containers running what real pods would run (k8sharness.py, fakekube.py).

No Kubernetes API server is involved (none can run here): what this proves is that the objects the backend
creates, played by the kubelet's rules as fakekube implements them, make pods whose supervisors train, restart,
fail fast, stop and authenticate as over SSH. It does not prove how a real cluster schedules, names or
deletes pods beyond those rules (docs/kubernetes.md, "The test harness").
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

import k8sharness as h
from clusterlib import cli_to_interrupt, interrupt, read_until

pytestmark = pytest.mark.integration

NS = "k8s-it"
JOBS = Path(__file__).resolve().parent / "jobs"


@pytest.fixture(scope="module")
def image(testcluster_packages, request):
    """The pods' image: the test cluster's node image plus this checkout's wheel in /opt/venv."""
    from clusterctl import testcluster as tc
    from clusterctl.errors import ClusterctlError

    try:
        tc.ensure_docker()
    except ClusterctlError as exc:
        if os.environ.get("CI", "").lower() in ("true", "1", "yes"):
            pytest.fail(f"docker cannot be used: {exc}")
        pytest.skip(f"docker cannot be used: {exc}")
    tag, _built = h.pod_image(testcluster_packages, lambda: request.getfixturevalue("clusterctl_wheel"))
    return tag


@pytest.fixture(scope="module")
def kube(tmp_path_factory, image):
    """A fake cluster (state dir, docker network, `kubectl`), removed with every container at the end. This
    process's environment points at it too (the backend, called in-process to poll the status, runs kubectl)."""
    k = h.up(tmp_path_factory.mktemp("fakekube"))
    with pytest.MonkeyPatch.context() as mp:
        for key, value in k.env().items():
            if os.environ.get(key) != value:
                mp.setenv(key, value)
        yield k
    h.down(k)


def _status(kube, spec) -> dict:
    """`clusterctl status --json`, the CLI run as a user would."""
    res = h.clusterctl(kube, "status", spec, "--json")
    assert res.stdout.startswith("{"), res.stdout + res.stderr
    return json.loads(res.stdout)


def _backend_status(spec) -> dict:
    """The backend's status, called in-process (what `clusterctl status --json` prints, without its start-up)."""
    from clusterctl.backends import open_backend

    with open_backend(str(spec)) as backend:
        return backend.status().to_json()


def _wait(kube, spec, ok, timeout: float, what: str) -> dict:
    """Poll the job's status until ok(status)."""
    deadline = time.monotonic() + timeout
    while True:
        st = _backend_status(spec)
        if ok(st):
            return st
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not within {timeout:g}s: {st}")
        time.sleep(0.5)


def _running(st, role, id) -> dict | None:
    return next((p for p in st["processes"] if (p["role"], p["id"]) == (role, id) and p["state"] == "running"), None)


def _token(kube, name) -> str:
    res = kube.kubectl("get", "secrets", "-l", f"clusterctl.io/job={name}", "-o", "json", ns=NS)
    (secret,) = json.loads(res.stdout)["items"]
    return base64.b64decode(secret["data"]["token"]).decode()


def _pods(kube, name) -> dict[tuple[str, int], dict]:
    out = {}
    for p in kube.pods(NS, f"clusterctl.io/job={name}"):
        out[p["metadata"]["labels"]["clusterctl.io/role"], int(p["metadata"]["annotations"][
            "batch.kubernetes.io/job-completion-index"])] = p
    return out


# a stranger on the pods' network (tests/integration/jobs/ps_stranger.py): no keys, another token's, the job's
STRANGER = (h.ROOT / "tests" / "integration" / "jobs" / "ps_stranger.py").read_text()

# run in a pod: which processes hold the raw token (stdin) in their environment, and the derived one
ENVIRON = """
import json, os, sys
raw = sys.stdin.read().strip().encode()
out = {}
for pid in (p for p in os.listdir("/proc") if p.isdigit() and int(p) != os.getpid()):
    try:
        env = open("/proc/%s/environ" % pid, "rb").read().split(b"\\0")
        cmd = open("/proc/%s/cmdline" % pid, "rb").read().replace(b"\\0", b" ").decode()
    except OSError:
        continue
    out[pid] = {"raw": any(raw in e for e in env), "cmd": cmd,
                "derived": [e.decode().split("=", 1)[1] for e in env if e.startswith(b"CLUSTERCTL_JOB_TOKEN=")]}
print(json.dumps(out))
"""


@pytest.mark.timeout(300)
def test_fit_a_line_trains_to_success_and_a_stranger_is_refused_by_its_pserver(kube, image, tmp_path):
    from clusterctl import k8s
    from clusterctl.host.spawn import process_token
    from clusterctl.spec import load_spec

    ws = tmp_path / "fit_a_line"
    shutil.copytree(h.ROOT / "examples" / "fit_a_line", ws, ignore=shutil.ignore_patterns("__pycache__"))
    spec = h.write_spec(tmp_path / "fal.yaml", name="k8s-fal", image=image, workspace=ws, job={
        "mode": "pserver", "entrypoint": ["/opt/venv/bin/python", "train.py"], "args": ["--step-delay", "0.03"],
        "pservers": 1, "trainers": 1, "grace": 3})
    run = subprocess.Popen([sys.executable, "-m", "clusterctl.cli", "start", str(spec), "--follow"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**kube.env(), "COLUMNS": "200"})
    stranger = subprocess.Popen(["docker", "run", "--rm", "-i", "--network", kube.network, "--entrypoint",
                                 "/opt/venv/bin/python", image, "-c", STRANGER, "k8s-fal-pserver-0.k8s-fal:6170"],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        st = _wait(kube, spec, lambda s: _running(s, "trainer", 0) and _running(s, "trainer", 1), 120, "trainers running")
        token = _token(kube, "k8s-fal")
        derived = process_token(token)
        # the raw token is in no process of the job: not the pod's PID 1, not the supervisor, not the pserver
        pserver_pod = _running(st, "pserver", 0)["host"]
        res = subprocess.run(["docker", "exec", "-i", kube.main_container(pserver_pod, "pserver"), "python3", "-c",
                              ENVIRON], input=token, capture_output=True, text=True, timeout=60)
        procs = json.loads(res.stdout)
        pserver_pid = str(_running(st, "pserver", 0)["pid"])
        assert procs["1"]["raw"] is False and "pod init" in procs["1"]["cmd"], procs["1"]
        assert procs[pserver_pid]["raw"] is False and procs[pserver_pid]["derived"] == [derived], procs[pserver_pid]
        holders = {pid: p["cmd"] for pid, p in procs.items() if p["raw"]}
        assert all("agent status" in c or "agent stop" in c for c in holders.values()), holders  # kubectl exec only
        # the stranger is refused without the job's token, and served with it (the key derived from the Secret's)
        out, err = stranger.communicate(derived + "\n", timeout=120)
        assert stranger.returncode == 0, err
        got = json.loads(out)  # another token's keys: refused by the door, or the handshake never completes
        assert got["plain"] == "no answer" and got["wrong"] in ("refused", "no answer") and got["right"] == "served", out
        out, err = run.communicate(timeout=240)
    finally:
        for proc in (run, stranger):
            if proc.poll() is None:
                proc.kill()
    assert run.returncode == 0, out[-4000:] + err[-2000:]
    done = re.findall(r"^\[k8s-fal-trainer-(\d)-[a-z0-9]{5} trainer\.(\d)\] done steps=\d+ loss=([\d.]+) ", out, re.M)
    assert sorted((pod, tid) for pod, tid, _ in done) == [("0", "0"), ("1", "1")], out[-4000:]
    assert all(float(loss) < 10 for _, _, loss in done), done  # the seed's "avg cost < 10"
    final = _status(kube, spec)
    assert final["state"] == "succeeded" and final["backend"] == "kubernetes", final
    by = {(p["role"], p["id"]): (p["state"], p["exit_code"]) for p in final["processes"]}
    assert (by["trainer", 0], by["trainer", 1]) == (("exited", 0), ("exited", 0)), by
    # the pserver exits once both trainers completed, or is stopped by its supervisor as the job succeeded
    assert by["pserver", 0][0] in ("exited", "stopped"), by
    logs = h.clusterctl(kube, "logs", spec, "--role", "pserver")
    assert logs.returncode == 0 and "pserver 0 of 1 listening" in logs.stdout, logs.stdout + logs.stderr
    assert "NOT authenticated" not in logs.stdout
    assert "all 2 trainer(s) completed" in logs.stdout
    # the token: in the Secret only; never in a kubectl command line, a container's command, or the logs
    assert not any(token in " ".join(argv) or derived in " ".join(argv) for argv in kube.journal())
    for name in kube.containers():
        cfg = json.loads(subprocess.run(["docker", "inspect", name], capture_output=True, text=True).stdout)[0]
        assert token not in json.dumps([cfg["Path"], cfg["Args"], cfg["Config"]["Cmd"], cfg["Config"]["Entrypoint"]])
    assert token not in out + err + logs.stdout
    # `clusterctl k8s render` renders what start created (but for the token, new on every render)
    rendered = k8s.render(load_spec(spec), token=token)
    for doc in rendered:
        stored = json.loads((kube.dir / "ns" / NS / "objects" / doc["kind"] / f"{doc['metadata']['name']}.json").read_text())
        for key in ("creationTimestamp", "uid"):
            del stored["metadata"][key]
        assert stored == json.loads(json.dumps(doc)), doc["kind"]
    res = h.clusterctl(kube, "stop", spec)
    assert res.returncode == 0 and "job k8s-fal is not running" in res.stdout, res.stdout + res.stderr


# kill -9 PID, if PID is the job's trainer (not a pid reused meanwhile)
KILL = "import os, sys; p = int(sys.argv[1]); assert b'job.py' in open('/proc/%d/cmdline' % p, 'rb').read(); os.kill(p, 9)"


@pytest.mark.slow  # 26-46 s on the shared 2-core machine: keeps the default tier's Kubernetes part near 1.5 min
@pytest.mark.timeout(240)
def test_a_trainer_killed_in_its_pod_restarts_there_and_the_job_succeeds(kube, image, tmp_path):
    spec = h.write_spec(tmp_path / "restart.yaml", name="k8s-restart", image=image, workspace=JOBS, job={
        "entrypoint": ["python3", "job.py"], "args": ["{role}", "{id}"], "trainers": 1, "restarts": 1,
        "restart_backoff": 1, "grace": 2, "env": {"STEPS": "80", "STEP_S": "0.1"}})
    res = h.clusterctl(kube, "start", spec)
    assert res.returncode == 0, res.stdout + res.stderr
    st = _wait(kube, spec, lambda s: _running(s, "trainer", 1), 60, "trainer 1 running")
    victim = _running(st, "trainer", 1)
    pods_before = {k: p["metadata"]["name"] for k, p in _pods(kube, "k8s-restart").items()}
    kill = kube.kubectl("exec", victim["host"], "-c", "trainer", "--", "python3", "-c", KILL, str(victim["pid"]), ns=NS)
    assert kill.returncode == 0, kill.stderr
    final = _wait(kube, spec, lambda s: s["state"] in ("succeeded", "failed"), 120, "the job's end")
    assert final["state"] == "succeeded", final
    assert (final["attempt"], final["restarts"]) == (1, 1), final
    first = final["attempts"][0]
    assert first["attempt"] == 0 and first["outcome"] == "failed", final["attempts"]
    assert first["reason"] == f"trainer.1 on {victim['host']} exited with code -9", first
    # the restart was the supervisor's, inside the same pods: Kubernetes retried nothing
    assert {k: p["metadata"]["name"] for k, p in _pods(kube, "k8s-restart").items()} == pods_before
    logs = h.clusterctl(kube, "logs", spec, "--role", "trainer", "--id", "1")
    assert logs.returncode == 0, logs.stderr
    assert f"[{victim['host']} trainer.1#1] attempt=1 torchelastic=1" in logs.stdout.splitlines(), logs.stdout
    assert f"[{victim['host']} trainer.1] step=0 trainer=1" in logs.stdout.splitlines()  # attempt 0 is kept too
    assert f"[{victim['host']} trainer.1#1] step=79 trainer=1" in logs.stdout.splitlines()
    # -n: the last lines of the process (its latest attempt's), plain and followed (the pod ended: it returns)
    t0 = _pods(kube, "k8s-restart")["trainer", 0]["metadata"]["name"]
    last = [f"[{t0} trainer.0#1] step=78 trainer=0", f"[{t0} trainer.0#1] step=79 trainer=0"]
    for args in (("-n", "2"), ("--follow", "-n", "2")):
        logs = h.clusterctl(kube, "logs", spec, "--role", "trainer", "--id", "0", *args)
        assert (logs.returncode, logs.stdout.splitlines()) == (0, last), logs.stdout + logs.stderr
    res = h.clusterctl(kube, "stop", spec)
    assert res.returncode == 0, res.stdout + res.stderr


@pytest.mark.timeout(240)
def test_a_failing_trainer_fails_the_job_fast_and_every_pod_ends(kube, image, tmp_path):
    spec = h.write_spec(tmp_path / "fail.yaml", name="k8s-fail", image=image, workspace=JOBS, job={
        "mode": "pserver", "entrypoint": ["python3", "job.py"], "args": ["{role}", "{id}"], "pservers": 1,
        "trainers": 1, "grace": 2,
        "env": {"STEPS": "600", "STEP_S": "0.1", "FAIL_TRAINER": "1", "FAIL_AFTER": "3", "FAIL_CODE": "3"}})
    res = h.clusterctl(kube, "start", spec)
    assert res.returncode == 0, res.stdout + res.stderr
    # the end is every process's end: while the pserver's pod winds down, its supervisor may answer no exec for a
    # poll (unreachable, its row still `running`), and a failed pod beside an unreachable one already reads failed
    final = _wait(kube, spec, lambda s: s["state"] not in ("starting", "running", "stopping")
                  and not any(p["state"] == "running" for p in s["processes"]), 60, "the job's end")
    assert final["state"] == "failed", final
    t1 = next(p for p in final["processes"] if (p["role"], p["id"]) == ("trainer", 1))
    assert final["reason"] == f"{_pods(kube, 'k8s-fail')['trainer', 0]['metadata']['name']}: trainer.1 on " \
                              f"{t1['host']} exited with code 3", final["reason"]
    by = {(p["role"], p["id"]): (p["state"], p["exit_code"]) for p in final["processes"]}
    assert by == {("trainer", 1): ("failed", 3), ("trainer", 0): ("stopped", -15), ("pserver", 0): ("stopped", -15)}
    # every pod ended by itself (its supervisor exited 1): Kubernetes stopped nothing, and retried nothing
    deadline = time.monotonic() + 30
    while {p["status"]["phase"] for p in _pods(kube, "k8s-fail").values()} != {"Failed"}:
        assert time.monotonic() < deadline, [p["status"] for p in _pods(kube, "k8s-fail").values()]
        time.sleep(0.5)
    assert len(_pods(kube, "k8s-fail")) == 3
    logs = h.clusterctl(kube, "logs", spec, "--role", "trainer", "--id", "1")
    assert f"[{t1['host']} trainer.1] failing on purpose" in logs.stdout.splitlines(), logs.stdout + logs.stderr
    res = h.clusterctl(kube, "stop", spec)
    assert res.returncode == 0 and "job k8s-fail is not running" in res.stdout, res.stdout + res.stderr


@pytest.mark.timeout(180)
def test_a_script_missing_from_the_pods_fails_the_job_at_its_start_and_is_never_restarted(kube, image, tmp_path):
    """A pod's supervisor runs the preflight of the ssh path and of Slurm's node (its file checks: host/pod.py): a
    script that is not in the image fails the first attempt as `failed to start`, which no restart repeats."""
    spec = h.write_spec(tmp_path / "noscript.yaml", name="k8s-noscript", image=image, workspace=JOBS, job={
        "entrypoint": ["python3", "no_such_job.py"], "trainers": 1, "restarts": 3, "restart_backoff": 1, "grace": 2})
    res = h.clusterctl(kube, "start", spec)
    assert res.returncode == 0, res.stdout + res.stderr
    final = _wait(kube, spec, lambda s: s["state"] not in ("starting", "running", "stopping")
                  and not any(p["state"] == "running" for p in s["processes"]), 60, "the job's end")
    assert final["state"] == "failed", final
    assert final["attempt"] == 0, final  # 3 restarts allowed, none made
    assert re.fullmatch(r"k8s-noscript-trainer-[01]-[a-z0-9]{5}: trainer\.[01] on \S+ failed to start: preflight: "
                        r"trainer\.[01]: script /workspace/no_such_job\.py not found", final["reason"]), final["reason"]
    assert [a["outcome"] for a in final["attempts"]] == ["failed"], final["attempts"]
    deadline = time.monotonic() + 30
    while {p["status"]["phase"] for p in _pods(kube, "k8s-noscript").values()} != {"Failed"}:
        assert time.monotonic() < deadline, [p["status"] for p in _pods(kube, "k8s-noscript").values()]
        time.sleep(0.5)
    assert len(_pods(kube, "k8s-noscript")) == 2  # Kubernetes retried nothing either
    res = h.clusterctl(kube, "stop", spec)
    assert res.returncode == 0, res.stdout + res.stderr


@pytest.mark.timeout(240)
def test_stop_ends_every_process_in_every_pod_and_deletes_the_job(kube, image, tmp_path):
    spec = h.write_spec(tmp_path / "stop.yaml", name="k8s-stop", image=image, workspace=JOBS, job={
        "mode": "pserver", "entrypoint": ["python3", "job.py"], "args": ["{role}", "{id}"], "pservers": 1,
        "trainers": 1, "grace": 2, "env": {"STEPS": "100000", "SETSID_CHILD": "1"}})
    res = h.clusterctl(kube, "start", spec)
    assert res.returncode == 0, res.stdout + res.stderr
    st = _wait(kube, spec, lambda s: _running(s, "trainer", 0) and _running(s, "trainer", 1), 60, "trainers running")
    again = h.clusterctl(kube, "start", spec)
    assert again.returncode == 1 and "job k8s-stop is already running; stop it first (clusterctl stop)" in again.stderr
    # the sweep finds the job's processes in the pods: each trainer and the grandchild it started with setsid
    for role, i in (("trainer", 0), ("trainer", 1)):
        pod = _running(st, role, i)["host"]

        def tagged():
            res = subprocess.run(["docker", "exec", kube.main_container(pod, role), "python3", "-c", _sweep_script()],
                                 capture_output=True, text=True, timeout=60)
            return len(json.loads(res.stdout)) == 2  # once the trainer (just started) has started its grandchild

        _until(tagged, 60, f"two processes tagged with the job in {pod}")
    # Ctrl+C on `logs --follow` (SIGINT to clusterctl alone, as a wrapper sends it): exit 130, and no `kubectl
    # logs -f` it started is left streaming on this machine (they would until the pods end); the job runs on
    with cli_to_interrupt("logs", spec, "--follow", env={**kube.env(), "COLUMNS": "200"}) as proc:
        def both(seen):
            return all(any(f" trainer={i}" in s for s in seen) for i in (0, 1))
        seen = read_until(proc, both, 60)
        assert both(seen), "".join(seen)
        rest = interrupt(proc, 30)
    assert proc.returncode == 130 and "Traceback" not in rest, "".join(seen) + rest
    assert not _followers("k8s-stop-"), _followers("k8s-stop-")
    assert _running(_backend_status(spec), "trainer", 1), "the job stopped with its logs' follower"
    res = h.clusterctl(kube, "stop", spec, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    m = re.fullmatch(r"job k8s-stop stopped on 3 host\(s\) \(deleted ConfigMap, Job, Pod, Secret, Service in namespace "
                     r"k8s-it\), (\d+) process\(es\) killed\n", res.stdout)
    assert m and int(m[1]) >= 5, res.stdout  # SIGTERM to each group, SIGKILL to each ignoring one and its setsid child
    assert "still alive" not in res.stderr
    # when Kubernetes started deleting the pods, no process of the job was left in any of them
    sweeps = [s for s in kube.sweeps() if s["pod"].startswith("k8s-stop-")]
    assert len(sweeps) == 3 and not [s for s in sweeps if s["tagged"] != []], [s for s in sweeps if s["tagged"] != []] or sweeps
    assert not [c for c in kube.containers() if "-k8s-stop-" in c]
    assert not list((kube.dir / "ns" / NS / "objects").glob("*/k8s-stop*.json"))
    res = h.clusterctl(kube, "stop", spec)
    assert res.returncode == 0 and res.stdout == "job k8s-stop is not running (no objects in namespace k8s-it)\n", res.stdout


def _until(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout:g}s")
        time.sleep(0.5)


def _followers(pods: str) -> list[str]:
    """The command lines of this machine's `logs -f` processes (kubectl's, docker's) of pods named `pods`*."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            argv = (entry / "cmdline").read_bytes().decode("utf-8", "replace").split("\0")
        except OSError:  # not a process, or gone since
            continue
        if "logs" in argv and "-f" in argv and any(pods in a for a in argv):
            found.append(" ".join(argv).strip())
    return found


def _sweep_script() -> str:
    from fakekube import SWEEP

    return SWEEP


@pytest.mark.timeout(120)
def test_an_image_that_is_not_there_fails_start_in_one_line_and_leaves_nothing(kube, image, tmp_path):
    spec = h.write_spec(tmp_path / "noimage.yaml", name="k8s-noimage", image="clusterctl/no-such-image:1",
                        workspace=JOBS, job={"entrypoint": ["python3", "job.py"], "trainers": 1})
    res = h.clusterctl(kube, "start", spec)
    assert res.returncode == 1, res.stdout + res.stderr
    line = " ".join(res.stderr.split())
    assert re.search(r"start failed: pod k8s-noimage-trainer-[01]-[a-z0-9]{5}: ErrImageNeverPull: image "
                     r'"clusterctl/no-such-image:1" is not present here \(fakekube never pulls\)(; pod [^;]+)*; '
                     r"the job's objects were deleted", line), res.stderr
    assert "Traceback" not in res.stderr
    assert not list((kube.dir / "ns" / NS / "objects").glob("*/k8s-noimage*.json"))
    assert not [c for c in kube.containers() if "-k8s-noimage-" in c]


@pytest.mark.timeout(300)
def test_ctrl_c_on_start_follow_stops_the_job_and_deletes_it(kube, image, tmp_path):
    """Ctrl+C while `start --follow` streams the pods' logs: the same cleanup as over ssh (the job stopped through
    fresh connections, exit 130): every pod's processes ended and every object deleted."""
    spec = h.write_spec(tmp_path / "sigint.yaml", name="k8s-sigint", image=image, workspace=JOBS, job={
        "mode": "collective", "entrypoint": ["python3", "job.py"], "args": ["{role}", "{id}"], "trainers": 2,
        "grace": 2, "env": {"STEPS": "100000"}})
    def stepped(seen):  # both trainers have stepped: their lines are in the followed logs
        return all(any(f"step=3 trainer={i}" in s for s in seen) for i in (0, 1))

    with cli_to_interrupt("start", spec, "--follow", env={**kube.env(), "COLUMNS": "200"}) as proc:
        seen = read_until(proc, stepped, 120)
        assert stepped(seen), "".join(seen)
        rest = interrupt(proc, 90)
    out = "".join(seen) + rest
    assert proc.returncode == 130 and "interrupted: stopping the job" in rest, out
    assert "Traceback" not in out, out
    # when Kubernetes started deleting the pods, no process of the job was left in any of them
    sweeps = [s for s in kube.sweeps() if s["pod"].startswith("k8s-sigint-")]
    left = [s for s in sweeps if s["tagged"] != []]  # a pod per process: 2 hosts x 2
    assert len(sweeps) == 4 and not left, left or sweeps
    assert not [c for c in kube.containers() if "-k8s-sigint-" in c]
    assert not list((kube.dir / "ns" / NS / "objects").glob("*/k8s-sigint*.json"))
    res = h.clusterctl(kube, "stop", spec)
    assert res.returncode == 0 and "job k8s-sigint is not running" in res.stdout, res.stdout


# A trainer that prints a progress line per step (as clusterctl.report writes them) until it is stopped.
PROGRESS = """\
import time
for step in range(1000000):
    print("step=%d loss=%.4f time=%.3f" % (step, 1.0 / (step + 1), time.time()), flush=True)
    time.sleep(0.1)
"""


@pytest.mark.timeout(300)
def test_top_lists_every_pods_process_with_its_steps(kube, image, tmp_path):
    """`clusterctl top` under Kubernetes: every pod's supervisor answers (kubectl exec), with each process's
    resources and the steps its log reports."""
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "job.py").write_text(PROGRESS)
    spec = h.write_spec(tmp_path / "top.yaml", name="k8s-top", image=image, workspace=ws, job={
        "mode": "collective", "entrypoint": ["/opt/venv/bin/python", "job.py"], "trainers": 1, "grace": 2})
    res = h.clusterctl(kube, "start", spec)
    assert res.returncode == 0, res.stdout + res.stderr
    try:
        _wait(kube, spec, lambda s: _running(s, "trainer", 0) and _running(s, "trainer", 1), 120, "trainers running")
        deadline = time.monotonic() + 30
        while True:
            res = h.clusterctl(kube, "top", spec, "--once", "--json", "--no-gpu", timeout=60)
            doc = json.loads(res.stdout) if res.stdout.startswith("{") else {}
            if (doc and all((p["progress"] or {}).get("step", 0) > 0 for p in doc["processes"])
                    or time.monotonic() > deadline):
                break
            time.sleep(1)
        assert res.returncode == 0 and doc["state"] == "running", res.stdout + res.stderr
        assert sorted(p["name"] for p in doc["processes"]) == ["trainer.0", "trainer.1"], doc["processes"]
        assert all(h_["status"] == "ok" and h_["state"] == "running" for h_ in doc["hosts"]), doc["hosts"]
        assert all(p["state"] == "running" and p["progress"]["step"] > 0 and p["progress"]["metrics"]["loss"] > 0
                   and p["rss_bytes"] > 1 << 20 for p in doc["processes"]), doc["processes"]
    finally:
        h.clusterctl(kube, "stop", spec, timeout=120)
