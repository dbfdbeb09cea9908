"""Mamba-2's state-space duality (SSD) scan in plain torch, fp32 state.

Per head h the recurrence over tokens t is

    S_t = exp(dt_t A_h) S_{t-1} + dt_t x_t B_t^T        (S: [head_dim p, state_dim n])
    y_t = S_t C_t

with dt_t > 0 (already through softplus), A_h < 0, and B, C shared by the heads of a group. A
position with `reset` set starts a new document: the state it receives is dropped (packed
sequences; the depthwise conv is reset separately by the mixer).

The recurrence is affine in the incoming state: over a span, state_out = M state_in + U with M a
scalar per head (the product of the decays, 0 across a reset), and every output likewise, y =
Y0 + Cd state_in. `SpanSummary` holds (M, U, Y0, Cd); `compose` chains two spans, `apply` feeds
a state in. The chunked form computes every chunk's summary at once (quadratic within a chunk, as
attention) and chains them over the chunks; context parallelism can chain the ranks' summaries the
same way. `ssd_step` is the per-token recurrence for decoding.

Shapes: x [b, s, H, p], dt [b, s, H], A [H], B and C [b, s, G, n], reset [b, s] bool, state
[b, H, p, n]. Everything is computed in fp32; outputs are fp32.
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Tuple

import torch
import torch.nn.functional as F


class SpanSummary(NamedTuple):
    """A span as an affine map of its incoming state: state_out = M state_in + U, y = Y0 + Cd state_in."""
    M: torch.Tensor  # [b, H] decay of the incoming state over the whole span
    U: torch.Tensor  # [b, H, p, n] the outgoing state from a zero incoming state
    Y0: torch.Tensor  # [b, s, H, p] the outputs from a zero incoming state
    Cd: torch.Tensor  # [b, s, H, n] C_t decayed from the span's start (0 past a reset)


def _per_head(t: torch.Tensor, heads: int) -> torch.Tensor:
    """B or C [..., G, n] -> [..., H, n]: each group serves heads / G consecutive heads."""
    return t.float().repeat_interleave(heads // t.shape[-2], dim=-2)


def _segments(reset: Optional[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    """[b, s] document index within the span: 0 until the first reset, +1 at each."""
    if reset is None:
        return torch.zeros(like.shape[:2], dtype=torch.long, device=like.device)
    return torch.cumsum(reset.long(), dim=1)


def _chunk(t: torch.Tensor, size: int) -> torch.Tensor:
    """[b, s, ...] -> [b, s / size, size, ...] (s a multiple of size)."""
    return t.reshape(t.shape[0], t.shape[1] // size, size, *t.shape[2:])


def _chunk_summaries(x, dt, A, B, C, seg, size: int) -> SpanSummary:
    """Every chunk's summary at once: fields carry an extra chunk dimension after b."""
    heads = x.shape[2]
    xs = _chunk(x.float() * dt.unsqueeze(-1), size)  # dt_t x_t  [b, c, L, H, p]
    Bh, Ch = _chunk(_per_head(B, heads), size), _chunk(_per_head(C, heads), size)  # [b, c, L, H, n]
    seg = _chunk(seg, size)  # [b, c, L]
    cum = torch.cumsum(_chunk(dt * A.float(), size), dim=2)  # log decay from the chunk start  [b, c, L, H]
    # Within the chunk: token l sees token s <= l decayed by exp(cum_l - cum_s), in the same document.
    causal = torch.ones(size, size, dtype=torch.bool, device=x.device).tril()
    seen = causal & (seg.unsqueeze(3) == seg.unsqueeze(2))  # [b, c, L(l), L(s)]
    log_w = (cum.unsqueeze(3) - cum.unsqueeze(2)).masked_fill(~seen.unsqueeze(-1), float("-inf"))
    scores = torch.einsum("bclhn,bcshn->bclsh", Ch, Bh) * torch.exp(log_w)
    Y0 = torch.einsum("bclsh,bcshp->bclhp", scores, xs)
    # The chunk's state: each token decayed to the chunk's end, if in the last token's document.
    to_end = torch.exp(cum[:, :, -1:] - cum) * (seg == seg[:, :, -1:]).unsqueeze(-1)  # [b, c, L, H]
    U = torch.einsum("bclh,bclhn,bclhp->bchpn", to_end, Bh, xs)
    # The incoming state reaches token l if no reset lies between the chunk's start and l.
    open_ = (seg == _previous(seg)).unsqueeze(-1)  # [b, c, L, 1]
    Cd = Ch * (torch.exp(cum) * open_).unsqueeze(-1)
    M = torch.exp(cum[:, :, -1]) * open_[:, :, -1]
    return SpanSummary(M, U, Y0, Cd)


def _previous(seg: torch.Tensor) -> torch.Tensor:
    """[b, c, 1] the document of the token before each chunk's first (0 before the span): the
    incoming state's."""
    return torch.cat([torch.zeros_like(seg[:, :1, -1:]), seg[:, :-1, -1:]], dim=1)


def apply(summary: SpanSummary, state: Optional[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
    """(outputs [b, s, H, p], outgoing state) of a span given its incoming state (None: zero)."""
    if state is None:
        return summary.Y0, summary.U
    state = state.float()
    y = summary.Y0 + torch.einsum("bshn,bhpn->bshp", summary.Cd, state)
    return y, summary.M[..., None, None] * state + summary.U


def compose(first: SpanSummary, second: SpanSummary) -> SpanSummary:
    """The summary of `first` followed by `second`."""
    y2, U = apply(second, first.U)
    return SpanSummary(first.M * second.M, U, torch.cat([first.Y0, y2], dim=1),
                       torch.cat([first.Cd, second.Cd * first.M[:, None, :, None]], dim=1))


def _padded(t: Optional[torch.Tensor], pad: int) -> Optional[torch.Tensor]:
    if t is None or pad == 0:
        return t
    return F.pad(t, (0, 0) * (t.dim() - 2) + (0, pad))


def ssd_summary(x, dt, A, B, C, chunk_size: int, reset: Optional[torch.Tensor] = None) -> SpanSummary:
    """The affine summary of a whole span, computed chunk by chunk. A span shorter than a multiple of
    `chunk_size` is padded with dt = 0 (identity steps), which changes nothing."""
    s = x.shape[1]
    pad = (-s) % chunk_size
    seg = _padded(_segments(reset, x).unsqueeze(-1), pad).squeeze(-1)
    if pad:
        seg[:, s:] = seg[:, s - 1:s]  # padding continues the last document
    chunks = _chunk_summaries(_padded(x, pad), _padded(dt.float(), pad), A, _padded(B, pad), _padded(C, pad),
                              seg, chunk_size)
    # Chain the chunks: each one's incoming state (from a zero state before the span) and decay since
    # the span's start; then every output at once.
    state, decay = torch.zeros_like(chunks.U[:, 0]), torch.ones_like(chunks.M[:, 0])
    states, decays = [], []
    for c in range(chunks.M.shape[1]):
        states.append(state)
        decays.append(decay)
        state, decay = chunks.M[:, c, :, None, None] * state + chunks.U[:, c], chunks.M[:, c] * decay
    incoming, since_start = torch.stack(states, dim=1), torch.stack(decays, dim=1)  # [b, c, H, p, n], [b, c, H]
    Y0 = chunks.Y0 + torch.einsum("bclhn,bchpn->bclhp", chunks.Cd, incoming)
    Cd = chunks.Cd * since_start[:, :, None, :, None]
    b = x.shape[0]
    return SpanSummary(decay, state, Y0.reshape(b, -1, *Y0.shape[3:])[:, :s], Cd.reshape(b, -1, *Cd.shape[3:])[:, :s])


def ssd_chunked(x, dt, A, B, C, chunk_size: int, initial_state: Optional[torch.Tensor] = None,
                reset: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """(y [b, s, H, p], final state [b, H, p, n]) of the recurrence from `initial_state` (None: zero)."""
    return apply(ssd_summary(x, dt, A, B, C, chunk_size, reset), initial_state)


def ssd_step(state: torch.Tensor, x, dt, A, B, C) -> Tuple[torch.Tensor, torch.Tensor]:
    """One token of the recurrence: x [b, H, p], dt [b, H], B and C [b, G, n]; state [b, H, p, n]
    (fp32). Returns (y [b, H, p], the new state)."""
    heads = x.shape[1]
    Bh, Ch = _per_head(B, heads), _per_head(C, heads)
    dt = dt.float()
    state = torch.exp(dt * A.float())[..., None, None] * state.float() \
        + torch.einsum("bh,bhp,bhn->bhpn", dt, x.float(), Bh)
    return torch.einsum("bhpn,bhn->bhp", state, Ch), state
