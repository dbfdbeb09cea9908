"""Draw a run's curves or a plan's memory as PNG files (matplotlib, Agg backend).

    python tools/plot.py --metrics-file run1.jsonl --metrics-file run2.jsonl --out curves.png
    python tools/plan.py --model llama3-8b --bf16 --pipeline-model-parallel-size 2 --world-size 8 --json > plan.json
    python tools/plot.py --plan plan.json --out memory.png

--metrics-file (the trainer's JSON Lines, repeatable): loss, grad norm and throughput against the
iteration, one line per run with a legend. --plan (tools/plan.py --json output, or `-` for stdin):
a stacked bar per pipeline rank of parameters, gradients, optimizer state, activations and buffers.
Invalid arguments print one line on stderr and exit with status 2.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Dict, List, Optional, Tuple

CURVES = (("lm_loss", "lm loss"), ("grad_norm", "grad norm"), ("tokens_per_sec", "tokens/s"))
MEMORY = (("param_bytes", "parameters"), ("grad_bytes", "gradients"), ("optimizer_state_bytes", "optimizer state"),
          ("activation_bytes", "activations"))
# on the device where those features are on (bucket_plan.kept_bytes; planning/search.KEPT_ON_DEVICE)
KEPT = (("error_feedback_bytes", "error feedback"), ("hpz_secondary_bytes", "hpZ secondary partition"))
FIGSIZE, DPI = (8.0, 6.0), 100  # the PNG is FIGSIZE * DPI pixels


class PlotError(ValueError):
    pass


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def read_metrics(path: str) -> List[dict]:
    try:
        with open(path) as f:
            rows = [json.loads(line) for line in f if line.strip()]
    except OSError as e:
        raise PlotError(f"--metrics-file {path}: {e.strerror}; pass the file a run wrote with --metrics-file")
    except json.JSONDecodeError as e:
        raise PlotError(f"--metrics-file {path} is not JSON Lines ({e.msg}, line {e.lineno}); pass a trainer's "
                        f"--metrics-file")
    rows = [r for r in rows if "iteration" in r]
    if not rows:
        raise PlotError(f"--metrics-file {path} has no iterations; pass a trainer's --metrics-file")
    return rows


def plot_metrics(paths: List[str], out: str, labels: Optional[List[str]] = None
                 ) -> Dict[str, Dict[str, Tuple[List[float], List[float]]]]:
    """One panel per curve, one line per run; returns {label: {metric: (iterations, values)}} as drawn."""
    labels = labels or [os.path.basename(p) for p in paths]
    drawn = {}
    for path, label in zip(paths, labels):
        rows = read_metrics(path)
        drawn[label] = {key: ([r["iteration"] for r in rows if r.get(key) is not None],
                              [r[key] for r in rows if r.get(key) is not None]) for key, _ in CURVES}
    plt = _pyplot()
    fig, axes = plt.subplots(len(CURVES), 1, figsize=FIGSIZE, sharex=True)
    for ax, (key, title) in zip(axes, CURVES):
        for label, series in drawn.items():
            ax.plot(*series[key], label=label, marker="." if len(series[key][0]) < 50 else None)
        ax.set_ylabel(title)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    axes[-1].set_xlabel("iteration")
    fig.tight_layout()
    fig.savefig(out, dpi=DPI)
    plt.close(fig)
    return drawn


def plot_plan(plan: dict, out: str) -> Dict[str, List[float]]:
    """Stacked bar per pipeline rank of tools/plan.py --json's per-rank bytes; returns {component: GiB per rank}."""
    ev = plan.get("plan") or (plan.get("ranked") or [None])[0]
    if not ev or "ranks" not in ev:
        raise PlotError("--plan has no per-rank plan (the layout is refused or nothing fits); pass tools/plan.py "
                        "--json output of a valid layout")
    ranks = ev["ranks"]
    parts = {title: [r[key] / 2**30 for r in ranks] for key, title in MEMORY}
    parts.update({title: [r.get(key, 0) / 2**30 for r in ranks] for key, title in KEPT
                  if any(r.get(key) for r in ranks)})
    for name in sorted({k for r in ranks for k in r["buffers"]}):
        parts[f"{name.replace('_', ' ')} buffers"] = [r["buffers"].get(name, 0) / 2**30 for r in ranks]
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=FIGSIZE)
    x = [f"pp rank {r['pp_rank']}" for r in ranks]
    bottom = [0.0] * len(ranks)
    for title, gib in parts.items():
        ax.bar(x, gib, bottom=bottom, label=title)
        bottom = [b + g for b, g in zip(bottom, gib)]
    if ev.get("usable_bytes"):
        ax.axhline(ev["usable_bytes"] / 2**30, color="black", linestyle="--", label="usable memory")
    ax.set_ylabel("GiB per GPU")
    ax.set_title(f"{plan.get('model', '')}: {ev.get('layout', '')}", fontsize=8)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(out, dpi=DPI)
    plt.close(fig)
    return parts


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--metrics-file", action="append", default=[],
                    help="a run's metrics (JSON Lines); repeat to overlay")
    ap.add_argument("--label", action="append", default=None, help="legend name of each --metrics-file, in order")
    ap.add_argument("--plan", default=None, help="tools/plan.py --json output (a file, or - for stdin)")
    ap.add_argument("--out", required=True, help="PNG file to write")
    args = ap.parse_args(argv)
    try:
        if bool(args.metrics_file) == bool(args.plan):
            raise PlotError("pass either --metrics-file (one or more) or --plan")
        if args.label and len(args.label) != len(args.metrics_file):
            raise PlotError(f"{len(args.label)} --label for {len(args.metrics_file)} --metrics-file; give one each")
        if args.plan:
            try:
                with (sys.stdin if args.plan == "-" else open(args.plan)) as f:
                    plan = json.load(f)
            except (OSError, json.JSONDecodeError) as e:
                raise PlotError(f"--plan {args.plan}: {e}; pass the output of tools/plan.py --json")
            plot_plan(plan, args.out)
        else:
            plot_metrics(args.metrics_file, args.out, args.label)
    except PlotError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except ImportError:
        print("error: plotting needs matplotlib (pip install matplotlib)", file=sys.stderr)
        return 1
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
