"""The dispatch planner, pure: from the local files each host should have and what each host has, what
to send each host (whole files, patches, deletions), grouped into change sets that share one archive.

Nothing here reads a file, the network or the clock: the inputs are LocalFile records (scan.py) and
HostView states (a host's reply, or this controller's records of it); archive.py turns a HostPlan into
the bytes that travel, run.py sends them.
"""

from __future__ import annotations

from collections.abc import Collection, Hashable, Mapping
from dataclasses import dataclass, field

from ...errors import BadReply
from ...host import wire
from .delta import Patch, delta
from .scan import LocalFile

__all__ = ["INLINE", "BULK", "HostView", "HostPlan", "DispatchPlan", "drift_of", "generation_of", "view_of", "plan_host",
           "plan_dispatch"]

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


def generation_of(reply: dict, *, none_ok: bool = False) -> str | None:
    """The generation a host's reply names, checked: a name hostws could have made (it becomes part of
    this controller's records and of the next header, and is printed)."""
    gen = reply.get(wire.GEN)
    if gen is None and none_ok:
        return None
    if not (isinstance(gen, str) and 0 < len(gen) <= 128 and gen[0] != "." and gen.isascii()
            and all(c.isalnum() or c in "._~-" for c in gen)):
        raise BadReply(f"{wire.GEN!r} is not a generation name: {repr(gen)[:80]}")
    return gen


_ENTRY_KEYS = frozenset(wire.ENTRY_KEYS)


def _entry_ok(entry) -> bool:
    """Whether `entry` is a manifest entry as wire.manifest_entry makes them (~0.5 µs: a reply may hold 100,000)."""
    return (type(entry) is dict and entry.keys() == _ENTRY_KEYS and type(entry[wire.ENTRY_SIZE]) is int
            and type(entry[wire.ENTRY_MODE]) is int and type(entry[wire.ENTRY_MTIME_NS]) is int
            and type(entry[wire.ENTRY_SHA256]) is str)


def view_of(state: dict) -> HostView:
    """The view of a host from its `state` reply (or a `stale` reply of `apply`, which carries the same),
    checked field by field; BadReply says what is wrong. (Paths are not judged here: every path that
    travels back in a header is checked again by the host that applies it.)"""
    gen = generation_of(state, none_ok=True)
    manifest = state.get(wire.MANIFEST)
    if not isinstance(manifest, dict) or not all(isinstance(k, str) and _entry_ok(v) for k, v in manifest.items()):
        raise BadReply(f"{wire.MANIFEST!r} is not a manifest of {{path: entry}}")
    return HostView(gen, manifest, frozenset(d[wire.PATH] for d in drift_of(state)))


def drift_of(reply: dict) -> list[dict]:
    """The drift a host reports (`state`, a stale `apply`, `verify`), checked: [{'path': str, 'problem': str}]."""
    drift = reply.get(wire.DRIFT)
    if not isinstance(drift, list) or not all(
            isinstance(d, dict) and isinstance(d.get(wire.PATH), str) and isinstance(d.get("problem"), str)
            for d in drift):
        raise BadReply(f"{wire.DRIFT!r} is not a list of {{{wire.PATH!r}: path, 'problem': text}}")
    return drift


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
    # (a host with no generation yet gets its first one, also an empty one: `start` checks the workspace against it)
    current = [h for h, p in plans.items() if p.empty and not views[h].check and views[h].gen is not None]
    skip = set(confirm) | set(current)
    return DispatchPlan({h: p for h, p in plans.items() if h not in skip}, confirm, current)
