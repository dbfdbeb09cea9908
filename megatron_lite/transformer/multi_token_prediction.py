"""Multi-token prediction (DeepSeek-V3; Megatron-Core's --mtp-num-layers / --mtp-loss-scaling-factor).

D sequential modules follow the decoder on the last pipeline stage. Module k (1-based) takes the
previous depth's hidden states h (depth 0: the decoder's output after its final norm) and the
embedding of the tokens k positions ahead (the model's own embedding, with its dropout):

    h_k = final_layernorm_k(layer_k(eh_proj_k([enorm_k(embed(tokens[t + k])); hnorm_k(h_{k-1})])))

`eh_proj` is column-parallel (2h -> h, gathered over TP, split along the sequence again under SP),
`layer_k` a transformer layer of the last decoder layer's spec (dense or MoE), numbered after the
decoder's layers; the model's shared output layer turns h_k into logits for labels[t + k] (token
t + k + 1), where loss_mask[t + k] counts, and with packed documents only inside one document.
Each depth's loss is weighed like the main loss by the step's LossNormalization with its own token
count and the factor mtp_loss_scaling_factor / D, and reaches backward attached to the main token
losses (loss_normalization.attach_loss). Evaluation and generation skip the modules.

Shifting the labels across context-parallel chunks needs the neighbouring chunks' tokens: the [b, s]
inputs are all-gathered over CP (token ids and masks, a few bytes per token), shifted over the whole
sequence and split again, which is exact for any zigzag layout.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.nn as nn

from ..parallel.context_parallel import zigzag_split, zigzag_unsplit
from ..parallel.random import recompute
from ..parallel.state import ParallelDims
from ..parallel.tensor_parallel import ColumnParallelLinear
from .block import TransformerLayer
from .norm import build_norm


class MTPLayer(nn.Module):
    """One prediction depth: the norms, the 2h -> h projection, a transformer layer, its final norm."""

    def __init__(self, cfg, ctx, layer_number: int, spec):
        super().__init__()
        self.dims, self.sequence_parallel = ctx.dims, ctx.sequence_parallel
        self.enorm = build_norm(cfg, ctx)
        self.hnorm = build_norm(cfg, ctx)
        # [embedding; hidden] as Megatron-Core and DeepSeek-V3 concatenate them
        self.eh_proj = ColumnParallelLinear(2 * cfg.hidden_size, cfg.hidden_size, ctx.dims, bias=False,
                                            gather_output=True, sequence_parallel=ctx.sequence_parallel,
                                            dtype=ctx.params_dtype, gemm=ctx.gemm)
        self.transformer_layer = TransformerLayer(cfg, ctx, layer_number, spec)
        self.final_layernorm = build_norm(cfg, ctx)

    def forward(self, h: torch.Tensor, emb: torch.Tensor, rope=None, packed=None) -> torch.Tensor:
        """h, emb [s, b, h] ([s/tp, b, h] under SP) -> this depth's hidden states, same shape."""
        x = self.eh_proj(torch.cat([self.enorm(emb), self.hnorm(h)], dim=-1))  # [s, b, h] on every TP rank
        if self.sequence_parallel:
            x = self.dims.comm.scatter_to_sp(x, self.dims.tp_group)
        return self.final_layernorm(self.transformer_layer(x, rope, packed))


class MultiTokenPrediction(nn.Module):
    """The D modules (`layers`), numbered num_layers .. num_layers + D - 1 after the decoder's."""

    def __init__(self, cfg, ctx, spec):
        super().__init__()
        self.ctx, self.factor = ctx, cfg.mtp_loss_scaling_factor
        self.layers = nn.ModuleList([MTPLayer(cfg, ctx, cfg.num_layers + k, spec) for k in range(cfg.mtp_depth)])

    def forward(self, h: torch.Tensor, embed: Callable, inputs: List[Dict[str, torch.Tensor]], rope, packed,
                token_loss: Callable) -> Tuple[torch.Tensor, Dict[str, Tuple[torch.Tensor, torch.Tensor]]]:
        """h: the decoder's normed output; embed(tokens, position_ids) the model's embedding;
        inputs: per depth the shifted tokens / position_ids / labels / loss_mask (`shifted_inputs`);
        token_loss(h, labels) the per-token loss [b, s] through the shared output layer.

        Returns (the depths' losses as backward runs them, weighted by the step's LossNormalization,
        a 0-d tensor; logs name -> (masked loss sum, tokens), detached)."""
        ctx = self.ctx
        norm = ctx.loss_normalization.current
        total, logs = None, {}
        sums, counts = [], []
        for k, (layer, inp) in enumerate(zip(self.layers, inputs), start=1):
            emb = embed(inp["tokens"], inp["position_ids"])
            if ctx.recompute_granularity == "full":  # each module on its own, as Megatron-Core
                h = recompute(lambda a, b, layer=layer: layer(a, b, rope, packed), ctx.tracker, h, emb)
            else:
                h = layer(h, emb, rope, packed)
            mask = inp["loss_mask"].float()
            loss_sum = (token_loss(h, inp["labels"]) * mask).sum()
            weighted = norm(loss_sum * (self.factor / len(self.layers)), mask.sum())
            total = weighted if total is None else total + weighted
            sums.append(loss_sum.detach())
            counts.append(mask.sum())
            if len(self.layers) > 1:
                logs[f"mtp_{k}_loss"] = (sums[-1], counts[-1])
        logs["mtp_loss"] = (torch.stack(sums).sum(), torch.stack(counts).sum())
        return total, logs


def _shift(t: torch.Tensor, k: int) -> torch.Tensor:
    """t[:, i + k] at position i, zero past the end ([b, s])."""
    out = torch.zeros_like(t)
    out[:, :-k] = t[:, k:]
    return out


def shifted_inputs(depth: int, tokens: torch.Tensor, labels: torch.Tensor, loss_mask: torch.Tensor,
                   position_ids: torch.Tensor, document_ids: Optional[torch.Tensor],
                   dims: ParallelDims) -> List[Dict[str, torch.Tensor]]:
    """Per depth k = 1..depth, this rank's part of the [b, s] inputs shifted k positions to the left
    over the whole sequence: tokens, position_ids, labels and loss_mask (zero where t + k runs past the
    sequence or, with document ids, into another document). Under CP the inputs are this rank's
    zigzag chunks: they are all-gathered over CP (collective) and the results split again."""
    named = {"tokens": tokens, "position_ids": position_ids, "labels": labels, "loss_mask": loss_mask}
    if document_ids is not None:
        named["document_ids"] = document_ids
    cp = dims.cp
    if cp > 1:
        named = {n: _gather_cp(t, dims) for n, t in named.items()}
    out = []
    for k in range(1, depth + 1):
        d = {n: _shift(t, k) for n, t in named.items()}
        if document_ids is not None:  # the prediction stays inside its document
            d["loss_mask"] = d["loss_mask"] * (d.pop("document_ids") == named["document_ids"])
        if cp > 1:
            d = {n: zigzag_split(t, cp, dims.cp_rank, dim=1) for n, t in d.items()}
        out.append(d)
    return out


def _gather_cp(t: torch.Tensor, dims: ParallelDims) -> torch.Tensor:
    """The whole sequence [b, s] of a [b, s/cp] zigzag part (no gradient: ids and masks)."""
    return zigzag_unsplit(dims.comm.gather_along(t, 1, dims.cp_group).chunk(dims.cp, dim=1), dim=1)
