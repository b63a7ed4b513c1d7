"""The layout: which process runs where, with which id, port, endpoint, environment and argv. Pure.

One function, `layout(hosts, job)`, used on both sides: the controller's planner (clusterctl/plan.py) lays
out a spec's job with it, and a host's supervisor can lay the same job out again over another set of hosts
(a lost host left out, a spare in its place) from the same inputs, which every job file carries. Both get
the same answer for the same inputs: IDs are deterministic (hosts in the order given, then local slot).

Inputs are plain JSON-able data, so that they travel in job files:

    hosts: [{"index": i (the host's position in the spec), "address": what the spec names,
             "endpoint": the address other hosts reach it at, "trainers": trainers on it,
             "gpus": [GPU ids]}], in layout order
    job:   {"name", "mode": "collective" | "pserver", "entrypoint": [...], "args": [...], "env": {...},
            "ports": {"control", "master", "pserver", "trainer"},
            "pservers": {"count": n} | {"per_host": n} | {"on": [addresses]} | {"at": [host indices]},
            "sync", "k_steps", "data": None | {"remote": dir, "files": [names]},
            "elastic": true (optional: the job may be laid out again over other hosts)}

`{"at": [i, ...]}` places pserver k on the host whose "index" is the k-th entry: an elastic job keeps each
pserver id's host across attempts that way (clusterctl/host/elastic.py). With "elastic", the control and
master ports are reserved on every host given (any of them may become the coordinator or rank 0's host).

Stdlib only, Python 3.9 (it runs on the hosts).
"""

import posixpath

__all__ = ["LayoutError", "layout", "render_args", "deal_shards", "hostport", "pserver_placement", "DATA_ENV",
           "PLACEHOLDERS", "exec_string_fits", "endpoints_left_out"]

DATA_ENV = "CLUSTERCTL_DATA_FILES"
PLACEHOLDERS = ("role", "id", "trainer_id", "trainers", "pserver_endpoints", "trainer_endpoints",
                "current_endpoint", "host", "local_rank", "job")


class LayoutError(Exception):
    """The job cannot be laid out on these hosts; `path` is the spec key to blame (a tuple)."""

    def __init__(self, path, message):
        super().__init__(message)
        self.path, self.message = tuple(path), message


def hostport(addr, port):
    """`addr:port`, IPv6 addresses in brackets (`[fd00::1]:6170`), as endpoint lists carry them."""
    return "[%s]:%d" % (addr, port) if ":" in addr else "%s:%d" % (addr, port)


def render_args(args, values):
    """Substitute `{placeholder}`s in each arg; `{{`/`}}` are literal braces. Values are never re-parsed."""
    return tuple(arg.format_map(values) for arg in args)


def deal_shards(names, trainers):
    """Deal data files to trainers as seed 004 does: sorted file i goes to trainer i % trainers."""
    shards = [[] for _ in range(trainers)]
    for i, name in enumerate(sorted(names)):
        shards[i % trainers].append(name)
    return shards


def _pserver_hosts(hosts, spec):
    if "at" in spec:
        by_index = {h["index"]: h for h in hosts}
        missing = [str(i) for i in spec["at"] if i not in by_index]
        if missing:
            raise LayoutError(("job", "pservers"), "pserver host(s) hosts[%s] not in the job's hosts" % "], hosts[".join(missing))
        return [by_index[i] for i in spec["at"]]
    if "count" in spec:
        return [hosts[i % len(hosts)] for i in range(spec["count"])]
    if "per_host" in spec:
        return [h for h in hosts for _ in range(spec["per_host"])]
    by_addr = {}
    for h in reversed(hosts):  # the first host with that address wins
        by_addr[h["address"]] = h
    missing = [a for a in spec["on"] if a not in by_addr]
    if missing:
        raise LayoutError(("job", "pservers"), "pserver host(s) %s not in the job's hosts" % ", ".join(missing))
    return [by_addr[a] for a in spec["on"]]


def pserver_placement(hosts, job):
    """The "index" of the host each pserver id runs on, in id order ([] for a collective job); LayoutError."""
    if job["mode"] != "pserver":
        return []
    return [h["index"] for h in _pserver_hosts(hosts, job["pservers"])]


def _gpu_share(gpus, n, local, host):
    """Split a host's GPUs evenly and contiguously among its `n` trainers."""
    if not gpus:
        return ()
    if n > len(gpus):
        raise LayoutError(("hosts", host["index"], "gpus"),
                          "%d trainers on %s but only %d GPUs" % (n, host["address"], len(gpus)))
    per = len(gpus) // n
    return tuple(gpus[local * per:(local + 1) * per])


def _role_env(user_env, common, role):
    env = dict(user_env)
    env.update(common)
    env.update(CLUSTERCTL_ROLE=role, TRAINING_ROLE=role.upper())
    return env


def _env(base, endpoint):
    ip, port = endpoint.rsplit(":", 1)
    env = base.copy()
    env.update(POD_IP=ip, PADDLE_PORT=port, PADDLE_CURRENT_ENDPOINT=endpoint)
    return env


MAX_EXEC_STRING = 131072  # Linux's MAX_ARG_STRLEN: the longest argument or environment string execve takes, NUL included


def exec_string_fits(text):
    """Whether execve takes `text` (an argument, or an environment entry NAME=value) as one string."""
    return len(text.encode("utf-8", "surrogateescape")) + 1 <= MAX_EXEC_STRING


def _exec_string(text, path, what):
    """LayoutError at `path` when `text` (an argument, or an environment entry NAME=value) is longer than execve
    takes: every process would fail to start (E2BIG, "Argument list too long")."""
    if not exec_string_fits(text):
        raise LayoutError(path, "%s would be %d bytes: Linux starts no process with an argument or environment "
                                "string over %d KiB (E2BIG)"
                          % (what, len(text.encode("utf-8", "surrogateescape")), MAX_EXEC_STRING // 1024))


def endpoints_left_out(trainers, size):
    """What to tell the user when PADDLE_TRAINER_ENDPOINTS (`size` bytes for `trainers` trainers) is left out."""
    return ("PADDLE_TRAINER_ENDPOINTS is left out of every process's environment: its %d endpoints take %d bytes, "
            "over the %d KiB Linux passes in one environment string (PaddlePaddle's collective mode reads it; "
            "PyTorch and mpi4py do not)" % (trainers, size, MAX_EXEC_STRING // 1024))


def layout(hosts, job):
    """Every process of `job` on `hosts` (see the module docs): {"control": endpoint, "master": address,
    "processes": [{"host", "role", "id", "rank", "local_rank", "endpoint", "gpus", "env", "argv"}]}, with
    "host" a position in `hosts`. Raise LayoutError when the layout is impossible."""
    if not hosts:
        raise LayoutError(("hosts",), "no hosts to lay the job out on")
    ports = job["ports"]
    used = {}

    def claim(host, port, what, path):
        addr = host["endpoint"]
        key = (addr, port)
        if port > 65535:
            raise LayoutError(path, "%s needs port %d on %s, beyond 65535; lower the base port" % (what, port, addr))
        if key in used:
            other, other_host = used[key]
            if other_host is not host:  # one machine named twice, or a host that needs its own train_address
                raise LayoutError(("hosts", host["index"]), (
                    "%s and hosts[%d] (%s) both resolve to %s: %s and %s would share %s; give one of them "
                    "hosts[].train_address (the address the other hosts reach it at)"
                    % (host["address"], other_host["index"], other_host["address"], addr, other, what,
                       hostport(addr, port))))
            raise LayoutError(("job", "ports"), "two planned endpoints on %s: %s and %s"
                              % (hostport(addr, port), other, what))
        used[key] = (what, host)
        return hostport(addr, port)

    control = claim(hosts[0], ports["control"], "the job's control port", ("job", "ports", "control"))
    position = {id(h): i for i, h in enumerate(hosts)}

    pservers = []
    local_count = {}
    if job["mode"] == "pserver":
        for pid, host in enumerate(_pserver_hosts(hosts, job["pservers"])):
            local = local_count.get(id(host), 0)
            local_count[id(host)] = local + 1
            ep = claim(host, ports["pserver"] + local, "pserver.%d" % pid, ("job", "ports", "pserver"))
            pservers.append((host, local, ep))

    trainers = []
    for host in hosts:
        n = host["trainers"]
        for local in range(n):
            tid = len(trainers)
            ep = claim(host, ports["trainer"] + local, "trainer.%d" % tid, ("job", "ports", "trainer"))
            trainers.append((host, local, ep, _gpu_share(host.get("gpus") or (), n, local, host)))
    if not trainers:
        raise LayoutError(("job", "trainers"), "the job has no trainers")

    master_addr = trainers[0][0]["endpoint"]
    claim(trainers[0][0], ports["master"], "the trainers' master (rendezvous) port", ("job", "ports", "master"))
    if job.get("elastic"):  # after a change of hosts, any host may hold the coordinator or rank 0
        for host in hosts[1:]:
            claim(host, ports["control"], "the job's control port (reserved: elastic job)", ("job", "ports", "control"))
        for host in hosts:
            if host is not trainers[0][0] and host["trainers"]:
                claim(host, ports["master"], "the trainers' master port (reserved: elastic job)",
                      ("job", "ports", "master"))

    pserver_eps = ",".join(ep for _, _, ep in pservers)
    trainer_eps = ",".join(ep for _, _, ep, _ in trainers)
    common = {"CLUSTERCTL_JOB": job["name"], "PADDLE_TRAINERS_NUM": str(len(trainers))}
    # Past ~8,000 trainers the list is longer than execve takes: left out rather than refused, since only
    # PaddlePaddle's collective mode reads it, and a PyTorch or mpi4py job of that size must start (the
    # controller says so: JobPlan.notes). The pservers' list is read by every pserver-mode process: refused.
    if exec_string_fits("PADDLE_TRAINER_ENDPOINTS=" + trainer_eps):
        common["PADDLE_TRAINER_ENDPOINTS"] = trainer_eps
    if job["mode"] == "pserver":
        _exec_string("PADDLE_PSERVERS_IP_PORT_LIST=" + pserver_eps, ("job", "pservers"),
                     "PADDLE_PSERVERS_IP_PORT_LIST (every pserver's endpoint)")
        common["PADDLE_PSERVERS_IP_PORT_LIST"] = pserver_eps
        common["CLUSTERCTL_PS_MODE"] = job["sync"]
        common["CLUSTERCTL_PS_K_STEPS"] = str(job["k_steps"])
    data = job.get("data")
    shards = deal_shards((data or {}).get("files") or [], len(trainers))
    entrypoint, args, user_env = tuple(job["entrypoint"]), tuple(job.get("args") or ()), job.get("env") or {}

    def values(role, pid, ep, host, local):
        return {"role": role, "id": str(pid), "trainer_id": str(pid), "trainers": str(len(trainers)),
                "pserver_endpoints": pserver_eps, "trainer_endpoints": trainer_eps, "current_endpoint": ep,
                "host": host["endpoint"], "local_rank": str(local), "job": job["name"]}

    # What the user's spec puts in a process's argv and environment must pass execve: checked here, once, on the
    # longest forms (the endpoints of every process differ in a few characters), not on every host at the launch.
    for name, value in user_env.items():
        _exec_string("%s=%s" % (name, value), ("job", "env", name), "%s=..." % name)
    if args:
        host, local, ep, _ = trainers[-1]
        for arg in render_args(args, values("trainer", len(trainers) - 1, ep, host, local)):
            _exec_string(arg, ("job", "args"), "an argument (after its placeholders)")
    def data_files(names):  # DATA_ENV's value for one trainer's shards
        return ":".join(posixpath.join(data["remote"].strip("/"), n) for n in names)

    if data is not None:
        longest = max((data_files(names) for names in shards), key=len)
        _exec_string(DATA_ENV + "=" + longest, ("data",), DATA_ENV + " (one trainer's data files)")

    processes = []
    pserver_base, trainer_base = _role_env(user_env, common, "pserver"), _role_env(user_env, common, "trainer")
    for pid, (host, local, ep) in enumerate(pservers):
        env = _env(pserver_base, ep)
        env["PADDLE_PSERVER_ID"] = str(pid)
        processes.append({"host": position[id(host)], "role": "pserver", "id": pid, "rank": None,
                          "local_rank": local, "endpoint": ep, "gpus": (), "env": env,
                          "argv": entrypoint + render_args(args, values("pserver", pid, ep, host, local)) if args
                          else entrypoint})
    for tid, (host, local, ep, gpus) in enumerate(trainers):
        env = _env(trainer_base, ep)
        env.update(PADDLE_TRAINER_ID=str(tid), RANK=str(tid), WORLD_SIZE=str(len(trainers)),
                   LOCAL_RANK=str(local), LOCAL_WORLD_SIZE=str(host["trainers"]), MASTER_ADDR=master_addr,
                   MASTER_PORT=str(ports["master"]))
        if data is not None:
            env[DATA_ENV] = data_files(shards[tid])
        if gpus:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, gpus))
            # Inside the process the visible GPUs are renumbered from 0.
            env["FLAGS_selected_gpus"] = ",".join(str(i) for i in range(len(gpus)))
        processes.append({"host": position[id(host)], "role": "trainer", "id": tid, "rank": tid,
                          "local_rank": local, "endpoint": ep, "gpus": gpus, "env": env,
                          "argv": entrypoint + render_args(args, values("trainer", tid, ep, host, local)) if args
                          else entrypoint})
    return {"control": control, "master": master_addr, "processes": processes}
