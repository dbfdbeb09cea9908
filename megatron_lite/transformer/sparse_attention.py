"""Attention over selected keys only: each query attends to its own k keys (DSA's top-k), not to all.

    out_i = sum_{j in S_i} softmax_j(q_i . k_j / sqrt(d)) v_j     S_i: the valid picks of query i

The keys and values of each query's picks are gathered ([b, sq, k, heads, d]), so time and memory
grow with sq * k, linearly in the sequence once k is fixed, instead of sq * sk. This is the plain
PyTorch reference (Megatron-Core's unfused path masks a dense [sq, sk] score matrix instead: the
same numbers at quadratic cost); a fused kernel (FlashMLA's sparse decoding / prefill) would plug
in here. No dropout (Megatron-Core's has none either).
"""
from __future__ import annotations

import math

import torch


def gather_keys(t: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """t [b, sk, ...] at indices [b, sq, k] -> [b, sq, k, ...]."""
    batch = torch.arange(t.shape[0], device=t.device).view(-1, 1, 1)
    return t[batch, indices]


def sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, indices: torch.Tensor,
                     valid: torch.Tensor) -> torch.Tensor:
    """q [b, sq, heads, d], k [b, sk, heads or 1, d], v [b, sk, heads or 1, dv] (one K/V head: shared
    by every query head, as MLA's absorbed decoding has it); indices, valid [b, sq, k] (each query's
    picks, and which of them count; every query needs one valid pick).
    Returns out [b, sq, heads, dv]; the softmax in fp32."""
    shared = k.shape[2] == 1 and q.shape[2] != 1
    if shared:
        k, v = k.squeeze(2), v.squeeze(2)
    keys, values = gather_keys(k, indices), gather_keys(v, indices)  # [b, sq, k, (heads,) ...]
    pattern = "bshd,bskd->bshk" if shared else "bshd,bskhd->bshk"
    logits = torch.einsum(pattern, q.float(), keys.float()) / math.sqrt(q.shape[-1])
    logits = logits.masked_fill(~valid.unsqueeze(2), float("-inf"))
    probs = torch.softmax(logits, dim=-1).to(v.dtype)
    return torch.einsum("bshk,bskd->bshd" if shared else "bshk,bskhd->bshd", probs, values)
