"""Activation memory on the CPU, measured beside the formula and the planner (issue 21, point 5).

1. Bytes autograd keeps per transformer layer over one bf16 micro-batch (saved-tensor hooks,
   planning/measure.SavedBytes, tests/planner_harness.saved_per_layer) next to Korthikanti et al.'s
   count with flash-style attention (planning/activations.formula_layer_bytes; its docstring derives
   the Llama version) and next to the planner's layer count, for GPT-style and Llama-style layers
   (h 256, s 128, b 2) at TP1, TP2 and TP2 with SP; then Llama-style layers under
   --recompute-modules.
2. The step peak (planning/measure.StepMemory) beside the planner for the layouts of
   tests/planner_harness.py with --recompute-modules and --cpu-offloading (fp32, model B).
3. The planner's per-layer figure for Llama-3-70B at TP4 x SP, seq 8192, mbs 1 (Megatron-Bridge's
   recipe of issue 21) beside the formula.

    python benchmarks/bench_memory.py
"""
from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def per_layer() -> None:
    from megatron_lite.testing import run_distributed
    from tests.planner_harness import LAYER_CELLS, LAYER_MODELS, saved_per_layer

    selective = ["--recompute-granularity", "selective", "--recompute-modules"]
    cells = LAYER_CELLS + [("Llama", selective + m) for m in (["core_attn"], ["mlp"], ["layernorm"],
                                                                ["core_attn", "mlp", "layernorm"])]
    print("| model | flags | measured bytes / layer | / (s b h) | formula | planner | measured / formula |")
    print("|---|---|---|---|---|---|---|")
    for world in (1, 2):
        chosen = [(m, extra) for m, extra in cells if ("--tensor-model-parallel-size" in extra) == (world == 2)]
        got = run_distributed(saved_per_layer, world, [LAYER_MODELS[m] + extra for m, extra in chosen])[0]
        for (m, extra), g in zip(chosen, got):
            print(f"| {m} | {' '.join(extra) or '-'} | {g['measured']} | {g['measured'] / g['sbh']:.2f} | "
                  f"{g['formula']} | {g['planner']} | {g['measured'] / g['formula']:.3f} |")


def step_peaks() -> None:
    from megatron_lite.testing import run_distributed
    from tests.planner_harness import LAYOUTS, measure_layouts, predict

    chosen = [(n, w, a) for n, w, a in LAYOUTS if "modules" in n or "offloading" in n.lower()]
    print("\n| layout | rank (pp, tp) | measured step peak KiB | planner KiB | error |")
    print("|---|---|---|---|---|")
    for world in sorted({w for _, w, _ in chosen}):
        here = [(n, a) for n, w, a in chosen if w == world]
        per_rank = run_distributed(measure_layouts, world, [a for _, a in here])
        for i, (name, argv) in enumerate(here):
            for got in {(r[i]["pp_rank"], r[i]["tp_rank"]): r[i] for r in per_rank}.values():
                pred = predict(argv, world, got["pp_rank"], got["tp_rank"])["step"].total
                print(f"| {name} | {got['pp_rank']}, {got['tp_rank']} | {got['peak'] / 1024:.0f} | {pred / 1024:.0f} "
                      f"| {pred / got['peak'] - 1:+.1%} |")


def llama3_70b() -> None:
    import torch

    from megatron_lite.arguments import parse_args
    from megatron_lite.planning.activations import formula_layer_bytes, micro_batch
    from megatron_lite.planning.layout import Layout
    from megatron_lite.transformer.model_counts import layer_counts
    from models.zoo import zoo

    m = parse_args(["--model", "llama3-70b", "--bf16"], zoo()).model
    lay = Layout(tp=4, pp=8, sequence_parallel=True, seq_length=8192, params_dtype=torch.bfloat16)
    planner = layer_counts(m, micro_batch(lay), False).act_bytes
    formula = formula_layer_bytes(m, 8192, tp=4, sp=True)
    print(f"\nLlama-3-70B, TP4 + SP, seq 8192, mbs 1, bf16, per layer and rank: planner {planner / 2**30:.3f} GiB, "
          f"formula {formula / 2**30:.3f} GiB ({planner / formula - 1:+.1%})")


if __name__ == "__main__":
    per_layer()
    step_peaks()
    llama3_70b()
