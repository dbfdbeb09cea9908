"""DeepSeek Sparse Attention's indexer weights between Hugging Face's `deepseek_v32` and ours.

Hugging Face (as DeepSeek's reference) rotates the first qk_rope_head_dim channels of each indexer
head; Megatron-Core and we rotate the last ones. Every score is a sum over channels of q and k
products and the key's LayerNorm treats channels alike, so moving those channels to the back of
each head in W_q (per head), W_k and the norm's weight and bias gives the same scores.
"""
from __future__ import annotations

from typing import Dict

import torch

# Hugging Face's name under `self_attn.indexer.` -> ours under `self_attention.indexer.`
INDEXER_NAMES = {"wq_b.weight": "linear_wq_b.weight", "wk.weight": "linear_wk.weight",
                 "k_norm.weight": "k_norm.weight", "k_norm.bias": "k_norm.bias",
                 "weights_proj.weight": "linear_weights_proj.weight"}


def _roll_heads(t: torch.Tensor, head_dim: int, shift: int) -> torch.Tensor:
    """Rotate the channels of each head_dim block along dim 0 by `shift`."""
    shape = t.shape
    return torch.roll(t.reshape(shape[0] // head_dim, head_dim, -1), shifts=shift, dims=1).reshape(shape)


def _moved(name: str, t: torch.Tensor, cfg, shift: int) -> torch.Tensor:
    if name.startswith("weights_proj"):
        return t
    return _roll_heads(t, cfg.dsa_indexer_head_dim, shift).contiguous()


def indexer_from_hf(hf: Dict[str, torch.Tensor], cfg) -> Dict[str, torch.Tensor]:
    """One layer's HF indexer tensors (names relative to the indexer) -> ours."""
    return {INDEXER_NAMES[n]: _moved(n, t, cfg, -cfg.qk_pos_emb_head_dim) for n, t in hf.items()}


def indexer_to_hf(ours: Dict[str, torch.Tensor], cfg) -> Dict[str, torch.Tensor]:
    """The inverse of indexer_from_hf."""
    back = {v: k for k, v in INDEXER_NAMES.items()}
    return {back[n]: _moved(back[n], t, cfg, cfg.qk_pos_emb_head_dim) for n, t in ours.items()}
