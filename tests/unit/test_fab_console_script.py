"""`clusterctl-fab` (clusterctl.fab:main: Fabric's `fab` with clusterctl's fabfile and its one-line refusals from the
first flag on) and plain `fab` (Fabric's own script, which clusterctl does not install over: an uninstall of
clusterctl would remove it) once clusterctl's fabfile is loaded: a word for a core number was Invoke's traceback, and a
command line that named no task printed Fabric's help with exit 0. Each test runs the console script as users do. No
host is asked but 127.0.0.1 on a closed port (1)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent  # the venv's console scripts, as on the PATH
FAB = BIN / "clusterctl-fab"
CLOSED = "127.0.0.1:1"


def _fab(*words: str, cwd: Path, script: Path = FAB) -> subprocess.CompletedProcess:
    return subprocess.run([str(script), *words], capture_output=True, text=True, timeout=120,
                          stdin=subprocess.DEVNULL, cwd=cwd)


def _one_error(res: subprocess.CompletedProcess, code: int = 1) -> str:
    assert res.returncode == code, res.stdout + res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("clusterctl: error: "), res.stderr[:2000]
    return lines[0].removeprefix("clusterctl: error: ")


def test_plain_fab_stays_fabrics_own_script():
    # installing clusterctl's program over it would make `pip uninstall clusterctl` remove Fabric's `fab`
    assert "from fabric.main import program" in (BIN / "fab").read_text()


@pytest.mark.parametrize("words, said", [
    (["--connect-timeout", "abc"], "--connect-timeout: a whole number was expected, got 'abc'"),
    (["-t", "1.5"], "-t: a whole number was expected, got '1.5'"),
    (["-T", "abc"], "-T: a whole number was expected, got 'abc'"),
])
def test_a_word_for_fabs_own_number_before_the_task_is_one_line(tmp_path, words, said):
    # Invoke's ValueError traceback under Fabric's own program (its core flags are parsed before any fabfile is
    # imported), here in a directory with no fabfile at all
    assert _one_error(_fab("-H", CLOSED, *words, "status", cwd=tmp_path)) == said


def test_a_lone_command_after_a_double_dash_runs_over_clusterctls_connections(tmp_path):
    # Fabric's own executor (no fabfile) gives paramiko's socket error as a traceback (and adds any host key unseen)
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
@pytest.mark.parametrize("script", ["clusterctl-fab", "fab"])
def test_a_command_line_without_a_task_is_one_line_not_help_and_exit_0(words, script):
    # `fab -H a,b` (the task name forgotten) printed Fabric's help and exited 0, as if something had run; plain
    # `fab` in the checkout loads its fabfile.py (clusterctl's), whose guard refuses it as clusterctl-fab does
    res = _fab(*words, cwd=ROOT, script=BIN / script)
    assert _one_error(res) == f"no task given after {' '.join(words)!r}: name one (--list shows them)"
    assert res.stdout == ""


@pytest.mark.parametrize("words, shown", [
    ([], "Core options:"), (["--help"], "Core options:"), (["-h"], "Core options:"),
    (["--list"], "tail-log"), (["-l"], "tail-log"), (["-V"], "Fabric"),
])
@pytest.mark.parametrize("script", ["clusterctl-fab", "fab"])
def test_fab_alone_help_list_and_version_still_work(words, shown, script):
    res = _fab(*words, cwd=ROOT, script=BIN / script)  # plain fab: the checkout's own fabfile.py, as Fabric finds it
    assert (res.returncode, res.stderr) == (0, ""), res.stderr
    assert shown in res.stdout


def test_fabrics_own_program_refuses_a_missing_task_once_clusterctls_fabfile_is_loaded(tmp_path):
    # `python -m fabric` stays Fabric's program: its core flags are Invoke's, but no_tasks_given runs after the
    # fabfile (and its guard) is imported
    res = subprocess.run([sys.executable, "-m", "fabric", "-r", str(ROOT), "-H", CLOSED], capture_output=True,
                         text=True, timeout=120, stdin=subprocess.DEVNULL, cwd=tmp_path)
    assert _one_error(res) == f"no task given after '-r {ROOT} -H {CLOSED}': name one (--list shows them)"
