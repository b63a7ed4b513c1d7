"""Failures that say why, offline apt, and provisioning as a non-root user with sudo, against real sshd
nodes that have no route out (tests/provision's cluster)."""

from __future__ import annotations

import re
import shlex

import pytest
from helpers import tiny_wheel
from provision_helpers import APT_OFFLINE_CACHE, NVIDIA_DIR, REPO_DIR, docker_exec, run_cli

pytestmark = pytest.mark.integration

NVIDIA = ["cuda-toolkit-12-4", "libnccl2=2.21.5-1+cuda12.4", "libnccl-dev=2.21.5-1+cuda12.4"]
OFFLINE_RESET = (
    "apt-mark unhold $(apt-mark showhold) >/dev/null 2>&1; "
    "rm -rf /root/.clusterctl/apt-offline /home/ubuntu/.clusterctl/apt-offline; "
    "dpkg --purge jq libjq1 libonig5 cuda-toolkit-12-4 libnccl-dev libnccl2 ctl-hello >/dev/null 2>&1; "
    "rm -f /etc/apt/sources.list.d/clusterctl-*.list /etc/pip.conf; true"
)
REMEDY_APT = (
    "give a mirror this host can reach in apt.sources (with apt.update: sources), or apt.offline: true "
    "(the controller downloads the packages and uploads them)"
)


def _cells(output: str, label: str) -> list[str]:
    """The step cells of host `label`'s row, with rich's wrapped continuation lines joined."""
    lines = output.splitlines()
    starts = [i for i, ln in enumerate(lines) if re.search(rf"^│ {re.escape(label)}\s", ln)]
    assert starts, f"no row for {label} in:\n{output}"
    cells = [c.strip() for c in lines[starts[0]].split("│")[2:-1]]
    for ln in lines[starts[0] + 1:]:
        parts = ln.split("│")
        if len(parts) < 3 or parts[1].strip():
            break
        cells = [f"{a} {b.strip()}".strip() for a, b in zip(cells, parts[2:-1])]
    return cells


def _reset(nodes, script: str = OFFLINE_RESET) -> None:
    for node in nodes:
        docker_exec(node.container, "sh", "-c", script)


def _offline(local_repos: dict | None = None, **extra) -> dict:
    """apt.offline for the tests: the shared cache; the controller-side local repositories as file_roots."""
    roots = [str(p) for p in (local_repos or {}).values()]
    return {"local": str(APT_OFFLINE_CACHE), **({"file_roots": roots} if roots else {}), **extra}


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_unreachable_sources_and_index_fail_fast_naming_them_with_the_remedy(provcluster, prov_spec, cache_home):
    nodes = provcluster.nodes[:2]
    _reset(nodes)
    spec = prov_spec({"apt": {"packages": ["jq"], "lock_timeout": 3}}, nodes=[0, 1])
    res = run_cli("provision", str(spec))
    assert res.returncode == 1, res.stdout + res.stderr
    assert res.seconds < 25, f"took {res.seconds:.1f}s:\n{res.stdout}"  # the whole CLI run, on a loaded machine
    for node in nodes:
        row = " ".join(_cells(res.stdout, node.ip))
        assert re.search(r"^failed: cannot reach this host's apt sources: deb\.debian\.org:80 \((no answer in 6 s|.*unreachable.*|.*resolv.*)\);", row), row
        assert re.sub(r"\s+", " ", REMEDY_APT) in re.sub(r"\s+", " ", row), row

    # /opt/venv: the node image's own venv (creating one takes longer than the check under test)
    spec = prov_spec({"python": {"venv": "/opt/venv", "requirements": ["numpy"]}}, nodes=[0, 1])
    res = run_cli("provision", str(spec))
    assert res.returncode == 1, res.stdout + res.stderr
    assert res.seconds < 25, f"took {res.seconds:.1f}s:\n{res.stdout}"
    for node in nodes:
        row = re.sub(r"\s+", " ", " ".join(_cells(res.stdout, node.ip)))
        assert row.startswith("failed: cannot reach the package index: pypi.org:443 ("), row
        assert row.endswith("give provision.wheelhouse: true (the controller downloads the wheels and uploads them) "
                            "or an index this host can reach (pip config)"), row
        log = (cache_home / "clusterctl" / "provision" / "provjob" / f"{node.ip}.log").read_text()
        assert "Traceback" not in log
        step_seconds = [float(x) for x in re.findall(r"^\[\w+\] => failed .* \((\d+\.\d)s\)$", log, re.M)]
        assert len(step_seconds) == 2 and max(step_seconds) < 15, log  # the apt and the python step, each


@pytest.mark.timeout(180)
def test_a_failed_step_shows_the_hosts_own_error_line(provcluster, prov_spec, cache_home):
    nodes = provcluster.nodes[:2]
    _reset(nodes)
    apt = {"sources": [{"name": "testrepo", "uri": f"file:{REPO_DIR}", "trusted": True}], "update": "sources",
           "lock_timeout": 3, "packages": ["jq"]}
    res = run_cli("provision", str(prov_spec({"apt": apt}, nodes=[0, 1])))
    assert res.returncode == 1, res.stdout + res.stderr
    for node in nodes:
        assert _cells(res.stdout, node.ip) == ["failed: apt-get install jq: E: Unable to locate package jq"], res.stdout

    # A reachable (local) index that lacks the package: pip's own cause, not "pip install failed".
    for node in nodes:
        docker_exec(node.container, "sh", "-c",
                    "mkdir -p /srv/empty-index && printf '[global]\\nindex-url = file:///srv/empty-index\\n' > /etc/pip.conf")
    try:
        res = run_cli("provision", str(prov_spec({"python": {"venv": "/opt/venv", "requirements": ["numpy"]}}, nodes=[0, 1])))
    finally:
        _reset(nodes, "rm -f /etc/pip.conf")
    assert res.returncode == 1, res.stdout + res.stderr
    for node in nodes:
        assert _cells(res.stdout, node.ip) == ["failed: pip install requirements: No matching distribution found for numpy"], res.stdout


@pytest.mark.timeout(300)
def test_offline_apt_installs_jq_and_nvidia_packages_with_no_route_out(provcluster, prov_spec, cache_home, local_repos):
    nodes = provcluster.nodes[:2]
    _reset(nodes)
    for node in nodes:  # really no route out: the archive does not answer from the nodes
        probe = docker_exec(node.container, "python3", "-c",
                            "import socket; socket.create_connection(('151.101.2.132', 80), timeout=3)", check=False)
        assert probe.returncode != 0
    nvidia = {"name": "nvidia-local", "uri": f"file:{local_repos['nvidia']}", "trusted": True}
    apt = {"packages": ["jq", *NVIDIA], "sources": [nvidia], "hold": True, "lock_timeout": 5, "offline": _offline(local_repos)}
    spec = prov_spec({"apt": apt}, nodes=[0, 1])

    check = run_cli("provision", str(spec), "--check")
    assert check.returncode == 0, check.stdout + check.stderr
    for node in nodes:
        assert _cells(check.stdout, node.ip) == ["would change"], check.stdout
        assert docker_exec(node.container, "sh", "-c", "command -v jq", check=False).returncode != 0
        assert docker_exec(node.container, "ls", "/etc/apt/sources.list.d").stdout.split() == []

    first = run_cli("provision", str(spec))
    assert first.returncode == 0, first.stdout + first.stderr
    assert f"  apt on {nodes[0].ip}, {nodes[1].ip}: source offline; install jq {' '.join(NVIDIA)}; hold libnccl2 libnccl-dev" in first.stdout, first.stdout
    for node in nodes:
        assert docker_exec(node.container, "jq", "-n", "1+1").stdout.strip() == "2"
        versions = docker_exec(node.container, "dpkg-query", "-W", "-f", "${Package}=${Version}\\n",
                               "libnccl2", "libnccl-dev", "cuda-toolkit-12-4").stdout.split()
        assert versions == ["cuda-toolkit-12-4=12.4.1-1", "libnccl-dev=2.21.5-1+cuda12.4", "libnccl2=2.21.5-1+cuda12.4"]
        assert set(docker_exec(node.container, "apt-mark", "showhold").stdout.split()) == {"libnccl2", "libnccl-dev"}
        log = (cache_home / "clusterctl" / "provision" / "provjob" / f"{node.ip}.log").read_text()
        assert "[apt] offline: 6 .deb(s) needed, 6 to upload" in log, log

    second = run_cli("provision", str(spec))
    assert second.returncode == 0, second.stdout + second.stderr
    assert re.search(r"^0 changed, 0 failed, 2 ok in ", second.stdout, re.M), second.stdout

    # Only what a host lacks is uploaded: after removing jq, its .debs are still in the host's repository.
    _reset(nodes[:1], "dpkg --purge jq libjq1 libonig5 >/dev/null")
    third = run_cli("provision", str(spec))
    assert third.returncode == 0, third.stdout + third.stderr
    assert f"  apt on {nodes[0].ip}: install jq" in third.stdout, third.stdout
    log = (cache_home / "clusterctl" / "provision" / "provjob" / f"{nodes[0].ip}.log").read_text()
    assert re.fullmatch(r"\[apt\] => changed install jq \(\d+\.\ds\)", log.rstrip().splitlines()[-1]), log
    assert "[apt] offline: 3 .deb(s) needed, 0 to upload" in log, log


@pytest.mark.timeout(180)
def test_offline_apt_serves_the_gpu_steps_apt_method(provcluster, prov_spec, cache_home, local_repos):
    nodes = provcluster.nodes[:2]
    _reset(nodes)
    nvidia = {"name": "nvidia-local", "uri": f"file:{local_repos['nvidia']}", "trusted": True}
    prov = {"apt": {"offline": _offline(local_repos), "lock_timeout": 5},
            "cuda": {"version": "12.4", "method": "apt", "repository": nvidia}, "nccl": "2.21.5"}
    spec = prov_spec(prov, nodes=[0, 1])
    first = run_cli("provision", str(spec))
    assert first.returncode == 0, first.stdout + first.stderr
    assert f"  gpu on {nodes[0].ip}, {nodes[1].ip}: source offline; install {' '.join(NVIDIA)}; hold {' '.join(n.split('=')[0] for n in NVIDIA)}" in first.stdout, first.stdout
    for node in nodes:
        assert docker_exec(node.container, "dpkg-query", "-W", "-f", "${Version}", "libnccl2").stdout == "2.21.5-1+cuda12.4"
    again = run_cli("provision", str(spec))
    assert again.returncode == 0 and re.search(r"^0 changed, 0 failed, 2 ok in ", again.stdout, re.M), again.stdout


SUDO_SETUP = (
    "set -e; id ubuntu >/dev/null 2>&1 || useradd -m -s /bin/bash ubuntu; "
    "usermod -p '*' ubuntu; "  # no password, but not locked: sshd (UsePAM no) refuses locked accounts
    "install -d -m 700 -o ubuntu -g ubuntu /home/ubuntu/.ssh; "
    "install -m 600 -o ubuntu -g ubuntu /root/.ssh/authorized_keys /home/ubuntu/.ssh/authorized_keys; "
    "rm -f /etc/sudoers.d/90-ubuntu /etc/clusterctl-root-test; rm -rf /opt/ubvenv /home/ubuntu/userfile; "
)


@pytest.mark.timeout(300)
def test_non_root_login_uses_sudo_n_for_root_steps_and_names_a_password_sudo(provcluster, prov_spec, cache_home, local_repos):
    nodes = provcluster.nodes[:2]
    _reset(nodes)
    # As root, with offline apt (the nodes have no route out): sudo itself.
    res = run_cli("provision", str(prov_spec({"apt": {"packages": ["sudo"], "offline": _offline()}}, nodes=[0, 1], name="rootjob")))
    assert res.returncode == 0, res.stdout + res.stderr
    docker_exec(nodes[0].container, "sh", "-c", SUDO_SETUP + "echo 'ubuntu ALL=(ALL) NOPASSWD: ALL' > /etc/sudoers.d/90-ubuntu")
    docker_exec(nodes[1].container, "sh", "-c", SUDO_SETUP + "echo 'ubuntu ALL=(ALL) ALL' > /etc/sudoers.d/90-ubuntu")

    testrepo = {"name": "testrepo", "uri": f"file:{local_repos['test']}", "trusted": True}
    prov = {
        "apt": {"packages": ["ctl-hello=1.0-1"], "sources": [testrepo], "hold": True, "offline": _offline(local_repos)},
        "python": {"venv": "/opt/ubvenv"},
        "commands": [
            {"name": "rootfile", "run": "id -un > /etc/clusterctl-root-test", "creates": "/etc/clusterctl-root-test", "root": True},
            {"name": "userfile", "run": "id -un > /home/ubuntu/userfile", "creates": "/home/ubuntu/userfile"},
        ],
    }
    spec = prov_spec(prov, nodes=[0, 1], user="ubuntu")
    res = run_cli("provision", str(spec))
    assert res.returncode == 1, res.stdout + res.stderr
    assert res.seconds < 180, res.seconds  # creating a venv is most of it (tens of seconds on a loaded machine)
    assert _cells(res.stdout, nodes[0].ip) == ["changed", "changed", "changed"], res.stdout
    bad = re.sub(r"\s+", " ", " ".join(_cells(res.stdout, nodes[1].ip)))
    assert bad == (f"failed: sudo needs a password for ubuntu on {nodes[1].ip}: allow NOPASSWD sudo or log in as root "
                   f"skipped: apt failed skipped: apt failed"), res.stdout
    ok = nodes[0].container
    assert docker_exec(ok, "cat", "/etc/clusterctl-root-test").stdout.strip() == "root"
    assert docker_exec(ok, "stat", "-c", "%U", "/home/ubuntu/userfile", "/opt/ubvenv/bin/python").stdout.split() == ["ubuntu", "root"]
    assert docker_exec(ok, "cat", "/home/ubuntu/userfile").stdout.strip() == "ubuntu"
    assert docker_exec(ok, "dpkg-query", "-W", "-f", "${Version}", "ctl-hello").stdout == "1.0-1"
    assert "ctl-hello" in docker_exec(ok, "apt-mark", "showhold").stdout.split()

    again = run_cli("provision", str(prov_spec(prov, nodes=[0], user="ubuntu")))
    assert again.returncode == 0 and re.search(r"^0 changed, 0 failed, 3 ok in ", again.stdout, re.M), again.stdout

    doc = run_cli("doctor", str(spec))
    assert re.search(r"│ login\s+│ ubuntu\s+│ ubuntu\s+│", doc.stdout), doc.stdout
    assert re.search(r"│ sudo\s+│ passwordless\s+│ needs a password\s+│", doc.stdout), doc.stdout


USER_VENV = "/home/ubuntu/gpuvenv"
# what is in the login's home and is not the login's (nothing, once provisioned)
NOT_UBUNTUS = f"find {USER_VENV} /home/ubuntu/.cache /home/ubuntu/.clusterctl ! -user ubuntu"
SEES_SYSTEM_SITE = ("import sys; print(any(p.endswith(('site-packages', 'dist-packages')) and p.startswith(sys.base_prefix)"
                    " and not p.startswith(sys.prefix) for p in sys.path))")


@pytest.mark.timeout(300)
def test_a_non_root_logins_venv_stays_its_own_through_the_gpu_step_and_a_system_site_packages_change(
        provcluster, prov_spec, cache_home, tmp_path):
    """The gpu step with apt and pip parts ran wholly through sudo: pip wrote root's files into the login's venv (and
    ran the login's venv python as root). And a changed python.system_site_packages was never applied to a venv that
    was there: the python step said ok."""
    node = provcluster.nodes[0]
    _reset([node], OFFLINE_RESET + f"; rm -rf {USER_VENV} /home/ubuntu/.cache /home/ubuntu/.clusterctl")
    docker_exec(node.container, "sh", "-c", SUDO_SETUP + "echo 'ubuntu ALL=(ALL) NOPASSWD: ALL' > /etc/sudoers.d/90-ubuntu")
    tiny_wheel(tmp_path / "wheels", name="nvidia_cuda_runtime_cu12", version="12.4.127")  # named as NVIDIA's, tiny
    (tmp_path / "index").mkdir()

    def spec(system_site: bool):
        return prov_spec({
            "apt": {"sources": [], "update": "sources", "lock_timeout": 5},
            "python": {"venv": "gpuvenv", "system_site_packages": system_site},
            "cuda": {"version": "12.4", "method": "pip",
                     "repository": {"name": "fake-nvidia", "uri": f"file:{NVIDIA_DIR}", "trusted": True}},
            "nccl": {"version": "2.21.5", "method": "apt"},
            "wheelhouse": {"local": str(tmp_path / "wh"), "index_url": (tmp_path / "index").as_uri(),
                           "find_links": [str(tmp_path / "wheels")]},
        }, nodes=[0], user="ubuntu", name="gpuuser")

    def sees_system_site() -> str:
        return docker_exec(node.container, "su", "ubuntu", "-c", f"{USER_VENV}/bin/python -c \"{SEES_SYSTEM_SITE}\"").stdout.strip()

    first = run_cli("provision", str(spec(False)))
    assert first.returncode == 0, first.stdout + first.stderr
    assert re.search(rf"^  gpu on {node.ip}: .*install libnccl2=2.21.5-1\+cuda12.4 .*pip install CUDA wheels", first.stdout,
                     re.M), first.stdout
    assert docker_exec(node.container, "dpkg-query", "-W", "-f", "${Version}", "libnccl2").stdout == "2.21.5-1+cuda12.4"
    assert docker_exec(node.container, "sh", "-c", f"ls {USER_VENV}/lib/python3*/site-packages").stdout.count(
        "nvidia_cuda_runtime_cu12-12.4.127.dist-info") == 1
    assert docker_exec(node.container, "sh", "-c", NOT_UBUNTUS).stdout == ""
    assert sees_system_site() == "False"

    # the setting changed: --check names the change and makes none; provision makes it; the next run is ok
    cfg = f"{USER_VENV}/pyvenv.cfg"
    before = docker_exec(node.container, "cat", cfg).stdout
    check = run_cli("provision", str(spec(True)), "--check")
    assert check.returncode == 0, check.stdout + check.stderr
    assert f"  python on {node.ip}: include-system-site-packages = true in {cfg}\n" in check.stdout, check.stdout
    assert docker_exec(node.container, "cat", cfg).stdout == before
    applied = run_cli("provision", str(spec(True)))
    assert applied.returncode == 0, applied.stdout + applied.stderr
    assert f"  python on {node.ip}: include-system-site-packages = true in {cfg}\n" in applied.stdout, applied.stdout
    assert re.search(r"^1 changed, 0 failed, 2 ok in ", applied.stdout, re.M), applied.stdout
    assert sees_system_site() == "True"
    assert docker_exec(node.container, "sh", "-c", NOT_UBUNTUS).stdout == ""
    again = run_cli("provision", str(spec(True)))
    assert again.returncode == 0 and re.search(r"^0 changed, 0 failed, 3 ok in ", again.stdout, re.M), again.stdout


@pytest.mark.timeout(300)
def test_offline_apt_never_runs_a_hosts_apt_hooks_on_the_controller(provcluster, prov_spec, cache_home, local_repos, tmp_path):
    """A host's apt.conf.d hooks (issue 21): the controller's apt never reads them; the host's own apt still does."""
    node = provcluster.nodes[0]
    _reset([node])
    marker = tmp_path / "hook-ran" / "marker"  # a controller path: must not appear here
    hook = f'"mkdir -p {marker.parent} && touch {marker}";'
    conf = f"APT::Update::Pre-Invoke {{ {hook} }};\nAPT::Update::Post-Invoke-Success {{ {hook} }};\n"
    setup = (f"printf '%s' {shlex.quote(conf)} > /etc/apt/apt.conf.d/99clusterctl-test-hook && "
             "echo 'machine mirror.example login u password SECRET-IN-AUTH-CONF' > /etc/apt/auth.conf")
    docker_exec(node.container, "sh", "-c", setup)
    try:
        testrepo = {"name": "testrepo", "uri": f"file:{local_repos['test']}", "trusted": True}
        cache = tmp_path / "apt-offline"  # this test's own: every apt root in it was made by this run
        spec = prov_spec({"apt": {"packages": ["ctl-hello=1.0-1"], "sources": [testrepo],
                                  "offline": _offline(local_repos, local=str(cache))}}, nodes=[0])
        res = run_cli("provision", str(spec), "--force")  # --force: the controller runs apt-get update for this host
        assert res.returncode == 0, res.stdout + res.stderr
        log = (cache_home / "clusterctl" / "provision" / "provjob" / f"{node.ip}.log").read_text()
        assert re.search(r"^\[apt\] controller: Reading package lists", log, re.M), log  # the update did run here
        assert not marker.exists(), "the host's apt hook ran on the controller"
        # the hooks are real: the host's own apt-get update (its apt step) ran them, on the host
        assert docker_exec(node.container, "test", "-e", str(marker), check=False).returncode == 0
        assert list((cache / "roots").iterdir())
        for path in (cache / "roots").rglob("*"):
            assert "apt.conf.d" not in path.parts and not path.name.startswith("auth.conf"), path
            if path.is_file():
                assert b"SECRET-IN-AUTH-CONF" not in path.read_bytes(), path
    finally:
        docker_exec(node.container, "sh", "-c", f"rm -rf /etc/apt/apt.conf.d/99clusterctl-test-hook /etc/apt/auth.conf {marker.parent}")
