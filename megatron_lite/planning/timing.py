"""Step time from a roofline: compute is each layer's work by kind, each collective the bytes one
rank moves (ring algorithms: all-reduce 2(n-1)/n of the buffer, reduce-scatter and all-gather
(n-1)/n; all-to-all (n-1)/n) over the links its group's placement gives (hardware.py: NVLink inside
a node, k NICs for a ring with k ranks a node, the NIC for an all-to-all's bytes leaving the node),
and the pipeline adds the idle time the schedule simulator finds for the layout's own action lists.

Compute, per token and layer (the GPU record's rates; sources in hardware.py):
  - weight GEMMs: their FLOPs at the sustained GEMM rate (FP8: times the FP8 rate), plus their
    operands and results at the memory bandwidth (what makes a 2048-wide layer's GEMMs slower than
    a large square one);
  - the attention core: the flash kernels' FLOPs (causal: half the scores forward, 2.5 forwards
    backward) at the attention rate;
  - memory-bound work (norms, activations, dropout, residual adds, RoPE, the loss's softmax): the
    layer's kept activation bytes, ELEMENTWISE_PASSES times, at the memory bandwidth.
The MFU numerator stays training/flops.py's (6N + 12 L H Q T per token, MoE counting the active
experts); recomputation adds its forward's work.

What overlaps (and so counts only where it sticks out):
  - the gradient reduce-scatter / all-reduce with --overlap-grad-reduce: with the backward of the
    last micro-batch (buckets are reduced once every micro-batch's gradients are in), at least
    the last bucket exposed; ZeRO-2/3 by default reduce-scatter every micro-batch's gradients,
    each with that micro-batch's backward (m times the bytes); the updated-parameter all-gather
    with --overlap-param-gather: with the next forward of the first micro-batch; ZeRO-3's
    per-micro-batch gathers: with compute;
  - the context-parallel ring: with the attention it feeds;
  - the column-parallel layers' input-gradient all-reduce / reduce-scatter: with the weight-gradient GEMMs.
The other TP collectives, Ulysses and expert all-to-alls are on the critical path (this trainer has
no TP communication overlap of Transformer Engine's userbuffers kind), and so is 1-bit / 0/1 Adam's
compressed momentum exchange in the optimizer step. dp_traffic.py gives each DP collective's bytes
(compressed ones included) and group.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from ..config import ModelConfig
from ..parallel.bucket_plan import UPDATE_RULES, nvme_bytes_per_step, param_region_bytes, region_bytes
from ..parallel.pipeline.partition import stage_sizes
from ..parallel.pipeline.placement import StagePlacement
from ..parallel.pipeline.schedules import compute_orders, schedule_placement
from ..parallel.pipeline.simulator import simulate
from ..training.flops import flops_per_token
from ..transformer.counts import Counts
from ..transformer.mla import MLAConfig
from ..transformer.model_counts import MicroBatch, model_counts
from .activations import element_size
from .hardware import Hardware, all_to_all_seconds, p2p_seconds, ring_seconds
from .layout import Layout
from .dp_traffic import GATHER, GATHER_BACKWARD, OPTIMIZER, REDUCE, rounds, transfers_of
from .state import rank_bucket_params, stage_chunks

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
    nvme_s: float = 0.0  # --optimizer-offload-nvme-path: the file's I/O that compute does not cover

    @property
    def total_s(self) -> float:
        return (self.compute_s + self.bubble_s + self.tp_s + self.cp_s + self.ep_s + self.dp_s + self.optimizer_s
                + self.nvme_s)

    def mfu(self, hw: Hardware) -> float:
        return self.model_tflop_per_gpu / (self.total_s * hw.peak_tflops)


# Flash attention's kernels against the model's count of the core (4 s h per token forward, 3
# forwards in training, causal or not): the forward computes the causal half, the backward
# recomputes the scores and does 2.5 forwards' worth: 0.5 + 1.25 of the model's forward.
CORE_FORWARD_SHARE, CORE_TRAINING_SHARE = 0.5, 1.75
# Memory-bound work (norms, activations, RoPE, dropout, residual adds, the loss's softmax), in
# this trainer's unfused PyTorch ops: each byte a layer keeps for backward is read and written by
# the forward op that makes it (2), read with its output's gradient and its own gradient written
# in backward (3), and the residual stream's and norms' fp32 work adds about as much again: 8
# passes over the layer's kept activation bytes at the memory bandwidth.
ELEMENTWISE_PASSES = 8


def gemm_shapes(cfg: ModelConfig, lay: Layout, moe: bool) -> List[Tuple[int, int, int, int]]:
    """(M, K, N, count) of one layer's weight GEMMs for one micro-batch on one rank (TP-local
    widths; under SP the gathered tokens; an MoE layer's experts: `count` local experts, each with
    its share of the routed tokens): what their operand traffic costs next to their FLOPs."""
    h, tp, tokens = cfg.hidden_size, lay.tp, lay.seq_length // lay.cp * lay.micro_batch_size
    if getattr(cfg, "multi_latent_attention", False):
        c = MLAConfig.from_model(cfg)
        q = c.num_attention_heads * (c.qk_head_dim + c.qk_pos_emb_head_dim) // tp
        attn = [(h, c.q_lora_rank), (c.q_lora_rank, q)] if c.q_lora_rank else [(h, q)]
        attn += [(h, c.kv_lora_rank + c.qk_pos_emb_head_dim),
                 (c.kv_lora_rank, c.num_attention_heads * (c.qk_head_dim + c.v_head_dim) // tp),
                 (c.num_attention_heads * c.v_head_dim // tp, h)]
    else:
        d, heads, groups = cfg.kv_channels, cfg.num_attention_heads, cfg.num_query_groups or cfg.num_attention_heads
        attn = [(h, (heads + 2 * groups) * d // tp), (heads * d // tp, h)]
    out = [(tokens, k, n, 1) for k, n in attn]
    gate = 2 if cfg.swiglu else 1
    if moe:
        e = cfg.moe
        local = e.num_experts // lay.ep
        routed = max(1, tokens // (tp if lay.sp else 1) * e.moe_router_topk * lay.ep // e.num_experts)
        f = e.moe_ffn_hidden_size // lay.etp
        out += [(routed, h, gate * f, local), (routed, f, h, local)]
        if e.moe_shared_expert_intermediate_size:
            s = e.moe_shared_expert_intermediate_size // tp
            out += [(tokens, h, gate * s, 1), (tokens, s, h, 1)]
    else:
        f = cfg.ffn_hidden_size // tp
        out += [(tokens, h, gate * f, 1), (tokens, f, h, 1)]
    return out


def operand_share(shapes: List[Tuple[int, int, int, int]], a: int, hw: Hardware) -> float:
    """The GEMMs' operand and result traffic, a (MK + KN + MN) bytes each at the memory bandwidth,
    over their 2 MKN FLOPs at the GEMM rate (not hidden behind the math: what makes small shapes
    slower than the large ones a GEMM rate is measured on), FLOP-weighted over the shapes."""
    ratio = a * hw.gemm_tflops * 1e12 / (2 * hw.hbm_gbps * 1e9)
    flops = sum(c * m * k * n for m, k, n, c in shapes)
    return ratio * sum(c * m * k * n * (1 / m + 1 / k + 1 / n) for m, k, n, c in shapes) / flops


@dataclass(frozen=True)
class Work:
    """Seconds per token at full width (a TP rank does 1/TP of it) of a piece of the model, by kind."""
    gemm: float  # weight GEMMs, forward and both backward GEMMs
    core: float  # the attention core's kernels, forward and backward
    memory: float  # memory-bound work
    forward: float  # of all three, the forward's (what recomputation replays)
    moe: bool = False  # an MoE layer's (its tokens cross the expert all-to-all)

    @property
    def total(self) -> float:
        return self.gemm + self.core + self.memory


def work_of(c: Counts, operands: float, hw: Hardware, fp8: bool, moe: bool = False) -> Work:
    """`c` (forward FLOPs, core FLOPs, activation bytes of one token at full width) in seconds."""
    gemm = 3 * (c.flops - c.core_flops) / (hw.gemm_tflops * 1e12) * (1 / (hw.fp8_rate if fp8 else 1.0) + operands)
    core = CORE_TRAINING_SHARE * c.core_flops / (hw.attention_tflops * 1e12)
    memory = ELEMENTWISE_PASSES * c.act_bytes / (hw.hbm_gbps * 1e9)
    return Work(gemm, core, memory, gemm / 3 + core * CORE_FORWARD_SHARE / CORE_TRAINING_SHARE + memory / 3, moe)


def unkept_bytes(cfg: ModelConfig, moe: bool, a: int) -> int:
    """Bytes per token (full width) that one layer's memory-bound ops write without keeping them for
    backward, which ELEMENTWISE_PASSES covers beside the kept ones: RMSNorm's fp32 work, (8 - a) h
    per norm (it keeps its input and 1/rms only), and SwiGLU's silu(gate), a f (made again in
    backward). Recomputation never lowers this work, so the planner's memory-bound time does not
    depend on what the layers keep."""
    norms = 2 * (8 - a) * cfg.hidden_size if cfg.normalization == "RMSNorm" else 0
    if not cfg.swiglu:
        return norms
    if moe:
        e = cfg.moe
        ffn = e.moe_router_topk * e.moe_ffn_hidden_size + (e.moe_shared_expert_intermediate_size or 0)
    else:
        ffn = cfg.ffn_hidden_size
    return norms + a * ffn


def model_work(cfg: ModelConfig, lay: Layout, hw: Hardware) -> Tuple[List[Work], Work]:
    """Each layer's Work, and the last stage's extra (output layer, loss, multi-token prediction)."""
    a = element_size(lay.params_dtype)
    counts = model_counts(cfg, MicroBatch(seq_length=lay.seq_length, tokens=1, a=a))
    fp8 = bool(lay.fp8)
    kinds = {}
    for moe, layer in zip(cfg.moe_layers(), counts.layers):
        if (moe, layer) not in kinds:
            touched = layer._replace(act_bytes=layer.act_bytes + unkept_bytes(cfg, moe, a))
            kinds[(moe, layer)] = work_of(touched, operand_share(gemm_shapes(cfg, lay, moe), a, hw), hw, fp8, moe)
    layers = [kinds[(moe, layer)] for moe, layer in zip(cfg.moe_layers(), counts.layers)]
    tokens = lay.seq_length // lay.cp * lay.micro_batch_size
    head = operand_share([(tokens, cfg.hidden_size, cfg.padded_vocab_size(lay.tp) // lay.tp, 1)], a, hw)
    last = work_of(counts.output + counts.final_norm, head, hw, False)  # the output GEMM stays in bf16
    if cfg.mtp_depth:  # its layer's GEMMs as the decoder's (FP8 with it; its output GEMM too, a simplification)
        last = _plus(last, work_of(counts.mtp, head, hw, fp8))
    return layers, last


def _plus(x: Work, y: Work) -> Work:
    return Work(x.gemm + y.gemm, x.core + y.core, x.memory + y.memory, x.forward + y.forward)


def model_parallel_comm(cfg: ModelConfig, lay: Layout, hw: Hardware, rank_work: List[List[Work]], busiest: int,
                        detail: Dict[str, float]) -> Tuple[float, float, float]:
    """Exposed TP, CP and EP communication seconds of a step (the busiest pipeline rank's)."""
    a, m = element_size(lay.params_dtype), lay.num_microbatches
    mine = rank_work[busiest]
    per_rank_tokens = lay.global_batch_size * lay.seq_length / (lay.dp * lay.cp * lay.tp)
    layers_here = max(len(x) for x in rank_work)
    tokens_mb = lay.seq_length // lay.cp * lay.micro_batch_size
    act = a * tokens_mb * cfg.hidden_size  # one [s, b, h] activation of this rank's sequence part
    tp = 0.0
    if lay.tp > 1:
        # Per layer and micro-batch: the forward's two all-reduce equivalents (SP: all-gather before
        # the column-parallel GEMMs, reduce-scatter after the row-parallel ones) and, under SP, the
        # backward's all-gathers of the row-parallel output gradients wait for the GEMMs; the
        # column-parallel input gradients' all-reduce (SP: reduce-scatter) runs behind the
        # weight-gradient GEMMs (tensor_parallel._ColumnParallelFn), exposed only where longer.
        # Full recomputation replays the forward's.
        one = ring_seconds(hw, 2 * (lay.tp - 1) / lay.tp * act, lay.tp, 1)
        waited = (2 + (1 if lay.sp else 0) + (2 if lay.recompute == "full" else 0)) * one
        behind = (1 if lay.sp else 2) * one
        wgrad = sum(w.gemm for w in mine) / max(1, layers_here) / 3 * tokens_mb / lay.tp
        tp = (waited + max(0.0, behind - wgrad)) * layers_here * m
    cp = 0.0
    if lay.cp > 1:
        kv = a * tokens_mb * max(1, cfg.num_query_groups // lay.tp) * cfg.kv_channels * 2  # k and v
        q = a * tokens_mb * cfg.num_attention_heads // lay.tp * cfg.kv_channels
        if lay.cp_comm_type == "a2a":  # q, k, v in and the output back, forward and backward: exposed
            cp = 2 * all_to_all_seconds(hw, 2 * q + kv, lay.cp, lay.tp) * layers_here * m
        else:  # ring / all-gather of k, v forward, k, v and their gradients backward: under attention
            # a ring is as fast as its slowest hop: the network's once the group leaves the node
            inside = lay.tp * lay.cp <= hw.gpus_per_node
            hop = kv / ((hw.nvlink_gbps if inside else hw.network_gbps) * 1e9)
            moved = 3 * (lay.cp - 1) * hop * layers_here * m
            attn = sum(w.core for w in mine) * per_rank_tokens
            cp = max(0.0, moved - attn)
            detail["cp_comm_s"] = moved
    ep = 0.0
    if cfg.moe is not None and lay.ep * lay.etp > 1:  # dispatch and combine, forward and backward: exposed
        moe_layers = max(sum(w.moe for w in ws) for ws in rank_work)
        rows = a * tokens_mb // (lay.tp if lay.sp else 1) * cfg.moe.moe_router_topk * cfg.hidden_size
        # EP ranks sit ETP apart (expert grid "tp-ep-dp"): NVLink for the peers inside a node
        ep = 4 * all_to_all_seconds(hw, rows, lay.ep, lay.etp) * moe_layers * m
        if lay.etp > 1:  # ETP gathers its ranks' received rows, reduce-scatters the outputs; and in backward
            detail["etp_comm_s"] = 4 * ring_seconds(hw, (lay.etp - 1) * rows, lay.etp, 1) * moe_layers * m
            ep += detail["etp_comm_s"]
    return tp, cp, ep


def dp_comm(num_layers: int, lay: Layout, hw: Hardware, inventory, pp_rank: int, compute: float,
            detail: Dict[str, float]) -> Tuple[list, float]:
    """(this rank's buckets, exposed data-parallel seconds of a step): dense buckets over DP x CP,
    expert buckets over the expert-data-parallel group, each collective priced by its group's
    placement with the bytes it really moves (dp_traffic.py: compressed gradients, ZeRO++'s qgZ in
    one or two hops, qwZ and hpZ; 1-bit / 0/1 Adam in their steady state after the freeze, whose
    momentum exchange in the optimizer step nothing hides)."""
    m = lay.num_microbatches
    bucket_params = rank_bucket_params(num_layers, lay, pp_rank, inventory)
    plans = [b for b, _ in bucket_params]
    transfers = transfers_of(lay, bucket_params, hw.gpus_per_node)
    dp_s = 0.0
    backward_last = compute * 2 / 3 / m
    forward_first = compute / 3 / m
    for expert in (False, True):
        group = [ts for b, ts in zip(plans, transfers) if b.expert == expert and ts]
        if not group:
            continue
        seconds = {phase: sum(t.seconds(hw) for ts in group for t in ts if t.phase == phase)
                   for phase in (REDUCE, GATHER, GATHER_BACKWARD, OPTIMIZER)}
        reduce, gather = seconds[REDUCE], seconds[GATHER]
        last = reduce / len(group)
        exposed_reduce = max(reduce - backward_last, last) if lay.overlap_grad_reduce else reduce
        reduce, exposed_reduce = rounds(lay, REDUCE) * reduce, rounds(lay, REDUCE) * exposed_reduce
        gathers = rounds(lay, GATHER) * gather + rounds(lay, GATHER_BACKWARD) * seconds[GATHER_BACKWARD]
        if lay.zero_stage == 3:  # forward and backward gathers of every unit (or one per step), prefetched
            exposed_gather = max(0.0, gathers - compute)
        elif lay.zero_stage >= 1:
            exposed_gather = max(gather - forward_first, gather / len(group)) if lay.overlap_param_gather else gather
        else:
            exposed_gather = 0.0
        exposed = exposed_reduce + exposed_gather
        if lay.zero_stage == 3:  # its gathers and reduce-scatters share the links: what compute cannot cover waits
            exposed = max(exposed, gathers + reduce - compute)
        dp_s += exposed + seconds[OPTIMIZER]
        detail[f"{'expert ' if expert else ''}dp_comm_s"] = reduce + gathers + seconds[OPTIMIZER]

    return plans, dp_s


def step_time(cfg: ModelConfig, lay: Layout, hw: Hardware, inventory, pp_rank: int = 0) -> StepTime:
    a = element_size(lay.params_dtype)
    tokens = lay.global_batch_size * lay.seq_length
    m, v, p = lay.num_microbatches, lay.vpp, lay.pp
    model_flops = flops_per_token(cfg, lay.seq_length) * tokens / lay.world_size
    layer_work, last = model_work(cfg, lay, hw)

    def redo(w: Work) -> float:  # seconds per token recomputation adds to a layer
        if lay.recompute == "full":
            per_chunk = cfg.num_layers // (p * v)
            share = 1.0 if lay.recompute_method == "uniform" else min(1.0, lay.recompute_num_layers / per_chunk)
            return share * w.forward
        return w.core * CORE_FORWARD_SHARE / CORE_TRAINING_SHARE if lay.recompute == "selective" else 0.0

    # The pipeline runs at the pace of its busiest rank: the one with the output layer (and the
    # loss) does that GEMM, and the multi-token prediction modules, on top of its layers.
    work, forward, rank_work = [], [], []
    for r in range(p):
        chunks = stage_chunks(cfg.num_layers, lay, r)
        mine = [layer_work[i] for (lo, hi), _, _ in chunks for i in range(lo, hi)]
        post = any(post for _, _, post in chunks)
        rank_work.append(mine)
        work.append(sum(w.total + redo(w) for w in mine) + (last.total if post else 0.0))
        forward.append(sum(w.forward for w in mine) + (last.forward if post else 0.0))
    busiest = max(range(p), key=lambda r: work[r])
    per_rank_tokens = tokens / (lay.dp * lay.cp * lay.tp)
    compute = work[busiest] * per_rank_tokens

    # B + W over F, recomputation in B; to 0.05 (the bubble's share barely moves, the simulator's cache hits)
    backward_cost = round(20 * (work[busiest] / forward[busiest] - 1)) / 20
    bubble_fraction = (pipeline_idle(lay.pipeline_schedule, p, m, v, backward_cost, stage_weights(cfg, lay))
                       if p > 1 else 0.0)
    bubble = bubble_fraction * compute
    detail = {"busiest_rank_imbalance": max(work) / (sum(work) / p) - 1,
              **{f"{kind}_s": sum(getattr(w, attr) for w in rank_work[busiest]) * per_rank_tokens
                 for kind, attr in (("gemm", "gemm"), ("attention_core", "core"), ("memory_bound", "memory"))}}
    if p > 1:  # filling and draining the pipeline crosses every stage boundary once each way
        sent = a * lay.seq_length // lay.cp * lay.micro_batch_size * cfg.hidden_size // (lay.tp if lay.sp else 1)
        bubble += 2 * (p * v - 1) * p2p_seconds(hw, sent, lay.tp * lay.cp * lay.dp)

    tp, cp, ep = model_parallel_comm(cfg, lay, hw, rank_work, busiest, detail)

    plans, dp_s = dp_comm(cfg.num_layers, lay, hw, inventory, pp_rank, compute, detail)
    shard = sum(b.shard_numel for b in plans)
    # NVMe: the update runs on the host, in the staging buffers, like a fully offloaded optimizer's
    offloaded = shard * (1.0 if lay.optimizer_offload_nvme else
                         lay.optimizer_offload_fraction if lay.optimizer_cpu_offload else 0.0)
    opt = (shard - offloaded) * (16 + 2 * a) / (hw.hbm_gbps * 1e9)
    if offloaded:
        opt += offloaded * (4 + a) / (hw.host_link_gbps * 1e9) + offloaded / (hw.host_adam_gparams * 1e9)
    return StepTime(compute, bubble, tp, cp, ep, dp_s, opt, model_flops / 1e12, bubble_fraction, detail,
                    nvme_seconds(lay, hw, plans, compute, opt, detail) + param_nvme_seconds(lay, hw, plans, compute, detail))


def nvme_seconds(lay: Layout, hw: Hardware, plans, compute: float, optimizer: float,
                 detail: Dict[str, float]) -> float:
    """--optimizer-offload-nvme-path: the time the file's I/O adds to a step, as optim/nvme_store.py
    runs it. One I/O thread reads every region and writes it back (in order); the update of shard k
    waits for its read, and reads ahead and write-backs run beside the host updates. So the optimizer
    phase takes the first read plus the longer of the updates and the rest of the phase's I/O, and
    the step's last write-back runs behind the next forward and backward (exposed only where it
    outlasts them). On a slow disk a step is compute + I/O, not max(compute, I/O): the I/O waits
    for the gradients."""
    if not lay.optimizer_offload_nvme or not plans:
        return 0.0
    tensors = 1 + UPDATE_RULES[lay.optimizer].fp32_states  # main params and the rule's states
    rate = hw.nvme_gbps * 1e9
    regions = [region_bytes(b.shard_numel, tensors) / rate for b in plans]
    io = nvme_bytes_per_step([b.shard_numel for b in plans], tensors) / rate
    first_read, last_write = regions[0], regions[-1]
    phase = first_read + max(optimizer, io - last_write - first_read)
    detail["nvme_io_s"] = io
    return phase - optimizer + max(0.0, last_write - compute)


def param_nvme_seconds(lay: Layout, hw: Hardware, plans, compute: float, detail: Dict[str, float]) -> float:
    """--param-offload-nvme-path (parallel/param_offload.py): every ZeRO-3 gather of a unit reads its
    shards from the file (forward and backward of each micro-batch, or once a step without
    resharding), the I/O thread reading the next unit while this one computes, and the optimizer
    writes each shard back once behind the step: what of that the compute does not cover waits."""
    if not lay.param_offload_nvme or not plans:
        return 0.0
    gathers = 2 * lay.num_microbatches if lay.reshard_after_forward else 1
    file_bytes = sum(param_region_bytes(b) for b in plans)
    io = (gathers + 1) * file_bytes / (hw.nvme_gbps * 1e9)
    detail["param_nvme_io_s"] = io
    return max(0.0, io - compute)
