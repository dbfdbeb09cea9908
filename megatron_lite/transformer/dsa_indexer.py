"""The lightning indexer of DeepSeek Sparse Attention (DeepSeek-V3.2; Megatron-Core's DSAIndexer).

For each query it scores every key it may see with a few small ReLU heads and keeps the best top-k:

    q_h = rope(W_q qr)_h  (qr: MLA's normalised query latent, or the hidden state without one)
    k   = rope(LayerNorm(W_k x))                   one key of head_dim channels, shared by the heads
    w   = W_w x * n_heads^-1/2 * head_dim^-1/2     a weight per head and query
    score(i, j) = sum_h w_h(i) relu(q_h(i) . k(j))

RoPE turns the last qk_pos_emb_head_dim channels of each head, as Megatron-Core lays them out
(Hugging Face's `deepseek_v32` turns the first ones: the conversion moves them), with the model's
cos / sin (YaRN's factor included). Megatron-Core's Hadamard rotation of q and k (orthogonal: it
changes no score, it only helps FP8) is not applied. Scores of keys a query may not see (later
ones, other documents) are -inf.

The indexer's inputs are detached (as Megatron-Core and DeepSeek do): its parameters learn from
its KL loss only (dsa_loss.py), and nothing flows from it into the main model. Under tensor
parallelism it is replicated, as Megatron-Core builds it (`parallel_mode="duplicated"`): every TP
rank scores the whole sequence with every indexer head (its heads are few and small next to MLA's,
and splitting them would need an all-reduce of the [s, s] scores before the top-k); the same
gradient on every rank, so its parameters' gradients are not summed over TP.

This module is mixer-agnostic on purpose: DeepSeek-V4's compressed attention reuses it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..kernels.block_attention import visibility_mask
from ..parallel.sharding import replicated, set_spec
from ..parallel.tensor_parallel import linear
from .norm import LayerNorm
from .rope import apply_rope


class ReplicatedLinear(nn.Module):
    """y = x W^T with W whole on every TP rank and the same gradient there (not summed over TP)."""

    def __init__(self, input_size: int, output_size: int, dtype, gemm):
        super().__init__()
        self.gemm = gemm
        self.weight = nn.Parameter(torch.empty(output_size, input_size, dtype=dtype))
        set_spec(self.weight, replicated((output_size, input_size)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, None, self.gemm)


@dataclass
class Selection:
    """What the indexer chose for a block of queries: scores [b, sq, sk] (fp32, -inf where not
    visible; with the indexer's graph when training), indices [b, sq, k] of the top-k keys and
    valid [b, sq, k] (False where a query sees fewer than k keys and the pick is an invisible one)."""
    scores: torch.Tensor
    indices: torch.Tensor
    valid: torch.Tensor

    def key_mask(self) -> torch.Tensor:
        """Bool [b, sq, sk]: True at the selected visible keys."""
        mask = torch.zeros(self.scores.shape, dtype=torch.bool, device=self.scores.device)
        return mask.scatter_(-1, self.indices, self.valid)


def visible_keys(sq: int, sk: int, q_offset: int, document_ids: Optional[torch.Tensor], device) -> torch.Tensor:
    """Bool [1 or b, sq, sk]: causal by absolute position (queries at q_offset on), within a document."""
    q_index = torch.arange(q_offset, q_offset + sq, device=device)
    k_index = torch.arange(sk, device=device)
    docs = (None, None) if document_ids is None else (document_ids[:, q_offset:q_offset + sq], document_ids)
    return visibility_mask(q_index, k_index, docs[0], docs[1])


class LightningIndexer(nn.Module):
    def __init__(self, cfg, ctx, settings):
        super().__init__()
        dt, gemm = ctx.params_dtype, ctx.gemm
        self.n_heads, self.head_dim, self.topk = settings.n_heads, settings.head_dim, settings.topk
        self.rope_dim = cfg.qk_pos_emb_head_dim
        q_in = cfg.q_lora_rank or cfg.hidden_size
        self.linear_wq_b = ReplicatedLinear(q_in, self.n_heads * self.head_dim, dt, gemm)
        self.linear_wk = ReplicatedLinear(cfg.hidden_size, self.head_dim, dt, gemm)
        self.k_norm = LayerNorm(self.head_dim, cfg.norm_epsilon, dtype=dt)  # LayerNorm whatever the model's norm
        self.linear_weights_proj = ReplicatedLinear(cfg.hidden_size, self.n_heads, dt, gemm)

    def _rope(self, t: torch.Tensor, rope) -> torch.Tensor:
        """RoPE on the last rope_dim channels of each head (t [s, b, heads, head_dim])."""
        if rope is None:
            return t
        rest, turned = t.split([self.head_dim - self.rope_dim, self.rope_dim], dim=-1)
        return torch.cat([rest, apply_rope(turned, *rope)], dim=-1)

    def keys(self, x: torch.Tensor, rope) -> torch.Tensor:
        """The indexer's keys [b, s, head_dim] of hidden states x [s, b, h] (what generation caches)."""
        k = self.k_norm(self.linear_wk(x.detach()))
        return self._rope(k.unsqueeze(2), rope).squeeze(2).transpose(0, 1)

    def scores(self, x: torch.Tensor, qr: torch.Tensor, keys: torch.Tensor, rope) -> torch.Tensor:
        """Scores [b, sq, sk] fp32 of the queries of x / qr [sq, b, ...] against keys [b, sk, head_dim]."""
        x, qr = x.detach(), qr.detach()
        s, b = x.shape[:2]
        q = self._rope(self.linear_wq_b(qr).view(s, b, self.n_heads, self.head_dim), rope)
        weights = self.linear_weights_proj(x).float() * (self.n_heads ** -0.5 * self.head_dim ** -0.5)
        logits = F.relu(torch.einsum("sbhd,btd->bsht", q.float(), keys.float()))  # [b, sq, heads, sk]
        return torch.einsum("bsht,sbh->bst", logits, weights)

    def forward(self, x: torch.Tensor, qr: torch.Tensor, rope, document_ids: Optional[torch.Tensor] = None,
                keys: Optional[torch.Tensor] = None, q_offset: int = 0,
                visible: Optional[torch.Tensor] = None) -> Selection:
        """The top-k keys of each query of x [sq, b, h] (qr [sq, b, q latent]); `keys` [b, sk, d]:
        earlier keys included (generation), else those of x itself; `visible` [1 or b, sq, sk]: which
        keys each query may see, else causal from q_offset within document_ids' documents."""
        keys = self.keys(x, rope) if keys is None else keys
        scores = self.scores(x, qr, keys, rope)
        if visible is None:
            visible = visible_keys(scores.shape[1], scores.shape[2], q_offset, document_ids, scores.device)
        scores = scores.masked_fill(~visible, float("-inf"))
        k = min(self.topk, scores.shape[-1])
        with torch.no_grad():
            top, indices = scores.topk(k, dim=-1)
        return Selection(scores, indices, top > float("-inf"))
