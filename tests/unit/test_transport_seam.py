"""The transport seam: Result's typed outcome, the group result and the group exception carrying every host,
the transport chosen where a session is built (and the one default a test can set), the fake a real
Transport, the handshake gate, the OpenSSH argv's login signal and control socket, and the transports
importing nothing above them (neither remote, nor the plan, nor the spec)."""

import ast
import shlex
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from clusterctl.errors import CannotConnect, ClusterctlError, CommandFailed, RemoteError, TimedOut
from clusterctl.plan import Host
from clusterctl.remote import Remote, Result, SshOptions
from clusterctl.transport import openssh
from clusterctl.transport import default
from clusterctl.transport.base import GroupException, GroupResult, Transport, timed_out_result, unreachable_result
from clusterctl.transport.gate import HandshakeGate, gate_key
from clusterctl.transport.local import LocalTransport
from clusterctl.transport.process import ProcessRun, ProcessTransport

H = Host("10.0.0.7", 22, "root", 0)
JUMPED = Host("10.0.1.5", 22, "root", 1, jump=("ops@bastion:2200",))


# ------------------------------------------------------------------------------------------ Result


def test_result_knows_unreachable_and_timed_out_from_the_transport():
    down = unreachable_result(H, "true", "cannot connect to 10.0.0.7: Connection refused", 0.1)
    late = timed_out_result(H, "sleep 9", 2, 2.0)
    assert (down.exit_code, down.unreachable, down.timed_out, down.answered) == (255, True, False, False)
    assert (late.exit_code, late.unreachable, late.timed_out, late.answered) == (124, False, True, False)
    assert late.stderr == "timed out after 2s running sleep 9"
    assert isinstance(down.error(), CannotConnect) and str(down.error()) == down.stderr
    assert isinstance(late.error(), TimedOut) and late.error().host == "10.0.0.7"
    assert isinstance(down.error(), ClusterctlError)  # old `except ClusterctlError` still catch it


def test_result_built_by_hand_reads_as_before():
    """Results made without a transport's cause (tests, other code) keep the exit-code reading."""
    assert Result(H, "c", 255, "", "ssh: Connection refused", 0.1).unreachable
    assert not Result(H, "c", 255, "partial", "", 0.1).unreachable  # it ran and printed: the command's own 255
    assert Result(H, "c", 124, "", "timed out after 3s running c", 0.1).timed_out
    assert not Result(H, "c", 124, "", "the command's own timeout(1)", 0.1).timed_out
    failed = Result(H, "c", 3, "", "oops\n", 0.1)
    assert failed.answered and isinstance(failed.error(), CommandFailed) and failed.error().exit_code == 3
    assert str(failed.error()) == "10.0.0.7: exit 3: oops"
    assert Result(H, "c", 0, "{}", "", 0.1).error() is None


def test_a_command_exiting_124_itself_is_not_our_deadline(tmp_path):
    with Remote([H], SshOptions(), transport=LocalTransport(tmp_path)) as remote:
        res = remote.run("exit 124", check=False)[H]
    assert (res.exit_code, res.timed_out, res.answered) == (124, False, True)


# ------------------------------------------------------------------------------------------ group failures


def test_a_group_failure_carries_every_hosts_result_and_typed_error(tmp_path):
    hosts = [Host(f"n{i}", 22, "u", i) for i in range(3)]
    with Remote(hosts, SshOptions(), transport=LocalTransport(tmp_path)) as remote:
        with pytest.raises(RemoteError) as info:
            remote.run('case "$HOME" in */n0) echo fine;; */n1) echo bad >&2; exit 4;; *) sleep 5;; esac',
                       timeout=1, what="probe")
    err = info.value
    assert isinstance(err, GroupException) and isinstance(err.result, GroupResult)
    assert list(err.result) == hosts  # the group result, in the hosts' order
    assert list(err.result.succeeded) == [hosts[0]] and list(err.result.failed) == hosts[1:]
    assert err.result.failed == err.failed and err.result.succeeded == err.results
    assert set(err.outcomes) == set(hosts)  # every host: the success and both failures
    assert err.outcomes[hosts[0]].stdout == "fine\n" and set(err.results) == {hosts[0]}
    assert set(err.failed) == set(err.errors) == {hosts[1], hosts[2]}
    assert isinstance(err.errors[hosts[1]], CommandFailed) and err.errors[hosts[1]].exit_code == 4
    assert isinstance(err.errors[hosts[2]], TimedOut)
    assert str(err).splitlines()[0] == "probe failed on 2 host(s): n1, n2"


def test_run_returns_a_group_result_that_reads_as_a_dict(tmp_path):
    hosts = [Host(f"n{i}", 22, "u", i) for i in range(3)]
    with Remote(hosts, SshOptions(), transport=LocalTransport(tmp_path)) as remote:
        got = remote.run('case "$HOME" in */n1) exit 3;; esac; echo hi', check=False)
        fine = remote.run("echo hi")
    assert isinstance(got, GroupResult) and isinstance(got, dict) and list(got) == hosts
    assert [r.exit_code for r in got.values()] == [0, 3, 0] and got[hosts[0]].stdout == "hi\n"
    assert list(got.succeeded) == [hosts[0], hosts[2]] and list(got.failed) == [hosts[1]]
    assert isinstance(got.failed, GroupResult) and not got.ok and fine.ok and not fine.failed
    assert fine.raise_if_failed() is fine
    with pytest.raises(GroupException) as info:
        got.raise_if_failed("probe")
    assert info.value.result is got and str(info.value) == "probe failed on 1 host(s): n1\n  n1: exit 3"


# ------------------------------------------------------------------------------------------ choosing the transport


def test_the_fake_is_a_transport_and_remote_takes_transports_only(tmp_path):
    assert isinstance(LocalTransport(tmp_path), Transport) and isinstance(LocalTransport(tmp_path), ProcessTransport)

    class PopenOnly:  # the duck type Remote used to wrap: no longer a transport
        def popen(self, host, command):
            raise AssertionError("never called")

    with pytest.raises(TypeError, match="^transport must be a clusterctl.transport Transport, not PopenOnly$"):
        Remote([H], SshOptions(), transport=PopenOnly())


def test_a_session_that_names_no_transport_takes_the_default(tmp_path):
    """The one place a test (or an embedder) sets the transport of the sessions that commands build."""
    from clusterctl.ops import open_session

    spec = tmp_path / "cluster.yaml"
    spec.write_text("name: seam\nssh: {config: none, user: u}\nhosts: [{address: n0}, {address: n1}]\n"
                    "job: {entrypoint: [x]}\n")
    fake = LocalTransport(tmp_path / "hosts")
    seen = []

    def factory(hosts, options):
        seen.append(([h.address for h in hosts], options.config))
        return fake

    with default.use(factory):
        with open_session(str(spec)) as session:
            assert session.remote.transport is fake
            out = session.remote.run('basename "$HOME"')
        with Remote([H], SshOptions()) as remote:
            assert remote.transport is fake
        other = LocalTransport(tmp_path / "other")
        with Remote([H], SshOptions(), transport=other) as remote:
            assert remote.transport is other  # a transport named where the session is built wins
    assert seen == [(["n0", "n1"], "none"), (["10.0.0.7"], "none")]
    assert sorted(r.stdout for r in out.values()) == ["n0\n", "n1\n"]
    assert default.factory is None  # restored after the block
    with default.use(fake), Remote([H], SshOptions()) as remote:
        assert remote.transport is fake  # a transport itself, for every session
    with Remote([H], SshOptions(host_key_policy="strict")) as remote:
        assert remote.transport is None  # no default set: Remote picks the OpenSSH client itself
    with default.use(lambda hosts, options: object()):
        with pytest.raises(TypeError, match="^the transport factory gave a object, not a clusterctl Transport$"):
            Remote([H], SshOptions())


def test_host_lives_below_the_plan_and_the_plan_reexports_it():
    import clusterctl.plan
    import clusterctl.transport.host

    assert clusterctl.plan.Host is clusterctl.transport.host.Host is Host


# ------------------------------------------------------------------------------------------ handshake gate


def test_gate_keys_are_the_first_bastion_or_the_direct_set():
    assert gate_key(JUMPED) == "jump:ops@bastion:2200"
    assert gate_key(Host("n", 22, "u", 0, jump=("b1", "b2"))) == "jump:b1"
    assert gate_key(H) == gate_key(Host("other", 2222, "u", 1)) == ""


def test_gate_bounds_each_key_and_serves_waiters_in_order():
    gate = HandshakeGate(per_bastion=2, direct=3)
    assert gate.acquire("jump:a") and gate.acquire("jump:a")
    assert not gate.acquire("jump:a", blocking=False)  # full
    assert gate.acquire("jump:b", blocking=False)  # another bastion: its own slots
    assert all(gate.acquire("", blocking=False) for _ in range(3)) and not gate.acquire("", blocking=False)
    order = []

    def waiter(i):
        gate.acquire("jump:a")
        order.append(i)

    threads = []
    for i in range(3):
        threads.append(threading.Thread(target=waiter, args=(i,)))
        threads[-1].start()
        time.sleep(0.05)  # queue them in this order
    assert order == [] and not gate.acquire("jump:a", timeout=0.05)
    gate.release("jump:a")
    threads[0].join(2)
    assert order == [0]
    gate.release("jump:a")
    gate.release("jump:a")
    for t in threads:
        t.join(2)
    assert order == [0, 1, 2] and gate.in_flight("jump:a") == 2 and gate.peak["jump:a"] == 2
    with pytest.raises(RuntimeError):
        HandshakeGate().release("jump:never")


class _FakeSsh(ProcessTransport):
    """A process transport with OpenSSH's gate logic: each 'connection' logs in after `login_s` (touches its
    flag) and then runs `sleep run_s`; records how many were logging in at once."""

    def __init__(self, tmp: Path, gate: HandshakeGate, login_s: float, run_s: float, flag: bool = True):
        self.tmp, self.gate, self.login_s, self.run_s, self.flag = tmp, gate, login_s, run_s, flag
        self.options = SshOptions(connect_timeout=5)
        self.n = 0
        self.inner = openssh.OpenSshTransport(self.options, gate)

    def spawn(self, host, command, wait=True):
        """OpenSshTransport.spawn's gate, around our fake process."""
        self.inner._popen = self._popen  # the gate and the watch are OpenSSH's own
        self.inner.argv = lambda h, c, login_flag=None: [login_flag or ""]
        self.inner.reuses = lambda h: False
        return self.inner.spawn(host, command, wait)

    def _popen(self, argv):
        touch = f": > '{argv[0]}';" if self.flag else ""  # without: a login the gate never hears of
        script = f"sleep {self.login_s}; {touch} sleep {self.run_s}; echo ran"
        return subprocess.Popen(["sh", "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE)


def test_new_connections_behind_one_bastion_log_in_a_few_at_a_time(tmp_path):
    """24 hosts behind one bastion, at most 4 handshakes at once: all start without blocking the caller,
    never more than 4 log in at a time, the others wait for a login (not for the commands to end, which
    run 1 s each: with the gate held until exit this would take 6 s)."""
    gate = HandshakeGate(per_bastion=4)
    fake = _FakeSsh(tmp_path, gate, login_s=0.15, run_s=1.0)
    hosts = [Host(f"10.0.1.{i}", 22, "u", i, jump=("bastion",)) for i in range(24)]
    t0 = time.monotonic()
    runs = [ProcessRun(fake, h, "x") for h in hosts]
    assert time.monotonic() - t0 < 1.0  # the caller is never held by the gate
    results = [r.finish(lambda: [], 30, None) for r in runs]
    took = time.monotonic() - t0
    assert [r.stdout for r in results] == ["ran\n"] * 24
    assert gate.peak["jump:bastion"] == 4 and gate.in_flight("jump:bastion") == 0
    assert took < 4.5, took  # 6 waves of logins (~0.15 s each) then 1 s of command: not 6 x 1 s


def test_a_connection_that_never_signals_its_login_frees_its_slot_at_exit(tmp_path):
    gate = HandshakeGate(per_bastion=1)
    fake = _FakeSsh(tmp_path, gate, login_s=0, run_s=0.1, flag=False)
    hosts = [Host(f"10.0.1.{i}", 22, "u", i, jump=("bastion",)) for i in range(3)]
    runs = [ProcessRun(fake, h, "x") for h in hosts]
    assert [r.finish(lambda: [], 30, None).stdout for r in runs] == ["ran\n"] * 3
    assert gate.peak["jump:bastion"] == 1


def test_a_launch_given_up_before_its_slot_came_is_ended(tmp_path):
    gate = HandshakeGate(per_bastion=1)
    fake = _FakeSsh(tmp_path, gate, login_s=0.3, run_s=0.0)
    first, second = (ProcessRun(fake, Host(f"10.0.1.{i}", 22, "u", i, jump=("b",)), "x") for i in range(2))
    assert second.proc is None  # waiting for the slot
    second.kill()
    first.finish(lambda: [], 30, None)
    second._ready.wait(5)
    assert second.proc is not None and second.proc.poll() is not None  # started once the slot came, then ended
    deadline = time.monotonic() + 3
    while gate.in_flight("jump:b") and time.monotonic() < deadline:
        time.sleep(0.02)
    assert gate.in_flight("jump:b") == 0


# ------------------------------------------------------------------------------------------ OpenSSH argv


def test_the_login_signal_is_ssh_own_local_command(tmp_path):
    argv = openssh.ssh_argv(H, SshOptions(), "true", None, login_flag=str(tmp_path / "f 1"))
    o = dict(argv[i + 1].split("=", 1) for i, a in enumerate(argv) if a == "-o")
    assert o["PermitLocalCommand"] == "yes" and o["LocalCommand"] == f"touch '{tmp_path / 'f 1'}'"
    assert argv[-2:] == [H.address, "true"]
    # behind bastions the ssh to the first bastion signals (its login is what that sshd's MaxStartups counts)
    two = Host("10.0.1.5", 22, "root", 1, jump=("b1", "b2"))
    argv = openssh.ssh_argv(two, SshOptions(), "true", None, login_flag="/run/f")
    o = dict(argv[i + 1].split("=", 1) for i, a in enumerate(argv) if a == "-o")
    to_b2 = shlex.split(o["ProxyCommand"])
    to_b1 = shlex.split(dict(to_b2[i + 1].split("=", 1) for i, a in enumerate(to_b2) if a == "-o")["ProxyCommand"])
    assert "LocalCommand" not in o and to_b2[-1] == "b2" and not any("LocalCommand" in a for a in to_b2[:-1] if "ProxyCommand" not in a)
    assert to_b1[-1] == "b1" and "LocalCommand=touch /run/f" in to_b1 and "PermitLocalCommand=yes" in to_b1
    assert openssh.ssh_argv(H, SshOptions(), "true", None) == Remote([H], SshOptions())._ssh_argv(H, "true")


@pytest.mark.skipif(shutil.which("ssh") is None, reason="no OpenSSH client")
def test_the_control_socket_path_is_the_one_ssh_expands(tmp_path):
    """Remote skips the gate for a host whose kept connection is open: its socket path must be ssh's own."""
    opts = SshOptions(known_hosts="/kh", persist=60)
    for host in (H, Host("gpu0", 2222, "Train", 1, hostname="10.1.0.9"), JUMPED):
        argv = openssh.ssh_argv(host, opts, "true", "/tmp/cc")
        argv = argv[:argv.index("--")] + ["-G"] + argv[argv.index("--"):-1]
        shown = subprocess.run(argv, capture_output=True, text=True, timeout=10).stdout
        expanded = next(ln.split(" ", 1)[1] for ln in shown.splitlines() if ln.startswith("controlpath "))
        if host.hostname:  # -F none: ssh resolves no alias itself; its %h is the address given
            host = Host(host.address, host.port, host.user, host.index, hostname=host.address)
        assert openssh.control_socket(host, opts, "/tmp/cc") == expanded
    assert openssh.control_socket(H, SshOptions(persist=0), "/tmp/cc") is None


def test_a_host_with_an_open_kept_connection_skips_the_gate(tmp_path, monkeypatch):
    sock_dir = Path("/tmp") / f"cct{socket.gethostname()[:4]}{id(tmp_path) % 10000}"
    sock_dir.mkdir(mode=0o700, exist_ok=True)
    try:
        opts = SshOptions(persist=60)
        monkeypatch.setattr(openssh, "control_dir", lambda: str(sock_dir))
        transport = openssh.OpenSshTransport(opts, HandshakeGate())
        assert not transport.reuses(H)
        server = socket.socket(socket.AF_UNIX)
        server.bind(openssh.control_socket(H, opts, str(sock_dir)))
        assert transport.reuses(H)
        server.close()
    finally:
        shutil.rmtree(sock_dir, ignore_errors=True)


# ------------------------------------------------------------------------------------------ no cycle


def _imports_of(path: Path) -> list[tuple[str, int]]:
    """Every module `path` imports (at any depth, lazy imports included), with its line."""
    parts = path.relative_to(Path(__file__).resolve().parents[2]).with_suffix("").parts  # clusterctl, transport, base
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            mod = ".".join(list(parts[:-node.level]) + ([node.module] if node.module else [])) if node.level else node.module
            out += [(mod, node.lineno)] + [(f"{mod}.{a.name}", node.lineno) for a in node.names]
        elif isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
    return out


def test_the_transports_import_neither_the_plan_nor_the_spec():
    """transport/ and sshconn are below the plan: Host, the jump hop's form and the options are theirs."""
    root = Path(__file__).resolve().parents[2] / "clusterctl"
    for path in [root / "sshconn.py", *sorted((root / "transport").glob("*.py"))]:
        for mod, line in _imports_of(path):
            assert not mod.startswith(("clusterctl.plan", "clusterctl.spec", "clusterctl.ops", "clusterctl.backends",
                                       "pydantic", "yaml")), (path.name, line, mod)
    # behind a bastion (the ProxyCommand chain): the spec models and pydantic stay unloaded
    code = ("import sys; from clusterctl.transport import openssh; from clusterctl.transport.base import SshOptions; "
            "from clusterctl.transport.host import Host; "
            "argv = openssh.ssh_argv(Host('10.0.1.5', 22, 'u', 0, jump=('ops@b1:2200', 'b2')), SshOptions(), 'true', None); "
            "assert 'b1' in argv[argv.index('-o', argv.index('ForwardAgent=no')) + 1]; "
            "print(sorted(m for m in sys.modules if m.startswith(('pydantic', 'clusterctl.spec', 'clusterctl.plan', 'yaml'))))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "[]"


def test_sshconn_builds_on_the_transport_base_not_on_remote():
    """remote imports sshconn (lazily); sshconn, and the transport package, never import remote."""
    root = Path(__file__).resolve().parents[2] / "clusterctl"
    for path in [root / "sshconn.py", *sorted((root / "transport").glob("*.py"))]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""] + [a.name for a in node.names]
                assert not any(n == "remote" or n.endswith(".remote") for n in names if n), (path, node.lineno)
    code = "import clusterctl.sshconn, sys; print('clusterctl.remote' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "False"


# ------------------------------------------------------------------------------------------ a deadline's wait


def test_a_process_with_a_deadline_is_seen_ending_at_once_not_at_a_later_look(monkeypatch):
    """Popen.wait(timeout) sleeps up to 50 ms between looks for the exit (~40 ms late on every `start`
    over new connections); wait_until is woken by the exit itself: it never sleeps."""
    from clusterctl.transport import process

    proc = subprocess.Popen(["sleep", "0.3"])
    real_sleep = time.sleep

    def no_sleep(seconds):
        raise AssertionError(f"slept {seconds}s waiting for a process")

    monkeypatch.setattr(time, "sleep", no_sleep)
    try:
        assert process.wait_until(proc, time.monotonic() + 30) == 0
    finally:
        monkeypatch.setattr(time, "sleep", real_sleep)
        proc.kill()
        proc.wait()


def test_a_process_past_its_deadline_times_out_and_can_still_be_ended():
    from clusterctl.transport import process

    proc = subprocess.Popen(["sleep", "30"])
    t0 = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        process.wait_until(proc, t0 + 0.2)
    assert 0.19 <= time.monotonic() - t0 < 10
    proc.kill()
    assert process.wait_until(proc, time.monotonic() + 10) == -9  # already reaped or not: the code


def test_a_run_with_a_deadline_returns_its_exit_code_and_output(tmp_path):
    run = ProcessRun(LocalTransport(tmp_path), H, "echo out; echo err >&2; exit 3")
    res = run.finish(lambda: (), 30, None)
    assert (res.exit_code, res.stdout.strip(), res.stderr.strip()) == (3, "out", "err")


def test_ssh_like_lines_held_back_before_a_login_are_bounded():
    # a host that sends "Connection closed by ..." lines without end had every one held (1.66 GB for 2 hosts' 187 MB)
    # and none shown until its command ended
    from clusterctl.transport.host import Host
    from clusterctl.transport.process import _PreLoginLines

    shown = []
    hold = _PreLoginLines(lambda h, s, line: shown.append(line), lambda line: line.startswith("Connection closed"))
    host = Host("n0", 22, "u", 0)
    lines = [f"Connection closed by 10.0.0.1 port {i}" for i in range(10_000)]
    for line in lines:
        hold(host, "err", line)
    assert len(hold._held) <= _PreLoginLines.HOLD and shown == lines[:len(shown)] and len(shown) > 9_900
    hold.release()
    assert shown == lines  # in order, none lost
