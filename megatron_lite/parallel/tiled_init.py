"""Layout-independent initialization that never builds a full tensor.

Every parameter's full tensor (its stored shape: the true vocabulary, no padding) is defined as
a grid of fixed-size tiles, and tile t of parameter `name` is drawn whole from a generator seeded
by (seed, name, t). A rank fills its own piece of a parameter (a TP slice and its segments, K/V
replicas, its EP experts, a ZeRO-3 flat range of the local tensor) by drawing only the tiles that
meet it and copying their intersections: the values do not depend on the layout, and a rank
holds at most one tile besides its own parameters. Vocabulary rows past the stored rows (TP
padding) are zeros, not drawn.

Tiles. For a stored shape (d0, ..., dn) a tile spans 1 along every leading dimension and
(min(d[n-1], rows), min(dn, cols)) along the last two (a 1-D tensor: rows * cols elements), so
tensor-parallel cuts along either matrix dimension, and expert cuts along the leading one, meet
few tiles beyond their own. Edge tiles are smaller; their size too depends only on the stored
shape. The tile size is part of the definition of the weights: change it and they change.

Weights depend on (seed, names, tile size, init kinds and stds) and on the device type the tiles
are drawn on (CUDA's generator is not CPU's): `--use-cpu-initialization` draws them on the CPU,
so a GPU run then starts from a CPU run's weights.

Models are built on the `meta` device (no storage) and materialized parameter by parameter
(`materialize_`), or left on meta with a `DeferredInit` that the gradient buffers fill in place
(data_parallel.GradientSync: a ZeRO-3 rank then only ever draws its flat shard).
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn

from .sharding import Box, ShardSpec, spec_of, stored_name

TILE_ROWS, TILE_COLS = 256, 1024  # 256K elements (1 MiB of fp32) per full tile


def tile_extents(shape: Sequence[int], rows: int = TILE_ROWS, cols: int = TILE_COLS) -> Tuple[int, ...]:
    """The extent of a full tile along each dimension of a tensor of stored shape `shape`."""
    shape = tuple(shape)
    if len(shape) == 0:
        return ()
    if len(shape) == 1:
        return (max(1, min(shape[0], rows * cols)),)
    return (1,) * (len(shape) - 2) + (max(1, min(shape[-2], rows)), max(1, min(shape[-1], cols)))


def tiles_meeting(shape: Sequence[int], extents: Sequence[int], box: Box) -> Iterator[Tuple[int, Box]]:
    """(flat tile index, tile box) of every tile of the grid that meets `box`, in index order."""
    counts = [-(-d // e) for d, e in zip(shape, extents)]
    ranges = [range(s // e, -(-(s + n) // e)) for (s, n), e in zip(box, extents)]

    def walk(dim: int, index: int, prefix: Tuple[Tuple[int, int], ...]):
        if dim == len(shape):
            yield index, prefix
            return
        e = extents[dim]
        for i in ranges[dim]:
            yield from walk(dim + 1, index * counts[dim] + i, prefix + ((i * e, min(e, shape[dim] - i * e)),))

    if all(n > 0 for _, n in box):
        yield from walk(0, 0, ())


def flat_boxes(shape: Sequence[int], lo: int, hi: int) -> List[Tuple[int, Box]]:
    """Elements [lo, hi) of a row-major tensor of `shape` as (offset from lo, box) pieces, each a
    contiguous run of the flat tensor (a partial leading slab, whole slabs, a partial last one)."""
    shape = tuple(shape)
    if hi <= lo:
        return []
    if len(shape) <= 1:
        return [(0, ((lo, hi - lo),))] if shape else [(0, ())]
    stride = 1
    for d in shape[1:]:
        stride *= d
    out: List[Tuple[int, Box]] = []
    pos = lo
    while pos < hi:
        i, within = divmod(pos, stride)
        if within == 0 and hi - pos >= stride:  # a run of whole slabs
            n = (hi - pos) // stride
            out.append((pos - lo, ((i, n),) + tuple((0, d) for d in shape[1:])))
            pos += n * stride
            continue
        end = min(hi, (i + 1) * stride)  # part of slab i
        for off, sub in flat_boxes(shape[1:], within, end - i * stride):
            out.append((pos - lo + off, ((i, 1),) + sub))
        pos = end
    return out


def _tile_seed(seed: int, name: str, tile: int) -> int:
    """A 63-bit seed per (seed, name, tile): a hash, so that neighbouring tiles and parameters get
    unrelated streams."""
    digest = hashlib.blake2b(f"{seed}/{name}/{tile}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def _sub(t: torch.Tensor, box: Box, origin: Box) -> torch.Tensor:
    """The view of `t` (which covers `origin`) on `box` (a sub-box of origin, in the same coordinates)."""
    for d, ((s, n), (o, _)) in enumerate(zip(box, origin)):
        t = t.narrow(d, s - o, n)
    return t


def _intersect(a: Box, b: Box) -> Optional[Box]:
    out = []
    for (sa, na), (sb, nb) in zip(a, b):
        lo, hi = max(sa, sb), min(sa + na, sb + nb)
        if lo >= hi:
            return None
        out.append((lo, hi - lo))
    return tuple(out)


@dataclass(frozen=True)
class TiledInit:
    """The definition of a model's initial weights: seed, std per init kind, tile size, and the
    device tiles are drawn on (None: the device of the tensor being filled)."""
    seed: int
    stds: Dict[str, float]  # "normal" / "normal_scaled" -> std
    rows: int = TILE_ROWS
    cols: int = TILE_COLS
    draw_device: Optional[torch.device] = None

    def fill_box(self, out: torch.Tensor, spec: ShardSpec, name: str, box: Box) -> None:
        """Write the stored full tensor's values on `box` (full coordinates, stored rows only)
        into `out`, shaped like the box."""
        if spec.init in ("ones", "zeros"):
            out.fill_(1.0 if spec.init == "ones" else 0.0)
            return
        if spec.init == "log_arange":  # log(1 + row): Mamba-2's A_log, A = -(1, 2, ..., heads)
            (start, length), = box
            out.copy_(torch.log(torch.arange(start + 1, start + length + 1, dtype=torch.float64)))
            return
        shape = spec.stored_shape
        extents = tile_extents(shape, self.rows, self.cols)
        device = self.draw_device or out.device
        gen = torch.Generator(device=device)
        std = self.stds.get(spec.init, 0.0)
        for index, tile_box in tiles_meeting(shape, extents, box):
            gen.manual_seed(_tile_seed(self.seed, name, index))
            tile = torch.empty([n for _, n in tile_box], device=device)
            if spec.init == "a_log":  # state-space / delta-rule decay rates, as Megatron-Core's A_init_range
                tile.uniform_(1.0, 16.0, generator=gen).log_()
            else:
                tile.normal_(0.0, std, generator=gen)
            common = _intersect(box, tile_box)
            _sub(out, common, box).copy_(_sub(tile, common, tile_box))

    def fill_local(self, out: torch.Tensor, spec: ShardSpec, name: str, lo: int = 0) -> None:
        """Write elements [lo, lo + out.numel()) of this rank's flattened local tensor (shaped
        spec.local_shape) into the flat `out`. Padding rows become zeros."""
        shape = spec.local_shape
        for offset, local_box in flat_boxes(shape, lo, lo + out.numel()):
            piece = out[offset: offset + _numel(local_box)].view([n for _, n in local_box])
            if spec.stored_rows is not None:
                piece.zero_()  # padding rows: local_to_full leaves them out
            for sub_box, full_box in spec.local_to_full(local_box):
                self.fill_box(_sub(piece, sub_box, local_box), spec, name, full_box)


def _numel(box: Box) -> int:
    n = 1
    for _, k in box:
        n *= k
    return n


@dataclass(frozen=True)
class DeferredInit:
    """What a parameter left on the meta device needs to be filled later, in place, by whoever
    allocates its storage (GradientSync): the weights' definition, its stored name, its device."""
    init: TiledInit
    name: str
    device: torch.device

    def fill(self, out: torch.Tensor, param: nn.Parameter, lo: int = 0) -> None:
        self.init.fill_local(out, spec_of(param), self.name, lo)


def param_device(p: torch.Tensor) -> torch.device:
    """Where a parameter lives, or will live once materialized."""
    deferred = getattr(p, "deferred_init", None)
    return deferred.device if p.is_meta and deferred is not None else p.device


def swap_in(p: torch.Tensor, data: torch.Tensor) -> None:
    """Give the (meta) parameter `p` the storage `data` in place: every module and reference holding
    `p` sees it, its attributes (shard_spec, ...) stay. `p.data = data` cannot turn meta into a
    device tensor, so the tensors are swapped."""
    new = nn.Parameter(data, requires_grad=p.requires_grad) if isinstance(p, nn.Parameter) else data
    for k, v in p.__dict__.items():  # p's attributes; a tensor subclass's own state (a fake tensor's device) stays
        new.__dict__.setdefault(k, v)
    torch.utils.swap_tensors(p, new)


def defer_(module: nn.Module, init: TiledInit, device) -> None:
    """Mark the module's meta parameters for in-place filling later (each with its stored name)."""
    for name, p in module.named_parameters():
        if p.is_meta:
            p.deferred_init = DeferredInit(init, stored_name(name, p), torch.device(device))


def materialize_(module: nn.Module, init: Optional[TiledInit] = None, device=None) -> None:
    """Give every meta parameter of `module` its storage on `device` and its initial values, one
    parameter at a time; meta buffers become zeros (every buffer here starts at zero: router
    statistics and expert biases). Parameters carrying a DeferredInit use it (and its device)."""
    for name, p in module.named_parameters():
        if not p.is_meta:
            continue
        deferred = getattr(p, "deferred_init", None)
        if deferred is None:
            if init is None:
                raise ValueError(f"parameter {name} is on the meta device with no DeferredInit: pass the TiledInit")
            deferred = DeferredInit(init, stored_name(name, p), torch.device(device))
        data = torch.empty(p.shape, dtype=p.dtype, device=deferred.device)
        deferred.fill(data.view(-1), p)
        swap_in(p, data)
        p.__dict__.pop("deferred_init", None)
    materialize_buffers_(module, device)


def materialize_buffers_(module: nn.Module, device) -> None:
    for m in module.modules():
        for key, buf in m._buffers.items():
            if buf is not None and buf.is_meta:
                m._buffers[key] = torch.zeros(buf.shape, dtype=buf.dtype, device=device)
