"""Gradient bookkeeping across model-parallel ranks: the reductions every layout needs after
backward (besides data parallelism), as each parameter's ShardSpec says."""
from __future__ import annotations

from typing import Dict, Iterable, List, Tuple

import torch
import torch.nn as nn

from .sharding import spec_of
from .state import ParallelDims


def _grad_of(p: nn.Parameter):
    return getattr(p, "main_grad", None) if getattr(p, "main_grad", None) is not None else p.grad


def _partial_over(p: nn.Parameter, dims: ParallelDims) -> List[Tuple[str, object]]:
    """(key, group) of every group over which this parameter's gradient is a partial sum."""
    spec, out = spec_of(p), []
    if spec.sequence_parallel and dims.tp > 1:
        out.append(("tp", dims.tp_group))
    replicas = spec.replicas("tp")
    if replicas > 1:
        out.append((f"tp_sub{replicas}", dims.tp_replica_group(replicas)))
    if spec.tie is not None and dims.pp > 1:
        out.append(("embedding", dims.embedding_group))
    return out


def finalize_model_grads(params: Iterable[nn.Parameter], dims: ParallelDims) -> None:
    """Sum the partial gradients that model parallelism leaves behind, one all-reduce per group
    over a flat buffer of every gradient that needs it:
    - sequence-parallel replicated params (norms, row-parallel biases) saw only their sequence
      slice on each TP rank: over TP;
    - K/V weights replicated on several TP ranks: over those ranks;
    - a tied weight's copies on the first and last pipeline stage: over both."""
    by_group: Dict[str, Tuple[object, List[torch.Tensor]]] = {}
    for p in params:
        g = _grad_of(p)
        if g is None:
            continue
        for key, group in _partial_over(p, dims):
            by_group.setdefault(key, (group, []))[1].append(g)
    for key in sorted(by_group):  # the same order on every rank
        group, grads = by_group[key]
        if len(grads) == 1:
            dims.comm.all_reduce(grads[0], group)
            continue
        flat = torch.cat([g.reshape(-1) for g in grads])
        dims.comm.all_reduce(flat, group)
        for g, piece in zip(grads, flat.split([g.numel() for g in grads])):
            g.copy_(piece.view_as(g))


def sum_local_tie_copies(params: Iterable[nn.Parameter]) -> None:
    """Sum the gradients of a tied weight's copies held by this one rank (the V placement puts
    the first and the last pipeline stage, the embedding and the output layer, on rank 0), as the
    all-reduce over the embedding group does when they sit on two ranks. Each copy then holds
    the sum, so both take the same update and stay equal."""
    copies: Dict[str, List[torch.Tensor]] = {}
    for p in params:
        tie, g = spec_of(p).tie, _grad_of(p)
        if tie is not None and g is not None:
            copies.setdefault(tie.name, []).append(g)
    for name in sorted(copies):
        grads = copies[name]
        if len(grads) > 1:
            total = torch.stack(grads).sum(0)
            for g in grads:
                g.copy_(total)
