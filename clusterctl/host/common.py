"""What every host command shares: the input error, one JSON object on stdout, timestamped log lines, and two
file-system helpers that spare `agent up` (every start, on every host) the imports of tempfile and shutil."""

import errno
import json
import os
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


def private_temp(dirname, prefix):
    """(fd, path) of a new empty file in `dirname`, mode 0600, created exclusively (never through a link):
    tempfile.mkstemp's guarantees, without importing tempfile (and with it shutil, random and hashlib)."""
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    for _ in range(100):
        path = os.path.join(dirname, prefix + os.urandom(6).hex())
        try:
            return os.open(path, flags, 0o600), path
        except FileExistsError:
            continue
    raise FileExistsError(errno.EEXIST, "no unused temporary file name", dirname)


def write_private(path, data):
    """Replace `path` with `data` (bytes or str) atomically, mode 0600: a new file made by private_temp beside it
    (never through a link, never a stale one's mode), renamed over it; the temporary file removed on failure."""
    fd, tmp = private_temp(os.path.dirname(path) or ".", ".tmp-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode("utf-8") if isinstance(data, str) else data)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def script_arg(argv):
    """The script argument of an interpreter-like argv (its first non-option argument, where it ends in .py), or
    None: what the preflight checks for, and what a spec may not start with `~` (clusterctl.spec.job)."""
    for a in argv[1:]:
        if a in ("-m", "-c"):
            return None
        if a.startswith("-"):
            continue
        return a if a.endswith(".py") else None
    return None


def which(name, path):
    """shutil.which(name, path=path) on POSIX, without importing shutil (its import loads zlib, bz2 and lzma):
    the executable file `name` (a path when it has a slash, else looked up in `path`), or None."""

    def runnable(fn):
        return os.path.exists(fn) and os.access(fn, os.F_OK | os.X_OK) and not os.path.isdir(fn)

    if os.path.dirname(name):
        return name if runnable(name) else None
    if not path:
        return None
    seen = set()
    for d in os.fsdecode(path).split(os.pathsep):
        normdir = os.path.normcase(d)
        if normdir not in seen:
            seen.add(normdir)
            candidate = os.path.join(d, name)
            if runnable(candidate):
                return candidate
    return None


def log(msg):
    """Timestamped line on stderr (the supervisor's stderr is supervisor.log)."""
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime())
    sys.stderr.write("%s.%03dZ %s\n" % (stamp, int(time.time() * 1000) % 1000, msg))
    sys.stderr.flush()
