"""Optimizer step time with the state in memory, in host memory (--optimizer-cpu-offload) and on disk
(--optimizer-offload-nvme-path), for a ~1 GB optimizer state (fp32 main params, m and v of an
80M-parameter GPT), beside this machine's disk bandwidth as `dd` measures it (write with
conv=fdatasync, read with iflag=direct).

The step is DistributedOptimizer.step() on random gradients (no forward/backward: offload changes
only the step). NVMe throughput = bytes read + written per step / step time (both counted by the
store). On a GPU the in-memory and host rows differ; on this CPU-only machine the host store is a
second copy in the same memory.

    python benchmarks/bench_offload.py [--dir DIR] [--steps 3] [--layers 6] [--bucket-mib 64]

`--params` measures ZeRO-3's parameter offload (--param-offload-nvme-path) instead: whole training
steps (forward, backward, step: the gathers read the shards from the file), in memory and with the
shards on disk, with the bytes read and written per step and the param memory held.

    python benchmarks/bench_offload.py --params [--dir DIR] [--steps 3] [--layers 6] [--micro-batches 2]
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_lite.config import ModelConfig, ParallelConfig, TrainingConfig  # noqa: E402
from megatron_lite.optim.optimizer import build_optimizer  # noqa: E402
from megatron_lite.parallel.state import ParallelDims  # noqa: E402
from megatron_lite.training.step import train_step  # noqa: E402
from models.gpt import build_model, gpt_forward_step  # noqa: E402


def dd_bandwidth(directory: str, mib: int) -> tuple:
    """(write MB/s with conv=fdatasync, read MB/s with iflag=direct) of a `mib` MiB file, from dd's own report."""
    path = os.path.join(directory, "dd-probe.bin")

    def rate(cmd):
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stderr
        num, unit = re.findall(r"([\d.,]+) ([kMG]?B)/s", out)[-1]
        return float(num.replace(",", ".")) * {"kB": 1e-3, "MB": 1.0, "GB": 1e3, "B": 1e-6}[unit]

    try:
        write = rate(["dd", "if=/dev/zero", f"of={path}", "bs=4M", f"count={mib // 4}", "conv=fdatasync"])
        read = rate(["dd", f"if={path}", "of=/dev/null", "bs=4M", "iflag=direct"])
    finally:
        os.unlink(path)
    return write, read


def step_times(layers: int, bucket: int, steps: int, **tflags) -> tuple:
    """(seconds per optimizer step, state bytes, MB/s of file traffic or None, staging bytes or None)."""
    torch.manual_seed(0)
    dims = ParallelDims.from_world()
    cfg = ModelConfig(num_layers=layers, hidden_size=1024, num_attention_heads=16, ffn_hidden_size=4096,
                      vocab_size=8192, max_position_embeddings=512)
    chunks = build_model(cfg, dims, seed=1)
    optimizer, sync = build_optimizer(chunks, dims, TrainingConfig(lr=1e-4, **tflags),
                                      ParallelConfig(zero_stage=1, ddp_bucket_size=bucket))
    state = sum(12 * s.bucket.shard_numel for s in optimizer.shards)
    times, moved = [], 0
    for _ in range(steps + 1):  # the first step warms up
        for s in optimizer.shards:
            s.bucket.grad_shard_view().normal_()
        spill = optimizer.spill
        before = (spill.bytes_read + spill.bytes_written) if spill else 0
        t0 = time.perf_counter()
        optimizer.step(1e-4)
        if spill:
            spill.drain()
        times.append(time.perf_counter() - t0)
        moved = (spill.bytes_read + spill.bytes_written - before) if spill else 0
    per_step = sum(times[1:]) / steps
    held = optimizer.held_bytes()
    if optimizer.spill is not None:
        optimizer.spill.close()
    return per_step, state, (moved / per_step / 1e6 if moved else None), held.get("optimizer_staging_bytes")


def zero3_step_times(layers: int, steps: int, micro_batches: int, param_dir=None) -> tuple:
    """ZeRO-3 training steps on one rank: (seconds per step, file bytes (read, written) per step or
    None, param bytes held, param staging bytes or None)."""
    torch.manual_seed(0)
    dims = ParallelDims.from_world()
    cfg = ModelConfig(num_layers=layers, hidden_size=1024, num_attention_heads=16, ffn_hidden_size=4096,
                      vocab_size=8192, max_position_embeddings=512)
    chunks = build_model(cfg, dims, seed=1)
    optimizer, sync = build_optimizer(chunks, dims, TrainingConfig(lr=1e-4, param_offload_nvme_path=param_dir),
                                      ParallelConfig(zero_stage=3))
    tokens = torch.randint(0, cfg.vocab_size, (micro_batches, 1, 129))
    batches = [{"tokens": t[:, :-1], "labels": t[:, 1:], "loss_mask": torch.ones(1, 128)} for t in tokens]
    spill, times, moved = sync.param_spill, [], None
    for _ in range(steps + 1):  # the first step warms up
        before = (spill.file.bytes_read, spill.file.bytes_written) if spill else None
        t0 = time.perf_counter()
        train_step(chunks, batches, dims, optimizer, sync, 1e-4, gpt_forward_step, loss_normalizer=128.0 * micro_batches)
        if spill:
            spill.drain()
            moved = (spill.file.bytes_read - before[0], spill.file.bytes_written - before[1])
        times.append(time.perf_counter() - t0)
    held = optimizer.held_bytes()
    if spill is not None:
        spill.close()
    return sum(times[1:]) / steps, moved, held["param_bytes"], held.get("param_staging_bytes")


def params_table(args, d: str) -> None:
    rows = [("in memory", None), ("NVMe (--param-offload-nvme-path)", d)]
    results = [(name, *zero3_step_times(args.layers, args.steps, args.micro_batches, where)) for name, where in rows]
    print(f"ZeRO-3 on one rank, GPT h 1024, {args.layers} layers, {args.micro_batches} micro-batches of 1 x 128 "
          f"tokens a step")
    print("| param shards in | step s | file MiB read / written per step | param MiB held | staging MiB |")
    print("|---|---|---|---|---|")
    for name, t, moved, param, staging in results:
        io = f"{moved[0] / 2**20:.0f} / {moved[1] / 2**20:.0f}" if moved else "-"
        print(f"| {name} | {t:.2f} | {io} | {param / 2**20:.0f} | {f'{staging / 2**20:.0f}' if staging else '-'} |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default=None, help="where the NVMe offload file and the dd probe go (default: a temp dir)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--bucket-mib", type=int, default=64, help="bucket size in MiB of fp32 elements")
    ap.add_argument("--params", action="store_true", help="ZeRO-3 parameter offload instead (whole training steps)")
    ap.add_argument("--micro-batches", type=int, default=2, help="--params: micro-batches a step")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        if args.params:
            params_table(args, d)
            return
        bucket = args.bucket_mib * 2**20 // 4
        rows = [("in memory", {}), ("host (--optimizer-cpu-offload)", {"optimizer_cpu_offload": True}),
                ("NVMe (--optimizer-offload-nvme-path)", {"optimizer_offload_nvme_path": d})]
        results = [(name, *step_times(args.layers, bucket, args.steps, **flags)) for name, flags in rows]
        state = results[0][2]
        write, read = dd_bandwidth(d, max(64, state // 2**20 // 4 * 4))
        print(f"optimizer state {state / 2**30:.2f} GiB (fp32 main params, m, v), buckets of {args.bucket_mib} MiB; "
              f"dd: write {write:.0f} MB/s (conv=fdatasync), read {read:.0f} MB/s (iflag=direct)")
        print("| optimizer state in | step s | file MB/s (read + write) | staging MiB | floor: 2 x state / dd s |")
        print("|---|---|---|---|---|")
        floor = state / (write * 1e6) + state / (read * 1e6)
        for name, t, _, rate, staging in results:
            print(f"| {name} | {t:.2f} | {f'{rate:.0f}' if rate else '-'} | "
                  f"{f'{staging / 2**20:.0f}' if staging else '-'} | {f'{floor:.2f}' if rate else '-'} |")


if __name__ == "__main__":
    main()
