"""How a parameter on this rank is cut from its full, layout-independent tensor.

Every parameter carries one frozen `ShardSpec` (`param.shard_spec`), set by the layer that creates
it. It is the only description of the cut: initialization draws the full tensor and keeps
`spec.shard(full)`, gradient finalization sums what `spec` says is partial, the optimizer and
the global norm count each distinct element once (`counts_in_norm`), checkpoints map local boxes to
full boxes (`spec.local_to_full`), and conversion pads, shards and gathers through it.

A full tensor may be split along several dimensions, each over one parallel axis (`Split`):
  "tp"  tensor parallelism (expert tensor parallelism uses the same axis, over the ETP group:
        `tp_axis_group`): the full dimension is a
        concatenation of segments ([Q | K | V], [gate | up]), each split evenly, and a rank holds
        its piece of every segment; `replicas` consecutive ranks may hold the same piece
        (grouped-query K/V when there are fewer groups than TP ranks);
  "ep"  expert parallelism: the expert dimension of a stacked expert weight.
Vocabulary rows past `stored_rows` (padding, which depends on TP) are zero and never stored, so
stored shapes do not depend on the layout. A `Tie` marks the copies of one weight held on two
pipeline stages (tied embeddings): both are stored and initialized under the tie's name, their
gradients are summed, and only the primary counts.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, replace
from typing import List, Optional, Sequence, Tuple

import torch
import torch.nn as nn


Box = Tuple[Tuple[int, int], ...]  # per dimension: (start, length)
INITS = ("normal", "normal_scaled", "ones", "zeros", "a_log", "log_arange")  # a_log: log U(1, 16), a decay rate
# per head (delta rules); log_arange: log(1 + row index) (Mamba-2's A = -(1, 2, ..., heads))


@dataclass(frozen=True)
class Split:
    dim: int
    axis: str  # "tp" or "ep"
    shards: int  # distinct pieces along `dim`
    index: int  # the piece this rank holds
    segments: Tuple[int, ...]  # full sizes of the segments concatenated along `dim`
    replicas: int = 1  # consecutive ranks of the axis holding the same piece

    def intervals(self, start: int, length: int) -> List[Tuple[Tuple[int, int], Tuple[int, int]]]:
        """A local interval along `dim` as (local, full) interval pairs, one per segment it meets."""
        out, local_start, full_start = [], 0, 0
        for seg in self.segments:
            n = seg // self.shards
            lo, hi = max(start, local_start), min(start + length, local_start + n)
            if lo < hi:
                out.append(((lo, hi - lo), (full_start + self.index * n + lo - local_start, hi - lo)))
            local_start += n
            full_start += seg
        return out


@dataclass(frozen=True)
class Tie:
    name: str  # the global name both copies are stored and initialized under
    primary: bool  # the copy that counts (the first pipeline stage's)


@dataclass(frozen=True)
class ShardSpec:
    full_shape: Tuple[int, ...]  # the full tensor in this layout (vocabulary padded for TP)
    splits: Tuple[Split, ...] = ()
    stored_rows: Optional[int] = None  # rows of dim 0 that exist (the true vocabulary)
    sequence_parallel: bool = False  # whole on every TP rank, but its gradient is partial there: each rank saw
    #                                  only its sequence slice (SP) or its attention heads (q/k norms)
    tie: Optional[Tie] = None
    init: str = "normal"  # normal | normal_scaled (projections into the residual stream) | ones | zeros | log_arange

    @property
    def local_shape(self) -> Tuple[int, ...]:
        shape = list(self.full_shape)
        for s in self.splits:
            shape[s.dim] //= s.shards
        return tuple(shape)

    @property
    def stored_shape(self) -> Tuple[int, ...]:
        if self.stored_rows is None:
            return self.full_shape
        return (self.stored_rows,) + self.full_shape[1:]

    def split(self, axis: str) -> Optional[Split]:
        return next((s for s in self.splits if s.axis == axis), None)

    def replicas(self, axis: str) -> int:
        """Ranks of `axis` holding each piece: the split's replicas, or the whole axis if unsplit (0)."""
        s = self.split(axis)
        return s.replicas if s is not None else 0

    # --- tensors ------------------------------------------------------------------------------
    def shard(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's piece of `full` (shaped full_shape: vocabulary padded)."""
        for s in self.splits:
            n = [seg // s.shards for seg in s.segments]
            full = torch.cat([seg.narrow(s.dim, s.index * k, k) for seg, k in
                              zip(full.split(list(s.segments), dim=s.dim), n)], dim=s.dim)
        return full

    def unshard(self, pieces: Sequence[torch.Tensor], axis: str = "tp") -> torch.Tensor:
        """Inverse of `shard` along `axis`: the tensor from every piece in axis-rank order (one per
        rank of the axis, replicas included)."""
        s = self.split(axis)
        if s is None:
            return pieces[0]
        distinct = list(pieces[:: s.replicas])
        local = [seg // s.shards for seg in s.segments]
        per_rank = [p.split(local, dim=s.dim) for p in distinct]
        return torch.cat([torch.cat([r[i] for r in per_rank], dim=s.dim) for i in range(len(local))], dim=s.dim)

    def pad(self, stored: torch.Tensor) -> torch.Tensor:
        """A stored (true-vocabulary) tensor with zero rows up to this layout's padded rows."""
        missing = self.full_shape[0] - stored.shape[0] if self.stored_rows is not None else 0
        return stored if missing <= 0 else torch.cat([stored, stored.new_zeros((missing,) + tuple(stored.shape[1:]))])

    def trim(self, full: torch.Tensor) -> torch.Tensor:
        """Inverse of `pad`: the stored rows only."""
        return full if self.stored_rows is None else full[: self.stored_rows]

    # --- checkpoint geometry ------------------------------------------------------------------
    def local_to_full(self, box: Box) -> List[Tuple[Box, Box]]:
        """(local sub-box, full box) pairs covering the stored part of a box of the local tensor."""
        per_dim = []
        for d, (start, length) in enumerate(box):
            s = next((x for x in self.splits if x.dim == d), None)
            per_dim.append(s.intervals(start, length) if s is not None else [((start, length), (start, length))])
        out = []
        for combo in itertools.product(*per_dim):
            local, full = tuple(c[0] for c in combo), tuple(c[1] for c in combo)
            if self.stored_rows is not None and full:  # drop padding rows (dim 0 maps by an offset)
                keep = min(full[0][1], self.stored_rows - full[0][0])
                if keep <= 0:
                    continue
                local = ((local[0][0], keep),) + local[1:]
                full = ((full[0][0], keep),) + full[1:]
            out.append((local, full))
        return out


# --- attaching specs ----------------------------------------------------------------------------
def set_spec(param: nn.Parameter, spec: ShardSpec) -> nn.Parameter:
    assert tuple(param.shape) == spec.local_shape, f"parameter {tuple(param.shape)} != spec {spec.local_shape}"
    assert spec.init in INITS, spec.init
    param.shard_spec = spec
    return param


def spec_of(param: nn.Parameter) -> ShardSpec:
    """The parameter's spec; a plain parameter (no layer set one) is whole on every rank."""
    spec = getattr(param, "shard_spec", None)
    if spec is None:
        spec = param.shard_spec = ShardSpec(tuple(param.shape))
    return spec


def tp_split(dims, dim: int, full_size: int, segments: Optional[Sequence[int]] = None, replicas: int = 1) -> Split:
    """The split of dimension `dim` (full size `full_size`) over this rank's TP group."""
    shards = dims.tp // replicas
    segments = tuple(segments or (full_size,))
    for seg in segments:
        assert seg % shards == 0, f"segment {seg} is not divisible into {shards} tensor-parallel shards"
    return Split(dim, "tp", shards, dims.tp_rank // replicas, segments, replicas)


def stored_name(name: str, param: nn.Parameter) -> str:
    """The layout-independent name a parameter is stored and initialized under."""
    tie = spec_of(param).tie
    return tie.name if tie is not None else name


def with_tie(param: nn.Parameter, name: str, primary: bool) -> None:
    param.shard_spec = replace(spec_of(param), tie=Tie(name, primary))


def replicated(shape: Sequence[int], sequence_parallel: bool = False, init: str = "normal") -> ShardSpec:
    """A parameter every TP rank holds whole (under SP its gradient is partial: summed over TP)."""
    return ShardSpec(tuple(shape), sequence_parallel=sequence_parallel, init=init)


def counts_in_norm(param: nn.Parameter, dims) -> bool:
    """True on exactly one of the model-parallel ranks holding each distinct element."""
    spec = spec_of(param)
    if spec.tie is not None and not spec.tie.primary:
        return False  # the other pipeline stage's copy of a tied weight
    if spec.split("ep") is not None:
        return True  # experts: every piece on the ETP x EP x PP ranks (expert_mp) is distinct
    replicas = spec.replicas("tp")
    return dims.tp_rank == 0 if replicas == 0 else dims.tp_rank % replicas == 0


def gather_full(t: torch.Tensor, param: nn.Parameter, dims) -> torch.Tensor:
    """The stored full tensor of `t`, a tensor shaped like `param` on this rank (its data or
    gradient): all-gathered over TP (collective), vocabulary padding dropped."""
    spec = spec_of(param)
    s = spec.split("tp")
    t = t.detach()
    if s is None or s.shards == 1:
        return spec.trim(t.clone())
    group, size = tp_axis_group(param, dims)
    moved = t.movedim(s.dim, 0).contiguous()
    out = torch.empty((size * moved.shape[0],) + tuple(moved.shape[1:]), dtype=t.dtype, device=t.device)
    dims.comm.all_gather(out, moved, group)
    return spec.trim(spec.unshard([x.movedim(0, s.dim) for x in out.chunk(size, dim=0)]))


def tp_axis_group(param: nn.Parameter, dims):
    """(group, size) of the ranks along the parameter's "tp" axis: the expert TP group for
    experts (ETP, which need not be TP under MoE parallel folding), else the TP group."""
    if spec_of(param).split("ep") is not None:
        return dims.etp_group, dims.etp
    return dims.tp_group, dims.tp
