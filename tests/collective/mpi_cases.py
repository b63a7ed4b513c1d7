"""Collective assertions run under ``mpiexec -n N python -m pytest tests/collective/mpi_cases.py``.

Every rank runs every test (mpi4py's own style); the expected values are computed locally with NumPy.
test_mpi.py launches this file for N = 1..4 and for the shm / non-shm / fake-multi-node layouts.
"""

import os

import numpy as np
import pytest

import clusterctl.collective as cc

C = cc.init(timeout=float(os.environ.get("CLUSTERCTL_COLLECTIVE_TIMEOUT", "30")))
RANK, SIZE = C.rank, C.size

DTYPES = ["float32", "float64", "float16", "int32"]
SHAPES = [(0,), (1,), (7,), (3, 5), (1001,), (2, 3, 4), (300_007,)]


def data(shape, dtype, rank):
    """Small exact-ish values per rank: ((i % 13) - 6 + rank)."""
    n = int(np.prod(shape))
    return ((np.arange(n) % 13) - 6 + rank).reshape(shape).astype(dtype)


def expected(shape, dtype, op):
    stack = np.stack([data(shape, dtype, r).astype(np.float64) for r in range(SIZE)])
    return stack.sum(axis=0) if op == "sum" else stack.mean(axis=0)


def close(got, want, dtype):
    tol = {"float16": 1e-2, "float32": 1e-6, "float64": 1e-12}.get(str(dtype), 0)
    np.testing.assert_allclose(np.asarray(got, dtype=np.float64), want, rtol=tol, atol=tol)


def test_layout_matches_env():
    fake = os.environ.get("CLUSTERCTL_COLLECTIVE_FAKE_NODES")
    topo = cc.topology()
    assert (topo.rank, topo.size) == (RANK, SIZE)
    if fake:
        assert topo.node_count == min(int(fake), SIZE)
    else:
        assert topo.node_count == 1 and topo.local_size == SIZE
    want_shm = os.environ.get("CLUSTERCTL_COLLECTIVE_SHM", "1") != "0" and topo.local_size > 1 \
        and topo.homogeneous
    assert C.uses_shm == want_shm


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_allreduce_sum_out_of_place(shape, dtype):
    x = data(shape, dtype, RANK)
    before = x.copy()
    y = cc.allreduce(x)
    assert y.shape == x.shape and y.dtype == x.dtype
    close(y, expected(shape, dtype, "sum"), dtype)
    np.testing.assert_array_equal(x, before)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_allreduce_avg(shape, dtype):
    y = cc.allreduce(data(shape, dtype, RANK), "avg")
    close(y, expected(shape, dtype, "avg"), dtype if dtype != "int32" else "float64")


@pytest.mark.parametrize("dtype", ["float32", "float64", "int32"])
def test_allreduce_in_place_and_non_contiguous(dtype):
    x = data((40, 31), dtype, RANK)
    assert cc.allreduce(x, out=x) is x
    close(x, expected((40, 31), dtype, "sum"), dtype)
    base = data((40, 62), dtype, RANK)
    view = base[:, ::2]
    cc.allreduce(view, out=view)
    close(view, expected((40, 62), dtype, "sum")[:, ::2], dtype)
    close(base[:, 1::2], data((40, 62), dtype, RANK)[:, 1::2], dtype)


def test_allreduce_larger_than_window_is_chunked():
    n = C.fusion_threshold // 4 + 12_345
    x = np.full(n, RANK + 1, dtype=np.float32)
    cc.allreduce(x, out=x)
    assert np.all(x == SIZE * (SIZE + 1) / 2)


def test_results_identical_on_every_rank():
    rng = np.random.default_rng(RANK)
    y = cc.allreduce(rng.standard_normal(100_003).astype(np.float32))
    ys = C.comm.allgather(y.tobytes())
    assert all(b == ys[0] for b in ys)


@pytest.mark.parametrize("threshold", [1, 4096, 1 << 20, None])
@pytest.mark.parametrize("inplace", [False, True])
def test_grouped_many_buckets(threshold, inplace):
    shapes = [(3,), (256,), (0,), (17, 5), (70_000,), (1,)] * 20
    dtypes = ["float32", "float64", "int32"]
    xs = [data(s, dtypes[i % 3], RANK) for i, s in enumerate(shapes)]
    out = cc.grouped_allreduce(xs, inplace=inplace, threshold=threshold)
    if inplace:
        assert all(a is b for a, b in zip(out, xs))
    for i, (s, y) in enumerate(zip(shapes, out)):
        assert y.shape == s
        close(y, expected(s, dtypes[i % 3], "sum"), dtypes[i % 3])


def test_async_overlaps_and_keeps_order():
    hs = [cc.allreduce_async(np.full(1000, float(RANK + i), np.float64)) for i in range(8)]
    for i, h in enumerate(hs):
        assert np.all(h.wait() == sum(r + i for r in range(SIZE)))


@pytest.mark.parametrize("root", [0, "last"])
def test_broadcast(root):
    root = SIZE - 1 if root == "last" else root
    x = data((5, 7), "float32", RANK)
    assert cc.broadcast(x, root) is x
    np.testing.assert_array_equal(x, data((5, 7), "float32", root))
    assert cc.broadcast_object({"r": RANK}, root) == {"r": root}


def test_bad_input_raises():
    with pytest.raises(cc.CollectiveError, match="op="):
        cc.allreduce(np.ones(3), "max")
    with pytest.raises(cc.CollectiveError, match="unsupported buffer type"):
        cc.allreduce([1, 2, 3])
    with pytest.raises(cc.CollectiveError, match="integer"):
        x = np.ones(3, np.int32)
        cc.allreduce(x, "avg", out=x)
    with pytest.raises(cc.CollectiveError, match="root"):
        cc.broadcast(np.ones(3), SIZE)


def test_gradient_buffer_numpy_training_equivalent():
    from clusterctl.collective.numpy_opt import DistributedOptimizer, GradientBuffer
    buf = GradientBuffer({"w": (4, 3), "b": (3,)})
    assert buf.in_window == C.uses_shm
    buf.grads["w"][...] = RANK
    buf.grads["b"][...] = 2 * RANK
    buf.allreduce()
    assert np.allclose(buf.grads["w"], (SIZE - 1) / 2) and np.allclose(buf.grads["b"], SIZE - 1)
    # plain least squares: data-parallel halves == full batch
    rng = np.random.default_rng(0)
    X, Y = rng.standard_normal((8 * SIZE, 4)), rng.standard_normal(8 * SIZE)
    w_ref, w = np.zeros(4), {"w": np.zeros(4)}

    def sgd(params, grads):
        params["w"] -= 0.1 * grads["w"]
    opt = DistributedOptimizer(sgd, w)
    for _ in range(5):
        w_ref -= 0.1 * (2 * X.T @ (X @ w_ref - Y) / len(Y))
        Xs, Ys = X[RANK * 8:(RANK + 1) * 8], Y[RANK * 8:(RANK + 1) * 8]
        opt.step({"w": 2 * Xs.T @ (Xs @ w["w"] - Ys) / len(Ys)})
    np.testing.assert_allclose(w["w"], w_ref, rtol=1e-10)


def test_gradient_buffer_survives_other_collectives_and_repeats():
    """Gradients resident in their own window are not clobbered by unrelated window allreduces."""
    from clusterctl.collective.numpy_opt import GradientBuffer
    buf = GradientBuffer({"a": (1000,), "b": (7, 3)}, op="sum")
    for step in range(3):
        buf.zero()
        buf.grads["a"][...] = RANK + step
        buf.grads["b"][...] = 1
        other = cc.allreduce(np.full(50_000, 2.0, np.float32))        # uses the scratch window
        assert np.all(other == 2.0 * SIZE)
        buf.allreduce()
        assert np.all(buf.grads["a"] == sum(r + step for r in range(SIZE)))
        assert np.all(buf.grads["b"] == SIZE)


def test_grouped_allreduce_reuses_plan_for_same_buffers():
    xs = [np.full(n, RANK + 1.0, np.float32) for n in (3, 300, 30_000)]
    for _ in range(3):
        for x in xs:
            x[...] = RANK + 1.0
        cc.grouped_allreduce(xs, inplace=True)
        for x in xs:
            assert np.all(x == SIZE * (SIZE + 1) / 2)


# -- the argument check (init(check=True) / CLUSTERCTL_COLLECTIVE_CHECK=1) -----------------------------------------

_CHECKED: dict = {}


def checked(on: bool = True):
    """A communicator over these processes with the argument check on (or off); made once (collective)."""
    if on not in _CHECKED:
        _CHECKED[on] = cc.init(comm=C.comm, check=on)
    return _CHECKED[on]


OTHERS = "rank 1" if SIZE == 2 else f"ranks 1-{SIZE - 1}"        # every rank but rank 0
FIRST = "rank 0" if SIZE == 2 else f"ranks 0-{SIZE - 2}"         # every rank but the last


def in_step(c):
    """The ranks are still in step after a refused call: a matching allreduce gives the right answer."""
    assert cc.allreduce(np.full(3, float(RANK)), comm=c).tolist() == [sum(range(SIZE))] * 3


def raises_alike(call, message):
    """``call()`` raises exactly ``message`` (one line) on this rank, as on every other one."""
    with pytest.raises(cc.CollectiveError) as e:
        call()
    assert str(e.value) == message


def test_argument_check_setting():
    want = os.environ.get("CLUSTERCTL_COLLECTIVE_CHECK", "") == "1"
    assert C.check is want and checked().check is True and checked(False).check is False
    assert cc.init(check=want) is C
    with pytest.raises(cc.CollectiveError) as e:
        cc.init(check=not want)
    assert str(e.value) == (f"init(check={not want}): already initialised with check={want}; "
                            "call finalize() first to change it")


def test_init_over_a_communicator_makes_one_per_settings_and_no_more():
    """init(comm=X) again returns the communicator it made (it used to make a new one on every call and leak the
    others: their duplicates of X, a worker thread and maybe a shared window each); other settings, another one."""
    import threading

    def workers():
        return sum(t.name.startswith("clusterctl-collective") for t in threading.enumerate())
    sub = C.comm.Dup()
    try:
        first = cc.init(comm=sub, fusion_threshold=1 << 20)
        for _ in range(20):
            cc.allreduce(np.ones(3), comm=first)
        threads = workers()
        again = [cc.init(comm=sub, fusion_threshold=1 << 20) for _ in range(20)]
        assert all(c is first for c in again) and workers() == threads
        other = cc.init(comm=sub, fusion_threshold=2 << 20)
        assert other is not first and other.fusion_threshold == 2 << 20
        assert cc.init(comm=sub, fusion_threshold=1 << 20) is first
        assert cc.allreduce(np.ones(3), comm=sub).tolist() == [SIZE] * 3        # comm=X: the last one asked for
        if SIZE > 1:         # ranks asking for other settings, some of which they have: new ones, and no hang
            try:
                mixed = cc.init(comm=sub, fusion_threshold=(1 << 20) if RANK == 0 else (2 << 20))
            except cc.CollectiveError as e:                                      # the shared window's sizes differ
                assert "asked for different sizes" in str(e)
            else:
                assert mixed is not first and mixed is not other
                mixed.close()
            old, first = first, cc.init(comm=sub, fusion_threshold=1 << 20)     # one rank had none left: new ones
            assert first is not old and cc.init(comm=sub, fusion_threshold=1 << 20) is first
            assert cc.allreduce(np.ones(3), comm=first).tolist() == [SIZE] * 3
            old.close()
        first.close()                                                            # closed: the next call makes one
        renewed = cc.init(comm=sub, fusion_threshold=1 << 20)
        assert renewed is not first and cc.allreduce(np.ones(3), comm=renewed).tolist() == [SIZE] * 3
        other.close()
        renewed.close()
    finally:
        sub.Free()


def test_argument_check_costs_one_collective_when_on_and_none_when_off(monkeypatch):
    on, off = checked(), checked(False)

    def no_check(sig):
        raise AssertionError(f"argument check with the check off: {sig}")
    monkeypatch.setattr(off, "agree", no_check)
    x = np.ones(300, np.float32)
    calls = {"allreduce": lambda c: cc.allreduce(x, comm=c),
             "allreduce_async": lambda c: cc.allreduce_async(x, "avg", comm=c).wait(),
             "grouped_allreduce": lambda c: cc.grouped_allreduce([x, x], comm=c),
             "broadcast": lambda c: cc.broadcast(x, 0, comm=c),
             "broadcast_object": lambda c: cc.broadcast_object("a", 0, comm=c),
             "barrier": lambda c: cc.barrier(comm=c)}
    for name, call in calls.items():
        collectives = {}                     # the collectives each communicator counted for the same call
        for c in (off, on):
            before = c.progress.seq
            call(c)
            collectives[c.check] = c.progress.seq - before
        # one more with the check on; one rank: nothing to agree with, no MPI call
        assert collectives[True] - collectives[False] == (1 if SIZE > 1 else 0), name


def test_argument_check_passes_matching_calls():
    c = checked()
    x = data((3, 5), "float32", RANK)
    close(cc.allreduce(x, comm=c), expected((3, 5), "float32", "sum"), "float32")
    y = x.copy()
    assert cc.allreduce(y, "avg", out=y, comm=c) is y
    close(y, expected((3, 5), "float32", "avg"), "float32")
    hs = [cc.allreduce_async(np.full(7, float(RANK + i)), comm=c) for i in range(3)]
    assert [h.wait().tolist() for h in hs] == [[float(sum(r + i for r in range(SIZE)))] * 7 for i in range(3)]
    xs = [data(s, dt, RANK) for s, dt in [((4,), "float32"), ((2, 3), "int32"), ((0,), "float64")]]
    for inplace in (False, True):
        out = cc.grouped_allreduce([a.copy() for a in xs], inplace=inplace, threshold=64e3, comm=c)
        for a, o in zip(xs, out):
            close(o, expected(a.shape, a.dtype, "sum"), a.dtype)
    b = np.full(4, float(RANK))
    assert cc.broadcast(b, SIZE - 1, comm=c) is b and b.tolist() == [SIZE - 1.0] * 4
    assert cc.broadcast_object({"r": RANK}, np.int64(SIZE - 1), comm=c) == {"r": SIZE - 1}
    cc.barrier(comm=c)
    from clusterctl.collective.numpy_opt import DistributedOptimizer, GradientBuffer
    buf = GradientBuffer({"w": (4, 3), "b": (3,)}, op="sum", comm=c)
    buf.grads["w"][...] = RANK
    buf.allreduce()
    assert np.all(buf.grads["w"] == sum(range(SIZE)))
    w = {"w": np.zeros(2)}
    opt = DistributedOptimizer(lambda p, g: p["w"].__isub__(g["w"]), w, comm=c)
    opt.step({"w": np.full(2, float(RANK))})
    assert w["w"].tolist() == [-(SIZE - 1) / 2] * 2


def test_argument_check_catches_other_shapes():
    if SIZE == 1:
        pytest.skip("needs two ranks")
    c = checked()
    for n in (1000, 2 * C.fusion_threshold):     # the second: more window chunks on rank 0 (off: a hang)
        x = np.ones(n if RANK == 0 else n - 1, np.float32)
        want = f"allreduce: ranks disagree: rank 0 float32 ({n},), {OTHERS} float32 ({n - 1},)"
        raises_alike(lambda: cc.allreduce(x, comm=c), want)
        h = cc.allreduce_async(x, out=x, comm=c)           # agreed on the worker, right before the reduction
        raises_alike(h.wait, want)
        assert np.all(x == 1.0)                             # not reduced
        in_step(c)
    x = np.ones((4, 6) if RANK == 0 else (6, 4))                              # same size, other shape
    raises_alike(lambda: cc.broadcast(x, 0, comm=c),
                 f"broadcast: ranks disagree: rank 0 float64 (4, 6), {OTHERS} float64 (6, 4)")
    in_step(c)


def test_argument_check_catches_other_dtypes():
    if SIZE == 1:
        pytest.skip("needs two ranks")
    c = checked()
    last = RANK == SIZE - 1
    x = np.ones(1000, np.float64 if last else np.float32)
    raises_alike(lambda: cc.allreduce(x, comm=c),
                 f"allreduce: ranks disagree: {FIRST} float32 (1000,), rank {SIZE - 1} float64 (1000,)")
    in_step(c)
    # a dtype that the last rank refuses by itself (before any MPI call): the others do not wait for it
    b = np.ones(4, bool if last else np.float32)
    want = (f"allreduce: ranks disagree: {FIRST} float32 (4,), rank {SIZE - 1} bool (4,) "
            "(refused: cannot allreduce dtype bool)")
    raises_alike(lambda: cc.allreduce(b, comm=c), want)
    in_step(c)
    # the same behind reductions still in flight: the refusing rank agrees after them, as the others do
    earlier = [cc.allreduce_async(np.full(50_000, float(RANK)), comm=c) for _ in range(3)]
    if last:
        raises_alike(lambda: cc.allreduce_async(b, comm=c), want)                 # at the call: it refused
    else:
        raises_alike(cc.allreduce_async(b, comm=c).wait, want)                     # at wait()
    assert all(np.all(h.wait() == sum(range(SIZE))) for h in earlier)
    in_step(c)


def test_argument_check_catches_other_numbers_of_tensors():
    if SIZE == 1:
        pytest.skip("needs two ranks")
    c = checked()
    xs = [np.full(10, 1.0, np.float32) for _ in range(3 if RANK == 0 else 2)]
    for inplace in (False, True):
        raises_alike(lambda: cc.grouped_allreduce(xs, inplace=inplace, comm=c),
                     f"grouped_allreduce: ranks disagree: rank 0 3 tensors, {OTHERS} 2 tensors")
        assert all(np.all(a == 1.0) for a in xs)                              # nothing was reduced
    in_step(c)
    ys = [np.ones(11 if (i == 2 and RANK == 0) else 10, np.float32) for i in range(5)]
    raises_alike(lambda: cc.grouped_allreduce(ys, comm=c),
                 f"grouped_allreduce: ranks disagree on tensor 2: rank 0 float32 (11,), {OTHERS} float32 (10,)")
    from clusterctl.collective.numpy_opt import GradientBuffer
    shapes = {"w": (4, 3), "b": (3,) if RANK == 0 else (4,)}
    raises_alike(lambda: GradientBuffer(shapes, comm=c),
                 f"GradientBuffer: ranks disagree on tensor 1 (b): rank 0 float32 (3,), {OTHERS} float32 (4,)")
    in_step(c)


def test_argument_check_catches_other_ops_roots_and_collectives():
    if SIZE == 1:
        pytest.skip("needs two ranks")
    c = checked()
    x = np.ones(8, np.float32)
    raises_alike(lambda: cc.allreduce(x, "sum" if RANK == 0 else "avg", comm=c),
                 f"allreduce: ranks disagree: rank 0 op='sum', {OTHERS} op='avg'")
    raises_alike(lambda: cc.grouped_allreduce([x], threshold=1024 if RANK == 0 else 1e3, comm=c),
                 f"grouped_allreduce: ranks disagree: rank 0 threshold=1024, {OTHERS} threshold=1000")
    raises_alike(lambda: cc.broadcast_object(RANK, root=RANK, comm=c),
                 "broadcast_object: ranks disagree: " + ", ".join(f"rank {r} root={r}" for r in range(SIZE)))
    raises_alike(lambda: cc.barrier(comm=c) if RANK == 0 else cc.allreduce(x, comm=c),
                 f"ranks disagree on the collective: rank 0 barrier, {OTHERS} allreduce op='sum' float32 (8,)")
    in_step(c)


torch = pytest.importorskip("torch")


@pytest.mark.parametrize("overlap", [True, False], ids=["worker-thread", "inline"])
def test_torch_grads_are_views_into_buckets(overlap):
    from clusterctl.collective.torch import DistributedOptimizer
    torch.manual_seed(0)
    m = torch.nn.Linear(20, 5)
    opt = DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.0), named_parameters=m.named_parameters(),
                               overlap=overlap)
    assert opt.overlap is overlap
    ptrs = {b.flat.data_ptr() for b in opt._buckets}
    for _ in range(2):
        opt.zero_grad()
        (m(torch.full((4, 20), float(RANK + 1))).sum()).backward()
        opt.step()
        assert all(p.grad.data_ptr() in {v.data_ptr() for b in opt._buckets for v in b.views}
                   for p in m.parameters())
        # bias grad = 4 rows per rank, averaged: 4; weight grad = 4 * mean(rank + 1)
        assert torch.allclose(m.bias.grad, torch.full((5,), 4.0))
        assert torch.allclose(m.weight.grad, torch.full((5, 20), 4.0 * (SIZE + 1) / 2))
    assert {b.flat.data_ptr() for b in opt._buckets} == ptrs
    assert (opt._arena is not None) == C.uses_shm
    opt.remove_hooks()


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "bfloat16", "int32"])
def test_torch_cpu(dtype):
    dt = getattr(torch, dtype)
    base = torch.arange(1001, dtype=torch.float64) % 13 - 6
    x = (base + RANK).to(dt)
    want = sum(base + r for r in range(SIZE))
    y = cc.allreduce(x)
    assert y.dtype == dt and torch.allclose(y.double(), want.to(dt).double(), atol=1e-2)
    cc.allreduce(x, out=x)
    assert torch.allclose(x.double(), want.to(dt).double(), atol=1e-2)
    if dt.is_floating_point:
        z = cc.allreduce((base + RANK).to(dt), "avg")
        assert torch.allclose(z.double(), (want / SIZE).to(dt).double(), atol=2e-2)
    t = (base + RANK).to(dt).reshape(7, 143)
    assert cc.broadcast(t, 0) is t and torch.equal(t, base.to(dt).reshape(7, 143))


def test_torch_compression_fp16():
    x = torch.full((1000,), 1.0 + RANK, dtype=torch.float32)
    y = cc.allreduce(x, "avg", compression="fp16")
    assert y.dtype == torch.float32 and torch.allclose(y, torch.full((1000,), (SIZE + 1) / 2))


@pytest.mark.parametrize("overlap", [True, False], ids=["worker-thread", "inline"])
def test_distributed_optimizer_matches_single_process(overlap):
    from clusterctl.collective.torch import DistributedOptimizer, broadcast_parameters

    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(10, 32), torch.nn.Tanh(), torch.nn.Linear(32, 3))
    g = torch.Generator().manual_seed(1)
    X, Y = torch.randn(6 * SIZE, 10, generator=g), torch.randint(0, 3, (6 * SIZE,), generator=g)
    ref, m = model(), model()
    with torch.no_grad():
        for p in m.parameters():
            p.add_(RANK)                 # diverge, then broadcast_parameters must re-align
    broadcast_parameters(m.state_dict(), root=0)
    ropt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    opt = DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9),
                               named_parameters=m.named_parameters(), fusion_threshold=512, overlap=overlap)
    assert len(opt._buckets) > 1
    for _ in range(6):
        ropt.zero_grad()
        torch.nn.functional.cross_entropy(ref(X), Y).backward()
        ropt.step()
        opt.zero_grad()
        sl = slice(RANK * 6, (RANK + 1) * 6)
        torch.nn.functional.cross_entropy(m(X[sl]), Y[sl]).backward()
        opt.step()
    for (name, a), (_, b) in zip(ref.named_parameters(), m.named_parameters()):
        assert torch.allclose(a, b, atol=1e-5), name
    opt.remove_hooks()


@pytest.mark.parametrize("overlap", [True, False], ids=["worker-thread", "inline"])
def test_distributed_optimizer_grads_are_the_mean_over_ranks(overlap):
    """Every .grad after synchronize() equals the mean of the ranks' own gradients, bucket by bucket."""
    from clusterctl.collective.torch import DistributedOptimizer
    torch.manual_seed(3)
    m = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.ReLU(),
                            torch.nn.Linear(64, 4))
    g = torch.Generator().manual_seed(7)
    X = torch.randn(5 * SIZE, 16, generator=g)
    own = []                                      # every rank's local gradients, computed here for all ranks
    for r in range(SIZE):
        m.zero_grad()
        m(X[r * 5:(r + 1) * 5]).pow(2).mean().backward()
        own.append([p.grad.clone() for p in m.parameters()])
    want = [sum(gs[i] for gs in own) / SIZE for i in range(len(own[0]))]
    m.zero_grad(set_to_none=True)
    opt = DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.0), named_parameters=m.named_parameters(),
                               fusion_threshold=4096, overlap=overlap)
    assert len(opt._buckets) >= 3
    for _ in range(2):                            # twice: zero_grad and the buckets are reused
        opt.zero_grad()
        m(X[RANK * 5:(RANK + 1) * 5]).pow(2).mean().backward()
        opt.synchronize()
        for p, w in zip(m.parameters(), want):
            assert torch.allclose(p.grad, w, rtol=1e-5, atol=1e-7)
    opt.remove_hooks()


def test_overlap_env_and_default(monkeypatch):
    from clusterctl.collective.errors import CollectiveError
    from clusterctl.collective.torch import OVERLAP_ENV, _choose_overlap
    monkeypatch.setenv(OVERLAP_ENV, "0")
    assert _choose_overlap(None, C) is False and _choose_overlap(True, C) is True
    monkeypatch.setenv(OVERLAP_ENV, "1")
    assert _choose_overlap(None, C) is True and _choose_overlap(False, C) is False
    monkeypatch.setenv(OVERLAP_ENV, "maybe")
    with pytest.raises(CollectiveError, match="CLUSTERCTL_COLLECTIVE_OVERLAP='maybe': expected 0 or 1"):
        _choose_overlap(None, C)
    monkeypatch.delenv(OVERLAP_ENV)
    assert _choose_overlap(None, C) is True


def test_cuda_tensor():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    x = torch.full((1000,), float(RANK), device="cuda")
    y = cc.allreduce(x)
    assert y.is_cuda and torch.allclose(y.cpu(), torch.full((1000,), float(sum(range(SIZE)))))
    assert y is not x and torch.all(x == RANK)
    out = torch.empty_like(x)
    assert cc.allreduce(x, "avg", out=out) is out and torch.allclose(out.cpu(), torch.full((1000,), (SIZE - 1) / 2))
    assert cc.allreduce(x, out=x) is x and torch.all(x == sum(range(SIZE)))
    ints = torch.full((7,), RANK + 1, device="cuda", dtype=torch.int32)
    avg = cc.allreduce(ints, "avg")  # an integer average is out-of-place, in float64
    assert avg.is_cuda and avg.dtype == torch.float64 and torch.all(avg == (SIZE + 1) / 2)


@pytest.mark.parametrize("inplace", [True, False], ids=["inplace", "out-of-place"])
@pytest.mark.parametrize("op", ["sum", "avg"])
def test_cuda_tensors_grouped_into_device_buckets(op, inplace):
    """grouped_allreduce of CUDA tensors: same-dtype tensors share a device bucket (one staging copy each way,
    or one CUDA-aware call), odd ones (bf16, non-contiguous, integer) take the single-tensor path; every
    result is right and stays on the device."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from clusterctl.collective.fusion import fused_for
    shapes = [(1000,), (33, 7), (5,), (4096, 4), (2, 2, 2)]
    xs = [torch.full(s, float(RANK + 1 + k), device="cuda") for k, s in enumerate(shapes)]
    xs += [torch.full((300,), float(RANK + 1), device="cuda", dtype=torch.float64),
           torch.full((300,), float(RANK + 1), device="cuda", dtype=torch.float64),
           torch.full((64,), float(RANK + 1), device="cuda", dtype=torch.bfloat16),
           torch.full((8, 6), float(RANK + 1), device="cuda").t(),
           torch.full((10,), RANK + 1, device="cuda", dtype=torch.int64)]
    if op == "avg":
        xs.pop()  # an integer average is out-of-place only (floats); covered by the single-tensor tests
    fused = fused_for(xs, op=op, comm=C, threshold=64 << 10, compression=None)
    # float32: the first three share a bucket, the 64 KiB tensor fills one of its own and the last is left alone
    # (single-tensor path), as are bf16, the transposed view and int64; float64: one bucket of two
    assert sorted(len(b) for b in fused.device_buckets) == [2, 3]
    expect = [sum(RANK2 + 1 + k for RANK2 in range(SIZE)) for k in range(len(shapes))] + [SIZE * (SIZE + 1) / 2] * 5
    out = cc.grouped_allreduce(xs, op=op, inplace=inplace, threshold=64 << 10)
    for k, (x, y) in enumerate(zip(xs, out)):
        want = expect[k] / (SIZE if op == "avg" else 1)
        assert y.is_cuda and y.shape == x.shape and y.dtype == x.dtype, k
        assert torch.allclose(y.double().cpu(), torch.full(x.shape, float(want), dtype=torch.float64)), (k, y)
        if inplace:
            assert y is x


def test_cupy_array():
    cupy = pytest.importorskip("cupy")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    x = cupy.full((1000,), float(RANK), dtype=cupy.float32)
    y = cc.allreduce(x)
    assert float(y[0]) == sum(range(SIZE))


def test_argument_check_with_the_torch_optimizer():
    """Buckets in the window are checked as "gradient bucket"; parameters that differ are named at construction."""
    from clusterctl.collective.torch import DistributedOptimizer
    c = checked()
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    for overlap in (True, False):
        opt = DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.0), named_parameters=m.named_parameters(),
                                   comm=c, fusion_threshold=32, overlap=overlap)
        opt.zero_grad()
        m(torch.full((2, 4), float(RANK + 1))).sum().backward()
        opt.step()
        assert torch.allclose(m[1].bias.grad, torch.full((2,), 2.0))
        opt.remove_hooks()
    if SIZE == 1:
        return
    if RANK > 0:
        m[1].weight = torch.nn.Parameter(torch.zeros(3, 2))                # same size, another shape
    raises_alike(lambda: DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.0), m.named_parameters(), comm=c),
                 f"DistributedOptimizer: ranks disagree on tensor 2 (1.weight): rank 0 float32 (2, 3), "
                 f"{OTHERS} float32 (3, 2)")
    t = torch.ones(5, dtype=torch.float32 if RANK == 0 else torch.bfloat16)
    raises_alike(lambda: cc.allreduce(t, comm=c),
                 f"allreduce: ranks disagree: rank 0 float32 (5,), {OTHERS} bfloat16 (5,)")
    in_step(c)
