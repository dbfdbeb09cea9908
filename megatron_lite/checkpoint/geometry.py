"""Where a rank's pieces of a tensor sit inside the full, layout-independent tensor.

A checkpoint stores every tensor by its global name and FULL shape; each stored piece is a box
(per dimension: start, length) in full coordinates. This module maps what a rank holds onto such
boxes, in two steps:

1. a flat range of a rank's local tensor (ZeRO shards are flat ranges of a bucket, hence of
   its parameters) -> local boxes, each a contiguous run of the flat tensor (partial row, full
   rows, partial row; generalised to N dimensions);
2. a local box -> full boxes through the parameter's cut, `ShardSpec.local_to_full`
   (parallel/sharding.py): segments split over TP, experts over EP, vocabulary padding dropped.

Nothing here touches a process group or a file: the unit tests cover it exhaustively.
"""
from __future__ import annotations

import math
from typing import List, NamedTuple, Optional, Sequence, Tuple

import torch

from ..parallel.sharding import Box, ShardSpec


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
