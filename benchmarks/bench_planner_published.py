"""The planner against runs others published (tests/published_runs.py): for each, the published
throughput beside the predicted one (same unit: model TFLOP/s per GPU, or tokens/s per GPU), the
predicted peak memory per GPU beside the published one where given, and the step time's parts;
then the DeepSeek-V3 and Kimi-K2 layouts (no published figure in this form: the prediction), and
the GPU records used. Markdown for benchmarks/RESULTS.md.

    python benchmarks/bench_planner_published.py
"""
from __future__ import annotations

import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def _parts(ev) -> str:
    t = ev.time
    parts = [("compute", t.compute_s), ("bubble", t.bubble_s), ("TP", t.tp_s), ("CP", t.cp_s), ("EP a2a", t.ep_s),
             ("DP exposed", t.dp_s), ("optimizer", t.optimizer_s)]
    return ", ".join(f"{k} {v:.2f}" for k, v in parts if v >= 0.005)


def main() -> None:
    import torch

    from megatron_lite.planning.hardware import GPUS
    from tests.published_runs import LAYOUTS, RUNS

    torch.set_num_threads(1)
    tmp = tempfile.mkdtemp()
    print("| run | layout | published | predicted | error | peak GiB (published) | step s: parts |")
    print("|---|---|---|---|---|---|---|")
    worst = 0.0
    for run in RUNS:
        ev, hw = run.plan(tmp)
        pred = run.predicted(ev)
        err = pred / run.published - 1
        worst = max(worst, abs(err))
        unit = "TFLOP/s/GPU" if run.tflops_per_gpu else "tokens/s/GPU"
        mem = f"{ev.peak_bytes / 2**30:.1f}" + (f" ({run.memory_gib})" if run.memory_gib else "")
        print(f"| {run.name} | {ev.layout.describe()} | {run.published:,.1f} {unit} | {pred:,.1f} | {err:+.1%} | "
              f"{mem}{'' if ev.fits else ' DOES NOT FIT'} | {ev.time.total_s:.2f}: {_parts(ev)} |")
    print(f"\nworst |error| {worst:.1%} over {len(RUNS)} runs\n")
    print("| layout | plan | tokens/s/GPU | model TFLOP/s/GPU | MFU | peak GiB of usable | step s: parts |")
    print("|---|---|---|---|---|---|---|")
    for run in LAYOUTS:
        ev, hw = run.plan(tmp)
        t, lay = ev.time, ev.layout
        tokens = lay.global_batch_size * lay.seq_length / t.total_s / lay.world_size
        print(f"| {run.name} | {lay.describe()} | {tokens:,.0f} | {t.model_tflop_per_gpu / t.total_s:.1f} | "
              f"{t.mfu(hw):.1%} | {ev.peak_bytes / 2**30:.1f} of {ev.usable / 2**30:.1f}"
              f"{'' if ev.fits else ' DOES NOT FIT'} | {t.total_s:.2f}: {_parts(ev)} |")
    print("\nGPU records (planning/hardware.py; rates in TFLOP/s, bandwidths in GB/s per GPU):\n")
    print("| GPU | peak bf16 | GEMM (sustained) | attention | HBM | NVLink | network |")
    print("|---|---|---|---|---|---|---|")
    for name, hw in GPUS.items():
        print(f"| {name} | {hw.peak_tflops:.0f} | {hw.gemm_tflops:.0f} | {hw.attention_tflops:.0f} | "
              f"{hw.hbm_gbps:.0f} | {hw.nvlink_gbps:.0f} | {hw.network_gbps:.0f} |")


if __name__ == "__main__":
    main()
