"""Reading /proc: a process's state, group and start time; the processes tagged with a job's id; the files (shared
memory, mostly, and Open MPI's session directory) a job's MPI leaves behind when its processes are killed."""

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
# And a directory: Open MPI's launcher's session directory, which it removes when it exits unless it was killed, in
# its temp dir (the first of TMPDIR, TEMP and TMP that is set, else /tmp), named after the launcher's pid:
#   5.x (PRRTE 3): ompi.<pid> of mpiexec (prterun; ~124 KB: pmix rendezvous files, hwloc.sm that every rank holds
#     open, per-job dirs with the pmix-gds-shmem2 segments the ranks map), prted.<pid> of its daemon on another host;
#     on a shared file system it is ompi.<node>.<pid>: not matched (it may be another host's, its pid not ours);
#   4.x (ORTE): pid.<pid> of mpirun inside ompi.<node>.<uid>, a parent that every job of the user on the node shares
#     (left; so is an orted's jf.<jobfamily>, which names no pid).
# One is removed only while nothing on this host maps, holds open, works in or binds a unix socket in anything inside
# it, and its pid is not its launcher's: gone, or (pid reuse) a process not named as a launcher that started after the
# directory last changed.
# (patterns, not compiled here: every host tool imports this module, and only a stop looks for these; re.match
# compiles each once, at its first use)
SESSION_DIR = r"(?:ompi|prted)\.([0-9]+)\Z"
SESSION_PARENT_4 = r"ompi\.(.+)\.([0-9]+)\Z"
SESSION_DIR_4 = r"pid\.([0-9]+)\Z"
_SESSION_HINTS = ("/ompi.", "/prted.")
LAUNCHERS = ("prte", "orte", "mpirun", "mpiexec")  # comm: prterun, prted, orterun, orted, mpirun.openmpi, ...


def _leftover(path):
    """Whether path (absolute) is named as one of LEFTOVERS."""
    folder, _, name = path.rpartition("/")
    return any(folder + "/" == d and pattern.match(name) for d, pattern in LEFTOVERS)


def temp_dirs(env):
    """The folders Open MPI makes its session directories in for a process with environment `env` (a mapping): its
    temp dir (as PRRTE's and ORTE's: TMPDIR, TEMP or TMP), the one a rank's launcher used (PMIX_SYSTEM_TMPDIR), and
    /tmp; absolute, symlinks resolved (as /proc shows paths)."""
    dirs = ["/tmp", env.get("PMIX_SYSTEM_TMPDIR")]
    dirs.append(next((env[k] for k in ("TMPDIR", "TEMP", "TMP") if env.get(k)), None))
    return set(os.path.realpath(d) for d in dirs if d and d.startswith("/"))


def _environ_temp_dirs(pid):
    """temp_dirs of pid's environment (/tmp alone when it cannot be read)."""
    env = {}
    for entry in _read_environ(pid) or ():
        key, sep, value = entry.partition(b"=")
        if sep and key in (b"TMPDIR", b"TEMP", b"TMP", b"PMIX_SYSTEM_TMPDIR"):
            env[key.decode()] = os.fsdecode(value)
    return temp_dirs(env)


def _node_names():
    """This host's names as Open MPI puts them in its 4.x session directory: the node name, and without its domain."""
    node = os.uname().nodename
    return {node, node.split(".", 1)[0]}


def _parent_4(name):
    """Whether name is Open MPI 4.x's per-user parent of session directories on this node: ompi.<node>.<euid>."""
    m = re.match(SESSION_PARENT_4, name)
    return bool(m) and m.group(1) in _node_names() and int(m.group(2)) == os.geteuid()


def _session_dir(path, bases):
    """The Open MPI session directory that path (absolute) is or lies in, named exactly as Open MPI names one in
    one of the folders `bases` (temp_dirs); None if none."""
    parts = path.split("/")
    for i in range(1, len(parts)):
        if ("/".join(parts[:i]) or "/") not in bases:
            continue
        if re.match(SESSION_DIR, parts[i]):
            return "/".join(parts[:i + 1])
        if i + 1 < len(parts) and re.match(SESSION_DIR_4, parts[i + 1]) and _parent_4(parts[i]):
            return "/".join(parts[:i + 2])
    return None


def _launcher_pid(path):
    """The pid that path names if it is named as an Open MPI session directory (a 4.x one inside this user's own
    parent directory, not a symlink); else None."""
    folder, _, name = path.rpartition("/")
    m = re.match(SESSION_DIR, name)
    if m:
        return int(m.group(1))
    m = re.match(SESSION_DIR_4, name)
    if m and _parent_4(folder.rpartition("/")[2]) and _own(folder, stat.S_ISDIR):
        return int(m.group(1))
    return None


def _uses(pid):
    """The paths that pid maps, holds open or works in (its cwd), as /proc shows them ("PATH (deleted)" once
    unlinked); none if its maps cannot be read."""
    paths = []
    try:
        with open("/proc/%d/maps" % pid, "rb") as f:
            last = None
            for line in f:
                fields = line.rstrip(b"\n").split(None, 5)
                if len(fields) == 6 and fields[5].startswith(b"/") and fields[5] != last:
                    last = fields[5]
                    paths.append(os.fsdecode(last))
    except OSError:
        return paths
    try:
        fds = os.listdir("/proc/%d/fd" % pid)
    except OSError:
        fds = []
    for link in ["fd/" + fd for fd in fds] + ["cwd"]:
        try:
            paths.append(os.readlink("/proc/%d/%s" % (pid, link)))
        except OSError:
            continue
    return paths


def mpi_files(pids):
    """What of the MPI runtime's leftovers any of pids uses: the LEFTOVERS paths it maps or holds open (that still
    have their name), and the Open MPI session directories (in its temp dirs) of anything it maps, holds open or
    works in."""
    found = set()
    for pid in pids:
        bases = None
        for path in _uses(pid):
            if _leftover(path):  # an unlinked one reads "PATH (deleted)": not a name to remove
                found.add(path)
            elif any(hint in path for hint in _SESSION_HINTS):
                if bases is None:
                    bases = _environ_temp_dirs(pid)
                session = _session_dir(path, bases)
                if session is not None:
                    found.add(session)
    return found


def _own(path, kind):
    """Whether path is of this user and of `kind` (stat.S_ISREG, S_ISDIR) itself (lstat: a symlink is not)."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return kind(st.st_mode) and st.st_uid == os.geteuid()


def _session_dirs_in(folder):
    """The paths in folder named as Open MPI's session directories (5.x's, and 4.x's inside this user's parent)."""
    try:
        names = os.listdir(folder)
    except OSError:
        return []
    found = []
    for name in names:
        path = os.path.join(folder, name)
        if re.match(SESSION_DIR, name):
            found.append(path)
        elif _parent_4(name) and _own(path, stat.S_ISDIR):
            try:
                found.extend(os.path.join(path, n) for n in os.listdir(path) if re.match(SESSION_DIR_4, n))
            except OSError:
                continue
    return found


def mpi_leftovers(before=None, since=None):
    """The LEFTOVERS files and Open MPI session directories (in /tmp and this process's temp dir) of this user last
    changed before `before` and since `since` (wall clock; None: no bound), in use or not."""
    candidates = [(p, stat.S_ISDIR) for folder in sorted(temp_dirs(os.environ)) for p in _session_dirs_in(folder)]
    for folder, pattern in LEFTOVERS:
        try:
            candidates.extend((folder + n, stat.S_ISREG) for n in os.listdir(folder) if pattern.match(n))
        except OSError:
            continue
    found = set()
    for path, kind in candidates:
        try:
            changed = os.lstat(path).st_ctime
        except OSError:
            continue
        if (before is None or changed < before) and (since is None or changed >= since) and _own(path, kind):
            found.add(path)
    return found


def _in_use(paths):
    """Those of paths (files; directories, with all in them) that a process this one can see maps, holds open or
    works in, or that a live unix socket is bound in."""
    dirs = tuple(p + "/" for p in paths if not _leftover(p))
    used = set()
    for pid in _pids():
        used.update(u for u in _uses(pid) if u in paths or u.startswith(dirs))
    if dirs:
        try:
            with open("/proc/net/unix", "rb") as f:
                lines = f.read().splitlines()[1:]
        except OSError:
            lines = []
        for line in lines:  # Num RefCount Protocol Flags Type St Inode Path
            fields = line.split(None, 7)
            if len(fields) == 8 and os.fsdecode(fields[7]).startswith(dirs):
                used.add(os.fsdecode(fields[7]))
    return set(p for p in paths if p in used or any(u.startswith(p + "/") for u in used))


def _boot_time():
    """The wall clock at boot, in seconds (/proc/stat's btime, whole seconds: at most 1 s early); 0 if unknown."""
    try:
        with open("/proc/stat", "rb") as f:
            for line in f:
                if line.startswith(b"btime "):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return 0


def _launcher_gone(path, pid):
    """Whether the process that made the session directory path (named after its pid) is gone: no live process has
    that pid, or the one that has it is another (pid reuse): not named as a launcher (comm), and started after the
    directory last changed (the launcher made it after it started; the start read here is never late)."""
    st = proc_stat(pid)
    if st is None or st[0] in ("Z", "X", "x"):
        return True
    try:
        with open("/proc/%d/comm" % pid, "rb") as f:
            comm = f.read().strip().decode("ascii", "replace")
        changed = os.lstat(path).st_ctime
        boot = _boot_time()
    except OSError:
        return False
    if comm.startswith(LAUNCHERS) or not boot:
        return False
    return boot + st[2] / os.sysconf("SC_CLK_TCK") > changed


def _remove_tree(path):
    """Remove the directory path with all in it, never following a symlink (shutil.rmtree's walk by file
    descriptors; where that is not available, nothing is removed), whatever else removes some of it meanwhile.
    Returns whether it is gone."""
    import shutil  # here only: the host imports this module at every start, and most stops remove no directory

    if not shutil.rmtree.avoids_symlink_attacks:
        return False
    shutil.rmtree(path, ignore_errors=True)
    return not os.path.lexists(path)


def release_mpi_files(noted, before):
    """Remove the MPI runtime's files a stopped job left: those in `noted` (what its processes used when the stop
    began: mpi_files) and, with `before` (the stop's start, wall clock), any other LEFTOVERS file or Open MPI session
    directory of this user last changed before then (ranks another host's mpiexec ended before this host's stop began,
    a launcher killed earlier), each only while it is a regular file (a directory) of ours that no process this one
    can see maps or holds open (anything in), and a session directory only once its launcher is gone. Returns the
    paths removed."""
    left = set(p for p in noted if _own(p, stat.S_ISREG if _leftover(p) else stat.S_ISDIR))
    if before is not None:
        left |= mpi_leftovers(before=before)
    if not left:
        return []
    left -= _in_use(left)
    removed = []
    for path in sorted(left):
        if _leftover(path):
            try:
                os.unlink(path)
                removed.append(path)
            except OSError:
                continue
            continue
        pid = _launcher_pid(path)
        if pid is not None and _launcher_gone(path, pid) and _own(path, stat.S_ISDIR) and _remove_tree(path):
            removed.append(path)
    return removed


def _pids():
    """Every pid in /proc now (none when /proc cannot be read)."""
    try:
        names = os.listdir("/proc")
    except OSError:
        return []
    return [int(n) for n in names if n.isdigit()]
