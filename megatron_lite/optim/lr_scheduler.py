"""Learning-rate schedule as in Megatron-LM: linear warmup from 0, then cosine / linear decay to
min_lr (or constant). It advances once per successful update (skipped fp16 steps do not count)."""
from __future__ import annotations

import math


class LRScheduler:
    def __init__(self, max_lr: float, min_lr: float, warmup_iters: int, decay_iters: int, style: str = "cosine"):
        self.max_lr, self.min_lr = max_lr, min_lr
        self.warmup_iters, self.decay_iters, self.style = warmup_iters, max(decay_iters, 1), style
        self.num_steps = 0  # successful updates so far

    def lr(self, num_steps: int = None) -> float:
        """The learning rate after `num_steps` updates (default: the current count)."""
        n = self.num_steps if num_steps is None else num_steps
        if self.warmup_iters > 0 and n <= self.warmup_iters:
            return self.max_lr * n / self.warmup_iters
        if self.style == "constant":
            return self.max_lr
        if n > self.decay_iters:
            return self.min_lr
        progress = (n - self.warmup_iters) / max(1, self.decay_iters - self.warmup_iters)
        coeff = 1.0 - progress if self.style == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.min_lr + coeff * (self.max_lr - self.min_lr)

    def step(self) -> None:
        self.num_steps += 1

    def state_dict(self) -> dict:
        return dict(vars(self))

    def load_state_dict(self, state: dict) -> None:
        vars(self).update(state)
