"""A fake Slurm for unit tests of backend: slurm over fake hosts: sbatch, srun, scontrol, sacct, scancel, sinfo.

`install(bin_dir, state_dir, root, nodes)` writes the tools into a fake hosts' bin directory (tests/unit/
fakehosts.py). Each fake node is a fake host: node i is reached at 127.0.0.<i+1>, its home is
``root/127.0.0.<i+1>`` (where LocalTransport runs that host's commands). `sbatch` runs the script for real,
in the background, as the batch step on node 0 (its output where `#SBATCH --output` says); `srun` runs its
command once per node (``SLURMD_NODENAME``, ``SLURM_PROCID``, that node's HOME; with ``--input=all`` each
task gets the whole stdin; ``--distribution=arbitrary`` puts task i on the i-th node of ``--nodelist``, as the
real one does; ``--label`` starts every line a task prints with its number, zero-padded as srun's ``%0*d: ``,
a task's lines cut at 1024 bytes and an unfinished last one ended, each piece labelled, as slurmstepd does);
`scancel` SIGTERMs every process group the job started,
then SIGKILLs after a kill wait. A job waits in PENDING while ``state_dir/hold`` exists; while
``state_dir/down`` exists every tool fails as when slurmctld cannot be reached. Jobs are JSON files
under ``state_dir/jobs``; every change is made under a lock.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

__all__ = ["install", "FIRST_JOB"]

FIRST_JOB = 4242
KILL_WAIT = 2.0
LIVE = ("PENDING", "RUNNING")


def install(bin_dir: Path, state: Path, root: Path, nodes: int, *, allocate: int | None = None) -> dict:
    """Write sbatch/srun/... into bin_dir; return the fake cluster's config."""
    state.mkdir(parents=True, exist_ok=True)
    (state / "jobs").mkdir(exist_ok=True)
    names = [f"node{i + 1}" for i in range(nodes)]
    config = {"nodes": names, "addrs": {n: f"127.0.0.{i + 1}" for i, n in enumerate(names)}, "root": str(root),
              "allocate": allocate or nodes}
    (state / "config.json").write_text(json.dumps(config))
    bin_dir.mkdir(parents=True, exist_ok=True)
    for tool in ("sbatch", "srun", "scontrol", "sacct", "scancel", "sinfo"):
        path = bin_dir / tool
        path.write_text(f'#!/bin/sh\nexec python3 {Path(__file__).resolve()} {state} {tool} "$@"\n')
        path.chmod(0o755)
    return config


class Fake:
    def __init__(self, state: str):
        self.state = Path(state)
        self.config = json.loads((self.state / "config.json").read_text())

    @contextmanager
    def locked(self):
        with open(self.state / ".lock", "w") as fh:
            fcntl.flock(fh, fcntl.LOCK_EX)
            yield

    def job(self, job_id) -> dict | None:
        path = self.state / "jobs" / f"{job_id}.json"
        return json.loads(path.read_text()) if path.exists() else None

    def save(self, job: dict) -> None:
        path = self.state / "jobs" / f"{job['id']}.json"
        path.with_suffix(".tmp").write_text(json.dumps(job))
        os.replace(path.with_suffix(".tmp"), path)

    def update(self, job_id, **changes) -> dict:
        with self.locked():
            job = self.job(job_id)
            job.update(changes)
            self.save(job)
            return job

    def home(self, node: str) -> str:
        path = os.path.join(self.config["root"], self.config["addrs"][node])
        os.makedirs(path, exist_ok=True)  # as LocalTransport makes a fake host's home on first use
        return path

    # ---------------------------------------------------------------------------------------- tools

    def sbatch(self, args: list[str]) -> int:
        script = sys.stdin.read()
        opts = dict(m.groups() for m in re.finditer(r"^#SBATCH --([\w-]+)=(\S+)$", script, re.MULTILINE))
        with self.locked():
            ids = [int(p.stem) for p in (self.state / "jobs").glob("*.json")]
            job_id = max(ids, default=FIRST_JOB - 1) + 1
            n = min(int(opts.get("nodes", "1")), self.config["allocate"])
            path = self.state / f"script-{job_id}.sh"
            path.write_text(script)
            self.save({"id": job_id, "state": "PENDING", "exit_code": "0:0", "nodes": self.config["nodes"][:n],
                       "opts": opts, "pgids": [], "cancelled": False, "name": opts.get("job-name", "")})
        with open(self.state / f"run-{job_id}.err", "wb") as err:  # the fake's own failures, for the test's reader
            subprocess.Popen([sys.executable, __file__, str(self.state), "_run", str(job_id)], start_new_session=True,
                             stdin=subprocess.DEVNULL, stdout=err, stderr=err)
        print(job_id)
        return 0

    def _run(self, args: list[str]) -> int:
        """The batch step: wait while held, run the script on node 0, record how it ended."""
        job_id = int(args[0])
        while (self.state / "hold").exists() and not self.job(job_id)["cancelled"]:
            time.sleep(0.1)
        job = self.job(job_id)
        if job["cancelled"]:
            self.update(job_id, state="CANCELLED", exit_code="0:0")
            return 0
        node = job["nodes"][0]
        home = self.home(node)
        output = job["opts"].get("output", "slurm-%j.out").replace("%j", str(job_id)).replace("%%", "%")
        env = dict(os.environ, HOME=home, SLURM_JOB_ID=str(job_id), SLURM_JOB_NODELIST=",".join(job["nodes"]),
                   SLURMD_NODENAME=node, SLURM_NNODES=str(len(job["nodes"])),
                   SLURM_CPUS_PER_TASK=job["opts"].get("cpus-per-task", "1"))
        with open(os.path.join(home, output), "ab") as out:
            proc = subprocess.Popen(["bash", str(self.state / f"script-{job_id}.sh")], cwd=home, env=env,
                                    stdin=subprocess.DEVNULL, stdout=out, stderr=out, start_new_session=True)
        with self.locked():
            job = self.job(job_id)
            if job["cancelled"]:
                os.killpg(proc.pid, signal.SIGKILL)
            job.update(state="RUNNING", pgids=job["pgids"] + [proc.pid], batch=proc.pid, ran=True)
            self.save(job)
        rc = proc.wait()
        with self.locked():
            job = self.job(job_id)
            state = "CANCELLED" if job["cancelled"] else ("COMPLETED" if rc == 0 else "FAILED")
            job.update(state=state, exit_code=f"{rc if rc >= 0 else 128 - rc}:0")
            self.save(job)
        return 0

    def scancel(self, args: list[str]) -> int:
        job_id = args[-1]
        with self.locked():
            job = self.job(job_id)
            if job is None:
                print(f"scancel: error: Invalid job id {job_id}", file=sys.stderr)
                return 1
            if job["state"] not in LIVE:
                return 0
            job["cancelled"] = True
            self.save(job)
        self._signal(job_id, signal.SIGTERM)
        deadline = time.monotonic() + KILL_WAIT
        while self.job(job_id)["state"] in LIVE and time.monotonic() < deadline:
            time.sleep(0.1)
        self._signal(job_id, signal.SIGKILL)
        return 0

    def _signal(self, job_id, sig) -> None:
        for pgid in self.job(job_id)["pgids"]:
            try:
                os.killpg(pgid, sig)
            except (ProcessLookupError, PermissionError):
                pass

    def srun(self, args: list[str]) -> int:
        opts, i = {}, 0
        while i < len(args) and args[i].startswith("-"):
            key, _, value = args[i].lstrip("-").partition("=")
            opts[key] = value
            i += 1
        command = args[i:]
        job_id = opts.get("jobid") or os.environ.get("SLURM_JOB_ID")
        job = self.job(job_id)
        if job is None or job["state"] != "RUNNING":
            print(f"srun: error: Unable to create step for job {job_id}: Job/step already completing or completed",
                  file=sys.stderr)
            return 1
        nodes = job["nodes"][:int(opts.get("nodes", len(job["nodes"])))]
        if opts.get("distribution") == "arbitrary":  # task i on the i-th node of --nodelist (srun.1, -m arbitrary)
            nodes = [n for n in opts.get("nodelist", "").split(",") if n]
            if not nodes or any(n not in job["nodes"] for n in nodes):
                print(f"srun: error: Unable to create step for job {job_id}: Requested node configuration is not "
                      "available", file=sys.stderr)
                return 1
        data = sys.stdin.buffer.read() if opts.get("input") == "all" else None
        procs = []
        for rank, node in enumerate(nodes):
            env = dict(os.environ, HOME=self.home(node), SLURMD_NODENAME=node, SLURM_PROCID=str(rank),
                       SLURM_NODEID=str(rank), SLURM_JOB_ID=str(job_id))
            p = subprocess.Popen(command, cwd=opts.get("chdir") or self.home(node), env=env,
                                 stdin=subprocess.PIPE if data is not None else subprocess.DEVNULL,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
            procs.append((rank, p))
        with self.locked():
            job = self.job(job_id)
            job["pgids"] += [p.pid for _, p in procs]
            self.save(job)
        signal.signal(signal.SIGTERM, lambda s, f: [_killpg(p.pid, s) for _, p in procs])
        lock = threading.Lock()

        width = len(str(max(len(nodes) - 1, 0)))

        def pump(rank, stream, out):
            label = "label" in opts
            for line in iter(lambda: stream.readline(1024) if label else stream.readline(), b""):
                with lock:  # slurmstepd: a line at most 1024 bytes, labelled and ended whether or not it ended
                    out.write(f"{rank:0{width}d}: ".encode() + line.rstrip(b"\n") + b"\n" if label else line)
                    out.flush()

        threads = []
        for rank, p in procs:
            if data is not None:
                threading.Thread(target=_feed, args=(p.stdin, data), daemon=True).start()
            for stream, out in ((p.stdout, sys.stdout.buffer), (p.stderr, sys.stderr.buffer)):
                t = threading.Thread(target=pump, args=(rank, stream, out))
                t.start()
                threads.append(t)
        codes = [p.wait() for _, p in procs]
        for t in threads:
            t.join()
        return max((c if c >= 0 else 128 - c for c in codes), default=0)

    def scontrol(self, args: list[str]) -> int:
        words = [a for a in args if not a.startswith("--")]
        if words[:2] == ["show", "hostnames"]:
            print("\n".join(n for n in words[2].split(",") if n))
            return 0
        if words[:2] == ["show", "node"]:
            for n in words[2].split(","):
                print(f"NodeName={n} Arch=x86_64 NodeAddr={self.config['addrs'][n]} State=IDLE")
            return 0
        if words[:2] == ["show", "job"]:
            job = self.job(words[2])
            if job is None or (self.state / "forget").exists():
                print("slurm_load_jobs error: Invalid job id specified", file=sys.stderr)
                return 1
            nodes = ",".join(job["nodes"]) if job.get("ran") else "(null)"  # as Slurm: none before the allocation
            print(f"JobId={job['id']} JobName={job['name']} JobState={job['state']} Reason=None "
                  f"ExitCode={job['exit_code']} NodeList={nodes} BatchHost={job['nodes'][0] if job.get('ran') else ''}")
            return 0
        print(f"scontrol: unknown {args}", file=sys.stderr)
        return 1

    def sacct(self, args: list[str]) -> int:
        job = self.job(args[args.index("-j") + 1])
        if job is not None and not (self.state / "forget-sacct").exists():
            print(f"{job['state']}|{job['exit_code']}|{','.join(job['nodes']) if job.get('ran') else 'None assigned'}")
        return 0

    def sinfo(self, args: list[str]) -> int:
        for n in self.config["nodes"]:
            print(f"{n} {self.config['addrs'][n]}")
        return 0


def _killpg(pgid: int, sig) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _feed(pipe, data: bytes) -> None:
    try:
        pipe.write(data)
        pipe.close()
    except BrokenPipeError:
        pass


DOWN = {"scontrol": "slurm_load_jobs error: Unable to contact slurm controller (connect failure)",
        "sacct": "sacct: error: Problem talking to the database: Connection refused"}


if __name__ == "__main__":
    fake = Fake(sys.argv[1])
    tool = sys.argv[2]
    if tool != "_run" and (fake.state / "down").exists():  # slurmctld (and the accounting database) unreachable
        print(DOWN.get(tool, f"{tool}: error: Unable to contact slurm controller (connect failure)"), file=sys.stderr)
        sys.exit(1)
    sys.exit(getattr(fake, tool)(sys.argv[3:]))
