"""Tensor-parallel layers: column/row-parallel linear, vocab-parallel embedding and cross entropy.

Each layer sets the `ShardSpec` (sharding.py) of the parameters it creates: how they are cut from
their full tensors ([Q | K | V] or [gate | up] segments split evenly over TP, replicated K/V
groups, padded vocabulary rows), which is all that initialization, checkpoints and conversion read.

Column-parallel GEMMs (`column_parallel_linear`: ColumnParallelLinear, attention's Q with K;V,
the output layer) own their TP input region, so that backward can all-reduce (SP:
reduce-scatter) the input gradient asynchronously while it computes the weight gradients.
Their arithmetic is the layer's GemmPath (gemm.py): precision recipe and zero-bubble deferral.
"""
from __future__ import annotations

from typing import List, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from .gemm import GemmPath, apply as gemm_apply
from .sharding import ShardSpec, replicated, set_spec, tp_split
from .state import ParallelDims, group_rank, group_size


# --- the GEMMs, through the GemmPath (gemm.py) -------------------------------------------------
class _LinearFn(torch.autograd.Function):
    """y = x W^T + b through `gemm`, which may defer the weight gradient."""

    @staticmethod
    def forward(ctx, x, weight, bias, gemm):
        ctx.save_for_backward(x, weight)
        ctx.gemm, ctx.call = gemm, gemm.new_call()
        # The parameters themselves, for deferred accumulation: under activation recomputation
        # the saved tensors come back as detached copies, and a gradient put on one is lost.
        ctx.weight, ctx.bias = weight, bias
        return gemm.forward(ctx.call, x, weight, bias)

    @staticmethod
    def backward(ctx, g):
        x, weight = ctx.saved_tensors
        gemm, need = ctx.gemm, ctx.needs_input_grad
        grad_x = gemm.input_grad(ctx.call, g, weight) if need[0] else None
        grad_w, grad_b = gemm.linear_grads(ctx.call, g, x, ctx.weight, ctx.bias, need[1],
                                           ctx.bias is not None and need[2])
        return grad_x, grad_w, grad_b, None


def linear(x, weight, bias=None, gemm: Optional[GemmPath] = None):
    """F.linear through `gemm` (default: a plain GemmPath). Autograd saves the parameter itself,
    not F.linear's view of its storage (weight.t()): under ZeRO-3 a layer's gathered weights are
    then freed after its forward and gathered again for its backward."""
    gemm = gemm if gemm is not None else GemmPath()
    return gemm_apply(_LinearFn, gemm, x, weight, bias, gemm)


class _ColumnParallelFn(torch.autograd.Function):
    """y_i = x A_i^T + b_i for column-parallel weights A_i over one input x, with the TP input
    region inside (the f of the Megatron-LM paper, or the SP all-gather / reduce-scatter).

    Forward: the GEMMs on x, or under SP on x all-gathered along the sequence (only the local
    shard is saved). Backward: under SP the all-gather of the shard again, started first; the
    input gradient sum_i g_i A_i; its all-reduce (SP: reduce-scatter) started asynchronously;
    the weight gradients computed while it runs (gloo and NCCL reduce on their own thread /
    stream); then the wait. Megatron-Core's
    LinearWithGradAccumulationAndAsyncCommunication does the same. While the GemmPath defers,
    the weight gradients are queued exactly as _LinearFn queues them and the collective is
    waited for at once: nothing is left to hide it behind."""

    @staticmethod
    def forward(ctx, x, dims, sequence_parallel, gemm, n, *params):
        weights, biases = params[:n], params[n:]
        group, comm = dims.tp_group, dims.comm
        total = comm.gather_along(x, 0, group) if sequence_parallel else x
        # Under SP only this rank's sequence shard is kept: backward gathers it again (as Megatron).
        ctx.save_for_backward(x if sequence_parallel else total, *weights)
        ctx.group, ctx.comm, ctx.sequence_parallel, ctx.gemm = group, comm, sequence_parallel, gemm
        ctx.input_shape = x.shape
        ctx.weights, ctx.biases = weights, biases  # the parameters themselves (see _LinearFn)
        ctx.calls = [gemm.new_call() for _ in weights]
        return tuple(gemm.forward(c, total, w, b) for c, w, b in zip(ctx.calls, weights, biases))

    @staticmethod
    def backward(ctx, *grads):
        saved, *weights = ctx.saved_tensors
        n, need, gemm, calls = len(weights), ctx.needs_input_grad, ctx.gemm, ctx.calls
        grad_x = handle = None
        total, gathering = saved, None
        if ctx.sequence_parallel:  # the input again, gathered behind the input-gradient GEMMs
            x = saved.contiguous()
            total = x.new_empty((x.shape[0] * group_size(ctx.group),) + tuple(x.shape[1:]))
            gathering = ctx.comm.all_gather(total, x, ctx.group, async_op=True)
        if need[0]:
            grad_total = gemm.input_grad(calls[0], grads[0], weights[0])
            for c, g, w in zip(calls[1:], grads[1:], weights[1:]):
                grad_total.add_(gemm.input_grad(c, g, w))
            if ctx.sequence_parallel:
                grad_x = grad_total.new_empty(ctx.input_shape)
                handle = ctx.comm.reduce_scatter(grad_x, grad_total, ctx.group, async_op=True)
            else:
                grad_x = grad_total
                handle = ctx.comm.all_reduce(grad_x, ctx.group, async_op=True)
        if gathering is not None:
            gathering.wait()
        param_grads = [None] * n
        for i in reversed(range(n)):  # deferred: the order in which separate layers' backwards queue them
            param_grads[i] = gemm.linear_grads(calls[i], grads[i], total, ctx.weights[i], ctx.biases[i],
                                               need[5 + i], need[5 + n + i])
        if handle is not None:
            handle.wait()
        return (grad_x, None, None, None, None, *(w for w, _ in param_grads), *(b for _, b in param_grads))


def column_parallel_linear(x: torch.Tensor, params, dims: ParallelDims, sequence_parallel: bool = False,
                           gemm: Optional[GemmPath] = None) -> tuple:
    """(x A_i^T + b_i for each (A_i, b_i) in params): column-parallel GEMMs over one input that
    enter the TP region once (x [s, b, in], or [s/tp, b, in] under SP, all-gathered). The input
    gradient is summed over the outputs and all-reduced (SP: reduce-scattered) once, overlapped
    with the weight-gradient GEMMs, which `gemm` may defer."""
    if dims.tp == 1:
        return tuple(linear(x, w, b, gemm) for w, b in params)
    gemm = gemm if gemm is not None else GemmPath()
    weights, biases = zip(*params)
    return gemm_apply(_ColumnParallelFn, gemm, x, dims, sequence_parallel, gemm, len(params), *weights, *biases)


# --- layers -----------------------------------------------------------------------------------
class ColumnParallelLinear(nn.Module):
    """Y = X A with A split by columns: each TP rank computes its slice of the output features.

    Under sequence parallelism the input arrives sharded along the sequence and is all-gathered
    here (the gradient is reduce-scattered back)."""

    def __init__(self, input_size: int, output_size: int, dims: ParallelDims, bias: bool = True,
                 gather_output: bool = False, sequence_parallel: bool = False,
                 segments: Optional[List[int]] = None, replicas: int = 1, dtype=torch.float32,
                 init: str = "normal", gemm: Optional[GemmPath] = None):
        super().__init__()
        split = tp_split(dims, 0, output_size, segments, replicas)
        self.dims, self.gather_output, self.sequence_parallel = dims, gather_output, sequence_parallel
        self.gemm = gemm if gemm is not None else GemmPath()
        self.weight = nn.Parameter(torch.empty(output_size // split.shards, input_size, dtype=dtype))
        set_spec(self.weight, ShardSpec((output_size, input_size), (split,), init=init))
        if bias:
            self.bias = nn.Parameter(torch.zeros(output_size // split.shards, dtype=dtype))
            set_spec(self.bias, ShardSpec((output_size,), (split,), init="zeros"))
        else:
            self.register_parameter("bias", None)

    def forward(self, x: Optional[torch.Tensor] = None):
        """x [s, b, in] ([s/tp, b, in] under SP) -> [s, b, out/tp] ([s, b, out] with gather_output).

        Called without an input, returns (weight, bias): that is how `shared_input` takes them,
        through the module call, so that the module's forward hooks (data-parallel parameter
        gathering with --overlap-param-gather) still run."""
        if x is None:
            return self.weight, self.bias
        y, = column_parallel_linear(x, [(self.weight, self.bias)], self.dims, self.sequence_parallel, self.gemm)
        return self.dims.comm.gather_from_tp(y, self.dims.tp_group) if self.gather_output else y

    @staticmethod
    def shared_input(x: torch.Tensor, *layers: "ColumnParallelLinear") -> tuple:
        """The outputs of several column-parallel layers over one input (Q and K;V of attention):
        one TP input region for all (one gradient all-reduce, or under SP one all-gather and
        one reduce-scatter), see `column_parallel_linear`."""
        first = layers[0]
        for layer in layers:
            assert (layer.dims is first.dims and layer.sequence_parallel == first.sequence_parallel
                    and layer.gemm is first.gemm and not layer.gather_output)
        return column_parallel_linear(x, [layer() for layer in layers], first.dims, first.sequence_parallel, first.gemm)


class RowParallelLinear(nn.Module):
    """Y = X A with A split by rows: input features arrive split across TP, partial outputs are
    summed (all-reduce, or reduce-scatter along the sequence under SP) and the bias added once."""

    def __init__(self, input_size: int, output_size: int, dims: ParallelDims, bias: bool = True,
                 sequence_parallel: bool = False, dtype=torch.float32, init: str = "normal_scaled",
                 gemm: Optional[GemmPath] = None):
        super().__init__()
        split = tp_split(dims, 1, input_size)
        self.dims, self.sequence_parallel = dims, sequence_parallel
        self.gemm = gemm if gemm is not None else GemmPath()
        self.weight = nn.Parameter(torch.empty(output_size, input_size // split.shards, dtype=dtype))
        set_spec(self.weight, ShardSpec((output_size, input_size), (split,), init=init))
        if bias:
            self.bias = nn.Parameter(torch.zeros(output_size, dtype=dtype))
            set_spec(self.bias, replicated((output_size,), sequence_parallel, init="zeros"))
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = linear(x, self.weight, None, self.gemm)
        group, comm = self.dims.tp_group, self.dims.comm
        y = comm.reduce_scatter_to_sp(y, group) if self.sequence_parallel else comm.reduce_from_tp(y, group)
        return y if self.bias is None else y + self.bias


def vocab_parallel_weight(padded_vocab_size: int, hidden_size: int, dims: ParallelDims, dtype,
                          vocab_size: Optional[int] = None):
    """(weight, first row) of this rank's slice of a [padded vocab, hidden] table split by rows;
    `vocab_size` true rows are stored (the padding rows are never trained or saved)."""
    split = tp_split(dims, 0, padded_vocab_size)
    weight = nn.Parameter(torch.empty(padded_vocab_size // split.shards, hidden_size, dtype=dtype))
    set_spec(weight, ShardSpec((padded_vocab_size, hidden_size), (split,), stored_rows=vocab_size))
    return weight, split.index * weight.shape[0]


class VocabParallelEmbedding(nn.Module):
    """Embedding table split by vocabulary rows across TP. Returns [s, b, h] partial sums that the
    caller reduces (all-reduce, or reduce-scatter along the sequence under SP)."""

    def __init__(self, padded_vocab_size: int, hidden_size: int, dims: ParallelDims, dtype=torch.float32,
                 vocab_size: Optional[int] = None):
        super().__init__()
        self.weight, self.vocab_start = vocab_parallel_weight(padded_vocab_size, hidden_size, dims, dtype, vocab_size)
        self.dims, self.per_rank = dims, self.weight.shape[0]

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
    """Two all-reduces per call: one MAX of [row max; target logit] (a rank that does not hold a
    token's target sends -inf, so the MAX is that logit, exactly) and one SUM of the exp sums.

    The subtraction of the max and the exponential are done in place in a buffer this function
    owns: an fp32 copy of the logits (other dtypes, or padded vocab columns to mask), or, with
    `inplace`, the caller's fp32 logits themselves, which then hold the softmax (and, after
    backward, the logits gradient). The buffer is saved for backward and consumed by it."""

    @staticmethod
    def forward(ctx, logits, target, group, vocab_start, vocab_size, ignore_index, comm, inplace):
        per_rank = logits.shape[-1]
        n_valid = max(0, min(per_rank, vocab_size - vocab_start))
        buf = logits.float()  # the logits themselves when they are fp32 already
        owned = inplace or buf is not logits
        if n_valid < per_rank:  # padded vocab rows never take probability mass
            if not owned:
                buf, owned = buf.clone(), True
            buf[..., n_valid:] = float("-inf")
        local_t = target - vocab_start
        ignored = target == ignore_index
        in_range = (local_t >= 0) & (local_t < per_rank) & ~ignored
        safe_t = local_t.masked_fill(~in_range, 0)
        # [max over this rank's columns; target logit or -inf], reduced by MAX in one call.
        stats = torch.stack([buf.max(dim=-1)[0],
                             buf.gather(-1, safe_t.unsqueeze(-1)).squeeze(-1).masked_fill(~in_range, float("-inf"))])
        comm.all_reduce(stats, group, op=dist.ReduceOp.MAX)
        logits_max, target_logit = stats[0], stats[1]
        exp = buf.sub_(logits_max.unsqueeze(-1)) if owned else buf - logits_max.unsqueeze(-1)
        exp.exp_()
        sum_exp = exp.sum(dim=-1)
        comm.all_reduce(sum_exp, group)
        # A target no rank holds a real column for (ignored, out of range) has no target logit.
        predicted = (target_logit - logits_max).masked_fill(target_logit == float("-inf"), 0.0)
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
        return grad, None, None, None, None, None, None, None


class _ChunkedVocabParallelCrossEntropy(torch.autograd.Function):
    """The same loss with only `chunk` tokens' fp32 logits at a time, forward and backward: the
    logits stay in their own dtype (bf16) and the softmax is recomputed per chunk in backward from
    the saved per-token max and sum of exp. Still two all-reduces per call: each chunk's local
    max and exp sum (taken at the local max) are kept; one MAX gives the global max and target
    logit, and the local sums, rescaled to the global max, go into one SUM."""

    @staticmethod
    def _chunks(logits, chunk):
        flat = logits.view(-1, logits.shape[-1])
        for lo in range(0, flat.shape[0], chunk):
            yield slice(lo, lo + chunk), flat[lo:lo + chunk]

    @staticmethod
    def _fp32(rows, n_valid):
        c = rows.float()  # a copy for bf16/fp16 rows, the rows themselves when fp32
        if c is rows:  # (not data_ptr(): a fake tensor, as in tools/fake_cuda_dry_run.py, has none)
            c = c.clone()
        if n_valid < c.shape[-1]:  # padded vocab rows never take probability mass
            c[:, n_valid:] = float("-inf")
        return c

    @staticmethod
    def forward(ctx, logits, target, group, vocab_start, vocab_size, ignore_index, comm, inplace, chunk):
        per_rank = logits.shape[-1]
        n_valid = max(0, min(per_rank, vocab_size - vocab_start))
        flat_t = target.reshape(-1)
        ignored = flat_t == ignore_index
        local_t = flat_t - vocab_start
        in_range = (local_t >= 0) & (local_t < per_rank) & ~ignored
        safe_t = local_t.masked_fill(~in_range, 0)
        n = flat_t.numel()
        stats = torch.empty(2, n, dtype=torch.float32, device=logits.device)  # [local max; target logit]
        local_sum = torch.empty(n, dtype=torch.float32, device=logits.device)
        shift = torch.empty(n, dtype=torch.float32, device=logits.device)  # where each local sum was taken
        for rows, x in _ChunkedVocabParallelCrossEntropy._chunks(logits, chunk):
            c = _ChunkedVocabParallelCrossEntropy._fp32(x, n_valid)
            m = c.max(dim=-1)[0]
            stats[0, rows] = m
            stats[1, rows] = c.gather(-1, safe_t[rows].unsqueeze(-1)).squeeze(-1)
            padding_only = m == float("-inf")  # this rank holds no real column: its sum is 0
            m = m.masked_fill_(padding_only, 0.0)
            local_sum[rows] = c.sub_(m.unsqueeze(-1)).exp_().sum(dim=-1)
            shift[rows] = m.masked_fill_(padding_only, float("-inf"))  # its rescale is exp(-inf) = 0
        stats[1].masked_fill_(~in_range, float("-inf"))
        comm.all_reduce(stats, group, op=dist.ReduceOp.MAX)
        logits_max, target_logit = stats[0], stats[1]
        sum_exp = local_sum.mul_(shift.sub_(logits_max).exp_())
        comm.all_reduce(sum_exp, group)
        predicted = (target_logit - logits_max).masked_fill(target_logit == float("-inf"), 0.0)
        loss = (sum_exp.log() - predicted).masked_fill(ignored, 0.0)
        ctx.save_for_backward(logits, logits_max, sum_exp, safe_t, in_range, ignored)
        ctx.n_valid, ctx.inplace, ctx.chunk = n_valid, inplace, chunk
        return loss.view_as(target)

    @staticmethod
    def backward(ctx, g):
        logits, logits_max, sum_exp, safe_t, in_range, ignored = ctx.saved_tensors
        # The caller gave up its logits (inplace): the gradient overwrites them chunk by chunk.
        grad = logits if ctx.inplace else torch.empty_like(logits)
        grad_flat = grad.view(-1, grad.shape[-1])
        scale = g.reshape(-1).float() * (~ignored).float()
        for rows, x in _ChunkedVocabParallelCrossEntropy._chunks(logits, ctx.chunk):
            c = _ChunkedVocabParallelCrossEntropy._fp32(x, ctx.n_valid)
            c.sub_(logits_max[rows].unsqueeze(-1)).exp_().div_(sum_exp[rows].unsqueeze(-1))
            c.scatter_add_(-1, safe_t[rows].unsqueeze(-1), -in_range[rows].unsqueeze(-1).float())
            grad_flat[rows] = c.mul_(scale[rows].unsqueeze(-1))
        return grad, None, None, None, None, None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, dims: ParallelDims,
                                 vocab_size: int, ignore_index: int = -100, inplace: bool = False,
                                 chunk_tokens: int = 0) -> torch.Tensor:
    """Per-token loss (fp32, shaped like target) from logits split over the vocab across TP.

    Full logits never exist on one rank. `vocab_size` is the true vocab: padded columns are
    masked out. Targets equal to `ignore_index` get zero loss and zero gradient.

    `inplace`: the caller gives up `logits` (nothing else reads them, and no autograd node saved
    them: a linear layer saves its input and weight, not its output), so fp32 logits are
    overwritten instead of copied. Without it the caller's logits are left untouched and one
    fp32 copy is made (or none is needed: other dtypes are converted into one anyway).

    `chunk_tokens` > 0: never more than that many tokens' fp32 logits at once (for bf16 logits the
    unchunked path holds an fp32 softmax of the whole micro-batch until backward); the softmax is
    recomputed per chunk in backward."""
    group = dims.tp_group
    vocab_start = group_rank(group) * logits.shape[-1]
    if 0 < chunk_tokens < target.numel() or (chunk_tokens > 0 and logits.dtype != torch.float32):
        return _ChunkedVocabParallelCrossEntropy.apply(logits.contiguous(), target, group, vocab_start, vocab_size,
                                                       ignore_index, dims.comm, inplace, chunk_tokens)
    return _VocabParallelCrossEntropy.apply(logits, target, group, vocab_start, vocab_size, ignore_index,
                                            dims.comm, inplace)
