"""The cluster spec: YAML → validated, typed, frozen objects. Knows YAML, nothing about SSH.

Every problem is reported at once as ``FILE:LINE:COL: dotted.key.path: message``.

By concern: the models (``models``, made of ``fields``, ``hosts``, ``job``, ``backends``); pydantic's errors
at the right line:column (``errors``); the semantic checks, the only part that lays out the plan
(``checks``); reading a file or text (``loading``). clusterctl.plan works on the models and imports none
of this package, so there is no import cycle between the spec and the plan.
"""

from __future__ import annotations

from .backends import KubernetesSpec, KubernetesVolumeSpec, SlurmSpec
from .fields import Port, check_address, check_user, parse_jump
from .hosts import HostSpec, SshSpec
from .job import CONTRACT_ENV, PLACEHOLDERS, RESTART_ENV, DataSpec, JobSpec, PortsSpec, PserversPerHost, WorkspaceSpec
from .loading import MAX_HOSTFILE_BYTES, MAX_SPEC_BYTES, load_spec, parse_hostfile, parse_spec
from .models import ClusterSpec

__all__ = [
    "ClusterSpec",
    "HostSpec",
    "JobSpec",
    "SshSpec",
    "WorkspaceSpec",
    "DataSpec",
    "PortsSpec",
    "KubernetesSpec",
    "SlurmSpec",
    "load_spec",
    "parse_spec",
    "parse_hostfile",
    "parse_jump",
    "check_address",
    "check_user",
    "PLACEHOLDERS",
    # also re-exported (what clusterctl and its tests import from here):
    "CONTRACT_ENV",
    "RESTART_ENV",
    "PserversPerHost",
    "KubernetesVolumeSpec",
    "Port",
    "MAX_SPEC_BYTES",
    "MAX_HOSTFILE_BYTES",
]
