"""DSA's indexer loss and its two training stages (DeepSeek-V3.2 report, section 2.1; Megatron-Core's
compute_dsa_indexer_loss).

The loss: for each query, the KL divergence from the main attention's distribution (softmax of the
logits per head, summed over all heads, L1-normalised) to the softmax of the indexer's scores,
averaged over the micro-batch's queries, times --dsa-indexer-loss-coeff. Over every key a query sees,
or with --dsa-indexer-use-sparse-loss over its selected keys only (both distributions restricted).
The target is detached: it trains the indexer only. Under tensor parallelism each rank holds some
heads: their summed probabilities are all-reduced before normalising, so every rank has the whole
loss (and the replicated indexer the same gradient).

The stages (`--dsa-dense-warmup-iters N`): for iterations 1..N DeepSeek's dense warm-up, in which
attention stays dense and the main model is frozen: its losses' gradients are weighted 0 (the
LossNormalization's main_weight) and its parameters' learning rate is 0 (so weight decay leaves them
alone too), while the indexer learns from its loss at the normal rate (its parameters form the LR
group `dsa_indexer`). Then the sparse stage: each query attends to its top-k keys, the main model
learns from the LM loss and the indexer from its own (its inputs are detached, so neither reaches
the other). Adam's step count runs through both stages; the frozen parameters' moments stay zero.

`DSAStepHooks` is the model's step-hooks part (transformer/step_hooks.py): the stage of the step,
the learning rates and loss weights the stage calls for, and the indexer loss per layer for the
log (`dsa_indexer_loss`, the mean over layers, coefficient applied as Megatron-Core logs it).
"""
from __future__ import annotations

from dataclasses import replace
from typing import Dict, Tuple

import torch

INDEXER_LR_GROUP = "dsa_indexer"


def indexer_kl_loss(scores: torch.Tensor, q: torch.Tensor, k: torch.Tensor, keys: torch.Tensor, dims) -> torch.Tensor:
    """KL(attention || indexer) averaged over queries. scores [b, sq, sk] (the indexer's, with its
    graph); q [b, sq, heads, d], k [b, sk, heads, d] (this rank's heads; softmax scale 1/sqrt(d));
    keys [1 or b, sq, sk] bool: the keys each distribution covers (every query has one)."""
    with torch.no_grad():
        logits = torch.einsum("bshd,bthd->bhst", q.float(), k.float()) / q.shape[-1] ** 0.5
        probs = torch.softmax(logits.masked_fill(~keys.unsqueeze(1), float("-inf")), dim=-1).sum(1)
        if dims.tp > 1:
            dims.comm.all_reduce(probs, dims.tp_group)
        target = probs / probs.sum(-1, keepdim=True)
    index = torch.softmax(scores.masked_fill(~keys, float("-inf")), dim=-1)
    # Megatron-Core's guard: an unseen key (target 0, index 0) adds 0, not 0 * -inf.
    kl = target * (torch.log(target + 1e-10) - torch.log(index + 1e-10))
    return kl.sum(-1).mean()


class DSAStepHooks:
    """The stage of each step, and the indexer losses of one step reduced for the log (one part
    per model, shared by its DSA layers; every rank of the world has one)."""

    def __init__(self, num_layers: int, dense_warmup_iters: int, dims, device=None):
        self.num_layers, self.dense_warmup_iters, self.dims = num_layers, dense_warmup_iters, dims
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.dense = dense_warmup_iters > 0  # before the first step (a model used outside the trainer)
        self.clear()

    def clear(self) -> None:
        self.losses = torch.zeros(self.num_layers, dtype=torch.float64, device=self.device)
        self.micro_batches = torch.zeros(self.num_layers, dtype=torch.float64, device=self.device)

    def record(self, layer_number: int, loss: torch.Tensor) -> None:
        """One micro-batch's loss partial of a layer on this rank: each TP rank holds its CP rank's
        whole partial, so each records a 1/tp share, and 1/(tp cp) of the micro-batch (the sums over
        the stage's ranks then count each once)."""
        self.losses[layer_number] += loss.detach().to(self.device, torch.float64) / self.dims.tp
        self.micro_batches[layer_number] += 1.0 / (self.dims.tp * self.dims.cp)

    # --- the step-hooks protocol ----------------------------------------------------------------
    def before_step(self, iteration: int) -> None:
        self.dense = iteration <= self.dense_warmup_iters
        self.clear()

    def after_update(self) -> None:
        pass

    def step_settings(self, lrs: Dict[str, float], norm, default_group: str) -> Tuple[Dict[str, float], object]:
        """The step's learning rates and loss weights: in the dense warm-up only the indexer learns."""
        if not self.dense:
            return lrs, norm
        frozen = {group: 0.0 for group in lrs}
        frozen[INDEXER_LR_GROUP] = lrs[default_group]
        return frozen, replace(norm, main_weight=0.0)

    def metrics(self) -> dict:
        """Collective over the world: the step's indexer loss, the mean over layers of each layer's
        mean over (data-parallel replica, micro-batch) pairs."""
        buf = torch.cat([self.losses, self.micro_batches])
        self.dims.comm.all_reduce(buf, self.dims.tp_dp_cp_group)
        self.dims.comm.all_reduce(buf, self.dims.pp_group)
        buf = buf.cpu()
        losses, pairs = buf[:self.num_layers], buf[self.num_layers:]
        seen = pairs > 0
        out = {"dsa_stage": "dense" if self.dense else "sparse"}
        if seen.any():
            out["dsa_indexer_loss"] = (losses[seen] / pairs[seen]).mean().item()
        return out
