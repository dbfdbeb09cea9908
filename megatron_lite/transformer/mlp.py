"""The feed-forward block: GELU MLP (GPT-2), squared-ReLU MLP (Nemotron-H) or a gated linear unit
(SwiGLU: Llama; quick-GeGLU with a clamp and a linear offset: gpt-oss), column- then row-parallel."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..parallel.random import recompute
from ..parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from .counts import Counts, MicroBatch, weights
from .replay import gated


@dataclass(frozen=True)
class GatedUnit:
    """Megatron-Core's gated linear unit over [gate | up]: act(gate) * (up + linear_offset), with
    gate clamped from above and up to [-clamp, clamp] when `clamp` is set; act is silu (--swiglu) or
    quick-GELU, x sigmoid(1.702 x) (--quick-geglu). gpt-oss: quick-GELU, offset 1, clamp 7."""
    quick_gelu: bool = False
    linear_offset: float = 0.0
    clamp: Optional[float] = None

    @classmethod
    def of(cls, cfg) -> "GatedUnit":
        return cls(cfg.quick_geglu, cfg.glu_linear_offset, cfg.activation_func_clamp_value)

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        # Backward keeps only [gate | up] (replay.py), not act(gate) beside it.
        return gated(self, h)

    @property
    def plain_silu(self) -> bool:
        return not self.quick_gelu and self.clamp is None

    def act(self, gate: torch.Tensor) -> torch.Tensor:
        if self.clamp is not None:
            gate = gate.clamp(max=self.clamp)
        return gate * torch.sigmoid(1.702 * gate) if self.quick_gelu else F.silu(gate)

    def up(self, up: torch.Tensor) -> torch.Tensor:
        if self.clamp is not None:
            up = up.clamp(-self.clamp, self.clamp)
        return up + self.linear_offset if self.linear_offset else up


class MLP(nn.Module):
    def __init__(self, cfg, ctx, layer_number: int = 0):
        super().__init__()
        f, dims, sp, dt = cfg.ffn_hidden_size, ctx.dims, ctx.sequence_parallel, ctx.params_dtype
        self.swiglu = cfg.swiglu
        self.activation = "squared_relu" if getattr(cfg, "squared_relu", False) else cfg.activation
        self.glu = GatedUnit.of(cfg)
        # SwiGLU keeps [gate | up] in one GEMM; each TP rank holds its slice of both halves.
        self.linear_fc1 = ColumnParallelLinear(
            cfg.hidden_size, 2 * f if cfg.swiglu else f, dims, bias=cfg.add_bias_linear, sequence_parallel=sp,
            segments=[f, f] if cfg.swiglu else None, dtype=dt, gemm=ctx.gemm)
        self.linear_fc2 = RowParallelLinear(f, cfg.hidden_size, dims, bias=cfg.add_bias_linear, sequence_parallel=sp,
                                            dtype=dt, gemm=ctx.gemm)
        # --recompute-modules mlp: only the input is kept; backward runs the MLP again
        self.recompute_tracker = ctx.tracker if ctx.recomputes("mlp") else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.recompute_tracker is not None and self.training and torch.is_grad_enabled():
            return recompute(self._forward, self.recompute_tracker, x)
        return self._forward(x)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.linear_fc1(x)
        if self.swiglu:
            h = self.glu(h)
        elif self.activation == "squared_relu":  # Nemotron-H (Megatron's --squared-relu)
            h = F.relu(h).square()
        else:
            h = F.gelu(h, approximate="tanh" if self.activation == "gelu_tanh" else "none")
        return self.linear_fc2(h)

    @classmethod
    def counts(cls, cfg, mb: MicroBatch) -> Counts:
        f = cfg.ffn_hidden_size
        out = ffn_counts(cfg.hidden_size, f, cfg.swiglu, cfg.add_bias_linear, mb.a, f // mb.tp, mb.tokens)
        return out._replace(act_bytes=0) if mb.recomputes("mlp") else out  # only its input: the norm's output


def ffn_counts(h: int, f: int, swiglu: bool, bias: bool, a: int, f_rank: int, tokens: int = 1,
               recompute_act: bool = False) -> Counts:
    """One feed-forward block h -> f -> h (a dense MLP, an expert, a shared expert), its activations
    over `tokens` with `f_rank` channels on this rank: SwiGLU's [gate | up] and their product, 3 a f
    (the gated unit recomputes silu(gate) in backward); GELU's input and output, 2 a f; with
    `recompute_act` (moe_act) not the activation's output, a f less."""
    fc1 = 2 * f if swiglu else f
    kept = (3 if swiglu else 2) - (1 if recompute_act else 0)
    return weights(h * (fc1 + f) + (fc1 + h if bias else 0), act_bytes=kept * a * f_rank * tokens)
