"""MoE parallel folding in the planner: the same model and world with the expert grid folded over
the TP ranks (ETP 1: EP spans TP x DP ranks inside a node) or not (ETP = TP: EP spans DP replicas,
TP x EP ranks apart, across nodes), and the layout folding newly allows (EP 8 beside TP 2 on one
8-GPU node, which EP-inside-DP-x-CP could not hold). Prints per layout the planner's expert
all-to-all time, step time, MFU and worst rank's peak memory, as markdown for RESULTS.md.

    python benchmarks/bench_moe_folding.py [--gpu H100] [--seq-length 4096] [--global-batch-size 256]
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_lite.arguments import parse_args  # noqa: E402
from megatron_lite.planning.hardware import GPUS  # noqa: E402
from megatron_lite.planning.layout import Layout  # noqa: E402
from megatron_lite.planning.search import evaluate  # noqa: E402
from models.gpt_inventory import GPTInventory  # noqa: E402
from models.zoo import zoo  # noqa: E402

ROWS = [  # (model, world, tp, dp, ep, etp, what)
    ("qwen3-30b-a3b", 16, 2, 8, 8, 1, "folded: EP over 4 DP x 2 TP ranks of a node"),
    ("qwen3-30b-a3b", 16, 2, 8, 8, 2, "ETP = TP: EP over 8 DP replicas, 16 ranks apart"),
    ("qwen3-30b-a3b", 8, 2, 4, 8, 1, "folded on one node (EP 8 > DP 4: not expressible unfolded)"),
    ("mixtral-8x7b", 16, 2, 8, 8, 1, "folded: EP over 4 DP x 2 TP ranks of a node"),
    ("mixtral-8x7b", 16, 2, 8, 8, 2, "ETP = TP: EP over 8 DP replicas, 16 ranks apart"),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gpu", default="H100", choices=sorted(GPUS))
    ap.add_argument("--seq-length", type=int, default=4096)
    ap.add_argument("--global-batch-size", type=int, default=256)
    args = ap.parse_args()
    hw = GPUS[args.gpu]
    print(f"{args.gpu}: NVLink {hw.nvlink_gbps} GB/s, network {hw.network_gbps} GB/s per GPU, "
          f"{hw.gpus_per_node} GPUs per node; seq {args.seq_length}, global batch {args.global_batch_size}, "
          f"mbs 1, ZeRO-1, SP, bf16\n")
    print("| model | GPUs | layout | EDP | expert comm s/step (EP all-to-all + ETP gather) | step s | MFU | peak GiB | note |")
    print("|---|---|---|---|---|---|---|---|---|")
    for model, world, tp, dp, ep, etp, what in ROWS:
        cfg = parse_args(["--model", model, "--bf16", "--seq-length", str(args.seq_length), "--train-iters", "10"],
                         zoo())
        lay = Layout(tp=tp, dp=dp, ep=ep, etp=etp, zero_stage=1, sequence_parallel=True,
                     seq_length=args.seq_length, global_batch_size=args.global_batch_size, overlap_grad_reduce=True,
                     overlap_param_gather=True)
        assert lay.world_size == world
        ev = evaluate(cfg, lay, hw, GPTInventory(cfg.model, torch.bfloat16).chunk)
        if not ev.valid:
            print(f"| {model} | {world} | TP{tp} DP{dp} EP{ep} ETP{etp} | | refused: {ev.error} | | | | {what} |")
            continue
        t = ev.time
        print(f"| {model} | {world} | TP{tp} DP{dp} EP{ep} ETP{etp} | {lay.edp} | {t.ep_s:.3f} | {t.total_s:.2f} | "
              f"{t.mfu(hw):.1%} | {ev.peak_bytes / 2**30:.1f} | {what} |")


if __name__ == "__main__":
    main()
