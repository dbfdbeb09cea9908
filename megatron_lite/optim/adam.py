"""AdamW on flat fp32 tensors: the update of torch.optim.AdamW (decoupled weight decay, bias
correction), in place, with weight decay restricted to ranges of the flat tensor (a ZeRO shard
mixes decayed weights with biases and norms)."""
from __future__ import annotations

import math
from typing import List, Tuple

import torch


@torch.no_grad()
def adamw_(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *,
           step: int, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
           decay_ranges: List[Tuple[int, int]]) -> None:
    if weight_decay:
        for lo, hi in decay_ranges:
            param[lo:hi].mul_(1.0 - lr * weight_decay)
    exp_avg.lerp_(grad, 1.0 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
    bias_correction1 = 1.0 - beta1 ** step
    bias_correction2 = 1.0 - beta2 ** step
    denom = (exp_avg_sq.sqrt() / math.sqrt(bias_correction2)).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-lr / bias_correction1)
