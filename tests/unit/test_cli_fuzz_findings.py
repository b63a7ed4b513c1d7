"""What fuzzing the `clusterctl` command line found: each a one-line refusal (exit 2) before any host is asked, or a
command that ends when its reader goes away, where it ran a wrong command on every host, dropped a flag without a
word, named a byte as a surrogate, or followed on for as long as the job ran."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import yaml

from clusterctl import cli
from fakehosts import FakeCluster
from helpers import free_port_base

ROOT = Path(__file__).resolve().parents[2]
SPEC = "name: t\nssh: {config: none}\nhosts:\n  - address: 10.0.0.1\njob:\n  entrypoint: [python3, train.py]\n"


def _cli(*argv, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "clusterctl.cli", *argv], capture_output=True, stdin=subprocess.DEVNULL,
                          timeout=120, **kw)


@pytest.mark.parametrize("words", [["--timeout", "5", "hostname"], ["--timeout=5", "hostname"], ["-x"]])
def test_exec_options_after_the_spec_without_a_double_dash_are_not_run_as_the_command(tmp_path, monkeypatch, capsys,
                                                                                   words):
    # `exec SPEC --timeout 5 hostname`: argparse's REMAINDER took `--timeout 5 hostname` as the command, and every
    # host was asked to run a program named `--timeout` (exit 127 each)
    import clusterctl.ops.execute as execute

    sent: list = []
    monkeypatch.setattr(execute, "execute", lambda remote, argv, **kw: sent.append(argv))
    spec = str(FakeCluster(tmp_path).everywhere(monkeypatch).spec_path)
    assert cli.main(["exec", spec, *words]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"clusterctl: error: exec: {words[0]} is not a command: exec's options go before --, the command "
                   "after it (clusterctl exec SPEC --timeout 5 -- hostname)"], err
    assert sent == []


def test_exec_without_a_double_dash_still_runs_a_plain_command(tmp_path, monkeypatch, capsys):
    spec = str(FakeCluster(tmp_path).everywhere(monkeypatch).spec_path)
    assert cli.main(["exec", spec, "echo", "-n", "hi"]) == 0
    assert sorted(capsys.readouterr().out.splitlines()) == ["[n0] hi", "[n1] hi"]


def test_plan_expand_without_json_is_refused_not_dropped(tmp_path):
    # the table has no env column: `plan --expand` printed the table, exit 0, as if the flag had not been given
    spec = tmp_path / "a.yaml"
    spec.write_text(SPEC)
    res = _cli("plan", str(spec), "--expand")
    assert (res.returncode, res.stdout, res.stderr) == (
        2, b"", b"clusterctl: error: plan: --expand goes with --json (the table shows no environment)\n")
    assert _cli("plan", str(spec), "--expand", "--json").returncode == 0


def test_a_spec_path_that_is_not_utf8_is_named_by_its_bytes(tmp_path):
    # a file name byte 0xff was shown as Python's surrogate `\udcff`
    res = _cli("validate", os.fsencode(tmp_path) + b"/l\xff.yaml")
    assert res.returncode == 2
    assert res.stderr.endswith(b"/l\\xff.yaml:1:1: cannot read spec: No such file or directory\n"), res.stderr


def test_printable_shows_escaped_bytes_as_bytes_and_other_controls_as_before():
    from clusterctl.console import printable

    assert printable("a\udcffb\udc80") == "a\\xffb\\x80"
    assert printable("\x1b[31m\ud800\u202e\tok") == "\\x1b[31m\\ud800\\u202e\tok"


@pytest.mark.parametrize("host", ["", " "])
def test_logs_refuses_an_empty_host(tmp_path, capsys, host):
    # said "no process of job t matches host=" (exit 1), after asking every host
    assert cli.main(["logs", str(tmp_path / "never-read.yaml"), "--host", host]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "clusterctl: error: logs: --host is empty: name a host as the spec does (its address or label)"]


def _first_line_then_no_reader(argv, env, cwd) -> tuple[int, bytes]:
    """Run `clusterctl ARGV | head -1`: read one log line, close the pipe; (exit code, stderr)."""
    proc = subprocess.Popen([sys.executable, "-m", "clusterctl.cli", *argv], env=env, cwd=cwd,
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        while not (line := proc.stdout.readline()).endswith(b"] tick\n"):  # `start` says "started in" first
            assert line, proc.stderr.read()
        proc.stdout.close()  # as `head -1` does
        # its next line (0.2 s later) finds no reader; the follow channels close as after Ctrl+C
        return proc.wait(timeout=60), proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_logs_follow_and_start_follow_end_when_their_reader_goes_away(tmp_path):
    """`clusterctl logs -f SPEC | head -1`: the lines went to /dev/null and the command followed on until the job
    ended (here: never), where `tail -f | head -1` ends at once. Now it ends, exit 0, nothing on stderr. So does
    `start --follow | head -1`, saying that the job runs on (as `docker run | head`'s container: the reader of the
    lines going away is not a request to stop, which Ctrl+C and SIGTERM are)."""
    home = tmp_path / "home"
    home.mkdir()
    env = {**os.environ, "HOME": str(home), "XDG_CACHE_HOME": str(tmp_path / "cache")}
    (tmp_path / "ws").mkdir()
    (tmp_path / "ws" / "train.py").write_text("import time\nwhile True:\n    print('tick', flush=True)\n"
                                              "    time.sleep(0.2)\n")
    name, base = f"loc-{uuid.uuid4().hex[:8]}", free_port_base(24)
    spec = tmp_path / "local.yaml"
    spec.write_text(yaml.safe_dump({
        "name": name, "backend": "local", "hosts": [{"address": "localhost"}],
        "workspace": {"local": str(tmp_path / "ws"), "remote": f"clusterctl-local/{name}"},
        "job": {"entrypoint": [sys.executable, "train.py"], "grace": 2,
                "ports": {"control": base, "master": base + 1, "pserver": base + 2, "trainer": base + 12}}}))
    try:
        code, err = _first_line_then_no_reader(["start", "--dispatch", "--follow", str(spec)], env, tmp_path)
        assert code == 0 and f"the reader of the logs went away: job {name} runs on".encode() in err, err
        assert b"stopping" not in err and b"Traceback" not in err, err
        assert _first_line_then_no_reader(["logs", "-f", str(spec)], env, tmp_path) == (0, b"")  # it runs on
    finally:
        stopped = _cli("stop", str(spec), env=env, cwd=tmp_path)
        assert stopped.returncode == 0, stopped.stdout + stopped.stderr


def test_a_closed_standard_input_is_held_by_dev_null_so_no_file_opened_later_takes_it(tmp_path):
    """`clusterctl ... <&-`: the first file the command opened became descriptor 0, the standard input of every ssh,
    rsync or kubectl it started afterwards."""
    probe = ("import os, sys\nfrom clusterctl import console\nconsole.hold_std_fds()\nf = open(sys.argv[1])\n"
             "print(f.fileno(), os.readlink('/proc/self/fd/0'))\n")
    (tmp_path / "spec.yaml").write_text("name: t\n")
    out = subprocess.run([sys.executable, "-c", probe, str(tmp_path / "spec.yaml")], capture_output=True, text=True,
                         preexec_fn=lambda: os.close(0), timeout=60)
    fileno, stdin = out.stdout.split()
    assert (int(fileno) != 0, stdin) == (True, os.devnull), out.stderr
    validated = subprocess.run(f"exec {sys.executable} -m clusterctl.cli validate {tmp_path / 'spec.yaml'} <&-",
                               shell=True, capture_output=True, text=True, timeout=60)
    assert validated.returncode == 2 and "job: required key is missing" in validated.stderr, validated.stderr


def test_a_closed_standard_error_is_dev_null_and_the_command_runs(tmp_path):
    """`clusterctl ... 2>&-` (cron, some CI runners) exited 1 doing nothing, silently; and no descriptor may be taken
    by a file opened later (every ssh's stderr). Now /dev/null takes descriptor 2 and the command runs: its output
    on stdout, its exit code as ever, its messages nowhere."""
    probe = ("import os, sys\nfrom clusterctl import console\nconsole.hold_std_fds()\nf = open(sys.argv[1])\n"
             "print(f.fileno(), os.readlink('/proc/self/fd/2'), sys.stderr.fileno())\n")
    spec = tmp_path / "spec.yaml"
    spec.write_text("name: t\nhosts: [10.0.0.1]\njob: {entrypoint: [python3, t.py]}\n")
    out = subprocess.run([sys.executable, "-c", probe, str(spec)], capture_output=True, text=True,
                         preexec_fn=lambda: os.close(2), timeout=60)
    fileno, stderr, sys_stderr = out.stdout.split()
    assert (int(fileno) != 2, stderr, sys_stderr) == (True, os.devnull, "2")
    for script in ("clusterctl.cli", "clusterctl.fab"):
        argv = ["validate", str(spec)] if script == "clusterctl.cli" else ["--spec", str(spec), "exec", "--help"]
        ran = subprocess.run(f"exec {sys.executable} -m {script} {' '.join(argv)} 2>&-", shell=True,
                             capture_output=True, text=True, timeout=60)
        assert ran.returncode == 0 and ran.stdout.strip(), (script, ran.stdout, ran.stderr)
    spec.write_text("name: t\n")
    bad = subprocess.run(f"exec {sys.executable} -m clusterctl.cli validate {spec} 2>&-", shell=True,
                         capture_output=True, text=True, timeout=60)
    assert (bad.returncode, bad.stdout) == (2, "")
