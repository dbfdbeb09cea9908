#!/usr/bin/env python
"""A fake-CUDA dry run of the FP8 and bf16 weight GEMMs (forward, input gradient, weight gradient)
of the 1.3B Llama of benchmarks/gpu_bench.py, with CUDA's operator rules enforced, on a machine
without a GPU:

    python tools/fake_cuda_dry_run.py                       # every recipe, the 1.3B shapes
    python tools/fake_cuda_dry_run.py --recipes rowwise --tokens 4096

Under tools/fake_cuda.py's `fake_cuda()` the tensors are `cuda` fake tensors (no memory), and each
operator runs its meta kernel, which checks the CUDA kernel's rules (torch._scaled_mm: a row-major
left and column-major right operand, multiples of 16, scale shapes per recipe). Each GEMM of the
GEMM path (megatron_lite/parallel/gemm.py, fp8.py) runs once per recipe; a refusal is a finding.
The report then lists the CUDA-only branches of megatron_lite/ (an `if` or conditional expression
whose test names CUDA) that ran, and those that did not, with why where known.

What it does not run yet (see the report's last lines): the whole training step (Trainer) under
fake CUDA, and the MoE / MLA model.
"""
from __future__ import annotations

import argparse
import os
import sys
import traceback
from typing import Dict, List

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir))
sys.path.insert(0, REPO)

import torch  # noqa: E402

from tools.cuda_branches import BranchRecorder  # noqa: E402
from tools.fake_cuda import fake_cuda  # noqa: E402

RECIPES = ("bf16", "tensorwise", "rowwise", "delayed", "blockwise")
LLAMA_1P3B = dict(hidden=2048, heads=16, ffn=5504, seq=2048)  # benchmarks/gpu_bench.py's SHAPES["llama-1.3b"]


def gemm_shapes(hidden: int, ffn: int) -> Dict[str, tuple]:
    """The weights [out, in] of one Llama layer's GEMMs (fused QKV, output projection, SwiGLU fc1, fc2)."""
    return {"qkv": (3 * hidden, hidden), "proj": (hidden, hidden), "fc1": (2 * ffn, hidden), "fc2": (hidden, ffn)}


def build_path(recipe: str, device):
    from megatron_lite.parallel.fp8 import Float8GemmPath
    from megatron_lite.parallel.gemm import GemmPath

    return GemmPath() if recipe == "bf16" else Float8GemmPath(None, "hybrid", recipe, device=device)


def run_gemm(path, name: str, shape: tuple, tokens: int, device) -> List[str]:
    """Forward, input gradient and weight gradient of one weight; the findings (refusals)."""
    w = torch.nn.Parameter(torch.empty(shape, device=device, dtype=torch.bfloat16))
    w.fp8_name = name
    if getattr(path, "delayed", None) is not None:
        path.delayed.expect([name])
    x = torch.empty(tokens, shape[1], device=device, dtype=torch.bfloat16)
    findings = []
    for part in ("forward", "input_grad", "weight_grad"):
        call = path.new_call()
        try:
            y = path.forward(call, x, w)
            g = torch.empty_like(y)
            if part == "input_grad":
                out = path.input_grad(call, g, w)
                assert out.shape == x.shape and out.is_cuda, (out.shape, out.device)
            elif part == "weight_grad":
                out = path.weight_grad(call, g, x)
                assert out.shape == w.shape and out.is_cuda, (out.shape, out.device)
        except Exception as e:  # noqa: BLE001 - every refusal is a finding to report
            where = traceback.extract_tb(e.__traceback__)
            own = [f for f in where if REPO in f.filename and "tools" not in f.filename]
            at = f" at {os.path.relpath(own[-1].filename, REPO)}:{own[-1].lineno}" if own else ""
            findings.append(f"{name} {part}: {type(e).__name__}: {str(e).splitlines()[0]}{at}")
    return findings


def dry_run(recipes, tokens: int, hidden: int, ffn: int, recorder=None) -> Dict[str, List[str]]:
    """recipe -> findings, every GEMM of one layer run under fake CUDA."""
    results = {}
    with fake_cuda(), (recorder or _nothing()):
        device = torch.device("cuda", 0)
        for recipe in recipes:
            path = build_path(recipe, device)
            results[recipe] = [f for name, shape in gemm_shapes(hidden, ffn).items()
                               for f in run_gemm(path, name, shape, tokens, device)]
    return results


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--recipes", default=",".join(RECIPES), help="comma-separated: " + ", ".join(RECIPES))
    ap.add_argument("--tokens", type=int, default=2 * LLAMA_1P3B["seq"], help="tokens per micro-batch (mbs x seq)")
    ap.add_argument("--hidden", type=int, default=LLAMA_1P3B["hidden"])
    ap.add_argument("--ffn", type=int, default=LLAMA_1P3B["ffn"])
    args = ap.parse_args(argv)
    recipes = [r for r in args.recipes.split(",") if r]
    unknown = [r for r in recipes if r not in RECIPES]
    if unknown:
        print(f"error: unknown recipe(s) {', '.join(unknown)}: use {', '.join(RECIPES)}", file=sys.stderr)
        return 2
    recorder = BranchRecorder(os.path.join(REPO, "megatron_lite"))
    results = dry_run(recipes, args.tokens, args.hidden, args.ffn, recorder)
    print(f"fake-CUDA dry run: one layer's weight GEMMs (hidden {args.hidden}, ffn {args.ffn}, {args.tokens} tokens), "
          "forward + input grad + weight grad, bf16 operands")
    for recipe, findings in results.items():
        print(f"  {recipe:<11} {'PASS' if not findings else 'FAIL'}")
        for f in findings:
            print(f"      finding: {f}")
    print(recorder.report(REPO))
    return 0 if not any(results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
