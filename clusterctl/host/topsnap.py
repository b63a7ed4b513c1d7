"""`agent top JOBDIR`: the job's status on this host plus what its processes use and how far they got.

The reply is `agent status`'s (clusterctl/host/jobdir.py `describe`) with, per process, `resources` (CPU %,
RSS and GPUs of its process tree: clusterctl/host/metrics.py) and `progress` (its last progress line, steps/s,
rate slices for the straggler rule: clusterctl/host/progressline.py), and the host's own figures under
`host_figures`. With `--progress-only` (what `clusterctl status` asks for) it reads the logs only: no /proc
scan, no nvidia-smi, no wait.

A one-shot command has no memory of its own, so the sampler's state (CPU ticks, log offsets, recent progress
points) is kept between calls in the job dir, `top-cache.json` (0600, written atomically, under a lock; a
damaged or missing one just starts afresh). A long-running process can skip the file: `reply(state, job,
sampler, ...)` is the whole command given a Sampler kept in memory, which is what the supervisor calls to
answer the same question over its control socket.
"""

import argparse
import fcntl
import json
import os
import tempfile
import time

from .common import UsageError, emit
from .jobdir import StateFileError, describe, job_from_dir, settled_state
from .jobfile import JOB_FILE
from .metrics import Sampler, dumps
from .progressline import STRAGGLER_SLICES, STRAGGLER_WINDOW_S

__all__ = ["targets", "reply", "cmd_top", "CACHE_FILE"]

CACHE_FILE = "top-cache.json"
LOCK_WAIT_S = 2.0  # another `agent top` holding the cache: wait this long, then go on without it
MAX_CACHE = 4 * 1024 * 1024


def _cuda_env(job):
    """{(role, id): CUDA_VISIBLE_DEVICES or None} from a job file (only that variable is read)."""
    shared = (job or {}).get("env") or {}
    out = {}
    for p in (job or {}).get("processes") or []:
        env = p.get("env") or {}
        value = env.get("CUDA_VISIBLE_DEVICES", shared.get("CUDA_VISIBLE_DEVICES"))
        out[(p.get("role"), p.get("id"))] = value if isinstance(value, str) else None
    return out


def targets(state, job=None):
    """The Sampler's targets for a state.json dict (and its job file, for each process's GPUs)."""
    cuda = _cuda_env(job)
    out = []
    for r in state.get("processes") or []:
        role, pid = r.get("role"), r.get("id")
        out.append({"key": "%s.%s" % (role, pid), "pid": r.get("pid") if r.get("state") == "running" else None,
                    "start_ticks": r.get("start_ticks"), "log": r.get("log"), "rank": str(pid),
                    "cuda_visible_devices": cuda.get((role, pid))})
    return out


def reply(state, job, sampler, progress_only=False, slice_s=None, slices=STRAGGLER_SLICES, wait=0.25, gpu=True,
          alive=None):
    """The `agent top` reply for a state.json dict, sampled with `sampler` (updated in place); `alive` as
    jobdir.describe takes it."""
    t0, c0 = time.monotonic(), time.process_time()
    out = describe(state, alive=alive)
    tg = targets(state, job)
    slice_s = STRAGGLER_WINDOW_S / slices if slice_s is None else slice_s
    try:
        prog = sampler.progress(tg, slice_s=slice_s, slices=slices)
        res, host = ({}, None) if progress_only else sampler.resources(tg, wait=wait, gpu=gpu)
    except OSError as e:  # a sample that cannot be taken is not a status that cannot be given
        prog, res, host = {}, {}, None
        out["top_error"] = "sampling failed: %s" % (e.strerror or e)
    for p, t in zip(out["processes"], tg):
        entry = prog.get(t["key"]) or {}
        views = [entry.get("progress")] + list(entry.get("ranks") or [])
        if p.get("state") != "running":  # its last step stays; a rate is for a process that runs
            for v in views:
                if v is not None:
                    v["rate"] = None
                    v.pop("slices", None)
        p["progress"] = entry.get("progress")
        if entry.get("ranks"):
            p["ranks"] = entry["ranks"]
        if not progress_only:
            p["resources"] = res.get(t["key"])
    if host is not None:
        out["host_figures"] = host
    out["sample"] = {"t": time.time(), "slice_s": slice_s, "slices": slices,
                     "wall_s": round(time.monotonic() - t0, 4), "cpu_s": round(time.process_time() - c0, 4)}
    return out


def _load(jobdir):
    """The Sampler kept in the job dir; a fresh one when there is none or it cannot be read."""
    try:
        with open(os.path.join(jobdir, CACHE_FILE), "rb") as f:
            data = f.read(MAX_CACHE + 1)
        if len(data) > MAX_CACHE:
            return Sampler()
        d = json.loads(data.decode("utf-8"))
    except (OSError, ValueError, UnicodeDecodeError, RecursionError):
        return Sampler()
    return Sampler.from_json(d) if isinstance(d, dict) else Sampler()


def _save(jobdir, sampler):
    fd, tmp = tempfile.mkstemp(prefix=".tmp-top-", dir=jobdir)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(dumps(sampler.to_json()))
        os.replace(tmp, os.path.join(jobdir, CACHE_FILE))
    except OSError:
        try:
            os.unlink(tmp)
        except OSError:
            pass


def _lock(jobdir):
    """An exclusive lock on the cache (a file descriptor), or None after LOCK_WAIT_S or where there is none."""
    try:
        fd = os.open(os.path.join(jobdir, CACHE_FILE + ".lock"), os.O_RDWR | os.O_CREAT, 0o600)
    except OSError:
        return None
    deadline = time.monotonic() + LOCK_WAIT_S
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except OSError:
            if time.monotonic() > deadline:
                os.close(fd)
                return None
            time.sleep(0.02)


def _job_file(jobdir):
    try:
        with open(os.path.join(jobdir, JOB_FILE), "rb") as f:
            job = json.loads(f.read().decode("utf-8"))
    except (OSError, ValueError, UnicodeDecodeError, RecursionError):
        return None
    return job if isinstance(job, dict) else None


def cmd_top(args):
    """Print the job's state on this host with each process's resources and progress."""
    args = parse_args(args.args)
    jobdir = os.path.abspath(args.jobdir)
    try:
        state, job = job_from_dir(jobdir)
    except StateFileError as e:  # as `agent status` says it
        emit({"ok": False, "state": "unknown", "jobdir": jobdir, "processes": [], "job": None,
              "error": str(e), "reason": str(e)})
        return 2
    if state is None:
        emit({"ok": False, "state": "unknown", "jobdir": jobdir, "processes": [],
              "job": job["job"] if job else None,
              "error": "no job state in %s (never launched here?)" % jobdir})
        return 1
    job = _job_file(jobdir)
    lock = _lock(jobdir)
    sampler = Sampler()
    try:
        if lock is not None:
            sampler = _load(jobdir)
        out = reply(settled_state(jobdir, state), job, sampler, progress_only=args.progress_only,
                    slice_s=args.slice, slices=args.slices, wait=args.wait, gpu=not args.no_gpu)
        if lock is not None:
            _save(jobdir, sampler)
    finally:
        if lock is not None:
            os.close(lock)
    emit(out)
    return 0


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise UsageError("%s: %s" % (self.prog, message))


def parse_args(argv):
    """`agent top`'s own options (agent.py hands it everything after `top`)."""
    p = _Parser(prog="agent.py top", description="job state, each process's resources and progress")
    p.add_argument("jobdir")
    p.add_argument("--progress-only", action="store_true", help="progress from the logs only (what status shows)")
    p.add_argument("--slice", type=float, default=None, help="seconds per rate slice (straggler rule)")
    p.add_argument("--slices", type=int, default=STRAGGLER_SLICES, help="rate slices reported per rank")
    p.add_argument("--wait", type=float, default=0.25, help="seconds between two samples when there is no earlier one")
    p.add_argument("--no-gpu", action="store_true", help="do not ask nvidia-smi")
    args = p.parse_args(argv)
    if args.slices < 0 or args.slices > 60 or (args.slice is not None and not 0.5 <= args.slice <= 600):
        raise UsageError("agent.py top: --slices must be 0..60 and --slice 0.5..600 seconds")
    if not 0 <= args.wait <= 5:
        raise UsageError("agent.py top: --wait must be 0..5 seconds")
    return args
