"""FP8 convergence study on the built-in corpus: a small Llama (llama-tiny) and a small MoE
(mixtral-tiny) trained for --iters iterations with fp32 GEMMs (the baseline) and with each FP8
recipe (hybrid format: e4m3 forward, e5m2 gradients), same seed and data. fp32 master weights
throughout: on this CPU bf16 autocast is slower than fp32, so the baseline is fp32, not bf16.

Writes one metrics file per run (OUT/<model>-<precision>.jsonl), OUT/summary.json, a Markdown
table on stdout (final loss = mean of the last --tail iterations, and its difference from the
baseline) and the curves with tools/plot.py (--plot).

    python benchmarks/fp8_convergence.py --out-dir /tmp/fp8_convergence --plot benchmarks/fp8_convergence.png
"""
import argparse
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir))
MODELS = {"llama": "llama-tiny", "moe": "mixtral-tiny"}
SHAPE = ["--seq-length", "64", "--micro-batch-size", "4", "--global-batch-size", "4", "--eval-iters", "0",
         "--log-interval", "50", "--device", "cpu"]


def run(model, precision, args):
    metrics = os.path.join(args.out_dir, f"{model}-{precision}.jsonl")
    fp8 = [] if precision == "fp32" else ["--fp8-format", "hybrid", "--fp8-recipe", precision]
    cmd = [sys.executable, os.path.join(ROOT, "pretrain_gpt.py"), "--model", MODELS[model], *SHAPE,
           "--train-iters", str(args.iters), "--metrics-file", metrics, *fp8]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if not (args.reuse and os.path.exists(metrics) and len(_losses(metrics)) == args.iters):
        subprocess.run(cmd, check=True, env=env, cwd=args.out_dir, stdout=subprocess.DEVNULL)
    return model, precision, metrics


def _losses(path):
    with open(path) as f:
        return [json.loads(line)["lm_loss"] for line in f if line.strip()]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--models", default="llama,moe")
    ap.add_argument("--recipes", default="tensorwise,rowwise,delayed,blockwise", help="FP8 recipes, comma-separated")
    ap.add_argument("--tail", type=int, default=20, help="final loss: the mean over this many last iterations")
    ap.add_argument("--jobs", type=int, default=2, help="runs at the same time")
    add_study_args(ap)
    args = ap.parse_args()
    os.makedirs(args.out_dir, exist_ok=True)
    models, precisions = args.models.split(","), ["fp32"] + args.recipes.split(",")
    with ThreadPoolExecutor(args.jobs) as pool:
        done = list(pool.map(lambda mp: run(*mp, args), [(m, p) for m in models for p in precisions]))
    summary = {}
    print(f"{args.iters} iterations, final loss = mean of the last {args.tail}\n")
    print("| model | GEMMs | first loss | final loss | vs fp32 |")
    print("|---|---|---|---|---|")
    for model, precision, path in done:
        losses = _losses(path)
        final = sum(losses[-args.tail:]) / len(losses[-args.tail:])
        base = summary.get((model, "fp32"), {}).get("final", final)
        summary[(model, precision)] = dict(first=losses[0], final=final, last=losses[-1],
                                           rel=(final - base) / base, metrics=path)
        print(f"| {MODELS[model]} | {precision if precision == 'fp32' else 'FP8 ' + precision} | {losses[0]:.4f} | "
              f"{final:.4f} | {100 * (final - base) / base:+.2f} % |")
    with open(os.path.join(args.out_dir, "summary.json"), "w") as f:
        json.dump({f"{m}-{p}": v for (m, p), v in summary.items()}, f, indent=1)
    if args.plot:
        plot_curves(args.plot, [(path, f"{MODELS[model]} {precision}") for model, precision, path in done])


def add_study_args(ap) -> None:
    """The flags every convergence study here takes (compression_convergence.py too)."""
    ap.add_argument("--tail", type=int, default=20, help="final loss: the mean over this many last iterations")
    ap.add_argument("--out-dir", required=True)
    ap.add_argument("--reuse", action="store_true", help="keep a run whose metrics file is complete")
    ap.add_argument("--plot", default=None, help="PNG of the curves (tools/plot.py)")


def plot_curves(out, runs) -> None:
    """tools/plot.py of (metrics file, label) pairs into the PNG `out`."""
    cmd = [sys.executable, os.path.join(ROOT, "tools", "plot.py"), "--out", out]
    for path, label in runs:
        cmd += ["--metrics-file", path, "--label", label]
    subprocess.run(cmd, check=True)


if __name__ == "__main__":
    main()
