"""Rotary position embeddings (RoPE), in the half-split convention of Llama / Hugging Face."""
from __future__ import annotations

import torch


def rope_cos_sin(position_ids: torch.Tensor, head_dim: int, base: float, dtype) -> tuple:
    """position_ids [b, s] -> cos, sin shaped [s, b, 1, head_dim] for [s, b, heads, d] tensors."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32,
                                            device=position_ids.device) / head_dim))
    freqs = position_ids.t().float().unsqueeze(-1) * inv_freq  # [s, b, d/2]
    emb = torch.cat([freqs, freqs], dim=-1).unsqueeze(2)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin
