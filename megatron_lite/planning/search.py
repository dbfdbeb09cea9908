"""Evaluate one layout (memory per rank, step time) and search the layouts of a world for the
fastest ones that fit, with the reasons.

A layout is valid when the trainer itself would accept it: Config.validate (divisibility, the
pipeline schedule's rules, ...) with the candidate's sizes, so a layout the
search proposes is one pretrain_gpt.py runs. It fits when its worst rank (every pipeline stage is
checked, the last TP rank for the padded vocabulary) holds its state and its step's peak within
the GPU's usable memory.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Dict, Iterator, List, Optional, Tuple

from ..config import Config
from ..errors import ConfigError
from ..parallel.pipeline.partition import LayerSplit
from .activations import StepMemoryEstimate, step_memory
from .hardware import GiB, Hardware
from .layout import Layout
from .state import rank_state_bytes
from .timing import StepTime, step_time

RECOMPUTE = (None, "selective", "full")
# bucket_plan.kept_bytes' figures, on the device beside the params, grads and optimizer state
KEPT_ON_DEVICE = ("error_feedback_bytes", "hpz_secondary_bytes")


@dataclass
class RankMemory:
    pp_rank: int
    state: Dict[str, int]  # the optimizer's memory_bytes() on this rank
    step: StepMemoryEstimate

    @property
    def device_bytes(self) -> int:
        s = self.state
        return (s["param_bytes"] + s["grad_bytes"] + s["optimizer_state_bytes"] + self.step.total
                + sum(s.get(k, 0) for k in KEPT_ON_DEVICE))


@dataclass
class Evaluation:
    layout: Layout
    error: Optional[str] = None  # why the trainer would refuse it
    ranks: List[RankMemory] = field(default_factory=list)
    time: Optional[StepTime] = None
    usable: int = 0

    @property
    def valid(self) -> bool:
        return self.error is None

    @property
    def worst(self) -> RankMemory:
        return max(self.ranks, key=lambda r: r.device_bytes)

    @property
    def peak_bytes(self) -> int:
        return self.worst.device_bytes

    @property
    def fits(self) -> bool:
        return self.valid and self.peak_bytes <= self.usable


def trainer_error(cfg: Config, lay: Layout) -> Optional[str]:
    """The ConfigError the trainer would raise for this layout, or None."""
    p = replace(cfg.parallel, tensor_model_parallel_size=lay.tp, pipeline_model_parallel_size=lay.pp,
                context_parallel_size=lay.cp, expert_model_parallel_size=lay.ep,
                expert_tensor_parallel_size=lay.etp,
                virtual_pipeline_model_parallel_size=lay.vpp if lay.vpp > 1 else None,
                num_layers_per_virtual_pipeline_stage=None, pipeline_schedule=lay.schedule,
                sequence_parallel=lay.sequence_parallel, zero_stage=lay.zero_stage,
                overlap_grad_reduce=lay.overlap_grad_reduce, overlap_param_gather=lay.overlap_param_gather,
                decoder_first_pipeline_num_layers=lay.split.first, decoder_last_pipeline_num_layers=lay.split.last,
                pipeline_model_parallel_layout=lay.split.layout,
                account_for_embedding_in_pipeline_split=lay.split.account_for_embedding,
                account_for_loss_in_pipeline_split=lay.split.account_for_loss)
    t = replace(cfg.training, micro_batch_size=lay.micro_batch_size, global_batch_size=lay.global_batch_size,
                recompute_granularity=lay.recompute, recompute_method=lay.recompute_method,
                recompute_num_layers=lay.recompute_num_layers, finetune=False)  # no filesystem checks
    try:
        Config(model=cfg.model, parallel=p, training=t, data=cfg.data).validate(lay.world_size)
    except ConfigError as e:
        return str(e)
    return None


def evaluate(cfg: Config, lay: Layout, hw: Hardware, inventory, check: bool = True) -> Evaluation:
    ev = Evaluation(lay, usable=hw.usable_bytes)
    if check:
        ev.error = trainer_error(cfg, lay)
        if ev.error:
            return ev
    m = cfg.model
    for r in range(lay.pp):
        ev.ranks.append(RankMemory(r, rank_state_bytes(m.num_layers, lay, r, inventory, hw.gpus_per_node),
                                   step_memory(m, lay, r, inventory, tp_rank=lay.tp - 1)))
    ev.time = step_time(m, lay, hw, inventory)
    return ev


def _divisors(n: int, most: int) -> List[int]:
    return [d for d in range(1, min(n, most) + 1) if n % d == 0]


def candidates(cfg: Config, base: Layout, hw: Hardware, max_pp: int = 16,
               schedules: Tuple[str, ...] = ("1f1b", "interleaved")) -> Iterator[Tuple[Layout, ...]]:
    """Groups of layouts that share everything but the recomputation (tried in order: none,
    selective, full), over TP, CP (TP x CP inside a node), PP, VPP, EP and ZeRO, with sequence
    parallelism whenever TP > 1 and the distributed optimizer's overlaps on."""
    m, world = cfg.model, base.world_size
    experts = m.moe.num_experts if m.moe is not None else 0
    for tp in (t for t in (1, 2, 4, 8) if t <= hw.gpus_per_node):
        for cp in (c for c in (1, 2, 4, 8) if tp * c <= hw.gpus_per_node):
            for pp in _divisors(m.num_layers, max_pp):
                if world % (tp * cp * pp):
                    continue
                dp = world // (tp * cp * pp)
                vpps = [1] + ([v for v in range(2, 9) if m.num_layers % (pp * v) == 0] if pp > 1 else [])
                # MoE parallel folding: EP over any ranks of a stage (TP ranks first), not only DP x CP
                eps = [e for e in _divisors(tp * cp * dp, 64) if experts % e == 0] if experts else [1]
                for vpp in vpps:
                    schedule = ("interleaved" if vpp > 1 else "1f1b") if pp > 1 else None
                    if schedule is not None and schedule not in schedules:
                        continue
                    for ep in eps:
                        for zero in (0, 1, 2, 3):
                            lay = base.with_(tp=tp, cp=cp, pp=pp, vpp=vpp, dp=dp, ep=ep, etp=1, zero_stage=zero,
                                             sequence_parallel=tp > 1, schedule=schedule,
                                             overlap_grad_reduce=True, overlap_param_gather=zero >= 1,
                                             split=LayerSplit())
                            yield tuple(lay.with_(recompute=r) for r in RECOMPUTE)


@dataclass
class SearchResult:
    ranked: List[Evaluation]  # fitting layouts, fastest first
    rejected: List[Evaluation]  # valid but not fitting, or refused by the trainer's rules
    evaluated: int


def search(cfg: Config, base: Layout, hw: Hardware, inventory, **kw) -> SearchResult:
    ranked, rejected, n = [], [], 0
    for group in candidates(cfg, base, hw, **kw):
        for lay in group:  # recomputation only when the layout does not fit without it
            ev = evaluate(cfg, lay, hw, inventory)
            n += 1
            if ev.fits:
                ranked.append(ev)
                break
            rejected.append(ev)
            if not ev.valid:
                break
    ranked.sort(key=lambda e: (round(e.time.total_s, 4), e.peak_bytes))
    return SearchResult(ranked, rejected, n)


# --- reasons ------------------------------------------------------------------------------------
DIMENSIONS = {"tp": "TP", "pp": "PP", "vpp": "VPP", "cp": "CP", "ep": "EP", "zero_stage": "ZeRO", "recompute": "recompute"}


def gib(n: float) -> str:
    return f"{n / GiB:.1f} GiB"


def memory_line(ev: Evaluation) -> str:
    w = ev.worst
    s = w.state
    parts = [f"params {gib(s['param_bytes'])}", f"grads {gib(s['grad_bytes'])}",
             f"optimizer {gib(s['optimizer_state_bytes'])}",
             f"activations {gib(w.step.activations)} ({w.step.in_flight} chunk-micro-batches in flight)"]
    parts += [f"{k.replace('_', ' ')} {gib(v)}" for k, v in w.step.buffers.items() if v]
    parts += [f"{k[:-len('_bytes')].replace('_', ' ')} {gib(s[k])}" for k in KEPT_ON_DEVICE if s.get(k)]
    if s.get("optimizer_host_bytes"):
        parts.append(f"host: optimizer {gib(s['optimizer_host_bytes'])}")
    if s.get("optimizer_nvme_bytes"):
        parts.append(f"host: optimizer staging {gib(s['optimizer_staging_bytes'])} (NVMe: optimizer "
                     f"{gib(s['optimizer_nvme_bytes'])})")
    if s.get("param_nvme_bytes"):
        parts.append(f"host: param staging {gib(s['param_staging_bytes'])} (NVMe: param shards "
                     f"{gib(s['param_nvme_bytes'])})")
    return (f"{gib(ev.peak_bytes)} of {gib(ev.usable)} usable on pipeline rank {w.pp_rank}: " + ", ".join(parts))


def time_line(ev: Evaluation, hw: Hardware) -> str:
    t, lay = ev.time, ev.layout
    parts = [f"compute {t.compute_s:.2f} s"]
    if lay.pp > 1:
        parts.append(f"pipeline bubble {t.bubble_s:.2f} s ({t.bubble_fraction:.1%} of compute, "
                     f"{lay.pipeline_schedule} p={lay.pp} v={lay.vpp} m={lay.num_microbatches})")
    for name, v in (("TP comm", t.tp_s), ("CP comm", t.cp_s), ("EP all-to-all", t.ep_s), ("DP comm exposed", t.dp_s),
                    ("optimizer", t.optimizer_s), ("NVMe I/O exposed", t.nvme_s)):
        if v > 0.0005:
            parts.append(f"{name} {v:.2f} s")
    tokens = lay.global_batch_size * lay.seq_length / t.total_s / lay.world_size
    return f"{t.total_s:.2f} s/step ({', '.join(parts)}); {tokens:,.0f} tokens/s/GPU, MFU {t.mfu(hw):.1%}"


def _components(ev: Evaluation) -> Dict[str, float]:
    t = ev.time
    return {"compute": t.compute_s, "pipeline bubble": t.bubble_s, "TP comm": t.tp_s, "CP comm": t.cp_s,
            "EP all-to-all": t.ep_s, "DP comm": t.dp_s, "optimizer": t.optimizer_s, "NVMe I/O": t.nvme_s}


def _value(lay: Layout, dim: str):
    return getattr(lay, dim)


def reasons(result: SearchResult, hw: Hardware) -> List[str]:
    """Why the best layout: per dimension, the best alternative value and what it costs."""
    best = result.ranked[0]
    lines = []
    everything = result.ranked + result.rejected
    for dim, label in DIMENSIONS.items():
        mine = _value(best.layout, dim)
        others = [e for e in everything if e.valid and _value(e.layout, dim) != mine]
        fitting = [e for e in others if e.fits]
        if fitting:
            alt = min(fitting, key=lambda e: e.time.total_s)
            delta = alt.time.total_s / best.time.total_s - 1
            diffs = sorted(((v - _components(best)[k], k) for k, v in _components(alt).items()), reverse=True)
            worse = ", ".join(f"{k} +{d:.2f} s" for d, k in diffs if d > 0.005)[:120]
            lines.append(f"{label} {_fmt(dim, mine)}: the best with {label} {_fmt(dim, _value(alt.layout, dim))} "
                         f"({alt.layout.describe()}) is {delta:+.1%} per step" + (f" ({worse})" if worse else "")
                         + f", peak {gib(alt.peak_bytes)}")
        elif others:
            alt = min(others, key=lambda e: e.peak_bytes)
            lines.append(f"{label} {_fmt(dim, mine)}: every other {label} value is refused or does not fit (closest: "
                         f"{alt.layout.describe()} needs {gib(alt.peak_bytes)} > {gib(alt.usable)})")
    return lines


def neighbours(cfg: Config, best: Evaluation, hw: Hardware, inventory) -> List[str]:
    """The best layout with only its ZeRO stage or its recomputation changed: what each would cost."""
    lines = []
    for dim, values in (("zero_stage", (0, 1, 2, 3)), ("recompute", RECOMPUTE)):
        for value in values:
            if value == getattr(best.layout, dim):
                continue
            change = {dim: value}
            if dim == "zero_stage":  # the param-gather overlap exists with the distributed optimizer only
                change["overlap_param_gather"] = best.layout.overlap_param_gather and value >= 1
            ev = evaluate(cfg, best.layout.with_(**change), hw, inventory)
            what = f"{DIMENSIONS[dim]} {_fmt(dim, value)} instead"
            if not ev.valid:
                lines.append(f"{what}: refused ({ev.error})")
            elif not ev.fits:
                lines.append(f"{what}: does not fit ({gib(ev.peak_bytes)} > {gib(ev.usable)})")
            else:
                lines.append(f"{what}: {ev.time.total_s / best.time.total_s - 1:+.1%} per step, peak "
                             f"{gib(ev.peak_bytes)} ({(ev.peak_bytes - best.peak_bytes) / GiB:+.1f} GiB)")
    return lines


def _fmt(dim: str, v) -> str:
    return str(v if v is not None else "none")
