"""The PMI-1 wire format (MPICH's "simple PMI"), clusterctl's hello/ready lines and their MACs.

Pure functions shared by the server (:mod:`clusterctl.collective.pmi`) and the rank side
(:mod:`clusterctl.collective.pmiclient`). A PMI-1 command is one line ``cmd=NAME key=value ...``;
MPICH's spawn is the multi-line ``mcmd=spawn`` form, one ``key=value`` per line, each command segment
ending with ``endcmd`` (src/pmi/src/pmi_wire.c, ``PMIU_msg_set_query_spawn``).
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass, field
from typing import Sequence

from .errors import CollectiveError

__all__ = ["HELLO", "READY", "TOKEN_ENV", "AUTH_ENV", "NODE_ENV", "parse_command", "format_command",
           "process_mapping", "hello_mac", "ready_mac", "SpawnCommand", "SpawnRequest", "parse_spawn"]

HELLO = "clusterctl_hello"
READY = "clusterctl_ready"
#: The job's shared secret for its processes (set by the host supervisor; never in argv or logs).
TOKEN_ENV = "CLUSTERCTL_JOB_TOKEN"
#: ``none`` when the spec said ``job.auth: none`` (then the servers serve without a token, loudly).
AUTH_ENV = "CLUSTERCTL_AUTH"
#: Overrides the node name a rank registers with (tests: several fake nodes on one host).
NODE_ENV = "CLUSTERCTL_COLLECTIVE_PMI_NODE"

#: Bounds of one spawn request (MPI_Comm_spawn / Spawn_multiple).
MAX_SPAWN_PROCS = 1024
MAX_SPAWN_CMDS = 64
MAX_SPAWN_ARGS = 4096


def hello_mac(token: str, rank, size, host, pid, nonce) -> str:
    """HMAC-SHA256 (hex) of a clusterctl_hello's fields, keyed by the job token."""
    msg = "\0".join(("clusterctl-pmi-hello/1", str(rank), str(size), str(host), str(pid), str(nonce)))
    return hmac.new(token.encode(), msg.encode(), hashlib.sha256).hexdigest()


def ready_mac(token: str, nonce, rc, kvsname, mapping, pmiid, msg) -> str:
    """HMAC-SHA256 (hex) the server puts on its ready answer: over the rank's hello nonce and every field,
    so a rank acts on nothing (spawn orders included) from a server that does not hold the job token."""
    text = "\0".join(("clusterctl-pmi-ready/1", str(nonce), str(rc), str(kvsname), str(mapping), str(pmiid),
                      str(msg)))
    return hmac.new(token.encode(), text.encode(), hashlib.sha256).hexdigest()


def _unescape(value: str) -> str:
    if "\\" not in value:
        return value
    out, i = [], 0
    while i < len(value):
        if value[i] == "\\" and i + 1 < len(value):
            out.append(value[i + 1])
            i += 2
        else:
            out.append(value[i])
            i += 1
    return "".join(out)


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace(" ", "\\ ").replace("\n", " ")


def parse_command(line: str) -> tuple[str, dict[str, str]]:
    """Parse one PMI-1 wire line ``cmd=NAME key=value ...`` (backslash escapes) into (NAME, attrs)."""
    line = line.strip("\n")
    if not line.startswith("cmd="):
        raise CollectiveError(f"malformed PMI command {line[:80]!r}: expected 'cmd=...'")
    tokens, cur, i = [], [], 0
    while i < len(line):
        ch = line[i]
        if ch == "\\" and i + 1 < len(line):
            cur.append(line[i:i + 2])
            i += 2
            continue
        if ch == " ":
            if cur:
                tokens.append("".join(cur))
                cur = []
        else:
            cur.append(ch)
        i += 1
    if cur:
        tokens.append("".join(cur))
    attrs: dict[str, str] = {}
    for tok in tokens:
        key, _, value = tok.partition("=")
        attrs[key] = _unescape(value)
    return attrs.pop("cmd"), attrs


def format_command(cmd: str, **attrs) -> bytes:
    """One PMI-1 wire line ``cmd=NAME key=value ...\\n`` (spaces in values escaped)."""
    parts = [f"cmd={cmd}"] + [f"{k}={_escape(str(v))}" for k, v in attrs.items()]
    return (" ".join(parts) + "\n").encode()


def process_mapping(node_of: Sequence[int]) -> str:
    """MPICH's ``PMI_process_mapping`` for the node index of every rank, e.g. ``(vector,(0,2,4))``."""
    runs: list[list[int]] = []                   # [node, count] of consecutive same-node ranks
    for node in node_of:
        if runs and runs[-1][0] == node:
            runs[-1][1] += 1
        else:
            runs.append([node, 1])
    blocks: list[list[int]] = []                 # [first node, node count, ranks per node]
    for node, count in runs:
        last = blocks[-1] if blocks else None
        if last and last[2] == count and last[0] + last[1] == node:
            last[1] += 1
        else:
            blocks.append([node, 1, count])
    return "(vector," + ",".join(f"({a},{b},{c})" for a, b, c in blocks) + ")"


@dataclass
class SpawnCommand:
    """One command of a spawn request: ``nprocs`` copies of ``argv``, with MPI_Info keys."""

    argv: list[str]
    nprocs: int
    info: dict[str, str] = field(default_factory=dict)


@dataclass
class SpawnRequest:
    """A parsed ``mcmd=spawn`` message: its commands and the keys to pre-put in the new world's KVS."""

    commands: list[SpawnCommand]
    preput: dict[str, str]

    @property
    def total(self) -> int:
        """Number of processes the request starts."""
        return sum(c.nprocs for c in self.commands)


def _count(seg: dict[str, str], key: str, lo: int, hi: int, default: int | None = None) -> int:
    raw = seg.get(key)
    if raw is None and default is not None:
        return default
    try:
        value = int(raw)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise CollectiveError(f"spawn: {key}={raw!r} is not an integer") from None
    if not lo <= value <= hi:
        raise CollectiveError(f"spawn: {key}={value} out of range {lo}..{hi}")
    return value


def parse_spawn(lines: Sequence[str]) -> SpawnRequest:
    """Parse the lines of one ``mcmd=spawn`` message (from the first ``mcmd=spawn`` to the last ``endcmd``).

    Values are taken as sent: MPICH's client does not escape them in this form (a value runs to the end
    of its line).
    """
    segments: list[dict[str, str]] = []
    cur: dict[str, str] | None = None
    for line in lines:
        if line == "mcmd=spawn":
            cur = {}
            continue
        if line == "endcmd":
            if cur is None:
                raise CollectiveError("spawn: 'endcmd' outside a command")
            segments.append(cur)
            cur = None
            continue
        if cur is None:
            raise CollectiveError(f"spawn: {line[:60]!r} outside a command")
        key, eq, value = line.partition("=")
        if not eq:
            raise CollectiveError(f"spawn: malformed line {line[:60]!r}")
        cur[key] = value
    if cur is not None or not segments:
        raise CollectiveError("spawn: message does not end with 'endcmd'")
    total = _count(segments[0], "totspawns", 1, MAX_SPAWN_CMDS)
    if len(segments) != total:
        raise CollectiveError(f"spawn: totspawns={total} but {len(segments)} command(s) sent")
    preput: dict[str, str] = {}
    for i in range(_count(segments[0], "preput_num", 0, 64, default=0)):
        key, value = segments[0].get(f"preput_key_{i}"), segments[0].get(f"preput_val_{i}")
        if key is None or value is None:
            raise CollectiveError(f"spawn: preput_key_{i}/preput_val_{i} missing")
        preput[key] = value
    commands = []
    for seg in segments:
        execname = seg.get("execname")
        if not execname:
            raise CollectiveError("spawn: a command without execname")
        argc = _count(seg, "argcnt", 0, MAX_SPAWN_ARGS, default=0)
        args = []
        for i in range(1, argc + 1):
            if f"arg{i}" not in seg:
                raise CollectiveError(f"spawn: argcnt={argc} but arg{i} missing")
            args.append(seg[f"arg{i}"])
        info = {}
        for i in range(_count(seg, "info_num", 0, 256, default=0)):
            key, value = seg.get(f"info_key_{i}"), seg.get(f"info_val_{i}")
            if key is None or value is None:
                raise CollectiveError(f"spawn: info_key_{i}/info_val_{i} missing")
            info[key] = value
        commands.append(SpawnCommand([execname, *args], _count(seg, "nprocs", 0, MAX_SPAWN_PROCS), info))
    request = SpawnRequest(commands, preput)
    if request.total < 1:
        raise CollectiveError("spawn: no process asked for")
    if request.total > MAX_SPAWN_PROCS:
        raise CollectiveError(f"spawn: {request.total} processes asked, at most {MAX_SPAWN_PROCS} per spawn")
    return request
