"""Mixed-precision AdamW over this rank's parameters, with global-norm clipping across every
model-parallel rank and (fp16) dynamic loss scaling.

Model parameters may be bf16/fp16; the optimizer keeps fp32 main parameters and fp32 gradients
and copies the updated values back. Data-parallel gradient reduction happens before `step` in
`GradientSync.finish` (megatron_lite/parallel/data_parallel.py).
"""
from __future__ import annotations

import math
from typing import Dict, List

import torch
import torch.distributed as dist
import torch.nn as nn

from ..config import ParallelConfig, TrainingConfig
from ..parallel import comm
from ..parallel.grads import counts_in_norm, local_grad_sq_norm
from ..parallel.state import ParallelDims
from .loss_scaler import ConstantLossScaler, DynamicLossScaler


def no_weight_decay(name: str, p: nn.Parameter) -> bool:
    """Biases and norm weights (every 1-D parameter) are not decayed."""
    return p.dim() == 1 or name.endswith(".bias")


class MixedPrecisionOptimizer:
    def __init__(self, chunks: List[nn.Module], dims: ParallelDims, tcfg: TrainingConfig, pcfg: ParallelConfig):
        self.dims, self.tcfg = dims, tcfg
        self.params: List[nn.Parameter] = []
        decay, no_decay = [], []
        for chunk in chunks:
            for name, p in chunk.named_parameters():
                self.params.append(p)
        self.fp32_params = all(p.dtype == torch.float32 for p in self.params)
        # Main params: the fp32 copies the optimizer updates (the params themselves in fp32).
        self.main_params = [p if self.fp32_params else p.detach().float().clone() for p in self.params]
        for chunk in chunks:
            for name, p in chunk.named_parameters():
                mp = self.main_params[self._index(p)]
                (no_decay if no_weight_decay(name, p) else decay).append(mp)
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": tcfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=tcfg.lr, betas=(tcfg.adam_beta1, tcfg.adam_beta2), eps=tcfg.adam_eps, foreach=False)
        if tcfg.fp16:
            self.scaler = DynamicLossScaler(tcfg.initial_loss_scale, tcfg.min_loss_scale, tcfg.loss_scale_window,
                                            tcfg.hysteresis)
        else:
            self.scaler = ConstantLossScaler(1.0)

    def _index(self, p: nn.Parameter) -> int:
        for i, q in enumerate(self.params):
            if q is p:
                return i
        raise KeyError("parameter not managed by this optimizer")

    @property
    def loss_scale(self) -> float:
        return self.scaler.scale

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def _main_grads(self) -> List[torch.Tensor]:
        grads = []
        for p, mp in zip(self.params, self.main_params):
            g = p.grad if p.grad is not None else torch.zeros_like(p)
            g = g.float() if g.dtype != torch.float32 else g
            if self.scaler.scale != 1.0:
                g = g / self.scaler.scale
            if mp is not p:
                mp.grad = g
            else:
                p.grad = g
            grads.append(g)
        return grads

    def _all_model_reduce(self, t: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
        comm.all_reduce(t, self.dims.mp_group, op=op)
        return t

    def grad_norm(self, grads: List[torch.Tensor]) -> float:
        counted = [g for p, g in zip(self.params, grads) if counts_in_norm(p, self.dims)]
        sq = self._all_model_reduce(local_grad_sq_norm(counted))
        return math.sqrt(sq.item())

    def found_inf(self, grads: List[torch.Tensor]) -> bool:
        flag = torch.tensor([0.0])
        for g in grads:
            if not torch.isfinite(g).all():
                flag.fill_(1.0)
                break
        self._all_model_reduce(flag, dist.ReduceOp.MAX)
        comm.all_reduce(flag, self.dims.dp_group, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    @torch.no_grad()
    def step(self, lr: float) -> Dict[str, float]:
        grads = self._main_grads()
        scale = self.scaler.scale
        if self.tcfg.fp16 and self.found_inf(grads):
            self.scaler.update(True)
            self.zero_grad()
            return {"update_successful": False, "grad_norm": float("nan"), "loss_scale": scale}
        self.scaler.update(False)
        norm = self.grad_norm(grads)
        if self.tcfg.clip_grad > 0 and norm > self.tcfg.clip_grad:
            coeff = self.tcfg.clip_grad / (norm + 1e-6)
            for g in grads:
                g.mul_(coeff)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        if not self.fp32_params:
            for p, mp in zip(self.params, self.main_params):
                p.copy_(mp)
        self.zero_grad()
        return {"update_successful": True, "grad_norm": norm, "loss_scale": scale}

    def memory_bytes(self) -> Dict[str, int]:
        state = sum(t.numel() * t.element_size() for s in self.optimizer.state.values()
                    for t in s.values() if torch.is_tensor(t) and t.dim() > 0)
        main = 0 if self.fp32_params else sum(mp.numel() * 4 for mp in self.main_params)
        return {"param_bytes": sum(p.numel() * p.element_size() for p in self.params),
                "grad_bytes": sum(p.numel() * 4 for p in self.params),
                "optimizer_state_bytes": state + main}

    def state_dict(self) -> dict:
        return {"optimizer": self.optimizer.state_dict(), "scaler": self.scaler.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.scaler.load_state_dict(state["scaler"])
