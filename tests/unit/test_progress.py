"""Progress on the controller (clusterctl/progress.py): hosts' progress entries through an allow-list, the
straggler rule over a job's ranks, and how metrics read."""

import math

import pytest

from clusterctl.progress import clean_progress, metrics_text, parse_fields, stragglers


def test_parse_fields():
    assert parse_fields("step=3 loss=12.5 mode=sync x") == {"step": "3", "loss": "12.5", "mode": "sync"}


def test_a_progress_entry_passes_the_allow_list():
    entry = {"step": 12, "rate": 3.5, "done": False, "age_s": 0.4, "metrics": {"loss": 0.31, "pass": 2, "mode": "sync"},
             "slices": [[100.0, 3.0], [110.0, None]], "rank": "3", "extra": "dropped"}
    assert clean_progress(entry) == {"step": 12, "rate": 3.5, "done": False, "age_s": 0.4,
                                     "metrics": {"loss": 0.31, "pass": 2, "mode": "sync"},
                                     "slices": [[100.0, 3.0], [110.0, None]], "rank": "3"}
    assert "slices" not in clean_progress(entry, keep_slices=False)


@pytest.mark.parametrize("entry", [None, [], "step=3", {"step": "3"}, {"step": -1}, {"step": True}, {"step": 10**16},
                                   {"rate": 1.0}])
def test_what_is_not_a_progress_entry(entry):
    assert clean_progress(entry) is None


def test_hostile_fields_are_dropped_not_trusted():
    entry = {"step": 1, "rate": -5, "age_s": math.inf, "done": "yes",
             "metrics": {"loss": math.nan, "ok": 1.5, "bad key": 1, "\x1b[2J": 2, "msg": "\x1b]0;owned\x07", "big": "x" * 65,
                         **{f"m{i}": i for i in range(40)}},
             "slices": [[1.0, -2.0], "x", [math.nan, 1.0], [2.0, 1.0, 3.0]] * 30, "rank": "\n"}
    got = clean_progress(entry)
    assert got["rate"] is None and got["age_s"] is None and got["done"] is False and "rank" not in got
    assert set(got["metrics"]) <= {"ok"} | {f"m{i}" for i in range(40)} and got["metrics"]["ok"] == 1.5
    assert len(got["metrics"]) <= 16
    assert all(s == [1.0, None] for s in got["slices"])


def test_rates_no_training_loop_makes_are_dropped_so_the_straggler_median_stays_finite():
    """Two hosts' rates of 1e308 (finite, so they passed) made the median `inf`: `status --json` could not say it."""
    huge = {"step": 5, "rate": 1e308, "age_s": 1e308, "slices": [[float(i), 1e308] for i in range(6)]}
    honest = {"step": 5, "rate": 3.0, "slices": [[float(i), 3.0] for i in range(6)]}
    got = clean_progress(huge)
    assert (got["rate"], got["age_s"], {r for _, r in got["slices"]}) == (None, None, {None})
    ranks = {"a": got, "b": clean_progress(honest), "c": clean_progress(huge)}
    assert stragglers(ranks) == {}  # the honest rank is no straggler, and nothing is inf
    assert clean_progress({"step": 5, "rate": 2.5e5})["rate"] == 2.5e5  # a fast loop's real rate stays


def _p(rates, done=False):
    return {"step": 1, "done": done, "slices": [[100.0 + 10 * i, r] for i, r in enumerate(rates)]}


def test_stragglers_among_a_jobs_ranks():
    ranks = {"a": _p([10] * 6), "b": _p([10] * 6), "c": _p([3] * 6), "d": _p([1] * 6, done=True), "e": None}
    assert stragglers(ranks) == {"c": {"rate": 3.0, "median": 10.0, "ratio": 0.3}}  # a finished rank takes no part
    assert stragglers(ranks, threshold=0.2) == {}


def test_metrics_text_puts_loss_first():
    assert metrics_text({"acc": 0.91234, "loss": 0.3102567, "mode": "sync", "pass": 2, "x": 1}) == \
        "loss=0.3103 acc=0.9123 mode=sync pass=2"
