"""Tensor-parallel layers: column/row-parallel linear, vocab-parallel embedding and cross entropy.

Every sharded parameter carries metadata describing how it is cut from its full tensor:
`partition_dim` and `tp_segments` (the full tensor is a concatenation of segments along
`partition_dim`, e.g. [Q | K | V] or [gate | up]; each segment is split evenly across TP ranks
and a rank holds its piece of every segment). `shard_tensor` / `unshard_tensors` use it, so
initialization, checkpoints, conversion and tests agree on one definition of the full weight.
"""
from __future__ import annotations

from typing import List, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from . import comm
from .state import ParallelDims, group_rank, group_size


# --- sharding metadata ------------------------------------------------------------------------
def set_tp_meta(param: nn.Parameter, partition_dim: int, full_shape: Sequence[int],
                segments: Optional[List[int]] = None, replicas: int = 1) -> None:
    """Mark `param` as cut along `partition_dim` into tp / replicas shards; `replicas` consecutive
    TP ranks hold the same shard (grouped-query K/V when there are fewer groups than TP ranks)."""
    param.tensor_model_parallel = True
    param.partition_dim = partition_dim
    param.full_shape = tuple(full_shape)
    param.tp_segments = list(segments) if segments else [full_shape[partition_dim]]
    param.tp_replicas = replicas


def set_replicated_meta(param: nn.Parameter, sequence_parallel: bool = False) -> None:
    """A parameter every TP rank holds whole. Under SP its gradient is partial (each rank saw
    only its sequence slice) and must be summed over TP."""
    param.tensor_model_parallel = False
    param.full_shape = tuple(param.shape)
    param.sequence_parallel = sequence_parallel


def shard_tensor(full: torch.Tensor, param: nn.Parameter, tp_rank: int, tp: int) -> torch.Tensor:
    """This TP rank's piece of `full` according to `param`'s metadata."""
    if not getattr(param, "tensor_model_parallel", False) or tp == 1:
        return full
    dim, replicas = param.partition_dim, getattr(param, "tp_replicas", 1)
    shards, index = tp // replicas, tp_rank // replicas
    pieces = []
    for seg in full.split(param.tp_segments, dim=dim):
        n = seg.shape[dim] // shards
        pieces.append(seg.narrow(dim, index * n, n))
    return torch.cat(pieces, dim=dim)


def unshard_tensors(shards: List[torch.Tensor], param: nn.Parameter) -> torch.Tensor:
    """Inverse of shard_tensor: the full tensor from every TP rank's piece, in rank order."""
    if not getattr(param, "tensor_model_parallel", False) or len(shards) == 1:
        return shards[0]
    shards = shards[:: getattr(param, "tp_replicas", 1)]  # one copy of each distinct shard
    dim, tp = param.partition_dim, len(shards)
    local_segments = [s // tp for s in param.tp_segments]
    per_rank = [s.split(local_segments, dim=dim) for s in shards]
    segs = [torch.cat([per_rank[r][i] for r in range(tp)], dim=dim) for i in range(len(local_segments))]
    return torch.cat(segs, dim=dim)


def gather_full_param(t: torch.Tensor, param: nn.Parameter, dims: ParallelDims) -> torch.Tensor:
    """All-gather a TP-sharded tensor shaped like `param` into its full tensor (collective over TP).

    Vocabulary padding (which depends on TP) is dropped: the result is layout-independent."""
    tp = group_size(dims.tp_group)
    if not getattr(param, "tensor_model_parallel", False) or tp == 1:
        return trim_vocab_padding(t.detach().clone(), param)
    moved = t.detach().movedim(param.partition_dim, 0).contiguous()
    out = torch.empty((tp * moved.shape[0],) + tuple(moved.shape[1:]), dtype=t.dtype, device=t.device)
    comm.all_gather(out, moved, dims.tp_group)
    shards = [s.movedim(0, param.partition_dim) for s in out.chunk(tp, dim=0)]
    return trim_vocab_padding(unshard_tensors(shards, param), param)


def trim_vocab_padding(full: torch.Tensor, param: nn.Parameter) -> torch.Tensor:
    rows = getattr(param, "vocab_rows", None)
    return full if rows is None else full[:rows]


def pad_vocab(full: torch.Tensor, param: nn.Parameter) -> torch.Tensor:
    """Inverse of trim_vocab_padding: zero rows up to the padded vocab this layout uses."""
    missing = param.full_shape[0] - full.shape[0]
    return full if missing <= 0 else torch.cat([full, full.new_zeros((missing,) + tuple(full.shape[1:]))])


# --- weight-gradient deferral (zero-bubble pipeline schedules) --------------------------------
def accumulate_grad(param: nn.Parameter, grad: torch.Tensor) -> None:
    """Add `grad` to param.grad outside autograd and tell the grad-sync machinery, if any."""
    if param.grad is None:
        param.grad = grad.to(param.dtype)
    else:
        param.grad.add_(grad)
    hook = getattr(param, "grad_ready_hook", None)
    if hook is not None:
        hook(param)


class WeightGradStore:
    """While `deferring`, linear layers compute only input gradients in backward and queue the
    weight-gradient GEMMs here; `flush()` runs them later (the W pass of zero-bubble schedules)."""

    def __init__(self):
        self.deferring = False
        self.queue: list = []

    def take(self) -> list:
        """The weight-gradient work queued so far (for one B pass), emptying the queue."""
        queue, self.queue = self.queue, []
        return queue

    @staticmethod
    def run(queue: list) -> None:
        for x, g, weight, bias in queue:
            _weight_grads(x, g, weight, bias)

    def flush(self) -> None:
        """Run every queued weight-gradient pass now."""
        self.run(self.take())


WEIGHT_GRAD_STORE = WeightGradStore()


@torch.no_grad()
def _weight_grads(x, g, weight, bias):
    g2 = g.reshape(-1, g.shape[-1])
    x2 = x.reshape(-1, x.shape[-1])
    if weight.requires_grad:
        accumulate_grad(weight, g2.t().matmul(x2))
    if bias is not None and bias.requires_grad:
        accumulate_grad(bias, g2.sum(0))


class _LinearFn(torch.autograd.Function):
    """y = x W^T + b, whose weight gradient may be deferred to WEIGHT_GRAD_STORE."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        # The parameters themselves, for deferred accumulation: under activation recomputation
        # the saved tensors come back as detached copies, and a gradient put on one is lost.
        ctx.weight, ctx.bias = weight, bias
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, g):
        x, weight = ctx.saved_tensors
        grad_x = g.matmul(weight) if ctx.needs_input_grad[0] else None
        if WEIGHT_GRAD_STORE.deferring:
            WEIGHT_GRAD_STORE.queue.append((x, g, ctx.weight, ctx.bias))
            return grad_x, None, None
        g2 = g.reshape(-1, g.shape[-1])
        grad_w = g2.t().matmul(x.reshape(-1, x.shape[-1])) if ctx.needs_input_grad[1] else None
        grad_b = g2.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, grad_w, grad_b


def linear(x, weight, bias=None):
    return _LinearFn.apply(x, weight, bias)


# --- layers -----------------------------------------------------------------------------------
def enter_tp_region(x: torch.Tensor, dims: ParallelDims, sequence_parallel: bool) -> torch.Tensor:
    """Input of column-parallel layers: all-gather the sequence (SP) or mark for grad all-reduce."""
    if sequence_parallel:
        return comm.gather_from_sp(x, dims.tp_group)
    return comm.copy_to_tp(x, dims.tp_group)


class ColumnParallelLinear(nn.Module):
    """Y = X A with A split by columns: each TP rank computes its slice of the output features.

    Under sequence parallelism the input arrives sharded along the sequence and is all-gathered
    here (the gradient is reduce-scattered back)."""

    def __init__(self, input_size: int, output_size: int, dims: ParallelDims, bias: bool = True,
                 gather_output: bool = False, sequence_parallel: bool = False,
                 segments: Optional[List[int]] = None, replicas: int = 1, dtype=torch.float32):
        super().__init__()
        shards = dims.tp // replicas
        segments = segments or [output_size]
        for s in segments:
            assert s % shards == 0, f"output segment {s} not divisible into {shards} tensor-parallel shards"
        self.dims, self.gather_output, self.sequence_parallel = dims, gather_output, sequence_parallel
        self.weight = nn.Parameter(torch.empty(output_size // shards, input_size, dtype=dtype))
        set_tp_meta(self.weight, 0, (output_size, input_size), segments, replicas)
        if bias:
            self.bias = nn.Parameter(torch.zeros(output_size // shards, dtype=dtype))
            set_tp_meta(self.bias, 0, (output_size,), segments, replicas)
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor, input_ready: bool = False) -> torch.Tensor:
        """input_ready: the caller already entered the TP region (shared by several layers)."""
        if not input_ready:
            x = enter_tp_region(x, self.dims, self.sequence_parallel)
        y = linear(x, self.weight, self.bias)
        return comm.gather_from_tp(y, self.dims.tp_group) if self.gather_output else y


class RowParallelLinear(nn.Module):
    """Y = X A with A split by rows: input features arrive split across TP, partial outputs are
    summed (all-reduce, or reduce-scatter along the sequence under SP) and the bias added once."""

    def __init__(self, input_size: int, output_size: int, dims: ParallelDims, bias: bool = True,
                 sequence_parallel: bool = False, dtype=torch.float32):
        super().__init__()
        tp = dims.tp
        assert input_size % tp == 0, f"input size {input_size} not divisible by tensor_model_parallel_size {tp}"
        self.dims, self.sequence_parallel = dims, sequence_parallel
        self.weight = nn.Parameter(torch.empty(output_size, input_size // tp, dtype=dtype))
        set_tp_meta(self.weight, 1, (output_size, input_size))
        if bias:
            self.bias = nn.Parameter(torch.zeros(output_size, dtype=dtype))
            set_replicated_meta(self.bias, sequence_parallel)
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = linear(x, self.weight)
        group = self.dims.tp_group
        y = comm.reduce_scatter_to_sp(y, group) if self.sequence_parallel else comm.reduce_from_tp(y, group)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Embedding table split by vocabulary rows across TP. Returns [s, b, h] partial sums that the
    caller reduces (all-reduce, or reduce-scatter along the sequence under SP)."""

    def __init__(self, padded_vocab_size: int, hidden_size: int, dims: ParallelDims, dtype=torch.float32):
        super().__init__()
        tp = dims.tp
        assert padded_vocab_size % tp == 0
        self.dims = dims
        self.per_rank = padded_vocab_size // tp
        self.vocab_start = dims.tp_rank * self.per_rank
        self.weight = nn.Parameter(torch.empty(self.per_rank, hidden_size, dtype=dtype))
        set_tp_meta(self.weight, 0, (padded_vocab_size, hidden_size))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [b, s] -> partial embeddings [s, b, h] (exact on a single TP rank)."""
        ids = ids.t()
        if self.dims.tp == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.per_rank)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return out.masked_fill(outside.unsqueeze(-1), 0.0)


# --- vocab-parallel cross entropy -------------------------------------------------------------
class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, group, vocab_start, vocab_size, ignore_index):
        logits = logits.float()
        per_rank = logits.shape[-1]
        n_valid = max(0, min(per_rank, vocab_size - vocab_start))
        if n_valid < per_rank:  # padded vocab rows never take probability mass
            logits = logits.clone()
            logits[..., n_valid:] = float("-inf")
        logits_max = logits.max(dim=-1)[0]
        comm.all_reduce(logits_max, group, op=dist.ReduceOp.MAX)
        shifted = logits - logits_max.unsqueeze(-1)
        local_t = target - vocab_start
        ignored = target == ignore_index
        in_range = (local_t >= 0) & (local_t < per_rank) & ~ignored
        safe_t = local_t.masked_fill(~in_range, 0)
        predicted = shifted.gather(-1, safe_t.unsqueeze(-1)).squeeze(-1).masked_fill(~in_range, 0.0)
        comm.all_reduce(predicted, group)
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        comm.all_reduce(sum_exp, group)
        loss = (sum_exp.log() - predicted).masked_fill(ignored, 0.0)
        exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(exp, safe_t, in_range, ignored)
        return loss

    @staticmethod
    def backward(ctx, g):
        softmax, safe_t, in_range, ignored = ctx.saved_tensors
        grad = softmax
        grad.scatter_add_(-1, safe_t.unsqueeze(-1), -in_range.unsqueeze(-1).to(grad.dtype))
        grad.mul_((g * (~ignored).to(g.dtype)).unsqueeze(-1))
        return grad, None, None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, dims: ParallelDims,
                                 vocab_size: int, ignore_index: int = -100) -> torch.Tensor:
    """Per-token loss (fp32, shaped like target) from logits split over the vocab across TP.

    Full logits never exist on one rank. `vocab_size` is the true vocab: padded columns are
    masked out. Targets equal to `ignore_index` get zero loss and zero gradient."""
    group = dims.tp_group
    vocab_start = group_rank(group) * logits.shape[-1]
    return _VocabParallelCrossEntropy.apply(logits, target, group, vocab_start, vocab_size, ignore_index)
