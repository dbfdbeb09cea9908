"""Building the optimizer of a model: its GradientSync (buffers, buckets, DP communication, ZeRO
storage) first, then the DistributedOptimizer over that sync's shards."""
from __future__ import annotations

from typing import List, Tuple

import torch
import torch.nn as nn

from ..config import ParallelConfig, TrainingConfig
from ..parallel.data_parallel import GradientSync
from ..parallel.state import ParallelDims
from .distributed_optimizer import DistributedOptimizer, no_weight_decay

__all__ = ["build_optimizer", "DistributedOptimizer", "no_weight_decay"]


def build_optimizer(chunks: List[nn.Module], dims: ParallelDims, tcfg: TrainingConfig,
                    pcfg: ParallelConfig) -> Tuple[DistributedOptimizer, GradientSync]:
    """(optimizer, grad_sync) for this rank's model chunks. Build it before the first forward:
    at ZeRO-3 it shards the parameters, gathering and freeing each chunk's `sharding_units()`
    (when the model has them) together."""
    units = [c.sharding_units() if hasattr(c, "sharding_units") else [] for c in chunks]
    grad_sync = GradientSync(chunks, dims, zero_stage=pcfg.zero_stage, bucket_size=pcfg.ddp_bucket_size,
                             overlap_grad_reduce=pcfg.overlap_grad_reduce,
                             overlap_param_gather=pcfg.overlap_param_gather,
                             grad_dtype=torch.bfloat16 if pcfg.grad_reduce_in_bf16 else torch.float32, units=units)
    return DistributedOptimizer(grad_sync, tcfg), grad_sync
