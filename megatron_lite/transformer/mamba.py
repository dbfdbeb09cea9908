"""The Mamba-2 mixer (Nemotron-H; Megatron-Core's MambaMixer), a module of the self-attention slot.

Per token: in_proj(x) -> [z | x | B | C | dt]; a depthwise causal conv1d over [x | B | C] with SiLU;
dt = clamp(softplus(dt + dt_bias)); A = -exp(A_log); the SSD scan (ssd.py) with the D skip,
y = scan(x, dt, A, B, C) + D x; then a gated RMSNorm over each of the n_groups channel groups,
norm(y * silu(z)); out_proj. The parameter names are Megatron-Core's and Hugging Face's (in_proj,
conv1d, dt_bias, A_log, D, norm, out_proj), so conversion maps them one to one.

Tensor parallelism (Megatron's rule: heads and groups divisible by TP): each rank holds its share of
the heads and of the groups; in_proj is column-parallel with its five segments split separately,
the conv channels, dt_bias, A_log, D and the norm follow their heads / groups, out_proj is
row-parallel. Under sequence parallelism in_proj gathers the sequence (the scan needs all of it).

Packed documents: the conv and the scan's state restart at each document boundary. --mamba-impl
mamba_ssm runs training's conv and scan through mamba-ssm / causal-conv1d (mamba_kernels.py).
Generation keeps a fixed-size state per sequence (the conv's last kernel - 1 inputs and the SSM
state), not a per-token cache: `cache_entry()` says so with a `RecurrentState`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..errors import ConfigError
from ..parallel.random import recompute
from ..parallel.sharding import ShardSpec, set_spec, tp_split
from ..parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from .core_attention import PackedSeq
from . import mamba_kernels
from .counts import Counts, MicroBatch, weights
from .spec import RecurrentState
from .ssd import ssd_chunked, ssd_step


@dataclass(frozen=True)
class MambaConfig:
    """The knobs of the Mamba-2 mixer (Megatron's flag names where it has them)."""
    hidden_size: int
    num_heads: int  # --mamba-num-heads (None there: 2 h / head_dim, Megatron's expand = 2)
    head_dim: int  # --mamba-head-dim
    state_dim: int  # --mamba-state-dim
    num_groups: int  # --mamba-num-groups: B and C are shared by the heads of a group
    conv_kernel: int = 4
    chunk_size: int = 128  # --mamba-chunk-size: tokens per chunk of the SSD scan
    time_step_min: float = 0.0  # dt is clamped to [time_step_min, time_step_max] after softplus
    time_step_max: float = math.inf
    norm_eps: float = 1e-5
    bias: bool = False  # in_proj / out_proj biases
    conv_bias: bool = True
    impl: str = "torch"  # --mamba-impl: torch, or mamba_ssm's kernels for training (mamba_kernels.py)

    @classmethod
    def from_model(cls, cfg) -> "MambaConfig":
        heads = cfg.mamba_num_heads or 2 * cfg.hidden_size // cfg.mamba_head_dim
        return cls(cfg.hidden_size, heads, cfg.mamba_head_dim, cfg.mamba_state_dim, cfg.mamba_num_groups,
                   chunk_size=cfg.mamba_chunk_size, time_step_min=cfg.mamba_time_step_min, norm_eps=cfg.norm_epsilon,
                   impl=cfg.mamba_impl)

    @property
    def inner(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def conv_channels(self) -> int:
        """[x | B | C], what the conv runs over."""
        return self.inner + 2 * self.num_groups * self.state_dim

    def check(self, tp: int) -> None:
        """One line per problem, before anything is built."""
        for name in ("num_heads", "head_dim", "state_dim", "num_groups", "chunk_size"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"--mamba-{name.replace('_', '-')} ({getattr(self, name)}) must be positive")
        if self.num_heads % self.num_groups:
            raise ConfigError(f"--mamba-num-heads ({self.num_heads}) must be divisible by --mamba-num-groups "
                              f"({self.num_groups})")
        if self.num_heads % tp or self.num_groups % tp:
            raise ConfigError(f"Mamba heads ({self.num_heads}) and groups ({self.num_groups}) must be divisible by "
                              f"the tensor-parallel size ({tp}): change --mamba-num-heads / --mamba-num-groups or TP")
        if self.impl == "mamba_ssm":
            mamba_kernels.check_available()


def _tp_param(shape, dims, init: str, dtype, segments=None) -> nn.Parameter:
    """A parameter split over TP along dim 0 (by `segments` when given)."""
    split = tp_split(dims, 0, shape[0], segments)
    p = nn.Parameter(torch.empty((shape[0] // split.shards,) + tuple(shape[1:]), dtype=dtype))
    return set_spec(p, ShardSpec(tuple(shape), (split,), init=init))


class GatedRMSNorm(nn.Module):
    """RMSNorm of y * silu(z) over each group of channels (Mamba-2's norm_before_gate=False), in fp32.
    Its weight follows the groups over TP (whole groups per rank: no collective)."""

    def __init__(self, width: int, group_size: int, eps: float, dims, dtype):
        super().__init__()
        self.group_size, self.eps = group_size, eps
        self.weight = _tp_param((width,), dims, "ones", dtype)

    def forward(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        h = y.float() * F.silu(z.float())
        g = h.unflatten(-1, (-1, self.group_size))
        g = g * torch.rsqrt(g.square().mean(-1, keepdim=True) + self.eps)
        return self.weight * g.flatten(-2).to(y.dtype)


class DepthwiseConv(nn.Module):
    """A causal depthwise conv1d over [b, s, channels] (weight [channels, 1, kernel], as nn.Conv1d)
    whose window stops at document boundaries."""

    def __init__(self, cfg: MambaConfig, dims, dtype):
        super().__init__()
        g = cfg.num_groups * cfg.state_dim
        segments = [cfg.inner, g, g]
        self.kernel = cfg.conv_kernel
        self.weight = _tp_param((cfg.conv_channels, 1, cfg.conv_kernel), dims, "normal", dtype, segments)
        self.bias = _tp_param((cfg.conv_channels,), dims, "zeros", dtype, segments) if cfg.conv_bias else None

    def forward(self, x: torch.Tensor, docs: Optional[torch.Tensor], state: Optional[torch.Tensor] = None):
        """x [b, s, c]; docs [b, s] document ids or None; state [b, kernel - 1, c]: the inputs before
        x (None: zeros). Returns (silu(conv(x)) [b, s, c], the last kernel - 1 inputs)."""
        k, s = self.kernel, x.shape[1]
        before = state.to(x.dtype) if state is not None else x.new_zeros(x.shape[0], k - 1, x.shape[2])
        inp = torch.cat([before, x], dim=1)
        if docs is not None:  # the state's inputs count as the first token's document
            docs = torch.cat([docs[:, :1].expand(-1, k - 1), docs], dim=1)
        w = self.weight[:, 0]  # [c, k]: w[:, k - 1] weighs the current token
        out = self.bias.expand_as(x) if self.bias is not None else torch.zeros_like(x)
        for back in range(k):  # token t - back
            tap = inp[:, k - 1 - back:k - 1 - back + s] * w[:, k - 1 - back]
            if docs is not None and back:
                tap = tap * (docs[:, k - 1 - back:k - 1 - back + s] == docs[:, k - 1:]).unsqueeze(-1)
            out = out + tap
        last = inp[:, -(k - 1):]
        if docs is not None:  # a new document's state starts clean
            last = last * (docs[:, -(k - 1):] == docs[:, -1:]).unsqueeze(-1)
        return F.silu(out), last


class MambaMixer(nn.Module):
    # Generation only: returns (conv state, SSM state, tokens cached before) for this layer, updated in
    # place. Set by KVCache.attached while the model decodes.
    cache_update: Optional[Callable[..., Tuple]] = None

    def __init__(self, cfg, ctx, layer_number: int, core_attention=None, config: Optional[MambaConfig] = None):
        super().__init__()
        c = self.config = config or MambaConfig.from_model(cfg)
        dims, sp, dt, gemm = ctx.dims, ctx.sequence_parallel, ctx.params_dtype, ctx.gemm
        tp = dims.tp
        c.check(tp)
        self.layer_number, self.tracker = layer_number, ctx.tracker
        self.heads, self.groups, self.inner = c.num_heads // tp, c.num_groups // tp, c.inner // tp
        self.recompute_scan = ctx.recomputes("mamba")
        g = c.num_groups * c.state_dim
        self.in_proj = ColumnParallelLinear(c.hidden_size, 2 * c.inner + 2 * g + c.num_heads, dims, bias=c.bias,
                                            sequence_parallel=sp, segments=[c.inner, c.inner, g, g, c.num_heads],
                                            dtype=dt, gemm=gemm)
        self.conv1d = DepthwiseConv(c, dims, dt)
        self.dt_bias = _tp_param((c.num_heads,), dims, "ones", dt)
        self.A_log = _tp_param((c.num_heads,), dims, "log_arange", dt)  # A = -(1, 2, ..., heads)
        self.D = _tp_param((c.num_heads,), dims, "ones", dt)
        self.norm = GatedRMSNorm(c.inner, c.inner // c.num_groups, c.norm_eps, dims, dt)
        self.out_proj = RowParallelLinear(c.inner, c.hidden_size, dims, bias=c.bias, sequence_parallel=sp, dtype=dt,
                                          gemm=gemm)

    def cache_entry(self) -> RecurrentState:
        """What generation keeps per sequence on each rank: the conv's last kernel - 1 inputs over
        this rank's channels, and the SSM state of its heads."""
        c = self.config
        conv = self.inner + 2 * self.groups * c.state_dim
        return RecurrentState(((c.conv_kernel - 1, conv), (self.heads, c.head_dim, c.state_dim)))

    def forward(self, x: torch.Tensor, rope=None, packed: Optional[PackedSeq] = None) -> torch.Tensor:
        s = x.shape[0] * (self.in_proj.dims.tp if self.in_proj.sequence_parallel else 1)  # the whole sequence
        zxbcdt = self.in_proj(x).transpose(0, 1)  # [b, s, ...]: the whole sequence, this rank's channels
        if self.cache_update is not None:
            conv_state, ssm_state, offset = self.cache_update()
            docs = packed.for_queries(s, offset, 0) if packed is not None else None
            y = self._mix(zxbcdt, docs, conv_state, ssm_state)
        elif self.recompute_scan and self.training and torch.is_grad_enabled():
            y = recompute(lambda t: self._mix(t, packed.document_ids if packed is not None else None), self.tracker,
                          zxbcdt)
        else:
            y = self._mix(zxbcdt, packed.document_ids if packed is not None else None)
        return self.out_proj(y.transpose(0, 1))

    def _mix(self, zxbcdt, docs, conv_state=None, ssm_state=None) -> torch.Tensor:
        """[b, s, in_proj out / tp] -> the gated norm's output [b, s, inner / tp]; with a cache, its
        states are read and updated in place."""
        c = self.config
        s = zxbcdt.shape[1]
        n = self.groups * c.state_dim
        z, xbc, dt = zxbcdt.split([self.inner, self.inner + 2 * n, self.heads], dim=-1)
        kernels = c.impl == "mamba_ssm" and ssm_state is None  # decoding stays on the torch path
        if kernels:
            xbc = mamba_kernels.conv(xbc, self.conv1d.weight, self.conv1d.bias, docs)
        else:
            xbc, last = self.conv1d(xbc, docs, conv_state)
        x, B, C = xbc.split([self.inner, n, n], dim=-1)
        x = x.unflatten(-1, (self.heads, c.head_dim))
        B, C = B.unflatten(-1, (self.groups, c.state_dim)), C.unflatten(-1, (self.groups, c.state_dim))
        dt = F.softplus(dt.float() + self.dt_bias.float()).clamp(c.time_step_min, c.time_step_max)
        A = -torch.exp(self.A_log.float())
        if kernels:
            y, state = mamba_kernels.scan(x, dt, A, B, C, c.chunk_size, docs)
        elif ssm_state is not None and s == 1:  # decoding: the recurrent form
            y, state = ssd_step(ssm_state, x[:, 0], dt[:, 0], A, B[:, 0], C[:, 0])
            y = y.unsqueeze(1)
        else:
            reset = None
            if docs is not None:
                reset = torch.zeros_like(docs, dtype=torch.bool)
                reset[:, 1:] = docs[:, 1:] != docs[:, :-1]
            y, state = ssd_chunked(x, dt, A, B, C, c.chunk_size, ssm_state, reset)
        if ssm_state is not None:
            ssm_state.copy_(state)
            conv_state.copy_(last)
        y = y + self.D.float()[:, None] * x.float()
        return self.norm(y.flatten(-2).to(zxbcdt.dtype), z)

    @classmethod
    def counts(cls, cfg, mb: MicroBatch, window=None) -> Counts:
        """The projections, conv, dt_bias / A_log / D and the norm. The scan's FLOPs per token and
        head, chunked: the chunk's scores C.B and their use on x (2 chunk (n + p)), the chunk state and
        its readout (4 p n). Kept per token on each rank: in_proj's output, the conv's output, the
        scan's fp32 output and out_proj's input (--recompute-modules mamba: the ends only)."""
        c = MambaConfig.from_model(cfg)
        h, g = c.hidden_size, c.num_groups * c.state_dim
        proj = h * (2 * c.inner + 2 * g + c.num_heads) + c.inner * h
        proj += (2 * c.inner + 2 * g + c.num_heads + h) if c.bias else 0
        n = proj + c.conv_channels * (c.conv_kernel + (1 if c.conv_bias else 0)) + 3 * c.num_heads + c.inner
        scan = 2 * c.num_heads * (c.chunk_size * (c.state_dim + c.head_dim) + 2 * c.head_dim * c.state_dim)
        proj_out, tp = 2 * c.inner + 2 * g + c.num_heads, mb.tp
        kept = mb.a * (proj_out + c.inner) // tp  # in_proj's output, out_proj's input
        if not mb.recomputes("mamba"):  # the conv's output and the scan's fp32 output
            kept += (mb.a * c.conv_channels + 4 * c.inner) // tp
        return weights(n, act_bytes=kept * mb.tokens) + Counts(flops=scan, core_flops=scan)
