"""Self-attention with grouped-query heads and RoPE, split across TP by heads, around a pluggable
core attention (core_attention.py; a context-parallel wrapper has the same interface).
Selective recomputation checkpoints only the core.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn

from ..parallel.random import recompute
from ..parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from .core_attention import PackedSeq
from .norm import head_norm
from .rope import apply_rope


class SelfAttention(nn.Module):
    def __init__(self, cfg, ctx, layer_number: int, core_attention):
        super().__init__()
        dims, sp, dt = ctx.dims, ctx.sequence_parallel, ctx.params_dtype
        tp = dims.tp
        d = cfg.kv_channels
        self.head_dim, self.heads = d, cfg.num_attention_heads // tp
        self.tracker, self.tp, self.sequence_parallel, self.dims = ctx.tracker, tp, sp, dims
        self.layer_number = layer_number  # names this layer's buffers in a KV cache
        self.recompute_core = ctx.recompute_granularity == "selective"
        q_size, kv_size = cfg.num_attention_heads * d, cfg.num_query_groups * d
        # With fewer query groups than TP ranks, each K/V group is replicated on tp / groups
        # consecutive ranks (their weight gradients are summed over those ranks after backward).
        kv_replicas = max(1, tp // cfg.num_query_groups)
        self.groups = max(1, cfg.num_query_groups // tp)
        qkv_bias = cfg.add_bias_linear or cfg.add_qkv_bias
        gemm = ctx.gemm
        self.linear_q = ColumnParallelLinear(cfg.hidden_size, q_size, dims, bias=qkv_bias, sequence_parallel=sp,
                                             dtype=dt, gemm=gemm)
        self.linear_kv = ColumnParallelLinear(cfg.hidden_size, 2 * kv_size, dims, bias=qkv_bias, sequence_parallel=sp,
                                              segments=[kv_size, kv_size], replicas=kv_replicas, dtype=dt,
                                              gemm=gemm)
        self.linear_proj = RowParallelLinear(q_size, cfg.hidden_size, dims, bias=cfg.add_bias_linear,
                                             sequence_parallel=sp, dtype=dt, gemm=gemm)
        self.core_attention = core_attention(cfg, ctx, layer_number)
        if cfg.qk_layernorm:  # over each head's channels; the heads are split over TP: grads partial there
            self.q_layernorm = head_norm(cfg, ctx, d)
            self.k_layernorm = head_norm(cfg, ctx, d)

    def _core(self, q, k, v, packed, q_offset=0):
        if self.core_attention.dropout > 0 and self.training and self.tp > 1:
            with self.tracker.fork():  # each TP rank drops in its own heads: its own stream
                return self.core_attention(q, k, v, packed, q_offset=q_offset)
        return self.core_attention(q, k, v, packed, q_offset=q_offset)

    def forward(self, x: torch.Tensor, rope=None, packed: Optional[PackedSeq] = None, kv_cache=None) -> torch.Tensor:
        """`kv_cache` (inference only, megatron_lite/inference): x holds the tokens after those
        already cached; their K/V join the cache and the queries attend over all of it."""
        # [s, b, hq d] and [s, b, 2 hkv d] over the full sequence, through one TP input region
        q, kv = ColumnParallelLinear.shared_input(x, self.linear_q, self.linear_kv)
        k, v = kv.chunk(2, dim=-1)
        s, b = q.shape[:2]
        d = self.head_dim
        q = q.reshape(s, b, self.heads, d)
        k = k.reshape(s, b, self.groups, d)
        v = v.reshape(s, b, self.groups, d)
        if hasattr(self, "q_layernorm"):
            q, k = self.q_layernorm(q), self.k_layernorm(k)
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        q, k, v = (t.transpose(0, 1) for t in (q, k, v))  # [b, s, heads, d]
        q_offset = 0
        if kv_cache is not None:  # causality by absolute position: the queries sit after the cache
            k, v, q_offset = kv_cache.update(self.layer_number, k, v)
        if self.recompute_core and self.training:
            out = recompute(self._core, self.tracker, q, k, v, packed)
        else:
            out = self._core(q, k, v, packed, q_offset)
        out = out.transpose(0, 1).reshape(s, b, self.heads * d)
        return self.linear_proj(out)
