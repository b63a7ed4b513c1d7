"""`agent preflight` (ports, entrypoints, scripts, log and state dirs) and `agent wait-ports`."""

import errno
import os
import socket
import time

from .common import InputError, emit, private_temp, script_arg, which
from .jobfile import format_endpoint, load_job, parse_endpoint
from .spawn import base_env


def _check_port(host, port):
    fam = socket.AF_INET6 if ":" in host else socket.AF_INET
    s = socket.socket(fam, socket.SOCK_STREAM)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((host, port))
    except socket.gaierror as e:
        return "address_unknown", str(e)
    except OSError as e:
        if e.errno == errno.EADDRINUSE:
            return "port_in_use", e.strerror
        if e.errno == errno.EADDRNOTAVAIL:
            return "address_not_local", e.strerror
        return "port_unavailable", e.strerror or str(e)
    finally:
        s.close()
    return None


def _writable_dir(path):
    """None if files can be created in directory path (created as needed), else why not."""
    probe = path
    while not os.path.exists(probe):
        parent = os.path.dirname(probe)
        if parent == probe:
            break
        probe = parent
    if not os.path.isdir(probe):
        return "%s is not a directory" % probe
    if probe != path:
        return None if os.access(probe, os.W_OK | os.X_OK) else "%s is not writable" % probe
    try:
        fd, tmp = private_temp(path, ".clusterctl-preflight-")
    except OSError as e:
        return "%s is not writable: %s" % (path, e.strerror)
    os.close(fd)
    os.unlink(tmp)
    return None


def _under_home(relative):
    """A hint where a relative program or script missing from the workspace is a file under the login's home (a venv
    that provision made there: `.venvs/x/bin/python`, which a relative path does not reach), else ''."""
    if os.path.isabs(relative):
        return ""
    there = os.path.normpath(os.path.join(os.path.expanduser("~"), relative))
    if not os.path.isfile(there):
        return ""
    return " (relative to the workspace; %s is there: give its absolute path)" % there


def _master(process):
    """HOST:PORT of the trainers' master (MASTER_ADDR, MASTER_PORT) where `process` is rank 0; else None."""
    env = process["env"]
    if process["role"] != "trainer" or env.get("RANK") != "0" or not env.get("MASTER_ADDR"):
        return None
    try:
        return format_endpoint(env["MASTER_ADDR"], int(env.get("MASTER_PORT", "")))
    except ValueError:  # a user's MASTER_PORT that is no number: the program's to say
        return None


def _reserved(job, is_coordinator, planned):
    """An elastic job's ports that this host may need at a later attempt (the plan reserved them on every host:
    clusterctl/host/layout.py): the control port, where it listens if it takes over as coordinator, and, on a
    host with trainers, the master port, where its first trainer listens if it becomes rank 0."""
    el = job.get("elastic")
    if el is None:
        return []
    own = next((h for h in el["hosts"] if h["index"] == el["index"]), None)
    if own is None:
        return []
    ports = el["job"]["ports"]
    out = []
    if not is_coordinator:
        out.append(("the job's control port (reserved: elastic job)", format_endpoint(own["endpoint"], ports["control"])))
    master = format_endpoint(own["endpoint"], ports["master"])
    if own["trainers"] and master not in planned:
        out.append(("the trainers' master port (reserved: elastic job)", master))
    return out


def preflight(job, jobdir=None, ports=True):
    """List of problems (dicts with kind, message and the path or endpoint) for a job on this host. `ports`: also
    bind every endpoint the job plans here (a Kubernetes pod leaves them out: its endpoints are its Service's DNS
    names, and its network namespace holds nothing of another job's)."""
    problems = []

    def add(kind, message, **kw):
        d = {"kind": kind, "message": message}
        d.update(kw)
        problems.append(d)

    endpoints = []
    for p in job["processes"]:
        name = "%s.%d" % (p["role"], p["id"])
        env = base_env(job["job"], jobdir or "", p["env"])
        cwd = p["cwd"]
        if not os.path.isdir(cwd):
            add("cwd_missing", "%s: working directory %s does not exist" % (name, cwd), process=name, path=cwd)
        exe = p["argv"][0]
        if "/" in exe:
            path = os.path.normpath(os.path.join(cwd, exe))
            if not os.path.isfile(path):
                add("entrypoint_missing", "%s: %s not found%s" % (name, path, _under_home(exe)), process=name,
                    path=path)
            elif not os.access(path, os.X_OK):
                add("entrypoint_not_executable", "%s: %s is not executable" % (name, path), process=name,
                    path=path)
        elif which(exe, env["PATH"]) is None:
            add("entrypoint_missing", "%s: %s not found in PATH=%s" % (name, exe, env["PATH"]), process=name,
                path=exe)
        script = script_arg(p["argv"])
        if script is not None:
            path = os.path.normpath(os.path.join(cwd, script))
            if not os.path.isfile(path):
                add("script_missing", "%s: script %s not found%s" % (name, path, _under_home(script)), process=name,
                    path=path)
        logdir = os.path.dirname(p["log"])
        why = _writable_dir(logdir)
        if why:
            add("log_dir_not_writable", "%s: log dir %s: %s" % (name, logdir, why), process=name, path=logdir)
        for ep in p["ports"]:
            endpoints.append((name, ep))
        master = _master(p)
        if master is not None:  # rank 0 listens there (torch's env:// rendezvous): the plan reserved it
            endpoints.append(("%s's master (rendezvous) port" % name, master))
    c = job["coordinator"]
    if c is not None and c["is_coordinator"]:
        endpoints.append(("coordinator", format_endpoint(c["address"], c["port"])))
    endpoints += _reserved(job, c is not None and c["is_coordinator"], {ep for _, ep in endpoints})
    if jobdir is not None:
        why = _writable_dir(jobdir)
        if why:
            add("state_dir_not_writable", "job dir %s: %s" % (jobdir, why), path=jobdir)
    seen = {}
    for name, ep in endpoints if ports else ():
        host, port = parse_endpoint(ep)
        norm = format_endpoint(host, port)
        if norm in seen:
            add("port_duplicate", "%s: %s is also planned for %s" % (name, norm, seen[norm]), process=name,
                endpoint=norm)
            continue
        seen[norm] = name
        res = _check_port(host, port)
        if res is not None:
            add(res[0], "%s: cannot bind %s: %s" % (name, norm, res[1]), process=name, endpoint=norm)
    return problems


def cmd_preflight(args):
    """Print the problems that would stop the job from starting on this host."""
    jobfile = os.path.abspath(args.jobfile)
    job = load_job(jobfile)
    problems = preflight(job, os.path.dirname(jobfile))
    emit({"ok": not problems, "job": job["job"], "host": job["host"], "problems": problems})
    return 0 if not problems else 1


def cmd_wait_ports(args):
    """Wait until every endpoint accepts TCP connections."""
    eps = []
    for text in args.endpoints.split(","):
        text = text.strip()
        if not text:
            continue
        try:
            eps.append((text, parse_endpoint(text)))
        except ValueError as e:
            raise InputError(str(e))
    if not eps:
        raise InputError("no endpoints given")
    if args.timeout < 0:
        raise InputError("--timeout must be >= 0")
    t0 = time.monotonic()
    deadline = t0 + args.timeout
    opened = {}
    errors = {}
    while True:
        for text, (host, port) in eps:
            if text in opened:
                continue
            remaining = max(0.05, min(1.0, deadline - time.monotonic()))
            try:
                socket.create_connection((host, port), timeout=remaining).close()
                opened[text] = round(time.monotonic() - t0, 3)
            except OSError as e:
                errors[text] = e.strerror or str(e) or type(e).__name__
        if len(opened) == len(eps) or time.monotonic() >= deadline:
            break
        time.sleep(min(0.1, max(0.0, deadline - time.monotonic())))
    closed = [t for t, _ in eps if t not in opened]
    emit({"ok": not closed, "open": [t for t, _ in eps if t in opened], "closed": closed,
          "errors": {t: errors.get(t) for t in closed}, "opened_after_s": opened,
          "elapsed_s": round(time.monotonic() - t0, 3)})
    return 0 if not closed else 1
