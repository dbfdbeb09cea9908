"""Block attention that also returns the log-sum-exp: the kernel context parallelism composes.

`attention_block` computes softmax(scale * q k^T) v for one block of keys and the log-sum-exp
(LSE) of every query row's scores. Partial results over disjoint key sets combine exactly with
`merge_partials`; a block's gradients can be recomputed later from the FINAL (merged) LSE and
delta = rowsum(dout * out) of the final output (`attention_block_backward`, the flash-attention
backward: dS = P * (dP - delta)). Ring attention is built from these three pieces.

Visibility is a function of absolute token indices, not of positions inside the block: key j is
visible to query i iff
    causal:     k_index[j] <= q_index[i]
    window w:   q_index[i] - k_index[j] < w      (|q_index[i] - k_index[j]| < w when not causal)
    documents:  q_doc[b, i] == k_doc[b, j]       (packed sequences)
so a block may hold any subset of the sequence, in any order (e.g. zigzag chunks).

Layouts: q [b, sq, hq, d]; k, v [b, sk, hkv, d] with hq a multiple of hkv (query head h uses
key/value head h // (hq // hkv), as repeat_interleave would); out [b, sq, hq, d]; lse [b, hq, sq].
Scores, softmax and accumulation run in float32 (float64 for float64 inputs): the "accumulation
dtype", which is also the dtype of lse and of the backward helper's gradients. Rows with no
visible key give out 0 and lse -inf, and zero gradients (never NaN).

This is the pure-PyTorch reference path and runs on any device. It materializes the
[b, hq, sq, sk] scores of one block, which is fine for the blocks of CP tests and small runs; a
fused CUDA kernel returning the LSE can replace the inside of `_block_forward` /
`attention_block_backward` without changing this interface.
"""
from __future__ import annotations

import math
from typing import Optional, Tuple

import torch

NEG_INF = float("-inf")


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def visibility_mask(q_index: torch.Tensor, k_index: torch.Tensor, q_doc: Optional[torch.Tensor] = None,
                    k_doc: Optional[torch.Tensor] = None, *, causal: bool = True,
                    window: Optional[int] = None) -> Optional[torch.Tensor]:
    """Bool [1 or b, sq, sk], True where query i may attend key j; None when every key is visible."""
    if (q_doc is None) != (k_doc is None):
        raise ValueError("pass both q_doc and k_doc (document ids of queries and keys), or neither")
    mask = None
    if causal or window is not None:
        diff = q_index[:, None] - k_index[None, :]
        if causal:
            mask = diff >= 0
        if window is not None:
            near = diff < window if causal else diff.abs() < window
            mask = near if mask is None else mask & near
        mask = mask[None]
    if q_doc is not None:
        same_doc = q_doc[:, :, None] == k_doc[:, None, :]
        mask = same_doc if mask is None else mask & same_doc
    return mask


def _check_inputs(q, k, v, q_index, k_index, q_doc, k_doc, window):
    if q.dim() != 4 or k.dim() != 4 or k.shape != v.shape:
        raise ValueError(f"expected q [b, sq, hq, d] and k, v [b, sk, hkv, d]; got q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}, v {tuple(v.shape)}")
    b, sq, hq, d = q.shape
    if k.shape[0] != b or k.shape[3] != d or hq % k.shape[2]:
        raise ValueError(f"k/v {tuple(k.shape)} do not match q {tuple(q.shape)}: same batch and head dim, "
                         "and the query heads must be a multiple of the key/value heads")
    if q_index.shape != (sq,) or k_index.shape != (k.shape[1],):
        raise ValueError(f"q_index {tuple(q_index.shape)} / k_index {tuple(k_index.shape)} must be 1-D with "
                         f"one absolute token index per query ({sq}) / key ({k.shape[1]})")
    if q_doc is not None and (q_doc.shape != (b, sq) or k_doc is None or k_doc.shape != (b, k.shape[1])):
        raise ValueError(f"q_doc / k_doc must be [b, sq] = {(b, sq)} / [b, sk] = {(b, k.shape[1])} document ids")
    if k.shape[1] == 0:
        raise ValueError("a key block needs at least one key (skip empty blocks instead)")
    if window is not None and window < 1:
        raise ValueError(f"window must be a positive number of tokens, got {window}")


def _grouped(x: torch.Tensor, hkv: int) -> torch.Tensor:
    """[b, s, hq, d] -> [b, hkv, rep * s, d]: the rep query heads of a K/V group stacked as rows,
    so one batched matmul per group serves all of them (GQA without repeating K/V)."""
    b, s, hq, d = x.shape
    return x.view(b, s, hkv, hq // hkv, d).permute(0, 2, 3, 1, 4).reshape(b, hkv, -1, d)


def _ungrouped(x: torch.Tensor, s: int) -> torch.Tensor:
    """Inverse of _grouped: [b, hkv, rep * s, d] -> [b, s, hq, d]."""
    b, hkv, rs, d = x.shape
    return x.view(b, hkv, rs // s, s, d).permute(0, 3, 1, 2, 4).reshape(b, s, -1, d)


def _masked_scores(qg, kg, mask, scale):
    """scale * q k^T as [b, hkv, rep * sq, sk], -inf where the key is not visible."""
    scores = torch.matmul(qg, kg.transpose(-1, -2)) * scale
    if mask is not None:
        b, hkv, rs, sk = scores.shape
        sq = mask.shape[1]
        rows = scores.view(b, hkv, rs // sq, sq, sk)
        scores = rows.masked_fill(~mask[:, None, None], NEG_INF).view(b, hkv, rs, sk)
    return scores


def dropout_keep_mask(shape, p: float, seed: int, device) -> torch.Tensor:
    """The dropout keep-mask of a block: a function of (shape, p, seed) only, so the backward
    (and a reference in a test) regenerates exactly the mask the forward used."""
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return torch.rand(shape, generator=gen, device=device) >= p


def _block_forward(q, k, v, mask, scale, dropout_p, dropout_seed):
    """(out, lse) in the accumulation dtype; out in the grouped layout [b, hkv, rep * sq, d]."""
    acc = accumulation_dtype(q.dtype)
    hkv = k.shape[2]
    qg, kg, vg = _grouped(q.to(acc), hkv), k.to(acc).transpose(1, 2), v.to(acc).transpose(1, 2)
    scores = _masked_scores(qg, kg, mask, scale)
    row_max = scores.amax(dim=-1, keepdim=True)
    # A row with no visible key has max -inf: shift it by 0 instead, so exp(-inf) = 0, not NaN.
    row_max = row_max.masked_fill(row_max == NEG_INF, 0.0)
    unnorm = torch.exp(scores - row_max)
    total = unnorm.sum(dim=-1, keepdim=True)
    lse = (row_max + torch.log(total)).squeeze(-1)  # log(0) = -inf for empty rows
    probs = unnorm / total.masked_fill(total == 0, 1.0)
    if dropout_p > 0:
        keep = dropout_keep_mask(probs.shape, dropout_p, dropout_seed, probs.device)
        probs = probs * keep / (1.0 - dropout_p)
    return torch.matmul(probs, vg), lse


def attention_block_backward(dout, q, k, v, lse, delta, *, q_index, k_index, q_doc=None, k_doc=None,
                             causal: bool = True, window: Optional[int] = None,
                             softmax_scale: Optional[float] = None, dropout_p: float = 0.0,
                             dropout_seed: Optional[int] = None):
    """Gradients (dq, dk, dv) of one key block, recomputed from the FINAL row statistics.

    lse [b, hq, sq]: log-sum-exp over ALL keys each query sees (the merged result, not this
    block's); delta [b, hq, sq] = rowsum(dout * out) of the final output (`softmax_delta`), minus
    any incoming gradient of the final lse. Then P = exp(S - lse) is this block's slice of the
    global softmax and dS = P * (dP - delta), so the per-block gradients of disjoint key blocks
    sum to the gradient of the whole attention. Returned in the accumulation dtype (dq [b, sq, hq, d],
    dk/dv [b, sk, hkv, d]) so callers can sum blocks without rounding."""
    acc = accumulation_dtype(q.dtype)
    b, sq, hq, d = q.shape
    hkv = k.shape[2]
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    mask = visibility_mask(q_index, k_index, q_doc, k_doc, causal=causal, window=window)
    qg, kg, vg = _grouped(q.to(acc), hkv), k.to(acc).transpose(1, 2), v.to(acc).transpose(1, 2)
    dog = _grouped(dout.to(acc), hkv)
    lse_g = lse.to(acc).reshape(b, hkv, -1, 1)
    # Rows with lse -inf see no key at all: use +inf so P = exp(-inf) = 0 there.
    probs = torch.exp(_masked_scores(qg, kg, mask, scale) - lse_g.masked_fill(lse_g == NEG_INF, float("inf")))
    dprobs = torch.matmul(dog, vg.transpose(-1, -2))
    if dropout_p > 0:
        keep = dropout_keep_mask(probs.shape, dropout_p, dropout_seed, probs.device) / (1.0 - dropout_p)
        dv = torch.matmul((probs * keep).transpose(-1, -2), dog)
        dprobs = dprobs * keep
    else:
        dv = torch.matmul(probs.transpose(-1, -2), dog)
    dscores = probs * (dprobs - delta.to(acc).reshape(b, hkv, -1, 1))
    dq = _ungrouped(torch.matmul(dscores, kg) * scale, sq)
    dk = (torch.matmul(dscores.transpose(-1, -2), qg) * scale).transpose(1, 2)
    return dq, dk, dv.transpose(1, 2)


def softmax_delta(dout: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """delta = rowsum(dout * out) as [b, hq, sq] in the accumulation dtype."""
    acc = accumulation_dtype(out.dtype)
    return (dout.to(acc) * out.to(acc)).sum(dim=-1).transpose(1, 2).contiguous()


class _AttentionBlock(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, q_index, k_index, q_doc, k_doc, causal, window, scale, dropout_p, dropout_seed,
                out_dtype):
        mask = visibility_mask(q_index, k_index, q_doc, k_doc, causal=causal, window=window)
        out, lse = _block_forward(q, k, v, mask, scale, dropout_p, dropout_seed)
        b, sq, hq, _ = q.shape
        out = _ungrouped(out, sq).to(out_dtype)
        lse = lse.reshape(b, hq, sq)
        # Saved: inputs, output and lse; the mask and probabilities are recomputed in backward.
        ctx.save_for_backward(q, k, v, q_index, k_index, q_doc, k_doc, out, lse)
        ctx.opts = dict(causal=causal, window=window, softmax_scale=scale, dropout_p=dropout_p,
                        dropout_seed=dropout_seed)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, q_index, k_index, q_doc, k_doc, out, lse = ctx.saved_tensors
        # d lse / dS = P, so a gradient on lse enters as -dlse in delta.
        delta = softmax_delta(dout, out) - dlse
        dq, dk, dv = attention_block_backward(dout, q, k, v, lse, delta, q_index=q_index, k_index=k_index,
                                              q_doc=q_doc, k_doc=k_doc, **ctx.opts)
        return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)) + (None,) * 10


def attention_block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, q_index: torch.Tensor,
                    k_index: torch.Tensor, q_doc: Optional[torch.Tensor] = None,
                    k_doc: Optional[torch.Tensor] = None, causal: bool = True, window: Optional[int] = None,
                    softmax_scale: Optional[float] = None, dropout_p: float = 0.0,
                    dropout_seed: Optional[int] = None,
                    out_dtype: Optional[torch.dtype] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Attention of queries q over one block of keys; returns (out [b, sq, hq, d], lse [b, hq, sq]).

    q_index [sq] / k_index [sk] (int64): absolute token index of each query / key row in the full
    sequence; q_doc [b, sq] / k_doc [b, sk]: document ids (both or neither). softmax_scale defaults
    to 1/sqrt(d). out is in `out_dtype` (default q.dtype); lse in the accumulation dtype.
    Differentiable in q, k, v through both outputs. With dropout_p > 0 the keep-mask comes from
    `dropout_seed` (drawn from the device's default generator when None, so an RNG tracker's
    fork decides it) and is regenerated in backward."""
    _check_inputs(q, k, v, q_index, k_index, q_doc, k_doc, window)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    if dropout_p > 0 and dropout_seed is None:
        dropout_seed = int(torch.randint(0, 2 ** 62, (1,), device=q.device).item())
    return _AttentionBlock.apply(q, k, v, q_index, k_index, q_doc, k_doc, causal, window, scale, dropout_p,
                                 dropout_seed, out_dtype or q.dtype)


def merge_partials(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
                   lse_b: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Combine attention over two disjoint key sets: out [b, s, h, d], lse [b, h, s] each.

    lse = logaddexp(lse_a, lse_b) = max + log1p(exp(min - max)); out = sum of the parts weighted
    by exp(lse_part - lse). Rows empty in one part take the other; rows empty in both stay
    (0, -inf). Computed in the dtype of the inputs: pass accumulation-dtype partials."""
    # logaddexp by hand: torch.logaddexp's gradient is NaN where both inputs are -inf.
    top = torch.maximum(lse_a, lse_b)
    empty = top == NEG_INF
    top = top.masked_fill(empty, 0.0)
    total = torch.exp(lse_a - top) + torch.exp(lse_b - top)
    lse = torch.where(empty, NEG_INF, top + torch.log(total.masked_fill(empty, 1.0)))
    shift = lse.masked_fill(empty, 0.0)  # weights exp(-inf - 0) = 0 in rows empty in both
    w_a = torch.exp(lse_a - shift).transpose(1, 2).unsqueeze(-1)
    w_b = torch.exp(lse_b - shift).transpose(1, 2).unsqueeze(-1)
    return out_a * w_a + out_b * w_b, lse


__all__ = ["attention_block", "attention_block_backward", "merge_partials", "softmax_delta",
           "visibility_mask", "dropout_keep_mask", "accumulation_dtype"]
