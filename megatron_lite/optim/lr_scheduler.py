"""Learning-rate schedule: linear warmup, then cosine / linear decay to min_lr (or constant)."""
from __future__ import annotations

import math


class LRScheduler:
    def __init__(self, max_lr: float, min_lr: float, warmup_iters: int, decay_iters: int, style: str = "cosine"):
        self.max_lr, self.min_lr = max_lr, min_lr
        self.warmup_iters, self.decay_iters, self.style = warmup_iters, max(decay_iters, 1), style

    def lr(self, iteration: int) -> float:
        """Learning rate for iteration `iteration` (1-based: the first update uses lr(1))."""
        if self.warmup_iters > 0 and iteration <= self.warmup_iters:
            return self.max_lr * iteration / self.warmup_iters
        if self.style == "constant":
            return self.max_lr
        if iteration >= self.decay_iters:
            return self.min_lr
        progress = (iteration - self.warmup_iters) / max(1, self.decay_iters - self.warmup_iters)
        if self.style == "linear":
            coeff = 1.0 - progress
        else:
            coeff = 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.min_lr + coeff * (self.max_lr - self.min_lr)

    def state_dict(self) -> dict:
        return dict(vars(self))

    def load_state_dict(self, state: dict) -> None:
        vars(self).update(state)
