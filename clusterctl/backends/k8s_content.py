"""What the Kubernetes pods' manifests hold: every pod's environment, its argv's placeholders, the ConfigMap (the host
package and the job's template that clusterctl/host/pod.py reads), and what of it is too large for a pod to start or
for Kubernetes to store.

clusterctl.k8s places this content in the objects; `kubernetes_problems` is everything `k8s render` refuses of a spec:
the kubernetes: section's own checks (clusterctl.spec.checks.kubernetes_section_problems, which every command makes
when it loads a spec), the env names every pod sets itself, then the sizes. The sizes are those of what `k8s render`
writes, computed from the spec alone (no plan), so that loading a spec of 10,000 processes checks them in
milliseconds; `backend: kubernetes` makes these checks when a spec is loaded (clusterctl.backends.kubernetes), with
what `start` would hit beyond them (clusterctl.backends.k8s_limits)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING

from ..host.layout import exec_string_fits
from ..host.pod import POD_NAME_ENV, SECRET_ENV, TEMPLATE_VERSION
from ..host.policy import DEFAULT_TIMINGS
from ..spec.backends import STATE_MOUNT
from ..spec.checks import k8s_gpus_per_trainer, k8s_object_name, k8s_pod_counts, kubernetes_section_problems

if TYPE_CHECKING:
    from ..spec import ClusterSpec

__all__ = ["kubernetes_problems", "POD_ENV", "K8sShape", "k8s_shape", "k8s_endpoints", "k8s_escape", "k8s_own_env",
           "k8s_container_env", "k8s_placeholders", "k8s_last_placeholders", "k8s_host_package", "k8s_configmap_data",
           "K8S_ID_VAR", "INDEX_ANNOTATION", "TEMPLATE_KEY", "STATE_ROOT", "PYCACHE", "TERMINATION_LOG",
           "CONFIGMAP_LIMIT", "WAIT_DEFAULT_S"]

# What every pod's container sets itself beside the contract (CONTRACT_ENV, refused in job.env by the model): the
# main process's own two (its pod's name, the job's token) and what the Job controller adds. The pservers' mode
# variables (clusterctl.spec.checks.PSERVER_POD_ENV) are the pserver-mode pods' too.
POD_ENV = frozenset({SECRET_ENV, POD_NAME_ENV, "JOB_COMPLETION_INDEX"})

INDEX_ANNOTATION = "batch.kubernetes.io/job-completion-index"
K8S_ID_VAR = {"trainer": "PADDLE_TRAINER_ID", "pserver": "PADDLE_PSERVER_ID"}
# the ConfigMap (at clusterctl.spec.backends.HOST_MOUNT): the host package's modules and the job's template
TEMPLATE_KEY = "template.json"
CONFIGMAP_LIMIT = 1_000_000  # bytes (Kubernetes refuses a ConfigMap over 1 MiB)
# the emptyDir (at STATE_MOUNT): the job dir (job file, state, logs) and the bytecode cache
STATE_ROOT = f"{STATE_MOUNT}/jobs"
PYCACHE = f"{STATE_MOUNT}/pycache"
TERMINATION_LOG = "/dev/termination-log"
WAIT_DEFAULT_S = 120.0  # the supervisors' timeouts (peers connecting, pservers listening) when wait_timeout is 0


def kubernetes_problems(spec: ClusterSpec) -> list[tuple[tuple, str]]:
    """(path, message) for each thing in a spec with a kubernetes: section that its manifests cannot be: the section's
    own checks (kubernetes_section_problems: launcher mpi, names, GPUs, resources) with the env names every pod sets
    itself (POD_ENV) among them, then (when none of those) what is too large for a pod to start or for a ConfigMap
    (_size_problems). `k8s render` (which makes no check of its own) and every command that loads a `backend:
    kubernetes` spec say the same."""
    found = kubernetes_section_problems(spec, pod_env=POD_ENV)
    if not found:  # sizes of manifests that can be made at all (their names, their GPUs)
        found += _size_problems(spec, k8s_shape(spec))
    return found


@dataclass(frozen=True)
class K8sShape:
    """A spec's pods as its manifests name them: the objects' name prefix, how many of each role (as the plan lays
    them out), each trainer's GPUs, and each role's endpoint list (`NAME-ROLE-I.NAME:PORT,...`)."""

    name: str
    trainers: int
    pservers: int
    gpus: int
    trainer_endpoints: str
    pserver_endpoints: str


def k8s_shape(spec: ClusterSpec) -> K8sShape:
    """The K8sShape of a spec with a kubernetes: section (pservers only in pserver mode)."""
    name, ports = k8s_object_name(spec), spec.job.ports
    trainers, pservers = k8s_pod_counts(spec)
    return K8sShape(name, trainers, pservers, k8s_gpus_per_trainer(spec)[0],
                    k8s_endpoints(name, "trainer", trainers, ports.trainer),
                    k8s_endpoints(name, "pserver", pservers, ports.pserver))


def k8s_endpoints(name: str, role: str, count: int, port: int) -> str:
    """The pods' endpoint list of one role, as every pod's environment states it: `NAME-ROLE-I.NAME:PORT,...`."""
    return ",".join(f"{name}-{role}-{i}.{name}:{port}" for i in range(count))


def k8s_escape(text: str) -> str:
    """A literal for a field the kubelet expands (`env[].value`, `command`, `args`): `$` is written `$$`."""
    return text.replace("$", "$$")


def k8s_own_env(shape: K8sShape, role: str) -> list[dict]:
    """A pod's id (its completion index) and its name, the endpoint's host as in the plan (Paddle finds a pserver's
    id by POD_IP:PADDLE_PORT in PADDLE_PSERVERS_IP_PORT_LIST): env items of the main and the init container."""
    id_var = K8S_ID_VAR[role]
    return [{"name": id_var, "valueFrom": {"fieldRef": {"fieldPath": f"metadata.annotations['{INDEX_ANNOTATION}']"}}},
            {"name": "POD_IP", "value": f"{shape.name}-{role}-$({id_var}).{shape.name}"}]


def k8s_container_env(spec: ClusterSpec, shape: K8sShape, role: str) -> list[dict]:
    """The env items of a role's main container, as its manifest lists them (clusterctl.k8s adds the main process's
    own two after them): job.env, then the contract's variables (GUIDE section 2), literals escaped, each pod's own
    built by the kubelet's `$(VAR)` from its completion index. CLUSTERCTL_JOB is not here: the supervisor tags the
    processes it starts (and nothing else)."""
    job, name = spec.job, shape.name
    port = job.ports.trainer if role == "trainer" else job.ports.pserver
    env = [{"name": n, "value": k8s_escape(v)} for n, v in job.env.items()]
    env += [{"name": "CLUSTERCTL_ROLE", "value": role}, {"name": "TRAINING_ROLE", "value": role.upper()},
            *k8s_own_env(shape, role), {"name": "PADDLE_PORT", "value": str(port)},
            {"name": "PADDLE_CURRENT_ENDPOINT", "value": f"$(POD_IP):{port}"}]
    common = [("PADDLE_TRAINERS_NUM", str(shape.trainers))]  # literal values, the same for every pod
    if exec_string_fits("PADDLE_TRAINER_ENDPOINTS=" + shape.trainer_endpoints):  # else left out, as over SSH
        common.append(("PADDLE_TRAINER_ENDPOINTS", shape.trainer_endpoints))  # (clusterctl.k8s.notes says so)
    if job.mode == "pserver":  # its size: _size_problems
        common += [("PADDLE_PSERVERS_IP_PORT_LIST", shape.pserver_endpoints), ("CLUSTERCTL_PS_MODE", job.sync),
                   ("CLUSTERCTL_PS_K_STEPS", str(job.k_steps))]
    env += [{"name": n, "value": k8s_escape(v)} for n, v in common]
    if role == "trainer":  # references, or literals with no '$'
        env += [{"name": "RANK", "value": "$(PADDLE_TRAINER_ID)"}, {"name": "WORLD_SIZE", "value": str(shape.trainers)},
                {"name": "LOCAL_RANK", "value": "0"}, {"name": "LOCAL_WORLD_SIZE", "value": "1"},  # one trainer a pod
                {"name": "MASTER_ADDR", "value": f"{name}-trainer-0.{name}"},
                {"name": "MASTER_PORT", "value": str(job.ports.master)}]
        if shape.gpus:  # the device plugin gives the container its GPUs only, numbered from 0
            visible = ",".join(str(i) for i in range(shape.gpus))
            env += [{"name": "CUDA_VISIBLE_DEVICES", "value": visible}, {"name": "FLAGS_selected_gpus", "value": visible}]
    return env


def k8s_placeholders(spec: ClusterSpec, shape: K8sShape) -> dict[str, str]:
    """job.args' placeholders that are the same in every pod, unescaped (each role's own: clusterctl.k8s)."""
    return {"trainers": str(shape.trainers), "pserver_endpoints": shape.pserver_endpoints,
            "trainer_endpoints": shape.trainer_endpoints, "job": spec.name, "local_rank": "0"}


def k8s_last_placeholders(spec: ClusterSpec, shape: K8sShape, role: str) -> dict[str, str]:
    """job.args' placeholders as the kubelet fills them in for a role's last pod (its longest index), unescaped."""
    last = (shape.trainers if role == "trainer" else shape.pservers) - 1
    host = f"{shape.name}-{role}-{last}.{shape.name}"
    port = spec.job.ports.trainer if role == "trainer" else spec.job.ports.pserver
    return dict(k8s_placeholders(spec, shape), role=role, id=str(last), trainer_id=str(last), host=host,
                current_endpoint=f"{host}:{port}")


@lru_cache(maxsize=1)
def _host_package() -> tuple[tuple[str, str], ...]:
    from importlib import resources  # here: not on the path of every command that loads a spec (~2 ms, zipfile)

    root = resources.files("clusterctl.host")
    return tuple((e.name, e.read_text(encoding="utf-8")) for e in sorted(root.iterdir(), key=lambda e: e.name)
                 if e.name.endswith(".py"))


def k8s_host_package() -> dict[str, str]:
    """Every module of the host package (clusterctl/host), by file name: the ConfigMap's data beside the template."""
    return dict(_host_package())


def _template(spec: ClusterSpec, shape: K8sShape) -> dict:
    """What every pod's job file shares (clusterctl/host/pod.py builds the rest from the pod's environment)."""
    k, job = spec.kubernetes, spec.job
    wait = k.wait_timeout or WAIT_DEFAULT_S
    counts = {"pserver": shape.pservers, "trainer": shape.trainers}
    roles = [r for r in ("pserver", "trainer") if counts[r]]
    env_names = list(dict.fromkeys(e["name"] for r in roles for e in k8s_container_env(spec, shape, r)))
    eps = shape.pserver_endpoints
    return {
        "version": TEMPLATE_VERSION,
        "job": spec.name,
        "state_root": STATE_ROOT,
        "pycache": PYCACHE,
        "termination_log": TERMINATION_LOG,
        "on_failure": job.on_failure,
        "grace": job.grace,
        "restarts": job.restarts,
        "restart_backoff": job.restart_backoff,
        "auth": job.auth,
        "roles": {r: {"count": counts[r], "id_env": K8S_ID_VAR[r], "dns": f"{shape.name}-{r}-{{id}}.{shape.name}",
                      "port": job.ports.pserver if r == "pserver" else job.ports.trainer} for r in roles},
        # the supervisors' coordinator: trainer 0's pod (every job has one)
        "coordinator": {"address": f"{shape.name}-trainer-0.{shape.name}", "port": job.ports.control,
                        "pod": ["trainer", 0], "hosts": shape.pservers + shape.trainers, "trainers_total": shape.trainers,
                        "timings": {"connect_timeout": max(wait, DEFAULT_TIMINGS.connect_timeout)}},
        "start_trainers_after": {"endpoints": eps.split(","), "timeout": wait} if eps else None,
        "env": env_names,
    }


def k8s_configmap_data(spec: ClusterSpec, shape: K8sShape) -> dict[str, str]:
    """The ConfigMap's data: the host package and the job's template (TEMPLATE_KEY)."""
    data = k8s_host_package()
    data[TEMPLATE_KEY] = json.dumps(_template(spec, shape), indent=1, sort_keys=True) + "\n"
    return data


def _size_problems(spec: ClusterSpec, shape: K8sShape) -> list[tuple[tuple, str]]:
    """The first of what is too large in the manifests: the pserver list or an argument (its placeholders filled in as
    the longest pod's are: the pods' DNS names make `{trainer_endpoints}` longer than over SSH) over what execve takes
    (no pod would start), or the ConfigMap over what Kubernetes stores."""
    job = spec.job
    if job.mode == "pserver" and not exec_string_fits("PADDLE_PSERVERS_IP_PORT_LIST=" + shape.pserver_endpoints):
        return [(("job", "pservers"), f"PADDLE_PSERVERS_IP_PORT_LIST would be {len(shape.pserver_endpoints) + 29} "
                 "bytes: Linux starts no process with an environment string over 128 KiB (E2BIG)")]
    for role, count in (("trainer", shape.trainers), ("pserver", shape.pservers)):
        if not count:
            continue
        longest = k8s_last_placeholders(spec, shape, role)
        for arg in job.args:
            text = arg.format_map(longest)
            if not exec_string_fits(text):
                return [(("job", "args"), f"an argument (after its placeholders) would be "
                         f"{len(text.encode('utf-8', 'surrogateescape'))} bytes in a {role} pod: Linux starts no "
                         "process with an argument or environment string over 128 KiB (E2BIG)")]
    size = sum(len(k) + len(v.encode("utf-8")) for k, v in k8s_configmap_data(spec, shape).items())
    if size > CONFIGMAP_LIMIT:
        return [(("kubernetes",), f"the host package and template take {size} bytes; a ConfigMap holds at most "
                 f"{CONFIGMAP_LIMIT}")]
    return []
