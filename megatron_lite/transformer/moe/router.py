"""TopKRouter: which k experts each token goes to, with what weight, and the balancing losses.

Routing (Megatron-Core's rules; `MoEConfig` names):
  logits = x W_r^T, computed in moe_router_dtype (fp32/fp64) if set;
  softmax scores:  pre-softmax: softmax over all experts, take the top k (renormalised only if
                   moe_router_norm_topk_prob); otherwise the top k logits, softmax over those k
                   (Mixtral; equal to renormalising the full softmax);
  sigmoid scores:  sigmoid(logits); the expert bias (aux-loss-free balancing) is added for the
                   *selection* only; the weights are the unbiased scores of the chosen experts,
                   renormalised when k > 1 (DeepSeek-V3);
  group-limited:   experts are split into moe_router_num_groups groups, each token keeps the
                   moe_router_group_topk groups with the largest sum of their top k/group_topk
                   selection scores and picks its k experts inside them;
  then the weights are multiplied by moe_router_topk_scaling_factor.
With a capacity factor, each expert keeps at most ceil(T k / E * factor) of this rank's T
tokens (by probability or by position) and, if padding, is filled up to exactly that many.
Capacities depend only on T, which every rank knows from its own input shape, and the
dispatchers always exchange token counts before tokens, so no rank can wait in an all-to-all
for tokens another rank dropped.

Each rank routes its own tokens (its sequence shard under SP / CP). The expert bias is a
buffer, identical on every rank; `update_expert_bias` (once per optimizer step, collective over
TP x DP x CP) moves it by rate * sign(mean count - count) from the counts of the whole step.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from ...parallel.sharding import replicated, set_spec
from ...parallel.state import ParallelDims
from ..loss_normalization import LossNormalizationSlot
from .config import MoEConfig
from .losses import attach_aux_loss, load_balancing_loss, recording, sequence_load_balancing_loss, z_loss
from .tracker import MoEMetricsTracker


def router_dtype(name: Optional[str]) -> Optional[torch.dtype]:
    """--moe-router-dtype as a torch dtype (None: compute in the input's dtype)."""
    return {None: None, "fp32": torch.float32, "fp64": torch.float64}[name]


@dataclass
class Routing:
    probs: torch.Tensor  # [T, E] routing weights, zero where a token does not go
    routing_map: torch.Tensor  # [T, E] bool, True where a token goes to an expert
    dropped: int = 0  # token-expert pairs removed by the capacity limit on this rank


# --- the pieces of routing, as plain functions -----------------------------------------------
def group_limited_topk(scores: torch.Tensor, k: int, num_groups: int, group_topk: int):
    """Top k of `scores` [T, E] restricted to each token's best `group_topk` expert groups."""
    t, e = scores.shape
    grouped = scores.view(t, num_groups, e // num_groups)
    group_scores = grouped.topk(k // group_topk, dim=-1).values.sum(-1)
    keep = torch.zeros_like(group_scores, dtype=torch.bool)
    keep.scatter_(1, group_scores.topk(group_topk, dim=-1).indices, True)
    masked = scores.masked_fill(~keep.repeat_interleave(e // num_groups, dim=1), float("-inf"))
    return masked.topk(k, dim=-1)


def expert_capacity(num_tokens: int, topk: int, num_experts: int, factor: float) -> int:
    """Megatron's capacity: ceil of the even share of the token-expert pairs times the factor."""
    return math.ceil(num_tokens * topk / num_experts * factor)


def apply_capacity(probs: torch.Tensor, routing_map: torch.Tensor, capacity: int, policy: str, pad: bool):
    """(probs, map) with at most `capacity` tokens per expert (exactly min(capacity, T) if `pad`).
    policy 'probs' keeps each expert's highest-weight tokens, 'position' its earliest ones."""
    t = probs.shape[0]
    if capacity >= t and not pad:
        return probs, routing_map
    capacity = min(capacity, t)
    if policy == "position" and not pad:
        keep = routing_map & (routing_map.long().cumsum(0) <= capacity)
    else:
        # Rank routed tokens first (by weight, or by position: earlier first), then the rest.
        if policy == "probs":
            rank = probs.detach().float() + routing_map.float() * 2.0
        else:
            rank = routing_map.float() * 2.0 - torch.arange(t, device=probs.device).unsqueeze(1) / (t + 1.0)
        top = rank.topk(capacity, dim=0).indices
        keep = torch.zeros_like(routing_map).scatter_(0, top, True)
        if not pad:
            keep &= routing_map
    return probs * keep, keep


class TopKRouter(nn.Module):
    """Routes [T, h] tokens to `num_experts` experts. Constructor arguments:
    cfg (validated MoEConfig), hidden_size, dims (groups), layer_number (global layer index, for
    the tracker), loss_normalization (the step's loss weights; None: the unit weighting), tracker
    (MoEMetricsTracker or None), dtype of the router weight."""

    def __init__(self, cfg: MoEConfig, hidden_size: int, dims: ParallelDims, layer_number: int,
                 loss_normalization: Optional[LossNormalizationSlot] = None,
                 tracker: Optional[MoEMetricsTracker] = None, dtype=torch.float32, bias: bool = False):
        super().__init__()
        self.cfg, self.dims, self.layer_number = cfg, dims, layer_number
        self.loss_normalization, self.tracker = loss_normalization or LossNormalizationSlot(), tracker
        self.num_experts, self.topk = cfg.num_experts, cfg.moe_router_topk
        self.router_dtype = router_dtype(cfg.moe_router_dtype)
        # Every TP rank routes its own tokens (the layer shards them over TP), so the router
        # weight's gradient is partial per TP rank, as a sequence-parallel weight's is.
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, hidden_size, dtype=dtype))
        set_spec(self.weight, replicated((cfg.num_experts, hidden_size), sequence_parallel=dims.tp > 1))
        self.bias = None  # the gating linear's bias (Megatron-Core's, with --add-bias-linear; gpt-oss)
        if bias:
            self.bias = nn.Parameter(torch.empty(cfg.num_experts, dtype=dtype))
            set_spec(self.bias, replicated((cfg.num_experts,), sequence_parallel=dims.tp > 1, init="zeros"))
        if cfg.moe_router_enable_expert_bias:
            self.register_buffer("expert_bias", torch.zeros(cfg.num_experts, dtype=torch.float32))
            self.register_buffer("local_tokens_per_expert", torch.zeros(cfg.num_experts, dtype=torch.float32),
                                 persistent=False)
        else:
            self.expert_bias = self.local_tokens_per_expert = None

    @property
    def sequence_group(self):
        """The ranks sharing one micro-batch's tokens of one DP replica: TP x CP."""
        return self.dims.group("tp_cp")

    # --- forward ------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, seq_len: int, batch: int) -> Routing:
        """x [T, h] with T = seq_len * batch, laid out [seq_len, batch] (this rank's shard)."""
        loss_on = self.training and torch.is_grad_enabled()
        logits = self.gating(self.jitter(x))
        if loss_on and self.cfg.moe_z_loss_coeff:
            logits = self._with_z_loss(logits)
        probs, top = self.topk_probs(logits)
        routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter_(1, top, True)
        probs = torch.zeros_like(logits).scatter(1, top, probs)
        probs, routing_map, dropped = self._capacity(probs, routing_map)
        if loss_on and self.cfg.moe_router_load_balancing_type != "none" and self.cfg.moe_aux_loss_coeff > 0:
            probs = self._with_aux_loss(probs, logits, seq_len, batch)
        self._count(routing_map)
        return Routing(probs, routing_map, dropped)

    def jitter(self, x: torch.Tensor) -> torch.Tensor:
        eps = self.cfg.moe_input_jitter_eps
        if not (self.training and eps):
            return x
        return x * torch.empty_like(x).uniform_(1.0 - eps, 1.0 + eps)

    def gating(self, x: torch.Tensor) -> torch.Tensor:
        dtype = self.router_dtype or x.dtype
        return F.linear(x.to(dtype), self.weight.to(dtype), None if self.bias is None else self.bias.to(dtype))

    def topk_probs(self, logits: torch.Tensor):
        """(weights [T, k], expert indices [T, k]) of each token's chosen experts."""
        cfg = self.cfg
        if cfg.moe_router_score_function == "softmax":
            if cfg.moe_router_pre_softmax:
                probs, top = self._topk(torch.softmax(logits.float(), dim=-1))
                if cfg.normalizes_topk:
                    probs = probs / probs.sum(-1, keepdim=True)
            else:
                top_logits, top = self._topk(logits)
                probs = torch.softmax(top_logits.float(), dim=-1)
        else:
            scores = torch.sigmoid(logits.float())
            selection = scores if self.expert_bias is None else scores + self.expert_bias
            _, top = self._topk(selection)
            probs = scores.gather(1, top)
            if cfg.normalizes_topk:
                probs = probs / (probs.sum(-1, keepdim=True) + 1e-20)
        if cfg.moe_router_topk_scaling_factor:
            probs = probs * cfg.moe_router_topk_scaling_factor
        return probs.to(logits.dtype), top

    def _topk(self, scores: torch.Tensor):
        if self.cfg.moe_router_group_topk:
            return group_limited_topk(scores, self.topk, self.cfg.moe_router_num_groups, self.cfg.moe_router_group_topk)
        return scores.topk(self.topk, dim=-1)

    def _capacity(self, probs, routing_map):
        factor = self.cfg.moe_expert_capacity_factor
        if factor is None:
            return probs, routing_map, 0
        capacity = expert_capacity(probs.shape[0], self.topk, self.num_experts, factor)
        before = int(routing_map.sum())
        probs, kept = apply_capacity(probs, routing_map, capacity, self.cfg.moe_token_drop_policy,
                                     self.cfg.moe_pad_expert_input_to_capacity)
        return probs, kept, before - int((kept & routing_map).sum())

    # --- auxiliary losses ---------------------------------------------------------------------
    def aux_scores(self, logits: torch.Tensor) -> torch.Tensor:
        """Scores the load-balancing loss uses: softmax, or sigmoid normalised over experts."""
        if self.cfg.moe_router_score_function == "softmax":
            return torch.softmax(logits.float(), dim=-1)
        scores = torch.sigmoid(logits.float())
        return scores / (scores.sum(-1, keepdim=True) + 1e-20)

    def aux_loss(self, logits: torch.Tensor, seq_len: int, batch: int) -> torch.Tensor:
        """This rank's partial of the load-balancing loss (no coefficient)."""
        scores = self.aux_scores(logits)
        topk_map = torch.zeros_like(scores, dtype=torch.bool).scatter_(1, scores.topk(self.topk, dim=-1).indices, True)
        if self.cfg.moe_router_load_balancing_type == "seq_aux_loss":
            return sequence_load_balancing_loss(scores, topk_map, self.topk, seq_len, batch, self.sequence_group,
                                                self.dims.comm)
        return load_balancing_loss(scores, topk_map, self.topk, self.sequence_group, self.dims.comm)

    def _with_aux_loss(self, probs, logits, seq_len, batch):
        loss = self.aux_loss(logits, seq_len, batch)
        if self.tracker is not None and recording():
            self.tracker.record_loss(self.layer_number, "load_balancing_loss", loss)
        return attach_aux_loss(probs, loss * self.cfg.moe_aux_loss_coeff, self.loss_normalization)

    def _with_z_loss(self, logits):
        loss = z_loss(logits, self.sequence_group, self.dims.comm)
        if self.tracker is not None and recording():
            self.tracker.record_loss(self.layer_number, "z_loss", loss)
        return attach_aux_loss(logits, loss * self.cfg.moe_z_loss_coeff, self.loss_normalization)

    # --- token counts -------------------------------------------------------------------------
    def _count(self, routing_map: torch.Tensor) -> None:
        if not (self.training and recording()):  # training forwards only, each counted once
            return
        counts = routing_map.sum(0)
        if self.local_tokens_per_expert is not None:
            self.local_tokens_per_expert += counts.float()
        if self.tracker is not None:
            self.tracker.record_tokens(self.layer_number, counts)


@torch.no_grad()
def update_expert_bias(routers: Iterable[TopKRouter], dims: ParallelDims) -> None:
    """Once per optimizer step, on every rank (collective over TP x DP x CP): sum each router's
    token counts over the stage's ranks in fp32 and move its bias toward the experts that got
    fewer tokens than the mean, `bias += rate * sign(mean - count)`; then reset the counts.
    Pass every router of this rank's model chunks; all-reduced in one buffer."""
    routers = [r for r in routers if r.expert_bias is not None]
    if not routers:
        return
    counts = torch.cat([r.local_tokens_per_expert for r in routers]).float()
    dims.comm.all_reduce(counts, dims.tp_dp_cp_group)
    for r, c in zip(routers, counts.split([r.num_experts for r in routers])):
        r.expert_bias += r.cfg.moe_router_bias_update_rate * torch.sign(c.mean() - c)
        r.local_tokens_per_expert.zero_()
