"""Operations: plain functions over (plan, remote). They return results; they never print or exit."""

from __future__ import annotations

import os
import time
from contextlib import contextmanager
from typing import TYPE_CHECKING

from ..plan import JobPlan
from ..remote import Remote, SshOptions
from .session import Session

if TYPE_CHECKING:  # the spec models (pydantic) load only on a plan-cache miss or when an operation needs them
    from ..spec import ClusterSpec

__all__ = ["Session", "open_session", "plan_for", "load_plan"]


def plan_for(spec: ClusterSpec, *, resolve: bool = True) -> JobPlan:
    """The plan of `spec`: its hosts resolved as `ssh` would (the user's ssh config; `resolve=False`: taken
    as written, for a backend whose hosts `ssh` does not reach), its data files listed from the controller's
    disk. A problem the plan finds is reported as a spec error, at its key."""
    return _plan_for(spec, _data_files(spec), resolve=resolve)


def _data_files(spec: ClusterSpec) -> list[str] | None:
    if spec.data is None:
        return None
    root = spec.local_path(spec.data.local)
    if not root.is_dir():  # the plan deals its files to the trainers: a spec error at the key, as the plan's are
        from ..errors import SpecError, SpecProblem

        line, col = spec_position(spec, ("data", "local"))
        why = "does not exist" if not root.exists() else "is not a directory"
        raise SpecError([SpecProblem(spec.source, line, col, "data.local", f"{root} {why} (the data shards' directory)")])
    from .dispatch import list_data_files  # dispatch's imports (pathspec) cost ~0.1 s: only for specs with data

    return list_data_files(spec)


def _plan_for(spec: ClusterSpec, data_files: list[str] | None, *, resolve: bool = True) -> JobPlan:
    from ..errors import SpecError, SpecProblem
    from ..plan import PlanError, make_plan, ssh_targets
    from ..sshconfig import config_path
    from ..sshconfig import resolve as ssh_resolve

    resolved = ssh_resolve(ssh_targets(spec), config_path(spec)) if resolve else None
    if resolved is not None:
        resolved = _with_bastion_routes(spec, resolved, config_path(spec))
    try:
        return make_plan(spec, data_files=data_files, resolved=resolved)
    except PlanError as exc:
        line, col = spec_position(spec, exc.path)
        raise SpecError([SpecProblem(spec.source, line, col, _dotted(exc.path), exc.message)]) from None


def _with_bastion_routes(spec: ClusterSpec, resolved: list, config: str | None) -> list:
    """`resolved` with how ssh reaches each host's first bastion under the ssh config (bastion_routes): the
    bastions before it (hop_jump) and the outermost one's own ProxyCommand (hop_command); each bastion once."""
    from dataclasses import replace

    from ..plan import make_hosts

    if not routes_may_differ(config):  # most configs: no `ssh -G` for the bastions
        return resolved
    hosts = make_hosts(spec, resolved)
    routes = bastion_routes([h.jump[0] for h in hosts if h.jump], config)
    return [replace(r, hop_jump=routes[h.jump[0]][0], hop_command=routes[h.jump[0]][1])
            if h.jump and routes[h.jump[0]] != ((), None) else r
            for h, r in zip(hosts, resolved, strict=True)]


def routes_may_differ(config: str | None) -> bool:
    """Whether the ssh config `config` may give a bastion a ProxyJump or ProxyCommand of its own."""
    from ..sshconfig import may_set

    return may_set(config, "proxycommand") or may_set(config, "proxyjump")


MAX_BASTIONS = 16  # bastions before a first one, its own ProxyJump followed: more is a loop or a mistake


def bastion_routes(firsts: list[str], config: str | None) -> dict[str, tuple[tuple[str, ...], str | None]]:
    """How ssh reaches each first bastion (a ProxyJump hop: [user@]name[:port]) under the ssh config `config`:
    (the bastions before it, first hop first; the outermost one's own ProxyCommand or None). ssh follows a first
    hop's own ProxyJump (its config entry's; a later hop's is overridden by the -W before it), and that chain's
    first hop's, and so on; a loop, or more than MAX_BASTIONS, is a ClusterctlError. A bastion whose own ProxyJump
    is itself (a `Host *` that meets it too; ssh: "jumphost loop") is reached directly, as clusterctl always has.
    Resolved level by level, each name once, and only when a file of the config uses either keyword."""
    from ..errors import ClusterctlError

    names = sorted(set(firsts))
    routes: dict[str, tuple[tuple[str, ...], str | None]] = dict.fromkeys(names, ((), None))
    if not names or not routes_may_differ(config):
        return routes
    tips = {n: n for n in names}  # the hop whose own entry is read next, for each first bastion
    while tips:
        found = _own_entries(sorted(set(tips.values())), config)
        for name, tip in list(tips.items()):
            r, before = found[tip], routes[name][0]
            del tips[name]
            if r is None:
                continue
            if r.proxy_command:
                routes[name] = (before, r.proxy_command)
            elif r.proxy_jump and _hop(r.proxy_jump[-1], config)[1] != _hop(tip, config)[1]:
                chain = (*r.proxy_jump, *before)
                seen = [_hop(h, config)[1] for h in (*chain, name)]
                if len(set(seen)) < len(seen) or len(chain) > MAX_BASTIONS:
                    why = "loop" if len(set(seen)) < len(seen) else f"go past {MAX_BASTIONS} bastions"
                    raise ClusterctlError(f"ssh config {config or '~/.ssh/config'}: the bastions' own ProxyJump "
                                          f"entries {why}: {' -> '.join((*chain, name))}")
                routes[name] = (chain, None)
                tips[name] = r.proxy_jump[0]
    return routes


def _own_entries(hops: list[str], config: str | None) -> dict:
    """Each bastion's own entry in the ssh config (a Resolved), or None for one ssh refuses as its own jump host."""
    from ..sshconfig import JumphostLoop, Target
    from ..sshconfig import resolve as ssh_resolve

    out: dict = {}
    rest = list(hops)
    while rest:
        try:
            found = ssh_resolve([Target(n, u, p) for u, n, p in (_hop(h, config) for h in rest)], config)
        except JumphostLoop as exc:  # that one is reached directly; the others are still followed
            looped = [h for h in rest if _hop(h, config)[1] == exc.address]
            if not looped:
                raise
            out.update(dict.fromkeys(looped))
            rest = [h for h in rest if h not in out]
            continue
        out.update(zip(rest, found, strict=True))
        break
    return out


def _hop(hop: str, config: str | None) -> tuple[str | None, str, int | None]:
    """A ProxyJump hop of the ssh config as (user, host, port); a ClusterctlError for one of another form (`ssh`
    refuses those itself; paramiko's reader, used where there is no `ssh`, does not)."""
    from ..errors import ClusterctlError
    from ..transport.host import split_jump

    try:
        return split_jump(hop)
    except ValueError as exc:
        raise ClusterctlError(f"ssh config {config or '~/.ssh/config'}: ProxyJump: {exc}") from None


def spec_position(spec: ClusterSpec, path: tuple) -> tuple[int, int]:
    """Line and column of `path` in the spec's file (1, 1 when it cannot be read back)."""
    if getattr(spec, "located", None) is not None:  # kept by the loader: the file is not parsed again
        return spec.located.position(path)
    from ..yamlpos import YamlSyntaxError, load_located

    try:
        with open(spec.source, encoding="utf-8") as fh:
            return load_located(fh.read()).position(path)
    except (OSError, UnicodeDecodeError, YamlSyntaxError):
        return 1, 1


def _dotted(path: tuple) -> str:
    return "".join(f"[{p}]" if isinstance(p, int) else (f".{p}" if i else str(p)) for i, p in enumerate(path))


def load_plan(path: str, *, check=None, resolve=None) -> "tuple[ClusterSpec | None, JobPlan, SshOptions]":
    """The spec at `path`, its plan and connection options: from clusterctl.plancache when the spec and
    everything it reads are unchanged since a command last planned it (the spec is then None: neither the
    spec models nor `ssh -G` were needed), else loaded and validated as always and kept for next time.

    `check(spec)` (the backend's problems, clusterctl.backends) runs on a freshly loaded spec before its plan
    is kept: a plan in the cache passed it. `resolve(spec)`: whether its hosts are resolved through the ssh
    config (default: yes)."""
    from .. import plancache
    from ..files import read_spec_bytes

    cached = plancache.load(path)
    if cached is not None:
        return None, cached.plan, cached.options
    from ..spec import load_spec

    started = time.time_ns()
    try:
        spec_bytes: bytes | None = read_spec_bytes(path)  # what load_spec parses (a pipe is read once)
    except OSError:
        spec_bytes = None  # load_spec reports it
    spec = load_spec(path, layout=False, check=check)  # laid out once, just below (PlanErrors at their keys there)
    data_files = _data_files(spec)
    plan = _plan_for(spec, data_files, resolve=True if resolve is None else resolve(spec))
    options = SshOptions.from_spec(spec)
    if spec_bytes is not None:
        plancache.store(path, spec_bytes, started, spec, plan, options, data_files)
    return spec, plan, options


@contextmanager
def open_session(spec_or_path: "str | ClusterSpec", *, check=None, transport=None):
    """Load (if given a path: through load_plan's cache) and plan a spec, open a Remote to its hosts (over
    `transport`, default the OpenSSH client), close it afterwards. `check(spec)` as for load_plan; commands
    open sessions through clusterctl.backends.ssh_session, which passes the backend's."""
    if isinstance(spec_or_path, (str, os.PathLike)):
        path: str | None = str(spec_or_path)
        spec, plan, options = load_plan(path, check=check)
    else:
        path, spec = None, spec_or_path
        if check is not None and check(spec):
            from ..errors import SpecError

            raise SpecError(check(spec))
        plan, options = plan_for(spec), SshOptions.from_spec(spec)
    with Remote(plan.hosts, options, transport=transport) as remote:
        yield Session(spec, plan, remote, spec_path=path)
