"""MoELayer: the mixture-of-experts block for the MLP slot of a transformer layer.

forward(x [s, b, h]) -> [s, b, h], in the layer's sequence layout (sequence-sharded [s/tp, b, h]
under SP), like the dense MLP it replaces.

Which tokens each rank routes. Under TP the experts' tokens must be split among the TP ranks,
not replicated: the expert grid (ETP x EP x EDP, folded over TP x CP x DP, parallel/state.py)
puts the TP ranks of a replica in the EP, ETP or EDP group, and in each of them replicated
tokens would be computed (and their expert gradients summed) several times. So, as in
Megatron-Core (which requires SP for MoE under TP), every TP rank routes its own sequence shard:
  - with SP the input already is that shard;
  - without SP (input whole on every TP rank) the layer keeps its shard of the sequence on the
    way in (s must be divisible by tp) and all-gathers the output on the way out.
Under CP each CP rank routes its own part of the sequence, so every rank of a pipeline stage
routes distinct tokens and any expert grid sees each token once. The router
weight's gradient is therefore partial on each TP rank (summed over TP by grad finalization, its
ShardSpec says sequence_parallel) and summed over DP x CP with the dense gradients.

What the caller passes (the GPT layer spec / the training step):
  cfg               a validated MoEConfig (`cfg.with_defaults(ffn_hidden_size).validate(...)`)
  dims              ParallelDims with the expert groups (ep, etp, edp, etp_ep, tp_cp, tp_dp_cp)
  layer_number      the global layer index (0-based), the tracker's key
  loss_normalization  the step's loss weights, one LossNormalizationSlot for all layers (None: unit)
  tracker           one MoEMetricsTracker shared by all layers (or None)
  sequence_parallel, swiglu, activation, dtype as for the dense MLP.
Around each training step, a model's `MoEStepHooks` clears the tracker, moves the expert biases
after the update (moe_router_enable_expert_bias) and reduces the statistics for the record.
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch
import torch.nn as nn

from ...errors import ConfigError
from ...parallel.context_parallel import zigzag_indices
from ...parallel.gemm import GemmPath
from ...parallel.random import RNGStatesTracker, recompute
from ...parallel.state import ParallelDims
from ..counts import Counts, MicroBatch, weights
from ..loss_normalization import LossNormalizationSlot
from ..mlp import ffn_counts
from .config import MoEConfig
from .dispatcher import build_dispatcher
from .experts import GroupedExperts, SharedExpertMLP
from .router import TopKRouter, update_expert_bias
from .tracker import MoEMetricsTracker


class MoELayer(nn.Module):
    def __init__(self, cfg: MoEConfig, hidden_size: int, dims: ParallelDims, *, layer_number: int,
                 loss_normalization: Optional[LossNormalizationSlot] = None,
                 tracker: Optional[MoEMetricsTracker] = None, sequence_parallel: bool = False, swiglu: bool = True,
                 activation: str = "gelu", dtype=torch.float32, recompute_tracker: Optional[RNGStatesTracker] = None,
                 gemm: Optional[GemmPath] = None, glu=None, bias: bool = False, recompute: Tuple[str, ...] = ()):
        """`recompute_tracker`: the RNG streams a --moe-layer-recompute replay restores; `recompute`:
        which of --recompute-modules moe, shared_experts, moe_act apply here; `gemm`: the
        GemmPath of the experts' and the shared expert's weights (the router's stays plain); `glu`:
        the gated unit (mlp.GatedUnit) when `swiglu` (None: SwiGLU); `bias`: biases on the router and
        both expert projections (--add-bias-linear, as Megatron-Core; the shared expert has none)."""
        super().__init__()
        cfg.validate(ep=dims.ep, etp=dims.etp)
        self.cfg, self.dims, self.sequence_parallel = cfg, dims, sequence_parallel
        self.router = TopKRouter(cfg, hidden_size, dims, layer_number, loss_normalization, tracker, dtype, bias)
        self.experts = GroupedExperts(cfg.num_experts, hidden_size, cfg.moe_ffn_hidden_size, dims, swiglu,
                                      activation, cfg.moe_grouped_gemm, dtype, gemm, glu, bias,
                                      recompute_act="moe_act" in recompute)
        self.shared_experts = None
        if cfg.moe_shared_expert_intermediate_size:
            self.shared_experts = SharedExpertMLP(hidden_size, cfg.moe_shared_expert_intermediate_size, dims,
                                                  sequence_parallel, swiglu, activation, cfg.moe_shared_expert_gate,
                                                  dtype, gemm, glu)
        self.dispatcher = build_dispatcher(cfg.moe_token_dispatcher_type, cfg.num_experts, dims)
        recomputed = cfg.moe_layer_recompute or "moe" in recompute
        self.recompute_tracker = recompute_tracker if recomputed else None
        self.shared_recompute_tracker = recompute_tracker if "shared_experts" in recompute else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.recompute_tracker is not None and self.training and torch.is_grad_enabled():
            # --moe-layer-recompute: nothing of the layer is kept but its input; backward replays it
            # (the router's statistics and the expert-bias counts record only the first pass).
            return recompute(self._forward, self.recompute_tracker, x)
        return self._forward(x)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        local = self._own_tokens(x)
        s, b, h = local.shape
        tokens = local.reshape(s * b, h)
        routing = self.router(tokens, s, b)
        keys = self._token_keys(s, b, tokens.device) if getattr(self.experts.gemm, "token_order", False) else None
        rows, tokens_per_expert, state = self.dispatcher.dispatch(tokens, routing, keys)
        out = self.dispatcher.combine(self.experts(rows, tokens_per_expert, state.batches, state.orders), state)
        out = self._all_tokens(out.view(s, b, h))
        if self.shared_experts is None:
            return out
        if self.shared_recompute_tracker is not None and self.training and torch.is_grad_enabled():
            return out + recompute(self.shared_experts, self.shared_recompute_tracker, x)
        return out + self.shared_experts(x)

    def _token_keys(self, s: int, b: int, device):
        """(the index of each of this rank's [s, b] tokens in the single-process micro-batch, its
        tokens), for a GemmPath that orders an expert's tokens as the single process (FP8 blockwise):
        this TP rank's share of the CP rank's zigzag part of the sequence (context_parallel.py)."""
        d = self.dims
        pos = torch.arange(s, device=device) + d.tp_rank * s
        if d.cp > 1:
            pos = zigzag_indices(s * d.tp * d.cp, d.cp, d.cp_rank, device)[pos]
        return (pos[:, None] * b + torch.arange(b, device=device)).reshape(-1), s * d.tp * d.cp * b

    def _own_tokens(self, x: torch.Tensor) -> torch.Tensor:
        """This TP rank's tokens: x itself under SP, else its slice of the sequence."""
        if self.dims.tp == 1 or self.sequence_parallel:
            return x
        if x.shape[0] % self.dims.tp:
            raise ConfigError(f"an MoE layer without sequence parallelism splits the sequence over TP: sequence "
                              f"length {x.shape[0]} must be divisible by tp {self.dims.tp} (or use "
                              f"--sequence-parallel)")
        return self.dims.comm.scatter_to_sp(x, self.dims.tp_group)

    def _all_tokens(self, out: torch.Tensor) -> torch.Tensor:
        if self.dims.tp == 1 or self.sequence_parallel:
            return out
        return self.dims.comm.gather_from_sp(out, self.dims.tp_group, tensor_parallel_output_grad=False)

    @classmethod
    def counts(cls, cfg, mb: MicroBatch) -> Counts:
        """Router, experts (a token uses k; their biases and the router's with add_bias_linear), shared
        expert and its gate. Kept per token, each TP rank routing its share: per routed copy its rows
        through the dispatch (permuted, exchanged, back) 3 a h and the expert MLP's activations; the
        router's fp32 logits, scores and top-k mask, 12 per expert (expected routing: a measured run
        scatters around it by the load imbalance)."""
        m, h, a = cfg.moe, cfg.hidden_size, mb.a
        k, e, f = m.moe_router_topk, m.num_experts, m.moe_ffn_hidden_size
        expert = ffn_counts(h, f, cfg.swiglu, cfg.add_bias_linear, a, f // mb.etp,
                            recompute_act=mb.recomputes("moe_act"))
        kept = (k * (3 * a * h + expert.act_bytes) + 12 * e) // mb.tp * mb.tokens
        router = e * (h + 1) if cfg.add_bias_linear else e * h
        out = weights(router + e * expert.params, router + k * expert.params, kept)
        if m.moe_shared_expert_intermediate_size:
            i = m.moe_shared_expert_intermediate_size
            gate = h if m.moe_shared_expert_gate else 0
            shared = ffn_counts(h, i, cfg.swiglu, False, a, i // mb.tp, mb.tokens)
            out += (shared._replace(act_bytes=0) if mb.recomputes("shared_experts") else shared) + weights(gate)
        # --recompute-modules moe (or --moe-layer-recompute): only the input, the norm's output
        return out._replace(act_bytes=0) if mb.recomputes("moe") or m.moe_layer_recompute else out


class MoEStepHooks:
    """The MoE layers' step hooks (transformer/step_hooks.py), on every rank of an MoE model (the
    statistics are reduced over the whole world): clear the statistics, move the expert biases after
    an update (collective over TP x DP x CP), report per-layer statistics and their means / worst."""

    def __init__(self, num_layers: int, num_experts: int, dims: ParallelDims, device=None):
        self.dims, self.tracker = dims, MoEMetricsTracker(num_layers, num_experts, device)
        self.routers: List[TopKRouter] = []  # this rank's, added by the model builder

    def before_step(self, iteration: int) -> None:
        self.tracker.clear()

    def after_update(self) -> None:
        update_expert_bias(self.routers, self.dims)

    def metrics(self) -> dict:
        moe = self.tracker.reduce(self.dims)
        rec = {k: moe[k] for k in ("moe_aux_loss", "moe_z_loss", "moe_load_imbalance") if k in moe}
        rec["moe_layers"] = {str(layer): {k: (v.tolist() if torch.is_tensor(v) else v) for k, v in s.items()}
                             for layer, s in moe["layers"].items()}
        return rec
