"""Backpropagation without the autograd engine, for the fake-CUDA dry run.

torch's CPU-only build has no accelerator for the C++ autograd engine: `loss.backward()` on a `cuda`
fake tensor fails ("Cannot access accelerator device when none is available"), whatever stands in
for the device. The graph itself is fine, and each of its nodes can be called from Python. So this
walks it: nodes in topological order, each called with the sum of the gradients its consumers
sent, a leaf's gradient accumulated into `.grad` and its post-accumulate hooks run (the gradient
buffers' hooks, as the engine would). Node hooks, tensor hooks and engine callbacks are not run
(none of the dry run's layouts needs them: no ZeRO-3, no activation recomputation).
"""
from __future__ import annotations

from collections import Counter
from typing import Dict, List, Optional

import torch


def _edges(node):
    return [(nxt, nr) for nxt, nr in node.next_functions if nxt is not None]


def _dependencies(root) -> Counter:
    deps, seen, stack = Counter(), {root}, [root]
    while stack:
        node = stack.pop()
        for nxt, _ in _edges(node):
            deps[nxt] += 1
            if nxt not in seen:
                seen.add(nxt)
                stack.append(nxt)
    return deps


def _accumulate(leaf: torch.Tensor, grad: torch.Tensor) -> None:
    leaf.grad = grad.to(leaf.dtype) if leaf.grad is None else leaf.grad + grad
    for hook in (getattr(leaf, "_post_accumulate_grad_hooks", None) or {}).values():
        hook(leaf)


def _as_input(node, nr: int, grad: torch.Tensor) -> torch.Tensor:
    """The gradient in the shape and dtype the node's input `nr` expects (a broadcast operand's
    gradient summed back to its shape), as the engine's output validation does."""
    meta = node._input_metadata[nr]
    shape = tuple(meta.shape)
    if tuple(grad.shape) != shape:
        grad = grad.sum_to_size(shape)
    return grad.to(meta.dtype) if grad.dtype != meta.dtype else grad


def _call(node, grads: List[Optional[torch.Tensor]]):
    if hasattr(node, "_forward_cls"):  # a Python autograd.Function: its backward
        out = node.apply(*grads)
    else:
        out = node(*grads)
    return out if isinstance(out, tuple) else (out,)


@torch.no_grad()  # as the engine runs a backward without create_graph
def backward(loss: torch.Tensor, grad: Optional[torch.Tensor] = None) -> None:
    """loss.backward(grad), in Python."""
    root = loss.grad_fn
    if root is None:
        raise ValueError("backward: the loss has no gradient function")
    deps = _dependencies(root)
    pending: Dict[object, Dict[int, torch.Tensor]] = {root: {0: torch.ones_like(loss) if grad is None else grad}}
    ready = [root]
    while ready:
        node = ready.pop()
        inputs = pending.pop(node, {})
        if node.name() == "torch::autograd::AccumulateGrad":
            if 0 in inputs:
                _accumulate(node.variable, inputs[0])
            continue
        grads = [inputs.get(i) for i in range(len(node._input_metadata))]
        outs = _call(node, grads) if any(g is not None for g in grads) else ()
        for (nxt, nr), g in zip(node.next_functions, list(outs) + [None] * len(node.next_functions)):
            if nxt is None:
                continue
            if g is not None:
                g = _as_input(nxt, nr, g)
                slot = pending.setdefault(nxt, {})
                slot[nr] = g if nr not in slot else slot[nr] + g
            deps[nxt] -= 1
            if deps[nxt] == 0:
                ready.append(nxt)
