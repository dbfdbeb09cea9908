"""The gated delta rule (Gated DeltaNet; Kimi Delta Attention) in plain PyTorch, with fp32 state.

Per head, with a state S [dk, dv], per token t (q scaled by `scale`, k usually L2-normalised):
    S <- diag(exp(g_t)) S                       decay: one number per head (GDN) or per key channel (KDA)
    S <- S + beta_t k_t (v_t - S^T k_t)^T         the delta rule's correction towards v_t
    o_t = S^T q_t
`recurrent_gated_delta_rule` runs exactly that loop (decoding); `chunked_gated_delta_rule` is the
same function computed chunk by chunk (training): inside a chunk of C tokens the corrections solve
one unit lower-triangular system (the WY form), across chunks only the state is carried.

Every chunk, and so every span of chunks, is affine in its incoming state S_in:
    S_out = M S_in + U,      o_t = o0_t + a_t S_in
with M [dk, dk], U [dk, dv], a_t [dk] per token. `span_summary` returns (o0, a, M, U) of a span and
`compose` chains two summaries, so a context-parallel rank can reduce its whole shard to a pair of
size dk x (dk + dv) per head and exchange that instead of the sequence; `apply_summary` finishes a
span once its incoming state is known. The chunked forward is itself this chaining, chunk by chunk.

Layouts (those of flash-linear-attention and Hugging Face): q, k [b, s, h, dk]; v [b, s, h, dv];
g [b, s, h] (scalar decay) or [b, s, h, dk] (per-channel decay), in log space (<= 0); beta [b, s, h];
states [b, h, dk, dv]; outputs [b, s, h, dv] in v's dtype. Arithmetic runs in float32 (float64 for
float64 inputs). Memory of the plain path: per chunk C x C scores per head, times dk under a
per-channel decay (pick a smaller chunk for KDA).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import torch.nn.functional as F


@dataclass
class SpanSummary:
    """A span's outputs and final state as affine functions of its incoming state S_in [b, h, dk, dv]:
    out = out0 + out_map @ S_in, S_out = decay @ S_in + state."""
    out0: torch.Tensor  # [b, h, s, dv]: the outputs for S_in = 0
    out_map: torch.Tensor  # [b, h, s, dk]
    decay: torch.Tensor  # [b, h, dk, dk]: M
    state: torch.Tensor  # [b, h, dk, dv]: U, the final state for S_in = 0


def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _heads_first(q, k, v, g, beta, scale):
    """[b, h, s, ...] in the compute dtype, q scaled; g gains a channel axis of 1 when it is per head."""
    dt = _compute_dtype(v)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    q, k, v = (x.transpose(1, 2).to(dt) for x in (q, k, v))
    g = g.to(dt).unsqueeze(-1) if g.dim() == 3 else g.to(dt)
    return q * scale, k, v, g.transpose(1, 2), beta.transpose(1, 2).to(dt)


def _pair_scores(a: torch.Tensor, b: torch.Tensor, G: torch.Tensor, strict: bool) -> torch.Tensor:
    """sum_c a[t, c] b[i, c] exp(G[t, c] - G[i, c]) for i <= t (i < t when strict), else 0.
    a, b [..., C, dk]; G [..., C, 1] (one decay per head) or [..., C, dk]. Differences of the
    cumulative log decay are <= 0 on the kept pairs, so nothing overflows."""
    C = a.shape[-2]
    keep = torch.ones(C, C, dtype=torch.bool, device=a.device).tril(-1 if strict else 0)
    if G.shape[-1] == 1:
        diff = (G - G.transpose(-1, -2)).masked_fill(~keep, float("-inf"))
        return (a @ b.transpose(-1, -2)) * diff.exp()
    diff = (G.unsqueeze(-2) - G.unsqueeze(-3)).masked_fill(~keep[..., None], float("-inf"))  # [..., t, i, c]
    return torch.einsum("...tc,...ic,...tic->...ti", a, b, diff.exp())


def _chunk_summaries(q, k, v, g, beta) -> SpanSummary:
    """Each chunk's summary, batched over chunks: inputs [..., C, d] (g [..., C, 1 or dk], beta [..., C]).

    With G the cumulative log decay inside the chunk and Gamma = exp(G), the corrections
    u_t = beta_t (v_t - k_t^T D_t S_{t-1}) satisfy (I + A) u = beta (v - (k Gamma) S_in), A strictly
    lower triangular: u = U0 - W S_in. Then o = P u + (q Gamma) S_in with P the decayed q.k scores
    (i <= t), and S_out = diag(Gamma_C) S_in + Kd^T u with Kd_i = k_i exp(G_C - G_i)."""
    G = g.cumsum(-2)
    beta = beta.unsqueeze(-1)
    A = beta * _pair_scores(k, k, G, strict=True)
    eye = torch.eye(A.shape[-1], dtype=A.dtype, device=A.device)
    rhs = torch.cat([beta * v, beta * k * G.exp()], dim=-1)
    sol = torch.linalg.solve_triangular(eye + A, rhs, upper=False, unitriangular=True)
    u0, w = sol.split([v.shape[-1], k.shape[-1]], dim=-1)
    P = _pair_scores(q, k, G, strict=False)
    last = G[..., -1:, :]  # [..., 1, 1 or dk]
    kd = k * (last - G).exp()
    decay = torch.diag_embed(last.exp().squeeze(-2).expand(*k.shape[:-2], k.shape[-1])) - kd.transpose(-1, -2) @ w
    return SpanSummary(P @ u0, q * G.exp() - P @ w, decay, kd.transpose(-1, -2) @ u0)


def _chunked(q, k, v, g, beta, chunk_size: int) -> SpanSummary:
    """Per-chunk summaries [b, h, n, ...] of inputs [b, h, s, ...]; the tail is padded with tokens that
    leave the state as it is (k = 0, beta = 0, no decay)."""
    if chunk_size < 1:
        raise ValueError(f"chunk size must be positive, got {chunk_size}")
    s = q.shape[2]
    pad = -s % chunk_size
    if pad:
        q, k, v, g = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v, g))
        beta = F.pad(beta, (0, pad))
    n = (s + pad) // chunk_size

    def chunks(x):
        return x.reshape(*x.shape[:2], n, chunk_size, *x.shape[3:])
    return _chunk_summaries(*(chunks(x) for x in (q, k, v, g, beta)))


def _run_chunks(sums: SpanSummary, state: torch.Tensor, s: int):
    """Carry the state through the chunks in order: outputs [b, h, s, dv] and the final state."""
    outs = []
    for j in range(sums.decay.shape[2]):
        outs.append(sums.out0[:, :, j] + sums.out_map[:, :, j] @ state)
        state = sums.decay[:, :, j] @ state + sums.state[:, :, j]
    return torch.cat(outs, dim=2)[:, :, :s], state


def _zero_state(q, v, initial_state):
    b, h, _, dk = q.shape
    if initial_state is not None:
        return initial_state.to(v.dtype)
    return v.new_zeros(b, h, dk, v.shape[-1])


def chunked_gated_delta_rule(q, k, v, g, beta, initial_state: Optional[torch.Tensor] = None, chunk_size: int = 64,
                             scale: Optional[float] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """(outputs [b, s, h, dv] in v's dtype, final state [b, h, dk, dv] in the compute dtype)."""
    out_dtype, s = v.dtype, q.shape[1]
    q, k, v, g, beta = _heads_first(q, k, v, g, beta, scale)
    out, state = _run_chunks(_chunked(q, k, v, g, beta, chunk_size), _zero_state(q, v, initial_state), s)
    return out.transpose(1, 2).to(out_dtype), state


def recurrent_gated_delta_rule(q, k, v, g, beta, initial_state: Optional[torch.Tensor] = None,
                               scale: Optional[float] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """The per-token loop (decoding: usually one token); same arguments and results as the chunked form."""
    out_dtype = v.dtype
    q, k, v, g, beta = _heads_first(q, k, v, g, beta, scale)
    state = _zero_state(q, v, initial_state)
    outs = []
    for t in range(q.shape[2]):
        state = state * g[:, :, t].exp().unsqueeze(-1)
        correction = beta[:, :, t, None] * (v[:, :, t] - (k[:, :, t].unsqueeze(-2) @ state).squeeze(-2))
        state = state + k[:, :, t].unsqueeze(-1) * correction.unsqueeze(-2)
        outs.append((q[:, :, t].unsqueeze(-2) @ state).squeeze(-2))
    return torch.stack(outs, dim=1).to(out_dtype), state


def compose(first: SpanSummary, second: SpanSummary) -> SpanSummary:
    """The summary of running `first`, then `second` on first's final state."""
    return SpanSummary(torch.cat([first.out0, second.out0 + second.out_map @ first.state], dim=2),
                       torch.cat([first.out_map, second.out_map @ first.decay], dim=2),
                       second.decay @ first.decay, second.decay @ first.state + second.state)


def span_summary(q, k, v, g, beta, chunk_size: int = 64, scale: Optional[float] = None) -> SpanSummary:
    """The affine summary of a whole span (inputs as `chunked_gated_delta_rule`; tensors heads-first)."""
    s = q.shape[1]
    sums = _chunked(*_heads_first(q, k, v, g, beta, scale), chunk_size)
    total = None
    for j in range(sums.decay.shape[2]):
        piece = SpanSummary(sums.out0[:, :, j], sums.out_map[:, :, j], sums.decay[:, :, j], sums.state[:, :, j])
        total = piece if total is None else compose(total, piece)
    return SpanSummary(total.out0[:, :, :s], total.out_map[:, :, :s], total.decay, total.state)


def apply_summary(summary: SpanSummary, initial_state: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(outputs [b, s, h, dv], final state) of a span given its incoming state."""
    out = summary.out0 + summary.out_map @ initial_state
    return out.transpose(1, 2), summary.decay @ initial_state + summary.state
