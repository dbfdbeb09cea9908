"""DeepSeek Sparse Attention (DeepSeek-V3.2; Megatron-Core's `--experimental-attention-variant dsa`):
multi-latent attention whose queries attend to the top-k keys a lightning indexer picks.

Per layer: MLA's latents as usual (mla.py); the indexer (dsa_indexer.py) scores every visible key
for each query from the hidden state and MLA's query latent, detached, and keeps the top-k; the
core attends to those keys only (sparse_attention.py), inside MLA's recomputation regions; the
indexer's KL loss to the main attention (dsa_loss.py) is attached to the layer's output and so
reaches backward with the step's weight, whatever the schedule.

When a query's picks cover every key it sees (top-k at least the sequence) and in the dense
warm-up stage, the core is MLA's own dense core: then DSA is MLA exactly. The loss's target comes
from q and k recomputed without gradient from the detached latents (the up-projections run twice),
so it does not care which recomputation regions hold the core's q and k.

Tensor / sequence parallelism: the indexer is replicated (dsa_indexer.py); under SP it scores the
hidden states gathered along the sequence (without gradient: its inputs are detached anyway).
Context parallelism: dsa_context_parallel.py (the small per-token keys all-gathered, top-k locally).
"""
from __future__ import annotations

import functools
from typing import Optional

import torch

from .counts import Counts, MicroBatch, weights
from .dsa_config import DSASettings
from .dsa_context_parallel import ContextParallelDSA
from .dsa_indexer import LightningIndexer, Selection
from .dsa_loss import INDEXER_LR_GROUP, DSAStepHooks, indexer_kl_loss
from .loss_normalization import attach_loss
from .mla import MLASelfAttention
from .moe.losses import recording
from .core_attention import PackedSeq
from .sparse_attention import sparse_attention


class DSASelfAttention(MLASelfAttention):
    def __init__(self, cfg, ctx, layer_number: int, core_attention, config=None):
        super().__init__(cfg, ctx, layer_number, core_attention, config)
        self.dsa = DSASettings.from_model(cfg)
        self.indexer = LightningIndexer(cfg, ctx, self.dsa)
        for p in self.indexer.parameters():
            p.lr_group = INDEXER_LR_GROUP  # the one group that learns in the dense warm-up
        layers = cfg.num_layers + cfg.mtp_depth
        self.stage = ctx.hooks.shared(DSAStepHooks, layers, self.dsa.dense_warmup_iters, ctx.dims, ctx.device)
        self.loss_weights = ctx.loss_normalization
        self.sequence_parallel = ctx.sequence_parallel
        self.context_parallel = ContextParallelDSA(self)

    def cache_entry(self):
        """MLA's latent and RoPE key, and the indexer's key [head_dim], per token on each rank."""
        return super().cache_entry() + ((self.dsa.head_dim,),)

    def forward(self, x: torch.Tensor, rope=None, packed: Optional[PackedSeq] = None) -> torch.Tensor:
        q, latent, k_rope = self._latents(x)
        if self.sequence_parallel:  # the indexer scores the whole sequence
            x = self.dims.comm.gather_along(x.detach(), 0, self.dims.tp_group)
        qr = q if self.config.q_lora_rank is not None else x
        docs = None if packed is None else packed.document_ids
        if self.cache_update is not None:
            return self._project(self._decode(x, qr, q, latent, k_rope, rope, packed))
        training = self.training and torch.is_grad_enabled() and self.dsa.loss_coeff > 0
        if self.dims.cp > 1:
            out, selection, q_heads, k_heads = self.context_parallel(x, qr, q, latent, k_rope, rope, packed)
        else:
            selection = self.indexer(x, qr, rope, docs)
            out = self._attend(q, latent, k_rope, rope, packed, self._core_for(selection))
            if training:  # the loss's target: q and k again, without gradient (whatever recomputation kept)
                with torch.no_grad():
                    q_heads, k_heads, _ = self._qkv(q.detach(), latent.detach(), k_rope.detach(), rope)
        if training:
            out = self._with_indexer_loss(out, selection, q_heads.detach(), k_heads.detach())
        return self._project(out)

    def _core_for(self, selection: Selection):
        """The core over the selected keys, or None (MLA's dense core) in the dense warm-up or where
        every query may pick every key."""
        if self.stage.dense or selection.indices.shape[-1] >= selection.scores.shape[-1]:
            return None
        return functools.partial(self._sparse_core, selection.indices, selection.valid)

    @staticmethod
    def _sparse_core(indices, valid, q, k, v, packed, q_offset=0):
        return sparse_attention(q, k, v, indices, valid)  # the picks already respect causality and documents

    def _decode(self, x, qr, q, latent, k_rope, rope, packed):
        """Generation: the new tokens' latents, RoPE keys and indexer keys into the cache; the indexer
        scores every cached key; the absorbed attention over the picks."""
        q_nope, q_rope, k_rope = self._queries(q, k_rope, rope)
        latents, k_ropes, index_keys, q_offset = self.cache_update(latent.transpose(0, 1), k_rope.squeeze(2),
                                                                   self.indexer.keys(x, rope))
        docs = None if packed is None else packed.document_ids
        selection = self.indexer(x, qr, rope, docs, keys=index_keys, q_offset=q_offset)
        return self._absorbed_core(q_nope, q_rope, latents, k_ropes, q_offset, packed, self._core_for(selection))

    def _with_indexer_loss(self, out, selection: Selection, q_heads, k_heads):
        """`out`, carrying the indexer's loss into backward (dsa_loss.py): under CP this rank's
        queries' share of the micro-batch's mean."""
        keys = selection.scores > float("-inf")  # every visible key
        if self.dsa.sparse_loss and self._core_for(selection) is not None:
            keys = selection.key_mask()
        loss = indexer_kl_loss(selection.scores, q_heads, k_heads, keys, self.dims) * (self.dsa.loss_coeff / self.dims.cp)
        if recording():
            self.stage.record(self.layer_number, loss)
        return attach_loss(out, loss, self.loss_weights.current.indexer_weight)

    @classmethod
    def counts(cls, cfg, mb: MicroBatch, window=None) -> Counts:
        """MLA's, plus the indexer's projections and norm (its scoring and the sparse core are not
        yet counted apart: the FLOPs are MLA's dense ones)."""
        s = DSASettings.from_model(cfg)
        q_in, h = cfg.q_lora_rank or cfg.hidden_size, cfg.hidden_size
        n = q_in * s.n_heads * s.head_dim + h * s.head_dim + 2 * s.head_dim + h * s.n_heads
        return super().counts(cfg, mb, window) + weights(n)
