"""--fp8-param-gather: ZeRO-1/2/3 all-gather the updated weights of FP8 GEMMs as FP8, one byte an
element instead of the params dtype's (ZeRO-1/2: after the step; ZeRO-3: each gather of a layer).

Each rank owns a shard of every bucket. For each weight the GEMMs run in
FP8 (Float8GemmPath marks it `fp8_gemm` on its first forward) the owner quantizes its part with
the full weight's tensorwise scale (the amax MAX-reduced over the bucket's group and TP, as the
GEMM reduces it) and the ranks gather those bytes; the other parameters of the bucket (norms,
embedding, output layer, router, biases) are gathered in their dtype. The gathered bytes are
dequantized into the parameters, so the GEMM quantizes them again to the same FP8 values (the
amax element maps to the fp8 maximum; every other element is already on the FP8 grid), with the
same scale to fp32 rounding. This rank's own shard keeps its exact values: at fp32 parameters it
is the main copy the optimizer updates (main params stay fp32); whoever reads the parameters
(GradientSync.gathered_params: checkpoints, tests) gets them gathered exactly.
"""
from __future__ import annotations

from typing import List, Tuple

import torch
import torch.distributed as dist

from .fp8 import FORMATS, quantize
from .sharding import spec_of

E4M3 = FORMATS["e4m3"]


class _Gathering:
    """The in-flight collectives of one bucket; wait() writes the other ranks' elements."""

    def __init__(self, handles: List, finish):
        self.handles, self.finish = handles, finish

    def wait(self) -> None:
        for h in self.handles:
            if h is not None:
                h.wait()
        self.finish()


def _units(b) -> List[Tuple[int, int, bool]]:
    """The bucket's parameters as (lo, hi, whether its GEMMs are FP8): one unit a parameter, one an
    expert of a stacked experts' weight (each expert's GEMMs scale by its own amax)."""
    out = []
    for p, (lo, hi) in zip(b.params, b.offsets):
        k = p.shape[0] if spec_of(p).split("ep") is not None else 1
        step = (hi - lo) // k
        out += [(lo + i * step, lo + (i + 1) * step, getattr(p, "fp8_gemm", False)) for i in range(k)]
    return out


class Fp8ParamGather:
    def __init__(self, dims, margin: int = 0):
        self.dims, self.margin = dims, margin

    def start(self, b, full=None, shard=None):
        """Gather bucket `b`'s updated parameters into `full` (default: its flat params), its FP8-GEMM
        weights as FP8, from this rank's `shard` (default: its part of them; ZeRO-3: the persistent
        shard, copied into `full` as it is); None where it has no FP8-GEMM weight."""
        if not any(getattr(p, "fp8_gemm", False) for p in b.params):
            return None
        full = b.param_data if full is None else full
        shard = full[b.shard] if shard is None else shard
        comm, n, rows, device = self.dims.comm, b.shard_numel, b.group_size, full.device
        units = _units(b)  # (lo, hi, FP8) bucket ranges, each quantized with one scale
        which = torch.full((b.numel,), len(units), dtype=torch.long, device=device)  # each position's unit
        for u, (lo, hi, _) in enumerate(units):
            which[lo:hi] = u
        mask = torch.tensor([fp8 for _, _, fp8 in units] + [False], device=device)[which]  # padding: False
        own = mask[b.shard]
        mine = [(u, max(lo, b.shard_lo) - b.shard_lo, min(hi, b.shard_lo + n) - b.shard_lo)
                for u, (lo, hi, fp8) in enumerate(units) if fp8 and max(lo, b.shard_lo) < min(hi, b.shard_lo + n)]
        amax = torch.zeros(len(units), device=device)
        for u, lo, hi in mine:
            amax[u] = shard[lo:hi].float().abs().max()
        comm.all_reduce(amax, b.group, op=dist.ReduceOp.MAX)  # the whole weight's: over the shards ...
        if self.dims.tp > 1:
            comm.all_reduce(amax, self.dims.tp_group, op=dist.ReduceOp.MAX)  # ... and TP's slices
        _, inv = quantize(amax.unsqueeze(1), E4M3, 1, self.margin)  # each unit's inverse scale, as the GEMM's
        q = torch.zeros(n, dtype=torch.uint8, device=device)
        for u, lo, hi in mine:
            qu, _ = quantize(shard[lo:hi], E4M3, None, self.margin, lambda a, v=amax[u]: a.copy_(v))
            q[lo:hi] = qu.view(torch.uint8)
        counts = mask.view(rows, n).sum(1).tolist()  # FP8 elements in each rank's shard
        fp8_out, fp8_in = self._padded(q[own], max(counts), rows)
        rest_out, rest_in = self._padded(shard[~own], n - min(counts), rows)
        handles = [comm.all_gather(fp8_out, fp8_in, b.group, async_op=True),
                   comm.all_gather(rest_out, rest_in, b.group, async_op=True)]
        if shard.data_ptr() != full[b.shard].data_ptr():
            full[b.shard] = shard

        def finish():
            theirs = torch.ones(b.numel, dtype=torch.bool, device=device)
            theirs[b.shard] = False
            gathered = torch.cat([fp8_out.view(rows, -1)[r, :c] for r, c in enumerate(counts)])
            values = gathered.view(E4M3).float() * inv.view(-1)[which[mask]]
            keep = theirs[mask]
            full[mask & theirs] = values[keep].to(b.dtype)
            rest = torch.cat([rest_out.view(rows, -1)[r, :n - c] for r, c in enumerate(counts)])
            full[~mask & theirs] = rest[theirs[~mask]]
        return _Gathering(handles, finish)

    @staticmethod
    def _padded(values: torch.Tensor, width: int, rows: int):
        """(out [rows x width], this rank's `values` padded to width): an all-gather of uneven parts."""
        inp = values.new_zeros(width)
        inp[:values.numel()] = values
        return values.new_empty(rows * width), inp
