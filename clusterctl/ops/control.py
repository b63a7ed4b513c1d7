"""Asking a running job's host supervisor over its control socket: one round trip, no Python started on the host.

The host side is clusterctl/host/control.py (the protocol, the control file, the flood limits). Here is the one
shell line that asks it: bash builtins read the control file (`1 PID PORT CLIENT_SECRET SERVER_SECRET`, 0600 in
the 0700 job dir), check that the supervisor's pid is there, connect with bash's /dev/tcp, send
`CLIENT_SECRET COMMAND JSON`, and pass the body through once the supervisor proved itself (`ok SERVER_SECRET`
within CLIENT_HEADER_TIMEOUT). The secrets never reach an argv: `read` and `printf` are builtins. Where any of
that fails (no control file: the job ended or never started here; a dead supervisor; a shell without bash or
without /dev/tcp; a supervisor that does not answer in time or refuses the request), the same line runs the
agent instead (`python3 ... agent status|top|stop|logs`), which works from the state files, as before. When
that fallback is needed and this version's host package is not on the host, the line exits NEEDS_PACKAGE
having run nothing: the caller installs the package (`hosttools.install_on`) and asks those hosts again.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence

from ..errors import ClusterctlError
from ..host.controlproto import CLIENT_HEADER_TIMEOUT, CONTROL_FILE, CONTROL_VERSION, OK
from ..plan import Host
from ..quoting import join, quote
from ..remote import LineCallback, Remote, Result
from .hosttools import install_on, package_dir, tool_argv

__all__ = ["control_command", "ask", "agent_reply", "NEEDS_PACKAGE"]

# the line exits with this when the agent is needed and this version of the host package is not on the host
NEEDS_PACKAGE = 97


def control_command(jobdir: str, command: str, args: dict | None, fallback: list[str]) -> str:
    """The shell line that asks the supervisor of the job in `jobdir` (relative to the login's home) `command`
    with `args` over its control socket, or runs `agent FALLBACK...` where the supervisor cannot answer."""
    request = command if not args else f"{command} {json.dumps(args, sort_keys=True, separators=(',', ':'))}"
    agent = f"test -d {quote(package_dir())} || exit {NEEDS_PACKAGE}; exec {join(tool_argv('agent', fallback))}"
    script = (
        f"f={quote(jobdir + '/' + CONTROL_FILE)}; "
        f"if read -r v i p c s <\"$f\" && [ \"$v\" = {CONTROL_VERSION} ] && [ -d \"/proc/$i\" ]; then "
        f"{{ printf '%s %s\\n' \"$c\" {quote(request)} >&3 && IFS= read -r -t {CLIENT_HEADER_TIMEOUT:g} h <&3 && "
        f"[ \"$h\" = \"{OK} $s\" ] && exec cat <&3; }} 3<>\"/dev/tcp/127.0.0.1/$p\"; fi 2>/dev/null; "
        f"{agent}"
    )
    # the login shell may be any POSIX sh: a bash runs the script itself (no second shell), another shell hands
    # it to bash; without bash, the agent answers
    return (f"ctl={quote(script)}; if [ -n \"${{BASH_VERSION-}}\" ]; then eval \"$ctl\"; "
            f"elif command -v bash >/dev/null 2>&1; then exec bash -c \"$ctl\"; fi; {agent}")


def ask(remote: Remote, command: str | Callable[[Host], str], *, hosts: Sequence[Host] | None = None,
        timeout: float | None, what: str, on_line: LineCallback | None = None) -> dict[Host, Result]:
    """Run a control_command line on `hosts` (default: all); the hosts that need this version's host package for
    the fallback get it (one more round trip, those hosts only) and are asked again. Each host's Result (an
    install that failed: its Result)."""
    results = remote.run(command, hosts=hosts, check=False, timeout=timeout, what=what, on_line=on_line)
    missing = [h for h, r in results.items() if r.exit_code == NEEDS_PACKAGE]
    if missing:
        installed = install_on(remote, ("agent",), missing)
        again = [h for h in missing if installed[h].ok]
        results.update({h: installed[h] for h in missing if not installed[h].ok})
        if again:
            results.update(remote.run(command, hosts=again, check=False, timeout=timeout, what=what, on_line=on_line))
    return results


def agent_reply(res: Result) -> dict:
    """The agent's (or the supervisor's) JSON object in a host's output, whatever a shell's start-up printed before
    it; where there is none, `{"ok": False, "error": ...}` with the host's stderr (else stdout) tail. Its fields
    are the host's word: read them through HostStatus.from_json or check each one's type."""
    try:
        return res.reply()
    except ClusterctlError:
        return {"ok": False, "error": (res.stderr or res.stdout).strip()[-500:] or f"exit {res.exit_code}"}
