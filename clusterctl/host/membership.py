"""The coordinator's view of the job's peer hosts: who joined, who is done, who was lost. Pure.

One place holds membership (state.json "hosts"): the coordinator link (clusterctl/host/coordinator.py)
says who connected and who went away, the supervisor says who finished its stop, and the rules
(clusterctl/host/rules.py) read who is connected, who is still stopping and who never joined.

An elastic job (host/elastic.py) also has hosts that are connected but run nothing in the current attempt
(spares, a host that came back): `members` names the peers of the attempt's view, and only they count for
the rules (a lost host, the peers a restart waits for, the peers an attempt needs). Without `members` every
peer is one (`expected` of them).
"""

from .states import HostState

__all__ = ["Membership"]


class Membership:
    """The peer hosts of a job (all hosts but the coordinator's) and where each stands."""

    def __init__(self, expected, members=None, everyone=None):
        self.expected = expected  # peer hosts the attempt needs (the attempt's hosts - 1)
        self.members = None if members is None else set(members)  # their labels (None: any peer is one)
        self.everyone = expected if everyone is None else everyone  # every peer host of the job, spares included
        self.records = {}  # label -> {"state": HostState, "since": epoch, ...}: state.json "hosts"
        self.connected = set()
        self.finished = set()  # connected peers whose local stop of this attempt is done
        self.ever = set()  # every peer that joined at least once
        self.joined_at = {}  # label -> when it (last) joined, epoch: how long an idle host has been back

    def is_member(self, host):
        """Whether `host` runs a part of the current attempt (every peer, unless the job is elastic)."""
        return self.members is None or host in self.members

    def set_members(self, members):
        """A new view's peers (labels)."""
        self.members = set(members)
        self.expected = len(self.members)

    def join(self, host, addr, now, done=False, index=None):
        """`host` authenticated (or came back) from `addr`; `done`: its processes are already stopped."""
        self.connected.add(host)
        self.ever.add(host)
        self.joined_at[host] = now
        if done:
            self.finished.add(host)
        else:
            self.finished.discard(host)
        self.records[host] = {"state": HostState.DONE if done else HostState.CONNECTED, "since": now, "addr": addr}
        if index is not None:
            self.records[host]["index"] = index

    def _keep(self, host, record):
        old = self.records.get(host, {})
        if "index" in old:
            record["index"] = old["index"]
        self.records[host] = record

    def mark_done(self, host, now):
        """`host` finished its local stop of the current attempt."""
        if host in self.connected:
            self.finished.add(host)
            self._keep(host, {"state": HostState.DONE, "since": now})

    def leave(self, host, why, now, deciding):
        """`host`'s connection is gone. True when that is a lost host for the rules: a member that had not
        finished its stop while the attempt has no verdict yet (`deciding`); recorded `lost`, else
        `disconnected` (an idle host going away is no verdict)."""
        self.connected.discard(host)
        self.joined_at.pop(host, None)
        if host in self.finished:
            return False  # it said `done`: its going away is expected
        deciding = deciding and self.is_member(host)
        self._keep(host, {"state": HostState.LOST if deciding else HostState.DISCONNECTED, "since": now, "why": why})
        return deciding

    def new_attempt(self, now):
        """A new attempt starts: every connected peer is in it (or idle), none is done."""
        self.finished.clear()
        for host in self.connected:
            old = self.records.get(host, {})
            self._keep(host, {"state": HostState.CONNECTED, "since": now, "addr": old.get("addr")})

    def connected_members(self):
        """The connected peers of the current attempt."""
        return set(h for h in self.connected if self.is_member(h))

    def waiting(self):
        """Connected members that have not finished their stop, sorted."""
        return sorted(h for h in self.connected - self.finished if self.is_member(h))

    def unjoined(self):
        """How many expected peers never joined."""
        joined = self.ever if self.members is None else self.ever & self.members
        return max(0, self.expected - len(joined))

    def all_joined(self):
        """Every peer host of the job, spares included, is connected (the start barrier)."""
        return len(self.connected) >= self.everyone

    def to_json(self):
        """state.json "hosts"."""
        return {h: dict(r) for h, r in self.records.items()}
