"""clusterctl.ps: a parameter server on ZeroMQ (sharded parameters; sync, async and geo modes).

Trainers use :class:`PSClient` (or :func:`client_from_env`); pservers run :class:`ParameterServer`
(or ``python -m clusterctl.ps server``). See docs/ps.md.
"""

from .client import PSClient
from .env import PsEnv, client_from_env, from_env, server_from_env
from .errors import (
    BarrierTimeoutError,
    CheckpointError,
    ProtocolError,
    PsConfigError,
    PsError,
    PsTimeoutError,
    RemoteOpError,
)
from .optim import SGD, Adam, Momentum, OptimizerConfig
from .server import MODES, ParameterServer
from .sharding import DEFAULT_MIN_BLOCK_SIZE, Block, ShardPlan, plan_shards, slice_param

__all__ = [
    "DEFAULT_MIN_BLOCK_SIZE",
    "MODES",
    "SGD",
    "Adam",
    "BarrierTimeoutError",
    "Block",
    "CheckpointError",
    "Momentum",
    "OptimizerConfig",
    "PSClient",
    "ParameterServer",
    "ProtocolError",
    "PsConfigError",
    "PsEnv",
    "PsError",
    "PsTimeoutError",
    "RemoteOpError",
    "ShardPlan",
    "client_from_env",
    "from_env",
    "plan_shards",
    "server_from_env",
    "slice_param",
]
