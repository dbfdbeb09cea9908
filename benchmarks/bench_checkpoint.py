#!/usr/bin/env python
"""Checkpoint save and load for a ~100M-parameter GPT at DP=2 on CPU: synchronous vs --async-save.

    python benchmarks/bench_checkpoint.py [--num-layers 14] [--hidden-size 768] [--iters 10] [--interval 3]

Three training runs of the same command in fresh worlds of forked gloo ranks (ZeRO-1, fp32):
no checkpoints, `--save-interval` synchronous, and the same with `--async-save`. "Blocked" is the
time the training loop spent inside checkpoint calls for a save (snapshot and file writing for
a synchronous save; snapshot copies, the completion polls and the commit for an asynchronous
one; the slower rank counts). "Slowdown" is the extra step time of the iterations after a save,
until the next one, against the median step of the run without checkpoints (a background writer
shares the 2 cores). Lost per save = blocked + slowdown; the last save of a run (at the end of
training) is left out. Then the checkpoint is loaded at the same layout, resharded into DP=1,
and into TP=2: the time of the whole load (read, fill, param all-gather), the slower rank.
"""
from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir)))

import torch  # noqa: E402

from megatron_lite.checkpoint import read_metadata, read_tracker  # noqa: E402
from megatron_lite.testing import run_distributed  # noqa: E402


def worker(rank, world, argv):
    os.environ["WORLD_SIZE"] = str(world)
    from pretrain_gpt import resolve
    from megatron_lite.training.loop import Trainer
    cfg, tokenizer = resolve(argv)
    trainer = Trainer(cfg, tokenizer, torch.device("cpu"))
    history = trainer.train()
    return {"steps": {r["iteration"]: r["step_time_s"] for r in history},
            "blocked": dict(trainer.checkpointing.blocked_s), "load_s": trainer.checkpointing.load_s,
            "params": cfg.model.num_parameters()}


def slowest(results, what):
    """Per key, the largest value over ranks."""
    keys = set().union(*(r[what] for r in results))
    return {k: max(r[what].get(k, 0.0) for r in results) for k in keys}


def lost_per_save(results, baseline_step, saves, last):
    blocked, steps = slowest(results, "blocked"), slowest(results, "steps")
    out = []
    for i, it in enumerate(saves):
        following = range(it + 1, (saves[i + 1] if i + 1 < len(saves) else last) + 1)
        slowdown = sum(steps[j] - baseline_step for j in following if j in steps and j not in saves)
        out.append((blocked.get(it, 0.0), slowdown))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-layers", type=int, default=14)
    ap.add_argument("--hidden-size", type=int, default=768)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--interval", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where checkpoints go (default: a temporary directory)")
    args = ap.parse_args()
    root = args.dir or tempfile.mkdtemp(prefix="bench_ckpt_")
    model = ["--num-layers", str(args.num_layers), "--hidden-size", str(args.hidden_size), "--num-attention-heads", "12",
             "--seq-length", "128", "--max-position-embeddings", "128", "--micro-batch-size", "1",
             "--global-batch-size", "2", "--lr", "1e-4", "--eval-iters", "0", "--device", "cpu",
             "--log-interval", "1000", "--train-iters", str(args.iters)]
    dp2 = model + ["--use-distributed-optimizer"]
    print(f"machine: {platform.machine()} {os.cpu_count()} cores, torch {torch.__version__}; checkpoints in {root}")

    base = run_distributed(worker, 2, dp2)
    steps = slowest(base, "steps")
    baseline = statistics.median(steps[i] for i in steps if i > 1)
    print(f"model: {base[0]['params'] / 1e6:.1f}M parameters; DP=2 ZeRO-1 fp32; median step {baseline:.2f} s")

    saves = list(range(args.interval, args.iters, args.interval))  # mid-run saves (the end save is left out)
    rows = {}
    for name, extra in (("synchronous", []), ("--async-save", ["--async-save"])):
        d = os.path.join(root, name.strip("-"))
        shutil.rmtree(d, ignore_errors=True)
        res = run_distributed(worker, 2, dp2 + ["--save", d, "--save-interval", str(args.interval), "--keep-last", "2"] + extra)
        rows[name] = lost_per_save(res, baseline, saves, args.iters)
    ckpt = os.path.join(root, "synchronous")
    meta = read_metadata(os.path.join(ckpt, f"iter_{read_tracker(ckpt):07d}"))
    size = sum(f["bytes"] for f in meta["files"].values())
    per_file = ", ".join(f"{f['bytes'] / 2**20:.0f}" for f in meta["files"].values())
    print(f"checkpoint: {size / 2**20:.0f} MiB in {len(meta['files'])} files ({per_file} MiB)\n")
    print("| save mode | blocked per save (s) | slowdown after it (s) | lost per save (s) | lost / step |")
    print("|---|---|---|---|---|")
    for name, per in rows.items():
        b = statistics.median(x for x, _ in per)
        s = statistics.median(y for _, y in per)
        print(f"| {name} | {b:.2f} | {s:.2f} | {b + s:.2f} | {(b + s) / baseline:.2f} |")

    print("\n| load into | ranks | load time (s) | MB/s read |")
    print("|---|---|---|---|")
    for name, world, flags in (("DP=2 ZeRO-1 (same layout)", 2, ["--use-distributed-optimizer"]),
                               ("DP=1 (resharded)", 1, []),
                               ("TP=2 DP=1 (resharded)", 2, ["--tensor-model-parallel-size", "2"])):
        res = run_distributed(worker, world, model + flags + ["--load", ckpt])
        load_s = max(r["load_s"] for r in res)
        print(f"| {name} | {world} | {load_s:.2f} | {size / 2**20 / load_s:.0f} |")
    if args.dir is None:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    t0 = time.perf_counter()
    main()
    print(f"\n(total {time.perf_counter() - t0:.0f} s)")
