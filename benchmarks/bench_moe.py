#!/usr/bin/env python
"""Mixture of experts on CPU: the MoE layer and a whole 8-expert top-2 model.

    python benchmarks/bench_moe.py [--part layer|model|all] [--tokens 2048] [--hidden 256]
                                   [--ffn 512] [--repeats 5] [--iters 8]

Part `layer`: one MoE layer (8 experts, top-2, SwiGLU experts of --ffn, fp32) forward + backward
on fresh forked gloo worlds (one torch thread per rank), `--tokens` tokens per rank: EP 1 with the per-expert loop and with
grouped GEMM (torch._grouped_mm), then EP 2 and 4 with each dispatcher (grouped GEMM on). Per
configuration, the slowest rank's median over --repeats passes after a warm-up, and the bytes its
collectives moved per pass (megatron-lite's comm counter, which counts each collective's whole
input buffer) beside theory: alltoall sends tokens x k x hidden x 4 bytes in each of its four
exchanges (dispatch and combine, forward and backward), of which (EP-1)/EP leaves the rank,
plus E int64 counts; allgather gathers the whole EP group's tokens (hidden), probabilities and
routing map (E each) and reduce-scatters the output (and in backward the reverse).

Part `model`: `pretrain_gpt.py` under torchrun (a 4-layer, hidden-256 model, every layer MoE with
8 experts top-2, seq 256, global batch 8, --device cpu, one thread per rank), median `step_time_s` of the iterations
after the first two from the metrics file: EP 1 loop vs grouped GEMM on 1 rank, and EP 2 / EP 4
alltoall vs allgather (EP x DP ranks, grouped GEMM).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir)))

import torch  # noqa: E402

from megatron_lite.parallel.comm import CommCounter  # noqa: E402
from megatron_lite.parallel.state import ParallelDims  # noqa: E402
from megatron_lite.testing import run_distributed  # noqa: E402
from megatron_lite.transformer.moe import MoEConfig, MoELayer  # noqa: E402

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir))
EXPERTS, TOPK = 8, 2


# --- the layer --------------------------------------------------------------------------------
def layer_worker(rank, world, dispatcher, grouped, tokens, hidden, ffn, repeats):
    torch.set_num_threads(1)  # one thread per rank: 2 threads on a shared 2-core box spin-wait badly
    dims = ParallelDims.from_world(ep=world)
    cfg = MoEConfig(num_experts=EXPERTS, moe_router_topk=TOPK, moe_ffn_hidden_size=ffn, moe_aux_loss_coeff=1e-2,
                    moe_token_dispatcher_type=dispatcher, moe_grouped_gemm=grouped)
    layer = MoELayer(cfg, hidden, dims, layer_number=0)
    gen = torch.Generator().manual_seed(rank)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    x = torch.randn(tokens, 1, hidden, generator=gen)

    def step():
        xi = x.clone().requires_grad_(True)
        layer(xi).square().mean().backward()

    step()  # warm-up
    times, counted = [], {}
    for _ in range(repeats):
        dims.comm_counter = CommCounter()
        torch.distributed.barrier()
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
        counted = dict(dims.comm_counter.bytes)
        dims.comm_counter = None
    return statistics.median(times), counted


def theory(dispatcher, ep, tokens, hidden):
    """(counted bytes per rank per pass, of which leave the rank) for one layer."""
    if ep == 1:
        return 0, 0
    if dispatcher == "alltoall":
        rows = tokens * TOPK * hidden * 4
        return 4 * rows + EXPERTS * 8, 4 * rows * (ep - 1) // ep
    full = ep * tokens
    gathered = full * hidden * 4 * 2 + full * EXPERTS * 4 * 2  # tokens + out grad, probs + map
    scattered = full * hidden * 4 * 2 + full * EXPERTS * 4  # out + token grad, probs grad
    return gathered + scattered, (gathered + scattered) * (ep - 1) // ep


def bench_layer(args):
    print(f"## MoE layer: {EXPERTS} experts top-{TOPK}, hidden {args.hidden}, expert ffn {args.ffn} (SwiGLU), "
          f"{args.tokens} tokens per rank, fp32, forward + backward\n")
    print("| EP | dispatcher | experts | time / pass (ms) | counted MB / rank | theory MB (counted) | "
          "theory MB leaving the rank |")
    print("|---|---|---|---|---|---|---|")
    runs = [(1, "alltoall", False), (1, "alltoall", True)]
    runs += [(ep, d, True) for ep in (2, 4) for d in ("alltoall", "allgather")]
    for ep, dispatcher, grouped in runs:
        results = run_distributed(layer_worker, ep, dispatcher, grouped, args.tokens, args.hidden, args.ffn,
                                  args.repeats, timeout=1800)
        slowest = max(t for t, _ in results)
        counted = max(sum(c.values()) for _, c in results)
        want, leaving = theory(dispatcher, ep, args.tokens, args.hidden)
        print(f"| {ep} | {dispatcher if ep > 1 else '-'} | {'grouped GEMM' if grouped else 'loop'} | "
              f"{slowest * 1e3:.1f} | {counted / 2**20:.2f} | {want / 2**20:.2f} | {leaving / 2**20:.2f} |")
    print()


# --- the whole model --------------------------------------------------------------------------
MODEL = ["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "4", "--seq-length", "256",
         "--normalization", "RMSNorm", "--swiglu", "--position-embedding-type", "rope", "--disable-bias-linear",
         "--num-experts", str(EXPERTS), "--moe-router-topk", str(TOPK), "--moe-ffn-hidden-size", "512",
         "--moe-aux-loss-coeff", "1e-2", "--micro-batch-size", "2", "--global-batch-size", "8",
         "--device", "cpu", "--eval-iters", "0", "--log-interval", "100", "--attention-dropout", "0",
         "--hidden-dropout", "0"]


def model_step_time(ranks, extra, iters):
    with tempfile.TemporaryDirectory() as tmp:
        metrics = os.path.join(tmp, "m.jsonl")
        env = dict(os.environ, OMP_NUM_THREADS="1")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}",
               os.path.join(ROOT, "pretrain_gpt.py")] + MODEL + extra + ["--train-iters", str(iters),
                                                                         "--metrics-file", metrics]
        subprocess.run(cmd, check=True, env=env, cwd=tmp, stdout=subprocess.DEVNULL)
        records = [json.loads(line) for line in open(metrics)]
    times = [r["step_time_s"] for r in records if r["iteration"] > 2]
    losses = [r["lm_loss"] for r in records]
    return statistics.median(times), losses[0], losses[-1], records[-1].get("moe_aux_loss")


def bench_model(args):
    print(f"## Whole model: 4 layers, hidden 256, all MoE ({EXPERTS} experts top-{TOPK}, expert ffn 512), seq 256, "
          f"global batch 8, {args.iters} iterations\n")
    print("| ranks | EP | dispatcher | experts | median step (s) | loss first -> last | aux loss (last) |")
    print("|---|---|---|---|---|---|---|")
    runs = [(1, 1, "alltoall", False), (1, 1, "alltoall", True)]
    runs += [(ep, ep, d, True) for ep in (2, 4) for d in ("alltoall", "allgather")]
    for ranks, ep, dispatcher, grouped in runs:
        extra = ["--expert-model-parallel-size", str(ep), "--moe-token-dispatcher-type", dispatcher]
        extra += ["--moe-grouped-gemm"] if grouped else []
        step, first, last, aux = model_step_time(ranks, extra, args.iters)
        print(f"| {ranks} | {ep} | {dispatcher if ep > 1 else '-'} | {'grouped GEMM' if grouped else 'loop'} | "
              f"{step:.3f} | {first:.3f} -> {last:.3f} | {aux if aux is None else f'{aux:.4f}'} |")
    print()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--part", choices=["layer", "model", "all"], default="all")
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--ffn", type=int, default=512)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--iters", type=int, default=8)
    args = p.parse_args()
    print(f"torch {torch.__version__}, {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs\n")
    if args.part in ("layer", "all"):
        bench_layer(args)
    if args.part in ("model", "all"):
        bench_model(args)


if __name__ == "__main__":
    main()
