"""The few keys of a spec's text that name the other files its plan is made from: `hostfile`, `ssh.config`
and `data.local` (with whether `data` is there), read without the spec models or, mostly, PyYAML.

The plan cache (clusterctl.plancache) derives an entry's inputs from the spec's own bytes on every
command, so that an entry can never say what it was made from. Loading the spec for that would cost what
the cache saves (pydantic, and PyYAML's ~13 ms import on a command that takes ~0.1 s), so the common
forms are read here, exactly: top-level keys at column 0 (other keys' lists may start there too), these
keys' values as one-line plain,
single-quoted or backslash-free double-quoted scalars, in a block mapping or a one-line flow mapping.
Anything else (anchors, tags, multi-line values, documents markers, numbers or booleans where a path is
expected, ...) falls back to PyYAML (`yaml.safe_load`); a spec PyYAML cannot read is `None`.
"""

from __future__ import annotations

import re

__all__ = ["spec_keys", "SpecKeys"]

# (hostfile, ssh.config, data.local, data given): what the plan's other inputs are named by
SpecKeys = tuple  # tuple[str | None, str | None, str | None, bool]

_TOP = re.compile(r"([A-Za-z_][A-Za-z0-9_-]*)[ \t]*:(?:[ \t]+(.*))?$", re.S)
_CHILD = re.compile(r"( +)([A-Za-z_][A-Za-z0-9_-]*)[ \t]*:(?:[ \t]+(.*))?$", re.S)
_NULL = {"", "~", "null", "Null", "NULL"}
# PyYAML resolves these plain scalars to booleans, numbers or dates, not strings: the models refuse them,
# so a spec with one was never planned; read such a spec with PyYAML rather than guess
_NOT_STR = re.compile(r"(?:[-+]?\.?[0-9]|[-+]?\.(?:inf|Inf|INF)$|\.(?:nan|NaN|NAN)$|<<$|=$"
                      r"|(?:yes|Yes|YES|no|No|NO|true|True|TRUE|false|False|FALSE|on|On|ON|off|Off|OFF)$)")
_SINGLE = re.compile(r"'((?:[^']|'')*)'[ \t]*(?:#.*)?$", re.S)
_DOUBLE = re.compile(r'"([^"\\]*)"[ \t]*(?:#.*)?$', re.S)


class _Unsure(Exception):
    """The text is not in the forms read here."""


def spec_keys(text: str) -> SpecKeys | None:
    """(hostfile, ssh.config, data.local, data given) of the spec `text`; None when PyYAML cannot read it
    as a mapping either."""
    try:
        return _fast(text)
    except _Unsure:
        return _slow(text)


def _slow(text: str) -> SpecKeys | None:
    import yaml

    try:
        data = yaml.load(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    except (yaml.YAMLError, RecursionError, ValueError):
        return None
    if not isinstance(data, dict):
        return None
    ssh, dat = data.get("ssh"), data.get("data")
    config = ssh.get("config") if isinstance(ssh, dict) else None
    local = dat.get("local") if isinstance(dat, dict) else None
    return (_str(data.get("hostfile")), _str(config), _str(local), dat is not None)


def _str(value) -> str | None:
    return value if isinstance(value, str) else None


def _scalar(value: str | None, lines: list[str], index: int, indent: int) -> str | None:
    """A one-line scalar value (the rest of line `index`, whose key is at column `indent`); the lines after
    it must not continue it (a plain scalar goes on over more-indented lines)."""
    value = (value or "").strip()
    if value.startswith("'"):
        m = _SINGLE.match(value)
        if m is None:
            raise _Unsure("multi-line single-quoted value")
        return m.group(1).replace("''", "'")
    if value.startswith('"'):
        m = _DOUBLE.match(value)
        if m is None:
            raise _Unsure("double-quoted value with escapes, or over lines")
        return m.group(1)
    for mark in (" #", "\t#"):
        cut = value.find(mark)
        if cut >= 0:
            value = value[:cut].rstrip()
    if value.startswith("#"):
        value = ""
    if value[:1] and value[0] in "-?:,[]{}&*!|>%@`\\" or ": " in value or value.endswith(":") or "\t" in value:
        raise _Unsure("not a plain scalar read here")
    for nxt in lines[index + 1:]:
        stripped = nxt.lstrip(" ")
        if stripped and not stripped.startswith("#"):
            if len(nxt) - len(stripped) > indent:
                raise _Unsure("a value continued over lines")
            break
    if value in _NULL:
        return None
    if _NOT_STR.match(value):
        raise _Unsure("a value PyYAML reads as something other than a string")
    return value


def _split_top(text: str) -> tuple[list[str], bool]:
    """`text` split at its top-level commas (outside quotes and brackets), and whether every quote and bracket
    it opens is closed."""
    items, depth, quote, start = [], 0, None, 0
    for i, c in enumerate(text):
        if quote:
            if c == quote:
                quote = None
        elif c in "'\"":
            quote = c
        elif c in "[{":
            depth += 1
        elif c in "]}":
            depth -= 1
        elif c == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    items.append(text[start:])
    return items, depth == 0 and quote is None


def _flow(value: str) -> dict[str, str | None]:
    """A one-line flow mapping `{k: v, ...}` of plain or quoted scalars."""
    value = value.strip()
    end = value.rfind("}")
    if not value.startswith("{") or end < 0 or value[end + 1:].strip()[:1] not in ("", "#"):
        raise _Unsure("not a one-line flow mapping")
    items, balanced = _split_top(value[1:end])
    if not balanced:
        raise _Unsure("unbalanced flow mapping")
    out: dict[str, str | None] = {}
    for item in items:
        if not item.strip():
            continue
        key, sep, val = item.partition(":")
        key = key.strip()
        if not sep or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_-]*", key) or key in out:
            raise _Unsure("a flow mapping key not read here")
        val = val.strip()
        if key in ("config", "local"):
            if val[:1] in ("{", "[") or ":" in val:
                raise _Unsure("a nested value, or a colon PyYAML reads its own way in flow context")
            out[key] = _scalar(val, [], 0, 0)
        else:
            out[key] = val
    return out


def _block(lines: list[str], index: int) -> dict[str, str | None]:
    """The block mapping under the top-level key at line `index`: its children's one-line values."""
    out: dict[str, str | None] = {}
    child, last_empty = None, None
    for i in range(index + 1, len(lines)):
        line = lines[i]
        stripped = line.lstrip(" ")
        if not stripped or stripped.startswith("#"):
            continue
        indent = len(line) - len(stripped)
        if indent == 0:
            break
        if child is None:
            child = indent
        if indent > child:
            continue  # inside a child's own value (its lines were checked where it starts)
        if indent == child and stripped[0] == "-" and stripped[1:2] in ("", " "):  # a child key's list
            if last_empty is None or last_empty in ("config", "local"):
                raise _Unsure("a list not read here")
            rest = stripped[1:].strip()
            if rest[:1] in ("'", '"', "[", "{"):
                _closed(rest)
            continue
        m = _CHILD.match(line)
        if indent < child or m is None:
            raise _Unsure("a block mapping line not read here")
        key, rest = m.group(2), m.group(3)
        if key in out:
            raise _Unsure("a key given twice")
        text = (rest or "").strip()
        if text[:1] in ("'", '"', "[", "{") and key not in ("config", "local"):
            _closed(text)  # another key's one-line value: it must not run into the next lines
        out[key] = _scalar(rest, lines, i, indent) if key in ("config", "local") else text
        last_empty = key if text == "" or text.startswith("#") else None
    return out


def _closed(text: str) -> None:
    """Refuse a quoted or flow value that goes on past its line."""
    if text[0] == "'" and _SINGLE.match(text):
        return
    if text[0] == '"' and re.match(r'"(?:[^"\\]|\\.)*"[ \t]*(?:#.*)?$', text):
        return
    if text[0] in "[{" and _split_top(text)[1]:
        return
    raise _Unsure("a value that goes on over lines")


def _fast(text: str) -> SpecKeys:
    if "\t" in text or "\r" in text or text.startswith("\ufeff"):
        raise _Unsure("tabs, carriage returns or a byte-order mark")
    lines = text.split("\n")
    top: dict[str, int] = {}
    first, last_empty = True, None
    for i, line in enumerate(lines):
        stripped = line.lstrip(" ")
        if not stripped or stripped.startswith("#"):
            continue
        if line[0] == " ":
            if first:
                raise _Unsure("an indented first line")
            continue
        if line[0] == "-" and line[1:2] in ("", " "):  # `key:` then its list at column 0 (PyYAML's own style)
            if first or last_empty is None or last_empty in ("hostfile", "ssh", "data"):
                raise _Unsure("a list not read here")
            rest = line[1:].strip()
            if rest[:1] in ("'", '"', "[", "{"):
                _closed(rest)
            continue
        first = False
        m = _TOP.match(line)
        if m is None:
            raise _Unsure("a top-level line not read here")
        key, rest = m.group(1), (m.group(2) or "").strip()
        if key in top:
            raise _Unsure("a key given twice")
        top[key] = i
        last_empty = key if rest == "" or rest.startswith("#") else None
        if rest[:1] in ("'", '"', "[", "{"):
            _closed(rest)
    if first:
        raise _Unsure("no mapping")
    hostfile = _scalar(_TOP.match(lines[top["hostfile"]]).group(2), lines, top["hostfile"], 0) if "hostfile" in top else None
    sections = {}
    for name in ("ssh", "data"):
        if name not in top:
            sections[name] = None
            continue
        rest = (_TOP.match(lines[top[name]]).group(2) or "").strip()
        if rest.startswith("{"):
            sections[name] = _flow(rest)
        elif rest in _NULL or rest.startswith("#"):
            sections[name] = _block(lines, top[name]) or None
        else:
            raise _Unsure(f"{name}: not a mapping read here")
    ssh, data = sections["ssh"], sections["data"]
    return (hostfile, (ssh or {}).get("config"), (data or {}).get("local"), data is not None)
