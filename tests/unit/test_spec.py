"""Spec validation: a table of bad specs and the exact messages they produce."""

import subprocess
import sys

import pytest

from clusterctl.errors import SpecError
from clusterctl.spec import load_spec, parse_hostfile

GOOD = """\
name: demo
ssh:
  identity_file: id_ed25519
hosts:
  - address: 10.0.0.1
  - address: 10.0.0.2
job:
  mode: pserver
  entrypoint: [python3, train.py]
  pservers: 1
"""

# (spec text, [expected "LINE:COL: path: message" suffixes]) — each problem on its own line.
BAD = [
    pytest.param(
        GOOD.replace("  identity_file", "  identiy_file"),
        ["3:3: ssh.identiy_file: unknown key (did you mean 'identity_file'?)"],
        id="misspelt-key",
    ),
    pytest.param(GOOD + "colour: red\n", ["11:1: colour: unknown key"], id="unknown-section"),
    pytest.param(  # OpenSSH expands ${NAME} there, with no escape: ssh opened another file than the one named
        GOOD.replace("identity_file: id_ed25519", "identity_file: ${HOME}/id\n  known_hosts: a${X}b"),
        ["3:3: ssh.identity_file: '${HOME}/id': ssh reads '${...}' in this path as an environment variable: write "
         "the path itself",
         "4:3: ssh.known_hosts: 'a${X}b': ssh reads '${...}' in this path as an environment variable: write the path "
         "itself"],
        id="dollar-brace-in-an-ssh-path",
    ),
    pytest.param(
        GOOD.replace("ssh:\n", "ssh:\n  password: s3cret\n"),
        ["3:3: ssh.password: passwords are not allowed in a spec: use ssh.identity_file or an ssh-agent"],
        id="password",
    ),
    pytest.param(
        GOOD.replace("  - address: 10.0.0.2", "  - address: 10.0.0.2\n    labels: {db_passwd: x}"),
        ["7:14: hosts[1].labels.db_passwd: passwords are not allowed in a spec: use ssh.identity_file or an ssh-agent"],
        id="password-nested",
    ),
    pytest.param(
        GOOD.replace("ssh:\n", "ssh:\n  known_hosts: ''\n  config: ' '\n"),
        ["3:3: ssh.known_hosts: empty: give a path, or leave the key out",
         "4:3: ssh.config: empty: give a path, or leave the key out"],
        id="empty-paths",  # were taken for the keys left out: host keys checked against another file
    ),
    pytest.param(  # were '.' (the key left out) and the spec's directory (a hostfile "cannot read <dir>")
        GOOD.replace("job:", "workspace: {local: ''}\ndata: {local: ' '}\njob:"),
        ["7:13: workspace.local: empty: give a path, or leave the key out",
         "8:8: data.local: empty: give a path, or leave the data: section out"],
        id="empty-workspace-and-data-paths",
    ),
    pytest.param(
        GOOD.replace("hosts:\n  - address: 10.0.0.1\n  - address: 10.0.0.2\n", "hostfile: ''\n"),
        ["4:1: hostfile: empty: give a path, or list the hosts under hosts:"],
        id="empty-hostfile",
    ),
    pytest.param(  # both were clusterctl/demo, the default
        GOOD.replace("job:", "workspace: {remote: ''}\njob:"),
        ["7:13: workspace.remote: empty: give a path, or leave the key out"],
        id="empty-workspace-remote",
    ),
    pytest.param(  # data.remote '' was the workspace's own directory; a pattern '' matched no file; log_dir '' was '.'
        GOOD.replace("job:", "data: {local: d, remote: '', pattern: ' '}\njob:").replace(
            "  pservers: 1", "  pservers: 1\n  log_dir: ''\n  mpiexec: ''"),
        ["7:18: data.remote: empty: give a path, or leave the key out",
         "7:30: data.pattern: empty: it would match no file; give a pattern, or leave the key out ('*')",
         "12:3: job.log_dir: empty: give a path, or leave the key out",
         "13:3: job.mpiexec: empty: give a path, or leave the key out"],
        id="empty-data-and-log-paths",
    ),
    pytest.param(
        GOOD.replace("job:", "workspace: {remote: ~/}\njob:"),
        ["7:13: workspace.remote: '~/' is the home directory itself: give a directory under it, or leave the key out"],
        id="home-as-workspace-remote",
    ),
    pytest.param(  # were valid: the host refused them only at dispatch (its home is not a workspace symlink)
        GOOD.replace("job:", "workspace: {remote: ~/./}\njob:"),
        ["7:13: workspace.remote: '~/./' is the home directory itself: give a directory under it, or leave the key out"],
        id="home-by-another-name-as-workspace-remote",
    ),
    pytest.param(
        GOOD.replace("job:", "workspace: {remote: '~'}\njob:"),
        ["7:13: workspace.remote: '~' is the home directory itself: give a directory under it, or leave the key out"],
        id="tilde-as-workspace-remote",
    ),
    pytest.param(
        GOOD.replace("job:", "workspace: {remote: //}\njob:"),
        ["7:13: workspace.remote: '//' is the root directory: give a directory under it, or leave the key out"],
        id="root-as-workspace-remote",
    ),
    pytest.param(  # NaN failed the upper bound ("less than or equal to 600"); inf the same
        GOOD.replace("ssh:\n", "ssh:\n  connect_timeout: .nan\n").replace("  pservers: 1", "  pservers: 1\n  grace: .inf"),
        ["3:3: ssh.connect_timeout: input should be a finite number", "12:3: job.grace: input should be a finite number"],
        id="nan-and-inf-seconds",
    ),
    pytest.param(  # the docs' table spells it off; unquoted, YAML reads false
        GOOD.replace("ssh:\n", "ssh:\n  host_key_policy: off\n"),
        ["3:3: ssh.host_key_policy: expected one of 'strict', 'accept-new' or 'off', got False (an unquoted off reads "
         "as false in YAML: write 'off', quoted)"],
        id="unquoted-off",
    ),
    pytest.param(  # YAML 1.1 read these as 70, 8, 16, 1000, 90.5: validated as numbers no one wrote
        GOOD.replace("ssh:\n", "ssh:\n  port: 1:10\n  keepalive: 010\n").replace(
            "  - address: 10.0.0.2", "  - {address: 10.0.0.2, slots: 0x10, gpus: [0b1]}").replace(
            "  pservers: 1", "  pservers: 1\n  restarts: 1_000\n  grace: 1:30.5"),
        ["3:3: ssh.port: '1:10' reads as 70 in YAML 1.1 (a base-60 number): write a number in plain decimal digits, "
         "or quote it if it is text",
         "4:3: ssh.keepalive: '010' reads as 8 in YAML 1.1 (an octal number): write a number in plain decimal "
         "digits, or quote it if it is text",
         "8:25: hosts[1].slots: '0x10' reads as 16 in YAML 1.1 (a hexadecimal number): write a number in plain "
         "decimal digits, or quote it if it is text",
         "8:45: hosts[1].gpus[0]: '0b1' reads as 1 in YAML 1.1 (a binary number): write a number in plain decimal "
         "digits, or quote it if it is text",
         "13:3: job.restarts: '1_000' reads as 1000 in YAML 1.1 ('_' digit separators dropped): write a number in "
         "plain decimal digits, or quote it if it is text",
         "14:3: job.grace: '1:30.5' reads as 90.5 in YAML 1.1 (a base-60 number): write a number in plain decimal "
         "digits, or quote it if it is text"],
        id="yaml11-numbers",
    ),
    pytest.param(  # the number's message, not also "port out of range (1-65535): 65536" about YAML 1.1's value
        GOOD.replace("ssh:\n", "ssh:\n  port: 0x10000\n"),
        ["3:3: ssh.port: '0x10000' reads as 65536 in YAML 1.1 (a hexadecimal number): write a number in plain "
         "decimal digits, or quote it if it is text"],
        id="yaml11-number-out-of-range",
    ),
    pytest.param(  # an unknown key is said to be one, whatever its value
        GOOD + "colour: {a: 010}\n",
        ["11:1: colour: unknown key"],
        id="yaml11-number-under-unknown-key",
    ),
    pytest.param(
        GOOD.replace("ssh:\n", "ssh:\n  port: 70000\n"),
        ["3:3: ssh.port: port out of range (1-65535): 70000"],
        id="port-range",
    ),
    pytest.param(
        GOOD.replace("  pservers: 1", "  pservers: 1\n  ports: {pserver: 0}"),
        ["11:11: job.ports.pserver: port out of range (1-65535): 0"],
        id="base-port-range",
    ),
    pytest.param(
        GOOD.replace("hosts:\n  - address: 10.0.0.1\n  - address: 10.0.0.2\n", "hosts: []\n"),
        ["4:1: hosts: no hosts: list at least one host"],
        id="empty-hosts",
    ),
    pytest.param(
        GOOD.replace("10.0.0.2", "10.0.0.1"),
        ["6:5: hosts[1]: duplicate host 10.0.0.1 (also hosts[0])"],
        id="duplicate-host",
    ),
    pytest.param(
        GOOD.replace("  pservers: 1", "  pservers: 1\n  ports: {pserver: 6180, trainer: 6180}"),
        ["11:3: job.ports: two planned endpoints on 10.0.0.1:6180: pserver.0 and trainer.0"],
        id="endpoint-collision",
    ),
    pytest.param(
        GOOD.replace("  pservers: 1", "  pservers: 1\n  trainers: 2\n  ports: {trainer: 6169}"),
        ["12:3: job.ports: two planned endpoints on 10.0.0.1:6170: pserver.0 and trainer.1"],
        id="endpoint-collision-range",
    ),
    pytest.param(
        GOOD.replace("  mode: pserver", "  mode: pserver\n  trainers: three"),
        ["9:3: job.trainers: expected trainers per host (an integer) or 'gpu' (one per GPU)"],
        id="wrong-type-trainers",
    ),
    pytest.param(
        GOOD.replace("name: demo", "name: [demo]"),
        ["1:1: name: expected a string"],
        id="wrong-type-name",
    ),
    pytest.param(
        GOOD.replace("  mode: pserver", "  mode: psever"),
        ["8:3: job.mode: expected one of 'pserver' or 'collective', got 'psever'"],
        id="bad-literal",
    ),
    pytest.param(
        GOOD.replace("  pservers: 1", "  pservers: 1\n  args: ['{trainer_idx}']"),
        ["11:3: job.args: unknown placeholder {trainer_idx} in '{trainer_idx}' (did you mean 'trainer_id'?)"],
        id="bad-placeholder",
    ),
    pytest.param(  # and "expected an integer", "expected a list": the union's other members, wrongly
        GOOD.replace("  pservers: 1", "  pservers: {per_host: -1}"),
        ["10:14: job.pservers.per_host: input should be greater than or equal to 0"],
        id="union-member-errors-left-out",
    ),
    pytest.param(  # and "job.entrypoint: must name a program to run", once its only item was refused
        GOOD.replace("[python3, train.py]", "[[python3]]"),
        ["9:16: job.entrypoint[0]: expected a string"],
        id="too-short-after-a-bad-item-left-out",
    ),
    pytest.param(  # pydantic takes a bool for an int: `port: true` was port 1, `connect_timeout: yes` one second
        GOOD.replace("  identity_file: id_ed25519", "  identity_file: id_ed25519\n  port: true\n  connect_timeout: yes"),
        ["4:3: ssh.port: expected a number, got true", "5:3: ssh.connect_timeout: expected a number, got true"],
        id="truth-for-a-number",
    ),
    pytest.param(  # str.format raised in the plan (a traceback), or built a 111 MB argument from a nested spec
        GOOD.replace("  pservers: 1", "  pservers: 1\n  args: ['{']"),
        ["11:3: job.args: a lone '{' in '{': write {{ and }} for literal braces"],
        id="lone-brace",
    ),
    pytest.param(
        GOOD.replace("  pservers: 1", "  pservers: 1\n  args: ['--x={trainer_id}}']"),
        ["11:3: job.args: a lone '}' in '--x={trainer_id}}': write {{ and }} for literal braces"],
        id="lone-closing-brace",
    ),
    pytest.param(
        GOOD.replace("  pservers: 1", "  pservers: 1\n  args: ['{trainer_id:{trainers}{trainers}}']"),
        ["11:3: job.args: placeholder {trainer_id} in '{trainer_id:{trainers}{trainers}}' takes no format spec or "
         "conversion"],
        id="placeholder-format-spec",
    ),
    pytest.param(
        GOOD.replace("  pservers: 1", "  pservers: [10.0.0.9]"),
        ["10:14: job.pservers[0]: 10.0.0.9 is not in hosts (did you mean '10.0.0.2'?)"],
        id="pserver-unknown-host",
    ),
    pytest.param(
        GOOD.replace("  pservers: 1", "  pservers: 1\n  env: {RANK: '3'}"),
        ["11:3: job.env: RANK is set by clusterctl from the plan; remove it from job.env"],
        id="env-contract-clash",
    ),
    pytest.param(  # CLUSTERCTL_AUTH: none reached the processes while job.auth said token: pservers served anyone
        GOOD.replace("  pservers: 1", "  pservers: 1\n  env: {CLUSTERCTL_AUTH: none}"),
        ["11:3: job.env: CLUSTERCTL_AUTH is clusterctl's, set by each host's supervisor; remove it from job.env "
         "(job.auth: none turns the job token off)"],
        id="env-supervisor-clash",
    ),
    pytest.param(  # execve cannot pass a NUL: refused here, not by the host supervisor after the launch
        GOOD.replace("[python3, train.py]", '[python3, "tr\\0ain.py"]').replace(
            "  pservers: 1", '  pservers: 1\n  args: [a, "\\0"]\n  env: {A: "x\\0"}'),
        ["9:25: job.entrypoint[1]: NUL character at character 3 of 'tr\\x00ain.py': a process's arguments and "
         "environment cannot hold one",
         "11:13: job.args[1]: NUL character at character 1 of '\\x00': a process's arguments and environment "
         "cannot hold one",
         "12:9: job.env.A: NUL character at character 2 of 'x\\x00': a process's arguments and environment "
         "cannot hold one"],
        id="nul-in-argv-or-env",
    ),
    pytest.param(
        GOOD.replace("  pservers: 1", "  pservers: 0"),
        ["10:3: job.pservers: pserver mode needs at least one pserver"],
        id="pserver-mode-no-pservers",
    ),
    pytest.param(GOOD.replace("job:", "job:\n  x: [1,"), ["10:13: YAML syntax error: expected ',' or ']', but got ':'"], id="yaml-syntax"),
    pytest.param(GOOD + "name: other\n", ["11:1: name: key given twice"], id="duplicate-key"),
    pytest.param(
        GOOD.replace("    pservers: 1", "") .replace("job:\n  mode: pserver\n  entrypoint: [python3, train.py]\n  pservers: 1\n", "job:\n  mode: collective\n  entrypoint: [python3, train.py]\n  trainers: gpu\n"),
        [
            "5:5: hosts[0]: job.trainers is 'gpu' but this host lists no gpus",
            "6:5: hosts[1]: job.trainers is 'gpu' but this host lists no gpus",
        ],
        id="gpu-trainers-without-gpus",
    ),
    pytest.param(
        GOOD.replace("  - address: 10.0.0.1", "  - address: 10.0.0.1\n    gpus: 1").replace(
            "  pservers: 1", "  pservers: 1\n  trainers: 2"
        ),
        ["6:5: hosts[0].gpus: 2 trainers on 10.0.0.1 but only 1 GPUs"],
        id="more-trainers-than-gpus",
    ),
    # nothing expands a ~ in what is executed: it was <workspace>/~/... on the host, "not found" after the dispatch
    pytest.param(GOOD.replace("[python3, train.py]", "[~/venv/bin/python, train.py]"),
                 ["9:3: job.entrypoint: '~/venv/bin/python': ~ is not expanded (processes start without a shell): give an absolute path, or one relative to the workspace (workspace.remote)"], id="tilde-program"),
    pytest.param(GOOD.replace("[python3, train.py]", "python3 -u ~/train.py --data ~/d"),
                 ["9:3: job.entrypoint: '~/train.py': ~ is not expanded (processes start without a shell): give an absolute path, or one relative to the workspace (workspace.remote)"], id="tilde-script"),
    pytest.param(GOOD.replace("[python3, train.py]", "[python3]\n  args: [-u, ~bob/train.py]\n  mpiexec: ~/mpiexec"),
                 ["10:3: job.args: '~bob/train.py': ~ is not expanded (processes start without a shell): give an absolute path, or one relative to the workspace (workspace.remote)", "11:3: job.mpiexec: '~/mpiexec': ~ is not expanded (processes start without a shell): give an absolute path, or one relative to the workspace (workspace.remote)"],
                 id="tilde-script-in-args-and-mpiexec"),
    # `$` matched before a final newline: a name, an env name or a namespace ending in one passed every check
    pytest.param(GOOD.replace("name: demo", 'name: "demo\\n"'), ["1:1: name: use 1-63 letters, digits"], id="name-trailing-newline"),
    pytest.param(GOOD.replace("  pservers: 1", '  pservers: 1\n  env: {"FOO\\n": bar}'), ["11:3: job.env: "],
                 id="env-name-trailing-newline"),
    # the workspace's path becomes a symlink: an empty /tmp (a container's) was replaced by one, mode 0755
    pytest.param(GOOD + "workspace: {remote: /tmp/}\n",
                 ["11:13: workspace.remote: '/tmp/' is a system directory, which the workspace's symlink would replace"],
                 id="workspace-system-dir"),
    # set from job.sync over the user's value in pserver mode: it was dropped without a word
    pytest.param(GOOD.replace("  pservers: 1", "  pservers: 1\n  env: {CLUSTERCTL_PS_MODE: async}"),
                 ["11:9: job.env.CLUSTERCTL_PS_MODE: CLUSTERCTL_PS_MODE is set from job.sync in pserver mode; give "
                  "job.sync instead"], id="env-ps-mode"),
    pytest.param("- just\n- a list\n", ["1:1: a spec is a YAML mapping"], id="not-a-mapping"),
    # another kind of file: each of its lines was echoed as an unknown key (`validate /etc/shadow` showed the hashes)
    pytest.param("root:$y$j9T$salt$hash:19000:0:99999:7:::\ndaemon:*:19000:0:99999:7:::\n",
                 ["1:1: not a cluster spec: none of its top-level keys is a spec's (name:, hosts:, job:, ...)"],
                 id="not-a-spec"),
    pytest.param("nmae: x\nhosts: [{address: a}]\njob: {entrypoint: [t]}\n", ["1:1: name: required key is missing", "1:1: nmae: unknown key (did you mean 'name'?)"],
                 id="one-known-key-is-a-spec-with-a-typo"),
    pytest.param(
        "name: x\nhosts: [{address: a}]\n",
        ["1:1: job: required key is missing"],
        id="missing-job",
    ),
]


@pytest.mark.parametrize("text, expected", BAD)
def test_bad_spec_messages(write_spec, text, expected):
    path = write_spec(text)
    with pytest.raises(SpecError) as info:
        load_spec(path)
    lines = [str(p) for p in info.value.problems]
    assert len(lines) == len(expected), lines
    for line, want in zip(lines, expected):
        assert line.startswith(f"{path}:{want}"), (line, want)


def test_good_spec_is_frozen_and_typed(write_spec):
    spec = load_spec(write_spec(GOOD))
    assert spec.name == "demo"
    assert spec.ssh.host_key_policy == "strict"
    assert [h.address for h in spec.hosts] == ["10.0.0.1", "10.0.0.2"]
    assert spec.job.entrypoint == ("python3", "train.py")
    assert spec.workspace.remote == "clusterctl/demo"
    with pytest.raises(Exception):
        spec.name = "other"


def test_a_host_may_be_its_address_alone(write_spec):
    # `hosts: [node0, 10.0.0.6]`, as `fab -H` takes them: each is `{address: ...}`, beside full entries
    spec = load_spec(write_spec(GOOD.replace("  - address: 10.0.0.2\n", "  - node0\n  - 10.0.0.6\n")))
    assert [(h.address, h.slots) for h in spec.hosts] == [("10.0.0.1", None), ("node0", None), ("10.0.0.6", None)]
    path = write_spec("name: x\nhosts: [node0, '-x', 5, [a]]\njob: {entrypoint: [t]}\n")
    with pytest.raises(SpecError) as info:
        load_spec(path)
    either = "expected a host address or a mapping (address:, slots:, ...)"
    assert [(p.line, p.column, p.path, p.message) for p in info.value.problems] == [
        (2, 16, "hosts[1].address", "not a host name or IP address: '-x'"),
        (2, 22, "hosts[2]", either), (2, 25, "hosts[3]", either)]
    # with a user and a port, as `fab -H` takes them too (`fab -H ubuntu@gpu0:2222`: it was "not a host name")
    spec = load_spec(write_spec(GOOD.replace("  - address: 10.0.0.2\n", "  - ubuntu@gpu0:2222\n  - '[fe80::1]:22'\n"
                                             "  - fe80::2\n")))
    assert [(h.address, h.user, h.port) for h in spec.hosts[1:]] == [("gpu0", "ubuntu", 2222), ("fe80::1", None, 22),
                                                                     ("fe80::2", None, None)]
    path = write_spec("name: x\nhosts: ['gpu0:99999', '@gpu0', 'a b@gpu0']\njob: {entrypoint: [t]}\n")
    with pytest.raises(SpecError) as info:
        load_spec(path)
    assert [(p.path, p.message) for p in info.value.problems] == [
        ("hosts[0]", "bad port in 'gpu0:99999': expected 1-65535"),
        ("hosts[1]", "no user before '@' in '@gpu0': expected [user@]host[:port]"),
        ("hosts[2].user", "not a valid user name: 'a b'")]


def test_scalar_env_values_become_strings(write_spec):
    spec = load_spec(write_spec(GOOD.replace("  pservers: 1", "  pservers: 1\n  env: {OMP_NUM_THREADS: 1, DEBUG: true}")))
    assert spec.job.env == {"OMP_NUM_THREADS": "1", "DEBUG": "true"}


def test_hostfile(write_spec, tmp_path):
    (tmp_path / "hosts.txt").write_text("# comment\n10.0.0.5 slots=2\n10.0.0.6   # trailing\n")
    spec = load_spec(write_spec(GOOD.replace("hosts:\n  - address: 10.0.0.1\n  - address: 10.0.0.2\n", "hostfile: hosts.txt\n")))
    assert [(h.address, h.slots) for h in spec.hosts] == [("10.0.0.5", 2), ("10.0.0.6", None)]


def test_hostfile_errors_name_the_hostfile_line(write_spec, tmp_path):
    (tmp_path / "hosts.txt").write_text("10.0.0.5 slots=2\n10.0.0.6 cpus=4\n")
    path = write_spec(GOOD.replace("hosts:\n  - address: 10.0.0.1\n  - address: 10.0.0.2\n", "hostfile: hosts.txt\n"))
    with pytest.raises(SpecError) as info:
        load_spec(path)
    assert [str(p) for p in info.value.problems] == [f"{tmp_path / 'hosts.txt'}:2:1: hostfile: cannot parse 'cpus=4' (expected slots=N)"]


def test_a_tilde_the_program_reads_itself_is_its_own(write_spec):
    """Arguments other than the program and an interpreter's script are the program's to read (and expand)."""
    for entrypoint in ("python3 train.py --data ~/d", "[python3, -m, pkg, ~/x.py]", "[python3, -c, '~1']"):
        assert load_spec(write_spec(GOOD.replace("[python3, train.py]", entrypoint))).job.entrypoint[0] == "python3"


def test_plain_decimal_numbers_are_numbers(write_spec):
    spec = load_spec(write_spec(GOOD.replace("ssh:\n", "ssh:\n  port: +22\n  keepalive: 08\n  connect_timeout: 2.50\n")
                                .replace("  pservers: 1", "  pservers: 1\n  restarts: -0\n  grace: 1e1")))
    assert (spec.ssh.port, spec.ssh.keepalive, spec.ssh.connect_timeout) == (22, 8, 2.5)
    assert (spec.job.restarts, spec.job.grace) == (0, 10.0)


HOSTFILE_SPEC = GOOD.replace("hosts:\n  - address: 10.0.0.1\n  - address: 10.0.0.2\n", "hostfile: hosts.txt\n")


@pytest.mark.parametrize("hostfile, expected", [
    ("10.0.0.5 slots=2\n10.0.0.6   slots=0\n", ["2:12: hosts[1].slots: input should be greater than or equal to 1"]),
    ("# fleet\n10.0.0.5\n\n  -oProxyCommand=x slots=1\n",
     ["4:3: hosts[1].address: not a host name or IP address: '-oProxyCommand=x'"]),
    ("10.0.0.5\n10.0.0.6\n10.0.0.5 slots=2\n", ["3:1: hosts[2]: duplicate host 10.0.0.5 (also hosts[0])"]),
    ("10.0.0.5 slots=2000\n", ["1:10: hosts[0].slots: input should be less than or equal to 1024"]),
], ids=["slots-0", "address", "duplicate", "slots-too-many"])
def test_hostfile_hosts_problems_name_the_hostfile_line(write_spec, tmp_path, hostfile, expected):
    """They were all at spec.yaml:1:1 (the hosts had no place in the spec)."""
    (tmp_path / "hosts.txt").write_text(hostfile)
    path = write_spec(HOSTFILE_SPEC)
    with pytest.raises(SpecError) as info:
        load_spec(path)
    assert [str(p) for p in info.value.problems] == [f"{tmp_path / 'hosts.txt'}:{want}" for want in expected]


def test_hostfile_slots_in_other_digits_is_one_line(write_spec, tmp_path):
    """`slots=²` passed str.isdigit, then int() raised a ValueError the parser's handler could not unpack."""
    (tmp_path / "hosts.txt").write_text("10.0.0.5 slots=\u00b2\n")
    with pytest.raises(SpecError) as info:
        load_spec(write_spec(HOSTFILE_SPEC))
    assert [str(p) for p in info.value.problems] == [
        f"{tmp_path / 'hosts.txt'}:1:1: hostfile: cannot parse 'slots=\u00b2' (expected slots=N)"]


def test_spec_problems_printed_are_capped(write_spec, tmp_path):
    """A 5,000-host hostfile with slots=0 everywhere printed 5,000 lines; now 20 and a count, at the next one's place."""
    (tmp_path / "hosts.txt").write_text("".join(f"h{i} slots=0\n" for i in range(5000)))
    path = write_spec(HOSTFILE_SPEC)
    res = subprocess.run([sys.executable, "-m", "clusterctl.cli", "validate", str(path)], capture_output=True, text=True)
    hosts = tmp_path / "hosts.txt"
    assert res.returncode == 2 and res.stdout == ""
    assert res.stderr.splitlines() == [
        f"{hosts}:{i + 1}:{3 + len(str(i))}: hosts[{i}].slots: input should be greater than or equal to 1" for i in range(20)
    ] + [f"{hosts}:21:5: ... and 4980 more problems (the first 20 are shown)"]
    with pytest.raises(SpecError) as info:
        load_spec(path)
    assert len(info.value.problems) == 5000  # every one is kept: only what is printed is capped
    assert str(info.value).splitlines()[-1] == f"{hosts}:21:5: ... and 4980 more problems (the first 20 are shown)"


def test_spec_error_lines():
    from clusterctl.errors import SpecProblem

    problems = [SpecProblem("s.yaml", i, 1, "hosts", "x") for i in range(1, 23)]
    assert SpecError(problems[:20]).lines() == [f"s.yaml:{i}:1: hosts: x" for i in range(1, 21)]
    assert SpecError(problems[:21]).lines()[20:] == ["s.yaml:21:1: ... and 1 more problem (the first 20 are shown)"]
    assert SpecError(problems).lines(limit=2) == ["s.yaml:1:1: hosts: x", "s.yaml:2:1: hosts: x",
                                                  "s.yaml:3:1: ... and 20 more problems (the first 2 are shown)"]


def test_a_long_value_or_key_is_quoted_clipped(write_spec):
    """A 5,000-character value echoed by its message, or a 900-character unknown key, stays one readable line."""
    path = write_spec(GOOD.replace("mode: pserver", "mode: " + "x" * 5000).replace("ssh:\n", "ssh:\n  " + "k" * 900 + ": 1\n"))
    with pytest.raises(SpecError) as info:
        load_spec(path)
    assert [line.split(": ", 1)[1] for line in info.value.lines()] == [
        "ssh." + "k" * 156 + "... (904 characters): unknown key",
        "job.mode: " + ("expected one of 'pserver' or 'collective', got '" + "x" * 5000)[:300] + "... (5,049 characters)",
    ]
    assert len(info.value.problems[1].message) == 5049  # the problem keeps it whole: only the line is clipped


def test_parse_hostfile_max_slots_ignored():
    assert parse_hostfile("a slots=4 max_slots=8\nb\n") == [{"address": "a", "slots": 4}, {"address": "b"}]


def test_cli_validate_exit_codes_and_no_traceback(write_spec):
    good = write_spec(GOOD, "good.yaml")
    bad = write_spec(GOOD.replace("ssh:\n", "ssh:\n  usr: root\n  port: 0\n"), "bad.yaml")
    ok = subprocess.run([sys.executable, "-m", "clusterctl.cli", "validate", str(good)], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.strip() == f"{good}: valid: job demo (pserver), 2 host(s), 1 pserver(s), 2 trainer(s)"
    res = subprocess.run([sys.executable, "-m", "clusterctl.cli", "validate", str(bad)], capture_output=True, text=True)
    assert res.returncode == 2
    assert res.stderr.splitlines() == [
        f"{bad}:3:3: ssh.usr: unknown key (did you mean 'user'?)",
        f"{bad}:4:3: ssh.port: port out of range (1-65535): 0",
    ]
    assert "Traceback" not in res.stderr and res.stdout == ""


@pytest.mark.parametrize(
    "env, expected",
    [
        ("  env: {PATH: [1, 2]}", "5:9: job.env.PATH: expected a string"),
        ("  env:\n    PATH: [1, 2]", "6:5: job.env.PATH: expected a string"),
        ("  env:\n    GLOG_v: 1\n    Name: {a: 1}", "7:5: job.env.Name: expected a string"),
    ],
    ids=["flow", "block", "second-key"],
)
def test_capital_env_key_is_the_error_path(write_spec, env, expected):
    """Issue 14: a user's key starting with a capital letter is kept in the path, not dropped as a union tag."""
    path = write_spec("name: c\nhosts: [{address: h1}]\njob:\n  entrypoint: [python]\n" + env + "\n")
    with pytest.raises(SpecError) as info:
        load_spec(path)
    assert [str(p) for p in info.value.problems] == [f"{path}:{expected}"]
