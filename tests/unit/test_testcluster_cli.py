"""`clusterctl testcluster` and `clusterctl testcluster-slurm`: an argument no cluster can have is a usage error
(exit 2, one `clusterctl: error:` line, as argparse's own), refused before docker is touched; a docker that
cannot be used is a runtime failure (exit 1). Every command runs with a PATH whose `docker` and `dockerd` are a
script that records its call and exits 1, so no test here can start docker or a cluster."""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path

import pytest

NAME_RULE = "use lowercase letters, digits, '.', '_' or '-' (at most 41 characters, starting with a letter or digit)"
USER_RULE = "use lowercase letters, digits, '_' or '-' (at most 32, not starting with a digit or '-')"
BASE_RULE = "give a docker image reference such as debian:bookworm-slim, or leave it out to build a Debian base locally"
NOT_WITH_SLURM = "a Slurm test cluster logs in as root, on one network, with no ssh config"
FAKE_DOCKER = '#!/bin/sh\necho "$0 $*" >> "$MARKER"\nexit 1\n'


@pytest.fixture
def clusterctl(tmp_path: Path):
    """Run `python -m clusterctl.cli WORDS` (or another module) with the fake docker and dockerd alone on PATH; return (rc, stderr
    lines, the fake's calls)."""
    bin_dir, marker = tmp_path / "bin", tmp_path / "docker-called"
    bin_dir.mkdir()
    for tool in ("docker", "dockerd"):
        (bin_dir / tool).write_text(FAKE_DOCKER)
        (bin_dir / tool).chmod(0o755)
    env = {"PATH": str(bin_dir), "MARKER": str(marker), "HOME": str(tmp_path / "home"),
           "CLUSTERCTL_TESTCLUSTER_HOME": str(tmp_path / "state"), "COLUMNS": "400"}

    def run(*words: str, module: str = "clusterctl.cli") -> tuple[int, list[str], list[str]]:
        proc = subprocess.run([sys.executable, "-m", module, *words], env=env, cwd=tmp_path,
                              capture_output=True, text=True, timeout=60)
        calls = marker.read_text().splitlines() if marker.exists() else []
        return proc.returncode, proc.stderr.splitlines(), calls

    return run


SPEC_OUT_DIR = "<an existing directory>"

USAGE_ERRORS = [
    (["testcluster", "up", "--nodes", "0"], "--nodes must be between 1 and 64, not 0"),
    (["testcluster", "up", "--nodes", "65"], "--nodes must be between 1 and 64, not 65"),
    (["testcluster", "up", "--nodes", "99999999999999999999"],
     "--nodes must be between 1 and 64, not 99999999999999999999"),
    (["testcluster", "up", "--nodes", "1", "--name", "BAD"], f"invalid test cluster name 'BAD': {NAME_RULE}"),
    (["testcluster", "up", "--nodes", "1", "--name", ""], f"invalid test cluster name '': {NAME_RULE}"),
    (["testcluster", "up", "--nodes", "1", "--user", "Bad User"], f"invalid user name 'Bad User': {USER_RULE}"),
    (["testcluster", "up", "--nodes", "1", "--user", ""], f"invalid user name '': {USER_RULE}"),  # was: root
    (["testcluster", "up", "--nodes", "2", "--sudo-password-node", "5", "--user", "u"],
     "--sudo-password-node 5: nodes are numbered 0..1"),
    (["testcluster", "up", "--nodes", "2", "--sudo-password-node", "1"],
     "--sudo-password-node needs --user NAME: root does not use sudo"),
    (["testcluster", "up", "--nodes", "1", "--packages", "!!"],
     "invalid package requirement '!!': Expected package name at the start of dependency specifier"),
    (["testcluster", "up", "--nodes", "1", "--spec-out", SPEC_OUT_DIR],
     f"--spec-out {SPEC_OUT_DIR} is a directory: give the spec file's path (e.g. {SPEC_OUT_DIR}/cluster.yaml)"),
    # --base-image is a docker image reference: `--base-image=--help` was docker's --help (a JSONDecodeError
    # traceback), '' the default base without a word, 'Bad Image' a 20 s pull
    *[(["testcluster", "up", "--nodes", "1", f"--base-image={image}"], f"invalid --base-image {image!r}: {BASE_RULE}")
      for image in ("--help", "", "Bad Image", "UPPER", "debian:", "a//b")],
    (["testcluster", "up", "--slurm", "--nodes", "1", "--base-image=-x"], f"invalid --base-image '-x': {BASE_RULE}"),
    (["testcluster", "status", "--name", "BAD"], f"invalid test cluster name 'BAD': {NAME_RULE}"),
    (["testcluster", "down", "--name", ""], f"invalid test cluster name '': {NAME_RULE}"),
    (["testcluster-slurm", "up", "--nodes", "0"], "--nodes must be between 1 and 64, not 0"),
    (["testcluster-slurm", "up", "--nodes", "1", "--name", "BAD"], f"invalid test cluster name 'BAD': {NAME_RULE}"),
    (["testcluster-slurm", "up", "--nodes", "1", "--packages", "!!"],
     "invalid package requirement '!!': Expected package name at the start of dependency specifier"),
    (["testcluster", "up", "--slurm", "--nodes", "0"], "--nodes must be between 1 and 64, not 0"),
    # the fleet options that the Slurm cluster never reads: refused, not dropped
    (["testcluster", "up", "--slurm", "--nodes", "1", "--user", "u"],
     f"testcluster up --slurm does not take --user: {NOT_WITH_SLURM}"),
    (["testcluster", "up", "--slurm", "--nodes", "1", "--user", ""],
     f"testcluster up --slurm does not take --user: {NOT_WITH_SLURM}"),
    (["testcluster", "up", "--slurm", "--nodes", "2", "--sudo-password-node", "0"],
     f"testcluster up --slurm does not take --sudo-password-node: {NOT_WITH_SLURM}"),
    (["testcluster", "up", "--slurm", "--nodes", "1", "--bastion"],
     f"testcluster up --slurm does not take --bastion: {NOT_WITH_SLURM}"),
    (["testcluster", "up", "--slurm", "--nodes", "1", "--ssh-config"],
     f"testcluster up --slurm does not take --ssh-config: {NOT_WITH_SLURM}"),
    (["testcluster", "up", "--slurm", "--nodes", "1", "--user", "u", "--bastion", "--ssh-config"],
     f"testcluster up --slurm does not take --user, --bastion, --ssh-config: {NOT_WITH_SLURM}"),
]


@pytest.mark.parametrize(("words", "message"), USAGE_ERRORS, ids=[shlex.join(w) for w, _ in USAGE_ERRORS])
def test_a_bad_argument_is_a_usage_error_before_docker(clusterctl, tmp_path, words, message) -> None:
    spec_dir = tmp_path / "specs"
    spec_dir.mkdir()
    words = [str(spec_dir) if w == SPEC_OUT_DIR else w for w in words]
    rc, err, calls = clusterctl(*words)
    assert (rc, err) == (2, [f"clusterctl: error: {message.replace(SPEC_OUT_DIR, str(spec_dir))}"])
    assert calls == []  # neither docker nor dockerd was run


def test_a_docker_that_cannot_be_used_is_a_runtime_failure(clusterctl) -> None:
    # good arguments reach docker (here the fake, which fails): exit 1, not 2; and the fake does record its calls
    rc, err, calls = clusterctl("testcluster", "status", "--name", "never-started")
    assert rc == 1 and len(err) == 1 and err[0].startswith("clusterctl: error: "), err
    assert ("dockerd" in err[0] or "docker daemon" in err[0]) and calls, (err, calls)
    assert calls[0].endswith("/docker info --format {{.ServerVersion}}"), calls


def test_the_stand_alone_entry_point_says_a_usage_error_in_one_line_on_stderr(clusterctl) -> None:
    rc, err, calls = clusterctl("up", "--nodes", "1", "--slurm", "--bastion", module="clusterctl.testcluster_cli")
    assert (rc, err, calls) == (2, [f"error: testcluster up --slurm does not take --bastion: {NOT_WITH_SLURM}"], [])


@pytest.mark.parametrize("words,name", [
    (["--slurm"], "clusterctl-slurm"),  # was the plain cluster's name: `up --slurm` replaced that cluster
    (["--slurm", "--name", "mine"], "mine"),
    ([], "clusterctl-test"),
])
def test_up_names_the_cluster_it_brings_up(monkeypatch, words, name):
    import clusterctl.testcluster_cli as tcli
    from clusterctl import cli, testcluster, testcluster_slurm

    seen = []

    def plain_up(nodes, **kw):
        seen.append(kw["name"])
        raise testcluster.DockerClusterError("not brought up in a unit test")

    monkeypatch.setattr(testcluster_slurm, "cmd_up", lambda args: seen.append(args.name) or 0)
    monkeypatch.setattr(tcli, "up", plain_up)
    cli.main(["testcluster", "up", "--nodes", "1", *words])
    assert seen == [name]


@pytest.mark.parametrize("image", ["debian:bookworm-slim", "localhost:5000/team/base:v1.2", "2b5b2047fc22",
                                   "ghcr.io/o/img@sha256:" + "ab" * 32, "clusterctl/bookworm-base:bookworm-16f793b27ba5"])
def test_a_good_base_image_reaches_docker(clusterctl, image) -> None:
    rc, err, calls = clusterctl("testcluster", "up", "--nodes", "1", "--name", "never-started", "--base-image", image)
    assert rc == 1 and calls and "docker" in err[0], (rc, err, calls)  # the fake docker's failure, not a usage error


@pytest.mark.parametrize("words", [
    ["testcluster", "down", "--name", "never-started"],
    ["testcluster", "up", "--nodes", "1", "--name", "never-started"],
    ["testcluster", "up", "--slurm", "--nodes", "1", "--name", "never-started"],
    ["testcluster-slurm", "down", "--name", "never-started"],
])
def test_a_state_directory_that_cannot_be_made_is_one_line(monkeypatch, tmp_path, capsys, words) -> None:
    # a file where a directory must be (read-only or missing file systems fail the same way): was
    # "Not a directory: .../locks", naming neither what it was for nor how to choose another place
    from clusterctl import cli, testcluster

    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("CLUSTERCTL_TESTCLUSTER_HOME", str(blocker / "state"))
    monkeypatch.setattr(testcluster, "ensure_docker", lambda: None)
    assert cli.main(words) == 1
    where = blocker / "state" / ("locks" if "down" in words else "never-started")
    assert capsys.readouterr().err == (f"clusterctl: error: cannot make the test cluster state directory {where}: "
                                       "Not a directory (CLUSTERCTL_TESTCLUSTER_HOME chooses where they are)\n")


def test_up_prints_odd_paths_as_they_are_and_a_hint_to_paste(monkeypatch, tmp_path, capsys) -> None:
    # a state directory with a blank, % and [brackets]: the paths were rich markup ("[b]" vanished) and the
    # `ssh -F ... node0` hint split at the blank
    import clusterctl.testcluster_cli as tcli
    from clusterctl import cli, testcluster

    state = tmp_path / "a b%d [b]x"
    node = testcluster.Node("c-node0", "10.0.0.2", "c-node0")
    info = testcluster.ClusterInfo(name="c", nodes=[node], spec_path=state / "cluster.yaml",
                                   key_path=state / "id_ed25519", known_hosts_path=state / "known_hosts",
                                   state_dir=state, ssh_config_path=state / "ssh_config", timings={"total": 1.0})
    monkeypatch.setenv("COLUMNS", "400")
    monkeypatch.setattr(tcli, "up", lambda nodes, **kw: info)
    assert cli.main(["testcluster", "up", "--nodes", "1", "--ssh-config"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[-5:] == [
        f"spec:        {state}/cluster.yaml", f"key:         {state}/id_ed25519",
        f"known_hosts: {state}/known_hosts",
        f"ssh_config:  {state}/ssh_config   (ssh -F '{state}/ssh_config' node0)", "login:       root",
    ]  # fmt: skip
