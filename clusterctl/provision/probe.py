"""One round trip per host before provisioning: Python/platform tags, hostname, host key, wheelhouse listing."""

from __future__ import annotations

import inspect

from ..host import provision_host
from ..quoting import join
from ..remote import Remote
from .hostdata import BadReply, Collector, probe_facts, shown
from .steps import HostFacts

__all__ = ["probe_hosts", "PROBE_SCRIPT"]

PROBE_SCRIPT = "import json, os, platform, socket, subprocess, sys\n" + inspect.getsource(provision_host.login_facts) + r"""
wheelhouse = sys.argv[1]
if wheelhouse and not wheelhouse.startswith("/"):
    wheelhouse = os.path.join(os.path.expanduser("~"), wheelhouse)
libc, ver = platform.libc_ver()
try:
    key = open("/etc/ssh/ssh_host_ed25519_key.pub").read().split()[:2]
except OSError:
    key = []
wheels = []
if wheelhouse and os.path.isdir(wheelhouse):
    for name in sorted(os.listdir(wheelhouse)):
        path = os.path.join(wheelhouse, name)
        if os.path.isfile(path):
            wheels.append([name, os.path.getsize(path)])
print(json.dumps({
    "python": "%d.%d" % sys.version_info[:2],
    "implementation": {"cpython": "cp", "pypy": "pp"}.get(sys.implementation.name, sys.implementation.name),
    "machine": platform.machine(),
    "glibc": ver if libc == "glibc" else "",
    "hostname": socket.gethostname(),
    "host_key": " ".join(key),
    "wheels": wheels,
    **login_facts(),
}))
"""


MAX_REPLY = 16 << 20  # bytes of stdout kept per host (a wheelhouse of 100,000 files lists in ~8 MiB)
TIMEOUT = 60.0


def probe_hosts(remote: Remote, hosts, *, interpreter: str, wheelhouse: str) -> tuple[dict, dict]:
    """Facts per host, and the reason for every host the probe could not run on (host → message).

    A host's reply is untrusted (hostdata.py): bounded while it arrives, every fact checked before the
    other steps (and the other hosts, through ssh_mesh) see it."""
    collect = Collector(MAX_REPLY)
    results = remote.run(
        join([interpreter, "-c", PROBE_SCRIPT, wheelhouse]), hosts=hosts, check=False, timeout=TIMEOUT, what="probe",
        on_line=collect,
    )
    facts, failed = {}, {}
    for host, res in results.items():
        if not res.ok:
            tail = (res.stderr or res.stdout).strip().splitlines()
            failed[host] = f"probe failed (exit {res.exit_code}): {shown(tail[-1]) if tail else 'no output'}"
            continue
        try:
            facts[host] = HostFacts(**probe_facts(collect.reply(host)))
        except BadReply as exc:
            failed[host] = f"probe printed an unexpected reply: {exc}"
    return facts, failed
