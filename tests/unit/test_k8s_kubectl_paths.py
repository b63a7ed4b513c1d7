"""`backend: kubernetes`'s operations against a scripted kubectl (tests/unit/fakekubectl.py): what start, status,
logs, stop and top send to kubectl, and what they make of its answers (the pods' states, the supervisors' replies,
kubectl's errors). No pod runs here: the supervisors' replies are the test's; tests/integration/test_k8s_pods.py
runs real supervisors in pods played by Docker.
"""

from __future__ import annotations

import base64
import json
import os
import threading
import time

import pytest

import fakekubectl
from clusterctl import backends, k8s
from clusterctl.backends import kubernetes
from clusterctl.backends.base import StopReport
from clusterctl.errors import JobError
from clusterctl.host import pod as hostpod
from clusterctl.ops.top import TopRequest
from clusterctl.spec import parse_spec

SPEC = """\
name: fit
backend: kubernetes
hosts: [{address: a}, {address: b}]
job: {mode: pserver, pservers: 1, trainers: 1, entrypoint: [python3, train.py], grace: 3}
kubernetes: {image: img, namespace: ml, context: prod}
"""
SEL = f"{k8s.LABEL_JOB}=fit"
HEAD = ["--context", "prod", "--namespace", "ml"]
GET = [*HEAD, "get", "jobs,pods", "-l", SEL, "-o", "json"]
GET_ALL = [*HEAD, "get", "jobs,pods,services,configmaps,secrets", "-l", SEL, "-o", "json"]
# grace 3 + k8s.STOP_MARGIN_S + 60
DELETE = [*HEAD, "delete", "jobs,services,configmaps,secrets", "-l", SEL, "--cascade=foreground", "--wait=true",
          "--ignore-not-found=true", "--timeout=73s"]
CREATE = [*HEAD, "create", "-f", "-"]
P0, T0, T1 = "fit-pserver-0-abcde", "fit-trainer-0-abcde", "fit-trainer-1-abcde"
RUNNING = {"running": {"startedAt": "2026-01-01T00:00:05Z"}}
CREATING = {"waiting": {"reason": "ContainerCreating"}}
NOT_FOUND = 'Error from server (NotFound): pods "{}" not found'


@pytest.fixture
def kube(tmp_path, monkeypatch):
    """The scripted kubectl first on PATH; the backend's polls without a pause (each look is a kubectl call)."""
    fake = fakekubectl.install(tmp_path / "bin", tmp_path / "kube")
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setattr(kubernetes, "START_POLL_S", 0)
    monkeypatch.setattr(kubernetes, "FOLLOW_POLL_S", 0.01)
    return fake


def backend(text: str = SPEC):
    return backends.open_backend(parse_spec(text, "k.yaml", check=backends.problems))


def agent(*args: str) -> list[str]:
    return k8s.host_tool_argv(parse_spec(SPEC), "agent", list(args))


def pod(role: str, i: int, state: dict | None = None, *, phase: str = "Running", deleting: bool = False,
        at: str = "2026-01-01T00:00:00Z") -> dict:
    """A pod of job fit as `kubectl get pods -o json` shows it (`state`: its main container's)."""
    meta = {"name": f"fit-{role}-{i}-abcde", "creationTimestamp": at,
            "labels": {k8s.LABEL_JOB: "fit", k8s.LABEL_ROLE: role}, "annotations": {k8s.INDEX_ANNOTATION: str(i)}}
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:09:00Z"
    status = {"phase": phase}
    if state is not None:
        status["containerStatuses"] = [{"name": role, "state": state}]
    return {"kind": "Pod", "metadata": meta, "status": status}


def obj(kind: str, name: str) -> dict:
    return {"kind": kind, "metadata": {"name": name, "labels": {k8s.LABEL_JOB: "fit"}}}


def reply(state: str, procs, **kw) -> dict:
    """An `agent status` reply (clusterctl/host/agent.py's shape)."""
    return {"ok": True, "state": state, "reason": kw.pop("reason", None), "attempt": kw.pop("attempt", 0),
            "restarts": kw.pop("restarts", 0), "attempts": kw.pop("attempts", []),
            "processes": [dict(role=r, id=i, pid=p, state=s, exit_code=c, uptime_s=1.0, error=None)
                          for r, i, p, s, c in procs], **kw}


def answer(data: dict, rc: int = 0) -> dict:
    """What kubectl exec prints of an agent's reply: the supervisor's log line first, then the JSON."""
    return {"out": "2026-01-01T00:00:00Z agent: asked\n" + json.dumps(data) + "\n", "rc": rc}


def ended(role: str, i: int, status: dict, code: int = 0) -> dict:
    """A pod whose supervisor ended and left its last status as the termination message."""
    return pod(role, i, {"terminated": {"exitCode": code, "message": hostpod.termination_message(status)}},
               phase="Succeeded" if code == 0 else "Failed")


# ------------------------------------------------------------------------------------------- start


def all_running() -> dict:
    """Each pod's supervisor answering `status`: every process running (a new dict per test)."""
    return {P0: {"status": answer(reply("running", [("pserver", 0, 7, "running", None)]))},
            T0: {"status": answer(reply("running", [("trainer", 0, 8, "running", None)]))},
            T1: {"status": answer(reply("running", [("trainer", 1, 9, "running", None)]))}}

def test_start_replaces_the_previous_run_creates_the_objects_and_waits_for_every_pod(kube):
    done = reply("succeeded", [("trainer", 0, 5, "exited", 0)], reason="all 2 trainers exited 0")
    old = [ended("pserver", 0, done), ended("trainer", 0, done), ended("trainer", 1, done)]
    kube.set(objects=[obj("Job", "fit-trainer"), obj("Secret", "fit-token"), obj("Job", "other") | {"metadata": {
                 "name": "other", "labels": {k8s.LABEL_JOB: "other"}}}],
             # the looks: start's status, the leftovers, then the new pods coming up, one look each
             pods=[old, old,
                   [],
                   [pod("pserver", 0, CREATING, phase="Pending"), pod("trainer", 0, CREATING, phase="Pending")],
                   [pod("pserver", 0, RUNNING), pod("trainer", 0, RUNNING), pod("trainer", 1, CREATING)],
                   [pod("pserver", 0, RUNNING), pod("trainer", 0, RUNNING), pod("trainer", 1, RUNNING)]],
             exec=all_running())
    said = []
    with backend() as b:
        st = b.start(on_progress=said.append)
    assert said == [
        "deleting the previous run's 5 object(s) (its logs go with them)",  # the other job's Job is not its
        "creating Secret fit-token, ConfigMap fit-host, Service fit, Job fit-pserver, Job fit-trainer",
        "waiting for 3 pod(s) to start (at most 120s)"]
    assert (st.state, st.reason, st.unreachable) == ("running", None, {})
    assert [(p.host, p.role, p.id, p.pid, p.state) for p in st.processes] == [
        (P0, "pserver", 0, 7, "running"), (T0, "trainer", 0, 8, "running"), (T1, "trainer", 1, 9, "running")]
    calls = kube.calls()
    assert calls[:9] == [GET, GET_ALL, DELETE, CREATE, GET, GET, GET, GET, GET]
    status = agent("top", "/var/lib/clusterctl/jobs/fit", "--progress-only")  # the status, with progress
    assert sorted(calls[9:]) == [[*HEAD, "exec", p, "-c", r, "--", *status]
                                 for p, r in ((P0, "pserver"), (T0, "trainer"), (T1, "trainer"))]
    # the objects went on stdin, as rendered; the job's token is in the Secret, never in an argv
    created = kube.created()
    assert [(o["kind"], o["metadata"]["name"]) for o in created] == [
        ("Secret", "fit-token"), ("ConfigMap", "fit-host"), ("Service", "fit"), ("Job", "fit-pserver"),
        ("Job", "fit-trainer")]
    token = base64.b64decode(created[0]["data"]["token"]).decode()
    assert len(token) == 32 and token not in json.dumps(calls) and created[0]["data"]["token"] not in json.dumps(calls)


def test_start_refuses_a_job_that_runs(kube):
    kube.set(objects=[obj("Job", "fit-trainer"), pod("trainer", 0, RUNNING)],
             exec={T0: {"status": answer(reply("running", [("trainer", 0, 8, "running", None)]))}})
    with backend() as b, pytest.raises(JobError) as info:
        b.start()
    assert str(info.value) == "job fit is already running; stop it first (clusterctl stop)"
    assert [c[4] for c in kube.calls()] == ["get", "exec"]  # nothing created, nothing deleted


def test_a_create_kubectl_refuses_is_one_line_and_the_objects_are_deleted(kube):
    forbidden = 'Error from server (Forbidden): secrets is forbidden: User "ci" cannot create resource "secrets"'
    kube.set(fail={"create": {"rc": 1, "err": f"W0101 a warning\n{forbidden}\n"}})
    with backend() as b, pytest.raises(JobError) as info:
        b.start()
    assert str(info.value) == ("start failed: kubectl create Secret/fit-token, ConfigMap/fit-host, Service/fit, "
                               f"Job/fit-pserver, Job/fit-trainer: {forbidden}; the job's objects were deleted")
    assert kube.calls() == [GET, GET_ALL, CREATE, DELETE]
    # when the cleanup fails too, both are said
    kube.set(fail={"create": {"rc": 1, "err": f"{forbidden}\n"},
                   "delete": {"rc": 1, "err": "error: You must be logged in to the server (Unauthorized)\n"}})
    with backend() as b, pytest.raises(JobError) as info:
        b.start()
    assert str(info.value) == (
        "start failed: kubectl create Secret/fit-token, ConfigMap/fit-host, Service/fit, Job/fit-pserver, "
        f"Job/fit-trainer: {forbidden} (cleanup also failed: kubectl delete jobs,services,configmaps,secrets -l "
        f"{SEL}: error: You must be logged in to the server (Unauthorized))")


def test_a_pod_that_cannot_pull_its_image_fails_the_start_and_the_objects_are_deleted(kube):
    pull = {"waiting": {"reason": "ErrImagePull", "message": 'pull access denied for img'}}
    kube.set(pods=[[], [], [pod("pserver", 0, RUNNING), pod("trainer", 0, CREATING, phase="Pending"),
                            pod("trainer", 1, pull, phase="Pending")]])
    said = []
    with backend() as b, pytest.raises(JobError) as info:
        b.start(on_progress=said.append)
    assert str(info.value) == ("start failed: pod fit-trainer-1-abcde: ErrImagePull: pull access denied for img; "
                               "the job's objects were deleted")
    assert kube.calls() == [GET, GET_ALL, CREATE, GET, DELETE]
    assert said[-1] == "waiting for 3 pod(s) to start (at most 120s)"


def test_a_pull_failures_message_from_the_cluster_is_one_line_and_printable(kube):
    # a message with a newline and an escape made two `clusterctl: error:` lines, the escape raw in the second
    pull = {"waiting": {"reason": "ErrImagePull", "message": "line1\nline2\x1b[31m"}}
    kube.set(pods=[[], [], [pod("pserver", 0, RUNNING), pod("trainer", 0, RUNNING), pod("trainer", 1, pull)]])
    with backend() as b, pytest.raises(JobError) as info:
        b.start(on_progress=lambda _: None)
    assert str(info.value) == ("start failed: pod fit-trainer-1-abcde: ErrImagePull: line1 line2\\x1b[31m; "
                               "the job's objects were deleted")


def test_start_says_which_pods_still_wait_at_its_deadline(kube):
    kube.set(pods=[[], [], [pod("pserver", 0, RUNNING), pod("trainer", 0, CREATING, phase="Pending")]],
             exec={P0: {"status": answer(reply("running", [("pserver", 0, 7, "running", None)]))}})
    said = []
    # a deadline that has passed by the first look: the start returns what it sees and says what waits
    with backend(SPEC.replace("context: prod", "context: prod, wait_timeout: 0.001")) as b:
        st = b.start(on_progress=said.append)
    assert said[-2:] == ["waiting for 3 pod(s) to start (at most 0.001s)",
                         "pods still waiting after 0.001s: fit-trainer-0-abcde (ContainerCreating)"]
    assert st.state == "running"  # one supervisor runs; the pods still waiting are pending processes
    assert [(p.host, p.state, p.error) for p in st.processes] == [
        (P0, "running", None), (T0, "pending", None), ("-", "pending", "no pod yet")]
    # no pod scheduled by the deadline (a full cluster): the job is starting, not running
    kube.set(objects=[], gets=0, pods=[[], [], [pod("pserver", 0, CREATING, phase="Pending"),
                                               pod("trainer", 0, CREATING, phase="Pending")]])
    with backend(SPEC.replace("context: prod", "context: prod, wait_timeout: 0.001")) as b:
        st = b.start(on_progress=said.append)
    assert st.state == "starting" and {p.state for p in st.processes} == {"pending"}
    kube.set(objects=[], pods=[[]])  # an empty namespace, and no pod comes at all
    with backend(SPEC.replace("context: prod", "context: prod, wait_timeout: 0.001")) as b:
        b.start(on_progress=said.append)
    assert said[-1] == "pods still waiting after 0.001s: not created yet"


# ------------------------------------------------------------------------------------------ status


def test_status_looks_again_when_a_pod_ended_before_its_supervisor_answered(kube):
    why = "trainer.1 on fit-trainer-1-abcde exited with code 3"
    failed = reply("failed", [("trainer", 0, 8, "stopped", -15)], reason=why)
    running = [pod("pserver", 0, RUNNING), pod("trainer", 0, RUNNING), pod("trainer", 1, RUNNING)]
    kube.set(objects=[obj("Job", "fit-trainer")],
             pods=[running, [pod("pserver", 0, RUNNING), ended("trainer", 0, failed, 1), pod("trainer", 1, RUNNING)]],
             exec={P0: {"status": answer(reply("stopping", [("pserver", 0, 7, "running", None)],
                                               restart_pending=True))},
                   T1: {"status": answer(reply("failed", [("trainer", 1, 9, "failed", 3)], reason=why))}})
    with backend() as b:
        st = b.status()
    # T0's exec found no pod; the second look shows it ended, with its supervisor's verdict (the coordinator's,
    # named once); the pserver's supervisor is still stopping its process: the job is not over yet
    assert (st.state, st.reason, st.unreachable) == ("stopping", f"{T0}: {why}", {})
    assert [(p.host, p.role, p.id, p.state, p.exit_code) for p in st.processes] == [
        (P0, "pserver", 0, "running", None), (T0, "trainer", 0, "stopped", -15), (T1, "trainer", 1, "failed", 3)]
    calls = kube.calls()
    assert (calls[0], calls[-1], len(calls)) == (GET, GET, 5)


def test_supervisors_stopping_before_a_restart_are_a_restarting_job(kube):
    kube.set(objects=[obj("Job", "fit-trainer"), pod("pserver", 0, RUNNING), pod("trainer", 0, RUNNING),
                      pod("trainer", 1, RUNNING)],
             exec={p: {"status": answer(reply("stopping", [(r, i, 7 + n, "stopped", -15)], restart_pending=True,
                                              reason="trainer.1 exited with code 3", attempt=0, restarts=1))}
                   for n, (p, r, i) in enumerate(((P0, "pserver", 0), (T0, "trainer", 0), (T1, "trainer", 1)))})
    with backend() as b:
        st = b.status()
    assert (st.state, st.reason, st.restarts) == ("restarting", f"{T0}: trainer.1 exited with code 3", 1)
    assert [(p.host, p.state) for p in st.processes] == [(P0, "stopped"), (T0, "stopped"), (T1, "stopped")]


@pytest.mark.parametrize("exec_answer,why", [
    ({"rc": 1, "err": "error: unable to upgrade connection: container not found (\"trainer\")\n"},
     "kubectl exec fit-trainer-0-abcde: error: unable to upgrade connection: container not found (\"trainer\")"),
    ({"rc": 2, "out": "Traceback (most recent call last):\n{not json\n"}, "kubectl exec fit-trainer-0-abcde: exit 2, "
                                                                         "no reply"),
    ({"rc": 0, "out": "[1, 2]\n"}, "kubectl exec fit-trainer-0-abcde: exit 0, no reply"),
])
def test_a_running_pod_whose_supervisor_does_not_answer_is_lost(kube, exec_answer, why):
    kube.set(objects=[obj("Job", "fit-trainer"), pod("pserver", 0, RUNNING), pod("trainer", 0, RUNNING),
                      pod("trainer", 1, RUNNING)],
             exec={P0: {"status": answer(reply("running", [("pserver", 0, 7, "running", None)]))},
                   T0: {"status": exec_answer},
                   T1: {"status": answer(reply("running", [("trainer", 1, 9, "running", None)]))}})
    with backend() as b:
        st = b.status()
    assert (st.state, st.reason, st.unreachable) == ("lost", f"unreachable: {T0}", {T0: why})
    assert [(p.host, p.state, p.error) for p in st.processes] == [
        (P0, "running", None), (T0, "running", why), (T1, "running", None)]
    assert [c[4] for c in kube.calls()] == ["get", "exec", "exec", "exec", "get"]  # looked again: T0 still runs


def test_status_says_kubectls_error_in_one_line(kube):
    kube.set(fail={"get": {"rc": 1, "err": "E0101 memcache.go:265] couldn't get current server API group list\n"
                                           "The connection to the server localhost:8080 was refused\n"}})
    with backend() as b, pytest.raises(kubernetes.KubectlError) as info:
        b.status()
    assert str(info.value) == (f"kubectl get jobs,pods -l {SEL}: The connection to the server localhost:8080 was "
                               "refused")


def test_status_without_objects_is_not_running_and_asks_no_pod(kube):
    with backend() as b:
        st = b.status()
    assert (st.state, st.processes) == ("not running", [])
    assert kube.calls() == [GET]


# -------------------------------------------------------------------------------------------- logs

P0_LOG = ("2026-01-01T00:00:00Z supervisor 1 for job fit\n"
          "[fit-pserver-0-abcde pserver.0] listening\n"
          "[fit-pserver-0-abcde pserver.0] served 10\n")
T0_LOG = ("[fit-trainer-0-abcde trainer.0] step=1\n"
          "2026-01-01T00:00:01Z supervisor: attempt 1\n"
          "[fit-trainer-0-abcde trainer.0#1] step=1 again\n"
          "[fit-trainer-1-abcde trainer.1] not this pod's\n")


def _logs(b, **kw) -> list[tuple]:
    got = []
    b.logs(on_line=lambda host, stream, line: got.append((host, stream, line)), **kw)
    return got


def test_logs_are_each_pods_own_process_lines_pservers_first(kube):
    done = reply("succeeded", [("trainer", 0, 8, "exited", 0)])
    kube.set(objects=[obj("Job", "fit-trainer"), ended("trainer", 0, done), pod("pserver", 0, RUNNING),
                      pod("trainer", 1, CREATING, phase="Pending")],
             logs={P0: P0_LOG, T0: T0_LOG})
    with backend() as b:
        with pytest.raises(JobError) as info:
            _logs(b)
        # the pods that have logs gave them before the error said which did not
        assert str(info.value) == "logs incomplete:\nfit-trainer-1-abcde: not started (ContainerCreating)"
        assert _logs(b, role="trainer", id=0) == [
            (T0, "out", "[fit-trainer-0-abcde trainer.0] step=1"),
            (T0, "out", "[fit-trainer-0-abcde trainer.0#1] step=1 again")]
        assert _logs(b, host="fit-pserver-0", lines=1) == [(P0, "out", "[fit-pserver-0-abcde pserver.0] served 10")]
        assert _logs(b, host=P0, lines=0) == []  # as the SSH backend's -n 0 (host/logtail.py): no line
        assert len(_logs(b, host=P0, lines=5)) == 2
        with pytest.raises(JobError) as info:  # nothing printed, exit 0 before
            _logs(b, host="no-such-pod")
        assert str(info.value) == ("no process of job fit matches host=no-such-pod (a pod's name, or its "
                                   "<name>-<role>-<id> part)")
    logs_calls = [c[4:] for c in kube.calls() if c[4] == "logs"]
    # the pods' logs are asked for in parallel (the first call's two); the lines come in the pods' order (above)
    assert sorted(logs_calls[:2]) == [["logs", P0, "-c", "pserver"], ["logs", T0, "-c", "trainer"]]
    assert logs_calls[2:] == [["logs", T0, "-c", "trainer"], *[["logs", P0, "-c", "pserver"]] * 3]


def test_logs_say_what_kubectl_could_not_read(kube):
    kube.set(objects=[obj("Job", "fit-trainer"), pod("pserver", 0, RUNNING), pod("trainer", 0, RUNNING)],
             logs={T0: T0_LOG})  # no log of P0: kubectl's error
    got = []
    with backend() as b, pytest.raises(JobError) as info:
        b.logs(on_line=lambda host, stream, line: got.append(line))
    assert str(info.value) == (
        "logs incomplete:\nkubectl logs fit-pserver-0-abcde -c pserver: Error from server (BadRequest): container "
        '"pserver" in pod "fit-pserver-0-abcde" is waiting to start: ContainerCreating')
    assert got == ["[fit-trainer-0-abcde trainer.0] step=1", "[fit-trainer-0-abcde trainer.0#1] step=1 again"]


def test_the_pods_logs_are_read_in_parallel_and_shown_in_their_order(kube):
    # one `kubectl logs` after the other, each with a 600 s deadline: minutes for a few slow pods
    kube.set(objects=[obj("Job", "fit-trainer"), pod("pserver", 0, RUNNING), pod("trainer", 0, RUNNING),
                      pod("trainer", 1, RUNNING)],
             logs={f"fit-trainer-{i}-abcde": {"out": f"[fit-trainer-{i}-abcde trainer.{i}] step=1\n", "hold": 2}
                   for i in range(2)} | {P0: {"out": "[fit-pserver-0-abcde pserver.0] up\n", "hold": 2}})
    with backend() as b:
        t0 = time.monotonic()
        got = _logs(b)
        took = time.monotonic() - t0
    assert [ln for _, _, ln in got] == ["[fit-pserver-0-abcde pserver.0] up", "[fit-trainer-0-abcde trainer.0] step=1",
                                        "[fit-trainer-1-abcde trainer.1] step=1"]
    assert took < 4.5, took  # 6 s one after the other


def test_logs_refusals(kube):
    with backend() as b:
        with pytest.raises(JobError, match=r"^-n must be >= 0$"):
            _logs(b, lines=-1)
        with pytest.raises(JobError, match=r"^no process of job fit matches role=trainer id=7$"):
            _logs(b, role="trainer", id=7)
        with pytest.raises(JobError) as info:
            _logs(b)
    assert str(info.value) == ("job fit has no pods in namespace ml (never started, or stopped: a stop deletes the "
                               "pods and their logs)")
    assert kube.calls() == [GET]  # the refusals of the arguments asked nothing


def test_follow_reads_each_line_once_across_restarted_streams_until_the_pods_end(kube):
    first = "supervisor line\n[fit-trainer-0-abcde trainer.0] step=1\n"  # a process line last: read once
    kube.set(pods=[[pod("trainer", 0, RUNNING), pod("trainer", 1, CREATING, phase="Pending")],
                   [pod("trainer", 0, RUNNING), pod("trainer", 1, RUNNING)]],
             objects=[obj("Job", "fit-trainer")],
             follow={T0: [{"out": first},  # the stream ends while the container runs: followed again
                          {"out": first + "[fit-trainer-0-abcde trainer.0] step=2\n", "end": 0}],
                     T1: [{"out": "[fit-trainer-1-abcde trainer.1] step=1\n[fit-trainer-0-abcde trainer.0] no\n",
                           "end": 1}]})
    with backend() as b:
        got = _logs(b, role="trainer", follow=True)
    assert [ln for host, _, ln in got if host == T0] == ["[fit-trainer-0-abcde trainer.0] step=1",
                                                         "[fit-trainer-0-abcde trainer.0] step=2"]
    assert [ln for host, _, ln in got if host == T1] == ["[fit-trainer-1-abcde trainer.1] step=1"]
    follows = [c[4:] for c in kube.calls() if c[4] == "logs"]
    assert sorted(follows) == [["logs", "-f", T0, "-c", "trainer"]] * 2 + [["logs", "-f", T1, "-c", "trainer"]]


def test_an_interrupted_follow_leaves_no_kubectl_logs_running(kube):
    """Ctrl+C of `logs --follow` while the pods run: each `kubectl logs -f` it started is ended on the
    way out, not left streaming on the user's machine until the pod ends (a SIGINT to clusterctl alone, as a
    wrapper sends it, reaches no child of it)."""
    kube.set(objects=[obj("Job", "fit-trainer"), pod("trainer", 0, RUNNING), pod("trainer", 1, RUNNING)],
             follow={T0: [{"out": "[fit-trainer-0-abcde trainer.0] step=1\n", "hold": 600}],
                     T1: [{"out": "[fit-trainer-1-abcde trainer.1] step=1\n", "hold": 600}]})
    got = []
    with backend() as b:
        looks = b._snapshot

        def snapshot():  # Ctrl+C at the main thread's next look once both streams said their line
            if len(got) == 2:
                raise KeyboardInterrupt
            return looks()
        b._snapshot = snapshot
        with pytest.raises(KeyboardInterrupt):
            b.logs(on_line=lambda host, stream, line: got.append(line), role="trainer", follow=True)
    pids = kube.follower_pids()
    assert len(pids) == 2 and sorted(got) == ["[fit-trainer-0-abcde trainer.0] step=1",
                                              "[fit-trainer-1-abcde trainer.1] step=1"], (pids, got)
    for pid in pids:  # ended and reaped: no such process
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_follow_with_lines_starts_from_the_last_ones(kube):
    log = "[fit-trainer-0-abcde trainer.0] step=1\nsupervisor line\n[fit-trainer-0-abcde trainer.0] step=2\n"
    kube.set(objects=[obj("Job", "fit-trainer"), pod("trainer", 0, RUNNING)], logs={T0: log},
             follow={T0: [{"out": log + "[fit-trainer-0-abcde trainer.0] step=3\n", "end": 0}]})
    with backend() as b:
        got = _logs(b, role="trainer", id=0, follow=True, lines=1)
    assert [ln for _, _, ln in got] == ["[fit-trainer-0-abcde trainer.0] step=2", "[fit-trainer-0-abcde trainer.0] step=3"]


@pytest.mark.timeout(60)
def test_a_follow_whose_kubectl_says_much_on_stderr_does_not_hang(kube):
    # its stderr was a pipe read only after stdout's end: kubectl blocked writing its 65th KiB, stdout never ended
    kube.set(objects=[obj("Job", "fit-trainer"), pod("trainer", 0, RUNNING)],
             follow={T0: [{"out": "[fit-trainer-0-abcde trainer.0] step=1\n", "err": "W: chatty\n" * 30000,
                           "end": 0}]})
    with backend() as b:
        got = _logs(b, role="trainer", id=0, follow=True)
    assert [ln for _, _, ln in got] == ["[fit-trainer-0-abcde trainer.0] step=1"]


def test_follow_says_which_streams_broke(kube):
    kube.set(pods=[[pod("trainer", 0, RUNNING)], [pod("trainer", 0, RUNNING, deleting=True)]],
             objects=[obj("Job", "fit-trainer")],
             follow={T0: [{"out": "[fit-trainer-0-abcde trainer.0] step=1\n", "rc": 1,
                           "err": "error: unexpected EOF\n"}]})
    with backend() as b, pytest.raises(JobError) as info:
        _logs(b, role="trainer", id=0, follow=True)
    assert str(info.value) == "logs incomplete:\nkubectl logs -f fit-trainer-0-abcde: error: unexpected EOF"
    # a line read before the stream broke: --lines 1 reads it through kubectl logs, which fails here
    kube.set(gets=0, fail={"logs": {"rc": 1, "err": "error: You must be logged in to the server\n"}})
    with backend() as b, pytest.raises(JobError) as info:
        _logs(b, role="trainer", id=0, follow=True, lines=1)
    assert str(info.value) == ("logs incomplete:\nkubectl logs fit-trainer-0-abcde -c trainer: error: You must be "
                               "logged in to the server")


# -------------------------------------------------------------------------------------------- stop


def test_stop_asks_each_running_pods_supervisor_then_deletes_the_objects(kube):
    done = reply("succeeded", [("trainer", 1, 9, "exited", 0)])
    kube.set(objects=[obj("Job", "fit-pserver"), obj("Job", "fit-trainer"), obj("Secret", "fit-token"),
                      pod("pserver", 0, RUNNING), pod("trainer", 0, RUNNING), ended("trainer", 1, done)],
             exec={P0: {"stop": answer({"ok": True, "was_running": True, "killed": [{"pid": 7}, {"pid": 70}],
                                        "left": []})},
                   T0: {"stop": answer({"ok": False, "was_running": True, "killed": [{"pid": 8}],
                                        "left": [{"pid": 80}]}, rc=1)}})
    with backend() as b:
        report = b.stop(grace=0.5)
    assert report == StopReport(job="fit", was_running=True, hosts=2, killed=3, left={T0: [{"pid": 80}]},
                                detail="deleted Job, Pod, Secret in namespace ml")
    calls = kube.calls()
    stop = agent("stop", "/var/lib/clusterctl/jobs/fit", "--grace", "0.5", "--job", "fit")
    assert calls[0] == GET_ALL and calls[-1] == DELETE
    assert sorted(calls[1:-1]) == [[*HEAD, "exec", P0, "-c", "pserver", "--", *stop],
                                   [*HEAD, "exec", T0, "-c", "trainer", "--", *stop]]
    # again: nothing left, nothing done
    with backend() as b:
        again = b.stop()
    assert again == StopReport(job="fit", was_running=False, detail="no objects in namespace ml")
    assert kube.calls()[len(calls):] == [GET_ALL]


def test_stop_says_which_pods_gave_no_report_and_deletes_them_all_the_same(kube):
    kube.set(objects=[obj("Job", "fit-trainer"), pod("trainer", 0, RUNNING), pod("trainer", 1, RUNNING)],
             exec={T1: {"stop": answer({"ok": True, "was_running": False, "killed": [], "left": []})}})
    with backend() as b:
        report = b.stop()
    assert report == StopReport(job="fit", was_running=True, hosts=1, killed=0, left={}, detail=(
        f"deleted Job, Pod in namespace ml; no stop report from {T0}: kubectl exec {T0}: {NOT_FOUND.format(T0)}"))
    stop = agent("stop", "/var/lib/clusterctl/jobs/fit", "--grace", "3", "--job", "fit")
    assert [*HEAD, "exec", T0, "-c", "trainer", "--", *stop] in kube.calls() and kube.calls()[-1] == DELETE
    with backend() as b:
        assert b.status().state == "not running"  # the pods went with their Jobs


def test_stop_fails_loudly_when_kubectl_cannot_delete(kube):
    kube.set(objects=[obj("Job", "fit-trainer")],
             fail={"delete": {"rc": 1, "err": "error: timed out waiting for the condition on jobs/fit-trainer\n"}})
    with backend() as b, pytest.raises(kubernetes.KubectlError) as info:
        b.stop()
    assert str(info.value) == (f"kubectl delete jobs,services,configmaps,secrets -l {SEL}: error: timed out waiting "
                               "for the condition on jobs/fit-trainer")


# --------------------------------------------------------------------------------------------- top

REQUEST = TopRequest(slice_s=1, slices=6, gpu=False)


def _top(b, request=REQUEST) -> dict:
    out = {}
    asks = b.top_asks(request)
    assert [a.labels for a in asks] == [("fit-pserver-0",), ("fit-trainer-0",), ("fit-trainer-1",)]
    for ask in asks:
        out.update(ask.call())
    return out


def test_top_asks_each_running_pod_once_a_refresh_and_says_why_the_others_have_no_figures(kube, monkeypatch):
    monkeypatch.setattr(kubernetes, "TOP_PODS_TTL_S", 600)  # one refresh, however slow this machine is
    figures = {"ok": True, "state": "running", "processes": [{"role": "pserver", "id": 0, "pid": 7, "rss": 1}]}
    kube.set(objects=[obj("Job", "fit-trainer"), pod("pserver", 0, RUNNING), pod("trainer", 0, RUNNING)],
             exec={P0: {"top": answer(figures)},
                   T0: {"top": {"rc": 1, "err": "Traceback (most recent call last):\nOSError: [Errno 28] No space\n"}}})
    with backend() as b:
        got = _top(b)
    assert [(k, a.status, a.reply, a.error, a.state) for k, a in got.items()] == [
        (P0, "ok", figures, None, None),
        (T0, "unreachable", None, "kubectl exec fit-trainer-0-abcde: OSError: [Errno 28] No space", None),
        ("fit-trainer-1", "waiting", None, "no pod yet", "starting")]
    top = agent("top", "/var/lib/clusterctl/jobs/fit", "--slice", "1", "--slices", "6", "--no-gpu")
    calls = kube.calls()
    assert calls[0] == GET and sorted(calls[1:]) == [[*HEAD, "exec", P0, "-c", "pserver", "--", *top],
                                                     [*HEAD, "exec", T0, "-c", "trainer", "--", *top]]


def test_top_rows_of_pods_not_running(kube, monkeypatch):
    monkeypatch.setattr(kubernetes, "TOP_PODS_TTL_S", 600)
    done = reply("succeeded", [("trainer", 0, 8, "exited", 0)], reason="all 2 trainers exited 0")
    kube.set(objects=[obj("Job", "fit-trainer"), pod("pserver", 0, RUNNING, deleting=True), ended("trainer", 0, done),
                      pod("trainer", 1, {"waiting": {"reason": "ImagePullBackOff", "message": "Back-off pulling"}},
                          phase="Pending")])
    with backend() as b:
        got = _top(b)
    assert [(k, a.status, a.error, a.state) for k, a in got.items()] == [
        (P0, "no job", "pod being deleted", "stopping"),
        (T0, "ok", None, None),
        (T1, "waiting", "not started (ImagePullBackOff: Back-off pulling)", "starting")]
    assert (got[T0].reply["state"], got[T0].reply["processes"][0]["state"]) == ("succeeded", "exited")
    assert kube.calls() == [GET]  # no pod runs: nothing to exec
    kube.set(objects=[])
    with backend() as b:
        got = _top(b)
    assert [(k, a.status, a.error, a.state) for k, a in got.items()] == [
        (f"fit-{r}-{i}", "no job", "no pod", "not running") for r, i in (("pserver", 0), ("trainer", 0), ("trainer", 1))]


def test_top_when_kubectl_cannot_list_the_pods_every_row_is_unreachable_and_the_next_ask_tries_again(kube):
    kube.set(fail={"get": {"rc": 1, "err": "error: the server doesn't have a resource type \"jobs\"\n"}})
    with backend() as b:
        got = _top(b)
    why = f"kubectl get jobs,pods -l {SEL}: error: the server doesn't have a resource type \"jobs\""
    assert [(k, a.status, a.error) for k, a in got.items()] == [
        (f"fit-{r}-{i}", "unreachable", why) for r, i in (("pserver", 0), ("trainer", 0), ("trainer", 1))]
    assert kube.calls() == [GET] * 3  # a failed look is not kept


# ---------------------------------------------------------------------------------------- dispatch


def test_dispatch_says_which_volume_holds_the_code(kube):
    said = []
    spec = SPEC.replace("context: prod", "context: prod, workspace: {pvc: code, mount_path: /src}")
    with backend(spec) as b:
        assert b.dispatch(on_progress=said.append) == []
    assert said == ["nothing to dispatch with backend: kubernetes: the pods run the code in the volume code at /src"]
    assert kube.calls() == []


# ----------------------------------------------------------------- Jobs whose pods are gone (their conditions)

DONE_AT = "2026-01-01T00:10:00Z"


def job(role: str, **status) -> dict:
    """Job fit-<role> as `kubectl get jobs -o json` shows it, with `status` (conditions=[(type, reason, message)])."""
    conds = [{"type": t, "status": "True", "reason": r, "message": m, "lastTransitionTime": DONE_AT}
             for t, r, m in status.pop("conditions", [])]
    return {"kind": "Job", "metadata": {"name": f"fit-{role}", "labels": {k8s.LABEL_JOB: "fit", k8s.LABEL_ROLE: role}},
            "status": {"startTime": "2026-01-01T00:00:00Z", **({"conditions": conds} if conds else {}), **status}}


COMPLETE = ("Complete", "CompletionsReached", "Reached expected number of succeeded pods")
FAILED = ("Failed", "FailedIndexes", "Job has failed indexes")
# the previous run's Jobs, finished, their pods gone (deleted by hand, pod GC, ttlSecondsAfterFinished...)
FINISHED = [job("pserver", conditions=[COMPLETE], succeeded=1, completedIndexes="0", completionTime=DONE_AT),
            job("trainer", conditions=[COMPLETE], succeeded=2, completedIndexes="0-1", completionTime=DONE_AT)]


def test_status_of_finished_jobs_whose_pods_are_gone_is_their_conditions(kube):
    kube.set(objects=FINISHED)
    with backend() as b:
        st = b.status()
    done = "Complete (CompletionsReached: Reached expected number of succeeded pods) at 2026-01-01T00:10:00Z"
    assert (st.state, st.unreachable) == ("succeeded", {})
    assert st.reason == (f"pods gone; Job fit-pserver: {done}, 1 succeeded; "
                         f"pods gone; Job fit-trainer: {done}, 2 succeeded")
    assert [(p.host, p.role, p.id, p.state, p.error) for p in st.processes] == [
        ("-", "pserver", 0, "exited", f"pod gone; Job fit-pserver: index 0 completed, {done}"),
        ("-", "trainer", 0, "exited", f"pod gone; Job fit-trainer: index 0 completed, {done}"),
        ("-", "trainer", 1, "exited", f"pod gone; Job fit-trainer: index 1 completed, {done}")]
    assert kube.calls() == [GET]  # the Jobs came with the pods: one look, nothing to exec


def test_status_of_failed_jobs_whose_pods_are_gone_names_each_index(kube):
    kube.set(objects=[job("pserver", conditions=[FAILED], failed=1, failedIndexes="0"),
                      job("trainer", conditions=[FAILED], succeeded=1, failed=1, completedIndexes="0",
                          failedIndexes="1")])
    with backend() as b:
        st = b.status()
    failed = "Failed (FailedIndexes: Job has failed indexes) at 2026-01-01T00:10:00Z"
    assert st.state == "failed"
    assert st.reason == (f"pods gone; Job fit-pserver: {failed}, 1 failed; "
                         f"pods gone; Job fit-trainer: {failed}, 1 succeeded, 1 failed")
    assert [(p.role, p.id, p.state, p.error) for p in st.processes] == [
        ("pserver", 0, "failed", f"pod gone; Job fit-pserver: index 0 failed, {failed}"),
        ("trainer", 0, "exited", f"pod gone; Job fit-trainer: index 0 completed, {failed}"),
        ("trainer", 1, "failed", f"pod gone; Job fit-trainer: index 1 failed, {failed}")]


def test_a_pod_gone_while_its_job_runs_on_is_what_the_job_says_of_its_index(kube):
    # trainer 1's pod deleted by hand: the Job controller counts its index failed; the others still run
    kube.set(objects=[job("pserver", active=1), job("trainer", active=1, failed=1, failedIndexes="1"),
                      pod("pserver", 0, RUNNING), pod("trainer", 0, RUNNING)],
             exec={P0: {"status": answer(reply("running", [("pserver", 0, 7, "running", None)]))},
                   T0: {"status": answer(reply("running", [("trainer", 0, 8, "running", None)]))}})
    with backend() as b:
        st = b.status()
    assert (st.state, st.reason) == ("running", "pod gone; Job fit-trainer: index 1 failed")
    assert [(p.host, p.state, p.error) for p in st.processes] == [
        (P0, "running", None), (T0, "running", None), ("-", "failed", "pod gone; Job fit-trainer: index 1 failed")]


def test_jobs_without_a_verdict_and_without_pods_are_still_starting(kube):
    # created, the pods not scheduled yet: no condition, no index ended (today's "no pod yet")
    kube.set(objects=[job("pserver", active=1), job("trainer", active=2, completedIndexes="")])
    with backend() as b:
        st = b.status()
    assert (st.state, st.reason) == ("starting", None)
    assert [(p.host, p.state, p.error) for p in st.processes] == [("-", "pending", "no pod yet")] * 3
    # a condition that is not "True", or not Complete/Failed, is no verdict either
    kube.set(objects=[job("pserver", conditions=[("Suspended", "JobSuspended", "suspended")]),
                      job("trainer", conditions=[("FailureTarget", "FailedIndexes", "Job has failed indexes")])
                      | {"status": {"conditions": [{"type": "Complete", "status": "False"}]}}])
    with backend() as b:
        st = b.status()
    assert [(p.state, p.error) for p in st.processes] == [("pending", "no pod yet")] * 3


def test_what_a_job_says_is_untrusted_text_one_bounded_printable_line(kube):
    evil = "\x1b[2J\x1b]0;owned\x07line one\nline two\r\u202e" + "x" * 5000
    kube.set(objects=[job("trainer", conditions=[("Failed", "Bad\nReason" + "r" * 100, evil)],
                          completedIndexes="0-999999999999,x,-1,\u00b2,1-0", failedIndexes=["1"])])
    with backend() as b:
        st = b.status()
    row = st.processes[2].error
    assert row.startswith("pod gone; Job fit-trainer: index 1 completed, Failed (Bad Reason" + "r" * 51 + "...: \\x1b[2J\\x1b]0;owned\\x07"
                          "line one line two \\u202e" + "x" * 100)
    assert row.endswith("x...) at 2026-01-01T00:10:00Z") and all(c.isprintable() for c in row) and len(row) < 400
    # the indexes are clamped to the job's (0-999999999999 is 0 and 1 here); what is not an index list is none
    assert [(p.role, p.id, p.state) for p in st.processes] == [
        ("pserver", 0, "pending"), ("trainer", 0, "exited"), ("trainer", 1, "exited")]


def test_start_after_a_run_whose_pods_are_gone_replaces_it(kube):
    kube.set(objects=[*FINISHED, obj("Secret", "fit-token")],
             pods=[[], [], [pod("pserver", 0, RUNNING), pod("trainer", 0, RUNNING), pod("trainer", 1, RUNNING)]],
             exec=all_running())
    said = []
    with backend() as b:
        st = b.start(on_progress=said.append)
    assert said[:2] == ["deleting the previous run's 3 object(s) (its logs go with them)",
                        "creating Secret fit-token, ConfigMap fit-host, Service fit, Job fit-pserver, Job fit-trainer"]
    assert st.state == "running"
    assert kube.calls()[:5] == [GET, GET_ALL, DELETE, CREATE, GET]


def test_start_still_refuses_while_a_job_of_the_previous_run_has_no_verdict(kube):
    kube.set(objects=[FINISHED[0], job("trainer", active=2, succeeded=1, completedIndexes="0")])
    with backend() as b, pytest.raises(JobError) as info:
        b.start()
    assert str(info.value) == "job fit is already running; stop it first (clusterctl stop)"
    assert kube.calls() == [GET]  # nothing created, nothing deleted


def test_top_rows_of_processes_whose_pods_are_gone(kube, monkeypatch):
    monkeypatch.setattr(kubernetes, "TOP_PODS_TTL_S", 600)
    kube.set(objects=[FINISHED[0], job("trainer", conditions=[FAILED], failed=2, failedIndexes="0-1")])
    with backend() as b:
        got = _top(b)
    failed = "Failed (FailedIndexes: Job has failed indexes) at 2026-01-01T00:10:00Z"
    assert {k: (a.status, a.reply["state"], a.reply["top_error"], a.reply["processes"]) for k, a in got.items()} == {
        "fit-pserver-0": ("ok", "succeeded", "pod gone; Job fit-pserver: index 0 completed, Complete "
                          "(CompletionsReached: Reached expected number of succeeded pods) at 2026-01-01T00:10:00Z",
                          [{"role": "pserver", "id": 0, "state": "exited"}]),
        "fit-trainer-0": ("ok", "failed", f"pod gone; Job fit-trainer: index 0 failed, {failed}",
                          [{"role": "trainer", "id": 0, "state": "failed"}]),
        "fit-trainer-1": ("ok", "failed", f"pod gone; Job fit-trainer: index 1 failed, {failed}",
                          [{"role": "trainer", "id": 1, "state": "failed"}])}
    assert kube.calls() == [GET]


def test_logs_of_processes_whose_pods_are_gone_say_so_and_follow_ends(kube):
    done = reply("succeeded", [("trainer", 0, 8, "exited", 0)])
    kube.set(objects=[*FINISHED, ended("trainer", 0, done)], logs={T0: T0_LOG},
             follow={T0: [{"out": T0_LOG, "rc": 0}]})
    complete = "Complete (CompletionsReached: Reached expected number of succeeded pods) at 2026-01-01T00:10:00Z"
    with backend() as b:
        with pytest.raises(JobError) as info:
            _logs(b)
        assert str(info.value).splitlines() == [
            "logs incomplete:",
            f"pserver.0: pod gone; Job fit-pserver: index 0 completed, {complete} (its log went with the pod)",
            f"trainer.1: pod gone; Job fit-trainer: index 1 completed, {complete} (its log went with the pod)"]
        result = []
        follower = threading.Thread(target=lambda: result.append(_logs(b, follow=True, role="pserver")), daemon=True)
        follower.start()
        follower.join(timeout=60)  # without the Jobs' verdicts this waits for a pod forever
        assert not follower.is_alive() and result == [[]]


def test_stop_of_finished_jobs_whose_pods_are_gone_deletes_them(kube):
    kube.set(objects=[*FINISHED, obj("Secret", "fit-token")])
    with backend() as b:
        report = b.stop()
    assert report == StopReport(job="fit", was_running=False, hosts=0, killed=0, left={},
                                detail="deleted Job, Secret in namespace ml")
    assert kube.calls() == [GET_ALL, DELETE]
    with backend() as b:
        assert b.status().state == "not running"


def test_a_kubectl_past_its_deadline_is_killed_with_what_it_started(tmp_path):
    """kubectl killed at its deadline alone left its children (an `exec:` credential plugin) running, reparented
    to init, one per call that timed out."""
    from helpers import pids_running

    marker = f"{os.getpid()}.75"  # seconds: this sleep's own argument, found in /proc
    tool = tmp_path / "kubectl"
    tool.write_text(f"#!/bin/sh\nsleep {marker} &\nsleep {marker}\n")  # a plugin it started, and kubectl waiting
    tool.chmod(0o755)

    def left() -> list[int]:
        return pids_running(["sleep", marker])

    kubectl = kubernetes.Kubectl("ml", binary=str(tool))
    with pytest.raises(kubernetes.KubectlError, match=r"^kubectl get pods -l a=b: kubectl did not answer within 1s$"):
        kubectl.run("get", "pods", "-l", "a=b", what="kubectl get pods -l a=b", timeout=1)
    deadline = time.monotonic() + 10
    while left() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert left() == [], "what kubectl started outlived it"
