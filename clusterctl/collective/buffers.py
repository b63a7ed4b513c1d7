"""Turn NumPy arrays, PyTorch tensors (CPU/CUDA) and CuPy arrays into flat buffers MPI can reduce.

A :class:`Prepared` holds a 1-D contiguous host ``src`` and ``dst`` (the same object for in-place work),
or a ``device`` buffer for CUDA-aware MPI, plus a ``finish`` step that writes back and returns the
user-facing result.  Contiguous NumPy arrays and CPU tensors are reduced where they are (no copy in
place; one copy for out-of-place, which MPI would make anyway).  Copies happen only where the buffer
does not allow otherwise: non-contiguous inputs, bfloat16 (reduced in float32), device memory without
CUDA-aware MPI (pinned host staging), and compression.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from .errors import CollectiveError

__all__ = ["Prepared", "prepare", "reduce_one", "kind_of", "check_writable", "check_torch", "OPS",
           "TORCH_REDUCIBLE"]

OPS = ("sum", "avg")

#: torch dtypes this package can reduce (by name, so torch need not be imported): what MPI/NumPy add, plus
#: bfloat16 (reduced in float32). Float8, complex, quantized and bool tensors are refused up front.
TORCH_REDUCIBLE = frozenset(f"torch.{n}" for n in (
    "float16", "float32", "float64", "bfloat16", "int8", "int16", "int32", "int64",
    "uint8", "uint16", "uint32", "uint64"))


def kind_of(x) -> str:
    """'numpy', 'torch', 'torch-cuda', 'cupy' or raise for anything else."""
    if isinstance(x, np.ndarray):
        return "numpy"
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(x, torch.Tensor):
        return "torch-cuda" if x.is_cuda else "torch"
    cupy = sys.modules.get("cupy")
    if cupy is not None and isinstance(x, cupy.ndarray):
        return "cupy"
    raise CollectiveError(f"unsupported buffer type {type(x).__module__}.{type(x).__qualname__}; "
                          "expected a NumPy array, a PyTorch tensor or a CuPy array")


@dataclass
class Prepared:
    """Flat buffers for one reduction plus how to produce the user-visible result."""

    src: Any = None
    dst: Any = None
    device: Any = None
    average_here: bool = True
    finish: Callable[[], Any] = field(default=lambda: None)
    local: bool = False  # nothing to exchange (one rank): ``finish`` alone makes the result


def check_writable(x, what: str = "x") -> None:
    """Refuse a read-only NumPy/CuPy array that would be written (on every rank alike, before any MPI call)."""
    flags = getattr(x, "flags", None)
    if flags is not None and not getattr(flags, "writeable", True):
        raise CollectiveError(f"{what} is a read-only array (flags.writeable is False): cannot write the result into it")


def check_torch(t, what: str = "x") -> None:
    """Refuse tensors that have no flat strided memory on the CPU or a CUDA device (sparse, meta, nested, ...)."""
    import torch
    if t.layout != torch.strided or t.is_nested or t.is_quantized:
        kind = "nested" if t.is_nested else "quantized" if t.is_quantized else str(t.layout)
        raise CollectiveError(f"{what} is a {kind} tensor: only dense (strided) tensors are supported")
    if t.device.type not in ("cpu", "cuda"):
        raise CollectiveError(f"{what} is on device {t.device}: expected a CPU or CUDA tensor")


def _check_op(op: str) -> None:
    if op not in OPS:
        raise CollectiveError(f"op={op!r}: expected one of {', '.join(OPS)}")


def _check_out(x, out) -> None:
    if tuple(out.shape) != tuple(x.shape) or str(out.dtype) != str(x.dtype):
        raise CollectiveError(f"out has shape {tuple(out.shape)} dtype {out.dtype}; "
                              f"expected shape {tuple(x.shape)} dtype {x.dtype}")


def _compress_dtype(compression: str | None, dtype: np.dtype):
    if compression is None or dtype.kind != "f" or dtype.itemsize <= 2:
        return None
    if compression == "fp16":
        return np.dtype(np.float16)
    raise CollectiveError(f"compression={compression!r}: host buffers support 'fp16' (bf16 needs torch)")


def _prepare_numpy(x: np.ndarray, op: str, out, size: int, compression: str | None) -> Prepared:
    if x.dtype.kind not in "fiu":
        raise CollectiveError(f"cannot allreduce dtype {x.dtype}")
    if not x.dtype.isnative:
        raise CollectiveError(f"cannot allreduce dtype {x.dtype.str} (non-native byte order): "
                              f"convert it first, e.g. x.astype({x.dtype.newbyteorder('=').str!r})")
    inplace = out is x
    if out is not None and not inplace:
        _check_out(x, out)
    if out is not None:
        check_writable(out, "x (reduced in place)" if inplace else "out")
    int_avg = op == "avg" and x.dtype.kind in "iu"
    if int_avg and out is not None:
        raise CollectiveError("op='avg' on an integer array gives floats: call it out-of-place (no out=)")
    cdt = _compress_dtype(compression, x.dtype)
    if cdt is not None:
        wire = x.astype(cdt).reshape(-1)
        target = x if inplace else (out if out is not None else np.empty_like(x, order="C"))

        def finish_c():
            np.copyto(target, wire.reshape(x.shape), casting="unsafe")
            return target
        return Prepared(src=wire, dst=wire, finish=finish_c)
    src = x.reshape(-1) if x.flags.c_contiguous else np.ascontiguousarray(x).reshape(-1)
    if inplace:
        if x.flags.c_contiguous:
            return Prepared(src=src, dst=src, finish=lambda: x)

        def finish_nc():
            x[...] = src.reshape(x.shape)
            return x
        return Prepared(src=src, dst=src, finish=finish_nc)
    target = out if out is not None else np.empty(x.shape, dtype=x.dtype)
    dst = target.reshape(-1) if target.flags.c_contiguous else np.empty(x.size, dtype=x.dtype)
    if int_avg:
        return Prepared(src=src, dst=dst, average_here=False,
                        finish=lambda: (dst.reshape(x.shape) / size))

    def finish_oop():
        if dst.base is not target and dst is not target and not target.flags.c_contiguous:
            target[...] = dst.reshape(x.shape)
        return target
    return Prepared(src=src, dst=dst, finish=finish_oop)


def _prepare_torch(x, op: str, out, size: int, compression: str | None, communicator) -> Prepared:
    import torch
    check_torch(x)
    t = x.detach()
    inplace = out is x
    if out is not None and not inplace:
        check_torch(out, "out")
        _check_out(x, out)
    if str(t.dtype) not in TORCH_REDUCIBLE:
        raise CollectiveError(f"cannot allreduce dtype {t.dtype}")
    is_int = not (t.is_floating_point())
    if op == "avg" and is_int and out is not None:
        raise CollectiveError("op='avg' on an integer tensor gives floats: call it out-of-place (no out=)")
    target = x if inplace else (out.detach() if out is not None else None)
    wire_dtype = t.dtype
    if t.dtype == torch.bfloat16 or (compression == "bf16" and t.is_floating_point()):
        # No MPI/NumPy bfloat16 arithmetic: bf16 tensors are reduced in float32; 'bf16' compression
        # rounds float32 values to bf16 precision before a float32 reduction (accuracy, not bandwidth).
        wire_dtype = torch.float32 if t.dtype == torch.bfloat16 else torch.bfloat16
    elif compression == "fp16" and t.is_floating_point() and t.element_size() > 2:
        wire_dtype = torch.float16
    elif compression not in (None, "fp16", "bf16"):
        raise CollectiveError(f"compression={compression!r}: expected None, 'fp16' or 'bf16'")
    if t.is_cuda and size == 1:  # one rank: the sum and the average are the tensor itself, no trip to the host
        def finish_one():
            if op == "avg" and is_int:
                return t.double()
            if inplace:
                return x
            if target is None:
                return t.clone()
            target.copy_(t)
            return out
        return Prepared(finish=finish_one, local=True)
    if t.is_cuda:
        from .cuda import cuda_aware, note_staging
        aware = cuda_aware(communicator)
        work = t.to(wire_dtype) if wire_dtype != t.dtype else t
        if wire_dtype == torch.bfloat16:
            work = work.float()
        if aware:
            if work is not t:
                buf = work.contiguous()
            elif inplace:
                buf = t.contiguous()                      # t itself when already contiguous
            else:
                buf = t.clone(memory_format=torch.contiguous_format)
            torch.cuda.current_stream(buf.device).synchronize()

            def finish_dev():
                if op == "avg":
                    if buf.is_floating_point():
                        buf.div_(size)
                res_src = buf
                if target is None:
                    return res_src.to(x.dtype) if not (op == "avg" and is_int) else res_src.double() / size
                target.copy_(res_src.view(x.shape))
                return x if inplace else out
            return Prepared(device=buf, finish=finish_dev, average_here=False)
        note_staging(communicator)
        host = torch.empty(work.shape, dtype=work.dtype, pin_memory=True)
        host.copy_(work)
        flat = host.reshape(-1).numpy()

        def finish_staged():
            if target is None:
                res = host.to(x.device)
                if op == "avg" and is_int:
                    return res.double() / size
                return res.to(x.dtype)
            target.copy_(host.view(x.shape))          # one copy to the device, into the target
            return x if inplace else out
        return Prepared(src=flat, dst=flat, finish=finish_staged,
                        average_here=not (op == "avg" and is_int))
    # CPU tensor
    if wire_dtype != t.dtype:
        work = t.to(torch.float32) if wire_dtype == torch.bfloat16 else t.to(wire_dtype)
        if wire_dtype == torch.bfloat16:
            work = t.to(torch.bfloat16).to(torch.float32)
        flat = work.contiguous().reshape(-1).numpy()

        def finish_cast():
            res = torch.from_numpy(flat).view(x.shape)
            if target is None:
                return res.to(x.dtype)
            target.copy_(res)
            return x if inplace else out
        return Prepared(src=flat, dst=flat, finish=finish_cast)
    src_t = t if t.is_contiguous() else t.contiguous()
    src = src_t.reshape(-1).numpy()
    if inplace:
        if src_t is t:
            return Prepared(src=src, dst=src, finish=lambda: x)

        def finish_nc():
            target.copy_(src_t)
            return x
        return Prepared(src=src, dst=src, finish=finish_nc)
    if op == "avg" and is_int:
        dst_t = torch.empty(t.shape, dtype=t.dtype)
        return Prepared(src=src, dst=dst_t.reshape(-1).numpy(), average_here=False,
                        finish=lambda: dst_t.double() / size)
    dst_t = target if (target is not None and target.is_contiguous()) else torch.empty(t.shape, dtype=t.dtype)

    def finish_oop():
        if target is not None and dst_t is not target:
            target.copy_(dst_t)
            return out
        return dst_t if target is None else out
    return Prepared(src=src, dst=dst_t.reshape(-1).numpy(), finish=finish_oop)


def _prepare_cupy(x, op: str, out, size: int, compression: str | None, communicator) -> Prepared:
    import cupy
    from .cuda import cuda_aware, note_staging
    inplace = out is x
    if out is not None and not inplace:
        _check_out(x, out)
    if op == "avg" and x.dtype.kind in "iu" and out is not None:
        raise CollectiveError("op='avg' on an integer array gives floats: call it out-of-place (no out=)")
    target = x if inplace else out
    cdt = _compress_dtype(compression, np.dtype(x.dtype))
    work = x.astype(cdt) if cdt is not None else (x if inplace else x.copy())
    work = cupy.ascontiguousarray(work)
    int_avg = op == "avg" and x.dtype.kind in "iu"
    if cuda_aware(communicator):
        cupy.cuda.get_current_stream().synchronize()

        def finish_dev():
            res = work.reshape(x.shape)
            if op == "avg":
                res = res / size if int_avg else res.__itruediv__(size)
            if target is None:
                return res.astype(x.dtype) if not int_avg else res
            if res is not target:
                target[...] = res
            return target
        return Prepared(device=work.reshape(-1), finish=finish_dev, average_here=False)
    note_staging(communicator)
    import cupyx
    host = cupyx.empty_pinned(work.shape, dtype=work.dtype)
    work.get(out=host)
    flat = host.reshape(-1)

    def finish_staged():
        res = cupy.asarray(flat.reshape(x.shape))
        if int_avg:
            return res / size
        if target is None:
            return res.astype(x.dtype)
        target[...] = res
        return target
    return Prepared(src=flat, dst=flat, finish=finish_staged, average_here=not int_avg)


def prepare(x, op: str, out, size: int, compression: str | None, communicator) -> Prepared:
    """Build the flat buffers for reducing ``x`` (into ``out``; ``out is x`` means in place)."""
    _check_op(op)
    kind = kind_of(x)
    if out is not None and kind_of(out) != kind:
        raise CollectiveError(f"out is a {kind_of(out)} buffer but x is a {kind} buffer")
    if kind == "numpy":
        return _prepare_numpy(x, op, out, size, compression)
    if kind in ("torch", "torch-cuda"):
        return _prepare_torch(x, op, out, size, compression, communicator)
    return _prepare_cupy(x, op, out, size, compression, communicator)


def reduce_one(c, prepared: Prepared, op: str, what: str):
    """Allreduce one prepared buffer on communicator ``c`` (run on its worker thread); return the result."""
    if prepared.local:
        pass
    elif prepared.device is not None:
        c.allreduce_device(prepared.device, what)
    else:
        c.allreduce_flat(prepared.src, prepared.dst, op == "avg" and prepared.average_here, what)
    return prepared.finish()
