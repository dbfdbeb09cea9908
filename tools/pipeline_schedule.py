"""Print a pipeline schedule's timeline, bubble and in-flight micro-batches per rank.

    python tools/pipeline_schedule.py --pp 4 --vpp 2 --microbatches 8 --schedule interleaved
    python -m tools.pipeline_schedule --pp 4 --microbatches 8 --schedule zb-h1 --costs 1,1,1 --png zb.png
    python tools/pipeline_schedule.py --pp 2 --microbatches 8 --pipeline-model-parallel-layout "E|(tt|)*2,L"
    python tools/pipeline_schedule.py --pp 4 --microbatches 8 --schedule all --png t.png   # t-zb-v.png, ...
    python tools/pipeline_schedule.py --pp 4 --microbatches 10 --schedule dualpipe-v --pair-cost 2.5

With --schedule all every schedule that accepts the sizes runs on the same model, each chunk's
costs being --costs / (chunks per rank), so makespans compare: a table, then the timelines.

Invalid arguments print one line on stderr and exit with status 2.
"""
from __future__ import annotations

import argparse
import os
import sys

if __package__ in (None, ""):  # run as a script: make the repo root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_lite.errors import ConfigError  # noqa: E402
from megatron_lite.parallel.pipeline.partition import layout_stage_sizes, parse_layout  # noqa: E402
from megatron_lite.parallel.pipeline.schedules import (  # noqa: E402
    SCHEDULES, build_schedule, default_schedule, schedule_placement, schedule_vpp, validate_schedule_args)
from megatron_lite.parallel.pipeline.placement import StagePlacement  # noqa: E402
from megatron_lite.parallel.pipeline.simulator import (  # noqa: E402
    COMM_MODES, check_schedule, format_timeline, save_png, simulate)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pp", type=int, default=4, help="pipeline-parallel size (ranks)")
    ap.add_argument("--vpp", type=int, default=1, help="model chunks per rank (virtual stages)")
    ap.add_argument("--microbatches", type=int, default=8, help="micro-batches per step")
    ap.add_argument("--schedule", default=None, help=f"one of {', '.join(SCHEDULES)}, or all; default: "
                    "interleaved if --vpp > 1 else 1f1b (zb-v, dualpipe-v: two chunks per rank, V placement)")
    ap.add_argument("--costs", default="1,1,1", help="F,B,W cost of one chunk's action (BW = B + W)")
    ap.add_argument("--pipeline-model-parallel-layout", default=None,
                    help="Megatron-LM's layout string, e.g. 'E|(tt|)*2,L': sets --vpp and weighs each virtual "
                         "stage's costs by its transformer layers over their mean")
    ap.add_argument("--pair-cost", type=float, default=None,
                    help="dualpipe-v: run each backward/forward pair overlapped, costing this (DeepSeek's F&B); "
                         "prints the DualPipeV table's bubble and activations beside the simulated ones")
    ap.add_argument("--comm-cost", type=float, default=0.0, help="time of one p2p transfer")
    ap.add_argument("--comm", default="lazy", choices=COMM_MODES,
                    help="executor model: lazy waits (default), blocking batches, or ideal (no comm)")
    ap.add_argument("--width", type=int, default=None, help="timeline width in characters")
    ap.add_argument("--png", default=None, help="also draw the timeline to this PNG (needs matplotlib)")
    return ap.parse_args(argv)


def _parse_costs(text: str):
    try:
        costs = tuple(float(x) for x in text.split(","))
    except ValueError:
        costs = ()
    if len(costs) != 3 or min(costs) < 0 or costs[0] <= 0 or costs[1] + costs[2] <= 0:
        raise ConfigError(f"--costs {text!r} must be three numbers F,B,W with F > 0, B + W > 0, none negative, "
                          f"e.g. --costs 1,1,1")
    return costs


def _theory(name: str, p: int, m: int, v: int) -> str:
    if name == "interleaved":
        return f"(p-1)/(v*m) = {(p - 1) / (v * m):.4f}"
    if name == "zb-h1":
        return f"(p-1)/(3m) = {(p - 1) / (3 * m):.4f}"
    if name in ("zb-v", "dualpipe-v"):
        return f"(p-1)/(6m) = {(p - 1) / (6 * m):.4f} (reached for m >= 2p - 1; 0 as m grows)"
    return f"(p-1)/m = {(p - 1) / m:.4f}"


def _run(name: str, args, costs, weights=None):
    """(vpp, simulated result) of one schedule; costs per chunk action (times each virtual stage's
    `weights`: its share of the layers under a --pipeline-model-parallel-layout)."""
    vpp = schedule_vpp(name, args.vpp)
    placement = StagePlacement(args.pp, vpp, schedule_placement(name))
    pair_cost = getattr(args, "pair_cost", None) if name == "dualpipe-v" else None
    sched = build_schedule(name, args.pp, args.microbatches, vpp, overlap=pair_cost is not None)
    check_schedule(sched, placement)
    return vpp, simulate(sched, costs=costs, comm_cost=args.comm_cost, comm=args.comm, placement=placement,
                         stage_weights=weights, pair_cost=pair_cost)


def _dualpipe_v_table(args, costs, res) -> str:
    """The DualPipeV row of deepseek-ai/DualPipe's table beside our simulated figures: PP = 2p
    stages, B there = our B + W; bubble = the largest idle time of a rank (makespan - busy)."""
    f, b, w = costs
    table = (args.pp - 1) * (args.pair_cost + b + w - 3 * w)
    idle = max(res.makespan - busy for busy in res.busy)
    note = "" if f <= b and w <= b else "; the table assumes F <= B and W <= B"
    return (f"DualPipeV table (PP = {2 * args.pp} stages): bubble (PP/2-1)(F&B+B-3W) = {table:g} (simulated "
            f"{idle:g}), activations PP+1 = {2 * args.pp + 1} chunks (simulated {max(res.peak_in_flight)}){note}")


def _report(name: str, args, vpp: int, res) -> None:
    print(f"schedule {name} | pp {args.pp} | vpp {vpp} | micro-batches {args.microbatches} | "
          f"costs F,B,W = {args.costs} | comm {args.comm} ({args.comm_cost:g}) | makespan {res.makespan:g}")
    print(format_timeline(res, args.width))
    print(f"bubble = idle / busy per rank; theory with unit costs: {_theory(name, args.pp, args.microbatches, vpp)}")
    unit = " (micro-batch x chunk; /vpp = micro-batches of activations)" if vpp > 1 else ""
    print(f"{'rank':>4}  {'bubble':>7}  {'busy':>7}  peak in-flight{unit}")
    for r in range(args.pp):
        extra = f"  ({res.peak_in_flight[r] / vpp:g})" if vpp > 1 else ""
        print(f"{r:>4}  {res.bubble[r]:>7.4f}  {res.busy[r]:>7g}  {res.peak_in_flight[r]}{extra}")


def _png(res, path: str, title: str) -> bool:
    try:
        save_png(res, path, title=title)
    except ImportError:
        print("error: --png needs matplotlib (pip install matplotlib)", file=sys.stderr)
        return False
    print(f"wrote {path}")
    return True


def _compare(args, costs) -> int:
    """Every schedule the sizes allow, on the same model: a chunk of v per rank costs 1/v."""
    rows, runs = [], []
    for name in SCHEDULES:
        vpp = schedule_vpp(name, args.vpp if name == "interleaved" and args.vpp > 1 else
                          2 if name == "interleaved" else None)
        try:
            validate_schedule_args(name, args.pp, args.microbatches, vpp)
        except ConfigError as e:
            print(f"skipped {name}: {e}")
            continue
        args_v = argparse.Namespace(**{**vars(args), "vpp": vpp})
        _, res = _run(name, args_v, tuple(c / vpp for c in costs))
        rows.append((name, vpp, res))
        runs.append((name, args_v, vpp, res))
    print(f"pp {args.pp} | micro-batches {args.microbatches} | costs F,B,W of a whole stage = {args.costs}")
    print(f"{'schedule':<12} {'vpp':>3}  {'makespan':>9}  {'max bubble':>10}  peak activations (stages)")
    for name, vpp, res in rows:
        print(f"{name:<12} {vpp:>3}  {res.makespan:>9.4g}  {max(res.bubble):>10.4f}  {max(res.peak_in_flight) / vpp:g}")
    for name, args_v, vpp, res in runs:
        print()
        _report(name, args_v, vpp, res)
        if args.png:
            root, ext = os.path.splitext(args.png)
            if not _png(res, f"{root}-{name}{ext or '.png'}", f"{name} p={args.pp} v={vpp} m={args.microbatches}"):
                return 1
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    weights = None
    try:
        if args.pipeline_model_parallel_layout is not None:
            layout = args.pipeline_model_parallel_layout
            sizes = layout_stage_sizes(layout, sum(st.count("t") for st in parse_layout(layout)), args.pp)
            args.vpp = len(sizes) // args.pp
            weights = [n * len(sizes) / sum(sizes) for n in sizes]
        name = args.schedule or default_schedule(args.vpp)
        if name != "all":
            validate_schedule_args(name, args.pp, args.microbatches, args.vpp)
        costs = _parse_costs(args.costs)
        if args.pair_cost is not None and (name != "dualpipe-v" or not args.pair_cost > 0):
            raise ConfigError(f"--pair-cost ({args.pair_cost:g}) is the time of an overlapped dualpipe-v pair: "
                              f"use it with --schedule dualpipe-v and a value > 0")
        if args.width is not None and args.width < 1:
            raise ConfigError(f"--width ({args.width}) must be >= 1")
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if name == "all":
        return _compare(args, costs)
    vpp, res = _run(name, args, costs, weights)
    _report(name, args, vpp, res)
    if args.pair_cost is not None:
        print(_dualpipe_v_table(args, costs, res))
    if args.png and not _png(res, args.png, f"{name} p={args.pp} v={vpp} m={args.microbatches}"):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
