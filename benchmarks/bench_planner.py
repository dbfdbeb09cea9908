"""The planner's accuracy table: predicted vs measured per rank for the layouts of
tests/planner_harness.py (two model sizes, TP/SP, PP with each schedule, VPP, DP with ZeRO 0-3,
recomputation, CP, EP), as markdown for benchmarks/RESULTS.md; then the timing of
`tools/plan.py --model llama3-70b --world-size 1024 --gpu-memory 80GB --search`.

    python benchmarks/bench_planner.py
"""
from __future__ import annotations

import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def main() -> None:
    from tests.planner_harness import measure_all

    rows = measure_all()
    print("| layout | world | pp rank | tp rank | param / grad / optimizer bytes: predicted = accounted = held |"
          " measured step peak KiB | predicted KiB | error |")
    print("|---|---|---|---|---|---|---|---|")
    worst = 0.0
    for r in rows:
        acc = r["accounted"]
        same = r["predicted"]["accounted"] == acc == r["held"]
        pred, meas = r["predicted"]["step"].total, r["peak"]
        err = pred / meas - 1
        worst = max(worst, abs(err))
        print(f"| {r['name']} | {r['world']} | {r['pp_rank']} | {r['tp_rank']} | "
              f"{acc['param_bytes']} / {acc['grad_bytes']} / {acc['optimizer_state_bytes']}: "
              f"{'equal' if same else 'DIFFERENT'} | {meas / 1024:.0f} | {pred / 1024:.0f} | {err:+.1%} |")
    print(f"\n{len(rows)} ranks, worst |error| {worst:.1%}")
    cmd = [sys.executable, os.path.join(ROOT, "tools", "plan.py"), "--model", "llama3-70b", "--world-size", "1024",
           "--gpu-memory", "80GB", "--search"]
    start = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=ROOT), check=True)
    print(f"\n`{' '.join(['python', 'tools/plan.py'] + cmd[2:])}` in {time.perf_counter() - start:.1f} s "
          f"(process, imports included):\n```\n{out.stdout}```")


if __name__ == "__main__":
    main()
