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

Layouts: q [b, sq, hq, d]; k [b, sk, hkv, d]; v [b, sk, hkv, dv] (the value head size may differ, as in
MLA) with hq a multiple of hkv (query head h uses key/value head h // (hq // hkv), as repeat_interleave
would); out [b, sq, hq, dv]; lse [b, hq, sq].
Scores, softmax and accumulation run in float32 (float64 for float64 inputs): the "accumulation
dtype", which is also the dtype of lse and of the backward helper's gradients. Rows with no
visible key give out 0 and lse -inf, and zero gradients (never NaN).

Two paths behind one interface:
- fused: PyTorch's flash-attention kernels, which return the LSE and never materialize the
  scores. Used automatically when the visible pairs split into sub-blocks that are either fully
  visible or plain causal over one and the same run of consecutive indices (`_fused_blocks`):
  that is every causal or non-causal block without window, documents or dropout, whatever the
  index layout (zigzag chunks, all-gathered K/V), as long as it cuts into at most
  _MAX_FUSED_BLOCKS sub-blocks. CPU: `_scaled_dot_product_flash_attention_for_cpu` in the
  accumulation dtype (GQA native). CUDA (opt-in, `fused_cuda`, not yet checked on a GPU):
  `_scaled_dot_product_flash_attention` for bf16/fp16, `_scaled_dot_product_efficient_attention`
  for fp32, K/V expanded per group. The kernels take one head size: q/k or v is zero-padded to
  the other's (a value head size other than the query/key one). The backward feeds the kernel's
  backward the FINAL out and lse (it recomputes P = exp(S - lse) and delta = rowsum(dout * out)),
  as ring flash attention does; that needs `out`, so a nonzero gradient on the returned lse takes
  the reference backward.
- reference: pure PyTorch, any device and any visibility; it materializes the [b, hq, sq, sk]
  scores of a block. Set `use_fused = False` (or MEGATRON_LITE_FUSED_ATTENTION=0) to force it.
"""
from __future__ import annotations

import math
import os
from typing import List, Optional, Tuple

import torch

# Module switches, read at every call (tests flip them with monkeypatch).
use_fused = os.environ.get("MEGATRON_LITE_FUSED_ATTENTION", "1") != "0"
# The CUDA kernels are written against the aten schemas of torch 2.11-2.13 but not yet run on a
# GPU here: opt in with MEGATRON_LITE_FUSED_ATTENTION_CUDA=1 (tests/test_block_attention_fused.py
# has the CUDA checks) until they are.
fused_cuda = os.environ.get("MEGATRON_LITE_FUSED_ATTENTION_CUDA", "0") == "1"
_MAX_FUSED_BLOCKS = 512  # beyond this many sub-blocks (scattered indices) the reference is used

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
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4 or k.shape[:3] != v.shape[:3]:
        raise ValueError(f"expected q [b, sq, hq, d], k [b, sk, hkv, d], v [b, sk, hkv, dv]; got q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}, v {tuple(v.shape)}")
    b, sq, hq, d = q.shape
    if k.shape[0] != b or k.shape[3] != d or hq % k.shape[2]:
        raise ValueError(f"k/v {tuple(k.shape)} do not match q {tuple(q.shape)}: same batch and head dim, "
                         "and the query heads must be a multiple of the key/value heads")
    if q_index.shape != (sq,) or k_index.shape != (k.shape[1],):
        raise ValueError(f"q_index {tuple(q_index.shape)} / k_index {tuple(k_index.shape)} must be 1-D with "
                         f"one absolute token index per query ({sq}) / key ({k.shape[1]})")
    if (q_doc is None) != (k_doc is None):
        raise ValueError("pass both q_doc and k_doc (document ids of queries and keys), or neither")
    if q_doc is not None and (q_doc.shape != (b, sq) or k_doc.shape != (b, k.shape[1])):
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


# --- fused path: flash-attention kernels over fully visible / plain causal sub-blocks ------------
Block = Tuple[slice, slice, bool]  # (query rows, key rows, causal over the same index run)


def _runs(index: torch.Tensor) -> List[Tuple[int, int, int]]:
    """Maximal runs of consecutive increasing indices as (first row, first index, last index)."""
    idx = index.detach().to("cpu", torch.int64)
    n = idx.numel()
    if n == 0:
        return []
    cuts = ((idx[1:] != idx[:-1] + 1).nonzero().flatten() + 1).tolist()
    starts, stops = [0] + cuts, cuts + [n]
    first = idx[starts].tolist()
    return [(a, lo, lo + (z - a) - 1) for a, z, lo in zip(starts, stops, first)]


def _cut(run: Tuple[int, int, int], lo: int, hi: int) -> List[Tuple[int, int, int]]:
    """A run cut at the edges of the index range [lo, hi]: pieces inside it or disjoint from it."""
    start, a, z = run
    edges = sorted({a, z + 1} | {e for e in (lo, hi + 1) if a < e <= z})
    return [(start + e0 - a, e0, e1 - 1) for e0, e1 in zip(edges, edges[1:])]


def fused_kernel(device, dtype: torch.dtype, head_dim: int = 64) -> Optional[str]:
    """The fused kernel block attention uses for these inputs ("cpu", "flash", "efficient"), or None
    (reference path). The visibility of a block decides the rest (`_fused_blocks`)."""
    if not use_fused:
        return None
    device = torch.device(device)
    if device.type == "cpu":
        return "cpu" if dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16) else None
    if device.type == "cuda" and fused_cuda and head_dim % 8 == 0:
        if dtype in (torch.bfloat16, torch.float16) and head_dim <= 256:
            return "flash"
        if dtype == torch.float32:
            return "efficient"
    return None


def _kernel_kind(x: torch.Tensor) -> Optional[str]:
    return fused_kernel(x.device, x.dtype, x.shape[-1])


def _fused_blocks(q, k, q_index, k_index, q_doc, causal, window, dropout_p) -> Optional[List[Block]]:
    """The sub-blocks that hold exactly the visible pairs, each fully visible or plain causal (the
    same run of consecutive indices for queries and keys, so visibility is j <= i); None when the
    fused path does not apply (switched off, no kernel, window, documents, dropout, scattered
    indices). Rows in no sub-block see no key."""
    if q_doc is not None or window is not None or dropout_p > 0 or _kernel_kind(q) is None:
        return None
    sq, sk = q.shape[1], k.shape[1]
    if not causal:
        return [(slice(0, sq), slice(0, sk), False)]
    q_runs, k_runs = _runs(q_index), _runs(k_index)
    if len(q_runs) * len(k_runs) > _MAX_FUSED_BLOCKS:
        return None
    blocks: List[Block] = []
    for q_run in q_runs:
        for k_run in k_runs:
            lo, hi = max(q_run[1], k_run[1]), min(q_run[2], k_run[2])
            q_parts = _cut(q_run, lo, hi) if lo <= hi else [q_run]
            k_parts = _cut(k_run, lo, hi) if lo <= hi else [k_run]
            for qs, qa, qz in q_parts:
                rows = slice(qs, qs + qz - qa + 1)
                for ks, ka, kz in k_parts:
                    cols = slice(ks, ks + kz - ka + 1)
                    if (ka, kz) == (qa, qz):
                        blocks.append((rows, cols, True))
                    elif kz < qa:  # every key before every query: fully visible
                        prev = blocks[-1] if blocks else None
                        if prev is not None and not prev[2] and prev[0] == rows and prev[1].stop == cols.start:
                            blocks[-1] = (rows, slice(prev[1].start, cols.stop), False)
                        else:
                            blocks.append((rows, cols, False))
                    # else every key after every query: nothing visible
    return blocks if len(blocks) <= _MAX_FUSED_BLOCKS else None


def _heads_first(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(1, 2)  # [b, s, h, d] -> [b, h, s, d] (a view, last dim contiguous)


def _kernel_forward(q, k, v, causal: bool, scale: float):
    """One sub-block: q [b, sq, hq, d], k/v [b, sk, hkv, d] (one head size) -> (out [b, sq, hq, d],
    lse [b, hq, sq]), both in the accumulation dtype."""
    acc = accumulation_dtype(q.dtype)
    kind = _kernel_kind(q)
    if kind == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            *(_heads_first(t.to(acc)) for t in (q, k, v)), 0.0, causal, attn_mask=None, scale=scale)
        return out.transpose(1, 2), lse.to(acc)
    rep = q.shape[2] // k.shape[2]
    qh, kh, vh = (_heads_first(t) for t in (q, k, v))
    if rep > 1:
        kh, vh = kh.repeat_interleave(rep, dim=1), vh.repeat_interleave(rep, dim=1)
    if kind == "flash":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(qh, kh, vh, 0.0, causal, False, scale=scale)[:2]
    else:  # efficient (fp32); its lse is padded to a multiple of 32 rows
        out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(qh, kh, vh, None, True, 0.0, causal,
                                                                          scale=scale)[:2]
        lse = lse[:, :, :q.shape[1]]
    return out.transpose(1, 2).to(acc), lse.to(acc)


def _kernel_backward(dout, q, k, v, out, lse, causal: bool, scale: float):
    """Gradients of one sub-block from the FINAL out [b, sq, hq, d] and lse [b, hq, sq] of its query
    rows: (dq, dk, dv) in the accumulation dtype, dk/dv with the hkv heads of k/v."""
    acc = accumulation_dtype(q.dtype)
    kind = _kernel_kind(q)
    lse = lse.to(torch.float32 if kind != "cpu" else acc).contiguous()
    if kind == "cpu":
        grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            *(_heads_first(t.to(acc)) for t in (dout, q, k, v, out)), lse, 0.0, causal, attn_mask=None, scale=scale)
        return tuple(g.transpose(1, 2) for g in grads)
    b, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    rep = hq // hkv
    qh, kh, vh = (_heads_first(t) for t in (q, k, v))
    if rep > 1:
        kh, vh = kh.repeat_interleave(rep, dim=1), vh.repeat_interleave(rep, dim=1)
    doh, oh = _heads_first(dout.to(q.dtype)), _heads_first(out.to(q.dtype))
    if kind == "flash":
        # Dense (not varlen) call: cum_seq None; the philox seed/offset are read only with dropout.
        seed = torch.empty(2, dtype=torch.uint64, device=q.device)
        offset = torch.empty((), dtype=torch.uint64, device=q.device)
        gq, gk, gv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            doh, qh, kh, vh, oh, lse, None, None, sq, sk, 0.0, causal, seed, offset, scale=scale)
    else:
        padded = lse.new_zeros(b, hq, -(-sq // 32) * 32)
        padded[:, :, :sq] = lse
        seed = torch.zeros((), dtype=torch.int64, device=q.device)
        gq, gk, gv = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
            doh, qh, kh, vh, None, oh, padded, seed, seed.clone(), 0.0, [True, True, True, False], causal,
            scale=scale)[:3]
    if rep > 1:
        gk, gv = (g.unflatten(1, (hkv, rep)).sum(2) for g in (gk.to(acc), gv.to(acc)))
    return gq.transpose(1, 2).to(acc), gk.transpose(1, 2).to(acc), gv.transpose(1, 2).to(acc)


def _padded(x: torch.Tensor, width: int) -> torch.Tensor:
    """x zero-padded to `width` channels: the kernels take one head size for q, k and v, and zero
    channels change neither q k^T nor the output's first channels."""
    return x if x.shape[-1] == width else torch.nn.functional.pad(x, (0, width - x.shape[-1]))


def _fused_forward(q, k, v, blocks: List[Block], scale: float):
    """(out [b, sq, hq, dv], lse [b, hq, sq]) in the accumulation dtype, merged over the sub-blocks."""
    acc = accumulation_dtype(q.dtype)
    b, sq, hq, d = q.shape
    v_dim = v.shape[-1]
    q, k, v = (_padded(t, max(d, v_dim)) for t in (q, k, v))
    if len(blocks) == 1 and blocks[0][0] == slice(0, sq):
        rows, cols, causal = blocks[0]
        out, lse = _kernel_forward(q, k[:, cols], v[:, cols], causal, scale)
        return out[..., :v_dim], lse
    out = torch.zeros(b, sq, hq, v.shape[-1], dtype=acc, device=q.device)
    lse = torch.full((b, hq, sq), NEG_INF, dtype=acc, device=q.device)
    for rows, cols, causal in blocks:
        o, l = _kernel_forward(q[:, rows], k[:, cols], v[:, cols], causal, scale)
        out[:, rows], lse[:, :, rows] = merge_partials(out[:, rows], lse[:, :, rows], o, l)
    return out[..., :v_dim], lse


def _fused_backward(dout, q, k, v, out, lse, blocks: List[Block], scale: float):
    acc = accumulation_dtype(q.dtype)
    d, v_dim = q.shape[-1], v.shape[-1]
    q, k, v, dout, out = (_padded(t, max(d, v_dim)) for t in (q, k, v, dout, out))
    dq, dk, dv = (torch.zeros(t.shape, dtype=acc, device=q.device) for t in (q, k, v))
    for rows, cols, causal in blocks:
        gq, gk, gv = _kernel_backward(dout[:, rows], q[:, rows], k[:, cols], v[:, cols], out[:, rows],
                                      lse[:, :, rows], causal, scale)
        dq[:, rows] += gq
        dk[:, cols] += gk
        dv[:, cols] += gv
    return dq[..., :d], dk[..., :d], dv[..., :v_dim]


def attention_block_backward(dout, q, k, v, lse, delta=None, *, q_index, k_index, q_doc=None, k_doc=None,
                             causal: bool = True, window: Optional[int] = None,
                             softmax_scale: Optional[float] = None, dropout_p: float = 0.0,
                             dropout_seed: Optional[int] = None, out: Optional[torch.Tensor] = None):
    """Gradients (dq, dk, dv) of one key block, recomputed from the FINAL row statistics.

    lse [b, hq, sq]: log-sum-exp over ALL keys each query sees (the merged result, not this
    block's); delta [b, hq, sq] = rowsum(dout * out) of the final output (`softmax_delta`), minus
    any incoming gradient of the final lse. Then P = exp(S - lse) is this block's slice of the
    global softmax and dS = P * (dP - delta), so the per-block gradients of disjoint key blocks
    sum to the gradient of the whole attention. Returned in the accumulation dtype (dq [b, sq, hq, d],
    dk [b, sk, hkv, d], dv [b, sk, hkv, dv]) so callers can sum blocks without rounding.

    out [b, sq, hq, dv]: the final output of these query rows. Pass it (with or without delta; delta
    must then be softmax_delta(dout, out)) to let the fused kernel run, which takes out, not delta;
    with delta alone (e.g. a gradient on the lse folded in) the reference path runs."""
    b, sq, hq, d = q.shape
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    if out is not None:
        blocks = _fused_blocks(q, k, q_index, k_index, q_doc, causal, window, dropout_p)
        if blocks is not None:
            return _fused_backward(dout, q, k, v, out, lse, blocks, scale)
        if delta is None:
            delta = softmax_delta(dout, out)
    if delta is None:
        raise ValueError("attention_block_backward needs delta or out")
    return _reference_backward(dout, q, k, v, lse, delta, q_index, k_index, q_doc, k_doc, causal, window, scale,
                               dropout_p, dropout_seed)


def _reference_backward(dout, q, k, v, lse, delta, q_index, k_index, q_doc, k_doc, causal, window, scale,
                        dropout_p, dropout_seed):
    acc = accumulation_dtype(q.dtype)
    b, sq, hq, d = q.shape
    hkv = k.shape[2]
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
        blocks = _fused_blocks(q, k, q_index, k_index, q_doc, causal, window, dropout_p)
        b, sq, hq, _ = q.shape
        if blocks is not None:
            out, lse = _fused_forward(q, k, v, blocks, scale)
            out = out.to(out_dtype)
        else:
            mask = visibility_mask(q_index, k_index, q_doc, k_doc, causal=causal, window=window)
            out, lse = _block_forward(q, k, v, mask, scale, dropout_p, dropout_seed)
            out = _ungrouped(out, sq).to(out_dtype)
            lse = lse.reshape(b, hq, sq)
        # Saved: inputs, output and lse; the mask and probabilities are recomputed in backward.
        ctx.save_for_backward(q, k, v, q_index, k_index, q_doc, k_doc, out, lse)
        ctx.opts = dict(causal=causal, window=window, softmax_scale=scale, dropout_p=dropout_p,
                        dropout_seed=dropout_seed)
        ctx.set_materialize_grads(False)  # an unused lse gives dlse None: the fused backward may run
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, q_index, k_index, q_doc, k_doc, out, lse = ctx.saved_tensors
        if dout is None:
            dout = torch.zeros_like(out)
        kw = dict(q_index=q_index, k_index=k_index, q_doc=q_doc, k_doc=k_doc, **ctx.opts)
        if dlse is None:
            dq, dk, dv = attention_block_backward(dout, q, k, v, lse, out=out, **kw)
        else:  # d lse / dS = P, so a gradient on lse enters as -dlse in delta (reference path)
            dq, dk, dv = attention_block_backward(dout, q, k, v, lse, softmax_delta(dout, out) - dlse, **kw)
        return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)) + (None,) * 10


def attention_block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, q_index: torch.Tensor,
                    k_index: torch.Tensor, q_doc: Optional[torch.Tensor] = None,
                    k_doc: Optional[torch.Tensor] = None, causal: bool = True, window: Optional[int] = None,
                    softmax_scale: Optional[float] = None, dropout_p: float = 0.0,
                    dropout_seed: Optional[int] = None,
                    out_dtype: Optional[torch.dtype] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Attention of queries q over one block of keys; returns (out [b, sq, hq, dv], lse [b, hq, sq]).

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
    """Combine attention over two disjoint key sets: out [b, s, h, dv], lse [b, h, s] each.

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
           "visibility_mask", "dropout_keep_mask", "accumulation_dtype", "fused_kernel"]
