"""Multi-latent attention (DeepSeek-V2/V3; Megatron-Core's MLASelfAttention), in the self-attention slot.

Per token: the query either directly (x W_Q) or through a low-rank latent (RMSNorm(x W_DQ) W_UQ);
the keys and values through one latent c = KVNorm(x W_DKV) of kv_lora_rank channels, up-projected
per head to K_nope and V (W_UKV), plus one RoPE key of qk_pos_emb_head_dim channels (x W_KR, taken
from the same down-projection) shared by every head. Query = [q_nope, rope(q_rope)], key =
[k_nope, rope(k_rope)]; the value head size may differ from the key's. Softmax scale
1/sqrt(qk_head_dim + qk_pos_emb_head_dim), times YaRN's mscale^2 when set.

Tensor parallelism: the heads are split (Q, up-projections: column-parallel; output: row-parallel);
the down-projections are replicated, computed on every rank over the full sequence (under SP the
gathered one, as Megatron-Core). They sit in one TP input region with the Q projection, so the
input gradient is all-reduced (SP: reduce-scattered) once; each rank's gradient of the latent and
the RoPE key covers only its heads, so the replicated weights' and norms' gradients are partial
and summed over TP (their ShardSpecs say so), like the q/k norms of standard attention.

Generation caches the normalised latent and the rotated RoPE key per token (kv_lora_rank +
qk_pos_emb_head_dim numbers, on every TP rank), not per-head K/V, and attends with the absorbed
up-projections: W_UK folded into the query, W_UV applied after attention.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional, Tuple

import torch
import torch.nn as nn

from ..parallel.random import recompute, recomputed_when_saved
from ..parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear, linear
from .attention import SelfAttention
from .core_attention import PackedSeq
from .counts import Counts, MicroBatch, weights
from .norm import head_norm, norm_weights
from .qk_clip import MaxLogitObserver, RowScales, balancing_eta, rows
from .rope import apply_rope, softmax_scale_factor


@dataclass(frozen=True)
class MLAConfig:
    """The knobs of multi-latent attention (Megatron's flag names)."""
    num_attention_heads: int
    q_lora_rank: Optional[int]
    kv_lora_rank: int
    qk_head_dim: int
    qk_pos_emb_head_dim: int
    v_head_dim: int
    bias: bool
    softmax_scale: float

    @classmethod
    def from_model(cls, cfg) -> "MLAConfig":
        d = cfg.qk_head_dim + cfg.qk_pos_emb_head_dim
        return cls(cfg.num_attention_heads, cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_head_dim,
                   cfg.qk_pos_emb_head_dim, cfg.v_head_dim, cfg.add_bias_linear,
                   softmax_scale_factor(cfg) / math.sqrt(d))


class MLASelfAttention(nn.Module):
    # Generation only: stores this layer's new latents in the cache (see attention.py / kv_cache.py).
    cache_update: Optional[Callable[..., Tuple]] = None
    max_logits: Optional[MaxLogitObserver] = None  # set while --qk-clip measures (transformer/qk_clip.py)

    def __init__(self, cfg, ctx, layer_number: int, core_attention, config: Optional[MLAConfig] = None):
        super().__init__()
        c = self.config = config or MLAConfig.from_model(cfg)
        dims, sp, dt, gemm = ctx.dims, ctx.sequence_parallel, ctx.params_dtype, ctx.gemm
        tp, h, heads = dims.tp, cfg.hidden_size, c.num_attention_heads
        self.heads, self.tp, self.tracker, self.gemm, self.dims = heads // tp, tp, ctx.tracker, gemm, dims
        self.layer_number = layer_number
        self.recompute_core = ctx.recomputes("core_attn")
        self.recompute_up = ctx.recomputes("mla_up_proj")
        q_head = c.qk_head_dim + c.qk_pos_emb_head_dim

        def duplicated(out_size):  # whole on every TP rank; its gradient partial over TP (summed there)
            return ColumnParallelLinear(h, out_size, dims, bias=c.bias, sequence_parallel=sp, replicas=tp, dtype=dt,
                                        gemm=gemm)
        if c.q_lora_rank is None:
            self.linear_q_proj = ColumnParallelLinear(h, heads * q_head, dims, bias=c.bias, sequence_parallel=sp,
                                                      dtype=dt, gemm=gemm)
        else:
            self.linear_q_down_proj = duplicated(c.q_lora_rank)
            self.q_layernorm = head_norm(cfg, ctx, c.q_lora_rank)
            # Applied to the replicated latent on each rank (no TP region of its own: see the module doc).
            self.linear_q_up_proj = ColumnParallelLinear(c.q_lora_rank, heads * q_head, dims, bias=c.bias, dtype=dt,
                                                         gemm=gemm)
        self.linear_kv_down_proj = duplicated(c.kv_lora_rank + c.qk_pos_emb_head_dim)
        self.kv_layernorm = head_norm(cfg, ctx, c.kv_lora_rank)
        self.linear_kv_up_proj = ColumnParallelLinear(c.kv_lora_rank, heads * (c.qk_head_dim + c.v_head_dim), dims,
                                                      bias=c.bias, dtype=dt, gemm=gemm)
        self.linear_proj = RowParallelLinear(heads * c.v_head_dim, h, dims, bias=c.bias, sequence_parallel=sp,
                                             dtype=dt, gemm=gemm)
        self.core_attention = core_attention(cfg, ctx, layer_number)

    def cache_entry(self) -> Tuple[Tuple[int, ...], ...]:
        """What generation caches per token on each rank: the latent [kv_lora_rank] and the RoPE key
        [qk_pos_emb_head_dim] (one of each, shared by every head)."""
        return (self.config.kv_lora_rank,), (self.config.qk_pos_emb_head_dim,)

    def _core(self, q, k, v, packed, q_offset=0):
        if self.core_attention.dropout > 0 and self.training and self.tp > 1:
            with self.tracker.fork():  # each TP rank drops in its own heads: its own stream
                return self.core_attention(q, k, v, packed, q_offset=q_offset)
        return self.core_attention(q, k, v, packed, q_offset=q_offset)

    def _local(self, layer: ColumnParallelLinear, x: torch.Tensor) -> torch.Tensor:
        """A column-parallel up-projection of a replicated latent, without a TP region of its own."""
        weight, bias = layer()
        return linear(x, weight, bias, self.gemm)

    def forward(self, x: torch.Tensor, rope=None, packed: Optional[PackedSeq] = None) -> torch.Tensor:
        q, latent, k_rope = self._latents(x)
        if self.cache_update is not None:
            q_nope, q_rope, k_rope = self._queries(q, k_rope, rope)
            out = self._absorbed(q_nope, q_rope, latent.transpose(0, 1), k_rope.squeeze(2), packed)
        else:
            out = self._attend(q, latent, k_rope, rope, packed)
        return self._project(out)

    def _latents(self, x: torch.Tensor):
        """The query (or its normalised latent), the normalised K/V latent and the RoPE key of x, each
        [s, b, ...] over the full sequence."""
        c = self.config
        first = self.linear_q_proj if c.q_lora_rank is None else self.linear_q_down_proj
        q, kv = ColumnParallelLinear.shared_input(x, first, self.linear_kv_down_proj)  # [s, b, ...], full sequence
        if c.q_lora_rank is not None:
            q = self.q_layernorm(q)  # the query latent
        latent, k_rope = kv.split([c.kv_lora_rank, c.qk_pos_emb_head_dim], dim=-1)
        return q, self.kv_layernorm(latent), k_rope

    def _project(self, out: torch.Tensor) -> torch.Tensor:
        """The output projection of the core's out [b, s, heads, dv]."""
        b, s = out.shape[:2]
        return self.linear_proj(out.transpose(0, 1).reshape(s, b, self.heads * self.config.v_head_dim))

    def _queries(self, q, k_rope, rope):
        """q_nope, q_rope [b, s, heads, ...] (after the query's up-projection) and k_rope [b, s, 1, dr],
        with RoPE applied."""
        c = self.config
        if c.q_lora_rank is not None:
            q = self._local(self.linear_q_up_proj, q)
        s, b = q.shape[:2]
        q_nope, q_rope = q.reshape(s, b, self.heads, c.qk_head_dim + c.qk_pos_emb_head_dim).split(
            [c.qk_head_dim, c.qk_pos_emb_head_dim], dim=-1)
        k_rope = k_rope.unsqueeze(2)  # [s, b, 1, dr]
        if rope is not None:
            q_rope, k_rope = apply_rope(q_rope, *rope), apply_rope(k_rope, *rope)
        return q_nope.transpose(0, 1), q_rope.transpose(0, 1), k_rope.transpose(0, 1)

    def _qkv(self, q, latent, k_rope, rope):
        """The core's q, k, v [b, s, heads, ...] from the query (or its latent) and the K/V latent:
        the up-projections and RoPE (what --recompute-modules mla_up_proj recomputes)."""
        c = self.config
        dn, dr, dv = c.qk_head_dim, c.qk_pos_emb_head_dim, c.v_head_dim
        q_nope, q_rope, k_rope = self._queries(q, k_rope, rope)
        b, s = q_nope.shape[:2]
        kv = self._local(self.linear_kv_up_proj, latent.transpose(0, 1)).reshape(b, s, self.heads, dn + dv)
        k_nope, v = kv.split([dn, dv], dim=-1)
        # The core scales by 1/sqrt(dn + dr): the rest of the softmax scale goes into the query.
        q = torch.cat([q_nope, q_rope], dim=-1) * (c.softmax_scale * math.sqrt(dn + dr))
        k = torch.cat([k_nope, k_rope.expand(b, s, self.heads, dr)], dim=-1)
        return q, k, v

    def _attend(self, q, latent, k_rope, rope, packed, core=None):
        """Training and prefill: the core over the up-projected heads, recomputed as
        --recompute-modules says (core_attn: the core; mla_up_proj: the up-projections, whose
        outputs are not kept; both: one region from the latents). `core`: in place of the core
        attention (DSA's attention over the selected keys), called as core(q, k, v, packed)."""
        core = core or self._core
        latents = (q, latent, k_rope)
        recomputing = self.training and torch.is_grad_enabled()
        up, recompute_core = recomputing and self.recompute_up, recomputing and self.recompute_core
        observe = self.max_logits is not None and self.training
        if up and recompute_core:
            if observe:  # q, k are not kept here: measured apart
                with torch.no_grad():
                    self._observe(*self._qkv(*latents, rope)[:2], packed)
            return recompute(lambda *a: core(*self._qkv(*a, rope), packed), self.tracker, *latents)
        q, k, v = self._qkv(*latents, rope)
        if observe:
            self._observe(q, k, packed)
        if recompute_core:
            return recompute(core, self.tracker, q, k, v, packed)
        if not up:
            return core(q, k, v, packed)
        with recomputed_when_saved((q, k, v), lambda *a: self._qkv(*a, rope), *latents):
            return core(q, k, v, packed)

    def _observe(self, q, k, packed):
        """--qk-clip / --log-max-attention-logit: this step's max logit per head (transformer/qk_clip.py)."""
        self.max_logits.observe(q, k, packed, getattr(self.core_attention, "window", None))

    def qk_clip_rows(self, max_logits: torch.Tensor, tau: float, alpha: float) -> RowScales:
        """QK-clip's factors of this rank's rows given every head's largest logit [num heads], as
        Kimi-K2's report scales MLA: per head, q_nope by eta^alpha, k_nope by eta^(1 - alpha), q_rope
        by eta; the shared RoPE key (in the KV down-projection) is not touched."""
        c, rank = self.config, self.dims.tp_rank
        eta = balancing_eta(max_logits[rank * self.heads:(rank + 1) * self.heads], tau)[:, None]  # [heads, 1]
        q = rows(torch.cat([eta ** alpha, eta], dim=1), [c.qk_head_dim, c.qk_pos_emb_head_dim])
        kv = rows(torch.cat([eta ** (1.0 - alpha), torch.ones_like(eta)], dim=1), [c.qk_head_dim, c.v_head_dim])
        q_layer = self.linear_q_proj if c.q_lora_rank is None else self.linear_q_up_proj
        out = [(q_layer.weight, q), (self.linear_kv_up_proj.weight, kv)]
        if c.bias:
            out += [(q_layer.bias, q), (self.linear_kv_up_proj.bias, kv)]
        return out

    def _absorbed(self, q_nope, q_rope, latent, k_rope, packed):
        """Decoding over the cache of latents: scores q_nope W_UK^T c + q_rope k_rope, output
        (softmax . c) W_UV, as multi-query attention over [c | k_rope] with values c (one head)."""
        latents, k_ropes, q_offset = self.cache_update(latent, k_rope)
        return self._absorbed_core(q_nope, q_rope, latents, k_ropes, q_offset, packed)

    def _absorbed_core(self, q_nope, q_rope, latents, k_ropes, q_offset, packed, core=None):
        """The absorbed attention over every cached latent [b, t, r] and RoPE key [b, t, dr]; `core`: in
        place of the core attention (DSA's over the selected keys), called as the core is."""
        c = self.config
        dn, dr, dv, r = c.qk_head_dim, c.qk_pos_emb_head_dim, c.v_head_dim, c.kv_lora_rank
        w = self.linear_kv_up_proj()[0].view(self.heads, dn + dv, r)  # this rank's heads
        w_uk, w_uv = w[:, :dn], w[:, dn:]
        q_latent = torch.einsum("bshd,hdr->bshr", q_nope, w_uk)
        q = torch.cat([q_latent, q_rope], dim=-1) * (c.softmax_scale * math.sqrt(r + dr))
        k = torch.cat([latents, k_ropes], dim=-1).unsqueeze(2)  # [b, t, 1, r + dr]
        out = (core or self.core_attention)(q, k, latents.unsqueeze(2), packed, q_offset=q_offset)  # [b, s, heads, r]
        out = torch.einsum("bshr,hvr->bshv", out, w_uv)
        bias = self.linear_kv_up_proj.bias
        if bias is not None:  # the value bias passes through attention unchanged (softmax rows sum to 1)
            out = out + bias.view(self.heads, dn + dv)[:, dn:]
        return out

    @classmethod
    def counts(cls, cfg, mb: MicroBatch, window=None) -> Counts:  # (MLA attends causally: no window)
        """The projections, their biases and the two latent norms; the core's 2 H (d + dv) T FLOPs per
        token with d = qk_head_dim + qk_pos_emb_head_dim. Kept per token (heads per TP rank): the
        latents (with the RoPE key) and their norms' inputs, q, k after RoPE and v; the core's
        output and log-sum-exp (none under selective recomputation)."""
        c, h = MLAConfig.from_model(cfg), cfg.hidden_size
        d, dv, heads, r, dr = (c.qk_head_dim + c.qk_pos_emb_head_dim, c.v_head_dim, c.num_attention_heads,
                               c.kv_lora_rank, c.qk_pos_emb_head_dim)
        q = heads * d
        outs = [q] if c.q_lora_rank is None else [c.q_lora_rank, q]
        ins = [h] if c.q_lora_rank is None else [h, c.q_lora_rank]
        outs += [r + dr, heads * (c.qk_head_dim + dv), h]
        ins += [h, r, heads * dv]
        n = sum(i * o for i, o in zip(ins, outs)) + (sum(outs) if c.bias else 0)
        n += norm_weights(cfg, r) + (norm_weights(cfg, c.q_lora_rank) if c.q_lora_rank else 0)
        keys = min(mb.seq_length, cfg.window_size) if cfg.window_size else mb.seq_length
        core = 2 * heads * (d + dv) * keys
        local = heads // mb.tp
        latents = r + dr + (c.q_lora_rank or 0)
        kept = 2 * latents + (0 if mb.recomputes("mla_up_proj") else local * (2 * d + dv) + local * (d + dv))
        kept = mb.a * kept + (0 if mb.recomputes("core_attn") else 4 * local)
        return weights(n, act_bytes=kept * mb.tokens) + Counts(flops=core, core_flops=core)
