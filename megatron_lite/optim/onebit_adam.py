"""1-bit Adam (Tang et al. 2021, as DeepSpeed's OnebitAdam defines it): --optimizer adam-1bit
--freeze-step N.

Warm-up: the first N steps are our AdamW exactly (the gradients all-reduced in fp32, the fused
update). Then the variance is frozen (v and its bias correction as they were after step N) and
the gradients are no longer all-reduced: each rank folds its own gradient into the momentum,
and the momenta are averaged by DeepSpeed's compressed all-reduce: signs packed 8 to a byte with
a scale (the RMS) per tensor in each rank's piece of the bucket (DeepSpeed compresses each tensor
apart: one scale per bucket gives a tensor of small values the bucket's typical one), with
error feedback on the sending rank (worker error) and on the rank that sums each piece (server
error; none kept where the momentum is masked, below); see parallel/compression.py. The update is then
p -= lr * (m / bc1) / (sqrt(v / bc2(N)) + eps), after decoupled weight decay. Elements whose
frozen variance is 0 (no gradient ever, e.g. padded vocabulary rows) keep a zero momentum
(DeepSpeed's momentum mask): a sign cannot say 0.

Layout: ZeRO 0 (each rank holds the whole momentum), as DeepSpeed's. The gradient of rank r
here is its part of the global sum (each micro-batch's loss is normalised by the global token
count), so N_dp x g_r is its estimate of the whole, which its momentum takes.

Checkpoints: each rank's own errors (optim/feedback_state.py), which a load at the same layout
restores, so that saving leaves the run bit-identical to one that does not save; and the errors'
sum over ranks (their mean, as the momenta are averaged) as `exp_avg_residual` over the bucket
(a collective on copies), which a load at another DP size gives every rank as its worker error,
with server errors zero, which leaves the average the next compressed all-reduce computes
unchanged, whatever the number of ranks.
"""
from __future__ import annotations

import math
from typing import Callable, Dict, Sequence

import torch

from ..parallel.comm import Communicator
from ..parallel.compression import ErrorFeedbackExchange
from ..parallel.data_parallel import PlainReducer
from .adam import AdamW


def decay_and_step_(s, main: torch.Tensor, m: torch.Tensor, denom: torch.Tensor, lr_of, weight_decay: float,
                    bias_correction1: float, also_decayed: Sequence[torch.Tensor] = ()) -> None:
    """Adam's step with a given denominator, LR run by LR run of shard `s`: decoupled weight decay
    of `main` (and of `also_decayed`, tensors laid out like it) on the decayed ranges, then
    main -= lr * (m / bias_correction1) / denom."""
    for group, lo, hi in s.lr_runs_for(lr_of):
        lr = lr_of(group)
        if weight_decay:
            for a, z in s.decay:
                a, z = max(a, lo), min(z, hi)
                if a < z:
                    for t in (main, *also_decayed):
                        t[a:z].mul_(1.0 - lr * weight_decay)
        main[lo:hi].addcdiv_(m[lo:hi], denom[lo:hi], value=-lr / bias_correction1)


class OneBitReducer(PlainReducer):
    """The plain gradient reduction during warm-up; none once the variance is frozen (`frozen()`
    true: the momentum is what gets communicated)."""

    def __init__(self, comm: Communicator):
        super().__init__(comm)
        self.frozen: Callable[[], bool] = lambda: False

    def start(self, b):
        return None if self.frozen() else super().start(b)

    def finish(self, b) -> None:
        if not self.frozen():
            super().finish(b)


class OneBitAdam:
    """An update rule over whole shards (see DistributedOptimizer's `update_shard_` rules)."""
    state_names = AdamW.state_names
    residual_name = "exp_avg_residual"
    per_tensor_scales = True  # one sign scale per tensor within each bucket row (False: one per bucket)

    def __init__(self, adam: AdamW, freeze_step: int, comm: Communicator):
        self.adam, self.freeze_step = adam, freeze_step
        self.exchange = ErrorFeedbackExchange(comm, "sign")
        self.loaded: Dict[int, torch.Tensor] = {}  # a checkpoint's residual per bucket, not yet applied

    def apply_loaded(self, b) -> None:
        if b.index in self.loaded:
            self.exchange.set_worker(b.index, self.loaded.pop(b.index), b.group_size)

    def compressed_sum_(self, b, x: torch.Tensor) -> None:
        """x := its sum over b's ranks through the compressed all-reduce (in place)."""
        if self.per_tensor_scales:
            self.exchange.scale_per_tensor(b.index, b.offsets, b.numel, b.group_size)
        self.exchange.all_reduce(b.index, x, b.group, b.group_size)

    @torch.no_grad()
    def update_shard_(self, s, grad: torch.Tensor, lr_of, weight_decay: float, step: int) -> None:
        if step <= self.freeze_step:  # exactly AdamW (the gradient was all-reduced)
            s.update(self.adam, grad, lr_of, weight_decay, step)
            return
        b, t = s.bucket, s.store.tensors
        self.apply_loaded(b)
        m, v, main = t["exp_avg"], t["exp_avg_sq"], t["main"]
        beta1, beta2, eps = self.adam.hyper
        m.lerp_(grad * b.group_size, 1.0 - beta1)
        dead = v == 0
        if b.group_size > 1:
            self.compressed_sum_(b, m)
            m.div_(b.group_size)
            self._clear_dead_errors(b, dead)
        m.masked_fill_(dead, 0.0)
        denom = (v.sqrt() / math.sqrt(1.0 - beta2 ** self.freeze_step)).add_(eps)
        decay_and_step_(s, main, m, denom, lr_of, weight_decay, 1.0 - beta1 ** step)

    def _clear_dead_errors(self, b, dead: torch.Tensor) -> None:
        """No error where the momentum is masked, nor in the pieces' padding: a sign would grow one
        there step after step, which would weigh in the scales and is in no checkpoint."""
        ex = self.exchange
        dead_rows = ex.to_rows((~dead).float(), b.group_size) == 0  # (the padding too)
        ex.worker[b.index].masked_fill_(dead_rows, 0.0)
        ex.server[b.index].masked_fill_(dead_rows[b.group_rank], 0.0)

    # --- checkpoints ---------------------------------------------------------------------------
    def fold_for_checkpoint(self, b) -> torch.Tensor:
        """Collective: the mean over ranks of the errors (whole bucket), which a load at another
        layout gives every rank as its worker error. The running job's errors stay as they are."""
        self.apply_loaded(b)
        if b.index not in self.exchange.worker:
            return torch.zeros(b.numel, dtype=torch.float32, device=b.device)
        return self.exchange.summed_errors(b.index, b.numel, b.group, b.group_size, b.device).div_(b.group_size)

    def own_errors(self, b) -> Dict[str, torch.Tensor]:
        """Copies of this rank's own errors of bucket b (after fold_for_checkpoint)."""
        return self.exchange.own_errors(b.index)

    def restore_own_errors(self, b, saved: Dict[str, torch.Tensor]) -> None:
        """Instead of the mean that residual_for_loading() filled: this rank's own errors."""
        self.loaded.pop(b.index, None)
        self.exchange.restore_errors(b.index, saved)

    def residual_for_loading(self, b) -> torch.Tensor:
        """The tensor a load fills (every rank reads the whole): this rank's worker error from the
        next update on."""
        self.loaded[b.index] = torch.zeros(b.numel, dtype=torch.float32, device=b.device)
        return self.loaded[b.index]
