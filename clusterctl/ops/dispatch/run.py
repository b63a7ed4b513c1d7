"""The dispatch run: scan, plan against each host's state (remembered, or asked), stream every host its
update at once, learn from the replies; and `verify`, each host's drift from its last dispatch."""

from __future__ import annotations

import secrets
import time
from pathlib import Path
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from ...plan import DATA_ENV, Host
from ...quoting import join
from ...errors import BadReply, RemoteError
from ...remote import GroupException, GroupResult, Launch, Result
from ..hosttools import package_dir, tool_argv, tool_command
from ..session import Session
from ...host import wire
from .archive import Archive, update_bytes
from .plan import BULK, HostPlan, HostView, drift_of, generation_of, plan_dispatch, view_of
from .records import Records
from .scan import LocalFile, scan_workspace
from .sources import Sources, sources_of

__all__ = ["HostDispatch", "dispatch", "verify", "host_files"]


@dataclass(frozen=True)
class HostDispatch:
    """What one host received."""

    host: Host
    files_sent: int
    bytes_sent: int
    deleted: int
    generation: str | None  # None: an empty workspace, never filled, stays as it was


def host_files(session: Session, workspace: dict[str, LocalFile], sources: Sources | None = None) -> dict[Host, dict[str, LocalFile]]:
    """The full file set each host should have: the workspace plus its trainers' data shards."""
    plan = session.plan
    sources = sources or sources_of(session)
    per_host = dict.fromkeys(plan.hosts, workspace)  # shared until a host gets shards of its own
    if sources.data_local is None:
        return per_host
    data_prefix = sources.data_remote.strip("/") + "/"
    data_files = scan_workspace(Path(sources.data_local), (), prefix=data_prefix)
    for trainer in plan.trainers:
        for path in filter(None, trainer.env[DATA_ENV].split(":")):
            if per_host[trainer.host] is workspace:
                per_host[trainer.host] = dict(workspace)
            per_host[trainer.host][path] = data_files[path]
    if plan.elastic is not None:  # a later attempt may deal any shard to any host (clusterctl/host/elastic.py)
        every = dict(workspace)
        every.update((data_prefix + n, data_files[data_prefix + n]) for n in plan.elastic["job"]["data"]["files"])
        per_host = dict.fromkeys(plan.hosts, every)
    return per_host


def _read_states(remote, hosts: list[Host], root: str) -> dict[Host, HostView | Result]:
    """Ask hosts for their workspace state (installing hostws where missing): a view, or the failed Result."""
    state_cmd, payload = tool_command("hostws", ["state", root])  # installs the tool if missing, same round trip
    out: dict[Host, HostView | Result] = {}
    for host, res in remote.run(state_cmd, hosts=hosts, stdin=payload, check=False, timeout=remote.control_timeout,
                                what="reading workspace state").items():
        out[host] = _checked(res, view_of) if res.ok else res
    return out


def _checked(res: Result, read):
    """read(the host's reply), or, for a reply that is no JSON object or one `read` refuses, that host's failure."""
    try:
        return read(res.reply())
    except (RemoteError, BadReply) as exc:
        return _unexpected(res, exc)


def _unexpected(res: Result, exc: RemoteError | BadReply) -> Result:
    """A host that answered, but not as hostws does (no JSON object, or one of another shape): its failure,
    saying what came instead. The other hosts' dispatch goes on."""
    why = exc.failures[0].reason if isinstance(exc, RemoteError) else exc
    return Result(res.host, res.command, 1, "", f"unexpected reply from the host: {why}", res.seconds)


def dispatch(session: Session) -> list[HostDispatch]:
    """Bring every host's workspace to the local content; raise RemoteError naming hosts that failed."""
    plan, remote = session.plan, session.remote
    root = plan.workdir
    records = Records(root)
    # the host package runs as imported modules (their bytecode is kept): see ops/hosttools.py
    apply = f"test -d {join([package_dir()])} || exit {wire.TOOL_MISSING_EXIT}; exec " + join(
        tool_argv("hostws", ["apply", root]))

    views: dict[Host, HostView] = {}
    ask: list[Host] = []
    for host in plan.hosts:
        view = records.load(host)
        if view is None:
            ask.append(host)
        else:
            views[host] = view
    # Hosts we have a record of get their update in one round trip: start `apply` there now, so the SSH
    # handshakes and the hosts' own checks overlap the scan below. (Unknown hosts are asked first.)
    launched = remote.launch(apply, hosts=list(views)) if views else None
    try:
        return _dispatch(session, records, apply, views, ask, launched)
    finally:
        if launched is not None:
            launched.close()


def _dispatch(session: Session, records: Records, apply: str, views: dict, ask: list, launched) -> list[HostDispatch]:
    plan, remote = session.plan, session.remote
    sources = sources_of(session)  # without the spec models when the plan came from the cache
    workspace = scan_workspace(Path(sources.workspace), sources.exclude)
    wanted = host_files(session, workspace, sources)
    root = plan.workdir
    gen = time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(4)
    failed: dict[Host, Result] = {}
    sent: dict[Host, int] = dict.fromkeys(plan.hosts, 0)
    done: dict[Host, tuple[HostPlan | None, str]] = {}  # host → (the plan it applied, its generation)
    learned: dict[Host, tuple[str, dict]] = {}  # host → (generation, manifest) to remember
    succeeded: dict[Host, Result] = {}
    no_deltas: set[Host] = set()
    for _round in range(3):  # a stale record costs one more round; a patch that does not apply, one more
        if ask:
            for host, got in _read_states(remote, ask, root).items():
                if isinstance(got, Result):
                    failed[host] = got
                else:
                    views[host] = got
            ask = []
        if not views:
            break
        planned = plan_dispatch(gen, views, wanted, no_deltas=no_deltas)
        for host in planned.confirm:
            ask.append(host)
            del views[host]
        for host in planned.current:
            view = views.pop(host)
            done[host] = (None, view.gen)
            learned[host] = (view.gen, view.manifest)
        plans = planned.send
        results, streamed = _send(remote, apply, planned, wanted, launched)
        launched = None  # finished: every host it started got its update or an empty stdin
        views = {}
        for host, res in results.items():
            sent[host] += streamed[host]
            if res.exit_code == wire.TOOL_MISSING_EXIT and not res.stdout:
                ask.append(host)
            elif not res.ok:
                failed[host] = res
            else:
                try:
                    reply = res.reply()
                    if wire.STALE not in reply:
                        # the host's generation now: `gen`, or its current one (none yet: an empty workspace unchanged)
                        now = generation_of(reply, none_ok=reply.get(wire.UNCHANGED) is True)
                        done[host] = (plans[host], now)
                        succeeded[host] = res
                        if not reply.get(wire.UNCHANGED):
                            learned[host] = (now, plans[host].manifest)
                        continue
                    views[host] = view_of(reply)
                except (RemoteError, BadReply) as exc:
                    failed[host] = _unexpected(res, exc)
                    continue
                if reply[wire.STALE] == wire.STALE_PATCH:
                    no_deltas.add(host)
        if not views and not ask:
            break
    for host in [*views, *ask]:  # did not converge in three rounds (something keeps changing it)
        failed[host] = Result(host, apply, 1, "", "the workspace kept changing during dispatch; dispatch again", 0.0)

    records.save(learned)
    out = []
    for host in plan.hosts:
        if host in done:
            p, g = done[host]
            out.append(HostDispatch(host, 0 if p is None else len(p.whole) + len(p.patches), sent[host],
                                    0 if p is None else len(p.delete), g))
    if failed:  # one group exception with every host's last outcome, in the plan's order
        raise GroupException(GroupResult((h, failed.get(h) or succeeded[h]) for h in plan.hosts
                                         if h in failed or h in succeeded), what="dispatch")
    return out


def _send(remote, apply: str, planned, wanted, launched: Launch | None = None) -> tuple[dict[Host, Result], dict[Host, int]]:
    """Stream each host its header and archive (one archive per distinct change set); the results and
    the bytes streamed to each host (less than the archive where a host stopped reading early). Hosts
    where `launched` already started `apply` get theirs there (those without a plan, an empty stdin)."""
    plans: dict[Host, HostPlan] = planned.send
    if not plans and launched is None:
        return {}, {}
    archives: dict[tuple, Archive] = {}
    headers: dict[int, bytes] = {}  # by plan: hosts in the same state share one
    streamed = dict.fromkeys(plans, 0)
    try:
        for key, hosts in planned.change_sets().items():
            p = plans[hosts[0]]
            if not p.inline:  # built once per distinct change set, streamed to every host that needs it
                archives[key] = Archive(wanted[hosts[0]], p.whole, p.patches)
            for host in hosts:
                if id(plans[host]) not in headers:
                    headers[id(plans[host])] = update_bytes(plans[host], wanted[host])

        def feed(host: Host):
            p = plans[host]
            header = headers[id(p)]
            for block in [header] if p.inline else archives[p.key].stream(header):
                yield block
                streamed[host] += len(block)  # counted once the channel took it

        started = set(launched.hosts) if launched is not None else set()
        rest = [h for h in plans if h not in started]
        # a deadline for the whole transfer: ten control deadlines, plus a second per MB at the least
        deadline = 10 * remote.control_timeout + max((p.payload for p in plans.values()), default=0) / 1e6
        with ThreadPoolExecutor(1) as waiter:  # the launched hosts and the others at the same time
            early = (waiter.submit(launched.finish, {h: feed for h in plans if h in started}, timeout=deadline)
                     if started else None)
            results: dict[Host, Result] = {}
            if rest and max(plans[h].payload for h in rest) >= BULK:  # bulk data: through ssh whatever the host-key policy
                results = remote.push(apply, hosts=rest, stdin=feed, timeout=deadline, what="dispatch")
            elif rest:
                results = remote.run(apply, hosts=rest, stdin=feed, check=False, timeout=deadline, what="dispatch")
            if early is not None:
                results.update(early.result())
    finally:
        for archive in archives.values():
            archive.close()
    return results, streamed


def verify(session: Session, *, hosts=None) -> dict[Host, list[dict]]:
    """Each host's (or each of `hosts`') drift from its last dispatch: [{'path', 'problem'}]; [] means verified."""
    cmd, payload = tool_command("hostws", ["verify", session.plan.workdir])
    results = session.remote.run(cmd, hosts=hosts, stdin=payload, timeout=10 * session.remote.control_timeout,
                                 what="verifying workspaces")
    drift = {host: _checked(res, drift_of) for host, res in results.items()}
    bad = {host: got for host, got in drift.items() if isinstance(got, Result)}
    if bad:
        raise GroupException(GroupResult((h, bad.get(h) or results[h]) for h in results), what="verifying workspaces")
    return drift
