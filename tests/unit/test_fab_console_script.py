"""The `fab` console script clusterctl installs (pyproject's [project.scripts]: clusterctl.fab:fab_main) is Fabric's
`fab` with clusterctl's one-line refusals from its first flag on: Fabric's own script parsed its core flags before
any clusterctl code ran (`--connect-timeout abc` was Invoke's traceback), ran a lone `-- command` without any
fabfile (paramiko, host keys added unseen, a traceback for a host it could not reach), and printed its help with
exit 0 for a command line that named no task. Each test runs the script as users do. No host is asked but
127.0.0.1 on a closed port (1)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FAB = Path(sys.executable).parent / "fab"  # the venv's console script, as `fab` on the PATH
CLOSED = "127.0.0.1:1"


def _fab(*words: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(FAB), *words], capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL,
                          cwd=cwd)


def _one_error(res: subprocess.CompletedProcess, code: int = 1) -> str:
    assert res.returncode == code, res.stdout + res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("clusterctl: error: "), res.stderr[:2000]
    return lines[0].removeprefix("clusterctl: error: ")


def test_the_fab_script_is_clusterctls():
    # an environment whose `fab` is still Fabric's (clusterctl installed before fabric, or fabric reinstalled
    # after it) has none of what follows: say so here rather than in each test
    text = FAB.read_text()
    assert "from clusterctl.fab import fab_main" in text, text


@pytest.mark.parametrize("words, said", [
    (["--connect-timeout", "abc"], "--connect-timeout: a whole number was expected, got 'abc'"),
    (["-t", "1.5"], "-t: a whole number was expected, got '1.5'"),
    (["-T", "abc"], "-T: a whole number was expected, got 'abc'"),
])
def test_a_word_for_fabs_own_number_before_the_task_is_one_line(tmp_path, words, said):
    # was Invoke's ValueError traceback: the core flags are parsed before the fabfile (and its guard) is imported,
    # here in a directory with no fabfile at all
    assert _one_error(_fab("-H", CLOSED, *words, "status", cwd=tmp_path)) == said


def test_a_lone_command_after_a_double_dash_runs_over_clusterctls_connections(tmp_path):
    # was Fabric's executor with no fabfile: paramiko's socket error as a traceback (and any host key added unseen)
    res = _fab("-H", CLOSED, "--", "true", cwd=tmp_path)
    assert res.returncode == 255, res.stdout + res.stderr
    assert res.stderr.strip().splitlines()[-1] == f"clusterctl: error: cannot connect to {CLOSED}: Connection refused"
    assert "Traceback" not in res.stderr


def test_a_lone_command_with_no_hosts_or_none_after_the_dash_is_one_line(tmp_path):
    # were Fabric's NothingToDo traceback, and its help with exit 0
    assert _one_error(_fab("--", "true", cwd=tmp_path)) == \
        "no hosts: give -H host1,host2 or --spec FILE, or run where a cluster.yaml is"
    assert _one_error(_fab("-H", CLOSED, "--", cwd=tmp_path)) == \
        "no command after --: give one (clusterctl-fab -H HOST -- uptime)"


@pytest.mark.parametrize("words", [["-H", CLOSED], ["-H", CLOSED, "-e"], ["-w"], ["-r", str(ROOT)]])
def test_a_command_line_without_a_task_is_one_line_not_help_and_exit_0(words):
    # `fab -H a,b` (the task name forgotten) printed Fabric's help and exited 0, as if something had run
    res = _fab(*words, cwd=ROOT)
    assert _one_error(res) == f"no task given after {' '.join(words)!r}: name one (--list shows them)"
    assert res.stdout == ""


@pytest.mark.parametrize("words, shown", [
    ([], "Core options:"), (["--help"], "Core options:"), (["-h"], "Core options:"),
    (["--list"], "tail-log"), (["-l"], "tail-log"), (["-V"], "Fabric"),
])
def test_fab_alone_help_list_and_version_still_work(words, shown):
    res = _fab(*words, cwd=ROOT)  # the checkout's own fabfile.py, found as Fabric finds it
    assert (res.returncode, res.stderr) == (0, ""), res.stderr
    assert shown in res.stdout


def test_another_directorys_fabfile_is_found_as_fabric_finds_it(tmp_path):
    # the script stays Fabric's `fab`: a project's own fabfile.py (this directory or one above), not clusterctl's
    (tmp_path / "fabfile.py").write_text("from invoke import task\n\n\n@task\ndef hello(c):\n    print('hello')\n")
    (tmp_path / "sub").mkdir()
    res = _fab("hello", cwd=tmp_path / "sub")
    assert (res.returncode, res.stdout, res.stderr) == (0, "hello\n", "")
    assert _one_error(_fab("status", cwd=tmp_path)) == "no task 'status' (see --list)"


def test_fabrics_own_program_refuses_a_missing_task_once_clusterctls_fabfile_is_loaded(tmp_path):
    # `python -m fabric` stays Fabric's program: its core flags are Invoke's, but no_tasks_given runs after the
    # fabfile (and its guard) is imported
    res = subprocess.run([sys.executable, "-m", "fabric", "-r", str(ROOT), "-H", CLOSED], capture_output=True,
                         text=True, timeout=120, stdin=subprocess.DEVNULL, cwd=tmp_path)
    assert _one_error(res) == f"no task given after '-r {ROOT} -H {CLOSED}': name one (--list shows them)"
