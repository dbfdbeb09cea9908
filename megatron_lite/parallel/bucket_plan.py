"""Which gradient bucket each parameter goes to, and the bytes a rank then holds across steps, as
pure functions of parameter descriptions: the one source of both GradientSync's buckets and
DistributedOptimizer.memory_bytes() (what the trainer prints) and of the planner's figures
(megatron_lite/planning), which describes parameters without building a model.

The rules (data_parallel.py explains why): per model chunk, parameters in reverse registration
order are cut into runs of at least `bucket_size` elements of one dtype (ZeRO-3: one bucket per
unit, units in reverse forward order, each unit's parameters reversed); expert parameters of a
run get a bucket of their own (reduced over the expert-data-parallel group). A bucket is padded
to a multiple of its group size when ZeRO shards it (stages 1-3).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch


@dataclass(frozen=True)
class ParamInfo:
    """What bucketing and accounting need of a trainable parameter."""
    name: str
    numel: int
    dtype: torch.dtype
    expert: bool = False  # split over experts: its own buckets, reduced over the edp group
    unit: int = 0  # ZeRO-3: 0 = the chunk's root, k = its k-th sharding unit (layer) in forward order


@dataclass(frozen=True)
class BucketPlan:
    params: tuple  # indices into the chunk's ParamInfo list, in bucket order
    numel: int  # padded
    shard_numel: int  # this rank's part: the whole bucket unless sharded
    dtype: torch.dtype
    expert: bool
    unit: int = 0  # ZeRO-3: the unit (ParamInfo.unit) the bucket belongs to


def split_by_size(sizes: Sequence[int], dtypes: Sequence[torch.dtype], bucket_size: int) -> List[List[int]]:
    """Consecutive runs (indices) of at least bucket_size elements (the last may be smaller); one dtype each."""
    groups: List[List[int]] = []
    current: List[int] = []
    n = 0
    for i, (size, dt) in enumerate(zip(sizes, dtypes)):
        if current and (n >= bucket_size or dt != dtypes[current[-1]]):
            groups.append(current)
            current, n = [], 0
        current.append(i)
        n += size
    if current:
        groups.append(current)
    return groups


def padded(n: int, shards: int) -> int:
    """Elements of a bucket of n elements cut into `shards` equal shards."""
    return -(-n // shards) * shards


def plan_buckets(params: Sequence[ParamInfo], stage: int, bucket_size: int, dense_group: int,
                 expert_group: int) -> List[BucketPlan]:
    """One chunk's buckets, in GradientSync's order. `params`: the chunk's trainable parameters in
    registration order; `dense_group` / `expert_group`: ranks of the data-parallel (dp x cp) and
    expert-data-parallel groups."""
    if stage == 3:
        units = sorted({p.unit for p in params})
        groups = [[i for i in range(len(params)) if params[i].unit == u][::-1] for u in units[::-1]]
    else:
        order = list(range(len(params)))[::-1]
        runs = split_by_size([params[i].numel for i in order], [params[i].dtype for i in order], bucket_size)
        groups = [[order[j] for j in run] for run in runs]
    out = []
    for g in groups:
        unit = params[g[0]].unit if g and stage == 3 else 0
        for expert in (False, True):
            idx = tuple(i for i in g if params[i].expert == expert)
            if not idx:
                continue
            shards = (expert_group if expert else dense_group) if stage >= 1 else 1
            numel = padded(sum(params[i].numel for i in idx), shards)
            out.append(BucketPlan(idx, numel, numel // shards, params[idx[0]].dtype, expert, unit))
    return out


def _bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def state_bytes(buckets: Sequence[BucketPlan], stage: int, grad_dtype: torch.dtype = torch.float32,
                offloaded: Optional[Sequence[bool]] = None, nvme: bool = False,
                kept: Optional["KeptFeatures"] = None) -> Dict[str, int]:
    """Bytes a rank keeps across steps for these buckets (all of its chunks'):
      param_bytes            full flat params (stage 3: the shard)
      grad_bytes             full flat grads (stages 2-3: the reduced shard)
      optimizer_state_bytes  per shard element: the update rule's fp32 states (UPDATE_RULES; AdamW's m
                             and v), plus fp32 main params when the params are not fp32 (else the
                             param shard is the main copy)
      optimizer_host_bytes   (only with offloaded buckets) their m, v, main params and gradient
                             staging buffer, all fp32, in host memory instead
    With `nvme` (--optimizer-offload-nvme-path) every bucket's m, v and main params are in a file:
      optimizer_staging_bytes  two staging buffers, each the largest shard's region and its gradient
      optimizer_nvme_bytes     the file (optim/nvme_store.py's layout)
    With `kept` (compression, ZeRO++, the update rule), what those keep besides: kept_bytes()."""
    kept = kept or KeptFeatures()
    states, beside = UPDATE_RULES[kept.optimizer].fp32_states, UPDATE_RULES[kept.optimizer].fp32_beside
    if nvme:
        out = state_bytes(buckets, stage, grad_dtype, kept=kept)
        shards = [b.shard_numel for b in buckets]
        out["optimizer_state_bytes"] = 4 * beside * sum(shards)  # (what the rule keeps outside the store)
        out["optimizer_staging_bytes"] = 2 * slot_bytes(shards, 1 + states)
        out["optimizer_nvme_bytes"] = sum(region_bytes(n, 1 + states) for n in shards)
        return out
    offloaded = offloaded or [False] * len(buckets)
    out = {"param_bytes": 0, "grad_bytes": 0, "optimizer_state_bytes": 0}
    host = 0
    g = _bytes(grad_dtype)
    for b, off in zip(buckets, offloaded):
        out["param_bytes"] += (b.shard_numel if stage == 3 else b.numel) * _bytes(b.dtype)
        out["grad_bytes"] += (b.shard_numel if stage >= 2 else b.numel) * g
        out["optimizer_state_bytes"] += 4 * beside * b.shard_numel
        if off:
            host += 4 * (2 + states) * b.shard_numel  # main, the states, the gradient
        else:
            out["optimizer_state_bytes"] += (4 * states + (4 if b.dtype != torch.float32 else 0)) * b.shard_numel
    if host:
        out["optimizer_host_bytes"] = host
    out.update(kept_bytes(buckets, stage, kept))
    return out


# --- what compression, ZeRO++ and update rules keep beside the params, grads and Adam state -----

@dataclass(frozen=True)
class RuleState:
    """What an update rule (--optimizer) keeps per shard element beyond the main params."""
    fp32_states: int  # fp32 values in the optimizer state (AdamW: exp_avg, exp_avg_sq)
    momentum_codec: Optional[str] = None  # its momentum is all-reduced in this format with error feedback
    fp32_beside: int = 0  # fp32 values it keeps on the device outside the state store (NVMe / host offload)


# One entry per --optimizer. adam-1bit: sign-compressed momentum, worker + server error per bucket
# (optim/onebit_adam.py; held from the freeze step on). Muon's momentum rides in AdamW's slots.
UPDATE_RULES = {"adam": RuleState(2), "muon": RuleState(2), "adam-1bit": RuleState(2, "sign"),
                "adam-01": RuleState(2, "sign", 1)}  # 0/1 Adam: m, v; its anchor beside (optim/zero_one_adam.py)


@dataclass(frozen=True)
class KeptFeatures:
    """The flags whose state kept_bytes() counts, and the ranks each bucket is reduced over."""
    grad_codec: Optional[str] = None  # --grad-comm-dtype, or "int4-blocks" (--zeropp-quantized-gradients)
    optimizer: str = "adam"  # --optimizer (UPDATE_RULES)
    hpz: int = 1  # --zeropp-hpz-partition-size
    group_sizes: Tuple[int, ...] = ()  # per bucket: ranks of its reduction group (empty: no compression)
    qgz_nodes: int = 1  # two-hop qgZ: nodes the dense buckets' DP x CP group spans (1: one hop)


# A row of each wire format (compression.py's codecs read it) is a multiple of this many values; others: 1.
CODEC_ALIGN = {"sign": 8, "int8-blocks": 256, "int4-blocks": 256}


def feedback_rows(numel: int, ranks: int, align: int) -> Tuple[int, int]:
    """(shard, n) of an error-feedback exchange (parallel/compression.py) over a flat tensor of
    `numel`: each of the `ranks` rows holds `shard` = ceil(numel / ranks) elements, padded to `n`,
    whole codec blocks of `align`."""
    shard = -(-numel // ranks)
    return shard, -(-shard // align) * align


def row_runs(offsets: Sequence[Tuple[int, int]], numel: int, ranks: int, align: int) -> List[List[int]]:
    """Per row of an exchange over a flat tensor of `numel` (feedback_rows' layout), the lengths of
    the tensors ([lo, hi) `offsets`, consecutive) it meets, in order: where the sign codec puts a
    scale each (one per tensor and row, as DeepSpeed compresses each tensor apart)."""
    shard, _ = feedback_rows(numel, ranks, align)
    return [[min(e, (r + 1) * shard) - max(s, r * shard) for s, e in offsets
             if max(s, r * shard) < min(e, (r + 1) * shard)] for r in range(ranks)]


def feedback_bytes(numel: int, ranks: int, align: int, server: bool) -> int:
    """fp32 errors an exchange keeps for one tensor: the worker error of every row, plus the
    server error of this rank's row when the exchange is an all-reduce (it all-gathers its sums)."""
    if ranks <= 1:  # nothing is compressed inside a group of one
        return 0
    _, n = feedback_rows(numel, ranks, align)
    return 4 * n * (ranks + (1 if server else 0))


def kept_bytes(buckets: Sequence[BucketPlan], stage: int, kept: "KeptFeatures") -> Dict[str, int]:
    """Bytes held per rank by the compression and ZeRO++ flags (keys only where a flag is on):
      error_feedback_bytes  --grad-comm-dtype / --zeropp-quantized-gradients: each bucket's fp32
                            worker error [ranks, n] (ZeRO 0 also the server error [n] of its
                            all-gather); two-hop qgZ also the second hop's [nodes, n] for each
                            dense bucket; adam-1bit: the same for its momentum exchange (whole
                            bucket, ZeRO 0), from the freeze step on
      hpz_secondary_bytes   --zeropp-hpz-partition-size N: 1/N of every dense ZeRO-3 bucket, in the
                            params' dtype, held from a unit's forward to its backward (the peak of
                            a step: every unit's, before the first backward frees any)
    --zeropp-quantized-weights keeps nothing across its gathers."""
    out: Dict[str, int] = {}
    rule = UPDATE_RULES[kept.optimizer]
    exchanges = [(kept.grad_codec, stage == 0), (rule.momentum_codec, True)]
    exchanges = [(CODEC_ALIGN.get(name, 1), server) for name, server in exchanges if name is not None]
    if exchanges:
        out["error_feedback_bytes"] = sum(feedback_bytes(b.numel, n, align, server)
                                          for b, n in zip(buckets, kept.group_sizes) for align, server in exchanges)
        if kept.qgz_nodes > 1 and kept.grad_codec is not None:  # (compression.CompressedReducer._start_two_hops)
            align = CODEC_ALIGN.get(kept.grad_codec, 1)
            out["error_feedback_bytes"] += sum(4 * kept.qgz_nodes * feedback_rows(b.numel, n, align)[1]
                                               for b, n in zip(buckets, kept.group_sizes) if not b.expert)
    if kept.hpz > 1 and stage == 3:
        out["hpz_secondary_bytes"] = sum(b.numel // kept.hpz * _bytes(b.dtype) for b in buckets if not b.expert)
    return out


NVME_ALIGN = 4096  # O_DIRECT wants offsets, lengths and buffer addresses aligned to the logical block


def region_bytes(shard_numel: int, num_tensors: int) -> int:
    """Bytes of one bucket shard's region in the NVMe offload file (optim/nvme_store.py): its fp32
    tensors back to back, padded to NVME_ALIGN."""
    return -(-num_tensors * 4 * shard_numel // NVME_ALIGN) * NVME_ALIGN


def slot_bytes(shard_numels: Sequence[int], num_tensors: int) -> int:
    """Bytes of one NVMe staging buffer: the largest region and that shard's fp32 gradient."""
    return max((region_bytes(n, num_tensors) + 4 * n for n in shard_numels), default=0)


def nvme_bytes_per_step(shard_numels: Sequence[int], num_tensors: int) -> int:
    """File bytes one optimizer step moves (optim/nvme_store.update_all): every region read once and
    written back once."""
    return 2 * sum(region_bytes(n, num_tensors) for n in shard_numels)


def param_spans(buckets: Sequence[BucketPlan]) -> List[List[int]]:
    """ZeRO-3: the buckets of each unit (plan_buckets puts a unit's expert bucket right after its
    dense one), as lists of bucket indices in bucket order."""
    spans: List[List[int]] = []
    for j, b in enumerate(buckets):
        prev = buckets[j - 1] if j else None
        if prev is not None and b.expert and not prev.expert and b.unit == prev.unit:
            spans[-1].append(j)
        else:
            spans.append([j])
    return spans


def param_region_bytes(b: BucketPlan) -> int:
    """Bytes of a bucket's param shard in the --param-offload-nvme-path file, padded to NVME_ALIGN."""
    return -(-b.shard_numel * _bytes(b.dtype) // NVME_ALIGN) * NVME_ALIGN


def with_param_offload(acc: Dict[str, int], buckets: Sequence[BucketPlan], optimizer_nvme: bool,
                       offloaded: Optional[Sequence[bool]] = None) -> Dict[str, int]:
    """state_bytes' figures `acc` under --param-offload-nvme-path: no param shard is held (param_bytes
    0); two staging buffers, each the largest unit's shards (param_staging_bytes); the file
    (param_nvme_bytes). The optimizer's fp32 main params are then a copy of fp32 params too, held in
    memory unless `optimizer_nvme` put them in the optimizer's file (or `offloaded` (per bucket,
    --optimizer-cpu-offload) on the host, where optimizer_host_bytes counts them already)."""
    regions = [param_region_bytes(b) for b in buckets]
    out = dict(acc, param_bytes=0)
    if not optimizer_nvme:
        on_host = offloaded or [False] * len(buckets)
        out["optimizer_state_bytes"] += sum(4 * b.shard_numel for b, off in zip(buckets, on_host)
                                            if b.dtype == torch.float32 and not off)
    out["param_staging_bytes"] = 2 * max((sum(regions[j] for j in span) for span in param_spans(buckets)), default=0)
    out["param_nvme_bytes"] = sum(regions)
    return out


def offloaded_buckets(shard_numels: Sequence[int], fraction: float) -> List[bool]:
    """Which buckets' optimizer state lives on the host for --optimizer-offload-fraction: buckets
    in order while their cumulative share of the rank's shard elements, counted to each bucket's
    middle, stays below the fraction (whole buckets: each shard's state stays one tensor)."""
    total, before, out = sum(shard_numels), 0, []
    for n in shard_numels:
        out.append(total > 0 and (before + n / 2) < fraction * total)
        before += n
    return out
