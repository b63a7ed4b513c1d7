"""Reading /proc: a process's state, group and start time; the processes tagged with a job's id; the files (shared
memory, mostly) a job's MPI leaves behind when its processes are killed."""

import os
import re
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


# The files an MPI job's runtime makes on a host and removes only on a clean exit, so that every rank (or launcher)
# killed by a stop, a fail-fast or a restart left them for good. Other files in these directories may be a user's
# own: only names made this way are ours to remove, and only once no process maps them or holds them open.
#   MPICH: one segment a node, at MPI_Init (~2 MiB of tmpfs, that is of memory), unlinked only by MPI_Finalize;
#   Open MPI's shared-memory transport: one segment a rank (16 MiB each in 5.0: sm_segment.<node>.<uid>.<jobid>.<rank>;
#     4.x: vader_segment.<node>[.<uid>].<jobid>.<rank>), removed by its launcher unless that was killed too;
#   MPICH's hydra: the node's hwloc topology for the ranks, in /tmp whatever TMPDIR says, held open by its proxy.
SHM_DIR = "/dev/shm/"
LEFTOVERS = (
    (SHM_DIR, re.compile(r"mpich_shm_[^/ ]+\Z")),
    (SHM_DIR, re.compile(r"(?:sm|vader)_segment\.[^/ ]+\.[0-9a-f]+\.[0-9]+\Z")),
    ("/tmp/", re.compile(r"hydra_hwloc_xmlfile_[A-Za-z0-9]{6}\Z")),
)


def _leftover(path):
    """Whether path (absolute) is named as one of LEFTOVERS."""
    folder, _, name = path.rpartition("/")
    return any(folder + "/" == d and pattern.match(name) for d, pattern in LEFTOVERS)


def mpi_files(pids):
    """The LEFTOVERS paths that any of pids maps or holds open and that still have their name."""
    found = set()
    for pid in pids:
        try:
            with open("/proc/%d/maps" % pid, "rb") as f:
                for line in f:
                    fields = line.rstrip(b"\n").split(None, 5)
                    if len(fields) == 6 and fields[5].startswith(b"/"):
                        path = os.fsdecode(fields[5])
                        if _leftover(path):  # an unlinked one reads "PATH (deleted)": not a name to remove
                            found.add(path)
        except OSError:
            continue
        try:
            fds = os.listdir("/proc/%d/fd" % pid)
        except OSError:
            continue
        for fd in fds:
            try:
                path = os.readlink("/proc/%d/fd/%s" % (pid, fd))
            except OSError:
                continue
            if _leftover(path):
                found.add(path)
    return found


def _own_file(path):
    """Whether path is a regular file of this user (lstat: a symlink is not)."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid()


def mpi_leftovers(before=None, since=None):
    """The LEFTOVERS files of this user last changed before `before` and since `since` (wall clock; None: no
    bound), in use or not."""
    found = set()
    for folder, pattern in LEFTOVERS:
        try:
            names = [n for n in os.listdir(folder) if pattern.match(n)]
        except OSError:
            continue
        for name in names:
            try:
                changed = os.lstat(folder + name).st_ctime
            except OSError:
                continue
            if (before is None or changed < before) and (since is None or changed >= since) and _own_file(folder + name):
                found.add(folder + name)
    return found


def release_mpi_files(noted, before):
    """Unlink the MPI runtime's files a stopped job left: those in `noted` (what its processes mapped or held open
    when the stop began) and, with `before` (the stop's start, wall clock), any other LEFTOVERS file of this user
    last changed before then (ranks another host's mpiexec ended before this host's stop began), each only while it
    is a regular file of ours that no process this one can see maps or holds open. Returns the paths removed."""
    left = set(p for p in noted if _own_file(p)) | (mpi_leftovers(before=before) if before is not None else set())
    if not left:
        return []
    left -= mpi_files(_pids())
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
