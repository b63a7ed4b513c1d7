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
from .sshconfig import Resolved, Target, unresolved

if TYPE_CHECKING:  # the spec models (pydantic) load only where a spec is laid out, not for a cached plan
    from .spec.models import ClusterSpec

__all__ = [
    "Host", "Process", "JobPlan", "MpiLaunch", "PlanError", "make_plan", "make_hosts", "ssh_targets", "render_args", "deal_shards", "DATA_ENV",
    "factor_env", "expand_env",
]

DATA_ENV = "CLUSTERCTL_DATA_FILES"


class PlanError(ClusterctlError):
    """The spec is well-formed but cannot be laid out (e.g. two endpoints on one host:port)."""

    exit_code = 2

    def __init__(self, path: tuple, message: str):
        super().__init__(message)
        self.path, self.message = path, message


@dataclass(frozen=True)
class Host:
    """A host as the remote layer needs it: where to connect, as whom, through which bastions.

    `address` is what the spec names (an IP, a host name or an ssh-config alias) and what `ssh` is
    given; `hostname`, `user` and `port` are what OpenSSH resolves it to (`ssh -G`); `jump` the
    bastions in between, first hop first; `train_address` what the other hosts use for its endpoints."""

    address: str
    port: int
    user: str
    index: int
    hostname: str = ""  # "" = address
    jump: tuple[str, ...] = ()
    train_address: str = ""  # "" = hostname
    jump_none: bool = False  # the spec said `proxy_jump: none` over a ProxyJump in the ssh config

    @property
    def label(self) -> str:
        """Short name used to prefix output lines: the address, plus the port when it is not 22."""
        return self.address if self.port == 22 else f"{self.address}:{self.port}"

    @property
    def connect_name(self) -> str:
        """The name or address the SSH connection finally goes to (the config's HostName)."""
        return self.hostname or self.address

    @property
    def endpoint_address(self) -> str:
        """The address in this host's endpoints: train_address, else the resolved HostName."""
        return self.train_address or self.hostname or self.address

    def to_json(self) -> dict:
        """What clusterctl connects to for this host, as `clusterctl plan --json` shows it."""
        return {"address": self.address, "user": self.user, "hostname": self.connect_name, "port": self.port,
                "jump": list(self.jump), "train_address": self.endpoint_address}


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
    restarts: int = 0
    restart_backoff: float = 1.0
    auth: str = "token"  # job.auth: "none" runs the job's servers unauthenticated
    backend: str = "ssh"  # where the job runs (clusterctl.backends)

    @functools.cached_property
    def trainers(self) -> tuple[Process, ...]:
        """Trainer processes in id order."""
        return tuple(p for p in self.processes if p.role == "trainer")

    @functools.cached_property
    def pservers(self) -> tuple[Process, ...]:
        """Pserver processes in id order."""
        return tuple(p for p in self.processes if p.role == "pserver")

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
        return out


def deal_shards(names: list[str], trainers: int) -> list[list[str]]:
    """Deal data files to trainers as seed 004 does: sorted file i goes to trainer i % trainers."""
    shards: list[list[str]] = [[] for _ in range(trainers)]
    for i, name in enumerate(sorted(names)):
        shards[i % trainers].append(name)
    return shards


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
        hosts.append(Host(
            address=h.address, port=r.port, user=r.user, index=i, hostname=r.hostname, jump=tuple(jump),
            train_address=h.train_address or "", jump_none=explicit == () and bool(r.proxy_jump),
        ))
    return tuple(hosts)


@_reuse_last
def make_plan(
    spec: ClusterSpec, *, data_files: list[str] | None = None, resolved: Sequence[Resolved] | None = None
) -> JobPlan:
    """Lay out every process of `spec`'s job; raise PlanError when the layout is impossible.

    `data_files` are the names (relative to `data.local`) of the spec's data shards, listed by the caller;
    `resolved` what OpenSSH resolves each host to (see make_hosts).
    """
    job = spec.job
    hosts = make_hosts(spec, resolved)
    pserver_hosts = _pserver_hosts(spec, hosts)
    trainer_slots = _trainer_slots(spec, hosts)

    used: dict[tuple[str, int], tuple[str, Host]] = {}

    def claim(host: Host, port: int, what: str, path: tuple) -> str:
        addr = host.endpoint_address
        key = (addr, port)
        if port > 65535:
            raise PlanError(path, f"{what} needs port {port} on {addr}, beyond 65535; lower the base port")
        if key in used:
            other, other_host = used[key]
            if other_host != host:  # one machine named twice, or a host that needs its own train_address
                raise PlanError(("hosts", host.index), (
                    f"{host.address} and hosts[{other_host.index}] ({other_host.address}) both "
                    f"resolve to {addr}: {other} and {what} would share {_hostport(addr, port)}; give one of them "
                    "hosts[].train_address (the address the other hosts reach it at)"))
            raise PlanError(("job", "ports"), f"two planned endpoints on {_hostport(addr, port)}: {other} and {what}")
        used[key] = (what, host)
        return _hostport(addr, port)

    control = claim(hosts[0], job.ports.control, "the job's control port", ("job", "ports", "control"))

    pservers: list[tuple[Host, int, str]] = []
    local_count: dict[Host, int] = {}
    for pid, host in enumerate(pserver_hosts):
        local = local_count.get(host, 0)
        local_count[host] = local + 1
        ep = claim(host, job.ports.pserver + local, f"pserver.{pid}", ("job", "ports", "pserver"))
        pservers.append((host, local, ep))

    trainers: list[tuple[Host, int, str, tuple[int, ...]]] = []
    for host, n, gpus in trainer_slots:
        for local in range(n):
            tid = len(trainers)
            ep = claim(host, job.ports.trainer + local, f"trainer.{tid}", ("job", "ports", "trainer"))
            trainers.append((host, local, ep, _gpu_share(gpus, n, local, host)))

    master_addr = (trainers[0][0] if trainers else hosts[0]).endpoint_address
    if trainers:
        claim(trainers[0][0], job.ports.master, "the trainers' master (rendezvous) port", ("job", "ports", "master"))

    pserver_eps = ",".join(ep for _, _, ep in pservers)
    trainer_eps = ",".join(ep for _, _, ep, _ in trainers)
    per_host_trainers = {h: n for h, n, _ in trainer_slots}
    common = {
        "CLUSTERCTL_JOB": spec.name,
        "PADDLE_TRAINERS_NUM": str(len(trainers)),
        "PADDLE_TRAINER_ENDPOINTS": trainer_eps,
    }
    if job.mode == "pserver":
        common["PADDLE_PSERVERS_IP_PORT_LIST"] = pserver_eps
        common["CLUSTERCTL_PS_MODE"] = job.sync
        common["CLUSTERCTL_PS_K_STEPS"] = str(job.k_steps)

    shards = deal_shards(data_files or [], len(trainers))
    processes: list[Process] = []
    for pid, (host, local, ep) in enumerate(pservers):
        env = _env(job.env, common, role="pserver", endpoint=ep)
        env["PADDLE_PSERVER_ID"] = str(pid)
        fmt = _placeholders(spec, "pserver", pid, pid, len(trainers), pserver_eps, trainer_eps, ep, host, local)
        processes.append(
            Process(host, "pserver", pid, None, local, ep, (), env, tuple(job.entrypoint) + render_args(job.args, fmt))
        )
    for tid, (host, local, ep, gpus) in enumerate(trainers):
        env = _env(job.env, common, role="trainer", endpoint=ep)
        env.update(
            PADDLE_TRAINER_ID=str(tid),
            RANK=str(tid),
            WORLD_SIZE=str(len(trainers)),
            LOCAL_RANK=str(local),
            LOCAL_WORLD_SIZE=str(per_host_trainers[host]),
            MASTER_ADDR=master_addr,
            MASTER_PORT=str(job.ports.master),
        )
        if spec.data is not None:
            env[DATA_ENV] = ":".join(posixpath.join(spec.data.remote.strip("/"), n) for n in shards[tid])
        if gpus:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, gpus))
            # Inside the process the visible GPUs are renumbered from 0.
            env["FLAGS_selected_gpus"] = ",".join(str(i) for i in range(len(gpus)))
        fmt = _placeholders(spec, "trainer", tid, tid, len(trainers), pserver_eps, trainer_eps, ep, host, local)
        processes.append(
            Process(host, "trainer", tid, tid, local, ep, gpus, env, tuple(job.entrypoint) + render_args(job.args, fmt))
        )

    workdir = spec.workspace.remote
    # beside the workspace, not in it: what a job writes into the workspace lives only as long as its
    # generation (dispatch switches to a new one, and recycles the old one a dispatch later)
    log_dir = job.log_dir if posixpath.isabs(job.log_dir) else posixpath.normpath(posixpath.join(workdir + ".logs", job.log_dir))
    mpi = _mpi_launch(spec, hosts, trainer_slots, len(trainers), workdir) if job.launcher == "mpi" else None
    return JobPlan(
        job=spec.name,
        mode=job.mode,
        hosts=hosts,
        processes=tuple(processes),
        workdir=workdir,
        log_dir=log_dir,
        control_endpoint=control,
        on_failure=job.on_failure,
        grace=job.grace,
        mpi=mpi,
        restarts=job.restarts,
        restart_backoff=job.restart_backoff,
        auth=job.auth,
        backend=spec.backend,
    )


def _hostport(addr: str, port: int) -> str:
    """`addr:port`, IPv6 addresses in brackets (`[fd00::1]:6170`), as endpoint lists carry them."""
    return f"[{addr}]:{port}" if ":" in addr else f"{addr}:{port}"


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
    if job.mpi == "mpich":
        hostfile = "".join(f"{h.endpoint_address}:{n}\n" for h, n in used)
        argv = [job.mpiexec, "-f", path, "-n", str(total), "-wdir", workdir, "-launcher", "ssh",
                "-envlist", ",".join(env)]
    else:
        hostfile = "".join(f"{h.endpoint_address} slots={n}\n" for h, n in used)
        argv = [job.mpiexec, "--hostfile", path, "-n", str(total), "--wdir", workdir, "--mca", "plm_rsh_agent", "ssh"]
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


def render_args(args: tuple[str, ...], values: dict[str, str]) -> tuple[str, ...]:
    """Substitute `{placeholder}`s in each arg; `{{`/`}}` are literal braces. Values are never re-parsed."""
    return tuple(arg.format_map(values) for arg in args)


def _placeholders(spec, role, pid, trainer_id, trainers, pserver_eps, trainer_eps, ep, host, local) -> dict[str, str]:
    return {
        "role": role,
        "id": str(pid),
        "trainer_id": str(trainer_id),
        "trainers": str(trainers),
        "pserver_endpoints": pserver_eps,
        "trainer_endpoints": trainer_eps,
        "current_endpoint": ep,
        "host": host.endpoint_address,
        "local_rank": str(local),
        "job": spec.name,
    }


def _env(user_env: dict[str, str], common: dict[str, str], *, role: str, endpoint: str) -> dict[str, str]:
    ip, port = endpoint.rsplit(":", 1)
    env = dict(user_env)
    env.update(common)
    env.update(
        CLUSTERCTL_ROLE=role,
        TRAINING_ROLE=role.upper(),
        POD_IP=ip,
        PADDLE_PORT=port,
        PADDLE_CURRENT_ENDPOINT=endpoint,
    )
    return env


def _pserver_hosts(spec: ClusterSpec, hosts: tuple[Host, ...]) -> list[Host]:
    # job.pservers is a count, a PserversPerHost or a tuple of addresses; told apart by shape, so that the
    # plan imports nothing of clusterctl.spec (which lays out the plan to check a spec: no import cycle)
    p = spec.job.pservers
    if spec.job.mode != "pserver":
        return []
    if isinstance(p, int):
        return [hosts[i % len(hosts)] for i in range(p)]
    if not isinstance(p, tuple):  # {per_host: N}
        return [h for h in hosts for _ in range(p.per_host)]
    by_addr = {h.address: h for h in reversed(hosts)}  # first host with that address wins
    return [by_addr[a] for a in p]


def _trainer_slots(spec: ClusterSpec, hosts: tuple[Host, ...]) -> list[tuple[Host, int, tuple[int, ...]]]:
    slots = []
    for h, hs in zip(hosts, spec.hosts):
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


def _gpu_share(gpus: tuple[int, ...], n: int, local: int, host: Host) -> tuple[int, ...]:
    """Split a host's GPUs evenly and contiguously among its `n` trainers."""
    if not gpus:
        return ()
    if n > len(gpus):
        raise PlanError(("hosts", host.index, "gpus"), f"{n} trainers on {host.address} but only {len(gpus)} GPUs")
    per = len(gpus) // n
    return gpus[local * per : (local + 1) * per]


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
