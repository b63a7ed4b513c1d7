"""Provisioning without a network: schema errors, version rules, step selection, rendering and quoting,
status parsing, mesh files, wheel selection, doctor's comparison; step scripts run locally under bash."""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
import tarfile
import textwrap
from pathlib import Path

import pytest

from clusterctl.errors import ProvisionError, SpecError
from clusterctl.plan import Host, make_plan
from clusterctl.provision import mesh, versions, wheelhouse
from clusterctl.provision.doctor import compare, host_params
from clusterctl.provision.render import render_step
from clusterctl.provision.runner import parse_status
from clusterctl.provision.steps import HostFacts, requirements, selected_steps, step_context
from clusterctl.remote import Result
from clusterctl.spec import load_spec, parse_spec

HEAD = """\
name: demo
hosts:
  - address: 10.0.0.1
  - address: 10.0.0.2
job:
  entrypoint: [python3, train.py]
provision:
"""

FULL = HEAD + textwrap.indent(
    textwrap.dedent(
        """\
        apt:
          packages: [htop, "libfoo=1.2-3"]
          sources:
            - {name: local, uri: "file:/srv/repo", trusted: true}
          lock_timeout: 10
          hold: true
        cuda: {version: "12.4", method: apt}
        cudnn: "9.1.0.70"
        nccl: "2.21.5"
        python:
          venv: /opt/jobvenv
          requirements: [numpy==2.1.0, "requests>=2"]
        mpi: mpich
        wheelhouse: true
        ssh_mesh: true
        commands:
          - {name: marker, run: "touch /tmp/x", creates: /tmp/x}
          - {name: hostile, run: "echo '$(id)'; echo \\"$HOME\\" `date`", unless: "test -e /nonexistent"}
        """
    ),
    "  ",
)


def _spec(text: str):
    return parse_spec(text, "cluster.yaml")


def _errors(text: str) -> list[str]:
    with pytest.raises(SpecError) as info:
        _spec(text)
    return [str(p) for p in info.value.problems]


BAD = [
    pytest.param("  apt: {pakages: [htop]}\n", "cluster.yaml:8:9: provision.apt.pakages: unknown key (did you mean 'packages'?)", id="misspelt"),
    pytest.param("  apt: [htop, htop=1.0]\n", "cluster.yaml:8:3: provision.apt.packages: package listed twice: htop", id="dup-pkg"),
    pytest.param("  apt: ['Bad Name']\n", "cluster.yaml:8:3: provision.apt.packages: not a Debian package name: 'Bad Name'", id="pkg-name"),
    pytest.param(
        "  cuda: {version: '12.4', method: apt}\n  nccl: '2.21.5-1+cuda11.8'\n",
        "cluster.yaml:9:3: provision.nccl: nccl 2.21.5-1+cuda11.8 is built for CUDA 11.8, but cuda.version is 12.x; use a +cuda12.N build",
        id="nccl-major",
    ),
    pytest.param(
        "  cuda: '12.4'\n  cudnn: '8.9.7.29-1+cuda11.8'\n",
        "cluster.yaml:9:3: provision.cudnn: cudnn 8.9.7.29-1+cuda11.8 is built for CUDA 11.8, but cuda.version is 12.x; use a +cuda12.N build",
        id="cudnn-major",
    ),
    pytest.param("  cuda: '12.7'\n", "cluster.yaml:8:3: provision.cuda.version: unknown CUDA release 12.7 (known: 11.0, 11.1, 11.2, 11.3, 11.4, 11.5, 11.6, 11.7, 11.8, 12.0, 12.1, 12.2, 12.3, 12.4, 12.5, 12.6, 12.8, 12.9, 13.0)", id="cuda-unknown"),
    pytest.param("  nccl: '2.21.5'\n", "cluster.yaml:7:1: provision: cudnn and nccl need cuda.version (their builds are per CUDA major)", id="nccl-no-cuda"),
    pytest.param(
        "  cuda: {version: '12.4', method: pip}\n",
        "cluster.yaml:7:1: provision: method: pip installs into the job's venv: add a python: section (python.venv)",
        id="pip-no-venv",
    ),
    pytest.param("  mpi: mpich\n", "cluster.yaml:8:3: provision.mpi: mpi installs into the job's venv: add a python: section (python.venv)", id="mpi-no-venv"),
    pytest.param("  mpi: mvapich\n", "cluster.yaml:8:3: provision.mpi.implementation: expected one of 'mpich' or 'openmpi', got 'mvapich'", id="mpi-impl"),
    pytest.param(
        "  commands: [{name: x, run: 'echo hi'}]\n",
        "cluster.yaml:8:14: provision.commands[0]: command 'x' needs a guard: creates: PATH or unless: SHELL-TEST (so reruns are idempotent)",
        id="command-guard",
    ),
    pytest.param(
        "  apt: {sources: [{name: x, uri: 'file:/r', trusted: true, signed_by: k.gpg}]}\n",
        "cluster.yaml:8:19: provision.apt.sources[0]: give signed_by or trusted: true, not both",
        id="source-trust",
    ),
    pytest.param("  apt: {lock_timeout: -1}\n", "cluster.yaml:8:9: provision.apt.lock_timeout: input should be greater than or equal to 0", id="lock-timeout"),
    # a newline in a word of the source's line wrote a second source (trusted, here) into the host's list file
    pytest.param(
        "  apt: {sources: [{name: a, uri: 'http://x/', suite: bookworm, components: [\"main\\ndeb [trusted=yes] http://evil.example/ ./\"]}]}\n",
        "cluster.yaml:8:64: provision.apt.sources[0].components: not an apt component: 'main\\ndeb [trusted=yes] http://evil.example/ ./'",
        id="component-newline",
    ),
    pytest.param(  # `$` matched before a final newline: the URI, names and packages took one
        "  apt: {sources: [{name: a, uri: \"http://x/\\n\"}]}\n",
        "cluster.yaml:8:29: provision.apt.sources[0].uri: expected an http(s)://, ftp:// or file: URI, not 'http://x/\\n'",
        id="uri-newline",
    ),
    # relative to the spec now (it was the current directory): '' would be the spec's directory itself
    pytest.param("  python: {venv: v}\n  wheelhouse: {local: ''}\n",
                 "cluster.yaml:9:16: provision.wheelhouse.local: empty: give a path, or leave the key out", id="wheelhouse-local-empty"),
    pytest.param("  apt: [\"jq\\n\"]\n", "cluster.yaml:8:3: provision.apt.packages: not a Debian package name: 'jq\\n'", id="pkg-newline"),
    # a version written as a number is the text written: 12.10 was CUDA 12.1, and 4.10 mpi4py 4.1
    pytest.param("  cuda: 12.10\n", "cluster.yaml:8:3: provision.cuda.version: unknown CUDA release 12.10 (known: 11.0, 11.1, 11.2, 11.3, 11.4, 11.5, 11.6, 11.7, 11.8, 12.0, 12.1, 12.2, 12.3, 12.4, 12.5, 12.6, 12.8, 12.9, 13.0)", id="cuda-as-written"),
    pytest.param(  # only the version's start was checked: the rest went into the apt pin or the pip requirement
        "  cuda: '12.4'\n  cudnn: '9.1.0.70; python_version<\"3\"'\n",
        "cluster.yaml:9:3: provision.cudnn: cuDNN version must look like 9.1.0.70, not '9.1.0.70; python_version<\"3\"'",
        id="cudnn-whole-version",
    ),
    pytest.param(
        "  cuda: '12.4'\n  nccl: '2.21.5garbage'\n",
        "cluster.yaml:9:3: provision.nccl: NCCL version must look like 2.21.5 or 2.21.5-1+cuda12.4, not '2.21.5garbage'",
        id="nccl-whole-version",
    ),
    pytest.param(  # the file form refused pip's options; the list form passed them to pip download and install
        "  python: {requirements: ['--index-url=http://evil.example/simple', numpy]}\n",
        "cluster.yaml:8:12: provision.python.requirements: one requirement per item, not a pip option or a line of its own: '--index-url=http://evil.example/simple'",
        id="requirement-option",
    ),
    pytest.param(
        "  wheelhouse: {index_url: ''}\n  python: {requirements: [numpy]}\n",
        "cluster.yaml:8:16: provision.wheelhouse.index_url: expected an http(s):// or file:// URL, not ''",
        id="index-url",
    ),
    # the home or / itself: `python -m venv .` wrote bin/, lib/ and pyvenv.cfg into the home, `venv: /` into / as root
    *(pytest.param(f"  python: {{venv: '{v}'}}\n", f"cluster.yaml:8:12: provision.python.venv: '{v}' is the home directory "
                   "itself: give a directory under it, or leave the key out", id=f"venv-home-{v}") for v in (".", "./", "~", "~/", "~/.")),
    *(pytest.param(f"  python: {{venv: '{v}'}}\n", f"cluster.yaml:8:12: provision.python.venv: '{v}' is the root directory: "
                   "give a directory under it, or leave the key out", id=f"venv-root-{v}") for v in ("/", "//", "/./")),
    *(pytest.param(f"  python: {{venv: '{v}'}}\n", f"cluster.yaml:8:12: provision.python.venv: '{v}' is a system directory: "
                   "give a directory of its own (such as /opt/clusterctl-venv)", id=f"venv-system-{v}")
      for v in ("/usr", "/usr/local/", "/opt", "/etc", "/var", "/bin", "/lib", "//usr/lib")),
    pytest.param("  python: {}\n  wheelhouse: {remote: '~'}\n", "cluster.yaml:9:16: provision.wheelhouse.remote: '~' is the home "
                 "directory itself: give a directory under it, or leave the key out", id="wheelhouse-home"),
    pytest.param("  python: {}\n  wheelhouse: {remote: /}\n", "cluster.yaml:9:16: provision.wheelhouse.remote: '/' is the root "
                 "directory: give a directory under it, or leave the key out", id="wheelhouse-root"),
    pytest.param("  apt: {offline: {local: ' '}}\n", "cluster.yaml:8:19: provision.apt.offline.local: empty: give a path, or "
                 "leave the key out", id="offline-local-empty"),
    pytest.param("  apt: {offline: {remote: .}}\n", "cluster.yaml:8:19: provision.apt.offline.remote: '.' is the home directory "
                 "itself: give a directory under it, or leave the key out", id="offline-home"),
    # `~user/x` was taken as a directory named `~user` under the home (doctor looked in user's home)
    pytest.param("  python: {venv: '~bob/venv'}\n", "cluster.yaml:8:12: provision.python.venv: '~bob/venv': ~user is not "
                 "expanded; give a path under the login's home (~/...) or an absolute one", id="venv-tilde-user"),
    # the host runs a command as `bash -c TEXT`: over 128 KiB, E2BIG on every host (the step script now travels on
    # stdin, so nothing else stops such a command before it fails there)
    pytest.param("  commands: [{name: big, creates: /x, run: '" + "x" * 140_000 + "'}]\n",
                 "cluster.yaml:8:39: provision.commands[0].run: 140,000 bytes: the host runs it as one argument of "
                 "`bash -c`, and Linux takes at most 128 KiB in one (E2BIG): run a script the hosts have instead",
                 id="command-too-long"),
]


@pytest.mark.parametrize("section, message", BAD)
def test_bad_provision_sections(section, message):
    problems = _errors(HEAD + section)
    assert problems == [message]


def test_full_section_parses_and_selects_every_step_in_order():
    spec = _spec(FULL)
    assert selected_steps(spec.provision) == ["wheelhouse", "apt", "python", "gpu", "mpi", "ssh_mesh", "commands"]
    assert selected_steps(spec.provision, ["commands", "apt"]) == ["apt", "commands"]
    assert requirements(spec) == ["numpy==2.1.0", "requests>=2", "mpich", "mpi4py"]
    with pytest.raises(ProvisionError, match=r"unknown step 'aptt' for --only \(steps: wheelhouse, apt"):
        selected_steps(spec.provision, ["aptt"])
    minimal = _spec(HEAD + "  apt: [htop]\n")
    with pytest.raises(ProvisionError, match="--only mpi: the spec's provision section has no mpi step"):
        selected_steps(minimal.provision, ["mpi"])


def test_requirements_file_is_read_from_the_workspace(tmp_path):
    (tmp_path / "ws").mkdir()
    (tmp_path / "ws" / "req.txt").write_text("# pinned\nnumpy==2.1.0  # inline\n\nmpi4py\n")
    path = tmp_path / "cluster.yaml"
    path.write_text(HEAD.replace("provision:\n", "workspace: {local: ws}\nprovision:\n") + "  python: {requirements: req.txt}\n")
    assert requirements(load_spec(path)) == ["numpy==2.1.0", "mpi4py"]
    (tmp_path / "ws" / "req.txt").write_text("--index-url http://x\nnumpy\n")
    with pytest.raises(ProvisionError, match=r"req.txt:1: option lines \(--index-url\) are not supported"):
        requirements(load_spec(path))
    (tmp_path / "ws" / "req.txt").unlink()
    os.mkfifo(tmp_path / "ws" / "req.txt")  # was waited on for ever (and /dev/zero read until memory ran out)
    with pytest.raises(ProvisionError, match=r"req.txt: not a file \(a FIFO or a socket\)"):
        requirements(load_spec(path))


def test_versions_tables_and_package_names():
    assert versions.min_driver("12.4.1") == "550.54.14"
    assert versions.driver_ok("12.4", "550.54.15") and not versions.driver_ok("12.4", "535.104.05")
    assert versions.cuda_apt_package("12.4") == "cuda-toolkit-12-4"
    assert versions.cuda_apt_package("12.4.1") == "cuda-toolkit-12-4=12.4.1-1"
    assert versions.cudnn_apt_packages("9.1.0.70", "12.4") == [
        ("libcudnn9-cuda-12", "9.1.0.70-1"),
        ("libcudnn9-dev-cuda-12", "9.1.0.70-1"),
    ]
    assert versions.cudnn_apt_packages("8.9.7.29", "12.2") == [
        ("libcudnn8", "8.9.7.29-1+cuda12.2"),
        ("libcudnn8-dev", "8.9.7.29-1+cuda12.2"),
    ]
    assert versions.nccl_apt_version("2.21.5", "12.4") == "2.21.5-1+cuda12.4"
    assert versions.nccl_apt_version("2.21.5-1+cuda12.2", "12.4") == "2.21.5-1+cuda12.2"
    assert versions.nccl_pip_requirement("2.21.5-1+cuda12.4", "12.4") == "nvidia-nccl-cu12==2.21.5"
    assert versions.cudnn_pip_requirement("9.1.0.70", "12.4") == "nvidia-cudnn-cu12==9.1.0.70"
    assert versions.cuda_pip_requirements("12.4") == ["nvidia-cuda-runtime-cu12==12.4.*"]
    # CUDA 13's runtime wheel has no -cu13 suffix (nvidia-cuda-runtime-cu13 is a 0.0.1 placeholder on PyPI)
    assert versions.cuda_pip_requirements("13.0") == ["nvidia-cuda-runtime==13.0.*"]
    with pytest.raises(ValueError, match=r"cuDNN 8.9.7 has no build for CUDA 13.x \(it supports CUDA 10.x, 11.x, 12.x\)"):
        versions.cudnn_apt_packages("8.9.7", "13.0")


def _facts(plan):
    return {h: HostFacts(python="3.11", machine="x86_64", glibc="2.36", hostname=f"n{h.index}", host_key="ssh-ed25519 AAAAkey") for h in plan.hosts}


def _render_all(spec, check=False):
    plan = make_plan(spec)
    mesh_ctx = mesh.mesh_context("demo", "ssh-ed25519 BBBB clusterctl-mesh-demo", plan.hosts, _facts(plan))
    out = {}
    for step in selected_steps(spec.provision):
        if step != "wheelhouse":
            ctx = step_context(step, spec, check=check, force=False, wheelhouse_remote=".clusterctl/wheelhouse", mesh=mesh_ctx)
            out[step] = render_step(f"{step}.sh.j2", ctx)
    return out


def test_every_template_renders_to_valid_bash_with_values_quoted():
    scripts = _render_all(_spec(FULL))
    for step, text in scripts.items():
        proc = subprocess.run(["bash", "-n"], input=text, text=True, capture_output=True, check=False)
        assert proc.returncode == 0, (step, proc.stderr)
    assert "apt_ensure 1 htop libfoo=1.2-3\n" in scripts["apt"]
    assert "apt_source local 'deb [trusted=yes] file:/srv/repo ./' ''\n" in scripts["apt"]
    assert (
        "apt_ensure 2 cuda-toolkit-12-4 libcudnn9-cuda-12=9.1.0.70-1 libcudnn9-dev-cuda-12=9.1.0.70-1 "
        "libnccl2=2.21.5-1+cuda12.4 libnccl-dev=2.21.5-1+cuda12.4\n" in scripts["gpu"]
    )
    assert "MIN_DRIVER=550.54.14\n" in scripts["gpu"]
    assert "pip_ensure requirements numpy==2.1.0 'requests>=2'\n" in scripts["python"]
    assert "PIP_ARGS+=(--no-index --find-links \"$(abspath .clusterctl/wheelhouse)\")" in scripts["mpi"]
    assert "bash -c 'echo '\"'\"'$(id)'\"'\"'; echo \"$HOME\" `date`' </dev/null" in scripts["commands"]
    assert "BEGIN=" in scripts["ssh_mesh"] and "StrictHostKeyChecking yes" in scripts["ssh_mesh"]
    assert "StrictHostKeyChecking=no" not in "".join(scripts.values())


def test_finalize_refuses_none():
    with pytest.raises(ValueError, match="undefined value"):
        render_step("commands.sh.j2", {"step": "commands", "check": False, "force": False,
                                       "commands": [{"name": "x", "run": None, "creates": "/x", "unless": None, "root": False}]})


def _run_local(script: str, home: Path, stdin: bytes = b"") -> tuple[int, str]:
    env = {"HOME": str(home), "PATH": os.environ["PATH"]}
    proc = subprocess.run(["bash", "-c", script, "x"], input=stdin, capture_output=True, env=env, timeout=60, check=False)
    return proc.returncode, proc.stdout.decode()


def _last(out: str) -> str:
    return out.strip().splitlines()[-1]


def test_commands_step_guards_check_and_force_locally(tmp_path):
    marker = tmp_path / "made"
    text = HEAD + textwrap.indent(
        textwrap.dedent(
            f"""\
            commands:
              - {{name: make, run: "echo run >> {tmp_path}/runs; touch {marker}", creates: {marker}}}
              - {{name: never, run: "false", unless: "true"}}
            """
        ),
        "  ",
    )
    spec = _spec(text)

    def script(check=False, force=False):
        return render_step("commands.sh.j2", step_context("commands", spec, check=check, force=force, wheelhouse_remote=None, mesh=None))

    assert _run_local(script(check=True), tmp_path) == (0, "CLUSTERCTL_STEP commands changed ran make\n")
    assert not marker.exists()
    rc, out = _run_local(script(), tmp_path)
    assert (rc, _last(out)) == (0, "CLUSTERCTL_STEP commands changed ran make")
    assert (_run_local(script(), tmp_path)) == (0, "CLUSTERCTL_STEP commands ok \n")
    rc, out = _run_local(script(force=True), tmp_path)
    assert (rc, _last(out)) == (1, "CLUSTERCTL_STEP commands failed command never exited 1")
    assert (tmp_path / "runs").read_text() == "run\nrun\n"


def test_ssh_mesh_step_writes_key_pins_and_keeps_user_config(tmp_path):
    spec = _spec(FULL)
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True)
    (home / ".ssh" / "config").write_text("Host mine\n    User me\n")
    script = _render_all(spec)["ssh_mesh"]
    rc, out = _run_local(script, home, stdin=b"PRIVATE-KEY-TEXT\n")
    assert (rc, _last(out)) == (
        0,
        "CLUSTERCTL_STEP ssh_mesh changed mesh key; mesh public key; peers' host keys; authorize mesh key; ssh config block",
    )
    ssh = home / ".ssh"
    assert (ssh / "clusterctl-demo_ed25519").read_text() == "PRIVATE-KEY-TEXT\n"
    assert oct((ssh / "clusterctl-demo_ed25519").stat().st_mode & 0o777) == "0o600"
    assert (ssh / "clusterctl-demo.known_hosts").read_text() == "10.0.0.1,n0 ssh-ed25519 AAAAkey\n10.0.0.2,n1 ssh-ed25519 AAAAkey\n"
    config = (ssh / "config").read_text()
    assert config.startswith("# BEGIN clusterctl ssh_mesh demo\nHost 10.0.0.1 n0 10.0.0.2 n1\n")
    assert config.endswith("# END clusterctl ssh_mesh demo\nHost mine\n    User me\n")
    assert _run_local(script, home, stdin=b"PRIVATE-KEY-TEXT\n") == (0, "CLUSTERCTL_STEP ssh_mesh ok \n")
    rc, out = _run_local(script, home, stdin=b"")
    assert (rc, _last(out)) == (1, "CLUSTERCTL_STEP ssh_mesh failed no key received on stdin")


def test_mesh_key_is_made_once_with_mode_0600(tmp_path):
    path = tmp_path / "mesh" / "id_ed25519"
    private, public = mesh.mesh_key(path, "demo")
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    assert public.startswith("ssh-ed25519 ") and public.endswith(" clusterctl-mesh-demo")
    assert mesh.mesh_key(path, "demo") == (private, public)


def _res(code, out, err=""):
    return Result(Host("h", 22, "root", 0), "cmd", code, out, err, 0.1)


@pytest.mark.parametrize(
    "result, expected",
    [
        (_res(0, "noise\nCLUSTERCTL_STEP apt ok \n"), ("ok", "")),
        (_res(0, "CLUSTERCTL_STEP apt changed install a b\n"), ("changed", "install a b")),
        (_res(1, "CLUSTERCTL_STEP apt failed dpkg lock held\n"), ("failed", "dpkg lock held")),
        (_res(0, "no status\n"), ("failed", "exit 0 without a status line: no status")),
        (_res(3, "CLUSTERCTL_STEP apt ok \n"), ("failed", "exit 3 after reporting ok")),
        (_res(0, "CLUSTERCTL_STEP gpu ok \n"), ("failed", "bad status line: CLUSTERCTL_STEP gpu ok ")),
        (_res(255, "", "cannot connect to h: refused"), ("failed", "cannot connect to h: refused")),
        (_res(124, "", "timed out after 5s running x"), ("failed", "timed out after 5s (provision.timeout)")),
    ],
)
def test_parse_status(result, expected):
    outcome = parse_status("apt", result, 5)
    assert (outcome.status, outcome.reason) == expected


def test_platform_args_cover_every_manylinux_tag_up_to_the_hosts_glibc():
    args = wheelhouse.platform_args(HostFacts(python="3.11", machine="x86_64", glibc="2.36"))
    assert args[:4] == ["--python-version", "3.11", "--implementation", "cp"]
    assert args[4:10] == ["--abi", "cp311", "--abi", "abi3", "--abi", "none"]
    plats = [args[i + 1] for i, a in enumerate(args) if a == "--platform"]
    assert plats[0] == "manylinux_2_36_x86_64" and "manylinux_2_17_x86_64" in plats and "manylinux_2_5_x86_64" in plats
    assert {"manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64", "linux_x86_64"} <= set(plats)
    assert "manylinux_2_37_x86_64" not in plats
    with pytest.raises(ProvisionError, match="Python version or machine is unknown"):
        wheelhouse.platform_args(HostFacts())


def test_only_missing_wheels_travel_and_the_tar_stream_is_valid(tmp_path):
    for name, size in (("a-1-py3-none-any.whl", 10), ("b-2-py3-none-any.whl", 20000)):
        (tmp_path / name).write_bytes(os.urandom(size))
    facts = HostFacts(wheels=(("a-1-py3-none-any.whl", 10), ("b-2-py3-none-any.whl", 5)))
    missing = wheelhouse.missing_wheels(tmp_path, facts)
    assert [p.name for p in missing] == ["b-2-py3-none-any.whl"]
    data = b"".join(wheelhouse.tar_stream(missing))
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        assert [(m.name, m.size) for m in tar.getmembers()] == [("b-2-py3-none-any.whl", 20000)]
    assert wheelhouse.upload_command(".clusterctl/wheelhouse") == (
        "mkdir -p -- .clusterctl/wheelhouse && tar -x -f - -C .clusterctl/wheelhouse --no-same-owner"
    )


def test_wheelhouse_local_is_relative_to_the_spec_like_the_other_controller_paths(tmp_path, monkeypatch):
    """A relative wheelhouse.local was taken from the current directory; find_links, keys and apt.offline.local from
    the spec's. Absolute paths and `~` are as written."""
    (tmp_path / "specs").mkdir()
    (tmp_path / "elsewhere").mkdir()
    path = tmp_path / "specs" / "cluster.yaml"
    monkeypatch.chdir(tmp_path / "elsewhere")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))

    def local(value: str) -> Path:
        path.write_text(HEAD + f"  python: {{venv: v}}\n  wheelhouse: {{local: '{value}', find_links: [links]}}\n")
        return wheelhouse.local_root(load_spec(path))

    assert local("wh") == tmp_path / "specs" / "wh"
    assert local("../cache/wh") == tmp_path / "specs" / ".." / "cache" / "wh"
    assert local(str(tmp_path / "abs")) == tmp_path / "abs"
    assert local("~/wh") == tmp_path / "home" / "wh"
    assert load_spec(path).local_path("links") == tmp_path / "specs" / "links"  # the rule it follows


def _doctor_facts(mpi4py: str, nccl: str = "", pkgs=None):
    return {
        "python3": "3.11.2",
        "venv": {"path": "/v", "exists": True, "python": "3.11.2", "mpi4py": mpi4py, "mpi_library": "MPICH Version: 5.0.2",
                 "mpiexec": "5.0.2", "packages": pkgs or {"numpy": "2.4.6"}},
        "gpu": {"toolkit": "", "cudnn": "", "nccl": nccl, "gpus": [], "driver": ""},
    }


def test_doctor_compare_names_the_odd_host_out():
    hosts = [Host(f"10.0.0.{i}", 22, "root", i) for i in range(1, 4)]
    facts = {hosts[0]: _doctor_facts("4.1.2"), hosts[1]: _doctor_facts("4.1.2"), hosts[2]: _doctor_facts("4.1.1")}
    assert compare(facts, hosts) == ["mpi4py differs: 10.0.0.3 has 4.1.1; 10.0.0.1, 10.0.0.2 have 4.1.2"]
    facts[hosts[0]] = _doctor_facts("4.1.2", nccl="2.21.5-1+cuda12.4 (apt)", pkgs={"numpy": "2.0.0"})
    facts[hosts[2]] = _doctor_facts("4.1.2")
    assert compare(facts, hosts) == [
        "NCCL differs: 10.0.0.1 has 2.21.5-1+cuda12.4; 10.0.0.2, 10.0.0.3 have none",
        "package numpy differs: 10.0.0.1 has 2.0.0; 10.0.0.2, 10.0.0.3 have 2.4.6",
    ]


def test_doctor_params_list_the_plans_ports_and_peers():
    spec = _spec(HEAD + "  python: {venv: /opt/v}\n")
    plan = make_plan(spec)
    p = host_params(plan, "/opt/v", plan.hosts[0])
    assert p["ports"] == [6168, 6169, 6180] and p["listen_port"] == 6168
    assert p["peers"] == [{"label": "10.0.0.2", "address": "10.0.0.2", "ssh_port": 22, "job_port": 6180}]
    # launcher: mpi binds none of the plan's ports (mpiexec picks its own): a busy 6168 there was a false problem
    mpi = make_plan(_spec(HEAD.replace("job:\n", "job:\n  mode: collective\n  launcher: mpi\n") + "  python: {venv: /opt/v}\n"))
    p = host_params(mpi, "/opt/v", mpi.hosts[0])
    assert (p["ports"], p["listen_port"], [q["job_port"] for q in p["peers"]]) == ([], None, [None])


def test_cli_without_provision_section_is_one_clean_error(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(HEAD.replace("provision:\n", ""))
    """The spec's or the command line's problem, not a host's: exit 2 (it was 1, as for a failed step)."""
    proc = subprocess.run([sys.executable, "-m", "clusterctl.cli", "provision", str(path)], capture_output=True, text=True, check=False)
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"clusterctl: error: {path} has no provision: section (see docs/provisioning.md)"
    path.write_text(HEAD + "  apt: [htop]\n")
    proc = subprocess.run([sys.executable, "-m", "clusterctl.cli", "provision", str(path), "--only", "gpu"], capture_output=True, text=True, check=False)
    assert proc.returncode == 2
    assert proc.stderr.strip() == "clusterctl: error: --only gpu: the spec's provision section has no gpu step"
    proc = subprocess.run([sys.executable, "-m", "clusterctl.cli", "provision", str(path), "--only", "bogus"], capture_output=True, text=True, check=False)
    assert proc.returncode == 2
    assert proc.stderr.strip() == ("clusterctl: error: unknown step 'bogus' for --only (steps: wheelhouse, apt, python, gpu, "
                                   "mpi, ssh_mesh, commands)")


# ---------------------------------------------------------------- failures, sudo, offline apt, packaging


def _lib_script(body: str) -> str:
    """The shared step prelude (_lib) followed by `body`, as a step script."""
    from clusterctl.provision.render import environment

    lib = environment().get_template("_lib.sh.j2").render(step="t", check=False, force=False)
    return lib + body


@pytest.mark.parametrize(
    "output, cause",
    [
        ("Reading package lists...\nE: Unable to locate package jq\nE: second\n", "E: Unable to locate package jq"),
        ("ERROR: Could not find a version that satisfies the requirement numpy (from versions: none)\n"
         "ERROR: No matching distribution found for numpy\n", "No matching distribution found for numpy"),
        ("Traceback (most recent call last):\n  File \"x\", line 1\n"
         "PermissionError: [Errno 13] Permission denied: '/var/lib/dpkg/lock-frontend'\n",
         "PermissionError: [Errno 13] Permission denied: '/var/lib/dpkg/lock-frontend'"),
        ("ERROR: Cannot install six==1.15.0 and six==1.16.0 because these package versions have conflicting "
         "dependencies.\n\nThe conflict is caused by:\n    The user requested six==1.15.0\n\n"
         "ERROR: ResolutionImpossible: for help visit https://pip.pypa.io/en/latest/topics/dependency-resolution\n",
         "Cannot install six==1.15.0 and six==1.16.0 because these package versions have conflicting dependencies."),
        ("something\nlast words\n\n", "last words"),
        ("", ""),
    ],
)
def test_run_why_picks_the_hosts_own_cause(tmp_path, output, cause):
    (tmp_path / "out").write_text(output)
    script = _lib_script(f'run_why bash -c "cat {tmp_path}/out; exit 3" || finish failed "$WHY"\n')
    rc, out = _run_local(script, tmp_path)
    assert (rc, _last(out)) == (1, f"CLUSTERCTL_STEP t failed {cause}".rstrip())
    assert output.strip().splitlines()[:1] == out.splitlines()[:1] or not output  # the output still reaches the log


def test_unreachable_names_refused_endpoints_quickly(tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening: connections are refused
        script = _lib_script(f'finish ok "$(unreachable http://127.0.0.1:{port}/debian file:/srv/x \'http://127.0.0.1:{port}/y\')"\n')
        rc, out = _run_local(script, tmp_path)
    assert (rc, _last(out)) == (0, f"CLUSTERCTL_STEP t ok 127.0.0.1:{port} (Connection refused)")


def _login(uid=1000, home="/home/ubuntu", sudo="ok", user="ubuntu") -> HostFacts:
    return HostFacts(uid=uid, home=home, sudo=sudo, user=user)


def test_needs_root_and_sudo_problems():
    from clusterctl.provision.steps import needs_root, sudo_problem

    prov = _spec(FULL).provision
    user = _login()
    assert [s for s in ("apt", "python", "gpu", "mpi", "ssh_mesh", "commands") if needs_root(s, prov, user)] == [
        "apt", "python", "gpu", "mpi"]
    assert not any(needs_root(s, prov, _login(uid=0, home="/root", sudo="root")) for s in ("apt", "python", "commands"))
    home_venv = _spec(FULL.replace("venv: /opt/jobvenv", "venv: /home/ubuntu/venv")).provision
    assert [s for s in ("python", "mpi") if needs_root(s, home_venv, user)] == []
    rooted = _spec(HEAD + "  commands:\n    - {name: x, run: 'true', creates: /x, root: true}\n").provision
    assert needs_root("commands", rooted, user)
    assert sudo_problem("192.0.2.10", _login(sudo="password")) == (
        "sudo needs a password for ubuntu on 192.0.2.10: allow NOPASSWD sudo or log in as root")
    assert sudo_problem("h", _login(sudo="missing")) == "sudo is not installed for ubuntu on h: install sudo (NOPASSWD) or log in as root"
    assert sudo_problem("h", _login()) == "" and sudo_problem("h", _login(uid=0, sudo="root")) == ""


def test_root_commands_run_through_sudo_n_and_others_do_not(tmp_path):
    spec = _spec(HEAD + textwrap.indent(textwrap.dedent(f"""\
        commands:
          - {{name: asroot, run: "echo root > {tmp_path}/r", creates: {tmp_path}/r, root: true}}
          - {{name: asuser, run: "echo user > {tmp_path}/u", creates: {tmp_path}/u}}
        """), "  "))
    script = render_step("commands.sh.j2", step_context("commands", spec, check=False, force=False, wheelhouse_remote=None, mesh=None))
    assert 'AS=("${SUDO_RUN[@]}")' in script and "SUDO_RUN=(sudo -n env" in script
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "sudo").write_text(f"#!/bin/sh\necho \"sudo $*\" >> {tmp_path}/sudo.log\nshift\nexec \"$@\"\n")
    (fake / "sudo").chmod(0o755)
    # a login user that is not root, whatever runs the test
    (fake / "id").write_text('#!/bin/sh\nif [ "$1" = -u ]; then echo 1000; else exec /usr/bin/id "$@"; fi\n')
    (fake / "id").chmod(0o755)
    env = {"HOME": str(tmp_path), "PATH": f"{fake}:{os.environ['PATH']}"}
    proc = subprocess.run(["bash", "-c", script, "x"], capture_output=True, env=env, timeout=60, check=False)
    assert proc.returncode == 0, proc.stdout
    calls = (tmp_path / "sudo.log").read_text().splitlines()
    assert calls == [f"sudo -n env CLUSTERCTL_USER_HOME={tmp_path} test -e {tmp_path}/r",
                     f"sudo -n env CLUSTERCTL_USER_HOME={tmp_path} bash -c echo root > {tmp_path}/r",
                     f"sudo -n env CLUSTERCTL_USER_HOME={tmp_path} test -e {tmp_path}/r"]
    assert (tmp_path / "u").read_text() == "user\n"


STATUS = b"""Package: jq
Status: install ok installed
Version: 1.6-2.1

Package: gone
Status: deinstall ok config-files
Version: 1.0

Package: libnccl2
Status: install ok installed
Version: 2.20.5-1+cuda12.4
"""


def test_offline_missing_packages_reads_the_hosts_dpkg_status():
    from clusterctl.provision.aptoffline import installed_versions, missing_packages

    assert installed_versions(STATUS) == {"jq": "1.6-2.1", "libnccl2": "2.20.5-1+cuda12.4"}
    assert missing_packages(["jq", "gone", "libnccl2=2.21.5-1+cuda12.4", "libnccl2x"], STATUS) == [
        "gone", "libnccl2=2.21.5-1+cuda12.4", "libnccl2x"]
    assert missing_packages(["jq", "libnccl2=2.20.5-1+cuda12.4"], STATUS) == []
    assert missing_packages(["jq"], STATUS, force=True) == ["jq"]


def test_offline_packages_index_and_upload_plan(tmp_path):
    sys.path.insert(0, str(Path(__file__).parent))
    from provision_helpers import build_repo

    from clusterctl.provision.aptoffline import HostAptState, packages_index, release_file, upload_plan

    repo = build_repo(tmp_path, [("ctl-a", "1.0-1"), ("ctl-b", "2.0-1", "ctl-a (= 1.0-1)")])
    debs = sorted(repo.glob("*.deb"))
    index = packages_index(debs).decode()
    stanzas = index.split("\n\n")
    assert [s.splitlines()[0] for s in stanzas] == ["Package: ctl-a", "Package: ctl-b"]
    assert f"Filename: ./{debs[0].name}\nSize: {debs[0].stat().st_size}\nSHA256: " in stanzas[0]
    assert "Depends: ctl-a (= 1.0-1)" in stanzas[1]
    assert release_file(index.encode()).decode().splitlines()[-1].endswith(f" {len(index.encode())} Packages")
    import hashlib
    import json

    from clusterctl.provision.aptoffline import manifest

    same = (debs[0].stat().st_size, hashlib.sha256(debs[0].read_bytes()).hexdigest())
    other = (debs[1].stat().st_size, "0" * 64)  # same name and size, other bytes (a rebuilt package)
    state = HostAptState("amd64", b"", b"", {debs[0].name: same, debs[1].name: other, "old.deb": (3, "ab")})
    assert upload_plan(debs, state) == [debs[1]]
    assert json.loads(manifest([debs[1]], state)) == {
        debs[0].name: list(same), debs[1].name: [debs[1].stat().st_size, hashlib.sha256(debs[1].read_bytes()).hexdigest()],
        "old.deb": [3, "ab"]}


def test_self_wheel_is_complete_and_reproducible(tmp_path):
    import zipfile

    from clusterctl.provision.selfwheel import build_self_wheel

    wheel, version = build_self_wheel(tmp_path / "a")
    again, version2 = build_self_wheel(tmp_path / "b")
    assert version == version2 and wheel.read_bytes() == again.read_bytes()
    assert wheel.name == f"clusterctl-{version}-py3-none-any.whl" and "+src." in version
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {"clusterctl/templates/provision/apt.sh.j2", "clusterctl/fab/fabfile.py", "clusterctl/py.typed",
            f"clusterctl-{version}.dist-info/RECORD"} <= names
    assert not [n for n in names if "__pycache__" in n or n.endswith(".pyc")]
    meta = zipfile.ZipFile(wheel).read(f"clusterctl-{version}.dist-info/METADATA").decode()
    assert f"Version: {version}\n" in meta and "Requires-Dist: fabric>=3.2" in meta


def test_apt_reach_tries_apts_own_proxy(tmp_path):
    from clusterctl.provision.render import environment

    apt = environment().get_template("_apt.sh.j2").render(lock_timeout=1, step="t", check=False, force=False)
    conf = tmp_path / "apt.conf"
    conf.write_text('Acquire::http::Proxy "http://127.0.0.1:9/";\n')  # discard port: nothing listens there
    script = _lib_script(apt + 'apt_reach "the archive" "\'http://deb.debian.org/debian/pool/x.deb\'"\nfinish ok\n')
    env = {"HOME": str(tmp_path), "PATH": os.environ["PATH"], "APT_CONFIG": str(conf)}
    proc = subprocess.run(["bash", "-c", script, "x"], capture_output=True, env=env, timeout=60, check=False)
    assert (proc.returncode, _last(proc.stdout.decode())) == (1, (
        "CLUSTERCTL_STEP t failed cannot reach the archive: 127.0.0.1:9 (Connection refused); give a mirror this host "
        "can reach in apt.sources (with apt.update: sources), or apt.offline: true (the controller downloads the "
        "packages and uploads them)"))


@pytest.mark.parametrize("runtime", ["nvidia-cuda-runtime", "nvidia-cuda-runtime-cu12"])
def test_doctor_facts_read_the_cuda_runtime_wheel_of_cuda_12_and_13(monkeypatch, runtime):
    """doctor's facts name the CUDA runtime from the job's venv: CUDA 13's wheel has no -cuNN suffix."""
    from clusterctl.host import provision_host
    monkeypatch.setattr(provision_host.shutil, "which", lambda name: None)  # no nvidia-smi, no nvcc
    monkeypatch.setattr(provision_host, "_dpkg", lambda: {})
    info = provision_host._gpu_stack({runtime: "13.0.96", "nvidia-nccl-cu13": "2.27.7", "numpy": "2.3.0"})
    assert info["toolkit"] == f"13.0.96 (pip {runtime})"
    assert info["nccl"] == "2.27.7 (pip nvidia-nccl-cu13)"
    assert info["gpus"] == [] and info["driver"] == ""


@pytest.mark.parametrize("gpu", ["  cuda: '12.4'\n", "  cuda: {version: '12.4', method: pip}\n  nccl: {version: 2.21.5, method: apt}\n"])
def test_offline_apt_for_the_gpu_step_without_a_repository_is_a_spec_error(gpu):
    """`validate` said valid; `provision` changed the hosts in the earlier steps, then stopped at gpu."""
    problems = _errors(HEAD + "  apt: {offline: true}\n  python: {venv: v}\n" + gpu)
    assert problems == ["cluster.yaml:7:1: provision: apt.offline with cuda.method apt needs cuda.repository (a repository "
                        "the controller can read: NVIDIA's URL, or a local mirror)"]


def test_doctor_says_a_busy_port_is_the_running_jobs_own_not_a_problem(tmp_path, monkeypatch):
    """doctor while the job runs said `job port 6168 is busy: Address already in use`: its own coordinator's port.
    The facts script reads the job's state.json (the spec's job dir under home) and checks its supervisor's pid and
    start time in /proc: alive, a busy port is `job:` (no problem); a stale state.json or none, `busy:` as before."""
    import socket

    from clusterctl.host import provision_host
    from clusterctl.provision.doctor import port_problems

    monkeypatch.setenv("HOME", str(tmp_path))
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen(1)
        port = held.getsockname()[1]
        params = {"address": "127.0.0.1", "ports": [port], "peers": [], "window": 0.1, "job_dir": ".clusterctl/jobs/j"}

        def ports_now():
            monkeypatch.setattr(sys, "argv", ["facts", json.dumps(params)])
            with contextlib.redirect_stdout(io.StringIO()) as out:
                provision_host.main()
            return json.loads(out.getvalue().strip().splitlines()[-1])["ports"][str(port)]

        assert ports_now().startswith("busy: ")  # no job dir at all
        jobdir = tmp_path / ".clusterctl" / "jobs" / "j"
        jobdir.mkdir(parents=True)
        ticks = int(open("/proc/self/stat").read().rsplit(")", 1)[1].split()[19])
        (jobdir / "state.json").write_text(json.dumps({"supervisor": {"pid": os.getpid(), "start_ticks": ticks}}))
        assert ports_now() == "job: in use while the job runs"
        (jobdir / "state.json").write_text(json.dumps({"supervisor": {"pid": os.getpid(), "start_ticks": ticks + 1}}))
        assert ports_now().startswith("busy: ")  # that pid is another process now
    assert port_problems("n0", {"6168": "job: in use while the job runs", "6169": "free"}) == []
    assert port_problems("n0", {"6168": "busy: Address already in use"}) == [
        "n0: job port 6168 is busy: Address already in use"]
