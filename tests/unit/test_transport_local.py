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
