"""A static cache for generation: per attention layer, the buffers [b, max_length, ...] that its
attention module asks for (`cache_entry()`: the per-token shape of each tensor it stores; K
[kv heads, d] and V [kv heads, dv] for standard attention, latents for MLA), allocated once, before
the prompt goes in, and filled in place as tokens are decoded.

Under tensor parallelism each rank caches what its own heads need, so the cache is TP-sharded like
the heads (a K/V group replicated over several TP ranks is cached on each of them).

Every sequence of the batch has the same number of cached tokens (`offset`): prompts are
left-padded to one length (megatron_lite/inference/generation.py), so one decoding step writes
every sequence's new token at the same index. The model's forward runs its layers with the cache
`attached` (each attention module's `cache_update` then stores its new tokens through `update`);
the caller calls `advance` once the forward is done.

A recurrent mixer (Mamba-2, Gated DeltaNet, KDA) keeps a fixed size per sequence instead, whatever
the length: its `cache_entry()` is a `RecurrentState` of shapes (conv history, recurrent state),
allocated [b, *shape] in float32 (the state's precision) and handed back whole by `update`, which the
mixer reads and overwrites in place.
"""
from __future__ import annotations

import contextlib
import functools
import math
from typing import Dict, List, Sequence, Tuple

import torch
import torch.nn as nn

from ..errors import ConfigError
from ..transformer.spec import RecurrentState


def _cache_owners(model: nn.Module) -> List[nn.Module]:
    """The attention modules of `model` that keep a cache entry."""
    return [m for m in model.modules() if hasattr(m, "cache_entry")]


def _recurrent(module: nn.Module) -> bool:
    return isinstance(module.cache_entry(), RecurrentState)


def kv_cache_bytes_per_token(model: nn.Module) -> int:
    """Bytes this rank caches per token of one sequence over every attention layer of `model` (in
    its parameter dtype): K and V per head group for standard attention, the latent and RoPE key
    for MLA; nothing for recurrent mixers (recurrent_state_bytes)."""
    size = next(model.parameters()).element_size()
    return sum(math.prod(shape) * size for m in _cache_owners(model) if not _recurrent(m) for shape in m.cache_entry())


def recurrent_state_bytes(model: nn.Module) -> int:
    """Bytes this rank keeps per sequence for the recurrent mixers of `model` (float32), whatever its length."""
    return sum(math.prod(shape) * 4 for m in _cache_owners(model) if _recurrent(m) for shape in m.cache_entry().shapes)


class KVCache:
    def __init__(self, entries: Dict[int, Sequence[Tuple[int, ...]]], batch_size: int, max_length: int,
                 dtype: torch.dtype = torch.float32, device=None):
        """`entries`: layer number -> the per-token shape of each tensor that layer caches, or a
        RecurrentState (the per-sequence shapes a recurrent mixer keeps)."""
        self.batch_size, self.max_length = batch_size, max_length
        self.offset = 0  # tokens cached so far, the same for every sequence
        self.buffers = {layer: tuple(torch.zeros(batch_size, max_length, *shape, dtype=dtype, device=device)
                                     for shape in shapes)
                        for layer, shapes in entries.items() if not isinstance(shapes, RecurrentState)}
        # Recurrent states: fp32 whatever the model's dtype (the scan keeps its state in fp32)
        self.states = {layer: tuple(torch.zeros(batch_size, *shape, dtype=torch.float32, device=device)
                                    for shape in entry.shapes)
                       for layer, entry in entries.items() if isinstance(entry, RecurrentState)}

    @classmethod
    def for_model(cls, model: nn.Module, batch_size: int, max_length: int) -> "KVCache":
        """A cache for every attention layer of `model` (one model chunk), in its dtype and on its
        device."""
        param = next(model.parameters())
        return cls({m.layer_number: m.cache_entry() for m in _cache_owners(model)}, batch_size, max_length,
                   param.dtype, param.device)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for held in (self.buffers, self.states)
                   for entry in held.values() for t in entry)

    def update(self, layer_number: int, *new: torch.Tensor) -> Tuple:
        """Store the new tokens' tensors [b, s, ...] after the cached ones; return every cached one
        [b, offset + s, ...] (views of the buffers) and the number of tokens cached before these
        (the queries' absolute position offset). A recurrent layer passes nothing and gets its
        state tensors, to update in place."""
        if layer_number in self.states:
            return (*self.states[layer_number], self.offset)
        end = self.offset + new[0].shape[1]
        if end > self.max_length:
            raise ConfigError(f"KV cache overflow: {end} tokens do not fit the {self.max_length} it was built for")
        entry = self.buffers[layer_number]
        for buffer, tensor in zip(entry, new):
            buffer[:, self.offset:end] = tensor
        return (*(buffer[:, :end] for buffer in entry), self.offset)

    @contextlib.contextmanager
    def attached(self, model: nn.Module):
        """Within, every cache-owning attention module of `model` stores its new tokens here: the
        cache reaches the attention without passing through the layers' (training) forwards."""
        owners = _cache_owners(model)
        for m in owners:
            m.cache_update = functools.partial(self.update, m.layer_number)
        try:
            yield
        finally:
            for m in owners:
                m.cache_update = None

    def advance(self, n: int) -> None:
        """The forward that cached `n` more tokens per sequence is complete."""
        self.offset += n
