"""Collectives, with optional byte accounting, and the autograd-aware TP/SP regions built on them.

All communication in megatron-lite goes through the plain wrappers at the top of this file
(`all_reduce`, `all_gather`, `reduce_scatter`, `all_to_all`, `record_p2p`), so that
`--log-comm-volume` can count it: each takes the `CommCounter` to add to (callers pass
`dims.comm_counter`; None counts nothing). Counted is the size of the full logical buffer on this
rank: the unsharded tensor for reduce-scatter and all-gather.

The autograd functions implement Megatron's four TP regions (f/g of the Megatron-LM paper)
and their sequence-parallel counterparts. Activations are laid out [s, b, h]: the sequence
dimension is dim 0, so sequence-parallel gathers and scatters are contiguous.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Dict, Optional

import torch
import torch.distributed as dist

from .state import group_rank, group_size


class CommCounter:
    """Bytes moved per collective kind. Owned by whoever measures (the trainer with
    --log-comm-volume) and handed to the collectives explicitly, through `ParallelDims.comm_counter`
    (None: nothing is counted)."""

    def __init__(self):
        self.bytes: Dict[str, int] = defaultdict(int)

    def add(self, kind: str, nbytes: int) -> None:
        self.bytes[kind] += int(nbytes)

    def reset(self) -> Dict[str, int]:
        out = dict(self.bytes)
        self.bytes = defaultdict(int)
        return out


def _count(counter: Optional[CommCounter], kind: str, nbytes: int) -> None:
    if counter is not None:
        counter.add(kind, nbytes)


# torch >= 2.13 renamed the "*_into_tensor" / "*_tensor" collectives; use whichever exists.
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


# --- plain collectives (no autograd) ----------------------------------------------------------
def all_reduce(t: torch.Tensor, group, op=dist.ReduceOp.SUM, async_op: bool = False, counter=None):
    if group_size(group) == 1:
        return None
    _count(counter, "all_reduce", _nbytes(t))
    return dist.all_reduce(t, op=op, group=group, async_op=async_op)


def all_gather(out: torch.Tensor, inp: torch.Tensor, group, async_op: bool = False, counter=None):
    """Gather `inp` from every rank into `out` along dim 0 (out has group_size x inp rows)."""
    if group_size(group) == 1:
        out.copy_(inp)
        return None
    _count(counter, "all_gather", _nbytes(out))
    return _ALL_GATHER(out, inp.contiguous(), group=group, async_op=async_op)


def reduce_scatter(out: torch.Tensor, inp: torch.Tensor, group, async_op: bool = False, counter=None):
    """Sum `inp` over ranks and keep this rank's dim-0 slice in `out`."""
    if group_size(group) == 1:
        out.copy_(inp)
        return None
    _count(counter, "reduce_scatter", _nbytes(inp))
    return _REDUCE_SCATTER(out, inp.contiguous(), group=group, async_op=async_op)


def all_to_all(out: torch.Tensor, inp: torch.Tensor, group, out_splits=None, in_splits=None, counter=None):
    if group_size(group) == 1:
        out.copy_(inp)
        return None
    _count(counter, "all_to_all", _nbytes(inp))
    return dist.all_to_all_single(out, inp.contiguous(), out_splits, in_splits, group=group)


def record_p2p(t: torch.Tensor, counter=None) -> None:
    _count(counter, "p2p", _nbytes(t))


# --- helpers along an arbitrary dimension ---------------------------------------------------
def split_along(t: torch.Tensor, dim: int, group) -> torch.Tensor:
    n = group_size(group)
    if n == 1:
        return t
    size = t.shape[dim]
    assert size % n == 0, f"dimension {dim} of size {size} is not divisible by group size {n}"
    return t.narrow(dim, group_rank(group) * (size // n), size // n).contiguous()


def gather_along(t: torch.Tensor, dim: int, group, counter=None) -> torch.Tensor:
    n = group_size(group)
    if n == 1:
        return t
    moved = t.movedim(dim, 0).contiguous()
    out = torch.empty((n * moved.shape[0],) + tuple(moved.shape[1:]), dtype=t.dtype, device=t.device)
    all_gather(out, moved, group, counter=counter)
    return out.movedim(0, dim).contiguous()


def reduce_scatter_along(t: torch.Tensor, dim: int, group, counter=None) -> torch.Tensor:
    n = group_size(group)
    if n == 1:
        return t
    moved = t.movedim(dim, 0).contiguous()
    out = torch.empty((moved.shape[0] // n,) + tuple(moved.shape[1:]), dtype=t.dtype, device=t.device)
    reduce_scatter(out, moved, group, counter=counter)
    return out.movedim(0, dim).contiguous()


def reduced(t: torch.Tensor, group, counter=None) -> torch.Tensor:
    if group_size(group) == 1:
        return t
    t = t.clone()
    all_reduce(t, group, counter=counter)
    return t


# --- autograd regions -------------------------------------------------------------------------
# Each takes the group and the (optional) byte counter; backward uses the same pair.
class _CopyToRegion(torch.autograd.Function):
    """f: identity forward, all-reduce backward (input of a column-parallel layer)."""

    @staticmethod
    def forward(ctx, x, group, counter):
        ctx.group, ctx.counter = group, counter
        return x

    @staticmethod
    def backward(ctx, g):
        return reduced(g, ctx.group, ctx.counter), None, None


class _ReduceFromRegion(torch.autograd.Function):
    """g: all-reduce forward, identity backward (output of a row-parallel layer)."""

    @staticmethod
    def forward(ctx, x, group, counter):
        return reduced(x, group, counter)

    @staticmethod
    def backward(ctx, g):
        return g, None, None


class _ScatterToRegion(torch.autograd.Function):
    """Keep this rank's slice along `dim` forward; all-gather backward."""

    @staticmethod
    def forward(ctx, x, group, dim, counter):
        ctx.group, ctx.dim, ctx.counter = group, dim, counter
        return split_along(x, dim, group)

    @staticmethod
    def backward(ctx, g):
        return gather_along(g, ctx.dim, ctx.group, ctx.counter), None, None, None


class _GatherFromRegion(torch.autograd.Function):
    """All-gather along `dim` forward; backward keeps this rank's slice, or reduce-scatters
    when each rank's consumer produced a partial gradient of the whole (SP before a TP layer)."""

    @staticmethod
    def forward(ctx, x, group, dim, reduce_grad, counter):
        ctx.group, ctx.dim, ctx.reduce_grad, ctx.counter = group, dim, reduce_grad, counter
        return gather_along(x, dim, group, counter)

    @staticmethod
    def backward(ctx, g):
        if ctx.reduce_grad:
            return reduce_scatter_along(g, ctx.dim, ctx.group, ctx.counter), None, None, None, None
        return split_along(g, ctx.dim, ctx.group), None, None, None, None


class _ReduceScatterToRegion(torch.autograd.Function):
    """Reduce-scatter along `dim` forward (row-parallel output under SP); all-gather backward."""

    @staticmethod
    def forward(ctx, x, group, dim, counter):
        ctx.group, ctx.dim, ctx.counter = group, dim, counter
        return reduce_scatter_along(x, dim, group, counter)

    @staticmethod
    def backward(ctx, g):
        return gather_along(g, ctx.dim, ctx.group, ctx.counter), None, None, None


def copy_to_tp(x, group, counter=None):
    return x if group_size(group) == 1 else _CopyToRegion.apply(x, group, counter)


def reduce_from_tp(x, group, counter=None):
    return x if group_size(group) == 1 else _ReduceFromRegion.apply(x, group, counter)


def gather_from_tp(x, group, dim: int = -1, counter=None):
    return x if group_size(group) == 1 else _GatherFromRegion.apply(x, group, dim % x.dim(), False, counter)


def scatter_to_sp(x, group, counter=None):
    """[s, b, h] -> this rank's [s/tp, b, h]; gradient all-gathered."""
    return x if group_size(group) == 1 else _ScatterToRegion.apply(x, group, 0, counter)


def gather_from_sp(x, group, tensor_parallel_output_grad: bool = True, counter=None):
    """[s/tp, b, h] -> [s, b, h]. With tensor_parallel_output_grad the consumer is a TP layer whose
    gradient is partial on each rank, so the backward reduce-scatters; otherwise it splits."""
    if group_size(group) == 1:
        return x
    return _GatherFromRegion.apply(x, group, 0, tensor_parallel_output_grad, counter)


def reduce_scatter_to_sp(x, group, counter=None):
    return x if group_size(group) == 1 else _ReduceScatterToRegion.apply(x, group, 0, counter)
