"""Server-side optimizers applied to one parameter block: SGD, Momentum and Adam (Paddle's update rules).

Updates are out-of-place for the parameter (the result goes to a separate buffer that then replaces
the block), so a block still being sent zero-copy to a trainer is never modified under the sender's
feet; the server recycles buffers once ZeroMQ reports them sent. Optimizer state (velocity, moments)
is private to the server and updated in place.

Blocks narrower than float32 (float16) are updated in float32: their state is float32 and only the new
value is rounded to the block's dtype. In float16 Adam's epsilon (1e-8, scaled) rounds to 0 and
``0.001 * g**2`` underflows, so ``m / (sqrt(v) + eps)`` would be 0/0 or m/0.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from .errors import PsConfigError

__all__ = ["SGD", "Adam", "Momentum", "OptimizerConfig", "apply_piece", "apply_update", "begin_update", "init_state",
           "state_dtype"]

_KINDS = ("sgd", "momentum", "adam")


@dataclass(frozen=True)
class OptimizerConfig:
    """Which optimizer the pservers run and its hyper-parameters; sent by trainers in ``init``."""

    kind: str = "sgd"
    lr: float = 0.01
    momentum: float = 0.9
    beta1: float = 0.9
    beta2: float = 0.999
    epsilon: float = 1e-8

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise PsConfigError(f"optimizer must be one of {', '.join(_KINDS)}, got {self.kind!r}")
        for name in ("lr", "momentum", "beta1", "beta2", "epsilon"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise PsConfigError(f"optimizer {name} must be a finite number, got {value!r}")
        if self.lr < 0:
            raise PsConfigError(f"optimizer lr must be >= 0, got {self.lr}")
        if not (0 <= self.beta1 < 1 and 0 <= self.beta2 < 1):
            raise PsConfigError("adam betas must lie in [0, 1)")

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict (the wire and manifest form)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> OptimizerConfig:
        """Parse the wire form; unknown keys are an error."""
        if not isinstance(data, Mapping):
            raise PsConfigError(f"optimizer config must be an object, got {type(data).__name__}")
        unknown = set(data) - set(cls.__dataclass_fields__)
        if unknown:
            raise PsConfigError(f"unknown optimizer field(s): {', '.join(sorted(unknown))}")
        return cls(**dict(data))


def SGD(lr: float = 0.01) -> OptimizerConfig:
    """Plain SGD: ``p -= lr * g``."""
    return OptimizerConfig("sgd", lr)


def Momentum(lr: float = 0.01, momentum: float = 0.9) -> OptimizerConfig:
    """Momentum SGD as Paddle's ``momentum`` op: ``v = mu * v + g; p -= lr * v``."""
    return OptimizerConfig("momentum", lr, momentum=momentum)


def Adam(lr: float = 0.001, beta1: float = 0.9, beta2: float = 0.999, epsilon: float = 1e-8) -> OptimizerConfig:
    """Adam with bias correction folded into the learning rate, as Paddle's ``adam`` op."""
    return OptimizerConfig("adam", lr, beta1=beta1, beta2=beta2, epsilon=epsilon)


def state_dtype(dtype: Any) -> np.dtype:
    """The dtype of a block's optimizer state and arithmetic: float32 for float16 blocks, the block's own otherwise."""
    dtype = np.dtype(dtype)
    return np.dtype(np.float32) if dtype.itemsize < 4 else dtype


def init_state(cfg: OptimizerConfig, param: np.ndarray) -> dict[str, np.ndarray]:
    """Fresh optimizer state for one block."""
    work = state_dtype(param.dtype)
    if cfg.kind == "momentum":
        return {"velocity": np.zeros(param.shape, work)}
    if cfg.kind == "adam":
        return {"m": np.zeros(param.shape, work), "v": np.zeros(param.shape, work), "t": np.zeros(1, np.float64)}
    return {}


def _pieces(grad: Any) -> Iterable[tuple[int, np.ndarray]]:
    """``(element offset, 1-D array)`` pieces of ``grad``: a NumPy array, or a received protocol Tensor."""
    pieces = getattr(grad, "pieces", None)
    return pieces if pieces is not None else ((0, np.asarray(grad).reshape(-1)),)


def apply_update(cfg: OptimizerConfig, param: np.ndarray, grad: Any, state: dict[str, np.ndarray],
                 out: np.ndarray | None = None) -> np.ndarray:
    """One optimizer step written to ``out`` (a fresh array if None); ``param`` itself is left untouched.

    ``grad`` is a 1-D array of ``param``'s size or a received ``Tensor`` (processed piece by piece, as
    its frames arrived, without assembling it). SGD computes ``param + (-lr * grad)``, bit-identical to
    ``param - lr * grad``.
    """
    if out is None:
        out = np.empty_like(param)
    t = begin_update(cfg, state)
    for off, g in _pieces(grad):
        apply_piece(cfg, param, g, state, off, out, t)
    return out


def begin_update(cfg: OptimizerConfig, state: dict[str, np.ndarray]) -> float:
    """Start one update of a block: advance Adam's step count (once per update); return it (0 otherwise)."""
    if cfg.kind != "adam":
        return 0.0
    t = state["t"]
    t[0] += 1
    return float(t[0])


def apply_piece(cfg: OptimizerConfig, param: np.ndarray, g: np.ndarray, state: dict[str, np.ndarray],
                off: int, out: np.ndarray, t: float) -> None:
    """Elements ``off:off+g.size`` of one update: ``out[...] = step(param[...], g)``; ``t`` from begin_update.

    ``param`` and ``out`` are whole blocks (``param`` is only read); the optimizer state of the same
    elements is updated in place, so pieces of one update may be applied in any order, each once.
    """
    dtype = state_dtype(param.dtype)  # the arithmetic's dtype: float32 for a float16 block
    end = off + g.size
    o = out[off:end]
    u = o if dtype == param.dtype else np.empty(g.size, dtype)  # the step, then the new value
    g = g.astype(dtype, copy=False)
    if cfg.kind == "sgd":
        np.multiply(g, -dtype.type(cfg.lr), out=u)
    elif cfg.kind == "momentum":
        vel = state["velocity"][off:end]
        vel *= dtype.type(cfg.momentum)
        vel += g
        np.multiply(vel, -dtype.type(cfg.lr), out=u)
    else:  # adam, as Paddle: lr_t = lr * sqrt(1 - b2^t) / (1 - b1^t); eps scaled by sqrt(1 - b2^t)
        corr2 = math.sqrt(1 - cfg.beta2 ** t)
        lr_t = dtype.type(cfg.lr * corr2 / (1 - cfg.beta1 ** t))
        eps = dtype.type(cfg.epsilon * corr2)
        m, v = state["m"][off:end], state["v"][off:end]
        m *= dtype.type(cfg.beta1)
        m += dtype.type(1 - cfg.beta1) * g
        v *= dtype.type(cfg.beta2)
        v += dtype.type(1 - cfg.beta2) * np.square(g)
        np.sqrt(v, out=u)
        u += eps
        np.divide(m, u, out=u)
        u *= -lr_t
    u += param[off:end]
    if u is not o:
        o[...] = u  # rounded once into the block's dtype
