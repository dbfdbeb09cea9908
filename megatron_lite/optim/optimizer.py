"""Building the optimizer of a model: its GradientSync (buffers, buckets, DP communication, ZeRO
storage) first, then the DistributedOptimizer over that sync's shards."""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch
import torch.nn as nn

from ..config import ParallelConfig, TrainingConfig
from ..errors import ConfigError
from ..parallel.data_parallel import GradientSync
from ..parallel.state import ParallelDims, partial_dp_groups
from .distributed_optimizer import DistributedOptimizer, lr_group, no_weight_decay
from .precision import OptimizerPrecision

__all__ = ["build_optimizer", "DistributedOptimizer", "OptimizerPrecision", "lr_group", "no_weight_decay"]


def build_optimizer(chunks: List[nn.Module], dims: ParallelDims, tcfg: TrainingConfig, pcfg: ParallelConfig,
                    precision: Optional[OptimizerPrecision] = None,
                    num_distributed_optimizer_instances: int = 1) -> Tuple[DistributedOptimizer, GradientSync]:
    """(optimizer, grad_sync) for this rank's model chunks. Build it before the first forward:
    at ZeRO-3 it shards the parameters. `precision`: --use-precision-aware-optimizer's dtypes
    (main_grads is the gradient buffers' dtype). `num_distributed_optimizer_instances`: shard the
    optimizer inside that many groups of DP ranks (collective: builds their process groups)."""
    precision = precision or OptimizerPrecision()
    dp_groups = None
    if num_distributed_optimizer_instances > 1:
        if pcfg.zero_stage < 1:
            raise ConfigError("--num-distributed-optimizer-instances needs the distributed optimizer "
                              "(--use-distributed-optimizer or --zero-stage >= 1)")
        try:
            dp_groups = partial_dp_groups(dims, num_distributed_optimizer_instances)
        except ValueError as e:
            raise ConfigError(f"--num-distributed-optimizer-instances: {e}") from e
    grad_dtype = None if precision.main_grads == torch.float32 else precision.main_grads
    grad_sync = GradientSync(chunks, dims, pcfg, grad_dtype=grad_dtype, dp_groups=dp_groups)
    return DistributedOptimizer(grad_sync, tcfg, precision), grad_sync
