"""Per-GEMM error of the FP8 recipes (megatron_lite/parallel/fp8.py) on the CPU: for each GEMM of a
linear (forward x W^T, input gradient g W, weight gradient g^T x) and each recipe / format, the
relative Frobenius error against the fp32 GEMM, beside bf16's. Activations ~ N(0, 1) with a few
outlier rows (x 20, --outlier), weights ~ N(0, 0.02), gradients ~ N(0, 1e-3): what current scaling sees.
Delayed scaling quantizes with the scales of a previous step: one step of other tensors from the
same distributions is folded into its history first (what it sees in steady training).

    python benchmarks/bench_fp8.py [--tokens 512 --hidden 256 --ffn 1024 --outlier 20]
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir)))
from megatron_lite.parallel.fp8 import Float8GemmPath


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def operands(a, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(a.tokens, a.hidden, generator=g)
    x[:: max(1, a.tokens // 8)] *= a.outlier  # outlier tokens: where per-row / per-tile scaling helps
    w = torch.randn(a.ffn, a.hidden, generator=g) * 0.02
    w.fp8_name = "w"  # delayed scaling's history is per weight
    return x, w, torch.randn(a.tokens, a.ffn, generator=g) * 1e-3


def gemms(p, x, w, dy):
    c = p.new_call()
    return {"forward": p.forward(c, x, w), "input_grad": p.input_grad(c, dy, w), "weight_grad": p.weight_grad(c, dy, x)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--ffn", type=int, default=1024)
    ap.add_argument("--outlier", type=float, default=20.0, help="the outlier tokens' factor")
    a = ap.parse_args()
    x, w, dy = operands(a, 0)
    exact = {"forward": x @ w.t(), "input_grad": dy @ w, "weight_grad": dy.t() @ x}
    bf = lambda t: t.bfloat16().float()  # noqa: E731
    rows = [("bf16", {"forward": bf(x) @ bf(w).t(), "input_grad": bf(dy) @ bf(w), "weight_grad": bf(dy).t() @ bf(x)})]
    for recipe in ("tensorwise", "rowwise", "blockwise", "delayed"):
        for fmt in ("e4m3", "hybrid"):
            p = Float8GemmPath(fmt=fmt, recipe=recipe)
            if p.delayed is not None:  # a previous step's amaxes in the history
                p.delayed.before_step(1)
                gemms(p, *operands(a, 1))
                p.delayed.after_update()
                p.delayed.before_step(2)
            rows.append((f"{recipe} {fmt}", gemms(p, x, w, dy)))
    print(f"x [{a.tokens}, {a.hidden}] (outlier tokens x {a.outlier:g}), W [{a.ffn}, {a.hidden}]: relative error vs "
          f"the fp32 GEMM")
    other = torch.ones(a.tokens, dtype=torch.bool)
    other[:: max(1, a.tokens // 8)] = False  # the forward's error on the ordinary tokens alone
    print(f"{'':22s}" + "".join(f"{k:>14s}" for k in exact) + f"{'fwd, others':>14s}")
    for name, got in rows:
        print(f"{name:22s}" + "".join(f"{rel(got[k], exact[k]):14.2e}" for k in exact)
              + f"{rel(got['forward'][other], exact['forward'][other]):14.2e}")


if __name__ == "__main__":
    main()
