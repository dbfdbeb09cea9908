"""Mamba-2's SSD scan (megatron_lite/transformer/ssd.py): the chunked form, the per-token step and the
affine span summaries against a naive per-token loop in fp64, forward and gradients."""
import pytest
import torch

from megatron_lite.transformer.ssd import apply, compose, ssd_chunked, ssd_step, ssd_summary


def naive_scan(x, dt, A, B, C, state=None, reset=None):
    """The recurrence token by token in fp64: S = exp(dt A) S + dt x B^T, y = S C."""
    b, s, H, p = x.shape
    G, n = B.shape[2], B.shape[3]
    x, dt, A, B, C = (t.double() for t in (x, dt, A, B, C))
    S = torch.zeros(b, H, p, n, dtype=torch.float64) if state is None else state.double()
    ys = []
    for t in range(s):
        if reset is not None:
            S = S * (~reset[:, t]).double()[:, None, None, None]
        Bh, Ch = (u[:, t].repeat_interleave(H // G, dim=1) for u in (B, C))
        S = torch.exp(dt[:, t] * A)[..., None, None] * S + dt[:, t, :, None, None] * x[:, t, ..., None] * Bh[:, :, None]
        ys.append(torch.einsum("bhpn,bhn->bhp", S, Ch))
    return torch.stack(ys, 1), S


def inputs(b=2, s=13, H=4, G=2, p=3, n=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, s, H, p, generator=g)
    dt = torch.nn.functional.softplus(torch.randn(b, s, H, generator=g))
    A = -torch.rand(H, generator=g) * 2 - 0.1
    B, C = torch.randn(b, s, G, n, generator=g), torch.randn(b, s, G, n, generator=g)
    state = torch.randn(b, H, p, n, generator=g)
    return [t.requires_grad_() for t in (x, dt, A, B, C, state)]


def grads(out, ins, seed=1):
    g = torch.Generator().manual_seed(seed)
    loss = sum((o.double() * torch.randn(o.shape, generator=g, dtype=torch.float64)).sum() for o in out)
    return torch.autograd.grad(loss, ins)


@pytest.mark.parametrize("chunk", [1, 4, 5, 13, 16])
def test_chunked_equals_naive_forward_and_gradients(chunk):
    x, dt, A, B, C, state = ins = inputs()
    reset = torch.zeros(2, 13, dtype=torch.bool)
    reset[0, 6], reset[1, 0], reset[1, 9] = True, True, True  # documents: a state reset inside chunks and at 0
    ref = naive_scan(x, dt, A, B, C, state, reset)
    out = ssd_chunked(x, dt, A, B, C, chunk, state, reset)
    for o, r in zip(out, ref):
        torch.testing.assert_close(o.double(), r, rtol=1e-5, atol=1e-5)
    for g, r in zip(grads(out, ins), grads(ref, ins)):
        torch.testing.assert_close(g.double(), r.double(), rtol=1e-4, atol=1e-4)


def test_recurrent_step_equals_naive_forward_and_gradients():
    x, dt, A, B, C, state = ins = inputs(s=7)
    ref = naive_scan(x, dt, A, B, C, state)
    S, ys = state, []
    for t in range(7):
        y, S = ssd_step(S, x[:, t], dt[:, t], A, B[:, t], C[:, t])
        ys.append(y)
    out = (torch.stack(ys, 1), S)
    for o, r in zip(out, ref):
        torch.testing.assert_close(o.double(), r, rtol=1e-5, atol=1e-5)
    for g, r in zip(grads(out, ins), grads(ref, ins)):
        torch.testing.assert_close(g.double(), r.double(), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("cut", [5, 8])
def test_composed_span_summaries_equal_the_whole_run(cut):
    """Two spans' summaries composed (and applied to an incoming state) = the scan over both: what a
    prefix scan over context-parallel ranks relies on; a reset in the second span cuts the chain."""
    x, dt, A, B, C, state = inputs(s=16)
    reset = torch.zeros(2, 16, dtype=torch.bool)
    reset[1, 11] = True
    parts = [ssd_summary(x[:, sl], dt[:, sl], A, B[:, sl], C[:, sl], 4, reset[:, sl])
             for sl in (slice(0, cut), slice(cut, 16))]
    y, final = apply(compose(*parts), state)
    ref_y, ref_final = naive_scan(x, dt, A, B, C, state, reset)
    torch.testing.assert_close(y.double(), ref_y, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(final.double(), ref_final, rtol=1e-5, atol=1e-5)
    # the second span's decay is 0 for the sequence with a reset: its final state ignores the first span
    assert parts[1].M[1].abs().max() == 0 and parts[1].M[0].abs().min() > 0
