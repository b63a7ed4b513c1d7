"""The semantic checks of a validated spec: what its models cannot see alone (duplicate hosts, pservers
named but not listed) and what only laying out its plan finds. What a backend cannot honour is that
backend's check (clusterctl.backends), made by every command that runs the spec.

Imports the models and clusterctl.plan; neither imports this module (clusterctl.spec.loading calls it)."""

from __future__ import annotations

from ..errors import SpecProblem
from ..host.pod import POD_NAME_ENV, SECRET_ENV
from ..plan import PlanError, make_plan
from ..yamlpos import Located
from .backends import _amount, is_extended_resource
from .errors import problem
from .fields import _did_you_mean
from .job import PserversPerHost
from .models import ClusterSpec

__all__ = ["semantic_problems", "kubernetes_problems", "k8s_object_name", "k8s_gpus_per_trainer", "POD_ENV"]

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
    """(path, message) for each thing in a spec with a kubernetes: section that its manifests cannot be: object and
    pod host names Kubernetes refuses, env names the pods set themselves, GPUs and extended resources the API server
    refuses or clusterctl would contradict. `k8s render` and every command that loads the spec say the same."""
    k, job = spec.kubernetes, spec.job
    found: list[tuple[tuple, str]] = []
    name = k8s_object_name(spec)
    if name and not name[0].isalpha():  # the Service's name is an RFC 1035 label; kubernetes.name is checked as one
        found.append((("name",), f"the job's Service would be named {name!r}, and a Service's name starts with a "
                      "letter; set kubernetes.name"))
    trainers = sum(n for n, _ in _trainers_per_host(spec))
    pservers = _pserver_count(spec) if job.mode == "pserver" else 0
    for role, count in (("pserver", pservers), ("trainer", trainers)):  # each role's last pod has its longest name
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
