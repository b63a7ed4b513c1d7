"""Backends: where a job runs, behind one interface (clusterctl.backends.base.Backend).

The registry below is the only place that knows the backends by name: the CLI, the fab tasks and the
operations ask it for the spec's backend and call the interface. Adding a backend is one module with a
`Backend` subclass plus one line here (and its name in the spec's `backend:` choices, which a unit test
keeps equal to this registry).
"""

from __future__ import annotations

import importlib
import os
from contextlib import contextmanager
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..spec import ClusterSpec
    from .base import Backend

__all__ = ["REGISTRY", "names", "backend_class", "open_backend", "ssh_session", "problems", "check", "load_spec"]

# backend name -> "module:Class" (imported on use: a command loads only its own backend)
REGISTRY: dict[str, str] = {
    "ssh": "clusterctl.backends.ssh:SshBackend",
    "slurm": "clusterctl.backends.slurm:SlurmBackend",
    "local": "clusterctl.backends.local:LocalBackend",
    "kubernetes": "clusterctl.backends.kubernetes:KubernetesBackend",
}


def names() -> tuple[str, ...]:
    """Every registered backend's name, as the spec's `backend:` key takes it."""
    return tuple(REGISTRY)


def backend_class(name: str) -> "type[Backend]":
    """The Backend subclass registered as `name`."""
    from ..errors import ClusterctlError

    try:
        module, cls = REGISTRY[name].split(":")
    except KeyError:
        raise ClusterctlError(f"unknown backend {name!r}; known: {', '.join(REGISTRY)}") from None
    return getattr(importlib.import_module(module), cls)


def problems(spec: "ClusterSpec") -> list:
    """Why the spec's backend cannot run it as written: SpecProblems at their lines, [] when it can. A kubernetes:
    section kept beside another backend (for `k8s render`) is checked too, as `k8s render` checks it."""
    found = backend_class(spec.backend).check(spec)
    if not found and spec.backend != "kubernetes" and spec.kubernetes is not None:
        found = backend_class("kubernetes").content_problems(spec, to_start=False)
    return found


def check(spec: "ClusterSpec") -> None:
    """Raise SpecError (every problem at its line:column) when the spec's backend cannot run it as written."""
    from ..errors import SpecError

    found = problems(spec)
    if found:
        raise SpecError(found)


def load_spec(path, *, layout: bool = True) -> "ClusterSpec":
    """clusterctl.spec.load_spec with the spec's backend's problems reported first (every command's way in)."""
    from ..spec import load_spec as load

    return load(path, layout=layout, check=problems)


def _resolves(spec: "ClusterSpec") -> bool:
    """Whether the spec's hosts are resolved through the user's ssh config (`ssh -G`) when planned."""
    return backend_class(spec.backend).resolve_hosts


def open_backend(spec_or_path: "str | os.PathLike | ClusterSpec", **kwargs) -> "Backend":
    """The spec's backend, ready to use as a context manager: from a path through the plan cache (the spec is
    then loaded only if an operation needs it), or from a loaded spec. kwargs go to the backend (e.g. the
    SSH backend's `transport`)."""
    from ..ops import load_plan, plan_for

    if isinstance(spec_or_path, (str, os.PathLike)):
        path = str(spec_or_path)
        spec, plan, options = load_plan(path, check=problems, resolve=_resolves)
    else:
        from ..remote import SshOptions

        path, spec = None, spec_or_path
        check(spec)
        plan, options = plan_for(spec, resolve=_resolves(spec)), SshOptions.from_spec(spec)
    return backend_class(plan.backend)(spec, plan, spec_path=path, options=options, **kwargs)


@contextmanager
def ssh_session(spec_or_path: "str | os.PathLike | ClusterSpec", **kwargs):
    """An ops Session over SSH to the spec's hosts, for the commands that need machines `ssh` reaches (exec,
    provision, doctor): refused in one line when the spec's backend has none (Slurm's nodes are Slurm's choice
    until the job runs; Kubernetes' are pods)."""
    from ..errors import UsageError
    from ..ops import open_session

    def check_ssh(spec):  # a command this backend has not: exit 2, as a command argparse does not know
        if not backend_class(spec.backend).ssh_hosts:
            raise UsageError(f"{spec.source}: this command works on SSH hosts; with backend: {spec.backend} "
                                  "use dispatch, start, status, logs or stop")
        return problems(spec)

    with open_session(spec_or_path, check=check_ssh, **kwargs) as session:
        if not backend_class(session.plan.backend).ssh_hosts:  # a cached plan (checked when it was made)
            raise UsageError(f"{spec_or_path}: this command works on SSH hosts; with backend: "
                                  f"{session.plan.backend} use dispatch, start, status, logs or stop")
        yield session
