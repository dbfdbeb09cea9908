"""LossNormalization: the weights of one training step's losses, built once per step.

A step's loss is one of Megatron-LM's two, exact whatever the layout (M micro-batches on each of D
data-parallel replicas, N loss-bearing tokens in the global batch, `loss_scale` fp16's or 1.0):
- per token (--calculate-per-token-loss): the mean over the global batch's loss-bearing tokens.
  Backward runs on loss_sum x loss_scale / normalizer (a constant about N: a mean's magnitude, in
  fp16's range); the reduced gradients are multiplied by normalizer / N.
- per micro-batch (Megatron's default): the mean over micro-batches of each one's token mean.
  Backward runs on loss_sum x loss_scale / (M x the micro-batch's tokens, counted over its CP
  ranks, so CP does not change the mean, unlike Megatron-LM); the gradients summed over DP are
  divided by D.
Multi-token prediction's losses are token losses like the main one: each depth's masked sum goes
through `__call__` with its own token count (its labels are shifted, so it has fewer) and its factor,
and `attach_loss` adds that weighted loss's gradient where it is computed.
An auxiliary loss computed once per micro-batch (MoE's) adds its gradient where it is computed,
weighted like its micro-batch in the main loss: 1 / M, or per token by its nominal tokens,
normalizer / (M x D) (the trainer's normalizer is global batch x sequence length); that gradient
then passes through the main loss's reductions and final factor.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..parallel.state import ParallelDims


@dataclass(frozen=True)
class LossNormalization:
    """One step's loss weights. Called as `norm(loss_sum, tokens)`: the micro-batch's main loss as
    backward runs it, which is what every schedule backpropagates (on the last pipeline stage)."""
    per_token: bool = False
    num_microbatches: int = 1
    loss_scale: float = 1.0
    normalizer: float = 1.0  # per token: the constant backward divides by (about the global token count)
    dims: ParallelDims = field(default_factory=ParallelDims, compare=False, repr=False)
    main_weight: float = 1.0  # 0: the model's own losses give no gradient (DSA's dense warm-up trains the indexer only)

    def __call__(self, loss_sum: torch.Tensor, tokens) -> torch.Tensor:
        if self.per_token:
            return loss_sum * (self.loss_scale * self.main_weight / self.normalizer)
        n = torch.as_tensor(tokens, dtype=torch.float32, device=loss_sum.device).detach().clone()
        self.dims.comm.all_reduce(n, self.dims.cp_group)  # over the micro-batch's CP ranks
        return loss_sum * ((self.loss_scale * self.main_weight / self.num_microbatches) / n.clamp_min(1.0))

    @property
    def aux_weight(self) -> float:
        """The gradient of an auxiliary loss computed once per micro-batch (module docstring)."""
        return self.indexer_weight * self.main_weight

    @property
    def indexer_weight(self) -> float:
        """The aux weight of DSA's indexer loss, which trains the indexer in every stage."""
        share = 1.0 / (self.num_microbatches * self.dims.dp) if self.per_token else 1.0 / self.num_microbatches
        return self.loss_scale * share

    def grad_factor(self, global_tokens: float) -> float:
        """The factor of the gradients after the data-parallel reduction, given N."""
        return self.normalizer / global_tokens if self.per_token else 1.0 / self.dims.dp


class _AttachLoss(torch.autograd.Function):
    """Identity on `activation`; in backward also gives `loss` the gradient `scale`."""

    @staticmethod
    def forward(ctx, activation, loss, scale: float):
        ctx.scale = scale  # a plain float on ctx: recomputation does not replace it
        ctx.loss_meta = (loss.shape, loss.dtype, loss.device)
        return activation

    @staticmethod
    def backward(ctx, grad):
        shape, dtype, device = ctx.loss_meta
        return grad, torch.full(shape, ctx.scale, dtype=dtype, device=device), None


def attach_loss(activation: torch.Tensor, loss: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """`activation`, unchanged, carrying `loss` into backward: when backward reaches `activation`,
    `loss` gets the gradient `scale` (no schedule needs to know about that loss)."""
    return _AttachLoss.apply(activation, loss, scale)


@dataclass
class LossNormalizationSlot:
    """The current step's LossNormalization (put in by the trainer before each step), for modules
    with losses of their own (MoE's auxiliary losses, multi-token prediction)."""
    current: LossNormalization = field(default_factory=LossNormalization)
