"""Compressed gradient reduction with error feedback (--grad-comm-dtype bf16 | fp8-e4m3 | fp8-e5m2,
--zeropp-quantized-gradients: int4 blocks), and ZeRO++'s quantized weight all-gather.

A bucket reducer (data_parallel.PlainReducer's two calls) that sends each bucket's gradient in a
low-precision format and sums in fp32 where it lands:

- reduce-scatter (ZeRO 1-3): this rank's bucket x = gradient + its error, cut into the group's N
  shards, each shard encoded (bf16; or fp8 with one fp32 scale per shard, amax / the format's
  largest value) and sent to its owner by one all-to-all; the owner decodes the N pieces and adds
  them in fp32 (Megatron-Core's reduce_scatter_with_fp32_accumulation moves the same bytes).
  The worker error x - decode(encode(x)) stays on this rank and joins the next step's gradient.
  qgZ across nodes goes in two hops instead (CompressedReducer, NodeHops): inside the node, then
  across, the partial sums re-encoded with an error feedback of their own.
- all-reduce (ZeRO 0): the same reduce-scatter over the bucket padded to N pieces, then each owner
  encodes its summed piece plus its own server error and all-gathers it, so every rank decodes the
  same gradient (the two error feedbacks of DeepSpeed's compressed all-reduce).

Nothing is lost, only delayed: the sum over ranks of the gradients applied so far equals the
exact sum minus what the errors hold. Checkpoints store that sum as the state `grad_residual` of
each shard (fold_for_checkpoint: a reduce-scatter of the worker errors, collective, on copies: the
run that saves goes on as if it had not); it reshards like the optimizer state, and a load at
another layout adds it to the next reduced gradient. Each rank's own errors are stored too
(optim/feedback_state.py): a load at the same layout restores them, and continues bit-exactly.
Without --grad-comm-dtype, PlainReducer runs, unchanged.

qgZ keeps no error at either hop unless --zeropp-qgz-error-feedback (DeepSpeed's qgZ keeps none):
each step's int4 rounding is lost rather than delayed, and no fp32 copy of the buckets is held.
Such a run writes no residual to its checkpoints; one it loads (written with error feedback) is
applied once.
"""
from __future__ import annotations

import math
from typing import Callable, Dict, Optional, Tuple

import torch

from .bucket_plan import CODEC_ALIGN, feedback_rows, row_runs
from .comm import Communicator, group_rank, group_size
from .state import partial_dp_groups

FORMATS = {"bf16": torch.bfloat16, "fp8-e4m3": torch.float8_e4m3fn, "fp8-e5m2": torch.float8_e5m2}
RESIDUAL = "grad_residual"  # the checkpointed state's name (optim/<param>/grad_residual)
# Error-feedback states a checkpoint may lack (written without compression): loaded as zeros.
OPTIONAL_STATES = (RESIDUAL, "exp_avg_residual")
_SCALE_BYTES = 4  # one fp32 scale per encoded piece (fp8 formats)


def _scale_of(amax: torch.Tensor, largest: float) -> torch.Tensor:
    """amax / the format's largest value, or 1 where that is 0: an all-zero block, and one whose
    values are so small (denormals: error feedback shrinks an idle block's errors down to them)
    that the quotient underflows, whose 0 / 0 would make its error NaN for good."""
    scale = amax / largest
    return torch.where(scale > 0, scale, torch.ones_like(scale))


class Codec:
    """Rows of fp32 values <-> rows of bytes in a wire format (fp8: the row's scale appended)."""
    align = 1  # a row's length must be a multiple of this

    def __init__(self, name: str):
        self.name, self.dtype = name, FORMATS[name]
        self.scaled = self.dtype.itemsize == 1
        self.max = torch.finfo(self.dtype).max

    def row_bytes(self, n: int) -> int:
        return n * self.dtype.itemsize + (_SCALE_BYTES if self.scaled else 0)

    def encode(self, x: torch.Tensor):
        """x [k, n] fp32 -> (bytes [k, row_bytes(n)], what the receiver will decode [k, n] fp32)."""
        if not self.scaled:
            q = x.to(self.dtype)
            return q.view(torch.uint8), q.float()
        amax = x.abs().amax(dim=1, keepdim=True)
        scale = _scale_of(amax, self.max)
        q = (x / scale).clamp_(-self.max, self.max).to(self.dtype)
        payload = torch.cat([q.view(torch.uint8), scale.view(torch.uint8)], dim=1)
        return payload, q.float() * scale

    def decode(self, payload: torch.Tensor, n: int) -> torch.Tensor:
        """bytes [k, row_bytes(n)] -> fp32 [k, n]."""
        values = payload[:, :n * self.dtype.itemsize].contiguous().view(self.dtype).float()
        if not self.scaled:
            return values
        return values * payload[:, n:].contiguous().view(torch.float32)


_BITS = 1 << torch.arange(8, dtype=torch.uint8)


def _per_element(values: torch.Tensor, runs: torch.Tensor, n: int) -> torch.Tensor:
    """[k, n]: each run of each row (runs [k, r], CPU) filled with its value (values [k, r]); a
    fill per run (a few per row) is faster here than repeat_interleave."""
    out = torch.empty(values.shape[0] * n, dtype=values.dtype, device=values.device)
    for piece, value in zip(out.split(runs.reshape(-1).tolist()), values.reshape(-1)):
        piece.copy_(value)
    return out.view(-1, n)


class SignCodec:
    """1-bit Adam's format (DeepSpeed's compressed all-reduce): each value's sign (0 counts as +)
    packed 8 to a byte, and its scale: an RMS (the norm over sqrt(elements)), so that the decoded
    values keep the input's norm. Without `runs`, one scale for all the rows encoded together;
    with `runs` ([k, s + 1]: the lengths of consecutive runs of each row, the last its padding),
    one per run, the s of each row after its signs (the padding's scale is 0, never sent)."""
    name, align = "sign", CODEC_ALIGN["sign"]

    def row_bytes(self, n: int, per_row: int = 1) -> int:
        return n // 8 + per_row * _SCALE_BYTES

    def encode(self, x: torch.Tensor, runs: Optional[torch.Tensor] = None):
        k, n = x.shape
        positive = x >= 0
        packed = (positive.view(k, n // 8, 8).to(torch.uint8) * _BITS.to(x.device)).sum(dim=2, dtype=torch.uint8)
        if runs is None:
            scale = (x.norm() / math.sqrt(x.numel())).reshape(1, 1).expand(k, 1).contiguous()
            payload = torch.cat([packed, scale.view(torch.uint8)], dim=1)
            return payload, torch.where(positive, scale, -scale)
        pieces = x.reshape(-1).split(runs.reshape(-1).tolist())
        scales = torch.stack(torch._foreach_norm(pieces)).view(k, -1) / runs.clamp(min=1).float().sqrt().to(x.device)
        scales[:, -1] = 0.0
        payload = torch.cat([packed, scales[:, :-1].contiguous().view(torch.uint8)], dim=1)
        each = _per_element(scales, runs, n)
        return payload, torch.where(positive, each, -each)

    def decode(self, payload: torch.Tensor, n: int, runs: Optional[torch.Tensor] = None) -> torch.Tensor:
        k = payload.shape[0]
        bits = (payload[:, :n // 8].unsqueeze(2) & _BITS.to(payload.device)).ne(0).view(k, n)
        scale = payload[:, n // 8:].contiguous().view(torch.float32)
        if runs is not None:  # (the padding's scale 0 appended)
            scale = _per_element(torch.cat([scale, torch.zeros_like(scale[:, :1])], dim=1), runs, n)
        return torch.where(bits, scale, -scale)


class Int8BlockCodec:
    """ZeRO++'s quantized weights: int8 values in blocks of `block` elements, each block with its
    fp32 scale (amax / 127), appended after the row's values."""
    name = "int8-blocks"

    def __init__(self, block: int = CODEC_ALIGN["int8-blocks"]):
        self.align = block

    def row_bytes(self, n: int) -> int:
        return n + n // self.align * _SCALE_BYTES

    def encode(self, x: torch.Tensor):
        k, n = x.shape
        blocks = x.view(k, n // self.align, self.align)
        amax = blocks.abs().amax(dim=2, keepdim=True)
        scale = _scale_of(amax, 127.0)
        q = torch.round(blocks / scale).clamp_(-127, 127).to(torch.int8)
        payload = torch.cat([q.view(k, n).view(torch.uint8), scale.view(k, -1).contiguous().view(torch.uint8)], dim=1)
        return payload, (q.float() * scale).view(k, n)

    def decode(self, payload: torch.Tensor, n: int) -> torch.Tensor:
        k = payload.shape[0]
        q = payload[:, :n].contiguous().view(torch.int8).float().view(k, n // self.align, self.align)
        scale = payload[:, n:].contiguous().view(torch.float32).view(k, -1, 1)
        return (q * scale).view(k, n)


class Int4BlockCodec:
    """ZeRO++'s quantized gradients: values rounded to -7..7 in blocks of `block` elements, each
    block with its fp32 scale (amax / 7); two values to a byte (value + 8 in each half)."""
    name = "int4-blocks"

    def __init__(self, block: int = CODEC_ALIGN["int4-blocks"]):
        self.align = block

    def row_bytes(self, n: int) -> int:
        return n // 2 + n // self.align * _SCALE_BYTES

    def encode(self, x: torch.Tensor):
        k, n = x.shape
        blocks = x.view(k, n // self.align, self.align)
        amax = blocks.abs().amax(dim=2, keepdim=True)
        scale = _scale_of(amax, 7.0)
        q = torch.round(blocks / scale).clamp_(-7, 7)
        nibbles = (q + 8).to(torch.uint8).view(k, n // 2, 2)
        packed = nibbles[:, :, 0] | (nibbles[:, :, 1] << 4)
        payload = torch.cat([packed, scale.view(k, -1).contiguous().view(torch.uint8)], dim=1)
        return payload, (q * scale).view(k, n)

    def decode(self, payload: torch.Tensor, n: int) -> torch.Tensor:
        k = payload.shape[0]
        packed = payload[:, :n // 2]
        q = torch.stack([packed & 15, packed >> 4], dim=2).view(k, n).float() - 8
        scale = payload[:, n // 2:].contiguous().view(torch.float32).view(k, -1, 1)
        return (q.view(k, n // self.align, self.align) * scale).view(k, n)


_CODECS = {"sign": SignCodec, "int8-blocks": Int8BlockCodec, "int4-blocks": Int4BlockCodec}


def codec(name: str):
    return _CODECS[name]() if name in _CODECS else Codec(name)


class _Pending:
    """An all-to-all in flight and what to do once it has landed (decode and add up). When that
    issues a collective of its own (`collective`: ZeRO 0's all-gather) it must run at the same
    point on every rank: it reports itself complete only once waited for, so that GradientSync
    retires it at its waits (the same on every rank), never when a poll happens to find it done."""

    def __init__(self, handle, then: Callable[[], None], collective: bool):
        self.handle, self.then, self.collective, self.done = handle, then, collective, False

    def is_completed(self) -> bool:
        if self.done:
            return True
        return not self.collective and (self.handle is None or self.handle.is_completed())

    def wait(self) -> None:
        if not self.done:
            if self.handle is not None:
                self.handle.wait()
            self.then()
            self.done = True


class ErrorFeedbackExchange:
    """The two halves of a compressed all-reduce with error feedback, over tensors named by a key
    (a bucket's index). A flat tensor of `numel` is laid out as N rows, row r holding elements
    [r * shard, (r + 1) * shard) (shard = ceil(numel / N): a ZeRO shard), each row padded to whole
    blocks of the codec (n elements). `scatter` encodes the rows + the worker error and all-to-alls
    them (each rank gets every rank's copy of its row, which `land` decodes and sums in fp32);
    `gather` encodes a summed row + the server error and all-gathers it to every rank. With the
    sign codec a key may have one scale per tensor within each row (`scale_per_tensor`).
    Without `error_feedback` the rows are encoded as they are and no error is kept."""

    def __init__(self, comm: Communicator, fmt: str, error_feedback: bool = True):
        self.comm, self.codec, self.error_feedback = comm, codec(fmt), error_feedback
        self.worker: Dict[int, torch.Tensor] = {}  # [N, n] per key
        self.server: Dict[int, torch.Tensor] = {}  # [n] per key
        self.runs: Dict[int, torch.Tensor] = {}  # per key: [N, scales per row + 1] elements per scale (CPU)

    def scale_per_tensor(self, key: int, offsets, numel: int, ranks: int) -> None:
        """Key's sign scales: one per tensor (`offsets`: their [lo, hi) in the flat layout, in
        order) within each row, where DeepSpeed compresses each tensor apart (a scale over it at
        the worker, one per piece at the server); each row carries as many as the most any row
        meets (its tensors in order, then unused ones). Kept as run lengths per row (the tensors
        of a row are consecutive, the padding last), not as an index per element."""
        if key in self.runs:
            return
        n = self.layout(numel, ranks)[1]
        counts = row_runs(offsets, numel, ranks, self.codec.align)
        per_row = max(1, max(len(c) for c in counts))
        runs = torch.zeros(ranks, per_row + 1, dtype=torch.long)
        for r, c in enumerate(counts):
            runs[r, :len(c)] = torch.tensor(c, dtype=torch.long)
            runs[r, per_row] = n - sum(c)  # (the padding: scale 0)
        self.runs[key] = runs  # (on the CPU: the runs' lengths are read as a list)

    def _runs(self, key: int, rows=slice(None)) -> tuple:
        """The sign codec's `runs` for `rows` of key's layout; () if it has one scale."""
        return (self.runs[key][rows],) if key in self.runs else ()

    def layout(self, numel: int, ranks: int) -> Tuple[int, int]:
        """(shard, n): elements of each rank's row, and the row padded to whole codec blocks."""
        return feedback_rows(numel, ranks, self.codec.align)

    def to_rows(self, x: torch.Tensor, ranks: int) -> torch.Tensor:
        shard, n = self.layout(x.numel(), ranks)
        flat = torch.zeros(ranks * shard, dtype=torch.float32, device=x.device)
        flat[:x.numel()] = x
        rows = torch.zeros(ranks, n, dtype=torch.float32, device=x.device)
        rows[:, :shard] = flat.view(ranks, shard)
        return rows

    def from_rows(self, rows: torch.Tensor, numel: int) -> torch.Tensor:
        shard, _ = self.layout(numel, rows.shape[0])
        return rows[:, :shard].reshape(-1)[:numel]

    def error(self, store: Dict[int, torch.Tensor], key: int, shape, device) -> torch.Tensor:
        if key not in store:
            store[key] = torch.zeros(shape, dtype=torch.float32, device=device)
        return store[key]

    def encode_rows(self, key: int, x: torch.Tensor, ranks: int) -> Tuple[torch.Tensor, int]:
        """(the encoded rows [ranks, bytes], row length n) of x (flat fp32) plus the worker error,
        which keeps what the encoding lost."""
        y = self.to_rows(x, ranks)
        if not self.error_feedback:
            return self.codec.encode(y, *self._runs(key))[0], y.shape[1]
        error = self.error(self.worker, key, y.shape, x.device)
        y.add_(error)
        payload, sent = self.codec.encode(y, *self._runs(key))
        error.copy_(y - sent)
        return payload, y.shape[1]

    def scatter(self, key: int, x: torch.Tensor, group, ranks: int, async_op: bool = False):
        """(what lands, its all-to-all's handle, row length n) of x (flat fp32) plus the worker error."""
        payload, n = self.encode_rows(key, x, ranks)
        received = torch.empty_like(payload)
        return received, self.comm.all_to_all(received, payload, group, async_op=async_op), n

    def land(self, received: torch.Tensor, n: int, shard: int, key: int = -1, rank: int = 0) -> torch.Tensor:
        """This rank's row (`rank`'s of key's layout) summed over ranks (its first `shard` elements)."""
        runs = [r.expand(received.shape[0], -1) for r in self._runs(key, slice(rank, rank + 1))]
        return self.codec.decode(received, n, *runs).sum(dim=0)[:shard]

    def gather(self, key: int, piece: torch.Tensor, group, ranks: int, out: torch.Tensor) -> None:
        """out (flat) = every rank's summed row (plus its server error), as sent."""
        shard, n = self.layout(out.numel(), ranks)
        error = self.error(self.server, key, (n,), piece.device)
        y = error.clone()
        y[:shard].add_(piece)
        rank = group_rank(group)
        payload, sent = self.codec.encode(y.view(1, n), *self._runs(key, slice(rank, rank + 1)))
        error.copy_(y - sent.view(-1))
        gathered = torch.empty((ranks, payload.shape[1]), dtype=torch.uint8, device=piece.device)
        self.comm.all_gather(gathered, payload, group)
        out.copy_(self.from_rows(self.codec.decode(gathered, n, *self._runs(key)), out.numel()))

    def all_reduce(self, key: int, x: torch.Tensor, group, ranks: int) -> None:
        """x = the sum over ranks of x, compressed both ways (in place, blocking)."""
        received, handle, n = self.scatter(key, x, group, ranks)
        if handle is not None:
            handle.wait()
        shard = self.layout(x.numel(), ranks)[0]
        self.gather(key, self.land(received, n, shard, key, group_rank(group)), group, ranks, x)

    def summed_errors(self, key: int, numel: int, group, ranks: int, device) -> torch.Tensor:
        """Collective: every rank's worker error plus every server error, summed, over the flat
        tensor's `numel` elements; the errors are left as they are."""
        shard, n = self.layout(numel, ranks)
        worker = self.error(self.worker, key, (ranks, n), device)
        total = self.comm.reduced(worker, group)
        servers = torch.empty(ranks * n, dtype=torch.float32, device=device)
        self.comm.all_gather(servers, self.error(self.server, key, (n,), device), group)
        return self.from_rows(total + servers.view(ranks, n), numel)

    def own_errors(self, key: int) -> Dict[str, torch.Tensor]:
        """Copies of this rank's errors of `key` (what a checkpoint at the same layout restores)."""
        return {name: store[key].clone() for name, store in (("worker", self.worker), ("server", self.server))
                if key in store}

    def restore_errors(self, key: int, saved: Dict[str, torch.Tensor]) -> None:
        for name, store in (("worker", self.worker), ("server", self.server)):
            if name in saved:
                store[key] = saved[name].clone()
            else:
                store.pop(key, None)

    def set_worker(self, key: int, values: torch.Tensor, ranks: int) -> None:
        """This rank's worker error := `values` (flat, the tensor's layout); no server error."""
        rows = self.to_rows(values, ranks)
        self.error(self.worker, key, rows.shape, values.device).copy_(rows)
        self.error(self.server, key, (rows.shape[1],), values.device).zero_()


def qgz_node_size(dp: int, tp: int, hpz: int, local_world_size: Optional[int]) -> int:
    """Data-parallel ranks per node for two-hop qgZ: --zeropp-hpz-partition-size when given (DeepSpeed's
    ZeRO++ sets it to a node's GPUs), else torchrun's LOCAL_WORLD_SIZE over the TP ranks inside it
    (TP ranks are adjacent: a node holds LOCAL_WORLD_SIZE / tp consecutive DP x CP ranks). `dp` (one
    hop) when the DP group fits in a node, or nodes would not hold whole, equal parts of it."""
    if hpz > 1:
        node = hpz
    elif local_world_size and local_world_size % tp == 0:
        node = local_world_size // tp
    else:
        return dp
    return node if node < dp and dp % node == 0 else dp


class NodeHops:
    """Two-hop qgZ's groups over the DP group `group` of `nodes` x `size` ranks, rank = node * size +
    local: `intra` this rank's node (its `size` ranks), `inter` the ranks at its place in every node."""

    def __init__(self, group, intra, inter, size: int, nodes: int):
        self.group, self.intra, self.inter, self.size, self.nodes = group, intra, inter, size, nodes


def node_hops(dims, node_size: int) -> Optional[NodeHops]:
    """The groups of two-hop qgZ over `dims`' DP x CP group in nodes of `node_size` ranks (hpZ's
    groups when they exist: built once); None where one hop is all there is."""
    dp = group_size(dims.dp_cp_group)
    if node_size >= dp:
        return None
    intra, inter = partial_dp_groups(dims, dp // node_size)
    return NodeHops(dims.dp_cp_group, intra, inter, node_size, dp // node_size)


class CompressedReducer:
    """GradientSync's bucket reducer sending gradients as `fmt` (a FORMATS key), with error
    feedback (an ErrorFeedbackExchange keyed by bucket index), and the residual [the bucket's
    shard] a checkpoint load gave, added to the next reduced gradient.

    With `hops` (qgZ across nodes, DeepSpeed's all_to_all_quant_reduce) the sharded buckets of the
    DP group go in two hops: an all-to-all inside the node sends each node-mate the rows of the
    ranks at its place in every node; it decodes and sums them in fp32 (one row per node),
    re-encodes them with an error feedback of their own (`node_error`, [nodes, n] per bucket) and an
    all-to-all across nodes delivers each row to its owner. Cross-node bytes are 1/size of one hop's;
    the owner of each element is the same (row r: rank r's ZeRO shard).

    Without `error_feedback` neither hop keeps an error, and checkpoints get no residual from it
    (`checkpoints_residual`); a residual loaded from one written with error feedback is applied once."""

    residual_name = RESIDUAL

    def __init__(self, comm: Communicator, fmt: str, hops: Optional[NodeHops] = None, error_feedback: bool = True):
        self.comm, self.exchange, self.hops = comm, ErrorFeedbackExchange(comm, fmt, error_feedback), hops
        self.checkpoints_residual = error_feedback
        self.residual: Dict[int, torch.Tensor] = {}
        self.node_error: Dict[int, torch.Tensor] = {}

    def start(self, b):
        if b.group_size == 1:  # nothing to send: exact, like PlainReducer
            if b.sharded:
                b.reduce_out().copy_(b.grad_data)
            return None
        if self.hops is not None and b.sharded and b.group is self.hops.group:
            return self._start_two_hops(b)
        received, handle, n = self.exchange.scatter(b.index, b.grad_data, b.group, b.group_size, async_op=True)
        out = b.reduce_out() if b.sharded else None
        shard, _ = self.exchange.layout(b.numel, b.group_size)

        def land():
            summed = self.exchange.land(received, n, shard)
            if b.sharded:
                out.copy_(summed)
            else:  # ZeRO 0's second half: the summed pieces to every rank
                self.exchange.gather(b.index, summed, b.group, b.group_size, b.grad_data)
        return _Pending(handle, land, collective=not b.sharded)

    def _start_two_hops(self, b) -> _Pending:
        h, ex = self.hops, self.exchange
        payload, n = ex.encode_rows(b.index, b.grad_data, b.group_size)
        # node-mate j gets the rows of ranks (m, j) for every node m: [nodes, size, B] -> [size, nodes, B]
        swizzled = payload.view(h.nodes, h.size, -1).transpose(0, 1).reshape(b.group_size, -1)
        received = torch.empty_like(swizzled)
        handle = self.comm.all_to_all(received, swizzled, h.intra, async_op=True, kind="all_to_all_intra_node")
        out, shard = b.reduce_out(), ex.layout(b.numel, b.group_size)[0]

        def land():  # (collective: the cross-node all-to-all, issued at the same wait on every rank)
            per_node = ex.codec.decode(received, n).view(h.size, h.nodes, n).sum(dim=0)  # row m: rank (m, mine)'s
            if ex.error_feedback:
                error = ex.error(self.node_error, b.index, per_node.shape, per_node.device)
                per_node.add_(error)
            payload2, sent = ex.codec.encode(per_node)
            if ex.error_feedback:
                error.copy_(per_node - sent)
            got = torch.empty_like(payload2)
            self.comm.all_to_all(got, payload2, h.inter, kind="all_to_all_inter_node")
            out.copy_(ex.land(got, n, shard))
        return _Pending(handle, land, collective=True)

    def finish(self, b) -> None:
        if b.replica_group is not None:
            self.comm.all_reduce(b.grad_shard_view(), b.replica_group)
        residual = self.residual.pop(b.index, None)
        if residual is not None:  # a checkpoint's residual, added once
            b.grad_shard_view().add_(residual)

    # --- checkpoints ---------------------------------------------------------------------------
    def fold_for_checkpoint(self, b) -> torch.Tensor:
        """Collective over b's groups: the errors of every rank summed over this rank's shard (the
        whole bucket at ZeRO 0), plus a loaded residual not yet applied (fp32, shard-sized): what a
        load at another layout applies. The running job's errors stay as they are."""
        pending = self.residual.get(b.index)
        residual = torch.zeros(b.shard_numel, dtype=torch.float32, device=b.device) if pending is None \
            else pending.clone()
        worker = self.exchange.worker.get(b.index)
        if worker is None:
            return residual
        if b.sharded:  # (rows are the shards: a reduce-scatter of the rows gives this rank's)
            piece = torch.empty(worker.shape[1], dtype=torch.float32, device=b.device)
            self.comm.reduce_scatter(piece, worker.view(-1).clone(), b.group)
            if b.replica_group is not None:
                self.comm.all_reduce(piece, b.replica_group)
            node = self.node_error.get(b.index)
            if node is not None:  # two hops: row m of (m', mine)'s error is (m, mine)'s, summed across nodes
                across = torch.empty_like(piece)
                self.comm.reduce_scatter(across, node.view(-1).clone(), self.hops.inter)
                piece.add_(across)
            residual.add_(piece[:b.shard_numel])
        else:
            residual.add_(self.exchange.summed_errors(b.index, b.numel, b.group, b.group_size, b.device))
        return residual

    def own_errors(self, b) -> Dict[str, torch.Tensor]:
        """Copies of this rank's own error state of bucket b: its errors at each hop and a loaded
        residual not yet applied (a checkpoint at the same layout restores them exactly)."""
        out = self.exchange.own_errors(b.index)
        for name, store in (("node", self.node_error), ("pending", self.residual)):
            if b.index in store:
                out[name] = store[b.index].clone()
        return out

    def restore_own_errors(self, b, saved: Dict[str, torch.Tensor]) -> None:
        """Instead of the folded residual that residual_for_loading() filled: this rank's own state."""
        self.exchange.restore_errors(b.index, saved)
        for name, store in (("node", self.node_error), ("pending", self.residual)):
            if name in saved:
                store[b.index] = saved[name].clone()
            else:
                store.pop(b.index, None)

    def residual_for_loading(self, b) -> torch.Tensor:
        """The tensor a checkpoint load fills (a run resumed here starts with no errors of its own)."""
        for store in (self.exchange.worker, self.exchange.server, self.node_error):
            if b.index in store:
                store[b.index].zero_()
        self.residual[b.index] = torch.zeros(b.shard_numel, dtype=torch.float32, device=b.device)
        return self.residual[b.index]


def build_reducer(comm: Communicator, fmt: Optional[str], quantized_gradients: bool = False,
                  hops: Optional[NodeHops] = None, qgz_error_feedback: bool = False):
    """--grad-comm-dtype's reducer (error feedback), or --zeropp-quantized-gradients' (int4 blocks; in
    two `hops` when DP spans nodes; error feedback with --zeropp-qgz-error-feedback); None:
    GradientSync's default PlainReducer."""
    if quantized_gradients:
        return CompressedReducer(comm, "int4-blocks", hops, error_feedback=qgz_error_feedback)
    return None if fmt is None else CompressedReducer(comm, fmt)


class QuantizedWeightGather:
    """--zeropp-quantized-weights (ZeRO++'s qwZ): ZeRO-3's parameter all-gather sends each shard as
    int8 blocks with fp32 scales (about a quarter of fp32's bytes, half of bf16's); every rank,
    the owner too, computes with the dequantized weights, while the shards (the optimizer's
    params) stay exact. Checkpoints and gathered_params() gather exactly (zero3's `exact`)."""

    def __init__(self, comm: Communicator):
        self.comm, self.codec = comm, Int8BlockCodec()

    def start(self, b, full: torch.Tensor, shard: torch.Tensor) -> _Pending:
        n = -(-b.shard_numel // self.codec.align) * self.codec.align
        x = torch.zeros(1, n, dtype=torch.float32, device=full.device)
        x[0, :b.shard_numel] = shard
        payload, _ = self.codec.encode(x)
        gathered = torch.empty((b.group_size, payload.shape[1]), dtype=torch.uint8, device=full.device)
        handle = self.comm.all_gather(gathered, payload, b.group, async_op=True)

        def land():
            full.copy_(self.codec.decode(gathered, n)[:, :b.shard_numel].reshape(-1))
        return _Pending(handle, land, collective=False)
