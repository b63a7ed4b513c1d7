#!/usr/bin/env python3
"""clusterctl host agent: a per-host, per-job supervisor for training processes.

This file is uploaded to every host of a job and run there with the host's
``python3`` (>= 3.9).  It is a single file and uses only the standard library.

Subcommands (each prints exactly one JSON object on stdout, except ``logs``)::

    launch JOBFILE                 start the supervisor daemon for the job
    status JOBDIR                  job and per-process state
    stop JOBDIR [--grace S]        SIGTERM groups, SIGKILL after grace, sweep by environ
    preflight JOBFILE              ports / entrypoints / log dirs problems
    wait-ports HOST:PORT,... --timeout S
    logs JOBDIR [--follow] [--role R] [--id N] [-n LINES] [--host-label H]

Exit codes: 0 success, 1 the operation did not succeed (details in the JSON),
2 bad input (JSON ``{"ok": false, "error": ...}``), 3 internal error.
See docs/agent.md for the design and the full JSON contract.
"""

from __future__ import annotations

import argparse
import errno
import fcntl
import hmac
import json
import os
import re
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback

__all__ = ["main", "load_job", "tagged_processes", "proc_stat", "parse_endpoint"]

PROTOCOL_VERSION = 2  # 2: mutual challenge-response (HMAC-SHA256 over both nonces), no token on the wire
JOB_FILE = "job.json"
STATE_FILE = "state.json"
LOCK_FILE = ".lock"
SUPERVISOR_LOG = "supervisor.log"
STOP_REQUEST = "stop-request.json"

JOB_ENV = "CLUSTERCTL_JOB"
JOBDIR_ENV = "CLUSTERCTL_JOBDIR"
# The attempt number (0 = the first run), under clusterctl's name and torchrun's.
RESTART_ENV = ("CLUSTERCTL_RESTART_COUNT", "TORCHELASTIC_RESTART_COUNT")
RESTART_BACKOFF_MAX = 300.0  # restarts: the back-off doubles per restart up to this
# Variables taken from the host's own environment; everything else comes from the job file.
BASE_ENV_KEYS = ("PATH", "HOME", "LANG", "LC_ALL", "USER", "LOGNAME", "TMPDIR")
DEFAULT_PATH = "/usr/local/bin:/usr/bin:/bin"

ROLES = ("pserver", "trainer")
JOB_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
TERMINAL_JOB_STATES = ("succeeded", "failed", "stopped")

MAX_MESSAGE = 64 * 1024  # protocol: longest accepted JSON line
MAX_DEPTH = 16  # protocol: deepest accepted JSON nesting (checked before json.loads)
NONCE_BYTES = 32
BACKOFF_MIN, BACKOFF_MAX = 0.1, 1.0  # peer: reconnect back-off (doubles, with jitter, up to the max)
LOG_BURST, LOG_WINDOW = 10, 10.0  # at most LOG_BURST lines per kind about bad connections per window
AUTH_TIMEOUT = 5.0  # protocol: a new connection must say hello within this
MAX_PENDING = 32  # protocol: unauthenticated connections kept at once
LAUNCH_REPORT_TIMEOUT = 60.0
PEER_DONE_LINGER = 5.0  # coordinator: after its own stop, how long it waits for peers' "done"
STOP_WAIT_EXTRA = 15.0  # agent stop: waits grace + this for the supervisor to finish
LOG_CHUNK = 64 * 1024
LOG_MAX_PARTIAL = 4 * 1024 * 1024  # --follow: a partial line longer than this is emitted in pieces

DEFAULT_TIMINGS = {
    "connect_timeout": 30.0,  # peers: first connection; coordinator: all peers connected
    "heartbeat": 1.0,  # ping interval, both directions
    "peer_timeout": 5.0,  # silence after which a connection is considered dead
    "reconnect_timeout": 3.0,  # peer: time to re-establish a lost coordinator connection
}


class InputError(Exception):
    """Bad input from the caller: reported as JSON with exit code 2."""


class UsageError(InputError):
    """Bad command line."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse would print usage and exit 2 with text
        raise UsageError("%s: %s" % (self.prog, message))


def emit(obj):
    """Print one JSON object on stdout."""
    sys.stdout.write(json.dumps(obj, sort_keys=True) + "\n")
    sys.stdout.flush()


def log(msg):
    """Timestamped line on stderr (the supervisor's stderr is supervisor.log)."""
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime())
    sys.stderr.write("%s.%03dZ %s\n" % (stamp, int(time.time() * 1000) % 1000, msg))
    sys.stderr.flush()


# ---------------------------------------------------------------------------
# job file


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
    job["on_failure"] = raw.get("on_failure", "stop")
    if job["on_failure"] not in ("stop", "continue"):
        raise InputError("%s: on_failure: must be 'stop' or 'continue', got %r" % (source, job["on_failure"]))
    job["grace"] = _num("%s: grace" % source, raw.get("grace", 10))
    job["restarts"] = _int("%s: restarts" % source, raw.get("restarts", 0))
    job["restart_backoff"] = _num("%s: restart_backoff" % source, raw.get("restart_backoff", 1.0))

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
        for key, default in DEFAULT_TIMINGS.items():
            c[key] = _num(where + "." + key, coord.get(key, default))
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


# ---------------------------------------------------------------------------
# /proc helpers


def proc_stat(pid):
    """(state, pgid, start_ticks) of a pid from /proc/<pid>/stat, or None if it is gone."""
    try:
        with open("/proc/%d/stat" % pid, "rb") as f:
            data = f.read()
    except OSError:
        return None
    try:
        rest = data[data.rindex(b")") + 2:].split()
        return rest[0].decode("ascii", "replace"), int(rest[2]), int(rest[19])
    except (ValueError, IndexError):
        return None


def pid_alive(pid, start_ticks=None):
    """True if pid exists, is not a zombie, and (if given) started at start_ticks."""
    if not pid:
        return False
    st = proc_stat(pid)
    if st is None or st[0] in ("Z", "X", "x"):
        return False
    return start_ticks is None or st[2] == start_ticks


def _read_environ(pid):
    try:
        with open("/proc/%d/environ" % pid, "rb") as f:
            return f.read().split(b"\0")
    except OSError:
        return None


def tagged_processes(job_id, jobdir=None):
    """Live pids whose /proc environ has CLUSTERCTL_JOB=<job_id> exactly.

    With jobdir, processes tagged with a different CLUSTERCTL_JOBDIR (another
    supervisor of the same job on this machine) are left out; untagged-by-jobdir
    ones are included.  Returns {pid: pgid}.
    """
    needle = ("%s=%s" % (JOB_ENV, job_id)).encode()
    mark = ("%s=%s" % (JOBDIR_ENV, jobdir)).encode() if jobdir else None
    prefix = ("%s=" % JOBDIR_ENV).encode()
    me = os.getpid()
    found = {}
    try:
        names = os.listdir("/proc")
    except OSError:
        return found
    for name in names:
        if not name.isdigit():
            continue
        pid = int(name)
        if pid == me:
            continue
        entries = _read_environ(pid)
        if not entries or needle not in entries:
            continue
        if mark is not None:
            dirs = [e for e in entries if e.startswith(prefix)]
            if dirs and mark not in dirs:
                continue
        st = proc_stat(pid)
        if st is None or st[0] in ("Z", "X", "x"):
            continue
        found[pid] = st[1]
    return found


def _group_members(pgids):
    """{pgid: [pids]} of live (non-zombie) processes in the given groups."""
    out = {}
    if not pgids:
        return out
    try:
        names = os.listdir("/proc")
    except OSError:
        return out
    for name in names:
        if not name.isdigit():
            continue
        st = proc_stat(int(name))
        if st is not None and st[1] in pgids and st[0] not in ("Z", "X", "x"):
            out.setdefault(st[1], []).append(int(name))
    return out


class Stopper:
    """SIGTERM to each process group, SIGKILL after grace, then a sweep by environ.

    groups: dicts with pid (== pgid, started with start_new_session), start_ticks,
    role, id.  A group is only signalled while it is provably ours: its leader is
    alive with the recorded start time, or the leader is gone (the kernel does not
    reuse a pid that is still a process-group id).  step() is non-blocking.
    """

    def __init__(self, job_id, jobdir, groups, grace, sweep=True):
        self.job_id = job_id
        self.jobdir = jobdir
        self.groups = [g for g in groups if g.get("pid")]
        self.grace = max(0.0, float(grace))
        self.sweep = sweep
        self.killed = []
        self._sent = set()
        self.phase = "new"
        self.leftover = []
        self.deadline = self.kill_deadline = 0.0

    def _ours(self, g):
        st = proc_stat(g["pid"])
        return st is None or st[2] == g.get("start_ticks")

    def _signal(self, how, target, sig, g=None):
        key = (how, target, sig)
        try:
            if how == "killpg":
                os.killpg(target, sig)
            else:
                os.kill(target, sig)
        except ProcessLookupError:
            return
        except PermissionError as e:
            log("cannot signal %s %d: %s" % (how, target, e))
            return
        if key not in self._sent:
            self._sent.add(key)
            entry = {"pid": target, "signal": signal.Signals(sig).name, "via": how}
            if g is not None:
                entry["role"], entry["id"] = g.get("role"), g.get("id")
            self.killed.append(entry)

    def _snapshot(self):
        ours = [g for g in self.groups if self._ours(g)]
        members = _group_members(set(g["pid"] for g in ours))
        live = [g for g in ours if members.get(g["pid"])]
        tagged = tagged_processes(self.job_id, self.jobdir) if self.sweep else {}
        grouped = set(g["pid"] for g in live)
        strays = {pid: pgid for pid, pgid in tagged.items() if pgid not in grouped}
        return live, strays

    def start(self, now):
        """Send SIGTERM to every live group and to tagged processes outside them."""
        self.phase = "term"
        self.deadline = now + self.grace
        self._term_round()

    def _term_round(self):
        live, strays = self._snapshot()
        for g in live:
            self._signal("killpg", g["pid"], signal.SIGTERM, g)
        for pid in strays:
            self._signal("kill", pid, signal.SIGTERM)
        return bool(live or strays)

    def step(self, now):
        """Advance; return True when nothing of the job is left (or it gave up)."""
        if self.phase == "done":
            return True
        if self.phase == "term":
            if self._term_round() and now < self.deadline:
                return False
            self.phase = "kill"
            self.kill_deadline = now + 5.0
        live, strays = self._snapshot()
        if not live and not strays:
            self.phase = "done"
            return True
        for g in live:
            self._signal("killpg", g["pid"], signal.SIGKILL, g)
        for pid in strays:
            self._signal("kill", pid, signal.SIGKILL)
        if now >= self.kill_deadline:
            self.leftover = sorted(set([g["pid"] for g in live] + list(strays)))
            log("giving up on pids %s (uninterruptible?)" % self.leftover)
            self.phase = "done"
            return True
        return False

    def run(self, poll=0.05):
        """Blocking version of start() + step()."""
        self.start(time.monotonic())
        while not self.step(time.monotonic()):
            time.sleep(poll)
        return self.killed


# ---------------------------------------------------------------------------
# state files


def write_json_atomic(path, obj):
    """Write JSON to path via a temporary file and os.replace."""
    d = os.path.dirname(path)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=d)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(obj, f, sort_keys=True, indent=1)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def read_state(jobdir):
    """state.json of a job dir as a dict, or None when absent/unreadable."""
    try:
        with open(os.path.join(jobdir, STATE_FILE), "rb") as f:
            state = json.loads(f.read().decode("utf-8"))
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    return state if isinstance(state, dict) else None


def supervisor_alive(state):
    """True when the supervisor recorded in state is running."""
    sup = (state or {}).get("supervisor") or {}
    return pid_alive(sup.get("pid"), sup.get("start_ticks"))


# the job's processes' shared secret (pserver / PMI authentication), derived from the coordinator token;
# passed in the environment only (never argv, never logged)
TOKEN_ENV = "CLUSTERCTL_JOB_TOKEN"


def process_token(token):
    """The secret the job's processes share (CLUSTERCTL_JOB_TOKEN): derived, so they never hold the agent's token."""
    return hmac.new(token.encode("utf-8"), b"clusterctl-job-processes", "sha256").hexdigest()


def base_env(job_id, jobdir, extra):
    """The host's base environment (BASE_ENV_KEYS) + the job's env + the job tags."""
    env = {k: os.environ[k] for k in BASE_ENV_KEYS if k in os.environ}
    env.setdefault("PATH", DEFAULT_PATH)
    env.update(extra)
    env[JOB_ENV] = job_id
    env[JOBDIR_ENV] = jobdir
    return env


def restart_delay(backoff, restart):
    """Seconds to wait before restart number `restart` (1 = the first): backoff doubled per restart, capped."""
    if restart <= 0 or backoff <= 0:
        return 0.0
    return min(backoff * 2.0 ** min(restart - 1, 30), max(backoff, RESTART_BACKOFF_MAX))


def attempt_log(path, attempt):
    """The log of `attempt` for a process whose first attempt logs to `path` (trainer.0.log -> trainer.0.attempt1.log)."""
    if attempt == 0:
        return path
    stem, dot, ext = path.rpartition(".")
    if dot and ext == "log" and "/" not in ext:
        return "%s.attempt%d.log" % (stem, attempt)
    return "%s.attempt%d" % (path, attempt)


# ---------------------------------------------------------------------------
# supervisor protocol connection


class ProtocolError(Exception):
    """Garbage on a coordinator connection."""


def json_depth_ok(line, limit=MAX_DEPTH):
    """True if the JSON text's bracket nesting (outside strings) stays within limit."""
    depth, in_str, esc = 0, False, False
    for ch in line:
        if in_str:
            if esc:
                esc = False
            elif ch == 0x5C:  # backslash
                esc = True
            elif ch == 0x22:  # quote
                in_str = False
        elif ch == 0x22:
            in_str = True
        elif ch == 0x5B or ch == 0x7B:  # [ {
            depth += 1
            if depth > limit:
                return False
        elif ch == 0x5D or ch == 0x7D:
            depth -= 1
    return True


def auth_proof(token, side, job, host, nonce_c, nonce_p):
    """HMAC-SHA256 (hex) of one side's role, the job, the peer host and both nonces, keyed by the job token."""
    msg = "\0".join(("clusterctl-agent/%d" % PROTOCOL_VERSION, side, job, host, nonce_c, nonce_p))
    return hmac.new(token.encode("utf-8"), msg.encode("utf-8"), "sha256").hexdigest()


def proof_ok(expected, got):
    """Constant-time comparison of a hex proof with whatever the other side sent."""
    return isinstance(got, str) and hmac.compare_digest(expected.encode(), got.encode("utf-8", "replace"))


def _nonce():
    return os.urandom(NONCE_BYTES).hex()


def _brief(value, limit=200):
    """A repr of untrusted data, cut short and free of control characters, for a log line."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "...(%d chars)" % len(text)


class LogLimiter:
    """Rate-limits log lines per kind: LOG_BURST per LOG_WINDOW, then one line with the count suppressed."""

    def __init__(self, burst=LOG_BURST, window=LOG_WINDOW):
        self.burst, self.window = burst, window
        self.kinds = {}  # kind -> [window start, lines in window, suppressed]

    def __call__(self, kind, msg, now=None):
        """Log msg unless this kind already logged `burst` lines in the current window."""
        now = time.monotonic() if now is None else now
        st = self.kinds.setdefault(kind, [now, 0, 0])
        if now - st[0] >= self.window:
            if st[2]:
                log("(%d more %s message(s) suppressed in the last %.0fs)" % (st[2], kind, now - st[0]))
            st[:] = [now, 0, 0]
        if st[1] < self.burst:
            st[1] += 1
            log(msg)
        else:
            st[2] += 1


class Conn:
    """One newline-delimited-JSON TCP connection (peer <-> coordinator)."""

    def __init__(self, sock, addr, now):
        self.sock = sock
        self.addr = "%s:%s" % (addr[0], addr[1]) if isinstance(addr, tuple) else str(addr)
        self.buf = b""
        self.host = None
        self.authed = False
        self.done = False
        self.last_rx = self.last_tx = now
        self.deadline = now + AUTH_TIMEOUT
        self.nonce = _nonce()  # ours: the coordinator's challenge, or the peer's own nonce
        self.their_nonce = None  # peer side: the coordinator's challenge

    def send(self, msg):
        """Send one message; False if the connection is broken."""
        try:
            self.sock.sendall(json.dumps(msg, sort_keys=True).encode() + b"\n")
        except OSError:
            return False
        self.last_tx = time.monotonic()
        return True

    def receive(self):
        """Read available data; return messages, or None on EOF; raise ProtocolError."""
        try:
            data = self.sock.recv(65536)
        except (BlockingIOError, socket.timeout, InterruptedError):
            return []
        except OSError:
            return None
        if not data:
            return None
        self.last_rx = time.monotonic()
        self.buf += data
        msgs = []
        while b"\n" in self.buf:
            line, self.buf = self.buf.split(b"\n", 1)
            if len(line) > MAX_MESSAGE:
                raise ProtocolError("line longer than %d bytes" % MAX_MESSAGE)
            if not line.strip():
                continue
            if not json_depth_ok(line):
                raise ProtocolError("JSON nested deeper than %d" % MAX_DEPTH)
            try:
                msg = json.loads(line.decode("utf-8"))
            except (UnicodeDecodeError, ValueError, RecursionError):
                raise ProtocolError("not JSON")
            if not isinstance(msg, dict) or not isinstance(msg.get("type"), str):
                raise ProtocolError("not a message object")
            msgs.append(msg)
        if len(self.buf) > MAX_MESSAGE:
            raise ProtocolError("line longer than %d bytes" % MAX_MESSAGE)
        return msgs

    def close(self):
        try:
            self.sock.close()
        except OSError:
            pass


# ---------------------------------------------------------------------------
# supervisor


def _private_opener(path, flags):
    """open() opener creating files 0600 (process logs)."""
    return os.open(path, flags, 0o600)


def _pdeathsig_setup(parent_pid):
    """Return a preexec_fn asking the kernel to SIGTERM the child if the supervisor dies."""
    try:
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        prctl = libc.prctl
    except (OSError, AttributeError, ImportError):
        return None
    PR_SET_PDEATHSIG = 1

    def setup():
        prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
        if os.getppid() != parent_pid:  # the supervisor died before prctl
            os._exit(1)
    return setup


class Supervisor:
    """Runs the job's local processes and takes part in the cross-host protocol."""

    def __init__(self, job, jobdir, report_fd=None):
        self.job = job
        self.jobdir = jobdir
        self.report_fd = report_fd
        self.job_id = job["job"]
        self.host = job["host"]
        self.grace = job["grace"]
        self.coord = job["coordinator"]
        self.is_coord = self.coord is None or self.coord["is_coordinator"]
        if self.coord is not None:  # the processes' shared secret (pserver / PMI auth): in their environment only
            for p in job["processes"]:
                p["env"][TOKEN_ENV] = process_token(self.coord["token"])
        self.timing = dict(DEFAULT_TIMINGS)
        if self.coord is not None:
            self.timing.update({k: self.coord[k] for k in DEFAULT_TIMINGS})
        self.trainers_total = (self.coord["trainers_total"] if self.coord is not None
                               else sum(1 for p in job["processes"] if p["role"] == "trainer"))
        self.t0 = time.monotonic()
        self.state = "starting"
        # restarts: the attempt being run (0 = the first), the finished ones, and whether the decision is final
        self.restarts = job.get("restarts", 0)
        self.restart_backoff = job.get("restart_backoff", 1.0)
        self.attempt = 0
        self.attempt_t0 = self.t0
        self.attempt_started_at = time.time()
        self.attempts = []  # finished attempts: {attempt, outcome, reason, failure, started_at, ended_at}
        self.final = False  # the current decision ends the job (no restart follows)
        self.restart_at = None  # coordinator: monotonic time of the next attempt, once every host has stopped
        self.pending_restart = None  # peer: attempt the coordinator asked for, started once the local stop is done
        self.term_handled = False
        self.outcome = None  # terminal state decided, while stopping
        self.reason = None
        self.failure = None
        self.failures = []
        self.decided_at = None
        self.stop_done_at = None
        self.stopper = None
        self.stop_done = False
        self.stop_report = None
        self.term_requested = False
        self.waiting = None  # trainers held back until the pserver endpoints open (start_trainers_after)
        self.dirty = True
        self.sel = selectors.DefaultSelector()
        self.procs = []
        self.popens = {}
        for p in job["processes"]:
            rec = {"role": p["role"], "id": p["id"], "argv": p["argv"], "cwd": p["cwd"], "log": p["log"],
                   "ports": p["ports"], "pid": None, "start_ticks": None, "state": "pending",
                   "exit_code": None, "started_at": None, "ended_at": None, "error": None, "signalled": False,
                   "logs": []}
            self.procs.append(rec)
        self.local_exits = []
        # coordinator side
        self.listener = None
        self.pending = {}
        self.peers = {}  # host label -> Conn
        self.hosts = {}  # host label -> {"state": ..., "since": ...}
        self.exits = {}  # (role, id) -> event
        # peer side
        self.conn = None
        self.ever_connected = False
        self.welcomed = False
        self.lost_since = None
        self.lost_why = None
        self.rejected = False
        self.next_attempt = 0.0
        self.backoff = BACKOFF_MIN
        self.last_error = None
        self.bad_conns = 0  # unauthenticated / malformed connections dropped (coordinator)
        self.log_bad = LogLimiter()

    # -- bookkeeping ---------------------------------------------------

    def snapshot(self):
        procs = []
        for r in self.procs:
            procs.append({k: v for k, v in r.items() if k != "signalled"})
        state = {
            "version": PROTOCOL_VERSION, "job": self.job_id, "host": self.host, "jobdir": self.jobdir,
            "state": self.state, "outcome": self.outcome, "reason": self.reason, "failure": self.failure,
            "failures": self.failures, "on_failure": self.job["on_failure"], "grace": self.grace,
            "supervisor": {"pid": os.getpid(), "start_ticks": self.my_ticks, "started_at": self.started_at},
            "is_coordinator": self.is_coord, "processes": procs, "updated_at": time.time(),
            "stop": self.stop_report,
            "attempt": self.attempt, "restarts": self.restarts, "attempts": self.attempts,
            "attempt_started_at": self.attempt_started_at,
            "restart_pending": self.outcome is not None and not self.final,
            "restart_at": (time.time() + max(0.0, self.restart_at - time.monotonic())
                           if self.restart_at is not None else None),
        }
        if self.coord is not None:
            state["coordinator"] = {"address": self.coord["address"], "port": self.coord["port"],
                                    "hosts": self.coord["hosts"]}
            if self.is_coord:
                state["coordinator"]["trainers_total"] = self.trainers_total
                state["coordinator"]["rejected_connections"] = self.bad_conns
                state["hosts"] = self.hosts
            else:
                state["coordinator"]["connected"] = self.conn is not None and self.welcomed
        return state

    def write_state(self):
        write_json_atomic(os.path.join(self.jobdir, STATE_FILE), self.snapshot())
        self.dirty = False

    def report(self, obj):
        if self.report_fd is None:
            return
        try:
            os.write(self.report_fd, (json.dumps(obj, sort_keys=True) + "\n").encode())
        except OSError as e:
            log("cannot report to launcher: %s" % e)
        try:
            os.close(self.report_fd)
        except OSError:
            pass
        self.report_fd = None

    # -- main ------------------------------------------------------------

    def run(self):
        self.my_ticks = (proc_stat(os.getpid()) or (None, None, None))[2]
        self.started_at = time.time()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_term)
        # a handler, not SIG_IGN: ignored signals would be inherited by the children
        signal.signal(signal.SIGHUP, lambda s, f: None)
        log("supervisor %d for job %s on %s (%s), %d local processes"
            % (os.getpid(), self.job_id, self.host, "coordinator" if self.is_coord else "peer", len(self.procs)))
        if self.coord is not None and self.is_coord:
            ep = format_endpoint(self.coord["address"], self.coord["port"])
            try:
                fam = socket.AF_INET6 if ":" in self.coord["address"] else socket.AF_INET
                self.listener = socket.create_server((self.coord["address"], self.coord["port"]), family=fam)
            except OSError as e:
                msg = "cannot listen on %s: %s" % (ep, os.strerror(e.errno) if e.errno else e)
                log(msg)
                self.state, self.reason = "failed", msg
                for r in self.procs:
                    r["state"], r["error"] = "stopped", "not started: " + msg
                self.write_state()
                self.report({"ok": False, "error": msg, "pids": {}, "jobdir": self.jobdir,
                             "supervisor_pid": os.getpid()})
                return 1
            self.listener.setblocking(False)
            self.sel.register(self.listener, selectors.EVENT_READ, self._on_accept)
            log("coordinator listening on %s, expecting %d peer(s), %d trainer(s) in total"
                % (ep, self.coord["hosts"] - 1, self.trainers_total))
        self._start_attempt()
        self._loop()
        if self.waiting is not None:  # ended before the trainers were released
            self._report_launch("job %s: %s before the trainers started" % (self.state, self.reason))
        log("supervisor exiting, job state %s (%s)" % (self.state, self.reason))
        return 0

    def _start_attempt(self):
        """Spawn this attempt's local processes: pservers first, trainers at once or once the pservers listen."""
        if self.attempt:
            log("attempt %d of job %s (restart %d of %d)" % (self.attempt, self.job_id, self.attempt, self.restarts))
        after = self.job.get("start_trainers_after")
        if after and after["endpoints"] and any(r["role"] == "trainer" for r in self.procs):
            # pservers first; trainers once every pserver endpoint accepts connections (see _release_trainers)
            spawn_error = self._spawn_all(roles=("pserver",))
            if spawn_error is None:
                self.waiting = {"eps": list(after["endpoints"]), "open": set(), "next": 0.0,
                                "deadline": time.monotonic() + after["timeout"], "timeout": after["timeout"]}
        else:
            spawn_error = self._spawn_all()
        if self.state == "starting":
            self.state = "running"
        self.write_state()
        if self.waiting is None:
            self._report_launch(spawn_error)
        for r in self.procs:
            if r["state"] == "failed":
                self._local_exit(r)

    def _report_launch(self, error):
        self.report({"ok": error is None, "error": error, "jobdir": self.jobdir,
                     "supervisor_pid": os.getpid(),
                     "pids": {"%s.%d" % (r["role"], r["id"]): r["pid"] for r in self.procs if r["pid"]}})

    def _release_trainers(self, now):
        """Start the local trainers once every pserver endpoint accepts TCP connections (bounded)."""
        w = self.waiting
        if self.outcome is not None:  # the job was stopped or failed while waiting
            self.waiting = None
            for r in self.procs:
                if r["state"] == "pending":
                    r["state"], r["error"] = "stopped", "not started: the job ended first"
            self.dirty = True
            self._report_launch("job %s: %s before the trainers started" % (self.outcome, self.reason))
            return
        if now < w["next"]:
            return
        w["next"] = now + 0.2
        for ep in w["eps"]:
            if ep in w["open"]:
                continue
            try:
                socket.create_connection(parse_endpoint(ep), timeout=0.2).close()
                w["open"].add(ep)
            except OSError:
                pass
        if len(w["open"]) == len(w["eps"]):
            self.waiting = None
            log("pserver endpoints open: starting trainers")
            error = self._spawn_all(roles=("trainer",))
            self.dirty = True
            self._report_launch(error)
            for r in self.procs:
                if r["state"] == "failed" and r["role"] == "trainer":
                    self._local_exit(r)
            return
        if now >= w["deadline"]:
            self.waiting = None
            closed = [ep for ep in w["eps"] if ep not in w["open"]]
            msg = "pserver endpoint(s) %s did not accept connections within %gs" % (", ".join(closed), w["timeout"])
            log(msg)
            first = None
            for r in self.procs:
                if r["state"] == "pending":
                    r["state"], r["error"], r["ended_at"] = "failed", "not started: " + msg, time.time()
                    first = first or r
            self.dirty = True
            self._report_launch(msg)
            if first is not None:
                self._local_exit(first)

    def _spawn_all(self, roles=ROLES):
        preexec = _pdeathsig_setup(os.getpid())
        for r in self.procs:
            if r["role"] not in roles or r["state"] != "pending":
                continue
            spec = next(p for p in self.job["processes"] if p["role"] == r["role"] and p["id"] == r["id"])
            env = base_env(self.job_id, self.jobdir, spec["env"])
            for name in RESTART_ENV:
                env[name] = str(self.attempt)
            r["log"] = attempt_log(spec["log"], self.attempt)
            if not any(entry["attempt"] == self.attempt for entry in r["logs"]):
                r["logs"].append({"attempt": self.attempt, "path": r["log"]})
            try:
                os.makedirs(os.path.dirname(r["log"]), mode=0o700, exist_ok=True)
                if os.path.exists(r["log"]):  # keep the previous run's log, start this one fresh
                    os.replace(r["log"], r["log"] + ".1")
                with open(r["log"], "ab", opener=_private_opener) as logf:  # 0600: logs may hold secrets
                    popen = subprocess.Popen(
                        r["argv"], cwd=r["cwd"], env=env, stdin=subprocess.DEVNULL, stdout=logf,
                        stderr=subprocess.STDOUT, start_new_session=True, close_fds=True, preexec_fn=preexec)
            except (OSError, subprocess.SubprocessError) as e:
                err = "cannot start %s.%d (%s in %s): %s" % (
                    r["role"], r["id"], r["argv"][0], r["cwd"], getattr(e, "strerror", None) or e)
                log(err)
                r["state"], r["error"], r["ended_at"] = "failed", err, time.time()
                for rest in self.procs:
                    if rest["state"] == "pending" and rest["role"] in roles:
                        rest["state"], rest["error"] = "stopped", "not started: an earlier process failed to start"
                return err
            st = proc_stat(popen.pid)
            r.update(pid=popen.pid, start_ticks=st[2] if st else None, state="running",
                     started_at=time.time())
            self.popens[(r["role"], r["id"])] = popen
            log("started %s.%d pid %d: %s" % (r["role"], r["id"], popen.pid, r["argv"]))
        return None

    def _on_term(self, signum, frame):
        self.term_requested = True

    def _loop(self):
        while True:
            for key, _ in self.sel.select(timeout=0.1):
                key.data(key.fileobj)
            now = time.monotonic()
            self._reap()
            if self.waiting is not None:
                self._release_trainers(now)
            if self.term_requested and not self.term_handled:
                self.term_handled = True
                self._stop_requested()
            if self.coord is not None:
                if self.is_coord:
                    self._coordinator_tick(now)
                else:
                    self._peer_tick(now)
            if self.stopper is not None and not self.stop_done and self.stopper.step(now):
                self._stop_finished()
            if self.is_coord:
                self._restart_tick(now)
            if self.dirty:
                self.write_state()
            if self._finished(now):
                break
        for conn in list(self.peers.values()) + list(self.pending.values()):
            conn.close()
        if self.conn is not None:
            self.conn.close()
        if self.listener is not None:
            self.listener.close()

    def _finished(self, now):
        if not self.stop_done or not self.final:
            return False
        if not self.is_coord or self.coord is None:
            return True
        # the stop message is already sent; wait briefly for peers' "done" so state.json can show it
        waiting = [h for h, c in self.peers.items() if not c.done]
        return not waiting or now > self.stop_done_at + PEER_DONE_LINGER

    def _reap(self):
        for r in self.procs:
            popen = self.popens.get((r["role"], r["id"]))
            if popen is None or r["state"] != "running":
                continue
            rc = popen.poll()
            if rc is None:
                continue
            r["exit_code"], r["ended_at"] = rc, time.time()
            if r["signalled"]:
                r["state"] = "stopped"
            else:
                r["state"] = "exited" if rc == 0 else "failed"
            self.dirty = True
            log("%s.%d pid %d ended with %s -> %s" % (r["role"], r["id"], r["pid"], rc, r["state"]))
            if not r["signalled"]:
                self._local_exit(r)

    def _local_exit(self, r):
        ev = {"role": r["role"], "id": r["id"], "code": r["exit_code"], "host": self.host, "error": r["error"],
              "attempt": self.attempt}
        self.local_exits.append(ev)
        if self.is_coord:
            self._handle_exit(ev)
        elif self.conn is not None and self.welcomed:  # else the next hello carries it (`exits`)
            msg = dict(ev)
            msg["type"] = "exit"
            if not self.conn.send(msg):
                self._peer_lost("send failed")

    def _stop_requested(self):
        grace = self.grace
        try:
            with open(os.path.join(self.jobdir, STOP_REQUEST), "rb") as f:
                req = json.loads(f.read().decode("utf-8"))
            if isinstance(req, dict) and isinstance(req.get("grace"), (int, float)) and req["grace"] >= 0:
                grace = float(req["grace"])
        except (OSError, ValueError, UnicodeDecodeError):
            pass
        reason = "stop requested on %s" % self.host
        log(reason)
        if self.outcome is not None and self.final:
            return
        if not self.is_coord and self.conn is not None and self.welcomed:  # else the hello says `stopping`
            self.conn.send({"type": "stopping", "reason": reason})
        self._user_stop(reason, grace)

    def _user_stop(self, reason, grace=None):
        """A user's stop (on any host): final, it never leads to a restart, also while one is pending."""
        if self.outcome is None:
            self.decide("stopped", reason, grace=grace, restart=False)
        elif not self.final:
            self._finalize("stopped", reason, None)

    # -- decisions -------------------------------------------------------

    def _handle_exit(self, ev):
        """Coordinator: apply the job rules to one process exit anywhere in the job."""
        role, pid_, code, err = ev.get("role"), ev.get("id"), ev.get("code"), ev.get("error")
        if (role not in ROLES or isinstance(pid_, bool) or not isinstance(pid_, int)
                or not (code is None or (isinstance(code, int) and not isinstance(code, bool)))
                or not (err is None or isinstance(err, str)) or (code is None and err is None)):
            log("ignoring malformed exit event from %s: %r" % (ev.get("host"), ev))
            return
        key = (role, pid_)
        if self.outcome is not None or key in self.exits or ev.get("attempt", self.attempt) != self.attempt:
            return  # decided already, a repeat, or an exit of an earlier attempt
        self.exits[key] = ev
        failure = {"role": key[0], "id": key[1], "host": ev.get("host"), "exit_code": code}
        what = "%s.%s on %s" % (key[0], key[1], ev.get("host"))
        trainers = [e for k, e in self.exits.items() if k[0] == "trainer"]
        trainers_running = len(trainers) < self.trainers_total
        if err:
            failure["error"] = err
            self.failures.append(failure)
            self.decide("failed", "%s failed to start: %s" % (what, err), failure)
            return
        if code != 0 and (key[0] == "trainer" or trainers_running):
            self.failures.append(failure)
            self.dirty = True
            if self.job["on_failure"] == "stop":
                self.decide("failed", "%s exited with code %s" % (what, code), failure)
                return
            log("%s exited with code %s; on_failure=continue" % (what, code))
        if self.trainers_total and len(trainers) >= self.trainers_total:
            bad = [e for e in trainers if e.get("code") != 0]
            if not bad and not self.failures:
                self.decide("succeeded", "all %d trainers exited 0" % self.trainers_total)
            else:
                first = self.failures[0] if self.failures else None
                self.decide("failed", "all trainers ended; %d failure(s), first: %s.%s on %s code %s" % (
                    len(self.failures), first["role"], first["id"], first["host"], first["exit_code"]), first)

    def decide(self, outcome, reason, failure=None, grace=None, restart=None):
        """Fix the attempt's outcome; the coordinator broadcasts it; stop local processes.

        The decision is final unless `restart` (default: the coordinator's rule: a failure, not a failure
        to start, with restarts left), in which case the whole job starts again once every host stopped.
        """
        if self.outcome is not None:
            return
        if restart is None:
            restart = (self.is_coord and outcome == "failed" and self.attempt < self.restarts
                       and not (failure or {}).get("error"))
        self.final = not restart
        self.outcome, self.reason, self.failure = outcome, reason, failure
        self.decided_at = time.monotonic()
        log("job %s -> %s: %s%s" % (self.job_id, outcome, reason,
                                    "; restart %d of %d follows" % (self.attempt + 1, self.restarts) if restart else ""))
        if self.is_coord:
            for host, conn in list(self.peers.items()):
                self._send_stop(conn)
        self._begin_stop(self.grace if grace is None else grace)

    def _finalize(self, outcome, reason, failure):
        """Make a decision that awaited a restart final (a user's stop, the coordinator gone): the job ends."""
        self.final = True
        self.outcome, self.reason, self.failure = outcome, reason, failure
        self.restart_at = self.pending_restart = None
        log("job %s -> %s: %s (no restart)" % (self.job_id, outcome, reason))
        if self.is_coord:
            for host, conn in list(self.peers.items()):
                self._send_stop(conn)
        if self.stop_done:
            self.state = outcome
            self.stop_done_at = time.monotonic()
        self.dirty = True

    def _send_stop(self, conn):
        conn.send({"type": "stop", "state": self.outcome, "reason": self.reason, "failure": self.failure,
                   "attempt": self.attempt, "restart": not self.final})

    def _begin_stop(self, grace):
        self.state = "stopping"
        groups = []
        for r in self.procs:
            if r["state"] == "running":
                r["signalled"] = True
                groups.append(r)
            elif r["state"] == "pending":
                r["state"] = "stopped"
        self.stopper = Stopper(self.job_id, self.jobdir, groups, grace)
        self.stopper.start(time.monotonic())
        self.dirty = True

    def _stop_finished(self):
        self._reap()
        self.stop_done = True
        self.stop_done_at = time.monotonic()
        self.stop_report = {"killed": self.stopper.killed, "leftover": self.stopper.leftover,
                            "finished_at": time.time()}
        self.dirty = True
        log("local processes stopped; killed %s" % self.stopper.killed)
        if self.final:
            self.state = self.outcome
        else:
            self.state = "restarting"
            self.attempts.append({"attempt": self.attempt, "outcome": self.outcome, "reason": self.reason,
                                  "failure": self.failure, "started_at": self.attempt_started_at,
                                  "ended_at": time.time()})
        if not self.is_coord and self.conn is not None and self.welcomed:  # else the hello says `idle`
            self.conn.send({"type": "done", "host": self.host, "attempt": self.attempt})
        if not self.final and self.pending_restart is not None:
            self._next_attempt(self.pending_restart)

    # -- restarts ------------------------------------------------------------

    def _restart_tick(self, now):
        """Coordinator: once every host stopped the failed attempt, wait the back-off, then start the next."""
        if not self.stop_done or self.final:
            return
        if self.restart_at is None:
            waiting = [h for h, c in self.peers.items() if not c.done]
            if waiting and now < self.stop_done_at + self.grace + PEER_DONE_LINGER:
                return
            delay = restart_delay(self.restart_backoff, self.attempt + 1)
            self.restart_at = time.monotonic() + delay  # not `now`: the stop that just ended took time
            self.dirty = True
            log("restart %d of %d in %.1fs" % (self.attempt + 1, self.restarts, delay))
        if time.monotonic() >= self.restart_at:
            self._next_attempt(self.attempt + 1)

    def _next_attempt(self, attempt):
        """Start attempt number `attempt` on this host, on the same plan (the coordinator tells the peers)."""
        self.attempt = attempt
        self.attempt_t0 = time.monotonic()
        self.attempt_started_at = time.time()
        self.outcome = self.reason = self.failure = None
        self.final = False
        self.failures = []
        self.decided_at = self.restart_at = self.pending_restart = None
        self.stopper, self.stop_done, self.stop_report = None, False, None
        self.exits, self.local_exits = {}, []
        self.waiting = None
        self.popens = {}
        for r in self.procs:
            r.update(pid=None, start_ticks=None, state="pending", exit_code=None, started_at=None, ended_at=None,
                     error=None, signalled=False)
        self.state = "starting"
        if self.is_coord:
            for host, conn in list(self.peers.items()):
                conn.done = False
                self.hosts[host] = {"state": "connected", "since": time.time(), "addr": conn.addr}
                conn.send({"type": "restart", "attempt": attempt})  # a broken connection is noticed by the tick
        self.dirty = True
        self._start_attempt()

    # -- coordinator side -------------------------------------------------

    def _on_accept(self, listener):
        try:
            sock, addr = listener.accept()
        except OSError:
            return
        if len(self.pending) >= MAX_PENDING:
            self.bad_conns += 1
            self.dirty = True
            self.log_bad("overload", "too many unauthenticated connections; dropping %s" % (addr,))
            sock.close()
            return
        sock.settimeout(2.0)
        conn = Conn(sock, addr, time.monotonic())
        self.pending[sock] = conn
        self.sel.register(sock, selectors.EVENT_READ, self._on_readable)
        # mutual authentication: the peer proves the token over this nonce and its own, and so do we
        if not conn.send({"type": "challenge", "version": PROTOCOL_VERSION, "nonce": conn.nonce}):
            self._drop(conn, "send failed")

    def _drop(self, conn, why):
        try:
            self.sel.unregister(conn.sock)
        except (KeyError, ValueError):
            pass
        if self.pending.pop(conn.sock, None) is not None:
            self.bad_conns += 1  # an unauthenticated connection dropped: counted in state.json
            self.dirty = True
        if conn.host is not None and self.peers.get(conn.host) is conn:
            del self.peers[conn.host]
            if not conn.done:
                self.hosts[conn.host] = {"state": "lost" if self.outcome is None else "disconnected",
                                         "since": time.time(), "why": why}
                self.dirty = True
                if self.outcome is None:
                    self.decide("failed", "lost host %s: %s" % (conn.host, why),
                                {"host": conn.host, "role": None, "id": None, "exit_code": None})
        conn.close()

    def _conn_for(self, sock):
        if sock in self.pending:
            return self.pending[sock]
        for c in self.peers.values():
            if c.sock is sock:
                return c
        if self.conn is not None and self.conn.sock is sock:
            return self.conn
        return None

    def _on_readable(self, sock):
        conn = self._conn_for(sock)
        if conn is None:
            try:
                self.sel.unregister(sock)
            except (KeyError, ValueError):
                pass
            sock.close()
            return
        try:
            msgs = conn.receive()
        except ProtocolError as e:
            self.log_bad("garbage", "garbage from %s (%s): %s; closing" % (conn.addr, conn.host or "unauthenticated", e))
            if conn is self.conn:
                self._peer_lost("protocol error: %s" % e)
            else:
                self._drop(conn, "protocol error: %s" % e)
            return
        if msgs is None:
            if conn is self.conn:
                self._peer_lost("connection closed by coordinator")
            else:
                self._drop(conn, "connection closed")
            return
        for msg in msgs:
            try:
                if conn is self.conn:
                    self._peer_message(msg)
                    if conn is not self.conn:  # dropped while handling it
                        return
                elif not conn.authed:
                    self._hello(conn, msg)
                    if not conn.authed:
                        return
                else:
                    self._coordinator_message(conn, msg)
            except Exception as e:  # noqa: BLE001 - contained per connection: log it, drop the sender
                self.log_bad("bad-message", "bad message %s from %s: %s: %s"
                             % (_brief(msg), conn.addr, type(e).__name__, e))
                if conn is self.conn:
                    self._peer_lost("bad message from coordinator")
                else:
                    self._drop(conn, "bad message")
                return

    def _reject(self, conn, why, error):
        self.log_bad("rejected", "rejected connection from %s: %s" % (conn.addr, why))
        conn.send({"type": "error", "error": error, "version": PROTOCOL_VERSION})
        self._drop(conn, why)

    def _hello(self, conn, msg):
        if msg.get("type") != "hello":
            return self._reject(conn, "first message is not a hello", "expected hello")
        if msg.get("version") != PROTOCOL_VERSION:
            return self._reject(conn, "protocol version %s" % _brief(msg.get("version"), 20),
                                "protocol version mismatch: coordinator speaks %d, peer sent %s"
                                % (PROTOCOL_VERSION, _brief(msg.get("version"), 20)))
        host, nonce = msg.get("host"), msg.get("nonce")
        if (not isinstance(host, str) or not host or len(host) > 255 or not isinstance(nonce, str)
                or len(nonce) != 2 * NONCE_BYTES or not isinstance(msg.get("job"), str)):
            return self._reject(conn, "malformed hello", "malformed hello")
        want = auth_proof(self.coord["token"], "peer", msg["job"], host, conn.nonce, nonce)
        if not proof_ok(want, msg.get("proof")):
            return self._reject(conn, "bad token", "bad token")
        if msg["job"] != self.job_id:
            return self._reject(conn, "wrong job %s" % _brief(msg["job"]), "wrong job")
        del self.pending[conn.sock]
        old = self.peers.get(host)
        if old is not None:
            log("host %s reconnected; replacing its old connection" % host)
            try:
                self.sel.unregister(old.sock)
            except (KeyError, ValueError):
                pass
            old.close()
        conn.authed, conn.host = True, host
        self.peers[host] = conn
        self.hosts[host] = {"state": "connected", "since": time.time(), "addr": conn.addr}
        self.dirty = True
        log("host %s connected from %s" % (host, conn.addr))
        conn.send({"type": "welcome", "job": self.job_id,
                   "proof": auth_proof(self.coord["token"], "coordinator", self.job_id, host, conn.nonce, nonce)})
        self._rejoin(conn, msg)

    def _rejoin(self, conn, msg):
        """Coordinator: bring a peer that (re)connected to the job's attempt and state."""
        host = conn.host
        attempt = msg.get("attempt", 0)
        attempt = attempt if isinstance(attempt, int) and not isinstance(attempt, bool) else 0
        conn.done = bool(msg.get("idle")) and self.outcome is not None
        if msg.get("stopping"):
            self._user_stop(str(msg["stopping"]))
        if self.outcome is not None:
            self._send_stop(conn)
            return
        if attempt != self.attempt:  # it stopped an earlier attempt on its own: it joins this one
            log("host %s rejoined at attempt %d; sending it attempt %d" % (host, attempt, self.attempt))
            conn.send({"type": "restart", "attempt": self.attempt})
            return
        exits = msg.get("exits")
        for ev in exits if isinstance(exits, list) else []:
            if isinstance(ev, dict):
                ev = dict(ev, host=host)
                self._handle_exit(ev)
        if msg.get("failed") and self.outcome is None:  # it stopped this attempt by itself (lost us for a while)
            self.decide("failed", "host %s: %s" % (host, msg["failed"]),
                        {"host": host, "role": None, "id": None, "exit_code": None})

    def _coordinator_message(self, conn, msg):
        kind = msg["type"]
        if kind == "ping":
            return
        if kind == "exit":
            self._handle_exit({"role": msg.get("role"), "id": msg.get("id"), "code": msg.get("code"),
                               "error": msg.get("error"), "host": conn.host})
        elif kind == "stopping":
            self._user_stop(str(msg.get("reason") or "stop requested on %s" % conn.host))
        elif kind == "done":
            if msg.get("attempt", self.attempt) != self.attempt:
                return  # a late "done" of an earlier attempt
            conn.done = True
            self.hosts[conn.host] = {"state": "done", "since": time.time()}
            self.dirty = True
        else:
            log("ignoring unknown message type %r from %s" % (kind, conn.host))

    def _coordinator_tick(self, now):
        for conn in list(self.pending.values()):
            if now > conn.deadline:
                self.log_bad("rejected", "rejected connection from %s: no hello within %.0fs" % (conn.addr, AUTH_TIMEOUT))
                self._drop(conn, "no hello")
        for host, conn in list(self.peers.items()):
            if now - conn.last_tx >= self.timing["heartbeat"]:
                if not conn.send({"type": "ping"}):
                    self._drop(conn, "send failed")
                    continue
            if not conn.done and now - conn.last_rx > self.timing["peer_timeout"]:
                self._drop(conn, "no heartbeat for %.1fs" % (now - conn.last_rx))
        expected = self.coord["hosts"] - 1
        if (self.outcome is None and len(self.peers) < expected
                and now - self.attempt_t0 > self.timing["connect_timeout"]):
            self.decide("failed", "only %d of %d peer host(s) connected within %.0fs (connected: %s)" % (
                len(self.peers), expected, self.timing["connect_timeout"], sorted(self.peers) or "none"))

    # -- peer side ------------------------------------------------------------

    def _peer_tick(self, now):
        if self.conn is not None and not self.welcomed:
            if now > self.conn.deadline:
                self._peer_lost("coordinator did not authenticate within %.0fs" % AUTH_TIMEOUT)
            elif (self.lost_since is not None
                  and now - (self.conn.deadline - AUTH_TIMEOUT) > self.timing["reconnect_timeout"]):
                # reconnected, but nobody answers (a frozen or cut-off coordinator host still completes TCP handshakes)
                self._peer_lost("no answer from the coordinator within %.1fs" % self.timing["reconnect_timeout"])
            else:
                return
        if self.conn is not None:
            if now - self.conn.last_tx >= self.timing["heartbeat"]:
                if not self.conn.send({"type": "ping"}):
                    self._peer_lost("send failed")
                    return
            if now - self.conn.last_rx > self.timing["peer_timeout"]:
                self._peer_lost("no heartbeat for %.1fs" % (now - self.conn.last_rx))
            return
        if self.rejected or (self.outcome is not None and self.final):
            return
        ep = format_endpoint(self.coord["address"], self.coord["port"])
        if not self.ever_connected and now - self.t0 > self.timing["connect_timeout"]:
            why = "could not connect to coordinator %s within %.0fs: %s" % (
                ep, self.timing["connect_timeout"], self.last_error)
            if self.outcome is None:
                self.decide("failed", why, restart=False)
            else:
                self._finalize(self.outcome, self.reason, self.failure)
            return
        if self.ever_connected:
            away = now - self.lost_since
            if self.outcome is None and away > self.timing["reconnect_timeout"]:
                # stop our processes; with restarts left, keep trying to rejoin the coordinator
                self.decide("failed", "lost connection to coordinator %s: %s" % (ep, self.lost_why),
                            restart=self.attempt < self.restarts)
                return
            if (self.outcome is not None and not self.final
                    and away > self.timing["reconnect_timeout"] + self.timing["connect_timeout"]):
                self._finalize("failed", "lost connection to coordinator %s and could not rejoin within %.0fs: %s"
                               % (ep, self.timing["connect_timeout"], self.lost_why), self.failure)
                return
        if now < self.next_attempt:
            return
        self._next_backoff()
        try:
            sock = socket.create_connection((self.coord["address"], self.coord["port"]), timeout=1.0)
        except OSError as e:
            self.last_error = e.strerror or str(e)
            return
        sock.settimeout(2.0)
        # the hello goes out only in answer to the coordinator's challenge (_peer_message)
        self.conn = Conn(sock, ep, time.monotonic())
        self.sel.register(sock, selectors.EVENT_READ, self._on_readable)

    def _next_backoff(self):
        """Peer: schedule the next connection attempt (exponential back-off with jitter)."""
        delay = self.backoff * (0.5 + 0.5 * int.from_bytes(os.urandom(2), "big") / 65535.0)
        self.next_attempt = time.monotonic() + delay
        self.backoff = min(self.backoff * 2, BACKOFF_MAX)

    def _peer_challenge(self, msg):
        """Peer: answer the coordinator's challenge with our proof of the token and our own nonce."""
        ep = format_endpoint(self.coord["address"], self.coord["port"])
        conn = self.conn
        if msg.get("version") != PROTOCOL_VERSION:
            why = ("protocol version mismatch: coordinator %s speaks %s, this agent %d (upload the same agent.py "
                   "to every host)" % (ep, _brief(msg.get("version"), 20), PROTOCOL_VERSION))
            self.rejected = True
            self._peer_lost(why)
            self.decide("failed", why)
            return
        nonce = msg.get("nonce")
        if conn.their_nonce is not None or not isinstance(nonce, str) or len(nonce) != 2 * NONCE_BYTES:
            self._peer_lost("malformed challenge from %s" % ep)
            return
        conn.their_nonce = nonce
        hello = {"type": "hello", "job": self.job_id, "host": self.host, "version": PROTOCOL_VERSION,
                 "nonce": conn.nonce,
                 "proof": auth_proof(self.coord["token"], "peer", self.job_id, self.host, nonce, conn.nonce),
                 "exits": self.local_exits, "stopping": self.reason if self.term_requested else None,
                 "attempt": self.attempt, "idle": self.stop_done,
                 "failed": self.reason if self.outcome == "failed" and self.decided_at is not None else None}
        if not conn.send(hello):
            self._peer_lost("send failed")

    def _peer_lost(self, why):
        if self.conn is None:
            return
        try:
            self.sel.unregister(self.conn.sock)
        except (KeyError, ValueError):
            pass
        self.conn.close()
        self.conn = None
        was_welcomed, self.welcomed = self.welcomed, False
        self.dirty = True
        if not was_welcomed:  # an attempt that never authenticated: the loss (if any) dates from earlier
            self.last_error = why
            if self.outcome is None:
                self.log_bad("connect", "connection to coordinator failed (%s); retrying" % why)
            return
        if self.lost_since is None:  # since the last welcome, across failed reconnections
            self.lost_since = time.monotonic()
        self.lost_why = why
        if self.outcome is None:
            log("lost coordinator connection (%s); retrying for %.1fs" % (why, self.timing["reconnect_timeout"]))

    def _peer_message(self, msg):
        kind = msg["type"]
        conn = self.conn
        if not self.welcomed:
            # nothing the other end says counts until it has proved the token over our nonce
            if kind == "challenge":
                self._peer_challenge(msg)
            elif kind == "welcome" and conn.their_nonce is not None and proof_ok(
                    auth_proof(self.coord["token"], "coordinator", self.job_id, self.host, conn.their_nonce,
                               conn.nonce), msg.get("proof")):
                self.welcomed = True
                self.backoff = BACKOFF_MIN
                self.dirty = True
                log("connected to coordinator %s" % conn.addr)
                self.ever_connected = True
                self.lost_since = None
            elif kind == "error" and conn.their_nonce is not None:
                # unauthenticated, but only the coordinator (or whoever holds its port) sends it;
                # the text is the other end's, so it is cut short
                self.rejected = True
                why = "coordinator rejected this host: %s" % "".join(
                    c if c.isprintable() else "?" for c in str(msg.get("error"))[:200])
                log(why)
                self._peer_lost(why)
                self.decide("failed", why)
            else:
                self.log_bad("impostor", "coordinator %s did not prove the job token (sent %s); closing"
                             % (conn.addr, _brief(kind, 40)))
                self._peer_lost("coordinator did not prove the job token")
            return
        if kind == "welcome":
            pass
        elif kind == "error":
            self.rejected = True
            why = "coordinator rejected this host: %s" % "".join(
                c if c.isprintable() else "?" for c in str(msg.get("error"))[:200])
            log(why)
            self._peer_lost(why)
            self.decide("failed", why)
        elif kind == "stop":
            state = msg.get("state") if msg.get("state") in TERMINAL_JOB_STATES else "failed"
            failure = msg.get("failure") if isinstance(msg.get("failure"), dict) else None
            attempt = msg.get("attempt", self.attempt)
            if isinstance(attempt, int) and attempt < self.attempt:
                return  # about an attempt this host already left
            restart = bool(msg.get("restart")) and state == "failed"
            if self.outcome is None:
                self.decide(state, str(msg.get("reason")), failure, restart=restart)
            elif not self.final and not restart:
                self._finalize(state, str(msg.get("reason")), failure)
        elif kind == "restart":
            attempt = msg.get("attempt")
            if isinstance(attempt, bool) or not isinstance(attempt, int) or attempt <= self.attempt or self.final:
                return
            if self.outcome is None:  # still running an earlier attempt: stop it first
                self.decide("failed", "the coordinator started attempt %d" % attempt, restart=True)
            if self.stop_done:
                self._next_attempt(attempt)
            else:
                self.pending_restart = attempt
        elif kind != "ping":
            log("ignoring unknown message type %r from coordinator" % kind)


# ---------------------------------------------------------------------------
# launch


def _close_fds(keep):
    try:
        fds = [int(x) for x in os.listdir("/proc/self/fd")]
    except OSError:
        fds = list(range(3, 256))
    for fd in fds:
        if fd > 2 and fd not in keep:
            try:
                os.close(fd)
            except OSError as e:
                if e.errno != errno.EBADF:
                    raise


def cmd_launch(args):
    """Validate the job, daemonize a supervisor, report the spawned pids."""
    jobfile = os.path.abspath(args.jobfile)
    job = load_job(jobfile)
    jobdir = os.path.dirname(jobfile)
    try:
        lockfd = os.open(os.path.join(jobdir, LOCK_FILE), os.O_RDWR | os.O_CREAT, 0o600)
    except OSError as e:
        raise InputError("cannot use job dir %s: %s" % (jobdir, e.strerror))
    try:
        fcntl.flock(lockfd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        state = read_state(jobdir) or {}
        emit({"ok": False, "error": "job %s already has a supervisor in %s (pid %s)" % (
            job["job"], jobdir, (state.get("supervisor") or {}).get("pid")), "pids": {}, "jobdir": jobdir})
        return 1
    prev = read_state(jobdir)
    if prev is not None and supervisor_alive(prev):
        emit({"ok": False, "error": "job %s already has a supervisor in %s (pid %s)" % (
            job["job"], jobdir, prev["supervisor"]["pid"]), "pids": {}, "jobdir": jobdir})
        return 1
    lingering = tagged_processes(job["job"], jobdir)
    if lingering:
        emit({"ok": False, "pids": {}, "jobdir": jobdir, "error": "job %s still has %d process(es) on this host "
              "(pids %s); run 'stop' first" % (job["job"], len(lingering), sorted(lingering))})
        return 1
    for name in (STATE_FILE, STOP_REQUEST):
        try:
            os.unlink(os.path.join(jobdir, name))
        except FileNotFoundError:
            pass
    logpath = os.path.join(jobdir, SUPERVISOR_LOG)
    rfd, wfd = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # first child: new session, fork again so the daemon is no session leader
        code = 70
        try:
            os.close(rfd)
            os.setsid()
            if os.fork() != 0:
                os._exit(0)
            devnull = os.open(os.devnull, os.O_RDONLY)
            logfd = os.open(logpath, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            os.dup2(devnull, 0)
            os.dup2(logfd, 1)
            os.dup2(logfd, 2)
            _close_fds({wfd, lockfd})
            os.chdir("/")
            code = Supervisor(job, jobdir, wfd).run()
        except BaseException:
            try:
                log("supervisor crashed:\n" + traceback.format_exc())
            except OSError:  # nowhere left to report to; the exit code (70) still says it
                code = 71
        finally:
            os._exit(code)
    os.close(wfd)
    os.close(lockfd)
    os.waitpid(pid, 0)
    data = b""
    after = job.get("start_trainers_after") or {}
    report_timeout = LAUNCH_REPORT_TIMEOUT + after.get("timeout", 0)
    deadline = time.monotonic() + report_timeout
    sel = selectors.DefaultSelector()
    sel.register(rfd, selectors.EVENT_READ)
    while time.monotonic() < deadline:
        if not sel.select(timeout=max(0.0, deadline - time.monotonic())):
            continue
        chunk = os.read(rfd, 65536)
        if not chunk:
            break
        data += chunk
    os.close(rfd)
    try:
        result = json.loads(data.decode("utf-8").strip().splitlines()[-1])
    except (ValueError, IndexError, UnicodeDecodeError):
        result = {"ok": False, "pids": {}, "jobdir": jobdir,
                  "error": "supervisor did not report within %.0fs; see %s" % (report_timeout, logpath)}
    result["job"] = job["job"]
    result["host"] = job["host"]
    emit(result)
    return 0 if result.get("ok") else 1


# ---------------------------------------------------------------------------
# status / stop


def _job_from_dir(jobdir):
    state = read_state(jobdir)
    if state is not None:
        return state, None
    path = os.path.join(jobdir, JOB_FILE)
    if os.path.exists(path):
        return None, load_job(path)
    return None, None


def describe(state, now=None):
    """Status JSON for a state.json dict, resolving 'lost' processes and jobs."""
    now = time.time() if now is None else now
    alive = supervisor_alive(state)
    job_state = state.get("state")
    reason = state.get("reason")
    if not alive and job_state not in TERMINAL_JOB_STATES:
        job_state = "lost"
        reason = "supervisor is not running (was %s: %s)" % (state.get("state"), state.get("reason"))
    procs = []
    for r in state.get("processes") or []:
        p = {k: r.get(k) for k in ("role", "id", "pid", "state", "exit_code", "started_at", "ended_at",
                                   "log", "error")}
        p["logs"] = r.get("logs") or ([{"attempt": 0, "path": r["log"]}] if r.get("log") else [])
        if p["state"] == "running" and not pid_alive(r.get("pid"), r.get("start_ticks")):
            if not alive:
                p["state"] = "lost"
        if p["state"] == "running" and not alive:
            p["orphaned"] = True
        if p["started_at"]:
            p["uptime_s"] = round((p["ended_at"] or now) - p["started_at"], 3)
        procs.append(p)
    out = {"ok": True, "job": state.get("job"), "host": state.get("host"), "jobdir": state.get("jobdir"),
           "state": job_state, "reason": reason, "failure": state.get("failure"),
           "failures": state.get("failures") or [], "is_coordinator": state.get("is_coordinator"),
           "supervisor": {"pid": (state.get("supervisor") or {}).get("pid"), "alive": alive},
           "processes": procs, "updated_at": state.get("updated_at")}
    attempt = state.get("attempt") or 0
    attempts = [dict(a) for a in state.get("attempts") or []]
    if not any(a.get("attempt") == attempt for a in attempts):
        attempts.append({"attempt": attempt, "outcome": job_state, "reason": reason, "failure": state.get("failure"),
                         "started_at": state.get("attempt_started_at"), "ended_at": None})
    out.update(attempt=attempt, restarts=state.get("restarts") or 0, attempts=attempts,
               restart_at=state.get("restart_at") if alive else None,
               restart_pending=bool(state.get("restart_pending")) and alive)
    if "hosts" in state:
        out["hosts"] = state["hosts"]
    if "coordinator" in state:
        out["coordinator"] = state["coordinator"]
    return out


def cmd_status(args):
    """Print the job's state on this host."""
    jobdir = os.path.abspath(args.jobdir)
    state, job = _job_from_dir(jobdir)
    if state is None:
        emit({"ok": False, "state": "unknown", "jobdir": jobdir, "processes": [],
              "job": job["job"] if job else None,
              "error": "no job state in %s (never launched here?)" % jobdir})
        return 1
    emit(describe(state))
    return 0


def cmd_stop(args):
    """Stop the job on this host: supervisor first, then anything left, then the environ sweep."""
    jobdir = os.path.abspath(args.jobdir)
    state, job = _job_from_dir(jobdir)
    job_id = args.job or (state or {}).get("job") or (job or {}).get("job") or os.path.basename(jobdir)
    if not JOB_ID_RE.match(job_id):
        raise InputError("cannot tell the job id of %s; pass --job" % jobdir)
    if args.grace is not None and args.grace < 0:
        raise InputError("--grace must be >= 0")
    grace = args.grace if args.grace is not None else float(
        (state or {}).get("grace") or (job or {}).get("grace") or 10.0)
    killed = []
    was_running = False
    sup_stopped = None
    if state is not None and supervisor_alive(state):
        was_running = True
        sup = state["supervisor"]
        try:
            write_json_atomic(os.path.join(jobdir, STOP_REQUEST), {"grace": grace, "requested_at": time.time()})
        except OSError as e:
            log("cannot write stop request: %s" % e)
        try:
            os.kill(sup["pid"], signal.SIGTERM)
        except ProcessLookupError:
            pass
        deadline = time.monotonic() + grace + STOP_WAIT_EXTRA
        while supervisor_alive(state) and time.monotonic() < deadline:
            time.sleep(0.05)
        if supervisor_alive(state):
            log("supervisor %d did not finish in time; killing it" % sup["pid"])
            try:
                os.kill(sup["pid"], signal.SIGKILL)
            except ProcessLookupError:
                pass
            sup_stopped = "killed"
        else:
            sup_stopped = "exited"
        state = read_state(jobdir) or state
        killed.extend(((state.get("stop") or {}).get("killed")) or [])
    # whatever the supervisor left (or everything, when it was dead): same sequence, run here
    groups = []
    for r in (state or {}).get("processes") or []:
        if r.get("state") == "running" and pid_alive(r.get("pid"), r.get("start_ticks")):
            groups.append(r)
    stopper = Stopper(job_id, jobdir, groups, grace)
    own = stopper.run()
    if own:
        was_running = True
        killed.extend(own)
    if state is not None and not supervisor_alive(state):
        changed = False
        for r in state.get("processes") or []:
            if r.get("state") == "running":
                r["state"] = "stopped" if any(g is r for g in groups) else "lost"
                r["ended_at"] = r.get("ended_at") or time.time()
                changed = True
        if state.get("state") not in TERMINAL_JOB_STATES:
            state["state"], state["reason"] = "stopped", "stopped by 'agent stop' (supervisor was not running)"
            changed = True
        if changed:
            try:
                lockfd = os.open(os.path.join(jobdir, LOCK_FILE), os.O_RDWR | os.O_CREAT, 0o600)
                try:
                    fcntl.flock(lockfd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    write_json_atomic(os.path.join(jobdir, STATE_FILE), state)
                finally:
                    os.close(lockfd)
            except OSError as e:
                log("cannot update %s: %s" % (STATE_FILE, e))
    left = sorted(tagged_processes(job_id, jobdir)) + stopper.leftover
    out = {"ok": not left, "was_running": was_running, "job": job_id, "jobdir": jobdir,
           "state": (state or {}).get("state"), "reason": (state or {}).get("reason"),
           "supervisor": sup_stopped, "killed": killed, "left": sorted(set(left))}
    emit(out)
    return 0 if not left else 1


# ---------------------------------------------------------------------------
# preflight / wait-ports


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
        fd, tmp = tempfile.mkstemp(prefix=".clusterctl-preflight-", dir=path)
    except OSError as e:
        return "%s is not writable: %s" % (path, e.strerror)
    os.close(fd)
    os.unlink(tmp)
    return None


def _script_arg(argv):
    """The script argument of an interpreter-like argv (first non-option arg), or None."""
    for a in argv[1:]:
        if a in ("-m", "-c"):
            return None
        if a.startswith("-"):
            continue
        return a if a.endswith(".py") else None
    return None


def preflight(job, jobdir=None):
    """List of problems (dicts with kind, message and the path or endpoint) for a job on this host."""
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
                add("entrypoint_missing", "%s: %s not found" % (name, path), process=name, path=path)
            elif not os.access(path, os.X_OK):
                add("entrypoint_not_executable", "%s: %s is not executable" % (name, path), process=name,
                    path=path)
        elif shutil.which(exe, path=env["PATH"]) is None:
            add("entrypoint_missing", "%s: %s not found in PATH=%s" % (name, exe, env["PATH"]), process=name,
                path=exe)
        script = _script_arg(p["argv"])
        if script is not None:
            path = os.path.normpath(os.path.join(cwd, script))
            if not os.path.isfile(path):
                add("script_missing", "%s: script %s not found" % (name, path), process=name, path=path)
        logdir = os.path.dirname(p["log"])
        why = _writable_dir(logdir)
        if why:
            add("log_dir_not_writable", "%s: log dir %s: %s" % (name, logdir, why), process=name, path=logdir)
        for ep in p["ports"]:
            endpoints.append((name, ep))
    c = job["coordinator"]
    if c is not None and c["is_coordinator"]:
        endpoints.append(("coordinator", format_endpoint(c["address"], c["port"])))
    if jobdir is not None:
        why = _writable_dir(jobdir)
        if why:
            add("state_dir_not_writable", "job dir %s: %s" % (jobdir, why), path=jobdir)
    seen = {}
    for name, ep in endpoints:
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


# ---------------------------------------------------------------------------
# logs


def _tail_offset(f, size, n):
    """Offset where the last n lines of an open binary file start."""
    if n <= 0 or size == 0:
        return size
    f.seek(size - 1)
    end = size - 1 if f.read(1) == b"\n" else size
    pos, count = end, 0
    while pos > 0:
        step = min(LOG_CHUNK, pos)
        pos -= step
        f.seek(pos)
        block = f.read(step)
        idx = len(block)
        while True:
            idx = block.rfind(b"\n", 0, idx)
            if idx < 0:
                break
            count += 1
            if count == n:
                return pos + idx + 1
    return 0


class LogTail:
    """One log file being multiplexed: keeps offset and a partial last line."""

    def __init__(self, prefix, path, out):
        self.prefix = prefix
        self.path = path
        self.out = out
        self.f = None
        self.ino = None
        self.offset = 0
        self.partial = b""

    def open(self, tail_lines):
        try:
            self.f = open(self.path, "rb")
        except OSError:
            return False
        st = os.fstat(self.f.fileno())
        self.ino = st.st_ino
        self.offset = _tail_offset(self.f, st.st_size, tail_lines) if tail_lines is not None else 0
        self.f.seek(self.offset)
        return True

    def _write_lines(self, data):
        data = self.partial + data
        lines = data.split(b"\n")
        self.partial = lines.pop()
        for line in lines:
            self.out.write(self.prefix + line + b"\n")
        if len(self.partial) > LOG_MAX_PARTIAL:
            self.out.write(self.prefix + self.partial + b"\n")
            self.partial = b""

    def flush_partial(self):
        if self.partial:
            self.out.write(self.prefix + self.partial + b"\n")
            self.partial = b""

    def poll(self, budget=LOG_CHUNK * 16):
        """Read what is new (up to budget bytes); handle truncation and replacement."""
        if self.f is None:
            if not self.open(None):
                return 0
        try:
            st = os.stat(self.path)
        except OSError:
            st = None
        if st is not None and (st.st_ino != self.ino or st.st_size < self.offset):
            self.flush_partial()
            self.f.close()
            self.f = None
            if not self.open(None):
                return 0
        got = 0
        while got < budget:
            chunk = self.f.read(LOG_CHUNK)
            if not chunk:
                break
            self.offset += len(chunk)
            got += len(chunk)
            self._write_lines(chunk)
        return got

    def dump(self, tail_lines):
        """Non-follow mode: stream from the start (or the last n lines) to EOF."""
        if not self.open(tail_lines):
            return False
        at_start = True
        while True:
            chunk = self.f.read(LOG_CHUNK)
            if not chunk:
                break
            parts = chunk.split(b"\n")
            for i, part in enumerate(parts):
                last = i == len(parts) - 1
                if at_start and (part or not last):
                    self.out.write(self.prefix)
                self.out.write(part)
                if not last:
                    self.out.write(b"\n")
                    at_start = True
                elif part:
                    at_start = False
        if not at_start:
            self.out.write(b"\n")
        self.f.close()
        return True


def _job_over(state):
    """True when nothing more will be written to this host's logs (follow mode may end)."""
    if state is None or not supervisor_alive(state):
        return True
    if state.get("state") in TERMINAL_JOB_STATES:
        return True
    if (state.get("attempt") or 0) < (state.get("restarts") or 0):
        return False  # a failure now would start the job again: only a final state ends the logs
    return all(r.get("state") not in ("running", "pending") for r in state.get("processes") or [])


def _attempt_logs(p):
    """[(attempt, path)] of a process record (a job.json process or a state.json one)."""
    entries = p.get("logs") or [{"attempt": 0, "path": p["log"]}]
    return [(e["attempt"], e["path"]) for e in entries if isinstance(e, dict) and e.get("path")]


def _log_prefix(host, p, attempt):
    name = "%s.%d" % (p["role"], p["id"])
    if attempt:
        name += "#%d" % attempt
    return ("[%s %s] " % (host, name)).encode("utf-8", "replace")


def cmd_logs(args):
    """Write the selected log files to stdout, each line prefixed '[host role.id] '."""
    jobdir = os.path.abspath(args.jobdir)
    state, job = _job_from_dir(jobdir)
    if state is None and job is None:
        raise InputError("no job state or %s in %s" % (JOB_FILE, jobdir))
    procs = (state or job)["processes"]
    host = args.host_label or (state or job).get("host") or socket.gethostname()
    sel = [p for p in procs if (args.role is None or p["role"] == args.role) and (args.id is None or p["id"] == args.id)]
    if not sel:
        raise InputError("no process matches role=%s id=%s in %s" % (args.role, args.id, jobdir))
    if args.lines is not None and args.lines < 0:
        raise InputError("-n must be >= 0")
    out = sys.stdout.buffer
    wanted = set((p["role"], p["id"]) for p in sel)
    tails = [LogTail(_log_prefix(host, p, attempt), path, out) for p in sel for attempt, path in _attempt_logs(p)]
    try:
        if not args.follow:
            missing = [t.path for t in tails if not t.dump(args.lines)]
            out.flush()
            for path in missing:
                log("log file %s does not exist (yet)" % path)
            return 0
        for t in tails:
            t.open(args.lines)
        known = set(t.path for t in tails)
        while True:
            state = read_state(jobdir)
            over = _job_over(state)  # decide before draining so nothing written before the end is lost
            for p in (state or {}).get("processes") or []:  # a restart's new logs, from their first line
                if (p.get("role"), p.get("id")) in wanted:
                    for attempt, path in _attempt_logs(p):
                        if path not in known:
                            known.add(path)
                            tails.append(LogTail(_log_prefix(host, p, attempt), path, out))
            busy = sum(t.poll() for t in tails)
            out.flush()
            if over:
                while sum(t.poll() for t in tails):
                    pass
                for t in tails:
                    t.flush_partial()
                out.flush()
                return 0
            if not busy:
                time.sleep(args.interval)
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0
    except KeyboardInterrupt:
        return 0


# ---------------------------------------------------------------------------
# CLI


def build_parser():
    """The agent's argparse parser."""
    p = _Parser(prog="agent.py", description="clusterctl host agent (see docs/agent.md)")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    s = sub.add_parser("launch", help="start the job's supervisor on this host")
    s.add_argument("jobfile")
    s.set_defaults(func=cmd_launch)

    s = sub.add_parser("status", help="job state on this host")
    s.add_argument("jobdir")
    s.set_defaults(func=cmd_status)

    s = sub.add_parser("stop", help="stop the job on this host (idempotent)")
    s.add_argument("jobdir")
    s.add_argument("--grace", type=float, default=None, help="seconds between SIGTERM and SIGKILL")
    s.add_argument("--job", default=None, help="job id to sweep when the job dir has no state")
    s.set_defaults(func=cmd_stop)

    s = sub.add_parser("preflight", help="check ports, entrypoints, log dirs")
    s.add_argument("jobfile")
    s.set_defaults(func=cmd_preflight)

    s = sub.add_parser("wait-ports", help="wait until endpoints accept TCP connections")
    s.add_argument("endpoints", help="HOST:PORT[,HOST:PORT...]")
    s.add_argument("--timeout", type=float, default=60.0)
    s.set_defaults(func=cmd_wait_ports)

    s = sub.add_parser("logs", help="prefixed, multiplexed process logs")
    s.add_argument("jobdir")
    s.add_argument("--follow", "-f", action="store_true")
    s.add_argument("--role", choices=ROLES)
    s.add_argument("--id", type=int)
    s.add_argument("-n", dest="lines", type=int, default=None, help="only the last LINES lines of each file")
    s.add_argument("--host-label", default=None)
    s.add_argument("--interval", type=float, default=0.2, help=argparse.SUPPRESS)
    s.set_defaults(func=cmd_logs)
    return p


def main(argv=None):
    """Run one subcommand; return the exit code."""
    try:
        args = build_parser().parse_args(argv)
        return args.func(args)
    except InputError as e:
        emit({"ok": False, "error": str(e)})
        return 2
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # a bug: still one JSON object on stdout, details on stderr
        traceback.print_exc()
        emit({"ok": False, "error": "internal error: %s: %s" % (type(e).__name__, e)})
        return 3


if __name__ == "__main__":
    sys.exit(main())
