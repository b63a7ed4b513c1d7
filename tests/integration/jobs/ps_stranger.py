"""A stranger on the job's network tries a pserver (argv[1], HOST:PORT) three ways; prints one JSON line.

`plain`: a ZeroMQ client without CURVE sends a made-up `init` and `complete` (what ended a token-less pserver
once); `wrong`: a trainer client whose keys come from another token; `right`: one whose keys come from the
job's process token, read from stdin (empty: not tried). Each is "served", "refused" (the pserver's door said
no) or "no answer" (no handshake: libzmq never delivers a frame before it, so the pserver saw nothing)."""

import json
import socket
import sys
import time

import zmq

from clusterctl.ps.client import PSClient
from clusterctl.ps.errors import AuthError, PsTimeoutError

ep = sys.argv[1]


def plain() -> str:
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.SNDTIMEO, 2000)  # with no handshake done there is no peer to queue for: do not block
    s.connect("tcp://" + ep)
    answered = False
    for op in ("init", "complete"):
        try:
            s.send_multipart([json.dumps({"seq": 1, "op": op, "tid": 0, "mode": "sync", "plan": "made-up"}).encode()])
        except zmq.Again:
            continue
        answered = answered or bool(s.poll(2000))
    s.close()
    return "served" if answered else "no answer"


def client(token: str) -> str:
    try:
        with PSClient([ep], trainer_id=0, num_trainers=1, token=token, timeout=10) as c:
            c.ping(timeout=10)
        return "served"
    except AuthError:
        return "refused"
    except PsTimeoutError:
        return "no answer"


right = sys.stdin.readline().strip()
host, port = ep.rsplit(":", 1)
deadline = time.monotonic() + 150
while True:  # once the pserver listens (its name resolves once its pod has an address)
    try:
        socket.create_connection((host, int(port)), timeout=1).close()
        break
    except OSError:
        if time.monotonic() > deadline:
            sys.exit("the pserver never listened")
        time.sleep(0.2)
out = {"right": client(right)} if right else {}  # first: the job may end soon after
out["wrong"] = client("0" * 64)
out["plain"] = plain()
print(json.dumps(out))
