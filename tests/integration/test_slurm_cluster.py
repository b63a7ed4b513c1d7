"""backend: slurm against a real Slurm cluster (Debian's slurm-wlm and munge in containers, testcluster_slurm).

Every job runs clusterctl's host supervisor on each node of the allocation (one srun task per node), so what
is shown here is the supervisor's: fit_a_line in pserver sync mode (workspace dispatched to every node),
mlp_collective (workspace on the cluster's shared filesystem), restarts (kill -9 of a trainer: a new
attempt, success, both attempts' logs and status), fail-fast (a trainer exits 3: the job fails naming it,
the rest stopped), and a job whose pserver a stranger cannot use (the job's token: a made-up `init` is
refused and the job goes on), whose files are private, which runs nothing a local user pre-created at the
old predictable /tmp names, and whose stop kills exactly its processes and leaves no orphan on any node.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml

from clusterlib import (ROOT, assert_mlp_ranks_match_single, cli_to_interrupt, clusterctl, docker, interrupt, listening,
                        node_exec, read_until, status_json, tagged_pids, wait_until)

pytestmark = pytest.mark.integration

NODES = 3
CLUSTER_NAME = os.environ.get("CLUSTERCTL_TESTCLUSTER_NAME", "clusterctl-pytest") + "-slurm"
VENV_PY = "/opt/venv/bin/python"
# How long a started job may take to have every supervisor up: sbatch, the allocation, the package and the
# srun step (docs/slurm.md); generous for a loaded machine.
UP_S = 90

# Every trainer leaves a child behind that setsid()s, ignores SIGTERM and sleeps: it escapes its supervisor's
# process group and Slurm's step (proctrack/linuxproc follows the process tree), so only the sweep by
# CLUSTERCTL_JOB ends it. Attempt 0 of trainer FAIL_TRAINER exits 3; with SLOW_ATTEMPT0 every trainer of
# attempt 0 waits to be killed, and later attempts finish at once.
ORPHANING = """\
import os, signal, sys, time
if os.environ["TRAINING_ROLE"] == "PSERVER":
    from clusterctl.ps.__main__ import main
    sys.exit(main(["server"]))
attempt = int(os.environ["CLUSTERCTL_RESTART_COUNT"])
if os.fork() == 0:
    os.setsid()
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    time.sleep(600)
    os._exit(0)
tid = int(os.environ["PADDLE_TRAINER_ID"])
print(f"trainer={tid} attempt={attempt} rank={os.environ['RANK']} world={os.environ['WORLD_SIZE']} "
      f"endpoint={os.environ['PADDLE_CURRENT_ENDPOINT']} master={os.environ['MASTER_ADDR']}", flush=True)
if os.environ.get("FAIL_TRAINER") == str(tid):
    time.sleep(1)
    sys.exit(3)
if os.environ.get("SLOW_ATTEMPT0") and attempt > 0:
    time.sleep(1)
    sys.exit(0)
time.sleep(600)
"""


@pytest.fixture(scope="module")
def slurm_cluster(testcluster_packages, clusterctl_wheel):
    """A 3-node Slurm cluster with this checkout of clusterctl (the session's wheel) in every node's /opt/venv."""
    from clusterctl import testcluster as tc
    from clusterctl import testcluster_slurm as tsl
    from clusterctl.errors import ClusterctlError

    try:
        tc.ensure_docker()
    except ClusterctlError as exc:
        if os.environ.get("CI", "").lower() in ("true", "1", "yes"):
            pytest.fail(f"docker cannot be used: {exc}")
        pytest.skip(f"docker cannot be used: {exc}")
    t0 = time.monotonic()
    packages = testcluster_packages
    info = tsl.up(NODES, name=CLUSTER_NAME, packages=packages)
    wheel = clusterctl_wheel

    def install(container: str) -> None:
        docker("cp", str(wheel), f"{container}:/tmp/{wheel.name}")
        docker("exec", container, "/opt/venv/bin/pip", "install", "-q", "--no-deps", "--no-index",
               "--force-reinstall", f"/tmp/{wheel.name}", timeout=120)

    with ThreadPoolExecutor(len(info.nodes)) as pool:
        list(pool.map(install, [n.container for n in info.nodes]))
    print(f"slurm cluster {info.name} up in {time.monotonic() - t0:.1f}s ({info.timings}), packages {packages}")
    yield info
    if os.environ.get("CLUSTERCTL_KEEP_TESTCLUSTER") != "1":
        tsl.down(CLUSTER_NAME)


def slurm_spec(info, path: Path, name: str, workspace: Path, remote: str, job: dict, *, shared: bool = False) -> Path:
    """A backend: slurm spec for the test Slurm cluster (its own written spec's ssh and slurm sections)."""
    base = yaml.safe_load(Path(info.spec_path).read_text())
    slurm = dict(base["slurm"], workspace="shared" if shared else "dispatch")
    # a loaded machine (2 cores, many test clusters) can take longer than the written spec's 5 s to accept ssh
    spec = {"name": name, "backend": "slurm", "slurm": slurm, "ssh": dict(base["ssh"], connect_timeout=30),
            "workspace": {"local": str(workspace), "remote": remote}, "job": job}
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def no_tagged(info, job: str, timeout: float = 15) -> dict[str, list[int]]:
    """Wait until no node has a process tagged with job; return what is still there."""
    deadline = time.monotonic() + timeout
    while True:
        left = {n.container: tagged_pids(n.container, job) for n in info.nodes}
        if not any(left.values()) or time.monotonic() > deadline:
            return {c: p for c, p in left.items() if p}
        time.sleep(0.5)


def wait_status(spec: Path, pred, timeout: float = UP_S) -> dict:
    """Poll `clusterctl status --json` until pred(status) holds; the status."""
    deadline = time.monotonic() + timeout
    while True:
        st = status_json(spec)
        if pred(st):
            return st
        assert time.monotonic() < deadline, f"status never matched within {timeout}s: {st}"
        time.sleep(0.5)


def _orphaning_job(info, tmp_path, name: str, job: dict, base: int) -> Path:
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "job.py").write_text(ORPHANING)
    spec_job = {"mode": "collective", "entrypoint": [VENV_PY, "job.py"], "trainers": 1, "grace": 2,
                "ports": {"control": base, "master": base + 1, "pserver": base + 5, "trainer": base + 10}, **job}
    spec = slurm_spec(info, tmp_path / f"{name}.yaml", name, ws, f"clusterctl-it/{name}", spec_job)
    clusterctl("stop", spec, check=True)
    return spec


@pytest.mark.timeout(600)  # the first test also brings the cluster up (an image build when not cached)
def test_fit_a_line_pserver_sync_through_slurm(slurm_cluster, tmp_path):
    info = slurm_cluster
    spec = slurm_spec(info, tmp_path / "fal.yaml", "it-slurm-fal", ROOT / "examples" / "fit_a_line",
                      "clusterctl-it/slurm-fal",
                      {"mode": "pserver", "entrypoint": ["/opt/venv/bin/python", "train.py"], "pservers": 2,
                       "trainers": 1, "sync": "sync", "grace": 3,
                       "ports": {"control": 7460, "pserver": 7470, "trainer": 7480}})
    clusterctl("stop", spec, check=True)
    plan = clusterctl("plan", spec, "--json", check=True).stdout
    assert '"PADDLE_PSERVERS_IP_PORT_LIST": "slurm-node-0.invalid:7470,slurm-node-1.invalid:7470"' in plan
    res = clusterctl("start", spec, "--dispatch", "--follow", timeout=240)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr
    done = re.findall(r"\[(\S+) trainer\.(\d)\] done steps=\d+ loss=([\d.]+) .* mode=(\w+)", res.stdout)
    assert sorted(t for _, t, _, _ in done) == ["0", "1", "2"], res.stdout[-3000:]
    assert all(m == "sync" and float(loss) < 10 for _, _, loss, m in done), done
    # trainer i on node i of the allocation, pservers on nodes 0 and 1, each listening on its node's own IP
    assert {(node, t) for node, t, _, _ in done} == {(n.hostname, str(i)) for i, n in enumerate(info.nodes)}
    pserver_log = clusterctl("logs", spec, "--role", "pserver", "--id", "1", check=True).stdout
    assert f"[{info.nodes[1].hostname} pserver.1]" in pserver_log
    assert f"listening on tcp://{info.nodes[1].ip}:7470" in pserver_log
    assert "NOT authenticated" not in pserver_log  # the job's token reached the pserver
    final = status_json(spec)
    assert (final["backend"], final["state"]) == ("slurm", "succeeded"), final
    assert re.match(r"Slurm job \d+ COMPLETED \(exit 0:0\) on ", final["reason"]), final["reason"]
    rows = {(p["host"], p["role"], p["id"]): p["state"] for p in final["processes"]}
    hosts = [n.hostname for n in info.nodes]
    assert {k: v for k, v in rows.items() if k[1] == "trainer"} == {
        (hosts[i], "trainer", i): "exited" for i in range(3)}
    assert set(k for k in rows if k[1] == "pserver") == {(hosts[0], "pserver", 0), (hosts[1], "pserver", 1)}
    assert not no_tagged(info, "it-slurm-fal")


@pytest.mark.timeout(300)
def test_mlp_collective_from_the_shared_filesystem(slurm_cluster, tmp_path):
    info = slurm_cluster
    spec = slurm_spec(info, tmp_path / "mlp.yaml", "it-slurm-mlp", ROOT / "examples" / "mlp_collective",
                      "/shared/it-slurm-mlp",
                      {"mode": "collective", "entrypoint": ["/opt/venv/bin/python", "train.py"],
                       "args": ["--steps", "300", "--batch", "96"], "trainers": 1, "env": {"UCX_TLS": "tcp,self"},
                       "grace": 3, "ports": {"control": 7500, "master": 7501, "trainer": 7510}}, shared=True)
    clusterctl("stop", spec, check=True)
    res = clusterctl("dispatch", spec, check=True)
    assert re.findall(r"^│ (\S+) ", res.stdout, re.MULTILINE) == [info.nodes[0].ip], res.stdout  # the login node only
    res = clusterctl("start", spec, "--follow", timeout=240)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr
    assert_mlp_ranks_match_single(res.stdout, ranks=3, steps=300, batch=96)
    assert status_json(spec)["state"] == "succeeded"


@pytest.mark.timeout(300)
def test_a_killed_trainer_restarts_the_job_through_the_supervisor(slurm_cluster, tmp_path):
    info = slurm_cluster
    hosts = [n.hostname for n in info.nodes]
    spec = _orphaning_job(info, tmp_path, "it-slurm-restart", {"env": {"SLOW_ATTEMPT0": "1"}, "restarts": 1,
                                                                  "restart_backoff": 1}, 7560)
    clusterctl("start", spec, "--dispatch", check=True, timeout=120)
    st = wait_status(spec, lambda s: len(s["processes"]) == 3 and all(p["state"] == "running" for p in s["processes"]))
    assert (st["state"], st["attempt"], st["restarts"]) == ("running", 0, 1), st
    victim = next(p for p in st["processes"] if p["id"] == 1)
    assert victim["host"] == hosts[1]
    node_exec(info.nodes[1].container, f"kill -9 {victim['pid']}")
    # the supervisors' word comes first; Slurm's (the reason) once the batch script has ended the allocation
    st = wait_status(spec, lambda s: s["state"] in ("succeeded", "failed", "stopped")
                     and not re.search(r"Slurm job \d+ (RUNNING|COMPLETING)", s["reason"] or ""))
    assert (st["state"], st["attempt"]) == ("succeeded", 1), st
    assert [(a["attempt"], a["outcome"], a["reason"]) for a in st["attempts"]] == [
        (0, "failed", f"trainer.1 on {hosts[1]} exited with code -9"),
        (1, "succeeded", "all 3 trainers exited 0")], st["attempts"]
    assert [(p["host"], p["id"], p["state"], p["exit_code"]) for p in st["processes"]] == [
        (hosts[i], i, "exited", 0) for i in range(3)]
    assert re.match(r"Slurm job \d+ COMPLETED \(exit 0:0\)", st["reason"]), st["reason"]
    logs = clusterctl("logs", spec, check=True).stdout.splitlines()
    for i in range(3):
        for attempt, suffix in ((0, ""), (1, "#1")):
            line = next((ln for ln in logs if ln.startswith(f"[{hosts[i]} trainer.{i}{suffix}] ")), None)
            assert line is not None and f"trainer={i} attempt={attempt} rank={i} world=3" in line, logs
    assert not no_tagged(info, "it-slurm-restart")  # both attempts' setsid children included


@pytest.mark.timeout(300)
def test_a_failed_trainer_fails_the_job_and_leaves_nothing(slurm_cluster, tmp_path):
    info = slurm_cluster
    hosts = [n.hostname for n in info.nodes]
    spec = _orphaning_job(info, tmp_path, "it-slurm-fail", {"env": {"FAIL_TRAINER": "1"}}, 7520)
    res = clusterctl("start", spec, "--dispatch", "--follow", timeout=180)
    assert res.returncode == 1, res.stdout[-3000:] + res.stderr
    ranks = re.findall(r"\[(\S+) trainer\.(\d)\] trainer=\d attempt=0 rank=(\d) world=3 endpoint=([\d.]+):(\d+) "
                       r"master=([\d.]+)", res.stdout)
    assert sorted(r[1] for r in ranks) == ["0", "1", "2"], res.stdout + res.stderr
    by_node = {n.hostname: n.ip for n in info.nodes}
    assert all(by_node[node] == ip and port == "7530" and master == info.nodes[0].ip
               for node, _, _, ip, port, master in ranks), ranks
    st = status_json(spec)
    assert st["state"] == "failed", st
    assert re.match(r"Slurm job \d+ FAILED \(exit 1:0\) on ", st["reason"]), st["reason"]
    assert f"trainer.1 on {hosts[1]} exited with code 3" in st["reason"], st["reason"]
    by = {(p["role"], p["id"]): (p["state"], p["exit_code"]) for p in st["processes"]}
    assert by == {("trainer", 0): ("stopped", -15), ("trainer", 1): ("failed", 3), ("trainer", 2): ("stopped", -15)}
    assert not no_tagged(info, "it-slurm-fail")  # the setsid children that ignored SIGTERM included


# Holds a TCP port on a node, as another program there would, until killed.
HOLD_PORT = "import socket, sys, time; s = socket.socket(); s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(); time.sleep(300)"


@pytest.mark.timeout(300)
def test_a_port_in_use_on_a_node_fails_the_job_at_its_start_by_preflight_and_is_never_restarted(slurm_cluster, tmp_path):
    """The ssh path's `agent up` runs preflight before the launch; Slurm's node task started its supervisor with none:
    a trainer's port in use on a node surfaced only when the trainer bound it, after every process had started, and
    was restarted as any failure. Now the node's preflight fails the first attempt at its spawn, on every node at
    once, with the port named and no restart."""
    info = slurm_cluster
    node = info.nodes[1]
    docker("exec", "-d", node.container, "python3", "-c", HOLD_PORT, node.ip, "7570")
    try:
        assert wait_until(lambda: listening(node.container, 7570), 20)
        spec = _orphaning_job(info, tmp_path, "it-slurm-preflight", {"restarts": 2}, 7560)
        res = clusterctl("start", spec, "--dispatch", "--follow", timeout=180)
        assert res.returncode == 1, res.stdout[-3000:] + res.stderr
        st = status_json(spec)
        problem = f"preflight: trainer.1: cannot bind {node.ip}:7570: Address already in use"
        assert st["state"] == "failed", st
        assert f"trainer.1 on {node.hostname} failed to start: {problem}" in st["reason"], st["reason"]
        assert "trainer=1 attempt=" not in res.stdout  # trainer.1 never ran
        assert "attempt=1" not in res.stdout, res.stdout[-3000:]  # not restarted
        assert not no_tagged(info, "it-slurm-preflight")
    finally:
        node_exec(node.container, "pkill -f 'time.sleep(300)' || true")


# The old batch program's predictable names (before the supervisor): srun executed the first, read the second.
OLD_NAMES = ("/tmp/clusterctl-slurm-{id}-slurmjob.py", "/tmp/clusterctl-slurm-{id}-tasks.json")
PWNED = "import os; open('/tmp/pwned-{id}', 'w').write(str(os.getuid()))"
# Every file holding the token (read from the job file named first, never put in an argv): the processes'
# command lines and environments, then the trees named after it.
FIND_TOKEN = """\
import os, sys
token = __import__("json").load(open(sys.argv[1]))["token"].encode()
paths = [f"/proc/{p}/{k}" for p in os.listdir("/proc") if p.isdigit() for k in ("cmdline", "environ")]
for top in sys.argv[2:]:
    paths += [os.path.join(d, f) for d, _, fs in os.walk(top) for f in fs]
for path in paths:
    try:
        with open(path, "rb") as fh:
            if token in fh.read():
                print(path)
    except OSError:
        pass
"""
STRANGER = (Path(__file__).parent / "jobs" / "ps_stranger.py").read_text()


@pytest.mark.timeout(300)
def test_the_jobs_token_files_and_stop(slurm_cluster, tmp_path):
    info = slurm_cluster
    head, nodes, hosts = info.nodes[0].container, info.nodes, [n.hostname for n in info.nodes]
    spec = _orphaning_job(info, tmp_path, "it-slurm-stop", {"mode": "pserver", "pservers": 1}, 7540)
    clusterctl("dispatch", spec, check=True)
    # a local user pre-creates the old predictable names, world-writable, with code of theirs, for the next jobs
    probe = node_exec(head, "sbatch --parsable --wrap=true").strip()
    ids = [int(probe) + k for k in range(1, 4)]
    for n in nodes:
        for i in ids:
            for name in OLD_NAMES:
                node_exec(n.container, f"printf %s {shlex.quote(PWNED.format(id=i))} > {name.format(id=i)} && "
                          f"chmod 0777 {name.format(id=i)} && chown nobody {name.format(id=i)}", user="root")
    before = {n.container: node_exec(n.container, "ls /tmp") for n in nodes}

    res = clusterctl("start", spec, check=True, timeout=120)
    assert re.search(r"started in [\d.]+s", res.stdout), res.stdout
    again = clusterctl("start", spec)
    assert again.returncode == 1 and re.search(r"job it-slurm-stop is already (pending|running) as Slurm job \d+; "
                                               r"stop it first", again.stderr), again.stdout + again.stderr
    st = wait_status(spec, lambda s: len(s["processes"]) == 4 and all(p["state"] == "running" for p in s["processes"]))
    slurm_id = re.match(r"Slurm job (\d+) RUNNING", st["reason"]).group(1)
    assert int(slurm_id) in ids
    deadline = time.monotonic() + 30
    while "listening on" not in clusterctl("logs", spec, "--role", "pserver").stdout:
        assert time.monotonic() < deadline, "the pserver never said it listens"
        time.sleep(0.5)

    # the token: made inside the allocation, the same in every node's job file, and nowhere else
    jobdirs = {n.container: f"/root/.clusterctl/slurm/jobs/it-slurm-stop/{slurm_id}-{n.hostname}" for n in nodes}
    tokens = {json.loads(node_exec(c, f"cat {d}/job.json"))["token"] for c, d in jobdirs.items()}
    assert len(tokens) == 1 and len(token := tokens.pop()) == 64
    script = node_exec(head, f"scontrol write batch_script {slurm_id} -")
    assert script.startswith("#!/bin/bash\n#SBATCH --job-name=clusterctl-it-slurm-stop\n") and token not in script
    logs_dir = "/root/clusterctl-it/it-slurm-stop.logs"
    for c in jobdirs:
        where = node_exec(c, f"python3 -c {shlex.quote(FIND_TOKEN)} {jobdirs[c]}/job.json {logs_dir} /tmp /root/.clusterctl")
        assert where.split() == [f"{jobdirs[c]}/job.json"], (c, where)
        pids = tagged_pids(c, "it-slurm-stop")
        keys = {node_exec(c, f"tr '\\0' '\\n' < /proc/{p}/environ | sed -n 's/^CLUSTERCTL_JOB_TOKEN=//p'").strip()
                for p in pids}
        assert len(keys) == 1 and len(key := keys.pop()) == 64 and key != token, keys  # the derived key only
    # the files: the job's own directories 0700, its files 0600
    modes = node_exec(head, f"stat -c '%a %n' {jobdirs[head]} {jobdirs[head]}/job.json {jobdirs[head]}/state.json "
                            f"{logs_dir} {logs_dir}/slurm-{slurm_id}.out {logs_dir}/trainer.0.log {logs_dir}/pserver.0.log")
    assert [line.split()[0] for line in modes.splitlines()] == ["700", "600", "600", "700", "600", "600", "600"], modes

    # a stranger reaches nothing (no CURVE handshake without the job's keys: its made-up init and the complete
    # that once ended a token-less pserver never arrive; keys of another token are refused); the job's key works
    pserver = f"{nodes[0].ip}:7545"
    node_exec(nodes[1].container, f"cat > /root/stranger.py <<'EOF'\n{STRANGER}EOF")
    out = node_exec(nodes[1].container, f"echo {key} | {VENV_PY} /root/stranger.py {pserver}", timeout=90)
    got = json.loads(out)  # another token's keys: refused by the door, or the handshake never completes
    assert got["plain"] == "no answer" and got["wrong"] in ("refused", "no answer") and got["right"] == "served", out
    time.sleep(1)  # were the complete accepted, the pserver would exit now: give it the time to
    st = status_json(spec)
    assert st["state"] == "running" and {(p["role"], p["state"]) for p in st["processes"]} == {
        ("pserver", "running"), ("trainer", "running")}, st
    pserver_log = clusterctl("logs", spec, "--role", "pserver", check=True).stdout
    assert f"[{hosts[0]} pserver.0]" in pserver_log and "NOT authenticated" not in pserver_log

    # stop: exactly the job's processes (1 pserver, 3 trainers, their 3 setsid children), none left anywhere
    tagged = {n.container: tagged_pids(n.container, "it-slurm-stop") for n in nodes}
    assert sorted(len(p) for p in tagged.values()) == [2, 2, 3], tagged
    assert listening(head, 7540) and listening(head, 7545)
    res = clusterctl("stop", spec, check=True, timeout=120)
    assert res.stdout.strip() == (f"job it-slurm-stop stopped on 3 host(s) (Slurm job {slurm_id} CANCELLED), "
                                  "7 process(es) killed"), res.stdout
    assert not no_tagged(info, "it-slurm-stop", timeout=2)
    assert not [p for p in (7540, 7545) if listening(head, p)]  # the coordinator's and the pserver's ports are free
    st = status_json(spec)
    assert st["state"] == "stopped" and st["reason"].startswith(f"Slurm job {slurm_id} CANCELLED"), st
    assert "is not running" in clusterctl("stop", spec, check=True).stdout

    # nothing the local user left at the old names ran, and the job made no file in /tmp
    for n in nodes:
        assert node_exec(n.container, "ls /tmp") == before[n.container], n.container
        assert node_exec(n.container, "ls /tmp/pwned-* 2>/dev/null || true") == ""
        for i in ids:
            assert node_exec(n.container, f"cat {OLD_NAMES[0].format(id=i)}") == PWNED.format(id=i)


# A trainer that prints a progress line per step (as clusterctl.report writes them) until it is stopped.
PROGRESS = """\
import time
for step in range(1000000):
    print("step=%d loss=%.4f time=%.3f" % (step, 1.0 / (step + 1), time.time()), flush=True)
    time.sleep(0.1)
"""


@pytest.mark.timeout(300)
def test_top_lists_every_process_with_its_steps(slurm_cluster, tmp_path):
    """`clusterctl top` under Slurm: every node's supervisor answers in one srun --overlap step."""
    info = slurm_cluster
    hosts = [n.hostname for n in info.nodes]
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "job.py").write_text(PROGRESS)
    job = {"mode": "collective", "entrypoint": [VENV_PY, "job.py"], "trainers": 1, "grace": 2,
           "ports": {"control": 7600, "master": 7601, "pserver": 7605, "trainer": 7610}}
    spec = slurm_spec(info, tmp_path / "top.yaml", "it-slurm-top", ws, "clusterctl-it/slurm-top", job)
    clusterctl("stop", spec, check=True)
    clusterctl("start", spec, "--dispatch", check=True, timeout=120)
    try:
        wait_status(spec, lambda s: len(s["processes"]) == 3 and all(p["state"] == "running" for p in s["processes"]))
        deadline = time.monotonic() + 20
        while True:
            res = clusterctl("top", spec, "--once", "--json", "--no-gpu", timeout=60)
            doc = json.loads(res.stdout)
            if all((p["progress"] or {}).get("step", 0) > 0 for p in doc["processes"]) or time.monotonic() > deadline:
                break
            time.sleep(1)
        assert res.returncode == 0 and doc["state"] == "running", res.stdout + res.stderr
        assert [(h["host"], h["status"], h["state"]) for h in doc["hosts"]] == [(h, "ok", "running") for h in hosts]
        assert [(p["host"], p["name"], p["state"]) for p in doc["processes"]] == [
            (hosts[i], f"trainer.{i}", "running") for i in range(3)]
        assert all(p["progress"]["step"] > 0 and p["progress"]["metrics"]["loss"] > 0 and p["rss_bytes"] > 1 << 20
                   for p in doc["processes"]), doc["processes"]
        # `status` shows each process's progress too, as over SSH (it showed none under Slurm)
        res = clusterctl("status", spec, "--json", timeout=60)
        st = json.loads(res.stdout)
        assert [(p["host"], p["id"], p["progress"]["step"] > 0) for p in st["processes"]] == [
            (hosts[i], i, True) for i in range(3)], res.stdout + res.stderr
        assert st["stragglers"] == []
    finally:
        clusterctl("stop", spec, check=True)
    assert not no_tagged(info, "it-slurm-top")


@pytest.mark.timeout(300)
def test_ctrl_c_on_start_follow_cancels_the_allocation_and_leaves_nothing(slurm_cluster, tmp_path):
    """Ctrl+C while `start --follow` streams a Slurm job's logs: the same cleanup as over ssh (the job stopped
    through fresh connections, exit 130), and the allocation cancelled."""
    info = slurm_cluster
    head = info.nodes[0].container
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "job.py").write_text(PROGRESS)
    job = {"mode": "collective", "entrypoint": [VENV_PY, "job.py"], "trainers": 1, "grace": 2,
           "ports": {"control": 7620, "master": 7621, "pserver": 7625, "trainer": 7630}}
    spec = slurm_spec(info, tmp_path / "sigint.yaml", "it-slurm-sigint", ws, "clusterctl-it/slurm-sigint", job)
    clusterctl("stop", spec, check=True)
    with cli_to_interrupt("start", spec, "--dispatch", "--follow") as proc:
        # every node's trainer has stepped: its lines are in the followed logs
        seen = read_until(proc, lambda seen: sum("step=2 " in s for s in seen) == NODES, UP_S)
        assert sum("step=2 " in s for s in seen) == NODES, "".join(seen)
        slurm_id = node_exec(head, "squeue -h -o %i -n clusterctl-it-slurm-sigint").strip()
        assert slurm_id.isdigit(), slurm_id
        rest = interrupt(proc, 90)
    out = "".join(seen) + rest
    assert proc.returncode == 130 and "interrupted: stopping the job" in rest, out
    assert "Traceback" not in out, out
    assert not no_tagged(info, "it-slurm-sigint")
    assert node_exec(head, f"squeue -h -j {slurm_id} -o %T 2>/dev/null || true").strip() in ("", "CANCELLED",
                                                                                           "COMPLETING"), out
    st = status_json(spec)
    assert st["state"] == "stopped" and st["reason"].startswith(f"Slurm job {slurm_id} CANCELLED"), st
    assert "is not running" in clusterctl("stop", spec, check=True).stdout


@pytest.mark.timeout(300)
def test_ctrl_c_on_logs_follow_of_a_quiet_job_leaves_no_follower_on_the_nodes(slurm_cluster, tmp_path):
    """`logs --follow` under Slurm runs `agent logs --follow` on each node over ssh: after Ctrl+C, each one ends at
    its next keepalive (clusterctl/host/logtail.py KEEPALIVE_S), although the job writes nothing more."""
    from clusterctl.host.logtail import KEEPALIVE_S

    info = slurm_cluster
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "job.py").write_text("import time\nprint('step=0 quiet now', flush=True)\ntime.sleep(600)\n")
    job = {"mode": "collective", "entrypoint": [VENV_PY, "job.py"], "trainers": 1, "grace": 2,
           "ports": {"control": 7640, "master": 7641, "pserver": 7645, "trainer": 7650}}
    spec = slurm_spec(info, tmp_path / "quiet.yaml", "it-slurm-quiet", ws, "clusterctl-it/slurm-quiet", job)
    clusterctl("stop", spec, check=True)
    clusterctl("start", spec, "--dispatch", check=True, timeout=120)

    def followers():
        return {n.container: node_exec(n.container, "pgrep -f '[a]gent logs .*--follow' || true").split()
                for n in info.nodes}

    try:
        wait_status(spec, lambda s: len(s["processes"]) == NODES and all(p["state"] == "running"
                                                                          for p in s["processes"]))
        with cli_to_interrupt("logs", spec, "--follow") as proc:
            seen = read_until(proc, lambda seen: sum("step=0 quiet now" in s for s in seen) == NODES, UP_S)
            assert sum("step=0 quiet now" in s for s in seen) == NODES, "".join(seen)
            assert all(followers().values()), followers()
            rest = interrupt(proc, 30)
        assert proc.returncode == 130 and "Traceback" not in rest, "".join(seen) + rest
        # 20: polling and a loaded machine
        assert wait_until(lambda: not any(followers().values()), 2 * KEEPALIVE_S + 20), followers()
        assert status_json(spec)["state"] == "running"
    finally:
        clusterctl("stop", spec, check=True, timeout=120)
    assert not no_tagged(info, "it-slurm-quiet")
