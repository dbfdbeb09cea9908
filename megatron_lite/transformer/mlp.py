"""The feed-forward block: GELU MLP (GPT-2) or SwiGLU (Llama), column- then row-parallel."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear


class MLP(nn.Module):
    def __init__(self, cfg, ctx, layer_number: int = 0):
        super().__init__()
        f, dims, sp, dt = cfg.ffn_hidden_size, ctx.dims, ctx.sequence_parallel, ctx.params_dtype
        self.swiglu = cfg.swiglu
        self.activation = cfg.activation
        # SwiGLU keeps [gate | up] in one GEMM; each TP rank holds its slice of both halves.
        self.linear_fc1 = ColumnParallelLinear(
            cfg.hidden_size, 2 * f if cfg.swiglu else f, dims, bias=cfg.add_bias_linear, sequence_parallel=sp,
            segments=[f, f] if cfg.swiglu else None, dtype=dt, gemm=ctx.gemm)
        self.linear_fc2 = RowParallelLinear(f, cfg.hidden_size, dims, bias=cfg.add_bias_linear, sequence_parallel=sp,
                                            dtype=dt, gemm=ctx.gemm)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.linear_fc1(x)
        if self.swiglu:
            gate, up = h.chunk(2, dim=-1)
            h = F.silu(gate) * up
        else:
            h = F.gelu(h, approximate="tanh" if self.activation == "gelu_tanh" else "none")
        return self.linear_fc2(h)
