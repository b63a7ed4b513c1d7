"""The plan: a pure function from a spec to every process, ID, endpoint, env var and argv.

Deterministic: hosts in spec order, then local slot. The same spec always gives the same plan.
No I/O here; every decision is unit-tested without a network.
"""

from __future__ import annotations

import functools
import posixpath
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .errors import ClusterctlError
from .host.elastic import HOST_CHANGE_WINDOW
from .host.layout import (DATA_ENV, LayoutError, deal_shards, endpoints_left_out, layout, pserver_placement,
                          render_args)
from .host.policy import DEFAULT_POLICY, Policy
from .sshconfig import Resolved, Target, unresolved
from .transport.host import Host  # defined below the plan, for the transports; re-exported here

if TYPE_CHECKING:  # the spec models (pydantic) load only where a spec is laid out, not for a cached plan
    from .spec.models import ClusterSpec

__all__ = [
    "Host", "Process", "JobPlan", "MpiLaunch", "PlanError", "make_plan", "make_hosts", "ssh_targets", "render_args", "deal_shards", "DATA_ENV",
    "factor_env", "expand_env", "layout_inputs",
]

# The most processes (pservers + trainers) one job may have: a spec asking for more is refused at its key
# before any process is laid out; a plan this size takes about a second to lay out (docs/spec.md).
MAX_PROCESSES = 16_384


class PlanError(ClusterctlError):
    """The spec is well-formed but cannot be laid out (e.g. two endpoints on one host:port)."""

    exit_code = 2

    def __init__(self, path: tuple, message: str):
        super().__init__(message)
        self.path, self.message = path, message


@dataclass(frozen=True)
class Process:
    """One process of the job, fully decided."""

    host: Host
    role: str  # "pserver" | "trainer"
    id: int
    rank: int | None
    local_rank: int
    endpoint: str
    gpus: tuple[int, ...]
    env: dict[str, str] = field(hash=False)
    argv: tuple[str, ...]

    @property
    def name(self) -> str:
        """`role.id`, the process's name in logs and status."""
        return f"{self.role}.{self.id}"

    @property
    def port(self) -> int:
        """The process's own port (from its endpoint)."""
        return int(self.endpoint.rsplit(":", 1)[1])

    def to_json(self, *, env: dict[str, str] | None = None) -> dict:
        """The JSON shape printed by `clusterctl plan --json`; `env` replaces the process's full env."""
        return {
            "host": self.host.address,
            "role": self.role,
            "id": self.id,
            "rank": self.rank,
            "local_rank": self.local_rank,
            "endpoint": self.endpoint,
            "gpus": list(self.gpus),
            "env": dict(self.env) if env is None else env,
            "argv": list(self.argv),
        }


@dataclass(frozen=True)
class MpiLaunch:
    """`launcher: mpi`: one mpiexec on the first host starts every rank over the hosts' SSH mesh."""

    host: Host
    argv: tuple[str, ...]
    hostfile: str  # its content: slots = trainers per host, hosts in spec order
    hostfile_path: str  # relative to the first host's home directory, where mpiexec runs
    # set in mpiexec's own environment (by the agent); argv names them only (-envlist / -x NAME), so
    # job.env values never appear on a command line that every user of the host can read in `ps`
    env: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        """JSON form shown by `clusterctl plan --json` (environment names only, no values)."""
        return {"host": self.host.address, "argv": list(self.argv), "hostfile": self.hostfile,
                "hostfile_path": self.hostfile_path, "env": sorted(self.env)}


@dataclass(frozen=True)
class JobPlan:
    """Every process of one job, plus the job-wide facts operations need."""

    job: str
    mode: str
    hosts: tuple[Host, ...]
    processes: tuple[Process, ...]
    workdir: str
    log_dir: str
    control_endpoint: str
    on_failure: str
    grace: float
    mpi: MpiLaunch | None = None
    restarts: int = DEFAULT_POLICY.restarts
    restart_backoff: float = DEFAULT_POLICY.restart_backoff
    auth: str = "token"  # job.auth: "none" runs the job's servers unauthenticated
    backend: str = "ssh"  # where the job runs (clusterctl.backends)
    # elastic jobs (hosts[].spare, job.min_hosts; docs/lifecycle.md#elastic-jobs): the spares (in `hosts`, so
    # that provisioning, dispatch, doctor and exec reach them, but running no process), the fewest hosts the
    # job may run on (None: not elastic), and every host's job-file section (clusterctl/host/jobfile.py's
    # elastic_entry less the host's own index: the layout's inputs, the first attempt's hosts, the bounds)
    spares: tuple[Host, ...] = ()
    min_hosts: int | None = None
    elastic: dict | None = field(default=None, hash=False)

    @functools.cached_property
    def members(self) -> tuple[Host, ...]:
        """The hosts the (first attempt of the) job runs on: every host that is not a spare, in spec order."""
        return tuple(h for h in self.hosts if h not in self.spares) if self.spares else self.hosts

    @property
    def policy(self) -> Policy:
        """What the supervisors do about failures (on_failure, grace, restarts, restart_backoff)."""
        return Policy(self.on_failure, self.grace, self.restarts, self.restart_backoff)

    @functools.cached_property
    def trainers(self) -> tuple[Process, ...]:
        """Trainer processes in id order."""
        return tuple(p for p in self.processes if p.role == "trainer")

    @functools.cached_property
    def pservers(self) -> tuple[Process, ...]:
        """Pserver processes in id order."""
        return tuple(p for p in self.processes if p.role == "pserver")

    @functools.cached_property
    def notes(self) -> tuple[str, ...]:
        """What the user should know before the job starts, one line each: what the layout had to leave out."""
        trainers = self.trainers
        if not trainers or "PADDLE_TRAINER_ENDPOINTS" in trainers[0].env:
            return ()
        return (endpoints_left_out(len(trainers), sum(len(p.endpoint) + 1 for p in trainers) - 1),)

    def on_host(self, host: Host) -> tuple[Process, ...]:
        """The processes planned on `host`."""
        return self._by_host.get(host, ())

    @functools.cached_property
    def _by_host(self) -> dict[Host, tuple[Process, ...]]:
        # one pass over the processes, not one per host (1,250 hosts x 10,000 processes)
        groups: dict[Host, list[Process]] = {}
        for p in self.processes:
            groups.setdefault(p.host, []).append(p)
        return {h: tuple(ps) for h, ps in groups.items()}

    def log_path(self, proc: Process) -> str:
        """Where `proc`'s stdout+stderr go on its host: `<log_dir>/<role>.<id>.log`."""
        return posixpath.join(self.log_dir, f"{proc.role}.{proc.id}.log")

    def to_json(self, *, expand: bool = False) -> dict:
        """The JSON shape printed by `clusterctl plan --json` (docs/spec.md); `expand`: every env in full.

        Factored (the default): `shared_env.all` holds what every process's env has, `shared_env.<role>`
        what every process of that role has besides, and each process's `env` the rest;
        `expand_env(doc, i)` puts process i's full env back together.
        """
        out: dict = {"job": self.job, "mode": self.mode, "hosts": [h.to_json() for h in self.hosts]}
        if expand:
            procs = [p.to_json() for p in self.processes]
        else:
            # an item every process has is one that every process of each role has
            by_role = {role: factor_env([p.env for p in self.processes if p.role == role])[0]
                       for role in ("pserver", "trainer") if any(p.role == role for p in self.processes)}
            shared_all = dict(functools.reduce(lambda a, b: a & b, (d.items() for d in by_role.values())))
            shared = {"all": {k: v for k, v in next(iter(by_role.values())).items() if k in shared_all}}
            shared.update({role: {k: v for k, v in d.items() if k not in shared_all} for role, d in by_role.items()})
            procs = [p.to_json(env={k: v for k, v in p.env.items() if k not in shared[p.role] and k not in shared_all})
                     for p in self.processes]
            out["shared_env"] = shared
        out["processes"] = procs
        if self.mpi is not None:
            out["mpi"] = self.mpi.to_json()
        if self.min_hosts is not None:
            out["elastic"] = {"spares": [h.address for h in self.spares], "min_hosts": self.min_hosts,
                              "max_host_changes": self.elastic["max_host_changes"] if self.elastic else 0}
        return out


def _reuse_last(fn):
    """Return the previous plan when asked again for the same spec object, hosts and data files.

    A caller that loads a spec with its layout check (clusterctl.spec.checks; commands skip it and lay out
    once) and then asks for the same plan gets it without a second layout (0.3 s at 10,000 processes). The key is the hosts that
    `resolved` makes (with `ssh.config: none`, what ssh would resolve is what no resolution gives).
    Specs are frozen; the plan returned is shared between such callers, so nobody may modify it (its
    env dicts included).
    """
    last: list = []

    @functools.wraps(fn)
    def wrapper(spec, *, data_files=None, resolved=None):
        key = (make_hosts(spec, resolved), tuple(data_files or ()))
        if last and last[0] is spec and last[1] == key:
            return last[2]
        plan = fn(spec, data_files=data_files, resolved=resolved)
        last[:] = [spec, key, plan]
        return plan

    return wrapper


def ssh_targets(spec: ClusterSpec) -> list[Target]:
    """Each host as the spec names it, with the user and port the spec sets explicitly (for resolution)."""
    return [Target(h.address, h.user or spec.ssh.user, h.port or spec.ssh.port) for h in spec.hosts]


def make_hosts(spec: ClusterSpec, resolved: Sequence[Resolved] | None = None) -> tuple[Host, ...]:
    """The spec's hosts as the remote layer needs them, from what `ssh -G` resolved for each (`resolved`,
    in spec order; None: taken literally, as with `ssh.config: none`)."""
    targets = ssh_targets(spec)
    found = list(resolved) if resolved is not None else [unresolved(t) for t in targets]
    hosts = []
    for i, (h, r) in enumerate(zip(spec.hosts, found, strict=True)):
        explicit = h.proxy_jump if h.proxy_jump is not None else (spec.ssh.proxy_jump or None)
        jump = explicit if explicit is not None else r.proxy_jump
        jump = (*r.hop_jump, *jump) if jump else ()  # the first bastion's own ProxyJump too, as ssh follows it
        hosts.append(Host(
            address=h.address, port=r.port, user=r.user, index=i, hostname=r.hostname, jump=tuple(jump),
            train_address=h.train_address or "", jump_none=explicit == () and bool(r.proxy_jump),
            hop_command=(r.hop_command or "") if jump else "",
        ))
    return tuple(hosts)


def layout_inputs(spec: ClusterSpec, hosts: tuple[Host, ...], data_files: list[str] | None) -> tuple[list[dict], dict]:
    """What clusterctl/host/layout.py lays out for `spec` on `hosts` (pure): the hosts' slots and the job, as
    JSON-able data (job files carry them, so that a host can lay the job out again)."""
    job = spec.job
    slots = _trainer_slots(spec, hosts)
    layout_hosts = [{"index": h.index, "address": h.address, "endpoint": h.endpoint_address, "trainers": n,
                     "gpus": list(gpus)} for h, n, gpus in slots]
    p = job.pservers
    if isinstance(p, int):  # told apart by shape: the plan imports nothing of clusterctl.spec
        pservers: dict = {"count": p}
    elif not isinstance(p, tuple):
        pservers = {"per_host": p.per_host}
    else:
        pservers = {"on": list(p)}
    ports = job.ports
    doc = {"name": spec.name, "mode": job.mode, "entrypoint": list(job.entrypoint), "args": list(job.args),
           "env": dict(job.env), "ports": {"control": ports.control, "master": ports.master, "pserver": ports.pserver,
                                           "trainer": ports.trainer},
           "pservers": pservers, "sync": job.sync, "k_steps": job.k_steps,
           "data": None if spec.data is None else {"remote": spec.data.remote, "files": list(data_files or [])}}
    return layout_hosts, doc


@_reuse_last
def make_plan(
    spec: ClusterSpec, *, data_files: list[str] | None = None, resolved: Sequence[Resolved] | None = None
) -> JobPlan:
    """Lay out every process of `spec`'s job; raise PlanError when the layout is impossible.

    `data_files` are the names (relative to `data.local`) of the spec's data shards, listed by the caller;
    `resolved` what OpenSSH resolves each host to (see make_hosts). The layout itself is
    clusterctl/host/layout.py's, which the hosts share.
    """
    job = spec.job
    hosts = make_hosts(spec, resolved)
    spares = tuple(h for h, hs in zip(hosts, spec.hosts) if hs.spare)
    members = tuple(h for h in hosts if h not in spares) if spares else hosts
    min_hosts = _check_elastic(spec, hosts, spares, members)
    _check_size(spec, members, _trainer_slots(spec, hosts, only=members))  # before any per-process list is built
    layout_hosts, layout_job = layout_inputs(spec, hosts, data_files)
    if min_hosts is not None:
        layout_job["elastic"] = True  # ports any later attempt may need are reserved on every host
    try:
        if min_hosts is not None:  # every host (spares too) can take its part: one layout over all of them
            layout(layout_hosts, dict(layout_job, pservers=_all_hosts_pservers(layout_job, layout_hosts, spares)))
        laid = layout([h for h in layout_hosts if hosts[h["index"]] not in spares] if spares else layout_hosts,
                      layout_job)
    except LayoutError as exc:
        raise PlanError(exc.path, exc.message) from None
    processes = tuple(
        Process(members[p["host"]], p["role"], p["id"], p["rank"], p["local_rank"], p["endpoint"], tuple(p["gpus"]),
                p["env"], tuple(p["argv"]))
        for p in laid["processes"]
    )
    trainer_slots = _trainer_slots(spec, hosts, only=members)
    workdir = spec.workspace.remote
    # beside the workspace, not in it: what a job writes into the workspace lives only as long as its
    # generation (dispatch switches to a new one, and recycles the old one a dispatch later)
    log_dir = job.log_dir if posixpath.isabs(job.log_dir) else posixpath.normpath(posixpath.join(workdir + ".logs", job.log_dir))
    mpi = _mpi_launch(spec, hosts, trainer_slots, sum(1 for p in processes if p.role == "trainer"), workdir) if job.launcher == "mpi" else None
    return JobPlan(
        job=spec.name,
        mode=job.mode,
        hosts=hosts,
        processes=processes,
        workdir=workdir,
        log_dir=log_dir,
        control_endpoint=laid["control"],
        on_failure=job.on_failure,
        grace=job.grace,
        mpi=mpi,
        restarts=job.restarts,
        restart_backoff=job.restart_backoff,
        auth=job.auth,
        backend=spec.backend,
        spares=spares,
        min_hosts=min_hosts,
        elastic=None if min_hosts is None else {
            "hosts": layout_hosts, "job": layout_job, "members": [h.index for h in members],
            "spares": [h.index for h in spares], "min_hosts": min_hosts, "max_host_changes": job.max_host_changes,
            "host_change_window": HOST_CHANGE_WINDOW, "workdir": workdir, "log_dir": log_dir},
    )


def _check_elastic(spec: ClusterSpec, hosts: tuple[Host, ...], spares: tuple[Host, ...],
                   members: tuple[Host, ...]) -> int | None:
    """The fewest hosts an elastic job runs on (None: not elastic); PlanError at the key that makes it impossible."""
    job = spec.job
    if job.min_hosts is None and not spares:
        return None
    if not members:
        raise PlanError(("hosts",), "every host is a spare: at least one host must run the job")
    min_hosts = len(members) if job.min_hosts is None else job.min_hosts
    if min_hosts > len(members):
        raise PlanError(("job", "min_hosts"), f"{min_hosts}, but the job starts on {len(members)} host(s)"
                                              + (f" (the {len(spares)} spare(s) only take a lost host's place)"
                                                 if spares else ""))
    if min_hosts == len(members) and not spares:
        return None  # nothing can change: not elastic
    if job.restarts == 0:
        raise PlanError(("job", "restarts"), "an elastic job (hosts[].spare, job.min_hosts) goes on without a lost "
                                             "host by restarting: set job.restarts (1 or more)")
    if job.launcher == "mpi":
        raise PlanError(("job", "launcher"), "launcher: mpi cannot change the job's hosts (mpiexec's world is fixed); "
                                             "elastic jobs (hosts[].spare, job.min_hosts) use launcher: ssh")
    if isinstance(job.pservers, tuple):
        spare_addresses = {h.address for h in spares}
        for i, addr in enumerate(job.pservers):
            if addr in spare_addresses:
                raise PlanError(("job", "pservers", i), f"{addr} is a spare: spares run nothing until they take a "
                                                        "lost host's place")
    return min_hosts


def _all_hosts_pservers(layout_job: dict, layout_hosts: list[dict], spares: tuple[Host, ...]) -> dict:
    """The pservers of the check that lays an elastic job out over every host: as planned (on the members)."""
    p = layout_job["pservers"]
    if "per_host" in p:  # the spares included, as they would be once members
        return p
    members = [h for h in layout_hosts if h["index"] not in {s.index for s in spares}]
    return {"at": pserver_placement(members, layout_job)}


# Placeholders whose value differs per rank: a single mpiexec command line cannot carry them.
_PER_RANK = ("id", "trainer_id", "current_endpoint", "host", "local_rank")


def _mpi_launch(spec: ClusterSpec, hosts, trainer_slots, total: int, workdir: str) -> MpiLaunch:
    """The mpiexec argv and hostfile for MPICH (hydra) or Open MPI, from the first host over ssh.

    The environment reaches the ranks by name only (values in mpiexec's own environment): hydra's
    ``-envlist`` (not ``-genvlist``/``-genvall``: with a global list set, hydra 5.0.2 dies on the first
    MPI_Comm_spawn, "duplicate setting: genv-prop"; spawned processes get mpiexec's whole environment,
    the job's tag and token included), Open MPI's ``-x NAME`` (which its spawns inherit too; with
    ``--map-by :OVERSUBSCRIBE`` unless ``mpi_args`` maps, so that a spawn finds a slot).
    """
    job = spec.job
    if job.mode != "collective":
        raise PlanError(("job", "launcher"), "launcher: mpi runs collective jobs; set mode: collective")
    for arg in job.args:
        for name in _PER_RANK:
            if "{" + name + "}" in arg:
                raise PlanError(("job", "args"), f"{{{name}}} differs per rank and cannot be used with launcher: mpi")
    values = {"role": "trainer", "trainers": str(total), "job": spec.name, "pserver_endpoints": "",
              "trainer_endpoints": "", **{k: "" for k in _PER_RANK}}
    args = render_args(job.args, values)
    env = {"CLUSTERCTL_JOB": spec.name, "CLUSTERCTL_ROLE": "trainer", "TRAINING_ROLE": "TRAINER",
           "PADDLE_TRAINERS_NUM": str(total), **job.env}
    path = posixpath.join(".clusterctl", "jobs", spec.name, "hostfile")
    used = [(h, n) for h, n, _ in trainer_slots if n]
    mpiexec = _mpiexec(spec)
    if job.mpi == "mpich":
        hostfile = "".join(f"{h.endpoint_address}:{n}\n" for h, n in used)
        argv = [mpiexec, "-f", path, "-n", str(total), "-wdir", workdir, "-launcher", "ssh",
                "-envlist", ",".join(env)]
    else:
        hostfile = "".join(f"{h.endpoint_address} slots={n}\n" for h, n in used)
        argv = [mpiexec, "--hostfile", path, "-n", str(total), "--wdir", workdir, "--mca", "plm_rsh_agent", "ssh"]
        for k in env:
            argv += ["-x", k]
        if not any(a.lstrip("-").startswith(("map-by", "oversubscribe")) for a in job.mpi_args):
            # the ranks fill the hostfile's slots; without this, Open MPI has no slot for a spawned process
            # (MPI_Comm_spawn fails), where hydra places spawns on the hosts regardless
            argv += ["--map-by", ":OVERSUBSCRIBE"]
        # mpirun refuses to run as root unless told twice; a job whose login is root runs as root whatever
        # mpirun thinks, so say so in mpirun's own environment (it matters for uid 0 only; not forwarded)
        env = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1", **env}
    argv += [*job.mpi_args, *job.entrypoint, *args]
    return MpiLaunch(hosts[0], tuple(argv), hostfile, path, env)


def _mpiexec(spec: ClusterSpec) -> str:
    """`job.mpiexec` as written; left out, where `provision.mpi` installs the job's MPI into `provision.python.venv`,
    that venv's `bin/mpiexec` (the one its mpi4py agrees with: `mpiexec` on PATH was not found on a host whose MPI
    is a venv's wheels). A venv under the home (`~/venv`, kept as `venv`) is relative to it, where mpiexec runs."""
    job, prov = spec.job, spec.provision
    mpi, python = getattr(prov, "mpi", None), getattr(prov, "python", None)
    if "mpiexec" in job.model_fields_set or mpi is None or python is None or mpi.implementation != job.mpi:
        return job.mpiexec
    return posixpath.join(python.venv, "bin", "mpiexec")


def _check_size(spec: ClusterSpec, hosts: tuple[Host, ...], trainer_slots) -> None:
    """PlanError at the key that asks for more than MAX_PROCESSES processes (counted, not laid out)."""
    p = spec.job.pservers
    if spec.job.mode != "pserver":
        pservers = 0
    elif isinstance(p, int):
        pservers = p
    elif isinstance(p, tuple):
        pservers = len(p)
    else:  # {per_host: N}
        pservers = p.per_host * len(hosts)
    trainers = sum(n for _, n, _ in trainer_slots)
    if pservers + trainers > MAX_PROCESSES:
        key = "pservers" if pservers > MAX_PROCESSES or pservers >= trainers else "trainers"
        raise PlanError(("job", key), f"{pservers} pserver(s) and {trainers} trainer(s): a job has at most "
                                      f"{MAX_PROCESSES} processes (docs/spec.md)")


def _trainer_slots(spec: ClusterSpec, hosts: tuple[Host, ...],
                   only: tuple[Host, ...] | None = None) -> list[tuple[Host, int, tuple[int, ...]]]:
    """(host, trainers, gpus) of each of `hosts` (every host of the spec, in order), or of those in `only`."""
    slots = []
    for h, hs in zip(hosts, spec.hosts):
        if only is not None and only is not hosts and h not in only:
            continue
        if hs.slots is not None:
            n = hs.slots
        elif spec.job.trainers == "gpu":
            n = len(hs.gpus)
        else:
            n = int(spec.job.trainers)
        slots.append((h, n, hs.gpus))
    if sum(n for _, n, _ in slots) == 0:
        raise PlanError(("job", "trainers"), "the job has no trainers")
    return slots


def factor_env(envs: Sequence[Mapping[str, str]]) -> tuple[dict[str, str], list[dict[str, str]]]:
    """Split `envs` into the items all of them have (same name and value) and, for each, the rest."""
    if not envs:
        return {}, []
    common = set(envs[0].items())
    for env in envs[1:]:
        if not common:
            break
        common.intersection_update(env.items())
    shared = {k: v for k, v in envs[0].items() if (k, v) in common}
    return shared, [{k: v for k, v in env.items() if k not in shared} for env in envs]


def expand_env(plan_json: Mapping, index: int) -> dict[str, str]:
    """The full environment of `plan_json["processes"][index]` (the JSON of `clusterctl plan --json`)."""
    proc = plan_json["processes"][index]
    shared = plan_json.get("shared_env") or {}
    return {**shared.get("all", {}), **shared.get(proc["role"], {}), **proc["env"]}
