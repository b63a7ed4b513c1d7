"""clusterctl.procs.run_session: a helper program to its end or its deadline, with what it started; with `tail`,
only the end of its output held (a pod's `kubectl exec` output is the pod's to choose)."""

from __future__ import annotations

import hashlib
import subprocess
import sys
import time

import pytest

from clusterctl.procs import run_session

PY = sys.executable


def test_without_tail_it_is_communicate():
    res = run_session([PY, "-c", "import sys; sys.stdout.write(sys.stdin.read().upper()); sys.stderr.write('w')"],
                      timeout=30, input=b"abc")
    assert (res.returncode, res.stdout, res.stderr) == (0, b"ABC", b"w")


def test_tail_keeps_the_end_of_each_stream_and_feeds_stdin_whole():
    body = bytes(range(256)) * 4096  # 1 MiB of stdin: more than a pipe holds, so writing and reading interleave
    code = ("import sys, hashlib; d = sys.stdin.buffer.read(); "
            "[sys.stdout.buffer.write(b'x' * 65536) for _ in range(200)]; sys.stderr.write('e' * 300000); "
            "print(hashlib.sha256(d).hexdigest(), len(d)); sys.exit(3)")
    res = run_session([PY, "-c", code], timeout=60, input=body, tail=4096)
    assert res.returncode == 3 and len(res.stdout) == 4096 and len(res.stderr) == 4096
    assert res.stdout.endswith(f"{hashlib.sha256(body).hexdigest()} {len(body)}\n".encode())
    assert res.stderr == b"e" * 4096


def test_tail_with_a_short_output_keeps_all_of_it_and_no_stdin_is_fine():
    res = run_session([PY, "-c", "print('hi')"], timeout=30, tail=1 << 20)
    assert (res.returncode, res.stdout, res.stderr) == (0, b"hi\n", b"")
    res = run_session([PY, "-c", "import sys; print(len(sys.stdin.read()))"], timeout=30, input=b"", tail=10)
    assert res.stdout == b"0\n"


def test_a_program_that_does_not_read_its_stdin_is_not_waited_on():
    res = run_session([PY, "-c", "import os; os.close(0); print('done')"], timeout=30, input=b"z" * (4 << 20), tail=100)
    assert (res.returncode, res.stdout) == (0, b"done\n")


@pytest.mark.parametrize("tail", [None, 1024])
def test_the_deadline_ends_the_program_and_what_it_started(tmp_path, tail):
    pidfile = tmp_path / "child"
    code = (f"import subprocess, sys, time; p = subprocess.Popen([{PY!r}, '-c', 'import time; time.sleep(60)']); "
            f"open({str(pidfile)!r}, 'w').write(str(p.pid)); sys.stdout.write('y' * 100000); sys.stdout.flush(); "
            "time.sleep(60)")
    t0 = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        run_session([PY, "-c", code], timeout=2, tail=tail)
    assert time.monotonic() - t0 < 15
    child = int(pidfile.read_text())
    for _ in range(100):  # killed with its group; reaped by init once its parent is gone
        try:
            with open(f"/proc/{child}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    break
        except FileNotFoundError:
            break
        time.sleep(0.05)
    else:
        raise AssertionError(f"pid {child} outlived the deadline")
