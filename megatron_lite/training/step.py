"""One training step: forward/backward over this rank's micro-batches, gradient sync, update.

The forward-step protocol (Megatron-Core's), which every schedule uses (the loop below when there
is no pipeline, the executor of parallel/pipeline otherwise):

    forward_step(batch, model_chunk) -> (output, loss_func)
    loss_func(output) -> (loss_sum, token_count, logs)        # on the last pipeline stage only

Schedules backpropagate `loss_normalization(loss_sum, tokens)` and know no batch keys and no loss
formula: the step's LossNormalization (Megatron-LM's per-token or per-micro-batch loss, exact
whatever the layout) weighs the main loss, and its factor the reduced gradients. Extra losses (MoE
auxiliary losses) add their gradient where they are computed, weighted by the same object. `logs`
(name -> (sum, count)) are summed like the loss over micro-batches and data-parallel ranks and
reported as sum / count; so is the logged loss, in both modes (as Megatron).
"""
from __future__ import annotations

import math
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.nn as nn

from ..parallel.state import ParallelDims
from ..transformer.loss_normalization import LossNormalization

Batch = Dict[str, torch.Tensor]
ForwardStep = Callable[[Batch, nn.Module], Tuple[torch.Tensor, Callable]]


class LossTotals:
    """Sums over micro-batches of what loss functions return (the last stage's)."""

    def __init__(self, device):
        self.loss_sum = torch.zeros((), dtype=torch.float32, device=device)
        self.tokens = torch.zeros((), dtype=torch.float32, device=device)
        self.logs: Dict[str, torch.Tensor] = {}

    def add(self, loss_sum: torch.Tensor, tokens, logs: Dict[str, Tuple]) -> None:
        self.loss_sum += loss_sum.detach().float()
        self.tokens += torch.as_tensor(tokens, dtype=torch.float32, device=self.tokens.device)
        for name, (s, n) in logs.items():
            pair = torch.stack([torch.as_tensor(s, dtype=torch.float32), torch.as_tensor(n, dtype=torch.float32)])
            self.logs[name] = self.logs.get(name, 0) + pair.to(self.tokens.device)


def forward_backward_no_pipelining(chunks: List[nn.Module], batches: List[Batch], forward_step: ForwardStep,
                                   loss_normalization: Optional[LossNormalization], forward_only=False) -> LossTotals:
    """All micro-batches through the one model chunk (no loss_normalization when forward_only)."""
    model = chunks[0]
    totals = LossTotals(next(model.parameters()).device)
    for batch in batches:
        with torch.set_grad_enabled(not forward_only):
            output, loss_func = forward_step(batch, model)
            loss_sum, tokens, logs = loss_func(output)
        if not forward_only:
            loss_normalization(loss_sum, tokens).backward()
        totals.add(loss_sum, tokens, logs)
    return totals


def pipelined_forward_backward(executor) -> Callable:
    """A forward_backward for train_step / eval_step that runs a PipelineExecutor's schedule."""

    def forward_backward(chunks, batches, forward_step, loss_normalization, forward_only=False):
        totals = LossTotals(executor.device)
        return executor.run(batches, forward_step, loss_normalization, totals, forward_only)

    forward_backward.executor = executor
    return forward_backward


def finalize_losses(totals: Optional[LossTotals], dims: ParallelDims) -> Tuple[float, float, Dict[str, float]]:
    """(loss sum, loss-bearing tokens, logs) of the global batch. Collective: the last stage sums
    over data-parallel (and context-parallel) ranks; with a pipeline the token count, which every
    stage's gradients are divided by, then reaches the other stages too. The loss and logs are
    meaningful on the last stage only."""
    device = totals.tokens.device
    names = sorted(totals.logs) if dims.is_last_stage else []
    if dims.is_last_stage:
        vec = torch.cat([totals.loss_sum.view(1), totals.tokens.view(1)] + [totals.logs[n] for n in names])
        dims.comm.all_reduce(vec, dims.dp_cp_group)
    else:
        vec = torch.zeros(2, device=device)
    if dims.pp > 1:
        tokens = vec[1:2].clone() if dims.is_last_stage else torch.zeros(1, device=device)
        dims.comm.all_reduce(tokens, dims.pp_group)
        vec[1] = tokens[0]
    tokens = max(vec[1].item(), 1.0)
    logs = {n: (vec[2 + 2 * i] / vec[3 + 2 * i].clamp_min(1)).item() for i, n in enumerate(names)}
    return vec[0].item(), tokens, logs


def move_batch(batch: Batch, device) -> Batch:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


def train_step(chunks: List[nn.Module], batches: List[Batch], dims: ParallelDims, optimizer, grad_sync,
               lr, forward_step: ForwardStep, forward_backward: Callable = forward_backward_no_pipelining,
               loss_normalizer: float = 1.0, per_token_loss: bool = True, weight_decay: Optional[float] = None,
               after_backward: Optional[Callable[[], None]] = None,
               loss_normalization: Optional[LossNormalization] = None) -> Dict[str, Optional[float]]:
    """`lr`: one LR or a mapping LR group -> LR; `weight_decay`: this step's (None: the config's).
    `loss_normalization`: the step's loss weights; None: from `per_token_loss` (which loss),
    `loss_normalizer` (per-token mode's constant, about the global token count) and the optimizer's
    loss scale. `after_backward`: called between the gradient reduction and the optimizer."""
    for c in chunks:
        c.train()
    grad_sync.start_step(len(batches))  # DP reductions start once every micro-batch's grads are in
    norm = loss_normalization or LossNormalization(per_token_loss, len(batches), optimizer.loss_scale,
                                                   loss_normalizer, dims)
    totals = forward_backward(chunks, batches, forward_step, norm)
    grad_sync.finish()
    if after_backward is not None:
        after_backward()
    loss_sum, tokens, logs = finalize_losses(totals, dims)
    lm_loss = loss_sum / tokens if dims.is_last_stage else None
    out = optimizer.step(lr, loss_is_finite=lm_loss is None or math.isfinite(lm_loss),
                         grad_scale=norm.grad_factor(tokens), weight_decay=weight_decay)
    out["lm_loss"] = lm_loss
    out["logs"] = logs
    return out


@torch.no_grad()
def eval_step(chunks: List[nn.Module], batches: List[Batch], dims: ParallelDims, forward_step: ForwardStep,
              forward_backward: Callable = forward_backward_no_pipelining) -> Optional[float]:
    for c in chunks:
        c.eval()
    totals = forward_backward(chunks, batches, forward_step, None, forward_only=True)
    loss_sum, tokens, _ = finalize_losses(totals, dims)
    return loss_sum / tokens if dims.is_last_stage else None
