"""Elastic jobs: when a host is lost, which hosts run the next attempt, and what each of them runs. Pure.

An elastic job (spec: `hosts[].spare`, `job.min_hosts`; docs/lifecycle.md#elastic-jobs) carries in every
host's job file, spares' included, the same "elastic" section (clusterctl/host/jobfile.py `check_elastic`):
the layout's inputs for every host, the first attempt's hosts, the fewest hosts the job may run on and the
bound on changes. From it every host computes, with the functions here, the same answers as every other:

- `initial_view(section)`: the first attempt's membership (a *view*, below);
- `next_view(section, view, lost, available, now)`: the next attempt's membership once `lost` members are
  gone: an idle host (a spare) in each lost host's place, positions kept, else the lost host left out while
  at least `min_hosts` remain; `CannotContinue` (one line) when the job cannot go on;
- `attempt_part(section, view, index, home)`: what host `index` runs in a view's attempt (its process
  entries as a job file holds them, where the coordinator listens): clusterctl/host/layout.py's layout of
  the view's members, so ranks, WORLD_SIZE, endpoints, MASTER_ADDR, pserver placement and data shards are
  derived by the same planner as the first attempt's;
- `successor(view, skip)`, `control_endpoint(section, index)`: who takes over when the coordinator's host is
  lost (the first member after it, in the view's order, that is not known lost), and where it listens;
- `admission(view, index)`: a host that (re)joins while an attempt runs that it is not a member of waits,
  idle, as a spare for the next change; `eligible` says when it may be picked (`READMIT_AFTER`);
- `checkpoint_dir`, `ps_inventory`, `shard_problem`: whether a pserver job's checkpoint shards are where the
  new placement needs them, else the one line that refuses the attempt before it starts;
- `describe_change`, `describe_view`: what `status` and the supervisors' logs say.

A view (JSON: messages and state.json carry it):

    {"attempt": k, "members": [host index, ...] (layout order, so rank order), "coordinator": host index,
     "pservers": [host index of pserver 0, 1, ...], "changes": [change, ...] (the last MAX_CHANGES_KEPT)}

A change: {"attempt": k (the first attempt on the new hosts), "at": wall-clock seconds, "lost": [index, ...],
"replaced": [[lost index, its replacement], ...], "left_out": [index, ...], "coordinator": [old, new] or null}.

Host indices are positions in the spec's hosts (the layout inputs' "index"); a host that is not a member
of a view is idle (a spare, a host left out, a host that came back). Bounds against a flapping host: every
change of hosts is a restart (it counts against `job.restarts` and waits its doubling back-off), at most
`max_host_changes` changes within `host_change_window` seconds, and a host that was lost is picked again
only once it has been back for READMIT_AFTER seconds.

Stdlib only, Python 3.9 (it runs on the hosts).
"""

import json
import os
import posixpath

from .jobfile import process_entry
from .layout import LayoutError, layout, pserver_placement

__all__ = ["CannotContinue", "MAX_HOST_CHANGES", "MAX_HOST_CHANGES_MAX", "HOST_CHANGE_WINDOW", "READMIT_AFTER",
           "MAX_CHANGES_KEPT", "PS_CHECKPOINT_ENV", "initial_view", "check_view", "next_view", "eligible",
           "missing", "successor", "control_endpoint", "admission", "laid_out", "attempt_part", "checkpoint_dir",
           "ps_inventory", "shard_problem", "host_name", "describe_change", "describe_view"]

MAX_HOST_CHANGES = 3  # job.max_host_changes' default: changes of the job's hosts within HOST_CHANGE_WINDOW
MAX_HOST_CHANGES_MAX = 100
HOST_CHANGE_WINDOW = 3600.0  # seconds: the window max_host_changes counts in
READMIT_AFTER = 60.0  # seconds a host that was lost must have been back before it takes a place again
MAX_CHANGES_KEPT = 100  # a view keeps the last this many changes (for the bound and for status)
PS_CHECKPOINT_ENV = "CLUSTERCTL_PS_CHECKPOINT"  # a pserver job's checkpoint directory (docs/ps.md)
MAX_MANIFEST = 1 << 20  # bytes of a pserver checkpoint manifest read, at most


class CannotContinue(Exception):
    """The job cannot go on with the hosts it has; the message is the one line that says why."""


def host_name(section, index):
    """The address the spec gives host `index` (for messages)."""
    for h in section["hosts"]:
        if h["index"] == index:
            return h["address"]
    return "hosts[%s]" % index


def _names(section, indices):
    return ", ".join(host_name(section, i) for i in indices) or "none"


def _layout_hosts(section, members):
    by_index = {h["index"]: h for h in section["hosts"]}
    return [by_index[i] for i in members]


def _job_for(section, pservers):
    job = section["job"]
    if job["mode"] != "pserver":
        return job
    return dict(job, pservers={"at": list(pservers)})


def initial_view(section):
    """The first attempt's view: the section's members, the first of them the coordinator (the plan's)."""
    members = list(section["members"])
    return {"attempt": 0, "members": members, "coordinator": members[0],
            "pservers": pserver_placement(_layout_hosts(section, members), section["job"]), "changes": []}


def _ints(value):
    return isinstance(value, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in value)


def check_view(raw, section):
    """A view received from another host (or read back from state.json), checked against `section`: a copy,
    or ValueError with one line."""
    known = {h["index"] for h in section["hosts"]}
    if not isinstance(raw, dict):
        raise ValueError("view: must be an object")
    attempt, members, coordinator = raw.get("attempt"), raw.get("members"), raw.get("coordinator")
    if isinstance(attempt, bool) or not isinstance(attempt, int) or attempt < 0:
        raise ValueError("view.attempt: must be an integer >= 0")
    if not _ints(members) or not members or len(set(members)) != len(members) or not set(members) <= known:
        raise ValueError("view.members: must list distinct hosts of the job")
    if coordinator not in members:
        raise ValueError("view.coordinator: must be one of the members")
    pservers = raw.get("pservers")
    count = len(pserver_placement(_layout_hosts(section, section["members"]), section["job"]))
    if not _ints(pservers) or not set(pservers) <= set(members) or len(pservers) != count:
        raise ValueError("view.pservers: must place each of the job's %d pserver(s) on a member" % count)
    changes = raw.get("changes")
    if not isinstance(changes, list) or len(changes) > MAX_CHANGES_KEPT:
        raise ValueError("view.changes: must be a list of at most %d changes" % MAX_CHANGES_KEPT)
    out_changes = []
    for c in changes:
        if (not isinstance(c, dict) or isinstance(c.get("attempt"), bool) or not isinstance(c.get("attempt"), int)
                or isinstance(c.get("at"), bool) or not isinstance(c.get("at"), (int, float))
                or not _ints(c.get("lost")) or not _ints(c.get("left_out"))
                or not isinstance(c.get("replaced"), list)
                or not all(_ints(pair) and len(pair) == 2 for pair in c["replaced"])
                or not (c.get("coordinator") is None or (_ints(c["coordinator"]) and len(c["coordinator"]) == 2))):
            raise ValueError("view.changes: malformed change %s" % json.dumps(c)[:200])
        out_changes.append({"attempt": c["attempt"], "at": float(c["at"]), "lost": list(c["lost"]),
                            "replaced": [list(p) for p in c["replaced"]], "left_out": list(c["left_out"]),
                            "coordinator": None if c.get("coordinator") is None else list(c["coordinator"])})
    return {"attempt": attempt, "members": list(members), "coordinator": coordinator, "pservers": list(pservers),
            "changes": out_changes}


def missing(view, connected, me):
    """The members of `view` other than `me` that are not among the `connected` hosts (indices), in order."""
    return [m for m in view["members"] if m != me and m not in connected]


def eligible(section, view, available, now, readmit_after=READMIT_AFTER):
    """The idle hosts that may take a lost host's place, lowest index first: `available` maps each connected
    host that runs nothing to the wall-clock time it (re)connected; a host that was lost before is eligible
    only once it has been back `readmit_after` seconds (so that a flapping host cannot take a place again and
    again)."""
    members = set(view["members"])
    known = {h["index"] for h in section["hosts"]}
    ever_lost = {i for c in view["changes"] for i in c["lost"]}
    return sorted(i for i, since in available.items()
                  if i in known and i not in members and (i not in ever_lost or now - since >= readmit_after))


def successor(view, skip=()):
    """The host that takes over when the coordinator's host is lost: the first member after the coordinator,
    in the view's order, that is not in `skip` (hosts known lost); None when there is none.

    Every host computes it from the view of the attempt it ran, so all agree without a controller: a peer that
    lost the coordinator connects to successor(view)'s control endpoint, and moves on to successor(view,
    skip=[that one]) when it does not answer within connect_timeout."""
    for m in view["members"]:
        if m != view["coordinator"] and m not in skip:
            return m
    return None


def control_endpoint(section, index):
    """(address, port) where host `index` listens when it is the coordinator: its endpoint address and the
    job's control port (reserved on every host of an elastic job by the plan)."""
    for h in section["hosts"]:
        if h["index"] == index:
            return h["endpoint"], section["job"]["ports"]["control"]
    raise KeyError(index)


def admission(view, index):
    """What a host that connects to the coordinator during `view`'s attempt does: "member" (it is one: the
    supervisor's reconnect rules apply), or "spare": it never joins a running attempt; it waits, running
    nothing, and is one of the hosts `next_view` may pick (see `eligible`)."""
    return "member" if index in view["members"] else "spare"


def _quorum(section, view, lost):
    n, left = len(view["members"]), len(view["members"]) - len(lost)
    coordinator_lost = view["coordinator"] in lost
    if left * 2 > n or (left * 2 == n and not coordinator_lost):
        return
    raise CannotContinue(
        "cannot continue: %d of the %d hosts of attempt %d are lost (%s): a majority must remain (half, with the "
        "coordinator), so that a cut-off minority never runs the job as well" % (
            len(lost), n, view["attempt"], _names(section, lost)))


def _replace_pservers(placement, replaced, members):
    """Each pserver id stays on its host; a lost host's go to its replacement, else to the members with the
    fewest pservers (the first in order on a tie): the pserver count, so the parameter sharding, never
    changes."""
    kept = [h if h in members else replaced.get(h) for h in placement]
    load = dict.fromkeys(members, 0)
    for h in kept:
        if h is not None:
            load[h] += 1
    out = []
    for h in kept:
        if h is None:
            h = min(members, key=lambda m: (load[m], members.index(m)))
            load[h] += 1
        out.append(h)
    return out


def next_view(section, view, lost, available, now, readmit_after=READMIT_AFTER):
    """The next attempt's (view, change) after `view`'s attempt lost the members in `lost` (other hosts in it
    are ignored); change is None when no member was lost (a plain restart on the same hosts).

    `available`: the idle hosts connected now (index -> when they connected, wall clock; see `eligible`);
    `now`: the wall clock. Each lost member's place goes to an eligible idle host (lowest index first),
    positions kept so that the other hosts keep their ranks where the slot counts allow; with none left, the
    lost host is left out. Raises CannotContinue when fewer than min_hosts would remain, when a majority of
    the attempt's hosts is lost (the coordinator's side wins a tie), when the job changed hosts
    max_host_changes times within host_change_window, or when the new hosts cannot be laid out."""
    lost_set = set(lost)
    members = view["members"]
    lost_members = [m for m in members if m in lost_set]
    attempt = view["attempt"] + 1
    if not lost_members:
        return dict(view, attempt=attempt, changes=list(view["changes"])), None
    _quorum(section, view, lost_members)
    window, cap = section["host_change_window"], section["max_host_changes"]
    recent = [c for c in view["changes"] if now - c["at"] < window]
    if len(recent) >= cap:
        raise CannotContinue("cannot continue without %s: the job's hosts changed %d time(s) within the last %gs "
                             "(job.max_host_changes: %d)" % (_names(section, lost_members), len(recent), window, cap))
    pool = [i for i in eligible(section, view, available, now, readmit_after) if i not in lost_set]
    new, replaced, left_out = list(members), [], []
    for pos, m in enumerate(members):
        if m not in lost_set:
            continue
        if pool:
            new[pos] = pool.pop(0)
            replaced.append([m, new[pos]])
        else:
            left_out.append(m)
    new = [h for h in new if h not in left_out]
    if len(new) < section["min_hosts"]:
        raise CannotContinue("cannot continue: %d of min %d hosts (lost: %s; no spare left)"
                             % (len(new), section["min_hosts"], _names(section, lost_members)))
    coordinator = view["coordinator"]
    coordinator_change = None
    if coordinator in lost_set:
        coordinator = successor(view, lost_set)
        coordinator_change = [view["coordinator"], coordinator]
    pservers = _replace_pservers(view["pservers"], dict((a, b) for a, b in replaced), new)
    try:
        layout(_layout_hosts(section, new), _job_for(section, pservers))
    except LayoutError as e:
        raise CannotContinue("cannot continue on %s: %s" % (_names(section, new), e.message))
    change = {"attempt": attempt, "at": float(now), "lost": lost_members, "replaced": replaced, "left_out": left_out,
              "coordinator": coordinator_change}
    return ({"attempt": attempt, "members": new, "coordinator": coordinator, "pservers": pservers,
             "changes": (list(view["changes"]) + [change])[-MAX_CHANGES_KEPT:]}, change)


def laid_out(section, view):
    """clusterctl/host/layout.py's layout of the view's members (its "control" is the plan's for attempt 0
    only: the coordinator is view["coordinator"], see control_endpoint)."""
    return layout(_layout_hosts(section, view["members"]), _job_for(section, view["pservers"]))


def _home_path(home, path):
    return path if posixpath.isabs(path) else posixpath.normpath(posixpath.join(home, path))


def attempt_part(section, view, index, home, laid=None, pserver_wait=120.0):
    """What host `index` runs in `view`'s attempt, as a job file has it: {"member": bool, "processes": [process
    entries, full env each], "coordinator": {"address", "port", "is_coordinator", "hosts", "trainers_total"},
    "start_trainers_after": {"endpoints", "timeout": pserver_wait} or None}; relative paths resolved against
    `home`. `laid`: laid_out(section, view), when the caller has it already."""
    laid = laid_out(section, view) if laid is None else laid
    members = view["members"]
    pos = members.index(index) if index in members else None
    workdir = _home_path(home, section["workdir"])
    procs = []
    for p in laid["processes"]:
        if p["host"] != pos:
            continue
        log = _home_path(home, posixpath.join(section["log_dir"], "%s.%d.log" % (p["role"], p["id"])))
        procs.append(process_entry(p["role"], p["id"], p["argv"], p["env"], workdir, log, [p["endpoint"]]))
    addr, port = control_endpoint(section, view["coordinator"])
    trainers = sum(1 for p in laid["processes"] if p["role"] == "trainer")
    pserver_eps = [p["endpoint"] for p in laid["processes"] if p["role"] == "pserver"]
    return {"member": pos is not None, "processes": procs,
            "coordinator": {"address": addr, "port": port, "is_coordinator": index == view["coordinator"],
                            "hosts": len(members), "trainers_total": trainers},
            "start_trainers_after": {"endpoints": pserver_eps, "timeout": pserver_wait} if pserver_eps else None}


# -- pserver jobs: the checkpoint shards on the new placement ----------------------------------------------------


def checkpoint_dir(section, home):
    """The pservers' checkpoint directory on this host (job.env's CLUSTERCTL_PS_CHECKPOINT, relative to the
    workspace, where the processes run), or None: a collective job, or pservers that keep no checkpoint."""
    job = section["job"]
    root = (job.get("env") or {}).get(PS_CHECKPOINT_ENV)
    if job["mode"] != "pserver" or not root:
        return None
    return root if posixpath.isabs(root) else posixpath.normpath(
        posixpath.join(_home_path(home, section["workdir"]), root))


def _manifest_step(path, server_id, count):
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_MANIFEST + 1)
        manifest = json.loads(data.decode("utf-8")) if len(data) <= MAX_MANIFEST else None
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    if not isinstance(manifest, dict) or manifest.get("server_id") != server_id or manifest.get("num_servers") != count:
        return None
    step = manifest.get("step")
    return step if isinstance(step, int) and not isinstance(step, bool) and step >= 0 else None


def ps_inventory(root, count):
    """The checkpoint shards this host holds under `root` (clusterctl/ps/checkpoint.py's layout: pserver-<id>/
    and pserver-<id>.prev/, each with a manifest.json): {pserver id: [steps, newest first]} for the shards of
    a job of `count` pservers; a missing, unreadable or foreign manifest counts as no shard."""
    out = {}
    for k in range(count):
        steps = []
        for name in ("pserver-%d" % k, "pserver-%d.prev" % k):
            step = _manifest_step(os.path.join(root, name, "manifest.json"), k, count)
            if step is not None and step not in steps:
                steps.append(step)
        if steps:
            out[k] = sorted(steps, reverse=True)
    return out


def shard_problem(section, old, new, inventories):
    """None when every pserver of `new`'s attempt can load a common checkpoint step where `new` places it, or
    when no pserver holds any checkpoint (they all start afresh); else the one line that refuses the attempt.

    `inventories`: {host index: ps_inventory of that host} for the hosts that answered (a host missing holds
    nothing). Only pservers that moved to another host can lack their shard: with the checkpoint directory on
    storage every host shares, the new host holds it as well."""
    if section["job"]["mode"] != "pserver" or not (section["job"].get("env") or {}).get(PS_CHECKPOINT_ENV):
        return None
    held = []
    for k, host in enumerate(new["pservers"]):
        shards = inventories.get(host) or {}
        held.append(set(shards.get(k, shards.get(str(k), ()))))
    if not any(held):
        return None
    moved = [(k, a, b) for k, (a, b) in enumerate(zip(old["pservers"], new["pservers"])) if a != b]
    for k, a, b in moved:
        if not held[k]:
            return ("cannot resume the parameters: pserver.%d's checkpoint shard (pserver-%d in %s) was on %s, which "
                    "is gone, and %s does not hold it; put %s on storage every host shares (docs/lifecycle.md)"
                    % (k, k, section["job"]["env"][PS_CHECKPOINT_ENV], host_name(section, a), host_name(section, b),
                       PS_CHECKPOINT_ENV))
    if set.intersection(*held):
        return None
    return ("cannot resume the parameters: the pservers hold no checkpoint step in common (%s)"
            % "; ".join("pserver.%d: %s" % (k, sorted(s, reverse=True) or "none") for k, s in enumerate(held)))


# -- what status and the logs say ------------------------------------------------------------------------------


def describe_change(section, change):
    """One line: 'host 10.0.0.3 lost at attempt 1; 10.0.0.5 (spare) in its place at attempt 2'."""
    replaced = dict((a, b) for a, b in change["replaced"])
    k = change["attempt"]
    coord = change.get("coordinator")
    parts = []
    for m in change["lost"]:
        text = "host %s lost at attempt %d" % (host_name(section, m), k - 1)
        if coord and coord[0] == m:
            text += " (the coordinator; %s took over)" % host_name(section, coord[1])
        if m in replaced:
            text += "; %s (spare) in its place at attempt %d" % (host_name(section, replaced[m]), k)
        else:
            text += "; left out from attempt %d" % k
        parts.append(text)
    return "; ".join(parts)


def describe_view(section, view, connected=None, now=None, readmit_after=READMIT_AFTER):
    """Lines for status: the attempt's hosts, every idle host (a spare, a host left out, one that came back:
    `connected` maps the idle hosts connected now to when they connected), then every change."""
    members = view["members"]
    lines = ["attempt %d runs on %d host(s) (min %d): %s; coordinator %s" % (
        view["attempt"], len(members), section["min_hosts"], _names(section, members),
        host_name(section, view["coordinator"]))]
    lost_at = {}
    for c in view["changes"]:
        for m in c["lost"]:
            lost_at[m] = c["attempt"] - 1
    for h in section["hosts"]:
        i = h["index"]
        if i in members:
            continue
        if i not in lost_at:
            what = "spare"
        elif connected is not None and i in connected:
            what = "came back after it was lost at attempt %d: a spare for the next attempt, not in this one" % lost_at[i]
            if now is not None and now - connected[i] < readmit_after:
                what += " (eligible %ds after it came back)" % readmit_after
        else:
            what = "lost at attempt %d" % lost_at[i]
        if connected is not None and i not in connected and i not in lost_at:
            what += " (not connected)"
        lines.append("%s: %s" % (h["address"], what))
    lines.extend(describe_change(section, c) for c in view["changes"])
    return lines
