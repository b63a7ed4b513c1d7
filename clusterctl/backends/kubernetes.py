"""`backend: kubernetes`: one pod per process (an Indexed Job per role), the host supervisor in every pod.

`start` creates the objects clusterctl/k8s.py renders (the job's token in a Secret, the host package and the
job's template in a ConfigMap, a headless Service, the Jobs) with ``kubectl create``; every pod's main process
is clusterctl/host/pod.py, which builds the pod's job file and runs the supervisor in the foreground, so the
guarantees (the token, restarts, fail-fast, attempt logs, the sweep) are the supervisor's, as over SSH.
`status` reads the Jobs and pods (one ``kubectl get``) and asks each running pod's supervisor (``kubectl exec ... agent
status``); a pod that ended left its supervisor's last status in its termination message. `logs` reads
``kubectl logs``, where each pod's main process writes every attempt's lines prefixed ``[pod role.id]``.
`stop` asks each running pod's supervisor to stop (``agent stop``: the exact report, the sweep in the
pod), then deletes the objects. `top` asks each running pod's supervisor for its figures and progress
(``kubectl exec ... agent top``, one pod per TopAsk, at most EXEC_PARALLEL at once, the pods read once a refresh).

Every kubectl call goes through `Kubectl` (argv lists, a deadline each, errors in one line naming the
objects). No API server was reachable where this was built: tests/integration/test_k8s_pods.py runs it
against a fake kubectl that plays the pods in Docker (docs/kubernetes.md says what that does and does not prove).

Why one module of about 950 lines: it is the backend and the three things only it uses, in order: the kubectl
layer (`Kubectl`), what a pod object says (`pod_facts`) and the fold of pods and replies into a JobStatus
(`fold_status`, pure: unit-tested from pod JSON), then the operations. Split, each part would be a module with
one caller.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import tempfile
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from ..errors import ClusterctlError, JobError
from ..host.states import ACTIVE_JOB_STATES, JobState, ProcState
from ..host.status import HostStatus, JobStatus, ProcessStatus, overall_state
from ..procs import run_session
from .base import Backend, LineCallback, Placement, Progress, StopReport, killed_count

if TYPE_CHECKING:
    from ..plan import JobPlan
    from ..spec import ClusterSpec

__all__ = ["KubernetesBackend", "Kubectl", "KubectlError", "fold_status", "pod_facts", "LOG_LINE"]

KUBECTL_TIMEOUT = 60.0  # seconds for one control command (get, create, exec of agent status)
EXEC_PARALLEL = 16  # kubectl exec (status, stop, top) and kubectl logs commands in flight at once
LOGS_TIMEOUT = 2 * KUBECTL_TIMEOUT  # one pod's `kubectl logs` (the kubelet keeps ~10 MiB a container: seconds)
TOP_PODS_TTL_S = 1.0  # top: one `kubectl get` serves every pod's request of a refresh
REPLY_LIMIT = 1 << 20  # bytes of an agent reply read from a pod
START_POLL_S = 0.5
FOLLOW_POLL_S = 1.0
KINDS = "jobs,pods,services,configmaps,secrets"
DELETE_KINDS = "jobs,services,configmaps,secrets"  # the pods go with their Jobs (--cascade=foreground)
# a pod waiting for one of these will not start by itself: `start` deletes the job and says why
FATAL_WAITING = frozenset({"ErrImagePull", "ImagePullBackOff", "ErrImageNeverPull", "InvalidImageName",
                           "CreateContainerConfigError", "CreateContainerError", "RunContainerError"})
# a process line in `kubectl logs` of a pod (the pod's main process follows the supervisor's attempt logs);
# everything else there is the supervisor's own log
LOG_LINE = re.compile(r"^\[(?P<pod>[a-z0-9.-]+) (?P<role>pserver|trainer)\.(?P<id>\d+)(?:#\d+)?\] ")


class KubectlError(ClusterctlError):
    """A kubectl command failed: one line naming what it did."""


_KUBECTL_ERROR = ("error:", "Error from server", "Unable to connect to the server")


def _tail_line(text: str) -> str:
    """kubectl's cause from its stderr: its last error line (`error: ...`, `Unable to connect to the server: ...`),
    else its last line that is not a URL or an introduction to one (a credential plugin's advice ends with a URL)."""
    lines = [ln.strip() for ln in (text or "").splitlines() if ln.strip()]
    said = [ln for ln in lines if ln.startswith(_KUBECTL_ERROR)] or [
        ln for ln in lines if not ln.startswith(("http://", "https://", ">")) and not ln.endswith(":")] or lines
    return said[-1][:500] if said else ""


@dataclass
class Kubectl:
    """The one place that runs kubectl: argv lists, the namespace and context on every call, a deadline each."""

    namespace: str
    context: str | None = None
    binary: str = "kubectl"

    def argv(self, *args: str) -> list[str]:
        """The full argv of `kubectl ARGS` in this namespace (and context)."""
        head = [self.binary] + (["--context", self.context] if self.context else [])
        return [*head, "--namespace", self.namespace, *args]

    def run(self, *args: str, what: str, input: bytes | None = None, timeout: float = KUBECTL_TIMEOUT,
            check: bool = True, tail: int | None = None) -> subprocess.CompletedProcess:
        """Run `kubectl ARGS`; KubectlError (one line: what, and kubectl's last line) when it fails and `check`.
        `tail`: only the last `tail` bytes of its output are kept (procs.run_session)."""
        argv = self.argv(*args)
        try:
            # a session of its own: an auth plugin it started (`exec:` credentials) is killed with it at the deadline
            res = run_session(argv, input=input, timeout=timeout, tail=tail)
        except FileNotFoundError:
            raise KubectlError(f"{what}: {self.binary} not found on PATH (backend: kubernetes runs kubectl)") from None
        except subprocess.TimeoutExpired:
            raise KubectlError(f"{what}: kubectl did not answer within {timeout:g}s") from None
        if check and res.returncode != 0:
            why = _tail_line(res.stderr.decode("utf-8", "replace")) or f"exit {res.returncode}"
            raise KubectlError(f"{what}: {why}")
        return res

    def get(self, kinds: str, selector: str) -> list[dict]:
        """The objects of `kinds` (comma separated) labelled `selector`, as JSON."""
        res = self.run("get", kinds, "-l", selector, "-o", "json", what=f"kubectl get {kinds} -l {selector}")
        try:
            data = json.loads(res.stdout[:64 << 20])
        except (ValueError, RecursionError) as e:  # RecursionError: a reply nested 100,000 deep
            raise KubectlError(f"kubectl get {kinds} -l {selector}: not JSON: {e}") from None
        items = data.get("items") if isinstance(data, dict) else None
        if not isinstance(items, list):
            raise KubectlError(f"kubectl get {kinds} -l {selector}: no item list in the reply")
        return [i for i in items if isinstance(i, dict)]

    def create(self, objects: list[dict]) -> str:
        """`kubectl create -f -` of `objects` (a List on stdin: nothing secret in argv); kubectl's output."""
        body = json.dumps({"apiVersion": "v1", "kind": "List", "items": objects}).encode()
        what = "kubectl create " + ", ".join(f"{o['kind']}/{o['metadata']['name']}" for o in objects)
        return self.run("create", "-f", "-", what=what, input=body).stdout.decode("utf-8", "replace")

    def exec(self, pod: str, container: str, argv: list[str], *, timeout: float = KUBECTL_TIMEOUT):
        """`kubectl exec POD -c CONTAINER -- ARGV`: the CompletedProcess (any exit code); KubectlError if none came.
        What the pod prints is the pod's to choose: the last REPLY_LIMIT bytes of each stream are kept."""
        return self.run("exec", pod, "-c", container, "--", *argv, what=f"kubectl exec {pod} -c {container}",
                        timeout=timeout, check=False, tail=REPLY_LIMIT)

    def logs(self, pod: str, container: str) -> str:
        """`kubectl logs POD -c CONTAINER`: the container's log as Kubernetes keeps it."""
        res = self.run("logs", pod, "-c", container, what=f"kubectl logs {pod} -c {container}",
                       timeout=LOGS_TIMEOUT)
        return res.stdout.decode("utf-8", "replace")

    def follow(self, pod: str, container: str) -> subprocess.Popen:
        """`kubectl logs -f POD -c CONTAINER`, started: read its stdout until the container ends. Its stderr goes to
        a file (`err_file`, read with stderr_tail): a pipe no one reads while stdout streams fills at 64 KiB, and
        kubectl then blocks for ever."""
        err = tempfile.TemporaryFile()
        try:
            proc = subprocess.Popen(self.argv("logs", "-f", pod, "-c", container), stdout=subprocess.PIPE,
                                    stderr=err, stdin=subprocess.DEVNULL)
        except FileNotFoundError:
            err.close()
            raise KubectlError(f"kubectl logs -f {pod}: {self.binary} not found on PATH") from None
        proc.err_file = err
        return proc

    @staticmethod
    def stderr_tail(proc: subprocess.Popen, limit: int = 64 << 10) -> str:
        """The last `limit` bytes of what a follow() wrote on stderr (its file is closed then)."""
        with proc.err_file as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - limit))
            return f.read().decode("utf-8", "replace")

    def delete(self, kinds: str, selector: str, *, timeout: float) -> str:
        """Delete the objects labelled `selector` and wait until they (and their pods) are gone."""
        what = f"kubectl delete {kinds} -l {selector}"
        res = self.run("delete", kinds, "-l", selector, "--cascade=foreground", "--wait=true", "--ignore-not-found=true",
                       f"--timeout={int(timeout)}s", what=what, timeout=timeout + 30)
        return res.stdout.decode("utf-8", "replace")


# --------------------------------------------------------------------------------------------- pods


@dataclass(frozen=True)
class PodFacts:
    """What a pod object says: who it is and how far its main container got."""

    name: str
    role: str
    id: int
    phase: str  # "waiting" (not started), "running", "ended", "deleting"
    exit_code: int | None = None
    message: str = ""  # ended: the termination message; waiting: why it waits
    waiting: str = ""  # the waiting reason (ErrImagePull, PodInitializing, ...)


def _obj(value) -> dict:
    """`value` when the cluster sent an object there, else an empty one (a reply of another shape is read as absent)."""
    return value if isinstance(value, dict) else {}


def _objs(value) -> list[dict]:
    """The objects of a list the cluster sent (anything else in it, or a list that is not one, left out)."""
    return [v for v in value if isinstance(v, dict)] if isinstance(value, list) else []


def _code(value) -> int | None:
    """An integer the cluster sent (an exit code, a count), else None (a bool or a string is not one)."""
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def pod_facts(pod: dict) -> PodFacts | None:
    """The facts of one pod object of `kubectl get pods -o json` (None: not one of a job's pods). The cluster's
    reply is read field by field, each of the type it should have; another type is taken as absent."""
    from ..k8s import INDEX_ANNOTATION, LABEL_ROLE

    meta = _obj(pod.get("metadata"))
    role = _obj(meta.get("labels")).get(LABEL_ROLE)
    index = _obj(meta.get("annotations")).get(INDEX_ANNOTATION)
    if role not in ("pserver", "trainer") or not (isinstance(index, str) and index.isascii() and index.isdigit()):
        return None
    name, idx = str(meta.get("name")), int(index)
    status = _obj(pod.get("status"))
    main = next((c for c in _objs(status.get("containerStatuses")) if c.get("name") == role), {})
    state = _obj(main.get("state"))
    if "terminated" in state:
        t = _obj(state["terminated"])
        return PodFacts(name, role, idx, "ended", _code(t.get("exitCode")), str(t.get("message") or ""),
                        _text(t.get("reason"), 200))
    if meta.get("deletionTimestamp"):
        return PodFacts(name, role, idx, "deleting")
    if "running" in state:
        return PodFacts(name, role, idx, "running")
    for init in _objs(status.get("initContainerStatuses")):
        ist = _obj(init.get("state"))
        t, w = _obj(ist.get("terminated")), _obj(ist.get("waiting"))
        if _code(t.get("exitCode")):
            why = f"init container {init.get('name')} exited {t.get('exitCode')}: {t.get('message') or t.get('reason') or ''}"
            return PodFacts(name, role, idx, "ended", _code(t.get("exitCode")), "", _text(why.strip(), 500))
        if isinstance(w.get("reason"), str) and w["reason"] in FATAL_WAITING:
            return PodFacts(name, role, idx, "waiting", None, _text(w.get("message"), 500), w["reason"])
    if status.get("phase") in ("Failed", "Succeeded"):  # ended without its container (evicted, ...)
        return PodFacts(name, role, idx, "ended", None, "", _text(f"{status.get('reason') or status.get('phase')}: "
                                                                 f"{status.get('message') or ''}".strip(), 500))
    if "waiting" in state:
        w = _obj(state["waiting"])
        return PodFacts(name, role, idx, "waiting", None, _text(w.get("message"), 500), _text(w.get("reason"), 200))
    why = next((f"{c.get('reason')}: {c.get('message')}" for c in _objs(status.get("conditions"))
                if c.get("type") == "PodScheduled" and c.get("status") == "False"), "")
    return PodFacts(name, role, idx, "waiting", None, _text(why, 500), "Pending" if not why else "Unschedulable")


def _newest(pods: list[dict]) -> dict[tuple[str, int], tuple[PodFacts, dict]]:
    """The newest pod of each (role, id) (Kubernetes never retries ours, but a deleted pod may linger)."""
    out: dict[tuple[str, int], tuple[PodFacts, dict]] = {}
    for pod in sorted(pods, key=lambda p: str(_obj(p.get("metadata")).get("creationTimestamp") or "")):
        facts = pod_facts(pod)
        if facts is not None:
            out[facts.role, facts.id] = (facts, pod)
    return out


# --------------------------------------------------------------------------------------------- jobs


def _text(value, limit: int) -> str:
    """Text from the cluster made safe to show: one line, control characters escaped, at most `limit` characters."""
    from ..console import printable

    text = printable(" ".join(str(value).split())) if value is not None else ""
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _indexes(value, count: int) -> frozenset[int]:
    """The indexes below `count` in a Job's `completedIndexes`/`failedIndexes` ("0,2-4"); anything else: none."""
    out: set[int] = set()
    for part in (value if isinstance(value, str) else "")[:65536].split(","):
        lo, _, hi = part.strip().partition("-")
        if not (lo.isascii() and lo.isdigit()) or (hi and not (hi.isascii() and hi.isdigit())):
            continue
        out.update(range(int(lo), min(int(hi or lo), count - 1) + 1))
    return frozenset(out)


@dataclass(frozen=True)
class JobFacts:
    """What a (role's Indexed) Job object says, for the processes whose pods are gone."""

    name: str
    role: str
    done: str | None  # "Complete" or "Failed" (its condition of that type is "True"); None: not finished
    condition: str = ""  # that condition, printable: "Failed (FailedIndexes: Job has failed indexes) at T"
    completed: frozenset[int] = frozenset()  # status.completedIndexes
    failed: frozenset[int] = frozenset()  # status.failedIndexes
    counts: str = ""  # "2 succeeded, 1 failed" (status.succeeded / status.failed)

    def outcome(self, i: int) -> tuple[str, str] | None:
        """Process `i` of a pod that is gone: (JobState.SUCCEEDED or FAILED, what says so), or None: not known
        to have ended (a pod not created yet, or one deleted while the Job runs on)."""
        if i in self.failed:
            state, bits = JobState.FAILED, [f"index {i} failed"]
        elif i in self.completed:
            state, bits = JobState.SUCCEEDED, [f"index {i} completed"]
        elif self.done == "Complete":  # every index completed
            state, bits = JobState.SUCCEEDED, []
        elif self.done == "Failed":  # ended without index i completed (failed, or never run: a deadline)
            state, bits = JobState.FAILED, []
        else:
            return None
        return state, f"pod gone; Job {self.name}: " + ", ".join(bits + ([self.condition] if self.done else []))

    def summary(self) -> str:
        """The Job's verdict for the job's reason: its condition and counts."""
        what = ", ".join(w for w in (self.condition, self.counts) if w)
        return f"pods gone; Job {self.name}: {what}"


def job_facts(job: dict, expected: dict[str, int]) -> JobFacts | None:
    """The facts of one Job object of `kubectl get jobs -o json` (None: not a role's Job); expected: role -> its
    number of processes (indexes)."""
    from ..k8s import LABEL_ROLE

    meta = _obj(job.get("metadata"))
    role = _obj(meta.get("labels")).get(LABEL_ROLE)
    if job.get("kind") != "Job" or role not in ("pserver", "trainer"):
        return None
    status = _obj(job.get("status"))
    done, condition = None, ""
    for c in _objs(status.get("conditions")):
        if c.get("type") in ("Failed", "Complete") and c.get("status") == "True":
            done = c["type"]
            why = ": ".join(t for t in (_text(c.get("reason"), 64), _text(c.get("message"), 200)) if t)
            when = _text(status.get("completionTime") if done == "Complete" else None, 40) or _text(
                c.get("lastTransitionTime"), 40)
            condition = done + (f" ({why})" if why else "") + (f" at {when}" if when else "")
            if done == "Failed":
                break
    counts = ", ".join(f"{n} {what}" for what in ("succeeded", "failed") if (n := _code(status.get(what))) and n > 0)
    return JobFacts(_text(meta.get("name"), 80) or f"?-{role}", role, done, condition,
                    _indexes(status.get("completedIndexes"), expected.get(role, 0)),
                    _indexes(status.get("failedIndexes"), expected.get(role, 0)), counts)


def _jobs_by_role(jobs: list[dict], expected: dict[str, int]) -> dict[str, JobFacts]:
    """The facts of each role's Job (one a role: its name is `<name>-<role>`)."""
    out: dict[str, JobFacts] = {}
    for job in jobs:
        facts = job_facts(job, expected)
        if facts is not None:
            out[facts.role] = facts
    return out


def _parse_reply(text: bytes | str) -> dict | None:
    """The agent's JSON object: its last line that is one (what a pod prints before it is skipped)."""
    if isinstance(text, bytes):
        text = text[-REPLY_LIMIT:].decode("utf-8", "replace")
    for line in reversed(text.strip().splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                data = json.loads(line)
            except (ValueError, RecursionError):  # a pod's message may be anything: 2,000 brackets deep in 4 KiB
                return None
            return data if isinstance(data, dict) else None
    return None


def _ended_view(f: PodFacts) -> dict:
    """What a pod that ended says of its job: its supervisor's termination message, else its exit code."""
    data = _parse_reply(f.message) if f.message.startswith("{") else None
    if data is not None and data.get("v") == 1 and isinstance(data.get("state"), str):
        return data
    if f.exit_code == 0:
        return {"state": JobState.SUCCEEDED, "reason": None, "processes": []}
    why = f.waiting or "no report from its supervisor"
    code = "" if f.exit_code is None else f" exited {f.exit_code}"
    return {"state": JobState.FAILED, "reason": f"pod {f.name}{code} ({why})", "processes": []}


def fold_status(job: str, expected: dict[str, int], jobs: list[dict], pods: list[dict],
                replies: dict[str, tuple[dict | None, str | None]]) -> JobStatus:
    """The job's JobStatus from its Jobs, its pods and the running pods' supervisors' replies (pure).

    expected: role -> number of pods; replies: pod name -> (agent status reply, or None and why not). A process
    without a pod is what its Job says of its index (completed, failed: the pod is gone) or, when the Job says
    nothing of it, pending ("no pod yet").
    """
    from ..ops.job import bounded_reply, job_stragglers, not_its_own, progress_rows

    S = JobState
    seen = _newest(pods)
    jobs_exist = bool(jobs)
    if not seen and not jobs_exist:
        return JobStatus(job, S.NOT_RUNNING, None, backend="kubernetes")
    by_role = _jobs_by_role(jobs, expected)
    gone: list[str] = []  # the verdicts of the Jobs whose pods are gone
    procs: list[ProcessStatus] = []
    host_states: list[str] = []
    unreachable: dict[str, str] = {}
    reasons: list[str] = []
    best = (0, 0, [], None)  # (attempt, attempts_total, [AttemptRecord], the pod's HostStatus)
    restarts = 0
    coordinator_reason = None
    for role in ("pserver", "trainer"):
        for i in range(expected.get(role, 0)):
            got = seen.get((role, i))
            outcome = by_role[role].outcome(i) if got is None and role in by_role else None
            if outcome is not None:  # the Job ended (or says how index i did) and the pod is gone
                state, note = outcome
                host_states.append(state)
                done = ProcState.EXITED if state == S.SUCCEEDED else ProcState.FAILED
                procs.append(ProcessStatus("-", role, i, None, done, None, None, note))
                verdict = by_role[role].summary() if by_role[role].done else note
                (reasons if state == S.FAILED else gone).append(verdict)
                continue
            if got is None:
                host_states.append(S.STARTING if jobs_exist else S.UNKNOWN)
                procs.append(ProcessStatus("-", role, i, None, ProcState.PENDING if jobs_exist else ProcState.NOT_STARTED,
                                           None, None, "no pod yet" if jobs_exist else "no pod"))
                continue
            f, _ = got
            if f.phase == "waiting":
                host_states.append(S.STARTING)
                err = f"{f.waiting}: {f.message}".strip(": ") if f.waiting not in ("", "PodInitializing",
                                                                                   "ContainerCreating") else None
                if err and f.waiting in FATAL_WAITING | {"Unschedulable"}:
                    reasons.append(f"{f.name}: {err}")
                procs.append(ProcessStatus(f.name, role, i, None, ProcState.PENDING, None, None, err))
                continue
            if f.phase == "deleting":
                host_states.append(S.STOPPING)
                procs.append(ProcessStatus(f.name, role, i, None, ProcState.RUNNING, None, None, "pod being deleted"))
                continue
            if f.phase == "ended":
                data = _ended_view(f)
            else:
                data, why = replies.get(f.name, (None, "not asked"))
                if data is None:
                    unreachable[f.name] = why or "no reply"
                    host_states.append(S.LOST)
                    procs.append(ProcessStatus(f.name, role, i, None, ProcState.RUNNING, None, None, why))
                    continue
                if data.get("ok") is False and data.get("state") in (None, S.UNKNOWN):
                    host_states.append(S.STARTING)  # the supervisor has not written its state yet
                    procs.append(ProcessStatus(f.name, role, i, None, ProcState.PENDING, None, None, None))
                    continue
            # only the well-typed fields of a reply or termination message (a pod may be compromised), as the
            # SSH path reads its hosts' replies (clusterctl/ops/job.py): a state of its own making or a row of
            # another pod's process is that pod's `no status` line; numbers no process has are left blank
            reply = HostStatus.from_json(data)
            wrong = not_its_own(reply, placed=frozenset({(role, i)}))
            if wrong:
                unreachable[f.name] = f"no status: {wrong}"
                host_states.append(S.LOST)
                procs.append(ProcessStatus(f.name, role, i, None, ProcState.RUNNING, None, None, f"no status: {wrong}"))
                continue
            reply = bounded_reply(reply)
            state = reply.folded_state  # a failed attempt being stopped reads `restarting` when another follows
            host_states.append(state)
            restarts = max(restarts, reply.restarts)
            if (reply.attempt, reply.attempts_total) > best[:2]:
                best = (reply.attempt, reply.attempts_total, reply.attempts, reply)
            if reply.reason and state not in (S.RUNNING, S.SUCCEEDED):
                reasons.append(f"{f.name}: {reply.reason}")
                if (role, i) == ("trainer", 0):
                    coordinator_reason = f"{f.name}: {reply.reason}"
            rows = progress_rows(reply, f.name)  # with the progress of `agent top --progress-only`
            procs.extend(rows)
            if not rows:
                done = ProcState.EXITED if state == S.SUCCEEDED else ProcState.FAILED
                procs.append(ProcessStatus(f.name, role, i, None, done, None, None, reply.reason))
    procs.sort(key=lambda p: (p.role != "pserver", p.id))
    found = job_stragglers(procs)
    state = overall_state(host_states)
    # the coordinator's verdict names the cause; the other pods repeat it
    reason = coordinator_reason or "; ".join(dict.fromkeys(reasons)) or (
        "unreachable: " + ", ".join(unreachable) if unreachable else None) or (
        "; ".join(dict.fromkeys(gone)) if gone and state == S.SUCCEEDED else None)
    attempts = [a.summary() for a in best[2]]
    return JobStatus(job, state, reason, procs, unreachable, best[0], restarts, attempts, stragglers=found,
                     backend="kubernetes")


# ------------------------------------------------------------------------------------------ backend


class KubernetesBackend(Backend):
    """Jobs as Indexed Jobs on a Kubernetes cluster, through kubectl; the host supervisor in every pod."""

    name: ClassVar[str] = "kubernetes"
    summary: ClassVar[str] = "one pod per process (Indexed Jobs, through kubectl); the host supervisor in every pod"
    unsupported = (
        ("slurm", "a slurm: section needs backend: slurm"),
        ("ssh", "pods are reached through kubectl, not ssh"),
        ("hosts.*.port", "hosts only give the job's shape (gpus, slots) under Kubernetes"),
        ("hosts.*.user", "hosts only give the job's shape (gpus, slots) under Kubernetes"),
        ("hosts.*.proxy_jump", "hosts only give the job's shape (gpus, slots) under Kubernetes"),
        ("hosts.*.train_address", "pods are named by the cluster's DNS (<name>-<role>-<i>.<name>)"),
        ("hosts.*.labels", "hosts only give the job's shape (gpus, slots) under Kubernetes"),
        ("provision", "pods run an image: put what the job needs in kubernetes.image"),
        ("workspace", "the code comes from kubernetes.image or kubernetes.workspace (a volume); nothing is dispatched"),
        ("data", "data: is not dealt under Kubernetes; keep the shards on the workspace volume and pick them by "
                 "PADDLE_TRAINER_ID"),
        ("job.log_dir", "the logs are in the pods (clusterctl logs, kubectl logs)"),
        ("job.mpi", "launcher: mpi is not supported under Kubernetes"),
        ("job.mpiexec", "launcher: mpi is not supported under Kubernetes"),
        ("job.mpi_args", "launcher: mpi is not supported under Kubernetes"),
        ("hosts.*.spare", "pods are the job's hosts: spares and min_hosts are the SSH backend's"),
        ("job.min_hosts", "pods are the job's hosts: spares and min_hosts are the SSH backend's"),
    )

    @classmethod
    def check(cls, spec) -> list:
        """The keys this backend does not honour and its own rules (Backend.check), then (when none of those) what the
        pods' manifests cannot be and what `start` would hit with them (clusterctl.backends.k8s_limits.start_problems:
        names, GPUs, sizes), each at its key's line:column."""
        found = super().check(spec)
        return found or cls.content_problems(spec)

    @staticmethod
    def content_problems(spec, *, to_start: bool = True) -> list:
        """What the pods' manifests of the spec's kubernetes: section cannot be, each at its key: what `start` would
        hit, or (not `to_start`: a spec of another backend that keeps the section for `k8s render`, checked by
        clusterctl.backends.problems) what `k8s render` refuses."""
        if spec.kubernetes is None or spec.located is None:
            return []
        from ..spec.errors import problem
        from .k8s_content import kubernetes_problems
        from .k8s_limits import start_problems

        found = start_problems(spec) if to_start else kubernetes_problems(spec)
        return [problem(spec.located, spec.source, path, message) for path, message in found]

    @classmethod
    def check_spec(cls, spec) -> list:
        """A kubernetes: section; pservers by count. What the section itself cannot be (launcher: mpi among it) is
        clusterctl.spec.checks.kubernetes_section_problems', made for every spec with the section; what the pods'
        content cannot be is `check`'s."""
        from ..spec.errors import problem

        loc, source, problems = spec.located, spec.source, []
        if loc is None:
            return []
        if spec.kubernetes is None:
            return [problem(loc, source, ("backend",), "backend: kubernetes needs a kubernetes: section (at least "
                            "kubernetes.image)")]
        if isinstance(spec.job.pservers, tuple):
            problems.append(problem(loc, source, ("job", "pservers"),
                                    "pservers are pods under Kubernetes: give a count or {per_host: N}"))
        return problems

    def __init__(self, spec, plan, *, spec_path=None, options=None, kubectl: Kubectl | None = None):
        super().__init__(spec, plan, spec_path=spec_path, options=options)
        self._kubectl = kubectl

    # -- what every operation needs -----------------------------------------------------------

    @property
    def kubectl(self) -> Kubectl:
        """The kubectl layer for the spec's namespace and context."""
        if self._kubectl is None:
            k = self.spec.kubernetes
            self._kubectl = Kubectl(k.namespace, k.context)
        return self._kubectl

    @property
    def selector(self) -> str:
        """The label every object of the job carries."""
        from ..k8s import LABEL_JOB, object_name

        return f"{LABEL_JOB}={object_name(self.spec)}"

    def _expected(self) -> dict[str, int]:
        return {"pserver": len(self.plan.pservers), "trainer": len(self.plan.trainers)}

    def _agent(self, *args: str) -> list[str]:
        from ..k8s import host_tool_argv

        return host_tool_argv(self.spec, "agent", list(args))

    def _jobdir(self) -> str:
        from ..k8s import jobdir

        return jobdir(self.spec)

    def _ask(self, pods: list[PodFacts], argv: list[str], timeout: float) -> dict[str, tuple[dict | None, str | None]]:
        """Run `argv` in each pod's main container, in parallel: pod name -> (its JSON reply, or None and why)."""
        def one(f: PodFacts):
            try:
                res = self.kubectl.exec(f.name, f.role, argv, timeout=timeout)
            except KubectlError as e:
                return f.name, (None, str(e))
            data = _parse_reply(res.stdout)
            if data is None:
                why = _tail_line(res.stderr.decode("utf-8", "replace")) or f"exit {res.returncode}, no reply"
                return f.name, (None, f"kubectl exec {f.name}: {why}")
            return f.name, (data, None)

        if not pods:
            return {}
        with ThreadPoolExecutor(max_workers=min(EXEC_PARALLEL, len(pods))) as pool:
            return dict(pool.map(one, pods))

    def _snapshot(self) -> tuple[list[dict], list[dict]]:
        """The job's Jobs and pods, in one `kubectl get` (the Jobs' status says how the processes whose pods are
        gone ended)."""
        items = self.kubectl.get("jobs,pods", self.selector)
        return [i for i in items if i.get("kind") == "Job"], [i for i in items if i.get("kind") == "Pod"]

    # -- operations -------------------------------------------------------------------------------

    def dispatch(self, *, on_progress: Progress | None = None) -> list:
        """Nothing to ship: the pods' code is in the image or on the workspace volume (said in one line)."""
        k = self.spec.kubernetes
        where = (f"the volume {k.workspace.pvc or k.workspace.host_path} at {k.workspace.mount_path}"
                 if k.workspace is not None else f"the image {k.image}")
        (on_progress or (lambda _m: None))(f"nothing to dispatch with backend: kubernetes: the pods run the code in "
                                           f"{where}")
        return []

    def status(self) -> JobStatus:
        """The pods' state, and each running pod's supervisor's view, folded into one JobStatus."""
        jobs, pods = self._snapshot()
        running = [f for f, _ in _newest(pods).values() if f.phase == "running"]
        # the status with each process's progress from its log, as over SSH (no sampling)
        replies = self._ask(running, self._agent("top", self._jobdir(), "--progress-only"), KUBECTL_TIMEOUT)
        if any(data is None for data, _ in replies.values()):  # a pod may have ended since `get`: look again
            jobs, pods = self._snapshot()
        return fold_status(self.plan.job, self._expected(), jobs, pods, replies)

    @classmethod
    def placement(cls, spec: ClusterSpec, plan: JobPlan) -> Placement:
        """One pod per process, named, reached and started as the manifests say (`k8s render`)."""
        from .. import k8s

        jobs = [d for d in k8s.render(spec, token="-") if d["kind"] == "Job"]  # pservers first, as in the plan
        secrets = {(k8s.names(spec)["secret"], k8s.TOKEN_KEY): "<the job's token>"}
        pods = [(job, i) for job in jobs for i in range(job["spec"]["completions"])]

        def row(n: int) -> tuple[str, str, str, str, str, str, str]:
            job, i = pods[n]
            env = k8s.pod_env(job, i, secrets=secrets)
            role = env["CLUSTERCTL_ROLE"]
            return (env["POD_IP"], role, str(i), str(i) if role == "trainer" else "", env["PADDLE_CURRENT_ENDPOINT"],
                    env.get("CUDA_VISIBLE_DEVICES", ""), " ".join(k8s.process_argv(job, i, secrets=secrets)))

        return Placement("pod", len(pods), row, f"backend: kubernetes, namespace {spec.kubernetes.namespace}",
                         f"one pod per process; `clusterctl k8s render {spec.source} -o -` prints every object")

    def notes(self) -> tuple[str, ...]:
        """The manifests' notes (the pods' names are longer than the SSH plan's addresses)."""
        from .. import k8s

        return k8s.notes(self.spec, len(self.plan.trainers))

    def start(self, *, on_progress: Progress | None = None) -> JobStatus:
        """Create the job's objects; wait (at most kubernetes.wait_timeout) until every pod's supervisor runs."""
        from .. import k8s

        say = on_progress or (lambda _m: None)
        current = self.status()
        if current.state in ACTIVE_JOB_STATES:
            raise JobError(f"job {self.plan.job} is already running; stop it first (clusterctl stop)")
        docs = k8s.render(self.spec)
        leftovers = self.kubectl.get(KINDS, self.selector)
        if leftovers:
            say(f"deleting the previous run's {len(leftovers)} object(s) (its logs go with them)")
            self._delete()
        say("creating " + ", ".join(f"{d['kind']} {d['metadata']['name']}" for d in docs))
        try:
            self.kubectl.create(docs)
        except KubectlError as e:
            cleanup = self._cleanup_after_failed_start()
            raise JobError(f"start failed: {e}{cleanup}") from None
        wait = self.spec.kubernetes.wait_timeout or k8s.WAIT_DEFAULT_S
        say(f"waiting for {sum(self._expected().values())} pod(s) to start (at most {wait:g}s)")
        deadline = time.monotonic() + wait
        while True:
            _, pods = self._snapshot()
            seen = _newest(pods)
            fatal = [f for f, _ in seen.values() if f.phase == "waiting" and f.waiting in FATAL_WAITING]
            if fatal:
                why = "; ".join(f"pod {f.name}: {f.waiting}: {f.message}".rstrip(": ") for f in fatal)
                cleanup = self._cleanup_after_failed_start()
                raise JobError(f"start failed: {why}{cleanup}")
            started = len(seen) == sum(self._expected().values()) and all(
                f.phase in ("running", "ended") for f, _ in seen.values())
            if started:
                break
            if time.monotonic() > deadline:
                waiting = [f"{f.name} ({f.waiting or f.phase})" for f, _ in seen.values() if f.phase == "waiting"]
                say(f"pods still waiting after {wait:g}s: {', '.join(waiting) or 'not created yet'}")
                break
            time.sleep(START_POLL_S)
        return self.status()

    def _cleanup_after_failed_start(self) -> str:
        try:
            self._delete()
        except KubectlError as e:
            return f" (cleanup also failed: {e})"
        return "; the job's objects were deleted"

    def _delete(self) -> str:
        from ..k8s import STOP_MARGIN_S

        return self.kubectl.delete(DELETE_KINDS, self.selector, timeout=self.plan.grace + STOP_MARGIN_S + 60)

    def logs(self, *, on_line: LineCallback, follow: bool = False, role: str | None = None, id: int | None = None,
             host: str | None = None, lines: int | None = None) -> int:
        """`[pod role.id] line` from every selected pod's log (every attempt); with follow, until the pods end."""
        if lines is not None and lines < 0:
            raise JobError("-n must be >= 0")
        wanted = [(r, i) for r, n in self._expected().items() for i in range(n)
                  if role in (None, r) and id in (None, i)]
        if not wanted:
            what = " ".join(f"{k}={v}" for k, v in (("role", role), ("id", id)) if v is not None)
            raise JobError(f"no process of job {self.plan.job} matches {what}")
        jobs, pods = self._snapshot()
        if not pods and not jobs:
            raise JobError(f"job {self.plan.job} has no pods in namespace {self.spec.kubernetes.namespace} "
                           "(never started, or stopped: a stop deletes the pods and their logs)")

        def selected(seen):
            return [f for key, (f, _) in sorted(seen.items(), key=lambda kv: (kv[0][0] != "pserver", kv[0][1]))
                    if key in wanted and host in (None, f.name, f"{f.name.rsplit('-', 1)[0]}")]

        if host is not None and not selected(_newest(pods)):  # as over SSH: said, not an empty success
            what = " ".join(f"{k}={v}" for k, v in (("host", host), ("role", role), ("id", id)) if v is not None)
            raise JobError(f"no process of job {self.plan.job} matches {what} (a pod's name, or its "
                           "<name>-<role>-<id> part)")

        def gone(seen, jobs) -> dict[tuple[str, int], str]:
            """The wanted processes whose pods are gone after their Job said how they ended: why, each."""
            by_role = _jobs_by_role(jobs, self._expected())
            return {(r, i): out[1] for r, i in wanted if (r, i) not in seen and r in by_role
                    and (out := by_role[r].outcome(i)) is not None}

        if not follow:
            problems = [f"{r}.{i}: {note} (its log went with the pod)" for (r, i), note in gone(_newest(pods), jobs).items()
                        if host is None]
            todo = []
            for f in selected(_newest(pods)):
                if f.phase == "waiting":
                    problems.append(f"{f.name}: not started ({f.waiting or 'pending'})")
                else:
                    todo.append(f)
            # EXEC_PARALLEL pods' logs at a time, each within its deadline, shown in the pods' order
            with ThreadPoolExecutor(max_workers=max(1, min(EXEC_PARALLEL, len(todo)))) as pool:
                for first in range(0, len(todo), EXEC_PARALLEL):
                    window = todo[first:first + EXEC_PARALLEL]
                    for f, got in zip(window, [pool.submit(self.kubectl.logs, f.name, f.role) for f in window]):
                        try:
                            text = got.result()
                        except KubectlError as e:
                            problems.append(str(e))
                            continue
                        out = [ln for ln in text.splitlines() if _own_line(ln, f)]
                        for ln in out[len(out) - lines:] if lines is not None else out:  # -n 0: none (out[-0:] is all)
                            on_line(f.name, "out", ln)
            if problems:
                raise JobError("logs incomplete:\n" + "\n".join(problems))
            return 0
        # nothing left to wait for: every wanted process without a pod is one whose Job says it ended (pod gone)
        def settled(seen, jobs) -> bool:
            return len(gone(seen, jobs)) == sum(1 for key in wanted if key not in seen)

        return self._follow(on_line, selected, lines, settled)

    def _follow(self, on_line: LineCallback, selected, lines: int | None, settled) -> int:
        """One thread per pod once its container runs; until every selected pod ended (or the job is gone)."""
        lock = threading.Lock()
        threads: dict[str, threading.Thread] = {}
        errors: list[str] = []
        followers: set[subprocess.Popen] = set()  # the `kubectl logs -f` running now, ended on the way out
        closing = threading.Event()

        def emit(pod: str, line: str) -> None:
            with lock:
                on_line(pod, "out", line)

        def follow_pod(f: PodFacts) -> None:
            seen = 0  # container log lines read so far: a restarted `kubectl logs -f` skips them
            if lines is not None:  # the last LINES process lines first, then what comes after them
                try:
                    text = self.kubectl.logs(f.name, f.role)
                except KubectlError as e:
                    errors.append(str(e))
                    return
                all_lines = text.splitlines()
                seen = len(all_lines)
                for ln in deque((ln for ln in all_lines if _own_line(ln, f)), maxlen=lines):
                    emit(f.name, ln)
            while True:
                with lock:
                    if closing.is_set():
                        return
                    proc = self.kubectl.follow(f.name, f.role)
                    followers.add(proc)
                n = 0
                for raw in proc.stdout:
                    n += 1
                    if n <= seen:
                        continue
                    seen = n
                    ln = raw.decode("utf-8", "replace").rstrip("\n")
                    if _own_line(ln, f):
                        emit(f.name, ln)
                proc.wait()
                with lock:
                    followers.discard(proc)
                if closing.is_set():  # ended on the way out (below): nothing to say
                    return
                err = self.kubectl.stderr_tail(proc)
                try:
                    _, pods = self._snapshot()
                except KubectlError as e:
                    errors.append(str(e))
                    return
                now = next((g for g, _ in _newest(pods).values() if g.name == f.name), None)
                if now is None or now.phase != "running":
                    if proc.returncode != 0 and now is not None and now.phase != "ended":
                        errors.append(f"kubectl logs -f {f.name}: {_tail_line(err) or 'exit %d' % proc.returncode}")
                    return
                time.sleep(FOLLOW_POLL_S)  # the stream ended while the container runs: follow it again

        try:
            while True:
                jobs, pods = self._snapshot()
                seen = _newest(pods)
                targets = selected(seen)
                for f in targets:
                    if f.name not in threads and f.phase in ("running", "ended", "deleting"):
                        t = threading.Thread(target=follow_pod, args=(f,), daemon=True, name=f"logs {f.name}")
                        threads[f.name] = t
                        t.start()
                waiting = [f for f in targets if f.name not in threads and f.phase == "waiting"]
                if not waiting and all(not t.is_alive() for t in threads.values()):
                    if threads or not jobs or settled(seen, jobs):
                        break
                time.sleep(FOLLOW_POLL_S)
        finally:  # Ctrl+C or an error: no `kubectl logs -f` outlives the command
            with lock:
                closing.set()
                left = list(followers)
            for proc in left:
                if proc.poll() is None:
                    proc.kill()  # a log stream: nothing to end gracefully
                proc.wait()
        if errors:
            raise JobError("logs incomplete:\n" + "\n".join(errors))
        return 0

    def top_asks(self, request) -> list:
        """One TopAsk per process (a pod each): its supervisor's `agent top` through `kubectl exec` while the pod
        runs; a pod not started, ended or gone is a row that says so. The pods are read once a refresh."""
        from functools import partial

        from ..k8s import object_name
        from ..ops.top import TopAsk

        pods = _Cached(self._snapshot, TOP_PODS_TTL_S)
        limit = threading.BoundedSemaphore(EXEC_PARALLEL)
        name = object_name(self.spec)
        return [TopAsk((f"{name}-{role}-{i}",), partial(self._top_pod, pods, limit, role, i, request))
                for role, n in self._expected().items() for i in range(n)]

    def _top_pod(self, pods: "_Cached", limit, role: str, i: int, request) -> dict:
        from ..k8s import object_name
        from ..ops.top import TopAnswer, answer_of

        try:
            jobs, items = pods.get()
        except KubectlError as e:
            return {f"{object_name(self.spec)}-{role}-{i}": TopAnswer(time.monotonic(), "unreachable", error=str(e))}
        got = _newest(items).get((role, i))
        now = time.monotonic()
        job = _jobs_by_role(jobs, self._expected()).get(role)
        outcome = job.outcome(i) if got is None and job is not None else None
        if outcome is not None:  # the pod is gone, its Job says how it ended: a row of the process, no figures
            state, note = outcome
            done = ProcState.EXITED if state == JobState.SUCCEEDED else ProcState.FAILED
            return {f"{object_name(self.spec)}-{role}-{i}": TopAnswer(now, "ok", {
                "state": state, "top_error": note, "processes": [{"role": role, "id": i, "state": done}]})}
        if got is None:
            return {f"{object_name(self.spec)}-{role}-{i}": TopAnswer(
                now, "waiting" if jobs else "no job", error="no pod yet" if jobs else "no pod",
                state=JobState.STARTING if jobs else JobState.NOT_RUNNING)}
        f = got[0]
        if f.phase == "waiting":
            why = f"{f.waiting or 'pending'}: {f.message}".strip(": ")
            return {f.name: TopAnswer(now, "waiting", error=f"not started ({why})", state=JobState.STARTING)}
        if f.phase == "deleting":
            return {f.name: TopAnswer(now, "no job", error="pod being deleted", state=JobState.STOPPING)}
        if f.phase == "ended":  # its supervisor's last status: the processes' rows, no figures
            return {f.name: TopAnswer(now, "ok", _ended_view(f))}
        argv = self._agent(*request.agent_args(self._jobdir()))
        with limit:
            try:
                res = self.kubectl.exec(f.name, f.role, argv, timeout=request.deadline(KUBECTL_TIMEOUT))
            except KubectlError as e:
                return {f.name: TopAnswer(time.monotonic(), "unreachable", error=str(e))}
        data = _parse_reply(res.stdout)
        if data is None:
            why = _tail_line(res.stderr.decode("utf-8", "replace")) or f"exit {res.returncode}, no reply"
            return {f.name: TopAnswer(time.monotonic(), "unreachable", error=f"kubectl exec {f.name}: {why}")}
        # a pod speaks for its own process only (as in `status`: fold_status)
        return {f.name: answer_of(data, exit_code=res.returncode, placed=frozenset({(role, i)}))}

    def stop(self, *, grace: float | None = None) -> StopReport:
        """Each running pod's supervisor stops its processes (`agent stop`: SIGTERM, SIGKILL after grace, the
        sweep), then the job's objects are deleted (the pods with their Jobs). Idempotent."""
        g = self.plan.grace if grace is None else grace
        items = self.kubectl.get(KINDS, self.selector)
        ns = self.spec.kubernetes.namespace
        if not items:
            return StopReport(job=self.plan.job, was_running=False, detail=f"no objects in namespace {ns}")
        pods = [i for i in items if i.get("kind") == "Pod"]
        running = [f for f, _ in _newest(pods).values() if f.phase == "running"]
        replies = self._ask(running, self._agent("stop", self._jobdir(), "--grace", f"{g:g}", "--job", self.plan.job),
                            g + 60)
        self._delete()
        done = {pod: data for pod, (data, _) in replies.items() if data is not None}
        missing = [f"{pod}: {why}" for pod, (data, why) in replies.items() if data is None]
        kinds = sorted({k for i in items if isinstance(k := i.get("kind"), str)})
        detail = f"deleted {', '.join(kinds)} in namespace {ns}"
        if missing:
            detail += "; no stop report from " + "; ".join(missing)
        return StopReport(
            job=self.plan.job,
            was_running=any(d.get("was_running") for d in done.values()) or bool(running),
            hosts=len(done),
            killed=killed_count(done.values()),
            left={pod: d["left"] for pod, d in done.items() if d.get("left")},
            detail=detail,
        )


class _Cached:
    """A value fetched at most once per `ttl` seconds, whoever asks (top's requests share one `kubectl get`)."""

    def __init__(self, fetch, ttl: float):
        self._fetch, self._ttl, self._lock = fetch, ttl, threading.Lock()
        self._at, self._value = -math.inf, None

    def get(self):
        """The value, fetched again when older than ttl (a failed fetch raises, and the next get tries again)."""
        with self._lock:
            if time.monotonic() - self._at > self._ttl:
                self._value = self._fetch()
                self._at = time.monotonic()
            return self._value


def _own_line(line: str, f: PodFacts) -> bool:
    """A process line of pod `f` in its log (not the supervisor's own lines)."""
    m = LOG_LINE.match(line)
    return bool(m) and m["pod"] == f.name and m["role"] == f.role and int(m["id"]) == f.id
