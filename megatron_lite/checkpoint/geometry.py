"""Where a rank's pieces of a tensor sit inside the full, layout-independent tensor.

A checkpoint stores every tensor by its global name and FULL shape; each stored piece is a box
(per dimension: start, length) in full coordinates. This module maps what a rank holds onto such
boxes, in two steps:

1. a flat range of a rank's TP-local tensor (ZeRO shards are flat ranges of a bucket, hence of
   its parameters) -> local boxes, each a contiguous run of the flat tensor (partial row, full
   rows, partial row; generalised to N dimensions);
2. a local box -> full boxes through the tensor-parallel cut (`ShardSpec`): the full tensor is
   a concatenation of segments along `partition_dim` ([K | V], [gate | up]), each split evenly
   over `tp / replicas` distinct pieces; vocabulary padding (rows past `stored_rows`, which
   depend on TP) is dropped, so stored shapes do not depend on the layout.

Nothing here touches a process group or a file: the unit tests cover it exhaustively.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, NamedTuple, Optional, Sequence, Tuple

import torch

Box = Tuple[Tuple[int, int], ...]  # per dimension: (start, length)


def box_volume(box: Box) -> int:
    return math.prod(n for _, n in box)


def whole_box(shape: Sequence[int]) -> Box:
    return tuple((0, n) for n in shape)


def intersect(a: Box, b: Box) -> Optional[Box]:
    """The common part of two boxes, None when they do not overlap."""
    out = []
    for (s1, n1), (s2, n2) in zip(a, b):
        lo, hi = max(s1, s2), min(s1 + n1, s2 + n2)
        if lo >= hi:
            return None
        out.append((lo, hi - lo))
    return tuple(out)


def relative_slices(box: Box, origin: Box) -> Tuple[slice, ...]:
    """Slices selecting `box` inside a tensor that holds `origin` (box must lie inside origin)."""
    return tuple(slice(s - o, s - o + n) for (s, n), (o, _) in zip(box, origin))


def flat_range_to_boxes(shape: Sequence[int], lo: int, hi: int) -> List[Tuple[int, Box]]:
    """Cover flat elements [lo, hi) of a contiguous tensor of `shape` with boxes, each of which is
    itself a contiguous flat run. Returns (flat start, box) pairs in flat order."""
    if not shape:
        return [(0, ())] if lo < hi else []
    return [(start, box) for start, box in _flat_boxes(tuple(shape), lo, hi, 0) if box_volume(box)]


def _flat_boxes(shape: Tuple[int, ...], lo: int, hi: int, base: int) -> List[Tuple[int, Box]]:
    if lo >= hi:
        return []
    if len(shape) == 1:
        return [(base + lo, ((lo, hi - lo),))]
    inner = math.prod(shape[1:])
    rest = tuple((0, n) for n in shape[1:])

    def within_row(row: int, a: int, b: int) -> List[Tuple[int, Box]]:
        return [(s, ((row, 1),) + box) for s, box in _flat_boxes(shape[1:], a, b, base + row * inner)]

    r0, r1 = lo // inner, hi // inner
    if r0 == r1:
        return within_row(r0, lo - r0 * inner, hi - r0 * inner)
    out = []
    if lo % inner:  # partial first row
        out += within_row(r0, lo % inner, inner)
        r0 += 1
    if r1 > r0:  # full rows
        out.append((base + r0 * inner, ((r0, r1 - r0),) + rest))
    if hi % inner:  # partial last row
        out += within_row(r1, 0, hi % inner)
    return out


@dataclass(frozen=True)
class ShardSpec:
    """How one rank's TP-local tensor is cut from the full tensor."""
    local_shape: Tuple[int, ...]
    full_shape: Tuple[int, ...]  # as this layout holds it (vocabulary padded)
    partition_dim: Optional[int] = None  # None: every TP rank holds the whole tensor
    segments: Tuple[int, ...] = ()  # sizes along partition_dim of the concatenated full segments
    shards: int = 1  # distinct pieces (tp / replicas)
    index: int = 0  # the piece this rank holds
    stored_rows: Optional[int] = None  # rows of dim 0 kept in the checkpoint (true vocabulary)

    @property
    def stored_shape(self) -> Tuple[int, ...]:
        if self.stored_rows is None:
            return self.full_shape
        return (self.stored_rows,) + self.full_shape[1:]

    def local_to_full(self, box: Box) -> List[Tuple[Box, Box]]:
        """(local sub-box, full box) pairs covering the stored part of a local box."""
        pairs = [(box, box)] if self.partition_dim is None else self._through_segments(box)
        return [p for p in (self._trim(lb, fb) for lb, fb in pairs) if p is not None]

    def _through_segments(self, box: Box) -> List[Tuple[Box, Box]]:
        d = self.partition_dim
        start, length = box[d]
        out, local_start, full_start = [], 0, 0
        for seg in self.segments:
            n = seg // self.shards
            lo, hi = max(start, local_start), min(start + length, local_start + n)
            if lo < hi:
                full_lo = full_start + self.index * n + (lo - local_start)
                local = box[:d] + ((lo, hi - lo),) + box[d + 1:]
                full = box[:d] + ((full_lo, hi - lo),) + box[d + 1:]
                out.append((local, full))
            local_start += n
            full_start += seg
        return out

    def _trim(self, local: Box, full: Box) -> Optional[Tuple[Box, Box]]:
        """Drop vocabulary padding: full rows at or past stored_rows (dim 0 maps by an offset)."""
        if self.stored_rows is None or not full:
            return local, full
        (s, n), (ls, _) = full[0], local[0]
        keep = min(n, self.stored_rows - s)
        if keep <= 0:
            return None
        return ((ls, keep),) + local[1:], ((s, keep),) + full[1:]


def spec_of(param: torch.nn.Parameter, local_shape: Sequence[int], tp_rank: int, tp: int) -> ShardSpec:
    """The ShardSpec of a parameter built by parallel/tensor_parallel.py (its TP metadata).
    `local_shape` is given because a ZeRO-3 parameter's storage is freed between uses."""
    local = tuple(local_shape)
    rows = getattr(param, "vocab_rows", None)
    if not getattr(param, "tensor_model_parallel", False) or tp == 1:
        return ShardSpec(local, tuple(param.full_shape), stored_rows=rows)
    replicas = getattr(param, "tp_replicas", 1)
    return ShardSpec(local, tuple(param.full_shape), param.partition_dim, tuple(param.tp_segments),
                     tp // replicas, tp_rank // replicas, rows)


class Run(NamedTuple):
    """Part of a flat range: the contiguous run flat[start:start + volume(box)] holds local `box`;
    its sub-box `local` (local coordinates) is the piece `full` of the full tensor."""
    start: int
    box: Box
    local: Box
    full: Box

    def view(self, flat: torch.Tensor, offset: int = 0) -> torch.Tensor:
        """This run's `local` sub-box as a view of `flat`, a 1-D tensor in which local flat
        element j sits at index j + offset (e.g. a ZeRO shard of the bucket holding the tensor)."""
        lo = self.start + offset
        run = flat[lo:lo + box_volume(self.box)].view([n for _, n in self.box])
        return run[relative_slices(self.local, self.box)]


def flat_range_to_full(spec: ShardSpec, lo: int, hi: int) -> List[Run]:
    """Flat elements [lo, hi) of a rank's local tensor, as pieces of the full tensor."""
    return [Run(start, box, local, full) for start, box in flat_range_to_boxes(spec.local_shape, lo, hi)
            for local, full in spec.local_to_full(box)]
