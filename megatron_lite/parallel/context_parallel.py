"""Context parallelism (CP): attention over a sequence that is split across the CP ranks.

Layout. The sequence is cut into 2*cp equal chunks and CP rank r holds chunks r and 2cp-1-r,
concatenated ("zigzag"): under a causal mask every rank then has the same amount of work.
`split_batch_for_cp` applies that split to a batch once and returns the absolute index of
every local token. The attention entry `cp_attention` takes those indices: visibility is
decided by absolute indices and document ids (see kernels/block_attention.py), never by
local positions, so every comm type is exact for any layout; the zigzag only makes it balanced.

Comm types (Megatron-Core's --cp-comm-type names), all autograd-correct:
  p2p        ring attention: K/V rotate around the group with async isend/irecv, overlapped
             with the current block; blocks that no query can see are skipped; backward
             recomputes every block from the final LSE and sends dK/dV around the ring home.
  a2a        Ulysses: all-to-all from sequence-sharded to head-sharded q/k/v, attention over
             the full sequence, all-to-all back.
  all_gather all-gather K/V, local queries attend; backward reduce-scatters dK/dV.
  a2a+p2p    Ulysses inside groups of size A, ring across groups of size B (cp = A * B).

Every collective goes through the caller's comm.Communicator (p2p bytes via record_p2p), so
--log-comm-volume counts it. Groups are passed explicitly; None means a group of one.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from ..kernels.block_attention import (NEG_INF, accumulation_dtype, attention_block, attention_block_backward,
                                       merge_partials, softmax_delta)
from .comm import Communicator, group_rank, group_size

CP_COMM_TYPES = ("p2p", "a2a", "all_gather", "a2a+p2p")


# --- the load-balanced (zigzag) split ----------------------------------------------------------
def _check_zigzag(seq_len: int, cp: int, cp_rank: int) -> int:
    """The chunk length; ValueError for a split that cannot be load-balanced."""
    if cp < 1 or not 0 <= cp_rank < cp:
        raise ValueError(f"context parallel rank {cp_rank} is not in [0, {cp})")
    if seq_len % (2 * cp):
        raise ValueError(f"sequence length {seq_len} is not divisible by 2 x context_parallel_size = {2 * cp}: "
                         "the load-balanced (zigzag) split cuts the sequence into 2*cp equal chunks; "
                         "pad the sequence or choose --seq-length / --context-parallel-size to fit")
    return seq_len // (2 * cp)


def zigzag_indices(seq_len: int, cp: int, cp_rank: int, device=None) -> torch.Tensor:
    """Absolute token indices [seq_len // cp] (int64) held by `cp_rank`: chunks r and 2cp-1-r."""
    c = _check_zigzag(seq_len, cp, cp_rank)
    first, second = cp_rank * c, (2 * cp - 1 - cp_rank) * c
    return torch.cat([torch.arange(first, first + c, device=device), torch.arange(second, second + c, device=device)])


def zigzag_split(t: torch.Tensor, cp: int, cp_rank: int, dim: int) -> torch.Tensor:
    """This rank's zigzag part of `t` along `dim` (chunks r and 2cp-1-r, concatenated)."""
    c = _check_zigzag(t.shape[dim], cp, cp_rank)
    return torch.cat([t.narrow(dim, cp_rank * c, c), t.narrow(dim, (2 * cp - 1 - cp_rank) * c, c)], dim=dim)


def zigzag_unsplit(parts: Sequence[torch.Tensor], dim: int) -> torch.Tensor:
    """Inverse of zigzag_split: the full tensor from every rank's part, in CP rank order.
    (A tensor all-gathered along `dim` is `zigzag_unsplit(t.chunk(cp, dim), dim)`.)"""
    if len({p.shape[dim] for p in parts}) != 1 or parts[0].shape[dim] % 2:
        raise ValueError("zigzag parts must have the same, even length along the split dimension")
    halves = [p.chunk(2, dim=dim) for p in parts]
    return torch.cat([h[0] for h in halves] + [h[1] for h in reversed(halves)], dim=dim)


def split_batch_for_cp(batch: Dict[str, object], cp: int, cp_rank: int) -> Tuple[Dict[str, object], torch.Tensor]:
    """Zigzag-split every [b, s] tensor of a batch (tokens, labels, loss_mask, position_ids,
    document ids, ...) along the sequence; return (local batch, local absolute indices [s/cp]).

    The sequence length is that of batch["tokens"] (else of the first 2-D tensor). A dense
    "attention_mask" is dropped: under CP, visibility comes from the indices and document ids.
    Other entries pass through unchanged."""
    tensors = [v for v in batch.values() if torch.is_tensor(v) and v.dim() == 2]
    ref = batch.get("tokens", tensors[0] if tensors else None)
    if not torch.is_tensor(ref) or ref.dim() != 2:
        raise ValueError("split_batch_for_cp needs [b, s] tensors (e.g. 'tokens') to split")
    shape = ref.shape
    local = {}
    for key, value in batch.items():
        if key == "attention_mask":
            continue
        if torch.is_tensor(value) and value.shape == shape:
            value = zigzag_split(value, cp, cp_rank, dim=1)
        local[key] = value
    return local, zigzag_indices(shape[1], cp, cp_rank, device=ref.device)


# --- ring attention (p2p) ----------------------------------------------------------------------
_TAG_KV, _TAG_DKV = 0, 1  # distinct tags: a step's K/V and dK/dV transfers are in flight together
_MAX_PARTS = 16  # beyond this many index runs, plan whole blocks (correct, just not skipped)


class _RingExchange:
    """One posted ring transfer: send a tensor to the next rank, receive one from the previous."""

    def __init__(self, send: torch.Tensor, group, tag: int, comm: Communicator):
        size, rank = group_size(group), group_rank(group)
        self.recv = torch.empty_like(send)
        comm.record_p2p(send)  # counted once per rank: the bytes this rank sends
        ops = [dist.P2POp(dist.isend, send, dist.get_global_rank(group, (rank + 1) % size), group, tag),
               dist.P2POp(dist.irecv, self.recv, dist.get_global_rank(group, (rank - 1) % size), group, tag)]
        self.works = comm.batch_p2p(ops, group)

    def wait(self) -> torch.Tensor:
        for w in self.works:
            w.wait()
        return self.recv


def _index_runs(index: List[int]) -> List[Tuple[slice, int, int]]:
    """Runs of consecutive indices as (rows, lowest, highest), also cut at the middle of the local
    sequence: the two zigzag chunks (rank cp-1's chunks cp-1 and cp are consecutive but still two)."""
    runs, start, middle = [], 0, len(index) // 2
    for i in range(1, len(index) + 1):
        if i == len(index) or index[i] != index[i - 1] + 1 or i == middle:
            runs.append((slice(start, i), index[start], index[i - 1]))
            start = i
    if len(runs) > _MAX_PARTS:
        return [(slice(0, len(index)), min(index), max(index))]
    return runs


def _may_see(q_lo: int, q_hi: int, k_lo: int, k_hi: int, causal: bool, window: Optional[int]) -> bool:
    """False only if no query in [q_lo, q_hi] can see any key in [k_lo, k_hi] (document ids are
    ignored here: they only hide more, and the block's own mask applies them)."""
    if causal and k_lo > q_hi:
        return False
    if window is not None and k_hi <= q_lo - window:
        return False
    if window is not None and not causal and k_lo >= q_hi + window:
        return False
    return True


def ring_block_plan(q_index: List[int], k_index: List[int], causal: bool,
                    window: Optional[int]) -> List[Tuple[slice, slice]]:
    """The (query rows, key rows) blocks of one ring step that may hold a visible pair.

    Queries and keys are cut into their runs of consecutive indices (the two zigzag chunks);
    a key run is kept for a query run unless no pair in them can be visible. With the zigzag
    layout this is Transformer Engine's rule and a bit more: step 0 computes (q0, k0) and
    (q1, k0+k1), both causal, and skips (q0, k1); when the K/V come from a lower rank all
    queries see the first K/V chunk only; from a higher rank only the second query chunk sees
    anything (all K/V). The blocks still apply the full mask, so any layout stays exact."""
    q_runs, k_runs = _index_runs(q_index), _index_runs(k_index)
    blocks: List[Tuple[slice, Tuple[slice, ...]]] = []
    for rows, q_lo, q_hi in q_runs:
        seen: List[slice] = []
        for cols, k_lo, k_hi in k_runs:
            if not _may_see(q_lo, q_hi, k_lo, k_hi, causal, window):
                continue
            if seen and seen[-1].stop == cols.start:  # adjacent key runs: one block
                seen[-1] = slice(seen[-1].start, cols.stop)
            else:
                seen.append(cols)
        if not seen:
            continue
        prev = blocks[-1] if blocks else None
        if prev is not None and prev[1] == tuple(seen) and prev[0].stop == rows.start:  # same keys: one block
            blocks[-1] = (slice(prev[0].start, rows.stop), prev[1])
        else:
            blocks.append((rows, tuple(seen)))
    return [(rows, cols) for rows, all_cols in blocks for cols in all_cols]


def _ring_plans(all_index: torch.Tensor, rank: int, causal: bool, window: Optional[int]):
    """Per step i, the blocks of this rank's queries against the K/V of rank (rank - i) % size."""
    index = all_index.tolist()
    size = len(index)
    return [ring_block_plan(index[rank], index[(rank - i) % size], causal, window) for i in range(size)]


class _RingAttention(torch.autograd.Function):
    """Ring attention over `group`. all_index [P, s] / all_docs [P, b, s] or None: the token
    indices / document ids of every ring rank's local chunk (K/V of step i come from rank r - i)."""

    @staticmethod
    def forward(ctx, q, k, v, all_index, all_docs, plans, group, opts, comm):
        size, rank = group_size(group), group_rank(group)
        acc = accumulation_dtype(q.dtype)
        b, s, hq, d = q.shape
        out = torch.zeros(b, s, hq, v.shape[-1], dtype=acc, device=q.device)
        lse = torch.full((b, hq, s), NEG_INF, dtype=acc, device=q.device)
        q_doc = None if all_docs is None else all_docs[rank]
        # One transfer per step: only the K/V heads travel, K and V side by side (head sizes may differ).
        kv, halves = torch.cat([k, v], dim=-1), (d, v.shape[-1])
        for step in range(size):
            src = (rank - step) % size
            pending = _RingExchange(kv, group, _TAG_KV, comm) if step < size - 1 else None  # overlaps the compute
            k_doc = None if all_docs is None else all_docs[src]
            for rows, cols in plans[step]:
                o, l = attention_block(q[:, rows], *kv[:, cols].split(halves, -1), q_index=all_index[rank][rows],
                                       k_index=all_index[src][cols], q_doc=None if q_doc is None else q_doc[:, rows],
                                       k_doc=None if k_doc is None else k_doc[:, cols], out_dtype=acc, **opts)
                out[:, rows], lse[:, :, rows] = merge_partials(out[:, rows], lse[:, :, rows], o, l)
            if pending is not None:
                kv = pending.wait()
        out = out.to(q.dtype)
        # No per-step activations: backward recomputes every block from q, k, v and the final lse.
        ctx.save_for_backward(q, k, v, out, lse, all_index, all_docs)
        ctx.plans, ctx.group, ctx.opts, ctx.comm = plans, group, opts, comm
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, all_index, all_docs = ctx.saved_tensors
        group, plans = ctx.group, ctx.plans
        size, rank = group_size(group), group_rank(group)
        acc = accumulation_dtype(q.dtype)
        delta = softmax_delta(dout, out)
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        q_doc = None if all_docs is None else all_docs[rank]
        kv, halves = torch.cat([k, v], dim=-1), (k.shape[-1], v.shape[-1])
        incoming_dkv = None  # the gradient of the K/V now held, accumulated by the ranks before
        for step in range(size):
            src = (rank - step) % size
            pending_kv = _RingExchange(kv, group, _TAG_KV, ctx.comm) if step < size - 1 else None
            k_doc = None if all_docs is None else all_docs[src]
            dkv = torch.zeros(kv.shape, dtype=acc, device=q.device)
            for rows, cols in plans[step]:
                gq, gk, gv = attention_block_backward(
                    dout[:, rows], q[:, rows], *kv[:, cols].split(halves, -1), lse[:, :, rows], delta[:, :, rows],
                    q_index=all_index[rank][rows], k_index=all_index[src][cols],
                    q_doc=None if q_doc is None else q_doc[:, rows], k_doc=None if k_doc is None else k_doc[:, cols],
                    out=out[:, rows], **ctx.opts)  # out: the fused kernels' backward takes it, not delta
                dq[:, rows] += gq
                dkv[:, cols] += torch.cat([gk, gv], dim=-1)
            if incoming_dkv is not None:
                dkv += incoming_dkv.wait()
            # dK/dV travel with their K/V; after the last step one more hop brings them home.
            incoming_dkv = _RingExchange(dkv, group, _TAG_DKV, ctx.comm) if size > 1 else None
            if pending_kv is not None:
                kv = pending_kv.wait()
        if incoming_dkv is not None:
            dkv = incoming_dkv.wait()
        dk, dv = dkv.split(halves, -1)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None, None


def _gather_positions(q_index: torch.Tensor, q_doc: Optional[torch.Tensor], group, comm: Communicator):
    """Every rank's indices [P * s] and document ids [b, P * s] (or None), in group rank order."""
    index = comm.gather_along(q_index, 0, group)
    docs = None if q_doc is None else comm.gather_along(q_doc, 1, group)
    return index, docs


def ring_attention(q, k, v, *, group, q_index, q_doc=None, causal: bool = True, window: Optional[int] = None,
                   softmax_scale: Optional[float] = None, comm: Communicator) -> torch.Tensor:
    """Ring attention (p2p) of this rank's queries over the keys of every rank of `group`.
    q [b, s, hq, d], k [b, s, hkv, d], v [b, s, hkv, dv], q_index [s], q_doc [b, s] or None
    -> out [b, s, hq, dv]."""
    size = group_size(group)
    index, docs = _gather_positions(q_index, q_doc, group, comm)
    all_index = index.view(size, -1)
    all_docs = None if docs is None else docs.view(docs.shape[0], size, -1).transpose(0, 1)
    plans = _ring_plans(all_index.cpu(), group_rank(group), causal, window)
    opts = dict(causal=causal, window=window, softmax_scale=softmax_scale)
    return _RingAttention.apply(q, k, v, all_index, all_docs, plans, group, opts, comm)


# --- Ulysses (a2a) ---------------------------------------------------------------------------
def check_ulysses(num_heads: int, num_kv_heads: int, cp: int) -> None:
    """ValueError unless all-to-all CP over `cp` ranks can split these (TP-local) heads."""
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads are not a multiple of {num_kv_heads} key/value heads")
    if num_heads % cp:
        raise ValueError(f"a2a (Ulysses) context parallelism splits attention heads over {cp} ranks, but "
                         f"{num_heads} query heads (per TP rank) are not divisible by {cp}; use "
                         "--cp-comm-type p2p, or a2a+p2p with an a2a group size that divides the heads")
    if num_kv_heads % cp and cp % num_kv_heads:
        raise ValueError(f"a2a (Ulysses) context parallelism over {cp} ranks needs the {num_kv_heads} key/value "
                         f"heads (per TP rank) to be divisible by {cp}, or to divide {cp} (then they are "
                         "replicated); use --cp-comm-type p2p, or a2a+p2p with a smaller a2a group")


def _seq_to_heads(x: torch.Tensor, group, comm: Communicator) -> torch.Tensor:
    """[b, s, h, d] sequence-sharded -> [b, n * s, h / n, d] head-sharded (n = group size);
    the gathered sequence is the ranks' local chunks in group rank order."""
    n = group_size(group)
    b, s, h, d = x.shape
    send = x.reshape(b, s, n, h // n, d).permute(2, 0, 1, 3, 4).contiguous()  # [dest, b, s, h/n, d]
    recv = torch.empty_like(send)  # [src, b, s, h/n, d]
    comm.all_to_all(recv, send, group)
    return recv.permute(1, 0, 2, 3, 4).reshape(b, n * s, h // n, d)


def _heads_to_seq(x: torch.Tensor, group, comm: Communicator) -> torch.Tensor:
    """Inverse of _seq_to_heads: [b, n * s, h / n, d] -> [b, s, h, d]."""
    n = group_size(group)
    b, ns, hl, d = x.shape
    send = x.reshape(b, n, ns // n, hl, d).transpose(0, 1).contiguous()  # [dest, b, s, h/n, d]
    recv = torch.empty_like(send)  # [src = head slice, b, s, h/n, d]
    comm.all_to_all(recv, send, group)
    return recv.permute(1, 2, 0, 3, 4).reshape(b, ns // n, n * hl, d)


class _UlyssesAllToAll(torch.autograd.Function):
    """Sequence -> heads (to_heads) or heads -> sequence; the backward is the reverse all-to-all."""

    @staticmethod
    def forward(ctx, x, group, to_heads: bool, comm):
        ctx.group, ctx.to_heads, ctx.comm = group, to_heads, comm
        return _seq_to_heads(x, group, comm) if to_heads else _heads_to_seq(x, group, comm)

    @staticmethod
    def backward(ctx, g):
        back = _heads_to_seq if ctx.to_heads else _seq_to_heads
        return back(g, ctx.group, ctx.comm), None, None, None


CoreAttention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor]], torch.Tensor]


def ulysses_attention(q, k, v, *, group, q_index, q_doc=None, causal: bool = True, window: Optional[int] = None,
                      softmax_scale: Optional[float] = None, core: Optional[CoreAttention] = None,
                      comm: Communicator) -> torch.Tensor:
    """Ulysses (a2a): q/k/v [b, s, h, d or dv] sequence-sharded -> head-sharded over the whole gathered
    sequence -> core(q, k, v, index, docs) -> back to [b, s, hq, dv]. K/V heads are replicated first
    when there are fewer of them than ranks. `core` defaults to one attention_block over the
    gathered (zigzag-ordered) sequence with the gathered absolute indices."""
    n = group_size(group)
    hq, hkv = q.shape[2], k.shape[2]
    check_ulysses(hq, hkv, n)
    if hkv < n:  # each rank needs the K/V head of its query heads: replicate (autograd sums the grads)
        k, v = k.repeat_interleave(n // hkv, dim=2), v.repeat_interleave(n // hkv, dim=2)
    # One all-to-all for q, k and v: per destination rank, its query heads then its K and V heads,
    # each flattened with its own head size (the value head size may differ).
    parts = [t.unflatten(2, (n, -1)).flatten(3) for t in (q, k, v)]  # [b, s, n, heads / n * head size]
    qkv = _UlyssesAllToAll.apply(torch.cat(parts, dim=3), group, True, comm).squeeze(2)  # [b, n s, ...]
    q, k, v = (x.unflatten(-1, (-1, t.shape[-1])) for x, t in zip(qkv.split([p.shape[-1] for p in parts], -1),
                                                                  (q, k, v)))
    index, docs = _gather_positions(q_index, q_doc, group, comm)
    if core is None:
        out = attention_block(q, k, v, q_index=index, k_index=index, q_doc=docs, k_doc=docs, causal=causal,
                              window=window, softmax_scale=softmax_scale)[0]
    else:
        out = core(q, k, v, index, docs)
    return _UlyssesAllToAll.apply(out, group, False, comm)


# --- all-gather K/V -----------------------------------------------------------------------------
def all_gather_attention(q, k, v, *, group, q_index, q_doc=None, causal: bool = True, window: Optional[int] = None,
                         softmax_scale: Optional[float] = None, comm: Communicator) -> torch.Tensor:
    """Local queries attend the K/V all-gathered over `group`; the backward reduce-scatters dK/dV
    (every rank's queries contribute to every key's gradient)."""
    d = k.shape[-1]
    kv = torch.cat([k, v], dim=-1).transpose(0, 1)  # [s, b, hkv, d + dv]: one gather, along dim 0
    kv = comm.gather_from_sp(kv, group, tensor_parallel_output_grad=True).transpose(0, 1)
    k, v = kv[..., :d], kv[..., d:]
    k_index, k_doc = _gather_positions(q_index, q_doc, group, comm)
    return attention_block(q, k, v, q_index=q_index, k_index=k_index, q_doc=q_doc, k_doc=k_doc, causal=causal,
                           window=window, softmax_scale=softmax_scale)[0]


# --- entry ----------------------------------------------------------------------------------------
def cp_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, comm_type: str, q_index: torch.Tensor,
                 cp_group=None, a2a_group=None, p2p_group=None, q_doc: Optional[torch.Tensor] = None,
                 causal: bool = True, window: Optional[int] = None,
                 softmax_scale: Optional[float] = None, comm: Optional[Communicator] = None) -> torch.Tensor:
    """Context-parallel core attention of this rank's local chunk.

    q [b, s_local, hq, d], k [b, s_local, hkv, d], v [b, s_local, hkv, dv]: this rank's tokens
    (zigzag chunks), heads already TP-local. q_index [s_local] int64: their absolute indices (split_batch_for_cp);
    q_doc [b, s_local]: their document ids, or None. K/V are the same tokens (self-attention).
    Groups: cp_group for "p2p", "a2a", "all_gather"; for "a2a+p2p" a2a_group (inner, Ulysses,
    size A) and p2p_group (outer, ring, size B), whose product is the CP group. None = one rank.
    `comm`: the communicator that moves and counts the bytes (dims.comm; None: an uncounted one).
    Returns out [b, s_local, hq, dv] in q.dtype."""
    if comm_type not in CP_COMM_TYPES:
        raise ValueError(f"unknown cp comm type {comm_type!r}; choose one of {', '.join(CP_COMM_TYPES)}")
    if comm_type == "a2a+p2p" and cp_group is not None:
        raise ValueError("a2a+p2p takes a2a_group (inner) and p2p_group (outer), not cp_group")
    if comm_type != "a2a+p2p" and (a2a_group is not None or p2p_group is not None):
        raise ValueError(f"a2a_group / p2p_group are for a2a+p2p; {comm_type} takes cp_group")
    if q.dim() != 4 or k.shape[:2] != q.shape[:2] or q_index.shape != (q.shape[1],):
        raise ValueError(f"expected q [b, s, hq, d], k/v [b, s, hkv, d/dv] and q_index [s] for the same local "
                         f"tokens; got q {tuple(q.shape)}, k {tuple(k.shape)}, q_index {tuple(q_index.shape)}")
    comm = comm if comm is not None else Communicator()
    opts = dict(q_index=q_index, q_doc=q_doc, causal=causal, window=window, softmax_scale=softmax_scale, comm=comm)
    if comm_type == "p2p":
        return ring_attention(q, k, v, group=cp_group, **opts)
    if comm_type == "a2a":
        return ulysses_attention(q, k, v, group=cp_group, **opts)
    if comm_type == "all_gather":
        return all_gather_attention(q, k, v, group=cp_group, **opts)

    def ring_core(q_, k_, v_, index, docs):  # across the outer groups, over the inner-gathered tokens
        return ring_attention(q_, k_, v_, group=p2p_group, q_index=index, q_doc=docs, causal=causal,
                              window=window, softmax_scale=softmax_scale, comm=comm)

    return ulysses_attention(q, k, v, group=a2a_group, core=ring_core, **opts)


__all__ = ["CP_COMM_TYPES", "zigzag_indices", "zigzag_split", "zigzag_unsplit", "split_batch_for_cp",
           "ring_block_plan", "ring_attention", "check_ulysses", "ulysses_attention", "all_gather_attention",
           "cp_attention"]
