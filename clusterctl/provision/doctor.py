"""`doctor`: gather every host's facts in one round trip, then compare hosts and name the odd one out."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from importlib import resources

from ..plan import Host
from ..quoting import join
from .hostdata import BadReply, Collector, doctor_facts, shown

__all__ = ["DoctorReport", "doctor", "host_params", "compare", "COMPARED"]

MAX_REPLY = 16 << 20  # bytes of a host's facts kept (its venv's package list is most of them)
WINDOW = 3.0  # seconds each host keeps trying its peers (and keeps its listener open, a bit longer)

# Facts that must agree across hosts (mismatches hang or break collectives); name → getter.
COMPARED = {
    "python": lambda f: f["venv"].get("python") or f["python3"],
    "mpi4py": lambda f: f["venv"].get("mpi4py", ""),
    "MPI library": lambda f: f["venv"].get("mpi_library", ""),
    "mpiexec": lambda f: f["venv"].get("mpiexec", ""),
    "CUDA toolkit": lambda f: _short(f["gpu"].get("toolkit", "")),
    "cuDNN": lambda f: _short(f["gpu"].get("cudnn", "")),
    "NCCL": lambda f: _short(f["gpu"].get("nccl", "")),
}


def _short(value: str) -> str:
    # "12.4 (apt cuda-toolkit-12-4)" -> "12.4"; always a string: doctor_facts turns a host's null into ""
    return value.split(" (")[0]


def host_ports(plan, host: Host) -> list[int]:
    """The job's ports on `host`: its processes' ports, plus the control/master ports it carries. None under
    `launcher: mpi`: one supervisor runs mpiexec, which picks its own ports (no coordinator, no rank binds the plan's)."""
    if plan.mpi is not None:
        return []
    ports = {p.port for p in plan.on_host(host)}
    ctl_addr, ctl_port = plan.control_endpoint.rsplit(":", 1)
    if host.endpoint_address == ctl_addr.strip("[]"):
        ports.add(int(ctl_port))
    trainers = plan.trainers
    if trainers and trainers[0].host == host:
        ports.add(int(trainers[0].env["MASTER_PORT"]))
    return sorted(ports)


def port_problems(label: str, ports: dict[str, str]) -> list[str]:
    """A host's job ports that another process holds (the facts script's `busy:`); those the running job holds
    itself (`job:`) are none."""
    return [f"{label}: job port {port} is {state}" for port, state in ports.items()
            if state != "free" and not state.startswith("job:")]


def _venv_cell(f: dict) -> str:
    """The venv provision.python names and whether it is there; `-` when the spec names none."""
    path = f["venv"]["path"]
    return (path + ("" if f["venv"]["exists"] else " (missing)")) if path else "-"


def host_params(plan, venv: str, host: Host) -> dict:
    """The facts script's parameters for `host`: its address, ports, venv and peers to test."""
    ports = host_ports(plan, host)
    peers = []
    for peer in plan.hosts:
        if peer == host:
            continue
        peer_ports = host_ports(plan, peer)
        peers.append(
            {"label": peer.label, "address": peer.endpoint_address, "ssh_port": peer.port, "job_port": peer_ports[0] if peer_ports else None}
        )
    return {
        "address": host.endpoint_address,
        "ports": ports,
        "listen_port": ports[0] if ports else None,
        "venv": venv,
        "peers": peers,
        "window": WINDOW,
        "job_dir": f".clusterctl/jobs/{plan.job}",  # a busy port while the job's supervisor runs is the job's own
    }


@dataclass
class DoctorReport:
    """Facts per host (None where ssh failed), the reasons hosts failed, and every problem found."""

    job: str
    hosts: tuple[Host, ...]
    facts: dict[Host, dict | None]
    errors: dict[Host, str] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when every host answered, and no check or comparison found a problem."""
        return not self.problems

    def rows(self) -> list[list[str]]:
        """Table rows: a check name, then one value per host."""
        def row(name, get):
            return [name] + [self.errors.get(h, "") if self.facts.get(h) is None else get(self.facts[h]) for h in self.hosts]

        rows = [row("ssh", lambda f: "ok")]
        rows.append(row("hostname", lambda f: f["hostname"]))
        rows.append(row("login", lambda f: f.get("login", {}).get("user", "-")))
        rows.append(row("sudo", lambda f: _SUDO_WORDS.get(f.get("login", {}).get("sudo", ""), f.get("login", {}).get("sudo", "-"))))
        rows.append(row("OS", lambda f: f["os"]))
        rows.append(row("python3", lambda f: f["python3"]))
        rows.append(row("venv", _venv_cell))
        for name, get in COMPARED.items():
            rows.append(row(name, lambda f, get=get: get(f) or "-"))
        rows.append(row("driver", lambda f: f["gpu"].get("driver") or "-"))
        rows.append(row("GPUs", lambda f: ", ".join(f"{g['index']}:{g['name']}" for g in f["gpu"]["gpus"]) or "none"))
        rows.append(row("job ports", lambda f: " ".join(f"{p}:{s.split(':')[0]}" for p, s in f["ports"].items()) or "-"))
        rows.append(row("peers", _peer_summary))
        return rows

    def to_json(self) -> dict:
        """The JSON printed by `doctor --json`."""
        return {
            "job": self.job,
            "ok": self.ok,
            "hosts": {h.label: self.facts.get(h) for h in self.hosts},
            "errors": {h.label: e for h, e in self.errors.items()},
            "problems": self.problems,
        }


_SUDO_WORDS = {
    "root": "not needed (root)",
    "ok": "passwordless",
    "password": "needs a password",
    "missing": "not installed",
}


def _peer_summary(f: dict) -> str:
    bad = [f"{peer} {kind} {state}" for peer, r in f["reach"].items() for kind, state in r.items() if state != "ok"]
    return "all reachable" if not bad else "; ".join(bad)


def _facts_source() -> bytes:
    return resources.files("clusterctl.host").joinpath("provision_host.py").read_bytes()


def compare(facts: dict[Host, dict], hosts) -> list[str]:
    """Cross-host mismatches of COMPARED facts and of the venv's package versions, naming the odd hosts."""
    problems = []
    live = [h for h in hosts if facts.get(h) is not None]
    values = {name: {h: get(facts[h]) for h in live} for name, get in COMPARED.items()}
    names = set()
    for h in live:
        names |= set(facts[h]["venv"].get("packages", {}))
    for pkg in sorted(names):
        if pkg in ("mpi4py",):
            continue
        values[f"package {pkg}"] = {h: facts[h]["venv"].get("packages", {}).get(pkg, "") for h in live}
    for name, per_host in values.items():
        if len(set(per_host.values())) <= 1:
            continue
        problems.append(_mismatch(name, per_host, live))
    return problems


def _mismatch(name: str, per_host: dict, order) -> str:
    counts = Counter(per_host.values())
    top = max(counts.values())
    majority = next(per_host[h] for h in order if counts[per_host[h]] == top)
    odd = [h for h in order if per_host[h] != majority]
    odd_text = ", ".join(f"{h.label} has {per_host[h] or 'none'}" for h in odd)
    others = [h.label for h in order if per_host[h] == majority]
    return f"{name} differs: {odd_text}; {', '.join(others)} {'has' if len(others) == 1 else 'have'} {majority or 'none'}"


def doctor(session) -> DoctorReport:
    """Gather facts on every host (one round trip each) and compare them."""
    spec, plan, remote = session.spec, session.plan, session.remote
    prov = spec.provision
    venv = prov.python.venv if prov and prov.python else ""
    source = _facts_source()
    collect = Collector(MAX_REPLY)  # a host's reply is untrusted: bounded, then checked (hostdata.py)
    results = remote.run(
        lambda h: join(["python3", "-", json.dumps(host_params(plan, venv, h))]),
        stdin=source,
        timeout=120,
        check=False,
        what="doctor",
        on_line=collect,
    )
    report = DoctorReport(spec.name, plan.hosts, {})
    down = set()  # hosts whose own line says they did not answer: their peers' failures to reach them follow
    for host in plan.hosts:
        res = results[host]
        if not res.ok:
            down.add(host.label)
            tail = (res.stderr or res.stdout).strip().splitlines()[-1:] or [f"exit {res.exit_code}"]
            report.errors[host] = shown(tail[0], 300)
            report.facts[host] = None
            report.problems.append(f"{host.label}: {shown(tail[0], 300)}")
            continue
        try:
            report.facts[host] = doctor_facts(collect.reply(host))  # the last JSON object on stdout, checked
        except BadReply as exc:
            report.errors[host] = f"facts script: {exc}"
            report.facts[host] = None
            report.problems.append(f"{host.label}: facts script printed an unexpected reply: {exc}")
    for host in plan.hosts:
        f = report.facts.get(host)
        if f is None:
            continue
        if venv and not f["venv"]["exists"]:
            report.problems.append(f"{host.label}: no venv at {f['venv']['path']}")
        if f["venv"].get("mpi4py_error"):
            report.problems.append(f"{host.label}: mpi4py: {f['venv']['mpi4py_error']}")
        elif prov and prov.mpi and f["venv"]["exists"] and not f["venv"].get("mpi4py"):
            report.problems.append(f"{host.label}: no mpi4py in {f['venv']['path']} (provision.mpi asks for it)")
        report.problems += port_problems(host.label, f["ports"])
        for peer, r in f["reach"].items():
            for kind, state in r.items():
                if state != "ok" and peer not in down:  # the table's peers row still shows it
                    report.problems.append(f"{host.label} cannot reach {peer} ({kind}): {state}")
    report.problems += compare(report.facts, plan.hosts)
    return report
