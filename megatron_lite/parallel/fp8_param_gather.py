"""--fp8-param-gather: ZeRO-1/2/3 all-gather the updated weights of FP8 GEMMs as FP8, one byte an
element instead of the params dtype's (ZeRO-1/2: after the step; ZeRO-3: each gather of a layer).

Each rank owns a shard of every bucket. For each weight the GEMMs run in FP8 (Float8GemmPath
marks it `fp8_gemm` on its first forward) the owner quantizes its part with the scale the GEMM
will use, and the ranks gather those bytes; the other parameters of the bucket (norms,
embedding, output layer, router, biases) are gathered in their dtype. The scale is per unit: a
weight, or one expert of the stacked experts' weight (tensorwise: the amax of the whole unit,
MAX-reduced over the bucket's group and TP, as the GEMM reduces it; delayed: the recipe state's
weight scale, folded from this step's amaxes before the gather, or current scaling before the
first fold), or per 128x128 block of it (blockwise: ZeRO's shard boundaries cut blocks, so a
block's amax is MAX-reduced over the bucket's group; TP shards hold whole blocks).

The gathered bytes become values the GEMM quantizes to the same FP8 bytes with the same scale:
each FP8 value q stands for any value that rounds to q, and the one written is q / scale clamped
to the unit's true amax, or that amax itself where q is the amax's own FP8 value. The gathered
weight's amax (per unit, per block) is then the true one exactly: current scaling recomputes the
same scale, and delayed scaling records the same amax history, as with the plain gather. This
rank's own shard keeps its exact values: at fp32 parameters it is the main copy the optimizer
updates (main params stay fp32); whoever reads the parameters (GradientSync.gathered_params:
checkpoints, tests) gets them gathered exactly, and so does a checkpoint load (no step has set the
delayed scales yet).
"""
from __future__ import annotations

from typing import List, Optional

import torch
import torch.distributed as dist

from .fp8 import FORMATS, local_gemm_names
from .fp8_blocks import BLOCK
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


class _Units:
    """A bucket's elements by scale unit: `which` [numel + 1] (the last: padding) the unit of
    each, `fp8` [units + 1] whether its GEMMs are FP8, `names` the recipe-state name of each
    unit's GEMM (delayed scaling), `param` whether a unit is a whole weight (TP amax reduction)."""

    def __init__(self, b, blockwise: bool):
        which = torch.full((b.numel,), -1, dtype=torch.long)
        fp8, names = [], []
        for p, (lo, hi) in zip(b.params, b.offsets):
            gemm, spec = getattr(p, "fp8_gemm", False), spec_of(p)
            experts, shape = spec.split("ep") is not None, torch.Size(spec.local_shape)  # (ZeRO-3: p may be freed)
            per_expert = local_gemm_names(p, shape[0]) if gemm else [None] * (shape[0] if experts else 1)
            shape = shape[1:] if experts else shape
            for e, name in enumerate(per_expert):
                step = (hi - lo) // len(per_expert)
                ids = _block_ids(shape) if blockwise and gemm else torch.zeros(shape.numel(), dtype=torch.long)
                which[lo + e * step:lo + (e + 1) * step] = ids + len(fp8)
                n = int(ids.max()) + 1 if ids.numel() else 1
                fp8 += [gemm] * n
                names += [name] * n
        pad = len(fp8)
        self.which = torch.where(which < 0, pad, which)
        self.fp8 = torch.tensor(fp8 + [False])
        self.names, self.count, self.key = names, pad + 1, tuple(getattr(p, "fp8_gemm", False) for p in b.params)

    def to(self, device):
        self.which, self.fp8 = self.which.to(device), self.fp8.to(device)
        return self


def _block_ids(shape) -> torch.Tensor:
    """Each element's 128x128 block of a 2-D weight [out, in], row-major block numbering."""
    rows, cols = shape
    per_row = -(-cols // BLOCK)
    return ((torch.arange(rows)[:, None] // BLOCK) * per_row + torch.arange(cols)[None, :] // BLOCK).reshape(-1)


class Fp8ParamGather:
    def __init__(self, dims, margin: int = 0, recipe: str = "tensorwise"):
        self.dims, self.margin, self.recipe = dims, margin, recipe
        self.delayed = None  # delayed scaling's recipe state (bind_recipe)

    def bind_recipe(self, delayed) -> None:
        self.delayed = delayed

    def start(self, b, full=None, shard=None):
        """Gather bucket `b`'s updated parameters into `full` (default: its flat params), its FP8-GEMM
        weights as FP8, from this rank's `shard` (default: its part of them; ZeRO-3: the persistent
        shard, copied into `full` as it is); None where it has no FP8-GEMM weight (or, delayed
        scaling at ZeRO-1/2, where no step has run: a checkpoint load), for the plain gather."""
        if not any(getattr(p, "fp8_gemm", False) for p in b.params):
            return None
        if self.delayed is not None and full is None and not self.delayed.fold_before_gather():
            return None
        full = b.param_data if full is None else full
        shard = full[b.shard] if shard is None else shard
        comm, n, rows, device = self.dims.comm, b.shard_numel, b.group_size, full.device
        units = self._units(b, device)
        own_which = units.which[b.shard]
        own = units.fp8[own_which]
        amax = torch.zeros(units.count, device=device).scatter_reduce_(0, own_which, shard.float().abs(), "amax")
        comm.all_reduce(amax, b.group, op=dist.ReduceOp.MAX)  # each unit's (each block's) amax on this TP rank
        scale = self._scales(amax, units)
        q = (shard.float() * scale[own_which]).clamp(-448.0, 448.0).to(E4M3).view(torch.uint8)
        mask = units.fp8[units.which]  # padding: not FP8
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
            keep = theirs[mask]
            u = units.which[mask][keep]
            full[mask & theirs] = _representatives(gathered.view(E4M3)[keep].float(), scale[u], amax[u]).to(b.dtype)
            rest = torch.cat([rest_out.view(rows, -1)[r, :n - c] for r, c in enumerate(counts)])
            full[~mask & theirs] = rest[theirs[~mask]]
        return _Gathering(handles, finish)

    def _units(self, b, device) -> _Units:
        units: Optional[_Units] = getattr(b, "fp8_units", None)
        if units is None or units.key != tuple(getattr(p, "fp8_gemm", False) for p in b.params):
            units = b.fp8_units = _Units(b, self.recipe == "blockwise").to(device)
        return units

    def _scales(self, amax: torch.Tensor, units: _Units) -> torch.Tensor:
        """Each unit's scale, as the GEMM will take it (see the module doc)."""
        current = amax
        if self.recipe != "blockwise" and self.dims.tp > 1:  # a tensorwise amax spans TP's slices
            current = amax.clone()
            self.dims.comm.all_reduce(current, self.dims.tp_group, op=dist.ReduceOp.MAX)
        scale = torch.where(current > 0, 448.0 / current / 2.0 ** self.margin, torch.ones_like(current))
        if self.delayed is not None:
            for u, name in enumerate(units.names):
                folded = self.delayed.scale_of(name, "weight") if name is not None else None
                if folded is not None:
                    scale[u] = folded
        return scale

    @staticmethod
    def _padded(values: torch.Tensor, width: int, rows: int):
        """(out [rows x width], this rank's `values` padded to width): an all-gather of uneven parts."""
        inp = values.new_zeros(width)
        inp[:values.numel()] = values
        return values.new_empty(rows * width), inp


def _representatives(q: torch.Tensor, scale: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    """A value that quantizes to FP8 value q (as float) at `scale` with its unit's true `amax` as
    the largest: q / scale within +-amax, and amax itself for q = the amax's own FP8 value
    (quantizing rounds monotonically: anything between an element and its q rounds to q)."""
    top = (amax * scale).clamp(-448.0, 448.0).to(E4M3).float()
    values = torch.minimum((q * scale.reciprocal()).abs(), amax) * q.sign()
    return torch.where(q.abs() == top, q.sign() * amax, values)
