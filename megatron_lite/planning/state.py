"""Per-rank parameter, gradient and optimizer-state bytes of a layout, from a description of the
model's parameters: the same bucket rules and the same accounting (parallel/bucket_plan.py) that
GradientSync and DistributedOptimizer.memory_bytes() use, so the figures are equal to the
trainer's to the byte."""
from __future__ import annotations

from typing import Callable, Dict, List, Optional, Tuple

import torch

from ..parallel.bucket_plan import BucketPlan, KeptFeatures, ParamInfo, offloaded_buckets, plan_buckets, state_bytes, \
    with_param_offload
from ..parallel.pipeline.placement import StagePlacement
from ..parallel.pipeline.schedules import schedule_placement
from .layout import Layout

# (layer_range, pre_process, post_process, tp, ep, etp) -> the chunk's trainable parameters
Inventory = Callable[..., List[ParamInfo]]


def stage_chunks(num_layers: int, lay: Layout, pp_rank: int) -> List[Tuple[Tuple[int, int], bool, bool]]:
    """(layer range, pre_process, post_process) of each model chunk of pipeline rank `pp_rank`."""
    placement = StagePlacement(lay.pp, lay.vpp, schedule_placement(lay.pipeline_schedule))
    return placement.rank_chunks(pp_rank, num_layers, lay.split)


def rank_buckets(num_layers: int, lay: Layout, pp_rank: int, inventory: Inventory) -> List[BucketPlan]:
    return [plan for plan, _ in rank_bucket_params(num_layers, lay, pp_rank, inventory)]


def rank_bucket_params(num_layers: int, lay: Layout, pp_rank: int,
                       inventory: Inventory) -> List[Tuple[BucketPlan, List[ParamInfo]]]:
    """rank_buckets, each with its parameters' ParamInfo."""
    out = []
    for layer_range, pre, post in stage_chunks(num_layers, lay, pp_rank):
        params = inventory(layer_range, pre, post, lay.tp, lay.ep, lay.etp)
        out += [(plan, [params[i] for i in plan.params])
                for plan in plan_buckets(params, lay.zero_stage, lay.buckets, lay.dp * lay.cp, lay.edp)]
    return out


FP8_GEMM_WEIGHTS = (".linear_q.weight", ".linear_kv.weight", ".linear_qkv.weight", ".linear_proj.weight",
                    ".linear_fc1.weight", ".linear_fc2.weight", ".experts.weight1", ".experts.weight2")


def gathered_bytes(plan: BucketPlan, params: List[ParamInfo], fp8_param_gather: bool) -> int:
    """Bytes of the bucket's full parameters as its all-gather moves them: with --fp8-param-gather
    one byte an element of an FP8 GEMM's weight (parallel/fp8_param_gather.py)."""
    elt = torch.empty((), dtype=plan.dtype).element_size()
    fp8 = sum(p.numel for p in params if p.name.endswith(FP8_GEMM_WEIGHTS)) if fp8_param_gather else 0
    return plan.numel * elt - fp8 * (elt - 1)


def qgz_nodes(lay: Layout, local_world_size: Optional[int]) -> int:
    """Nodes two-hop qgZ's dense reduction spans (1: one hop), by the trainer's rule."""
    if not lay.zeropp_quantized_gradients:
        return 1
    from ..parallel.compression import qgz_node_size

    dp = lay.dp * lay.cp
    return dp // qgz_node_size(dp, lay.tp, lay.zeropp_hpz_partition_size, local_world_size)


def rank_state_bytes(num_layers: int, lay: Layout, pp_rank: int, inventory: Inventory,
                     local_world_size: Optional[int] = None) -> Dict[str, int]:
    """What DistributedOptimizer.memory_bytes() reports on a rank of pipeline stage `pp_rank`, on
    nodes of `local_world_size` ranks (torchrun's LOCAL_WORLD_SIZE: where two-hop qgZ splits)."""
    plans = rank_buckets(num_layers, lay, pp_rank, inventory)
    fraction = lay.optimizer_offload_fraction if lay.optimizer_cpu_offload else 0.0
    kept = KeptFeatures(grad_codec=lay.grad_codec, optimizer=lay.optimizer, hpz=lay.zeropp_hpz_partition_size,
                        group_sizes=tuple(lay.edp if b.expert else lay.dp * lay.cp for b in plans),
                        qgz_nodes=qgz_nodes(lay, local_world_size))
    offloaded = offloaded_buckets([b.shard_numel for b in plans], fraction)
    out = state_bytes(plans, lay.zero_stage, lay.grad_dtype, offloaded, nvme=lay.optimizer_offload_nvme, kept=kept)
    return with_param_offload(out, plans, lay.optimizer_offload_nvme, offloaded) if lay.param_offload_nvme else out
