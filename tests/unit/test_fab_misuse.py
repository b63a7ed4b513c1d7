"""The fab tasks given bad or unlucky input: every refusal is one `clusterctl: error:` line per problem and a
non-zero exit, never Fabric's or Invoke's traceback, never a cluster the user did not name. No host is asked:
each is refused before a connection is made (the host, where one is named, is loopback all the same)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from clusterctl.adhoc import AdhocOptions, adhoc_spec
from clusterctl.errors import ClusterctlError
from fakehosts import FakeCluster

ROOT = Path(__file__).resolve().parents[2]


def _run(argv: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL, cwd=cwd)


def _fab(*words: str, cwd: Path) -> subprocess.CompletedProcess:
    """Plain `fab` with the checkout's fabfile (`fab -r /path/to/clusterctl ...`)."""
    return _run([sys.executable, "-m", "fabric", "-r", str(ROOT), *words], cwd)


def _clusterctl_fab(*words: str, cwd: Path) -> subprocess.CompletedProcess:
    """`clusterctl-fab ...` (the same as `python -m clusterctl.fab ...`)."""
    return _run([sys.executable, "-m", "clusterctl.fab", *words], cwd)


def _one_error(res: subprocess.CompletedProcess, code: int = 1) -> str:
    assert res.returncode == code, res.stdout + res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("clusterctl: error: "), res.stderr
    return lines[0].removeprefix("clusterctl: error: ")


def test_an_unclosed_quote_in_entrypoint_is_one_line(tmp_path):
    # was shlex's ValueError through Invoke: a 30-line traceback
    res = _fab("-H", "127.0.0.1", "start", "--entrypoint", "python3 'train.py", cwd=tmp_path)
    assert _one_error(res, 2) == "--entrypoint: cannot split \"python3 'train.py\": No closing quotation"


@pytest.mark.parametrize("hosts, opts, said", [
    # were `<fab -H>:24:5: job.ports.pserver: ...` lines (a YAML file the user never saw), up to four for one --port
    (["h1"], {"pserver_port": 70000}, ["--port 70000: job.ports.pserver: port out of range (1-65535): 70000"]),
    (["h1"], {"pserver_port": 65534}, ["--port 65534: job.ports.master: port out of range (1-65535): 65536"]),
    (["h1", "h1"], {}, ["-H h1,h1: hosts[1]: duplicate host h1 (also hosts[0])"]),
    (["h1"], {"name": "a b", "entrypoint": ""}, [
        "--name 'a b': name: use 1-63 letters, digits, '.', '_' or '-', starting with a letter or digit",
        "--entrypoint '': job.entrypoint: must name a program to run"]),
])
def test_a_value_the_spec_refuses_names_the_option_that_gave_it(hosts, opts, said):
    with pytest.raises(ClusterctlError) as info:
        adhoc_spec(hosts, AdhocOptions(**opts))
    assert str(info.value).splitlines() == said
    assert info.value.exit_code == 1  # adhoc's; the fab tasks make a task option's exit 2 (test_a_refused_port_...)


def test_a_refused_port_is_one_line_from_fab(tmp_path):
    res = _fab("-H", "127.0.0.1", "start", "--port", "0", cwd=tmp_path)
    assert _one_error(res, 2) == "--port 0: job.ports.pserver: port out of range (1-65535): 0"  # a task's bad value


@pytest.mark.parametrize("hosts", ["", ",", " , "])
def test_an_empty_host_list_is_refused_not_replaced_by_this_directorys_spec(tmp_path, hosts):
    # `fab -H "$HOSTS" kill` with HOSTS unset acted on ./cluster.yaml (or the last -H start from here):
    # here that spec is not even valid YAML, so using it at all shows as a spec error (exit 2)
    (tmp_path / "cluster.yaml").write_text("name: [unclosed\n")
    res = _fab("-H", hosts, "kill", cwd=tmp_path)
    assert _one_error(res) == f"-H {hosts!r} names no host: give -H host1,host2"


@pytest.mark.parametrize("hosts", ["127.0.0.1,,127.0.0.2", "127.0.0.1,", ",127.0.0.1", "127.0.0.1, ,127.0.0.2"])
def test_an_empty_name_in_the_host_list_is_refused_not_dropped(tmp_path, hosts):
    # `fab -H "$A,$B" kill` with B unset acted on A alone
    res = _fab("-H", hosts, "kill", cwd=tmp_path)
    assert _one_error(res) == f"-H {hosts!r} has an empty host name: give -H host1,host2"


def test_a_cluster_yaml_that_is_no_file_is_said_not_passed_over(tmp_path):
    # a directory named cluster.yaml was skipped: the task went on to the last `fab -H ... start` from here, or said
    # "no hosts"
    (tmp_path / "cluster.yaml").mkdir()
    res = _fab("status", cwd=tmp_path)
    assert res.returncode == 2 and res.stderr.strip() == "cluster.yaml:1:1: cannot read spec: is a directory", res
    # a spec named in Fabric's config that is not there was passed over the same way
    (tmp_path / "cluster.yaml").rmdir()
    (tmp_path / "conf.yaml").write_text("clusterctl: {spec: mine.yaml}\n")
    res = _fab("-f", str(tmp_path / "conf.yaml"), "status", cwd=tmp_path)
    assert res.returncode == 2 and res.stderr.strip() == "mine.yaml:1:1: cannot read spec: No such file or directory", res


def test_clusterctl_fab_takes_spec_before_the_task_as_documented(tmp_path):
    # README: `clusterctl-fab --spec cluster.yaml provision`; was Invoke's "No idea what '--spec' is!"
    res = _clusterctl_fab("--spec", "missing.yaml", "status", cwd=tmp_path)
    assert res.returncode == 2, res.stdout + res.stderr  # as `clusterctl status missing.yaml`
    assert res.stderr.strip() == "missing.yaml:1:1: cannot read spec: No such file or directory"


PROGRAMS = [pytest.param(_fab, id="fab"), pytest.param(_clusterctl_fab, id="clusterctl-fab")]


@pytest.mark.parametrize("program", PROGRAMS)
def test_a_missing_ssh_config_is_one_line(tmp_path, program):
    # was Fabric's FileNotFoundError traceback from its own -S loading, before any task ran (plain fab's until
    # clusterctl's fabfile guarded Fabric's program when imported)
    res = program("-S", str(tmp_path / "no_config"), "-H", "127.0.0.1", "status", cwd=tmp_path)
    assert _one_error(res) == f"ssh config {tmp_path / 'no_config'}: no such file"


@pytest.mark.parametrize("program", PROGRAMS)
def test_an_ssh_config_paramiko_cannot_parse_is_one_line(tmp_path, program):
    # was paramiko's ConfigParseError traceback
    (tmp_path / "ssh_config").write_text("Host\n")
    res = program("-S", str(tmp_path / "ssh_config"), "-H", "127.0.0.1", "status", cwd=tmp_path)
    assert _one_error(res) == f"ssh config {tmp_path / 'ssh_config'}: Unparsable line Host"


@pytest.mark.parametrize("program", PROGRAMS)
@pytest.mark.parametrize("words, said", [
    # `-i "$KEY"` with KEY unset: the task went on with no key of its own (the ssh config's, ~/.ssh's)
    (["-i", ""], "-i '' names nothing: give a key file, or leave the option out"),
    (["-i", "k1", "-i", " "], "-i ' ' names nothing: give a key file, or leave the option out"),
    # `-S "$CFG"`: was Fabric's FileNotFoundError traceback (fab), `ssh config : no such file` (clusterctl-fab)
    (["-S", ""], "-S '' names nothing: give an ssh config file, or leave the option out"),
    # `-f "$CONF"`: Invoke's UnknownFileType traceback
    (["-f", ""], "-f '' names nothing: give a config file, or leave the option out"),
])
def test_an_empty_file_for_fab_itself_is_refused_not_dropped(tmp_path, program, words, said):
    assert _one_error(program(*words, "-H", "127.0.0.1", "status", cwd=tmp_path)) == said
    # after the task name as well (Invoke takes fab's own flags there too)
    assert _one_error(program("-H", "127.0.0.1", "status", *words, cwd=tmp_path)) == said


@pytest.mark.parametrize("program", PROGRAMS)
def test_a_config_file_fab_cannot_use_is_one_line(tmp_path, program):
    # a missing -f file was skipped without a word; the others were Invoke's tracebacks
    (tmp_path / "bad.yaml").write_text("a: [\n")
    (tmp_path / "conf.txt").write_text("a: 1\n")
    for name, said in [("missing.yaml", "no such file"), (".", "not a file"),
                       ("conf.txt", "not a .yaml, .yml, .json or .py file")]:
        res = program("-f", str(tmp_path / name), "-H", "127.0.0.1", "status", cwd=tmp_path)
        assert _one_error(res) == f"-f {tmp_path / name}: {said}"
    res = program("-f", str(tmp_path / "bad.yaml"), "-H", "127.0.0.1", "status", cwd=tmp_path)
    assert _one_error(res).startswith(f"-f {tmp_path / 'bad.yaml'}: cannot read it: while parsing a flow node ")


@pytest.mark.parametrize("program", PROGRAMS)
def test_fabs_own_numbers_are_checked(tmp_path, program):
    # `-t 0`: Fabric set no timeout at all (its `if timeout:`), the spec's default 10 s was used
    res = program("-t", "0", "-H", "127.0.0.1", "status", cwd=tmp_path)
    assert _one_error(res) == "--connect-timeout must be more than 0 seconds, not 0"
    res = program("-T", "0", "-H", "127.0.0.1:1", "status", cwd=tmp_path)  # `-- cmd` ran with no limit
    assert _one_error(res) == "-T/--command-timeout must be more than 0 seconds, not 0"
    # a word after the task name: Invoke's int() traceback (before the task name: parsed before the fabfile
    # is imported, so plain fab's own traceback stays; see test_a_word_for_a_whole_number_of_fab_itself_...)
    res = program("-H", "127.0.0.1", "status", "--connect-timeout", "soon", cwd=tmp_path)
    assert _one_error(res) == "--connect-timeout: a whole number was expected, got 'soon'"


def test_more_than_one_key_file_is_refused_not_all_but_the_first_dropped(tmp_path):
    # `-i k1 -i k2`: the spec took k1 and k2 was never tried
    res = _fab("-i", "k1", "-i", "k2", "-H", "127.0.0.1", "status", cwd=tmp_path)
    assert _one_error(res) == ("-i: 2 key files (k1, k2): clusterctl's tasks take one; "
                               "put the others in your ssh-agent or ssh config")


@pytest.mark.parametrize("program", PROGRAMS)
@pytest.mark.parametrize("words, said", [
    # were Invoke's own lines, without the prefix: `Flag <_WholeNumber: lines (l) [int]> needed value and was
    # not given one!`, `No idea what '--lines' is!`, `'exec' did not receive required positional arguments: 'cmd'`
    (["tail-log", "--lines"], "-l/--lines needs a value"),
    (["status", "--spec"], "-s/--spec needs a value"),
    (["status", "-S"], "-S/--ssh-config needs a value"),  # fab's own flag, after the task name
    (["status", "--lines"], "status has no option '--lines'"),
    (["stauts"], "no task 'stauts' (see --list)"),
    (["--help", "stauts"], "no task 'stauts' (see --list)"),
    (["exec"], "exec needs --cmd"),
])
def test_a_task_flag_without_its_value_is_one_line(tmp_path, program, words, said):
    assert _one_error(program(*words, cwd=tmp_path)) == said


@pytest.mark.parametrize("words, said", [
    # fab's own flags, parsed before any fabfile is imported: only clusterctl-fab's program can word them
    (["-r"], "-r/--search-root needs a value"),
    (["-H"], "-H/--hosts needs a value"),
    (["--spec"], "--spec needs a value"),
    (["--bogus", "status"], "no option '--bogus'"),
    (["-r", ""], "-r '' names nothing: give a directory holding a fabfile.py, or leave the option out"),
    (["-c", "", "status"], "-c '' names nothing: give a collection name, or leave the option out"),
])
def test_a_core_flag_without_its_value_is_one_line_from_clusterctl_fab(tmp_path, words, said):
    assert _one_error(_clusterctl_fab(*words, cwd=tmp_path)) == said


def test_a_search_root_without_a_fabfile_is_one_line(tmp_path):
    # Invoke's `Can't find any collection named 'fabfile'!`, without the prefix
    missing = tmp_path / "missing"
    for words in (["status"], []):
        res = _clusterctl_fab("-r", str(missing), *words, cwd=tmp_path)
        assert _one_error(res) == f"no 'fabfile' collection (fabfile.py) in {missing} or a directory above it"


def test_plain_fab_with_a_bad_search_root_says_so_without_a_traceback(tmp_path):
    # plain fab's core flags are parsed, and its fabfile looked for, before clusterctl's fabfile is imported:
    # Invoke's own line stays there, but it is one line and exit 1
    for words in (["-r"], ["-r", str(tmp_path / "missing"), "status"]):
        res = _run([sys.executable, "-m", "fabric", *words], tmp_path)
        assert res.returncode == 1 and len(res.stderr.strip().splitlines()) == 1, res.stderr
        assert "Traceback" not in res.stderr, res.stderr


def test_exec_with_an_empty_command_says_how_to_give_one(tmp_path):
    # was the CLI's hint, `clusterctl exec cluster.yaml -- hostname`, which is no fab command line
    res = _fab("-H", "127.0.0.1", "exec", "--cmd", "", cwd=tmp_path)
    assert _one_error(res, 2) == "exec needs a command: exec --cmd 'hostname'"


def test_exec_help_says_the_command_runs_without_a_shell(tmp_path):
    # the help said "a shell command": `exec --cmd "a | b"` ran `a` with the arguments '|' and 'b'
    res = _fab("--help", "exec", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    text = " ".join(res.stdout.split())
    assert "Run a command on every host (no shell: wrap pipes and globs in sh -c '...')" in text, text
    assert "shell command" not in text


def test_start_help_says_which_ports_port_takes(tmp_path):
    # `--port 65534` is refused for the master port, 65536: the help said only "pserver port"
    res = _fab("--help", "start", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    text = " ".join(res.stdout.split())
    assert "pserver port; trainer, master and control ports are the next three (default: 6173)" in text, text


def _fab_here(*words: str) -> int:
    """clusterctl-fab run in this process (the test's fake hosts): its exit code."""
    from clusterctl.fab import main

    try:
        main(list(words))
    except SystemExit as exc:
        return exc.code or 0
    return 0


def test_spec_before_the_task_acts_on_that_spec(tmp_path, monkeypatch, capsys):
    c = FakeCluster(tmp_path).everywhere(monkeypatch)
    monkeypatch.chdir(tmp_path / "ws")  # no cluster.yaml here: only --spec names the cluster
    assert _fab_here("--spec", str(c.spec_path), "status") == 0
    assert capsys.readouterr().out == f"job {c.name} is not running (no state on any host)\n"


def test_provision_of_a_spec_without_a_provision_section_names_the_file(tmp_path, monkeypatch, capsys):
    # was `clusterctl: error: name='fk-…' backend='ssh' slurm=None ssh=SshSpec(...` : the spec object's repr
    c = FakeCluster(tmp_path).everywhere(monkeypatch)
    assert _fab_here("provision", "--spec", str(c.spec_path), "--check") == 1  # as `clusterctl provision`
    assert capsys.readouterr().err.splitlines() == [
        f"clusterctl: error: {c.spec_path} has no provision: section (see docs/provisioning.md)"]


def test_provision_with_only_hosts_says_to_give_a_spec(tmp_path):
    res = _fab("-H", "127.0.0.1", "provision", cwd=tmp_path)
    assert _one_error(res) == ("a spec built from -H has no provision: section: give --spec FILE with one "
                               "(see docs/provisioning.md)")


def test_provision_only_takes_steps_with_spaces_after_the_commas(tmp_path, monkeypatch, capsys):
    # `--only "commands, apt"` was refused as the unknown step ' apt'; now that step is read, and named
    guarded = {"name": "t", "run": "true", "unless": "true"}
    c = FakeCluster(tmp_path, extra={"provision": {"commands": [guarded]}}).everywhere(monkeypatch)
    assert _fab_here("provision", "--spec", str(c.spec_path), "--check", "--only", "commands, apt") == 2  # a usage error
    assert capsys.readouterr().err.splitlines() == [
        "clusterctl: error: --only apt: the spec's provision section has no apt step"]


def test_exec_runs_a_command_that_holds_a_double_dash_as_given(tmp_path, monkeypatch, capsys):
    # `git log -- FILE`, `grep -- -x FILE`: the `--` was taken for the CLI's `exec SPEC [--timeout N] -- CMD`,
    # and `echo -- hi` refused as "exec: unknown option echo" (exit 2)
    c = FakeCluster(tmp_path).everywhere(monkeypatch)
    assert _fab_here("exec", "--spec", str(c.spec_path), "--cmd", "echo -- hi") == 0
    assert sorted(capsys.readouterr().out.splitlines()) == ["[n0] -- hi", "[n1] -- hi"]


@pytest.mark.parametrize("value, code, said", [
    ("soon", 2, "--timeout must be a number of seconds, not 'soon'"),  # as `--port http` (was exit 1)
    ("-1", 2, "exec: --timeout must be more than 0 and at most 604800 seconds, not -1"),  # as `clusterctl exec`
])
def test_exec_refuses_a_timeout_as_the_cli_does(tmp_path, value, code, said):
    res = _fab("-H", "127.0.0.1", "exec", "--timeout", value, "--cmd", "true", cwd=tmp_path)
    assert _one_error(res, code) == said


@pytest.fixture
def exec_calls(monkeypatch) -> list:
    """What clusterctl's exec ran on the hosts: (argv, timeout) per call."""
    import clusterctl.ops.execute as execute

    calls: list = []
    real = execute.execute

    def spy(remote, argv, on_line=None, timeout=None):
        calls.append((list(argv), timeout))
        return real(remote, argv, on_line=on_line, timeout=timeout)

    monkeypatch.setattr(execute, "execute", spy)
    return calls


def test_exec_takes_a_timeout_as_the_cli_does(tmp_path, monkeypatch, capsys, exec_calls):
    # fab's exec had no --timeout: a command that hung on one host held the task forever
    c = FakeCluster(tmp_path).everywhere(monkeypatch)
    assert _fab_here("exec", "--spec", str(c.spec_path), "--timeout", "0.5", "--cmd", "sleep 30") == 124
    assert exec_calls == [(["sleep", "30"], 0.5)]


def test_fabs_connect_timeout_bounds_the_connections_to_h_hosts(monkeypatch):
    # `fab --connect-timeout 2 -H ...` was ignored: a host that did not answer took the spec's default, 10 s
    import clusterctl.commands.lifecycle as lifecycle

    seen = []
    monkeypatch.setattr(lifecycle, "run_status", lambda spec: seen.append(spec.ssh.connect_timeout) or 0)
    assert _fab_here("--connect-timeout", "2", "-H", "127.0.0.1", "status") == 0
    assert _fab_here("-H", "127.0.0.1", "status") == 0
    assert seen == [2.0, 10.0]


def test_a_word_for_a_whole_number_of_fab_itself_is_one_line(tmp_path):
    # was Invoke's ValueError traceback from its own parsing of the number
    res = _clusterctl_fab("--connect-timeout", "soon", "-H", "127.0.0.1", "status", cwd=tmp_path)
    assert _one_error(res) == "--connect-timeout: a whole number was expected, got 'soon'"


def test_an_option_for_h_hosts_is_refused_for_this_directorys_spec(tmp_path, monkeypatch, capsys):
    # `fab kill --name j1` where ./cluster.yaml names another job stopped that other job: --name was dropped
    c = FakeCluster(tmp_path).everywhere(monkeypatch)
    monkeypatch.chdir(tmp_path)  # FakeCluster's spec is ./cluster.yaml
    assert _fab_here("kill", "--name", "j1") == 1
    assert capsys.readouterr().err.splitlines() == [
        f"clusterctl: error: --name: for -H hosts only, not for {c.spec_path.name}: give -H host1,host2 with it"]
    assert _fab_here("start", "--spec", str(c.spec_path), "--port", "7000", "--workspace", ".") == 1
    assert capsys.readouterr().err.splitlines() == [
        f"clusterctl: error: --workspace, --port: for -H hosts only, not for {c.spec_path}: give -H host1,host2 with it"]


def test_an_option_for_h_hosts_is_refused_for_the_last_start_from_here(tmp_path, monkeypatch, capsys):
    # `fab -H a,b start --name j1; fab -H a,b start --name j2 --port 7200; fab kill --name j1` stopped j2
    from clusterctl.fabfile import _remembered

    c = FakeCluster(tmp_path).everywhere(monkeypatch)
    here = tmp_path / "here"
    here.mkdir()
    monkeypatch.chdir(here)
    _remembered(str(here)).write_text(c.spec_path.read_text())  # as `fab -H ... start` leaves it
    assert _fab_here("kill", "--name", "j1") == 1
    assert capsys.readouterr().err.splitlines() == [
        "clusterctl: error: --name: for -H hosts only, not for the last `fab -H ... start` from here: "
        "give -H host1,host2 with it"]
    assert _fab_here("kill") == 0  # without it: the remembered job
    assert capsys.readouterr().out == f"job {c.name} is not running\n"


def test_hosts_and_a_spec_together_are_refused(tmp_path, monkeypatch, capsys):
    # the spec won and -H was dropped without a word
    c = FakeCluster(tmp_path).everywhere(monkeypatch)
    assert _fab_here("-H", "127.0.0.1", "kill", "--spec", str(c.spec_path)) == 1
    assert capsys.readouterr().err.splitlines() == [
        f"clusterctl: error: -H 127.0.0.1 and --spec {c.spec_path} name two clusters: give one of them"]


@pytest.mark.parametrize("task", [["status"], ["tail-log"], ["kill"], ["doctor"], ["dispatch"], ["exec", "--cmd", "true"]])
def test_an_empty_known_hosts_is_refused_not_dropped(tmp_path, task):
    # `--known-hosts "$KH"` with KH unset checked host keys against ~/.ssh/known_hosts (and with --accept-new
    # recorded them there) without a word: the option was dropped as if not given
    res = _fab("-H", "127.0.0.1", *task, "--known-hosts", "", cwd=tmp_path)
    assert _one_error(res, 2) == "--known-hosts '' names no file: give a known_hosts file, or leave the option out"


@pytest.mark.parametrize("option, said", [
    ("--port", "--port must be a whole number, not ''"),  # was the default port, 6173
    ("--spec", "--spec '' names no file: give --spec cluster.yaml"),  # was ./cluster.yaml's job (not valid YAML here)
])
def test_another_empty_option_is_refused_not_dropped(tmp_path, option, said):
    (tmp_path / "cluster.yaml").write_text("name: [unclosed\n")
    res = _fab(*(["-H", "127.0.0.1"] if option == "--port" else []), "start", option, "", cwd=tmp_path)
    assert _one_error(res, 2) == said


def test_tail_log_lines_is_a_whole_number_option(tmp_path):
    # the help said `-l STRING, --lines=STRING`
    res = _fab("--help", "tail-log", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert "-l INT, --lines=INT" in res.stdout, res.stdout
    for words in (["--lines", "x"], ["-l", "1.5"], ["--lines="]):  # Invoke's int() of them: a traceback
        assert _one_error(_fab("-H", "127.0.0.1", "tail-log", *words, cwd=tmp_path), 2) == (
            f"--lines must be a whole number, not {words[-1].removeprefix('--lines=')!r}")


def test_tail_log_lines_takes_a_number(monkeypatch):
    import clusterctl.commands.lifecycle as lifecycle

    seen = []
    monkeypatch.setattr(lifecycle, "run_logs", lambda spec, lines, follow: seen.append(lines) or 0)
    assert _fab_here("-H", "127.0.0.1", "tail-log", "--lines", "3") == 0
    assert _fab_here("-H", "127.0.0.1", "tail-log") == 0
    assert seen == [3, 10]


def test_starting_a_running_job_again_says_to_stop_it_with_fab_kill(tmp_path, monkeypatch, capsys):
    # the hint was the CLI's, `(clusterctl stop)`: no fab command
    c = FakeCluster(tmp_path, files={"train.py": "import time\ntime.sleep(60)\n"}).everywhere(monkeypatch)
    monkeypatch.chdir(tmp_path)  # FakeCluster's spec is ./cluster.yaml: `fab kill` stops it
    try:
        assert _fab_here("start") == 0
        capsys.readouterr()
        assert _fab_here("start") == 1
        assert _first_error(capsys) == f"job {c.name} is already running; stop it first (fab kill):"
        assert _fab_here("start", "--spec", str(c.spec_path)) == 1
        assert _first_error(capsys) == f"job {c.name} is already running; stop it first (fab kill --spec {c.spec_path}):"
    finally:
        assert _fab_here("kill") == 0


def _first_error(capsys) -> str:
    """The first `clusterctl: error:` line on stderr (after the progress lines), without its prefix."""
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("clusterctl: error: ")]
    return lines[0].removeprefix("clusterctl: error: ") if lines else ""


@pytest.mark.parametrize("host, said", [
    # were taken as the host alone (port 22, or the ssh config's): the ':' dropped without a word; then said
    # `-H h:: bad port ...`, the colon of `h:` doubled by the one after the value
    ("h:", "-H 'h:': bad port in 'h:': expected 1-65535"),
    ("u@h:", "-H 'u@h:': bad port in 'u@h:': expected 1-65535"),
    ("[::1]:", "-H '[::1]:': bad port in '[::1]:': expected 1-65535"),
    ("h:\u00b2", "-H 'h:\u00b2': bad port in 'h:\u00b2': expected 1-65535"),  # was int()'s own error
    ("h:0", "-H 'h:0': bad port in 'h:0': expected 1-65535"),
    (":22", "-H ':22': not a host name or IP address: ''"),
    ("h1,h:", "-H 'h:': bad port in 'h:': expected 1-65535"),  # the host at fault, not the whole list
])
def test_a_host_with_an_empty_or_bad_port_is_refused_by_name(host, said, capsys):
    assert _fab_here("-H", host, "status") == 1
    assert capsys.readouterr().err.splitlines() == [f"clusterctl: error: {said}"]


@pytest.mark.parametrize("host, address, port", [("[::1]:2222", "::1", 2222), ("[::1]", "::1", None),
                                                 ("::1", "::1", None), ("u@h:2222", "h", 2222), ("h", "h", None)])
def test_host_forms_that_stay(host, address, port):
    from clusterctl.adhoc import AdhocOptions, adhoc_spec

    entry = adhoc_spec([host], AdhocOptions()).hosts[0]
    assert (entry.address, entry.port) == (address, port)


@pytest.mark.parametrize("program", PROGRAMS)
@pytest.mark.parametrize("where", [[], ["status"]])
def test_an_identity_flag_with_no_value_is_refused_not_dropped(tmp_path, program, where):
    # `fab -H h status -i` (a key file meant to follow): the task went on with no key; `clusterctl-fab -i`: help, exit 0
    res = program("-H", "127.0.0.1", *where, "-i", cwd=tmp_path)
    assert _one_error(res) == "-i needs a value: give a key file, or leave the option out"


@pytest.mark.parametrize("program", PROGRAMS)
@pytest.mark.parametrize("flag", ["--prompt-for-login-password", "--prompt-for-passphrase",
                                  "--prompt-for-sudo-password"])
def test_fabs_password_prompts_are_refused_before_they_ask(tmp_path, program, flag):
    # was getpass's prompt (EOFError's traceback without a terminal), then a password no task used
    res = program("-H", "127.0.0.1", "status", flag, cwd=tmp_path)
    assert _one_error(res) == (f"{flag}: clusterctl never takes a password: use a key (-i, your ssh config or the "
                               "ssh-agent), and passwordless (NOPASSWD) sudo on the hosts")
    assert "assword" not in res.stdout


@pytest.mark.parametrize("words, said", [
    # the spec sets no identity_file: "has its own ssh.identity_file" was said of it
    (["-i", "k1"], "-i: {where} has no ssh.identity_file: give -H host1,host2 with -i, or leave it out"),
    (["-S", "ssh_config"], "-S: {where} has its own ssh.config: give -H host1,host2 with -S, or leave it out"),
    (["-t", "3"], "--connect-timeout: {where} has its own ssh.connect_timeout: give -H host1,host2 with "
                  "--connect-timeout, or leave it out"),
    (["-i", "k1", "-t", "3"], "-i, --connect-timeout: {where} has no ssh.identity_file and its own "
                              "ssh.connect_timeout: give -H host1,host2 with -i, --connect-timeout, or leave them out"),
])
def test_fabs_connection_flags_that_differ_from_the_spec_are_refused_not_dropped(tmp_path, monkeypatch, capsys,
                                                                                words, said):
    # `fab -i ~/.ssh/other --spec cluster.yaml status` connected with the spec's key: -i was dropped without a word
    c = FakeCluster(tmp_path).everywhere(monkeypatch)
    (tmp_path / "ssh_config").write_text("Host *\n")
    monkeypatch.chdir(tmp_path)
    assert _fab_here(*words, "--spec", str(c.spec_path), "status") == 1
    assert capsys.readouterr().err.splitlines() == ["clusterctl: error: " + said.format(where=c.spec_path)]
    assert _fab_here(*words, "status") == 1  # ./cluster.yaml
    assert capsys.readouterr().err.splitlines() == ["clusterctl: error: " + said.format(where=c.spec_path.name)]


def test_fabs_connection_flags_that_say_what_the_spec_says_are_taken(tmp_path, monkeypatch, capsys):
    # `fab -S cfg -H a,b start` then `fab -S cfg status` from the same directory: the remembered spec has -S's config
    from clusterctl.fabfile import _remembered

    c = FakeCluster(tmp_path).everywhere(monkeypatch)
    here = tmp_path / "here"
    here.mkdir()
    monkeypatch.chdir(here)
    (here / "ssh_config").write_text("Host *\n")
    (here / "key").write_text("")
    spec = yaml.safe_load(c.spec_path.read_text())
    spec["ssh"].update(config="ssh_config", identity_file="key", connect_timeout=3)
    _remembered(str(here)).write_text(yaml.safe_dump(spec))
    assert _fab_here("-S", "ssh_config", "-i", str(here / "key"), "-t", "3", "status") == 0, capsys.readouterr().err
    assert capsys.readouterr().out == f"job {c.name} is not running (no state on any host)\n"
    assert _fab_here("-S", "ssh_config", "-t", "4", "status") == 1
    assert capsys.readouterr().err.splitlines() == [
        "clusterctl: error: --connect-timeout: the last `fab -H ... start` from here has its own ssh.connect_timeout: "
        "give -H host1,host2 with --connect-timeout, or leave it out"]


def test_a_command_after_a_double_dash_runs_on_every_host_through_a_shell(tmp_path, monkeypatch, capsys,
                                                                          exec_calls):
    # `fab -H a,b -- CMD` was Fabric's: one paramiko connection per host, one host after another, adding any host
    # key it had not seen (AutoAddPolicy), and a traceback for a host it could not reach
    c = FakeCluster(tmp_path).everywhere(monkeypatch)
    assert _fab_here("--spec", str(c.spec_path), "--", "echo hi there | tr a-z A-Z") == 0
    assert sorted(capsys.readouterr().out.splitlines()) == ["[n0] HI THERE", "[n1] HI THERE"]
    assert _fab_here("--spec", str(c.spec_path), "-T", "1", "--", "sleep 30") == 124  # fab's -T: exec's --timeout
    assert exec_calls == [(["sh", "-c", "echo hi there | tr a-z A-Z"], None), (["sh", "-c", "sleep 30"], 1.0)]
    assert _fab_here("--spec", str(c.spec_path), "--", "exit 3") == 3


def test_a_command_after_a_double_dash_with_no_hosts_is_one_line(tmp_path):
    # was Fabric's NothingToDo traceback (Fabric's own program's, plain `fab` and `python -m fabric`, still is: it
    # skips every fabfile, clusterctl's executor with it, for a lone `-- command`)
    res = _clusterctl_fab("--", "true", cwd=tmp_path)
    assert _one_error(res) == "no hosts: give -H host1,host2 or --spec FILE, or run where a cluster.yaml is"


def test_a_command_after_a_double_dash_to_an_unreachable_host_is_one_line(tmp_path):
    res = _clusterctl_fab("-H", "127.0.0.1:1", "--", "true", cwd=tmp_path)
    assert res.returncode == 255, res.stderr
    assert res.stderr.strip().splitlines()[-1] == "clusterctl: error: cannot connect to 127.0.0.1:1: Connection refused"
    assert "Traceback" not in res.stderr


@pytest.mark.parametrize("words, said", [
    (["start", "-r", "x", "--entrypoint", "python3 'train.py"],
     "--entrypoint: cannot split \"python3 'train.py\": No closing quotation"),
    (["exec", "-c", "echo 'x"], "exec: cannot split the command \"echo 'x\": No closing quotation"),
])
def test_a_tasks_own_short_options_are_the_tasks(tmp_path, words, said):
    # `start -r DIR` and `exec -c CMD` (the tasks' own short options, as their help shows them) were taken for
    # Fabric's -r (search root) and -c (collection): "no 'fabfile' collection (fabfile.py) in <cwd>"
    assert _one_error(_clusterctl_fab("-H", "127.0.0.1", *words, cwd=tmp_path), 2) == said


def test_a_start_that_fails_does_not_replace_the_hosts_remembered_here(tmp_path, monkeypatch, capsys):
    """`fab -H a,b start` (running), then `fab -H c,d start` that fails: later tasks from here reached c,d, whose start
    had failed, instead of the running job on a,b. A -H spec is remembered once its job has started."""
    from clusterctl.fabfile import _remembered
    from fakehosts import FaultyTransport, free_port_base

    port = str(free_port_base(16))

    c = FakeCluster(tmp_path)
    here = tmp_path / "here"
    here.mkdir()
    (here / "train.py").write_text(  # a -H job runs pservers (seed 000's shape): they listen on their port
        "import os, socket, time\n"
        "if os.environ['TRAINING_ROLE'] == 'PSERVER':\n"
        "    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
        "    s.bind(('127.0.0.1', int(os.environ['PADDLE_PORT']))); s.listen()\n"
        "time.sleep(30)\n")
    monkeypatch.chdir(here)
    c.everywhere(monkeypatch, transport=FaultyTransport(c.transport, down=("n1",)))
    assert _fab_here("-H", "127.0.0.1,n1", "start", "--entrypoint", "python3 train.py", "--name", "j2",
                     "--port", port) == 1
    assert not _remembered(str(here)).exists()
    c.everywhere(monkeypatch)
    assert _fab_here("-H", "127.0.0.1", "start", "--entrypoint", "python3 train.py", "--name", "j1",
                     "--port", port) == 0
    before = _remembered(str(here)).read_text()
    assert "j1" in before
    c.everywhere(monkeypatch, transport=FaultyTransport(c.transport, down=("n1",)))
    assert _fab_here("-H", "127.0.0.1,n1", "start", "--entrypoint", "python3 train.py", "--name", "j2",
                     "--port", port) == 1
    assert _remembered(str(here)).read_text() == before
    c.everywhere(monkeypatch)
    capsys.readouterr()
    assert _fab_here("kill") == 0  # the running job, from what was remembered
    assert capsys.readouterr().out.startswith("job j1 stopped on 1 host(s)")


def test_a_home_that_is_not_a_directory_and_a_reader_that_goes_away_are_no_traceback(tmp_path):
    """HOME=/dev/null: Invoke's look for ~/.fabric.yaml ended in NotADirectoryError's traceback before any task ran;
    `clusterctl-fab --list | head -1`: BrokenPipeError's."""
    import os

    res = subprocess.run([sys.executable, "-m", "clusterctl.fab", "--list"], capture_output=True, text=True,
                         timeout=120, cwd=tmp_path, env={**os.environ, "HOME": "/dev/null"})
    assert _one_error(res) == ("cannot look for Fabric's config file /dev/null/.fabric.yaml: Not a directory "
                               "(HOME=/dev/null)")
    listing = subprocess.Popen([sys.executable, "-m", "clusterctl.fab", "--list"], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, cwd=tmp_path)
    assert listing.stdout.readline().strip() == b"Available tasks:"
    listing.stdout.close()  # as `head -1` does
    assert (listing.wait(timeout=120), listing.stderr.read()) == (0, b"")


@pytest.mark.parametrize("argv", [["--list"], ["--help"], ["--version"], ["--where"]])
def test_listing_to_a_full_disk_is_one_line_and_exit_1(tmp_path, argv):
    # `clusterctl-fab --list >/dev/full`: Invoke's print raised OSError (ENOSPC) as a traceback
    with open("/dev/full", "w") as full:
        res = subprocess.run([sys.executable, "-m", "clusterctl.fab", *argv], stdout=full, stderr=subprocess.PIPE,
                             text=True, timeout=120, cwd=tmp_path)
    assert (res.returncode, res.stderr) == (1, "clusterctl: error: cannot write the output: No space left on device\n")


@pytest.mark.parametrize("rest", [["--"], ["--", ""], ["--", " ", ""]])
def test_a_double_dash_with_no_command_after_it_is_refused(tmp_path, rest):
    # Fabric printed its help and exited 0, having run nothing; `clusterctl exec` refuses the same in one line
    res = subprocess.run([sys.executable, "-m", "clusterctl.fab", "-H", "n1.invalid", *rest], capture_output=True,
                         text=True, timeout=120, cwd=tmp_path, stdin=subprocess.DEVNULL)
    assert _one_error(res) == "no command after --: give one (clusterctl-fab -H HOST -- uptime)" and res.stdout == ""


def test_a_problem_the_plan_finds_in_an_h_list_names_no_line_of_a_file(tmp_path):
    # `<fab -H>:6:3: hosts[1]: ...`: a line and column in a YAML file the user never saw
    res = subprocess.run([sys.executable, "-m", "clusterctl.fab", "-H", "a.invalid,A.INVALID", "status"],
                         capture_output=True, text=True, timeout=120, cwd=tmp_path, stdin=subprocess.DEVNULL)
    assert _one_error(res, code=2).startswith("-H: hosts[1]: A.INVALID and hosts[0] (a.invalid) both resolve to "
                                             "a.invalid: ")


@pytest.mark.parametrize("argv, said", [
    (["-H", "a.invalid", "-H", "b.invalid", "status"], "-H given twice: give it once (-H a,b)"),
    (["--hosts=a.invalid", "-H", "b.invalid", "status"], "-H given twice: give it once (-H a,b)"),
    (["--spec", "x.yaml", "--spec=y.yaml", "status"], "--spec given twice: give it once (--spec X)"),
])
def test_a_core_option_given_twice_is_refused_not_taken_for_a_task(tmp_path, argv, said):
    # Invoke took the second value for a task name: "no task 'b.invalid' (see --list)"
    res = subprocess.run([sys.executable, "-m", "clusterctl.fab", *argv], capture_output=True, text=True,
                         timeout=120, cwd=tmp_path, stdin=subprocess.DEVNULL)
    assert _one_error(res) == said


def test_exec_help_is_the_tasks_help_not_a_command_run_on_every_host(tmp_path):
    """`clusterctl-fab -H h exec --help` (or `-h`): Invoke took the flag for exec's command, and `--help` ran on every
    host (bash's usage from each); every other task's `--help` was already its help."""
    for flag in ("--help", "-h"):
        res = _clusterctl_fab("-H", "h.invalid", "exec", flag, cwd=tmp_path)
        assert res.returncode == 0 and res.stdout.startswith("Usage: fab [--core-opts] exec [--options]"), res
        assert "--cmd=STRING" in res.stdout and res.stderr == ""
    # plain `fab` (its own parser): refused in one line, nothing run
    assert _one_error(_fab("-H", "h.invalid", "exec", "--help", cwd=tmp_path), 2) == (
        "exec: --help is not a command to run on every host; exec's help: fab --help exec")
