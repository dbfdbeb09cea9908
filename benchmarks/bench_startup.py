"""Start-up time of the entry point, timed as whole processes from outside (start to exit):
`pretrain_gpt.py --help`, a one-line configuration error, and `python -c "import torch"` as the
yardstick (what any run that trains must pay). Median of N runs, with min and max, and the CPU
seconds (user + system) of the child, which the load of a shared machine moves less than wall time.

    python benchmarks/bench_startup.py            # 5 runs each
    python benchmarks/bench_startup.py -n 11
"""
from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENTRY = os.path.join(ROOT, "pretrain_gpt.py")
COMMANDS = [
    ("pretrain_gpt.py --help", [ENTRY, "--help"], 0),
    ("config error (--tensor-model-parallel-size 3, world 1)",
     [ENTRY, "--num-layers", "2", "--train-iters", "10", "--tensor-model-parallel-size", "3"], 2),
    ("config error on a preset (--model llama3-8b, TP 16 in a world of 1)",
     [ENTRY, "--model", "llama3-8b", "--train-iters", "10", "--tensor-model-parallel-size", "16"], 2),
    ('python -c "import torch" (yardstick)', ["-c", "import torch"], 0),
]


def time_once(args, expect_rc: int):
    """(wall s, cpu s) of one run of `python args`."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": ROOT, "WORLD_SIZE": "1"})
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != expect_rc:
        raise SystemExit(f"{args}: exit {proc.returncode}, expected {expect_rc}\n{proc.stderr}")
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-n", type=int, default=5, help="timed runs per command (after one warm-up run)")
    args = ap.parse_args()
    print(f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}, Python {sys.version.split()[0]}, "
          f"median of {args.n} runs after 1 warm-up\n")
    print("| command | wall s median | wall s min-max | cpu s median |")
    print("| --- | ---: | ---: | ---: |")
    for name, cmd, rc in COMMANDS:
        time_once(cmd, rc)
        runs = [time_once(cmd, rc) for _ in range(args.n)]
        walls, cpus = [w for w, _ in runs], [c for _, c in runs]
        print(f"| {name} | {statistics.median(walls):.2f} | {min(walls):.2f}-{max(walls):.2f} | "
              f"{statistics.median(cpus):.2f} |", flush=True)


if __name__ == "__main__":
    main()
