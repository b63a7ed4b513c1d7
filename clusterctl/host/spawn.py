"""What a supervised process starts with: its environment, its log per attempt, its derived token."""

import hmac
import os
import signal

from .jobfile import JOB_ENV, JOBDIR_ENV

# Variables taken from the host's own environment; everything else comes from the job file.
BASE_ENV_KEYS = ("PATH", "HOME", "LANG", "LC_ALL", "USER", "LOGNAME", "TMPDIR")
DEFAULT_PATH = "/usr/local/bin:/usr/bin:/bin"


def process_token(token):
    """The secret the job's processes share (CLUSTERCTL_JOB_TOKEN): derived, so they never hold the agent's token."""
    return hmac.new(token.encode("utf-8"), b"clusterctl-job-processes", "sha256").hexdigest()


def base_env(job_id, jobdir, extra):
    """The host's base environment (BASE_ENV_KEYS) + the job's env + the job tags."""
    env = {k: os.environ[k] for k in BASE_ENV_KEYS if k in os.environ}
    env.setdefault("PATH", DEFAULT_PATH)
    env.update(extra)
    env[JOB_ENV] = job_id
    env[JOBDIR_ENV] = jobdir
    return env


def attempt_log(path, attempt):
    """The log of `attempt` for a process whose first attempt logs to `path` (trainer.0.log -> trainer.0.attempt1.log)."""
    if attempt == 0:
        return path
    stem, dot, ext = path.rpartition(".")
    if dot and ext == "log" and "/" not in ext:
        return "%s.attempt%d.log" % (stem, attempt)
    return "%s.attempt%d" % (path, attempt)


def _private_opener(path, flags):
    """open() opener creating files 0600 (process logs)."""
    return os.open(path, flags, 0o600)


def _pdeathsig_setup(parent_pid):
    """Return a preexec_fn asking the kernel to SIGTERM the child if the supervisor dies."""
    try:
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        prctl = libc.prctl
    except (OSError, AttributeError, ImportError):
        return None
    PR_SET_PDEATHSIG = 1

    def setup():
        prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
        if os.getppid() != parent_pid:  # the supervisor died before prctl
            os._exit(1)
    return setup
