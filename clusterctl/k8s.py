"""Kubernetes manifests from a cluster spec: a headless Service and one Indexed Job per role.

One pod per process. A pod's id is its completion index (the `batch.kubernetes.io/job-completion-index`
annotation the Job controller sets); every other variable of the environment contract (GUIDE section 2)
is either the same for every pod of a role or built from that index with Kubernetes' own `$(VAR)`
expansion, so the manifests hold no per-pod copy of anything. Endpoints are the pods' stable DNS
names, `<name>-<role>-<index>.<service>`: Indexed Jobs give pod `i` the hostname `<job>-<i>`, and the
pod's `subdomain` (the headless Service) puts that name in the cluster's DNS.

Pure: nothing here talks to a cluster. `pod_env` shows the environment the kubelet gives a pod of a
rendered Job, by the same rules (docs/kubernetes.md).
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import yaml

from .errors import SpecError, SpecProblem
from .plan import JobPlan, make_plan
from .spec import ClusterSpec

__all__ = [
    "INDEX_ANNOTATION", "LABEL_JOB", "LABEL_ROLE", "object_name", "render", "dump", "expand", "pod_env", "pod_argv",
    "add_cli",
]

INDEX_ANNOTATION = "batch.kubernetes.io/job-completion-index"
LABEL_JOB = "clusterctl.io/job"
LABEL_ROLE = "clusterctl.io/role"
_ID_VAR = {"trainer": "PADDLE_TRAINER_ID", "pserver": "PADDLE_PSERVER_ID"}

# The init container's program (python3 of the job's image): wait until every name in argv[1] (comma
# separated) resolves and every HOST:PORT in argv[2] accepts a TCP connection, for at most argv[3]
# seconds. A pod's DNS name exists only once the pod has an IP; what the SSH agent does with
# start_trainers_after (trainers start once the pservers listen) is this container's job here.
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
    k = spec.kubernetes
    if k is not None and k.name:
        return k.name
    return "".join(c if c.isalnum() else "-" for c in spec.name.lower()).strip("-")


def render(spec: ClusterSpec) -> list[dict]:
    """The Service and the Jobs (pservers first, then trainers) for `spec`; SpecError when it cannot be."""
    k = spec.kubernetes
    if k is None:
        raise _problem(spec, ("kubernetes",), "the spec has no kubernetes: section (at least kubernetes.image)")
    job = spec.job
    if job.launcher == "mpi":
        raise _problem(spec, ("job", "launcher"), "launcher: mpi is not rendered for Kubernetes; use launcher: ssh")
    plan = make_plan(spec)
    name = object_name(spec)
    trainers, pservers = len(plan.trainers), len(plan.pservers)
    longest = f"{name}-trainer-{trainers - 1}"
    if len(longest) > 63 or not name:
        raise _problem(spec, ("kubernetes", "name") if k.name else ("name",),
                       f"pod host names like {longest!r} must be 1-63 characters; set a shorter kubernetes.name")
    gpus = _gpus_per_trainer(spec, plan)
    ports = job.ports
    trainer_eps = ",".join(f"{name}-trainer-{i}.{name}:{ports.trainer}" for i in range(trainers))
    pserver_eps = ",".join(f"{name}-pserver-{i}.{name}:{ports.pserver}" for i in range(pservers))
    common = [  # literal values, the same for every pod
        ("PADDLE_TRAINERS_NUM", str(trainers)),
        ("PADDLE_TRAINER_ENDPOINTS", trainer_eps),
    ]
    if job.mode == "pserver":
        common += [("PADDLE_PSERVERS_IP_PORT_LIST", pserver_eps), ("CLUSTERCTL_PS_MODE", job.sync),
                   ("CLUSTERCTL_PS_K_STEPS", str(job.k_steps))]
    values = {"trainers": str(trainers), "pserver_endpoints": pserver_eps, "trainer_endpoints": trainer_eps,
              "job": spec.name, "local_rank": "0"}
    docs: list[dict] = [_service(spec, name, pservers > 0)]
    if pservers:
        docs.append(_job(spec, name, "pserver", pservers, ports.pserver, common, [], 0, values, ""))
    trainer_env = [  # as written in the manifest: references, or literals with no '$'
        ("RANK", "$(PADDLE_TRAINER_ID)"),
        ("WORLD_SIZE", str(trainers)),
        ("LOCAL_RANK", "0"),  # one trainer per pod
        ("LOCAL_WORLD_SIZE", "1"),
        ("MASTER_ADDR", f"{name}-trainer-0.{name}"),
        ("MASTER_PORT", str(ports.master)),
    ]
    if gpus:
        # the device plugin gives the container its GPUs only, numbered from 0
        visible = ",".join(str(i) for i in range(gpus))
        trainer_env += [("CUDA_VISIBLE_DEVICES", visible), ("FLAGS_selected_gpus", visible)]
    docs.append(_job(spec, name, "trainer", trainers, ports.trainer, common, trainer_env, gpus, values, pserver_eps))
    return docs


def _gpus_per_trainer(spec: ClusterSpec, plan: JobPlan) -> int:
    k = spec.kubernetes
    if k.gpus_per_trainer is not None:
        return k.gpus_per_trainer
    counts = sorted({len(t.gpus) for t in plan.trainers})
    if len(counts) > 1:
        raise _problem(spec, ("kubernetes",), f"the plan gives trainers {' or '.join(map(str, counts))} GPUs; "
                       "every pod of a Job asks for the same: set kubernetes.gpus_per_trainer")
    return counts[0]


def _service(spec: ClusterSpec, name: str, with_pservers: bool) -> dict:
    named = [("trainer", spec.job.ports.trainer), ("master", spec.job.ports.master)]
    if with_pservers:
        named.append(("pserver", spec.job.ports.pserver))
    ports: list[dict] = []
    for port_name, number in named:  # a Service lists each port number once (pods of two roles may share one)
        if all(p["port"] != number for p in ports):
            ports.append({"name": port_name, "port": number})
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "namespace": spec.kubernetes.namespace, "labels": {LABEL_JOB: name}},
        "spec": {
            "clusterIP": "None",  # headless: DNS names for the pods, no virtual IP
            "publishNotReadyAddresses": True,  # names resolve as soon as pods have IPs, before any readiness
            "selector": {LABEL_JOB: name},
            "ports": ports,
        },
    }


def _job(spec: ClusterSpec, name: str, role: str, count: int, port: int, common, role_env, gpus: int, values,
         wait_for: str) -> dict:
    k, job = spec.kubernetes, spec.job
    id_var = _ID_VAR[role]
    own = [  # the pod's id (its completion index), and its name: the endpoint's host, as in the plan
        # (Paddle finds a pserver's id by POD_IP:PADDLE_PORT in PADDLE_PSERVERS_IP_PORT_LIST)
        {"name": id_var, "valueFrom": {"fieldRef": {"fieldPath": f"metadata.annotations['{INDEX_ANNOTATION}']"}}},
        {"name": "POD_IP", "value": f"{name}-{role}-$({id_var}).{name}"},
    ]
    env = [{"name": n, "value": _escape(v)} for n, v in job.env.items()]
    env += [
        {"name": "CLUSTERCTL_JOB", "value": _escape(spec.name)},
        {"name": "CLUSTERCTL_ROLE", "value": role},
        {"name": "TRAINING_ROLE", "value": role.upper()},
        *own,
        {"name": "PADDLE_PORT", "value": str(port)},
        {"name": "PADDLE_CURRENT_ENDPOINT", "value": f"$(POD_IP):{port}"},
    ]
    env += [{"name": n, "value": _escape(v)} for n, v in common]
    env += [{"name": n, "value": v} for n, v in role_env]
    placeholders = {k_: _escape(v) for k_, v in values.items()}
    placeholders.update({"role": role, "id": f"$({id_var})", "trainer_id": f"$({id_var})",
                         "current_endpoint": "$(PADDLE_CURRENT_ENDPOINT)", "host": "$(POD_IP)"})
    container: dict = {
        "name": role,
        "image": k.image,
        "command": [_escape(a) for a in job.entrypoint],
        "args": [_escape(a).format_map(placeholders) for a in job.args],
        "env": env,
        "ports": [{"name": role, "containerPort": port}]
        + ([{"name": "master", "containerPort": job.ports.master}] if role == "trainer" else []),
    }
    if not container["args"]:
        del container["args"]
    if k.image_pull_policy:
        container["imagePullPolicy"] = k.image_pull_policy
    resources = {kind: dict(q) for kind, q in k.resources.get(role, {}).items()}
    if gpus:
        resources.setdefault("limits", {})[k.gpu_resource] = str(gpus)
    if resources:
        container["resources"] = resources
    pod: dict = {
        "restartPolicy": "Never",
        "subdomain": name,  # with the hostname <job>-<index>: <name>-<role>-<index>.<name> in DNS
        "enableServiceLinks": False,  # no <SERVICE>_PORT variables beside the contract
        "terminationGracePeriodSeconds": math.ceil(job.grace),
        "containers": [container],
    }
    if k.wait_timeout:
        names = "$(POD_IP)" + (f",{name}-trainer-0.{name}" if role == "trainer" else "")  # own name, the master's
        pod["initContainers"] = [{
            "name": "wait",
            "image": k.image,
            "command": ["python3", "-c", _escape(WAIT_SCRIPT), names, _escape(wait_for), f"{k.wait_timeout:g}"],
            "env": own,
        }]
        if k.image_pull_policy:
            pod["initContainers"][0]["imagePullPolicy"] = k.image_pull_policy
    if k.workspace is not None:
        w = k.workspace
        source = ({"persistentVolumeClaim": {"claimName": w.pvc}} if w.pvc is not None
                  else {"hostPath": {"path": w.host_path, "type": "Directory"}})
        pod["volumes"] = [{"name": "workspace", **source}]
        mount = {"name": "workspace", "mountPath": w.mount_path}
        if w.sub_path:
            mount["subPath"] = w.sub_path
        container["volumeMounts"] = [mount]
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
    spec_: dict = {"completionMode": "Indexed", "completions": count, "parallelism": count}
    if job.on_failure == "stop":
        spec_["backoffLimit"] = 0  # the first failed pod fails the Job, which ends its other pods
    else:
        spec_.update(backoffLimitPerIndex=0, maxFailedIndexes=count)  # a failed pod is not retried; the rest go on
    spec_["template"] = {"metadata": {"labels": labels}, "spec": pod}
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": f"{name}-{role}", "namespace": k.namespace, "labels": labels},
        "spec": spec_,
    }


def _escape(text: str) -> str:
    """A literal for a field the kubelet expands (`env[].value`, `command`, `args`): `$` is written `$$`."""
    return text.replace("$", "$$")


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


def pod_env(job: dict, index: int, *, pod_ip: str = "10.0.0.1", container: str | None = None) -> dict[str, str]:
    """The environment the kubelet gives pod `index` of an Indexed Job manifest (its first container, or
    the (init) container named `container`).

    Each `value` is expanded against the variables listed before it, a `fieldRef` read from the pod
    (the completion index annotation, `status.podIP`, `metadata.namespace`); the Job controller adds
    JOB_COMPLETION_INDEX last. Raises ValueError on anything else (a secret, another field).
    """
    spec = _container(job, container)
    fields = {
        f"metadata.annotations['{INDEX_ANNOTATION}']": str(index),
        "status.podIP": pod_ip,
        "metadata.namespace": job["metadata"].get("namespace", "default"),
    }
    env: dict[str, str] = {}
    for item in spec.get("env", []):
        if "value" in item:
            env[item["name"]] = expand(item["value"], env)
        else:
            path = item.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath")
            if path not in fields:
                raise ValueError(f"env {item['name']}: cannot tell what {item.get('valueFrom')} gives a pod")
            env[item["name"]] = fields[path]
    env.setdefault("JOB_COMPLETION_INDEX", str(index))
    return env


def pod_argv(job: dict, index: int, *, pod_ip: str = "10.0.0.1", container: str | None = None) -> list[str]:
    """The argv pod `index` of a rendered Job runs (in `container`, as for pod_env): command and args, expanded."""
    spec = _container(job, container)
    env = pod_env(job, index, pod_ip=pod_ip, container=container)
    return [expand(a, env) for a in spec.get("command", []) + spec.get("args", [])]


# ------------------------------------------------------------------------------------------- CLI


def cmd_render(args: argparse.Namespace) -> int:
    """clusterctl k8s render: write (or print) the manifests, then say how to apply and follow them."""
    import sys

    from rich.markup import escape

    from .console import err, out
    from .spec import load_spec

    spec = load_spec(args.spec)
    docs = render(spec)
    text = dump(docs)
    name, ns = object_name(spec), spec.kubernetes.namespace
    if args.output:
        path = Path(args.output) / f"{name}.yaml"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        apply, say = f"kubectl apply -f {path}", out
    else:
        sys.stdout.write(text)
        apply, say = f"clusterctl k8s render {args.spec} | kubectl apply -f -", err  # the manifests own stdout
    pods = sum(d["spec"]["completions"] for d in docs if d["kind"] == "Job")
    jobs = ", ".join(f"Job {d['metadata']['name']} ({d['spec']['completions']} pods)" for d in docs if d["kind"] == "Job")
    say.print(escape(f"{'wrote ' + str(path) if args.output else 'manifests'}: Service {name} (headless), {jobs}"))
    sel = f"{LABEL_JOB}={name}"
    for what, cmd in (
        ("apply", apply),
        ("watch", f"kubectl get pods -n {ns} -l {sel} -w"),
        ("logs", f"kubectl logs -n {ns} -f -l {sel} --prefix --max-log-requests {pods}"),
        ("wait", f"kubectl wait -n {ns} --for=condition=complete job/{name}-trainer --timeout=24h"),
        ("delete", f"kubectl delete -n {ns} service,job -l {sel}"),
    ):
        say.print(escape(f"  {what + ':':<8}{cmd}"))
    if spec.data is not None:
        say.print("  note: data: is not dealt on Kubernetes (no CLUSTERCTL_DATA_FILES); put the shards on the "
                  "workspace volume and pick them by PADDLE_TRAINER_ID")
    return 0


def add_cli(sub) -> None:
    """Register `clusterctl k8s render`."""
    p = sub.add_parser("k8s", help="Kubernetes manifests from the spec")
    ksub = p.add_subparsers(dest="k8s_command", metavar="COMMAND", required=True)
    r = ksub.add_parser("render", help="a headless Service and one Indexed Job per role; no cluster is contacted")
    r.add_argument("spec")
    r.add_argument("-o", "--output", metavar="DIR", help="write DIR/<name>.yaml (default: print to stdout)")
    r.set_defaults(func=cmd_render)
