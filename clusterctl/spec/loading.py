"""Reading a spec: the file (size, UTF-8), YAML with positions, passwords refused, the hostfile, the
models, then the semantic checks; every problem found reported at once as a SpecError."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pydantic

from ..errors import SpecError, SpecProblem
from ..files import TooLarge, read_limited, read_spec_bytes
from ..yamlpos import MAX_BYTES as MAX_SPEC_BYTES
from ..yamlpos import Located, YamlSyntaxError, load_located
from .checks import semantic_problems
from .errors import dedupe, problem, pydantic_problem, telling
from .fields import TEXT_PATHS, nonempty_path, yaml11_number
from .models import ClusterSpec

__all__ = ["load_spec", "parse_spec", "parse_hostfile", "MAX_HOSTFILE_BYTES", "MAX_SPEC_BYTES"]


PASSWORD_KEY_RE = re.compile(r"(^|[_-])(password|passwd|passphrase|pass)\Z", re.IGNORECASE)


MAX_HOSTFILE_BYTES = 1 << 20


def load_spec(path: str | Path, *, layout: bool = True, check=None) -> ClusterSpec:
    """Read, parse and validate the spec at `path`; raise SpecError with every problem found.

    layout=False leaves out the one check that lays out the plan (ports, endpoints, GPUs): for callers
    that plan the spec next (clusterctl.ops.plan_for reports the same problems at the same keys), so that
    a command lays out its plan once. `check(spec)`: more problems (the spec's backend's, clusterctl.backends),
    reported before the semantic checks, which they may explain."""
    if not str(path).strip():  # Path('') is '.': "is a directory" about a directory no one named
        raise SpecError([SpecProblem("''", 1, 1, "", "the spec's path is empty: name a spec file")])
    path = Path(path)
    try:
        text = read_spec_bytes(path).decode("utf-8")  # a spec given as a pipe: read once per process
    except TooLarge:
        raise SpecError([SpecProblem(str(path), 1, 1, "", f"spec is larger than {MAX_SPEC_BYTES // 1024} KiB")]) from None
    except OSError as exc:
        raise SpecError([SpecProblem(str(path), 1, 1, "", f"cannot read spec: {exc.strerror or exc}")]) from None
    except UnicodeDecodeError:
        raise SpecError([SpecProblem(str(path), 1, 1, "", "spec is not UTF-8 text")]) from None
    return parse_spec(text, str(path), layout=layout, check=check)


def parse_spec(text: str, source: str = "<spec>", *, layout: bool = True, check=None) -> ClusterSpec:
    """Validate spec `text` (named `source` in messages); raise SpecError with every problem found
    (layout, check: as in load_spec)."""
    try:
        loc = load_located(text)
    except YamlSyntaxError as exc:
        raise SpecError([SpecProblem(source, exc.line, exc.column, "", exc.message)]) from None
    data = loc.data
    if not isinstance(data, dict):
        raise SpecError([SpecProblem(source, 1, 1, "", "a spec is a YAML mapping (name:, hosts:, job:, ...)")])
    if data and not any(isinstance(k, str) and (k in ClusterSpec.model_fields or k == "provision") for k in data):
        # another kind of file (`validate /etc/passwd`): one line, not each of its lines echoed as an unknown key
        raise SpecError([SpecProblem(source, 1, 1, "", "not a cluster spec: none of its top-level keys is a spec's "
                                                       "(name:, hosts:, job:, ...)")])

    problems = [problem(loc, source, p, "key given twice") for p in loc.duplicates]
    problems += _password_problems(loc, source, data, ())
    problems += _surrogate_problems(loc, source, data, ())
    if problems:
        raise SpecError(problems)

    data, numbers = _as_written(loc, source, data)
    problems += _load_hostfile(loc, source, data)
    if problems:
        raise SpecError(problems)
    provision, found = data.pop("provision", None), []
    try:
        spec = ClusterSpec.model_validate({**data, "source": source})
    except pydantic.ValidationError as exc:
        found += exc.errors()
    if provision is not None:
        from ..provision.schema import ProvisionSpec, WrittenFloat

        try:
            provision = ProvisionSpec.model_validate(WrittenFloat.within(provision, loc, ("provision",)))
        except pydantic.ValidationError as exc:
            found += [{**err, "loc": ("provision", *err["loc"])} for err in exc.errors()]
    if found or numbers:
        told = [(err, pydantic_problem(loc, source, err, path)) for err, path in telling(found)]
        unknown = [p.path for err, p in told if err["type"] == "extra_forbidden"]  # said once, as an unknown key
        numbers = [n for n in numbers if not any(n.path == u or n.path.startswith((u + ".", u + "[")) for u in unknown)]
        misread = {n.path for n in numbers}  # what the models said of those is about the number YAML 1.1 read
        problems += numbers + [p for _, p in told if p.path not in misread]
        raise SpecError(sorted(dedupe(problems), key=lambda p: (p.file != source, p.file, p.line, p.column))) from None
    if provision is not None:
        object.__setattr__(spec, "provision", provision)  # frozen model: set once, here
    spec._located = loc
    if check is not None:
        problems += check(spec)
        if problems:
            raise SpecError(problems)
    problems += semantic_problems(loc, source, spec, layout=layout)
    if problems:
        raise SpecError(problems)
    return spec


def _password_problems(loc: Located, source: str, node: Any, path: tuple) -> list[SpecProblem]:
    found = []
    if isinstance(node, dict):
        for key, value in node.items():
            child = path + (key,)
            if isinstance(key, str) and PASSWORD_KEY_RE.search(key):
                found.append(
                    problem(loc, source, child, "passwords are not allowed in a spec: use ssh.identity_file or an ssh-agent")
                )
            else:
                found += _password_problems(loc, source, value, child)
    elif isinstance(node, list):
        for i, value in enumerate(node):
            found += _password_problems(loc, source, value, path + (i,))
    return found


def _surrogate_problems(loc: Located, source: str, node: Any, path: tuple) -> list[SpecProblem]:
    """A problem at every string of the spec (key or value) that is not valid Unicode: a lone surrogate, which YAML's
    "\\uD800" gives and nothing can encode (an argv, a manifest, a log line: a UnicodeEncodeError far from the key)."""
    found = []
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for key, value in items:
        child = path + (key,)
        for text in (key, value):
            if isinstance(text, str) and not _encodable(text):
                at = next(i for i, c in enumerate(text) if "\ud800" <= c <= "\udfff")
                found.append(problem(loc, source, child, f"not valid Unicode: a lone surrogate {text[at]!r} at "
                                     f"character {at + 1} of {text!r}"))
                break
        else:
            found += _surrogate_problems(loc, source, value, child)
    return found


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _as_written(loc: Located, source: str, data: dict) -> tuple[dict, list[SpecProblem]]:
    """`data` (a copy) with the numbers and truth values at TEXT_PATHS as their text in the file (`010`, not 8), and
    a problem for each other number written in a form YAML 1.1 reads otherwise than as decimal digits (`1:10`)."""
    for pattern in TEXT_PATHS:
        data = _texts_at(loc, data, pattern, ())
    found: list[SpecProblem] = []
    _yaml11_numbers(loc, source, data, (), found)
    return dict(data), found


def _texts_at(loc: Located, node: Any, pattern: tuple, path: tuple) -> Any:
    """`node` (at `path`) with the non-string scalars that `pattern` names as written; containers copied on the way."""
    if not pattern:
        text = loc.text(path) if isinstance(node, (int, float)) else None  # bool is an int
        return node if text is None else text
    head, rest = pattern[0], pattern[1:]
    if isinstance(node, dict):
        keys = list(node) if head == "*" else [head] if head in node else []
        return {**node, **{k: _texts_at(loc, node[k], rest, path + (k,)) for k in keys}} if keys else node
    if isinstance(node, list) and head == "*":
        return [_texts_at(loc, item, rest, path + (i,)) for i, item in enumerate(node)]
    return node


def _yaml11_numbers(loc: Located, source: str, node: Any, path: tuple, found: list) -> None:
    """Append a problem for every number under `node` written as YAML 1.1 alone reads it (`010`, `0x10`, `1_000`)."""
    if isinstance(node, dict):
        for key, value in node.items():
            _yaml11_numbers(loc, source, value, path + (key,), found)
    elif isinstance(node, list):
        for i, value in enumerate(node):
            _yaml11_numbers(loc, source, value, path + (i,), found)
    elif isinstance(node, (int, float)) and not isinstance(node, bool):
        text = loc.text(path)
        why = yaml11_number(text, node) if text is not None and text != str(node) else None
        if why:
            found.append(problem(loc, source, path, why))


def _load_hostfile(loc: Located, source: str, data: dict) -> list[SpecProblem]:
    hostfile = data.get("hostfile")
    if hostfile is None:
        return []
    if "hosts" in data:
        return [problem(loc, source, ("hostfile",), "give either hosts or hostfile, not both")]
    if not isinstance(hostfile, str):
        return []  # the type check reports it
    try:
        nonempty_path(hostfile, "list the hosts under hosts:")  # '' was read as the spec's directory
    except ValueError as exc:
        return [problem(loc, source, ("hostfile",), str(exc))]
    base = Path(source).resolve().parent if source != "<spec>" else Path.cwd()
    path = Path(hostfile).expanduser()
    path = path if path.is_absolute() else base / path
    try:
        text = read_limited(path, MAX_HOSTFILE_BYTES).decode("utf-8")  # no FIFO waited on, no device read forever
    except TooLarge:
        return [problem(loc, source, ("hostfile",), f"{path} is larger than {MAX_HOSTFILE_BYTES // 1024} KiB")]
    except OSError as exc:
        return [problem(loc, source, ("hostfile",), f"cannot read {path}: {exc.strerror or exc}")]
    except UnicodeDecodeError:
        return [problem(loc, source, ("hostfile",), f"{path} is not UTF-8 text")]
    try:
        bad = next((c for c in text if not c.isprintable() and c not in "\n\t\r"), None)
        if bad is not None:
            lineno = text[:text.index(bad)].count("\n") + 1
            return [SpecProblem(str(path), lineno, 1, "hostfile", f"not a text hostfile (control character {bad!r})")]
        entries = _hostfile_entries(text)
    except ValueError as exc:
        lineno, msg = exc.args
        return [SpecProblem(str(path), lineno, 1, "hostfile", msg)]
    data["hosts"] = [entry for entry, _ in entries]
    for i, (_, places) in enumerate(entries):  # a problem with a host is reported at its line of the hostfile
        for key, (line, col) in places.items():
            loc.elsewhere[("hosts", i, key) if key else ("hosts", i)] = (str(path), line, col)
    loc.values.setdefault(("hosts",), loc.position(("hostfile",)))  # in the spec: the hosts are its hostfile's
    return []


def parse_hostfile(text: str) -> list[dict]:
    """Parse the common `host slots=N` hostfile format into host dicts; raise ValueError(lineno, msg)."""
    return [entry for entry, _ in _hostfile_entries(text)]


def _hostfile_entries(text: str) -> list[tuple[dict, dict]]:
    """Each host of a hostfile with where it is: (entry, {"": (line, 1), "address": (line, col), "slots": ...})."""
    hosts = []
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0]
        parts = line.split()
        if not parts:
            continue
        entry: dict[str, Any] = {"address": parts[0]}
        places = {"": (lineno, 1)}  # the line; a key's column where it is not the line's first
        at = line.find(parts[0])
        if at:
            places["address"] = (lineno, at + 1)
        for opt in parts[1:]:
            at = line.find(opt, at + 1)
            key, sep, value = opt.partition("=")
            if key in ("slots", "max_slots", "max-slots") and sep and value.isascii() and value.isdigit():
                if key == "slots":
                    entry["slots"] = int(value)
                    places["slots"] = (lineno, at + 1)
            else:
                raise ValueError(lineno, f"cannot parse {opt!r} (expected slots=N)")
        hosts.append((entry, places))
    return hosts
