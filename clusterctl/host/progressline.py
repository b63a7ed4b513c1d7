"""Training progress from log lines: the progress line, incremental reading of a log, step rates, stragglers.

The progress line (docs/lifecycle.md, "Progress and stragglers") is a line whose first word is `step=N`
(N a whole number), followed by `key=value` words: `step=12 loss=0.31 lr=0.01`. Reserved keys: `time` (Unix
seconds when the step ended; without it, the time the line was read), `rank` (whose step, for a log several
ranks share; `trainer` is taken as the rank when there is no `rank`). `done steps=N ...` (the examples' last
line) is step N, finished. Any program can print it; clusterctl/report.py is a helper that does.

Pure functions (parsing, rates, rate slices, the straggler rule) and `LogProgress`, which remembers how far
it read a log and keeps each rank's recent (time, step) points; clusterctl/host/metrics.py's Sampler holds one
per log. Stdlib only, Python 3.9 (the host package).
"""

import os
import re
import time

__all__ = ["parse_progress_line", "add_point", "step_at", "rate_over", "slice_rates", "median", "find_stragglers",
           "LogProgress", "rank_order", "STRAGGLER_THRESHOLD", "STRAGGLER_WINDOW_S", "STRAGGLER_SLICES",
           "RATE_WINDOW_S"]

# -- documented defaults (docs/lifecycle.md, "Progress and stragglers") ---------------------------------------
STRAGGLER_THRESHOLD = 0.8  # a rank below 80% of the job's median step rate ...
STRAGGLER_WINDOW_S = 60.0  # ... in every slice of the last minute ...
STRAGGLER_SLICES = 6  # ... cut into 6 slices of 10 s, aligned to the clock (so hosts' slices line up)
RATE_WINDOW_S = 20.0  # steps/s shown: over the last 20 s
MIN_RATE_SPAN_S = 2.0  # no rate from points less than 2 s apart

# -- bounds ----------------------------------------------------------------------------------------------------
MAX_READ = 256 * 1024  # new bytes of a log read per sample; more: the older part is skipped
FIRST_READ = 64 * 1024  # a log seen for the first time: its last 64 KiB
MAX_LINE = 4096  # longer lines are not progress lines
MAX_METRICS = 16  # metrics kept per line
MAX_VALUE = 64  # characters of a non-numeric metric value
MAX_RANKS_PER_LOG = 256
POINT_GAP_S = 1.0  # progress points kept at least this far apart (the latest always kept)
KEEP_POINTS = 240  # per rank: 4 minutes at one point a second


_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_.\-/]{0,63}\Z")
_INT = re.compile(r"^[0-9]{1,15}\Z")


def _value(text):
    try:
        v = float(text)
    except ValueError:
        return text[:MAX_VALUE]
    if v != v or abs(v) == float("inf"):
        return text[:MAX_VALUE]
    return int(v) if _INT.match(text) else v


def parse_progress_line(line):
    """A progress line -> {step, done, time, rank, metrics}, or None for any other line (pure).

    `step=12 loss=0.31 time=1718000000.5` -> step 12, metrics {'loss': 0.31}, time 1718000000.5;
    `done steps=180 loss=6.2` -> step 180, done. Words that are not key=value are ignored.
    """
    if len(line) > MAX_LINE:
        return None
    words = line.split()
    if not words:
        return None
    first = words[0]
    if first.startswith("step="):
        done = False
        step_text, rest = first[5:], words[1:]
    elif first == "done":
        done, step_text, rest = True, None, words[1:]
    else:
        return None
    fields = {}
    for w in rest:
        k, eq, v = w.partition("=")
        if eq and v and _KEY.match(k) and k not in fields:
            fields[k] = v
    if done:
        step_text = fields.pop("steps", None)
    if step_text is None or not _INT.match(step_text):
        return None
    t = fields.pop("time", None)
    try:
        t = float(t) if t is not None else None
    except ValueError:
        t = None
    if t is not None and not (t == t and 0 < t < 1e11):
        t = None
    rank = fields.pop("rank", None)
    trainer = fields.pop("trainer", None)
    rank = rank if rank is not None else trainer
    metrics = {}
    for k, v in fields.items():
        if len(metrics) >= MAX_METRICS:
            break
        metrics[k] = _value(v)
    return {"step": int(step_text), "done": done, "time": t, "rank": None if rank is None else rank[:32],
            "metrics": metrics}


# ============================================================================================ rates (pure)

def add_point(points, t, step, gap=POINT_GAP_S, keep=KEEP_POINTS):
    """Add (t, step) to a rank's points in place: at most one point per `gap` seconds (the latest kept) and one per
    time, at most `keep` points; a step lower than the last one (a restart) starts the history again."""
    if points and (step < points[-1][1] or t < points[-1][0]):
        del points[:]
    # the lines of one read (no time= of their own) are one point, the last; so are those within `gap`
    if points and (t == points[-1][0] or (len(points) >= 2 and t - points[-2][0] < gap)):
        points[-1] = [t, step]
    else:
        points.append([t, step])
    if len(points) > keep:
        del points[:len(points) - keep]


def step_at(points, t):
    """The step a rank had reached at time t; None before its first point. Between two points it is the straight
    line between them: a point is where a read of the log found the rank, and the lines a read finds were printed
    at some time since the read before (`clusterctl status` a minute apart: all of a minute's steps in one
    point), not all at the earlier read. After the last point the step holds: a rank that stopped printing."""
    before = None
    for pt, step in points:
        if pt > t:
            if before is None:
                return None
            t0, s0 = before
            return s0 if t0 == t else s0 + (step - s0) * (t - t0) / (pt - t0)
        before = (pt, step)
    return None if before is None else before[1]


def rate_over(points, now, window=RATE_WINDOW_S, min_span=MIN_RATE_SPAN_S):
    """Steps per second over the last `window` seconds up to `now` (step_at: a rank that stopped printing slows
    to 0); None with less than `min_span` seconds of history."""
    if not points:
        return None
    start = max(now - window, points[0][0])
    if now - start < min_span:
        return None
    s0, s1 = step_at(points, start), step_at(points, now)
    if s0 is None or s1 is None:
        return None
    return (s1 - s0) / (now - start)


def slice_rates(points, now, slice_s, count):
    """Step rates in the last `count` whole slices of `slice_s` seconds before `now`, the slices aligned to
    multiples of slice_s on the clock (so every host's slices line up): [[slice end, rate or None]], oldest
    first; None where the rank's history does not cover the slice."""
    out = []
    if slice_s <= 0 or count <= 0:
        return out
    last_end = int(now // slice_s) * slice_s
    for k in range(count - 1, -1, -1):
        end = last_end - k * slice_s
        a, b = step_at(points, end - slice_s), step_at(points, end)
        out.append([round(end, 3), None if a is None or b is None else round((b - a) / slice_s, 6)])
    return out


def median(values):
    """The median of a non-empty list of numbers."""
    v = sorted(values)
    n = len(v)
    return v[n // 2] if n % 2 else (v[n // 2 - 1] + v[n // 2]) / 2.0


def find_stragglers(slices_by_rank, threshold=STRAGGLER_THRESHOLD, count=STRAGGLER_SLICES):
    """The straggler rule (pure): {rank: slice_rates(...)} -> {rank: {rate, median, ratio}} for every rank whose
    step rate was below `threshold` x the median of all ranks' rates in each of the last `count` slices.

    Only slices that at least two ranks cover count, and every one of the last `count` slice ends seen must
    be covered by the rank; fewer slices than `count` (not enough history yet) mark nobody.
    """
    by_end = {}
    for rank, slices in slices_by_rank.items():
        for end, rate in slices or ():
            if rate is not None:
                by_end.setdefault(end, {})[rank] = rate
    ends = sorted(by_end)[-count:] if count > 0 else []
    if len(ends) < count or count <= 0:
        return {}
    medians = {}
    for e in ends:
        if len(by_end[e]) < 2:
            return {}
        medians[e] = median(list(by_end[e].values()))
    out = {}
    for rank in slices_by_rank:
        rates = [by_end[e].get(rank) for e in ends]
        if any(r is None for r in rates):
            continue
        if all(medians[e] > 0 and r < threshold * medians[e] for e, r in zip(ends, rates)):
            med = sum(medians.values()) / len(medians)
            mean = sum(rates) / len(rates)
            out[rank] = {"rate": round(mean, 6), "median": round(med, 6), "ratio": round(mean / med, 4)}
    return out


# ============================================================================================ one log

class LogProgress:
    """Progress read incrementally from one log file: the offset read to, and per rank the last progress line
    and its recent (time, step) points."""

    def __init__(self, path, ino=None, offset=None, seen=None, ranks=None):
        self.path = path
        self.ino = ino
        self.offset = offset  # None: never read
        self.seen = seen  # wall time of the last read: every rank's step is known up to then
        self.ranks = ranks if ranks is not None else {}  # key -> {step, time, done, metrics, points}

    def to_json(self):
        """A JSON-able dict (the Sampler's cache)."""
        return {"path": self.path, "ino": self.ino, "offset": self.offset, "seen": self.seen, "ranks": self.ranks}

    @classmethod
    def from_json(cls, d):
        """The inverse of to_json; raises ValueError/TypeError/KeyError on a malformed dict."""
        ranks = d.get("ranks") or {}
        if not isinstance(ranks, dict):
            raise ValueError("ranks")
        for r in ranks.values():
            if not isinstance(r.get("points"), list) or not isinstance(r.get("step"), int):
                raise ValueError("rank entry")
        off = d.get("offset")
        if off is not None and not isinstance(off, int):
            raise ValueError("offset")
        return cls(str(d["path"]), d.get("ino"), off, d.get("seen"), ranks)

    def poll(self, now=None, default_rank="0"):
        """Read what was appended since the last poll (at most MAX_READ bytes) and fold its progress lines in."""
        now = time.time() if now is None else now
        try:
            f = open(self.path, "rb")
        except OSError:
            return
        with f:
            try:
                st = os.fstat(f.fileno())
            except OSError:
                return
            if self.ino != st.st_ino or self.offset is None or st.st_size < self.offset:
                # a new file (a new attempt, a rotated log), or truncated: start from its tail
                self.ino, self.offset, self.ranks = st.st_ino, max(0, st.st_size - FIRST_READ), {}
                skip_partial = self.offset > 0
            else:
                skip_partial = False
            start = self.offset
            if st.st_size - start > MAX_READ:
                start, skip_partial = st.st_size - MAX_READ, True
            f.seek(start)
            data = f.read(min(MAX_READ, max(0, st.st_size - start)))
        end = data.rfind(b"\n")
        if end < 0:
            if len(data) >= MAX_LINE:  # one huge unfinished line: no progress line; skip it
                self.offset = start + len(data)
            else:
                self.offset = start
            self._hold(now)
            self.seen = now
            return
        body = data[:end]
        if skip_partial:
            cut = body.find(b"\n")
            body = body[cut + 1:] if cut >= 0 else b""
        self.offset = start + end + 1
        for raw in body.split(b"\n"):
            if b"=" not in raw:
                continue
            got = parse_progress_line(raw.decode("utf-8", "replace"))
            if got is not None:
                self._fold(got, now, default_rank)
        self._hold(now)
        self.seen = now

    def _hold(self, now):
        """Every rank whose lines carry no `time=` was, as of this read, at its last step: a point that says so
        (step_at draws straight lines between points: without it, a rank that printed nothing for a while and then
        went on would seem to have been slow all along). Ranks that time their own lines keep their own clock."""
        for r in self.ranks.values():
            if not r["done"] and not r.get("timed") and r["points"]:
                add_point(r["points"], now, r["step"])

    def _fold(self, got, now, default_rank):
        key = got["rank"] if got["rank"] is not None else default_rank
        r = self.ranks.get(key)
        if r is None:
            if len(self.ranks) >= MAX_RANKS_PER_LOG:
                return
            r = self.ranks[key] = {"step": got["step"], "time": None, "done": False, "metrics": {}, "points": []}
        t = got["time"] if got["time"] is not None else now
        add_point(r["points"], t, got["step"])
        r.update(step=got["step"], time=t, done=got["done"], timed=got["time"] is not None)
        if got["metrics"] or not got["done"]:
            r["metrics"] = got["metrics"] if not got["done"] else dict(r["metrics"], **got["metrics"])

    def view(self, key, now=None, slice_s=0.0, slices=0):
        """What one rank's progress looks like now: {step, rate, done, metrics, age_s[, slices]}; None when the log
        has shown no progress line for it."""
        r = self.ranks.get(key)
        if r is None:
            return None
        now = self.seen if self.seen is not None else (time.time() if now is None else now)
        out = {"step": r["step"], "done": r["done"], "metrics": r["metrics"],
               "rate": None if r["done"] else _round(rate_over(r["points"], now)),
               "age_s": None if r["time"] is None else round(max(0.0, now - r["time"]), 3)}
        if slices and not r["done"]:
            out["slices"] = slice_rates(r["points"], now, slice_s, slices)
        return out


def _round(x, n=4):
    return None if x is None else round(x, n)


def rank_order(key):
    """Sort key for rank names: numbers in numeric order, then the others."""
    return (0, int(key), "") if key.isdigit() else (1, 0, key)
