"""The supervisor's control socket: `status`, `top`, `stop` and `logs` answered by the running supervisor,
reached from a shell in one round trip with no Python started on the host (docs/agent.md, "Control socket").

The supervisor listens on 127.0.0.1 (an ephemeral port) and writes `control` (0600, in the 0700 job dir): one
line `1 PID PORT CLIENT_SECRET SERVER_SECRET`. A client (the controller's bash one-liner, built by
clusterctl/ops/control.py) reads that line with bash builtins, connects with bash's /dev/tcp and sends one
request line, `CLIENT_SECRET COMMAND [JSON ARGS]`; the supervisor answers `ok SERVER_SECRET` (so that a client
knows it reached this job's supervisor, not whatever took the port after it died) and then the body: one JSON
line (`status`, `top`, `stop`) or the log stream (`logs`), and closes. Anything else is refused before a
byte of it is acted on: the secret is compared in constant time on the first line, which may be at most
MAX_REQUEST bytes and must come within AUTH_TIMEOUT; a bad one closes the connection with no answer.

The listener survives floods like the coordinator's: at most MAX_PENDING unauthenticated connections (a new
one evicts the oldest), AUTH_TIMEOUT to authenticate, garbage (an over-long line, a wrong secret, a bad
command) counted and dropped, accept errors (EMFILE and the like) contained. Nothing here blocks the
supervisor's loop: replies are written as the socket takes them (a client that reads nothing is dropped after
REPLY_TIMEOUT), `stop` and `top` replies that must wait (the stop to finish, a CPU baseline, nvidia-smi) are
answered from the loop's tick, nvidia-smi runs on a thread of its own (metrics.GpuWatch), and each `logs` client
is served by a thread of its own (at most MAX_LOG_CLIENTS; beyond that the client is told to fall back to
`agent logs`).
"""

import collections
import errno
import hmac
import json
import os
import selectors
import socket
import threading
import time

from .common import InputError, log, write_private
from .controlproto import (CLIENT_HEADER_TIMEOUT, COMMANDS, CONTROL_FILE, CONTROL_VERSION, ERROR, MAX_REQUEST, OK,
                           RequestError, parse_request, read_control)
from .jobdir import STOP_REQUEST, describe, write_json_atomic
from .procfs import tagged_processes
from .protocol import AUTH_TIMEOUT, LogLimiter

__all__ = ["ControlServer", "CONTROL_FILE", "CONTROL_VERSION", "MAX_REQUEST", "MAX_PENDING",
           "MAX_LOG_CLIENTS", "REPLY_TIMEOUT", "CLIENT_HEADER_TIMEOUT", "COMMANDS", "parse_request", "read_control"]

SECRET_BYTES = 32
MAX_PENDING = 16  # unauthenticated connections kept at once (a new one evicts the oldest)
MAX_REPLYING = 64  # authenticated connections being answered at once (the oldest is dropped beyond)
MAX_LOG_CLIENTS = 8  # `logs` clients served at once (a thread each); beyond: "busy", the client falls back
REPLY_TIMEOUT = 30.0  # a client that takes nothing of its reply for this long is dropped
LOG_SEND_TIMEOUT = 60.0  # a `logs` client that reads nothing for this long is dropped
TOP_BASELINE_WAIT = 0.25  # no CPU baseline younger than metrics.BASELINE_MAX_AGE_S: take one, answer this later
GPU_REFRESH_S = 2.0  # GpuWatch: nvidia-smi every this many seconds while `top` is asked
GPU_IDLE_S = 30.0  # ... and stops this long after the last `top`
LAST_REQUEST_S = 0.2  # at close: how long a client that connected may take to send its request line
CLOSE_DRAIN_S = 2.0  # at the supervisor's exit: time left to the replies being written and the log clients
ACCEPT_PAUSE = 0.5  # seconds without accepting after an accept error such as EMFILE
ACCEPT_BATCH = 32
_PAUSE_ERRNOS = frozenset(e for e in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM) if e)


class _Conn:
    """One control connection: the request being read, then the reply being written."""

    def __init__(self, sock, deadline):
        self.sock = sock
        self.buf = bytearray()
        self.out = bytearray()
        self.deadline = deadline
        self.authed = False
        self.closing = False  # close once `out` is written
        self.writing = False  # registered for EVENT_WRITE
        self.found_running = True  # a `stop`: whether the job's processes were still going when it came

    def close(self):
        try:
            self.sock.close()
        except OSError:
            pass


class ControlServer:
    """The control socket of one supervisor (`sup`: clusterctl/host/supervisor.py's Supervisor). `start(sup)`
    opens it and registers it on the supervisor's loop; `close()` at its exit answers what waits and removes
    the control file."""

    def __init__(self, sup, max_pending=MAX_PENDING, auth_timeout=AUTH_TIMEOUT):
        self.sup = sup
        self.loop = sup.loop
        self.jobdir = sup.jobdir
        self.clock = getattr(sup, "clock", time.monotonic)  # the supervisor's (tests move theirs)
        self.max_pending, self.auth_timeout = max_pending, auth_timeout
        self.listener = None
        self.port = None
        self.path = os.path.join(self.jobdir, CONTROL_FILE)
        self.client_secret = os.urandom(SECRET_BYTES).hex().encode()
        self.server_secret = os.urandom(SECRET_BYTES).hex()
        self.pending = collections.OrderedDict()  # sock -> _Conn, unauthenticated, oldest first
        self.replying = collections.OrderedDict()  # sock -> _Conn, authenticated, reply being written
        self.stop_waiters = []  # _Conn waiting for the stop to finish
        self.top_waiters = []  # [(_Conn, args, answer no earlier than)]
        self.log_threads = []
        self.sampler = None
        self.gpu = None
        self.accept_paused_until = None
        self.closed = False
        self.counts = collections.Counter()  # accepted, answered, rejected, evicted, garbage, accept_errors, busy
        self.log_bad = getattr(sup, "log_bad", None) or LogLimiter()

    @classmethod
    def start(cls, sup):
        """Open the control socket of `sup`; one that cannot be opened is logged and is a no-op object (clients
        then fall back to the agent, which reads the state files)."""
        server = cls(sup)
        error = server.open()
        if error is not None:
            log("no control socket: %s (status, stop and logs go through the agent)" % error)
        return server

    # -- the listener -----------------------------------------------------------------------------------------

    def open(self):
        """Listen on 127.0.0.1:0 and write the control file; None, or why not."""
        try:
            self.listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            self.listener.bind(("127.0.0.1", 0))
            self.listener.listen(128)
            self.listener.setblocking(False)
            self.port = self.listener.getsockname()[1]
        except OSError as e:
            self._close_listener()
            return "cannot listen on 127.0.0.1: %s" % (e.strerror or e)
        line = "%d %d %d %s %s\n" % (CONTROL_VERSION, os.getpid(), self.port, self.client_secret.decode(),
                                     self.server_secret)
        try:
            write_private(self.path, line)
        except OSError as e:
            self._close_listener()
            return "cannot write %s: %s" % (self.path, e.strerror or e)
        self.loop.register(self.listener, self._on_accept)
        self.loop.on_poll(self.tick)
        return None

    def _serve_last_requests(self):
        """At close: the clients that connected before the listener closes (accepted or still in its backlog) are
        served, not dropped, when their request line comes within LAST_REQUEST_S: a `stop` that reached this host
        just after the coordinator's broadcast ended the job here gets its answer from this supervisor, instead of
        falling back to a Python `agent stop` on the host (what `stop` then waited for)."""
        if self.listener is None:
            return
        self._on_accept(self.listener)
        deadline = time.monotonic() + LAST_REQUEST_S
        while True:
            for conn in list(self.pending.values()):
                self._on_request(conn.sock)  # non-blocking: serves a complete request, drops a closed client
            left = deadline - time.monotonic()
            if not self.pending or left <= 0:
                return
            with selectors.DefaultSelector() as sel:  # not select(): a coordinator's descriptors pass FD_SETSIZE
                for conn in self.pending.values():
                    sel.register(conn.sock, selectors.EVENT_READ)
                sel.select(left)

    def _close_listener(self):
        if self.listener is not None:
            self.loop.unregister(self.listener)
            try:
                self.listener.close()
            except OSError:
                pass
            self.listener = None

    def _on_accept(self, listener):
        made_room = False
        for _ in range(ACCEPT_BATCH):
            try:
                sock, _ = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                self.counts["accept_errors"] += 1
                if e.errno not in _PAUSE_ERRNOS:
                    continue
                if self.pending and not made_room:  # out of descriptors: the oldest unauthenticated one goes
                    self._make_room(next(iter(self.pending.values())))
                    made_room = True
                    continue
                self.log_bad("control-accept", "control socket: cannot accept (%s); pausing %.1fs"
                             % (os.strerror(e.errno), ACCEPT_PAUSE))
                self.loop.unregister(self.listener)
                self.accept_paused_until = self.clock() + ACCEPT_PAUSE
                return
            made_room = False
            self.counts["accepted"] += 1
            while len(self.pending) >= self.max_pending:
                self._make_room(next(iter(self.pending.values())))
            sock.setblocking(False)
            conn = _Conn(sock, self.clock() + self.auth_timeout)
            self.pending[sock] = conn
            self.loop.register(sock, self._on_request)

    def _make_room(self, conn):
        """Take the oldest unauthenticated connection out: read what it sent first (a client whose request is
        already there is served, garbage is dropped as garbage), else evict it."""
        self._on_request(conn.sock)
        if conn.sock in self.pending:
            self._drop(conn, "evicted")

    def _drop(self, conn, why):
        """Close a connection (counted by `why` when unauthenticated)."""
        self.loop.unregister(conn.sock)
        if self.pending.pop(conn.sock, None) is not None:
            self.counts[why] += 1
        self.replying.pop(conn.sock, None)
        conn.close()

    # -- requests ---------------------------------------------------------------------------------------------

    def _on_request(self, sock):
        conn = self.pending.get(sock)
        if conn is None:  # an authenticated connection: the client may only close it (or send what we ignore)
            conn = self.replying.get(sock)
            if conn is None:
                self.loop.unregister(sock)
                sock.close()
                return
            try:
                data = sock.recv(4096)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                data = b""
            if not data:
                self._client_gone(conn)
            return
        try:
            data = sock.recv(MAX_REQUEST + 1 - len(conn.buf))
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._drop(conn, "rejected")
            return
        conn.buf += data
        end = conn.buf.find(b"\n")
        if end < 0:
            if len(conn.buf) > MAX_REQUEST:
                self._garbage(conn, "a request line longer than %d bytes" % MAX_REQUEST)
            return
        secret, _, rest = bytes(conn.buf[:end]).partition(b" ")
        if not hmac.compare_digest(secret, self.client_secret):
            self.log_bad("control-rejected", "control socket: a request with a wrong secret; closing")
            self._drop(conn, "rejected")
            return
        del self.pending[sock]
        conn.authed = True
        self.replying[sock] = conn
        while len(self.replying) > MAX_REPLYING:
            oldest = next(iter(self.replying.values()))
            self._client_gone(oldest)
        try:
            command, args = parse_request(rest)
        except RequestError as e:
            self.counts["bad_requests"] += 1
            self.log_bad("control-request", "control socket: refused a request: %s" % e)
            self._reply(conn, ("%s %s\n" % (ERROR, e)).encode("utf-8", "replace"), close=True)
            return
        self._serve(conn, command, args)

    def _garbage(self, conn, why):
        self.counts["garbage"] += 1
        self.log_bad("control-garbage", "control socket: %s; closing" % why)
        self._drop(conn, "rejected")

    def _serve(self, conn, command, args):
        sup = self.sup
        if command == "status":
            self._answer(conn, describe(sup.snapshot(), alive=True))
        elif command == "top":
            self._ask_top(conn, args)
        elif command == "stop":
            self._reply(conn, self._header())
            conn.found_running = not (sup.core.final and sup.core.stop_done)  # not a coordinator waiting for peers
            self._request_stop(args.get("grace"))
            self.stop_waiters.append(conn)
            self._stop_tick()
        elif command == "logs":
            self._serve_logs(conn, args)

    def _header(self):
        return ("%s %s\n" % (OK, self.server_secret)).encode()

    def _answer(self, conn, obj):
        """The header and one JSON line (as the agent prints it), then close."""
        self.counts["answered"] += 1
        body = json.dumps(obj, sort_keys=True) + "\n"
        self._reply(conn, self._header() + body.encode("utf-8"), close=True)

    def _reply(self, conn, data, close=False):
        """Write `data` as the socket takes it (the rest when it is writable again); then close, if asked."""
        if conn.sock not in self.replying:
            return
        conn.out += data
        conn.closing = conn.closing or close
        conn.deadline = self.clock() + REPLY_TIMEOUT
        self._flush(conn)

    def _flush(self, conn):
        while conn.out:
            try:
                n = conn.sock.send(conn.out)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                self._client_gone(conn)
                return
            del conn.out[:n]
        if conn.out:
            if not conn.writing:
                conn.writing = True
                self.loop.modify(conn.sock, self._on_writable, selectors.EVENT_WRITE)
            return
        if conn.writing:
            conn.writing = False
            self.loop.modify(conn.sock, self._on_request)
        if conn.closing:
            self._finish(conn)

    def _on_writable(self, sock):
        conn = self.replying.get(sock)
        if conn is None:
            self.loop.unregister(sock)
            return
        self._flush(conn)

    def _finish(self, conn):
        self.loop.unregister(conn.sock)
        self.replying.pop(conn.sock, None)
        try:
            conn.sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        conn.close()

    def _client_gone(self, conn):
        """An authenticated client closed its end, or takes nothing: forget it (a stop it asked for goes on)."""
        self.loop.unregister(conn.sock)
        self.replying.pop(conn.sock, None)
        if conn in self.stop_waiters:
            self.stop_waiters.remove(conn)
        self.top_waiters = [w for w in self.top_waiters if w[0] is not conn]
        conn.close()

    # -- stop -------------------------------------------------------------------------------------------------

    def _request_stop(self, grace):
        """What `agent stop` does to a live supervisor, without the signal: the grace in stop-request.json,
        then the supervisor's own stop request (the same rule, the same broadcast)."""
        sup = self.sup
        if grace is not None:
            try:
                write_json_atomic(os.path.join(self.jobdir, STOP_REQUEST), {"grace": grace, "requested_at": time.time()})
            except OSError as e:
                log("cannot write stop request: %s" % e)
        sup.term_requested = True

    def _stop_over(self):
        sup = self.sup
        core = sup.core
        return sup.term_handled and core.stop_done and core.final

    def _stop_reply(self):
        """`agent stop`'s reply, from the supervisor that ran the stop: what it killed for a stop request
        (reported once, as state.json's stop report is), what the sweep finds left."""
        sup = self.sup
        report = sup.stop_report
        killed = []
        if isinstance(report, dict) and report.get("requested") and not report.get("reported"):
            killed = [dict(k) for k in report.get("killed") or [] if isinstance(k, dict)]
            report["reported"] = True
            sup.dirty = True
        leftover = (report.get("leftover") or []) if isinstance(report, dict) else []
        left = sorted(set(tagged_processes(sup.job_id, self.jobdir)) | set(leftover))
        verdict = sup.core.verdict
        return {"ok": not left, "was_running": True, "job": sup.job_id, "jobdir": self.jobdir,
                "state": sup.core.state, "reason": verdict.reason if verdict else None, "supervisor": "answered",
                "killed": killed, "left": left}

    def _stop_tick(self, force=False):
        """Answer the stops that wait once the stop is over (`force`: now, whatever is left)."""
        if not self.stop_waiters or not (force or self._stop_over()):
            return
        waiters, self.stop_waiters = self.stop_waiters, []
        reply = self._stop_reply()
        for conn in waiters:
            self.counts["answered"] += 1
            # a stop that came after the job was over (a second `stop`) found nothing running, unless it is the
            # one to report what an earlier stop killed
            answer = dict(reply, was_running=conn.found_running or bool(reply["killed"]))
            self._reply(conn, (json.dumps(answer, sort_keys=True) + "\n").encode(), close=True)
            reply = dict(reply, killed=[])  # reported once

    # -- top --------------------------------------------------------------------------------------------------

    def _ask_top(self, conn, args):
        from .metrics import BASELINE_MAX_AGE_S, GpuWatch, Sampler

        if self.sampler is None:
            self.sampler = Sampler()
        now = time.monotonic()  # real time, not the supervisor's clock: the CPU is measured over it
        ready_at = now
        if not args.get("progress_only"):
            s = self.sampler
            if args.get("gpu", True):
                if s.nvidia_smi is None:
                    import shutil  # only here: its import (zlib, bz2, lzma) is not for every start

                    s.nvidia_smi = shutil.which("nvidia-smi") or ""
                if s.nvidia_smi:
                    if self.gpu is None:
                        self.gpu = GpuWatch(s.nvidia_smi, refresh=GPU_REFRESH_S, idle=GPU_IDLE_S)
                        s.gpu_source = self.gpu
                    self.gpu.want()
            if s.host_cpu is None or now - s.host_cpu[0] > BASELINE_MAX_AGE_S:
                # no baseline: take one now, answer a moment later (as `agent top --wait 0.25`), never sleeping; the
                # moment counts from when the baseline was taken (its scan of /proc is slow on a loaded machine)
                self._top(args, baseline=True)
                ready_at = time.monotonic() + TOP_BASELINE_WAIT
        self.top_waiters.append((conn, args, ready_at, now + 2 * _gpu_timeout() + 1.0))
        self._top_tick()

    def _top(self, args, baseline=False):
        from .topsnap import reply

        sup = self.sup
        gpu = bool(args.get("gpu", True)) and not baseline and self.gpu is not None
        return reply(sup.snapshot(), sup.job, self.sampler, progress_only=bool(args.get("progress_only")),
                     slice_s=args.get("slice"), slices=args.get("slices", _default_slices()), wait=0, gpu=gpu,
                     alive=True)

    def _top_tick(self):
        if not self.top_waiters:
            return
        now = time.monotonic()
        waiting = []
        for conn, args, ready_at, gpu_deadline in self.top_waiters:
            gpu_wait = (not args.get("progress_only") and args.get("gpu", True) and self.gpu is not None
                        and not self.gpu.ready and now < gpu_deadline)
            if now < ready_at or gpu_wait:
                waiting.append((conn, args, ready_at, gpu_deadline))
                continue
            self._answer(conn, self._top(args))
        self.top_waiters = waiting

    # -- logs -------------------------------------------------------------------------------------------------

    def _serve_logs(self, conn, args):
        self.log_threads = [t for t in self.log_threads if t.is_alive()]
        if len(self.log_threads) >= MAX_LOG_CLIENTS:
            self.counts["busy"] += 1
            self._reply(conn, ("%s busy: %d log clients\n" % (ERROR, MAX_LOG_CLIENTS)).encode(), close=True)
            return
        from .logtail import stream  # imported here, on the loop's thread, not in the new one

        # the thread owns the connection from here
        self.loop.unregister(conn.sock)
        self.replying.pop(conn.sock, None)
        self.counts["answered"] += 1
        conn.sock.setblocking(True)
        t = threading.Thread(target=self._logs_thread, args=(conn.sock, args, stream), name="control-logs",
                             daemon=True)
        self.log_threads.append(t)
        t.start()

    def _logs_thread(self, sock, args, stream):
        try:
            sock.settimeout(LOG_SEND_TIMEOUT)
            out = sock.makefile("wb", buffering=65536)
            try:
                out.write(self._header())
                try:
                    stream(self.jobdir, out, follow=bool(args.get("follow")), role=args.get("role"), id=args.get("id"),
                           lines=args.get("lines"), host_label=args.get("host_label"), ended=lambda: self.closed,
                           say=log)
                except InputError as e:  # as `agent logs` says it: one JSON line
                    out.write((json.dumps({"ok": False, "error": str(e)}, sort_keys=True) + "\n").encode())
                out.flush()
            finally:
                try:
                    out.close()
                except OSError:
                    pass
        except OSError:
            pass  # the client went away or took nothing for LOG_SEND_TIMEOUT
        except Exception as e:  # a bug here must not go unseen, nor end the supervisor
            log("control socket: logs client failed: %s: %s" % (type(e).__name__, e))
        finally:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()

    # -- the loop's tick, the end -----------------------------------------------------------------------------

    def tick(self):
        """At every round of the loop: deadlines, a paused listener, the replies that wait (stop, top)."""
        now = self.clock()
        if self.accept_paused_until is not None and now >= self.accept_paused_until and self.listener is not None:
            self.accept_paused_until = None
            self.loop.register(self.listener, self._on_accept)
        while self.pending:
            conn = next(iter(self.pending.values()))
            if now <= conn.deadline:
                break
            self.log_bad("control-rejected", "control socket: no request within %.0fs; closing" % self.auth_timeout)
            self._drop(conn, "rejected")
        for conn in [c for c in self.replying.values() if c.out and now > c.deadline]:
            self.log_bad("control-slow", "control socket: a client took nothing of its reply for %.0fs; dropping it"
                         % REPLY_TIMEOUT)
            self._client_gone(conn)
        self._stop_tick()
        self._top_tick()

    def stats(self):
        """The listener's counters."""
        return dict(self.counts, pending=len(self.pending))

    def close(self):
        """At the supervisor's exit: answer the stops that wait (the stop is over by now), give the replies being
        written and the log clients CLOSE_DRAIN_S, remove the control file and close everything."""
        if self.closed:
            return
        self.closed = True
        if self.listener is None:
            return
        try:
            if os.path.exists(self.path) and (read_control(self.jobdir) or (None, None))[1] == self.port:
                os.unlink(self.path)
        except OSError:
            pass
        self._serve_last_requests()
        self._close_listener()
        for conn in list(self.pending.values()):
            self._drop(conn, "rejected")
        if self.stop_waiters and not self._stop_over():
            log("control socket: the supervisor ends before the stop finished; answering with what is left")
        self._stop_tick(force=True)
        for conn, args, _, _ in self.top_waiters:
            self._answer(conn, self._top(dict(args, gpu=False)))
        self.top_waiters = []
        if self.sup.dirty:
            self.sup.write_state()  # a stop report now reported
        deadline = time.monotonic() + CLOSE_DRAIN_S
        for conn in list(self.replying.values()):
            conn.sock.setblocking(True)
            try:
                conn.sock.settimeout(max(0.01, deadline - time.monotonic()))
                if conn.out:
                    conn.sock.sendall(bytes(conn.out))
            except OSError:
                pass
            if conn.closing:
                self._finish(conn)
            else:
                self._client_gone(conn)
        for t in self.log_threads:
            t.join(max(0.0, deadline - time.monotonic()))
        if self.gpu is not None:
            self.gpu.close()
        log("control socket closed: %s" % ", ".join("%s %d" % kv for kv in sorted(self.counts.items())))



def _gpu_timeout():
    from .metrics import GPU_TIMEOUT_S

    return GPU_TIMEOUT_S


def _default_slices():
    from .progressline import STRAGGLER_SLICES

    return STRAGGLER_SLICES
