"""The control socket's contract, shared by the supervisor (clusterctl/host/control.py) and the controller's
one-line client (clusterctl/ops/control.py): the control file, the request line, the answer's first line.

Kept apart from the server so that the controller imports a few constants, not the supervisor's socket code.
Stdlib only, Python 3.9 (the host package).
"""

__all__ = ["CONTROL_FILE", "CONTROL_VERSION", "COMMANDS", "MAX_REQUEST", "CLIENT_HEADER_TIMEOUT", "OK", "ERROR"]

CONTROL_FILE = "control"  # in the job dir, 0600: "VERSION PID PORT CLIENT_SECRET SERVER_SECRET"
CONTROL_VERSION = 1
COMMANDS = ("status", "top", "stop", "logs")  # request: "CLIENT_SECRET COMMAND [JSON ARGS]\n"
MAX_REQUEST = 4096  # the request line, secret included
CLIENT_HEADER_TIMEOUT = 5.0  # the client waits this long for the answer's first line, then falls back to the agent
OK = "ok"  # the answer's first line: "ok SERVER_SECRET", then the body
ERROR = "error"  # or "error WHY": not served here (the client falls back to the agent)
