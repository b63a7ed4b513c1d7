"""A stopped job leaves no MPI shared memory behind: MPICH names one segment per node in /dev/shm (mpich_shm_*)
and unlinks it only in MPI_Finalize, so every rank killed by a stop, a fail-fast or a restart left ~2 MiB of tmpfs
(memory) on its host for good: one machine here had 431 of them, 1 GB, after a day of test runs. The Stopper
(clusterctl/host/stopping.py) notes the segments the job's processes map before it signals them and, once they
are gone, removes those and any older MPICH segment of the same user that nothing maps (under launcher: mpi a
node's ranks may have been ended by mpiexec's proxy before that node's stop began); it never touches a file that
a process still maps, that is not MPICH's, or that was made after the stop began."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from clusterctl.host.jobfile import JOB_ENV
from clusterctl.host.procfs import shm_segments, tagged_processes
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


def test_shm_segments_reads_only_named_mpich_segments(names):
    kept, gone = names("mpich_shm_"), names("mpich_shm_")
    p = mapper(kept, gone, session=False)
    try:
        gone.unlink()  # shows as "(deleted)" in maps: nothing to remove
        assert shm_segments([p.pid, 999999999]) == {str(kept)}
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


def test_a_stopped_mpich_job_leaves_no_segment_in_dev_shm(tmp_path):
    mpiexec = Path(sys.executable).with_name("mpiexec")
    if not mpiexec.exists():
        pytest.skip("no mpiexec beside this Python (the mpich wheel)")
    script = tmp_path / "job.py"
    script.write_text(MPI_JOB)
    tag = "shm-mpi-" + uuid.uuid4().hex[:8]  # hydra puts the ranks in groups of their own: the sweep finds them
    job = subprocess.Popen([str(mpiexec), "-n", "2", sys.executable, str(script)], stdout=subprocess.PIPE,
                           stderr=subprocess.DEVNULL, start_new_session=True, env=dict(os.environ, **{JOB_ENV: tag}))
    try:
        seen = b""
        while seen.count(b"ready") < 2:  # the two ranks' lines may come interleaved
            line = job.stdout.readline()
            assert line, seen
            seen += line
        ranks = list(tagged_processes(tag))
        segments = shm_segments(ranks)
        assert segments and all(os.path.exists(p) for p in segments), ranks  # MPICH's, while the job runs
        s = stop(tmp_path, job, job=tag)
        assert segments <= set(s.removed) and not any(os.path.exists(p) for p in segments)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
        for path in locals().get("segments") or ():
            Path(path).unlink(missing_ok=True)  # a failed run's: not left on the machine
