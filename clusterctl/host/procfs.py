"""Reading /proc: a process's state, group and start time; the processes tagged with a job's id."""

import os

from .jobfile import JOB_ENV, JOBDIR_ENV


def proc_stat(pid):
    """(state, pgid, start_ticks) of a pid from /proc/<pid>/stat, or None if it is gone."""
    try:
        with open("/proc/%d/stat" % pid, "rb") as f:
            data = f.read()
    except OSError:
        return None
    try:
        rest = data[data.rindex(b")") + 2:].split()
        return rest[0].decode("ascii", "replace"), int(rest[2]), int(rest[19])
    except (ValueError, IndexError):
        return None


def pid_alive(pid, start_ticks=None):
    """True if pid exists, is not a zombie, and (if given) started at start_ticks."""
    if not pid:
        return False
    st = proc_stat(pid)
    if st is None or st[0] in ("Z", "X", "x"):
        return False
    return start_ticks is None or st[2] == start_ticks


def _read_environ(pid):
    try:
        with open("/proc/%d/environ" % pid, "rb") as f:
            return f.read().split(b"\0")
    except OSError:
        return None


def tagged_processes(job_id, jobdir=None):
    """Live pids whose /proc environ has CLUSTERCTL_JOB=<job_id> exactly.

    With jobdir, processes tagged with a different CLUSTERCTL_JOBDIR (another
    supervisor of the same job on this machine) are left out; untagged-by-jobdir
    ones are included.  Returns {pid: pgid}.
    """
    needle = ("%s=%s" % (JOB_ENV, job_id)).encode()
    mark = ("%s=%s" % (JOBDIR_ENV, jobdir)).encode() if jobdir else None
    prefix = ("%s=" % JOBDIR_ENV).encode()
    me = os.getpid()
    found = {}
    for pid in _pids():
        if pid == me:
            continue
        entries = _read_environ(pid)
        if not entries or needle not in entries:
            continue
        if mark is not None:
            dirs = [e for e in entries if e.startswith(prefix)]
            if dirs and mark not in dirs:
                continue
        st = proc_stat(pid)
        if st is None or st[0] in ("Z", "X", "x"):
            continue
        found[pid] = st[1]
    return found


def group_members(pgids):
    """{pgid: [pids]} of live (non-zombie) processes in the given groups."""
    out = {}
    for pid in _pids() if pgids else ():
        st = proc_stat(pid)
        if st is not None and st[1] in pgids and st[0] not in ("Z", "X", "x"):
            out.setdefault(st[1], []).append(pid)
    return out


def _pids():
    """Every pid in /proc now (none when /proc cannot be read)."""
    try:
        names = os.listdir("/proc")
    except OSError:
        return []
    return [int(n) for n in names if n.isdigit()]
