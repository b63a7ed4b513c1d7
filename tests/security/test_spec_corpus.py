"""The hostile-spec corpus: every case is refused with one-line `FILE:LINE:COL: ...` problems and exit 2,
never a traceback, within a time and memory bound (issue 12, findings 6 and 7)."""

from __future__ import annotations

import re
import resource
import time

import pytest

from clusterctl import cli
from hostile_specs import VALID, cases, hostfile_cases

CASES = cases()
HOSTFILES = hostfile_cases()
PER_CASE_S = 2.0
MAX_RSS_GROWTH_MB = 200  # the old loader took 3.1 GB on a 309-byte spec


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _validate(path, capsys) -> tuple[int, str, str, float]:
    t0 = time.monotonic()
    rc = cli.main(["validate", str(path)])
    took = time.monotonic() - t0
    captured = capsys.readouterr()
    return rc, captured.out, captured.err, took


def _assert_one_line_problems(path, rc, out, err, took):
    assert rc == 2, (rc, out, err)
    assert out == "" and "Traceback" not in err
    lines = err.splitlines()
    assert lines, "no problem printed"
    pattern = re.compile(r"^" + re.escape(str(path)) + r":\d+:\d+: \S.*$")
    for line in lines:
        assert pattern.match(line) and line.isprintable(), line
    assert took < PER_CASE_S, f"{took:.2f}s"


def test_corpus_is_big_enough():
    assert len(CASES) + len(HOSTFILES) >= 100


def test_valid_base_spec_is_valid(tmp_path, capsys):
    path = tmp_path / "ok.yaml"
    path.write_text(VALID)
    assert cli.main(["validate", str(path)]) == 0, capsys.readouterr()


@pytest.mark.timeout(120)
def test_hostile_specs_give_one_line_errors_and_exit_2(tmp_path, capsys):
    before = _rss_mb()
    failures = []
    for name, data in CASES.items():
        path = tmp_path / f"{len(failures)}-{abs(hash(name))}.yaml"
        path.write_bytes(data)
        rc, out, err, took = _validate(path, capsys)
        try:
            _assert_one_line_problems(path, rc, out, err, took)
        except AssertionError as exc:
            failures.append(f"{name}: {exc}")
    assert not failures, "\n".join(failures)
    assert _rss_mb() - before < MAX_RSS_GROWTH_MB


def test_hostile_hostfiles_give_one_line_errors(tmp_path, capsys):
    failures = []
    for name, data in HOSTFILES.items():
        d = tmp_path / name
        d.mkdir()
        (d / "hosts").write_bytes(data)
        spec = d / "c.yaml"
        spec.write_text("name: c\nhostfile: hosts\njob: {entrypoint: [python]}\n")
        rc, out, err, took = _validate(spec, capsys)
        assert rc == 2 and "Traceback" not in err, (name, err)
        for line in err.splitlines():
            if not (re.match(r"^\S+:\d+:\d+: \S", line) and line.isprintable()):
                failures.append(f"{name}: {line!r}")
        assert took < PER_CASE_S
    assert not failures, failures


def test_billion_laughs_is_refused_fast(tmp_path, capsys):
    path = tmp_path / "laughs.yaml"
    path.write_bytes(CASES["billion-laughs-9"])
    rc, _, err, took = _validate(path, capsys)
    assert rc == 2 and took < 0.5, (err, took)
    assert err.strip().endswith("spec expands to more than 100000 values (aliases?)"), err


def test_error_paths_are_walked_against_the_model(tmp_path, capsys):
    """pydantic's union tags are dropped by structure, not by their spelling: keys like `Name` stay."""
    for text, want in [
        ("name: c\nhosts: [{address: h1}]\njob: {entrypoint: [python], env: {PATH: [1, 2]}}\n",
         ":3:35: job.env.PATH: expected a string"),
        ("Name: c\nname: c\nhosts: [{address: h1}]\njob: {entrypoint: [python]}\n",
         ":1:1: Name: unknown key (did you mean 'name'?)"),
        ("name: c\nhosts: [{address: h1}]\njob: {entrypoint: [python], int: 1}\n",
         ":3:29: job.int: unknown key"),
        ("name: c\nhosts: [{address: h1}]\njob: {entrypoint: [python], pservers: {per_host: x}}\n",
         ":3:29: job.pservers: expected {per_host: N} with N an integer"),
    ]:
        path = tmp_path / "p.yaml"
        path.write_text(text)
        rc, _, err, _ = _validate(path, capsys)
        assert rc == 2 and err.splitlines() == [f"{path}{want}"], err
