"""A norm and a gated unit whose backward keeps only what Korthikanti et al. count, so that a bf16
layer keeps no more: RMSNorm its input and the fp32 1/rms (not the fp32 copy of its input nor its
normalized value), SwiGLU its [gate | up] (not silu(gate) beside it). Each recomputes the rest in
backward, a few elementwise passes, and works its gradient into as few buffers as autograd's own
backward needs. SwiGLU's gradients are autograd's bit for bit (the same kernels in the same order);
RMSNorm's come from the closed form (fp32, as autograd's composite; equal to ~1e-7). Under
torch.compile, or without gradients, the plain functions run.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def _plain(*inputs: torch.Tensor) -> bool:
    return not torch.is_grad_enabled() or torch.compiler.is_compiling() or not any(t.requires_grad for t in inputs)


class _RMSNorm(torch.autograd.Function):
    """w * rms_norm(x in fp32) cast back to x's dtype, w = weight (+ 1 when zero-centered); keeps x
    and the fp32 1/rms (4 bytes a token). Backward: dx = rstd (dn - n mean(dn n)), n = x rstd,
    dn = g w, worked in place (fp32, as autograd's)."""

    @staticmethod
    def forward(ctx, x, weight, eps, zero_centered):
        ctx.zero_centered = zero_centered
        x32 = x.float()
        rstd = torch.rsqrt(x32.square().mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, rstd)
        w = weight + 1 if zero_centered else weight
        return w * F.rms_norm(x32, x.shape[-1:], eps=eps).to(x.dtype)

    @staticmethod
    def backward(ctx, g):
        x, weight, rstd = ctx.saved_tensors
        n = x.float() * rstd
        grad_w = (g * n.to(x.dtype)).sum_to_size(weight.shape) if ctx.needs_input_grad[1] else None
        grad_x = None
        if ctx.needs_input_grad[0]:
            dn = (g * (weight + 1 if ctx.zero_centered else weight)).float()
            dot = (dn * n).mean(-1, keepdim=True)
            grad_x = dn.sub_(n.mul_(dot)).mul_(rstd).to(x.dtype)
        return grad_x, grad_w, None, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool) -> torch.Tensor:
    """Llama's RMSNorm: normalized in fp32, cast to x's dtype, times the weight (1 + weight when
    `zero_centered`); backward keeps x and the fp32 1/rms only."""
    if _plain(x, weight):
        w = weight + 1 if zero_centered else weight
        return w * F.rms_norm(x.float(), x.shape[-1:], eps=eps).to(x.dtype)
    return _RMSNorm.apply(x, weight, eps, zero_centered)


class _Gated(torch.autograd.Function):
    """act(gate) * up' over h = [gate | up]; keeps h. Backward writes both halves of the gradient
    into one buffer; SwiGLU without a clamp runs silu's own backward kernel into it (as autograd
    would), so it needs no more memory than autograd's backward over the kept silu(gate)."""

    @staticmethod
    def forward(ctx, unit, h):
        ctx.unit = unit
        ctx.save_for_backward(h)
        gate, up = h.chunk(2, dim=-1)
        return unit.act(gate) * unit.up(up)

    @staticmethod
    def backward(ctx, g):
        h, = ctx.saved_tensors
        unit, grad = ctx.unit, torch.empty_like(h)
        d_gate, d_up = grad.chunk(2, dim=-1)
        gate, up = h.detach().chunk(2, dim=-1)
        if unit.plain_silu:
            torch.mul(g, F.silu(gate), out=d_up)
            torch.ops.aten.silu_backward.grad_input(g * unit.up(up), gate, grad_input=d_gate)
            return None, grad
        gate, up = gate.detach().requires_grad_(), up.detach().requires_grad_()
        with torch.enable_grad():
            a, u = unit.act(gate), unit.up(up)
        d_gate.copy_(torch.autograd.grad(a, gate, g * u)[0])
        d_up.copy_(torch.autograd.grad(u, up, g * a)[0])
        return None, grad


def gated(unit, h: torch.Tensor) -> torch.Tensor:
    """unit.act(gate) * unit.up(up) over h = [gate | up] (last dimension), keeping only h for
    backward; `unit.plain_silu`: act is silu and up is up (+ a constant)."""
    if _plain(h):
        gate, up = h.chunk(2, dim=-1)
        return unit.act(gate) * unit.up(up)
    return _Gated.apply(unit, h)
