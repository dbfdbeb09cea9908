"""DSA under context parallelism: each CP rank holds its zigzag chunks of the queries
(parallel/context_parallel.py) and a query may pick any earlier key of the whole sequence.

Per layer, three small per-token tensors are all-gathered over CP (with autograd: the gradient of
what other ranks' queries did with this rank's keys is reduce-scattered back): the indexer's key
[indexer head dim], MLA's normalised latent [kv_lora_rank] and its rotated RoPE key [rope dim]
(rotated at their own positions before the gather). Each rank then scores its queries against every
key, takes its top-k locally, up-projects the gathered latents to the heads' keys and values (its own
TP heads) and attends over its picks. The gathered keys are put back in sequence order, so that the
top-k sees each query's scores in the single process's order (ties, such as keys every ReLU head
scores 0, then break the same way); absolute positions (zigzag) decide causality.

Bytes per rank and layer (forward): (cp - 1) / cp x s x b x (indexer head dim + kv_lora_rank + rope
dim) x element size for the gather, and as much again for the gradients' reduce-scatter, plus the
document ids under --reset-attention-mask. Only the latents travel, not the per-head keys and values:
each rank up-projects all of them (the up-projection's FLOPs for the whole sequence on every CP
rank), which is cheaper to move than the picked heads' K/V once k x heads x (d + dv) exceeds the
latent's width.

The indexer loss is this rank's partial (its queries' share of the micro-batch's mean), so the
partials sum over CP to the loss of the whole micro-batch, as the MoE losses do.
"""
from __future__ import annotations

import torch

from ..parallel.context_parallel import zigzag_indices
from .dsa_indexer import Selection
from .sparse_attention import sparse_attention


def _natural_order(s_local: int, dims, device) -> torch.Tensor:
    """The permutation putting tokens gathered in CP rank order (each rank's zigzag chunks) back in
    sequence order."""
    every = torch.cat([zigzag_indices(s_local * dims.cp, dims.cp, r, device=device) for r in range(dims.cp)])
    return torch.argsort(every)


def _gather_tokens(t: torch.Tensor, order: torch.Tensor, dims) -> torch.Tensor:
    """[s_local, b, ...] -> [s, b, ...] in sequence order; backward reduce-scatters."""
    return dims.comm.gather_from_sp(t.contiguous(), dims.cp_group, True)[order]


def cp_visible(s_local: int, order: torch.Tensor, docs, dims) -> torch.Tensor:
    """Bool [1 or b, s_local, s]: this rank's queries against every key in sequence order, causal by
    absolute position, within a document."""
    q_pos = zigzag_indices(s_local * dims.cp, dims.cp, dims.cp_rank, device=order.device)
    mask = (q_pos[:, None] >= torch.arange(order.numel(), device=order.device)[None, :])[None]
    if docs is not None:
        every = dims.comm.gather_along(docs.contiguous(), 1, dims.cp_group)[:, order]
        mask = mask & (docs[:, :, None] == every[:, None, :])
    return mask


class ContextParallelDSA:
    """The CP path of one DSA layer (dsa.py holds the layer); stateless besides the layer."""

    def __init__(self, layer):
        self.layer = layer

    def __call__(self, x, qr, q, latent, k_rope, rope, packed):
        """(out [b, s_local, heads, dv], selection, q heads, k heads of every key) of this rank's queries."""
        layer, dims = self.layer, self.layer.dims
        q_nope, q_rope, k_rope = layer._queries(q, k_rope, rope)  # k_rope rotated at its own positions
        b, s_local = q_nope.shape[:2]
        order = _natural_order(s_local, dims, q_nope.device)  # the same order as the single process: its ties
        keys = _gather_tokens(layer.indexer.keys(x, rope).transpose(0, 1), order, dims).transpose(0, 1)
        latents = _gather_tokens(latent, order, dims)  # [s, b, r]
        k_ropes = _gather_tokens(k_rope.transpose(0, 1), order, dims).transpose(0, 1)  # [b, s, 1, dr]
        visible = cp_visible(s_local, order, None if packed is None else packed.document_ids, dims)
        selection: Selection = layer.indexer(x, qr, rope, keys=keys, visible=visible)
        q_heads, k_heads, v_heads = self._heads(q_nope, q_rope, latents, k_ropes)
        if layer._core_for(selection) is None:  # every visible key picked: all of them
            selection = Selection(selection.scores, *self._every_key(visible, b))
        out = sparse_attention(q_heads, k_heads, v_heads, selection.indices, selection.valid)
        return out, selection, q_heads, k_heads

    def _heads(self, q_nope, q_rope, latents, k_ropes):
        """This rank's queries and every key's K and V per local head (MLA's _qkv on the gathered latents)."""
        layer = self.layer
        c = layer.config
        dn, dr, dv = c.qk_head_dim, c.qk_pos_emb_head_dim, c.v_head_dim
        b, s = k_ropes.shape[:2]
        kv = layer._local(layer.linear_kv_up_proj, latents.transpose(0, 1)).reshape(b, s, layer.heads, dn + dv)
        k_nope, v = kv.split([dn, dv], dim=-1)
        q = torch.cat([q_nope, q_rope], dim=-1) * (c.softmax_scale * (dn + dr) ** 0.5)
        k = torch.cat([k_nope, k_ropes.expand(b, s, layer.heads, dr)], dim=-1)
        return q, k, v

    @staticmethod
    def _every_key(visible: torch.Tensor, b: int):
        """(indices, valid) picking every key, the visible ones valid."""
        sq, s = visible.shape[1:]
        indices = torch.arange(s, device=visible.device).expand(b, sq, s)
        return indices, visible.expand(b, sq, s)
