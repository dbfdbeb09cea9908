#!/usr/bin/env python
"""Training-step time: megatron-lite at TP=1 against plain single-file PyTorch, same run.

    python benchmarks/bench_step.py [--model llama-20m] [--micro-batch-size 4] [--repeats 8]

The plain reference below is the same Llama architecture written the ordinary way (nn.Linear,
F.scaled_dot_product_attention, RMSNorm, RoPE, SwiGLU, GQA, torch.optim.AdamW, grad clipping).
Before timing, our initial weights are copied into it and both must give the same loss on the
same batch, so the two sides compute the same thing. Steps are interleaved (ours, plain, ours,
plain, ...) so that machine noise hits both alike; we report medians and ours / plain.
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from typing import Callable, Dict, List

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir)))

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from megatron_lite.config import ModelConfig, ParallelConfig, TrainingConfig  # noqa: E402
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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama-20m")
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--seq-length", type=int, default=None, help="default: the zoo config's")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=8)
    args = p.parse_args(argv)
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
