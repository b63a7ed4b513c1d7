"""The seed's fab workflow, done right: `fab -H ip1,ip2 start | tail-log | status | kill`, and every other
operation of a spec as a fab task (`fab --spec cluster.yaml provision`).

With only `-H` (and SSH keys or an ssh-agent: never a password), each host runs one pserver and one
trainer of the seed-000 positional script on port 6173. Hosts may be aliases of your ssh config
(`fab -S my_ssh_config -H gpu0,gpu1 status`) and may carry a user and port (`ubuntu@gpu0:2222`).
Without `-H` or `--spec`, a task uses the spec of the current directory (`cluster.yaml`, or the one
named by `clusterctl.spec` in Fabric's own config files), else the hosts of the last `fab -H ... start`
run from this directory. These are thin wrappers over clusterctl's operations.

Fabric calls a task once per `-H` host; a job needs the whole host list at once (ids, endpoints, the
coordinator). `ClusterExecutor`, named in the `fabric.yaml` beside this file (Invoke's
`tasks.executor_class` setting), calls each task once with every host instead, and runs a `-- command`
(`clusterctl-fab -H ip1,ip2 -- 'uptime'`) as clusterctl's `exec` of `sh -c COMMAND` on every host at once,
host keys checked, where Fabric's own would add any key it had not seen.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shlex
from pathlib import Path

from fabric import Task as FabricTask
from fabric import task
from fabric.executor import Executor
from invoke import Argument, Call, Context, Exit, Task

from clusterctl.errors import ClusterctlError, UsageError
from clusterctl.fab import guard_fab

__all__ = ["ClusterExecutor", "start", "tail_log", "status", "kill", "provision", "doctor", "dispatch", "exec_"]

SPEC_NAMES = ("cluster.yaml", "cluster.yml")

guard_fab()  # plain `fab`'s refusals after this import (its task flags, -S, -f, -i) are one line (see clusterctl.fab)


class ClusterContext(Context):
    """The context of a clusterctl task: Fabric's config plus the whole `-H` host list."""

    def __init__(self, config, hosts: list[str], hosts_flag: str | None = None, spec: str | None = None):
        super().__init__(config=config)
        # hosts_flag: -H as given (None: no -H); spec: `clusterctl-fab --spec FILE TASK` (before the task)
        self._set(cluster_hosts=list(hosts), cluster_hosts_flag=hosts_flag, cluster_spec=spec)


class ClusterCall(Call):
    """A call of a clusterctl task, made once for all hosts."""

    def __init__(self, *args, cluster_hosts=(), cluster_hosts_flag=None, cluster_spec=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.cluster_hosts = list(cluster_hosts)
        self.cluster_hosts_flag, self.cluster_spec = cluster_hosts_flag, cluster_spec

    def make_context(self, config) -> ClusterContext:
        """A context carrying the host list instead of one host's Connection."""
        return ClusterContext(config, self.cluster_hosts, self.cluster_hosts_flag, self.cluster_spec)


class ClusterExecutor(Executor):
    """Fabric's executor, except that clusterctl's tasks run once with every `-H` host, and so does a `-- command`
    remainder (`fab -H a,b -- uname -a`: clusterctl's `exec` of `sh -c COMMAND`; Fabric's would connect with
    paramiko and add any host key it had not seen); other tasks are expanded per host as Fabric does."""

    def expand_calls(self, calls, apply_hosts=True):
        """Per-host calls for ordinary tasks, one ClusterCall for each clusterctl task and for the remainder."""
        core = self.core[0].args
        host_str = core.hosts.value if apply_hosts else None
        hosts = [h.strip() for h in (host_str or "").split(",") if h.strip()]
        where = {"cluster_hosts": hosts, "cluster_hosts_flag": host_str,
                 "cluster_spec": core["spec"].value if "spec" in core else None}  # clusterctl-fab's own --spec
        ours, others = [], []
        for call in calls:
            call = Call(task=call) if isinstance(call, Task) else call
            if getattr(call.task, "whole_cluster", False):
                ours += self.expand_calls(call.pre, apply_hosts=False)
                ours.append(call.clone(into=ClusterCall, with_=where))
                ours += self.expand_calls(call.post, apply_hosts=False)
            else:
                others.append(call)
        remainder, self.core.remainder = self.core.remainder, ""  # Fabric's own expansion never sees it
        try:
            ours += super().expand_calls(others, apply_hosts) if others else []
        finally:
            self.core.remainder = remainder
        if remainder and apply_hosts:
            ours.append(ClusterCall(ClusterTask(_remainder_body(remainder)), **where))
        return ours


def _remainder_body(command: str):
    def remainder(c):
        """`fab -H HOSTS -- COMMAND`: the command through `sh -c` on every host at once, as `exec` runs one."""
        from clusterctl.commands.core import cmd_exec

        timeout = c.config.timeouts.command  # fab's own -T/--command-timeout
        _run(lambda: cmd_exec(argparse.Namespace(spec=_spec(c, None), argv=["--", "sh", "-c", command],
                                                 timeout=None if timeout is None else _seconds("-T", timeout))))

    return remainder


class _WholeNumber(Argument):
    """A task's int option (`--lines`: INT in its help, as Invoke shows an int default): a word given for it is
    one line, not the traceback of Invoke's own int() (raised while fab parses, before any task runs)."""

    def set_value(self, value, cast=True):
        try:
            super().set_value(value, cast)
        except ValueError:
            # exit 2, as every bad value of a task's own (docs/install.md) and clusterctl's argparse have it
            raise Exit(f"clusterctl: error: --{self.name} must be a whole number, not {value!r}", code=2) from None


class ClusterTask(FabricTask):
    """A clusterctl task: run once with the whole host list (see ClusterExecutor); its int options are _WholeNumber."""

    whole_cluster = True

    def get_arguments(self, ignore_unknown_help=None):
        args = super().get_arguments(ignore_unknown_help)
        for arg in args:
            if arg.kind is int:
                arg.__class__ = _WholeNumber  # Invoke builds its own Argument from the default's type
        return args


def cluster_task(*args, **kwargs):
    """`@task` for clusterctl's tasks: run once with the whole host list (see ClusterExecutor)."""
    return task(*args, klass=ClusterTask, **kwargs)


# ------------------------------------------------------------------------------------------ the spec


def _remembered(cwd: str) -> Path:
    from clusterctl.cache import cache_dir

    return cache_dir("fab") / (hashlib.sha256(cwd.encode()).hexdigest()[:16] + ".yaml")


def _spec(c, spec: str | None, *, remember: list | None = None, **options):
    """The spec a task acts on: --spec, else -H (remembered for this directory), else the directory's own
    spec (cluster.yaml, or Fabric config's clusterctl.spec), else the last -H used from this directory.
    `options`: the task's options for the -H spec (see _opts). `remember`: where to put what remembers a -H
    spec for this directory, for the caller to call once the job has started (a failed start remembers nothing:
    the hosts of a running job stay the ones later tasks reach)."""
    from clusterctl.adhoc import ADHOC_SOURCE, AdhocOptions, adhoc_spec, adhoc_spec_text
    from clusterctl.spec import load_spec, parse_spec

    opts = _opts(**options)
    spec = spec if spec is not None else getattr(c, "cluster_spec", None)
    if spec is not None and not spec.strip():  # `--spec "$SPEC"`, SPEC unset: never this directory's spec
        raise UsageError(f"--spec {spec!r} names no file: give --spec cluster.yaml")
    hosts = getattr(c, "cluster_hosts", None)
    if spec and hosts:
        raise ClusterctlError(f"-H {','.join(hosts)} and --spec {spec} name two clusters: give one of them")
    if spec:
        return _as_given(c, load_spec(_only_for_hosts(opts, spec)), spec)
    if hosts is None:
        raise ClusterctlError(
            "this fab run did not use clusterctl's executor: keep fabric.yaml (tasks.executor_class: "
            "clusterctl.fabfile.ClusterExecutor) beside the fabfile"
        )
    cwd = os.getcwd()
    if hosts:
        connect = c.config.get("connect_kwargs") or {}
        key = _one_key(connect.get("key_filename"))
        ssh_config = getattr(c.config, "_runtime_ssh_path", None) or None  # fab -S FILE
        chosen = {k: v for k, v in opts.items() if v is not None}
        options = AdhocOptions(identity_file=key, ssh_config=ssh_config, connect_timeout=connect.get("timeout"),
                               **chosen)
        try:
            parsed = adhoc_spec(hosts, options)
        except ClusterctlError as exc:
            raise _task_value_error(exc) from None
        if remember is not None:  # `start`: later tasks run from here need no -H
            text = adhoc_spec_text(hosts, options)
            remember.append(lambda: _write_private(_remembered(cwd), text))
        return parsed
    if getattr(c, "cluster_hosts_flag", None) is not None:  # `-H ""`, `-H ,`: never another cluster's hosts
        raise ClusterctlError(f"-H {c.cluster_hosts_flag!r} names no host: give -H host1,host2")
    named = (c.config.get("clusterctl") or {}).get("spec")
    for candidate in ([named] if named else []) + list(SPEC_NAMES):
        # the one named in Fabric's config, or a directory's entry that is there but no file: said by the loader
        # ("cannot read spec: is a directory"), never passed over for another cluster's spec
        if candidate == named or os.path.lexists(candidate):
            return _as_given(c, load_spec(_only_for_hosts(opts, candidate)), candidate)
    last = _remembered(cwd)
    if last.is_file():
        where = _only_for_hosts(opts, "the last `fab -H ... start` from here")
        return _as_given(c, parse_spec(last.read_text(encoding="utf-8"), ADHOC_SOURCE), where)
    raise ClusterctlError("no hosts: give -H host1,host2 or --spec FILE, or run where a cluster.yaml is")


def _one_key(keys) -> str | None:
    """The key file of `-i` (Fabric's connect_kwargs.key_filename): a spec takes one, so more are refused, not
    all but the first dropped."""
    keys = [keys] if isinstance(keys, str) else list(keys or [])
    if len(keys) > 1:
        raise ClusterctlError(f"-i: {len(keys)} key files ({', '.join(map(str, keys))}): clusterctl's tasks take one; "
                              "put the others in your ssh-agent or ssh config")
    return keys[0] if keys else None


# the task options that shape the spec built from -H (keys of _opts), as a user types them
_FOR_HOSTS = {"name": "--name", "entrypoint": "--entrypoint", "workspace": "--workspace", "remote_dir": "--remote-dir",
              "pserver_port": "--port", "known_hosts": "--known-hosts", "host_key_policy": "--accept-new"}


def _task_value_error(exc: ClusterctlError) -> ClusterctlError:
    """`exc` (a -H spec refused, one line per option) as a UsageError (exit 2, as docs/install.md says of a task's own
    bad values) when a line names one of the task's options (`--port 70000: ...`, `--name a/b: ...`); as it is (exit
    1, as fab's own flags) when only -H, -i, -S or --connect-timeout gave what was refused."""
    flags = tuple(f"{flag}{end}" for flag in _FOR_HOSTS.values() for end in (" ", ":"))
    if any(line.startswith(flags) for line in str(exc).splitlines()):
        return UsageError(str(exc))
    return exc


def _only_for_hosts(opts: dict, where: str) -> str:
    """`where`, unless an option that only -H hosts take was given: a spec has its own (`kill --name j1` acted on
    the spec's job, whichever that was), so it is refused rather than dropped."""
    given = [flag for key, flag in _FOR_HOSTS.items() if opts.get(key) is not None]
    if given:
        raise ClusterctlError(f"{', '.join(given)}: for -H hosts only, not for {where}: give -H host1,host2 with it")
    return where


def _as_given(c, spec, where: str):
    """`spec`, unless fab's own -i, -S or --connect-timeout, as given on its command line (Fabric keeps those as
    its config's overrides; its config files' are not counted), says otherwise than the spec: they shape a -H
    spec only, so one that differs is refused rather than dropped (`fab -i KEY --spec F` connected with F's key)."""
    connect = (getattr(c.config, "_overrides", None) or {}).get("connect_kwargs") or {}
    key, config, timeout = connect.get("key_filename"), getattr(c.config, "_runtime_ssh_path", None), connect.get("timeout")
    differ = []  # (flag, the spec's field, whether the spec sets it)
    if key and not _same_file(spec, spec.ssh.identity_file, _one_key(key)):
        differ.append(("-i", "ssh.identity_file", spec.ssh.identity_file is not None))
    if config and not _same_file(spec, spec.ssh.config, config):
        differ.append(("-S", "ssh.config", spec.ssh.config is not None))
    if timeout and float(timeout) != spec.ssh.connect_timeout:
        differ.append(("--connect-timeout", "ssh.connect_timeout", True))
    if differ:
        flags = ", ".join(f for f, _, _ in differ)
        runs: list[tuple[str, list[str]]] = []  # "its own" / "no" and their fields, in the flags' order
        for _, field, sets in differ:  # a spec without ssh.config: "has its own ssh.config" was wrong there
            word = "its own" if sets else "no"
            if runs and runs[-1][0] == word:
                runs[-1][1].append(field)
            else:
                runs.append((word, [field]))
        has = " and ".join(f"{word} {', '.join(fields)}" for word, fields in runs)
        raise ClusterctlError(f"{flags}: {where} has {has}: give -H host1,host2 with {flags}, or leave "
                              f"{'it' if len(differ) == 1 else 'them'} out")
    return spec


def _same_file(spec, mine: str | None, given: str) -> bool:
    """Whether the spec's path `mine` (relative to the spec) names the file `given` on the command line names."""
    return mine is not None and os.path.realpath(spec.local_path(mine)) == os.path.realpath(os.path.expanduser(given))


def _write_private(path: Path, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        fh.write(text)


def _run(fn) -> None:
    """Run an operation's front end; errors become one line on stderr and fab's exit code."""
    import sys

    from clusterctl import console
    from clusterctl.cli import guarded

    console.setup_logging()
    code = guarded(fn)
    if code:
        sys.exit(code)


def _whole_number(option: str, value) -> int:
    """A task's numeric option as given on fab's command line (a string): an int, or a one-line error."""
    try:
        return int(value)
    except (TypeError, ValueError):
        raise UsageError(f"{option} must be a whole number, not {value!r}") from None


def _seconds(option: str, value) -> float:
    """A task's seconds option as given on fab's command line: a number (its range is the operation's to check)."""
    try:
        return float(value)
    except (TypeError, ValueError):
        raise UsageError(f"{option} must be a number of seconds, not {value!r}") from None


def _opts(c=None, *, entrypoint=None, workspace=None, remote_dir=None, port=None, name=None, accept_new=False,
          known_hosts=None) -> dict:
    """The task options that shape the -H spec; an empty value is refused, never taken for the option's default
    (`--known-hosts ""` checked host keys against another file)."""
    if known_hosts is not None and not known_hosts.strip():
        raise UsageError(f"--known-hosts {known_hosts!r} names no file: give a known_hosts file, "
                              "or leave the option out")
    return {
        "known_hosts": known_hosts,
        "entrypoint": entrypoint,
        "workspace": workspace,
        "remote_dir": remote_dir,
        "pserver_port": _whole_number("--port", port) if port is not None else None,
        "name": name,
        "host_key_policy": "accept-new" if accept_new else None,
    }


_HELP = {
    "spec": "a cluster spec (YAML) instead of -H (default: ./cluster.yaml, or the last -H used here)",
    "entrypoint": "program and leading args (default: python3 dist_train_demo.py)",
    "workspace": "local directory shipped to every host (default: .)",
    "remote_dir": "where it lands, relative to the login user's home unless absolute (default: clusterctl/fabjob)",
    "port": "pserver port; trainer, master and control ports are the next three (default: 6173)",
    "name": "job name (default: fabjob)",
    "accept_new": "record unknown host keys in the known_hosts file (default: refuse them)",
    "known_hosts": "the known_hosts file host keys are checked against (default: your ssh config's)",
    "lines": "lines per log (default 10)",
    "follow": "keep following the logs until the job ends",
    "check": "report what would change; change nothing",
    "only": "comma-separated steps to run (wheelhouse,apt,python,gpu,mpi,ssh_mesh,commands)",
    "timeout": "seconds the command may run on each host; it is ended there after (default: no limit)",
    "cmd": "the command to run on every host, split as a shell would but run without one (pipes, ~, globs: sh -c '...')",
}


def _help(*names: str) -> dict:
    return {n: _HELP[n] for n in names}


_CONN = ("spec", "name", "accept_new", "known_hosts")


@cluster_task(help=_help(*_CONN, "entrypoint", "workspace", "remote_dir", "port", "follow"))
def start(c, spec=None, entrypoint=None, workspace=None, remote_dir=None, port=None, name=None, accept_new=False,
          known_hosts=None, follow=False):
    """Dispatch the workspace and start pservers then trainers on every host (detached unless --follow)."""
    from clusterctl.commands.lifecycle import run_start

    def started():
        remember: list = []
        try:
            return run_start(_spec(c, spec, entrypoint=entrypoint, workspace=workspace, remote_dir=remote_dir, port=port,
                                   name=name, accept_new=accept_new, known_hosts=known_hosts, remember=remember),
                             dispatch_first=True, follow=follow, on_started=lambda: [r() for r in remember])
        except ClusterctlError as exc:  # "already running; stop it first (clusterctl stop)": fab's word is kill
            named = spec if spec is not None else getattr(c, "cluster_spec", None)
            kill = f"fab kill --spec {shlex.quote(named)}" if named else "fab kill"
            exc.args = tuple(a.replace("(clusterctl stop)", f"({kill})") if isinstance(a, str) else a
                             for a in exc.args)
            raise

    _run(started)


@cluster_task(name="tail-log", help=_help(*_CONN, "lines", "follow"))
def tail_log(c, spec=None, name=None, lines=10, follow=False, accept_new=False, known_hosts=None):
    """Show the last lines of every process's log, prefixed [host role.id]."""
    from clusterctl.commands.lifecycle import run_logs

    _run(lambda: run_logs(_spec(c, spec, name=name, accept_new=accept_new, known_hosts=known_hosts), lines=lines,
                          follow=follow))


@cluster_task(help=_help(*_CONN))
def status(c, spec=None, name=None, accept_new=False, known_hosts=None):
    """Show every process's state."""
    from clusterctl.commands.lifecycle import run_status

    _run(lambda: run_status(_spec(c, spec, name=name, accept_new=accept_new, known_hosts=known_hosts)))


@cluster_task(aliases=["stop"], help=_help(*_CONN))
def kill(c, spec=None, name=None, accept_new=False, known_hosts=None):
    """Stop the job on every host: SIGTERM, SIGKILL after the grace period, no orphan left."""
    from clusterctl.commands.lifecycle import run_stop

    _run(lambda: run_stop(_spec(c, spec, name=name, accept_new=accept_new, known_hosts=known_hosts)))


@cluster_task(help=_help(*_CONN, "workspace", "remote_dir"))
def dispatch(c, spec=None, name=None, workspace=None, remote_dir=None, accept_new=False, known_hosts=None):
    """Ship the workspace to every host: incremental, atomic, verified."""
    from clusterctl.commands.lifecycle import cmd_dispatch

    opts = dict(name=name, workspace=workspace, remote_dir=remote_dir, accept_new=accept_new, known_hosts=known_hosts)
    _run(lambda: cmd_dispatch(argparse.Namespace(spec=_spec(c, spec, **opts))))


@cluster_task(help=_help(*_CONN, "check", "only"))
def provision(c, spec=None, name=None, check=False, only=None, accept_new=False, known_hosts=None):
    """Install what the spec's provision section asks for on every host."""
    from clusterctl.commands.provision import cmd_provision

    steps = [s.strip() for s in (only or "").split(",") if s.strip()] or None
    opts = dict(name=name, accept_new=accept_new, known_hosts=known_hosts)
    _run(lambda: cmd_provision(argparse.Namespace(spec=_provisioned(_spec(c, spec, **opts)), check=check, force=False,
                                                  only=steps, verbose_lines=False)))


def _provisioned(spec):
    """`spec`, if it has a provision: section; else the CLI's one line, naming the file (not the spec's repr)."""
    from clusterctl.adhoc import ADHOC_SOURCE
    from clusterctl.errors import ProvisionError

    if spec.provision is None and spec.source == ADHOC_SOURCE:
        raise ProvisionError("a spec built from -H has no provision: section: give --spec FILE with one "
                             "(see docs/provisioning.md)")
    if spec.provision is None:
        raise ProvisionError(f"{spec.source} has no provision: section (see docs/provisioning.md)")
    return spec


@cluster_task(help=_help(*_CONN))
def doctor(c, spec=None, name=None, accept_new=False, known_hosts=None):
    """Check every host (ssh, login user and sudo, Python, MPI, CUDA, ports, peers) and compare them."""
    from clusterctl.commands.provision import cmd_doctor

    opts = dict(name=name, accept_new=accept_new, known_hosts=known_hosts)
    _run(lambda: cmd_doctor(argparse.Namespace(spec=_spec(c, spec, **opts), json=False)))


@cluster_task(name="exec", help=_help(*_CONN, "cmd", "timeout"))
def exec_(c, cmd, spec=None, name=None, timeout=None, accept_new=False, known_hosts=None):
    """Run a command on every host (no shell: wrap pipes and globs in sh -c '...'), output prefixed [host]."""
    from clusterctl.commands.core import cmd_exec

    opts = dict(name=name, accept_new=accept_new, known_hosts=known_hosts)
    # a leading `--`, as the CLI's `exec SPEC -- CMD`: a `--` inside the command (`git log -- FILE`) is the command's
    _run(lambda: cmd_exec(argparse.Namespace(spec=_spec(c, spec, **opts), argv=["--", *_words(cmd)],
                                             timeout=None if timeout is None else _seconds("--timeout", timeout))))


def _words(cmd: str) -> list[str]:
    """`exec`'s command split as a shell would (shlex), or a one-line error (an unclosed quote)."""
    try:
        words = shlex.split(cmd)
    except ValueError as exc:
        raise UsageError(f"exec: cannot split the command {cmd!r}: {exc}") from None
    if not words:  # else the CLI's own hint, `clusterctl exec cluster.yaml -- hostname`
        raise UsageError("exec needs a command: exec --cmd 'hostname'")
    if words in (["--help"], ["-h"]):  # plain `fab exec --help`: Invoke gave the flag as the command
        raise UsageError(f"exec: {words[0]} is not a command to run on every host; exec's help: fab --help exec")
    return words
