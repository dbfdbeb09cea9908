#!/usr/bin/env python
"""Multi-latent attention against standard (multi-head) attention at about the same parameter
count: training step time, decode step time and the KV cache per token, side by side in one run.

    python benchmarks/bench_mla.py                     # 4 layers, h 512, 8 heads, seq 512, fp32, CPU
    python benchmarks/bench_mla.py --seq-length 1024 --kv-lora-rank 128

Both models have the same embedding, MLP and layer count; their attention blocks hold about the
same weights (MLA: full Q projection, a kv_lora_rank latent and a 32-channel RoPE key shared by the
heads, up-projected to 64-channel keys and values per head; standard: 64-channel heads). A training
step is forward + backward of the loss on random tokens (no optimizer); a decode step feeds one
token after a `--prompt`-token prefill with the KV cache (MLA: the latent cache with the absorbed
up-projections). Runs alternate (standard, MLA, standard, ...) against machine noise; medians.
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir)))

import torch  # noqa: E402

from megatron_lite.config import ModelConfig  # noqa: E402
from megatron_lite.inference import DecodingSession, kv_cache_bytes_per_token  # noqa: E402
from megatron_lite.parallel.state import ParallelDims  # noqa: E402
from models.gpt import build_model  # noqa: E402


# This process's CPU seconds: on a shared machine (other jobs on the same cores) wall time measures
# them too; with --threads 1 CPU time is the compute itself. --wall: wall-clock time instead.
CLOCK = time.process_time


def configs(args):
    common = dict(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads, vocab_size=4096,
                  normalization="RMSNorm", position_embedding_type="rope", swiglu=True, add_bias_linear=False,
                  untie_embeddings_and_output_weights=True, attention_dropout=0.0, hidden_dropout=0.0,
                  max_position_embeddings=args.seq_length)
    mla = dict(common, multi_latent_attention=True, q_lora_rank=None, kv_lora_rank=args.kv_lora_rank,
               qk_head_dim=args.head_dim, qk_pos_emb_head_dim=args.head_dim // 2, v_head_dim=args.head_dim)
    return {"standard": ModelConfig(**common, kv_channels=args.head_dim), "mla": ModelConfig(**mla)}


def train_step_seconds(model, tokens) -> float:
    start = CLOCK()
    loss = model(tokens[:, :-1], labels=tokens[:, 1:]).mean()
    loss.backward()
    model.zero_grad(set_to_none=True)
    return CLOCK() - start


@torch.no_grad()
def decode_step_seconds(model, prompt, steps: int) -> float:
    session = DecodingSession(model, prompt.tolist(), steps + 1)
    logits = session.prefill()
    start = CLOCK()
    for _ in range(steps):
        logits = session.step(logits.argmax(-1))
    return (CLOCK() - start) / steps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--kv-lora-rank", type=int, default=256)
    p.add_argument("--seq-length", type=int, default=512)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--prompt", type=int, default=256, help="prefill tokens before the timed decode steps")
    p.add_argument("--decode-steps", type=int, default=16)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--wall", action="store_true", help="wall-clock time instead of this process's CPU time")
    args = p.parse_args()
    global CLOCK
    if args.wall:
        CLOCK = time.perf_counter
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cfgs = configs(args)
    models = {k: build_model(c, ParallelDims(), seed=1)[0] for k, c in cfgs.items()}
    tokens = torch.randint(0, 4096, (args.batch, args.seq_length + 1))
    prompt = torch.randint(0, 4096, (args.batch, args.prompt))
    times = {k: {"train": [], "decode": []} for k in models}
    for k, m in models.items():  # warm-up
        train_step_seconds(m.train(), tokens)
    for _ in range(args.repeats):
        for k, m in models.items():
            times[k]["train"].append(train_step_seconds(m.train(), tokens))
            times[k]["decode"].append(decode_step_seconds(m.eval(), prompt, args.decode_steps))
    print(f"# {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}"
          f"; {args.layers} layers, h {args.hidden}, {args.heads} heads, seq {args.seq_length}, batch {args.batch}, "
          f"fp32; {'wall' if args.wall else 'CPU'} time, medians of {args.repeats}")
    print("| attention | attention params / layer | model params | train step (ms) | decode step (ms) "
          "| KV cache bytes / token |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for k, m in models.items():
        layer = sum(p.numel() for n, p in m.named_parameters() if n.startswith("layers.0.self_attention."))
        print(f"| {k} | {layer:,} | {sum(p.numel() for p in m.parameters()):,} "
              f"| {1e3 * statistics.median(times[k]['train']):.1f} | {1e3 * statistics.median(times[k]['decode']):.2f} "
              f"| {kv_cache_bytes_per_token(m):,} |")


if __name__ == "__main__":
    main()
