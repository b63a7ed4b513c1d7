"""What a fuzzing pass of `clusterctl-fab` / `fab` found: each bad input is one `clusterctl: error:` line and a
non-zero exit (a task's own bad values exit 2, as docs/install.md says), never a traceback, a silent exit 0 or a
50 MB line. No host is asked: the hosts named are loopback, and every case is refused before a connection.
(The same pass's OpenSSH findings: test_openssh_config_paths.py.)"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parents[2]
HOST = "127.0.0.2"  # never reached: every case is refused before a connection


def _run(argv: list[str], cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL, cwd=cwd,
                          env=env, errors="replace")


def _fab(*words: str, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    """Plain `fab` with the checkout's fabfile (`fab -r /path/to/clusterctl ...`)."""
    return _run([sys.executable, "-m", "fabric", "-r", str(ROOT), *words], cwd, env)


def _clusterctl_fab(*words: str, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    """`clusterctl-fab ...` (the same as `python -m clusterctl.fab ...`)."""
    return _run([sys.executable, "-m", "clusterctl.fab", *words], cwd, env)


PROGRAMS = [pytest.param(_fab, id="fab"), pytest.param(_clusterctl_fab, id="clusterctl-fab")]


def _one_error(res: subprocess.CompletedProcess, code: int = 1) -> str:
    assert res.returncode == code, res.stdout + res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("clusterctl: error: "), res.stderr[:2000]
    return lines[0].removeprefix("clusterctl: error: ")


# ------------------------------------------------------------------------------------------ a. -F/--list-format


@pytest.mark.parametrize("program", PROGRAMS)
@pytest.mark.parametrize("shown", ["bogus", ""])
def test_an_unknown_list_format_names_the_valid_ones(tmp_path, program, shown):
    # was AttributeError: 'ClusterFab' object has no attribute 'list_bogus' (a traceback)
    res = program("-F", shown, "--list", cwd=tmp_path)
    assert _one_error(res) == f"-F/--list-format {shown!r}: give flat, nested or json"


def test_a_known_list_format_still_lists(tmp_path):
    res = _clusterctl_fab("-F", "json", "--list", cwd=tmp_path)
    assert res.returncode == 0 and '"name": "tail-log"' in res.stdout, res.stderr


# ------------------------------------------------------------------------------------------ b. -r not a directory


@pytest.mark.parametrize("kind", ["file", "devnull", "fifo"])
def test_a_search_root_that_is_no_directory_is_one_line(tmp_path, kind):
    # was NotADirectoryError's traceback from Invoke's loader
    root = {"file": tmp_path / "passwd", "devnull": Path("/dev/null"), "fifo": tmp_path / "fifo"}[kind]
    if kind == "file":
        root.write_text("root:x:0:0::/root:/bin/sh\n")
    elif kind == "fifo":
        os.mkfifo(root)
    res = _clusterctl_fab("-r", str(root), "--list", cwd=tmp_path)
    assert _one_error(res) == f"-r {root}: not a directory: give a directory holding a fabfile.py"


# ------------------------------------------------------------------------------------------ c. -f not a mapping


@pytest.mark.parametrize("program", PROGRAMS)
@pytest.mark.parametrize("name, text, kind", [
    ("l.yml", "- a\n", "a list"),
    ("n.yaml", "42\n", "a number"),
    ("s.yaml", '"s"\n', "a string"),
    ("j.json", "[1]\n", "a list"),
])
@pytest.mark.parametrize("words", [["-H", HOST, "status"], ["--list"]])
def test_a_config_file_that_is_no_mapping_is_one_line(tmp_path, program, name, text, kind, words):
    # was AttributeError: 'list' object has no attribute 'items' for a task, and --list took it without a word
    (tmp_path / name).write_text(text)
    res = program("-f", name, *words, cwd=tmp_path)
    assert _one_error(res) == f"-f {name}: holds {kind}, not a mapping of Fabric's settings (key: value)"


def test_an_empty_config_file_is_still_taken(tmp_path):
    (tmp_path / "empty.yaml").write_text("")
    res = _clusterctl_fab("-f", "empty.yaml", "--list", cwd=tmp_path)
    assert res.returncode == 0 and "tail-log" in res.stdout, res.stderr


def test_a_users_fabric_config_that_is_no_mapping_is_one_line(tmp_path):
    # ~/.fabric.yaml is read before the command line is parsed (then program.args itself was an AttributeError)
    home = tmp_path / "home"
    home.mkdir()
    (home / ".fabric.yaml").write_text("- a\n")
    res = _clusterctl_fab("-H", HOST, "status", cwd=tmp_path, env={**os.environ, "HOME": str(home)})
    assert _one_error(res) == (f"Fabric's config file {home / '.fabric.yaml'}: holds a list, not a mapping of "
                               "Fabric's settings (key: value)")


# ------------------------------------------------------------------------------------------ d. -f x.py fails


@pytest.mark.parametrize("program", PROGRAMS)
@pytest.mark.parametrize("text, said", [
    ("x = 1\ny = (\n", "2: SyntaxError: '(' was never closed"),
    ("import sys\n1/0\n", "2: ZeroDivisionError: division by zero"),
    ("def f():\n    raise KeyError('k')\n\nf()\n", "2: KeyError: 'k'"),  # where it raised, in the file
    ("import os\n", "'os' is a module, which can't be used as a config value. (Are you perhaps giving a tasks file "
                    "instead of a config file by mistake?)"),
])
def test_a_python_config_file_that_fails_names_its_line(tmp_path, program, text, said):
    # was the Python traceback of Invoke's exec of the file
    (tmp_path / "conf.py").write_text(text)
    res = program("-f", "conf.py", "-H", HOST, "status", cwd=tmp_path)
    assert _one_error(res) == f"-f conf.py{':' if said[0].isdigit() else ': '}{said}"


# ------------------------------------------------------------------------------------------ e, f. the -S file


@pytest.mark.parametrize("program", PROGRAMS)
def test_an_ssh_config_that_is_not_utf8_names_the_file_and_line(tmp_path, program):
    # was UnicodeDecodeError's traceback from paramiko's reading of it
    (tmp_path / "s").write_bytes(b"Host a\n  User u\n\xff\xfe bad\n")
    res = program("-S", "s", "-H", HOST, "status", cwd=tmp_path)
    assert _one_error(res) == "ssh config s: line 3: not UTF-8 text (byte 0xff)"


def test_a_very_long_bad_ssh_config_line_is_clipped(tmp_path):
    # the whole line was quoted: a 50 MB stderr line for a 50 MB one
    (tmp_path / "s").write_text("x" * 2_000_000 + "\n")
    res = _clusterctl_fab("-S", "s", "-H", HOST, "status", cwd=tmp_path)
    said = _one_error(res)
    assert said.startswith("ssh config s: Unparsable line xxx") and said.endswith("... (2,000,016 characters)")
    assert len(said) < 400


# ------------------------------------------------------------------------------------------ h, i. output, --where


def _stdout_closed(argv: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return _run(["sh", "-c", '"$@" >&-', "sh", *argv], cwd)


@pytest.mark.parametrize("argv", [
    [sys.executable, "-m", "clusterctl.cli", "--help"],  # was an AttributeError traceback (argparse's print)
    [sys.executable, "-m", "clusterctl.fab", "--list"],  # exit 0, the list lost
    [sys.executable, "-m", "clusterctl.fab", "--where"],  # exit 0, the path lost
    [sys.executable, "-m", "fabric", "-r", str(ROOT), "--list"],  # plain fab, once it has imported our fabfile
])
def test_a_closed_stdout_is_one_line_and_a_failure(tmp_path, argv):
    assert _one_error(_stdout_closed(argv, tmp_path)) == "standard output is closed"


def test_where_refuses_words_after_it(tmp_path):
    # `--where extra` printed the directory and exit 0, `extra` dropped
    assert _one_error(_clusterctl_fab("--where", "extra", cwd=tmp_path)) == (
        "--where takes nothing after it, not 'extra': clusterctl-fab --where")
    res = _clusterctl_fab("--where", cwd=tmp_path)
    assert res.returncode == 0 and (Path(res.stdout.strip()) / "fabfile.py").is_file(), res.stderr


# ------------------------------------------------------------------------------------------ j. exit codes


@pytest.mark.parametrize("words, said", [
    (["start", "--port", "abc"], "--port must be a whole number, not 'abc'"),
    (["start", "--name", "a/b"],
     "--name a/b: name: use 1-63 letters, digits, '.', '_' or '-', starting with a letter or digit"),
    (["start", "--remote-dir", ".."], "--remote-dir ..: workspace.remote: must not contain '..'"),
    (["tail-log", "--lines", "abc"], "--lines must be a whole number, not 'abc'"),
    (["tail-log", "--lines", "-3"], "logs: the number of lines must be 0 or more, not -3"),
    (["exec", "--cmd", "true", "--timeout", "0"],
     "exec: --timeout must be more than 0 and at most 604800 seconds, not 0"),
    (["exec", "--cmd", "true", "--timeout", "abc"], "--timeout must be a number of seconds, not 'abc'"),
])
def test_a_tasks_bad_values_all_exit_2_as_documented(tmp_path, words, said):
    # --port abc, --name a/b, --remote-dir .., --lines abc were exit 1; --lines -3 and --timeout 0 exit 2
    assert _one_error(_clusterctl_fab("-H", HOST, *words, cwd=tmp_path), 2) == said
    assert "exit 2" in (ROOT / "docs" / "install.md").read_text()


def test_fabs_own_bad_host_list_stays_exit_1(tmp_path):
    # -H is Fabric's flag, in install.md's exit-1 list (an empty name, a bad port)
    assert _one_error(_clusterctl_fab("-H", f"{HOST},{HOST}", "status", cwd=tmp_path)) == (
        f"-H {HOST},{HOST}: hosts[1]: duplicate host {HOST} (also hosts[0])")


# ------------------------------------------------------------------------------------------ k. -f size


@pytest.mark.parametrize("program", PROGRAMS)
def test_a_config_file_over_1_mib_is_refused_before_it_is_parsed(tmp_path, program):
    # a 20 MB one-line YAML file took 26 s (50 MB: over 150 s) to be parsed by Invoke
    (tmp_path / "big.yaml").write_text("a: " + "x" * (1 << 20) + "\n")
    res = program("-f", "big.yaml", "-H", HOST, "status", cwd=tmp_path)
    assert _one_error(res) == "-f big.yaml: cannot read it: larger than 1024 KiB"


# ------------------------------------------------------------------------------------------ l. -S with a spec


def test_a_spec_without_ssh_config_is_said_to_have_none(tmp_path):
    # was "S.yaml has its own ssh.config" of a spec that names none
    (tmp_path / "cfg").write_text("Host x\n  User u\n")
    (tmp_path / "S.yaml").write_text(f"name: j\nhosts: [{{address: {HOST}}}]\njob: {{entrypoint: [python3, t.py]}}\n")
    res = _clusterctl_fab("-S", "cfg", "status", "--spec", "S.yaml", cwd=tmp_path)
    assert _one_error(res) == "-S: S.yaml has no ssh.config: give -H host1,host2 with -S, or leave it out"


# ------------------------------------------------------------------------------------------ m. fab's own numbers


@pytest.mark.parametrize("value, shown", [
    ("x" * 300, repr("x" * 80 + "... (300 characters)")),  # Python's message cuts the word at 200 characters
    ("12'3", "\"12'3\""),  # Python quotes it with " then
    ("1\"2'3", repr("1\"2'3")),
])
@pytest.mark.parametrize("flag", ["--connect-timeout", "-T"])
def test_a_long_or_quoted_word_for_fabs_own_number_names_the_flag(tmp_path, flag, value, shown):
    # was "a whole number was expected: invalid literal for int() with base 10: 'xxx…" (210 characters of it, no
    # flag named) for a word the message cut short or quoted with "
    res = _clusterctl_fab(flag, value, "-H", HOST, "status", cwd=tmp_path)
    assert _one_error(res) == f"{flag}: a whole number was expected, got {shown}"
