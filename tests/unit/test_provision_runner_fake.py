"""The provisioning runner (clusterctl.provision.runner.provision) over fake hosts: the real probe and the real
step scripts run in each host's directory; what needs apt, sudo or a package index is a fake executable on the
hosts' PATH (tests/unit/fakehosts.py). The integration tests (tests/provision) run the real ones."""

import hashlib
import json
import os
import re
import subprocess
import sys
import threading

import pytest

from clusterctl.errors import ProvisionError, SpecError
from clusterctl.provision.runner import provision

sys.path.insert(0, os.path.dirname(__file__))
from fakehosts import FakeCluster, FaultyTransport, fake_exe, refused, wait_until  # noqa: E402
from helpers import tiny_wheel  # noqa: E402

# apt-get and dpkg-query for the fake hosts: a package counts as installed once its marker is in the host's
# home; the host whose name is in FAIL_APT_ON cannot install anything, as apt says it.
FAKE_APT_GET = """\
    echo "apt-get $*" >> "$HOME/apt.log"
    for a in "$@"; do
        case $a in --print-uris) exit 0 ;; esac
    done
    for a in "$@"; do last=$a; done
    case " $* " in *" install "*) ;; *) exit 0 ;; esac
    if [ "$(basename "$HOME")" = "${FAIL_APT_ON:-}" ]; then echo "E: Unable to locate package $last"; exit 100; fi
    touch "$HOME/installed-$last"
    """
FAKE_DPKG_QUERY = """\
    for a in "$@"; do pkg=$a; done
    if [ -e "$HOME/installed-$pkg" ]; then printf 'installed 1.0'; else exit 1; fi
    """
# an interpreter for the probe that reports the facts in FAKE_FACTS (JSON) over the real ones
FAKE_PYTHON = """\
    python3 "$@" | python3 -c 'import json, os, sys
    d = json.loads(sys.stdin.read().splitlines()[-1]); d.update(json.loads(os.environ["FAKE_FACTS"])); print(json.dumps(d))'
    """


BROKEN_TAR_ON_N1 = """\
    if [ "$(basename "$HOME")" = n1 ]; then echo "tar: write error: No space left" >&2; exit 2; fi
    exec /usr/bin/tar "$@"
    """


def cluster(tmp_path, monkeypatch, provision_section, hosts=2, env=None):
    c = FakeCluster(tmp_path, hosts=hosts, extra={"provision": provision_section}, env=env)
    fake_exe(c.bin, "apt-get", FAKE_APT_GET)
    fake_exe(c.bin, "dpkg-query", FAKE_DPKG_QUERY)
    fake_exe(c.bin, "fakepython", FAKE_PYTHON)
    return c.everywhere(monkeypatch)  # provisioning logs and the mesh key under the test's own cache


def outcomes(report):
    """{(host label, step): (status, reason)}."""
    return {(h.label, step): (o.status, o.reason) for (h, step), o in report.outcomes.items()}


def run(c, **kw):
    with c.session() as s:
        return provision(s, **kw)


COMMANDS = {"timeout": 30, "commands": [
    {"name": "mark", "run": "echo made > marker", "creates": "marker"},
    {"name": "count", "run": "echo run >> count", "unless": "test -s count"},
]}


def test_commands_change_once_then_are_ok_check_changes_nothing_and_force_runs_again(tmp_path, monkeypatch):
    c = cluster(tmp_path, monkeypatch, COMMANDS)
    events = []
    with c.session() as s:
        checked = provision(s, check=True, on_event=lambda *e: events.append(e))
    assert checked.check and checked.steps == ["commands"]
    assert outcomes(checked) == {(h, "commands"): ("changed", "ran mark; ran count") for h in ("n0", "n1")}
    assert not (c.home(0) / "marker").exists()  # --check: nothing was changed
    assert sorted((h.label, step, text) for h, step, kind, text in events if kind == "status") == [
        ("n0", "commands", "changed"), ("n1", "commands", "changed")]
    assert ("n0", "commands", "line", "CLUSTERCTL_STEP commands changed ran mark; ran count") in [
        (h.label, step, kind, text) for h, step, kind, text in events]
    applied = run(c)
    assert outcomes(applied) == {(h, "commands"): ("changed", "ran mark; ran count") for h in ("n0", "n1")}
    assert applied.ok and applied.count("changed") == 2 and applied.count("failed") == 0
    assert (c.home(1) / "marker").read_text() == "made\n" and (c.home(1) / "count").read_text() == "run\n"
    assert outcomes(run(c)) == {(h, "commands"): ("ok", "") for h in ("n0", "n1")}
    assert (c.home(1) / "count").read_text() == "run\n"
    assert outcomes(run(c, force=True))[("n0", "commands")] == ("changed", "ran mark; ran count")
    assert (c.home(0) / "count").read_text() == "run\nrun\n"
    log = applied.log_path(applied.hosts[0]).read_text()
    assert "provision (apply) steps: commands" in log and "[commands] => changed ran mark; ran count" in log
    assert applied.log_dir == tmp_path / "cache" / "clusterctl" / "provision" / c.name


def test_a_failed_step_skips_the_hosts_later_steps_while_the_others_go_on(tmp_path, monkeypatch):
    section = {"apt": {"packages": ["fakepkg"], "lock_timeout": 5}, **COMMANDS}
    c = cluster(tmp_path, monkeypatch, section, hosts=3, env={"FAIL_APT_ON": "n1"})
    with c.session(transport=FaultyTransport(c.transport, down={"n2"})) as s:
        report = provision(s)
    got = outcomes(report)
    assert got[("n0", "apt")] == ("changed", "install fakepkg")
    assert got[("n0", "commands")] == ("changed", "ran mark; ran count")
    assert got[("n1", "apt")][0] == "failed"
    assert "E: Unable to locate package fakepkg" in got[("n1", "apt")][1]
    assert got[("n1", "commands")] == ("skipped", "apt failed")
    probe = r"probe failed \(exit 255\): " + refused("n2")
    assert got[("n2", "apt")][0] == "failed" and re.fullmatch(probe, got[("n2", "apt")][1])
    assert got[("n2", "commands")][0] == "skipped" and re.fullmatch(probe, got[("n2", "commands")][1])
    assert not report.ok and report.count("skipped") == 2
    assert (c.home(0) / "installed-fakepkg").exists() and not (c.home(1) / "marker").exists()
    assert "install --no-install-recommends" in (c.home(0) / "apt.log").read_text()
    with c.session() as s:  # n0 has it now: nothing to install
        assert outcomes(provision(s, only=["apt"]))[("n0", "apt")] == ("ok", "")


def test_a_step_over_its_timeout_fails_with_the_reason(tmp_path, monkeypatch):
    """A timed-out step's leftover child may still print after the run: that line reached the closed log file
    and raised in Remote's reader thread (a traceback on the terminal); it is dropped from the log now."""
    section = {"timeout": 1, "commands": [{"name": "slow", "run": "(sleep 1.5; echo late line) & sleep 3",
                                           "creates": "never"}]}
    c = cluster(tmp_path, monkeypatch, section, hosts=1)
    raised = []
    monkeypatch.setattr(threading, "excepthook", raised.append)
    events = []
    with c.session() as s:
        report = provision(s, on_event=lambda *e: events.append(e))
    assert outcomes(report) == {("n0", "commands"): ("failed", "timed out after 1s (provision.timeout)")}
    wait_until(lambda: any(e[3] == "late line" for e in events), timeout=10)
    assert raised == []
    assert "late line" not in report.log_path(report.hosts[0]).read_text()


def test_root_steps_go_through_non_interactive_sudo(tmp_path, monkeypatch):
    section = {"python": {"interpreter": "fakepython"}, "apt": {"packages": ["fakepkg"], "lock_timeout": 5}}
    facts = {"uid": 1000, "user": "alice", "sudo": "password"}
    c = cluster(tmp_path, monkeypatch, section, hosts=1, env={"FAKE_FACTS": json.dumps(facts)})
    report = run(c, only=["apt"])
    assert outcomes(report) == {("n0", "apt"): (
        "failed", "sudo needs a password for alice on n0: allow NOPASSWD sudo or log in as root")}
    # where `sudo -n` works, the step runs through it, with the login user's home passed on
    fake_exe(c.bin, "sudo", 'echo "sudo $*" | cut -c1-60 >> "$HOME/sudo.log"\n[ "$1" = -n ] && shift\nexec "$@"\n')
    c.transport.env["FAKE_FACTS"] = json.dumps({**facts, "sudo": "ok", "home": "/home/alice"})
    report = run(c, only=["apt"])
    assert outcomes(report) == {("n0", "apt"): ("changed", "install fakepkg")}
    assert (c.home(0) / "sudo.log").read_text().startswith("sudo -n env CLUSTERCTL_USER_HOME=/home/alice bash -c ")


def test_ssh_mesh_pins_every_peer_and_installs_one_key(tmp_path, monkeypatch):
    section = {"python": {"interpreter": "fakepython"}, "ssh_mesh": True}
    facts = {"host_key": "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIFakeHostKeyForTests", "hostname": "box"}
    c = cluster(tmp_path, monkeypatch, section, env={"FAKE_FACTS": json.dumps(facts)})
    report = run(c, only=["ssh_mesh"])
    assert outcomes(report)[("n1", "ssh_mesh")][0] == "changed"
    ssh = c.home(1) / ".ssh"
    key = (tmp_path / "cache" / "clusterctl" / "mesh" / c.name / "id_ed25519").read_bytes()
    assert (ssh / f"clusterctl-{c.name}_ed25519").read_bytes().strip() == key.strip()
    # both hosts say they are `box`: a name two hosts claim is pinned for neither (a host may only name itself)
    assert (ssh / f"clusterctl-{c.name}.known_hosts").read_text().splitlines() == [
        f"127.0.0.1 {facts['host_key']}", f"127.0.0.2 {facts['host_key']}"]
    assert "Host 127.0.0.1 127.0.0.2" in (ssh / "config").read_text()
    assert (ssh / "authorized_keys").read_text().endswith(f"clusterctl-mesh-{c.name}\n")
    assert outcomes(run(c, only=["ssh_mesh"]))[("n1", "ssh_mesh")] == ("ok", "")


def test_the_wheelhouse_downloads_once_and_uploads_what_a_host_lacks(tmp_path, monkeypatch):
    tiny_wheel(tmp_path / "wheels")
    (tmp_path / "index").mkdir()
    section = {"python": {"requirements": ["tinypkg==1.0"]},
               "wheelhouse": {"local": str(tmp_path / "wh"), "index_url": (tmp_path / "index").as_uri(),
                              "find_links": ["wheels"]}}
    c = cluster(tmp_path, monkeypatch, section)
    checked = run(c, only=["wheelhouse"], check=True)
    assert outcomes(checked) == {(h, "wheelhouse"): ("changed", "upload 1 wheel(s)") for h in ("n0", "n1")}
    fake_exe(c.bin, "tar", BROKEN_TAR_ON_N1)
    report = run(c, only=["wheelhouse"])
    assert outcomes(report)[("n0", "wheelhouse")][0] == "changed"
    assert outcomes(report)[("n0", "wheelhouse")][1].startswith("uploaded 1 wheel(s), ")
    assert outcomes(report)[("n1", "wheelhouse")] == ("failed", "upload failed: tar: write error: No space left")
    uploaded = c.home(0) / ".clusterctl" / "wheelhouse" / "tinypkg-1.0-py3-none-any.whl"
    assert uploaded.read_bytes() == (tmp_path / "wheels" / "tinypkg-1.0-py3-none-any.whl").read_bytes()
    (c.bin / "tar").unlink()
    again = outcomes(run(c, only=["wheelhouse"]))  # the host that has it is left alone; the other gets it now
    assert again[("n0", "wheelhouse")] == ("ok", "") and again[("n1", "wheelhouse")][0] == "changed"
    assert (c.home(1) / ".clusterctl" / "wheelhouse" / uploaded.name).read_bytes() == uploaded.read_bytes()


def test_a_wheelhouse_without_requirements_has_nothing_to_do(tmp_path, monkeypatch):
    section = {"python": {"requirements": []}, "wheelhouse": {"local": str(tmp_path / "wh")}}
    c = cluster(tmp_path, monkeypatch, section, hosts=1)
    assert outcomes(run(c, only=["wheelhouse"])) == {("n0", "wheelhouse"): ("ok", "no pip requirements")}


def _deb(folder, name="fakepkg-fk", version="1.0"):
    root = folder / "build"
    (root / "DEBIAN").mkdir(parents=True)
    (root / "DEBIAN" / "control").write_text(
        f"Package: {name}\nVersion: {version}\nArchitecture: all\nMaintainer: t <t@example.org>\nDescription: test\n")
    deb = folder / f"{name}_{version}_all.deb"
    subprocess.run(["dpkg-deb", "--build", "--root-owner-group", str(root), str(deb)], check=True, capture_output=True)
    return deb


def test_offline_apt_resolves_downloads_and_uploads_on_the_controller(tmp_path, monkeypatch):
    deb = _deb(tmp_path)
    digest = hashlib.sha256(deb.read_bytes()).hexdigest()
    section = {"apt": {"packages": ["fakepkg-fk"], "offline": {"local": str(tmp_path / "aptcache"), "file_roots": [str(tmp_path)]}}}
    c = cluster(tmp_path, monkeypatch, section)
    # the host's apt step itself is not under test here (and must not touch this machine's /etc/apt)
    fake_exe(c.bin, "bash", 'echo "CLUSTERCTL_STEP apt ok"\n')
    # the controller's apt-get (its solver, against each host's copied configuration) names the .deb to fetch
    ctl = tmp_path / "controller-bin"
    fake_exe(ctl, "apt-get", f"""\
        case " $* " in *" update "*) exit 0 ;; esac
        echo "'{deb.as_uri()}' {deb.name} {deb.stat().st_size} MD5Sum:0"
        """)
    # and apt-cache the index's SHA256 for it (apt-get --print-uris gives MD5 at most)
    fake_exe(ctl, "apt-cache", f"""\
        printf 'Package: fakepkg-fk\\nFilename: ./{deb.name}\\nSize: {deb.stat().st_size}\\nSHA256: {digest}\\n'
        """)
    monkeypatch.setenv("PATH", f"{ctl}:{os.environ['PATH']}")
    checked = run(c, check=True, only=["apt"])  # resolved and downloaded; nothing uploaded under --check
    assert (tmp_path / "aptcache" / "debs" / f"sha256-{digest[:32]}" / deb.name).read_bytes() == deb.read_bytes()
    assert not (c.home(0) / ".clusterctl" / "apt-offline").exists()
    assert outcomes(checked) == {(h, "apt"): ("ok", "") for h in ("n0", "n1")}
    # the upload to n1 fails (its tar cannot write): that host fails the step, naming why; n0 got the files
    fake_exe(c.bin, "tar", BROKEN_TAR_ON_N1)
    report = run(c, only=["apt"])
    assert outcomes(report)[("n1", "apt")] == ("failed", "offline apt: upload failed: tar: write error: No space left")
    assert outcomes(report)[("n0", "apt")] == ("ok", "")
    repo = c.home(0) / ".clusterctl" / "apt-offline"
    assert (repo / deb.name).read_bytes() == deb.read_bytes()
    assert f"Filename: ./{deb.name}" in (repo / "Packages").read_text()
    assert json.loads((repo / "clusterctl-manifest.json").read_text())[deb.name][1] == digest


def test_provision_refuses_specs_it_cannot_run(tmp_path, monkeypatch):
    c = cluster(tmp_path, monkeypatch, COMMANDS, hosts=1)
    with c.session() as s, pytest.raises(ProvisionError, match="unknown step 'apt-get' for --only"):
        provision(s, only=["apt-get"])
    with c.session() as s, pytest.raises(ProvisionError, match="--only apt: the spec's provision section has no apt step"):
        provision(s, only=["apt"])
    bare = FakeCluster(tmp_path / "bare", hosts=1)
    with bare.session() as s, pytest.raises(ProvisionError, match="has no provision: section"):
        provision(s)
    # offline apt for an apt-method GPU component without cuda.repository: the spec's error, before any host
    with pytest.raises(SpecError, match="cuda.repository"):
        cluster(tmp_path / "gpu", monkeypatch, {"cuda": "12.4", "apt": {"offline": True}}, hosts=1).spec()
