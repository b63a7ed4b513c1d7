"""clusterctl.backends: one registry, one interface; a key a backend cannot honour is refused at its line."""

from __future__ import annotations

import re
import typing
from pathlib import Path

import pytest

from clusterctl import backends
from clusterctl.backends.base import Backend
from clusterctl.errors import SpecError
from clusterctl.spec import ClusterSpec, parse_spec

ROOT = Path(backends.__file__).resolve().parents[2]


def test_the_specs_backend_choices_are_the_registry():
    choices = typing.get_args(ClusterSpec.model_fields["backend"].annotation)
    assert tuple(choices) == backends.names()


@pytest.mark.parametrize("name", backends.names())
def test_every_registered_backend_implements_the_interface(name):
    cls = backends.backend_class(name)
    assert issubclass(cls, Backend) and cls.name == name and cls.summary
    assert not getattr(cls, "__abstractmethods__", None), cls.__abstractmethods__


def test_nothing_outside_the_registry_branches_on_a_backends_name():
    """`spec.backend == "slurm"` and the like belong to clusterctl/backends only (docs/architecture.md)."""
    pattern = re.compile(r"""backend\s*(==|!=|in)\s*\(?\s*["']""")
    found, scanned = [], 0
    for path in sorted((ROOT / "clusterctl").rglob("*.py")):
        scanned += 1
        if "backends" in path.relative_to(ROOT).parts:
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if pattern.search(line):
                found.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert scanned > 50 and not found, (scanned, found)


def test_an_unsupported_key_is_refused_at_its_line_and_column():
    text = "name: x\nhosts: [{address: a}]\njob: {entrypoint: python3 t.py}\nslurm:\n  login: l\n"
    with pytest.raises(SpecError) as info:
        parse_spec(text, "s.yaml", check=backends.problems)
    (p,) = info.value.problems
    assert (p.line, p.column, p.path) == (4, 1, "slurm")
    assert p.message == "not supported with backend: ssh: a slurm: section needs backend: slurm"


def test_an_unknown_backend_is_one_line():
    with pytest.raises(Exception, match="unknown backend 'nope'; known: ssh"):
        backends.backend_class("nope")
