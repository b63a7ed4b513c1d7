#!/usr/bin/env python3
"""Plan scale: `clusterctl validate`, `plan --json` and `plan` on a spec of H hosts x G GPUs.

Writes the spec (one trainer per GPU, `pservers: P` in pserver mode, `ssh: {config: none}` so that
no `ssh -G` runs per host), then runs each command N times in a fresh process (`python -m clusterctl.cli`, from --src)
and reports the median wall time and CPU time (user+sys), the peak RSS of the child (ru_maxrss from
wait4) and the bytes it printed. `job-files` builds every host's job file as `start` does (plan, then
clusterctl.ops.job.job_files, then JSON), without sending them: its stdout is the files' sizes, one line
each; the table shows their total.

    .venv/bin/python benchmarks/plan_scale.py [--hosts 1250] [--gpus 8] [--pservers 16] [--repeat 5]
    .venv/bin/python benchmarks/plan_scale.py --write-spec /tmp/plan10k.yaml   # only write the spec
    git archive OLD | tar -x -C /tmp/old && .venv/bin/python benchmarks/plan_scale.py --src /tmp/old --no-ssh-config-key
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def spec_text(hosts: int, gpus: int, pservers: int, *, ssh_config_key: bool = True) -> str:
    """The YAML of a pserver-mode spec with `hosts` hosts of `gpus` GPUs each (addresses 10.x.y.z)."""
    lines = ["name: scale", "ssh:", "  user: train"]
    if ssh_config_key:
        lines.append("  config: none")
    lines.append("hosts:")
    for i in range(hosts):
        lines.append(f"  - {{address: 10.{(i >> 16) & 255}.{(i >> 8) & 255}.{i & 255}, gpus: {gpus}}}")
    lines += [
        "job:",
        "  mode: pserver",
        f"  pservers: {pservers}",
        "  trainers: gpu",
        "  entrypoint: python train.py",
        "  args: ['--epochs', '10']",
        "  env: {GLOG_v: 0, NCCL_DEBUG: WARN}",
        "",
    ]
    return "\n".join(lines)


# `python -m clusterctl.cli` from the checkout `src`: an editable install's import hook would otherwise
# load this checkout's clusterctl whatever PYTHONPATH says.
_BOOT = """import runpy, sys
sys.meta_path[:] = [f for f in sys.meta_path if not getattr(f, "__module__", "").startswith("__editable__")]
sys.path.insert(0, sys.argv[1])
sys.argv[:] = ["clusterctl", *sys.argv[2:]]
runpy.run_module("clusterctl.cli", run_name="__main__")
"""

# `job-files SPEC`: what `start` builds and sends: every host's job file as JSON (printed: their sizes).
_JOB_FILES = """import json, sys
sys.meta_path[:] = [f for f in sys.meta_path if not getattr(f, "__module__", "").startswith("__editable__")]
sys.path.insert(0, sys.argv[1])
from clusterctl.ops import plan_for
from clusterctl.ops.job import job_files
from clusterctl.spec import load_spec
plan = plan_for(load_spec(sys.argv[3]))
files = job_files(plan, {h: "/home/train" for h in plan.hosts}, "0" * 32)
sys.stdout.write("".join(str(len(json.dumps(f))) + "\\n" for f in files.values()))
"""


def run_once(argv: list[str], env: dict) -> tuple[float, float, int, int, bytes]:
    """Run `argv`; return (wall s, CPU s (user+sys), peak RSS bytes of the child, bytes it printed, its first MiB)."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, env=env)
    size, head = 0, b""
    while chunk := proc.stdout.read(1 << 20):  # counted, not kept: the old plan --json printed 1.57 GB
        head = head or chunk
        size += len(chunk)
    stderr = proc.stderr.read().decode(errors="replace")
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    proc.stdout.close()
    proc.stderr.close()
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} exited {proc.returncode}: {stderr[-500:]}")
    return wall, usage.ru_utime + usage.ru_stime, usage.ru_maxrss * 1024, size, head


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hosts", type=int, default=1250)
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--pservers", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--write-spec", metavar="PATH", help="write the spec there and exit")
    ap.add_argument("--no-ssh-config-key", action="store_true", help="leave out ssh.config (specs before issue 11)")
    ap.add_argument("--src", help="the checkout whose clusterctl to run (default: this one), e.g. an older version")
    ap.add_argument("--commands", default="validate,plan --json,plan,job-files",
                    help="comma-separated clusterctl subcommands to time (default: %(default)s)")
    args = ap.parse_args()

    text = spec_text(args.hosts, args.gpus, args.pservers, ssh_config_key=not args.no_ssh_config_key)
    if args.write_spec:
        Path(args.write_spec).write_text(text)
        return 0
    src = Path(args.src).resolve() if args.src else ROOT
    env = {**os.environ, "COLUMNS": "200"}
    with tempfile.TemporaryDirectory() as tmp:
        spec = Path(tmp) / "scale.yaml"
        spec.write_text(text)
        print(f"clusterctl from {src}; spec: {args.hosts} hosts x {args.gpus} GPUs, {args.pservers} pservers "
              f"({args.hosts * args.gpus} trainers), {len(text)} bytes; {args.repeat} runs each; medians")
        print(f"{'command':<28} {'wall s':>7} {'(min-max)':>11} {'CPU s':>6} {'peak RSS MB':>12} {'stdout bytes':>14}")
        for cmd in args.commands.split(","):
            sub = cmd.split()
            boot = _JOB_FILES if sub[0] == "job-files" else _BOOT
            argv = [sys.executable, "-c", boot, str(src), sub[0], str(spec), *sub[1:]]
            runs = [run_once(argv, env) for _ in range(args.repeat)]
            walls = [r[0] for r in runs]
            label = "job files (start)" if cmd == "job-files" else f"clusterctl {cmd}"
            print(f"{label:<28} {statistics.median(walls):>7.2f} {min(walls):>5.2f}-{max(walls):<5.2f} "
                  f"{statistics.median(r[1] for r in runs):>6.2f} {statistics.median(r[2] for r in runs) / 1e6:>12.0f} "
                  f"{runs[0][3] if cmd != 'job-files' else sum(map(int, runs[0][4].split())):>14,}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
