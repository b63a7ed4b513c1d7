"""launcher: mpi across test-cluster nodes (one mpiexec over the nodes' SSH mesh; stop cleans every node), and
the same programs under launcher: ssh through clusterctl's PMI server: spawn (mpi4py.futures), MPI_Abort, and
mpi4py's own test suite under both launchers (slow tier)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest
import yaml

from clusterlib import (ROOT, assert_mlp_ranks_match_single, assert_no_orphans, clusterctl, mlp_single, node_exec,
                        port_base, status_json, tagged_pids, write_spec)

pytestmark = pytest.mark.integration

# Inside containers MPICH's intra-node shared-memory transport fails to connect; TCP between all ranks works.
CONTAINER_MPI_ENV = {"MPIR_CVAR_NOLOCAL": "1", "UCX_TLS": "tcp,self", "UCX_WARN_UNUSED_ENV_VARS": "n"}


def mpi_spec(info, tmp_path, name, *, hosts, slots, entrypoint, args=(), workspace):
    base = yaml.safe_load(Path(info.spec_path).read_text())
    spec = write_spec(
        info, tmp_path / f"{name}.yaml", name=name, hosts=hosts,
        workspace={"local": str(workspace), "remote": f"clusterctl-it/{name}"},
        job={"mode": "collective", "launcher": "mpi", "mpiexec": "/opt/venv/bin/mpiexec", "entrypoint": entrypoint,
             "args": list(args), "env": CONTAINER_MPI_ENV, "grace": 3},
    )
    data = yaml.safe_load(spec.read_text())
    data["hosts"] = [dict(h, slots=slots) for h in base["hosts"][:hosts]]
    spec.write_text(yaml.safe_dump(data))
    clusterctl("stop", spec)
    return spec


@pytest.mark.timeout(240)
def test_mlp_trains_over_mpi_launch_and_matches_single_process(clusterctl_on_nodes, tmp_path):
    info = clusterctl_on_nodes
    spec = mpi_spec(info, tmp_path, "it-mpi-mlp", hosts=3, slots=1, workspace=ROOT / "examples" / "mlp_collective",
                    entrypoint=["/opt/venv/bin/python", "train.py"], args=["--steps", "300", "--batch", "96"])
    plan = clusterctl("plan", spec, check=True).stdout
    assert "launcher: mpi" in plan and "-n 3" in plan and "-launcher ssh" in plan
    clusterctl("dispatch", spec, check=True)
    res = clusterctl("start", spec, "--follow", timeout=200)
    assert res.returncode == 0, res.stdout + res.stderr
    done = re.findall(r"done steps=300 loss=([\d.]+) .* trainer=(\d) checksum=([\d.]+)", res.stdout)
    assert sorted(t for _, t, _ in done) == ["0", "1", "2"], res.stdout
    ref_loss, ref_sum = mlp_single(300, 96)
    for loss, _, checksum in done:
        assert float(checksum) == pytest.approx(float(ref_sum), rel=1e-9)
        assert float(loss) == pytest.approx(float(ref_loss), rel=1e-6)
    assert float(ref_loss) < 0.1  # it did converge


@pytest.mark.timeout(240)
def test_stop_of_an_mpi_job_leaves_no_rank_on_any_node(testcluster, tmp_path):
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "spin.py").write_text(
        "import time\nfrom mpi4py import MPI\nc = MPI.COMM_WORLD\nc.Barrier()\n"
        "print(f'rank={c.Get_rank()} up', flush=True)\ntime.sleep(600)\n"
    )
    spec = mpi_spec(testcluster, tmp_path, "it-mpi-stop", hosts=2, slots=2, workspace=ws,
                    entrypoint=["/opt/venv/bin/python", "spin.py"])
    clusterctl("dispatch", spec, check=True)
    clusterctl("start", spec, check=True)
    nodes = testcluster.nodes[:2]
    deadline = time.monotonic() + 60
    while sum(len(tagged_pids(n.container, "it-mpi-stop")) for n in nodes) < 5 and time.monotonic() < deadline:
        time.sleep(0.5)  # mpiexec plus 4 ranks, 2 on each node
    counts = {n.container: len(tagged_pids(n.container, "it-mpi-stop")) for n in nodes}
    assert counts[nodes[1].container] == 2, counts  # ranks on the second node carry the job's tag too
    assert status_json(spec)["state"] == "running"
    segments = {n.container: set(node_exec(n.container, "ls /dev/shm | grep ^mpich_shm_ || true").split())
                for n in nodes}
    assert all(segments.values()), segments  # MPICH's segment on each node, unlinked only by MPI_Finalize
    res = clusterctl("stop", spec, check=True)
    assert "job it-mpi-stop stopped" in res.stdout
    deadline = time.monotonic() + 15
    while any(tagged_pids(n.container, "it-mpi-stop") for n in nodes) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not any(tagged_pids(n.container, "it-mpi-stop") for n in nodes)
    left = {c: names & set(node_exec(c, "ls /dev/shm").split()) for c, names in segments.items()}
    assert not any(left.values()), left  # the stop removed them (they were left on every node for good)


@pytest.mark.timeout(240)
def test_same_training_without_mpiexec_under_the_ssh_launcher(clusterctl_on_nodes, tmp_path):
    """launcher: ssh — clusterctl starts each rank with the env contract; the backend joins them via its PMI server."""
    info = clusterctl_on_nodes
    base = 7600
    spec = write_spec(
        info, tmp_path / "ssh.yaml", name="it-ssh-mlp", hosts=3,
        workspace={"local": str(ROOT / "examples" / "mlp_collective"), "remote": "clusterctl-it/ssh-mlp"},
        job={"mode": "collective", "launcher": "ssh", "entrypoint": ["/opt/venv/bin/python", "train.py"],
             "args": ["--steps", "300", "--batch", "96"], "trainers": 1, "env": {"UCX_TLS": "tcp,self"}, "grace": 3,
             "ports": {"control": base, "master": base + 1, "trainer": base + 10}},
    )
    clusterctl("stop", spec)
    clusterctl("dispatch", spec, check=True)
    res = clusterctl("start", spec, "--follow", timeout=200)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr
    assert_mlp_ranks_match_single(res.stdout, ranks=3, steps=300, batch=96)


# -- issue 26: spawn, abort, and mpi4py's own test suite, under both launchers ------------------------------------

FUTURES = ROOT / "examples" / "mpi4py_futures"
# In these containers process_vm_readv fails (EPERM: no CAP_SYS_PTRACE), so MPICH's shared memory must not
# use CMA for large messages between processes of one node (a spawned world), nor UCX its shared memory.
NODE_MPI_ENV = {"UCX_TLS": "tcp,self", "UCX_WARN_UNUSED_ENV_VARS": "n", "MPIR_CVAR_CH4_CMA_ENABLE": "0"}
# MPICH 5.0.2's ch4:ucx loses an MPI_ANY_SOURCE receive whose message from another node has already arrived
# (jobs/mpi_any_source.py; docs/benchmarks.md, issue 26); its ofi netmod does not.
OFI_MPI_ENV = {**NODE_MPI_ENV, "MPIR_CVAR_CH4_NETMOD": "ofi"}


def launcher_spec(info, tmp_path, name, launcher, *, workspace, script, args=(), hosts=2, mpi_args=(),
                  env=NODE_MPI_ENV):
    """A 2-host collective job of one rank per host running ``script`` under ``launcher`` (ssh: through
    ``python -m clusterctl.collective``; mpi: hydra's mpiexec over the nodes' ssh mesh)."""
    base = port_base()
    job = {"mode": "collective", "launcher": launcher, "args": list(args), "env": dict(env), "grace": 3,
           "ports": {"control": base, "master": base + 1, "trainer": base + 10}}
    if launcher == "ssh":
        job.update(entrypoint=["/opt/venv/bin/python", "-m", "clusterctl.collective", script], trainers=1)
    else:
        job.update(entrypoint=["/opt/venv/bin/python", script], mpiexec="/opt/venv/bin/mpiexec",
                   mpi_args=list(mpi_args))
    spec = write_spec(info, tmp_path / f"{name}.yaml", name=name, hosts=hosts,
                      workspace={"local": str(workspace), "remote": f"clusterctl-it/{name}"}, job=job)
    if launcher == "mpi":
        data = yaml.safe_load(spec.read_text())
        data["hosts"] = [dict(h, slots=1) for h in data["hosts"]]
        spec.write_text(yaml.safe_dump(data))
    clusterctl("stop", spec)
    return spec


@pytest.mark.timeout(300)
@pytest.mark.parametrize("launcher", ["ssh", "mpi"])
def test_the_mpi4py_futures_example_runs_under_both_launchers(clusterctl_on_nodes, tmp_path, launcher):
    """examples/mpi4py_futures: every rank spawns a pool (MPI_Comm_spawn). Under launcher: mpi hydra spawns
    them (the job's -envlist, not -genvlist, which made hydra die on a spawn); under launcher: ssh the PMI
    server has each rank's control thread start them on the rank's own host, logged beside its log."""
    info = clusterctl_on_nodes
    name = f"it-futures-{launcher}"
    spec = launcher_spec(info, tmp_path, name, launcher, workspace=FUTURES, script="primes.py",
                         args=["--below", "10000", "--workers", "2"])
    clusterctl("dispatch", spec, check=True)
    res = clusterctl("start", spec, "--follow", timeout=240)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-4000:]
    assert "primes below 10000: 1229 (expected 1229)" in out, out[-4000:]
    ranks = {r: workers for r, _, workers in
             re.findall(r"rank (\d)/2 on (\S+): \d+ primes in 5 chunks, workers (.+)", out)}
    assert sorted(ranks) == ["0", "1"], out[-4000:]
    nodes = info.nodes[:2]
    if launcher == "ssh":
        for r, node in enumerate(nodes):
            host = node_exec(node.container, "hostname").strip()
            workers = ranks[str(r)].split()
            assert len(workers) == 2 and all(w.startswith(f"{host}:") for w in workers), (r, host, workers)
            home = info.home
            rec = json.loads(node_exec(node.container, f"cat {home}/.clusterctl/jobs/{name}/spawned-{r}.json",
                                       user=info.user))
            procs = rec["spawns"][0]["procs"]
            assert [p["argv"][-2:] for p in procs] == [["-m", "mpi4py.futures.server"]] * 2
            assert {f"{host}:{p['pid']}" for p in procs} == set(workers)
            assert [p["log"] for p in procs] == [f"{home}/clusterctl-it/{name}.logs/trainer.{r}.spawn1.{i}.log"
                                                 for i in range(2)]
    assert_no_orphans(info, name, hosts=info.nodes[:2])


@pytest.mark.timeout(240)
def test_mpi_abort_on_another_host_fails_the_job_naming_the_rank_and_code(clusterctl_on_nodes, tmp_path):
    """launcher: ssh, rank 1 on the second node calls MPI_Abort(3): it exits 3 at once, rank 0 a second
    later; the job fails with the supervisor's reason naming trainer 1 and code 3, and abort.json says so on
    the aborting rank's host (and on rank 0's, where the PMI server runs)."""
    info = clusterctl_on_nodes
    ws = tmp_path / "ws"
    ws.mkdir()
    shutil.copy(ROOT / "tests/integration/jobs/mpi_abort.py", ws / "abort.py")
    name = "it-pmi-abort"
    spec = launcher_spec(info, tmp_path, name, "ssh", workspace=ws, script="abort.py")
    clusterctl("dispatch", spec, check=True)
    res = clusterctl("start", spec, "--follow", timeout=200)
    out = res.stdout + res.stderr
    assert res.returncode != 0, out[-3000:]
    st = status_json(spec)
    # the aborting rank's exit is the job's first failure: every host's reason names it, and why (its host read
    # the rank's abort.json)
    second = info.nodes[1].ip
    why = f"trainer.1 on {second} exited with code 3 (rank 1 called MPI_Abort with error code 3)"
    assert st["state"] == "failed" and st["reason"] == f"{info.nodes[0].ip}, {second}: {why}", st  # said once
    assert "not reached" not in out
    assert "clusterctl.collective: rank 1 called MPI_Abort with error code 3: rank 1 exits with code 3" in out
    for node in info.nodes[:2]:
        rec = json.loads(node_exec(node.container, f"cat {info.home}/.clusterctl/jobs/{name}/abort.json",
                                   user=info.user))
        assert (rec["rank"], rec["code"], rec["exit_code"], rec["message"], rec["spawned"]) == (
            1, 3, 3, "rank 1 called MPI_Abort with error code 3", None), rec
    assert_no_orphans(info, name, hosts=info.nodes[:2])


UCX_LOSES_ANY_SOURCE = pytest.mark.xfail(
    strict=True, raises=AssertionError,
    reason="MPICH 5.0.2 ch4:ucx: the shm half of an any-source receive is never cancelled when the netmod half "
           "matches at once (docs/benchmarks.md, issue 26); an XPASS means the wheel is fixed and the mpi4py "
           "suite parity test can drop its -x testDistgraphcomm")


@pytest.mark.timeout(240)
@pytest.mark.parametrize("launcher,netmod", [
    ("ssh", "ofi"), ("mpi", "ofi"), pytest.param("mpi", "ucx", marks=UCX_LOSES_ANY_SOURCE)])
def test_an_any_source_receive_from_another_host_completes(clusterctl_on_nodes, tmp_path, launcher, netmod):
    """The message is in before MPI_Recv(MPI_ANY_SOURCE) is posted (the pattern of MPI_Dist_graph_create): with
    ofi both ranks get it under either launcher; with ucx (the wheel's default) both spin until the job's
    faulthandler ends them, 5 s after the barrier."""
    info = clusterctl_on_nodes
    ws = tmp_path / "ws"
    ws.mkdir()
    shutil.copy(ROOT / "tests/integration/jobs/mpi_any_source.py", ws / "any_source.py")
    name = f"it-anysrc-{launcher}-{netmod}"
    env = OFI_MPI_ENV if netmod == "ofi" else NODE_MPI_ENV
    spec = launcher_spec(info, tmp_path, name, launcher, workspace=ws, script="any_source.py", env=env)
    clusterctl("dispatch", spec, check=True)
    res = clusterctl("start", spec, "--follow", timeout=200)
    out = res.stdout + res.stderr
    got = sorted(re.findall(r"rank (\d) got \[(\d), \d, \d, \d\] from (\d)", out))
    assert res.returncode == 0 and got == [("0", "1", "1"), ("1", "0", "0")], out[-3000:]
    assert_no_orphans(info, name, hosts=info.nodes[:2])


def mpi4py_test_suite(tmp_path_factory, container: str) -> Path:
    """mpi4py's own test suite, unmodified: the test/ directory of the sdist of the version on the nodes."""
    version = node_exec(container, "/opt/venv/bin/python -c 'import mpi4py; print(mpi4py.__version__)'").strip()
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "clusterctl" / "mpi4py-sdist"
    sdist = cache / f"mpi4py-{version}.tar.gz"
    if not sdist.exists():
        cache.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
                        f"mpi4py=={version}", "-d", str(cache), "-q"], check=True, timeout=300)
    out = tmp_path_factory.mktemp("mpi4py")
    with tarfile.open(sdist) as tar:
        tar.extractall(out, members=[m for m in tar.getmembers() if m.name.startswith(f"mpi4py-{version}/test/")],
                       filter="data")
    return out / f"mpi4py-{version}" / "test"


def suite_results(out: str) -> dict:
    """What both ranks' unittest runners said: per-rank summaries and the failing/erroring tests."""
    ran = sorted(re.findall(r"Ran (\d+) tests? in [\d.]+s", out))
    verdicts = sorted(re.findall(r"^(?:\[[^\]]*\] )*(OK(?: \(.*\))?|FAILED \(.*\))\s*$", out, re.M))
    # the failing tests by name: hydra merges both ranks' output into one stream, where a line of one rank can
    # be cut by the other's (the counts above are each rank's own summary line)
    bad = sorted(set(re.findall(r"^(?:\[[^\]]*\] )*((?:FAIL|ERROR): \S+ \(\S+\))", out, re.M)))
    return {"ran": ran, "verdicts": verdicts, "bad": bad}


@pytest.mark.slow
@pytest.mark.timeout(3000)
def test_mpi4py_test_suite_gives_the_same_results_under_both_launchers(clusterctl_on_nodes, tmp_path,
                                                                       tmp_path_factory):
    """mpi4py's own test suite (its sdist's test/ directory, unmodified) as a 2-host job, under launcher: ssh
    (clusterctl's PMI server, spawn included) and launcher: mpi (hydra): the same tests run, pass, fail and
    skip. Left out of both with mpi4py's own -x (docs/benchmarks.md, "mpi4py's own test suite under both
    launchers"): testDistgraphcomm, which hangs in MPICH itself whenever a rank's peer is on another node
    (MPI_Dist_graph_create's MPI_Recv(MPI_ANY_SOURCE) of a message already in: MPICH 5.0.2's ch4:ucx never
    cancels the shm half of the any-source receive when the ucx half completes inside ucp_tag_recv_nbx, the
    gap pmodels/mpich#7745 closed for the other netmods; test_an_any_source_receive_from_another_host_...;
    the ofi netmod avoids it but hangs this suite's test_spawn under hydra), and test_spawn's testNoArgs,
    whose child script is written to the spawning rank's /tmp: hydra starts the child on the other node,
    where exec fails and the spawn hangs (under launcher: ssh it passes)."""
    info = clusterctl_on_nodes
    suite = mpi4py_test_suite(tmp_path_factory, info.nodes[0].container)
    args = ["-x", "test_comm_topo.*.testDistgraphcomm", "-x", "test_spawn.*.testNoArgs"]
    results, took = {}, {}
    for launcher in ("mpi", "ssh"):
        spec = launcher_spec(info, tmp_path, f"it-m4p-{launcher}", launcher, workspace=suite, script="main.py",
                             args=args)
        clusterctl("dispatch", spec, check=True, timeout=300)
        t0 = time.monotonic()
        res = clusterctl("start", spec, "--follow", timeout=1400)
        took[launcher] = time.monotonic() - t0
        out = res.stdout + res.stderr
        results[launcher] = suite_results(out)
        print(f"mpi4py suite under launcher {launcher}: exit {res.returncode} in {took[launcher]:.0f}s: "
              f"{results[launcher]}")
        assert len(results[launcher]["ran"]) == 2, out[-5000:]
        assert_no_orphans(info, f"it-m4p-{launcher}", hosts=info.nodes[:2])
    assert results["ssh"] == results["mpi"], results
