"""The data-parallel collectives of one step on one rank, each with the bytes the trainer's
--log-comm-volume counts for it (parallel/comm.py's CommCounter: a collective's whole buffer, every
rank's share of it, under the counter's name) and the group it runs over, so that timing.py prices
each on the links its group's placement gives.

What each bucket moves (a bucket of `numel` elements over a group of N ranks):
  - plain: ZeRO 0 all-reduces the gradient buffer (--grad-dtype), ZeRO 1-3 reduce-scatter it;
    ZeRO 1-2 all-gather the updated params once a step, ZeRO-3 before every use (parameter dtype,
    --fp8-param-gather: one byte an FP8 GEMM's weight element);
  - --grad-comm-dtype / --zeropp-quantized-gradients (parallel/compression.py): one all-to-all of
    N encoded rows (ZeRO 0: and an all-gather of N more, each owner's sum); qgZ over nodes goes in
    two hops, N rows inside the node, then one row a node across the nodes;
  - --zeropp-quantized-weights: ZeRO-3's gathers move N int8-block rows; --zeropp-hpz-partition-size:
    backward's gathers of the dense buckets run inside the hpZ group, in the parameter dtype;
  - --optimizer adam-1bit / adam-01, in the steady state after the freeze: no gradient reduction;
    the optimizer step sends each bucket's momentum (0/1 Adam: the params' move at each
    synchronisation, every step with its default --local-step-scaler) as signs, an all-to-all and
    an all-gather of N rows. The warm-up's fp32 all-reduces (and 0/1 Adam's variance steps, and
    its local steps once the interval grows) are not priced.
Encoded sizes come from the codec objects themselves (encoded_bytes), scales and padding included.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

import torch

from ..parallel.bucket_plan import feedback_rows, row_runs
from ..parallel.compression import codec
from .hardware import Hardware, all_to_all_seconds, ring_seconds
from .layout import Layout
from .state import gathered_bytes, qgz_nodes, rank_bucket_params

REDUCE, GATHER, GATHER_BACKWARD, OPTIMIZER = "reduce", "gather", "gather backward", "optimizer step"
ONE_BIT_OPTIMIZERS = ("adam-1bit", "adam-01")


def encoded_bytes(fmt: str, numel: int, ranks: int, rows: Optional[int] = None) -> int:
    """Bytes of `rows` (default: `ranks`) rows of a flat tensor of `numel` elements cut into `ranks`
    rows and encoded in `fmt` (compression.codec's names: bf16, fp8-*, int4-blocks, int8-blocks,
    sign), each row padded to whole codec blocks and carrying its scales: what the trainer's
    compressed exchanges send (ErrorFeedbackExchange, QuantizedWeightGather)."""
    c = codec(fmt)
    _, n = feedback_rows(numel, ranks, c.align)
    return (ranks if rows is None else rows) * c.row_bytes(n)


@dataclass(frozen=True)
class Transfer:
    kind: str  # CommCounter's name for it
    nbytes: int  # the buffer it counts
    size: int  # ranks in its group
    stride: int  # rank distance between them (Megatron's order)
    phase: str  # REDUCE (each reduction round), GATHER / GATHER_BACKWARD (each gather), OPTIMIZER (once a step)

    def seconds(self, hw: Hardware) -> float:
        if self.kind.startswith("all_to_all"):
            return all_to_all_seconds(hw, self.nbytes, self.size, self.stride)
        factor = 2 * (self.size - 1) / self.size if self.kind == "all_reduce" else (self.size - 1) / self.size
        return ring_seconds(hw, factor * self.nbytes, self.size, self.stride)


def sign_bytes(sizes: Sequence[int], numel: int, ranks: int) -> int:
    """1-bit / 0/1 Adam's encoded rows of a bucket of tensors of `sizes` (laid back to back): each
    row carries as many scales as the most tensors a row meets (SignCodec with runs)."""
    c = codec("sign")
    offsets = [(sum(sizes[:i]), sum(sizes[:i + 1])) for i in range(len(sizes))]
    per_row = max(1, max(len(r) for r in row_runs(offsets, numel, ranks, c.align)))
    return ranks * c.row_bytes(feedback_rows(numel, ranks, c.align)[1], per_row)


def bucket_transfers(lay: Layout, numel: int, gathered: int, expert: bool,
                     local_world_size: Optional[int], sizes: Sequence[int] = ()) -> List[Transfer]:
    """The transfers of one bucket of `numel` elements (`gathered`: its plain all-gather's bytes;
    `sizes`: its tensors' elements in bucket order)."""
    n, stride = (lay.edp, lay.etp * lay.ep) if expert else (lay.dp * lay.cp, lay.tp)
    if n <= 1:
        return []
    out: List[Transfer] = []
    if lay.optimizer in ONE_BIT_OPTIMIZERS:  # (ZeRO 0 only; a sign scale per tensor and row)
        signs = sign_bytes(sizes, numel, n)
        return [Transfer("all_to_all", signs, n, stride, OPTIMIZER), Transfer("all_gather", signs, n, stride, OPTIMIZER)]
    fmt = "int4-blocks" if lay.zeropp_quantized_gradients else lay.grad_comm_dtype
    nodes = qgz_nodes(lay, local_world_size) if not expert and lay.zero_stage >= 1 else 1
    if fmt is None:
        kind = "all_reduce" if lay.zero_stage == 0 else "reduce_scatter"
        out.append(Transfer(kind, numel * torch.empty((), dtype=lay.grad_dtype).element_size(), n, stride, REDUCE))
    elif nodes > 1:  # two-hop qgZ: the node's ranks, then the ranks at this place in every node
        size = n // nodes
        out += [Transfer("all_to_all_intra_node", encoded_bytes(fmt, numel, n), size, stride, REDUCE),
                Transfer("all_to_all_inter_node", encoded_bytes(fmt, numel, n, rows=nodes), nodes, stride * size,
                         REDUCE)]
    else:
        out.append(Transfer("all_to_all", encoded_bytes(fmt, numel, n), n, stride, REDUCE))
        if lay.zero_stage == 0:
            out.append(Transfer("all_gather", encoded_bytes(fmt, numel, n), n, stride, REDUCE))
    if lay.zero_stage == 0:
        return out
    forward = (Transfer("all_gather", encoded_bytes("int8-blocks", numel, n), n, stride, GATHER)
               if lay.zeropp_quantized_weights and lay.zero_stage == 3 else
               Transfer("all_gather", gathered, n, stride, GATHER))
    out.append(forward)
    if lay.zero_stage == 3 and lay.reshard_after_forward:
        hpz = lay.zeropp_hpz_partition_size
        if hpz > 1 and not expert:  # from the secondary partition, exact values, inside the group
            out.append(Transfer("all_gather_hpz", numel * torch.empty((), dtype=lay.params_dtype).element_size(),
                                hpz, lay.tp, GATHER_BACKWARD))
        else:
            out.append(Transfer(forward.kind, forward.nbytes, n, stride, GATHER_BACKWARD))
    return out


def rounds(lay: Layout, phase: str) -> int:
    """How many times a step runs a transfer of `phase`."""
    m = lay.num_microbatches
    if phase == REDUCE:
        return m if lay.grad_reduce_per_microbatch else 1
    if phase in (GATHER, GATHER_BACKWARD):
        return m if lay.zero_stage == 3 and lay.reshard_after_forward else 1
    return 1


def transfers_of(lay: Layout, bucket_params, local_world_size: Optional[int]) -> List[List[Transfer]]:
    """Per bucket of state.rank_bucket_params' list: its transfers."""
    return [bucket_transfers(lay, b.numel, gathered_bytes(b, params, lay.fp8_param_gather), b.expert, local_world_size,
                             [p.numel for p in params])
            for b, params in bucket_params]


def dp_bytes_per_step(num_layers: int, lay: Layout, pp_rank: int, inventory,
                      local_world_size: Optional[int] = None) -> Dict[str, int]:
    """Bytes per CommCounter kind that a step's data-parallel communication moves on a rank of
    pipeline stage `pp_rank` (nodes of `local_world_size` ranks: where two-hop qgZ splits)."""
    total: Counter = Counter()
    bucket_params = rank_bucket_params(num_layers, lay, pp_rank, inventory)
    for transfers in transfers_of(lay, bucket_params, local_world_size):
        for t in transfers:
            total[t.kind] += t.nbytes * rounds(lay, t.phase)
    return dict(total)
