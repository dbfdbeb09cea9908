"""Gradient bookkeeping across model-parallel ranks: the reductions every layout needs after
backward (besides data parallelism), and which ranks count a parameter in the global norm."""
from __future__ import annotations

from typing import Iterable

import torch.nn as nn

from . import comm
from .state import ParallelDims


def _grad_of(p: nn.Parameter):
    return getattr(p, "main_grad", None) if getattr(p, "main_grad", None) is not None else p.grad


def finalize_model_grads(params: Iterable[nn.Parameter], dims: ParallelDims) -> None:
    """Sum the partial gradients that model parallelism leaves behind:
    - sequence-parallel replicated params (norms, row-parallel biases) saw only their sequence
      slice on each TP rank: all-reduce over TP;
    - K/V weights replicated on several TP ranks: all-reduce over those ranks;
    - the tied word embedding on the first and last pipeline stage: all-reduce over both."""
    for p in params:
        g = _grad_of(p)
        if g is None:
            continue
        if getattr(p, "sequence_parallel", False):
            comm.all_reduce(g, dims.tp_group)
        replicas = getattr(p, "tp_replicas", 1)
        if replicas > 1:
            comm.all_reduce(g, dims.tp_replica_group(replicas))
        if getattr(p, "shared_embedding", False):
            comm.all_reduce(g, dims.embedding_group)


def counts_in_norm(p: nn.Parameter, dims: ParallelDims) -> bool:
    """True on exactly one of the model-parallel ranks holding each distinct gradient element."""
    if getattr(p, "shared_embedding", False) and not dims.is_first_stage:
        return False  # the last stage's copy of the tied embedding
    if getattr(p, "tensor_model_parallel", False):
        return dims.tp_rank % getattr(p, "tp_replicas", 1) == 0
    return dims.tp_rank == 0
