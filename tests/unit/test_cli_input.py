"""Numbers and words a user types, refused in one line before any host is asked: `clusterctl exec --timeout`,
`clusterctl logs -n`, and the fab tasks' `--lines`, `--port` and `exec --cmd`. A refusal is the command's exit
code and one `clusterctl: error:` line, never a traceback (fab's own parser included)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from clusterctl import cli
from fakehosts import FakeCluster

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def ran(tmp_path, monkeypatch):
    """A spec of two local fake hosts; the list of commands exec sent to them (none, for a refusal)."""
    import clusterctl.ops.execute as execute

    calls: list = []
    real = execute.execute

    def spy(remote, argv, on_line=None, timeout=None):
        calls.append((list(argv), timeout))
        return real(remote, argv, on_line=on_line, timeout=timeout)

    monkeypatch.setattr(execute, "execute", spy)
    return str(FakeCluster(tmp_path).everywhere(monkeypatch).spec_path), calls


@pytest.mark.parametrize("value", ["-1", "0", "nan", "inf", "1e9"])
def test_exec_refuses_a_timeout_that_is_no_deadline(ran, value, capsys):
    # `timeout 0` on the host means no limit, `-1` is read as an option by coreutils, inf and nan ended in
    # tracebacks from the controller's clock
    spec, calls = ran
    assert cli.main(["exec", spec, "--timeout", value, "--", "true"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("clusterctl: error: exec: --timeout must be more than 0"), err
    assert calls == []


def test_exec_takes_a_timeout_within_bounds(ran, capsys):
    spec, calls = ran
    assert cli.main(["exec", "--timeout", "0.5", spec, "--", "true"]) == 0
    assert calls == [(["true"], 0.5)]


def test_logs_refuses_a_negative_line_count_once(tmp_path, capsys):
    # refused before the spec is even read: every host's agent would refuse it too, once per host
    assert cli.main(["logs", str(tmp_path / "never-read.yaml"), "-n", "-5"]) == 2  # a usage error, as exec's
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["clusterctl: error: logs: the number of lines must be 0 or more, not -5"]


def _fab(*words: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fabric", "-r", str(ROOT), "-H", "127.0.0.1", *words],
                          capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL, cwd=cwd)


@pytest.mark.parametrize("words, said", [
    (("tail-log", "--lines", "many"), "--lines must be a whole number, not 'many'"),
    (("start", "--port", "http"), "--port must be a whole number, not 'http'"),
    (("exec", "--cmd", "echo 'unclosed"), "exec: cannot split the command \"echo 'unclosed\": No closing quotation"),
])
def test_fab_tasks_refuse_bad_words_in_one_line(tmp_path, words, said):
    # each is refused before a connection is made (the host is loopback all the same)
    res = _fab(*words, cwd=tmp_path)
    assert res.returncode == 2, res.stdout + res.stderr  # a task's bad value: exit 2, as docs/install.md says
    assert res.stderr.strip().splitlines() == [f"clusterctl: error: {said}"], res.stderr


@pytest.mark.parametrize("text, said", [
    ("127.0.0.1:99999", "-H '127.0.0.1:99999': bad port in '127.0.0.1:99999': expected 1-65535"),  # said "jump host"
    ("[::1", "-H '[::1': cannot parse '[::1': expected [user@]host[:port]"),
    ("a b", "-H 'a b': not a host name or IP address: 'a b'"),
    ("bad user@h", "-H 'bad user@h': not a valid user name: 'bad user'"),
    ("h:", "-H 'h:': bad port in 'h:': expected 1-65535"),  # said "-H h:: bad port"
])
def test_a_bad_fab_host_is_one_line_naming_it(text, said):
    from clusterctl.adhoc import split_host
    from clusterctl.errors import ClusterctlError

    with pytest.raises(ClusterctlError) as info:
        split_host(text)
    assert str(info.value) == said


SPEC = "name: t\nssh: {config: none}\nhosts:\n  - address: 10.0.0.1\njob:\n  entrypoint: [python3, train.py]\n"


@pytest.mark.parametrize("argv", [["validate"], ["plan"], ["plan", "--json"]])
def test_an_output_that_cannot_be_written_is_one_line(tmp_path, argv):
    # `> /dev/full`: a 16-26 line traceback ending in OSError, and the interpreter's exit failing on it once more
    spec = tmp_path / "a.yaml"
    spec.write_text(SPEC)
    with open("/dev/full", "w") as full:
        res = subprocess.run([sys.executable, "-m", "clusterctl.cli", *argv, str(spec)], stdout=full,
                             stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL, timeout=60)
    assert (res.returncode, res.stderr) == (1, "clusterctl: error: No space left on device\n")


@pytest.mark.parametrize("argv", [["--help"], ["--version"], ["exec", "--help"], ["top", "--help"]])
def test_help_that_cannot_be_written_fails(argv):
    # argparse drops its print's OSError and exits 0: `clusterctl --help > /dev/full` looked like it had worked
    with open("/dev/full", "w") as full:
        res = subprocess.run([sys.executable, "-m", "clusterctl.cli", *argv], stdout=full, stderr=subprocess.PIPE,
                             text=True, stdin=subprocess.DEVNULL, timeout=60)
    assert (res.returncode, res.stderr) == (1, "clusterctl: error: cannot write the output: No space left on device\n")
    # a usage error still goes to stderr, exit 2
    res = subprocess.run([sys.executable, "-m", "clusterctl.cli", "bogus"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "invalid choice: 'bogus'" in res.stderr


@pytest.mark.parametrize("columns", ["0", "-3", "wide"])
def test_a_terminal_width_of_nothing_still_prints(tmp_path, columns):
    # rich read COLUMNS=0 as a width of nothing: no output and no error message at all
    spec = tmp_path / "a.yaml"
    spec.write_text(SPEC)
    env = {**os.environ, "COLUMNS": columns}
    ok = subprocess.run([sys.executable, "-m", "clusterctl.cli", "validate", str(spec)], capture_output=True,
                        text=True, env=env, stdin=subprocess.DEVNULL, timeout=60)
    assert ok.returncode == 0 and "valid: job t" in ok.stdout, ok.stdout + ok.stderr
    spec.write_text(SPEC + "name: u\n")
    bad = subprocess.run([sys.executable, "-m", "clusterctl.cli", "validate", str(spec)], capture_output=True,
                         text=True, env=env, stdin=subprocess.DEVNULL, timeout=60)
    assert bad.returncode == 2 and bad.stderr.strip().endswith("7:1: name: key given twice"), bad.stderr


def test_a_spec_named_with_control_characters_is_still_one_line_per_problem(tmp_path):
    # the name went to the terminal as it was: a newline split the line, an escape sequence drove the terminal
    spec = tmp_path / "a\nb\x1b[31m.yaml"
    spec.write_text(SPEC + "name: u\n")
    res = subprocess.run([sys.executable, "-m", "clusterctl.cli", "validate", str(spec)], capture_output=True,
                         text=True, stdin=subprocess.DEVNULL, timeout=60)
    assert res.returncode == 2 and res.stderr.count("\n") == 1 and "\x1b" not in res.stderr, repr(res.stderr)
    assert res.stderr.endswith("a\\nb\\x1b[31m.yaml:7:1: name: key given twice\n"), repr(res.stderr)


@pytest.mark.parametrize("columns", ["1", "8"])
def test_a_terminal_of_a_few_columns_still_shows_the_tables_cells(tmp_path, columns):
    # COLUMNS=8: rich drew the plan's tables as empty frames, exit 0
    spec = tmp_path / "a.yaml"
    spec.write_text(SPEC)
    res = subprocess.run([sys.executable, "-m", "clusterctl.cli", "plan", str(spec)], capture_output=True, text=True,
                         env={**os.environ, "COLUMNS": columns}, stdin=subprocess.DEVNULL, timeout=60)
    assert res.returncode == 0 and "10.0.0.1" in res.stdout.replace("…", ""), res.stdout


def test_the_plans_table_shows_ipv6_endpoints_whole(tmp_path):
    # `[fd00::5]:6180` read as a rich markup tag: the endpoint column showed `:6180` (--json had it right)
    spec = tmp_path / "v6.yaml"
    spec.write_text('name: v6\nssh: {config: none}\nhosts: [{address: "fd00::5"}, {address: "abcd::1"}]\n'
                    "job: {entrypoint: [x]}\n")
    res = subprocess.run([sys.executable, "-m", "clusterctl.cli", "plan", str(spec)], capture_output=True, text=True,
                         env={**os.environ, "COLUMNS": "200"}, stdin=subprocess.DEVNULL, timeout=60)
    assert res.returncode == 0, res.stderr
    rows = [line for line in res.stdout.splitlines() if "trainer" in line]
    assert "[fd00::5]:6180" in rows[0] and "[abcd::1]:6180" in rows[1], res.stdout


@pytest.mark.parametrize("argv", [["validate", ""], ["plan", " "], ["exec", "", "--", "true"]])
def test_an_empty_spec_path_is_refused_as_such(argv):
    # `validate ''` said ".:1:1: cannot read spec: is a directory" (Path('') is '.')
    res = subprocess.run([sys.executable, "-m", "clusterctl.cli", *argv], capture_output=True, text=True,
                         stdin=subprocess.DEVNULL, timeout=60)
    assert (res.returncode, res.stderr) == (2, "'':1:1: the spec's path is empty: name a spec file\n")


def test_top_json_lines_end_quietly_when_their_reader_goes_away(tmp_path):
    # `top --json | head -n 1`: "clusterctl: error: Broken pipe", exit 1 (a stream's reader leaving is no error)
    spec = tmp_path / "s.yaml"
    spec.write_text("name: t\nssh: {config: none}\nhosts: [{address: 127.0.0.1, port: 1}]\njob: {entrypoint: [x]}\n")
    proc = subprocess.Popen([sys.executable, "-m", "clusterctl.cli", "top", str(spec), "--json", "--no-gpu",
                             "--interval", "0.5"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            stdin=subprocess.DEVNULL, env={**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")})
    assert json.loads(proc.stdout.readline())["hosts"], "no first view"
    proc.stdout.close()  # as `head -n 1` does
    assert (proc.wait(timeout=60), proc.stderr.read()) == (0, b"")


def test_top_tables_end_quietly_when_their_reader_goes_away(tmp_path):
    # `top | head` (tables one after another, not a terminal): rich's own broken-pipe exit, 1, mid-loop
    spec = tmp_path / "s.yaml"
    spec.write_text("name: t\nssh: {config: none}\nhosts: [{address: 127.0.0.1, port: 1}]\njob: {entrypoint: [x]}\n")
    proc = subprocess.Popen([sys.executable, "-m", "clusterctl.cli", "top", str(spec), "--no-gpu", "--interval", "0.5"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                            env={**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")})
    assert proc.stdout.readline(), "no first view"
    proc.stdout.close()  # as `head -n 1` does
    assert (proc.wait(timeout=60), proc.stderr.read()) == (0, b"")


@pytest.mark.parametrize("command", [["validate"], ["top", "--once", "--no-gpu"]])
def test_an_output_that_cannot_encode_unicode_gets_escapes_not_a_traceback(tmp_path, command):
    # PYTHONIOENCODING=ascii (or a C locale without UTF-8 coercion): rich's UnicodeEncodeError, a traceback
    spec = tmp_path / "ünï.yaml"
    spec.write_text("name: t\nssh: {config: none}\nhosts: [{address: 127.0.0.1, port: 1}]\njob: {entrypoint: [x]}\n")
    res = subprocess.run([sys.executable, "-m", "clusterctl.cli", command[0], str(spec), *command[1:]],
                         capture_output=True, env={**os.environ, "PYTHONIOENCODING": "ascii",
                                                   "XDG_CACHE_HOME": str(tmp_path / "cache")},
                         stdin=subprocess.DEVNULL, timeout=60)
    assert b"Traceback" not in res.stderr, res.stderr.decode()
    if command[0] == "validate":
        assert res.returncode == 0 and b"\\xfcn\\xef.yaml: valid" in res.stdout, res.stdout
    else:  # the header's `\u00b7` as an escape; the host refused: exit 1
        assert res.returncode == 1 and b"\\xb7" in res.stdout, res.stdout
