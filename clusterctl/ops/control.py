"""Asking a running job's host supervisor over its control socket: one round trip, no Python started on the host.

The host side is clusterctl/host/control.py (the protocol, the control file, the flood limits). Here is the one
shell line that asks it: bash builtins read the control file (`1 PID PORT CLIENT_SECRET SERVER_SECRET`, 0600 in
the 0700 job dir), check that the supervisor's pid is there, connect with bash's /dev/tcp, send
`CLIENT_SECRET COMMAND JSON`, and pass the body through once the supervisor proved itself (`ok SERVER_SECRET`
within CLIENT_HEADER_TIMEOUT). The secrets never reach an argv: `read` and `printf` are builtins. Where any of
that fails (no control file: the job ended or never started here; a dead supervisor; a shell without bash or
without /dev/tcp; a supervisor that does not answer in time or refuses the request), the same line runs the
agent instead (`python3 ... agent status|top|stop|logs`), which works from the state files, as before. When
that fallback is needed and this version's host package is not on the host, the line exits NEEDS_PACKAGE
having run nothing: the caller installs the package (`hosttools.install_on`) and asks those hosts again.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from ..errors import ClusterctlError, TimedOut
from ..host.controlproto import CLIENT_HEADER_TIMEOUT, CONTROL_FILE, CONTROL_VERSION, OK
from ..plan import Host
from ..quoting import join, quote
from ..remote import LineCallback, Remote, Result, Until
from ..transport.base import TIMED_OUT, LineSplitter, cut_short
from .hosttools import install_on, package_dir, tool_argv

__all__ = ["control_command", "ask", "Enough", "host_key", "agent_reply", "over_bound", "NEEDS_PACKAGE", "Direct", "remember", "recall", "forget"]

# the line exits with this when the agent is needed and this version of the host package is not on the host
NEEDS_PACKAGE = 97


def _request(command: str, args: dict | None) -> str:
    return command if not args else f"{command} {json.dumps(args, sort_keys=True, separators=(',', ':'))}"


def agent_command(fallback: list[str]) -> str:
    """The shell line that runs `agent FALLBACK...` (exit NEEDS_PACKAGE where this version's host package is not
    on the host)."""
    return f"test -d {quote(package_dir())} || exit {NEEDS_PACKAGE}; exec {join(tool_argv('agent', fallback))}"


def control_command(jobdir: str, command: str, args: dict | None, fallback: list[str]) -> str:
    """The shell line that asks the supervisor of the job in `jobdir` (relative to the login's home) `command`
    with `args` over its control socket, or runs `agent FALLBACK...` where the supervisor cannot answer."""
    request = _request(command, args)
    agent = agent_command(fallback)
    script = (
        f"f={quote(jobdir + '/' + CONTROL_FILE)}; "
        f"if read -r v i p c s <\"$f\" && [ \"$v\" = {CONTROL_VERSION} ] && [ -d \"/proc/$i\" ]; then "
        f"{{ printf '%s %s\\n' \"$c\" {quote(request)} >&3 && IFS= read -r -t {CLIENT_HEADER_TIMEOUT:g} h <&3 && "
        f"[ \"$h\" = \"{OK} $s\" ] && exec cat <&3; }} 3<>\"/dev/tcp/127.0.0.1/$p\"; fi 2>/dev/null; "
        f"{agent}"
    )
    # the login shell may be any POSIX sh: a bash runs the script itself (no second shell), another shell hands
    # it to bash; without bash, the agent answers
    return (f"ctl={quote(script)}; if [ -n \"${{BASH_VERSION-}}\" ]; then eval \"$ctl\"; "
            f"elif command -v bash >/dev/null 2>&1; then exec bash -c \"$ctl\"; fi; {agent}")


# --------------------------------------------------------------------------------------------- direct

# Where `start` keeps each host's control endpoint (the port and both secrets of the control file, as `agent up`
# reported them), so that later commands on this controller can ask the supervisors straight through the kept
# connections (clusterctl.transport.muxfwd): no shell, no `cat`, no fork on the host. One 0600 file per job in a
# private directory of the cache; a controller without it (another machine, a wiped cache) asks with the line.
CONTROL_CACHE = "control"
_MAX_CACHE = 4 << 20
STALE_DAYS = 30
_CACHE_LOCK = threading.Lock()  # `top` asks each host from a thread of its own
DIRECT_MAX_BODY = 16 << 20  # a direct answer kept in memory; a longer one is asked for again by the line
MAX_CONTROL_REPLY = 16 << 20  # a host's status, top, stop or start reply parsed (a few kB a process)


@dataclass(frozen=True)
class Direct:
    """Ask the supervisors of `job` `command` with `args` through the kept connections where this controller
    knows their control endpoints; `fallback` is the agent's argv for a host whose supervisor took longer than
    CLIENT_HEADER_TIMEOUT to answer (the line would wait for it again). `args` and `fallback` may be functions of
    the host, for a request that names it (`logs`: its label)."""

    job: str
    command: str
    args: dict | None | Callable[[Host], dict | None]
    fallback: list[str] | Callable[[Host], list[str]]

    def request(self, host: Host) -> str:
        return _request(self.command, self.args(host) if callable(self.args) else self.args)

    def agent(self, host: Host) -> str:
        return agent_command(self.fallback(host) if callable(self.fallback) else self.fallback)


def host_key(host: Host) -> str:
    """How this controller's caches name a host: the login, the name it connects to, the port."""
    return f"{host.user}@{host.connect_name}:{host.port}"


def cache_file(job: str, suffix: str = ".json") -> str | None:
    """`job`'s file in this controller's control cache (0700), or None for a name that is no file name."""
    if not job or len(job) > 200 or not all(c.isalnum() or c in "._-" for c in job) or job[0] == ".":
        return None
    from ..cache import private_dir

    folder = private_dir(CONTROL_CACHE)
    return None if folder is None else os.path.join(folder, f"{job}{suffix}")


def _valid(entry) -> bool:
    return (isinstance(entry, dict) and isinstance(entry.get("port"), int) and not isinstance(entry["port"], bool)
            and 0 < entry["port"] < 65536 and all(_secret(entry.get(k)) for k in ("client", "server")))


def _secret(value) -> bool:
    return isinstance(value, str) and 16 <= len(value) <= 256 and all(c in "0123456789abcdef" for c in value)


def recall(job: str) -> dict[str, dict]:
    """{host key: {port, client, server}} that `start` kept for `job` on this controller ({} when none)."""
    from ..cache import read_private

    path = cache_file(job)
    data = read_private(path, _MAX_CACHE) if path else None
    try:
        doc = json.loads(data) if data else {}
    except ValueError:
        return {}
    return {k: v for k, v in doc.items() if isinstance(k, str) and _valid(v)} if isinstance(doc, dict) else {}


def remember(job: str, endpoints: dict[Host, dict]) -> None:
    """Keep the control endpoints a `start` of `job` reported (hosts without a valid one are left out); the files
    of jobs started more than STALE_DAYS ago go (their next `status` asks with the line)."""
    from ..cache import write_private

    path = cache_file(job)
    if path is None:
        return
    with _CACHE_LOCK:
        kept = {host_key(h): {k: e[k] for k in ("port", "client", "server")} for h, e in endpoints.items() if _valid(e)}
        write_private(path, json.dumps(kept).encode())
        folder, old = os.path.dirname(path), time.time() - STALE_DAYS * 86400
        try:
            with os.scandir(folder) as entries:
                for entry in entries:
                    if entry.name.endswith(".json") and entry.stat(follow_symlinks=False).st_mtime < old:
                        os.unlink(entry.path)
        except OSError:
            pass


def forget(job: str, hosts: Sequence[Host] | None = None) -> None:
    """Drop the kept control endpoints of `hosts` (all of the job's: None): their supervisors are gone, or did
    not answer as theirs would."""
    from ..cache import write_private

    path = cache_file(job)
    if path is None or not os.path.exists(path):
        return
    drop = None if hosts is None else {host_key(h) for h in hosts}
    with _CACHE_LOCK:
        left = {} if drop is None else {k: v for k, v in recall(job).items() if k not in drop}
        if left:
            write_private(path, json.dumps(left).encode())
            return
        try:
            os.unlink(path)
        except OSError:
            pass


def _forwards(remote: Remote, hosts: Sequence[Host], direct: Direct) -> dict:
    """{host: Forward} for the hosts this controller can ask directly: a control endpoint kept from their `start`
    and a kept connection open now."""
    known = recall(direct.job)
    if not known:
        return {}
    from ..transport.muxfwd import Forward

    forwards = {}
    for host in hosts:
        entry = known.get(host_key(host))
        control = remote.kept_control(host) if entry else None
        if control is not None:
            forwards[host] = Forward(control, entry["port"], f"{entry['client']} {direct.request(host)}\n".encode(),
                                     f"{OK} {entry['server']}".encode())
    return forwards


class Enough(Until):
    """The hosts' answers to one `ask` as they come, from each of its paths (threads): once `need` (of the Results so
    far, host -> Result) gives a reason, the others are waited for as long again as that took, plus `grace_s` (a host
    that is up answers in that time, and its rows are worth showing: a lost host whose supervisor died with the job's
    processes, say); then those that have not answered are not waited for, and their Result (a TimedOut: they did not
    answer) says after how long and why."""

    def __init__(self, need: Callable[[dict[Host, Result]], str | None], grace_s: float = 1.0):
        self._need, self._lock, self._results, self._why = need, threading.Lock(), {}, None
        self._t0, self._until, self._grace = time.monotonic(), None, grace_s

    def add(self, host: Host, result: Result) -> None:
        with self._lock:
            self._results[host] = result
            if self._why is None:
                self._why = self._need(dict(self._results))
                if self._why is not None:
                    now = time.monotonic()
                    self._until = now + (now - self._t0) + self._grace

    def is_set(self) -> bool:
        return self._until is not None and time.monotonic() >= self._until

    def cut(self, host: Host, command: str, seconds: float) -> Result:
        reason = f"no answer in {seconds:.1f}s, not waited for: {self._why}"
        return Result(host, command, TIMED_OUT, "", reason, seconds, TimedOut(host.label, reason, command))


def ask(remote: Remote, command: str | Callable[[Host], str], *, hosts: Sequence[Host] | None = None,
        timeout: float | None, what: str, on_line: LineCallback | None = None,
        direct: Direct | None = None, enough: Enough | None = None) -> dict[Host, Result]:
    """Run a control_command line on `hosts` (default: all); the hosts that need this version's host package for
    the fallback get it (one more round trip, those hosts only) and are asked again. Each host's Result (an
    install that failed: its Result).

    With `direct` (and a deadline), the supervisors whose control endpoints this controller kept from their `start`
    are asked straight through the kept connections (clusterctl.transport.muxfwd: nothing started on the host), the
    other hosts with the line at the same time; `on_line` gets a direct answer's lines once it is whole. A host that
    refused (no supervisor listening there any more, forwarding off in its sshd) or answered as no supervisor of
    ours would is forgotten and asked with the line, as is (not forgotten) one whose kept connection went away or
    whose answer was over muxfwd's limit; one whose supervisor did not answer within CLIENT_HEADER_TIMEOUT, with the
    agent alone (the line would wait for it again); all of them in the time left. With `enough`, each path gives it
    each host's Result as it comes, and once it has what the caller needs no host is waited for any more (its cut)."""
    targets = list(remote.hosts if hosts is None else hosts)
    forwards = _forwards(remote, targets, direct) if direct is not None and timeout else {}
    if not forwards:
        return _ask_line(remote, command, targets, timeout, what, on_line, enough)
    from ..transport.muxfwd import ask_many

    t0 = time.monotonic()
    results: dict[Host, Result] = {}
    rest = [h for h in targets if h not in forwards]
    beside = ThreadPoolExecutor(max_workers=1) if rest else None  # the line for them while the others are asked
    line = beside.submit(_ask_line, remote, command, rest, timeout, what, on_line, enough) if beside else None

    def answered(h: Host, body: bytes) -> None:  # split, passed on and kept as the line's output is
        out = LineSplitter(h, "out", on_line)
        out.feed(body)
        results[h] = Result(h, f"<control {direct.command}>", 0, out.close(), "", time.monotonic() - t0)
        if enough is not None:
            enough.add(h, results[h])

    outcomes = ask_many(forwards, header_timeout=CLIENT_HEADER_TIMEOUT, timeout=timeout, max_body=DIRECT_MAX_BODY,
                        on_ok=answered, stop=None if enough is None else enough.is_set)
    cut = [h for h, o in outcomes.items() if o.kind == "cut" or (o.kind != "ok" and enough is not None and enough.is_set())]
    results.update((h, enough.cut(h, f"<control {direct.command}>", time.monotonic() - t0)) for h in cut)
    outcomes = {h: o for h, o in outcomes.items() if h not in cut}
    gone = [h for h, o in outcomes.items() if o.kind in ("refused", "bad")]
    slow = {h for h, o in outcomes.items() if o.kind == "timeout"}
    other = [h for h, o in outcomes.items() if o.kind in ("unreachable", "big")]  # not the host's word against it
    if gone:
        forget(direct.job, gone)
    gone += other
    if gone or slow:
        def again(h: Host) -> str:
            return direct.agent(h) if h in slow else command(h) if callable(command) else command

        left = max(timeout - (time.monotonic() - t0), 0.1)  # the caller's deadline holds for every host
        results.update(_ask_line(remote, again, [*gone, *slow], left, what, on_line, enough))
    if line is not None:
        results.update(line.result())
        beside.shutdown()
    return {h: results[h] for h in targets}


def _ask_line(remote: Remote, command: str | Callable[[Host], str], hosts: Sequence[Host], timeout: float | None,
              what: str, on_line: LineCallback | None, enough: Enough | None = None) -> dict[Host, Result]:
    results = remote.run(command, hosts=hosts, check=False, timeout=timeout, what=what, on_line=on_line,
                         max_output=MAX_CONTROL_REPLY, until=enough)
    missing = [h for h, r in results.items() if r.exit_code == NEEDS_PACKAGE]
    if missing and enough is not None and enough.is_set():  # not waited for: neither is the package's install
        results.update((h, enough.cut(h, results[h].command, results[h].seconds)) for h in missing)
    elif missing:
        installed = install_on(remote, ("agent",), missing)
        again = [h for h in missing if installed[h].ok]
        results.update({h: installed[h] for h in missing if not installed[h].ok})
        if again:
            results.update(remote.run(command, hosts=again, check=False, timeout=timeout, what=what, on_line=on_line,
                                      max_output=MAX_CONTROL_REPLY, until=enough))
    return results


def over_bound(res: Result) -> bool:
    """Whether `res` is a control reply over MAX_CONTROL_REPLY, which is not parsed (256 MiB of `{}` would take ~6 GiB
    as objects). The callers keep no more of it than that (Remote.run's max_output: the rest is dropped as it
    comes, and said at the end: cut_short); a Result from elsewhere, by its length."""
    return len(res.stdout) > MAX_CONTROL_REPLY or cut_short(res.stdout)


def agent_reply(res: Result) -> dict:
    """The agent's (or the supervisor's) JSON object in a host's output, whatever a shell's start-up printed before
    it; where there is none, `{"ok": False, "error": ...}` with the host's stderr (else stdout) tail. Its fields
    are the host's word: read them through HostStatus.from_json or check each one's type."""
    if over_bound(res):
        return {"ok": False, "error": f"a reply over the {MAX_CONTROL_REPLY >> 20} MiB a host's control reply may be"}
    try:
        return res.reply()
    except ClusterctlError:
        return {"ok": False, "error": (res.stderr or res.stdout).strip()[-500:] or f"exit {res.exit_code}"}
