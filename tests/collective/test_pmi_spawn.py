"""MPI_Comm_spawn, a clean finalize after errors, and MPI_Abort, through clusterctl's PMI server (no mpiexec).

Every job is two real ranks started as clusterctl's ssh launcher starts them (the plan's env plus the job
token), running the unmodified mpi4py program tests/collective/spawn_worker.py through
``python -m clusterctl.collective``; each rank's output goes to ``trainer.R.log`` in a job directory, as
under the host supervisor, so the spawned processes' logs and ``spawned-R.json`` land beside it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import job_pids
from launchlib import HERE, TOKEN, assert_no_orphans, finish, plan_for, start

from clusterctl.collective.errors import CollectiveError
from clusterctl.collective.pmiwire import parse_spawn

pytest.importorskip("mpi4py")

WORKER = HERE / "spawn_worker.py"
RUNNER = [sys.executable, "-m", "clusterctl.collective"]


def run_job(tmp_path: Path, mode: str, *, ranks: int = 2, timeout: float = 90, **env):
    """Run ``ranks`` ranks of spawn_worker.py MODE; (plan, procs, outputs by rank, seconds)."""
    plan = plan_for(ranks, WORKER, mode, str(tmp_path), entrypoint=RUNNER)
    logs = [open(tmp_path / f"trainer.{r}.log", "w") for r in range(ranks)]
    t0 = time.monotonic()
    try:
        procs = [start(t, stdout=logs[r], CLUSTERCTL_JOBDIR=tmp_path, CLUSTERCTL_COLLECTIVE_TIMEOUT=60, **env)
                 for r, t in enumerate(plan.trainers)]
        finish(procs, timeout=timeout)
    finally:
        for f in logs:
            f.close()
    took = time.monotonic() - t0
    outs = [(tmp_path / f"trainer.{r}.log").read_text() for r in range(ranks)]
    return plan, procs, outs, took


def job_of(plan) -> str:
    return plan.trainers[0].env["CLUSTERCTL_JOB"]


# -- the spawn message (pure) ---------------------------------------------------------------------------------

def test_spawn_message_parsed_as_mpich_sends_it():
    """Spawn_multiple's mcmd form (src/pmi/src/pmi_wire.c): segments to endcmd, preput in the first only."""
    lines = ["mcmd=spawn", "nprocs=2", "execname=/usr/bin/python3", "totspawns=2", "spawnssofar=1", "argcnt=2",
             "arg1=worker.py", "arg2=a b\\c", "preput_num=1", "preput_key_0=PARENT_ROOT_PORT_NAME",
             "preput_val_0=tag#0$connentry#0200$", "info_num=1", "info_key_0=wdir", "info_val_0=/tmp", "endcmd",
             "mcmd=spawn", "nprocs=1", "execname=/bin/true", "totspawns=2", "spawnssofar=2", "argcnt=0",
             "info_num=0", "endcmd"]
    req = parse_spawn(lines)
    assert [(c.argv, c.nprocs, c.info) for c in req.commands] == [
        (["/usr/bin/python3", "worker.py", "a b\\c"], 2, {"wdir": "/tmp"}), (["/bin/true"], 1, {})]
    assert req.preput == {"PARENT_ROOT_PORT_NAME": "tag#0$connentry#0200$"} and req.total == 3


@pytest.mark.parametrize("lines,msg", [
    (["mcmd=spawn", "nprocs=1", "execname=x", "totspawns=2", "spawnssofar=1", "endcmd"],
     "spawn: totspawns=2 but 1 command(s) sent"),
    (["mcmd=spawn", "nprocs=5000", "execname=x", "totspawns=1", "spawnssofar=1", "endcmd"],
     "spawn: nprocs=5000 out of range 0..1024"),
    (["mcmd=spawn", "nprocs=1", "totspawns=1", "spawnssofar=1", "endcmd"], "spawn: a command without execname"),
    (["mcmd=spawn", "nprocs=1", "execname=x", "totspawns=1", "argcnt=2", "arg1=a", "endcmd"],
     "spawn: argcnt=2 but arg2 missing"),
    (["mcmd=spawn", "nprocs=1", "execname=x", "totspawns=1"], "spawn: message does not end with 'endcmd'"),
])
def test_bad_spawn_messages_are_named(lines, msg):
    with pytest.raises(CollectiveError) as info:
        parse_spawn(lines)
    assert str(info.value) == msg


# -- real worlds ------------------------------------------------------------------------------------------------

@pytest.mark.timeout(150)
def test_spawn_starts_children_with_the_jobs_environment_beside_the_spawning_rank(tmp_path):
    plan, procs, outs, _ = run_job(tmp_path, "spawn")
    job = job_of(plan)
    for r, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"rank {r} exited {p.returncode}:\n{out}"
    reports = {}
    for out in outs:
        line = next(ln for ln in out.splitlines() if ln.startswith("REPORT "))
        rep = json.loads(line[len("REPORT "):])
        reports[rep["rank"]] = rep
    token = TOKEN["CLUSTERCTL_JOB_TOKEN"]
    for r in (0, 1):
        single, multi = reports[r]["single"], reports[r]["multi"]
        assert [(c["rank"], c["size"], c["appnum"], c["argv"]) for c in single] == [
            (0, 2, 0, ["a b", "c\\d"]), (1, 2, 0, ["a b", "c\\d"])]
        assert [(c["rank"], c["size"], c["appnum"], c["argv"]) for c in multi] == [
            (0, 3, 0, ["x"]), (1, 3, 1, ["y"]), (2, 3, 1, ["y"])]
        assert multi[0]["cwd"] == str(tmp_path)               # info wdir
        for c in single + multi:                               # the job's contract and tag, not the rank's
            assert (c["job"], c["jobdir"], c["token"], c["spawned"]) == (job, str(tmp_path), token, "1")
            assert c["RANK"] is None and c["WORLD_SIZE"] is None
    by_world = reports[1]["by_world"]                          # COMM_WORLD.Spawn with root=1
    assert [(c["rank"], c["size"], c["argv"]) for c in by_world] == [(0, 1, ["world"])]
    assert reports[0]["by_world"] is None
    # what was spawned, per spawning rank, with logs beside the rank's own
    rec = json.loads((tmp_path / "spawned-1.json").read_text())
    assert rec["rank"] == 1 and [s["seq"] for s in rec["spawns"]] == [1, 2, 3]
    procs_by_seq = {s["seq"]: s["procs"] for s in rec["spawns"]}
    assert [p["log"] for p in procs_by_seq[3]] == [str(tmp_path / "trainer.1.spawn3.0.log")]
    assert procs_by_seq[2][0]["argv"][1:] == [str(WORKER), "child-report", str(tmp_path), "0", "x"]
    assert {p["pid"] for s in rec["spawns"] for p in s["procs"]} == {
        c["pid"] for c in reports[1]["single"] + reports[1]["multi"] + by_world}
    assert oct((tmp_path / "spawned-1.json").stat().st_mode & 0o777) == "0o600"
    assert sorted(p.name for p in tmp_path.glob("trainer.0.spawn*.log")) == [
        "trainer.0.spawn1.0.log", "trainer.0.spawn1.1.log", "trainer.0.spawn2.0.log", "trainer.0.spawn2.1.log",
        "trainer.0.spawn2.2.log"]
    assert_no_orphans(job)


@pytest.mark.timeout(150)
def test_refused_spawns_leave_the_job_able_to_spawn_and_finalize(tmp_path):
    """The issue's case: a refused spawn used to leave MPICH's client one reply out of step (Spawn_multiple
    got a reply per command), so MPI_Finalize failed with 'PMI_Barrier returned -1', exit code 15."""
    plan, procs, outs, _ = run_job(tmp_path, "refused")
    for r, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"rank {r} exited {p.returncode}:\n{out}"
        assert "REFUSED foreign host class=15" in out and "REFUSED missing program class=15" in out, out
        assert f"AFTER rank={r} children=1" in out
        assert (f"clusterctl.collective: rank {r}: MPI_Comm_spawn refused: info host 'no-such-host.invalid' is not "
                f"this host ({os.uname().nodename}): under clusterctl's PMI server spawned processes start on the "
                "spawning rank's host only") in out
        assert (f"clusterctl.collective: rank {r}: MPI_Comm_spawn refused: cannot start '/no/such/program': "
                "No such file or directory") in out
    # the one good spawn after the refusals is spawn #3 of each rank (a refusal by the rank counts one)
    assert [s["seq"] for s in json.loads((tmp_path / "spawned-0.json").read_text())["spawns"]] == [3]
    assert_no_orphans(job_of(plan))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode,code", [("abort", 7), ("abort-at-exit", 9)])
def test_abort_ends_every_rank_with_its_code_and_names_the_rank(tmp_path, mode, code):
    """MPI_Abort returns in MPICH when a PMI server (not hydra) runs the job: the server tells every rank's
    control thread, the aborting rank exits at once with the code, the others a second later. abort-at-exit:
    Abort is the script's last statement, so the rank is already shutting down when the notice comes."""
    plan, procs, outs, took = run_job(tmp_path, mode, timeout=60)
    assert [p.returncode for p in procs] == [code, code], outs
    assert took < 30, f"took {took:.1f}s"
    host = os.uname().nodename
    msg = f"rank 1 called MPI_Abort with error code {code}"
    assert outs[1].rstrip().endswith(f"clusterctl.collective: {msg}: rank 1 exits with code {code}"), outs[1]
    assert outs[0].rstrip().endswith(f"clusterctl.collective: {msg}: ending rank 0 (exit code {code})"), outs[0]
    assert "BARRIER COMPLETED" not in outs[0]
    rec = json.loads((tmp_path / "abort.json").read_text())
    assert {k: rec[k] for k in ("rank", "code", "exit_code", "message", "host", "spawned")} == {
        "rank": 1, "code": code, "exit_code": code, "message": msg, "host": host, "spawned": None}
    assert rec["pid"] == procs[1].pid
    assert oct((tmp_path / "abort.json").stat().st_mode & 0o777) == "0o600"
    assert_no_orphans(job_of(plan))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode,code", [("abort-child", 5), ("crash-child", 3)])
def test_a_spawned_process_that_aborts_or_fails_ends_the_job(tmp_path, mode, code):
    """abort-child: process 0 of a spawned world of two calls MPI_Abort(5); crash-child: a spawned process
    exits 3 without MPI_Finalize (as MPI_Abort does in a world of one). Both end the job, as under hydra."""
    plan, procs, outs, took = run_job(tmp_path, mode, timeout=60)
    assert [p.returncode for p in procs] == [code, code], outs
    assert took < 30, f"took {took:.1f}s"
    rec = json.loads((tmp_path / "abort.json").read_text())
    spawned = json.loads((tmp_path / "spawned-0.json").read_text())["spawns"][0]
    child = spawned["procs"][0]
    assert rec["rank"] == 0 and rec["code"] == code
    assert rec["spawned"] == {"world": spawned["world"], "rank": 0, "pid": child["pid"]}
    who = f"spawned process 0 of {spawned['world']} (spawned by rank 0)"
    want = (f"{who} called MPI_Abort with error code 5" if mode == "abort-child" else
            f"{who} (pid {child['pid']}) exited with code 3 before MPI_Finalize")
    assert rec["message"] == want
    assert outs[0].rstrip().endswith(f"clusterctl.collective: {want}: ending rank 0 (exit code {code})"), outs[0]
    assert_no_orphans(job_of(plan))


@pytest.mark.timeout(120)
def test_a_rank_that_leaves_without_finalize_does_not_fail_the_others_finalize(tmp_path):
    plan, procs, outs, _ = run_job(tmp_path, "early-exit")
    assert [p.returncode for p in procs] == [0, 0], outs
    assert "FINALIZING rank=0" in outs[0]
    assert "PMI: rank 1 closed its connection before MPI_Finalize (it exited or crashed)" in outs[0]
    assert "released without 1 (closed before MPI_Finalize)" in outs[0], outs[0]
    assert_no_orphans(job_of(plan))


@pytest.mark.timeout(150)
def test_mpi4py_futures_pool_executor_spawns_its_workers_in_a_job(tmp_path):
    plan, procs, outs, _ = run_job(tmp_path, "futures")
    assert [p.returncode for p in procs] == [0, 0], outs
    for r in (0, 1):
        assert f"FUTURES rank={r} sum=285" in outs[r]
        rec = json.loads((tmp_path / f"spawned-{r}.json").read_text())
        assert [p["argv"][-2:] for p in rec["spawns"][0]["procs"]] == [["-m", "mpi4py.futures.server"]] * 2
    assert_no_orphans(job_of(plan))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("rank", [0, 1])
def test_no_token_no_world(tmp_path, rank):
    """Without CLUSTERCTL_JOB_TOKEN (and without CLUSTERCTL_AUTH=none) neither rank 0 serves nor a rank joins."""
    plan = plan_for(2, WORKER, "spawn", str(tmp_path), entrypoint=RUNNER)
    (out,) = finish([start(plan.trainers[rank], token=False, CLUSTERCTL_COLLECTIVE_TIMEOUT=10)], timeout=40)
    if rank == 0:
        want = ("clusterctl.collective: PMI server: CLUSTERCTL_JOB_TOKEN is not set and CLUSTERCTL_AUTH is not 'none': "
                "refusing to serve MPI's process manager unauthenticated")
    else:
        want = ("clusterctl.collective: rank 1: cannot join the MPI world: CLUSTERCTL_JOB_TOKEN is not set and "
                "CLUSTERCTL_AUTH is not 'none'")
    assert out.startswith(want), out
    assert len(out.strip().splitlines()) == 1, out
    assert not job_pids(job_of(plan))


@pytest.mark.timeout(120)
def test_auth_none_serves_unauthenticated_and_says_so(tmp_path):
    plan = plan_for(2, WORKER, "early-exit", str(tmp_path), entrypoint=RUNNER)
    procs = [start(t, token=False, CLUSTERCTL_AUTH="none", CLUSTERCTL_COLLECTIVE_TIMEOUT=60) for t in plan.trainers]
    outs = finish(procs, timeout=90)
    assert [p.returncode for p in procs] == [0, 0], outs
    assert "serves WITHOUT authentication (CLUSTERCTL_AUTH=none)" in outs[0]


def test_runner_usage_errors_are_one_line():
    res = subprocess.run(RUNNER + ["-m"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and res.stderr.splitlines()[0] == "python -m clusterctl.collective: -m needs an argument"
