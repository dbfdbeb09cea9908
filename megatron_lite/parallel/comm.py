"""Collectives, with byte accounting, and the autograd-aware TP/SP regions built on them.

All communication in megatron-lite goes through a `Communicator`: `ParallelDims` owns one
(`dims.comm`), so that `--log-comm-volume` can count every byte in one place. It adds to its
`counter` (a `CommCounter`, set through `dims.comm_counter`; None counts nothing) the size of the
full logical buffer on this rank: the unsharded tensor for reduce-scatter and all-gather.

The autograd regions implement Megatron's four TP regions (f/g of the Megatron-LM paper) and
their sequence-parallel counterparts; they keep the communicator, so backward counts into the
same counter. Activations are laid out [s, b, h]: the sequence dimension is dim 0, so
sequence-parallel gathers and scatters are contiguous.

A collective that fails because a peer died or did not answer in time (gloo / NCCL report it as
a `DistError`, or a RuntimeError from gloo's sources) is raised as a `CollectiveError` naming the
operation and the group (launch.py turns it into one line), from the call or from an async
handle's wait(). The communicator also adds up the seconds this rank spent blocked in
collectives (`blocked_s`), so that a straggler report can tell a rank's own work from waiting.
"""
from __future__ import annotations

import time
from collections import defaultdict
from typing import Callable, Dict, List, Optional

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


def is_peer_failure(error: BaseException) -> bool:
    """A collective's error that means a peer died or did not answer in time."""
    return isinstance(error, (dist.DistError, CollectiveError)) or (isinstance(error, RuntimeError)
                                                                   and "/gloo/" in str(error))


class CollectiveError(RuntimeError):
    """A collective that failed because a peer died or did not answer in time: the operation, the
    name of its group (ParallelDims' name: "tp", "dp_cp", ...), the group's global ranks, and when
    this rank entered it (issued it, for an async one) and saw it fail."""

    def __init__(self, op: str, group_name: str, ranks: List[int], cause: BaseException, entered: float):
        self.op, self.group_name, self.ranks = op, group_name, ranks
        self.entered, self.failed = entered, time.time()  # wall clock: compared with the peers' reports
        # gloo's / NCCL's own first sentence, without its "[file:line]" prefix
        first = str(cause).strip().splitlines()[0] if str(cause).strip() else type(cause).__name__
        self.reason = first.split("] ", 1)[-1] if first.startswith("[") else first
        self.reason = self.reason.split(". ")[0]
        super().__init__(f"{op} over the {group_name} group (ranks {_ranges(ranks)}) failed: {self.reason}")


def _ranges(ranks: List[int]) -> str:
    """[0, 1, 2, 5] -> "0-2, 5"."""
    out, start = [], None
    for i, r in enumerate(ranks):
        if start is None:
            start = r
        if i + 1 == len(ranks) or ranks[i + 1] != r + 1:
            out.append(str(start) if start == r else f"{start}-{r}")
            start = None
    return ", ".join(out)


class _WatchedWork:
    """An async collective's handle whose wait() counts the time blocked and names a failure."""

    def __init__(self, work, comm: "Communicator", op: str, group, entered: float, ranks: Optional[List[int]]):
        self._work, self._comm, self._op, self._group = work, comm, op, group
        self._entered, self._ranks = entered, ranks

    def wait(self, *args, **kwargs):
        return self._comm._run(self._op, self._group, lambda: self._work.wait(*args, **kwargs), entered=self._entered,
                               ranks=self._ranks)

    def __getattr__(self, name):  # is_completed, get_future, ...
        return getattr(self._work, name)


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
        self.group_names: Dict[int, str] = {}  # id(group) -> its name in ParallelDims (error lines)
        self.blocked_s = 0.0  # seconds spent in blocking collectives and in waits on async ones
        self.interleaver = None  # parallel/overlap.py's Interleaver while an overlapped pair runs

    def _count(self, kind: str, t: torch.Tensor) -> None:
        if self.counter is not None:
            self.counter.add(kind, t.numel() * t.element_size())

    def name_group(self, group, name: str) -> None:
        if group is not None:
            self.group_names[id(group)] = name

    def _run(self, op: str, group, call: Callable, async_op: bool = False, entered: Optional[float] = None,
             ranks: Optional[List[int]] = None):
        """call() (a torch.distributed collective or a wait), timed; a peer's failure named, with
        `ranks` (default: the group's) as the ranks that had to answer."""
        start, entered = time.perf_counter(), time.time() if entered is None else entered
        try:
            work = call()
        except RuntimeError as e:
            if not is_peer_failure(e):
                raise
            ranks = ranks or dist.get_process_group_ranks(group or dist.group.WORLD)
            raise CollectiveError(op, self.group_names.get(id(group), "world" if group is None else "unnamed"),
                                  ranks, e, entered) from e
        finally:
            self.blocked_s += time.perf_counter() - start
        if async_op and isinstance(work, list):  # batch_isend_irecv's works
            return [_WatchedWork(w, self, op, group, entered, ranks) for w in work]
        return _WatchedWork(work, self, op, group, entered, ranks) if async_op and work is not None else work

    # --- plain collectives (no autograd) ----------------------------------------------------
    def all_reduce(self, t: torch.Tensor, group, op=dist.ReduceOp.SUM, async_op: bool = False):
        if group_size(group) == 1:
            return None
        self._count("all_reduce", t)
        return self._run("all_reduce", group, lambda: dist.all_reduce(t, op=op, group=group, async_op=async_op),
                         async_op)

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, group, async_op: bool = False,
                   kind: str = "all_gather"):
        """Gather `inp` from every rank into `out` along dim 0 (out has group_size x inp rows).
        `kind`: the counter's name for it (ZeRO++'s intra-node gathers count apart)."""
        if group_size(group) == 1:
            out.copy_(inp)
            return None
        self._count(kind, out)
        return self._run("all_gather", group, lambda: _ALL_GATHER(out, inp.contiguous(), group=group,
                                                                  async_op=async_op), async_op)

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, group, async_op: bool = False):
        """Sum `inp` over ranks and keep this rank's dim-0 slice in `out`."""
        if group_size(group) == 1:
            out.copy_(inp)
            return None
        self._count("reduce_scatter", inp)
        return self._run("reduce_scatter", group, lambda: _REDUCE_SCATTER(out, inp.contiguous(), group=group,
                                                                          async_op=async_op), async_op)

    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor, group, out_splits=None, in_splits=None,
                   async_op: bool = False, kind: str = "all_to_all"):
        """`kind`: the counter's name for it (two-hop qgZ's intra- and inter-node hops count apart)."""
        if group_size(group) == 1:
            out.copy_(inp)
            return None
        self._count(kind, inp)
        return self._run("all_to_all", group, lambda: dist.all_to_all_single(
            out, inp.contiguous(), out_splits, in_splits, group=group, async_op=async_op), async_op)

    def wait_overlapped(self, work) -> None:
        """Wait for an asynchronous collective; inside an overlapped pair (`self.interleaver`, set
        by the pipeline executor around DualPipe-V's pairs) first let the other computation run."""
        if work is None:
            return
        if self.interleaver is not None and self.interleaver.switch():
            self.interleaver.record_wait()
        work.wait()

    def record_p2p(self, t: torch.Tensor) -> None:
        """Count a point-to-point send (posted by the caller: batched with its receives)."""
        self._count("p2p", t)

    def batch_p2p(self, ops: List["dist.P2POp"], group) -> list:
        """Post sends and receives (dist.P2POp, global peer ranks) together; their works' waits are
        timed, and a failure names `group` and this rank with its peers."""
        if not ops:
            return []
        ranks = sorted({dist.get_rank()} | {op.peer for op in ops})
        return self._run("send/recv", group, lambda: dist.batch_isend_irecv(ops), async_op=True, ranks=ranks)

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
