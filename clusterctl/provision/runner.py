"""Run the provisioning steps on every host in parallel; collect host × step outcomes and per-host logs."""

from __future__ import annotations

import base64
import fcntl
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ..cache import makedirs
from ..errors import ProvisionError
from ..files import open_append
from ..plan import Host
from ..quoting import join, redact
from ..remote import Result
from . import aptoffline, mesh, wheelhouse
from .hostdata import shown
from .probe import probe_hosts
from .render import render_step
from .steps import (gpu_apt_packages, needs_root, pip_as_login, read_keyring, requirements, selected_steps, step_context,
                    sudo_problem)

__all__ = ["StepOutcome", "ProvisionReport", "provision", "parse_status", "log_dir", "STATUS_PREFIX"]

STATUS_PREFIX = "CLUSTERCTL_STEP "
HOST_GRACE_S = 2  # a step past provision.timeout is ended on the host this much after the controller gave up
KILL_AFTER_S = 5  # ... with SIGTERM to its process group, then SIGKILL this much later
HOST_LOCK_DIR = "$HOME/.cache/clusterctl"  # where the login's provision lock is, on its host (expanded there)
HOST_LOCK = HOST_LOCK_DIR + "/provision.lock"  # one step at a time per login on a host, whichever controller
HOST_LOCK_WAIT = 0.8  # of provision.timeout: a step waits this long for another run's step on its host
HOST_LOCK_BUSY = 199  # flock's exit when the wait ran out
LOG_KEEP_BYTES = 32 << 20  # a host's log past this at the start of a run is kept as <host>.log.1, and a new one begun
REASON_CHARS = 300  # of a host's own words in a table cell (the whole line is in the host's log)
LOG_RUN_BYTES = LOG_KEEP_BYTES  # what one run writes to a host log; past it, one line says the rest is left out
EventCallback = Callable[[Host, str, str, str], None]  # (host, step, "line"|"status", text)
# A step's script travels on the command's stdin, never as an argument: Linux takes at most 128 KiB in one
# argument (the ssh_mesh script of a few hundred hosts, a big keyring). The host reads one line first: the secret the
# script reads on its own stdin (ssh_mesh's private key), base64, or nothing; then the script, which bash reads as a
# file on fd 3 (a here-string: a pipe or an unlinked temporary file). The secret reaches the script through a pipe
# from printf, bash's own: it is no process's argument either. LIMIT: coreutils `timeout` (see _run_step).
STEP_BOOT = (
    'IFS= read -r secret || exit 1; script=$(cat); '
    'step() { if [ -n "$secret" ]; then printf %s "$secret" | base64 -d | "$@" 3<<<"$script"; '
    'else "$@" 3<<<"$script" </dev/null; fi; }; '
    'if command -v timeout >/dev/null 2>&1; then step LIMIT bash /dev/fd/3; else step bash /dev/fd/3; fi'
)


@dataclass(frozen=True)
class StepOutcome:
    """One host's result of one step: ok | changed | failed | skipped, why, and how long it took."""

    status: str
    reason: str = ""
    seconds: float = 0.0


@dataclass
class ProvisionReport:
    """Every host × step outcome of one `provision` run, and where the per-host logs are."""

    job: str
    steps: list[str]
    hosts: tuple[Host, ...]
    check: bool
    log_dir: Path
    outcomes: dict[tuple[Host, str], StepOutcome] = field(default_factory=dict)
    seconds: float = 0.0

    def count(self, status: str) -> int:
        """How many host × step cells have `status`."""
        return sum(1 for o in self.outcomes.values() if o.status == status)

    @property
    def ok(self) -> bool:
        """True when no step failed (or was skipped after a failure) on any host."""
        return not any(o.status in ("failed", "skipped") for o in self.outcomes.values())

    def log_path(self, host: Host) -> Path:
        """The controller-side provisioning log of `host`."""
        return self.log_dir / f"{host.label}.log"


def log_dir(job: str) -> Path:
    """Controller-side directory of a job's provisioning logs: ~/.cache/clusterctl/provision/<job>/."""
    return mesh.cache_root() / "provision" / job


def parse_status(step: str, res: Result, timeout: float) -> StepOutcome:
    """Turn a step script's Result into an outcome, from its final `CLUSTERCTL_STEP` line and exit code."""
    # what the host wrote is shown as doctor shows a host's text: one line, at most REASON_CHARS
    if res.unreachable:
        return StepOutcome("failed", res.stderr.strip() or "host unreachable", res.seconds)
    if res.timed_out:
        return StepOutcome("failed", f"timed out after {timeout:g}s (provision.timeout)", res.seconds)
    status_lines = [ln for ln in res.stdout.splitlines() if ln.startswith(STATUS_PREFIX)]
    if not status_lines:
        tail = (res.stdout + res.stderr).strip().splitlines()[-1:] or ["no output"]
        return StepOutcome("failed", f"exit {res.exit_code} without a status line: {shown(tail[0], REASON_CHARS)}", res.seconds)
    words = status_lines[-1][len(STATUS_PREFIX):].split(" ", 2)
    name, status, reason = (words + ["", ""])[:3]
    if name != step or status not in ("ok", "changed", "failed"):
        return StepOutcome("failed", f"bad status line: {shown(status_lines[-1], REASON_CHARS)}", res.seconds)
    if status != "failed" and res.exit_code != 0:
        return StepOutcome("failed", f"exit {res.exit_code} after reporting {status}", res.seconds)
    return StepOutcome(status, shown(reason.strip(), REASON_CHARS), res.seconds)


class _Logs:
    """Per-host log files, appended to; every line is `[step] text`, at most LOG_RUN_BYTES a host per run. Held by
    one run of the job at a time on this controller (its `.lock`): a second run at once would race the first on
    the same hosts (a venv the first is still creating looks made to the second)."""

    def __init__(self, folder: Path, hosts, header: str, job: str):
        try:
            makedirs(folder)
            self._held = os.open(folder / ".lock", os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as exc:  # an unwritable cache (XDG_CACHE_HOME): before any host is touched
            raise ProvisionError(f"cannot write the provisioning logs in {folder}: {exc.strerror or exc} "
                                 f"(set XDG_CACHE_HOME to a writable directory)") from None
        self._files: dict = {}
        self._written: dict = {}  # bytes this run wrote to each host's log
        self._full: set = set()  # hosts whose log reached LOG_RUN_BYTES in this run
        try:
            fcntl.flock(self._held, fcntl.LOCK_EX | fcntl.LOCK_NB)
            for h in hosts:  # a log past LOG_KEEP_BYTES becomes <host>.log.1 (the one before it goes)
                path = folder / f"{h.label}.log"
                if path.is_file() and path.stat().st_size > LOG_KEEP_BYTES:
                    os.replace(path, folder / f"{h.label}.log.1")
            for h in hosts:  # never a FIFO, which would wait for a reader forever, a socket or a device
                self._files[h] = open(folder / f"{h.label}.log", "a", encoding="utf-8", opener=open_append)
        except BlockingIOError:
            os.close(self._held)
            raise ProvisionError(f"another clusterctl provision of {job} is running on this controller; "
                                 "run again when it has finished") from None
        except OSError as exc:
            os.close(self._held)
            for fh in self._files.values():
                fh.close()
            which = f"{os.path.basename(exc.filename)}: " if exc.filename else ""
            raise ProvisionError(f"cannot write the provisioning logs in {folder}: {which}{exc.strerror or exc}") from None
        self._lock = threading.Lock()
        for fh in self._files.values():
            fh.write(header + "\n")

    def write(self, host: Host, step: str, text: str, *, own: bool = False) -> None:
        """Log a line of `host`'s output in `step`; `own`: the controller's own line (a step's outcome), written past
        the cap too."""
        with self._lock:
            fh = self._files[host]
            if fh.closed:  # a line that came after the run ended (a timed-out step's leftover child): not logged
                return
            if host in self._full and not own:  # its output past LOG_RUN_BYTES: the one line saying so is written
                return
            line = f"[{step}] {redact(text)}\n"
            size = self._written.get(host, 0) + len(line.encode())
            if size > LOG_RUN_BYTES and not own:  # a host may print without end: rotation is only between runs
                self._full.add(host)
                line = (f"[{step}] clusterctl: the rest of this host's output in this run is left out of its log "
                        f"(more than {LOG_RUN_BYTES >> 20} MiB); `clusterctl provision --lines` prints all of it\n")
            self._written[host] = size
            fh.write(line)
            fh.flush()

    def close(self) -> None:
        with self._lock:
            for fh in self._files.values():
                fh.close()
        os.close(self._held)  # the next run of the job may start


def provision(
    session,
    *,
    check: bool = False,
    force: bool = False,
    only: list[str] | None = None,
    on_event: EventCallback | None = None,
) -> ProvisionReport:
    """Bring every host to the spec's `provision` state (or, with check, report what would change)."""
    spec, remote = session.spec, session.remote
    prov = spec.provision
    if prov is None:
        raise ProvisionError(f"{spec.source} has no provision: section (see docs/provisioning.md)")
    steps = selected_steps(prov, only)
    _preflight(spec, steps)
    hosts = session.plan.hosts
    start = time.monotonic()
    report = ProvisionReport(spec.name, steps, hosts, check, log_dir(spec.name))
    mode = "check" if check else ("force" if force else "apply")
    logs = _Logs(report.log_dir, hosts, f"=== {time.strftime('%Y-%m-%d %H:%M:%S')} provision ({mode}) steps: {' '.join(steps)}",
                 spec.name)
    emit = on_event or (lambda *a: None)

    def on_line(step: str):
        def cb(host: Host, _stream: str, line: str) -> None:
            logs.write(host, step, line)
            emit(host, step, "line", line)

        return cb

    try:
        wh = prov.wheelhouse if prov.wheelhouse and prov.wheelhouse.enabled else None
        interpreter = prov.python.interpreter if prov.python else "python3"
        facts, dead = probe_hosts(remote, hosts, interpreter=interpreter, wheelhouse=wh.remote if wh else "")
        alive = [h for h in hosts if h not in dead]
        for host, why in dead.items():
            logs.write(host, "probe", why)
        for step in steps:
            for host in hosts:
                if host in dead:
                    report.outcomes[(host, step)] = StepOutcome("skipped" if step != steps[0] else "failed", dead[host])
            if not alive:
                continue
            if step == "wheelhouse":
                outcomes = _wheelhouse(session, steps, alive, facts, check=check, force=force, log=logs.write)
            elif _offline(prov, step):
                outcomes = _offline_apt(session, step, alive, check=check, force=force, log=logs.write)
                rest = [h for h in alive if h not in outcomes]
                if rest:
                    outcomes.update(_run_step(session, step, rest, facts, check=check, force=force, on_line=on_line(step)))
            else:
                outcomes = _run_step(session, step, alive, facts, check=check, force=force, on_line=on_line(step))
            for host, outcome in outcomes.items():
                report.outcomes[(host, step)] = outcome
                logs.write(host, step, f"=> {outcome.status} {outcome.reason}".rstrip() + f" ({outcome.seconds:.1f}s)",
                           own=True)
                emit(host, step, "status", outcome.status)
                if outcome.status == "failed":
                    dead[host] = f"{step} failed"
            alive = [h for h in alive if h not in dead]
    finally:
        logs.close()
    report.seconds = time.monotonic() - start
    return report


def _script(spec, step: str, *, check: bool, force: bool, mesh_ctx: dict | None) -> str:
    """The rendered script of `step` (reading what it needs on the controller: a requirements file, keyrings)."""
    prov = spec.provision
    wh = prov.wheelhouse if prov.wheelhouse and prov.wheelhouse.enabled else None
    try:
        ctx = step_context(step, spec, check=check, force=force, wheelhouse_remote=wh.remote if wh else None, mesh=mesh_ctx)
        return render_step(f"{step}.sh.j2", ctx)
    except ValueError as exc:
        raise ProvisionError(f"cannot render step {step}: {exc}") from None


def _mesh_key(spec) -> tuple[bytes, str]:
    key = spec.provision.ssh_mesh.key
    return mesh.mesh_key(spec.local_path(key) if key else mesh.default_key_path(spec.name), spec.name)


def _preflight(spec, steps: list[str]) -> None:
    """Read and check what the selected steps take from the controller (a requirements file, keyrings, file: roots,
    the mesh key) before any host is touched: a missing file is one error, not a run stopped halfway."""
    prov = spec.provision
    for step in steps:
        if step == "wheelhouse":
            requirements(spec)
        elif step == "ssh_mesh":
            _mesh_key(spec)
        else:
            _script(spec, step, check=True, force=False, mesh_ctx=None)
        if _offline(prov, step):
            _offline_sources(spec, step)


def _run_step(session, step: str, hosts, facts, *, check: bool, force: bool, on_line) -> dict[Host, StepOutcome]:
    spec, remote = session.spec, session.remote
    prov = spec.provision
    mesh_ctx, stdin = None, None
    if step == "ssh_mesh":
        private, public = _mesh_key(spec)
        # the hosts the probe reached (a host that failed it has no facts, and no key to pin)
        mesh_ctx = mesh.mesh_context(spec.name, public, [h for h in session.plan.hosts if h in facts], facts)
        for host, why in mesh_ctx.pop("dropped"):
            if host in hosts:
                on_line(host, "out", f"controller: {why}: left out of the mesh's known_hosts and ssh config")
        stdin = private
    script = _script(spec, step, check=check, force=force, mesh_ctx=mesh_ctx)
    out: dict[Host, StepOutcome] = {}
    as_root: dict[Host, bool] = {}
    for host in hosts:
        as_root[host] = needs_root(step, prov, facts[host])
        why = sudo_problem(host.address, facts[host]) if as_root[host] else ""
        if why:
            out[host] = StepOutcome("failed", why)
    # The host ends a step the controller gave up on (provision.timeout) HOST_GRACE_S later: coreutils `timeout`,
    # inside sudo where the step runs as root (so that its signals reach every process), ends the step's whole
    # process group (SIGTERM, SIGKILL KILL_AFTER_S later), so nothing it started (a hung apt-get holding dpkg's
    # lock, a user command) is left for the next run to meet. Hosts without `timeout` run the step as before.
    limit = join(["timeout", "-k", str(KILL_AFTER_S), f"{prov.timeout + HOST_GRACE_S:g}"])
    argv = ["bash", "-c", STEP_BOOT.replace("LIMIT", limit), f"clusterctl-{step}"]
    stdin = base64.b64encode(stdin or b"") + b"\n" + script.encode()

    def command(host: Host) -> str:
        # What needs root runs through non-interactive sudo; relative paths stay under the login user's home. A venv
        # in that home stays the user's: the step's pip part goes back to the user (CLUSTERCTL_PIP_UID, _pip.sh.j2).
        if as_root[host] and step != "commands":  # commands: per command, inside the script (`root: true`)
            env = [f"CLUSTERCTL_USER_HOME={facts[host].home}"]
            if pip_as_login(step, prov, facts[host]):
                env.append(f"CLUSTERCTL_PIP_UID={facts[host].uid}")
            return _host_locked(join(["sudo", "-n", "env", *env, *argv]), step, prov.timeout)
        return _host_locked(join(argv), step, prov.timeout)

    runnable = [h for h in hosts if h not in out]
    if runnable:
        results = remote.run(command, hosts=runnable, stdin=stdin, timeout=prov.timeout, on_line=on_line, check=False, what=step)
        out.update({h: parse_status(step, r, prov.timeout) for h, r in results.items()})
    return out


def _host_locked(command: str, step: str, timeout: float, *, upload: bool = False) -> str:
    """`command` run while holding the login's provision lock on its host (util-linux `flock`, taken as the login
    user, before any sudo), so that runs from two controllers (or of two specs) take turns step by step instead of
    racing on one venv: the second waits for the first's step, then finds it done. `-o`: what the step leaves
    running (a service it started) does not hold the lock, flock itself does until the step ends. A wait past
    HOST_LOCK_WAIT of the step's timeout fails the step in one line; a host without flock, or whose home cannot
    hold the lock, runs it unlocked, as before. `upload`: `command` unpacks files for `step` (a tar writes each in
    place, so another run's install could read one half written); the busy line goes to stderr, not as a status."""
    wait = f"{max(1.0, timeout * HOST_LOCK_WAIT):g}"
    busy = (f"another clusterctl provision on this host held its lock ({HOST_LOCK.replace('$HOME', '~')}) for "
            f"{wait}s; run again when it has finished")
    say = f"echo {join([busy])} >&2" if upload else f"echo {join([f'{STATUS_PREFIX}{step} failed {busy}'])}"
    return (f'if command -v flock >/dev/null 2>&1 && mkdir -p "{HOST_LOCK_DIR}" 2>/dev/null; then '
            f'flock -o -w {wait} -E {HOST_LOCK_BUSY} "{HOST_LOCK}" {command}; rc=$?; '
            f'if [ "$rc" = {HOST_LOCK_BUSY} ]; then {say}; fi; exit "$rc"; else {command}; fi')


def _locked_upload(remote_dir: str, step: str, timeout: float) -> str:
    """The host command unpacking `step`'s tar stream (wheelhouse.tar_stream) into `remote_dir`, under the host's
    provision lock."""
    return _host_locked(join(["sh", "-c", wheelhouse.upload_command(remote_dir)]), step, timeout, upload=True)


def _offline(prov, step: str) -> bool:
    """Whether `step` installs apt packages through offline apt (apt.offline: the apt step, the gpu step's apt part)."""
    if not (prov.apt and prov.apt.offline and prov.apt.offline.enabled):
        return False
    return step == "apt" or (step == "gpu" and bool(gpu_apt_packages(prov)))


def _offline_sources(spec, step: str) -> tuple[list[Path], list]:
    """(apt.offline.file_roots, [(source, its keyring)]) of offline apt for `step`: apt.sources, or for the gpu step
    cuda.repository (the spec requires one); ProvisionError for a file: source outside the roots, or a keyring
    that cannot be read."""
    prov = spec.provision
    if step == "gpu":
        wanted, where = [prov.cuda.repository], "cuda.repository"
    else:
        wanted, where = list(prov.apt.sources), "apt.sources"
    roots = aptoffline.file_roots(spec)
    aptoffline.check_file_sources(wanted, roots, where)
    return roots, [(src, read_keyring(spec, src)) for src in wanted]


def _offline_apt(session, step: str, hosts, *, check: bool, force: bool, log) -> dict[Host, StepOutcome]:
    """Offline apt's controller side (resolve, download once, upload what each host lacks); the hosts that failed it.

    What a host sends is untrusted (aptstate.py reads it within limits, against an allow-list); everything on
    the controller runs under one deadline, apt.offline.timeout, for all these hosts together."""
    spec, remote = session.spec, session.remote
    prov = spec.provision
    apt = prov.apt
    remote_dir = apt.offline.remote
    cache = aptoffline.local_root(spec)
    deadline = aptoffline.Deadline(apt.offline.timeout, "apt.offline.timeout")
    wanted_pkgs = gpu_apt_packages(prov) if step == "gpu" else list(apt.packages)
    roots, sources = _offline_sources(spec, step)
    readers = {h: aptoffline.StateReader(h.label) for h in hosts}
    state_timeout = min(120.0, deadline.left())
    results = remote.run(join(["python3", "-c", aptoffline.HOST_STATE_SCRIPT, remote_dir]), hosts=hosts, check=False,
                         timeout=state_timeout, what="apt state", on_line=lambda h, stream, line: readers[h](h, stream, line))
    failed: dict[Host, StepOutcome] = {}
    states, wanted = {}, {}
    for host in hosts:
        res = results[host]
        if res.timed_out:
            failed[host] = StepOutcome("failed", f"offline apt for {host.label}: reading the host's apt state took over "
                                                 f"{state_timeout:.0f}s", res.seconds)
            continue
        if not res.ok:
            tail = (res.stderr or res.stdout).strip().splitlines()[-1:] or [f"exit {res.exit_code}"]
            failed[host] = StepOutcome("failed", f"offline apt: cannot read the host's apt state: {tail[0]}", res.seconds)
            continue
        try:
            states[host] = readers[host].state()
        except ProvisionError as exc:
            failed[host] = StepOutcome("failed", str(exc), res.seconds)
            continue
        for note in states[host].notes:
            log(host, step, f"host: {note}")
        wanted[host] = aptoffline.missing_packages(wanted_pkgs, states[host].status, force=force)
    t0 = time.monotonic()
    resolved = aptoffline.resolve_all(cache, states, wanted, sources, deadline=deadline, refresh=force, reinstall=force,
                                      log=lambda host, line: log(host, step, line))
    uploads: dict[Host, list[Path]] = {}
    for host, state in states.items():
        debs = resolved[host]
        if isinstance(debs, ProvisionError):
            failed[host] = StepOutcome("failed", str(debs), time.monotonic() - t0)
            continue
        try:
            paths = aptoffline.download(cache, debs, deadline=deadline, file_roots=roots, label=host.label,
                                        log=lambda line, host=host: log(host, step, line),
                                        trusted=aptoffline.source_hosts(sources))
        except ProvisionError as exc:
            failed[host] = StepOutcome("failed", str(exc), time.monotonic() - t0)
            continue
        send = aptoffline.upload_plan(paths, state)
        log(host, step, f"offline: {len(paths)} .deb(s) needed, {len(send)} to upload")
        if paths and not check:
            index = cache / "index" / host.label / "Packages"
            index.parent.mkdir(parents=True, exist_ok=True)
            packages = aptoffline.packages_index(paths)
            index.write_bytes(packages)
            (index.parent / "Release").write_bytes(aptoffline.release_file(packages))
            (index.parent / "clusterctl-manifest.json").write_bytes(aptoffline.manifest(send, state))
            uploads[host] = [*send, index, index.parent / "Release", index.parent / "clusterctl-manifest.json"]
    if uploads:
        sent = remote.run(_locked_upload(remote_dir, step, spec.provision.timeout), hosts=list(uploads),
                          stdin=lambda h: wheelhouse.tar_stream(uploads[h]), timeout=spec.provision.timeout,
                          check=False, what="apt offline upload")
        for host, res in sent.items():
            if not res.ok:
                tail = (res.stderr or res.stdout).strip().splitlines()[-1:] or [f"exit {res.exit_code}"]
                failed[host] = StepOutcome("failed", f"offline apt: upload failed: {tail[0]}", res.seconds)
    return failed


def _wheelhouse(session, steps, hosts, facts, *, check: bool, force: bool, log) -> dict[Host, StepOutcome]:
    spec, remote = session.spec, session.remote
    wh = spec.provision.wheelhouse
    reqs = requirements(spec)  # every pip step of the spec, even under --only wheelhouse
    out: dict[Host, StepOutcome] = {}
    if not reqs:
        return {h: StepOutcome("ok", "no pip requirements") for h in hosts}
    groups: dict[tuple, list[Host]] = {}
    for host in hosts:
        f = facts[host]
        groups.setdefault((f.python, f.implementation, f.machine, f.glibc), []).append(host)
    missing: dict[Host, list[Path]] = {}
    for members in groups.values():
        t0 = time.monotonic()
        try:
            folder = wheelhouse.download(
                reqs, facts[members[0]], wheelhouse.local_root(spec), index_url=wh.index_url, force=force,
                log=lambda line, members=members: [log(h, "wheelhouse", line) for h in members],
                find_links=[str(spec.local_path(d)) for d in wh.find_links],
            )
        except ProvisionError as exc:
            out.update({h: StepOutcome("failed", str(exc), time.monotonic() - t0) for h in members})
            continue
        for host in members:
            missing[host] = wheelhouse.missing_wheels(folder, facts[host])
            log(host, "wheelhouse", f"local {folder}: {len(missing[host])} wheel(s) to upload")
    senders = [h for h, files in missing.items() if files]
    for host, files in missing.items():
        if not files:
            out[host] = StepOutcome("ok")
        elif check:
            out[host] = StepOutcome("changed", f"upload {len(files)} wheel(s)")
    if senders and not check:
        results = remote.run(
            _locked_upload(wh.remote, "wheelhouse", spec.provision.timeout), hosts=senders,
            stdin=lambda h: wheelhouse.tar_stream(missing[h]),
            timeout=session.spec.provision.timeout, check=False, what="wheelhouse upload",
        )
        for host, res in results.items():
            size = sum(p.stat().st_size for p in missing[host]) / 1e6
            if res.ok:
                out[host] = StepOutcome("changed", f"uploaded {len(missing[host])} wheel(s), {size:.1f} MB", res.seconds)
            else:
                reason = (res.stderr or res.stdout).strip().splitlines()[-1:] or [f"exit {res.exit_code}"]
                out[host] = StepOutcome("failed", f"upload failed: {reason[0]}", res.seconds)
    return out
