"""The built artefacts, not the checkout: build the sdist and the wheel, install the wheel into a fresh venv
outside the checkout, and drive that install from another directory (validate, plan, a 2-node test cluster,
exec, provision from the wheelhouse, the fab workflow, the wheel shipped to hosts, down)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
CLUSTER = "clusterctl-pkgtest"
TEMPLATES = {
    "clusterctl/templates/provision/apt.sh.j2",
    "clusterctl/templates/provision/_lib.sh.j2",
    "clusterctl/templates/testcluster/Dockerfile",
    "clusterctl/templates/testcluster/sshd_config",
    "clusterctl/fab/fabfile.py",
    "clusterctl/host/provision_host.py",
    "clusterctl/py.typed",
}
# and the whole host package: uploaded to hosts from the installed package's own files (ops/hosttools.py)
TEMPLATES |= {f"clusterctl/host/{p.name}" for p in (ROOT / "clusterctl" / "host").glob("*.py")}


def _run(argv, *, cwd, env=None, timeout=300, check=True) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(a) for a in argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    if check and proc.returncode != 0:
        pytest.fail(f"{' '.join(map(str, argv))} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}", pytrace=False)
    return proc


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict[str, Path]:
    """sdist + wheel of this checkout (python -m build: the wheel is built from the sdist)."""
    out = tmp_path_factory.mktemp("dist")
    _run([sys.executable, "-m", "build", "--no-isolation", "--outdir", out, ROOT], cwd=ROOT, timeout=300)
    (wheel,), (sdist,) = list(out.glob("clusterctl-*.whl")), list(out.glob("clusterctl-*.tar.gz"))
    return {"wheel": wheel, "sdist": sdist}


@pytest.fixture(scope="module")
def installed(built, tmp_path_factory) -> dict:
    """A fresh venv outside the checkout with the wheel (and its dependencies) installed; an env without the checkout."""
    venv = tmp_path_factory.mktemp("venv") / "v"
    _run([sys.executable, "-m", "venv", venv], cwd=venv.parent)
    _run([venv / "bin" / "pip", "install", "-q", "--no-compile", "--disable-pip-version-check", built["wheel"]], cwd=venv.parent, timeout=600)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = f"{venv / 'bin'}:{env.get('PATH', '/usr/bin:/bin')}"
    env["COLUMNS"] = "200"
    work = tmp_path_factory.mktemp("elsewhere")
    return {"venv": venv, "bin": venv / "bin", "env": env, "cwd": work}


def test_sdist_and_wheel_carry_the_package_data(built):
    names = set(zipfile.ZipFile(built["wheel"]).namelist())
    assert TEMPLATES <= names, sorted(TEMPLATES - names)
    assert not [n for n in names if n.startswith(("templates/", "tests/", "fabfile.py"))], "stray top-level files in the wheel"
    with tarfile.open(built["sdist"]) as tar:
        members = {m.name.split("/", 1)[1]: m for m in tar.getmembers() if "/" in m.name}
    assert TEMPLATES <= set(members), sorted(TEMPLATES - set(members))
    assert members["clusterctl/fab/fabfile.py"].isfile()  # the link to ../../fabfile.py is a real file in the sdist
    wheel_fab = zipfile.ZipFile(built["wheel"]).read("clusterctl/fab/fabfile.py")
    assert wheel_fab == (ROOT / "fabfile.py").read_bytes()


@pytest.mark.timeout(600)
def test_the_installed_wheel_works_from_another_directory(installed, tmp_path):
    bin_, env, cwd = installed["bin"], installed["env"], installed["cwd"]
    where = _run([bin_ / "python", "-c", "import clusterctl; print(clusterctl.__file__)"], cwd=cwd, env=env).stdout.strip()
    assert where.startswith(str(installed["venv"])) and not where.startswith(str(ROOT)), where

    # The fab workflow: clusterctl's fabfile from the install, through clusterctl-fab and through plain fab.
    listed = _run([bin_ / "clusterctl-fab", "--list"], cwd=cwd, env=env).stdout
    assert re.findall(r"^  (\S+)", listed, re.M) == ["dispatch", "doctor", "exec", "kill", "provision", "start", "status", "tail-log"], listed
    fab_dir = _run([bin_ / "clusterctl-fab", "--where"], cwd=cwd, env=env).stdout.strip()
    assert Path(fab_dir, "fabfile.py").is_file() and fab_dir.startswith(str(installed["venv"]))
    assert "tail-log" in _run([bin_ / "fab", "--search-root", fab_dir, "--list"], cwd=cwd, env=env).stdout

    # The wheel shipped to hosts is built from the install itself (no checkout, no build backend).
    shipped = json.loads(_run([bin_ / "python", "-c", (
        "import json, pathlib, sys; from clusterctl.demo import build_wheel; "
        "w, v = build_wheel(pathlib.Path(sys.argv[1])); print(json.dumps([str(w), v]))"), tmp_path / "ship"],
        cwd=cwd, env=env).stdout)
    names = set(zipfile.ZipFile(shipped[0]).namelist())
    assert TEMPLATES <= names and f"clusterctl-{shipped[1]}.dist-info/METADATA" in names
    bare = tmp_path / "bare"
    _run([sys.executable, "-m", "venv", "--without-pip", bare], cwd=cwd)
    _run([bin_ / "python", "-m", "pip", "--python", bare / "bin" / "python", "install", "-q", "--no-deps", shipped[0]], cwd=cwd, env=env)
    probe = ("import importlib.metadata as m, importlib.resources as r; "
             "print(m.version('clusterctl'), r.files('clusterctl').joinpath('templates/provision/apt.sh.j2').is_file())")
    assert _run([bare / "bin" / "python", "-c", probe], cwd=cwd).stdout.split() == [shipped[1], "True"]

    cli = bin_ / "clusterctl"
    try:
        up = _run([cli, "testcluster", "up", "--nodes", "2", "--name", CLUSTER], cwd=cwd, env=env, timeout=600)
        spec_path = Path(re.search(r"(/\S+/cluster\.yaml)", up.stdout).group(1))
        base = yaml.safe_load(spec_path.read_text())
        base["workspace"] = {"local": str(tmp_path), "remote": "work"}
        # /opt/venv: the node image's venv (creating one would be most of this test's time)
        base["provision"] = {"wheelhouse": True, "python": {"venv": "/opt/venv", "requirements": ["six==1.17.0"]}}
        spec = tmp_path / "cluster.yaml"
        spec.write_text(yaml.safe_dump(base, sort_keys=False))

        assert _run([cli, "validate", spec], cwd=cwd, env=env).stdout.strip().startswith(f"{spec}: valid")
        plan = _run([cli, "plan", spec, "--json"], cwd=cwd, env=env).stdout
        assert "PADDLE_TRAINER_ENDPOINTS" in plan and json.loads(plan), plan
        hosts = _run([cli, "exec", spec, "--", "hostname"], cwd=cwd, env=env).stdout
        assert f"{CLUSTER}-node0" in hosts and f"{CLUSTER}-node1" in hosts, hosts
        # fab's `-- command`: through a shell, on both hosts, over clusterctl's connections (host keys checked)
        shouted = _run([bin_ / "clusterctl-fab", "--spec", spec, "--", "hostname | tr a-z A-Z"], cwd=cwd, env=env).stdout
        assert f"{CLUSTER}-NODE0".upper() in shouted and f"{CLUSTER}-NODE1".upper() in shouted, shouted

        cache = {**env, "XDG_CACHE_HOME": str(tmp_path / "cache")}
        res = _run([cli, "provision", spec], cwd=cwd, env=cache, timeout=300)
        assert re.search(r"^4 changed, 0 failed, 0 ok in ", res.stdout, re.M), res.stdout
        assert "wheelhouse on" in res.stdout and "uploaded 1 wheel(s)" in res.stdout, res.stdout
        six = _run([cli, "exec", spec, "--", "/opt/venv/bin/python", "-c", "import six; print(six.__version__)"], cwd=cwd, env=env)
        assert six.stdout.count("1.17.0") == 2, six.stdout
        again = _run([cli, "provision", spec], cwd=cwd, env=cache)
        assert re.search(r"^0 changed, 0 failed, 4 ok in ", again.stdout, re.M), again.stdout
    finally:
        _run([cli, "testcluster", "down", "--name", CLUSTER], cwd=cwd, env=env, check=False)
