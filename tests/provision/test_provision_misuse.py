"""`clusterctl provision` given bad or unlucky input, over fake hosts (tests/unit/fakehosts.py): each failure is
one line naming what and where (a table cell, or one error line before any host is touched), never a
traceback, and nothing is left running on a host for the next run to meet."""

import copy
import json
import os
import platform
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from clusterctl.cli import main
from clusterctl.errors import ProvisionError
from clusterctl.provision.runner import HOST_GRACE_S, KILL_AFTER_S, provision

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
from fakehosts import FakeCluster, fake_exe, wait_until  # noqa: E402
from helpers import tiny_wheel  # noqa: E402

WAIT_S = 30.0  # event waits: far above what each takes, so that they hold on a busy machine


def cluster(tmp_path, monkeypatch, section, hosts=2):
    return FakeCluster(tmp_path, hosts=hosts, extra={"provision": section}).everywhere(monkeypatch)


def outcomes(report):
    """{(host label, step): (status, reason)}."""
    return {(h.label, step): (o.status, o.reason) for (h, step), o in report.outcomes.items()}


def run(c, **kw):
    with c.session() as s:
        return provision(s, **kw)


def cli(capsys, *argv):
    """(exit code, stdout, stderr) of `clusterctl ARGV`."""
    code = main([str(a) for a in argv])
    got = capsys.readouterr()
    return code, got.out, got.err


MARK = {"name": "mark", "run": "echo made > marker", "creates": "marker"}


def test_only_given_twice_runs_the_steps_of_both(tmp_path, monkeypatch, capsys):
    """`--only wheelhouse --only commands` ran the commands step alone: the second --only replaced the first."""
    section = {"python": {"requirements": []}, "wheelhouse": {"local": str(tmp_path / "wh")}, "commands": [MARK]}
    c = cluster(tmp_path, monkeypatch, section)
    code, out, err = cli(capsys, "provision", c.spec_path, "--only", "wheelhouse", "--only", "commands")
    assert (code, err) == (0, "")
    assert "wheelhouse" in out and "no pip requirements" not in out  # ok cells carry no reason
    assert [ln for ln in out.splitlines() if " ok in " in ln][0].startswith("2 changed, 0 failed, 2 ok in ")


def test_an_unwritable_cache_is_one_error_before_any_host_is_touched(tmp_path, monkeypatch, capsys):
    c = cluster(tmp_path, monkeypatch, {"commands": [MARK]})
    (tmp_path / "notadir").write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "notadir"))
    code, out, err = cli(capsys, "provision", c.spec_path)
    folder = tmp_path / "notadir" / "clusterctl" / "provision" / c.name
    assert (code, out) == (1, "")
    assert err.strip() == (f"clusterctl: error: cannot write the provisioning logs in {folder}: Not a directory "
                           "(set XDG_CACHE_HOME to a writable directory)")
    assert not (c.home(0) / "marker").exists() and not (c.home(1) / "marker").exists()


@pytest.mark.parametrize("kind", ["fifo", "socket", "symlink to /dev/null"])
def test_a_log_path_that_is_not_a_file_is_one_error_not_a_hang(tmp_path, monkeypatch, capsys, kind):
    """A FIFO at a host's log path waited for a reader forever (the open for writing blocks); a socket or a device
    is no log either. One line, exit 1, no host touched, in well under the test's timeout."""
    import socket

    c = cluster(tmp_path, monkeypatch, {"commands": [MARK]})
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    folder = tmp_path / "cache" / "clusterctl" / "provision" / c.name
    folder.mkdir(parents=True)
    where = folder / "n1.log"
    if kind == "fifo":
        os.mkfifo(where)
    elif kind == "socket":
        sock = socket.socket(socket.AF_UNIX)
        monkeypatch.chdir(folder)  # a socket's path is at most 107 bytes: bound by its relative name
        sock.bind(where.name)
    else:
        where.symlink_to("/dev/null")
    code, out, err = cli(capsys, "provision", c.spec_path)
    assert (code, out) == (1, "")
    assert err.strip() == f"clusterctl: error: cannot write the provisioning logs in {folder}: n1.log: not a regular file"
    assert not (c.home(0) / "marker").exists() and not (c.home(1) / "marker").exists()


def test_a_mesh_key_that_cannot_be_made_is_one_error(tmp_path, monkeypatch):
    (tmp_path / "afile").write_text("")
    c = cluster(tmp_path, monkeypatch, {"ssh_mesh": {"key": str(tmp_path / "afile" / "id_ed25519")}})
    with pytest.raises(ProvisionError) as info:
        run(c)
    assert str(info.value) == f"ssh_mesh key {tmp_path / 'afile' / 'id_ed25519'}: File exists"


def test_a_venv_path_that_is_a_file_names_the_hosts_own_error(tmp_path, monkeypatch):
    """It said "python3 -m venv v failed (is python3-venv installed?)" whatever the cause."""
    c = cluster(tmp_path, monkeypatch, {"python": {"venv": "v", "requirements": []}})
    for i in range(2):
        c.home(i).mkdir(parents=True, exist_ok=True)
        (c.home(i) / "v").write_text("")
    got = outcomes(run(c, only=["python"]))
    for i in range(2):
        assert got[(f"n{i}", "python")] == ("failed", f"python3 -m venv {c.home(i) / 'v'} failed: "
                                                      f"Error: Unable to create directory '{c.home(i) / 'v'}'")


def test_a_python_without_ensurepip_says_to_install_python3_venv(tmp_path, monkeypatch):
    c = cluster(tmp_path, monkeypatch, {"python": {"venv": "v", "requirements": [], "interpreter": "pynovenv"}})
    fake_exe(c.bin, "pynovenv", f"""
        if [ "$1 $2" = "-m venv" ]; then  # what Debian's python3 says without python3-venv (its last line)
            echo "The virtual environment was not created successfully because ensurepip is not"
            echo "available.  On Debian/Ubuntu systems, you need to install the python3-venv"
            echo; echo "    apt install python3.11-venv"; echo; echo "Failing command: $PWD/v/bin/python3"
            exit 1
        fi
        exec {c.bin / 'python3'} "$@"
        """)
    got = outcomes(run(c, only=["python"]))
    assert got[("n0", "python")] == ("failed", f"pynovenv -m venv {c.home(0) / 'v'} failed: no ensurepip: install "
                                               "python3-venv (apt.packages)")


def test_an_unwritable_wheelhouse_fails_its_hosts_in_the_table(tmp_path, monkeypatch):
    (tmp_path / "afile").write_text("")
    section = {"python": {"requirements": ["tinypkg==1.0"]}, "wheelhouse": {"local": str(tmp_path / "afile" / "wh")}}
    c = cluster(tmp_path, monkeypatch, section)
    got = outcomes(run(c))
    for host in ("n0", "n1"):
        status, reason = got[(host, "wheelhouse")]
        assert status == "failed"
        assert reason.startswith(f"cannot write the wheelhouse in {tmp_path / 'afile' / 'wh'}/")
        assert reason.endswith(" (wheelhouse.local): Not a directory")
        assert got[(host, "python")] == ("skipped", "wheelhouse failed")


def test_conflicting_requirements_name_the_conflict_not_pips_help_link(tmp_path, monkeypatch):
    """pip ends a conflict with `ERROR: ResolutionImpossible: for help visit URL`: that was the whole reason."""
    tiny_wheel(tmp_path / "wheels", version="1.0")
    tiny_wheel(tmp_path / "wheels", version="1.1")
    (tmp_path / "index").mkdir()
    section = {"python": {"requirements": ["tinypkg==1.0", "tinypkg==1.1"]},
               "wheelhouse": {"local": str(tmp_path / "wh"), "index_url": (tmp_path / "index").as_uri(),
                              "find_links": ["wheels"]}}
    c = cluster(tmp_path, monkeypatch, section, hosts=1)
    got = outcomes(run(c, only=["wheelhouse"]))
    py = "%d.%d" % sys.version_info[:2]
    assert got == {("n0", "wheelhouse"): (
        "failed", f"pip download for Python {py} {platform.machine()} failed: ERROR: Cannot install tinypkg==1.0 and "
                  "tinypkg==1.1 because these package versions have conflicting dependencies.")}


# a commands step that notes its start and end in the host's `trace` and waits for `go` there in between
WAIT = {"name": "wait", "run": "echo in >> trace; touch started; while [ ! -e go ]; do sleep 0.05; done; "
                               "echo out >> trace", "unless": "false"}


def first_run(c) -> tuple[threading.Thread, list]:
    """A run of `c` in a thread, once its WAIT step has started on n0: (the thread, [its report, once done])."""
    report: list = []
    t = threading.Thread(target=lambda: report.append(run(c)), daemon=True)
    t.start()
    wait_until(lambda: (c.home(0) / "started").exists(), timeout=WAIT_S)
    return t, report


def test_a_second_run_of_the_same_job_at_once_is_refused(tmp_path, monkeypatch):
    """Two runs at once raced on the same hosts: the second saw the venv the first was still creating as made."""
    c = cluster(tmp_path, monkeypatch, {"timeout": 120, "commands": [WAIT]}, hosts=1)
    t, first = first_run(c)
    try:
        with pytest.raises(ProvisionError) as info:
            run(c, check=True)
        assert str(info.value) == (f"another clusterctl provision of {c.name} is running on this controller; "
                                   "run again when it has finished")
    finally:
        (c.home(0) / "go").touch()
        t.join(WAIT_S)
    assert outcomes(first[0]) == {("n0", "commands"): ("changed", "ran wait")}
    assert outcomes(run(c, check=True)) == {("n0", "commands"): ("changed", "ran wait")}  # the lock was let go


def _running(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has ended (whoever reaps it)


def test_a_timed_out_step_leaves_nothing_running_on_the_host(tmp_path, monkeypatch):
    """The controller gave up on the step, the step went on: a hung command (an apt-get holding dpkg's lock)
    met the next run. The host now ends the step's processes HOST_GRACE_S later (SIGKILL KILL_AFTER_S after)."""
    hang = {"name": "hang", "run": "echo $$ > hang.pid; exec sleep 300", "unless": "false"}
    c = cluster(tmp_path, monkeypatch, {"timeout": 1, "commands": [hang]}, hosts=1)
    report = run(c)
    pid = int((c.home(0) / "hang.pid").read_text())
    try:
        assert outcomes(report) == {("n0", "commands"): ("failed", "timed out after 1s (provision.timeout)")}
        wait_until(lambda: not _running(pid), timeout=HOST_GRACE_S + KILL_AFTER_S + WAIT_S)
    finally:
        if _running(pid):
            os.kill(pid, 9)


def test_a_host_log_past_its_limit_is_kept_as_log_1_and_a_new_one_begun(tmp_path, monkeypatch):
    from clusterctl.provision import runner

    monkeypatch.setattr(runner, "LOG_KEEP_BYTES", 1000)
    c = cluster(tmp_path, monkeypatch, {"commands": [{"name": "say", "run": "echo hello", "unless": "false"}]}, hosts=1)
    folder = runner.log_dir(c.name)
    run(c)
    first = (folder / "n0.log").read_text()
    (folder / "n0.log").write_text(first + "x" * 1000 + "\n")  # past the limit: kept once, then begun again
    run(c)
    assert (folder / "n0.log.1").read_text().startswith(first) and len((folder / "n0.log").read_text()) < 1000
    run(c)  # under the limit again: appended to, .1 unchanged
    assert (folder / "n0.log").read_text().count("=== ") == 2 and (folder / "n0.log.1").stat().st_size > 1000



def test_what_one_run_writes_to_a_host_log_is_capped_with_one_line_saying_so(tmp_path, monkeypatch):
    """A host step that printed without end (200 MB) grew its log without bound within the run: the rotation at
    LOG_KEEP_BYTES happens only when a run starts. Past LOG_RUN_BYTES one line says so; the outcome is the same."""
    from clusterctl.provision import runner

    monkeypatch.setattr(runner, "LOG_RUN_BYTES", 1 << 20)
    # n1 prints 6 MB, n0 nothing
    flood = {"name": "flood", "run": 'if [ "$(basename "$HOME")" = n1 ]; then yes hostile output | head -n 400000; fi',
             "unless": "false"}
    c = cluster(tmp_path, monkeypatch, {"commands": [flood]})
    folder = runner.log_dir(c.name)
    notice = ("[commands] clusterctl: the rest of this host's output in this run is left out of its log "
              "(more than 1 MiB); `clusterctl provision --lines` prints all of it")
    for n in (1, 2):  # each run has its own allowance
        report = run(c)
        assert outcomes(report) == {("n0", "commands"): ("changed", "ran flood"), ("n1", "commands"): ("changed", "ran flood")}
        lines = (folder / "n1.log").read_text().splitlines()
        assert lines[-2] == notice and lines.count(notice) == n and lines.count("[commands] hostile output") > 30000 * n
        assert lines[-1].startswith("[commands] => changed ran flood (")  # the controller's own line still is
        assert (folder / "n1.log").stat().st_size < n * ((1 << 20) + 1000)
        assert (folder / "n0.log").read_text().splitlines()[-1].startswith("[commands] => changed ran flood (")



def test_runs_from_two_controllers_take_turns_on_a_host(tmp_path, monkeypatch):
    """The controller's lock is one controller's: a run from another one (another XDG_CACHE_HOME, another
    machine) raced the first on the same hosts. Each step now holds the login's lock on its host: the second
    run's step waits for the first's, and fails in one line when the wait runs past 0.8 x provision.timeout."""
    c = cluster(tmp_path, monkeypatch, {"timeout": 120, "commands": [WAIT]}, hosts=1)
    t, first = first_run(c)
    try:
        monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "other-controller"))
        data = c.spec_path.read_text().replace("timeout: 120", "timeout: 2")
        assert data != c.spec_path.read_text()
        other = tmp_path / "other.yaml"
        other.write_text(data)
        elsewhere = copy.copy(c)
        elsewhere.spec_path = other
        with elsewhere.session() as s:
            got = outcomes(provision(s))
        assert got == {("n0", "commands"): (
            "failed", "another clusterctl provision on this host held its lock (~/.cache/clusterctl/provision.lock) "
                      "for 1.6s; run again when it has finished")}
        second: list = []
        t2 = threading.Thread(target=lambda: second.append(run(c)), daemon=True)
        t2.start()
        time.sleep(0.5)
        assert (c.home(0) / "trace").read_text() == "in\n"  # waiting for the first's step, not running beside it
    finally:
        (c.home(0) / "go").touch()
        t.join(WAIT_S)
    t2.join(WAIT_S)
    assert outcomes(first[0]) == outcomes(second[0]) == {("n0", "commands"): ("changed", "ran wait")}
    assert (c.home(0) / "trace").read_text() == "in\nout\nin\nout\n"


def test_a_wheelhouse_upload_waits_for_another_runs_step_on_its_host(tmp_path, monkeypatch):
    """The uploads ran outside the host's lock: tar writes each wheel in place, so a second controller's upload
    could rewrite a wheel while the first run's pip step was installing from it. The upload now takes the lock too,
    and a wait past 0.8 x provision.timeout fails it in one line, having written nothing."""
    import fcntl

    tiny_wheel(tmp_path / "wheels", version="1.0")
    (tmp_path / "index").mkdir()
    section = {"timeout": 2, "python": {"requirements": ["tinypkg==1.0"]},
               "wheelhouse": {"local": str(tmp_path / "wh"), "index_url": (tmp_path / "index").as_uri(),
                              "find_links": ["wheels"]}}
    c = cluster(tmp_path, monkeypatch, section, hosts=1)
    lock = c.home(0) / ".cache" / "clusterctl" / "provision.lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    with open(lock, "w") as held:  # another run's step, holding the login's lock on the host
        fcntl.flock(held, fcntl.LOCK_EX)
        got = outcomes(run(c, only=["wheelhouse"]))
    assert got == {("n0", "wheelhouse"): (
        "failed", "upload failed: another clusterctl provision on this host held its lock "
                  "(~/.cache/clusterctl/provision.lock) for 1.6s; run again when it has finished")}
    assert not list(c.home(0).rglob("tinypkg-*.whl"))
    got = outcomes(run(c, only=["wheelhouse"]))  # the lock let go: uploaded
    assert got[("n0", "wheelhouse")][0] == "changed" and list(c.home(0).rglob("tinypkg-*.whl"))


def test_a_venv_under_tilde_is_the_one_doctor_checks(tmp_path, monkeypatch, capsys):
    """`venv: ~/jobvenv` made $HOME/~/jobvenv (the tilde quoted), while doctor looked for $HOME/jobvenv."""
    c = cluster(tmp_path, monkeypatch, {"python": {"venv": "~/jobvenv", "requirements": []}}, hosts=1)
    assert outcomes(run(c, only=["python"])) == {("n0", "python"): ("changed", f"create venv {c.home(0) / 'jobvenv'}")}
    assert (c.home(0) / "jobvenv" / "bin" / "python").exists() and not (c.home(0) / "~").exists()
    code, out, err = cli(capsys, "doctor", c.spec_path, "--json")
    venv = json.loads(out)["hosts"]["n0"]["venv"]
    assert (venv["path"], venv["exists"]) == (str(c.home(0) / "jobvenv"), True)


def test_a_creates_guard_under_tilde_holds_on_the_second_run(tmp_path, monkeypatch):
    """`creates: ~/marker` was tested as a file named `~/marker` under the current directory: the command ran on
    every run, and the step failed saying it did not create what it had."""
    command = {"name": "mark", "run": "echo made >> ~/marker", "creates": "~/marker"}
    c = cluster(tmp_path, monkeypatch, {"commands": [command]}, hosts=1)
    assert outcomes(run(c)) == {("n0", "commands"): ("changed", "ran mark")}
    assert outcomes(run(c)) == {("n0", "commands"): ("ok", "")}
    assert (c.home(0) / "marker").read_text() == "made\n"


def _set_section(c, section):
    """Give the fake cluster's spec another provision section (the hosts keep what earlier runs made)."""
    spec = yaml.safe_load(c.spec_path.read_text())
    spec["provision"] = section
    c.spec_path.write_text(yaml.safe_dump(spec, sort_keys=False))


# True when the venv's python has its base interpreter's site-packages on sys.path (what --system-site-packages does)
SEES_SYSTEM_SITE = ("import sys; print(any(p.endswith(('site-packages', 'dist-packages')) and p.startswith(sys.base_prefix)"
                    " and not p.startswith(sys.prefix) for p in sys.path))")


def test_a_changed_system_site_packages_is_applied_to_the_existing_venv(tmp_path, monkeypatch):
    """python.system_site_packages was read only when the venv was made: a venv made with the other setting was left
    as it was, and the step said ok."""
    c = cluster(tmp_path, monkeypatch, {"python": {"venv": "v", "requirements": []}}, hosts=1)
    venv = c.home(0) / "v"
    cfg = venv / "pyvenv.cfg"

    def sees_system_site() -> bool:
        out = subprocess.run([str(venv / "bin" / "python"), "-c", SEES_SYSTEM_SITE], capture_output=True, text=True,
                             timeout=60, check=True).stdout
        return out.strip() == "True"

    assert outcomes(run(c)) == {("n0", "python"): ("changed", f"create venv {venv}")}
    assert not sees_system_site()
    made = cfg.read_text()
    for setting in ("true", "false"):
        _set_section(c, {"python": {"venv": "v", "requirements": [], "system_site_packages": setting == "true"}})
        change = ("changed", f"include-system-site-packages = {setting} in {cfg}")
        before = cfg.read_bytes()
        assert outcomes(run(c, check=True)) == {("n0", "python"): change}
        assert cfg.read_bytes() == before  # --check: nothing changed
        assert outcomes(run(c)) == {("n0", "python"): change}
        assert sees_system_site() == (setting == "true")
        assert outcomes(run(c)) == {("n0", "python"): ("ok", "")}
    assert cfg.read_text() == made  # the other lines of pyvenv.cfg as python -m venv wrote them


def test_a_venv_of_another_python_version_than_the_interpreter_fails_in_one_line(tmp_path, monkeypatch):
    """python.interpreter was read only when the venv was made: a venv of another Python (a python3.9 one, the spec
    now naming python3.11) was said ok, and the job ran the old Python."""
    c = cluster(tmp_path, monkeypatch, {"python": {"venv": "v", "requirements": []}}, hosts=1)
    assert outcomes(run(c)) == {("n0", "python"): ("changed", f"create venv {c.home(0) / 'v'}")}
    cfg = c.home(0) / "v" / "pyvenv.cfg"
    real = cfg.read_text()
    cfg.write_text(re.sub(r"(?m)^version = .*$", "version = 2.7.18", real))  # as if python2.7 -m virtualenv made it
    ours = "%d.%d" % sys.version_info[:2]
    for check in (True, False):
        assert outcomes(run(c, check=check)) == {("n0", "python"): (
            "failed", f"{c.home(0) / 'v'} was made by Python 2.7, python.interpreter python3 is {ours}: provision "
                      "--force makes it again with python3")}
    cfg.write_text(real)
    assert outcomes(run(c)) == {("n0", "python"): ("ok", "")}


def test_a_venv_without_pyvenv_cfg_is_one_line_not_ok(tmp_path, monkeypatch):
    c = cluster(tmp_path, monkeypatch, {"python": {"venv": "v", "requirements": [], "system_site_packages": True}}, hosts=1)
    fake_exe(c.home(0) / "v" / "bin", "python", "exit 0")
    assert outcomes(run(c)) == {("n0", "python"): (
        "failed", f"no pyvenv.cfg in {c.home(0) / 'v'}: not a venv of python3 -m venv (remove it, or provision --force "
                  "to make it again)")}


# The gpu step as a login user with passwordless sudo: its apt part (here already in place) needs root, its pip part
# goes into the user's venv. A fake sudo logs how it was called and marks what runs as another user (FAKE_AS).
GPU_MIXED = {"python": {"venv": "v"}, "cuda": {"version": "12.4", "method": "pip", "driver_check": False},
             "nccl": {"version": "2.21.5", "method": "apt"}}
FAKE_SUDO = """\
    echo "sudo $*" >> "$HOME/sudo.log"
    [ "$1" = -n ] && shift
    if [ "$1" = -u ]; then FAKE_AS=$2; export FAKE_AS; shift 2; fi
    exec "$@"
    """
FAKE_GPU_DPKG_QUERY = """\
    for a in "$@"; do pkg=$a; done
    case $pkg in
        cuda-keyring) printf 'installed 1.1-1' ;;
        libnccl2|libnccl-dev) printf 'installed 2.21.5-1+cuda12.4' ;;
        *) exit 1 ;;
    esac
    """
# the user's venv: its python logs who runs it; `-m pip install` installs, `-` (the satisfied check) reads the marker
FAKE_VENV_PYTHON = """\
    echo "${FAKE_AS:-root} python $1" >> "$HOME/python.log"
    venv=$(dirname "$(dirname "$0")")
    case $1 in
        -m) touch "$venv/installed" ;;
        -) cat >/dev/null; [ -e "$venv/installed" ] || { echo "nvidia-cuda-runtime-cu12 missing"; exit 1; } ;;
    esac
    """


def _gpu_host(tmp_path, monkeypatch, section=GPU_MIXED, apt_mark='echo libnccl2; echo libnccl-dev\n',
              pip_done=False):
    """One host for the gpu step, logged in as alice (uid 4321) with passwordless sudo: its apt part in place (fake
    `dpkg-query`, `apt-mark`; `apt-get` and `dpkg` only log to unexpected.log), the user's venv `v` with a fake
    python (`pip_done`: its CUDA wheels already installed). (cluster, home)."""
    c = cluster(tmp_path, monkeypatch, section, hosts=1)
    home = c.home(0)
    fake_exe(c.bin, "fakepython", FAKE_PYTHON)
    fake_exe(c.bin, "sudo", FAKE_SUDO)
    fake_exe(c.bin, "dpkg-query", FAKE_GPU_DPKG_QUERY)
    fake_exe(c.bin, "apt-mark", apt_mark)
    for tool in ("apt-get", "dpkg"):  # nothing to install: neither may run
        fake_exe(c.bin, tool, f'echo "{tool} $*" >> "$HOME/unexpected.log"; exit 1\n')
    fake_exe(home / "v" / "bin", "python", FAKE_VENV_PYTHON)
    if pip_done:
        (home / "v" / "installed").touch()
    _set_section(c, {**section, "python": {"venv": "v", "interpreter": "fakepython"}})
    c.transport.env.update(FAKE_FACTS=json.dumps({"uid": 4321, "user": "alice", "sudo": "ok", "home": str(home)}),
                           PIP_INDEX_URL="file:///nowhere")  # no network probe for the index
    return c, home


def test_the_gpu_steps_pip_part_runs_as_the_login_user_when_its_apt_part_needs_root(tmp_path, monkeypatch):
    """With apt and pip components, the whole gpu step ran through sudo: pip installed into the user's venv as root,
    leaving root's files in it (and ran the user's venv python as root)."""
    c, home = _gpu_host(tmp_path, monkeypatch)
    assert outcomes(run(c, only=["gpu"])) == {("n0", "gpu"): (
        "changed", "pip install CUDA wheels (nvidia-cuda-runtime-cu12 missing)")}
    sudo = (home / "sudo.log").read_text().splitlines()
    assert sudo[0].startswith(f"sudo -n env CLUSTERCTL_USER_HOME={home} CLUSTERCTL_PIP_UID=4321 bash -c ")
    assert sudo[1:] and all(line.startswith(f"sudo -n -u #4321 env HOME={home} ") for line in sudo[1:]), sudo
    assert (home / "python.log").read_text().splitlines() == ["#4321 python -", "#4321 python -m", "#4321 python -"]
    assert not (home / "unexpected.log").exists()
    assert outcomes(run(c, only=["gpu"])) == {("n0", "gpu"): ("ok", "")}
    # a venv outside the home is root's (the python step made it through sudo): pip stays root's there too
    (home / "sudo.log").unlink()
    _set_section(c, {**GPU_MIXED, "python": {"venv": str(home / "v"), "interpreter": "fakepython"}})
    c.transport.env["FAKE_FACTS"] = json.dumps({"uid": 4321, "user": "alice", "sudo": "ok", "home": "/home/alice"})
    assert outcomes(run(c, only=["gpu"])) == {("n0", "gpu"): ("ok", "")}
    assert (home / "sudo.log").read_text().startswith("sudo -n env CLUSTERCTL_USER_HOME=/home/alice bash -c ")
    assert (home / "python.log").read_text().splitlines()[-1] == "root python -"


def test_the_hold_check_reads_every_held_package_however_long_the_list(tmp_path, monkeypatch):
    """apt_ensure read `apt-mark showhold` through `printf | grep -q` under pipefail: bash's printf writes a line at a
    time, grep's exit at its match cut it off (SIGPIPE), and a held package before the end of the list read as not
    held: `changed: hold libnccl-dev` on a converged host (seen once in a tier run under load). A list longer than a
    pipe's buffer makes that certain; the check now reads the list whole."""
    c, home = _gpu_host(tmp_path, monkeypatch, pip_done=True,
                        apt_mark='case $1 in showhold) echo libnccl-dev; echo libnccl2; seq -f "lib%g" 20000 ;; '
                                 '*) echo "apt-mark $*" >> "$HOME/unexpected.log" ;; esac\n')
    for _ in range(3):
        assert outcomes(run(c, only=["gpu"])) == {("n0", "gpu"): ("ok", "")}
    assert not (home / "unexpected.log").exists()


@pytest.mark.parametrize("driver, ok", [("470.82.01", False), ("550.54.15", True)])
def test_the_driver_check_reads_the_first_of_eight_gpus_driver(tmp_path, monkeypatch, driver, ok):
    """The gpu step's driver check on an 8-GPU host (nvidia-smi prints a line per GPU): the first line is the driver,
    compared with the CUDA version's minimum. (The output is now read whole, not through `| head` under pipefail as
    the hold check was; nvidia-smi writes it at once, so that pipe could not fail in practice.)"""
    c, _ = _gpu_host(tmp_path, monkeypatch, {**GPU_MIXED, "cuda": {**GPU_MIXED["cuda"], "driver_check": True}},
                     pip_done=True)
    fake_exe(c.bin, "nvidia-smi", f'for i in 1 2 3 4 5 6 7 8; do echo "{driver} "; done\n')
    state, detail = outcomes(run(c, only=["gpu"]))[("n0", "gpu")]
    if ok:
        assert (state, detail) == ("ok", "")
    else:
        assert state == "failed" and re.search(rf"CUDA 12\.4 needs NVIDIA driver >= [\d.]+ but this host's driver is "
                                               rf"{re.escape(driver)}$", detail), (state, detail)


def test_a_relative_wheelhouse_local_is_next_to_the_spec_whatever_the_current_directory(tmp_path, monkeypatch):
    tiny_wheel(tmp_path / "wheels")
    (tmp_path / "index").mkdir()
    section = {"python": {"requirements": ["tinypkg==1.0"]},
               "wheelhouse": {"local": "wh", "index_url": (tmp_path / "index").as_uri(), "find_links": ["wheels"]}}
    c = cluster(tmp_path, monkeypatch, section, hosts=1)
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    assert outcomes(run(c, only=["wheelhouse"]))[("n0", "wheelhouse")][0] == "changed"
    assert [p.name for p in (tmp_path / "wh").glob("*/*.whl")] == ["tinypkg-1.0-py3-none-any.whl"]
    assert not (tmp_path / "elsewhere" / "wh").exists()


@pytest.mark.timeout(60)
def test_an_offline_keyring_that_is_a_fifo_is_one_error_not_a_hang(tmp_path, monkeypatch):
    """Offline apt read signed_by with read_bytes(): a FIFO waited for a writer for ever (the online path refused it)."""
    os.mkfifo(tmp_path / "key.gpg")
    source = {"name": "x", "uri": "http://mirror.example/debian", "suite": "bookworm", "components": ["main"],
              "signed_by": str(tmp_path / "key.gpg")}
    c = cluster(tmp_path, monkeypatch, {"apt": {"packages": ["jq"], "offline": True, "sources": [source]}})
    with pytest.raises(ProvisionError) as info:
        run(c, check=True)  # --check: this machine's own apt is the fake hosts' (see the module's docstring)
    assert str(info.value) == f"cannot read apt keyring {tmp_path / 'key.gpg'}: not a file (a FIFO or a socket)"


@pytest.mark.parametrize("broken", ["mesh key", "keyring"])
def test_a_controller_input_that_cannot_be_read_fails_before_any_host_is_touched(tmp_path, monkeypatch, broken):
    """A missing keyring (or a mesh key that cannot be made) was found when its step came: the python step had made
    its venv on every host by then, and the run stopped with no table."""
    (tmp_path / "afile").write_text("")
    section = {"python": {"venv": "v", "requirements": []}}
    if broken == "mesh key":
        section["ssh_mesh"] = {"key": str(tmp_path / "afile" / "id_ed25519")}
        message = f"ssh_mesh key {tmp_path / 'afile' / 'id_ed25519'}: File exists"
    else:
        section["cuda"] = {"version": "12.4", "method": "pip",
                           "repository": {"name": "nv", "uri": "http://x.example/", "signed_by": "missing.gpg"}}
        message = f"cannot read apt keyring {tmp_path / 'missing.gpg'}: No such file or directory"
    c = cluster(tmp_path, monkeypatch, section)
    with pytest.raises(ProvisionError) as info:
        run(c)
    assert str(info.value) == message
    assert not (c.home(0) / "v").exists() and not (c.home(1) / "v").exists()
    assert not (tmp_path / "cache" / "clusterctl" / "provision" / c.name).exists()  # not even a log begun


def test_a_step_script_over_128_kib_runs(tmp_path, monkeypatch):
    """The script was one argument of the host's command line: past Linux's 128 KiB for one argument (an ssh_mesh of
    ~400 hosts, a big keyring) the run stopped with `Argument list too long`, after the earlier steps had run."""
    many = [{"name": f"c{k}", "run": f"echo {k} >> marks # " + "x" * 1000, "unless": f"grep -qx {k} marks"}
            for k in range(150)]  # each one small; the script over 150 KiB
    c = cluster(tmp_path, monkeypatch, {"commands": many})
    got = outcomes(run(c))
    assert [(status, reason[:15]) for status, reason in got.values()] == [("changed", "ran c0; ran c1;")] * 2
    assert (c.home(1) / "marks").read_text() == "".join(f"{k}\n" for k in range(150))
    assert outcomes(run(c)) == {(f"n{i}", "commands"): ("ok", "") for i in range(2)}


# the probe's interpreter: the real facts, overridden by FAKE_FACTS (JSON)
FAKE_PYTHON = """\
    python3 "$@" | python3 -c 'import json, os, sys
    d = json.loads(sys.stdin.read().splitlines()[-1]); d.update(json.loads(os.environ["FAKE_FACTS"])); print(json.dumps(d))'
    """


def test_the_mesh_key_reaches_the_hosts_and_a_shared_hostname_is_pinned_for_nobody(tmp_path, monkeypatch, capsys):
    """Both hosts say they are `box`: each host's key was pinned for that name (ssh takes either key for it)."""
    key = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIFakeHostKeyForTests"
    c = FakeCluster(tmp_path, hosts=2, extra={"provision": {"python": {"interpreter": "fakepython"}, "ssh_mesh": True}},
                    env={"FAKE_FACTS": json.dumps({"host_key": key, "hostname": "box"})}).everywhere(monkeypatch)
    fake_exe(c.bin, "fakepython", FAKE_PYTHON)
    report = run(c, only=["ssh_mesh"])
    assert outcomes(report) == {(f"n{i}", "ssh_mesh"): ("changed", f"create {c.home(i) / '.ssh'}; mesh key; mesh public "
                                                        "key; peers' host keys; authorize mesh key; ssh config block")
                                for i in range(2)}
    ssh = c.home(1) / ".ssh"
    private = (tmp_path / "cache" / "clusterctl" / "mesh" / c.name / "id_ed25519").read_text()
    assert (ssh / f"clusterctl-{c.name}_ed25519").read_text() == private  # on stdin, never in the script
    assert (ssh / f"clusterctl-{c.name}.known_hosts").read_text() == f"127.0.0.1 {key}\n127.0.0.2 {key}\n"
    assert "\nHost 127.0.0.1 127.0.0.2\n" in (ssh / "config").read_text()
    assert ("[ssh_mesh] controller: its hostname box names n1 too: left out of the mesh's known_hosts and ssh config\n"
            in report.log_path(report.hosts[0]).read_text())


def test_a_spec_after_only_is_taken_as_the_spec(tmp_path, capsys):
    # `provision --only apt cluster.yaml`: --only took the spec as a step; argparse then wanted a spec (exit 2)
    from clusterctl import cli

    missing = str(tmp_path / "cluster.yaml")
    assert cli.main(["provision", "--only", "commands", missing, "--check"]) == 2
    assert capsys.readouterr().err.strip() == f"{missing}:1:1: cannot read spec: No such file or directory"
    assert cli.main(["provision", "--only", missing]) == 2  # never every step for an --only that named none
    assert "--only needs a step" in capsys.readouterr().err
    assert cli.main(["provision", "--only", "commands"]) == 2
    assert "provision: give the spec" in capsys.readouterr().err
    assert cli.main(["provision", "--only", "apt", str(tmp_path)]) == 2  # a directory where the spec goes: said
    assert capsys.readouterr().err.strip() == (f"clusterctl: error: provision: {tmp_path} is a directory: give the spec "
                                               "file: clusterctl provision SPEC [--only STEP ...]")
