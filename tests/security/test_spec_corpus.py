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
    assert err.strip().endswith("spec has more than 100000 values (its aliases expanded)"), err


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


@pytest.mark.parametrize("hostfile, first, count, last", [
    ("".join(f"h{i} slots=0\n" for i in range(20000)), "1:4: hosts[0].slots: input should be greater than or equal to 1",
     20000, "21:5"),
    ("h1\n" * 10000, "2:1: hosts[1]: duplicate host h1 (also hosts[0])", 9999, "22:1"),
], ids=["slots-0", "one-host-many-times"])
def test_a_hostfile_of_many_bad_hosts_prints_twenty_lines_and_a_count(tmp_path, capsys, hostfile, first, count, last):
    """A line per problem was a line per host: 65,000 for a 65,000-host hostfile, all at the spec's 1:1. Now the
    first 20, at their lines of the hostfile, and one more line (of the same FILE:LINE:COL: shape) with the count."""
    (tmp_path / "hosts").write_text(hostfile)
    spec = tmp_path / "c.yaml"
    spec.write_text("name: c\nssh: {config: none}\nhostfile: hosts\njob: {entrypoint: [python]}\n")
    rc, out, err, took = _validate(spec, capsys)
    lines = err.splitlines()
    assert (rc, out, len(lines)) == (2, "", 21), err[:500]
    assert lines[0] == f"{tmp_path / 'hosts'}:{first}"
    assert lines[-1] == f"{tmp_path / 'hosts'}:{last}: ... and {count - 20} more problems (the first 20 are shown)"
    assert all(re.match(r"^\S+:\d+:\d+: \S", line) and line.isprintable() for line in lines)
    assert took < PER_CASE_S, f"{took:.2f}s"


@pytest.mark.parametrize("key", ["ssh: {port: 1:10}", "ssh: {connect_timeout: 1:30.5}", "job: {entrypoint: [x], restarts: 0x1}",
                                 "hosts: [{address: h1, slots: 010}]", "hosts: [{address: h1, gpus: [0b1]}]",
                                 "job: {entrypoint: [x], pservers: {per_host: 1_0}}", "provision: {timeout: 1_800}"])
def test_numbers_yaml11_alone_reads_otherwise_are_one_line_at_their_key(tmp_path, capsys, key):
    """`ssh.port: 1:10` was port 70; now one line at the key (exit 2) naming what YAML 1.1 made of it."""
    head = {"ssh": "name: c\nhosts: [{address: h1}]\njob: {entrypoint: [x]}\n", "job": "name: c\nhosts: [{address: h1}]\n",
            "hosts": "name: c\njob: {entrypoint: [x]}\n", "provision": VALID}[key.split(":")[0]]
    path = tmp_path / "n.yaml"
    path.write_text(head + key + "\n")
    rc, out, err, _ = _validate(path, capsys)
    assert (rc, out, len(err.splitlines())) == (2, "", 1), err
    assert re.fullmatch(re.escape(str(path)) + r":\d+:\d+: [a-z_.\[\]0-9]+: '[^']+' reads as [-0-9.]+ in YAML 1\.1 \(.*\): "
                        r"write a number in plain decimal digits, or quote it if it is text\n", err), err
