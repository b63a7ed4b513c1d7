#!/usr/bin/env python3
"""What offline apt's pinning proxy (clusterctl/provision/aptproxy.py) costs a fetch: one file from a loopback
HTTP server, directly and through the proxy, interleaved, with curl (a client that is neither side's Python).

`apt-get update` fetches the host's indexes through the proxy; this measures the relay alone, on loopback, where
nothing else hides it (a real mirror is farther away: the proxy's share is smaller there).

    .venv/bin/python benchmarks/aptproxy.py --mib 256 --repeat 7
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from clusterctl.provision import aptproxy  # noqa: E402


class _Quiet(SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


def _curl(url: str, proxy: str | None) -> float:
    argv = ["curl", "-sS", "-o", "/dev/null", "--noproxy", "*" if proxy is None else "", url]
    if proxy is not None:
        argv[1:1] = ["--proxy", proxy]
    t0 = time.perf_counter()
    subprocess.run(argv, check=True)
    return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=256, help="size of the file fetched")
    ap.add_argument("--repeat", type=int, default=7)
    args = ap.parse_args()
    if shutil.which("curl") is None:
        print("benchmarks/aptproxy.py: needs curl", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as d:
        Path(d, "blob").write_bytes(os.urandom(args.mib << 20))
        server = ThreadingHTTPServer(("127.0.0.1", 0), partial(_Quiet, directory=d))
        threading.Thread(target=server.serve_forever, daemon=True).start()
        url = f"http://127.0.0.1:{server.server_address[1]}/blob"
        times: dict[str, list[float]] = {"direct": [], "proxy": []}
        cpu: dict[str, list[float]] = {"direct": [], "proxy": []}
        with aptproxy.proxy(aptproxy.Pinned({"127.0.0.1"})) as (via, _):
            _curl(url, via)  # warm: the page cache, the first threads
            for _ in range(args.repeat):
                for case, proxy in (("direct", None), ("proxy", via)):
                    before = resource.getrusage(resource.RUSAGE_SELF)
                    times[case].append(_curl(url, proxy))
                    after = resource.getrusage(resource.RUSAGE_SELF)
                    # this process: the server (both cases) and the proxy's relay (the second)
                    cpu[case].append((after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime))
        server.shutdown()
    d_med, p_med = statistics.median(times["direct"]), statistics.median(times["proxy"])
    relay = statistics.median(cpu["proxy"]) - statistics.median(cpu["direct"])
    print(f"{args.mib} MiB over loopback, medians of {args.repeat} (load {os.getloadavg()[0]:.1f}):")
    print(f"  direct        {d_med:.3f} s  {args.mib / d_med:7.0f} MiB/s")
    print(f"  through proxy {p_med:.3f} s  {args.mib / p_med:7.0f} MiB/s  ({p_med / d_med:.2f}x)")
    print(f"  the relay's CPU per fetch: {relay:.3f} s ({relay / args.mib * 1000:.2f} ms a MiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
