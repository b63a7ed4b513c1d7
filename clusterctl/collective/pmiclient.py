"""The rank side of clusterctl's PMI server: joining (the authenticated hello) and the control thread.

:func:`join` registers a rank with the PMI server on MASTER_ADDR:MASTER_PORT (retrying until it listens,
and while an unauthenticated answer or a dropped connection says it did not get through) and checks
that the server's ready answer carries a MAC of the job token over the rank's own nonce.  The
connection stays open as the rank's *control connection*: :class:`RankControl`, a daemon thread, reads
the server's orders from it (JSON lines):

* ``spawn``: start the processes an ``MPI_Comm_spawn`` asked for, here on the spawning rank's host, with
  the job's environment (CLUSTERCTL_JOB, CLUSTERCTL_JOBDIR and the token inherited, so stop and the
  orphan sweep cover them) plus their own ``PMI_*``; their output goes to a log beside this rank's
  (``trainer.1.spawn1.0.log`` next to ``trainer.1.log``), and ``$CLUSTERCTL_JOBDIR/spawned-<rank>.json``
  lists what was started (pids, argv, logs, exit codes);
* ``abort``: some process called ``MPI_Abort``; the aborting rank writes ``$CLUSTERCTL_JOBDIR/abort.json``
  and exits at once with the abort's error code (1 if it was 0 or beyond 255), every other rank a second
  later with the same code, after killing the processes it spawned.

A thread, not a process: ``MPI_Comm_spawn`` and the other blocking calls release the GIL in mpi4py, so
the thread runs while the rank waits for the server's answer.
"""

from __future__ import annotations

import hmac
import json
import logging
import os
import secrets
import select
import signal
import socket
import stat
import subprocess
import sys
import threading
import time

from .errors import CollectiveError
from .pmiwire import (AUTH_ENV, HELLO, NODE_ENV, READY, TOKEN_ENV, format_command, hello_mac, parse_command,
                      ready_mac)

__all__ = ["join", "register", "RankControl", "abort_record", "write_private_json", "SPAWNED_FILE",
           "ABORT_EXIT_DELAY"]

log = logging.getLogger("clusterctl.collective")

SPAWNED_FILE = "spawned-{rank}.json"     # in $CLUSTERCTL_JOBDIR
ABORT_FILE = "abort.json"
ABORT_EXIT_DELAY = 1.0                    # other ranks exit this much after the aborting one
_MAX_ORDER = 1 << 20                      # a JSON line from the server
_MAX_SPAWNS_KEPT = 256                    # spawns listed in spawned-<rank>.json


def write_private_json(path: str, obj) -> None:
    """Write ``obj`` as JSON to ``path`` atomically (a 0600 temporary file, then rename)."""
    tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0), 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(obj, f, indent=1)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def abort_exit_code(code: int) -> int:
    """The exit status an MPI_Abort error code gives the job's processes: the code, or 1 if it is 0 or >255."""
    return code if 0 < code < 256 else 1


def abort_record(rank: int, code: int, message: str, *, host: str, pid: int, spawned: dict | None) -> dict:
    """The contents of abort.json: the job rank responsible, the error code, a one-line message, and for a
    spawned process its world, rank and pid."""
    return {"rank": rank, "code": code, "exit_code": abort_exit_code(code), "message": message,
            "host": host, "pid": pid, "spawned": spawned, "time": time.time()}


def _auth() -> tuple[str | None, bool]:
    token = os.environ.get(TOKEN_ENV) or None
    return token, os.environ.get(AUTH_ENV, "").strip() == "none"


def _read_line(sock: socket.socket, deadline: float) -> tuple[bytes, bytes]:
    """One line from ``sock`` before ``deadline``: (line, bytes after it); (b"", b"") at EOF."""
    buf = b""
    while b"\n" not in buf:
        left = deadline - time.monotonic()
        if left <= 0:
            raise socket.timeout()
        sock.settimeout(left)
        chunk = sock.recv(4096)
        if not chunk:
            return b"", b""
        buf += chunk
        if len(buf) > 65536:
            raise CollectiveError("the PMI server's answer is longer than 64 KiB")
    line, _, rest = buf.partition(b"\n")
    return line, rest


def join(host: str, port: int, *, rank: int, size: int, timeout: float) -> tuple[dict, socket.socket, bytes]:
    """Register with rank 0's PMI server and wait until every rank has; return (answer, control socket,
    bytes already read after the answer).

    Retries until ``timeout``: while the server does not listen, and while it drops the connection or
    answers without proof of the job token (a flood evicted us, or another job's server holds the port).
    A MACed refusal (wrong WORLD_SIZE, a rank missing at the deadline) fails at once.
    """
    token, no_auth = _auth()
    if token is None and not no_auth:
        raise CollectiveError(f"rank {rank}: cannot join the MPI world: {TOKEN_ENV} is not set and {AUTH_ENV} is "
                              "not 'none' (clusterctl's supervisor sets the token; job.auth: none runs without)")
    deadline = time.monotonic() + timeout
    delay = 0.05
    last = "no answer"
    # The node name decides which ranks MPICH treats as local (shared memory); tests may fake nodes.
    node = os.environ.get(NODE_ENV, "").strip() or socket.gethostname()
    while True:
        if time.monotonic() + delay > deadline and last != "no answer":
            raise CollectiveError(f"rank {rank}: joining the MPI world failed: {last} (PMI server at {host}:{port}, "
                                  f"for {timeout:g}s)")
        try:
            sock = socket.create_connection((host, port), timeout=max(0.1, min(5.0, deadline - time.monotonic())))
        except OSError as e:
            if time.monotonic() + delay > deadline:
                raise CollectiveError(
                    f"rank {rank}: could not reach rank 0's PMI server at MASTER_ADDR:MASTER_PORT {host}:{port} "
                    f"within {timeout:g}s ({e}); is rank 0 running?") from None
            time.sleep(delay)
            delay = min(delay * 2, 1.0)
            continue
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        hello = {"rank": rank, "size": size, "host": node, "pid": os.getpid(), "nonce": secrets.token_hex(16)}
        if token:
            hello["mac"] = hello_mac(token, **hello)
        try:
            sock.sendall(format_command(HELLO, **hello))
            # the server answers when every rank registered, or at its own deadline; allow for clock skew
            raw, rest = _read_line(sock, deadline + 10)
        except socket.timeout:
            sock.close()
            raise CollectiveError(f"rank {rank}: no answer from the PMI server at {host}:{port} within "
                                  f"{timeout + 10:g}s") from None
        except OSError as e:
            raw, rest, last = b"", b"", f"the connection failed ({e})"
        if not raw:
            sock.close()
            if not last.startswith("the connection failed"):
                last = "the server closed the connection without answering"
            time.sleep(delay)
            delay = min(delay * 2, 1.0)
            continue
        try:
            cmd, a = parse_command(raw.decode(errors="replace"))
        except CollectiveError:
            cmd, a = "", {}
        proven = no_auth or (token is not None and cmd == READY and _mac_ok(token, hello["nonce"], a))
        if cmd != READY or not proven:
            sock.close()
            last = (f"the server answered without proof of the job token: {a.get('msg', raw[:200].decode(errors='replace'))}"
                    if cmd == READY else f"unexpected answer {raw[:200]!r}")
            time.sleep(delay)
            delay = min(delay * 2, 1.0)
            continue
        if a.get("rc") != "0":
            sock.close()
            raise CollectiveError(f"rank {rank}: joining the MPI world failed: {a.get('msg', 'unknown error')}")
        sock.settimeout(None)
        return a, sock, rest


def _mac_ok(token: str, nonce: str, a: dict) -> bool:
    want = ready_mac(token, nonce, a.get("rc", ""), a.get("kvsname", ""), a.get("mapping", ""), a.get("pmiid", ""),
                     a.get("msg", ""))
    return hmac.compare_digest(want.encode(), a.get("mac", "").encode("utf-8", "replace"))


def register(host: str, port: int, *, rank: int, size: int, timeout: float) -> dict[str, str]:
    """:func:`join`, then close the control connection (tests and tools that only need the answer)."""
    info, sock, _ = join(host, port, rank=rank, size=size, timeout=timeout)
    sock.close()
    return info


def _local_names() -> set[str]:
    names = {"localhost", "127.0.0.1", "::1", socket.gethostname(), socket.gethostname().split(".")[0]}
    for var in (NODE_ENV, "POD_IP"):
        if os.environ.get(var):
            names.add(os.environ[var].strip())
    try:
        names.add(socket.getfqdn())
        for info in socket.getaddrinfo(socket.gethostname(), None):
            names.add(info[4][0])
    except OSError:
        pass
    return names


class RankControl(threading.Thread):
    """The rank's control connection to the PMI server: carries out spawn and abort orders (daemon thread)."""

    def __init__(self, sock: socket.socket, pending: bytes, *, rank: int, pmi_port: str, child_env: dict):
        super().__init__(name=f"clusterctl-pmi-control-{rank}", daemon=True)
        self.sock, self.buf, self.rank = sock, bytearray(pending), rank
        self.pmi_port, self.child_env = pmi_port, child_env
        self.jobdir = os.environ.get("CLUSTERCTL_JOBDIR", "")
        self.children: list[dict] = []           # {"popen", "world", "rank", "rec"}
        self.spawns: list[dict] = []              # what spawned-<rank>.json lists
        self.seq = 0
        self._send_lock = threading.Lock()
        self._local: set[str] | None = None
        self._bye = threading.Event()
        self.server_gone = False

    def settle(self, timeout: float = 2.0) -> None:
        """At interpreter exit (an ``atexit`` hook): one round trip with the server, so that the notice of an
        MPI_Abort this rank called is handled here, before mpi4py's MPI_Finalize (which runs after Python
        has stopped its threads and would wait for ever in the PMI barrier)."""
        if self.server_gone or not self.is_alive():
            return
        self._send({"op": "exiting", "pid": os.getpid()})
        self._bye.wait(timeout)

    # -- the loop ------------------------------------------------------------------------------------
    def run(self) -> None:
        try:
            self._loop()
        except Exception as e:          # never take the rank down; say why spawn/abort stopped working
            print(f"clusterctl.collective: rank {self.rank}: PMI control thread failed: {e!r}", file=sys.stderr,
                  flush=True)

    def _loop(self) -> None:
        while True:
            self._handle_lines()
            if self.server_gone and not self._running():
                return
            if self.server_gone:
                time.sleep(0.5)
            else:
                ready, _, _ = select.select([self.sock], [], [], 0.5)
                if ready:
                    try:
                        data = self.sock.recv(65536)
                    except OSError:
                        data = b""
                    if not data:
                        self.server_gone = True
                        self.sock.close()
                    self.buf += data
                    if len(self.buf) > _MAX_ORDER and b"\n" not in self.buf:
                        print(f"clusterctl.collective: rank {self.rank}: the PMI server sent {len(self.buf)} bytes "
                              "without a newline; closing the control connection", file=sys.stderr, flush=True)
                        self.server_gone = True
                        self.sock.close()
                        self.buf.clear()
            self._reap()

    def _handle_lines(self) -> None:
        while b"\n" in self.buf:
            raw, _, rest = self.buf.partition(b"\n")
            self.buf = bytearray(rest)
            try:
                msg = json.loads(raw)
            except ValueError:
                log.warning("rank %d: ignoring a control line that is not JSON: %r", self.rank, raw[:80])
                continue
            if isinstance(msg, dict) and msg.get("op") == "spawn":
                self._spawn(msg)
            elif isinstance(msg, dict) and msg.get("op") == "abort":
                self._abort(msg)
            elif isinstance(msg, dict) and msg.get("op") == "bye":
                self._bye.set()

    def _send(self, obj: dict) -> None:
        if self.server_gone:
            return
        with self._send_lock:
            try:
                self.sock.settimeout(10)
                self.sock.sendall(json.dumps(obj, separators=(",", ":")).encode() + b"\n")
            except OSError as e:
                log.warning("rank %d: cannot reach the PMI server: %s", self.rank, e)
            finally:
                try:
                    self.sock.settimeout(None)
                except OSError:
                    pass

    # -- spawn ---------------------------------------------------------------------------------------------
    def _check_hosts(self, info: dict) -> None:
        """MPICH's ``host``/``hosts``/``hostfile`` info keys: only this host can be honoured."""
        wanted: list[str] = []
        for key in ("host", "hosts"):
            if info.get(key):
                wanted += [h.strip() for h in info[key].split(",") if h.strip()]
        if info.get("hostfile"):
            path = info["hostfile"]
            try:
                with open(path, encoding="utf-8", errors="replace") as f:
                    text = f.read(65536)
            except OSError as e:
                raise CollectiveError(f"info hostfile={path!r}: {e.strerror}") from None
            for line in text.splitlines():
                line = line.split("#", 1)[0].strip()
                if line:
                    wanted.append(line.split()[0].split(":")[0])
        if not wanted:
            return
        if self._local is None:
            self._local = _local_names()
        # "name:N" (hydra's host:slots form) names the host "name"
        foreign = [h for h in wanted if h.split(":")[0] not in self._local]
        if foreign:
            raise CollectiveError(
                f"info host {foreign[0]!r} is not this host ({socket.gethostname()}): under clusterctl's PMI server "
                "spawned processes start on the spawning rank's host only")

    def _log_for(self, seq: int, rank: int) -> str | None:
        """A log beside this rank's own (its stdout, when that is a regular file), or None (inherit stdout)."""
        try:
            if not stat.S_ISREG(os.fstat(1).st_mode):
                return None
            path = os.readlink("/proc/self/fd/1")
        except OSError:
            return None
        if not os.path.isabs(path) or path.endswith(" (deleted)"):
            return None
        stem = path[:-4] if path.endswith(".log") else path
        return f"{stem}.spawn{seq}.{rank}.log"

    def _spawn(self, order: dict) -> None:
        sid = order.get("id")
        started: list[subprocess.Popen] = []
        logs: list[str] = []
        argv: list[str] = ["?"]
        self.seq += 1                     # spawn N of this rank (refused ones count)
        seq, rank, recs = self.seq, 0, []
        try:
            size, pmiids, cmds, world = int(order["size"]), list(order["pmiids"]), list(order["cmds"]), str(order["world"])
            for c in cmds:
                self._check_hosts(dict(c.get("info") or {}))
            for c in cmds:
                info = dict(c.get("info") or {})
                argv = [str(a) for a in c["argv"]]
                if info.get("path"):
                    argv[0] = os.path.join(info["path"], argv[0])
                cwd = info.get("wdir") or None
                for _ in range(int(c["nprocs"])):
                    env = dict(self.child_env, PMI_PORT=self.pmi_port, PMI_ID=str(pmiids[rank]), PMI_RANK=str(rank),
                               PMI_SIZE=str(size), PMI_SPAWNED="1")
                    logpath = self._log_for(seq, rank)
                    out = open(logpath, "wb", opener=_private_opener) if logpath else None
                    if logpath:
                        logs.append(logpath)
                    try:
                        p = subprocess.Popen(argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=out,
                                             stderr=subprocess.STDOUT if out else None, close_fds=True)
                    finally:
                        if out is not None:
                            out.close()
                    started.append(p)
                    rec = {"rank": rank, "appnum": c.get("appnum", 0), "pid": p.pid, "argv": argv, "cwd": cwd or os.getcwd(),
                           "log": logpath, "exit_code": None, "ended_at": None}
                    recs.append(rec)
                    self.children.append({"popen": p, "world": world, "rank": rank, "rec": rec})
                    rank += 1
        except (CollectiveError, OSError, ValueError, KeyError, TypeError, IndexError) as e:
            for p in started:
                p.kill()
                p.wait()
            self.children = [c for c in self.children if c["popen"] not in started]
            for path in logs:           # the processes were killed at once: nothing worth keeping
                try:
                    os.unlink(path)
                except OSError:
                    pass
            if isinstance(e, OSError) and e.strerror:
                why = f"cannot start {e.filename or argv[0]!r}: {e.strerror}"
            else:
                why = str(e) or repr(e)
            print(f"clusterctl.collective: rank {self.rank}: MPI_Comm_spawn refused: {why}", file=sys.stderr, flush=True)
            self._send({"op": "spawn_failed", "id": sid, "error": why})
            return
        self.spawns.append({"seq": seq, "world": world, "spawner": order.get("spawner"), "started_at": time.time(),
                            "procs": recs})
        del self.spawns[:-_MAX_SPAWNS_KEPT]
        self._record()
        self._send({"op": "spawned", "id": sid, "pids": [p.pid for p in started]})

    def _record(self) -> None:
        if not self.jobdir or not os.path.isdir(self.jobdir):
            return
        path = os.path.join(self.jobdir, SPAWNED_FILE.format(rank=self.rank))
        try:
            write_private_json(path, {"rank": self.rank, "pid": os.getpid(), "host": socket.gethostname(),
                                      "spawns": self.spawns})
        except OSError as e:
            log.warning("rank %d: cannot write %s: %s", self.rank, path, e)

    def _running(self) -> bool:
        return any(c["popen"].poll() is None for c in self.children)

    def _reap(self) -> None:
        changed = False
        for c in list(self.children):
            code = c["popen"].poll()
            if code is None:
                continue
            self.children.remove(c)
            c["rec"]["exit_code"], c["rec"]["ended_at"] = code, time.time()
            changed = True
            self._send({"op": "exited", "world": c["world"], "rank": c["rank"], "code": code})
        if changed:
            self._record()

    # -- abort ---------------------------------------------------------------------------------------------
    def _abort(self, notice: dict) -> None:
        ec = notice.get("exit_code") if isinstance(notice.get("exit_code"), int) else 1
        mine = notice.get("rank") == self.rank
        for c in self.children:
            try:
                c["popen"].send_signal(signal.SIGKILL)
            except OSError:
                pass
        self._reap()
        if mine and self.jobdir and os.path.isdir(self.jobdir):
            rec = {k: notice.get(k) for k in ("rank", "code", "exit_code", "message", "host", "pid", "spawned", "time")}
            try:
                write_private_json(os.path.join(self.jobdir, ABORT_FILE), rec)
            except OSError as e:
                log.warning("rank %d: cannot write %s: %s", self.rank, ABORT_FILE, e)
        if notice.get("aborter"):
            line = f"clusterctl.collective: {notice.get('message')}: rank {self.rank} exits with code {ec}\n"
        else:
            line = (f"clusterctl.collective: {notice.get('message')}: ending rank {self.rank} "
                    f"(exit code {ec})\n")
            time.sleep(ABORT_EXIT_DELAY)      # the aborting rank's exit is the job's first failure
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        try:
            os.write(2, line.encode(errors="replace"))
        except OSError:
            pass
        os._exit(ec)


def _private_opener(path, flags):
    return os.open(path, flags, 0o600)
