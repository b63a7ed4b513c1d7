"""Offline apt treats what a host sends as untrusted (issue 21): each attack against the real component, with
real apt on the controller (this machine), loopback HTTP mirrors and a crafted host /etc/apt.

- a host's apt.conf / apt.conf.d hooks (APT::Update::Pre-Invoke, Post-Invoke-Success, DPkg::Pre-Invoke) never
  run on the controller: a marker file they would create must not appear (and does appear in the control
  run, where apt is made to read them); `apt-config dump` of the controller's apt root shows none of them;
- what a host sends outside the allow-list, or garbage, or too much, is refused in one line;
- `file:` URIs are read only inside apt.offline.file_roots (also through `../` in an index, or a symlink);
- a mirror that drips bytes (index or .deb, headers or body) is cut off at the deadline, with a message naming
  the host and the URL, and apt's processes are gone.
"""

from __future__ import annotations

import base64
import gzip
import hashlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from clusterctl import cli
from clusterctl.errors import ProvisionError
from clusterctl.provision import aptoffline
from clusterctl.provision.aptstate import LIMITS, STATE_HEADER, HostAptState, StateReader, parse_sources
from clusterctl.provision.schema import AptSource

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "provision"))
from provision_helpers import build_repo  # noqa: E402

pytestmark = pytest.mark.skipif(shutil.which("apt-get") is None or shutil.which("dpkg-scanpackages") is None,
                                reason="needs apt-get and dpkg-dev on the controller (Debian/Ubuntu)")

DRIP_EVERY_S = 0.2  # one byte per this many seconds: slower than any deadline below could wait out
SLACK_S = 8.0  # a deadline may fire this late on a loaded 2-core machine (thread scheduling, apt's exit)


class Mirror:
    """A loopback HTTP server over a directory; `drip` names what it sends one byte at a time:
    "deb" (.deb bodies), "index" (Release/Packages bodies), "headers" (every response's status line).
    `redirect`: a URL every request is sent on to (302); `bind`: its address. `hits`: the paths asked for."""

    def __init__(self, folder: Path, drip: str = "", redirect: str = "", bind: str = "127.0.0.1"):
        self.folder, self.drip, self.stopping = folder, drip, threading.Event()
        self.hits: list[str] = []
        mirror = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _slow(self, data: bytes) -> None:
                for i in range(len(data)):
                    if mirror.stopping.wait(DRIP_EVERY_S):
                        return
                    self.wfile.write(data[i:i + 1])
                    self.wfile.flush()

            def do_GET(self):
                rel = urllib.parse.unquote(urllib.parse.urlsplit(self.path).path).lstrip("/")
                mirror.hits.append(rel)
                if mirror.redirect:
                    self.send_response(302)
                    self.send_header("Location", mirror.redirect + rel)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                path = (mirror.folder / rel).resolve()
                if mirror.drip == "headers":
                    return self._slow(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n")
                if mirror.folder.resolve() not in path.parents or not path.is_file():
                    self.send_error(404)
                    return
                data = path.read_bytes()
                self.send_response(200)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                slow = (mirror.drip == "deb" and path.suffix == ".deb") or (
                    mirror.drip == "index" and path.name.split(".")[0] in ("Release", "InRelease", "Packages"))
                if slow:
                    self._slow(data)
                else:
                    self.wfile.write(data)

        self.redirect = redirect
        self.server = ThreadingHTTPServer((bind, 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}/"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.stopping.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def repo(tmp_path) -> Path:
    """A flat repository with one empty package, ctl-safe 1.0-1 (built with dpkg-deb and dpkg-scanpackages)."""
    return build_repo(tmp_path / "build", [("ctl-safe", "1.0-1")])


@pytest.fixture
def mirrors():
    made = []

    def make(folder: Path, drip: str = "", **kw) -> Mirror:
        made.append(Mirror(folder, drip, **kw))
        return made[-1]

    yield make
    for m in made:
        m.close()


def _state_stream(etc: Path) -> str:
    """What the real host-state script prints on a host whose /etc/apt is `etc` (a private mount namespace)."""
    script = aptoffline.HOST_STATE_SCRIPT
    proc = subprocess.run(["unshare", "-m", "sh", "-c", 'mount --bind "$1" /etc/apt && exec python3 -c "$2" "$3"', "sh",
                           str(etc), script, str(etc.parent / "repo")], capture_output=True, text=True, timeout=60)
    if proc.returncode != 0 and "mount" in proc.stderr + proc.stdout:
        pytest.skip(f"no private mount namespace here: {proc.stderr.strip()}")
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def _crafted_etc(tmp: Path, marker: Path, mirror_url: str) -> Path:
    """A hostile host's /etc/apt: hooks in apt.conf and apt.conf.d, credentials, sources the controller must not
    fetch (file:, ssh:, mirror+file:, loopback, a keyring path it does not send), and one it may."""
    etc = tmp / "hostile-etc-apt"
    (etc / "apt.conf.d").mkdir(parents=True)
    (etc / "sources.list.d").mkdir()
    (etc / "keyrings").mkdir()
    hook = f'"touch {marker}";'
    (etc / "apt.conf").write_text(f"APT::Update::Pre-Invoke {{ {hook} }};\nClusterctl::Test::FromHost \"apt.conf\";\n")
    (etc / "apt.conf.d" / "99evil").write_text(
        f"APT::Update::Pre-Invoke {{ {hook} }};\nAPT::Update::Post-Invoke-Success {{ {hook} }};\n"
        f"DPkg::Pre-Invoke {{ {hook} }};\nAcquire::http::Proxy-Auto-Detect \"/bin/sh -c 'touch {marker}'\";\n"
        'Dir::Bin::methods "/tmp/evil-methods/";\nClusterctl::Test::FromHost "apt.conf.d";\n')
    (etc / "auth.conf").write_text("machine mirror.example login u password SECRET-IN-AUTH-CONF\n")
    (etc / "keyrings" / "good.gpg").write_bytes(b"not really a key")
    (etc / "sources.list").write_text(
        "deb [trusted=yes] file:/etc ./\n"
        "deb ssh://attacker@mirror.example/repo ./\n"
        f"deb [trusted=yes] {mirror_url} ./\n"
        "deb [trusted=yes signed-by=/root/.ssh/id_ed25519] http://mirror.example/debian bookworm main\n")
    (etc / "sources.list.d" / "evil.sources").write_text(
        "Types: deb\nURIs: mirror+file:/etc/passwd\nSuites: ./\n\n"
        "Types: deb-src\nURIs: http://mirror.example/debian\nSuites: bookworm\nComponents: main\n")
    return etc


def _apt_config(root: Path) -> str:
    env = dict(os.environ, APT_CONFIG=str(root / "apt.conf"))
    return subprocess.run(["apt-config", "dump"], capture_output=True, text=True, env=env, check=True, timeout=30).stdout


def _apt_processes(root: Path) -> list[int]:
    """Processes whose environment points at this apt root (apt-get and its methods)."""
    found = []
    needle = f"APT_CONFIG={root / 'apt.conf'}".encode()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as fh:
                if needle in fh.read().split(b"\0"):
                    found.append(int(pid))
        except OSError:
            pass
    return found


@pytest.mark.timeout(180)
def test_a_hostile_hosts_apt_hooks_never_run_on_the_controller(tmp_path, repo, mirrors):
    marker = tmp_path / "HOOK-RAN-ON-CONTROLLER"
    mirror = mirrors(repo)
    etc = _crafted_etc(tmp_path, marker, mirror.url)
    stream = _state_stream(etc)
    assert stream.splitlines()[0] == STATE_HEADER
    assert "apt.conf" not in stream.replace("apt.conf.d", "").replace("sources.list", "") and "SECRET" not in stream
    state = aptoffline.parse_state(stream, "node7")
    assert sorted(p for p in state.config if p.startswith("etc/")) == ["etc/apt/keyrings/good.gpg", "etc/apt/sources.list",
                                    "etc/apt/sources.list.d/evil.sources"]

    cache, lines = tmp_path / "cache", []
    source = AptSource(name="spec-mirror", uri=mirror.url, trusted=True)
    debs = aptoffline.resolve(cache, state, ["ctl-safe"], [(source, b"")], label="node7", log=lines.append,
                              deadline=aptoffline.Deadline(120, "apt.offline.timeout"))
    assert [(d.uri, d.filename) for d in debs] == [(f"{mirror.url}./ctl-safe_1.0-1_all.deb", "ctl-safe_1.0-1_all.deb")]
    deb = repo / "ctl-safe_1.0-1_all.deb"
    assert debs[0].digest == "sha256:" + hashlib.sha256(deb.read_bytes()).hexdigest()
    [path] = aptoffline.download(cache, debs, deadline=aptoffline.Deadline(60, "apt.offline.timeout"), label="node7",
                                 trusted=aptoffline.source_hosts([(source, b"")]))
    assert path.read_bytes() == deb.read_bytes()
    assert not marker.exists(), "a host's apt hook ran on the controller"
    notes = [ln for ln in lines if ln.startswith("controller: host source ")]
    assert notes == [
        "controller: host source /etc/apt/sources.list:1: dropped file:/etc: scheme file: the controller fetches only http(s) sources of a host",
        "controller: host source /etc/apt/sources.list:2: dropped ssh://attacker@mirror.example/repo: scheme ssh: the controller fetches only http(s) sources of a host",
        f"controller: host source /etc/apt/sources.list:3: dropped {mirror.url}: 127.0.0.1 is the host itself (loopback or link-local), not a place the controller may fetch from",
        "controller: host source /etc/apt/sources.list:4: dropped: Signed-By /root/.ssh/id_ed25519: a keyring offline apt does not take from the host",
        "controller: host source /etc/apt/sources.list.d/evil.sources:1: dropped mirror+file:/etc/passwd: scheme mirror+file: the controller fetches only http(s) sources of a host",
    ], lines

    [root] = (cache / "roots").iterdir()
    dump = _apt_config(root)
    for name in aptoffline.HOOK_LISTS:
        assert not re.search(rf"^{re.escape(name)}\b", dump, re.M | re.I), name
    assert "FromHost" not in dump and "Proxy-Auto-Detect" not in dump
    assert re.search(r'^Dir::Bin::methods "/usr/lib/apt/methods/";$', dump, re.M)
    assert not list(root.rglob("apt.conf.d")) and not list(root.rglob("auth.conf*"))

    # Control: the same hooks do run when apt reads the host's apt.conf.d (what offline apt used to do: its
    # configuration left Dir::Etc::parts inside the copy of the host's /etc/apt), so the check above can fail.
    control = tmp_path / "control-apt.conf"
    control.write_text(re.sub(r'^Dir::Etc::parts .*$', f'Dir::Etc::parts "{etc / "apt.conf.d"}/";',
                              (root / "apt.conf").read_text(), flags=re.M))
    subprocess.run(["apt-get", "-q", "update"], env=dict(os.environ, APT_CONFIG=str(control)),
                   capture_output=True, timeout=120, check=False)
    assert marker.exists()


def _records(*records: dict, header: bool = True, end: bool = True) -> str:
    lines = ["motd noise a shell printed"] + ([STATE_HEADER] if header else [])
    lines += [json.dumps(r) for r in records] + ([json.dumps({"end": True})] if end else [])
    return "\n".join(lines) + "\n"


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


@pytest.mark.parametrize("stream, why", [
    (_records({"arch": "amd64"}, {"path": "etc/apt/apt.conf.d/99evil", "data": _b64(b'APT::Update::Pre-Invoke {"id";};')}),
     "line 4: the host sent /etc/apt/apt.conf.d/99evil, which offline apt never takes from a host"),
    (_records({"arch": "amd64"}, {"path": "etc/apt/apt.conf", "data": ""}),
     "line 4: the host sent /etc/apt/apt.conf, which offline apt never takes from a host"),
    (_records({"arch": "amd64"}, {"path": "etc/apt/auth.conf", "data": ""}),
     "line 4: the host sent /etc/apt/auth.conf, which offline apt never takes from a host"),
    (_records({"arch": "amd64"}, {"path": "etc/apt/keyrings/../apt.conf.d/x", "data": ""}),
     "line 4: the host sent /etc/apt/keyrings/../apt.conf.d/x, which offline apt never takes from a host"),
    (_records({"arch": 'amd64"; APT::Update::Pre-Invoke {"id";}; //'}),
     "line 3: not a dpkg architecture: amd64\"; APT::Update::Pre-Invoke {\"id\";}; //"),
    (_records({"arch": "amd64"}, {"path": "etc/apt/sources.list", "data": "%%%"}),
     "line 4: Only base64 data is allowed"),
    (_records({"arch": "amd64"}, {"deb": ["../../x.deb", 1, "0" * 64]}),
     'line 4: not a .deb listing: ["../../x.deb", 1, "' + "0" * 60 + '...'),
    (_records({"arch": "amd64"}, {"exec": "id"}), 'line 4: unknown record ["exec"]'),
    (_records({"arch": "amd64"}) + "\x1b[2Jnot json\n", "line 5: output after the end record"),
    (_records({"arch": "amd64"}, end=False) + "\x1b[2Jnot json\n", "line 4: not a JSON record: \\x1b[2Jnot json"),
    (_records({"arch": "amd64"}, end=False), "cut short (no end record)"),
    (_records({"arch": "amd64"}, header=False), "no state header (is python3 on the host?)"),
    (_records(), "no architecture"),
    (_records({"arch": "amd64"}, {"note": "x"}) + "[" * 100000 + "\n", "line 6: output after the end record"),
    (_records({"arch": "amd64"}, end=False) + "[" * 100000 + "\n", "line 4: not a JSON record: " + "[" * 80 + "..."),
    (_records({"arch": "amd64"}, end=False) + "x" * (LIMITS["line"] + 1) + "\n", "line 4: longer than 256 KiB"),
])
def test_what_a_host_sends_outside_the_allow_list_or_garbage_is_refused_in_one_line(stream, why):
    with pytest.raises(ProvisionError) as err:
        aptoffline.parse_state(stream, "node7")
    assert str(err.value) == f"offline apt: the state node7 sent is not usable: {why}"


def test_a_host_cannot_send_more_than_the_limits(monkeypatch):
    monkeypatch.setitem(LIMITS, "status", 100_000)
    chunk = {"path": "var/lib/dpkg/status", "data": _b64(b"x" * 49152)}
    with pytest.raises(ProvisionError, match=r"^offline apt: the state n sent is not usable: line 6: "
                                             r"/var/lib/dpkg/status is larger than 0 MiB$"):
        aptoffline.parse_state(_records({"arch": "amd64"}, chunk, chunk, chunk), "n")
    monkeypatch.setitem(LIMITS, "files", 2)
    files = [{"path": f"etc/apt/keyrings/k{i}", "data": ""} for i in range(3)]
    with pytest.raises(ProvisionError, match=r"line 6: more than 2 apt files$"):
        aptoffline.parse_state(_records({"arch": "amd64"}, *files), "n")
    monkeypatch.setitem(LIMITS, "total", 1 << 20)
    reader = StateReader("n")
    for _ in range(100):
        reader.feed("y" * 20000)  # noise before the header counts too
    with pytest.raises(ProvisionError, match=r"not usable: it sent more than 1 MiB$"):
        reader.state()


def test_host_sources_are_rewritten_from_an_allow_list():
    sources = (
        "deb [arch=amd64 trusted=yes lang=none target=Contents-deb inrelease-path=../../x] http://m.example/debian bookworm main contrib\n"
        "deb [signed-by=/etc/apt/keyrings/k.gpg] https://m.example/x ./\n"
        "deb http://[::1]:80/debian bookworm main\n"
        "deb http://169.254.169.254/latest ./\n"
        "deb http://user:pw@m.example/debian bookworm main\n"
        "deb cdrom:[Debian]/ bookworm main\n"
        "deb http://m.example/debian bookworm ma$in\n"
    )
    deb822 = (
        "Types: deb\nURIs: https://m.example/a https://localhost/b\nSuites: s\nComponents: c\nEnabled: yes\n"
        "Signed-By:\n -----BEGIN PGP PUBLIC KEY BLOCK-----\n .\n mQINBGR=\n -----END PGP PUBLIC KEY BLOCK-----\n"
        "X-Repolib-Name: weird\n\n"
        "Types: deb\nURIs: https://m.example/off\nSuites: s\nEnabled: no\n"
    )
    state = HostAptState("amd64", {"etc/apt/keyrings/k.gpg": b"k", "etc/apt/sources.list": sources.encode(),
                                   "etc/apt/sources.list.d/a.sources": deb822.encode()}, b"")
    entries, notes = parse_sources(state)
    assert [e.deb822("/ROOT") for e in entries] == [
        "Types: deb\nURIs: http://m.example/debian\nSuites: bookworm\nComponents: main contrib\n"
        "Architectures: amd64\nTrusted: yes\nLanguages: none\n",
        "Types: deb\nURIs: https://m.example/x\nSuites: ./\nSigned-By: /ROOT/etc/apt/keyrings/k.gpg\n",
        "Types: deb\nURIs: https://m.example/a\nSuites: s\nComponents: c\nSigned-By:\n"
        " -----BEGIN PGP PUBLIC KEY BLOCK-----\n .\n mQINBGR=\n -----END PGP PUBLIC KEY BLOCK-----\n",
    ]
    assert notes == [
        "/etc/apt/sources.list:1: option target ignored (not one offline apt takes from a host)",
        "/etc/apt/sources.list:1: option inrelease-path ignored (not one offline apt takes from a host)",
        "/etc/apt/sources.list:3: dropped http://[::1]:80/debian: ::1 is the host itself (loopback or link-local), not a place the controller may fetch from",
        "/etc/apt/sources.list:4: dropped http://169.254.169.254/latest: 169.254.169.254 is the host itself (loopback or link-local), not a place the controller may fetch from",
        "/etc/apt/sources.list:5: dropped http://user:pw@m.example/debian: credentials in the URI",
        "/etc/apt/sources.list:6: dropped cdrom:[Debian]/: scheme cdrom: the controller fetches only http(s) sources of a host",
        "/etc/apt/sources.list:7: dropped: not a suite and components apt reads: ma$in",
        "/etc/apt/sources.list.d/a.sources:1: dropped https://localhost/b: localhost is the host itself (loopback or link-local), not a place the controller may fetch from",
        "/etc/apt/sources.list.d/a.sources:1: option X-Repolib-Name ignored (not one offline apt takes from a host)",
    ]


def test_deb822_continuation_lines_are_read_as_before():
    deb822 = (
        "# a comment\nTypes: deb\nURIs: https://m.example/a\n https://m.example/b\n"
        "suites: bookworm\n\tbookworm-updates\nComponents: main\n contrib  \n"
        "Languages: none\n en\nSigned-By: /etc/apt/keyrings/k.gpg\n  /etc/apt/keyrings/j.gpg\n"
        "Components: non-free\n non-free-firmware\n\n"  # a field given twice: the last one, with its own lines
        "Types: deb\n deb-src\nURIs:\n https://m.example/c\nSuites: s\n"
    )
    state = HostAptState("amd64", {"etc/apt/keyrings/k.gpg": b"k", "etc/apt/keyrings/j.gpg": b"j",
                                   "etc/apt/sources.list.d/a.sources": deb822.encode()}, b"")
    entries, notes = parse_sources(state)
    assert [e.deb822("/ROOT") for e in entries] == [
        "Types: deb\nURIs: https://m.example/a https://m.example/b\nSuites: bookworm bookworm-updates\n"
        "Components: non-free non-free-firmware\nSigned-By: /ROOT/etc/apt/keyrings/k.gpg /ROOT/etc/apt/keyrings/j.gpg\n",
        "Types: deb\nURIs: https://m.example/c\nSuites: s\n",
    ]
    assert notes == ["/etc/apt/sources.list.d/a.sources:2: option Languages ignored: value none\\nen is not a plain word list"]


@pytest.mark.timeout(120)
def test_a_4_mib_stanza_of_continuation_lines_parses_in_linear_time():
    # Each continuation line was added to its field's string, copying it: this file took ~36 s of CPU.
    head = "Types: deb\nURIs: http://mirror.example/ubuntu\nSuites: jammy\nX-Note: a\n"
    text = head + " x\n" * ((LIMITS["file"] - len(head)) // 3)
    assert len(text) <= LIMITS["file"]
    state = HostAptState("amd64", {"etc/apt/sources.list.d/a.sources": text.encode()}, b"")
    start = time.process_time()
    entries, notes = parse_sources(state)
    assert time.process_time() - start < 2.0  # ~0.4 s here: room for a slow, busy machine
    assert [e.deb822("/ROOT") for e in entries] == ["Types: deb\nURIs: http://mirror.example/ubuntu\nSuites: jammy\n"]
    assert notes == ["/etc/apt/sources.list.d/a.sources:1: option X-Note ignored (not one offline apt takes from a host)"]


# ------------------------------------------------------------------------------------------- file: roots

def _flat_index(folder: Path, filename: str, data: bytes, package: str = "ctl-evil") -> None:
    """A flat repository index in `folder` whose one package's Filename is `filename` (may point anywhere)."""
    folder.mkdir(parents=True, exist_ok=True)
    index = (f"Package: {package}\nVersion: 1.0\nArchitecture: all\nMaintainer: t <t@example.invalid>\n"
             f"Filename: {filename}\nSize: {len(data)}\nSHA256: {hashlib.sha256(data).hexdigest()}\n"
             f"Description: test\n").encode()
    (folder / "Packages").write_bytes(index)
    (folder / "Packages.gz").write_bytes(gzip.compress(index))
    (folder / "Release").write_text("Origin: t\nSHA256:\n" + "".join(
        f" {hashlib.sha256(d).hexdigest()} {len(d)} {n}\n" for n, d in (("Packages", index), ("Packages.gz", gzip.compress(index)))))


def _empty_state() -> HostAptState:
    return HostAptState("amd64", {}, b"")


def _global_ipv4() -> str | None:
    """An IPv4 address of this machine that is neither loopback nor link-local (docker0's, eth0's), or None."""
    out = subprocess.run(["ip", "-o", "-4", "addr", "show", "scope", "global"], capture_output=True, text=True).stdout
    found = re.findall(r"\binet (\d+\.\d+\.\d+\.\d+)/", out)
    return found[0] if found else None


@pytest.mark.timeout(120)
def test_a_host_source_whose_name_resolves_to_the_controller_is_never_fetched(tmp_path, repo, mirrors, monkeypatch):
    """A host's source `http://NAME/` passes the check of its text (a name, not an address), but on the controller
    NAME may resolve to the loopback (or the metadata address). apt's fetches (through aptproxy's proxy) and the .deb
    downloads (redirects included) connect only to what the name resolved to, once, and refuse this machine."""
    mirror = mirrors(repo)  # on 127.0.0.1: where the hostile name leads
    names = {"mirror.evil.test": "127.0.0.1"}
    real = socket.getaddrinfo
    monkeypatch.setattr(socket, "getaddrinfo", lambda host, *a, **k: real(names.get(str(host).lower(), host), *a, **k))
    hostile = f"http://mirror.evil.test:{mirror.port}/"
    state = HostAptState("amd64", {"etc/apt/sources.list": f"deb [trusted=yes] {hostile} ./\n".encode()}, b"")
    deadline = aptoffline.Deadline(60, "apt.offline.timeout")
    with pytest.raises(ProvisionError) as err:
        aptoffline.resolve(tmp_path / "a", state, ["ctl-safe"], [], label="node7", deadline=deadline)
    assert str(err.value) == ("offline apt for node7: a source of the host refused: mirror.evil.test resolves to "
                              "127.0.0.1: the controller itself (loopback or link-local), not a place it may fetch from "
                              "(a mirror of yours there: name it in apt.sources)")
    assert mirror.hits == []

    # the same name in the spec's own sources is the user's: fetched as named (the refusal above is the check's)
    spec_source = [(AptSource(name="m", uri=hostile, trusted=True), b"")]
    debs = aptoffline.resolve(tmp_path / "b", _empty_state(), ["ctl-safe"], spec_source, label="node7", deadline=deadline)
    assert [d.uri for d in debs] == [f"{hostile}./ctl-safe_1.0-1_all.deb"] and mirror.hits
    [path] = aptoffline.download(tmp_path / "b", debs, deadline=deadline, label="node7",
                                 trusted=aptoffline.source_hosts(spec_source))
    assert path.read_bytes() == (repo / "ctl-safe_1.0-1_all.deb").read_bytes()

    # a .deb of a host's source (as apt's --print-uris names it): the download refuses it before it connects
    mirror.hits.clear()
    with pytest.raises(ProvisionError) as err:
        aptoffline.download(tmp_path / "c", debs, deadline=deadline, label="node7")
    assert str(err.value) == (f"offline apt for node7: cannot download {debs[0].uri} on the controller: mirror.evil.test "
                              "resolves to 127.0.0.1: the controller itself (loopback or link-local), not a place it may "
                              "fetch from")
    assert mirror.hits == []

    # and a redirect from a host's mirror that may be fetched to the loopback: followed to the check, not past it
    address = _global_ipv4()
    if address is None:
        pytest.skip("no global IPv4 address on this machine for a mirror that is not on the loopback")
    bouncer = mirrors(repo, redirect=f"http://127.0.0.1:{mirror.port}/", bind=address)
    names["cdn.evil.test"] = address
    bounced = [aptoffline.Deb(d.uri.replace(hostile, f"http://cdn.evil.test:{bouncer.port}/"), d.filename, d.size, d.digest)
               for d in debs]
    with pytest.raises(ProvisionError) as err:
        aptoffline.download(tmp_path / "d", bounced, deadline=deadline, label="node7")
    assert str(err.value).endswith(": 127.0.0.1 is the controller itself (loopback or link-local), not a place it may "
                                   "fetch from"), str(err.value)
    assert bouncer.hits == ["./ctl-safe_1.0-1_all.deb"] and mirror.hits == []


def _through(proxy_url: str, request: bytes, then: bytes = b"") -> bytes:
    """Send `request` to the proxy, and `then` once it answered; everything read until it closes."""
    port = urllib.parse.urlsplit(proxy_url).port
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(request)
        data = sock.recv(65536)
        if then and data.startswith(b"HTTP/1.1 200 "):
            sock.sendall(then)
        while chunk := sock.recv(65536):
            data += chunk
    return data


@pytest.mark.timeout(60)
def test_aptproxy_relays_connect_and_get_to_what_it_may_reach_and_refuses_the_rest(repo, mirrors, monkeypatch):
    """apt-get's own fetches go through aptproxy.proxy: CONNECT (https) and GET in absolute form (http), each target
    through Pinned. A name that resolves to this machine gets a 403 whose reason apt prints; anything else, 400/405."""
    from clusterctl.provision import aptproxy

    mirror = mirrors(repo)
    real = socket.getaddrinfo
    monkeypatch.setattr(socket, "getaddrinfo", lambda host, *a, **k: real(
        "127.0.0.1" if str(host).lower() in ("mirror.evil.test", "spec.test") else host, *a, **k))
    deb = (repo / "ctl-safe_1.0-1_all.deb").read_bytes()
    with aptproxy.proxy(aptproxy.Pinned({"spec.test"})) as (url, refused):
        tunnel = _through(url, f"CONNECT spec.test:{mirror.port} HTTP/1.1\r\nHost: spec.test\r\n\r\n".encode(),
                          b"GET /ctl-safe_1.0-1_all.deb HTTP/1.0\r\n\r\n")
        assert tunnel.startswith(b"HTTP/1.1 200 Connection established\r\n\r\nHTTP/1.1 200 ") and tunnel.endswith(deb)
        get = _through(url, f"GET http://spec.test:{mirror.port}/ctl-safe_1.0-1_all.deb HTTP/1.1\r\nHost: x\r\n"
                            "Proxy-Connection: keep-alive\r\n\r\n".encode())
        assert get.startswith(b"HTTP/1.1 200 ") and get.endswith(deb), get[:200]
        assert mirror.hits == ["ctl-safe_1.0-1_all.deb"] * 2
        for target in ("mirror.evil.test", "127.0.0.1", "localhost", "[::ffff:127.0.0.1]"):
            for req in (f"CONNECT {target}:{mirror.port} HTTP/1.1\r\n\r\n",
                        f"GET http://{target}:{mirror.port}/ctl-safe_1.0-1_all.deb HTTP/1.1\r\n\r\n"):
                answer = _through(url, req.encode())
                assert answer.startswith(b"HTTP/1.1 403 refused by clusterctl: ") and b"the controller itself" in \
                    answer.split(b"\r\n")[0], (req, answer)
        assert mirror.hits == ["ctl-safe_1.0-1_all.deb"] * 2 and len(refused) == 8
        assert _through(url, b"POST http://spec.test/ HTTP/1.1\r\n\r\n").startswith(b"HTTP/1.1 405 ")
        assert _through(url, b"GET ftp://spec.test/ HTTP/1.1\r\n\r\n").startswith(b"HTTP/1.1 405 ")
        assert _through(url, b"GET http://spec.test/ HTTP/1.1\r\nContent-Length: 1\r\n\r\nx").startswith(b"HTTP/1.1 400 ")
        assert _through(url, b"nonsense\r\n\r\n").startswith(b"HTTP/1.1 400 ")
        assert _through(url, b"x" * (aptproxy.HEAD_LIMIT + 20000)).startswith(b"HTTP/1.1 400 ")


@pytest.mark.parametrize("env, through", [({}, ["http", "https"]), ({"https_proxy": "http://proxy.corp:3128"}, ["http"]),
                                          ({"http_proxy": "proxy.corp:3128", "no_proxy": "localhost"}, ["https"])])
def test_apt_goes_through_the_pinning_proxy_except_for_a_scheme_the_environment_proxies(tmp_path, monkeypatch, env, through):
    for key in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY", "no_proxy", "NO_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    proc = aptoffline._apt(tmp_path, tmp_path / "status", "update", deadline=aptoffline.Deadline(30, "t"), tool="echo",
                           via="http://127.0.0.1:9/")
    assert re.findall(r"Acquire::(\w+)::Proxy=http://127\.0\.0\.1:9/", proc.stdout) == through, proc.stdout
    assert proc.stdout.split()[-1] == "update"


@pytest.mark.timeout(120)
def test_file_uris_are_read_only_inside_file_roots(tmp_path):
    allowed, outside = tmp_path / "allowed", tmp_path / "outside"
    secret = b"controller secret, shaped like a .deb"
    (outside).mkdir()
    (outside / "ctl-evil_1.0_all.deb").write_bytes(secret)
    deadline = aptoffline.Deadline(120, "apt.offline.timeout")

    # the spec's own source outside every root: refused before anything is read
    src = AptSource(name="elsewhere", uri=f"file:{outside}", trusted=True)
    with pytest.raises(ProvisionError) as err:
        aptoffline.check_file_sources([src], [allowed])
    assert str(err.value) == (f"offline apt: apt.sources elsewhere: file:{outside} is outside apt.offline.file_roots "
                              f"({allowed}); add its directory there to let the controller read it")

    # an index inside a root whose Filename climbs out of it, and one whose .deb is a symlink out of it
    for name, filename in (("climb", "../../outside/ctl-evil_1.0_all.deb"), ("link", "./ctl-evil_1.0_all.deb")):
        repo = allowed / name
        _flat_index(repo, filename, secret)
        if name == "link":
            (repo / "ctl-evil_1.0_all.deb").symlink_to(outside / "ctl-evil_1.0_all.deb")
        source = AptSource(name=name, uri=f"file:{repo}", trusted=True)
        aptoffline.check_file_sources([source], [allowed])  # the source itself is inside
        cache = tmp_path / f"cache-{name}"
        debs = aptoffline.resolve(cache, _empty_state(), ["ctl-evil"], [(source, b"")], deadline=deadline, label="node7")
        assert len(debs) == 1
        with pytest.raises(ProvisionError) as err:
            aptoffline.download(cache, debs, deadline=deadline, file_roots=[allowed], label="node7")
        assert str(err.value) == (f"offline apt for node7: cannot download {debs[0].uri} on the controller: refused: "
                                  f"{outside / 'ctl-evil_1.0_all.deb'} is outside apt.offline.file_roots ({allowed})")
        assert not list((cache / "debs").rglob("*.deb"))


def test_a_file_source_without_file_roots_is_a_spec_error_at_its_key(tmp_path, capsys):
    spec = tmp_path / "c.yaml"
    spec.write_text("name: c\nhosts: [{address: h1}]\njob: {entrypoint: [python]}\nprovision:\n  apt:\n"
                    "    packages: [jq]\n    sources: [{name: local, uri: 'file:/srv/repo', trusted: true}]\n"
                    "    offline: true\n")
    assert cli.main(["validate", str(spec)]) == 2
    captured = capsys.readouterr()
    assert captured.err.splitlines() == [
        f"{spec}:5:3: provision.apt: offline apt reads the file: source local on the controller: name its directory "
        "(or one above it) in apt.offline.file_roots"]


# ------------------------------------------------------------------------------------------- deadlines

@pytest.mark.timeout(120)
@pytest.mark.parametrize("drip", ["deb", "headers"])
def test_a_mirror_that_drips_a_deb_is_cut_off_at_the_deadline(tmp_path, repo, mirrors, drip):
    good = mirrors(repo)
    source = AptSource(name="m", uri=good.url, trusted=True)
    cache = tmp_path / "cache"
    debs = aptoffline.resolve(cache, _empty_state(), ["ctl-safe"], [(source, b"")], label="node7",
                              deadline=aptoffline.Deadline(60, "apt.offline.timeout"))
    slow = mirrors(repo, drip=drip)
    debs = [aptoffline.Deb(d.uri.replace(good.url, slow.url), d.filename, d.size, d.digest) for d in debs]
    t0 = time.monotonic()
    with pytest.raises(ProvisionError) as err:
        aptoffline.download(cache, debs, deadline=aptoffline.Deadline(3, "apt.offline.timeout"), label="node7",
                            trusted=aptoffline.source_hosts([(source, b"")]))
    took = time.monotonic() - t0
    assert re.fullmatch(rf"offline apt for node7: downloading {re.escape(debs[0].uri)} did not finish within 3s "
                        rf"\(apt\.offline\.timeout; \d+ of {debs[0].size} bytes\)", str(err.value)), str(err.value)
    assert 3 <= took < 3 + SLACK_S, took
    assert not list((cache / "debs").rglob("*.part*"))


@pytest.mark.timeout(120)
def test_each_download_has_its_own_deadline_within_the_overall_one(tmp_path, repo, mirrors, monkeypatch):
    monkeypatch.setattr(aptoffline, "DOWNLOAD_BASE_S", 2.0)
    good = mirrors(repo)
    source = AptSource(name="m", uri=good.url, trusted=True)
    debs = aptoffline.resolve(tmp_path, _empty_state(), ["ctl-safe"], [(source, b"")],
                              deadline=aptoffline.Deadline(60, "apt.offline.timeout"))
    slow = mirrors(repo, drip="deb")
    debs = [aptoffline.Deb(d.uri.replace(good.url, slow.url), d.filename, d.size, d.digest) for d in debs]
    t0 = time.monotonic()
    with pytest.raises(ProvisionError, match=r"did not finish within 2s \(2 s \+ 1 s/MiB for one \.deb; \d+ of \d+ bytes\)$"):
        aptoffline.download(tmp_path, debs, deadline=aptoffline.Deadline(600, "apt.offline.timeout"), label="node7",
                            trusted=aptoffline.source_hosts([(source, b"")]))
    assert time.monotonic() - t0 < 2 + SLACK_S


@pytest.mark.timeout(120)
def test_apt_get_update_against_a_dripping_index_is_killed_at_the_deadline(tmp_path, repo, mirrors):
    slow = mirrors(repo, drip="index")
    source = AptSource(name="m", uri=slow.url, trusted=True)
    cache = tmp_path / "cache"
    t0 = time.monotonic()
    with pytest.raises(ProvisionError) as err:
        aptoffline.resolve(cache, _empty_state(), ["ctl-safe"], [(source, b"")], label="node7",
                           deadline=aptoffline.Deadline(4, "apt.offline.timeout"))
    took = time.monotonic() - t0
    assert re.fullmatch(rf"offline apt for node7: apt-get update did not finish within 4s \(apt\.offline\.timeout\); "
                        rf"still fetching {re.escape(slow.url.rstrip('/'))} \./ (In)?Release", str(err.value)), str(err.value)
    assert 4 <= took < 4 + SLACK_S, took
    [root] = (cache / "roots").iterdir()
    assert _apt_processes(root) == []  # apt-get and its http methods were killed with it


@pytest.mark.timeout(120)
def test_many_hosts_share_one_deadline_not_one_each(tmp_path, repo, mirrors):
    """apt-get update used to have 600 s per host, one host after another; now one deadline covers all hosts,
    and hosts with different configurations are resolved in parallel."""
    slow = mirrors(repo, drip="index")
    source = AptSource(name="m", uri=slow.url, trusted=True)
    states = {f"node{i}": HostAptState("amd64", {"etc/apt/preferences.d/p": f"# host {i}\n".encode()}, b"")
              for i in range(4)}  # four configurations: four apt roots, four apt-get updates
    t0 = time.monotonic()
    out = aptoffline.resolve_all(tmp_path, states, dict.fromkeys(states, ["ctl-safe"]), [(source, b"")],
                                 deadline=aptoffline.Deadline(4, "apt.offline.timeout"), refresh=False,
                                 reinstall=False, log=lambda key, line: None)
    took = time.monotonic() - t0
    assert sorted(out) == sorted(states) and len(list((tmp_path / "roots").iterdir())) == 4
    for key, err in out.items():
        assert isinstance(err, ProvisionError) and str(err).startswith(
            f"offline apt for {key}: apt-get update did not finish within 4s (apt.offline.timeout); still fetching "), err
    assert 4 <= took < 4 + SLACK_S, took  # not 4 x 4 s
