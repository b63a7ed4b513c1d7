"""The semantic checks of a validated spec: what its models cannot see alone (duplicate hosts, pservers
named but not listed) and what only laying out its plan finds. What a backend cannot honour is that
backend's check (clusterctl.backends), made by every command that runs the spec; so is what the Kubernetes pods'
content cannot be (their env names, their sizes: clusterctl.backends.k8s_content), of which a kubernetes: section's
own checks here know nothing.

Imports the models and clusterctl.plan; neither imports this module (clusterctl.spec.loading calls it)."""

from __future__ import annotations

from ..errors import SpecProblem
from ..plan import PlanError, make_plan
from ..yamlpos import Located
from .backends import _amount, is_extended_resource
from .errors import problem
from .fields import _did_you_mean
from .job import PserversPerHost
from .models import ClusterSpec

__all__ = ["semantic_problems", "kubernetes_section_problems", "k8s_object_name", "k8s_gpus_per_trainer",
           "k8s_pod_counts", "PSERVER_POD_ENV"]

# The pservers' mode variables: every pserver-mode pod's manifest sets them (as layout.py does over SSH). What else
# every pod sets itself is the pods' content (clusterctl.backends.k8s_content.POD_ENV).
PSERVER_POD_ENV = frozenset({"CLUSTERCTL_PS_MODE", "CLUSTERCTL_PS_K_STEPS"})


def semantic_problems(loc: Located, source: str, spec: ClusterSpec, *, layout: bool = True) -> list[SpecProblem]:
    """What is wrong with a well-typed `spec`: Slurm's constraints, hosts, pservers, then (with `layout`)
    its plan's layout."""
    problems: list[SpecProblem] = []
    if spec.kubernetes is not None:  # what `k8s render` (and backend: kubernetes) refuses, refused by every command
        problems += [problem(loc, source, path, message) for path, message in kubernetes_section_problems(spec)]
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


def k8s_pod_counts(spec: ClusterSpec) -> tuple[int, int]:
    """(trainers, pservers): the pods of a spec with a kubernetes: section, as the plan lays out its processes
    (pservers only in pserver mode, on each host of the job, not on a spare)."""
    trainers = sum(n for n, _ in _trainers_per_host(spec))
    pservers = spec.job.pservers if spec.job.mode == "pserver" else 0
    if isinstance(pservers, PserversPerHost):
        pservers = pservers.per_host * sum(1 for h in spec.hosts if not h.spare)
    elif isinstance(pservers, tuple):
        pservers = len(pservers)
    return trainers, pservers


def kubernetes_section_problems(spec: ClusterSpec, *, pod_env: frozenset = frozenset()) -> list[tuple[tuple, str]]:
    """(path, message) for each thing in a spec with a kubernetes: section that its manifests cannot be, as far as the
    spec alone says: launcher mpi, object and pod host names Kubernetes refuses, env names the pods set themselves
    (the pserver mode's, and `pod_env`: the names the pods' content sets, which the caller knows), GPUs and extended
    resources the API server refuses or clusterctl would contradict. What the manifests' content would make too
    large is clusterctl.backends.k8s_content's (kubernetes_problems: these, then the sizes)."""
    k, job = spec.kubernetes, spec.job
    found: list[tuple[tuple, str]] = []
    if job.launcher == "mpi":
        found.append((("job", "launcher"), "launcher: mpi is not supported under Kubernetes; use launcher: ssh (one "
                      "process per pod)"))
    name = k8s_object_name(spec)
    if name and not name[0].isalpha():  # the Service's name is an RFC 1035 label; kubernetes.name is checked as one
        found.append((("name",), f"the job's Service would be named {name!r}, and a Service's name starts with a "
                      "letter; set kubernetes.name"))
    trainers, pservers = k8s_pod_counts(spec)
    for role, count in (("pserver", pservers), ("trainer", trainers)):  # each role's last pod has its longest name
        longest = f"{name}-{role}-{max(count - 1, 0)}"
        if count and (len(longest) > 63 or not name):
            found.append((("kubernetes", "name") if k.name else ("name",),
                          f"pod host names like {longest!r} must be 1-63 characters; set a shorter kubernetes.name"))
            break
    for var in job.env:
        if var in pod_env or (var in PSERVER_POD_ENV and job.mode == "pserver"):
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
