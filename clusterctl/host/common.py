"""What every host command shares: the input error, one JSON object on stdout, timestamped log lines."""

import json
import sys
import time


class InputError(Exception):
    """Bad input from the caller: reported as JSON with exit code 2."""


class UsageError(InputError):
    """Bad command line."""



def emit(obj):
    """Print one JSON object on stdout."""
    sys.stdout.write(json.dumps(obj, sort_keys=True) + "\n")
    sys.stdout.flush()


def log(msg):
    """Timestamped line on stderr (the supervisor's stderr is supervisor.log)."""
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime())
    sys.stderr.write("%s.%03dZ %s\n" % (stamp, int(time.time() * 1000) % 1000, msg))
    sys.stderr.flush()
