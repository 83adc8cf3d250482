"""Per-element pieces of the shared-memory collectives: input checks, how a vector is split among ranks, and the
chunk reduction (low-precision inputs accumulate in float32)."""

from __future__ import annotations

import torch

from cocosync.reduce_op import ReduceOp

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
REDUCE_OPS = tuple(ReduceOp)


def split_bounds(n: int, parts: int) -> list[tuple[int, int]]:
    """[start, stop) of `parts` nearly equal contiguous pieces of range(n) (the first ones one longer)."""
    q, r = divmod(n, parts)
    out, start = [], 0
    for i in range(parts):
        stop = start + q + (1 if i < r else 0)
        out.append((start, stop))
        start = stop
    return out


def check_dtype(name: str, t: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{name}: unsupported dtype {t.dtype}; supported: "
                        f"{', '.join(str(d) for d in SUPPORTED_DTYPES)}")
    if t.device.type != "cpu":
        raise ValueError(f"{name}: the shared-memory path needs CPU tensors, got device {t.device}")


def check_op(name: str, op: ReduceOp | str) -> ReduceOp:
    """The ReduceOp named by `op` (a ReduceOp, 'sum', 'avg', 'ReduceOp.MAX', ...), or ValueError naming the call."""
    try:
        return ReduceOp.parse(op)
    except ValueError:
        raise ValueError(f"{name}: unsupported op {op!r}; supported: {', '.join(o.value for o in ReduceOp)}") from None



def element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def reduce_chunk(dst: torch.Tensor, srcs: list[torch.Tensor], op: ReduceOp, acc_buf, scale: float | None) -> None:
    """dst = reduce(srcs) in rank order; float32 accumulation for 16-bit sums. dst may alias any src."""
    if len(srcs) == 1:  # one rank on this node (a hierarchical collective's local step): its own values
        if srcs[0].data_ptr() != dst.data_ptr():
            dst.copy_(srcs[0])
        if scale is not None:
            dst.mul_(scale)
        return
    if op in (ReduceOp.MAX, ReduceOp.MIN):
        f = torch.maximum if op is ReduceOp.MAX else torch.minimum
        # exact and order-free: start with an aliased source (if any) so nothing is overwritten before it is read
        order = sorted(range(len(srcs)), key=lambda i: srcs[i].data_ptr() != dst.data_ptr())
        f(srcs[order[0]], srcs[order[1]], out=dst)
        for i in order[2:]:
            f(dst, srcs[i], out=dst)
        return
    f32 = srcs[0].dtype == torch.float32
    if f32 and len(srcs) == 2:
        torch.add(srcs[0], srcs[1], out=dst)
        if scale is not None:
            dst.mul_(scale)
        return
    aliased_late = any(s.data_ptr() == dst.data_ptr() for s in srcs[2:])
    if f32 and not aliased_late:
        torch.add(srcs[0], srcs[1], out=dst)
        for s in srcs[2:]:
            dst.add_(s)
        if scale is not None:
            dst.mul_(scale)
        return
    acc = acc_buf(dst.numel())
    acc.copy_(srcs[0])
    for s in srcs[1:]:
        acc.add_(s)
    if scale is not None:
        acc.mul_(scale)
    dst.copy_(acc)
