"""`agent preflight` checks the ports a job may need beyond its processes' own: rank 0's master (rendezvous) port,
and on every host of an elastic job the control and master ports the plan reserved there (any host may take over as
coordinator, or hold rank 0, at a later attempt: clusterctl/host/layout.py). Before, a port taken there surfaced only
when the job needed it: torch's rendezvous failing at the first start, or a successor that could not take over.

Job files from the real pipeline (spec -> plan -> job files), on loopback addresses of this machine."""

from __future__ import annotations

import json
import socket

import pytest

from clusterctl.host.jobfile import load_job
from clusterctl.host.preflight import preflight
from clusterctl.ops.job import job_files
from clusterctl.plan import make_plan
from clusterctl.spec import parse_spec
from helpers import free_port

PORT_KINDS = {"port_in_use", "port_duplicate", "port_unavailable", "address_not_local", "address_unknown"}


def _spec(base: int, elastic: bool) -> str:
    hosts = ["127.0.0.1", "127.0.0.2"] + (["127.0.0.3"] if elastic else [])
    lines = ["name: pf", "ssh: {config: none}", "hosts:"]
    lines += [f"  - {{address: {a}{', spare: true' if elastic and i == 2 else ''}}}" for i, a in enumerate(hosts)]
    lines += ["job:", "  entrypoint: [python3, train.py]", "  trainers: 1",
              f"  ports: {{control: {base}, master: {base + 1}, pserver: {base + 2}, trainer: {base + 3}}}"]
    lines += ["  restarts: 2", "  min_hosts: 1"] if elastic else []
    return "\n".join(lines) + "\n"


def _port_problems(tmp_path, elastic: bool, held: tuple[str, int] | None, base: int) -> dict[str, list[tuple]]:
    """{host address: [(kind, process, endpoint)]} of each host's preflight, with `held` bound meanwhile."""
    plan = make_plan(parse_spec(_spec(base, elastic)))
    out = {}
    sock = socket.create_server(held) if held else None
    try:
        for host, raw in job_files(plan, dict.fromkeys(plan.hosts, str(tmp_path)), "tok").items():
            path = tmp_path / f"{host.address}.json"
            path.write_text(json.dumps(raw))
            out[host.address] = [(p["kind"], p.get("process"), p.get("endpoint")) for p in preflight(load_job(str(path)))
                                 if p["kind"] in PORT_KINDS]
    finally:
        if sock is not None:
            sock.close()
    return out


def _base() -> int:
    base = free_port()
    return base if base < 65000 else 20000 + base % 20000


def test_nothing_held_nothing_said(tmp_path):
    base = _base()
    assert _port_problems(tmp_path, False, None, base) == {"127.0.0.1": [], "127.0.0.2": []}
    assert _port_problems(tmp_path, True, None, base) == {"127.0.0.1": [], "127.0.0.2": [], "127.0.0.3": []}


def test_rank_0s_master_port_taken_is_refused_on_its_host(tmp_path):
    base = _base()
    got = _port_problems(tmp_path, False, ("127.0.0.1", base + 1), base)
    assert got == {"127.0.0.1": [("port_in_use", "trainer.0's master (rendezvous) port", f"127.0.0.1:{base + 1}")],
                   "127.0.0.2": []}


@pytest.mark.parametrize("where, port, said", [
    ("127.0.0.2", 0, "the job's control port (reserved: elastic job)"),
    ("127.0.0.3", 0, "the job's control port (reserved: elastic job)"),  # a spare: it may take over too
    ("127.0.0.2", 1, "the trainers' master port (reserved: elastic job)"),
    ("127.0.0.3", 1, "the trainers' master port (reserved: elastic job)"),
])
def test_an_elastic_jobs_reserved_ports_taken_on_any_host_are_refused_there(tmp_path, where, port, said):
    base = _base()
    got = _port_problems(tmp_path, True, (where, base + port), base)
    assert got.pop(where) == [("port_in_use", said, f"{where}:{base + port}")]
    assert got == dict.fromkeys(got, [])
