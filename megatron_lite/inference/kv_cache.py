"""A static key/value cache: per self-attention layer, two buffers [b, max_length, kv_heads, d]
allocated once, before the prompt goes in, and filled in place as tokens are decoded.

`kv_heads` is the layer's K/V heads on this rank (`SelfAttention.groups`): under tensor
parallelism each rank caches the heads it computes, so the cache is TP-sharded like the heads
(a K/V group replicated over several TP ranks is cached on each of them).

Every sequence of the batch has the same number of cached tokens (`offset`): prompts are
left-padded to one length (megatron_lite/inference/generation.py), so one decoding step writes
every sequence's new token at the same index. The model's forward calls `update` once per
layer; the caller calls `advance` once the forward is done.
"""
from __future__ import annotations

from typing import Dict, Tuple

import torch
import torch.nn as nn

from ..errors import ConfigError
from ..transformer.attention import SelfAttention


class KVCache:
    def __init__(self, shapes: Dict[int, Tuple[int, int]], batch_size: int, max_length: int,
                 dtype: torch.dtype = torch.float32, device=None):
        """`shapes`: layer number -> (K/V heads on this rank, head dim)."""
        self.batch_size, self.max_length = batch_size, max_length
        self.offset = 0  # tokens cached so far, the same for every sequence
        self.buffers = {layer: tuple(torch.zeros(batch_size, max_length, heads, d, dtype=dtype, device=device)
                                     for _ in range(2))
                        for layer, (heads, d) in shapes.items()}

    @classmethod
    def for_model(cls, model: nn.Module, batch_size: int, max_length: int) -> "KVCache":
        """A cache for every self-attention layer of `model` (one model chunk), in its dtype and
        on its device."""
        layers = [m for m in model.modules() if isinstance(m, SelfAttention)]
        param = next(model.parameters())
        return cls({m.layer_number: (m.groups, m.head_dim) for m in layers}, batch_size, max_length,
                   param.dtype, param.device)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for pair in self.buffers.values() for t in pair)

    def update(self, layer_number: int, k: torch.Tensor, v: torch.Tensor):
        """Store the new tokens' k, v [b, s, kv_heads, d] after the cached ones; return every
        cached key and value [b, offset + s, kv_heads, d] (views of the buffers) and the number
        of tokens cached before these (the queries' absolute position offset)."""
        end = self.offset + k.shape[1]
        if end > self.max_length:
            raise ConfigError(f"KV cache overflow: {end} tokens do not fit the {self.max_length} it was built for")
        k_buf, v_buf = self.buffers[layer_number]
        k_buf[:, self.offset:end] = k
        v_buf[:, self.offset:end] = v
        return k_buf[:, :end], v_buf[:, :end], self.offset

    def advance(self, n: int) -> None:
        """The forward that cached `n` more tokens per sequence is complete."""
        self.offset += n
