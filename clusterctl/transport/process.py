"""Transports whose command is a local process with pipes (the OpenSSH client; the local fake): starting it,
feeding its stdin, collecting its output, its deadline, and trying again a connection shed before the login."""

from __future__ import annotations

import os
import select
import subprocess
import threading
import time
from collections.abc import Callable, Iterable

from .host import Host
from .base import (UNREACHABLE, LineCallback, LineSplitter, Result, Running, Transport, timed_out_result,
                   unreachable_result)

__all__ = ["ProcessTransport", "ProcessRun", "CONNECT_TRIES"]

CONNECT_TRIES = 6  # a connection shed before the login is tried this many times in all
KILLED_DRAIN_S = 0.5  # a killed kept-connection session: how long its output may still take to end (collect_once)


class ProcessTransport(Transport):
    """A transport that runs each command as a local process (popen); subclasses say how, and may word
    their own failures (exit 255) and recognise a connection the server shed before the login."""

    def popen(self, host: Host, command: str) -> subprocess.Popen:
        """Start `command` for `host` with pipes on stdin, stdout and stderr."""
        raise NotImplementedError

    def spawn(self, host: Host, command: str, wait: bool = True) -> subprocess.Popen | None:
        """popen, or None when it may not start yet (wait=False; a transport that bounds new connections)."""
        return self.popen(host, command)

    def shed(self, stderr: str) -> bool:
        """Whether a failed try never reached the login (safe to try again); never, unless a subclass says."""
        return False

    def logged_in(self, proc) -> bool:
        """Whether the try `proc` is known to have logged in (then it ran, and is never tried again)."""
        return False

    def prelogin(self, line: str) -> bool:
        """Whether a stderr line is what a shed try prints (held back until the try's outcome is known)."""
        return False

    def failure_reason(self, host: Host, stderr: str) -> str:
        """One line for an exit 255 without output (the host not reached)."""
        said = [line.strip() for line in stderr.splitlines() if line.strip()]
        return f"connection to {host.label} lost: {said[-1] if said else 'ssh exited 255'}"

    def start(self, host: Host, command: str) -> "ProcessRun":
        """Start the process now (or in the background as soon as the transport allows)."""
        return ProcessRun(self, host, command)


class ProcessRun(Running):
    """One process started for one host; finish() feeds it and collects its Result."""

    def __init__(self, transport: ProcessTransport, host: Host, command: str,
                 proc: subprocess.Popen | None = None, start: float | None = None):
        self.transport, self.host, self.command = transport, host, command
        self.start_time = time.monotonic() if start is None else start
        self._ready = threading.Event()
        self._lock = threading.Lock()
        self._killed = False
        self._finishing = False  # a thread reads its output (finish): a kill ends the process only
        self._error: OSError | None = None
        self.proc = proc if proc is not None else transport.spawn(host, command, wait=False)
        if self.proc is not None:
            self._ready.set()
        else:  # its connection waits for a slot: started by a thread of its own, the caller goes on
            threading.Thread(target=self._spawn_later, daemon=True).start()

    def _spawn_later(self) -> None:
        try:
            proc = self.transport.spawn(self.host, self.command, wait=True)
        except OSError as exc:
            self._error = exc
            self._ready.set()
            return
        with self._lock:
            self.proc = proc
            killed = self._killed
        if killed:  # ended before anyone waiting on _ready looks at it
            _end(proc)
        self._ready.set()

    def finish(self, feed: Callable[[], Iterable[bytes]], timeout: float | None,
               on_line: LineCallback | None, max_output: int | None = None) -> Result:
        """Write what `feed()` yields to the process's stdin, close it, wait for the exit; the host's Result.

        A connection that the server (or a bastion) closed before the login (sshd's MaxStartups shedding a
        burst of new connections, as a bastion in front of many hosts sees) never ran the command, so it is
        tried again, a few times, with a jittered back-off."""
        self._ready.wait()
        if self._error is not None:
            raise self._error
        with self._lock:
            if self._killed:  # ended (its pipes closed) before this thread came to it
                return unreachable_result(self.host, self.command, "ended before it was finished",
                                          time.monotonic() - self.start_time)
            self._finishing = True
        host, command, start, proc = self.host, self.command, self.start_time, self.proc
        for attempt in range(CONNECT_TRIES):
            held = _PreLoginLines(on_line, self.transport.prelogin) if on_line is not None else None
            code, out, err = collect_once(host, proc, feed(), timeout, held, max_output)
            if code is None:
                if held is not None:
                    held.release()
                return timed_out_result(host, command, timeout, time.monotonic() - start)
            spent = time.monotonic() - start
            # a transport of another kind (a test's, a user's) may have no logged_in(): then stderr decides alone
            logged_in = getattr(self.transport, "logged_in", None)
            shed = code == UNREACHABLE and not out and not (logged_in and logged_in(proc)) and self.transport.shed(err)
            if not shed or attempt == CONNECT_TRIES - 1 or (
                    timeout is not None and spent > timeout / 2):
                if held is not None:
                    held.release()
                break
            time.sleep((0.1 + 0.2 * os.urandom(1)[0] / 255) * 2 ** min(attempt, 3))  # jittered, no `random` import
            with self._lock:
                if self._killed:  # ended meanwhile (the caller was interrupted): no new connection
                    break
            proc = self.proc = self.transport.spawn(host, command, wait=True)
        if code == UNREACHABLE and not out:
            return unreachable_result(host, command, self.transport.failure_reason(host, err), time.monotonic() - start)
        return Result(host, command, code, out, err, time.monotonic() - start)

    def kill(self) -> None:
        """End the process; one still waiting for a slot is ended when it starts. While a thread finishes it
        (reads its output), only the process is ended: that thread sees its end and closes the pipes."""
        with self._lock:
            self._killed = True
            proc, finishing = self.proc, self._finishing
        if proc is None:
            return
        if finishing:
            proc.kill()
        else:
            _end(proc)


def _end(proc: subprocess.Popen) -> None:
    proc.kill()
    proc.wait()
    for stream in (proc.stdin, proc.stdout, proc.stderr):
        stream.close()


def collect_once(host: Host, proc: subprocess.Popen, chunks: Iterable[bytes], timeout,
                 on_line: LineCallback | None, max_output: int | None = None) -> tuple[int | None, str, str]:
    """One process to its end: (exit code, stdout, stderr); exit code None when it timed out. `max_output`: as
    for Running.finish."""
    outputs: dict[str, str] = {}
    callback_failed: list[Exception] = []

    def drain(name: str, stream) -> None:
        lines = LineSplitter(host, name, on_line, max_output if name == "out" else None)
        try:
            while chunk := stream.read1(65536):
                lines.feed(chunk)
            outputs[name] = lines.close()
        except Exception as exc:  # the line callback failed: read on (a command whose output is not read never
            callback_failed.append(exc)  # ends: it waits on a full pipe), and say it in the caller's thread
            while stream.read1(65536):
                pass

    readers = [threading.Thread(target=drain, args=(n, s), daemon=True) for n, s in (("out", proc.stdout), ("err", proc.stderr))]
    for t in readers:
        t.start()
    if timeout is None:
        try:
            _write_stdin(proc, chunks)
        except BaseException:  # the local stream failed: the command would wait for the rest of its stdin
            proc.kill()
            proc.wait()
            raise
        code = proc.wait()
    else:  # the deadline covers writing stdin too: a command that never reads it must not block us past it
        failed: list[BaseException] = []
        writer = threading.Thread(target=_write_stdin, args=(proc, chunks, failed), daemon=True)
        deadline = time.monotonic() + timeout
        writer.start()
        writer.join(timeout)
        try:  # a local stream that failed ends the command at once: it would wait for the rest of its stdin
            code = None if failed else wait_until(proc, deadline)
        except subprocess.TimeoutExpired:
            code = None
        if code is None or failed:
            proc.kill()
            proc.wait()
            writer.join(5)  # its next write fails now that the process is gone
        if failed:
            raise failed[0]  # the local stream failed (not the host): as without a deadline
        if code is None:
            return None, "", ""
    for t in readers:
        # a killed session of a kept connection: its master holds our pipes' other ends until the host's side of
        # the session is gone, which a quiet command (a followed log) notices only at its next write; not waited for
        t.join(KILLED_DRAIN_S if getattr(proc, "killed", False) else None)
    if callback_failed:
        raise callback_failed[0]
    return code, outputs.get("out", ""), outputs.get("err", "")


def wait_until(proc, deadline: float) -> int:
    """proc's exit code once it ended, by time.monotonic() `deadline` at the latest (else TimeoutExpired).

    Popen.wait(timeout) looks for the exit in a loop that sleeps up to 50 ms between looks, so a command
    that ended waited for the next look: ~40 ms on every `start` over new connections. Here the wait is
    a pidfd (Linux), readable the moment the process ends; elsewhere, Popen's own wait.
    """
    if not isinstance(proc, subprocess.Popen) or proc.poll() is not None:
        return proc.wait(timeout=max(0.0, deadline - time.monotonic()))
    try:
        fd = os.pidfd_open(proc.pid)
    except (AttributeError, OSError):  # no pidfd here (not Linux 5.3+), or the process is already reaped
        return proc.wait(timeout=max(0.0, deadline - time.monotonic()))
    try:
        poller = select.poll()  # not select(): a big fan-out's descriptors pass FD_SETSIZE
        poller.register(fd, select.POLLIN)
        while proc.returncode is None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise subprocess.TimeoutExpired(proc.args, None)
            if poller.poll(max(1, int(left * 1000 + 1))):
                return proc.wait()
    finally:
        os.close(fd)
    return proc.returncode


def _write_stdin(proc: subprocess.Popen, chunks: Iterable[bytes], failed: list | None = None) -> None:
    """Write `chunks` to the process's stdin and close it. The process ending early (or being ended at the
    deadline) only stops the writing: its exit code and stderr say why. An error of the local stream itself
    is raised, or with `failed` given (a writer thread) put there."""
    try:
        for chunk in chunks:
            try:
                proc.stdin.write(chunk)
            except (BrokenPipeError, ValueError):  # ValueError: stdin closed because the process was ended
                return
        try:
            proc.stdin.close()
        except (BrokenPipeError, ValueError):
            pass
    except BaseException as exc:
        if failed is None:
            raise
        failed.append(exc)


class _PreLoginLines:
    """An on_line callback that holds back ssh's pre-login stderr lines until the try's outcome is known:
    shown as they were when the try stands, dropped when it was shed and is tried again (measured: 23 of
    64 connections through one bastion shed, each printing two such lines for a command that succeeded)."""

    def __init__(self, on_line: LineCallback, prelogin: Callable[[str], bool]):
        self._on_line, self._prelogin, self._held, self._passed = on_line, prelogin, [], False
        self._lock = threading.Lock()

    HOLD = 16  # ssh says a line or two before a shed; a host that sends such lines without end is not one

    def __call__(self, host: Host, stream: str, line: str) -> None:
        """Hold a pre-login line; pass anything else on (after what was held)."""
        with self._lock:
            if not self._passed and stream == "err" and self._prelogin(line) and len(self._held) < self.HOLD:
                self._held.append((host, stream, line))
                return
            self._passed = True
            held, self._held = self._held, []
        for item in held:
            self._on_line(*item)
        self._on_line(host, stream, line)

    def release(self) -> None:
        """The try stands: show what was held."""
        with self._lock:
            held, self._held = self._held, []
        for item in held:
            self._on_line(*item)
