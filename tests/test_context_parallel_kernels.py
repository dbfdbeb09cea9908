"""Context-parallel attention kernels against single-process references.

Block attention (with LSE) against plain float64 softmax and PyTorch's SDPA; merge_partials and
the final-LSE backward helper against attention over the union of key sets; every CP comm type
(p2p ring, a2a Ulysses, all_gather, a2a+p2p) on forked gloo ranks against full-sequence
attention, forward and dq/dk/dv; with a value head size other than the query/key one (MLA's kind),
block attention and every comm type against SDPA; the ring's p2p byte count against its formula.
"""
from functools import lru_cache

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_lite.parallel import comm
from megatron_lite.parallel.context_parallel import (check_ulysses, cp_attention, ring_block_plan, split_batch_for_cp,
                                                     zigzag_indices, zigzag_split, zigzag_unsplit)
from megatron_lite.testing import assert_close, run_distributed
from megatron_lite.kernels import block_attention as ba
from megatron_lite.kernels.block_attention import (attention_block, attention_block_backward, dropout_keep_mask,
                                                   merge_partials, softmax_delta)

F64 = torch.float64


# --- an independent reference: the visibility rule written out pair by pair, plain softmax -----
def reference_mask(q_index, k_index, q_doc=None, k_doc=None, causal=True, window=None, batch=1):
    sq, sk = len(q_index), len(k_index)
    mask = torch.zeros(batch, sq, sk, dtype=torch.bool)
    for b in range(batch):
        for i in range(sq):
            for j in range(sk):
                qi, kj = int(q_index[i]), int(k_index[j])
                ok = (kj <= qi) if causal else True
                if window is not None:
                    ok = ok and (qi - kj < window if causal else abs(qi - kj) < window)
                if q_doc is not None:
                    ok = ok and bool(q_doc[b, i] == k_doc[b, j])
                mask[b, i, j] = ok
    return mask


def reference_attention(q, k, v, mask, scale=None):
    """Float64 softmax attention: (out [b, sq, hq, d], lse [b, hq, sq]); empty rows give 0 / -inf.
    Differentiable (no NaN): masked scores use a huge finite negative, and P is multiplied by the mask."""
    q, k, v = q.double(), k.double(), v.double()
    rep = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
    scale = scale if scale is not None else q.shape[-1] ** -0.5
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    m = mask[:, None]
    lse = torch.logsumexp(scores.masked_fill(~m, float("-inf")), dim=-1)
    probs = torch.softmax(scores.masked_fill(~m, -1e300), dim=-1) * m
    return torch.einsum("bhqk,bkhd->bqhd", probs, v), lse


def _qkv(b, sq, sk, hq, hkv, d, dtype=F64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, sq, hq, d, generator=gen, dtype=dtype)
    k = torch.randn(b, sk, hkv, d, generator=gen, dtype=dtype)
    v = torch.randn(b, sk, hkv, d, generator=gen, dtype=dtype)
    return q, k, v


def _sdpa(q, k, v, mask):
    """PyTorch's SDPA (an oracle that takes a value head size of its own) on [b, s, h, d] layouts;
    mask [1 or b, sq, sk] bool."""
    return F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), attn_mask=mask[:, None],
                                          enable_gqa=True).transpose(1, 2)


def _docs(lengths_per_row):
    return torch.stack([torch.repeat_interleave(torch.arange(len(ls)), torch.tensor(ls)) for ls in lengths_per_row])


# Block cases: (name, hq, hkv, q_index, k_index, docs?, causal, window). Indices are arbitrary
# subsets in arbitrary order (as CP blocks are); "empty" cases have rows that see no key.
S = 7
BLOCK_CASES = [
    ("mha_causal", 2, 2, torch.arange(S), torch.arange(S), False, True, None),
    ("gqa_causal", 4, 2, torch.arange(S), torch.arange(S), False, True, None),
    ("gqa_shuffled", 6, 2, torch.tensor([9, 2, 5, 7, 0, 4, 8]), torch.tensor([3, 8, 1, 6, 0, 2, 9, 5]),
     False, True, None),
    ("docs", 4, 1, torch.arange(S), torch.arange(S), True, True, None),
    ("window", 2, 1, torch.arange(S), torch.arange(S), False, True, 3),
    ("docs_window", 4, 2, torch.arange(S), torch.arange(S), True, True, 2),
    ("noncausal_docs", 2, 2, torch.arange(S), torch.arange(S), True, False, None),
    ("noncausal_window", 2, 1, torch.arange(S), torch.arange(S), False, False, 2),
    ("empty_rows_causal", 4, 2, torch.arange(S), torch.arange(3, 3 + S), False, True, None),
    ("empty_rows_docs", 2, 1, torch.arange(S), torch.arange(S), True, False, None),
]


def _block_inputs(case, dtype=F64):
    name, hq, hkv, q_index, k_index, with_docs, causal, window = case
    b, d = 2, 3
    q, k, v = _qkv(b, len(q_index), len(k_index), hq, hkv, d, dtype)
    q_doc = k_doc = None
    if with_docs:
        q_doc = _docs([[3, 4], [1, 2, 4]])
        # "empty_rows_docs": row 1's keys are in documents shifted by one, so its first doc sees nothing.
        k_doc = q_doc.clone() if name != "empty_rows_docs" else q_doc + torch.tensor([[0], [1]])
    kw = dict(q_index=q_index, k_index=k_index, q_doc=q_doc, k_doc=k_doc, causal=causal, window=window)
    mask = reference_mask(q_index, k_index, q_doc, k_doc, causal, window, batch=b)
    return q, k, v, kw, mask


@pytest.mark.parametrize("case", BLOCK_CASES, ids=[c[0] for c in BLOCK_CASES])
def test_block_attention_matches_float64_reference(case):
    q, k, v, kw, mask = _block_inputs(case)
    out, lse = attention_block(q, k, v, **kw)
    ref_out, ref_lse = reference_attention(q, k, v, mask)
    assert out.dtype == F64 and lse.dtype == F64 and lse.shape == (q.shape[0], q.shape[2], q.shape[1])
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse)), "rows without a visible key must have lse -inf"
    if case[0].startswith("empty"):
        assert torch.isinf(lse).any(), "the case should have empty rows"
        assert torch.all(out.transpose(1, 2)[torch.isinf(lse)] == 0)
    finite = torch.isfinite(ref_lse)
    assert (lse[finite] - ref_lse[finite]).abs().max() <= 1e-10
    assert (out - ref_out).abs().max() <= 1e-10


@pytest.mark.parametrize("hq,hkv", [(4, 4), (4, 2), (6, 1)])
def test_block_attention_matches_sdpa(hq, hkv):
    q, k, v = _qkv(2, 9, 9, hq, hkv, 5)
    idx = torch.arange(9)
    sdpa = lambda mask=None, causal=False: F.scaled_dot_product_attention(  # noqa: E731
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, is_causal=causal,
        enable_gqa=True).transpose(1, 2)
    out, _ = attention_block(q, k, v, q_index=idx, k_index=idx)
    assert (out - sdpa(causal=True)).abs().max() <= 1e-10
    # Packed documents under a causal mask (every row sees at least itself), SDPA with a bool mask.
    doc = _docs([[2, 4, 3], [9]])
    out, _ = attention_block(q, k, v, q_index=idx, k_index=idx, q_doc=doc, k_doc=doc)
    dense = (idx[None, :, None] >= idx[None, None, :]) & (doc[:, :, None] == doc[:, None, :])
    assert (out - sdpa(mask=dense[:, None])).abs().max() <= 1e-10
    out, _ = attention_block(q, k, v, q_index=idx, k_index=idx, causal=False, softmax_scale=0.3)
    ref = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale=0.3,
                                         enable_gqa=True).transpose(1, 2)
    assert (out - ref).abs().max() <= 1e-10


@pytest.mark.parametrize("case", BLOCK_CASES, ids=[c[0] for c in BLOCK_CASES])
def test_block_attention_gradcheck(case):
    q, k, v, kw, _ = _block_inputs(case)
    q, k, v = (t.requires_grad_() for t in (q, k, v))

    def fn(q, k, v):  # both outputs; -inf lse entries (empty rows) replaced by a constant
        out, lse = attention_block(q, k, v, **kw)
        return out, lse.masked_fill(torch.isinf(lse), 0.0)

    assert torch.autograd.gradcheck(fn, (q, k, v))
    out, lse = attention_block(q, k, v, **kw)
    (out.sum() + lse.masked_fill(torch.isinf(lse), 0.0).sum()).backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v)), "no NaN/inf gradients, even for empty rows"


def test_block_attention_dropout():
    q, k, v = _qkv(1, 6, 6, 4, 2, 3)
    idx = torch.arange(6)
    kw = dict(q_index=idx, k_index=idx, dropout_p=0.4, dropout_seed=123)
    out, lse = attention_block(q, k, v, **kw)
    # Reference: the same keep-mask (grouped layout [b, hkv, rep * sq, sk] = [b, hq, sq, sk]).
    keep = dropout_keep_mask((1, 2, 2 * 6, 6), 0.4, 123, q.device).view(1, 4, 6, 6)
    rep_k, rep_v = k.repeat_interleave(2, 2), v.repeat_interleave(2, 2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, rep_k) * 3 ** -0.5
    scores = scores.masked_fill(~(idx[:, None] >= idx[None, :]), float("-inf"))
    probs = torch.softmax(scores, -1)
    ref = torch.einsum("bhqk,bkhd->bqhd", probs * keep / 0.6, rep_v)
    assert (out - ref).abs().max() <= 1e-12
    assert (lse - torch.logsumexp(scores, -1)).abs().max() <= 1e-12  # the lse is that of the undropped scores
    assert 0.2 < 1 - keep.double().mean() < 0.6
    assert not torch.equal(out, attention_block(q, k, v, q_index=idx, k_index=idx)[0])
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    assert torch.autograd.gradcheck(lambda q, k, v: attention_block(q, k, v, **kw), (q, k, v))


def test_block_attention_low_precision_accumulates_in_fp32():
    q, k, v = (t.bfloat16() for t in _qkv(2, 16, 16, 4, 2, 8, dtype=torch.float32))
    idx = torch.arange(16)
    out, lse = attention_block(q, k, v, q_index=idx, k_index=idx, window=6)
    ref_out, ref_lse = reference_attention(q, k, v, reference_mask(idx, idx, window=6))
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    assert_close(out, ref_out, rtol=1e-2, what="bf16 out")
    assert_close(lse, ref_lse, rtol=1e-5, what="bf16 lse (fp32 accumulation of bf16 inputs)")


@pytest.mark.parametrize("causal,window,with_docs", [(True, None, False), (True, 4, True), (False, None, True)])
def test_merge_partials_and_final_lse_backward_equal_the_union(causal, window, with_docs):
    b, s, hq, hkv, d = 2, 10, 4, 2, 3
    q, k, v = _qkv(b, s, s, hq, hkv, d)
    idx = torch.arange(s)
    doc = _docs([[4, 6], [1, 5, 4]]) if with_docs else None
    # Disjoint key sets, shuffled; set A holds only late keys, so causal rows near the start are
    # empty in A (lse -inf) and some rows of the first document are empty in both with a window.
    perm = torch.tensor([7, 2, 9, 5, 0, 8, 3, 1, 6, 4])
    parts = [perm[:5], perm[5:]]
    kwargs = lambda cols: dict(q_index=idx, k_index=idx[cols], q_doc=doc,  # noqa: E731
                               k_doc=None if doc is None else doc[:, cols], causal=causal, window=window)
    q_, k_, v_ = (t.clone().requires_grad_() for t in (q, k, v))
    full_out, full_lse = attention_block(q_, k_, v_, **kwargs(torch.arange(s)))
    dout = torch.randn_like(full_out)
    full_out.backward(dout)

    qm, km, vm = (t.clone().requires_grad_() for t in (q, k, v))
    (oa, la), (ob, lb) = (attention_block(qm, km[:, c], vm[:, c], **kwargs(c)) for c in parts)
    out, lse = merge_partials(oa, la, ob, lb)
    assert_close(out, full_out, rtol=1e-12, what="merged out")
    assert torch.equal(torch.isinf(lse), torch.isinf(full_lse))
    assert torch.allclose(lse[torch.isfinite(lse)], full_lse[torch.isfinite(full_lse)], rtol=0, atol=1e-12)
    out.backward(dout)  # autograd through merge_partials (the lse gradient path of each block)
    for name, a, ref in (("dq", qm, q_), ("dk", km, k_), ("dv", vm, v_)):
        assert_close(a.grad, ref.grad, rtol=1e-12, what=f"{name} through merge_partials")

    # The ring's way: each block's gradients recomputed from the FINAL lse and delta, summed.
    delta = softmax_delta(dout, full_out.detach())
    dq = torch.zeros_like(q)
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    for c in parts:
        gq, gk, gv = attention_block_backward(dout, q, k[:, c], v[:, c], full_lse.detach(), delta, **kwargs(c))
        dq += gq
        dk[:, c] += gk
        dv[:, c] += gv
    for name, a, ref in (("dq", dq, q_), ("dk", dk, k_), ("dv", dv, v_)):
        assert_close(a, ref.grad, rtol=1e-12, what=f"{name} from the final lse")


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("d,dv", [(4, 6), (6, 3)])
def test_block_attention_with_its_own_value_head_size_matches_sdpa(d, dv, fused, monkeypatch):
    """q/k head size d, v head size dv: out, lse and gradients of one block against SDPA (the fused
    path pads to one head size), and two key blocks merged and differentiated from the final lse."""
    monkeypatch.setattr(ba, "use_fused", fused)
    q, k, _ = _qkv(2, 9, 9, 4, 2, d)
    v = torch.randn(2, 9, 2, dv, generator=torch.Generator().manual_seed(1), dtype=F64)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    idx = torch.arange(9)
    mask = reference_mask(idx, idx)
    out, lse = attention_block(q, k, v, q_index=idx, k_index=idx)
    ref = _sdpa(q, k, v, mask)
    assert out.shape == ref.shape == (2, 9, 4, dv)
    assert (out - ref).abs().max() <= 1e-10
    assert (lse - reference_attention(q, k, v, mask)[1]).abs().max() <= 1e-10
    dout = torch.randn_like(ref)
    expected = torch.autograd.grad(ref, (q, k, v), dout)
    for name, got, want in zip(("dq", "dk", "dv"), torch.autograd.grad(out, (q, k, v), dout), expected):
        assert (got - want).abs().max() <= 1e-10, name
    parts = [torch.tensor([0, 2, 3, 7]), torch.tensor([1, 4, 5, 6, 8])]
    merged, _ = merge_partials(*attention_block(q, k[:, parts[0]], v[:, parts[0]], q_index=idx, k_index=parts[0]),
                               *attention_block(q, k[:, parts[1]], v[:, parts[1]], q_index=idx, k_index=parts[1]))
    assert (merged - ref).abs().max() <= 1e-10
    dq, dk, dv_ = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for c in parts:
        gq, gk, gv = attention_block_backward(dout, q.detach(), k.detach()[:, c], v.detach()[:, c], lse.detach(),
                                              q_index=idx, k_index=c, out=out.detach())
        dq, dk[:, c], dv_[:, c] = dq + gq, dk[:, c] + gk, dv_[:, c] + gv
    for name, got, want in zip(("dq", "dk", "dv"), (dq, dk, dv_), expected):
        assert (got - want).abs().max() <= 1e-10, f"{name} from the final lse"


def test_merge_partials_handles_empty_rows():
    out_a, out_b = torch.randn(1, 3, 1, 2), torch.randn(1, 3, 1, 2)
    inf = float("-inf")
    lse_a, lse_b = torch.tensor([[[inf, 0.5, inf]]]), torch.tensor([[[inf, inf, -1.0]]])
    out_a[:, 0] = out_b[:, 0] = 0
    out, lse = merge_partials(out_a, lse_a, out_b, lse_b)
    assert torch.equal(lse, torch.tensor([[[inf, 0.5, -1.0]]]))
    assert torch.equal(out[:, 0], torch.zeros(1, 1, 2)) and torch.equal(out[:, 1], out_a[:, 1])
    assert torch.equal(out[:, 2], out_b[:, 2])
    big = merge_partials(out_a, torch.full((1, 1, 3), 1e4), out_b, torch.full((1, 1, 3), 1e4 - 1.0))[1]
    assert torch.allclose(big, torch.full((1, 1, 3), 1e4 + torch.log1p(torch.exp(torch.tensor(-1.0))).item()))


# --- zigzag split and batch splitting ------------------------------------------------------------
def test_zigzag_split_unsplit_and_indices():
    t = torch.arange(2 * 24).view(2, 24)
    assert zigzag_indices(24, 4, 1).tolist() == [3, 4, 5, 18, 19, 20]
    parts = [zigzag_split(t, 4, r, dim=1) for r in range(4)]
    for r in range(4):
        assert torch.equal(parts[r], t[:, zigzag_indices(24, 4, r)])
    assert torch.equal(zigzag_unsplit(parts, dim=1), t)
    assert torch.equal(torch.sort(torch.cat([zigzag_indices(24, 4, r) for r in range(4)])).values, torch.arange(24))
    batch = {"tokens": t, "labels": t + 100, "loss_mask": torch.ones(2, 24), "position_ids": t % 7,
             "document_ids": t // 5, "attention_mask": torch.ones(2, 1, 24, 24, dtype=torch.bool), "name": "x"}
    local, index = split_batch_for_cp(batch, 4, 2)
    assert "attention_mask" not in local and local["name"] == "x"
    assert torch.equal(index, zigzag_indices(24, 4, 2))
    for key in ("tokens", "labels", "loss_mask", "position_ids", "document_ids"):
        assert torch.equal(local[key], batch[key][:, index]), key


def test_invalid_inputs_raise_clear_errors():
    with pytest.raises(ValueError, match=r"not divisible by 2 x context_parallel_size = 8"):
        zigzag_split(torch.zeros(1, 12), 4, 0, dim=1)
    with pytest.raises(ValueError, match=r"sequence length 10 is not divisible"):
        split_batch_for_cp({"tokens": torch.zeros(2, 10, dtype=torch.long)}, 2, 0)
    with pytest.raises(ValueError, match=r"6 query heads .* not divisible by 4; use --cp-comm-type p2p, or a2a\+p2p"):
        check_ulysses(6, 2, 4)
    with pytest.raises(ValueError, match=r"3 key/value heads .* use --cp-comm-type p2p, or a2a\+p2p"):
        check_ulysses(6, 3, 2)
    check_ulysses(8, 2, 4)  # fewer K/V heads than ranks, 4 % 2 == 0: replicated, allowed
    check_ulysses(8, 1, 8)
    q = torch.zeros(1, 4, 2, 2)
    with pytest.raises(ValueError, match="unknown cp comm type"):
        cp_attention(q, q, q, comm_type="ring", q_index=torch.arange(4))
    with pytest.raises(ValueError, match="q_index"):
        cp_attention(q, q, q, comm_type="p2p", q_index=torch.arange(3))
    with pytest.raises(ValueError, match="a2a_group / p2p_group are for a2a\\+p2p"):
        cp_attention(q, q, q, comm_type="p2p", q_index=torch.arange(4), a2a_group=object())
    with pytest.raises(ValueError, match="not cp_group"):
        cp_attention(q, q, q, comm_type="a2a+p2p", q_index=torch.arange(4), cp_group=object())


@pytest.mark.parametrize("comm_type", ["p2p", "a2a", "all_gather", "a2a+p2p"])
def test_cp_attention_with_one_rank_is_block_attention(comm_type):
    q, k, v = _qkv(2, 8, 8, 4, 2, 3)
    idx, doc = torch.arange(8), _docs([[3, 5], [8]])
    out = cp_attention(q, k, v, comm_type=comm_type, q_index=idx, q_doc=doc, window=4)
    ref, _ = reference_attention(q, k, v, reference_mask(idx, idx, doc, doc, window=4, batch=2))
    assert (out - ref).abs().max() <= 1e-12


# --- the ring's block plan reproduces the zigzag skipping rule -----------------------------------
def test_ring_block_plan_is_the_zigzag_rule():
    cp, c = 4, 3
    index = [zigzag_indices(2 * cp * c, cp, r).tolist() for r in range(cp)]
    first, second, both = slice(0, c), slice(c, 2 * c), slice(0, 2 * c)
    for r in range(cp):
        for i in range(cp):
            plan = ring_block_plan(index[r], index[(r - i) % cp], causal=True, window=None)
            if i == 0:  # local: causal, and (q first chunk, k second chunk) is never visible
                assert plan == [(first, first), (second, both)]
            elif i <= r:  # K/V of a lower rank: all queries, its first chunk only
                assert plan == [(both, first)]
            else:  # K/V of a higher rank: second query chunk, all of it
                assert plan == [(second, both)]
            assert ring_block_plan(index[r], index[(r - i) % cp], causal=False, window=None) == [(both, both)]
    # A short window drops blocks and whole steps: rank 0 (chunks 0, 7 = tokens 0-2, 21-23) sees
    # only chunk 6 (tokens 18-20) of rank 1, and nothing of rank 2 (chunks 2, 5 = tokens 6-8, 15-17).
    assert ring_block_plan(index[0], index[1], causal=True, window=2) == [(second, second)]
    assert ring_block_plan(index[0], index[2], causal=True, window=2) == []
    # Boundaries (one-token chunks, touching ranges): a pair at distance 0 is visible, at distance w not.
    assert ring_block_plan([5], [5], causal=True, window=None) == [(slice(0, 1), slice(0, 1))]
    assert ring_block_plan([5, 6], [6, 7], causal=True, window=None) == [(slice(1, 2), slice(0, 1))]
    assert ring_block_plan([5, 6], [7, 8], causal=True, window=None) == []
    assert ring_block_plan([10, 11], [7, 8], causal=True, window=3) == [(slice(0, 1), slice(1, 2))]
    assert ring_block_plan([10, 11], [7, 8], causal=True, window=2) == []
    assert ring_block_plan([7, 8], [10, 11], causal=False, window=3) == [(slice(1, 2), slice(0, 1))]
    assert ring_block_plan([7, 8], [10, 11], causal=False, window=2) == []


# --- every comm type against full-sequence attention ---------------------------------------------
TIMEOUT = 60  # seconds; a ring that deadlocks fails here instead of after the harness's 300 s
SEQ, BATCH, DIM = 24, 2, 4  # divisible by 2 * cp for cp in {2, 4}; chunks of 3 or 6 tokens
DV = 6  # the value head size of DV_CASES (MLA's kind of attention): not DIM
DV_CASES = {"dv_gqa_docs": (4, 2, True, True, None), "dv_mqa_causal": (4, 1, False, True, None)}
CP_CASES = {  # name: (hq, hkv, packed documents?, causal, window)
    "mha_causal": (4, 4, False, True, None),
    "gqa_causal": (4, 1, False, True, None),  # fewer K/V heads than cp (replicated for a2a)
    "gqa2_docs": (4, 2, True, True, None),  # documents crossing chunk boundaries
    "gqa_window": (4, 2, False, True, 5),
    "docs_window": (4, 1, True, True, 4),
    "noncausal_docs": (4, 2, True, False, None),
}
DOC_LENGTHS = [[5, 9, 3, 7], [11, 13]]  # boundaries at 5, 14, 17 / 11: inside chunks for cp 2 and 4


def _cp_inputs(name):
    hq, hkv, with_docs, causal, window = CP_CASES.get(name) or DV_CASES[name]
    dv = DV if name in DV_CASES else DIM
    gen = torch.Generator().manual_seed(sum(map(ord, name)))
    q = torch.randn(BATCH, SEQ, hq, DIM, generator=gen)
    k = torch.randn(BATCH, SEQ, hkv, DIM, generator=gen)
    v = torch.randn(BATCH, SEQ, hkv, dv, generator=gen)
    dout = torch.randn(BATCH, SEQ, hq, dv, generator=gen)
    docs = _docs(DOC_LENGTHS) if with_docs else None
    return q, k, v, dout, docs, dict(causal=causal, window=window)


@lru_cache(maxsize=None)
def _cp_reference(name):
    q, k, v, dout, docs, opts = _cp_inputs(name)
    idx = torch.arange(SEQ)
    mask = reference_mask(idx, idx, docs, docs, opts["causal"], opts["window"], batch=BATCH)
    q, k, v = (t.double().requires_grad_() for t in (q, k, v))
    out = _sdpa(q, k, v, mask) if name in DV_CASES else reference_attention(q, k, v, mask)[0]
    out.backward(dout.double())
    return out.detach(), q.grad, k.grad, v.grad


def _layout_groups(kind, world):
    """(kwargs for cp_attention, cp rank) for this rank. new_group is collective: all ranks build all."""
    rank = dist.get_rank()
    if kind == "flat":
        return dict(cp_group=dist.new_group(list(range(world)))), rank
    inner_size = 2
    blocks = [list(range(i, i + inner_size)) for i in range(0, world, inner_size)]  # consecutive ranks
    if kind == "strided":  # inner groups of non-adjacent ranks: balanced less well, still exact
        blocks = [list(range(i, world, world // inner_size)) for i in range(world // inner_size)]
    inner = [dist.new_group(g) for g in blocks]
    outer = [dist.new_group(list(g)) for g in zip(*blocks)]
    pick = lambda groups, lists: next(g for g, ranks in zip(groups, lists) if rank in ranks)  # noqa: E731
    return dict(a2a_group=pick(inner, blocks), p2p_group=pick(outer, [list(g) for g in zip(*blocks)])), rank


def _cp_worker(rank, world, comm_type, layout, split, names, dtype=torch.float32):
    kw, cp_rank = _layout_groups(layout, world)
    results = {}
    for name in names:
        q, k, v, dout, docs, opts = _cp_inputs(name)
        q, k, v, dout = (t.to(dtype) for t in (q, k, v, dout))
        if split == "zigzag":
            index = zigzag_indices(SEQ, world, cp_rank)
        else:  # a plain contiguous split: unbalanced, but the attention must still be exact
            index = torch.arange(cp_rank * SEQ // world, (cp_rank + 1) * SEQ // world)
        lq, lk, lv = (t[:, index].clone().requires_grad_() for t in (q, k, v))
        out = cp_attention(lq, lk, lv, comm_type=comm_type, q_index=index,
                           q_doc=None if docs is None else docs[:, index], **opts, **kw)
        out.backward(dout[:, index])
        results[name] = (index, out.detach(), lq.grad, lk.grad, lv.grad)
    return results


def _check_against_reference(results, names, what, rtol=1e-5):
    for name in names:
        ref = _cp_reference(name)
        index = torch.cat([r[name][0] for r in results])
        assert torch.equal(torch.sort(index).values, torch.arange(SEQ))
        for pos, label in enumerate(("out", "dq", "dk", "dv"), start=1):
            full = torch.empty_like(ref[pos - 1], dtype=results[0][name][pos].dtype)
            full[:, index] = torch.cat([r[name][pos] for r in results], dim=1)
            assert_close(full, ref[pos - 1], rtol=rtol, what=f"{what} {name} {label}")


def _names_for(comm_type, cp):
    if comm_type in ("a2a", "a2a+p2p"):  # heads split over the a2a group: K/V heads divide it or replicate
        inner = cp if comm_type == "a2a" else 2
        return [n for n, c in CP_CASES.items() if c[0] % inner == 0 and (c[1] % inner == 0 or inner % c[1] == 0)]
    return list(CP_CASES)


@pytest.mark.parametrize("comm_type,cp,layout", [("p2p", 2, "flat"), ("p2p", 4, "flat"), ("a2a", 2, "flat"),
                                                 ("a2a", 4, "flat"), ("all_gather", 2, "flat"),
                                                 ("all_gather", 4, "flat"), ("a2a+p2p", 4, "consecutive"),
                                                 ("a2a+p2p", 4, "strided")])
def test_cp_attention_matches_full_sequence(comm_type, cp, layout):
    names = _names_for(comm_type, cp)
    assert "gqa_causal" in names  # GQA with fewer K/V heads than ranks is always covered
    results = run_distributed(_cp_worker, cp, comm_type, layout, "zigzag", names, timeout=TIMEOUT)
    _check_against_reference(results, names, f"{comm_type} cp={cp} {layout}")


@pytest.mark.parametrize("comm_type,cp,layout", [("p2p", 4, "flat"), ("a2a", 2, "flat"), ("all_gather", 2, "flat"),
                                                 ("a2a+p2p", 4, "consecutive")])
def test_cp_attention_with_its_own_value_head_size_matches_sdpa(comm_type, cp, layout):
    names = list(DV_CASES)
    results = run_distributed(_cp_worker, cp, comm_type, layout, "zigzag", names, timeout=TIMEOUT)
    _check_against_reference(results, names, f"{comm_type} cp={cp} {layout} d_v={DV}")


def test_ring_is_exact_for_a_contiguous_split_too():
    names = ["gqa2_docs", "gqa_window"]
    results = run_distributed(_cp_worker, 4, "p2p", "flat", "contiguous", names, timeout=TIMEOUT)
    _check_against_reference(results, names, "p2p contiguous")


def test_ring_in_bf16_accumulates_in_fp32():
    names = ["gqa2_docs"]
    results = run_distributed(_cp_worker, 2, "p2p", "flat", "zigzag", names, torch.bfloat16, timeout=TIMEOUT)
    assert results[0]["gqa2_docs"][1].dtype == torch.bfloat16 and results[0]["gqa2_docs"][3].dtype == torch.bfloat16
    # The reference sees the fp32 inputs: the bound covers rounding the inputs to bf16 too.
    _check_against_reference(results, names, "p2p bf16", rtol=1e-2)


# --- communication volume ---------------------------------------------------------------------------
def _bytes_worker(rank, world, comm_type, layout, hq, hkv):
    kw, cp_rank = _layout_groups(layout, world)
    gen = torch.Generator().manual_seed(0)
    index = zigzag_indices(SEQ, world, cp_rank)
    s = SEQ // world
    q = torch.randn(BATCH, s, hq, DIM, generator=gen, requires_grad=True)
    k = torch.randn(BATCH, s, hkv, DIM, generator=gen, requires_grad=True)
    v = torch.randn(BATCH, s, hkv, DIM, generator=gen, requires_grad=True)
    docs = torch.zeros(BATCH, s, dtype=torch.long)
    counter = comm.CommCounter()
    out = cp_attention(q, k, v, comm_type=comm_type, q_index=index, q_doc=docs, comm=comm.Communicator(counter), **kw)
    forward = counter.reset()
    out.sum().backward()
    backward = counter.reset()
    return forward, backward


def test_ring_p2p_bytes_match_the_formula():
    cp, hq, hkv = 4, 4, 1
    forward, backward = run_distributed(_bytes_worker, cp, "p2p", "flat", hq, hkv, timeout=TIMEOUT)[0]
    s = SEQ // cp
    kv_bytes = 2 * BATCH * s * hkv * DIM * 4  # this rank's K and V (fp32); the query heads never travel
    # Forward: K/V travel cp - 1 hops. Backward: K/V again cp - 1 hops, and dK/dV (fp32) cp hops:
    # they ride along with their K/V and take one more hop home at the end.
    assert forward["p2p"] == (cp - 1) * kv_bytes
    assert backward["p2p"] == (cp - 1) * kv_bytes + cp * kv_bytes
    # Plus, once per call, the all-gather of every rank's token indices and document ids (int64).
    assert forward["all_gather"] == cp * s * 8 + BATCH * cp * s * 8
    assert set(forward) == {"p2p", "all_gather"} and set(backward) == {"p2p"}


def test_hierarchical_bytes_match_the_formula():
    cp, inner, hq, hkv = 4, 2, 4, 1
    forward, backward = run_distributed(_bytes_worker, cp, "a2a+p2p", "consecutive", hq, hkv, timeout=TIMEOUT)[0]
    s, outer = SEQ // cp, cp // inner
    kv_rep = max(hkv, inner)  # K/V heads replicated up to the a2a size
    qkv_bytes = BATCH * s * (hq + 2 * kv_rep) * DIM * 4
    out_bytes = BATCH * s * hq * DIM * 4
    assert forward["all_to_all"] == qkv_bytes + out_bytes and backward["all_to_all"] == qkv_bytes + out_bytes
    # The ring runs after the a2a: inner * s tokens per rank, kv_rep / inner K/V heads.
    ring_kv = 2 * BATCH * (inner * s) * (kv_rep // inner) * DIM * 4
    assert forward["p2p"] == (outer - 1) * ring_kv
    assert backward["p2p"] == (outer - 1) * ring_kv + outer * ring_kv


def _bad_heads_worker(rank, world):
    q, k = torch.zeros(1, 4, 3, 2), torch.zeros(1, 4, 1, 2)
    try:
        cp_attention(q, k, k, comm_type="a2a", cp_group=dist.group.WORLD, q_index=zigzag_indices(8, 2, rank))
    except ValueError as e:
        return str(e)
    return None


def test_a2a_with_indivisible_heads_raises_value_error():
    for message in run_distributed(_bad_heads_worker, 2, timeout=TIMEOUT):
        assert message is not None and "3 query heads" in message and "use --cp-comm-type p2p" in message
