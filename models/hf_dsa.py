"""DeepSeek Sparse Attention's indexer weights between Hugging Face's `deepseek_v32` and ours.

Hugging Face (as DeepSeek's reference code) rotates the first qk_rope_head_dim channels of each
indexer head; Megatron-Core and we rotate the last ones. A score is a sum over channels of q * k
and the key's LayerNorm treats its channels alike, so moving those channels to the back of each
head, in W_q (per indexer head), W_k and the norm's weight and bias, gives the same scores.
(hf_families.py holds the deepseek_v32 table; the `rope_indexer` op of hf_conversion.py calls these.)
"""
from __future__ import annotations

import torch


def _roll_heads(t: torch.Tensor, head_dim: int, shift: int) -> torch.Tensor:
    """Rotate the rows of each head_dim block of dim 0 by `shift`."""
    shape = t.shape
    return torch.roll(t.reshape(shape[0] // head_dim, head_dim, -1), shifts=shift, dims=1).reshape(shape).contiguous()


def indexer_rope_last(hf: torch.Tensor, cfg) -> torch.Tensor:
    """An HF indexer tensor (wq_b, wk, k_norm) with each head's rotated channels moved last (ours)."""
    return _roll_heads(hf, cfg.dsa_indexer_head_dim, -cfg.qk_pos_emb_head_dim)


def indexer_rope_first(ours: torch.Tensor, cfg) -> torch.Tensor:
    """The inverse of indexer_rope_last."""
    return _roll_heads(ours, cfg.dsa_indexer_head_dim, cfg.qk_pos_emb_head_dim)
