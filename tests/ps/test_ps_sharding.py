"""Placement of parameter blocks: Paddle's slicing rules, round-robin, determinism."""

from __future__ import annotations

import itertools

import pytest

from clusterctl.ps import Block, PsConfigError, plan_shards, slice_param

pytestmark = pytest.mark.timeout(10)

EPS2 = ["10.0.0.2:6170", "10.0.0.3:6170"]
EPS3 = ["10.0.0.2:6170", "10.0.0.3:6170", "10.0.0.4:6170"]


@pytest.mark.parametrize(
    ("shape", "servers", "ranges"),
    [
        # small: kept whole, whatever the server count
        ((13, 1), 3, [(0, 13)]),
        ((1,), 2, [(0, 1)]),
        ((8191,), 2, [(0, 8191)]),
        # exactly two min blocks on 3 servers -> 2 blocks
        ((16384,), 3, [(0, 8192), (8192, 16384)]),
        # 1-D, not a multiple: ceil split
        ((100000,), 3, [(0, 33334), (33334, 66668), (66668, 100000)]),
        # 2-D: blocks aligned on whole rows of 100 elements
        ((1000, 100), 3, [(0, 33400), (33400, 66800), (66800, 100000)]),
        # 2-D with rows wider than the block: one row per block at most #servers blocks
        ((3, 10000), 2, [(0, 20000), (20000, 30000)]),
        # fewer min blocks than servers limits the split
        ((300, 100), 8, [(0, 10000), (10000, 20000), (20000, 30000)]),
        # empty tensor
        ((0, 5), 2, [(0, 0)]),
    ],
)
def test_slice_param_matches_paddle_rules(shape, servers, ranges):
    assert slice_param(shape, servers) == ranges


def test_slice_param_custom_min_block():
    assert slice_param((10,), 4, min_block_size=3) == [(0, 4), (4, 8), (8, 10)]


def test_round_robin_over_all_blocks_in_parameter_order():
    plan = plan_shards([("fc_0.w_0", (1000, 100)), ("fc_0.b_0", (100,)), ("fc_1.w_0", (100, 10)),
                        ("emb", (30000,))], EPS2)
    assert plan.blocks == (
        Block("fc_0.w_0", 0, 0, 50000, 0),
        Block("fc_0.w_0", 1, 50000, 100000, 1),
        Block("fc_0.b_0", 0, 0, 100, 0),
        Block("fc_1.w_0", 0, 0, 1000, 1),
        Block("emb", 0, 0, 15000, 0),
        Block("emb", 1, 15000, 30000, 1),
    )
    assert [b.key for b in plan.for_server(1)] == ["fc_0.w_0.block1", "fc_1.w_0.block0", "emb.block1"]
    assert plan.shape("emb") == (30000,)


def test_fit_a_line_params_go_one_per_server():
    plan = plan_shards([("fc_0.w_0", (13, 1)), ("fc_0.b_0", (1,))], EPS2)
    assert [(b.key, b.server) for b in plan.blocks] == [("fc_0.w_0.block0", 0), ("fc_0.b_0.block0", 1)]


def test_placement_is_a_pure_function():
    params = [(f"p{i}", (i * 977 + 1, 37)) for i in range(20)]
    a = plan_shards(params, EPS3)
    b = plan_shards(list(params), list(EPS3))
    assert a == b
    # every element of every parameter is covered exactly once
    for name, shape in params:
        blocks = a.for_param(name)
        assert blocks[0].start == 0 and blocks[-1].stop == shape[0] * shape[1]
        assert all(x.stop == y.start for x, y in itertools.pairwise(blocks))


def test_server_order_matters():
    p = [("w", (100000,))]
    assert [b.server for b in plan_shards(p, EPS3).blocks] == [0, 1, 2]
    swapped = plan_shards(p, [EPS3[2], EPS3[0], EPS3[1]])
    assert swapped.endpoints[0] == EPS3[2] and swapped.blocks[0].server == 0


@pytest.mark.parametrize(
    ("params", "eps", "message"),
    [
        ([("w", (3,))], [], "the pserver endpoint list is empty"),
        ([("w", (3,))], ["a:1", "a:1"], "the pserver endpoint list a:1,a:1 names a:1 more than once"),
        ([("w", (3,))], ["tcp://LOCALHOST:6170", "127.0.0.1:06170"], "the pserver endpoint list tcp://LOCALHOST:6170,"
         "127.0.0.1:06170 names 127.0.0.1:6170 (as 'tcp://LOCALHOST:6170', '127.0.0.1:06170') more than once"),
        ([("w", (3,)), ("w", (4,))], EPS2, "duplicate parameter name 'w'"),
        ([("w", (3, -1))], EPS2, "parameter 'w' has a negative dimension: (3, -1)"),
    ],
)
def test_plan_errors(params, eps, message):
    with pytest.raises(PsConfigError) as err:
        plan_shards(params, eps)
    assert str(err.value) == message


def test_fingerprint_identifies_the_placement():
    p = [("w", (100000,)), ("b", (10,))]
    assert plan_shards(p, EPS2).fingerprint == plan_shards(list(p), list(EPS2)).fingerprint
    assert len(plan_shards(p, EPS2).fingerprint) == 16
    assert plan_shards(p, EPS2).fingerprint != plan_shards(p[::-1], EPS2).fingerprint
    assert plan_shards(p, EPS2).fingerprint != plan_shards(p, EPS2[::-1]).fingerprint
    assert plan_shards(p, EPS2).fingerprint != plan_shards(p, EPS2, min_block_size=60000).fingerprint
