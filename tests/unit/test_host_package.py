"""The host package (clusterctl/host): stdlib only, the protocol version checked on both sides, a corrupt
state file reported as such, states as string enums, the job-file schema shared by controller and host."""

from __future__ import annotations

import ast
import enum
import json
import subprocess
import sys
from pathlib import Path

import pytest

from clusterctl.host import jobfile, protocol, states
from clusterctl.host.states import JobState, ProcState

sys.path.insert(0, str(Path(__file__).parent))
from helpers import FakeCoordinator  # noqa: E402
from test_agent import AGENT, PY, SLACK, Cluster, coordinator, free_port, launch, terminal, wait_for  # noqa: E402

HOST = Path(jobfile.__file__).resolve().parent


@pytest.fixture
def cluster(tmp_path):
    """Job dirs of simulated hosts (test_agent's), cleaned up after the test."""
    c = Cluster(tmp_path)
    yield c
    c.cleanup()


def _imports(path: Path) -> list[tuple[int, str]]:
    """(level, top-level module) of every import in a module, at any depth (lazy imports included)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(0, a.name.split(".")[0]) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            out.append((node.level, (node.module or "").split(".")[0]))
    return out


def test_the_host_package_imports_only_the_standard_library_and_itself():
    modules = sorted(HOST.glob("*.py"))
    assert len(modules) >= 10, modules
    own = {p.stem for p in modules}
    bad = []
    for path in modules:
        for level, name in _imports(path):
            if level > 0:  # relative: must name a module of the package
                if name and name not in own:
                    bad.append(f"{path.name}: from .{name}")
            elif name not in sys.stdlib_module_names and name != "__future__":
                bad.append(f"{path.name}: import {name}")
    assert not bad, bad


def test_the_host_package_parses_as_python_3_9():
    """Hosts run their own python3 (>= 3.9): no newer syntax in the package."""
    for path in sorted(HOST.glob("*.py")):
        ast.parse(path.read_text(), str(path), feature_version=(3, 9))


def test_states_are_strings_on_the_wire_and_compare_with_what_json_gives_back():
    assert json.dumps({"s": JobState.RUNNING, "p": [ProcState.EXITED]}) == '{"s": "running", "p": ["exited"]}'
    assert json.loads(json.dumps(JobState.FAILED)) == JobState.FAILED and "%s" % ProcState.LOST == "lost"
    assert f"{JobState.STOPPED}" == "stopped" and "succeeded" in states.TERMINAL_JOB_STATES


def test_states_on_a_python_without_strenum(monkeypatch):
    """Hosts may run Python 3.9: the fallback behaves like enum.StrEnum."""
    monkeypatch.delattr(enum, "StrEnum")
    ns: dict = {"__name__": "states_py39"}
    exec(compile(Path(states.__file__).read_text(), states.__file__, "exec"), ns)
    job_state = ns["JobState"]
    assert job_state.RUNNING == "running" and str(job_state.RUNNING) == "running" and f"{job_state.LOST}" == "lost"
    assert json.dumps([job_state.FAILED]) == '["failed"]'
    assert json.dumps({"a": job_state.STOPPED}, indent=1) == '{\n "a": "stopped"\n}'


def test_version_mismatch_names_both_versions():
    assert protocol.version_mismatch({"version": protocol.PROTOCOL_VERSION}, "a", "b") is None
    assert protocol.version_mismatch({"version": True}, "coordinator", "peer") is not None
    assert (protocol.version_mismatch({}, "coordinator", "peer")
            == "protocol version mismatch: coordinator speaks 2, peer sent None")
    assert (protocol.version_mismatch({"version": 3}, "this host's agent", "coordinator 10.0.0.1:29400")
            == "protocol version mismatch: this host's agent speaks 2, coordinator 10.0.0.1:29400 sent 3")


@pytest.mark.timeout(60)
def test_a_peer_refuses_a_coordinator_of_another_protocol_version(cluster):
    job_id = cluster.new_job_id()
    port = free_port()
    old = FakeCoordinator(port, version=1, timeout=1)
    connect_timeout = 3.0
    try:
        hB = cluster.host("hB", job_id, [cluster.process("trainer", 0, "sleep")],
                          coordinator(port, False, 2, 1, connect_timeout=connect_timeout))
        launch(hB)
        final = wait_for(lambda: terminal(hB), connect_timeout + SLACK)
    finally:
        old.close()
    assert final and final["state"] == "failed", final
    # it kept trying (another coordinator may take the port) until connect_timeout, then says why it failed
    assert final["reason"] == (f"could not connect to coordinator 127.0.0.1:{port} within 3s: protocol version "
                               f"mismatch: this host's agent speaks 2, coordinator 127.0.0.1:{port} sent 1 (upload "
                               "the same agent to every host)"), final
    assert old.connections >= 2
    assert old.received == b""  # it said nothing (no hello, no proof) to a coordinator it cannot talk to


def _agent(*args):
    res = subprocess.run([PY, AGENT, *args], capture_output=True, text=True, timeout=30)
    return res.returncode, json.loads(res.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("content", [b'{"state": "runn', b"[1, 2]", b"\xff\xfe"])
def test_a_corrupt_state_file_is_an_error_not_never_launched(cluster, content):
    job_id = cluster.new_job_id()
    d = cluster.host("hA", job_id, [cluster.process("trainer", 0, "exit", 0, 0)])
    rc, out = _agent("status", d)
    assert rc == 1 and "never launched" in out["error"], out  # no state.json at all: never launched
    (Path(d) / "state.json").write_bytes(content)
    rc, out = _agent("status", d)
    assert rc == 2 and out["ok"] is False and out["state"] == "unknown", out
    assert "is corrupt" in out["error"] and "never launched" not in out["error"] and out["reason"] == out["error"], out
    rc, out = _agent("stop", d, "--grace", "0")  # stop still works: by the job file and the environ sweep
    assert rc == 0 and out["ok"] and out["job"] == job_id, out


def test_the_job_file_is_built_and_checked_by_one_schema(tmp_path):
    proc = jobfile.process_entry("trainer", 0, ["python3", "t.py"], {"A": "1"}, "/w", "/w/t.log", ["127.0.0.1:5000"])
    coord = jobfile.coordinator_entry("127.0.0.1", 29400, "t" * 32, True, 1, 1)
    job = jobfile.build_job("j-1", "h", [proc], "/s", start_trainers_after=None, coordinator=coord, env={"B": "2"})
    assert list(job) == ["job", "host", "state_root", "on_failure", "grace", "restarts", "restart_backoff", "auth",
                         "start_trainers_after", "coordinator", "env", "processes"]
    path = tmp_path / "job.json"
    path.write_text(json.dumps(job))
    loaded = jobfile.load_job(str(path))  # what the agent runs on the host
    assert loaded["processes"][0]["env"] == {"A": "1", "B": "2"} and loaded["coordinator"]["port"] == 29400
    assert "start_trainers_after" not in jobfile.build_job("j-1", "h", [proc], "/s")
    with pytest.raises(ValueError, match=r"job file for h: processes\[0\].role: must be one of pserver/trainer"):
        jobfile.build_job("j-1", "h", [dict(proc, role="worker")], "/s")
    with pytest.raises(ValueError, match="coordinator.port: must be <= 65535"):
        jobfile.build_job("j-1", "h", [proc], "/s", coordinator=dict(coord, port=70000))
    # the policy as one object, or its keys one by one (the older form): one default and bound each
    from clusterctl.host.policy import Policy

    a = jobfile.build_job("j-1", "h", [proc], "/s", Policy(grace=5.0, restarts=2))
    assert a == jobfile.build_job("j-1", "h", [proc], "/s", grace=5.0, restarts=2)
    assert (a["on_failure"], a["grace"], a["restarts"], a["restart_backoff"]) == ("stop", 5.0, 2, 1.0)
    with pytest.raises(ValueError, match="restart_backoff: must be a number between 1.0 and 300.0, got 0.5"):
        jobfile.build_job("j-1", "h", [proc], "/s", restart_backoff=0.5)
    with pytest.raises(TypeError, match="unexpected keyword argument.s. colour"):
        jobfile.build_job("j-1", "h", [proc], "/s", colour="red")


# ------------------------------------------------------------------ the upload, over the local fake transport


def _local_remote(tmp_path, n=2):
    from clusterctl.plan import Host
    from clusterctl.remote import Remote, SshOptions
    from clusterctl.transport.local import LocalTransport

    hosts = [Host(f"n{i}", 22, "u", i) for i in range(n)]
    return Remote(hosts, SshOptions(), transport=LocalTransport(tmp_path / "hosts")), hosts


def test_the_host_package_is_one_content_addressed_upload_run_with_bytecode(tmp_path):
    from clusterctl.ops import hosttools

    remote, hosts = _local_remote(tmp_path)
    pkg = hosttools.package_dir()
    assert pkg.startswith(".clusterctl/bin/host-") and hosttools.tool_path("agent") == f"{pkg}/clusterctl_host/agent.py"
    cmd, payload = hosttools.tool_command("agent", ["status", ".clusterctl/jobs/nothing"])
    with remote:
        first = remote.run(cmd, stdin=payload, check=False)
        again = remote.run(cmd, stdin=payload, check=False)
    for host in hosts:
        home = tmp_path / "hosts" / host.address
        shipped = sorted(p.name for p in (home / pkg / "clusterctl_host").glob("*.py"))
        assert shipped == sorted(p.name for p in HOST.glob("*.py"))
        assert (home / pkg / "clusterctl_host" / "jobfile.py").read_bytes() == (HOST / "jobfile.py").read_bytes()
        assert list((home / pkg / "clusterctl_host" / "__pycache__").glob("agent.*.pyc"))  # imported, not a script
        for res in (first[host], again[host]):
            assert res.exit_code == 1 and res.reply()["error"].startswith("no job state in "), res
        assert [p.name for p in (home / ".clusterctl" / "bin").iterdir()] == [pkg.rsplit("/", 1)[1]]  # no leftovers


def test_the_host_never_imports_a_clusterctl_installed_there(tmp_path):
    """A `clusterctl` or `clusterctl_host` on the host's PYTHONPATH (or in site-packages) is never imported."""
    from clusterctl.ops import hosttools

    remote, (host,) = _local_remote(tmp_path, 1)
    home = tmp_path / "hosts" / host.address
    for name in ("clusterctl", "clusterctl_host"):
        (home / "site" / name).mkdir(parents=True)
        (home / "site" / name / "__init__.py").write_text("raise SystemExit('imported the wrong package')\n")
    cmd, payload = hosttools.tool_command("agent", ["status", "nowhere"])
    with remote:
        res = remote.run(f"PYTHONPATH=$HOME/site; export PYTHONPATH; {cmd}", stdin=payload, check=False)[host]
    assert res.exit_code == 1 and "wrong package" not in res.stderr and res.reply()["state"] == "unknown", res


def test_ensure_tools_then_the_workspace_tool(tmp_path):
    from clusterctl.ops import hosttools
    from clusterctl.quoting import join

    remote, hosts = _local_remote(tmp_path)
    with remote:
        paths = hosttools.ensure_tools(remote, ("agent", "hostws"))
        out = remote.run(join(hosttools.tool_argv("hostws", ["verify", "ws"])), check=False)
    assert paths == {"agent": hosttools.tool_path("agent"), "hostws": hosttools.tool_path("hostws")}
    for host in hosts:
        assert out[host].reply() == {"gen": None, "drift": [{"path": "", "problem": "never dispatched"}]}


# ------------------------------------------------------------------ what `agent up` costs a host (issue 23)

UP_PROBE = """\
import sys
sys.path[0] = sys.argv[1]
from clusterctl.host import agent
code = agent.main(["up"])
sys.stderr.write("modules: " + " ".join(sorted(sys.modules)) + "\\n")
sys.exit(code)
"""


def test_agent_up_imports_what_the_supervisor_needs_and_no_more(cluster):
    """`agent up` (every start, on every host) as the controller runs it (python3 -S -E, the document on stdin)
    launches the job without argparse (and gettext), shutil, tempfile, traceback or typing: together ~10 ms of
    the host's CPU, a sixth of the command. The modules are read back after the reply."""
    job_id = cluster.new_job_id("up")
    jobdir = cluster.host("h0", job_id, [cluster.process("trainer", 0, "sleep")],
                          coordinator=coordinator(free_port(), True, 1, 1))
    doc = {"job": json.loads((Path(jobdir) / "job.json").read_text()), "jobdir": jobdir}
    res = subprocess.run([PY, "-S", "-E", "-c", UP_PROBE, str(HOST.parent.parent)], input=json.dumps(doc).encode(),
                         capture_output=True, timeout=60)
    reply = json.loads(res.stdout.decode().strip().splitlines()[-1])
    assert res.returncode == 0 and (reply["ok"], reply["stage"]) == (True, "launched"), (reply, res.stderr[-2000:])
    assert reply["status"]["processes"][0]["state"] in ("running", "pending"), reply
    modules = set(res.stderr.decode().rsplit("modules: ", 1)[1].split())
    assert {"clusterctl.host.up", "clusterctl.host.preflight", "clusterctl.host.supervisor"} <= modules
    assert not {"argparse", "gettext", "shutil", "tempfile", "traceback", "typing"} & modules, sorted(modules)


def test_which_is_shutil_which(tmp_path, monkeypatch):
    """preflight's entrypoint lookup (common.which, no shutil import) answers as shutil.which(name, path=...)."""
    import os
    import shutil

    from clusterctl.host.common import which

    for name, mode in (("tool", 0o755), ("plain", 0o644), ("both", 0o755)):
        (tmp_path / "a").mkdir(exist_ok=True)
        (tmp_path / "a" / name).write_text("#!/bin/sh\n")
        (tmp_path / "a" / name).chmod(mode)
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "both").write_text("#!/bin/sh\n")
    (tmp_path / "b" / "both").chmod(0o755)
    (tmp_path / "b" / "adir").mkdir()
    (tmp_path / "b" / "rel").write_text("#!/bin/sh\n")
    (tmp_path / "b" / "rel").chmod(0o755)
    monkeypatch.chdir(tmp_path / "b")
    paths = [f"{tmp_path}/a:{tmp_path}/b", f"{tmp_path}/b:{tmp_path}/a", f"{tmp_path}/nowhere", "", ":", "/usr/bin:/bin"]
    names = ["tool", "plain", "both", "adir", "missing", "sh", f"{tmp_path}/a/tool", f"{tmp_path}/a/plain", "./rel",
             "rel", f"{tmp_path}/b/adir"]
    for path in paths:
        for name in names:
            assert which(name, path) == shutil.which(name, path=path), (name, path)
    assert which("both", f"{tmp_path}/b:{tmp_path}/a") == f"{tmp_path}/b/both"
    assert which("rel", ":") == "rel" and os.access("rel", os.X_OK)  # an empty PATH entry: the working directory


def test_private_temp_is_a_new_0600_file_never_through_a_link(tmp_path):
    """The job dir's temporary files (state.json's atomic writes, preflight's probe): tempfile.mkstemp's promises."""
    import os
    import stat

    from clusterctl.host.common import private_temp

    made = [private_temp(str(tmp_path), ".tmp-") for _ in range(50)]
    assert len({path for _, path in made}) == 50
    for fd, path in made:
        st = os.fstat(fd)
        assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_size == 0 and os.path.basename(path).startswith(".tmp-")
        assert os.path.samestat(st, os.stat(path))
        os.close(fd)
    target = tmp_path / "target"
    os.symlink(target, tmp_path / ".tmp-link")
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
    with pytest.raises(FileExistsError):  # what private_temp opens with: an existing name (a link too) is refused
        os.open(str(tmp_path / ".tmp-link"), flags, 0o600)
    assert not target.exists()


def test_write_private_replaces_a_file_with_a_new_0600_one_and_leaves_nothing_on_failure(tmp_path):
    """The job file (with the token), the control file (with its secrets), state.json: written by write_private."""
    import os
    import stat

    from clusterctl.host.common import write_private

    path = tmp_path / "job.json"
    path.write_text("old")
    os.chmod(path, 0o644)
    old_inode = path.stat().st_ino
    os.symlink(tmp_path / "elsewhere", tmp_path / "job.json.tmp")  # the name the old writer used: not followed
    write_private(str(path), '{"token": "x"}')
    assert path.read_text() == '{"token": "x"}' and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert path.stat().st_ino != old_inode  # a new file: never the old one's mode, never a reader's half-write
    write_private(str(path), b"\x00bytes")
    assert path.read_bytes() == b"\x00bytes"
    assert not (tmp_path / "elsewhere").exists()
    (tmp_path / "adir").mkdir()
    with pytest.raises(OSError):  # a directory in the way: os.replace fails
        write_private(str(tmp_path / "adir"), "x")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adir", "job.json", "job.json.tmp"]
