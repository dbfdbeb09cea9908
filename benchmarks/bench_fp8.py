"""Per-GEMM error of the FP8 recipes (megatron_lite/parallel/fp8.py) on the CPU: for each GEMM of a
linear (forward x W^T, input gradient g W, weight gradient g^T x) and each recipe / format, the
relative Frobenius error against the fp32 GEMM, beside bf16's. Activations ~ N(0, 1) with a few
outlier rows (x 20), weights ~ N(0, 0.02), gradients ~ N(0, 1e-3): what current scaling sees.

    python benchmarks/bench_fp8.py [--tokens 512 --hidden 256 --ffn 1024]
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir)))
from megatron_lite.parallel.fp8 import Float8GemmPath


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--ffn", type=int, default=1024)
    a = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(a.tokens, a.hidden, generator=g)
    x[:: max(1, a.tokens // 8)] *= 20  # outlier tokens: where per-row scaling helps
    w = torch.randn(a.ffn, a.hidden, generator=g) * 0.02
    dy = torch.randn(a.tokens, a.ffn, generator=g) * 1e-3
    exact = {"forward": x @ w.t(), "input_grad": dy @ w, "weight_grad": dy.t() @ x}
    bf = lambda t: t.bfloat16().float()  # noqa: E731
    rows = [("bf16", {"forward": bf(x) @ bf(w).t(), "input_grad": bf(dy) @ bf(w), "weight_grad": bf(dy).t() @ bf(x)})]
    for recipe in ("tensorwise", "rowwise"):
        for fmt in ("e4m3", "hybrid"):
            p = Float8GemmPath(fmt=fmt, recipe=recipe)
            c = p.new_call()
            rows.append((f"{recipe} {fmt}", {"forward": p.forward(c, x, w), "input_grad": p.input_grad(c, dy, w),
                                             "weight_grad": p.weight_grad(c, dy, x)}))
    print(f"x [{a.tokens}, {a.hidden}], W [{a.ffn}, {a.hidden}]: relative error vs the fp32 GEMM")
    print(f"{'':22s}" + "".join(f"{k:>14s}" for k in exact))
    for name, got in rows:
        print(f"{name:22s}" + "".join(f"{rel(got[k], exact[k]):14.2e}" for k in exact))


if __name__ == "__main__":
    main()
