"""The semantic checks of a validated spec: what its models cannot see alone (duplicate hosts, pservers
named but not listed) and what only laying out its plan finds. What a backend cannot honour is that
backend's check (clusterctl.backends), made by every command that runs the spec.

Imports the models and clusterctl.plan; neither imports this module (clusterctl.spec.loading calls it)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache

from ..errors import SpecProblem
from ..host.layout import exec_string_fits
from ..host.pod import POD_NAME_ENV, SECRET_ENV, TEMPLATE_VERSION
from ..host.policy import DEFAULT_TIMINGS
from ..plan import PlanError, make_plan
from ..yamlpos import Located
from .backends import STATE_MOUNT, _amount, is_extended_resource
from .errors import problem
from .fields import _did_you_mean
from .job import PserversPerHost
from .models import ClusterSpec

__all__ = ["semantic_problems", "kubernetes_problems", "k8s_object_name", "k8s_gpus_per_trainer", "POD_ENV",
           "K8sShape", "k8s_shape", "k8s_endpoints", "k8s_escape", "k8s_own_env", "k8s_container_env", "k8s_placeholders",
           "k8s_host_package", "k8s_configmap_data", "K8S_ID_VAR", "INDEX_ANNOTATION", "TEMPLATE_KEY", "STATE_ROOT",
           "PYCACHE", "TERMINATION_LOG", "CONFIGMAP_LIMIT", "WAIT_DEFAULT_S"]

# What every pod's container sets itself beside the contract (CONTRACT_ENV, refused in job.env by the model): the
# main process's own two (its pod's name, the job's token) and what the Job controller adds. The pservers' mode
# variables are the pserver-mode pods' (layout.py sets them over SSH).
POD_ENV = frozenset({SECRET_ENV, POD_NAME_ENV, "JOB_COMPLETION_INDEX"})
PSERVER_POD_ENV = frozenset({"CLUSTERCTL_PS_MODE", "CLUSTERCTL_PS_K_STEPS"})


def semantic_problems(loc: Located, source: str, spec: ClusterSpec, *, layout: bool = True) -> list[SpecProblem]:
    """What is wrong with a well-typed `spec`: Slurm's constraints, hosts, pservers, then (with `layout`)
    its plan's layout."""
    problems: list[SpecProblem] = []
    if spec.kubernetes is not None:  # what `k8s render` (and backend: kubernetes) refuses, refused by every command
        problems += [problem(loc, source, path, message) for path, message in kubernetes_problems(spec)]
    if not spec.hosts and spec.slurm is None:  # under Slurm the nodes give the hosts (clusterctl.backends.slurm)
        where = ("hostfile",) if spec.hostfile else ("hosts",)
        problems.append(problem(loc, source, where, "no hosts: list at least one host"))
    seen: dict[tuple[str, int], int] = {}
    for i, host in enumerate(spec.hosts):
        key = (host.address, host.port or spec.ssh.port)
        if key in seen:
            where = key[0] if key[1] is None else f"{key[0]}:{key[1]}"
            problems.append(problem(loc, source, ("hosts", i), f"duplicate host {where} (also hosts[{seen[key]}])"))
        else:
            seen[key] = i
        if spec.job.trainers == "gpu" and not host.gpus:
            problems.append(problem(loc, source, ("hosts", i), "job.trainers is 'gpu' but this host lists no gpus"))
    if isinstance(spec.job.pservers, tuple):
        addresses = {h.address for h in spec.hosts}
        for i, addr in enumerate(spec.job.pservers):
            if addr not in addresses:
                hint = _did_you_mean(addr, sorted(addresses))
                problems.append(problem(loc, source, ("job", "pservers", i), f"{addr} is not in hosts{hint}"))
    if spec.job.mode == "pserver" and _pserver_count(spec) == 0:
        problems.append(problem(loc, source, ("job", "pservers"), "pserver mode needs at least one pserver"))
    if spec.job.mode == "pserver" and spec.kubernetes is None:  # (the pods' own check above says it there)
        for var in sorted(PSERVER_POD_ENV & set(spec.job.env)):  # layout.py set it over this value without a word
            key = "sync" if var == "CLUSTERCTL_PS_MODE" else "k_steps"
            problems.append(problem(loc, source, ("job", "env", var), f"{var} is set from job.{key} in pserver mode; "
                                    f"give job.{key} instead"))
    if spec.job.mode == "collective" and _pserver_count(spec) > 0:
        problems.append(problem(loc, source, ("job", "pservers"), "collective mode runs no pservers; set mode: pserver"))
    if problems or not layout:
        return problems
    try:
        make_plan(spec)
    except PlanError as exc:
        problems.append(problem(loc, source, exc.path, exc.message))
    return problems


def _pserver_count(spec: ClusterSpec) -> int:
    p = spec.job.pservers
    if isinstance(p, int):
        return p
    if isinstance(p, PserversPerHost):
        return p.per_host * len(spec.hosts)
    return len(p)


# ------------------------------------------------------------------------------------------- kubernetes:


def k8s_object_name(spec: ClusterSpec) -> str:
    """The prefix of every Kubernetes object's name: `kubernetes.name`, else the spec's name as a DNS label."""
    k = spec.kubernetes
    if k is not None and k.name:
        return k.name
    return "".join(c if c.isalnum() else "-" for c in spec.name.lower()).strip("-")


def _trainers_per_host(spec: ClusterSpec) -> list[tuple[int, int]]:
    """(trainers, GPUs) of each host of the job (not a spare), as the plan lays them out."""
    job = spec.job
    return [(h.slots if h.slots is not None else len(h.gpus) if job.trainers == "gpu" else int(job.trainers),
             len(h.gpus)) for h in spec.hosts if not h.spare]


def k8s_gpus_per_trainer(spec: ClusterSpec) -> tuple[int, ...]:
    """The GPUs each trainer pod asks for: (kubernetes.gpus_per_trainer,), else the counts the plan gives a trainer
    (each host's GPUs shared evenly by its trainers, as clusterctl/host/layout.py does); more than one: refused."""
    k = spec.kubernetes
    if k is not None and k.gpus_per_trainer is not None:
        return (k.gpus_per_trainer,)
    # a host with fewer GPUs than trainers is the layout's error (at its hosts[].gpus), not a count here
    return tuple(sorted({g // n for n, g in _trainers_per_host(spec) if n and (g == 0 or g >= n)})) or (0,)


def kubernetes_problems(spec: ClusterSpec) -> list[tuple[tuple, str]]:
    """(path, message) for each thing in a spec with a kubernetes: section that its manifests cannot be: launcher
    mpi, object and pod host names Kubernetes refuses, env names the pods set themselves, GPUs and extended resources
    the API server refuses or clusterctl would contradict, then (when none of those) what is too large for a pod to
    start or for a ConfigMap (_size_problems). `k8s render` (which makes no check of its own) and every command that
    loads the spec say the same."""
    k, job = spec.kubernetes, spec.job
    found: list[tuple[tuple, str]] = []
    if job.launcher == "mpi":
        found.append((("job", "launcher"), "launcher: mpi is not supported under Kubernetes; use launcher: ssh (one "
                      "process per pod)"))
    shape = k8s_shape(spec)
    name = shape.name
    if name and not name[0].isalpha():  # the Service's name is an RFC 1035 label; kubernetes.name is checked as one
        found.append((("name",), f"the job's Service would be named {name!r}, and a Service's name starts with a "
                      "letter; set kubernetes.name"))
    for role, count in (("pserver", shape.pservers), ("trainer", shape.trainers)):  # each role's last pod has its longest name
        longest = f"{name}-{role}-{max(count - 1, 0)}"
        if count and (len(longest) > 63 or not name):
            found.append((("kubernetes", "name") if k.name else ("name",),
                          f"pod host names like {longest!r} must be 1-63 characters; set a shorter kubernetes.name"))
            break
    for var in job.env:
        if var in POD_ENV or (var in PSERVER_POD_ENV and job.mode == "pserver"):
            found.append((("job", "env", var), f"{var} is clusterctl's, set in every pod by its manifest; remove it "
                          "from job.env"))
    gpus = k8s_gpus_per_trainer(spec)
    if len(gpus) > 1:
        found.append((("kubernetes",), f"the plan gives trainers {' or '.join(map(str, gpus))} GPUs; every pod of a "
                      "Job asks for the same: set kubernetes.gpus_per_trainer"))
    for role, kinds in k.resources.items():
        found += _resource_problems(spec, role, kinds, gpus[0] if role == "trainer" and len(gpus) == 1 else 0)
    if not found:  # sizes of manifests that can be made at all (their names, their GPUs)
        found += _size_problems(spec, shape)
    return found


def _resource_problems(spec: ClusterSpec, role: str, kinds: dict, gpus: int) -> list[tuple[tuple, str]]:
    """What the API server refuses of a role's extended resources (a request without a limit, or other than it), and
    a trainer's GPU resource other than the `gpus` clusterctl sets as its limit (and CUDA_VISIBLE_DEVICES names)."""
    found = []
    requests, limits = kinds.get("requests", {}), kinds.get("limits", {})
    at = ("kubernetes", "resources", role)
    gpu = spec.kubernetes.gpu_resource
    for res in dict.fromkeys([*requests, *limits]):
        if gpus and res == gpu:
            for kind, given in (("requests", requests.get(res)), ("limits", limits.get(res))):
                if given is not None and _amount(given) != gpus:
                    found.append(((*at, kind, res), f"{given}, but each trainer pod gets {gpus} GPU(s) (hosts[].gpus "
                                  "or kubernetes.gpus_per_trainer): the limit clusterctl sets and CUDA_VISIBLE_DEVICES "
                                  "names; remove it, or set kubernetes.gpus_per_trainer"))
            continue
        if not is_extended_resource(res) or res not in requests:
            continue
        if res not in limits:
            found.append(((*at, "requests", res), f"{res} is an extended resource: Kubernetes takes a request of one "
                          f"only with a limit equal to it; set limits.{res} (or only the limit)"))
        elif _amount(requests[res]) != _amount(limits[res]):
            found.append(((*at, "requests", res), f"{requests[res]} but limits.{res} is {limits[res]}: Kubernetes "
                          "takes an extended resource's request only equal to its limit"))
    return found


# ------------------------------------------------------------------------------ kubernetes: the manifests' content
# What every pod's environment, argv and ConfigMap hold is decided here, and clusterctl.k8s places it in the objects:
# the sizes kubernetes_problems checks are those of what `k8s render` writes, computed from the spec alone (no plan)
# so that loading a spec of 10,000 processes checks them in milliseconds.

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
    trainers = sum(n for n, _ in _trainers_per_host(spec))
    pservers = spec.job.pservers if spec.job.mode == "pserver" else 0
    if isinstance(pservers, PserversPerHost):  # on each host of the job, not on a spare (as the plan lays them out)
        pservers = pservers.per_host * sum(1 for h in spec.hosts if not h.spare)
    elif isinstance(pservers, tuple):
        pservers = len(pservers)
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
    values = k8s_placeholders(spec, shape)
    for role, count, port in (("trainer", shape.trainers, job.ports.trainer),
                              ("pserver", shape.pservers, job.ports.pserver)):
        if not count:
            continue
        host = f"{shape.name}-{role}-{count - 1}.{shape.name}"
        longest = dict(values, role=role, id=str(count - 1), trainer_id=str(count - 1), host=host,
                       current_endpoint=f"{host}:{port}")
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
