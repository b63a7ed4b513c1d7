"""Issue 12 over real SSH: `exec --timeout` ends the remote process group, and a host whose shell
start-up prints a line still dispatches, starts, reports status and stops."""

from __future__ import annotations

import time

import pytest
import yaml

from clusterlib import assert_no_orphans, clusterctl, job_ports, job_spec, node_exec, status_json, wait_state

pytestmark = pytest.mark.integration


@pytest.mark.timeout(90)
def test_exec_timeout_ends_the_remote_process_group(testcluster, tmp_path):
    from clusterlib import write_spec

    spec = write_spec(testcluster, tmp_path / "c.yaml", name="exectimeout", hosts=2, job={"entrypoint": ["true"]})
    marker = "3141"
    t0 = time.monotonic()
    res = clusterctl("exec", "--timeout", "2", spec, "--", "sh", "-c", f"sleep {marker}1 & sleep {marker}2; echo never")
    took = time.monotonic() - t0
    assert res.returncode == 124, (res.stdout, res.stderr)
    assert "never" not in res.stdout and took < 30
    for node in testcluster.nodes[:2]:
        deadline = time.monotonic() + 10
        while True:
            left = node_exec(node.container, f"ps -eo args | grep '^sleep {marker}' || true").strip()
            if not left or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert left == "", f"{node.container}: {left}"


@pytest.mark.timeout(180)
def test_shell_startup_noise_does_not_break_dispatch_status_or_stop(testcluster, tmp_path):
    spec = job_spec(testcluster, tmp_path, "it-noise", hosts=2, pservers=1, env={"STEPS": "3"})
    user = yaml.safe_load(spec.read_text())["ssh"]["user"]
    node = testcluster.nodes[0]
    home = node_exec(node.container, f"getent passwd {user} | cut -d: -f6").strip()
    rc = f"{home}/.bashrc"
    node_exec(node.container, f"cp -p {rc} {rc}.sec-orig 2>/dev/null || touch {rc}.sec-orig; "
                              f"{{ echo 'echo Welcome to this node'; printf 'printf \"motd-no-newline\"\\n'; "
                              f"cat {rc}.sec-orig; }} > {rc}.new && chown {user} {rc}.new && mv {rc}.new {rc}")
    try:
        noisy = clusterctl("exec", spec, "--", "true", check=True)
        assert "Welcome to this node" in noisy.stdout  # the noise is real
        clusterctl("dispatch", spec, check=True)
        clusterctl("start", spec, check=True)
        st = wait_state(spec, {"succeeded", "failed"}, timeout=60)
        assert st["state"] == "succeeded", st
        assert status_json(spec)["state"] == "succeeded"
        clusterctl("dispatch", spec, check=True)  # again, now from the cached manifests (hostws replies)
    finally:
        node_exec(node.container, f"mv {rc}.sec-orig {rc}")
        clusterctl("stop", spec)
    assert_no_orphans(testcluster, "it-noise", job_ports(spec), hosts=testcluster.nodes[:2])
