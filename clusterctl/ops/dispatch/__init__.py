"""`clusterctl dispatch`: ship the workspace (and data shards) to every host, incrementally and atomically.

Each host keeps the manifest of its last dispatch; only files whose content differs travel, as one tar
stream per distinct change set (built once, streamed to every host that needs it). A changed file whose
previous content this controller hashed travels as its changed fixed-size blocks only. The host applies
the stream to a hard-linked staging copy and switches a symlink (see clusterctl/host/hostws.py).

One round trip per host: the controller remembers what it last dispatched to each host (generation and
manifest, under ~/.cache/clusterctl/dispatched) and sends the update straight away; the host checks that
it is still at that generation with no drift, and otherwise replies with its actual state, from which
the update is planned again. Hosts this controller has not dispatched to are asked for their state first.

By concern:
    scan.py     the workspace scan (excludes), data file listing, the hash cache
    delta.py    block digests and deltas
    plan.py     the planner, pure: local files + each host's state -> each host's update, by change set
    archive.py  the bytes that travel: the framed header, the tar archive streamed to many hosts
    records.py  the controller's records of what each host has
    (the header, manifest and reply format: clusterctl/host/wire.py, imported by both sides)
    run.py      the orchestration: dispatch(), verify()
"""

from __future__ import annotations

from .archive import Archive, update_bytes
from .delta import Patch, block_size, delta
from .plan import DispatchPlan, HostPlan, HostView, plan_dispatch, plan_host, view_of
from .records import Records
from .run import HostDispatch, dispatch, verify
from .scan import LocalFile, ignore_matcher, list_data_files, scan_workspace

__all__ = [
    "dispatch", "verify", "HostDispatch", "LocalFile", "scan_workspace", "list_data_files", "ignore_matcher",
    "block_size", "delta", "Patch", "HostView", "HostPlan", "DispatchPlan", "view_of", "plan_host",
    "plan_dispatch", "Archive", "update_bytes", "Records",
]
