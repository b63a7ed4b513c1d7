"""The parameter-server runtime on the test cluster: fit_a_line through clusterctl, and a trainer killed -9."""

from __future__ import annotations

import re
import time

import pytest

from clusterlib import ROOT, clusterctl, docker, status_json, tagged_pids, write_spec

pytestmark = pytest.mark.integration


def fit_a_line_spec(info, tmp_path, name, *, args=(), sync="sync", base=7400):
    spec = write_spec(
        info, tmp_path / f"{name}.yaml", name=name, hosts=3,
        workspace={"local": str(ROOT / "examples" / "fit_a_line"), "remote": f"clusterctl-it/{name}"},
        job={"mode": "pserver", "entrypoint": ["/opt/venv/bin/python", "train.py"], "args": list(args),
             "pservers": 2, "trainers": 1, "sync": sync, "k_steps": 10, "grace": 3,
             "ports": {"control": base, "master": base + 1, "pserver": base + 2, "trainer": base + 10}},
    )
    clusterctl("stop", spec)
    return spec


@pytest.mark.parametrize("mode", ["sync", "async", "geo"])
@pytest.mark.timeout(180)
def test_fit_a_line_converges_on_three_nodes(clusterctl_on_nodes, tmp_path, mode):
    spec = fit_a_line_spec(clusterctl_on_nodes, tmp_path, f"it-fal-{mode}", sync=mode)
    clusterctl("dispatch", spec, check=True)
    res = clusterctl("start", spec, "--follow", timeout=150)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr
    done = re.findall(r"trainer\.(\d)\] done steps=\d+ loss=([\d.]+) .* mode=(\w+)", res.stdout)
    assert sorted(t for t, _, _ in done) == ["0", "1", "2"], res.stdout[-3000:]
    assert all(m == mode and float(loss) < 10 for _, loss, m in done), done  # the seed's "avg cost < 10"
    final = status_json(spec)
    assert final["state"] == "succeeded"
    assert {p["state"] for p in final["processes"] if p["role"] == "pserver"} <= {"exited", "stopped"}


@pytest.mark.timeout(180)
def test_trainer_killed_with_sigkill_fails_the_job_without_orphans(clusterctl_on_nodes, tmp_path):
    info = clusterctl_on_nodes
    spec = fit_a_line_spec(info, tmp_path, "it-fal-kill", args=["--step-delay", "0.05", "--passes", "200"], base=7440)
    clusterctl("dispatch", spec, check=True)
    clusterctl("start", spec, check=True)
    time.sleep(2)
    st = status_json(spec)
    victim = next(p for p in st["processes"] if p["role"] == "trainer" and p["id"] == 1)
    node = next(n for n in info.nodes if n.ip == victim["host"])
    docker("exec", node.container, "kill", "-9", str(victim["pid"]))
    t0 = time.monotonic()
    deadline = t0 + 30
    while (st := status_json(spec))["state"] != "failed" and time.monotonic() < deadline:
        time.sleep(0.5)
    assert st["state"] == "failed", st
    assert time.monotonic() - t0 < 15
    by = {(p["role"], p["id"]): p for p in st["processes"]}
    assert by[("trainer", 1)]["exit_code"] == -9
    assert "trainer.1" in st["reason"]
    deadline = time.monotonic() + 15
    while any(tagged_pids(n.container, "it-fal-kill") for n in info.nodes[:3]) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not any(tagged_pids(n.container, "it-fal-kill") for n in info.nodes[:3])
