"""Hosts resolved as `ssh HOST` resolves them: the real `ssh -G` over a real config file, and the plan built
from it (user, hostname, port, jump chain, endpoint addresses). No connection is made."""

from __future__ import annotations

import shutil
import textwrap

import pytest

from clusterctl.errors import SpecError
from clusterctl.ops import plan_for
from clusterctl.spec import load_spec
from clusterctl.sshconfig import Target, parse_ssh_g, resolve

needs_ssh = pytest.mark.skipif(shutil.which("ssh") is None, reason="needs the OpenSSH client")

CONFIG = """\
Host gpu*
    User ubuntu
    ProxyJump ops@bastion.example:2200
Host gpu0
    HostName 10.1.0.5
Host gpu1
    HostName 10.1.0.6
    Port 2222
Host same-as-gpu0
    HostName 10.1.0.5
"""


@pytest.fixture
def cfg(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    path = tmp_path / "ssh_config"
    path.write_text(CONFIG)
    return path


@needs_ssh
def test_aliases_resolve_through_the_config_and_the_spec_wins(cfg):
    found = resolve([Target("gpu0"), Target("gpu1", user="root", port=22), Target("10.9.9.9")], str(cfg))
    assert (found[0].hostname, found[0].user, found[0].port, found[0].proxy_jump) == (
        "10.1.0.5", "ubuntu", 22, ("ops@bastion.example:2200",))
    assert (found[1].hostname, found[1].user, found[1].port) == ("10.1.0.6", "root", 22)  # explicit wins
    assert found[2].hostname == "10.9.9.9" and found[2].proxy_jump == ()


@needs_ssh
def test_resolution_is_cached_until_the_config_changes(cfg):
    first = resolve([Target("gpu0")], str(cfg))
    assert resolve([Target("gpu0")], str(cfg)) == first
    cfg.write_text(CONFIG.replace("10.1.0.5", "10.1.0.50"))
    assert resolve([Target("gpu0")], str(cfg))[0].hostname == "10.1.0.50"


def test_config_none_needs_no_ssh_and_takes_the_address_literally():
    (r,) = resolve([Target("gpu0", port=2200)], "none")
    assert (r.hostname, r.port, r.proxy_jump) == ("gpu0", 2200, ())


def test_a_missing_config_file_is_one_line(tmp_path):
    from clusterctl.errors import ClusterctlError

    with pytest.raises(ClusterctlError, match=r"^ssh config .*/nope: no such file$"):
        resolve([Target("gpu0")], str(tmp_path / "nope"))


def test_parse_ssh_g_output():
    text = "user bob\nhostname 10.0.0.1\nport 2200\nproxyjump a,b@c:22\nidentityfile ~/.ssh/x\nidentityfile ~/.ssh/y\n" \
           "userknownhostsfile /k1 /k2\nproxycommand none\n"
    r = parse_ssh_g(text, Target("alias"))
    assert (r.user, r.hostname, r.port, r.proxy_jump) == ("bob", "10.0.0.1", 2200, ("a", "b@c:22"))
    assert r.identity_files == ("~/.ssh/x", "~/.ssh/y") and r.known_hosts == ("/k1", "/k2") and r.proxy_command is None


def _spec(tmp_path, body: str):
    path = tmp_path / "cluster.yaml"
    path.write_text(textwrap.dedent(body))
    return load_spec(path)


@needs_ssh
def test_the_plan_connects_to_what_ssh_would_and_puts_endpoints_where_hosts_reach_each_other(cfg, tmp_path):
    spec = _spec(tmp_path, """\
        name: t
        ssh: {config: ssh_config}
        hosts:
          - {address: gpu0}
          - {address: gpu1, train_address: 192.168.50.6}
          - {address: 10.1.0.7, proxy_jump: none}
        job: {mode: pserver, entrypoint: [python3, train.py], pservers: 1}
        """)
    plan = plan_for(spec)
    h0, h1, h2 = plan.hosts
    assert (h0.address, h0.user, h0.connect_name, h0.port, h0.jump) == ("gpu0", "ubuntu", "10.1.0.5", 22,
                                                                         ("ops@bastion.example:2200",))
    assert (h1.connect_name, h1.port, h1.endpoint_address) == ("10.1.0.6", 2222, "192.168.50.6")
    assert h2.jump == () and h2.connect_name == "10.1.0.7"
    assert [p.endpoint for p in plan.processes] == ["10.1.0.5:6170", "10.1.0.5:6180", "192.168.50.6:6180", "10.1.0.7:6180"]
    assert plan.trainers[0].env["MASTER_ADDR"] == "10.1.0.5"
    assert plan.to_json()["hosts"][1] == {"address": "gpu1", "user": "ubuntu", "hostname": "10.1.0.6", "port": 2222,
                                          "jump": ["ops@bastion.example:2200"], "train_address": "192.168.50.6"}


@needs_ssh
def test_the_spec_jump_wins_over_the_config_and_none_means_direct(cfg, tmp_path):
    spec = _spec(tmp_path, """\
        name: t
        ssh: {config: ssh_config, proxy_jump: "me@b1, b2:2201"}
        hosts:
          - {address: gpu0}
          - {address: gpu1, proxy_jump: none}
        job: {entrypoint: [x]}
        """)
    h0, h1 = plan_for(spec).hosts
    assert h0.jump == ("me@b1", "b2:2201") and not h0.jump_none
    assert h1.jump == () and h1.jump_none  # over the config's ProxyJump: ssh is told ProxyJump=none


BEHIND_BASTIONS = """\
    name: t
    ssh: {config: ssh_config}
    hosts:
      - {address: gpu0}
      - {address: other}
      - {address: gpu1, proxy_jump: "relay-b"}
    job: {entrypoint: [x]}
    """


@needs_ssh
def test_the_first_bastions_own_proxy_command_goes_with_the_hosts_behind_it(cfg, tmp_path):
    """ssh reaches a bastion through the ProxyCommand the config gives it; the plan carries it with each host whose
    first hop it is (the argv: test_remote_argv.py; for real: tests/integration/test_fleet.py)."""
    from clusterctl.sshconfig import may_set

    text = BEHIND_BASTIONS
    assert not may_set(str(cfg), "proxycommand")  # no ProxyCommand anywhere: the bastions are not asked of ssh
    assert all(h.hop_command == "" for h in plan_for(_spec(tmp_path, text)).hosts)
    cfg.write_text("Host bastion.example\n    ProxyCommand corp-relay %h %p\n"
                   "Host relay-b\n    ProxyCommand other-relay --host %h\n" + CONFIG)
    assert may_set(str(cfg), "proxycommand")
    h0, other, h1 = plan_for(_spec(tmp_path, text)).hosts
    assert h0.jump == ("ops@bastion.example:2200",) and h0.hop_command == "corp-relay %h %p"
    assert other.jump == () and other.hop_command == ""
    assert h1.jump == ("relay-b",) and h1.hop_command == "other-relay --host %h"
    from clusterctl.ops.slurm import _host  # the Slurm backend's login node and nodes: the same
    login = _host(_spec(tmp_path, text), "gpu0", 0)
    assert login.jump == ("ops@bastion.example:2200",) and login.hop_command == "corp-relay %h %p"


@needs_ssh
def test_the_first_bastions_own_proxy_jump_is_followed_to_the_outermost_ones_proxy_command(cfg, tmp_path):
    """ssh reaches a first bastion through its own entry's ProxyJump (and that chain's first hop through its own,
    and so on; a later hop's entry is not read: the -W before it decides); the plan's chain holds them all, first
    hop first, with the outermost one's own ProxyCommand (for real: tests/integration/test_fleet.py)."""
    from clusterctl.errors import ClusterctlError
    from clusterctl.ops.slurm import _host

    text = BEHIND_BASTIONS
    cfg.write_text("Host bastion.example\n    ProxyJump inner1,inner2\n"
                   "Host inner1\n    ProxyJump gate@outer:2022\n"
                   "Host inner2\n    ProxyJump not-read\n"  # a later hop: its own entry is not ssh's route
                   "Host outer\n    ProxyCommand corp-relay %h %p\n" + CONFIG)
    h0, other, h1 = plan_for(_spec(tmp_path, text)).hosts
    assert h0.jump == ("gate@outer:2022", "inner1", "inner2", "ops@bastion.example:2200")
    assert h0.hop_command == "corp-relay %h %p"
    assert (other.jump, other.hop_command) == ((), "")
    assert (h1.jump, h1.hop_command) == (("relay-b",), "")  # no entry of its own: reached directly
    login = _host(_spec(tmp_path, text), "gpu0", 0)  # the Slurm backend's login node and nodes: the same
    assert (login.jump, login.hop_command) == (h0.jump, h0.hop_command)
    # a loop is refused in one line, before any connection
    cfg.write_text("Host bastion.example\n    ProxyJump inner1\nHost inner1\n    ProxyJump bastion.example\n" + CONFIG)
    with pytest.raises(ClusterctlError, match=r"ProxyJump entries loop: bastion.example -> inner1 -> "
                                              r"ops@bastion.example:2200"):
        plan_for(_spec(tmp_path, text))
    # `Host *` that meets the bastions too: bastion.example's own route is relay-b, relay-b's would be itself (ssh:
    # "jumphost loop"), so relay-b is reached directly, as clusterctl always reached a first bastion
    cfg.write_text(CONFIG + "Host *\n    ProxyJump relay-b\n")
    h0, other, h1 = plan_for(_spec(tmp_path, text)).hosts
    assert (h0.jump, other.jump, h1.jump) == (("relay-b", "ops@bastion.example:2200"), ("relay-b",), ("relay-b",))


def test_a_malformed_bastion_hop_from_paramikos_reader_is_one_line(cfg, tmp_path, monkeypatch):
    """Without an `ssh` binary the config is read by paramiko, which does not check a ProxyJump's form as ssh does."""
    from clusterctl import sshconfig
    from clusterctl.errors import ClusterctlError

    monkeypatch.setattr(sshconfig.shutil, "which", lambda name: None)
    cfg.write_text("Host bastion.example\n    ProxyJump ops@[inner:22\n" + CONFIG)
    with pytest.raises(ClusterctlError, match=r"ProxyJump: cannot parse 'ops@\[inner:22'"):
        plan_for(_spec(tmp_path, BEHIND_BASTIONS))


@needs_ssh
def test_two_hosts_resolving_to_one_address_are_named_both(cfg, tmp_path):
    spec = _spec(tmp_path, """\
        name: t
        ssh: {config: ssh_config}
        hosts:
          - {address: gpu0}
          - {address: same-as-gpu0}
        job: {entrypoint: [x]}
        """)
    with pytest.raises(SpecError) as info:
        plan_for(spec)
    (problem,) = info.value.problems
    assert str(problem) == (
        f"{tmp_path / 'cluster.yaml'}:5:5: hosts[1]: same-as-gpu0 and hosts[0] (gpu0) both resolve to 10.1.0.5: "
        "trainer.0 and trainer.1 would share 10.1.0.5:6180; give one of them hosts[].train_address "
        "(the address the other hosts reach it at)")


@pytest.mark.parametrize("body, message", [
    ("hosts: [{address: '-oProxyCommand=x'}]", "hosts[0].address: not a host name or IP address: '-oProxyCommand=x'"),
    ("hosts: [{address: ']]::[['}]", "hosts[0].address: not a host name or IP address: ']]::[['"),
    ("hosts: [{address: 'a b'}]", "hosts[0].address: not a host name or IP address: 'a b'"),
    ("hosts: [{address: h, user: \"bob\\nx\"}]", "hosts[0].user: not a valid user name: 'bob\\nx'"),
    ("hosts: [{address: h, proxy_jump: 'u@h:99999'}]", "hosts[0].proxy_jump: bad port in 'u@h:99999': expected 1-65535"),
    ("hosts: [{address: h, proxy_jump: '-J'}]", "hosts[0].proxy_jump: not a host name or IP address: '-J'"),
    ("hosts: [{address: h, train_address: '-x'}]", "hosts[0].train_address: not a host name or IP address: '-x'"),
])
def test_bad_addresses_users_and_jumps_are_refused(tmp_path, body, message):
    with pytest.raises(SpecError) as info:
        _spec(tmp_path, f"name: t\n{body}\njob: {{entrypoint: [x]}}\n")
    assert [p.path + ": " + p.message for p in info.value.problems] == [message]


def test_ipv6_addresses_and_bracketed_jumps_are_fine(tmp_path):
    spec = _spec(tmp_path, """\
        name: t
        ssh: {config: none, proxy_jump: "ops@[fd00::1]:2222"}
        hosts: [{address: "fd00::2"}, {address: "[fd00::3]"}]
        job: {entrypoint: [x]}
        """)
    plan = plan_for(spec)
    assert [p.endpoint for p in plan.processes] == ["[fd00::2]:6180", "[fd00::3]:6180"]
    assert plan.hosts[0].jump == ("ops@[fd00::1]:2222",)


def test_a_jump_host_as_an_ssh_uri_is_taken_as_ssh_takes_it(tmp_path):
    # `ssh -J ssh://ops@gw:2222` and ProxyJump take the URI form; the spec refused it ("not a valid user name:
    # 'ssh://ops'") and the paramiko path would have dialled a host named "ssh"
    from clusterctl.transport.host import split_jump

    assert split_jump("ssh://ops@gw:2222") == ("ops", "gw", 2222)
    assert split_jump("SSH://gw/") == (None, "gw", None)
    assert split_jump("ssh://[fd00::1]:22") == (None, "fd00::1", 22)
    spec = _spec(tmp_path, """\
        name: t
        ssh: {config: none, proxy_jump: "ssh://ops@gw.example:2222"}
        hosts: [{address: h1}]
        job: {entrypoint: [x]}
        """)
    assert plan_for(spec).hosts[0].jump == ("ssh://ops@gw.example:2222",)
    with pytest.raises(SpecError, match="not a valid user name"):
        _spec(tmp_path, "name: t\nssh: {config: none, proxy_jump: 'ssh://a b@gw'}\nhosts: [{address: h}]\n"
                        "job: {entrypoint: [x]}\n")


# ------------------------------------------------------------------ one `ssh -G` per class of names, not per name

VARIED = """\
# a varied config: wildcards, negations, Include (glob), Match host/originalhost/user/localuser/exec,
# HostName with %h, ProxyJump, Port/User per pattern, HostKeyAlias, CanonicalizeHostname
Include {d}/conf.d/*.conf
Host bastion
    HostName 10.9.0.1
    Port 2200
Host gpu* !gpu13
    HostName %h.cluster.example
    ProxyJump ops@bastion:2200
    User ubuntu
Host gpu13
    HostName 10.1.0.13
Host db? web-*
    Port 2222
    IdentityFile ~/.ssh/id_%h
    HostKeyAlias shared-db-key
Match host *.cluster.example user root
    Port 2201
Match originalhost special-* exec "test %n = special-exec"
    HostName 10.7.7.7
Match host 10.2.*,!10.2.0.3
    UserKnownHostsFile /tmp/kh-10-2
Host canon*
    CanonicalizeHostname yes
Match user deploy
    IdentityFile ~/.ssh/deploy
    ProxyCommand ssh -W %h:%p gate
Match !localuser nobody-at-all host 10.3.*
    User localmatch
Host *.lab
    HostName %h.internal
    UserKnownHostsFile ~/.ssh/kh_%h
Host *
    ServerAliveInterval 30
"""

INCLUDED = """\
Host lab*
    User labuser
    ProxyJump jump1,jump2:2022
Match host lab1*
    Port 2023
"""


@pytest.fixture
def varied(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    (tmp_path / "conf.d").mkdir()
    (tmp_path / "conf.d" / "10-lab.conf").write_text(INCLUDED)
    (tmp_path / "conf.d" / "ignored.txt").write_text("Host *\n    Port 9\n")  # not *.conf: not included
    cfg = tmp_path / "config"
    cfg.write_text(VARIED.format(d=tmp_path))
    return str(cfg)


NAMES = ([f"gpu{i}" for i in range(20)] + ["bastion", "db1", "dba", "dbxx", "web-1", "web-", "lab1", "lab12", "lab2",
         "canon1", "special-exec", "special-other", "x.lab", "y.lab", "plain-host", "a.b.c", "fd00::1", "UPPER", "Gpu1"]
         + [f"10.2.0.{i}" for i in range(1, 8)] + [f"10.3.0.{i}" for i in range(1, 5)] + [f"10.4.{i}.1" for i in range(30)])


@needs_ssh
def test_resolving_by_class_gives_what_ssh_gives_for_every_name(varied, monkeypatch):
    """The same answers as one `ssh -G` per name, for every name, user (-l) and port (-p) combination,
    with far fewer `ssh -G` runs."""
    from clusterctl import sshconfig

    targets = [Target(n, u, p) for n in NAMES for u, p in ((None, None), ("root", None), ("deploy", 2022))]
    expected = sshconfig.resolve_each(targets, varied)
    calls = []
    real = sshconfig._ssh_g
    monkeypatch.setattr(sshconfig, "_ssh_g", lambda config, t: calls.append(t) or real(config, t))
    got = resolve(targets, varied)
    mismatched = [(t, g, e) for t, g, e in zip(targets, got, expected, strict=True) if g != e]
    assert mismatched == []
    assert len(calls) < len(targets) / 3, len(calls)  # 249 names: asked per class, plus the names read as dynamic
    assert sshconfig.LAST["rechecked"] == 0  # every class's second name confirmed the reader
    asked = {t.address for t in calls}
    assert {"special-exec", "special-other", "UPPER", "Gpu1", "canon1", "x.lab"} <= asked  # exec, case, canon, %h
    assert len([t for t in calls if t.address.startswith("10.4.")]) <= 6  # 90 targets of one class per user/port
    calls.clear()
    assert resolve(targets, varied) == expected and calls == []  # and then from the cache


@needs_ssh
def test_a_match_exec_every_name_reaches_asks_ssh_for_every_name(tmp_path, monkeypatch):
    from clusterctl import sshconfig

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    cfg = tmp_path / "config"
    cfg.write_text('Match exec "test %h = n3"\n    Port 2203\nHost *\n    User u\n')
    targets = [Target(f"n{i}") for i in range(6)]
    calls = []
    real = sshconfig._ssh_g
    monkeypatch.setattr(sshconfig, "_ssh_g", lambda config, t: calls.append(t) or real(config, t))
    got = resolve(targets, str(cfg))
    assert [r.port for r in got] == [22, 22, 22, 2203, 22, 22] and sorted(calls, key=str) == sorted(targets, key=str)


@needs_ssh
def test_a_match_exec_that_hangs_is_one_line_and_leaves_no_process(tmp_path, monkeypatch):
    """`ssh -G` past its deadline was killed alone: the config's `Match exec` command it had started (ssh runs it
    through the shell) was left running, reparented to init, one per name asked."""
    import os
    import time
    from helpers import pids_running

    from clusterctl import sshconfig
    from clusterctl.errors import ClusterctlError

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(sshconfig, "_TIMEOUT", 1.0)
    marker = f"{os.getpid()}.25"  # seconds: this sleep's own argument, found in /proc
    cfg = tmp_path / "config"
    cfg.write_text(f'Match exec "sleep {marker}"\n    Port 2203\n')

    def left() -> list[int]:
        return pids_running(["sleep", marker])

    with pytest.raises(ClusterctlError, match=r"^resolving n0 with `ssh -G` took over 1s \(a Match exec in the ssh config\?\)$"):
        sshconfig._ssh_g(str(cfg), Target("n0"))
    deadline = time.monotonic() + 10
    while left() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert left() == [], "the Match exec command outlived ssh -G"


@needs_ssh
def test_a_class_whose_check_fails_is_asked_name_by_name(varied, monkeypatch):
    """Were the reader wrong about a class, the second name's answer says so: every name is then asked."""
    from clusterctl import sshconfig, sshconfigfile

    real = sshconfigfile.ConfigModel.classify
    monkeypatch.setattr(sshconfigfile.ConfigModel, "classify",
                        lambda self, name, user: sshconfigfile.NameClass(("one",), name.lower()))  # all one class
    targets = [Target(n) for n in ["gpu1", "plain-host", "10.4.0.1", "db1", "lab12", "gpu2"]]
    assert resolve(targets, varied) == sshconfig.resolve_each(targets, varied)
    assert sshconfig.LAST == {"names": 6, "classes": 1, "asked": 6, "rechecked": 4}
    monkeypatch.setattr(sshconfigfile.ConfigModel, "classify", real)


@pytest.mark.parametrize("line, why", [
    ("Match canonical\n    User c", "Match canonical"),
    ("Match final\n    User c", "Match final"),
    ("Host gpu%h\n    User c", "a Host pattern with a token"),
    ("Include ~/conf.d/%h.conf", "an Include path with a token or variable"),
    ('Host a\n    HostName "unclosed', "unclosed quote"),
])
def test_forms_the_reader_does_not_reproduce_send_every_name_to_ssh(tmp_path, line, why):
    from clusterctl.sshconfigfile import ConfigModel

    cfg = tmp_path / "config"
    cfg.write_text(line + "\n")
    model = ConfigModel(str(cfg))
    assert model.dynamic is not None and why in model.dynamic
    assert model.classify("gpu1", None).dynamic == model.dynamic


def test_the_reader_follows_includes_nested_and_under_inactive_blocks(tmp_path):
    """An Include's files start in the including block's state; under an inactive block they match nothing."""
    from clusterctl.sshconfigfile import ConfigModel

    (tmp_path / "inner.conf").write_text("User from-inner\nHost *\n    Port 2000\n")
    cfg = tmp_path / "config"
    cfg.write_text(f"Host gpu*\n    Include {tmp_path}/inner.conf\nHost *\n    HostName %h.x\n")
    model = ConfigModel(str(cfg))
    gpu, other = model.classify("gpu1", None), model.classify("cpu1", None)
    assert gpu.dynamic is other.dynamic is None
    assert gpu.key != other.key and (gpu.hostname, other.hostname) == ("gpu1.x", "cpu1.x")
    assert str(tmp_path / "inner.conf") in model.files


# ------------------------------------------------------------------ IdentityFile as ssh opens it (the paramiko path)


@needs_ssh
@pytest.mark.parametrize("alias", [None, "the-alias"])
def test_identity_file_tokens_are_expanded_as_ssh_expands_them(tmp_path, monkeypatch, alias):
    """`ssh -G` prints IdentityFile as written but expands UserKnownHostsFile, which takes the same tokens (and `~`,
    `${VAR}`): the same text in both, ours must give what ssh gave (for real: tests/integration/test_fleet.py)."""
    from clusterctl.errors import ClusterctlError
    from clusterctl.sshkeys import key_files

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("CLUSTERCTL_T", "from-env")
    text = "~/k/%%-%C-%d-%h-%i-%k-%L-%l-%n-%p-%r-%u-${CLUSTERCTL_T}.key"
    cfg = tmp_path / "config"
    head = "Host x\n    HostName 10.0.0.9\n    User bob\n    Port 2201\n    ProxyJump a@j1:2022,j2\n"
    cfg.write_text(head + (f"    HostKeyAlias {alias}\n" if alias else "")
                   + f"    UserKnownHostsFile {text}\n    IdentityFile {text}\n    IdentityFile /plain/key\n")
    (r,) = resolve([Target("x")], str(cfg))
    assert r.identity_files[0] == text  # as written
    got = key_files(r, "x")
    assert got == [*r.known_hosts, "/plain/key"], (got, r.known_hosts)
    assert f"-{alias or 'x'}-" in got[0] and "-10.0.0.9-" in got[0] and got[0].endswith("-from-env.key")
    for bad, why in (("/k/%j", "token %j"), ("/k/${CLUSTERCTL_UNSET_VAR}", "CLUSTERCTL_UNSET_VAR} is not set")):
        cfg.write_text(head + f"    IdentityFile {bad}\n")
        (r,) = resolve([Target("x")], str(cfg))
        with pytest.raises(ClusterctlError, match=why.replace("$", r"\$").replace("{", r"\{")):
            key_files(r, "x")


@needs_ssh
def test_a_config_ssh_refuses_is_one_line_naming_each_bad_line(tmp_path, monkeypatch):
    """What ssh said about each bad line, not only its closing "terminating, N bad configuration options"."""
    from clusterctl.errors import ClusterctlError

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    cfg = tmp_path / "config"
    cfg.write_text("Host *\n    Bogus yes\n    Port 99999\n")
    with pytest.raises(ClusterctlError) as info:
        resolve([Target("a")], str(cfg))
    line = str(info.value)
    assert "\n" not in line and line.startswith(f"ssh config {cfg}: ")
    assert "line 2: Bad configuration option: bogus" in line and "line 3: Bad port '99999'" in line, line
    assert "terminating" not in line


def test_a_host_off_port_22_is_labelled_as_ssh_writes_it():
    # an IPv6 address and its port in one label read as another address (`fd00::1:2222`): brackets, as ssh has them
    from clusterctl.transport.host import Host

    assert Host("fd00::1", 2222, "u", 0).label == "[fd00::1]:2222"
    assert Host("fd00::1", 22, "u", 0).label == "fd00::1"
    assert Host("10.0.0.1", 2222, "u", 0).label == "10.0.0.1:2222"
    assert Host("node1", 22, "u", 0).label == "node1"


@needs_ssh
def test_the_answer_cache_holds_each_host_set_on_its_own_and_stays_bounded(tmp_path, monkeypatch):
    """One cache file per ssh config took every name ever resolved: 61 MB after a day of tests, 2.2 s of JSON for a
    cold `validate` of a 4-host spec. Each set of hosts now has its file, holding only its answers; the RECENT most
    recently used files are kept, and others only while used within IDLE_S."""
    import json
    import os
    import time

    from clusterctl import sshconfig

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(sshconfig._Cache, "RECENT", 3)
    cfg = tmp_path / "config"
    cfg.write_text("Host gpu*\n    User ubuntu\n")
    folder = tmp_path / "cache" / "clusterctl" / "sshg"
    big = [Target(f"10.1.{i // 250}.{i % 250}") for i in range(2000)]
    resolve(big, str(cfg))
    small = [Target("gpu0"), Target("10.0.0.1")]
    (r, _) = resolve(small, str(cfg))
    assert r.user == "ubuntu"
    sizes = sorted(len(json.loads(p.read_text())) for p in folder.glob("*.json"))
    assert sizes == [2, 2000]  # the small spec's file holds its own two answers, not the 2,000 others
    old = time.time() - sshconfig._Cache.IDLE_S - 60
    for p in folder.glob("*.json"):
        os.utime(p, (old, old))
    for i in range(4):  # new host sets: past the RECENT newest, the files unused for IDLE_S go (the new ones stay)
        resolve([Target(f"gpu{i + 100}")], str(cfg))
    assert sorted(len(json.loads(p.read_text())) for p in folder.glob("*.json")) == [1, 1, 1, 1]
    (again, _) = resolve(small, str(cfg))  # pruned: asked again, the same answer
    assert again == r
