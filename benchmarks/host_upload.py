"""How fast `agent status` starts on a host, by how the host side is shipped (issue 14).

Runs each form locally with the host's interpreter (default /usr/bin/python3), interleaved, REPEAT rounds:

- package dir + bytecode: the host package as uploaded (clusterctl_host/ in a directory, __pycache__ kept
  beside it after the first run), run as an imported module with `python3 -S -E -c` (what hosttools runs);
- the same directory run as a plain `python3 .../agent.py` (no flags; agent.py compiled on every run);
- single file: the one-file agent.py of before the split (git show REV:clusterctl/agent.py), as it ran
  (`python3 agent-<hash>.py`), and with -S -E;
- zipapp: the package in a .pyz with a __main__ (zip imports keep no bytecode), with -S -E.

Usage: .venv/bin/python benchmarks/host_upload.py [--repeat 30] [--python /usr/bin/python3] [--rev b552d09]
Prints one table (median / min / max ms per form).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from clusterctl.ops import hosttools  # noqa: E402


def main() -> int:
    """Build the forms, time them interleaved, print the table."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=30)
    ap.add_argument("--python", default="/usr/bin/python3")
    ap.add_argument("--rev", default="b552d09", help="git revision whose clusterctl/agent.py is the single file")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="host-upload-"))
    try:
        pkg = work / "host-pkg"
        shutil.copytree(ROOT / "clusterctl" / "host", pkg / hosttools.HOST_PACKAGE,
                        ignore=shutil.ignore_patterns("__pycache__"))
        single = work / "agent-single.py"
        single.write_bytes(subprocess.run(["git", "-C", str(ROOT), "show", f"{args.rev}:clusterctl/agent.py"],
                                          capture_output=True, check=True).stdout)
        pyz = work / "host.pyz"
        with zipfile.ZipFile(pyz, "w") as z:
            for f in sorted((pkg / hosttools.HOST_PACKAGE).glob("*.py")):
                z.write(f, f"{hosttools.HOST_PACKAGE}/{f.name}")
            z.writestr("__main__.py", f"import sys\nfrom {hosttools.HOST_PACKAGE}.agent import main\nsys.exit(main())\n")
        jobdir = work / "jobs" / "bench"
        jobdir.mkdir(parents=True)
        procs = [{"role": r, "id": i, "pid": None, "state": "exited", "exit_code": 0, "started_at": 1.0,
                  "ended_at": 2.0, "log": f"/tmp/{r}.{i}.log", "error": None} for r, i in
                 [("pserver", 0), ("pserver", 1), ("trainer", 0), ("trainer", 1)]]
        (jobdir / "state.json").write_text(json.dumps({
            "job": "bench", "host": "h", "jobdir": str(jobdir), "state": "succeeded", "reason": "all 2 trainers exited 0",
            "supervisor": {"pid": os.getpid(), "start_ticks": None}, "processes": procs, "updated_at": 2.0}))
        run = hosttools._RUN
        py = args.python
        forms = {
            "package dir + bytecode (-S -E, imported)": [py, "-S", "-E", "-c", run, str(pkg), "agent", "status", str(jobdir)],
            "package dir, agent.py as a script (no flags)": [py, str(pkg / hosttools.HOST_PACKAGE / "agent.py"), "status", str(jobdir)],
            "single file (as before: no flags)": [py, str(single), "status", str(jobdir)],
            "single file (-S -E)": [py, "-S", "-E", str(single), "status", str(jobdir)],
            "zipapp (-S -E)": [py, "-S", "-E", str(pyz), "status", str(jobdir)],
        }
        for argv in forms.values():  # warm-up: writes the package's __pycache__, checks every form answers
            out = subprocess.run(argv, capture_output=True, text=True, check=False)
            reply = json.loads(out.stdout.strip().splitlines()[-1])
            assert reply.get("ok") and reply["state"] == "succeeded", (argv, out.stdout, out.stderr)
        times: dict[str, list[float]] = {k: [] for k in forms}
        for _ in range(args.repeat):
            for name, argv in forms.items():
                t0 = time.perf_counter()
                subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
                times[name].append((time.perf_counter() - t0) * 1000)
        version = subprocess.run([py, "--version"], capture_output=True, text=True).stdout.strip()
        print(f"{version}, {args.repeat} rounds interleaved, load average {os.getloadavg()[0]:.1f}")
        print("| form | median ms | min ms | max ms |\n| --- | ---: | ---: | ---: |")
        for name, ts in times.items():
            print(f"| {name} | {statistics.median(ts):.1f} | {min(ts):.1f} | {max(ts):.1f} |")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
