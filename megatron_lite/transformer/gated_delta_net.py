"""Linear-attention mixers of the gated delta rule, in the self-attention slot: Gated DeltaNet
(Qwen3-Next, Qwen3.5; Megatron-Core's GatedDeltaNet) and Kimi Delta Attention (Kimi Linear).

Both project the input to q, k, v, run them through a short causal depthwise conv1d with SiLU,
L2-normalise q and k, and run the gated delta rule (kernels/gated_delta.py) with a decay
g = -exp(A_log) softplus(a + dt_bias) and a write strength beta = sigmoid(b); the output goes
through an RMSNorm per value head gated by a projection of the input, then the output projection.
- Gated DeltaNet: one fused input projection `in_proj` = [q | k | v | z | b | a] (Megatron-Core's
  layout), a decay per value head; value heads may outnumber key heads (each key head serves
  consecutive value heads, as grouped-query attention); the norm's gate is SiLU(z).
- KDA: separate q/k/v projections (as Hugging Face's kimi_linear), one head count, a decay per key
  channel through the low-rank `f_a_proj` -> `f_b_proj` (plus dt_bias per channel, A_log per head),
  the norm's gate sigmoid(g_b_proj(g_a_proj(x))).

Tensor parallelism splits the heads (key and value heads divisible by TP, Megatron's rule): the
projections are column-parallel per segment, so a rank's conv channels, gates, dt_bias and A_log
are those of its heads; the low-rank down-projections of KDA are replicated (their gradients
partial over TP, as MLA's); the output projection is row-parallel. Under SP the input projections
all-gather the sequence and the output projection reduce-scatters it.

Packed documents (`packed`): the conv and the recurrent state restart at each document.
Generation keeps the conv's last kernel - 1 inputs and the recurrent state per sequence
(`cache_entry`): a fixed size whatever the length.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..kernels.fla_backend import fla_gated_delta_rule
from ..kernels.gated_delta import chunked_gated_delta_rule, recurrent_gated_delta_rule
from ..parallel.random import recompute
from ..parallel.sharding import ShardSpec, replicated, set_spec, tp_split
from ..parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear, linear
from .core_attention import PackedSeq
from .counts import Counts, MicroBatch, weights
from .spec import RecurrentState


@dataclass(frozen=True)
class GatedDeltaNetConfig:
    """The knobs of a gated-delta-rule mixer (Megatron's --linear-* flags)."""
    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int = 4
    chunk_size: int = 64
    per_channel_decay: bool = False  # Kimi Delta Attention (one head count: key heads = value heads)
    norm_epsilon: float = 1e-6
    bias: bool = False
    kernel: str = "torch"  # the chunked rule in training: torch, or fla (kernels/fla_backend.py)

    @classmethod
    def from_model(cls, cfg) -> "GatedDeltaNetConfig":
        kda = cfg.linear_attention_type == "kda"
        return cls(cfg.linear_num_key_heads, cfg.linear_num_key_heads if kda else cfg.linear_num_value_heads,
                   cfg.linear_key_head_dim, cfg.linear_key_head_dim if kda else cfg.linear_value_head_dim,
                   cfg.linear_conv_kernel_dim, cfg.linear_chunk_size, kda, cfg.norm_epsilon, cfg.add_bias_linear,
                   cfg.linear_attention_kernel)

    @property
    def key_dim(self) -> int:
        return self.num_key_heads * self.key_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_value_heads * self.value_head_dim

    @property
    def conv_segments(self) -> List[int]:
        return [self.key_dim, self.key_dim, self.value_dim]


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(|x|^2 + eps) over the last dimension (flash-linear-attention's convention)."""
    return x * torch.rsqrt(x.square().sum(-1, keepdim=True) + eps)


def document_spans(packed: Optional[PackedSeq], batch: int, length: int) -> List[List[Tuple[int, int]]]:
    """Per sequence of the batch, the [start, end) of each run of one document (the whole sequence
    without packing)."""
    if packed is None:
        return [[(0, length)]] * batch
    ids = packed.document_ids
    out = []
    for row in ids:
        starts = [0] + (torch.nonzero(row[1:] != row[:-1]).flatten() + 1).tolist()
        out.append(list(zip(starts, starts[1:] + [length])))
    return out


class CausalConv1d(nn.Module):
    """A depthwise causal conv over channels split into TP segments (weight [channels, 1, kernel],
    Megatron-Core's and Hugging Face's shape), followed by SiLU."""

    def __init__(self, segments: List[int], kernel: int, dims, dtype):
        super().__init__()
        split = tp_split(dims, 0, sum(segments), segments)
        self.kernel = kernel
        self.weight = nn.Parameter(torch.empty(sum(segments) // split.shards, 1, kernel, dtype=dtype))
        set_spec(self.weight, ShardSpec((sum(segments), 1, kernel), (split,)))

    def forward(self, x: torch.Tensor, history: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x [b, s, c] -> [b, s, c]; `history` [b, kernel - 1, c]: the inputs before x (zeros if None)."""
        if history is None:
            history = x.new_zeros(x.shape[0], self.kernel - 1, x.shape[2])
        full = torch.cat([history.to(x.dtype), x], dim=1).transpose(1, 2)
        return F.silu(F.conv1d(full, self.weight, groups=self.weight.shape[0])).transpose(1, 2)


class GatedRMSNorm(nn.Module):
    """RMSNorm over each value head (fp32), times act(gate): SiLU for GDN, sigmoid for KDA. The
    weight is shared by the heads, which TP splits: its gradient is partial over TP."""

    def __init__(self, width: int, eps: float, act: Callable, dims, dtype):
        super().__init__()
        self.eps, self.act = eps, act
        self.weight = nn.Parameter(torch.ones(width, dtype=dtype))
        set_spec(self.weight, replicated((width,), dims.tp > 1, init="ones"))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        y = x32 * torch.rsqrt(x32.square().mean(-1, keepdim=True) + self.eps) * self.weight.float()
        return (y * self.act(gate.float())).to(x.dtype)


def _head_param(heads: int, dims, dtype, init: str) -> nn.Parameter:
    """A vector with one entry per head (or per head channel), split over TP with the heads."""
    split = tp_split(dims, 0, heads)
    return set_spec(nn.Parameter(torch.empty(heads // split.shards, dtype=dtype)),
                    ShardSpec((heads,), (split,), init=init))


class DeltaRuleMixer(nn.Module):
    """What both mixers share: the conv, the rule over packed documents and the decoding cache."""
    # Generation only: () -> the cached (conv history [b, kernel - 1, c], state [b, Hv, dk, dv], tokens
    # cached before), updated in place. Set by the KV cache while the model decodes (inference/kv_cache.py).
    cache_update: Optional[Callable[..., Tuple]] = None

    def _setup(self, cfg, ctx, config: GatedDeltaNetConfig):
        dims = ctx.dims
        for heads in (config.num_key_heads, config.num_value_heads):
            assert heads % dims.tp == 0, f"{heads} linear-attention heads do not split over TP {dims.tp}"
        self.config, self.dims, self.gemm, self.sp = config, dims, ctx.gemm, ctx.sequence_parallel
        self.tracker = ctx.tracker
        # --recompute-modules: core_attn replays the conv and the rule, linear_attn also the gates and the norm
        self.recompute_mixer = ctx.recomputes("linear_attn")
        self.recompute_rule = ctx.recomputes("core_attn") and not self.recompute_mixer
        self.key_heads, self.value_heads = config.num_key_heads // dims.tp, config.num_value_heads // dims.tp
        self.conv1d = CausalConv1d(config.conv_segments, config.conv_kernel, dims, ctx.params_dtype)
        self.A_log = _head_param(config.num_value_heads, dims, ctx.params_dtype, "a_log")

    def cache_entry(self) -> RecurrentState:
        """What generation keeps per sequence on each rank (not per token): the conv history
        [kernel - 1, conv channels] and the recurrent state [value heads, dk, dv]."""
        c = self.config
        channels = sum(c.conv_segments) // self.dims.tp
        return RecurrentState(((c.conv_kernel - 1, channels), (self.value_heads, c.key_head_dim, c.value_head_dim)))

    def _mix(self, qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, packed) -> torch.Tensor:
        """conv -> q, k, v -> the rule, document by document: qkv [b, s, conv channels], g [b, s, Hv(, dk)],
        beta [b, s, Hv] -> [b, s, Hv, dv]."""
        if self.cache_update is not None:
            return self._decode(qkv, g, beta, packed)
        if self.recompute_rule and self.training and torch.is_grad_enabled():
            return recompute(self._mix_documents, self.tracker, qkv, g, beta, packed)
        return self._mix_documents(qkv, g, beta, packed)

    def _mix_documents(self, qkv, g, beta, packed):
        b, s = qkv.shape[:2]
        rows = []
        for i, spans in enumerate(document_spans(packed, b, s)):
            pieces = [self._rule(self.conv1d(qkv[i:i + 1, lo:hi]), g[i:i + 1, lo:hi], beta[i:i + 1, lo:hi])[0]
                      for lo, hi in spans]
            rows.append(torch.cat(pieces, dim=1))
        return torch.cat(rows, dim=0)

    def _decode(self, qkv, g, beta, packed):
        """Prefill or decoding steps, sequence by sequence: the first document of the new tokens
        continues from the cached conv history and state (zeros before the prompt), a later one (the
        prompt after left padding) starts afresh; the last one's history and state are cached."""
        b, s = qkv.shape[:2]
        history, state, _ = self.cache_update()
        new_docs = None if packed is None else PackedSeq(packed.document_ids[:, -s:])
        rows, histories, states = [], [], []
        for i, spans in enumerate(document_spans(new_docs, b, s)):
            h, st, pieces = history[i:i + 1], state[i:i + 1], []
            for j, (lo, hi) in enumerate(spans):
                if j > 0:  # a new document: nothing before it
                    h, st = torch.zeros_like(h), torch.zeros_like(st)
                x = qkv[i:i + 1, lo:hi]
                out, st = self._rule(self.conv1d(x, h), g[i:i + 1, lo:hi], beta[i:i + 1, lo:hi], st,
                                     recurrent=hi - lo == 1)
                h = torch.cat([h, x.to(h.dtype)], dim=1)[:, x.shape[1]:]  # the last kernel - 1 inputs
                pieces.append(out)
            rows.append(torch.cat(pieces, dim=1))
            histories.append(h)
            states.append(st)
        history.copy_(torch.cat(histories))
        state.copy_(torch.cat(states))
        return torch.cat(rows, dim=0)

    def _heads(self, conv_out: torch.Tensor):
        c = self.config
        b, s = conv_out.shape[:2]
        q, k, v = conv_out.split([x // self.dims.tp for x in c.conv_segments], dim=-1)
        q = l2_normalize(q.reshape(b, s, self.key_heads, c.key_head_dim).float())
        k = l2_normalize(k.reshape(b, s, self.key_heads, c.key_head_dim).float())
        if self.value_heads != self.key_heads:  # each key head serves consecutive value heads
            q, k = (x.repeat_interleave(self.value_heads // self.key_heads, dim=2) for x in (q, k))
        return q, k, v.reshape(b, s, self.value_heads, c.value_head_dim)

    def _rule(self, conv_out, g, beta, state=None, recurrent=False):
        q, k, v = self._heads(conv_out)
        if recurrent:
            return recurrent_gated_delta_rule(q, k, v, g, beta, state)
        if self.config.kernel == "fla":
            return fla_gated_delta_rule(q, k, v, g, beta, state)
        return chunked_gated_delta_rule(q, k, v, g, beta, state, self.config.chunk_size)

    def _decay(self, a: torch.Tensor, dt_bias: torch.Tensor, A_log: torch.Tensor) -> torch.Tensor:
        """g = -exp(A_log) softplus(a + dt_bias) in fp32."""
        return -A_log.float().exp() * F.softplus(a.float() + dt_bias.float())

    def _between_projections(self, fn, *args):
        """fn(*args): what lies between the input and output projections, recomputed in backward
        under --recompute-modules linear_attn."""
        if self.recompute_mixer and self.training and torch.is_grad_enabled():
            return recompute(fn, self.tracker, *args)
        return fn(*args)


class GatedDeltaNet(DeltaRuleMixer):
    """Qwen3-Next / Qwen3.5's Gated DeltaNet (parameter names: Megatron-Core's)."""

    def __init__(self, cfg, ctx, layer_number: int, core_attention=None, config: Optional[GatedDeltaNetConfig] = None):
        super().__init__()
        c = config or GatedDeltaNetConfig.from_model(cfg)
        self._setup(cfg, ctx, c)
        self.layer_number = layer_number
        dims, dt, hv = ctx.dims, ctx.params_dtype, c.num_value_heads
        segments = [c.key_dim, c.key_dim, c.value_dim, c.value_dim, hv, hv]
        self.in_proj = ColumnParallelLinear(cfg.hidden_size, sum(segments), dims, bias=c.bias, segments=segments,
                                            sequence_parallel=self.sp, dtype=dt, gemm=ctx.gemm)
        self.dt_bias = _head_param(hv, dims, dt, "ones")
        self.out_norm = GatedRMSNorm(c.value_head_dim, c.norm_epsilon, F.silu, dims, dt)
        self.out_proj = RowParallelLinear(c.value_dim, cfg.hidden_size, dims, bias=c.bias, sequence_parallel=self.sp,
                                          dtype=dt, gemm=ctx.gemm)

    def forward(self, x: torch.Tensor, rope=None, packed: Optional[PackedSeq] = None) -> torch.Tensor:
        mixed = self.in_proj(x).transpose(0, 1)  # [b, s, local features]
        o = self._between_projections(self._inner, mixed, packed)
        return self.out_proj(o.transpose(0, 1))

    def _inner(self, mixed, packed):
        """[b, s, local in_proj features] -> the normed, gated output [b, s, local value channels]."""
        c, tp = self.config, self.dims.tp
        b, s = mixed.shape[:2]
        qkv, z, beta, a = mixed.split([(2 * c.key_dim + c.value_dim) // tp, c.value_dim // tp,
                                       self.value_heads, self.value_heads], dim=-1)
        o = self._mix(qkv, self._decay(a, self.dt_bias, self.A_log), beta.float().sigmoid(), packed)
        return self.out_norm(o, z.reshape(b, s, self.value_heads, c.value_head_dim)).reshape(b, s, -1)

    @classmethod
    def counts(cls, cfg, mb: MicroBatch, window=None) -> Counts:
        return mixer_counts(GatedDeltaNetConfig.from_model(cfg), cfg.hidden_size, mb)


class KimiDeltaAttention(DeltaRuleMixer):
    """Kimi Linear's KDA (parameter names: Hugging Face's kimi_linear)."""

    def __init__(self, cfg, ctx, layer_number: int, core_attention=None, config: Optional[GatedDeltaNetConfig] = None):
        super().__init__()
        c = config or GatedDeltaNetConfig.from_model(cfg)
        assert c.per_channel_decay and c.num_key_heads == c.num_value_heads and c.key_head_dim == c.value_head_dim
        self._setup(cfg, ctx, c)
        self.layer_number = layer_number
        dims, dt, h, d, width = ctx.dims, ctx.params_dtype, cfg.hidden_size, c.key_head_dim, c.key_dim

        def column(out, replicas=1):
            return ColumnParallelLinear(h, out, dims, bias=False, sequence_parallel=self.sp, replicas=replicas,
                                        dtype=dt, gemm=ctx.gemm)
        self.q_proj, self.k_proj, self.v_proj = column(width), column(width), column(width)
        self.f_a_proj, self.g_a_proj = column(d, replicas=dims.tp), column(d, replicas=dims.tp)
        self.b_proj = column(c.num_value_heads)
        # Applied to the replicated low-rank latents on each rank (no TP region of their own).
        self.f_b_proj = ColumnParallelLinear(d, width, dims, bias=False, dtype=dt, gemm=ctx.gemm)
        self.g_b_proj = ColumnParallelLinear(d, width, dims, bias=False, dtype=dt, gemm=ctx.gemm)
        self.dt_bias = _head_param(width, dims, dt, "ones")
        self.out_norm = GatedRMSNorm(d, c.norm_epsilon, torch.sigmoid, dims, dt)
        self.out_proj = RowParallelLinear(width, h, dims, bias=c.bias, sequence_parallel=self.sp, dtype=dt,
                                          gemm=ctx.gemm)

    def _local(self, layer: ColumnParallelLinear, x: torch.Tensor) -> torch.Tensor:
        weight, bias = layer()
        return linear(x, weight, bias, self.gemm)

    def forward(self, x: torch.Tensor, rope=None, packed: Optional[PackedSeq] = None) -> torch.Tensor:
        projected = (t.transpose(0, 1) for t in ColumnParallelLinear.shared_input(
            x, self.q_proj, self.k_proj, self.v_proj, self.f_a_proj, self.g_a_proj, self.b_proj))
        o = self._between_projections(self._inner, *projected, packed)
        return self.out_proj(o.transpose(0, 1))

    def _inner(self, q, k, v, f_lat, g_lat, beta, packed):
        """The projections' outputs [b, s, ...] -> the normed, gated output [b, s, local value channels]."""
        b, s = q.shape[:2]
        heads = (b, s, self.value_heads, self.config.key_head_dim)
        g = self._decay(self._local(self.f_b_proj, f_lat).view(heads),
                        self.dt_bias.view(self.value_heads, -1), self.A_log.view(-1, 1))
        o = self._mix(torch.cat([q, k, v], dim=-1), g, beta.float().sigmoid(), packed)
        return self.out_norm(o, self._local(self.g_b_proj, g_lat).view(heads)).reshape(b, s, -1)

    @classmethod
    def counts(cls, cfg, mb: MicroBatch, window=None) -> Counts:
        return mixer_counts(GatedDeltaNetConfig.from_model(cfg), cfg.hidden_size, mb)


def mixer_counts(c: GatedDeltaNetConfig, h: int, mb: MicroBatch) -> Counts:
    """Parameters and forward FLOPs per token of either mixer. The rule, per token and value head:
    the state update and read (about 6 dk dv) plus the chunk's pair scores and triangular solve
    (about 2 C (dk + dv)); linear in the sequence. Kept activations: the projections' outputs,
    the conv outputs and the norm's input per token (an estimate; a rank holds 1/tp of the heads)."""
    qk, v, hv = c.key_dim, c.value_dim, c.num_value_heads
    if c.per_channel_decay:
        d = c.key_head_dim
        proj = h * (3 * qk + 2 * d + hv) + 2 * d * qk + v * h
        vectors = qk + hv
    else:
        proj = h * (2 * qk + 2 * v + 2 * hv) + v * h
        vectors = 2 * hv
    n = proj + sum(c.conv_segments) * c.conv_kernel + vectors + c.value_head_dim
    if c.bias:  # the output projection's; GDN's fused input projection has one too (KDA's have none, as HF's)
        n += h + (0 if c.per_channel_decay else 2 * qk + 2 * v + 2 * hv)
    rule = hv * (6 * c.key_head_dim * c.value_head_dim + 2 * c.chunk_size * (c.key_head_dim + c.value_head_dim))
    kept = mb.a * (2 * (2 * qk + 2 * v) + v) // max(1, mb.tp)
    return weights(n, act_bytes=kept * mb.tokens) + Counts(flops=rule, core_flops=rule)
