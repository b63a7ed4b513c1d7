"""backend: slurm, pure parts: spec checks (control characters and what Slurm cannot honour, at line:column),
the plan with placeholder nodes, the per-node job files (the SSH path's, no token), the batch script, the
node glue's address/home/token substitution, Slurm's word folded with the supervisors' replies, the job
directory's creation (private, never reused), slurm.conf."""

from __future__ import annotations

import base64
import dataclasses
import itertools
import json
import os
import re
import zlib

import pytest

from clusterctl.backends import problems as backend_problems
from clusterctl.errors import JobError, SpecError
from clusterctl.host import slurm as glue
from clusterctl.host import slurmctl
from clusterctl.host.jobfile import validate_job
from clusterctl.ops.hosttools import _package_payload, package_dir
from clusterctl.ops.slurm import batch_script, job_templates, sbatch_options, slurm_state, slurm_status
from clusterctl.plan import make_plan
from clusterctl.spec import parse_spec

BASE = """\
name: sj
backend: slurm
slurm: {login: login1, nodes: 3, partition: gpu, time: "01:00:00"}
job: {mode: pserver, entrypoint: [python, train.py], args: ["--ep={current_endpoint}"], pservers: 2, trainers: 2}
"""


def located(text: str) -> list[tuple[int, int, str, str]]:
    """What `clusterctl validate` says: (line, column, key, message) of each problem, the spec's own first."""
    with pytest.raises(SpecError) as info:
        parse_spec(text, "s.yaml", check=backend_problems)
    return [(p.line, p.column, p.path, p.message) for p in info.value.problems]


def problems(text: str) -> list[str]:
    return [f"{path}: {message}" for _, _, path, message in located(text)]


def test_slurm_spec_plans_node_i_as_a_placeholder():
    spec = parse_spec(BASE)
    assert [h.address for h in spec.hosts] == ["slurm-node-0.invalid", "slurm-node-1.invalid", "slurm-node-2.invalid"]
    plan = make_plan(spec)
    t3 = plan.trainers[3]
    assert (t3.host.index, t3.endpoint, t3.env["LOCAL_RANK"]) == (1, "slurm-node-1.invalid:6181", "1")
    assert plan.pservers[1].env["PADDLE_PSERVERS_IP_PORT_LIST"] == "slurm-node-0.invalid:6170,slurm-node-1.invalid:6170"


def test_plan_shows_slurm_nodes_and_the_login_not_placeholder_hosts_and_their_connections(tmp_path, capsys):
    # `clusterctl plan` listed the hosts slurm-node-<i>.invalid and their ssh connections, and not the login node
    from clusterctl import cli

    path = tmp_path / "s.yaml"
    path.write_text(BASE)
    assert cli.main(["plan", str(path)]) == 0
    out = capsys.readouterr().out
    assert "backend: slurm, 3 node(s) of partition gpu" in out and "sbatch through ssh to login1" in out, out
    assert "<node 1>:6181" in out and ".invalid" not in out and "connections" not in out, out


def test_hosts_give_the_shape_of_each_node_without_addresses():
    spec = parse_spec(BASE.replace("nodes: 3, ", "") + "hosts: [{gpus: 2}, {slots: 3}]\n", check=backend_problems)
    assert [(h.address, h.gpus, h.slots) for h in spec.hosts] == [
        ("slurm-node-0.invalid", (0, 1), None), ("slurm-node-1.invalid", (), 3)]


SLURM_LINE = 'slurm: {login: login1, nodes: 3, partition: gpu, time: "01:00:00"}\n'


@pytest.mark.parametrize("text, expected", [
    (BASE.replace(SLURM_LINE, ""), "backend: backend: slurm needs a slurm: section (login:, nodes:, ...)"),
    (BASE.replace("backend: slurm\n", ""), "slurm: not supported with backend: ssh: a slurm: section needs backend: slurm"),
    (BASE.replace("nodes: 3, ", ""), "slurm: give slurm.nodes (or hosts, for the shape of each node)"),
    (BASE + "hosts: [{gpus: 1}]\n", "slurm.nodes: 3 nodes but 1 hosts"),
    (BASE.replace("pservers: 2", "pservers: [a]"),
     "job.pservers: under Slurm the nodes are known at run time: give a count or {per_host: N}"),
    (BASE.replace("mode: pserver", "mode: collective, launcher: mpi").replace("pservers: 2, ", ""),
     "job.launcher: not supported with backend: slurm: launcher: mpi; use launcher: ssh (clusterctl's own PMI server)"),
    (BASE.replace("time:", "workspace: shared, time:") + "workspace: {remote: rel/dir}\n",
     "workspace.remote: slurm.workspace: shared needs an absolute path on the shared filesystem"),
    (BASE.replace('"01:00:00"', '"1h"'), 'slurm.time: \'1h\' is not a Slurm time limit: write one of "MINUTES", '
     '"MM:SS", "HH:MM:SS", "D-HH", "D-HH:MM", "D-HH:MM:SS", "UNLIMITED"'),
    (BASE.replace('"01:00:00"', '"1:2:3:4"'), 'slurm.time: \'1:2:3:4\' is not a Slurm time limit: write one of '
     '"MINUTES", "MM:SS", "HH:MM:SS", "D-HH", "D-HH:MM", "D-HH:MM:SS", "UNLIMITED"'),
    (BASE + "data: {local: d}\n",
     "data: not supported with backend: slurm: data: is not dealt under Slurm yet; put the files in the workspace"),
    (BASE.replace("login: login1", "login: 'a b'"), "slurm.login: not a host name, ssh alias or IP address: 'a b'"),
    (BASE.replace("login: login1", "login: '-oProxyCommand=x'"),
     "slurm.login: not a host name, ssh alias or IP address: '-oProxyCommand=x'"),
    (BASE.replace("backend: slurm", "backend: k8s"),
     "backend: expected one of 'ssh', 'slurm', 'local' or 'kubernetes', got 'k8s'"),
    (BASE.replace("partition: gpu", 'partition: "gpu\\nrm -rf ~"'),  # a real newline: an #SBATCH line injected
     "slurm.partition: expected one word (letters, digits, _.:,+=@/-), got 'gpu\\nrm -rf ~'"),
    (BASE.replace("time:", "sbatch_args: [exclusive], time:"),
     "slurm.sbatch_args[0]: each item is one sbatch option on one line, starting with '-': 'exclusive'"),
    (BASE.replace("pservers: 2,", "pservers: 2, log_dir: 'my logs',"),
     "job.log_dir: under Slurm the log dir is an #SBATCH --output value: no whitespace or backslash (found ' ')"),
])
def test_slurm_spec_problems(text, expected):
    assert problems(text) == [expected]


@pytest.mark.parametrize("limit", ["90", "10:30", "1:00:00", "2-3", "2-3:30", "2-03:30:15", "UNLIMITED", "infinite",
                                   "-1", "0"])
def test_every_time_limit_sbatch_takes_is_valid(limit):
    """Each form sbatch --time takes (checked with sbatch --test-only on the test cluster's Slurm 22.05)."""
    spec = parse_spec(BASE.replace('"01:00:00"', f'"{limit}"'), check=backend_problems)
    assert f"--time={limit}" in sbatch_options(spec, make_plan(spec))


@pytest.mark.parametrize("written, limit", [("90", "90"), ("1:30", "1:30"), ("010", "010")])
def test_a_time_limit_written_unquoted_is_sbatchs_as_written(written, limit):
    # `time: 90` was "expected a string", and `time: 1:30` (sbatch's minutes:seconds) "reads as 90 in YAML 1.1"
    spec = parse_spec(BASE.replace('"01:00:00"', written), check=backend_problems)
    assert f"--time={limit}" in sbatch_options(spec, make_plan(spec))


def test_what_slurm_places_is_refused_at_each_key():
    text = BASE.replace("nodes: 3, ", "") + (
        "hosts:\n"
        "  - {address: a, gpus: 1}\n"
        "  - port: 2222\n"
        "    user: bob\n"
        "    proxy_jump: bastion\n"
        "    train_address: 10.0.0.2\n")
    why = "not supported with backend: slurm: Slurm places the nodes; hosts: gives only the shape (gpus, slots) of node i"
    assert located(text) == [
        (6, 6, "hosts[0].address", why),
        (7, 5, "hosts[1].port", why),
        (8, 5, "hosts[1].user", why + " (ssh.user is the login's and the nodes' user)"),
        (9, 5, "hosts[1].proxy_jump", why + " (ssh.proxy_jump reaches the login node and the nodes)"),
        (10, 5, "hosts[1].train_address", why + " (slurm.endpoints: ip | hostname picks the endpoints' address)"),
    ]


def test_a_host_given_as_its_address_alone_is_refused_too():
    # `hosts: [n1, {gpus: 1}]`: the name was dropped for node 0's placeholder without a word
    assert located(BASE.replace("nodes: 3, ", "") + "hosts: [n1, {gpus: 1}]\n") == [
        (5, 9, "hosts[0]", "an address is not supported with backend: slurm: Slurm places the nodes; hosts: gives only "
                           "the shape (gpus, slots) of node i")]


def test_a_hostfile_is_refused(tmp_path):
    (tmp_path / "hosts.txt").write_text("a\nb\n")
    with pytest.raises(SpecError) as info:
        parse_spec(BASE + "hostfile: hosts.txt\n", str(tmp_path / "s.yaml"), check=backend_problems)
    assert [(p.line, p.path, p.message) for p in info.value.problems] == [
        (5, "hostfile", "not supported with backend: slurm: Slurm places the nodes; give slurm.nodes (or hosts: for "
                        "the shape of each node)")]


CONTROL = "paths and #SBATCH values must be one line of printable characters"


@pytest.mark.parametrize("where, yaml_value, line, column, key, shown", [
    ("job", 'log_dir: "logs\\n#SBATCH --wrap=id"', 4, 115, "job.log_dir", "'\\n' at character 5 of 'logs\\n#SBATCH --wrap=id'"),
    ("job", 'log_dir: "a\\rb"', 4, 115, "job.log_dir", "'\\r' at character 2 of 'a\\rb'"),
    ("job", 'log_dir: "a\\u2028b"', 4, 115, "job.log_dir", "'\\u2028' at character 2 of 'a\\u2028b'"),
    ("workspace", 'remote: "w\\x1bs"', 6, 3, "workspace.remote", "'\\x1b' at character 2 of 'w\\x1bs'"),
    ("workspace", 'local: "w\\x00s"', 6, 3, "workspace.local", "'\\x00' at character 2 of 'w\\x00s'"),
    ("workspace", 'exclude: [ok, "a\\tb"]', 6, 17, "workspace.exclude[1]", "'\\t' at character 2 of 'a\\tb'"),
    ("slurm", 'sbatch_args: ["--x=1\\n#SBATCH --wrap=id"]', 3, 82, "slurm.sbatch_args[0]",
     "'\\n' at character 6 of '--x=1\\n#SBATCH --wrap=id'"),
    ("slurm", 'sbatch_args: ["--x=\\x85"]', 3, 82, "slurm.sbatch_args[0]", "'\\x85' at character 5 of '--x=\\x85'"),
])
def test_control_characters_are_refused_at_line_and_column(where, yaml_value, line, column, key, shown):
    text = BASE
    if where == "job":
        text = text.replace("trainers: 2}", f"trainers: 2, {yaml_value}}}")
    elif where == "slurm":
        text = text.replace('time: "01:00:00"}', f'time: "01:00:00", {yaml_value}}}')
    else:
        text += f"workspace:\n  {yaml_value}\n"
    assert located(text) == [(line, column, key, f"control character {shown}: {CONTROL}")]


def test_control_characters_are_refused_for_every_backend():
    text = "name: x\nhosts: [{address: a}]\njob: {entrypoint: python3 t.py, log_dir: \"l\\x07\"}\n"
    assert problems(text) == [f"job.log_dir: control character '\\x07' at character 2 of 'l\\x07': {CONTROL}"]


# ------------------------------------------------------------------------------- job files and script


def test_every_node_gets_the_ssh_paths_job_file_without_a_token():
    spec = parse_spec(BASE.replace("trainers: 2}", "trainers: 2, restarts: 3, restart_backoff: 2, on_failure: continue}"))
    plan = make_plan(spec)
    files = job_templates(plan)
    assert len(files) == 3 and "planned" not in json.dumps(files) and all("token" not in f for f in files)
    assert [(f["host"], f["coordinator"]["is_coordinator"]) for f in files] == [
        ("slurm-node-0.invalid", True), ("slurm-node-1.invalid", False), ("slurm-node-2.invalid", False)]
    assert {(f["restarts"], f["restart_backoff"], f["on_failure"], f["auth"]) for f in files} == {(3, 2.0, "continue", "token")}
    assert files[0]["coordinator"]["address"] == "slurm-node-0.invalid" and files[0]["coordinator"]["port"] == 6168
    assert files[2]["start_trainers_after"]["endpoints"] == ["slurm-node-0.invalid:6170", "slurm-node-1.invalid:6170"]
    assert files[1]["processes"][0]["log"] == glue.HOME_MARK + "/clusterctl/sj.logs/pserver.1.log"


def _unpack(script: str) -> tuple[dict, bytes, dict]:
    blob = re.search(r"<<'CLUSTERCTL_EOF'\n(.*?)\nCLUSTERCTL_EOF\n\Z", script, re.DOTALL).group(1)
    raw = base64.b64decode(blob)
    line, _, raw = raw.partition(b"\n")
    head = json.loads(line)
    return head, raw[:head["size"]], json.loads(raw[head["size"]:])


def test_batch_script_carries_the_options_the_glue_the_package_and_every_job_file():
    spec = parse_spec(BASE.replace("time:", "account: ml, sbatch_args: ['--exclusive'], gpus_per_node: 2, time:"))
    plan = make_plan(spec)
    script = batch_script(spec, plan)
    options = re.findall(r"^#SBATCH (.*)$", script, re.MULTILINE)
    assert options == ["--job-name=clusterctl-sj", "--nodes=3", "--ntasks-per-node=1", "--cpus-per-task=3",
                       "--output=clusterctl/sj.logs/slurm-%j.out", "--partition=gpu", "--time=01:00:00",
                       "--account=ml", "--gres=gpu:2", "--exclusive"]
    body = script.split("\n", len(options) + 2)[-1]
    assert body.startswith("umask 077\nexec python3 -S -E -c 'import hashlib, json, os")
    assert f"{glue.BOOT}' batch <<'CLUSTERCTL_EOF'\n" in body
    head, blob, job = _unpack(script)
    assert head["dir"] == package_dir() and head["sha256"] == json.loads(_package_payload().split(b"\n")[0])["sha256"]
    files = dict(zip([name for name, _ in head["files"]], _split(zlib.decompress(blob), head["files"])))
    assert files["clusterctl_host/slurm.py"] == open(glue.__file__, "rb").read()
    assert job == {"job": "sj", "log_dir": "clusterctl/sj.logs", "endpoints": "ip", "gpus_per_node": 2,
                   "templates": job_templates(plan)}
    assert all("token" not in f and "token" not in f["coordinator"] for f in job["templates"])


def _split(data: bytes, layout) -> list[bytes]:
    out, pos = [], 0
    for _, size in layout:
        out.append(data[pos:pos + size])
        pos += size
    return out


def test_the_output_option_escapes_slurms_patterns():
    spec = parse_spec(BASE.replace("trainers: 2}", "trainers: 2, log_dir: /scratch/100%/x}"))
    assert "--output=/scratch/100%%/x/slurm-%j.out" in sbatch_options(spec, make_plan(spec))


def test_a_spec_made_in_code_with_a_newline_in_an_sbatch_value_is_refused_by_the_script():
    spec = parse_spec(BASE)
    spec = spec.model_copy(update={"slurm": spec.slurm.model_construct(**{**dict(spec.slurm), "qos": "a\nb"})})
    with pytest.raises(JobError, match=r"#SBATCH '--qos=a\\nb' holds the control character '\\n'"):
        batch_script(spec, make_plan(spec))


# ------------------------------------------------------------------------------------ node glue


def _addresses(n: int) -> list[str]:
    return [f"10.0.0.{i + 1}" for i in range(n)]


def test_the_node_glue_puts_addresses_home_name_and_token_in_place():
    spec = parse_spec(BASE.replace("nodes: 3", "nodes: 12"))
    templates = job_templates(make_plan(spec))
    job = glue.node_job(templates[11], _addresses(12), "/home/u", "n11", "s3cret")
    assert validate_job(job, "test")["token"] == "s3cret"
    assert (job["host"], job["coordinator"]["address"], job["coordinator"]["token"]) == ("n11", "10.0.0.1", "s3cret")
    t = job["processes"][1]  # trainer 23: node 11, local 1: `slurm-node-1.invalid` must not match inside `-11.`
    assert (t["role"], t["id"], t["argv"], t["ports"]) == ("trainer", 23, ["python", "train.py", "--ep=10.0.0.12:6181"],
                                                          ["10.0.0.12:6181"])
    assert (t["cwd"], t["log"]) == ("/home/u/clusterctl/sj", "/home/u/clusterctl/sj.logs/trainer.23.log")
    assert job["env"]["POD_IP"] == "10.0.0.12" and job["env"]["PADDLE_PSERVERS_IP_PORT_LIST"] == "10.0.0.1:6170,10.0.0.2:6170"
    eps = job["env"]["PADDLE_TRAINER_ENDPOINTS"].split(",")
    assert eps[:3] == ["10.0.0.1:6180", "10.0.0.1:6181", "10.0.0.2:6180"] and len(eps) == 24
    assert job["start_trainers_after"]["endpoints"] == ["10.0.0.1:6170", "10.0.0.2:6170"]
    assert "invalid" not in json.dumps(job)
    assert "token" not in templates[11] and "token" not in templates[11]["coordinator"]  # the template is untouched


def test_the_node_glue_refuses_an_allocation_smaller_than_the_plan():
    templates = job_templates(make_plan(parse_spec(BASE)))
    with pytest.raises(ValueError, match=r"slurm-node-2.invalid:6181' names a node the allocation does not have \(2 nodes\)$"):
        glue.node_job(templates[2], _addresses(2), "/home/u", "n2", "t")


def test_planned_gpus_become_the_gpus_slurm_gave_the_node():
    assert glue.gpu_map("0,1", "2,3") == "2,3" and glue.gpu_map("1", "5,7") == "7" and glue.gpu_map("1", None) == "1"
    with pytest.raises(ValueError, match="GPU 2 planned but Slurm gave this node 4,5"):
        glue.gpu_map("2", "4,5")
    spec = parse_spec(BASE.replace("time:", "gpus_per_node: 2, time:").replace("pservers: 2, trainers: 2", "pservers: 1, trainers: gpu"))
    job = glue.node_job(job_templates(make_plan(spec))[1], _addresses(3), "/h", "n1", "t", gpus="6,7")
    assert [(p["id"], p["env"]["CUDA_VISIBLE_DEVICES"]) for p in job["processes"] if p["role"] == "trainer"] == [(2, "6"), (3, "7")]


def test_step_argv_runs_one_supervisor_per_node_with_the_whole_stdin():
    assert glue.step_argv(3, "4", 2) == [
        "srun", "--nodes=3", "--ntasks=3", "--ntasks-per-node=1", "--input=all", "--label", "--kill-on-bad-exit=0",
        "--wait=0", "--mpi=none", "--chdir=/", "--job-name=clusterctl-supervisor", "--cpus-per-task=4", "--gres=gpu:2",
        "python3", "-S", "-E", "-c", glue.BOOT, "node"]


def test_the_job_directory_is_created_private_and_never_reused(tmp_path):
    rel = glue.jobdir_rel("j", "42", "n1")
    assert rel == ".clusterctl/slurm/jobs/j/42-n1"
    for node in ("../../x", "n1\n", ".n1", "n1/x"):  # a trailing newline passed `$` before (now `\Z`)
        with pytest.raises(ValueError, match="unsafe"):
            glue.jobdir_rel("j", "42", node)
    path = glue.create_jobdir(str(tmp_path), rel)
    assert path == str(tmp_path / rel)
    for p in (tmp_path / ".clusterctl", tmp_path / ".clusterctl/slurm", tmp_path / ".clusterctl/slurm/jobs",
              tmp_path / ".clusterctl/slurm/jobs/j", tmp_path / rel):
        assert oct(p.stat().st_mode & 0o777) == "0o700", p
    with pytest.raises(ValueError, match=f"job directory {re.escape(path)} already exists: refusing to reuse it"):
        glue.create_jobdir(str(tmp_path), rel)
    glue.write_private(os.path.join(path, "job.json"), b"{}")
    assert oct(os.stat(os.path.join(path, "job.json")).st_mode & 0o777) == "0o600"
    with pytest.raises(FileExistsError):
        glue.write_private(os.path.join(path, "job.json"), b"{}")


def test_a_job_directory_under_a_directory_others_can_write_or_a_symlink_is_refused(tmp_path):
    (tmp_path / ".clusterctl").mkdir(mode=0o700)
    (tmp_path / ".clusterctl").chmod(0o777)
    with pytest.raises(ValueError, match=r"\.clusterctl is writable by others \(mode 777\)"):
        glue.create_jobdir(str(tmp_path), glue.jobdir_rel("j", "1", "n"))
    (tmp_path / ".clusterctl").chmod(0o755)
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / ".clusterctl" / "slurm").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(ValueError, match=r"\.clusterctl/slurm is not a directory \(a symlink\?\)"):
        glue.create_jobdir(str(tmp_path), glue.jobdir_rel("j", "1", "n"))
    assert list((tmp_path / "elsewhere").iterdir()) == []


@pytest.mark.parametrize("job, sid, node", [("j", "1", "../x"), ("j", "1;rm", "n"), ("../j", "1", "n"), ("j", "", "n")])
def test_job_directory_names_are_checked(job, sid, node):
    with pytest.raises(ValueError, match="unsafe"):
        glue.jobdir_rel(job, sid, node)


def _labelled(task: int, lines: list[str]) -> list[str]:
    return [f"{task}: {line}" for line in lines]  # srun --label's prefix (`%0*d: `, 1 digit for 3 tasks)


def test_node_replies_survive_sruns_output_whole():
    """srun cuts output lines longer than 1024 bytes and interleaves the pieces of several tasks: each node's
    reply travels as short lines, read back whole among the other nodes' lines and noise."""
    big = {"processes": [{"log": "/x" * 400, "id": i} for i in range(30)], "state": "running"}
    nodes = ["n0", "n1", "n2"]
    lines = {n: _labelled(i, slurmctl.reply_lines(n, dict(big, node=n))) for i, n in enumerate(nodes)}
    assert all(len(line) < 1024 for ls in lines.values() for line in ls) and len(lines["n0"]) > 5
    mixed = [line for group in itertools.zip_longest(*lines.values()) for line in group if line]
    mixed += ["srun: warning: noise", "0: n0 1/2 x"]
    assert slurmctl.read_replies("\n".join(mixed), nodes) == ({n: dict(big, node=n) for n in nodes}, {})
    cut = "\n".join(lines["n1"][:-1] + lines["n2"])  # n1 cut short: no reply, not refused
    assert slurmctl.read_replies(cut, nodes) == ({"n2": dict(big, node="n2")}, {})


def test_a_nodes_reply_is_read_from_the_lines_slurm_labelled_with_its_task_only(monkeypatch):
    """Which node a reply came from is srun's label (task i runs on node i), never the name the node prints: node
    n1 (possibly compromised) cannot replace n0's reply; a reply line of n1's naming n0, repeating a part, a line
    over the bound or more than a task's share refuses n1's own reply, and n0's stands."""
    nodes = ["n0", "n1"]
    a, b = slurmctl.reply_lines("n0", {"node": "n0"}), slurmctl.reply_lines("n1", {"node": "n1"})
    forged = slurmctl.reply_lines("n0", {"node": "n0", "forged": True})
    good = _labelled(0, a)
    mark = slurmctl.REPLY_MARK
    cases = {  # what n1's task prints (srun labels it `1: `), and why n1's reply is refused (None: it stands)
        "n1 names n0": (forged + b, "a reply line naming another node"),
        "n1 repeats a part": (b + b, "a reply line repeated or out of step"),
        "parts disagree": ([f"{mark} n1 0/2 {b[0].split()[-1]}", f"{mark} n1 1/3 AAAA"], "a reply line repeated or out of step"),
        "garbled index": ([f"{mark} n1 x/1 AAAA"], "a garbled reply line"),
        "not base64": ([f"{mark} n1 0/1 e30=\r"], "a garbled reply"),
        "a line over the bound": (b + ["x" * slurmctl.MAX_STEP_LINE], f"a line over {slurmctl.MAX_STEP_LINE} bytes"),
        "label inside its line": (["x\r0: " + forged[0], "0: " + forged[0]] + b, None),
        "other separators": (["x\x0b" + f"0: {forged[0]}\x1c0: {forged[0]}\u2028" + f"0: {forged[0]}"] + b, None),
    }
    for what, (printed, why) in cases.items():
        text = "\n".join(good[:1] + _labelled(1, printed) + good[1:])
        assert slurmctl.read_replies(text, nodes) == (
            {"n0": {"node": "n0"}, **({} if why else {"n1": {"node": "n1"}})}, {"n1": why} if why else {}), what
    # lines srun did not label, or labelled past the step's tasks, are nobody's
    stray = [forged[0], "2: " + forged[0], "-1: " + forged[0], " 0: " + forged[0], "0:" + forged[0]]
    assert slurmctl.read_replies("\n".join(stray + _labelled(1, b)), nodes) == ({"n1": {"node": "n1"}}, {})
    assert slurmctl.read_replies("\n".join(["01: " + line for line in b]), nodes) == ({"n1": {"node": "n1"}}, {})
    monkeypatch.setattr(slurmctl, "REPLY_SHARE", 2000)  # a task's share of the output, its noise counted
    text = "\n".join(good + _labelled(1, ["noise " * 400] + b))
    assert slurmctl.read_replies(text, nodes) == ({"n0": {"node": "n0"}}, {"n1": "more than 2000 bytes of output"})


_STUB = """\
import base64, json, os, sys, time
def main(argv):
    node = os.environ["SLURMD_NODENAME"]
    def reply(name, body):
        data = base64.b64encode(json.dumps(body).encode()).decode()
        return "clusterctl-slurm-reply %s 0/1 %s\\n" % (name, data)
    out = sys.stdout
    if node == "node2":  # compromised: after node1's honest reply, its own and a forged one of node1's
        time.sleep(0.5)
        out.write(os.environ["FORGE"].replace("FORGED", reply("node1", {"node": "node1", "forged": True})))
    out.write(reply(node, {"node": node, "argv": argv}))
    out.flush()
    return 0
"""


@pytest.mark.parametrize("forge, refused", [
    ("FORGED", "node2: its reply refused (a reply line naming another node)"),  # it names node1: refused
    ("x" * 1024 + "FORGED", "node2: its reply refused (a reply line naming another node)"),  # cut: a line of its own
    ("junk\rFORGED", ""), ("0: FORGED", ""),  # srun's label before it is node2's: noise of node2's
])
def test_the_status_step_takes_each_reply_from_the_node_slurm_ran_it_on(tmp_path, monkeypatch, forge, refused):
    """node2's step prints a reply under node1's name (with a carriage return, a cut line, a label of its own):
    node1's reply is node1's, and node2 speaks for itself or not at all (the fake srun labels and cuts lines as
    srun does, and lays task i on the i-th node of --nodelist)."""
    import sys

    sys.path.insert(0, os.path.dirname(__file__))
    from fakeslurm import install

    install(tmp_path / "bin", tmp_path / "slurm", tmp_path / "root", 2)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FORGE", forge)
    (tmp_path / "slurm" / "jobs" / "4242.json").write_text(json.dumps(
        {"id": 4242, "state": "RUNNING", "nodes": ["node1", "node2"], "pgids": []}))
    for home in ("127.0.0.1", "127.0.0.2"):
        pkg = tmp_path / "root" / home / "pkg" / "clusterctl" / "host"
        pkg.mkdir(parents=True)
        for init in (pkg / "__init__.py", pkg.parent / "__init__.py"):
            init.write_text("")
        (pkg / "slurmctl.py").write_text(_STUB)
    sj = {"id": "4242", "nodes": ["node2", "node1"]}  # task 0 on node2: --nodelist's order, not the names'
    replies, why = slurmctl._node_step({"package": "pkg"}, sj, ["node-status"], 30, "t")
    assert replies.pop("node1") == {"node": "node1", "argv": ["node-status"]}
    assert (replies, why) == (({}, refused) if refused else ({"node2": {"node": "node2", "argv": ["node-status"]}}, ""))


def _login_says(capsys, *argv: str) -> tuple[int, dict]:
    umask = os.umask(0o077)  # main() sets 077 for its process, as on the login node: this one's is put back
    try:
        code = slurmctl.main(["login", *argv])
    finally:
        os.umask(umask)
    return code, json.loads(capsys.readouterr().out)


def test_a_slurm_that_cannot_be_asked_is_never_a_job_that_is_over(tmp_path, monkeypatch, capsys):
    """slurmctld out of reach: the login node's query, stop and submit say so (`clusterctl stop` said `job is not
    running`, exit 0, and left the job's processes running; status said `no longer known to Slurm`)."""
    import sys

    sys.path.insert(0, os.path.dirname(__file__))
    from fakeslurm import install

    install(tmp_path / "bin", tmp_path / "slurm", tmp_path / "root", 1)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (tmp_path / "home" / glue.RECORD_DIR).mkdir(parents=True)
    (tmp_path / "home" / glue.RECORD_DIR / "sj.json").write_text(json.dumps({"slurm_job": "4242", "package": "p"}))
    code, said = _login_says(capsys, "stop", "--job", "sj", "--grace", "1")  # Slurm answers: it has no such job
    assert (code, said["ok"], said["slurm"], said["was_running"]) == (0, True, None, False)
    (tmp_path / "slurm" / "down").touch()
    refusal = {"ok": False, "error": "cannot ask Slurm about Slurm job 4242: slurm_load_jobs error: Unable to "
                                     "contact slurm controller (connect failure)"}
    for argv in (["query", "--job", "sj", "--replies"], ["stop", "--job", "sj", "--grace", "1"],
                 ["top", "--job", "sj", "--slice", "1", "--slices", "1"],
                 ["submit", "--job", "sj", "--record", "{}"]):
        assert _login_says(capsys, *argv) == (2, refusal), argv


def _fake_slurm(tmp_path, monkeypatch, *, job=None, transport=None, workspace="shared"):
    """A backend: slurm spec over fake hosts (tests/unit/fakehosts.py) with the fake Slurm (fakeslurm.py) of 2
    nodes installed; a shared workspace is the login host's directory."""
    import sys

    import yaml

    sys.path.insert(0, os.path.dirname(__file__))
    from fakehosts import FakeCluster
    from fakeslurm import install

    c = FakeCluster(tmp_path, hosts=2, job=job, files={"train.py": "import time\nprint('trained', flush=True)\n"})
    data = yaml.safe_load(c.spec_path.read_text())
    data.pop("hosts")
    if workspace == "shared":
        data["workspace"]["remote"] = str(c.root / "login" / c.remote_dir)
    data.update(backend="slurm", slurm={"login": "login", "nodes": 2, "workspace": workspace})
    c.spec_path.write_text(yaml.safe_dump(data, sort_keys=False))
    c.slurm = tmp_path / "slurm"
    install(c.bin, c.slurm, c.root, 2)
    return c.everywhere(monkeypatch, transport=transport(c) if transport else None)


def test_logs_follow_waits_while_the_job_is_pending(tmp_path, monkeypatch, capsys):
    """`clusterctl start` leaves a Slurm job pending: `logs -f` right after it said `has not started: no logs yet`
    (exit 1) instead of following the job, as `start --follow` does."""
    import threading

    from clusterctl.cli import main

    c = _fake_slurm(tmp_path, monkeypatch)
    (c.slurm / "hold").touch()
    assert main(["start", str(c.spec_path), "--dispatch"]) == 0
    assert "pending (Slurm job 4242 PENDING" in capsys.readouterr().out
    threading.Timer(2.0, (c.slurm / "hold").unlink).start()  # the allocation comes while logs -f waits
    code = main(["logs", str(c.spec_path), "-f"])
    got = capsys.readouterr()
    assert (code, sorted(got.out.splitlines())) == (0, ["[node1 trainer.0] trained", "[node2 trainer.1] trained"]), got


@pytest.mark.parametrize("command", ["start", "dispatch", "status", "stop", "logs"])
def test_every_command_says_an_unreachable_login_node_in_one_line(tmp_path, monkeypatch, capsys, command):
    """start said `installing clusterctl's host tools failed on 1 host(s)` and dispatch `sinfo on login failed`
    when the login node could not be reached; every command now says that, as status, stop and logs did."""
    from clusterctl.cli import main
    from fakehosts import FaultyTransport, refused

    c = _fake_slurm(tmp_path, monkeypatch, workspace="dispatch",
                    transport=lambda c: FaultyTransport(c.transport, down={"login"}))
    code = main([command, str(c.spec_path)])
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("clusterctl: error:")]
    assert code == 1 and len(err) == 1, err
    assert re.fullmatch(f"clusterctl: error: cannot reach the Slurm login node login: {refused('login')}", err[0]), err


# -------------------------------------------------------------------------------- Slurm's word


@pytest.mark.parametrize("word, state", [
    ("PENDING", "pending"), ("RUNNING", "running"), ("COMPLETING", "stopping"), ("COMPLETED", "succeeded"),
    ("CANCELLED by 0", "stopped"), ("FAILED", "failed"), ("TIMEOUT", "failed"), ("NODE_FAIL", "failed"),
    ("CANCELLED+", "stopped"), ("", "not running"),
])
def test_slurm_states(word, state):
    assert slurm_state(word) == state


SJ = {"id": "7", "state": "RUNNING", "exit_code": "0:0", "nodes": ["n0", "n1"], "batch_host": "n0", "reason": None}


def _reply(state, procs, **extra):
    return {"ok": True, "state": state, "reason": extra.pop("reason", None), "attempt": extra.pop("attempt", 0),
            "restarts": 1, "attempts": extra.pop("attempts", []), "processes": procs, **extra}


def test_slurm_status_folds_the_supervisors_replies_as_over_ssh():
    replies = {
        "n0": _reply("failed", [{"role": "trainer", "id": 0, "pid": 5, "state": "stopped", "exit_code": -15}],
                     reason="trainer.1 on n1 exited with code 3"),
        "n1": _reply("failed", [{"role": "trainer", "id": 1, "pid": 6, "state": "failed", "exit_code": 3}],
                     reason="trainer.1 on n1 exited with code 3"),
    }
    st = slurm_status("j", dict(SJ, state="FAILED", exit_code="1:0"), replies, {})
    assert (st.backend, st.state) == ("slurm", "failed")
    # the same verdict from both hosts, said once (it was said once per host)
    assert st.reason == "Slurm job 7 FAILED (exit 1:0) on n0,n1; n0, n1: trainer.1 on n1 exited with code 3"
    assert [(p.host, p.role, p.id, p.state, p.exit_code) for p in st.processes] == [
        ("n0", "trainer", 0, "stopped", -15), ("n1", "trainer", 1, "failed", 3)]


@pytest.mark.parametrize("word, state", [("TIMEOUT", "failed"), ("NODE_FAIL", "failed"), ("PREEMPTED", "failed"),
                                         ("CANCELLED by 0", "stopped")])
def test_a_job_slurm_ended_is_failed_though_its_supervisors_say_stopped(word, state):
    """The time limit (or a node's failure) SIGTERMs the supervisors, which record a stop: the job was `stopped`, as
    after a user's `clusterctl stop` (CANCELLED), though its work was cut short."""
    stopped = {n: _reply("stopped", [{"role": "trainer", "id": i, "pid": 5, "state": "stopped", "exit_code": -15}],
                         reason="stop requested on n0") for i, n in enumerate(("n0", "n1"))}
    st = slurm_status("j", dict(SJ, state=word, exit_code="143:0", reason="TimeLimit"), stopped, {})
    assert (st.state, st.reason) == (state, f"Slurm job 7 {word} (exit 143:0) on n0,n1: TimeLimit; "
                                            "n0, n1: stop requested on n0")


def test_slurm_status_before_and_without_supervisors():
    st = slurm_status("j", dict(SJ, state="PENDING", nodes=[], reason="Resources"), {}, {})
    assert (st.state, st.reason, st.processes) == ("pending", "Slurm job 7 PENDING (exit 0:0): Resources", [])
    none = {"n0": {"ok": False, "state": "unknown", "error": "no job state"}}
    st = slurm_status("j", SJ, none, {})
    assert (st.state, st.reason) == ("starting", "Slurm job 7 RUNNING (exit 0:0) on n0,n1; starting the supervisors")
    st = slurm_status("j", dict(SJ, state="FAILED", exit_code="2:0"), none, {"n1": "Connection refused"},
                      tail="python3: not found")
    assert (st.state, st.unreachable) == ("failed", {"n1": "Connection refused"})
    assert st.reason == "Slurm job 7 FAILED (exit 2:0) on n0,n1; slurm-7.out ends: python3: not found"


# one trainer on each of 2 nodes: node i of Slurm's node list runs the plan's host i's job file (host/slurm.py)
TWO = "name: sj\nbackend: slurm\nslurm: {login: login1, nodes: 2}\njob: {entrypoint: [python, train.py], trainers: 1}\n"


def _node(node, rows, state="running", **extra):
    """Node `node`'s supervisor's honest reply: this job, its own name (the glue's `host`), rows (id, state, exit)."""
    procs = [{"role": "trainer", "id": i, "pid": 10 + i, "state": st, "exit_code": code} for i, st, code in rows]
    return _reply(state, procs, job="sj", host=node, **extra)


def _folded(replies: dict, sj: dict = SJ):
    """`clusterctl status` under Slurm for TWO, every node's reply brought by the login node's step (no ssh)."""
    from clusterctl.ops.slurm import _status_from

    spec = parse_spec(TWO)
    st = _status_from(spec, make_plan(spec), {"record": {"slurm_job": "7"}, "slurm": sj, "addresses": {},
                                              "replies": replies})
    return st.state, st.reason, st.unreachable, [(p.host, p.role, p.id, p.state) for p in st.processes]


def test_slurm_status_of_honest_nodes_is_their_word():
    honest = {"n0": _node("n0", [(0, "running", None)]), "n1": _node("n1", [(1, "running", None)])}
    assert _folded(honest) == ("running", "Slurm job 7 RUNNING (exit 0:0) on n0,n1", {},
                               [("n0", "trainer", 0, "running"), ("n1", "trainer", 1, "running")])


def test_a_node_cannot_report_another_nodes_trainer():
    """n1 (compromised) says n0's trainer.0 failed: the job's reason blamed n0's trainer and its table showed a
    failed trainer.0 on n1 beside n0's running one. The plan places trainer.0 on node 0 (n0), so n1's reply is its
    one `no status` line, as an SSH host's."""
    forged = {"n0": _node("n0", [(0, "running", None)]),
              "n1": _node("n1", [(1, "running", None), (0, "failed", 3)], state="failed",
                          reason="trainer.0 on n0 exited with code 3")}
    assert _folded(forged) == (
        "lost", "Slurm job 7 RUNNING (exit 0:0) on n0,n1; unreachable: n1",
        {"n1": "no status: a row for trainer.0, which the plan does not place on this host (was the spec changed "
               "since the job started?)"},
        [("n0", "trainer", 0, "running")])


@pytest.mark.parametrize("field, value, why", [
    ("host", "n0", "a reply for host 'n0', not n1"),
    ("job", "other", "a reply for job 'other', not sj"),
])
def test_a_node_cannot_answer_for_another_node_or_job(field, value, why):
    """n1's reply names n0 (a state directory copied from n0, or n1 answering as n0), or another job."""
    replies = {"n0": _node("n0", [(0, "running", None)]), "n1": dict(_node("n1", [(1, "failed", 3)]), **{field: value})}
    assert _folded(replies) == ("lost", "Slurm job 7 RUNNING (exit 0:0) on n0,n1; unreachable: n1",
                                {"n1": f"no status: {why}"}, [("n0", "trainer", 0, "running")])


def test_top_under_slurm_shows_a_node_for_itself_only():
    """`clusterctl top`: n1's reply with n0's trainer.0 (or naming n0) was shown as n1's row; now its one error, as
    an SSH host's (ops/top.py), and n0's honest reply is unchanged."""
    from clusterctl.ops.slurm import SlurmTop
    from clusterctl.ops.top import TopRequest

    spec = parse_spec(TWO)
    top = SlurmTop(spec, make_plan(spec), TopRequest(1.0, 1))
    honest = _node("n0", [(0, "running", None)])
    for n1, why in [(_node("n1", [(1, "running", None), (0, "failed", 3)]), "a row for trainer.0, which the plan does "
                     "not place on this host (was the spec changed since the job started?)"),
                    (_node("n0", [(1, "running", None)]), "a reply for host 'n0', not n1")]:
        got = top._answers({"record": {"slurm_job": "7"}, "slurm": SJ, "replies": {"n0": honest, "n1": n1}}, 5.0)
        assert {n: (a.status, a.error, a.reply) for n, a in got.items()} == {
            "n0": ("ok", None, honest), "n1": ("error", why, None)}


def test_node_i_of_slurms_list_runs_the_plans_host_i():
    from clusterctl.ops.slurm_status import node_placement

    plan = make_plan(parse_spec(TWO))
    assert node_placement(plan, ["b7", "a3"]) == {"b7": {("trainer", 0)}, "a3": {("trainer", 1)}}
    # a node the plan has no host for (the spec changed since the job started) runs none of the plan's processes
    assert node_placement(plan, ["n0", "n1", "n2"])["n2"] == frozenset()
    # an elastic plan lays its ranks out again: not the plan's to check (ops/job.py placement), as over SSH
    assert node_placement(dataclasses.replace(plan, min_hosts=1), ["n0", "n1"]) is None


def test_slurm_conf_runs_the_controller_on_node0_without_cgroups():
    from clusterctl.testcluster import Node
    from clusterctl.testcluster_slurm import slurm_conf

    conf = slurm_conf("ct", [Node("ct-node0", "10.1.0.2", "ct-node0"), Node("ct-node1", "10.1.0.3", "ct-node1")])
    lines = conf.splitlines()
    for line in ("SlurmctldHost=ct-node0(10.1.0.2)", "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none",
                 "SelectType=select/cons_tres", "AuthType=auth/munge",
                 "NodeName=ct-node1 NodeAddr=10.1.0.3 CPUs=16 State=UNKNOWN"):
        assert line in lines
    assert lines[-1] == "PartitionName=debug Nodes=ct-node0,ct-node1 Default=YES MaxTime=INFINITE State=UP"


def test_a_nodes_log_lines_on_either_stream_are_shown_under_its_name_only():
    """`logs` under Slurm: what a node's `agent logs` sends, stdout or stderr, is that node's word (as over SSH:
    tests/security/test_hostile_status.py); its own JSON message is a problem, a keepalive nothing."""
    from clusterctl.ops.slurm import _LogRelay
    from clusterctl.transport.host import Host

    n0 = Host("10.0.0.5", 22, "u", 0)
    shown, problems = [], []
    relay = _LogRelay({n0: "node0"}, lambda h, stream, line: shown.append((h, stream, line)), problems)
    for stream, line in [("out", "[node0 trainer.0] mine"), ("out", "[node1 trainer.1] FAILED: diverged"),
                         ("err", "[node1 trainer.1] FAILED: diverged"), ("err", "[node0 trainer.0] mine too"),
                         ("out", ""), ("out", '{"ok": false, "error": "no job here"}'), ("out", "{not json")]:
        relay(n0, stream, line)
    assert shown == [(n0, "out", "[node0 trainer.0] mine"), (n0, "out", "[node0] [node1 trainer.1] FAILED: diverged"),
                     (n0, "err", "[node0] [node1 trainer.1] FAILED: diverged"), (n0, "err", "[node0 trainer.0] mine too"),
                     (n0, "out", "[node0] {not json")]
    assert problems == ["node0: no job here"]  # under the node's name, as its lines (was its ssh address)
    for _ in range(10_000):  # a node that says it without end: a few said, the rest counted (was every one kept)
        relay(n0, "out", '{"error": "again"}')
    assert problems[1:] == ["node0: again"] * 4 and relay.counted() == ["node0: 9,996 more error messages"]


def test_a_second_start_says_the_job_runs_not_that_sbatch_failed(tmp_path, monkeypatch, capsys):
    """A start while the job's Slurm job is pending or running said `sbatch on login failed: job sj is already
    running ...`, as if sbatch had run: the login node refuses before sbatch, and says the job's state and id."""
    from clusterctl.ops.slurm import SlurmError, _reply
    from clusterctl.plan import Host
    from clusterctl.transport.base import Result

    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / glue.RECORD_DIR).mkdir(parents=True)
    (tmp_path / glue.RECORD_DIR / "sj.json").write_text(json.dumps({"slurm_job": "4242"}))
    monkeypatch.setattr(slurmctl, "query_job", lambda sid: dict(SJ, id=sid, state="RUNNING"))
    code, said = _login_says(capsys, "submit", "--job", "sj", "--record", "{}")
    assert (code, said["ok"], said["live"]) == (1, False, {"state": "running", "slurm_job": "4242"})

    login = Host("10.0.0.9", 22, "u", 0)
    with pytest.raises(JobError) as info:
        _reply(Result(login, "slurmctl login submit", code, json.dumps(said) + "\n", "", 0.1), login, "sbatch", "sj")
    assert str(info.value) == "job sj is already running as Slurm job 4242; stop it first (clusterctl stop)"
    # a login node's `live` of another shape (it may be compromised) is its words, as any refusal
    forged = dict(said, live={"state": "running\x1b[2J", "slurm_job": "4242"}, error="no")
    with pytest.raises(SlurmError, match=r"^sbatch on 10.0.0.9 failed: no$"):
        _reply(Result(login, "slurmctl login submit", 1, json.dumps(forged) + "\n", "", 0.1), login, "sbatch", "sj")


def test_a_login_node_reply_cut_at_its_bound_is_refused_by_name():
    # the login node may be compromised too: what it prints beyond LOGIN_REPLY is dropped as it comes
    # (Remote.run's max_output) and the command fails in one line, not with the reply that came before the cut
    from clusterctl.ops.slurm import LOGIN_REPLY, SlurmError, _reply
    from clusterctl.plan import Host
    from clusterctl.transport.base import LineSplitter, Result

    login = Host("10.0.0.9", 22, "u", 0)
    split = LineSplitter(login, "out", None, 1 << 16)
    split.feed(b'{"ok": true, "slurm": {}}\n' + b"y" * (1 << 17))
    res = Result(login, "slurmctl login query", 0, split.close(), "", 0.1)
    with pytest.raises(SlurmError, match=rf"^asking Slurm on 10.0.0.9: a reply over the {LOGIN_REPLY >> 20} MiB "):
        _reply(res, login, "asking Slurm")
    honest = Result(login, "slurmctl login query", 0, '{"ok": true, "slurm": {}}\n', "", 0.1)
    assert _reply(honest, login, "asking Slurm") == {"ok": True, "slurm": {}}


def test_the_login_node_without_scontrol_gets_no_nodes_not_a_traceback(tmp_path, monkeypatch):
    """`scontrol` gone from PATH between two calls on the login node (a module unloaded, a broken install): the
    node-name and node-address lookups answer nothing, as for an empty node list, instead of FileNotFoundError."""
    monkeypatch.setenv("PATH", str(tmp_path))
    assert slurmctl._hostnames("node[1-3]") == []
    assert slurmctl.node_addresses(["node1"]) == {}
    with pytest.raises(ValueError, match=r"^cannot ask Slurm about Slurm job 7: scontrol: "):
        slurmctl.query_job("7")
