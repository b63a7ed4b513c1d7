"""Training progress on the controller: what hosts report of it, checked, and the stragglers among the ranks.

The hosts read the progress lines (`step=N loss=X ...`, clusterctl/host/progressline.py) from the processes'
logs; `agent top` replies carry, per process, {step, rate, done, metrics, age_s, slices}. A host may be
compromised, so what it sends is taken through an allow-list with bounds (`clean_progress`) before anything
shows or compares it. `stragglers` applies the straggler rule (host/progressline.find_stragglers) to every
rank of a job, wherever it runs. Pure: no I/O, no rich (`clusterctl status` and `top` render it).
"""

from __future__ import annotations

import math
import re

from .host.progressline import (RATE_WINDOW_S, STRAGGLER_SLICES, STRAGGLER_THRESHOLD, STRAGGLER_WINDOW_S,
                                find_stragglers)

__all__ = ["parse_fields", "clean_progress", "stragglers", "metrics_text", "RATE_WINDOW_S", "STRAGGLER_THRESHOLD",
           "STRAGGLER_WINDOW_S", "STRAGGLER_SLICES"]

_FIELD = re.compile(r"(\w+)=(\S+)")
_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_.\-/]{0,63}\Z")
MAX_METRICS = 16
MAX_SLICES = 60
# no training loop makes a billion steps a second: a rate above it is a host's invention, and two of 1e308 made the
# straggler median `inf`, which no JSON can carry (`status --json` failed)
MAX_RATE = 1e9
MAX_AGE_S = 1e9  # ~31 years


def parse_fields(text: str) -> dict[str, str]:
    """`a=1 b=x` → {'a': '1', 'b': 'x'}."""
    return dict(_FIELD.findall(text))


def _finite(x, lo: float = -math.inf, hi: float = math.inf) -> float | None:
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return None
    x = float(x)
    return x if math.isfinite(x) and lo <= x <= hi else None


def _word(x, limit: int = 64) -> str | None:
    if not isinstance(x, str) or not x or len(x) > limit:
        return None
    return x if x.isprintable() else None


def clean_progress(d, *, keep_slices: bool = True) -> dict | None:
    """A host's progress entry through an allow-list: {step, rate, done, metrics, age_s[, slices][, rank]}, or None
    when it is not one (wrong types, out of bounds)."""
    if not isinstance(d, dict):
        return None
    step = d.get("step")
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step < 10**15:
        return None
    metrics = {}
    raw = d.get("metrics")
    if isinstance(raw, dict):
        for k, v in list(raw.items())[:MAX_METRICS]:
            if not isinstance(k, str) or not _KEY.match(k):
                continue
            value = _finite(v) if not isinstance(v, str) else _word(v)
            if value is not None:
                metrics[k] = int(value) if isinstance(v, int) and not isinstance(v, bool) else value
    out = {"step": step, "rate": _finite(d.get("rate"), 0.0, MAX_RATE), "done": d.get("done") is True,
           "metrics": metrics, "age_s": _finite(d.get("age_s"), 0.0, MAX_AGE_S)}
    if keep_slices and isinstance(d.get("slices"), list):
        slices = []
        for item in d["slices"][-MAX_SLICES:]:
            if isinstance(item, list) and len(item) == 2 and _finite(item[0]) is not None:
                slices.append([float(item[0]), _finite(item[1], 0.0, MAX_RATE)])
        out["slices"] = slices
    rank = _word(d.get("rank"), 32)
    if rank is not None:
        out["rank"] = rank
    return out


def stragglers(ranks: dict, *, threshold: float = STRAGGLER_THRESHOLD, slices: int = STRAGGLER_SLICES) -> dict:
    """The straggler rule over a job's ranks: {key: progress (clean_progress, with slices)} → {key: {rate, median,
    ratio}} for the ranks below `threshold` × the median rate in each of the last `slices` slices. Finished ranks
    (done) take no part."""
    live = {k: p.get("slices") or [] for k, p in ranks.items() if p and not p.get("done")}
    return find_stragglers(live, threshold, slices)


def metrics_text(metrics: dict, limit: int = 4) -> str:
    """`loss=0.3102 acc=0.91`: the first `limit` metrics, loss first."""
    items = sorted(metrics.items(), key=lambda kv: kv[0] != "loss")[:limit]
    return " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in items)
