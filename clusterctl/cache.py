"""The controller's cache directory: one place that decides where clusterctl keeps its state."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["cache_root", "cache_dir"]


def cache_root() -> Path:
    """$XDG_CACHE_HOME/clusterctl (an unset or empty XDG_CACHE_HOME means ~/.cache)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "clusterctl"


def cache_dir(*parts: str) -> Path:
    """A directory under cache_root(), created private (0700) when missing."""
    path = cache_root().joinpath(*parts)
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    return path
