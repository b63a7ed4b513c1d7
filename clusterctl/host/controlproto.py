"""The control socket's contract, shared by the supervisor (clusterctl/host/control.py) and the controller's
one-line client (clusterctl/ops/control.py): the control file, the request line, the answer's first line.

Kept apart from the server so that the controller imports the contract, not the supervisor's socket code.
Stdlib only, Python 3.9 (the host package).
"""

import json
import math
import os

from .jobfile import ROLES

__all__ = ["CONTROL_FILE", "CONTROL_VERSION", "COMMANDS", "MAX_REQUEST", "CLIENT_HEADER_TIMEOUT", "OK", "ERROR",
           "RequestError", "parse_request", "read_control"]

CONTROL_FILE = "control"  # in the job dir, 0600: "VERSION PID PORT CLIENT_SECRET SERVER_SECRET"
CONTROL_VERSION = 1
COMMANDS = ("status", "top", "stop", "logs")  # request: "CLIENT_SECRET COMMAND [JSON ARGS]\n"
MAX_REQUEST = 4096  # the request line, secret included
CLIENT_HEADER_TIMEOUT = 5.0  # the client waits this long for the answer's first line, then falls back to the agent
OK = "ok"  # the answer's first line: "ok SERVER_SECRET", then the body
ERROR = "error"  # or "error WHY": not served here (the client falls back to the agent)


class RequestError(Exception):
    """An authenticated request this supervisor does not serve (an unknown command, bad arguments)."""


def _num(v, lo, hi):
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and lo <= v <= hi


def parse_request(rest):
    """(command, args) of a request line after its secret (bytes); raise RequestError. The arguments are those
    of the agent's subcommand, checked with the same bounds (clusterctl/host/agent.py, topsnap.parse_args)."""
    try:
        text = rest.decode("utf-8")
    except UnicodeDecodeError:
        raise RequestError("request is not UTF-8")
    command, _, raw = text.strip().partition(" ")
    if command not in COMMANDS:
        raise RequestError("unknown command %r" % command[:40])
    args = {}
    if raw.strip():
        try:
            args = json.loads(raw)
        except (ValueError, RecursionError):
            raise RequestError("arguments are not JSON")
        if not isinstance(args, dict):
            raise RequestError("arguments are not a JSON object")
    known = {"status": (), "top": ("progress_only", "slice", "slices", "gpu"), "stop": ("grace",),
             "logs": ("follow", "role", "id", "lines", "host_label")}[command]
    extra = sorted(set(args) - set(known))
    if extra:
        raise RequestError("%s: unknown argument(s) %s" % (command, ", ".join(map(str, extra))))
    for key in ("progress_only", "gpu", "follow"):
        if key in args and not isinstance(args[key], bool):
            raise RequestError("%s: %s must be true or false" % (command, key))
    if args.get("slice") is not None and not _num(args["slice"], 0.5, 600):
        raise RequestError("top: slice must be 0.5..600 seconds")
    if "slices" in args and not (_num(args["slices"], 0, 60) and isinstance(args["slices"], int)):
        raise RequestError("top: slices must be 0..60")
    if "grace" in args and args["grace"] is not None and not _num(args["grace"], 0, 86400):
        raise RequestError("stop: grace must be 0..86400 seconds")
    if args.get("role") is not None and args["role"] not in ROLES:
        raise RequestError("logs: role must be one of %s" % "/".join(ROLES))
    if args.get("id") is not None and not (isinstance(args["id"], int) and not isinstance(args["id"], bool)
                                           and args["id"] >= 0):
        raise RequestError("logs: id must be an integer >= 0")
    if args.get("lines") is not None and not (isinstance(args["lines"], int) and not isinstance(args["lines"], bool)
                                              and args["lines"] >= 0):
        raise RequestError("logs: lines must be an integer >= 0")
    label = args.get("host_label")
    if label is not None and not (isinstance(label, str) and 0 < len(label) <= 255 and label.isprintable()):
        raise RequestError("logs: host_label must be 1..255 printable characters")
    return command, args


def read_control(jobdir):
    """The control file of a job dir as (pid, port, client secret, server secret), or None (no file, garbage)."""
    try:
        with open(os.path.join(jobdir, CONTROL_FILE), "rb") as f:
            parts = f.read(512).decode("ascii").split()
        if len(parts) != 5 or parts[0] != str(CONTROL_VERSION):
            return None
        return int(parts[1]), int(parts[2]), parts[3], parts[4]
    except (OSError, ValueError, UnicodeDecodeError):
        return None
