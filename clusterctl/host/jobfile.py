"""The job file: the one schema, built on the controller (`build_job`) and checked on the host (`validate_job`).

The controller (clusterctl/ops/job.py) writes one job file per host with `build_job`, which checks what it
built with the same `validate_job` the agent runs on the host before it starts anything, so the two sides
cannot drift apart. Also here: the names of the environment variables that tag a job's processes.
"""

import json
import os
import re

from .common import InputError
from .policy import DEFAULT_POLICY, Policy, Timings

JOB_FILE = "job.json"  # the job dir is the directory that holds it
JOB_ENV = "CLUSTERCTL_JOB"
JOBDIR_ENV = "CLUSTERCTL_JOBDIR"
# The attempt number (0 = the first run), under clusterctl's name and torchrun's.
RESTART_ENV = ("CLUSTERCTL_RESTART_COUNT", "TORCHELASTIC_RESTART_COUNT")
# the job's processes' shared secret (pserver / PMI authentication), derived from the coordinator token;
# passed in the environment only (never argv, never logged)
TOKEN_ENV = "CLUSTERCTL_JOB_TOKEN"
# set to "none" (instead of a token) in the processes of a job whose spec says `job.auth: none` in so many
# words: the job's servers (pserver, PMI) then serve unauthenticated; without either they refuse to serve
AUTH_ENV = "CLUSTERCTL_AUTH"
AUTH_MODES = ("token", "none")

ROLES = ("pserver", "trainer")
JOB_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}\Z")

_ABSENT = object()


def process_entry(role, id, argv, env, cwd, log, ports=()):
    """One entry of a job file's "processes": what runs, where, with which env and log, on which ports."""
    return {"role": role, "id": id, "argv": list(argv), "env": dict(env), "cwd": cwd, "log": log,
            "ports": list(ports)}


def coordinator_entry(address, port, token, is_coordinator, hosts, trainers_total, timings=None):
    """A job file's "coordinator" section: where the coordinator listens, the job token, this host's part
    (and the protocol's `Timings`, when not the defaults)."""
    out = {"address": address, "port": port, "token": token, "is_coordinator": is_coordinator, "hosts": hosts,
           "trainers_total": trainers_total}
    if timings is not None:
        out.update(timings.to_job())
    return out


def build_job(job, host, processes, state_root, policy=DEFAULT_POLICY, start_trainers_after=_ABSENT,
              coordinator=_ABSENT, env=_ABSENT, auth="token", token=None, **policy_keys):
    """A job file (dict, for json.dumps) for one host, checked by the host's own validator; raise ValueError.

    `policy` (a `Policy`: on_failure, grace, restarts, restart_backoff) is written as top-level keys; its
    keys given one by one (`grace=5`, the older form) replace the policy's. The optional sections are
    written only when given (`start_trainers_after` may be given as None). `token` is the job's secret (the
    processes get a key derived from it); `auth: none` runs without one.
    """
    out = {"job": job, "host": host, "state_root": state_root}
    unknown = set(policy_keys) - set(policy.to_job())
    if unknown:
        raise TypeError("build_job() got unexpected keyword argument(s) %s" % ", ".join(sorted(unknown)))
    out.update(policy.to_job(), **policy_keys)
    out["auth"] = auth
    if token is not None:
        out["token"] = token
    if start_trainers_after is not _ABSENT:
        out["start_trainers_after"] = start_trainers_after
    if coordinator is not _ABSENT:
        out["coordinator"] = coordinator
    if env is not _ABSENT:
        out["env"] = env
    out["processes"] = list(processes)
    # paths may be relative to the host's home (`agent up` makes them absolute there): checked as if under /
    rooted = [dict(p, **{k: "/" + p[k] for k in ("cwd", "log") if isinstance(p.get(k), str) and p[k]
                         and not os.path.isabs(p[k])}) if isinstance(p, dict) else p for p in out["processes"]]
    try:
        validate_job(dict(out, processes=rooted), "job file for %s" % host)
    except InputError as e:
        raise ValueError(str(e)) from None
    return out


# -- elastic jobs (hosts[].spare, job.min_hosts): the "elastic" section -----------------------------------------
#
# Every host of an elastic job (spares too) gets the same section but its own "index": what any host needs to
# lay the job out again over another set of hosts with clusterctl/host/layout.py (clusterctl/host/elastic.py
# decides which set, and what this host runs in it). Paths ("workdir", "log_dir") are as the plan has them:
# relative to the host's home unless absolute.

ELASTIC_KEYS = ("index", "hosts", "job", "members", "spares", "min_hosts", "max_host_changes",
                "host_change_window", "workdir", "log_dir")
_LAYOUT_HOST_KEYS = ("index", "address", "endpoint", "trainers", "gpus")
_PORT_KEYS = ("control", "master", "pserver", "trainer")
_PSERVER_FORMS = ("count", "per_host", "on", "at")


def elastic_entry(index, hosts, job, members, spares, min_hosts, max_host_changes, host_change_window, workdir,
                  log_dir):
    """A job file's "elastic" section for the host at spec position `index` (see check_elastic)."""
    return {"index": index, "hosts": hosts, "job": job, "members": list(members), "spares": list(spares),
            "min_hosts": min_hosts, "max_host_changes": max_host_changes, "host_change_window": host_change_window,
            "workdir": workdir, "log_dir": log_dir}


def with_elastic(jobs, section):
    """Each job file of `jobs` ([(a job file `build_job` made, its host's index)]) with its "elastic" section:
    `section` with the host's own index. Checked by the host's own validator: what every host shares once (the
    hosts and the job: a check per host would cost the square of the hosts), each index against its file's host;
    raise ValueError."""
    out = []
    for n, (job, index) in enumerate(jobs):
        own = dict(section, index=index)
        where = "job file for %s: elastic" % job.get("host")
        try:
            if n == 0:
                _, by_index = _check_elastic(own, where, job.get("host"))
            else:
                _check_index(own, by_index, where, job.get("host"))
        except InputError as e:
            raise ValueError(str(e)) from None
        out.append(dict(job, elastic=own))
    return out


def _strs(where, value, allow_empty=True):
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value) or (not allow_empty and not value):
        raise InputError("%s: must be a %slist of strings" % (where, "" if allow_empty else "non-empty "))
    return list(value)


def _indices(where, value, known):
    if not isinstance(value, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in value):
        raise InputError("%s: must be a list of host indices" % where)
    if len(set(value)) != len(value):
        raise InputError("%s: a host is listed twice" % where)
    unknown = [i for i in value if i not in known]
    if unknown:
        raise InputError("%s: %d is not the index of one of the job's hosts" % (where, unknown[0]))
    return list(value)


def _layout_job(where, job):
    """The layout's job inputs (clusterctl/host/layout.py): the keys and types layout() reads."""
    if not isinstance(job, dict):
        raise InputError("%s: must be an object" % where)
    out = dict(job)
    out["name"] = _str(where + ".name", job.get("name"))
    if job.get("mode") not in ("collective", "pserver"):
        raise InputError("%s.mode: must be 'collective' or 'pserver', got %r" % (where, job.get("mode")))
    out["entrypoint"] = _strs(where + ".entrypoint", job.get("entrypoint"), allow_empty=False)
    out["args"] = _strs(where + ".args", job.get("args", []))
    env = job.get("env", {})
    if not isinstance(env, dict) or not all(isinstance(k, str) and k and "=" not in k and isinstance(v, str)
                                            for k, v in env.items()):
        raise InputError("%s.env: must be an object of string to string (no '=' in names)" % where)
    ports = job.get("ports")
    if not isinstance(ports, dict):
        raise InputError("%s.ports: must be an object" % where)
    for key in _PORT_KEYS:
        if _int("%s.ports.%s" % (where, key), ports.get(key), 1) > 65535:
            raise InputError("%s.ports.%s: must be <= 65535" % (where, key))
    ps = job.get("pservers")
    if not isinstance(ps, dict) or len(ps) != 1 or next(iter(ps)) not in _PSERVER_FORMS:
        raise InputError("%s.pservers: must be one of {count: N}, {per_host: N}, {on: [addresses]}, {at: [indices]}"
                         % where)
    form, value = next(iter(ps.items()))
    if form in ("count", "per_host"):
        _int("%s.pservers.%s" % (where, form), value)
    elif form == "on":
        _strs(where + ".pservers.on", value)
    elif not isinstance(value, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in value):
        raise InputError("%s.pservers.at: must be a list of host indices" % where)
    _str(where + ".sync", job.get("sync"))
    _int(where + ".k_steps", job.get("k_steps"), 1)
    data = job.get("data")
    if data is not None:
        if not isinstance(data, dict):
            raise InputError("%s.data: must be null or an object" % where)
        _str(where + ".data.remote", data.get("remote"))
        _strs(where + ".data.files", data.get("files"))
    if job.get("elastic") is not True:
        raise InputError("%s.elastic: must be true" % where)
    return out


def check_elastic(raw, where, host=None):
    """Check a job file's "elastic" section (for the job file of `host`) and return a copy; raise InputError."""
    return _check_elastic(raw, where, host)[0]


def _check_index(raw, by_index, where, host):
    index = _int(where + ".index", raw.get("index"))
    if index not in by_index:
        raise InputError("%s.index: %d is not the index of one of the job's hosts" % (where, index))
    if host is not None and by_index[index]["address"] != host:
        raise InputError("%s.index: hosts[%d] is %s, not this job file's host %s"
                         % (where, index, by_index[index]["address"], host))
    return index


def _check_elastic(raw, where, host):
    if not isinstance(raw, dict):
        raise InputError("%s: must be an object" % where)
    unknown = sorted(k for k in raw if k not in ELASTIC_KEYS)
    if unknown:
        raise InputError("%s: unknown key %r" % (where, unknown[0]))
    hosts = raw.get("hosts")
    if not isinstance(hosts, list) or not hosts:
        raise InputError("%s.hosts: must be a non-empty list" % where)
    by_index = {}
    for i, h in enumerate(hosts):
        w = "%s.hosts[%d]" % (where, i)
        if not isinstance(h, dict) or sorted(h) != sorted(_LAYOUT_HOST_KEYS):
            raise InputError("%s: must be an object with exactly %s" % (w, ", ".join(_LAYOUT_HOST_KEYS)))
        idx = _int(w + ".index", h["index"])
        if idx in by_index:
            raise InputError("%s.index: %d appears twice" % (w, idx))
        by_index[idx] = h
        _str(w + ".address", h["address"])
        _str(w + ".endpoint", h["endpoint"])
        _int(w + ".trainers", h["trainers"])
        if not isinstance(h["gpus"], list) or not all(isinstance(g, int) and not isinstance(g, bool) and g >= 0
                                                      for g in h["gpus"]):
            raise InputError("%s.gpus: must be a list of GPU indices" % w)
    out = dict(raw)
    out["index"] = _check_index(raw, by_index, where, host)
    out["job"] = _layout_job(where + ".job", raw.get("job"))
    out["members"] = _indices(where + ".members", raw.get("members"), by_index)
    out["spares"] = _indices(where + ".spares", raw.get("spares", []), by_index)
    if not out["members"]:
        raise InputError("%s.members: the job needs at least one host" % where)
    if set(out["members"]) & set(out["spares"]) or len(out["members"]) + len(out["spares"]) != len(hosts):
        raise InputError("%s: every host must be either a member or a spare, once" % where)
    out["min_hosts"] = _int(where + ".min_hosts", raw.get("min_hosts"), 1)
    if out["min_hosts"] > len(out["members"]):
        raise InputError("%s.min_hosts: %d, but the job starts on %d host(s)" % (where, out["min_hosts"],
                                                                                len(out["members"])))
    out["max_host_changes"] = _int(where + ".max_host_changes", raw.get("max_host_changes"))
    out["host_change_window"] = _num(where + ".host_change_window", raw.get("host_change_window"), 1.0)
    out["workdir"] = _str(where + ".workdir", raw.get("workdir"))
    out["log_dir"] = _str(where + ".log_dir", raw.get("log_dir"))
    return out, by_index


def parse_endpoint(text):
    """Split 'host:port' or '[v6]:port' into (host, port); raise ValueError."""
    if not isinstance(text, str) or ":" not in text:
        raise ValueError("expected HOST:PORT, got %r" % (text,))
    if text.startswith("["):
        end = text.find("]")
        if end < 0 or text[end + 1:end + 2] != ":":
            raise ValueError("expected [ADDR]:PORT, got %r" % (text,))
        host, port_s = text[1:end], text[end + 2:]
    else:
        host, _, port_s = text.rpartition(":")
    if not host or not port_s.isdigit() or not 0 < int(port_s) < 65536:
        raise ValueError("expected HOST:PORT with port 1-65535, got %r" % (text,))
    return host, int(port_s)


def format_endpoint(host, port):
    """Inverse of parse_endpoint."""
    return "[%s]:%d" % (host, port) if ":" in host else "%s:%d" % (host, port)


def _num(where, value, minimum=0.0):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < minimum:
        raise InputError("%s: must be a number >= %s, got %r" % (where, minimum, value))
    return float(value)


def _int(where, value, minimum=0):
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise InputError("%s: must be an integer >= %d, got %r" % (where, minimum, value))
    return value


def _str(where, value):
    if not isinstance(value, str) or not value:
        raise InputError("%s: must be a non-empty string, got %r" % (where, value))
    return value


def validate_job(raw, source):
    """Check a job dict and return a normalized copy; raise InputError naming the key."""
    if not isinstance(raw, dict):
        raise InputError("%s: top level must be a JSON object" % source)
    job = {}
    job["job"] = _str("%s: job" % source, raw.get("job"))
    if not JOB_ID_RE.match(job["job"]):
        raise InputError("%s: job: %r must match %s" % (source, job["job"], JOB_ID_RE.pattern))
    job["host"] = _str("%s: host" % source, raw.get("host", "localhost"))
    job["state_root"] = raw.get("state_root")
    job.update(Policy.from_job(raw, source).to_job())  # on_failure, grace, restarts, restart_backoff
    job["auth"] = raw.get("auth", "token")
    if job["auth"] not in AUTH_MODES:
        raise InputError("%s: auth: must be one of %s, got %r" % (source, "/".join(AUTH_MODES), job["auth"]))
    job["token"] = raw.get("token")
    if job["token"] is not None:
        _str("%s: token" % source, job["token"])

    shared_env = raw.get("env", {})  # what all processes share, written once; a process's own env adds to it
    if not isinstance(shared_env, dict) or not all(
            isinstance(k, str) and k and "=" not in k and isinstance(v, str) for k, v in shared_env.items()):
        raise InputError("%s: env: must be an object of string to string (no '=' in names)" % source)
    procs = raw.get("processes")
    if not isinstance(procs, list):
        raise InputError("%s: processes: must be a list" % source)
    seen = set()
    job["processes"] = []
    for i, p in enumerate(procs):
        where = "%s: processes[%d]" % (source, i)
        if not isinstance(p, dict):
            raise InputError("%s: must be an object" % where)
        role = p.get("role")
        if role not in ROLES:
            raise InputError("%s.role: must be one of %s, got %r" % (where, "/".join(ROLES), role))
        pid = _int(where + ".id", p.get("id"))
        if (role, pid) in seen:
            raise InputError("%s: duplicate process %s.%d" % (where, role, pid))
        seen.add((role, pid))
        argv = p.get("argv")
        if not isinstance(argv, list) or not argv or not all(isinstance(a, str) for a in argv) or not argv[0]:
            raise InputError("%s.argv: must be a non-empty list of strings" % where)
        env = p.get("env", {})
        if not isinstance(env, dict) or not all(
                isinstance(k, str) and k and "=" not in k and isinstance(v, str) for k, v in env.items()):
            raise InputError("%s.env: must be an object of string to string (no '=' in names)" % where)
        env = dict(shared_env, **env)
        if env.get(JOB_ENV, job["job"]) != job["job"]:
            raise InputError("%s.env.%s: %r differs from job %r" % (where, JOB_ENV, env[JOB_ENV], job["job"]))
        cwd = _str(where + ".cwd", p.get("cwd"))
        logp = _str(where + ".log", p.get("log"))
        if not os.path.isabs(cwd) or not os.path.isabs(logp):
            raise InputError("%s: cwd and log must be absolute paths" % where)
        ports = p.get("ports", [])
        if not isinstance(ports, list):
            raise InputError("%s.ports: must be a list of HOST:PORT strings" % where)
        for j, ep in enumerate(ports):
            try:
                parse_endpoint(ep)
            except ValueError as e:
                raise InputError("%s.ports[%d]: %s" % (where, j, e))
        job["processes"].append({"role": role, "id": pid, "argv": list(argv), "env": dict(env),
                                 "cwd": cwd, "log": logp, "ports": list(ports)})

    after = raw.get("start_trainers_after")
    if after is None:
        job["start_trainers_after"] = None
    else:
        where = "%s: start_trainers_after" % source
        if not isinstance(after, dict) or not isinstance(after.get("endpoints"), list):
            raise InputError("%s: must be an object with an endpoints list" % where)
        for j, ep in enumerate(after["endpoints"]):
            try:
                parse_endpoint(ep)
            except ValueError as e:
                raise InputError("%s.endpoints[%d]: %s" % (where, j, e))
        job["start_trainers_after"] = {"endpoints": list(after["endpoints"]),
                                       "timeout": _num(where + ".timeout", after.get("timeout", 120))}

    # an elastic job's section (spares, min_hosts): what this host needs to run its part of any later attempt
    job["elastic"] = None if raw.get("elastic") is None else check_elastic(raw["elastic"], "%s: elastic" % source,
                                                                           job["host"])

    coord = raw.get("coordinator")
    if coord is None:
        job["coordinator"] = None
    else:
        where = "%s: coordinator" % source
        if not isinstance(coord, dict):
            raise InputError("%s: must be an object" % where)
        c = {"address": _str(where + ".address", coord.get("address")),
             "port": _int(where + ".port", coord.get("port"), 1),
             "token": _str(where + ".token", coord.get("token")),
             "is_coordinator": coord.get("is_coordinator"),
             "hosts": _int(where + ".hosts", coord.get("hosts", 1), 1)}
        if c["port"] > 65535:
            raise InputError("%s.port: must be <= 65535" % where)
        if not isinstance(c["is_coordinator"], bool):
            raise InputError("%s.is_coordinator: must be true or false" % where)
        local_trainers = sum(1 for p in job["processes"] if p["role"] == "trainer")
        if "trainers_total" in coord:
            c["trainers_total"] = _int(where + ".trainers_total", coord["trainers_total"])
        elif c["is_coordinator"] and c["hosts"] > 1:
            raise InputError("%s.trainers_total: required on the coordinator of a multi-host job" % where)
        else:
            c["trainers_total"] = local_trainers
        c.update(Timings.from_job(coord, where).to_job())  # connect_timeout, heartbeat, peer_timeout, reconnect_timeout
        job["coordinator"] = c
    return job


def load_job(path):
    """Read and validate a job file; raise InputError."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise InputError("cannot read job file %s: %s" % (path, e.strerror or e))
    try:
        raw = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise InputError("job file %s is not valid JSON: %s" % (path, e))
    return validate_job(raw, path)
