"""`clusterctl demo`: the main job on the embedded default, a local 3-node dockerized SSH test cluster.

test cluster up → provision (from a wheelhouse: no internet on the nodes) → dispatch fit_a_line →
start 2 pservers + 3 trainers in sync mode, watched with `clusterctl top`'s view → final table → stop.
A second run is faster: provisioning reports 0 changed and dispatch sends nothing.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import yaml
from rich.live import Live
from rich.markup import escape
from rich.rule import Rule

from .console import out
from .errors import ClusterctlError

__all__ = ["add_cli", "demo_spec", "build_wheel"]

DEMO_CLUSTER = "clusterctl-demo"
DEMO_NODES = 3
DEMO_REFRESH_S = 1.0  # the training view's refresh
VENV = "/opt/clusterctl-venv"
ROOT = Path(__file__).resolve().parent.parent


def build_wheel(dest: Path) -> tuple[Path, str]:
    """A wheel of the running clusterctl (checkout or installed), versioned `X.Y.Z+src.<hash>`; built once per version.

    The local version label makes hosts install the new code whenever it changed (same-named wheels
    would count as already present).
    """
    from .provision.selfwheel import build_self_wheel

    return build_self_wheel(dest)


def demo_spec(cluster_spec: Path, dest: Path, wheel: Path, version: str) -> Path:
    """The demo job: the test cluster's hosts and keys, provisioning, the fit_a_line example, 2 pservers, 3 trainers."""
    base = yaml.safe_load(cluster_spec.read_text())
    spec = {
        "name": "fit-a-line-demo",
        "ssh": base["ssh"],
        "hosts": base["hosts"],
        "workspace": {"local": str(ROOT / "examples" / "fit_a_line"), "remote": "clusterctl/fit-a-line"},
        "provision": {
            "wheelhouse": {"enabled": True, "find_links": [str(wheel.parent)]},
            "python": {"venv": VENV, "requirements": ["numpy", "pyzmq", f"clusterctl=={version}"]},
        },
        "job": {
            "mode": "pserver",
            "entrypoint": [f"{VENV}/bin/python", "train.py"],
            "args": ["--step-delay", "0.02"],
            "pservers": 2,
            "trainers": 1,
            "sync": "sync",
            "grace": 5,
        },
    }
    dest.write_text("# Written by `clusterctl demo`.\n" + yaml.safe_dump(spec, sort_keys=False))
    return dest


def cmd_demo(args: argparse.Namespace) -> int:
    """Run the demo end to end; exit 0 when every trainer converged (loss < 10)."""
    from . import testcluster as tc
    from .commands.core import cmd_plan
    from .backends import open_backend
    from .host.states import ACTIVE_JOB_STATES
    from .commands.lifecycle import _stop_after_interrupt, render_status
    from .commands.provision import cmd_provision
    from .ops.top import Top
    from .commands.top import render_top

    t_all = time.monotonic()
    example = ROOT / "examples" / "fit_a_line"
    if not example.is_dir():
        raise ClusterctlError(
            f"clusterctl demo trains the repository's examples/fit_a_line, which an installed clusterctl does not "
            f"carry ({example} is missing): run it from a checkout (./scripts/demo)"
        )
    out.print(Rule(f"1. test cluster: {DEMO_NODES} nodes running sshd in Docker"))
    info = tc.up(DEMO_NODES, name=DEMO_CLUSTER)
    wheel, version = build_wheel(Path(info.state_dir) / "dist")
    spec_path = demo_spec(Path(info.spec_path), Path(info.state_dir) / "demo.yaml", wheel, version)
    out.print(f"{DEMO_NODES} nodes up ({'reused' if info.reused else 'started'}); spec: {escape(str(spec_path))}")
    cmd_plan(argparse.Namespace(spec=str(spec_path), json=False, expand=False, all=False))

    out.print(Rule("2. provision: venv + numpy, pyzmq, clusterctl from a wheelhouse (nodes have no internet)"))
    t0 = time.monotonic()
    code = cmd_provision(argparse.Namespace(spec=str(spec_path), check=False, force=False, only=None, verbose_lines=False))
    if code:
        return code
    t_provision = time.monotonic() - t0

    with open_backend(str(spec_path)) as backend:
        out.print(Rule("3. dispatch the workspace (incremental, atomic)"))
        t0 = time.monotonic()
        sent = backend.dispatch()
        out.print(
            f"{sum(d.files_sent for d in sent)} file(s), {sum(d.bytes_sent for d in sent):,} bytes to "
            f"{len(sent)} hosts in {time.monotonic() - t0:.1f}s"
        )

        out.print(Rule("4. train fit_a_line: 2 pservers, 3 trainers, sync"))
        t0 = time.monotonic()
        try:
            backend.stop()  # a previous demo interrupted half way leaves nothing behind
            backend.start()
            # `clusterctl top`'s view, refreshed every second until the job ends
            with Top(backend.session) as top:
                view = top.snapshot(None, interval=DEMO_REFRESH_S)
                with Live(render_top(view), console=out, auto_refresh=False, transient=True) as live:
                    while view.state in ACTIVE_JOB_STATES:
                        time.sleep(max(0.0, DEMO_REFRESH_S - view.took_s))
                        view = top.snapshot(DEMO_REFRESH_S, interval=DEMO_REFRESH_S)
                        live.update(render_top(view), refresh=True)
                view = top.snapshot(None)  # every log read to its end
            final = backend.status()
        except KeyboardInterrupt:
            return _stop_after_interrupt(backend)
        t_train = time.monotonic() - t0

        out.print(Rule("5. result"))
        out.print(render_top(view, title=f"fit_a_line: job {final.state} in {t_train:.1f}s"))
        render_status(final)
        out.print(Rule("6. stop"))
        left = backend.stop().was_running
        out.print("stopped the remaining processes" if left else "nothing left to stop: pservers exited when the trainers finished")

    trainers = [r for r in view.rows if r.role == "trainer" and r.rank is None and r.progress]
    losses = [r.progress["metrics"]["loss"] for r in trainers if isinstance(r.progress["metrics"].get("loss"), (int, float))]
    converged = final.state == "succeeded" and len(losses) == 3 and max(losses) < 10
    verdict = "[bold green]converged[/]" if converged else "[bold red]did not converge[/]"
    out.print(
        f"{verdict}: final loss per trainer {', '.join(f'{x:.2f}' for x in losses)} (target < 10); "
        f"provision {t_provision:.1f}s, training {t_train:.1f}s, total {time.monotonic() - t_all:.1f}s"
    )
    return 0 if converged else 1


def add_cli(sub) -> None:
    """Register `clusterctl demo`."""
    p = sub.add_parser("demo", help="run the demo job on a local dockerized test cluster")
    p.set_defaults(func=cmd_demo)
