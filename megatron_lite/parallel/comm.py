"""Collectives, with byte accounting, and the autograd-aware TP/SP regions built on them.

All communication in megatron-lite goes through a `Communicator`: `ParallelDims` owns one
(`dims.comm`), so that `--log-comm-volume` can count every byte in one place. It adds to its
`counter` (a `CommCounter`, set through `dims.comm_counter`; None counts nothing) the size of the
full logical buffer on this rank: the unsharded tensor for reduce-scatter and all-gather.

The autograd regions implement Megatron's four TP regions (f/g of the Megatron-LM paper) and
their sequence-parallel counterparts; they keep the communicator, so backward counts into the
same counter. Activations are laid out [s, b, h]: the sequence dimension is dim 0, so
sequence-parallel gathers and scatters are contiguous.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Dict, Optional

import torch
import torch.distributed as dist


def group_size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group) -> int:
    return 0 if group is None else dist.get_rank(group)


class CommCounter:
    """Bytes moved per collective kind. Owned by whoever measures (the trainer with
    --log-comm-volume) and given to the communicator through `ParallelDims.comm_counter`."""

    def __init__(self):
        self.bytes: Dict[str, int] = defaultdict(int)

    def add(self, kind: str, nbytes: int) -> None:
        self.bytes[kind] += int(nbytes)

    def reset(self) -> Dict[str, int]:
        out = dict(self.bytes)
        self.bytes = defaultdict(int)
        return out


# torch >= 2.13 renamed the "*_into_tensor" / "*_tensor" collectives; use whichever exists.
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def split_along(t: torch.Tensor, dim: int, group) -> torch.Tensor:
    """This rank's 1/n slice of `t` along `dim` (moves no bytes)."""
    n = group_size(group)
    if n == 1:
        return t
    size = t.shape[dim]
    assert size % n == 0, f"dimension {dim} of size {size} is not divisible by group size {n}"
    return t.narrow(dim, group_rank(group) * (size // n), size // n).contiguous()


class Communicator:
    """The collectives of one layout. A group of None (or of one rank) moves and counts nothing."""

    def __init__(self, counter: Optional[CommCounter] = None):
        self.counter = counter

    def _count(self, kind: str, t: torch.Tensor) -> None:
        if self.counter is not None:
            self.counter.add(kind, t.numel() * t.element_size())

    # --- plain collectives (no autograd) ----------------------------------------------------
    def all_reduce(self, t: torch.Tensor, group, op=dist.ReduceOp.SUM, async_op: bool = False):
        if group_size(group) == 1:
            return None
        self._count("all_reduce", t)
        return dist.all_reduce(t, op=op, group=group, async_op=async_op)

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, group, async_op: bool = False):
        """Gather `inp` from every rank into `out` along dim 0 (out has group_size x inp rows)."""
        if group_size(group) == 1:
            out.copy_(inp)
            return None
        self._count("all_gather", out)
        return _ALL_GATHER(out, inp.contiguous(), group=group, async_op=async_op)

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, group, async_op: bool = False):
        """Sum `inp` over ranks and keep this rank's dim-0 slice in `out`."""
        if group_size(group) == 1:
            out.copy_(inp)
            return None
        self._count("reduce_scatter", inp)
        return _REDUCE_SCATTER(out, inp.contiguous(), group=group, async_op=async_op)

    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor, group, out_splits=None, in_splits=None):
        if group_size(group) == 1:
            out.copy_(inp)
            return None
        self._count("all_to_all", inp)
        return dist.all_to_all_single(out, inp.contiguous(), out_splits, in_splits, group=group)

    def record_p2p(self, t: torch.Tensor) -> None:
        """Count a point-to-point send (posted by the caller: batched with its receives)."""
        self._count("p2p", t)

    def gather_along(self, t: torch.Tensor, dim: int, group) -> torch.Tensor:
        n = group_size(group)
        if n == 1:
            return t
        moved = t.movedim(dim, 0).contiguous()
        out = torch.empty((n * moved.shape[0],) + tuple(moved.shape[1:]), dtype=t.dtype, device=t.device)
        self.all_gather(out, moved, group)
        return out.movedim(0, dim).contiguous()

    def reduce_scatter_along(self, t: torch.Tensor, dim: int, group) -> torch.Tensor:
        n = group_size(group)
        if n == 1:
            return t
        moved = t.movedim(dim, 0).contiguous()
        out = torch.empty((moved.shape[0] // n,) + tuple(moved.shape[1:]), dtype=t.dtype, device=t.device)
        self.reduce_scatter(out, moved, group)
        return out.movedim(0, dim).contiguous()

    def reduced(self, t: torch.Tensor, group) -> torch.Tensor:
        if group_size(group) == 1:
            return t
        t = t.clone()
        self.all_reduce(t, group)
        return t

    # --- autograd regions -------------------------------------------------------------------
    def copy_to_tp(self, x, group):
        return x if group_size(group) == 1 else _CopyToRegion.apply(x, group, self)

    def reduce_from_tp(self, x, group):
        return x if group_size(group) == 1 else _ReduceFromRegion.apply(x, group, self)

    def gather_from_tp(self, x, group, dim: int = -1):
        return x if group_size(group) == 1 else _GatherFromRegion.apply(x, group, dim % x.dim(), False, self)

    def scatter_to_sp(self, x, group):
        """[s, b, h] -> this rank's [s/tp, b, h]; gradient all-gathered."""
        return x if group_size(group) == 1 else _ScatterToRegion.apply(x, group, 0, self)

    def gather_from_sp(self, x, group, tensor_parallel_output_grad: bool = True):
        """[s/tp, b, h] -> [s, b, h]. With tensor_parallel_output_grad the consumer is a TP layer whose
        gradient is partial on each rank, so the backward reduce-scatters; otherwise it splits."""
        if group_size(group) == 1:
            return x
        return _GatherFromRegion.apply(x, group, 0, tensor_parallel_output_grad, self)

    def reduce_scatter_to_sp(self, x, group):
        return x if group_size(group) == 1 else _ReduceScatterToRegion.apply(x, group, 0, self)


# Each region takes the group and the communicator; backward uses the same pair.
class _CopyToRegion(torch.autograd.Function):
    """f: identity forward, all-reduce backward (input of a column-parallel layer)."""

    @staticmethod
    def forward(ctx, x, group, comm):
        ctx.group, ctx.comm = group, comm
        return x

    @staticmethod
    def backward(ctx, g):
        return ctx.comm.reduced(g, ctx.group), None, None


class _ReduceFromRegion(torch.autograd.Function):
    """g: all-reduce forward, identity backward (output of a row-parallel layer)."""

    @staticmethod
    def forward(ctx, x, group, comm):
        return comm.reduced(x, group)

    @staticmethod
    def backward(ctx, g):
        return g, None, None


class _ScatterToRegion(torch.autograd.Function):
    """Keep this rank's slice along `dim` forward; all-gather backward."""

    @staticmethod
    def forward(ctx, x, group, dim, comm):
        ctx.group, ctx.dim, ctx.comm = group, dim, comm
        return split_along(x, dim, group)

    @staticmethod
    def backward(ctx, g):
        return ctx.comm.gather_along(g, ctx.dim, ctx.group), None, None, None


class _GatherFromRegion(torch.autograd.Function):
    """All-gather along `dim` forward; backward keeps this rank's slice, or reduce-scatters
    when each rank's consumer produced a partial gradient of the whole (SP before a TP layer)."""

    @staticmethod
    def forward(ctx, x, group, dim, reduce_grad, comm):
        ctx.group, ctx.dim, ctx.reduce_grad, ctx.comm = group, dim, reduce_grad, comm
        return comm.gather_along(x, dim, group)

    @staticmethod
    def backward(ctx, g):
        if ctx.reduce_grad:
            return ctx.comm.reduce_scatter_along(g, ctx.dim, ctx.group), None, None, None, None
        return split_along(g, ctx.dim, ctx.group), None, None, None, None


class _ReduceScatterToRegion(torch.autograd.Function):
    """Reduce-scatter along `dim` forward (row-parallel output under SP); all-gather backward."""

    @staticmethod
    def forward(ctx, x, group, dim, comm):
        ctx.group, ctx.dim, ctx.comm = group, dim, comm
        return comm.reduce_scatter_along(x, dim, group)

    @staticmethod
    def backward(ctx, g):
        return ctx.comm.gather_along(g, ctx.dim, ctx.group), None, None, None
