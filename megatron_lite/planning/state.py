"""Per-rank parameter, gradient and optimizer-state bytes of a layout, from a description of the
model's parameters: the same bucket rules and the same accounting (parallel/bucket_plan.py) that
GradientSync and DistributedOptimizer.memory_bytes() use, so the figures are equal to the
trainer's to the byte."""
from __future__ import annotations

from typing import Callable, Dict, List, Tuple

from ..parallel.bucket_plan import BucketPlan, ParamInfo, offloaded_buckets, plan_buckets, state_bytes
from ..parallel.pipeline.placement import StagePlacement
from ..parallel.pipeline.schedules import schedule_placement
from .layout import Layout

# (layer_range, pre_process, post_process, tp, ep, etp) -> the chunk's trainable parameters
Inventory = Callable[..., List[ParamInfo]]


def stage_chunks(num_layers: int, lay: Layout, pp_rank: int) -> List[Tuple[Tuple[int, int], bool, bool]]:
    """(layer range, pre_process, post_process) of each model chunk of pipeline rank `pp_rank`."""
    placement = StagePlacement(lay.pp, lay.vpp, schedule_placement(lay.pipeline_schedule))
    return placement.rank_chunks(pp_rank, num_layers, lay.first_stage_layers, lay.last_stage_layers)


def rank_buckets(num_layers: int, lay: Layout, pp_rank: int, inventory: Inventory) -> List[BucketPlan]:
    plans: List[BucketPlan] = []
    for layer_range, pre, post in stage_chunks(num_layers, lay, pp_rank):
        params = inventory(layer_range, pre, post, lay.tp, lay.ep, lay.etp)
        plans += plan_buckets(params, lay.zero_stage, lay.buckets, lay.dp * lay.cp, lay.edp)
    return plans


def rank_state_bytes(num_layers: int, lay: Layout, pp_rank: int, inventory: Inventory) -> Dict[str, int]:
    """What DistributedOptimizer.memory_bytes() reports on a rank of pipeline stage `pp_rank`."""
    plans = rank_buckets(num_layers, lay, pp_rank, inventory)
    fraction = lay.optimizer_offload_fraction if lay.optimizer_cpu_offload else 0.0
    return state_bytes(plans, lay.zero_stage, lay.grad_dtype, offloaded_buckets([b.shard_numel for b in plans],
                                                                                 fraction))
