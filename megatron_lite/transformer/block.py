"""One pre-norm transformer layer: x + attn(norm(x)), then x + mlp(norm(x))."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..config import ModelConfig
from ..parallel.random import RNGStatesTracker
from ..parallel.state import ParallelDims
from .attention import SelfAttention
from .mlp import MLP
from .norm import build_norm


class TransformerLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, dims: ParallelDims, layer_number: int, sequence_parallel: bool,
                 dtype, tracker: RNGStatesTracker, recompute_core_attention: bool = False):
        super().__init__()
        self.layer_number = layer_number
        self.sequence_parallel, self.tracker = sequence_parallel, tracker
        self.hidden_dropout = cfg.hidden_dropout
        self.input_layernorm = build_norm(cfg.normalization, cfg.hidden_size, cfg.norm_epsilon, sequence_parallel, dtype)
        self.self_attention = SelfAttention(cfg, dims, sequence_parallel, dtype, tracker, recompute_core_attention)
        self.pre_mlp_layernorm = build_norm(cfg.normalization, cfg.hidden_size, cfg.norm_epsilon, sequence_parallel, dtype)
        self.mlp = MLP(cfg, dims, sequence_parallel, dtype)

    def _dropout_add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        p = self.hidden_dropout if self.training else 0.0
        if p == 0.0:
            return residual + x
        if self.sequence_parallel:  # sequence shards differ across TP ranks: per-rank stream
            with self.tracker.fork():
                return residual + F.dropout(x, p, True)
        return residual + F.dropout(x, p, True)

    def forward(self, x: torch.Tensor, rope=None, attention_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        x = self._dropout_add(self.self_attention(self.input_layernorm(x), rope, attention_mask), x)
        return self._dropout_add(self.mlp(self.pre_mlp_layernorm(x)), x)
