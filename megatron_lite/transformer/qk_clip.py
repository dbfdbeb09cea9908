"""QK-clip (Kimi-K2's MuonClip; Megatron-LM's --qk-clip, --qk-clip-threshold tau, --qk-clip-alpha a):
the attention layers measure each head's largest pre-softmax logit of the step's forward passes;
after the update, a head (a query group under GQA, as Megatron-LM groups it) whose largest logit m
exceeded tau has its query rows scaled by eta^a and its key rows by eta^(1 - a), eta = tau / m, so
that its logits scale by eta. MLA (the report's recipe): the head's q_nope rows by eta^a, its
k_nope rows by eta^(1 - a), its q_rope rows by eta; the RoPE key shared by every head is left alone.

The logit is q . k times the core's 1 / sqrt(head dim) (MLA folds the rest of its softmax scale into
q), over the keys each query sees (causal, window, documents). With context parallelism the keys
of the other CP ranks are gathered for it, at their zigzag positions. This module measures and
says which rows to scale; training/qk_clip.py reduces the maxima and scales the weights."""
from __future__ import annotations

import math
from typing import List, Optional, Tuple

import torch

from ..kernels.block_attention import visibility_mask
from ..parallel.context_parallel import zigzag_indices

LOW = -1e30  # "no logit seen yet": finite, so that MAX reductions stay plain arithmetic
_BLOCK = 256  # queries per block of the measurement (its [b, heads, block, sk] scores stay small)


@torch.no_grad()
def head_max_logits(q: torch.Tensor, k: torch.Tensor, q_index: torch.Tensor, k_index: torch.Tensor,
                    q_doc: Optional[torch.Tensor] = None, k_doc: Optional[torch.Tensor] = None,
                    window: Optional[int] = None) -> torch.Tensor:
    """Per query head, the largest visible logit q . k / sqrt(d): q [b, sq, hq, d], k [b, sk, hkv, d] -> [hq] fp32."""
    hq, hkv = q.shape[2], k.shape[2]
    k = k.float().repeat_interleave(hq // hkv, dim=2) if hkv != hq else k.float()
    scale = 1.0 / math.sqrt(q.shape[-1])
    out = torch.full((hq,), LOW, dtype=torch.float32, device=q.device)
    for lo in range(0, q.shape[1], _BLOCK):
        hi = min(q.shape[1], lo + _BLOCK)
        scores = torch.einsum("bqhd,bkhd->bhqk", q[:, lo:hi].float(), k) * scale
        mask = visibility_mask(q_index[lo:hi], k_index, None if q_doc is None else q_doc[:, lo:hi], k_doc,
                               window=window)
        if mask is not None:
            scores = scores.masked_fill(~mask.unsqueeze(1), LOW)
        out = torch.maximum(out, scores.amax(dim=(0, 2, 3)))
    return out


class MaxLogitObserver:
    """An attention module's running per-head maximum over the step (None while QK-clip is off)."""

    def __init__(self, heads: int, dims):
        self.heads, self.dims = heads, dims
        self.value: Optional[torch.Tensor] = None

    def reset(self) -> None:
        self.value = None

    @torch.no_grad()
    def observe(self, q: torch.Tensor, k: torch.Tensor, packed, window: Optional[int]) -> None:
        """q [b, s, heads, d], k [b, s, kv heads, d] of this rank's tokens (its zigzag part under CP)."""
        dims, s = self.dims, q.shape[1]
        docs = None if packed is None else packed.document_ids
        if dims.cp > 1:
            q_index = zigzag_indices(s * dims.cp, dims.cp, dims.cp_rank, device=q.device)
            k_index = torch.cat([zigzag_indices(s * dims.cp, dims.cp, r, device=q.device) for r in range(dims.cp)])
            k = _gather_seq(k.contiguous(), dims)
            k_docs = None if docs is None else _gather_seq(docs.contiguous(), dims)
        else:
            q_index = k_index = torch.arange(s, device=q.device)
            k_docs = docs
        m = head_max_logits(q, k, q_index, k_index, docs, k_docs, window)
        self.value = m if self.value is None else torch.maximum(self.value, m)


def _gather_seq(t: torch.Tensor, dims) -> torch.Tensor:
    """`t` [b, s, ...] of every CP rank, concatenated along the sequence in CP rank order."""
    out = torch.empty((dims.cp * t.shape[0], *t.shape[1:]), dtype=t.dtype, device=t.device)
    dims.comm.all_gather(out, t, dims.cp_group)
    return torch.cat(out.chunk(dims.cp), dim=1)


def balancing_eta(max_logits: torch.Tensor, tau: float) -> torch.Tensor:
    """min(1, tau / max logit), elementwise (a head that never exceeded tau keeps its weights)."""
    return torch.clamp(tau / max_logits.clamp_min(tau), max=1.0)


def rows(per_unit: torch.Tensor, sizes: List[int]) -> torch.Tensor:
    """Per-row factors of a [units x sum(sizes), ...] weight whose unit u has rows of factors
    per_unit[u, j] repeated sizes[j] times (e.g. a head's q_nope rows then its q_rope rows)."""
    parts = [per_unit[:, j:j + 1].expand(-1, n) for j, n in enumerate(sizes)]
    return torch.cat(parts, dim=1).reshape(-1)


RowScales = List[Tuple[torch.nn.Parameter, torch.Tensor]]  # (weight or bias, factor of each of its rows)
