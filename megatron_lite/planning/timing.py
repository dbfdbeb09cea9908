"""Step time from a roofline: compute is FLOPs over the GPU's achievable rate, each collective is
the bytes one rank moves (ring algorithms: all-reduce 2(n-1)/n of the buffer, reduce-scatter and
all-gather (n-1)/n) over the link it crosses (NVLink inside a node, the network across), and the
pipeline adds the idle time the schedule simulator finds for the layout's own action lists.

What overlaps (and so counts only where it sticks out):
  - the gradient reduce-scatter / all-reduce with --overlap-grad-reduce: with the backward of the
    last micro-batch (buckets are reduced once every micro-batch's gradients are in), at least
    the last bucket exposed; ZeRO-2/3 by default reduce-scatter every micro-batch's gradients,
    each with that micro-batch's backward (m times the bytes); the updated-parameter all-gather with --overlap-param-gather: with
    the next forward of the first micro-batch; ZeRO-3's per-micro-batch gathers: with compute;
  - the context-parallel ring: with the attention it feeds.
TP collectives, Ulysses and expert all-to-alls are on the critical path (no TP comm overlap here).
FLOPs are what the layer types report (transformer/counts.py), in the MFU convention of
training/flops.py (6N + 12 L H Q T per token, MoE counting the active experts), plus what
recomputation redoes. With FP8 (parallel/fp8.py) the layers' weight GEMMs run at the hardware's
FP8 rate; the attention core and the output layer stay at the bf16 rate (the casts and amax
reductions are not counted).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

from ..config import ModelConfig
from ..parallel.pipeline.partition import stage_sizes
from ..parallel.pipeline.placement import StagePlacement
from ..parallel.pipeline.schedules import compute_orders, schedule_placement
from ..parallel.pipeline.simulator import simulate
from ..training.flops import flops_per_token
from ..transformer.model_counts import MicroBatch, model_counts
from .activations import element_size
from .hardware import Hardware
from .layout import Layout
from .state import gathered_bytes, rank_bucket_params, stage_chunks

SIM_MAX_MICROBATCHES = 64  # longer schedules: the idle time of a schedule with fewer (it stops growing)


@functools.lru_cache(maxsize=4096)
def pipeline_idle(schedule: str, p: int, m: int, v: int, backward_cost: float,
                  stage_weights: Optional[Tuple[float, ...]] = None) -> float:
    """Idle time of the busiest rank over its busy time (the bubble fraction) of the schedule's own
    action lists, replayed by the simulator with per-chunk costs F = 1, B = backward_cost - 1, W = 1,
    each times its virtual stage's weight (None: all equal)."""
    if p == 1:
        return 0.0
    step = p if schedule == "interleaved" else 1
    sim_m = m if m <= SIM_MAX_MICROBATCHES else max(p, SIM_MAX_MICROBATCHES // step * step)
    res = simulate(compute_orders(schedule, p, sim_m, v), costs=(1.0, backward_cost - 1.0, 1.0), comm="ideal",
                   stage_weights=stage_weights, placement=StagePlacement(p, v, schedule_placement(schedule)))
    idle = res.makespan - max(res.busy)  # the warm-up and cool-down: independent of m once m >= p
    return idle / (max(res.busy) * m / sim_m)


def stage_weights(cfg: ModelConfig, lay: Layout) -> Optional[Tuple[float, ...]]:
    """Each virtual stage's share of the work under a split that is not even (its layers; None: even)."""
    if lay.split.even:
        return None
    sizes = stage_sizes(cfg.num_layers, lay.pp, lay.vpp, lay.split)
    mean = sum(sizes) / len(sizes)
    return tuple(round(n / mean, 4) for n in sizes)


@dataclass
class StepTime:
    compute_s: float
    bubble_s: float
    tp_s: float
    cp_s: float
    ep_s: float
    dp_s: float  # exposed
    optimizer_s: float
    model_tflop_per_gpu: float  # model FLOPs of one step per GPU (the MFU numerator)
    bubble_fraction: float
    detail: Dict[str, float]

    @property
    def total_s(self) -> float:
        return self.compute_s + self.bubble_s + self.tp_s + self.cp_s + self.ep_s + self.dp_s + self.optimizer_s

    def mfu(self, hw: Hardware) -> float:
        return self.model_tflop_per_gpu / (self.total_s * hw.peak_tflops)


def _bw(hw: Hardware, span: int) -> float:
    """Bytes/s of a collective whose ranks span `span` consecutive GPUs."""
    return (hw.nvlink_gbps if span <= hw.gpus_per_node else hw.network_gbps) * 1e9


def step_time(cfg: ModelConfig, lay: Layout, hw: Hardware, inventory, pp_rank: int = 0) -> StepTime:
    a = element_size(lay.params_dtype)
    tokens = lay.global_batch_size * lay.seq_length
    m, v, p = lay.num_microbatches, lay.vpp, lay.pp
    per_token = flops_per_token(cfg, lay.seq_length)
    model_flops = per_token * tokens / lay.world_size
    counts = model_counts(cfg, MicroBatch(seq_length=lay.seq_length))  # forward FLOPs per token
    attention = 3 * sum(layer.core_flops for layer in counts.layers)  # the core's, forward and backward
    logits = 3 * (counts.output.flops + counts.mtp.flops)  # the output GEMM and MTP's modules (last stage)
    core = attention / cfg.num_layers
    # per token and layer, in FLOPs at the bf16 rate: FP8 weight GEMMs count 1 / fp8_rate of theirs
    per_layer = ((per_token - logits) / cfg.num_layers - core) / (hw.fp8_rate if lay.fp8 else 1.0) + core
    redo = 0.0  # recomputed forward FLOPs per token and layer (a forward is a third of forward + backward)
    if lay.recompute == "full":
        per_chunk = cfg.num_layers // (p * v)
        share = 1.0 if lay.recompute_method == "uniform" else min(1.0, lay.recompute_num_layers / per_chunk)
        redo = share * per_layer / 3
    elif lay.recompute == "selective":
        redo = core / 3
    # The pipeline runs at the pace of its busiest rank: the one with the output layer (and the
    # loss) does that GEMM, and the multi-token prediction modules, on top of its layers.
    work = []
    for r in range(p):
        chunks = stage_chunks(cfg.num_layers, lay, r)
        layers = sum(hi - lo for (lo, hi), _, _ in chunks)
        work.append(layers * (per_layer + redo) + (logits if any(post for _, _, post in chunks) else 0.0))
    per_rank_tokens = tokens / (lay.dp * lay.cp * lay.tp)
    compute = max(work) * per_rank_tokens / (hw.achievable_tflops * 1e12)

    backward_cost = 2.0 + (3 * redo / per_layer if redo else 0.0)
    bubble_fraction = (pipeline_idle(lay.pipeline_schedule, p, m, v, round(backward_cost, 3), stage_weights(cfg, lay))
                       if p > 1 else 0.0)
    bubble = bubble_fraction * compute
    detail = {"busiest_rank_imbalance": max(work) / (sum(work) / p) - 1}
    if p > 1:  # filling and draining the pipeline crosses every stage boundary once each way
        sent = a * lay.seq_length // lay.cp * lay.micro_batch_size * cfg.hidden_size // (lay.tp if lay.sp else 1)
        span = lay.tp * lay.cp * lay.dp * 2  # neighbouring stages are a data-parallel replica apart
        bubble += 2 * (p * v - 1) * sent / _bw(hw, span)

    layers_here = cfg.num_layers // p
    tokens_mb = lay.seq_length // lay.cp * lay.micro_batch_size
    act = a * tokens_mb * cfg.hidden_size  # one [s, b, h] activation of this rank's sequence part
    tp = 0.0
    if lay.tp > 1:  # 4 all-reduce equivalents per layer and micro-batch (2 forward, 2 backward);
        # under SP the column-parallel inputs are gathered again in backward, but asynchronously
        # behind the input-gradient GEMMs (tensor_parallel._ColumnParallelFn): not counted as exposed
        per = 2 * (lay.tp - 1) / lay.tp * act * (4 + (2 if lay.recompute == "full" else 0))
        tp = per * layers_here * m / _bw(hw, lay.tp)
    cp = 0.0
    if lay.cp > 1:
        kv = a * tokens_mb * max(1, cfg.num_query_groups // lay.tp) * cfg.kv_channels * 2  # k and v
        q = a * tokens_mb * cfg.num_attention_heads // lay.tp * cfg.kv_channels
        bw = _bw(hw, lay.tp * lay.cp)
        if lay.cp_comm_type == "a2a":  # q, k, v in and the output back, forward and backward: exposed
            cp = 2 * (lay.cp - 1) / lay.cp * (2 * q + kv) * layers_here * m / bw
        else:  # ring / all-gather of k, v forward, k, v and their gradients backward: under attention
            moved = 3 * (lay.cp - 1) * kv * layers_here * m / bw
            attn = attention / cfg.num_layers * layers_here * tokens / lay.world_size / (hw.achievable_tflops * 1e12)
            cp = max(0.0, moved - attn)
            detail["cp_comm_s"] = moved
    ep = 0.0
    if cfg.moe is not None and lay.ep * lay.etp > 1:
        moe_layers = sum(cfg.moe_layers()) // p
        rows = a * tokens_mb // lay.tp * cfg.moe.moe_router_topk * cfg.hidden_size
        # the EP group spans ETP x EP consecutive ranks (expert grid "tp-ep-dp"): NVLink when inside a node
        ep = 4 * (lay.ep - 1) / lay.ep * rows * moe_layers * m / _bw(hw, lay.etp * lay.ep)
        if lay.etp > 1:  # ETP gathers its ranks' received rows, reduce-scatters the outputs; and in backward
            detail["etp_comm_s"] = 4 * (lay.etp - 1) * rows * moe_layers * m / _bw(hw, lay.etp)
            ep += detail["etp_comm_s"]

    buckets = rank_bucket_params(cfg.num_layers, lay, pp_rank, inventory)
    plans = [b for b, _ in buckets]
    gathered = {id(b): gathered_bytes(b, params, lay.fp8_param_gather) for b, params in buckets}
    d, g = lay.dp * lay.cp, element_size(lay.grad_dtype)
    dense = [b for b in plans if not b.expert]
    expert = [b for b in plans if b.expert]
    dp_s = 0.0
    backward_last = compute * 2 / 3 / m
    forward_first = compute / 3 / m
    for group, n in ((dense, d), (expert, lay.edp)):
        if n <= 1 or not group:
            continue
        bw = _bw(hw, lay.world_size // lay.pp if n == d else lay.tp * lay.dp * lay.cp)
        grad_full = sum(b.numel for b in group) * g
        param_full = sum(gathered[id(b)] for b in group)
        frac = (n - 1) / n
        if lay.zero_stage == 0:
            reduce, gather = 2 * frac * grad_full / bw, 0.0
        else:
            reduce, gather = frac * grad_full / bw, frac * param_full / bw
        last = reduce / len(group)
        exposed_reduce = max(reduce - backward_last, last) if lay.overlap_grad_reduce else reduce
        rounds = m if lay.grad_reduce_per_microbatch else 1
        reduce, exposed_reduce = rounds * reduce, rounds * exposed_reduce
        gathers = (2 * m if lay.reshard_after_forward else 1) if lay.zero_stage == 3 else 1
        if lay.zero_stage == 3:  # forward and backward gathers of every unit (or one per step), prefetched
            exposed_gather = max(0.0, gather * gathers - compute)
        elif lay.zero_stage >= 1:
            exposed_gather = max(gather - forward_first, gather / len(group)) if lay.overlap_param_gather else gather
        else:
            exposed_gather = 0.0
        dp_s += exposed_reduce + exposed_gather
        detail[f"{'expert ' if group is expert else ''}dp_comm_s"] = reduce + gather * gathers

    shard = sum(b.shard_numel for b in plans)
    offloaded = shard * (lay.optimizer_offload_fraction if lay.optimizer_cpu_offload else 0.0)
    opt = (shard - offloaded) * (16 + 2 * a) / (hw.hbm_gbps * 1e9)
    if offloaded:
        opt += offloaded * (4 + a) / (hw.host_link_gbps * 1e9) + offloaded / (hw.host_adam_gparams * 1e9)
    return StepTime(compute, bubble, tp, cp, ep, dp_s, opt, model_flops / 1e12, bubble_fraction, detail)
