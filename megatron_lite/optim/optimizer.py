"""Building the optimizer of a model: its GradientSync (buffers, buckets, DP communication, ZeRO
storage) first, then the DistributedOptimizer over that sync's shards."""
from __future__ import annotations

from typing import List, Tuple

import torch.nn as nn

from ..config import ParallelConfig, TrainingConfig
from ..parallel.data_parallel import GradientSync
from ..parallel.state import ParallelDims
from .distributed_optimizer import DistributedOptimizer, no_weight_decay

__all__ = ["build_optimizer", "DistributedOptimizer", "no_weight_decay"]


def build_optimizer(chunks: List[nn.Module], dims: ParallelDims, tcfg: TrainingConfig,
                    pcfg: ParallelConfig) -> Tuple[DistributedOptimizer, GradientSync]:
    """(optimizer, grad_sync) for this rank's model chunks. Build it before the first forward:
    at ZeRO-3 it shards the parameters."""
    grad_sync = GradientSync(chunks, dims, pcfg)
    return DistributedOptimizer(grad_sync, tcfg), grad_sync
