"""Running a helper program (`ssh -G`, `kubectl`) to its end or its deadline, with everything it started.

A helper run in the controller's own process group leaves what it started behind when it is killed at its
deadline: the commands of an ssh config's `Match exec`, a kubectl auth plugin (`exec:` credentials). Run in a
session of its own, the whole group is killed: at the deadline, and when the caller is interrupted.
"""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import time

__all__ = ["run_session"]


def run_session(argv: list[str], *, timeout: float, input: bytes | None = None,
                tail: int | None = None) -> subprocess.CompletedProcess:
    """`argv`'s CompletedProcess (stdout, stderr as bytes); subprocess.TimeoutExpired once `timeout` passed, the
    program and what it started killed. FileNotFoundError (and other OSError) when it cannot start. `tail`: keep
    only the last `tail` bytes of each stream, the rest dropped as it comes (what a pod prints through `kubectl
    exec` is the pod's to choose: a compromised one must not fill the controller's memory)."""
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE if input is not None else subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        if tail is None:
            stdout, stderr = proc.communicate(input, timeout=timeout)
        else:
            stdout, stderr = _communicate_tail(proc, input, time.monotonic() + timeout, tail)
    finally:
        if proc.returncode is None:  # timed out, or interrupted: the program and what it started, not only it
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
            for pipe in (proc.stdin, proc.stdout, proc.stderr):
                if pipe is not None:
                    pipe.close()
    return subprocess.CompletedProcess(argv, proc.returncode, stdout, stderr)


def _communicate_tail(proc: subprocess.Popen, data: bytes | None, deadline: float, tail: int) -> tuple[bytes, bytes]:
    """proc.communicate(data) by the deadline, keeping the last `tail` bytes of stdout and of stderr."""
    kept = {proc.stdout: bytearray(), proc.stderr: bytearray()}
    with selectors.DefaultSelector() as sel:
        for stream in kept:
            os.set_blocking(stream.fileno(), False)
            sel.register(stream, selectors.EVENT_READ)
        view, sent = memoryview(data or b""), 0
        if proc.stdin is not None:
            if view:
                os.set_blocking(proc.stdin.fileno(), False)
                sel.register(proc.stdin, selectors.EVENT_WRITE)
            else:
                proc.stdin.close()
        while sel.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                raise subprocess.TimeoutExpired(proc.args, 0)
            for key, _ in sel.select(left):
                stream = key.fileobj
                if stream is proc.stdin:
                    try:
                        sent += os.write(stream.fileno(), view[sent:sent + 65536])
                    except BlockingIOError:
                        continue
                    except BrokenPipeError:  # it exited without reading all of it: as communicate() takes it
                        sent = len(view)
                    if sent >= len(view):
                        sel.unregister(stream)
                        stream.close()
                    continue
                try:
                    chunk = os.read(stream.fileno(), 65536)
                except BlockingIOError:
                    continue
                if not chunk:
                    sel.unregister(stream)
                    continue
                buf = kept[stream]
                buf += chunk
                if len(buf) > 2 * tail:  # trimmed now and then: not a copy of `tail` bytes per chunk
                    del buf[:-tail]
    proc.wait(max(deadline - time.monotonic(), 0.001))
    return bytes(kept[proc.stdout][-tail:] if tail else b""), bytes(kept[proc.stderr][-tail:] if tail else b"")
