#!/usr/bin/env python3
"""Cold and warm `clusterctl validate` / `plan` of a big fleet named through an ssh config (issue 23 part 3).

Writes a spec of H hosts (`node-0000`, ... named by an ssh config that gives them HostNames, a bastion,
a user and options per pattern, as a fleet's config does) with G GPUs each, then runs each command in a
fresh process (`python -m clusterctl.cli`, from --src and, side by side, from --compare-src), cold (an
empty cache directory: no `ssh -G` answer and no plan kept) and warm (the same command again), with the
runs interleaved. Reports medians of wall time and CPU time (user+sys of the command and the `ssh -G`
processes it waited for), and how many `ssh` processes a cold and a warm run start (counted in one more,
untimed, round by an `ssh` wrapper first on PATH).

    .venv/bin/python benchmarks/plan_cold.py --hosts 1250 --repeat 5
    git archive main | tar -x -C /tmp/before
    .venv/bin/python benchmarks/plan_cold.py --hosts 1250 --compare-src /tmp/before --repeat 3
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

SSH_CONFIG = """\
# a fleet's ssh config: a bastion, nodes given HostNames by pattern, options for every host
Host bastion
    HostName 192.0.2.10
    User ops
    Port 2200
Host node-0*
    HostName %h.rack0.example
Host node-1* node-2*
    HostName %h.rack1.example
Host node-* !node-0000
    User train
    ProxyJump bastion
    IdentityFile ~/.ssh/fleet_ed25519
Host *.example
    ServerAliveInterval 30
Host *
    ConnectTimeout 10
    HashKnownHosts no
"""

_BOOT = """import runpy, sys
sys.meta_path[:] = [f for f in sys.meta_path if not getattr(f, "__module__", "").startswith("__editable__")]
sys.path.insert(0, sys.argv[1])
sys.argv[:] = ["clusterctl", *sys.argv[2:]]
runpy.run_module("clusterctl.cli", run_name="__main__")
"""

# an `ssh` first on PATH that counts its runs, then runs the real one
_COUNTING_SSH = """#!/bin/sh
echo >> "$CLUSTERCTL_BENCH_SSH_COUNT"
exec {ssh} "$@"
"""


def spec_text(hosts: int, gpus: int, pservers: int) -> str:
    """A pserver-mode spec naming `hosts` hosts through the ssh config beside it."""
    lines = ["name: fleet", "ssh:", "  config: ssh_config", "hosts:"]
    lines += [f"  - {{address: node-{i:04d}, gpus: {gpus}}}" for i in range(hosts)]
    lines += ["job:", "  mode: pserver", f"  pservers: {pservers}", "  trainers: gpu", "  entrypoint: python train.py", ""]
    return "\n".join(lines)


def run_once(argv: list[str], env: dict) -> tuple[float, float]:
    """(wall s, CPU s of the command and every process it waited for)."""
    before = os.times()
    t0 = time.perf_counter()
    proc = subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, env=env)
    wall = time.perf_counter() - t0
    after = os.times()
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(argv[3:])} exited {proc.returncode}: {proc.stderr.decode()[-500:]}")
    return wall, (after.children_user - before.children_user) + (after.children_system - before.children_system)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hosts", type=int, default=1250)
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--pservers", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--src", default=str(ROOT), help="the checkout to time (default: this one)")
    ap.add_argument("--compare-src", help="another checkout, timed side by side (e.g. main unpacked)")
    ap.add_argument("--commands", default="validate,plan")
    args = ap.parse_args()

    real_ssh = shutil.which("ssh")
    if real_ssh is None:
        raise SystemExit("needs the OpenSSH client")
    srcs = {"ours": Path(args.src).resolve()}
    if args.compare_src:
        srcs["compare"] = Path(args.compare_src).resolve()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        (work / "bin").mkdir()
        (work / "bin" / "ssh").write_text(_COUNTING_SSH.format(ssh=real_ssh))
        (work / "bin" / "ssh").chmod(0o755)
        (work / "fleet").mkdir()  # the spec and its ssh config, alone (nothing else changes beside them)
        (work / "fleet" / "ssh_config").write_text(SSH_CONFIG)
        spec = work / "fleet" / "fleet.yaml"
        spec.write_text(spec_text(args.hosts, args.gpus, args.pservers))
        count = work / "ssh-count"
        base_env = {**os.environ, "COLUMNS": "200"}
        counting = {**base_env, "PATH": f"{work / 'bin'}{os.pathsep}{os.environ['PATH']}",
                    "CLUSTERCTL_BENCH_SSH_COUNT": str(count)}
        print(f"spec: {args.hosts} hosts x {args.gpus} GPUs named through an ssh config; {args.repeat} rounds, "
              f"interleaved; medians (wall s / CPU s / ssh runs)")
        for name, src in srcs.items():  # compile once: an installed package has its bytecode
            subprocess.run([sys.executable, "-m", "compileall", "-q", str(src / "clusterctl")], check=True,
                           stdout=subprocess.DEVNULL)
        rows: dict[tuple, list] = {}
        for round_ in range(args.repeat + 1):  # the last round counts ssh runs, untimed
            for cmd in args.commands.split(","):
                for name, src in srcs.items():
                    cache = work / f"cache-{name}"
                    shutil.rmtree(cache, ignore_errors=True)
                    env = {**(counting if round_ == args.repeat else base_env), "XDG_CACHE_HOME": str(cache)}
                    argv = [sys.executable, "-c", _BOOT, str(src), *cmd.split(), str(spec)]
                    for state in ("cold", "warm"):
                        count.write_text("")
                        wall, cpu = run_once(argv, env)
                        if round_ == args.repeat:
                            rows[(cmd, name, state)].append(len(count.read_text().splitlines()))
                        else:
                            rows.setdefault((cmd, name, state), []).append((wall, cpu))
        print(f"{'command':<12} {'code':<8} {'state':<5} {'wall s':>7} {'(min-max)':>12} {'CPU s':>6} {'ssh runs':>9}")
        for (cmd, name, state), runs in rows.items():
            ssh_runs, runs = runs[-1], runs[:-1]
            walls = [r[0] for r in runs]
            print(f"{cmd:<12} {name:<8} {state:<5} {statistics.median(walls):>7.2f} {min(walls):>5.2f}-{max(walls):<6.2f} "
                  f"{statistics.median(r[1] for r in runs):>6.2f} {ssh_runs:>9}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
