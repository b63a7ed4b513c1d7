"""What every spec model shares: the base model, the port type, address/user/jump-host checks, scalar helpers.

Knows pydantic and nothing of the plan."""

from __future__ import annotations

import difflib
import re
import types
import typing
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from ..transport.host import split_jump

__all__ = ["Port", "check_address", "check_user", "parse_jump", "TEXT_PATHS", "yaml11_number", "nonempty_path"]


Port = Annotated[int, Field(ge=1, le=65535)]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_truth_for_a_number(cls, v: Any, info: ValidationInfo) -> Any:
        """`port: true` read as port 1 (pydantic takes a bool for an int): a number's key refuses true/false."""
        if isinstance(v, bool) and _numeric(cls.model_fields[info.field_name].annotation):
            raise ValueError(f"expected a number, got {str(v).lower()}")
        return v


def _numeric(annotation: Any) -> bool:
    """Whether a field's type takes a number (int or float, alone, Annotated, or in a union) and not a bool."""
    if annotation in (int, float):
        return True
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is Annotated:
        return _numeric(args[0])
    return origin in (typing.Union, types.UnionType) and bool not in args and any(_numeric(a) for a in args)


_HOSTNAME_RE = re.compile(r"[A-Za-z0-9_](?:[A-Za-z0-9_.-]{0,252})")
_USER_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}\$?")


def check_address(value: str) -> str:
    """A host address as ssh takes it: an IPv4/IPv6 address or a host name / ssh config alias.

    Refuses what ssh would read as an option (a leading '-') or what a shell or a log line would
    misread (spaces, control characters, brackets around a non-IPv6 address)."""
    import ipaddress

    bare = value[1:-1] if value.startswith("[") and value.endswith("]") else value
    if ":" in bare:
        try:
            ipaddress.IPv6Address(bare.split("%", 1)[0])
        except ValueError:
            raise ValueError(f"not a host name or IP address: {value!r}") from None
        return bare
    if bare != value or not _HOSTNAME_RE.fullmatch(value) or ".." in value:
        raise ValueError(f"not a host name or IP address: {value!r}")
    return value


def check_user(value: str) -> str:
    """A login user name: letters, digits, '_', '.', '-' (not first), as useradd allows."""
    if not _USER_RE.fullmatch(value):
        raise ValueError(f"not a valid user name: {value!r}")
    return value


def parse_jump(hop: str) -> tuple[str | None, str, int | None]:
    """`[user@]host[:port]` (IPv6 as `[addr]:port`, or an `ssh://` URI) -> (user, host, port); ValueError when
    malformed."""
    user, host, port = split_jump(hop)  # the form, parsed once for the spec and the transports
    if user is not None or "@" in hop:
        check_user(user or "")
    return user, check_address(host), port


def _jump_chain(v: Any) -> Any:
    """`proxy_jump`: "a,b", [a, b] or "none" -> a tuple of validated hops (first hop first)."""
    if isinstance(v, str):
        v = [] if v.strip().lower() == "none" else [part.strip() for part in v.split(",")]
    if isinstance(v, (list, tuple)):
        for hop in v:
            if not isinstance(hop, str) or not hop:
                raise ValueError("expected jump hosts as [user@]host[:port] strings")
            parse_jump(hop)
        return tuple(v)
    return v


# Where the spec's scalars are text (the validators that take them with _scalar_str): a number or a truth value
# there is taken as it was written (`12.10`, `010`, `1:10`, `on`), never as YAML 1.1 read it (12.1, 8, 70, True).
# `*` is any key or index. clusterctl.spec.loading puts the written text in before validation (Located.text).
TEXT_PATHS = (
    ("job", "env", "*"),
    ("job", "entrypoint", "*"),
    ("job", "args", "*"),
    ("hosts", "*", "labels", "*"),
    ("kubernetes", "resources", "*", "*", "*"),
    ("slurm", "time"),  # sbatch's `90` (minutes), `1:30` (minutes:seconds)
)

_DECIMAL_INT_RE = re.compile(r"[-+]?(0|[1-9][0-9]*)")


def yaml11_number(text: str, value: Any) -> str | None:
    """Why the number `value`, written `text`, is not what its digits say (YAML 1.1 read it as a base-60, octal,
    hexadecimal or binary number, or dropped its `_`s): a one-line message; None for a plain decimal number."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    bare = text.lstrip("+-")
    if ":" in text:
        kind = "a base-60 number"
    elif bare[:2] in ("0x", "0X"):
        kind = "a hexadecimal number"
    elif bare[:2] in ("0b", "0B"):
        kind = "a binary number"
    elif isinstance(value, int) and len(bare) > 1 and bare[0] == "0":
        kind = "an octal number"
    elif "_" in text:
        kind = "'_' digit separators dropped"
    elif isinstance(value, int) and not _DECIMAL_INT_RE.fullmatch(text):
        kind = "not decimal digits"
    else:
        return None
    return (f"{text!r} reads as {value!r} in YAML 1.1 ({kind}): write a number in plain decimal digits, "
            "or quote it if it is text")


def nonempty_path(v: str | None, hint: str = "leave the key out") -> str | None:
    """A path key's value: an empty (or blank) one is refused, never taken for the key left out (`known_hosts: ''`
    was another file than the one named)."""
    if v is not None and not v.strip():
        raise ValueError(f"empty: give a path, or {hint}")
    return v


def _scalar_str(v: Any) -> Any:
    """YAML scalars become strings (`1` → "1", `true` → "true"); anything else is left for the type check. A spec
    loaded from YAML has its TEXT_PATHS' scalars as written already: this is for specs built in code."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return str(v)
    return v


def _placeholder_names(arg: str) -> list[str]:
    """The placeholders of `arg` as `str.format` reads them (`{{` and `}}` are literal braces); ValueError for a
    lone brace, and for a format spec or conversion (`{id:>9}`, `{id!r}`: a placeholder is its value, as is)."""
    import string

    try:
        fields = [(f, spec, conv) for _, f, spec, conv in string.Formatter().parse(arg) if f is not None]
    except ValueError as exc:  # "Single '}' encountered in format string", "expected '}' before end of string"
        what = f"a lone {str(exc).split()[1]}" if str(exc).startswith("Single ") else "an unclosed '{'"
        raise ValueError(f"{what} in {arg!r}: write {{{{ and }}}} for literal braces") from None
    for name, spec, conversion in fields:
        if spec or conversion:
            raise ValueError(f"placeholder {{{name}}} in {arg!r} takes no format spec or conversion")
    return [name for name, _, _ in fields]


def _did_you_mean(word: str, choices) -> str:
    close = difflib.get_close_matches(str(word), [str(c) for c in choices], n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ""
