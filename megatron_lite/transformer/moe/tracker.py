"""MoEMetricsTracker: per-layer MoE statistics of one optimizer step, reduced for logging.

One tracker is built per model replica and passed to every MoE layer at construction (no module
state). During the step each layer records, per micro-batch on this rank:
  - its loss partials (`load_balancing_loss`, `z_loss`: coefficient not applied, as Megatron logs
    them; the partials of one micro-batch sum over its TP x CP ranks to the micro-batch's value),
  - the tokens it routed to each expert (after capacity), and that one more micro-batch went by.
Nothing is recorded without gradients or during recomputation (`losses.recording`).

`reduce(dims)` (collective over the whole world: call it on every rank, once per logged step)
sums every entry over all ranks of a pipeline stage (tp_dp_cp) and then over the pipeline
(pp). Each layer lives on one stage, each routed token on one rank and each loss partial on one
TP x CP rank of its replica, so after the sum
  loss of layer l      = (sum of per-micro-batch losses) / (number of (DP replica, micro-batch) pairs)
  tokens_per_expert    = every token of the global batch the layer routed
which do not depend on PP, on how the micro-batches are spread over DP ranks (DP 4 x 1
micro-batch logs what DP 1 x 4 micro-batches does) or on TP/CP/EP. (Changing the micro-batch
*size* changes the losses themselves: they are per-micro-batch quantities, as in Megatron.)
Every rank gets the same numbers. `clear()` starts the next step.
"""
from __future__ import annotations

from typing import Dict, List

import torch


LOSS_NAMES = ("load_balancing_loss", "z_loss")


class MoEMetricsTracker:
    """num_layers: layers of the whole model (the key is the global layer index); device: where
    the sums live and are reduced (the model's device, so recording never synchronizes)."""

    def __init__(self, num_layers: int, num_experts: int, device=None):
        self.num_layers, self.num_experts = num_layers, num_experts
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.clear()

    def clear(self) -> None:
        n, kw = self.num_layers, dict(dtype=torch.float64, device=self.device)
        self.losses = torch.zeros(len(LOSS_NAMES), n, **kw)
        self.has_loss = torch.zeros(len(LOSS_NAMES), n, **kw)
        self.tokens = torch.zeros(n, self.num_experts, **kw)
        self.micro_batches = torch.zeros(n, **kw)

    # --- recording (by the layers) ------------------------------------------------------------
    def record_loss(self, layer_number: int, name: str, partial: torch.Tensor) -> None:
        i = LOSS_NAMES.index(name)
        self.losses[i, layer_number] += partial.detach().to(self.device, torch.float64)
        self.has_loss[i, layer_number] = 1.0

    def record_tokens(self, layer_number: int, tokens_per_expert: torch.Tensor) -> None:
        self.tokens[layer_number] += tokens_per_expert.detach().to(self.device, torch.float64)
        self.micro_batches[layer_number] += 1.0

    # --- reduction (by the training step) -----------------------------------------------------
    def reduce(self, dims) -> Dict[str, object]:
        """Collective: the step's statistics, the same on every rank (see the module docstring).
        Returns {"layers": {layer: {load_balancing_loss, z_loss (those computed), tokens_per_expert,
        min_load, max_load (min / max over experts of tokens / mean tokens)}}, "moe_aux_loss",
        "moe_z_loss" (means over MoE layers), "moe_load_imbalance" (the largest max_load)}."""
        buf = torch.cat([self.losses.flatten(), self.has_loss.flatten(), self.tokens.flatten(), self.micro_batches])
        dims.comm.all_reduce(buf, dims.tp_dp_cp_group)
        dims.comm.all_reduce(buf, dims.pp_group)
        buf = buf.cpu()
        n, e, k = self.num_layers, self.num_experts, len(LOSS_NAMES)
        losses, has_loss = buf[:k * n].view(k, n), buf[k * n:2 * k * n].view(k, n)
        tokens, micro = buf[2 * k * n:2 * k * n + n * e].view(n, e), buf[2 * k * n + n * e:]
        # Every rank of a replica counted the same micro-batches: divide by the ranks per replica.
        pairs = micro / (dims.tp * dims.cp)
        return self._summarize(losses, has_loss, tokens, pairs)

    def _summarize(self, losses, has_loss, tokens, pairs) -> Dict[str, object]:
        layers: List[int] = [l for l in range(self.num_layers) if pairs[l] > 0]
        out: Dict[str, object] = {"layers": {}}
        for l in layers:
            mean = tokens[l].mean().item()
            entry = {"tokens_per_expert": tokens[l].clone(),
                     "min_load": tokens[l].min().item() / mean if mean > 0 else 0.0,
                     "max_load": tokens[l].max().item() / mean if mean > 0 else 0.0}
            for i, name in enumerate(LOSS_NAMES):
                if has_loss[i, l] > 0:
                    entry[name] = (losses[i, l] / pairs[l]).item()
            out["layers"][l] = entry
        out.update(self._headline(out["layers"]))
        return out

    @staticmethod
    def _headline(per_layer: Dict[int, dict]) -> Dict[str, float]:
        """The metrics-file scalars: losses averaged over MoE layers, the worst layer's max load."""
        heads = {}
        for name, key in (("load_balancing_loss", "moe_aux_loss"), ("z_loss", "moe_z_loss")):
            vals = [v[name] for v in per_layer.values() if name in v]
            if vals:
                heads[key] = sum(vals) / len(vals)
        if per_layer:
            heads["moe_load_imbalance"] = max(v["max_load"] for v in per_layer.values())
        return heads
