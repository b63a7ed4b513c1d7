"""Misuse of the collective API: bad input must give one clear CollectiveError on every rank alike, never a deep
mpi4py/NumPy/torch traceback, a hang, or a silently wrong result.

Two kinds of tests live here:

* ``test_*``: plain pytest (env knob parsing, no MPI), plus launchers that run this same file under
  ``mpiexec -n 1`` and ``-n 2`` (as test_mpi.py does with mpi_cases.py);
* ``case_*``: the per-rank assertions, collected only by those launches (``-o python_functions=case_*``),
  where every rank runs every case.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import clusterctl.collective as cc
from clusterctl.collective import _mpi
from clusterctl.collective.errors import CollectiveError

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
UNDER_MPI = os.environ.get("CLUSTERCTL_TEST_MISUSE_RANKS") == "1"

torch = pytest.importorskip("torch")


# -- plain pytest: environment knobs (no MPI) -----------------------------------------------------------

@pytest.mark.parametrize("raw", ["nan", "inf", "-inf", "NaN"])
def test_timeout_env_that_never_expires_is_refused(monkeypatch, raw):
    monkeypatch.setenv(_mpi.TIMEOUT_ENV, raw)
    with pytest.raises(CollectiveError, match=rf"^CLUSTERCTL_COLLECTIVE_TIMEOUT='{raw}': must be a positive, "
                                              r"finite number of seconds$"):
        _mpi._env_float(_mpi.TIMEOUT_ENV, 300.0)


@pytest.mark.parametrize("raw", ["infG", "1e400", "-infk"])
def test_fusion_threshold_env_overflow_is_a_collective_error(monkeypatch, raw):
    monkeypatch.setenv(_mpi.FUSION_ENV, raw)
    with pytest.raises(CollectiveError, match=rf"^CLUSTERCTL_COLLECTIVE_FUSION_THRESHOLD='{raw}': expected bytes"):
        _mpi._env_size(_mpi.FUSION_ENV, 1)


@pytest.mark.parametrize(("raw", "want"), [("Abort", "abort"), (" RAISE ", "raise"), ("raise", "raise"), ("", "abort")])
def test_on_timeout_env_takes_any_case(monkeypatch, raw, want):
    monkeypatch.setenv(_mpi.ON_TIMEOUT_ENV, raw)
    assert _mpi._settings(None, None, None, None, None)[1] == want
    assert _mpi._settings(None, "abort", None, None, None)[1] == "abort"  # the argument wins


def test_on_timeout_env_garbage_is_refused_by_the_variables_name(monkeypatch):
    """It said on_timeout='later', a keyword argument the user never wrote."""
    monkeypatch.setenv(_mpi.ON_TIMEOUT_ENV, "later")
    with pytest.raises(CollectiveError) as err:
        _mpi._settings(None, None, None, None, None)
    assert str(err.value) == "CLUSTERCTL_COLLECTIVE_ON_TIMEOUT='later': expected 'abort' or 'raise' (any case)"


def test_a_world_size_no_world_can_have_is_refused_before_any_server_starts(monkeypatch):
    # WORLD_SIZE=100000000: rank 0 started a PMI server that outlived it and then wrote a 988 MB line of the
    # ranks that never connected
    from clusterctl.collective import rendezvous

    for name, value in {"WORLD_SIZE": str(10**8), "RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(rendezvous, "_mpi_already_initialized", lambda: False)
    monkeypatch.setattr(rendezvous, "under_mpi_launcher", lambda: False)
    with pytest.raises(CollectiveError, match=r"^WORLD_SIZE=100000000 is more ranks than a world of clusterctl's "
                                              r"can hold \(at most 1,048,576\)$"):
        rendezvous.prepare_environment(timeout=1.0)
    assert rendezvous._server is None


def test_the_ranks_that_never_connected_are_listed_up_to_a_point():
    from clusterctl.collective.pmi import PMIServer

    assert PMIServer._missing(None, {0: 1, 3: 1}, 10**6) == ("1, 2, " + ", ".join(map(str, range(4, 18)))
                                                            + ", ... (999,998 in all)")
    assert PMIServer._missing(None, {0: 1}, 3) == "1, 2"


@pytest.mark.parametrize("raw", ["true", "2", "auto"])
def test_cuda_aware_env_garbage_is_refused(monkeypatch, raw):
    from clusterctl.collective import cuda

    class NoDetection:           # detection must not even be tried with a garbage override
        @property
        def comm(self):
            raise AssertionError("detection ran")
    monkeypatch.setenv(cuda.CUDA_AWARE_ENV, raw)
    with pytest.raises(CollectiveError, match=rf"^CLUSTERCTL_COLLECTIVE_CUDA_AWARE='{raw}': expected 0 or 1"):
        cuda.cuda_aware(NoDetection())


# -- launchers: this file's case_* under mpiexec ----------------------------------------------------------

def _launch(n: int, timeout_s: int, *extra_args: str, env_extra: dict | None = None):
    from helpers import MPIEXEC
    if MPIEXEC is None:
        pytest.skip("no mpiexec found")
    pytest.importorskip("mpi4py")
    env = {k: v for k, v in os.environ.items() if not k.startswith("CLUSTERCTL_COLLECTIVE_")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.update(UCX_LOG_LEVEL="error", CLUSTERCTL_TEST_MISUSE_RANKS="1",
               CLUSTERCTL_COLLECTIVE_TIMEOUT=str(timeout_s), **(env_extra or {}))
    cmd = [MPIEXEC, "-n", str(n), sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
           "-o", "python_functions=case_*", "-o", "addopts=", str(Path(__file__)), *extra_args]
    start = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=100)
    out = proc.stdout + proc.stderr
    took = time.monotonic() - start
    assert proc.returncode == 0, f"{' '.join(cmd)} failed ({proc.returncode}) after {took:.1f}s:\n{out[-6000:]}"
    assert out.count(" passed") >= n and " failed" not in out and " error" not in out, out[-3000:]
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("n", [1, 2])
def test_misuse_cases_under_mpiexec(n):
    # A case that hangs (the bugs this file pins) ends at the 10 s deadline and fails, instead of waiting 300 s.
    _launch(n, 10)


# -- per-rank cases (collected only under mpiexec) ---------------------------------------------------------

if UNDER_MPI:
    C = cc.init()
    RANK, SIZE = C.rank, C.size


def _one_line(excinfo) -> str:
    msg = str(excinfo.value)
    assert "\n" not in msg, msg
    return msg


@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "float8_e5m2", "complex32", "complex64", "bool"])
def case_torch_dtype_without_reduction_is_refused(dtype):
    x = torch.zeros(4, dtype=getattr(torch, dtype))
    with pytest.raises(CollectiveError, match=rf"^cannot allreduce dtype torch.{dtype}$"):
        cc.allreduce(x)
    with pytest.raises(CollectiveError, match=rf"^cannot allreduce dtype torch.{dtype}$"):
        cc.grouped_allreduce([torch.ones(3), x])


def case_torch_layouts_and_devices_without_flat_memory_are_refused():
    sparse = torch.ones(3).to_sparse()
    quant = torch.quantize_per_tensor(torch.ones(3), 0.1, 0, torch.quint8)
    nested = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])
    for x, want in [(sparse, "x is a torch.sparse_coo tensor"), (quant, "x is a quantized tensor"),
                    (nested, "x is a nested tensor")]:
        for call in (lambda: cc.allreduce(x), lambda: cc.grouped_allreduce([x]), lambda: cc.broadcast(x)):
            with pytest.raises(CollectiveError, match=rf"^{want}: only dense \(strided\) tensors are supported$"):
                call()
    with pytest.raises(CollectiveError, match=r"^x is on device meta: expected a CPU or CUDA tensor$"):
        cc.allreduce(torch.ones(3, device="meta"))
    with pytest.raises(CollectiveError, match=r"^out is a torch.sparse_coo tensor"):
        cc.allreduce(torch.ones(3), out=sparse)


def case_read_only_arrays_are_refused_before_any_mpi_call():
    ro = np.ones(3)
    ro.flags.writeable = False
    with pytest.raises(CollectiveError, match=r"^x \(reduced in place\) is a read-only array"):
        cc.allreduce(ro, out=ro)
    with pytest.raises(CollectiveError, match=r"^out is a read-only array"):
        cc.allreduce(np.ones(3), out=np.frombuffer(bytes(24)))
    other = np.full(2, float(RANK + 1))
    with pytest.raises(CollectiveError, match=r"^x is a read-only array"):
        cc.grouped_allreduce([other, ro], inplace=True)
    assert np.all(other == RANK + 1)
    # broadcast: only the receivers write, but every rank (the root too) refuses, so no rank runs ahead
    with pytest.raises(CollectiveError, match=r"^x is a read-only array"):
        cc.broadcast(ro, 0)
    y = np.full(4, float(RANK))
    assert cc.broadcast(y, SIZE - 1) is y and np.all(y == SIZE - 1)        # still in step afterwards


def case_non_native_byte_order_is_refused():
    be = np.arange(6, dtype=">f4")
    with pytest.raises(CollectiveError, match=r"^cannot allreduce dtype >f4 \(non-native byte order\): "
                                              r"convert it first, e.g. x.astype\('<f4'\)$"):
        cc.allreduce(be)
    with pytest.raises(CollectiveError, match=r"^cannot allreduce dtype >i4 \(non-native byte order\)"):
        cc.grouped_allreduce([np.ones(3, np.float32), np.ones(2, ">i4")])
    # broadcast moves bytes: any fixed-size dtype goes through
    x = np.arange(5, dtype=">f8") * (RANK + 1)
    cc.broadcast(x, 0)
    np.testing.assert_array_equal(x, np.arange(5, dtype=">f8"))


def case_broadcast_of_object_arrays_and_odd_dtypes():
    with pytest.raises(CollectiveError, match=r"^cannot broadcast dtype object: it holds Python object pointers$"):
        cc.broadcast(np.array([RANK, "a"], dtype=object))
    flags = np.array([RANK == 0, True, RANK == 1])
    cc.broadcast(flags, 0)
    np.testing.assert_array_equal(flags, [True, True, False])
    t = torch.tensor([RANK == 0, False])
    cc.broadcast(t, 0)
    assert t.tolist() == [True, False]


@pytest.mark.parametrize("root,want", [("0", r"root='0': expected an int rank"), (0.0, r"root=0.0: expected an int"),
                                       (None, r"root=None: expected an int rank"), (-1, r"root=-1 out of range"),
                                       ("size", r"root=\d+ out of range for \d+ rank\(s\)")])
def case_bad_root(root, want):
    root = SIZE if root == "size" else root
    with pytest.raises(CollectiveError, match=rf"^{want}"):
        cc.broadcast(np.ones(3), root)
    with pytest.raises(CollectiveError, match=rf"^{want}"):
        cc.broadcast_object({"a": 1}, root)
    assert cc.broadcast_object({"r": RANK}, np.int64(SIZE - 1)) == {"r": SIZE - 1}


def case_unpicklable_object_fails_on_every_rank_instead_of_hanging():
    obj = (lambda: RANK) if RANK == 0 else None
    with pytest.raises(CollectiveError, match=r"^broadcast_object: rank 0 could not pickle its object") as e:
        cc.broadcast_object(obj, 0)
    _one_line(e)
    assert cc.broadcast_object(RANK + 10, 0) == 10                           # still in step


@pytest.mark.parametrize("threshold,want", [(-5, "must not be negative"), ("8M", "expected a whole number"),
                                            (1.5, "expected a whole number"), (math.inf, "expected a whole number"),
                                            (True, "expected a whole number")])
def case_bad_fusion_thresholds(threshold, want):
    with pytest.raises(CollectiveError, match=rf"^threshold={threshold!r}: {want}"):
        cc.grouped_allreduce([np.ones(3), np.ones(4)], threshold=threshold)
    m = torch.nn.Linear(3, 2)
    with pytest.raises(CollectiveError, match=rf"^fusion_threshold={threshold!r}: {want}"):
        from clusterctl.collective.torch import DistributedOptimizer
        DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), m.named_parameters(),
                             fusion_threshold=threshold)
    with pytest.raises(CollectiveError, match=rf"^fusion_threshold={threshold!r}: {want}"):
        cc.init(fusion_threshold=threshold)


def case_a_whole_float_threshold_is_that_many_bytes():
    xs = [np.ones(3), np.ones(4)]
    assert [x.tolist() for x in cc.grouped_allreduce(xs, threshold=64e3)] == [[SIZE] * 3, [SIZE] * 4]
    m = torch.nn.Linear(3, 2)
    from clusterctl.collective.torch import DistributedOptimizer
    DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), m.named_parameters(), fusion_threshold=8e6)


@pytest.mark.parametrize("timeout,want", [(float("nan"), "must be positive, finite seconds"),
                                          (math.inf, "must be positive, finite seconds"),
                                          (-1, "must be positive, finite seconds"),
                                          ("soon", "expected a number of seconds")])
def case_init_checks_its_arguments_even_when_already_initialised(timeout, want):
    with pytest.raises(CollectiveError, match=rf"^timeout={timeout!r}: {want}$"):
        cc.init(timeout=timeout)


def case_ranks_asking_for_different_window_sizes_fail_alike_instead_of_hanging():
    if C.arena is None:
        pytest.skip("no shared-memory window (one rank per node)")
    with pytest.raises(CollectiveError, match=r"^shared-memory window: the ranks of this node asked for different "
                                              r"sizes \(bytes by local rank: \[1048576, 2097152\]\)") as e:
        cc.init(comm=C.comm, fusion_threshold=(1 << 20) * (RANK + 1))
    _one_line(e)
    cc.barrier()


def case_grouped_refuses_before_reducing_anything():
    """A buffer that cannot be reduced fails the call before any bucket is reduced in place."""
    a = np.full(3, float(RANK + 1))
    with pytest.raises(CollectiveError, match=r"^cannot allreduce dtype bool$"):
        cc.grouped_allreduce([a, np.ones(2, dtype=bool)], inplace=True)
    cc.barrier()
    assert np.all(a == RANK + 1), a


def case_zero_size_and_0d_buffers():
    assert cc.allreduce(np.array(float(RANK), np.float32)) == sum(range(SIZE))
    assert cc.allreduce(torch.tensor(float(RANK)), "avg").item() == pytest.approx((SIZE - 1) / 2)
    assert cc.allreduce(torch.ones(0, 3)).shape == (0, 3)
    out = cc.grouped_allreduce([np.ones(0), torch.ones(()), np.ones((2, 0))])
    assert out[0].shape == (0,) and out[1].item() == SIZE and out[2].shape == (2, 0)


# -- the torch optimizer wrapper -----------------------------------------------------------------------------

def _dopt(model, **kw):
    from clusterctl.collective.torch import DistributedOptimizer
    return DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), **kw)


def case_named_parameters_must_be_pairs():
    m = torch.nn.Linear(3, 2)
    with pytest.raises(CollectiveError, match=r"^named_parameters must be \(name, tensor\) pairs, "
                                              r"e.g. model.named_parameters\(\)$"):
        _dopt(m, named_parameters=m.parameters())


def case_optimizer_parameters_missing_from_named_parameters():
    m = torch.nn.Linear(3, 2)
    with pytest.raises(CollectiveError, match=r"^1 parameter\(s\) of the optimizer are not in named_parameters"):
        _dopt(m, named_parameters=[("weight", m.weight)])


def case_parameters_of_a_dtype_without_reduction_are_refused_at_construction():
    m = torch.nn.Linear(2, 2).to(torch.complex64)
    with pytest.raises(CollectiveError, match=r"^cannot allreduce gradients of dtype torch.complex64$"):
        _dopt(m, named_parameters=m.named_parameters())


def case_duplicate_parameter_is_one_gradient():
    torch.manual_seed(0)
    m = torch.nn.Linear(4, 2)
    opt = _dopt(m, named_parameters=[("w", m.weight), ("b", m.bias), ("tied", m.weight)])
    assert sum(len(b.params) for b in opt._buckets) == 2
    for _ in range(2):
        opt.zero_grad()
        m(torch.full((3, 4), float(RANK + 1))).sum().backward()
        opt.step()
        assert torch.allclose(m.bias.grad, torch.full((2,), 3.0))
        assert torch.allclose(m.weight.grad, torch.full((2, 4), 3.0 * (SIZE + 1) / 2))
    opt.remove_hooks()


def case_parameters_added_after_wrapping_are_refused():
    m, extra = torch.nn.Linear(3, 2), torch.nn.Linear(2, 1)
    opt = _dopt(m, named_parameters=m.named_parameters())
    opt.optimizer.add_param_group({"params": list(extra.parameters())})
    opt.zero_grad()
    extra(m(torch.ones(1, 3))).sum().backward()
    with pytest.raises(CollectiveError, match=r"^2 parameter\(s\) with a gradient were added to the optimizer"):
        opt.step()
    opt.remove_hooks()


@pytest.mark.parametrize("what", ["count", "shape", "threshold"])
def case_different_parameters_per_rank_are_detected_at_construction(what):
    if SIZE == 1:
        pytest.skip("needs two ranks")
    m = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    kw = {}
    if RANK == 1 and what == "count":
        m.append(torch.nn.Linear(2, 2))
    if RANK == 1 and what == "shape":
        m[1].weight = torch.nn.Parameter(torch.zeros(3, 2))      # same element count, another shape
    if what == "threshold":
        kw["fusion_threshold"] = 16 if RANK == 1 else 1 << 20
    head = r"^DistributedOptimizer: the ranks' parameters differ \("
    if RANK == 0:
        want = head + r"1 rank\(s\) differ from rank 0; shapes, dtypes, order, op, compression and fusion_threshold"
    elif what == "count":
        want = head + r"rank 1 has 6 parameter tensor\(s\) \(29 elements\), rank 0 has 4 \(23 elements\);"
    else:
        want = head + r"rank 1 has 4 parameter tensor\(s\) \(23 elements\), rank 0 has 4 \(23 elements\);"
    with pytest.raises(CollectiveError, match=want) as e:
        _dopt(m, named_parameters=m.named_parameters(), **kw)
    _one_line(e)
    cc.barrier()                                # every rank raised at the same point: still in step


# -- init and finalize ----------------------------------------------------------------------------------------

def case_second_init_with_other_settings_is_refused():
    now = dict(timeout=C.timeout, on_timeout=C.on_timeout, fusion_threshold=C.fusion_threshold, shm=True)
    assert cc.init(**{**now, "fusion_threshold": float(C.fusion_threshold)}) is C     # the same settings: a no-op
    assert cc.init() is C                                                 # none given: a no-op
    for name, other in [("fusion_threshold", C.fusion_threshold + 64), ("timeout", C.timeout + 1),
                        ("on_timeout", "raise" if C.on_timeout == "abort" else "abort"), ("shm", False)]:
        with pytest.raises(CollectiveError, match=rf"^init\({name}={other!r}\): already initialised with "
                                                  rf"{name}={now[name]!r}; call finalize\(\) first") as e:
            cc.init(**{**now, name: other})
        _one_line(e)
    with pytest.raises(CollectiveError, match=r"^on_timeout='later': expected 'abort' or 'raise'$"):
        cc.init(on_timeout="later")
    assert cc.allreduce(np.ones(2)).tolist() == [SIZE, SIZE]                 # still in step


@pytest.mark.parametrize("threshold", ["free", 1e15])
def case_a_shared_window_larger_than_dev_shm_is_refused_alike(threshold):
    if C.arena is None:
        pytest.skip("no shared-memory window (one rank per node)")
    if threshold == "free":                     # MPICH maps it (sparse); the first allreduce that fills it: SIGBUS
        st = os.statvfs("/dev/shm")
        threshold = st.f_bavail * st.f_frsize
    with pytest.raises(CollectiveError, match=rf"^shared-memory window: {C.topo.local_size} local ranks x "
                                              r"\d+ bytes do not fit in /dev/shm \(\d+ bytes free\)") as e:
        cc.init(comm=C.comm, fusion_threshold=threshold)
    _one_line(e)
    c = cc.init(comm=C.comm, fusion_threshold=1 << 20)                      # a reasonable size still works
    assert c.uses_shm and cc.allreduce(np.ones(3), comm=c).tolist() == [SIZE] * 3


def case_collectives_after_finalize_raise_until_init_is_called_again(monkeypatch):
    """Runs last: it finalizes the module's communicator (and makes a new one)."""
    global C
    MPI, old = C.MPI, C
    cc.finalize()

    def no_mpi(*a, **k):
        raise AssertionError("an MPI call after finalize()")
    monkeypatch.setattr(_mpi, "get_mpi", no_mpi)             # init() and Communicator() start with it
    from clusterctl.collective.torch import DistributedOptimizer
    m = torch.nn.Linear(2, 1)
    for call in (lambda: cc.allreduce(np.ones(2)), lambda: cc.allreduce_async(np.ones(2)),
                 lambda: cc.grouped_allreduce([np.ones(2)]), lambda: cc.broadcast(np.ones(2)),
                 lambda: cc.broadcast_object(1), cc.barrier, cc.rank, cc.topology,
                 lambda: cc.allreduce(np.ones(2), comm=MPI.COMM_WORLD),
                 lambda: DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), m.named_parameters())):
        with pytest.raises(CollectiveError, match=r"^the collective backend was finalized: call init\(\) again "
                                                  r"first if a new communicator is intended$"):
            call()
    with pytest.raises(CollectiveError, match=r"^communicator already finalized$"):
        cc.allreduce(np.ones(2), comm=old)
    assert not cc.is_initialized()
    monkeypatch.undo()
    C = cc.init()                               # an explicit init() after finalize() starts afresh
    assert C is not old and cc.is_initialized()
    assert cc.allreduce(np.ones(2)).tolist() == [SIZE, SIZE]
