"""DualPipe-V's simulated bubble and activations against deepseek-ai/DualPipe's table.

    python benchmarks/bench_dualpipe_v_table.py

The table: DualPipeV bubble (PP/2 - 1)(F&B + B - 3W), activations PP + 1 per device, PP = the
number of stages (2p on our p ranks), B a full backward (our B + W). Simulated: our dualpipe-v list
with its pairs overlapped (`simulate(..., pair_cost=F&B)`, no comm), bubble = the largest idle time
of a rank (makespan - busy), activations = the peak of chunk activations held by a rank.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_lite.parallel.pipeline.placement import StagePlacement  # noqa: E402
from megatron_lite.parallel.pipeline.schedules import build_schedule  # noqa: E402
from megatron_lite.parallel.pipeline.simulator import simulate  # noqa: E402

COSTS = [(1, 1, 1, 2), (1, 1, 1, 2.5), (1, 1, 1, 3), (1, 2, 1, 3), (1, 1.5, 0.5, 2),  # F, W <= B
         (2, 1, 1, 3), (0.5, 0.5, 1, 1.5)]  # F > B, W > B: outside the table's assumptions


def _figures(p: int, m: int, f: float, b: float, w: float, fb: float):
    """(simulated bubble, simulated peak activations) of our overlapped dualpipe-v list."""
    lists = build_schedule("dualpipe-v", p, m, overlap=True)
    res = simulate(lists, costs=(f, b, w), comm="ideal", placement=StagePlacement(p, 2, "V"), pair_cost=fb)
    return max(res.makespan - busy for busy in res.busy), max(res.peak_in_flight)


def main() -> None:
    print("| p (PP = 2p) | m | F,B,W | F&B | simulated bubble | table bubble | simulated act. | table act. (PP+1) |")
    print("|---|---|---|---|---|---|---|---|")
    for p in (2, 4, 8):
        ms = (2 * p - 1, 4 * p)
        for f, b, w, fb in COSTS:
            figures = {m: _figures(p, m, f, b, w, fb) for m in ms}
            rows = [(", ".join(map(str, ms)), figures[ms[0]])] if len(set(figures.values())) == 1 else \
                [(str(m), fig) for m, fig in figures.items()]  # one row when every m gives the same
            for m_text, (idle, act) in rows:
                table = (p - 1) * (fb + (b + w) - 3 * w)
                print(f"| {p} ({2 * p}) | {m_text} | {f:g},{b:g},{w:g} | {fb:g} | {idle:g} | {table:g} | "
                      f"{act} | {2 * p + 1} |")

if __name__ == "__main__":
    main()
