"""0/1 Adam (Lu et al. 2022, as DeepSpeed's ZeroOneAdam defines it): --optimizer adam-01
--var-freeze-step F --var-update-scaler K --local-step-scaler S --local-step-clipper H.

Steps t = 1..F (the variance phase): at the steps of T_v (the interval starts at 1 and doubles
after every K of them, each a multiple of its interval, as DeepSpeed counts) the gradients are
all-reduced in fp32 (the plain reducer) and m and v take them as Adam does; at the other steps the
reducer sends nothing and each rank's gradient (N_dp x its part of the global sum: its estimate
of the whole) is averaged by 1-bit Adam's compressed all-reduce (signs and one RMS scale, worker
and server error feedback; parallel/compression.py) and folded into m only.

Steps t > F (local steps): each rank folds its own gradient into its m, no communication, and
updates its params. At the steps of T_u (t a multiple of the interval, which starts at 1 and
doubles every S local steps, up to H) the params' move since the last synchronisation,
anchor - p (the anchor: the params as last synchronised, decayed as the params are), goes through
the compressed all-reduce (its errors zeroed at the freeze, as DeepSpeed's); every rank then sets
p = anchor - mean(move) (the same bits everywhere) and resets m to mean(move) x denom / (the sum
of the LRs since the last synchronisation), DeepSpeed's momentum_accumulator u / lrs. The anchor
takes the accumulator's memory and keeps the replicas equal bit for bit. Steps between
synchronisations send 0 bytes. With the defaults (S = 32678) every local step synchronises.

Where we differ from DeepSpeed, and why:
- What is compressed: the update each tensor makes, the gradient divided by denom =
  sqrt(v / bias correction) + eps (multiplied back after the average; v is the same on every
  rank) and the params' move, where DeepSpeed compresses the gradient and u x denom (momentum
  units). With one sign scale (the RMS) per bucket, elements with a small variance took the
  bucket's typical gradient, which their small denom turned into a huge step: params of 100s
  within steps, +11 % final loss in the 300-iteration study (benchmarks/RESULTS.md) against +2.3 %
  in update units, where every element's step is of the same order. The scales are now per
  tensor (within each rank's piece of the bucket, as 1-bit Adam's), as DeepSpeed's.
- Decoupled weight decay (p *= 1 - lr wd first, as our AdamW and 1-bit Adam; DeepSpeed adds wd p
  to the update, and so to the momentum it resets); bias correction m / (1 - beta1^t) and
  v / (1 - beta2^k), k the variance updates so far (DeepSpeed has none), so that steps 1..K are
  AdamW's exactly; steps counted from 1 (DeepSpeed's first step only initialises, and it freezes
  after step F + 1).
- Elements whose variance is 0 (padded vocabulary rows, rows no variance step has seen) keep
  zero momentum and move by weight decay only, as 1-bit Adam's momentum mask.
With one DP rank nothing is compressed (DeepSpeed's too), and the momentum is still reset at T_u.

Checkpoints: a save never changes the running job (bit for bit the run that does not save). Where
local updates are pending, the checkpoint's params, m (and main params) are their synchronisation
computed on copies (of the params, m, the anchor and the errors; the same on every rank), and its
`exp_avg_residual` the mean of the errors after it; each rank's own state is stored beside
(optim/feedback_state.py: its errors, and with updates pending its main params, m, anchor, LR sums
and step). A load at the same layout restores each rank's own and continues bit-exactly; loaded at
another DP size the synchronised state is what every rank starts from, each taking the residual as
its worker error; at DP1 it is added once to the next averaged tensor, as the next compressed
all-reduce would add it. The intervals are functions of
the step count, which the checkpoint holds.
"""
from __future__ import annotations

import math
from typing import Dict, Optional, Tuple

import torch

from ..parallel.comm import Communicator
from .adam import AdamW
from .distributed_optimizer import CHECKPOINT_PARAMS
from .onebit_adam import OneBitAdam, decay_and_step_


def variance_schedule(step: int, scaler: int) -> Tuple[bool, int]:
    """(whether `step` is a variance step, how many variance steps there have been up to it)."""
    interval, last, count = 1, 0, 0
    while True:
        first = (last // interval + 1) * interval  # the interval's first multiple after the last
        end = first + (scaler - 1) * interval
        if step <= end:
            taken = (step - first) // interval + 1 if step >= first else 0
            return step >= first and step % interval == 0, count + taken
        count, last, interval = count + scaler, end, interval * 2


def local_interval(step: int, var_freeze_step: int, scaler: int, clipper: int) -> int:
    """Steps between synchronisations at local step `step` (> var_freeze_step)."""
    doublings = (step - var_freeze_step - 1) // scaler
    return min(clipper, 1 << min(doublings, clipper.bit_length()))


class ZeroOneAdam(OneBitAdam):
    """An update rule over whole shards; 1-bit Adam's exchange, mask and checkpoint fold."""

    def __init__(self, adam: AdamW, var_freeze_step: int, var_update_scaler: int, local_step_scaler: int,
                 local_step_clipper: int, comm: Communicator):
        super().__init__(adam, var_freeze_step, comm)
        self.var_update_scaler, self.local_step_scaler = var_update_scaler, local_step_scaler
        self.local_step_clipper = local_step_clipper
        self.anchor: Dict[int, torch.Tensor] = {}  # per bucket: the params as last synchronised (decayed)
        self.lrs: Dict[int, Dict[str, float]] = {}  # per bucket and LR group: the LRs summed since then
        self.shards: Dict[int, object] = {}  # per bucket: its shard state (a save synchronises a copy)
        self.synced: Dict[int, Dict[str, torch.Tensor]] = {}  # per bucket, during a save: the copies synchronised
        self.step = 0

    # --- the schedule (a function of the step: the checkpoint's update count restores it) ---------
    def all_reduces_gradient(self, step: int) -> bool:
        """Whether the reducer all-reduces the gradient of `step` in fp32 (a variance step)."""
        return step <= self.freeze_step and variance_schedule(step, self.var_update_scaler)[0]

    def takes_local_gradients(self, step: int) -> bool:
        """Whether `step` folds each rank's own gradient (scaled to the whole) into its momentum:
        the optimizer then clips by the norm of that estimate, as a variance step by the global
        norm, so that m and the v of the variance steps are clipped alike."""
        return not self.all_reduces_gradient(step)

    def synchronises(self, step: int) -> bool:
        interval = local_interval(step, self.freeze_step, self.local_step_scaler, self.local_step_clipper)
        return step > self.freeze_step and step % interval == 0

    def _denominator(self, v: torch.Tensor) -> torch.Tensor:
        updates = variance_schedule(min(self.step, self.freeze_step), self.var_update_scaler)[1]
        return (v.sqrt() / math.sqrt(1.0 - self.adam.hyper[1] ** updates)).add_(self.adam.hyper[2])

    # --- the update ------------------------------------------------------------------------------
    @torch.no_grad()
    def update_shard_(self, s, grad: torch.Tensor, lr_of, weight_decay: float, step: int) -> None:
        b, t = s.bucket, s.store.tensors
        m, v, main = t["exp_avg"], t["exp_avg_sq"], t["main"]
        beta1, beta2, _ = self.adam.hyper
        self.shards[b.index], self.step = s, step
        variance_step, updates = variance_schedule(min(step, self.freeze_step), self.var_update_scaler)
        if step <= self.freeze_step and variance_step and updates == step:  # exactly AdamW so far
            s.update(self.adam, grad, lr_of, weight_decay, step)
            return
        dead = v == 0
        if step <= self.freeze_step and variance_step:
            m.lerp_(grad, 1.0 - beta1)
            v.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
        elif step <= self.freeze_step:
            denom = self._denominator(v)
            preconditioned = (grad * b.group_size).div_(denom).masked_fill_(dead, 0.0)
            m.lerp_(self._average(b, preconditioned, dead).mul_(denom), 1.0 - beta1)
        else:
            self._start_local_steps(s, step)
            m.lerp_(grad * b.group_size, 1.0 - beta1)
        if step > self.freeze_step or not variance_step:
            m.masked_fill_(dead, 0.0)
        anchor = (self.anchor[b.index],) if step > self.freeze_step else ()
        decay_and_step_(s, main, m, self._denominator(v), lr_of, weight_decay, 1.0 - beta1 ** step, anchor)
        if step > self.freeze_step:
            for group in s.groups:
                self.lrs[b.index][group] += lr_of(group)
            if self.synchronises(step):
                self._synchronise(s, step)

    def _start_local_steps(self, s, step: int) -> None:
        """The anchor from the params (the same on every rank: synchronised, or a checkpoint's), at
        the first local step or the first after a load; at the freeze the errors restart."""
        b = s.bucket
        if step == self.freeze_step + 1:
            self.loaded.pop(b.index, None)
            for store in (self.exchange.worker, self.exchange.server):
                if b.index in store:
                    store[b.index].zero_()
        if b.index not in self.anchor:
            self.anchor[b.index] = s.store.tensors["main"].clone()
            self.lrs[b.index] = {group: 0.0 for group in s.groups}

    def _average(self, b, x: torch.Tensor, dead: torch.Tensor) -> torch.Tensor:
        """x := its mean over the DP ranks through the compressed all-reduce (in place); at one rank
        exactly x, plus a loaded residual once."""
        self.apply_loaded(b)
        if b.group_size > 1:
            self.compressed_sum_(b, x)
            x.div_(b.group_size)
            self._clear_dead_errors(b, dead)
        elif b.index in self.exchange.worker:
            x.add_(self.exchange.from_rows(self.exchange.worker.pop(b.index), x.numel()))
            self.exchange.server.pop(b.index, None)
        return x

    def _live(self, s) -> Dict[str, torch.Tensor]:
        """Shard s's tensors that local steps make differ between ranks: main params, m, the anchor."""
        t = s.store.tensors
        return {"main": t["main"], "exp_avg": t["exp_avg"], "anchor": self.anchor[s.bucket.index]}

    def _synchronise(self, s, step: int, state: Optional[Dict[str, torch.Tensor]] = None,
                     lrs: Optional[Dict[str, float]] = None) -> None:
        """The params and the anchor := anchor - mean(anchor - params) on every rank; m := that mean
        x denom / (sum of the LRs), bias-corrected as m is. On `state` (as _live() names them) and
        `lrs` when given (a save's copies), else on the live ones."""
        b = s.bucket
        state, lrs = state or self._live(s), self.lrs[b.index] if lrs is None else lrs
        m, main, anchor, v = state["exp_avg"], state["main"], state["anchor"], s.store.tensors["exp_avg_sq"]
        denom, dead = self._denominator(v), v == 0
        moved = self._average(b, anchor - main, dead).masked_fill_(dead, 0.0)
        anchor.sub_(moved)
        main.copy_(anchor)
        u = moved.mul_(denom)
        for group, lo, hi in s.lr_runs:
            if lrs[group] > 0:  # (else nothing moved: m stays)
                m[lo:hi] = u[lo:hi] * ((1.0 - self.adam.hyper[0] ** step) / lrs[group])
        for group in lrs:
            lrs[group] = 0.0

    def _pending(self, b) -> bool:
        """Whether bucket b has local updates not yet synchronised (the same answer on every rank)."""
        return any(self.lrs.get(b.index, {}).values())

    # --- checkpoints -----------------------------------------------------------------------------
    def fold_for_checkpoint(self, b) -> torch.Tensor:
        """Collective: 1-bit Adam's fold of the errors. With local updates pending, first their
        synchronisation on copies of the main params, m, the anchor and the errors: the checkpoint
        holds that state (checkpointed_instead(); what a load at any layout starts from) and the
        errors' mean after it, while the running job keeps its own, unchanged."""
        if not self._pending(b):
            return super().fold_for_checkpoint(b)
        s = self.shards[b.index]
        self.apply_loaded(b)
        kept = self.exchange.own_errors(b.index)  # (copies: the synchronisation changes the live errors)
        copies = {name: t.clone() for name, t in self._live(s).items()}
        self._synchronise(s, self.step, copies, dict(self.lrs[b.index]))
        residual = super().fold_for_checkpoint(b)
        self.exchange.restore_errors(b.index, kept)
        self.synced[b.index] = copies
        return residual

    def checkpointed_instead(self, s) -> Dict[str, torch.Tensor]:
        """After fold_for_checkpoint(): what the checkpoint holds instead of shard s's live params
        (CHECKPOINT_PARAMS), main params and m: their synchronised copies (none when nothing was pending)."""
        copies = self.synced.pop(s.bucket.index, None)
        if copies is None:
            return {}
        out = {"exp_avg": copies["exp_avg"], CHECKPOINT_PARAMS: copies["main"].to(s.bucket.param_shard_view().dtype)}
        if s.owns_main:
            out["main"] = copies["main"]
        return out

    def own_local_state(self, s) -> Dict[str, torch.Tensor]:
        """Copies of shard s's state of local updates pending, this rank's own (none pending:
        nothing): main params, m, the anchor, the LR sums (by sorted group) and the step."""
        b = s.bucket
        if not self._pending(b):
            return {}
        out = {name: t.clone() for name, t in self._live(s).items()}
        out["lrs"] = torch.tensor([self.lrs[b.index][g] for g in sorted(s.groups)], dtype=torch.float64)
        out["step"] = torch.tensor([self.step], dtype=torch.int64)
        return out

    def restore_local_state(self, s, saved: Dict[str, torch.Tensor]) -> None:
        """At the writing layout, after a load filled the synchronised state: this rank's own, as
        own_local_state() gave it; the params follow the main params."""
        b, t = s.bucket, s.store.tensors
        t["main"].copy_(saved["main"])
        t["exp_avg"].copy_(saved["exp_avg"])
        if s.owns_main:
            s.store.publish(b.param_shard_view(), t["main"])
        self.anchor[b.index] = saved["anchor"].clone()
        self.lrs[b.index] = dict(zip(sorted(s.groups), saved["lrs"].tolist()))
        self.shards[b.index], self.step = s, int(saved["step"][0])

    def residual_for_loading(self, b) -> torch.Tensor:
        """As 1-bit Adam's; the anchor is taken again from the loaded params at the next local step."""
        self.anchor.pop(b.index, None)
        self.lrs.pop(b.index, None)
        return super().residual_for_loading(b)
