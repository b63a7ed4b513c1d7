"""Shared test helpers."""

import textwrap
from pathlib import Path

import pytest


@pytest.fixture
def write_spec(tmp_path: Path):
    """Write a dedented YAML spec into tmp_path and return its path."""

    def write(text: str, name: str = "cluster.yaml") -> Path:
        path = tmp_path / name
        path.write_text(textwrap.dedent(text))
        return path

    return write
