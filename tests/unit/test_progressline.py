"""The progress line, reading logs incrementally, step rates and the straggler rule (clusterctl/host/progressline.py)."""

from __future__ import annotations

import os

import pytest

from clusterctl.host import progressline as pl
from clusterctl.host.progressline import (LogProgress, add_point, find_stragglers, parse_progress_line, rate_over,
                                          slice_rates, step_at)


@pytest.mark.parametrize("line, want", [
    ("step=12 loss=0.3102 lr=0.01 time=1718000000.512",
     {"step": 12, "done": False, "time": 1718000000.512, "rank": None, "metrics": {"loss": 0.3102, "lr": 0.01}}),
    # the examples' lines: `trainer=` names the rank, other words are kept as metrics (numbers as numbers)
    ("step=3 loss=12.5000 trainer=0 pass=1 mode=sync",
     {"step": 3, "done": False, "time": None, "rank": "0", "metrics": {"loss": 12.5, "pass": 1, "mode": "sync"}}),
    ("done steps=180 loss=6.2001 steps_per_s=412.5 wall_s=0.44 trainer=0 mode=sync",
     {"step": 180, "done": True, "time": None, "rank": "0",
      "metrics": {"loss": 6.2001, "steps_per_s": 412.5, "wall_s": 0.44, "mode": "sync"}}),
    ("step=7 rank=3 trainer=1 acc=0.9", {"step": 7, "done": False, "time": None, "rank": "3", "metrics": {"acc": 0.9}}),
    ("step=7 loss=nan grad=inf note", {"step": 7, "done": False, "time": None, "rank": None,
                                       "metrics": {"loss": "nan", "grad": "inf"}}),
    ("step=7 time=yesterday", {"step": 7, "done": False, "time": None, "rank": None, "metrics": {}}),
    ("step=7 time=-5", {"step": 7, "done": False, "time": None, "rank": None, "metrics": {}}),
])
def test_progress_lines_parse(line, want):
    assert parse_progress_line(line) == want


@pytest.mark.parametrize("line", [
    "", "hello", "loss=0.3 step=4",  # step= must be the first word
    "step=-1 loss=2", "step=1.5", "step=", "step=abc", "done loss=3", "done steps=x",
    "checkpoint step=3 dir=/x", "resumed step=5 attempt=1", "step=1 " + "x" * pl.MAX_LINE,
])
def test_other_lines_are_not_progress(line):
    assert parse_progress_line(line) is None


def test_metrics_are_bounded_in_number_and_length():
    got = parse_progress_line("step=1 " + " ".join(f"m{i}={i}" for i in range(40)) + " tag=" + "y" * 200)
    assert list(got["metrics"]) == [f"m{i}" for i in range(pl.MAX_METRICS)]
    got = parse_progress_line("step=1 tag=" + "y" * 200)
    assert got["metrics"] == {"tag": "y" * pl.MAX_VALUE}


def test_points_are_thinned_to_one_per_gap_and_restart_on_a_lower_step():
    pts: list = []
    for i in range(10):  # ten steps in 0.45 s: the first point and the latest
        add_point(pts, 100.0 + i * 0.05, i, gap=1.0)
    assert pts == [[100.0, 0], [100.45, 9]]
    add_point(pts, 101.2, 20, gap=1.0)
    assert pts == [[100.0, 0], [100.45, 9], [101.2, 20]]
    add_point(pts, 102.0, 3, gap=1.0)  # a restart from a checkpoint: a new history
    assert pts == [[102.0, 3]]
    for i in range(10):
        add_point(pts, 103.0 + i, i + 4, gap=1.0, keep=4)
    assert [p[1] for p in pts] == [10, 11, 12, 13]


def test_rate_over_a_window_and_a_stall_slows_to_zero():
    pts = [[float(t), 2 * t] for t in range(0, 31)]  # 2 steps/s for 30 s
    assert rate_over(pts, 30.0, window=20.0) == pytest.approx(2.0)
    assert rate_over(pts, 40.0, window=20.0) == pytest.approx(1.0)  # printed nothing for the last 10 s
    assert rate_over(pts, 60.0, window=20.0) == 0.0
    assert rate_over([[10.0, 5]], 11.0) is None  # less than MIN_RATE_SPAN_S of history
    assert rate_over([], 11.0) is None
    assert step_at(pts, -1.0) is None and step_at(pts, 4.5) == 9 and step_at(pts, 99.0) == 60


def test_slices_are_aligned_to_the_clock_and_empty_before_the_history():
    pts = [[float(t), t] for t in range(95, 131)]  # one step a second from t=95 to 130
    assert slice_rates(pts, 131.7, 10.0, 4) == [[100.0, None], [110.0, 1.0], [120.0, 1.0], [130.0, 1.0]]
    assert slice_rates(pts, 131.7, 0, 4) == [] and slice_rates(pts, 131.7, 10.0, 0) == []


def _slices(rates, end=160.0, size=10.0):
    return [[end - size * (len(rates) - 1 - i), r] for i, r in enumerate(rates)]


def test_the_straggler_rule():
    fast = _slices([10.0] * 6)
    rule = dict(threshold=0.8, count=6)
    # below 80% of the median in every one of the last 6 slices: a straggler, with its mean rate and the median's
    got = find_stragglers({"a": fast, "b": fast, "c": _slices([7.0] * 6)}, **rule)
    assert got == {"c": {"rate": 7.0, "median": 10.0, "ratio": 0.7}}
    # fast again in the last slice: not (the rule is "stays below for the whole window")
    assert find_stragglers({"a": fast, "b": fast, "c": _slices([7.0] * 5 + [9.5])}, **rule) == {}
    # just at the threshold: not below
    assert find_stragglers({"a": fast, "b": fast, "c": _slices([8.0] * 6)}, **rule) == {}
    # a stalled rank (rate 0) among moving ones is one
    assert list(find_stragglers({"a": fast, "b": fast, "c": _slices([0.0] * 6)}, **rule)) == ["c"]
    # not enough history yet (5 slices), a gap in the rank's history, one rank alone, everyone stalled: nobody
    assert find_stragglers({"a": _slices([10.0] * 5), "c": _slices([1.0] * 5)}, **rule) == {}
    assert find_stragglers({"a": fast, "b": fast, "c": _slices([1.0, None, 1, 1, 1, 1])}, **rule) == {}
    assert find_stragglers({"c": _slices([1.0] * 6)}, **rule) == {}
    assert find_stragglers({"a": _slices([0.0] * 6), "b": _slices([0.0] * 6)}, **rule) == {}
    # two ranks: the median is their mean; 2 < 0.8 * 6
    assert list(find_stragglers({"a": fast, "c": _slices([2.0] * 6)}, **rule)) == ["c"]


def test_the_documented_defaults():
    assert (pl.STRAGGLER_THRESHOLD, pl.STRAGGLER_WINDOW_S, pl.STRAGGLER_SLICES) == (0.8, 60.0, 6)
    fast, slow = _slices([10.0] * 6), _slices([7.9] * 6)
    assert list(find_stragglers({"a": fast, "b": fast, "c": slow})) == ["c"]


def _write(path, text, mode="a"):
    with open(path, mode) as f:
        f.write(text)


def test_a_log_is_read_incrementally_partial_lines_wait_for_their_end(tmp_path):
    log = tmp_path / "trainer.0.log"
    _write(log, "starting\nstep=1 loss=4 time=100\nstep=2 loss=3 time=101\n", "w")
    lp = LogProgress(str(log))
    lp.poll(now=102.0)
    assert lp.ranks["0"]["step"] == 2 and lp.ranks["0"]["metrics"] == {"loss": 3}
    assert lp.offset == os.path.getsize(log)
    _write(log, "step=3 loss=2 time=103\nstep=4 lo")  # the writer is in the middle of a line
    lp.poll(now=103.5)
    assert lp.ranks["0"]["step"] == 3
    _write(log, "ss=1 time=104\n")
    lp.poll(now=104.5)
    view = lp.view("0")
    assert (view["step"], view["metrics"], view["done"]) == (4, {"loss": 1}, False)
    assert view["rate"] == pytest.approx(3 / 4.5, abs=1e-4) and view["age_s"] == pytest.approx(0.5)
    _write(log, "done steps=4 steps_per_s=1.0\n")
    lp.poll(now=105.0)
    view = lp.view("0")
    assert (view["step"], view["done"], view["rate"], view["metrics"]) == (4, True, None, {"loss": 1, "steps_per_s": 1.0})
    # survives a round trip through the cache
    again = LogProgress.from_json(lp.to_json())
    assert again.to_json() == lp.to_json()


def _steps(log, first, last):
    _write(log, "".join(f"step={i} loss=1\n" for i in range(first, last + 1)))


def test_reads_far_apart_give_the_rate_between_them_not_all_of_it_in_the_window(tmp_path):
    # `clusterctl status` 40 s after the one before, a rank at 2 steps/s: 80 steps since, over 40 s. The step held
    # at the earlier read until the window's start was 4 steps/s (5.5 seen on a test cluster for a rank at 2)
    log = tmp_path / "trainer.3.log"
    _write(log, "", "w")
    lp = LogProgress(str(log))
    _steps(log, 0, 10)
    lp.poll(now=100.0)
    _steps(log, 11, 90)
    lp.poll(now=140.0)
    assert lp.view("0")["rate"] == pytest.approx(2.0)
    # its slices (the straggler rule's) are 2 steps/s each, not 0 and then 8
    assert [r for _, r in lp.view("0", slice_s=10.0, slices=3)["slices"]] == [2.0, 2.0, 2.0]


def test_a_rank_that_stopped_printing_for_a_while_is_not_slow_all_along(tmp_path):
    # read every 10 s (top, or status in a loop): steps 0-10, nothing for 30 s, then 20 steps in the last 5 s.
    # Each read that found nothing new says the rank was still at its step then
    log = tmp_path / "trainer.0.log"
    _write(log, "", "w")
    lp = LogProgress(str(log))
    _steps(log, 0, 10)
    for now in (100.0, 110.0, 120.0, 130.0):
        lp.poll(now=now)
    _steps(log, 11, 30)
    lp.poll(now=140.0)
    assert lp.view("0")["rate"] == pytest.approx(20 / 20)  # 20 steps in the 20 s window; a line from (100, 10) was 0.5
    assert [r for _, r in lp.view("0", slice_s=10.0, slices=4)["slices"]] == [0.0, 0.0, 0.0, 2.0]
    assert lp.view("0")["step"] == 30


def test_a_truncated_or_replaced_log_is_read_again_from_its_start(tmp_path):
    log = tmp_path / "t.log"
    _write(log, "step=10 time=100\nstep=11 time=101\n", "w")
    lp = LogProgress(str(log))
    lp.poll(now=101.0)
    _write(log, "step=1 time=200\n", "w")  # truncated: a new run writes the same file
    lp.poll(now=201.0)
    assert lp.ranks["0"]["step"] == 1 and lp.ranks["0"]["points"] == [[200.0, 1]]
    os.replace(log, str(log) + ".1")  # rotated away, a new file in its place
    _write(log, "step=5 time=300\n", "w")
    lp.poll(now=301.0)
    assert lp.ranks["0"]["step"] == 5


def test_reads_are_bounded_the_first_read_takes_the_tail(tmp_path):
    log = tmp_path / "big.log"
    lines = "".join(f"step={i} loss=1 time={1000 + i * 0.01:.2f}\n" for i in range(20000))  # ~600 KB
    _write(log, lines, "w")
    lp = LogProgress(str(log))
    lp.poll(now=2000.0)
    assert lp.ranks["0"]["step"] == 19999
    assert lp.offset == len(lines)
    more = "".join(f"step={i} time={1200 + i * 0.01:.2f}\n" for i in range(20000, 40000))
    _write(log, more)
    lp.poll(now=2001.0)  # more than MAX_READ appended: the older part skipped, the newest line read
    assert lp.ranks["0"]["step"] == 39999 and lp.offset == len(lines) + len(more)
    _write(log, "x" * (pl.MAX_LINE + 10))  # a huge unfinished line is skipped, not held forever
    lp.poll(now=2002.0)
    _write(log, "\nstep=40000 time=1500\n")
    lp.poll(now=2003.0)
    assert lp.ranks["0"]["step"] == 40000


def test_a_log_several_ranks_share_keeps_each_rank(tmp_path):
    log = tmp_path / "mpi.log"
    _write(log, "".join(f"step={s} trainer={r} time={100 + s}\n" for s in range(5) for r in range(3)) + "step=9 time=200\n", "w")
    lp = LogProgress(str(log))
    lp.poll(now=205.0, default_rank="0")
    assert sorted(lp.ranks) == ["0", "1", "2"]
    assert lp.ranks["0"]["step"] == 9  # a line without rank= is the process's own rank
    assert lp.ranks["1"]["step"] == 4


def test_a_malformed_cache_entry_is_refused():
    with pytest.raises((ValueError, TypeError, KeyError, AttributeError)):
        LogProgress.from_json({"path": "x", "ranks": {"0": {"step": "1", "points": []}}})
    with pytest.raises((ValueError, TypeError, KeyError, AttributeError)):
        LogProgress.from_json({"path": "x", "offset": "12"})
