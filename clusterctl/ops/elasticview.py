"""What an elastic job's status reads from its hosts' views, and the hosts it need not wait for.

Every host of an elastic job holds the view of the attempt it runs (clusterctl/host/elastic.py): which hosts run
it (`members`), which wait idle. `status` folds the job's state from the latest attempt's hosts (job.fold_status,
with `latest_view`) and does not wait long for a host outside them (`attempt_answered`, with control.Enough): a
machine gone for good answers nothing until the connect timeout, every call. Such a host is noted on this
controller (`note_left`), so that `logs`, whose replies carry no view, does not wait long for it either
(`left_enough`) until a status finds it answering again.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable

from ..host.status import HostStatus, JobStatus
from ..plan import Host, JobPlan
from ..remote import Result
from .control import NEEDS_PACKAGE, Enough, agent_reply, cache_file, host_key

__all__ = ["latest_view", "in_attempt", "attempt_answered", "note_left", "forget_left", "left_enough"]

_MAX_LEFT = 1 << 20


def latest_view(parsed: dict[str, HostStatus], addresses: dict[str, str] | None, known: set[str]) -> dict | None:
    """An elastic job's view: the coordinator's of the latest attempt knows who runs it and who waits idle. Only one
    that names known hosts alone (`known`: the plan's addresses), its sender among them (fold_status)."""
    elastic, elastic_rank = None, None
    for label, reply in parsed.items():
        view = reply.elastic
        sender = reply.host or (addresses or {}).get(label, label)
        if view is not None and view["members"] and not (set(view["members"]) <= known and sender in view["members"]):
            continue
        if view is not None and (elastic_rank is None or (view["attempt"], reply.is_coordinator is True) > elastic_rank):
            elastic, elastic_rank = view, (view["attempt"], reply.is_coordinator is True)
    return elastic


def in_attempt(view: dict | None, addresses: dict[str, str] | None) -> Callable[[str, str | None], bool]:
    """Whether a host (its label, and the address its reply names, if any) decides the job's state: every host
    where there is no view, else the view's members only (a host lost and replaced, a spare, does not)."""
    members = set(view["members"]) if view is not None and view["members"] else None

    def counts(label: str, host: str | None = None) -> bool:
        return members is None or (host or (addresses or {}).get(label, label)) in members
    return counts


def attempt_answered(plan: JobPlan, not_its_own: Callable[..., str | None]) -> Callable[[dict[Host, Result]], str | None]:
    """For an elastic job's status (control.Enough): once every host of the current attempt and every idle one (the
    view fold_status reads) has answered, why the others are not waited for: the job left them (a host lost for
    good would cost every status its connect timeout). `not_its_own`: job.not_its_own, which answers are read."""
    addresses = {h.label: h.address for h in plan.hosts}
    own: dict[str, HostStatus] = {}  # each answer read once, as it comes

    def need(results: dict[Host, Result]) -> str | None:
        done = {h for h, r in results.items() if r.exit_code != NEEDS_PACKAGE}
        for h in done - {h for h in results if h.label in own}:
            data = agent_reply(results[h]) if results[h].answered else {}
            if "state" in data and not not_its_own(reply := HostStatus.from_json(data), plan.job, addresses[h.label]):
                own[h.label] = reply
        view = latest_view(own, addresses, set(addresses.values()))
        if view is None or not view["members"]:
            return None
        wanted = set(view["members"]) | set(view["idle"])
        if any(h.address in wanted and h not in done for h in plan.hosts):
            return None
        return f"attempt {view['attempt']} runs without it and its hosts all answered"
    return need


def _recall_left(job: str) -> dict[str, int]:
    from ..cache import read_private

    path = cache_file(job, "+left.json")
    data = read_private(path, _MAX_LEFT) if path else None
    try:
        doc = json.loads(data) if data else {}
    except ValueError:
        return {}
    if not isinstance(doc, dict):
        return {}
    return {k: v for k, v in doc.items() if isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool)}


def note_left(plan: JobPlan, st: JobStatus, answered: Iterable[Host]) -> None:
    """After an elastic job's status: the hosts outside its attempt's view (neither members nor idle) that did not
    answer are noted as left at that attempt; a host that answered is not (any more)."""
    from ..cache import write_private

    path = cache_file(plan.job, "+left.json")
    if path is None:
        return
    view = st.elastic or {}
    keep = set(view.get("members") or ()) | set(view.get("idle") or ())
    was = _recall_left(plan.job)
    now = {k: v for k, v in was.items() if k not in {host_key(h) for h in answered}}
    if view.get("members"):
        now.update({host_key(h): int(view.get("attempt") or 0) for h in plan.hosts
                    if h.label in st.unreachable and h.address not in keep})
    if now != was:
        write_private(path, json.dumps(now).encode())


def forget_left(job: str) -> None:
    """A new `start` of `job`: no host is left yet."""
    path = cache_file(job, "+left.json")
    try:
        if path is not None:
            os.unlink(path)
    except OSError:  # none (the usual case); one that cannot go is read as before, and answers correct it
        pass


def left_enough(plan: JobPlan, targets: Iterable[Host]) -> Enough | None:
    """For `logs` of an elastic job: an Enough that stops waiting for the hosts its last status found left (once
    every other host answered, as long again plus a second); None where there are none."""
    if plan.min_hosts is None:
        return None
    left, targets = _recall_left(plan.job), list(targets)
    gone = {h: left[host_key(h)] for h in targets if host_key(h) in left}
    if not gone:
        return None
    others = [h for h in targets if h not in gone]
    attempt = max(gone.values())
    return Enough(lambda got: (f"attempt {attempt} ran without it at the job's last status"
                               if all(h in got for h in others) else None))
