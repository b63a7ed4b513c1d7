"""`backend: kubernetes` without a cluster: the pod's main process (clusterctl/host/pod.py) run here as a pod
would run it, the keys the backend refuses, the status folded from pod objects, the kubectl layer's argv and
errors. The end-to-end runs (pods as Docker containers, a fake kubectl) are tests/integration/test_k8s_backend.py.
"""

from __future__ import annotations

import functools
import json
import os
import shlex
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from clusterctl import backends, k8s
from clusterctl.backends.kubernetes import (LOG_LINE, Kubectl, KubectlError, KubernetesBackend, _own_line,
                                            fold_status, pod_facts)
from clusterctl.errors import SpecError
from clusterctl.host import pod as hostpod
from clusterctl.host.common import InputError
from clusterctl.host.jobfile import load_job
from clusterctl.spec import parse_spec
from helpers import free_port

HOST = Path(hostpod.__file__).resolve().parent
TOKEN = "feedbeef" * 4

SPEC = """\
name: tiny
backend: kubernetes
hosts: [{address: a}]
job: {entrypoint: [python3, t.py], grace: 1}
kubernetes: {image: img}
"""



# ------------------------------------------------------------------------------------- the pod glue


class Pod:
    """One pod of a rendered one-trainer job, played here: the ConfigMap's files in a directory, the template
    pointed at this machine (the state dir, a termination message file, the coordinator on loopback)."""

    def __init__(self, tmp: Path, job: str = "name: tiny\nhosts: [{address: a}]\njob: {entrypoint: [x], grace: 1}\n"
                                              "kubernetes: {image: img}\n"):
        docs = k8s.render(parse_spec(job), token=TOKEN)
        cm = next(d for d in docs if d["kind"] == "ConfigMap")
        self.job = next(d for d in docs if d["kind"] == "Job")
        self.mount = tmp / "opt"
        (self.mount / "clusterctl_host").mkdir(parents=True)
        for name, text in cm["data"].items():
            (self.mount / ("template.json" if name == "template.json" else f"clusterctl_host/{name}")).write_text(text)
        self.template = json.loads(cm["data"]["template.json"])
        self.state = tmp / "state"
        self.termination = tmp / "termination-log"
        self.template.update(state_root=str(self.state / "jobs"), pycache=str(self.state / "pycache"),
                             termination_log=str(self.termination))
        self.template["coordinator"].update(address="127.0.0.1", port=free_port())
        self.template["roles"]["trainer"]["dns"] = "127.0.0.1"
        (self.mount / "template.json").write_text(json.dumps(self.template))
        self.env = k8s.pod_env(self.job, 0, pod_name="tiny-trainer-0-abcde",
                               secrets={("tiny-token", "token"): TOKEN})
        self.env["PATH"] = os.environ.get("PATH", "/usr/bin:/bin")

    def start(self, argv: list[str], **kw) -> subprocess.Popen:
        """The container's command, with this pod's argv: `python3 -S -E ... pod start TEMPLATE -- ARGV`, as PID 1
        of a PID namespace of its own where this machine allows one (as root): like a pod's, its /proc then shows
        only the pod's processes, so it does not wait EXEC_LINGER_S for every other process on the machine."""
        cmd = [sys.executable, "-S", "-E", "-c", hostpod.RUN, str(self.mount), "clusterctl_host.pod", "start",
               str(self.mount / "template.json"), "--", *argv]
        if pid_namespaces():
            cmd = ["unshare", "--pid", "--fork", "--mount-proc", "--kill-child", *cmd]
        return subprocess.Popen(cmd, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                cwd=str(self.mount), **kw)

    @staticmethod
    def main_pid(proc: subprocess.Popen) -> int:
        """The pid (as this machine sees it) of the pod's main process: `unshare`'s child, or the process itself."""
        if not pid_namespaces():
            return proc.pid
        children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children")
        return int(_wait_for(lambda: children.read_text().split(), 30, "the pod's main process")[0])


@functools.cache
def pid_namespaces() -> bool:
    """Whether `unshare` can give a process a PID namespace with its own /proc here (root, util-linux)."""
    try:
        return subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, timeout=30).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def _wait_for(cond, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while True:
        got = cond()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not within {timeout:g}s")
        time.sleep(0.05)


def test_the_pods_main_process_runs_the_supervisor_and_keeps_the_token_from_the_process(tmp_path):
    pod = Pod(tmp_path)
    code = ("import os, time; time.sleep(1); print('hello from', os.environ['PADDLE_CURRENT_ENDPOINT']); "
            "print(sorted(k for k in os.environ if 'TOKEN' in k or 'SECRET' in k or k == 'CLUSTERCTL_JOB'))")
    proc = pod.start([sys.executable, "-c", code])
    main = pod.main_pid(proc)
    # stage two replaced stage one (same pid): its environment holds neither the token nor the contract
    _wait_for(lambda: b"clusterctl_host.pod\0init" in Path(f"/proc/{main}/cmdline").read_bytes(), 30, "stage two")
    environ = Path(f"/proc/{main}/environ").read_bytes().split(b"\0")
    assert not [e for e in environ if TOKEN.encode() in e or e.startswith((b"CLUSTERCTL_", b"PADDLE_", b"RANK="))], environ
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    lines = out.splitlines()
    assert "[tiny-trainer-0-abcde trainer.0] hello from tiny-trainer-0.tiny:6180" in lines, out
    assert "[tiny-trainer-0-abcde trainer.0] ['CLUSTERCTL_JOB', 'CLUSTERCTL_JOB_TOKEN']" in lines, out
    assert TOKEN not in out + err
    jobdir = pod.state / "jobs" / "tiny"
    assert stat.S_IMODE(jobdir.stat().st_mode) == 0o700 and stat.S_IMODE((jobdir / "job.json").stat().st_mode) == 0o600
    job = load_job(str(jobdir / "job.json"))
    assert (job["token"], job["host"], job["coordinator"]["is_coordinator"]) == (TOKEN, "tiny-trainer-0-abcde", True)
    msg = json.loads(pod.termination.read_text())
    assert (msg["state"], msg["reason"], msg["attempt"]) == ("succeeded", "all 1 trainers exited 0", 0)
    assert [(p["role"], p["id"], p["state"], p["exit_code"]) for p in msg["processes"]] == [("trainer", 0, "exited", 0)]


@pytest.mark.skipif(not pid_namespaces(), reason="needs `unshare --pid --mount-proc` (root)")
def test_the_pods_main_process_waits_for_a_kubectl_exec_command_and_for_nothing_else(tmp_path):
    """When the job ends, PID 1 stays while a `kubectl exec` command (a process that joined the pod's namespaces,
    not PID 1's child) still runs: the kernel kills every process of the namespace when PID 1 exits."""
    pod, joined = Pod(tmp_path), tmp_path / "exec-joined"
    # the job ends once the exec command is in the pod, so PID 1 cannot miss it however slow this machine is
    wait = f"import os, time\nwhile not os.path.exists({str(joined)!r}): time.sleep(0.02)"
    proc = pod.start([sys.executable, "-c", wait])
    main = pod.main_pid(proc)
    nspid = next(line for line in Path(f"/proc/{main}/status").read_text().splitlines() if line.startswith("NSpid:"))
    assert nspid.split()[-1] == "1", nspid  # PID 1 of its namespace, as in a pod
    exec_cmd = subprocess.Popen(["nsenter", "-t", str(main), "-p", "-m", "--",
                                 "sh", "-c", f"touch {shlex.quote(str(joined))}; sleep 3; echo done"],
                                stdout=subprocess.PIPE, text=True)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    # PID 1 ended after the exec command did, which was not killed with the namespace
    assert exec_cmd.poll() is not None and exec_cmd.stdout.read() == "done\n" and exec_cmd.returncode == 0
    # and with nothing left in the pod, the next one ends as soon as its job did
    pod = Pod(tmp_path / "again")
    t0 = time.monotonic()
    proc = pod.start([sys.executable, "-c", "pass"])
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert time.monotonic() - t0 < hostpod.EXEC_LINGER_S / 2, "PID 1 waited with nothing left to wait for"


def test_sigterm_to_the_pod_stops_the_job_through_its_supervisor(tmp_path):
    """What the kubelet does to a deleted pod: SIGTERM to PID 1, which the supervisor turns into a stop."""
    pod = Pod(tmp_path)
    proc = pod.start([sys.executable, "-c", "import time; print('up', flush=True); time.sleep(600)"])
    state = pod.state / "jobs" / "tiny" / "state.json"
    def said_up():
        procs = json.loads(state.read_text())["processes"] if state.exists() else []
        return bool(procs) and procs[0]["state"] == "running" and Path(procs[0]["log"]).exists() and \
            "up" in Path(procs[0]["log"]).read_text().split()

    _wait_for(said_up, 30, "the process running and its line in its log")
    t0 = time.monotonic()
    os.kill(pod.main_pid(proc), signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 1, err
    assert time.monotonic() - t0 < 15  # grace 1s + the supervisor's stop
    msg = json.loads(pod.termination.read_text())
    assert msg["state"] == "stopped" and msg["reason"].startswith("stop requested on tiny-trainer-0-abcde"), msg
    assert [(p["state"], p["exit_code"]) for p in msg["processes"]] == [("stopped", -15)]
    assert "[tiny-trainer-0-abcde trainer.0] up" in out.splitlines()


@pytest.mark.skipif(not pid_namespaces(), reason="needs `unshare --pid --mount-proc` (root)")
def test_a_pod_stopped_through_the_coordinator_waits_for_the_agent_stop_that_reports_its_kills(tmp_path):
    """`clusterctl stop` runs `agent stop` in every pod at once; the first to land stops the job everywhere through
    the coordinator, so another pod's supervisor may end before that pod's exec arrives. PID 1 stays until an
    `agent stop` has collected what the stop killed there (else the exec finds no container, and the report lacks
    those kills: 1 run in 5 of test_k8s_pods' stop test under load), and then ends at once."""
    pod = Pod(tmp_path)
    proc = pod.start([sys.executable, "-c", "import time; print('up', flush=True); time.sleep(600)"])
    main = pod.main_pid(proc)
    jobdir = pod.state / "jobs" / "tiny"
    state = jobdir / "state.json"

    def running():
        procs = json.loads(state.read_text())["processes"] if state.exists() else []
        return bool(procs) and procs[0]["state"] == "running" and json.loads(state.read_text())

    sup = _wait_for(running, 30, "the process running")["supervisor"]["pid"]

    def in_pod(*argv: str) -> subprocess.CompletedProcess:
        return subprocess.run(["nsenter", "-t", str(main), "-p", "-m", "--", *argv], capture_output=True, text=True,
                              timeout=60)

    # a stop that is not the pod's own SIGTERM nor this pod's `agent stop`: the supervisor alone is told (its pid
    # as the pod's namespace numbers it), as the coordinator's broadcast tells it
    assert in_pod("kill", "-TERM", str(sup)).returncode == 0
    _wait_for(lambda: json.loads(state.read_text()).get("state") == "stopped", 30, "the job stopped")
    _wait_for(lambda: pod.termination.exists(), 30, "the termination message")  # the supervisor has exited
    time.sleep(2)
    assert proc.poll() is None, "PID 1 ended before the stop's report was collected"
    stop = in_pod(sys.executable, "-S", "-E", "-c", hostpod.RUN, str(pod.mount), "clusterctl_host.agent", "stop",
                  str(jobdir))
    assert stop.returncode == 0, stop.stderr
    reply = json.loads(stop.stdout.splitlines()[-1])
    assert reply["was_running"] and reply["state"] == "stopped" and reply["left"] == [], reply
    assert [(k["role"], k["signal"]) for k in reply["killed"]] == [("trainer", "SIGTERM")], reply
    t0 = time.monotonic()
    out, err = proc.communicate(timeout=60)
    assert time.monotonic() - t0 < 5, "PID 1 waited on after the report was collected"
    assert proc.returncode == 1 and json.loads(pod.termination.read_text())["state"] == "stopped", err


# ~22 s a pod where this test's "pod" sees every process on the machine (no PID namespace): PID 1 lingers for them
@(pytest.mark.slow if not pid_namespaces() else lambda test: test)
def test_a_job_that_ends_before_the_log_follower_starts_still_has_its_lines_on_the_pods_stdout(tmp_path):
    """`kubectl logs` is the pod's stdout: a process that prints and exits at once may end the job before PID 1
    started its follower (4 of 10 such pods lost their line before the fix); PID 1 then prints the logs once."""
    for i in range(5):
        pod = Pod(tmp_path / str(i))
        proc = pod.start([sys.executable, "-c", "print('hi', flush=True)"])
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
        assert "[tiny-trainer-0-abcde trainer.0] hi" in out.splitlines(), (i, out, err)


@pytest.mark.parametrize("change,message", [
    (lambda e: e.pop("CLUSTERCTL_ROLE"), "CLUSTERCTL_ROLE=None is not a role of this job (trainer)"),
    (lambda e: e.update(PADDLE_TRAINER_ID="1"), "PADDLE_TRAINER_ID='1' is not a completion index below 1"),
    (lambda e: e.update(PADDLE_TRAINER_ID="x"), "PADDLE_TRAINER_ID='x' is not a completion index below 1"),
    (lambda e: e.pop(hostpod.POD_NAME_ENV), "CLUSTERCTL_POD_NAME is not set (the pod's name, from the downward API)"),
    (lambda e: e.pop(hostpod.SECRET_ENV), "CLUSTERCTL_POD_SECRET is not set: the job's token comes from its Secret"),
])
def test_a_pod_without_what_it_needs_says_so_in_one_line(tmp_path, change, message):
    pod = Pod(tmp_path)
    change(pod.env)
    with pytest.raises(InputError) as info:
        hostpod.pod_job(pod.template, pod.env, ["x"], "/")
    assert str(info.value) == message
    # the same, run as the pod's main process: one line on stderr, in the termination message, exit 2
    proc = pod.start(["true"])
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 2 and err.strip().endswith("clusterctl pod: " + message), err


def test_a_template_of_another_version_is_refused(tmp_path):
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"version": 99}))
    with pytest.raises(InputError, match="expected version 1 .the controller's clusterctl and this package differ"):
        hostpod.load_template(str(path))
    path.write_text("{not json")
    with pytest.raises(InputError, match="is not valid JSON"):
        hostpod.load_template(str(path))


def test_stage_two_runs_without_the_token_and_the_contract():
    template = {"env": ["RANK", "PADDLE_TRAINER_ID"]}
    env = {"PATH": "/bin", "HOME": "/root", "RANK": "1", "PADDLE_TRAINER_ID": "1", hostpod.SECRET_ENV: TOKEN,
           hostpod.POD_NAME_ENV: "p", "CLUSTERCTL_JOB": "j", "KUBERNETES_SERVICE_HOST": "10.0.0.1"}
    assert hostpod.clean_environ(template, env) == {"PATH": "/bin", "HOME": "/root", "KUBERNETES_SERVICE_HOST": "10.0.0.1"}
    assert hostpod.process_env(template, env) == {"RANK": "1", "PADDLE_TRAINER_ID": "1"}


def test_the_termination_message_fits_what_kubernetes_keeps():
    attempts = [{"attempt": i, "outcome": "failed", "reason": "x" * 5000, "started_at": i, "ended_at": i + 1}
                for i in range(200)]
    status = {"state": "failed", "reason": "r" * 5000, "attempt": 199, "restarts": 200, "attempts": attempts,
              "processes": [{"role": "trainer", "id": 0, "pid": 7, "state": "failed", "exit_code": 3,
                             "uptime_s": 1.5, "error": "e" * 9000, "log": "/x"}]}
    text = hostpod.termination_message(status)
    assert len(text.encode()) <= hostpod.TERMINATION_LIMIT
    msg = json.loads(text)
    assert (msg["state"], msg["attempt"], msg["restarts"], msg["v"]) == ("failed", 199, 200, 1)
    assert msg["attempts"][-1]["attempt"] == 199 and len(msg["attempts"]) < 200  # the latest kept, the oldest cut
    assert msg["processes"][0]["exit_code"] == 3 and "log" not in msg["processes"][0]


# ------------------------------------------------------------------------------------- spec checks


@pytest.mark.parametrize("extra,where,message", [
    ("ssh: {user: u}\n", (6, 1, "ssh"), "pods are reached through kubectl, not ssh"),
    ("workspace: {local: .}\n", (6, 1, "workspace"), "the code comes from kubernetes.image or kubernetes.workspace"),
    ("data: {local: d}\n", (6, 1, "data"), "data: is not dealt under Kubernetes"),
    ("provision: {apt: {packages: [git]}}\n", (6, 1, "provision"), "pods run an image: put what the job needs in kubernetes.image"),
])
def test_keys_kubernetes_cannot_honour_are_refused_at_their_line(extra, where, message):
    with pytest.raises(SpecError) as info:
        parse_spec(SPEC + extra, "k.yaml", check=backends.problems)
    (p,) = info.value.problems
    assert (p.line, p.column, p.path) == where, str(p)
    assert p.message.startswith(f"not supported with backend: kubernetes: {message}"), p.message


@pytest.mark.parametrize("old,new,where,message", [
    ("hosts: [{address: a}]", "hosts: [{address: a, port: 2222}]", "hosts[0].port", "hosts only give the job's shape"),
    ("job: {", "job: {log_dir: x, ", "job.log_dir", "the logs are in the pods"),
    ("job: {", "job: {launcher: mpi, ", "job.launcher", "launcher: mpi is not supported under Kubernetes"),
    ("job: {", "job: {mode: pserver, pservers: [a], ", "job.pservers", "pservers are pods under Kubernetes"),
    ("kubernetes: {image: img}\n", "", "backend", "backend: kubernetes needs a kubernetes: section"),
    ("kubernetes: {image: img}", "kubernetes: {image: img, python: -c}", "kubernetes.python", "expected one word"),
])
def test_the_backends_own_rules(old, new, where, message):
    with pytest.raises(SpecError) as info:
        parse_spec(SPEC.replace(old, new), "k.yaml", check=backends.problems)
    assert any(p.path == where and message in p.message for p in info.value.problems), [str(p) for p in info.value.problems]


def test_a_spec_it_can_run_passes_and_dispatch_says_where_the_code_is():
    spec = parse_spec(SPEC, "k.yaml", check=backends.problems)
    said = []
    with backends.open_backend(spec) as backend:
        assert isinstance(backend, KubernetesBackend)
        assert backend.dispatch(on_progress=said.append) == []
    assert said == ["nothing to dispatch with backend: kubernetes: the pods run the code in the image img"]


def test_the_dispatch_command_prints_no_empty_host_table(tmp_path):
    # an empty `dispatch` table of SSH hosts the pods never use followed the line that says nothing is shipped
    import subprocess
    import sys

    (tmp_path / "k.yaml").write_text(SPEC)
    res = subprocess.run([sys.executable, "-m", "clusterctl.cli", "dispatch", str(tmp_path / "k.yaml")],
                         capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=60,
                         env={**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")})
    assert res.returncode == 0 and res.stdout == "", res
    assert "nothing to dispatch with backend: kubernetes" in res.stderr, res.stderr


def test_start_notes_are_the_manifests_not_the_ssh_plans():
    """4,800 trainers: their SSH endpoints (`10.0.I.1:6180+L`) fit one environment string, their pods' names do
    not; `start` prints what the backend will leave out (commands/lifecycle.py), so the backend answers it."""
    hosts = "".join(f"  - {{address: 10.{i >> 8}.{i & 255}.1, gpus: 8}}\n" for i in range(600))
    spec = parse_spec(SPEC.replace("hosts: [{address: a}]\n", "hosts:\n" + hosts)
                      .replace("job: {", "job: {trainers: gpu, "), "k.yaml", check=backends.problems)
    with backends.open_backend(spec) as backend:
        assert backend.plan.notes == () and "PADDLE_TRAINER_ENDPOINTS" in backend.plan.trainers[0].env
        assert backend.notes() == k8s.notes(spec, 4800) and len(backend.notes()) == 1
        assert backend.notes()[0].startswith("PADDLE_TRAINER_ENDPOINTS is left out of every process's environment: "
                                             "its 4800 endpoints take 133289 bytes")


# ------------------------------------------------------------------------------------------ status


def _pod(role, i, *, state=None, init=None, phase="Running", deleting=False, conditions=None, message=None):
    status = {"phase": phase}
    if state is not None:
        if "terminated" in state and message is not None:
            state["terminated"]["message"] = message
        status["containerStatuses"] = [{"name": role, "state": state}]
    if init is not None:
        status["initContainerStatuses"] = [{"name": "wait", "state": init}]
    if conditions is not None:
        status["conditions"] = conditions
    meta = {"name": f"j-{role}-{i}-abcde", "labels": {"clusterctl.io/role": role},
            "annotations": {k8s.INDEX_ANNOTATION: str(i)}, "creationTimestamp": "2026-01-01T00:00:00Z"}
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:01:00Z"
    return {"kind": "Pod", "metadata": meta, "status": status}


def _reply(state, procs, **kw):
    return {"ok": True, "state": state, "reason": kw.pop("reason", None), "attempt": kw.pop("attempt", 0),
            "restarts": kw.pop("restarts", 0), "attempts": kw.pop("attempts", []),
            "processes": [dict(role=r, id=i, pid=p, state=s, exit_code=c, uptime_s=1.0, error=None)
                          for r, i, p, s, c in procs], **kw}


RUNNING = {"running": {"startedAt": "x"}}
# the job's Jobs, running (no condition): a process without a pod has none yet
JOBS = [{"kind": "Job", "metadata": {"name": f"j-{r}", "labels": {k8s.LABEL_JOB: "j", k8s.LABEL_ROLE: r}},
         "status": {"active": 1}} for r in ("pserver", "trainer")]


def test_no_objects_is_not_running():
    st = fold_status("j", {"trainer": 2}, [], [], {})
    assert (st.state, st.processes, st.backend) == ("not running", [], "kubernetes")


def test_pods_waiting_to_start_are_pending_and_an_image_error_is_the_reason():
    pods = [_pod("trainer", 0, phase="Pending", state={"waiting": {"reason": "ContainerCreating"}}),
            _pod("trainer", 1, phase="Pending", init={"waiting": {"reason": "ErrImagePull", "message": "no such image"}})]
    st = fold_status("j", {"trainer": 3}, JOBS, pods, {})
    assert st.state == "starting"  # no pod runs yet: not "running"
    assert [(p.host, p.state, p.error) for p in st.processes] == [
        ("j-trainer-0-abcde", "pending", None), ("j-trainer-1-abcde", "pending", "ErrImagePull: no such image"),
        ("-", "pending", "no pod yet")]
    assert st.reason == "j-trainer-1-abcde: ErrImagePull: no such image"


def test_running_pods_are_their_supervisors_replies():
    pods = [_pod("pserver", 0, state=RUNNING), _pod("trainer", 0, state=RUNNING), _pod("trainer", 1, state=RUNNING)]
    replies = {
        "j-pserver-0-abcde": (_reply("running", [("pserver", 0, 7, "running", None)]), None),
        "j-trainer-0-abcde": (_reply("restarting", [("trainer", 0, 8, "stopped", -15)], attempt=1, restarts=2,
                                     attempts=[{"attempt": 0, "outcome": "failed", "reason": "trainer.1 on x exited with "
                                                "code 3", "started_at": 1, "ended_at": 2}]), None),
        "j-trainer-1-abcde": (None, "kubectl exec j-trainer-1-abcde -c trainer: error: connection refused"),
    }
    st = fold_status("j", {"pserver": 1, "trainer": 2}, JOBS, pods, replies)
    assert st.state == "lost"  # a pod that does not answer while it runs: as an unreachable host over SSH
    assert st.unreachable == {"j-trainer-1-abcde": "kubectl exec j-trainer-1-abcde -c trainer: error: connection refused"}
    assert (st.attempt, st.restarts, st.attempts[0]["outcome"]) == (1, 2, "failed")
    assert [(p.role, p.id, p.pid, p.state) for p in st.processes] == [
        ("pserver", 0, 7, "running"), ("trainer", 0, 8, "stopped"), ("trainer", 1, None, "running")]
    replies["j-trainer-1-abcde"] = ({"ok": False, "state": "unknown", "error": "no job state"}, None)
    assert fold_status("j", {"pserver": 1, "trainer": 2}, JOBS, pods, replies).state == "running"


def test_running_pods_progress_and_their_straggler_are_in_the_status():
    # the pods' `agent top --progress-only` replies: each process's step and rate, and the straggler rule over them
    # (a Kubernetes `status` showed neither, where an SSH one shows both)
    def progress(step, rate):
        return {"step": step, "rate": rate, "done": False, "metrics": {"loss": 0.5}, "age_s": 0.1,
                "slices": [[float(100 + 10 * k), rate] for k in range(6)]}

    pods = [_pod("trainer", i, state=RUNNING) for i in range(3)]
    replies = {}
    for i, rate in enumerate((5.0, 5.0, 2.0)):
        reply = _reply("running", [("trainer", i, 10 + i, "running", None)])
        reply["processes"][0]["progress"] = progress(100 * (i + 1), rate)
        replies[f"j-trainer-{i}-abcde"] = (reply, None)
    st = fold_status("j", {"trainer": 3}, JOBS[1:], pods, replies)
    assert [(p.id, p.progress["step"], p.progress["rate"]) for p in st.processes] == [(0, 100, 5.0), (1, 200, 5.0),
                                                                                       (2, 300, 2.0)]
    assert all("slices" not in p.progress for p in st.processes)  # the rule's input only
    assert st.stragglers == [{"host": "j-trainer-2-abcde", "process": "trainer.2", "rate": 2.0, "median": 5.0,
                              "ratio": 0.4}]


def test_the_status_asks_each_running_pod_for_its_progress_too(monkeypatch):
    from clusterctl.backends.kubernetes import KubernetesBackend

    asked = []
    backend = object.__new__(KubernetesBackend)
    monkeypatch.setattr(KubernetesBackend, "_snapshot", lambda self: (JOBS[1:], [_pod("trainer", 0, state=RUNNING)]))
    monkeypatch.setattr(KubernetesBackend, "_ask", lambda self, pods, argv, timeout: asked.append(argv) or {})
    monkeypatch.setattr(KubernetesBackend, "_agent", lambda self, *args: ["agent", *args])
    monkeypatch.setattr(KubernetesBackend, "_jobdir", lambda self: "/jobdir")
    monkeypatch.setattr(KubernetesBackend, "_expected", lambda self: {"trainer": 1})
    backend.plan = type("P", (), {"job": "j"})()
    backend.status()
    assert asked == [["agent", "top", "/jobdir", "--progress-only"]]


def test_pods_that_ended_are_their_termination_messages():
    def msg(state, reason, procs):
        return hostpod.termination_message(_reply(state, procs, reason=reason))

    why = "trainer.1 on j-trainer-1-abcde exited with code 3"
    pods = [_pod("pserver", 0, phase="Failed", state={"terminated": {"exitCode": 1}},
                 message=msg("failed", why, [("pserver", 0, 5, "stopped", -15)])),
            _pod("trainer", 0, phase="Failed", state={"terminated": {"exitCode": 1}},
                 message=msg("failed", why, [("trainer", 0, 6, "stopped", -15)])),
            _pod("trainer", 1, phase="Failed", state={"terminated": {"exitCode": 1}},
                 message=msg("failed", why, [("trainer", 1, 6, "failed", 3)]))]
    st = fold_status("j", {"pserver": 1, "trainer": 2}, JOBS, pods, {})
    assert st.state == "failed" and st.reason == f"j-trainer-0-abcde: {why}"  # the coordinator's, once
    assert [(p.role, p.id, p.state, p.exit_code) for p in st.processes] == [
        ("pserver", 0, "stopped", -15), ("trainer", 0, "stopped", -15), ("trainer", 1, "failed", 3)]
    # no message (a container killed before it wrote one): the exit code says what it can
    pods = [_pod("trainer", 0, phase="Succeeded", state={"terminated": {"exitCode": 0, "reason": "Completed"}}),
            _pod("trainer", 1, phase="Failed", state={"terminated": {"exitCode": 137, "reason": "OOMKilled"}})]
    st = fold_status("j", {"trainer": 2}, JOBS, pods, {})
    assert st.state == "failed" and st.reason == "j-trainer-1-abcde: pod j-trainer-1-abcde exited 137 (OOMKilled)"
    assert [(p.state, p.error) for p in st.processes] == [
        ("exited", None), ("failed", "pod j-trainer-1-abcde exited 137 (OOMKilled)")]


def test_pod_facts_read_init_failures_evictions_and_scheduling():
    f = pod_facts(_pod("trainer", 2, phase="Failed", init={"terminated": {"exitCode": 1, "message": "gave up"}}))
    assert (f.phase, f.exit_code, f.waiting) == ("ended", 1, "init container wait exited 1: gave up")
    f = pod_facts(_pod("trainer", 0, phase="Failed") | {"status": {"phase": "Failed", "reason": "Evicted",
                                                                     "message": "low on memory"}})
    assert (f.phase, f.waiting) == ("ended", "Evicted: low on memory")
    f = pod_facts(_pod("trainer", 0, phase="Pending", conditions=[
        {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": "0/3 nodes"}]))
    assert (f.phase, f.waiting, f.message) == ("waiting", "Unschedulable", "Unschedulable: 0/3 nodes")
    assert pod_facts(_pod("trainer", 0, state=RUNNING, deleting=True)).phase == "deleting"
    assert pod_facts(_pod("trainer", 0, phase="Pending", deleting=True)).phase == "deleting"
    assert pod_facts({"kind": "Pod", "metadata": {"name": "other"}}) is None


def test_only_the_pods_own_process_lines_are_its_logs():
    f = pod_facts(_pod("trainer", 1, state=RUNNING))
    assert _own_line("[j-trainer-1-abcde trainer.1] step=3", f)
    assert _own_line("[j-trainer-1-abcde trainer.1#2] attempt=2", f)
    assert not _own_line("2026-01-01T00:00:00.000Z supervisor 1 for job j", f)  # the supervisor's own log
    assert not _own_line("[j-trainer-0-abcde trainer.0] step=3", f)
    assert LOG_LINE.match("[j-pserver-0-abcde pserver.0] x")["role"] == "pserver"


# ------------------------------------------------------------------------------------------ kubectl


@pytest.fixture
def fake_kubectl(tmp_path):
    """A kubectl that records its argv and answers as the test says (KUBECTL_ANSWER: rc|stdout|stderr|sleep)."""
    path = tmp_path / "kubectl"
    path.write_text(f"#!{sys.executable}\n"
                    "import json, os, sys, time\n"
                    "open(os.environ['KUBECTL_LOG'], 'a').write(json.dumps(sys.argv[1:]) + '\\n')\n"
                    "rc, out, err, nap = os.environ['KUBECTL_ANSWER'].split('|')\n"
                    "time.sleep(float(nap)); sys.stdout.write(out); sys.stderr.write(err); sys.exit(int(rc))\n")
    path.chmod(0o755)
    log = tmp_path / "argv.jsonl"

    def answer(rc=0, out="", err="", nap=0.0):
        os.environ["KUBECTL_ANSWER"] = f"{rc}|{out}|{err}|{nap}"
        return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []

    os.environ["KUBECTL_LOG"] = str(log)
    yield str(path), answer
    os.environ.pop("KUBECTL_ANSWER", None)
    os.environ.pop("KUBECTL_LOG", None)


def test_kubectl_runs_argv_lists_in_the_namespace_and_context(fake_kubectl):
    binary, answer = fake_kubectl
    kc = Kubectl("ml", "prod", binary)
    answer(out=json.dumps({"items": [{"kind": "Pod"}]}))
    assert kc.get("jobs,pods", "clusterctl.io/job=x") == [{"kind": "Pod"}]
    answer()
    kc.exec("x-trainer-0-abcde", "trainer", ["python3", "-c", "print(1)"])
    kc.delete("jobs,services", "clusterctl.io/job=x", timeout=70)
    assert answer() == [
        ["--context", "prod", "--namespace", "ml", "get", "jobs,pods", "-l", "clusterctl.io/job=x", "-o", "json"],
        ["--context", "prod", "--namespace", "ml", "exec", "x-trainer-0-abcde", "-c", "trainer", "--", "python3", "-c",
         "print(1)"],
        ["--context", "prod", "--namespace", "ml", "delete", "jobs,services", "-l", "clusterctl.io/job=x",
         "--cascade=foreground", "--wait=true", "--ignore-not-found=true", "--timeout=70s"],
    ]


def test_kubectl_errors_are_one_line_naming_the_objects(fake_kubectl, tmp_path):
    binary, answer = fake_kubectl
    kc = Kubectl("ml", None, binary)
    answer(rc=1, err="W0101 some warning\nError from server (Forbidden): jobs.batch is forbidden: User cannot list\n")
    with pytest.raises(KubectlError) as info:
        kc.get("jobs,pods", "clusterctl.io/job=x")
    assert str(info.value) == ("kubectl get jobs,pods -l clusterctl.io/job=x: Error from server (Forbidden): jobs.batch "
                               "is forbidden: User cannot list")
    answer(rc=1, err="Error from server (AlreadyExists): secrets \"x-token\" already exists\n")
    with pytest.raises(KubectlError, match=r'^kubectl create Secret/x-token, Job/x-trainer: Error from server '
                                           r'\(AlreadyExists\): secrets "x-token" already exists$'):
        kc.create([{"kind": "Secret", "metadata": {"name": "x-token"}}, {"kind": "Job", "metadata": {"name": "x-trainer"}}])
    answer(out="not json")
    with pytest.raises(KubectlError, match="^kubectl get pods -l a=b: not JSON"):
        kc.get("pods", "a=b")
    with pytest.raises(KubectlError, match="^kubectl get pods -l a=b: /nonexistent/kubectl not found on PATH"):
        Kubectl("ml", None, "/nonexistent/kubectl").get("pods", "a=b")


def test_kubectl_create_sends_the_objects_on_stdin_not_argv(fake_kubectl, tmp_path):
    binary, answer = fake_kubectl
    stdin_copy = tmp_path / "stdin"
    script = Path(binary).read_text().replace("time.sleep(float(nap))",
                                              f"time.sleep(float(nap)); open({str(stdin_copy)!r}, 'w').write(sys.stdin.read())")
    Path(binary).write_text(script)
    answer(out="secret/x-token created\n")
    docs = k8s.render(parse_spec(SPEC), token=TOKEN)
    Kubectl("default", None, binary).create(docs)
    (argv,) = answer()
    assert argv == ["--namespace", "default", "create", "-f", "-"]
    assert json.loads(stdin_copy.read_text()) == {"apiVersion": "v1", "kind": "List", "items": json.loads(json.dumps(docs))}


def test_a_kubectl_that_hangs_is_cut_at_its_deadline(fake_kubectl):
    binary, answer = fake_kubectl
    answer(nap=30)
    t0 = time.monotonic()
    with pytest.raises(KubectlError, match=r"^kubectl exec p -c trainer: kubectl did not answer within 1s$"):
        Kubectl("ml", None, binary).exec("p", "trainer", ["true"], timeout=1)
    assert time.monotonic() - t0 < 10


def test_the_host_package_travels_whole():
    """Every module of clusterctl/host is in the ConfigMap (a new supervisor module travels without a change here)."""
    assert set(k8s.host_package()) == {p.name for p in HOST.glob("*.py")}
    assert shutil.which  # the package is stdlib-only; test_host_package.py checks the imports


def test_a_pod_that_floods_kubectl_exec_is_kept_to_its_tail(fake_kubectl):
    # what a pod prints through `kubectl exec` is the pod's to choose: 40 MiB, then its reply; only the last
    # REPLY_LIMIT bytes of it are held (the reply at the end is still read), never all of it
    binary, answer = fake_kubectl
    script = Path(binary).read_text().replace(
        "sys.stdout.write(out)",
        "[(sys.stdout.buffer.write(b'y' * (1 << 20)), sys.stderr.buffer.write(b'e' * (1 << 19))) for _ in range(40)]; "
        "sys.stdout.flush(); sys.stdout.write(out)")
    Path(binary).write_text(script)
    answer(out='\n{"ok": true, "state": "running"}\n')
    res = Kubectl("ml", None, binary).exec("p", "trainer", ["agent", "status"])
    limit = backends.kubernetes.REPLY_LIMIT
    assert len(res.stdout) == limit and res.stdout.endswith(b'{"ok": true, "state": "running"}\n')
    assert len(res.stderr) == limit and res.returncode == 0
    assert backends.kubernetes._parse_reply(res.stdout) == {"ok": True, "state": "running"}
