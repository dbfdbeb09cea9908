"""DualPipe-V's simulated bubble and activations against deepseek-ai/DualPipe's table.

    python benchmarks/bench_dualpipe_v_table.py

The table: DualPipeV bubble (PP/2 - 1)(F&B + B - 3W), activations PP + 1 per device, PP = the
number of stages (2p on our p ranks), B a full backward (our B + W). Simulated: our dualpipe-v list
with its pairs overlapped (`simulate(..., pair_cost=F&B)`, no comm), bubble = the largest idle time
of a rank (makespan - busy), activations = the peak of chunk activations held by a rank.
Then the one place where DeepSeek's dualpipev.py differs from our list: on the last rank it runs
the first pair of its main step serialized (F, then B), where ours overlaps it.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_lite.parallel.pipeline.placement import StagePlacement  # noqa: E402
from megatron_lite.parallel.pipeline.schedules import build_schedule, compute_orders  # noqa: E402
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


def _deepseek_last_rank(orders):
    """Our compute order with the last rank's first pair made serial, forward first (dualpipev.py, step 4)."""
    last = orders[-1]
    i = next(k for k in range(len(last) - 1) if last[k].kind == "BW" and last[k + 1].kind == "F")
    out = [list(o) for o in orders]
    out[-1][i], out[-1][i + 1] = last[i + 1], last[i]
    return out


def compare_last_rank() -> None:
    print("\n| p | m | F,B,W | F&B | makespan ours / serial first pair | bubble ours / serial first pair |")
    print("|---|---|---|---|---|---|")
    for p, m in ((4, 7), (8, 15)):
        orders = compute_orders("dualpipe-v", p, m)
        for f, b, w, fb in COSTS[:5]:
            runs = [simulate(o, costs=(f, b, w), comm="ideal", placement=StagePlacement(p, 2, "V"), pair_cost=fb)
                    for o in (orders, _deepseek_last_rank(orders))]
            spans = " / ".join(f"{r.makespan:g}" for r in runs)
            idles = " / ".join(f"{max(r.makespan - x for x in r.busy):g}" for r in runs)
            print(f"| {p} | {m} | {f:g},{b:g},{w:g} | {fb:g} | {spans} | {idles} |")


if __name__ == "__main__":
    main()
    compare_last_rank()
