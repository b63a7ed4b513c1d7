"""The one quoting point: every value that reaches a remote shell goes through here."""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterable, Mapping

__all__ = ["quote", "join", "command", "redact"]

# scheme://user:password@host or scheme://token@host: everything between // and @ is a credential
_URL_CREDENTIALS = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)[^/@\s]+@")

_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*\Z")


def redact(text: str) -> str:
    """`text` with credentials in URLs (`https://user:secret@host`) replaced by `***`."""
    return _URL_CREDENTIALS.sub(r"\1***@", str(text))


def quote(value: str) -> str:
    """Quote one word for a POSIX shell: it arrives verbatim and executes nothing."""
    return shlex.quote(str(value))


def join(argv: Iterable[str]) -> str:
    """Quote and join an argv into one POSIX shell command line."""
    return " ".join(quote(a) for a in argv)


def command(argv: Iterable[str], *, env: Mapping[str, str] | None = None, cwd: str | None = None) -> str:
    """A shell line that runs `argv` with extra `env` in directory `cwd`, every value quoted.

    Env goes through `env NAME=VALUE ...` (never `export` built by string formatting); names are checked.
    """
    parts = []
    if cwd:
        parts.append(f"cd {quote(cwd)} &&")
    if env:
        for name in env:
            if not _ENV_NAME.match(name):
                raise ValueError(f"invalid environment variable name: {name!r}")
        parts.append("env " + " ".join(quote(f"{k}={v}") for k, v in env.items()))
    parts.append(join(argv))
    return " ".join(parts)
