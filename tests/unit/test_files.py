"""The user's files as clusterctl reads them (clusterctl/files.py): bounded, a FIFO refused rather than waited on, a
device read as a file, a spec given as a pipe read once. Before, `hostfile: /dev/zero` or an ssh config's
`Include /dev/zero` grew the process by gigabytes, a FIFO there hung the command, and `clusterctl status
/dev/stdin` read the spec twice (the plan cache, then the loader) and complained of an empty spec."""

from __future__ import annotations

import os
import threading

import pytest

from clusterctl.errors import ClusterctlError, SpecError
from clusterctl.files import NotAFile, TooLarge, read_limited

SPEC = """\
name: piped
ssh: {config: none}
hosts:
  - address: 10.0.0.1
  - address: 10.0.0.2
job:
  entrypoint: [python3, train.py]
"""


@pytest.fixture
def fifo(tmp_path):
    path = tmp_path / "fifo"
    os.mkfifo(path)
    return path


@pytest.mark.timeout(20)
def test_what_is_not_a_file_is_refused_or_bounded(tmp_path, fifo):
    with pytest.raises(NotAFile):  # opened without blocking: no writer is waited for
        read_limited(fifo, 1024)
    with pytest.raises(TooLarge, match="larger than 1 KiB"):  # read no further than the limit
        read_limited("/dev/zero", 1024)
    assert read_limited("/dev/null", 1024) == b""  # `ssh -F /dev/null`: a device read as a file
    with pytest.raises(IsADirectoryError):
        read_limited(tmp_path, 1024)
    (tmp_path / "f").write_bytes(b"x" * 1024)
    assert read_limited(tmp_path / "f", 1024) == b"x" * 1024
    with pytest.raises(TooLarge):
        read_limited(tmp_path / "f", 1023)


@pytest.mark.timeout(20)
@pytest.mark.parametrize("target, said", [("/dev/zero", "is larger than 1024 KiB"),
                                          ("FIFO", "not a file (a FIFO or a socket)")])
def test_a_hostfile_that_is_not_a_file_is_one_problem(tmp_path, fifo, target, said):
    from clusterctl.spec import load_spec

    spec = tmp_path / "spec.yaml"
    spec.write_text(SPEC.replace("hosts:\n  - address: 10.0.0.1\n  - address: 10.0.0.2\n",
                                 f"hostfile: {fifo if target == 'FIFO' else target}\n"))
    with pytest.raises(SpecError) as err:
        load_spec(spec)
    assert [p.message for p in err.value.problems] == [f"{fifo if target == 'FIFO' else target} {said}"
                                                       if "larger" in said else f"cannot read {fifo}: {said}"]


@pytest.mark.timeout(20)
@pytest.mark.parametrize("target", ["/dev/zero", "FIFO"])
def test_an_ssh_config_including_what_is_not_a_file_is_one_line(tmp_path, fifo, target):
    from clusterctl.sshconfig import Target, resolve

    config = tmp_path / "ssh_config"
    config.write_text(f"Host gpu*\n    User ops\nInclude {fifo if target == 'FIFO' else target}\n")
    with pytest.raises(ClusterctlError, match=r"^ssh config (/dev/zero: larger than 16384 KiB|.*/fifo: not a file)"):
        resolve([Target("gpu1", None, None)], str(config))
    (found,) = resolve([Target("gpu1", "ops", None)], "/dev/null")  # `ssh -F /dev/null`: a device read as a file
    assert (found.hostname, found.user) == ("gpu1", "ops")


@pytest.mark.timeout(30)
def test_a_spec_given_as_a_pipe_is_read_once_by_every_command(tmp_path, monkeypatch):
    from clusterctl.ops import load_plan

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    read, write = os.pipe()
    writer = threading.Thread(target=lambda: (os.write(write, SPEC.encode()), os.close(write)))
    writer.start()
    try:
        spec, plan, _ = load_plan(f"/dev/fd/{read}")
    finally:
        writer.join()
        os.close(read)
    assert spec is not None and spec.name == "piped"
    assert [h.address for h in plan.hosts] == ["10.0.0.1", "10.0.0.2"]


@pytest.mark.timeout(30)
def test_another_pipe_under_the_same_name_is_another_spec():
    # `/dev/fd/N` names whichever pipe fd N is now: kept bytes are the pipe's, not the name's
    from clusterctl.files import read_spec_bytes

    spare = os.dup(0)
    try:
        for text in (b"name: first\n", b"name: second\n"):
            read, write = os.pipe()
            os.write(write, text)
            os.close(write)
            os.dup2(read, spare)
            os.close(read)
            assert read_spec_bytes(f"/dev/fd/{spare}") == text
            assert read_spec_bytes(f"/dev/fd/{spare}") == text  # and again: kept, the pipe is empty now
    finally:
        os.close(spare)
