"""Convergence of compressed communication on the built-in corpus: llama-tiny at DP2 for --iters
iterations, uncompressed (the baseline, ZeRO-1), with each --grad-comm-dtype (ZeRO-1, error
feedback on), with 1-bit Adam (ZeRO 0, --freeze-step warm-up), 0/1 Adam (ZeRO 0,
--var-freeze-step) and with ZeRO++'s quantized weights / gradients (ZeRO-3, qgZ with and without
error feedback; hpZ changes no value), same seed (--seed: another for every scheme) and data. DP
bytes: the reduction's and the parameter all-gather's (counted buffers). The global batch is 4
whatever --dp (micro-batches of 4 / dp: the same data); at --dp 4 "qgZ 2-hop" reduces the int4
gradients in nodes of 2 (hpZ's partition): its cross-node bytes are reported apart.

Writes OUT/<scheme>.jsonl, OUT/summary.json, a Markdown table on stdout (final loss = mean of
the last --tail iterations, and its difference from the baseline; gradient bytes per step from
--log-comm-volume) and the curves with tools/plot.py (--plot).

    python benchmarks/compression_convergence.py --out-dir /tmp/compression_convergence \
        --plot benchmarks/compression_convergence.png
"""
import argparse
import json
import os
import subprocess
import sys

from fp8_convergence import add_study_args, plot_curves  # (this directory: the script's own)

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir))
GLOBAL_BATCH = 4
SHAPE = ["--model", "llama-tiny", "--seq-length", "64", "--global-batch-size", str(GLOBAL_BATCH),
         "--eval-iters", "0", "--log-interval", "50", "--device", "cpu", "--log-comm-volume"]
ZERO1 = ["--zero-stage", "1"]
SCHEMES = {"fp32": ZERO1, "bf16": ZERO1 + ["--grad-comm-dtype", "bf16"],
           "fp8-e4m3": ZERO1 + ["--grad-comm-dtype", "fp8-e4m3"], "fp8-e5m2": ZERO1 + ["--grad-comm-dtype", "fp8-e5m2"],
           "adam-1bit": ["--optimizer", "adam-1bit"],  # (ZeRO 0, as DeepSpeed's; --freeze-step from the flag)
           "adam-01": ["--optimizer", "adam-01"],  # (ZeRO 0; --var-freeze-step from the flag)
           "qwZ ZeRO-3": ["--zero-stage", "3", "--zeropp-quantized-weights"],
           "qwZ+qgZ ZeRO-3": ["--zero-stage", "3", "--zeropp-quantized-weights", "--zeropp-quantized-gradients",
                              "--zeropp-qgz-error-feedback"],
           # ("qgZ": with error feedback, as these studies ran it; "no-EF": the default, DeepSpeed's qgZ)
           "qgZ ZeRO-3": ["--zero-stage", "3", "--zeropp-quantized-gradients", "--zeropp-qgz-error-feedback"],
           # (nodes of 2 DP ranks: two hops at --dp 4, one at --dp 2)
           "qgZ 2-hop ZeRO-3": ["--zero-stage", "3", "--zeropp-quantized-gradients", "--zeropp-qgz-error-feedback",
                                "--zeropp-hpz-partition-size", "2"],
           "qgZ no-EF ZeRO-3": ["--zero-stage", "3", "--zeropp-quantized-gradients"],
           "qgZ 2-hop no-EF ZeRO-3": ["--zero-stage", "3", "--zeropp-quantized-gradients",
                                      "--zeropp-hpz-partition-size", "2"]}
INTER_NODE = "all_to_all_inter_node"


def run(scheme, args):
    metrics = os.path.join(args.out_dir, f"{scheme}.jsonl")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.dp}",
           os.path.join(ROOT, "pretrain_gpt.py"), *SHAPE, *SCHEMES[scheme], "--train-iters", str(args.iters),
           "--micro-batch-size", str(GLOBAL_BATCH // args.dp),
           *(["--seed", str(args.seed)] if args.seed is not None else []), "--metrics-file", metrics]
    if scheme == "adam-1bit":
        cmd += ["--freeze-step", str(args.freeze_step)]
    if scheme == "adam-01":
        cmd += ["--var-freeze-step", str(args.var_freeze_step)]
    if not (args.reuse and os.path.exists(metrics) and len(_records(metrics)) == args.iters):
        subprocess.run(cmd, check=True, env=dict(os.environ, OMP_NUM_THREADS="1"), cwd=args.out_dir,
                       stdout=subprocess.DEVNULL)
    return scheme, metrics


def _records(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--schemes", default=",".join(SCHEMES))
    ap.add_argument("--freeze-step", type=int, default=100, help="1-bit Adam's warm-up (a third of the default run)")
    ap.add_argument("--var-freeze-step", type=int, default=100,
                    help="0/1 Adam's last variance step (DeepSpeed: the end of the LR warm-up; this study has none, "
                         "LR decays from iteration 1: a third of the run, as --freeze-step)")
    ap.add_argument("--seed", type=int, default=None, help="pretrain_gpt's --seed for every run (default: its own)")
    add_study_args(ap)
    args = ap.parse_args()
    if GLOBAL_BATCH % args.dp:
        ap.error(f"--dp {args.dp} must divide the global batch ({GLOBAL_BATCH})")
    os.makedirs(args.out_dir, exist_ok=True)
    done = [run(s, args) for s in args.schemes.split(",")]  # one at a time: DP ranks already fill the cores
    summary, base = {}, None
    print(f"llama-tiny, DP{args.dp}, {args.iters} iterations (1-bit Adam: freeze step {args.freeze_step}; 0/1 Adam: "
          f"var freeze step {args.var_freeze_step}), final "
          f"loss = mean of the last {args.tail}; bytes of the last step\n")
    print("| scheme | first loss | final loss | vs fp32 | DP bytes / step (counted) | median step s |")
    print("|---|---|---|---|---|---|")
    for scheme, path in done:
        recs = _records(path)
        losses = [r["lm_loss"] for r in recs]
        final = sum(losses[-args.tail:]) / len(losses[-args.tail:])
        base = final if base is None else base
        comm = recs[-1].get("comm_bytes", {})
        grad_bytes = sum(comm.get(k, 0) for k in ("reduce_scatter", "all_to_all", "all_gather",
                                                  "all_to_all_intra_node", INTER_NODE, "all_gather_hpz"))
        if scheme in ("adam-1bit", "adam-01"):  # (ZeRO 0: the compressed all-reduce's two halves, or the plain all-reduce)
            grad_bytes = grad_bytes or comm.get("all_reduce", 0)
        step = sorted(r["step_time_s"] for r in recs)[len(recs) // 2]
        summary[scheme] = dict(first=losses[0], final=final, rel=(final - base) / base, grad_bytes=grad_bytes,
                               inter_node_bytes=comm.get(INTER_NODE), median_step_s=step, metrics=path)
        print(f"| {scheme} | {losses[0]:.4f} | {final:.4f} | {100 * (final - base) / base:+.2f} % | "
              f"{grad_bytes:,}{f' (inter-node all-to-all {comm[INTER_NODE]:,})' if INTER_NODE in comm else ''} | "
              f"{step:.3f} |")
    with open(os.path.join(args.out_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    if args.plot:
        plot_curves(args.plot, [(path, scheme) for scheme, path in done])


if __name__ == "__main__":
    main()
