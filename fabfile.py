"""The seed's fab workflow, done right: `fab -H ip1,ip2 start | tail-log | status | kill`.

With only `-H` (and SSH keys or an ssh-agent: never a password), each host runs one pserver and one
trainer of the seed-000 positional script on port 6173. Every task also takes `--spec FILE` to use a
full cluster spec instead. These are thin wrappers over clusterctl's operations.

Fabric calls a task once per `-H` host; a job needs the whole host list at once (ids, endpoints, the
coordinator), so each task acts on the full list at its first call and the later calls do nothing.
"""

from __future__ import annotations

import sys

from fabric import task

from clusterctl import console
from clusterctl.adhoc import AdhocOptions, adhoc_spec
from clusterctl.errors import ClusterctlError, SpecError

_done: set[str] = set()


def _cli_hosts() -> list[str]:
    """The `-H/--hosts` list as given on the fab command line, in order."""
    hosts: list[str] = []
    argv = sys.argv[1:]
    for i, arg in enumerate(argv):
        if arg in ("-H", "--hosts") and i + 1 < len(argv):
            hosts += argv[i + 1].split(",")
        elif arg.startswith("--hosts="):
            hosts += arg.split("=", 1)[1].split(",")
        elif arg.startswith("-H") and len(arg) > 2:
            hosts += arg[2:].lstrip("=").split(",")
    return [h.strip() for h in hosts if h.strip()]


def _once(name: str) -> bool:
    if name in _done:
        return False
    _done.add(name)
    return True


def _spec(c, spec: str | None, opts: dict):
    from clusterctl.spec import load_spec

    if spec:
        return load_spec(spec)
    hosts = _cli_hosts() or ([c.host] if getattr(c, "host", None) else [])
    if not hosts:
        raise ClusterctlError("give hosts with -H ip1,ip2 or a spec with --spec FILE")
    user = getattr(c, "user", None) or "root"
    key = (getattr(c, "connect_kwargs", None) or {}).get("key_filename")
    if isinstance(key, list):
        key = key[0] if key else None
    return adhoc_spec(hosts, AdhocOptions(user=user, identity_file=key, **{k: v for k, v in opts.items() if v is not None}))


def _run(fn) -> None:
    console.setup_logging()
    try:
        code = fn()
    except SpecError as exc:
        for p in exc.problems:
            console.err.print(str(p))
        sys.exit(exc.exit_code)
    except ClusterctlError as exc:
        console.error(str(exc))
        sys.exit(exc.exit_code)
    if code:
        sys.exit(code)


def _opts(entrypoint, workspace, remote_dir, port, name, accept_new, known_hosts=None) -> dict:
    return {
        "known_hosts": known_hosts,
        "entrypoint": entrypoint,
        "workspace": workspace,
        "remote_dir": remote_dir,
        "pserver_port": port,
        "name": name,
        "host_key_policy": "accept-new" if accept_new else None,
    }


_HELP = {
    "spec": "a cluster spec (YAML) instead of -H",
    "entrypoint": "program and leading args (default: python3 dist_train_demo.py)",
    "workspace": "local directory shipped to every host (default: .)",
    "remote_dir": "where it lands (default: /root/work)",
    "port": "pserver port (default: 6173)",
    "name": "job name (default: fabjob)",
    "accept_new": "record unknown host keys in the known_hosts file (default: refuse them)",
    "known_hosts": "the known_hosts file host keys are checked against (default: ~/.ssh/known_hosts)",
    "lines": "lines per log (default 10)",
    "follow": "keep following the logs until the job ends",
}


def _help(*names: str) -> dict:
    return {n: _HELP[n] for n in names}


@task(help=_help("spec", "entrypoint", "workspace", "remote_dir", "port", "name", "accept_new", "known_hosts", "follow"))
def start(
    c, spec=None, entrypoint=None, workspace=None, remote_dir=None, port=None, name=None, accept_new=False,
    known_hosts=None, follow=False,
):
    """Dispatch the workspace and start pservers then trainers on every host (detached unless --follow)."""
    if not _once("start"):
        return
    from clusterctl.ops.lifecycle_cli import run_start

    s = _spec(c, spec, _opts(entrypoint, workspace, remote_dir, int(port) if port else None, name, accept_new, known_hosts))
    _run(lambda: run_start(s, dispatch_first=True, follow=follow))


@task(name="tail-log", help=_help("spec", "name", "lines", "follow", "accept_new", "known_hosts"))
def tail_log(c, spec=None, name=None, lines=10, follow=False, accept_new=False, known_hosts=None):
    """Show the last lines of every process's log, prefixed [host role.id]."""
    if not _once("tail-log"):
        return
    from clusterctl.ops.lifecycle_cli import run_logs

    s = _spec(c, spec, _opts(None, None, None, None, name, accept_new, known_hosts))
    _run(lambda: run_logs(s, lines=int(lines), follow=follow))


@task(help=_help("spec", "name", "accept_new", "known_hosts"))
def status(c, spec=None, name=None, accept_new=False, known_hosts=None):
    """Show every process's state."""
    if not _once("status"):
        return
    from clusterctl.ops.lifecycle_cli import run_status

    s = _spec(c, spec, _opts(None, None, None, None, name, accept_new, known_hosts))
    _run(lambda: run_status(s))


@task(help=_help("spec", "name", "accept_new", "known_hosts"))
def kill(c, spec=None, name=None, accept_new=False, known_hosts=None):
    """Stop the job on every host: SIGTERM, SIGKILL after the grace period, no orphan left."""
    if not _once("kill"):
        return
    from clusterctl.ops.lifecycle_cli import run_stop

    s = _spec(c, spec, _opts(None, None, None, None, name, accept_new, known_hosts))
    _run(lambda: run_stop(s))
