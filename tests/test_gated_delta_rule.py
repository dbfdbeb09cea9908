"""The gated delta rule (kernels/gated_delta.py): the chunked form, the per-token recurrent form and
the affine span summaries all equal a naive per-token fp64 loop written here from the definition,
forward and gradients, for a scalar decay per head (Gated DeltaNet) and a per-channel decay (KDA)."""
import pytest
import torch

from megatron_lite.kernels.gated_delta import (apply_summary, chunked_gated_delta_rule, compose,
                                               recurrent_gated_delta_rule, span_summary)


def naive(q, k, v, g, beta, state=None, scale=None):
    """Token by token, head by head, with explicit matrices (fp64)."""
    b, s, h, dk = q.shape
    dv = v.shape[-1]
    scale = dk ** -0.5 if scale is None else scale
    S = torch.zeros(b, h, dk, dv, dtype=torch.float64) if state is None else state.double()
    outs = torch.zeros(b, s, h, dv, dtype=torch.float64)
    for bi in range(b):
        for hi in range(h):
            St = S[bi, hi]
            for t in range(s):
                gt = g[bi, t, hi]
                D = torch.diag(gt.exp()) if gt.dim() else gt.exp() * torch.eye(dk, dtype=torch.float64)
                kt, vt = k[bi, t, hi].double(), v[bi, t, hi].double()
                St = D @ St
                St = St + beta[bi, t, hi] * torch.outer(kt, vt - St.T @ kt)
                outs[bi, t, hi] = St.T @ (q[bi, t, hi].double() * scale)
            S = S.clone()
            S[bi, hi] = St
    return outs, S


def inputs(b=2, s=11, h=3, dk=4, dv=5, per_channel=False, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, s, h, dk, generator=gen, dtype=dtype)
    k = torch.nn.functional.normalize(torch.randn(b, s, h, dk, generator=gen, dtype=dtype), dim=-1)
    v = torch.randn(b, s, h, dv, generator=gen, dtype=dtype)
    gshape = (b, s, h, dk) if per_channel else (b, s, h)
    g = -torch.rand(gshape, generator=gen, dtype=dtype) * 1.5  # log decay in [-1.5, 0]
    beta = torch.rand(b, s, h, generator=gen, dtype=dtype)
    state = torch.randn(b, h, dk, dv, generator=gen, dtype=dtype)
    return q, k, v, g, beta, state


@pytest.mark.parametrize("per_channel", [False, True], ids=["gdn", "kda"])
@pytest.mark.parametrize("chunk", [1, 3, 4, 11, 16])
def test_chunked_equals_naive_with_initial_state(per_channel, chunk):
    q, k, v, g, beta, state = inputs(per_channel=per_channel)
    want, want_state = naive(q, k, v, g, beta, state)
    out, final = chunked_gated_delta_rule(q, k, v, g, beta, state, chunk_size=chunk)
    torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(final, want_state, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("per_channel", [False, True], ids=["gdn", "kda"])
def test_recurrent_equals_naive_and_fp32_stays_close(per_channel):
    q, k, v, g, beta, state = inputs(per_channel=per_channel, s=9)
    want, want_state = naive(q, k, v, g, beta, state, scale=0.3)
    out, final = recurrent_gated_delta_rule(q, k, v, g, beta, state, scale=0.3)
    torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(final, want_state, rtol=1e-10, atol=1e-10)
    f32 = [x.float() for x in (q, k, v, g, beta, state)]
    out32, final32 = chunked_gated_delta_rule(*f32, chunk_size=4, scale=0.3)
    assert out32.dtype == torch.float32 and final32.dtype == torch.float32
    torch.testing.assert_close(out32.double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("per_channel", [False, True], ids=["gdn", "kda"])
def test_gradients_match_naive_and_gradcheck(per_channel):
    args = [x.requires_grad_() for x in inputs(b=1, s=7, h=2, dk=3, dv=2, per_channel=per_channel)]
    weights = torch.randn(1, 7, 2, 2, dtype=torch.float64)
    state_weights = torch.randn(1, 2, 3, 2, dtype=torch.float64)

    def loss(fn, *a):
        out, final = fn(*a)
        return (out * weights).sum() + (final * state_weights).sum()
    want = torch.autograd.grad(loss(naive, *args), args)
    for fn in (lambda *a: chunked_gated_delta_rule(*a, chunk_size=3), recurrent_gated_delta_rule):
        got = torch.autograd.grad(loss(fn, *args), args)
        for w, gr in zip(want, got):
            torch.testing.assert_close(gr, w, rtol=1e-9, atol=1e-10)
    assert torch.autograd.gradcheck(lambda *a: chunked_gated_delta_rule(*a, chunk_size=2), args)


@pytest.mark.parametrize("per_channel", [False, True], ids=["gdn", "kda"])
def test_span_summaries_compose_to_running_both_spans(per_channel):
    q, k, v, g, beta, state = inputs(s=13, per_channel=per_channel)
    want, want_state = naive(q, k, v, g, beta, state)
    cut = 6
    first = span_summary(*(x[:, :cut] for x in (q, k, v, g, beta)), chunk_size=4)
    second = span_summary(*(x[:, cut:] for x in (q, k, v, g, beta)), chunk_size=4)
    out, final = apply_summary(compose(first, second), state)
    torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(final, want_state, rtol=1e-10, atol=1e-10)
    # the second span alone, on the state the first hands it, gives the tail of the outputs
    mid_out, mid_state = apply_summary(first, state)
    tail, _ = apply_summary(second, mid_state)
    torch.testing.assert_close(torch.cat([mid_out, tail], dim=1), want, rtol=1e-10, atol=1e-10)


def _fla_reason():
    from megatron_lite.kernels.fla_backend import missing_reason
    return missing_reason()


@pytest.mark.skipif(_fla_reason() is not None, reason=f"the fla path cannot run here: {_fla_reason()}")
@pytest.mark.parametrize("per_channel", [False, True], ids=["gdn", "kda"])
def test_fla_kernels_equal_the_torch_path(per_channel):
    """flash-linear-attention's kernels (CUDA) against the plain-torch chunked rule: outputs, final
    state and input gradients, in float32."""
    from megatron_lite.kernels.fla_backend import fla_gated_delta_rule
    args = [x.float().cuda().requires_grad_() for x in inputs(b=2, s=100, h=4, dk=64, dv=64,
                                                               per_channel=per_channel)]
    outs = [fn(*args) for fn in (fla_gated_delta_rule, lambda *a: chunked_gated_delta_rule(*a, chunk_size=16))]
    for got, want in zip(*outs):
        torch.testing.assert_close(got, want, rtol=2e-3, atol=2e-3)
    weights = torch.randn_like(outs[0][0])
    grads = [torch.autograd.grad((o * weights).sum() + s.sum(), args) for o, s in outs]
    for got, want in zip(*grads):
        torch.testing.assert_close(got, want, rtol=5e-3, atol=5e-3)
