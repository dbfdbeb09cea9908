#!/usr/bin/env python
"""One MLA layer dense against the same layer with DeepSeek Sparse Attention as the sequence grows:
where does attending to a fixed top-k become cheaper than attending to every earlier key?

    python benchmarks/bench_dsa.py                            # seq 256..4096, top-k 256, fp32, CPU
    python benchmarks/bench_dsa.py --topk 128 --seqs 512 1024 2048

Both layers hold the same MLA weights (the DSA one adds its indexer). A step is forward + backward
of the layer's output (sum of squares) on random hidden states, batch 1; the dense layer runs MLA's
SDPA core over all keys (causal), the DSA layer its indexer (ReLU scores of every earlier key:
still quadratic, with indexer heads x indexer head dim per pair instead of heads x (d + dv)) and the
gathered-key core over the top-k (linear once k is fixed). `--indexer-loss` adds the KL loss (dense
over every earlier key: quadratic again). Runs alternate (dense, DSA, dense, ...) against machine
noise; medians of this process's CPU seconds.
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
from megatron_lite.transformer.core_attention import SDPAAttention  # noqa: E402
from megatron_lite.transformer.dsa import DSASelfAttention  # noqa: E402
from megatron_lite.transformer.mla import MLASelfAttention  # noqa: E402
from megatron_lite.transformer.rope import rope_cos_sin, rope_inv_freq  # noqa: E402
from megatron_lite.transformer.spec import BuildContext  # noqa: E402

CLOCK = time.process_time


def layers(args, seq: int):
    cfg = ModelConfig(hidden_size=args.hidden, num_attention_heads=args.heads, normalization="RMSNorm",
                      position_embedding_type="rope", add_bias_linear=False, attention_dropout=0.0,
                      max_position_embeddings=seq, multi_latent_attention=True, q_lora_rank=args.q_lora_rank,
                      kv_lora_rank=args.kv_lora_rank, qk_head_dim=args.head_dim, qk_pos_emb_head_dim=args.head_dim // 2,
                      v_head_dim=args.head_dim, experimental_attention_variant="dsa",
                      dsa_indexer_n_heads=args.indexer_heads, dsa_indexer_head_dim=args.indexer_head_dim,
                      dsa_indexer_topk=args.topk, dsa_indexer_loss_coeff=1.0 if args.indexer_loss else 0.0)
    torch.manual_seed(0)
    dsa = DSASelfAttention(cfg, BuildContext(), 0, core_attention=SDPAAttention)
    with torch.no_grad():
        for p in dsa.parameters():
            p.normal_(0, 0.05)
    dense = MLASelfAttention(cfg, BuildContext(), 0, core_attention=SDPAAttention)
    dense.load_state_dict({k: v for k, v in dsa.state_dict().items() if not k.startswith("indexer.")})
    rope = rope_cos_sin(torch.arange(seq)[None], rope_inv_freq(cfg), torch.float32)
    return {"dense": dense.train(), "dsa": dsa.train()}, rope


def step_seconds(layer, x, rope) -> float:
    start = CLOCK()
    layer(x, rope).square().sum().backward()
    layer.zero_grad(set_to_none=True)
    return CLOCK() - start


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seqs", type=int, nargs="+", default=[256, 512, 1024, 2048, 4096])
    p.add_argument("--topk", type=int, default=256)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--q-lora-rank", type=int, default=192)
    p.add_argument("--kv-lora-rank", type=int, default=128)
    p.add_argument("--indexer-heads", type=int, default=4)
    p.add_argument("--indexer-head-dim", type=int, default=64)
    p.add_argument("--indexer-loss", action="store_true")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"# {platform.processor() or platform.machine()}, torch {torch.__version__}, {args.threads} threads; "
          f"h {args.hidden}, {args.heads} heads x {args.head_dim} (+{args.head_dim // 2} rope), q latent "
          f"{args.q_lora_rank}, kv latent {args.kv_lora_rank}; indexer {args.indexer_heads} x "
          f"{args.indexer_head_dim}, top-k {args.topk}; indexer loss {'on' if args.indexer_loss else 'off'}")
    print("| seq | dense ms | DSA ms | DSA / dense |")
    print("|---|---|---|---|")
    for seq in args.seqs:
        mods, rope = layers(args, seq)
        x = torch.randn(seq, 1, args.hidden)
        times = {name: [] for name in mods}
        for name, layer in mods.items():
            step_seconds(layer, x, rope)  # warm-up
        for _ in range(args.repeats):
            for name, layer in mods.items():
                times[name].append(step_seconds(layer, x, rope))
        dense, dsa = (statistics.median(times[n]) * 1e3 for n in ("dense", "dsa"))
        print(f"| {seq} | {dense:.1f} | {dsa:.1f} | {dsa / dense:.2f} |", flush=True)


if __name__ == "__main__":
    main()
