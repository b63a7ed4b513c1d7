"""Facts a compromised host reports to the provisioning probe and to doctor are untrusted (issue 21): checked
before they reach a controller tool or another host (its hostname and host key go into every peer's ssh config
and known_hosts through ssh_mesh). The real runner over fake hosts (tests/unit/fakehosts.py): the real probe
runs on each host, and one host's interpreter rewrites the reply as a compromised host would."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from clusterctl.provision.doctor import doctor
from clusterctl.provision.hostdata import BadReply, doctor_facts, probe_facts
from clusterctl.provision.runner import provision

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
from fakehosts import FakeCluster, fake_exe  # noqa: E402

# The hosts' interpreter runs the real script and merges $FAKE_FACTS into its reply (a host key to pin); on n1
# it then merges the JSON in $HOSTILE_FILE, as a compromised host would, or prints $RAW_FILE instead.
HOSTILE_PYTHON = """\
    if [ "$(basename "$HOME")" = n1 ] && [ -s "$RAW_FILE" ]; then cat "$RAW_FILE"; exit 0; fi
    python3 "$@" | python3 -c 'import json, os, sys
    d = json.loads(sys.stdin.read().splitlines()[-1]); d.update(json.loads(os.environ["FAKE_FACTS"]))
    if os.path.basename(os.environ["HOME"]) == "n1":
        d.update(json.load(open(os.environ["HOSTILE_FILE"])))
    print(json.dumps(d))'
    """
KEY = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIFakeHostKeyForTests"


def _cluster(tmp_path, monkeypatch, hostile: dict | None = None, raw: str = ""):
    (tmp_path / "hostile.json").write_text(json.dumps(hostile or {}))
    (tmp_path / "hostile.raw").write_text(raw)
    env = {"HOSTILE_FILE": str(tmp_path / "hostile.json"), "RAW_FILE": str(tmp_path / "hostile.raw"),
           "FAKE_FACTS": json.dumps({"host_key": KEY, "hostname": "box"})}
    c = FakeCluster(tmp_path / "c", hosts=2, extra={"provision": {"python": {"interpreter": "hostilepython"}, "ssh_mesh": True}},
                    env=env)
    fake_exe(c.bin, "hostilepython", HOSTILE_PYTHON)
    return c.everywhere(monkeypatch)


def _outcomes(report):
    return {(h.label, step): (o.status, o.reason) for (h, step), o in report.outcomes.items()}


@pytest.mark.parametrize("hostile, why", [
    ({"hostname": "box\n    ProxyCommand touch /tmp/pwned", "host_key": KEY},
     "hostname: not a hostname: box\\n    ProxyCommand touch /tmp/pwned"),
    ({"hostname": "*", "host_key": KEY}, "hostname: not a hostname: *"),
    ({"hostname": "box", "host_key": KEY + "\n@cert-authority * " + KEY},
     "host_key: not a host_key: " + (KEY + "\\n@cert-authority * " + KEY)[:80] + "..."),
    ({"glibc": "two.thirty-six"}, "glibc: not a glibc: two.thirty-six"),
    ({"machine": "x86_64 --index-url http://evil"}, "machine: not a machine: x86_64 --index-url http://evil"),
    ({"home": "relative\n"}, "home: not an absolute path: relative\\n"),
    ({"uid": "0"}, "uid: not a user id: 0"),
    ({"wheels": [["../x.whl", 1]]}, "wheels: not a [name, size]: ['../x.whl', 1]"),
])
@pytest.mark.timeout(120)
def test_a_hostile_probe_reply_fails_that_host_and_never_reaches_the_others(tmp_path, monkeypatch, hostile, why):
    c = _cluster(tmp_path, monkeypatch, hostile)
    with c.session() as s:
        report = provision(s, only=["ssh_mesh"])
    got = _outcomes(report)
    assert got[("n1", "ssh_mesh")] == ("failed", f"probe printed an unexpected reply: {why}")
    assert got[("n0", "ssh_mesh")][0] == "changed", got  # the mesh of the hosts the probe could trust
    ssh = c.home(0) / ".ssh"
    assert "\nHost 127.0.0.1 box\n" in (ssh / "config").read_text()
    assert (ssh / f"clusterctl-{c.name}.known_hosts").read_text().splitlines() == [f"127.0.0.1,box {KEY}"]
    written = "".join(p.read_text() for p in ssh.glob("*"))
    assert "ProxyCommand" not in written and "cert-authority" not in written and "Host *" not in written


@pytest.mark.parametrize("raw, why", [
    ("\n", "no JSON reply (last line: nothing)"),
    ("motd\n{not json\n", "not JSON: {not json"),
    ('["a list"]\n', "no JSON reply (last line: [\"a list\"])"),
    ('{"python": "3.11"}\n', "machine: not a string of at most 4096 characters: None"),
    ("[" * 100000 + "{" + "\n", "not JSON: " + "[" * 80 + "..."),
])
@pytest.mark.timeout(60)
def test_garbage_from_the_probe_is_one_line(tmp_path, monkeypatch, raw, why):
    c = _cluster(tmp_path, monkeypatch, raw=raw)
    with c.session() as s:
        report = provision(s, only=["ssh_mesh"])
    assert _outcomes(report)[("n1", "ssh_mesh")] == ("failed", f"probe printed an unexpected reply: {why}")


@pytest.mark.timeout(60)
def test_a_probe_reply_over_the_limit_is_refused(tmp_path, monkeypatch):
    from clusterctl.provision import probe

    monkeypatch.setattr(probe, "MAX_REPLY", 1 << 20)
    c = _cluster(tmp_path, monkeypatch, {"wheels": [[f"w{i}.whl", i] for i in range(60000)]})
    with c.session() as s:
        report = provision(s, only=["ssh_mesh"])
    assert _outcomes(report) == {("n1", "ssh_mesh"): ("failed", "probe printed an unexpected reply: the reply is larger than 1 MiB"),
                                 ("n0", "ssh_mesh"): ("changed", _outcomes(report)[("n0", "ssh_mesh")][1])}


@pytest.mark.timeout(120)
def test_a_hostile_doctor_reply_is_one_problem_line_and_the_other_hosts_are_reported(tmp_path, monkeypatch):
    c = _cluster(tmp_path, monkeypatch)
    real = Path(c.bin / "python3").resolve()
    (c.bin / "python3").unlink()  # n1's python3 answers doctor with a reply of the wrong shape
    fake_exe(c.bin, "python3", f"""\
        if [ "$(basename "$HOME")" = n1 ] && [ "$1" = - ]; then echo '{{"venv": 1, "hostname": "x"}}'; exit 0; fi
        exec {real} "$@"
        """)
    with c.session() as s:
        report = doctor(s)
    n0, n1 = report.hosts
    assert report.facts[n1] is None and report.facts[n0]["hostname"]
    assert f"{n1.label}: facts script printed an unexpected reply: os: missing" in report.problems
    assert report.rows()  # the table renders with n1's error in its column


def test_doctor_replies_are_checked_and_made_printable():
    good = {"hostname": "h\x1b[2J", "os": "Debian", "python3": "3.11.2", "venv": {"path": "", "exists": False},
            "gpu": {"gpus": [], "driver": ""}, "ports": {"6168": "free"}, "reach": {"n1": {"ssh": "ok"}}}
    assert doctor_facts(good)["hostname"] == "h\\x1b[2J"
    for bad, why in (({**good, "venv": 1}, "venv: not a dict: 1"),
                     ({**good, "ports": {"1": 2}}, "ports: not a port -> state mapping"),
                     ({**good, "reach": {"n1": "ok"}}, "reach.n1: not a kind -> state mapping"),
                     ({k: v for k, v in good.items() if k != "gpu"}, "gpu: missing")):
        with pytest.raises(BadReply) as err:
            doctor_facts(bad)
        assert str(err.value) == why
    with pytest.raises(BadReply, match="nested too deep"):
        doctor_facts({**good, "extra": json.loads("[" * 20 + "]" * 20)})
    assert probe_facts({"python": "3.11", "machine": "x86_64", "hostname": "box"})["wheels"] == ()


@pytest.mark.timeout(120)
def test_null_gpu_versions_in_a_doctor_reply_show_as_absent(tmp_path, monkeypatch):
    c = _cluster(tmp_path, monkeypatch)
    real = Path(c.bin / "python3").resolve()
    (c.bin / "python3").unlink()  # n1 runs the real facts script, then reports every GPU version as null
    fake_exe(c.bin, "python3", f"""\
        if [ "$(basename "$HOME")" = n1 ] && [ "$1" = - ]; then
            {real} "$@" | {real} -c 'import json, sys
        d = json.loads(sys.stdin.read().splitlines()[-1])
        d["gpu"].update(toolkit=None, cudnn=None, nccl=None, driver=None)
        print(json.dumps(d))'
            exit 0
        fi
        exec {real} "$@"
        """)
    with c.session() as s:
        report = doctor(s)  # comparing the hosts' CUDA versions raised AttributeError on None
    n0, n1 = report.hosts
    assert report.facts[n1]["gpu"] | {"gpus": []} == {"gpus": [], "toolkit": "", "cudnn": "", "nccl": "", "driver": ""}
    rows = {r[0]: r[1:] for r in report.rows()}
    for name in ("CUDA toolkit", "cuDNN", "NCCL", "driver"):
        assert rows[name][1] == "-", (name, rows[name])
    assert not [p for p in report.problems if "unexpected reply" in p], report.problems  # n1's facts were taken
