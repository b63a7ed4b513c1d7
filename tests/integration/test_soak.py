"""The fault soak's short version (benchmarks/soak.py has the long one): a few cycles of start -> fault ->
decision -> stop on the session cluster, with nothing left behind."""

from __future__ import annotations

import random
import sys

import pytest
from clusterlib import ROOT

pytestmark = pytest.mark.integration

sys.path.insert(0, str(ROOT / "benchmarks"))
import soak  # noqa: E402


@pytest.mark.slow  # each fault has its own default-tier test; benchmarks/soak.py runs them in cycles
@pytest.mark.timeout(150)
def test_short_fault_soak_leaves_nothing_behind(testcluster, tmp_path):
    s = soak.make_soak(testcluster, tmp_path, job="it-soak", base_port=7700)
    rows = [soak.cycle(s, kind, random.Random(7)) for kind in ("kill9_trainer", "kill9_supervisor")]
    for row in rows:
        assert row["decision_s"] is not None and row["decision_s"] < 15, rows
        assert (row["orphans"], row["leaked_ports"], row["lost_lines"], row["stuck"]) == (0, 0, 0, 0), rows
    assert rows[0]["restarts"] == 1, rows  # a killed trainer: the whole job started again
