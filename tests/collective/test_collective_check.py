"""The opt-in argument check (``init(check=True)`` / CLUSTERCTL_COLLECTIVE_CHECK=1), docs/collective.md.

* the message every rank raises, built from the ranks' signatures: pure, no MPI;
* the whole of mpi_cases.py under ``mpiexec -n 2`` with the check on: every matching call of that suite passes
  (the mismatch cases, ``test_argument_check_*`` there, run in every layout of test_mpi.py);
* a garbage CLUSTERCTL_COLLECTIVE_CHECK is refused at init().
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from clusterctl.collective.check import disagreement, encode, fingerprint, signature

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent


def sig(collective="allreduce", tensors=(("cpu", "float32", "(1000,)"),), refused=None, names=None, params=None):
    """A rank's signature; ``params`` default: op='sum'."""
    s = signature(collective, [list(t) for t in tensors], names=names, **({"op": "sum"} if params is None else params))
    s["refused"] = refused
    return s


# -- the message (pure) --------------------------------------------------------------------------------------------

def test_message_names_each_rank_and_what_it_passed():
    assert disagreement([sig(), sig(tensors=[("cpu", "float32", "(999,)")])]) == \
        "allreduce: ranks disagree: rank 0 float32 (1000,), rank 1 float32 (999,)"


def test_ranks_that_pass_the_same_are_one_group_in_rank_order():
    a, b = sig(), sig(tensors=[("cpu", "float64", "(1000,)")])
    assert disagreement([a, a, a, b, a, b, a]) == \
        "allreduce: ranks disagree: ranks 0-2,4,6 float32 (1000,), ranks 3,5 float64 (1000,)"


def test_only_what_differs_is_shown():
    assert disagreement([sig(params={"op": "sum", "compression": None}),
                         sig(params={"op": "avg", "compression": None})]) == \
        "allreduce: ranks disagree: rank 0 op='sum', rank 1 op='avg'"
    # the device kind only when it differs (a CUDA tensor against a host array)
    assert disagreement([sig(), sig(tensors=[("cuda", "float32", "(1000,)")])]) == \
        "allreduce: ranks disagree: rank 0 cpu float32 (1000,), rank 1 cuda float32 (1000,)"
    assert disagreement([sig(params={"op": "sum", "threshold": 64}), sig(params={"op": "avg", "threshold": 32})]) == \
        "allreduce: ranks disagree: rank 0 op='sum' threshold=64, rank 1 op='avg' threshold=32"


def test_grouped_calls_name_the_count_or_the_first_tensor_that_differs():
    three = [("cpu", "float32", "(10,)")] * 3
    assert disagreement([sig("grouped_allreduce", three), sig("grouped_allreduce", three[:2])]) == \
        "grouped_allreduce: ranks disagree: rank 0 3 tensors, rank 1 2 tensors"
    other = [three[0], ("cpu", "int32", "(10,)"), ("cpu", "int32", "(10,)")]
    assert disagreement([sig("grouped_allreduce", three), sig("grouped_allreduce", other)]) == \
        "grouped_allreduce: ranks disagree on tensor 1 (and 1 more): rank 0 float32 (10,), rank 1 int32 (10,)"
    names = ["w", "b", "c"]
    assert disagreement([sig("GradientBuffer", three, names=names),
                         sig("GradientBuffer", [three[0], three[1], ("cpu", "float32", "(2, 5)")], names=names)]) == \
        "GradientBuffer: ranks disagree on tensor 2 (c): rank 0 float32 (10,), rank 1 float32 (2, 5)"


def test_a_rank_that_refused_its_input_says_why():
    assert disagreement([sig(), sig(tensors=[("cpu", "bool", "(1000,)")], refused="cannot allreduce dtype bool")]) == \
        "allreduce: ranks disagree: rank 0 float32 (1000,), rank 1 bool (1000,) (refused: cannot allreduce dtype bool)"
    ro = "x (reduced in place) is a read-only array (flags.writeable is False): cannot write the result into it"
    assert disagreement([sig(), sig(refused=ro)]) == \
        f"allreduce: ranks disagree: rank 0 (accepted its input), rank 1 (refused: {ro})"


def test_ranks_in_different_collectives_are_described_in_full():
    assert disagreement([sig("barrier", [], params={}), sig(), sig("broadcast_object", [], params={"root": 1})]) == \
        ("ranks disagree on the collective: rank 0 barrier, rank 1 allreduce op='sum' float32 (1000,), "
         "rank 2 broadcast_object root=1")


def test_many_different_ranks_keep_the_message_to_eight_groups():
    msg = disagreement([sig(tensors=[("cpu", "float32", f"({n},)")]) for n in range(1, 13)])
    assert msg.startswith("allreduce: ranks disagree: rank 0 float32 (1,), rank 1 float32 (2,), ")
    assert msg.endswith("rank 7 float32 (8,), and 4 more groups") and "\n" not in msg


def test_ranks_whose_signature_was_not_exchanged_are_counted():
    # beyond the first 8 groups only the fingerprints travel: those ranks are None, their groups counted
    a, b = sig(), sig(tensors=[("cpu", "float32", "(999,)")])
    assert disagreement([a, b, None, a, None], hidden=1) == \
        "allreduce: ranks disagree: ranks 0,3 float32 (1000,), rank 1 float32 (999,), and 1 more group"
    assert disagreement([a, None, None], hidden=2) == \
        "allreduce: ranks disagree: rank 0 allreduce op='sum' float32 (1000,), and 2 more groups"


def test_fingerprint_compares_meaning_not_spelling():
    a = np.ones((3, 4), np.float32)
    fp = fingerprint(encode(signature("grouped_allreduce", [a], op="sum", threshold=64000000, root=1)))
    assert fp == fingerprint(encode(signature("grouped_allreduce", [a], op="sum", threshold=64e6, root=np.int64(1))))
    torch = pytest.importorskip("torch")
    assert fp == fingerprint(encode(signature("grouped_allreduce", [torch.ones(3, 4)], op="sum", threshold=64e6,
                                              root=1)))                   # a CPU tensor is a host float32 (3, 4)
    assert fp != fingerprint(encode(signature("grouped_allreduce", [a.T], op="sum", threshold=64e6, root=1)))
    assert fp != fingerprint(encode(signature("grouped_allreduce", [a], op="sum", threshold=64e6, root=0)))
    # names label the message only: differently named parameters of the same layout agree
    assert fingerprint(encode(signature("GradientBuffer", [a], names=["w"]))) == \
        fingerprint(encode(signature("GradientBuffer", [a], names=["weight"])))


# -- under mpiexec ---------------------------------------------------------------------------------------------------

def _mpiexec(n: int, args: list[str], env_extra: dict, timeout: float):
    from helpers import MPIEXEC
    if MPIEXEC is None:
        pytest.skip("no mpiexec found")
    pytest.importorskip("mpi4py")
    env = {k: v for k, v in os.environ.items() if not k.startswith("CLUSTERCTL_COLLECTIVE_")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.update(UCX_LOG_LEVEL="error", **env_extra)
    cmd = [MPIEXEC, "-n", str(n), sys.executable, *args]
    start = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    return proc, proc.stdout + proc.stderr, f"{' '.join(cmd)} ({proc.returncode}) after {time.monotonic() - start:.1f}s"


@pytest.mark.timeout(150)
def test_every_matching_call_of_mpi_cases_passes_with_the_check_on():
    # The deadline is short: a check that left a rank waiting would fail the run instead of hanging it for 300 s.
    proc, out, what = _mpiexec(2, ["-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-o", "addopts=",
                                   str(HERE / "mpi_cases.py")],
                               {"CLUSTERCTL_COLLECTIVE_CHECK": "1", "CLUSTERCTL_COLLECTIVE_TIMEOUT": "20"}, 140)
    assert proc.returncode == 0, f"{what}:\n{out[-6000:]}"
    assert out.count(" passed") >= 2 and " failed" not in out, out[-3000:]


@pytest.mark.timeout(60)
def test_a_garbage_check_setting_is_refused_at_init():
    proc, out, what = _mpiexec(1, ["-c", "import clusterctl.collective as cc; cc.init()"],
                               {"CLUSTERCTL_COLLECTIVE_CHECK": "maybe"}, 50)
    assert proc.returncode != 0, what
    assert "CollectiveError: CLUSTERCTL_COLLECTIVE_CHECK='maybe': expected 0 or 1" in out, f"{what}:\n{out[-3000:]}"
