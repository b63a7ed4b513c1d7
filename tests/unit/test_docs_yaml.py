"""Every YAML example in the README and docs/, and every spec file in configs/ and examples/, validates: the docs
stay true to the spec's keys. A block's parts (separated by a blank line: the alternatives of one example) are each
merged into a small whole spec, so a fragment (`job: {restarts: 3}`) is checked in a spec around it."""

import copy
import re
from pathlib import Path

import pytest
import yaml

from clusterctl.errors import SpecError
from clusterctl.spec import load_spec

ROOT = Path(__file__).resolve().parents[2]
BASE = {
    "name": "docs",
    "ssh": {"user": "root"},
    "hosts": [{"address": "10.0.0.1"}, {"address": "10.0.0.2"}],
    "job": {"mode": "pserver", "entrypoint": ["python3", "train.py"], "pservers": 1},
}


def _merged(base: dict, part: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in part.items():
        out[key] = _merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def _examples() -> list:
    found = []
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = doc.read_text()
        for block in re.finditer(r"^```yaml\n(.*?)^```", text, re.S | re.M):
            line = text.count("\n", 0, block.start()) + 2
            for n, part in enumerate(re.split(r"\n[ \t]*\n", block.group(1))):
                if part.strip():
                    found.append(pytest.param(part, id=f"{doc.name}:{line}:{n}"))
    return found


EXAMPLES = _examples()


def test_the_docs_have_yaml_examples():
    assert len(EXAMPLES) >= 12, [p.id for p in EXAMPLES]  # the finder above still finds them


@pytest.mark.parametrize("part", EXAMPLES)
def test_a_yaml_example_of_the_docs_validates(part, tmp_path):
    doc = yaml.safe_load(part)
    assert isinstance(doc, dict), f"not a mapping: {part!r}"
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(_merged(BASE, doc)))
    try:
        load_spec(path)
    except SpecError as exc:
        pytest.fail(f"the example does not validate:\n{exc}")


SPEC_FILES = sorted([*(ROOT / "configs").glob("*.yaml"), *(ROOT / "examples").glob("*/*.yaml")])


def test_the_shipped_spec_files_are_found():
    assert {p.name for p in SPEC_FILES} >= {"example.yaml", "provision-example.yaml", "mpi.yaml", "ssh.yaml"}


@pytest.mark.parametrize("path", SPEC_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_a_shipped_spec_file_validates(path):
    load_spec(path)  # a SpecError names the file's line
