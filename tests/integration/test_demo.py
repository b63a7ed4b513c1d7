"""The README's first command, end to end: the demo converges, and a second run is incremental."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration


def run_demo() -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "clusterctl.cli", "demo"], capture_output=True, text=True, timeout=600,
        stdin=subprocess.DEVNULL, env={**os.environ, "COLUMNS": "120"},
    )


@pytest.mark.timeout(900)
def test_demo_converges_and_a_second_run_is_incremental(testcluster):  # testcluster: docker is usable
    from clusterctl import testcluster as tc
    from clusterctl.demo import DEMO_CLUSTER

    tc.down(DEMO_CLUSTER)  # fresh nodes: the first run provisions for real
    first = run_demo()
    assert first.returncode == 0, first.stdout[-4000:] + first.stderr[-2000:]
    assert "converged: final loss per trainer" in first.stdout
    losses = [float(x) for x in re.search(r"final loss per trainer ([\d., ]+) \(", first.stdout).group(1).split(", ")]
    assert len(losses) == 3 and max(losses) < 10
    assert "job fit-a-line-demo: succeeded" in first.stdout

    second = run_demo()
    assert second.returncode == 0, second.stdout[-4000:] + second.stderr[-2000:]
    assert re.search(r"^0 changed, 0 failed, \d+ ok in ", second.stdout, re.M), second.stdout
    sent = re.search(r"0 file\(s\), ([\d,]+) bytes to 3 hosts", second.stdout)  # a header per host, no file
    assert sent and int(sent.group(1).replace(",", "")) < 3 * 256, second.stdout
    # the two runs' times side by side (provision, total): `benchmarks/provision.py --demo` (ratios live there)
