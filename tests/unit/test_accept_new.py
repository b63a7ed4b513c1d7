"""host_key_policy accept-new: a new key is recorded once, however many connections meet it at once (a bastion
in front of many hosts), and a different key recorded meanwhile is refused, not added beside it."""

from __future__ import annotations

import threading

import paramiko
import pytest

from clusterctl.sshconn import _AcceptNewPolicy, _HostKeyError


def test_a_key_met_by_many_connections_at_once_is_recorded_once(tmp_path):
    known = tmp_path / "known_hosts"
    key = paramiko.ECDSAKey.generate()
    other = paramiko.ECDSAKey.generate()
    known.write_text(f"other.example {other.get_name()} {other.get_base64()}\n")
    barrier = threading.Barrier(8)

    def meet():
        barrier.wait()
        _AcceptNewPolicy(str(known)).missing_host_key(paramiko.SSHClient(), "[10.9.0.2]:22", key)

    threads = [threading.Thread(target=meet) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    lines = known.read_text().splitlines()
    assert lines == [f"other.example {other.get_name()} {other.get_base64()}",
                     f"[10.9.0.2]:22 {key.get_name()} {key.get_base64()}"]


def test_a_different_key_recorded_meanwhile_is_refused(tmp_path):
    known = tmp_path / "known_hosts"
    first, second = paramiko.ECDSAKey.generate(), paramiko.ECDSAKey.generate()
    known.write_text(f"bastion.example {first.get_name()} {first.get_base64()}\n")
    with pytest.raises(_HostKeyError, match="changed while connecting"):
        _AcceptNewPolicy(str(known)).missing_host_key(paramiko.SSHClient(), "bastion.example", second)
    assert known.read_text().count("bastion.example") == 1
