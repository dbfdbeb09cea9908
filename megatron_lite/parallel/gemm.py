"""The one path of every weight GEMM: forward y = x W^T, input gradient g W, weight gradient g^T x,
dense or grouped over experts, and when the weight gradients are computed (zero-bubble deferral).

The autograd functions of the layers (tensor_parallel.py, moe/experts.py) do the layout work (TP
collectives, SP gathers, expert splits) and leave the arithmetic to one `GemmPath` chosen at
build time (`BuildContext.gemm`). A precision recipe (FP8) is a subclass replacing the
primitives; each GEMM call gets `new_call()`'s object in forward and the same one in backward,
for what the recipe keeps in between (quantized operands, scales) beyond the input and weight
that autograd saves.

Deferral (zero-bubble pipeline schedules): while a `deferrable` path is `deferring`, weight
gradients are queued instead of computed; the executor `take()`s the queue of a B pass and
`run()`s it as the W pass, adding them to the parameters themselves (under activation
recomputation autograd saves detached copies, and a gradient put on one is lost).
"""
from __future__ import annotations

import collections
from typing import Callable, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F


def accumulate_grad(param: nn.Parameter, grad: torch.Tensor) -> None:
    """Add `grad` to param.grad outside autograd, or hand it to the grad-sync machinery if any (into
    its gradient buffers: at ZeRO-3 the parameter may be released, its storage empty, by then)."""
    hook = getattr(param, "grad_ready_hook", None)
    if hook is not None:
        hook(param, grad)
    elif param.grad is None:
        param.grad = grad.to(param.dtype)
    else:
        param.grad.add_(grad)


def keep_precision(param: nn.Parameter) -> nn.Parameter:
    """Mark a weight whose GEMMs a precision recipe leaves in the params dtype (the output layer)."""
    param.keep_precision = True
    return param


class GemmPath:
    """Today's math in the operands' dtype. `deferrable`: built for a zero-bubble schedule, whose
    executor sets `deferring` around each B pass."""

    grouped_kernel = True  # grouped_* are one kernel; False: the experts' GEMMs loop over the experts

    def __init__(self, deferrable: bool = False):
        self.deferrable, self.deferring = deferrable, False
        self.queue: list = []

    def new_call(self, batches=None, order=None):
        """What one GEMM call's forward leaves to its backward: nothing here. `batches`: (the
        micro-batch of each input row, how many) where the rows come from several (EP over DP);
        `order`: (each row's place in the single-process order of its micro-batch's rows, their
        number) where the rows are an expert's (moe/dispatcher.py)."""
        return None

    # --- the primitives: x the input, w the weight [out, in], g the output gradient ----------------
    def forward(self, call, x, w, bias=None):
        return F.linear(x, w, bias)

    def input_grad(self, call, g, w):
        return g.matmul(w)

    def weight_grad(self, call, g, x):
        """g^T x over every leading dimension: [out, in]."""
        return g.reshape(-1, g.shape[-1]).t().matmul(x.reshape(-1, x.shape[-1]))

    # Grouped over experts: w [E, out, in], the rows of expert e end at offs[e].
    def grouped_forward(self, call, x, w, offs):
        return torch._grouped_mm(x, w.transpose(1, 2), offs=offs)

    def grouped_input_grad(self, call, g, w, offs):
        return torch._grouped_mm(g, w, offs=offs)

    def grouped_weight_grad(self, call, g, x, offs):
        return torch._grouped_mm(g.t(), x, offs=offs)

    # --- when weight gradients are computed -----------------------------------------------------
    def param_grads(self, params: Sequence, compute: Callable[[], tuple]) -> tuple:
        """compute(): the gradients of `params` (None where not wanted), for autograd to return;
        while deferring, queued for the W pass instead, and Nones returned."""
        if self.deferring:
            self.queue.append((params, compute))
            return (None,) * len(params)
        return compute()

    def linear_grads(self, call, g, x, weight, bias, need_weight: bool, need_bias: bool) -> tuple:
        """param_grads of (weight, bias) for y = x W^T + b."""
        def compute():
            return (self.weight_grad(call, g, x) if need_weight else None,
                    g.reshape(-1, g.shape[-1]).sum(0) if need_bias else None)
        return self.param_grads((weight, bias), compute)

    def take(self) -> list:
        """The weight-gradient work queued so far (for one B pass), emptying the queue."""
        queue, self.queue = self.queue, []
        return queue

    @torch.no_grad()
    def run(self, queue: list) -> None:
        # A weight of several GEMMs in one pass (the output layer shared by multi-token prediction)
        # gets their sum at once: the grad-sync machinery counts one gradient per micro-batch.
        left = collections.Counter(id(p) for params, _ in queue for p in params if p is not None)
        partial = {}
        for params, compute in queue:
            for param, grad in zip(params, compute()):
                if param is None:
                    continue
                if grad is not None:
                    partial[id(param)] = grad if id(param) not in partial else partial[id(param)].add_(grad)
                left[id(param)] -= 1
                if not left[id(param)] and id(param) in partial:
                    accumulate_grad(param, partial.pop(id(param)))

    def flush(self) -> None:
        """Run every queued weight-gradient pass now."""
        self.run(self.take())


def apply(fn, gemm: GemmPath, *args):
    """fn.apply(*args) for an autograd function whose weight gradients `gemm` computes."""
    return _eager_apply(fn, *args) if gemm.deferrable else fn.apply(*args)


def _eager_apply(fn, *args):
    """Outside torch.compile (--compile): a compiled backward would fix `gemm.deferring` at its
    value when the forward was traced, and the W pass of zero-bubble schedules would get nothing.
    The disable is made only while compiling: the decorator imports torch._dynamo, seconds of
    every start-up that only --compile needs."""
    if torch.compiler.is_compiling():
        return torch.compiler.disable(fn.apply)(*args)
    return fn.apply(*args)
