#!/usr/bin/env python
"""ZeRO stages 0-3 at DP=N on CPU: per-rank memory, communication and step time, theory beside
measurement; and step time against PyTorch's own DDP, ZeroRedundancyOptimizer and FSDP2.

    python benchmarks/bench_zero.py [--model llama-20m] [--dp 4] [--steps 4] [--seq-length 256]

Every configuration runs in a fresh world of forked gloo ranks (so peak RSS is its own), on the
same global batches. Memory "held" is what `optimizer.memory_bytes()` reports (parameters,
gradients, optimizer state kept across steps); theory is Adam's 2 + 4 + 12 bytes per parameter
(bf16 params, fp32 grads, fp32 main params + m + v), sharded from stage 1, 2, 3 on. "Peak RSS" is
the rank's peak resident memory during the steps minus its resident memory before building the
model: everything, including activations, the transient full gradient buckets of stages 2-3, the
gathered layers of stage 3, and gloo's internal copies (on CPU a reduce-scatter of B bytes
transiently allocates about 1.6 B, an all-gather about 2 B of its output; NCCL works in place).
"Between steps" is resident memory after the last step (freed heap returned to the OS first). Communication is bytes of full logical buffers per step and
rank (a `comm.CommCounter` in `dims.comm_counter`). The torch peers train the plain Llama of bench_step.py, loaded with
our initial weights (their first loss must equal ours), in fp32 beside our fp32 runs.
"""
from __future__ import annotations

import argparse
import ctypes
import gc
import os
import platform
import re
import statistics
import sys
import time

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from megatron_lite.config import ModelConfig, ParallelConfig, TrainingConfig  # noqa: E402
from megatron_lite.optim.optimizer import build_optimizer  # noqa: E402
from megatron_lite.parallel import comm  # noqa: E402
from megatron_lite.parallel.state import ParallelDims  # noqa: E402
from megatron_lite.testing import run_distributed  # noqa: E402
from megatron_lite.training.step import train_step  # noqa: E402
from models import zoo  # noqa: E402
from models.gpt import build_model, gpt_forward_step  # noqa: E402

MB = 2 ** 20


def rss_bytes() -> int:
    """Resident bytes now, after handing freed heap memory back to the OS (so it measures live data)."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def reset_peak_rss() -> None:
    with open("/proc/self/clear_refs", "w") as f:  # Linux: "5" resets the VmHWM high-water mark
        f.write("5")


def peak_rss_bytes() -> int:
    with open("/proc/self/status") as f:
        return int(re.search(r"VmHWM:\s+(\d+) kB", f.read()).group(1)) * 1024


def model_config(args) -> ModelConfig:
    fields = zoo.get_model_config(args.model)
    fields.pop("seq_length")
    return ModelConfig(**fields)


def global_batch(step: int, args, vocab: int, world: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, vocab, (world * args.micro_batches, args.seq_length + 1), generator=gen)


def rank_batches(step, args, vocab, world, rank):
    tokens = global_batch(step, args, vocab, world)[rank * args.micro_batches:(rank + 1) * args.micro_batches]
    return [{"tokens": t[None, :-1], "labels": t[None, 1:], "loss_mask": torch.ones(1, args.seq_length)}
            for t in tokens]


# --- ours --------------------------------------------------------------------------------------
def run_ours(rank, world, stage, dtype, args):
    base = rss_bytes()
    cfg = model_config(args)
    dims = ParallelDims.from_world()
    chunks = build_model(cfg, dims, seed=1, params_dtype=dtype)
    psi = sum(p.numel() for p in chunks[0].parameters())
    tcfg = TrainingConfig(lr=1e-4, bf16=dtype == torch.bfloat16)
    pcfg = ParallelConfig(zero_stage=stage, overlap_grad_reduce=True, ddp_bucket_size=args.bucket_size)
    optimizer, sync = build_optimizer(chunks, dims, tcfg, pcfg)
    held = optimizer.memory_bytes()
    reset_peak_rss()
    times, losses, comm_bytes = [], [], None
    for step in range(args.warmup + args.steps):
        batches = rank_batches(step, args, cfg.vocab_size, world, rank)
        dims.comm_counter = comm.CommCounter()
        start = time.perf_counter()
        losses.append(train_step(chunks, batches, dims, optimizer, sync, tcfg.lr, gpt_forward_step)["lm_loss"])
        times.append(time.perf_counter() - start)
        comm_bytes = dims.comm_counter.reset()
    peak = peak_rss_bytes() - base
    return dict(psi=psi, held=held, comm=comm_bytes, step_s=statistics.median(times[args.warmup:]),
                first_loss=losses[0], steady=rss_bytes() - base, peak=peak)


# --- torch peers --------------------------------------------------------------------------------
def peer_adamw(params, tcfg: TrainingConfig, **kw):
    """bench_step.plain_optimizer's AdamW, but fused as ours is (unfused AdamW on CPU makes
    whole-tensor temporaries each step, which would time the allocator rather than ZeRO)."""
    params = list(params)
    groups = [{"params": [p for p in params if p.dim() > 1], "weight_decay": tcfg.weight_decay},
              {"params": [p for p in params if p.dim() <= 1], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=tcfg.lr, betas=(tcfg.adam_beta1, tcfg.adam_beta2), eps=tcfg.adam_eps,
                             fused=True, **kw)


def run_peer(rank, world, kind, args):
    from bench_step import PlainLlama
    from models.hf_conversion import gather_full_state_dict, megatron_lite_to_hf
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.optim import ZeroRedundancyOptimizer

    base = rss_bytes()
    cfg = model_config(args)
    plain = PlainLlama(cfg)
    ours = build_model(cfg, ParallelDims(dp=world, rank=rank), seed=1)[0]  # our init, any layout
    plain.load_state_dict(megatron_lite_to_hf(gather_full_state_dict(ours, ParallelDims()), cfg, "llama"))
    del ours
    tcfg = TrainingConfig(lr=1e-4)
    if kind.startswith("FSDP2"):
        mesh = init_device_mesh("cpu", (world,))
        for layer in plain.model.layers:
            fully_shard(layer, mesh=mesh, reshard_after_forward=kind.endswith("(ZeRO-3)"))
        model = fully_shard(plain, mesh=mesh)
        opt = peer_adamw(model.parameters(), tcfg)
    else:
        model = torch.nn.parallel.DistributedDataParallel(plain)
        if kind == "DDP":
            opt = peer_adamw(plain.parameters(), tcfg)
        else:  # DDP + ZeroRedundancyOptimizer: ZeRO-1 (one param group: it shards whole tensors)
            opt = ZeroRedundancyOptimizer(plain.parameters(), optimizer_class=torch.optim.AdamW, lr=tcfg.lr,
                                          weight_decay=tcfg.weight_decay, fused=True)
    reset_peak_rss()
    times, losses = [], []
    for step in range(args.warmup + args.steps):
        (batch,) = rank_batches(step, args, cfg.vocab_size, world, rank)  # one micro-batch per rank
        start = time.perf_counter()
        loss = model(batch["tokens"], batch["labels"])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), tcfg.clip_grad)
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
        loss = loss.detach().clone()
        dist.all_reduce(loss)
        losses.append(loss.item() / world)
    peak = peak_rss_bytes() - base
    return dict(step_s=statistics.median(times[args.warmup:]), first_loss=losses[0], steady=rss_bytes() - base,
                peak=peak)


# --- tables ------------------------------------------------------------------------------------
def theory(stage: int, psi: int, n: int, micro_batches: int):
    mem = {"param_bytes": 2 * psi / (n if stage >= 3 else 1), "grad_bytes": 4 * psi / (n if stage >= 2 else 1),
           "optimizer_state_bytes": 12 * psi / (n if stage >= 1 else 1)}
    comm_bytes = {0: 4 * psi, 1: 6 * psi, 2: 6 * psi, 3: 4 * psi + 2 * micro_batches * 2 * psi}[stage]
    return mem, comm_bytes


def memory_table(results, args) -> None:
    print(f"\nbf16 params, fp32 grads and main params, AdamW; DP={args.dp}; --overlap-grad-reduce, buckets of "
          f"{args.bucket_size / 1e6:g}M elements; MB per rank (measured / theory)")
    print("| stage | params | grads | optimizer state | total held | RSS between steps | RSS peak in step "
          "| comm MB/step | step ms |")
    print("|---|---|---|---|---|---|---|---|---|")
    for stage, r in results.items():
        mem, comm_theory = theory(stage, r["psi"], args.dp, args.micro_batches)
        cells = [f"{r['held'][k] / MB:.1f} / {mem[k] / MB:.1f}" for k in mem]
        total = sum(r["held"].values())
        cells.append(f"{total / MB:.1f} / {sum(mem.values()) / MB:.1f}")
        sent = sum(r["comm"].values())
        print(f"| {stage} | " + " | ".join(cells) + f" | {r['steady'] / MB:.0f} | {r['peak'] / MB:.0f} | "
              f"{sent / MB:.1f} / {comm_theory / MB:.1f} | {r['step_s'] * 1000:.0f} |")


def peer_table(ours, peers, args) -> None:
    print(f"\nfp32, DP={args.dp}: step time against PyTorch (first-step losses must agree)")
    print("| ours | ms/step | RSS MB between / peak | torch peer | ms/step | RSS MB between / peak | ours / peer "
          "time | first loss ours, peer |")
    print("|---|---|---|---|---|---|---|---|")
    for stage, kind in PEERS.items():
        o, p = ours[stage], peers[kind]
        print(f"| ZeRO-{stage} | {o['step_s'] * 1000:.0f} | {o['steady'] / MB:.0f} / {o['peak'] / MB:.0f} | {kind} | "
              f"{p['step_s'] * 1000:.0f} | {p['steady'] / MB:.0f} / {p['peak'] / MB:.0f} | "
              f"{o['step_s'] / p['step_s']:.2f} | {o['first_loss']:.6f}, {p['first_loss']:.6f} |")


PEERS = {0: "DDP", 1: "DDP + ZeroRedundancyOptimizer", 2: "FSDP2 reshard_after_forward=False",
         3: "FSDP2 (ZeRO-3)"}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama-20m")
    p.add_argument("--dp", type=int, default=4)
    p.add_argument("--seq-length", type=int, default=256)
    p.add_argument("--micro-batches", type=int, default=1, help="per rank and step (micro-batch size 1)")
    p.add_argument("--bucket-size", type=int, default=3_000_000, help="elements (~ one llama-20m layer)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--no-peers", action="store_true")
    args = p.parse_args(argv)
    cfg = model_config(args)
    print(f"{args.model}: {cfg.num_parameters() / 1e6:.1f}M parameters, seq {args.seq_length}, DP={args.dp}, "
          f"{args.micro_batches} micro-batch(es) of 1 per rank; {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} cores, torch {torch.__version__}")
    bf16 = {s: run_distributed(run_ours, args.dp, s, torch.bfloat16, args)[0] for s in range(4)}
    memory_table(bf16, args)
    if not args.no_peers:
        fp32 = {s: run_distributed(run_ours, args.dp, s, torch.float32, args)[0] for s in range(4)}
        peers = {k: run_distributed(run_peer, args.dp, k, args)[0] for k in PEERS.values()}
        peer_table(fp32, peers, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
