"""Reading /proc: a process's state, group and start time; the processes tagged with a job's id; the shared-memory
segments a job's MPI leaves behind when its processes are killed."""

import os
import stat

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


SHM_DIR = "/dev/shm/"
# MPICH's named segments (MPI_Init's, in /dev/shm), unlinked only by MPI_Finalize: a killed rank leaves them, ~2 MiB
# of tmpfs, that is of memory, a node and a stop. Other files in /dev/shm may be a user's own: only these are ours
# to remove.
SHM_PREFIXES = ("mpich_shm_",)


def shm_segments(pids):
    """The paths of SHM_PREFIXES segments in /dev/shm that any of pids maps and that still have their name."""
    found = set()
    for pid in pids:
        try:
            with open("/proc/%d/maps" % pid, "rb") as f:
                for line in f:
                    fields = line.rstrip(b"\n").split(None, 5)
                    if len(fields) < 6 or not fields[5].startswith(b"/dev/shm/"):
                        continue
                    name = os.fsdecode(fields[5][9:])
                    if name.startswith(SHM_PREFIXES) and "/" not in name and " " not in name:  # " (deleted)"
                        found.add(SHM_DIR + name)
        except OSError:
            continue
    return found


def _own_segment(path):
    """Whether path is a regular file of this user (lstat: a symlink is not)."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid()


def shm_leftovers(before=None, since=None):
    """The SHM_PREFIXES segments of this user in /dev/shm last changed before `before` and since `since` (wall
    clock; None: no bound), mapped or not."""
    try:
        names = [n for n in os.listdir(SHM_DIR) if n.startswith(SHM_PREFIXES)]
    except OSError:
        return set()
    found = set()
    for name in names:
        try:
            changed = os.lstat(SHM_DIR + name).st_ctime
        except OSError:
            continue
        if (before is None or changed < before) and (since is None or changed >= since) and _own_segment(SHM_DIR + name):
            found.add(SHM_DIR + name)
    return found


def release_shm(noted, before):
    """Unlink the MPI segments a stopped job left: those in `noted` (what its processes mapped when the stop
    began) and, with `before` (the stop's start, wall clock), any other SHM_PREFIXES segment of this user last
    changed before then (ranks another host's mpiexec ended before this host's stop began), each only while it is
    a regular file of ours that no process this one can see maps. Returns the paths removed."""
    left = set(p for p in noted if _own_segment(p)) | (shm_leftovers(before=before) if before is not None else set())
    if not left:
        return []
    left -= shm_segments(_pids())
    removed = []
    for path in sorted(left):
        try:
            os.unlink(path)
            removed.append(path)
        except OSError:
            continue
    return removed


def _pids():
    """Every pid in /proc now (none when /proc cannot be read)."""
    try:
        names = os.listdir("/proc")
    except OSError:
        return []
    return [int(n) for n in names if n.isdigit()]
