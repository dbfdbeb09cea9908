"""ZeRO-2/3 under gradient accumulation: gradients reduce-scattered every micro-batch (the default)
against once per step (--grad-reduce-once-per-step), at DP2 with 8 micro-batches per rank, on CPU.

Per layout and rank: the measured peak of what the second step allocates on top of the state held
across steps (planning/measure.StepMemory, as tests/planner_harness.py measures it) beside the
planner's prediction; the reduce-scatter bytes the communicator counted beside the theory (the
full padded gradient buckets, 4 bytes an element, once per micro-batch or once per step); the
step's wall time (noisy: 2 shared cores).

    python benchmarks/bench_zero_accumulation.py [--layers 8] [--hidden 256] [--bucket-size 500000]
"""
from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

MiB = 2 ** 20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--seq-length", type=int, default=256)
    ap.add_argument("--bucket-size", type=int, default=500_000, help="ZeRO-2's bucket size in elements")
    args = ap.parse_args()

    from megatron_lite.testing import run_distributed
    from tests.planner_harness import measure_layouts, predict

    dp, mbs, m = 2, 2, 8
    model = ["--num-layers", str(args.layers), "--hidden-size", str(args.hidden), "--num-attention-heads", "8",
             "--ffn-hidden-size", str(args.hidden * 11 // 4), "--seq-length", str(args.seq_length),
             "--vocab-size", "4000", "--normalization", "RMSNorm", "--swiglu", "--position-embedding-type", "rope",
             "--untie-embeddings-and-output-weights", "--disable-bias-linear", "--device", "cpu",
             "--eval-iters", "0", "--train-iters", "2", "--attention-dropout", "0", "--hidden-dropout", "0",
             "--mock-data", "--micro-batch-size", str(mbs), "--global-batch-size", str(dp * mbs * m),
             "--overlap-grad-reduce"]
    layouts = []
    for stage, extra in (("2", ["--ddp-bucket-size", str(args.bucket_size)]), ("3", [])):
        for once in (False, True):
            name = f"ZeRO-{stage} {'once per step' if once else 'per micro-batch'}"
            layouts.append((name, model + ["--zero-stage", stage] + extra
                            + (["--grad-reduce-once-per-step"] if once else [])))
    per_rank = run_distributed(measure_layouts, dp, [argv for _, argv in layouts])
    print(f"DP{dp}, {m} micro-batches of {mbs} x {args.seq_length} tokens per rank, {args.layers} layers, "
          f"h {args.hidden}, --overlap-grad-reduce; rank 0\n")
    print("| layout | step peak measured MiB | planner MiB | error | reduce-scatter MiB measured | theory | "
          "step s |")
    print("|---|---|---|---|---|---|---|")
    for i, (name, argv) in enumerate(layouts):
        got = per_rank[0][i]
        pred = predict(argv, dp, 0, 0)
        rounds = 1 if "once" in name else m
        theory = pred["accounted"]["grad_bytes"] * dp * rounds  # the shard is 1/dp of the padded buckets
        rs = got["comm"].get("reduce_scatter", 0)
        planned = pred["step"].total
        print(f"| {name} | {got['peak'] / MiB:.2f} | {planned / MiB:.2f} | {planned / got['peak'] - 1:+.1%} | "
              f"{rs / MiB:.2f} | {theory / MiB:.2f}{'' if rs == theory else ' (DIFFERENT)'} | "
              f"{got['step_s']:.2f} |")


if __name__ == "__main__":
    main()
