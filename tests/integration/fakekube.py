"""A fake `kubectl` for the Kubernetes backend's tests: exactly the commands clusterctl/backends/kubernetes.py
runs, played over Docker containers on this machine (there is no Kubernetes API server here).

    kubectl [--context C] --namespace NS create -f -          (a JSON List, or YAML documents, on stdin)
    kubectl [--context C] --namespace NS get KINDS -l K=V -o json
    kubectl [--context C] --namespace NS exec POD -c CONTAINER -- ARGV...
    kubectl [--context C] --namespace NS logs [-f] POD -c CONTAINER
    kubectl [--context C] --namespace NS delete KINDS -l K=V --cascade=foreground --wait=true
            --ignore-not-found=true --timeout=Ns

Anything else is refused (exit 2, "fakekube: unsupported ..."), so a backend that starts to rely on more is
caught. State lives in $FAKEKUBE_DIR; pods' containers join the docker network $FAKEKUBE_NETWORK.

What a pod is here (what the kubelet and the Job controller would do, as far as this backend relies on it):
- Creating an Indexed Job creates its pods at once: pod `<job>-<i>-<5 random chars>`, hostname `<job>-<i>`,
  the completion index as annotation and label; a "kubelet" process per pod (this file, `kubelet NS POD`,
  detached) then plays the pod: a pause container holds the pod's network namespace and its DNS names
  (`<hostname>.<subdomain>`, `.<ns>.svc`, `.<ns>.svc.cluster.local`: docker network aliases), the init
  containers run in turn, then the main container, each `docker run --network container:<pause>`, with the
  environment the kubelet computes (clusterctl.k8s.pod_env: `$(VAR)` expansion, fieldRefs, secretKeyRef from
  the stored Secret; docker gets it as a 0600 --env-file, never in argv), the container's command and args as
  `--entrypoint` and arguments, the volumes as bind mounts (configMap items written as files, read-only,
  defaultMode applied; emptyDir a fresh directory; hostPath with type Directory checked), and the termination
  message file bind-mounted at terminationMessagePath and read back (4096 bytes) when the container ends.
- An image that is not in the local docker daemon is never pulled: the pod waits with ErrImageNeverPull (or
  ErrImagePull). A container asking for a GPU resource leaves the pod Unschedulable.
- Pods are never retried: only Jobs with backoffLimitPerIndex: 0 are accepted (what the backend renders).
- Deleting a Job (--cascade=foreground) deletes its pods: `docker stop -t <terminationGracePeriodSeconds>` of
  the main container (SIGTERM to its PID 1, SIGKILL after the grace), then every container of the pod is removed.
- `exec` is `docker exec` into the running main container (the container's environment, like the runtime's);
  `logs` is `docker logs` with stderr merged into stdout, as the kubelet keeps them.

Why one file of about 700 lines: `kubectl` on PATH is a two-line script importing this module, and the
per-pod "kubelet" is this same file run detached; the store, the verbs and the kubelet share the state layout
and the locking, and nothing else uses them.
"""

from __future__ import annotations

import base64
import fcntl
import hashlib
import json
import os
import random
import signal
import string
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

INDEX_ANNOTATION = "batch.kubernetes.io/job-completion-index"  # clusterctl.k8s's (imported by the kubelet only:
# every kubectl command starts a Python, and clusterctl.k8s brings the spec's pydantic models)

KINDS = {  # kubectl's names -> kind
    "job": "Job", "jobs": "Job", "pod": "Pod", "pods": "Pod", "service": "Service", "services": "Service",
    "configmap": "ConfigMap", "configmaps": "ConfigMap", "secret": "Secret", "secrets": "Secret",
}
RESOURCE = {"Job": "job.batch", "Pod": "pod", "Service": "service", "ConfigMap": "configmap", "Secret": "secret"}
CREATABLE = ("Secret", "ConfigMap", "Service", "Job")
DOCKER_TIMEOUT = 120


class Refused(Exception):
    """kubectl's error: printed on stderr, exit 1 (2 for a command this fake does not implement)."""

    def __init__(self, message: str, code: int = 1):
        super().__init__(message)
        self.code = code


def state_dir() -> Path:
    return Path(os.environ["FAKEKUBE_DIR"])


def tag() -> str:
    """This fake cluster's docker label value and container name prefix."""
    return hashlib.sha256(str(state_dir()).encode()).hexdigest()[:8]


def network() -> str:
    return os.environ["FAKEKUBE_NETWORK"]


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def _write_json(path: Path, obj) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
    with os.fdopen(fd, "w") as f:
        json.dump(obj, f)
    os.replace(tmp, path)


def _read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, ValueError):
        return None


def docker(*args: str, check: bool = True, timeout: float = DOCKER_TIMEOUT) -> subprocess.CompletedProcess:
    res = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout)
    if check and res.returncode != 0:
        raise Refused(f"fakekube: docker {args[0]} failed: {res.stderr.strip()[-300:]}")
    return res


# ------------------------------------------------------------------------------------------ the store


def ns_dir(ns: str) -> Path:
    return state_dir() / "ns" / ns


def obj_path(ns: str, kind: str, name: str) -> Path:
    return ns_dir(ns) / "objects" / kind / f"{name}.json"


def pod_dir(ns: str, pod: str) -> Path:
    return ns_dir(ns) / "pods" / pod


def stored(ns: str, kind: str) -> list[dict]:
    if kind == "Pod":
        return [p for p in (_read_json(d / "pod.json") for d in sorted((ns_dir(ns) / "pods").glob("*"))) if p]
    return [o for o in (_read_json(p) for p in sorted((ns_dir(ns) / "objects" / kind).glob("*.json"))) if o]


def matches(obj: dict, selector: str | None) -> bool:
    if not selector:
        return True
    labels = obj.get("metadata", {}).get("labels") or {}
    for term in selector.split(","):
        key, _, value = term.partition("=")
        if labels.get(key) != value:
            return False
    return True


def container_name(pod: str, container: str | None = None) -> str:
    return f"fk-{tag()}-{pod}" + (f"-{container}" if container else "")


@contextmanager
def pod_lock(ns: str, pod: str):
    d = pod_dir(ns, pod)
    try:
        f = open(d / "lock", "w")
    except FileNotFoundError:  # deleted meanwhile
        raise _Stop() from None
    with f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def deleted(ns: str, pod: str) -> bool:
    d = pod_dir(ns, pod)
    return (d / "deleted").exists() or not (d / "pod.json").exists()


def journal(argv: list[str]) -> None:
    """Every kubectl command line, for the tests (a secret must never be in one)."""
    with open(state_dir() / "journal.jsonl", "a") as f:
        f.write(json.dumps(argv) + "\n")


# ------------------------------------------------------------------------------------------- create


def _docs(text: str) -> list[dict]:
    text = text.strip()
    if text.startswith("{"):
        data = json.loads(text)
        return data["items"] if data.get("kind") == "List" else [data]
    import yaml

    return [d for d in yaml.safe_load_all(text) if d]


def cmd_create(ns: str, args: list[str]) -> int:
    if args != ["-f", "-"]:
        raise Refused(f"fakekube: unsupported: create {' '.join(args)}", 2)
    docs = _docs(sys.stdin.read())
    out = []
    for doc in docs:
        kind, name = doc.get("kind"), doc.get("metadata", {}).get("name")
        if kind not in CREATABLE:
            raise Refused(f"fakekube: unsupported kind {kind}", 2)
        if doc["metadata"].get("namespace", ns) != ns:
            raise Refused(f'error: the namespace from the provided object "{doc["metadata"]["namespace"]}" does not '
                          f'match the namespace "{ns}". You must pass \'--namespace={doc["metadata"]["namespace"]}\' '
                          "to perform this operation.")
        path = obj_path(ns, kind, name)
        if path.exists():
            raise Refused(f'Error from server (AlreadyExists): error when creating "STDIN": '
                          f'{RESOURCE[kind].split(".")[0]}s "{name}" already exists')
        if kind == "Job":
            _check_job(doc)
        doc = json.loads(json.dumps(doc))
        doc["metadata"].update(namespace=ns, creationTimestamp=_now(), uid=os.urandom(8).hex())
        path.parent.mkdir(parents=True, exist_ok=True)
        _write_json(path, doc)
        if kind == "Job":
            _create_pods(ns, doc)
        out.append(f"{RESOURCE[kind]}/{name} created")
    print("\n".join(out))
    return 0


def _check_job(job: dict) -> None:
    spec = job["spec"]
    if spec.get("completionMode") != "Indexed" or spec.get("backoffLimitPerIndex") != 0:
        raise Refused("fakekube: only Indexed Jobs with backoffLimitPerIndex: 0 are played (pods never retried)", 2)
    if spec.get("parallelism", spec["completions"]) != spec["completions"]:
        raise Refused("fakekube: parallelism must equal completions (all pods at once)", 2)
    if spec["template"]["spec"].get("restartPolicy") != "Never":
        raise Refused("fakekube: only restartPolicy: Never is played", 2)
    if len(spec["template"]["spec"]["containers"]) != 1:
        raise Refused("fakekube: one container per pod", 2)


def _create_pods(ns: str, job: dict) -> None:
    name = job["metadata"]["name"]
    template = job["spec"]["template"]
    for i in range(job["spec"]["completions"]):
        pod_name = f"{name}-{i}-" + "".join(random.choices(string.ascii_lowercase + string.digits, k=5))
        labels = dict(template["metadata"].get("labels") or {})
        labels.update({"batch.kubernetes.io/job-name": name, "job-name": name,
                       "batch.kubernetes.io/job-completion-index": str(i)})
        pod = {
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": pod_name, "namespace": ns, "labels": labels, "uid": os.urandom(8).hex(),
                         "annotations": {INDEX_ANNOTATION: str(i)}, "creationTimestamp": _now(),
                         "ownerReferences": [{"apiVersion": "batch/v1", "kind": "Job", "name": name}]},
            "spec": {**template["spec"], "hostname": f"{name}-{i}"},
            "status": {"phase": "Pending"},
        }
        d = pod_dir(ns, pod_name)
        d.mkdir(parents=True)
        _write_json(d / "pod.json", pod)
        log = open(d / "kubelet.log", "ab")
        proc = subprocess.Popen([sys.executable, __file__, "kubelet", ns, pod_name], stdin=subprocess.DEVNULL,
                                stdout=log, stderr=log, start_new_session=True, env=os.environ.copy())
        (d / "kubelet.pid").write_text(str(proc.pid))


# ---------------------------------------------------------------------------------------------- get


def _job_status(ns: str, job: dict) -> dict:
    pods = [p for p in stored(ns, "Pod")
            if any(o.get("name") == job["metadata"]["name"] for o in p["metadata"].get("ownerReferences", []))]
    phases = [p["status"].get("phase") for p in pods]
    status = {"active": sum(ph in ("Pending", "Running") for ph in phases), "succeeded": phases.count("Succeeded"),
              "failed": phases.count("Failed")}
    if status["succeeded"] == job["spec"]["completions"]:
        status["conditions"] = [{"type": "Complete", "status": "True"}]
    elif status["failed"] and not status["active"]:
        status["conditions"] = [{"type": "Failed", "status": "True", "reason": "FailedIndexes"}]
    return status


def cmd_get(ns: str, args: list[str]) -> int:
    if len(args) != 5 or args[1] != "-l" or args[3:] != ["-o", "json"]:
        raise Refused(f"fakekube: unsupported: get {' '.join(args)}", 2)
    items = []
    for word in args[0].split(","):
        if word not in KINDS:
            raise Refused(f'error: the server doesn\'t have a resource type "{word}"')
        kind = KINDS[word]
        for obj in stored(ns, kind):
            if matches(obj, args[2]):
                if kind == "Job":
                    obj["status"] = _job_status(ns, obj)
                items.append(obj)
    json.dump({"apiVersion": "v1", "kind": "List", "items": items}, sys.stdout)
    sys.stdout.write("\n")
    return 0


# --------------------------------------------------------------------------------------- exec, logs


def _pod(ns: str, pod: str) -> dict:
    obj = _read_json(pod_dir(ns, pod) / "pod.json")
    if obj is None:
        raise Refused(f'Error from server (NotFound): pods "{pod}" not found')
    return obj


def _running(name: str) -> bool:
    res = docker("inspect", "-f", "{{.State.Running}}", name, check=False)
    return res.returncode == 0 and res.stdout.strip() == "true"


def cmd_exec(ns: str, args: list[str]) -> int:
    if len(args) < 5 or args[1] != "-c" or args[3] != "--":
        raise Refused(f"fakekube: unsupported: exec {' '.join(args)}", 2)
    pod, container, argv = args[0], args[2], args[4:]
    obj = _pod(ns, pod)
    if obj["status"].get("phase") in ("Succeeded", "Failed"):
        raise Refused(f"error: cannot exec into a container in a completed pod; current phase is "
                      f"{obj['status']['phase']}")
    if not _running(container_name(pod, container)):
        raise Refused(f'error: unable to upgrade connection: container not found ("{container}")')
    res = subprocess.run(["docker", "exec", container_name(pod, container), *argv], stdin=subprocess.DEVNULL)
    if res.returncode != 0:
        print(f"command terminated with exit code {res.returncode}", file=sys.stderr)
    return res.returncode


def cmd_logs(ns: str, args: list[str]) -> int:
    follow = bool(args) and args[0] == "-f"
    rest = args[1:] if follow else args
    if len(rest) != 3 or rest[1] != "-c":
        raise Refused(f"fakekube: unsupported: logs {' '.join(args)}", 2)
    pod, container = rest[0], rest[2]
    _pod(ns, pod)
    name = container_name(pod, container)
    if docker("inspect", name, check=False).returncode != 0:
        raise Refused(f'Error from server (BadRequest): container "{container}" in pod "{pod}" is waiting to start: '
                      "PodInitializing")
    sys.stdout.flush()
    # one process, as kubectl is: a SIGTERM to `kubectl logs -f` ends the stream (a child would outlive it)
    os.dup2(1, 2)
    os.execvp("docker", ["docker", "logs", *(["-f"] if follow else []), name])


# ------------------------------------------------------------------------------------------- delete


def cmd_delete(ns: str, args: list[str]) -> int:
    if (len(args) != 7 or args[1] != "-l" or args[3:6] != ["--cascade=foreground", "--wait=true",
                                                            "--ignore-not-found=true"]
            or not args[6].startswith("--timeout=")):
        raise Refused(f"fakekube: unsupported: delete {' '.join(args)}", 2)
    out = []
    for word in args[0].split(","):
        if word not in KINDS or KINDS[word] == "Pod":
            raise Refused(f"fakekube: unsupported: delete {word}", 2)
        kind = KINDS[word]
        for obj in stored(ns, kind):
            if not matches(obj, args[2]):
                continue
            name = obj["metadata"]["name"]
            if kind == "Job":
                owned = [p["metadata"]["name"] for p in stored(ns, "Pod")
                         if any(o.get("name") == name for o in p["metadata"].get("ownerReferences", []))]
                import threading

                threads = [threading.Thread(target=delete_pod, args=(ns, p)) for p in owned]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
            obj_path(ns, kind, name).unlink(missing_ok=True)
            out.append(f'{RESOURCE[kind]} "{name}" deleted')
    print("\n".join(out))
    return 0


# run in a pod's main container just before its deletion (for the tests): pids carrying a CLUSTERCTL_JOB tag
SWEEP = """
import json, os
found = []
for pid in (p for p in os.listdir("/proc") if p.isdigit()):
    try:
        env = open("/proc/%s/environ" % pid, "rb").read().split(b"\\0")
    except OSError:
        continue
    if any(e.startswith(b"CLUSTERCTL_JOB=") for e in env):
        try:  # what it is, for a failed test to say: "pid argv..."
            argv = open("/proc/%s/cmdline" % pid, "rb").read().split(b"\\0")
        except OSError:
            argv = []
        found.append(" ".join([pid] + [a.decode("utf-8", "replace") for a in argv if a]))
print(json.dumps(found))
"""


def _sweep(container: str) -> dict:
    """The processes tagged with a job in a running container ({"tagged": [...]}), or {"running": False} when its
    PID 1 exits meanwhile: an exec into a container whose PID 1 is exiting fails while docker may still call it
    running for a moment, so a failed sweep is tried again until it succeeds or the container has stopped (5 s)."""
    deadline = time.monotonic() + 5
    while True:
        res = docker("exec", container, "python3", "-c", SWEEP, check=False)
        if res.returncode == 0:
            return {"tagged": json.loads(res.stdout)}
        if not _running(container):  # nothing runs in a stopped container
            return {"running": False}
        if time.monotonic() > deadline:
            return {"tagged": f"sweep failed: {res.stderr.strip()}"}
        time.sleep(0.2)


def delete_pod(ns: str, pod: str) -> None:
    """The kubelet's part of a pod's deletion: SIGTERM, SIGKILL after its grace, every container removed."""
    try:
        _delete_pod(ns, pod)
    except _Stop:
        pass


def _delete_pod(ns: str, pod: str) -> None:
    obj = _read_json(pod_dir(ns, pod) / "pod.json") or {}
    grace = int(obj.get("spec", {}).get("terminationGracePeriodSeconds", 30))
    main = obj.get("spec", {}).get("containers", [{}])[0].get("name")
    with pod_lock(ns, pod):
        (pod_dir(ns, pod) / "deleted").touch()
        obj.setdefault("metadata", {})["deletionTimestamp"] = _now()
        if (pod_dir(ns, pod) / "pod.json").exists():
            _write_json(pod_dir(ns, pod) / "pod.json", obj)
        running = bool(main) and _running(container_name(pod, main))
        record = {"pod": pod, "running": running, "tagged": []}
        if running:  # what the job left in the pod when Kubernetes starts deleting it (the tests' orphan check)
            record.update(_sweep(container_name(pod, main)))
        with open(state_dir() / "sweeps.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")
        if running:
            docker("stop", "-t", str(grace), container_name(pod, main), check=False, timeout=grace + 60)
        names = docker("ps", "-aq", "--filter", f"label=fakekube.pod={tag()}/{ns}/{pod}", check=False).stdout.split()
        if names:
            docker("rm", "-f", *names, check=False)
    pid_file = pod_dir(ns, pod) / "kubelet.pid"
    if pid_file.exists():
        try:
            os.kill(int(pid_file.read_text()), signal.SIGTERM)
        except ProcessLookupError:
            pass
    import shutil

    shutil.rmtree(pod_dir(ns, pod), ignore_errors=True)


# ------------------------------------------------------------------------------------------ kubelet


class _Stop(Exception):
    """The pod was deleted (or cannot go on): the kubelet process ends."""


def kubelet(ns: str, pod: str) -> int:
    """Play one pod: pause container, init containers, the main container; keep its status in pod.json."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    k = _Kubelet(ns, pod)
    try:
        k.run()
    except _Stop:
        pass
    except Refused as e:
        print(f"kubelet {pod}: {e}", flush=True)
    return 0


class _Kubelet:
    def __init__(self, ns: str, pod: str):
        self.ns, self.pod = ns, pod
        self.dir = pod_dir(ns, pod)
        self.obj = _read_json(self.dir / "pod.json")
        if self.obj is None:
            raise _Stop()
        self.spec = self.obj["spec"]
        self.label = f"fakekube.pod={tag()}/{ns}/{pod}"

    def update(self, **status) -> None:
        with pod_lock(self.ns, self.pod):
            if deleted(self.ns, self.pod):
                raise _Stop()
            self.obj["status"].update(status)
            _write_json(self.dir / "pod.json", self.obj)

    def run_locked(self, *args: str) -> None:
        """A docker command that creates something: never for a pod being deleted."""
        with pod_lock(self.ns, self.pod):
            if deleted(self.ns, self.pod):
                raise _Stop()
            docker(*args)

    def waiting(self, reason: str, message: str, name: str | None = None) -> None:
        """The pod cannot go on (the kubelet would retry: here it stays so): container `name` waits for `reason`."""
        main = self.spec["containers"][0]["name"]
        name = name or main
        state = {"name": name, "ready": False, "restartCount": 0,
                 "state": {"waiting": {"reason": reason, "message": message}}}
        if name == main:
            self.update(containerStatuses=[state])
        else:  # an init container: the main one waits for it
            self.update(initContainerStatuses=[state], containerStatuses=[
                {"name": main, "ready": False, "restartCount": 0, "state": {"waiting": {"reason": "PodInitializing"}}}])
        raise _Stop()

    def secrets(self) -> dict:
        out = {}
        for s in stored(self.ns, "Secret"):
            for key, value in (s.get("data") or {}).items():
                out[s["metadata"]["name"], key] = base64.b64decode(value).decode()
            for key, value in (s.get("stringData") or {}).items():
                out[s["metadata"]["name"], key] = value
        return out

    def manifest(self) -> dict:
        """The pod as clusterctl.k8s.pod_env reads a Job: its template's spec, the Job's name and namespace."""
        job = self.obj["metadata"]["labels"]["job-name"]
        return {"metadata": {"name": job, "namespace": self.ns}, "spec": {"template": {"spec": self.spec}}}

    def env_file(self, container: dict, ip: str) -> tuple[Path, dict]:
        from clusterctl.k8s import pod_env

        index = int(self.obj["metadata"]["annotations"][INDEX_ANNOTATION])
        env = pod_env(self.manifest(), index, pod_ip=ip, pod_name=self.pod, secrets=self.secrets(),
                      container=container["name"])
        path = self.dir / f"env-{container['name']}"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            for k_, v in env.items():
                if "\n" in v:
                    raise Refused(f"fakekube: env {k_} has a newline (docker --env-file cannot carry it)")
                f.write(f"{k_}={v}\n")
        return path, env

    def volumes(self) -> dict[str, Path]:
        out = {}
        for vol in self.spec.get("volumes", []):
            host = self.dir / "volumes" / vol["name"]
            if "configMap" in vol:
                src = vol["configMap"]
                cm = _read_json(obj_path(self.ns, "ConfigMap", src["name"]))
                if cm is None:
                    self.waiting("ContainerCreating", f'configmap "{src["name"]}" not found')
                host.mkdir(parents=True)
                items = src.get("items") or [{"key": k_, "path": k_} for k_ in cm.get("data", {})]
                for item in items:
                    if item["key"] not in cm.get("data", {}):
                        self.waiting("ContainerCreating", f'configmap "{src["name"]}": no key {item["key"]}')
                    path = host / item["path"]
                    path.parent.mkdir(parents=True, exist_ok=True)
                    path.write_text(cm["data"][item["key"]])
                    path.chmod(item.get("mode", src.get("defaultMode", 0o644)))
            elif "emptyDir" in vol:
                host.mkdir(parents=True)
                host.chmod(0o777)
            elif "hostPath" in vol:
                host = Path(vol["hostPath"]["path"])
                if vol["hostPath"].get("type") == "Directory" and not host.is_dir():
                    self.waiting("ContainerCreating", f"hostPath type check failed: {host} is not a directory")
            else:
                raise Refused(f"fakekube: unsupported volume {vol}", 2)
            out[vol["name"]] = host
        return out

    def run_args(self, container: dict, ip: str, vols: dict[str, Path], term: Path | None) -> list[str]:
        from clusterctl.k8s import expand

        env_path, env = self.env_file(container, ip)
        argv = [expand(a, env) for a in container.get("command", []) + container.get("args", [])]
        if not container.get("command"):
            raise Refused("fakekube: a container without command is not played", 2)
        run = ["run", "-d", "--name", container_name(self.pod, container["name"]), "--label", f"fakekube={tag()}",
               "--label", self.label, "--network", f"container:{container_name(self.pod)}", "--env-file", str(env_path)]
        if container.get("workingDir"):
            run += ["-w", container["workingDir"]]
        for m in container.get("volumeMounts", []):
            src = vols[m["name"]] / m.get("subPath", "")
            run += ["-v", f"{src}:{m['mountPath']}" + (":ro" if m.get("readOnly") else "")]
        if term is not None:
            term.touch()
            term.chmod(0o666)
            run += ["-v", f"{term}:{container.get('terminationMessagePath', '/dev/termination-log')}"]
        return [*run, "--entrypoint", argv[0], container["image"], *argv[1:]]

    def run(self) -> None:
        containers = self.spec["containers"]
        for c in self.spec.get("initContainers", []) + containers:
            limits = (c.get("resources") or {}).get("limits") or {}
            if any("gpu" in name for name in limits):
                self.update(conditions=[{"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                                         "message": "0/1 nodes are available: 1 Insufficient "
                                                    + next(n for n in limits if "gpu" in n) + "."}])
                raise _Stop()
        self.update(conditions=[{"type": "PodScheduled", "status": "True"}])
        for c in self.spec.get("initContainers", []) + containers:
            if docker("image", "inspect", c["image"], check=False).returncode != 0:
                reason = "ErrImageNeverPull" if c.get("imagePullPolicy") == "Never" else "ErrImagePull"
                self.waiting(reason, f'image "{c["image"]}" is not present here (fakekube never pulls)', c["name"])
        vols = self.volumes()
        subdomain = self.spec.get("subdomain")
        hostname = self.spec["hostname"]
        aliases = []
        if subdomain:
            aliases = [f"{hostname}.{subdomain}", f"{hostname}.{subdomain}.{self.ns}.svc",
                       f"{hostname}.{subdomain}.{self.ns}.svc.cluster.local"]
        pause = ["run", "-d", "--name", container_name(self.pod), "--label", f"fakekube={tag()}", "--label", self.label,
                 "--hostname", hostname, "--network", network()]
        for a in aliases:
            pause += ["--network-alias", a]
        self.run_locked(*pause, "--entrypoint", "sleep", containers[0]["image"], "infinity")
        ip = docker("inspect", "-f", "{{range .NetworkSettings.Networks}}{{.IPAddress}}{{end}}",
                    container_name(self.pod)).stdout.strip()
        self.update(podIP=ip)
        inits = self.spec.get("initContainers", [])
        statuses = [{"name": c["name"], "state": {"waiting": {"reason": "PodInitializing"}}} for c in inits]
        for n, c in enumerate(inits):
            try:
                self.run_locked(*self.run_args(c, ip, vols, None))
            except ValueError as e:  # pod_env: a Secret or key that is not there
                self.waiting("CreateContainerConfigError", str(e), c["name"])
            statuses[n] = {"name": c["name"], "state": {"running": {"startedAt": _now()}}}
            self.update(initContainerStatuses=statuses, containerStatuses=[
                {"name": containers[0]["name"], "state": {"waiting": {"reason": "PodInitializing"}}}])
            code = int(docker("wait", container_name(self.pod, c["name"]), timeout=86400).stdout.strip() or 1)
            statuses[n] = {"name": c["name"], "state": {"terminated": {
                "exitCode": code, "reason": "Completed" if code == 0 else "Error", "finishedAt": _now()}}}
            if code != 0:
                self.update(phase="Failed", initContainerStatuses=statuses)
                self.teardown()
                return
            self.update(initContainerStatuses=statuses)
        main = containers[0]
        term = self.dir / f"termination-{main['name']}"
        try:
            args = self.run_args(main, ip, vols, term)
        except ValueError as e:
            self.waiting("CreateContainerConfigError", str(e))
        self.run_locked(*args)
        started = _now()
        self.update(phase="Running", containerStatuses=[{"name": main["name"], "ready": True, "restartCount": 0,
                                                         "state": {"running": {"startedAt": started}}}])
        code = int(docker("wait", container_name(self.pod, main["name"]), timeout=86400).stdout.strip() or 1)
        message = term.read_bytes()[:4096].decode("utf-8", "replace") if term.exists() else ""
        self.update(phase="Succeeded" if code == 0 else "Failed", containerStatuses=[
            {"name": main["name"], "ready": False, "restartCount": 0, "state": {"terminated": {
                "exitCode": code, "reason": "Completed" if code == 0 else "Error", "message": message,
                "startedAt": started, "finishedAt": _now()}}}])
        self.teardown()

    def teardown(self) -> None:
        """The pod's sandbox goes (its IP and DNS names); its containers stay for `kubectl logs`."""
        with pod_lock(self.ns, self.pod):
            docker("rm", "-f", container_name(self.pod), check=False)


# --------------------------------------------------------------------------------------------- main


def main(argv: list[str]) -> int:
    if argv[:1] == ["kubelet"]:
        return kubelet(argv[1], argv[2])
    journal(["kubectl", *argv])
    args = list(argv)
    if args[:1] == ["--context"]:
        args = args[2:]
    if args[:1] != ["--namespace"] or len(args) < 3:
        print(f"fakekube: unsupported: {' '.join(argv)} (expected [--context C] --namespace NS VERB ...)", file=sys.stderr)
        return 2
    ns, verb, rest = args[1], args[2], args[3:]
    verbs = {"create": cmd_create, "get": cmd_get, "exec": cmd_exec, "logs": cmd_logs, "delete": cmd_delete}
    try:
        if verb not in verbs:
            raise Refused(f"fakekube: unsupported verb {verb}", 2)
        return verbs[verb](ns, rest)
    except Refused as e:
        sys.stdout.flush()
        print(str(e), file=sys.stderr)
        return e.code


def install(bin_dir: Path) -> Path:
    """Write `kubectl` (this fake, run by this Python) into bin_dir; return its path."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    path = bin_dir / "kubectl"
    path.write_text(f"#!{sys.executable}\nimport sys\nsys.path.insert(0, {str(Path(__file__).parent)!r})\n"
                    "from fakekube import main\nsys.exit(main(sys.argv[1:]))\n")
    path.chmod(0o755)
    return path


def cleanup() -> None:
    """Remove every container of this fake cluster and stop its kubelets (the fixture's teardown)."""
    for pid_file in state_dir().glob("ns/*/pods/*/kubelet.pid"):
        try:
            os.kill(int(pid_file.read_text()), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass
    names = docker("ps", "-aq", "--filter", f"label=fakekube={tag()}", check=False).stdout.split()
    if names:
        docker("rm", "-f", *names, check=False)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
