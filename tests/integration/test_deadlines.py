"""Every remote wait has a deadline (issue 12): a host whose SSH stays healthy but whose `python3` hangs is
named as timed out within ssh.command_timeout (plus a few seconds), by status and by dispatch; the others
answer as usual."""

from __future__ import annotations

import time

import pytest
from clusterlib import clusterctl, node_exec, write_spec

SHIM = "/usr/local/bin/python3"  # ahead of /usr/bin on sshd's PATH: every `python3` the tools run hangs


@pytest.mark.timeout(120)
def test_a_host_whose_python_hangs_is_named_within_the_command_timeout(testcluster, tmp_path):
    node = testcluster.nodes[1]
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "a.txt").write_text("a\n")
    spec = write_spec(testcluster, tmp_path / "d.yaml", name="it-deadline", hosts=2,
                      ssh={"command_timeout": 3}, workspace={"local": str(ws), "remote": "clusterctl-it/deadline"},
                      job={"entrypoint": ["true"]})
    node_exec(node.container, f"printf '#!/bin/sh\\nexec sleep 600\\n' > {SHIM} && chmod 755 {SHIM}")
    try:
        for command in ("status", "dispatch"):
            t0 = time.monotonic()
            res = clusterctl(command, spec, timeout=90)
            elapsed = time.monotonic() - t0
            assert res.returncode != 0, res.stdout + res.stderr
            said = res.stdout + res.stderr
            assert node.ip in said and "timed out after" in said, said
            assert elapsed < 3 * 10 + 15, (command, elapsed)  # dispatch: the transfer's deadline is ten of them
    finally:
        node_exec(node.container, f"rm -f {SHIM}; pkill -f '^sleep 600$' || true")
    assert clusterctl("dispatch", spec, timeout=90).returncode == 0
