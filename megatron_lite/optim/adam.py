"""AdamW on flat fp32 tensors: the update of torch.optim.AdamW (decoupled weight decay, bias
correction), in place, with weight decay restricted to ranges of the flat tensor (a ZeRO shard
mixes decayed weights with biases and norms): the distributed optimizer's update rule.

PyTorch's fused AdamW kernel (CPU and CUDA) does it in one pass without temporaries; elsewhere
the plain formula runs over slices, so that its temporaries stay small (whole-shard temporaries
of tens of MB are fresh pages on every step: 3-4x slower on CPU)."""
from __future__ import annotations

import functools
import math
from typing import Dict, List, Tuple

import torch

_FUSED = getattr(torch, "_fused_adamw_", None)


@functools.cache
def fused_adamw_available(device_type: str) -> bool:
    """Whether this build has the fused AdamW kernel for the device: tried once on one element.
    Only a missing kernel turns the fused path off; errors of real calls (out of memory) propagate."""
    if _FUSED is None or device_type not in ("cpu", "cuda"):
        return False
    one = torch.zeros(1, device=device_type)
    try:
        _FUSED([one], [one.clone()], [one.clone()], [one.clone()], [], [torch.ones((), device=device_type)],
               lr=0.0, beta1=0.9, beta2=0.999, weight_decay=0.0, eps=1e-8, amsgrad=False, maximize=False)
    except (RuntimeError, NotImplementedError):
        return False
    return True


@functools.cache
def _step_tensor(device: torch.device) -> torch.Tensor:
    """The fused kernel's step count on the device, refilled each call (a fill kernel, where a new
    tensor from a Python number would be a host-to-device copy every step)."""
    return torch.zeros((), dtype=torch.float32, device=device)


_SLICE = 1 << 18  # elements per slice of the unfused formula


def _adam_formula(param, grad, exp_avg, exp_avg_sq, step, lr, beta1, beta2, eps) -> None:
    exp_avg.lerp_(grad, 1.0 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
    bias_correction1 = 1.0 - beta1 ** step
    bias_correction2 = 1.0 - beta2 ** step
    denom = (exp_avg_sq.sqrt() / math.sqrt(bias_correction2)).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-lr / bias_correction1)


class AdamW:
    """An update rule (another, e.g. Muon, has the same two members): the names of its states, as
    checkpoints store them (`optim/<param>/<name>`; the state store allocates them at zero), and
    the in-place update of flat fp32 main params from their gradient (`states`: the shard's
    tensors by name, the rule's among them)."""
    state_names = ("exp_avg", "exp_avg_sq")

    def __init__(self, beta1: float, beta2: float, eps: float):
        self.hyper = (beta1, beta2, eps)

    @torch.no_grad()
    def update_(self, param: torch.Tensor, grad: torch.Tensor, states: Dict[str, torch.Tensor], *, step: int,
                lr: float, weight_decay: float, decay_ranges: List[Tuple[int, int]]) -> None:
        exp_avg, exp_avg_sq = states["exp_avg"], states["exp_avg_sq"]
        beta1, beta2, eps = self.hyper
        if weight_decay:  # decoupled decay first, as torch.optim.AdamW does
            for lo, hi in decay_ranges:
                param[lo:hi].mul_(1.0 - lr * weight_decay)
        if fused_adamw_available(param.device.type):
            steps = [_step_tensor(param.device).fill_(float(step))]
            _FUSED([param], [grad], [exp_avg], [exp_avg_sq], [], steps, lr=lr, beta1=beta1, beta2=beta2,
                   weight_decay=0.0, eps=eps, amsgrad=False, maximize=False)
            return
        for lo in range(0, param.numel(), _SLICE):
            s = slice(lo, lo + _SLICE)
            _adam_formula(param[s], grad[s], exp_avg[s], exp_avg_sq[s], step, lr, beta1, beta2, eps)
