"""Kubernetes objects from a cluster spec: the job's Secret and ConfigMap, a headless Service, one Indexed Job per role.

One pod per process, and in every pod the same host supervisor as over SSH (clusterctl/host): the pod's main
process is clusterctl/host/pod.py, run by the image's ``python3 -S -E`` from the host package that the
ConfigMap carries; it builds the pod's job file from the job's template (also in the ConfigMap) and the
pod's environment, then runs `agent run` in the foreground. The job's token is in a Secret, read by the
pod through `valueFrom.secretKeyRef` (never a literal in a manifest, never in argv).

A pod's id is its completion index (the `batch.kubernetes.io/job-completion-index` annotation the Job
controller sets); every other variable of the environment contract (GUIDE section 2) is either the same for
every pod of a role or built from that index with Kubernetes' own `$(VAR)` expansion, so the manifests hold
no per-pod copy of anything. Endpoints are the pods' stable DNS names, `<name>-<role>-<index>.<service>`:
Indexed Jobs give pod `i` the hostname `<job>-<i>`, and the pod's `subdomain` (the headless Service) puts
that name in the cluster's DNS. The coordinator of the supervisors is trainer 0's pod.

Pure: nothing here talks to a cluster (clusterctl/backends/kubernetes.py does, through kubectl). `pod_env`
and `pod_argv` show what the kubelet gives a pod of a rendered Job, by the same rules (docs/kubernetes.md).
"""

from __future__ import annotations

import argparse
import base64
import math
import secrets
from pathlib import Path

import yaml

from .errors import ClusterctlError, SpecError, SpecProblem, UsageError
from .host import pod as hostpod
from .host.layout import endpoints_left_out, exec_string_fits
from .plan import make_plan
from .spec import ClusterSpec
from .spec.backends import HOST_MOUNT, STATE_MOUNT
from .backends.k8s_content import (CONFIGMAP_LIMIT, INDEX_ANNOTATION, PYCACHE, STATE_ROOT, TEMPLATE_KEY, TERMINATION_LOG,
                                   WAIT_DEFAULT_S, K8sShape, k8s_configmap_data, k8s_container_env, k8s_endpoints,
                                   k8s_escape, k8s_host_package, k8s_own_env, k8s_placeholders, k8s_shape,
                                   kubernetes_problems)
from .spec.checks import k8s_object_name

__all__ = [
    "INDEX_ANNOTATION", "LABEL_JOB", "LABEL_ROLE", "HOST_MOUNT", "STATE_MOUNT", "STATE_ROOT", "TEMPLATE_KEY",
    "CONFIGMAP_LIMIT", "WAIT_DEFAULT_S", "object_name", "names", "jobdir", "host_tool_argv", "render", "dump",
    "expand", "pod_env", "pod_argv", "process_argv", "add_cli",
]

LABEL_JOB = "clusterctl.io/job"
LABEL_ROLE = "clusterctl.io/role"

HOST_PACKAGE = "clusterctl_host"  # the host package's name in a pod, as on SSH hosts (ops/hosttools.py)
# HOST_MOUNT, the ConfigMap: <HOST_MOUNT>/clusterctl_host/*.py and <HOST_MOUNT>/template.json; STATE_MOUNT, an
# emptyDir: the job dir (job file, state, logs) and the bytecode cache (clusterctl.spec.backends: a workspace's
# mount_path is refused there). What the pods' env, args and ConfigMap hold, and the constants above the objects
# (TEMPLATE_KEY, STATE_ROOT, PYCACHE, TERMINATION_LOG, CONFIGMAP_LIMIT, WAIT_DEFAULT_S, INDEX_ANNOTATION), are
# clusterctl.backends.k8s_content's, which checks their sizes whenever a spec with the section is loaded.
TOKEN_KEY = "token"
# terminationGracePeriodSeconds = job.grace + this: the supervisor's own stop (SIGTERM, job.grace, SIGKILL, the
# sweep) and the termination message fit in it before the kubelet kills what is left
STOP_MARGIN_S = 10

# The init container's program (python3 of the job's image): wait until every name in argv[1] (comma
# separated) resolves and every HOST:PORT in argv[2] accepts a TCP connection, for at most argv[3]
# seconds. A pod's DNS name exists only once the pod has an IP: the pod waits for its own name (its
# coordinator binds to it) and the coordinator's (its supervisor connects to it) before its supervisor starts.
WAIT_SCRIPT = """\
import socket, sys, time
names, eps = [n for n in sys.argv[1].split(",") if n], [e for e in sys.argv[2].split(",") if e]
deadline = time.monotonic() + float(sys.argv[3])
while True:
    try:
        for n in names:
            socket.getaddrinfo(n, None)
        for e in eps:
            h, p = e.rsplit(":", 1)
            socket.create_connection((h, int(p)), timeout=2).close()
        break
    except OSError as exc:
        if time.monotonic() > deadline:
            sys.exit("clusterctl: gave up after %ss waiting for %s: %s" % (sys.argv[3], sys.argv[1:3], exc))
        time.sleep(1)
"""
def object_name(spec: ClusterSpec) -> str:
    """The prefix of every object's name: `kubernetes.name`, else the spec's name as a DNS label."""
    return k8s_object_name(spec)


def names(spec: ClusterSpec) -> dict[str, str]:
    """The objects' names: `service`, `secret`, `configmap`, and `job:<role>` for each role's Job."""
    name = object_name(spec)
    return {"service": name, "secret": f"{name}-token", "configmap": f"{name}-host",
            "job:pserver": f"{name}-pserver", "job:trainer": f"{name}-trainer"}


def jobdir(spec: ClusterSpec) -> str:
    """The job dir inside every pod (the supervisor's state, the job file, the processes' logs)."""
    return f"{STATE_ROOT}/{spec.name}"


def _python(spec: ClusterSpec) -> list[str]:
    # -S -E: nothing of the image's site-packages or PYTHON* variables; bytecode in the emptyDir (the ConfigMap is
    # read-only)
    return [spec.kubernetes.python, "-S", "-E", "-X", f"pycache_prefix={PYCACHE}"]


def host_tool_argv(spec: ClusterSpec, module: str, args: list[str]) -> list[str]:
    """The argv that runs host module `module` (e.g. 'agent') of the ConfigMap's host package in a pod."""
    return [*_python(spec), "-c", hostpod.RUN, HOST_MOUNT, f"{HOST_PACKAGE}.{module}", *args]


def host_package() -> dict[str, str]:
    """Every module of the host package (clusterctl/host), by file name: the ConfigMap's data."""
    return k8s_host_package()


def render(spec: ClusterSpec, *, token: str | None = None) -> list[dict]:
    """The Secret, the ConfigMap, the Service and the Jobs (pservers first, then trainers) for `spec`;
    SpecError when it cannot be. `token`: the job's secret (default: a new random one)."""
    if spec.kubernetes is None:
        raise _problem(spec, ("kubernetes",), "the spec has no kubernetes: section (at least kubernetes.image)")
    # every refusal is kubernetes_problems', which loading the spec made already (validate, plan and start say the
    # same): here for a spec built in code, which was not loaded
    found = kubernetes_problems(spec)
    if found:
        raise SpecError([p for path, message in found for p in _problem(spec, path, message).problems])
    make_plan(spec)  # its layout's errors (the plan is not needed: the pods are counted as it counts them)
    shape = k8s_shape(spec)
    jobs = []
    if shape.pservers:
        jobs.append(_job(spec, shape, "pserver", shape.pservers, spec.job.ports.pserver, 0))
    jobs.append(_job(spec, shape, "trainer", shape.trainers, spec.job.ports.trainer, shape.gpus))
    configmap = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": _meta(spec, shape.name, names(spec)["configmap"]),
                 "immutable": True, "data": k8s_configmap_data(spec, shape)}
    return [_secret(spec, shape.name, token or secrets.token_hex(16)), configmap,
            _service(spec, shape.name, shape.pservers > 0), *jobs]


def notes(spec: ClusterSpec, trainers: int) -> tuple[str, ...]:
    """What the user should know about the manifests `render` makes for `trainers` trainers, one line each."""
    trainer_eps = k8s_endpoints(object_name(spec), "trainer", trainers, spec.job.ports.trainer)
    if exec_string_fits("PADDLE_TRAINER_ENDPOINTS=" + trainer_eps):
        return ()
    return (endpoints_left_out(trainers, len(trainer_eps)),)


def _labels(name: str) -> dict:
    return {LABEL_JOB: name}


def _meta(spec: ClusterSpec, name: str, obj_name: str) -> dict:
    return {"name": obj_name, "namespace": spec.kubernetes.namespace, "labels": _labels(name)}


def _secret(spec: ClusterSpec, name: str, token: str) -> dict:
    """The job's token: read by every pod's main process (secretKeyRef), handed to the supervisor in its job file."""
    return {"apiVersion": "v1", "kind": "Secret", "metadata": _meta(spec, name, names(spec)["secret"]),
            "type": "Opaque", "immutable": True,
            "data": {TOKEN_KEY: base64.b64encode(token.encode("ascii")).decode("ascii")}}


def _service(spec: ClusterSpec, name: str, with_pservers: bool) -> dict:
    named = [("trainer", spec.job.ports.trainer), ("master", spec.job.ports.master), ("control", spec.job.ports.control)]
    if with_pservers:
        named.append(("pserver", spec.job.ports.pserver))
    ports: list[dict] = []
    for port_name, number in named:  # a Service lists each port number once (pods of two roles may share one)
        if all(p["port"] != number for p in ports):
            ports.append({"name": port_name, "port": number})
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(spec, name, name),
        "spec": {
            "clusterIP": "None",  # headless: DNS names for the pods, no virtual IP
            "publishNotReadyAddresses": True,  # names resolve as soon as pods have IPs, before any readiness
            "selector": _labels(name),
            "ports": ports,
        },
    }


def _job(spec: ClusterSpec, shape: K8sShape, role: str, count: int, port: int, gpus: int) -> dict:
    k, job, name = spec.kubernetes, spec.job, shape.name
    own = k8s_own_env(shape, role)
    env = k8s_container_env(spec, shape, role)
    env += [  # the main process's own: its pod's name and the job's token (never in the processes' environment)
        {"name": hostpod.POD_NAME_ENV, "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": hostpod.SECRET_ENV, "valueFrom": {"secretKeyRef": {"name": names(spec)["secret"], "key": TOKEN_KEY}}},
    ]
    id_var = own[0]["name"]
    placeholders = {k_: _escape(v) for k_, v in k8s_placeholders(spec, shape).items()}
    placeholders.update({"role": role, "id": f"$({id_var})", "trainer_id": f"$({id_var})",
                         "current_endpoint": "$(PADDLE_CURRENT_ENDPOINT)", "host": "$(POD_IP)"})
    glue = [*_python(spec), "-c", hostpod.RUN, HOST_MOUNT, f"{HOST_PACKAGE}.pod", "start",
            f"{HOST_MOUNT}/{TEMPLATE_KEY}", "--"]
    container: dict = {
        "name": role,
        "image": k.image,
        "command": [_escape(a) for a in glue],  # the pod's main process: clusterctl/host/pod.py, then the supervisor
        "args": [_escape(a) for a in job.entrypoint] + [_escape(a).format_map(placeholders) for a in job.args],
        "env": env,
        "ports": [{"name": role, "containerPort": port}]
        + ([{"name": "master", "containerPort": job.ports.master}] if role == "trainer" else []),
        "terminationMessagePath": TERMINATION_LOG,  # the supervisor's last status, once the pod ended
        "terminationMessagePolicy": "File",
    }
    if k.image_pull_policy:
        container["imagePullPolicy"] = k.image_pull_policy
    resources_ = {kind: dict(q) for kind, q in k.resources.get(role, {}).items()}
    if gpus:
        resources_.setdefault("limits", {})[k.gpu_resource] = str(gpus)
    if resources_:
        container["resources"] = resources_
    host_files = [{"key": f, "path": f"{HOST_PACKAGE}/{f}"} for f in host_package()]
    volumes: list[dict] = [
        {"name": "clusterctl-host", "configMap": {"name": names(spec)["configmap"], "defaultMode": 0o444,
                                                  "items": host_files + [{"key": TEMPLATE_KEY, "path": TEMPLATE_KEY}]}},
        {"name": "clusterctl-state", "emptyDir": {}},
    ]
    mounts: list[dict] = [
        {"name": "clusterctl-host", "mountPath": HOST_MOUNT, "readOnly": True},
        {"name": "clusterctl-state", "mountPath": STATE_MOUNT},
    ]
    pod: dict = {
        "restartPolicy": "Never",  # restarts are the supervisor's, inside the pod (job.restarts)
        "subdomain": name,  # with the hostname <job>-<index>: <name>-<role>-<index>.<name> in DNS
        "enableServiceLinks": False,  # no <SERVICE>_PORT variables beside the contract
        "terminationGracePeriodSeconds": math.ceil(job.grace) + STOP_MARGIN_S,
        "containers": [container],
    }
    if k.wait_timeout:
        names_ = f"$(POD_IP),{name}-trainer-0.{name}"  # its own name, the coordinator's
        pod["initContainers"] = [{
            "name": "wait",
            "image": k.image,
            "command": [_escape(k.python), "-c", _escape(WAIT_SCRIPT), names_, "", f"{k.wait_timeout:g}"],
            "env": own,
        }]
        if k.image_pull_policy:
            pod["initContainers"][0]["imagePullPolicy"] = k.image_pull_policy
    if k.workspace is not None:
        w = k.workspace
        source = ({"persistentVolumeClaim": {"claimName": w.pvc}} if w.pvc is not None
                  else {"hostPath": {"path": w.host_path, "type": "Directory"}})
        volumes.append({"name": "workspace", **source})
        mount = {"name": "workspace", "mountPath": w.mount_path}
        if w.sub_path:
            mount["subPath"] = w.sub_path
        mounts.append(mount)
    pod["volumes"] = volumes
    container["volumeMounts"] = mounts
    working_dir = k.working_dir or (k.workspace.mount_path if k.workspace is not None else None)
    if working_dir:
        container["workingDir"] = working_dir
    if k.node_selector:
        pod["nodeSelector"] = dict(k.node_selector)
    if k.service_account:
        pod["serviceAccountName"] = k.service_account
    if k.image_pull_secrets:
        pod["imagePullSecrets"] = [{"name": s} for s in k.image_pull_secrets]
    labels = {LABEL_JOB: name, LABEL_ROLE: role}
    # Kubernetes never retries a pod nor ends the others: a failed index stays failed (the job's restarts are the
    # supervisors', in the pods) and the Job is failed once every pod ended; the supervisors decide fail-fast
    spec_: dict = {"completionMode": "Indexed", "completions": count, "parallelism": count,
                   "backoffLimitPerIndex": 0, "maxFailedIndexes": count}
    spec_["template"] = {"metadata": {"labels": labels}, "spec": pod}
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": f"{name}-{role}", "namespace": k.namespace, "labels": labels},
        "spec": spec_,
    }


_escape = k8s_escape


def _problem(spec: ClusterSpec, path: tuple, message: str) -> SpecError:
    from .ops import spec_position

    line, col = spec_position(spec, path)
    dotted = "".join(f"[{p}]" if isinstance(p, int) else (f".{p}" if i else str(p)) for i, p in enumerate(path))
    return SpecError([SpecProblem(spec.source, line, col, dotted, message)])


class _Dumper(yaml.SafeDumper):
    def ignore_aliases(self, data) -> bool:  # no &id001 anchors where two objects share a labels dict
        return True


def _str(dumper: yaml.SafeDumper, text: str):
    style = "|" if "\n" in text else None  # the init container's script as a readable block
    return dumper.represent_scalar("tag:yaml.org,2002:str", text, style=style)


_Dumper.add_representer(str, _str)


def dump(docs: list[dict]) -> str:
    """The manifests as one multi-document YAML text (`kubectl apply -f` reads it)."""
    return yaml.dump_all(docs, Dumper=_Dumper, sort_keys=False, width=1 << 30, explicit_start=True)


# ---------------------------------------------------------------------------------- what a pod gets


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' `$(VAR)` expansion: `$$` is `$`, `$(NAME)` is env[NAME] (kept as written when unset)."""
    out, i, n = [], 0, len(text)
    while i < n:
        c = text[i]
        if c != "$" or i + 1 == n:
            out.append(c)
            i += 1
            continue
        nxt = text[i + 1]
        if nxt == "$":
            out.append("$")
            i += 2
        elif nxt == "(":
            close = text.find(")", i + 2)
            if close < 0:  # an unterminated reference is kept as written
                out.append("$(")
                i += 2
            else:
                ref = text[i + 2 : close]
                out.append(env[ref] if ref in env else f"$({ref})")
                i = close + 1
        else:
            out.append("$" + nxt)
            i += 2
    return "".join(out)


def _container(job: dict, name: str | None) -> dict:
    pod = job["spec"]["template"]["spec"]
    if name is None:
        return pod["containers"][0]
    return next(c for c in pod.get("initContainers", []) + pod["containers"] if c["name"] == name)


def pod_env(job: dict, index: int, *, pod_ip: str = "10.0.0.1", pod_name: str | None = None,
            secrets: dict | None = None, container: str | None = None) -> dict[str, str]:
    """The environment the kubelet gives pod `index` of an Indexed Job manifest (its first container, or
    the (init) container named `container`).

    Each `value` is expanded against the variables listed before it, a `fieldRef` read from the pod
    (the completion index annotation, `metadata.name` (default `<job>-<index>-xxxxx`), `status.podIP`,
    `metadata.namespace`), a `secretKeyRef` from `secrets` ({(secret name, key): value}); the Job
    controller adds JOB_COMPLETION_INDEX last. Raises ValueError on anything else (a Secret not given).
    """
    spec = _container(job, container)
    fields = {
        f"metadata.annotations['{INDEX_ANNOTATION}']": str(index),
        "metadata.name": pod_name or f"{job['metadata']['name']}-{index}-xxxxx",
        "status.podIP": pod_ip,
        "metadata.namespace": job["metadata"].get("namespace", "default"),
    }
    env: dict[str, str] = {}
    for item in spec.get("env", []):
        source = item.get("valueFrom", {})
        if "value" in item:
            env[item["name"]] = expand(item["value"], env)
        elif "secretKeyRef" in source:
            ref = source["secretKeyRef"]
            if (ref.get("name"), ref.get("key")) not in (secrets or {}):
                raise ValueError(f"env {item['name']}: no value given for Secret {ref.get('name')} key {ref.get('key')}")
            env[item["name"]] = secrets[ref["name"], ref["key"]]
        else:
            path = source.get("fieldRef", {}).get("fieldPath")
            if path not in fields:
                raise ValueError(f"env {item['name']}: cannot tell what {item.get('valueFrom')} gives a pod")
            env[item["name"]] = fields[path]
    env.setdefault("JOB_COMPLETION_INDEX", str(index))
    return env


def pod_argv(job: dict, index: int, *, pod_ip: str = "10.0.0.1", pod_name: str | None = None,
             secrets: dict | None = None, container: str | None = None) -> list[str]:
    """The argv pod `index` of a rendered Job runs (in `container`, as for pod_env): command and args, expanded."""
    spec = _container(job, container)
    env = pod_env(job, index, pod_ip=pod_ip, pod_name=pod_name, secrets=secrets, container=container)
    return [expand(a, env) for a in spec.get("command", []) + spec.get("args", [])]


def process_argv(job: dict, index: int, *, secrets: dict | None = None) -> list[str]:
    """The argv the supervisor of pod `index` runs: the main container's args, after the `pod start ... --` part."""
    argv = pod_argv(job, index, secrets=secrets)
    return argv[argv.index("--") + 1:]


# ------------------------------------------------------------------------------------------- CLI


def cmd_render(args: argparse.Namespace) -> int:
    """clusterctl k8s render: write (or print) the manifests, then say how to apply and follow them."""
    import sys

    from rich.markup import escape

    from .backends import load_spec  # the spec's backend's checks too, as validate and plan make them
    from .cache import write_atomic
    from .console import err, out, printable
    from .quoting import quote

    spec = load_spec(args.spec)
    docs = render(spec)
    text = dump(docs)
    name, ns = object_name(spec), spec.kubernetes.namespace
    # `create`, not `apply`: apply copies each object into an annotation, the Secret's token included
    if args.output == "-":  # the usual spelling of stdout (it made a directory named `-`, the token in it)
        args.output = None
    if args.output is not None:
        if not args.output.strip():  # `-o "$DIR"` with DIR unset: never the token on stdout instead
            raise UsageError(f"k8s render: -o {args.output!r} names no directory: give -o DIR")
        path = Path(args.output) / f"{name}.yaml"
        if path.parent.exists() and not path.parent.is_dir():
            raise ClusterctlError(f"k8s render: -o {args.output} is not a directory")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(path, text.encode("utf-8"))  # 0600: it holds the job's token (the Secret)
        except OSError as e:
            raise ClusterctlError(f"k8s render: cannot write {path}: {e.strerror or e}") from e
        apply, say = f"kubectl create -f {quote(str(path))}", out
    else:
        sys.stdout.write(text)
        apply, say = f"clusterctl k8s render {quote(args.spec)} | kubectl create -f -", err  # stdout: the manifests
    n = names(spec)
    pods = sum(d["spec"]["completions"] for d in docs if d["kind"] == "Job")
    jobs = ", ".join(f"Job {d['metadata']['name']} ({d['spec']['completions']} pods)" for d in docs if d["kind"] == "Job")
    say.print(escape(printable(f"{'wrote ' + str(path) + ' (0600: it holds the token)' if args.output else 'manifests'}: "
                     f"Secret {n['secret']}, ConfigMap {n['configmap']}, Service {name} (headless), {jobs}")))
    sel = f"{LABEL_JOB}={name}"
    for what, cmd in (
        ("create", apply),
        ("watch", f"kubectl get pods -n {ns} -l {sel} -w"),
        ("logs", f"kubectl logs -n {ns} -f -l {sel} --prefix --max-log-requests {pods}"),
        ("wait", f"kubectl wait -n {ns} --for=condition=complete job/{name}-trainer --timeout=24h"),
        ("delete", f"kubectl delete -n {ns} job,service,configmap,secret -l {sel}"),
    ):
        say.print(escape(printable(f"  {what + ':':<8}{cmd}")))  # commands to copy: every word quoted
    trainers = sum(d["spec"]["completions"] for d in docs
                   if d["kind"] == "Job" and d["metadata"]["labels"].get(LABEL_ROLE) == "trainer")
    for line in notes(spec, trainers):
        say.print(escape(f"  note: {line}"))
    if spec.data is not None:
        say.print("  note: data: is not dealt on Kubernetes (no CLUSTERCTL_DATA_FILES); put the shards on the "
                  "workspace volume and pick them by PADDLE_TRAINER_ID")
    return 0


def add_cli(sub) -> None:
    """Register `clusterctl k8s render`."""
    p = sub.add_parser("k8s", help="Kubernetes manifests from the spec")
    ksub = p.add_subparsers(dest="k8s_command", metavar="COMMAND", required=True)
    r = ksub.add_parser("render", help="the job's Secret and ConfigMap, a headless Service and one Indexed Job per "
                        "role (what `start` creates with backend: kubernetes); no cluster is contacted")
    r.add_argument("spec")
    r.add_argument("-o", "--output", metavar="DIR", help="write DIR/<name>.yaml (default, or -: print to stdout)")
    r.set_defaults(func=cmd_render)
