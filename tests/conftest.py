"""Shared test helpers."""

import signal
import textwrap
from pathlib import Path

import pytest


def pytest_configure(config):
    """Ctrl+C as in a terminal, however the suite was started: a shell's background job starts with SIGINT
    ignored, and an ignored signal stays ignored in every process started from it, so the tests that press
    Ctrl+C (here, and in the commands they start) would see nothing happen. A handler is not inherited: the
    children start with the default again."""
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture
def write_spec(tmp_path: Path):
    """Write a dedented YAML spec into tmp_path and return its path."""

    def write(text: str, name: str = "cluster.yaml") -> Path:
        path = tmp_path / name
        path.write_text(textwrap.dedent(text))
        return path

    return write
