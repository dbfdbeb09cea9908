#!/usr/bin/env python
"""Decode throughput: ours with the KV cache, ours recomputing the whole sequence every step, and
Hugging Face `generate` on the same weights, side by side in one run.

    python benchmarks/bench_generate.py                       # llama-20m, fp32, on the CPU
    python benchmarks/bench_generate.py --skip-cpu            # on a GPU machine: the 1B-class model only

Every side decodes greedily from the same random prompt (random weights: no download) and must
produce the same tokens as ours with the cache, so that all compute the same thing. Runs are
interleaved (ours, no cache, HF, ours, ...) against machine noise; medians are reported. Where
CUDA is available, a Llama-3.2-1B-shaped model is also measured in bf16 (unless --no-gpu).
Throughput is new tokens per second over the whole call (prefill included: it is what a caller
waits for); "decode" excludes our prefill (timed apart), i.e. the steps that feed one token each.
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

from megatron_lite.config import ModelConfig  # noqa: E402
from megatron_lite.inference import DecodingSession, generate, inference_context  # noqa: E402
from megatron_lite.parallel.state import ParallelDims  # noqa: E402
from models import zoo  # noqa: E402
from models.gpt import build_model  # noqa: E402
from models.hf_conversion import gather_full_state_dict, megatron_lite_to_hf, model_config_to_hf_config  # noqa: E402

OURS = "ours (KV cache)"
# Llama-3.2-1B's shape (its llama3 RoPE scaling changes no cost and is left out here).
LLAMA_1B = dict(num_layers=16, hidden_size=2048, num_attention_heads=32, num_query_groups=8, kv_channels=64,
                ffn_hidden_size=8192, vocab_size=128256, max_position_embeddings=131072, normalization="RMSNorm",
                position_embedding_type="rope", rotary_base=500000.0, swiglu=True, add_bias_linear=False,
                untie_embeddings_and_output_weights=False, attention_dropout=0.0, hidden_dropout=0.0)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def ours_cached(model, prompts: torch.Tensor, n: int) -> torch.Tensor:
    """`generate` itself: the tools' path, per-step host sync for the stopping test included."""
    completions = generate(model, prompts.tolist(), n)
    return torch.tensor([c.tokens for c in completions], device=prompts.device)


@torch.no_grad()
def prefill_seconds(model, prompts: torch.Tensor, n: int) -> float:
    start = time.perf_counter()
    DecodingSession(model, prompts.tolist(), n).prefill()
    _sync(prompts.device)
    return time.perf_counter() - start


@torch.no_grad()
def ours_uncached(model, prompts: torch.Tensor, n: int):
    seq = prompts
    for _ in range(n):
        tokens = model(seq)[:, -1].argmax(-1)
        seq = torch.cat([seq, tokens[:, None]], 1)
    return seq[:, prompts.shape[1]:]


@torch.no_grad()
def hf_generate(hf, prompts: torch.Tensor, n: int):
    out = hf.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=n, min_new_tokens=n,
                      do_sample=False, pad_token_id=0)
    return out[:, prompts.shape[1]:]


def build_pair(cfg: ModelConfig, device: torch.device, dtype: torch.dtype, with_hf: bool):
    """Our model (random, layout-independent init) and, if asked, HF's LlamaForCausalLM with the
    same weights."""
    dims = ParallelDims().build_groups()
    model = build_model(cfg, inference_context(cfg, dims, dtype, device), seed=1)[0].eval()
    if not with_hf:
        return model, None
    import transformers

    hf_cfg = model_config_to_hf_config(cfg, "llama")
    hf = transformers.LlamaForCausalLM(hf_cfg).to(dtype).eval()
    state = megatron_lite_to_hf(gather_full_state_dict(model, dims), cfg, "llama")
    hf.load_state_dict(state, strict=True)
    return model, hf.to(device)


def run_side_by_side(sides: Dict[str, Callable], prefill: Callable, prompts, n: int, repeats: int,
                     device) -> Dict[str, dict]:
    reference = None
    times: Dict[str, List[float]] = {k: [] for k in sides}
    prefills: List[float] = []
    for i in range(repeats + 1):  # the first round warms up
        for name, fn in sides.items():
            _sync(device)
            start = time.perf_counter()
            tokens = fn(prompts, n)
            _sync(device)
            dt = time.perf_counter() - start
            if reference is None:
                reference = tokens
            if not torch.equal(tokens, reference):
                print(f"warning: {name} generated other tokens than ours with the cache "
                      f"({(tokens != reference).float().mean().item():.0%} differ)")
            if i > 0:
                times[name].append(dt)
        if i > 0:
            prefills.append(prefill(prompts, n))
    b = prompts.shape[0]
    out = {name: {"seconds": statistics.median(ts), "tokens_per_s": b * n / statistics.median(ts)}
           for name, ts in times.items()}
    cached, pre = out[OURS], statistics.median(prefills)
    cached["prefill_s"] = pre
    cached["decode_tokens_per_s"] = b * (n - 1) / (cached["seconds"] - pre)
    return out


def report(title: str, results: Dict[str, dict]) -> None:
    print(f"\n{title}")
    print(f"| side | s per call | new tokens/s | vs {OURS} |")
    print("|---|---|---|---|")
    base = results[OURS]["tokens_per_s"]
    for name, r in results.items():
        print(f"| {name} | {r['seconds']:.3f} | {r['tokens_per_s']:.1f} | {r['tokens_per_s'] / base:.2f}x |")
    c = results[OURS]
    print(f"{OURS}: prefill {c['prefill_s'] * 1e3:.1f} ms, then decode {c['decode_tokens_per_s']:.1f} tokens/s")


def bench(cfg: ModelConfig, device, dtype, args, title: str) -> None:
    with_hf = not args.no_hf
    model, hf = build_pair(cfg, device, dtype, with_hf)
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, cfg.vocab_size, (args.batch_size, args.prompt_length), generator=g).to(device)
    sides = {OURS: lambda p, n: ours_cached(model, p, n)}
    if not args.no_uncached:
        sides["ours (no cache: full recomputation)"] = lambda p, n: ours_uncached(model, p, n)
    if with_hf:
        sides["HF generate (its KV cache)"] = lambda p, n: hf_generate(hf, p, n)
    results = run_side_by_side(sides, lambda p, n: prefill_seconds(model, p, n), prompts, args.new_tokens,
                               args.repeats, device)
    report(f"{title}: {cfg.num_parameters() / 1e6:.1f}M parameters, {str(dtype).replace('torch.', '')}, "
           f"batch {args.batch_size}, prompt {args.prompt_length} + {args.new_tokens} new tokens, {device}", results)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama-20m", help="the CPU model (models/zoo.py)")
    p.add_argument("--prompt-length", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--no-hf", action="store_true", help="skip Hugging Face generate")
    p.add_argument("--no-uncached", action="store_true", help="skip the recomputing side")
    p.add_argument("--no-gpu", action="store_true", help="skip the 1B-class model in bf16 on CUDA")
    p.add_argument("--skip-cpu", action="store_true", help="skip the CPU model (e.g. on a GPU machine)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
          f"{torch.get_num_threads()} threads, load average {os.getloadavg()[0]:.2f}")
    if not args.skip_cpu:
        fields = zoo.get_model_config(args.model)
        fields.pop("seq_length", None)
        cfg = ModelConfig(**dict(fields, attention_dropout=0.0, hidden_dropout=0.0))
        bench(cfg, torch.device("cpu"), torch.float32, args, f"{args.model} on the CPU")
    if args.no_gpu:
        return 0
    if not torch.cuda.is_available():
        print("\nno CUDA device: the 1B-class bf16 comparison is skipped")
        return 0
    print(f"\nGPU: {torch.cuda.get_device_name()}")
    bench(ModelConfig(**LLAMA_1B), torch.device("cuda"), torch.bfloat16, args, "Llama-3.2-1B shape on CUDA")
    return 0


if __name__ == "__main__":
    sys.exit(main())
