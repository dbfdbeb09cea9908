#!/usr/bin/env python
"""Context-parallel attention on CPU: step time, per-rank peak memory, and bytes against theory.

    python benchmarks/bench_context_parallel.py [--seqs 4096 8192 16384] [--heads 4] [--kv-heads 1]
                                                [--head-dim 64] [--repeats 3] [--layouts 1:sdpa 2:p2p ...]

For each sequence length, the core attention of one layer (causal, fp32, batch 1) runs forward
and backward on fresh forked gloo worlds: CP=1 (PyTorch SDPA on the whole sequence, the CPU
flash kernel) and CP 2 / 4 with each comm type (p2p ring, a2a Ulysses, all_gather; a2a+p2p at
CP 4 as 2 x 2). Reported per configuration, the slowest rank:
- time: median of `--repeats` forward+backward passes after one warm-up;
- peak: the process's peak resident memory above its level before the first pass (ru_maxrss;
  what the attention's activations, temporaries and communication buffers cost a rank);
- bytes: what this rank's collectives moved per pass (megatron-lite's comm counter), beside theory:
  ring forward (cp-1) x local K/V bytes, backward (cp-1) x K/V + cp x dK/dV (fp32: the same);
  Ulysses 4 all-to-alls (q+k+v packed in one, then out; their backward the same again) of which
  (cp-1)/cp of each buffer leaves the rank (the counter counts the whole buffer);
  all_gather: the gathered K/V, and in backward their reduce-scatter.
The all-gather of every rank's token indices (8 bytes per token) is counted with the all-gathers.
"""
from __future__ import annotations

import argparse
import os
import platform
import resource
import statistics
import sys
import time

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir)))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from megatron_lite.parallel import comm  # noqa: E402
from megatron_lite.parallel.context_parallel import cp_attention, zigzag_indices  # noqa: E402
from megatron_lite.parallel.state import ParallelDims  # noqa: E402
from megatron_lite.testing import run_distributed  # noqa: E402


def _inputs(seq, heads, kv_heads, dim, cp, rank):
    gen = torch.Generator().manual_seed(rank)
    s = seq // cp
    q = torch.randn(1, s, heads, dim, generator=gen, requires_grad=True)
    k = torch.randn(1, s, kv_heads, dim, generator=gen, requires_grad=True)
    v = torch.randn(1, s, kv_heads, dim, generator=gen, requires_grad=True)
    return q, k, v


def worker(rank, world, seq, heads, kv_heads, dim, comm_type, repeats, threads=None):
    torch.set_num_threads(threads or max(1, 2 // world))
    q, k, v = _inputs(seq, heads, kv_heads, dim, world, rank)
    if world == 1:
        def step(counter):
            out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                 is_causal=True, enable_gqa=heads != kv_heads).transpose(1, 2)
            out.sum().backward()
    else:
        dims = ParallelDims.from_world(cp=world, cp_a2a=2 if comm_type == "a2a+p2p" else 0)
        groups = (dict(a2a_group=dims.group("cp_a2a"), p2p_group=dims.group("cp_p2p")) if comm_type == "a2a+p2p"
                  else dict(cp_group=dims.cp_group))
        index = zigzag_indices(seq, world, rank)

        def step(counter):
            out = cp_attention(q, k, v, comm_type=comm_type, q_index=index, comm=comm.Communicator(counter), **groups)
            out.sum().backward()
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    step(None)  # warm-up (and the peak of a pass)
    peak = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) * 1024
    times, counter = [], comm.CommCounter()
    for _ in range(repeats):
        counter.reset()
        start = time.perf_counter()
        step(counter)
        times.append(time.perf_counter() - start)
    return {"time": statistics.median(times), "peak": peak, "bytes": counter.reset()}


def theory(comm_type, seq, heads, kv_heads, dim, cp):
    """Bytes this rank's collectives move per forward+backward (as the counter counts them)."""
    s, elt = seq // cp, 4
    kv = 2 * s * kv_heads * dim * elt
    index = cp * s * 8  # the all-gather of every rank's token indices
    if comm_type == "p2p":
        return {"p2p": (cp - 1) * kv + (cp - 1) * kv + cp * kv, "all_gather": index}
    if comm_type == "all_gather":
        return {"all_gather": cp * kv + index, "reduce_scatter": cp * kv}
    if comm_type == "a2a":
        rep = cp if kv_heads < cp else kv_heads  # K/V heads replicated up to the group size
        qkv, out = s * (heads + 2 * rep) * dim * elt, s * heads * dim * elt
        return {"all_to_all": 2 * (qkv + out), "all_gather": index}
    return {}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seqs", type=int, nargs="+", default=[4096, 8192, 16384])
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=1)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--layouts", nargs="+", default=None, metavar="CP:TYPE",
                    help="run only these layouts, e.g. 1:sdpa 2:p2p 4:a2a+p2p (default: all; the materialised "
                         "scores of Ulysses / all-gather at long sequences may not fit a small box)")
    ap.add_argument("--sdpa-threads", type=int, default=None,
                    help="torch threads of the CP=1 run (default 2; on a loaded 2-core box 2 threads spin-wait)")
    args = ap.parse_args()
    load = os.getloadavg()[0]
    print(f"machine: {platform.machine()} {os.cpu_count()} cores, torch {torch.__version__}, load {load:.1f}; "
          f"heads {args.heads}, K/V heads {args.kv_heads}, head dim {args.head_dim}, batch 1, fp32, causal")
    print("\n| seq | layout | time fwd+bwd (s) | peak RSS / rank (MiB) | bytes / rank (MiB) | theory (MiB) |")
    print("|---|---|---|---|---|---|")
    configs = [(1, "sdpa")] + [(cp, ct) for ct in ("p2p", "a2a", "all_gather") for cp in (2, 4)] + [(4, "a2a+p2p")]
    if args.layouts:
        configs = [(cp, ct) for cp, ct in configs if f"{cp}:{ct}" in args.layouts]
    for seq in args.seqs:
        for cp, ct in configs:
            res = run_distributed(worker, cp, seq, args.heads, args.kv_heads, args.head_dim, ct, args.repeats,
                                  args.sdpa_threads if cp == 1 else None, timeout=1200)
            slowest = max(res, key=lambda r: r["time"])
            moved = {k: v for k, v in slowest["bytes"].items()}
            shown = ", ".join(f"{k} {v / 2**20:.1f}" for k, v in sorted(moved.items())) or "-"
            th = theory(ct, seq, args.heads, args.kv_heads, args.head_dim, cp) if cp > 1 else {}
            th_shown = ", ".join(f"{k} {v / 2**20:.1f}" for k, v in sorted(th.items())) or "-"
            layout = "CP=1 (SDPA)" if cp == 1 else f"CP={cp} {ct}"
            print(f"| {seq} | {layout} | {slowest['time']:.3f} | {max(r['peak'] for r in res) / 2**20:.0f} | "
                  f"{shown} | {th_shown} |", flush=True)


if __name__ == "__main__":
    main()
