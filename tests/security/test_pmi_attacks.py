"""The PMI server under attack on loopback (issue 12, finding 4): a rogue hello first, replies never
read, MPICH-style commands without the secret PMI_ID, a flooded key-value store."""

from __future__ import annotations

import socket
import threading
import time

import pytest
from helpers import free_port

from clusterctl.collective.errors import CollectiveError
from clusterctl.collective.pmi import TOKEN_ENV, PMIServer, format_command, parse_command, register

TOKEN = "beef" * 16


@pytest.fixture
def server(monkeypatch):
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    made = []

    def make(size, timeout=10.0):
        s = PMIServer("127.0.0.1", free_port(), size, timeout=timeout).start()
        made.append(s)
        return s

    yield make
    for s in made:
        s.close()


def closed_by_peer(sock, timeout=5.0):
    sock.settimeout(timeout)
    try:
        while sock.recv(65536):
            pass
        return True
    except ConnectionResetError:
        return True
    except socket.timeout:
        return False


def test_a_rogue_hello_first_does_not_take_a_real_ranks_place(server):
    srv = server(2)
    rogue = socket.create_connection(("127.0.0.1", srv.port))
    rogue.sendall(format_command("clusterctl_hello", rank=1, size=2, host="evil", pid=1, nonce="n"))
    assert closed_by_peer(rogue)
    forged = socket.create_connection(("127.0.0.1", srv.port))  # a MAC made with the wrong token
    forged.sendall(format_command("clusterctl_hello", rank=1, size=2, host="evil", pid=1, nonce="n", mac="0" * 64))
    assert closed_by_peer(forged)
    got = {}
    threads = [threading.Thread(target=lambda r=r: got.setdefault(r, register("127.0.0.1", srv.port, rank=r, size=2,
                                                                             timeout=10))) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(15)
    assert got[0]["rc"] == "0" and got[1]["rc"] == "0", got
    assert got[0]["pmiid"] != got[1]["pmiid"] and int(got[0]["pmiid"]) >= 1 << 24
    assert srv.hosts[1][0] != "evil" and srv.rejected >= 2


def test_commands_before_authentication_are_dropped(server):
    srv = server(1)
    for line in [format_command("get", kvsname=srv.kvsname, key="PMI_process_mapping"),
                 format_command("put", kvsname=srv.kvsname, key="k", value="v"),
                 format_command("initack", pmiid=0), format_command("initack", pmiid=12345678),
                 format_command("barrier_in"), format_command("finalize"), b"garbage\n", b"x" * 20000 + b"\n"]:
        with socket.create_connection(("127.0.0.1", srv.port)) as s:
            s.sendall(line)
            assert closed_by_peer(s), line[:40]
    assert srv.kvs == {} and not srv.done.is_set()


def _authed(srv):
    """register rank 0 (size 1), then an MPICH-style connection authenticated by its PMI_ID."""
    info = register("127.0.0.1", srv.port, rank=0, size=1, timeout=10)
    s = socket.create_connection(("127.0.0.1", srv.port))
    s.sendall(format_command("initack", pmiid=info["pmiid"]))
    f = s.makefile("rb")
    assert parse_command(f.readline().decode())[0] == "initack"
    for _ in range(3):
        f.readline()  # set size / rank / debug
    return s, f


def test_replies_never_read_do_not_pile_up(server):
    srv = server(1)
    s, f = _authed(srv)
    s.sendall(format_command("put", kvsname=srv.kvsname, key="big", value="v" * 1000))
    assert parse_command(f.readline().decode())[1]["rc"] == "0"
    line = format_command("get", kvsname=srv.kvsname, key="big")  # ~45 bytes asking for ~1 KB
    s.settimeout(10)
    sent = 0
    try:
        while sent < 6_000_000:  # 6 MB of gets, never reading a reply
            s.sendall(line * 1000)
            sent += len(line) * 1000
    except OSError:
        pass  # the server dropped us: what this test wants
    assert closed_by_peer(s, 10)
    time.sleep(0.2)
    conns = [k.data for k in srv._sel.get_map().values() if hasattr(k.data, "wbuf")]
    assert all(len(c.wbuf) <= (1 << 20) + 4096 for c in conns)
    assert srv.rejected >= 1


def test_the_key_value_store_is_bounded(server):
    srv = server(1)
    s, f = _authed(srv)
    ok = refused = 0
    for i in range(2000):
        s.sendall(format_command("put", kvsname=srv.kvsname, key=f"k{i}", value="v" * 100))
        _, a = parse_command(f.readline().decode())
        ok += a["rc"] == "0"
        refused += a["rc"] != "0"
    assert ok == 1024 + 256 and refused == 2000 - ok and len(srv.kvs) == ok
    s.sendall(format_command("put", kvsname=srv.kvsname, key="k" * 65, value="v"))
    assert parse_command(f.readline().decode())[1]["rc"] == "1"
    s.close()


def test_a_rank_with_the_wrong_token_cannot_join(server, monkeypatch):
    srv = server(1, timeout=2)
    monkeypatch.setenv(TOKEN_ENV, "not-the-token")
    with pytest.raises(CollectiveError):
        register("127.0.0.1", srv.port, rank=0, size=1, timeout=2)
