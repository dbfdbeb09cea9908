"""Blockwise FP8 scaling as DeepSeek-V3 trains (`--fp8-recipe blockwise`): one scale per 1x128 tile
of an activation or gradient (per row, per 128 elements along the contracted dimension) and per
128x128 block of a weight, fp32 accumulation.

A dimension that is not a multiple of 128 is padded with zeros to find the blocks' amaxes (zeros
change no amax); the quantized tensor keeps its shape, the scales cover the padded blocks.
torch 2.13's CPU `torch._scaled_mm` refuses block scales ("Invalid scaling configuration", for
1x128 and 128x128 in every layout), and no GPU has run a blockwise kernel here, so the product
is the fp32 GEMM of the dequantised operands on every device: the recipe's numerics, not its speed.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

BLOCK = 128
TILE, WEIGHT_BLOCK = (1, BLOCK), (BLOCK, BLOCK)


def quantize_blocks(t: torch.Tensor, dtype: torch.dtype, block, margin: int = 0):
    """(q [M, N] in `dtype`, inverse scales [ceil(M/bm), ceil(N/bn)]): t [M, N] scaled per
    bm x bn block by fp8 max / block amax / 2^margin (scale 1 for an all-zero block)."""
    (bm, bn), (m, n) = block, t.shape
    fmax = torch.finfo(dtype).max
    rows, cols = -(-m // bm), -(-n // bn)
    padded = F.pad(t.float(), (0, cols * bn - n, 0, rows * bm - m)).reshape(rows, bm, cols, bn)
    amax = padded.abs().amax(dim=(1, 3), keepdim=True) if padded.numel() else padded.sum(dim=(1, 3), keepdim=True)
    scale = torch.where(amax > 0, fmax / amax / 2.0 ** margin, torch.ones_like(amax))
    q = (padded * scale).clamp(-fmax, fmax).to(dtype).reshape(rows * bm, cols * bn)[:m, :n]
    return q, scale.reciprocal().reshape(rows, cols)


def dequantize_blocks(q: torch.Tensor, inv: torch.Tensor, block) -> torch.Tensor:
    bm, bn = block
    full = inv.repeat_interleave(bm, 0).repeat_interleave(bn, 1)
    return q.float() * full[:q.shape[0], :q.shape[1]]


def blockwise_mm(a, b, dtypes, b_is_weight: bool, margin: int, out_dtype) -> torch.Tensor:
    """a [M,K] @ b [K,N]: a in 1x128 tiles along K; b in 128x128 blocks (a weight) or, for the
    weight gradient's activation, 128x1 tiles along K."""
    qa, sa = quantize_blocks(a, dtypes[0], TILE, margin)
    b_block = WEIGHT_BLOCK if b_is_weight else TILE[::-1]
    qb, sb = quantize_blocks(b, dtypes[1], b_block, margin)
    return (dequantize_blocks(qa, sa, TILE) @ dequantize_blocks(qb, sb, b_block)).to(out_dtype)


def token_tiled_weight_grad(g, x, tiles, n_tiles: int, dtypes, margin: int, out_dtype, reduce=None):
    """g [M,N]^T @ x [M,K], both in 128-token tiles along M as the single process cuts them:
    tiles[i] is the tile (of n_tiles) row i falls in in the single-process order, so a tile's rows
    may sit on several ranks (CP, an expert's tokens routed by several TP / CP ranks) or come in
    another order (EP); reduce(amax [n_tiles, features]) MAX-reduces a tile's amax over those
    ranks. Each rank's product is its rows' share of the single process's sum."""
    def deq(t, dtype):
        t = t.float()
        fmax = torch.finfo(dtype).max
        amax = t.new_zeros(n_tiles, t.shape[1]).scatter_reduce_(0, tiles[:, None].expand_as(t), t.abs(), "amax")
        if reduce is not None:
            reduce(amax)
        scale = torch.where(amax > 0, fmax / amax / 2.0 ** margin, torch.ones_like(amax))[tiles]
        return (t * scale).clamp(-fmax, fmax).to(dtype).float() * scale.reciprocal()
    return (deq(g, dtypes[0]).t() @ deq(x, dtypes[1])).to(out_dtype)


def check_tp_blocks(name: str, param, tp: int) -> None:
    """A TP shard must hold whole 128-blocks of the full weight, or the layout changes the
    blocks (and the numerics): raise a one-line error naming the weight otherwise."""
    from ..errors import ConfigError

    spec = getattr(param, "shard_spec", None)
    for split in (spec.splits if spec is not None else ()):
        if split.axis == "tp" and split.shards > 1 and any(seg // split.shards % BLOCK for seg in split.segments):
            sizes = "/".join(str(seg // split.shards) for seg in split.segments)
            raise ConfigError(f"--fp8-recipe blockwise at --tensor-model-parallel-size {tp}: the TP shards of {name} "
                              f"({sizes} along dimension {split.dim}) cut its {BLOCK}x{BLOCK} blocks; use sizes whose "
                              f"TP shards are multiples of {BLOCK}, or --fp8-recipe tensorwise / rowwise / delayed")
