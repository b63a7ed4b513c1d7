"""The one quoting point: whatever the value, a POSIX shell receives it verbatim and runs nothing."""

import subprocess

import pytest

from clusterctl.quoting import command, join

NASTY = [
    "plain",
    "with space",
    "semi;colon",
    "$(touch /tmp/clusterctl-pwned)",
    "`touch /tmp/clusterctl-pwned`",
    "it's",
    'dq"uote',
    "new\nline",
    "glob*?[a]",
    "$HOME ${PATH}",
    "back\\slash",
    "",
    "-n",
    "tab\there",
    "ünïcödé",
]


def test_argv_round_trips_through_a_real_shell(tmp_path):
    line = join(["printf", "%s\\0"] + NASTY)
    out = subprocess.run(["sh", "-c", line], capture_output=True, check=True).stdout
    assert out.decode().split("\0")[:-1] == NASTY


def test_env_and_cwd_round_trip(tmp_path):
    d = tmp_path / "dir with 'quote' and $x"
    d.mkdir()
    env = {f"V{i}": v for i, v in enumerate(NASTY)}
    script = "import os; print(os.getcwd()); print('\\0'.join(os.environ[f'V{i}'] for i in range(15)), end='')"
    line = command(["python3", "-c", script], env=env, cwd=str(d))
    out = subprocess.run(["sh", "-c", line], capture_output=True, check=True).stdout.decode()
    first, rest = out.split("\n", 1)
    assert first == str(d)
    assert rest.split("\0") == NASTY


def test_bad_env_name_rejected():
    with pytest.raises(ValueError, match="invalid environment variable name: 'A B'"):
        command(["true"], env={"A B": "x"})
