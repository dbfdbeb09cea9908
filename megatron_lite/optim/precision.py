"""Low-precision optimizer state (--use-precision-aware-optimizer) in plain PyTorch.

Megatron-LM hands these dtypes to Transformer Engine's FusedAdam; we store the states the way it
does and compute every update in fp32:
  fp32        as is;
  bf16        a plain cast (bf16 has fp32's range);
  fp16, fp8   scaled per parameter: stored = x / s with s = absmax(x) / R, R = 65504 / 2 for fp16
              (headroom for the next update) and 448 for fp8 (E4M3's largest value), so small
              second moments neither underflow nor overflow.
A step reads a parameter's state to fp32, updates it, and stores it again (rounding once).

Flags (Megatron's choices): --main-params-dtype fp32|fp16 (the master copy of bf16/fp16 params;
fp32 params are their own master), --main-grads-dtype fp32|bf16 (the gradient buffers: our
GradientSync's grad dtype), --exp-avg-dtype / --exp-avg-sq-dtype fp32|fp16|bf16|fp8. Without
--use-precision-aware-optimizer every one must be fp32; with it, the distributed optimizer
(ZeRO stage >= 1) is required.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence, Tuple

import torch

from ..errors import ConfigError

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.float8_e4m3fn}
CHOICES = {"main_params_dtype": ("fp32", "fp16"), "main_grads_dtype": ("fp32", "bf16"),
           "exp_avg_dtype": ("fp32", "fp16", "bf16", "fp8"), "exp_avg_sq_dtype": ("fp32", "fp16", "bf16", "fp8")}
# Largest stored magnitude of a scaled dtype (Transformer Engine's FusedAdam ranges).
SCALED_RANGE = {torch.float16: torch.finfo(torch.float16).max / 2.0, torch.float8_e4m3fn: 448.0}


@dataclass(frozen=True)
class OptimizerPrecision:
    main_params: torch.dtype = torch.float32
    main_grads: torch.dtype = torch.float32
    exp_avg: torch.dtype = torch.float32
    exp_avg_sq: torch.dtype = torch.float32

    @property
    def is_default(self) -> bool:
        return all(d == torch.float32 for d in (self.main_params, self.main_grads, self.exp_avg, self.exp_avg_sq))

    def dtype_of(self, state: str) -> torch.dtype:
        """The stored dtype of 'main' or of an update rule's state (fp32 without a flag)."""
        flagged = {"main": self.main_params, "exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq}
        return flagged.get(state, torch.float32)

    @classmethod
    def from_flags(cls, *, use_precision_aware_optimizer: bool, main_params_dtype: str, main_grads_dtype: str,
                   exp_avg_dtype: str, exp_avg_sq_dtype: str, distributed_optimizer: bool) -> "OptimizerPrecision":
        """Megatron's checks (OptimizerConfig), from the flags' strings."""
        given = {"main_params_dtype": main_params_dtype, "main_grads_dtype": main_grads_dtype,
                 "exp_avg_dtype": exp_avg_dtype, "exp_avg_sq_dtype": exp_avg_sq_dtype}
        for name, value in given.items():
            if value not in CHOICES[name]:
                raise ConfigError(f"--{name.replace('_', '-')} {value}: choose one of {', '.join(CHOICES[name])}")
        low = [f"--{k.replace('_', '-')} {v}" for k, v in given.items() if v != "fp32"]
        if low and not use_precision_aware_optimizer:
            raise ConfigError(f"{', '.join(low)} needs --use-precision-aware-optimizer (without it every optimizer "
                              f"dtype is fp32)")
        if use_precision_aware_optimizer and not distributed_optimizer:
            raise ConfigError("--use-precision-aware-optimizer needs the distributed optimizer "
                              "(--use-distributed-optimizer or --zero-stage >= 1)")
        return cls(*(DTYPES[given[k]] for k in ("main_params_dtype", "main_grads_dtype", "exp_avg_dtype",
                                                "exp_avg_sq_dtype")))


class StateStorage:
    """One optimizer state over a shard, stored in `dtype`, read and written per segment (one
    segment = one parameter's part of the shard, the unit a scale covers)."""

    def __init__(self, init: torch.Tensor, dtype: torch.dtype, segments: Sequence[Tuple[int, int]]):
        self.dtype, self.segments = dtype, list(segments)
        self.scaled = dtype in SCALED_RANGE
        self.data = torch.zeros(init.numel(), dtype=dtype, device=init.device)  # padding stays 0
        self.scales = torch.ones(len(self.segments) if self.scaled else 0, dtype=torch.float32, device=init.device)
        self.write_all(init.float())

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size() + self.scales.numel() * 4

    def read(self, k: int) -> torch.Tensor:
        """Segment k in fp32 (a fresh tensor)."""
        lo, hi = self.segments[k]
        x = self.data[lo:hi].float()
        return x.mul_(self.scales[k]) if self.scaled else x

    def write(self, k: int, x: torch.Tensor) -> None:
        """Store fp32 values `x` as segment k (rescaled to the segment's new absmax)."""
        lo, hi = self.segments[k]
        if self.scaled and x.numel():
            scale = x.abs().max() / SCALED_RANGE[self.dtype]
            self.scales[k] = scale
            x = x * torch.where(scale > 0, 1.0 / scale, 0.0)  # all zeros: scale 0, stored 0
        self.data[lo:hi].copy_(x)

    def read_all(self) -> torch.Tensor:
        """The whole shard in fp32 (checkpoints hold optimizer states in fp32)."""
        out = torch.zeros(self.data.numel(), dtype=torch.float32, device=self.data.device)
        for k, (lo, hi) in enumerate(self.segments):
            out[lo:hi] = self.read(k)
        return out

    def write_all(self, x: torch.Tensor) -> None:
        for k, (lo, hi) in enumerate(self.segments):
            self.write(k, x[lo:hi])
