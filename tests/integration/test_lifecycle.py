"""The job lifecycle over real SSH: dispatch → start → status → logs → stop, failures, and no orphans."""

from __future__ import annotations

import hashlib
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
import yaml

from clusterlib import (
    JOBS, ROOT, assert_no_orphans, cli_to_interrupt, clusterctl, clusterctl_while_paused, interrupt, job_ports,
    job_spec, listening, node_exec, port_base, read_until, status_json, tagged_pids, via, wait_state, wait_until,
    write_spec,
)

pytestmark = pytest.mark.integration

def nodes_of(info, n):
    return info.nodes[:n]


@pytest.mark.timeout(180)
def test_full_cycle_pserver_mode(testcluster, tmp_path):
    spec = job_spec(testcluster, tmp_path, "it-cycle", hosts=3, pservers=2, env={"STEPS": "600", "STEP_S": "0.1"})
    clusterctl("dispatch", spec, check=True)
    try:
        res = clusterctl("start", spec, check=True)
        assert "job it-cycle: running" in res.stdout
        st = status_json(spec)
        assert st["state"] == "running"
        rows = sorted((p["role"], p["id"], p["host"], p["state"]) for p in st["processes"])
        ips = [n.ip for n in testcluster.nodes[:3]]
        assert rows == [
            ("pserver", 0, ips[0], "running"),
            ("pserver", 1, ips[1], "running"),
            ("trainer", 0, ips[0], "running"),
            ("trainer", 1, ips[1], "running"),
            ("trainer", 2, ips[2], "running"),
        ]
        assert all(isinstance(p["pid"], int) for p in st["processes"])
        time.sleep(1)
        logs = clusterctl("logs", spec, check=True).stdout.splitlines()
        assert f"[{ips[2]} trainer.2] trainer 2 argv=['trainer', '2'] endpoint={ips[2]}:{job_ports(spec)[2]}" in logs
        assert f"[{ips[1]} pserver.1] pserver listening" in logs
        only = clusterctl("logs", spec, "--role", "trainer", "--id", "1", "-n", "1", check=True).stdout.splitlines()
        assert len(only) == 1 and only[0].startswith(f"[{ips[1]} trainer.1] step=")
    finally:
        res = clusterctl("stop", spec)
    assert res.returncode == 0, res.stderr
    # every host's processes counted, once each: also those the coordinator's broadcast stopped first (issue 22.7)
    assert "job it-cycle stopped on 3 host(s), 5 process(es) killed" in res.stdout, res.stdout
    assert_no_orphans(testcluster, "it-cycle", job_ports(spec))
    assert status_json(spec)["state"] in ("stopped", "failed")
    again = clusterctl("stop", spec, check=True)
    assert again.stdout.strip() == "job it-cycle is not running"


@pytest.mark.timeout(180)
def test_all_trainers_succeed_then_pservers_are_stopped(testcluster, tmp_path):
    spec = job_spec(testcluster, tmp_path, "it-success", hosts=3, env={"STEPS": "3"})
    clusterctl("dispatch", spec, check=True)
    clusterctl("start", spec, check=True)
    st = wait_state(spec, {"succeeded", "failed"})
    assert st["state"] == "succeeded", st
    by = {(p["role"], p["id"]): p for p in st["processes"]}
    assert all(by[("trainer", i)]["state"] == "exited" and by[("trainer", i)]["exit_code"] == 0 for i in range(3))
    assert all(by[("pserver", i)]["state"] == "stopped" for i in range(2))
    assert_no_orphans(testcluster, "it-success", job_ports(spec))


@pytest.mark.timeout(180)
def test_logs_outlive_later_dispatches(testcluster, tmp_path):
    """Logs live beside the workspace: the generation a job ran in is recycled two dispatches later."""
    spec = job_spec(testcluster, tmp_path, "it-keeplogs", hosts=2, env={"STEPS": "3"})
    ws = tmp_path / "ws"
    shutil.copytree(JOBS, ws, ignore=shutil.ignore_patterns("__pycache__"))
    data = yaml.safe_load(spec.read_text())
    data["workspace"]["local"] = str(ws)
    spec.write_text(yaml.safe_dump(data))
    clusterctl("dispatch", spec, check=True)
    clusterctl("start", spec, check=True)
    assert wait_state(spec, {"succeeded", "failed"})["state"] == "succeeded"
    before = sorted(clusterctl("logs", spec, check=True).stdout.splitlines())
    assert any("trainer 1 argv=['trainer', '1']" in line for line in before), before
    for i in range(2):  # two new generations: the second recycles the one the job ran in
        (ws / "extra.txt").write_text(f"v{i}\n")
        clusterctl("dispatch", spec, check=True)
    assert sorted(clusterctl("logs", spec, check=True).stdout.splitlines()) == before
    remote = data["workspace"]["remote"]
    for n in testcluster.nodes[:2]:
        assert node_exec(n.container, f"ls {testcluster.home}/{remote}.logs").split(), n.container


@pytest.mark.timeout(240)
def test_dispatches_while_a_job_runs_leave_its_generation_alone(testcluster, tmp_path):
    """Fuzzing `fab start` found two refused starts (each ships the workspace first) recycling a running job's
    generation: its own files deleted, its code replaced; a third removed it. The job's supervisor holds its
    generation: three dispatches later the job runs on, in the files it started with."""
    spec = job_spec(testcluster, tmp_path, "it-held", hosts=2, mode="collective", env={"STEPS": "6000", "STEP_S": "0.1"})
    ws = tmp_path / "ws"
    shutil.copytree(JOBS, ws, ignore=shutil.ignore_patterns("__pycache__"))
    data = yaml.safe_load(spec.read_text())
    data["workspace"]["local"] = str(ws)
    spec.write_text(yaml.safe_dump(data))
    original = hashlib.sha256((ws / "job.py").read_bytes()).hexdigest()
    clusterctl("dispatch", spec, check=True)
    try:
        clusterctl("start", spec, check=True)
        node = testcluster.nodes[0]
        pid = next(p["pid"] for p in status_json(spec)["processes"] if p["host"] == node.ip)
        held = node_exec(node.container, f"readlink /proc/{pid}/cwd", user=testcluster.user).strip()
        node_exec(node.container, f"echo mine > {held}/out.txt", user=testcluster.user)  # the job's own output in its workspace
        for i in range(3):
            (ws / "job.py").write_text((JOBS / "job.py").read_text() + f"# v{i}\n")
            clusterctl("dispatch", spec, check=True)
        remote = f"{testcluster.home}/{data['workspace']['remote']}"
        assert node_exec(node.container, f"readlink -f {remote}").strip() != held
        assert node_exec(node.container, f"cat {held}/out.txt") == "mine\n"
        assert node_exec(node.container, f"sha256sum < {held}/job.py").split()[0] == original
        assert node_exec(node.container, f"readlink /proc/{pid}/cwd", user=testcluster.user).strip() == held
        assert status_json(spec)["state"] == "running"
    finally:
        clusterctl("stop", spec, check=True)
    for i in range(2):  # the job ended: its generation is pruned as any other
        (ws / "extra.txt").write_text(f"after {i}\n")
        clusterctl("dispatch", spec, check=True)
    assert wait_until(lambda: node_exec(node.container, f"test -e {held} && echo yes || true").strip() == "", 30)


@pytest.mark.timeout(180)
def test_failed_trainer_stops_the_whole_job(testcluster, tmp_path):
    env = {"STEPS": "600", "STEP_S": "0.1", "FAIL_TRAINER": "1", "FAIL_CODE": "3", "FAIL_AFTER": "3"}
    spec = job_spec(testcluster, tmp_path, "it-fail", hosts=3, env=env)
    clusterctl("dispatch", spec, check=True)
    t0 = time.monotonic()
    clusterctl("start", spec, check=True)
    st = wait_state(spec, {"failed"}, timeout=30)
    assert time.monotonic() - t0 < 30  # the others would have run for a minute
    by = {(p["role"], p["id"]): p for p in st["processes"]}
    assert by[("trainer", 1)]["state"] == "failed" and by[("trainer", 1)]["exit_code"] == 3
    assert {by[("trainer", i)]["state"] for i in (0, 2)} == {"stopped"}
    assert "trainer.1" in (st["reason"] or ""), st
    assert_no_orphans(testcluster, "it-fail", job_ports(spec))


@pytest.mark.timeout(120)
def test_missing_entrypoint_starts_nothing_anywhere(testcluster, tmp_path):
    spec = job_spec(testcluster, tmp_path, "it-noentry", hosts=2, entrypoint=["python3", "no_such_script.py"])
    clusterctl("dispatch", spec, check=True)
    res = clusterctl("start", spec)
    assert res.returncode == 1
    ips = [n.ip for n in testcluster.nodes[:2]]
    assert "preflight failed, nothing started" in res.stderr
    for ip in ips:
        assert f"{ip}: " in res.stderr and "no_such_script.py" in res.stderr
    assert_no_orphans(testcluster, "it-noentry", job_ports(spec), within=1)


@pytest.mark.timeout(120)
def test_port_held_on_one_host_is_named_and_nothing_starts(testcluster, tmp_path):
    spec = job_spec(testcluster, tmp_path, "it-port", hosts=2)
    clusterctl("dispatch", spec, check=True)
    node = testcluster.nodes[1]
    trainer_port = job_ports(spec)[2]
    holder = subprocess.Popen(
        ["docker", "exec", node.container, "python3", "-c",
         f"import socket,time; s=socket.socket(); s.bind(('{node.ip}', {trainer_port})); s.listen(); time.sleep(60)"],
    )
    try:
        deadline = time.monotonic() + 10
        while not listening(node.container, trainer_port) and time.monotonic() < deadline:
            time.sleep(0.2)
        res = clusterctl("start", spec)
    finally:
        holder.kill()
        node_exec(node.container, f"pkill -f 's.bind..{node.ip}., {trainer_port}' || true", check=False)
    assert res.returncode == 1
    assert f"{node.ip}:{trainer_port}" in res.stderr
    assert "nothing started" in res.stderr
    assert_no_orphans(testcluster, "it-port", [job_ports(spec)[0]], within=1)


@pytest.mark.timeout(150)
def test_setsid_child_that_ignores_sigterm_is_still_swept(testcluster, tmp_path):
    spec = job_spec(testcluster, tmp_path, "it-setsid", hosts=2, grace=2, env={"STEPS": "600", "SETSID_CHILD": "1"})
    clusterctl("dispatch", spec, check=True)
    clusterctl("start", spec, check=True)
    node = testcluster.nodes[0]
    deadline = time.monotonic() + 10
    while len(tagged_pids(node.container, "it-setsid")) < 3 and time.monotonic() < deadline:
        time.sleep(0.3)  # pserver, trainer, and the trainer's escaped grandchild
    assert len(tagged_pids(node.container, "it-setsid")) >= 3
    t0 = time.monotonic()
    clusterctl("stop", spec, check=True)
    assert_no_orphans(testcluster, "it-setsid", job_ports(spec), within=2 + 5)
    assert time.monotonic() - t0 < 2 + 8


@pytest.mark.timeout(150)
def test_other_jobs_process_with_the_same_script_survives_stop(testcluster, tmp_path):
    mine = job_spec(testcluster, tmp_path, "it-mine", hosts=1, env={"STEPS": "600"})
    node = testcluster.nodes[0]
    clusterctl("dispatch", mine, check=True)
    # Another job's trainer running the same script name, by hand, tagged with its own job id.
    other = subprocess.Popen(  # as the login user, like the job's own processes
        ["docker", "exec", "-u", testcluster.user, "-e", "CLUSTERCTL_JOB=it-other", "-e", "TRAINING_ROLE=TRAINER", "-e", "PADDLE_TRAINER_ID=0",
         "-e", f"PADDLE_CURRENT_ENDPOINT={node.ip}:1", "-e", "STEPS=600", "-w", f"{testcluster.home}/clusterctl-it/it-mine",
         node.container, "python3", "job.py", "trainer", "0"],
        stdout=subprocess.DEVNULL,
    )
    try:
        clusterctl("start", mine, check=True)
        time.sleep(1)
        clusterctl("stop", mine, check=True)
        assert_no_orphans(testcluster, "it-mine", job_ports(mine), hosts=[node])
        assert tagged_pids(node.container, "it-other"), "the other job's process was killed"
        assert other.poll() is None
    finally:
        other.kill()
        for pid in tagged_pids(node.container, "it-other"):
            node_exec(node.container, f"kill -9 {pid}", check=False)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("sig, code, said", [(signal.SIGINT, 130, "interrupted"), (signal.SIGTERM, 143, "terminated")],
                         ids=["sigint", "sigterm"])
def test_sigint_or_sigterm_on_start_follow_stops_everything(testcluster, tmp_path, sig, code, said):
    """Ctrl+C, or SIGTERM (a CI runner's cancel, `timeout`, a batch system's time limit), while `start --follow`
    owns the job: stopped on every host, nothing left."""
    name = f"it-{signal.Signals(sig).name.lower()}"
    spec = job_spec(testcluster, tmp_path, name, hosts=2, env={"STEPS": "600"})
    clusterctl("dispatch", spec, check=True)
    with cli_to_interrupt("start", spec, "--follow") as proc:
        seen = read_until(proc, lambda seen: "step=" in seen[-1], 60)
        rest = interrupt(proc, 60, sig)
    assert proc.returncode == code, "".join(seen) + rest
    assert f"{said}: stopping the job" in rest
    assert_no_orphans(testcluster, name, job_ports(spec))
    again = clusterctl("stop", spec, check=True)
    assert again.stdout.strip() == f"job {name} is not running"


@pytest.mark.timeout(150)
def test_ctrl_c_on_logs_follow_of_a_quiet_job_leaves_no_follower_on_the_hosts(testcluster, tmp_path):
    """Ctrl+C ends `logs --follow` at once, and on each host the follower (the supervisor's log thread and the `cat`
    relaying its stream) goes within two keepalives, although the job writes nothing more (clusterctl/host/logtail.py
    KEEPALIVE_S); the job runs on."""
    from clusterctl.host.logtail import KEEPALIVE_S

    spec = job_spec(testcluster, tmp_path, "it-quiet", hosts=2, mode="collective",
                    env={"STEPS": "2", "STEP_S": "600"})
    clusterctl("start", spec, "--dispatch", check=True)
    nodes = testcluster.nodes[:2]

    def cats():
        return {n.container: node_exec(n.container, "pgrep -u ubuntu -x cat || true").split() for n in nodes}

    try:
        with cli_to_interrupt("logs", spec, "--follow") as proc:
            # both trainers' first (and only) step: the followers are streaming
            seen = read_until(proc, lambda seen: sum("step=0 " in s for s in seen) == 2, 60)
            assert sum("step=0 " in s for s in seen) == 2, "".join(seen)
            assert all(cats().values()), cats()  # each host relays its supervisor's stream with a `cat`
            rest = interrupt(proc, 30)
        assert proc.returncode == 130 and "Traceback" not in rest, "".join(seen) + rest
        assert not [line for line in seen if not line.strip()], seen  # the keepalives are not shown
        # 20: polling and a loaded machine
        assert wait_until(lambda: not any(cats().values()), 2 * KEEPALIVE_S + 20), cats()
        assert status_json(spec)["state"] == "running"
    finally:
        clusterctl("stop", spec, check=True)


@pytest.mark.timeout(120)
def test_paused_host_fails_start_within_connect_timeout(testcluster, tmp_path):
    spec = job_spec(testcluster, tmp_path, "it-paused", hosts=2)
    clusterctl("dispatch", spec, check=True)
    import yaml

    data = yaml.safe_load(spec.read_text())
    data["ssh"]["connect_timeout"] = 3
    spec.write_text(yaml.safe_dump(data))
    node = testcluster.nodes[1]
    res, elapsed = clusterctl_while_paused(node.container, "start", spec, timeout=60)
    assert res.returncode != 0
    assert f"cannot connect to {node.ip}{via(testcluster)}: timed out after 3s" in res.stderr
    assert elapsed < 3 + 10
    assert_no_orphans(testcluster, "it-paused", job_ports(spec))


@pytest.mark.timeout(150)
def test_drift_makes_start_refuse_naming_host_and_file(testcluster, tmp_path):
    spec = job_spec(testcluster, tmp_path, "it-drift", hosts=2)
    clusterctl("dispatch", spec, check=True)
    node = testcluster.nodes[1]
    node_exec(node.container, f"echo '# edited by hand' >> {testcluster.home}/clusterctl-it/it-drift/job.py")
    res = clusterctl("start", spec)
    assert res.returncode == 1
    assert f"{node.ip}: workspace job.py modified since the last dispatch" in res.stderr
    assert_no_orphans(testcluster, "it-drift", job_ports(spec), within=1)
    clusterctl("dispatch", spec, check=True)  # repairs the drift
    assert node_exec(node.container, f"tail -n1 {testcluster.home}/clusterctl-it/it-drift/job.py").strip() == "sys.exit(0)"


def dispatched(out: str) -> dict[str, tuple[int, str]]:
    """{host: (files sent, bytes sent)} from `clusterctl dispatch`'s table."""
    rows = [[c.strip() for c in line.split("│")[1:-1]] for line in out.splitlines() if line.count("│") >= 5]
    return {r[0]: (int(r[1]), r[2]) for r in rows if r[1].isdigit()}


def as_bytes(text: str) -> float:
    number, unit = text.split()
    return float(number) * {"B": 1, "KiB": 1024, "MiB": 1 << 20, "GiB": 1 << 30}[unit]


@pytest.mark.timeout(300)
def test_incremental_dispatch_of_2000_files(testcluster, tmp_path):
    ws = tmp_path / "ws"
    for d in range(20):
        (ws / f"d{d:02d}").mkdir(parents=True)
        for f in range(100):
            (ws / f"d{d:02d}" / f"f{f:03d}.txt").write_text(f"file {d}/{f}\n" * 20)
    spec = write_spec(
        testcluster, tmp_path / "inc.yaml", name="it-inc", hosts=2,
        workspace={"local": str(ws), "remote": f"clusterctl-it/inc-{uuid.uuid4().hex[:8]}"}, job={"entrypoint": ["true"]},
    )
    first = dispatched(clusterctl("dispatch", spec, check=True, timeout=240).stdout)
    assert [files for files, _ in first.values()] == [2000, 2000], first
    second = dispatched(clusterctl("dispatch", spec, check=True, timeout=240).stdout)
    for files, sent in second.values():  # nothing changed: a header travels, no file, no manifest
        assert files == 0 and as_bytes(sent) < 256, second
    (ws / "d03" / "f007.txt").write_text("changed\n")
    third = dispatched(clusterctl("dispatch", spec, check=True, timeout=240).stdout)
    for files, sent in third.values():  # one file: one tar record, not the manifest
        assert files == 1 and as_bytes(sent) < 12 * 1024, third
    for n in testcluster.nodes[:2]:
        remote = yaml.safe_load(spec.read_text())["workspace"]["remote"]
        assert node_exec(n.container, f"cat {testcluster.home}/{remote}/d03/f007.txt") == "changed\n"
        assert node_exec(n.container, f"find -L {testcluster.home}/{remote} -type f | wc -l").strip() == "2000"


@pytest.mark.timeout(300)
def test_dispatch_sends_changed_blocks_and_survives_other_controllers(testcluster, tmp_path, monkeypatch):
    """Bytes follow the bytes changed; this controller's records of the hosts are checked, not trusted: another
    controller's dispatch, a hand edit and a missing host tool are each noticed and repaired in the same run."""
    ws = tmp_path / "ws"
    ws.mkdir()
    big = ws / "weights.bin"
    big.write_bytes(os.urandom(3 << 20))
    (ws / "train.py").write_text("print('v1')\n")
    remote = f"clusterctl-it/blocks-{uuid.uuid4().hex[:8]}"
    spec = write_spec(testcluster, tmp_path / "blocks.yaml", name="it-blocks", hosts=2,
                      workspace={"local": str(ws), "remote": remote}, job={"entrypoint": ["true"]})
    nodes = testcluster.nodes[:2]
    home = testcluster.home

    def on_nodes_matches_local():
        want = hashlib.sha256(big.read_bytes()).hexdigest()
        for n in nodes:
            assert node_exec(n.container, f"sha256sum {home}/{remote}/weights.bin").split()[0] == want
            assert node_exec(n.container, f"cat {home}/{remote}/train.py") == (ws / "train.py").read_text()
            assert node_exec(n.container, f"ls {home}/{remote}").split() == ["train.py", "weights.bin"]

    clusterctl("dispatch", spec, check=True)
    with open(big, "r+b") as fh:  # 100 bytes in the middle of 3 MiB
        fh.seek(1_500_000)
        fh.write(os.urandom(100))
    out = dispatched(clusterctl("dispatch", spec, check=True).stdout)
    for files, sent in out.values():
        assert files == 1 and as_bytes(sent) < 16 * 1024, out  # one 4 KiB block (3 MiB whole)
    on_nodes_matches_local()

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "another-controller"))
    (ws / "train.py").write_text("print('v2')\n")
    clusterctl("dispatch", spec, check=True)  # the hosts move on without this controller knowing
    monkeypatch.delenv("XDG_CACHE_HOME")
    (ws / "train.py").write_text("print('v3')\n")
    clusterctl("dispatch", spec, check=True)
    on_nodes_matches_local()

    node_exec(nodes[0].container, f"echo extra >> {home}/{remote}/weights.bin")  # drift
    node_exec(nodes[1].container, f"rm -rf {home}/.clusterctl/bin/host-*")  # a host that lost its tools
    (ws / "train.py").write_text("print('v4')\n")
    clusterctl("dispatch", spec, check=True)
    on_nodes_matches_local()
    from clusterctl.ops.hosttools import tool_argv
    from clusterctl.quoting import join

    for n in nodes:  # what `start` checks: no drift left (this version's tool: a kept cluster holds older ones)
        verify = node_exec(n.container, f"cd {home} && {join(tool_argv('hostws', ['verify', remote]))}", user=testcluster.user)
        assert '"drift": []' in verify, verify


def control_masters(control: Path) -> dict[str, str]:
    """{socket: "Master running (pid=N)"} for the reusable connections whose sockets are in `control`."""
    out = {}
    for sock in sorted(control.iterdir()):
        res = subprocess.run(["ssh", "-S", str(sock), "-O", "check", "unused"], capture_output=True, text=True, timeout=10)
        out[sock.name] = res.stderr.strip() if res.returncode == 0 else f"down ({res.returncode})"
    return out


@pytest.mark.timeout(180)
def test_dispatch_reuses_connections_and_gives_up_on_a_frozen_host(testcluster, tmp_path, monkeypatch):
    """Dispatch reaches hosts through the OpenSSH client, which keeps each connection open for the next
    command (ssh.persist); a host that freezes while its connection is open fails the dispatch, named,
    within connect_timeout plus a few seconds, while the other host is updated; the next dispatch recovers."""
    cache = Path(tempfile.mkdtemp(prefix="cc", dir="/tmp"))  # short: socket paths are limited to 108 bytes
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache))
    control = cache / "clusterctl" / "ssh"
    ws = tmp_path / "ws"
    ws.mkdir()
    remote = f"clusterctl-it/reuse-{uuid.uuid4().hex[:8]}"
    spec = write_spec(testcluster, tmp_path / "reuse.yaml", name="it-reuse", hosts=2, ssh={"connect_timeout": 3},
                      workspace={"local": str(ws), "remote": remote}, job={"entrypoint": ["true"]})
    nodes = testcluster.nodes[:2]

    def on_node(n):
        return node_exec(n.container, f"cat {testcluster.home}/{remote}/train.py", check=False)

    try:
        (ws / "train.py").write_text("v1\n")
        clusterctl("dispatch", spec, check=True)
        masters = control_masters(control)
        assert len(masters) == 2 and all(m.startswith("Master running") for m in masters.values()), masters
        (ws / "train.py").write_text("v2\n")
        clusterctl("dispatch", spec, check=True)
        assert control_masters(control) == masters  # the same connections carried the second dispatch
        assert [on_node(n) for n in nodes] == ["v2\n", "v2\n"]

        (ws / "train.py").write_text("v3\n")
        res, elapsed = clusterctl_while_paused(nodes[1].container, "dispatch", spec, timeout=60)
        assert res.returncode != 0
        assert f"dispatch failed on 1 host(s): {nodes[1].ip}" in res.stderr, res.stderr
        assert f"cannot connect to {nodes[1].ip}{via(testcluster)}: timed out after 3s" in res.stderr, res.stderr
        assert elapsed < 3 + 6, elapsed
        assert on_node(nodes[0]) == "v3\n" and on_node(nodes[1]) == "v2\n"
        clusterctl("dispatch", spec, check=True)  # a new connection to the host that came back
        assert on_node(nodes[1]) == "v3\n"

        monkeypatch.setenv("XDG_CACHE_HOME", str(cache / "no-reuse"))
        data = yaml.safe_load(spec.read_text())
        data["ssh"]["persist"] = 0
        spec.write_text(yaml.safe_dump(data))
        (ws / "train.py").write_text("v4\n")
        clusterctl("dispatch", spec, check=True)
        assert [on_node(n) for n in nodes] == ["v4\n", "v4\n"]
        assert not (cache / "no-reuse" / "clusterctl" / "ssh").exists() or not list((cache / "no-reuse" / "clusterctl" / "ssh").iterdir())
    finally:
        for sock in control.iterdir() if control.exists() else ():
            subprocess.run(["ssh", "-S", str(sock), "-O", "exit", "unused"], capture_output=True, timeout=10)
        shutil.rmtree(cache, ignore_errors=True)


@pytest.mark.timeout(240)
def test_stock_torch_gloo_script_trains_on_two_nodes(testcluster, tmp_path):
    base = port_base()
    spec = write_spec(
        testcluster, tmp_path / "torch.yaml", name="it-torch", hosts=2,
        workspace={"local": str(ROOT / "examples" / "torch_gloo"), "remote": "clusterctl-it/torch"},
        job={"mode": "collective", "entrypoint": ["/opt/venv/bin/python", "train.py"], "trainers": 1,
             "env": {"STEPS": "30"}, "ports": {"control": base, "master": base + 1, "trainer": base + 10}},
    )
    clusterctl("dispatch", spec, check=True)
    res = clusterctl("start", spec, "--follow", timeout=200)
    assert res.returncode == 0, res.stdout + res.stderr
    ips = [n.ip for n in testcluster.nodes[:2]]
    assert f"[{ips[0]} trainer.0] done rank=0 world=2 allreduce=3" in res.stdout
    assert f"[{ips[1]} trainer.1] done rank=1 world=2 allreduce=3" in res.stdout
    assert "job it-torch: succeeded" in res.stdout


@pytest.mark.timeout(240)
def test_fab_workflow_with_the_seed_positional_script(clusterctl_on_nodes, tmp_path):
    """`fab -H a,b start | tail-log | status | kill` running examples/seed_positional (seed 000's interface)."""
    info = clusterctl_on_nodes
    # behind the bastion, the nodes are reached by their ssh config aliases (the config has the key and pins)
    ips = info.aliases[:2] if info.bastion else [n.ip for n in info.nodes[:2]]
    fab = [sys.executable, "-m", "fabric", "-r", str(ROOT), "-i", str(info.key_path), "-H", ",".join(ips)]
    if info.ssh_config_path:
        fab[5:5] = ["-S", str(info.ssh_config_path)]
    common = ["--known-hosts", str(info.known_hosts_path)]

    def run(*task, timeout=120):
        return subprocess.run(fab + list(task) + common, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)

    run("kill")  # a crashed earlier run on a kept cluster
    try:
        start = run("start", "--workspace", str(ROOT / "examples" / "seed_positional"), "--remote-dir",
                    f"{info.home}/clusterctl-it/fab", "--entrypoint", "/opt/venv/bin/python train.py")
        assert start.returncode == 0, start.stdout + start.stderr
        deadline = time.monotonic() + 90
        while "succeeded" not in (status := run("status")).stdout and time.monotonic() < deadline:
            time.sleep(1)
        assert "job fabjob: succeeded" in status.stdout, status.stdout + status.stderr
        tail = run("tail-log", "--lines", "200").stdout.splitlines()
        done = [line for line in tail if "] done steps=" in line]
        assert {line.split("]")[0] for line in done} == {f"[{ips[0]} trainer.0", f"[{ips[1]} trainer.1"}, tail
        for line in done:
            assert float(line.split("loss=")[1].split()[0]) < 1.0
        # success means each pserver found its positional CURRENT_ENDPOINT (ip:6173, from -H) in ENDPOINTS
    finally:
        kill = run("kill")
    assert kill.returncode == 0, kill.stderr
    assert_no_orphans(info, "fabjob", [6173, 6174], hosts=info.nodes[:2])
    assert run("kill").stdout.strip() == "job fabjob is not running"


@pytest.mark.timeout(150)
def test_disk_full_during_dispatch_keeps_the_old_workspace(testcluster, tmp_path):
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "train.py").write_text("print('v1')\n")
    node = testcluster.nodes[1]
    remote = f"/mnt/small/{tmp_path.name}"
    spec = write_spec(
        testcluster, tmp_path / "full.yaml", name="it-full", hosts=2,
        workspace={"local": str(ws), "remote": remote}, job={"entrypoint": ["python3", "train.py"]},
    )
    clusterctl("dispatch", spec, check=True)
    # 3 MiB cannot fit in the node's 2 MiB tmpfs
    (ws / "train.py").write_text("print('v2')\n")
    (ws / "big.bin").write_bytes(os.urandom(3 * 1024 * 1024))
    res = clusterctl("dispatch", spec)
    assert res.returncode == 1
    assert "dispatch failed on 2 host(s)" in res.stderr
    assert f"{node.ip}: exit 1: dispatch failed, previous workspace kept: No space left on device" in res.stderr
    for n in testcluster.nodes[:2]:
        assert node_exec(n.container, f"cat {remote}/train.py") == "print('v1')\n"
        assert node_exec(n.container, f"ls {remote}.d | grep -c tmp || true").strip() == "0"  # staging removed
    # the old workspace still verifies: start would accept it
    (ws / "big.bin").unlink()
    (ws / "train.py").write_text("print('v1')\n")
    again = dispatched(clusterctl("dispatch", spec, check=True).stdout)
    assert [files for files, _ in again.values()] == [0, 0], again
