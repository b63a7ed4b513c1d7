"""The local fake transport: Remote's real machinery (launch, stdin, timeouts, replies) over local `sh` hosts."""

from clusterctl.plan import Host
from clusterctl.remote import Remote, SshOptions
from clusterctl.transport.local import LocalTransport


def _remote(tmp_path, n=2):
    hosts = [Host(f"n{i}", 22, "u", i) for i in range(n)]
    return Remote(hosts, SshOptions(), transport=LocalTransport(tmp_path)), hosts


def test_each_host_runs_in_its_own_home(tmp_path):
    remote, hosts = _remote(tmp_path)
    with remote:
        out = remote.run('echo "$HOME"; cat > got', stdin=b"payload")
    for host in hosts:
        assert out[host].stdout.strip() == str(tmp_path / host.address)
        assert (tmp_path / host.address / "got").read_bytes() == b"payload"


def test_failures_and_deadlines_read_as_over_ssh(tmp_path):
    remote, hosts = _remote(tmp_path, 1)
    with remote:
        failed = remote.run("echo oops >&2; exit 3", check=False)[hosts[0]]
        slow = remote.run("sleep 5", timeout=0.5, check=False)[hosts[0]]
    assert (failed.exit_code, failed.stderr.strip()) == (3, "oops")
    assert slow.exit_code == 124 and slow.stderr.startswith("timed out after 0.5s")


def test_the_deadline_holds_while_a_command_ignores_a_large_stdin(tmp_path):
    """A host command that never reads its stdin fills the pipe: writing must not hold us past the deadline."""
    import time

    remote, hosts = _remote(tmp_path, 1)
    t0 = time.monotonic()
    with remote:
        res = remote.run("sleep 30", stdin=b"x" * (8 << 20), timeout=1, check=False)[hosts[0]]
    assert res.timed_out and res.exit_code == 124
    assert time.monotonic() - t0 < 10


def test_a_failing_local_stream_is_raised_not_taken_for_the_host(tmp_path):
    """An error of the stream we feed (a local file gone, say) is ours: raised, with or without a deadline."""
    import pytest

    def feed(_host):
        yield b"first"
        raise OSError("local file vanished")

    remote, hosts = _remote(tmp_path, 1)
    with remote:
        for timeout in (None, 5):
            with pytest.raises(OSError, match="vanished"):
                remote.run("cat > /dev/null", stdin=feed, timeout=timeout, check=False)


def test_ctrl_c_while_waiting_ends_the_hosts_commands_not_only_the_wait(tmp_path):
    """Ctrl+C while every host's command runs (a followed log, say): KeyboardInterrupt reaches the caller at once
    and each host's command is ended with it, instead of streaming on in the worker threads."""
    import os
    import signal
    import threading
    import time

    import pytest

    remote, hosts = _remote(tmp_path, 2)
    started, up = threading.Event(), set()

    def on_line(host, stream, line):
        if line.strip() == "up":
            up.add(host)
            if len(up) == len(hosts):  # both wrote their pid: interrupt with both commands running
                started.set()

    def interrupt():
        started.wait(30)
        os.kill(os.getpid(), signal.SIGINT)

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # however the suite was started
    threading.Thread(target=interrupt, daemon=True).start()
    t0 = time.monotonic()
    try:
        with remote, pytest.raises(KeyboardInterrupt):
            remote.run('echo $$ > pid; echo up; exec sleep 60', on_line=on_line, check=False)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert started.is_set() and time.monotonic() - t0 < 30
    pids = [int((tmp_path / h.address / "pid").read_text()) for h in hosts]

    def running(pid):
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(") ", 1)[1][0] != "Z"
        except OSError:
            return False

    deadline = time.monotonic() + 10
    while any(map(running, pids)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [p for p in pids if running(p)], "the hosts' commands outlived the interrupt"


def test_a_line_callback_that_fails_does_not_leave_the_command_blocked(tmp_path):
    """The thread reading a command's output died with its line callback: the command, its pipe full, never ended.
    Now the output is read to its end and the callback's error is raised in the caller's thread."""
    import time

    import pytest

    def fails(host, stream, line):
        raise ValueError("the callback's own bug")

    remote, hosts = _remote(tmp_path, 1)
    t0 = time.monotonic()
    with remote, pytest.raises(ValueError, match="the callback's own bug"):
        remote.run("head -c 4000000 /dev/zero | tr '\\0' 'x' | fold -w 100", on_line=fails, timeout=60, check=False)
    assert time.monotonic() - t0 < 30
