"""One pre-norm transformer layer: x + attn(norm(x)), then x + mlp(norm(x)), its submodules built
from a TransformerLayerSpec (spec.py)."""
from __future__ import annotations

import functools
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..parallel.random import recompute, recomputed_when_saved
from .core_attention import PackedSeq
from .spec import TransformerLayerSpec


class TransformerLayer(nn.Module):
    def __init__(self, cfg, ctx, layer_number: int, spec: TransformerLayerSpec):
        super().__init__()
        self.layer_number = layer_number
        self.sequence_parallel, self.tracker = ctx.sequence_parallel, ctx.tracker
        self.hidden_dropout = cfg.hidden_dropout
        self.self_attention = self.mlp = None  # a hybrid layer has one of them (spec.py)
        if spec.self_attention is not None:
            self.input_layernorm = spec.input_layernorm(cfg, ctx, layer_number)
            self.self_attention = spec.self_attention(cfg, ctx, layer_number, core_attention=spec.core_attention)
        if spec.mlp is not None:
            self.pre_mlp_layernorm = spec.pre_mlp_layernorm(cfg, ctx, layer_number)
            self.mlp = spec.mlp(cfg, ctx, layer_number)
        self.recompute_norms = ctx.recomputes("layernorm")
        self.offloader = ctx.offloader if layer_number < ctx.offloaded_layers else None

    def _dropout_add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        p = self.hidden_dropout if self.training else 0.0
        if p == 0.0:
            return residual + x
        if self.sequence_parallel:  # sequence shards differ across TP ranks: per-rank stream
            with self.tracker.fork():
                return residual + F.dropout(x, p, True)
        return residual + F.dropout(x, p, True)

    compiled = False  # --compile (transformer/fast_paths.py:compile_layer): this layer runs compiled

    def forward(self, x: torch.Tensor, rope=None, packed: Optional[PackedSeq] = None) -> torch.Tensor:
        if self.offloader is not None and self.training and torch.is_grad_enabled():
            with self.offloader.layer(self.layer_number):  # what backward keeps waits in host memory
                return self._run(x, rope, packed)
        return self._run(x, rope, packed)

    def _run(self, x: torch.Tensor, rope=None, packed: Optional[PackedSeq] = None) -> torch.Tensor:
        if self.compiled and getattr(self.self_attention, "cache_update", None) is None:  # decoding runs eager
            return compiled_layer_forward()(self, x, rope, packed)
        return self._forward(x, rope, packed)

    def _forward(self, x: torch.Tensor, rope=None, packed: Optional[PackedSeq] = None) -> torch.Tensor:
        if self.self_attention is not None:
            x = self._dropout_add(self._norm_then(self.input_layernorm, self.self_attention, x, rope, packed), x)
        return self._dropout_add(self._mlp_block(x), x) if self.mlp is not None else x

    def _norm_then(self, norm: nn.Module, block: nn.Module, x: torch.Tensor, *args) -> torch.Tensor:
        """block(norm(x)); under --recompute-modules layernorm the norm's output is not kept for
        backward (the block's linear layers would keep it): it is computed again from x there."""
        y = norm(x)
        if not (self.recompute_norms and self.training and torch.is_grad_enabled()):
            return block(y, *args)
        with recomputed_when_saved(y, norm, x):
            return block(y, *args)

    def _mlp_block(self, x: torch.Tensor) -> torch.Tensor:
        if self.recompute_norms and getattr(self.mlp, "recompute_tracker", None) is not None and self.training \
                and torch.is_grad_enabled():
            # The MLP slot is recomputed whole (mlp, moe): the norm joins its region, so only x is kept
            return recompute(lambda y: self.mlp._forward(self.pre_mlp_layernorm(y)), self.tracker, x)
        return self._norm_then(self.pre_mlp_layernorm, self.mlp, x)


@functools.cache
def compiled_layer_forward():
    """One torch.compile of the layer's forward function, shared by every compiled layer (one code
    object: the layers differ only in their parameters, so one graph serves them all). A flag on
    the layer selects it, so a deepcopy or a pickle of the model stays a plain module."""
    return torch.compile(TransformerLayer._forward)
