"""Sampling a job's processes on one host: CPU and memory from /proc, GPUs from nvidia-smi, progress from logs.

Everything `clusterctl top` shows, and the progress `clusterctl status` shows, is measured here, in layers:

- pure functions over text (a /proc stat line, /proc/meminfo, nvidia-smi's CSV) unit-tested with fixture text;
  the progress line, rates and the straggler rule are in clusterctl/host/progressline.py;
- `Sampler`: what a sample needs from the one before it (CPU ticks per process tree, each log's read offset
  and its recent progress points). It serialises to a small JSON document (`to_json`/`from_json`), so a
  one-shot command (`agent top`, clusterctl/host/topsnap.py) keeps it in the job dir between calls, and a
  long-running process (the supervisor) can keep the object in memory;
- the bounded effects: one pass over /proc per sample, one nvidia-smi call per query with a deadline, at
  most progressline.MAX_READ new bytes of each log per sample.

Stdlib only, Python 3.9 (the host package).
"""

import json
import os
import shutil
import subprocess
import threading
import time

from .progressline import LogProgress, rank_order

__all__ = ["parse_stat", "scan_procs", "tree_of", "parse_meminfo", "parse_cpu_line", "parse_gpu_csv",
           "parse_apps_csv", "query_gpus", "visible_devices", "Sampler", "GpuWatch", "dumps"]

# -- bounds ----------------------------------------------------------------------------------------------------
GPU_TIMEOUT_S = 2.0  # nvidia-smi deadline per query
GPU_MAX_OUTPUT = 64 * 1024
BASELINE_MAX_AGE_S = 30.0  # a CPU baseline older than this is taken again

_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096

GPU_QUERY = ["--query-gpu=index,uuid,utilization.gpu,memory.used,memory.total", "--format=csv,noheader,nounits"]
APPS_QUERY = ["--query-compute-apps=pid,gpu_uuid,used_memory", "--format=csv,noheader,nounits"]


# ============================================================================================ /proc (pure parts)

def parse_stat(data):
    """/proc/<pid>/stat bytes -> (state, ppid, pgid, cpu ticks with reaped children's, start ticks, rss pages), or None."""
    try:
        rest = data[data.rindex(b")") + 2:].split()
        ticks = int(rest[11]) + int(rest[12]) + int(rest[13]) + int(rest[14])
        return (rest[0].decode("ascii", "replace"), int(rest[1]), int(rest[2]), ticks, int(rest[19]), int(rest[21]))
    except (ValueError, IndexError):
        return None


def scan_procs(proc="/proc"):
    """{pid: parse_stat(...)} of every process now (one pass over /proc; unreadable ones left out)."""
    try:
        names = os.listdir(proc)
    except OSError:
        return {}
    out = {}
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open("%s/%s/stat" % (proc, name), "rb") as f:
                st = parse_stat(f.read())
        except OSError:
            continue
        if st is not None:
            out[int(name)] = st
    return out


def tree_of(procs, pid, start_ticks=None, children=None):
    """The pids of `pid`'s process tree in a scan: its process group and its descendants (pure); [] when the
    process is gone or its start time is not `start_ticks` (the pid was reused)."""
    me = procs.get(pid)
    if me is None or (start_ticks is not None and me[4] != start_ticks):
        return []
    if children is None:
        children = _children(procs)
    seen = {pid}
    todo = [pid]
    while todo:
        for c in children.get(todo.pop(), ()):
            if c not in seen:
                seen.add(c)
                todo.append(c)
    pgid = me[2]
    if pgid == pid:  # a group leader (the supervisor starts each process in a session of its own)
        seen.update(p for p, st in procs.items() if st[2] == pgid)
    return sorted(seen)


def _children(procs):
    kids = {}
    for p, st in procs.items():
        kids.setdefault(st[1], []).append(p)
    return kids


def parse_meminfo(text):
    """/proc/meminfo text -> {MemTotal, MemAvailable, ...} in bytes."""
    out = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            out[key.strip()] = int(parts[0]) * (1024 if len(parts) > 1 and parts[1] == "kB" else 1)
    return out


def parse_cpu_line(text):
    """The first line of /proc/stat -> (busy ticks, total ticks) of the whole machine, or None."""
    first = text.split("\n", 1)[0].split()
    if not first or first[0] != "cpu":
        return None
    try:
        vals = [int(x) for x in first[1:]]
    except ValueError:
        return None
    total = sum(vals[:8])  # user nice system idle iowait irq softirq steal (guest is inside user)
    idle = vals[3] + (vals[4] if len(vals) > 4 else 0)
    return total - idle, total


def _read_text(path, limit=65536):
    try:
        with open(path, "rb") as f:
            return f.read(limit).decode("ascii", "replace")
    except OSError:
        return ""


# ============================================================================================ GPUs

def _num(text):
    """nvidia-smi's field -> float, or None for '[N/A]', '[Not Supported]', '' and the like."""
    text = text.strip()
    try:
        v = float(text)
    except ValueError:
        return None
    return v if v == v and abs(v) != float("inf") else None


def parse_gpu_csv(text):
    """`nvidia-smi --query-gpu=index,uuid,utilization.gpu,memory.used,memory.total --format=csv,noheader,nounits`
    -> [{index, uuid, util_pct, mem_used_mib, mem_total_mib}] (rows that do not parse are skipped)."""
    gpus = []
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 5 or not parts[0].isdigit():
            continue
        gpus.append({"index": int(parts[0]), "uuid": parts[1][:96], "util_pct": _num(parts[2]),
                     "mem_used_mib": _num(parts[3]), "mem_total_mib": _num(parts[4])})
    return gpus


def parse_apps_csv(text):
    """`nvidia-smi --query-compute-apps=pid,gpu_uuid,used_memory --format=csv,noheader,nounits`
    -> [{pid, gpu_uuid, used_mib}] (a GPU without processes prints nothing, or a 'No running...' line)."""
    apps = []
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 3 or not parts[0].isdigit():
            continue
        apps.append({"pid": int(parts[0]), "gpu_uuid": parts[1][:96], "used_mib": _num(parts[2])})
    return apps


def _run_bounded(argv, timeout):
    """(stdout text, error or None) of a short command with a deadline and a cap on what is read."""
    try:
        res = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             timeout=timeout)
    except subprocess.TimeoutExpired:
        return "", "%s did not answer within %gs" % (os.path.basename(argv[0]), timeout)
    except OSError as e:
        return "", "cannot run %s: %s" % (argv[0], e.strerror or e)
    if res.returncode != 0:
        why = res.stderr.decode("utf-8", "replace").strip().splitlines() or ["exit %d" % res.returncode]
        return "", "%s: %s" % (os.path.basename(argv[0]), why[-1][:200])
    return res.stdout[:GPU_MAX_OUTPUT].decode("utf-8", "replace"), None


def query_gpus(exe, timeout=GPU_TIMEOUT_S):
    """(gpus, apps, error) from nvidia-smi at `exe` (two queries, each with a deadline); gpus is None on error."""
    text, err = _run_bounded([exe] + GPU_QUERY, timeout)
    if err is not None:
        return None, [], err
    gpus = parse_gpu_csv(text)
    text, err = _run_bounded([exe] + APPS_QUERY, timeout)
    return gpus, (parse_apps_csv(text) if err is None else []), err


def visible_devices(value, gpus):
    """The nvidia-smi indices a CUDA_VISIBLE_DEVICES value names (indices or GPU-UUIDs; pure); None when unset."""
    if value is None:
        return None
    by_uuid = {g["uuid"]: g["index"] for g in gpus}
    out = []
    for item in value.split(","):
        item = item.strip()
        if item.isdigit():
            out.append(int(item))
        elif item.startswith("GPU-"):
            match = [i for u, i in by_uuid.items() if u.startswith(item)]  # a UUID prefix is allowed too
            if len(match) == 1:
                out.append(match[0])
        else:  # -1, an empty value, MIG devices: no more GPUs from here on (CUDA stops at the first invalid one)
            break
    return out


# ============================================================================================ the sampler

class Sampler:
    """What a sample of a job's processes needs from the previous one; `sample` takes one.

    A target is a dict: {key, pid, start_ticks, log, rank, cuda_visible_devices}: `key` names it in the result
    ("trainer.0"), `rank` is its own rank for progress lines that do not name one, `cuda_visible_devices` the
    value its environment has (None: not set).
    """

    def __init__(self, cpu=None, host_cpu=None, logs=None, nvidia_smi=None):
        self.cpu = cpu if cpu is not None else {}  # "pid:start" -> [monotonic time, ticks of the tree]
        self.host_cpu = host_cpu  # [monotonic time, busy ticks, total ticks]
        self.logs = logs if logs is not None else {}  # path -> LogProgress
        self.nvidia_smi = nvidia_smi  # path, "" when there is none, None: not looked for yet
        # exe -> (gpus, apps, error): query_gpus, unless a long-running owner answers from elsewhere (the
        # supervisor's control socket: the latest answer of a thread that runs nvidia-smi, GpuWatch below)
        self.gpu_source = None

    def to_json(self):
        """A JSON-able dict: what the next sample needs."""
        return {"version": 1, "cpu": self.cpu, "host_cpu": self.host_cpu,
                "logs": [lp.to_json() for lp in self.logs.values()]}

    @classmethod
    def from_json(cls, d):
        """A Sampler from to_json's dict; a malformed dict (another version, damage) gives a fresh Sampler."""
        try:
            if d.get("version") != 1:
                return cls()
            cpu = {str(k): [float(v[0]), int(v[1])] for k, v in (d.get("cpu") or {}).items()}
            host = d.get("host_cpu")
            host = [float(host[0]), int(host[1]), int(host[2])] if host else None
            logs = {}
            for item in d.get("logs") or []:
                lp = LogProgress.from_json(item)
                logs[lp.path] = lp
            return cls(cpu, host, logs)
        except (AttributeError, TypeError, ValueError, KeyError, IndexError):
            return cls()

    # -- progress -------------------------------------------------------------------------------------

    def progress(self, targets, now=None, slice_s=0.0, slices=0):
        """{key: {"progress": ..., "ranks": [...]}} for every target with a log: own rank's progress (None if
        none yet) and, for a log that other ranks write too, theirs."""
        now = time.time() if now is None else now
        out, keep = {}, {}
        for t in targets:
            path = t.get("log")
            if not path:
                continue
            lp = keep.get(path) or self.logs.get(path) or LogProgress(path)
            if path not in keep:
                lp.poll(now, str(t.get("rank", "0")))
                keep[path] = lp
            own = str(t.get("rank", "0"))
            others = []
            for key in sorted(lp.ranks, key=rank_order):
                if key != own:
                    v = lp.view(key, now, slice_s, slices)
                    v["rank"] = key
                    others.append(v)
            entry = {"progress": lp.view(own, now, slice_s, slices)}
            if others:
                entry["ranks"] = others
            out[t["key"]] = entry
        self.logs = keep
        return out

    # -- resources ------------------------------------------------------------------------------------

    def resources(self, targets, wait=0.25, gpu=True):
        """({key: {cpu_pct, rss_bytes, procs[, gpus, gpu_mem_mib]}}, host figures) for the targets' process trees.

        CPU % is over the time since the previous sample; where there is none younger than
        BASELINE_MAX_AGE_S, this takes one, waits `wait` seconds (0: CPU % is None this time) and samples again.
        """
        now = time.monotonic()
        for k in [k for k, v in self.cpu.items() if now - v[0] > BASELINE_MAX_AGE_S]:
            del self.cpu[k]
        if self.host_cpu and now - self.host_cpu[0] > BASELINE_MAX_AGE_S:
            self.host_cpu = None
        live = [t for t in targets if t.get("pid")]
        procs = scan_procs()
        kids = _children(procs)
        if wait > 0 and (self.host_cpu is None or any(_cpu_key(t) not in self.cpu and tree_of(procs, t["pid"],
                                                      t.get("start_ticks"), kids) for t in live)):
            self._cpu_sample(live, procs, kids)  # the baseline
            self._host_cpu(time.monotonic())
            time.sleep(wait)
            procs = scan_procs()
            kids = _children(procs)
        trees = self._cpu_sample(live, procs, kids)
        gpus = apps = None
        gpu_error = None
        if gpu:
            if self.nvidia_smi is None:
                self.nvidia_smi = shutil.which("nvidia-smi") or ""
            if self.nvidia_smi:
                gpus, apps, gpu_error = (self.gpu_source or query_gpus)(self.nvidia_smi)
        out = {}
        for t in targets:
            tree = trees.get(t["key"])
            if tree is None:
                out[t["key"]] = None
                continue
            members, cpu_pct = tree
            res = {"cpu_pct": cpu_pct, "rss_bytes": sum(procs[p][5] for p in members) * _PAGE, "procs": len(members)}
            if gpus is not None:
                mine = set(members)
                used = [a for a in apps or () if a["pid"] in mine]
                assigned = visible_devices(t.get("cuda_visible_devices"), gpus)
                if assigned is None:  # not set: the GPUs it uses
                    uuids = {a["gpu_uuid"] for a in used}
                    assigned = [g["index"] for g in gpus if g["uuid"] in uuids]
                res["gpus"] = [g for g in gpus if g["index"] in assigned]
                res["gpu_mem_mib"] = sum(a["used_mib"] or 0 for a in used) if used else None
            out[t["key"]] = res
        host = self._host_figures()
        if gpu and self.nvidia_smi:
            host["gpus"] = gpus
            if gpu_error:
                host["gpu_error"] = gpu_error
        return out, host

    def _cpu_sample(self, targets, procs, kids):
        """Record each target tree's CPU ticks; {key: (pids, cpu % since the previous record or None)}."""
        now = time.monotonic()
        out = {}
        seen = set()
        for t in targets:
            members = tree_of(procs, t["pid"], t.get("start_ticks"), kids)
            if not members:
                continue
            ticks = sum(procs[p][3] for p in members)
            k = _cpu_key(t)
            seen.add(k)
            prev = self.cpu.get(k)
            pct = None
            if prev is not None and now - prev[0] > 0.05:
                pct = round(max(0, ticks - prev[1]) / _CLK_TCK / (now - prev[0]) * 100.0, 1)
            self.cpu[k] = [now, ticks]
            out[t["key"]] = (members, pct)
        for k in [k for k in self.cpu if k not in seen]:
            del self.cpu[k]
        return out

    def _host_cpu(self, now):
        cur = parse_cpu_line(_read_text("/proc/stat", 4096))
        prev, pct = self.host_cpu, None
        if cur is not None:
            if prev is not None and cur[1] > prev[2]:
                pct = round(100.0 * (cur[0] - prev[1]) / (cur[1] - prev[2]), 1)
            self.host_cpu = [now, cur[0], cur[1]]
        return pct

    def _host_figures(self):
        mem = parse_meminfo(_read_text("/proc/meminfo"))
        try:
            load1 = os.getloadavg()[0]
        except OSError:
            load1 = None
        try:
            ncpu = len(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            ncpu = os.cpu_count()
        return {"ncpu": ncpu, "load1": None if load1 is None else round(load1, 2),
                "cpu_pct": self._host_cpu(time.monotonic()), "mem_total": mem.get("MemTotal"),
                "mem_available": mem.get("MemAvailable")}


class GpuWatch:
    """nvidia-smi off a long-running owner's loop (the supervisor's control socket): a thread queries it every
    `refresh` seconds while `top` is asked (the last ask within `idle` seconds); the loop reads the latest answer
    (a Sampler's `gpu_source`), never waiting for nvidia-smi."""

    def __init__(self, exe, refresh, idle, query=None):
        self.exe = exe
        self.query_fn = query or (lambda exe: query_gpus(exe))  # looked up at each call
        self.refresh, self.idle = refresh, idle
        self.latest = None  # (gpus, apps, error) of the last query
        self.asked = 0.0
        self.cond = threading.Condition()
        self.thread = None
        self.closed = False

    def want(self):
        """Someone asks `top` now: keep (or start) querying."""
        with self.cond:
            self.asked = time.monotonic()
            if self.thread is None and not self.closed:
                self.thread = threading.Thread(target=self._run, name="gpu-watch", daemon=True)
                self.thread.start()

    @property
    def ready(self):
        """An answer is in."""
        return self.latest is not None

    def __call__(self, exe):
        """metrics.Sampler's gpu_source: the latest answer, never a wait."""
        latest = self.latest
        return latest if latest is not None else (None, [], "nvidia-smi has not answered yet")

    def _run(self):
        while True:
            result = self.query_fn(self.exe)
            with self.cond:
                self.latest = result
                self.cond.wait(self.refresh)
                if self.closed or time.monotonic() - self.asked > self.idle:
                    self.thread = None
                    return

    def close(self):
        """Stop querying (the thread ends after its current query)."""
        with self.cond:
            self.closed = True
            self.cond.notify_all()


def _cpu_key(t):
    return "%s:%s" % (t["pid"], t.get("start_ticks"))


def dumps(obj):
    """Compact JSON (the sampler's cache)."""
    return json.dumps(obj, separators=(",", ":"))
