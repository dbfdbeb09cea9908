"""The fused block-attention path (flash-attention kernels that return the LSE) against the
pure-PyTorch reference path of the same module.

The sub-block planner covers exactly the visible pairs; forward (out, lse) and the final-LSE
backward (dq, dk, dv, fed the MERGED out and lse of a 2-block split, as the ring does) agree
with the reference in fp32 and bf16, MHA and GQA, causal and fully visible blocks; windows,
documents, dropout and a gradient on the lse fall back to the reference. The CUDA kernels are
checked the same way where a GPU is present (they are opt-in: block_attention.fused_cuda).
"""
import pytest
import torch

from megatron_lite.parallel.context_parallel import zigzag_indices
from megatron_lite.testing import assert_close
from megatron_lite.kernels import block_attention as ba
from megatron_lite.kernels.block_attention import (attention_block, attention_block_backward, merge_partials,
                                                   softmax_delta, visibility_mask)


@pytest.fixture
def path(monkeypatch):
    """path(fused: bool): switch the module between the fused and the reference path."""
    def set_path(fused: bool, cuda: bool = False):
        monkeypatch.setattr(ba, "use_fused", fused)
        monkeypatch.setattr(ba, "fused_cuda", cuda)
    return set_path


def _zig(seq, cp, r):
    return zigzag_indices(seq, cp, r)


# (name, q_index, k_index): the layouts CP produces, and odd ones (overlapping runs, shuffled).
LAYOUTS = [
    ("square", torch.arange(16), torch.arange(16)),
    ("zigzag_local", _zig(32, 2, 0), _zig(32, 2, 0)),
    ("zigzag_from_lower", _zig(32, 2, 1), _zig(32, 2, 0)),
    ("zigzag_from_higher", _zig(32, 2, 0), _zig(32, 2, 1)),
    ("allgather_kv", _zig(32, 2, 1), torch.cat([_zig(32, 2, 0), _zig(32, 2, 1)])),
    ("ulysses_gathered", torch.cat([_zig(48, 3, r) for r in range(3)]), torch.cat([_zig(48, 3, r) for r in range(3)])),
    ("overlapping_runs", torch.arange(10, 21), torch.arange(15, 31)),
    ("keys_after", torch.arange(0, 6), torch.arange(3, 12)),  # rows 0-2 see no key
    ("shuffled", torch.tensor([9, 2, 5, 7, 0, 4, 8]), torch.tensor([3, 8, 1, 6, 0, 2, 9, 5])),
]


def _qkv(b, sq, sk, hq, hkv, d, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(b, sq, hq, d, generator=gen).to(dtype), torch.randn(b, sk, hkv, d, generator=gen).to(dtype),
            torch.randn(b, sk, hkv, d, generator=gen).to(dtype))


@pytest.mark.parametrize("name,q_index,k_index", LAYOUTS, ids=[c[0] for c in LAYOUTS])
def test_sub_blocks_cover_exactly_the_visible_pairs(name, q_index, k_index, path):
    path(True)
    q, k, _ = _qkv(1, len(q_index), len(k_index), 2, 1, 8, torch.float32)
    blocks = ba._fused_blocks(q, k, q_index, k_index, None, True, None, 0.0)
    assert blocks is not None
    covered = torch.zeros(len(q_index), len(k_index), dtype=torch.int64)
    for rows, cols, causal in blocks:
        if causal:  # the same run of consecutive indices on both sides
            assert torch.equal(q_index[rows], k_index[cols])
            assert torch.equal(q_index[rows], torch.arange(int(q_index[rows][0]), int(q_index[rows][0]) + len(q_index[rows])))
            covered[rows, cols] += torch.ones(len(q_index[rows]), len(k_index[cols]), dtype=torch.int64).tril()
        else:
            assert k_index[cols].max() < q_index[rows].min()
            covered[rows, cols] += 1
    assert torch.equal(covered, visibility_mask(q_index, k_index)[0].long()), "each visible pair exactly once"
    # The CP layouts need only a few kernel calls.
    if name.startswith("zigzag") or name == "allgather_kv":
        assert len(blocks) <= 4
    # Not causal: one fully visible block.
    assert ba._fused_blocks(q, k, q_index, k_index, None, False, None, 0.0) == [
        (slice(0, len(q_index)), slice(0, len(k_index)), False)]


def test_window_documents_dropout_and_switch_fall_back_to_the_reference(path):
    path(True)
    q, k, _ = _qkv(1, 8, 8, 2, 1, 8, torch.float32)
    idx, doc = torch.arange(8), torch.zeros(1, 8, dtype=torch.long)
    assert ba._fused_blocks(q, k, idx, idx, None, True, None, 0.0) is not None
    assert ba._fused_blocks(q, k, idx, idx, None, True, 3, 0.0) is None
    assert ba._fused_blocks(q, k, idx, idx, doc, True, None, 0.0) is None
    assert ba._fused_blocks(q, k, idx, idx, None, True, None, 0.1) is None
    scattered = torch.randperm(64, generator=torch.Generator().manual_seed(0))
    big_q, big_k, _ = _qkv(1, 64, 64, 2, 1, 8, torch.float32)
    assert ba._fused_blocks(big_q, big_k, scattered, scattered, None, True, None, 0.0) is None  # too many pieces
    path(False)
    assert ba._fused_blocks(q, k, idx, idx, None, True, None, 0.0) is None


def _forward_backward(q, k, v, dout, **kw):
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out, lse = attention_block(q, k, v, **kw)
    out.backward(dout)
    return out.detach(), lse.detach(), q.grad, k.grad, v.grad


CASES = [(hq, hkv, causal) for hq, hkv in ((4, 4), (4, 2), (6, 1)) for causal in (True, False)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hq,hkv,causal", CASES)
@pytest.mark.parametrize("name,q_index,k_index", LAYOUTS[:-1], ids=[c[0] for c in LAYOUTS[:-1]])
def test_fused_block_matches_reference(name, q_index, k_index, hq, hkv, causal, dtype, path):
    q, k, v = _qkv(2, len(q_index), len(k_index), hq, hkv, 16, dtype, seed=len(name))
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    kw = dict(q_index=q_index, k_index=k_index, causal=causal, softmax_scale=0.37)
    path(False)
    ref = _forward_backward(q, k, v, dout, **kw)
    path(True)
    assert ba._fused_blocks(q, k, q_index, k_index, None, causal, None, 0.0) is not None
    got = _forward_backward(q, k, v, dout, **kw)
    assert got[1].dtype == torch.float32 and got[0].dtype == dtype and got[2].dtype == dtype
    assert torch.equal(torch.isinf(got[1]), torch.isinf(ref[1])), "the same rows see no key"
    if name == "keys_after" and causal:
        assert torch.isinf(got[1]).any() and torch.all(got[0].transpose(1, 2)[torch.isinf(got[1])] == 0)
    rtol = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: both round out/grads to bf16
    for label, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, ref):
        assert torch.isfinite(a[~torch.isinf(a)]).all()
        finite = ~torch.isinf(b)
        assert_close(a[finite], b[finite], rtol=rtol, what=f"{name} {dtype} {label}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (4, 2)])
def test_fused_backward_from_the_final_out_and_lse_of_a_two_block_merge(hq, hkv, dtype, path):
    """The ring's trick: each block's kernel backward is fed the MERGED out and lse, not its own."""
    s = 24
    q_index = torch.arange(s, 2 * s)  # the queries' own chunk (causal block) and an earlier one (full)
    k_index = torch.arange(2 * s)
    q, k, v = _qkv(2, s, 2 * s, hq, hkv, 16, dtype, seed=3)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(4)).to(dtype)
    acc = torch.float32
    parts = [slice(0, s), slice(s, 2 * s)]  # full, then causal
    path(True)
    halves = [attention_block(q, k[:, c], v[:, c], q_index=q_index, k_index=k_index[c], out_dtype=acc)
              for c in parts]
    out, lse = merge_partials(halves[0][0], halves[0][1], halves[1][0], halves[1][1])
    out = out.to(dtype)  # as the ring saves it
    delta = softmax_delta(dout, out)
    results = {}
    for fused in (True, False):
        path(fused)
        grads = torch.zeros(q.shape, dtype=acc), torch.zeros(k.shape, dtype=acc), torch.zeros(v.shape, dtype=acc)
        for c in parts:
            kw = dict(q_index=q_index, k_index=k_index[c])
            if fused:
                assert ba._fused_blocks(q, k[:, c], q_index, k_index[c], None, True, None, 0.0) is not None
                gq, gk, gv = attention_block_backward(dout, q, k[:, c], v[:, c], lse, out=out, **kw)
            else:
                gq, gk, gv = attention_block_backward(dout, q, k[:, c], v[:, c], lse, delta, **kw)
            assert gq.dtype == gk.dtype == acc
            grads[0].add_(gq)
            grads[1][:, c] += gk
            grads[2][:, c] += gv
        results[fused] = grads
    # And both equal autograd through one block over all keys (fp32 reference path).
    q_, k_, v_ = (t.float().requires_grad_() for t in (q, k, v))
    path(False)
    whole, _ = attention_block(q_, k_, v_, q_index=q_index, k_index=k_index)
    whole.backward(dout.float())
    rtol = 1e-5 if dtype == torch.float32 else 1e-2
    for label, a, b, c in zip(("dq", "dk", "dv"), results[True], results[False], (q_.grad, k_.grad, v_.grad)):
        assert_close(a, b, rtol=1e-5, what=f"fused vs reference {label} from the final lse ({dtype})")
        assert_close(a, c, rtol=rtol, what=f"{label} vs whole-attention autograd ({dtype})")


def test_gradient_on_lse_uses_the_reference_backward(path):
    q, k, v = _qkv(1, 8, 8, 4, 2, 8, torch.float64)
    idx = torch.arange(8)
    grads = {}
    for fused in (True, False):
        path(fused)
        q_, k_, v_ = (t.clone().requires_grad_() for t in (q, k, v))
        out, lse = attention_block(q_, k_, v_, q_index=idx, k_index=idx)
        (out.square().sum() + lse.sum()).backward()
        grads[fused] = (q_.grad, k_.grad, v_.grad)
        lse_only = attention_block(*(t.clone().requires_grad_() for t in (q, k, v)), q_index=idx, k_index=idx)[1]
        lse_only.sum().backward()  # out unused: dout is None
    for a, b in zip(grads[True], grads[False]):
        assert_close(a, b, rtol=1e-12, what="grad with an lse term")
    path(True)
    q_, k_, v_ = (t.clone().requires_grad_() for t in (q, k, v))
    assert torch.autograd.gradcheck(lambda q, k, v: attention_block(q, k, v, q_index=idx, k_index=idx), (q_, k_, v_))


# --- the CP comm types take the fused path, and match their reference-path selves ----------------
def _cp_worker(rank, world, comm_type, causal):
    import torch.distributed as dist
    from megatron_lite.parallel.context_parallel import cp_attention
    group = dist.new_group(list(range(world)))
    calls = {"forward": 0, "backward": 0}
    kernel_forward, kernel_backward = ba._kernel_forward, ba._kernel_backward

    def count(name, fn):
        def wrapped(*a, **kw):
            calls[name] += 1
            return fn(*a, **kw)
        return wrapped

    ba._kernel_forward, ba._kernel_backward = count("forward", kernel_forward), count("backward", kernel_backward)
    seq = 32
    index = zigzag_indices(seq, world, rank)
    q, k, v = (t[:, index] for t in _qkv(2, seq, seq, 4, 2, 8, torch.float32, seed=5))
    dout = torch.randn(2, seq, 4, 8, generator=torch.Generator().manual_seed(6))[:, index]
    results = {}
    for fused in (True, False):
        ba.use_fused = fused
        lq, lk, lv = (t.clone().requires_grad_() for t in (q, k, v))
        out = cp_attention(lq, lk, lv, comm_type=comm_type, q_index=index, cp_group=group, causal=causal)
        out.backward(dout)
        results[fused] = (out.detach(), lq.grad, lk.grad, lv.grad)
        if fused:
            counted = dict(calls)
    return counted, calls, results


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("comm_type", ["p2p", "all_gather", "a2a"])
def test_cp_comm_types_use_the_fused_kernels(comm_type, causal, path):
    from megatron_lite.testing import run_distributed
    path(True)
    for counted, calls, results in run_distributed(_cp_worker, 2, comm_type, causal, timeout=60):
        assert counted["forward"] > 0 and counted["backward"] > 0, "the fused kernels ran"
        assert calls == counted, "use_fused = False runs none of them"
        for label, a, b in zip(("out", "dq", "dk", "dv"), results[True], results[False]):
            assert_close(a, b, rtol=1e-5, what=f"{comm_type} fused vs reference {label}")


# --- CUDA kernels (opt-in; run where a GPU is present) -------------------------------------------
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (8, 2)])
@pytest.mark.parametrize("name,q_index,k_index", LAYOUTS[:-1], ids=[c[0] for c in LAYOUTS[:-1]])
def test_cuda_fused_block_matches_reference(name, q_index, k_index, hq, hkv, dtype, path):
    dev = torch.device("cuda")
    q, k, v = (t.to(dev) for t in _qkv(2, len(q_index), len(k_index), hq, hkv, 64, dtype, seed=len(name)))
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(1)).to(dtype).to(dev)
    kw = dict(q_index=q_index.to(dev), k_index=k_index.to(dev), causal=True)
    path(False)
    ref = _forward_backward(q, k, v, dout, **kw)
    path(True, cuda=True)
    assert ba._fused_blocks(q, k, kw["q_index"], kw["k_index"], None, True, None, 0.0) is not None
    got = _forward_backward(q, k, v, dout, **kw)
    rtol = 1e-4 if dtype == torch.float32 else 2e-2
    for label, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, ref):
        finite = ~torch.isinf(b)
        assert torch.equal(torch.isinf(a), ~finite)
        assert_close(a[finite].cpu(), b[finite].cpu(), rtol=rtol, what=f"cuda {name} {dtype} {label}")
