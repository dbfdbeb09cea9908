#!/usr/bin/env python
"""Checkpoint save and load for a ~100M-parameter GPT at DP=2 on CPU: synchronous vs --async-save
vs local (non-persistent) checkpoints.

    python benchmarks/bench_checkpoint.py [--num-layers 14] [--hidden-size 768] [--iters 16] [--interval 5] [--repeats 2]

Four training runs of the same command in fresh worlds of forked gloo ranks (ZeRO-1, fp32):
no checkpoints, `--save-interval` synchronous, the same with `--async-save`, and local checkpoints
at the same interval (`--non-persistent-ckpt-type local --non-persistent-save-interval`: each rank
writes its own state into its own directory; no --save). "Blocked" is the
time the training loop spent inside checkpoint calls for a save (snapshot and file writing for
a synchronous save; snapshot copies, the completion polls and the commit for an asynchronous
one; the slower rank counts). "Slowdown" is the extra time of the steps after a save up to the
next one (a background writer shares the 2 cores and the disk) over the median step of the run
without checkpoints just before. Lost per save = blocked + slowdown, for the mid-run saves
whose following steps all ran. "Write" is how long writing a rank's file took (in the
background with --async-save). The trio runs `--repeats` times, interleaved, because the load of
this shared machine drifts. Then the checkpoint is loaded at the same layout, resharded into
DP=1, and into TP=2: the whole load (read, fill, param all-gather), the slower rank, from a warm
page cache (the files were just written), with the CRC-32 checksums verified (the default) and
with --no-verify-checkpoint. "Checksums" is the part of a rank's write spent computing them.
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
    from pretrain_gpt import make_trainer
    cfg, tokenizer = resolve(argv)
    trainer = make_trainer(cfg, tokenizer, torch.device("cpu"))
    history = trainer.train()
    ckpt = trainer.checkpointing
    return {"steps": {r["iteration"]: r["step_time_s"] for r in history}, "blocked": dict(ckpt.blocked_s),
            "write": {**ckpt.write_s, **ckpt.local_write_s}, "checksum": {**ckpt.checksum_s, **ckpt.local_checksum_s},
            "load_s": ckpt.load_s, "local_bytes": local_bytes(cfg.training.non_persistent_local_ckpt_dir),
            "params": cfg.model.num_parameters()}


def local_bytes(root):
    """Bytes of the local checkpoints under `root` (all ranks' directories), None without."""
    if root is None:
        return None
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(root) for f in files)


def slowest(results, what):
    """Per key, the largest value over ranks."""
    keys = set().union(*(r[what] for r in results))
    return {k: max(r[what].get(k, 0.0) for r in results) for k in keys}


def per_save(results, saves, interval, baseline):
    """(blocked, slowdown, write, checksum) seconds per mid-run save."""
    blocked, steps, write = slowest(results, "blocked"), slowest(results, "steps"), slowest(results, "write")
    crc = slowest(results, "checksum")
    return [(blocked.get(i, 0.0), sum(steps[j] - baseline for j in range(i + 1, i + interval)), write.get(i, 0.0),
             crc.get(i, 0.0)) for i in saves]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-layers", type=int, default=14)
    ap.add_argument("--hidden-size", type=int, default=768)
    ap.add_argument("--iters", type=int, default=16)
    ap.add_argument("--interval", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--dir", default=None, help="where checkpoints go (default: a temporary directory)")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds one training run may take (a loaded machine)")
    args = ap.parse_args()
    root = args.dir or tempfile.mkdtemp(prefix="bench_ckpt_")
    model = ["--num-layers", str(args.num_layers), "--hidden-size", str(args.hidden_size), "--num-attention-heads", "12",
             "--seq-length", "128", "--max-position-embeddings", "128", "--micro-batch-size", "1",
             "--global-batch-size", "2", "--lr", "1e-4", "--eval-iters", "0", "--device", "cpu",
             "--log-interval", "1000", "--train-iters", str(args.iters)]
    dp2 = model + ["--use-distributed-optimizer"]
    print(f"machine: {platform.machine()} {os.cpu_count()} cores, torch {torch.__version__}; checkpoints in {root}")

    saves = list(range(args.interval, args.iters - args.interval + 1, args.interval))  # with all next steps run
    print("| repeat | save mode | median step without saves (s) | write (s) | of which checksums (s) "
          "| blocked per save (s) | slowdown after it (s) | lost per save (s) | lost / step |")
    print("|---|---|---|---|---|---|---|---|---|")
    for repeat in range(args.repeats):
        base = run_distributed(worker, 2, dp2, timeout=args.timeout)
        steps = slowest(base, "steps")
        baseline = statistics.median(t for i, t in steps.items() if i > 1)
        for name, extra in (("synchronous", []), ("--async-save", ["--async-save"]), ("local", None)):
            ckpt = os.path.join(root, name.strip("-"))
            shutil.rmtree(ckpt, ignore_errors=True)
            saving = ["--save", ckpt, "--save-interval", str(args.interval), "--keep-last", "2"]
            if extra is None:
                saving = ["--non-persistent-ckpt-type", "local", "--non-persistent-local-ckpt-dir", ckpt,
                          "--non-persistent-save-interval", str(args.interval)]
            res = run_distributed(worker, 2, dp2 + saving + (extra or []), timeout=args.timeout)
            if extra is None:
                local_size = res[0]["local_bytes"]
            per = per_save(res, saves, args.interval, baseline)
            b, s, w, c = (statistics.median(x[k] for x in per) for k in range(4))
            print(f"| {repeat + 1} | {name} | {baseline:.2f} | {w:.2f} | {c:.2f} | {b:.2f} | {s:.2f} | {b + s:.2f} "
                  f"| {(b + s) / baseline:.2f} |", flush=True)
    ckpt = os.path.join(root, "synchronous")
    meta = read_metadata(os.path.join(ckpt, f"iter_{read_tracker(ckpt):07d}"))
    size = sum(f["bytes"] for f in meta["files"].values())
    per_file = ", ".join(f"{f['bytes'] / 2**20:.0f}" for f in meta["files"].values())
    print(f"\nmodel: {base[0]['params'] / 1e6:.1f}M parameters, DP=2 ZeRO-1 fp32; checkpoint {size / 2**20:.0f} MiB "
          f"in {len(meta['files'])} files ({per_file} MiB); local checkpoints {local_size / 2**20:.0f} MiB (both "
          f"ranks, the newest only); mid-run saves measured at {saves}")

    print("\n| load into | ranks | load time, checksums verified (s) | MB/s | load time, --no-verify-checkpoint (s) "
          "| MB/s |")
    print("|---|---|---|---|---|---|")
    for name, world, flags in (("DP=2 ZeRO-1 (same layout)", 2, ["--use-distributed-optimizer"]),
                               ("DP=1 (resharded)", 1, []),
                               ("TP=2 DP=1 (resharded)", 2, ["--tensor-model-parallel-size", "2"])):
        row = []
        for verify in ([], ["--no-verify-checkpoint"]):
            res = run_distributed(worker, world, model + flags + ["--load", ckpt] + verify, timeout=args.timeout)
            load_s = max(r["load_s"] for r in res)
            row += [f"{load_s:.2f}", f"{size / 2**20 / load_s:.0f}"]
        print(f"| {name} | {world} | " + " | ".join(row) + " |")
    if args.dir is None:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    t0 = time.perf_counter()
    main()
    print(f"\n(total {time.perf_counter() - t0:.0f} s)")
