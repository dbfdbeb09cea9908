"""Token dispatchers: send each routed token to the ranks holding its experts, and back.

Both take this rank's tokens [T, h] with a `Routing` (dense probs [T, E] and a bool map), hand
the local experts their tokens sorted by local expert, and after the experts ran return [T, h]:
sum over a token's experts of weight * expert output (the weighting happens here, in the
router's dtype, on the rank that routed the token). Every step is an autograd operation whose
backward is the reverse exchange, so gradients reach the tokens, the weights (hence the router)
and the experts.

Experts of a layer are split over EP (ep_rank r holds experts [r E/EP, (r+1) E/EP)) and, with
expert tensor parallelism, each is split over the ETP ranks along its ffn dimension: an ETP
rank computes a partial output of every token its experts get, and the partials are summed.

  alltoall  (Megatron's MoEAlltoAllTokenDispatcher): permute by expert -> exchange counts, then
            tokens, all-to-all over EP with uneven splits -> (ETP > 1) gather the tokens of the
            ETP ranks, uneven -> sort by local expert; combine runs the reverse (unsort ->
            reduce-scatter over ETP -> all-to-all back -> weight and sum).
  allgather (Megatron's MoEAllGatherTokenDispatcher): all-gather tokens, weights and map over
            ETP x EP, keep what goes to the local experts; combine weights, scatters into the
            gathered layout and reduce-scatters over ETP x EP. Needs equal T on every rank of
            ETP x EP (equal micro-batch shapes).

Counts always travel before tokens and every rank derives its splits from the counts it
received, so all ranks agree on every split (dropless or not, padded or not).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import torch

from ...parallel.comm import Communicator
from ...parallel.state import ParallelDims, group_rank, group_size
from .router import Routing


# --- exchanges with uneven splits (autograd) --------------------------------------------------
def _exchange(x: torch.Tensor, group, out_splits: List[int], in_splits: List[int], comm: Communicator) -> torch.Tensor:
    out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
    # asynchronous: in DualPipe-V's overlapped pairs the other micro-batch computes meanwhile
    comm.wait_overlapped(comm.all_to_all(out, x.contiguous(), group, out_splits, in_splits, async_op=True))
    return out


class _AllToAll(torch.autograd.Function):
    """All-to-all with uneven splits; backward is the all-to-all with the splits swapped."""

    @staticmethod
    def forward(ctx, x, group, out_splits, in_splits, comm):
        ctx.group, ctx.out_splits, ctx.in_splits, ctx.comm = group, out_splits, in_splits, comm
        return _exchange(x, group, out_splits, in_splits, comm)

    @staticmethod
    def backward(ctx, g):
        return _exchange(g, ctx.group, ctx.in_splits, ctx.out_splits, ctx.comm), None, None, None, None


def _gather_uneven(x: torch.Tensor, group, sizes: List[int], comm: Communicator) -> torch.Tensor:
    """Rows of every rank of `group`, in rank order (rank i holds sizes[i]); via all-to-all,
    which gloo runs with uneven splits where all-gather needs equal ones."""
    n = len(sizes)
    return _exchange(x.repeat((n,) + (1,) * (x.dim() - 1)), group, sizes, [x.shape[0]] * n, comm)


def _reduce_scatter_uneven(x: torch.Tensor, group, sizes: List[int], comm: Communicator) -> torch.Tensor:
    """Sum over `group` of each rank's copy of this rank's rows (x holds every rank's rows)."""
    n, mine = len(sizes), sizes[group_rank(group)]
    out = _exchange(x, group, [mine] * n, sizes, comm)
    return out.view((n, mine) + tuple(x.shape[1:])).sum(0)


class _GatherUneven(torch.autograd.Function):
    """Forward gathers rows over ETP; the experts' slices give partial gradients, so backward
    sums them (reduce-scatter)."""

    @staticmethod
    def forward(ctx, x, group, sizes, comm):
        ctx.group, ctx.sizes, ctx.comm = group, sizes, comm
        return _gather_uneven(x, group, sizes, comm)

    @staticmethod
    def backward(ctx, g):
        return _reduce_scatter_uneven(g, ctx.group, ctx.sizes, ctx.comm), None, None, None


class _ReduceScatterUneven(torch.autograd.Function):
    """Forward sums the ETP partial outputs and keeps this rank's rows; backward gathers."""

    @staticmethod
    def forward(ctx, x, group, sizes, comm):
        ctx.group, ctx.sizes, ctx.comm = group, sizes, comm
        return _reduce_scatter_uneven(x, group, sizes, comm)

    @staticmethod
    def backward(ctx, g):
        return _gather_uneven(g, ctx.group, ctx.sizes, ctx.comm), None, None, None


# --- permutation by expert --------------------------------------------------------------------
def permute(tokens: torch.Tensor, routing_map: torch.Tensor, probs: torch.Tensor):
    """(tokens sorted by expert then position, their weights, their token indices, per-expert
    counts). A token routed to several experts appears once per expert."""
    expert_idx, token_idx = routing_map.t().nonzero(as_tuple=True)
    return tokens.index_select(0, token_idx), probs[token_idx, expert_idx], token_idx, routing_map.sum(0)


def unpermute(rows: torch.Tensor, weights: torch.Tensor, token_idx: torch.Tensor, num_tokens: int,
              dtype) -> torch.Tensor:
    """Sum over each token's rows of weight * row, in the weights' dtype, cast to `dtype`."""
    weighted = rows.to(weights.dtype) * weights.unsqueeze(-1)
    out = weighted.new_zeros((num_tokens, rows.shape[-1])).index_add(0, token_idx, weighted)
    return out.to(dtype)


def sort_chunks(x: torch.Tensor, sizes: torch.Tensor) -> torch.Tensor:
    """Rows in chunks sizes [A, B] (row-major) reordered to [B, A] chunk order."""
    chunks = x.split(sizes.flatten().tolist())
    a, b = sizes.shape
    return torch.cat([chunks[i * b + j] for j in range(b) for i in range(a)]) if chunks else x


def token_orders(routing_map: torch.Tensor, keys: torch.Tensor, n_total: int, dims: ParallelDims) -> torch.Tensor:
    """[T, E]: the place of each of this rank's (token, expert) pairs among the tokens the single
    process routes to that expert (it permutes by expert, then by token), from the tokens' indices
    `keys` in the single-process micro-batch of n_total tokens: the routing of the whole micro-batch,
    summed over the TP / CP ranks that share it, counted up to each token."""
    full = torch.zeros((n_total, routing_map.shape[1]), dtype=torch.int32, device=routing_map.device)
    full[keys] = routing_map.int()
    for group, size in ((dims.tp_group, dims.tp), (dims.cp_group, dims.cp)):
        if size > 1:
            dims.comm.all_reduce(full, group)
    return (full.cumsum(0) - 1)[keys]


def _pair_rows(per_pair: torch.Tensor, routing_map: torch.Tensor) -> torch.Tensor:
    """A [T, E] value of each routed pair, in the order of permute's rows."""
    return per_pair.t()[routing_map.t()]


@dataclass
class DispatchState:
    """What `combine` needs from `dispatch` (one forward of one layer)."""
    weights: torch.Tensor
    token_idx: torch.Tensor
    num_tokens: int
    dtype: torch.dtype
    in_splits: Optional[List[int]] = None
    out_splits: Optional[List[int]] = None
    etp_sizes: Optional[List[int]] = None
    chunk_sizes: Optional[torch.Tensor] = None  # [sources, local experts] rows at the experts
    batches: Optional[tuple] = None  # (data-parallel rank = micro-batch of each expert row, DP): None at DP 1
    orders: Optional[tuple] = None  # (each expert row's place among its expert's rows in the single process, tokens)


def _needs_batches(replicas: List[int], dims: ParallelDims) -> bool:
    """Whether expert rows must carry their micro-batch (data-parallel rank): they come from several,
    or an expert's copies share one (FP8 scales are per micro-batch, reduced over EDP: parallel/fp8.py)."""
    return dims.dp > 1 and (len(set(replicas)) > 1 or dims.edp_shares_micro_batches)


def _own_batch(rows: torch.Tensor, dims: ParallelDims):
    """`batches` of rows that all hold this rank's tokens: its data-parallel replica's micro-batch."""
    if not _needs_batches([dims.dp_rank], dims):
        return None
    return torch.full((rows.shape[0],), dims.dp_rank, device=rows.device), dims.dp


class AllToAllDispatcher:
    def __init__(self, num_experts: int, dims: ParallelDims):
        self.num_experts, self.dims = num_experts, dims
        self.ep, self.etp = dims.ep, dims.etp
        self.num_local_experts = num_experts // dims.ep

    def dispatch(self, tokens: torch.Tensor, routing: Routing, keys=None):
        """-> (expert input [N, h] sorted by local expert, tokens per local expert, state); `keys`:
        (the tokens' indices in the single-process micro-batch, its tokens) for state.orders."""
        rows, weights, token_idx, counts = permute(tokens, routing.routing_map, routing.probs)
        state = DispatchState(weights, token_idx, tokens.shape[0], tokens.dtype)
        orders = None if keys is None else _pair_rows(token_orders(routing.routing_map, *keys, self.dims),
                                                      routing.routing_map)
        if self.ep == 1 and self.etp == 1:
            state.orders = None if keys is None else (orders, keys[1])
            state.batches = _own_batch(rows, self.dims)
            return rows, counts.tolist(), state
        received = self._exchange_counts(counts)  # [ETP, EP, local experts]
        comm = self.dims.comm
        if self.ep > 1:
            state.in_splits = counts.view(self.ep, self.num_local_experts).sum(1).tolist()
            state.out_splits = received[self.dims.etp_rank].sum(1).tolist()
            rows = _AllToAll.apply(rows, self.dims.ep_group, state.out_splits, state.in_splits, comm)
            orders = None if keys is None else _exchange(orders, self.dims.ep_group, state.out_splits,
                                                         state.in_splits, comm)
        if self.etp > 1:
            state.etp_sizes = received.sum((1, 2)).tolist()
            rows = _GatherUneven.apply(rows, self.dims.etp_group, state.etp_sizes, comm)
            orders = None if keys is None else _gather_uneven(orders, self.dims.etp_group, state.etp_sizes, comm)
        # Rows arrive grouped by (source rank, local expert): regroup by local expert.
        state.chunk_sizes = received.reshape(-1, self.num_local_experts)
        rows = sort_chunks(rows, state.chunk_sizes)
        state.orders = None if keys is None else (sort_chunks(orders, state.chunk_sizes), keys[1])
        replicas = self.dims.expert_source_replicas()  # of each source s = etp_src * EP + ep_src
        if _needs_batches(replicas, self.dims):  # rows, grouped by (local expert, source), of their micro-batches
            which = torch.tensor(replicas, device=rows.device).repeat(self.num_local_experts)
            state.batches = (which.repeat_interleave(state.chunk_sizes.t().reshape(-1).to(rows.device)), self.dims.dp)
        return rows, state.chunk_sizes.sum(0).tolist(), state

    def _exchange_counts(self, counts: torch.Tensor) -> torch.Tensor:
        """Tokens every EP (and ETP) source sends to each of this rank's experts."""
        per_rank = counts.view(self.ep, self.num_local_experts).contiguous()
        received = torch.empty_like(per_rank)
        comm = self.dims.comm
        comm.wait_overlapped(comm.all_to_all(received, per_rank, self.dims.ep_group, async_op=True))
        if self.etp == 1:
            return received.unsqueeze(0)
        return self.dims.comm.gather_along(received.unsqueeze(0), 0, self.dims.etp_group)

    def combine(self, expert_output: torch.Tensor, state: DispatchState) -> torch.Tensor:
        rows = expert_output
        if state.chunk_sizes is not None:
            rows = sort_chunks(rows, state.chunk_sizes.t())
        if state.etp_sizes is not None:
            rows = _ReduceScatterUneven.apply(rows, self.dims.etp_group, state.etp_sizes, self.dims.comm)
        if state.in_splits is not None:
            rows = _AllToAll.apply(rows, self.dims.ep_group, state.in_splits, state.out_splits, self.dims.comm)
        return unpermute(rows, state.weights, state.token_idx, state.num_tokens, state.dtype)


class AllGatherDispatcher:
    def __init__(self, num_experts: int, dims: ParallelDims):
        self.num_experts, self.dims = num_experts, dims
        self.num_local_experts = num_experts // dims.ep
        self.group = dims.etp_ep_group

    def dispatch(self, tokens: torch.Tensor, routing: Routing, keys=None):
        probs, routing_map = routing.probs, routing.routing_map
        per_source = tokens.shape[0]
        per_pair = None if keys is None else token_orders(routing_map, *keys, self.dims)
        if group_size(self.group) > 1:
            # Each rank's experts give partial gradients of the gathered tokens: reduce-scatter.
            comm = self.dims.comm
            tokens = comm.gather_from_sp(tokens, self.group, tensor_parallel_output_grad=True)
            probs = comm.gather_from_sp(probs, self.group, tensor_parallel_output_grad=True)
            routing_map = comm.gather_along(routing_map.to(torch.int32), 0, self.group).bool()
            per_pair = None if keys is None else comm.gather_along(per_pair, 0, self.group)
        first = self.dims.ep_rank * self.num_local_experts
        local = slice(first, first + self.num_local_experts)
        rows, weights, token_idx, counts = permute(tokens, routing_map[:, local], probs[:, local])
        state = DispatchState(weights, token_idx, tokens.shape[0], tokens.dtype)
        if keys is not None:
            state.orders = (_pair_rows(per_pair[:, local], routing_map[:, local]), keys[1])
        # the data-parallel rank of group rank i, whose tokens are rows [i n, (i + 1) n)
        replicas = ([self.dims.coords(r)[2] for r in self.dims.group_ranks["etp_ep"]]
                    if group_size(self.group) > 1 else [self.dims.dp_rank])
        if len(replicas) > 1 and _needs_batches(replicas, self.dims):
            state.batches = (torch.tensor(replicas, device=rows.device)[token_idx // per_source], self.dims.dp)
        else:
            state.batches = _own_batch(rows, self.dims)
        return rows, counts.tolist(), state

    def combine(self, expert_output: torch.Tensor, state: DispatchState) -> torch.Tensor:
        # Sum in the weights' dtype across ranks (k > 1 experts, ETP partials), then cast.
        out = unpermute(expert_output, state.weights, state.token_idx, state.num_tokens, state.weights.dtype)
        if group_size(self.group) > 1:
            out = self.dims.comm.reduce_scatter_to_sp(out, self.group)
        return out.to(state.dtype)


def build_dispatcher(kind: str, num_experts: int, dims: ParallelDims):
    return {"alltoall": AllToAllDispatcher, "allgather": AllGatherDispatcher}[kind](num_experts, dims)
