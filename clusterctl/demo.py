"""`clusterctl demo`: the main job on the embedded default, a local 3-node dockerized SSH test cluster."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import yaml
from rich.markup import escape
from rich.rule import Rule

from .console import LinePrinter, out

__all__ = ["add_cli", "demo_spec"]

DEMO_CLUSTER = "clusterctl-demo"
DEMO_NODES = 3
DEMO_PACKAGES = ["numpy", "pyzmq"]
ROOT = Path(__file__).resolve().parent.parent


def demo_spec(cluster_spec: Path, dest: Path) -> Path:
    """Write the demo job's spec: the test cluster's hosts and keys, the fit_a_line example, 2 pservers, 3 trainers."""
    base = yaml.safe_load(cluster_spec.read_text())
    spec = {
        "name": "fit-a-line-demo",
        "ssh": base["ssh"],
        "hosts": base["hosts"],
        "workspace": {"local": str(ROOT / "examples" / "fit_a_line"), "remote": "clusterctl/fit-a-line"},
        "job": {
            "mode": "pserver",
            "entrypoint": ["/opt/venv/bin/python", "train.py"],
            "pservers": 2,
            "trainers": 1,
            "sync": "sync",
            "grace": 5,
        },
    }
    dest.write_text("# Written by `clusterctl demo`.\n" + yaml.safe_dump(spec, sort_keys=False))
    return dest


def cmd_demo(args: argparse.Namespace) -> int:
    """Bring up the test cluster, then validate, plan and exec on it."""
    from . import testcluster as tc
    from .cli import cmd_plan, cmd_validate
    from .ops import open_session
    from .ops.execute import execute, worst_exit_code

    t0 = time.monotonic()
    out.print(Rule(f"1. test cluster: {DEMO_NODES} nodes running sshd in Docker"))
    info = tc.up(DEMO_NODES, name=DEMO_CLUSTER, packages=DEMO_PACKAGES)
    spec_path = demo_spec(Path(info.spec_path), Path(info.state_dir) / "demo.yaml")
    out.print(f"spec: {escape(str(spec_path))}")

    out.print(Rule("2. validate"))
    cmd_validate(argparse.Namespace(spec=str(spec_path)))
    out.print(Rule("3. plan"))
    cmd_plan(argparse.Namespace(spec=str(spec_path), json=False))
    out.print(Rule("4. exec on every host (strict host keys, in parallel)"))
    with open_session(str(spec_path)) as session:
        results = execute(session.remote, ["sh", "-c", 'echo "$(hostname) $(python3 --version)"'], on_line=LinePrinter())
    out.print(f"[bold green]done[/] in {time.monotonic() - t0:.1f}s")
    return worst_exit_code(results)


def add_cli(sub) -> None:
    """Register `clusterctl demo`."""
    p = sub.add_parser("demo", help="run the demo job on a local dockerized test cluster")
    p.set_defaults(func=cmd_demo)
