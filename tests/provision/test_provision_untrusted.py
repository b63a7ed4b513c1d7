"""What a compromised host sends to provision and doctor (its apt sources, its claimed hostname, its replies, its
step status lines) is taken within an allow-list and bounds; see docs/security.md."""

from __future__ import annotations

import pytest

from clusterctl.errors import BadReply
from clusterctl.plan import make_plan
from clusterctl.provision import mesh
from clusterctl.provision.aptoffline import prepare_root
from clusterctl.provision.aptstate import HostAptState, parse_sources
from clusterctl.provision.hostdata import doctor_facts, last_object
from clusterctl.provision.runner import parse_status
from clusterctl.provision.steps import HostFacts
from clusterctl.remote import Result
from clusterctl.spec import parse_spec

LOCAL_FORMS = [  # each names loopback or link-local as the controller's resolver (inet_aton) reads it
    "127.1", "2130706433", "0x7f000001", "0177.0.0.1", "0x7f.1", "0", "[::ffff:127.0.0.1]", "[::127.0.0.1]",
    "[2002:7f00:1::]", "2852039166", "169.254.43518", "[::ffff:169.254.169.254]", "224.0.0.1", "[ff02::1]", "0.0.0.0",
    "[::]", "localhost.",
]


@pytest.mark.parametrize("host", LOCAL_FORMS)
def test_a_host_source_on_loopback_in_any_form_is_dropped(host):
    """Only the canonical text was checked: 127.1 or 2852039166 (the cloud metadata address) sent the controller's
    apt to its own loopback, or to the metadata service, for a compromised host."""
    state = HostAptState("amd64", {"etc/apt/sources.list": f"deb http://{host}:8080/secret bookworm main\n".encode()}, b"")
    entries, notes = parse_sources(state)
    name = host.strip("[]")
    assert (entries, notes) == ([], [f"/etc/apt/sources.list:1: dropped http://{host}:8080/secret: {name} is the host "
                                     "itself (loopback or link-local), not a place the controller may fetch from"])


@pytest.mark.parametrize("host", ["1.2.3.4.5", "cafe.1", "127.0.0.1.", "999.1"])
def test_a_host_source_whose_name_ends_in_a_number_must_be_an_address(host):
    state = HostAptState("amd64", {"etc/apt/sources.list": f"deb http://{host}/d bookworm main\n".encode()}, b"")
    assert parse_sources(state) == ([], [f"/etc/apt/sources.list:1: dropped http://{host}/d: {host} is neither a host "
                                         "name nor an address"])


@pytest.mark.parametrize("host", ["deb.debian.org", "10.0.0.5", "[2001:db8::1]", "192.168.1.9", "mirror.example.com.",
                                  "99.example"])
def test_mirrors_by_name_or_private_address_are_kept(host):
    state = HostAptState("amd64", {"etc/apt/sources.list": f"deb http://{host}/d bookworm main\n".encode()}, b"")
    entries, notes = parse_sources(state)
    assert ([e.uris for e in entries], notes) == ([(f"http://{host}/d",)], [])


def test_the_controllers_apt_follows_no_redirect(tmp_path):
    """A checked source could redirect apt anywhere (its own loopback, the metadata address)."""
    state = HostAptState("amd64", {"etc/apt/sources.list": b"deb http://m.example/d bookworm main\n"}, b"")
    conf = (prepare_root(tmp_path, state, []) / "apt.conf").read_text().splitlines()
    assert 'Acquire::http::AllowRedirect "false";' in conf and 'Acquire::https::AllowRedirect "false";' in conf


MESH_SPEC = """\
name: demo
hosts:
  - address: 10.0.0.1
  - address: 10.0.0.2
  - address: 10.0.0.3
  - address: 10.0.0.4
job:
  entrypoint: [python3, train.py]
"""


def test_a_host_cannot_have_its_key_pinned_under_a_peers_name_or_an_address():
    """The hostname a host reports went into every host's known_hosts with that host's key, and into the Host line
    of their ssh config: n1 reporting n0's address had its key pinned for n0."""
    plan = make_plan(parse_spec(MESH_SPEC, "cluster.yaml"))
    claims = ["node0", "10.0.0.1", "node0", "127.1"]  # n0 honest; n1 names n0's address; n2 n0's hostname; n3 an IP
    facts = {h: HostFacts(hostname=claims[h.index], host_key=f"ssh-ed25519 AAAAkey{h.index}") for h in plan.hosts}
    own, dropped = mesh.own_names(plan.hosts, facts)
    assert own == dict.fromkeys(plan.hosts, "")
    assert [(h.label, why) for h, why in dropped] == [
        ("10.0.0.1", "its hostname node0 names 10.0.0.3 too"), ("10.0.0.2", "its hostname 10.0.0.1 names 10.0.0.1 too"),
        ("10.0.0.3", "its hostname node0 names 10.0.0.1 too"), ("10.0.0.4", "its hostname 127.1 is an IP address")]
    ctx = mesh.mesh_context("demo", "ssh-ed25519 BBBB clusterctl-mesh-demo", plan.hosts, facts)
    assert ctx["known_hosts"].splitlines() == [f"10.0.0.{i + 1} ssh-ed25519 AAAAkey{i}" for i in range(4)]
    assert "\nHost 10.0.0.1 10.0.0.2 10.0.0.3 10.0.0.4\n" in ctx["config_block"]
    # a name of its own, that no other host has, is pinned as before (case does not make two names of one)
    facts = {h: HostFacts(hostname=["node0", "node1", "NODE0", ""][h.index], host_key="ssh-ed25519 AAAAkey") for h in plan.hosts}
    assert list(mesh.own_names(plan.hosts, facts)[0].values()) == ["", "node1", "", ""]


def test_a_host_cannot_add_a_name_outside_the_spec_hosts_domains_to_the_mesh():
    """A host reporting github.com had that name pinned to its own key in every peer's mesh known_hosts, and put in
    the ssh config's Host line (that file, StrictHostKeyChecking yes): every peer's ssh to github.com was refused
    (or, where its DNS was also the attacker's, took this host for it)."""
    spec = MESH_SPEC.replace("10.0.0.3", "n3.corp.example")
    plan = make_plan(parse_spec(spec, "cluster.yaml"))
    claims = ["github.com", "n1.corp.example", "n3", "GitHub.COM."]
    facts = {h: HostFacts(hostname=claims[h.index], host_key=f"ssh-ed25519 AAAAkey{h.index}") for h in plan.hosts}
    own, dropped = mesh.own_names(plan.hosts, facts)
    # n1.corp.example: in the domain of a spec host (n3.corp.example); n3: a single label
    assert list(own.values()) == ["", "n1.corp.example", "n3", ""]
    assert [(h.label, why) for h, why in dropped] == [
        ("10.0.0.1", "its hostname github.com is a domain name outside the spec hosts' domains"),
        ("10.0.0.4", "its hostname GitHub.COM. is a domain name outside the spec hosts' domains")]
    ctx = mesh.mesh_context("demo", "ssh-ed25519 BBBB clusterctl-mesh-demo", plan.hosts, facts)
    assert "github" not in ctx["config_block"].lower() and "github" not in ctx["known_hosts"].lower()


@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity", "1e999", "-1e999"])
def test_a_reply_with_a_number_json_has_not_is_a_bad_reply(value):
    """`doctor --json` printed a host's NaN or Infinity as it came: no JSON parser outside Python reads that."""
    line = f'{{"kernel": {value}, "hostname": "n0"}}'
    with pytest.raises(BadReply) as info:
        last_object([line])
    assert str(info.value) == f"not JSON: {line}"
    with pytest.raises(BadReply, match="not a finite number: nan"):
        doctor_facts({"listen_port": float("nan")})


@pytest.mark.parametrize("stdout, reason", [
    ("CLUSTERCTL_STEP apt failed " + "E" * 100_000 + "\n", "E" * 300 + "..."),
    ("x" * 100_000 + "\n", "exit 1 without a status line: " + "x" * 300 + "..."),
    ("CLUSTERCTL_STEP apt failed bell\a and\x1b[2J\n", "bell\\x07 and\\x1b[2J"),
])
def test_a_hosts_reason_is_one_line_of_at_most_300_characters(stdout, reason):
    """A host's status line (or its last line) went into the table and the changes list whole: up to ~1 MiB."""
    assert parse_status("apt", Result(host="n1", command="x", exit_code=1, stdout=stdout, stderr="", seconds=0.1), 60).reason == reason
