"""Deterministic placement of parameter blocks on pservers (Paddle's DistributeTranspiler slicing).

A parameter with ``numel`` elements is split along dim 0 into at most ``len(pservers)`` blocks, never
smaller than ``min_block_size`` elements and always a whole number of rows; blocks of all parameters,
taken in parameter order, are dealt round-robin over the pservers in list order. Small parameters stay
whole. The result is a pure function of (names, shapes, pserver list, min_block_size).
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from .endpoints import duplicate_endpoints
from .errors import PsConfigError

__all__ = [
    "DEFAULT_MIN_BLOCK_SIZE",
    "Block",
    "ShardPlan",
    "plan_shards",
    "slice_param",
]

#: Paddle's ``min_block_size`` default in ``DistributeTranspilerConfig``.
DEFAULT_MIN_BLOCK_SIZE = 8192


@dataclass(frozen=True)
class Block:
    """One contiguous block of a parameter: elements ``[start, stop)`` of its row-major flattening."""

    param: str
    block_id: int
    start: int
    stop: int
    server: int

    @property
    def key(self) -> str:
        """The block's name on the wire and in checkpoints, e.g. ``fc_0.w_0.block1``."""
        return f"{self.param}.block{self.block_id}"

    @property
    def size(self) -> int:
        """Number of elements in the block."""
        return self.stop - self.start


@dataclass(frozen=True)
class ShardPlan:
    """Every block of every parameter, with its pserver; built by :func:`plan_shards`."""

    endpoints: tuple[str, ...]
    shapes: tuple[tuple[str, tuple[int, ...]], ...]
    blocks: tuple[Block, ...]

    @property
    def fingerprint(self) -> str:
        """A short hash of the placement; every trainer of a job must compute the same one."""
        text = json.dumps([self.endpoints, self.shapes, [(b.key, b.start, b.stop, b.server) for b in self.blocks]])
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def for_server(self, server: int) -> tuple[Block, ...]:
        """The blocks held by pserver ``server`` (index into ``endpoints``), in plan order."""
        return tuple(b for b in self.blocks if b.server == server)

    def for_param(self, name: str) -> tuple[Block, ...]:
        """The blocks of parameter ``name`` in block-id order."""
        return tuple(b for b in self.blocks if b.param == name)

    def shape(self, name: str) -> tuple[int, ...]:
        """The full shape of parameter ``name``."""
        for n, s in self.shapes:
            if n == name:
                return s
        raise KeyError(name)


def slice_param(
    shape: Sequence[int], num_servers: int, min_block_size: int = DEFAULT_MIN_BLOCK_SIZE
) -> list[tuple[int, int]]:
    """Split a parameter of ``shape`` into ``[start, stop)`` element ranges, as Paddle's ``slice_variable``."""
    if num_servers < 1:
        raise PsConfigError("need at least one pserver to place parameters")
    if min_block_size < 1:
        raise PsConfigError(f"min_block_size must be >= 1, got {min_block_size}")
    numel = math.prod(shape)
    if numel == 0:
        return [(0, 0)]
    max_count = max(1, numel // min_block_size)
    split_count = min(num_servers, max_count)
    block_size = math.ceil(numel / split_count)
    if len(shape) >= 2:
        # Align on whole rows so each block is a slice along dim 0.
        row = math.prod(shape[1:])
        if block_size % row:
            block_size += row - block_size % row
    split_count = math.ceil(numel / block_size)
    return [(i * block_size, min(numel, (i + 1) * block_size)) for i in range(split_count)]


def plan_shards(
    params: Iterable[tuple[str, Sequence[int]]],
    endpoints: Sequence[str],
    *,
    min_block_size: int = DEFAULT_MIN_BLOCK_SIZE,
) -> ShardPlan:
    """Place every block of ``params`` (``(name, shape)`` pairs, in model order) on ``endpoints``."""
    eps = tuple(endpoints)
    if not eps:
        raise PsConfigError("the pserver endpoint list is empty")
    dups = duplicate_endpoints(eps)
    if dups:
        raise PsConfigError(f"the pserver endpoint list {','.join(eps)} names {', '.join(dups)} more than once")
    shapes: list[tuple[str, tuple[int, ...]]] = []
    blocks: list[Block] = []
    seen: set[str] = set()
    cursor = 0  # the round-robin dispatcher's position, carried across parameters
    for name, shape in params:
        if name in seen:
            raise PsConfigError(f"duplicate parameter name {name!r}")
        seen.add(name)
        shp = tuple(int(d) for d in shape)
        if any(d < 0 for d in shp):
            raise PsConfigError(f"parameter {name!r} has a negative dimension: {shp}")
        shapes.append((name, shp))
        for block_id, (start, stop) in enumerate(slice_param(shp, len(eps), min_block_size)):
            blocks.append(Block(name, block_id, start, stop, cursor))
            cursor = (cursor + 1) % len(eps)
    return ShardPlan(eps, tuple(shapes), tuple(blocks))
