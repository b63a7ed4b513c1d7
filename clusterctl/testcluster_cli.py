"""`clusterctl testcluster up|status|down`: the command line of clusterctl.testcluster (and of
`testcluster up --slurm`, which hands over to clusterctl.testcluster_slurm). Kept apart from both so that
neither imports the other's command line: testcluster_slurm builds on testcluster, this module on both."""

from __future__ import annotations

import argparse
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .errors import ClusterctlError, UsageError
from .testcluster import DEFAULT_NAME, add_down_parser, add_up_arguments, down, status, up

__all__ = ["add_cli", "cmd_up", "cmd_status", "cmd_down", "main"]


def _console() -> Any:
    from rich.console import Console

    return Console(log_path=False)


# The fleet options of `up` that the Slurm cluster does not take (testcluster_slurm.up has no such parameter:
# its nodes log in as root, on one network, and it writes no ssh config): the flag, its dest in args.
_NOT_WITH_SLURM = (("--user", "user"), ("--sudo-password-node", "sudo_password_node"), ("--bastion", "bastion"),
                   ("--ssh-config", "ssh_config"))


def _refuse_with_slurm(args: argparse.Namespace) -> None:
    """Raise UsageError naming every option given that `up --slurm` would drop (their defaults: None, False)."""
    given = [flag for flag, dest in _NOT_WITH_SLURM if getattr(args, dest, None) not in (None, False)]
    if given:
        raise UsageError(f"testcluster up --slurm does not take {', '.join(given)}: a Slurm test cluster logs in "
                         "as root, on one network, with no ssh config")


def cmd_up(args: argparse.Namespace) -> int:
    """`testcluster up`: bring the cluster up and print its nodes and spec path."""
    from rich.table import Table

    if getattr(args, "slurm", False):  # a Slurm cluster on these nodes: clusterctl/testcluster_slurm.py
        _refuse_with_slurm(args)
        from .testcluster_slurm import DEFAULT_NAME as SLURM_NAME
        from .testcluster_slurm import cmd_up as slurm_up  # imports testcluster, never this module

        if args.name is None:  # the Slurm cluster's own default: never the plain cluster's, which it would replace
            args.name = SLURM_NAME
        return slurm_up(args)
    if args.name is None:
        args.name = DEFAULT_NAME
    console = _console()
    packages = [p for p in (args.packages or "").split(",") if p.strip()]
    info = up(
        args.nodes,
        name=args.name,
        spec_out=Path(args.spec_out) if args.spec_out else None,
        base_image=args.base_image,
        packages=packages,
        progress=lambda msg: console.log(msg, markup=False, highlight=False),
        user=args.user,
        bastion=args.bastion,
        ssh_config=args.ssh_config,
        sudo_password_nodes=args.sudo_password_node or (),
    )
    table = Table(title=f"test cluster {info.name}")
    for column in ("container", "ip", "hostname"):
        table.add_column(column)
    for node in info.nodes:
        table.add_row(node.container, node.ip, node.hostname)
    if info.bastion:
        table.add_row(info.bastion.container, info.bastion.ip, info.bastion.hostname)
    console.print(table)
    how = "reused" if info.reused else "started"
    image = f"{info.image} ({'built' if info.image_built else 'cached'})"
    console.print(f"{how} in {info.timings['total']:.1f}s; image {image}")
    console.print(f"spec:        {info.spec_path}", markup=False, highlight=False)
    console.print(f"key:         {info.key_path}", markup=False, highlight=False)
    console.print(f"known_hosts: {info.known_hosts_path}", markup=False, highlight=False)
    if info.ssh_config_path:
        # the hint is a command line to paste: its file name quoted for the shell (a blank split it in two)
        hint = shlex.join(["ssh", "-F", str(info.ssh_config_path), "node0"])
        console.print(f"ssh_config:  {info.ssh_config_path}   ({hint})", markup=False, highlight=False)
    console.print(f"login:       {info.user}" + (f" via {info.proxy_jump}" if info.proxy_jump else ""))
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    """`testcluster status`: print each node's state; exit 1 if a node is down or absent."""
    from rich.table import Table

    console = _console()
    nodes = status(args.name)
    if not nodes:
        console.print(f"no test cluster named {args.name}")
        return 1
    table = Table(title=f"test cluster {args.name}")
    for column in ("container", "ip", "state", "ssh"):
        table.add_column(column)
    for node in nodes:
        table.add_row(node.container, node.ip, node.state, "yes" if node.ssh else "[red]no[/red]")
    console.print(table)
    return 0 if all(n.ssh for n in nodes) else 1


def cmd_down(args: argparse.Namespace) -> int:
    """`testcluster down`: remove the cluster's containers and network."""
    removed = down(args.name)
    _console().print(f"removed {removed} docker object(s) of test cluster {args.name}")
    return 0


def add_cli(subparsers: Any) -> argparse.ArgumentParser:
    """Register `testcluster up|status|down` on an argparse subparsers object; handlers in args.func."""
    parser = subparsers.add_parser("testcluster", help="a cluster of sshd containers on this machine")
    sub = parser.add_subparsers(dest="testcluster_command", required=True, metavar="{up,status,down}")

    p_up = sub.add_parser("up", help="create or reuse the cluster and write its spec")
    add_up_arguments(p_up, DEFAULT_NAME)
    p_up.set_defaults(name=None)  # DEFAULT_NAME, or with --slurm the Slurm cluster's (cmd_up)
    p_up.add_argument("--user", help="a non-root login user with passwordless sudo; root login disabled")
    p_up.add_argument(
        "--bastion", action="store_true", help="nodes only behind <name>-bastion, on a network this machine is not on"
    )
    p_up.add_argument("--ssh-config", action="store_true", help="write <spec dir>/ssh_config: Host node0.., bastion")
    p_up.add_argument(
        "--sudo-password-node",
        type=int,
        action="append",
        metavar="K",
        help="node K's sudo wants a password (never written anywhere); repeatable; needs --user",
    )
    p_up.add_argument("--slurm", action="store_true", help="add slurm-wlm and munge and start Slurm (docs/slurm.md)")
    p_up.set_defaults(func=cmd_up)

    p_status = sub.add_parser("status", help="show the cluster's nodes")
    p_status.add_argument("--name", default=DEFAULT_NAME)
    p_status.set_defaults(func=cmd_status)

    add_down_parser(sub, DEFAULT_NAME, cmd_down, "remove the cluster's containers and network")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Stand-alone entry point: `python -m clusterctl.testcluster_cli up --nodes 3`."""
    words = list(sys.argv[1:] if argv is None else argv)
    if not words or words[0] != "testcluster":
        words.insert(0, "testcluster")  # reuse add_cli's parser without making users type it twice
    parser = argparse.ArgumentParser(prog="python -m clusterctl.testcluster_cli")
    add_cli(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(words)
    try:
        return int(args.func(args))
    except ClusterctlError as exc:  # on stderr, not wrapped: a one-line error stays one line
        from rich.console import Console

        console = Console(stderr=True, soft_wrap=True)
        console.print("error:", style="bold red", end=" ")
        console.print(str(exc), markup=False, highlight=False)
        return exc.exit_code


if __name__ == "__main__":
    sys.exit(main())
