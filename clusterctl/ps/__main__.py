"""``python -m clusterctl.ps server [options]``: run one pserver from the environment until the job ends.

Exit codes: 0 when every trainer sent ``complete``; 1 on a runtime failure (e.g. a sync barrier timed
out: the missing trainer ids are logged); 2 on a configuration error (bad environment or arguments);
128+signal (143, 130) when stopped by SIGTERM or SIGINT before every trainer completed.
"""

from __future__ import annotations

import argparse
import logging
import math
import signal
import sys
from collections.abc import Sequence

from .env import server_from_env
from .errors import PsConfigError, PsError
from .protocol import MAX_TIMEOUT

__all__ = ["main"]


def _seconds(text: str) -> float:
    """An argparse type: a finite number of seconds > 0."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number of seconds > 0")
    if value > MAX_TIMEOUT:
        raise argparse.ArgumentTypeError(f"{text!r} is more than {MAX_TIMEOUT:,.0f} seconds")
    return value


def _level(text: str) -> str:
    """An argparse type: a logging level name (debug, info, warning, error, critical)."""
    if not isinstance(logging.getLevelName(text.upper()), int):
        raise argparse.ArgumentTypeError(f"{text!r} is not a logging level (DEBUG, INFO, WARNING, ERROR, CRITICAL)")
    return text.upper()


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m clusterctl.ps", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("server", help="run a pserver configured by TRAINING_ROLE/PADDLE_* variables")
    s.add_argument("--mode", choices=("sync", "async", "geo"), help="override CLUSTERCTL_PS_MODE")
    s.add_argument("--barrier-timeout", type=_seconds, help="override CLUSTERCTL_PS_BARRIER_TIMEOUT (seconds)")
    s.add_argument("--checkpoint", help="override CLUSTERCTL_PS_CHECKPOINT (resume from this directory)")
    s.add_argument("--checkpoint-every", type=int,
                   help="override CLUSTERCTL_PS_CHECKPOINT_EVERY (save to the checkpoint directory every N steps)")
    s.add_argument("--log-level", type=_level, default="INFO", help="logging level (default INFO)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the process exit code."""
    args = _parser().parse_args(argv)
    logging.basicConfig(level=args.log_level,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    log = logging.getLogger("clusterctl.ps")
    overrides = {}
    if args.mode:
        overrides["mode"] = args.mode
    if args.barrier_timeout is not None:
        overrides["barrier_timeout"] = args.barrier_timeout
    if args.checkpoint:
        overrides["checkpoint_dir"] = args.checkpoint
    if args.checkpoint_every is not None:
        overrides["checkpoint_every"] = args.checkpoint_every
    try:
        server = server_from_env(**overrides)
    except PsConfigError as exc:
        log.error("%s", exc)
        return 2
    except PsError as exc:  # e.g. a checkpoint it must start from is unreadable: one line, not a traceback
        log.error("pserver could not start: %s", exc)
        return 1
    stopped: list[int] = []

    def _on_term(signum: int, _frame: object) -> None:
        stopped.append(signum)
        server.stop()

    signal.signal(signal.SIGTERM, _on_term)
    signal.signal(signal.SIGINT, _on_term)
    try:
        server.serve()
    except PsConfigError as exc:
        log.error("%s", exc)
        return 2
    except PsError as exc:
        log.error("pserver %d failed: %s", server.server_id, exc)
        return 1
    if stopped:
        log.warning("pserver %d stopped by signal %d before every trainer completed", server.server_id, stopped[0])
        return 128 + stopped[0]
    return 0


if __name__ == "__main__":
    sys.exit(main())
