"""mpi4py's own test suite as a 2-host clusterctl job under launcher: ssh (clusterctl's PMI server) and
launcher: mpi (MPICH's hydra over the hosts' ssh mesh), alternating, timed; results compared.

The suite is the test/ directory of the sdist of the mpi4py version on the hosts (``pip download
--no-binary :all: --no-deps mpi4py==V``), unmodified; mpi4py's own ``-x`` leaves out testDistgraphcomm (it
hangs in MPICH's ch4:ucx whenever a rank's peer is on another node: docs/benchmarks.md, issue 26) and test_spawn's testNoArgs (its child script
lives in the spawning rank's /tmp, and hydra starts the child on the other host). Each run is
``clusterctl dispatch`` then ``clusterctl start --follow`` (timed: start to the job's end); the table gives
the medians and, per launcher, what unittest said on each rank.

usage: python benchmarks/pmi_suite.py CLUSTER_SPEC [--runs 3] [--python /opt/venv/bin/python]
       [--mpiexec /opt/venv/bin/mpiexec] [--port-base 7950]
CLUSTER_SPEC: a spec whose ssh section and first two hosts are used (e.g. the test cluster's cluster.yaml).
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import yaml

ENV = {"UCX_TLS": "tcp,self", "UCX_WARN_UNUSED_ENV_VARS": "n", "MPIR_CVAR_CH4_CMA_ENABLE": "0"}
EXCLUDE = ["-x", "test_comm_topo.*.testDistgraphcomm", "-x", "test_spawn.*.testNoArgs"]


def clusterctl(*args, timeout=1800) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "clusterctl.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout)


def remote_version(spec: Path, python: str) -> str:
    res = clusterctl("exec", spec, "--", python, "-c", "import mpi4py; print(mpi4py.__version__)", timeout=120)
    found = re.findall(r"\b(\d+\.\d+\.\d+)\b", res.stdout)
    if res.returncode or not found:
        raise SystemExit(f"cannot read mpi4py's version on the hosts: {res.stdout}{res.stderr}")
    return found[-1]


def suite_dir(version: str, work: Path) -> Path:
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
                    f"mpi4py=={version}", "-d", str(work), "-q"], check=True, timeout=300)
    with tarfile.open(work / f"mpi4py-{version}.tar.gz") as tar:
        tar.extractall(work, members=[m for m in tar.getmembers() if m.name.startswith(f"mpi4py-{version}/test/")],
                       filter="data")
    return work / f"mpi4py-{version}" / "test"


def write_spec(base: dict, work: Path, suite: Path, launcher: str, a) -> Path:
    job = {"mode": "collective", "launcher": launcher, "env": ENV, "args": EXCLUDE, "grace": 3,
           "ports": {"control": a.port_base, "master": a.port_base + 1, "trainer": a.port_base + 10}}
    hosts = base["hosts"][:2]
    if launcher == "ssh":
        job.update(entrypoint=[a.python, "-m", "clusterctl.collective", "main.py"], trainers=1)
    else:
        job.update(entrypoint=[a.python, "main.py"], mpiexec=a.mpiexec)
        hosts = [dict(h, slots=1) for h in hosts]
    spec = {"name": f"bench-m4p-{launcher}", "ssh": base["ssh"], "hosts": hosts,
            "workspace": {"local": str(suite), "remote": f"clusterctl-bench/m4p-{launcher}"}, "job": job}
    path = work / f"{launcher}.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def verdicts(out: str) -> list[str]:
    ran = re.findall(r"Ran (\d+) tests? in [\d.]+s", out)
    said = re.findall(r"^(?:\[[^\]]*\] )*(OK(?: \(.*\))?|FAILED \(.*\))\s*$", out, re.M)
    return sorted(f"{n} tests: {v}" for n, v in zip(ran, said))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("cluster_spec", type=Path)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--python", default="/opt/venv/bin/python")
    ap.add_argument("--mpiexec", default="/opt/venv/bin/mpiexec")
    ap.add_argument("--port-base", type=int, default=7950)
    a = ap.parse_args()
    base = yaml.safe_load(a.cluster_spec.read_text())
    with tempfile.TemporaryDirectory(prefix="pmi-suite-") as tmp:
        work = Path(tmp)
        probe = work / "probe.yaml"
        probe.write_text(yaml.safe_dump({"name": "bench-m4p-probe", "ssh": base["ssh"], "hosts": base["hosts"][:1],
                                         "workspace": {"local": str(work), "remote": "clusterctl-bench/probe"},
                                         "job": {"entrypoint": ["true"]}}))
        version = remote_version(probe, a.python)
        suite = suite_dir(version, work)
        specs = {launcher: write_spec(base, work, suite, launcher, a) for launcher in ("mpi", "ssh")}
        times: dict[str, list[float]] = {"mpi": [], "ssh": []}
        said: dict[str, set] = {"mpi": set(), "ssh": set()}
        for run in range(a.runs):
            for launcher, spec in specs.items():
                clusterctl("stop", spec)
                disp = clusterctl("dispatch", spec)
                if disp.returncode:
                    raise SystemExit(f"dispatch failed: {disp.stdout}{disp.stderr}")
                t0 = time.monotonic()
                res = clusterctl("start", spec, "--follow")
                took = time.monotonic() - t0
                v = verdicts(res.stdout + res.stderr)
                times[launcher].append(took)
                said[launcher].add(tuple(v))
                print(f"run {run + 1} launcher {launcher}: {took:.1f}s, exit {res.returncode}, {v}", flush=True)
        print(f"\nmpi4py {version} test suite, 2 hosts, 1 rank each, {a.runs} runs per launcher (alternating)\n")
        print("| launcher | median wall (s) | runs (s) | what unittest said on each rank |")
        print("| --- | --- | --- | --- |")
        for launcher in ("mpi", "ssh"):
            runs = ", ".join(f"{t:.0f}" for t in times[launcher])
            print(f"| {launcher} | {statistics.median(times[launcher]):.1f} | {runs} | "
                  f"{'; '.join(' / '.join(s) for s in sorted(said[launcher]))} |")
        print(f"\nratio ssh/mpi (medians): {statistics.median(times['ssh']) / statistics.median(times['mpi']):.2f}")
        return 0 if said["mpi"] == said["ssh"] else 1


if __name__ == "__main__":
    sys.exit(main())
