"""LayerNorm and RMSNorm whose parameters know they are replicated across TP (and partial under SP)."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..parallel.sharding import ShardSpec, replicated, set_spec, tp_split
from .counts import Counts, MicroBatch, weights
from .replay import rms_norm


class LayerNorm(nn.Module):
    """`zero_centered` (--apply-layernorm-1p): the weight is stored as w and applied as 1 + w."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, sequence_parallel: bool = False, dtype=torch.float32,
                 zero_centered: bool = False):
        super().__init__()
        self.eps, self.zero_centered = eps, zero_centered
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(hidden_size, dtype=dtype))
        set_spec(self.weight, replicated((hidden_size,), sequence_parallel, init="zeros" if zero_centered else "ones"))
        set_spec(self.bias, replicated((hidden_size,), sequence_parallel, init="zeros"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight + 1 if self.zero_centered else self.weight
        return F.layer_norm(x, x.shape[-1:], w, self.bias, self.eps)


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-5, sequence_parallel: bool = False, dtype=torch.float32,
                 zero_centered: bool = False):
        super().__init__()
        self.eps, self.zero_centered = eps, zero_centered
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype))
        set_spec(self.weight, replicated((hidden_size,), sequence_parallel, init="zeros" if zero_centered else "ones"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 whatever the activation dtype, as Llama does (F.rms_norm: one fused
        # kernel on CUDA; torch.compile fuses it with its neighbours). Backward keeps x and the
        # fp32 1/rms only (replay.py), not the fp32 copy nor the normalized value.
        return rms_norm(x, self.weight, self.eps, self.zero_centered)


def build_norm(cfg, ctx, layer_number: int = 0) -> nn.Module:
    """The model's norm (cfg.normalization) over the hidden size: a layer-spec constructor."""
    cls = {"LayerNorm": LayerNorm, "RMSNorm": RMSNorm}[cfg.normalization]
    return cls(cfg.hidden_size, cfg.norm_epsilon, ctx.sequence_parallel, ctx.params_dtype, cfg.apply_layernorm_1p)


def head_norm(cfg, ctx, head_dim: int) -> nn.Module:
    """The model's norm over each attention head's channels (--qk-layernorm). The heads are split
    over TP, so each rank's gradient of the shared weight is partial: summed over TP."""
    cls = {"LayerNorm": LayerNorm, "RMSNorm": RMSNorm}[cfg.normalization]
    return cls(head_dim, cfg.norm_epsilon, ctx.dims.tp > 1, ctx.params_dtype, cfg.apply_layernorm_1p)


class FullWidthRMSNorm(nn.Module):
    """RMSNorm over all heads of Q (or of K) together (--qk-layernorm-full-width, OLMoE). The heads,
    and so the weight, are split over TP: each rank sums the squares of its own heads and the sum is
    all-reduced both ways (every rank's output depends on every rank's input). K groups replicated
    on `replicas` ranks are counted once."""

    def __init__(self, width: int, dims, eps: float, dtype, zero_centered: bool, replicas: int = 1):
        super().__init__()
        split = tp_split(dims, 0, width, replicas=replicas)
        self.width, self.eps, self.zero_centered, self.dims, self.replicas = width, eps, zero_centered, dims, replicas
        self.weight = nn.Parameter(torch.ones(width // split.shards, dtype=dtype))
        set_spec(self.weight, ShardSpec((width,), (split,), init="zeros" if zero_centered else "ones"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., heads on this rank, head dim]
        x32 = x.float().flatten(-2)
        squares = x32.square().sum(-1, keepdim=True)
        if self.dims.tp > 1:
            comm, group = self.dims.comm, self.dims.tp_group
            squares = comm.copy_to_tp(comm.reduce_from_tp(squares, group), group) / self.replicas
        w = self.weight + 1 if self.zero_centered else self.weight
        return (w * (x32 * torch.rsqrt(squares / self.width + self.eps)).to(x.dtype)).view_as(x)


def norm_weights(cfg, width: int) -> int:
    """Parameters of one norm over `width` channels: LayerNorm's weight and bias, RMSNorm's weight."""
    return width * (2 if cfg.normalization == "LayerNorm" else 1)


def norm_counts(cfg, mb: MicroBatch) -> Counts:
    """One norm over the hidden size. Kept per residual-stream token besides its input: LayerNorm mean
    and 1/std, 8; RMSNorm 1/rms, 4; and its output as the next linear's input, a h (under SP the
    shard: backward gathers it), unless --recompute-modules layernorm."""
    h = cfg.hidden_size
    internal = 4 if cfg.normalization == "RMSNorm" else 8
    output = 0 if mb.recomputes("layernorm") else mb.a * h  # --recompute-modules layernorm: recomputed
    return weights(norm_weights(cfg, h), act_bytes=(internal + output) * mb.residual_tokens)
