"""One training step: forward/backward over this rank's micro-batches, gradient sync, update.

The loss of a step is the mean over every loss-bearing token of the global batch. Each
micro-batch contributes sum(token_loss * mask) / (global token count), so gradients summed over
micro-batches and data-parallel ranks are exactly those of the global-batch mean, whatever the
layout.
"""
from __future__ import annotations

import math
from typing import Callable, Dict, List, Optional

import torch
import torch.nn as nn

from ..parallel import comm
from ..parallel.state import ParallelDims

Batch = Dict[str, torch.Tensor]


def micro_batch_loss_sum(model: nn.Module, batch: Batch) -> torch.Tensor:
    """Forward one micro-batch through a whole (single-chunk) model: sum of masked token losses."""
    token_loss = model(batch["tokens"], batch.get("position_ids"), batch["labels"], batch.get("attention_mask"))
    return (token_loss * batch["loss_mask"]).sum()


def forward_backward_no_pipelining(chunks: List[nn.Module], batches: List[Batch], loss_denominator: torch.Tensor,
                                   loss_scale: float, forward_only: bool = False) -> torch.Tensor:
    """All micro-batches through the one model chunk; returns the local sum of token losses."""
    model = chunks[0]
    total = torch.zeros((), dtype=torch.float32, device=loss_denominator.device)
    for batch in batches:
        with torch.set_grad_enabled(not forward_only):
            loss_sum = micro_batch_loss_sum(model, batch)
        if not forward_only:
            (loss_sum * (loss_scale / loss_denominator)).backward()
        total += loss_sum.detach().float()
    return total


def global_token_count(batches: List[Batch], dims: ParallelDims, device) -> torch.Tensor:
    """Loss-bearing tokens in the whole global batch (sum over micro-batches and DP ranks)."""
    n = torch.zeros((), dtype=torch.float32, device=device)
    for b in batches:
        n += b["loss_mask"].sum().float()
    comm.all_reduce(n, dims.dp_cp_group, counter=dims.comm_counter)
    return n.clamp_min(1.0)


def reduce_loss(local_sum: torch.Tensor, denominator: torch.Tensor, dims: ParallelDims) -> float:
    """Global mean loss from each DP rank's local loss sum (meaningful on the last stage)."""
    total = local_sum.clone()
    comm.all_reduce(total, dims.dp_cp_group, counter=dims.comm_counter)
    return (total / denominator).item()


def move_batch(batch: Batch, device) -> Batch:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


def train_step(chunks: List[nn.Module], batches: List[Batch], dims: ParallelDims, optimizer, grad_sync,
               lr: float, forward_backward: Callable = forward_backward_no_pipelining) -> Dict[str, Optional[float]]:
    for c in chunks:
        c.train()
    denominator = global_token_count(batches, dims, batches[0]["tokens"].device)
    grad_sync.start_step(len(batches))  # DP reductions start once every micro-batch's grads are in
    local = forward_backward(chunks, batches, denominator, optimizer.loss_scale)
    grad_sync.finish()
    lm_loss = reduce_loss(local, denominator, dims) if dims.is_last_stage else None
    out = optimizer.step(lr, loss_is_finite=lm_loss is None or math.isfinite(lm_loss))
    out["lm_loss"] = lm_loss
    return out


@torch.no_grad()
def eval_step(chunks: List[nn.Module], batches: List[Batch], dims: ParallelDims,
              forward_backward: Callable = forward_backward_no_pipelining) -> Optional[float]:
    for c in chunks:
        c.eval()
    denominator = global_token_count(batches, dims, batches[0]["tokens"].device)
    local = forward_backward(chunks, batches, denominator, 1.0, forward_only=True)
    return reduce_loss(local, denominator, dims) if dims.is_last_stage else None
