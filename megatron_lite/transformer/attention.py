"""Self-attention with grouped-query heads and RoPE, split across TP by heads.

The core attention (softmax(QK^T)V) is pluggable: PyTorch's scaled_dot_product_attention is
always available; flash-attn is used on CUDA in bf16/fp16 when installed and no custom mask is
needed. Selective recomputation checkpoints only this core.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..config import ModelConfig
from ..parallel.random import RNGStatesTracker, recompute
from ..parallel.state import ParallelDims
from ..parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear, enter_tp_region
from .rope import apply_rope

@functools.cache
def _flash_attn_func():
    """flash_attn.flash_attn_func if importable (CUDA only), else None. Imported once, lazily."""
    try:
        from flash_attn import flash_attn_func  # type: ignore
    except Exception:
        return None
    return flash_attn_func


def core_attention(q, k, v, attention_mask: Optional[torch.Tensor], dropout_p: float, backend: str = "auto"):
    """q [b, s, hq, d], k/v [b, s, hkv, d] -> [b, s, hq, d], causal (and masked if given).

    attention_mask: optional bool [b, s, s], True where a query may attend a key."""
    flash = _flash_attn_func() if backend in ("auto", "flash") else None
    if flash is not None and q.is_cuda and q.dtype in (torch.bfloat16, torch.float16) and attention_mask is None:
        return flash(q, k, v, dropout_p=dropout_p, causal=True)  # handles GQA natively
    rep = q.shape[2] // k.shape[2]
    if rep > 1:  # query head i uses key/value group i // rep
        k = k.repeat_interleave(rep, dim=2)
        v = v.repeat_interleave(rep, dim=2)
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    if attention_mask is None:
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)
    else:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask.unsqueeze(1), dropout_p=dropout_p)
    return out.transpose(1, 2)


class SelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, dims: ParallelDims, sequence_parallel: bool, dtype,
                 tracker: RNGStatesTracker, recompute_core: bool = False):
        super().__init__()
        tp = dims.tp
        d = cfg.kv_channels
        self.head_dim = d
        self.heads = cfg.num_attention_heads // tp
        self.dropout = cfg.attention_dropout
        self.tracker, self.tp, self.recompute_core = tracker, tp, recompute_core
        self.backend = cfg.attention_backend
        q_size, kv_size = cfg.num_attention_heads * d, cfg.num_query_groups * d
        # With fewer query groups than TP ranks, each K/V group is replicated on tp / groups
        # consecutive ranks (their weight gradients are summed over those ranks after backward).
        kv_replicas = max(1, tp // cfg.num_query_groups)
        self.groups = max(1, cfg.num_query_groups // tp)
        qkv_bias = cfg.add_bias_linear or cfg.add_qkv_bias
        self.sequence_parallel = sequence_parallel
        self.linear_q = ColumnParallelLinear(cfg.hidden_size, q_size, dims, bias=qkv_bias,
                                             sequence_parallel=sequence_parallel, dtype=dtype)
        self.linear_kv = ColumnParallelLinear(cfg.hidden_size, 2 * kv_size, dims, bias=qkv_bias,
                                              sequence_parallel=sequence_parallel, segments=[kv_size, kv_size],
                                              replicas=kv_replicas, dtype=dtype)
        self.linear_proj = RowParallelLinear(q_size, cfg.hidden_size, dims, bias=cfg.add_bias_linear,
                                             sequence_parallel=sequence_parallel, dtype=dtype)

    def _core(self, q, k, v, attention_mask):
        p = self.dropout if self.training else 0.0
        if p > 0 and self.tp > 1:  # each TP rank drops in its own heads: its own stream
            with self.tracker.fork():
                return core_attention(q, k, v, attention_mask, p, self.backend)
        return core_attention(q, k, v, attention_mask, p, self.backend)

    def forward(self, x: torch.Tensor, rope=None, attention_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        x = enter_tp_region(x, self.linear_q.dims, self.sequence_parallel)  # once for both projections
        q = self.linear_q(x, input_ready=True)  # [s, b, hq d] over the full sequence
        k, v = self.linear_kv(x, input_ready=True).chunk(2, dim=-1)
        s, b = q.shape[:2]
        d = self.head_dim
        q = q.reshape(s, b, self.heads, d)
        k = k.reshape(s, b, self.groups, d)
        v = v.reshape(s, b, self.groups, d)
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        q, k, v = (t.transpose(0, 1) for t in (q, k, v))  # [b, s, heads, d]
        if self.recompute_core and self.training:
            out = recompute(self._core, self.tracker, q, k, v, attention_mask)
        else:
            out = self._core(q, k, v, attention_mask)
        out = out.transpose(0, 1).reshape(s, b, self.heads * d)
        return self.linear_proj(out)
