"""The supervisor's rules: pure decisions over a small state object, and the job-state transition table.

Like torch.distributed.elastic's agent, the supervisor (clusterctl/host/supervisor.py) keeps what it
decides apart from what it does. Everything here is a function of a `JobCore` (the attempt, its state,
its verdict, the exits and failures seen so far, the finished attempts), a `Policy` and the clock passed
in as a number: no processes, sockets, files or time.monotonic(). The supervisor feeds events in (a
process exit anywhere, a host lost, a stop requested, a peer's silence, the coordinator's verdict) and
carries the answer out (a `Verdict` -> stop the local processes and tell the peers; start attempt K).

The job state on one host moves only along `TRANSITIONS`; `JobCore.move` checks every move.
"""

from __future__ import annotations  # `X | None` on Python 3.9 hosts; no typing import (every start)

from .policy import Policy
from .record import dataclass, field
from .states import JobState
from .status import AttemptRecord

__all__ = ["TRANSITIONS", "IllegalTransition", "check_transition", "Verdict", "ExitEvent", "History", "JobCore",
           "failed", "on_exit", "on_host_lost", "on_host_failed", "on_peers_missing", "on_stop_request",
           "on_verdict_received", "on_restart_order", "on_coordinator_silence", "apply_verdict",
           "stop_finished", "begin_attempt", "mark_running", "restart_ready", "may_exit", "barrier_passed",
           "next_coordinator_due", "takeover_gathered", "PEER_DONE_LINGER", "ATTEMPTS_KEPT", "BEGIN_STOP",
           "FINALIZED"]

S = JobState
PEER_DONE_LINGER = 5.0  # coordinator: after its own stop, how long it waits for the peers' "done"
ATTEMPTS_KEPT = 20  # state.json keeps the last this many finished attempts (and counts all of them)

# The legal moves of a host's job state. A verdict ends an attempt (-> stopping); once the local processes
# are stopped the state is the verdict's outcome, or `restarting` when another attempt follows.
TRANSITIONS = {
    S.STARTING: frozenset((
        S.RUNNING,  # the attempt's processes were spawned (or are waiting for the pserver endpoints)
        S.STOPPING,  # a verdict before the spawn finished
        S.FAILED,  # the coordinator cannot listen: nothing was started
    )),
    S.RUNNING: frozenset((S.STOPPING,)),  # a verdict: fail-fast, success, a stop request, a lost host
    S.STOPPING: frozenset((
        S.SUCCEEDED, S.FAILED, S.STOPPED,  # the local stop finished, the verdict final
        S.RESTARTING,  # the local stop finished, another attempt follows
    )),
    S.RESTARTING: frozenset((
        S.STARTING,  # the next attempt (the back-off passed; on a peer: the coordinator said so)
        S.STOPPED,  # a stop request during the back-off: final
        S.FAILED,  # a peer that could not rejoin the coordinator; the coordinator's final verdict
        S.SUCCEEDED,  # a peer cut off while the rest of the job succeeded learns it when it rejoins
    )),
    S.SUCCEEDED: frozenset(),
    S.FAILED: frozenset(),
    S.STOPPED: frozenset(),
}


class IllegalTransition(Exception):
    """A move of the job state that TRANSITIONS does not allow (a bug in the supervisor)."""


def check_transition(old, new):
    """Raise IllegalTransition unless `old` -> `new` is in TRANSITIONS."""
    if new not in TRANSITIONS.get(old, ()):
        raise IllegalTransition("job state %s -> %s is not allowed" % (old, new))


@dataclass(frozen=True)
class Verdict:
    """How an attempt ends: its outcome (a terminal job state), why, the failure that decided it, and whether
    another attempt follows (`restart`). `grace` overrides the policy's for the local stop."""

    outcome: str
    reason: str
    failure: dict | None = None
    restart: bool = False
    grace: float | None = None


@dataclass(frozen=True)
class ExitEvent:
    """A process of the job ended on its own, on some host (`error`: it could not be started; `note`: what its
    host knows of why, e.g. that it called MPI_Abort)."""

    role: str
    id: int
    code: int | None
    error: str | None
    host: str
    attempt: int
    note: str | None = None

    @property
    def key(self):
        """(role, id): one exit per process and attempt counts."""
        return (self.role, self.id)

    def to_json(self):
        """The event's fields, as an `exit` message and a hello's `exits` carry them."""
        return {"role": self.role, "id": self.id, "code": self.code, "error": self.error, "host": self.host,
                "attempt": self.attempt, "note": self.note}


class History:
    """The finished attempts, oldest first: the last `keep` of them, and how many there were in all."""

    def __init__(self, keep=ATTEMPTS_KEPT):
        self.keep = keep
        self.kept = []  # [AttemptRecord]
        self.total = 0

    def add(self, record):
        """Record a finished attempt; forget the oldest beyond `keep`."""
        self.kept.append(record)
        self.total += 1
        del self.kept[:-self.keep]

    @property
    def dropped(self):
        """How many finished attempts are no longer kept."""
        return self.total - len(self.kept)


@dataclass
class JobCore:
    """The job as one supervisor decides about it: the small state object every rule reads and writes."""

    policy: Policy
    trainers_total: int
    attempt: int = 0
    state: str = S.STARTING
    started_at: float | None = None  # wall clock: when the attempt started
    verdict: Verdict | None = None
    exits: dict = field(default_factory=dict)  # (role, id) -> ExitEvent, this attempt
    failures: list = field(default_factory=list)  # failure dicts of this attempt, in order
    stop_done: bool = False  # the local processes of this attempt are stopped
    history: History = field(default_factory=History)

    @property
    def final(self):
        """A verdict is in and no other attempt follows."""
        return self.verdict is not None and not self.verdict.restart

    @property
    def restart_pending(self):
        """A verdict is in and another attempt follows."""
        return self.verdict is not None and self.verdict.restart

    def move(self, new):
        """Change the job state, along TRANSITIONS only."""
        check_transition(self.state, new)
        self.state = new


# -- decisions ------------------------------------------------------------------------------------------------


def failed(core, reason, failure=None, restartable=True):
    """A `failed` verdict; another attempt follows while restarts are left (never after a failure to start)."""
    return Verdict(S.FAILED, reason, failure, restart=restartable and core.attempt < core.policy.restarts)


def on_exit(core, ev):
    """A process exit anywhere in the job (coordinator): None (go on), or the verdict it brings.

    Records the exit and any failure in `core`. A repeat, an exit of another attempt, or any exit after the
    verdict changes nothing."""
    if core.verdict is not None or ev.key in core.exits or ev.attempt != core.attempt:
        return None
    core.exits[ev.key] = ev
    failure = {"role": ev.role, "id": ev.id, "host": ev.host, "exit_code": ev.code}
    what = "%s.%s on %s" % (ev.role, ev.id, ev.host)
    why = ""
    if ev.note:
        failure["note"] = ev.note
        why = " (%s)" % ev.note
    if ev.error:
        failure["error"] = ev.error
        core.failures.append(failure)
        return failed(core, "%s failed to start: %s" % (what, ev.error), failure, restartable=False)
    trainers = [e for k, e in core.exits.items() if k[0] == "trainer"]
    if ev.code != 0 and (ev.role == "trainer" or len(trainers) < core.trainers_total):
        core.failures.append(failure)
        if core.policy.on_failure == "stop":
            return failed(core, "%s exited with code %s%s" % (what, ev.code, why), failure)
    if core.trainers_total and len(trainers) >= core.trainers_total:
        if not core.failures and all(e.code == 0 for e in trainers):
            return Verdict(S.SUCCEEDED, "all %d trainers exited 0" % core.trainers_total)
        first = core.failures[0]
        return failed(core, "all trainers ended; %d failure(s), first: %s.%s on %s code %s%s" % (
            len(core.failures), first["role"], first["id"], first["host"], first["exit_code"],
            " (%s)" % first["note"] if first.get("note") else ""), first)
    return None


def _host_failure(host):
    return {"host": host, "role": None, "id": None, "exit_code": None}


def on_host_lost(core, host, why):
    """Coordinator: an authenticated peer that had not finished its stop went away."""
    if core.verdict is not None:
        return None
    return failed(core, "lost host %s: %s" % (host, why), _host_failure(host))


def on_host_failed(core, host, why):
    """Coordinator: a rejoining peer stopped this attempt by itself (it had lost the coordinator)."""
    if core.verdict is not None:
        return None
    return failed(core, "host %s: %s" % (host, why), _host_failure(host))


def on_peers_missing(core, connected, expected, waited, timings):
    """Coordinator: the attempt ran `waited` seconds with only the peers `connected` of `expected`."""
    if core.verdict is not None or len(connected) >= expected or waited <= timings.connect_timeout:
        return None
    return failed(core, "only %d of %d peer host(s) connected within %.0fs (connected: %s)" % (
        len(connected), expected, timings.connect_timeout, sorted(connected) or "none"))


def on_stop_request(core, reason, grace=None):
    """A stop was requested (any host): `stopped`, final, also over a pending restart; None once final."""
    if core.verdict is None:
        return Verdict(S.STOPPED, reason, grace=grace)
    if core.verdict.restart:
        return Verdict(S.STOPPED, reason)
    return None


def on_verdict_received(core, state, reason, failure, attempt, restart):
    """Peer: the coordinator's verdict of `attempt` (a `stop` message): the verdict to apply, or None."""
    if attempt < core.attempt:
        return None  # about an attempt this host already left
    verdict = Verdict(state, reason, failure, restart=restart and state == S.FAILED)
    if core.verdict is None or (core.verdict.restart and not verdict.restart):
        return verdict
    return None


def on_restart_order(core, attempt):
    """Peer: the coordinator started `attempt`. (follow it?, the verdict that first stops the current one)."""
    if attempt <= core.attempt or core.final:
        return False, None
    if core.verdict is None:  # still running an earlier attempt: stop it first
        return True, Verdict(S.FAILED, "the coordinator started attempt %d" % attempt, restart=True)
    return True, None


def on_coordinator_silence(core, timings, now, started, ever_connected, lost_since, why, endpoint, elastic=False):
    """Peer: what having no coordinator means now: None (keep trying), or a verdict.

    Never connected: after `connect_timeout` (from `started`) the job fails here (final). Connected, then
    lost since `lost_since`: after `reconnect_timeout` the attempt fails here (a restart may follow: keep
    trying to rejoin); after another `connect_timeout` without the coordinator that is final, unless the job
    is `elastic`: its hosts then look for the coordinator's successor instead (`next_coordinator_due`)."""
    if not ever_connected:
        if now - started <= timings.connect_timeout:
            return None
        text = "could not connect to coordinator %s within %.0fs: %s" % (endpoint, timings.connect_timeout, why)
        if core.verdict is None:
            return Verdict(S.FAILED, text)
        if core.verdict.restart:
            return Verdict(core.verdict.outcome, core.verdict.reason, core.verdict.failure)
        return None
    if lost_since is None:
        return None
    away = now - lost_since
    if core.verdict is None and away > timings.reconnect_timeout:
        return failed(core, "lost connection to coordinator %s: %s" % (endpoint, why))
    if not elastic and core.restart_pending and away > timings.reconnect_timeout + timings.connect_timeout:
        return Verdict(S.FAILED, "lost connection to coordinator %s and could not rejoin within %.0fs: %s"
                       % (endpoint, timings.connect_timeout, why), core.verdict.failure)
    return None


def barrier_passed(core, all_joined, members_joined, waited, timings):
    """Coordinator, before the first attempt spawns anything (the start barrier): True once every host of the
    job has joined (`all_joined`), or, `connect_timeout` into the attempt, every host of its view has
    (`members_joined`: an elastic job's spare that never joined is not waited for; a member that never joined
    fails the attempt, `on_peers_missing`). Never once a verdict is in."""
    if core.verdict is not None:
        return False
    return all_joined or (members_joined and waited > timings.connect_timeout)


def next_coordinator_due(core, timings, now, lost_since, trying_since, trying_successor):
    """Peer of an elastic job without its coordinator: whether to turn to the next candidate (the view's
    successor, host/elastic.py `successor`). From the view's coordinator: once it has been lost
    `reconnect_timeout` (when this host also fails the attempt); from a successor that does not answer: after
    `connect_timeout` of trying it. Never once the verdict is final (no restart left: nothing to take over)."""
    if core.final:
        return False
    if trying_successor:
        return now - trying_since > timings.connect_timeout
    return lost_since is not None and now - lost_since > timings.reconnect_timeout


def takeover_gathered(missing, now, since, timings):
    """A host that took over as coordinator (since `since`) may plan the next attempt: every member of the
    last view but the old coordinator has joined it (`missing` is empty), or `connect_timeout` passed (those
    still missing count as lost)."""
    return not missing or now - since > timings.connect_timeout


# -- applying them --------------------------------------------------------------------------------------------

BEGIN_STOP = "begin-stop"  # the attempt's first verdict: stop the local processes, tell the peers
FINALIZED = "finalized"  # a verdict that awaited a restart is now final: tell the peers, no next attempt


def apply_verdict(core, verdict):
    """Record a verdict: BEGIN_STOP, FINALIZED, or None (a verdict was already in: the first one stands)."""
    if core.verdict is None:
        core.verdict = verdict
        core.move(S.STOPPING)
        return BEGIN_STOP
    if core.verdict.restart and not verdict.restart:
        core.verdict = verdict
        if core.stop_done:
            core.move(verdict.outcome)
        return FINALIZED
    return None


def stop_finished(core, ended_at):
    """The local processes of the attempt are stopped: its outcome, or `restarting` (the attempt recorded)."""
    core.stop_done = True
    if core.final:
        core.move(core.verdict.outcome)
        return
    core.move(S.RESTARTING)
    v = core.verdict
    core.history.add(AttemptRecord(core.attempt, v.outcome, v.reason, v.failure, core.started_at, ended_at))


def begin_attempt(core, attempt, started_at):
    """Start attempt number `attempt` (from `restarting`): a clean slate of exits, failures and verdict."""
    core.move(S.STARTING)
    core.attempt = attempt
    core.started_at = started_at
    core.verdict = None
    core.exits = {}
    core.failures = []
    core.stop_done = False


def mark_running(core):
    """The attempt's processes were spawned: `starting` -> `running` (a verdict that came first stands)."""
    if core.state == S.STARTING:
        core.move(S.RUNNING)


def restart_ready(core, now, stop_done_at, waiting_peers, grace):
    """Coordinator: the next attempt may be scheduled: the local stop is done and every connected peer said
    `done` (or `grace` + PEER_DONE_LINGER passed since)."""
    if not (core.stop_done and core.restart_pending):
        return False
    return not waiting_peers or now >= stop_done_at + grace + PEER_DONE_LINGER


def may_exit(core, now, coordinator, stop_done_at=None, waiting_peers=(), unjoined=0, join_deadline=None,
             term_requested=False):
    """Whether the supervisor's work is over: the verdict final and the local stop done; a coordinator also
    waits (PEER_DONE_LINGER at most) for the peers' `done`, and until `join_deadline` for peers that never
    joined, so that one connecting late learns the verdict at once (a stop request cuts that short)."""
    if not (core.stop_done and core.final):
        return False
    if not coordinator:
        return True
    if waiting_peers and now <= stop_done_at + PEER_DONE_LINGER:
        return False
    if unjoined and join_deadline is not None and now < join_deadline and not term_requested:
        return False
    return True
