"""A deterministic, synthetic stand-in for the UCI housing data of the fit-a-line seed (no downloads).

506 rows like the original: 13 features, already normalised as Paddle's ``uci_housing`` reader does
(here: zero mean, unit variance), and a price in thousands of dollars (mean ~22.5, std ~9). The price is
a fixed linear function of the features plus Gaussian noise (std 2.5), so the best achievable mean
squared error is ~6 and the seed's "average loss < 10" bar is meaningful.

    python examples/fit_a_line/data.py           # (re)writes data/housing-0.csv .. housing-3.csv
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

__all__ = ["FEATURES", "default_files", "generate", "load", "write_parts"]

FEATURES = ["CRIM", "ZN", "INDUS", "CHAS", "NOX", "RM", "AGE", "DIS", "RAD", "TAX", "PTRATIO", "B", "LSTAT"]
ROWS = 506
PARTS = 4
DATA_DIR = Path(__file__).resolve().parent / "data"
# True weights, loosely shaped like a linear fit of the real data (RM up, LSTAT down, ...).
_W = np.array([-0.9, 1.0, 0.1, 0.7, -2.0, 2.7, 0.0, -3.1, 2.6, -2.0, -2.1, 0.9, -3.7])
_B = 22.5


def generate(rows: int = ROWS, seed: int = 1978) -> np.ndarray:
    """The dataset as a ``(rows, 14)`` float64 array: 13 normalised features, then the price."""
    rng = np.random.default_rng(seed)
    mix = rng.normal(size=(13, 13)) * 0.3 + np.eye(13)  # correlated features, as in the real data
    x = rng.normal(size=(rows, 13)) @ mix
    x = (x - x.mean(axis=0)) / x.std(axis=0)
    y = x @ _W + _B + rng.normal(scale=2.5, size=rows)
    return np.column_stack([x, np.clip(y, 5.0, 50.0)])


def write_parts(directory: Path = DATA_DIR, parts: int = PARTS) -> list[Path]:
    """Write the dataset as ``parts`` CSV files (row i goes to part i % parts); return their paths."""
    directory.mkdir(parents=True, exist_ok=True)
    data = generate()
    paths = []
    for p in range(parts):
        path = directory / f"housing-{p}.csv"
        np.savetxt(path, data[p::parts], delimiter=",", fmt="%.6f", header=",".join(FEATURES + ["PRICE"]))
        paths.append(path)
    return paths


def default_files() -> list[Path]:
    """The CSV parts shipped next to this file, in order."""
    return sorted(DATA_DIR.glob("housing-*.csv"))


def load(files: Sequence[str | os.PathLike[str]]) -> tuple[np.ndarray, np.ndarray]:
    """Read CSV parts into ``(x float32 (n, 13), y float32 (n, 1))``, rows in file then line order."""
    arrays = [np.loadtxt(f, delimiter=",", ndmin=2) for f in files]
    data = np.concatenate(arrays) if arrays else np.empty((0, 14))
    return data[:, :13].astype(np.float32), data[:, 13:14].astype(np.float32)


if __name__ == "__main__":
    for written in write_parts():
        print(written)
