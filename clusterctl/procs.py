"""Running a helper program (`ssh -G`, `kubectl`) to its end or its deadline, with everything it started.

A helper run in the controller's own process group leaves what it started behind when it is killed at its
deadline: the commands of an ssh config's `Match exec`, a kubectl auth plugin (`exec:` credentials). Run in a
session of its own, the whole group is killed: at the deadline, and when the caller is interrupted.
"""

from __future__ import annotations

import os
import signal
import subprocess

__all__ = ["run_session"]


def run_session(argv: list[str], *, timeout: float, input: bytes | None = None) -> subprocess.CompletedProcess:
    """`argv`'s CompletedProcess (stdout, stderr as bytes); subprocess.TimeoutExpired once `timeout` passed, the
    program and what it started killed. FileNotFoundError (and other OSError) when it cannot start."""
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE if input is not None else subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(input, timeout=timeout)
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
