"""Building the optimizer of a model: its GradientSync (buffers, buckets, DP communication, ZeRO
storage) first, then the DistributedOptimizer over that sync's shards."""
from __future__ import annotations

import os
from typing import List, Optional, Tuple

import torch
import torch.nn as nn

from ..config import ParallelConfig, TrainingConfig
from ..errors import ConfigError
from ..parallel.compression import NodeHops, QuantizedWeightGather, build_reducer, node_hops, qgz_node_size
from ..parallel.data_parallel import GradientSync
from ..parallel.fp8_param_gather import Fp8ParamGather
from ..parallel.state import ParallelDims, group_size, partial_dp_groups
from .adam import AdamW
from .distributed_optimizer import DistributedOptimizer, lr_group, no_weight_decay
from .muon import Muon
from .onebit_adam import OneBitAdam, OneBitReducer
from .zero_one_adam import ZeroOneAdam
from .precision import OptimizerPrecision

__all__ = ["build_optimizer", "DistributedOptimizer", "OptimizerPrecision", "lr_group", "no_weight_decay"]


def build_optimizer(chunks: List[nn.Module], dims: ParallelDims, tcfg: TrainingConfig, pcfg: ParallelConfig,
                    precision: Optional[OptimizerPrecision] = None,
                    num_distributed_optimizer_instances: int = 1) -> Tuple[DistributedOptimizer, GradientSync]:
    """(optimizer, grad_sync) for this rank's model chunks. Build it before the first forward:
    at ZeRO-3 it shards the parameters, gathering and freeing each chunk's `sharding_units()`
    (when the model has them) together. `precision`: --use-precision-aware-optimizer's dtypes
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
    grad_dtype = torch.bfloat16 if pcfg.grad_reduce_in_bf16 else torch.float32
    if precision.main_grads != torch.float32:
        grad_dtype = precision.main_grads
    units = [c.sharding_units() if hasattr(c, "sharding_units") else [] for c in chunks]
    hpz = pcfg.zeropp_hpz_partition_size
    hpz_group = partial_dp_groups(dims, group_size(dims.dp_cp_group) // hpz)[0] if hpz > 1 else None
    onebit = tcfg.optimizer in ("adam-1bit", "adam-01")
    reducer = OneBitReducer(dims.comm) if onebit else build_reducer(dims.comm, pcfg.grad_comm_dtype,
                                                                        pcfg.zeropp_quantized_gradients,
                                                                        qgz_hops(dims, pcfg),
                                                                        pcfg.zeropp_qgz_error_feedback)
    grad_sync = GradientSync(chunks, dims, zero_stage=pcfg.zero_stage, bucket_size=pcfg.ddp_bucket_size,
                             overlap_grad_reduce=pcfg.overlap_grad_reduce,
                             grad_reduce_once_per_step=pcfg.grad_reduce_once_per_step,
                             reshard_after_forward=pcfg.reshard_after_forward,
                             overlap_param_gather=pcfg.overlap_param_gather, grad_dtype=grad_dtype, units=units,
                             dp_groups=dp_groups, reducer=reducer, hpz_group=hpz_group,
                             param_gather=param_gather(dims, tcfg, pcfg),
                             param_offload_nvme_path=tcfg.param_offload_nvme_path)
    optimizer = DistributedOptimizer(grad_sync, tcfg, precision, rule=update_rule(tcfg, dims))
    if tcfg.optimizer == "adam-1bit":  # after the warm-up the momentum, not the gradient, is communicated
        reducer.frozen = lambda: optimizer.num_updates >= tcfg.freeze_step
    elif onebit:  # 0/1 Adam: the gradient is all-reduced in fp32 at variance steps only
        reducer.frozen = lambda: not optimizer.rule.all_reduces_gradient(optimizer.num_updates + 1)
    return optimizer, grad_sync


def qgz_hops(dims: ParallelDims, pcfg: ParallelConfig) -> Optional[NodeHops]:
    """--zeropp-quantized-gradients' two hops when the DP group spans nodes (qgz_node_size: hpZ's
    partition, else torchrun's LOCAL_WORLD_SIZE); None: one all-to-all over the DP group."""
    if not pcfg.zeropp_quantized_gradients:
        return None
    local = os.environ.get("LOCAL_WORLD_SIZE")
    node = qgz_node_size(group_size(dims.dp_cp_group), dims.tp, pcfg.zeropp_hpz_partition_size,
                         int(local) if local else None)
    return node_hops(dims, node)


def param_gather(dims: ParallelDims, tcfg: TrainingConfig, pcfg: ParallelConfig):
    """What gathers updated parameters instead of the plain all-gather: --fp8-param-gather's FP8
    weights, or --zeropp-quantized-weights' int8 blocks (ZeRO-3); None: the plain all-gather."""
    if tcfg.fp8_param_gather:
        return Fp8ParamGather(dims, tcfg.fp8_margin, tcfg.fp8_recipe)
    return QuantizedWeightGather(dims.comm) if pcfg.zeropp_quantized_weights else None


def update_rule(tcfg: TrainingConfig, dims: ParallelDims):
    """--optimizer's update rule: AdamW, 1-bit Adam (onebit_adam.py), 0/1 Adam (zero_one_adam.py), or Muon
    with AdamW beside it (muon.py)."""
    adam = AdamW(tcfg.adam_beta1, tcfg.adam_beta2, tcfg.adam_eps)
    if tcfg.optimizer == "adam-1bit":
        return OneBitAdam(adam, tcfg.freeze_step, dims.comm)
    if tcfg.optimizer == "adam-01":
        return ZeroOneAdam(adam, tcfg.var_freeze_step, tcfg.var_update_scaler, tcfg.local_step_scaler,
                           tcfg.local_step_clipper, dims.comm)
    if tcfg.optimizer != "muon":
        return adam
    return Muon(dims, tcfg.muon_momentum, tcfg.muon_use_nesterov, tcfg.muon_num_ns_steps, tcfg.muon_scale_mode,
                tcfg.muon_extra_scale_factor, adam, split_qkv=tcfg.muon_split_qkv)
