"""Self-attention with grouped-query heads and RoPE, split across TP by heads, around a pluggable
core attention (core_attention.py; a context-parallel wrapper has the same interface).
Selective recomputation checkpoints only the core.

What any module in a layer's self-attention slot (this one, or MLA) provides: its own config of
knobs (here `AttentionConfig`, built from the model config as MoEConfig is kept apart from it);
`forward(x, rope, packed)`; and, for generation, `cache_entry()` (the per-token shapes of what it
caches) and `cache_update`, which the KV cache sets while the model decodes (inference/kv_cache.py).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, Optional, Tuple

import torch
import torch.nn as nn

from ..parallel.random import recompute
from ..parallel.sharding import ShardSpec, set_spec, tp_split
from ..parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from .core_attention import PackedSeq
from .counts import Counts, MicroBatch, weights
from .norm import FullWidthRMSNorm, head_norm, norm_weights
from .qk_clip import MaxLogitObserver, RowScales, balancing_eta, rows
from .rope import apply_rope


@dataclass(frozen=True)
class AttentionConfig:
    """The knobs of standard (grouped-query) self-attention."""
    num_attention_heads: int
    num_query_groups: int
    kv_channels: int  # query / key head size
    v_head_dim: int  # value head size (kv_channels in every model built from flags)
    qkv_bias: bool
    proj_bias: bool
    qk_layernorm: bool
    qk_layernorm_full_width: bool = False
    output_gate: bool = False  # --attention-output-gate: sigmoid(x W_gate) times the output, W_gate beside W_Q

    @classmethod
    def from_model(cls, cfg) -> "AttentionConfig":
        return cls(cfg.num_attention_heads, cfg.num_query_groups, cfg.kv_channels, cfg.kv_channels,
                   cfg.add_bias_linear or cfg.add_qkv_bias, cfg.add_bias_linear, cfg.qk_layernorm,
                   cfg.qk_layernorm_full_width, getattr(cfg, "attention_output_gate", False))


class SelfAttention(nn.Module):
    # Generation only: stores this layer's new K/V in the KV cache, returns (every cached K, V, the
    # number of tokens cached before these). Set by KVCache.attached while the model decodes.
    cache_update: Optional[Callable[..., Tuple]] = None
    max_logits: Optional[MaxLogitObserver] = None  # set while --qk-clip measures (transformer/qk_clip.py)

    def __init__(self, cfg, ctx, layer_number: int, core_attention, config: Optional[AttentionConfig] = None):
        super().__init__()
        config = config or AttentionConfig.from_model(cfg)
        dims, sp, dt = ctx.dims, ctx.sequence_parallel, ctx.params_dtype
        tp = dims.tp
        heads, groups = config.num_attention_heads, config.num_query_groups
        d, dv = config.kv_channels, config.v_head_dim
        self.head_dim, self.v_head_dim, self.heads = d, dv, heads // tp
        self.tracker, self.tp, self.sequence_parallel, self.dims = ctx.tracker, tp, sp, dims
        self.layer_number = layer_number  # names this layer's buffers in a KV cache
        self.recompute_core = ctx.recomputes("core_attn")
        q_size, k_size, v_size = heads * d, groups * d, groups * dv
        # With fewer query groups than TP ranks, each K/V group is replicated on tp / groups
        # consecutive ranks (their weight gradients are summed over those ranks after backward).
        kv_replicas = max(1, tp // groups)
        self.groups, self.query_groups = max(1, groups // tp), groups
        gemm = ctx.gemm
        # With the output gate, linear_q holds [Q | gate] (one gate channel per output channel of every head)
        self.output_gate = config.output_gate
        q_segments = [q_size, heads * dv] if self.output_gate else [q_size]
        self.linear_q = ColumnParallelLinear(cfg.hidden_size, sum(q_segments), dims, bias=config.qkv_bias,
                                             sequence_parallel=sp, segments=q_segments, dtype=dt, gemm=gemm)
        self.linear_kv = ColumnParallelLinear(cfg.hidden_size, k_size + v_size, dims, bias=config.qkv_bias,
                                              sequence_parallel=sp, segments=[k_size, v_size], replicas=kv_replicas,
                                              dtype=dt, gemm=gemm)
        self.linear_proj = RowParallelLinear(heads * dv, cfg.hidden_size, dims, bias=config.proj_bias,
                                             sequence_parallel=sp, dtype=dt, gemm=gemm)
        self.core_attention = core_attention(cfg, ctx, layer_number)
        # --softmax-type: a logit per head that joins every softmax's denominator (attention sinks);
        # off-by-one fixes it at 0, learnable trains it (Megatron-Core's softmax_offset; heads split over TP)
        self.softmax_type = cfg.softmax_type
        if self.softmax_type == "learnable":
            self.softmax_offset = nn.Parameter(torch.empty(heads // tp, dtype=dt))
            set_spec(self.softmax_offset, ShardSpec((heads,), (tp_split(dims, 0, heads),)))
        if config.qk_layernorm_full_width:  # one norm over all heads: weights split over TP like the heads
            norm = functools.partial(FullWidthRMSNorm, dims=dims, eps=cfg.norm_epsilon, dtype=dt,
                                     zero_centered=cfg.apply_layernorm_1p)
            self.q_layernorm, self.k_layernorm = norm(q_size), norm(k_size, replicas=kv_replicas)
        elif config.qk_layernorm:  # over each head's channels; the heads are split over TP: grads partial there
            self.q_layernorm = head_norm(cfg, ctx, d)
            self.k_layernorm = head_norm(cfg, ctx, d)

    def cache_entry(self) -> Tuple[Tuple[int, ...], ...]:
        """What generation caches per token on this rank: K [kv heads, head dim], V [kv heads, v head dim]."""
        return (self.groups, self.head_dim), (self.groups, self.v_head_dim)

    def _core(self, q, k, v, packed, q_offset=0):
        if self.core_attention.dropout > 0 and self.training and self.tp > 1:
            with self.tracker.fork():  # each TP rank drops in its own heads: its own stream
                return self._attend(q, k, v, packed, q_offset)
        return self._attend(q, k, v, packed, q_offset)

    def _attend(self, q, k, v, packed, q_offset):
        if self.softmax_type == "vanilla":
            return self.core_attention(q, k, v, packed, q_offset=q_offset)
        # With the sink logit o in the denominator: softmax' = softmax * Z / (Z + e^o) = softmax * sigmoid(lse - o)
        out, lse = self.core_attention(q, k, v, packed, q_offset=q_offset, return_lse=True)  # lse [b, heads, s]
        offset = self.softmax_offset if self.softmax_type == "learnable" else lse.new_zeros(lse.shape[1])
        return out * torch.sigmoid(lse - offset.float()[:, None]).transpose(1, 2).unsqueeze(-1).to(out.dtype)

    def forward(self, x: torch.Tensor, rope=None, packed: Optional[PackedSeq] = None) -> torch.Tensor:
        """While generating (`cache_update` set), x holds the tokens after those already cached;
        their K/V join the cache and the queries attend over all of it."""
        # [s, b, hq d] and [s, b, hkv (d + dv)] over the full sequence, through one TP input region
        q, kv = ColumnParallelLinear.shared_input(x, self.linear_q, self.linear_kv)
        s, b = q.shape[:2]
        d, dv = self.head_dim, self.v_head_dim
        if self.output_gate:
            q, gate = q.split([self.heads * d, self.heads * dv], dim=-1)
        k, v = kv.split([self.groups * d, self.groups * dv], dim=-1)
        q = q.reshape(s, b, self.heads, d)
        k = k.reshape(s, b, self.groups, d)
        v = v.reshape(s, b, self.groups, dv)
        if hasattr(self, "q_layernorm"):
            q, k = self.q_layernorm(q), self.k_layernorm(k)
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
            if torch.is_grad_enabled() and not hasattr(self, "q_layernorm"):
                v = v.contiguous()  # else the saved v (a view) would keep the pre-RoPE k alive beside it
        q, k, v = (t.transpose(0, 1) for t in (q, k, v))  # [b, s, heads, d]
        q_offset = 0
        if self.cache_update is not None:  # causality by absolute position: the queries sit after the cache
            k, v, q_offset = self.cache_update(k, v)
        elif self.max_logits is not None and self.training:
            self.max_logits.observe(q, k, packed, getattr(self.core_attention, "window", None))
        if self.recompute_core and self.training:
            out = recompute(self._core, self.tracker, q, k, v, packed)
        else:
            out = self._core(q, k, v, packed, q_offset)
        out = out.transpose(0, 1).reshape(s, b, self.heads * dv)
        if self.output_gate:
            out = out * torch.sigmoid(gate)
        return self.linear_proj(out)

    def qk_clip_rows(self, max_logits: torch.Tensor, tau: float, alpha: float) -> RowScales:
        """The factors of this rank's query and key rows (QK-clip) given every head's largest logit
        [num heads]: per query group, as Megatron-LM (one group per head without GQA)."""
        heads, groups, rank = max_logits.numel(), self.query_groups, self.dims.tp_rank
        eta = balancing_eta(max_logits.view(groups, heads // groups).amax(dim=1), tau)  # [groups]
        local_heads = torch.arange(rank * self.heads, (rank + 1) * self.heads, device=eta.device)
        if groups >= self.tp:
            local_groups = torch.arange(rank * self.groups, (rank + 1) * self.groups, device=eta.device)
        else:  # each group replicated on tp / groups consecutive ranks
            local_groups = torch.tensor([rank // (self.tp // groups)], device=eta.device)
        q = rows(eta[local_heads // (heads // groups)][:, None] ** alpha, [self.head_dim])
        if self.output_gate:  # the gate's rows are no query's
            q = torch.cat([q, torch.ones(self.heads * self.v_head_dim, device=eta.device)])
        k = eta[local_groups][:, None] ** (1.0 - alpha)
        kv = torch.cat([rows(k, [self.head_dim]), torch.ones(self.groups * self.v_head_dim, device=eta.device)])
        out = [(self.linear_q.weight, q), (self.linear_kv.weight, kv)]
        if self.linear_q.bias is not None:
            out += [(self.linear_q.bias, q), (self.linear_kv.bias, kv)]
        return out

    @classmethod
    def counts(cls, cfg, mb: MicroBatch, window: Optional[int] = None) -> Counts:
        """Q, K, V and output projections, their biases and q/k norms; the core's 2 H (d + dv) T FLOPs
        per token (4 H Q T). Kept per token (heads per TP rank): q and k after RoPE (and q/k norms) and v; the
        core's output and its log-sum-exp, 4 per head (fused kernels keep no [s, s] scores; under
        selective recomputation the core is replayed: no log-sum-exp)."""
        c, h = AttentionConfig.from_model(cfg), cfg.hidden_size
        d, dv, heads, groups = c.kv_channels, c.v_head_dim, c.num_attention_heads, c.num_query_groups
        qkv = heads * d + groups * (d + dv) + (heads * dv if c.output_gate else 0)
        n = h * qkv + heads * dv * h + (qkv if c.qkv_bias else 0) + (h if c.proj_bias else 0)
        if c.qk_layernorm:
            n += heads * d + groups * d if c.qk_layernorm_full_width else 2 * norm_weights(cfg, d)
        n += heads if cfg.softmax_type == "learnable" else 0
        keys = min(mb.seq_length, window) if window else mb.seq_length  # `window`: this layer's sliding window
        core = 2 * heads * (d + dv) * keys
        heads, groups = heads // mb.tp, max(1, groups // mb.tp)
        kept = heads * (d + dv) + groups * (d + dv)
        if c.qk_layernorm:  # the norms keep their inputs: q and [k | v] as the projections left them
            kept += heads * d + groups * d
        if c.output_gate:  # the gate and the ungated output
            kept += 2 * heads * dv
        kept = mb.a * kept + (0 if mb.recomputes("core_attn") else 4 * heads)
        return weights(n, act_bytes=kept * mb.tokens) + Counts(flops=core, core_flops=core)
