"""Sampling processes on a host (clusterctl/host/metrics.py): /proc and nvidia-smi parsing with fixture text, and
the Sampler on real process trees of this machine (a fake `nvidia-smi` where a GPU is needed)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from clusterctl.host import metrics
from clusterctl.host.metrics import (Sampler, parse_apps_csv, parse_cpu_line, parse_gpu_csv, parse_meminfo, parse_stat,
                                     query_gpus, scan_procs, tree_of, visible_devices)

sys.path.insert(0, os.path.dirname(__file__))
from fakehosts import fake_exe, wait_until  # noqa: E402

# /proc/<pid>/stat of a process whose name has a space and a parenthesis in it
STAT = (b"4242 (python3 (x) y) S 4200 4242 4242 0 -1 4194304 5230 0 0 0 150 30 7 3 20 0 2 0 987654 "
        b"33554432 2048 18446744073709551615 1 1 0 0 0 0 0 16781312 2 0 0 0 17 1 0 0 0 0 0\n")


def test_parse_stat():
    assert parse_stat(STAT) == ("S", 4200, 4242, 150 + 30 + 7 + 3, 987654, 2048)
    assert parse_stat(b"garbage") is None and parse_stat(b"1 (x) S 1 2") is None


def test_a_tree_is_the_process_group_and_the_descendants():
    procs = {  # pid: (state, ppid, pgid, ticks, start, rss)
        10: ("S", 1, 10, 5, 100, 1), 11: ("S", 10, 10, 5, 101, 1), 12: ("S", 11, 12, 5, 102, 1),  # 12: setsid child
        13: ("S", 1, 10, 5, 103, 1),  # reparented to init, still in the group
        20: ("S", 1, 20, 5, 200, 1), 21: ("S", 20, 20, 5, 201, 1),
    }
    assert tree_of(procs, 10) == [10, 11, 12, 13]
    assert tree_of(procs, 10, 100) == [10, 11, 12, 13]
    assert tree_of(procs, 10, 999) == []  # the pid was reused by another process
    assert tree_of(procs, 11) == [11, 12]  # not a group leader: its descendants only
    assert tree_of(procs, 30) == []


def test_meminfo_and_the_cpu_line():
    mem = parse_meminfo("MemTotal:       16384000 kB\nMemAvailable:    8192000 kB\nHugePages_Total:       0\n")
    assert mem == {"MemTotal": 16384000 * 1024, "MemAvailable": 8192000 * 1024, "HugePages_Total": 0}
    # user nice system idle iowait irq softirq steal guest guest_nice
    assert parse_cpu_line("cpu  100 5 50 800 20 1 2 3 0 0\ncpu0 1 2 3\n") == (100 + 5 + 50 + 1 + 2 + 3, 981)
    assert parse_cpu_line("intr 1 2 3") is None and parse_cpu_line("cpu x y") is None


GPU_CSV = """\
0, GPU-6f1c2b8e-aaaa-bbbb-cccc-000000000000, 87, 40213, 81559
1, GPU-0a9d4e21-aaaa-bbbb-cccc-111111111111, 0, 4, 81559
2, GPU-77777777-aaaa-bbbb-cccc-222222222222, [N/A], [N/A], 81559
garbage line
"""
APPS_CSV = """\
4242, GPU-6f1c2b8e-aaaa-bbbb-cccc-000000000000, 40200
4243, GPU-0a9d4e21-aaaa-bbbb-cccc-111111111111, [Not Supported]
"""


def test_nvidia_smi_csv():
    gpus = parse_gpu_csv(GPU_CSV)
    assert gpus == [
        {"index": 0, "uuid": "GPU-6f1c2b8e-aaaa-bbbb-cccc-000000000000", "util_pct": 87.0, "mem_used_mib": 40213.0,
         "mem_total_mib": 81559.0},
        {"index": 1, "uuid": "GPU-0a9d4e21-aaaa-bbbb-cccc-111111111111", "util_pct": 0.0, "mem_used_mib": 4.0,
         "mem_total_mib": 81559.0},
        {"index": 2, "uuid": "GPU-77777777-aaaa-bbbb-cccc-222222222222", "util_pct": None, "mem_used_mib": None,
         "mem_total_mib": 81559.0},
    ]
    assert parse_apps_csv(APPS_CSV) == [
        {"pid": 4242, "gpu_uuid": "GPU-6f1c2b8e-aaaa-bbbb-cccc-000000000000", "used_mib": 40200.0},
        {"pid": 4243, "gpu_uuid": "GPU-0a9d4e21-aaaa-bbbb-cccc-111111111111", "used_mib": None}]
    assert parse_apps_csv("No running processes found\n") == [] and parse_apps_csv("") == []


def test_visible_devices():
    gpus = parse_gpu_csv(GPU_CSV)
    assert visible_devices(None, gpus) is None
    assert visible_devices("0,2", gpus) == [0, 2]
    assert visible_devices("GPU-0a9d4e21", gpus) == [1]  # a UUID prefix, as CUDA takes it
    assert visible_devices("1,-1,0", gpus) == [1]  # CUDA stops at the first invalid entry
    assert visible_devices("", gpus) == [] and visible_devices("MIG-abc", gpus) == []


def test_nvidia_smi_answers_late_or_fails(tmp_path):
    ok = fake_exe(tmp_path, "smi-ok", f"""\
        case "$1" in --query-gpu=*) printf '%s' '{GPU_CSV}';; --query-compute-apps=*) printf '%s' '{APPS_CSV}';; esac
        """)
    gpus, apps, error = query_gpus(str(ok))
    assert (len(gpus), len(apps), error) == (3, 2, None)
    slow = fake_exe(tmp_path, "smi-slow", "exec sleep 30\n")
    t0 = time.monotonic()
    assert query_gpus(str(slow), timeout=0.5) == (None, [], "smi-slow did not answer within 0.5s")
    assert time.monotonic() - t0 < 10
    broken = fake_exe(tmp_path, "smi-broken", "echo 'NVIDIA-SMI has failed because it could not communicate' >&2; exit 9\n")
    assert query_gpus(str(broken)) == (None, [], "smi-broken: NVIDIA-SMI has failed because it could not communicate")
    assert query_gpus(str(tmp_path / "absent"))[2].startswith("cannot run ")


# A trainer that burns CPU in itself and keeps a sleeping child (its tree: 2 processes), in a session of its own
# as the supervisor starts it; it prints its pid and its child's once both run.
BUSY = textwrap.dedent("""\
    import subprocess, sys, time
    child = subprocess.Popen([sys.executable, "-c", "import time; b = bytearray(20 << 20); time.sleep(600)"])
    print(child.pid, flush=True)
    x = 0
    while True:
        x += 1
    """)


@pytest.fixture
def busy():
    p = subprocess.Popen([sys.executable, "-c", BUSY], stdout=subprocess.PIPE, text=True, start_new_session=True)
    child = int(p.stdout.readline())
    yield p, child
    os.killpg(p.pid, signal.SIGKILL)
    p.wait()


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def _ticks(pid: int) -> int:
    with open(f"/proc/{pid}/stat", "rb") as f:
        return parse_stat(f.read())[3]


def test_the_sampler_measures_a_process_tree(busy, tmp_path, monkeypatch):
    p, child = busy
    wait_until(lambda: _rss(child) > 20 << 20, timeout=30)  # the child's 20 MiB are in
    start = scan_procs()[p.pid][4]
    target = {"key": "trainer.0", "pid": p.pid, "start_ticks": start, "log": None, "rank": "0"}
    gone = {"key": "trainer.1", "pid": p.pid, "start_ticks": start + 1, "log": None, "rank": "1"}  # a reused pid
    monkeypatch.setenv("PATH", str(tmp_path))  # no nvidia-smi: no GPU figures at all
    sampler = Sampler()
    t0, c0 = time.monotonic(), _ticks(p.pid)
    res, host = sampler.resources([target, gone], wait=0.5)
    elapsed, used = time.monotonic() - t0, _ticks(p.pid) - c0
    got = res["trainer.0"]
    assert res["trainer.1"] is None
    assert got["procs"] == 2 and "gpus" not in got and "gpus" not in host
    # against /proc: the tree's RSS is the two processes' VmRSS (within what moves between the two reads)
    want = _rss(p.pid) + _rss(child)
    assert abs(got["rss_bytes"] - want) < 0.1 * want, (got, want)
    # CPU: the busy loop's ticks over the sampler's window, as /proc counted them around it
    assert 0 < got["cpu_pct"] <= 100 * os.cpu_count()
    assert got["cpu_pct"] <= used / os.sysconf("SC_CLK_TCK") / 0.5 * 100 + 5, (got, used, elapsed)
    assert host["ncpu"] >= 1 and 0 <= host["cpu_pct"] <= 100 and 0 < host["mem_available"] <= host["mem_total"]
    # the next sample measures since this one, without waiting (once the loop has used some CPU since)
    after = _ticks(p.pid)
    wait_until(lambda: _ticks(p.pid) >= after + 5, timeout=30)
    t0 = time.monotonic()
    res, _ = Sampler.from_json(sampler.to_json()).resources([target], wait=5)
    assert time.monotonic() - t0 < 4 and res["trainer.0"]["cpu_pct"] > 0


def test_gpu_columns_come_from_nvidia_smi(busy, tmp_path, monkeypatch):
    p, child = busy
    fake_exe(tmp_path, "nvidia-smi", f"""\
        case "$1" in
          --query-gpu=*) printf '%s' '{GPU_CSV}';;
          --query-compute-apps=*) printf '{child}, GPU-6f1c2b8e-aaaa-bbbb-cccc-000000000000, 1000\\n9, GPU-x, 5\\n';;
        esac
        """)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    start = scan_procs()[p.pid][4]
    targets = [{"key": "trainer.0", "pid": p.pid, "start_ticks": start, "log": None, "cuda_visible_devices": None},
               {"key": "trainer.1", "pid": p.pid, "start_ticks": start, "log": None, "cuda_visible_devices": "1,2"}]
    res, host = Sampler().resources(targets, wait=0)
    assert res["trainer.0"]["cpu_pct"] is None  # wait=0: no second sample, no CPU %
    assert [g["index"] for g in res["trainer.0"]["gpus"]] == [0]  # not set: the GPU its tree uses
    assert res["trainer.0"]["gpu_mem_mib"] == 1000.0
    assert [g["index"] for g in res["trainer.1"]["gpus"]] == [1, 2]  # CUDA_VISIBLE_DEVICES names them
    assert [g["index"] for g in host["gpus"]] == [0, 1, 2] and "gpu_error" not in host


def test_a_damaged_cache_gives_a_fresh_sampler():
    for bad in ({}, {"version": 2}, {"version": 1, "cpu": {"1:2": "x"}}, {"version": 1, "logs": [{"nopath": 1}]},
                {"version": 1, "host_cpu": [1]}):
        s = Sampler.from_json(bad)
        assert (s.cpu, s.host_cpu, s.logs) == ({}, None, {})


def test_progress_per_target(tmp_path):
    log = tmp_path / "trainer.0.log"
    log.write_text("step=4 loss=2 time=100\nstep=6 loss=1 time=102\n")
    s = Sampler()
    got = s.progress([{"key": "trainer.0", "log": str(log), "rank": "0"},
                      {"key": "trainer.1", "log": str(tmp_path / "missing.log"), "rank": "1"}], now=103.0)
    assert got["trainer.0"]["progress"]["step"] == 6 and got["trainer.0"]["progress"]["rate"] == pytest.approx(2 / 3, abs=1e-4)  # 2 steps in 3 s
    assert got["trainer.1"] == {"progress": None}
    assert metrics.dumps(s.to_json())  # JSON-able
