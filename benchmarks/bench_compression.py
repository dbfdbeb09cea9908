"""Bytes and step time of each compressed-communication scheme at DP4 on the CPU (gloo).

One torchrun per scheme (pretrain_gpt.py, --log-comm-volume, --metrics-file): plain fp32
reduction (ZeRO-1 and ZeRO 0), --grad-comm-dtype bf16 / fp8-e4m3 / fp8-e5m2 (ZeRO-1), 1-bit
Adam (ZeRO 0) after its --freeze-step warm-up, 0/1 Adam (ZeRO 0) after --var-freeze-step (its
default every-step synchronisation: 1-bit Adam's bytes), and ZeRO-3 plain and with ZeRO++'s qwZ,
qwZ+qgZ and hpZ (its intra-group gathers counted apart: what stays inside a node), and qgZ in one hop
and in two (nodes of --node-size DP ranks, hpZ's partition: an intra-node then an inter-node
all-to-all, counted apart). Prints a Markdown
table: the bytes of the last iteration by collective kind (the counter's convention: the full
logical buffer per rank), the data-parallel gradient / momentum bytes against the fp32 reduction
of the same ZeRO stage, and the median step time over the iterations after --skip (1-bit Adam:
after its freeze). The ratios compare bytes on the wire per rank (a ring all-reduce moves twice
what a reduce-scatter does, which the counter, counting buffers, does not show); and the qgZ
all-to-all bytes that leave a rank's node (its rows for ranks of other nodes).

    python benchmarks/bench_compression.py --out-dir /tmp/bench_compression
"""
import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir))
# ZeRO-3: parameter gathers and gradient reduction (hpZ's intra-group gathers last: left out of its cross-group bytes)
ZERO3 = ("all_gather", "reduce_scatter", "all_to_all", "all_gather_hpz")
SCHEMES = {  # name: (flags, ZeRO stage of the fp32 reference, the collectives that carry the DP reduction)
    "fp32 ZeRO-1": (["--zero-stage", "1"], "fp32 ZeRO-1", ("reduce_scatter",)),
    "bf16 ZeRO-1": (["--zero-stage", "1", "--grad-comm-dtype", "bf16"], "fp32 ZeRO-1", ("all_to_all",)),
    "fp8-e4m3 ZeRO-1": (["--zero-stage", "1", "--grad-comm-dtype", "fp8-e4m3"], "fp32 ZeRO-1", ("all_to_all",)),
    "fp8-e5m2 ZeRO-1": (["--zero-stage", "1", "--grad-comm-dtype", "fp8-e5m2"], "fp32 ZeRO-1", ("all_to_all",)),
    "fp32 ZeRO-0": ([], "fp32 ZeRO-0", ("all_reduce",)),
    "fp8-e4m3 ZeRO-0": (["--grad-comm-dtype", "fp8-e4m3"], "fp32 ZeRO-0", ("all_to_all", "all_gather")),
    "adam-1bit ZeRO-0": (["--optimizer", "adam-1bit"], "fp32 ZeRO-0", ("all_to_all", "all_gather")),
    "adam-01 ZeRO-0": (["--optimizer", "adam-01"], "fp32 ZeRO-0", ("all_to_all", "all_gather")),
    "adam-01 H4 ZeRO-0": (["--optimizer", "adam-01", "--local-step-scaler", "1", "--local-step-clipper", "4"],
                          "fp32 ZeRO-0", ("all_to_all", "all_gather")),  # (syncs every 1, 2, then 4 local steps)
    "fp32 ZeRO-3": (["--zero-stage", "3"], "fp32 ZeRO-3", ZERO3),
    "qwZ ZeRO-3": (["--zero-stage", "3", "--zeropp-quantized-weights"], "fp32 ZeRO-3", ZERO3),
    "qwZ+qgZ ZeRO-3": (["--zero-stage", "3", "--zeropp-quantized-weights", "--zeropp-quantized-gradients"],
                       "fp32 ZeRO-3", ZERO3),
    "hpZ 2 ZeRO-3": (["--zero-stage", "3", "--zeropp-hpz-partition-size", "2"], "fp32 ZeRO-3", ZERO3[:-1]),
    "qgZ ZeRO-3": (["--zero-stage", "3", "--zeropp-quantized-gradients"], "fp32 ZeRO-3", ZERO3),
    # (nodes of --node-size: hpZ's partition; its intra-node gathers and all-to-all left out, as hpZ's)
    "qgZ 2-hop ZeRO-3": (["--zero-stage", "3", "--zeropp-quantized-gradients", "--zeropp-hpz-partition-size", "NODE"],
                         "fp32 ZeRO-3", ("all_gather", "all_to_all_inter_node")),
}
INTRA, INTER = "all_to_all_intra_node", "all_to_all_inter_node"


def run(name, args):
    metrics = os.path.join(args.out_dir, name.replace(" ", "_") + ".jsonl")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.dp}",
           os.path.join(ROOT, "pretrain_gpt.py"), "--model", args.model, "--seq-length", str(args.seq_length),
           "--micro-batch-size", "1", "--global-batch-size", str(args.dp), "--train-iters", str(args.iters),
           "--eval-iters", "0", "--device", "cpu", "--log-comm-volume",
           "--log-interval", str(args.iters), "--metrics-file", metrics,
           *(str(args.node_size) if f == "NODE" else f for f in SCHEMES[name][0])]
    if "--optimizer" in SCHEMES[name][0]:  # (1-bit / 0/1 Adam: compressed from iteration --skip + 1 on)
        cmd += ["--freeze-step" if "adam-1bit" in SCHEMES[name][0] else "--var-freeze-step", str(args.skip)]
    if not (args.reuse and os.path.exists(metrics)):
        if os.path.exists(metrics):
            os.remove(metrics)
        subprocess.run(cmd, check=True, env=dict(os.environ, OMP_NUM_THREADS="1"), cwd=args.out_dir,
                       stdout=subprocess.DEVNULL)
    with open(metrics) as f:
        return [json.loads(line) for line in f if line.strip()]


def wire_bytes(comm, kinds, ranks, node) -> float:
    """What the counted collectives move per rank on a ring: (N-1)/N of each buffer (N: the
    collective's group: a node's ranks, one per node or the DP group), twice for an all-reduce (a
    reduce-scatter, then an all-gather)."""
    group = {INTRA: node, INTER: ranks // node}
    return sum((group.get(k, ranks) - 1) / group.get(k, ranks) * comm.get(k, 0) * (2 if k == "all_reduce" else 1)
               for k in kinds)


def cross_node_bytes(comm, ranks, node) -> float:
    """qgZ's all-to-all bytes per rank bound for other nodes: one hop sends (N - node) of its N rows
    off the node, two hops (nodes - 1) of the inter-node all-to-all's `nodes` rows (none intra)."""
    nodes = ranks // node
    return comm.get("all_to_all", 0) * (ranks - node) / ranks + comm.get(INTER, 0) * (nodes - 1) / nodes


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="llama-20m")
    ap.add_argument("--seq-length", type=int, default=64)
    ap.add_argument("--dp", type=int, default=4)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--node-size", type=int, default=2, help="DP ranks per node for the qgZ rows")
    ap.add_argument("--skip", type=int, default=4, help="iterations left out of the step time (1-bit Adam's freeze)")
    ap.add_argument("--schemes", default=",".join(SCHEMES))
    ap.add_argument("--out-dir", required=True)
    ap.add_argument("--reuse", action="store_true", help="keep the metrics files already in --out-dir")
    args = ap.parse_args()
    os.makedirs(args.out_dir, exist_ok=True)
    results = {name: run(name, args) for name in args.schemes.split(",")}
    print(f"{args.model}, seq {args.seq_length}, DP{args.dp} on the CPU (gloo), {args.iters} iterations; bytes of the "
          f"last one; median step over iterations {args.skip + 1}-{args.iters}\n")
    print("| scheme | DP reduction bytes / step (counted) | on the wire per rank | vs fp32 "
          "| qgZ bytes leaving the node / rank | all bytes by kind (counted) | median step s | vs fp32 |")
    print("|---|---|---|---|---|---|---|---|")
    summary = {}
    for name, recs in results.items():
        _, ref, kinds = SCHEMES[name]
        comm = recs[-1]["comm_bytes"]
        steps = sorted(r["step_time_s"] for r in recs[args.skip:])
        summary[name] = dict(dp_bytes=sum(comm.get(k, 0) for k in kinds),
                             wire=wire_bytes(comm, kinds, args.dp, args.node_size),
                             cross_node=cross_node_bytes(comm, args.dp, args.node_size), comm=comm,
                             step=steps[len(steps) // 2])
    for name, row in summary.items():
        base = summary.get(SCHEMES[name][1], row)
        kinds = ", ".join(f"{k} {v:,}" for k, v in sorted(row["comm"].items()))
        cross = f"{row['cross_node']:,.0f}" if row["cross_node"] and "qgZ" in name else "-"
        print(f"| {name} | {row['dp_bytes']:,} | {row['wire']:,.0f} | {row['wire'] / base['wire']:.3f} | {cross} | "
              f"{kinds} | {row['step']:.3f} | {row['step'] / base['step']:.2f}x |")
    with open(os.path.join(args.out_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()
