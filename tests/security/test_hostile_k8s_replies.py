"""A compromised pod under `backend: kubernetes` may say anything: its supervisor's `agent status` reply (over
`kubectl exec`), its termination message (`{"v": 1, "state": ...}`, read once the pod has ended) and its
`agent stop` reply are untrusted. This attacks the controller's reading of them (clusterctl/backends/kubernetes.py's
`fold_status` and `KubernetesBackend.stop`) with replies of the wrong shape: wrongly typed restarts, attempt,
attempts, state, and process rows whose role, id or state is not what the agent sends, and a stop reply whose
`killed` is not a list. Each must be ignored (only the well-typed fields count, as clusterctl/host/status.py's
`HostStatus.from_json` reads an SSH host's reply), never a TypeError/AttributeError traceback, and the status must
render (clusterctl/commands/render.py) without a raw control character. The stop replies go through the scripted
kubectl of tests/unit/fakekubectl.py; no cluster, no network.
"""

from __future__ import annotations

import io
import json
import os
import sys
from pathlib import Path

import pytest

from clusterctl import backends, k8s
from clusterctl.backends import kubernetes
from clusterctl.backends.kubernetes import fold_status
from clusterctl.commands.lifecycle import render_stop
from clusterctl.commands.render import render_status
from clusterctl.spec import parse_spec

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
import fakekubectl  # noqa: E402

ESC = "\x1b[2J\x1b]0;pwned\x07"
P0, T0 = "fit-pserver-0-abcde", "fit-trainer-0-abcde"
RUNNING = {"running": {"startedAt": "2026-01-01T00:00:05Z"}}
JOBS = [{"kind": "Job", "metadata": {"name": f"fit-{r}", "labels": {k8s.LABEL_JOB: "fit", k8s.LABEL_ROLE: r}},
         "status": {"active": 1}} for r in ("pserver", "trainer")]
GOOD = {"ok": True, "state": "running", "attempt": 0, "restarts": 0, "attempts": [],
        "processes": [{"role": "trainer", "id": 0, "pid": 8, "state": "running", "exit_code": None, "uptime_s": 1.0}]}
SPEC = """\
name: fit
backend: kubernetes
hosts: [{address: a}, {address: b}]
job: {mode: pserver, pservers: 1, trainers: 1, entrypoint: [python3, train.py], grace: 3}
kubernetes: {image: img, namespace: ml, context: prod}
"""


def pod(role: str, i: int, state: dict) -> dict:
    """A pod of job fit as `kubectl get pods -o json` shows it (`state`: its main container's)."""
    meta = {"name": f"fit-{role}-{i}-abcde", "creationTimestamp": "2026-01-01T00:00:00Z",
            "labels": {k8s.LABEL_JOB: "fit", k8s.LABEL_ROLE: role}, "annotations": {k8s.INDEX_ANNOTATION: str(i)}}
    return {"kind": "Pod", "metadata": meta,
            "status": {"phase": "Running", "containerStatuses": [{"name": role, "state": state}]}}


def rendered(st) -> str:
    """The status as `clusterctl status` prints it, and as `--json` does (both must not raise)."""
    json.dumps(st.to_json())
    out = io.StringIO()
    render_status(st, out)
    return out.getvalue()


def check_sane(st, hostile_pod: str) -> str:
    """Whatever the hostile pod said: a job state, typed rows, the good pod's row intact, a clean table."""
    assert isinstance(st.state, str) and isinstance(st.restarts, int) and isinstance(st.attempt, int)
    for p in st.processes:
        assert isinstance(p.role, str) and isinstance(p.id, int) and isinstance(p.state, str), p
        assert p.pid is None or isinstance(p.pid, int)
        assert p.exit_code is None or isinstance(p.exit_code, int)
    for a in st.attempts:
        assert isinstance(a["attempt"], int) and (a["outcome"] is None or isinstance(a["outcome"], str)), a
    assert [(p.role, p.id, p.pid, p.state) for p in st.processes if p.host == T0] == [("trainer", 0, 8, "running")]
    assert any(p.host == hostile_pod for p in st.processes)
    text = rendered(st)
    assert "\x1b" not in text and "\x07" not in text
    assert all(c == "\n" or c.isprintable() for c in text)
    return text


HOSTILE_STATUS = {
    "restarts-str": {"ok": True, "state": "running", "restarts": "x"},
    "restarts-list": {"ok": True, "state": "running", "restarts": [9]},
    "attempt-str": {"ok": True, "state": "running", "attempt": "x"},
    "attempts-int": {"ok": True, "state": "running", "attempts": 5},
    "attempts-outcome-list": {"ok": True, "state": "failed", "attempt": 1, "restarts": 2,
                              "attempts": [{"attempt": 0, "outcome": [ESC], "reason": ESC}, {"attempt": "1"}]},
    "state-list": {"ok": True, "state": [ESC]},
    "state-dict": {"ok": True, "state": {"running": 1}},
    "process-id-str": {"ok": True, "state": "running", "processes": [{"role": "pserver", "id": "x"}]},
    "process-role-int": {"ok": True, "state": "running", "processes": [{"role": 5, "id": 0, "state": "running"}]},
    "process-state-list": {"ok": True, "state": "running",
                           "processes": [{"role": "pserver", "id": 0, "state": [ESC]}]},
    "process-state-dict": {"ok": True, "state": "running",
                           "processes": [{"role": "pserver", "id": 0, "state": {"x": 1}, "pid": "7"}]},
    "process-uptime-str": {"ok": True, "state": "running",
                           "processes": [{"role": "pserver", "id": 0, "state": "running", "uptime_s": ESC}]},
}


@pytest.mark.parametrize("reply", list(HOSTILE_STATUS.values()), ids=list(HOSTILE_STATUS))
def test_a_hostile_status_reply_is_read_for_its_well_typed_fields_only(reply):
    pods = [pod("pserver", 0, RUNNING), pod("trainer", 0, RUNNING)]
    st = fold_status("fit", {"pserver": 1, "trainer": 1}, JOBS, pods, {P0: (reply, None), T0: (GOOD, None)})
    check_sane(st, P0)


HOSTILE_TERMINATION = {
    "restarts-str": {"v": 1, "state": "failed", "reason": "boom", "restarts": "x"},
    "attempt-list": {"v": 1, "state": "failed", "reason": "boom", "attempt": [1]},
    "attempts-int": {"v": 1, "state": "failed", "reason": "boom", "attempts": 5},
    "process-id-str": {"v": 1, "state": "failed", "processes": [{"role": "pserver", "id": "x", "state": "failed"}]},
    "process-role-int": {"v": 1, "state": "failed", "processes": [{"role": 5, "id": 0, "state": "failed"}]},
    "process-state-list": {"v": 1, "state": "failed", "processes": [{"role": "pserver", "id": 0, "state": [ESC]}]},
    "process-exit-str": {"v": 1, "state": "failed",
                         "processes": [{"role": "pserver", "id": 0, "state": "failed", "exit_code": ESC}]},
}


@pytest.mark.parametrize("message", list(HOSTILE_TERMINATION.values()), ids=list(HOSTILE_TERMINATION))
def test_a_hostile_termination_message_is_read_for_its_well_typed_fields_only(message):
    ended = pod("pserver", 0, {"terminated": {"exitCode": 1, "reason": "Error", "message": json.dumps(message)}})
    st = fold_status("fit", {"pserver": 1, "trainer": 1}, JOBS, [ended, pod("trainer", 0, RUNNING)],
                     {T0: (GOOD, None)})
    check_sane(st, P0)
    assert st.state in ("running", "failed", "stopping")  # the pod failed; the trainer still runs


def test_a_termination_message_nested_too_deep_to_read_is_the_pods_exit_code():
    """4,014 bytes (under the 4 KiB Kubernetes keeps), 1,990 brackets deep: json's RecursionError, not a traceback."""
    deep = '{"v": 1, "state": "failed", "x": ' + "[" * 1990 + "]" * 1990 + "}"
    assert len(deep) < 4096
    ended = pod("pserver", 0, {"terminated": {"exitCode": 1, "reason": "Error", "message": deep}})
    st = fold_status("fit", {"pserver": 1, "trainer": 1}, JOBS, [ended, pod("trainer", 0, RUNNING)],
                     {T0: (GOOD, None)})
    check_sane(st, P0)
    assert st.state in ("running", "failed", "stopping")


def _reshaped(path: tuple, value) -> dict:
    """The trainer's running pod with the field at `path` replaced by `value`."""
    p = pod("trainer", 0, RUNNING)
    node = p
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return p


HOSTILE_PODS = {  # each was an AttributeError, TypeError or ValueError traceback out of `status`, `stop`, `logs`
    "status-str": _reshaped(("status",), "Running"),
    "container-statuses-str": _reshaped(("status", "containerStatuses"), ["trainer"]),
    "state-str": _reshaped(("status", "containerStatuses", 0, "state"), "running"),
    "terminated-str": _reshaped(("status", "containerStatuses", 0, "state"), {"terminated": "yes"}),
    "exit-code-str": _reshaped(("status", "containerStatuses", 0, "state"), {"terminated": {"exitCode": "1"}}),
    "metadata-str": _reshaped(("metadata",), "fit-trainer-0"),
    "labels-str": _reshaped(("metadata", "labels"), "trainer"),
    "annotations-list": _reshaped(("metadata", "annotations"), [k8s.INDEX_ANNOTATION]),
    "index-superscript": _reshaped(("metadata", "annotations", k8s.INDEX_ANNOTATION), "\u00b2"),
    "index-int": _reshaped(("metadata", "annotations", k8s.INDEX_ANNOTATION), 0),
    "waiting-reason-list": _reshaped(("status",), {"initContainerStatuses": [{"state": {"waiting": {"reason": []}}}],
                                                   "conditions": ["x", {"type": "PodScheduled"}]}),
}


@pytest.mark.parametrize("hostile", list(HOSTILE_PODS.values()), ids=list(HOSTILE_PODS))
def test_a_pod_object_of_the_wrong_shape_is_read_for_its_well_typed_fields_only(hostile):
    st = fold_status("fit", {"pserver": 1, "trainer": 1}, JOBS, [pod("pserver", 0, RUNNING), hostile],
                     {P0: (GOOD, None)})
    rendered(st)
    assert st.state in ("running", "pending", "lost", "failed", "stopping", "unknown"), st.state


def test_kubectls_cause_is_its_error_line_not_the_url_after_it():
    said = ("Unable to connect to the server: getting credentials: exec: executable no-such-plugin not found\n\n"
            "It looks like you are trying to use a client-go credential plugin that is not installed.\n\n"
            "To learn more about this feature, consult the documentation available at:\n"
            "      https://kubernetes.io/docs/reference/access-authn-authz/authentication/#client-go-credential-plugins\n")
    assert kubernetes._tail_line(said) == ("Unable to connect to the server: getting credentials: exec: executable "
                                           "no-such-plugin not found")
    assert kubernetes._tail_line("Warning: x\nerror: pods \"p\" not found\n") == 'error: pods "p" not found'
    assert kubernetes._tail_line("something odd\n") == "something odd"


@pytest.fixture
def kube(tmp_path, monkeypatch):
    """The scripted kubectl first on PATH (tests/unit/fakekubectl.py)."""
    fake = fakekubectl.install(tmp_path / "bin", tmp_path / "kube")
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setattr(kubernetes, "START_POLL_S", 0)
    return fake


@pytest.mark.parametrize("killed, counted", [
    (5, 0), (2.5, 0), (True, 0), ("xyz" + ESC, 0), ({"pid": 7}, 0),
    ([7, {"pid": 7, "via": "killpg"}, {"pid": 7, "via": "kill"}, {"pid": 8}, True, "9", [10], {"pid": [11]}], 2),
], ids=["int", "float", "bool", "str", "dict", "list"])
def test_a_hostile_stop_reply_counts_only_its_well_typed_distinct_pids(kube, killed, counted, capsys):
    kube.set(objects=[JOBS[0], JOBS[1], pod("pserver", 0, RUNNING), pod("trainer", 0, RUNNING)],
             exec={P0: {"stop": {"out": json.dumps({"ok": True, "was_running": True, "killed": killed}) + "\n"}},
                   T0: {"stop": {"out": json.dumps({"ok": True, "was_running": True, "killed": [{"pid": 8}],
                                                    "left": []}) + "\n"}}})
    with backends.open_backend(parse_spec(SPEC, "k.yaml", check=backends.problems)) as b:
        report = b.stop(grace=0.5)
    # the hostile pod counts only its distinct integer pids (none when `killed` is not a list); the good pod's one
    assert (report.was_running, report.hosts, report.killed, report.left) == (True, 2, counted + 1, {})
    render_stop(report)
    out = capsys.readouterr()
    assert out.out == f"job fit stopped on 2 host(s) (deleted Job, Pod in namespace ml), {counted + 1} process(es) killed\n"
    assert "\x1b" not in out.out + out.err


@pytest.mark.parametrize("reply, said", [
    ({"ok": True, "state": "a-ok", "processes": []}, "a job state clusterctl does not know: 'a-ok'"),
    (dict(GOOD, processes=[dict(GOOD["processes"][0], id=0, role="trainer", pid=9)]),
     "a row for trainer.0, which the plan does not place on this host (was the spec changed since the job started?)"),
])
def test_a_pod_speaks_for_its_own_process_only(reply, said):
    # the pserver pod reporting a state of its own making (it became the job's), or trainer 0's row (shown twice,
    # its rate able to make the real one a straggler): that pod's `no status` line, as an SSH host's (ops/job.py)
    pods = [pod("pserver", 0, RUNNING), pod("trainer", 0, RUNNING)]
    st = fold_status("fit", {"pserver": 1, "trainer": 1}, JOBS, pods, {P0: (reply, None), T0: (GOOD, None)})
    check_sane(st, P0)
    assert st.unreachable == {P0: "no status: " + said}, st.unreachable
    assert st.state == "lost" and [(p.host, p.role, p.id) for p in st.processes] == [(P0, "pserver", 0), (T0, "trainer", 0)]


@pytest.mark.parametrize("reply, said", [
    ({"ok": True, "state": "a-ok", "processes": []}, "a job state clusterctl does not know: 'a-ok'"),
    (dict(GOOD, processes=[dict(GOOD["processes"][0], pid=9)]),
     "a row for trainer.0, which the plan does not place on this host (was the spec changed since the job started?)"),
])
def test_top_too_takes_a_pods_word_for_its_own_process_only(kube, reply, said):
    """`top` asks each pod as `status` does: the pserver pod's state of its own making, or trainer 0's row from it
    (its rate could make the real trainer a straggler), is that pod's error row; the trainer pod's stands."""
    from clusterctl.ops.top import TopRequest

    kube.set(objects=JOBS + [pod("pserver", 0, RUNNING), pod("trainer", 0, RUNNING)],
             exec={P0: {"top": {"out": json.dumps(reply) + "\n"}}, T0: {"top": {"out": json.dumps(GOOD) + "\n"}}})
    with backends.open_backend(parse_spec(SPEC, "k.yaml", check=backends.problems)) as b:
        answers = {}
        for ask in b.top_asks(TopRequest(1.0, 6, gpu=False)):
            answers.update(ask.call())
    assert {name: (a.status, a.error) for name, a in answers.items() if name in (P0, T0)} == {
        P0: ("error", said), T0: ("ok", None)}
