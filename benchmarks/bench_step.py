#!/usr/bin/env python
"""Training-step time: megatron-lite against plain single-file PyTorch (TP=1) or Megatron-Core (TP=1, 2).

    python benchmarks/bench_step.py [--model llama-20m] [--micro-batch-size 4] [--repeats 8]
    python benchmarks/bench_step.py --against megatron-core [--tp 1 2] [--family llama|gpt2]
        [--repeats 10] [--profile N] [--mcore-core-attention local|sdpa]

The plain reference below is the same Llama architecture written the ordinary way (nn.Linear,
F.scaled_dot_product_attention, RMSNorm, RoPE, SwiGLU, GQA, torch.optim.AdamW, grad clipping).
Before timing, our initial weights are copied into it and both must give the same loss on the
same batch, so the two sides compute the same thing. Steps are interleaved (ours, plain, ours,
plain, ...) so that machine noise hits both alike; we report medians and ours / plain.

`--against megatron-core` (needs `pip install megatron-core==0.16.1`, imported lazily; it is not
a dependency of megatron-lite) builds, in each TP world of forked gloo ranks (one torch thread per
rank at TP>1, `--threads` at TP=1), our model and Megatron-Core's `GPTModel` with
`get_gpt_layer_local_spec()` (no Transformer Engine) of the same shape: by default Llama-style,
4 layers x h 256, 4 heads / 2 query groups, SwiGLU 704, vocab 8192, seq 256, micro-batch 4, fp32
(`--family gpt2`: LayerNorm, learned positions, GELU, biases, tied embeddings). Our initial
weights are copied into Megatron-Core's through the full tensors (Q, K, V fused into its
per-group linear_qkv), and the initial losses must agree. Each side steps with its own machinery:
ours `train_step` with the project's optimizer; theirs its DistributedDataParallel,
`get_megatron_optimizer` (FP32Optimizer over torch AdamW, its CPU fallback without TE/apex),
the no-pipelining schedule and `finalize_model_grads`; both Adam(W) lr 3e-4, weight decay 0.01
(not on norms), clipping at 1.0, one micro-batch per step. Steps alternate ours / Megatron-Core
after a barrier; we report per TP size the medians, ours / Megatron-Core, phase times (forward,
backward, grad sync, optimizer incl. zeroing), and our collectives per step (CommCounter).
`--profile N` then runs N more steps of each side under torch.profiler and lists the top
self-time ops and every collective (gloo), per step, on rank 0. Megatron-Core needs a few CPU
shims (see `mcore_cpu_shims`), none of which touches its math.
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from collections import defaultdict
from typing import Callable, Dict, List, Tuple

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from megatron_lite.config import ModelConfig, ParallelConfig, TrainingConfig  # noqa: E402
from megatron_lite.parallel import comm  # noqa: E402
from megatron_lite.parallel.state import ParallelDims  # noqa: E402
from megatron_lite.training.step import train_step  # noqa: E402
from megatron_lite.optim.optimizer import build_optimizer  # noqa: E402
from models import zoo  # noqa: E402
from models.gpt import build_model, gpt_forward_step  # noqa: E402
from models.hf_conversion import gather_full_state_dict, megatron_lite_to_hf  # noqa: E402


# --- the plain reference (HF-style names, so our weights load through megatron_lite_to_hf) ---
class RMSNorm(nn.Module):
    def __init__(self, h: int, eps: float):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(h)), eps

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        h, d = cfg.hidden_size, cfg.kv_channels
        self.heads, self.groups, self.d = cfg.num_attention_heads, cfg.num_query_groups, d
        self.q_proj = nn.Linear(h, self.heads * d, bias=False)
        self.k_proj = nn.Linear(h, self.groups * d, bias=False)
        self.v_proj = nn.Linear(h, self.groups * d, bias=False)
        self.o_proj = nn.Linear(self.heads * d, h, bias=False)

    def forward(self, x, cos, sin):
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.heads, self.d).transpose(1, 2)
        k = self.k_proj(x).view(b, s, self.groups, self.d).transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.groups, self.d).transpose(1, 2)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        h, f = cfg.hidden_size, cfg.ffn_hidden_size
        self.gate_proj, self.up_proj = nn.Linear(h, f, bias=False), nn.Linear(h, f, bias=False)
        self.down_proj = nn.Linear(f, h, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_epsilon)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_epsilon)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class PlainLlama(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.model.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.model.norm = RMSNorm(cfg.hidden_size, cfg.norm_epsilon)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def forward(self, tokens, labels):
        d, s = self.cfg.kv_channels, tokens.shape[1]
        inv_freq = 1.0 / self.cfg.rotary_base ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
        freqs = torch.outer(torch.arange(s, dtype=torch.float32), inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        cos, sin = emb.cos(), emb.sin()
        x = self.model.embed_tokens(tokens)
        for layer in self.model.layers:
            x = layer(x, cos, sin)
        logits = self.lm_head(self.model.norm(x))
        return F.cross_entropy(logits.view(-1, logits.shape[-1]).float(), labels.reshape(-1))


def plain_optimizer(model: nn.Module, t: TrainingConfig) -> torch.optim.Optimizer:
    decay = [p for p in model.parameters() if p.dim() > 1]
    no_decay = [p for p in model.parameters() if p.dim() <= 1]
    return torch.optim.AdamW([{"params": decay, "weight_decay": t.weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}],
                             lr=t.lr, betas=(t.adam_beta1, t.adam_beta2), eps=t.adam_eps)


def plain_step(model, opt, batch, clip: float) -> float:
    model.train()
    loss = model(batch["tokens"], batch["labels"])
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.item()


# --- setup, correctness check, timing ---------------------------------------------------------
def build_both(cfg: ModelConfig, t: TrainingConfig):
    dims = ParallelDims().build_groups()
    chunks = build_model(cfg, dims, seed=t.seed)
    optimizer, grad_sync = build_optimizer(chunks, dims, t, ParallelConfig())  # may rebind params
    plain = PlainLlama(cfg)
    plain.load_state_dict(megatron_lite_to_hf(gather_full_state_dict(chunks[0], dims), cfg, "llama"), strict=True)
    ours_step = lambda batch: train_step(chunks, [batch], dims, optimizer, grad_sync, t.lr, gpt_forward_step)["lm_loss"]  # noqa: E731,E501
    return chunks[0], plain, ours_step, plain_optimizer(plain, t)


def timed(fn: Callable[[], float]):
    start = time.perf_counter()
    loss = fn()
    return time.perf_counter() - start, loss


# --- against Megatron-Core (--against megatron-core) ------------------------------------------
# Megatron-Core is imported lazily, inside the forked ranks: it is no dependency of the project.
MCORE_HINT = ("this comparison needs Megatron-Core (not a dependency of megatron-lite): "
              "pip install megatron-core==0.16.1")

# The shape (4 layers x hidden 256, vocab 8192), in a form both frameworks express identically.
MCORE_SHAPES = {
    "llama": dict(num_layers=4, hidden_size=256, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=704,
                  vocab_size=8192, max_position_embeddings=256, normalization="RMSNorm", norm_epsilon=1e-5,
                  position_embedding_type="rope", rotary_base=10000.0, swiglu=True, add_bias_linear=False,
                  untie_embeddings_and_output_weights=True),
    "gpt2": dict(num_layers=4, hidden_size=256, num_attention_heads=4, ffn_hidden_size=1024, vocab_size=8192,
                 max_position_embeddings=256, normalization="LayerNorm", norm_epsilon=1e-5,
                 position_embedding_type="learned_absolute", swiglu=False, activation="gelu", add_bias_linear=True,
                 untie_embeddings_and_output_weights=False),
}
PHASES = ("forward", "backward", "grad_sync", "optimizer")


def mcore_cpu_shims() -> None:
    """Make Megatron-Core 0.16.1 run on CPU, inside this process only. It assumes CUDA in a few
    places off the hot path: `torch.cuda.current_device()` as the device of buffers and RoPE
    frequencies, `device="cuda"` in small factory calls (the FP32 optimizer's loss scale, the grad
    norm's scratch tensors), and one `param.grad.type() == 'torch.cuda.FloatTensor'` assertion.
    Every megatron.core module gets a `torch` whose factories and `torch.cuda.current_device` map
    CUDA to the CPU (everything else is torch's own object, looked up the same way); the assertion's
    function is replaced by the same code without it. Megatron-Core's math is untouched.
    The RNG tracker (CUDA states) is Megatron-Core's own no-op kind (dropout is 0), and the causal
    mask is passed in (its default one is built on "cuda")."""
    import types

    import megatron.core.distributed  # noqa: F401  (imported so that their modules get the shim)
    import megatron.core.models.gpt  # noqa: F401
    import megatron.core.optimizer  # noqa: F401
    import megatron.core.optimizer.clip_grads as cg
    import megatron.core.pipeline_parallel  # noqa: F401
    from megatron.core.tensor_parallel.random import initialize_rng_tracker

    def cpu(d):
        if isinstance(d, int) or (isinstance(d, str) and d.startswith("cuda")) or \
                (isinstance(d, torch.device) and d.type == "cuda"):
            return torch.device("cpu")
        return d

    def factory(fn):
        def f(*a, **kw):
            if "device" in kw:
                kw["device"] = cpu(kw["device"])
            return fn(*a, **kw)
        return f

    cuda = types.ModuleType("torch.cuda (CPU shim)")
    cuda.__dict__.update(vars(torch.cuda))
    cuda.current_device = lambda: torch.device("cpu")
    cuda.synchronize = cuda.empty_cache = lambda *a, **k: None
    proxy = types.ModuleType("torch (CPU shim)")
    proxy.__dict__.update(vars(torch))
    for name in ("tensor", "zeros", "ones", "empty", "full", "arange"):
        setattr(proxy, name, factory(getattr(torch, name)))
    proxy.cuda = cuda

    def clip_grad_by_total_norm_fp32(parameters, max_norm, total_norm, use_decoupled_grad=False):
        if isinstance(parameters, torch.Tensor):
            parameters = [parameters]
        attr = "decoupled_grad" if use_decoupled_grad else "grad"
        grads = [cg.to_local_if_dtensor(getattr(p, attr)).detach() for p in parameters
                 if getattr(p, attr, None) is not None]
        clip_coeff = max_norm / (total_norm + 1.0e-6)
        if clip_coeff < 1.0:
            cg.multi_tensor_applier(cg.multi_tensor_scale_impl, torch.zeros(1, dtype=torch.int), [grads, grads],
                                    clip_coeff)

    original = cg.clip_grad_by_total_norm_fp32
    for name, mod in list(sys.modules.items()):
        if not name.startswith("megatron.core"):
            continue
        if getattr(mod, "torch", None) is torch:
            mod.torch = proxy
        if getattr(mod, "clip_grad_by_total_norm_fp32", None) is original:
            mod.clip_grad_by_total_norm_fp32 = clip_grad_by_total_norm_fp32
    initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)


class SDPACoreAttention(nn.Module):
    """--mcore-core-attention sdpa: Megatron-Core's core-attention slot filled with
    F.scaled_dot_product_attention (the kernel our side uses), to separate the attention kernel from
    the rest of the framework. Megatron-Core's own choice without Transformer Engine is its
    DotProductAttention (baddbmm, masked softmax, bmm), the default here."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                 softmax_scale=None, cp_comm_type=None, pg_collection=None):
        super().__init__()
        self.config = config

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [s, b, n, d] -> [b, n, s, d]
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])
        s, b = query.shape[0], query.shape[1]
        return out.permute(2, 0, 1, 3).reshape(s, b, -1)


def mcore_transformer_config(cfg: ModelConfig, tp: int):
    from megatron.core.transformer.transformer_config import TransformerConfig

    act = F.silu if cfg.swiglu else F.gelu
    return TransformerConfig(
        num_layers=cfg.num_layers, hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_attention_heads,
        num_query_groups=cfg.num_query_groups, ffn_hidden_size=cfg.ffn_hidden_size, kv_channels=cfg.kv_channels,
        normalization=cfg.normalization, layernorm_epsilon=cfg.norm_epsilon, gated_linear_unit=cfg.swiglu,
        activation_func=act, add_bias_linear=cfg.add_bias_linear, hidden_dropout=0.0, attention_dropout=0.0,
        init_method_std=cfg.init_method_std, tensor_model_parallel_size=tp, params_dtype=torch.float32,
        pipeline_dtype=torch.float32, use_cpu_initialization=True, gradient_accumulation_fusion=False,
        bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
        persist_layer_norm=False, apply_rope_fusion=False)


def build_mcore(cfg: ModelConfig, tp: int, t: TrainingConfig, core_attention: str):
    """Megatron-Core's GPTModel (local spec, no Transformer Engine) wrapped in its
    DistributedDataParallel, its optimizer (get_megatron_optimizer: FP32Optimizer over torch AdamW,
    its CPU fallback without TE/apex), its no-pipelining schedule and finalize_model_grads."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    tcfg = mcore_transformer_config(cfg, tp)
    spec = get_gpt_layer_local_spec(normalization=cfg.normalization)
    if core_attention == "sdpa":
        spec.submodules.self_attention.submodules.core_attention = SDPACoreAttention
    model = GPTModel(tcfg, spec, vocab_size=cfg.vocab_size, max_sequence_length=cfg.max_position_embeddings,
                     position_embedding_type=cfg.position_embedding_type, rotary_base=int(cfg.rotary_base),
                     share_embeddings_and_output_weights=not cfg.untie_embeddings_and_output_weights)
    ddp = DistributedDataParallel(tcfg, DistributedDataParallelConfig(grad_reduce_in_fp32=True), model)
    opt = get_megatron_optimizer(OptimizerConfig(
        optimizer="adam", lr=t.lr, min_lr=t.lr, weight_decay=t.weight_decay, adam_beta1=t.adam_beta1,
        adam_beta2=t.adam_beta2, adam_eps=t.adam_eps, clip_grad=t.clip_grad, bf16=False, fp16=False,
        use_distributed_optimizer=False), [ddp])
    return tcfg, model, ddp, opt


def mcore_full_tensors(ours: Dict[str, torch.Tensor], cfg: ModelConfig) -> Dict[str, torch.Tensor]:
    """Our full (unsharded) tensors under Megatron-Core's full-tensor names and layouts: Q, K, V fused
    into linear_qkv, per query group [q heads of the group; k; v]; [gate; up] of SwiGLU as ours."""
    out = {}
    d, ng = cfg.kv_channels, cfg.num_query_groups
    per_group = cfg.num_attention_heads // ng
    for name, t in ours.items():
        if ".self_attention.linear_kv." in name:
            continue
        if ".self_attention.linear_q." in name:
            kv = ours[name.replace(".linear_q.", ".linear_kv.")]
            k, v = kv.chunk(2, dim=0)
            q = t.reshape(ng, per_group * d, *t.shape[1:])
            qkv = torch.cat([q, k.reshape(ng, d, *t.shape[1:]), v.reshape(ng, d, *t.shape[1:])], dim=1)
            out["decoder." + name.replace(".linear_q.", ".linear_qkv.")] = qkv.reshape(-1, *t.shape[1:])
        elif name.startswith("layers."):
            out["decoder." + name] = t
        elif name.startswith("final_norm."):
            out[name.replace("final_norm.", "decoder.final_layernorm.")] = t
        else:
            out[name] = t
    return out


@torch.no_grad()
def load_into_mcore(model: nn.Module, full: Dict[str, torch.Tensor], tp: int, tp_rank: int) -> None:
    """Each Megatron-Core parameter takes its TP shard of the full tensor (its `partition_dim`;
    the SwiGLU fc1 holds [gate shard; up shard])."""
    params = dict(model.named_parameters())
    assert set(params) == set(full), sorted(set(params) ^ set(full))
    for name, p in params.items():
        t = full[name]
        if getattr(p, "tensor_model_parallel", False) and tp > 1:
            dim = p.partition_dim
            if ".mlp.linear_fc1." in name and model.config.gated_linear_unit:
                t = torch.cat([h.chunk(tp, dim)[tp_rank] for h in t.chunk(2, dim)], dim)
            else:
                t = t.chunk(tp, dim)[tp_rank]
        assert t.shape == p.shape, (name, tuple(t.shape), tuple(p.shape))
        p.copy_(t)


class CountingCommCounter(comm.CommCounter):
    """Our CommCounter (bytes per kind), also counting calls."""

    def __init__(self):
        super().__init__()
        self.calls: Dict[str, int] = defaultdict(int)

    def add(self, kind: str, nbytes: int) -> None:
        super().add(kind, nbytes)
        self.calls[kind] += 1

    def take(self) -> Dict[str, Tuple[int, int]]:
        calls, self.calls = dict(self.calls), defaultdict(int)
        return {k: (calls.get(k, 0), b) for k, b in self.reset().items()}


class PhaseClock:
    """Wall-clock marks within one step: forward (forward step called .. loss function returned),
    backward (.. gradient sync called), grad sync, optimizer (incl. zeroing the gradients)."""

    def __init__(self):
        self.marks: Dict[str, float] = {}
        self.spans: Dict[str, float] = defaultdict(float)

    def mark(self, name: str) -> None:
        self.marks[name] = time.perf_counter()

    def timed(self, phase: str, fn: Callable) -> Callable:
        def wrapper(*a, **kw):
            t0 = time.perf_counter()
            if phase == "grad_sync":
                self.mark("backward_end")
            try:
                return fn(*a, **kw)
            finally:
                self.spans[phase] += time.perf_counter() - t0
        return wrapper

    def take(self) -> Dict[str, float]:
        m = self.marks
        out = dict(self.spans)
        out["forward"] = m["forward_end"] - m["forward_start"]
        out["backward"] = m["backward_end"] - m["forward_end"]
        self.marks, self.spans = {}, defaultdict(float)
        return out


def profile_steps(step: Callable[[], float], n: int, top: int) -> dict:
    """Self-time table and collectives of n steps under torch.profiler (CPU), per step."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        for _ in range(n):
            step()
    ops = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total_self = sum(e.self_cpu_time_total for e in prof.key_averages())
    top_ops = [(e.key, e.count / n, e.self_cpu_time_total / n / 1e3) for e in ops
               if not e.key.startswith("gloo:")][:top]
    colls: Dict[tuple, List[float]] = defaultdict(lambda: [0, 0.0])
    enqueue: Dict[str, List[float]] = defaultdict(lambda: [0, 0.0])
    for e in prof.events():
        if e.name.startswith("gloo:"):
            numel = 1
            for dim in (e.input_shapes[0] if e.input_shapes else []):
                numel *= dim
            c = colls[(e.name[5:], numel)]
            c[0] += 1
            c[1] += e.cpu_time_total / 1e3
        elif e.name.startswith("c10d::"):
            enqueue[e.name][0] += 1
            enqueue[e.name][1] += e.cpu_time_total / 1e3
    return {"top": top_ops, "self_total_ms": total_self / n / 1e3,
            "collectives": sorted(((k, numel, c / n, ms / n) for (k, numel), (c, ms) in colls.items()),
                                  key=lambda r: -r[3]),
            "enqueue": {k: (c / n, ms / n) for k, (c, ms) in enqueue.items()}}


def _mcore_worker(rank: int, world: int, args) -> dict:
    """One TP world: our model and Megatron-Core's from the same weights, stepped alternately."""
    torch.set_num_threads(args.threads if world == 1 else 1)
    try:
        from megatron.core import parallel_state
    except ImportError as e:
        raise SystemExit(f"{MCORE_HINT} ({e})")
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.pipeline_parallel import get_forward_backward_func

    mcore_cpu_shims()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    cfg = ModelConfig(**dict(MCORE_SHAPES[args.family], attention_dropout=0.0, hidden_dropout=0.0,
                             attention_backend=args.attention_backend))
    seq, mb = args.seq_length or 256, args.micro_batch_size
    t = TrainingConfig(micro_batch_size=mb, seq_length=seq, lr=3e-4, clip_grad=1.0)

    # ours
    dims = ParallelDims(tp=world).build_groups()
    chunks = build_model(cfg, dims, seed=t.seed)
    optimizer, grad_sync = build_optimizer(chunks, dims, t, ParallelConfig(tensor_model_parallel_size=world))
    full = gather_full_state_dict(chunks[0], dims)
    ours_clock = PhaseClock()
    grad_sync.finish = ours_clock.timed("grad_sync", grad_sync.finish)
    optimizer.step = ours_clock.timed("optimizer", optimizer.step)

    def ours_forward_step(batch, model):
        ours_clock.mark("forward_start")
        output, loss_func = gpt_forward_step(batch, model)

        def marked(out):
            r = loss_func(out)
            ours_clock.mark("forward_end")
            return r
        return output, marked

    # Megatron-Core
    tcfg, mmodel, ddp, mopt = build_mcore(cfg, world, t, args.mcore_core_attention)
    load_into_mcore(mmodel, mcore_full_tensors(full, cfg), world, parallel_state.get_tensor_model_parallel_rank())
    mc_clock = PhaseClock()
    tcfg.finalize_model_grads_func = mc_clock.timed("grad_sync", finalize_model_grads)
    forward_backward = get_forward_backward_func()

    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, cfg.vocab_size, (mb, seq + 1), generator=g)
    batch = {"tokens": data[:, :-1].contiguous(), "labels": data[:, 1:].contiguous(),
             "loss_mask": torch.ones(mb, seq)}
    position_ids = torch.arange(seq).unsqueeze(0).expand(mb, -1)
    causal = torch.triu(torch.ones(seq, seq, dtype=torch.bool), diagonal=1)[None, None]

    def mc_forward_step(data_iterator, model):
        mc_clock.mark("forward_start")
        b = next(data_iterator)
        out = model(b["tokens"], position_ids, causal, labels=b["labels"])

        def loss_func(output):
            loss_sum = (output.float() * b["loss_mask"]).sum()
            tokens = b["loss_mask"].sum()
            mc_clock.mark("forward_end")
            return loss_sum, tokens.to(torch.int), {"lm loss": torch.stack([loss_sum.detach(), tokens])}
        return out, loss_func

    def mc_step():
        t0 = time.perf_counter()
        ddp.zero_grad_buffer()
        mopt.zero_grad()
        zero = time.perf_counter() - t0
        losses = forward_backward(forward_step_func=mc_forward_step, data_iterator=iter([batch]), model=[ddp],
                                  num_microbatches=1, seq_length=seq, micro_batch_size=mb, forward_only=False)
        t1 = time.perf_counter()
        _, grad_norm, _ = mopt.step()
        mc_clock.spans["optimizer"] += zero + time.perf_counter() - t1
        s, n = losses[0]["lm loss"].tolist()
        return s / n, grad_norm

    def ours_step():
        out = train_step(chunks, [batch], dims, optimizer, grad_sync, t.lr, ours_forward_step)
        return out["lm_loss"], out["grad_norm"]

    with torch.no_grad():  # same weights, same batch -> same loss, or the comparison is void
        ours0 = chunks[0].eval()(batch["tokens"], labels=batch["labels"]).mean().item()
        mc0 = mmodel.eval()(batch["tokens"], position_ids, causal, labels=batch["labels"]).mean().item()

    steps = {"ours": ours_step, "mcore": mc_step}
    clocks = {"ours": ours_clock, "mcore": mc_clock}
    res = {k: {"times": [], "phases": [], "losses": [], "grad_norms": []} for k in steps}
    comm_counts = None
    for i in range(args.warmup + args.repeats):
        counting = i == args.warmup - 1 or (args.warmup == 0 and i == 0)
        for name, fn in steps.items():  # interleaved: ours, Megatron-Core, ours, ...
            if name == "ours" and counting:
                dims.comm_counter = CountingCommCounter()
            dist.barrier()  # both ranks start each step together: no wait carried across steps
            t0 = time.perf_counter()
            loss, grad_norm = fn()
            dt = time.perf_counter() - t0
            phases = clocks[name].take()
            if name == "ours" and counting:
                comm_counts, dims.comm_counter = dims.comm_counter.take(), None
            r = res[name]
            r["losses"].append(loss)
            r["grad_norms"].append(grad_norm)
            if i >= args.warmup:
                r["times"].append(dt)
                r["phases"].append(phases)
    out = {"initial": (ours0, mc0), "res": res, "comm": comm_counts, "threads": torch.get_num_threads(),
           "params": cfg.num_parameters()}
    if args.profile:
        out["profile"] = {}
        for name, fn in steps.items():
            dist.barrier()
            out["profile"][name] = profile_steps(fn, args.profile, args.profile_top)
            clocks[name].take()
    parallel_state.destroy_model_parallel()
    return out


def _fmt_ms(x: float) -> str:
    return f"{x * 1e3:7.1f}"


def main_mcore(args) -> int:
    try:
        import megatron.core  # noqa: F401  (only to fail early and clearly)
    except ImportError:
        print(f"error: {MCORE_HINT}", file=sys.stderr)
        return 2
    from megatron_lite.testing import run_distributed

    seq = args.seq_length or 256
    load = os.getloadavg()
    print(f"megatron-lite vs Megatron-Core {megatron.core.__version__}: {args.family} "
          f"{MCORE_SHAPES[args.family]['num_layers']} layers x h {MCORE_SHAPES[args.family]['hidden_size']}, "
          f"vocab {MCORE_SHAPES[args.family]['vocab_size']}, batch {args.micro_batch_size} x {seq}, fp32; "
          f"ours attention {args.attention_backend}, Megatron-Core core attention {args.mcore_core_attention}; "
          f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    summary = []
    for tp in args.tp:
        before = os.getloadavg()[0]
        r = run_distributed(_mcore_worker, tp, args, timeout=3600)[0]
        after = os.getloadavg()[0]
        ours0, mc0 = r["initial"]
        rel = abs(ours0 - mc0) / abs(mc0)
        res = r["res"]
        print(f"\n== TP={tp} ({tp} rank{'s' if tp > 1 else ''} x {r['threads']} thread{'s' if r['threads'] > 1 else ''}, "
              f"{r['params']:,} parameters; 1-min load average {before:.2f} before, {after:.2f} after) ==")
        print(f"initial loss: ours {ours0:.6f}  Megatron-Core {mc0:.6f}  (relative diff {rel:.1e})")
        assert rel < 1e-5, "ours and Megatron-Core disagree on the initial loss: not the same model"
        for name in ("ours", "mcore"):
            print(f"losses ({name:>5}): " + " ".join(f"{x:.4f}" for x in res[name]["losses"]))
        print(f"first grad norm: ours {res['ours']['grad_norms'][0]:.6f}  "
              f"Megatron-Core {res['mcore']['grad_norms'][0]:.6f}")
        for v in res.values():  # the rest of a step: bookkeeping between the phases
            for dt, x in zip(v["times"], v["phases"]):
                x["other"] = dt - sum(x[p] for p in PHASES)
        med = {k: statistics.median(v["times"]) for k, v in res.items()}
        ph = {k: {p: statistics.median(x[p] for x in v["phases"]) for p in PHASES + ("other",)}
              for k, v in res.items()}
        print(f"{'':>14} {'ms/step':>8} {'min':>7} {'max':>7} | " + " ".join(f"{p:>9}" for p in PHASES) + "   other")
        for name, label in (("ours", "megatron-lite"), ("mcore", "Megatron-Core")):
            v = res[name]["times"]
            print(f"{label:>14} {_fmt_ms(med[name]):>8} {_fmt_ms(min(v))} {_fmt_ms(max(v))} | "
                  + " ".join(f"{_fmt_ms(ph[name][p]):>9}" for p in PHASES) + f" {_fmt_ms(ph[name]['other'])}")
        ratio = med["ours"] / med["mcore"]
        pairs = [a / b for a, b in zip(res["ours"]["times"], res["mcore"]["times"])]  # adjacent steps
        q = statistics.quantiles(pairs, n=4) if len(pairs) > 1 else pairs * 3
        print(f"ratio ours / Megatron-Core = {ratio:.3f}  (medians of {len(pairs)} interleaved steps; "
              f"per adjacent pair: median {statistics.median(pairs):.3f}, quartiles {q[0]:.3f} .. {q[2]:.3f})")
        if r["comm"] is not None:
            print("our collectives per step (CommCounter): " + (", ".join(
                f"{k} {c} calls {b / 2**20:.2f} MiB" for k, (c, b) in sorted(r["comm"].items())) or "none"))
        for name, label in (("ours", "megatron-lite"), ("mcore", "Megatron-Core")):
            pr = r.get("profile", {}).get(name)
            if pr is None:
                continue
            print(f"-- profile, {label}, rank 0, per step over {args.profile} steps "
                  f"(self CPU time of all ops {pr['self_total_ms']:.1f} ms) --")
            for key, calls, ms in pr["top"]:
                print(f"   {ms:8.2f} ms  {calls:6.1f} calls  {key}")
            for kind, numel, calls, ms in pr["collectives"]:
                print(f"   collective {kind:<14} {numel:>9,} elements ({numel * 4 / 2**20:6.3f} MiB fp32) "
                      f"x {calls:4.1f}/step  {ms:7.2f} ms/step enqueue->done")
            for k, (c, ms) in sorted(pr["enqueue"].items()):
                print(f"   {k:<26} x {c:4.1f}/step  {ms:6.2f} ms/step on the calling thread")
        summary.append((tp, med, ph, ratio, statistics.median(pairs)))
    print("\n| TP | ours ms/step | Megatron-Core ms/step | ours / MCore (medians; per pair) | "
          "ours fwd / bwd / sync / opt | MCore fwd / bwd / sync / opt |")
    print("|---|---|---|---|---|---|")
    for tp, med, ph, ratio, pair in summary:
        f = lambda k: " / ".join(f"{ph[k][p] * 1e3:.1f}" for p in PHASES)  # noqa: E731
        print(f"| {tp} | {med['ours'] * 1e3:.1f} | {med['mcore'] * 1e3:.1f} | {ratio:.3f}; {pair:.3f} | "
              f"{f('ours')} | {f('mcore')} |")
    end = os.getloadavg()
    print(f"load average at the end: {end[0]:.2f} {end[1]:.2f} {end[2]:.2f}")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--against", choices=["plain", "megatron-core"], default="plain",
                   help="the peer: plain PyTorch at TP=1, or Megatron-Core at each --tp")
    p.add_argument("--model", default="llama-20m", help="(plain) zoo model")
    p.add_argument("--family", choices=sorted(MCORE_SHAPES), default="llama",
                   help="(megatron-core) the model both frameworks build: 4 layers x h 256, vocab 8192")
    p.add_argument("--tp", type=int, nargs="+", default=[1, 2], help="(megatron-core) TP sizes, one world each")
    p.add_argument("--attention-backend", default="auto", help="(megatron-core) our core attention")
    p.add_argument("--mcore-core-attention", choices=["local", "sdpa"], default="local",
                   help="(megatron-core) theirs: DotProductAttention (the local spec's) or SDPA in its slot")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="(megatron-core) then profile N more steps of each side (torch.profiler, CPU)")
    p.add_argument("--profile-top", type=int, default=15, help="ops listed per profile")
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--seq-length", type=int, default=None, help="default: the zoo config's (plain), 256 (megatron-core)")
    p.add_argument("--threads", type=int, default=2, help="torch threads at TP=1 (one per rank at TP>1)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=8)
    args = p.parse_args(argv)
    return main_mcore(args) if args.against == "megatron-core" else main_plain(args)


def main_plain(args) -> int:
    torch.set_num_threads(args.threads)
    fields = zoo.get_model_config(args.model)
    zoo_seq = fields.pop("seq_length")
    seq = args.seq_length or zoo_seq
    cfg = ModelConfig(**dict(fields, attention_dropout=0.0, hidden_dropout=0.0))
    t = TrainingConfig(micro_batch_size=args.micro_batch_size, seq_length=seq, lr=3e-4, clip_grad=1.0)
    ours_model, plain, ours_step, popt = build_both(cfg, t)

    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, cfg.vocab_size, (args.micro_batch_size, seq + 1), generator=g)
    batch = {"tokens": data[:, :-1].contiguous(), "labels": data[:, 1:].contiguous(),
             "loss_mask": torch.ones(args.micro_batch_size, seq)}
    with torch.no_grad():  # same weights, same batch -> same loss, or the comparison is void
        ours0 = ours_model.eval()(batch["tokens"], labels=batch["labels"]).mean().item()
        plain0 = plain.eval()(batch["tokens"], batch["labels"]).item()
    rel = abs(ours0 - plain0) / abs(plain0)
    print(f"model {args.model}: {cfg.num_parameters():,} parameters, batch {args.micro_batch_size} x {seq} tokens, "
          f"{torch.get_num_threads()} threads, {platform.processor() or platform.machine()}")
    print(f"initial loss: ours {ours0:.6f}  plain {plain0:.6f}  (relative diff {rel:.1e})")
    assert rel < 1e-5, "ours and plain disagree on the initial loss: not the same model"

    steps: Dict[str, Callable[[], float]] = {"ours": lambda: ours_step(batch),
                                             "plain": lambda: plain_step(plain, popt, batch, t.clip_grad)}
    times: Dict[str, List[float]] = {"ours": [], "plain": []}
    losses: Dict[str, List[float]] = {"ours": [], "plain": []}
    for i in range(args.warmup + args.repeats):
        for name, fn in steps.items():  # interleaved: ours, plain, ours, plain, ...
            dt, loss = timed(fn)
            losses[name].append(loss)
            if i >= args.warmup:
                times[name].append(dt)
    print("losses (ours):  " + " ".join(f"{x:.4f}" for x in losses["ours"]))
    print("losses (plain): " + " ".join(f"{x:.4f}" for x in losses["plain"]))
    med = {k: statistics.median(v) for k, v in times.items()}
    for k, v in times.items():
        print(f"{k:>5}: median {med[k] * 1e3:8.1f} ms/step  (min {min(v) * 1e3:.1f}, max {max(v) * 1e3:.1f}, "
              f"n={len(v)})  {args.micro_batch_size * seq / med[k]:,.0f} tokens/s")
    ratio = med["ours"] / med["plain"]
    print(f"ratio ours / plain = {ratio:.3f}  (target <= 1.10: {'PASS' if ratio <= 1.10 else 'FAIL'})")
    return 0



if __name__ == "__main__":
    sys.exit(main())
