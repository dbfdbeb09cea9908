"""Gradient bookkeeping across model-parallel ranks: the reductions every layout needs after
backward (besides data parallelism), as each parameter's ShardSpec says."""
from __future__ import annotations

from typing import Iterable

import torch.nn as nn

from . import comm
from .sharding import spec_of
from .state import ParallelDims


def _grad_of(p: nn.Parameter):
    return getattr(p, "main_grad", None) if getattr(p, "main_grad", None) is not None else p.grad


def finalize_model_grads(params: Iterable[nn.Parameter], dims: ParallelDims) -> None:
    """Sum the partial gradients that model parallelism leaves behind:
    - sequence-parallel replicated params (norms, row-parallel biases) saw only their sequence
      slice on each TP rank: all-reduce over TP;
    - K/V weights replicated on several TP ranks: all-reduce over those ranks;
    - a tied weight's copies on the first and last pipeline stage: all-reduce over both."""
    for p in params:
        g = _grad_of(p)
        if g is None:
            continue
        spec = spec_of(p)
        if spec.sequence_parallel:
            comm.all_reduce(g, dims.tp_group, counter=dims.comm_counter)
        if spec.replicas("tp") > 1:
            comm.all_reduce(g, dims.tp_replica_group(spec.replicas("tp")), counter=dims.comm_counter)
        if spec.tie is not None:
            comm.all_reduce(g, dims.embedding_group, counter=dims.comm_counter)
