"""pydantic's errors as SpecProblems: each at the line:column of the key it is about, in the spec's words.

An error's location is walked against the models' annotations (clusterctl.spec.models and the provision
schema), so the union tags pydantic inserts are dropped where the walk knows a union is, and a user's key
(`PATH`, `Name`, `int`) is never taken for one."""

from __future__ import annotations

import types
import typing
from typing import Annotated, Any, Union

from pydantic import BaseModel

from ..errors import SpecProblem
from ..yamlpos import Located
from .fields import _did_you_mean
from .models import ClusterSpec

__all__ = ["pydantic_problem", "problem", "dedupe", "dotted"]


def problem(loc: Located, source: str, path: tuple, message: str) -> SpecProblem:
    """A SpecProblem about the key at `path`, at its line:column in the spec (or in the file it was read from: a
    hostfile's hosts at their lines), printable on one line."""
    file, line, col = loc.where(path)
    return SpecProblem(file or source, line, col, _printable(dotted(path)), _printable(message))


def _printable(text: str) -> str:
    """`text` on one line: control characters (newlines, escapes, NUL) shown as Python escapes."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def dotted(path: tuple) -> str:
    """`("hosts", 0, "gpus")` as `hosts[0].gpus`."""
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


_PYDANTIC_MESSAGES = {
    "missing": "required key is missing",
    "int_type": "expected an integer",
    "int_parsing": "expected an integer",
    "float_type": "expected a number",
    "float_parsing": "expected a number",
    "string_type": "expected a string",
    "bool_type": "expected true or false",
    "bool_parsing": "expected true or false",
    "dict_type": "expected a mapping",
    "list_type": "expected a list",
    "tuple_type": "expected a list",
    "model_type": "expected a mapping",
    "model_attributes_type": "expected a mapping",
}


def pydantic_problem(loc: Located, source: str, err: dict, path: tuple | None = None) -> SpecProblem:
    """One pydantic error (from ValidationError.errors()) as a SpecProblem in the spec's words (`path`: its spec
    path, where known already: see telling())."""
    path = _spec_path(err["loc"]) if path is None else path
    kind = err["type"]
    if kind == "extra_forbidden" and path:
        parent = path[:-1]
        allowed = _allowed_keys(parent)
        return problem(loc, source, path, f"unknown key{_did_you_mean(path[-1], allowed)}")
    if kind in ("greater_than_equal", "less_than_equal", "greater_than", "less_than") and path and path[-1] in (
        "port", "pserver", "trainer", "master", "control"
    ):
        return problem(loc, source, path, f"port out of range (1-65535): {err.get('input')!r}")
    if kind == "literal_error":
        expected = err.get("ctx", {}).get("expected", "")
        given = err.get("input")
        hint = ""
        if isinstance(given, bool):  # YAML reads an unquoted off/on/yes/no as a boolean
            words = [w for w in (("on", "yes", "true") if given else ("off", "no", "false")) if f"'{w}'" in expected]
            if words:
                hint = f" (an unquoted {words[0]} reads as {str(given).lower()} in YAML: write '{words[0]}', quoted)"
        return problem(loc, source, path, f"expected one of {expected}, got {given!r}{hint}")
    if kind == "value_error":
        msg = str(err.get("ctx", {}).get("error", err["msg"]))
        return problem(loc, source, path, msg)
    if kind == "too_short" and path and path[-1] == "entrypoint":
        return problem(loc, source, path, "must name a program to run")
    message = _PYDANTIC_MESSAGES.get(kind, err["msg"][0].lower() + err["msg"][1:])
    return problem(loc, source, path, message)


def telling(errors: list[dict]) -> list[tuple[dict, tuple]]:
    """pydantic's errors less those that only echo a deeper one: the type errors of a union's other members
    (`pservers: {per_host: -1}` is not "an integer" nor "a list": its mapping has a bad value), and a list found
    too short once its bad items were refused (`entrypoint: [[a]]`); each with its spec path."""
    paths = [_spec_path(err["loc"]) for err in errors]
    deeper = {p[:i] for p in paths for i in range(len(p))}  # every path that has an error below it
    return [(err, path) for err, path in zip(errors, paths)
            if not (path in deeper and (err["type"].endswith("_type") or err["type"] == "too_short"))]


def _spec_path(err_loc: tuple) -> tuple:
    """The spec path of a pydantic error location: its parts walked against the models' annotations.

    pydantic puts the union member it tried ('int', 'PserversPerHost', "literal['gpu']", ...) into the
    location after a field whose type is a union; those are dropped here because the walk knows where
    a union is, not because of how the tag looks (a user's key `Name` or `int` is kept).
    """
    if err_loc[:1] == ("provision",):
        from ..provision.schema import ProvisionSpec

        return ("provision",) + _walk_loc(ProvisionSpec, tuple(err_loc[1:]))
    return _walk_loc(ClusterSpec, tuple(err_loc))


def _unwrap(ann: Any) -> Any:
    """`ann` without Annotated[...] and without the None of an Optional (pydantic adds no tag for it)."""
    while True:
        origin = typing.get_origin(ann)
        if origin is Annotated:
            ann = typing.get_args(ann)[0]
            continue
        if origin in (Union, types.UnionType):
            members = [a for a in typing.get_args(ann) if a is not type(None)]
            if len(members) == 1:
                ann = members[0]
                continue
        return ann


def _walk_loc(model: Any, parts: tuple) -> tuple:
    path: list = []
    ann: Any = model
    i = 0
    while i < len(parts):
        part = parts[i]
        ann = _unwrap(ann) if ann is not None else None
        origin = typing.get_origin(ann)
        if origin in (Union, types.UnionType):  # this part is the tag of the member tried
            members = [a for a in typing.get_args(ann) if a is not type(None)]
            ann = next((m for m in members if getattr(m, "__name__", None) == part), None)
            i += 1
            continue
        path.append(part)
        i += 1
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            f = ann.model_fields.get(part) if isinstance(part, str) else None
            ann = f.annotation if f is not None else None
        elif origin is dict:
            ann = typing.get_args(ann)[1] if typing.get_args(ann) else None
        elif origin in (tuple, list):
            args = typing.get_args(ann)
            if len(args) == 2 and args[1] is Ellipsis or origin is list:
                ann = args[0] if args else None
            elif isinstance(part, int) and 0 <= part < len(args):
                ann = args[part]
            else:
                ann = None
        else:
            ann = None
    return tuple(path)


def _allowed_keys(parent: tuple) -> list[str]:
    """Keys allowed in the mapping at `parent`, found by walking the models' field annotations."""
    model: type[BaseModel] | None = ClusterSpec
    if parent[:1] == ("provision",):
        from ..provision.schema import ProvisionSpec

        model, parent = ProvisionSpec, parent[1:]
    for part in parent:
        if isinstance(part, int) or model is None:
            continue
        field = model.model_fields.get(part)
        model = _model_in(field.annotation) if field else None
    return [k for k in model.model_fields if k != "source"] if model else []


def _model_in(annotation: Any) -> type[BaseModel] | None:
    """The BaseModel inside an annotation like `X | None`, `tuple[X, ...]` or `Union[int, X]`."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()) or ():
        found = _model_in(arg)
        if found is not None:
            return found
    return None


def dedupe(problems: list[SpecProblem]) -> list[SpecProblem]:
    """`problems` without repeats of the same message at the same key, in order."""
    seen, out = set(), []
    for p in problems:
        key = (p.path, p.message)
        if key not in seen:
            seen.add(key)
            out.append(p)
    return out
