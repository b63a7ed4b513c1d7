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
from .models import ClusterSpec

__all__ = ["load_spec", "parse_spec", "parse_hostfile", "MAX_HOSTFILE_BYTES", "MAX_SPEC_BYTES"]


PASSWORD_KEY_RE = re.compile(r"(^|[_-])(password|passwd|passphrase|pass)$", re.IGNORECASE)


MAX_HOSTFILE_BYTES = 1 << 20


def load_spec(path: str | Path, *, layout: bool = True, check=None) -> ClusterSpec:
    """Read, parse and validate the spec at `path`; raise SpecError with every problem found.

    layout=False leaves out the one check that lays out the plan (ports, endpoints, GPUs): for callers
    that plan the spec next (clusterctl.ops.plan_for reports the same problems at the same keys), so that
    a command lays out its plan once. `check(spec)`: more problems (the spec's backend's, clusterctl.backends),
    reported before the semantic checks, which they may explain."""
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

    problems = [problem(loc, source, p, "key given twice") for p in loc.duplicates]
    problems += _password_problems(loc, source, data, ())
    if problems:
        raise SpecError(problems)

    data = dict(data)
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
    if found:
        problems += [pydantic_problem(loc, source, err) for err in telling(found)]
        raise SpecError(sorted(dedupe(problems), key=lambda p: (p.file != source, p.line, p.column))) from None
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


def _load_hostfile(loc: Located, source: str, data: dict) -> list[SpecProblem]:
    hostfile = data.get("hostfile")
    if hostfile is None:
        return []
    if "hosts" in data:
        return [problem(loc, source, ("hostfile",), "give either hosts or hostfile, not both")]
    if not isinstance(hostfile, str):
        return []  # the type check reports it
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
        data["hosts"] = parse_hostfile(text)
    except ValueError as exc:
        lineno, msg = exc.args
        return [SpecProblem(str(path), lineno, 1, "hostfile", msg)]
    return []


def parse_hostfile(text: str) -> list[dict]:
    """Parse the common `host slots=N` hostfile format into host dicts; raise ValueError(lineno, msg)."""
    hosts = []
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        entry: dict[str, Any] = {"address": parts[0]}
        for opt in parts[1:]:
            key, sep, value = opt.partition("=")
            if key in ("slots", "max_slots", "max-slots") and sep and value.isdigit():
                if key == "slots":
                    entry["slots"] = int(value)
            else:
                raise ValueError(lineno, f"cannot parse {opt!r} (expected slots=N)")
        hosts.append(entry)
    return hosts
