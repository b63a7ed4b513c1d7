"""The dispatch planner, pure: from the local files each host should have and what each host has, what
to send each host (whole files, patches, deletions), grouped into change sets that share one archive.

Nothing here reads a file, the network or the clock: the inputs are LocalFile records (scan.py) and
HostView states (a host's reply, or this controller's records of it); archive.py turns a HostPlan into
the bytes that travel, run.py sends them.
"""

from __future__ import annotations

from collections.abc import Collection, Hashable, Mapping
from dataclasses import dataclass, field

from ...host import wire
from .delta import Patch, delta
from .scan import LocalFile

__all__ = ["INLINE", "BULK", "HostView", "HostPlan", "DispatchPlan", "view_of", "plan_host", "plan_dispatch"]

INLINE = 1 << 20  # per-host update size up to which file content travels inside the header
# per-host update size from which a host planned from records confirms its state first, and from which
# run.py streams the data through the OpenSSH client
BULK = 8 << 20


@dataclass
class HostView:
    """What the controller takes a host's workspace to be: its generation, manifest and drifted paths."""

    gen: str | None
    manifest: dict[str, dict]
    drift: frozenset[str] = frozenset()
    check: bool = False  # from the controller's records, not read just now: the host must confirm it


def view_of(state: dict) -> HostView:
    """The view of a host from its `state` reply (or a `stale` reply of `apply`, which carries the same)."""
    return HostView(state[wire.GEN], state[wire.MANIFEST], frozenset(d[wire.PATH] for d in state[wire.DRIFT]))


@dataclass(frozen=True)
class HostPlan:
    """One host's update: from generation `base` to `gen`, what travels and the manifest that results."""

    gen: str
    base: str | None
    check: bool  # the host must confirm that it is at `base` with no drift before applying
    whole: list[str]  # paths sent whole, sorted
    patches: dict[str, Patch]  # paths sent as their changed blocks
    delete: list[str]  # paths removed, sorted
    manifest: dict[str, dict]  # the host's manifest once this update is applied
    key: tuple  # the change set: hosts with equal keys share one archive
    payload: int  # bytes of file content that travel
    inline: bool = False  # the content travels in the header: no archive follows

    @property
    def empty(self) -> bool:
        """Nothing to send, nothing to delete."""
        return not (self.whole or self.patches or self.delete)


def plan_host(gen: str, view: HostView, files: Mapping[str, LocalFile], *, deltas: bool = True) -> HostPlan:
    """The update that brings a host from `view` to `files` as generation `gen`: whole files, patched
    files (when `deltas` and this controller hashed the host's content), deletions."""
    whole, patches = [], {}
    manifest = dict(view.manifest)
    for rel, f in files.items():
        new, current = f.entry(), view.manifest.get(rel)
        if rel not in view.drift and not wire.differs(current, new):
            continue
        patch = delta(f.size, f.blocks, f.previous, current) if deltas and rel not in view.drift else None
        if patch is None:
            whole.append(rel)
        else:
            patches[rel] = patch
        manifest[rel] = new
    delete = sorted(set(view.manifest) - set(files))
    for rel in delete:
        del manifest[rel]
    whole.sort()
    patches = dict(sorted(patches.items()))
    payload = sum(files[rel].size for rel in whole) + sum(p.payload for p in patches.values())
    key = tuple((rel, files[rel].sha256, None) for rel in whole) + tuple(
        (rel, files[rel].sha256, p.base) for rel, p in patches.items()
    )
    # small updates travel inside the header: no tar on either side
    return HostPlan(gen, view.gen, view.check, whole, patches, delete, manifest, key, payload, payload <= INLINE)


@dataclass(frozen=True)
class DispatchPlan:
    """What to do with each host of one round: send it its update, ask its state first, or nothing."""

    send: dict[Hashable, HostPlan] = field(default_factory=dict)  # host → its update
    confirm: list[Hashable] = field(default_factory=list)  # planned from records, a big update: ask first
    current: list[Hashable] = field(default_factory=list)  # read just now and up to date: nothing to send

    def change_sets(self) -> dict[tuple, list[Hashable]]:
        """The hosts to send an update, by change set (one archive each, unless inline), in host order."""
        out: dict[tuple, list[Hashable]] = {}
        for host, p in self.send.items():
            out.setdefault(p.key, []).append(host)
        return out


def plan_dispatch(gen: str, views: Mapping[Hashable, HostView], wanted: Mapping[Hashable, Mapping[str, LocalFile]], *,
                  no_deltas: Collection[Hashable] = ()) -> DispatchPlan:
    """Plan generation `gen` for every host of `views` (what each has) from `wanted` (what each should
    have); hosts in `no_deltas` get changed files whole (a patch of theirs did not apply)."""
    plans: dict[Hashable, HostPlan] = {}
    memo: dict[tuple, HostPlan] = {}
    for h, v in views.items():  # hosts in the same state wanting the same files share one plan
        key = (id(v.manifest), v.gen, v.drift, v.check, id(wanted[h]), h not in no_deltas)
        if key not in memo:
            memo[key] = plan_host(gen, v, wanted[h], deltas=h not in no_deltas)
        plans[h] = memo[key]
    # a big update planned from records: confirm the host's state first rather than stream in vain
    confirm = [h for h, p in plans.items() if views[h].check and p.payload >= BULK]
    current = [h for h, p in plans.items() if p.empty and not views[h].check]
    skip = set(confirm) | set(current)
    return DispatchPlan({h: p for h, p in plans.items() if h not in skip}, confirm, current)
