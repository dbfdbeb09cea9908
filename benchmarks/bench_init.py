"""Model build time and peak memory per rank: tiled meta-device init (now) vs full-tensor init
(before: `models/gpt.py:init_weights` of commit 328de15, which drew every FULL tensor on the CPU
and kept this rank's slice).

Each measurement runs in a fresh process (`--child`) that builds one rank's model of a named
shape with its layers cut to `--layers`, in bf16, as TP rank `--rank`: the peak resident set
(VmHWM, reset through /proc/self/clear_refs after imports) minus the resident set before the
build, against the bytes of the rank's parameters.

    python benchmarks/bench_init.py                      # llama3-8b and llama3-70b, TP 1/2/4/8, both
    python benchmarks/bench_init.py --models llama3-8b --tps 8
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BEFORE_COMMIT = "328de15"  # the last commit with the full-tensor init_weights


def _status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise KeyError(key)


def _legacy_init_weights():
    """The full-tensor init_weights of BEFORE_COMMIT, taken from git (not kept in the tree)."""
    src = subprocess.run(["git", "-C", ROOT, "show", f"{BEFORE_COMMIT}:models/gpt.py"], capture_output=True,
                         text=True, check=True).stdout
    start = src.index("def _param_seed")
    end = src.index("def build_model")
    ns = {}
    exec("import math, zlib, torch\nfrom megatron_lite.parallel.sharding import spec_of, stored_name\n"
         + src[start:end], ns)
    return ns["init_weights"]


def child(args) -> dict:
    import torch

    from megatron_lite.config import ModelConfig
    from megatron_lite.parallel.state import ParallelDims
    from megatron_lite.transformer.spec import BuildContext
    from models.gpt import GPTModel, build_model
    from models.zoo import get_model_config

    torch.set_num_threads(1)
    kw = get_model_config(args.model)
    kw.pop("seq_length", None)
    kw["num_layers"] = args.layers
    cfg = ModelConfig(**kw)
    dims = ParallelDims(tp=args.tp, rank=args.rank)  # a rank of the layout, no process group
    legacy = _legacy_init_weights() if args.before else None
    torch.empty(1).normal_()  # warm the allocator and RNG before the baseline
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current resident set
    base = _status_kib("VmRSS")
    start = time.perf_counter()
    if args.before:
        model = GPTModel(cfg, BuildContext(dims, params_dtype=torch.bfloat16))
        legacy(model, 1234)
    else:
        model = build_model(cfg, dims, seed=1234, params_dtype=torch.bfloat16)[0]
    build_s = time.perf_counter() - start
    shard = sum(p.numel() * p.element_size() for p in model.parameters())
    peak = _status_kib("VmHWM")
    return {"model": args.model, "layers": args.layers, "tp": args.tp, "rank": args.rank,
            "mode": "before" if args.before else "after", "build_s": build_s, "shard_bytes": shard,
            "peak_growth_bytes": (peak - base) * 1024}


def run_child(model: str, tp: int, rank: int, layers: int, before: bool) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--model", model, "--tp", str(tp), "--rank",
           str(rank), "--layers", str(layers)] + (["--before"] if before else [])
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, env=dict(os.environ, PYTHONPATH=ROOT))
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--before", action="store_true", help="child: the full-tensor init of " + BEFORE_COMMIT)
    p.add_argument("--model", default="llama3-70b")
    p.add_argument("--tp", type=int, default=8)
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--models", nargs="+", default=["llama3-8b", "llama3-70b"])
    p.add_argument("--tps", nargs="+", type=int, default=[1, 2, 4, 8])
    p.add_argument("--modes", nargs="+", default=["before", "after"], choices=["before", "after"])
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return
    print(f"| model ({args.layers} layers, bf16) | TP | rank shard MiB | before: build s | before: peak MiB | "
          f"before: peak / shard | after: build s | after: peak MiB | after: peak / shard |")
    print("|---|---|---|---|---|---|---|---|---|")
    for model in args.models:
        for tp in args.tps:
            rank = tp - 1  # the last TP rank: the vocabulary padding lies there
            res = {m: run_child(model, tp, rank, args.layers, m == "before") for m in args.modes}
            shard = next(iter(res.values()))["shard_bytes"]
            cells = []
            for m in ("before", "after"):
                r = res.get(m)
                cells += ["-"] * 3 if r is None else [f"{r['build_s']:.2f}", f"{r['peak_growth_bytes'] / 2**20:.0f}",
                                                      f"{r['peak_growth_bytes'] / shard:.2f}"]
            print(f"| {model} | {tp} | {shard / 2**20:.0f} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    sys.path.insert(0, ROOT)
    main()
