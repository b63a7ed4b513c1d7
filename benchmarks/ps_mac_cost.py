"""Per-message cost of the pserver's request/reply MAC (docs/security.md): encode and decode of one
pipelined push_pull piece (a 4 MiB tensor, zero-copy) without and with the job token, side by side.

    python benchmarks/ps_mac_cost.py [--n 20000] [--repeats 5]

Prints the best of `repeats` timings per variant (microseconds per message) and the difference.
"""

from __future__ import annotations

import argparse
import sys
import timeit
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from clusterctl.ps.protocol import decode, encode, job_key


def main() -> int:
    """Run the comparison and print a markdown table."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=20000)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    tensors = {"w.block0": np.zeros(1 << 20, np.float32)}
    head = {"op": "push_pull", "seq": 7, "tid": 0, "step": 12, "part": 3, "off": [0]}
    rows = {}
    for label, key in (("no token", None), ("job token (HMAC-SHA256)", job_key("t" * 64))):
        frames = encode(head, tensors, key=key)
        enc = min(timeit.repeat(lambda: encode(head, tensors, key=key), number=args.n, repeat=args.repeats))
        dec = min(timeit.repeat(lambda: decode(frames, key=key), number=args.n, repeat=args.repeats))
        rows[label] = (enc / args.n * 1e6, dec / args.n * 1e6)
    print(f"| 4 MiB push_pull piece | encode (µs, best of {args.repeats}) | decode (µs) |")
    print("| --- | ---: | ---: |")
    for label, (e, d) in rows.items():
        print(f"| {label} | {e:.1f} | {d:.1f} |")
    (e0, d0), (e1, d1) = rows.values()
    print(f"| difference per message | {e1 - e0:+.1f} | {d1 - d0:+.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
