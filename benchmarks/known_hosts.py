#!/usr/bin/env python3
"""Reading a big known_hosts file on the paramiko path (host_key_policy accept-new or off): paramiko's own
`SSHClient.load_host_keys` against clusterctl.sshkeys, which every paramiko connection of a command goes through.

    .venv/bin/python benchmarks/known_hosts.py [--lines 1000 5000] [--repeat 5]

One ECDSA key per line, one host per line (as a fleet's system-wide file pins them); medians of `--repeat`.
"first" parses the file; "again" is the next connection of the same command (the file unchanged); "a host's keys"
is what each connection then does: a client holding the keys of its host, matched as ssh matches names (patterns,
hashed names), out of every entry, where paramiko's connect scanned every entry by exact name.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import paramiko

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from clusterctl import sshkeys  # noqa: E402


def timed(step) -> float:
    t0 = time.perf_counter()
    step()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lines", type=int, nargs="+", default=[1000, 5000])
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    key = paramiko.ECDSAKey.generate()
    from clusterctl.sshconfig import Resolved
    from clusterctl.transport.base import SshOptions

    print("| lines | paramiko `load_host_keys` (s) | ours, first (s) | ours, again (s) | ours, a host's keys (s) |")
    print("| ---: | ---: | ---: | ---: | ---: |")
    for n in args.lines:
        with tempfile.NamedTemporaryFile("w", suffix="_known_hosts") as fh:
            fh.writelines(f"10.{i // 65536}.{i // 256 % 256}.{i % 256} {key.get_name()} {key.get_base64()}\n"
                          for i in range(n))
            fh.flush()
            theirs, first, again, client = [], [], [], []
            host = Resolved(f"10.0.{n // 2 // 256 % 256}.{n // 2 % 256}", "ubuntu", 22, known_hosts=(fh.name,))
            options = SshOptions(host_key_policy="accept-new")
            for _ in range(args.repeat):
                theirs.append(timed(lambda: paramiko.SSHClient().load_host_keys(fh.name)))
                sshkeys._PARSED.clear()
                sshkeys._UNIONS.clear()
                first.append(timed(lambda: sshkeys._known_entries([fh.name])))
                again.append(timed(lambda: sshkeys._known_entries([fh.name])))
                client.append(timed(lambda: sshkeys.host_key_client(options, host)))
        print(f"| {n:,} | {statistics.median(theirs):.3f} | {statistics.median(first):.3f} | "
              f"{statistics.median(again):.5f} | {statistics.median(client):.4f} |")


if __name__ == "__main__":
    main()
