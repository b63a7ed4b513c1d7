"""`agent logs`: the selected processes' logs (every attempt), prefixed and multiplexed, with --follow.

`stream` is the whole of it given an output stream: `agent logs` writes to its stdout, the supervisor's control
socket (clusterctl/host/control.py) to a client's connection.
"""

import os
import socket
import sys
import time

from .common import InputError, log
from .jobdir import job_from_dir, read_state_or_none, supervisor_alive
from .jobfile import JOB_FILE
from .states import TERMINAL_JOB_STATES, ProcState

LOG_CHUNK = 64 * 1024
LOG_MAX_PARTIAL = 4 * 1024 * 1024  # --follow: a partial line longer than this is emitted in pieces
# --follow: after this long with nothing to send, an empty line (the controller drops it). A follower whose client
# went away (Ctrl+C, a lost connection) learns it only by writing: without this, a quiet job kept it, and the
# `cat` relaying the control socket's stream, on the host until the job's next log line or its end.
KEEPALIVE_S = 5.0
KEEPALIVE = b"\n"


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

    def close(self):
        """Close the file (a long-running server must not keep one open per finished client)."""
        if self.f is not None:
            self.f.close()
            self.f = None

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
    return all(r.get("state") not in (ProcState.RUNNING, ProcState.PENDING) for r in state.get("processes") or [])


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
    out = sys.stdout.buffer
    try:
        return stream(os.path.abspath(args.jobdir), out, follow=args.follow, role=args.role, id=args.id,
                      lines=args.lines, host_label=args.host_label, interval=args.interval)
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0
    except KeyboardInterrupt:
        return 0


def stream(jobdir, out, follow=False, role=None, id=None, lines=None, host_label=None, interval=0.2, ended=None,
           say=log, keepalive=KEEPALIVE_S):
    """Write the selected logs of the job in `jobdir` to the binary stream `out` (what `agent logs` prints; the
    supervisor's control socket serves the same to its `logs` clients); 0. With `follow`, until the job is over on
    this host, or `ended()` says so (then what is left is drained), writing an empty line after every `keepalive`
    seconds with nothing to send. `say` gets the notes about missing files.
    Raise InputError on a selection that matches nothing."""
    state, job = job_from_dir(jobdir, strict=False)
    if state is None and job is None:
        raise InputError("no job state or %s in %s" % (JOB_FILE, jobdir))
    # an elastic job's host also lists the processes it ran in earlier attempts and no longer runs ("retired")
    procs = (state or job)["processes"] + list((state or {}).get("retired") or [])
    host = host_label or (state or job).get("host") or socket.gethostname()

    def wanted(p):
        return (role is None or p.get("role") == role) and (id is None or p.get("id") == id)

    sel = [p for p in procs if wanted(p)]
    # an elastic job's spare may take a place (and processes) later: followed, it waits for them
    elastic = bool((state or {}).get("elastic") or (job or {}).get("elastic"))
    if not sel and not (follow and elastic):
        raise InputError("no process matches role=%s id=%s in %s" % (role, id, jobdir))
    if lines is not None and lines < 0:
        raise InputError("-n must be >= 0")
    tails = [LogTail(_log_prefix(host, p, attempt), path, out) for p in sel for attempt, path in _attempt_logs(p)]
    try:
        return _write_out(jobdir, out, follow, lines, interval, ended, say, host, wanted, tails, keepalive)
    finally:
        for t in tails:
            t.close()


def _write_out(jobdir, out, follow, lines, interval, ended, say, host, wanted, tails, keepalive):
    if not follow:
        missing = [t.path for t in tails if not t.dump(lines)]
        out.flush()
        for path in missing:
            say("log file %s does not exist (yet)" % path)
        return 0
    for t in tails:
        t.open(lines)
    known = set(t.path for t in tails)
    quiet_since = time.monotonic()
    while True:
        state = read_state_or_none(jobdir)
        # decide before draining so nothing written before the end is lost
        over = _job_over(state) or (ended is not None and ended())
        for p in (state or {}).get("processes") or []:  # a restart's new logs, from their first line
            if wanted(p):
                for attempt, path in _attempt_logs(p):
                    if path not in known:
                        known.add(path)
                        tails.append(LogTail(_log_prefix(host, p, attempt), path, out))
        busy = sum(t.poll() for t in tails)
        now = time.monotonic()
        if busy:
            quiet_since = now
        elif now - quiet_since >= keepalive:
            out.write(KEEPALIVE)
            quiet_since = now
        out.flush()
        if over:
            while sum(t.poll() for t in tails):
                pass
            for t in tails:
                t.flush_partial()
            out.flush()
            return 0
        if not busy:
            time.sleep(interval)
