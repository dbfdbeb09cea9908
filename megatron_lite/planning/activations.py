"""The memory a training step allocates on one rank on top of the state it holds across steps:
the activations autograd keeps, for as many micro-batches as the pipeline schedule keeps in
flight, plus what is alive at the worst moment (the loss's logits, ZeRO's gathered parameters
and full gradients).

What a layer keeps for backward is what its type reports (transformer/counts.py: norms, attention,
MLP, MoE layer, the residual stream; the embedding, final norm and loss in model_counts.py), checked
tensor by tensor with planning/measure.py. Per model chunk on top (bytes per token of a micro-batch,
`a` the activation element size, widths per TP rank: q = heads/tp x head dim, kv = groups/tp x head
dim, f = ffn/tp):

  chunk                its input a h (residual tokens); RoPE's cos and sin 2 a d
  recomputation        full: only each recomputed group's input a h (residual tokens), and while a
                       group's backward runs, its recomputed activations

Transients at their worst moment: the chunked loss's fp32 copy of one chunk of logits, forward and
backward (fp32 logits are worked on in place: none); its backward the input gradient a h and the
output layer's weight gradient;
a layer's forward its largest temporary (RoPE on q: 3 a q); a recomputed layer's backward the
gradients beside its activations (residual gradient and its gathered copy, the MLP's input
gradient).
ZeRO-3 keeps the root unit (embedding, final norm, output layer) and two layers of the running chunk
gathered (the linear layers save the parameters, not views of the gathered storage); with
--no-reshard-after-forward every unit of every chunk. ZeRO-2/3 keep a bucket's full
gradient from its first gradient until it is reduce-scattered: by default in the same micro-batch's
backward (a transient of each backward: the buckets whose gradients are arriving, in reverse
registration order with the embedding's last, and with --overlap-grad-reduce the one reduction in
flight; buckets of the pipeline-tied embedding wait for the step's end), with
--grad-reduce-once-per-step after the last micro-batch's (all of them from the second micro-batch on).

The pipeline's effect is exact: the rank's own list of compute actions (schedules.compute_orders)
is walked, adding a chunk's activations at each F and removing them at each BW (zb-h1: B frees
all but what the deferred weight gradients need, the linear layers' inputs and output gradients,
until W).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch

from ..config import ModelConfig
from ..parallel.bucket_plan import BucketPlan, ParamInfo, plan_buckets
from ..parallel.pipeline.schedules import ZERO_BUBBLE, Action, compute_orders
from ..transformer.model_counts import MicroBatch, loss_chunk_tokens, model_counts
from .layout import Layout
from .state import rank_buckets, stage_chunks


def element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def micro_batch(lay: Layout) -> MicroBatch:
    """One micro-batch on one rank of the layout (tokens of this CP rank's sequence part)."""
    return MicroBatch(lay.seq_length, lay.seq_length // lay.cp * lay.micro_batch_size, lay.tp, lay.etp, lay.sp,
                      element_size(lay.params_dtype), lay.recompute, lay.recompute_modules)


@dataclass
class Widths:
    """Per-rank tensor widths of one micro-batch."""
    tokens: int  # s / cp x b
    residual_tokens: int  # tokens of residual-stream tensors: / tp under SP
    a: int  # activation element size
    h: int
    d: int
    q: int
    kv: int
    f: int
    vocab: int  # padded vocabulary rows per TP rank

    @classmethod
    def of(cls, cfg: ModelConfig, lay: Layout) -> "Widths":
        mb, tp, d = micro_batch(lay), lay.tp, cfg.kv_channels
        return cls(mb.tokens, mb.residual_tokens, mb.a, cfg.hidden_size, d, cfg.num_attention_heads // tp * d,
                   max(1, cfg.num_query_groups // tp) * d, cfg.ffn_hidden_size // tp, cfg.padded_vocab_size(tp) // tp)


def _layer_forward_transient(cfg: ModelConfig, w: Widths) -> int:
    """The largest temporary inside a layer's forward: RoPE on q (x cos, the rotated copy and its
    product with sin, beside q itself), or RMSNorm's fp32 square."""
    if cfg.position_embedding_type == "rope":
        return 3 * w.a * w.q * w.tokens
    return 4 * w.h * w.residual_tokens if cfg.normalization == "RMSNorm" else 0


def _layer_backward_working_set(w: Widths) -> int:
    """Gradients alive inside a layer's backward beside its activations: the incoming gradient of the
    residual stream and its all-gathered copy (SP), and the MLP's input gradient."""
    return w.a * w.h * (w.tokens + w.residual_tokens) + w.a * w.f * w.tokens


def _mlp_backward_working_set(cfg: ModelConfig, w: Widths) -> int:
    """The largest working set of a layer's backward, its MLP's: the residual gradient (and its
    gathered copy), the gradients of fc2's input and of fc1's output, and fc1's weight gradient
    before it joins the main gradient."""
    fc1 = (2 if cfg.swiglu else 1) * w.f
    return w.a * (w.h * (w.tokens + w.residual_tokens) + (fc1 + w.f) * w.tokens + fc1 * w.h)


def _linear_io(cfg: ModelConfig, w: Widths) -> int:
    """zb-h1: bytes per token a layer's deferred weight gradients keep from B to W: every linear's
    input and output gradient (q and [k | v] share their input)."""
    fc1 = (2 if cfg.swiglu else 1) * w.f
    inputs = 2 * w.h + w.q + w.f
    grads = w.q + 2 * w.kv + 2 * w.h + fc1
    return w.a * (inputs + grads)


def _loss_transients(cfg: ModelConfig, lay: Layout, w: Widths, padded_here: bool) -> Tuple[int, int]:
    """(forward, backward) bytes alive beyond the saved activations at the loss: fp32 logits are
    the softmax's buffer (in place); chunked bf16 logits add one chunk's fp32 copy, forward and
    backward (whose gradient overwrites the logits). Backward: the input gradient a h and the
    output layer's weight gradient."""
    chunk = loss_chunk_tokens(w.a, w.vocab)
    fwd = 4 * w.vocab * min(chunk, w.tokens) if chunk else 0
    bwd = fwd + w.a * w.h * w.tokens + w.a * w.vocab * w.h
    return fwd, bwd


@dataclass
class ChunkCost:
    saved: int  # kept from F to BW
    deferred: int  # zb-h1: kept from B to W (the linear layers' inputs and output gradients)
    fwd_transient: int
    bwd_transient: int
    loss_saved: int = 0  # of `saved`, what the loss part keeps (freed before the layers' backward)


def chunk_costs(cfg: ModelConfig, lay: Layout, pp_rank: int, tp_rank: int = 0) -> List[ChunkCost]:
    w, counts = Widths.of(cfg, lay), model_counts(cfg, micro_batch(lay))
    # A chunk's input (the embedding's output or the received activation), RoPE's cos and sin;
    # the last stage's loss part is freed by the time the layers' backward (and recomputation) starts.
    chunk_input = w.a * w.h * w.residual_tokens
    chunk_input += 2 * w.a * w.d * w.tokens if cfg.position_embedding_type == "rope" else 0
    loss = counts.final_norm.act_bytes + counts.output.act_bytes + counts.mtp.act_bytes  # MTP: on the last stage
    out = []
    replayed = _selective_recompute_transient(cfg, lay)
    for (lo, hi), pre, post in stage_chunks(cfg.num_layers, lay, pp_rank):
        layers = [layer.act_bytes for layer in counts.layers[lo:hi]]
        fetched = _offloaded_backward(layers, lo, lay.cpu_offloading_num_layers, _mlp_backward_working_set(cfg, w),
                                      loss if post else 0)
        layers = [0 if lo + i < lay.cpu_offloading_num_layers else n for i, n in enumerate(layers)]
        extra = chunk_input + (counts.embedding.act_bytes if pre else 0) + (loss if post else 0)
        recomputed = 0
        if lay.recompute == "full":
            n = max(1, lay.recompute_num_layers)
            groups = [layers[i:i + n] for i in range(0, len(layers), n)]
            if lay.recompute_method == "block":
                groups, plain = groups[:1], layers[n:]
            else:
                plain = []
            saved = extra + len(groups) * w.a * w.h * w.residual_tokens + sum(plain)
            # One group is recomputed at a time, once the loss's own tensors are gone.
            recomputed = max(sum(g) for g in groups) - (loss if post else 0) if groups else 0
            recomputed += _layer_backward_working_set(w)
            if pre and post and not cfg.untie_embeddings_and_output_weights:
                # The tied weight's gradient from the output layer waits in autograd's input buffer
                # for the embedding's, through the whole backward of the layers.
                recomputed += w.a * w.vocab * w.h
        else:
            saved = extra + sum(layers)
        # A recomputed module's activations come back in the last layer's backward, beside its working
        # set, once the loss's tensors are gone.
        replay = max(0, replayed + _mlp_backward_working_set(cfg, w) - (loss if post else 0)) if replayed else 0
        fwd_t, bwd_t = _layer_forward_transient(cfg, w), max(replay, fetched)
        if post:
            padded_here = (tp_rank + 1) * w.vocab > cfg.vocab_size
            loss_fwd, loss_bwd = _loss_transients(cfg, lay, w, padded_here)
            bwd_t = max(bwd_t, loss_bwd)
            fwd_t = max(fwd_t, loss_fwd)
        deferred = 0
        if lay.pipeline_schedule in ZERO_BUBBLE:
            deferred = _linear_io(cfg, w) * w.tokens * (hi - lo)
            if post:  # the output layer's input and the logits' gradient
                deferred += w.a * (w.h + w.vocab) * w.tokens
        out.append(ChunkCost(saved, deferred, fwd_t, max(recomputed, bwd_t), loss if post else 0))
    return out


def _selective_recompute_transient(cfg: ModelConfig, lay: Layout) -> int:
    """--recompute-modules: what a layer's backward brings back at most at once, one recomputed
    module's activations (the difference it makes to a layer's kept bytes), beyond core_attn's."""
    if lay.recompute != "selective":
        return 0
    mods = set(lay.recompute_modules)
    kept = functools.partial(_layer_bytes, cfg, lay)
    return max([kept(tuple(mods - {m})) - kept(tuple(mods)) for m in mods - {"core_attn"}], default=0)


def _layer_bytes(cfg: ModelConfig, lay: Layout, modules: Tuple[str, ...]) -> int:
    """The most any layer of the model keeps under these --recompute-modules."""
    layers = model_counts(cfg, micro_batch(lay.with_(recompute_modules=modules))).layers
    return max(layer.act_bytes for layer in layers)


def _offloaded_backward(layers: List[int], first: int, offloaded: int, working_set: int, loss: int) -> int:
    """--cpu-offloading: the most device bytes the backward of an offloaded layer (of a chunk whose
    layers keep `layers`, the first numbered `first`) needs beyond the chunk's live activations:
    its activations and those of the layer before it, brought back ahead of time, beside the
    layer's backward working set; the chunk's kept layers after it and the loss's are gone by then."""
    n = min(len(layers), max(0, offloaded - first))
    if n == 0:
        return 0
    back = max(layers[i] + (layers[i - 1] if i > 0 else 0) for i in range(n))
    return max(0, back + working_set - sum(layers[n:]) - loss)


@functools.lru_cache(maxsize=256)
def _orders(schedule: str, p: int, m: int, v: int):
    return compute_orders(schedule, p, m, v)


def rank_order(schedule: str, p: int, m: int, v: int, rank: int):
    """A pipeline rank's compute actions in order (cached: the planner walks the same lists for
    every layout of the same shape)."""
    return _orders(schedule, p, m, v)[rank]


def _walk(order, costs: List[ChunkCost], kept: Optional[Dict[int, Tuple[int, bool]]] = None) -> Tuple[int, int]:
    """(peak bytes, peak in-flight chunk-micro-batches) over one rank's compute actions in order.
    `kept`: chunk -> (bytes, early) allocated in that chunk's first backward, at its start (early)
    or its end, and kept to the step's end."""
    live = peak = inflight = peak_inflight = 0
    kept = dict(kept or {})
    for a in order:
        c = costs[a.chunk]
        late = 0
        if a.kind in ("BW", "B") and a.chunk in kept:
            n, early = kept.pop(a.chunk)
            live, late = (live + n, 0) if early else (live, n)
        if a.kind == "F":
            peak = max(peak, live + c.saved + c.fwd_transient)
            live += c.saved
            inflight += 1
            peak_inflight = max(peak_inflight, inflight)
        elif a.kind in ("BW", "B"):
            peak = max(peak, live + c.bwd_transient)
            live -= c.saved - (c.deferred if a.kind == "B" else 0) - late
            inflight -= 1
        elif a.kind == "W":
            live -= c.deferred
    return peak, peak_inflight


def _grad_arrival(params: List[ParamInfo]) -> List[int]:
    """Each parameter's place in the order a chunk's backward completes the gradients: reverse
    registration, but the embedding's last (its backward runs last, and a tied word embedding's
    gradient completes only there)."""
    n = len(params)
    return [n + i if p.name.startswith("embedding.") else n - 1 - i for i, p in enumerate(params)]


def live_grad_bytes(params: List[ParamInfo], plans: List[BucketPlan], grad_bytes: int, overlap: bool) -> int:
    """Per-micro-batch reduction: the most bytes of full gradient buckets alive at once in one
    backward of a chunk. A bucket lives from its first gradient to its reduction (GradientSync waits
    for it there), with --overlap-grad-reduce until the next bucket's reduction starts (one round in
    flight)."""
    pos = _grad_arrival(params)
    spans = sorted([[min(pos[i] for i in b.params), max(pos[i] for i in b.params), b.numel * grad_bytes]
                    for b in plans], key=lambda s: s[1])
    if overlap:
        for this, nxt in zip(spans, spans[1:]):
            this[1] = nxt[1]
    return max((sum(n for lo, hi, n in spans if lo <= t <= hi) for t, _, _ in spans), default=0)


def _tied_across_stages(cfg: ModelConfig, lay: Layout, pre: bool, post: bool, p: ParamInfo) -> bool:
    """The pipeline-tied word embedding's copy on the first or last stage (GradientSync defers its bucket)."""
    if cfg.untie_embeddings_and_output_weights or lay.pp == 1 or (pre and post):
        return False
    return p.name == ("embedding.word_embeddings.weight" if pre else "output_layer.weight")


def _sharded_grad_buffers(cfg: ModelConfig, lay: Layout, pp_rank: int,
                          inventory) -> Tuple[List[int], Dict[int, Tuple[int, bool]]]:
    """Per-micro-batch reduction: (per chunk, its live full gradients in a backward; per chunk, the
    bytes of its deferred buckets, kept from its first backward to the step's end, and whether they
    come at that backward's start: the last stage's output layer; the first stage's embedding
    comes at its end)."""
    g, per_chunk, deferred = element_size(lay.grad_dtype), [], {}
    for c, (layer_range, pre, post) in enumerate(stage_chunks(cfg.num_layers, lay, pp_rank)):
        params = inventory(layer_range, pre, post, lay.tp, lay.ep, lay.etp)
        plans = plan_buckets(params, lay.zero_stage, lay.buckets, lay.dp * lay.cp, lay.edp)
        tied = [any(_tied_across_stages(cfg, lay, pre, post, params[i]) for i in b.params) for b in plans]
        if any(tied):
            deferred[c] = (sum(b.numel * g for b, t in zip(plans, tied) if t), post)
        per_chunk.append(live_grad_bytes(params, [b for b, t in zip(plans, tied) if not t], g,
                                         lay.overlap_grad_reduce))
    return per_chunk, deferred


@dataclass
class StepMemoryEstimate:
    activations: int  # peak of activations and loss transients over the schedule
    in_flight: int  # chunk-micro-batches alive at once at most
    buffers: Dict[str, int] = field(default_factory=dict)  # ZeRO gathered params, full grads, p2p

    @property
    def total(self) -> int:
        return self.activations + sum(self.buffers.values())


def step_memory(cfg: ModelConfig, lay: Layout, pp_rank: int, inventory, tp_rank: int = 0) -> StepMemoryEstimate:
    """What one step allocates on a rank of pipeline stage `pp_rank` on top of its held state."""
    costs = chunk_costs(cfg, lay, pp_rank, tp_rank)
    m = lay.num_microbatches
    buffers = {}
    w = Widths.of(cfg, lay)
    if lay.grad_reduce_per_microbatch:
        # The gradients arrive once the loss's backward is done (its tensors freed), beside a layer's
        # backward working set.
        live, deferred = _sharded_grad_buffers(cfg, lay, pp_rank, inventory)
        for c, n in zip(costs, live):
            c.bwd_transient = max(c.bwd_transient, n - c.loss_saved + _layer_backward_working_set(w))
    else:
        deferred = {}
    if lay.pp > 1:
        order = rank_order(lay.pipeline_schedule, lay.pp, m, lay.vpp, pp_rank)
    else:
        order = [Action(kind, mb) for mb in range(min(m, 2)) for kind in ("F", "BW")]  # the same after two
    peak, inflight = _walk(order, costs, deferred)  # the pipeline-tied embedding's full gradient
    if lay.pp > 1:  # a received activation and a received gradient in flight
        buffers["p2p"] = 2 * w.a * w.h * w.residual_tokens
    if lay.zero_stage >= 2 and m > 1 and not lay.grad_reduce_per_microbatch:
        # From the second micro-batch on, every bucket's full gradient exists (they are reduced
        # after the last micro-batch's); with one micro-batch they arrive as activations go.
        g = element_size(lay.grad_dtype)
        buffers["full_grads"] = sum(b.numel * g for b in rank_buckets(cfg.num_layers, lay, pp_rank, inventory))
    if lay.zero_stage == 3:
        chunks = _unit_param_bytes(cfg, lay, pp_rank, inventory)
        if lay.reshard_after_forward:
            # Gathered while a chunk's forward or backward runs: its root, the running layer and the
            # prefetched next one (the linear layers save the parameters, not views of their
            # gathered storage); the other chunks' are freed. Reported as what they add to the peak.
            for c, units in zip(costs, chunks):
                gathered = units[0] + sum(sorted(units[1:])[-2:])
                c.fwd_transient, c.bwd_transient = c.fwd_transient + gathered, c.bwd_transient + gathered
            buffers["gathered_params"] = _walk(order, costs, deferred)[0] - peak
        else:  # every unit of every chunk, from its first use to the step's end
            buffers["gathered_params"] = sum(sum(units) for units in chunks)
    if lay.fp8:
        buffers["fp8_operands"] = _fp8_operands(cfg, lay, w)
    return StepMemoryEstimate(peak, inflight, buffers)


def _fp8_operands(cfg: ModelConfig, lay: Layout, w: Widths) -> int:
    """FP8 current scaling (parallel/fp8.py) keeps no FP8 copy: autograd saves the input and the
    weight as they are, and each GEMM quantizes its two operands (one byte an element) for its own
    time. The largest such pair: fc1's (or an expert's, or QKV's, if wider), over its three GEMMs."""
    ffn = max(w.f, cfg.moe.moe_ffn_hidden_size // lay.etp if cfg.moe is not None else 0)
    out = max((2 if cfg.swiglu else 1) * ffn, w.q + 2 * w.kv)
    x, g, weight = w.tokens * w.h, w.tokens * out, out * w.h
    return max(x + weight, g + weight, g + x)


def _unit_param_bytes(cfg, lay, pp_rank, inventory) -> List[List[int]]:
    """ZeRO-3, per model chunk of the rank: bytes of each unit's gathered (full, padded) buckets,
    the root unit first."""
    out = []
    for layer_range, pre, post in stage_chunks(cfg.num_layers, lay, pp_rank):
        params = inventory(layer_range, pre, post, lay.tp, lay.ep, lay.etp)
        units: Dict[int, int] = {}
        for b in plan_buckets(params, 3, lay.buckets, lay.dp * lay.cp, lay.edp):
            u = params[b.params[0]].unit
            units[u] = units.get(u, 0) + b.numel * element_size(b.dtype)
        out.append([units.get(0, 0)] + [units[k] for k in sorted(units) if k])
    return out


def formula_layer_bytes(cfg: ModelConfig, tokens: int, tp: int = 1, sp: bool = False, a: int = 2) -> int:
    """Korthikanti et al. ("Reducing Activation Recomputation in Large Transformer Models", 2022) for
    one dense layer with flash-style attention (no s^2 terms), bytes over `tokens` (s x b) on one of
    `tp` ranks, `a` the activation element size. Per token:

      residual width, / tp under SP    norm inputs 2 a h, the Q/K/V and fc1 inputs 2 a h,
                                       hidden-dropout masks 2 h (one byte each, with dropout)
      split over TP                    Q a h, K and V 2 a g d (g query groups), the core's output a h
                                       and its log-sum-exp 4 n (n heads); GELU: fc1's output and GELU's
                                       output 2 a f; SwiGLU: [gate | up] 2 a f and their product a f

    GPT (h = n d = g d, f = 4 h, bf16): 32 h, with dropout 34 h, per token: 34 s b h / t under SP.
    Biases add nothing (their gradients need only the output gradient); the norms' statistics
    (LayerNorm's mean and 1/std, RMSNorm's 1/rms: 8 or 4 bytes a token each) are left out, as
    Korthikanti does.

    Llama (RMSNorm, SwiGLU, GQA, no biases), per token on one rank:
      4 a h / (tp under SP)  +  (2 a h + 2 a g d + 4 n + 3 a f) / tp
    e.g. Llama-3-70B (h 8192, n 64, g 8, d 128, f 28672), bf16: 33.5 h bytes a token, at TP4
    with SP 8.38 s b h per rank."""
    h, n, g, d, f = (cfg.hidden_size, cfg.num_attention_heads, cfg.num_query_groups, cfg.kv_channels,
                     cfg.ffn_hidden_size)
    replicated = 4 * a * h + (2 * h if cfg.hidden_dropout > 0 else 0)
    split = a * (2 * n * d + 2 * max(1, g // tp) * tp * d) + 4 * n + (3 if cfg.swiglu else 2) * a * f
    return tokens * (replicated // (tp if sp else 1) + split // tp)
